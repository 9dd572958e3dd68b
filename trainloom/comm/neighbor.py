"""Neighbour collectives, functional collectives and Bluefog-style handles over the core collectives.

Everything here is built on :mod:`trainloom.comm.collectives` (so on the same engines: NCCL, the
shared-memory engine, gloo) and returns the core's :class:`~trainloom.comm.work.Work` handles when
asynchronous. :func:`poll` and :func:`synchronize` (Bluefog) and ``Work.wait()`` /
``Work.is_completed()`` (torch) work on the same handles.

* :func:`neighbor_allreduce` -- the weighted average (or, with weights that do not sum to 1, the
  weighted sum) of this rank's tensor and its in-neighbours' tensors in the communicator's virtual
  topology (:mod:`trainloom.comm.topology`);
* :func:`neighbor_allgather` -- the in-neighbours' tensors concatenated along dimension 0;
* :func:`allreduce`, :func:`allgather`, :func:`broadcast` -- functional forms that return a new
  tensor (``allreduce_`` / ``broadcast_``: in place), each with an ``_async`` variant.

How neighbour data moves depends only on the topology and the tensor size (so every rank picks the
same collective): one neighbour exchange (``alltoall_v`` with zero counts for non-neighbours, every
destination reading the same send buffer), except for small tensors (< 64 KiB) on dense graphs
(at least half of all possible edges), which use one ``allgather``. :func:`neighbor_allgather` and
:func:`allgather` first exchange every rank's shape (the first dimension may differ between ranks,
as in Bluefog) and gather differently sized tensors with one ``alltoall_v``. See docs/comm-ext.md.

.. warning::
    As with every asynchronous collective, do not modify the input tensor until the handle has been
    waited on: the engine reads it while the operation runs.

Example::

    import trainloom.comm as C
    from trainloom.comm.neighbor import neighbor_allreduce
    from trainloom.comm.topology import RingGraph, set_topology

    C.init_process_group()
    set_topology(RingGraph(C.get_world_size()))
    x = torch.full((4,), float(C.get_rank()))
    y = neighbor_allreduce(x)        # (x[r-1] + x[r] + x[r+1]) / 3
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch

from trainloom.comm import collectives as _core
from trainloom.comm.collectives import ReduceOp
from trainloom.comm.env import as_int
from trainloom.comm.group import Communicator, ProcessGroup
from trainloom.comm.topology import _check_weight, exchange_strategy, resolve_comm, topology_entry
from trainloom.comm.work import CompletedWork, FutureWork, ThenWork, Work
from trainloom.errors import CommError

__all__ = [
    "neighbor_allreduce",
    "neighbor_allreduce_async",
    "neighbor_allgather",
    "neighbor_allgather_async",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "allgather",
    "allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "barrier",
    "poll",
    "synchronize",
    "ThenWork",
]

CommArg = Union[None, Communicator, ProcessGroup]
_HALF = (torch.float16, torch.bfloat16)


def then_work(
    c: Communicator,
    op_name: str,
    inner: Work,
    after: Optional[Callable[[], None]],
    result: Any,
    touches: Sequence[torch.Tensor] = (),
) -> Work:
    """``inner`` followed by ``after`` (local arithmetic or copies into the results), as one Work.

    For a CPU operation ``after`` runs on ``c``'s worker right after ``inner``: the results are
    complete when ``is_completed()`` (or :func:`poll`) says so, before any later collective on ``c``
    and at destroy, as torch.distributed's CPU Work guarantees. For CUDA it runs in ``wait()``.
    Every CommError raised through the returned Work starts with ``op_name`` (the call the user
    made), then the engine's step, with or without ``after``. ``touches``: the caller's tensors
    ``after`` reads or writes besides ``result`` (it follows the pending sends and receives on them,
    and only later sends and receives on them or on ``result`` follow it).
    """
    if after is None:
        # Nothing to run after the data movement, but its errors still name the call (a bare
        # ThenWork raised the engine's "shm alltoall_v #2 ..." alone).
        return _NamedWork(op_name, inner, None, result)

    def run() -> None:
        with torch.no_grad():
            after()

    if inner is None or isinstance(inner, (FutureWork, CompletedWork)):
        return _core._then(c, inner, run, True, result, op_name, touches)  # type: ignore[return-value]
    return _NamedWork(op_name, inner, run, result)  # CUDA: _then's ThenWork, with named errors


def _name_error(exc: CommError, op_name: str) -> None:
    """Start ``exc``'s message with ``op_name`` (once: a second wait() re-raises the same object)."""
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith(f"{op_name}: "):
        exc.args = (f"{op_name}: {exc.args[0]}",) + tuple(exc.args[1:])


