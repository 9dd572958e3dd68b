/* C helpers for trainloom.comm._shm: segment layout, atomics, futex, clocks and the reduction
 * kernels. Everything here is static inline and header-only so that the Cython module compiles
 * to one translation unit and gcc can inline and vectorize the kernels.
 *
 * Why C here and not Cython fused types: the reductions are 10 dtypes x 8 ops with fp16/bf16
 * conversions; macros keep one loop body per op that gcc vectorizes at -O3 (no -march=native:
 * baseline SSE2 on x86-64), and the atomics need __atomic builtins that Cython cannot spell.
 */
#ifndef TL_SHM_KERNELS_H
#define TL_SHM_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <time.h>
#include <stdio.h>
#include <signal.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <linux/futex.h>

#define TL_LINE 64
#define TL_MAGIC 0x544c53484d454e47ULL /* "TLSHMENG" */
#define TL_VERSION 2u
#define TL_MAXDIM 8

/* ------------------------------------------------------------------------------------------ */
/* Segment layout. Every counter that one rank writes and others poll sits alone on a cache    */
/* line: false sharing between two ranks' counters costs more than the copies at small sizes. */
/* ------------------------------------------------------------------------------------------ */
typedef struct {
    uint32_t v;
    char pad[TL_LINE - 4];
} __attribute__((aligned(TL_LINE))) tl_line_t;

/* One op descriptor (136 bytes): what a rank is about to do. Compared across ranks at the
 * first step of every op, so that a size/dtype/op mismatch is seen by every rank. */
typedef struct {
    int64_t opkind;
    int64_t seq;
    int64_t dtype;
    int64_t redop;
    int64_t root;
    int64_t numel;
    int64_t extra;   /* recv numel, or chunk index for p2p */
    int64_t ndim;
    int64_t shape[TL_MAXDIM];
    int64_t zc;      /* allreduce: 1 + offset of the tensor in the sender's heap, or 0 (not compared) */
    int64_t addr;    /* cross-memory attach: the sender's send buffer in ITS address space, or 0 when
                      * peers must not read it directly (not compared) */
    int64_t addr2;   /* cross-memory attach: the sender's recv buffer (allreduce), or 0 */
} tl_desc_t;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t world;
    uint64_t generation;
    uint64_t slot_bytes;
    uint64_t pair_bytes;
    uint64_t heap_bytes;
    uint64_t total_bytes;
    char pad0[TL_LINE * 2 - 48];
    tl_line_t attached;    /* ranks that mapped the segment */
    tl_line_t abort_word;  /* 0, or (reason << 16) | (rank + 1) of the rank that aborted */
} __attribute__((aligned(TL_LINE))) tl_hdr_t;

typedef struct {
    tl_line_t arrive;      /* step counter: "my data for step s is in my slot s % 2" */
    tl_line_t sleepers;    /* peers sleeping in futex on `arrive` (publisher wakes only if > 0) */
    int32_t pid;
    int32_t closed;
    char pad1[TL_LINE - 8];
    tl_desc_t desc[2];     /* descriptor of the op whose first step has parity s % 2 */
} __attribute__((aligned(TL_LINE))) tl_rank_t;

typedef struct {
    tl_line_t sent;        /* chunks the sender published on this (src, dst) channel */
    tl_line_t sent_sleepers;
    tl_line_t ack;         /* chunks the receiver consumed */
    tl_line_t ack_sleepers;
    tl_desc_t hdr[2];      /* descriptor of the message a chunk in buffer b belongs to */
    tl_desc_t poison;      /* receiver's view when it rejected a message (opkind != 0) */
} __attribute__((aligned(TL_LINE))) tl_pair_t;

