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

Names of later Bluefog releases are aliases: the ``*_nonblocking`` forms of the ``*_async``
functions, ``win_update`` / ``win_update_then_collect`` (``win_sync`` / ``win_sync_then_collect``),
``wait`` (``synchronize``) and ``src_weights=`` (``neighbor_weights=`` of ``neighbor_allreduce``).
``bluefog.common.topology_util`` is :mod:`trainloom.comm.topology_util`.
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

import torch

from trainloom.comm import env as _env
from trainloom.comm import group as _group
from trainloom.comm.neighbor import (
    CommArg,
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
from trainloom.comm.state import broadcast_object, broadcast_optimizer_state, broadcast_parameters
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
from trainloom.comm.work import Work

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
    "broadcast_object",
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
    # names of later Bluefog releases
    "allgather_nonblocking",
    "allreduce_nonblocking",
    "allreduce_nonblocking_",
    "broadcast_nonblocking",
    "broadcast_nonblocking_",
    "neighbor_allgather_nonblocking",
    "neighbor_allreduce_nonblocking",
    "wait",
    "win_accumulate_nonblocking",
    "win_get_nonblocking",
    "win_put_nonblocking",
    "win_update",
    "win_update_then_collect",
]


def init(topology_fn: Optional[Callable[[int], Topology]] = None, is_weighted: bool = False) -> None:
    """Initialize from the torchrun environment and set the topology (Bluefog's ``bf.init``).

    Args:
        topology_fn: builds the topology from the world size (default ``ExponentialTwoGraph``).
        is_weighted: use the topology's weights in neighbour averaging.

    Called again (Bluefog's own tests call it in every ``setUp``), or after
    ``trainloom.comm.init_process_group()``, it keeps the process group and only sets the topology, as
    Bluefog's ``InitializeBluefogOnce`` does.

    Example::

        bf.init(lambda n: bf.RingGraph(n))
    """
    if not _group.is_initialized():
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


# ---------------------------------------------------------------------------- later Bluefog names
#: Later Bluefog releases renamed ``*_async`` to ``*_nonblocking``; where the signatures are the
#: same the alias is the function itself.
allgather_nonblocking = allgather_async
broadcast_nonblocking = broadcast_async
broadcast_nonblocking_ = broadcast_async_
neighbor_allgather_nonblocking = neighbor_allgather_async
win_get_nonblocking = win_get_async
#: Later Bluefog's ``wait(handle)``, "just alias of synchronize()".
wait = synchronize


def allreduce_nonblocking(
    tensor: torch.Tensor,
    average: bool = True,
    is_hierarchical_local: bool = False,
    name: Optional[str] = None,
    comm: CommArg = None,
) -> Work:
    """Later Bluefog's name of :func:`allreduce_async`, with its third argument ``is_hierarchical_local``.

    Raises:
        NotImplementedError: ``is_hierarchical_local=True`` (an allreduce within each machine).
    """
    _no_hierarchical(is_hierarchical_local, "allreduce_nonblocking")
    return allreduce_async(tensor, average, name, comm)


def allreduce_nonblocking_(
    tensor: torch.Tensor,
    average: bool = True,
    is_hierarchical_local: bool = False,
    name: Optional[str] = None,
    comm: CommArg = None,
) -> Work:
    """Later Bluefog's name of :func:`allreduce_async_` (in place), with ``is_hierarchical_local``.

    Raises:
        NotImplementedError: ``is_hierarchical_local=True`` (an allreduce within each machine).
    """
    _no_hierarchical(is_hierarchical_local, "allreduce_nonblocking_")
    return allreduce_async_(tensor, average, name, comm)


def _no_hierarchical(flag: object, opname: str) -> None:
    if flag:
        raise NotImplementedError(
            f"{opname}: is_hierarchical_local=True (an allreduce within each machine) is not supported; "
            "call allreduce_async(tensor, comm=...) with a process group of the machine's ranks"
        )


def neighbor_allreduce_nonblocking(
    tensor: torch.Tensor,
    self_weight: Optional[float] = None,
    neighbor_weights: Optional[Mapping[int, float]] = None,
    name: Optional[str] = None,
    comm: CommArg = None,
    *,
    src_weights: Optional[Mapping[int, float]] = None,
) -> Work:
    """Later Bluefog's name of :func:`neighbor_allreduce_async` (same arguments; ``src_weights=``
    is the newer name of ``neighbor_weights=``).

    Bluefog's dynamic-topology arguments (``send_neighbors``, ``dst_weights``,
    ``enable_topo_check``) are not supported; a list in the ``name`` position (Bluefog 0.2's
    positional ``send_neighbors``) raises TypeError.

    Raises:
        TypeError: ``name`` is not a str, and everything :func:`neighbor_allreduce_async` raises.
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"neighbor_allreduce_nonblocking: name must be a str, got {type(name).__name__}; "
            "send_neighbors (dynamic topologies) is not supported"
        )
    return neighbor_allreduce_async(
        tensor, self_weight, neighbor_weights, name, comm, src_weights=src_weights
    )


def _no_self_weight(self_weight: Optional[float], opname: str) -> None:
    if self_weight is not None and self_weight != 1.0:
        raise NotImplementedError(
            f"{opname}: self_weight={self_weight!r} (scaling the tensor after the put) is not supported; "
            "leave it None (1.0) and scale the tensor yourself"
        )


def win_put_nonblocking(
    tensor: torch.Tensor,
    name: str,
    self_weight: Optional[float] = None,
    dst_weights: Optional[Mapping[int, float]] = None,
    require_mutex: bool = False,
) -> Work:
    """Later Bluefog's name of :func:`win_put_async`, with its third argument ``self_weight``.

    Raises:
        NotImplementedError: ``self_weight`` other than None or 1.0.
    """
    _no_self_weight(self_weight, "win_put_nonblocking")
    return win_put_async(tensor, name, dst_weights, require_mutex)


def win_accumulate_nonblocking(
    tensor: torch.Tensor,
    name: str,
    self_weight: Optional[float] = None,
    dst_weights: Optional[Mapping[int, float]] = None,
    require_mutex: bool = False,
) -> Work:
    """Later Bluefog's name of :func:`win_accumulate_async`, with its third argument ``self_weight``.

    Raises:
        NotImplementedError: ``self_weight`` other than None or 1.0.
    """
    _no_self_weight(self_weight, "win_accumulate_nonblocking")
    return win_accumulate_async(tensor, name, dst_weights, require_mutex)


def win_update(
    name: str,
    self_weight: Optional[float] = None,
    neighbor_weights: Optional[Dict[int, float]] = None,
    reset: bool = False,
    clone: bool = False,
    require_mutex: bool = False,
) -> torch.Tensor:
    """Later Bluefog's name of :func:`win_sync` (``require_mutex`` accepted; slots are always locked).

    Example::

        y = bf.win_update("w", self_weight=0.5, neighbor_weights={left: 0.5})
    """
    return win_sync(name, self_weight, neighbor_weights, reset, clone)


def win_update_then_collect(name: str, require_mutex: bool = True) -> torch.Tensor:
    """Later Bluefog's name of :func:`win_sync_then_collect` (``require_mutex`` accepted; slots are
    always locked)."""
    return win_sync_then_collect(name)
