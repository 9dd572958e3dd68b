# The sample codec: nested tuples/lists/dicts of tensors, numpy arrays, numbers, str and bytes into one
# checksummed buffer, and back.
#
# Layout of an encoded value (all integers little-endian; x86-64 and aarch64 are both little-endian):
#
#   [0:4)   magic b"TLC\x02" (b"TLC\x01": written before the checksum's key depended on the stripe's
#           place; still read, verified with that checksum: see _checksum)
#   [4:8)   meta_len   u32   length of the meta section (the object tree, small)
#   [8:16)  data_len   u64   length of the data section (raw array bytes)
#   [16:24) checksum   u64   _checksum over meta + padding, chained (as seed) into _checksum over data
#   [24:32) reserved   zero
#   [32:32+meta_len)         meta: one tag byte per node, then the node's fields
#   pad to a multiple of 64  so that array data sits on cache-line offsets from the value start
#   [data_start:+data_len)   data: each array's C-contiguous bytes, each at a 64-aligned offset
#
# Only the elements a view covers are written (a 10-element view of a 1M-element tensor costs 40 bytes,
# not 4 MB as pickle would), and tensors never go through pickle: objects the tree cannot express are
# pickled with protocol 5, but every tensor/array inside them is pulled out through persistent_id and
# stored raw in the data section like any other array. Tensor subclasses (torchvision's tv_tensors,
# your `class Image(torch.Tensor)`) are pickled as their plain data (raw) plus their type and attributes
# (_reduce_tensor), and tensors of more dimensions than numpy arrays have as their flat data (raw) plus
# their shape. A sample holding such objects below its top level is pickled whole, in one T_PICKLE
# node (encode()): one pickler and one memo for all of them. Values written when each object was
# pickled on its own (T_PICKLE nodes inside the tree) decode as before; the format has not changed.
#
# Decoding copies the data section once (fused with the checksum pass) into a block the decoder owns
# (_Block: pooled from 64 KiB) and returns tensors/arrays that are views of it. That single copy is what
# LMDB needs (its buffers are only valid inside the read transaction); the source is never copied twice.
# Batches spread the checksum+copy passes of their large values over threads (_decode_batch).
import copyreg
import io
import logging
import pickle
import sys

import numpy as np
import torch

cimport numpy as cnp

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.buffer cimport PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.ref cimport Py_INCREF
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_FromSsize_t
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc, PyMem_RawFree, PyMem_RawMalloc, PyMem_Realloc
from cpython.exc cimport PyErr_Clear, PyErr_ExceptionMatches
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

# ---------------------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------------------
cdef enum:
    HEADER = 32
    ALIGN = 64
    # Below this many bytes, hashing/copying takes less than releasing and re-taking the GIL (~0.1-0.2
    # us with contention), so the small-sample path keeps the GIL.
    NOGIL_MIN = 65536
    # Nesting depth guard: a self-referencing list would otherwise recurse until the C stack overflows.
    MAX_DEPTH = 200
    # _Encoder.encode's return (first pass) for a sample holding, below the top level, a value the tree
    # cannot express: encode() then pickles the whole sample at once (a return code, not an exception:
    # samples of small objects take this path on every encode).
    NEEDS_PICKLE = 1
    # First tensor dtype code stored as the integer of its width (see _RAW_VIEW_DTYPES).
    FIRST_RAW_VIEW = 15

cdef bytes MAGIC = b"TLC\x02"
cdef bytes MAGIC_V1 = b"TLC\x01"  # values checksummed with one key for every stripe (_checksum)

_logger = logging.getLogger("trainloom.data.codec")

#: The nesting depth the codec encodes (cache.py's tensor-state walks go as deep).
CODEC_MAX_DEPTH = MAX_DEPTH

cdef extern from "Python.h":
    # Without Cython's exception check: NULL (UnicodeEncodeError set) for a str holding a lone
    # surrogate, which encode() then pickles instead (pickle writes such strings with surrogatepass).
    const char* _utf8_and_size "PyUnicode_AsUTF8AndSize"(object, Py_ssize_t*) noexcept

cdef enum Tag:
    T_NONE = 0
    T_FALSE = 1
    T_TRUE = 2
    T_INT = 3
    T_FLOAT = 4
    T_STR = 5
    T_BYTES = 6
    T_TUPLE = 7
    T_LIST = 8
    T_DICT = 9
    T_NDARRAY = 10
    T_TENSOR = 11
    T_NPSCALAR = 12
    T_PICKLE = 13

# Array descriptor kinds inside a T_PICKLE node.
cdef enum Kind:
    K_NDARRAY = 0
    K_TENSOR = 1
    K_RAW = 2

cdef uint64_t P1 = 0x9E3779B185EBCA87ULL
cdef uint64_t P2 = 0xC2B2AE3D27D4EB4FULL
cdef uint64_t P3 = 0x165667B19E3779F9ULL
cdef uint64_t P4 = 0x85EBCA77C2B2AE63ULL
cdef uint64_t P5 = 0x27D4EB2F165667C5ULL

# dtype tables: code <-> dtype. Codes are part of the on-disk format: append only, never renumber.
_NP_DTYPES = [np.dtype(x) for x in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
    "complex64", "complex128", "uint16", "uint32", "uint64")]
_NP_CODE = {dt: i for i, dt in enumerate(_NP_DTYPES)}
_TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                 torch.uint16, torch.uint32, torch.uint64, torch.bfloat16]
_TORCH_NAMES = [str(dt).replace("torch.", "") for dt in _TORCH_DTYPES]
_TORCH_ITEMSIZE = [torch.empty((), dtype=dt).element_size() for dt in _TORCH_DTYPES]
# Decoded arrays are made with numpy's C API over the decoder's own block (0.1 us, against 0.3 us for
# np.ndarray(shape, dtype, buffer=...) and 2.5 us for torch.frombuffer(...).view(shape)); a tensor is
# torch.from_numpy of such an array (0.7 us). _TORCH_AS_NP[code] is the numpy dtype with the tensor's
# bytes; for dtypes numpy lacks (bfloat16) an integer of the same width, reinterpreted by
# Tensor.view(dtype).
_TORCH_AS_NP = [np.dtype(x) for x in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
    "complex64", "complex128", "uint16", "uint32", "uint64", "int16")]
# Codes from FIRST_RAW_VIEW on: dtypes numpy lacks whose torch pickle cannot be loaded back (float8,
# float4, the bits types, complex32, the sub-byte shells), stored raw like bfloat16 as the integer of
# their width. (name, bytes per element), appended in code order. A dtype this torch lacks, or sizes
# differently, has no entry (None): encoding it goes to pickle, decoding it raises CodecError.
_RAW_VIEW_DTYPES = (
    ("float8_e4m3fn", 1), ("float8_e5m2", 1), ("float8_e4m3fnuz", 1), ("float8_e5m2fnuz", 1),
    ("float8_e8m0fnu", 1), ("float4_e2m1fn_x2", 1), ("bits8", 1), ("bits16", 2), ("bits1x8", 1),
    ("bits2x4", 1), ("bits4x2", 1), ("complex32", 4),
    ("uint1", 1), ("uint2", 1), ("uint3", 1), ("uint4", 1), ("uint5", 1), ("uint6", 1), ("uint7", 1),
    ("int1", 1), ("int2", 1), ("int3", 1), ("int4", 1), ("int5", 1), ("int6", 1), ("int7", 1))
_RAW_NP = {1: np.dtype("uint8"), 2: np.dtype("int16"), 4: np.dtype("int32")}
_RAW_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
# The torch dtype a tensor of a raw-view code is reinterpreted as to be made contiguous (torch cannot
# copy some of them, e.g. uint1).
_TORCH_STORE_AS = [None] * len(_TORCH_DTYPES)


def _raw_view_dtype(name, width):
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        return None
    # dtype.itemsize, not torch.empty(): creating a complex32 tensor warns that it is experimental.
    if getattr(dt, "itemsize", None) != width:
        return None
    return dt


for _name, _width in _RAW_VIEW_DTYPES:
    _TORCH_DTYPES.append(_raw_view_dtype(_name, _width))
    _TORCH_NAMES.append(_name)
    _TORCH_ITEMSIZE.append(_width)
    _TORCH_AS_NP.append(_RAW_NP[_width])
    _TORCH_STORE_AS.append(_RAW_TORCH[_width])
_TORCH_CODE = {dt: i for i, dt in enumerate(_TORCH_DTYPES) if dt is not None}
_TORCH_NEEDS_VIEW = [tdt is not None and torch.from_numpy(np.zeros(1, dt)).dtype != tdt
                     for dt, tdt in zip(_TORCH_AS_NP, _TORCH_DTYPES)]
_NP_TYPENUM = [dt.num for dt in _NP_DTYPES]
_TORCH_TYPENUM = [dt.num for dt in _TORCH_AS_NP]
cnp.import_array()

# C copies of the tables the decoder reads for every array: a small sample is a few arrays, and the
# Python list indexing, int conversions and dtype.itemsize lookups cost more than making the array.
cdef enum:
    MAX_CODES = 64
cdef int _n_np_codes = len(_NP_DTYPES)
cdef int _n_torch_codes = len(_TORCH_DTYPES)
cdef int _np_typenum_c[MAX_CODES]
cdef uint64_t _np_itemsize_c[MAX_CODES]
cdef int _torch_typenum_c[MAX_CODES]
cdef uint64_t _torch_itemsize_c[MAX_CODES]
cdef bint _torch_needs_view_c[MAX_CODES]
# Most dimensions an array node may have: the decoder builds every array with numpy's C API, which
# allows NPY_MAXDIMS (64 in numpy 2, 32 in numpy 1, which extensions built against numpy 2 also run on)
# and never more than its 64-entry dims buffers. The encoder sends tensors of more dimensions (torch
# has no such limit) through pickle as their flat data, still raw, so encoder and decoder agree.
cdef int _max_ndim = min(<int>cnp.NPY_MAXDIMS, 64 if int(np.__version__.split(".")[0]) >= 2 else 32)
if _n_np_codes > MAX_CODES or _n_torch_codes > MAX_CODES:
    raise ImportError(f"trainloom.data._codec: more than {MAX_CODES} dtype codes; raise MAX_CODES")
for _i in range(_n_np_codes):
    _np_typenum_c[_i] = _NP_TYPENUM[_i]
    _np_itemsize_c[_i] = _NP_DTYPES[_i].itemsize
for _i in range(_n_torch_codes):
    _torch_typenum_c[_i] = _TORCH_TYPENUM[_i]
    _torch_itemsize_c[_i] = _TORCH_ITEMSIZE[_i]
    _torch_needs_view_c[_i] = _TORCH_NEEDS_VIEW[_i]

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_ndarray = np.ndarray
_npgeneric = np.generic
_strided = torch.strided
_frombuffer_np = np.frombuffer
_np_ndarray = np.ndarray
_from_numpy = torch.from_numpy
_torch_empty = torch.empty
_np_empty = np.empty


class CodecError(ValueError):
    """A value could not be encoded, or a buffer is not a valid encoded value."""


class ChecksumError(CodecError):
    """An encoded value is damaged: its checksum does not match its contents."""


