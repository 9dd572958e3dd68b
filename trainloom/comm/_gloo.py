"""The gloo engine: torch.distributed's ProcessGroupGloo behind the shared-memory engine's interface.

Used for CPU tensors of groups that span nodes (and for same-node groups while the shared-memory
engine is not available). It follows the method signatures of
:class:`trainloom.comm.shm.ShmCommunicator` (shm-interface.md), so the API layer treats both alike.

Gloo itself aborts the process, or returns silently wrong data, when ranks disagree on sizes or
dtypes (FINDINGS.md). So before each data transfer the ranks exchange a 16-int64 header (operation,
sequence number, dtype, reduce op, root, element count, shape) with one small allgather and every
rank checks every other rank's header; disagreements raise :class:`~trainloom.errors.CommError` on
every rank, naming both ranks' values. The header costs one extra small gloo round (about the latency
of a 4 KiB allreduce, ~0.1-0.4 ms here); ``TRAINLOOM_COMM_CHECK=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from trainloom.comm.env import STORE_GONE_HINT
from trainloom.comm.ops import divide_, writing
from trainloom.errors import CommError, CommTimeoutError, ConfigError

logger = logging.getLogger("trainloom.comm")

__all__ = [
    "GlooEngine",
    "DTYPE_CODES",
    "OP_NAMES",
    "OPCODES",
    "make_header",
    "describe",
    "compare_headers",
    "check_counts",
]

# Bagua's ReduceOp values.
SUM, PRODUCT, MIN, MAX, BOR, BAND, BXOR, AVG = 0, 1, 2, 3, 7, 8, 9, 10
OP_NAMES = {
    SUM: "SUM",
    PRODUCT: "PRODUCT",
    MIN: "MIN",
    MAX: "MAX",
    BOR: "BOR",
    BAND: "BAND",
    BXOR: "BXOR",
    AVG: "AVG",
}
_TORCH_OPS = {
    SUM: dist.ReduceOp.SUM,
    PRODUCT: dist.ReduceOp.PRODUCT,
    MIN: dist.ReduceOp.MIN,
    MAX: dist.ReduceOp.MAX,
    BOR: dist.ReduceOp.BOR,
    BAND: dist.ReduceOp.BAND,
    BXOR: dist.ReduceOp.BXOR,
    AVG: dist.ReduceOp.SUM,  # gloo has no AVG: SUM, then divide by the world size
}

DTYPE_CODES = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
    torch.complex64: 11,
    torch.complex128: 12,
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}

OPCODES = {
    "allreduce": 1,
    "reduce": 2,
    "broadcast": 3,
    "allgather": 4,
    "gather": 5,
    "scatter": 6,
    "reduce_scatter": 7,
    "alltoall": 8,
    "alltoall_v": 9,
    "send": 10,
    "recv": 11,
    "barrier": 12,
}
_OPCODE_NAMES = {v: k for k, v in OPCODES.items()}
_MAGIC = 0x746C6F6F6D  # "tloom"
_HDR = 16
#: After a timeout, how long (at most; the timeout if shorter) to wait for the other ranks' timeouts
#: before naming the ranks that did not arrive.
_CENSUS_S = 5.0
_LATE_GRACE_S = 1.0  # after a pair closed: how long to wait for a peer's "timed out here" key
_MAX_DIMS = 6
_NO = -1  # header field that does not apply to this operation
# send/recv header tags, one per direction (data goes with tag 0): a send to a peer and a receive
# from it may run at once (separate queues), and must not take each other's header.
_TAG_TO_RECV = 1  # the sender's header, to the receiver
_TAG_TO_SEND = 2  # the receiver's header, back to the sender


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (data movement does not care about the dtype)."""
    flat = t.reshape(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        # torch calls a one-element view with any stride contiguous (e.g. m[:, 1] of a 1 x 3 m), and
        # reshape keeps that stride; the byte view needs stride 1 (same memory, one element)
        flat = flat.as_strided((flat.numel(),), (1,))
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


#: TRAINLOOM_COMM_CHECK's spellings (stripped, any case) and the mode each one means.
_CHECK_MODES = {
    **dict.fromkeys(("0", "false", "no", "off"), "0"),
    **dict.fromkeys(("", "1", "true", "yes", "on"), "1"),
    "all": "all",
}


def comm_check_mode() -> str:
    """``TRAINLOOM_COMM_CHECK`` as ``"0"`` (no cross-rank argument check), ``"1"`` (the default:
    gloo headers, and CUDA operations checked through the shared-memory engine) or ``"all"`` (CUDA
    operations checked through gloo too).

    Raises:
        ConfigError: any other value (a typo must not silently mean the default).
    """
    raw = os.environ.get("TRAINLOOM_COMM_CHECK", "1")
    mode = _CHECK_MODES.get(raw.strip().lower())
    if mode is None:
        raise ConfigError(f"TRAINLOOM_COMM_CHECK={raw!r}: use 0, 1 or all")
    return mode


def _check_enabled() -> bool:
    return comm_check_mode() != "0"


def make_header(
    opname: str,
    seq: int,
    t: Optional[torch.Tensor],
    op: int = _NO,
    root: int = _NO,
    numel: Optional[int] = None,
) -> torch.Tensor:
    """The 16-int64 header one rank contributes to a cross-rank argument check."""
    h = [_NO] * _HDR
    h[0] = _MAGIC
    h[1] = seq
    h[2] = OPCODES[opname]
    h[4] = op
    h[5] = root
    if t is not None:
        h[3] = DTYPE_CODES.get(t.dtype, 0)
        h[6] = t.numel() if numel is None else numel
        shape = t.shape
        h[7] = len(shape)
        h[8 : 8 + min(len(shape), _MAX_DIMS)] = list(shape[:_MAX_DIMS])
    else:
        h[6] = 0 if numel is None else numel
    return torch.tensor(h, dtype=torch.int64)  # one tensor from a list: far cheaper than item writes


def describe(h: Sequence[int]) -> str:
    """A header as text: ``allreduce #5 dtype=float32 numel=4 shape=(4,) op=SUM``."""
    parts = [f"{_OPCODE_NAMES.get(int(h[2]), '?')} #{int(h[1])}"]
    if h[3] != _NO:
        parts.append(f"dtype={_CODE_DTYPES.get(int(h[3]), '?')}".replace("torch.", ""))
    # alltoall_v's sizes differ per rank by design: its header carries numel 0, not worth printing
    if h[3] != _NO and _OPCODE_NAMES.get(int(h[2])) != "alltoall_v":
        ndim = int(h[7])
        dims = [int(x) for x in h[8 : 8 + min(ndim, _MAX_DIMS)]]
        inner = ", ".join(map(str, dims)) + (", ..." if ndim > _MAX_DIMS else "") + ("," if ndim == 1 else "")
        parts.append(f"numel={int(h[6])} shape=({inner})")
    if h[4] != _NO:
        parts.append(f"op={OP_NAMES.get(int(h[4]), int(h[4]))}")
    if h[5] != _NO:
        parts.append(f"root={int(h[5])}")
    return " ".join(parts)


def compare_headers(opname: str, seq: int, rows: List[List[int]]) -> None:
    """Raise the same CommError on every rank when the ranks' headers disagree."""
    fields = [
        (1, "sequence number (a rank skipped or added a collective)"),
        (2, "operation"),
        (3, "dtype"),
        (4, "reduce op"),
        (5, "root"),
        (6, "number of elements"),
    ]
    first = rows[0]
    for r, row in enumerate(rows):
        if row[0] != _MAGIC:
            raise CommError(
                f"{opname} #{seq}: rank {r} sent a malformed header; its last call was not a "
                "trainloom collective on this communicator"
            )
    for idx, what in fields:
        for r, row in enumerate(rows):
            if row[idx] != first[idx]:
                raise CommError(
                    f"{opname} #{seq}: ranks disagree on the {what}: rank 0: {describe(first)}; "
                    f"rank {r}: {describe(row)}. Every rank must call the same collective "
                    "with the same dtype, size, op and root"
                )


def check_counts(opname: str, seq: int, counts: List[List[List[int]]]) -> None:
    """alltoall_v: ``counts[i] = [send_counts, recv_counts]`` of rank i; sends must match receives."""
    n = len(counts)
    for i in range(n):
        for j in range(n):
            if counts[i][0][j] != counts[j][1][i]:
                raise CommError(
                    f"{opname} #{seq}: rank {i} sends {counts[i][0][j]} elements to rank {j} "
                    f"(its send_counts[{j}]), but rank {j} expects {counts[j][1][i]} from rank {i} "
                    f"(its recv_counts[{i}])"
                )


# The longest a wait blocks in C++ before Python can run a signal handler (or see an abort).
_SLICE_S = 0.2


class _P2PWaiter:
    """A daemon thread that runs gloo's blocking send/recv waits for one calling thread (see
    GlooEngine._wait_p2p). Kept per calling thread: handing a wait to a running thread costs less
    than starting one per wait (2.1-2.3 ms against 1.15-1.5 ms per 1 KiB round trip here)."""

    def __init__(self) -> None:
        self.stuck = False  # a wait was given up on while gloo still runs it
        self.pid = os.getpid()  # a forked child has no copy of the thread
        self._jobs: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="trainloom-gloo-p2p-wait", daemon=True).start()

    def submit(
        self, works: Sequence[dist.Work], timeout: float
    ) -> Tuple[List[Optional[Exception]], threading.Event]:
        """Queue ``work.wait(timeout)`` for each of ``works`` in turn; the outcome (None: all done,
        else the first error) is appended to the returned list before the event is set."""
        outcome: List[Optional[Exception]] = []
        finished = threading.Event()
        self._jobs.put((works, timeout, outcome, finished))
        return outcome, finished

    def _serve(self) -> None:
        while True:
            # One job per call: its locals (the gloo Work objects, which hold the gloo context and
            # through it the store and rank 0's TCPStore server) die with the call, not when the next
            # job arrives. Kept here, they outlived destroy_process_group(), and a second
            # init_process_group() found the store's port still in use.
            self._serve_one(self._jobs.get())

    @staticmethod
    def _serve_one(job: tuple) -> None:
        works, timeout, outcome, finished = job
        try:
            for work in works:
                work.wait(datetime.timedelta(seconds=timeout))
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 -- handed to the waiting thread, which raises it
            # Without its traceback: that holds this frame, whose locals hold the exception (through
            # ``outcome``) and the gloo works (the store): a cycle only the garbage collector frees.
            outcome.append(exc.with_traceback(None))
        finished.set()


