"""Bitwise equality of fused and unfused optimizers over 100 steps mixing fuse_step() and step()."""

from __future__ import annotations

import pytest
import torch
from optimutil import assert_bitwise, groups, run_pair

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
    ref, fus, _, opt_f = run_pair(make, _mostly_fused, 60, torch.float32, none_every=0, gap=not fused)
    assert_bitwise(ref, fus)
    if name != "rmsprop":  # kernels: the steady state is served from the cached layout
        assert opt_f._trainloom_fused.fast is not None


def test_kernel_flavours_agree_bit_for_bit():
    """The portable scalar kernels and the AVX2 ones give the same bits (and both match torch)."""
    from trainloom.optim import _fused as K

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
    machines torch 2.13 runs its fused optimizers' AVX2 build). The probe must single it out: exactly
    one candidate reproduces torch's step, parameters and state, bit for bit."""
    from trainloom.optim import fused

    g = torch.Generator().manual_seed(7)
    n = sum(fused._PROBE_SIZES)
    p0 = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    grads = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for _ in range(2)]
    ref = fused._probe_torch(kind, p0, grads)
    item = 4 if dtype == torch.float32 else 8
    matches = [
        s for s in (32 // item, 64 // item) if torch.equal(fused._probe_kernel(kind, p0, grads, s), ref)
    ]
    assert len(matches) == 1, matches
    assert fused._fused_split(kind, dtype) == matches[0]


@pytest.mark.parametrize("name", ["sgd-fused", "adamw-fused"])
def test_fused_groups_step_per_tensor_when_no_split_matches(name, monkeypatch):
    """Where no compiled kernel reproduces torch's fused=True kernel (a torch that rounds its tails
    some other way), fuse_step leaves such groups to torch, per tensor: still bitwise equal."""
    from trainloom.optim import fused

    monkeypatch.setattr(
        fused, "_FUSED_SPLIT", {(k, d): None for k in ("sgd", "adam") for d in (torch.float32, torch.float64)}
    )
    make = dict(CONFIGS)[name]
    ref, fus, _, opt_f = run_pair(make, _alternate, 20, torch.float32, none_every=0, gap=False)
    assert_bitwise(ref, fus)
    info = opt_f._trainloom_fused
    group = opt_f.param_groups[0]
    assert all(fused._kernel_for(opt_f, group, b) is None for b in info.buckets)