class _NamedWork(ThenWork):
    """A :class:`ThenWork` whose CommErrors start with the call the user made (its ``op_name``)."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        try:
            return super().wait(timeout)
        except CommError as exc:
            _name_error(exc, self.op_name)
            raise


class _GatherWork(FutureWork):
    """A CPU gather whose output tensor the operation itself makes, on the worker: its first dimension
    is the sum of the ranks' first dimensions, known only once they were exchanged."""

    def __init__(self, op_name: str, future: Any, box: List[torch.Tensor]) -> None:
        super().__init__(op_name, future, None)
        self._box = box  # the output, appended once it holds the gathered data

    @property
    def tensor(self) -> Optional[torch.Tensor]:
        return self._box[0] if self._box else None

    def result(self) -> Optional[torch.Tensor]:
        self.wait()
        return self.tensor


# ---------------------------------------------------------------------------- handles
def poll(handle: Work) -> bool:
    """Whether the asynchronous operation behind ``handle`` finished (never blocks; Bluefog's ``poll``).

    After ``poll`` returned True, :func:`synchronize` returns without waiting for other ranks.

    Raises:
        TypeError: ``handle`` is not a Work returned by an ``*_async`` call or ``async_op=True``.

    Example::

        h = allreduce_async(x)
        while not poll(h):
            do_some_compute()
        y = synchronize(h)
    """
    return _handle(handle, "poll").is_completed()


def synchronize(handle: Work, timeout: Optional[float] = None) -> Optional[torch.Tensor]:
    """Wait for ``handle`` and return its output tensor (Bluefog's ``synchronize``).

    Args:
        handle: a Work from an ``*_async`` function or a collective called with ``async_op=True``.
        timeout: seconds to wait at most (None: the communicator's timeout applies).

    Returns:
        The operation's output tensor (None for barrier/send).

    Raises:
        TypeError: ``handle`` is not a Work.
        CommTimeoutError: ``timeout`` expired.
        CommError: the operation failed on this or another rank.
    """
    h = _handle(handle, "synchronize")
    h.wait(timeout)
    return h.tensor


def _handle(handle: Any, opname: str) -> Work:
    if not isinstance(handle, Work):
        raise TypeError(
            f"{opname}: handle must be the Work returned by an *_async function or a collective called "
            f"with async_op=True, got {type(handle).__name__}"
        )
    return handle


# ---------------------------------------------------------------------------- validation
def _tensor(t: Any, arg: str, opname: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{opname}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _averageable(t: torch.Tensor, opname: str, hint: str) -> None:
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"{opname}: averaging needs a floating or complex tensor, got {t.dtype}; {hint}")


def _weights(
    opname: str,
    c: Communicator,
    self_weight: Optional[float],
    neighbor_weights: Optional[Mapping[int, float]],
) -> tuple:
    topo, weighted = topology_entry(c)
    me = c.rank()
    ins = topo.in_neighbors(me)
    if (self_weight is None) != (neighbor_weights is None):
        raise ValueError(
            f"{opname}: self_weight and neighbor_weights must be given together (or neither, for the "
            "topology's weights)"
        )
    if neighbor_weights is None:
        if weighted:
            return topo, ins, topo.self_weight(me), topo.in_weights(me)
        u = 1.0 / (len(ins) + 1)
        return topo, ins, u, {i: u for i in ins}
    if not isinstance(neighbor_weights, Mapping):
        raise TypeError(
            f"{opname}: neighbor_weights must be a dict {{rank: weight}}, "
            f"got {type(neighbor_weights).__name__}"
        )
    sw = _check_weight(self_weight, f"{opname}: self_weight")
    nw: Dict[int, float] = {}
    for r, w in neighbor_weights.items():
        ri = as_int(r)
        if ri is None:
            raise TypeError(f"{opname}: neighbor_weights keys must be int ranks, got {r!r}")
        r = ri
        if r not in ins:
            raise ValueError(
                f"{opname}: rank {r} in neighbor_weights is not an in-neighbour of rank {me} "
                f"(in-neighbours: {ins}); change the topology with set_topology() or drop it"
            )
        nw[r] = _check_weight(w, f"{opname}: neighbor_weights[{r}]")
    return topo, ins, sw, nw