# ---------------------------------------------------------------------------------------------------
# XXH64 (Yann Collet's xxHash, 64-bit variant): ~10 GB/s on one core, 4 independent lanes so the
# multiplies pipeline. Used both as the value checksum and as ClusterStore's stable key hash.
# ---------------------------------------------------------------------------------------------------
cdef inline uint64_t _rotl(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))

cdef inline uint64_t _rd64(const uint8_t* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)      # unaligned-safe; gcc turns this into one load
    return v

cdef inline uint32_t _rd32(const uint8_t* p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v

cdef inline uint64_t _round(uint64_t acc, uint64_t inp) noexcept nogil:
    acc = acc + inp * P2
    acc = _rotl(acc, 31)
    return acc * P1

cdef inline uint64_t _merge(uint64_t acc, uint64_t val) noexcept nogil:
    val = _round(0, val)
    acc = acc ^ val
    return acc * P1 + P4

cdef uint64_t _xxh64(const uint8_t* p, size_t n, uint64_t seed, uint8_t* dst) noexcept nogil:
    """XXH64 of p[0:n]. When dst is not NULL, also copies p[0:n] to dst in the same pass, so the
    source is read from memory once for both (decode is bound by memory bandwidth)."""
    cdef const uint8_t* end = p + n
    cdef uint64_t h, v1, v2, v3, v4, k
    cdef const uint8_t* limit
    if n >= 32:
        v1 = seed + P1 + P2
        v2 = seed + P2
        v3 = seed
        v4 = seed - P1
        limit = end - 32
        while p <= limit:
            if dst != NULL:
                memcpy(dst, p, 32)
                dst += 32
            v1 = _round(v1, _rd64(p))
            v2 = _round(v2, _rd64(p + 8))
            v3 = _round(v3, _rd64(p + 16))
            v4 = _round(v4, _rd64(p + 24))
            p += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = seed + P5
    h += <uint64_t>n
    if dst != NULL and end > p:
        memcpy(dst, p, <size_t>(end - p))
    while p + 8 <= end:
        k = _round(0, _rd64(p))
        h = h ^ k
        h = _rotl(h, 27) * P1 + P4
        p += 8
    if p + 4 <= end:
        h = h ^ (<uint64_t>_rd32(p) * P1)
        h = _rotl(h, 23) * P2 + P3
        p += 4
    while p < end:
        h = h ^ (<uint64_t>p[0] * P5)
        h = _rotl(h, 11) * P1
        p += 1
    h = h ^ (h >> 33)
    h = h * P2
    h = h ^ (h >> 29)
    h = h * P3
    h = h ^ (h >> 32)
    return h


# ---------------------------------------------------------------------------------------------------
# The value checksum: XXH3's long-input accumulate loop (8 lanes, acc += lo32(d^k) * hi32(d^k), the
# data word added to the neighbour lane, a scramble every 1 KiB), finished with XXH64's avalanche.
# It uses only 32x32->64 multiplies, which gcc vectorises with plain SSE2 (pmuludq): ~3x the speed
# of XXH64 here, so the checksum does not dominate decoding a 150 KB image (memcpy does). Not
# byte-compatible with XXH3 (own key, own finish); it only has to be stable and catch damage.
#
# As in XXH3, the k-th stripe of each 1 KiB block is mixed with its own key, the 8 words of _KEY
# from word k on (k = 0..15), and the scramble uses words 16..23. Values of format 1 (magic
# b"TLC\x01") used _KEY[0:8] for every stripe and for the scramble: within a block the lanes were a
# plain sum, so swapped 64-byte stripes (two 512-byte sectors written in each other's place, two
# blocks of a tensor exchanged) checksummed alike and decoded as if undamaged. They are still read.
# ---------------------------------------------------------------------------------------------------
cdef uint64_t[24] _KEY = [0xbe4ba423396cfeb8ULL, 0x1cad21f72c81017cULL, 0xdb979083e96dd4deULL,
                          0x1f67b3b7a4a44072ULL, 0x78e5c0cc4ee679cbULL, 0x2172ffcc7dd05a82ULL,
                          0x8e2443f7744608b8ULL, 0x4c263a81e69035e0ULL,
                          0x2ef49c87b881f88fULL, 0x6a4ae6d5f29c53caULL, 0xd28d9fdd00f387bcULL,
                          0x612104963b1dc246ULL, 0x3d780b712e639be5ULL, 0xf88fbd91b91036ffULL,
                          0x2be874635288877bULL, 0x4927c0ff37cae95cULL, 0x5e91642df527ccadULL,
                          0xf709afae04b98a6eULL, 0x28cc4e20f52deaebULL, 0xf83115f6282edefcULL,
                          0xd09953c199fa1a86ULL, 0x4f8284d6c40ed028ULL, 0xc90c77041af335d9ULL,
                          0xbf93b60d1ecf151dULL]

cdef inline uint64_t _avalanche(uint64_t h) noexcept nogil:
    h = h ^ (h >> 33)
    h = h * P2
    h = h ^ (h >> 29)
    h = h * P3
    return h ^ (h >> 32)

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    /* 64-byte stripes into 8 u64 lanes (XXH3's accumulate_512). With SSE2 every x86-64 CPU has, the
       32x32->64 multiply is one pmuludq per two lanes; other CPUs run the identical scalar form. */
    static inline void tl_accumulate(uint64_t* acc, const uint8_t* p, uint8_t* dst, const uint64_t* key) {
    #if defined(__SSE2__)
        __m128i* a = (__m128i*)acc;
        /* Values come from LMDB's memory map, usually not in cache: ask for the data 512 bytes ahead
           so the loads overlap (150 KB images from the map, CPU time per decode: no prefetch 17.9 us,
           1 KiB ahead 18.0, 2 KiB 16.3, 512 B 16.2; raw py-lmdb get 9.4). */
        __builtin_prefetch(p + 512);
        __builtin_prefetch(p + 512 + 64);
        for (int i = 0; i < 4; i++) {
            __m128i d = _mm_loadu_si128((const __m128i*)(p + 16 * i));
            if (dst) _mm_storeu_si128((__m128i*)(dst + 16 * i), d);
            __m128i k = _mm_loadu_si128((const __m128i*)(key + 2 * i));
            __m128i dk = _mm_xor_si128(d, k);
            __m128i dk_hi = _mm_shuffle_epi32(dk, _MM_SHUFFLE(0, 3, 0, 1));
            __m128i prod = _mm_mul_epu32(dk, dk_hi);
            __m128i swap = _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
            a[i] = _mm_add_epi64(a[i], _mm_add_epi64(prod, swap));
        }
    #else
        uint64_t d[8];
        memcpy(d, p, 64);
        if (dst) memcpy(dst, d, 64);
        for (int i = 0; i < 8; i++) {
            uint64_t k = d[i] ^ key[i];
            acc[i ^ 1] += d[i];
            acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
        }
    #endif
    }
    static inline void tl_scramble(uint64_t* acc, const uint64_t* key) {
        for (int i = 0; i < 8; i++) acc[i] = (acc[i] ^ (acc[i] >> 47) ^ key[i]) * 0x9E3779B1ULL;
    }
    /* n stripes of 64 bytes; a scramble after every 16th stripe (counted from the value start). The
       k-th stripe of a block (k = 0..15) is mixed with key + step * k; the scramble uses skey. */
    static void tl_stripes_generic(uint64_t* acc, const uint8_t* p, uint8_t* dst, const uint64_t* key,
                                   size_t step, const uint64_t* skey, size_t n) {
        for (size_t s = 1; s <= n; s++) {
            tl_accumulate(acc, p, dst, key + step * ((s - 1) & 15));
            p += 64;
            if (dst) dst += 64;
            if ((s & 15) == 0) tl_scramble(acc, skey);
        }
    }
    #if defined(__x86_64__) && defined(__GNUC__)
    #include <immintrin.h>
    /* The same arithmetic on 256-bit registers (2 x 4 lanes instead of 4 x 2): identical results to the
       SSE2/scalar form, twice the multiply throughput. Compiled for AVX2 only in this function and
       chosen at run time, so the extension still runs on any x86-64 CPU. */
    __attribute__((target("avx2"), always_inline))
    static inline void tl_avx2_stripe(__m256i* a0, __m256i* a1, const uint8_t* p, uint8_t* dst,
                                      const uint64_t* k) {
        const __m256i k0 = _mm256_loadu_si256((const __m256i*)k);
        const __m256i k1 = _mm256_loadu_si256((const __m256i*)(k + 4));
        __builtin_prefetch(p + 512);
        __builtin_prefetch(p + 512 + 64);
        __m256i d0 = _mm256_loadu_si256((const __m256i*)p);
        __m256i d1 = _mm256_loadu_si256((const __m256i*)(p + 32));
        if (dst) {
            _mm256_storeu_si256((__m256i*)dst, d0);
            _mm256_storeu_si256((__m256i*)(dst + 32), d1);
        }
        __m256i dk0 = _mm256_xor_si256(d0, k0), dk1 = _mm256_xor_si256(d1, k1);
        __m256i p0 = _mm256_mul_epu32(dk0, _mm256_shuffle_epi32(dk0, _MM_SHUFFLE(0, 3, 0, 1)));
        __m256i p1 = _mm256_mul_epu32(dk1, _mm256_shuffle_epi32(dk1, _MM_SHUFFLE(0, 3, 0, 1)));
        *a0 = _mm256_add_epi64(*a0, _mm256_add_epi64(p0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
        *a1 = _mm256_add_epi64(*a1, _mm256_add_epi64(p1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
    }
    /* Whole 1 KiB blocks (16 stripes, each with key + step * its place, then a scramble), then the
       remaining stripes. Inlined with a constant step, so the keys are fixed offsets. */
    __attribute__((target("avx2"), always_inline))
    static inline void tl_avx2_run(uint64_t* acc, const uint8_t* p, uint8_t* dst, const uint64_t* key,
                                   const size_t step, const uint64_t* skey, size_t n) {
        __m256i a0 = _mm256_loadu_si256((const __m256i*)acc);
        __m256i a1 = _mm256_loadu_si256((const __m256i*)(acc + 4));
        const __m256i s0 = _mm256_loadu_si256((const __m256i*)skey);
        const __m256i s1 = _mm256_loadu_si256((const __m256i*)(skey + 4));
        const __m256i prime = _mm256_set1_epi32((int)0x9E3779B1U);
        for (; n >= 16; n -= 16) {
            #pragma GCC unroll 4
            for (size_t j = 0; j < 16; j++)
                tl_avx2_stripe(&a0, &a1, p + 64 * j, dst ? dst + 64 * j : NULL, key + step * j);
            p += 1024;
            if (dst) dst += 1024;
            __m256i x0 = _mm256_xor_si256(_mm256_xor_si256(a0, _mm256_srli_epi64(a0, 47)), s0);
            __m256i x1 = _mm256_xor_si256(_mm256_xor_si256(a1, _mm256_srli_epi64(a1, 47)), s1);
            a0 = _mm256_add_epi64(_mm256_mul_epu32(x0, prime),
                                  _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x0, 32), prime), 32));
            a1 = _mm256_add_epi64(_mm256_mul_epu32(x1, prime),
                                  _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x1, 32), prime), 32));
        }
        for (size_t j = 0; j < n; j++)
            tl_avx2_stripe(&a0, &a1, p + 64 * j, dst ? dst + 64 * j : NULL, key + step * j);
        _mm256_storeu_si256((__m256i*)acc, a0);
        _mm256_storeu_si256((__m256i*)(acc + 4), a1);
    }
    __attribute__((target("avx2")))
    static void tl_stripes_avx2(uint64_t* acc, const uint8_t* p, uint8_t* dst, const uint64_t* key,
                                size_t step, const uint64_t* skey, size_t n) {
        /* four copies, each with its constants folded: the format's key step, and whether to copy */
        if (step && dst) tl_avx2_run(acc, p, dst, key, 1, skey, n);
        else if (step) tl_avx2_run(acc, p, NULL, key, 1, skey, n);
        else if (dst) tl_avx2_run(acc, p, dst, key, 0, skey, n);
        else tl_avx2_run(acc, p, NULL, key, 0, skey, n);
    }
    #endif
    typedef void (*tl_stripes_fn)(uint64_t*, const uint8_t*, uint8_t*, const uint64_t*, size_t,
                                  const uint64_t*, size_t);
    static tl_stripes_fn tl_stripes_impl = tl_stripes_generic;
    static const char* tl_stripes_name = "sse2";
    /* Called once at import (GIL held). TRAINLOOM_CODEC_NO_AVX2 forces the portable path (tests). */
    static void tl_select_stripes(int allow_avx2) {
        tl_stripes_impl = tl_stripes_generic;
        tl_stripes_name = "sse2";
    #if defined(__x86_64__) && defined(__GNUC__)
        __builtin_cpu_init();
        if (allow_avx2 && __builtin_cpu_supports("avx2")) {
            tl_stripes_impl = tl_stripes_avx2;
            tl_stripes_name = "avx2";
        }
    #endif
    }
    static inline void tl_stripes(uint64_t* acc, const uint8_t* p, uint8_t* dst, const uint64_t* key,
                                  size_t step, const uint64_t* skey, size_t n) {
        tl_stripes_impl(acc, p, dst, key, step, skey, n);
    }
    """
    void tl_accumulate(uint64_t* acc, const uint8_t* p, uint8_t* dst, const uint64_t* key) noexcept nogil
    void tl_scramble(uint64_t* acc, const uint64_t* key) noexcept nogil
    void tl_stripes(uint64_t* acc, const uint8_t* p, uint8_t* dst, const uint64_t* key, size_t step,
                    const uint64_t* skey, size_t n) noexcept nogil
    void tl_select_stripes(int allow_avx2) noexcept
    const char* tl_stripes_name


import os as _os
tl_select_stripes(0 if _os.environ.get("TRAINLOOM_CODEC_NO_AVX2") else 1)


def checksum_kernel():
    """Which stripe kernel the checksum uses here: "avx2" or "sse2" (same results either way)."""
    return tl_stripes_name.decode()


def _select_kernel(bint allow_avx2):
    """Testing hook: switch the stripe kernel (call only while no other thread decodes)."""
    tl_select_stripes(1 if allow_avx2 else 0)
    return checksum_kernel()


cdef uint64_t _checksum(const uint8_t* p, size_t n, uint64_t seed, uint8_t* dst, int version) noexcept nogil:
    """Checksum of p[0:n] in format ``version`` (2, or 1 for values with magic b"TLC\x01"); when dst is
    not NULL also copies p to dst in the same pass (the source is read from memory once for both:
    decoding is bound by memory bandwidth)."""
    cdef uint64_t acc[8]
    cdef uint64_t h
    cdef size_t i, stripe = 0
    cdef const uint8_t* end = p + n
    if n < 256:
        # Short values (small samples, metadata): XXH64 has less set-up than 8 lanes.
        return _xxh64(p, n, seed, dst)
    for i in range(8):
        acc[i] = _KEY[i] ^ (seed * P1 + i)
    # Every 16 stripes (1 KiB) the lanes are scrambled, so they cannot cancel over long inputs.
    stripe = n // 64
    if version == 1:
        tl_stripes(acc, p, dst, _KEY, 0, _KEY, stripe)
    else:
        tl_stripes(acc, p, dst, _KEY, 1, _KEY + 16, stripe)
    p += stripe * 64
    if dst != NULL:
        dst += stripe * 64
    h = <uint64_t>n * P1
    for i in range(8):
        h = _merge(h, acc[i])
    # The tail (< 64 bytes) goes through XXH64 seeded with the lanes' state.
    return _avalanche(_xxh64(p, <size_t>(end - p), h, dst) ^ h)


def checksum(data, uint64_t seed=0, int version=2):
    """The codec's value checksum of a bytes-like object (for tests and tools); ``version=1``: the
    checksum of values with magic b"TLC\x01"."""
    cdef Py_buffer view
    cdef uint64_t h
    if version != 1 and version != 2:
        raise ValueError(f"checksum: version must be 1 or 2, got {version}")
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        h = _checksum(<const uint8_t*>view.buf, <size_t>view.len, seed, NULL, version)
    finally:
        PyBuffer_Release(&view)
    return h


def hash64(data, uint64_t seed=0):
    """XXH64 of a bytes-like object (or the UTF-8 of a str): a stable 64-bit hash, identical in every
    process and every run (unlike Python's salted ``hash``)."""
    cdef Py_buffer view
    cdef uint64_t h
    if isinstance(data, str):
        data = (<str>data).encode("utf-8")
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len >= NOGIL_MIN:
            with nogil:
                h = _xxh64(<const uint8_t*>view.buf, <size_t>view.len, seed, NULL)
        else:
            h = _xxh64(<const uint8_t*>view.buf, <size_t>view.len, seed, NULL)
    finally:
        PyBuffer_Release(&view)
    return h


# ---------------------------------------------------------------------------------------------------
# Encoder
# ---------------------------------------------------------------------------------------------------
cdef struct ArrayRef:
    const uint8_t* ptr      # borrowed: the owner object is kept alive in _Encoder.keep
    uint64_t nbytes
    uint64_t offset         # in the data section


cdef class _Encoder:
    cdef uint8_t* meta
    cdef size_t meta_len, meta_cap
    cdef ArrayRef* arrays
    cdef size_t n_arrays, arrays_cap
    cdef uint64_t data_len
    cdef list keep          # owners of every ArrayRef.ptr (contiguous copies included)
    cdef bint per_leaf      # pickle each value the tree cannot express on its own (see _leaf)
    cdef list _refs         # during _pickle: (kind, code, shape, offset) per persistent id or buffer
    cdef Py_ssize_t _n_ids  # during _pickle: persistent ids given so far (the K_RAW refs have none)
    cdef list _keep         # during _pickle: objects made by _reduce_tensor (pickle's memo keys by id)
    # {id(x): (x, x's contiguous CPU copy)}, shared by the passes of one encode(): the pass that pickles
    # the whole sample reuses what the first pass copied (a permuted image is copied once, not twice).
    cdef dict copies

    def __cinit__(self):
        self.per_leaf = False
        self.meta = NULL
        self.arrays = NULL
        self.meta_len = self.meta_cap = 0
        self.n_arrays = self.arrays_cap = 0
        self.data_len = 0
        self.keep = []

    def __dealloc__(self):
        # Plain C buffers only; the owners in self.keep are released by the normal refcounting.
        PyMem_Free(self.meta)
        PyMem_Free(self.arrays)

    cdef int _reserve(self, size_t extra) except -1:
        cdef size_t cap
        cdef uint8_t* m
        if self.meta_len + extra <= self.meta_cap:
            return 0
        cap = max(self.meta_cap * 2, self.meta_len + extra, <size_t>256)
        m = <uint8_t*>PyMem_Realloc(self.meta, cap)
        if m == NULL:
            raise MemoryError()
        self.meta = m
        self.meta_cap = cap
        return 0

    cdef inline int _put(self, const void* src, size_t n) except -1:
        self._reserve(n)
        memcpy(self.meta + self.meta_len, src, n)
        self.meta_len += n
        return 0

    cdef inline int _u8(self, uint8_t v) except -1:
        return self._put(&v, 1)

    cdef inline int _u32(self, uint32_t v) except -1:
        return self._put(&v, 4)

    cdef inline int _u64(self, uint64_t v) except -1:
        return self._put(&v, 8)

    cdef uint64_t _add_array(self, const uint8_t* ptr, uint64_t nbytes, object owner) except? 0xFFFFFFFFFFFFFFFF:
        cdef ArrayRef* a
        cdef size_t cap
        cdef uint64_t off
        if self.n_arrays == self.arrays_cap:
            cap = max(self.arrays_cap * 2, <size_t>8)
            a = <ArrayRef*>PyMem_Realloc(self.arrays, cap * sizeof(ArrayRef))
            if a == NULL:
                raise MemoryError()
            self.arrays = a
            self.arrays_cap = cap
        off = (self.data_len + ALIGN - 1) // ALIGN * ALIGN
        self.arrays[self.n_arrays].ptr = ptr
        self.arrays[self.n_arrays].nbytes = nbytes
        self.arrays[self.n_arrays].offset = off
        self.n_arrays += 1
        self.data_len = off + nbytes
        self.keep.append(owner)
        return off

    cdef object _copied(self, object x):
        """The contiguous copy of ``x`` a pass of this encode() made, or None."""
        if self.copies is None:
            return None
        hit = self.copies.get(id(x))
        # The entry holds x itself, so its id cannot have been reused by another object meanwhile.
        if hit is not None and (<tuple>hit)[0] is x:
            return (<tuple>hit)[1]
        return None

    cdef object _remember(self, object x, object copy):
        if self.copies is None:
            self.copies = {}
        self.copies[id(x)] = (x, copy)
        return copy

    cdef object _tensor_data(self, object obj, int code):
        """_stored_tensor(obj, code), computed once per encode()."""
        t = self._copied(obj)
        if t is None:
            t = _stored_tensor(obj, code)
            if t is not obj:
                self._remember(obj, t)
        return t

    cdef object _array_data(self, object a):
        """``a`` C-contiguous, copied at most once per encode()."""
        if a.flags.c_contiguous:
            return a
        c = self._copied(a)
        return c if c is not None else self._remember(a, np.ascontiguousarray(a))

    cdef int _shape(self, tuple shape) except -1:
        cdef Py_ssize_t d
        if len(shape) > _max_ndim:
            # Tensors of more dimensions never get here (_tensor, _persist); the decoder refuses them.
            raise CodecError(f"arrays with {len(shape)} dimensions are not supported (max {_max_ndim})")
        self._u8(<uint8_t>len(shape))
        for d in shape:
            self._u64(<uint64_t>d)
        return 0

    cdef int _tensor(self, object obj) except -1:
        """A T_TENSOR node: tag, dtype code, ndim, shape, data offset (nbytes follow from them)."""
        cdef uint64_t nbytes, off
        cdef int code = _TORCH_CODE[obj.dtype]   # the caller checked the dtype is in the table
        if obj.dim() > _max_ndim:
            # More dimensions than the decoder's numpy arrays can have: pickled (detach() makes a
            # Parameter a plain tensor, as below), which stores the flat data raw plus the shape.
            return self._pickle(obj.detach())
        try:
            t = self._tensor_data(obj, code)
            shape = tuple(t.shape)
        except RuntimeError:
            # A nested tensor reports the strided layout but has no single shape: torch's own
            # pickling handles it (its buffers still go raw through persistent_id).
            if obj.is_nested:
                return self._pickle(obj)
            raise
        nbytes = <uint64_t>t.numel() * <uint64_t>_TORCH_ITEMSIZE[code]
        self._u8(T_TENSOR)
        self._u8(<uint8_t>code)
        self._shape(shape)
        off = self._add_array(<const uint8_t*><size_t>t.data_ptr(), nbytes, t) if nbytes else 0
        self._u64(off)
        return 0

    cdef int _ndarray(self, object a, int code) except -1:
        cdef Py_buffer view
        cdef uint64_t off = 0, nbytes
        a = self._array_data(a)
        nbytes = <uint64_t>a.nbytes
        self._u8(<uint8_t>code)
        self._shape(a.shape)
        if nbytes:
            PyObject_GetBuffer(a, &view, PyBUF_SIMPLE)
            # numpy keeps the memory while `a` lives (kept in self.keep) and refuses to resize an
            # array that is referenced, so the pointer stays valid after the view is released.
            off = self._add_array(<const uint8_t*>view.buf, nbytes, a)
            PyBuffer_Release(&view)
        self._u64(off)
        return 0

    cdef inline int _leaf(self, object obj, int depth) except -1:
        """A value the tree cannot express. In the first pass, below the top level: NEEDS_PICKLE, and
        encode() pickles the whole sample instead (one pickler for 2,000 small objects rather than
        2,000 picklers, and shared references stay shared). In the per-leaf pass (and at the top level,
        where the value is the whole sample anyway): pickled on its own."""
        if depth == 0 or self.per_leaf:
            return self._pickle(obj)
        return NEEDS_PICKLE

    cdef int encode(self, object obj, int depth) except -1:
        """Append ``obj``'s node; 0, or NEEDS_PICKLE (first pass only: nothing usable was written)."""
        cdef Py_ssize_t n
        cdef const char* s
        cdef int64_t iv
        cdef double fv
        cdef object t = type(obj)
        if depth > MAX_DEPTH:
            raise CodecError(f"sample nested deeper than {MAX_DEPTH} levels (a self-referencing container?)")
        if obj is None:
            return self._u8(T_NONE)
        if t is bool:
            return self._u8(T_TRUE if obj else T_FALSE)
        if t is int:
            if -0x8000000000000000 <= obj <= 0x7FFFFFFFFFFFFFFF:
                iv = obj
                self._u8(T_INT)
                return self._put(&iv, 8)
            return self._leaf(obj, depth)
        if t is float:
            fv = obj
            self._u8(T_FLOAT)
            return self._put(&fv, 8)
        if t is str:
            s = _utf8_and_size(obj, &n)
            if s == NULL:
                if not PyErr_ExceptionMatches(UnicodeEncodeError):
                    return -1
                PyErr_Clear()
                return self._leaf(obj, depth)   # a lone surrogate (os.listdir of undecodable names)
            self._u8(T_STR)
            self._u64(<uint64_t>n)
            return self._put(s, <size_t>n)
        if t is bytes:
            n = len(<bytes>obj)
            self._u8(T_BYTES)
            self._u64(<uint64_t>n)
            return self._put(PyBytes_AS_STRING(obj), <size_t>n)
        if t is tuple or t is list:
            n = len(obj)
            self._u8(T_TUPLE if t is tuple else T_LIST)
            self._u64(<uint64_t>n)
            for item in obj:
                if self.encode(item, depth + 1):
                    return NEEDS_PICKLE
            return 0
        if t is dict:
            self._u8(T_DICT)
            self._u64(<uint64_t>len(obj))
            for k, v in (<dict>obj).items():
                if self.encode(k, depth + 1) or self.encode(v, depth + 1):
                    return NEEDS_PICKLE
            return 0
        if isinstance(obj, _Tensor):
            if obj.layout is _strided and type(obj) in (_Tensor, torch.nn.Parameter) and obj.dtype in _TORCH_CODE:
                return self._tensor(obj)
            return self._leaf(obj, depth)
        if isinstance(obj, _ndarray):
            code = _NP_CODE.get(obj.dtype)
            if code is not None and t is _ndarray:
                self._u8(T_NDARRAY)
                return self._ndarray(obj, code)
            return self._leaf(obj, depth)
        if isinstance(obj, _npgeneric):
            code = _NP_CODE.get(obj.dtype)
            if code is not None:
                raw = obj.tobytes()
                self._u8(T_NPSCALAR)
                self._u8(<uint8_t>code)
                return self._put(PyBytes_AS_STRING(raw), <size_t>len(raw))
            return self._leaf(obj, depth)
        return self._leaf(obj, depth)

    cdef int _pickle(self, object obj) except -1:
        """Pickle protocol 5; every tensor/array inside goes raw into the data section."""
        cdef list refs = []   # (kind, code, shape, offset) per persistent id
        out = io.BytesIO()
        self._refs = refs
        self._n_ids = 0
        self._keep = []
        p = _Pickler(out, self)
        try:
            p.dump(obj)
        except (CodecError, MemoryError):
            raise
        except Exception as exc:
            # Whatever an object's own pickling raises (pickle.PicklingError, TypeError, torch's
            # RuntimeError/NotImplementedError/KeyError for a tensor kind it refuses, an OSError or
            # IndexError from a __getstate__ reading a truncated file) is this value's failure:
            # named, and chained to the original, never a bare exception from deep inside pickle.
            raise CodecError(
                f"cannot serialize a value of type {type(obj).__name__}: {type(exc).__name__}: {exc}"
            ) from exc
        raw = out.getvalue()    # BytesIO hands over its own buffer: no copy
        self._u8(T_PICKLE)
        self._u32(<uint32_t>len(refs))
        for kind, code, shape, off in refs:
            self._u8(<uint8_t>kind)
            self._u8(<uint8_t>code)
            self._shape(shape)
            self._u64(<uint64_t>off)
        n = len(<bytes>raw)
        self._u64(<uint64_t>n)
        return self._put(PyBytes_AS_STRING(raw), <size_t>n)

    # The pickler's two hooks, as bound methods of this cdef class: pickle calls persistent_id for every
    # object it meets (ints and strs included: ~9 calls per small dataclass), and a method of the
    # Python _Pickler class costs about 3x as much per call.
    def _persistent_id(self, obj):
        cdef object t = type(obj)
        cdef uint64_t pid
        if t is not _Tensor and t is not _ndarray:
            return None
        pid = self._persist(obj, self._refs)
        return pid - 1 if pid else None

    def _reducer_override(self, obj):
        return _reduce_tensor(obj, self._keep)

    def _buffer_callback(self, pb):
        # Out-of-band buffers (protocol 5) also go raw into the data section.
        raw = pb.raw()
        off = self._raw(raw)
        self._refs.append((K_RAW, 0, (len(raw),), off))
        return False

    cdef uint64_t _raw(self, object obj) except? 0xFFFFFFFFFFFFFFFF:
        cdef Py_buffer view
        cdef uint64_t off = 0
        PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE)
        try:
            if view.len:
                off = self._add_array(<const uint8_t*>view.buf, <uint64_t>view.len, obj)
        finally:
            PyBuffer_Release(&view)
        return off

    cdef uint64_t _persist(self, object obj, list refs) except? 0xFFFFFFFFFFFFFFFF:
        """Store a tensor/ndarray found inside a pickled object; returns its persistent id + 1, or 0 to
        let pickle handle the object itself. Ids count the tensor/array refs only: the decoder hands the
        buffers (K_RAW refs) to the unpickler in a list of their own. (They used to count the buffers
        too, so an array pickled after an out-of-band buffer, e.g. after a big-endian array, did not
        decode: "bad persistent id".)"""
        cdef uint64_t nbytes
        cdef Py_buffer view
        if type(obj) is _Tensor and obj.layout is _strided:
            code = _TORCH_CODE.get(obj.dtype)
            if code is None or obj.is_nested or obj.dim() > _max_ndim:
                return 0   # torch's own pickling; more dimensions: _reduce_tensor stores it flat
            t = self._tensor_data(obj, code)
            nbytes = <uint64_t>t.numel() * <uint64_t>_TORCH_ITEMSIZE[code]
            off = self._add_array(<const uint8_t*><size_t>t.data_ptr(), nbytes, t) if nbytes else 0
            refs.append((K_TENSOR, code, tuple(t.shape), off))
            self._n_ids += 1
            return self._n_ids
        if type(obj) is _ndarray:
            code = _NP_CODE.get(obj.dtype)
            if code is None:
                return 0
            a = self._array_data(obj)
            off = 0
            if a.nbytes:
                PyObject_GetBuffer(a, &view, PyBUF_SIMPLE)
                off = self._add_array(<const uint8_t*>view.buf, <uint64_t>a.nbytes, a)
                PyBuffer_Release(&view)
            refs.append((K_NDARRAY, code, a.shape, off))
            self._n_ids += 1
            return self._n_ids
        return 0

    cdef bytes finish(self):
        cdef uint64_t data_start = (HEADER + self.meta_len + ALIGN - 1) // ALIGN * ALIGN
        cdef uint64_t total = data_start + self.data_len
        cdef uint32_t meta_len32
        cdef bytes out
        cdef uint8_t* o
        cdef size_t i
        cdef uint64_t h
        if self.meta_len > 0xFFFFFFFF:
            raise CodecError(f"sample structure too large ({self.meta_len} bytes of metadata; max 4 GiB)")
        meta_len32 = <uint32_t>self.meta_len
        out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>total)
        o = <uint8_t*>PyBytes_AS_STRING(out)
        memcpy(o, <const char*>MAGIC, 4)
        memcpy(o + 4, &meta_len32, 4)
        memcpy(o + 8, &self.data_len, 8)
        memset(o + 24, 0, 8)
        memcpy(o + HEADER, self.meta, self.meta_len)
        memset(o + HEADER + self.meta_len, 0, <size_t>(data_start - HEADER - self.meta_len))
        if self.data_len >= NOGIL_MIN:
            # The owners in self.keep pin every source pointer; nothing here touches Python objects.
            with nogil:
                self._fill(o, data_start)
                h = _checksum(o + HEADER, <size_t>(data_start - HEADER), self.data_len, NULL, 2)
                h = _checksum(o + data_start, <size_t>self.data_len, h, NULL, 2)
        else:
            self._fill(o, data_start)
            h = _checksum(o + HEADER, <size_t>(data_start - HEADER), self.data_len, NULL, 2)
            h = _checksum(o + data_start, <size_t>self.data_len, h, NULL, 2)
        memcpy(o + 16, &h, 8)
        return out

    cdef void _fill(self, uint8_t* o, uint64_t data_start) noexcept nogil:
        cdef size_t i
        cdef uint64_t pos = 0
        cdef uint8_t* d = o + data_start
        for i in range(self.n_arrays):
            if self.arrays[i].offset > pos:      # alignment gap: zero it, output is deterministic
                memset(d + pos, 0, <size_t>(self.arrays[i].offset - pos))
            memcpy(d + self.arrays[i].offset, self.arrays[i].ptr, <size_t>self.arrays[i].nbytes)
            pos = self.arrays[i].offset + self.arrays[i].nbytes


