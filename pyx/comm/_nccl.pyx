# cython: language_level=3
"""NCCL loaded with dlopen at first use: no CUDA/NCCL headers or libraries at build time.

Only ints reach this module (``data_ptr()`` values, element counts, ncclDataType_t / ncclRedOp_t
codes, ``cudaStream_t`` handles as ints); trainloom/comm/nccl.py validates tensors before calling it.
Enum values are those of NCCL 2.x (fixed since 2.0; ncclAvg since 2.10, bfloat16 since 2.10).
"""

from libc.stdint cimport int64_t, intptr_t, uintptr_t
from libc.string cimport memcpy
from posix.dlfcn cimport RTLD_LOCAL, RTLD_NOW, dlclose, dlerror, dlopen, dlsym

import os

from trainloom.errors import NcclError, NcclUnavailableError


cdef extern from "<dlfcn.h>" nogil:
    # Not in Cython's posix.dlfcn: reuse a libnccl torch (or anyone) already mapped, so one process
    # never runs two NCCL copies with separate global state.
    int RTLD_NOLOAD
    ctypedef struct Dl_info:
        const char* dli_fname
        void* dli_fbase
        const char* dli_sname
        void* dli_saddr
    int dladdr(const void* addr, Dl_info* info)


ctypedef void* ncclComm_t
ctypedef void* cudaStream_t
ctypedef struct ncclUniqueId:
    char internal[128]

