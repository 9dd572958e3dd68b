"""A CUDA collective's cross-rank argument check follows the asynchronous CPU collectives issued
before it (2 real ranks, both CPU engines, no GPU needed: the check runs before any CUDA call).

The check exchanges a header through the CPU engine from the calling thread. It used to race the
worker thread running an earlier ``allreduce(..., async_op=True)`` for the engine, so one rank's
header met the other rank's allreduce: both operations raised "ranks disagree" on every rank (an
audit saw it in 4 of 4 runs on both engines), for calls issued in the same order everywhere.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict

import pytest
import torch
from commutil import engines
from multiproc import run_ranks

import trainloom.comm as C
from trainloom.errors import CommError


def _cuda_after_async_cpu(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    os.environ["TRAINLOOM_COMM_CHECK"] = "all"  # check through gloo too (the default: shm only)
    C.init_process_group(timeout=10)
    comm = C.get_default_group().get_global_communicator()
    C.allreduce(torch.ones(1), torch.ones(1), async_op=True).wait()  # the worker thread exists
    x = torch.full((4,), float(rank + 1))
    w = C.allreduce(x, x, async_op=True)
    if rank == 0:
        time.sleep(0.3)  # rank 0's worker takes the engine first, rank 1's caller does
    out: Dict[str, Any] = {}
    t = torch.ones(4)
    try:  # what collectives.allreduce does for a CUDA tensor; the check passes, then CUDA is missing
        comm.execute(
            "allreduce", torch.device("cuda", 0), lambda e: None, False, None, check=(t, 0, -1, None, None)
        )
        out["cuda"] = "no error"
    except CommError as exc:
        out["cuda"] = f"CommError: {exc}"
    except (RuntimeError, AssertionError):  # torch without CUDA: after the check
        out["cuda"] = "check passed"
    try:
        w.wait()
        out["cpu"] = x.tolist()
    except CommError as exc:
        out["cpu"] = f"CommError: {exc}"
    C.destroy_process_group()
    return out


@pytest.mark.parametrize("engine", engines())
def test_a_cuda_collectives_check_follows_the_pending_async_cpu_collectives(engine):
    for r in run_ranks(_cuda_after_async_cpu, 2, engine, timeout=60):
        assert r == {"cuda": "check passed", "cpu": [3.0] * 4}, r