_META_TENSOR = "a tensor on the meta device holds no data and cannot be stored"


cdef object _stored_tensor(object t, int code):
    """``t`` as the encoder stores its elements: detached, on the CPU, conj/neg resolved, contiguous
    (copying only the elements a view covers; a raw-view dtype through the integer of its width,
    which torch can copy, e.g. uint1). CodecError for a meta tensor."""
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        if t.device.type == "meta":
            raise CodecError(_META_TENSOR)
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        if code >= FIRST_RAW_VIEW:
            t = t.view(_TORCH_STORE_AS[code])
        t = t.contiguous()
    return t


cdef object _flat_stored(object t, int code):
    """``t``'s elements as a detached, contiguous, 1-dimensional CPU tensor of ``t``'s dtype."""
    s = _stored_tensor(t, code)
    if s.dtype != t.dtype:      # a raw-view dtype made contiguous through the integer of its width
        s = s.view(t.dtype)
    return s.view(-1)


cdef object _class_by_name(object cls):
    """What pickle would find under ``cls``'s module and qualified name (None if nothing)."""
    obj = sys.modules.get(getattr(cls, "__module__", None) or "")
    for part in str(getattr(cls, "__qualname__", "<locals>")).split("."):
        if obj is None or part == "<locals>":
            return None
        obj = getattr(obj, part, None)
    return obj


