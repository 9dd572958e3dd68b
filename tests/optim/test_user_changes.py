"""What training code does to a fused optimizer between steps: reset state, unfreeze layers,
double backward, route step() to fuse_step. Each compared bitwise with the unfused optimizer."""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
from optimutil import assert_bitwise, make_grads, make_params, require_kernel, set_grads, twin

from trainloom.optim import flat_buffers, fuse_optimizer

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
}


def _clear_all(opt: torch.optim.Optimizer, params: list) -> None:
    opt.state.clear()


def _delete_one(opt: torch.optim.Optimizer, params: list) -> None:
    del opt.state[params[2]]


def _new_dict(opt: torch.optim.Optimizer, params: list) -> None:
    opt.state[params[3]] = {}


def _empty_dict(opt: torch.optim.Optimizer, params: list) -> None:
    opt.state[params[1]].clear()


def _replace_tensors(opt: torch.optim.Optimizer, params: list) -> None:
    # st["exp_avg"] = t: every state tensor of one parameter (the step counter too) replaced by a
    # new tensor of half its value; the fast path kept stepping the old flat state.
    st = opt.state[params[2]]
    for k, v in list(st.items()):
        st[k] = v.clone().mul_(0.5)


def _replace_step(opt: torch.optim.Optimizer, params: list) -> None:
    for p in params[1:3]:
        st = opt.state[p]
        st["step"] = torch.zeros_like(st["step"])


def _train_twins(make: Callable, reset: Callable) -> tuple:
    """Seven steps of ``make(params)`` stepped by torch and, on twin parameters, fused; ``reset`` is
    applied to both before the fifth step. Returns (ref params, fused params, ref opt, fused opt)."""
    ref = make_params(gap=False)
    fus = twin(ref)
    opt_r, opt_f = make(ref), fuse_optimizer(make(fus))
    for s in range(7):
        if s == 4:
            reset(opt_r, ref)
            reset(opt_f, fus)
        grads = make_grads(ref, s, none_every=0)
        set_grads(ref, grads)
        set_grads(fus, grads)
        opt_r.step()
        opt_f.fuse_step()
    return ref, fus, opt_r, opt_f


_RESETS = [_clear_all, _delete_one, _new_dict, _empty_dict, _replace_tensors, _replace_step]


@pytest.mark.parametrize(
    ("name", "reset"),
    [
        pytest.param(name, reset, id=f"{name}-{reset.__name__[1:]}")
        for name in OPTIMIZERS
        for reset in _RESETS
        if not (reset is _replace_step and name.startswith("sgd"))  # SGD keeps no step counter
    ],
)
def test_state_reset_by_hand_is_seen(name: str, reset: Callable) -> None:
    # A warm restart or a re-initialised layer drops or replaces optimizer state between two steps;
    # torch then starts it afresh or steps the new tensors. fuse_step's fast path used to keep
    # stepping the old flat state, and state_dict() then lacked those parameters.
    ref, fus, opt_r, opt_f = _train_twins(OPTIMIZERS[name], reset)
    assert_bitwise(ref, fus)
    sd_r, sd_f = opt_r.state_dict()["state"], opt_f.state_dict()["state"]
    assert sorted(sd_r) == sorted(sd_f) == list(range(len(ref)))
    for i in sd_r:
        assert sorted(sd_r[i]) == sorted(sd_f[i])
        assert_bitwise([sd_r[i][k] for k in sorted(sd_r[i])], [sd_f[i][k] for k in sorted(sd_f[i])], "state")


@pytest.mark.parametrize("which", ["all", "one"])
def test_step_counter_reset_in_place_is_seen(which: str) -> None:
    # st["step"].zero_() restarts Adam's bias correction; the fast path used its cached step count.
    def zero_steps(opt: torch.optim.Optimizer, ps: list) -> None:
        for p in ps if which == "all" else ps[3:4]:
            opt.state[p]["step"].zero_()

    ref, fus, opt_r, opt_f = _train_twins(lambda ps: torch.optim.Adam(ps, lr=1e-2), zero_steps)
    assert_bitwise(ref, fus)
    assert [float(opt_f.state[p]["step"]) for p in fus] == [float(opt_r.state[p]["step"]) for p in ref]


def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))


def _grad_in(flats: list, p: torch.Tensor) -> bool:
    ptr = p.grad.untyped_storage().data_ptr()
    return any(ptr == f.untyped_storage().data_ptr() for f in flats)


