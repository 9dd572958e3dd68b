"""What a communicator books of its pending asynchronous operations: only memory they use, a book no
longer than what is pending, and no pending send lost to another thread (real 2-rank runs, and one
in-process race made deterministic).

Each test failed on the code before it:
- gather and reduce booked ``recv_tensor`` on ranks other than ``dst``, where neither engine reads or
  writes it, so ``w = gather(s, r, 0, async_op=True); send(r, 0)`` on rank 1 waited for the gather,
  which waited for rank 0, which waited in its receive: both ranks timed out (torch's gloo runs it);
- the book of sends and receives dropped finished entries only from its front, so one receive
  pending from the start kept every later send in it (1,001 entries after 1,000 waited sends; each
  collective then scanned them all: 39 -> 422 us);
- ``_pending`` rebuilt the dict of the last send/receive per peer without the queueing lock, so a
  send queued meanwhile by another thread was dropped, and a later send to that peer overtook it
  (messages out of order).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from typing import Any, Dict, List

import pytest
import torch
from commutil import engines
from multiproc import run_ranks

import trainloom.comm as C
from trainloom.comm.group import Communicator, spans_meet, tensor_spans

TIMEOUT = 10  # seconds: the old code failed after this


def _start(engine: str) -> Any:
    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    C.init_process_group(timeout=TIMEOUT)
    C.barrier()
    return C.get_default_group().get_global_communicator()


def _send_of_an_unused_output(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 1: ``w = gather/reduce(s, r, dst=0, async_op=True); send(r, 0); w.wait()``; rank 0:
    ``recv(buf, 1); gather/reduce(s, out, dst=0)``."""
    _start(engine)
    out: Dict[str, Any] = {}
    for which in ("gather", "reduce"):
        s = torch.full((2,), float(rank + 1))
        try:
            if rank == 1:
                r = torch.full((4,), 9.0)
                if which == "gather":
                    w = C.gather(s, r, 0, async_op=True)
                else:
                    w = C.reduce(s, r[:2], 0, async_op=True)
                C.send(r, 0)
                w.wait()
                out[which] = r.tolist()  # not written here
            else:
                buf, res = torch.zeros(4), torch.zeros(4)
                C.recv(buf, 1)
                if which == "gather":
                    C.gather(s, res, 0)
                else:
                    C.reduce(s, res[:2], 0)
                out[which] = (buf.tolist(), res.tolist())
        except C.CommError as exc:
            out[which] = f"{type(exc).__name__}: {exc}"
            break
    C.destroy_process_group()
    return out


@pytest.mark.parametrize("engine", engines())
def test_a_send_of_the_output_gather_or_reduce_leaves_alone_off_dst_does_not_wait_for_them(engine):
    r0, r1 = run_ranks(_send_of_an_unused_output, 2, engine, timeout=60)
    assert r0 == {"gather": ([9.0] * 4, [1.0, 1.0, 2.0, 2.0]), "reduce": ([9.0] * 4, [3.0, 3.0, 0.0, 0.0])}
    assert r1 == {"gather": [9.0] * 4, "reduce": [9.0] * 4}


def _sends_behind_a_pending_receive(rank: int, ws: int, n: int) -> Dict[str, Any]:
    c = _start("shm")
    out: Dict[str, Any] = {}
    if rank == 0:
        late = torch.zeros(1)
        pending = C.recv(late, 1, async_op=True)  # rank 1 sends it only after all the others
        sizes: List[int] = []
        for i in range(n):
            C.send(torch.full((1,), float(i)), 1, async_op=True).wait()
            sizes.append(len(c._p2p_book))
        pending.wait()
        out.update(largest=max(sizes), last=sizes[-1], late=late.item())
    else:
        got = torch.zeros(n)
        for i in range(n):
            C.recv(got[i : i + 1], 0)
        C.send(torch.full((1,), -1.0), 0)
        out["received"] = got.tolist() == [float(i) for i in range(n)]
    C.destroy_process_group()
    return out


