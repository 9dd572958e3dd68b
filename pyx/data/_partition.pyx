# cython: language_level=3
"""Compiled planning core of trainloom's load-balancing samplers.

Every function here takes typed memoryviews over int64/float64 arrays that the Python layer
(trainloom/data/samplers.py) has already validated (finite costs, indices in range, sizes that
match). The functions re-check cheap invariants that would otherwise corrupt memory (shapes, index
ranges) and raise ValueError with the GIL held; the loops themselves run with the GIL released.

The plan is sequential by nature (a stable radix sort, a greedy cut of a sorted run, a longest-first
deal to the least-loaded rank), so there is no prange here: the loops are memory bound, and on the
small shared machines this runs on the DataLoader workers want the second core.
"""

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.math cimport INFINITY, copysign, floor, fmod
from libc.string cimport memcpy, memmove, memset
from posix.stdlib cimport posix_memalign

import numpy as np

cdef extern from *:
    """
    #include <stdint.h>
    /* Lemire's multiply-shift: an unbiased-enough bounded integer without a division. */
    static inline uint64_t tl_bounded(uint64_t x, uint64_t n) {
        return (uint64_t)(((__uint128_t)x * (__uint128_t)n) >> 64);
    }
    /* Index of the lowest set bit (x != 0). */
    static inline int64_t tl_ctz(uint64_t x) { return (int64_t)__builtin_ctzll(x); }
    """
    uint64_t tl_bounded(uint64_t x, uint64_t n) noexcept nogil
    int64_t tl_ctz(uint64_t x) noexcept nogil


# --------------------------------------------------------------------------------------------
# Scratch memory. A plan at 100k items needs a few MB of temporaries (sort buffers, the padded
# cut's dynamic program, the packed deal's step arrays). Fresh from malloc they are fresh pages
# from the kernel, and on the VMs this runs on a page fault costs about 2.4 us: 3 MB of scratch
# cost 2 ms, more than the work done in it. So the temporaries come from one buffer per process
# that is kept between plans (every epoch replans), up to SCRATCH_KEEP bytes; buffers of 2 MiB
# and more are 2 MiB-aligned, so that where transparent huge pages are on for all memory the
# kernel can back them with huge pages when it has some free. They are not madvise()d
# MADV_HUGEPAGE: with the usual defrag=madvise setting that makes every first touch wait for
# memory compaction, and a process's first 2M-item plan took a median of ~185 ms (up to 418)
# instead of ~137 ms (up to 221) (18 paired cold runs, 2 CPU VM). The buffer is handed out with the GIL held and marked busy
# for the nogil section that uses it; a second thread planning meanwhile gets its own malloc.
# --------------------------------------------------------------------------------------------
DEF HUGE = 2097152
DEF SCRATCH_KEEP = 268435456  # 256 MiB: the sort of a 2M-item plan needs 62 MiB

cdef void* _scratch = NULL
cdef size_t _scratch_cap = 0
cdef bint _scratch_busy = False


cdef void* _alloc_big(size_t nbytes, size_t* cap) noexcept:
    """malloc, or a 2 MiB-aligned block for 2 MiB and more; cap gets the size."""
    cdef void* p = NULL
    cdef size_t sz
    if nbytes < HUGE:
        cap[0] = nbytes
        return malloc(nbytes if nbytes > 0 else 1)
    sz = (nbytes + HUGE - 1) // HUGE * HUGE
    if posix_memalign(&p, HUGE, sz) != 0:
        return NULL
    cap[0] = sz
    return p


cdef void* _scratch_get(size_t nbytes, bint* owned) except NULL:
    """Scratch of at least nbytes (GIL held). Give it back with _scratch_put(p, owned[0])."""
    global _scratch, _scratch_cap, _scratch_busy
    cdef size_t cap = 0
    cdef void* p
    if not _scratch_busy and nbytes <= SCRATCH_KEEP:
        if _scratch_cap < nbytes:
            free(_scratch)
            _scratch = NULL
            _scratch_cap = 0
            _scratch = _alloc_big(nbytes, &cap)
            if _scratch == NULL:
                raise MemoryError(f"cannot allocate {nbytes} bytes of planning scratch")
            _scratch_cap = cap
        _scratch_busy = True
        owned[0] = False
        return _scratch
    p = _alloc_big(nbytes, &cap)
    if p == NULL:
        raise MemoryError(f"cannot allocate {nbytes} bytes of planning scratch")
    owned[0] = True
    return p


cdef void _scratch_put(void* p, bint owned) noexcept:
    """Give scratch back (GIL held)."""
    global _scratch_busy
    if owned:
        free(p)
    elif p != NULL:
        _scratch_busy = False


def scratch_bytes():
    """Bytes of planning scratch this process keeps between plans (0 before the first plan).

    Returns:
        int: the size of the kept buffer.
    """
    return _scratch_cap


def _hold_scratch(bint hold):
    """Mark the kept scratch busy (or free) as a plan in another thread would (tests only)."""
    global _scratch_busy
    _scratch_busy = hold


def release_scratch():
    """Free the kept planning scratch (the next plan allocates it again).

    Raises:
        RuntimeError: a plan is using it right now (in another thread).
    """
    global _scratch, _scratch_cap
    if _scratch_busy:
        raise RuntimeError("release_scratch: a plan in another thread is using the scratch buffer")
    free(_scratch)
    _scratch = NULL
    _scratch_cap = 0


# --------------------------------------------------------------------------------------------
# Result arrays. The plan's own arrays (sorted order and keys, the layout of the batches) are
# 0.8 MB each at 100k items: from malloc they are fresh pages again (200 faults, ~0.5 ms each
# array). empty() hands out numpy arrays over blocks (2 MiB-aligned from 2 MiB, like the
# scratch; smaller ones plain malloc), and a block whose array dies goes to a small pool
# (POOL_KEEP bytes) that the next plan (the next epoch's, or another sampler's) reuses. Blocks
# are handed out and returned with the GIL held (allocation in empty(), return in the owner's
# __dealloc__), so the pool needs no lock.
# --------------------------------------------------------------------------------------------
DEF POOL_MIN = 262144  # smaller arrays: np.empty (malloc reuses them without faults)
DEF POOL_KEEP = 134217728  # 128 MiB of free blocks at most
DEF POOL_SLOTS = 32

cdef void* _pool_ptr[POOL_SLOTS]
cdef size_t _pool_cap[POOL_SLOTS]
cdef int _pool_n = 0
cdef size_t _pool_bytes = 0


cdef void _pool_put(void* p, size_t cap) noexcept:
    global _pool_n, _pool_bytes
    if p == NULL:
        return
    if _pool_n < POOL_SLOTS and _pool_bytes + cap <= POOL_KEEP:
        _pool_ptr[_pool_n] = p
        _pool_cap[_pool_n] = cap
        _pool_n += 1
        _pool_bytes += cap
    else:
        free(p)


cdef void* _pool_take(size_t nbytes, size_t* cap) noexcept:
    """The smallest pooled block that holds nbytes without wasting more than half, else a new one."""
    global _pool_n, _pool_bytes
    cdef int i, best = -1
    cdef void* p
    for i in range(_pool_n):
        if _pool_cap[i] >= nbytes and _pool_cap[i] <= 2 * nbytes + HUGE:
            if best < 0 or _pool_cap[i] < _pool_cap[best]:
                best = i
    if best >= 0:
        p = _pool_ptr[best]
        cap[0] = _pool_cap[best]
        _pool_bytes -= _pool_cap[best]
        _pool_n -= 1
        _pool_ptr[best] = _pool_ptr[_pool_n]
        _pool_cap[best] = _pool_cap[_pool_n]
        return p
    return _alloc_big(nbytes, cap)


cdef class _Block:
    """Owner of one pooled block; exports it as a writable byte buffer for numpy."""

    cdef void* ptr
    cdef size_t cap
    cdef Py_ssize_t nbytes
    cdef Py_ssize_t one

    def __cinit__(self, Py_ssize_t nbytes):
        self.ptr = _pool_take(<size_t>nbytes, &self.cap)
        if self.ptr == NULL:
            raise MemoryError(f"cannot allocate {nbytes} bytes for a plan array")
        self.nbytes = nbytes
        self.one = 1

    def __getbuffer__(self, Py_buffer* buf, int flags):
        buf.buf = self.ptr
        buf.obj = self
        buf.len = self.nbytes
        buf.readonly = 0
        buf.itemsize = 1
        buf.format = "B"
        buf.ndim = 1
        buf.shape = &self.nbytes
        buf.strides = &self.one
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer* buf):
        pass

    def __dealloc__(self):
        _pool_put(self.ptr, self.cap)  # numpy holds the block while any view of it lives


def empty(Py_ssize_t n, dtype):
    """An uninitialised 1-D array of n items of ``dtype`` (a pooled block when large).

    Args:
        n: number of items, >= 0.
        dtype: numpy dtype.

    Returns:
        numpy.ndarray: writable, C-contiguous, like ``np.empty(n, dtype)``.
    """
    dt = np.dtype(dtype)
    if n < 0:
        raise ValueError(f"empty: n must be >= 0, got {n}")
    cdef Py_ssize_t nbytes = n * dt.itemsize
    if nbytes < POOL_MIN:
        return np.empty(n, dtype=dt)
    return np.frombuffer(_Block(nbytes), dtype=dt, count=n)


def pool_bytes():
    """Bytes of free result blocks kept for reuse.

    Returns:
        int: total size of the pooled blocks.
    """
    return _pool_bytes


def release_pool():
    """Free the pooled result blocks (arrays in use keep theirs)."""
    global _pool_n, _pool_bytes
    cdef int i
    for i in range(_pool_n):
        free(_pool_ptr[i])
    _pool_n = 0
    _pool_bytes = 0


# --------------------------------------------------------------------------------------------
# Random numbers: xoshiro256** seeded through splitmix64. The same 64-bit seed gives the same
# stream on every rank, every platform and every run, which is what keeps the ranks' plans equal.
# --------------------------------------------------------------------------------------------
cdef struct Rng:
    uint64_t s0, s1, s2, s3


cdef inline uint64_t _splitmix(uint64_t* x) noexcept nogil:
    x[0] += <uint64_t>0x9E3779B97F4A7C15
    cdef uint64_t z = x[0]
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
    return z ^ (z >> 31)


cdef inline void _rng_seed(Rng* r, uint64_t seed) noexcept nogil:
    cdef uint64_t x = seed
    r.s0 = _splitmix(&x)
    r.s1 = _splitmix(&x)
    r.s2 = _splitmix(&x)
    r.s3 = _splitmix(&x)


cdef inline uint64_t _rotl(uint64_t x, int k) noexcept nogil:
    return (x << k) | (x >> (64 - k))


cdef inline uint64_t _rng_next(Rng* r) noexcept nogil:
    cdef uint64_t result = _rotl(r.s1 * 5, 7) * 9
    cdef uint64_t t = r.s1 << 17
    r.s2 ^= r.s0
    r.s3 ^= r.s1
    r.s1 ^= r.s2
    r.s0 ^= r.s3
    r.s2 ^= t
    r.s3 = _rotl(r.s3, 45)
    return result


# Item ids and positions: int32 when they fit (half the memory of the arrays kept for an epoch).
ctypedef fused position_t:
    int32_t
    int64_t

DEF INT32_MAX = 2147483647


cdef inline void _fisher_yates(position_t* a, int64_t n, Rng* r) noexcept nogil:
    cdef int64_t i, j
    cdef position_t t
    i = n - 1
    while i > 0:
        j = <int64_t>tl_bounded(_rng_next(r), <uint64_t>(i + 1))
        t = a[i]
        a[i] = a[j]
        a[j] = t
        i -= 1