def _src_weights(
    opname: str, neighbor_weights: Optional[Mapping[int, float]], src_weights: Optional[Mapping[int, float]]
) -> Optional[Mapping[int, float]]:
    """``src_weights`` (newer Bluefog's name) in place of ``neighbor_weights``; TypeError for both."""
    if src_weights is None:
        return neighbor_weights
    if neighbor_weights is not None:
        raise TypeError(f"{opname}: pass neighbor_weights or src_weights (its newer Bluefog name), not both")
    return src_weights


# ---------------------------------------------------------------------------- neighbour collectives
def neighbor_allreduce_async(
    tensor: torch.Tensor,
    self_weight: Optional[float] = None,
    neighbor_weights: Optional[Mapping[int, float]] = None,
    name: Optional[str] = None,
    comm: CommArg = None,
    *,
    src_weights: Optional[Mapping[int, float]] = None,
) -> Work:
    """Asynchronous :func:`neighbor_allreduce`; the handle's result is the combined tensor.

    Example::

        h = neighbor_allreduce_async(x)
        ...                                   # overlap compute
        y = synchronize(h)
    """
    opname = f"neighbor_allreduce({name})" if name else "neighbor_allreduce"
    neighbor_weights = _src_weights(opname, neighbor_weights, src_weights)
    t = _tensor(tensor, "tensor", opname)
    _averageable(t, opname, "convert it first")
    c = resolve_comm(comm, opname)
    topo, ins, sw, nw = _weights(opname, c, self_weight, neighbor_weights)
    n, me = c.nranks(), c.rank()
    src = t.detach()
    out = torch.empty(src.shape, dtype=src.dtype, device=src.device)
    acc_dtype = torch.float32 if src.dtype in _HALF else src.dtype
    numel = src.numel()
    if n == 1:
        torch.mul(src, sw, out=out)
        return CompletedWork(opname, out)
    # src goes to the exchange as it is: the collectives take their elements in row-major order, and
    # copy a non-contiguous tensor when the operation starts, after the earlier asynchronous
    # operations that may still write it (a copy made here would read the values from before them).
    strategy = exchange_strategy(topo, numel * src.element_size())
    if strategy == "allgather":
        buf = torch.empty(n * numel, dtype=src.dtype, device=src.device)
        inner = cast(Work, _core.allgather(src, buf, comm=c, async_op=True))  # async_op=True: a Work
        rows = buf.view(n, numel)
        pick: List[tuple] = [(rows[r], w) for r, w in nw.items() if w != 0.0]
    else:
        buf, inner = _exchange(c, topo, me, src)
        rows = buf.view(len(ins), numel)
        pick = [(rows[ins.index(r)], w) for r, w in nw.items() if w != 0.0]

    def combine() -> None:
        # The self term is taken here, after the exchange, as the engine reads src when the exchange
        # runs (an earlier asynchronous operation may still write src when this call is made). ``out``
        # is contiguous; the float32 accumulator of a half tensor is made contiguous too (a transposed
        # or channels_last input would otherwise keep its strides and defeat acc.view(-1)).
        if acc_dtype == src.dtype:
            acc = torch.mul(src, sw, out=out)
        else:
            acc = src.to(acc_dtype, memory_format=torch.contiguous_format).mul_(sw)
        acc_flat = acc.view(-1)
        for row, w in pick:
            acc_flat.add_(row if row.dtype == acc_dtype else row.to(acc_dtype), alpha=w)
        if acc is not out:
            out.copy_(acc)

    return then_work(c, opname, inner, combine, out, (src,))  # combine reads src


