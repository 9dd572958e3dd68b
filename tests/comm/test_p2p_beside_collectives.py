"""Sends and receives pending beside a collective, on both CPU engines (2 real ranks, 10 s timeout).

torch.distributed's gloo runs ``w = irecv(buf, 1); all_reduce(x); w.wait()`` on rank 0 against
``all_reduce(x); send(t, 0)`` on rank 1 (checked with torch 2.13: it returns at once). trainloom's
collectives used to wait for every pending send and receive on their communicator, so rank 0's
allreduce waited for its receive, which waited for rank 1's send, which came after rank 1's allreduce:
every rank raised CommTimeoutError after the timeout. Now a CPU collective waits only for the pending
sends and receives whose tensors share memory with its own (collectives.p2p_hazards), and both
engines run sends and receives beside a collective. The patterns of the first three tests timed out
on the old code; the last ones check that overlapping operations are still ordered (and that a
disjoint part of the same tensor is not), and the threaded rules that remain.
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
    out["seconds"] = time.monotonic() - t0
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
        assert r["seconds"] < 5, r
    for k, name in enumerate(_collectives(0)):
        assert r0[name] == (_want(name, 0), [float(k)] * 3), (name, r0[name])
        assert r1[name] == (_want(name, 1), None), (name, r1[name])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_send_posted_before_a_collective_does_not_hold_it_back(engine):
    r0, r1 = run_ranks(_send_posted_before_a_collective, 2, engine, timeout=60)
    for r in (r0, r1):
        assert "error" not in r, r
        assert r["seconds"] < 5, r
    for k, name in enumerate(_collectives(0)):
        assert r0[name] == (_want(name, 0), None), (name, r0[name])
        assert r1[name] == (_want(name, 1), [float(k)]), (name, r1[name])


@pytest.mark.parametrize("engine", ENGINES)
def test_halo_exchange_with_receives_posted_before_a_collective(engine):
    res = run_ranks(_halo_exchange_around_a_collective, 2, engine, timeout=60)
    for rank, r in enumerate(res):
        peer = 1 - rank
        assert "error" not in r, r
        assert r["seconds"] < 5, r
        for size in ("small", "big"):
            assert r[size] == ([3.0] * 4, [10.0 * peer + 1], [10.0 * peer + 2]), (rank, size, r[size])
        assert r["ordered"] == [1.0 + peer, 3.0 + peer], r


# ------------------------------------------------------------------------------------------------
# operations on shared memory are still ordered
# ------------------------------------------------------------------------------------------------
def _overlapping(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 0 issues an asynchronous send or receive, then a collective on memory it uses; rank 1
    sends (receives) late, after 0.4 s, so a collective that did not wait would read or write the
    memory first. With the waits taken out (p2p_hazards returning nothing) the shm run failed every
    time, in raw, raw_hierarchical, raw_async_partial and raw_column (its one-shot allreduce and
    reduce copy their input into the slot before they wait for the peer), and the gloo run in some
    runs. The other steps read or write only once every rank arrived, after rank 1's send or
    receive, so there they check the results and that nothing deadlocks, not the wait itself."""
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

    def recv_then_allreduce_of_another_part() -> Any:
        if rank == 0:
            x = torch.ones(4)
            w = C.recv(x[0:2], 1, async_op=True)
            C.allreduce_inplace(x[2:4])
            w.wait()
            return x.tolist()
        y = torch.ones(2)
        C.allreduce_inplace(y)
        C.send(torch.full((2,), 5.0), 0)
        return y.tolist()

    return _run(engine, [("disjoint", recv_then_allreduce_of_another_part)])


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