def permutation(int64_t n, uint64_t seed):
    """A permutation of range(n) drawn from ``seed`` (identical on every rank).

    Args:
        n: length, >= 0.
        seed: 64-bit seed.

    Returns:
        numpy.ndarray: int64 array of length n.
    """
    if n < 0:
        raise ValueError(f"permutation: n must be >= 0, got {n}")
    out = np.arange(n, dtype=np.int64)
    cdef int64_t[::1] o = out
    cdef Rng r
    _rng_seed(&r, seed)
    if n > 1:
        with nogil:  # pure index shuffling over memory we own; nothing touches Python objects
            _fisher_yates(&o[0], n, &r)
    return out


def randint(int64_t n, int64_t bound, uint64_t seed):
    """n integers drawn uniformly from [0, bound), from ``seed`` (identical on every rank).

    Args:
        n: how many, >= 0.
        bound: exclusive upper bound, >= 1.
        seed: 64-bit seed.

    Returns:
        numpy.ndarray: int64 array of length n.
    """
    if n < 0 or bound < 1:
        raise ValueError(f"randint: need n >= 0 and bound >= 1, got n={n}, bound={bound}")
    out = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] o = out
    cdef int64_t i
    cdef Rng r
    _rng_seed(&r, seed)
    with nogil:  # writes only into the array we just made
        for i in range(n):
            o[i] = <int64_t>tl_bounded(_rng_next(&r), <uint64_t>bound)
    return out


def uniform(int64_t n, uint64_t seed):
    """n doubles drawn uniformly from [0, 1) (53 random bits each), from ``seed``.

    Args:
        n: how many, >= 0.
        seed: 64-bit seed.

    Returns:
        numpy.ndarray: float64 array of length n.
    """
    if n < 0:
        raise ValueError(f"uniform: n must be >= 0, got {n}")
    out = np.empty(n, dtype=np.float64)
    cdef double[::1] o = out
    cdef int64_t i
    cdef Rng r
    _rng_seed(&r, seed)
    with nogil:  # writes only into the array we just made
        for i in range(n):
            o[i] = (_rng_next(&r) >> 11) * (1.0 / 9007199254740992.0)
    return out


def sample(int64_t n, int64_t k, uint64_t seed):
    """k distinct integers of range(n), sorted, drawn from ``seed`` (Floyd's algorithm).

    Used for the few samples that padding repeats or drop_last leaves out: O(k) work and memory,
    where a permutation of all n would write n fresh items to pick a handful.

    Args:
        n: population size, >= 0.
        k: how many, 0 <= k <= n.
        seed: 64-bit seed.

    Returns:
        numpy.ndarray: int64 array of length k, increasing.
    """
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"sample: need 0 <= k <= n, got n={n}, k={k}")
    out = np.empty(k, dtype=np.int64)
    if k == 0:
        return out
    cdef int64_t[::1] o = out
    # Open-addressing set of the chosen values, at most half full (values + 1; 0 marks empty).
    cdef int64_t cap = 2
    while cap < 2 * k:
        cap *= 2
    table_a = np.zeros(cap, dtype=np.int64)
    cdef int64_t[::1] table = table_a
    cdef int64_t j, t, h, m = 0
    cdef Rng r
    _rng_seed(&r, seed)
    with nogil:  # integer work over arrays we own
        for j in range(n - k, n):
            t = <int64_t>tl_bounded(_rng_next(&r), <uint64_t>(j + 1))
            # Floyd: take t unless it was taken already, then take j (never taken before).
            h = <int64_t>((<uint64_t>t * <uint64_t>0x9E3779B97F4A7C15) >> 20) & (cap - 1)
            while table[h] != 0 and table[h] != t + 1:
                h = (h + 1) & (cap - 1)
            if table[h] == t + 1:
                t = j
                h = <int64_t>((<uint64_t>t * <uint64_t>0x9E3779B97F4A7C15) >> 20) & (cap - 1)
                while table[h] != 0:
                    h = (h + 1) & (cap - 1)
            table[h] = t + 1
            o[m] = t
            m += 1
    out.sort()
    return out


def shuffle_runs(const double[::1] keys, int64_t[::1] order, uint64_t seed):
    """Shuffle, in place, each run of ``order`` whose items have equal ``keys``.

    Sorting once and shuffling ties each epoch gives the same result as a stable sort of a fresh
    permutation, at the cost of one sequential pass instead of a sort.

    Args:
        keys: float64 key per item.
        order: int64 item indices sorted by key; modified in place.
        seed: 64-bit seed.
    """
    cdef int64_t n = order.shape[0]
    cdef int64_t nk = keys.shape[0]
    cdef int64_t i, start
    cdef Rng r
    for i in range(n):
        if order[i] < 0 or order[i] >= nk:
            raise ValueError(f"shuffle_runs: order[{i}] = {order[i]} is outside [0, {nk})")
    _rng_seed(&r, seed)
    if n < 2:
        return
    with nogil:  # sequential scan over validated indices
        start = 0
        for i in range(1, n + 1):
            if i == n or keys[order[i]] != keys[order[start]]:
                if i - start > 1:
                    _fisher_yates(&order[start], i - start, &r)
                start = i


cdef int64_t _longest_run(const int64_t[::1] ends, int64_t n, str who, str name) except -1:
    """Check the ends of runs that tile [0, n) (increasing, the last == n; none when n == 0) and
    return the longest run's length."""
    cdef int64_t nr = ends.shape[0]
    cdef int64_t k, lo, longest = 0
    if (nr == 0) != (n == 0) or (nr > 0 and ends[nr - 1] != n):
        raise ValueError(f"{who}: {name} must end at {n}")
    for k in range(nr):
        lo = ends[k - 1] if k > 0 else 0
        if ends[k] <= lo:
            raise ValueError(f"{who}: {name}[{k}] = {ends[k]} does not increase")
        if ends[k] - lo > longest:
            longest = ends[k] - lo
    return longest


def shuffle_runs_at(int64_t[::1] order, const int64_t[::1] run_ends, uint64_t seed):
    """Shuffle, in place, each run ``order[run_ends[k - 1]:run_ends[k]]`` (the first from 0).

    ``shuffle_runs`` with the runs given: the same draws when run_ends are the ends of the runs
    of equal keys, without reading a key.

    Args:
        order: int64 items; modified in place.
        run_ends: int64 end of each run, increasing, the last == len(order).
        seed: 64-bit seed.

    Raises:
        ValueError: run_ends not increasing or not ending at len(order).
    """
    cdef int64_t n = order.shape[0]
    cdef int64_t nr = run_ends.shape[0]
    cdef int64_t k, lo
    cdef Rng r
    _longest_run(run_ends, n, "shuffle_runs_at", "run_ends")
    _rng_seed(&r, seed)
    with nogil:  # validated spans of order
        lo = 0
        for k in range(nr):
            if run_ends[k] - lo > 1:
                _fisher_yates(&order[lo], run_ends[k] - lo, &r)
            lo = run_ends[k]


# --------------------------------------------------------------------------------------------
# Stable LSD radix argsort on float64 keys (8 passes of 8 bits at most). Passes whose byte is the
# same for every key are skipped: integer-valued lengths stored as doubles have all-zero low
# mantissa bytes, so sorting token counts takes 2 to 3 passes, not 8.
# order_in == NULL stands for the identity order (item i at position i): sort_desc sorts all
# items, and materialising range(n) would be one more array of fresh pages.
# --------------------------------------------------------------------------------------------
cdef inline uint64_t _sortable(double x) noexcept nogil:
    cdef uint64_t u
    x = x + 0.0  # -0.0 -> +0.0, so that both zeros compare equal
    memcpy(&u, &x, 8)
    if u >> 63:
        return ~u
    return u | (<uint64_t>1 << 63)


cdef inline int64_t _item(const int64_t* order_in, int64_t i) noexcept nogil:
    return i if order_in == NULL else order_in[i]


cdef inline size_t _sort_scratch_bytes(int64_t n) noexcept nogil:
    """Scratch for either sort: the radix's 3n + 2048 words, or the counting's n + 3n + 1024."""
    return <size_t>(4 * n + 2048) * sizeof(int64_t)


cdef void _radix_argsort(const double* keys, const int64_t* order_in, int64_t* out, int64_t n,
                         bint descending, int64_t* scratch) noexcept nogil:
    """scratch holds _sort_scratch_bytes(n)."""
    cdef uint64_t* ka = <uint64_t*>scratch
    cdef uint64_t* kb = ka + n
    cdef int64_t* ib = scratch + 2 * n
    cdef int64_t* hist = scratch + 3 * n
    cdef int64_t* ia = out
    cdef int64_t i, pos, c
    cdef int d, b
    cdef uint64_t k
    cdef uint64_t* tk
    cdef int64_t* ti
    memset(hist, 0, 8 * 256 * sizeof(int64_t))
    for i in range(n):
        k = _sortable(keys[_item(order_in, i)])
        if descending:
            k = ~k
        ka[i] = k
        ia[i] = _item(order_in, i)
        for d in range(8):
            hist[d * 256 + ((k >> (8 * d)) & 255)] += 1
    for d in range(8):
        # Skip a byte that every key shares: the scatter would be the identity.
        if hist[d * 256 + ((ka[0] >> (8 * d)) & 255)] == n:
            continue
        pos = 0
        for b in range(256):
            c = hist[d * 256 + b]
            hist[d * 256 + b] = pos
            pos += c
        for i in range(n):
            b = <int>((ka[i] >> (8 * d)) & 255)
            pos = hist[d * 256 + b]
            hist[d * 256 + b] = pos + 1
            kb[pos] = ka[i]
            ib[pos] = ia[i]
        tk = ka; ka = kb; kb = tk
        ti = ia; ia = ib; ib = ti
    if ia != out:
        memcpy(out, ia, n * sizeof(int64_t))


# Lengths are usually small non-negative integers (token counts, frames): then one counting
# pass (2 reads, 1 scatter) beats the radix passes. Up to 2^22 buckets (32 MiB of counts).
DEF COUNTING_MAX = 4194304


ctypedef fused sort_key_t:
    double
    int64_t
    int32_t


cdef int _counting_argsort(const sort_key_t* keys, const int64_t* order_in, position_t* out, int64_t n,
                           bint descending, int64_t* hist, int64_t* nbuckets) noexcept nogil:
    """0 when sorted, 1 when the keys are not small non-negative integers (nothing written).

    Integer keys are read as the doubles a float64 copy of them would hold (the same checks, the
    same buckets), so a sampler sorts its integer complexities without making that copy.

    hist is scratch of _sort_scratch_bytes(n). Sorting all items (order_in NULL), the passes
    re-read the keys (sequentially) and the counts are hist[0:]; sorting order_in, the first n
    words hold each item's bucket as int32 (read back instead of gathering the keys again) and
    the counts follow, at hist[n:]. Only the first max(key) + 1 counts are touched. After a sort,
    count b is the end of bucket b in out for b < nbuckets[0] (if not NULL); the buckets are in
    output order (bucket b holds key nbuckets - 1 - b when descending, else b).
    """
    cdef double x
    cdef int64_t i, b, nb, pos, c, mx = 0
    cdef bint keep = order_in != NULL
    cdef int* bucket = <int*>hist
    cdef int64_t* count = hist + n if keep else hist
    for i in range(n):
        x = <double>keys[_item(order_in, i)]
        if not (x >= 0.0 and x <= COUNTING_MAX):
            return 1
        b = <int64_t>x
        if <double>b != x:
            return 1
        if keep:
            bucket[i] = <int>b
        if b > mx:
            mx = b
    nb = mx + 1
    if nb > 3 * n + 1024:
        return 1  # sparse keys: the radix sort touches less memory
    if nbuckets != NULL:
        nbuckets[0] = nb
    memset(count, 0, nb * sizeof(int64_t))
    if keep:
        if descending:
            for i in range(n):
                bucket[i] = <int>(nb - 1 - bucket[i])
        for i in range(n):
            count[bucket[i]] += 1
    else:
        # Keys re-read: no n-sized bucket array (n / 1024 fresh pages of a first plan) for one
        # float-to-int conversion per item and pass. The checks above make <int64_t> exact.
        for i in range(n):
            b = <int64_t>keys[i]
            count[(nb - 1 - b) if descending else b] += 1
    pos = 0
    for b in range(nb):
        c = count[b]
        count[b] = pos
        pos += c
    if keep:
        for i in range(n):
            b = bucket[i]
            out[count[b]] = <position_t>order_in[i]
            count[b] += 1
    else:
        for i in range(n):
            b = <int64_t>keys[i]
            if descending:
                b = nb - 1 - b
            out[count[b]] = <position_t>i
            count[b] += 1
    return 0


