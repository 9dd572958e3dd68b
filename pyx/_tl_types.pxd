# Declarations only: fused types shared by the compiled kernels.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t

ctypedef fused real_t:
    float
    double

ctypedef fused index_t:
    int32_t
    int64_t