ctypedef int (*F_GetVersion)(int*) noexcept nogil
ctypedef int (*F_GetUniqueId)(ncclUniqueId*) noexcept nogil
ctypedef const char* (*F_GetErrorString)(int) noexcept nogil
ctypedef const char* (*F_GetLastError)(ncclComm_t) noexcept nogil
ctypedef int (*F_CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) noexcept nogil
ctypedef int (*F_CommOne)(ncclComm_t) noexcept nogil
ctypedef int (*F_CommGetAsyncError)(ncclComm_t, int*) noexcept nogil
ctypedef int (*F_CommInt)(ncclComm_t, int*) noexcept nogil
ctypedef int (*F_AllReduce)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef int (*F_Broadcast)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef int (*F_Reduce)(const void*, void*, size_t, int, int, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef int (*F_AllGather)(const void*, void*, size_t, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef int (*F_ReduceScatter)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef int (*F_AlltoAll)(const void*, void*, size_t, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef int (*F_Rooted)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef int (*F_Send)(const void*, size_t, int, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef int (*F_Recv)(void*, size_t, int, int, ncclComm_t, cudaStream_t) noexcept nogil
ctypedef int (*F_Void)() noexcept nogil


cdef struct _Api:
    F_GetVersion GetVersion
    F_GetUniqueId GetUniqueId
    F_GetErrorString GetErrorString
    F_GetLastError GetLastError          # optional (2.13+)
    F_CommInitRank CommInitRank
    F_CommOne CommDestroy
    F_CommOne CommAbort
    F_CommGetAsyncError CommGetAsyncError
    F_CommInt CommCount
    F_CommInt CommUserRank
    F_CommInt CommCuDevice
    F_AllReduce AllReduce
    F_Broadcast Broadcast
    F_Reduce Reduce
    F_AllGather AllGather
    F_ReduceScatter ReduceScatter
    F_AlltoAll AlltoAll                  # optional (2.28+); emulated with Send/Recv otherwise
    F_Rooted Gather                      # optional (2.28+)
    F_Rooted Scatter                     # optional (2.28+)
    F_Send Send                          # optional (2.7+)
    F_Recv Recv                          # optional (2.7+)
    F_Void GroupStart
    F_Void GroupEnd

cdef _Api _api
cdef void* _lib = NULL
cdef object _load_error = None
cdef object _lib_path = None
cdef int _version = 0



cdef void* _sym(void* lib, const char* name) except NULL:
    cdef void* p = dlsym(lib, name)
    if p == NULL:
        raise NcclUnavailableError(
            f"symbol {name.decode()} missing from the loaded libnccl; trainloom needs NCCL >= 2.7"
        )
    return p


cdef void* _opt(void* lib, const char* name) noexcept:
    # Symbols only newer NCCL exports: NULL is allowed, the caller raises NotImplementedError.
    return dlsym(lib, name)


cdef str _dlerr():
    cdef const char* e = dlerror()
    return e.decode(errors="replace") if e != NULL else "unknown dlopen error"


cdef str _shown(name):
    # A path for messages: os.fsdecode keeps undecodable bytes as lone surrogates, which printing
    # (trainloom info) cannot encode; show them as U+FFFD, as dlerror() text is decoded.
    return os.fsencode(name).decode("utf-8", "replace")


def _try_open(list candidates):
    """(handle int, name) of the first candidate that loads, or (0, list of failure texts)."""
    cdef void* h = NULL
    cdef bytes b
    failures = []
    # Pass 1: a copy already mapped into this process (torch's), without loading anything new.
    for name in candidates:
        # os.fsencode, not str.encode(): a path from the environment may hold bytes that are not
        # UTF-8 (os.environ keeps them as surrogates), which .encode() refuses.
        b = os.fsencode(name)
        h = dlopen(b, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)
        if h != NULL:
            return <intptr_t>h, name
    dlerror()  # clear the NOLOAD misses: they are not failures worth reporting
    # Pass 2: load, in the documented order.
    for name in candidates:
        b = os.fsencode(name)
        h = dlopen(b, RTLD_NOW | RTLD_LOCAL)
        if h != NULL:
            return <intptr_t>h, name
        failures.append(f"{_shown(name)}: {_dlerr()}")
    return 0, failures


cdef int _ensure_loaded() except -1:
    """Load libnccl and fill the function table; called with the GIL held, at first use only."""
    global _lib, _load_error, _lib_path, _version
    if _lib != NULL:
        return 0
    if _load_error is not None:
        raise NcclUnavailableError(_load_error)
    from trainloom._locate import NCCL_LIBRARY_ENV, nccl_candidates

    explicit = os.environ.get(NCCL_LIBRARY_ENV)
    # An explicit choice is honoured exactly: never substitute another library for it silently.
    candidates = [explicit] if explicit else nccl_candidates()
    handle, res = _try_open(candidates)
    if handle == 0:
        if explicit:
            # A bare name goes to the dynamic loader's search path only, where the pip wheel's copy
            # (site-packages/nvidia/nccl/lib) is not: say so rather than suggest installing it again.
            hint = (
                f"\nA bare file name is looked up by the dynamic loader only (LD_LIBRARY_PATH, ldconfig): "
                f"give the library's full path, or unset ${NCCL_LIBRARY_ENV} to let trainloom search the "
                "nvidia-nccl-cu12 wheel (`pip install nvidia-nccl-cu12`) and the usual places."
                if "/" not in explicit
                else f"\nPoint ${NCCL_LIBRARY_ENV} at a loadable libnccl.so.2, or unset it to search the "
                "usual places (`pip install nvidia-nccl-cu12` provides one)."
            )
            _load_error = f"NCCL unavailable: ${NCCL_LIBRARY_ENV}={explicit!r} could not be loaded: {res[0]}" + hint
        else:
            _load_error = (
                "NCCL unavailable: no libnccl.so.2 found. Tried, in order:\n  " + "\n  ".join(res)
                + "\nInstall it with `pip install nvidia-nccl-cu12` (or trainloom[nccl]) or point "
                + f"${NCCL_LIBRARY_ENV} at a libnccl.so.2."
            )
        raise NcclUnavailableError(_load_error)
    cdef void* h = <void*><intptr_t>handle
    cdef _Api api
    cdef Dl_info info
    cdef int ver = 0
    if dlsym(h, b"ncclGetVersion") == NULL:
        dlclose(h)
        _load_error = f"NCCL unavailable: {_shown(res)} is not an NCCL library (it exports no ncclGetVersion)"
        raise NcclUnavailableError(_load_error)
    try:
        api.GetVersion = <F_GetVersion>_sym(h, b"ncclGetVersion")
        api.GetUniqueId = <F_GetUniqueId>_sym(h, b"ncclGetUniqueId")
        api.GetErrorString = <F_GetErrorString>_sym(h, b"ncclGetErrorString")
        api.GetLastError = <F_GetLastError>_opt(h, b"ncclGetLastError")
        api.CommInitRank = <F_CommInitRank>_sym(h, b"ncclCommInitRank")
        api.CommDestroy = <F_CommOne>_sym(h, b"ncclCommDestroy")
        api.CommAbort = <F_CommOne>_sym(h, b"ncclCommAbort")
        api.CommGetAsyncError = <F_CommGetAsyncError>_sym(h, b"ncclCommGetAsyncError")
        api.CommCount = <F_CommInt>_sym(h, b"ncclCommCount")
        api.CommUserRank = <F_CommInt>_sym(h, b"ncclCommUserRank")
        api.CommCuDevice = <F_CommInt>_sym(h, b"ncclCommCuDevice")
        api.AllReduce = <F_AllReduce>_sym(h, b"ncclAllReduce")
        api.Broadcast = <F_Broadcast>_sym(h, b"ncclBroadcast")
        api.Reduce = <F_Reduce>_sym(h, b"ncclReduce")
        api.AllGather = <F_AllGather>_sym(h, b"ncclAllGather")
        api.ReduceScatter = <F_ReduceScatter>_sym(h, b"ncclReduceScatter")
        api.AlltoAll = <F_AlltoAll>_opt(h, b"ncclAlltoAll")
        api.Gather = <F_Rooted>_opt(h, b"ncclGather")
        api.Scatter = <F_Rooted>_opt(h, b"ncclScatter")
        api.Send = <F_Send>_opt(h, b"ncclSend")
        api.Recv = <F_Recv>_opt(h, b"ncclRecv")
        api.GroupStart = <F_Void>_sym(h, b"ncclGroupStart")
        api.GroupEnd = <F_Void>_sym(h, b"ncclGroupEnd")
    except NcclUnavailableError as exc:
        dlclose(h)
        _load_error = f"{_shown(res)}: {exc}"
        raise NcclUnavailableError(_load_error) from None
    api.GetVersion(&ver)
    path = _shown(res)
    if dladdr(<void*>api.GetVersion, &info) != 0 and info.dli_fname != NULL:
        path = info.dli_fname.decode(errors="replace")
    global _api
    _api = api
    _version = ver
    _lib_path = path
    _lib = h  # published last: no caller ever sees half a table
    return 0


def ensure_loaded():
    """Load libnccl now (idempotent). Raises NcclUnavailableError listing every path tried."""
    _ensure_loaded()


def is_loaded():
    return _lib != NULL


def load_error():
    """Why loading failed, or None when it has not failed (yet)."""
    return _load_error


def library_path():
    """The file libnccl was loaded from (dladdr of ncclGetVersion)."""
    _ensure_loaded()
    return _lib_path


def get_version():
    """ncclGetVersion(), e.g. 23203 for 2.32.3."""
    _ensure_loaded()
    return _version


def error_string(int status):
    _ensure_loaded()
    cdef const char* s = _api.GetErrorString(status)
    return s.decode(errors="replace") if s != NULL else "unknown NCCL error"


cdef int _check(int st, str where, ncclComm_t comm=NULL) except -1:
    if st == 0:
        return 0
    msg = error_string(st)
    cdef const char* last
    if _api.GetLastError != NULL:
        last = _api.GetLastError(comm)
        if last != NULL and last[0] != 0:
            msg = f"{msg}; {last.decode(errors='replace')}"
    raise NcclError(st, where, msg)


def get_unique_id():
    """ncclGetUniqueId() as 128 bytes (works without a GPU)."""
    _ensure_loaded()
    cdef ncclUniqueId uid
    cdef int st
    with nogil:  # may open a socket to pick the bootstrap interface
        st = _api.GetUniqueId(&uid)
    _check(st, "ncclGetUniqueId")
    return (<char*>uid.internal)[:128]


def has_symbol(str name):
    """Whether the loaded library exports ``name`` (for optional, version-dependent APIs)."""
    _ensure_loaded()
    return dlsym(_lib, name.encode()) != NULL


cdef int _need(void* fn, str name) except -1:
    if fn == NULL:
        raise NotImplementedError(
            f"{name} is not exported by the loaded libnccl (version {_version}, from {_lib_path}); "
            "upgrade NCCL (pip install -U nvidia-nccl-cu12)"
        )
    return 0


def group_start():
    _ensure_loaded()
    cdef int st
    with nogil:
        st = _api.GroupStart()
    _check(st, "ncclGroupStart")


def group_end():
    _ensure_loaded()
    cdef int st
    with nogil:  # may block while peers connect
        st = _api.GroupEnd()
    _check(st, "ncclGroupEnd")


cdef class Communicator:
    """One NCCL communicator (one rank of ``nranks``), owning its ncclComm_t.

    A communicator belongs to one thread at a time (the Python layer serialises calls); ``close()``
    or ``abort()`` from another thread while a call runs is not supported (py-lmdb issue #180:
    the handle would be freed under the running call).
    """

    cdef ncclComm_t _comm
    cdef readonly int rank
    cdef readonly int world_size

    def __cinit__(self):
        self._comm = NULL  # always valid, even if __init__ raises

    def __init__(self, int world_size, bytes unique_id, int rank):
        if len(unique_id) != 128:
            raise ValueError(f"unique_id must be 128 bytes (ncclUniqueId), got {len(unique_id)}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        _ensure_loaded()
        cdef ncclUniqueId uid
        memcpy(uid.internal, <const char*>unique_id, 128)
        cdef ncclComm_t c = NULL
        cdef int st
        cdef int n = world_size, r = rank
        with nogil:  # blocks until every rank has joined
            st = _api.CommInitRank(&c, n, uid, r)
        _check(st, "ncclCommInitRank")
        self._comm = c
        self.rank = rank
        self.world_size = world_size

    cdef ncclComm_t _get(self, str what) except NULL:
        if self._comm == NULL:
            from trainloom.errors import CommError

            raise CommError(f"{what}: NCCL communicator used after close() or abort()")
        return self._comm

    @property
    def closed(self):
        return self._comm == NULL

    def close(self):
        """ncclCommDestroy; idempotent."""
        cdef ncclComm_t c = self._comm
        cdef int st
        self._comm = NULL
        if c != NULL:
            with nogil:  # waits for the communicator's pending work
                st = _api.CommDestroy(c)
            _check(st, "ncclCommDestroy")

    def abort(self):
        """ncclCommAbort: frees the communicator without waiting for pending work (timeouts)."""
        cdef ncclComm_t c = self._comm
        cdef int st
        self._comm = NULL
        if c != NULL:
            with nogil:
                st = _api.CommAbort(c)
            _check(st, "ncclCommAbort")

    def __dealloc__(self):
        # Safety net only (no Python calls here): an unclosed communicator is destroyed.
        if self._comm != NULL:
            _api.CommDestroy(self._comm)
            self._comm = NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def get_async_error(self):
        """ncclCommGetAsyncError: 0 when fine, NCCL_IN_PROGRESS (7) while initialising."""
        cdef ncclComm_t c = self._get("ncclCommGetAsyncError")
        cdef int err = 0, st
        with nogil:
            st = _api.CommGetAsyncError(c, &err)
        _check(st, "ncclCommGetAsyncError", c)
        return err

    def count(self):
        cdef ncclComm_t c = self._get("ncclCommCount")
        cdef int v = 0, st
        st = _api.CommCount(c, &v)
        _check(st, "ncclCommCount", c)
        return v

    def user_rank(self):
        cdef ncclComm_t c = self._get("ncclCommUserRank")
        cdef int v = 0, st
        st = _api.CommUserRank(c, &v)
        _check(st, "ncclCommUserRank", c)
        return v

    def cu_device(self):
        cdef ncclComm_t c = self._get("ncclCommCuDevice")
        cdef int v = 0, st
        st = _api.CommCuDevice(c, &v)
        _check(st, "ncclCommCuDevice", c)
        return v

    # Every collective: arguments to C locals, the call with the GIL released (enqueueing can block
    # on a full queue or a peer's connection), then the status checked with the GIL back.

    def allreduce(self, intptr_t send, intptr_t recv, size_t count, int dtype, int op, intptr_t stream):
        cdef ncclComm_t c = self._get("ncclAllReduce")
        cdef int st
        with nogil:
            st = _api.AllReduce(<const void*>send, <void*>recv, count, dtype, op, c, <cudaStream_t>stream)
        _check(st, "ncclAllReduce", c)

    def broadcast(self, intptr_t send, intptr_t recv, size_t count, int dtype, int root, intptr_t stream):
        cdef ncclComm_t c = self._get("ncclBroadcast")
        cdef int st
        with nogil:
            st = _api.Broadcast(<const void*>send, <void*>recv, count, dtype, root, c, <cudaStream_t>stream)
        _check(st, "ncclBroadcast", c)

    def reduce(self, intptr_t send, intptr_t recv, size_t count, int dtype, int op, int root,
               intptr_t stream):
        cdef ncclComm_t c = self._get("ncclReduce")
        cdef int st
        with nogil:
            st = _api.Reduce(<const void*>send, <void*>recv, count, dtype, op, root, c, <cudaStream_t>stream)
        _check(st, "ncclReduce", c)

    def allgather(self, intptr_t send, intptr_t recv, size_t sendcount, int dtype, intptr_t stream):
        cdef ncclComm_t c = self._get("ncclAllGather")
        cdef int st
        with nogil:
            st = _api.AllGather(<const void*>send, <void*>recv, sendcount, dtype, c, <cudaStream_t>stream)
        _check(st, "ncclAllGather", c)

    def reduce_scatter(self, intptr_t send, intptr_t recv, size_t recvcount, int dtype, int op,
                       intptr_t stream):
        cdef ncclComm_t c = self._get("ncclReduceScatter")
        cdef int st
        with nogil:
            st = _api.ReduceScatter(<const void*>send, <void*>recv, recvcount, dtype, op, c,
                                    <cudaStream_t>stream)
        _check(st, "ncclReduceScatter", c)

    def send(self, intptr_t buf, size_t count, int dtype, int peer, intptr_t stream):
        cdef ncclComm_t c = self._get("ncclSend")
        _need(<void*>_api.Send, "ncclSend")
        cdef int st
        with nogil:
            st = _api.Send(<const void*>buf, count, dtype, peer, c, <cudaStream_t>stream)
        _check(st, "ncclSend", c)

    def recv(self, intptr_t buf, size_t count, int dtype, int peer, intptr_t stream):
        cdef ncclComm_t c = self._get("ncclRecv")
        _need(<void*>_api.Recv, "ncclRecv")
        cdef int st
        with nogil:
            st = _api.Recv(<void*>buf, count, dtype, peer, c, <cudaStream_t>stream)
        _check(st, "ncclRecv", c)

    def alltoall(self, intptr_t send, intptr_t recv, size_t count, size_t elem_size, int dtype,
                 intptr_t stream):
        """count elements to/from each peer; ncclAlltoAll when exported, else grouped Send/Recv."""
        cdef ncclComm_t c = self._get("ncclAlltoAll")
        cdef int st = 0, st2 = 0, peer, n = self.world_size
        cdef size_t step = count * elem_size
        if _api.AlltoAll != NULL:
            with nogil:
                st = _api.AlltoAll(<const void*>send, <void*>recv, count, dtype, c, <cudaStream_t>stream)
            _check(st, "ncclAlltoAll", c)
            return
        _need(<void*>_api.Send, "ncclSend")
        with nogil:
            st = _api.GroupStart()
            if st == 0:
                for peer in range(n):
                    st = _api.Send(<const void*>(<char*>send + peer * step), count, dtype, peer, c,
                                   <cudaStream_t>stream)
                    if st != 0:
                        break
                    st = _api.Recv(<void*>(<char*>recv + peer * step), count, dtype, peer, c,
                                   <cudaStream_t>stream)
                    if st != 0:
                        break
                st2 = _api.GroupEnd()  # always close the group, even after a failed enqueue
        _check(st, "ncclAlltoAll(send/recv)", c)
        _check(st2, "ncclGroupEnd", c)

    def alltoall_v(self, intptr_t send, const int64_t[::1] send_counts, const int64_t[::1] send_displs,
                   intptr_t recv, const int64_t[::1] recv_counts, const int64_t[::1] recv_displs,
                   size_t elem_size, int dtype, intptr_t stream):
        """Counts/displacements in elements, one per peer; grouped ncclSend/ncclRecv."""
        cdef ncclComm_t c = self._get("ncclAlltoAllv")
        _need(<void*>_api.Send, "ncclSend")
        cdef int n = self.world_size, peer, st = 0, st2 = 0
        if (send_counts.shape[0] != n or send_displs.shape[0] != n or recv_counts.shape[0] != n
                or recv_displs.shape[0] != n):
            raise ValueError(f"alltoall_v: counts and displacements need one entry per rank ({n}) each")
        with nogil:
            st = _api.GroupStart()
            if st == 0:
                for peer in range(n):
                    if send_counts[peer] > 0:
                        st = _api.Send(<const void*>(<char*>send + send_displs[peer] * elem_size),
                                       <size_t>send_counts[peer], dtype, peer, c, <cudaStream_t>stream)
                        if st != 0:
                            break
                    if recv_counts[peer] > 0:
                        st = _api.Recv(<void*>(<char*>recv + recv_displs[peer] * elem_size),
                                       <size_t>recv_counts[peer], dtype, peer, c, <cudaStream_t>stream)
                        if st != 0:
                            break
                st2 = _api.GroupEnd()
        _check(st, "ncclAlltoAllv(send/recv)", c)
        _check(st2, "ncclGroupEnd", c)

    def gather(self, intptr_t send, intptr_t recv, size_t count, size_t elem_size, int dtype, int root,
               intptr_t stream):
        cdef ncclComm_t c = self._get("ncclGather")
        cdef int st = 0, st2 = 0, peer, n = self.world_size, me = self.rank
        if _api.Gather != NULL:
            with nogil:
                st = _api.Gather(<const void*>send, <void*>recv, count, dtype, root, c, <cudaStream_t>stream)
            _check(st, "ncclGather", c)
            return
        _need(<void*>_api.Send, "ncclSend")
        with nogil:
            st = _api.GroupStart()
            if st == 0:
                st = _api.Send(<const void*>send, count, dtype, root, c, <cudaStream_t>stream)
                if st == 0 and me == root:
                    for peer in range(n):
                        st = _api.Recv(<void*>(<char*>recv + peer * count * elem_size), count, dtype, peer,
                                       c, <cudaStream_t>stream)
                        if st != 0:
                            break
                st2 = _api.GroupEnd()
        _check(st, "ncclGather(send/recv)", c)
        _check(st2, "ncclGroupEnd", c)

    def scatter(self, intptr_t send, intptr_t recv, size_t count, size_t elem_size, int dtype, int root,
                intptr_t stream):
        cdef ncclComm_t c = self._get("ncclScatter")
        cdef int st = 0, st2 = 0, peer, n = self.world_size, me = self.rank
        if _api.Scatter != NULL:
            with nogil:
                st = _api.Scatter(<const void*>send, <void*>recv, count, dtype, root, c, <cudaStream_t>stream)
            _check(st, "ncclScatter", c)
            return
        _need(<void*>_api.Send, "ncclSend")
        with nogil:
            st = _api.GroupStart()
            if st == 0:
                if me == root:
                    for peer in range(n):
                        st = _api.Send(<const void*>(<char*>send + peer * count * elem_size), count, dtype,
                                       peer, c, <cudaStream_t>stream)
                        if st != 0:
                            break
                if st == 0:
                    st = _api.Recv(<void*>recv, count, dtype, root, c, <cudaStream_t>stream)
                st2 = _api.GroupEnd()
        _check(st, "ncclScatter(send/recv)", c)
        _check(st2, "ncclGroupEnd", c)