cdef object _obj_state(object obj):
    """The Python state torch's own pickling saves for a tensor subclass (``_get_obj_state``):
    ``__getstate__()``, by default the ``__dict__``, or ``(__dict__, slots)``."""
    getstate = getattr(obj, "__getstate__", None)
    if getstate is not None:
        return getstate()
    slots = copyreg._slotnames(type(obj))     # Python < 3.11: object has no __getstate__
    if slots:
        return (obj.__dict__, {n: getattr(obj, n) for n in slots if hasattr(obj, n)})
    return obj.__dict__


cdef bint _restorable(object cls, object state):
    """Whether _rebuild_subclass can give ``state`` back to a ``cls``: its own ``__setstate__`` takes
    anything, else it must be what the default ``__getstate__`` returns."""
    if getattr(cls, "__setstate__", _Tensor.__setstate__) is not _Tensor.__setstate__:
        return True
    if state is None or isinstance(state, dict):
        return True
    return (isinstance(state, tuple) and len(state) == 2
            and all(part is None or isinstance(part, dict) for part in state))


def _rebuild_reshaped(flat, shape):
    """Decode side of a tensor of more dimensions than numpy arrays have (referenced by name in stored
    values: keep its name and arguments)."""
    return flat.view(tuple(shape))


def _rebuild_subclass(cls, data, state, requires_grad):
    """Decode side of a tensor subclass: its plain ``data`` (decoded raw) as a ``cls``, with its
    attributes (referenced by name in stored values: keep its name and arguments). Sets the state as
    torch's ``_rebuild_from_type_v2`` does."""
    if not (isinstance(cls, type) and issubclass(cls, _Tensor)):
        raise TypeError(f"{cls!r} is not a tensor subclass")
    out = data.as_subclass(cls)
    if requires_grad:
        out.requires_grad_(True)
    if getattr(cls, "__setstate__", _Tensor.__setstate__) is not _Tensor.__setstate__:
        out.__setstate__(state)
    elif state:
        if isinstance(state, tuple):
            dict_state, slots_state = state
        else:
            dict_state, slots_state = state, None
        for k, v in (dict_state or {}).items():
            setattr(out, k, v)
        for k, v in (slots_state or {}).items():
            setattr(out, k, v)
    return out


