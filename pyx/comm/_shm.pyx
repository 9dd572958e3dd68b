# cython: language_level=3
"""Shared-memory collective engine for CPU tensors of ranks on one node (compiled core).

Only ints reach this module (``data_ptr()`` values, element counts, dtype/op codes, byte sizes);
trainloom/comm/shm.py validates tensors and arguments first and formats the errors. Every method
that waits releases the GIL and returns a status code (0 = done); on failure the details are read
back with :meth:`Engine.error_info`.

Protocol in one paragraph. Each rank owns a control block (an ``arrive`` step counter and a
``sleepers`` count, each on its own cache line, plus two op descriptors) and three slots of
``slot_bytes``. A *step* is: write my data into my slot, publish ``arrive = s``, wait until every
peer's ``arrive >= s``, then read the peers' slots. Every op's first step also carries the op
descriptor, which every rank compares with every other rank's, so a size/dtype/op mismatch is seen
(and raised) by all ranks at the same step. Slots rotate per use: a slot is written again only three
uses later, by which time the full barriers of the steps in between guarantee that every reader is
done with it. Send/recv use separate per-pair channels with their own counters.
"""

cimport cython
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memset
from libc.errno cimport errno, ESRCH
from libc.limits cimport INT_MAX
from posix.mman cimport mmap, munmap, shm_open, shm_unlink, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED
from posix.fcntl cimport O_CREAT, O_EXCL, O_RDWR
from posix.unistd cimport ftruncate, close as c_close, getpid
from posix.stat cimport struct_stat, fstat
from cpython.exc cimport PyErr_CheckSignals

import time as _time

from trainloom.errors import CommError


cdef extern from "<fcntl.h>" nogil:
    int posix_fallocate(int fd, long offset, long length)

cdef extern from "<string.h>" nogil:
    char* strerror(int errnum)


cdef extern from "_shm_kernels.h" nogil:
    enum: TL_MAGIC
    enum: TL_VERSION
    enum: TL_MAXDIM
    ctypedef struct tl_line_t:
        uint32_t v
    ctypedef struct tl_desc_t:
        int64_t opkind
        int64_t seq
        int64_t dtype
        int64_t redop
        int64_t root
        int64_t numel
        int64_t extra
        int64_t ndim
        int64_t shape[8]
        int64_t zc
        int64_t addr
        int64_t addr2
    ctypedef struct tl_hdr_t:
        uint64_t magic
        uint32_t version
        uint32_t world
        uint64_t generation
        uint64_t slot_bytes
        uint64_t pair_bytes
        uint64_t heap_bytes
        uint64_t total_bytes
        tl_line_t attached
        tl_line_t abort_word
    ctypedef struct tl_rank_t:
        tl_line_t arrive
        tl_line_t sleepers
        int32_t pid
        int32_t closed
        tl_desc_t desc[2]
    ctypedef struct tl_pair_t:
        tl_line_t sent
        tl_line_t sent_sleepers
        tl_line_t ack
        tl_line_t ack_sleepers
        tl_desc_t hdr[2]
        tl_desc_t poison
    ctypedef void (*tl_reduce_fn)(void*, const void* const*, int, size_t, int)
    uint32_t tl_load(const uint32_t* p)
    void tl_store(uint32_t* p, uint32_t v)
    uint32_t tl_add(uint32_t* p, uint32_t v)
    uint32_t tl_sub(uint32_t* p, uint32_t v)
    uint32_t tl_cas(uint32_t* p, uint32_t expected, uint32_t desired)
    void tl_fence()
    void tl_copy_nt(void* dst, const void* src, size_t n)
    void tl_copy2_nt(void* dst, void* dst_nt, const void* src, size_t n)
    int tl_reached(uint32_t a, uint32_t b)
    void tl_pause()
    double tl_now()
    int tl_futex_wait(uint32_t* addr, uint32_t val, double timeout_s)
    int tl_futex_wake(uint32_t* addr, int n)
    int tl_pid_dead(int pid)
    tl_reduce_fn tl_pick_reduce(int dt, int op)
    int tl_cma_read(int pid, void* dst, const void* remote, size_t n)


cdef extern from "<sys/prctl.h>" nogil:
    int prctl(int option, unsigned long arg2, unsigned long arg3, unsigned long arg4, unsigned long arg5)


# Status codes returned by the nogil cores (0 = success). shm.py maps them to exceptions.
ERR_TIMEOUT = 1
ERR_ABORT = 2
ERR_DEAD = 3
ERR_CLOSED = 4
ERR_MISMATCH = 5
ERR_POISON = 6
ERR_LOCAL_CLOSE = 7
ERR_COUNTS = 8
ERR_INTERRUPTED = 9
ERR_CMA = 10

cdef enum:
    E_TIMEOUT = 1
    E_ABORT = 2
    E_DEAD = 3
    E_CLOSED = 4
    E_MISMATCH = 5
    E_POISON = 6
    E_LOCAL_CLOSE = 7
    E_COUNTS = 8
    E_INTERRUPTED = 9
    E_CMA = 10

# Abort reasons stored in the high half of the abort word.
cdef enum:
    A_USER = 1
    A_TIMEOUT = 2
    A_DEAD = 3
    A_INTERRUPTED = 4
    A_CMA = 5
    A_BUSY = 6  # a call started while another ran on another thread (see Engine._check_usable)
    K_SEND = 11
ABORT_USER = A_USER
ABORT_TIMEOUT = A_TIMEOUT
ABORT_DEAD = A_DEAD
ABORT_INTERRUPTED = A_INTERRUPTED
ABORT_CMA = A_CMA
ABORT_BUSY = A_BUSY

# An exception raised by a Python signal handler (Ctrl-C) during a wait, re-raised by the engine
# method once the wait has unwound. One per process is enough: only the main thread runs signal
# handlers (PyErr_CheckSignals does nothing on other threads), and it waits in one call at a time.
_pending_exc = None


cdef int _signals_pending() noexcept with gil:
    # Lets Ctrl-C (SIGINT -> KeyboardInterrupt) and other Python signal handlers run while a rank
    # sleeps in a long wait (the default deadline is minutes) instead of only after it.
    global _pending_exc
    try:
        PyErr_CheckSignals()
    except BaseException as exc:
        _pending_exc = exc
        return 1
    return 0

# Op kinds carried in descriptors (also used in messages by shm.py).
OP_ALLREDUCE = 1
OP_REDUCE = 2
OP_BROADCAST = 3
OP_ALLGATHER = 4
OP_GATHER = 5
OP_SCATTER = 6
OP_REDUCE_SCATTER = 7
OP_ALLTOALL = 8
OP_ALLTOALL_V = 9
OP_BARRIER = 10
OP_SEND = 11

# How often a waiter that already sleeps checks that the ranks it waits for are still alive, and
# the longest single futex sleep (also bounds how late an abort without a wake-up is noticed).
# 0.2 s keeps the /proc reads negligible while a dead peer is still reported well within 2 s.
cdef double PID_CHECK_FIRST = 0.05
cdef double PID_CHECK_EVERY = 0.2
cdef double MAX_SLEEP = 0.05


# Slots per rank, used round-robin ("use" u goes to slot u % NSLOTS). Two would do for ops with one
# step per chunk; the pipelined two-shot allreduce reads chunk k's slot one step later than it was
# written (its gather overlaps chunk k+1's reduce), so a slot may be rewritten only three uses later.
cdef enum:
    NSLOTS = 3


cdef inline size_t _round_up(size_t x, size_t a) noexcept nogil:
    return (x + a - 1) // a * a


cdef inline size_t _at_most(size_t x, size_t c) noexcept nogil:
    """min(x, c): part p of a two-shot chunk of c elements is [min(p*pl, c), min(p*pl + pl, c))."""
    return x if x < c else c


cdef struct State:
    char* base
    size_t total
    int rank
    int world
    tl_hdr_t* hdr
    tl_rank_t* ranks
    tl_pair_t* pairs
    char* slots
    char* pslots
    char* heap
    size_t S          # bytes per slot (each rank has two)
    size_t P          # bytes per p2p pair buffer (each ordered pair has two)
    size_t H          # bytes of zero-copy heap per rank
    uint32_t step     # last step this rank published
    uint64_t nbuf     # slot uses so far (the slot of a use is nbuf & 1); identical on all ranks
    uint32_t* p2p_sent   # per destination: chunks sent so far
    uint32_t* p2p_recv   # per source: chunks received so far
    char* check_pid      # per rank: 1 if its pid is visible from here (same pid namespace)
    char* missing        # per rank: filled on timeout
    double spin_s     # longest spin before sleeping in futex (configured ceiling)
    double spin_cur   # current adaptive spin budget, between 0 and spin_s
    uint64_t n_waits      # statistics: waits that found the counter not yet there
    uint64_t n_spun       # ... satisfied while spinning
    uint64_t n_sleeps     # futex sleeps
    double t_waited       # seconds spent in waits that did not succeed at once
    int local_closing # set by close() from another thread: waiters give up
    int cma           # 1: every rank agreed (probe at creation) that peers may read its memory
    size_t cma_bytes  # smallest per-peer message (bytes) that goes by cross-memory attach
    uint64_t probe    # a word peers read with process_vm_readv at creation (the probe)
    int err_errno     # errno of a failed cross-memory read (E_CMA)
    size_t big_bytes  # an op whose recv buffers (summed over ranks) reach this is memory-bound
                      # (outgrows the shared L3): slot path, streaming stores into recv, no CMA
    # error details
    int err_peer
    uint32_t err_target
    int err_rank      # mismatching rank (E_MISMATCH) / first inconsistent pair (E_COUNTS)
    int err_rank2
    int err_parity
    int64_t err_v1
    int64_t err_v2


