"""Process groups and communicators (Bagua's ``BaguaProcessGroup`` / ``BaguaSingleCommunicatorPy``).

A :class:`ProcessGroup` holds three :class:`Communicator` objects: global (every member), intra-node
(the members on this rank's node) and inter-node (one leader per node). On a rank that is not a
member of one of them, the getter returns :data:`NON_COMM_MEMBER` instead (Bagua's
``CommMember.NON_COMM_MEMBER``), and every collective given it returns at once without doing
anything. A communicator chooses its engine per tensor device, at the first operation on that device:

* CUDA tensors -> :class:`trainloom.comm.nccl.NcclEngine` (one per CUDA device);
* CPU tensors, every member on one node -> ``trainloom.comm.shm.ShmCommunicator`` when that module
  imports and the OS supports it, else gloo;
* CPU tensors across nodes -> :class:`trainloom.comm._gloo.GlooEngine`.

``TRAINLOOM_CPU_ENGINE=gloo|shm|auto`` (default ``auto``) forces the CPU engine. Nodes are told apart
by ``hostname:boot_id`` (never by LOCAL_WORLD_SIZE, which cannot tell whether a sub-group is
intra-node); ``TRAINLOOM_NODE_ID`` appends a label, to split one machine into logical nodes.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import ctypes
import dataclasses
import datetime
import hashlib
import inspect
import logging
import os
import socket
import sys
import threading
import time
import types
from typing import (
    Any,
    Callable,
    ContextManager,
    Deque,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import numpy as np
import torch
import torch.distributed as dist

from trainloom.comm.env import LaunchEnv, as_int, read_launch_env
from trainloom.comm.work import CudaWork, FutureWork, Work
from trainloom.errors import CommError, CommTimeoutError, ConfigError

logger = logging.getLogger("trainloom.comm")

__all__ = [
    "Communicator",
    "CommMember",
    "NON_COMM_MEMBER",
    "NonCommMember",
    "ProcessGroup",
    "BaguaProcessGroup",
    "RepeatedInitializationError",
    "init_process_group",
    "is_initialized",
    "new_group",
    "from_torch_group",
    "destroy_process_group",
    "get_default_group",
    "node_identity",
    "cpu_engine_name",
]

DEFAULT_TIMEOUT = 300.0

#: The memory of one tensor an operation reads or writes: the address range ``[start, end)`` from its
#: first element to the end of its last, and for a tensor that does not fill that range (a column,
#: ``x[0::2]``, ``z.real``) its layout ``(shape, byte strides, element size)``, else None.
Span = Tuple[int, int, Optional[Tuple[Tuple[int, ...], Tuple[int, ...], int]]]
# A pending collective and the memory it uses (None: unknown), in Communicator._coll_book.
_Booked = Tuple[concurrent.futures.Future, Optional[List[Span]]]


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last one, strides included (a strided view
    such as ``x[0::2]`` reaches past ``numel * element_size``; torch has no negative strides)."""
    if t.is_contiguous():
        return t.nbytes  # the common case, 5x cheaper
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def tensor_spans(tensors: Iterable[Any]) -> List[Span]:
    """The memory (see :data:`Span`) of the non-empty CPU tensors among ``tensors`` (anything else,
    None or a CUDA tensor, is left out)."""
    out: List[Span] = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cpu and t.numel():
            a = t.data_ptr()
            if t.is_contiguous():
                out.append((a, a + t.nbytes, None))
            else:
                n = _span(t)
                e = t.element_size()
                layout = None if n == t.nbytes else (tuple(t.shape), tuple(st * e for st in t.stride()), e)
                out.append((a, a + n, layout))
    return out


def _byte_view(start: int, end: int, layout: Optional[Tuple[Tuple[int, ...], Tuple[int, ...], int]]) -> Any:
    """A numpy array of the bytes a Span covers (made over the addresses, never read)."""
    buf = memoryview((ctypes.c_char * (end - start)).from_address(start))
    if layout is None:
        return np.ndarray((end - start,), dtype=np.uint8, buffer=buf)
    shape, strides, size = layout
    return np.ndarray(shape, dtype=np.dtype((np.void, size)), buffer=buf, strides=strides)


def spans_meet(a: Span, b: Span) -> bool:
    """Whether two tensors' memory shares a byte. Ranges that do not intersect never do; when they
    do and one tensor leaves gaps in its range (two columns of one matrix, ``x[0::2]`` and
    ``x[1::2]``, ``z.real`` and ``z.imag``), numpy's exact test of the strided layouts decides
    (``np.shares_memory``; a problem too hard for its bounded search counts as shared)."""
    if not (a[0] < b[1] and b[0] < a[1]):
        return False
    if a[2] is None and b[2] is None:
        return True
    try:
        shares: Any = np.shares_memory  # (numpy's stubs allow only max_work -1 or 0)
        return bool(shares(_byte_view(*a), _byte_view(*b), max_work=_SHARES_MEMORY_WORK))
    except _TooHardError:
        return True


#: The search bound of np.shares_memory in spans_meet (the interleaved views of real code take a
#: few steps; a layout that needs more is counted as sharing memory).
_SHARES_MEMORY_WORK = 10_000
_TooHardError: Any = getattr(np, "exceptions", np).TooHardError  # numpy < 1.25: np.TooHardError


class RepeatedInitializationError(CommError):
    """init_process_group() was called while a default group exists (Bagua's error name)."""


@dataclasses.dataclass
class _State:
    default: Optional[ProcessGroup] = None
    launch: Optional[LaunchEnv] = None
    store: Optional[Any] = None
    timeout: float = DEFAULT_TIMEOUT
    node_ids: List[str] = dataclasses.field(default_factory=list)
    groups: List[ProcessGroup] = dataclasses.field(default_factory=list)
    names: Dict[str, int] = dataclasses.field(default_factory=dict)
    owns_torch_pg: bool = False
    # the process that initialised the default group (a forked child inherits it, not its use)
    pid: int = -1
    generation: int = 0
    # The store key namespace of this generation: "tl/<generation>", plus "r<n>." under torchrun's
    # n-th restart (its agent store keeps the earlier attempts' keys: see _namespace).
    namespace: str = "tl/0"
    base_store: Optional[Any] = None  # the TCPStore init_process_group created (plain launch)


_STATE = _State()
_ATEXIT = False


def node_identity() -> str:
    """``hostname:boot_id`` of this machine (plus ``/$TRAINLOOM_NODE_ID`` when set)."""
    try:
        from trainloom.comm.shm import node_identity as shm_node_identity

        ident = shm_node_identity()
    except ImportError:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = "no-boot-id"
        ident = f"{socket.gethostname()}:{boot}"
    label = os.environ.get("TRAINLOOM_NODE_ID", "")
    return f"{ident}/{label}" if label else ident


_SHM_STATE: Dict[str, Any] = {}


def _shm_status() -> Optional[str]:
    """None when the shared-memory engine can be used, else why not."""
    if "why" not in _SHM_STATE:
        try:
            from trainloom.comm.shm import shm_supported

            _SHM_STATE["why"] = None if shm_supported() else "shm_supported() is False on this OS"
        except ImportError as exc:
            _SHM_STATE["why"] = f"trainloom.comm.shm does not import ({exc})"
            # Once per process: same-node CPU groups silently falling back to gloo would hide a
            # missing or stale build of the shared-memory engine.
            logger.warning("shared-memory engine unavailable, same-node CPU groups use gloo: %s", exc)
    return _SHM_STATE["why"]


def cpu_engine_name(same_node: bool) -> str:
    """The CPU engine a communicator uses: ``"shm"`` or ``"gloo"``.

    Raises:
        ConfigError: TRAINLOOM_CPU_ENGINE is invalid, or asks for shm where it cannot run.
    """
    raw = os.environ.get("TRAINLOOM_CPU_ENGINE", "auto")
    choice = raw.strip().lower() or "auto"
    if choice not in ("auto", "gloo", "shm"):
        raise ConfigError(f"TRAINLOOM_CPU_ENGINE={raw!r}: use auto, gloo or shm")
    if choice == "gloo":
        return "gloo"
    why = _shm_status()
    if choice == "shm":
        if why is not None:
            raise ConfigError(f"TRAINLOOM_CPU_ENGINE=shm but the shared-memory engine is unavailable: {why}")
        if not same_node:
            raise ConfigError("TRAINLOOM_CPU_ENGINE=shm but this communicator spans several nodes")
        return "shm"
    return "shm" if same_node and why is None else "gloo"


