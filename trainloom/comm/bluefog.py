"""Bluefog's ``bluefog.torch`` namespace over trainloom (neighbour averaging, handles, optimizers).

A Bluefog script moves over by changing its import::

    import trainloom.comm.bluefog as bf            # was: import bluefog.torch as bf

    bf.init()                                      # torchrun environment; ExponentialTwoGraph topology
    bf.set_topology(bf.RingGraph(bf.size()))
    y = bf.neighbor_allreduce(x)
    h = bf.allreduce_async(x); ...; z = bf.synchronize(h)

Everything here is a re-export of :mod:`trainloom.comm.neighbor`, :mod:`trainloom.comm.topology`,
:mod:`trainloom.comm.state`, :mod:`trainloom.comm.optimizers` and :mod:`trainloom.comm.windows`,
plus ``init``/``shutdown`` and the rank queries (which, as in Bluefog, raise ``ValueError`` before
``init()`` and after ``shutdown()``). Handles are the core
:class:`~trainloom.comm.work.Work` objects (Bluefog returns ints). Not provided:
``DistributedBluefogOptimizer``, ``win_lock``/``win_mutex`` (slots are always locked); use
:func:`DistributedNeighborAllreduceOptimizer` (see docs/comm-ext.md).
"""

from __future__ import annotations

from typing import Callable, Optional

from trainloom.comm import env as _env
from trainloom.comm import group as _group
from trainloom.comm.neighbor import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    neighbor_allgather,
    neighbor_allgather_async,
    neighbor_allreduce,
    neighbor_allreduce_async,
    poll,
    synchronize,
)
from trainloom.comm.optimizers import DistributedAllreduceOptimizer, DistributedNeighborAllreduceOptimizer
from trainloom.comm.state import broadcast_optimizer_state, broadcast_parameters
from trainloom.comm.topology import (
    ExponentialTwoGraph,
    FullyConnectedGraph,
    RingGraph,
    Topology,
    in_neighbor_ranks,
    is_topo_weighted,
    load_topology,
    out_neighbor_ranks,
    set_topology,
)
from trainloom.comm.windows import (
    win_accumulate,
    win_accumulate_async,
    win_create,
    win_free,
    win_get,
    win_get_async,
    win_poll,
    win_put,
    win_put_async,
    win_sync,
    win_sync_then_collect,
    win_wait,
)

__all__ = [
    "init",
    "shutdown",
    "size",
    "rank",
    "local_size",
    "local_rank",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "neighbor_allgather",
    "neighbor_allgather_async",
    "neighbor_allreduce",
    "neighbor_allreduce_async",
    "poll",
    "synchronize",
    "DistributedAllreduceOptimizer",
    "DistributedNeighborAllreduceOptimizer",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ExponentialTwoGraph",
    "FullyConnectedGraph",
    "RingGraph",
    "Topology",
    "in_neighbor_ranks",
    "is_topo_weighted",
    "load_topology",
    "out_neighbor_ranks",
    "set_topology",
    "win_accumulate",
    "win_accumulate_async",
    "win_create",
    "win_free",
    "win_get",
    "win_get_async",
    "win_poll",
    "win_put",
    "win_put_async",
    "win_sync",
    "win_sync_then_collect",
    "win_wait",
]


def init(topology_fn: Optional[Callable[[int], Topology]] = None, is_weighted: bool = False) -> None:
    """Initialize from the torchrun environment and set the topology (Bluefog's ``bf.init``).

    Args:
        topology_fn: builds the topology from the world size (default ``ExponentialTwoGraph``).
        is_weighted: use the topology's weights in neighbour averaging.

    Example::

        bf.init(lambda n: bf.RingGraph(n))
    """
    _group.init_process_group()
    set_topology((topology_fn or ExponentialTwoGraph)(size()), is_weighted=is_weighted)


def shutdown() -> None:
    """Tear down (Bluefog's ``bf.shutdown``)."""
    _group.destroy_process_group()


def _initialized(what: str) -> None:
    # Bluefog's rank queries raise ValueError before bf.init() and after bf.shutdown().
    if not _group.is_initialized():
        raise ValueError(f"{what}: BlueFog has not been initialized; use bf.init().")


def size() -> int:
    """Number of ranks.

    Raises:
        ValueError: before :func:`init` or after :func:`shutdown` (as Bluefog).
    """
    _initialized("size")
    return _env.get_world_size()


def rank() -> int:
    """This process's rank.

    Raises:
        ValueError: before :func:`init` or after :func:`shutdown` (as Bluefog).
    """
    _initialized("rank")
    return _env.get_rank()


def local_size() -> int:
    """Number of ranks on this node.

    Raises:
        ValueError: before :func:`init` or after :func:`shutdown` (as Bluefog).
    """
    _initialized("local_size")
    return _env.get_local_size()


def local_rank() -> int:
    """This process's rank on its node.

    Raises:
        ValueError: before :func:`init` or after :func:`shutdown` (as Bluefog).
    """
    _initialized("local_rank")
    return _env.get_local_rank()
