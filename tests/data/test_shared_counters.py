"""SharedCounters: one counter table for a CacheLoader and the processes it reaches (real processes)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import time

import numpy as np
import pytest

from trainloom.data import _counters
from trainloom.data.shared_counters import SharedCounters, _alive

NAMES = ("hits", "misses")
GAUGES = ("buffered",)
FORK = mp.get_context("fork")


def _count(counters: SharedCounters, hits: int, misses: int, buffered: int = 0) -> None:
    counters.after_fork()
    counters.values[counters.column("hits")] += hits
    counters.values[counters.column("misses")] += misses
    if counters.gauges:
        counters.values[counters.column("buffered")] = buffered


def _run(target, *args) -> int:
    p = FORK.Process(target=target, args=args)
    p.start()
    p.join(30)
    return p.exitcode


def test_counts_of_exited_and_live_processes_are_summed():
    c = SharedCounters(NAMES, GAUGES)
    _count(c, 1, 2, buffered=7)
    assert all(_run(_count, c, 10 * i, i, 5) == 0 for i in range(1, 4))
    # The exited children's counters moved to the totals; their gauges (buffered) did not.
    assert c.total() == ({"hits": 61, "misses": 8, "buffered": 7}, 4)
    assert c.local() == {"hits": 1, "misses": 2, "buffered": 7}
    c.retire()
    assert c.total() == ({"hits": 1 + 60, "misses": 8, "buffered": 0}, 4)


def _exit_like_a_forked_script(counters: SharedCounters, q) -> None:
    # os.fork() children (not multiprocessing's) inherit the parent's exit handlers and run them at
    # exit; the parent's retire must not run for the parent's slot there.
    mp.util._exit_function()
    q.put(int(counters._table[counters._row, 0]) == os.getppid())


def test_a_forked_child_does_not_retire_its_parents_slot():
    c = SharedCounters(NAMES)
    c.values[c.column("hits")] += 3
    q = FORK.SimpleQueue()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _exit_like_a_forked_script(c, q)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert q.get() is True
    c.values[c.column("hits")] += 1  # still this process's slot: counted once
    assert c.total() == ({"hits": 4, "misses": 0}, 1)


def test_full_table_counts_locally_with_one_warning(caplog):
    c = SharedCounters(NAMES, slots=1)
    q = FORK.SimpleQueue()

    def child() -> None:
        with caplog.at_level(logging.WARNING, logger="trainloom.data.shared_counters"):
            _count(c, 5, 0)
        q.put((c.total(), [r.getMessage() for r in caplog.records], os.getpid()))

    assert _run(child) == 0
    (total, processes), messages, pid = q.get()
    assert messages == [
        f"the cache counter table is full (1 processes count at once): process {pid} counts only for "
        "itself (stats() in other processes miss its counts)"
    ]
    assert (total, processes) == ({"hits": 5, "misses": 0}, 2)  # its own counts plus the parent's slot
    assert c.total() == ({"hits": 0, "misses": 0}, 1)


def _count_and_hang(counters: SharedCounters, ready) -> None:
    _count(counters, 9, 1)
    ready.set()
    signal.pause()


def test_a_killed_process_keeps_its_counts_and_its_slot_is_taken_over():
    c = SharedCounters(NAMES, slots=2)
    ready = FORK.Event()
    p = FORK.Process(target=_count_and_hang, args=(c, ready))
    p.start()
    assert ready.wait(30)
    os.kill(p.pid, signal.SIGKILL)  # no exit handler runs: the slot stays claimed
    p.join(30)
    assert c.total() == ({"hits": 9, "misses": 1}, 2)
    # The table is full (parent + dead child): the next process takes over the dead one's slot.
    assert _run(_count, c, 100, 0) == 0
    assert c.total() == ({"hits": 109, "misses": 1}, 3)
    assert _counters.total(c._table, c.ncounters)[0][0] == 2  # the dead child and the last one retired


def _count_many(counters: SharedCounters, n: int) -> None:
    counters.after_fork()
    col = counters.column("hits")
    for _ in range(n):
        counters.values[col] += 1


def test_sums_stay_exact_and_monotonic_while_processes_retire():
    # A sanity check across real processes; the retry protocol itself is pinned by the next test.
    c = SharedCounters(NAMES)
    procs = [FORK.Process(target=_count_many, args=(c, 2000)) for _ in range(4)]
    for p in procs:
        p.start()
    seen = []
    while any(p.is_alive() for p in procs):
        seen.append(c.total()[0]["hits"])
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    seen.append(c.total()[0]["hits"])
    assert seen[-1] == 8000
    assert all(a <= b for a, b in zip(seen, seen[1:])), "a sum went down: a retirement was missed"
    assert max(seen) == 8000, "a sum went over the final count: a retirement was counted twice"


def test_a_reader_does_not_trust_a_sum_taken_during_a_retirement(caplog):
    c = SharedCounters(NAMES)
    c.values[c.column("hits")] += 4
    c._table[0, 1] = 1  # a retirement running (its process died inside it): the reader retries
    with caplog.at_level(logging.WARNING, logger="trainloom.data.shared_counters"):
        assert c.total() == ({"hits": 4, "misses": 0}, 1)
        assert c.total() == ({"hits": 4, "misses": 0}, 1)  # warned once
    assert [r.getMessage() for r in caplog.records] == [
        "a process died while retiring its cache counters: stats() may count it twice"
    ]
    c._table[0, 1] = 0
    assert _counters.total(c._table, c.ncounters)[2] is True


def test_a_plain_pickle_counts_on_its_own():
    c = SharedCounters(NAMES, GAUGES, slots=3)
    c.values[c.column("hits")] += 2
    copy = pickle.loads(pickle.dumps(c))
    copy.values[copy.column("hits")] += 5
    assert c.total()[0]["hits"] == 2 and copy.total()[0]["hits"] == 5
    assert copy._table.shape == c._table.shape


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"^slots must be an int >= 1, got 0$"):
        SharedCounters(NAMES, slots=0)
    with pytest.raises(ValueError, match=r"^at most 15 counters and gauges, got 16$"):
        SharedCounters([f"c{i}" for i in range(16)])
    table = np.zeros((3, 4), dtype=np.int64)
    with pytest.raises(ValueError, match=r"^pid must be > 0, got 0$"):
        _counters.claim(table, 0)
    with pytest.raises(ValueError, match=r"^bad counter table shape \(2, 4\) for 1 counters$"):
        _counters.claim(np.zeros((2, 4), dtype=np.int64), 1)
    with pytest.raises(ValueError, match=r"^row 1 is not a slot of a table of 3 rows$"):
        _counters.retire(table, 1, 5, 2)
    assert _counters.claim(table, 5) == 2 and _counters.claim(table, 6) == -1
    assert _counters.retire(table, 2, 6, 2) is False  # not 6's slot: nothing moves
    assert _counters.retire(table, 2, 5, 2) is True and table[2, 0] == 0 and table[1, 0] == 1


def _count_later(counters: SharedCounters, go) -> None:
    go.wait(30)
    _count(counters, 7, 7, buffered=7)


def test_a_child_counting_after_the_parent_dropped_the_table_writes_only_its_own_memory():
    # The table was a block of multiprocessing's shared heap: a parent that dropped it reused the
    # block for its next shared array, and a forked child still counting wrote into that array.
    import ctypes
    import gc

    c = SharedCounters(NAMES, GAUGES)
    go = FORK.Event()
    p = FORK.Process(target=_count_later, args=(c, go))
    p.start()
    del c
    gc.collect()
    mine = mp.RawArray(ctypes.c_int64, 130 * 16)  # the parent's next shared allocation
    fresh = SharedCounters(NAMES, GAUGES)
    go.set()
    p.join(30)
    assert p.exitcode == 0
    assert not any(np.frombuffer(mine, dtype=np.int64))
    assert fresh.total() == ({"hits": 0, "misses": 0, "buffered": 0}, 1)


def _count_buffer_and_hang(counters: SharedCounters, ready) -> None:
    _count(counters, 9, 1, buffered=5)
    ready.set()
    signal.pause()


def test_gauges_of_a_killed_process_stop_counting_its_counters_stay():
    """A SIGKILLed DataLoader worker's 'buffered' gauge (values it held, now lost) was summed into
    stats() forever, so polling for buffered == 0 never ended. Also while the killed process is a
    zombie (not reaped yet)."""
    c = SharedCounters(NAMES, GAUGES, slots=4)
    c.values[c.column("buffered")] = 2
    for reaped, want in ((True, ({"hits": 9, "misses": 1, "buffered": 2}, 2)), (False, None)):
        ready = FORK.Event()
        p = FORK.Process(target=_count_buffer_and_hang, args=(c, ready))
        p.start()
        assert ready.wait(30)
        before, n = c.total()
        assert before["buffered"] == 7
        os.kill(p.pid, signal.SIGKILL)
        if reaped:
            p.join(30)
        else:  # wait until it is a zombie: killed, not yet reaped by join()
            deadline = time.monotonic() + 30
            while _alive(p.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            want = ({"hits": 18, "misses": 2, "buffered": 2}, 3)
        assert c.total() == want
        p.join(30)