def _exchange(c: Communicator, topo: Any, me: int, src: torch.Tensor) -> tuple:
    """Send ``src`` to every out-neighbour and receive from every in-neighbour in one alltoall_v."""
    n, numel = c.nranks(), src.numel()
    ins, outs = topo.in_neighbors(me), set(topo.out_neighbors(me))
    buf = torch.empty(len(ins) * numel, dtype=src.dtype, device=src.device)
    send_counts = [numel if j in outs else 0 for j in range(n)]
    recv_counts = [0] * n
    recv_displs = [0] * n
    for k, r in enumerate(ins):
        recv_counts[r] = numel
        recv_displs[r] = k * numel
    # Every destination reads the same region of the send buffer: no copy per neighbour.
    inner = _core.alltoall_v(src, send_counts, [0] * n, buf, recv_counts, recv_displs, comm=c, async_op=True)
    return buf, inner


def neighbor_allreduce(
    tensor: torch.Tensor,
    self_weight: Optional[float] = None,
    neighbor_weights: Optional[Mapping[int, float]] = None,
    name: Optional[str] = None,
    comm: CommArg = None,
    *,
    src_weights: Optional[Mapping[int, float]] = None,
) -> torch.Tensor:
    """Weighted average of ``tensor`` over this rank and its in-neighbours (Bluefog's ``neighbor_allreduce``).

    Collective over the communicator: every rank calls it. The input is not modified. The result is
    ``self_weight * x_self + sum_r neighbor_weights[r] * x_r``.

    Args:
        tensor: a floating or complex tensor of the same shape and dtype on every rank.
        self_weight: weight of this rank's own value; given together with ``neighbor_weights``.
        neighbor_weights: ``{in-neighbour rank: weight}``; ranks left out get weight 0. Any finite
            weights, as in Bluefog: weights summing to 1 average, others give a weighted sum (e.g.
            ``self_weight=1.0`` and every weight 1.0: the plain sum). Without either: the
            topology's weights if it was set with ``is_weighted=True``, else
            ``1 / (in_degree + 1)`` each.
        name: a label used in error messages (Bluefog keys operations by it; trainloom matches
            operations by issue order, so it is optional).
        comm: communicator or process group (None: the default group).
        src_weights: newer Bluefog's name for ``neighbor_weights`` (keyword only; not both).

    Returns:
        A new tensor of the same shape and dtype (float16/bfloat16 accumulate in float32).

    Raises:
        TypeError: not a tensor, an integer dtype, bad weight types, both ``neighbor_weights`` and
            ``src_weights``.
        ValueError: a weighted rank that is not an in-neighbour, non-finite weights, only one of
            ``self_weight`` / ``neighbor_weights``.
        CommError: the ranks disagree on the element count, the dtype or (exchange mode) the
            topology. Shapes with the same element count are not compared (as in torch.distributed).
        CommTimeoutError: a neighbour did not arrive in time.

    Example::

        set_topology(RingGraph(world_size))
        x = torch.full((4,), float(rank))
        y = neighbor_allreduce(x)                       # mean of ranks r-1, r, r+1
        y = neighbor_allreduce(x, self_weight=0.5, neighbor_weights={(rank + 1) % world_size: 0.5})
        s = neighbor_allreduce(x, self_weight=1.0, src_weights={r: 1.0 for r in in_neighbor_ranks()})  # sum
    """
    return synchronize(  # type: ignore[return-value]
        neighbor_allreduce_async(tensor, self_weight, neighbor_weights, name, comm, src_weights=src_weights)
    )


# Trailing dimensions a gather header carries for the error message; a digest compares all of them.
_HDR_DIMS = 6
# Header fields before those dimensions: dtype code, ndim, first dimension, digest of the other
# dimensions, elements per row, device kind.
_HDR_FIXED = 6


