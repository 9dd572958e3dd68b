"""Bitwise equality of fused and unfused optimizers over 100 steps mixing fuse_step() and step()."""

from __future__ import annotations

from typing import List

import pytest
import torch
from optimutil import assert_bitwise, groups, require_kernel, run_pair

optim = torch.optim

# (name, constructor over params); two param groups with different hyper-parameters each.
CONFIGS = [
    ("sgd", lambda ps: optim.SGD(groups(ps, dict(lr=0.1), dict(lr=0.01, momentum=0.9, weight_decay=1e-2)))),
    (
        "sgd-nesterov-dampening",
        lambda ps: optim.SGD(
            groups(
                ps,
                dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
                dict(lr=0.01, momentum=0.8, dampening=0.3, maximize=True),
            )
        ),
    ),
    (
        "sgd-foreach",
        lambda ps: optim.SGD(groups(ps, dict(lr=0.1, momentum=0.9), dict(lr=0.01)), foreach=True),
    ),
    (
        "sgd-fused",
        lambda ps: optim.SGD(groups(ps, dict(lr=0.1, momentum=0.9), dict(lr=0.01, momentum=0.5)), fused=True),
    ),
    ("adam", lambda ps: optim.Adam(groups(ps, dict(lr=1e-3), dict(lr=1e-2, weight_decay=0.1, amsgrad=True)))),
    (
        "adam-foreach",
        lambda ps: optim.Adam(
            groups(ps, dict(lr=1e-3, maximize=True), dict(lr=1e-2, betas=(0.3, 0.9))), foreach=True
        ),
    ),
    (
        "adam-fused",
        lambda ps: optim.Adam(
            groups(ps, dict(lr=1e-3), dict(lr=1e-2, weight_decay=0.1, amsgrad=True)), fused=True
        ),
    ),
    (
        "adamw",
        lambda ps: optim.AdamW(groups(ps, dict(lr=1e-3), dict(lr=1e-2, weight_decay=0.1, amsgrad=True))),
    ),
    (
        "adamw-fused",
        lambda ps: optim.AdamW(
            groups(ps, dict(lr=1e-3, maximize=True), dict(lr=1e-2, amsgrad=True)), fused=True
        ),
    ),
    (
        "rmsprop",
        lambda ps: optim.RMSprop(groups(ps, dict(lr=1e-3, centered=True), dict(lr=1e-2, momentum=0.9))),
    ),
    ("rprop", lambda ps: optim.Rprop(groups(ps, dict(lr=1e-3), dict(lr=1e-2, etas=(0.4, 1.3))))),
    ("asgd", lambda ps: optim.ASGD(groups(ps, dict(lr=1e-2, t0=3), dict(lr=1e-3, weight_decay=1e-2)))),
    ("adamax", lambda ps: optim.Adamax(groups(ps, dict(lr=1e-2), dict(lr=1e-3, weight_decay=0.1)))),
    ("adadelta", lambda ps: optim.Adadelta(groups(ps, dict(lr=1.0), dict(lr=0.5, weight_decay=1e-2)))),
    (
        "adagrad",
        lambda ps: optim.Adagrad(
            groups(ps, dict(lr=1e-2), dict(lr=1e-1, lr_decay=0.01, initial_accumulator_value=0.1))
        ),
    ),
    ("adagrad-fused", lambda ps: optim.Adagrad(groups(ps, dict(lr=1e-2), dict(lr=1e-1)), fused=True)),
    (
        "nadam",
        lambda ps: optim.NAdam(
            groups(ps, dict(lr=1e-2), dict(lr=1e-3, decoupled_weight_decay=True, weight_decay=0.1))
        ),
    ),
    ("radam", lambda ps: optim.RAdam(groups(ps, dict(lr=1e-2), dict(lr=1e-3, weight_decay=0.1)))),
]


def _alternate(opt: torch.optim.Optimizer, s: int) -> None:
    opt.step() if s % 2 else opt.fuse_step()