cdef int _sort_into(const double* keys, const int64_t* order_in, int64_t* out, int64_t n,
                    bint descending) except -1:
    """Counting sort when the keys allow it, else radix."""
    cdef bint owned
    cdef int64_t* scratch = <int64_t*>_scratch_get(_sort_scratch_bytes(n), &owned)
    cdef int rc
    with nogil:  # the sort reads keys and writes out and scratch only; no Python object touched
        rc = _counting_argsort(keys, order_in, out, n, descending, scratch, NULL)
        if rc == 1:
            _radix_argsort(keys, order_in, out, n, descending, scratch)
    _scratch_put(scratch, owned)
    return 0


def argsort(const double[::1] keys, const int64_t[::1] order_in, bint descending=False):
    """Stable argsort of ``order_in`` by ``keys[order_in]``; ties keep their order in order_in.

    Args:
        keys: float64 key per item (finite; NaN is rejected by the Python layer).
        order_in: int64 item indices (may repeat items).
        descending: sort from the largest key down (still stable).

    Returns:
        numpy.ndarray: the items of order_in, sorted (int64).
    """
    cdef int64_t n = order_in.shape[0]
    cdef int64_t nk = keys.shape[0]
    cdef int64_t i
    for i in range(n):
        if order_in[i] < 0 or order_in[i] >= nk:
            raise ValueError(f"argsort: order_in[{i}] = {order_in[i]} is outside [0, {nk})")
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    cdef int64_t[::1] o = out
    _sort_into(&keys[0], &order_in[0], &o[0], n, descending)
    return out


def sort_desc(const double[::1] keys):
    """Items sorted by key, largest first, ties by index.

    Args:
        keys: float64 key per item (finite).

    Returns:
        numpy.ndarray: int64 item indices (a pooled array; see empty()).
    """
    cdef int64_t n = keys.shape[0]
    out = empty(n, np.int64)
    if n == 0:
        return out
    cdef int64_t[::1] o = out
    _sort_into(&keys[0], NULL, &o[0], n, True)
    return out


def sort_desc_runs(const sort_key_t[::1] keys):
    """Items sorted by key, largest first, ties by index, and the run table of the sorted keys.

    The run table (one entry per distinct key, as ``key_runs`` gives it) comes straight from the
    counting sort's buckets when the keys are small non-negative integers (token counts), so
    padded planning needs no n-sized array of sorted keys.

    Args:
        keys: float64, int64 or int32 key per item (finite). Integer keys are sorted as the
            float64 values they convert to, without a float64 copy when they are small
            non-negative integers (a copy is made for the radix sort otherwise).

    Returns:
        tuple: (order, run_keys, run_ends): the item indices (int32 for at most 2^31 items, else
        int64), then the float64 key and the int64 end position of each run of equal keys in that
        order.
    """
    cdef int64_t n = keys.shape[0]
    cdef int64_t nb = 0, b, pos, nr = 0, end, i
    cdef int rc = 1
    cdef bint owned
    cdef bint narrow = n <= <int64_t>INT32_MAX + 1
    out = empty(n, np.int32 if narrow else np.int64)
    if n == 0:
        return out, np.empty(0, dtype=np.float64), np.empty(0, dtype=np.int64)
    cdef int32_t[::1] o32
    cdef int64_t[::1] o64
    cdef const double[::1] fk
    cdef int64_t* scratch = <int64_t*>_scratch_get(_sort_scratch_bytes(n), &owned)
    cdef int64_t* count = scratch  # the counting sort's bucket ends (see _counting_argsort)
    cdef int64_t* wide = NULL  # the int64 order of the radix sort
    cdef double[::1] rkv
    cdef int64_t[::1] rev
    if narrow:
        o32 = out
    else:
        o64 = out
    try:
        with nogil:  # the sort reads keys and writes out and scratch only
            if narrow:
                rc = _counting_argsort(&keys[0], NULL, &o32[0], n, True, scratch, &nb)
            else:
                rc = _counting_argsort(&keys[0], NULL, &o64[0], n, True, scratch, &nb)
        if rc == 1:
            if sort_key_t is double:
                fk = keys
            else:
                fk = np.asarray(keys, dtype=np.float64)  # large or negative integers: radix-sort doubles
            with nogil:
                # The radix sort writes int64: into the order itself, or into the last n words of
                # the scratch (past the radix's 3n + 2048), then narrowed.
                wide = &o64[0] if not narrow else scratch + 3 * n + 2048
                _radix_argsort(&fk[0], NULL, wide, n, True, scratch)
                nr = _runs_of_sorted(&fk[0], wide, n, NULL, NULL)
        else:
            pos = 0
            for b in range(nb):
                if count[b] > pos:
                    nr += 1
                    pos = count[b]
        rk = np.empty(nr, dtype=np.float64)
        re = np.empty(nr, dtype=np.int64)
        rkv = rk
        rev = re
        with nogil:  # the run table, from the buckets' ends or from the sorted keys
            if rc == 1:
                _runs_of_sorted(&fk[0], wide, n, &rkv[0], &rev[0])
                if narrow:
                    for i in range(n):
                        o32[i] = <int32_t>wide[i]
            else:
                pos = 0
                nr = 0
                for b in range(nb):
                    end = count[b]
                    if end > pos:
                        rkv[nr] = <double>(nb - 1 - b)
                        rev[nr] = end
                        nr += 1
                        pos = end
    finally:
        _scratch_put(scratch, owned)
    return out, rk, re


def rank_stream(const int64_t[::1] items, const int64_t[::1] chunk_order, const int64_t[::1] rot,
                int64_t world, int64_t rank):
    """One rank's indices: position ``(rank + rot[c]) % world`` of each chunk c, chunks in order.

    Args:
        items: the sorted items, ``len(chunk_order) * world`` of them.
        chunk_order: the order in which chunks are visited (a permutation of the chunks).
        rot: per chunk, a rotation so that no rank always gets the largest item of a chunk.
        world: number of ranks.
        rank: this rank.

    Returns:
        numpy.ndarray: int64 array of ``len(chunk_order)`` item indices.
    """
    cdef int64_t nc = chunk_order.shape[0]
    cdef int64_t i, c
    if world <= 0 or rank < 0 or rank >= world:
        raise ValueError(f"rank_stream: rank {rank} outside [0, {world})")
    # items.shape[0] // world, not nc * world: that product wraps for a huge world
    if items.shape[0] % world != 0 or items.shape[0] // world != nc or rot.shape[0] != nc:
        raise ValueError(f"rank_stream: {items.shape[0]} items, {rot.shape[0]} rotations for {nc} chunks")
    for i in range(nc):
        if chunk_order[i] < 0 or chunk_order[i] >= nc:
            raise ValueError(f"rank_stream: chunk_order[{i}] = {chunk_order[i]} outside [0, {nc})")
        # a negative rotation would index before the chunk (C's % keeps the sign under cdivision)
        if rot[i] < 0 or rot[i] >= world:
            raise ValueError(f"rank_stream: rot[{i}] = {rot[i]} outside [0, {world})")
    out = np.empty(nc, dtype=np.int64)
    cdef int64_t[::1] o = out
    with nogil:  # gathers from validated positions
        for i in range(nc):
            c = chunk_order[i]
            o[i] = items[c * world + (rank + rot[c]) % world]
    return out


cdef class IntStream:
    """Iterator over an int64 array that makes each Python int only when it is asked for.

    A sampler's epoch is consumed one index at a time; a list of them all (``tolist()``) would hold
    a million int objects per rank at N = 2M, W = 2 (36 MB of fresh pages on a first plan). The
    length hint is what is left, so a sampler can tell how far its consumer got.

    Args:
        values: int64 array (kept alive by the stream).
        start: position of the first value to yield.
    """

    cdef object _values
    cdef const int64_t[::1] _v
    cdef Py_ssize_t _pos

    def __cinit__(self, values, Py_ssize_t start=0):
        self._values = values
        self._v = values
        if start < 0 or start > self._v.shape[0]:
            raise ValueError(f"IntStream: start {start} outside [0, {self._v.shape[0]}]")
        self._pos = start

    def __iter__(self):
        return self

    def __next__(self):
        cdef Py_ssize_t i = self._pos
        if i >= self._v.shape[0]:
            raise StopIteration
        self._pos = i + 1
        return self._v[i]

    def __length_hint__(self):
        return self._v.shape[0] - self._pos

    def __reduce__(self):
        return (IntStream, (self._values, self._pos))


# --------------------------------------------------------------------------------------------
# Padded mode: items sorted by length, longest first; each batch is a run of consecutive items
# whose padded cost (count * cost of its first = longest item) stays under the budget.
#
# The planner works on the sorted costs as runs of equal cost: run r holds positions
# [run_ends[r - 1], run_ends[r]) (run_ends[-1] taken as 0), all of cost run_costs[r]. Items of a
# run are interchangeable, so a plan needs only the run table (a few thousand entries for token
# counts, whatever N), not a cost per item: no n-sized array of sorted costs and no n-sized
# dynamic program, which at 100k items were ~870 fresh pages (~2 ms) of a process's first plan.
# --------------------------------------------------------------------------------------------
cdef inline int64_t _run_of(const int64_t* run_ends, int64_t r, int64_t q) noexcept nogil:
    """The run holding position q (< n), searching forward from run r (positions only grow)."""
    while run_ends[r] <= q:
        r += 1
    return r


cdef int64_t _check_runs(const double[::1] run_costs, const int64_t[::1] run_ends, str who) except -1:
    """Validate a run table (GIL held); returns the number of items."""
    cdef int64_t nr = run_costs.shape[0]
    cdef int64_t r
    if run_ends.shape[0] != nr:
        raise ValueError(f"{who}: {nr} run costs but {run_ends.shape[0]} run ends")
    for r in range(nr):
        if not (run_costs[r] >= 0.0 and run_costs[r] < INFINITY) or (r > 0 and run_costs[r] > run_costs[r - 1]):
            raise ValueError(f"{who}: run {r} has cost {run_costs[r]}; costs must be finite, >= 0 and non-increasing")
        if run_ends[r] <= (run_ends[r - 1] if r > 0 else 0):
            raise ValueError(f"{who}: run {r} ends at {run_ends[r]}; run ends must be positive and increasing")
    return run_ends[nr - 1] if nr > 0 else 0


cdef int64_t _runs_of_sorted(const double* keys, const int64_t* order, int64_t n, double* run_keys,
                             int64_t* run_ends) noexcept nogil:
    """Runs of equal keys[order[i]] (order NULL: keys[i]); writes them when run_keys is not NULL."""
    cdef int64_t i, nr = 0
    cdef double prev = 0.0, x
    for i in range(n):
        x = keys[i] if order == NULL else keys[order[i]]
        if i > 0 and x != prev:
            if run_keys != NULL:
                run_keys[nr] = prev
                run_ends[nr] = i
            nr += 1
        prev = x
    if n > 0:
        if run_keys != NULL:
            run_keys[nr] = prev
            run_ends[nr] = n
        nr += 1
    return nr


