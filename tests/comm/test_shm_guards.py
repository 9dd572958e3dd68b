"""Exact messages of the shared-memory engine's own argument checks.

Through the public API: a communicator used in a forked child. The rest are guards of the compiled
core that trainloom/comm/shm.py never trips (it validates first); a missing one would read or write
out of the segment, so each is called here directly with the bad argument."""

from __future__ import annotations

import os
import struct
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from trainloom.comm import shm
from trainloom.comm.shm import ReduceOp, ShmCommunicator
from trainloom.errors import CommError

_shm = shm._shm
_, KDT_F32, ES_F32, _ = shm._DTYPES[torch.float32]
DESC = (_shm.OP_BROADCAST, 1, 0, -1, 0, 2, 0, (2,))  # (opkind, seq, dtype, redop, root, numel, extra, shape)


def test_a_communicator_used_in_a_forked_child_names_both_processes():
    """Collectives and sends in a child made by os.fork() after the communicator raise CommError
    (the rank belongs to the parent); the parent's communicator keeps working."""
    store = dist.HashStore()
    comms = [None, None]

    def make(r):
        comms[r] = ShmCommunicator(store, r, 2, prefix="guards/fork", timeout=10.0, slot_bytes=4096)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    c0, c1 = comms
    try:
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            try:
                msgs = []
                for call in (
                    lambda: c0.allreduce(torch.ones(2), torch.ones(2), ReduceOp.SUM),
                    lambda: c0.barrier(),
                    lambda: c0.send(torch.ones(2), 1),
                    lambda: c1.recv(torch.ones(2), 0),
                ):
                    try:
                        call()
                        msgs.append("no error")
                    except Exception as exc:  # noqa: BLE001 - reported to the parent
                        msgs.append(f"{type(exc).__name__}: {exc}")
                os.write(wfd, "\n".join(msgs).encode())
            finally:
                os._exit(0)
        os.close(wfd)
        with os.fdopen(rfd) as fh:
            got = fh.read().split("\n")
        os.waitpid(pid, 0)
        want = (
            f"CommError: this communicator was created in process {os.getpid()} and cannot be used in "
            f"forked child {pid}; create a new one in the child"
        )
        assert got == [want] * 4
        t = torch.full((2,), 3.0)
        c0.send(t, 1)
        r = torch.zeros(2)
        c1.recv(r, 0)
        assert r.tolist() == [3.0, 3.0]
    finally:
        c0.close()
        c1.close()


@pytest.fixture
def segment():
    """make(world, slot_bytes, heap_bytes) -> (engine of rank 0, segment name); unlinked after."""
    made = []

    def make(world=2, slot_bytes=4096, heap_bytes=4096):
        name = f"/tl-shm-{os.getpid()}-guard{len(made)}"
        eng = _shm.Engine.create(name.encode(), 0, world, slot_bytes, 4096, heap_bytes, 77)
        made.append((eng, name))
        return eng, name

    yield make
    for eng, name in made:
        eng.close()
        _shm.Engine.unlink(name.encode())


def _tamper_slot_bytes(name, value):
    """Write ``value`` into the header's slot_bytes (after magic, version, world, generation)."""
    with open(f"/dev/shm{name}", "r+b") as fh:
        fh.seek(24)
        fh.write(struct.pack("<Q", value))


def _attach_with_slot_bytes(eng, name, value):
    _tamper_slot_bytes(name, value)
    _shm.Engine.attach(name.encode(), 1, 2, 77)


def _heap(eng, offset=0):
    return eng.heap_address(0) + offset


def _alltoall_v(eng, n):
    s, sd, r, rd = (np.zeros(n, dtype=np.int64) for _ in range(4))
    x = torch.zeros(8)
    return eng.alltoall_v(DESC, x.data_ptr(), s, sd, x.data_ptr(), r, rd, 4, 1.0)