class NonCommMember:
    """The placeholder communicator of a rank that is not a member (Bagua's ``CommMember.NON_COMM_MEMBER``).

    There is one instance, :data:`NON_COMM_MEMBER`. The communicator getters of a
    :class:`ProcessGroup` return it on ranks outside that communicator (every getter on a rank outside
    the group; :meth:`ProcessGroup.get_inter_node_communicator` on members that are not node leaders).
    Every collective of :mod:`trainloom.comm` given it as ``comm`` returns immediately without
    checking its arguments or touching any tensor (``None``, or a completed Work when
    ``async_op=True``), so code written for Bagua can call a collective on every rank with
    ``comm=group.get_inter_node_communicator()``. It is falsy (``if comm:`` tells members apart), and
    it is never ``None``: ``comm=None`` still means the default group's global communicator.

    Example::

        inter = get_default_group().get_inter_node_communicator()
        allreduce_inplace(t, comm=inter)   # node leaders reduce; the other ranks return at once
        if inter:                          # or: inter is not NON_COMM_MEMBER
            leader_rank = inter.rank()
    """

    __slots__ = ()
    _instance: Optional[NonCommMember] = None

    def __new__(cls) -> NonCommMember:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NON_COMM_MEMBER (this rank is not a member of the communicator; collectives on it do nothing)"

    def __reduce__(self) -> str:
        return "NON_COMM_MEMBER"  # pickling and copying keep the single instance

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"NON_COMM_MEMBER has no attribute {name!r}: this rank is not a member of the communicator "
            "(collectives given it return at once; test membership with `if comm:`)"
        )


#: The single :class:`NonCommMember` (Bagua's ``CommMember.NON_COMM_MEMBER``).
NON_COMM_MEMBER = NonCommMember()


class _World:
    """Bagua's ``CommMember.WORLD``: as ``comm=``, the default group's global communicator."""

    _instance: Optional[_World] = None

    def __new__(cls) -> _World:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "CommMember.WORLD"

    def __reduce__(self) -> str:
        return "WORLD"


#: ``comm=WORLD`` is ``comm=None``: the default group's global communicator (Bagua's ``CommMember.WORLD``).
WORLD = _World()


class CommMember:
    """Bagua's ``CommMember`` namespace: ``CommMember.NON_COMM_MEMBER is NON_COMM_MEMBER`` and
    ``CommMember.WORLD`` (as ``comm=``, the same as ``None``)."""

    NON_COMM_MEMBER = NON_COMM_MEMBER
    WORLD = WORLD


