"""The early ``torch.distributed`` API (isend/irecv, list-based gather/scatter) over trainloom's collectives.

A script written for the early API moves over by changing its import::

    import trainloom.comm.classic as dist          # was: import torch.distributed as dist

    dist.init_process_group("gloo")                # backend is accepted; engines are chosen per tensor
    req = dist.isend(t, dst=1)                     # a Work: is_completed(), wait()
    sender = dist.recv(buf)                        # from any source; returns the sender's rank

Ranks (``src``, ``dst``, return values) are *global* ranks, as in torch.distributed; ``group`` is
``group.WORLD`` (or None) for the default group, or a trainloom ProcessGroup from :func:`new_group`.
Every collective also takes ``async_op=False`` (then returns the core
:class:`~trainloom.comm.work.Work`).

Receiving from any source: :func:`send` / :func:`isend` announce each message in the job's store
(``store.add`` + ``store.set``, ~0.1-1 ms) with the sender's rank and the message's place among
everything that rank sent to the receiver; ``recv(tensor)`` without ``src`` takes the next
announcement addressed to it (blocking, with the group's timeout), passes over one whose message a
receive with an explicit ``src`` already took, and receives from that rank. Messages sent with the
Bagua-style :func:`trainloom.comm.send` are not announced (an any-source receive does not wait for
them), but they hold their place in the stream: receive them with an explicit ``src``, before or
after any-source receives of announced messages from the same sender.

``isend``/``irecv`` calls run in issue order per direction and peer, each (direction, peer) on its
own thread, so two ranks that ``isend`` to each other and then receive, ``irecv`` first and then
send, or exchange with several neighbours at once, do so with messages of any size on both CPU
engines. A collective waits only for the pending ``isend``/``irecv`` whose tensors share memory
with its own, and a send or receive only for the pending asynchronous collectives whose tensors
share memory with its own (docs/comm.md, "Point to point on CPU"), so ``req = irecv(buf, 1);
all_reduce(x); req.wait()`` runs against ``all_reduce(x); send(t, 0)`` on the peer, and ``req =
all_reduce(x, async_op=True); send(t, 1); req.wait()`` against ``recv(buf, 0); all_reduce(x)``, as
in torch.distributed.

:func:`init_process_group` accepts the early launchers: ``rank=``/``world_size=`` with only
MASTER_ADDR/MASTER_PORT set (``multiprocessing.Process`` per rank), or ``init_method="tcp://..."``;
the local rank and size are then found from which ranks share a node.
"""

from __future__ import annotations

import datetime
import threading
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Union, cast

import torch
import torch.distributed as _tdist

from trainloom.comm import collectives as _core
from trainloom.comm import group as _group
from trainloom.comm._gloo import poll_keys
from trainloom.comm.collectives import ReduceOp
from trainloom.comm.group import Communicator, ProcessGroup
from trainloom.comm.neighbor import then_work
from trainloom.comm.topology import group_rank_of as _local
from trainloom.comm.topology import resolve_comm
from trainloom.comm.work import CompletedWork, Work
from trainloom.errors import CommTimeoutError, ConfigError

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "is_available",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "new_group",
    "group",
    "reduce_op",
    "ReduceOp",
    "isend",
    "irecv",
    "send",
    "recv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "barrier",
]


class reduce_op:  # noqa: N801 - the early torch.distributed name
    """The early ``torch.distributed.reduce_op`` names, as trainloom ReduceOp values."""

    SUM = ReduceOp.SUM
    PRODUCT = ReduceOp.PRODUCT
    MAX = ReduceOp.MAX
    MIN = ReduceOp.MIN


class group:  # noqa: N801 - the early torch.distributed name
    """``group.WORLD`` is the default group."""

    WORLD = object()


GroupArg = Union[None, object, ProcessGroup, Communicator]
_BACKENDS = ("gloo", "nccl", "mpi", "tcp")


