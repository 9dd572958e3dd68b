# cython: language_level=3, boundscheck=False, wraparound=False
"""Lock-free counter table shared by the processes of one CacheLoader (the process that made it and
the DataLoader workers forked or spawned from it).

The table is an int64 array of shape (2 + slots, width) in shared memory
(trainloom/data/shared_counters.py allocates it):

* row 0, the header: ``[GEN]`` counts finished retirements, ``[ACTIVE]`` the retirements running;
* row 1, the totals of retired processes: ``[0]`` how many, then their counters;
* rows 2..: one slot per live process: ``[0]`` its pid (0: free), then its counters.

A process increments only the counters of its own slot, with plain stores from Python (one writer
per slot). Claiming and freeing a slot are compare-and-swaps on the pid word. Retiring moves a
slot's counters into the totals; readers sum totals and live slots, and retry while a retirement
runs or one finished meanwhile (a sequence lock with many writers), so a process that exits while
another reads is counted once. Columns from ``ncounters`` on are gauges (values buffered now): they
are summed over live slots and not carried into the totals.
"""

from libc.stdint cimport int64_t

cdef extern from *:
    """
    #include <stdint.h>
    #include <sched.h>
    static inline int64_t tl_load(int64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
    static inline void tl_store(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
    static inline void tl_add(int64_t *p, int64_t v) { __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
    static inline int tl_cas(int64_t *p, int64_t expected, int64_t desired) {
        return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
    static inline void tl_yield(void) { sched_yield(); }
    """
    int64_t tl_load(int64_t *p) noexcept nogil
    void tl_store(int64_t *p, int64_t v) noexcept nogil
    void tl_add(int64_t *p, int64_t v) noexcept nogil
    int tl_cas(int64_t *p, int64_t expected, int64_t desired) noexcept nogil
    void tl_yield() noexcept nogil

#: Row and column positions (mirrored in shared_counters.py).
HEADER_ROWS = 2
DEF GEN = 0
DEF ACTIVE = 1
DEF TOTALS = 1
DEF FIRST_SLOT = 2
#: Reader attempts before it settles for a sum taken while a retirement ran (its process died).
DEF READ_ATTEMPTS = 100000


cdef inline void _check(int64_t[:, ::1] table, Py_ssize_t ncounters) except *:
    if table.shape[0] <= FIRST_SLOT or not 1 <= ncounters <= table.shape[1]:
        raise ValueError(f"bad counter table shape ({table.shape[0]}, {table.shape[1]}) for {ncounters} counters")


def claim(int64_t[:, ::1] table, int64_t pid, int64_t owner=0):
    """Take the first slot whose pid word is ``owner`` (0: a free slot) for ``pid``; -1 if none.

    With ``owner`` the pid of a dead process, the slot it left is taken over: its counters are moved
    into the totals first, as if it had retired. Returns the row index."""
    _check(table, 1)
    if pid <= 0:
        raise ValueError(f"pid must be > 0, got {pid}")
    cdef Py_ssize_t row
    for row in range(FIRST_SLOT, table.shape[0]):
        if tl_load(&table[row, 0]) == owner and tl_cas(&table[row, 0], owner, pid):
            if owner != 0:
                _move_to_totals(table, row, table.shape[1], True, False)
            return row
    return -1


cdef void _move_to_totals(
    int64_t[:, ::1] table, Py_ssize_t row, Py_ssize_t ncounters, bint gauges, bint free
) noexcept nogil:
    """Add a slot's counters to the totals and zero it (``free``: and release the slot), with
    readers told to retry meanwhile: a reader never sees the slot both live and in the totals."""
    cdef Py_ssize_t c
    tl_add(&table[0, ACTIVE], 1)
    for c in range(1, ncounters):
        tl_add(&table[TOTALS, c], tl_load(&table[row, c]))
        tl_store(&table[row, c], 0)
    if gauges:
        for c in range(ncounters, table.shape[1]):
            tl_store(&table[row, c], 0)
    tl_add(&table[TOTALS, 0], 1)
    if free:
        tl_store(&table[row, 0], 0)
    tl_add(&table[0, GEN], 1)
    tl_add(&table[0, ACTIVE], -1)


def retire(int64_t[:, ::1] table, Py_ssize_t row, int64_t pid, Py_ssize_t ncounters):
    """Move the counters of ``pid``'s slot ``row`` into the totals and free the slot.

    Returns False (and does nothing) when the slot is not ``pid``'s: a forked child running its
    parent's exit handlers, or a slot already retired."""
    _check(table, ncounters)
    if not FIRST_SLOT <= row < table.shape[0]:
        raise ValueError(f"row {row} is not a slot of a table of {table.shape[0]} rows")
    if tl_load(&table[row, 0]) != pid:
        return False
    _move_to_totals(table, row, ncounters, True, True)
    return True


def total(int64_t[:, ::1] table, Py_ssize_t ncounters):
    """(sums of every column, processes counted, consistent): totals plus live slots.

    Column 0 of the result is unused. ``consistent`` is False only when a retirement kept running
    for every attempt (its process died inside it): the sum may then count one process twice."""
    _check(table, ncounters)
    cdef Py_ssize_t width = table.shape[1], row, c, attempt
    cdef int64_t gen0, live = 0
    cdef bint last
    cdef list sums = [0] * width
    for attempt in range(READ_ATTEMPTS):
        last = attempt == READ_ATTEMPTS - 1
        gen0 = tl_load(&table[0, GEN])
        if tl_load(&table[0, ACTIVE]) != 0 and not last:
            tl_yield()
            continue
        for c in range(width):
            sums[c] = tl_load(&table[TOTALS, c]) if c < ncounters else 0
        live = 0
        for row in range(FIRST_SLOT, table.shape[0]):
            if tl_load(&table[row, 0]) != 0:
                live += 1
                for c in range(1, width):
                    sums[c] += tl_load(&table[row, c])
        if tl_load(&table[0, ACTIVE]) == 0 and tl_load(&table[0, GEN]) == gen0:
            return sums, sums[0] + live, True
        if not last:
            tl_yield()
    return sums, sums[0] + live, False