class Communicator:
    """A set of ranks that run collectives together (Bagua's ``BaguaSingleCommunicatorPy``).

    Obtained from :meth:`ProcessGroup.get_global_communicator` and friends; pass it as ``comm=`` to
    the collectives. Its ranks are numbered ``0..nranks()-1`` in the order of the group's ranks.

    Calls on one communicator are serialised: asynchronous CPU operations run in order on one worker
    thread, and a synchronous call first waits for the asynchronous ones issued before it. Send and
    recv have a queue per peer (a send may need the matching receive to complete): they follow the
    earlier operations of their own direction and peer, and the earlier collectives: all of them,
    or, when the caller names the tensors the send or receive uses (``touches``), only those booked
    with memory that intersects theirs (see :meth:`execute`), so an asynchronous collective issued
    before a send does not hold it back. The other way round the same: a collective given
    ``touches`` follows the earlier collectives and only the pending sends and receives booked with
    memory that intersects its own, so a receive posted before it does not hold it back.
    """

    def __init__(
        self,
        name: str,
        global_ranks: Sequence[int],
        global_rank: int,
        store: Any,
        timeout: float,
        same_node: bool,
        stream: Optional[Any] = None,
    ) -> None:
        self.name = name
        self.global_ranks = list(global_ranks)
        self._rank = self.global_ranks.index(global_rank)
        self._store = store
        self.timeout = float(timeout)
        self.same_node = same_node
        self.stream = stream
        self._cpu: Optional[Any] = None
        self._cuda: Dict[int, Any] = {}
        self._cuda_device: Optional[int] = None
        self._connected = False  # connect() has run: the getters then return at once
        self._lock = threading.RLock()  # held while an operation runs on an engine
        # held while queueing an asynchronous operation, and while reading _coll_book (re-entrant:
        # _pending reads it both under the lock, queueing, and without it, for a synchronous call)
        self._submit_lock = threading.RLock()
        self._tls = threading.local()  # .inside: this thread is running one of our operations
        # The user thread issuing a collective now (see execute)
        self._issuer: Optional[int] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._last: Optional[concurrent.futures.Future] = None
        # The last asynchronous operation issued on this communicator that runs on another
        # communicator's worker thread (the final step of an async hierarchical allreduce): later
        # calls here wait for it, as for ``_last``.
        self._fence: Optional[concurrent.futures.Future] = None
        # The asynchronous collectives (and composite steps, fences) that may still run, oldest
        # first, each with the address ranges of the memory it reads or writes (None: unknown, every
        # send and receive follows it). A send or receive given its own ranges follows only those
        # that intersect them (see _pending). Used under _submit_lock.
        self._coll_book: Deque[_Booked] = collections.deque()
        # The same for the asynchronous sends and receives, for the collectives given ``touches``.
        self._p2p_book: Deque[_Booked] = collections.deque()
        # send/recv: one queue (worker thread, lock, last operation) per direction and peer, keyed
        # "send:3" / "recv:1", so that a pending asynchronous send does not hold up a receive, nor a
        # receive from one neighbour a receive from another (see execute()).
        self._p2p_executors: Dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._p2p_locks: Dict[str, threading.Lock] = {}
        self._p2p_last: Dict[str, concurrent.futures.Future] = {}
        # How many sends to / receives from each peer were issued (same keys): a message's place in
        # its pair's stream, which classic's any-source receive needs (see p2p_issued()).
        self._p2p_issued: Dict[str, int] = {}
        self._p2p_issued_lock = threading.Lock()
        self._engine_lock = threading.Lock()  # engine creation (send and recv may run at once)
        self._destroyed = False
        self._draining = False  # destroy() is letting the queued operations finish
        self._xseq = 0
        # Set by ProcessGroup on global communicators: what hierarchical allreduce uses.
        self.intra: Optional[Communicator] = None
        self.inter: Optional[Communicator] = None
        self.is_inter_leader = False

    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    def nranks(self) -> int:
        """The number of ranks in the communicator."""
        return len(self.global_ranks)

    def __repr__(self) -> str:
        return f"<Communicator {self.name} rank {self._rank}/{self.nranks()} ranks={self.global_ranks}>"

    # ------------------------------------------------------------ engines
    def check_alive(self, opname: str) -> None:
        # While destroy() lets the queued operations finish, the steps they issue from the worker
        # threads (a composite's nested allgather) still run; nothing else does.
        if self._destroyed and not (self._draining and getattr(self._tls, "inside", False)):
            raise CommError(
                f"{opname}: communicator {self.name} was used after destroy_process_group(); "
                "call init_process_group()/new_group() again and use the new communicators"
            )

    def cpu_engine_kind(self) -> str:
        """``"shm"`` or ``"gloo"``: the engine CPU tensors use on this communicator."""
        return cpu_engine_name(self.same_node)

    def _prefix(self, kind: str) -> str:
        return f"{_STATE.namespace}/{self.name}/{kind}"

    def connect(self) -> None:
        """Connect the engine of the default device now; collective over this communicator's ranks.

        Bagua creates a communicator (``ncclCommInitRank``) when a rank asks for it, so scripts may
        start with point-to-point operations between some ranks while others go on to a collective.
        The public getters (:meth:`ProcessGroup.get_global_communicator` and friends) call this;
        later calls return at once. The default device is the current CUDA device when CUDA and NCCL
        are available, else the CPU; an engine for another device connects at its first operation.
        """
        if self._connected or self._store is None:
            return  # connected, or destroyed (its operations raise saying so)
        device: Union[str, torch.device] = "cpu"
        if torch.cuda.is_available():
            from trainloom.comm import nccl

            if nccl.is_available():
                device = torch.device("cuda", torch.cuda.current_device())
        try:
            self.engine(device)
        except CommError as exc:
            if isinstance(exc, CommTimeoutError) and exc.args:
                exc.args = (
                    f"{exc.args[0]}. Asking for a communicator (get_global_communicator() and the other "
                    "getters) connects it, as in Bagua: every member must ask for it",
                ) + tuple(exc.args[1:])
            self._annotate(exc)
            raise
        self._connected = True

    def engine(self, device: Union[str, torch.device]) -> Any:
        """The engine for ``device`` (``"cpu"`` or a torch.device), created (collectively) at first use."""
        if isinstance(device, str):
            device = torch.device(device)
        if device.type == "cpu":
            if self._cpu is None:
                with self._engine_lock:
                    if self._cpu is None:
                        self._cpu = self._new_cpu_engine()
            return self._cpu
        return self._cuda_engine(device)

    def _new_cpu_engine(self) -> Any:
        if self._store is None:
            raise CommError(
                f"communicator {self.name} was used after destroy_process_group(); "
                "call init_process_group()/new_group() again and use the new communicators"
            )
        kind = self.cpu_engine_kind()
        cls: Any
        if kind == "shm":
            from trainloom.comm.shm import ShmCommunicator as cls
        else:
            from trainloom.comm._gloo import GlooEngine as cls
        engine = cls(self._store, self._rank, self.nranks(), prefix=self._prefix(kind), timeout=self.timeout)
        logger.debug("%s: CPU engine %s", self.name, kind)
        return engine

    def _cuda_engine(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if self._cuda_device is None:
            self._cuda_device = index
        if index != self._cuda_device:
            raise ValueError(
                f"tensor is on cuda:{index} but communicator {self.name} uses cuda:{self._cuda_device} on "
                f"rank {self._rank}; call torch.cuda.set_device(local_rank) before the first collective and "
                "keep each rank's tensors on its own device"
            )
        if index not in self._cuda:
            from trainloom.comm.nccl import NcclEngine

            self._check_distinct_gpus(index)
            self._cuda[index] = NcclEngine(
                self._store,
                self._rank,
                self.nranks(),
                prefix=self._prefix("nccl"),
                device=torch.device("cuda", index),
                stream=self.stream,
                timeout=self.timeout,
            )
        return self._cuda[index]

    def _check_distinct_gpus(self, index: int) -> None:
        """Two ranks on one GPU make NCCL hang or fail obscurely: refuse it first, on every rank."""
        me = f"{node_identity()}#{torch.cuda.get_device_properties(index).uuid}"
        key = self._prefix("gpu")
        self._store.set(f"{key}/{self._rank}", me)
        seen: Dict[str, int] = {}
        for r in range(self.nranks()):
            ident = bytes(self._store.get(f"{key}/{r}")).decode()
            if ident in seen:
                raise CommError(
                    f"ranks {seen[ident]} and {r} of {self.name} use the same GPU ({ident}); give each rank "
                    "its own device with torch.cuda.set_device(get_local_rank())"
                )
            seen[ident] = r

    # ------------------------------------------------------------ execution
    def execute(
        self,
        opname: str,
        device: Union[str, torch.device],
        fn: Callable[[Any], Any],
        async_op: bool,
        result: Optional[torch.Tensor],
        finish: Optional[Callable[[], None]] = None,
        keep_alive: Sequence[torch.Tensor] = (),
        needs_engine: bool = True,
        check: Optional[Tuple[Any, ...]] = None,
        after: Sequence[concurrent.futures.Future] = (),
        p2p: Optional[str] = None,
        touches: Optional[Sequence[Any]] = None,
    ) -> Optional[Work]:
        """Run ``fn(engine)`` with the engine for ``device``; a Work when ``async_op``.

        ``needs_engine=False`` runs ``fn(None)`` (composite operations over other communicators).
        ``check`` = ``(tensor, op, root, numel, counts)`` describes the call for the cross-rank check of
        CUDA operations (the CPU engines check for themselves). ``after``: futures of operations on
        other communicators that must finish before this one starts (captured at issue time, so the
        order is the issue order on every rank). ``p2p`` (``"send:<peer>"``/``"recv:<peer>"``, the
        peer's rank in this communicator): a point-to-point operation, queued per direction and peer
        (see :meth:`_pending`).

        ``touches`` (CPU): every caller's tensor the operation reads or writes (staged sources
        included; new memory only it uses may be left out; entries that are not CPU tensors are
        ignored). An asynchronous operation is booked with their address ranges (None: unknown
        memory, so that every later operation of the other kind follows it). A send or receive given
        them follows only the pending collectives booked with ranges that intersect theirs (or with
        unknown memory), besides the earlier operations of its own direction and peer; a collective
        given them follows the earlier collectives and only the pending sends and receives booked
        so. None: every earlier operation of the other kind.
        """
        self.check_alive(opname)
        is_cpu = device == "cpu" if isinstance(device, str) else device.type == "cpu"
        if not is_cpu:
            checking = check is not None and self.nccl_checks()
            if checking and not getattr(self._tls, "inside", False):
                # The check's header allgather runs on the CPU engine from this thread: it follows the
                # asynchronous CPU collectives issued before it, as on every rank. It used to race
                # them for the engine and pair with a peer's pending one ("ranks disagree" on every
                # rank, for calls issued in the same order everywhere).
                pending = [f for f in (self._last, self._fence) if f is not None and not f.done()]
                if pending:
                    concurrent.futures.wait(pending)
            with self._lock:
                if checking and check is not None:
                    self.cross_check(opname, *check)
                engine = self.engine(device)
                event = fn(engine)
                if p2p is not None:  # counted once the engine took it (a refused call sends nothing)
                    self._count_p2p(p2p)
            if async_op:
                return CudaWork(opname, event, result, keep_alive, engine._check_deadline, finish)
            if finish is not None:
                finish()
            return None
        inside = getattr(self._tls, "inside", False)
        # (one tuple, built once: passing two more arguments beside *args cost 0.2 us a call)
        a = (opname, device, fn, async_op, result, finish, needs_engine, after, p2p, inside, touches)
        if p2p is not None or inside:
            return self._execute_cpu(*a)
        # A collective from a user thread: no other thread may be issuing one on this communicator
        # at the same time (sends and receives have their own queues per peer and direction). A
        # check-and-set under the GIL, without a lock (a lock cost 0.2 us a call here): two threads
        # entering in the same few bytecodes can both pass, so it catches overlapping use, not all.
        me = threading.get_ident()
        owner = self._issuer
        if owner is None:
            try:
                self._issuer = me
                return self._execute_cpu(*a)
            finally:
                self._issuer = None
        if owner != me:
            # Another rank may already have paired this thread's call with the other thread's:
            # abort, so that every rank fails now instead of going on with mis-paired results.
            self.abort_engines()
            raise CommError(
                f"{opname}: another thread ({_thread_name(owner)}) is issuing an operation on "
                f"communicator {self.name} at the same time. Collectives issued from several threads "
                "on one communicator can start in a different order on each rank, which pairs "
                "different calls (wrong results or a hang), so the communicator was aborted on every "
                "rank. Issue them from one thread, or give each thread its own communicator (new_group())"
            )
        return self._execute_cpu(*a)

    def p2p_issued(self, queue: str) -> int:
        """How many point-to-point operations this process issued on ``queue`` (``"send:3"``: sends
        to peer 3 of this communicator; ``"recv:1"``: receives from peer 1), every API's counted.

        Messages between two ranks arrive in issue order, so a send's count before it is issued is
        its place in the pair's stream, and a receive takes the message whose place is the count of
        receives from that peer before it. ``trainloom.comm.classic`` announces that place with each
        message so that a receive from any source can tell a message already taken by a receive
        with an explicit ``src`` from one still to come."""
        with self._p2p_issued_lock:
            return self._p2p_issued.get(queue, 0)

    def _count_p2p(self, queue: str) -> None:
        with self._p2p_issued_lock:
            self._p2p_issued[queue] = self._p2p_issued.get(queue, 0) + 1

    def _execute_cpu(
        self,
        opname: str,
        device: Union[str, torch.device],
        fn: Callable[[Any], Any],
        async_op: bool,
        result: Optional[torch.Tensor],
        finish: Optional[Callable[[], None]],
        needs_engine: bool,
        after: Sequence[concurrent.futures.Future],
        p2p: Optional[str],
        inside: bool,
        touches: Optional[Sequence[Any]] = None,
    ) -> Optional[Work]:
        """:meth:`execute` for a CPU operation (``inside``: called from a running operation)."""
        if p2p is not None:
            self._count_p2p(p2p)
        # Sends and receives take a queue per direction and peer (gloo itself runs them at once per
        # pair): a send does not complete before the peer takes the message (gloo: posts the
        # matching receive; shm: beyond two pair buffers), so on one queue an asynchronous send
        # followed by a receive from the same peer, a receive posted first and then a send, or
        # receives posted from two neighbours before sending to them would deadlock. Both engines
        # run operations of different (direction, peer) at once.
        queue = p2p
        lock: ContextManager[Any]
        if queue is None:
            lock = self._lock
        else:
            lock = self._p2p_locks.get(queue) or self._p2p_locks.setdefault(queue, threading.Lock())

        # An operation queued on a worker thread runs in the issuing thread's inference mode: tensors
        # made under torch.inference_mode() (an eval metric) can only be written in it (staging
        # copies, an AVG's division, a composite's local steps raised "Inplace update to inference
        # tensor outside InferenceMode").
        inference = async_op and torch.is_inference_mode_enabled()

        def run(deps: Sequence[concurrent.futures.Future]) -> None:
            if deps:
                # Completion, not success: a failed earlier operation is reported by its own Work.
                concurrent.futures.wait(deps)
            if inference:
                with torch.inference_mode():
                    locked()
            else:
                locked()

        def locked() -> None:
            with lock:
                inside = getattr(self._tls, "inside", False)
                self._tls.inside = True
                try:
                    if not needs_engine:
                        fn(None)
                    else:
                        fn(self._cpu if self._cpu is not None else self.engine(device))
                    if async_op and finish is not None:
                        # The copy into a non-contiguous output is part of the operation: is_completed(),
                        # a later operation and destroy_process_group() see it done without a wait().
                        finish()
                except CommError as exc:
                    self._annotate(exc)
                    _release_frames(exc)
                    raise
                except BaseException as exc:
                    _release_frames(exc)
                    raise
                finally:
                    self._tls.inside = inside

        if async_op:
            if needs_engine and self._cpu is None:
                # Connect now, in the issuing thread: engines then connect in issue order on every
                # rank. Two rendezvous at once over the one store client (two first operations
                # running on two worker threads) failed at random, in torch too.
                self.engine(device)
            # Only the submission is serialised here, not the operation: the worker thread takes
            # the lock per operation, so several asynchronous operations can be in flight.
            with self._submit_lock:
                deps = self._pending(queue, same_queue=False, touches=touches)
                deps += [f for f in after if not f.done()]
                if queue is None:
                    if self._executor is None:
                        self._executor = concurrent.futures.ThreadPoolExecutor(
                            max_workers=1, thread_name_prefix=f"trainloom-{self.name}"
                        )
                    fut = self._executor.submit(run, deps)
                    self._last = fut
                    self._book(self._coll_book, fut, touches)
                else:
                    executor = self._p2p_executors.get(queue)
                    if executor is None:
                        executor = concurrent.futures.ThreadPoolExecutor(
                            max_workers=1, thread_name_prefix=f"trainloom-{self.name}-{queue}"
                        )
                        self._p2p_executors[queue] = executor
                    fut = executor.submit(run, deps)
                    self._p2p_last[queue] = fut
                    self._book(self._p2p_book, fut, touches)
            return FutureWork(opname, fut, result)
        # (not from inside a running operation: a composite op calling this communicator would
        # otherwise wait for itself)
        if not inside:
            deps = self._pending(queue, touches=touches)
            if after:
                deps += [f for f in after if not f.done()]
            if deps:
                concurrent.futures.wait(deps)  # keep the issue order identical on every rank
        run(())
        if finish is not None:
            finish()
        return None

    def _pending(
        self,
        queue: Optional[str],
        same_queue: bool = True,
        touches: Optional[Sequence[Any]] = None,
    ) -> List[concurrent.futures.Future]:
        """The unfinished asynchronous operations a new call on ``queue`` must follow.

        A collective (``queue`` None) follows this communicator's worker queue and the fence left by
        an asynchronous hierarchical allreduce, and the sends and receives: every pending one with
        ``touches`` None, else those booked with memory that intersects that of ``touches`` (or with
        unknown memory). A send to (receive from) a peer follows the earlier sends to (receives
        from) that peer, but no other point-to-point operation, and the collectives: every one with
        ``touches`` None, else the booked ones that intersect it the same way. ``same_queue=False``
        leaves out the queue's own last operation (a worker thread runs its queue in order anyway).
        """
        last, fence = self._last, self._fence
        if (last is None or last.done()) and fence is None and not self._p2p_last:
            return []  # the common case: nothing in flight
        # Under the lock that queueing holds: another thread's send queued meanwhile was dropped
        # from the rebuilt _p2p_last (a later send to that peer then overtook it: messages out of
        # order), and a fence set meanwhile cleared.
        with self._submit_lock:
            return self._pending_locked(queue, same_queue, touches)

    def _pending_locked(
        self, queue: Optional[str], same_queue: bool, touches: Optional[Sequence[Any]]
    ) -> List[concurrent.futures.Future]:
        """:meth:`_pending` past its fast path, under ``_submit_lock``."""
        # Forget finished fences and point-to-point operations (there is one queue per peer used):
        # later calls then take the fast path again instead of scanning them every time.
        if self._fence is not None and self._fence.done():
            self._fence = None
        if self._p2p_last and any(f.done() for f in self._p2p_last.values()):
            self._p2p_last = {k: f for k, f in self._p2p_last.items() if not f.done()}
        # Every pending operation is in its kind's book (the worker's queue and the fences, the
        # send/recv queues), so a call given ``touches`` may skip the other kind's operations it
        # does not overlap. (The ranges are taken only here, past the fast path.)
        if queue is None:
            if touches is None:
                p2p: Sequence[concurrent.futures.Future] = list(self._p2p_last.values())
            else:
                p2p = self._hazards(self._p2p_book, tensor_spans(touches))
            cands = [self._last if same_queue else None, self._fence, *p2p]
        elif touches is None:
            cands = [self._last, self._fence, self._p2p_last.get(queue) if same_queue else None]
        else:
            hazards = self._hazards(self._coll_book, tensor_spans(touches))
            cands = [self._p2p_last.get(queue) if same_queue else None, *hazards]
        return [f for f in cands if f is not None and not f.done()]

    @staticmethod
    def _book(book: Deque[_Booked], fut: concurrent.futures.Future, touches: Optional[Sequence[Any]]) -> None:
        """Book a pending operation in ``book`` (``_coll_book`` or ``_p2p_book``) with the memory of
        ``touches`` (the caller holds ``_submit_lock``)."""
        # Collectives end in about the booking order (one worker queue, and what follows a fence
        # waits for it): dropping the finished ones at the front keeps the book as short as what
        # runs at O(1) a call (a scan per call made 2000 queued allreduces 4x slower). Sends and
        # receives of different peers end out of order, so one long-pending operation at the front
        # kept every later one: 6,000 waited sends behind a pending receive made each collective
        # scan 6,001 entries (39 -> 2,670 us). Every 64th entry past 64, the finished ones anywhere
        # are dropped too (amortised O(1): the book holds what is pending plus at most 64).
        while book and book[0][0].done():
            book.popleft()
        book.append((fut, None if touches is None else tensor_spans(touches)))
        if len(book) >= 64 and not len(book) % 64:
            live = [entry for entry in book if not entry[0].done()]
            book.clear()
            book.extend(live)

    def _hazards(self, book: Deque[_Booked], spans: Sequence[Span]) -> List[concurrent.futures.Future]:
        """The pending operations of ``book`` booked with address ranges that intersect ``spans``,
        or with unknown memory, oldest first: what an operation of the other kind on ``spans`` waits
        for (``_coll_book``: collectives, composite steps and fences; ``_p2p_book``: asynchronous
        sends and receives). Not shared memory means no hazard: neither reads what the other
        writes, and the engines run sends and receives beside a collective."""
        with self._submit_lock:
            if not book:
                return []
            booked_ops = tuple(book)
        return [
            f
            for f, booked in booked_ops
            if not f.done() and (booked is None or any(spans_meet(a, b) for a in booked for b in spans))
        ]

    def wait_pending(self, touches: Optional[Sequence[Any]] = None) -> None:
        """Block until every asynchronous operation issued on this communicator has finished
        (``touches``: every collective, and the sends and receives on memory they use)."""
        if not getattr(self._tls, "inside", False):
            deps = self._pending(None, touches=touches)
            if deps:
                concurrent.futures.wait(deps)

    def pending_futures(self, touches: Optional[Sequence[Any]] = None) -> List[concurrent.futures.Future]:
        """The unfinished asynchronous operations issued on this communicator (for ``after=``);
        ``touches``: of the sends and receives, only those on memory they use."""
        return self._pending(None, touches=touches)

    def set_fence(self, fut: concurrent.futures.Future, touches: Optional[Sequence[Any]] = None) -> None:
        """Make later calls on this communicator wait for ``fut`` (an operation queued elsewhere);
        ``touches``: the tensors it reads or writes, as for :meth:`execute` (later sends and
        receives on other memory do not wait for it; None: they all do)."""
        with self._submit_lock:
            self._fence = fut
            self._book(self._coll_book, fut, touches)

    def _annotate(self, exc: CommError) -> None:
        """Add the global ranks behind the engine's communicator-local ranks to ``exc``'s message."""
        if getattr(exc, "communicator", None) is not None:
            return
        exc.communicator = self.name  # type: ignore[attr-defined]
        local = getattr(exc, "missing_ranks", None)
        if local is not None:
            exc.global_missing_ranks = [  # type: ignore[attr-defined]
                self.global_ranks[r] for r in local if 0 <= r < self.nranks()
            ]
        if self.global_ranks == list(range(self.nranks())):
            return  # local ranks are global ranks
        mapping = ", ".join(f"{i}->{g}" for i, g in enumerate(self.global_ranks))
        note = f" [communicator {self.name}: its ranks are global ranks {mapping}"
        if local:
            note += f"; missing: global ranks {exc.global_missing_ranks}"  # type: ignore[attr-defined]
        note += "]"
        exc.args = (f"{exc.args[0] if exc.args else ''}{note}",) + tuple(exc.args[1:])

    def nccl_checks(self) -> bool:
        """Whether CUDA operations exchange a header through the CPU engine first.

        ``TRAINLOOM_COMM_CHECK``: ``1`` (default) checks when the CPU engine is the shared-memory
        engine (a few microseconds), ``all`` also through gloo (a network round trip per call),
        ``0`` never.

        Raises:
            ConfigError: TRAINLOOM_COMM_CHECK is none of these (init_process_group checks it first).
        """
        from trainloom.comm._gloo import comm_check_mode

        mode = comm_check_mode()
        if mode == "0":
            return False
        if mode == "all":
            return True
        return self.cpu_engine_kind() == "shm"

    def cross_check(
        self,
        opname: str,
        t: Optional[torch.Tensor],
        op: int = -1,
        root: int = -1,
        numel: Optional[int] = None,
        counts: Optional[Tuple[Sequence[int], Sequence[int]]] = None,
    ) -> None:
        """Compare this call's arguments with every other rank's through the CPU engine.

        Raises:
            CommError: on every rank, naming each rank's values, when they disagree.
        """
        from trainloom.comm._gloo import check_counts, compare_headers, make_header

        self._xseq += 1
        n = self.nranks()
        hdr = make_header(opname, self._xseq, t, op, root, numel)
        rows = torch.empty(n * hdr.numel(), dtype=torch.int64)
        cpu = self._cpu if self._cpu is not None else self.engine("cpu")
        cpu.allgather(hdr, rows)
        compare_headers(opname, self._xseq, rows.view(n, -1).tolist())
        if counts is not None:
            mine = torch.tensor([*counts[0], *counts[1]], dtype=torch.int64)
            allc = torch.empty(n * mine.numel(), dtype=torch.int64)
            cpu.allgather(mine, allc)
            check_counts(opname, self._xseq, allc.view(n, 2, n).tolist())

    def abort_engines(self) -> None:
        """Abort this communicator's engines: operations waiting in them, here and on the peers,
        raise CommError at once; the communicator cannot be used again."""
        for e in ([self._cpu] if self._cpu is not None else []) + list(self._cuda.values()):
            abort = getattr(e, "abort", None)
            if abort is not None:
                abort()

    def destroy(self) -> None:
        """Close every engine (idempotent); later calls raise CommError."""
        if self._destroyed:
            return
        self._destroyed = True
        self._draining = True
        try:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            for executor in self._p2p_executors.values():
                executor.shutdown(wait=True)
        finally:
            self._draining = False
        self._p2p_executors = {}
        self._p2p_last = {}
        self._fence = None
        self._last = None
        self._coll_book.clear()
        self._p2p_book.clear()
        # Old groups the caller still holds must not keep the job's store (and with it the TCPStore
        # server rank 0 hosts on MASTER_PORT) alive: a later init_process_group() binds that port.
        self._store = None
        engines = ([self._cpu] if self._cpu is not None else []) + list(self._cuda.values())
        self._cpu = None
        self._cuda = {}
        for e in engines:
            try:
                e.close()
            except CommError as exc:  # closing must not stop the others from closing
                logger.warning("closing %s engine of %s: %s", getattr(e, "name", "?"), self.name, exc)


class ProcessGroup:
    """A set of ranks with global, intra-node and inter-node communicators (Bagua's BaguaProcessGroup).

    Create with :func:`new_group` or :func:`from_torch_group`; the default group comes from
    :func:`init_process_group`.

    Attributes:
        ranks: the members' global ranks, sorted.
        stream: the CUDA stream NCCL operations run on (None: the current stream).
        group_name: a name unique within the job.
        rank: this process's rank in the group (-1 for non-members).
        world_size: the number of members.
    """

    def __init__(self, ranks: Sequence[int], stream: Optional[Any], group_name: str) -> None:
        st = _STATE
        if st.launch is None or st.store is None:
            raise CommError("the default process group is not initialized; call init_process_group() first")
        self.ranks = list(ranks)
        self.stream = stream
        self.group_name = group_name
        me = st.launch.rank
        self.world_size = len(self.ranks)
        self.is_member = me in self.ranks
        self.rank = self.ranks.index(me) if self.is_member else -1
        self._global: Optional[Communicator] = None
        self._intra: Optional[Communicator] = None
        self._inter: Optional[Communicator] = None
        if not self.is_member:
            return
        nodes = [st.node_ids[r] for r in self.ranks]
        order = list(dict.fromkeys(nodes))  # nodes in order of first appearance
        my_node = st.node_ids[me]
        intra = [r for r in self.ranks if st.node_ids[r] == my_node]
        leaders = [self.ranks[nodes.index(n)] for n in order]
        t = st.timeout
        self._global = Communicator(
            f"{group_name}/global", self.ranks, me, st.store, t, len(order) == 1, stream
        )
        self._intra = Communicator(
            f"{group_name}/intra{order.index(my_node)}", intra, me, st.store, t, True, stream
        )
        if me in leaders:
            self._inter = Communicator(
                f"{group_name}/inter", leaders, me, st.store, t, len(order) == 1, stream
            )
        self._global.intra = self._intra
        self._global.inter = self._inter
        self._global.is_inter_leader = me in leaders

    def get_global_communicator(self) -> Union[Communicator, NonCommMember]:
        """The communicator over every member, connected (as in Bagua, a member's first call is
        collective: every member must make it, see :meth:`Communicator.connect`).

        Returns:
            The communicator on members; :data:`NON_COMM_MEMBER` on ranks outside the group (as in
            Bagua: collectives given it return at once).
        """
        return _connected(self._global)

    def get_intra_node_communicator(self) -> Union[Communicator, NonCommMember]:
        """The communicator over the members on this rank's node, connected (a member's first call
        is collective over the node's members).

        Returns:
            The communicator on members; :data:`NON_COMM_MEMBER` on ranks outside the group.
        """
        return _connected(self._intra)

    def get_inter_node_communicator(self) -> Union[Communicator, NonCommMember]:
        """The communicator over one leader per node (the first member on each node), connected (a
        leader's first call is collective over the leaders).

        Returns:
            The communicator on node leaders; :data:`NON_COMM_MEMBER` on the other members and on
            ranks outside the group (as in Bagua: collectives given it return at once).
        """
        return _connected(self._inter)

    def global_communicator_unconnected(self) -> Union[Communicator, NonCommMember]:
        """The global communicator without connecting it: its engines connect at their first
        operation (what ``comm=None`` in the collectives uses)."""
        return self._global if self._global is not None else NON_COMM_MEMBER

    def destroy(self) -> None:
        for c in (self._global, self._intra, self._inter):
            if c is not None:
                c.destroy()

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.group_name} ranks={self.ranks} rank={self.rank}>"


