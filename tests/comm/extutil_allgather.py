"""Rank functions for the allgather / neighbor_allgather tests in test_ext_neighbor.py.

Each runs on every rank under tests/multiproc.run_ranks and returns plain data (lists, strings) that
the tests compare with exact values computed in the parent. This module holds no tests itself.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List

import torch
from test_ext_ranks import _engine, _expect

import trainloom.comm as C
from trainloom.comm import neighbor as nb
from trainloom.comm import topology as tp
from trainloom.errors import CommError


def _err(fn: Callable, *args: Any, **kwargs: Any) -> str:
    """``"<type>: <message>"`` of the CommError ``fn`` raises (or ``"no error"``)."""
    return _expect(fn, CommError, *args, **kwargs)


def rows(rank: int, first: int, cols: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input with ``first`` rows: distinct, exactly representable values."""
    return (torch.arange(first * cols, dtype=torch.float64).reshape(first, cols) + 100.0 * rank).to(dtype)


def variable_size(rank: int, ws: int, engine: str, strategy: str, firsts: List[int]) -> Dict[str, Any]:
    """allgather and neighbor_allgather of tensors whose first dimension differs between ranks."""
    _engine(engine)
    os.environ["TRAINLOOM_NEIGHBOR_EXCHANGE"] = strategy
    C.init_process_group(timeout=30)
    tp.set_topology(tp.RingGraph(ws, connect_style=2))  # in-neighbour: rank - 1
    x = rows(rank, firsts[rank])
    out: Dict[str, Any] = {}
    g = nb.allgather(x, name="v")
    out["allgather"] = (list(g.shape), g.tolist())
    h = nb.allgather_async(x)
    out["allgather_async"] = nb.synchronize(h).tolist()
    out["allgather_result"] = h.result().tolist()
    out["nag"] = nb.neighbor_allgather(x, name="v").tolist()
    h = nb.neighbor_allgather_async(x)
    while not nb.poll(h):
        time.sleep(0.001)
    out["nag_polled"] = h.tensor.tolist()  # complete once poll says so, without a wait()
    # a non-contiguous input (a column slice) and a row count of 0 on rank 0
    wide = rows(rank, firsts[rank], cols=6)
    out["strided"] = nb.allgather(wide[:, ::2]).tolist()
    out["empty"] = list(nb.allgather(rows(rank, 0 if rank == 0 else 2)).shape)
    out["nag_empty"] = nb.neighbor_allgather(rows(rank, 0 if rank == 0 else 2)).tolist()
    # the same first dimension everywhere (one plain allgather or exchange) still works
    out["same"] = nb.allgather(rows(rank, 2)).tolist()
    out["nag_same"] = nb.neighbor_allgather(rows(rank, 2)).tolist()
    out["scalar"] = nb.allgather(torch.tensor(float(rank))).tolist()
    out["nag_scalar"] = nb.neighbor_allgather(torch.tensor(float(rank))).tolist()
    C.destroy_process_group()
    return out


def shape_mismatch(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Dtypes or dimensions other than the first that differ between ranks: CommError on every rank."""
    _engine(engine)
    C.init_process_group(timeout=30)
    tp.set_topology(tp.RingGraph(ws))
    cols = 4 if rank == 1 else 3
    out: Dict[str, Any] = {
        "cols": _err(nb.allgather, rows(rank, rank + 1, cols), name="w"),
        "nag_cols": _err(nb.neighbor_allgather, rows(rank, rank + 1, cols)),
        "dtype": _err(nb.allgather, rows(rank, 2, dtype=torch.float64 if rank == 2 else torch.float32)),
        "ndim": _err(nb.neighbor_allgather, torch.zeros(2, 3, 1) if rank == 0 else torch.zeros(2, 3), "n"),
        "same_numel": _err(nb.allgather, torch.zeros((2, 3) if rank == 0 else (3, 2))),
        # trailing shapes that collided under the header's old polynomial hash (uint8: small)
        "collision": _err(
            nb.allgather, torch.zeros((1, 1, 1000004) if rank == 0 else (1, 2, 1), dtype=torch.uint8)
        ),
        "collision_same_numel": _err(
            nb.allgather, torch.zeros((1, 2, 1000003) if rank == 0 else (1, 1, 2000006), dtype=torch.uint8)
        ),
    }
    # inputs no rank can send raise at the call, on the calling rank, before any exchange
    for key, t in (("uint16", torch.zeros(2, dtype=torch.uint16)), ("sparse", torch.zeros(2, 2).to_sparse())):
        for fn in (nb.allgather, nb.neighbor_allgather_async):
            try:
                fn(t, name="b")
                out[f"{key}/{fn.__name__}"] = "no error"
            except TypeError as e:
                out[f"{key}/{fn.__name__}"] = str(e)
    h = nb.neighbor_allgather_async(rows(rank, 2, cols), name="a")
    out["async_wait"] = _err(h.wait)
    out["async_again"] = _err(nb.synchronize, h)  # the same message, not prefixed twice
    out["after"] = nb.allgather(torch.tensor([float(rank)])).tolist()  # the communicator still works
    C.destroy_process_group()
    return out


def exchange_errors(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Errors of neighbor_allgather on the exchange path name the call, sync and async."""
    _engine(engine)
    os.environ["TRAINLOOM_NEIGHBOR_EXCHANGE"] = "auto"
    C.init_process_group(timeout=30)
    # topologies that differ between ranks: the exchange's send and receive counts disagree
    tp.set_topology(tp.RingGraph(ws, connect_style=1 + rank % 2))
    big = torch.zeros(20000)  # 80 KB: the exchange path, whatever the graph
    out: Dict[str, Any] = {"sync": _err(nb.neighbor_allgather, big, name="grads")}
    h = nb.neighbor_allgather_async(big, name="grads")
    out["async_wait"] = _err(h.wait)
    out["async_sync"] = _err(nb.synchronize, h)
    C.destroy_process_group()
    return out


def late_rank(rank: int, ws: int, engine: str, mode: str) -> Dict[str, Any]:
    """Rank 1 never calls neighbor_allgather: the others' timeout errors name the call (``mode``:
    the synchronous call or synchronize() of a handle)."""
    _engine(engine)
    os.environ["TRAINLOOM_NEIGHBOR_EXCHANGE"] = "exchange"
    C.init_process_group(timeout=2)
    tp.set_topology(tp.RingGraph(ws))
    nb.barrier()  # every rank has joined the engine; only the neighbour operation is missing
    if rank == 1:
        time.sleep(3.5)  # longer than the 2 s timeout
        return {}
    t0 = time.monotonic()
    if mode == "sync":
        err = _err(nb.neighbor_allgather, torch.zeros(20000), name="grads")
    else:
        err = _err(nb.synchronize, nb.neighbor_allgather_async(torch.zeros(20000), name="grads"))
    return {"error": err, "seconds": time.monotonic() - t0}
