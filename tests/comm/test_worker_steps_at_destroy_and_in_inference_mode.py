"""Operations that run on a communicator's worker thread: at ``destroy_process_group()``, in the
issuing thread's ``torch.inference_mode()``, and ``classic.recv`` from any source after the core API
destroyed and re-created the group (real 2-rank runs, both CPU engines).

Each failed before (an audit reproduced them):
- ``allgather_async``/``neighbor_allgather_async`` issued right before ``destroy_process_group()``:
  destroy marked the communicator destroyed before letting the queued operations finish, so their
  nested steps raised "used after destroy_process_group()" (and a peer waiting on its handle failed);
- under ``torch.inference_mode()``, ``neighbor_allreduce(x.t())``, ``colossal.reduce_scatter(...,
  dim=1)``, an asynchronous AVG allreduce (gloo) and Bluefog's averaging ``allreduce`` (gloo) raised
  "Inplace update to inference tensor outside InferenceMode" from their steps on the worker thread;
- ``classic.recv(buf)`` without ``src`` after the core ``destroy_process_group()`` (which
  ``bf.shutdown()`` uses) and a new ``init_process_group()`` timed out: its announcement cursor
  was kept per communicator name across generations.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List

import pytest
import torch
from commutil import engines
from multiproc import run_ranks

import trainloom.comm as C
from trainloom.comm import classic, colossal
from trainloom.comm import neighbor as N
from trainloom.comm import topology as T
from trainloom.errors import CommError


def _any_source_message(rank: int, gen: int) -> Any:
    if rank == 1:
        classic.send(torch.full((2,), 10.0 + gen), 0)
        return None
    buf = torch.zeros(2)
    src = classic.recv(buf)
    return src, buf.tolist()


def _step(out: Dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """``out[name]`` = ``fn()``, or the error it raised (the old code's failures, one per step)."""
    try:
        out[name] = fn()
    except (CommError, RuntimeError) as exc:
        out[name] = f"{type(exc).__name__}: {exc}"


def _steps(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    out: Dict[str, Any] = {}
    C.init_process_group(timeout=5)
    C.barrier()  # connects the engine (a first send would wait for the receiver to connect)
    T.set_topology(T.RingGraph(ws))
    _step(out, "gen 0 any source", lambda: _any_source_message(rank, 0))

    def async_avg() -> List[float]:
        y = torch.full((3,), float(rank))
        C.allreduce_inplace(y, C.ReduceOp.AVG, async_op=True).wait()
        return y.tolist()

    with torch.inference_mode():
        x = torch.arange(4.0).view(2, 2) + rank
        _step(out, "neighbor_allreduce(x.t())", lambda: N.neighbor_allreduce(x.t()).tolist())
        _step(
            out,
            "colossal.reduce_scatter(dim=1)",
            lambda: colossal.reduce_scatter(torch.ones(2, 2 * ws), dim=1).tolist(),
        )
        _step(out, "async AVG allreduce", async_avg)
        _step(out, "bluefog allreduce (average)", lambda: N.allreduce(torch.full((3,), float(rank))).tolist())
    x = torch.full((2,), float(rank))
    handles = {
        "allgather_async": N.allgather_async(x),
        "neighbor_allgather_async": N.neighbor_allgather_async(x),
    }
    C.destroy_process_group()  # the handles' results are there without a wait()
    for name, h in handles.items():
        _step(out, name, lambda h=h: N.synchronize(h).tolist())
    C.init_process_group(timeout=5)
    C.barrier()
    _step(out, "gen 1 any source", lambda: _any_source_message(rank, 1))
    C.destroy_process_group()
    return out


@pytest.mark.parametrize("engine", engines())
def test_worker_steps_finish_at_destroy_and_run_in_inference_mode(engine):
    r0, r1 = run_ranks(_steps, 2, engine, timeout=60)
    assert r0["gen 0 any source"] == (1, [10.0, 10.0]) and r1["gen 0 any source"] is None
    assert r0["gen 1 any source"] == (1, [11.0, 11.0]) and r1["gen 1 any source"] is None
    for r in (r0, r1):
        assert r["neighbor_allreduce(x.t())"] == [[0.5, 2.5], [1.5, 3.5]]  # the mean of both ranks
        assert r["colossal.reduce_scatter(dim=1)"] == [[2.0, 2.0], [2.0, 2.0]]
        assert r["async AVG allreduce"] == [0.5] * 3
        assert r["bluefog allreduce (average)"] == [0.5] * 3
        assert r["allgather_async"] == [0.0, 0.0, 1.0, 1.0]
    assert r0["neighbor_allgather_async"] == [1.0, 1.0]  # the ring's one neighbour
    assert r1["neighbor_allgather_async"] == [0.0, 0.0]