@pytest.mark.parametrize("when", ["fused", "refused"])
def test_a_layer_unfrozen_later_gets_its_gradient_in_the_flat_buffer(when: str) -> None:
    ref, fus = _model(), _model()
    if when == "fused":  # frozen when the optimizer is fused
        for m in (ref, fus):
            m[0].requires_grad_(False)
    opt_r = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_f = fuse_optimizer(torch.optim.Adam(fus.parameters(), lr=1e-2))
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    flats = flat_buffers(opt_f, "grad")  # taken before the unfreezing (calling it would adopt them)
    for s in range(6):
        if when == "refused" and s == 1:  # frozen while the optimizer re-fuses (a resume)
            for m in (ref, fus):
                m[0].requires_grad_(False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the re-fuse warning is tested elsewhere
                opt_f.load_state_dict(opt_f.state_dict())
                flats = flat_buffers(opt_f, "grad")  # re-fuses (hooks installed again) without a step
        if s == 3:
            for m in (ref, fus):
                m[0].requires_grad_(True)
        for m, o in ((ref, opt_r), (fus, opt_f)):
            o.zero_grad()
            m(x * (s + 1)).square().sum().backward()
        if s >= 3:  # right after backward, before any fuse_step: ready for a collective on the buffer
            assert _grad_in(flats, fus[0].weight) and _grad_in(flats, fus[0].bias)
        opt_r.step()
        opt_f.fuse_step()
    assert_bitwise(list(ref.parameters()), list(fus.parameters()))


def test_every_parameter_frozen_when_fused_is_adopted_by_flat_buffers() -> None:
    # No parameter had a hook to notice the unfreezing: flat_buffers() adopts them.
    model = _model()
    model.requires_grad_(False)
    opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model.requires_grad_(True)
    model(torch.ones(2, 6)).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    (flat,) = flat_buffers(opt, "grad")
    for p, g in zip(model.parameters(), expected):
        assert p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert torch.equal(p.grad, g)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_create_graph_keeps_the_gradient_graph() -> None:
    # A gradient penalty built from p.grad after backward(create_graph=True): torch keeps the graph
    # on p.grad. The hook used to copy it into the flat buffer, dropping the graph.
    ref, fus = _model(), _model()
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_f = fuse_optimizer(torch.optim.SGD(fus.parameters(), lr=0.1, momentum=0.9))
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        for m, o in ((ref, opt_r), (fus, opt_f)):
            o.zero_grad()
            m(x).square().sum().backward(create_graph=True)
            assert all(p.grad.grad_fn is not None for p in m.parameters())
            penalty = sum(p.grad.square().sum() for p in m.parameters())
            o.zero_grad()
            penalty.backward()
        opt_r.step()
        opt_f.fuse_step()
    assert_bitwise(list(ref.parameters()), list(fus.parameters()))


def test_step_routed_to_fuse_step_then_an_lr_scheduler() -> None:
    # opt.step = opt.fuse_step (so GradScaler or Lightning loops calling step() run fused), then an LR
    # scheduler: torch wraps opt.step through its __func__, which Bagua's bound method had.
    ref, fus = _model(), _model()
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_f = fuse_optimizer(torch.optim.SGD(fus.parameters(), lr=0.1))
    opt_f.step = opt_f.fuse_step
    assert opt_f.fuse_step.__self__ is opt_f
    sched_r = torch.optim.lr_scheduler.StepLR(opt_r, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        sched_f = torch.optim.lr_scheduler.StepLR(opt_f, step_size=1, gamma=0.5)
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
        for _ in range(3):
            for m, o, sch in ((ref, opt_r, sched_r), (fus, opt_f, sched_f)):
                o.zero_grad()
                m(x).square().sum().backward()
                o.step()
                sch.step()
    assert sched_f.get_last_lr() == sched_r.get_last_lr() == [0.1 * 0.5**3]
    assert_bitwise(list(ref.parameters()), list(fus.parameters()))


#: torch's own fused=True optimizers (the ones GradScaler hands grad_scale and found_inf)
_TORCH_FUSED = [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
]


@pytest.mark.parametrize("make", _TORCH_FUSED, ids=["sgd", "adam"])
def test_grad_scaler_after_unscaled_steps_unscales_and_skips_inf(make: Callable) -> None:
    """Plain fp32 steps first (fuse_step caches its fast path), then GradScaler: the fast path used to
    replay the kernels, which neither divide by the scale nor skip a step whose gradients hold inf."""
    ref, fus = _model(), _model()
    opt_r = make(list(ref.parameters()))
    opt_f = fuse_optimizer(make(list(fus.parameters())))
    opt_f.step = opt_f.fuse_step
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(4))
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    for loss_scale in (None, None, None, 1.0, 1.0, float("inf"), 1.0):
        for m, o, scaler in ((ref, opt_r, scalers[0]), (fus, opt_f, scalers[1])):
            o.zero_grad()
            loss = m(x).square().sum()
            if loss_scale is None:
                loss.backward()
                o.step()
            else:
                scaler.scale(loss * loss_scale).backward()
                scaler.step(o)
                scaler.update()
        assert_bitwise(list(ref.parameters()), list(fus.parameters()))
        assert all(p.isfinite().all() for p in fus.parameters())
    assert scalers[0].get_scale() == scalers[1].get_scale() == 512.0  # the inf step halved it


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_untouched_state_keeps_the_fast_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The state check must not fail on state nobody touched: torch itself re-assigns SGD's
    # momentum buffers at every step (the same objects) and steps a 0-d parameter's state here.
    from trainloom.optim import fused as F

    require_kernel("sgd" if name.startswith("sgd") else "adam", "loop")  # the fast path is the kernels'
    taken: list = []
    step_fast = F._step_fast
    monkeypatch.setattr(F, "_step_fast", lambda o, i: taken.append(step_fast(o, i)) or taken[-1])
    ps = [*make_params(gap=False), torch.nn.Parameter(torch.tensor(0.5))]
    opt = fuse_optimizer(OPTIMIZERS[name](ps))
    for s in range(6):
        for p, g in zip(ps, [*make_grads(ps[:-1], s, none_every=0), torch.tensor(0.25)]):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        opt.fuse_step()
    assert taken == [True] * 4  # steps 3-6: the first creates the state, the second records it


def test_flat_grad_slot_of_a_parameter_without_gradient_is_zero_for_the_collective() -> None:
    """DDP-style flow (docs/optim.md), two ranks simulated in one process: rank 1 does not use ``b``
    in the second step, so after zero_grad() its b.grad is None. Its slot in the flat buffer used to
    keep the first step's gradient (10), which the average then mixed into rank 0's."""

    def rank():
        ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))]
        return ps, fuse_optimizer(torch.optim.SGD(ps, lr=1.0))

    ranks = [rank(), rank()]
    for step in range(2):
        for r, (ps, opt) in enumerate(ranks):
            opt.zero_grad()
            uses_b = not (step == 1 and r == 1)
            (ps[0].sum() + (ps[1].sum() * 10.0 if uses_b else 0.0)).backward()
        flats = [flat_buffers(opt, "grad")[0] for _, opt in ranks]
        if step == 1:
            b1 = ranks[1][0][1]
            assert b1.grad is None
            # a's three ones, zero padding, and zeros where b's slot is
            assert flats[1].abs().sum().item() == 3.0 and flats[1].numel() > 6
        avg = (flats[0] + flats[1]) / 2  # what allreduce_inplace(flat, op=AVG) leaves on each rank
        for f in flats:
            f.copy_(avg)
        for _, opt in ranks:
            opt.fuse_step()
    a0, b0 = ranks[0][0]
    assert a0.tolist() == [-2.0] * 3
    assert b0.tolist() == [-15.0] * 3  # -10 (step 0), then -(10 + 0) / 2
    # skipped in step 1, as torch skips grad None: this copy drifts (documented; DDP's reducer would
    # have handed it the average)
    assert ranks[1][0][1].tolist() == [-10.0] * 3