def _shape_header(src: torch.Tensor) -> torch.Tensor:
    """``[dtype code, ndim, first dimension, digest of the other dimensions, elements per row, device
    kind (0 CPU, 1 other), the first _HDR_DIMS other dimensions...]``. The digest is a truncated
    blake2b (a polynomial hash let ``(1, 1000004)`` pass for ``(2, 1)``); the row size and the device
    are compared too, so that no rank takes another path or another element count than the others."""
    from trainloom.comm._gloo import DTYPE_CODES  # (imported at first use, as group.cross_check does)

    shape = tuple(src.shape)
    rest = shape[1:]
    packed = struct.pack(f"<{len(rest)}q", *rest)  # not hash(): the same in every process and version
    digest = int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1
    dims = list(rest[:_HDR_DIMS]) + [-1] * (_HDR_DIMS - min(len(rest), _HDR_DIMS))
    first = shape[0] if shape else 1  # a 0-d tensor is one row
    row = math.prod(rest)
    device = 0 if src.is_cpu else 1
    return torch.tensor(
        [DTYPE_CODES.get(src.dtype, 0), len(shape), first, digest, row, device, *dims], dtype=torch.int64
    )


def _describe(row: Sequence[int]) -> str:
    """A header as ``float32 (17, 3)``."""
    from trainloom.comm._gloo import DTYPE_CODES

    names = {code: str(dt).replace("torch.", "") for dt, code in DTYPE_CODES.items()}
    ndim = row[1]
    if ndim == 0:
        return f"{names.get(row[0], 'unsupported dtype')} ()"
    dims = [row[2], *row[_HDR_FIXED : _HDR_FIXED + min(ndim - 1, _HDR_DIMS)]]
    inner = ", ".join(map(str, dims)) + (", ..." if ndim - 1 > _HDR_DIMS else "") + ("," if ndim == 1 else "")
    return f"{names.get(row[0], 'unsupported dtype')} ({inner})"


def _first_dims(c: Communicator, src: torch.Tensor) -> List[int]:
    """Every rank's first dimension, from one small synchronous allgather over the CPU engine. The
    ranks' dtypes and other dimensions must agree: otherwise every rank raises the same CommError
    (from the same exchanged data), naming each rank's dtype and shape."""
    mine = _shape_header(src)
    n = c.nranks()
    rows_t = torch.empty(n * mine.numel(), dtype=torch.int64)
    _core.allgather(mine, rows_t, comm=c)
    rows = rows_t.view(n, -1).tolist()

    def key(row: List[int]) -> List[int]:  # everything but the first dimension
        return row[:2] + row[3:]

    if any(key(row) != key(rows[0]) for row in rows):
        each = "; ".join(f"rank {r} has {_describe(row)}" for r, row in enumerate(rows))
        devices = {row[5] for row in rows}
        where = " and the device kind (CPU or not)" if len(devices) > 1 else ""
        raise CommError(
            f"ranks disagree on the tensor: only the first dimension may differ between ranks, the "
            f"dtype{where} and the other dimensions must be the same ({each})"
        )
    return [row[2] for row in rows]


def _gather_start(
    c: Communicator,
    src: torch.Tensor,
    firsts: List[int],
    topo: Any,
    async_op: bool,
) -> Tuple[torch.Tensor, Optional[Work], Optional[Callable[[], None]]]:
    """Start gathering ``src`` from every rank (``topo`` None) or from this rank's in-neighbours.

    ``firsts`` holds every rank's first dimension (:func:`_first_dims`, the same list on every
    rank, so every rank picks the same collectives). Returns the output, the Work (None when not
    ``async_op``) and what to run after it (or None).
    """
    n, me = c.nranks(), c.rank()
    numel = src.numel()
    row = math.prod(src.shape[1:])  # elements per index of dimension 0 (1 for a 0-d tensor)
    srcs = list(range(n)) if topo is None else topo.in_neighbors(me)
    total = sum(firsts[r] for r in srcs)
    out = torch.empty((total, *src.shape[1:]), dtype=src.dtype, device=src.device)
    same = all(f == firsts[0] for f in firsts)
    # src as it is, not reshaped: see neighbor_allreduce_async
    if topo is None and same:
        return out, _core.allgather(src, out, comm=c, async_op=async_op), None
    if topo is not None and same and exchange_strategy(topo, numel * src.element_size()) == "allgather":
        buf = torch.empty(n * numel, dtype=src.dtype, device=src.device)
        work = _core.allgather(src, buf, comm=c, async_op=async_op)
        index = torch.tensor(srcs, dtype=torch.long, device=src.device)

        def pick() -> None:
            torch.index_select(buf.view(n, numel), 0, index, out=out.view(len(srcs), numel))

        return out, work, pick
    # One alltoall_v with per-rank counts; every destination reads the same send buffer.
    outs = set(range(n)) if topo is None else set(topo.out_neighbors(me))
    send_counts = [numel if j in outs else 0 for j in range(n)]
    recv_counts = [0] * n
    recv_displs = [0] * n
    offset = 0
    for r in srcs:
        recv_counts[r] = firsts[r] * row
        recv_displs[r] = offset
        offset += recv_counts[r]
    work = _core.alltoall_v(
        src, send_counts, [0] * n, out, recv_counts, recv_displs, comm=c, async_op=async_op
    )
    return out, work, None


