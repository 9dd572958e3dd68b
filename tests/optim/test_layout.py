"""Flattening: alignment, shapes, memory formats, values, 0-d state, where gradients land, re-fusing."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from optimutil import assert_bitwise, make_grads, make_params, require_kernel, set_grads, twin

from trainloom.optim import (
    FuseError,
    calculate_mutual_groups,
    flat_buffers,
    fuse_optimizer,
    fuse_step,
    is_fused_optimizer,
)


def _in(t: torch.Tensor, flat: torch.Tensor) -> bool:
    lo = flat.data_ptr()
    hi = lo + flat.numel() * flat.element_size()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi


def test_params_become_aligned_views_keeping_shape_strides_and_values():
    params = make_params()
    before = [(p.shape, p.stride(), p.detach().clone()) for p in params]
    opt = fuse_optimizer(torch.optim.SGD(params, lr=0.1))
    assert is_fused_optimizer(opt)
    (flat,) = flat_buffers(opt, "param")
    for i, (p, (shape, stride, value)) in enumerate(zip(params, before)):
        assert _in(p, flat)
        assert p.data_ptr() % 64 == 0  # every view starts on a cache line
        assert p.shape == shape
        assert torch.equal(p.detach(), value)
        if i != 4:  # the slice with gaps becomes dense; everything else keeps its strides
            assert p.stride() == stride
    assert params[4].is_contiguous() and before[4][1] == (8, 2)
    conv = params[2]
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert params[3].stride() == (1, 5)  # the transposed parameter is still transposed


def test_one_buffer_per_group_and_dtype_and_zero_d_step_never_flattened():
    p32 = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 3))]
    p64 = [torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
    scalar = torch.nn.Parameter(torch.tensor(1.5))  # a 0-d parameter stays as it is
    opt = fuse_optimizer(torch.optim.Adam([{"params": p32 + p64}, {"params": [scalar], "lr": 0.1}], lr=1e-2))
    grads = flat_buffers(opt, "grad")
    assert sorted(str(g.dtype) for g in grads) == ["torch.float32", "torch.float64"]
    for p in p32 + p64 + [scalar]:
        p.grad = torch.ones_like(p)
    for _ in range(3):
        opt.fuse_step()
    for p in p32 + p64:
        st = opt.state[p]
        assert st["step"].dim() == 0 and float(st["step"]) == 3.0
        assert not any(_in(st["step"], f) for f in flat_buffers(opt, "param") + grads)
        assert any(_in(st["exp_avg"], f) for f in opt._trainloom_fused.buckets[0].state_flat.values()) or any(
            _in(st["exp_avg"], f) for b in opt._trainloom_fused.buckets for f in b.state_flat.values()
        )
    assert float(opt.state[scalar]["step"]) == 3.0 and scalar.dim() == 0


def test_grads_land_in_flat_buffer_after_zero_grad_and_backward():
    require_kernel("adam", "fused")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    ref.load_state_dict(model.state_dict())
    opt = fuse_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2, fused=True))
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2, fused=True)
    (gflat,) = flat_buffers(opt, "grad")
    for _ in range(6):
        x = torch.randn(4, 6)
        for m, o in ((model, opt), (ref, opt_r)):
            o.zero_grad()  # torch 2 default: set_to_none=True
            m(x).square().sum().backward()
        assert all(_in(p.grad, gflat) for p in model.parameters())
        opt.fuse_step()
        opt_r.step()
    assert_bitwise(list(model.parameters()), list(ref.parameters()))
    assert opt._trainloom_fused.fast is not None  # every fuse_step after the first is fused


def test_accumulating_backward_keeps_using_the_flat_buffer():
    torch.manual_seed(1)
    lin = torch.nn.Linear(3, 3)
    opt = fuse_optimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
    (gflat,) = flat_buffers(opt, "grad")
    x = torch.randn(2, 3)
    lin(x).sum().backward()
    first = lin.weight.grad.clone()
    lin(x).sum().backward()  # accumulates in place into the view
    assert _in(lin.weight.grad, gflat)
    assert torch.equal(lin.weight.grad, first * 2)


def test_param_without_grad_is_skipped_like_torch():
    params = make_params()
    ref = twin(params)
    opt = fuse_optimizer(torch.optim.Adam(params, lr=0.1))
    opt_r = torch.optim.Adam(ref, lr=0.1)
    frozen = params[4].detach().clone()
    for s in range(4):
        grads = make_grads(params, s, none_every=0)
        grads[4] = None
        set_grads(params, grads)
        set_grads(ref, grads)
        opt.fuse_step()
        opt_r.step()
    assert torch.equal(params[4].detach(), frozen)
    assert len(opt.state[params[4]]) == 0 and len(opt_r.state[ref[4]]) == 0
    assert_bitwise(params, ref)


def _step_both(opt, opt_r, params, ref, s):
    grads = make_grads(params, s, none_every=0)
    set_grads(params, grads)
    set_grads(ref, grads)
    opt.fuse_step()
    opt_r.step()


def test_param_group_added_after_fusing_is_fused_with_one_warning():
    params, ref = make_params(), None
    ref = twin(params)
    opt = fuse_optimizer(torch.optim.SGD(params[:5], lr=0.1, momentum=0.9))
    opt_r = torch.optim.SGD(ref[:5], lr=0.1, momentum=0.9)
    _step_both(opt, opt_r, params, ref, 0)
    opt.add_param_group({"params": params[5:], "lr": 0.01})
    opt_r.add_param_group({"params": ref[5:], "lr": 0.01})
    with pytest.warns(UserWarning, match="param groups changed"):
        _step_both(opt, opt_r, params, ref, 1)
    (_, gflat) = flat_buffers(opt, "grad")
    assert all(_in(p, flat_buffers(opt, "param")[1]) for p in params[5:])
    assert gflat.numel() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))]})
        for s in range(2, 5):
            _step_both(opt, opt_r, params, ref, s)
    assert_bitwise(params, ref)


def test_replaced_param_data_is_refused_in_place_and_refused():
    params = make_params()
    ref = twin(params)
    opt = fuse_optimizer(torch.optim.Adam(params, lr=0.1))
    opt_r = torch.optim.Adam(ref, lr=0.1)
    _step_both(opt, opt_r, params, ref, 0)
    new = torch.randn(params[1].shape)
    params[1].data = new.clone()
    ref[1].data = new.clone()
    with pytest.warns(UserWarning, match="no longer lives in the flat buffer"):
        _step_both(opt, opt_r, params, ref, 1)
    assert _in(params[1], flat_buffers(opt, "param")[0])
    for s in range(2, 5):
        _step_both(opt, opt_r, params, ref, s)
    assert_bitwise(params, ref)


def test_check_flatten_false_refuses_silently():
    params = make_params()
    opt = fuse_optimizer(torch.optim.SGD(params, lr=0.1), check_flatten=False)
    params[0].data = torch.zeros(7)
    params[0].grad = torch.ones(7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.fuse_step()
    assert torch.equal(params[0].detach(), torch.full((7,), -0.1))
    assert _in(params[0], flat_buffers(opt, "param")[0])


def test_fuse_step_function_form_and_closure_returns_loss():
    lin = torch.nn.Linear(3, 1)
    opt = fuse_optimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
    x = torch.ones(2, 3)

    def closure():
        opt.zero_grad()
        loss = lin(x).sum()
        loss.backward()
        return loss

    loss = fuse_step(opt, closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert opt.fuse_step(closure) is not None


def test_do_flatten_false_fuses_adjacent_params_only_and_stays_exact():
    base = torch.randn(40)
    params = [torch.nn.Parameter(base[0:10].clone()), torch.nn.Parameter(base[10:25].clone())]
    # two parameters that already are adjacent views of one buffer
    store = torch.randn(30)
    a = torch.nn.Parameter(store[:12])
    b = torch.nn.Parameter(store[12:])
    a.data = store[:12]
    b.data = store[12:]
    all_p = params + [a, b]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in all_p]
    opt = fuse_optimizer(torch.optim.SGD(all_p, lr=0.1), do_flatten=False)
    opt_r = torch.optim.SGD(ref, lr=0.1)
    gstore = torch.randn(30)
    for _ in range(3):
        g = torch.randn(25)
        for p, q, gg in zip(all_p[:2], ref[:2], (g[:10], g[10:])):
            p.grad, q.grad = gg.clone(), gg.clone()
        a.grad, b.grad = gstore[:12], gstore[12:]
        ref[2].grad, ref[3].grad = gstore[:12].clone(), gstore[12:].clone()
        opt.fuse_step()
        opt_r.step()
    assert_bitwise(all_p, ref)
    assert a.data_ptr() == store.data_ptr()  # nothing moved
    with pytest.raises(FuseError, match="do_flatten=False"):
        flat_buffers(opt)


def test_fused_optimizer_is_freed_without_the_cycle_collector():
    import gc
    import weakref

    params = make_params()
    opt = fuse_optimizer(torch.optim.Adam(params, lr=0.1))
    set_grads(params, make_grads(params, 0, none_every=0))
    opt.fuse_step()
    bound = opt.fuse_step
    ref = weakref.ref(opt)
    gc.disable()
    try:
        del opt
        assert ref() is None  # no reference cycle keeps the flat state alive
    finally:
        gc.enable()
    with pytest.raises(FuseError, match=re.escape(_GONE)):
        bound()


_GONE = (
    "fuse_step: the optimizer this method was bound to no longer exists: the method holds it through a "
    "weak reference, so an optimizer nothing else refers to (as in "
    "fuse_optimizer(torch.optim.SGD(...)).fuse_step()) is freed first. Keep a reference to the "
    "optimizer returned by fuse_optimizer: opt = fuse_optimizer(...); opt.fuse_step()"
)


def test_fuse_step_on_an_unreferenced_optimizer_says_to_keep_a_reference():
    params = make_params()
    set_grads(params, make_grads(params, 0, none_every=0))
    before = [p.detach().clone() for p in params]
    with pytest.raises(FuseError, match="^" + re.escape(_GONE) + "$"):
        fuse_optimizer(torch.optim.SGD(params, lr=0.1)).fuse_step()
    assert_bitwise(params, before)
    opt = fuse_optimizer(torch.optim.SGD(params, lr=0.1))  # what the message says: works
    opt.fuse_step()


def test_lr_scheduler_sees_fuse_step_as_a_step():
    lin = torch.nn.Linear(3, 1)
    opt = fuse_optimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lin(torch.ones(1, 3)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        opt.fuse_step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.05


def _sharing(seed: int):
    """Parameters where three share one tensor's memory (a 2-D, a flat and a row view), among
    ordinary ones; the same layout each call."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(4, 3, generator=g)
    plain = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((5,), (2, 7), (9,))]
    p1 = torch.nn.Parameter(base)
    p2 = torch.nn.Parameter(base.view(12))
    p3 = torch.nn.Parameter(base[1])
    return [plain[0], p1, plain[1], p2, p3, plain[2]]