cdef inline char* _slot(State* st, int r, uint64_t use) noexcept nogil:
    return st.slots + (<size_t>r * NSLOTS + <size_t>(use % NSLOTS)) * st.S


cdef inline char* _pslot(State* st, int src, int dst, uint32_t chunk) noexcept nogil:
    return st.pslots + ((<size_t>src * st.world + <size_t>dst) * 2 + <size_t>(chunk & 1)) * st.P


cdef inline tl_pair_t* _pair(State* st, int src, int dst) noexcept nogil:
    return &st.pairs[<size_t>src * st.world + <size_t>dst]


cdef int _wait_word(State* st, uint32_t* word, uint32_t* sleepers, uint32_t target, int peer,
                    double deadline, int64_t* poison, int* err_peer) noexcept nogil:
    """Wait until *word >= target (wrap-safe): spin briefly, then sleep in futex. On failure the
    peer waited for goes to *err_peer: collectives pass &st.err_peer (read by error_info()); a send
    or receive passes a local, because it may run on another thread beside a collective, whose
    error details it must not overwrite (shm.py names a send's or receive's peer itself).

    Spinning only pays while the peer is running on another core; when ranks outnumber cores a
    spinning waiter steals the very core the peer needs (FINDINGS: spin+sched_yield fell to gloo
    speed with 4 ranks on 2 cores), so the spin is bounded by time (spin_s) and then we sleep.
    """
    cdef double t0, t, next_check, nap, lim
    cdef uint32_t v
    cdef int i = 0
    if tl_reached(tl_load(word), target):
        return 0
    t0 = tl_now()
    st.n_waits += 1
    lim = st.spin_cur
    if lim > 0:
        while True:
            for i in range(16):
                if tl_reached(tl_load(word), target):
                    # the spin paid off: allow a longer one next time (up to the ceiling)
                    lim = lim * 2
                    st.spin_cur = lim if lim < st.spin_s else st.spin_s
                    st.n_spun += 1
                    st.t_waited += tl_now() - t0
                    return 0
                tl_pause()
            if tl_now() - t0 > lim:
                break
        # The peer did not come in time: it is probably not running (more ranks than free
        # cores, or a loaded machine), and spinning only delays it. Halve the budget.
        st.spin_cur = lim * 0.5 if lim > 0.5e-6 else 0.0
    t = tl_now()
    next_check = t + PID_CHECK_FIRST
    while True:
        v = tl_load(word)
        if tl_reached(v, target):
            # Woken quickly: a spin of this length would have caught it, so probe spinning again
            # (lets the budget recover once the machine or the peer is fast again).
            t = tl_now()
            st.t_waited += t - t0
            if st.spin_s > 0 and t - t0 < st.spin_s:
                lim = st.spin_cur * 2 if st.spin_cur >= 0.5e-6 else 1e-6
                st.spin_cur = lim if lim < st.spin_s else st.spin_s
            return 0
        if tl_load(&st.hdr.abort_word.v) != 0:
            err_peer[0] = peer
            return E_ABORT
        if poison != NULL and poison[0] != 0:
            err_peer[0] = peer
            return E_POISON
        if st.local_closing:
            return E_LOCAL_CLOSE
        t = tl_now()
        if t >= deadline:
            err_peer[0] = peer
            return E_TIMEOUT
        if t >= next_check:
            if _signals_pending():
                return E_INTERRUPTED
            if st.ranks[peer].closed:
                err_peer[0] = peer
                return E_CLOSED
            if st.check_pid[peer] and tl_pid_dead(st.ranks[peer].pid):
                # one more look: the peer may have published just before exiting
                if tl_reached(tl_load(word), target):
                    return 0
                err_peer[0] = peer
                return E_DEAD
            next_check = t + PID_CHECK_EVERY
        nap = deadline - t
        if next_check - t < nap:
            nap = next_check - t
        if nap > MAX_SLEEP:
            nap = MAX_SLEEP
        # Announce the sleep before the final check: the publisher stores the counter and then
        # reads `sleepers` (both seq_cst), so either it sees us and wakes us, or we see its value
        # here / the kernel sees it changed and FUTEX_WAIT returns EAGAIN at once.
        tl_add(sleepers, 1)
        v = tl_load(word)
        if not tl_reached(v, target):
            st.n_sleeps += 1
            tl_futex_wait(word, v, nap)
        tl_sub(sleepers, 1)


cdef inline void _publish(uint32_t* word, uint32_t* sleepers, uint32_t value) noexcept nogil:
    tl_store(word, value)
    # Wake only when someone sleeps: the syscall costs ~1 us, as much as a whole small allreduce.
    if tl_load(sleepers) != 0:
        tl_futex_wake(word, INT_MAX)


cdef int _step(State* st, double deadline) noexcept nogil:
    """Publish the next step and wait for every peer to publish it too (a full barrier)."""
    cdef uint32_t s = st.step + 1
    cdef int p, rc
    cdef tl_rank_t* me = &st.ranks[st.rank]
    if tl_load(&st.hdr.abort_word.v) != 0:
        # aborted communicators fail every op at once, also when peers would still answer
        return E_ABORT
    st.step = s
    _publish(&me.arrive.v, &me.sleepers.v, s)
    for p in range(st.world):
        if p == st.rank:
            continue
        rc = _wait_word(st, &st.ranks[p].arrive.v, &st.ranks[p].sleepers.v, s, p, deadline, NULL,
                        &st.err_peer)
        if rc != 0:
            st.err_target = s
            for p in range(st.world):
                st.missing[p] = 0 if tl_reached(tl_load(&st.ranks[p].arrive.v), s) else 1
            return rc
    return 0


cdef inline void _put_desc(State* st, const tl_desc_t* d) noexcept nogil:
    # the descriptor travels with the step about to be published (st.step + 1)
    memcpy(&st.ranks[st.rank].desc[(st.step + 1) & 1], d, sizeof(tl_desc_t))


cdef int _check_desc(State* st) noexcept nogil:
    """After the first step of an op: E_MISMATCH if any rank's descriptor differs from ours.

    Every rank compares the same set of descriptors, so either all ranks fail here or none.
    """
    cdef int par = st.step & 1
    cdef const tl_desc_t* mine = &st.ranks[st.rank].desc[par]
    cdef const tl_desc_t* o
    cdef int p
    for p in range(st.world):
        o = &st.ranks[p].desc[par]
        if (o.opkind != mine.opkind or o.dtype != mine.dtype or o.redop != mine.redop
                or o.root != mine.root or o.numel != mine.numel or o.extra != mine.extra):
            st.err_rank = p
            st.err_parity = par
            return E_MISMATCH
    return 0


cdef int _first_step(State* st, const tl_desc_t* d, double deadline) noexcept nogil:
    cdef int rc
    _put_desc(st, d)
    rc = _step(st, deadline)
    if rc != 0:
        return rc
    return _check_desc(st)


cdef int _cma(State* st, int p, void* dst, int64_t remote, size_t n) noexcept nogil:
    """Copy n bytes from address `remote` of rank p's process into dst (cross-memory attach).

    Rank p is parked in the op's completion barrier while we read, so the range stays valid; a
    peer that died meanwhile gives ESRCH (its memory is gone): reported like any dead peer.
    """
    cdef int e
    if n == 0:
        return 0
    e = tl_cma_read(st.ranks[p].pid, dst, <const void*><uintptr_t>remote, n)
    if e == 0:
        return 0
    st.err_peer = p
    st.err_errno = e
    if e == ESRCH or (st.check_pid[p] and tl_pid_dead(st.ranks[p].pid)):
        return E_DEAD
    return E_CMA


cdef inline void _out(int nt, void* d, const void* s, size_t n) noexcept nogil:
    # a copy into the user's recv buffer: streaming stores for large ops (see tl_copy_nt)
    if nt:
        tl_copy_nt(d, s, n)
    else:
        memcpy(d, s, n)


cdef inline int _cma_all_serve(State* st) noexcept nogil:
    # after an op's first step: 1 if every rank published a readable buffer (addr != -1)
    cdef int par = st.step & 1, p
    for p in range(st.world):
        if st.ranks[p].desc[par].addr == -1:
            return 0
    return 1


# ----------------------------------------------------------------------------------------------
# Collective algorithms. All run without the GIL on raw pointers validated by shm.py.
# ----------------------------------------------------------------------------------------------

cdef inline char* _csrc(State* st, int p, const int64_t* zp, uint64_t use, size_t byte_off) noexcept nogil:
    # where rank p's data for a chunk lives: its heap tensor (zero-copy) or its slot for that use
    if zp[p] >= 0:
        return st.heap + <size_t>p * st.H + <size_t>zp[p] + byte_off
    return _slot(st, p, use)