cdef object _reduce_tensor(object obj, list keep):
    """The pickler's reducer_override for a tensor persistent_id did not take (NotImplemented: torch's
    own pickling). torch pickles a tensor subclass with its whole storage (a 10-element view of a
    4 MB tensor costs 4 MB, and decodes holding 4 MB), so a subclass whose type pickle can find and
    that keeps torch's pickling is reduced to its plain data (stored raw by persistent_id), its type
    and its attributes, rebuilt with as_subclass. requires_grad is dropped as for plain tensors, except
    for Parameter subclasses (the cache keeps a Parameter's). Other subclasses are pickled by torch from
    a compact copy of the elements they view, never their whole storage."""
    if not isinstance(obj, _Tensor):
        return NotImplemented
    cls = type(obj)
    if cls is _Parameter or obj.layout is not _strided or obj.is_nested:
        return NotImplemented     # Parameter's own reduce pickles its plain .data, which goes raw
    code = _TORCH_CODE.get(obj.dtype)
    if code is None:
        return NotImplemented
    if cls is _Tensor:
        if obj.dim() <= _max_ndim:
            return NotImplemented
        return (_rebuild_reshaped, (_flat_stored(obj, code), tuple(obj.shape)))
    if cls in copyreg.dispatch_table:
        return NotImplemented     # the user's copyreg.pickle(cls, reducer) decides, as in plain pickle
    if cls.__torch_dispatch__ is not _Tensor.__torch_dispatch__:
        # A wrapper subclass (DTensor, ...) has no storage of its own: its pickling stores its inner
        # plain tensors, which go raw.
        return NotImplemented
    reduce_ex = cls.__reduce_ex__
    if (reduce_ex is _Tensor.__reduce_ex__ or reduce_ex is _Parameter.__reduce_ex__) and _class_by_name(cls) is cls:
        state = _obj_state(obj)
        if not _restorable(cls, state):
            # Refused here, not when decoding: a value that never decodes is recomputed on every read.
            raise CodecError(
                f"cannot serialize a value of type {cls.__name__}: its __getstate__ returned a "
                f"{type(state).__name__}, which only a __setstate__ of its own could restore")
        return (_rebuild_subclass,
                (cls, obj.as_subclass(_Tensor), state, isinstance(obj, _Parameter) and obj.requires_grad))
    # Its own __reduce_ex__, or a type pickle cannot find by name (which then fails as for any object).
    compact = _flat_stored(obj.as_subclass(_Tensor), code)
    if compact.untyped_storage().nbytes() > compact.nbytes:    # a contiguous view of a larger tensor
        compact = compact.clone()
    compact = compact.view(tuple(obj.shape)).as_subclass(cls)
    attrs = getattr(obj, "__dict__", None)
    if attrs:
        compact.__dict__.update(attrs)
    for name in copyreg._slotnames(cls):
        if hasattr(obj, name):
            setattr(compact, name, getattr(obj, name))
    keep.append(compact)    # alive until the pickle is written: pickle's memo is keyed by id()
    return compact.__reduce_ex__(5)


class _Pickler(pickle.Pickler):
    """Protocol 5 with the encoder's hooks: its bound methods (see _Encoder._persistent_id), set before
    pickle.Pickler.__init__, which looks them up on the instance. Nothing here refers back to the
    pickler: one in a reference cycle (a buffer_callback of its own bound method) outlived its dump()
    with its memo until the garbage collector ran, and pickling 2,000 small objects took 20% longer."""

    def __init__(self, file, _Encoder enc):
        self.reducer_override = enc._reducer_override
        self.persistent_id = enc._persistent_id
        super().__init__(file, protocol=5, buffer_callback=enc._buffer_callback)


def encode(obj):
    """Encode a sample into one checksummed ``bytes`` value (see the module comment for the layout)."""
    cdef _Encoder enc = _Encoder()
    cdef dict copies
    if enc.encode(obj, 0) == 0:
        return enc.finish()
    copies = enc.copies
    # Below the top level the sample holds a value the tree cannot express (a dataclass, a big int, a
    # tensor subclass...). Pickling each such value on its own costs a pickler per value and no memo
    # across them (2,000 token objects: 9x pickle.dumps' time, 3x its size), so the whole sample is
    # pickled at once; its tensors and arrays still go raw through persistent_id.
    if _whole_decodes_alike(obj, 0):
        enc = _Encoder()
        enc.copies = copies
        try:
            enc._pickle(obj)
            return enc.finish()
        except Exception as exc:  # any error of the user's __reduce__: the per-leaf pass decides
            # The per-leaf pass below fails the way encoding always did (its CodecError names the
            # value's type, not "dict"), or succeeds where it always did (a RecursionError of pickling
            # the sample from its root).
            _logger.debug("encode: pickling the whole sample failed (%s: %s); encoding value by value",
                          type(exc).__name__, exc)
    return _per_leaf(obj, copies)


cdef bytes _per_leaf(object obj, dict copies):
    cdef _Encoder enc = _Encoder()
    enc.per_leaf = True
    enc.copies = copies
    enc.encode(obj, 0)
    return enc.finish()


def _encode_per_leaf(obj):
    """encode() as it was before whole-sample pickling: every value the tree cannot express pickled on
    its own (T_PICKLE nodes inside the tree). The fallback of encode(); tests and benchmarks call it
    to write values the way older versions did."""
    return _per_leaf(obj, None)


cdef bint _whole_decodes_alike(object obj, int depth) except -1:
    """Whether the whole sample, pickled, decodes as its per-leaf encoding does (shared references
    apart). Not when an nn.Parameter sits in its tuples/lists/dicts (the tree stores it as a plain
    tensor, pickle would keep the Parameter), nor when it nests deeper than the tree goes (the per-leaf
    pass raises CodecError, e.g. for a self-referencing list, which pickle would accept)."""
    cdef object t = type(obj)
    if depth > MAX_DEPTH:
        return False
    if t is tuple or t is list:
        for item in obj:
            if not _whole_decodes_alike(item, depth + 1):
                return False
        return True
    if t is dict:
        for k, v in (<dict>obj).items():
            if not _whole_decodes_alike(k, depth + 1) or not _whole_decodes_alike(v, depth + 1):
                return False
        return True
    return t is not _Parameter


# ---------------------------------------------------------------------------------------------------
# Decoder
# ---------------------------------------------------------------------------------------------------
cdef struct Cursor:
    const uint8_t* p
    const uint8_t* end


cdef inline int _need(Cursor* c, size_t n) except -1:
    if <size_t>(c.end - c.p) < n:
        raise CodecError("encoded value is truncated or malformed (metadata runs past its end)")
    return 0

cdef inline uint8_t _gu8(Cursor* c) except? 255:
    _need(c, 1)
    cdef uint8_t v = c.p[0]
    c.p += 1
    return v

cdef inline uint32_t _gu32(Cursor* c) except? 0xFFFFFFFF:
    _need(c, 4)
    cdef uint32_t v = _rd32(c.p)
    c.p += 4
    return v

cdef inline uint64_t _gu64(Cursor* c) except? 0xFFFFFFFFFFFFFFFF:
    _need(c, 8)
    cdef uint64_t v = _rd64(c.p)
    c.p += 8
    return v