def key_runs(const double[::1] keys, const int64_t[::1] order=None):
    """The run table of keys[order] (or of keys, already sorted): (run_keys, run_ends).

    Args:
        keys: float64 key per item.
        order: int64 positions into keys (validated here), or None for keys in their own order.

    Returns:
        tuple: float64 key of each run of equal consecutive keys and int64 end position of each
        run (the last is the number of items).
    """
    cdef int64_t n = keys.shape[0] if order is None else order.shape[0]
    cdef int64_t nk = keys.shape[0]
    cdef int64_t i, nr
    cdef const int64_t* op = NULL
    if order is not None:
        for i in range(n):
            if order[i] < 0 or order[i] >= nk:
                raise ValueError(f"key_runs: order[{i}] = {order[i]} is outside [0, {nk})")
        if n > 0:
            op = &order[0]
    if n == 0:
        return np.empty(0, dtype=np.float64), np.empty(0, dtype=np.int64)
    with nogil:  # counting pass over validated positions
        nr = _runs_of_sorted(&keys[0], op, n, NULL, NULL)
    rk = np.empty(nr, dtype=np.float64)
    re = np.empty(nr, dtype=np.int64)
    cdef double[::1] rkv = rk
    cdef int64_t[::1] rev = re
    with nogil:  # writing pass
        _runs_of_sorted(&keys[0], op, n, &rkv[0], &rev[0])
    return rk, re


cdef inline int64_t _take(double c, double target, double budget, int64_t remaining) noexcept nogil:
    """How many items of cost ``c`` (the longest of the batch) to put in a batch aiming at target."""
    cdef int64_t k
    cdef double q
    if c <= 0.0:
        return remaining  # zero-cost items pad to nothing: one batch takes them all
    q = target / c
    if not q < <double>remaining:
        k = remaining  # all that are left fit the target (casting a q >= 2^63 would be undefined)
    else:
        k = <int64_t>q
    if k < 1:
        k = 1
    # One more item if it lands closer to the step's target and stays under the hard cap.
    if (k + 1) * c <= budget and (k + 1) * c - target < target - k * c:
        k += 1
    # The hard cap: k * c <= budget unless a single item is over budget (its own batch).
    while k > 1 and k * c > budget:
        k -= 1
    if k > remaining:
        k = remaining
    return k


cdef inline double _py_floordiv(double x, double y) noexcept nogil:
    """``x // y`` exactly as Python computes it for floats (y != 0): CPython's _float_div_mod.

    Not floor(x / y): Python divides x - fmod(x, y) and snaps to the nearest integer, so
    ``1.0 // 0.1`` is 9.0 where floor(1.0 / 0.1) is 10.0. packed_fill must match the Python loop
    it replaced item for item (the plan is what ranks and resumed runs agree on).
    """
    cdef double mod = fmod(x, y)
    cdef double div = (x - mod) / y
    cdef double fl
    if mod != 0.0 and (y < 0.0) != (mod < 0.0):
        div -= 1.0
    if div != 0.0:
        fl = floor(div)
        if div - fl > 0.5:
            fl += 1.0
        return fl
    return copysign(0.0, x / y)


cdef inline int64_t _fill_take(double c, double load, double budget, int64_t avail) noexcept nogil:
    """How many of ``avail`` items of cost ``c`` a rank already holding ``load`` takes: as many as
    keep it within ``budget`` (load <= budget, so the quotient below is >= 0 and < avail)."""
    cdef int64_t take
    # avail < 2^31 (checked by packed_fill): exact as a double, so the comparison is Python's.
    if c <= 0.0 or (budget - load) / c >= <double>avail:
        take = avail
    else:
        take = <int64_t>_py_floordiv(budget - load, c)
    # The quotient can round up past the budget: step back as the Python loop did.
    while take > 0 and load + take * c > budget:
        take -= 1
    return take


cdef inline bint _run_ok(const double* rc, const int64_t* re, int64_t r, int64_t n) noexcept nogil:
    """Run r obeys _check_runs' rules given run r - 1 does (and ends within the n items)."""
    if not (rc[r] >= 0.0 and rc[r] < INFINITY) or re[r] > n:
        return False
    if r == 0:
        return re[0] > 0
    return rc[r] <= rc[r - 1] and re[r] > re[r - 1]


cdef int64_t _packed_fill(const double* rc, const int64_t* re, int64_t nr, int64_t p, double budget,
                          int64_t* fill, int64_t slots, int64_t* bad) noexcept nogil:
    """The walk of packed_fill; returns the position after the last item taken, or -1 with
    ``bad[0]`` set to the first run on the way that breaks the run table's rules."""
    cdef int64_t n = re[nr - 1]
    cdef int64_t r = 0, j = 0, take, avail
    cdef double load, c
    # Only the runs walked over are read, so only they are checked (one compare each, on data
    # the walk loads anyway): a full check of a 2M-run table costs more than a short fill.
    if not _run_ok(rc, re, 0, n):
        bad[0] = 0
        return -1
    while j < slots and p < n:
        load = 0.0
        while p < n:
            while re[r] <= p:  # stops at run nr - 1 at the latest: re[nr - 1] = n > p
                r += 1
                if not _run_ok(rc, re, r, n):
                    bad[0] = r
                    return -1
            c = rc[r]
            avail = re[r] - p
            take = _fill_take(c, load, budget, avail)
            load += take * c
            p += take
            if take < avail:
                break  # the next item does not fit this rank
        fill[j] = p
        j += 1
    while j < slots:
        fill[j] = p  # no items left: the rank stays empty (the sampler fills or drops the step)
        j += 1
    return p


def packed_fill(const double[::1] run_costs, const int64_t[::1] run_ends, int64_t p, double budget,
                int64_t[::1] fill):
    """Fill ranks one after another with the items from position ``p`` on, each up to ``budget``.

    The free ranks of packed mode's last step of items over the budget (see _packed_over_budget
    in trainloom/data/samplers.py): rank j takes the items from where rank j - 1 stopped, as many
    as keep its total cost <= budget, and stops at the first item that does not fit. The walk is
    per run of equal costs (one division per run, not per item) with the GIL released: at 2M
    distinct float costs (a run each), B = 1e8, one item over it and W = 8 it takes 3-6 ms where
    the Python loop it replaces took ~470 ms of the epoch's plan.

    Args:
        run_costs: cost of each run of equal costs, non-increasing, finite, >= 0 (the runs
            walked over are checked).
        run_ends: end position of each run (the last is the number of items n <= 2^31 - 1).
        p: first position to take, 0 <= p <= n.
        budget: cap on each rank's total cost, finite and >= 0 (the sampler's is > 0; 0 takes
            only zero-cost items).
        fill: output, the end position of each rank's items (rank j holds
            ``[fill[j - 1], fill[j])``, the first from p); ranks left when the items run out get n.

    Returns:
        int: the position after the last item taken (``fill[-1]``, or p when fill is empty).
    """
    cdef int64_t nr = run_costs.shape[0]
    cdef int64_t n, q, bad = 0
    if run_ends.shape[0] != nr:
        raise ValueError(f"packed_fill: {nr} run costs but {run_ends.shape[0]} run ends")
    if nr == 0:
        raise ValueError("packed_fill: no items")
    n = run_ends[nr - 1]
    if n > INT32_MAX:
        raise ValueError(f"packed_fill: {n} items; packed mode plans at most {INT32_MAX}")
    if p < 0 or p > n:
        raise ValueError(f"packed_fill: p={p} is outside [0, {n}]")
    # NaN, inf (inf - inf) or < 0 would cast a NaN quotient to an integer, or make it negative.
    if not (budget >= 0.0 and budget < INFINITY):
        raise ValueError(f"packed_fill: budget={budget}")
    if fill.shape[0] == 0:
        return p
    with nogil:  # the walk reads runs up to the one holding position n - 1 and writes only fill
        q = _packed_fill(&run_costs[0], &run_ends[0], nr, p, budget, &fill[0], fill.shape[0], &bad)
    if q < 0:
        if not (run_costs[bad] >= 0.0 and run_costs[bad] < INFINITY) or (
                bad > 0 and run_costs[bad] > run_costs[bad - 1]):
            raise ValueError(f"packed_fill: run {bad} has cost {run_costs[bad]}; "
                             "costs must be finite, >= 0 and non-increasing")
        raise ValueError(f"packed_fill: run {bad} ends at {run_ends[bad]}; "
                         "run ends must be positive and increasing")
    return q


cdef inline double _step_ratio(const double* rc, const int64_t* re, int64_t r, int64_t n, int64_t p,
                               int64_t world, double target, double budget) noexcept nogil:
    """max/mean padded cost of the step that starts at p (in run r) with this target; -1 if it
    cannot fill."""
    cdef int64_t j, k, q = p
    cdef double c, mx = 0.0, total = 0.0
    for j in range(world):
        if q >= n:
            return -1.0
        r = _run_of(re, r, q)
        k = _take(rc[r], target, budget, n - q)
        c = k * rc[r]
        total += c
        if c > mx:
            mx = c
        q += k
    if total <= 0.0:
        return 1.0
    return mx * world / total


# Targets tried per step besides the greedy one: budget * (1 - i / PADDED_TRY_DIV) for i below
# PADDED_TRIES. Among long items a step's batches hold 2 to 5 items and the greedy target can
# leave one batch a whole item short (a straggler ratio of 1.2 and more); a slightly lower
# target often evens them. A candidate must beat the greedy target by PADDED_GAIN to be used,
# so steps of short items keep the fullest batches.
DEF PADDED_TRIES = 8
DEF PADDED_TRY_DIV = 16.0
DEF PADDED_GAIN = 1e-3


def padded_steps(const double[::1] run_costs, const int64_t[::1] run_ends, int64_t world, double budget,
                 int64_t[::1] ends):
    """Cut items (a run table of costs, longest first) into full steps of ``world`` batches.

    Every batch of a step aims at one target padded cost: the greedy one (as many of the step's
    longest item as fit the budget) or, when it balances the step clearly better, one of a few
    lower targets. Stops before the first step that the remaining items cannot fill; the caller
    re-cuts that tail.

    Args:
        run_costs: cost (a*len + b*len^2) of each run of equal costs, non-increasing.
        run_ends: end position of each run (the last is the number of items n).
        world: batches per step.
        budget: hard cap on count * cost(longest).
        ends: output, end position of each batch (capacity >= n).

    Returns:
        tuple: (number of batches written, position where the uncut tail starts).
    """
    cdef int64_t n = _check_runs(run_costs, run_ends, "padded_steps")
    cdef int64_t p = 0, q, nb = 0, j, k, i, r = 0, rq
    cdef double target, c0, best, rt, t
    cdef const double* rc
    cdef const int64_t* re
    if world <= 0 or not budget > 0.0:
        raise ValueError(f"padded_steps: world={world}, budget={budget}")
    if ends.shape[0] < n:
        raise ValueError(f"padded_steps: ends has {ends.shape[0]} slots for {n} items")
    if n == 0:
        return 0, 0
    rc = &run_costs[0]
    re = &run_ends[0]
    with nogil:  # greedy walk over a validated run table; writes only into ends
        while p < n:
            r = _run_of(re, r, p)
            c0 = rc[r]
            if c0 <= 0.0 or not budget / c0 < <double>(n - p):
                target = budget  # all that are left fit (and a quotient >= 2^63 must not be cast)
            else:
                k = <int64_t>(budget / c0)
                if k < 1:
                    k = 1
                target = k * c0
                if target > budget:
                    target = budget
            best = _step_ratio(rc, re, r, n, p, world, target, budget)
            if best < 0.0:
                break  # an incomplete step: the caller balances the tail
            if best > 1.0 + PADDED_GAIN:
                for i in range(PADDED_TRIES):
                    t = budget * (1.0 - i / PADDED_TRY_DIV)
                    if t >= target:
                        continue
                    rt = _step_ratio(rc, re, r, n, p, world, t, budget)
                    if rt >= 0.0 and rt < best - PADDED_GAIN:
                        best = rt
                        target = t
            q = p
            rq = r
            for j in range(world):
                rq = _run_of(re, rq, q)
                k = _take(rc[rq], target, budget, n - q)
                q += k
                ends[nb] = q
                nb += 1
            p = q
    return nb, p


