# Declarations only: an OpenMP shim that compiles with or without -fopenmp (like scikit-learn's
# _openmp_helpers.pxd). cimport it instead of `openmp` so a build without OpenMP runs serially.

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define TL_OPENMP_ENABLED 1
    static inline int tl_omp_get_max_threads(void) { return omp_get_max_threads(); }
    static inline int tl_omp_get_thread_num(void) { return omp_get_thread_num(); }
    #else
    #define TL_OPENMP_ENABLED 0
    static inline int tl_omp_get_max_threads(void) { return 1; }
    static inline int tl_omp_get_thread_num(void) { return 0; }
    #endif
    """
    bint TL_OPENMP_ENABLED
    int tl_omp_get_max_threads() noexcept nogil
    int tl_omp_get_thread_num() noexcept nogil