def _gather_now(c: Communicator, opname: str, src: torch.Tensor, topo: Any) -> torch.Tensor:
    """The CPU (neighbour) allgather of ``src``, run in this thread: the caller's for a synchronous
    call (which follows the asynchronous ones issued before it), or the worker's inside an operation
    (nested calls from a running operation run at once). Every CommError starts with ``opname``."""
    try:
        out, _, after = _gather_start(c, src, _first_dims(c, src), topo, False)
        if after is not None:
            with torch.no_grad():
                after()
    except CommError as exc:
        _name_error(exc, opname)
        raise
    return out


def _gather_work(c: Communicator, opname: str, src: torch.Tensor, topo: Any, async_op: bool) -> Work:
    """The (neighbour) allgather of ``src`` over ``c`` (more than one rank): the exchange of the
    ranks' shapes, then the gather sized by them (:func:`_gather_start`). Every CommError it raises
    starts with ``opname``. Not ``async_op``: a CPU gather runs now, in this thread (no worker hop)."""
    if src.is_cpu:
        if not async_op:
            return CompletedWork(opname, _gather_now(c, opname, src, topo))
        box: List[torch.Tensor] = []

        def body(_engine: Any) -> None:
            box.append(_gather_now(c, opname, src, topo))  # one operation on the worker

        # needs_engine: the engine connects now, in issue order on every rank (body only nests calls).
        # It reads src: it follows the pending sends and receives on src's memory, not the others,
        # and only later ones on src's memory follow it (the output is new, made by body).
        w = c.execute(opname, "cpu", body, True, None, touches=(src,))
        return _GatherWork(opname, w._future, box)  # type: ignore[union-attr]
    # CUDA: the shapes go through the CPU engine now (the output's size depends on them), then the
    # gather is enqueued on the CUDA stream.
    try:
        firsts = _first_dims(c, src)
    except CommError as exc:
        _name_error(exc, opname)
        raise
    out, work, after = _gather_start(c, src, firsts, topo, True)
    return then_work(c, opname, cast(Work, work), after, out, (src,))


def _neighbor_allgather(tensor: Any, name: Optional[str], comm: CommArg, async_op: bool) -> Work:
    opname = f"neighbor_allgather({name})" if name else "neighbor_allgather"
    t = _core._tensor(tensor, "tensor", opname)  # dense, CPU/CUDA, a supported dtype: before any exchange
    c = resolve_comm(comm, opname)
    topo, _ = topology_entry(c)
    src = t.detach()
    if c.nranks() == 1:
        return CompletedWork(opname, torch.empty((0, *src.shape[1:]), dtype=src.dtype, device=src.device))
    return _gather_work(c, opname, src, topo, async_op)


def neighbor_allgather_async(tensor: torch.Tensor, name: Optional[str] = None, comm: CommArg = None) -> Work:
    """Asynchronous :func:`neighbor_allgather`; the handle's result is the concatenated tensor."""
    return _neighbor_allgather(tensor, name, comm, True)


