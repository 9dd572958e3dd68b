"""state_dict round trips, refused optimizers, bad input, sparse gradients, calculate_mutual_groups."""

from __future__ import annotations

import copy
import functools
import io
import re
import warnings
from pathlib import Path

import pytest
import torch
from optimutil import assert_bitwise, make_grads, make_params, set_grads, twin

from trainloom.errors import ConfigError
from trainloom.optim import (
    FuseError,
    calculate_mutual_groups,
    flat_buffers,
    fuse_optimizer,
    fuse_step,
    is_fused_optimizer,
)

OPTS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True),
}

# Every other optimizer fuse_optimizer accepts (fused._ELEMENTWISE), with its special options. ASGD
# (eta, mu) and NAdam (mu_product) keep extra 0-d state next to `step`: a resume must restore it.
OTHER_OPTS = {
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2, etas=(0.4, 1.3), step_sizes=(1e-5, 0.5)),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=2, lambd=1e-3, weight_decay=1e-2),
    "asgd-foreach": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=3, foreach=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=0.1),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5, rho=0.8, weight_decay=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "adagrad-fused": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1, momentum_decay=5e-3),
    "nadam-decoupled": lambda ps: torch.optim.NAdam(
        ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "nadam-foreach": lambda ps: torch.optim.NAdam(ps, lr=1e-2, foreach=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1),
    "radam-decoupled": lambda ps: torch.optim.RAdam(
        ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
}
ROUND_TRIP_OPTS = {**OPTS, **OTHER_OPTS}


def test_round_trip_covers_every_fused_optimizer():
    from trainloom.optim import fused

    covered = {type(make(make_params())) for make in ROUND_TRIP_OPTS.values()}
    assert set(fused._ELEMENTWISE) <= covered, set(fused._ELEMENTWISE) - covered


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _advance(opt, params, steps, start, fused):
    for s in range(start, start + steps):
        set_grads(params, make_grads(params, s, none_every=0))
        opt.fuse_step() if fused else opt.step()


@pytest.mark.parametrize("name", sorted(ROUND_TRIP_OPTS))
@pytest.mark.parametrize("src_fused,dst_fused", [(True, False), (False, True), (True, True)])
def test_state_dict_round_trips_continue_bit_identically(name, src_fused, dst_fused):
    make = ROUND_TRIP_OPTS[name]
    ref = make_params(gap="fused" not in name)
    ref_opt = make(ref)
    _advance(ref_opt, ref, 8, 0, False)  # the uninterrupted unfused run

    src = make_params(gap="fused" not in name)
    src_opt = fuse_optimizer(make(src)) if src_fused else make(src)
    _advance(src_opt, src, 4, 0, src_fused)
    sd = _roundtrip(src_opt.state_dict())
    stock = make(twin(src))
    stock.load_state_dict(src_opt.state_dict())
    assert sd["param_groups"] == stock.state_dict()["param_groups"]  # the stock format
    assert set(sd["state"]) == set(stock.state_dict()["state"])

    dst = twin(src)
    dst_opt = make(dst)
    if dst_fused:
        dst_opt = fuse_optimizer(dst_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a resume is routine: no warning (a fused one warned once)
        dst_opt.load_state_dict(sd)
        _advance(dst_opt, dst, 4, 4, dst_fused)
    assert_bitwise(ref, dst)
    # ... and so is every state entry: ASGD's average `ax` (and its `mu`) never reach the parameters
    _assert_same_state(dst_opt.state_dict()["state"], ref_opt.state_dict()["state"])


def _assert_same_state(got, want):
    assert got.keys() == want.keys()
    for i in want:
        assert got[i].keys() == want[i].keys(), i
        for k, v in want[i].items():
            if torch.is_tensor(v):
                assert got[i][k].dtype == v.dtype, (i, k)
                assert_bitwise([got[i][k]], [v], f"state {i} {k!r}")
            else:
                assert got[i][k] == v, (i, k)


def _in_flat(t: torch.Tensor, opt: torch.optim.Optimizer) -> bool:
    return any(
        t.data_ptr() >= f.data_ptr() and t.data_ptr() < f.data_ptr() + f.numel() * f.element_size()
        for b in opt._trainloom_fused.buckets
        for f in b.state_flat.values()
    )


def test_load_state_dict_into_a_fused_optimizer_moves_the_state_into_the_flat_buffers_quietly():
    params = make_params()
    opt = fuse_optimizer(torch.optim.Adam(params, lr=1e-2))
    _advance(opt, params, 3, 0, True)
    sd = _roundtrip(opt.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(sd)
        # at once, before any fuse_step: the loaded tensors are copied into the flat buffers
        assert all(_in_flat(opt.state[p]["exp_avg"], opt) for p in params)
        _advance(opt, params, 1, 3, True)
    # A change behind the optimizer's back still warns (once).
    opt.param_groups[0] = dict(opt.param_groups[0])
    with pytest.warns(UserWarning, match="^fuse_step: param group 0 was replaced; re-fusing"):
        _advance(opt, params, 1, 4, True)


def test_fusing_twice_raises():
    opt = fuse_optimizer(torch.optim.SGD(make_params(), lr=0.1))
    with pytest.raises(FuseError, match="already fused"):
        fuse_optimizer(opt)
    with pytest.raises(RuntimeError, match="already fused"):  # Bagua raised RuntimeError
        fuse_optimizer(opt)


def _exactly(msg: str) -> str:
    return "^" + re.escape(msg) + "$"


_PER_TENSOR = "computes per-tensor quantities ({}); flattening would change its results. Keep it unfused."


@pytest.mark.parametrize(
    "make,msg",
    [
        (
            lambda ps: torch.optim.LBFGS(ps),
            "LBFGS is not elementwise (a quasi-Newton line search over dot products of all gradients, "
            "re-evaluating the closure); fusing cannot speed it up. Keep it unfused.",
        ),
        (
            lambda ps: torch.optim.SparseAdam(ps),
            "SparseAdam needs sparse gradients (it raises on dense ones), while fusing works on dense "
            "flat gradient buffers; there is nothing to fuse. Keep it unfused.",
        ),
        (
            lambda ps: torch.optim.Adafactor(ps),
            "Adafactor " + _PER_TENSOR.format("factored row and column second moments of each tensor"),
        ),
        (
            lambda ps: torch.optim.Muon([p for p in ps if p.dim() == 2]),
            "Muon " + _PER_TENSOR.format("an orthogonalisation of each 2-D gradient matrix"),
        ),
    ],
    ids=["LBFGS", "SparseAdam", "Adafactor", "Muon"],
)
def test_non_elementwise_optimizers_are_refused_with_their_reason(make, msg):
    opt = make(make_params())
    with pytest.raises(FuseError, match=_exactly("fuse_optimizer: " + msg)):
        fuse_optimizer(opt)
    assert not is_fused_optimizer(opt)
    assert not hasattr(opt, "fuse_step")


def test_subclass_of_a_refused_optimizer_names_its_base():
    class MyFactor(torch.optim.Adafactor):
        pass

    msg = "MyFactor (a subclass of Adafactor) " + _PER_TENSOR.format(
        "factored row and column second moments of each tensor"
    )
    with pytest.raises(FuseError, match=_exactly("fuse_optimizer: " + msg)):
        fuse_optimizer(MyFactor(make_params()))


def test_docs_list_every_fused_and_refused_optimizer():
    """docs/optim.md's optimizer table names each optimizer fusing accepts and each one it refuses."""
    from trainloom.optim import fused

    doc = (Path(__file__).resolve().parents[2] / "docs" / "optim.md").read_text()
    start = doc.index("## Which optimizers are fused")
    section = doc[start : doc.index("\n## ", start + 1)]
    for cls in fused._ELEMENTWISE:
        assert f"`{cls.__name__}`" in section, cls.__name__
    for name in fused._REFUSED:
        assert f"`{name}`" in section, name
    assert "overrid" in section and "step()" in section


def test_subclass_overriding_step_and_foreign_optimizers_are_refused():
    class Lars(torch.optim.SGD):  # per-tensor trust ratio: not elementwise
        def step(self, closure=None):
            return super().step(closure)

    msg = "Lars " + _PER_TENSOR.format("a trust ratio from each tensor's norms")
    with pytest.raises(FuseError, match=_exactly("fuse_optimizer: " + msg)):
        fuse_optimizer(Lars(make_params(), lr=0.1))

    class Scaled(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    msg = (
        "fuse_optimizer: Scaled overrides step() of SGD; its math may not be elementwise, so it cannot be "
        "fused"
    )
    with pytest.raises(FuseError, match=_exactly(msg)):
        fuse_optimizer(Scaled(make_params(), lr=0.1))

    class Plain(torch.optim.Adam):  # not overriding step(): fused like Adam
        pass

    assert is_fused_optimizer(fuse_optimizer(Plain(make_params(), lr=0.1)))

    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    with pytest.raises(FuseError, match="Custom is not one of the elementwise torch optimizers"):
        fuse_optimizer(Custom(make_params()))
    with pytest.raises(FuseError, match="expected a torch.optim.Optimizer, got list"):
        fuse_optimizer([])  # type: ignore[arg-type]


def test_bad_arguments():
    p = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    with pytest.raises(FuseError, match="param group 0 parameter 0 has dtype torch.int64"):
        fuse_optimizer(torch.optim.SGD([p], lr=0.1))
    with pytest.raises(FuseError, match="do_flatten and check_flatten must be bool"):
        fuse_optimizer(torch.optim.SGD(make_params(), lr=0.1), do_flatten=1)  # type: ignore[arg-type]
    plain = torch.optim.SGD(make_params(), lr=0.1)
    with pytest.raises(FuseError, match="SGD is not fused; call fuse_optimizer"):
        fuse_step(plain)
    with pytest.raises(FuseError, match="flat_buffers: SGD is not fused"):
        flat_buffers(plain)
    opt = fuse_optimizer(torch.optim.SGD(make_params(), lr=0.1))
    with pytest.raises(FuseError, match="kind must be 'grad' or 'param', got 'state'"):
        flat_buffers(opt, "state")
    assert issubclass(FuseError, ConfigError) and issubclass(FuseError, ValueError)


def test_sparse_gradients_get_torchs_own_handling():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = fuse_optimizer(torch.optim.Adam(emb.parameters(), lr=0.1))
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
        opt.fuse_step()

    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    ref = torch.nn.Embedding(10, 4, sparse=True)
    ref.load_state_dict(emb.state_dict())
    opt = fuse_optimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    for m in (emb, ref):
        m(torch.tensor([1, 2, 2])).sum().backward()
    opt.fuse_step()
    opt_r.step()
    assert_bitwise([emb.weight], [ref.weight])


def test_calculate_mutual_groups():
    flat = torch.zeros(20)
    gflat = torch.zeros(20)
    a, b, c, d = flat[0:4], flat[4:6], flat[7:10], flat[10:13]
    ga, gb, gc, gd = gflat[0:4], gflat[4:6], gflat[6:9], gflat[9:12]
    assert calculate_mutual_groups([[a, b, c, d]]) == [[0, 1], [2, 3]]
    # c/d adjacent in the first list only; a/b in both
    assert calculate_mutual_groups([[a, b, c, d], [ga, gb, gc, gd]]) == [[0, 1], [2, 3]]
    assert calculate_mutual_groups([[a, b, c, d], [gb, ga, gc, gd]]) == [[2, 3]]
    assert calculate_mutual_groups([[b, a]]) == [[1, 0]]  # memory order
    other = torch.zeros(4, dtype=torch.float64)
    assert calculate_mutual_groups([[a, other]]) == []
    assert calculate_mutual_groups([]) == []
    with pytest.raises(FuseError, match="list 1 has 1 tensors, list 0 has 2"):
        calculate_mutual_groups([[a, b], [a]])
    with pytest.raises(FuseError, match="list 0 item 1 is int, not a tensor"):
        calculate_mutual_groups([[a, 3]])
    with pytest.raises(
        FuseError,
        match=r"^calculate_mutual_groups: item 0 is a tensor, not a list of tensors; pass a list of lists, "
        r"e\.g\. \[params, grads\]$",
    ):
        calculate_mutual_groups([a, b])  # a flat list of tensors: it iterated their elements


def _flat_ranges(opt):
    info = opt._trainloom_fused
    return [
        (f.data_ptr(), f.data_ptr() + f.numel() * f.element_size())
        for b in info.buckets
        for f in [b.flat_param, b.flat_grad, *b.state_flat.values()]
    ]


def _inside(t, ranges):
    return any(lo <= t.data_ptr() < hi for lo, hi in ranges)


@pytest.mark.parametrize("name", sorted(OPTS))
def test_deepcopy_gives_a_fused_copy_that_continues_bit_identically(name):
    make = OPTS[name]
    ref = make_params(gap="fused" not in name)
    ref_opt = make(ref)
    _advance(ref_opt, ref, 7, 0, False)

    params = make_params(gap="fused" not in name)
    model = torch.nn.ParameterList(params)
    opt = fuse_optimizer(make(params), check_flatten=False)
    _advance(opt, params, 3, 0, True)
    model2, opt2 = copy.deepcopy((model, opt))
    params2 = list(model2)
    assert is_fused_optimizer(opt2) and opt2 is not opt
    assert opt2._trainloom_fused.check_flatten is False and opt2._trainloom_fused.do_flatten is True
    assert opt2.param_groups[0]["params"] == params2  # the copied model's Parameter objects
    ranges, ranges2 = _flat_ranges(opt), _flat_ranges(opt2)
    for p, p2 in zip(params, params2):
        assert p2 is not p and _inside(p2, ranges2) and not _inside(p2, ranges)
        for k, v in opt2.state[p2].items():
            if torch.is_tensor(v) and v.dim() > 0:
                assert _inside(v, ranges2), k
    assert opt2.fuse_step._ref() is opt2
    assert_bitwise(params, params2)
    _advance(opt2, params2, 4, 3, True)  # the copy steps on its own ...
    assert_bitwise(ref, params2)
    with pytest.raises(AssertionError):
        assert_bitwise(ref, params)  # ... without touching the original
    _advance(opt, params, 4, 3, True)
    assert_bitwise(ref, params)


def test_pickled_fused_optimizer_loads_unfused_and_can_be_fused_again():
    make = OPTS["adam"]
    ref = make_params()
    ref_opt = make(ref)
    _advance(ref_opt, ref, 6, 0, False)

    params = make_params()
    opt = fuse_optimizer(make(params))
    _advance(opt, params, 3, 0, True)
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    # torch's Optimizer.__getstate__ keeps defaults, state and param groups only: a plain optimizer
    assert type(loaded) is torch.optim.Adam
    assert not is_fused_optimizer(loaded) and not hasattr(loaded, "fuse_step")
    loaded = fuse_optimizer(loaded)
    lparams = loaded.param_groups[0]["params"]
    _advance(loaded, lparams, 3, 3, True)
    assert_bitwise(ref, lparams)


@pytest.mark.parametrize("wrapped", ["torch's step", "the bare step"])
def test_subclass_overriding_step_under_functools_wraps_is_refused(wrapped):
    """functools.wraps sets __wrapped__: following it back to SGD.step took the override for SGD's own
    step(), so fuse_step ran SGD's update and silently skipped the subclass's."""
    base_step = torch.optim.SGD.step
    if wrapped == "the bare step":  # under torch's profiling wrapper (Optimizer.profile_hook_step)
        base_step = base_step.__wrapped__

    class Halved(torch.optim.SGD):
        @functools.wraps(base_step)
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            return super().step(closure)

    msg = (
        "fuse_optimizer: Halved overrides step() of SGD; its math may not be elementwise, so it cannot be "
        "fused"
    )
    with pytest.raises(FuseError, match=_exactly(msg)):
        fuse_optimizer(Halved(make_params(), lr=0.1))


def test_subclass_made_before_its_base_is_fused(monkeypatch):
    """torch wraps the step() an optimizer class resolves to in its profiling wrapper and stores the
    wrapper on that class (Optimizer._patch_step_function). A subclass made before its base (SGD's
    step still bare, as in a fresh process) holds a wrapper of SGD's step of its own: no override."""
    from trainloom.optim import fused

    bare = fused._peel_profiling(torch.optim.SGD.step)

    class Plain(torch.optim.SGD):
        pass

    monkeypatch.setattr(torch.optim.SGD, "step", bare)  # as before the first SGD was made
    opt = Plain(make_params(), lr=0.1)
    monkeypatch.undo()
    wrapper = Plain.__dict__["step"]
    assert wrapper.hooked and wrapper.__wrapped__ is bare and wrapper is not torch.optim.SGD.step
    assert is_fused_optimizer(fuse_optimizer(opt))


@pytest.mark.parametrize("do_flatten", [True, False], ids=["flatten", "adjacent"])
def test_a_sparse_parameter_stays_outside_the_flat_buffers_and_steps_as_torch(do_flatten):
    """A sparse-layout parameter cannot be a view of a flat buffer; fusing used to raise
    NotImplementedError ("Cannot access storage of SparseTensorImpl") on it."""

    def run(fuse: bool) -> list:
        dense = torch.nn.Parameter(torch.linspace(-1, 1, 6).reshape(2, 3))
        sparse = torch.nn.Parameter(torch.tensor([0.0, 1.0, 0.0, 2.0]).to_sparse())
        opt = torch.optim.SGD([dense, sparse], lr=0.1)
        if fuse:
            opt = fuse_optimizer(opt, do_flatten=do_flatten)
        for s in range(3):
            dense.grad = torch.full((2, 3), 0.25 * (s + 1))
            sparse.grad = (torch.tensor([1.0, 1.0, 0.0, 0.0]) * (s + 1)).to_sparse()
            opt.fuse_step() if fuse else opt.step()
        if fuse and do_flatten:
            (flat,) = flat_buffers(opt, "param")
            assert dense.data_ptr() == flat.data_ptr()  # the dense parameter was fused
        return [dense, sparse.to_dense()]

    assert_bitwise(run(True), run(False))


def test_stateless_sgd_with_a_tensor_lr_keeps_torchs_empty_state():
    """SGD without momentum keeps no state; on the path for a Tensor lr fuse_step used to create an
    empty state dict for every parameter (state_dict()["state"] was {0: {}, 1: {}, ...})."""

    def run(fuse: bool):
        params = make_params(gap=False)
        opt = torch.optim.SGD(params, lr=torch.tensor(0.1))
        if fuse:
            opt = fuse_optimizer(opt)
        for s in range(2):
            set_grads(params, make_grads(params, s, none_every=0))
            opt.fuse_step() if fuse else opt.step()
        return params, opt

    (want, opt_r), (got, opt_f) = run(False), run(True)
    assert_bitwise(got, want)
    assert opt_r.state_dict()["state"] == {}
    assert opt_f.state_dict()["state"] == {}
    assert len(opt_f.state) == 0