# ---------------------------------------------------------------------------------------------------
# Destination blocks for large decoded values, recycled through a small pool.
#
# A 150 KB bytearray per decoded image goes to glibc's mmap path: every allocation is a fresh mapping
# (37 page faults, kernel zeroing) and every free an munmap. With a DataLoader batch of 32 images alive
# at once, that cost was ~3x the copy itself (bench: 95 us vs 30 us per image). Blocks freed by the
# last tensor viewing them go back to this pool instead and are reused for the next batch.
# ---------------------------------------------------------------------------------------------------
cdef enum:
    POOL_SLOTS = 128                 # enough for a few batches of 32 in flight
    BLOCK_GRAIN = 65536              # capacities are rounded up to 64 KiB so blocks are interchangeable
cdef size_t POOL_MAX_BYTES = 64 << 20    # bound of idle memory kept per process
cdef void* _pool_ptr[POOL_SLOTS]
cdef size_t _pool_cap[POOL_SLOTS]
cdef int _pool_n = 0
cdef size_t _pool_bytes = 0


cdef void* _pool_take(size_t cap) noexcept:
    # Called with the GIL held (from decode), so the pool needs no lock.
    global _pool_n, _pool_bytes
    cdef int i
    cdef void* p
    for i in range(_pool_n - 1, -1, -1):
        if _pool_cap[i] == cap:
            p = _pool_ptr[i]
            _pool_n -= 1
            _pool_ptr[i] = _pool_ptr[_pool_n]
            _pool_cap[i] = _pool_cap[_pool_n]
            _pool_bytes -= cap
            return p
    return PyMem_RawMalloc(cap)


cdef void _pool_give(void* p, size_t cap) noexcept:
    # Called from _Block.__dealloc__, which runs with the GIL held.
    global _pool_n, _pool_bytes
    if _pool_n < POOL_SLOTS and _pool_bytes + cap <= POOL_MAX_BYTES:
        _pool_ptr[_pool_n] = p
        _pool_cap[_pool_n] = cap
        _pool_n += 1
        _pool_bytes += cap
    else:
        PyMem_RawFree(p)


cdef char* _FMT_B = b"B"   # a literal: lives as long as the module


def pool_stats():
    """(idle blocks, idle bytes) of the decode block pool of this process."""
    return _pool_n, _pool_bytes


cdef class _Block:
    """A writable buffer from the pool; tensors/arrays decoded from a large value view it."""
    cdef char* ptr
    cdef size_t cap
    cdef Py_ssize_t size
    cdef Py_ssize_t shape[1]

    def __cinit__(self):
        self.ptr = NULL
        self.cap = 0
        self.size = 0

    @staticmethod
    cdef _Block make_exact(size_t size):
        """A block of exactly `size` bytes, not pooled (small values: the pool's 64 KiB grain would
        waste memory). From Python's allocator, which serves small sizes faster than malloc: made here
        and freed in __dealloc__, both with the GIL held."""
        cdef _Block b = _Block.__new__(_Block)
        b.ptr = <char*>PyMem_Malloc(size if size else 1)
        if b.ptr == NULL:
            raise MemoryError()
        b.cap = 0
        b.size = <Py_ssize_t>size
        b.shape[0] = b.size
        return b

    @staticmethod
    cdef _Block make(size_t size):
        cdef _Block b = _Block.__new__(_Block)
        cdef size_t cap = (size + BLOCK_GRAIN - 1) // BLOCK_GRAIN * BLOCK_GRAIN
        b.ptr = <char*>_pool_take(cap)
        if b.ptr == NULL:
            raise MemoryError()
        b.cap = cap
        b.size = <Py_ssize_t>size
        b.shape[0] = b.size
        return b

    def __getbuffer__(self, Py_buffer* view, int flags):
        view.buf = self.ptr
        view.obj = self
        view.len = self.size
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = _FMT_B
        view.ndim = 1
        view.shape = NULL
        if flags & PyBUF_ND:
            view.shape = self.shape
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __len__(self):
        return self.size

    def __dealloc__(self):
        # The last exporter (tensor/array) is gone: hand the memory back to the pool (GIL held here).
        if self.ptr != NULL:
            if self.cap:
                _pool_give(self.ptr, self.cap)
            else:
                PyMem_Free(self.ptr)   # a make_exact block
            self.ptr = NULL


cdef int _dtype_unavailable(int code) except -1:
    # Out of line: the f-string's temporaries would otherwise cost every decoded tensor (~40 ns).
    raise CodecError(
        f"tensor dtype {_TORCH_NAMES[code]} (code {code}) is not available in torch {torch.__version__}")


cdef tuple _dims_tuple(int nd, const cnp.npy_intp* dims):
    """A shape read by _Decoder._shape as a tuple (only the paths that call numpy/torch by shape)."""
    cdef tuple out = PyTuple_New(nd)
    cdef int i
    for i in range(nd):
        d = PyLong_FromSsize_t(dims[i])
        Py_INCREF(d)
        PyTuple_SET_ITEM(out, i, d)
    return out


cdef class _Decoder:
    cdef object arena          # the _Block the arrays view (or the caller's writable buffer)
    cdef char* base            # arena's memory when it is our own _Block, else NULL
    cdef uint64_t arena_off    # where the data section starts inside arena
    cdef uint64_t data_len

    cdef int _shape(self, Cursor* c, cnp.npy_intp* dims, uint64_t* numel) except -1:
        """Read a shape into dims (room for 64); returns the number of dimensions."""
        cdef uint8_t nd = _gu8(c)
        cdef uint8_t i
        cdef uint64_t d
        numel[0] = 1
        if nd > _max_ndim:    # the encoder writes at most _max_ndim (<= 64, the size of dims)
            raise CodecError(f"encoded value is malformed (an array with {nd} dimensions, max {_max_ndim})")
        for i in range(nd):
            d = _gu64(c)
            # Checked here, not by numpy: arrays are made over our block with the C API.
            if d > <uint64_t>0x7FFFFFFFFFFFFFFF or (d and numel[0] > <uint64_t>0x7FFFFFFFFFFFFFFF // d):
                raise CodecError("encoded value is malformed (an array's shape overflows)")
            numel[0] *= d
            dims[i] = <cnp.npy_intp>d
        return nd

    cdef object _own_array(self, int nd, cnp.npy_intp* dims, int typenum, uint64_t off):
        """An ndarray over base + off (bounds checked by the caller) that keeps the arena alive."""
        arr = cnp.PyArray_SimpleNewFromData(nd, dims, typenum, self.base + off)
        Py_INCREF(self.arena)
        cnp.PyArray_SetBaseObject(<cnp.ndarray>arr, self.arena)   # steals the reference
        return arr

    cdef object _array(self, int kind, int code, int nd, cnp.npy_intp* dims, uint64_t numel, uint64_t off):
        cdef uint64_t itemsize, nbytes
        cdef int typenum
        if kind == K_TENSOR:
            if code >= _n_torch_codes:
                raise CodecError(f"unknown tensor dtype code {code}")
            dt = _TORCH_DTYPES[code]     # the list, not a C copy: None when this torch lacks the dtype
            if dt is None:
                _dtype_unavailable(code)
            itemsize = _torch_itemsize_c[code]
            typenum = _torch_typenum_c[code]
        else:
            if code >= _n_np_codes:
                raise CodecError(f"unknown array dtype code {code}")
            itemsize = _np_itemsize_c[code]
            typenum = _np_typenum_c[code]
        nbytes = numel * itemsize
        if numel == 0:
            shape = _dims_tuple(nd, dims)
            if kind == K_TENSOR:
                return _torch_empty(shape, dtype=dt)
            return _np_empty(shape, dtype=_NP_DTYPES[code])
        if numel > self.data_len or nbytes > self.data_len or off + nbytes > self.data_len or off + nbytes < off:
            raise CodecError("encoded value is malformed (an array runs past the data section)")
        if self.base != NULL:
            arr = self._own_array(nd, dims, typenum, off)
        else:
            np_dt = _TORCH_AS_NP[code] if kind == K_TENSOR else _NP_DTYPES[code]
            arr = _np_ndarray(_dims_tuple(nd, dims), np_dt, self.arena, self.arena_off + off)
        if kind == K_TENSOR:
            t = _from_numpy(arr)
            return t.view(dt) if _torch_needs_view_c[code] else t
        return arr

    cdef object _array_node(self, Cursor* c, int kind):
        """A T_NDARRAY/T_TENSOR node after its tag (out of decode(): the dims buffer stays off the
        stack of the recursion)."""
        cdef cnp.npy_intp dims[64]
        cdef uint64_t numel, off
        cdef uint8_t code = _gu8(c)
        cdef int nd = self._shape(c, dims, &numel)
        off = _gu64(c)
        return self._array(kind, code, nd, dims, numel, off)

    cdef object decode(self, Cursor* c, int depth):
        cdef uint8_t tag = _gu8(c)
        cdef uint64_t n, i
        cdef int64_t iv
        cdef double fv
        cdef uint8_t code
        if depth > MAX_DEPTH:
            raise CodecError("encoded value nests too deeply")
        if tag == T_NONE:
            return None
        if tag == T_FALSE:
            return False
        if tag == T_TRUE:
            return True
        if tag == T_INT:
            _need(c, 8)
            memcpy(&iv, c.p, 8)
            c.p += 8
            return iv
        if tag == T_FLOAT:
            _need(c, 8)
            memcpy(&fv, c.p, 8)
            c.p += 8
            return fv
        if tag == T_STR:
            n = _gu64(c)
            _need(c, n)
            s = PyUnicode_DecodeUTF8(<const char*>c.p, <Py_ssize_t>n, "strict")
            c.p += n
            return s
        if tag == T_BYTES:
            n = _gu64(c)
            _need(c, n)
            b = PyBytes_FromStringAndSize(<const char*>c.p, <Py_ssize_t>n)
            c.p += n
            return b
        if tag == T_TUPLE or tag == T_LIST:
            n = _gu64(c)
            if n > <uint64_t>(c.end - c.p):   # every item takes at least one byte
                raise CodecError("encoded value is malformed (container longer than its metadata)")
            # Filled in place (no list then tuple). Slots not filled yet are NULL, which the GC and
            # the dealloc of a tuple or list left half-filled by an exception both accept.
            if tag == T_TUPLE:
                seq = PyTuple_New(<Py_ssize_t>n)
                for i in range(n):
                    item = self.decode(c, depth + 1)
                    Py_INCREF(item)
                    PyTuple_SET_ITEM(seq, <Py_ssize_t>i, item)   # steals the reference
            else:
                seq = PyList_New(<Py_ssize_t>n)
                for i in range(n):
                    item = self.decode(c, depth + 1)
                    Py_INCREF(item)
                    PyList_SET_ITEM(seq, <Py_ssize_t>i, item)    # steals the reference
            return seq
        if tag == T_DICT:
            n = _gu64(c)
            if n > <uint64_t>(c.end - c.p):
                raise CodecError("encoded value is malformed (dict longer than its metadata)")
            d = {}
            for i in range(n):
                k = self.decode(c, depth + 1)
                d[k] = self.decode(c, depth + 1)
            return d
        if tag == T_TENSOR or tag == T_NDARRAY:
            return self._array_node(c, K_TENSOR if tag == T_TENSOR else K_NDARRAY)
        if tag == T_NPSCALAR:
            code = _gu8(c)
            if code >= len(_NP_DTYPES):
                raise CodecError(f"unknown array dtype code {code}")
            dt = _NP_DTYPES[code]
            n = (<object>dt).itemsize
            _need(c, n)
            v = _frombuffer_np(PyBytes_FromStringAndSize(<const char*>c.p, <Py_ssize_t>n), dt)[0]
            c.p += n
            return v
        if tag == T_PICKLE:
            return self._unpickle(c)
        raise CodecError(f"encoded value is malformed (unknown tag {tag})")

    cdef object _unpickle(self, Cursor* c):
        cdef uint32_t nrefs = _gu32(c)
        cdef uint32_t i
        cdef uint8_t kind, code
        cdef uint64_t numel, off, n
        cdef cnp.npy_intp dims[64]
        cdef int nd
        objs = []
        buffers = []
        for i in range(nrefs):
            kind = _gu8(c)
            code = _gu8(c)
            nd = self._shape(c, dims, &numel)
            off = _gu64(c)
            if kind == K_RAW:
                if numel > self.data_len or off > self.data_len - numel:   # no uint64 wrap-around
                    raise CodecError("encoded value is malformed (a buffer runs past the data section)")
                buffers.append(memoryview(self.arena)[self.arena_off + off:self.arena_off + off + numel])
            elif kind == K_TENSOR or kind == K_NDARRAY:
                objs.append(self._array(kind, code, nd, dims, numel, off))
            else:
                raise CodecError(f"encoded value is malformed (unknown reference kind {kind})")
        n = _gu64(c)
        _need(c, n)
        payload = PyBytes_FromStringAndSize(<const char*>c.p, <Py_ssize_t>n)
        c.p += n
        up = _Unpickler(io.BytesIO(payload), objs, buffers)
        try:
            return up.load()
        except (MemoryError, RecursionError):
            raise
        except Exception as exc:
            # Unpickling runs the classes' own code: a renamed module or class, a torch that cannot load
            # what it pickled... The value is unusable as stored; the cache recomputes it.
            raise CodecError(
                f"cannot unpickle an object in the encoded value ({type(exc).__name__}: {exc}); "
                "was it written by another version of its code?"
            ) from exc


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, objs, buffers):
        super().__init__(file, buffers=buffers)
        self._objs = objs

    def persistent_load(self, pid):
        if type(pid) is not int or not 0 <= pid < len(self._objs):
            raise pickle.UnpicklingError(f"bad persistent id {pid!r}")
        return self._objs[pid]


