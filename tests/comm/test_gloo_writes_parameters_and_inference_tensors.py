"""The gloo engine writes results into an nn.Parameter and into tensors made under
``torch.inference_mode()``, as the shared-memory engine and torch.distributed do, and both engines
divide a complex AVG part by part (3 real ranks, both CPU engines).

Before (an audit reproduced each on gloo):
- ``allreduce_inplace(param, AVG)`` raised "a leaf Variable that requires grad is being used in an
  in-place operation" after the data was exchanged, leaving the SUM in every rank's parameter; the
  same under ``torch.no_grad()`` when asynchronous (the worker thread has its own grad mode), and
  out of place into a Parameter ("a view of a leaf Variable");
- a tensor made under ``torch.inference_mode()`` and reduced outside it (AVG, int16, out of place,
  reduce_scatter) raised "Inplace update to inference tensor outside InferenceMode"; when only
  reduce's destination held one, that rank failed and its peers waited for the timeout;
- a complex AVG on 3 ranks differed by 1 ulp (29 of 64 elements) between gloo's flat allreduce or
  either engine's hierarchical one and the shared-memory engine's: torch's complex division rounds
  otherwise than dividing the two parts.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict

import pytest
import torch
from commutil import engines
from multiproc import run_ranks

import trainloom.comm as C
from trainloom.comm import ReduceOp
from trainloom.errors import CommError


def _step(out: Dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    try:
        out[name] = fn()
    except (CommError, RuntimeError) as exc:
        out[name] = f"{type(exc).__name__}: {exc}"


def _complex(rank: int) -> torch.Tensor:
    """Multiples of 1/8: every sum is exact, so only the division rounds."""
    g = torch.Generator().manual_seed(rank)
    parts = torch.randint(-999, 999, (2, 64), generator=g) / 8.0
    return torch.complex(parts[0], parts[1])


def _writes(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    C.init_process_group(timeout=10)
    C.barrier()
    out: Dict[str, Any] = {"engine": C.get_default_group().get_global_communicator().cpu_engine_kind()}

    def param_avg() -> Any:
        p = torch.nn.Parameter(torch.full((4,), float(rank)))
        C.allreduce_inplace(p, ReduceOp.AVG)
        return p.tolist()

    def param_avg_async_under_no_grad() -> Any:
        p = torch.nn.Parameter(torch.full((4,), float(rank)))
        with torch.no_grad():
            C.allreduce_inplace(p, ReduceOp.AVG, async_op=True).wait()
        return p.tolist()

    def into_param() -> Any:
        p = torch.nn.Parameter(torch.zeros(4))
        C.allreduce(torch.full((4,), float(rank)), p)
        q = torch.nn.Parameter(torch.zeros(2))
        C.reduce_scatter(torch.ones(2 * ws), q)
        return p.tolist(), q.tolist()

    with torch.inference_mode():
        made = {
            "avg": torch.full((3,), float(rank)),
            "int16": torch.full((3,), rank, dtype=torch.int16),
            "out": torch.zeros(3),
            "rs": torch.zeros(2),
            "dst": torch.zeros(3),
        }

    def inference_tensors() -> Any:
        C.allreduce_inplace(made["avg"], ReduceOp.AVG)
        C.allreduce_inplace(made["int16"])
        C.allreduce(torch.ones(3), made["out"])
        C.reduce_scatter(torch.ones(2 * ws), made["rs"])
        # only rank 0's output is an inference tensor (a peer used to wait for the timeout)
        C.reduce(torch.ones(3), made["dst"] if rank == 0 else torch.zeros(3), 0)
        C.allreduce_inplace(torch.ones(1))  # the communicator still works
        return {k: v.tolist() for k, v in made.items()}

    def complex_avg(hierarchical: bool) -> bool:
        z = _complex(rank)
        C.allreduce_inplace(z, ReduceOp.AVG, hierarchical=hierarchical)
        total = sum(_complex(r) for r in range(ws))
        want = torch.view_as_real(total).div(ws)  # part by part, exact sums
        return bool(torch.equal(torch.view_as_real(z).view(torch.int32), want.view(torch.int32)))

    _step(out, "param AVG", param_avg)
    _step(out, "param AVG async under no_grad", param_avg_async_under_no_grad)
    _step(out, "into a param", into_param)
    _step(out, "inference tensors", inference_tensors)
    _step(out, "complex AVG", lambda: complex_avg(False))
    _step(out, "complex AVG hierarchical", lambda: complex_avg(True))
    C.destroy_process_group()
    return out


@pytest.mark.parametrize("engine", engines())
def test_results_go_into_parameters_and_inference_tensors_and_complex_avg_is_divided_by_parts(engine):
    res = run_ranks(_writes, 3, engine, timeout=60)
    for rank, r in enumerate(res):
        assert r["engine"] == engine
        assert r["param AVG"] == [1.0] * 4  # (0 + 1 + 2) / 3
        assert r["param AVG async under no_grad"] == [1.0] * 4
        assert r["into a param"] == ([3.0] * 4, [3.0] * 2)
        assert r["inference tensors"] == {
            "avg": [1.0] * 3,
            "int16": [3] * 3,
            "out": [3.0] * 3,
            "rs": [3.0] * 2,
            "dst": [3.0] * 3 if rank == 0 else [0.0] * 3,
        }
        assert r["complex AVG"] is True and r["complex AVG hierarchical"] is True