_SEG = "{name}"  # replaced by the segment's name
# (id, segment kwargs, call(engine, name), exception type, exact message)
GUARDS = [
    (
        "heap_buffer-past-end",
        {},
        lambda e, n: e.heap_buffer(4096, 1),
        ValueError,
        "heap range [4096, 4097) exceeds heap_bytes=4096",
    ),
    # offset + nbytes wrapped past 2**64 to 1 and passed: a buffer one byte before the heap (fixed)
    (
        "heap_buffer-wrapping-sum",
        {},
        lambda e, n: e.heap_buffer(2**64 - 1, 2),
        ValueError,
        "heap range [18446744073709551615, 18446744073709551617) exceeds heap_bytes=4096",
    ),
    (
        "broadcast-zc-not-at-offset",
        {},
        lambda e, n: e.broadcast(DESC, _heap(e, 64), 8, 0, 1.0, 0),
        ValueError,
        "zero-copy offset 0 does not match a tensor inside this rank's heap",
    ),
    (
        "allgather-zc-past-heap",
        {},
        lambda e, n: e.allgather(DESC, _heap(e, 4092), 0, 8, -1, 1.0, 4092),
        ValueError,
        "zero-copy offset 4092 does not match a tensor inside this rank's heap",
    ),
    (
        "allreduce-zc-send-is-not-recv",
        {},
        lambda e, n: e.allreduce(DESC, _heap(e), _heap(e, 8), 2, ES_F32, KDT_F32, 0, 2, -1, 1.0, 0),
        ValueError,
        "zero-copy allreduce needs send is recv inside this rank's heap",
    ),
    (
        "alltoall_v-counts-length",
        {},
        lambda e, n: _alltoall_v(e, 1),
        ValueError,
        "counts and displacements need one entry per rank",
    ),
    (
        "alltoall_v-slot-too-small",
        {"slot_bytes": 32},
        lambda e, n: _alltoall_v(e, 2),
        ValueError,
        "slot too small for the counts of this world size",
    ),
    (
        "send-to-self",
        {},
        lambda e, n: e.send(DESC, _heap(e), 8, 0, 1.0),
        ValueError,
        "send: dst 0 is not a peer of rank 0 in a world of 2",
    ),
    (
        "send-past-world",
        {},
        lambda e, n: e.send(DESC, _heap(e), 8, 2, 1.0),
        ValueError,
        "send: dst 2 is not a peer of rank 0 in a world of 2",
    ),
    (
        "recv-from-self",
        {},
        lambda e, n: e.recv(DESC, _heap(e), 8, 0, 1.0),
        ValueError,
        "recv: src 0 is not a peer of rank 0 in a world of 2",
    ),
    (
        "recv-negative",
        {},
        lambda e, n: e.recv(DESC, _heap(e), 8, -1, 1.0),
        ValueError,
        "recv: src -1 is not a peer of rank 0 in a world of 2",
    ),
    # rank arguments that indexed the segment's tables unchecked (guards added)
    ("peer_pid", {}, lambda e, n: e.peer_pid(2), ValueError, "peer_pid: rank 2 is outside 0..1"),
    ("heap_address", {}, lambda e, n: e.heap_address(2), ValueError, "heap_address: rank 2 is outside 0..1"),
    (
        "set_check_pid",
        {},
        lambda e, n: e.set_check_pid(-1, True),
        ValueError,
        "set_check_pid: rank -1 is outside 0..1",
    ),
    ("desc", {}, lambda e, n: e.desc(2, 0), ValueError, "desc: rank 2 is outside 0..1"),
    ("last_desc", {}, lambda e, n: e.last_desc(-1), ValueError, "last_desc: rank -1 is outside 0..1"),
    ("p2p_info", {}, lambda e, n: e.p2p_info(0, 2), ValueError, "p2p_info: rank 2 is outside 0..1"),
    (
        "attach-size-mismatch",
        {},
        lambda e, n: _attach_with_slot_bytes(e, n, 8192),
        ValueError,
        f"shared-memory segment {_SEG} rejected: layout size mismatch",
    ),
    # 6 slots of 2**63 + 4096 bytes wrap to the true layout's size in size_t and were accepted (fixed)
    (
        "attach-size-wraps",
        {},
        lambda e, n: _attach_with_slot_bytes(e, n, 2**63 + 4096),
        ValueError,
        f"shared-memory segment {_SEG} rejected: layout size mismatch",
    ),
]


@pytest.mark.parametrize("kw,call,exc,msg", [g[1:] for g in GUARDS], ids=[g[0] for g in GUARDS])
def test_engine_guard(segment, kw, call, exc, msg):
    eng, name = segment(**kw)
    with pytest.raises(exc) as info:
        call(eng, name)
    assert str(info.value) == msg.replace(_SEG, name)


def test_engine_used_after_close_says_so(segment):
    eng, _ = segment()
    eng.close()
    with pytest.raises(CommError) as info:
        eng.heap_buffer(0, 8)
    assert str(info.value) == "shared-memory engine used after close()"