_WAITERS = threading.local()


def poll_keys(store: dist.Store, keys: Sequence[str], timeout: float) -> None:
    """Wait until ``store`` holds every key, polling (1 ms, doubling to 50 ms between checks) so that
    Ctrl-C and other signal handlers run at once: a blocking ``store.wait``/``get`` holds the main
    thread in C++ for its whole timeout, and every timed-out TCPStore wait logs warnings.

    Raises:
        torch.distributed.DistStoreError: the keys are not all there after ``timeout`` seconds, as
            a timed-out ``store.wait`` raises (the callers' handlers for the store's own errors
            then name the ranks that never came).
    """
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not store.check(list(keys)):
        now = time.monotonic()
        if now >= deadline:
            raise dist.DistStoreError(f"timed out after {timeout:g}s waiting for store keys {list(keys)[:4]}")
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 0.05)


def _tagged(err: CommError, op: str, seq: int, missing: Optional[List[int]]) -> CommError:
    """``err`` with the ``op``, ``seq`` and ``missing_ranks`` attributes set.

    Raising the result directly (``raise _tagged(...) from None``) keeps the error out of the
    raising frame's locals: a local holding it while its traceback holds that frame is a reference
    cycle, which kept the engine (its store, and rank 0's TCPStore server) alive until the garbage
    collector ran, so init_process_group() after destroy_process_group() found the port in use."""
    err.op, err.seq, err.missing_ranks = op, seq, missing  # type: ignore[attr-defined]
    return err