def decode(buf, bint copy=True):
    """Decode a value produced by :func:`encode`.

    Verifies the checksum first; raises :class:`ChecksumError` for damaged values and
    :class:`CodecError` for anything that is not an encoded value. With ``copy=True`` (the default)
    the array bytes are copied once into a fresh buffer the returned tensors/arrays view, so ``buf``
    may be released right after (LMDB buffers). With ``copy=False`` and a writable ``buf`` (a
    bytearray), the arrays are views of ``buf`` itself.
    """
    return _decode(buf, copy)


cdef int _parse_header(const uint8_t* p, uint64_t total, uint32_t* meta_len, uint64_t* data_len,
                       uint64_t* stored, uint64_t* data_start) except -1:
    """Read and check the 32-byte header of an encoded value of `total` bytes at p; returns the
    value's format (its checksum's version: 2, or 1 for values written before format 2)."""
    cdef int version
    if total >= HEADER and memcmp4(p, <const char*>MAGIC) == 0:
        version = 2
    elif total >= HEADER and memcmp4(p, <const char*>MAGIC_V1) == 0:
        version = 1
    else:
        raise CodecError("not a trainloom-encoded value (bad magic or shorter than the 32-byte header)")
    memcpy(meta_len, p + 4, 4)
    memcpy(data_len, p + 8, 8)
    memcpy(stored, p + 16, 8)
    data_start[0] = (HEADER + <uint64_t>meta_len[0] + ALIGN - 1) // ALIGN * ALIGN
    if data_start[0] > total or total - data_start[0] != data_len[0]:
        raise ChecksumError(
            f"damaged value: header says {meta_len[0]}+{data_len[0]} bytes, buffer holds {total}")
    return version


cdef object _decode(object buf, bint copy):
    """Decode a value produced by :func:`encode`.

    Verifies the checksum first; raises :class:`ChecksumError` for damaged values and
    :class:`CodecError` for anything that is not an encoded value. With ``copy=True`` (the default)
    the array bytes are copied once into a fresh buffer the returned tensors/arrays view, so ``buf``
    may be released right after (LMDB buffers). With ``copy=False`` and a writable ``buf`` (a
    bytearray), the arrays are views of ``buf`` itself.
    """
    cdef Py_buffer view
    cdef bint writable = False
    if not copy:
        try:
            PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
            writable = True
        except BufferError:
            copy = True
    if not writable:
        PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        return _decode_view(buf, <const uint8_t*>view.buf, <uint64_t>view.len, copy)
    finally:
        PyBuffer_Release(&view)


cdef object _decode_view(object buf, const uint8_t* p, uint64_t total, bint copy):
    """_decode's work on the `total` bytes at p, which `buf` exports (the caller holds the view)."""
    cdef uint32_t meta_len
    cdef uint64_t data_len, stored, data_start
    cdef int version = _parse_header(p, total, &meta_len, &data_len, &stored, &data_start)
    return _decode_parsed(buf, p, meta_len, data_len, stored, data_start, copy, _Decoder.__new__(_Decoder),
                          version)


cdef object _decode_parsed(object buf, const uint8_t* p, uint32_t meta_len, uint64_t data_len,
                           uint64_t stored, uint64_t data_start, bint copy, _Decoder dec, int version):
    """_decode_view after _parse_header (a batch parses every header first). ``dec`` is a decoder
    whose fields are all set here (a batch reuses one for its small values)."""
    cdef uint64_t h
    cdef uint8_t* dst = NULL
    cdef Cursor c
    if copy and data_len:
        blk = _Block.make(<size_t>data_len) if data_len >= NOGIL_MIN else _Block.make_exact(<size_t>data_len)
        dst = <uint8_t*>(<_Block>blk).ptr
        dec.arena = blk
        dec.base = (<_Block>blk).ptr
        dec.arena_off = 0
    else:
        dec.arena = buf
        dec.base = NULL
        dec.arena_off = data_start
    dec.data_len = data_len
    if data_len >= NOGIL_MIN:
        # The caller's view pins the source and dec.arena owns dst: no Python object is touched here.
        with nogil:
            h = _checksum(p + HEADER, <size_t>(data_start - HEADER), data_len, NULL, version)
            h = _checksum(p + data_start, <size_t>data_len, h, dst, version)
    else:
        h = _checksum(p + HEADER, <size_t>(data_start - HEADER), data_len, NULL, version)
        h = _checksum(p + data_start, <size_t>data_len, h, dst, version)
    if h != stored:
        raise ChecksumError(f"damaged value: checksum {h:#018x} != stored {stored:#018x}")
    c.p = p + HEADER
    c.end = p + HEADER + meta_len
    out = dec.decode(&c, 0)
    if c.p != c.end:
        raise CodecError("encoded value is malformed (trailing metadata)")
    return out


cdef inline int memcmp4(const uint8_t* a, const char* b) noexcept nogil:
    return 0 if (a[0] == <uint8_t>b[0] and a[1] == <uint8_t>b[1] and a[2] == <uint8_t>b[2]
                 and a[3] == <uint8_t>b[3]) else 1


def is_encoded(buf):
    """True when ``buf`` starts with the codec's magic (cheap; does not verify the checksum)."""
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        return view.len >= HEADER and (memcmp4(<const uint8_t*>view.buf, <const char*>MAGIC) == 0
                                       or memcmp4(<const uint8_t*>view.buf, <const char*>MAGIC_V1) == 0)
    finally:
        PyBuffer_Release(&view)


# ---------------------------------------------------------------------------------------------------
# Batched decoding: the checksum+copy passes of a batch's large values spread over threads
# ---------------------------------------------------------------------------------------------------
# A batch of images is bound by memory bandwidth: one core reads ~17 GB/s from LMDB's map here, so a
# 150 KB image costs ~9 us of checksum+copy, and two cores read ~30 GB/s. The main thread (holding the
# GIL) fetches each value, parses its header, takes its destination block and publishes a job; worker
# threads (no GIL, no Python object touched) claim and run jobs as soon as they are published, and the
# main thread joins in once every value is fetched. It then joins the workers, verifies the checksums
# and builds the object trees, in order.
# Workers are started per batch with pthread_create, and only once the batch is known to hold enough
# large values (PAR_MIN_BYTES): starting one costs ~45 us, and a persistent pool would have to survive
# fork(), which DataLoader workers use. Inside a DataLoader worker torch.get_num_threads() is 1, so
# workers decode on their own thread only.

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef void* (*_start_fn)(void*) noexcept nogil
    int pthread_create(pthread_t* thread, const void* attr, _start_fn start, void* arg)
    int pthread_join(pthread_t thread, void** retval)

cdef extern from *:
    """
    #include <stddef.h>
    #include <time.h>
    #if defined(__x86_64__) || defined(__i386__)
    #include <immintrin.h>
    #define tl_cpu_relax() _mm_pause()
    #else
    #define tl_cpu_relax() ((void)0)
    #endif
    /* Claim the next published job: its index, or (size_t)-1 when none is published right now. */
    static inline size_t tl_claim(size_t* next, size_t* published) {
        size_t i = __atomic_load_n(next, __ATOMIC_RELAXED);
        while (i < __atomic_load_n(published, __ATOMIC_ACQUIRE)) {
            if (__atomic_compare_exchange_n(next, &i, i + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                return i;
        }
        return (size_t)-1;
    }
    static inline void tl_publish(size_t* published, size_t n) { __atomic_store_n(published, n, __ATOMIC_RELEASE); }
    static inline int tl_flag(int* f) { return __atomic_load_n(f, __ATOMIC_ACQUIRE); }
    static inline void tl_set_flag(int* f) { __atomic_store_n(f, 1, __ATOMIC_RELEASE); }
    static inline void tl_nap(void) { struct timespec ts = {0, 20000}; nanosleep(&ts, NULL); }
    /* Ask for the first 2 KiB of a value fetched from the map at once, so that its cache-line misses
       overlap instead of coming one by one as the checksum reaches each line. */
    static inline void tl_prefetch_head(const uint8_t* p, size_t n) {
        size_t o;
        if (n > 2048) n = 2048;
        for (o = 64; o < n; o += 64) __builtin_prefetch(p + o);
        if (n) __builtin_prefetch(p + n - 1);
    }
    """
    size_t tl_claim(size_t* next, size_t* published) noexcept nogil
    void tl_prefetch_head(const uint8_t* p, size_t n) noexcept nogil
    void tl_publish(size_t* published, size_t n) noexcept nogil
    int tl_flag(int* f) noexcept nogil
    void tl_set_flag(int* f) noexcept nogil
    void tl_cpu_relax() noexcept nogil
    void tl_nap() noexcept nogil