_SHARING_OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True),
}


@pytest.mark.parametrize("name", sorted(_SHARING_OPTS))
def test_params_sharing_memory_stay_out_of_the_flat_buffers_and_stay_exact(name):
    make = _SHARING_OPTS[name]
    params, ref = _sharing(0), _sharing(0)
    msg = (
        "fuse_optimizer: parameters whose memory overlaps (views of one tensor) would stop sharing it in "
        "the flat buffers, so they stay where they are and torch updates them per tensor: param group 0 "
        "parameter 1 (shape (4, 3)), param group 0 parameter 3 (shape (12,)), param group 0 parameter 4 "
        "(shape (3,)). flat_buffers(optimizer, 'grad') does not hold their gradients."
    )
    with pytest.warns(UserWarning, match="^" + re.escape(msg) + "$"):
        opt = fuse_optimizer(make(params))
    opt_r = make(ref)
    p1, p2, p3 = params[1], params[3], params[4]
    (flat,) = flat_buffers(opt, "param")
    assert all(_in(p, flat) for p in (params[0], params[2], params[5]))
    assert not any(_in(p, flat) for p in (p1, p2, p3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, at fuse time
        for s in range(6):
            # torch's fused SGD fails when only some params have a momentum buffer: no None grads
            grads = make_grads(params, s, none_every=0 if name == "sgd-fused" else 4)
            set_grads(params, grads)
            set_grads(ref, grads)
            opt.step() if s == 3 else opt.fuse_step()
            opt_r.step()
            assert_bitwise(params, ref)
            sd, sd_r = opt.state_dict()["state"], opt_r.state_dict()["state"]
            assert sd.keys() == sd_r.keys()
            for k in sd:
                assert sd[k].keys() == sd_r[k].keys()
                assert_bitwise(
                    [sd[k][n] for n in sorted(sd[k])], [sd_r[k][n] for n in sorted(sd[k])], "state"
                )
    # still one memory
    assert p1.data_ptr() == p2.data_ptr() == p3.data_ptr() - 3 * 4
    with torch.no_grad():
        p2[4] = 123.0
    assert p1[1, 1].item() == 123.0 and p3[1].item() == 123.0


def test_same_parameter_object_twice_is_fused_without_warning():
    w = torch.nn.Parameter(torch.randn(6, 4))
    b = torch.nn.Parameter(torch.randn(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = fuse_optimizer(torch.optim.SGD([{"params": [w, b]}], lr=0.1))
    (flat,) = flat_buffers(opt, "param")
    assert _in(w, flat) and _in(b, flat)


def test_do_flatten_false_steps_params_sharing_memory_in_torchs_order():
    def build():
        store, gstore, mstore = torch.zeros(12), torch.zeros(12), torch.zeros(12)
        g = torch.Generator().manual_seed(3)
        store.copy_(torch.randn(12, generator=g))
        mstore.copy_(torch.randn(12, generator=g))
        c = torch.nn.Parameter(store.view(3, 4))  # overlaps both a and b
        a = torch.nn.Parameter(store[:6])
        b = torch.nn.Parameter(store[6:])
        opt = torch.optim.SGD([c, a, b], lr=0.1, momentum=0.9, weight_decay=0.5)
        # adjacent params, grads and momentum buffers: a and b alone would be fused into one span
        opt.state[a]["momentum_buffer"] = mstore[:6]
        opt.state[b]["momentum_buffer"] = mstore[6:]
        opt.state[c]["momentum_buffer"] = torch.randn(3, 4, generator=g)
        a.grad, b.grad = gstore[:6], gstore[6:]
        return opt, [c, a, b], gstore

    opt, params, gstore = build()
    opt_r, ref, gstore_r = build()
    opt = fuse_optimizer(opt, do_flatten=False)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        gg = torch.randn(12, generator=g)
        gc = torch.randn(3, 4, generator=g)
        gstore.copy_(gg)
        gstore_r.copy_(gg)
        params[0].grad, ref[0].grad = gc.clone(), gc.clone()
        opt.fuse_step()
        opt_r.step()
        assert_bitwise(params, ref)


# ------------------------------------------------------------------ parameters at a storage offset
_OFFSET = 5  # elements before the first parameter in its storage (not a multiple of any vector width)
_OFFSET_SHAPES = [(7,), (3, 5), (33,), (2, 9)]
_OFFSET_OPTS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
}


def _packed(tensors, dtype):
    """Views of one storage, back to back, the first at element _OFFSET."""
    store = torch.full((_OFFSET + sum(t.numel() for t in tensors) + 3,), float("nan"), dtype=dtype)
    out, off = [], _OFFSET
    for t in tensors:
        v = store[off : off + t.numel()].view(t.shape)
        v.copy_(t)
        out.append(v)
        off += t.numel()
    return out


@pytest.mark.parametrize(
    "name,dtype",
    [(n, torch.float32) for n in sorted(_OFFSET_OPTS)] + [("sgd", torch.bfloat16), ("asgd", torch.bfloat16)],
    ids=lambda x: x if isinstance(x, str) else str(x).replace("torch.", ""),
)
@pytest.mark.parametrize("do_flatten", [True, False], ids=["flatten", "adjacent"])
def test_params_at_a_nonzero_storage_offset_match_torch(name, dtype, do_flatten):
    """Parameters, gradients and per-element state that are views of larger tensors, the first at
    storage_offset() == 5 and the rest adjacent to it (do_flatten=False fuses them into spans)."""
    make = _OFFSET_OPTS[name]
    g = torch.Generator().manual_seed(0)
    vals = _packed([torch.randn(s, generator=g).to(dtype) for s in _OFFSET_SHAPES], dtype)
    params = [torch.nn.Parameter(v) for v in vals]
    for p, v in zip(params, vals):
        p.data = v  # Parameter(v) of a view: keep the view itself
        p.grad = torch.zeros_like(v)
    for p, gv in zip(params, _packed([p.grad for p in params], dtype)):
        p.grad = gv
    ref = twin(params)
    opt, opt_r = make(params), make(ref)

    def step(s, fused):
        grads = make_grads(ref, s, none_every=0)
        set_grads(ref, grads)
        for p, gr in zip(params, grads):
            p.grad.copy_(gr)  # in place: the gradients stay where they are
        opt_r.step()
        opt.fuse_step() if fused else opt.step()

    step(0, False)  # torch creates the state; move it next to each other too, at the same offset
    for k in [k for k, v in opt.state[params[0]].items() if v.dim() > 0]:
        for p, v in zip(params, _packed([opt.state[p][k] for p in params], dtype)):
            opt.state[p][k] = v
    lists = [params, [p.grad for p in params]]
    lists += [[opt.state[p][k] for p in params] for k, v in opt.state[params[0]].items() if v.dim() > 0]
    assert calculate_mutual_groups(lists) == [[0, 1, 2, 3]]
    assert params[0].storage_offset() == _OFFSET and len(lists) > 2

    ptrs = [p.data_ptr() for p in params]
    opt = fuse_optimizer(opt, do_flatten=do_flatten)
    for s in range(1, 6):
        step(s, True)
    assert_bitwise(params, ref)
    for p, q in zip(params, ref):
        st, st_r = opt.state[p], opt_r.state[q]
        assert st.keys() == st_r.keys()
        assert_bitwise([st[k] for k in st_r], [st_r[k] for k in st_r], "state")
    if do_flatten:  # moved into the flat buffers
        (flat,) = flat_buffers(opt, "param")
        assert all(_in(p, flat) for p in params)
    else:  # nothing moved
        assert [p.data_ptr() for p in params] == ptrs and params[0].storage_offset() == _OFFSET


def test_do_flatten_false_steps_a_parameter_listed_twice_twice_even_next_to_a_neighbour():
    """With a, b adjacent in memory (parameters, gradients and momentum buffers) and a listed twice,
    torch steps a twice. The span over a and b used to replace every listing of a: a was stepped once."""

    def run(fuse: bool) -> list:
        store, gstore, mstore = torch.arange(32.0), torch.ones(32), torch.full((32,), 0.5)
        a, b = torch.nn.Parameter(store[:16]), torch.nn.Parameter(store[16:])
        opt = torch.optim.SGD([a, b, a], lr=0.1, momentum=0.9)
        opt.state[a]["momentum_buffer"] = mstore[:16]
        opt.state[b]["momentum_buffer"] = mstore[16:]
        if fuse:
            opt = fuse_optimizer(opt, do_flatten=False)
        for _ in range(2):
            a.grad, b.grad = gstore[:16], gstore[16:]
            opt.fuse_step() if fuse else opt.step()
        return [a, b, mstore]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning about the duplicate
        want, got = run(False), run(True)
    assert_bitwise(got, want)
    assert got[0][0].item() == pytest.approx(-1.059655, abs=1e-6)  # a[0] = 0.0 updated four times


@pytest.mark.parametrize("fused", [False, True])
def test_amsgrad_plans_stay_cached_across_steps(fused, monkeypatch):
    """45 runs of parameters (every other one without a gradient): after the first steps, no step
    makes a plan again. fused=True AMSGrad also made the for-loop's plan it does not use, so each
    run took two cache entries, the cache (cleared above 64) thrashed and every step re-planned."""
    from trainloom.optim import fused as F

    ps = [torch.randn(200).requires_grad_() for _ in range(90)]
    opt = fuse_optimizer(torch.optim.Adam(ps, lr=1e-3, amsgrad=True, fused=fused))
    for p in ps:
        p.grad = torch.randn(200)
    opt.fuse_step()
    for i, p in enumerate(ps):
        if i % 2:
            p.grad = None
    opt.fuse_step()
    calls = []
    real = F._K.make_plan
    monkeypatch.setattr(F._K, "make_plan", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):
        opt.fuse_step()
    assert calls == []
