"""The compiled kernels directly: plans, argument checks, 64-bit offsets, threads, GIL release."""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest
import torch
from optimutil import require_kernel

from trainloom.optim import _fused as K


def _plan(starts, lens, chunk=1 << 16):
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    return K.make_plan(starts, lens, lens.copy(), chunk)


def _sgd_ref(p, g, buf, lr=0.1, momentum=0.9):
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum)
    p.grad = g
    if buf is not None:
        opt.state[p]["momentum_buffer"] = buf
    opt.step()


def test_make_plan_splits_segments_and_rejects_bad_ones():
    starts, lens, bodies = K.make_plan(
        np.array([0, 100], dtype=np.int64),
        np.array([10, 150], dtype=np.int64),
        np.array([8, 144], dtype=np.int64),
        64,
    )
    assert starts.tolist() == [0, 100, 164, 228]
    assert lens.tolist() == [10, 64, 64, 22]
    assert bodies.tolist() == [8, 64, 64, 16]
    with pytest.raises(ValueError, match=r"segment 0 is invalid \(start=0, length=4, body=5\)"):
        K.make_plan(
            np.array([0], dtype=np.int64), np.array([4], dtype=np.int64), np.array([5], dtype=np.int64), 64
        )
    with pytest.raises(ValueError, match="chunk must be positive, got 0"):
        _plan([0], [4], 0)
    with pytest.raises(ValueError, match="same length"):
        K.make_plan(np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(2, dtype=np.int64), 64)


def test_kernel_argument_errors():
    plan = _plan([0], [4])
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="unsupported dtype code 7"):
        K.sgd_step(7, t.data_ptr(), t.data_ptr(), 0, *plan, 0.1, 0.0, 0.0, 0.0, False, False, False, 0, 1)
    with pytest.raises(ValueError, match="sgd_step: null buffer pointer"):
        K.sgd_step(0, t.data_ptr(), t.data_ptr(), 0, *plan, 0.1, 0.0, 0.9, 0.0, False, False, False, 0, 1)
    with pytest.raises(ValueError, match="adam_step: null buffer pointer"):
        K.adam_step(
            0,
            t.data_ptr(),
            0,
            t.data_ptr(),
            t.data_ptr(),
            0,
            *plan,
            0.1,
            0.999,
            0.001,
            1.0,
            1e-8,
            -0.1,
            0.0,
            1.0,
            False,
            False,
            False,
            False,
            0,
            1,
            1,
        )
    with pytest.raises(ValueError, match="unknown kernel flavour 'sse'"):
        K.set_isa("sse")
    with pytest.raises(ValueError, match="bump_steps: null pointer at index 0"):
        K.bump_steps(np.zeros(1, dtype=np.int64), 1.0)


def test_offsets_beyond_2_to_31_elements():
    """Segments that start past element 2**31 are addressed with 64-bit offsets (only the touched
    pages of the 8 GiB virtual buffer are ever committed)."""
    require_kernel("sgd", "loop")
    n = 64
    base = (1 << 31) + 1000
    try:
        big = torch.empty(base + 4 * n + 64, dtype=torch.float32)
    except RuntimeError as exc:  # pragma: no cover - a machine that refuses 8 GiB of address space
        pytest.skip(f"cannot reserve 8 GiB of address space: {exc}")
    p0, g0 = torch.randn(n), torch.randn(n)
    big[base : base + n] = p0
    big[base + n : base + 2 * n] = g0
    big[base + 2 * n : base + 3 * n] = 0
    ptr = big.data_ptr()
    # p, g and buf are three regions of one buffer: pointers differ by n elements each
    plan = _plan([base], [n])
    K.sgd_step(0, ptr, ptr + 4 * n, ptr + 8 * n, *plan, 0.1, 0.0, 0.9, 0.0, False, False, True, 0, 1)
    ref = p0.clone()
    _sgd_ref(ref, g0.clone(), None)
    assert torch.equal(big[base : base + n], ref)
    assert torch.equal(big[base + 2 * n : base + 3 * n], g0)  # first step: buffer = gradient
    del big


def test_two_threads_give_the_same_bits_as_one():
    n = 300_001
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    outs = []
    for nt in (1, 2):
        pp, m, v = p.clone(), torch.zeros(n), torch.zeros(n)
        plan = K.make_plan(
            np.array([0], dtype=np.int64),
            np.array([n], dtype=np.int64),
            np.array([n - n % 8], dtype=np.int64),
            4096,
        )
        for _ in range(3):
            K.adam_step(
                0,
                pp.data_ptr(),
                g.data_ptr(),
                m.data_ptr(),
                v.data_ptr(),
                0,
                *plan,
                0.1,
                0.999,
                0.001,
                0.5,
                1e-8,
                -1e-3,
                0.0,
                1.0,
                False,
                False,
                False,
                False,
                0,
                1,
                nt,
            )
        outs.append(pp)
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(p, outs[0])  # the kernel really moved the parameters


def _ticks_while(call) -> int:
    """Count main-thread loop iterations while another thread runs `call` (a C call)."""
    started, done = threading.Event(), threading.Event()

    def work():
        started.set()
        call()
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    ticks = 0
    while not done.is_set():
        ticks += 1  # needs the GIL: stalls for as long as the C call holds it
    t.join()
    return ticks


def test_kernels_release_the_gil():
    """The main thread keeps running during kernel calls in another thread, but not during a C
    call of the same length made through ctypes.PyDLL, which holds the GIL."""
    n = 4_000_000
    p, g, buf = torch.randn(n), torch.randn(n), torch.zeros(n)
    plan = _plan([0], [n])

    def one():
        K.sgd_step(
            0,
            p.data_ptr(),
            g.data_ptr(),
            buf.data_ptr(),
            *plan,
            0.1,
            0.0,
            0.9,
            0.0,
            False,
            False,
            False,
            0,
            1,
        )

    t0 = time.perf_counter()
    one()
    reps = max(1, int(0.3 / max(1e-4, time.perf_counter() - t0)))

    def kernel():
        # ~0.3 s in all: long next to the 5 ms GIL switch interval, which is about how long the
        # main thread gets to run after a GIL-holding call returns
        for _ in range(reps):
            one()

    usleep = ctypes.PyDLL(None).usleep  # PyDLL: the GIL stays held during the call
    released = _ticks_while(kernel)
    held = _ticks_while(lambda: usleep(300_000))
    assert released > 3 * held + 100, (released, held)
