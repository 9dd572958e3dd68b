/* A stand-in libnccl.so.2 for CPU-only CI: one rank, host memory, the NCCL 2.x C ABI.
 *
 * Built by tests/comm/commutil.py with gcc into a temporary directory and selected with
 * TRAINLOOM_NCCL_LIBRARY. Collectives over one rank are copies; "device" pointers are host
 * pointers. Extra entry points (fake_nccl_*) let tests inject failures, count live communicators
 * and block inside a call (to prove the binding releases the GIL).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct fakeComm { int nranks, rank, device; } *ncclComm_t;

enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
       ncclInvalidArgument = 4, ncclInvalidUsage = 5 };

static int live_comms = 0;
static int fail_next = 0;          /* status the next collective returns, 0 = none */
static int block_next = 0;         /* the next AllReduce waits for fake_nccl_release() */
static int released = 0;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int group_depth = 0;
/* Pending sends inside a group (one rank: every send is to ourselves). */
static const void *pend_ptr[64];
static size_t pend_bytes[64];
static int pend_n = 0;

static size_t type_size(int t) {
    switch (t) {
    case 0: case 1: return 1;               /* int8, uint8 */
    case 2: case 3: case 7: return 4;       /* int32, uint32, float32 */
    case 4: case 5: case 8: return 8;       /* int64, uint64, float64 */
    case 6: case 9: return 2;               /* float16, bfloat16 */
    default: return 0;
    }
}

static int take_failure(void) {
    int f = fail_next;
    fail_next = 0;
    return f;
}

void fake_nccl_fail_next(int status) { fail_next = status; }
int fake_nccl_live_comms(void) { return live_comms; }
void fake_nccl_block_next(void) {
    pthread_mutex_lock(&mu);
    block_next = 1;
    released = 0;
    pthread_mutex_unlock(&mu);
}
void fake_nccl_release(void) {
    pthread_mutex_lock(&mu);
    released = 1;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

int ncclGetVersion(int *version) { *version = 21899; return ncclSuccess; }

int ncclGetUniqueId(ncclUniqueId *id) {
    memset(id->internal, 0, sizeof(id->internal));
    memcpy(id->internal, "fake-nccl-unique-id", 19);
    return ncclSuccess;
}

const char *ncclGetErrorString(int status) {
    switch (status) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (fake)";
    case ncclSystemError: return "unhandled system error (fake)";
    case ncclInternalError: return "internal error (fake)";
    case ncclInvalidArgument: return "invalid argument (fake)";
    case ncclInvalidUsage: return "invalid usage (fake)";
    default: return "unknown result code (fake)";
    }
}

int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
    if (memcmp(id.internal, "fake-nccl-unique-id", 19) != 0) return ncclInvalidArgument;
    if (nranks != 1 || rank != 0) return ncclInvalidUsage; /* the fake has a single rank */
    *comm = calloc(1, sizeof(**comm));
    if (!*comm) return ncclSystemError;
    (*comm)->nranks = nranks;
    (*comm)->rank = rank;
    __atomic_add_fetch(&live_comms, 1, __ATOMIC_SEQ_CST);
    return ncclSuccess;
}

int ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return ncclInvalidArgument;
    free(comm);
    __atomic_sub_fetch(&live_comms, 1, __ATOMIC_SEQ_CST);
    return ncclSuccess;
}

int ncclCommAbort(ncclComm_t comm) { return ncclCommDestroy(comm); }
int ncclCommGetAsyncError(ncclComm_t comm, int *err) { (void)comm; *err = ncclSuccess; return ncclSuccess; }
int ncclCommCount(ncclComm_t comm, int *n) { *n = comm->nranks; return ncclSuccess; }
int ncclCommUserRank(ncclComm_t comm, int *r) { *r = comm->rank; return ncclSuccess; }
int ncclCommCuDevice(ncclComm_t comm, int *d) { *d = comm->device; return ncclSuccess; }

