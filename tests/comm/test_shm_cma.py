"""Cross-memory attach (process_vm_readv) in the shared-memory engine: the probe at creation, the
agreed fallback to the slot path, both paths giving the same bits on 2, 3 and 4 processes, the
memory-bound path with streaming stores, and a read that fails in the middle of an op."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
import sys

import pytest
import torch
from multiproc import run_ranks
from test_shm import _catch, _comm, _leftovers  # noqa: E402  (tests/comm is on sys.path)

from trainloom.comm import shm
from trainloom.comm.shm import ShmCommunicator
from trainloom.errors import CommError

_shm = shm._shm
PR_SET_DUMPABLE = 4


CAP_SYS_PTRACE = 19


def _undumpable():
    # A non-dumpable process refuses ptrace access (and so process_vm_readv) to other processes
    # of the same user that lack CAP_SYS_PTRACE: a real way to make a read fail with EPERM.
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _drop_ptrace_cap():
    # Tests may run as root (containers): drop CAP_SYS_PTRACE from this process's effective set
    # so that it is refused like an ordinary user (a no-op for a user without capabilities).
    libc = ctypes.CDLL(None, use_errno=True)
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # 2 x {effective, permitted, inheritable}
    if libc.capget(hdr, data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    data[0] &= ~(1 << CAP_SYS_PTRACE)
    if libc.capset(hdr, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _capture_log():
    h = _Lines()
    lg = logging.getLogger("trainloom.comm")
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    return h


def _ops(comm, rank, world, sizes, offset=0):
    """allgather (out of place and in place), gather, alltoall (out of place and in place) and an
    uneven alltoall_v for each element count; returns the result bytes (bitwise comparison) and
    the list of wrong results, checked against references built here."""
    wrong, blobs = [], []
    for n in sizes:
        base = torch.arange(n, dtype=torch.float32) * 0.37 + 1000 * rank
        want_all = torch.cat([torch.arange(n, dtype=torch.float32) * 0.37 + 1000 * p for p in range(world)])
        # recv as a view at an element offset: an unaligned destination for the streaming copy
        buf = torch.full((world * n + offset,), -1.0)
        r = buf[offset:]
        comm.allgather(base, r)
        if not torch.equal(r, want_all):
            wrong.append(("allgather", n))
        blobs.append(r.clone())
        r2 = torch.full((world * n,), -1.0)
        r2[rank * n : (rank + 1) * n] = base
        comm.allgather(r2[rank * n : (rank + 1) * n], r2)
        if not torch.equal(r2, want_all):
            wrong.append(("allgather in place", n))
        g = torch.full((world * n,), -1.0)
        comm.gather(base, g, world - 1)
        if rank == world - 1 and not torch.equal(g, want_all):
            wrong.append(("gather", n))
        s = torch.arange(world * n, dtype=torch.int64) + 10_000 * rank
        a = torch.empty(world * n, dtype=torch.int64)
        comm.alltoall(s, a)
        want = torch.cat([torch.arange(rank * n, (rank + 1) * n) + 10_000 * p for p in range(world)])
        if not torch.equal(a, want):
            wrong.append(("alltoall", n))
        blobs.append(a.clone())
        comm.alltoall(s, s)  # in place: falls back to the slots on every rank
        if not torch.equal(s, want):
            wrong.append(("alltoall in place", n))
        # alltoall_v: rank p sends (p + q + 1) * n elements to rank q (uneven, none to itself on rank 0)
        scount = [0 if (rank == 0 and q == 0) else (rank + q + 1) * n for q in range(world)]
        sdispl = [sum(scount[:q]) + q for q in range(world)]  # gaps between the pieces
        sendv = torch.arange(sum(scount) + world, dtype=torch.float64) + 0.5 * rank
        rcount = [0 if (rank == 0 and p == 0) else (p + rank + 1) * n for p in range(world)]
        rdispl = [sum(rcount[:p]) for p in range(world)]
        recvv = torch.full((sum(rcount),), -1.0, dtype=torch.float64)
        comm.alltoall_v(sendv, scount, sdispl, recvv, rcount, rdispl)
        parts = []
        for p in range(world):
            c = rcount[p]
            psc = [0 if (p == 0 and q == 0) else (p + q + 1) * n for q in range(world)]
            d = sum(psc[:rank]) + rank
            parts.append(torch.arange(d, d + c, dtype=torch.float64) + 0.5 * p)
        if not torch.equal(recvv, torch.cat(parts)):
            wrong.append(("alltoall_v", n))
        blobs.append(recvv.clone())
    return wrong, [b.numpy().tobytes() for b in blobs]


def _w_paths(rank, world):
    res = {}
    # tiny slots and a 4 KiB threshold: small tensors exercise every path
    sizes = [0, 1, 1000, 3001]
    for name, kw in (("cma", {"cma": True}), ("slot", {"cma": False})):
        comm = _comm(rank, world, prefix=f"test/cma/{name}", slot_bytes=4096, cma_bytes=4096, **kw)
        wrong, blobs = _ops(comm, rank, world, sizes, offset=1)
        # steps of a 40 KB allgather: 2 with cross-memory attach (first step + completion),
        # one per 4 KiB slot otherwise
        s0 = comm._engine.step
        comm.allgather(torch.ones(10_000), torch.empty(world * 10_000))
        steps = comm._engine.step - s0
        res[name] = (comm.cma, comm.cma_bytes, wrong, blobs, steps)
        comm.close()
    # memory-bound sizes (big_bytes lowered on every rank): slots with streaming stores
    comm = _comm(rank, world, prefix="test/cma/big", slot_bytes=4096, cma_bytes=4096, cma=True)
    comm._engine.big_bytes = 64 << 10
    wrong, blobs = _ops(comm, rank, world, [3001, 20_000], offset=3)
    s0 = comm._engine.step
    comm.allgather(torch.ones(10_000), torch.empty(world * 10_000))
    res["big"] = (comm.cma, wrong, blobs, comm._engine.step - s0)
    comm.close()
    return res, os.getpid()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cma_and_slot_paths_give_the_same_bits(world):
    out = run_ranks(_w_paths, world, timeout=120)
    for rank, (res, _) in enumerate(out):
        cma_on, thr, wrong, blobs, steps = res["cma"]
        assert cma_on and thr == 4096, "the probe must succeed on this machine"
        assert wrong == [], (rank, wrong)
        assert steps == 2, steps  # the cross-memory path really ran
        slot_on, _, wrong_s, blobs_s, steps_s = res["slot"]
        assert not slot_on and wrong_s == [], (rank, wrong_s)
        assert steps_s > 2 * world, steps_s
        assert blobs == blobs_s  # same bits on both paths
        big_on, wrong_b, _, steps_b = res["big"]
        assert big_on and wrong_b == [], (rank, wrong_b)
        assert steps_b > 2 * world, steps_b  # memory-bound: the slot path, not cross-memory attach
        # every rank got bitwise the same allgather results
        assert res["cma"][3][0::3] == out[0][0]["cma"][3][0::3]
    assert _leftovers([o[1] for o in out]) == []


def _w_probe(rank, world, how):
    h = _capture_log()
    kw = {"cma": True}
    if how == "undumpable":
        _drop_ptrace_cap()
        if rank == 1:
            _undumpable()
    if how == "option" and rank == world - 1:
        kw["cma"] = False
    if how.startswith("env"):
        # cma=None: the environment decides ("1" on; rank 0 says "0" in the "env" case)
        kw = {}
        os.environ[shm.CMA_ENV] = "0" if (how == "env" and rank == 0) else "1"
    if how == "default":
        kw = {}
        os.environ.pop(shm.CMA_ENV, None)
    if how == "env_words":
        kw = {}
        os.environ[shm.CMA_ENV] = ["true", "YES", " On\n"][rank % 3]
    if how == "env_bogus":
        kw = {}
        os.environ[shm.CMA_ENV] = "yes please"
    comm = _comm(rank, world, prefix=f"test/probe/{how}", slot_bytes=4096, cma_bytes=4096, **kw)
    wrong, _ = _ops(comm, rank, world, [3001])
    on = comm.cma
    comm.close()
    return on, wrong, [ln for ln in h.lines if "cross-memory attach" in ln[1]]


@pytest.mark.parametrize(
    "how", ["undumpable", "option", "env", "env_on", "env_words", "env_bogus", "default"]
)
def test_probe_failure_or_opt_out_turns_cma_off_on_every_rank(how):
    out = run_ranks(_w_probe, 3, how, timeout=60)
    for rank, (on, wrong, lines) in enumerate(out):
        assert wrong == [], (rank, wrong)
        if how in ("env_on", "env_words"):
            assert on is True and lines == [], (rank, lines)
            continue
        if how == "env_bogus":
            assert on is False
            assert lines[0] == (
                "WARNING",
                "TRAINLOOM_SHM_CMA='yes please' is not one of 1/true/yes/on or 0/false/no/off; "
                "cross-memory attach stays off",
            ), lines
            lines = lines[1:]
            assert len(lines) == 1 and lines[0][0] == "DEBUG" and "not enabled on rank 0" in lines[0][1], (
                lines
            )
            continue
        assert on is False, (rank, how)
        assert len(lines) == 1, lines  # one log line per rank
        ((level, line),) = lines
        if how == "undumpable":
            assert level == "WARNING" and "cannot read rank 1" in line, lines
            assert "Operation not permitted" in line, lines
        elif how == "option":
            want = "not enabled on rank 2 (cma=False, or cma=None without TRAINLOOM_SHM_CMA=1)"
            assert want in line, lines
            assert level == ("DEBUG" if rank == 2 else "INFO"), lines
        elif how == "env":
            assert "not enabled on rank 0" in line and level == ("DEBUG" if rank == 0 else "INFO"), lines
        else:
            assert level == "DEBUG", lines  # off by default, quietly


def _w_read_fails(rank, world):
    _drop_ptrace_cap()
    comm = _comm(rank, world, prefix="test/cma/eperm", slot_bytes=4096, cma_bytes=4096, cma=True)
    on = comm.cma
    comm.barrier()
    if rank == 1:
        _undumpable()  # after the probe: rank 0's next read of rank 1 fails
    comm.barrier()
    n = 5000
    msg = _catch(lambda: comm.allgather(torch.ones(n), torch.empty(world * n)))
    after = _catch(lambda: comm.barrier())
    comm.close()
    return on, msg, after


def test_a_read_that_fails_during_an_op_raises_on_every_rank():
    out = run_ranks(_w_read_fails, 2, timeout=60)
    (on0, msg0, after0), (on1, msg1, after1) = out
    assert on0 and on1
    assert "shm allgather #3 on rank 0/2" in msg0, msg0
    assert "reading rank 1's buffer" in msg0 and "Operation not permitted" in msg0, msg0
    assert "cma=False (or leave TRAINLOOM_SHM_CMA unset)" in msg0, msg0
    assert "aborted by rank 0 (reading a peer's memory with process_vm_readv failed there)" in msg1, msg1
    assert "aborted by rank 0" in after0 and "aborted by rank 0" in after1


def _w_mismatch(rank, world):
    comm = _comm(rank, world, prefix="test/cma/mismatch", slot_bytes=4096, cma_bytes=4096, cma=True)
    # 5000 floats (20 KB: cross-memory attach) against 500 (2 KB: the slot path)
    n = 5000 if rank == 0 else 500
    m1 = _catch(lambda: comm.allgather(torch.ones(n), torch.empty(world * n)))
    m2 = _catch(lambda: comm.alltoall(torch.ones(world * n), torch.empty(world * n)))
    t = torch.full((3000,), float(rank))
    r = torch.empty(world * 3000)
    comm.allgather(t, r)  # still in step
    ok = torch.equal(r, torch.arange(world, dtype=torch.float32).repeat_interleave(3000))
    comm.close()
    return m1, m2, ok


def test_size_mismatch_between_cma_and_slot_sized_calls_raises_on_every_rank():
    out = run_ranks(_w_mismatch, 2, timeout=60)
    for m1, m2, ok in out:
        assert ok
        assert "ranks disagree" in m1 and "numel=5000 " in m1 and "numel=500 " in m1, m1
        assert "ranks disagree" in m2 and "numel=10000 " in m2 and "numel=1000 " in m2, m2


def test_cma_read_reports_a_gone_process_and_bad_arguments():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(OSError) as ei:
        _shm.cma_read(child.pid, 4096, 8)
    assert ei.value.errno == errno.ESRCH
    x = ctypes.c_uint64(0x1234_5678_9ABC)
    assert _shm.cma_read(os.getpid(), ctypes.addressof(x), 8) == bytes(x)
    with pytest.raises(OSError) as ei:
        _shm.cma_read(os.getpid(), 8, 8)  # unmapped address
    assert ei.value.errno == errno.EFAULT


def test_cma_environment_words_and_one_warning(monkeypatch, caplog):
    for word in ("1", "true", "True", "YES", "on", " ON \n"):
        monkeypatch.setenv(shm.CMA_ENV, word)
        assert shm._cma_from_env() is True, word
    for word in ("", "0", "false", "No", "OFF", " "):
        monkeypatch.setenv(shm.CMA_ENV, word)
        assert shm._cma_from_env() is False, word
    monkeypatch.delenv(shm.CMA_ENV)
    assert shm._cma_from_env() is False
    assert caplog.records == []
    monkeypatch.setattr(shm, "_cma_env_warned", False)
    caplog.set_level(logging.WARNING, logger="trainloom.comm")
    for word in ("2", "enable", "2"):
        monkeypatch.setenv(shm.CMA_ENV, word)
        assert shm._cma_from_env() is False
    assert [r.getMessage() for r in caplog.records] == [
        "TRAINLOOM_SHM_CMA='2' is not one of 1/true/yes/on or 0/false/no/off; cross-memory attach stays off"
    ]


def test_bad_cma_arguments():
    with pytest.raises(ValueError, match="cma must be None, True or False, got 1"):
        ShmCommunicator(None, 0, 1, prefix="x", cma=1)
    with pytest.raises(ValueError, match="cma_bytes must be an int >= 1, got 0"):
        ShmCommunicator(None, 0, 1, prefix="x", cma_bytes=0)


def test_world_size_one_has_cma_off():
    import datetime

    import torch.distributed as dist
    from multiproc import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, datetime.timedelta(seconds=10))
    comm = ShmCommunicator(store, 0, 1, prefix="w1cma", cma=True)
    try:
        assert comm.cma is False
        t = torch.arange(5.0)
        r = torch.empty(5)
        comm.allgather(t, r)
        assert torch.equal(r, t)
    finally:
        comm.close()
    with pytest.raises(CommError, match="used after close"):
        comm.cma  # noqa: B018
