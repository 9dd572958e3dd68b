"""Work handles returned by collectives called with ``async_op=True``.

Four kinds, one interface (``wait(timeout=None)``, ``is_completed()``, ``result()``):

* :class:`CompletedWork` -- the operation already ran (``async_op=True`` on a path that finished
  synchronously, e.g. world size 1 or an empty tensor);
* :class:`FutureWork` -- a CPU operation running on the communicator's worker thread;
* :class:`CudaWork` -- an NCCL operation enqueued on a CUDA stream; ``wait()`` makes the *current*
  stream wait on the recorded event (no host synchronization), as ``torch.distributed``'s
  ``Work.wait`` does, and keeps the tensors alive until then.
* :class:`ThenWork` -- another Work followed by local copies or arithmetic that ``wait()`` runs
  (composite CUDA operations).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, Optional, Sequence

import torch

from trainloom.errors import CommTimeoutError

__all__ = ["Work", "CompletedWork", "FutureWork", "CudaWork", "ThenWork"]


class Work:
    """Handle of an asynchronous collective.

    Example::

        work = allreduce_inplace(t, async_op=True)
        ...                         # overlap other work
        work.wait()                 # t now holds the reduced values
    """

    def __init__(self, op_name: str, result: Optional[torch.Tensor]) -> None:
        self.op_name = op_name
        self._result = result

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the operation finished (CPU) or is ordered before the current stream (CUDA).

        Args:
            timeout: seconds to wait at most; ``None`` waits as long as the communicator's own
                timeout allows.

        Returns:
            True.

        Raises:
            CommTimeoutError: the operation did not finish within ``timeout``.
            CommError: the operation failed (mismatch between ranks, a peer died, ...).
        """
        raise NotImplementedError  # pragma: no cover - abstract

    def is_completed(self) -> bool:
        """Whether the operation finished (never blocks)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def result(self) -> Optional[torch.Tensor]:
        """The output tensor of the collective (``None`` for barrier/send), after :meth:`wait`."""
        self.wait()
        return self._result

    @property
    def tensor(self) -> Optional[torch.Tensor]:
        """The output tensor (valid after :meth:`wait`)."""
        return self._result

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.op_name} completed={self.is_completed()}>"


class CompletedWork(Work):
    """An operation that already finished when it was returned."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FutureWork(Work):
    """A CPU operation run by the communicator's single worker thread.

    ``finish`` runs in the waiting thread once the operation succeeded (copies a contiguous staging
    tensor back into the caller's non-contiguous view).
    """

    def __init__(
        self,
        op_name: str,
        future: concurrent.futures.Future[Any],
        result: Optional[torch.Tensor],
        finish: Optional[Callable[[], None]] = None,
    ) -> None:
        super().__init__(op_name, result)
        self._future = future
        self._finish = finish
        self._done = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._done:
            return True
        # Wait first, then take the result: the operation's own exception may be a TimeoutError
        # (CommTimeoutError is one), which must not be mistaken for this wait expiring.
        if not concurrent.futures.wait([self._future], timeout=timeout).done:
            raise CommTimeoutError(
                f"{self.op_name}: Work.wait(timeout={timeout}) expired before the operation finished; "
                "it is still running on the communicator's worker thread (wait again, or raise the "
                "timeout)"
            )
        try:
            self._future.result()  # re-raises the operation's exception, if any
        except BaseException:
            # The future keeps the exception, whose traceback now holds this frame: without
            # ``self`` in it (nor the future) that is no reference cycle, and the Work, the future
            # and what the operation's frames hold go when the caller lets go of them.
            del self
            raise
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class CudaWork(Work):
    """An NCCL operation enqueued on ``stream``; completion is tracked with a CUDA event.

    Keeps ``keep_alive`` tensors referenced until :meth:`wait` so the caching allocator cannot reuse
    their memory while the comm stream still uses it.
    """

    def __init__(
        self,
        op_name: str,
        event: Any,
        result: Optional[torch.Tensor],
        keep_alive: Sequence[torch.Tensor],
        check: Callable[[float], None],
        finish: Optional[Callable[[], None]] = None,
    ) -> None:
        super().__init__(op_name, result)
        self._event = event
        self._keep_alive = list(keep_alive)
        self._check = check
        self._finish = finish

    def wait(self, timeout: Optional[float] = None) -> bool:
        if timeout is not None:
            # An explicit timeout needs the host to watch the event: poll (never cudaEventSynchronize,
            # which cannot time out) and let check() abort the communicator at the deadline.
            deadline = time.monotonic() + timeout
            while not self._event.query():
                self._check(deadline)
                time.sleep(0.0005)
        # Order the current stream after the collective; no host synchronization. A hang is caught
        # by the engine's watchdog thread, which aborts the communicator after its timeout.
        torch.cuda.current_stream().wait_event(self._event)
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._keep_alive = []
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())


class ThenWork(Work):
    """A Work that runs ``after`` once ``inner`` finished (in the thread that waits).

    ``inner`` None means the data movement already finished. ``is_completed()`` is the inner
    operation's; ``after`` is local arithmetic or copies that :meth:`wait` runs once. The collectives'
    ``_then`` (and :func:`trainloom.comm.neighbor.then_work`) use it for CUDA operations; for CPU
    ones they run ``after`` on the communicator's worker instead (done when ``is_completed()`` says so).
    """

    def __init__(
        self, op_name: str, inner: Optional[Work], after: Optional[Callable[[], None]], result: Any
    ) -> None:
        super().__init__(op_name, result)
        self._inner = inner
        self._after = after

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._inner is not None:
            try:
                self._inner.wait(timeout)
            except BaseException:
                del self  # no reference cycle through the inner Work's stored exception
                raise
        if self._after is not None:
            after, self._after = self._after, None
            with torch.no_grad():
                after()
        return True

    def is_completed(self) -> bool:
        return True if self._inner is None else self._inner.is_completed()