cdef int _allreduce(State* st, const tl_desc_t* d, const char* send, char* recv, size_t n, size_t esz,
                    tl_reduce_fn fn, int div, int dst, size_t small_bytes, int64_t zc_off,
                    double deadline) noexcept nogil:
    """Allreduce (dst < 0) or reduce to dst.

    Small (n * esz <= small_bytes): one-shot, one barrier: every rank copies its vector into its
    slot and every (receiving) rank reduces all slots in rank order. Large: per chunk of one slot,
    two-shot: after a barrier rank r reduces part r of the chunk over all slots (rank order) into
    its own slot, and after the next barrier everyone copies every part out. The part a rank
    reduces is read by no one else during the reduce phase, so reducing in place is safe. The
    gather of chunk j-1 shares its barrier with the reduce of chunk j (one barrier per chunk).

    Zero-copy (zc_off >= 0: send is recv and lives at that offset of this rank's heap): no copy-in,
    peers read the chunk straight from the heap, the reduced part is written back in place, and a
    final barrier keeps the tensor untouched until every peer has gathered from it. Ranks decide
    this independently; readers learn each rank's choice from the descriptors of the first step.
    """
    cdef int W = st.world, me = st.rank, p, rc
    cdef size_t nbytes = n * esz, off = 0, c, pl, lo, hi, chunk_elems, align, nchunks, j
    cdef const void* srcs[256]
    cdef const void** sp = srcs
    cdef uint64_t use
    cdef char* mys
    cdef int64_t zcs[256]
    cdef int64_t* zp = zcs
    cdef int any_zc = 0, par
    cdef tl_desc_t dz
    # non-zero-copy allreduce (or reduce on its destination): my part is reduced into recv directly
    cdef int direct = zc_off < 0 and (dst < 0 or dst == me)
    cdef size_t k, m, sub = 16384 // esz if esz <= 16384 else 1
    if W > 256:
        sp = <const void**>calloc(W, sizeof(void*))
    if nbytes <= small_bytes:
        use = st.nbuf
        st.nbuf += 1
        if nbytes:
            memcpy(_slot(st, me, use), send, nbytes)
        rc = _first_step(st, d, deadline)
        if rc == 0 and nbytes and (dst < 0 or dst == me):
            for p in range(W):
                sp[p] = _slot(st, p, use)
            fn(recv, sp, W, n, div)
        if sp != srcs:
            free(sp)
        return rc
    chunk_elems = st.S // esz
    # parts start on cache-line boundaries so two reducers never write the same line
    align = 64 // esz if esz < 64 else 1
    nchunks = (n + chunk_elems - 1) // chunk_elems
    # Pipelined two-shot, one barrier per chunk (plus one): after the barrier that follows the
    # copy-in of chunk j, every rank gathers the reduced parts of chunk j-1 and reduces its part of
    # chunk j; then it copies in chunk j+1 and publishes the next step.
    rc = 0
    use = st.nbuf
    if W > 256:
        zp = <int64_t*>calloc(W, sizeof(int64_t))
    memcpy(&dz, d, sizeof(tl_desc_t))
    dz.zc = zc_off + 1
    for j in range(nchunks + 1):
        if j < nchunks:
            off = j * chunk_elems
            c = n - off if n - off < chunk_elems else chunk_elems
            if zc_off < 0:
                # Copy in only the parts the peers reduce: my own part is read from `send` by my own
                # reduce below (the slot's part `me` receives its result). For 2 ranks this halves
                # the copy-in; 16 MiB, 2 ranks, 6 interleaved pairs of runs: median 6.3 GB/s vs 5.6.
                pl = _round_up((c + W - 1) // W, align)
                for p in range(W):
                    if p == me:
                        continue
                    lo = _at_most(<size_t>p * pl, c)
                    hi = _at_most(lo + pl, c)
                    if hi > lo:
                        memcpy(_slot(st, me, use + j) + lo * esz, send + (off + lo) * esz, (hi - lo) * esz)
            st.nbuf += 1
        if j == 0:
            rc = _first_step(st, &dz, deadline)
            if rc == 0:
                par = st.step & 1
                for p in range(W):
                    zp[p] = st.ranks[p].desc[par].zc - 1
                    if zp[p] >= 0:
                        any_zc = 1
        else:
            rc = _step(st, deadline)
        if rc != 0:
            break
        if j >= 1 and (dst < 0 or dst == me):
            # gather chunk j-1: every part from its owner's slot
            off = (j - 1) * chunk_elems
            c = n - off if n - off < chunk_elems else chunk_elems
            pl = _round_up((c + W - 1) // W, align)
            for p in range(W):
                if p == me and (zc_off >= 0 or direct):
                    continue  # my reduced part is already in recv (in place, or written by my reduce)
                lo = _at_most(<size_t>p * pl, c)
                hi = _at_most(lo + pl, c)
                if hi > lo:
                    memcpy(recv + (off + lo) * esz, _csrc(st, p, zp, use + j - 1, off * esz) + lo * esz,
                           (hi - lo) * esz)
        if j < nchunks:
            # reduce my part of chunk j over every rank's slot, in rank order, into my slot
            off = j * chunk_elems
            c = n - off if n - off < chunk_elems else chunk_elems
            pl = _round_up((c + W - 1) // W, align)
            lo = _at_most(<size_t>me * pl, c)
            hi = _at_most(lo + pl, c)
            if hi > lo:
                mys = _csrc(st, me, zp, use + j, off * esz)
                for p in range(W):
                    sp[p] = _csrc(st, p, zp, use + j, off * esz) + lo * esz
                if zc_off < 0:
                    sp[me] = send + (off + lo) * esz   # my part was not copied in (see above)
                if direct:
                    # Reduce straight into recv, one L1-sized block at a time, and copy each block
                    # into my slot while it is still in L1 (the peers gather it from there): the
                    # gather then skips my part, which saves re-reading it from the slot.
                    k = lo
                    while k < hi:
                        m = hi - k if hi - k < sub else sub
                        fn(recv + (off + k) * esz, sp, W, m, div)
                        memcpy(mys + k * esz, recv + (off + k) * esz, m * esz)
                        for p in range(W):
                            sp[p] = <const char*>sp[p] + m * esz
                        k += m
                else:
                    fn(mys + lo * esz, sp, W, hi - lo, div)
    if rc == 0 and any_zc:
        # peers may still be gathering from a heap tensor: nobody returns (and lets the user
        # overwrite it) before everyone is done
        rc = _step(st, deadline)
    if sp != srcs:
        free(sp)
    if zp != zcs:
        free(zp)
    return rc


cdef int _broadcast(State* st, const tl_desc_t* d, char* buf, size_t nbytes, int root, int64_t zc_off,
                    double deadline) noexcept nogil:
    """Root copies one slot per step, the others copy it out. Zero-copy (zc_off >= 0 on the root:
    its tensor is in its heap): the others read it in place and a final barrier keeps the root
    from returning (and changing it) before they are done."""
    cdef size_t off = 0, c
    cdef int rc, first = 1
    cdef int64_t zr = -1
    cdef uint64_t use
    cdef tl_desc_t dz
    memcpy(&dz, d, sizeof(tl_desc_t))
    dz.zc = zc_off + 1 if st.rank == root else 0
    while first or off < nbytes:
        c = nbytes - off
        if c > st.S:
            c = st.S
        use = st.nbuf
        st.nbuf += 1
        if st.rank == root and c and zc_off < 0:
            memcpy(_slot(st, root, use), buf + off, c)
        if first:
            rc = _first_step(st, &dz, deadline)
            first = 0
            if rc == 0:
                zr = st.ranks[root].desc[st.step & 1].zc - 1
        else:
            rc = _step(st, deadline)
        if rc != 0:
            return rc
        if st.rank != root and c:
            if zr >= 0:
                memcpy(buf + off, st.heap + <size_t>root * st.H + <size_t>zr + off, c)
            else:
                memcpy(buf + off, _slot(st, root, use), c)
        off += c
    if zr >= 0:
        return _step(st, deadline)
    return 0


cdef int _allgather(State* st, const tl_desc_t* d, const char* send, char* recv, size_t nbytes, int dst,
                    int64_t zc_off, double deadline) noexcept nogil:
    """Allgather (dst < 0) or gather to dst; each rank contributes nbytes. A rank's own block goes
    straight from send to recv. Zero-copy for ranks whose send is in their heap (zc_off >= 0):
    no copy into the slot, readers take it in place, and a final barrier follows."""
    cdef size_t off = 0, c
    cdef int rc, p, k, par, first = 1, any_zc = 0, W = st.world
    # memory-bound (see State.big_bytes): slot path with streaming stores into recv
    cdef int nt = <size_t>W * <size_t>W * nbytes >= st.big_bytes
    cdef int fuse, own_done
    cdef uint64_t use
    cdef int64_t zcs[256]
    cdef int64_t* zp = zcs
    cdef const char* src
    cdef tl_desc_t dz
    if W > 256:
        zp = <int64_t*>calloc(W, sizeof(int64_t))
    memcpy(&dz, d, sizeof(tl_desc_t))
    dz.zc = zc_off + 1
    rc = 0
    if st.cma and nbytes >= st.cma_bytes and nbytes > 0 and not nt:
        # Cross-memory attach: one copy per block (peer's send -> my recv, by process_vm_readv)
        # instead of two (send -> slot, slot -> recv). Measured 1.3-2x faster than the slots for
        # 512 KiB-8 MiB gathered (2 ranks); not for memory-bound sizes, where the kernel's
        # page-by-page copy loses to streaming stores (hence `not nt`). The first step carries
        # every rank's send address; the second keeps each rank (and its send buffer) in the op
        # until every reader is done. The choice depends only on nbytes and the agreed setting,
        # so ranks whose sizes differ still meet at the first step and all raise the mismatch.
        dz.addr = <int64_t><uintptr_t>send
        st.nbuf += 1
        rc = _first_step(st, &dz, deadline)
        if rc == 0 and (dst < 0 or dst == st.rank):
            par = st.step & 1
            # start with my own block, then peer me+1, me+2, ...: with more than two ranks the
            # readers spread over different peers' memory instead of all reading rank 0 first
            for k in range(W):
                p = (st.rank + k) % W
                if p == st.rank:
                    if send != <const char*>(recv + <size_t>p * nbytes):
                        memcpy(recv + <size_t>p * nbytes, send, nbytes)
                elif st.ranks[p].desc[par].zc > 0:
                    memcpy(recv + <size_t>p * nbytes,
                           st.heap + <size_t>p * st.H + <size_t>(st.ranks[p].desc[par].zc - 1), nbytes)
                else:
                    rc = _cma(st, p, recv + <size_t>p * nbytes, st.ranks[p].desc[par].addr, nbytes)
                    if rc != 0:
                        break
        if rc == 0:
            st.nbuf += 1
            rc = _step(st, deadline)
        if zp != zcs:
            free(zp)
        return rc
    # Memory-bound: copy my block into my slot and into recv in one pass over send (measured
    # 2.0-2.1 ms against 2.5-2.8 ms for two passes, 16 MiB on 2 ranks in the same processes);
    # only where my block is wanted and recv does not overlap send (not in place).
    fuse = nt and (dst < 0 or dst == st.rank) and not (
        send < <const char*>(recv + <size_t>W * nbytes) and <const char*>recv < send + nbytes)
    while first or off < nbytes:
        c = nbytes - off
        if c > st.S:
            c = st.S
        use = st.nbuf
        st.nbuf += 1
        own_done = 0
        if c and zc_off < 0:
            if fuse:
                # memory-bound: my own block goes to recv in the same pass (read send once)
                tl_copy2_nt(_slot(st, st.rank, use), recv + <size_t>st.rank * nbytes + off, send + off, c)
                own_done = 1
            else:
                memcpy(_slot(st, st.rank, use), send + off, c)
        if first:
            rc = _first_step(st, &dz, deadline)
            first = 0
            if rc == 0:
                for p in range(W):
                    zp[p] = st.ranks[p].desc[st.step & 1].zc - 1
                    if zp[p] >= 0:
                        any_zc = 1
        else:
            rc = _step(st, deadline)
        if rc != 0:
            break
        if c and (dst < 0 or dst == st.rank):
            for p in range(W):
                if p == st.rank:
                    src = send + off
                    if own_done or src == <const char*>(recv + <size_t>p * nbytes + off):
                        continue  # in place, or copied with the slot: my block is where it belongs
                else:
                    src = _csrc(st, p, zp, use, off)
                _out(nt, recv + <size_t>p * nbytes + off, src, c)
        off += c
    if rc == 0 and any_zc:
        rc = _step(st, deadline)
    if zp != zcs:
        free(zp)
    return rc


cdef int _scatter(State* st, const tl_desc_t* d, const char* send, char* recv, size_t nbytes, int root,
                  double deadline) noexcept nogil:
    """Root's send holds world blocks of nbytes; rank r receives block r."""
    cdef size_t off = 0, c, per = st.S // <size_t>st.world
    cdef int rc, q, first = 1
    cdef uint64_t use
    cdef char* s
    while first or off < nbytes:
        c = nbytes - off
        if c > per:
            c = per
        use = st.nbuf
        st.nbuf += 1
        if st.rank == root and c:
            s = _slot(st, root, use)
            for q in range(st.world):
                memcpy(s + <size_t>q * c, send + <size_t>q * nbytes + off, c)
        if first:
            rc = _first_step(st, d, deadline)
            first = 0
        else:
            rc = _step(st, deadline)
        if rc != 0:
            return rc
        if c:
            memcpy(recv + off, _slot(st, root, use) + <size_t>st.rank * c, c)
        off += c
    return 0


cdef int _exchange(State* st, const tl_desc_t* d, const char* send, char* recv, size_t n, size_t esz,
                   tl_reduce_fn fn, int div, double deadline) noexcept nogil:
    """Alltoall (fn == NULL) or reduce_scatter (fn != NULL) of world blocks of n elements.

    Per chunk every rank copies its c-element piece of each destination's block into its slot;
    after the barrier rank r takes piece r from every slot: copies them into recv block p
    (alltoall) or reduces them in rank order into recv (reduce_scatter). A rank's own piece never
    goes through its slot: it is read straight from send (1/W less memory traffic).
    """
    cdef int W = st.world, me = st.rank, p, q, k, rc, first = 1, par
    cdef size_t off = 0, c, per = st.S // <size_t>W // esz, blk = n * esz
    cdef int nt = <size_t>W * <size_t>W * blk >= st.big_bytes
    cdef const void* srcs[256]
    cdef const void** sp = srcs
    cdef uint64_t use
    cdef char* s
    cdef tl_desc_t dz
    rc = 0
    if fn == NULL and st.cma and blk >= st.cma_bytes and blk > 0 and not nt:
        # Alltoall by cross-memory attach: rank r reads block r of every peer's send straight
        # into its recv (one copy instead of two). An in-place rank (send is recv) cannot let
        # peers read its send while it overwrites it: it publishes -1 and everyone takes the
        # slot path below (which repeats the first step; one extra barrier).
        memcpy(&dz, d, sizeof(tl_desc_t))
        dz.addr = -1 if send == <const char*>recv else <int64_t><uintptr_t>send
        st.nbuf += 1
        rc = _first_step(st, &dz, deadline)
        if rc != 0:
            return rc
        if _cma_all_serve(st):
            par = st.step & 1
            for k in range(W):
                p = (me + k) % W
                if p == me:
                    memcpy(recv + <size_t>me * blk, send + <size_t>me * blk, blk)
                else:
                    rc = _cma(st, p, recv + <size_t>p * blk, st.ranks[p].desc[par].addr + <int64_t>(me * blk), blk)
                    if rc != 0:
                        return rc
            st.nbuf += 1
            return _step(st, deadline)
    if W > 256:
        sp = <const void**>calloc(W, sizeof(void*))
    while first or off < n:
        c = n - off
        if c > per:
            c = per
        use = st.nbuf
        st.nbuf += 1
        if c:
            s = _slot(st, me, use)
            for q in range(W):
                if q != me:
                    memcpy(s + <size_t>q * c * esz, send + (<size_t>q * n + off) * esz, c * esz)
        if first:
            rc = _first_step(st, d, deadline)
            first = 0
        else:
            rc = _step(st, deadline)
        if rc != 0:
            break
        if c:
            if fn != NULL:
                for p in range(W):
                    sp[p] = _slot(st, p, use) + <size_t>me * c * esz
                # (in place, recv is my block of send: the kernel allows out to alias a source)
                sp[me] = send + (<size_t>me * n + off) * esz
                fn(recv + off * esz, sp, W, c, div)
            else:
                for p in range(W):
                    if p == me:
                        if send != <const char*>recv:
                            _out(nt, recv + (<size_t>me * n + off) * esz, send + (<size_t>me * n + off) * esz,
                                   c * esz)
                    else:
                        _out(nt, recv + (<size_t>p * n + off) * esz, _slot(st, p, use) + <size_t>me * c * esz,
                               c * esz)
        off += c
    if sp != srcs:
        free(sp)
    return rc


cdef int _alltoall_v(State* st, const tl_desc_t* d, const char* send, const int64_t* scount,
                     const int64_t* sdispl, char* recv, const int64_t* rcount, const int64_t* rdispl,
                     size_t esz, double deadline) noexcept nogil:
    """Alltoall with per-pair counts (elements). First step: every rank publishes its send and
    receive counts; every rank checks the whole matrix (send[p][q] == recv[q][p]), so a mismatch
    raises everywhere. Then rounds of W pieces of up to S/W bytes per rank, or (cross-memory
    attach, when the largest piece reaches cma_bytes) every rank reads its pieces straight from the
    peers' send buffers at their send displacements (published with the counts), then a barrier."""
    cdef int W = st.world, me = st.rank, p, q, rc, i
    cdef size_t per = st.S // <size_t>W // esz, k, rounds = 0, c, off, mx = 0, tot = 0
    cdef int64_t* m
    cdef uint64_t use
    cdef char* s
    cdef tl_desc_t dz
    cdef int par, nt
    use = st.nbuf
    st.nbuf += 1
    m = <int64_t*>_slot(st, me, use)
    memcpy(m, scount, W * sizeof(int64_t))
    memcpy(m + W, rcount, W * sizeof(int64_t))
    memcpy(m + 2 * W, sdispl, W * sizeof(int64_t))
    memcpy(&dz, d, sizeof(tl_desc_t))
    dz.addr = <int64_t><uintptr_t>send
    rc = _first_step(st, &dz, deadline)
    if rc != 0:
        return rc
    for p in range(W):
        for q in range(W):
            if (<int64_t*>_slot(st, p, use))[q] != (<int64_t*>_slot(st, q, use))[W + p]:
                st.err_rank = p
                st.err_rank2 = q
                # keep a copy of the two numbers for the message (slots may be reused later)
                st.err_v1 = (<int64_t*>_slot(st, p, use))[q]
                st.err_v2 = (<int64_t*>_slot(st, q, use))[W + p]
                return E_COUNTS
            if <size_t>(<int64_t*>_slot(st, p, use))[q] > mx:
                mx = <size_t>(<int64_t*>_slot(st, p, use))[q]
            tot += <size_t>(<int64_t*>_slot(st, p, use))[q]
    nt = tot * esz >= st.big_bytes
    if st.cma and mx * esz >= st.cma_bytes and mx > 0 and not nt:
        # the decision uses only the count matrix every rank has just checked: all ranks agree
        par = st.step & 1
        for i in range(W):
            p = (me + i) % W
            c = <size_t>rcount[p]
            if c == 0:
                continue
            if p == me:
                memcpy(recv + <size_t>rdispl[me] * esz, send + <size_t>sdispl[me] * esz, c * esz)
            else:
                # rank p's send displacement for me, validated by rank p against its own send
                off = <size_t>(<int64_t*>_slot(st, p, use))[2 * W + me]
                rc = _cma(st, p, recv + <size_t>rdispl[p] * esz,
                          st.ranks[p].desc[par].addr + <int64_t>(off * esz), c * esz)
                if rc != 0:
                    return rc
        st.nbuf += 1
        return _step(st, deadline)
    rounds = (mx + per - 1) // per
    for k in range(rounds):
        off = k * per
        use = st.nbuf
        st.nbuf += 1
        s = _slot(st, me, use)
        for q in range(W):
            if <size_t>scount[q] > off:
                c = <size_t>scount[q] - off
                if c > per:
                    c = per
                memcpy(s + <size_t>q * per * esz, send + (<size_t>sdispl[q] + off) * esz, c * esz)
        rc = _step(st, deadline)
        if rc != 0:
            return rc
        for p in range(W):
            if <size_t>rcount[p] > off:
                c = <size_t>rcount[p] - off
                if c > per:
                    c = per
                _out(nt, recv + (<size_t>rdispl[p] + off) * esz, _slot(st, p, use) + <size_t>me * per * esz,
                       c * esz)
    return 0


cdef int _send(State* st, const tl_desc_t* d, const char* buf, size_t nbytes, int dst,
               double deadline) noexcept nogil:
    """Eager up to two pair buffers: returns once the last chunk is published, not consumed.

    Touches only the rank -> dst channel and p2p_sent[dst] (plus the shared abort word and the wait
    statistics), never the collective state (step, slots, descriptors, st.err_*): it may run on
    another thread beside a collective or a receive. shm.py names the peer in its errors."""
    cdef tl_pair_t* pr = _pair(st, st.rank, dst)
    cdef uint32_t base = st.p2p_sent[dst], cid
    cdef size_t nch = (nbytes + st.P - 1) // st.P, k, c
    cdef int rc, who
    if nch == 0:
        nch = 1
    if tl_load(&st.hdr.abort_word.v) != 0:
        return E_ABORT
    if pr.poison.opkind != 0:
        return E_POISON
    for k in range(nch):
        cid = base + <uint32_t>k
        # buffer cid & 1 was last used by chunk cid - 2, consumed once ack >= cid - 1
        rc = _wait_word(st, &pr.ack.v, &pr.ack_sleepers.v, cid - 1, dst, deadline, &pr.poison.opkind, &who)
        if rc != 0:
            return rc
        c = nbytes - k * st.P
        if c > st.P:
            c = st.P
        if c:
            memcpy(_pslot(st, st.rank, dst, cid), buf + k * st.P, c)
        memcpy(&pr.hdr[cid & 1], d, sizeof(tl_desc_t))
        pr.hdr[cid & 1].extra = <int64_t>k
        pr.hdr[cid & 1].root = <int64_t>nch
        _publish(&pr.sent.v, &pr.sent_sleepers.v, cid + 1)
    st.p2p_sent[dst] = base + <uint32_t>nch
    return 0


cdef int _recv(State* st, const tl_desc_t* d, char* buf, size_t nbytes, int src, double deadline) noexcept nogil:
    # Touches only the src -> rank channel and p2p_recv[src] (see _send).
    cdef tl_pair_t* pr = _pair(st, src, st.rank)
    cdef uint32_t base = st.p2p_recv[src], cid
    cdef size_t nch = (nbytes + st.P - 1) // st.P, k, c
    cdef int rc, who
    cdef const tl_desc_t* h
    if nch == 0:
        nch = 1
    if tl_load(&st.hdr.abort_word.v) != 0:
        return E_ABORT
    if pr.poison.opkind != 0:
        return E_POISON
    for k in range(nch):
        cid = base + <uint32_t>k
        rc = _wait_word(st, &pr.sent.v, &pr.sent_sleepers.v, cid + 1, src, deadline, NULL, &who)
        if rc != 0:
            return rc
        h = &pr.hdr[cid & 1]
        if k == 0 and (h.dtype != d.dtype or h.numel != d.numel):
            # Refuse the message: record what we expected so the sender can report both sides,
            # and poison the channel (its counters no longer agree) so both ends fail from now on.
            memcpy(&pr.poison, d, sizeof(tl_desc_t))
            pr.poison.opkind = K_SEND
            tl_fence()
            tl_futex_wake(&pr.ack.v, INT_MAX)
            return E_POISON
        c = nbytes - k * st.P
        if c > st.P:
            c = st.P
        if c:
            memcpy(buf + k * st.P, _pslot(st, src, st.rank, cid), c)
        _publish(&pr.ack.v, &pr.ack_sleepers.v, cid + 1)
    st.p2p_recv[src] = base + <uint32_t>nch
    return 0


# ----------------------------------------------------------------------------------------------
# The engine object: owns the mapping and the per-rank bookkeeping.
# ----------------------------------------------------------------------------------------------

def layout(int world, size_t slot_bytes, size_t pair_bytes, size_t heap_bytes):
    """Byte offsets of the segment parts: (ranks, pairs, slots, pair slots, heap, total)."""
    cdef size_t ranks_off = _round_up(sizeof(tl_hdr_t), 4096)
    cdef size_t pairs_off = ranks_off + <size_t>world * sizeof(tl_rank_t)
    cdef size_t slots_off = _round_up(pairs_off + <size_t>world * world * sizeof(tl_pair_t), 4096)
    cdef size_t pslots_off = slots_off + <size_t>world * NSLOTS * slot_bytes
    cdef size_t heap_off = pslots_off + <size_t>world * world * 2 * pair_bytes
    cdef size_t total = heap_off + <size_t>world * heap_bytes
    return ranks_off, pairs_off, slots_off, pslots_off, heap_off, total


def cma_read(int pid, uintptr_t remote, size_t n):
    """Read n bytes at address ``remote`` of process ``pid`` (process_vm_readv); OSError on failure."""
    cdef bytearray out = bytearray(n)
    cdef char* dst = out
    cdef int e
    with nogil:
        e = tl_cma_read(pid, dst, <const void*>remote, n)
    if e != 0:
        raise OSError(e, f"process_vm_readv(pid {pid}, {n} bytes): {strerror(e).decode()}")
    return bytes(out)


def allow_ptrace_any():
    """prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY): lets peers read this process under Yama
    ptrace_scope=1 (what Open MPI's CMA path does). Returns 0 or the errno."""
    # PR_SET_PTRACER = 0x59616d61 ("Yama"), PR_SET_PTRACER_ANY = (unsigned long)-1
    if prctl(0x59616d61, <unsigned long>(-1), 0, 0, 0) != 0:
        return errno
    return 0


def pid_dead(int pid):
    """True if ``pid`` no longer runs (gone or a zombie)."""
    return bool(tl_pid_dead(pid))


def reduce_supported(int kdt, int op):
    """True if the compiled reduction kernel exists for (kernel dtype code, op code)."""
    return tl_pick_reduce(kdt, op) != NULL


def reduce_local(uintptr_t out, list srcs, int kdt, int op, size_t n, int div):
    """Run the reduction kernel in this process (tests compare it with torch)."""
    cdef tl_reduce_fn fn = tl_pick_reduce(kdt, op)
    cdef int k = len(srcs), i
    cdef const void** sp
    if fn == NULL:
        raise ValueError(f"no reduction kernel for dtype code {kdt} and op {op}")
    sp = <const void**>calloc(k if k > 0 else 1, sizeof(void*))
    for i in range(k):
        sp[i] = <const void*><uintptr_t>srcs[i]
    with nogil:
        fn(<void*>out, sp, k, n, div)
    free(sp)


@cython.auto_pickle(False)
cdef class Engine:
    """One mapped segment, seen from one rank. Created by :meth:`create` or :meth:`attach`."""

    cdef State st
    cdef readonly int rank
    cdef readonly int world
    cdef readonly object name
    cdef int busy       # a collective (or barrier) is running
    # Running sends and receives, as 2 * peer + (1 for a send): a send to `dst` touches only the
    # rank -> dst channel and p2p_sent[dst], a receive from `src` the src -> rank channel and
    # p2p_recv[src], so point-to-point operations with different (direction, peer) may overlap,
    # with each other and with a collective (which uses the slots, steps and descriptors). What
    # they still share: the abort word, local_closing, and the wait statistics and adaptive spin
    # budget (st.n_*, spin_cur: unsynchronised, at worst a miscounted wait or a spin tuned by the
    # other thread's wait). Errors: a collective's details stay in st.err_*, which p2p never writes.
    cdef object p2p_running
    cdef int pid
    cdef int exports   # live HeapBuffer objects: the mapping must outlive them
    cdef int closed
    cdef readonly int attach_order  # 1 for the first rank that mapped the segment, world for the last
    cdef public size_t small_bytes

    def __cinit__(self):
        self.p2p_running = set()
        memset(&self.st, 0, sizeof(State))
        self.st.big_bytes = <size_t>-1
        self.st.base = NULL

    def __dealloc__(self):
        # safety net only (close() is the real release): unmap, no Python calls
        if self.st.base != NULL:
            self.st.ranks[self.st.rank].closed = 1
            munmap(self.st.base, self.st.total)
            self.st.base = NULL
        free(self.st.p2p_sent)
        free(self.st.p2p_recv)
        free(self.st.check_pid)
        free(self.st.missing)
        self.st.p2p_sent = NULL
        self.st.p2p_recv = NULL
        self.st.check_pid = NULL
        self.st.missing = NULL

    cdef int _map(self, bytes name, int create, int rank, int world, size_t slot_bytes, size_t pair_bytes,
                  size_t heap_bytes, uint64_t generation) except -1:
        cdef int fd, err
        cdef struct_stat sb
        cdef void* p
        cdef size_t total
        cdef tl_hdr_t* h
        cdef const char* cname = name
        offs = None
        if create:
            offs = layout(world, slot_bytes, pair_bytes, heap_bytes)
            total = offs[5]
            # 0600: only this user's processes may map the job's tensors
            fd = shm_open(cname, O_CREAT | O_EXCL | O_RDWR, 0o600)
            if fd < 0:
                err = errno
                raise OSError(err, f"shm_open({name.decode()}, O_CREAT|O_EXCL): {strerror(err).decode()}")
            if ftruncate(fd, total) != 0:
                err = errno
                c_close(fd)
                shm_unlink(cname)
                raise OSError(err, f"ftruncate({name.decode()}, {total}): {strerror(err).decode()}")
            # Reserve the pages now: on a too-small /dev/shm (docker's 64 MiB default) a sparse
            # segment would kill the process with SIGBUS on first touch instead of raising here.
            err = posix_fallocate(fd, 0, total)
            if err != 0:
                c_close(fd)
                shm_unlink(cname)
                raise OSError(err, f"posix_fallocate({name.decode()}, {total} bytes): {strerror(err).decode()}")
        else:
            fd = shm_open(cname, O_RDWR, 0)
            if fd < 0:
                err = errno
                raise OSError(err, f"shm_open({name.decode()}): {strerror(err).decode()}")
            if fstat(fd, &sb) != 0:
                err = errno
                c_close(fd)
                raise OSError(err, f"fstat({name.decode()}): {strerror(err).decode()}")
            total = <size_t>sb.st_size
            if total < sizeof(tl_hdr_t):
                c_close(fd)
                raise OSError(0, f"segment {name.decode()} is only {total} bytes")
        p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        err = errno
        c_close(fd)  # the mapping keeps the segment alive; the descriptor is not needed
        if p == MAP_FAILED:
            if create:
                shm_unlink(cname)
            raise OSError(err, f"mmap({name.decode()}, {total}): {strerror(err).decode()}")
        h = <tl_hdr_t*>p
        if create:
            h.version = TL_VERSION
            h.world = world
            h.generation = generation
            h.slot_bytes = slot_bytes
            h.pair_bytes = pair_bytes
            h.heap_bytes = heap_bytes
            h.total_bytes = total
            tl_fence()
            h.magic = TL_MAGIC  # last: a reader never sees a half-initialised header
        else:
            problem = None
            if h.magic != TL_MAGIC:
                problem = f"bad magic {h.magic:#x} (not a trainloom shm segment)"
            elif h.version != TL_VERSION:
                problem = f"version {h.version}, this build speaks {TL_VERSION}"
            elif h.world != <uint32_t>world:
                problem = f"world size {h.world}, expected {world}"
            elif h.generation != generation:
                problem = f"generation {h.generation:#x}, expected {generation:#x} (a stale segment)"
            elif h.total_bytes != total:
                problem = f"size {total}, header says {h.total_bytes}"
            if problem is not None:
                munmap(p, total)
                raise ValueError(f"shared-memory segment {name.decode()} rejected: {problem}")
            slot_bytes = h.slot_bytes
            pair_bytes = h.pair_bytes
            heap_bytes = h.heap_bytes
            offs = layout(world, slot_bytes, pair_bytes, heap_bytes)
            # layout() sums in size_t: sizes so large that the sum wraps would match total too, so
            # the parts are also checked in Python ints (they cannot exceed the mapping)
            if offs[5] != total or world * (NSLOTS * <object>slot_bytes + world * 2 * <object>pair_bytes
                                            + <object>heap_bytes) > total:
                munmap(p, total)
                raise ValueError(f"shared-memory segment {name.decode()} rejected: layout size mismatch")
        self.st.base = <char*>p
        self.st.total = total
        self.st.rank = rank
        self.st.world = world
        self.st.hdr = h
        self.st.ranks = <tl_rank_t*>(self.st.base + <size_t>offs[0])
        self.st.pairs = <tl_pair_t*>(self.st.base + <size_t>offs[1])
        self.st.slots = self.st.base + <size_t>offs[2]
        self.st.pslots = self.st.base + <size_t>offs[3]
        self.st.heap = self.st.base + <size_t>offs[4]
        self.st.S = slot_bytes
        self.st.P = pair_bytes
        self.st.H = heap_bytes
        self.st.p2p_sent = <uint32_t*>calloc(world, sizeof(uint32_t))
        self.st.p2p_recv = <uint32_t*>calloc(world, sizeof(uint32_t))
        self.st.check_pid = <char*>calloc(world, 1)
        self.st.missing = <char*>calloc(world, 1)
        if not self.st.p2p_sent or not self.st.p2p_recv or not self.st.check_pid or not self.st.missing:
            raise MemoryError()
        self.st.ranks[rank].pid = getpid()
        self.pid = getpid()
        self.rank = rank
        self.world = world
        self.name = name.decode()
        self.attach_order = <int>tl_add(&h.attached.v, 1) + 1
        return 0

    @staticmethod
    def create(bytes name, int rank, int world, size_t slot_bytes, size_t pair_bytes, size_t heap_bytes,
               uint64_t generation):
        """Create, size and map a new segment (fails if the name exists)."""
        cdef Engine e = Engine.__new__(Engine)
        e._map(name, 1, rank, world, slot_bytes, pair_bytes, heap_bytes, generation)
        return e

    @staticmethod
    def attach(bytes name, int rank, int world, uint64_t generation):
        """Map an existing segment and verify its header (magic, version, world, generation)."""
        cdef Engine e = Engine.__new__(Engine)
        e._map(name, 0, rank, world, 0, 0, 0, generation)
        return e

    @staticmethod
    def unlink(bytes name):
        """shm_unlink(name); returns 0 or the errno."""
        if shm_unlink(name) != 0:
            return errno
        return 0

    # --- configuration and introspection -------------------------------------------------------
    @property
    def slot_bytes(self):
        return self.st.S

    @property
    def pair_bytes(self):
        return self.st.P

    @property
    def heap_bytes(self):
        return self.st.H

    @property
    def total_bytes(self):
        return self.st.total

    @property
    def attached(self):
        self._check_open()
        return tl_load(&self.st.hdr.attached.v)

    @property
    def spin_s(self):
        return self.st.spin_s

    @spin_s.setter
    def spin_s(self, double v):
        self.st.spin_s = v
        self.st.spin_cur = v

    @property
    def spin_cur(self):
        return self.st.spin_cur

    # --- cross-memory attach ----------------------------------------------------------------------
    def set_cma(self, bint on, size_t threshold):
        """Enable reads of peers' buffers by process_vm_readv for messages >= threshold bytes.

        Every rank must pass the same values (shm.py agrees them through the store after the probe):
        the choice of protocol is made independently on each rank from the message size."""
        self.st.cma = 1 if on else 0
        self.st.cma_bytes = threshold

    @property
    def big_bytes(self):
        return self.st.big_bytes

    @big_bytes.setter
    def big_bytes(self, size_t v):
        # must be equal on every rank (it selects the protocol); shm.py sets it at creation
        self.st.big_bytes = v

    @property
    def cma(self):
        return bool(self.st.cma)

    @property
    def cma_bytes(self):
        return self.st.cma_bytes

    def set_probe(self, uint64_t token):
        """Store the word peers read at creation to check that cross-memory attach works."""
        self.st.probe = token

    def probe_address(self):
        """Address (in this process) of the probe word: lives as long as this engine."""
        return <uintptr_t>&self.st.probe

    def stats(self):
        """Wait statistics of this rank: steps, waits, waits won by spinning, futex sleeps,
        seconds spent waiting."""
        return {
            "steps": self.st.step,
            "waits": self.st.n_waits,
            "spun": self.st.n_spun,
            "sleeps": self.st.n_sleeps,
            "wait_s": self.st.t_waited,
        }

    @property
    def step(self):
        return self.st.step

    @property
    def is_open(self):
        return self.st.base != NULL and not self.closed

    def heap_buffer(self, size_t offset, size_t nbytes):
        """A writable buffer over [offset, offset + nbytes) of this rank's heap.

        The buffer holds a reference to the engine and the mapping stays until the last buffer is
        gone, so tensors made from it (torch.frombuffer) never point into unmapped memory, even
        after close()."""
        self._check_open()
        # two comparisons, not offset + nbytes > H: that sum wraps for an offset near 2**64
        if offset > self.st.H or nbytes > self.st.H - offset:
            raise ValueError(f"heap range [{offset}, {offset + <object>nbytes}) exceeds heap_bytes={self.st.H}")
        cdef HeapBuffer b = HeapBuffer.__new__(HeapBuffer)
        b.eng = self
        b.ptr = self.st.heap + <size_t>self.st.rank * self.st.H + offset
        b.shape[0] = <Py_ssize_t>nbytes
        self.exports += 1
        return b

    def peer_pid(self, int r):
        self._check_open()
        self._check_peer(r, "peer_pid")
        return self.st.ranks[r].pid

    def set_check_pid(self, int r, bint on):
        self._check_open()
        self._check_peer(r, "set_check_pid")
        self.st.check_pid[r] = 1 if on else 0

    def peer_gone(self, int r):
        """2 if rank r closed its communicator, 1 if its process is dead (only checked when its pid
        is visible from here), else 0. For error messages: names the rank behind an abort."""
        self._check_open()
        if r < 0 or r >= self.st.world:
            raise ValueError(f"rank {r} is outside 0..{self.st.world - 1}")
        if self.st.ranks[r].closed:
            return 2
        if self.st.check_pid[r] and tl_pid_dead(self.st.ranks[r].pid):
            return 1
        return 0

    def abort_word(self):
        """(reason, rank) of the first abort, or (0, -1)."""
        self._check_open()
        cdef uint32_t w = tl_load(&self.st.hdr.abort_word.v)
        if w == 0:
            return 0, -1
        return <int>(w >> 16), <int>(w & 0xFFFF) - 1

    def heap_address(self, int r):
        """Address of rank r's zero-copy heap in this process's mapping."""
        self._check_open()
        self._check_peer(r, "heap_address")
        return <uintptr_t>(self.st.heap + <size_t>r * self.st.H)

    def error_info(self):
        """Details of the last failure: dict with peer, target, missing ranks, descriptors."""
        cdef int W = self.st.world
        info = {
            "peer": self.st.err_peer,
            "target": self.st.err_target,
            "missing": [p for p in range(W) if self.st.missing[p]],
            "rank": self.st.err_rank,
            "rank2": self.st.err_rank2,
            "send_count": self.st.err_v1,
            "recv_count": self.st.err_v2,
            "errno": self.st.err_errno,
        }
        return info

    def desc(self, int r, int parity):
        """Rank r's descriptor in parity slot `parity`, as a dict."""
        self._check_open()
        self._check_peer(r, "desc")
        return _desc_dict(&self.st.ranks[r].desc[parity & 1])

    def last_desc(self, int r):
        """Rank r's descriptor of the op whose first step was this rank's last step."""
        self._check_open()
        self._check_peer(r, "last_desc")
        return _desc_dict(&self.st.ranks[r].desc[self.st.err_parity & 1])

    def p2p_info(self, int src, int dst):
        """(sender's header of the pending chunk, receiver's poison descriptor) of a channel."""
        self._check_open()
        self._check_peer(src, "p2p_info")
        self._check_peer(dst, "p2p_info")
        cdef tl_pair_t* pr = _pair(&self.st, src, dst)
        # the refused chunk is the first one the receiver did not acknowledge
        cdef uint32_t cid = tl_load(&pr.ack.v)
        return _desc_dict(&pr.hdr[cid & 1]), _desc_dict(&pr.poison)

    cdef int _check_open(self) except -1:
        if self.st.base == NULL or self.closed:
            raise CommError("shared-memory engine used after close()")
        return 0

    cdef int _check_peer(self, int r, str what) except -1:
        if r < 0 or r >= self.st.world:
            raise ValueError(f"{what}: rank {r} is outside 0..{self.st.world - 1}")
        return 0

    cdef int _check_zc(self, uintptr_t ptr, size_t nbytes, int64_t zc_off) except -1:
        if (<size_t>zc_off + nbytes > self.st.H
                or ptr != <uintptr_t>(self.st.heap + <size_t>self.st.rank * self.st.H + <size_t>zc_off)):
            raise ValueError(f"zero-copy offset {zc_off} does not match a tensor inside this rank's heap")
        return 0

    cdef int _enter(self) except -1:
        """Start a collective: no other collective may be running (the GIL makes check-and-set
        atomic). Sends and receives may: they use their own channels and counters (see _send), so
        a receive posted before a collective no longer holds it back while the peer's matching send
        comes after the peer's collective (torch's gloo runs that pattern)."""
        self._check_usable(self.busy)
        self.busy = 1
        return 0

    cdef int _enter_p2p(self, int key) except -1:
        """Start a send or a receive (``key`` = 2 * peer + 1 for a send, + 0 for a receive). Each
        touches only its own channel, so those with different keys may run at once on several
        threads, and beside a collective: a receive posted first no longer holds back the send the
        peer waits for, and a rank may receive from (or send to) two neighbours at once."""
        self._check_usable(key in self.p2p_running)
        self.p2p_running.add(key)
        return 0

    cdef int _check_usable(self, bint running) except -1:
        if self.st.base == NULL or self.closed:
            raise CommError("shared-memory engine used after close()")
        if running:
            # Refused, the call never reaches its peers, which may already wait for it (a rank
            # whose two threads each run a collective, or each send to the same peer): abort, so
            # that they and the call already running here fail now instead of at their timeout.
            with nogil:
                self._set_abort(A_BUSY)
            raise CommError(
                "a communicator runs one collective at a time and one send to or receive from each "
                "peer at a time; another such call was running on it when this one started on another "
                "thread. The communicator is aborted: the running call and the peers' calls "
                "fail now instead of waiting for this one. Serialise the calls, e.g. on one worker thread")
        if getpid() != self.pid:
            raise CommError(
                f"this communicator was created in process {self.pid} and cannot be used in forked "
                f"child {getpid()}; create a new one in the child")
        return 0

    cdef int _fail(self, int rc) noexcept nogil:
        # Timeouts and dead peers leave the step counters out of step between ranks: the
        # communicator cannot be used again, and peers should fail fast instead of waiting too.
        cdef uint32_t reason = 0
        if rc == E_TIMEOUT:
            reason = A_TIMEOUT
        elif rc == E_DEAD or rc == E_CLOSED:
            reason = A_DEAD
        elif rc == E_INTERRUPTED:
            reason = A_INTERRUPTED
        elif rc == E_CMA:
            # peers sit in the op's completion barrier waiting for this rank: release them
            reason = A_CMA
        if reason != 0:
            self._set_abort(reason)
        return rc

    cdef void _set_abort(self, uint32_t reason) noexcept nogil:
        cdef int p
        tl_cas(&self.st.hdr.abort_word.v, 0, (reason << 16) | <uint32_t>(self.st.rank + 1))
        for p in range(self.st.world):
            tl_futex_wake(&self.st.ranks[p].arrive.v, INT_MAX)
        for p in range(self.st.world * self.st.world):
            tl_futex_wake(&self.st.pairs[p].sent.v, INT_MAX)
            tl_futex_wake(&self.st.pairs[p].ack.v, INT_MAX)

    def abort(self):
        """Set the shared abort word (if not set yet) and wake every sleeper."""
        if self.st.base == NULL:
            return
        with nogil:
            self._set_abort(A_USER)

    def close(self):
        """Mark this rank closed for its peers and unmap. Idempotent. In a forked child (``os.fork()``
        after the communicator was made) only the child's mapping goes: the rank is the parent's."""
        cdef double t0
        if self.st.base == NULL or self.closed:
            return
        if getpid() != self.pid:
            self.closed = 1
            if self.exports == 0:
                munmap(self.st.base, self.st.total)
                self.st.base = NULL
            return
        if self.busy or self.p2p_running:
            # another thread is inside an op: make its waits give up, then wait for it to leave
            self.st.local_closing = 1
            t0 = tl_now()
            while (self.busy or self.p2p_running) and tl_now() - t0 < 5.0:
                _time.sleep(0.001)
            if self.busy or self.p2p_running:
                raise CommError("close(): an operation running on another thread did not stop within 5 s")
        self.st.ranks[self.st.rank].closed = 1
        tl_fence()
        for p in range(self.st.world):
            tl_futex_wake(&self.st.ranks[p].arrive.v, INT_MAX)
        self.closed = 1
        if self.exports == 0:
            munmap(self.st.base, self.st.total)
            self.st.base = NULL
        # else: shared_empty tensors still point into the heap; __dealloc__ unmaps after them

    # --- operations ------------------------------------------------------------------------------
    # Each takes the descriptor fields (opkind, seq, dtype code, redop, root, numel, extra, shape)
    # followed by pointers and sizes, and returns 0 or an error code.

    def allreduce(self, tuple desc, uintptr_t send, uintptr_t recv, size_t n, size_t esz, int kdt, int op,
                  int div, int dst, double timeout, int64_t zc_off=-1):
        cdef tl_desc_t d
        cdef tl_reduce_fn fn = tl_pick_reduce(kdt, op)
        cdef double deadline = tl_now() + timeout
        cdef int rc
        cdef size_t small = self.small_bytes
        if fn == NULL:
            raise ValueError(f"no reduction kernel for dtype code {kdt} and op {op}")
        if small > self.st.S:
            small = self.st.S
        if zc_off >= 0:
            # zero-copy only for an in-place allreduce of a tensor inside this rank's heap
            if (send != recv or dst >= 0 or <size_t>zc_off + n * esz > self.st.H
                    or send != <uintptr_t>(self.st.heap + <size_t>self.st.rank * self.st.H + <size_t>zc_off)):
                raise ValueError("zero-copy allreduce needs send is recv inside this rank's heap")
        _fill_desc(&d, desc)
        # The one-shot/two-shot choice depends on small_bytes, which each rank may set: carry it in
        # the descriptor, so ranks that disagree fail in the first step's check (on every rank,
        # before any rank reads another's data) instead of mixing the two protocols.
        d.extra = <int64_t>small
        self._enter()
        with nogil:
            rc = _allreduce(&self.st, &d, <const char*>send, <char*>recv, n, esz, fn, div, dst, small, zc_off,
                            deadline)
            if rc != 0:
                self._fail(rc)
        self.busy = 0
        if rc == E_INTERRUPTED:
            _reraise_pending()
        return rc

    def broadcast(self, tuple desc, uintptr_t buf, size_t nbytes, int root, double timeout,
                  int64_t zc_off=-1):
        cdef tl_desc_t d
        cdef double deadline = tl_now() + timeout
        cdef int rc
        if zc_off >= 0:
            self._check_zc(buf, nbytes, zc_off)
        _fill_desc(&d, desc)
        self._enter()
        with nogil:
            rc = _broadcast(&self.st, &d, <char*>buf, nbytes, root, zc_off, deadline)
            if rc != 0:
                self._fail(rc)
        self.busy = 0
        if rc == E_INTERRUPTED:
            _reraise_pending()
        return rc

    def allgather(self, tuple desc, uintptr_t send, uintptr_t recv, size_t nbytes, int dst, double timeout,
                  int64_t zc_off=-1):
        cdef tl_desc_t d
        cdef double deadline = tl_now() + timeout
        cdef int rc
        if zc_off >= 0:
            self._check_zc(send, nbytes, zc_off)
        _fill_desc(&d, desc)
        self._enter()
        with nogil:
            rc = _allgather(&self.st, &d, <const char*>send, <char*>recv, nbytes, dst, zc_off, deadline)
            if rc != 0:
                self._fail(rc)
        self.busy = 0
        if rc == E_INTERRUPTED:
            _reraise_pending()
        return rc

    def scatter(self, tuple desc, uintptr_t send, uintptr_t recv, size_t nbytes, int root, double timeout):
        cdef tl_desc_t d
        cdef double deadline = tl_now() + timeout
        cdef int rc
        _fill_desc(&d, desc)
        self._enter()
        with nogil:
            rc = _scatter(&self.st, &d, <const char*>send, <char*>recv, nbytes, root, deadline)
            if rc != 0:
                self._fail(rc)
        self.busy = 0
        if rc == E_INTERRUPTED:
            _reraise_pending()
        return rc

    def exchange(self, tuple desc, uintptr_t send, uintptr_t recv, size_t n, size_t esz, int kdt, int op,
                 int div, double timeout):
        """reduce_scatter (op >= 0) or alltoall (op < 0)."""
        cdef tl_desc_t d
        cdef tl_reduce_fn fn = NULL
        cdef double deadline = tl_now() + timeout
        cdef int rc
        if op >= 0:
            fn = tl_pick_reduce(kdt, op)
            if fn == NULL:
                raise ValueError(f"no reduction kernel for dtype code {kdt} and op {op}")
        _fill_desc(&d, desc)
        self._enter()
        with nogil:
            rc = _exchange(&self.st, &d, <const char*>send, <char*>recv, n, esz, fn, div, deadline)
            if rc != 0:
                self._fail(rc)
        self.busy = 0
        if rc == E_INTERRUPTED:
            _reraise_pending()
        return rc

    def alltoall_v(self, tuple desc, uintptr_t send, const int64_t[::1] scount, const int64_t[::1] sdispl,
                   uintptr_t recv, const int64_t[::1] rcount, const int64_t[::1] rdispl, size_t esz,
                   double timeout):
        cdef tl_desc_t d
        cdef double deadline = tl_now() + timeout
        cdef int rc
        cdef int W = self.st.world
        if (scount.shape[0] != W or sdispl.shape[0] != W or rcount.shape[0] != W or rdispl.shape[0] != W):
            raise ValueError("counts and displacements need one entry per rank")
        if <size_t>(3 * W) * sizeof(int64_t) > self.st.S:
            raise ValueError("slot too small for the counts of this world size")
        _fill_desc(&d, desc)
        self._enter()
        with nogil:
            rc = _alltoall_v(&self.st, &d, <const char*>send, &scount[0], &sdispl[0], <char*>recv,
                             &rcount[0], &rdispl[0], esz, deadline)
            if rc != 0:
                self._fail(rc)
        self.busy = 0
        if rc == E_INTERRUPTED:
            _reraise_pending()
        return rc

    def barrier(self, tuple desc, double timeout):
        cdef tl_desc_t d
        cdef double deadline = tl_now() + timeout
        cdef int rc
        _fill_desc(&d, desc)
        self._enter()
        with nogil:
            self.st.nbuf += 1  # every op's first step consumes one slot use (see module doc)
            rc = _first_step(&self.st, &d, deadline)
            if rc != 0:
                self._fail(rc)
        self.busy = 0
        if rc == E_INTERRUPTED:
            _reraise_pending()
        return rc

    def send(self, tuple desc, uintptr_t buf, size_t nbytes, int dst, double timeout):
        cdef tl_desc_t d
        cdef double deadline = tl_now() + timeout
        cdef int rc
        _fill_desc(&d, desc)
        if dst < 0 or dst >= self.st.world or dst == self.st.rank:
            raise ValueError(f"send: dst {dst} is not a peer of rank {self.st.rank} in a world of {self.st.world}")
        self._enter_p2p(2 * dst + 1)
        with nogil:
            rc = _send(&self.st, &d, <const char*>buf, nbytes, dst, deadline)
            if rc != 0 and rc != E_POISON:
                self._fail(rc)
        self.p2p_running.discard(2 * dst + 1)
        if rc == E_INTERRUPTED:
            _reraise_pending()
        return rc

    def recv(self, tuple desc, uintptr_t buf, size_t nbytes, int src, double timeout):
        cdef tl_desc_t d
        cdef double deadline = tl_now() + timeout
        cdef int rc
        _fill_desc(&d, desc)
        if src < 0 or src >= self.st.world or src == self.st.rank:
            raise ValueError(f"recv: src {src} is not a peer of rank {self.st.rank} in a world of {self.st.world}")
        self._enter_p2p(2 * src)
        with nogil:
            rc = _recv(&self.st, &d, <char*>buf, nbytes, src, deadline)
            if rc != 0 and rc != E_POISON:
                self._fail(rc)
        self.p2p_running.discard(2 * src)
        if rc == E_INTERRUPTED:
            _reraise_pending()
        return rc


@cython.auto_pickle(False)
cdef class HeapBuffer:
    """Buffer-protocol view of part of a rank's heap (see Engine.heap_buffer)."""

    cdef Engine eng
    cdef char* ptr
    cdef Py_ssize_t shape[1]

    def __getbuffer__(self, Py_buffer* buf, int flags):
        buf.buf = self.ptr
        buf.len = self.shape[0]
        buf.readonly = 0
        buf.itemsize = 1
        buf.format = "B"
        buf.ndim = 1
        buf.shape = self.shape
        buf.strides = NULL
        buf.suboffsets = NULL
        buf.internal = NULL
        buf.obj = self

    def __releasebuffer__(self, Py_buffer* buf):
        pass

    def __dealloc__(self):
        if self.eng is not None:
            self.eng.exports -= 1


cdef int _reraise_pending() except -1:
    global _pending_exc
    exc = _pending_exc
    _pending_exc = None
    if exc is not None:
        raise exc
    return 0


cdef int _fill_desc(tl_desc_t* d, tuple t) except -1:
    # t = (opkind, seq, dtype, redop, root, numel, extra, shape)
    cdef int i
    memset(d, 0, sizeof(tl_desc_t))
    d.opkind = t[0]
    d.seq = t[1]
    d.dtype = t[2]
    d.redop = t[3]
    d.root = t[4]
    d.numel = t[5]
    d.extra = t[6]
    shape = t[7]
    d.ndim = len(shape)
    for i in range(min(len(shape), TL_MAXDIM)):
        d.shape[i] = shape[i]
    return 0


cdef object _desc_dict(const tl_desc_t* d):
    cdef int nd = <int>d.ndim
    if nd > TL_MAXDIM:
        nd = TL_MAXDIM
    if nd < 0:
        nd = 0
    return {
        "opkind": d.opkind,
        "seq": d.seq,
        "dtype": d.dtype,
        "redop": d.redop,
        "root": d.root,
        "numel": d.numel,
        "extra": d.extra,
        "ndim": d.ndim,
        "shape": tuple(d.shape[i] for i in range(nd)),
    }