def _mostly_fused(opt: torch.optim.Optimizer, s: int) -> None:
    # long stretches of fuse_step (the cached fast path) with an occasional step()
    opt.step() if s % 7 == 6 else opt.fuse_step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name,make", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_interleaved_steps_are_bitwise_equal(name, make, dtype):
    fused = "fused" in name
    # torch's own fused=True kernels walk data_ptr() linearly (they mis-handle a parameter with
    # gaps), and fused SGD fails on a group mixing initialised and fresh momentum buffers.
    none_every = 0 if name == "sgd-fused" else 5
    ref, fus, opt_r, opt_f = run_pair(make, _alternate, 100, dtype, none_every=none_every, gap=not fused)
    assert_bitwise(ref, fus)
    for pr, pf in zip(ref, fus):
        for key, v in opt_r.state[pr].items():
            if isinstance(v, torch.Tensor):
                assert_bitwise([v], [opt_f.state[pf][key]], f"state {key!r}")
            else:
                assert v == opt_f.state[pf][key]


@pytest.mark.parametrize(
    "name,make", [c for c in CONFIGS if c[0] in ("sgd", "adam", "adamw-fused", "rmsprop")]
)
def test_fast_path_with_all_grads_present(name, make):
    fused = "fused" in name
    if name != "rmsprop":
        require_kernel(name.split("-")[0].replace("adamw", "adam"), "fused" if fused else "loop")
    ref, fus, _, opt_f = run_pair(make, _mostly_fused, 60, torch.float32, none_every=0, gap=not fused)
    assert_bitwise(ref, fus)
    if name != "rmsprop":  # kernels: the steady state is served from the cached layout
        assert opt_f._trainloom_fused.fast is not None


def test_kernel_flavours_agree_bit_for_bit():
    """The portable scalar kernels and the AVX2 ones give the same bits (and both match torch)."""
    from trainloom.optim import _fused as K

    require_kernel("adam", "fused")
    require_kernel("adam", "loop", torch.float64)
    if not K.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2/FMA: only the scalar kernels exist here")
    make = dict(CONFIGS)["adam-fused"]
    try:
        K.set_isa("scalar")
        ref, fus, _, _ = run_pair(make, _alternate, 12, torch.float32, gap=False)
        assert_bitwise(ref, fus)
        make = dict(CONFIGS)["adamw"]
        ref, fus, _, _ = run_pair(make, _alternate, 12, torch.float64)
        assert_bitwise(ref, fus)
    finally:
        K.set_isa("avx2")
    assert K.isa() == "avx2"


@pytest.mark.parametrize("name", ["sgd", "rmsprop", "asgd", "adam", "adamw-fused"])
def test_bfloat16_params_stay_exact(name):
    """bf16 CPU parameters are flattened but updated per tensor: ATen's bf16 kernels round the
    tail of each tensor differently, so torch's math on a flat view would not be exact."""
    make = dict(CONFIGS)[name]
    ref, fus, _, _ = run_pair(make, _alternate, 20, torch.bfloat16, gap="fused" not in name)
    assert_bitwise(ref, fus)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw-fused", "rmsprop"])
def test_cuda_flat_views_are_exact(name):
    """On CUDA the flat views go through torch's own foreach/fused kernels."""
    from optimutil import make_grads, make_params, set_grads, twin

    from trainloom.optim import fuse_optimizer

    make = dict(CONFIGS)[name]
    ref = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(gap=False)]
    fus = twin(ref)
    opt_r, opt_f = make(ref), fuse_optimizer(make(fus))
    for s in range(20):
        grads = [None if g is None else g.cuda() for g in make_grads(ref, s)]
        set_grads(ref, grads)
        set_grads(fus, grads)
        opt_r.step()
        _alternate(opt_f, s)
    assert_bitwise(ref, fus)


@pytest.mark.parametrize("name", ["adam", "adam-foreach", "adamw"])
def test_adam_for_loop_three_pass_fallback_is_exact(name, monkeypatch):
    """Without torch's MKL square root (other builds, TRAINLOOM_NO_VML=1) the for-loop Adam runs
    as moments kernel + torch.sqrt + update kernel: just as exact."""
    from trainloom.optim import fused

    require_kernel("adam", "foreach" if "foreach" in name else "loop")
    monkeypatch.setattr(fused, "_VML_STATE", [False])
    make = dict(CONFIGS)[name]
    ref, fus, _, _ = run_pair(make, _mostly_fused, 30, torch.float32, none_every=0)
    assert_bitwise(ref, fus)