/* ------------------------------------------------------------------------------------------ */
/* Atomics, futex, time.                                                                       */
/* ------------------------------------------------------------------------------------------ */
static inline uint32_t tl_load(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void tl_store(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
static inline uint32_t tl_add(uint32_t *p, uint32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline uint32_t tl_sub(uint32_t *p, uint32_t v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }
static inline uint32_t tl_cas(uint32_t *p, uint32_t expected, uint32_t desired) {
    __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
static inline void tl_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
/* wrap-safe "a >= b" for monotonically increasing 32-bit counters */
static inline int tl_reached(uint32_t a, uint32_t b) { return (int32_t)(a - b) >= 0; }

static inline void tl_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline double tl_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Shared (not FUTEX_PRIVATE) futex: the word lives in a MAP_SHARED mapping used by several
 * processes, so the kernel must key the wait queue on the physical page. */
static inline int tl_futex_wait(uint32_t *addr, uint32_t val, double timeout_s) {
    struct timespec ts;
    if (timeout_s < 0) timeout_s = 0;
    ts.tv_sec = (time_t)timeout_s;
    ts.tv_nsec = (long)((timeout_s - (double)ts.tv_sec) * 1e9);
    return (int)syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, NULL, 0);
}
static inline int tl_futex_wake(uint32_t *addr, int n) {
    return (int)syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* 1 if `pid` is gone (no such process, or a zombie waiting to be reaped), else 0. A zombie still
 * answers kill(pid, 0), so /proc/<pid>/stat is read as well. */
static inline int tl_pid_dead(int pid) {
    char path[64], buf[256];
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *rp = strrchr(buf, ')');
    if (rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X')) return 1;
    return 0;
}

/* Cross-memory attach: copy n bytes at `remote` in process `pid` to `dst` here, with one copy
 * (the kernel walks the peer's page tables and copies page by page). Called through syscall() so
 * the declaration does not depend on _GNU_SOURCE. process_vm_readv may return a partial count (it
 * stops at the first unreadable page, and at IOV_MAX iovecs, which one iovec never reaches), so
 * loop; EINTR restarts. Returns 0 or the errno: ESRCH = the process is gone (or a zombie: its
 * memory is released at exit), EPERM = ptrace access denied (Yama, non-dumpable, other uid),
 * ENOSYS/EPERM = blocked by seccomp, EFAULT = the range is not mapped there. */
static inline int tl_cma_read(int pid, void *dst, const void *remote, size_t n) {
    char *d = (char *)dst;
    const char *r = (const char *)remote;
    while (n > 0) {
        struct iovec l, rv;
        l.iov_base = d;
        l.iov_len = n;
        rv.iov_base = (void *)r;
        rv.iov_len = n;
        long k = syscall(SYS_process_vm_readv, (long)pid, &l, 1UL, &rv, 1UL, 0UL);
        if (k < 0) {
            if (errno == EINTR) continue;
            return errno ? errno : EIO;
        }
        if (k == 0) return EFAULT;
        d += k;
        r += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Copy with non-temporal (streaming) stores, for large copies into a destination nobody reads
 * before the op returns (the user's recv). A normal store first reads the destination line
 * into the cache (read-for-ownership) and later writes it back: 3 memory transfers per line
 * instead of 2. When both ranks copy at once the two cores share the memory bandwidth, and
 * measured here (2 processes copying 8-16 MiB each at once) streaming copies ran 13-19 GB/s per
 * process against 8-11 GB/s for memcpy. SSE2 is the x86-64 baseline, so no dispatch is needed;
 * elsewhere this is memcpy. */
#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
/* One pass over src feeding two destinations: `dst` with normal stores (a slot, read by the
 * peers right after the step: keep it cached; NULL for none) and `dst_nt` with streaming stores
 * (the user's recv). An allgather needs its own block in both places; reading it once saves a
 * pass over memory when the op is memory-bound. */
static inline void tl_copy2_nt(void *dst, void *dst_nt, const void *src, size_t n) {
    char *d = (char *)dst, *e = (char *)dst_nt;
    const char *s = (const char *)src;
    size_t head = (size_t)(-(uintptr_t)e) & 15;
    if (n < 256) {
        if (d) memcpy(d, s, n);
        memcpy(e, s, n);
        return;
    }
    if (head) {
        if (d) memcpy(d, s, head);
        memcpy(e, s, head);
        if (d) d += head;
        e += head;
        s += head;
        n -= head;
    }
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i f = _mm_loadu_si128((const __m128i *)(s + i + 48));
        if (d) {
            _mm_storeu_si128((__m128i *)(d + i), a);
            _mm_storeu_si128((__m128i *)(d + i + 16), b);
            _mm_storeu_si128((__m128i *)(d + i + 32), c);
            _mm_storeu_si128((__m128i *)(d + i + 48), f);
        }
        _mm_stream_si128((__m128i *)(e + i), a);
        _mm_stream_si128((__m128i *)(e + i + 16), b);
        _mm_stream_si128((__m128i *)(e + i + 32), c);
        _mm_stream_si128((__m128i *)(e + i + 48), f);
    }
    /* streaming stores are weakly ordered: fence before the step that publishes the data */
    _mm_sfence();
    if (n > body) {
        if (d) memcpy(d + body, s + body, n - body);
        memcpy(e + body, s + body, n - body);
    }
}

/* A copy into recv with streaming stores only (inlined with dst NULL: no second destination). */
static inline void tl_copy_nt(void *dst, const void *src, size_t n) { tl_copy2_nt(NULL, dst, src, n); }
#else
static inline void tl_copy_nt(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
static inline void tl_copy2_nt(void *dst, void *dst_nt, const void *src, size_t n) {
    memcpy(dst, src, n);
    memcpy(dst_nt, src, n);
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* fp16 / bf16 conversions, bit-exact with c10 (IEEE round to nearest even), branch-free so    */
/* the loops vectorize without F16C.                                                           */
/* ------------------------------------------------------------------------------------------ */
static inline float tl_f32_from_bits(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t tl_f32_to_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

/* Selects are written as bit masks (not ?: or if) so that gcc if-converts and vectorizes them. */
static inline uint32_t tl_sel(uint32_t cond, uint32_t a, uint32_t b) {
    uint32_t m = (uint32_t)0 - cond; /* cond is 0 or 1 */
    return (a & m) | (b & ~m);
}
static inline float tl_h2f(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float exp_scale = 0x1.0p-112f;
    const float normalized = tl_f32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = 126u << 23;
    const float denormalized = tl_f32_from_bits((two_w >> 17) | magic_mask) - 0.5f;
    const uint32_t cutoff = 1u << 27;
    const uint32_t r = sign | tl_sel(two_w < cutoff, tl_f32_to_bits(denormalized), tl_f32_to_bits(normalized));
    return tl_f32_from_bits(r);
}
static inline uint16_t tl_f2h(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    const uint32_t w = tl_f32_to_bits(f);
    float base = (tl_f32_from_bits(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = tl_sel(bias < 0x71000000u, 0x71000000u, bias);
    base = tl_f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = tl_f32_to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | tl_sel(shl1_w > 0xFF000000u, 0x7E00u, nonsign));
}
static inline float tl_b2f(uint16_t b) { return tl_f32_from_bits((uint32_t)b << 16); }
static inline uint16_t tl_f2b(float f) {
    uint32_t u = tl_f32_to_bits(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    /* NaN (exponent all ones, mantissa non-zero) becomes the canonical quiet NaN, like c10 */
    return (uint16_t)tl_sel((u & 0x7FFFFFFFu) > 0x7F800000u, 0x7FC0u, r);
}

/* ------------------------------------------------------------------------------------------ */
/* Reductions: out[i] = src[0][i] op src[1][i] op ... op src[nsrc-1][i], always in that order  */
/* (rank order), so every rank that reduces the same slice gets the same bits. `out` may alias */
/* any src: each block is accumulated in a stack buffer and stored at the end.                 */
/* ------------------------------------------------------------------------------------------ */
enum { TL_F16 = 0, TL_BF16 = 1, TL_F32 = 2, TL_F64 = 3, TL_I8 = 4, TL_U8 = 5, TL_I16 = 6,
       TL_I32 = 7, TL_I64 = 8, TL_BOOL = 9 };
enum { TL_SUM = 0, TL_PROD = 1, TL_MIN = 2, TL_MAX = 3, TL_BOR = 7, TL_BAND = 8, TL_BXOR = 9,
       TL_AVG = 10 };

/* 1024 elements: 8 KiB of doubles on the stack, well inside L1 together with the sources. */
#define TL_BLK 1024

#define TL_ID(x) (x)
#define TL_ADD(a, b) ((a) + (b))
#define TL_MUL(a, b) ((a) * (b))
#define TL_AND(a, b) ((a) & (b))
#define TL_OR(a, b) ((a) | (b))
#define TL_XOR(a, b) ((a) ^ (b))
#define TL_IMIN(a, b) ((b) < (a) ? (b) : (a))
#define TL_IMAX(a, b) ((b) > (a) ? (b) : (a))
/* NaN-propagating like torch.minimum/maximum: a NaN on either side wins. */
#define TL_FMIN(a, b) ((b) != (b) ? (b) : ((b) < (a) ? (b) : (a)))
#define TL_FMAX(a, b) ((b) != (b) ? (b) : ((b) > (a) ? (b) : (a)))

/* T: element type; A: accumulator type; LD: T -> A; ST: A -> T; OP: combine; DIV: 1 to divide
 * the result by `div` (AVG). */
/* Runtime dispatch: gcc builds an AVX2 clone next to the baseline (SSE2) one and the loader picks
 * it on CPUs that have AVX2 (ifunc). Without -ffp-contract there is no FMA in either clone and every
 * operation is an IEEE add/mul/div/compare or an exact conversion, so both clones give the same
 * bits; the AVX2 one is ~1.5-2x faster on cache-resident chunks. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(TL_NO_CLONES)
#define TL_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define TL_CLONES
#endif

#define TL_DEFINE_REDUCE(NAME, T, A, LD, ST, OP, DIV)                                        \
    TL_CLONES static void NAME(void *out_, const void *const *src, int nsrc, size_t n, int div) { \
        A acc[TL_BLK];                                                                         \
        T *out = (T *)out_;                                                                    \
        const A d = (A)div;                                                                    \
        for (size_t b = 0; b < n; b += TL_BLK) {                                               \
            size_t m = n - b < TL_BLK ? n - b : TL_BLK;                                        \
            const T *s0 = (const T *)src[0] + b;                                               \
            if (nsrc > 1) {                                                                    \
                const T *s1 = (const T *)src[1] + b;                                           \
                for (size_t i = 0; i < m; i++) acc[i] = OP(LD(s0[i]), LD(s1[i]));              \
            } else {                                                                           \
                for (size_t i = 0; i < m; i++) acc[i] = LD(s0[i]);                             \
            }                                                                                  \
            for (int r = 2; r < nsrc; r++) {                                                   \
                const T *s = (const T *)src[r] + b;                                            \
                for (size_t i = 0; i < m; i++) acc[i] = OP(acc[i], LD(s[i]));                  \
            }                                                                                  \
            if (DIV) {                                                                         \
                for (size_t i = 0; i < m; i++) out[b + i] = ST(acc[i] / d);                    \
            } else {                                                                           \
                for (size_t i = 0; i < m; i++) out[b + i] = ST(acc[i]);                        \
            }                                                                                  \
        }                                                                                      \
    }

/* floats: f32 / f64 native, f16 / bf16 accumulate in f32 and round once at the end */
#define TL_FLOAT_FAMILY(SUF, T, A, LD, ST)                                                     \
    TL_DEFINE_REDUCE(tl_sum_##SUF, T, A, LD, ST, TL_ADD, 0)                                    \
    TL_DEFINE_REDUCE(tl_avg_##SUF, T, A, LD, ST, TL_ADD, 1)                                    \
    TL_DEFINE_REDUCE(tl_prod_##SUF, T, A, LD, ST, TL_MUL, 0)                                   \
    TL_DEFINE_REDUCE(tl_min_##SUF, T, A, LD, ST, TL_FMIN, 0)                                   \
    TL_DEFINE_REDUCE(tl_max_##SUF, T, A, LD, ST, TL_FMAX, 0)

TL_FLOAT_FAMILY(f32, float, float, TL_ID, TL_ID)
TL_FLOAT_FAMILY(f64, double, double, TL_ID, TL_ID)
TL_FLOAT_FAMILY(f16, uint16_t, float, tl_h2f, tl_f2h)
TL_FLOAT_FAMILY(bf16, uint16_t, float, tl_b2f, tl_f2b)

/* integers: SUM and PRODUCT in the unsigned type (defined wrap-around, same bits as two's
 * complement), MIN/MAX in the signed type; AVG sums in a wider type (below) and truncates toward
 * zero like NCCL's ncclAvg. */
#define TL_INT_FAMILY(SUF, T, U)                                                               \
    TL_DEFINE_REDUCE(tl_sum_##SUF, U, U, TL_ID, TL_ID, TL_ADD, 0)                              \
    TL_DEFINE_REDUCE(tl_prod_##SUF, U, U, TL_ID, TL_ID, TL_MUL, 0)                             \
    TL_DEFINE_REDUCE(tl_min_##SUF, T, T, TL_ID, TL_ID, TL_IMIN, 0)                             \
    TL_DEFINE_REDUCE(tl_max_##SUF, T, T, TL_ID, TL_ID, TL_IMAX, 0)                             \
    TL_DEFINE_REDUCE(tl_band_##SUF, U, U, TL_ID, TL_ID, TL_AND, 0)                             \
    TL_DEFINE_REDUCE(tl_bor_##SUF, U, U, TL_ID, TL_ID, TL_OR, 0)                               \
    TL_DEFINE_REDUCE(tl_bxor_##SUF, U, U, TL_ID, TL_ID, TL_XOR, 0)

TL_INT_FAMILY(i8, int8_t, uint8_t)
TL_INT_FAMILY(u8, uint8_t, uint8_t)
TL_INT_FAMILY(i16, int16_t, uint16_t)
TL_INT_FAMILY(i32, int32_t, uint32_t)
TL_INT_FAMILY(i64, int64_t, uint64_t)

/* Integer AVG: every value is widened on load, so that the sum never overflows (two int32 were
 * added in int32 before reaching the int64 accumulator: 2 x 2e9 averaged to -147483648). The
 * average of values of a type fits that type, so the store back is exact. */
#define TL_TO_I64(x) ((int64_t)(x))
TL_DEFINE_REDUCE(tl_avg_i8, int8_t, int64_t, TL_TO_I64, TL_ID, TL_ADD, 1)
TL_DEFINE_REDUCE(tl_avg_u8, uint8_t, int64_t, TL_TO_I64, TL_ID, TL_ADD, 1)
TL_DEFINE_REDUCE(tl_avg_i16, int16_t, int64_t, TL_TO_I64, TL_ID, TL_ADD, 1)
TL_DEFINE_REDUCE(tl_avg_i32, int32_t, int64_t, TL_TO_I64, TL_ID, TL_ADD, 1)
#if defined(__SIZEOF_INT128__) && !defined(TL_NO_INT128)
/* int64: a 128-bit sum (gcc and clang on 64-bit targets), divided in 64 bits when it fits there (a
 * 128-bit division is a library call, ~3x slower per element: 1M elements 6.5 ms against 2.2 ms). */
static void tl_avg_i64(void *out_, const void *const *src, int nsrc, size_t n, int div) {
    int64_t *out = (int64_t *)out_;
    const int64_t d = (int64_t)div;
    for (size_t i = 0; i < n; i++) {
        __int128 acc = 0;
        for (int s = 0; s < nsrc; s++) acc += ((const int64_t *)src[s])[i];
        const int64_t lo = (int64_t)acc;
        out[i] = (__int128)lo == acc ? lo / d : (int64_t)(acc / d);
    }
}
#else
/* int64 without a 128-bit type: with x = div * q + r (C division, |r| < div), the average is the
 * sum of the quotients plus that of the remainders divided by div, then moved one toward zero when
 * the sign of the leftover remainder disagrees with it. None of the partial results overflows when
 * nsrc <= div (the engine passes nsrc == div == the world size). */
static void tl_avg_i64(void *out_, const void *const *src, int nsrc, size_t n, int div) {
    int64_t *out = (int64_t *)out_;
    const int64_t d = (int64_t)div;
    for (size_t i = 0; i < n; i++) {
        int64_t q = 0, r = 0, t, rr;
        for (int s = 0; s < nsrc; s++) {
            const int64_t x = ((const int64_t *)src[s])[i];
            q += x / d;
            r += x % d;
        }
        t = q + r / d;
        rr = r % d;
        if (t > 0 && rr < 0) t -= 1;
        else if (t < 0 && rr > 0) t += 1;
        out[i] = t;
    }
}
#endif

typedef void (*tl_reduce_fn)(void *, const void *const *, int, size_t, int);

/* The kernel for (dtype, op), or NULL when the combination is not supported. bool is reduced as
 * bytes: SUM/MAX/BOR = or, PRODUCT/MIN/BAND = and, BXOR = xor (values are 0/1). */
static inline tl_reduce_fn tl_pick_reduce(int dt, int op) {
#define TL_FLOAT_CASE(D, SUF)                                                                  \
    case D:                                                                                    \
        switch (op) {                                                                          \
        case TL_SUM: return tl_sum_##SUF;                                                      \
        case TL_AVG: return tl_avg_##SUF;                                                      \
        case TL_PROD: return tl_prod_##SUF;                                                    \
        case TL_MIN: return tl_min_##SUF;                                                      \
        case TL_MAX: return tl_max_##SUF;                                                      \
        default: return NULL;                                                                  \
        }
#define TL_INT_CASE(D, SUF)                                                                    \
    case D:                                                                                    \
        switch (op) {                                                                          \
        case TL_SUM: return tl_sum_##SUF;                                                      \
        case TL_AVG: return tl_avg_##SUF;                                                      \
        case TL_PROD: return tl_prod_##SUF;                                                    \
        case TL_MIN: return tl_min_##SUF;                                                      \
        case TL_MAX: return tl_max_##SUF;                                                      \
        case TL_BAND: return tl_band_##SUF;                                                    \
        case TL_BOR: return tl_bor_##SUF;                                                      \
        case TL_BXOR: return tl_bxor_##SUF;                                                    \
        default: return NULL;                                                                  \
        }
    switch (dt) {
        TL_FLOAT_CASE(TL_F32, f32)
        TL_FLOAT_CASE(TL_F64, f64)
        TL_FLOAT_CASE(TL_F16, f16)
        TL_FLOAT_CASE(TL_BF16, bf16)
        TL_INT_CASE(TL_I8, i8)
        TL_INT_CASE(TL_U8, u8)
        TL_INT_CASE(TL_I16, i16)
        TL_INT_CASE(TL_I32, i32)
        TL_INT_CASE(TL_I64, i64)
    case TL_BOOL:
        switch (op) {
        case TL_SUM: case TL_MAX: case TL_BOR: return tl_bor_u8;
        case TL_PROD: case TL_MIN: case TL_BAND: return tl_band_u8;
        case TL_BXOR: return tl_bxor_u8;
        default: return NULL;
        }
    default:
        return NULL;
    }
#undef TL_FLOAT_CASE
#undef TL_INT_CASE
}

#endif /* TL_SHM_KERNELS_H */