#: Bagua's name for the class.
BaguaProcessGroup = ProcessGroup


def _connected(comm: Optional[Communicator]) -> Union[Communicator, NonCommMember]:
    if comm is None:
        return NON_COMM_MEMBER
    comm.connect()
    return comm


#: The deadlines become datetime.timedelta objects (torch's stores and gloo take them so), which end here.
_MAX_TIMEOUT = datetime.timedelta.max.total_seconds()


def _seconds(timeout: Union[None, float, int, datetime.timedelta]) -> float:
    source = ""  # where a bad value came from, when not from the argument
    if timeout is None:
        env = os.environ.get("TRAINLOOM_COMM_TIMEOUT")
        if env:
            try:
                value = float(env)
            except ValueError:
                raise ConfigError(f"TRAINLOOM_COMM_TIMEOUT={env!r} is not a number of seconds") from None
            source = f"TRAINLOOM_COMM_TIMEOUT={env!r}: "
        else:
            value = DEFAULT_TIMEOUT
    elif isinstance(timeout, datetime.timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise ConfigError(f"timeout must be seconds or a datetime.timedelta, got {timeout!r}")
    if not value > 0:
        raise ConfigError(f"{source}timeout must be > 0 seconds, got {value}")
    if not value < _MAX_TIMEOUT:  # inf: datetime.timedelta would raise OverflowError
        raise ConfigError(
            f"{source}timeout must be below {_MAX_TIMEOUT:g} seconds (datetime.timedelta's limit), "
            f"got {value}"
        )
    return value


def _namespace(generation: int) -> str:
    """The store key prefix of one init_process_group() of this process.

    Under ``torchrun --max-restarts`` the agent's store outlives a failed attempt, and the restarted
    workers count generations from 1 again: without the restart count they would read the dead
    attempt's keys (the shared-memory engine refused the prefix as taken; gloo connected to the
    dead workers' addresses)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"tl/r{restart}.{generation}" if restart.isdigit() and restart != "0" else f"tl/{generation}"


#: trainloom's own source directory: _release_frames clears only frames of code from there.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: Code whose frame outlives a call (a paused generator or coroutine): clearing it would finalize it.
_SUSPENDABLE = (
    inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
)


def _release_frames(exc: BaseException) -> None:
    """Clear the locals of trainloom's finished frames an operation's failure passed through.

    The exception outlives the call: a Future keeps it for ``Work.wait()`` (and the Work for as long
    as the caller holds it), and a caller may keep it too. Its traceback's frames held the engine's
    locals (gloo works, the store, rank 0's TCPStore server, the tensors), so a failed operation
    kept the store alive after destroy_process_group(), and the next init_process_group() found its
    port in use. Called in the frame that runs the operation, when ``exc`` leaves it: the frames
    below it have finished (they keep their code and line numbers for the traceback); the running
    ones (this one and its callers) refuse to be cleared. Only trainloom's own frames are cleared:
    a user's callback keeps its locals for a debugger, and a user's paused generator (whose frame
    an exception it caught may hold) is not finalized. The exceptions ``exc`` chains to
    (``__cause__``, ``__context__``) are cleared too when they were caught in those frames, not one
    a caller was handling when it made the call.
    """
    frames: set = set()
    tb = exc.__traceback__
    while tb is not None:
        frames.add(tb.tb_frame)
        tb = tb.tb_next
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        head = e.__traceback__
        if id(e) in seen or head is None or (e is not exc and head.tb_frame not in frames):
            continue
        seen.add(id(e))
        tb = head
        while tb is not None:
            frame, tb = tb.tb_frame, tb.tb_next
            frames.add(frame)
            code = frame.f_code
            if code.co_filename.startswith(_PACKAGE_DIR) and not code.co_flags & _SUSPENDABLE:
                try:
                    frame.clear()
                except RuntimeError:  # still executing (this frame and its callers)
                    pass
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]


def _thread_name(ident: int) -> str:
    for t in threading.enumerate():
        if t.ident == ident:
            return f"{t.name!r}"
    return f"ident {ident}"


def _use_agent_store() -> bool:
    """Whether torchrun's agent hosts the store on MASTER_PORT (torch's own test, in its rendezvous)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


#: Set in a TCPStore that init_process_group() created once destroy_process_group() let go of it:
#: a rank re-initializing before rank 0 has closed that server must not rendezvous through it.
_DESTROYED_KEY = "trainloom/destroyed"


def _await_listener(addr: str, port: int, deadline: float) -> None:
    """Return once something accepts TCP connections on ``addr:port``, or at ``deadline`` (the
    TCPStore constructor then reports the failure in its own words)."""
    pause = 0.005
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            with socket.create_connection((addr, port), timeout=min(left, 1.0)):
                return
        except OSError:
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 0.1)