def neighbor_allgather(
    tensor: torch.Tensor, name: Optional[str] = None, comm: CommArg = None
) -> torch.Tensor:
    """The in-neighbours' tensors concatenated along dimension 0 (Bluefog's ``neighbor_allgather``).

    This rank's own tensor is not included. As in Bluefog, the first dimension may differ between
    ranks; the dtype and the other dimensions must be the same on every rank.

    Returns:
        A tensor of shape ``(sum of the in-neighbours' tensor.shape[0], *tensor.shape[1:])`` (0-d
        inputs give shape ``(len(in_neighbors),)``), in in-neighbour rank order.

    Raises:
        TypeError: not a tensor.
        CommError: the ranks disagree on the dtype or on a dimension other than the first (the same
            error on every rank, naming each rank's dtype and shape), or, in exchange mode, on the
            topology; the message starts with the call (``neighbor_allgather(<name>): ...``).
        CommTimeoutError: a rank did not arrive in time.

    Example::

        set_topology(RingGraph(world_size))
        g = neighbor_allgather(torch.tensor([float(rank)]))    # [rank - 1, rank + 1] in rank order
        v = neighbor_allgather(torch.zeros(rank + 1, 3))       # rows: sum of the neighbours' rank + 1
    """
    return synchronize(_neighbor_allgather(tensor, name, comm, False))  # type: ignore[return-value]


# ---------------------------------------------------------------------------- functional forms
def _allreduce_work(tensor: torch.Tensor, average: bool, opname: str, comm: CommArg, copy: bool) -> Work:
    """Start an average (or sum) of ``tensor`` over all ranks, into a new tensor when ``copy``."""
    t = _tensor(tensor, "tensor", opname)
    if average:
        _averageable(t, opname, "pass average=False for a sum")
    c = resolve_comm(comm, opname)
    out = t.detach().clone(memory_format=torch.contiguous_format) if copy else t
    return _core.allreduce_inplace(out, ReduceOp.AVG if average else ReduceOp.SUM, comm=c, async_op=True)  # type: ignore[return-value]


def allreduce_async(
    tensor: torch.Tensor, average: bool = True, name: Optional[str] = None, comm: CommArg = None
) -> Work:
    """Asynchronous :func:`allreduce`; the handle's result is a new tensor."""
    return _allreduce_work(tensor, average, f"allreduce({name})" if name else "allreduce", comm, copy=True)


def allreduce(
    tensor: torch.Tensor, average: bool = True, name: Optional[str] = None, comm: CommArg = None
) -> torch.Tensor:
    """Average (or sum) ``tensor`` over all ranks into a new tensor; the input is not modified.

    Differentiable, as Horovod's and Bluefog's: when ``tensor`` requires grad, the backward pass
    reduces the gradient the same way (every rank must then run that backward, or it waits).

    Args:
        tensor: same shape and dtype on every rank.
        average: average (floating/complex dtypes) or sum.
        name: a label for error messages.
        comm: communicator or process group (None: the default group).

    Example::

        y = allreduce(torch.full((2,), float(rank)))          # mean of the ranks
    """
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return _AllreduceFn.apply(tensor, average, name, comm)
    return synchronize(allreduce_async(tensor, average, name, comm))  # type: ignore[return-value]


class _AllreduceFn(torch.autograd.Function):
    """allreduce with Horovod's backward: the gradient is reduced the same way (sum or mean)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: bool, name: Optional[str], comm: CommArg) -> Any:
        ctx.average, ctx.name, ctx.comm = average, name, comm
        return synchronize(allreduce_async(tensor.detach(), average, name, comm))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        label = f"{ctx.name} backward" if ctx.name else "backward"
        return synchronize(allreduce_async(grad, ctx.average, label, ctx.comm)), None, None, None


def allreduce_async_(
    tensor: torch.Tensor, average: bool = True, name: Optional[str] = None, comm: CommArg = None
) -> Work:
    """Asynchronous :func:`allreduce_` (in place); the handle's result is ``tensor``."""
    return _allreduce_work(tensor, average, f"allreduce_({name})" if name else "allreduce_", comm, copy=False)


def allreduce_(
    tensor: torch.Tensor, average: bool = True, name: Optional[str] = None, comm: CommArg = None
) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, comm))  # type: ignore[return-value]


