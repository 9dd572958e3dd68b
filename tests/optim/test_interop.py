"""fuse_step next to the rest of torch's training tools: model dtype changes, gradients replaced in
place, hyperparameter warm-ups, step hooks and the profiler, and shared-memory (Hogwild) models.
Each case runs the same steps with the plain optimizer and compares bit for bit."""

from __future__ import annotations

import multiprocessing
import re
import warnings
from typing import Any, Callable, Dict, List

import pytest
import torch
from optimutil import assert_bitwise, require_kernel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from trainloom.optim import flat_buffers, fuse_optimizer
from trainloom.optim import fused as F

# Changing a model's dtype or memory after fusing re-fuses, with a warning tested in test_layout.py.
pytestmark = pytest.mark.filterwarnings("ignore:fuse_step.*re-fusing")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(
    make_opt: Callable[[Any], torch.optim.Optimizer],
    fuse: bool,
    steps: int = 4,
    before_step: Callable[[int, torch.nn.Module, torch.optim.Optimizer], None] = lambda s, m, o: None,
    model: torch.nn.Module = None,
) -> torch.nn.Module:
    m = _model() if model is None else model
    opt = make_opt(m.parameters())
    if fuse:
        opt = fuse_optimizer(opt)
    for s in range(steps):
        opt.zero_grad()
        dt = next(m.parameters()).dtype
        m(torch.linspace(-1, 1, 12, dtype=dt).reshape(2, 6) * (s + 1)).square().sum().backward()
        before_step(s, m, opt)
        opt.fuse_step() if fuse else opt.step()
    return m


def _both(make_opt, **kw) -> None:
    want = _train(make_opt, False, **kw)
    got = _train(make_opt, True, **kw)
    assert_bitwise(list(got.parameters()), list(want.parameters()))


# ------------------------------------------------------------------------------ model dtype changes
def _to(dtype: torch.dtype):
    def before(s: int, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if s == 1:  # state exists from step 0; the gradients of step 1 are converted with the model
            m.to(dtype)

    return before


def _outcome(make, src: torch.dtype, dst: torch.dtype, fuse: bool) -> Any:
    """The trained parameters, or the text of the error torch raised."""
    try:
        return list(_train(make, fuse, before_step=_to(dst), model=_model().to(src)).parameters())
    except RuntimeError as e:
        return str(e)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    ],
    ids=["sgd", "sgd-fused", "adam", "adam-fused"],
)
def test_model_dtype_change_after_state_exists_does_what_torch_does(make, src, dst):
    """After ``model.to(other float dtype)`` the state keeps its dtype. torch's SGD for-loop then
    still trains, and its fused SGD and Adam raise; the fused kernels take one dtype per buffer,
    so state of another dtype stays per tensor and torch does the same here (it used to corrupt
    the heap)."""
    want, got = _outcome(make, src, dst, False), _outcome(make, src, dst, True)
    if isinstance(want, str):
        assert re.match(r"expected (scalar type|dtype) ", want)
        assert got == want
    else:
        assert not isinstance(got, str), got
        assert got[0].dtype == dst
        assert_bitwise(got, want)