def _connect_store(launch: LaunchEnv, host: bool, timeout: float) -> Any:
    """The job's TCPStore on MASTER_ADDR:MASTER_PORT (rank 0 hosts it; torchrun's agent under torchrun).

    A client that reaches a store an earlier generation destroyed (rank 0 has not closed it yet)
    drops it and connects again, until ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        base = None
        addr, port = launch.master_addr, launch.master_port
        if not host:
            # Until the server listens, a client waits here, where Ctrl-C works (the constructor
            # retries its connect in C++ for the whole timeout; short attempts of it each log a
            # warning with a C++ stack). The host does not wait for the clients in its constructor
            # either: init_process_group polls for every rank's key, interruptibly.
            _await_listener(addr, port, deadline)
        left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            base = dist.TCPStore(addr, port, launch.world_size, host, timeout=left, wait_for_workers=False)
            if host or _use_agent_store() or not base.check([_DESTROYED_KEY]):
                base.set_timeout(datetime.timedelta(seconds=timeout))
                return base
        except RuntimeError:
            # The earlier generation's server closed while this client connected to it or asked it
            # ("Failed to recv, got 0 bytes"): rank 0 is re-creating it; connect again (this raised
            # at once, and rank 0 then waited for this client for the whole timeout: seen in full
            # test runs, in the constructor's handshake as well as in the check). The host's own
            # store and connection failures until the deadline raise as before.
            if host or time.monotonic() >= deadline:
                raise
        del base
        if time.monotonic() >= deadline:
            raise CommTimeoutError(
                f"init_process_group (rank {launch.rank} of {launch.world_size}): within {timeout:g}s only "
                f"reached the TCPStore of an earlier init_process_group() at {launch.master_addr}:"
                f"{launch.master_port}; rank 0 did not re-create it (did rank 0 call destroy_process_group() "
                "and init_process_group() again?)"
            )
        time.sleep(0.05)


def torch_backend() -> str:
    """The backend :func:`init_process_group` gives torch.distributed's default group when it creates
    it: ``"cpu:gloo,cuda:nccl"`` where a GPU is visible and this torch has NCCL, else ``"gloo"``.

    trainloom's own collectives do not use that group (they have their engines); the user's
    torch.distributed calls and DDP do, and on CUDA tensors they would crawl through gloo. Bagua
    initialised torch.distributed with NCCL.
    """
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_process_group(
    store: Optional[Any] = None,
    timeout: Union[None, float, datetime.timedelta] = None,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    local_world_size: Optional[int] = None,
) -> ProcessGroup:
    """Initialize the default process group (and torch.distributed's, if not yet done: gloo, and
    NCCL for CUDA tensors where there is a GPU, see :func:`torch_backend`).

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (set by
    torchrun); with none of them set the process is rank 0 of 1.

    Args:
        store: a ``torch.distributed.Store`` shared by all ranks; None creates a TCPStore on
            MASTER_ADDR:MASTER_PORT, hosted by rank 0, or, under torchrun
            (``TORCHELASTIC_USE_AGENT_STORE=True``), connects every rank to the store torchrun's agent
            already serves there.
        timeout: seconds (or a timedelta) after which a collective raises CommTimeoutError; default
            ``$TRAINLOOM_COMM_TIMEOUT`` or 300.
        rank: overrides RANK.
        world_size: overrides WORLD_SIZE.
        local_world_size: overrides LOCAL_WORLD_SIZE.

    Returns:
        The default process group.

    Raises:
        RepeatedInitializationError: already initialized.
        ConfigError: the environment is incomplete or inconsistent (names the missing variable), or
            LOCAL_RANK/LOCAL_WORLD_SIZE contradict the node layout found at the rendezvous (raised
            on every rank; see :func:`_local_layout_error`).

    Example::

        import trainloom.comm as bagua          # was: import bagua.torch_api as bagua
        bagua.init_process_group()
        t = torch.ones(4) * (bagua.get_rank() + 1)
        bagua.allreduce_inplace(t)
    """
    global _ATEXIT
    if _STATE.default is not None:
        raise RepeatedInitializationError(
            "init_process_group() was already called; call destroy_process_group() first to re-initialize"
        )
    t = _seconds(timeout)
    from trainloom.comm._gloo import comm_check_mode

    comm_check_mode()  # a bad TRAINLOOM_COMM_CHECK fails here on every rank, before any rendezvous
    launch = read_launch_env(rank, world_size, local_world_size, need_master=store is None)
    td = datetime.timedelta(seconds=t)
    owns_torch = False
    owns_store = False
    if dist.is_initialized():
        if dist.get_rank() != launch.rank or dist.get_world_size() != launch.world_size:
            said = "rank=/world_size=" if rank is not None or world_size is not None else "the environment"
            raise ConfigError(
                f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but {said} says rank {launch.rank} of {launch.world_size}"
            )
        base = store if store is not None else dist.distributed_c10d._get_default_store()
    else:
        if store is not None:
            base = store
        elif launch.world_size == 1:
            base = dist.HashStore()
        else:
            # Under torchrun the agent already serves a TCPStore on MASTER_PORT and says so with
            # TORCHELASTIC_USE_AGENT_STORE=True: every rank connects to it as a client, as torch's own
            # env:// rendezvous does (rank 0 hosting a second server there fails to bind, and c10d logs
            # an error line for it).
            host = launch.rank == 0 and not _use_agent_store()
            try:
                base = _connect_store(launch, host, t)
                owns_store = not _use_agent_store()  # torchrun's agent store outlives generations
            except (RuntimeError, TimeoutError) as exc:  # DistNetworkError/DistStoreError are RuntimeErrors
                text = str(exc)
                if host and ("EADDRINUSE" in text or "address already in use" in text.lower()):
                    # Immediate, not a timeout: something already listens on the port.
                    raise CommError(
                        f"init_process_group (rank 0 of {launch.world_size}): could not host the TCPStore "
                        f"at {launch.master_addr}:{launch.master_port}: the port is already in use "
                        f"({text.splitlines()[0][:160]}). Another process (an earlier job, or a "
                        "torchrun agent: launch with torchrun, which sets TORCHELASTIC_USE_AGENT_STORE) "
                        "listens there, or a TCPStore this process created itself is still alive "
                        "(passed as store=, or kept by torch.distributed). Pick a free MASTER_PORT or "
                        "release the other store"
                    ) from None
                role = "host" if host else "reach"
                raise CommTimeoutError(
                    f"init_process_group (rank {launch.rank} of {launch.world_size}): could not {role} the "
                    f"TCPStore at {launch.master_addr}:{launch.master_port} within {t:g}s "
                    f"({str(exc).splitlines()[0][:160]}). Check MASTER_ADDR/MASTER_PORT and that rank 0 runs"
                ) from None
    _STATE.generation += 1
    _STATE.namespace = _namespace(_STATE.generation)
    tl_store = dist.PrefixStore(_STATE.namespace, base)
    tl_store.set_timeout(td)
    # Which node every rank is on (and its LOCAL_RANK/LOCAL_WORLD_SIZE, checked against that): one
    # store round, used for intra/inter-node communicators. The key is written first, so that a
    # rendezvous that times out can name the ranks that never came.
    tl_store.set(f"node/{launch.rank}", _node_record(launch))
    started = time.monotonic()
    from trainloom.comm._gloo import poll_keys

    try:
        # Every rank's key first, polled (Ctrl-C works while a rank is late): torch's gloo
        # rendezvous below then completes at once instead of waiting in C++.
        poll_keys(tl_store, [f"node/{r}" for r in range(launch.world_size)], t)
        records = [bytes(tl_store.get(f"node/{r}")).decode() for r in range(launch.world_size)]
        wrong = _local_layout_error(launch.rank, records)
        if wrong is not None:
            # Every rank reads the same records and raises the same error, none goes on to wait for
            # the others. Rank 0 may host the store: it stays until every rank has read them.
            tl_store.set(f"layout_read/{launch.rank}", "1")
            if launch.rank == 0:
                poll_keys(tl_store, [f"layout_read/{r}" for r in range(launch.world_size)], t)
        if wrong is None and not dist.is_initialized():
            _import_torch_group_defaults()
            dist.init_process_group(
                torch_backend(),
                # Per generation, like tl_store: torchrun's agent store outlives destroy_process_group,
                # and a second init must not read the first one's gloo rendezvous keys.
                store=dist.PrefixStore(f"{_STATE.namespace}/torch", base),
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=td,
            )
            owns_torch = True
    except RuntimeError as exc:  # DistStoreError / DistNetworkError / gloo connect errors
        try:
            missing = [r for r in range(launch.world_size) if not tl_store.check([f"node/{r}"])]
            who = (
                f"ranks {missing} never arrived"
                if missing
                else "every rank arrived but the rendezvous failed"
            )
        except RuntimeError:  # the store is gone with rank 0
            who = "the store (rank 0) went away"
        if owns_torch and dist.is_initialized():
            dist.destroy_process_group()
        elapsed = time.monotonic() - started
        detail = f"{who} ({str(exc).splitlines()[0][:160]})"
        if elapsed < 0.9 * t:  # failed, not timed out (e.g. gloo refused a connection)
            raise CommError(
                f"init_process_group (rank {launch.rank} of {launch.world_size}): the rendezvous failed "
                f"after {elapsed:.1f}s (timeout {t:g}s); {detail}"
            ) from None
        raise CommTimeoutError(
            f"init_process_group (rank {launch.rank} of {launch.world_size}): the rendezvous did not "
            f"complete within {t:g}s; {detail}"
        ) from None
    if wrong is not None:
        if owns_store:  # as destroy_process_group() does: a rank that initializes again waits for a new one
            try:
                base.set(_DESTROYED_KEY, "1")
            except RuntimeError as exc:  # the host (rank 0) is gone already: nothing to mark
                logger.debug("init_process_group: could not mark the store: %s", exc)
        del tl_store, base  # (rank 0's TCPStore server stops with the last reference)
        raise ConfigError(wrong)
    node_ids = [_parse_node_record(rec)[1] for rec in records]
    if not launch.local_known:
        # No LOCAL_RANK/LOCAL_WORLD_SIZE (e.g. an early-API launcher with multiprocessing): the ranks
        # on this node are the ones that reported this node's identity.
        here = [r for r in range(launch.world_size) if node_ids[r] == node_ids[launch.rank]]
        launch = dataclasses.replace(
            launch, local_rank=here.index(launch.rank), local_world_size=len(here), local_known=True
        )
    _STATE.launch = launch
    _STATE.store = tl_store
    _STATE.base_store = base if owns_store else None
    _STATE.timeout = t
    _STATE.node_ids = node_ids
    _STATE.owns_torch_pg = owns_torch
    _STATE.names = {}
    _STATE.groups = []
    pg = ProcessGroup(list(range(launch.world_size)), None, "default")
    _STATE.default = pg
    _STATE.pid = os.getpid()
    _STATE.groups.append(pg)
    if not _ATEXIT:
        atexit.register(_destroy_at_exit)
        # threading's exit hooks run in reverse order of registration, and before atexit's:
        # registered after concurrent.futures' own (which joins the worker threads), this one runs
        # before those joins.
        threading._register_atexit(_abort_pending_on_failed_exit)  # type: ignore[attr-defined]
        _ATEXIT = True
    return pg


def _node_record(launch: LaunchEnv) -> str:
    """What a rank publishes at the rendezvous: ``"<LOCAL_RANK> <LOCAL_WORLD_SIZE> <node identity>"``
    (``"- -"`` for values not given, which are then derived from the layout)."""
    local = f"{launch.local_rank} {launch.local_world_size}" if launch.local_known else "- -"
    return f"{local} {node_identity()}"


def _parse_node_record(record: str) -> Tuple[Optional[Tuple[int, int]], str]:
    """``((local_rank, local_world_size) or None, node identity)`` of a :func:`_node_record`."""
    lr, lws, ident = record.split(" ", 2)
    return (None if lr == "-" else (int(lr), int(lws))), ident


def _local_layout_error(me: int, records: Sequence[str]) -> Optional[str]:
    """Why the ranks' LOCAL_RANK/LOCAL_WORLD_SIZE contradict the node layout found at the rendezvous
    (``records``: every rank's :func:`_node_record`), or None when they fit it.

    They fit when, on every node, each rank has ``LOCAL_WORLD_SIZE`` = the number of ranks there,
    and their ``LOCAL_RANK`` values are ``0..n-1``, each once (``torch.cuda.set_device(local_rank)``
    then gives each rank its own GPU). A node is the ranks with the same identity; when
    ``TRAINLOOM_NODE_ID`` splits machines into logical nodes, values that fit the whole machines
    (as a launcher on that machine sets them: torchrun) fit too. Ranks that gave no values take
    those of their place among the ranks of their node. Every rank gets the same verdict from the
    same records, so each can raise without waiting for the others.
    """
    parsed = [_parse_node_record(rec) for rec in records]
    nodes = [ident for _, ident in parsed]
    # hostname:boot_id contains no "/": what follows the first one is TRAINLOOM_NODE_ID's label
    machines = [ident.split("/", 1)[0] for ident in nodes]

    def layout(keys: List[str]) -> Dict[str, List[int]]:
        groups: Dict[str, List[int]] = {}
        for r, key in enumerate(keys):
            groups.setdefault(key, []).append(r)
        return groups

    by_node = layout(nodes)
    local: List[Tuple[int, int]] = []
    for r, (given, ident) in enumerate(parsed):
        here = by_node[ident]
        local.append(given if given is not None else (here.index(r), len(here)))

    def misfit(groups: Dict[str, List[int]]) -> Optional[List[int]]:
        for group in groups.values():
            n = len(group)
            if any(local[q][1] != n for q in group) or sorted(local[q][0] for q in group) != list(range(n)):
                return group
        return None

    bad = misfit(by_node)
    by_machine = layout(machines)
    split = sorted(by_node.values()) != sorted(by_machine.values())  # TRAINLOOM_NODE_ID splits machines
    if bad is None or (split and misfit(by_machine) is None):
        return None
    n = len(bad)
    have = ", ".join(
        f"rank {q}: LOCAL_RANK={local[q][0]} LOCAL_WORLD_SIZE={local[q][1]}"
        + ("" if parsed[q][0] is not None else " (not set: derived)")
        for q in bad[:8]
    ) + (f", ... ({n - 8} more)" if n > 8 else "")
    note = ""
    if split:
        note = (
            f" (or, as TRAINLOOM_NODE_ID splits machines into logical nodes, the values that fit the "
            f"ranks {by_machine[machines[bad[0]]]} on its machine)"
        )
    return (
        f"init_process_group (rank {me} of {len(records)}): LOCAL_RANK/LOCAL_WORLD_SIZE contradict the "
        f"node layout found at the rendezvous: ranks {bad} run on one node ({nodes[bad[0]]}), so each "
        f"needs LOCAL_WORLD_SIZE={n} and its own LOCAL_RANK in 0..{n - 1}{note}, but they have {have}. "
        "Set LOCAL_RANK and LOCAL_WORLD_SIZE as the launcher placed the ranks (torchrun does); to run "
        "several launcher nodes on one machine, give each its own TRAINLOOM_NODE_ID (e.g. its node rank)"
    )


def _import_torch_group_defaults() -> None:
    """Import ``torch.distributed.nn.functional`` before torch's default group exists.

    Its functions take ``group=group.WORLD`` as a default argument, which Python evaluates once, at
    import. torch imports the module with ``torch._dynamo``, and the first optimizer a script makes
    imports that: imported while the default group exists, the module keeps that group, its worker
    threads and its store alive after ``destroy_process_group()``, until the interpreter exits. A
    later ``init_process_group()`` under a plain launch then found rank 0's store port in use, and
    at exit a gloo worker thread still releasing a finished collective's tensors could abort the
    process ("terminate called without an active exception"). Imported now, the defaults are
    ``None``, which torch reads as the default group.
    """
    import torch.distributed.nn.functional  # noqa: F401


#: Set once :func:`_warn_if_torch_keeps` has warned (once per process).
_WARNED_KEPT = False


def _torch_defaults_holding(pg: Any) -> List[Tuple[str, str]]:
    """``(module, qualname)`` of the functions of loaded ``torch.distributed`` modules, and of the
    classes defined there, whose default arguments hold ``pg``. A few milliseconds."""
    found: List[Tuple[str, str]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch.distributed" or name.startswith("torch.distributed.")):
            continue
        for obj in list(vars(module).values()):
            kind = type(obj)  # not isinstance(): a deprecated alias warns on attribute access
            if kind is types.FunctionType:
                functions = [obj]
            elif issubclass(kind, type) and vars(obj).get("__module__") == name:
                functions = [f for f in vars(obj).values() if type(f) is types.FunctionType]
            else:
                continue
            for f in functions:
                defaults = (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values())
                if any(d is pg for d in defaults):
                    found.append((f.__module__, f.__qualname__))
    return sorted(set(found))


def _warn_if_torch_keeps(pg: Any) -> None:
    """Warn (once per process) when default arguments in torch keep the destroyed process group
    ``pg`` alive: a module that evaluates ``group.WORLD`` in a signature was imported after
    :func:`init_process_group` (``torch.distributed.nn.functional`` is imported before it)."""
    global _WARNED_KEPT
    if _WARNED_KEPT or pg is None:
        return
    holders = _torch_defaults_holding(pg)
    if not holders:
        return
    _WARNED_KEPT = True
    from trainloom._warnings import warn_at_caller

    names = [f"{m}.{q}" for m, q in holders]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    modules = sorted({m for m, _ in holders})
    warn_at_caller(
        "destroy_process_group(): torch's process group stays alive until the process exits: the "
        f"default arguments of {shown} hold it (group=group.WORLD, evaluated at import, and "
        f"{', '.join(modules)} {'was' if len(modules) == 1 else 'were'} imported after "
        "init_process_group()). Its worker threads and store stay too, so a later "
        "init_process_group() may find the store port in use. Import "
        f"{'that module' if len(modules) == 1 else 'those modules'} before init_process_group()",
        RuntimeWarning,
        __file__,
        logger,
    )


def _destroy_at_exit() -> None:
    # Not in a child made with os.fork() after init: the process group is the parent's (destroying
    # it closed the parent's rank for every peer).
    if _STATE.default is not None and _STATE.pid == os.getpid():
        destroy_process_group()


def _abort_pending_on_failed_exit() -> None:
    """When the main thread ends with an uncaught exception (Ctrl-C, a crash), abort the
    communicators that still have asynchronous work in flight, so that the process exits now and
    their peers fail fast, instead of both waiting for that work's timeout (the interpreter joins
    the worker threads before atexit runs). A normal exit keeps waiting: work every rank issued
    completes."""
    if getattr(sys, "last_value", None) is None or _STATE.pid != os.getpid():
        return
    for pg in list(_STATE.groups):
        for c in (pg._global, pg._intra, pg._inter):
            if c is not None and c.pending_futures():
                c.abort_engines()


def is_initialized() -> bool:
    """Whether :func:`init_process_group` ran (and :func:`destroy_process_group` did not since).

    Returns:
        True when a default process group exists.

    Example::

        if not is_initialized():
            init_process_group()
    """
    return _STATE.default is not None


def get_default_group() -> ProcessGroup:
    """The default process group.

    Returns:
        The group :func:`init_process_group` created.

    Raises:
        CommError: not initialized.

    Example::

        comm = get_default_group().get_global_communicator()
    """
    if _STATE.default is None:
        raise CommError(
            "the default process group is not initialized; call trainloom.comm.init_process_group()"
        )
    return _STATE.default


def _group_name(ranks: List[int]) -> str:
    digest = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:10]
    n = _STATE.names.get(digest, 0)
    _STATE.names[digest] = n + 1
    return f"g{digest}.{n}"


def new_group(ranks: Optional[Sequence[int]] = None, stream: Optional[Any] = None) -> ProcessGroup:
    """Create a process group over ``ranks`` (default: every rank).

    .. warning::
        Every member must call ``new_group`` for the same rank lists in the same order (Bagua asks
        every rank of the job to call it; non-members may, and get a group whose communicator
        getters return :data:`NON_COMM_MEMBER`). Communicators connect when a member first asks
        for them (``get_global_communicator()``, collective, as in Bagua) or at their first
        operation, whichever comes first.

    Args:
        ranks: global ranks of the members (duplicates are an error; the order is normalised).
        stream: CUDA stream for NCCL operations (None: the current stream at each call).

    Returns:
        The new group.

    Raises:
        CommError: not initialized.
        TypeError: a rank is not an int.
        ValueError: a rank is outside the world or repeated, or the list is empty.

    Example::

        pg = new_group([0, 1])
        allreduce_inplace(t, comm=pg.get_global_communicator())  # a no-op on ranks 2, 3, ...
    """
    st = _STATE
    if st.default is None or st.launch is None:
        raise CommError(
            "new_group: the default process group is not initialized; call init_process_group() first"
        )
    w = st.launch.world_size
    if ranks is None:
        members = list(range(w))
    else:
        members = []
        for r in ranks:
            ri = as_int(r)
            if ri is None:
                raise TypeError(f"new_group: ranks must be ints, got {r!r}")
            r = ri
            if not 0 <= r < w:
                raise ValueError(f"new_group: rank {r} is outside the world 0..{w - 1}")
            members.append(r)
        if not members:
            raise ValueError("new_group: ranks is empty")
        if len(set(members)) != len(members):
            raise ValueError(f"new_group: ranks {list(ranks)} contain duplicates")
        members.sort()
    pg = ProcessGroup(members, stream, _group_name(members))
    st.groups.append(pg)
    return pg


def from_torch_group(group: Any, stream: Optional[Any] = None) -> ProcessGroup:
    """The trainloom group with the same members as a torch.distributed process group.

    Args:
        group: a ``torch.distributed.ProcessGroup`` (``None`` or ``group.WORLD``: the default group).
        stream: CUDA stream for NCCL operations.

    Returns:
        A new :class:`ProcessGroup` with the torch group's ranks. On a rank outside the torch group
        (``torch.distributed.new_group`` returned ``GroupMember.NON_GROUP_MEMBER`` there, which does
        not say who the members are) a group with ``ranks == []`` whose communicator getters return
        :data:`NON_COMM_MEMBER`, as :func:`new_group` gives non-members, so every rank may call it
        as in Bagua.

    Raises:
        CommError: not initialized.

    Example::

        g = from_torch_group(torch.distributed.new_group([0, 1]))
    """
    if _STATE.default is None:
        raise CommError("from_torch_group: call init_process_group() first")
    if group is None or group is dist.GroupMember.WORLD:
        ranks = list(range(dist.get_world_size()))
    elif group is dist.GroupMember.NON_GROUP_MEMBER:
        pg = ProcessGroup([], stream, "non-member")
        _STATE.groups.append(pg)
        return pg
    else:
        ranks = dist.get_process_group_ranks(group)
    return new_group(ranks, stream)


def destroy_process_group() -> None:
    """Close every group's engines and forget the default group (and torch's, if we created it).

    Communicators of the destroyed groups raise CommError when used. Safe to call twice; also
    runs at interpreter exit.

    Returns:
        None.

    Example::

        init_process_group()
        ...
        destroy_process_group()
    """
    st = _STATE
    for pg in st.groups:
        pg.destroy()
    st.groups = []
    st.default = None
    st.launch = None
    st.store = None
    base, st.base_store = st.base_store, None
    if base is not None:
        # Mark the server as the old generation's for ranks that re-initialize before rank 0 has
        # closed it (its last reference goes with this function's).
        try:
            base.set(_DESTROYED_KEY, "1")
        except RuntimeError as exc:  # the host (rank 0) is gone already: nothing to mark
            logger.debug("destroy_process_group: could not mark the store: %s", exc)
    st.node_ids = []
    if st.owns_torch_pg and dist.is_initialized():
        world = dist.GroupMember.WORLD
        dist.destroy_process_group()
        _warn_if_torch_keeps(world)
    st.owns_torch_pg = False
