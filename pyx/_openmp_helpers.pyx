# Build facts that only the compiled code can report: whether this extension was compiled with
# OpenMP and how many threads the OpenMP runtime would use. trainloom.show_config() reads them.
from cython.parallel cimport prange

from _tl_omp cimport TL_OPENMP_ENABLED, tl_omp_get_max_threads, tl_omp_get_thread_num


def openmp_enabled() -> bool:
    """True when the compiled kernels were built with OpenMP."""
    return bool(TL_OPENMP_ENABLED)


def openmp_max_threads() -> int:
    """omp_get_max_threads() of the runtime the kernels use (1 without OpenMP)."""
    return tl_omp_get_max_threads()


def openmp_threads_used(int num_threads) -> int:
    """Run a parallel region with num_threads and return how many distinct threads ran it.

    A smoke test that the OpenMP runtime loaded next to torch's actually forks threads.
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    cdef int seen[256]
    cdef int i, n = min(num_threads, 256), count = 0
    for i in range(256):
        seen[i] = 0
    for i in prange(n, nogil=True, num_threads=n, schedule="static", chunksize=1):
        seen[tl_omp_get_thread_num() % 256] = 1
    for i in range(256):
        count += seen[i]
    return count
