"""One-sided windows: Bluefog's win_create, win_put, win_get, win_accumulate, win_sync, win_free.

For groups whose ranks are all on one node and CPU tensors. Each rank owns one shared-memory file
with a *self* slot (the value it publishes, set by :func:`win_create` and every :func:`win_sync`)
and one slot per in-neighbour of the communicator's topology (what that neighbour put or
accumulated here, or what :func:`win_get` fetched from it). Every rank maps every other rank's file,
so ``win_put``/``win_accumulate``/``win_get`` are plain memory copies into or out of a neighbour's
slot, without the neighbour taking part (one-sided). Each slot is guarded by a POSIX byte-range lock
on its file (``fcntl.lockf``), so a put and the owner's sync never interleave inside a slot.

Only :func:`win_create` and :func:`win_free` are collective. Ordering between ranks is the user's
business, as with MPI windows: call :func:`trainloom.comm.neighbor.barrier` between a round of puts
and the syncs that should see them. The files are unlinked as soon as every rank has mapped them, so
nothing is left in /dev/shm even if the job is killed.

Groups spanning several nodes and CUDA tensors raise ``NotImplementedError`` naming the alternative,
:func:`~trainloom.comm.neighbor.neighbor_allreduce`.

Example::

    set_topology(RingGraph(world_size))
    win_create(x, "w")              # collective
    win_put(x, "w")                 # x -> my slot in each out-neighbour's window
    barrier()
    y = win_sync("w")               # uniform average of x and what the in-neighbours put
    win_free("w")
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
from typing import Dict, List, Mapping, Optional, Union

import torch

from trainloom.comm import collectives as _core
from trainloom.comm.group import Communicator, ProcessGroup
from trainloom.comm.state import broadcast_object
from trainloom.comm.topology import _check_weight, check_sum, resolve_comm, topology_entry
from trainloom.comm.work import CompletedWork, Work

__all__ = [
    "win_create",
    "win_free",
    "win_put",
    "win_put_async",
    "win_get",
    "win_get_async",
    "win_accumulate",
    "win_accumulate_async",
    "win_sync",
    "win_sync_then_collect",
    "win_poll",
    "win_wait",
]

CommArg = Union[None, Communicator, ProcessGroup]
_ALIGN = 64  # slots start on cache lines so two writers never share one


class _Window:
    def __init__(
        self, name: str, tensor: torch.Tensor, comm: Communicator, token: str, zero_init: bool
    ) -> None:
        topo, weighted = topology_entry(comm)
        self.name = name
        self.tensor = tensor
        self.comm = comm
        self.topo = topo
        self.weighted = weighted
        self.rank = comm.rank()
        self.nbytes = tensor.numel() * tensor.element_size()
        self.stride = max(_ALIGN, (self.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        n = comm.nranks()
        self.paths = [f"/dev/shm/tlwin-{token}-{r}" for r in range(n)]
        size = self.stride * (1 + len(topo.in_neighbors(self.rank)))
        fd = os.open(self.paths[self.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.fds: List[int] = []
        self.maps: List[mmap.mmap] = []
        self.freed = False
        self._zero_init = zero_init

    def open_all(self) -> None:
        for r, path in enumerate(self.paths):
            fd = os.open(path, os.O_RDWR)
            self.fds.append(fd)
            size = self.stride * (1 + len(self.topo.in_neighbors(r)))
            self.maps.append(mmap.mmap(fd, size))
        self.slot(self.rank, 0).copy_(self.tensor.reshape(-1))
        for k in range(len(self.topo.in_neighbors(self.rank))):
            buf = self.slot(self.rank, 1 + k)
            if self._zero_init:
                buf.zero_()
            else:
                buf.copy_(self.tensor.reshape(-1))

    def slot(self, owner: int, index: int) -> torch.Tensor:
        """Slot ``index`` (0 = self, 1 + k = k-th in-neighbour) of ``owner``'s window, as a flat tensor."""
        t = self.tensor
        if t.numel() == 0:
            return torch.empty(0, dtype=t.dtype)
        start = index * self.stride
        return torch.frombuffer(self.maps[owner], dtype=t.dtype, count=t.numel(), offset=start)

    def lock(self, owner: int, index: int) -> _SlotLock:
        return _SlotLock(self.fds[owner], index * self.stride, self.stride)

    def close(self) -> None:
        self.freed = True
        for m in self.maps:
            try:
                m.close()
            except BufferError:  # a tensor view still exports the buffer; the mapping dies with it
                pass
        for fd in self.fds:
            os.close(fd)
        self.maps, self.fds = [], []