def _is_timeout(exc: BaseException) -> bool:
    """Whether a torch/gloo error reports a deadline (their messages say "timeout" or "timed out")."""
    low = str(exc).lower()
    return "timed out" in low or "timeout" in low


class GlooEngine:
    """One gloo process group over ``world_size`` ranks, with cross-rank argument checks.

    Args:
        store: the job's store (a prefix is added).
        rank: this process's rank in the group.
        world_size: the group size.
        prefix: unique per group (every member passes the same one).
        timeout: default per-operation deadline in seconds.

    Thread-safety: collectives one thread at a time (the API layer serialises them); sends and
    receives may run on other threads at the same time, beside each other and beside a collective
    (gloo keeps them apart: they use their own tags).
    """

    name = "gloo"

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, *, prefix: str, timeout: float = 300.0
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self._prefix = prefix
        self._store: Any = store  # None after close(): see close()
        self._seq = 0
        self._p2p_seq = 0
        # Messages per direction and peer (("send", 1): sends to rank 1), numbered from 1 in the
        # headers: a mismatch names the message of the pair's stream ("send #3"), the same on both sides
        self._pair_seq: Dict[Tuple[str, int], int] = {}
        self._p2p_lock = threading.Lock()
        self._broken: Optional[str] = None
        self._aborted: Optional[str] = None  # why abort() was called; ends waits on other threads
        self._unfinished: List[dist.Work] = []  # operations a wait gave up on (still running in gloo)
        self._closed = False
        self._check = _check_enabled()
        try:
            # Mark arrival first: if connecting times out, the store tells which members never came.
            store.set(f"{prefix}/joined/{rank}", "1")
        except RuntimeError as exc:  # DistNetworkError: the store's host is gone
            raise self._store_gone(exc) from None
        try:
            # Every member first (interruptible): gloo's connect waits in C++ for the whole timeout.
            poll_keys(store, [f"{prefix}/joined/{r}" for r in range(world_size)], self.timeout)
            # Any: torch's stubs do not declare the collectives ProcessGroupGloo binds at run time.
            self._pg: Any = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix + "/pg", store),
                rank,
                world_size,
                datetime.timedelta(seconds=self.timeout),
            )
        except RuntimeError as exc:  # DistStoreError / DistNetworkError / gloo's connect errors
            try:
                missing = [r for r in range(world_size) if not store.check([f"{prefix}/joined/{r}"])]
            except RuntimeError as exc2:  # the store itself is unreachable too
                raise self._store_gone(exc2, exc) from None
            who = f"ranks {missing} never joined" if missing else "every rank joined but could not connect"
            # A member that never joined is a timeout whatever words torch or gloo chose for it
            # (the store says "timeout", a pair's connect "Timed out": testing only the first made
            # this a CommError now and then).
            kind = CommTimeoutError if missing or _is_timeout(exc) else CommError
            msg = (
                f"gloo communicator {prefix} (rank {rank} of {world_size}): connecting failed after "
                f"{self.timeout:g}s; {who} ({str(exc).splitlines()[0][:160]})"
            )
            self._store = None  # the failed engine is never closed: let go of the store now
            raise _tagged(kind(msg), "connect", 0, missing) from None

    def _store_gone(self, exc: BaseException, first: Optional[BaseException] = None) -> CommError:
        """The error for a store that went away while this communicator was connecting."""
        detail = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        if first is not None:
            detail = f"{str(first).splitlines()[0][:160]}; then asking the store: {detail}"
        return CommError(
            f"gloo communicator {self._prefix} (rank {self.rank} of {self.world_size}): could not connect "
            f"because the store is gone ({detail}). {STORE_GONE_HINT}"
        )

    # ----------------------------------------------------------------- plumbing
    def _begin(self, opname: str, p2p: bool = False) -> int:
        if self._closed:
            raise CommError(f"{opname}: gloo communicator used after close()/destroy_process_group()")
        if self._broken is not None:
            raise CommError(
                f"{opname}: this communicator is unusable after an earlier failure ({self._broken}); "
                "destroy the process group and create a new one"
            )
        if p2p:  # only two ranks take part: a separate count keeps collective numbers equal everywhere
            with self._p2p_lock:  # p2p operations run on several threads (a queue per direction and peer)
                self._p2p_seq += 1
                return self._p2p_seq
        self._seq += 1
        return self._seq

    def _wait(self, work: dist.Work, opname: str, seq: int, timeout: Optional[float]) -> None:
        """Wait for a collective's ``work`` (sends and receives: :meth:`_wait_p2p`) in slices of at
        most ``_SLICE_S``: gloo's wait blocks in C++, where
        Python runs no signal handler, and nothing can cancel a gloo operation (its ``abort()`` and
        ``shutdown()`` return while the operation keeps waiting for its peer). Between slices a
        signal handler's exception (Ctrl-C) propagates and aborts this engine, and an engine
        aborted from another thread (the exit hook after an uncaught exception) ends the wait with
        a CommError. Before, both waited for the whole timeout (300 s by default). A slice that
        expires leaves the operation running: gloo's "Operation timed out!" from ``wait(timeout)``
        does not cancel it."""
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        done = failing = settled = False
        try:
            while True:
                slice_s = max(min(deadline - time.monotonic(), _SLICE_S), 1e-3)
                try:
                    work.wait(datetime.timedelta(seconds=slice_s))
                except RuntimeError as exc:
                    # Handled inside the block, whose name goes with it: the error kept in a local for
                    # later, with this frame in its traceback, was a reference cycle (see close()).
                    if settled or not _is_timeout(exc) or time.monotonic() >= deadline:
                        failing = True
                        self._fail(exc, opname, seq, t)
                else:
                    done = True
                    return
                if work.is_completed():
                    # It ended (a peer's failure, say) as the slice ran out: the next wait returns
                    # its own outcome at once, not the slice's "Operation timed out!"
                    settled = True
                    continue
                if self._aborted is not None:
                    failing = True
                    raise self._aborted_error(opname, seq)
        except BaseException as exc:
            if not failing:  # a signal handler raised (KeyboardInterrupt, ...)
                if isinstance(exc.__context__, RuntimeError) and _is_timeout(exc.__context__):
                    exc.__suppress_context__ = True  # not the slice's "Operation timed out!"
                self.abort(f"{opname} #{seq} was interrupted by a signal handler (Ctrl-C)")
            raise
        finally:
            if not done and not work.is_completed():
                self._unfinished.append(work)  # close() must not wait for it (see close)

    def _wait_p2p(self, works: List[dist.Work], opname: str, seq: int, t: float, peer: int) -> None:
        """Wait for send/recv ``works``: gloo's waits for the whole timeout, on a daemon thread
        (:class:`_P2PWaiter`), while this thread waits for that one in slices (Ctrl-C, abort()
        from another thread).

        A send/recv cannot be waited in slices like a collective: a gloo ``wait(timeout)`` on it
        that runs out closes the pair (every later operation between the two ranks then fails with
        "Application timeout caused pair closure"), and its ``is_completed()`` stays False until a
        wait returns (measured on torch 2.13). A daemon thread does not hold up the process's exit.
        """
        waiter = getattr(_WAITERS, "waiter", None)
        if waiter is None or waiter.stuck or waiter.pid != os.getpid():
            waiter = _WAITERS.waiter = _P2PWaiter()
        outcome, finished = waiter.submit(works, t)
        failing = False
        try:
            while not finished.wait(_SLICE_S):
                if self._aborted is not None:
                    failing = True
                    raise self._aborted_error(opname, seq)
        except BaseException:
            waiter.stuck = True  # still waiting in gloo: the next wait takes a new thread
            self._unfinished.extend(works)  # close() must not wait for them either
            if not failing:  # a signal handler raised (KeyboardInterrupt, ...)
                self.abort(f"{opname} #{seq} was interrupted by a signal handler (Ctrl-C)")
            raise
        if outcome[0] is not None:
            self._fail(outcome[0], opname, seq, t, peer)

    def _aborted_error(self, opname: str, seq: int) -> CommError:
        return CommError(
            f"{opname} #{seq} (gloo, rank {self.rank} of {self.world_size}): the communicator was "
            f"aborted while this operation waited ({self._aborted})"
        )

    def _fail(
        self, exc: BaseException, opname: str, seq: int, timeout: float, peer: Optional[int] = None
    ) -> None:
        text = str(exc)
        low = text.lower()
        if _is_timeout(exc):
            self._broken = f"{opname} #{seq} timed out"
            if opname in ("send", "recv"):
                # Only the peer takes part (and p2p numbers are per rank): no store census of arrivals.
                missing: Optional[List[int]] = None
                other = "recv" if opname == "send" else "send"
                who = "the peer" if peer is None else f"the peer (rank {peer})"
                msg = (
                    f"{who} did not post the matching {other}. Check that every {opname} has a "
                    f"matching {other} on the peer, or raise the timeout"
                )
            else:
                window = min(max(timeout, 1.0), _CENSUS_S)
                missing = self._missing_ranks(seq, window)
                who = (
                    f"ranks {missing} did not arrive within {window:g}s of this rank"
                    if missing
                    else "a peer stopped responding"
                )
                msg = (
                    f"{who}. Check that every rank calls the same collectives in the same order, or raise "
                    "the timeout"
                )
            full = (
                f"{opname} #{seq} (gloo, rank {self.rank} of {self.world_size}): timed out after "
                f"{timeout:g}s; {msg}"
            )
            raise _tagged(CommTimeoutError(full), opname, seq, missing) from None
        self._broken = f"{opname} #{seq} failed: {text.splitlines()[0][:200]}"
        if "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
            late = [] if opname in ("send", "recv") else self._timed_out_peers(seq)
            if late:
                # gloo closes a pair when a wait on it times out: the peer is alive, this rank was late
                raise CommError(
                    f"{opname} #{seq} (gloo, rank {self.rank} of {self.world_size}): ranks {late} timed "
                    "out in this operation before this rank reached it, and closed their connections. "
                    "Check that every rank calls the same collectives in the same order, or raise the "
                    f"timeout ({text.splitlines()[0][:160]})"
                ) from None
            raise CommError(
                f"{opname} #{seq} (gloo, rank {self.rank}): a peer died or left the job ({text[:200]})"
            ) from None
        raise CommError(f"{opname} #{seq} (gloo, rank {self.rank}): {text[:300]}") from None

    def _missing_ranks(self, seq: int, window: float) -> List[int]:
        """After a timeout: which ranks had not reached operation ``seq`` ``window`` s after this one.

        Each rank that times out says so in the store; a rank that arrived ``d`` s after this one times
        out ``d`` s later, so waiting ``window`` s finds every rank that arrived within ``window`` s of
        this one (waiting the whole timeout would find all that arrived before this one gave up).
        """
        store = self._store
        if store is None:  # closed (destroy_process_group() from another thread): nothing to ask
            return []
        try:
            store.set(f"{self._prefix}/late/{seq}/{self.rank}", "1")
            deadline = time.monotonic() + window
            missing = list(range(self.world_size))
            while missing and time.monotonic() < deadline:
                missing = [
                    r for r in range(self.world_size) if not store.check([f"{self._prefix}/late/{seq}/{r}"])
                ]
                if missing:
                    time.sleep(0.05)
            return missing
        except RuntimeError as exc:  # the store itself is gone (rank 0 died): report what we know
            logger.warning("could not ask the store which ranks are missing: %s", exc)
            return []

    def _timed_out_peers(self, seq: int) -> List[int]:
        """After a connection closed during collective ``seq``: the ranks that say (in the store, see
        :meth:`_missing_ranks`) that they timed out in it. gloo closes the pairs before the rank that
        timed out writes its key, so the key is waited for, at most ``_LATE_GRACE_S``; a rank that
        died writes none (and with rank 0 the store is gone: no wait)."""
        store = self._store
        if store is None:  # closed (destroy_process_group() from another thread): nothing to ask
            return []
        keys = {r: f"{self._prefix}/late/{seq}/{r}" for r in range(self.world_size) if r != self.rank}
        deadline = time.monotonic() + _LATE_GRACE_S
        try:
            while True:
                late = [r for r, k in keys.items() if store.check([k])]
                if late or time.monotonic() >= deadline:
                    return late
                time.sleep(0.05)
        except RuntimeError as exc:  # the store is gone (its host, rank 0, died)
            logger.debug("could not ask the store which peers timed out: %s", exc)
            return []

    def _exchange(
        self, opname: str, seq: int, hdr: torch.Tensor, timeout: Optional[float]
    ) -> List[List[int]]:
        out = torch.empty(self.world_size * _HDR, dtype=torch.int64)
        try:
            work = self._pg._allgather_base(out, hdr)
        except RuntimeError as exc:
            self._fail(exc, opname, seq, self.timeout if timeout is None else timeout)
        self._wait(work, opname, seq, timeout)
        return out.view(self.world_size, _HDR).tolist()

    def _agree(
        self, opname: str, seq: int, hdr: torch.Tensor, timeout: Optional[float], force: bool = False
    ) -> Optional[List[List[int]]]:
        if not (self._check or force):
            return None
        rows = self._exchange(opname, seq, hdr, timeout)
        compare_headers(opname, seq, rows)
        return rows

    def _run(self, opname: str, seq: int, timeout: Optional[float], fn: Callable[[], Any]) -> None:
        try:
            work = fn()
        except RuntimeError as exc:
            self._fail(exc, opname, seq, self.timeout if timeout is None else timeout)
        if work is not None:
            self._wait(work, opname, seq, timeout)

    def _run_p2p(
        self, opname: str, seq: int, timeout: Optional[float], fns: Sequence[Callable[[], Any]], peer: int
    ) -> None:
        """Post the send/recv operations ``fns`` make, then wait for all of them with one hand-off
        to the waiter thread (each hand-off costs two thread wake-ups)."""
        t = self.timeout if timeout is None else timeout
        works = []
        for fn in fns:
            try:
                works.append(fn())
            except RuntimeError as exc:
                self._fail(exc, opname, seq, t, peer)
        self._wait_p2p(works, opname, seq, t, peer)

    # ------------------------------------------------------------- reductions
    def _reduce_buffer(
        self,
        buf: torch.Tensor,
        op: int,
        opname: str,
        seq: int,
        timeout: Optional[float],
        root: Optional[int] = None,
    ) -> None:
        """In-place allreduce (root None) or reduce of ``buf`` with Bagua op semantics.

        bool: SUM is "any" and PRODUCT "all", as on the shared-memory engine, so they run as MAX and
        MIN: gloo's own SUM adds the bytes (2 from two ranks, 0 from 256), which are no valid bools,
        and a later bytewise BXOR/BAND (or a comparison) on them went wrong. torch's gloo backend has
        that SUM (its ``all_reduce`` of bools gives those bytes); trainloom's does not. AVG of a bool
        is refused before it gets here (collectives: AVG needs a floating or complex dtype).
        """
        if buf.dtype == torch.bool:
            op = {SUM: MAX, PRODUCT: MIN}.get(op, op)
        work_t = buf
        if buf.dtype == torch.int16:  # gloo has no int16: reduce in int32, wrap back (same modulo 2**16)
            work_t = buf.to(torch.int32)
        elif op == AVG and buf.dtype in (torch.float16, torch.bfloat16):
            # Sum in fp32, divide, round once (as the shared-memory engine does): a half sum of
            # world_size values overflows long before their average does (4 x 40000 in fp16).
            work_t = buf.float()
        elif buf.dtype.is_complex:
            work_t = torch.view_as_real(buf)
        opts: Any  # AllreduceOptions or ReduceOptions (their stubs type reduceOp as ReduceOp)
        if root is None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = _TORCH_OPS[op]
            self._run(opname, seq, timeout, lambda: self._pg.allreduce([work_t], opts))
        else:
            opts = dist.ReduceOptions()
            opts.reduceOp = _TORCH_OPS[op]
            opts.rootRank = root
            opts.rootTensor = 0
            self._run(opname, seq, timeout, lambda: self._pg.reduce([work_t], opts))
        if op == AVG and buf.dtype in (torch.float16, torch.bfloat16):
            if root is None or root == self.rank:
                buf.copy_(work_t.div_(self.world_size))
            return
        if work_t is not buf and buf.dtype == torch.int16:
            buf.copy_(work_t)
        if op == AVG and (root is None or root == self.rank):
            divide_(buf, self.world_size)

    def allreduce(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, timeout: Optional[float] = None
    ) -> None:
        seq = self._begin("allreduce")
        self._agree("allreduce", seq, make_header("allreduce", seq, send, op=op), timeout)
        with writing(recv):
            if recv.data_ptr() != send.data_ptr():
                recv.view(-1).copy_(send.view(-1))  # same count, maybe another shape (as on shm)
            if recv.numel():
                self._reduce_buffer(recv, op, "allreduce", seq, timeout)

    def reduce(
        self, send: torch.Tensor, recv: torch.Tensor, dst: int, op: int, timeout: Optional[float] = None
    ) -> None:
        seq = self._begin("reduce")
        self._agree("reduce", seq, make_header("reduce", seq, send, op=op, root=dst), timeout)
        if not send.numel():
            return
        with writing(recv if self.rank == dst else send):
            if self.rank == dst:
                if recv.data_ptr() != send.data_ptr():
                    recv.view(-1).copy_(send.view(-1))  # same count, maybe another shape (as on shm)
                buf = recv
            else:
                buf = send.clone()  # gloo uses non-root buffers as scratch; never touch the caller's input
            self._reduce_buffer(buf, op, "reduce", seq, timeout, root=dst)

    def reduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, timeout: Optional[float] = None
    ) -> None:
        seq = self._begin("reduce_scatter")
        self._agree("reduce_scatter", seq, make_header("reduce_scatter", seq, recv, op=op), timeout)
        if not recv.numel():
            return
        # gloo's own reduce_scatter is an allreduce plus a copy (FINDINGS.md); do that explicitly.
        with writing(recv):
            tmp = send.reshape(-1).clone()
            self._reduce_buffer(tmp, op, "reduce_scatter", seq, timeout)
            n = recv.numel()
            recv.reshape(-1).copy_(tmp[self.rank * n : (self.rank + 1) * n])

    # ---------------------------------------------------------- data movement
    def broadcast(self, tensor: torch.Tensor, src: int, timeout: Optional[float] = None) -> None:
        seq = self._begin("broadcast")
        self._agree("broadcast", seq, make_header("broadcast", seq, tensor, root=src), timeout)
        if not tensor.numel():
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        b = _bytes(tensor)
        self._run("broadcast", seq, timeout, lambda: self._pg.broadcast([b], opts))

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, timeout: Optional[float] = None) -> None:
        seq = self._begin("allgather")
        self._agree("allgather", seq, make_header("allgather", seq, send), timeout)
        if not send.numel():
            return
        sb, rb = _bytes(send), _bytes(recv)
        self._run("allgather", seq, timeout, lambda: self._pg._allgather_base(rb, sb))

    def gather(
        self, send: torch.Tensor, recv: torch.Tensor, dst: int, timeout: Optional[float] = None
    ) -> None:
        seq = self._begin("gather")
        self._agree("gather", seq, make_header("gather", seq, send, root=dst), timeout)
        if not send.numel():
            return
        sb = _bytes(send)
        outs = [list(_bytes(recv).chunk(self.world_size))] if self.rank == dst else []
        opts = dist.GatherOptions()
        opts.rootRank = dst
        self._run("gather", seq, timeout, lambda: self._pg.gather(outs, [sb], opts))

    def scatter(
        self, send: torch.Tensor, recv: torch.Tensor, src: int, timeout: Optional[float] = None
    ) -> None:
        seq = self._begin("scatter")
        self._agree("scatter", seq, make_header("scatter", seq, recv, root=src), timeout)
        if not recv.numel():
            return
        rb = _bytes(recv)
        ins = [list(_bytes(send).chunk(self.world_size))] if self.rank == src else []
        opts = dist.ScatterOptions()
        opts.rootRank = src
        self._run("scatter", seq, timeout, lambda: self._pg.scatter([rb], ins, opts))

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, timeout: Optional[float] = None) -> None:
        seq = self._begin("alltoall")
        self._agree("alltoall", seq, make_header("alltoall", seq, send), timeout)
        if not send.numel():
            return
        sb, rb = _bytes(send), _bytes(recv)
        opts = dist.AllToAllOptions()
        self._run("alltoall", seq, timeout, lambda: self._pg.alltoall_base(rb, sb, [], [], opts))

    def alltoall_v(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        send_displs: Sequence[int],
        recv: torch.Tensor,
        recv_counts: Sequence[int],
        recv_displs: Sequence[int],
        timeout: Optional[float] = None,
    ) -> None:
        seq = self._begin("alltoall_v")
        n = self.world_size
        self._agree("alltoall_v", seq, make_header("alltoall_v", seq, send, numel=0), timeout)
        if self._check:
            # What rank i sends to j must be what j expects from i: exchange the count vectors.
            mine = torch.tensor(list(send_counts) + list(recv_counts), dtype=torch.int64)
            out = torch.empty(n * 2 * n, dtype=torch.int64)
            self._run("alltoall_v", seq, timeout, lambda: self._pg._allgather_base(out, mine))
            check_counts("alltoall_v", seq, out.view(n, 2, n).tolist())
        es = send.element_size()
        sflat, rflat = _bytes(send), _bytes(recv)
        # gloo's alltoall_base takes split sizes of packed buffers, not displacements: pack/unpack.
        spack = (
            torch.cat([sflat[d * es : (d + c) * es] for c, d in zip(send_counts, send_displs)])
            if n
            else sflat
        )
        rpack = torch.empty(sum(recv_counts) * es, dtype=torch.uint8)
        opts = dist.AllToAllOptions()
        self._run(
            "alltoall_v",
            seq,
            timeout,
            lambda: self._pg.alltoall_base(
                rpack, spack, [c * es for c in recv_counts], [c * es for c in send_counts], opts
            ),
        )
        off = 0
        for c, d in zip(recv_counts, recv_displs):
            rflat[d * es : (d + c) * es].copy_(rpack[off : off + c * es])
            off += c * es

    def send(self, tensor: torch.Tensor, dst: int, timeout: Optional[float] = None) -> None:
        seq = self._begin("send", p2p=True)
        if self._check:
            hdr = make_header("send", self._pair_message("send", dst), tensor)
            peer = torch.empty(_HDR, dtype=torch.int64)
            posts = [
                lambda: self._pg.send([hdr], dst, _TAG_TO_RECV),
                lambda: self._pg.recv([peer], dst, _TAG_TO_SEND),
            ]
            self._run_p2p("send", seq, timeout, posts, dst)
            self._compare_p2p("send", hdr.tolist(), peer.tolist(), self.rank, dst)
        if tensor.numel():
            b = _bytes(tensor)
            self._run_p2p("send", seq, timeout, [lambda: self._pg.send([b], dst, 0)], dst)

    def recv(self, tensor: torch.Tensor, src: int, timeout: Optional[float] = None) -> None:
        seq = self._begin("recv", p2p=True)
        if self._check:
            hdr = make_header("recv", self._pair_message("recv", src), tensor)
            peer = torch.empty(_HDR, dtype=torch.int64)
            posts = [
                lambda: self._pg.recv([peer], src, _TAG_TO_RECV),
                lambda: self._pg.send([hdr], src, _TAG_TO_SEND),
            ]
            self._run_p2p("recv", seq, timeout, posts, src)
            self._compare_p2p("recv", peer.tolist(), hdr.tolist(), src, self.rank)
        if tensor.numel():
            b = _bytes(tensor)
            self._run_p2p("recv", seq, timeout, [lambda: self._pg.recv([b], src, 0)], src)

    def _pair_message(self, direction: str, peer: int) -> int:
        """The number of this message in its direction with ``peer`` (from 1)."""
        with self._p2p_lock:
            n = self._pair_seq.get((direction, peer), 0) + 1
            self._pair_seq[(direction, peer)] = n
            return n

    @staticmethod
    def _compare_p2p(opname: str, s: List[int], r: List[int], src: int, dst: int) -> None:
        if s[0] != _MAGIC or r[0] != _MAGIC or s[2] != OPCODES["send"] or r[2] != OPCODES["recv"]:
            raise CommError(
                f"{opname}: rank {src} -> rank {dst}: the peer did not call the matching send/recv"
            )
        if s[3] != r[3] or s[6] != r[6]:
            raise CommError(
                f"{opname}: send on rank {src} ({describe(s)}) does not match recv on rank "
                f"{dst} ({describe(r)}): dtype and number of elements must be equal"
            )

    def barrier(self, timeout: Optional[float] = None) -> None:
        seq = self._begin("barrier")
        # The header allgather is itself a barrier; it also catches a rank that called another op.
        self._agree("barrier", seq, make_header("barrier", seq, None), timeout, force=True)

    def abort(self, reason: str = "abort() was called") -> None:
        self._broken = self._broken or reason
        self._aborted = self._aborted or reason
        try:
            self._pg.abort()
        except RuntimeError as exc:  # some torch builds do not implement abort for gloo
            logger.debug("ProcessGroupGloo.abort: %s", exc)

    def close(self) -> None:
        """Release the process group and the store (idempotent).

        Everything that holds the store goes here, not when the engine object dies: a failed
        operation's exception holds this engine through its traceback's frames for as long as
        something holds the exception (a Work, a caller's variable), and rank 0's TCPStore server
        must stop with destroy_process_group(), or the next init_process_group() finds its port in
        use (it did after a cross-rank mismatch or a timeout, until the garbage collector ran)."""
        if self._closed:
            return
        self._closed = True
        self._store = None
        pg, self._pg = self._pg, None
        if any(not w.is_completed() for w in self._unfinished):
            # ProcessGroupGloo's destructor joins its worker threads, and one of them still runs an
            # operation that nothing can cancel: destroying it would wait for gloo's timeout (at
            # exit too, after Ctrl-C). It is kept alive instead, to be reclaimed with the process.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
            logger.debug("gloo engine %s: left a process group with an operation in flight", self._prefix)
        self._unfinished = []
        del pg
