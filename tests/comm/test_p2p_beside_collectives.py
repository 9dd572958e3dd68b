"""Sends and receives pending beside a collective, on both CPU engines (2 real ranks, 10 s timeout).

torch.distributed's gloo runs ``w = irecv(buf, 1); all_reduce(x); w.wait()`` on rank 0 against
``all_reduce(x); send(t, 0)`` on rank 1 (checked with torch 2.13: it returns at once). trainloom's
collectives used to wait for every pending send and receive on their communicator, so rank 0's
allreduce waited for its receive, which waited for rank 1's send, which came after rank 1's allreduce:
every rank raised CommTimeoutError after the timeout. Now a CPU collective waits only for the pending
sends and receives whose tensors share memory with its own (Communicator._p2p_book), and both
engines run sends and receives beside a collective. The patterns of the first three tests timed out
on the old code; the next ones check that overlapping operations are still ordered (and that a
disjoint part of the same tensor is not).

The reverse, ``w = allreduce(x, async_op=True); send(t, 1); w.wait()`` on rank 0 against
``recv(buf, 0); allreduce(x)`` on rank 1 (and with the receive and send swapped), torch's gloo runs
too (checked with torch 2.13); trainloom's sends and receives waited for every earlier collective,
so both ranks timed out. Now a send or receive waits only for the pending asynchronous collectives
booked with memory that intersects its tensor (Communicator._coll_book). Each of the 22
patterns of the three "after" tests, run alone against the previous commit, timed out on both
engines, as did the two other-memory steps of the two-node test; the overlap tests that follow
them failed in every step with the waits taken out. The threaded rules that remain come last.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from commutil import engines
from multiproc import run_ranks

import trainloom.comm as C
from trainloom.comm import classic
from trainloom.comm import neighbor as N
from trainloom.errors import CommError

ENGINES = engines()
TIMEOUT = 10  # seconds: the old code failed after this, not after the default 5 minutes
BIG = 1 << 18  # float32 elements: 1 MiB, more than the shm pair channel (2 x 256 KiB), so a send waits


def _start(engine: str) -> None:
    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    C.init_process_group(timeout=TIMEOUT)
    C.barrier()


def _run(engine: str, steps: List[Tuple[str, Callable[[], Any]]]) -> Dict[str, Any]:
    """Run ``steps`` in order on this rank; each result under its name. The first CommError ends the
    run (its text under ``"error"``: what the old code gave), so a failing rank returns in seconds."""
    _start(engine)
    out: Dict[str, Any] = {"engine": C.get_default_group().get_global_communicator().cpu_engine_kind()}
    t0 = time.monotonic()
    for name, step in steps:
        try:
            out[name] = step()
        except CommError as exc:
            out["error"] = f"{name}: {type(exc).__name__}: {exc}"
            break
    out["seconds"] = time.monotonic() - t0  # for failure messages: a wait until the timeout is a CommError
    C.destroy_process_group()
    return out


def _collectives(rank: int) -> Dict[str, Callable[[], Any]]:
    """Collectives on tensors no send or receive uses, each returning its result as a list."""

    def allreduce() -> List[float]:
        x = torch.full((4,), float(rank + 1))
        C.allreduce_inplace(x)
        return x.tolist()

    def async_allreduce() -> List[float]:
        x = torch.full((4,), float(rank + 1))
        w = C.allreduce_inplace(x, async_op=True)
        w.wait()
        return x.tolist()

    def broadcast() -> List[float]:
        x = torch.full((2,), float(rank + 1))
        C.broadcast(x, 1)
        return x.tolist()

    def allgather() -> List[float]:
        out = torch.zeros(4)
        C.allgather(torch.full((2,), float(rank)), out)
        return out.tolist()

    def barrier() -> List[float]:
        C.barrier()
        return []

    def classic_all_gather() -> List[float]:
        outs = [torch.zeros(1), torch.zeros(1)]
        classic.all_gather(outs, torch.full((1,), float(rank)))
        return [o.item() for o in outs]

    def hierarchical() -> List[float]:
        x = torch.full((4,), float(rank + 1))
        C.allreduce_inplace(x, hierarchical=True)
        return x.tolist()

    def async_hierarchical() -> List[float]:
        x = torch.full((4,), float(rank + 1))
        C.allreduce_inplace(x, async_op=True, hierarchical=True).wait()
        return x.tolist()

    def neighbor_allreduce() -> List[float]:
        return N.neighbor_allreduce(torch.full((2,), float(rank + 1))).tolist()

    def async_neighbor_allgather() -> List[float]:
        return N.synchronize(N.neighbor_allgather_async(torch.full((2,), float(rank)))).tolist()

    return {
        "allreduce": allreduce,
        "async_allreduce": async_allreduce,
        "broadcast": broadcast,
        "allgather": allgather,
        "barrier": barrier,
        "classic_all_gather": classic_all_gather,
        "hierarchical": hierarchical,
        "async_hierarchical": async_hierarchical,
        "neighbor_allreduce": neighbor_allreduce,
        "async_neighbor_allgather": async_neighbor_allgather,
    }


def _want(name: str, rank: int) -> List[float]:
    return {
        "allreduce": [3.0] * 4,
        "async_allreduce": [3.0] * 4,
        "broadcast": [2.0] * 2,
        "allgather": [0.0, 0.0, 1.0, 1.0],
        "barrier": [],
        "classic_all_gather": [0.0, 1.0],
        "hierarchical": [3.0] * 4,
        "async_hierarchical": [3.0] * 4,
        "neighbor_allreduce": [1.5] * 2,  # the average of the two ranks' tensors
        "async_neighbor_allgather": [float(1 - rank)] * 2,  # the in-neighbour's tensor
    }[name]


# ------------------------------------------------------------------------------------------------
# patterns that deadlocked until the timeout
# ------------------------------------------------------------------------------------------------
def _recv_posted_before_a_collective(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 0: ``w = recv(buf, 1, async_op=True); <collective>; w.wait()``; rank 1: ``<collective>;
    send(t, 0)``; once per collective."""
    steps = []
    for k, (name, coll) in enumerate(_collectives(rank).items()):

        def step(coll: Callable[[], Any] = coll, k: int = k) -> Any:
            if rank == 0:
                buf = torch.zeros(3)
                w = C.recv(buf, 1, async_op=True)
                got = coll()
                w.wait()
                return got, buf.tolist()
            got = coll()
            C.send(torch.full((3,), float(k)), 0)
            return got, None

        steps.append((name, step))
    return _run(engine, steps)