def init_process_group(
    backend: str = "gloo",
    init_method: str = "env://",
    world_size: int = -1,
    rank: int = -1,
    group_name: str = "",
    timeout: Optional[Union[float, datetime.timedelta]] = None,
) -> None:
    """Initialize the default group (early torch.distributed signature).

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"mpi"`` or ``"tcp"``: accepted for compatibility; trainloom
            picks the engine per tensor (NCCL for CUDA, shared memory or gloo for CPU).
        init_method: ``"env://"`` (torchrun's variables) or ``"tcp://host:port"``.
        world_size: overrides WORLD_SIZE (-1: from the environment).
        rank: overrides RANK (-1: from the environment).
        group_name: ignored (accepted for compatibility).
        timeout: seconds or a timedelta for every operation.

    Raises:
        ConfigError: unknown backend or init_method.
        RepeatedInitializationError: already initialized.
    """
    if backend not in _BACKENDS:
        raise ConfigError(f"init_process_group: backend {backend!r} is not one of {', '.join(_BACKENDS)}")
    store = None
    if init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://") :].rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"init_process_group: init_method {init_method!r} must be tcp://host:port")
        if rank < 0 or world_size < 1:
            raise ConfigError("init_process_group: init_method tcp:// needs rank= and world_size=")
        # checked (and TRAINLOOM_COMM_TIMEOUT read) before the store starts, as init_process_group does
        td = datetime.timedelta(seconds=_group._seconds(timeout))
        store = _tdist.TCPStore(host, int(port), world_size, rank == 0, timeout=td)
    elif init_method != "env://":
        raise ConfigError(f"init_process_group: init_method {init_method!r}: use env:// or tcp://host:port")
    pg = _group.init_process_group(
        store=store,
        timeout=timeout,
        rank=rank if rank >= 0 else None,
        world_size=world_size if world_size >= 1 else None,
    )
    # torch.distributed connects a group when it is made; trainloom's core groups connect at their
    # first operation (Bagua's rule), which deadlocks torch scripts that issue asynchronous operations
    # on several groups in a different order on each rank. Here groups connect when made, as in torch.
    pg.get_global_communicator()


def destroy_process_group() -> None:
    """Destroy the default group and every group created from it."""
    _ANY.clear()
    _group.destroy_process_group()


def is_available() -> bool:
    """Always True: this API runs wherever trainloom imports (early torch.distributed's guard,
    ``if dist.is_available():``)."""
    return True


def is_initialized() -> bool:
    """Whether :func:`init_process_group` ran."""
    return _group.is_initialized()


def new_group(ranks: Optional[Sequence[int]] = None) -> ProcessGroup:
    """A group over ``ranks`` (every rank must call it, in the same order), connected now on its
    members, as torch.distributed's (a group of the core API connects at its first operation)."""
    pg = _group.new_group(ranks)
    pg.get_global_communicator()
    return pg


def _comm(g: GroupArg, opname: str) -> Communicator:
    # group=0: the id of the world group before torch 0.4 (the distributed tutorial's
    # average_gradients passes it); any other int is refused here.
    world = g is None or g is group.WORLD or (type(g) is int and g == 0)
    if not world and not isinstance(g, (ProcessGroup, Communicator)):
        # resolve_comm would speak of the core's ``comm=``, which this API's users never see.
        raise TypeError(
            f"{opname}: group must be a ProcessGroup from new_group(), group.WORLD or None (the world), "
            f"got {type(g).__name__} {g!r}"
        )
    return resolve_comm(None if world else g, opname)  # type: ignore[arg-type]


def get_rank(group: GroupArg = None) -> int:  # noqa: A002 - torch's name
    """This process's rank in ``group`` (default: the world)."""
    return _comm(group, "get_rank").rank()


def get_world_size(group: GroupArg = None) -> int:  # noqa: A002 - torch's name
    """The number of ranks in ``group`` (default: the world)."""
    return _comm(group, "get_world_size").nranks()


def _tensor(t: Any, arg: str, opname: str) -> torch.Tensor:
    """The core's checks (type, layout, device, dtype) under this module's names, before anything
    is announced or counted for the any-source protocol."""
    return _core._tensor(t, arg, opname)


def _sync(work: Optional[Work], async_op: bool) -> Optional[Work]:
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


