"""NCCL for CUDA tensors: availability queries and the NCCL engine behind the collective API.

``libnccl.so.2`` is loaded by the compiled :mod:`trainloom.comm._nccl` with ``dlopen`` at first use,
never at import. Search order (``trainloom._locate.nccl_candidates()``): ``$TRAINLOOM_NCCL_LIBRARY``
(when set, only that file is tried), a copy already loaded in the process (torch's, via
``RTLD_NOLOAD``), ``libnccl.so.2`` on the loader path, the nvidia-nccl-cu12/cu13 wheel's
``site-packages/nvidia/nccl/lib/libnccl.so.2``.

Example::

    from trainloom.comm import nccl
    if nccl.is_available():
        print(nccl.get_version(), nccl.library_path())
    else:
        print(nccl.unavailable_reason())
"""

from __future__ import annotations

import array
import functools
import logging
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from trainloom._build_check import import_compiled
from trainloom.errors import CommError, CommTimeoutError, NcclUnavailableError

_nccl = import_compiled("trainloom.comm._nccl")

logger = logging.getLogger("trainloom.comm")

__all__ = [
    "is_available",
    "get_version",
    "library_path",
    "unavailable_reason",
    "get_unique_id",
    "NcclEngine",
    "NCCL_DTYPES",
]

# ncclDataType_t / ncclRedOp_t values (NCCL 2.x; FINDINGS.md).
NCCL_DTYPES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
    torch.bool: 1,  # as uint8 0/1, with the ops mapped below
}
_NCCL_SUM, _NCCL_PROD, _NCCL_MAX, _NCCL_MIN, _NCCL_AVG = 0, 1, 2, 3, 4
# Bagua op -> ncclRedOp_t for numbers.
_OPS = {0: _NCCL_SUM, 1: _NCCL_PROD, 2: _NCCL_MIN, 3: _NCCL_MAX, 10: _NCCL_AVG}
# For bool (0/1 bytes): SUM/MAX/BOR = any, PRODUCT/MIN/BAND = all (torch's own NCCL mapping).
_BOOL_OPS = {0: _NCCL_MAX, 3: _NCCL_MAX, 7: _NCCL_MAX, 1: _NCCL_MIN, 2: _NCCL_MIN, 8: _NCCL_MIN}
_BITWISE = {7: torch.bitwise_or, 8: torch.bitwise_and, 9: torch.bitwise_xor}
_BITWISE_NAMES = {7: "BOR", 8: "BAND", 9: "BXOR"}


def is_available() -> bool:
    """Whether libnccl loads here (loads it on first call). Never raises."""
    try:
        _nccl.ensure_loaded()
        return True
    except NcclUnavailableError:
        return False


def unavailable_reason() -> Optional[str]:
    """Why NCCL is unavailable (every path tried with its dlerror()), or None when it loads."""
    return None if is_available() else _nccl.load_error()


def get_version() -> int:
    """``ncclGetVersion()``, e.g. 23203 for NCCL 2.32.3.

    Raises:
        NcclUnavailableError: libnccl cannot be loaded (the message lists every path tried).
    """
    return int(_nccl.get_version())


def library_path() -> str:
    """The file libnccl was loaded from.

    Raises:
        NcclUnavailableError: libnccl cannot be loaded.
    """
    return str(_nccl.library_path())


