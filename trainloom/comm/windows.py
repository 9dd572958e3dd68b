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

:func:`win_create` first exchanges every rank's window description (name, shape, dtype and the
topology's edges) and raises the same ``CommError`` on every rank when they differ, before any
file exists. Windows hold floating or complex tensors (they average): float16/bfloat16 windows
accumulate in float32, float32/float64/complex windows in their own precision.

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
import hashlib
import json
import mmap
import os
import secrets
from typing import Any, Dict, List, Mapping, Optional, Union

import torch

from trainloom.comm import collectives as _core
from trainloom.comm.env import as_int
from trainloom.comm.group import Communicator, ProcessGroup
from trainloom.comm.topology import _check_weight, resolve_comm, topology_entry
from trainloom.comm.work import CompletedWork, Work
from trainloom.errors import CommError

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
_HALF = (torch.float16, torch.bfloat16)  # accumulate in float32


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
        self.acc_dtype = torch.float32 if tensor.dtype in _HALF else tensor.dtype
        self.nbytes = tensor.numel() * tensor.element_size()
        self.stride = max(_ALIGN, (self.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        n = comm.nranks()
        self.paths = [f"/dev/shm/tlwin-{token}-{r}" for r in range(n)]
        size = self.stride * (1 + len(topo.in_neighbors(self.rank)))
        fd = os.open(self.paths[self.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.unlink(self.paths[self.rank])
            raise
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


def _lookup(name: str, opname: str) -> _Window:
    if not isinstance(name, str):
        raise TypeError(f"{opname}: name must be a str, got {type(name).__name__}")
    w = _WINDOWS.get(name)
    if w is None:
        raise ValueError(
            f"{opname}: no window named {name!r} (it was never created with win_create, or was freed); "
            f"windows: {sorted(_WINDOWS)}"
        )
    return w


def _get(name: str, opname: str) -> _Window:
    w = _lookup(name, opname)
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
        ri = as_int(r)
        if ri is None:
            raise TypeError(f"{opname}: {what} keys must be int ranks, got {r!r}")
        r = ri
        if r not in allowed:
            raise ValueError(
                f"{opname}: rank {r} in {what} is not allowed for rank {w.rank} of window {w.name!r} "
                f"(allowed: {allowed})"
            )
        out[r] = _check_weight(v, f"{opname}: {what}[{r}]")
    return out


def win_create(tensor: torch.Tensor, name: str, zero_init: bool = False, comm: CommArg = None) -> bool:
    """Create window ``name`` for ``tensor`` (collective over the communicator).

    Every rank first sends the others its window's name, shape, dtype and the topology's edges
    (two small allgathers); when they differ, or when a rank's arguments are bad, no window is
    created on any rank.

    Args:
        tensor: a contiguous floating or complex CPU tensor, same shape and dtype on every rank;
            :func:`win_sync` updates it in place.
        name: a name unique among this process's live windows, the same on every rank.
        zero_init: neighbour slots start at zero instead of this rank's value (may differ per rank).
        comm: communicator or process group (None: the default group); its topology (at creation,
            the same on every rank) decides the neighbours.

    Returns:
        True.

    Raises:
        NotImplementedError: the group spans several nodes, or the tensor is on a GPU.
        ValueError: the name is taken, or the tensor is not contiguous.
        TypeError: not a tensor / bad name / an integer or bool tensor (windows average values).
        CommError: (on every rank) the ranks' names, shapes, dtypes or topologies differ, naming the
            first difference and each rank's value; or another rank's arguments were bad (raised on
            the ranks whose own arguments were fine, naming that rank's error).

    Example::

        win_create(torch.zeros(4), "w")
    """
    opname = "win_create"
    c = resolve_comm(comm, opname)
    if not c.same_node:
        raise NotImplementedError(
            f"{opname}: communicator {c.name} spans several nodes; one-sided windows need shared memory. "
            "Use trainloom.comm.neighbor.neighbor_allreduce (or DistributedNeighborAllreduceOptimizer)"
        )
    problem = _create_problem(tensor, name, opname)
    token = _agree_on_window(c, tensor, name, problem, opname)
    w = _Window(name, tensor, c, token, zero_init)
    try:
        _core.barrier(comm=c)  # every file exists
        w.open_all()
        _core.barrier(comm=c)  # every rank mapped every file and initialised its slots
    except BaseException:
        w.close()
        raise
    finally:
        try:
            os.unlink(w.paths[w.rank])  # mappings stay valid; nothing is left in /dev/shm
        except FileNotFoundError:
            pass
    _WINDOWS[name] = w
    return True


def _create_problem(tensor: Any, name: Any, opname: str) -> Optional[Exception]:
    """This rank's reason not to create the window (raised after every rank has heard of it)."""
    if not isinstance(tensor, torch.Tensor):
        return TypeError(f"{opname}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(name, str) or not name:
        return TypeError(f"{opname}: name must be a non-empty str, got {name!r}")
    if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return TypeError(
            f"{opname}: windows average their values, so the tensor must be floating point or complex, "
            f"got {tensor.dtype}; convert it first (e.g. tensor.double())"
        )
    if tensor.device.type != "cpu":
        return NotImplementedError(
            f"{opname}: windows are implemented for CPU tensors on one node; for {tensor.device} tensors use "
            "trainloom.comm.neighbor.neighbor_allreduce (or DistributedNeighborAllreduceOptimizer)"
        )
    if name in _WINDOWS:
        return ValueError(f"{opname}: a window named {name!r} already exists; win_free it first")
    if not tensor.is_contiguous():
        return ValueError(f"{opname}: tensor must be contiguous (win_sync writes it in place)")
    return None


def _agree_on_window(
    c: Communicator, tensor: Any, name: Any, problem: Optional[Exception], opname: str
) -> str:
    """Exchange every rank's window description; rank 0's file token, or the same error on every rank.

    Runs before any file exists, so a failure leaves nothing behind.
    """
    topo, _ = topology_entry(c)
    ok = problem is None
    mine = {
        "problem": None if ok else f"{type(problem).__name__}: {problem}",
        "name": name if ok else None,
        "shape": list(tensor.shape) if ok else None,
        "dtype": str(tensor.dtype).replace("torch.", "") if ok else None,
        "topology": [topo.in_neighbors(r) for r in range(topo.size)],
        "token": secrets.token_hex(8) if c.rank() == 0 else "",
    }
    n = c.nranks()
    if n == 1:
        rows = [mine]
    else:
        data = json.dumps(mine).encode()
        lengths = torch.empty(n, dtype=torch.int64)
        _core.allgather(torch.tensor([len(data)], dtype=torch.int64), lengths, comm=c)
        sizes = lengths.tolist()
        width = max(sizes)
        send = torch.zeros(width, dtype=torch.uint8)
        send[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        recv = torch.empty(n * width, dtype=torch.uint8)
        _core.allgather(send, recv, comm=c)
        raw = recv.numpy().tobytes()
        rows = [json.loads(raw[r * width : r * width + sizes[r]]) for r in range(n)]
    if problem is not None:
        raise problem
    failed = [(r, row["problem"]) for r, row in enumerate(rows) if row["problem"]]
    if failed:
        r, why = failed[0]
        raise CommError(
            f"{opname}({name!r}): rank {r} could not create the window ({why}); no window was created "
            "on any rank"
        )
    for field in ("name", "shape", "dtype", "topology"):
        values = [row[field] for row in rows]
        if any(v != values[0] for v in values):
            raise CommError(
                f"{opname}: the ranks disagree on the window's {field}: {_by_rank(values, field)}; every "
                "rank must create the window with the same name, shape and dtype under the same topology "
                "(set_topology); no window was created on any rank"
            )
    return str(rows[0]["token"])


def _by_rank(values: List[Any], field: str) -> str:
    """``rank 0 has (4,), ranks [1, 2] have (3,)``: the ranks grouped by value, in rank order."""
    groups: Dict[str, List[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(_show(v, field), []).append(r)
    return ", ".join(
        f"rank {rs[0]} has {text}" if len(rs) == 1 else f"ranks {rs} have {text}"
        for text, rs in groups.items()
    )


def _show(value: Any, field: str) -> str:
    if field == "shape":
        return str(tuple(value))
    if field == "name":
        return repr(value)
    if field == "topology":
        text = f"in-neighbours {value}"
        if len(text) > 120:
            digest = hashlib.sha1(json.dumps(value).encode()).hexdigest()[:10]
            text = f"{sum(map(len, value))} edges (digest {digest})"
        return text
    return str(value)


def win_free(name: Optional[str] = None) -> bool:
    """Free window ``name`` (all windows when None). Local: other ranks keep their mappings.

    Needs no live communicator: after ``destroy_process_group()`` it still releases the mapping and
    the name, so a later ``win_create`` can reuse it. Later use of the name raises ``ValueError``.

    Raises:
        TypeError: ``name`` is not a str (or None).
        ValueError: no live window has that name.
    """
    names = list(_WINDOWS) if name is None else [_lookup(name, "win_free").name]
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
        ValueError: a destination that is not an out-neighbour, a non-finite weight, a shape
            mismatch, an unknown or freed window.
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
            (both or neither; default the topology's weights if weighted, else uniform). Any finite
            weights, as in Bluefog: ``self_weight=1.0, neighbor_weights={r: 1.0 ...}, reset=True``
            is :func:`win_sync_then_collect`.
        reset: zero the neighbour slots that were used, after reading them.
        clone: return a new tensor and leave the window's tensor unchanged.

    Returns:
        The combined tensor (the window's own tensor unless ``clone``).

    Raises:
        ValueError: only one of ``self_weight``/``neighbor_weights``, a rank that is not an
            in-neighbour, a non-finite weight, an unknown or freed window.
        TypeError: weights that are not real numbers, a non-dict ``neighbor_weights``.
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
    return _combine(w, sw, nw, reset, clone)


def win_sync_then_collect(name: str) -> torch.Tensor:
    """Add every neighbour slot into the tensor and zero the slots.

    The same as ``win_sync(name, self_weight=1.0, neighbor_weights={r: 1.0 for r in in-neighbours},
    reset=True)``, as Bluefog documents it (a collect, not an average).
    """
    w = _get(name, "win_sync_then_collect")
    return _combine(w, 1.0, {i: 1.0 for i in w.topo.in_neighbors(w.rank)}, True, False)


def _combine(w: _Window, sw: float, nw: Dict[int, float], reset: bool, clone: bool) -> torch.Tensor:
    ins = w.topo.in_neighbors(w.rank)
    with torch.no_grad():
        acc = w.tensor.reshape(-1).to(w.acc_dtype) * sw  # a new contiguous tensor in every case
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