def _allgather(tensor: Any, name: Optional[str], comm: CommArg, async_op: bool) -> Work:
    opname = f"allgather({name})" if name else "allgather"
    t = _core._tensor(tensor, "tensor", opname)  # dense, CPU/CUDA, a supported dtype: before any exchange
    c = resolve_comm(comm, opname)
    src = t.detach()
    if c.nranks() == 1:
        out = torch.empty(src.shape if src.dim() else (1,), dtype=src.dtype, device=src.device)
        return _core.allgather(src, out, comm=c, async_op=True)  # type: ignore[return-value]
    return _gather_work(c, opname, src, None, async_op)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None, comm: CommArg = None) -> Work:
    """Asynchronous :func:`allgather`; the handle's result is the concatenated tensor."""
    return _allgather(tensor, name, comm, True)


def allgather(tensor: torch.Tensor, name: Optional[str] = None, comm: CommArg = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0 (rank order) into a new tensor (Bluefog's
    ``allgather``); the input is not modified.

    As in Bluefog, the first dimension may differ between ranks (the output's first dimension is
    their sum); the dtype and the other dimensions must be the same on every rank.

    Raises:
        TypeError: not a tensor.
        CommError: the ranks disagree on the dtype or on a dimension other than the first (the same
            error on every rank, naming each rank's dtype and shape); the message starts with the
            call (``allgather(<name>): ...``).
        CommTimeoutError: a rank did not arrive in time.

    Example::

        g = allgather(torch.tensor([float(rank)]))      # [0., 1., ..., world_size - 1]
        v = allgather(torch.zeros(rank + 1, 3))         # shape (1 + 2 + ... + world_size, 3)
    """
    return synchronize(_allgather(tensor, name, comm, False))  # type: ignore[return-value]


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, comm: CommArg = None
) -> Work:
    """Asynchronous :func:`broadcast` (the input is not modified)."""
    opname = f"broadcast({name})" if name else "broadcast"
    t = _tensor(tensor, "tensor", opname)
    c = resolve_comm(comm, opname)
    out = t.detach().clone(memory_format=torch.contiguous_format)
    return _core.broadcast(out, root_rank, comm=c, async_op=True)  # type: ignore[return-value]


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, comm: CommArg = None
) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor`` on every rank.

    Differentiable, as Bluefog's ("a thin wrapper around an autograd function"): the root's
    ``tensor`` gets the sum of every rank's gradient, the other ranks' a zero gradient (every rank
    must then run that backward, or it waits).

    Example::

        w = broadcast(torch.full((2,), float(rank)), root_rank=0)   # [0., 0.] everywhere
    """
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastFn.apply(tensor, root_rank, name, comm)
    return synchronize(broadcast_async(tensor, root_rank, name, comm))  # type: ignore[return-value]


class _BroadcastFn(torch.autograd.Function):
    """broadcast with Horovod's backward: the gradients summed over ranks, kept on the root."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str], comm: CommArg) -> Any:
        ctx.root, ctx.name, ctx.comm = root_rank, name, comm
        return synchronize(broadcast_async(tensor.detach(), root_rank, name, comm))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        label = f"{ctx.name} backward" if ctx.name else "broadcast backward"
        total = cast(torch.Tensor, synchronize(allreduce_async(grad, False, label, ctx.comm)))
        if resolve_comm(ctx.comm, "broadcast backward").rank() != ctx.root:
            total.zero_()
        return total, None, None, None


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, comm: CommArg = None
) -> Work:
    """Asynchronous in-place :func:`broadcast_`."""
    opname = f"broadcast_({name})" if name else "broadcast_"
    t = _tensor(tensor, "tensor", opname)
    c = resolve_comm(comm, opname)
    return _core.broadcast(t, root_rank, comm=c, async_op=True)  # type: ignore[return-value]


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, comm: CommArg = None
) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s value, in place; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, comm))  # type: ignore[return-value]


def barrier(comm: CommArg = None) -> None:
    """Wait until every rank arrived; asynchronous operations issued before it have finished."""
    _core.barrier(comm=resolve_comm(comm, "barrier"))