def get_unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` (128 bytes); works without a GPU.

    Raises:
        NcclUnavailableError: libnccl cannot be loaded.
        NcclError: NCCL failed to create it.
    """
    return bytes(_nccl.get_unique_id())


def _version_tuple() -> Tuple[int, int, int]:
    v = get_version()
    if v >= 10000:
        return v // 10000, (v % 10000) // 100, v % 100
    return v // 1000, (v % 1000) // 100, v % 100


def _version_str() -> str:
    """The loaded NCCL's version as the messages compare it, e.g. ``2.9.9``."""
    return ".".join(map(str, _version_tuple()))


class NcclEngine:
    """An NCCL communicator for one CUDA device, with the shared-memory engine's method names.

    Created collectively by every rank of a communicator at its first CUDA operation: rank 0 makes
    the unique id and shares it through ``store``. Operations are enqueued on ``stream`` (or the
    current stream) after it waits for the current stream; nothing synchronises the host. A
    watchdog thread checks pending operations: past the timeout, or on an asynchronous NCCL error,
    it aborts the communicator (ncclCommAbort) so later calls raise instead of hanging.

    Args:
        store: the job's store.
        rank: this rank in the communicator.
        world_size: communicator size.
        prefix: unique per communicator.
        device: the CUDA device.
        stream: the stream to run on, or None for the current stream at each call.
        timeout: seconds before a pending operation counts as hung.
    """

    name = "nccl"

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        prefix: str,
        device: torch.device,
        stream: Optional[Any] = None,
        timeout: float = 300.0,
    ) -> None:
        _nccl.ensure_loaded()
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = float(timeout)
        self._stream = stream
        # One key per communicator, not per device: ranks of one communicator use different devices.
        key = f"{prefix}/nccl_uid"
        if rank == 0:
            uid = get_unique_id()
            store.set(key, uid)
        else:
            uid = bytes(store.get(key))
        with torch.cuda.device(device):
            self._comm = _nccl.Communicator(world_size, uid, rank)
        self._lock = threading.Lock()
        self._pending: List[Tuple[Any, float, str]] = []
        self._error: Optional[str] = None
        self._watchdog: Optional[threading.Thread] = None
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    def _raise_if_failed(self, opname: str) -> None:
        if self._closed:
            raise CommError(f"{opname}: NCCL communicator used after close()/destroy_process_group()")
        if self._error is not None:
            raise CommError(f"{opname}: the NCCL communicator was aborted: {self._error}")

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(0.1)
            with self._lock:
                self._pending = [p for p in self._pending if not p[0].query()]
                now = time.monotonic()
                late = [p for p in self._pending if p[1] < now]
            err = 0
            if self._comm is not None and not self._comm.closed:
                try:
                    err = self._comm.get_async_error()
                except CommError as exc:
                    err = getattr(exc, "status", -1)
            if late or err not in (0, 7):  # 7 = ncclInProgress
                what = (
                    f"{late[0][2]} exceeded {self.timeout:g}s" if late else f"asynchronous NCCL error {err}"
                )
                self.abort(reason=what)
                return

    def _check_deadline(self, deadline: float) -> None:
        if self._error is not None:
            raise CommError(f"NCCL communicator aborted: {self._error}")
        if time.monotonic() > deadline:
            self.abort(reason="Work.wait timeout")
            raise CommTimeoutError(
                f"NCCL operation did not finish before the deadline (rank {self.rank}); "
                "the communicator was aborted"
            )

    def abort(self, reason: str = "abort() called") -> None:
        """ncclCommAbort: pending and later operations fail instead of hanging."""
        self._error = self._error or reason
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.close()

    # ------------------------------------------------------------ enqueueing
    def _enqueue(
        self,
        opname: str,
        fn: Callable[[int], None],
        tensors: Sequence[torch.Tensor],
        timeout: Optional[float],
        after: Optional[Callable[[], Any]] = None,
    ) -> Any:
        """Run ``fn(stream_handle)`` on the comm stream ordered after the current stream."""
        self._raise_if_failed(opname)
        current = torch.cuda.current_stream(self.device)
        stream = self._stream if self._stream is not None else current
        if stream is not current:
            stream.wait_stream(current)
        with torch.cuda.stream(stream):
            fn(stream.cuda_stream)
            if after is not None:
                after()
        event = torch.cuda.Event()
        event.record(stream)
        if stream is not current:
            for t in tensors:
                t.record_stream(stream)  # the caching allocator must not reuse them early
            current.wait_event(event)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._pending.append((event, deadline, opname))
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="trainloom-nccl-watchdog", daemon=True)
            self._watchdog.start()
        return event

    @staticmethod
    def _dtype(t: torch.Tensor, opname: str) -> Tuple[torch.Tensor, int]:
        if t.is_conj() or t.is_neg():
            # NCCL reads and writes raw memory, where such a view's values are conjugated/negated
            raise TypeError(
                f"{opname}: a {'conjugate' if t.is_conj() else 'negative'} view holds other values in "
                "memory than it shows, and NCCL works on memory; pass t.resolve_conj().resolve_neg()"
            )
        if t.dtype.is_complex:
            t = torch.view_as_real(t)
        code = NCCL_DTYPES.get(t.dtype)
        if code is None:
            raise TypeError(
                f"{opname}: NCCL has no {t.dtype}; supported: "
                f"{sorted(str(d).replace('torch.', '') for d in NCCL_DTYPES)} and complex64/128"
            )
        if t.dtype == torch.bfloat16 and _version_tuple() < (2, 10, 0):
            raise NotImplementedError(f"{opname}: bfloat16 needs NCCL >= 2.10 (loaded {_version_str()})")
        return t, code

    def _op(self, t: torch.Tensor, op: int, opname: str) -> int:
        if t.dtype == torch.bool:
            return _BOOL_OPS[op]
        if op == 10 and _version_tuple() < (2, 10, 0):
            raise NotImplementedError(f"{opname}: ReduceOp.AVG needs NCCL >= 2.10 (loaded {_version_str()})")
        return _OPS[op]

    # ------------------------------------------------------------ operations
    def allreduce(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, timeout: Optional[float] = None
    ) -> Any:
        if op in _BITWISE and not (send.dtype == torch.bool and op != 9):
            # NCCL has no bitwise reductions: allgather, then reduce the rows on the comm stream.
            tmp = torch.empty((self.world_size, send.numel()), dtype=send.dtype, device=send.device)
            s, code = self._dtype(send, "allreduce")
            r, _ = self._dtype(tmp, "allreduce")

            def _fold() -> None:
                recv.reshape(-1).copy_(functools.reduce(_BITWISE[op], tmp.unbind(0)))

            return self._enqueue(
                "allreduce",
                lambda st: self._comm.allgather(s.data_ptr(), r.data_ptr(), s.numel(), code, st),
                [send, recv, tmp],
                timeout,
                after=_fold,
            )
        s, code = self._dtype(send, "allreduce")
        r, _ = self._dtype(recv, "allreduce")
        nop = self._op(send, op, "allreduce")
        return self._enqueue(
            "allreduce",
            lambda st: self._comm.allreduce(s.data_ptr(), r.data_ptr(), s.numel(), code, nop, st),
            [send, recv],
            timeout,
        )

    def reduce(
        self, send: torch.Tensor, recv: torch.Tensor, dst: int, op: int, timeout: Optional[float] = None
    ) -> Any:
        if op in _BITWISE and not (send.dtype == torch.bool and op != 9):
            tmp = torch.empty((self.world_size, send.numel()), dtype=send.dtype, device=send.device)
            s, code = self._dtype(send, "reduce")
            r, _ = self._dtype(tmp, "reduce")
            es = s.element_size()

            def _fold() -> None:
                if self.rank == dst:
                    recv.reshape(-1).copy_(functools.reduce(_BITWISE[op], tmp.unbind(0)))

            return self._enqueue(
                "reduce",
                lambda st: self._comm.gather(s.data_ptr(), r.data_ptr(), s.numel(), es, code, dst, st),
                [send, recv, tmp],
                timeout,
                after=_fold,
            )
        s, code = self._dtype(send, "reduce")
        r, _ = self._dtype(recv, "reduce")
        nop = self._op(send, op, "reduce")
        return self._enqueue(
            "reduce",
            lambda st: self._comm.reduce(s.data_ptr(), r.data_ptr(), s.numel(), code, nop, dst, st),
            [send, recv],
            timeout,
        )

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: Optional[float] = None) -> Any:
        t, code = self._dtype(tensor, "broadcast")
        return self._enqueue(
            "broadcast",
            lambda st: self._comm.broadcast(t.data_ptr(), t.data_ptr(), t.numel(), code, src, st),
            [tensor],
            timeout,
        )

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, timeout: Optional[float] = None) -> Any:
        s, code = self._dtype(send, "allgather")
        r, _ = self._dtype(recv, "allgather")
        return self._enqueue(
            "allgather",
            lambda st: self._comm.allgather(s.data_ptr(), r.data_ptr(), s.numel(), code, st),
            [send, recv],
            timeout,
        )

    def gather(
        self, send: torch.Tensor, recv: torch.Tensor, dst: int, timeout: Optional[float] = None
    ) -> Any:
        s, code = self._dtype(send, "gather")
        r, _ = self._dtype(recv, "gather")
        es = s.element_size()
        return self._enqueue(
            "gather",
            lambda st: self._comm.gather(s.data_ptr(), r.data_ptr(), s.numel(), es, code, dst, st),
            [send, recv],
            timeout,
        )

    def scatter(
        self, send: torch.Tensor, recv: torch.Tensor, src: int, timeout: Optional[float] = None
    ) -> Any:
        s, code = self._dtype(send, "scatter")
        r, _ = self._dtype(recv, "scatter")
        es = r.element_size()
        return self._enqueue(
            "scatter",
            lambda st: self._comm.scatter(s.data_ptr(), r.data_ptr(), r.numel(), es, code, src, st),
            [send, recv],
            timeout,
        )

    def reduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, timeout: Optional[float] = None
    ) -> Any:
        if op in _BITWISE and not (send.dtype == torch.bool and op != 9):
            raise TypeError(
                f"reduce_scatter: NCCL has no bitwise reductions, so op={_BITWISE_NAMES[op]} is not "
                "supported for CUDA tensors; allreduce the tensor instead (it emulates them) and take this "
                "rank's chunk"
            )
        s, code = self._dtype(send, "reduce_scatter")
        r, _ = self._dtype(recv, "reduce_scatter")
        nop = self._op(send, op, "reduce_scatter")
        return self._enqueue(
            "reduce_scatter",
            lambda st: self._comm.reduce_scatter(s.data_ptr(), r.data_ptr(), r.numel(), code, nop, st),
            [send, recv],
            timeout,
        )

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, timeout: Optional[float] = None) -> Any:
        s, code = self._dtype(send, "alltoall")
        r, _ = self._dtype(recv, "alltoall")
        count = s.numel() // self.world_size
        es = s.element_size()
        return self._enqueue(
            "alltoall",
            lambda st: self._comm.alltoall(s.data_ptr(), r.data_ptr(), count, es, code, st),
            [send, recv],
            timeout,
        )

    def alltoall_v(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        send_displs: Sequence[int],
        recv: torch.Tensor,
        recv_counts: Sequence[int],
        recv_displs: Sequence[int],
        timeout: Optional[float] = None,
    ) -> Any:
        mult = 2 if send.dtype.is_complex else 1
        s, code = self._dtype(send, "alltoall_v")
        r, _ = self._dtype(recv, "alltoall_v")
        arrs = [
            array.array("q", [int(x) * mult for x in v])
            for v in (send_counts, send_displs, recv_counts, recv_displs)
        ]
        es = s.element_size()
        return self._enqueue(
            "alltoall_v",
            lambda st: self._comm.alltoall_v(
                s.data_ptr(), arrs[0], arrs[1], r.data_ptr(), arrs[2], arrs[3], es, code, st
            ),
            [send, recv],
            timeout,
        )

    def send(self, tensor: torch.Tensor, dst: int, timeout: Optional[float] = None) -> Any:
        t, code = self._dtype(tensor, "send")
        return self._enqueue(
            "send", lambda st: self._comm.send(t.data_ptr(), t.numel(), code, dst, st), [tensor], timeout
        )

    def recv(self, tensor: torch.Tensor, src: int, timeout: Optional[float] = None) -> Any:
        t, code = self._dtype(tensor, "recv")
        return self._enqueue(
            "recv", lambda st: self._comm.recv(t.data_ptr(), t.numel(), code, src, st), [tensor], timeout
        )

    def barrier(self, timeout: Optional[float] = None) -> Any:
        t = torch.zeros(1, device=self.device)
        return self.allreduce(t, t, 0, timeout)