@pytest.mark.parametrize("make", _TORCH_FUSED, ids=["sgd", "adam"])
def test_fused_and_foreach_both_set_take_torchs_own_path(make: Callable) -> None:
    """The constructors refuse fused=True with foreach=True, but param_groups can be edited: torch's
    sgd() then takes foreach and adam() takes fused. The SGD kernel used to follow fused (8.9e-08 off)."""
    ref, fus = _model(), _model()
    opt_r = make(list(ref.parameters()))
    opt_f = fuse_optimizer(make(list(fus.parameters())))
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(5))
    for step in range(4):
        if step == 1:
            for o in (opt_r, opt_f):
                o.param_groups[0]["foreach"] = True
        for m, o in ((ref, opt_r), (fus, opt_f)):
            o.zero_grad()
            m(x).square().sum().backward()
        opt_r.step()
        opt_f.fuse_step()
        assert_bitwise(list(ref.parameters()), list(fus.parameters()))


def test_a_gradient_assigned_by_hand_goes_through_the_flat_buffer() -> None:
    """``p.grad = t`` before flat_buffers: its slot used to keep the old gradient (the collective saw
    that) and fuse_step then copied ``t`` over the reduced value."""
    ps = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))]
    opt = fuse_optimizer(torch.optim.SGD(ps, lr=1.0))
    (ps[0].sum() + 10 * ps[1].sum()).backward()
    opt.fuse_step()  # b's slot now holds 10s
    opt.zero_grad()
    ps[0].sum().backward()
    ps[1].grad = torch.full((3,), 4.0)  # e.g. the docs' zeros for an unused parameter, or a gradient
    (flat,) = flat_buffers(opt, "grad")
    assert sorted(flat.tolist()).count(4.0) == 3 and 10.0 not in flat.tolist()
    flat.mul_(0.5)  # what a collective might leave there
    assert ps[1].grad.tolist() == [2.0] * 3
    opt.fuse_step()
    assert ps[1].tolist() == [-10.0 - 2.0] * 3
    assert ps[0].tolist() == [-1.0 - 0.5] * 3