# ------------------------------------------------------------------------ gradients replaced in place
@pytest.mark.parametrize("how", ["data", "set_"])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    ],
    ids=["sgd", "adam", "adamw-fused", "rmsprop"],
)
def test_gradient_replaced_through_data_or_set_is_the_one_stepped(make, how):
    """``p.grad.data = t`` and ``p.grad.set_(t)`` re-point the gradient object that fuse_step put
    in the flat buffer (old-style manual averaging does this); the new values are stepped."""

    def halve(s: int, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if s >= 1:
            for p in m.parameters():
                if how == "data":
                    p.grad.data = p.grad.data / 2
                else:
                    p.grad.set_(p.grad.detach() / 2)

    _both(make, before_step=halve)


def test_after_a_replaced_gradient_the_flat_buffer_holds_it_again():
    m = _model()
    opt = fuse_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    m(torch.ones(2, 6)).sum().backward()
    opt.fuse_step()
    w = m[0].weight
    w.grad.data = torch.full_like(w, 7.0)
    before = w.detach().clone()
    opt.fuse_step()
    assert torch.equal(w.detach(), before.add(torch.full_like(w, 7.0), alpha=-0.1))  # SGD's own formula
    flat = flat_buffers(opt, "grad")[0]
    assert w.grad.data_ptr() == flat.data_ptr()  # the first parameter's view starts the buffer
    assert torch.equal(w.grad, torch.full_like(w, 7.0))


# ------------------------------------------------------------------------ hyperparameters changed
@pytest.mark.parametrize("fused_flag", [False, True])
@pytest.mark.parametrize("start", [0.0, 0])
def test_sgd_momentum_warm_up_from_zero_matches_torch(fused_flag, start):
    """Momentum 0 keeps no buffer; torch creates one at the first step with momentum."""

    def warm(s: int, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.param_groups[0]["momentum"] = [start, start, 0.5, 0.9, 0.0, 0.9][s]

    _both(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=start, fused=fused_flag), steps=6, before_step=warm)


# ---------------------------------------------------------------------------------- step hooks
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.5),
        lambda ps: torch.optim.RMSprop(ps, lr=0.5),
    ],
    ids=["sgd", "adam", "rmsprop"],
)
def test_step_hooks_run_once_per_fuse_step_with_the_model_parameters(make):
    """Optimizer and global step pre/post hooks run around every fuse_step as around step(),
    seeing the real param groups; a post-hook that clips weights (WGAN) takes effect."""

    def run(fuse: bool) -> tuple:
        m = _model()
        names = {id(p): n for n, p in m.named_parameters()}
        seen: List[Any] = []
        opt = make(m.parameters())
        if fuse:
            opt = fuse_optimizer(opt)

        def pre(o, args, kwargs):
            seen.append(("pre", len(args), [names.get(id(p)) for g in o.param_groups for p in g["params"]]))

        def post(o, args, kwargs):
            seen.append(("post",))
            with torch.no_grad():
                for p in m.parameters():
                    p.clamp_(-0.3, 0.3)

        handles = [
            opt.register_step_pre_hook(pre),
            opt.register_step_post_hook(post),
            register_optimizer_step_post_hook(lambda o, a, k: seen.append(("global",))),
        ]
        try:
            for s in range(5):
                opt.zero_grad()
                m(torch.ones(2, 6) * (s + 1)).sum().backward()
                opt.fuse_step() if fuse else opt.step()
        finally:
            for h in handles:
                h.remove()
        return m, seen

    (want, seen_want), (got, seen_got) = run(False), run(True)
    assert seen_got == seen_want
    assert len(seen_want) == 15 and seen_want[0][2] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert_bitwise(list(got.parameters()), list(want.parameters()))
    assert max(p.abs().max() for p in got.parameters()) <= torch.tensor(0.3)  # the hook clipped


def test_a_pre_hook_can_replace_the_closure_and_a_bad_return_raises_as_in_torch():
    m = _model()
    opt = fuse_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    calls: List[str] = []

    def closure():
        calls.append("closure")
        opt.zero_grad()
        loss = m(torch.ones(2, 6)).sum()
        loss.backward()
        return loss

    h = opt.register_step_pre_hook(lambda o, args, kwargs: ((o,), {"closure": closure}))
    loss = opt.fuse_step()
    assert calls == ["closure"] and isinstance(loss, torch.Tensor)
    h.remove()
    h = opt.register_step_pre_hook(lambda o, args, kwargs: "oops")
    with pytest.raises(
        RuntimeError,
        match=r"^fuse_step: the step pre-hook <function .*> must return None or a "
        r"tuple of \(new_args, new_kwargs\), but got 'oops'$",
    ):
        opt.fuse_step()
    h.remove()


def test_hooks_keep_the_steady_state_fast_path_and_step_still_invalidates_it():
    require_kernel("adam", "loop")
    m = _model()
    opt = fuse_optimizer(torch.optim.Adam(m.parameters(), lr=0.01))
    count: Dict[str, int] = {"post": 0}
    opt.register_step_post_hook(lambda o, a, k: count.__setitem__("post", count["post"] + 1))
    info = F._info(opt, "test")
    for _ in range(3):
        m(torch.ones(2, 6)).sum().backward()
        opt.fuse_step()
    assert info.fast is not None and count["post"] == 3
    opt.step()  # a plain step() between fuse_steps changes step counts: re-check then
    assert info.fast is None and count["post"] == 4


def test_the_profiler_sees_fuse_step_as_an_optimizer_step():
    m = _model()
    opt = fuse_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    m(torch.ones(2, 6)).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.fuse_step()
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#SGD.step") == 1


# ------------------------------------------------------------------------ shared-memory (Hogwild)
_SHM_WARNING = (
    "fuse_optimizer: 4 parameters live in shared memory (model.share_memory(), e.g. Hogwild training); "
    "moving them into the flat buffers would take them out of it, so the other processes would stop "
    "seeing their updates. They stay where they are and torch updates them per tensor (not fused): "
    "param group 0 parameter 0, param group 0 parameter 1, param group 0 parameter 2, "
    "param group 0 parameter 3."
)