static int copy(const void *src, void *dst, size_t count, int dtype) {
    size_t sz = type_size(dtype);
    if (sz == 0) return ncclInvalidArgument;
    if (src != dst && count) memmove(dst, src, count * sz);
    return ncclSuccess;
}

int ncclAllReduce(const void *s, void *r, size_t count, int dtype, int op, ncclComm_t comm, void *stream) {
    (void)comm; (void)stream;
    int f = take_failure();
    if (f) return f;
    if (op < 0 || op > 4) return ncclInvalidArgument;
    pthread_mutex_lock(&mu);
    if (block_next) {
        /* Wait (up to 10 s) for another thread to call fake_nccl_release(): only possible if the
         * caller released the GIL around this call. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 10;
        block_next = 0;
        while (!released) {
            if (pthread_cond_timedwait(&cv, &mu, &ts) != 0) break;
        }
        int ok = released;
        pthread_mutex_unlock(&mu);
        if (!ok) return ncclSystemError;
    } else {
        pthread_mutex_unlock(&mu);
    }
    return copy(s, r, count, dtype);
}

int ncclBroadcast(const void *s, void *r, size_t count, int dtype, int root, ncclComm_t c, void *st) {
    (void)c; (void)st;
    int f = take_failure();
    if (f) return f;
    if (root != 0) return ncclInvalidArgument;
    return copy(s, r, count, dtype);
}

int ncclReduce(const void *s, void *r, size_t count, int dtype, int op, int root, ncclComm_t c, void *st) {
    (void)c; (void)st; (void)op;
    int f = take_failure();
    if (f) return f;
    if (root != 0) return ncclInvalidArgument;
    return copy(s, r, count, dtype);
}

int ncclAllGather(const void *s, void *r, size_t count, int dtype, ncclComm_t c, void *st) {
    (void)c; (void)st;
    int f = take_failure();
    return f ? f : copy(s, r, count, dtype);
}

int ncclReduceScatter(const void *s, void *r, size_t count, int dtype, int op, ncclComm_t c, void *st) {
    (void)c; (void)st; (void)op;
    int f = take_failure();
    return f ? f : copy(s, r, count, dtype);
}

/* No ncclAlltoAll / ncclGather / ncclScatter: the binding's grouped Send/Recv fallbacks run. */

int ncclGroupStart(void) {
    group_depth++;
    return ncclSuccess;
}

int ncclGroupEnd(void) {
    if (group_depth <= 0) return ncclInvalidUsage;
    group_depth--;
    int leftover = pend_n;
    pend_n = 0;
    return leftover ? ncclInvalidUsage : ncclSuccess; /* a send nobody received */
}

#ifndef FAKE_NO_P2P /* -DFAKE_NO_P2P: an old NCCL without point-to-point (< 2.7) */
int ncclSend(const void *buf, size_t count, int dtype, int peer, ncclComm_t c, void *st) {
    (void)c; (void)st;
    int f = take_failure();
    if (f) return f;
    if (peer != 0 || type_size(dtype) == 0) return ncclInvalidArgument;
    if (group_depth <= 0 || pend_n >= 64) return ncclInvalidUsage; /* one rank: must be grouped */
    pend_ptr[pend_n] = buf;
    pend_bytes[pend_n] = count * type_size(dtype);
    pend_n++;
    return ncclSuccess;
}

int ncclRecv(void *buf, size_t count, int dtype, int peer, ncclComm_t c, void *st) {
    (void)c; (void)st;
    if (peer != 0 || type_size(dtype) == 0) return ncclInvalidArgument;
    if (pend_n == 0) return ncclInvalidUsage;
    size_t bytes = count * type_size(dtype);
    if (bytes != pend_bytes[0]) return ncclInvalidArgument;
    memmove(buf, pend_ptr[0], bytes);
    memmove(pend_ptr, pend_ptr + 1, (size_t)(pend_n - 1) * sizeof(pend_ptr[0]));
    memmove(pend_bytes, pend_bytes + 1, (size_t)(pend_n - 1) * sizeof(pend_bytes[0]));
    pend_n--;
    return ncclSuccess;
}
#endif