def test_the_send_receive_book_stays_short_behind_a_long_pending_receive():
    n = 300
    r0, r1 = run_ranks(_sends_behind_a_pending_receive, 2, n, timeout=60)
    assert r1 == {"received": True}
    assert r0["late"] == -1.0
    # what is pending (the receive, the last send) plus at most 64 finished ones (the old book: n + 1)
    assert r0["largest"] <= 66, r0
    assert r0["last"] < n // 2, r0


class _PausingFuture(concurrent.futures.Future):
    """A finished future whose second ``done()`` from ``thread`` (the prune's, after the check that
    something finished) waits for ``go``, after saying so."""

    def __init__(self) -> None:
        super().__init__()
        self.set_result(None)
        self.paused = threading.Event()
        self.go = threading.Event()
        self.thread: Any = None
        self.calls = 0

    def done(self) -> bool:
        if threading.current_thread() is self.thread:
            self.calls += 1
            if self.calls == 2:
                self.paused.set()
                self.go.wait(10)
        return super().done()


def _bare_communicator() -> Communicator:
    """The bookkeeping of a Communicator, without engines or a store (what ``_pending`` reads)."""
    c = Communicator.__new__(Communicator)
    c._submit_lock = threading.RLock()
    c._last = None
    c._fence = None
    c._p2p_last = {}
    c._coll_book = collections.deque()
    c._p2p_book = collections.deque()
    return c


def test_a_send_queued_by_another_thread_while_pending_prunes_finished_ones_is_kept():
    # Thread A (a collective's _pending) prunes the finished send to peer 1 and is paused inside;
    # thread B queues a new send to peer 1 the way _execute_cpu does (under _submit_lock). The new
    # send must survive A's prune, or a later send to peer 1 would not wait for it.
    c = _bare_communicator()
    finished = _PausingFuture()
    c._p2p_last["send:1"] = finished
    new: concurrent.futures.Future = concurrent.futures.Future()
    a = threading.Thread(target=lambda: c._pending(None))
    finished.thread = a
    a.start()
    assert finished.paused.wait(10)

    def queue_a_send() -> None:
        with c._submit_lock:
            c._p2p_last["send:1"] = new

    b = threading.Thread(target=queue_a_send)
    b.start()
    b.join(0.2)  # fixed: B waits for A's lock; old code: B is done at once, and A then drops its send
    finished.go.set()
    a.join(10)
    b.join(10)
    assert not a.is_alive() and not b.is_alive()
    assert c._p2p_last.get("send:1") is new
    assert c._pending("send:1") == [new]  # a later send to peer 1 waits for it


def _meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    (sa,), (sb,) = tensor_spans([a]), tensor_spans([b])
    return spans_meet(sa, sb) and spans_meet(sb, sa)


def test_spans_meet_only_where_two_views_share_an_element():
    m = torch.zeros(4, 3)
    x = torch.zeros(12)
    z = torch.zeros(5, dtype=torch.complex64)
    # interleaved address ranges, no element in common
    assert not _meet(m[:, 0], m[:, 1])
    assert not _meet(m[:, 0], m[:, 1:])
    assert not _meet(x[0::2], x[1::2])
    assert not _meet(x[0::3], x[1::3].view(2, 2))
    assert not _meet(z.real, z.imag)
    assert not _meet(m[0::2], m[1::2])  # even and odd rows
    # sharing elements
    assert _meet(m[:, 0], m[0, :])  # m[0, 0]
    assert _meet(m.t(), m)
    assert _meet(x[0::2], x[4:5])
    assert _meet(x[0::2], x[0::3])  # x[0], x[6]
    assert _meet(z.real, z)
    assert not _meet(m[:, 0], m[:, 0].clone())  # other memory
    assert _meet(x[:1].expand(3), x[0::4])  # a zero stride
    assert not _meet(x[1:2].expand(3), x[0::2])
    # contiguous parts: the ranges decide
    assert _meet(x[:6], x[5:])
    assert not _meet(x[:6], x[6:])
