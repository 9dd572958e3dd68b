"""Counters of one CacheLoader summed over every process that uses it.

A CacheLoader made in the main process is forked or pickled (spawn, forkserver) into its DataLoader
workers; each worker reads and writes the cache in its own process. :class:`SharedCounters` keeps one
table in shared memory for the loader and all its copies, so ``stats()`` in the main process counts
the hits its workers served (and workers that already exited). The table logic (claiming a slot,
retiring it at exit, consistent sums) is compiled: trainloom/data/_counters.pyx.

A process's own counters are a ``memoryview`` of its slot: incrementing one costs what a dict entry
does, and there is nothing to publish. A copy made by plain pickling (not while spawning a process)
starts a table of its own, as the shared memory cannot travel through a pickle.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing.context
import multiprocessing.reduction
import multiprocessing.util
import os
import tempfile
from typing import Any, Dict, Optional, Sequence, Tuple

from trainloom._build_check import import_compiled

_counters = import_compiled("trainloom.data._counters")

log = logging.getLogger(__name__)

#: Processes that can count at once; more fall back to counting for themselves (one warning).
DEFAULT_SLOTS = 128
#: int64 columns per row: the pid word, then the counters and gauges.
WIDTH = 16


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has the pid: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (not Linux), or it exited meanwhile
        return True


def _shared_fd(size: int) -> int:
    """A descriptor of ``size`` zeroed bytes of shared memory that has no name in any directory."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("trainloom-cache-counters", os.MFD_CLOEXEC)
    else:  # pragma: no cover - Linux has memfd_create; other POSIX systems: an unlinked file
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="trainloom-counters-", dir=where)
        os.unlink(name)
    os.ftruncate(fd, size)
    return fd


class SharedCounters:
    """Named int64 counters (then gauges) of one process, summed over a family of processes.

    Args:
        names: the counters, in column order (carried into the totals when a process exits).
        gauges: values that describe a process's present state (summed over live processes only).
        slots: how many processes can count at once.
    """

    def __init__(self, names: Sequence[str], gauges: Sequence[str] = (), slots: int = DEFAULT_SLOTS) -> None:
        self.names = tuple(names)
        self.gauges = tuple(gauges)
        self.ncounters = 1 + len(self.names)  # column 0 is the pid / retired-process count
        if self.ncounters + len(self.gauges) > WIDTH:
            n = len(self.names) + len(self.gauges)
            raise ValueError(f"at most {WIDTH - 1} counters and gauges, got {n}")
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self._fd = _shared_fd((_counters.HEADER_ROWS + slots) * WIDTH * 8)
        self._map()
        self._attach()

    def _map(self) -> None:
        # A mapping of its own, not a block of multiprocessing's shared heap: a parent that drops
        # the table frees a heap block and reuses it for its next shared array, while a forked
        # child still writes its counters there. A mapping stays valid in each process holding it.
        self._raw = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        multiprocessing.util.Finalize(self, os.close, args=(self._fd,))

    def _attach(self) -> None:
        """Take a slot of the table for this process (fresh, forked or unpickled)."""
        import numpy as np

        self._table = np.frombuffer(self._raw, dtype=np.int64).reshape(-1, WIDTH)
        self._pid = os.getpid()
        self._warned_inconsistent = False
        row = _counters.claim(self._table, self._pid)
        if row < 0:
            row = self._take_dead_slot()
        self._finalizer: Optional[multiprocessing.util.Finalize] = None
        if row < 0:
            log.warning(
                "the cache counter table is full (%d processes count at once): process %d counts only for "
                "itself (stats() in other processes miss its counts)",
                self._table.shape[0] - _counters.HEADER_ROWS,
                self._pid,
            )
            self._row = -1
            self.values = memoryview(bytearray(WIDTH * 8)).cast("q")
            return
        self._row = row
        offset = row * WIDTH * 8
        self.values = memoryview(self._raw).cast("B")[offset : offset + WIDTH * 8].cast("q")
        # Runs at exit in the main process and in every multiprocessing worker (exitpriority), after
        # the CacheLoader's own flush handler (priority 10), and when this object is collected; never
        # in a forked child that inherited it (Finalize checks the pid).
        self._finalizer = multiprocessing.util.Finalize(
            self, _counters.retire, args=(self._table, row, self._pid, self.ncounters), exitpriority=5
        )

    def _take_dead_slot(self) -> int:
        for pid in self._table[_counters.HEADER_ROWS :, 0].tolist():
            if pid > 0 and pid != self._pid and not _alive(pid):
                row = _counters.claim(self._table, self._pid, pid)
                if row >= 0:
                    return row
        return -1

    def _retire_dead(self) -> None:
        first = _counters.HEADER_ROWS
        for i, pid in enumerate(self._table[first:, 0].tolist()):
            if pid > 0 and pid != self._pid and not _alive(pid):
                _counters.retire(self._table, first + i, pid, self.ncounters)  # no-op if taken meanwhile

    def retire(self) -> None:
        """Move this process's counts into the totals now (they stay counted; the slot is freed)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def column(self, name: str) -> int:
        """The index into :attr:`values` of a counter or gauge."""
        if name in self.names:
            return 1 + self.names.index(name)
        return self.ncounters + self.gauges.index(name)

    def local(self) -> Dict[str, int]:
        """This process's counters and gauges."""
        v = self.values.tolist()
        out = {n: v[1 + i] for i, n in enumerate(self.names)}
        out.update({n: v[self.ncounters + i] for i, n in enumerate(self.gauges)})
        return out

    def total(self) -> Tuple[Dict[str, int], int]:
        """(counters and gauges summed over every process of the family, processes counted).

        Processes that exited are counted with their final values; a process that could not get a
        slot is counted only by itself. The slot of a process that died without retiring (SIGKILL)
        is retired here: its counters stay counted, its gauges (values it held) no longer are."""
        self._retire_dead()
        sums, processes, consistent = _counters.total(self._table, self.ncounters)
        if not consistent and not self._warned_inconsistent:
            self._warned_inconsistent = True
            log.warning("a process died while retiring its cache counters: stats() may count it twice")
        out = {n: sums[1 + i] for i, n in enumerate(self.names)}
        out.update({n: sums[self.ncounters + i] for i, n in enumerate(self.gauges)})
        if self._row < 0:
            for n, v in self.local().items():
                out[n] += v
            processes += 1
        return out, processes

    def __getstate__(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"names": self.names, "gauges": self.gauges}
        if multiprocessing.context.get_spawning_popen() is not None:
            state["fd"] = multiprocessing.reduction.DupFd(self._fd)  # shared with the process being spawned
        else:
            state["slots"] = self._table.shape[0] - _counters.HEADER_ROWS
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "fd" in state:
            self.names, self.gauges = state["names"], state["gauges"]
            self.ncounters = 1 + len(self.names)
            self._fd = state["fd"].detach()
            self._map()
            self._attach()
        else:  # a plain pickle: the copy counts on its own
            self.__init__(state["names"], state["gauges"], state["slots"])  # type: ignore[misc]

    def after_fork(self) -> None:
        """In a forked child: take a slot of its own in the inherited table."""
        if self._pid != os.getpid():
            self._attach()