cdef enum:
    MAX_DECODE_THREADS = 8
    # Start workers only for batches with at least this many bytes of large values (see above).
    PAR_MIN_BYTES = 1 << 20
    # A worker waiting for the next job spins this many times (~10 us), then naps 20 us per check, so a
    # slow fetch never burns a core for long.
    SPIN_LIMIT = 256
    # Batches up to this many values keep their per-value bookkeeping on the stack (_decode_batch).
    STACK_ITEMS = 64

cdef struct _Job:
    const uint8_t* src      # data section in the caller's buffer (valid while its view is held)
    uint8_t* dst            # the _Block the arrays will view
    size_t n
    uint64_t seed           # checksum of the meta section, chained into the data's
    uint64_t h              # result
    int version             # the value's format (_checksum)

cdef struct _Queue:
    _Job* jobs
    size_t published        # jobs[0:published) are ready (release store by the main thread)
    size_t next             # next job to claim
    int closed              # no more jobs will be published
    int aborted             # stop claiming (an exception in the main thread)

cdef inline void _run_job(_Job* j) noexcept nogil:
    j.h = _checksum(j.src, j.n, j.seed, j.dst, j.version)

cdef void* _worker(void* arg) noexcept nogil:
    cdef _Queue* q = <_Queue*>arg
    cdef size_t i
    cdef int idle = 0
    while not tl_flag(&q.aborted):
        i = tl_claim(&q.next, &q.published)
        if i != <size_t>-1:
            _run_job(&q.jobs[i])
            idle = 0
        elif tl_flag(&q.closed):
            # Re-check after seeing `closed`: the last jobs may have been published just before it.
            i = tl_claim(&q.next, &q.published)
            if i == <size_t>-1:
                break
            _run_job(&q.jobs[i])
        else:
            idle += 1
            if idle < SPIN_LIMIT:
                tl_cpu_relax()
            else:
                tl_nap()
    return NULL

cdef void _drain(_Queue* q) noexcept nogil:
    """The main thread's share: run jobs until none is left to claim."""
    cdef size_t i
    while True:
        i = tl_claim(&q.next, &q.published)
        if i == <size_t>-1:
            return
        _run_job(&q.jobs[i])


cdef int _decode_threads = 0     # 0: follow torch.get_num_threads() (1 inside DataLoader workers)
cdef Py_ssize_t _threads_started = 0   # worker threads started in this process (tests read it)


def threads_started():
    """How many decode worker threads this process has started so far (a counter for tests)."""
    return _threads_started
_torch_get_num_threads = torch.get_num_threads


def set_decode_threads(int n):
    """Threads that decode one batch (0: torch.get_num_threads(), the default). Returns the old value."""
    global _decode_threads
    if n < 0:
        raise ValueError(f"decode threads must be >= 0 (0 follows torch.get_num_threads()), got {n}")
    old = _decode_threads
    _decode_threads = n
    return old


def get_decode_threads():
    """The setting of :func:`set_decode_threads` (0: follow torch.get_num_threads())."""
    return _decode_threads


cdef inline uint64_t _stored(const uint8_t* p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p + 16, 8)
    return v


cdef tuple _decode_batch(object get, list items, object missing):
    """``([decode(v) or missing for v in values], total bytes)`` where the values are ``items`` (get is
    None) or ``get(k) for k in items``, and a value of None (no entry) gives ``missing``. Every buffer is
    held until the batch is done (LMDB buffers: call inside the read transaction). Raises on the first
    damaged value, in order."""
    global _threads_started
    cdef Py_ssize_t n = len(items), i, k, nj = 0, nbytes = 0
    cdef Py_buffer* views = NULL
    cdef char* held = NULL
    cdef Py_ssize_t* job_item = NULL
    cdef pthread_t tid[MAX_DECODE_THREADS]
    cdef int nworkers = 0, want = 0, w
    cdef _Queue q
    cdef const uint8_t* p
    cdef uint32_t meta_len
    cdef uint64_t data_len, stored, data_start, total, large_bytes = 0
    cdef int version
    cdef _Decoder dec
    cdef _Decoder sdec = _Decoder.__new__(_Decoder)   # reused for every small value of the batch
    cdef Cursor c
    cdef list out = [missing] * n
    cdef list decs = [None] * n
    cdef list vals = [None] * n     # keeps every fetched value alive until its buffer is released
    # Batches of up to STACK_ITEMS values keep their bookkeeping on the stack (~8 KiB): heap blocks of
    # this size took malloc's slow path (fastbin consolidation) once per batch.
    cdef Py_buffer views_s[STACK_ITEMS]
    cdef char held_s[STACK_ITEMS]
    cdef _Job jobs_s[STACK_ITEMS]
    cdef Py_ssize_t job_item_s[STACK_ITEMS]
    cdef bint heap = n > STACK_ITEMS
    memset(&q, 0, sizeof(q))
    if n == 0:
        return out, 0
    if heap:
        views = <Py_buffer*>PyMem_Calloc(<size_t>n, sizeof(Py_buffer))
        held = <char*>PyMem_Calloc(<size_t>n, 1)
        q.jobs = <_Job*>PyMem_Calloc(<size_t>n, sizeof(_Job))
        job_item = <Py_ssize_t*>PyMem_Calloc(<size_t>n, sizeof(Py_ssize_t))
    else:
        # Only held[] is read before being written (views, jobs and job_item are filled as used).
        views = views_s
        held = held_s
        memset(held, 0, <size_t>n)
        q.jobs = jobs_s
        job_item = job_item_s
    try:
        if views == NULL or held == NULL or q.jobs == NULL or job_item == NULL:
            raise MemoryError()
        want = (_decode_threads if _decode_threads > 0 else _torch_get_num_threads()) - 1
        if want > MAX_DECODE_THREADS - 1:
            want = MAX_DECODE_THREADS - 1
        for i in range(n):
            v = items[i] if get is None else get(items[i])
            if v is None:
                continue
            vals[i] = v
            PyObject_GetBuffer(v, &views[i], PyBUF_SIMPLE)
            held[i] = 1
            p = <const uint8_t*>views[i].buf
            total = <uint64_t>views[i].len
            nbytes += <Py_ssize_t>total
            tl_prefetch_head(p, <size_t>total)
            version = _parse_header(p, total, &meta_len, &data_len, &stored, &data_start)
            if data_len < NOGIL_MIN:
                # Small values: decoding takes less than handing them to another thread.
                out[i] = _decode_parsed(v, p, meta_len, data_len, stored, data_start, True, sdec, version)
                PyBuffer_Release(&views[i])
                held[i] = 0
                continue
            dec = _Decoder.__new__(_Decoder)
            blk = _Block.make(<size_t>data_len)
            dec.arena = blk
            dec.base = (<_Block>blk).ptr
            dec.arena_off = 0
            dec.data_len = data_len
            decs[i] = dec
            q.jobs[nj].src = p + data_start
            q.jobs[nj].dst = <uint8_t*>(<_Block>blk).ptr
            q.jobs[nj].n = <size_t>data_len
            q.jobs[nj].seed = _checksum(p + HEADER, <size_t>(data_start - HEADER), data_len, NULL, version)
            q.jobs[nj].version = version
            job_item[nj] = i
            nj += 1
            tl_publish(&q.published, <size_t>nj)
            large_bytes += data_len
            # Start the workers as soon as the batch looks large enough (its remaining items sized
            # like this one); a failed pthread_create only means fewer workers.
            if nworkers == 0 and want > 0 and large_bytes + <uint64_t>(n - 1 - i) * data_len >= PAR_MIN_BYTES:
                for w in range(want):
                    if pthread_create(&tid[nworkers], NULL, _worker, &q) == 0:
                        nworkers += 1
                _threads_started += nworkers
                want = 0
        tl_set_flag(&q.closed)
        with nogil:
            _drain(&q)
            for w in range(nworkers):
                pthread_join(tid[w], NULL)
        nworkers = 0
        for k in range(nj):
            i = job_item[k]
            p = <const uint8_t*>views[i].buf
            if q.jobs[k].h != _stored(p):
                raise ChecksumError(f"damaged value: checksum {q.jobs[k].h:#018x} != stored {_stored(p):#018x}")
            memcpy(&meta_len, p + 4, 4)
            c.p = p + HEADER
            c.end = p + HEADER + meta_len
            out[i] = (<_Decoder>decs[i]).decode(&c, 0)
            if c.p != c.end:
                raise CodecError("encoded value is malformed (trailing metadata)")
        return out, nbytes
    finally:
        if nworkers:
            # An exception while fetching: stop the workers before the buffers they read go away.
            tl_set_flag(&q.aborted)
            with nogil:
                for w in range(nworkers):
                    pthread_join(tid[w], NULL)
        if held != NULL:
            for i in range(n):
                if held[i]:
                    PyBuffer_Release(&views[i])
        if heap:
            PyMem_Free(views)
            PyMem_Free(held)
            PyMem_Free(q.jobs)
            PyMem_Free(job_item)


def decode_many_get(get, keys, missing=None):
    """``[decode(get(k)) for k in keys]`` and the total bytes read; ``missing`` where ``get(k)`` is
    None (no entry), so that a stored None (decoded None) can be told from an absent key.

    ``get`` is e.g. an LMDB transaction's ``get`` with ``buffers=True`` (buffers valid inside the
    read transaction only: call this inside it). The large values' checksum+copy passes run on up to
    :func:`get_decode_threads` threads. Raises CodecError/ChecksumError on the first damaged value;
    the caller then retries item by item.
    """
    return _decode_batch(get, list(keys), missing)


def decode_list(values, missing=None):
    """``[decode(v) for v in values]`` (``missing`` for None values) and the total bytes (Redis MGET
    results)."""
    return _decode_batch(None, list(values), missing)


def int_keys(bytes prefix, indices, Py_ssize_t n):
    """``[prefix + b"%d" % i for i in indices]`` when every index is an int in ``[0, n)`` (n < 0: no
    bound), else None (the caller then validates each index and reports the bad one)."""
    cdef list out = []
    cdef char buf[32]
    cdef Py_ssize_t plen = len(prefix)
    cdef long long v
    cdef unsigned long long u
    cdef int m
    cdef char* d
    for i in indices:
        if type(i) is not int:
            return None
        try:
            v = i
        except OverflowError:
            return None
        if v < 0 or (n >= 0 and v >= n):
            return None
        # The decimal digits, written backwards from the end of buf (snprintf's format parsing cost
        # more than the rest of the key).
        u = <unsigned long long>v
        m = 0
        while True:
            m += 1
            buf[32 - m] = <char>(48 + u % 10)   # 48: '0'
            u //= 10
            if u == 0:
                break
        k = PyBytes_FromStringAndSize(NULL, plen + m)
        d = PyBytes_AS_STRING(k)
        memcpy(d, PyBytes_AS_STRING(prefix), plen)
        memcpy(d + plen, buf + 32 - m, m)
        out.append(k)
    return out


def missing_positions(list values, missing, corrupt):
    """Positions of ``values`` that are ``missing`` or ``corrupt`` (identity checks only; a None value
    is a stored None, not a miss)."""
    cdef list out = []
    cdef Py_ssize_t i
    for i in range(len(values)):
        v = values[i]
        if v is missing or v is corrupt:
            out.append(i)
    return out