def _send_posted_before_a_collective(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """The mirror: rank 0: ``w = send(big, 1, async_op=True); <collective>; w.wait()``; rank 1:
    ``<collective>; recv(buf, 0)``. The message is larger than the shm pair channel, so the send
    waits for the receive on both engines."""
    steps = []
    for k, (name, coll) in enumerate(_collectives(rank).items()):

        def step(coll: Callable[[], Any] = coll, k: int = k) -> Any:
            if rank == 0:
                w = C.send(torch.full((BIG,), float(k)), 1, async_op=True)
                got = coll()
                w.wait()
                return got, None
            got = coll()
            buf = torch.zeros(BIG)
            C.recv(buf, 0)
            return got, buf.unique().tolist()

        steps.append((name, step))
    return _run(engine, steps)


def _halo_exchange_around_a_collective(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Both ranks post their receives (two from the neighbour, a small and a large message), run an
    allreduce, then send, then wait: the messages arrive in issue order."""
    peer = 1 - rank

    def halo(n: int) -> Any:
        a, b = torch.zeros(3), torch.zeros(n)
        works = [C.recv(a, peer, async_op=True), C.recv(b, peer, async_op=True)]
        x = torch.full((4,), float(rank + 1))
        C.allreduce_inplace(x)
        C.send(torch.full((3,), float(10 * rank + 1)), peer)
        C.send(torch.full((n,), float(10 * rank + 2)), peer)
        for w in works:
            w.wait()
        return x.tolist(), a.unique().tolist(), b.unique().tolist()

    def async_sends_then_collective() -> Any:
        # sends to one peer keep their order across collectives issued between them
        works = [C.send(torch.full((1,), 1.0 + rank), peer, async_op=True)]
        C.allreduce_inplace(torch.ones(2))
        works.append(C.send(torch.full((1,), 3.0 + rank), peer, async_op=True))
        C.allreduce_inplace(torch.ones(2))
        got = [torch.zeros(1), torch.zeros(1)]
        for g in got:
            C.recv(g, peer)
        for w in works:
            w.wait()
        return [g.item() for g in got]

    return _run(
        engine,
        [("small", lambda: halo(3)), ("big", lambda: halo(BIG)), ("ordered", async_sends_then_collective)],
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_a_receive_posted_before_a_collective_does_not_hold_it_back(engine):
    r0, r1 = run_ranks(_recv_posted_before_a_collective, 2, engine, timeout=60)
    assert r0["engine"] == engine
    for r in (r0, r1):
        assert "error" not in r, r
    for k, name in enumerate(_collectives(0)):
        assert r0[name] == (_want(name, 0), [float(k)] * 3), (name, r0[name])
        assert r1[name] == (_want(name, 1), None), (name, r1[name])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_send_posted_before_a_collective_does_not_hold_it_back(engine):
    r0, r1 = run_ranks(_send_posted_before_a_collective, 2, engine, timeout=60)
    for r in (r0, r1):
        assert "error" not in r, r
    for k, name in enumerate(_collectives(0)):
        assert r0[name] == (_want(name, 0), None), (name, r0[name])
        assert r1[name] == (_want(name, 1), [float(k)]), (name, r1[name])


@pytest.mark.parametrize("engine", ENGINES)
def test_halo_exchange_with_receives_posted_before_a_collective(engine):
    res = run_ranks(_halo_exchange_around_a_collective, 2, engine, timeout=60)
    for rank, r in enumerate(res):
        peer = 1 - rank
        assert "error" not in r, r
        for size in ("small", "big"):
            assert r[size] == ([3.0] * 4, [10.0 * peer + 1], [10.0 * peer + 2]), (rank, size, r[size])
        assert r["ordered"] == [1.0 + peer, 3.0 + peer], r


# ------------------------------------------------------------------------------------------------
# operations on shared memory are still ordered
# ------------------------------------------------------------------------------------------------
def _overlapping(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 0 issues an asynchronous send or receive, then a collective on memory it uses; rank 1
    sends (receives) late, after 0.4 s, so a collective that did not wait would read or write the
    memory first. With the waits taken out (Communicator._hazards on _p2p_book returning nothing)
    the shm run failed every time, in raw, raw_hierarchical, raw_async_partial and raw_column (its
    one-shot allreduce and reduce copy their input into the slot before they wait for the peer), and
    the gloo run in some runs. The other steps read or write only once every rank arrived, after
    rank 1's send or receive, so there they check the results and that nothing deadlocks, not the
    wait itself."""
    late = 0.4

    def recv_then_allreduce_of_it() -> Any:  # read after write
        if rank == 0:
            x = torch.zeros(4)
            w = C.recv(x, 1, async_op=True)
            C.allreduce_inplace(x)
            w.wait()
            return x.tolist()
        time.sleep(late)
        C.send(torch.full((4,), 5.0), 0)
        y = torch.ones(4)
        C.allreduce_inplace(y)
        return y.tolist()

    def recv_then_async_allreduce_of_part_of_it() -> Any:  # the same, partly overlapping, asynchronous
        if rank == 0:
            x = torch.zeros(6)
            w = C.recv(x[2:4], 1, async_op=True)
            a = C.allreduce_inplace(x[3:6], async_op=True)
            a.wait()
            w.wait()
            return x.tolist()
        time.sleep(late)
        C.send(torch.full((2,), 5.0), 0)
        y = torch.ones(3)
        C.allreduce_inplace(y)
        return y.tolist()

    def recv_into_a_column_then_allreduce() -> Any:  # a staged (non-contiguous) receive
        if rank == 0:
            m = torch.zeros(3, 2)
            w = C.recv(m[:, 1], 1, async_op=True)
            C.allreduce_inplace(m)
            w.wait()
            return m.tolist()
        time.sleep(late)
        C.send(torch.full((3,), 5.0), 0)
        y = torch.ones(3, 2)
        C.allreduce_inplace(y)
        return y.tolist()

    def send_then_allreduce_of_it() -> Any:  # write after read: the send sends the values from before
        if rank == 0:
            x = torch.full((BIG,), 3.0)
            w = C.send(x, 1, async_op=True)
            C.allreduce_inplace(x)
            w.wait()
            return x.unique().tolist()
        time.sleep(late)
        buf = torch.zeros(BIG)
        C.recv(buf, 0)
        y = torch.ones(BIG)
        C.allreduce_inplace(y)
        return buf.unique().tolist(), y.unique().tolist()

    def recv_then_classic_all_gather_into_it() -> Any:  # write after write (through a composite)
        if rank == 0:
            outs = [torch.zeros(2), torch.zeros(2)]
            w = C.recv(outs[1], 1, async_op=True)
            classic.all_gather(outs, torch.full((2,), 7.0))
            w.wait()
            return [o.tolist() for o in outs]
        time.sleep(late)
        C.send(torch.full((2,), 5.0), 0)
        outs = [torch.zeros(2), torch.zeros(2)]
        classic.all_gather(outs, torch.full((2,), 8.0))
        return [o.tolist() for o in outs]

    def recv_then_composite(kind: str) -> Any:  # read after write, through a composite operation
        if kind == "hierarchical":
            # connect the intra- and inter-node communicators first (a connection waits for the
            # peer, which would order the reads after rank 1's send even without the wait)
            C.allreduce_inplace(torch.ones(1), hierarchical=True)
        if rank == 0:
            x = torch.zeros(2)
            w = C.recv(x, 1, async_op=True)
            if kind == "hierarchical":
                C.allreduce_inplace(x, hierarchical=True)
                out = x
            else:
                out = N.neighbor_allreduce(x)  # (x + the peer's) / 2
            w.wait()
            return out.tolist()
        time.sleep(late)
        C.send(torch.full((2,), 5.0), 0)
        y = torch.ones(2)
        if kind == "hierarchical":
            C.allreduce_inplace(y, hierarchical=True)
            return y.tolist()
        return N.neighbor_allreduce(y).tolist()

    return _run(
        engine,
        [
            ("raw", recv_then_allreduce_of_it),
            ("raw_hierarchical", lambda: recv_then_composite("hierarchical")),
            ("raw_neighbor_allreduce", lambda: recv_then_composite("neighbor")),
            ("raw_async_partial", recv_then_async_allreduce_of_part_of_it),
            ("raw_column", recv_into_a_column_then_allreduce),
            ("war", send_then_allreduce_of_it),
            ("waw_classic", recv_then_classic_all_gather_into_it),
        ],
    )


def _disjoint(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 0 receives into one half of a tensor, then allreduces the other half; rank 1 sends
    only after its allreduce: a wait for the receive would deadlock (it did until the timeout)."""

    def recv_into_one_part_then_allreduce_of_another(
        shape: Tuple[int, ...],
        recv_part: Callable[[torch.Tensor], torch.Tensor],
        other: Callable[[torch.Tensor], torch.Tensor],
    ) -> Any:
        if rank == 0:
            x = torch.ones(shape)
            w = C.recv(recv_part(x), 1, async_op=True)
            C.allreduce_inplace(other(x))
            w.wait()
            return x.tolist()
        n = recv_part(torch.ones(shape)).numel()
        y = torch.ones(n)
        C.allreduce_inplace(y)
        C.send(torch.full((n,), 5.0), 0)
        return y.tolist()

    def recv_then_allreduce_of_another_part() -> Any:
        return recv_into_one_part_then_allreduce_of_another((4,), lambda x: x[0:2], lambda x: x[2:4])

    def recv_into_a_column_then_allreduce_of_another() -> Any:
        # two columns of one matrix: their address ranges interleave, their elements do not meet
        # (compared by ranges only, they waited for each other until the timeout)
        return recv_into_one_part_then_allreduce_of_another((3, 2), lambda m: m[:, 0], lambda m: m[:, 1])

    def allreduce_of_the_odd_elements_then_send_of_the_even() -> Any:
        # the reverse, x[1::2] against x[0::2]: the send does not wait for the async allreduce
        if rank == 0:
            x = torch.full((6,), 7.0)
            a = C.allreduce_inplace(x[1::2], async_op=True)
            C.send(x[0::2], 1)
            a.wait()
            return x.tolist()
        buf = torch.zeros(3)
        C.recv(buf, 0)
        y = torch.ones(3)
        C.allreduce_inplace(y)
        return buf.tolist(), y.tolist()

    return _run(
        engine,
        [
            ("disjoint", recv_then_allreduce_of_another_part),
            ("columns", recv_into_a_column_then_allreduce_of_another),
            ("interleaved", allreduce_of_the_odd_elements_then_send_of_the_even),
        ],
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_a_collective_still_waits_for_a_pending_send_or_receive_on_its_memory(engine):
    r0, r1 = run_ranks(_overlapping, 2, engine, timeout=60)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["raw"] == r1["raw"] == [6.0] * 4  # the received 5s, plus rank 1's ones
    assert r0["raw_hierarchical"] == r1["raw_hierarchical"] == [6.0] * 2
    assert r0["raw_neighbor_allreduce"] == r1["raw_neighbor_allreduce"] == [3.0] * 2
    assert r0["raw_async_partial"] == [0.0, 0.0, 5.0, 6.0, 1.0, 1.0]
    assert r1["raw_async_partial"] == [6.0, 1.0, 1.0]
    assert r0["raw_column"] == [[1.0, 6.0]] * 3
    assert r0["war"] == [4.0]
    assert r1["war"] == ([3.0], [4.0])  # rank 1 got the values from before rank 0's allreduce
    assert r0["waw_classic"] == [[7.0, 7.0], [8.0, 8.0]]  # the later all_gather wins
    assert r1["waw_classic"] == [[7.0, 7.0], [8.0, 8.0]]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_collective_on_another_part_of_a_tensor_being_received_does_not_wait(engine):
    r0, r1 = run_ranks(_disjoint, 2, engine, timeout=60)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    assert r0["disjoint"] == [5.0, 5.0, 2.0, 2.0]
    assert r1["disjoint"] == [2.0, 2.0]
    assert r0["columns"] == [[5.0, 2.0]] * 3
    assert r1["columns"] == [2.0] * 3
    assert r0["interleaved"] == [7.0, 8.0] * 3  # the odd elements: 7 + 1
    assert r1["interleaved"] == ([7.0] * 3, [8.0] * 3)


# ------------------------------------------------------------------------------------------------
# the reverse: a send or receive issued after an asynchronous collective
# ------------------------------------------------------------------------------------------------
def _async_collectives(rank: int) -> Dict[str, Callable[[], Callable[[], List[float]]]]:
    """Asynchronous collectives on tensors no send or receive uses: each starts one and returns what
    waits for it and gives its result as a list (the values of _want, under the same name)."""

    def allreduce() -> Callable[[], List[float]]:
        x = torch.full((4,), float(rank + 1))
        w = C.allreduce_inplace(x, async_op=True)
        return lambda: (w.wait(), x.tolist())[1]

    def allreduce_column() -> Callable[[], List[float]]:  # staged: copied in and back on the worker
        m = torch.full((4, 2), float(rank + 1))
        w = C.allreduce_inplace(m[:, 1], async_op=True)
        return lambda: (w.wait(), m[:, 1].tolist())[1]

    def broadcast() -> Callable[[], List[float]]:
        x = torch.full((2,), float(rank + 1))
        w = C.broadcast(x, 1, async_op=True)
        return lambda: (w.wait(), x.tolist())[1]

    def allgather() -> Callable[[], List[float]]:
        out = torch.zeros(4)
        w = C.allgather(torch.full((2,), float(rank)), out, async_op=True)
        return lambda: (w.wait(), out.tolist())[1]

    def barrier() -> Callable[[], List[float]]:
        w = C.barrier(async_op=True)
        return lambda: (w.wait(), [])[1]

    def classic_all_gather() -> Callable[[], List[float]]:  # a composite: its last step on the worker
        outs = [torch.zeros(1), torch.zeros(1)]
        w = classic.all_gather(outs, torch.full((1,), float(rank)), async_op=True)
        return lambda: (w.wait(), [o.item() for o in outs])[1]

    def hierarchical() -> Callable[[], List[float]]:  # steps on the intra-node communicator, a fence
        x = torch.full((4,), float(rank + 1))
        w = C.allreduce_inplace(x, async_op=True, hierarchical=True)
        return lambda: (w.wait(), x.tolist())[1]

    def neighbor_allreduce() -> Callable[[], List[float]]:
        h = N.neighbor_allreduce_async(torch.full((2,), float(rank + 1)))
        return lambda: N.synchronize(h).tolist()

    def async_neighbor_allgather() -> Callable[[], List[float]]:  # nested collectives on the worker
        h = N.neighbor_allgather_async(torch.full((2,), float(rank)))
        return lambda: N.synchronize(h).tolist()

    return {
        "async_allreduce": allreduce,
        "allreduce_column": allreduce_column,
        "broadcast": broadcast,
        "allgather": allgather,
        "barrier": barrier,
        "classic_all_gather": classic_all_gather,
        "async_hierarchical": hierarchical,
        "neighbor_allreduce": neighbor_allreduce,
        "async_neighbor_allgather": async_neighbor_allgather,
    }


def _want_async(name: str, rank: int) -> List[float]:
    return [3.0] * 4 if name == "allreduce_column" else _want(name, rank)


def _connect_hierarchical() -> None:
    """Connect the intra- and inter-node communicators first: an engine connects at its first
    operation, collectively, and rank 1 would be in its receive when rank 0's first hierarchical
    allreduce connected (it waited for rank 1)."""
    C.allreduce_inplace(torch.ones(1), hierarchical=True)


def _send_after_an_async_collective(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 0: ``w = <async collective>; send(t, 1); w.wait()``; rank 1: ``recv(buf, 0);
    <collective>``; once per collective."""
    steps: List[Tuple[str, Callable[[], Any]]] = [("connect", _connect_hierarchical)]
    for k, (name, start) in enumerate(_async_collectives(rank).items()):

        def step(start: Callable[[], Callable[[], List[float]]] = start, k: int = k) -> Any:
            if rank == 0:
                finish = start()
                C.send(torch.full((3,), float(k)), 1)
                return finish(), None
            buf = torch.zeros(3)
            C.recv(buf, 0)
            return start()(), buf.tolist()

        steps.append((name, step))
    return _run(engine, steps)


def _recv_after_an_async_collective(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Swapped: rank 0: ``w = <async collective>; recv(buf, 1); w.wait()``; rank 1: ``send(big, 0);
    <collective>``. The message is larger than the shm pair channel, so the send waits for the
    receive on both engines."""
    steps: List[Tuple[str, Callable[[], Any]]] = [("connect", _connect_hierarchical)]
    for k, (name, start) in enumerate(_async_collectives(rank).items()):

        def step(start: Callable[[], Callable[[], List[float]]] = start, k: int = k) -> Any:
            if rank == 0:
                finish = start()
                buf = torch.zeros(BIG)
                C.recv(buf, 1)
                return finish(), buf.unique().tolist()
            C.send(torch.full((BIG,), float(k)), 0)
            return start()(), None

        steps.append((name, step))
    return _run(engine, steps)


def _more_after_an_async_collective(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """An asynchronous send after the collective, messages to one peer kept in issue order around
    it, a send of another part of the collective's tensor, and an exchange (async receive, send,
    wait) issued after it on rank 0 and before it on rank 1."""
    peer = 1 - rank

    def async_send() -> Any:
        x = torch.full((4,), float(rank + 1))
        if rank == 0:
            a = C.allreduce_inplace(x, async_op=True)
            w = C.send(torch.full((3,), 7.0), 1, async_op=True)
            a.wait()
            w.wait()
            return x.tolist()
        buf = torch.zeros(3)
        C.recv(buf, 0)
        C.allreduce_inplace(x)
        return x.tolist(), buf.tolist()

    def ordered() -> Any:
        # rank 0's second send follows its first (to the same peer), not the allreduce between them
        x = torch.full((4,), float(rank + 1))
        if rank == 0:
            s1 = C.send(torch.full((BIG,), 1.0), 1, async_op=True)
            a = C.allreduce_inplace(x, async_op=True)
            C.send(torch.full((3,), 2.0), 1)
            a.wait()
            s1.wait()
            return x.tolist()
        big, small = torch.zeros(BIG), torch.zeros(3)
        C.recv(big, 0)
        C.recv(small, 0)
        C.allreduce_inplace(x)
        return x.tolist(), big.unique().tolist(), small.tolist()

    def disjoint() -> Any:
        if rank == 0:
            x = torch.full((4,), 5.0)
            a = C.allreduce_inplace(x[2:4], async_op=True)
            C.send(x[0:2], 1)  # another part of x: it does not wait for the allreduce
            a.wait()
            return x.tolist()
        buf = torch.zeros(2)
        C.recv(buf, 0)
        y = torch.ones(2)
        C.allreduce_inplace(y)
        return y.tolist(), buf.tolist()

    def exchange() -> Any:
        x = torch.full((4,), float(rank + 1))
        got = torch.zeros(BIG)

        def swap() -> None:
            w = C.recv(got, peer, async_op=True)
            C.send(torch.full((BIG,), 10.0 + rank), peer)
            w.wait()

        if rank == 0:
            a = C.allreduce_inplace(x, async_op=True)
            swap()
            a.wait()
        else:
            swap()
            C.allreduce_inplace(x)
        return x.tolist(), got.unique().tolist()

    return _run(
        engine,
        [("async_send", async_send), ("ordered", ordered), ("disjoint", disjoint), ("exchange", exchange)],
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_a_send_after_an_async_collective_does_not_wait_for_it(engine):
    r0, r1 = run_ranks(_send_after_an_async_collective, 2, engine, timeout=60)
    assert r0["engine"] == engine
    for r in (r0, r1):
        assert "error" not in r, r
    for k, name in enumerate(_async_collectives(0)):
        assert r0[name] == (_want_async(name, 0), None), (name, r0[name])
        assert r1[name] == (_want_async(name, 1), [float(k)] * 3), (name, r1[name])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_receive_after_an_async_collective_does_not_wait_for_it(engine):
    r0, r1 = run_ranks(_recv_after_an_async_collective, 2, engine, timeout=60)
    for r in (r0, r1):
        assert "error" not in r, r
    for k, name in enumerate(_async_collectives(0)):
        assert r0[name] == (_want_async(name, 0), [float(k)]), (name, r0[name])
        assert r1[name] == (_want_async(name, 1), None), (name, r1[name])


@pytest.mark.parametrize("engine", ENGINES)
def test_sends_and_receives_after_an_async_collective_keep_their_order(engine):
    r0, r1 = run_ranks(_more_after_an_async_collective, 2, engine, timeout=60)
    for r in (r0, r1):
        assert "error" not in r, r
    assert r0["async_send"] == [3.0] * 4
    assert r1["async_send"] == ([3.0] * 4, [7.0] * 3)
    assert r0["ordered"] == [3.0] * 4
    assert r1["ordered"] == ([3.0] * 4, [1.0], [2.0] * 3)  # in issue order
    assert r0["disjoint"] == [5.0, 5.0, 6.0, 6.0]
    assert r1["disjoint"] == ([6.0, 6.0], [5.0, 5.0])
    assert r0["exchange"] == ([3.0] * 4, [11.0])
    assert r1["exchange"] == ([3.0] * 4, [10.0])


def _overlapping_after(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 0 issues an asynchronous collective, then a send or receive on memory it uses; rank 1
    posts the matching receive or send asynchronously (on other memory than its collective's, so
    they run at once), then runs its collective late, after 0.4 s. A send that did not wait would
    send the values from before the collective, a receive that did not wait would be overwritten by
    the collective's result or read by it. With the waits taken out (Communicator._hazards on _coll_book
    returning nothing) every step failed on both engines, in each of two runs."""
    late = 0.4

    def peer_recv(n: int, collective: Callable[[], Any]) -> List[float]:
        buf = torch.zeros(n)
        w = C.recv(buf, 0, async_op=True)
        time.sleep(late)
        collective()
        w.wait()
        return buf.tolist()

    def peer_send(n: int, collective: Callable[[], Any]) -> Any:
        w = C.send(torch.full((n,), 5.0), 0, async_op=True)
        time.sleep(late)
        got = collective()
        w.wait()
        return got

    def send_of_it(kind: str) -> Any:  # read after write: the send sends the reduced values
        hier = kind == "hierarchical"
        if rank == 0:
            x = torch.full((4,), 3.0)
            a = C.allreduce_inplace(x, async_op=True, hierarchical=hier)
            w = C.send(x, 1, async_op=kind == "async")
            a.wait()
            if w is not None:
                w.wait()
            return x.tolist()
        return peer_recv(4, lambda: C.allreduce_inplace(torch.ones(4), hierarchical=hier))

    def send_of_a_column() -> Any:  # staged: the send copies the column when it starts
        if rank == 0:
            m = torch.full((3, 2), 3.0)
            a = C.allreduce_inplace(m, async_op=True)
            C.send(m[:, 1], 1)
            a.wait()
            return m.tolist()
        return peer_recv(3, lambda: C.allreduce_inplace(torch.ones(3, 2)))

    def recv_into_it(kind: str) -> Any:  # write after read and after write
        hier = kind == "hierarchical"
        if rank == 0:
            x = torch.full((4,), 3.0)
            a = C.allreduce_inplace(x, async_op=True, hierarchical=hier)
            w = C.recv(x, 1, async_op=kind == "async")
            a.wait()
            if w is not None:
                w.wait()
            return x.tolist()
        y = torch.ones(4)
        # rank 0's allreduce must read its 3s, not the 5s received after it
        return peer_send(4, lambda: (C.allreduce_inplace(y, hierarchical=hier), y.tolist())[1])

    def recv_into_part_of_it() -> Any:  # partly overlapping, both asynchronous
        if rank == 0:
            x = torch.full((6,), 3.0)
            a = C.allreduce_inplace(x[0:4], async_op=True)
            w = C.recv(x[2:6], 1, async_op=True)
            a.wait()
            w.wait()
            return x.tolist()
        y = torch.ones(4)
        return peer_send(4, lambda: (C.allreduce_inplace(y), y.tolist())[1])

    def recv_into_a_column() -> Any:  # a staged receive: written back when it ends
        if rank == 0:
            m = torch.full((3, 2), 3.0)
            a = C.allreduce_inplace(m, async_op=True)
            C.recv(m[:, 1], 1)
            a.wait()
            return m.tolist()
        y = torch.ones(3, 2)
        return peer_send(3, lambda: (C.allreduce_inplace(y), y.tolist())[1])

    def recv_into_classic_all_gather_output() -> Any:  # after the composite's last step
        if rank == 0:
            outs = [torch.zeros(2), torch.zeros(2)]
            a = classic.all_gather(outs, torch.full((2,), 7.0), async_op=True)
            C.recv(outs[1], 1)
            a.wait()
            return [o.tolist() for o in outs]
        outs = [torch.zeros(2), torch.zeros(2)]
        return peer_send(
            2, lambda: (classic.all_gather(outs, torch.full((2,), 8.0)), [o.tolist() for o in outs])[1]
        )

    def recv_into_neighbor_input(kind: str) -> Any:  # the composites read their input late
        if rank == 0:
            x = torch.full((2,), 3.0)
            if kind == "allreduce":
                h = N.neighbor_allreduce_async(x)  # its last step reads x (the self term)
            else:
                h = N.neighbor_allgather_async(x)  # gathers on the worker, reading x
            C.recv(x, 1)
            out = N.synchronize(h)
            return out.tolist(), x.tolist()
        y = torch.ones(2)
        if kind == "allreduce":
            return peer_send(2, lambda: N.neighbor_allreduce(y).tolist())
        return peer_send(2, lambda: N.neighbor_allgather(y).tolist())  # rank 0's tensor

    return _run(
        engine,
        [
            ("connect", _connect_hierarchical),
            ("send", lambda: send_of_it("sync")),
            ("send_async", lambda: send_of_it("async")),
            ("send_hierarchical", lambda: send_of_it("hierarchical")),
            ("send_column", send_of_a_column),
            ("recv", lambda: recv_into_it("sync")),
            ("recv_async", lambda: recv_into_it("async")),
            ("recv_hierarchical", lambda: recv_into_it("hierarchical")),
            ("recv_partial", recv_into_part_of_it),
            ("recv_column", recv_into_a_column),
            ("recv_classic_all_gather", recv_into_classic_all_gather_output),
            ("recv_neighbor_allreduce", lambda: recv_into_neighbor_input("allreduce")),
            ("recv_neighbor_allgather", lambda: recv_into_neighbor_input("allgather")),
        ],
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_a_send_or_receive_still_waits_for_a_pending_collective_on_its_memory(engine):
    r0, r1 = run_ranks(_overlapping_after, 2, engine, timeout=60)
    assert "error" not in r0 and "error" not in r1, (r0, r1)
    for name in ("send", "send_async", "send_hierarchical"):
        assert r0[name] == [4.0] * 4, (name, r0[name])
        assert r1[name] == [4.0] * 4, (name, r1[name])  # the reduced values, not rank 0's 3s
    assert r0["send_column"] == [[4.0, 4.0]] * 3
    assert r1["send_column"] == [4.0] * 3
    for name in ("recv", "recv_async", "recv_hierarchical"):
        assert r0[name] == [5.0] * 4, (name, r0[name])  # the received values, not the sum
        assert r1[name] == [4.0] * 4, (name, r1[name])  # the allreduce read rank 0's 3s
    assert r0["recv_partial"] == [4.0, 4.0, 5.0, 5.0, 5.0, 5.0]
    assert r1["recv_partial"] == [4.0] * 4
    assert r0["recv_column"] == [[4.0, 5.0]] * 3
    assert r1["recv_column"] == [[4.0, 4.0]] * 3
    assert r0["recv_classic_all_gather"] == [[7.0, 7.0], [5.0, 5.0]]  # the receive wins
    assert r1["recv_classic_all_gather"] == [[7.0, 7.0], [8.0, 8.0]]
    assert r0["recv_neighbor_allreduce"] == ([2.0, 2.0], [5.0, 5.0])  # (3 + 1) / 2: read the 3s
    assert r1["recv_neighbor_allreduce"] == [2.0, 2.0]
    assert r0["recv_neighbor_allgather"] == ([1.0, 1.0], [5.0, 5.0])
    assert r1["recv_neighbor_allgather"] == [3.0, 3.0]  # rank 0's tensor before the receive


def _hierarchical_across_two_nodes(rank: int, ws: int) -> Dict[str, Any]:
    """Two logical nodes of one rank each: the asynchronous hierarchical allreduce (AVG) runs its
    middle step on the inter-node communicator and divides in its last step, on the intra-node
    one. Sends and receives on other memory, on the global communicator, do not wait for it; those
    on its tensor, on the global or the inter-node communicator, wait for the whole operation."""
    os.environ["TRAINLOOM_NODE_ID"] = f"n{rank}"
    avg = C.ReduceOp.AVG
    late = 0.4

    def inter() -> Any:
        return C.get_default_group().get_inter_node_communicator()

    def other_memory(swap: bool) -> Any:
        x = torch.full((4,), float(rank + 1))
        if rank == 0:
            a = C.allreduce_inplace(x, avg, async_op=True, hierarchical=True)
            buf = torch.zeros(BIG)
            if swap:
                C.recv(buf, 1)
            else:
                C.send(torch.full((BIG,), 7.0), 1)
            a.wait()
            return x.tolist(), buf.unique().tolist()
        buf = torch.zeros(BIG)
        if swap:
            C.send(torch.full((BIG,), 7.0), 0)
        else:
            C.recv(buf, 0)
        C.allreduce_inplace(x, avg, hierarchical=True)
        return x.tolist(), buf.unique().tolist()

    def send_of_it(on_inter: bool) -> Any:
        comm = inter() if on_inter else None
        if rank == 0:
            x = torch.full((4,), 3.0)
            a = C.allreduce_inplace(x, avg, async_op=True, hierarchical=True)
            C.send(x, 1, comm=comm)  # the average, not the sum of the middle step
            a.wait()
            return x.tolist()
        buf = torch.zeros(4)
        w = C.recv(buf, 0, comm=comm, async_op=True)
        time.sleep(late)
        C.allreduce_inplace(torch.ones(4), avg, hierarchical=True)
        w.wait()
        return buf.tolist()

    def recv_into_it() -> Any:
        x = torch.full((4,), 3.0) if rank == 0 else torch.ones(4)
        if rank == 0:
            a = C.allreduce_inplace(x, avg, async_op=True, hierarchical=True)
            C.recv(x, 1)
            a.wait()
            return x.tolist()
        w = C.send(torch.full((4,), 5.0), 0, async_op=True)
        time.sleep(late)
        C.allreduce_inplace(x, avg, hierarchical=True)
        w.wait()
        return x.tolist()

    return _run(
        "auto",
        [
            ("connect", _connect_hierarchical),
            ("other_memory", lambda: other_memory(False)),
            ("other_memory_swapped", lambda: other_memory(True)),
            ("send", lambda: send_of_it(False)),
            ("send_on_inter", lambda: send_of_it(True)),
            ("recv", recv_into_it),
        ],
    )


def test_a_hierarchical_allreduce_across_nodes_beside_sends_and_receives():
    r0, r1 = run_ranks(_hierarchical_across_two_nodes, 2, timeout=60, local_world_size=1)
    for r in (r0, r1):
        assert "error" not in r, r
    assert r0["other_memory"] == ([1.5] * 4, [0.0])
    assert r1["other_memory"] == ([1.5] * 4, [7.0])
    assert r0["other_memory_swapped"] == ([1.5] * 4, [7.0])
    assert r1["other_memory_swapped"] == ([1.5] * 4, [0.0])
    for name in ("send", "send_on_inter"):
        assert r0[name] == r1[name] == [2.0] * 4, (name, r0[name], r1[name])
    assert r0["recv"] == [5.0] * 4
    assert r1["recv"] == [2.0] * 4  # rank 0's allreduce read its 3s


def _inter_fence_two_by_two(rank: int, ws: int) -> Dict[str, Any]:
    """Two logical nodes of two ranks each, gloo. A leader's asynchronous hierarchical allreduce of a
    column (staged: the result is copied back into it at the end of the last step, the intra-node
    broadcast) runs only its middle step on the inter-node communicator. Node a's leader then sends
    the column to node b's leader on that communicator. Its intra-node broadcast is held back 0.5 s,
    so a send that followed only the middle step would send the column before the result is copied
    into it: the sum must arrive, not the leader's own values."""
    os.environ["TRAINLOOM_NODE_ID"] = "a" if rank < 2 else "b"

    def send_on_inter() -> Any:
        pg = C.get_default_group()
        intra, inter = pg.get_intra_node_communicator(), pg.get_inter_node_communicator()  # every rank
        m = torch.full((4, 2), float(rank + 1))
        col = m[:, 1]
        if rank not in (0, 2):
            C.allreduce_inplace(col, hierarchical=True)
            return col.tolist()
        if rank == 0:
            engine = intra.engine("cpu")
            broadcast = engine.broadcast

            def late_broadcast(tensor: torch.Tensor, src: int, timeout: Any = None) -> None:
                time.sleep(0.5)
                broadcast(tensor, src, timeout)

            engine.broadcast = late_broadcast  # this rank's (Python) gloo engine object only
        a = C.allreduce_inplace(col, async_op=True, hierarchical=True)
        if rank == 0:
            C.send(col, 1, comm=inter)
            a.wait()
            return col.tolist()
        buf = torch.zeros(4)
        C.recv(buf, 0, comm=inter)
        a.wait()
        return buf.tolist(), col.tolist()

    return _run("gloo", [("connect", _connect_hierarchical), ("send_on_inter", send_on_inter)])


def test_a_send_on_the_inter_node_communicator_waits_for_the_whole_hierarchical_allreduce():
    """Guards the fence the asynchronous hierarchical allreduce sets on the inter-node communicator:
    without it, node b's leader received [1.0] * 4."""
    res = run_ranks(_inter_fence_two_by_two, 4, timeout=60, local_world_size=2)
    for r in res:
        assert "error" not in r, r
    assert res[0]["send_on_inter"] == [10.0] * 4
    assert res[1]["send_on_inter"] == res[3]["send_on_inter"] == [10.0] * 4
    assert res[2]["send_on_inter"] == ([10.0] * 4, [10.0] * 4)


# ------------------------------------------------------------------------------------------------
# threads: a send or receive on another thread beside a collective (two collectives at once are
# still refused: test_collectives.test_two_threads_issuing_collectives_at_once_abort_instead_of_mispairing)
# ------------------------------------------------------------------------------------------------
def _receive_on_a_thread_beside_collectives(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 0 receives on a helper thread (a synchronous recv, waiting for rank 1) while its main
    thread runs an allreduce and a barrier; rank 1 runs them, then sends. (The shared-memory engine
    refused the allreduce and aborted the communicator; gloo ran it.)"""
    _start(engine)
    out: Dict[str, Any] = {}
    t = torch.full((4,), float(rank + 1))
    if rank == 0:
        buf = torch.zeros(BIG)
        box: Dict[str, Any] = {}

        def receive() -> None:
            try:
                C.recv(buf, 1)
                box["recv"] = "no error"
            except CommError as exc:
                box["recv"] = f"{type(exc).__name__}: {exc}"

        th = threading.Thread(target=receive, name="receiver")
        th.start()
        time.sleep(0.2)  # the receive waits in the engine for rank 1
        C.allreduce_inplace(t)
        C.barrier()
        th.join(TIMEOUT)
        out["recv"] = box.get("recv", "still running")
        out["received"] = buf.unique().tolist()
    else:
        C.allreduce_inplace(t)
        C.barrier()
        C.send(torch.full((BIG,), 9.0), 0)
    out["t"] = t.tolist()
    C.destroy_process_group()
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_a_receive_on_a_thread_runs_beside_the_main_threads_collectives(engine):
    r0, r1 = run_ranks(_receive_on_a_thread_beside_collectives, 2, engine, timeout=60)
    assert (r0["recv"], r0["received"], r0["t"]) == ("no error", [9.0], [3.0] * 4), r0
    assert r1["t"] == [3.0] * 4
