"""ColossalAI's ``colossalai.communication.collective`` forms over trainloom's collectives.

A ColossalAI script moves over by changing its import::

    import trainloom.comm.colossal as collective   # was: from colossalai.communication import collective

Functions take the tensor, a dimension where it matters, and a *parallel mode*: a trainloom
:class:`~trainloom.comm.group.ProcessGroup` or :class:`~trainloom.comm.group.Communicator`, ``None``
for the default group, or any key registered with :func:`register_parallel_mode` (e.g. ColossalAI's
``ParallelMode.DATA``). ``src``/``dst`` are *global* ranks, as in ColossalAI and torch.distributed.
With ``async_op=False`` they return the result tensor; with ``async_op=True`` a tuple
``(tensor, work)`` where ``work`` is the core :class:`~trainloom.comm.work.Work` (``wait()``,
``is_completed()``; also :func:`trainloom.comm.neighbor.poll` / ``synchronize``). The result
tensor is complete after ``work.wait()``.

Example::

    out = all_gather(torch.ones(2, 3) * rank, dim=1)            # shape (2, 3 * world_size)
    part, work = reduce_scatter(torch.ones(4, 2 * ws), dim=1, async_op=True)
    work.wait()                                                  # part: shape (4, 2), all == ws
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Tuple, Union, cast

import torch

from trainloom.comm import collectives as _core
from trainloom.comm.collectives import ReduceOp
from trainloom.comm.env import as_int
from trainloom.comm.group import Communicator, ProcessGroup
from trainloom.comm.neighbor import then_work
from trainloom.comm.topology import group_rank_of as _local_rank
from trainloom.comm.topology import resolve_comm
from trainloom.comm.work import CompletedWork, Work

__all__ = [
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "reduce",
    "register_parallel_mode",
    "ReduceOp",
]

Result = Union[torch.Tensor, Tuple[torch.Tensor, Work]]
_MODES: Dict[Hashable, Union[ProcessGroup, Communicator]] = {}


def register_parallel_mode(mode: Hashable, group: Union[ProcessGroup, Communicator]) -> None:
    """Make ``mode`` (e.g. ColossalAI's ``ParallelMode.DATA``) stand for ``group`` in these functions.

    Example::

        register_parallel_mode("data", new_group([0, 1]))
        all_reduce(t, "data")
    """
    if not isinstance(group, (ProcessGroup, Communicator)):
        raise TypeError(
            f"register_parallel_mode: group must be a trainloom ProcessGroup or Communicator, got "
            f"{type(group).__name__}"
        )
    _MODES[mode] = group


def _comm(parallel_mode: Any, opname: str) -> Communicator:
    if parallel_mode is None or isinstance(parallel_mode, (ProcessGroup, Communicator)):
        return resolve_comm(parallel_mode, opname)
    try:
        group = _MODES.get(parallel_mode)
    except TypeError:  # unhashable
        group = None
    if group is None:
        raise ValueError(
            f"{opname}: parallel_mode {parallel_mode!r} is not a ProcessGroup/Communicator and was not "
            "registered; call trainloom.comm.colossal.register_parallel_mode(mode, group) first"
        )
    return resolve_comm(group, opname)


def _tensor(t: Any, opname: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{opname}: tensor must be a torch.Tensor, got {type(t).__name__}")
    return t


def _dim(dim: Any, t: torch.Tensor, opname: str) -> int:
    d = as_int(dim)
    if d is None:
        raise TypeError(f"{opname}: dim must be an int, got {dim!r}")
    dim = d
    nd = max(t.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(f"{opname}: dim={dim} is out of range for a tensor of shape {tuple(t.shape)}")
    return dim % nd


def _ret(out: torch.Tensor, work: Optional[Work], async_op: bool) -> Result:
    if not async_op:
        if work is not None:
            work.wait()
        return out
    return out, (work if work is not None else CompletedWork("local", out))


def all_gather(tensor: torch.Tensor, dim: int, parallel_mode: Any = None, async_op: bool = False) -> Result:
    """Gather every rank's ``tensor`` and concatenate along ``dim`` (rank order).

    Args:
        tensor: the same shape on every rank.
        dim: the dimension to concatenate along (negative counts from the end).
        parallel_mode: the group (see the module docstring).
        async_op: return ``(tensor, work)``.

    Returns:
        A new tensor whose ``dim`` is ``world_size`` times larger (and ``work`` when asynchronous).

    Raises:
        TypeError, ValueError: bad tensor, dim or group (named in the message).
        CommError: the ranks' element counts or dtypes differ (shapes with the same element count
            are not compared, as in torch.distributed).

    Example::

        out = all_gather(torch.full((2, 3), float(rank)), dim=1)     # shape (2, 3 * ws)
    """
    opname = "all_gather"
    t = _tensor(tensor, opname).detach()
    d = _dim(dim, t, opname)
    c = _comm(parallel_mode, opname)
    n = c.nranks()
    if t.dim() == 0:
        t = t.reshape(1)
    shape = tuple(t.shape)
    new_shape = shape[:d] + (n * shape[d],) + shape[d + 1 :]
    if d == 0:
        # Rank chunks are contiguous along dim 0: gather straight into the result.
        out = torch.empty(new_shape, dtype=t.dtype, device=t.device)
        return _ret(out, _core.allgather(t, out, comm=c, async_op=True), async_op)
    buf = torch.empty((n, *shape), dtype=t.dtype, device=t.device)
    out = torch.empty(new_shape, dtype=t.dtype, device=t.device)
    inner = cast(Work, _core.allgather(t, buf, comm=c, async_op=True))  # async_op=True: a Work

    def place() -> None:
        out.copy_(buf.movedim(0, d).reshape(new_shape))

    return _ret(out, then_work(c, opname, inner, place, out, ()), async_op)  # out and buf are new


def reduce_scatter(
    tensor: torch.Tensor,
    dim: int,
    parallel_mode: Any = None,
    op: Any = ReduceOp.SUM,
    async_op: bool = False,
) -> Result:
    """Reduce ``tensor`` over the ranks and give rank ``i`` the ``i``-th chunk along ``dim``.

    Args:
        tensor: the same shape on every rank; ``tensor.shape[dim]`` divisible by the world size.
        dim: the dimension to split.
        parallel_mode: the group.
        op: a trainloom or ``torch.distributed`` ReduceOp (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR).
        async_op: return ``(tensor, work)``.

    Returns:
        A new tensor with ``shape[dim] // world_size`` along ``dim``.

    Raises:
        ValueError: ``tensor.shape[dim]`` is not divisible by the world size.

    Example::

        part = reduce_scatter(torch.ones(4, 2 * ws), dim=1)    # shape (4, 2), every entry ws
    """
    opname = "reduce_scatter"
    t = _tensor(tensor, opname).detach()
    d = _dim(dim, t, opname)
    c = _comm(parallel_mode, opname)
    n = c.nranks()
    if t.dim() == 0:
        if n > 1:
            raise ValueError(
                f"{opname}: a 0-d tensor (shape ()) has 1 element, which is not divisible by the group's "
                f"{n} ranks"
            )
        t = t.reshape(1)
    shape = tuple(t.shape)
    if shape[d] % n:
        raise ValueError(
            f"{opname}: tensor.shape[{d}]={shape[d]} (shape {shape}) is not divisible by the group's "
            f"{n} ranks"
        )
    k = shape[d] // n
    # Chunk i along dim is row i of this view (unflatten splits one dimension: always a view). When it
    # is not contiguous (dim != 0, or t itself), reduce_scatter copies it into a contiguous buffer
    # when the operation starts, after the earlier asynchronous operations that may still write t.
    send = t.unflatten(d, (n, k)).movedim(d, 0)
    out = torch.empty(shape[:d] + (k,) + shape[d + 1 :], dtype=t.dtype, device=t.device)
    return _ret(out, _core.reduce_scatter(send, out, op, comm=c, async_op=True), async_op)


def all_reduce(
    tensor: torch.Tensor, parallel_mode: Any = None, op: Any = ReduceOp.SUM, async_op: bool = False
) -> Result:
    """Reduce ``tensor`` in place over the group; returns ``tensor`` (and the work when asynchronous).

    Example::

        t = all_reduce(torch.ones(3), op=ReduceOp.MAX)
    """
    opname = "all_reduce"
    t = _tensor(tensor, opname)
    c = _comm(parallel_mode, opname)
    return _ret(t, _core.allreduce_inplace(t, op, comm=c, async_op=True), async_op)


def broadcast(tensor: torch.Tensor, src: int, parallel_mode: Any = None, async_op: bool = False) -> Result:
    """Overwrite ``tensor`` with global rank ``src``'s value, in place; returns ``tensor``.

    Example::

        t = broadcast(torch.full((2,), float(rank)), src=0)       # [0., 0.]
    """
    opname = "broadcast"
    t = _tensor(tensor, opname)
    c = _comm(parallel_mode, opname)
    s = _local_rank(src, "src", c, opname)
    return _ret(t, _core.broadcast(t, s, comm=c, async_op=True), async_op)


def reduce(
    tensor: torch.Tensor, dst: int, parallel_mode: Any = None, op: Any = ReduceOp.SUM, async_op: bool = False
) -> Result:
    """Reduce ``tensor`` onto global rank ``dst`` in place (other ranks' tensors are unchanged).

    Example::

        t = reduce(torch.ones(2), dst=0)       # [ws, ws] on rank 0
    """
    opname = "reduce"
    t = _tensor(tensor, opname)
    c = _comm(parallel_mode, opname)
    r = _local_rank(dst, "dst", c, opname)
    return _ret(t, _core.reduce_inplace(t, r, op, comm=c, async_op=True), async_op)