# ---------------------------------------------------------------------------- point to point
class _AnySource:
    """Per-process bookkeeping of the any-source protocol (announcement queue per receiver)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # the last announcement index read, per (store namespace, communicator name)
        self.head: Dict[str, int] = defaultdict(int)

    def clear(self) -> None:
        self.head.clear()


_ANY = _AnySource()


def _store() -> Any:
    store = _group._STATE.store
    if store is None:
        raise ConfigError("the default process group is not initialized; call init_process_group() first")
    return store


def _announce(c: Communicator, dst_local: int, place: int) -> None:
    """Announce to ``dst_local`` a message from this rank, the ``place``-th (from 0) of every message
    this rank issued to it on ``c``, through any API: ``"<sender>:<place>"``."""
    store = _store()
    key = f"anysrc/{c.name}/{dst_local}"
    idx = store.add(f"{key}/n", 1)
    store.set(f"{key}/{idx}", f"{c.rank()}:{place}")


def isend(tensor: torch.Tensor, dst: int, group: GroupArg = None) -> Work:  # noqa: A002
    """Send ``tensor`` to global rank ``dst`` asynchronously; a Work with ``is_completed()``/``wait()``.

    Do not modify ``tensor`` before the request completed.

    Example::

        req = isend(torch.ones(4), dst=1)
        req.wait()
    """
    return _isend(tensor, dst, group, "isend")


def _isend(tensor: torch.Tensor, dst: int, group: GroupArg, opname: str) -> Work:
    t = _tensor(tensor, "tensor", opname)
    c = _comm(group, opname)
    d = _local(dst, "dst", c, opname)
    if d == c.rank():
        raise ValueError(f"{opname}: dst={dst} is this rank; send to another rank")
    place = c.p2p_issued(f"send:{d}")  # this message's place among every send to d
    work = _core.send(t, d, comm=c, async_op=True)
    # Announced once the send was accepted: a refused send must announce nothing, or an any-source
    # recv would wait for a message that never comes and pair the next ones with the wrong sender.
    _announce(c, d, place)
    return work  # type: ignore[return-value]


def send(tensor: torch.Tensor, dst: int, group: GroupArg = None) -> None:  # noqa: A002
    """Send ``tensor`` to global rank ``dst``; the receiver may call ``recv`` with or without ``src``."""
    _isend(tensor, dst, group, "send").wait()


def irecv(tensor: torch.Tensor, src: int, group: GroupArg = None) -> Work:  # noqa: A002
    """Receive into ``tensor`` from global rank ``src`` asynchronously (a Work).

    Messages from one sender arrive in the order it sent them, whichever API sent them: a
    receive with an explicit ``src`` takes that sender's next message, and a later
    ``recv(src=None)`` passes over the announcement of a message taken this way. Messages from the
    Bagua-style :func:`trainloom.comm.send` are not announced: receive them with an explicit ``src``.

    Example::

        req = irecv(buf, src=0)
        ...
        req.wait()
    """
    return _irecv(tensor, src, group, "irecv")


def _irecv(tensor: torch.Tensor, src: int, group: GroupArg, opname: str) -> Work:
    t = _tensor(tensor, "tensor", opname)
    c = _comm(group, opname)
    s = _local(src, "src", c, opname)
    if s == c.rank():
        raise ValueError(f"{opname}: src={src} is this rank; receive from another rank")
    return _core.recv(t, s, comm=c, async_op=True)  # type: ignore[return-value]


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: GroupArg = None) -> int:  # noqa: A002
    """Receive into ``tensor`` from global rank ``src``, or from any rank when ``src`` is None.

    Returns:
        The sender's global rank.

    Raises:
        ValueError: ``src`` is this rank or not in the group; ``src=None`` in a group of one.
        CommTimeoutError: no message was announced for this rank within the group's timeout.

    Example::

        sender = recv(buf)              # whoever sent first
    """
    opname = "recv"
    t = _tensor(tensor, "tensor", opname)
    c = _comm(group, opname)
    if src is not None:
        _irecv(t, src, group, opname).wait()
        return src
    if c.nranks() == 1:
        raise ValueError(f"{opname}: src=None (any source) in a group of one rank: there is no sender")
    store = _store()
    key = f"anysrc/{c.name}/{c.rank()}"
    # per generation of the default group: its store namespace is new, and so are the announcement
    # counters (the core destroy_process_group(), which bf.shutdown() uses too, does not clear head)
    head = f"{_group._STATE.namespace}/{c.name}"
    while True:
        with _ANY.lock:
            _ANY.head[head] += 1
            idx = _ANY.head[head]
        try:
            # polled, not a blocking get: Ctrl-C must not wait for the group's timeout
            poll_keys(store, [f"{key}/{idx}"], c.timeout)
            sender, place = (int(x) for x in bytes(store.get(f"{key}/{idx}")).decode().split(":"))
        except _tdist.DistStoreError:
            with _ANY.lock:
                _ANY.head[head] -= 1
            raise CommTimeoutError(
                f"{opname}(src=None) on rank {c.global_ranks[c.rank()]}: no message was sent to this rank "
                f"within the group's timeout ({c.timeout:g} s); messages must come from "
                "trainloom.comm.classic.send/isend to be received from any source"
            ) from None
        store.delete_key(f"{key}/{idx}")
        if c.p2p_issued(f"recv:{sender}") > place:
            continue  # a receive with an explicit src took this message (or is taking it)
        _core.recv(t, sender, comm=c)
        return c.global_ranks[sender]


# ---------------------------------------------------------------------------- collectives
def broadcast(
    tensor: torch.Tensor, src: int, group: GroupArg = None, async_op: bool = False
) -> Optional[Work]:  # noqa: A002
    """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every rank of the group."""
    c = _comm(group, "broadcast")
    return _sync(_core.broadcast(tensor, _local(src, "src", c, "broadcast"), comm=c, async_op=True), async_op)


def all_reduce(
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,  # noqa: A002
) -> Optional[Work]:
    """Reduce ``tensor`` in place over the group (``op``: reduce_op / ReduceOp / torch's ReduceOp)."""
    t = _tensor(tensor, "tensor", "all_reduce")
    c = _comm(group, "all_reduce")
    return _sync(_core.allreduce_inplace(t, op, comm=c, async_op=True), async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: GroupArg = None,
    async_op: bool = False,  # noqa: A002
) -> Optional[Work]:
    """Reduce ``tensor`` onto global rank ``dst`` in place."""
    t = _tensor(tensor, "tensor", "reduce")
    c = _comm(group, "reduce")
    d = _local(dst, "dst", c, "reduce")
    return _sync(_core.reduce_inplace(t, d, op, comm=c, async_op=True), async_op)


def _check_list(lst: Any, n: int, like: torch.Tensor, arg: str, opname: str) -> List[torch.Tensor]:
    if not isinstance(lst, (list, tuple)):
        raise TypeError(f"{opname}: {arg} must be a list of {n} tensors, got {type(lst).__name__}")
    if len(lst) != n:
        raise ValueError(f"{opname}: {arg} has {len(lst)} tensors, expected {n} (one per rank of the group)")
    for i, x in enumerate(lst):
        _tensor(x, f"{arg}[{i}]", opname)
        if x.numel() != like.numel():
            raise ValueError(
                f"{opname}: {arg}[{i}] has {x.numel()} elements but tensor has {like.numel()}; "
                "they must match"
            )
        if x.dtype != like.dtype:
            raise TypeError(f"{opname}: {arg}[{i}] has dtype {x.dtype} but tensor has {like.dtype}")
    return list(lst)


def _unpack(flat: torch.Tensor, outs: List[torch.Tensor]) -> None:
    k = flat.numel() // max(len(outs), 1)
    for i, o in enumerate(outs):
        _core._write(o, flat[i * k : (i + 1) * k].view(o.shape))


def all_gather(
    tensor_list: List[torch.Tensor],
    tensor: torch.Tensor,
    group: GroupArg = None,
    async_op: bool = False,  # noqa: A002
) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``tensor_list`` (entry ``i`` from group rank ``i``).

    Example::

        outs = [torch.empty(2) for _ in range(get_world_size())]
        all_gather(outs, torch.full((2,), float(get_rank())))
    """
    opname = "all_gather"
    t = _tensor(tensor, "tensor", opname)
    c = _comm(group, opname)
    outs = _check_list(tensor_list, c.nranks(), t, "tensor_list", opname)
    flat = torch.empty(c.nranks() * t.numel(), dtype=t.dtype, device=t.device)
    inner = cast(Work, _core.allgather(t, flat, comm=c, async_op=True))  # async_op=True: a Work
    return _sync(then_work(c, opname, inner, lambda: _unpack(flat, outs), None, outs), async_op)


def gather(
    tensor: torch.Tensor,
    dst: Optional[int] = None,
    gather_list: Optional[List[torch.Tensor]] = None,
    group: GroupArg = None,  # noqa: A002
    async_op: bool = False,
) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` (default: this rank).

    Raises:
        ValueError: ``gather_list`` missing on ``dst`` or given (non-empty) elsewhere; wrong length.
    """
    opname = "gather"
    t = _tensor(tensor, "tensor", opname)
    c = _comm(group, opname)
    me_global = c.global_ranks[c.rank()]
    d = _local(me_global if dst is None else dst, "dst", c, opname)
    if d == c.rank():
        if gather_list is None:
            raise ValueError(f"{opname}: gather_list is required on the destination rank {me_global}")
        outs = _check_list(gather_list, c.nranks(), t, "gather_list", opname)
        flat = torch.empty(c.nranks() * t.numel(), dtype=t.dtype, device=t.device)
        inner = cast(Work, _core.gather(t, flat, d, comm=c, async_op=True))  # async_op=True: a Work
        return _sync(then_work(c, opname, inner, lambda: _unpack(flat, outs), None, outs), async_op)
    if gather_list:
        raise ValueError(f"{opname}: gather_list must be empty on rank {me_global}, which is not dst={dst}")
    return _sync(_core.gather(t, None, d, comm=c, async_op=True), async_op)  # type: ignore[arg-type]


def scatter(
    tensor: torch.Tensor,
    src: Optional[int] = None,
    scatter_list: Optional[List[torch.Tensor]] = None,
    group: GroupArg = None,  # noqa: A002
    async_op: bool = False,
) -> Optional[Work]:
    """Give group rank ``i`` the tensor ``scatter_list[i]`` of global rank ``src`` (default: this rank).

    Raises:
        ValueError: ``scatter_list`` missing on ``src`` or given (non-empty) elsewhere; wrong length.
    """
    opname = "scatter"
    t = _tensor(tensor, "tensor", opname)
    c = _comm(group, opname)
    me_global = c.global_ranks[c.rank()]
    s = _local(me_global if src is None else src, "src", c, opname)
    if s == c.rank():
        if scatter_list is None:
            raise ValueError(f"{opname}: scatter_list is required on the source rank {me_global}")
        ins = _check_list(scatter_list, c.nranks(), t, "scatter_list", opname)
        if c.nranks() == 1:
            return _sync(_core.scatter(ins[0].detach(), t, s, comm=c, async_op=True), async_op)
        # The list is copied into one send buffer when the operation starts, after the earlier
        # asynchronous operations on the group, which may still write its tensors.
        send_buf = torch.empty(c.nranks() * t.numel(), dtype=t.dtype, device=t.device)
        st = _core._Staged(opname)
        for x, part in zip(ins, send_buf.view(c.nranks(), -1)):
            st.fill(part.view(x.shape), x.detach())
        return _sync(_core._scatter_staged(c, opname, send_buf, t, s, True, st), async_op)
    if scatter_list:
        raise ValueError(f"{opname}: scatter_list must be empty on rank {me_global}, which is not src={src}")
    return _sync(_core.scatter(None, t, s, comm=c, async_op=True), async_op)  # type: ignore[arg-type]


def barrier(group: GroupArg = None, async_op: bool = False) -> Optional[Work]:  # noqa: A002
    """Block until every rank of the group arrived."""
    c = _comm(group, "barrier")
    w = _core.barrier(comm=c, async_op=True)
    return _sync(w if w is not None else CompletedWork("barrier", None), async_op)