def test_mkl_square_root_is_found_and_checked():
    from trainloom.optim import _fused as K
    from trainloom.optim import fused

    if not fused._vml_ready():
        pytest.skip("this torch build's sqrt is not MKL's: the three-pass path is used (tested above)")
    assert K.has_vml_sqrt()
    x = torch.rand(1000, dtype=torch.float64) * 1e6
    out = torch.empty_like(x)
    K.vml_sqrt(K.DTYPE_F64, x.data_ptr(), out.data_ptr(), x.numel())
    assert torch.equal(out, torch.sqrt(x))
    with pytest.raises(ValueError, match="give both function addresses or neither"):
        K.set_vml_sqrt(1, 0, 0)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_fused_tail_split_is_measured_and_decisive(kind, dtype):
    """torch's fused=True kernels round each tensor's last ``numel % split`` elements apart; the
    split is the vector width torch's kernel runs at, which is not always the CPU's (on AVX512
    machines torch 2.13 runs its fused optimizers' AVX2 build). The probe must single it out: the
    measured split reproduces torch's steps, the other candidate does not."""
    from trainloom.optim import fused

    require_kernel(kind, "fused", dtype)
    split = fused._FUSED_SPLIT[(kind, dtype)]
    item = 4 if dtype == torch.float32 else 8
    (other,) = {32 // item, 64 // item} - {split}
    fused._PROBING.key = (kind, "fused", dtype)  # as during the probe: fuse_step uses the kernel
    try:
        fused._FUSED_SPLIT[(kind, dtype)] = other
        assert not fused._probe_matches_torch(kind, "fused", dtype)
        fused._FUSED_SPLIT[(kind, dtype)] = split
        assert fused._probe_matches_torch(kind, "fused", dtype)
    finally:
        fused._PROBING.key = None
        fused._FUSED_SPLIT[(kind, dtype)] = split


@pytest.mark.parametrize("name", ["sgd", "sgd-fused", "adam-foreach", "adamw-fused"])
def test_groups_step_through_torch_when_no_kernel_matches(name, monkeypatch):
    """Where a compiled kernel does not reproduce torch's path (a torch or CPU that rounds some other
    way), fuse_step leaves such groups to torch (flat views; per tensor for fused=True): still
    bitwise equal."""
    from trainloom.optim import fused

    monkeypatch.setattr(
        fused,
        "_KERNEL_OK",
        {
            (k, f, d): False
            for k in ("sgd", "adam")
            for f in ("fused", "foreach", "loop")
            for d in (torch.float32, torch.float64)
        },
    )
    make = dict(CONFIGS)[name]
    ref, fus, _, opt_f = run_pair(make, _alternate, 20, torch.float32, none_every=0, gap="fused" not in name)
    assert_bitwise(ref, fus)
    info = opt_f._trainloom_fused
    assert all(fused._kernel_for(opt_f, opt_f.param_groups[b.group_index], b) is None for b in info.buckets)


_NO_FMA_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from optimutil import assert_bitwise, run_pair
from test_exact import CONFIGS, _alternate
from trainloom.optim import fused
assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
for name in ("sgd", "sgd-nesterov-dampening", "sgd-fused", "adam", "adam-foreach", "adamw-fused"):
    for dtype in (torch.float32, torch.float64):
        # none_every=0 for fused SGD: torch's own kernel fails on a group mixing fresh and set momentum
        none_every = 0 if name == "sgd-fused" else 5
        make = dict(CONFIGS)[name]
        ref, fus, _, _ = run_pair(make, _alternate, 12, dtype, none_every, gap="fused" not in name)
        assert_bitwise(ref, fus)
print(sorted((k, f, str(d)) for (k, f, d), ok in fused._KERNEL_OK.items() if not ok))
"""


def test_exact_where_torch_runs_without_fma(tmp_path):
    """Under torch's DEFAULT CPU capability (no AVX2/FMA kernels, as on older x86 CPUs) torch rounds
    SGD and Adam otherwise than the compiled kernels: before they were checked, fuse_step silently
    differed from step() there (24 exactness tests failed). Now the probe rejects them and the
    results stay bitwise equal."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run(
        [sys.executable, "-c", _NO_FMA_SCRIPT, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rejected = eval(out.stdout.strip().splitlines()[-1])
    # the loop and foreach kernels of both optimizers do not match torch there: the fallback ran
    for key in (("sgd", "loop"), ("adam", "loop"), ("adam", "foreach")):
        assert any(r[:2] == key for r in rejected), (key, rejected)


_ADAM_FLAGS = {"loop": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
_ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("flavour", list(_ADAM_FLAGS))
@pytest.mark.parametrize("dtype", _ALL_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_adam_lerp_branch_is_chosen_on_the_weight_in_the_kernels_dtype(dtype, flavour):
    """exp_avg.lerp_(grad, 1 - beta1) takes one formula for |weight| < 0.5 and the other otherwise,
    testing the weight as ATen holds it: float for float32 (and for float16/bfloat16, whose math is
    in float), double for float64. With beta1 = 0.50000001, 1 - beta1 is below 0.5 in double and
    rounds to 0.5 in float; the kernels used to test the double for every dtype."""
    flags = _ADAM_FLAGS[flavour]
    make = lambda ps: optim.Adam(ps, lr=1e-2, betas=(0.50000001, 0.999), **flags)  # noqa: E731
    ref, fus, opt_r, opt_f = run_pair(make, lambda o, s: o.fuse_step(), 4, dtype, gap=flavour != "fused")
    assert_bitwise(ref, fus)
    assert_bitwise(
        [opt_r.state[p]["exp_avg"] for p in ref], [opt_f.state[p]["exp_avg"] for p in fus], "exp_avg"
    )


_NAN_SIZES = (1, 7, 8, 16, 17, 33, 32785)  # the last is split between threads by ATen's loops
_PAYLOAD_NAN = {torch.float32: (torch.int32, 0x7FC00123), torch.float64: (torch.int64, 0x7FF8000000000123)}


def _amsgrad_with_nans(flavour: str, dtype: torch.dtype, fuse: bool) -> List[torch.Tensor]:
    ps = [torch.nn.Parameter(torch.linspace(-1, 1, n, dtype=dtype)) for n in _NAN_SIZES]
    opt = optim.Adam(ps, lr=1e-2, amsgrad=True, **_ADAM_FLAGS[flavour.split("-")[0]])
    if fuse:
        from trainloom.optim import fuse_optimizer

        opt = fuse_optimizer(opt)
    ints, payload = _PAYLOAD_NAN[dtype]
    g = torch.Generator().manual_seed(0)
    for s in range(4):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
            if s == 2:
                p.grad[1::3] = float("nan")  # NaN exp_avg_sq: in the second operand of the maximum
        if s == 1:
            for p in ps:  # a NaN maximum (first operand) with a payload of its own
                opt.state[p]["max_exp_avg_sq"].view(ints)[::2] = payload
        opt.fuse_step() if fuse else opt.step()
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    return [t.detach() for p in ps for t in [p] + [opt.state[p][k] for k in keys]]


@pytest.mark.parametrize(
    "flavour,threads",
    # two threads: ATen splits the largest tensor into one chunk per thread, each with a tail
    [("loop", 1), ("loop-three-pass", 1), ("foreach", 1), ("fused", 1), ("loop", 2)],
    ids=["loop", "loop-three-pass", "foreach", "fused", "loop-2-threads"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_amsgrad_nan_bit_patterns_match_torch(dtype, flavour, threads, monkeypatch):
    """torch.maximum (for-loop, foreach) gives the all-ones NaN in ATen's vector loop (the first
    numel - numel % 16 float32 / % 8 float64 elements of each tensor, or of each thread's chunk of it)
    and the quiet NaN 0x7fc00000 / 0x7ff8000000000000 in its scalar tail; fused=True's tail takes
    std::max, which keeps a NaN maximum and drops a NaN exp_avg_sq. The kernels used to return the
    input NaN everywhere (the audit: 0x7fc00000 where torch has 0xffffffff)."""
    from trainloom.optim import _fused as K
    from trainloom.optim import fused

    torch.set_num_threads(threads)  # torch's chunks (what the plan must follow); the kernels run on one:
    monkeypatch.setattr(fused, "_PARALLEL_MIN", 1 << 40)  # two OpenMP teams would spin against each other
    if flavour == "loop-three-pass":
        monkeypatch.setattr(fused, "_VML_STATE", [False])
    want = _amsgrad_with_nans(flavour, dtype, False)
    for isa in ["avx2", "scalar"] if K.cpu_has_avx2() else ["scalar"]:
        K.set_isa(isa)
        try:
            got = _amsgrad_with_nans(flavour, dtype, True)
        finally:
            K.set_isa("avx2" if K.cpu_has_avx2() else "scalar")
        assert_bitwise(got, want, f"{isa}: param, exp_avg, exp_avg_sq, max_exp_avg_sq")
