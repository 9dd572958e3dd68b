"""Exact messages of the fused kernels' own argument checks.

fuse_optimizer (trainloom/optim/fused.py) builds every plan, pointer and dtype code itself, so none
of these is reachable through it. The kernels run over raw pointers without bounds checks: a plan
array shorter than the other, an unknown dtype code (read as float64 over a float32 buffer) or a
null pointer would read or write out of bounds, so each guard is called here directly."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from trainloom.optim import _fused as K
from trainloom.optim import fused

_T = torch.zeros(64, dtype=torch.float64)  # every buffer; no kernel runs
P = _T.data_ptr()
I2, I1 = np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64)
_VML = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong)


@pytest.fixture
def vml(request):
    """Install a do-nothing square root (param True) or none (False), or leave it (None); the real
    state comes back."""
    if request.param is None:
        yield
        return
    was = K.has_vml_sqrt()
    noop = _VML(lambda *a: None)
    addr = ctypes.cast(noop, ctypes.c_void_p).value
    K.set_vml_sqrt(addr, addr, 0) if request.param else K.set_vml_sqrt(0, 0, 0)
    try:
        yield
    finally:
        K.set_vml_sqrt(0, 0, 0)
        if was:
            assert fused._install_vml()


_ADAM = dict(w=0.1, b2=0.999, c2=0.001, bc2s=1.0, eps=1e-8, nss=-0.1, wd=0.0, decay=1.0)
_FLAGS = dict(amsgrad=False, maximize=False, l2=False, decoupled=False)
BASE = {
    K.vml_sqrt: dict(dtype=K.DTYPE_F64, src=P, dst=P, n=1),
    K.adam_loop_step: dict(
        dtype=0, p=P, g=P, m=P, v=P, vmax=0, i_start=I1, i_len=I1, i_body=I1, **_ADAM, **_FLAGS, nthreads=1
    ),
    K.adam_step: dict(
        dtype=0,
        p=P,
        g=P,
        m=P,
        v=P,
        vmax=0,
        i_start=I1,
        i_len=I1,
        i_body=I1,
        **_ADAM,
        **_FLAGS,
        body_v_alt=0,
        tail_v_alt=0,
        nthreads=1,
    ),
    K.adam_moments: dict(
        dtype=0,
        p=P,
        g=P,
        m=P,
        v=P,
        vmax=0,
        i_start=I1,
        i_len=I1,
        i_body=I1,
        w=0.1,
        b2=0.999,
        c2=0.001,
        wd=0.0,
        amsgrad=False,
        maximize=False,
        l2=False,
        nthreads=1,
    ),
    K.adam_apply: dict(
        dtype=0,
        p=P,
        m=P,
        sq=P,
        i_start=I1,
        i_len=I1,
        bc2s=1.0,
        eps=1e-8,
        nss=-0.1,
        decay=1.0,
        decoupled=False,
        nthreads=1,
    ),
    K.sgd_step: dict(
        dtype=0,
        p=P,
        g=P,
        buf=P,
        i_start=I1,
        i_len=I1,
        i_body=I1,
        lr=0.1,
        wd=0.0,
        momentum=0.9,
        dampening=0.0,
        nesterov=False,
        maximize=False,
        first=True,
        tail_alt=0,
        nthreads=1,
    ),
}


def _call(fn, **change):
    return fn(**{**BASE[fn], **change})


class _Param:
    def data_ptr(self):
        return P


def _scan(n_params, step_objs):
    out = np.zeros(n_params, dtype=np.uint8)
    ptrs = np.zeros(n_params, dtype=np.int64)
    return K.scan([_Param()] * n_params, [None] * n_params, ptrs, ptrs, {}, (), [], step_objs, 0, out)


# (id, square root installed (None: either), call, exception type, exact message)
GUARDS = [
    (
        "vml_sqrt-none-installed",
        False,
        lambda: _call(K.vml_sqrt),
        ValueError,
        "vml_sqrt: no square root installed; call set_vml_sqrt first",
    ),
    (
        "vml_sqrt-null-src",
        True,
        lambda: _call(K.vml_sqrt, src=0),
        ValueError,
        "vml_sqrt: null pointer or negative count",
    ),
    (
        "vml_sqrt-negative-count",
        True,
        lambda: _call(K.vml_sqrt, n=-1),
        ValueError,
        "vml_sqrt: null pointer or negative count",
    ),
    # any code but float32 ran the float64 root, over twice the bytes of a float32 buffer (fixed)
    (
        "vml_sqrt-dtype",
        True,
        lambda: _call(K.vml_sqrt, dtype=7),
        ValueError,
        "vml_sqrt: unsupported dtype code 7",
    ),
    (
        "adam_loop_step-none-installed",
        False,
        lambda: _call(K.adam_loop_step),
        ValueError,
        "adam_loop_step: no square root installed; call set_vml_sqrt first",
    ),
    (
        "adam_loop_step-plan",
        True,
        lambda: _call(K.adam_loop_step, i_len=I2),
        ValueError,
        "adam_loop_step: plan arrays differ in length",
    ),
    (
        "adam_loop_step-body",
        True,
        lambda: _call(K.adam_loop_step, i_body=I2),
        ValueError,
        "adam_loop_step: plan arrays differ in length",
    ),
    (
        "adam_loop_step-dtype",
        True,
        lambda: _call(K.adam_loop_step, dtype=2),
        ValueError,
        "adam_loop_step: unsupported dtype code 2",
    ),
    (
        "adam_loop_step-null",
        True,
        lambda: _call(K.adam_loop_step, amsgrad=True),
        ValueError,
        "adam_loop_step: null buffer pointer",
    ),
    (
        "adam_step-plan",
        None,
        lambda: _call(K.adam_step, i_body=I2),
        ValueError,
        "adam_step: plan arrays differ in length",
    ),
    (
        "adam_step-dtype",
        None,
        lambda: _call(K.adam_step, dtype=-1),
        ValueError,
        "adam_step: unsupported dtype code -1",
    ),
    (
        "adam_moments-plan",
        None,
        lambda: _call(K.adam_moments, i_len=I2),
        ValueError,
        "adam_moments: plan arrays differ in length",
    ),
    (
        "adam_moments-body",
        None,
        lambda: _call(K.adam_moments, i_body=I2),
        ValueError,
        "adam_moments: plan arrays differ in length",
    ),
    (
        "adam_moments-dtype",
        None,
        lambda: _call(K.adam_moments, dtype=2),
        ValueError,
        "adam_moments: unsupported dtype code 2",
    ),
    (
        "adam_moments-null",
        None,
        lambda: _call(K.adam_moments, v=0),
        ValueError,
        "adam_moments: null buffer pointer",
    ),
    (
        "adam_apply-plan",
        None,
        lambda: _call(K.adam_apply, i_start=I2),
        ValueError,
        "adam_apply: plan arrays differ in length",
    ),
    (
        "adam_apply-dtype",
        None,
        lambda: _call(K.adam_apply, dtype=2),
        ValueError,
        "adam_apply: unsupported dtype code 2",
    ),
    (
        "adam_apply-null",
        None,
        lambda: _call(K.adam_apply, sq=0),
        ValueError,
        "adam_apply: null buffer pointer",
    ),
    (
        "sgd_step-plan",
        None,
        lambda: _call(K.sgd_step, i_body=I2),
        ValueError,
        "sgd_step: plan arrays differ in length",
    ),
    (
        "steps_equal-null",
        None,
        lambda: K.steps_equal(np.array([P, 0], dtype=np.int64), 1.0),
        ValueError,
        "steps_equal: null pointer at index 1",
    ),
    (
        "same_state-sizes",
        None,
        lambda: K.same_state({}, [{}], I2, []),
        ValueError,
        "same_state: dicts and sizes differ in length",
    ),
    (
        "same_state-not-a-dict",
        None,
        lambda: K.same_state([], [], I2[:0], []),
        TypeError,
        "same_state: state must be a dict, got list",
    ),
    (
        "scan-lengths",
        None,
        lambda: K.scan([], [None], I1, I1, {}, (), [], None, 0, np.zeros(1, np.uint8)),
        ValueError,
        "scan: argument lengths differ",
    ),
    ("scan-step_objs", None, lambda: _scan(2, [None]), ValueError, "scan: step_objs length differs"),
]


@pytest.mark.parametrize(
    "vml,call,exc,msg", [g[1:] for g in GUARDS], ids=[g[0] for g in GUARDS], indirect=["vml"]
)
def test_kernel_guard(vml, call, exc, msg):
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc
    assert str(info.value) == msg


@pytest.mark.skipif(K.cpu_has_avx2(), reason="this CPU has AVX2/FMA: set_isa('avx2') is allowed here")
def test_set_isa_avx2_without_the_instructions():
    with pytest.raises(ValueError) as info:
        K.set_isa("avx2")
    assert str(info.value) == "set_isa('avx2'): this CPU lacks AVX2/FMA; use 'scalar'"