cdef int64_t _greedy(const double* rc, const int64_t* re, int64_t p, int64_t q, double target, double budget,
                     int64_t* ends, int64_t max_batches) noexcept nogil:
    """The greedy walk of greedy_cut over a validated run table."""
    cdef int64_t nb = 0, k, r = 0
    while p < q:
        if nb >= max_batches:
            return max_batches + 1
        r = _run_of(re, r, p)
        k = _take(rc[r], target, budget, q - p)
        p += k
        ends[nb] = p
        nb += 1
    return nb


cdef int64_t _check_cut(const double[::1] run_costs, const int64_t[::1] run_ends, int64_t p, int64_t q,
                        int64_t[::1] ends, int64_t max_batches, str who) except -1:
    """Validate a cut's run table, range and output size (GIL held)."""
    cdef int64_t n = _check_runs(run_costs, run_ends, who)
    if p < 0 or q > n or p > q:
        raise ValueError(f"{who}: bad range [{p}, {q}) of {n}")
    if ends.shape[0] < max_batches:
        raise ValueError(f"{who}: ends too small")
    return n


def greedy_cut(const double[::1] run_costs, const int64_t[::1] run_ends, int64_t p, int64_t q, double target,
               double budget, int64_t[::1] ends, int64_t max_batches):
    """Cut positions [p, q) of a run table into batches aiming at ``target`` (capped by ``budget``).

    Returns:
        int: the number of batches, or ``max_batches + 1`` as soon as more would be needed (only
        the first max_batches ends are written).
    """
    _check_cut(run_costs, run_ends, p, q, ends, max_batches, "greedy_cut")
    if p == q:
        return 0
    if max_batches == 0:
        return 1  # items but no room for a batch (and maybe no ends to point at)
    cdef int64_t nb
    with nogil:  # greedy walk; writes only the first max_batches ends
        nb = _greedy(&run_costs[0], &run_ends[0], p, q, target, budget, &ends[0], max_batches)
    return nb


def lowest_target_cut(const double[::1] run_costs, const int64_t[::1] run_ends, int64_t p, int64_t q,
                      double budget, int64_t want, int64_t[::1] ends):
    """greedy_cut of [p, q) at the smallest target (bisected, 60 halvings of [0, hi]) that needs
    at most ``want`` batches: the most even batches that fill ``want`` slots or fewer. hi is the
    budget or, when smaller, the padded cost of the whole range as one batch ((q - p) times the
    cost of its first item), above which every target cuts the same: the search keeps its
    relative precision under budgets far beyond the items' costs (over [0, budget], a budget of
    2^62 and 10 items of cost 1 were bisected to within 4 only, and cut into 8 + 2).

    One validation and one call for the whole search (the tail of a padded plan), instead of 61
    calls of greedy_cut that each re-check the run table.

    Returns:
        int: the number of batches written to ends (<= want when want is at least the number of
        batches the budget itself needs).
    """
    _check_cut(run_costs, run_ends, p, q, ends, want, "lowest_target_cut")
    if p == q:
        return 0
    if want == 0:
        return 1  # as greedy_cut: more batches than allowed
    cdef double lo = 0.0, hi = budget, mid, whole
    cdef int it
    cdef int64_t k
    cdef const double* rc = &run_costs[0]
    cdef const int64_t* re = &run_ends[0]
    whole = (q - p) * rc[_run_of(re, 0, p)]
    with nogil:  # the batch count falls as the target rises
        if whole < hi and _greedy(rc, re, p, q, whole, budget, &ends[0], want) <= want:
            hi = whole  # (checked: rounding in _take must not leave the range's last item out)
        for it in range(60):
            mid = 0.5 * (lo + hi)
            if _greedy(rc, re, p, q, mid, budget, &ends[0], want) <= want:
                hi = mid
            else:
                lo = mid
        k = _greedy(rc, re, p, q, hi, budget, &ends[0], want)
    return k


# --------------------------------------------------------------------------------------------
# Packed mode: shuffled items cut into steps of equal total cost, then each step's items dealt
# longest first to the least-loaded rank (LPT) without ever exceeding the budget.
# --------------------------------------------------------------------------------------------
cdef struct Bin:
    double load
    int64_t id


cdef inline void _sift_down(Bin* heap, int64_t size, int64_t i) noexcept nogil:
    # Min-heap on load with the entries stored inline (no indirection to a loads array) and a
    # moving hole instead of swaps: the deal of 2M items at W = 64 spent most of its time here.
    cdef Bin x = heap[i]
    cdef int64_t l, m
    while True:
        l = 2 * i + 1
        if l >= size:
            break
        m = l
        if l + 1 < size and heap[l + 1].load < heap[l].load:
            m = l + 1
        if heap[m].load < x.load:
            heap[i] = heap[m]
            i = m
        else:
            break
    heap[i] = x


cdef inline void _reset_bins(Bin* heap, int64_t* cnt, int64_t world) noexcept nogil:
    cdef int64_t j
    for j in range(world):
        heap[j].load = 0.0
        heap[j].id = j
        cnt[j] = 0


cdef inline int _try_place(int64_t it, double c, double budget, Bin* heap, int64_t* size,
                           int64_t* cnt, int64_t* rr, int64_t world, int64_t slot_base,
                           int64_t* slot_of) noexcept nogil:
    """Put item ``it`` into the least-loaded open bin; 0 on success, 1 when it fits no bin."""
    cdef int64_t bin_
    if size[0] == 0:
        return 1
    if c == 0.0:
        # Zero-cost items change no load: deal them round robin over the open bins so that they
        # spread out instead of all landing on the heap's root (closed bins hold an item over
        # budget alone and must stay alone).
        bin_ = heap[rr[0] % size[0]].id
        rr[0] += 1
        cnt[bin_] += 1
        slot_of[it] = slot_base + bin_
        return 0
    bin_ = heap[0].id
    if c > budget:
        if cnt[bin_] != 0:
            return 1
        # Over budget alone: the item gets this bin, which then closes (leaves the heap).
        cnt[bin_] = 1
        slot_of[it] = slot_base + bin_
        size[0] -= 1
        heap[0] = heap[size[0]]
        _sift_down(heap, size[0], 0)
        return 0
    if heap[0].load + c > budget:
        return 1  # the least-loaded bin is the roomiest: no bin can take it
    heap[0].load += c
    cnt[bin_] += 1
    slot_of[it] = slot_base + bin_
    _sift_down(heap, size[0], 0)
    return 0


# Blocks dealt together (see _packed): 8 int64 slots fill one 64-byte cache line of each step.
DEF DEAL_TILE = 8