def test_shared_memory_parameters_are_not_moved_and_match_torch():
    make = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731
    want = _train(make, False, model=_model().share_memory())
    m = _model().share_memory()
    ptrs = [p.data_ptr() for p in m.parameters()]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = _train(make, True, model=m)
    assert [str(x.message) for x in w] == [_SHM_WARNING]
    assert [p.data_ptr() for p in got.parameters()] == ptrs and all(p.is_shared() for p in got.parameters())
    assert_bitwise(list(got.parameters()), list(want.parameters()))


def test_share_memory_after_fusing_stays_shared_and_matches_torch():
    def share(s: int, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if s == 2:
            m.share_memory()

    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    want = _train(make, False, before_step=share)
    with pytest.warns(UserWarning, match=re.escape("4 parameters live in shared memory")):
        got = _train(make, True, before_step=share)
    assert all(p.is_shared() for p in got.parameters())
    assert_bitwise(list(got.parameters()), list(want.parameters()))


def _hogwild_worker(model: torch.nn.Module) -> None:
    warnings.simplefilter("ignore")
    opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(1, 6)).sum().backward()
        opt.fuse_step()


def test_a_hogwild_worker_with_a_fused_optimizer_updates_the_shared_model():
    """torch's mnist_hogwild pattern: the model is shared, each worker fuses its own optimizer."""
    m = _model().share_memory()
    want = _model()
    ref = torch.optim.SGD(want.parameters(), lr=1.0)
    for _ in range(2):
        ref.zero_grad()
        want(torch.ones(1, 6)).sum().backward()
        ref.step()
    proc = multiprocessing.get_context("fork").Process(target=_hogwild_worker, args=(m,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert_bitwise(list(m.parameters()), list(want.parameters()))


# ------------------------------------------------------------------------ two optimizers, one parameter
_HELD_WARNING = (
    "fuse_optimizer: 2 parameters are already in the flat buffers of another fused optimizer (two "
    "optimizers over the same parameters). Moving them here would take them out of that optimizer's "
    "buffers, and each would re-fuse at every step, so they stay there and this optimizer updates them "
    "per tensor through torch (not fused): param group 0 parameter 0 (shape (3, 5)), "
    "param group 0 parameter 1 (shape (3,))."
)


def _two_optimizers(fuse: bool, steps: int = 5):
    """SGD over the whole model and Adam over its last layer too (a second optimizer with its own
    rule for a shared part): both step the shared parameters, in that order."""
    m = _model()
    a = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    b = torch.optim.Adam(m[2].parameters(), lr=0.01)
    if fuse:
        a, b = fuse_optimizer(a), fuse_optimizer(b)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    infos = []
    for _ in range(steps):
        a.zero_grad()
        b.zero_grad()
        m(x).pow(2).sum().backward()
        if fuse:
            a.fuse_step()
            b.fuse_step()
            infos.append([list(F._info(o, "test").buckets) for o in (a, b)])
        else:
            a.step()
            b.step()
    return m, a, b, infos


def test_two_fused_optimizers_over_one_parameter_do_not_refuse_each_step_and_match_torch():
    """Before, the second fuse_optimizer moved the shared parameters into its own buffers, and from
    then on each fuse_step found them moved ("p.data was replaced"), re-fused and moved them back."""
    want, *_ = _two_optimizers(False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got, a, b, infos = _two_optimizers(True)
    assert [str(x.message) for x in w] == [_HELD_WARNING]
    assert all(step == infos[0] for step in infos)  # the same buckets every step: no re-fusing
    # the shared parameters live in the first optimizer's flat buffer and are stepped by both
    (flat,) = flat_buffers(a, "param")
    base, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    assert all(base <= p.data_ptr() < end for p in got[2].parameters())
    assert flat_buffers(b, "param") == [] and set(map(id, F._info(b, "test").outside[0])) == set(
        map(id, got[2].parameters())
    )
    assert_bitwise(list(got.parameters()), list(want.parameters()))


def test_a_parameter_held_by_a_deleted_fused_optimizer_is_fused_by_the_next():
    m = _model()
    first = fuse_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    del first
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "already in the flat buffers" warning
        second = fuse_optimizer(torch.optim.SGD(m.parameters(), lr=0.1))
    assert sum(b.numel() for b in flat_buffers(second, "param")) >= sum(p.numel() for p in m.parameters())


# ------------------------------------------------------------------------ one parameter listed twice
_DUPLICATE_WARNING = (
    "fuse_optimizer: a parameter listed more than once in the optimizer's param groups (torch warns "
    "about this and updates it once per listing) stays where it is, and torch updates it per tensor, as "
    "often as it is listed (not fused). The listings: param group 0 parameter 0 (shape (5, 6)), "
    "{second} (shape (5, 6))."
)
_SECOND_LISTING = {
    "one group": "param group 0 parameter 4",
    "two groups": "param group 1 parameter 0",
    "appended after fusing": "param group 0 parameter 4",
}


@pytest.mark.parametrize("where", list(_SECOND_LISTING))
@pytest.mark.parametrize(
    "make",
    [lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9), lambda g: torch.optim.Adam(g, lr=0.01)],
    ids=["sgd", "adam"],
)
def test_a_parameter_listed_twice_is_updated_twice_as_torch_does(where: str, make: Callable) -> None:
    """torch warns about a duplicate parameter and steps it once per listing; fuse_step used to put it
    in the flat buffer once and step it once."""

    def run(fuse: bool) -> torch.nn.Module:
        m = _model()
        w = m[0].weight
        params = list(m.parameters())  # w first
        groups: Any = [{"params": params + [w] if where == "one group" else params}]
        if where == "two groups":  # torch refuses this at construction, not when appended
            groups.append({"params": [], "lr": 0.05})
        opt = make(groups)
        if where == "two groups":
            opt.param_groups[1]["params"].append(w)
        if fuse:
            opt = fuse_optimizer(opt)
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
        for step in range(4):
            if where == "appended after fusing" and step == 2:
                opt.param_groups[0]["params"].append(w)
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            (opt.fuse_step if fuse else opt.step)()
        return m

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = run(False)
        got = run(True)
    assert_bitwise(list(got.parameters()), list(want.parameters()))
    ours = [str(x.message) for x in caught if str(x.message).startswith("fuse_optimizer")]
    assert ours == [_DUPLICATE_WARNING.format(second=_SECOND_LISTING[where])]


def test_the_kernel_self_check_runs_no_step_hooks_and_records_no_profiler_range(monkeypatch):
    """The first fuse_step of a configuration checks the compiled kernel against torch on internal
    optimizers. It used to step them through step() and fuse_step(), so the user's global step hooks
    ran 12 more times (a hook refusing unknown optimizers broke that fuse_step) and the profiler
    recorded 12 more Optimizer.step ranges."""
    monkeypatch.setattr(F, "_KERNEL_OK", {})  # as in a fresh process: the check runs in this fuse_step
    monkeypatch.setattr(F, "_FUSED_SPLIT", {})
    m = _model()
    opt = fuse_optimizer(torch.optim.Adam(m.parameters(), lr=1e-3))
    seen: List[str] = []

    def pre(o, args, kwargs):
        if o is not opt:
            raise RuntimeError(f"a step of an optimizer this hook does not know: {type(o).__name__}")
        seen.append("pre")

    handles = [
        register_optimizer_step_pre_hook(pre),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append("post" if o is opt else "other")),
    ]
    try:
        m(torch.ones(2, 6)).sum().backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            opt.fuse_step()
    finally:
        for h in handles:
            h.remove()
    assert seen == ["pre", "post"]
    assert [e.name for e in prof.events() if e.name.startswith("Optimizer.step#")] == [
        "Optimizer.step#Adam.step"
    ]
    assert list(F._KERNEL_OK) == [("adam", "loop", torch.float32)]  # the check did run


def test_load_state_dict_into_a_wrapped_fused_optimizer_resumes_as_torch():
    """A fused optimizer wrapped by trainloom.comm's DistributedAllreduceOptimizer: load_state_dict on
    the wrapper (a checkpoint resume) re-fuses it, which raised "FuseError: ... overrides step() of
    Adam" (the wrapper's class). One process: the allreduce averages over one rank."""
    from trainloom.comm import bluefog as bf

    def batches(n: int) -> List[torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        return [torch.randn(2, 4, generator=g) for _ in range(n)]

    def train(opt: Any, model: torch.nn.Module, xs: List[torch.Tensor]) -> None:
        for x in xs:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    train(ref_opt, ref, batches(4))
    bf.init()
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = bf.DistributedAllreduceOptimizer(
            fuse_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2)), model=model
        )
        train(opt, model, batches(4)[:2])
        saved = opt.state_dict()
        opt.load_state_dict(saved)  # raised FuseError
        train(opt, model, batches(4)[2:])
    finally:
        bf.shutdown()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_bitwise(p.detach(), q.detach())