class _SlotLock:
    """An exclusive POSIX byte-range lock on one slot (between processes)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length = fd, start, length

    def __enter__(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_EX, self.length, self.start, os.SEEK_SET)

    def __exit__(self, *exc: object) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN, self.length, self.start, os.SEEK_SET)


_WINDOWS: Dict[str, _Window] = {}


def _get(name: str, opname: str) -> _Window:
    if not isinstance(name, str):
        raise TypeError(f"{opname}: name must be a str, got {type(name).__name__}")
    w = _WINDOWS.get(name)
    if w is None:
        raise ValueError(
            f"{opname}: no window named {name!r} (it was never created with win_create, or was freed); "
            f"windows: {sorted(_WINDOWS)}"
        )
    w.comm.check_alive(opname)
    return w


def _weights_for(
    w: _Window,
    weights: Optional[Mapping[int, float]],
    allowed: List[int],
    default: float,
    what: str,
    opname: str,
) -> Dict[int, float]:
    if weights is None:
        return {r: default for r in allowed}
    if not isinstance(weights, Mapping):
        raise TypeError(f"{opname}: {what} must be a dict {{rank: weight}}, got {type(weights).__name__}")
    out: Dict[int, float] = {}
    for r, v in weights.items():
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"{opname}: {what} keys must be int ranks, got {r!r}")
        if r not in allowed:
            raise ValueError(
                f"{opname}: rank {r} in {what} is not allowed for rank {w.rank} of window {w.name!r} "
                f"(allowed: {allowed})"
            )
        out[r] = _check_weight(v, f"{opname}: {what}[{r}]")
    return out


def win_create(tensor: torch.Tensor, name: str, zero_init: bool = False, comm: CommArg = None) -> bool:
    """Create window ``name`` for ``tensor`` (collective over the communicator).

    Args:
        tensor: a CPU tensor, same shape and dtype on every rank; :func:`win_sync` updates it in place.
        name: a name unique among this process's live windows.
        zero_init: neighbour slots start at zero instead of this rank's value.
        comm: communicator or process group (None: the default group); its topology (at creation)
            decides the neighbours.

    Returns:
        True.

    Raises:
        NotImplementedError: the group spans several nodes, or the tensor is on a GPU.
        ValueError: the name is taken.
        TypeError: not a tensor / bad name.

    Example::

        win_create(torch.zeros(4), "w")
    """
    opname = "win_create"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{opname}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{opname}: name must be a non-empty str, got {name!r}")
    c = resolve_comm(comm, opname)
    if tensor.device.type != "cpu":
        raise NotImplementedError(
            f"{opname}: windows are implemented for CPU tensors on one node; for {tensor.device} tensors use "
            "trainloom.comm.neighbor.neighbor_allreduce (or DistributedNeighborAllreduceOptimizer)"
        )
    if not c.same_node:
        raise NotImplementedError(
            f"{opname}: communicator {c.name} spans several nodes; one-sided windows need shared memory. "
            "Use trainloom.comm.neighbor.neighbor_allreduce (or DistributedNeighborAllreduceOptimizer)"
        )
    if name in _WINDOWS:
        raise ValueError(f"{opname}: a window named {name!r} already exists; win_free it first")
    if not tensor.is_contiguous():
        raise ValueError(f"{opname}: tensor must be contiguous (win_sync writes it in place)")
    token = broadcast_object(secrets.token_hex(8) if c.rank() == 0 else None, 0, c)
    w = _Window(name, tensor, c, token, zero_init)
    try:
        _core.barrier(comm=c)  # every file exists
        w.open_all()
        _core.barrier(comm=c)  # every rank mapped every file and initialised its slots
    finally:
        try:
            os.unlink(w.paths[w.rank])  # mappings stay valid; nothing is left in /dev/shm
        except FileNotFoundError:
            pass
    _WINDOWS[name] = w
    return True


def win_free(name: Optional[str] = None) -> bool:
    """Free window ``name`` (all windows when None). Local: other ranks keep their mappings.

    Later use of the name raises ``ValueError``.
    """
    names = list(_WINDOWS) if name is None else [_get(name, "win_free").name]
    for n in names:
        _WINDOWS.pop(n).close()
    return True


def win_put(
    tensor: torch.Tensor,
    name: str,
    dst_weights: Optional[Mapping[int, float]] = None,
    require_mutex: bool = False,
) -> bool:
    """Write ``tensor * weight`` into this rank's slot in each destination's window (one-sided).

    Args:
        tensor: same shape and dtype as the window's tensor.
        name: the window.
        dst_weights: ``{out-neighbour: weight}``; default every out-neighbour with weight 1.
        require_mutex: accepted for Bluefog compatibility; slots are always locked.

    Raises:
        ValueError: a destination that is not an out-neighbour, a negative weight, a shape mismatch,
            an unknown or freed window.
    """
    opname = "win_put"
    w = _get(name, opname)
    t = _check_like(tensor, w, opname)
    dsts = _weights_for(w, dst_weights, w.topo.out_neighbors(w.rank), 1.0, "dst_weights", opname)
    with torch.no_grad():
        for d, wt in dsts.items():
            k = 1 + w.topo.in_neighbors(d).index(w.rank)
            with w.lock(d, k):
                torch.mul(t, wt, out=w.slot(d, k))
    return True


def win_accumulate(
    tensor: torch.Tensor,
    name: str,
    dst_weights: Optional[Mapping[int, float]] = None,
    require_mutex: bool = False,
) -> bool:
    """Add ``tensor * weight`` into this rank's slot in each destination's window (one-sided, SUM)."""
    opname = "win_accumulate"
    w = _get(name, opname)
    t = _check_like(tensor, w, opname)
    dsts = _weights_for(w, dst_weights, w.topo.out_neighbors(w.rank), 1.0, "dst_weights", opname)
    with torch.no_grad():
        for d, wt in dsts.items():
            k = 1 + w.topo.in_neighbors(d).index(w.rank)
            with w.lock(d, k):
                w.slot(d, k).add_(t, alpha=wt)
    return True


def win_get(
    name: str, src_weights: Optional[Mapping[int, float]] = None, require_mutex: bool = False
) -> bool:
    """Copy each source's published value (its self slot) ``* weight`` into this rank's slot for it.

    Args:
        name: the window.
        src_weights: ``{in-neighbour: weight}``; default every in-neighbour with weight 1.
        require_mutex: accepted for Bluefog compatibility; slots are always locked.
    """
    opname = "win_get"
    w = _get(name, opname)
    ins = w.topo.in_neighbors(w.rank)
    srcs = _weights_for(w, src_weights, ins, 1.0, "src_weights", opname)
    with torch.no_grad():
        for s, wt in srcs.items():
            with w.lock(s, 0):
                value = w.slot(s, 0).clone()
            k = 1 + ins.index(s)
            with w.lock(w.rank, k):
                w.slot(w.rank, k).copy_(value).mul_(wt)
    return True


def win_sync(
    name: str,
    self_weight: Optional[float] = None,
    neighbor_weights: Optional[Mapping[int, float]] = None,
    reset: bool = False,
    clone: bool = False,
) -> torch.Tensor:
    """Combine this rank's tensor with its neighbour slots; update the tensor in place and publish it.

    Args:
        name: the window.
        self_weight, neighbor_weights: as in :func:`~trainloom.comm.neighbor.neighbor_allreduce`
            (both or neither; default the topology's weights if weighted, else uniform). Must sum to 1.
        reset: zero the neighbour slots that were used, after reading them.
        clone: return a new tensor and leave the window's tensor unchanged.

    Returns:
        The combined tensor (the window's own tensor unless ``clone``).
    """
    opname = "win_sync"
    w = _get(name, opname)
    ins = w.topo.in_neighbors(w.rank)
    if (self_weight is None) != (neighbor_weights is None):
        raise ValueError(f"{opname}: self_weight and neighbor_weights must be given together (or neither)")
    if neighbor_weights is None:
        if w.weighted:
            sw, nw = w.topo.self_weight(w.rank), w.topo.in_weights(w.rank)
        else:
            sw = 1.0 / (len(ins) + 1)
            nw = {i: sw for i in ins}
    else:
        sw = _check_weight(self_weight, f"{opname}: self_weight")
        nw = _weights_for(w, neighbor_weights, ins, 0.0, "neighbor_weights", opname)
        check_sum(sw, nw, f"{opname} on rank {w.rank}")
    return _combine(w, sw, nw, reset, clone)


def win_sync_then_collect(name: str) -> torch.Tensor:
    """Add every neighbour slot into the tensor and zero the slots (``win_sync`` with weights 1, reset).

    The weights sum to more than 1 on purpose (a collect, not an average).
    """
    w = _get(name, "win_sync_then_collect")
    return _combine(w, 1.0, {i: 1.0 for i in w.topo.in_neighbors(w.rank)}, True, False)


def _combine(w: _Window, sw: float, nw: Dict[int, float], reset: bool, clone: bool) -> torch.Tensor:
    ins = w.topo.in_neighbors(w.rank)
    with torch.no_grad():
        acc = (
            w.tensor.reshape(-1).to(torch.float64 if w.tensor.dtype == torch.float64 else torch.float32) * sw
        )
        for r, wt in nw.items():
            k = 1 + ins.index(r)
            with w.lock(w.rank, k):
                acc.add_(w.slot(w.rank, k), alpha=wt)
                if reset:
                    w.slot(w.rank, k).zero_()
        out = acc.to(w.tensor.dtype).view(w.tensor.shape)
        if clone:
            return out
        w.tensor.copy_(out)
        with w.lock(w.rank, 0):
            w.slot(w.rank, 0).copy_(w.tensor.reshape(-1))
    return w.tensor


def _check_like(t: object, w: _Window, opname: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{opname}: tensor must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != w.tensor.shape or t.dtype != w.tensor.dtype:
        raise ValueError(
            f"{opname}: tensor has shape {tuple(t.shape)} and dtype {t.dtype}, but window {w.name!r} holds "
            f"{tuple(w.tensor.shape)} {w.tensor.dtype}"
        )
    if t.device.type != "cpu":
        raise ValueError(f"{opname}: tensor is on {t.device}; window {w.name!r} is a CPU window")
    return t.detach().reshape(-1)


def win_put_async(
    tensor: torch.Tensor,
    name: str,
    dst_weights: Optional[Mapping[int, float]] = None,
    require_mutex: bool = False,
) -> Work:
    """:func:`win_put`, returning a completed handle (the copy is done when it returns)."""
    win_put(tensor, name, dst_weights, require_mutex)
    return CompletedWork("win_put", None)


def win_accumulate_async(
    tensor: torch.Tensor,
    name: str,
    dst_weights: Optional[Mapping[int, float]] = None,
    require_mutex: bool = False,
) -> Work:
    """:func:`win_accumulate`, returning a completed handle."""
    win_accumulate(tensor, name, dst_weights, require_mutex)
    return CompletedWork("win_accumulate", None)


def win_get_async(
    name: str, src_weights: Optional[Mapping[int, float]] = None, require_mutex: bool = False
) -> Work:
    """:func:`win_get`, returning a completed handle."""
    win_get(name, src_weights, require_mutex)
    return CompletedWork("win_get", None)


def win_poll(handle: Work) -> bool:
    """Whether a window operation's handle completed (always True: window copies are synchronous)."""
    if not isinstance(handle, Work):
        raise TypeError(f"win_poll: handle must be a Work, got {type(handle).__name__}")
    return handle.is_completed()


def win_wait(handle: Work) -> bool:
    """Wait for a window operation's handle."""
    if not isinstance(handle, Work):
        raise TypeError(f"win_wait: handle must be a Work, got {type(handle).__name__}")
    return handle.wait()


def _live_windows() -> List[str]:  # for tests and diagnostics
    return sorted(_WINDOWS)