cdef inline int64_t _packed_tmp_words(int64_t n, int64_t world, int64_t nsteps) noexcept nogil:
    """int64 words of _packed's tmp: heap, cnt, bin_start, off, perm, tile, the tile's encoded
    items (int32), one step's bins (bin_of), the run at each block's start (int32), one step's
    positions (int32), then the per-slot counts of the planned steps. A few words per step, per
    block and per bin: no n-sized array (step_items is the plan itself; see packed_plan)."""
    cdef int64_t per_step = n // nsteps  # a step holds at most per_step + 1 items
    return (4 * world + (DEAL_TILE + DEAL_TILE // 2 + 2) * nsteps + 1 + (per_step + 1) + (per_step + 3) // 2
            + (per_step + 2) // 2 + nsteps * world)


cdef inline int _bits(int64_t x) noexcept nogil:
    """Bits needed to write x >= 0 (0 for 0)."""
    cdef int b = 0
    while x > 0:
        b += 1
        x >>= 1
    return b


cdef inline int64_t _run_in(const int64_t* re, int64_t lo, int64_t hi, int64_t q) noexcept nogil:
    """The run holding position q, known to be one of runs lo to hi: a binary search whose
    compare feeds a conditional move, not a branch (which runs a search ends in is random)."""
    cdef int64_t base = lo, m = hi - lo + 1, half
    while m > 1:
        half = m >> 1
        base = base + half if re[base + half - 1] <= q else base
        m -= half
    return base


cdef inline void _fill_block(const int64_t* re, int64_t r0, int64_t p0, int64_t m, int bj, bint enc,
                             int32_t* out) noexcept nogil:
    """out[j] for the m positions p0 + j of one block (r0: the run holding p0): the position,
    or with enc the run and the offset packed as ((run - r0) << bj) | j (see _packed)."""
    cdef int64_t r = r0, j = 0, e, i
    if not enc:
        for i in range(m):
            out[i] = <int32_t>(p0 + i)
        return
    while j < m:  # run by run: the runs are non-empty, and r0's holds p0
        e = re[r] - p0
        if e > m:
            e = m
        for i in range(j, e):
            out[i] = <int32_t>(((r - r0) << bj) | i)
        j = e
        r += 1


cdef int64_t _packed(const double* rc, const int64_t* re, int64_t nr, int64_t n, bint shuffle, uint64_t seed,
                     int64_t world, double budget, int64_t nsteps, int64_t* tmp, int32_t* out_items,
                     int64_t** drain_counts) noexcept nogil:
    """Deal positions of the longest-first order into slots ``step * world + bin``.

    The costs come as a run table of nr runs (rc, re; see padded mode). No per-item cost array
    is kept: each entry of step_items carries its item's run, packed with the item's offset in
    its block (see phases 1-2), and the cost is rc[run] where the deal uses it.
    Each step's items are written to out_items as soon as the step is dealt, grouped by bin
    (slot order), each bin in increasing position, i.e. longest first: positions, not item ids,
    so no per-step sort. The planned steps' per-slot counts are left in tmp (see
    _packed_tmp_words); the items that fit no bin of their step are dealt to extra steps at the
    end, whose per-slot counts go to a malloc'd array in drain_counts[0] (the caller frees it).
    out_items has n int32 entries (positions: the caller checks n < 2^31) and may hold anything.
    The steps are first laid out in it (step_items, step s at off[s]:off[s + 1]); a step's
    entries are all read (into pos_of) before its bins are written, and those land below the next
    step's entries (at most as many items precede them in the output as in the layout).
    Returns the number of steps used, or -1 when out of memory.
    """
    cdef int32_t* step_items = out_items  # the steps' layout, overwritten step by step (see above)
    cdef Bin* heap = <Bin*>tmp  # Bin is 2 int64 wide: 2 * world slots
    cdef int64_t* cnt = tmp + 2 * world
    cdef int64_t* bin_start = tmp + 3 * world
    cdef int64_t* off = tmp + 4 * world
    cdef int64_t* perm = off + nsteps + 1
    cdef int64_t* tile = perm + nsteps
    cdef int32_t* wenc = <int32_t*>(tile + DEAL_TILE * nsteps)  # the tile's step_items entries by position
    # each item of a step: its bin, and its place in the bin << 32
    cdef int64_t per_step = n // nsteps  # a step holds at most per_step + 1 items (see _packed_tmp_words)
    cdef int64_t* bin_of = tile + (DEAL_TILE + DEAL_TILE // 2) * nsteps
    cdef int64_t* block_words = bin_of + (per_step + 1)
    cdef int32_t* block_run = <int32_t*>block_words  # the run holding each block's start (<= per_step + 2)
    cdef int64_t* pos_words = block_words + (per_step + 3) // 2
    cdef int32_t* pos_of = <int32_t*>pos_words  # a step's items (<= per_step + 1)
    cdef int64_t* counts = pos_words + (per_step + 2) // 2
    cdef int64_t i, s, si, size, nleft, step, rr = 0, k, j, pos, base, b, kb, run, lo, hi, wpos, v
    cdef int64_t nblk, dmax = 0, jmask, e, nw
    cdef uint64_t word
    cdef uint64_t* lbits = NULL
    cdef int bj
    cdef bint enc
    cdef int64_t left_cap = 0, dcap = 0, ndslots = 0
    cdef bint ok
    cdef int64_t* left = NULL  # positions of the items left over, in step order (then sorted)
    cdef int64_t* grown
    cdef int64_t* dcounts = NULL
    cdef int64_t* lslot = NULL
    cdef int64_t nfull = n // nsteps
    cdef int64_t rem = n - nfull * nsteps
    cdef Rng r

    # Phases 1-2: blocks of nsteps consecutive positions (neighbours in cost) are dealt one item
    # to every step, in a fresh random order per block. Every step thus gets one item of every
    # block: the steps have nearly equal cost by construction, each step's items come out
    # longest first, and memory is touched sequentially or within a block's nsteps cache lines.
    # (A shuffled stream cut at equal cumulative cost did the same with two random accesses per
    # item and a scatter into nsteps buckets: 3x slower at 2M items.)
    _rng_seed(&r, seed)
    for j in range(nsteps):
        perm[j] = j
    if shuffle:
        _fisher_yates(perm, nsteps, &r)
    # Step s holds nfull items, plus the last slot for one item of the partial last block when
    # s is among the first `rem` entries of this permutation.
    for s in range(nsteps + 1):
        off[s] = nfull
    for j in range(rem):
        off[perm[j] + 1] += 1
    off[0] = 0
    for s in range(nsteps):
        off[s + 1] += off[s]
    base = nfull * nsteps
    # Costs without a cost array: an item of block k (positions k * nsteps + j, j < nsteps) lies
    # in one of runs block_run[k] to block_run[k + 1], so its step_items entry can carry the run as
    # a delta from block_run[k] next to j: ((run - block_run[k]) << bj) | j, bj = bits(nsteps - 1).
    # Phase 3 then gets position and cost with a shift, a mask and two loads of small arrays
    # (searching each item's run there made a plan of 100k items up to 15% slower). When the two
    # do not fit 31 bits (more than ~2^15 steps with blocks spanning as many runs) the entries are
    # plain positions, and phase 3 does search each item's run, between those two bounds.
    nblk = nfull + (rem > 0)
    run = 0
    for k in range(nblk):
        run = _run_of(re, run, k * nsteps)
        block_run[k] = <int32_t>run  # run indices < nr <= n < 2^31
    block_run[nblk] = <int32_t>(nr - 1)
    for k in range(nblk):
        if block_run[k + 1] - block_run[k] > dmax:
            dmax = block_run[k + 1] - block_run[k]
    bj = _bits(nsteps - 1)
    enc = bj + _bits(dmax) <= 31
    jmask = (<int64_t>1 << bj) - 1
    if rem > 0:
        _fill_block(re, block_run[nfull], base, rem, bj, enc, wenc)
        for j in range(rem):
            step_items[off[perm[j]] + nfull] = wenc[j]
    # Full blocks, DEAL_TILE blocks at a time. For each block a random permutation says which
    # item (offset j in the block) goes to step s: tile[b * nsteps + s] = j. Walking steps in the
    # outer loop writes DEAL_TILE consecutive slots of each step at once; walking items instead
    # wrote one slot in each of nsteps distant places per block (a transpose that missed the TLB
    # on every write: 40% of the plan at 2M items and 1440 steps).
    k = 0
    while k < nfull:
        kb = nfull - k
        if kb > DEAL_TILE:
            kb = DEAL_TILE
        for b in range(kb):
            for s in range(nsteps):
                tile[b * nsteps + s] = s
            if shuffle:
                _fisher_yates(tile + b * nsteps, nsteps, &r)
        # The entries by position, after all of the tile's shuffles: filling each block right
        # after its shuffle made the plan ~30% slower at W = 64 (9-item blocks) for 3 of 4 stack
        # placements, the shuffle's loads stalling behind the fill's stores.
        for b in range(kb):
            _fill_block(re, block_run[k + b], (k + b) * nsteps, nsteps, bj, enc, wenc + b * nsteps)
        for s in range(nsteps):
            si = off[s] + k
            for b in range(kb):
                step_items[si + b] = wenc[b * nsteps + tile[b * nsteps + s]]
        k += kb

    # Phase 3: longest first to the least-loaded open bin. An item that fits no bin is left over
    # for the drain below, never carried into the next step: carrying made the work quadratic
    # when items are coarse relative to the budget. Each step is written out by bin as soon as it
    # is dealt (a counting sort of the step's items by bin), so no per-item slot array is kept.
    # Item si - lo of a step is from block si - lo (the partial block's item, if any, last), so
    # its entry decodes to its run and position (see above) without a search.
    nleft = 0
    wpos = 0
    for step in range(nsteps):
        _reset_bins(heap, cnt, world)
        size = world
        lo = off[step]
        hi = off[step + 1]
        for si in range(lo, hi):
            k = si - lo
            v = step_items[si]
            if enc:
                run = block_run[k] + (v >> bj)
                v = k * nsteps + (v & jmask)
            else:
                run = _run_in(re, block_run[k], block_run[k + 1], v)
            pos_of[k] = <int32_t>v
            if _try_place(k, rc[run], budget, heap, &size, cnt, &rr, world, 0, bin_of):
                bin_of[k] = -1
                if nleft == left_cap:
                    left_cap = 2 * left_cap + 256
                    grown = <int64_t*>realloc(left, left_cap * sizeof(int64_t))
                    if grown == NULL:
                        free(left)
                        return -1
                    left = grown
                left[nleft] = v
                nleft += 1
            else:  # and its place in the bin: the write-out below then has no chain through a counter
                bin_of[k] |= (cnt[bin_of[k]] - 1) << 32
        for b in range(world):
            counts[step * world + b] = cnt[b]
            bin_start[b] = wpos
            wpos += cnt[b]
        for k in range(hi - lo):
            e = bin_of[k]
            if e >= 0:
                out_items[bin_start[e & ((<int64_t>1 << 32) - 1)] + (e >> 32)] = pos_of[k]

    # Drain: the left-over items, longest first (by position), in extra steps. A step closes at
    # the first item that fits none of its bins, which then opens the next step (an item always
    # fits an empty step), so this stays linear. Each bin is then written longest first, like
    # the planned steps' bins. The items are visited in increasing position, so each one's run
    # is searched from the previous one's on.
    step = nsteps
    drain_counts[0] = NULL
    ok = True
    if nleft > 0:
        nw = (n + 63) >> 6
        lbits = <uint64_t*>calloc(nw, sizeof(uint64_t))
        lslot = <int64_t*>malloc(nleft * sizeof(int64_t))
        dcap = 4 * world
        dcounts = <int64_t*>calloc(dcap, sizeof(int64_t))
        ok = lbits != NULL and lslot != NULL and dcounts != NULL
        if ok:
            # The left-over positions in increasing order, through a bitmap of all n positions
            # (n / 8 bytes, read a word at a time): a qsort of them took ~20% of a 100k-item plan
            # at W = 2, where a few thousand items are left over.
            for i in range(nleft):
                lbits[left[i] >> 6] |= (<uint64_t>1) << (left[i] & 63)
            i = 0
            for k in range(nw):
                word = lbits[k]
                while word != 0:
                    left[i] = (k << 6) | tl_ctz(word)
                    word &= word - 1
                    i += 1
            _reset_bins(heap, cnt, world)
            size = world
            run = 0
            for i in range(nleft):
                run = _run_in(re, run, nr - 1, left[i])
                if _try_place(i, rc[run], budget, heap, &size, cnt, &rr, world, (step - nsteps) * world,
                              lslot):
                    step += 1
                    _reset_bins(heap, cnt, world)
                    size = world
                    _try_place(i, rc[run], budget, heap, &size, cnt, &rr, world, (step - nsteps) * world,
                               lslot)
                if (step - nsteps + 1) * world > dcap:
                    grown = <int64_t*>realloc(dcounts, 2 * dcap * sizeof(int64_t))
                    if grown == NULL:
                        ok = False
                        break
                    dcounts = grown
                    memset(dcounts + dcap, 0, dcap * sizeof(int64_t))
                    dcap = 2 * dcap
                dcounts[lslot[i]] += 1
            step += 1
        if ok:
            # Bins of the extra steps: their offsets after the planned steps' items, then the
            # items by position.
            ndslots = (step - nsteps) * world
            grown = <int64_t*>malloc(ndslots * sizeof(int64_t))
            ok = grown != NULL
        if ok:
            for s in range(ndslots):
                grown[s] = wpos
                wpos += dcounts[s]
            for i in range(nleft):
                out_items[grown[lslot[i]]] = <int32_t>left[i]
                grown[lslot[i]] += 1
            free(grown)
    free(left)
    free(lbits)
    free(lslot)
    if not ok:
        free(dcounts)
        return -1
    drain_counts[0] = dcounts
    return step


def packed_plan(const double[::1] run_costs, const int64_t[::1] run_ends, int64_t world, double budget,
                int64_t nsteps, object seed):
    """Deal items to (step, rank) bins: equal-cost steps, longest first to the least-loaded rank.

    Args:
        run_costs: cost (a*len + b*len^2) of each run of equal costs in longest-first order,
            non-increasing (see padded_steps).
        run_ends: end position of each run (the last is the number of items).
        world: ranks (bins per step).
        budget: hard cap on a bin's total cost (an item over it gets a bin of its own).
        nsteps: planned number of steps (>= 1); a few more are added for items that fit no bin.
        seed: 64-bit seed of the epoch's stream order (which decides step membership), or None
            for the unshuffled order.

    Returns:
        tuple: (items, bounds, steps): int32 positions in the longest-first order (map them to
        item ids with the sort's order; only the rank's own share needs mapping) grouped by slot
        ``step * world + bin``; ``bounds`` has ``steps * world + 1`` int64 offsets into items.
    """
    cdef int64_t n = _check_runs(run_costs, run_ends, "packed_plan")
    cdef int64_t i, steps, s, nslots
    cdef bint shuffle = seed is not None
    cdef uint64_t useed = 0 if seed is None else <uint64_t>seed
    if world <= 0 or nsteps <= 0 or not budget > 0.0:
        raise ValueError(f"packed_plan: world={world}, nsteps={nsteps}, budget={budget}")
    if n == 0:
        raise ValueError("packed_plan: no items")
    if n > INT32_MAX:
        raise ValueError(f"packed_plan: {n} items; packed mode plans at most {INT32_MAX}")
    cdef int64_t ntmp = _packed_tmp_words(n, world, nsteps)
    cdef bint owned
    # The deal's steps are laid out in the plan itself (step_items = the items returned; see
    # _packed), and its tmp (a few words per step, block and bin) is kept scratch (_scratch_get),
    # whose first pages the sort that made the run table (sort_desc_runs) has just touched: no
    # n-sized scratch at all.
    cdef int64_t* tmp = <int64_t*>_scratch_get(ntmp * sizeof(int64_t), &owned)
    cdef int64_t* counts = tmp + ntmp - nsteps * world  # see _packed_tmp_words
    cdef int64_t* dcounts = NULL
    cdef int32_t[::1] items
    cdef int64_t[::1] bounds
    try:
        items_a = empty(n, np.int32)  # positions < 2^31 (checked above): half the pages of int64
        items = items_a
        with nogil:  # the whole deal runs on validated arrays and scratch we hold
            steps = _packed(&run_costs[0], &run_ends[0], run_costs.shape[0], n, shuffle, useed, world, budget,
                            nsteps, tmp, &items[0], &dcounts)
        if steps < 0:
            raise MemoryError("packed_plan: out of memory")
        nslots = steps * world
        bounds_a = np.empty(nslots + 1, dtype=np.int64)
        bounds = bounds_a
        with nogil:  # offsets from the per-slot counts (planned steps, then extra steps)
            bounds[0] = 0
            for s in range(nslots):
                bounds[s + 1] = bounds[s] + (counts[s] if s < nsteps * world else dcounts[s - nsteps * world])
    finally:
        free(dcounts)
        _scratch_put(tmp, owned)
    return items_a, bounds_a, steps


cdef void* _int_data(object arr, bint narrow) except? NULL:
    """The first element's address of a contiguous int32 (narrow) or int64 array; NULL if empty.
    The caller holds arr."""
    cdef int32_t[::1] a32
    cdef int64_t[::1] a64
    if arr.shape[0] == 0:
        return NULL
    if narrow:
        a32 = arr
        return &a32[0]
    a64 = arr
    return &a64[0]


def rank_batches(const position_t[::1] items, const int64_t[::1] bounds, const int64_t[::1] slots, ids=None,
                 bint narrow=False):
    """One rank's batches for the epoch, flat: the items of ``slots`` in order, and their offsets.

    Replaces a numpy repeat/arange/gather chain (four temporaries of the rank's item count) with
    one pass that writes only the two results. Only this rank's items are read (and, with ids,
    range-checked): at W = 64 that is 1/64 of the plan.

    Args:
        items: int32 or int64 items, slot s being items[bounds[s]:bounds[s + 1]].
        bounds: int64 offsets, non-decreasing, bounds[0] == 0, bounds[-1] == len(items).
        slots: int64 slot ids of this rank's batches, in yield order.
        ids: optional int32 or int64 array; when given, items are positions and ids[items] the
            results.
        narrow: write flat as int32 (half the memory of the rank's share); every value written
            (an item, or with ids ids[item]) must then be in [0, 2^31).

    Returns:
        tuple: (flat, offsets): flat int32 with ``narrow``, else int64, and int64 offsets; batch i
        is flat[offsets[i]:offsets[i + 1]].

    Raises:
        ValueError: bad bounds or slots, with ids an item outside [0, len(ids)), or with
        ``narrow`` a value to write outside [0, 2^31).
    """
    cdef int64_t ns = bounds.shape[0] - 1
    cdef int64_t nb = slots.shape[0]
    cdef int64_t n = items.shape[0]
    cdef int64_t i, s, j, v, total = 0, bad = -1, wide = -1
    cdef const int64_t[::1] idv
    cdef const int32_t[::1] idv32
    cdef int64_t nid = 0
    cdef bint map_ids = ids is not None
    cdef bint ids32 = map_ids and isinstance(ids, np.ndarray) and ids.dtype == np.int32
    if ns < 0 or bounds[0] != 0 or bounds[ns] != n:
        raise ValueError(f"rank_batches: bounds must run from 0 to {n}")
    for i in range(ns):
        if bounds[i + 1] < bounds[i]:
            raise ValueError(f"rank_batches: bounds decrease at {i}")
    for i in range(nb):
        s = slots[i]
        if s < 0 or s >= ns:
            raise ValueError(f"rank_batches: slots[{i}] = {s} is outside [0, {ns})")
        total += bounds[s + 1] - bounds[s]
    if ids32:
        idv32 = ids
        nid = idv32.shape[0]
    elif map_ids:
        idv = ids
        nid = idv.shape[0]
    flat_a = empty(total, np.int32 if narrow else np.int64)
    offs_a = np.empty(nb + 1, dtype=np.int64)
    cdef void* flat = _int_data(flat_a, narrow)
    cdef int64_t* o64 = <int64_t*>flat
    cdef int32_t* o32 = <int32_t*>flat
    cdef int64_t[::1] offs = offs_a
    cdef int64_t pos = 0
    with nogil:  # copies between validated ranges; a position outside ids or a wide value stops it
        offs[0] = 0
        for i in range(nb):
            s = slots[i]
            for j in range(bounds[s], bounds[s + 1]):
                v = items[j]
                if map_ids:
                    if v < 0 or v >= nid:
                        bad = j
                        break
                    v = idv32[v] if ids32 else idv[v]
                if narrow:
                    if <uint64_t>v > <uint64_t>INT32_MAX:  # negative values wrap to huge
                        wide = j
                        break
                    o32[pos] = <int32_t>v
                else:
                    o64[pos] = v
                pos += 1
            if bad >= 0 or wide >= 0:
                break
            offs[i + 1] = pos
    if bad >= 0:
        raise ValueError(f"rank_batches: items[{bad}] = {items[bad]} is outside [0, {nid})")
    if wide >= 0:
        if map_ids:
            raise ValueError(
                f"rank_batches: ids[{items[wide]}] = {idv32[items[wide]] if ids32 else idv[items[wide]]} "
                "does not fit int32 (narrow=True)"
            )
        raise ValueError(f"rank_batches: items[{wide}] = {items[wide]} does not fit int32 (narrow=True)")
    return flat_a, offs_a


cdef inline void _copy_items(const position_t* src, void* out, int64_t at, int64_t k,
                             bint narrow) noexcept nogil:
    """out[at:at + k] = src[:k], out being int32 (narrow, values already range-checked) or int64."""
    cdef int64_t j
    cdef int32_t* d32
    cdef int64_t* d64
    if narrow:
        d32 = (<int32_t*>out) + at
        for j in range(k):  # a plain loop: it vectorises
            d32[j] = <int32_t>src[j]
    elif position_t is int64_t:
        memcpy((<int64_t*>out) + at, src, k * sizeof(int64_t))
    else:
        d64 = (<int64_t*>out) + at
        for j in range(k):
            d64[j] = src[j]


cdef inline int64_t _batch_at(const int64_t* bounds, int64_t nb, int64_t p) noexcept nogil:
    """The batch that holds position p (bounds[b] <= p < bounds[b + 1]; 0 <= p < bounds[nb])."""
    cdef int64_t lo = 0, hi = nb - 1, mid
    while lo < hi:  # the last b with bounds[b] <= p: empty batches before it end at or before p
        mid = (lo + hi + 1) // 2
        if bounds[mid] <= p:
            lo = mid
        else:
            hi = mid - 1
    return lo


def gather_batches(const position_t[::1] items, const int64_t[::1] bounds, const int64_t[::1] perm,
                   bint narrow=False, const int64_t[::1] tie_runs=None, uint64_t seed=0,
                   const int64_t[::1] repeat=None):
    """Lay batches out in a new order: batch i of the result is batch ``perm[i]`` of the input.

    Padded mode groups batches of similar padded cost into the same step; every batch stays one
    contiguous run of positions, so this is a sequence of block copies.

    The positions are those of a source sequence: ``items``, with each run of ``tie_runs``
    shuffled (exactly as ``shuffle_runs`` with the same seed shuffles the runs of equal keys),
    then ``items[repeat[i]]`` (after that shuffle) at position ``len(items) + i``. The shuffle is
    done one run at a time in a small buffer while the blocks are copied, so the sampler's
    per-epoch tie shuffle needs no shuffled copy of the whole order (n fresh pages on the first
    plan, 16 MB at 2M items). Positions at or after ``bounds[-1]`` are left out (drop_last).

    Args:
        items: int32 or int64 items (the sorted order).
        bounds: int64 offsets, non-decreasing, bounds[0] == 0; batch b is positions
            [bounds[b], bounds[b + 1]); bounds[-1] <= len(items), or == len(items) + len(repeat)
            when items are repeated.
        perm: int64 permutation of range(len(bounds) - 1).
        narrow: write the items as int32 (half the memory of a plan kept for the epoch); every
            item must then be in [0, 2^31).
        tie_runs: end of each run of ties in ``items`` (increasing, the last == len(items)), to
            shuffle within; None leaves items in their order.
        seed: 64-bit seed of the tie shuffle.
        repeat: positions in [0, len(items)) whose (shuffled) items are repeated after the end.

    Returns:
        tuple: (new_items, new_bounds): bounds[-1] items, int32 with ``narrow``, else int64, and
        int64 bounds of the same size as bounds.

    Raises:
        ValueError: a bad bounds, perm, tie_runs or repeat, or with ``narrow`` an item outside
        [0, 2^31).
    """
    cdef int64_t nb = bounds.shape[0] - 1
    cdef int64_t n = items.shape[0]
    cdef int64_t nrep = 0 if repeat is None else repeat.shape[0]
    cdef int64_t nruns = 0 if tie_runs is None else tie_runs.shape[0]
    cdef int64_t i, b, pos = 0, m, longest = 1, lo, hi
    if nb < 0 or perm.shape[0] != nb:
        raise ValueError(f"gather_batches: {perm.shape[0]} entries in perm for {max(nb, 0)} batches")
    m = bounds[nb]
    if bounds[0] != 0 or m > n + nrep or (nrep > 0 and m != n + nrep):
        if nrep > 0:
            raise ValueError(f"gather_batches: bounds must run from 0 to {n + nrep} ({n} items, {nrep} repeated)")
        raise ValueError(f"gather_batches: bounds must run from 0 to at most {n}")
    for i in range(nb):
        if bounds[i + 1] < bounds[i]:
            raise ValueError(f"gather_batches: bounds decrease at {i}")
    for i in range(nrep):
        if repeat[i] < 0 or repeat[i] >= n:
            raise ValueError(f"gather_batches: repeat[{i}] = {repeat[i]} is outside [0, {n})")
    if tie_runs is not None:
        longest = max(1, _longest_run(tie_runs, n, "gather_batches", "tie_runs"))
    seen = np.zeros(nb, dtype=np.uint8)
    cdef unsigned char[::1] sn = seen
    for i in range(nb):
        b = perm[i]
        if b < 0 or b >= nb or sn[b]:
            raise ValueError(f"gather_batches: perm[{i}] = {b} is out of range or repeated")
        sn[b] = 1
    cdef int64_t j, bad = -1
    cdef uint64_t over = 0
    if narrow:
        with nogil:  # range check first, as one branch-free pass (the copies below then vectorise)
            for j in range(n):
                over |= <uint64_t>items[j] > <uint64_t>INT32_MAX  # negative items wrap to huge
            if over:
                for j in range(n):
                    if <uint64_t>items[j] > <uint64_t>INT32_MAX:
                        bad = j
                        break
        if bad >= 0:
            raise ValueError(f"gather_batches: items[{bad}] = {items[bad]} does not fit int32 (narrow=True)")
    out_items = empty(m, np.int32 if narrow else np.int64)
    out_bounds = np.empty(nb + 1, dtype=np.int64)
    at_a = np.empty(max(nb, 1), dtype=np.int64)  # where each source batch starts in the output
    cdef int64_t[::1] ob = out_bounds
    cdef int64_t[::1] at = at_a
    cdef void* out = _int_data(out_items, narrow)
    cdef int64_t rs, re_, end, p, q, k
    cdef const position_t* src
    cdef position_t* tmp = NULL
    cdef bint owned = False
    cdef Rng r
    _rng_seed(&r, seed)
    if tie_runs is not None and longest > 1 and m > 0:
        tmp = <position_t*>_scratch_get(longest * sizeof(position_t), &owned)
    try:
        with nogil:  # copies between validated ranges of arrays we own or only read
            ob[0] = 0
            for i in range(nb):
                b = perm[i]
                at[b] = pos
                pos += bounds[b + 1] - bounds[b]
                ob[i + 1] = pos
            if tie_runs is None:
                for b in range(nb):
                    lo = bounds[b]
                    hi = bounds[b + 1] if bounds[b + 1] < n else n
                    if hi > lo:
                        _copy_items(&items[lo], out, at[b], hi - lo, narrow)
            else:
                # Run by run: shuffle the run in tmp (the draws shuffle_runs would make, in the same
                # order), then copy its pieces to the batches that hold them. Runs past bounds[-1]
                # are dropped whole; the run that holds it is shuffled whole, so which of its items
                # are dropped is random.
                b = 0
                rs = 0
                end = m if m < n else n
                for i in range(nruns):
                    if rs >= end:
                        break
                    re_ = tie_runs[i]
                    if re_ - rs > 1:
                        memcpy(tmp, &items[rs], (re_ - rs) * sizeof(position_t))
                        _fisher_yates(tmp, re_ - rs, &r)
                        src = tmp
                    else:
                        src = &items[rs]
                    hi = re_ if re_ < end else end
                    p = rs
                    while p < hi:
                        while bounds[b + 1] <= p:  # the batch that holds p (skips empty ones)
                            b += 1
                        q = bounds[b + 1] if bounds[b + 1] < hi else hi
                        _copy_items(src + (p - rs), out, at[b] + p - bounds[b], q - p, narrow)
                        p = q
                    rs = re_
            # Repeated items: copied from where their position was laid out.
            for i in range(nrep):
                p = repeat[i]
                b = _batch_at(&bounds[0], nb, p)
                q = n + i
                k = _batch_at(&bounds[0], nb, q)
                if narrow:
                    (<int32_t*>out)[at[k] + q - bounds[k]] = (<int32_t*>out)[at[b] + p - bounds[b]]
                else:
                    (<int64_t*>out)[at[k] + q - bounds[k]] = (<int64_t*>out)[at[b] + p - bounds[b]]
    finally:
        if tmp != NULL:
            _scratch_put(tmp, owned)
    return out_items, out_bounds


cdef inline double _batch_value(double fi, int64_t i, int64_t j, double c, double pre_i, double pre_j,
                                double budget, double batch_penalty) noexcept nogil:
    """The program's value at j through a batch [i, j) of longest cost c (pre_*: sums of the
    costs before i and j)."""
    cdef double v = (j - i) * c  # the batch's padded cost
    if v > 0.0:
        return fi + v - (pre_j - pre_i) + batch_penalty * (budget / v) * (budget / v)
    return fi + batch_penalty


# The minimum-padding program visits positions in increasing order, but only few of them can end
# a batch: the run ends, and the fullest end of a batch from a position that ends one (a third of
# the positions at 100k token counts). A value and a predecessor per position (16 bytes per item)
# made a process's first plan fault in ~280 fresh pages at 100k items (~1 ms, most of the call)
# to use a third of them. So the program keeps them per run end (arrays of nr entries) and keeps
# the fullest ends that are not run ends only while they wait to be processed, in a window:
#
# - From i the fullest end is i + t(c_i) (t: how many items of the batch's longest cost c_i fit
#   the budget, at least 1), or n. Costs do not grow along positions, so t does not shrink, and
#   the fullest ends below n strictly increase with i. So they come out in increasing order (a
#   first-in first-out window, no heap) and each is relaxed by exactly one position, once.
# - For the same reason the walk back needs no stored predecessor for them: the one position
#   whose fullest end is p is found again from the run table (_fullest_from).
DEF WINDOW_START = 64  # pending fullest ends the window holds at first; it doubles in place as needed


cdef struct _Pending:
    int64_t pos  # a reachable fullest end that is not a run end, not processed yet
    double f  # the program's value there (final: only one position relaxes it)


cdef inline int64_t _fullest_take(double c, double budget) noexcept nogil:
    """Items in the fullest batch whose longest item costs c (at least 1), or -1 for all that are left."""
    cdef double q
    cdef int64_t k
    if c <= 0.0:
        return -1  # zero-cost items pad to nothing: one batch takes them all
    q = budget / c
    if not q < 9223372036854775808.0:
        return -1  # more than 2^63 fit: all of them (and casting q to int64 would be undefined)
    k = <int64_t>q
    if k < 1:
        k = 1
    return k


cdef inline int64_t _fullest_end(double c, int64_t i, int64_t n, double budget) noexcept nogil:
    """End of the fullest batch from position i, whose longest item costs c."""
    cdef int64_t t = _fullest_take(c, budget)
    if t < 0 or t > n - i:
        return n
    return i + t


cdef int64_t _fullest_from(const double* rc, const int64_t* re, int64_t r, int64_t p,
                           double budget) noexcept nogil:
    """The position whose fullest end is p (< n, not a run end, inside run r).

    Exactly one position i has i + t(c_i) == p (see above); it lies in run r or before. In run r'
    it can only be p - t(c_r'), so the runs are tried downwards from r."""
    cdef int64_t t, i
    while r >= 0:
        t = _fullest_take(rc[r], budget)
        i = p - t
        if t > 0 and i >= (re[r - 1] if r > 0 else 0) and i < re[r]:
            return i
        r -= 1
    return 0  # not reached: p was relaxed from a position before it


cdef int64_t _min_padding_dp(const double* rc, const int64_t* re, int64_t nr, int64_t n, double budget,
                             double batch_penalty, int64_t* ends, double* fr, int64_t* pr, _Pending* win,
                             int64_t win_max) noexcept nogil:
    """The program of padded_min_padding_cut on a validated run table.

    fr and pr hold nr entries (value and predecessor at each run end); win holds win_max >= n + 1 - nr
    pending fullest ends. Returns the number of batches written to ends, 0 if n has no finite value.
    """
    cdef int64_t i = 0, j, e, k, rj, cur = 0, nb = 0, rn = 0, head = 0, tail = 0, cap
    cdef double fi = 0.0, c, v, w, pre_i, pre_run = 0.0
    # The window is win[head:tail] within its first cap entries. At most n - nr fullest ends are
    # ever pushed (distinct positions in (0, n), none a run end), so tail < win_max: it can always
    # grow. When full it slides back to the front if half of it is processed, else doubles: it
    # grows only while more than half waits, so it touches fewer than 4 times the most entries
    # that ever wait at once (154 at 100k token counts and at 2M).
    cap = WINDOW_START if WINDOW_START < win_max else win_max
    for rj in range(nr):
        fr[rj] = INFINITY
    # i is the position being processed and fi its value (final: every batch into i starts before
    # it). The positions come in increasing order, as in a program over every position, so each
    # target sees the same relaxations in the same order and ties resolve the same way.
    while True:
        while re[cur] <= i:
            pre_run += (re[cur] - (re[cur - 1] if cur > 0 else 0)) * rc[cur]
            cur += 1
        c = rc[cur]
        e = _fullest_end(c, i, n, budget)
        # The sum of costs before i: runs before cur (pre_run) plus i's offset in its run. A
        # batch [i, j) pads (j - i) * c minus the costs in it.
        pre_i = pre_run + (i - (re[cur - 1] if cur > 0 else 0)) * c
        rj = cur
        v = pre_run  # the sum of costs before run rj's start
        while True:
            j = re[rj]
            if j >= e:
                # The fullest end (inside run rj, or its end).
                v = _batch_value(fi, i, e, c, pre_i, v + (e - (re[rj - 1] if rj > 0 else 0)) * rc[rj],
                                 budget, batch_penalty)
                if j == e:
                    if v < fr[rj]:
                        fr[rj] = v
                        pr[rj] = i
                elif v < INFINITY:  # e's first and only relaxation (an infinite value reaches nothing)
                    if tail == cap:
                        if 2 * head >= cap:
                            memmove(win, win + head, (tail - head) * sizeof(_Pending))
                            tail -= head
                            head = 0
                        else:
                            cap = 2 * cap if 2 * cap < win_max else win_max
                    win[tail].pos = e
                    win[tail].f = v
                    tail += 1
                break
            v += (j - (re[rj - 1] if rj > 0 else 0)) * rc[rj]  # now the sum of costs before j
            w = _batch_value(fi, i, j, c, pre_i, v, budget, batch_penalty)
            if w < fr[rj]:
                fr[rj] = w
                pr[rj] = i
            rj += 1
        # The next position: the first pending fullest end or the next reachable run end (they
        # are never equal), whichever comes first; the program stops at n.
        while True:
            if head < tail and win[head].pos < re[rn]:
                i = win[head].pos
                fi = win[head].f
                head += 1
                break
            if rn == nr - 1:
                i = n
                break
            i = re[rn]
            fi = fr[rn]
            rn += 1
            if fi < INFINITY:
                break
        if i == n:
            break
    if not fr[nr - 1] < INFINITY:
        return 0  # every way to n overflows (an infinite batch_penalty, or costs near the double range)
    # Walk back from n (rj follows the run holding i), then reverse the ends in place.
    ends[nb] = n
    nb += 1
    i = pr[nr - 1]
    rj = nr - 1
    while i > 0:
        ends[nb] = i
        nb += 1
        while rj > 0 and re[rj - 1] > i:
            rj -= 1
        if rj > 0 and re[rj - 1] == i:
            i = pr[rj - 1]  # i ends run rj - 1: its predecessor is kept
        else:
            i = _fullest_from(rc, re, rj, i, budget)  # i is a fullest end: found from the run table
    i = 0
    k = nb - 1
    while i < k:
        e = ends[i]
        ends[i] = ends[k]
        ends[k] = e
        i += 1
        k -= 1
    return nb


def padded_min_padding_cut(const double[::1] run_costs, const int64_t[::1] run_ends, double budget,
                           double batch_penalty, int64_t[::1] ends):
    """Cut items (a run table of costs, longest first) into batches that minimise padding + a
    cost per batch.

    A dynamic program over cut positions: a batch [i, j) costs its padding
    ``(j - i) * cost(i) - sum(cost[i:j])`` plus ``batch_penalty * (budget / padded)**2``
    (``padded`` = ``(j - i) * cost(i)``; small batches make uneven steps, so they are priced up)
    and must keep ``padded <= budget`` (one item alone may exceed it). Only cuts at the end of a
    run of equal costs or at the fullest end are tried: an end strictly inside a run pads nothing
    less than the run's end would, and the fullest end is what the greedy cut takes.

    The costs come as a run table, so the program needs no per-item costs or prefix sums, and it
    keeps a value only where a batch can end: per run end, and for the fullest ends only while
    they wait to be processed (see the comment above _min_padding_dp). It takes 16 * (n + 1)
    bytes of the kept scratch for the worst case, of which it touches 16 bytes per run and per
    waiting fullest end (30 KB at 100k or 2M token counts, where one value per position was 1.6
    or 32 MB).

    Args:
        run_costs: cost of each run of equal costs, non-increasing, >= 0.
        run_ends: end position of each run (the last is the number of items n).
        budget: hard cap on count * cost(longest).
        batch_penalty: padding (in cost units) that one full batch fewer is worth.
        ends: output, end position of each batch (capacity >= n).

    Returns:
        int: the number of batches written to ends; 0 when no cut has a finite cost (an infinite
        batch_penalty, or costs so large that the sums overflow).
    """
    cdef int64_t n = _check_runs(run_costs, run_ends, "padded_min_padding_cut")
    cdef int64_t nr = run_costs.shape[0]
    cdef int64_t nb = 0
    cdef bint owned
    if not budget > 0.0 or not batch_penalty >= 0.0:
        raise ValueError(f"padded_min_padding_cut: budget={budget}, batch_penalty={batch_penalty}")
    if ends.shape[0] < n:
        raise ValueError(f"padded_min_padding_cut: ends has {ends.shape[0]} slots for {n} items")
    if n == 0:
        return 0
    # In the kept scratch (see _scratch_get), small and hot arrays first: the run ends' values and
    # predecessors, then the window (n + 1 - nr entries at most, 512 in use at 100k token counts).
    # The plan's sort (sort_desc_runs) has just written its counts at the start of the scratch (a
    # word per possible length: 64 KB for lengths up to 8192), so on a process's first plan these
    # pages are mostly mapped already.
    cdef double* fr = <double*>_scratch_get(nr * (sizeof(double) + sizeof(int64_t))
                                            + (n + 1 - nr) * sizeof(_Pending), &owned)
    cdef int64_t* pr = <int64_t*>(fr + nr)
    cdef _Pending* win = <_Pending*>(pr + nr)
    try:
        with nogil:  # the program over the validated run table and scratch we hold
            nb = _min_padding_dp(&run_costs[0], &run_ends[0], nr, n, budget, batch_penalty, &ends[0], fr, pr,
                                 win, n + 1 - nr)
    finally:
        _scratch_put(fr, owned)
    return nb
