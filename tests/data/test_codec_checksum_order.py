"""The value checksum notices data moved within a value (format 2), and values of format 1 still read.

Format 1 mixed every 64-byte stripe with the same key and scrambled the lanes only every 1 KiB, so
inside a 1 KiB block the checksum was a plain sum of the stripes: two stripes swapped, the two
512-byte halves of a block swapped (two sectors written in each other's place) or one 8-byte word
exchanged with the word at the same place of another stripe decoded without an error, and the cache
served the damaged sample as a hit. Format 2 (magic b"TLC\\x02") mixes the k-th stripe of each block
with its own key, as XXH3 does. Every damage below decoded silently in format 1.
"""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from trainloom.data import CacheLoader, _codec
from trainloom.data.codec import ChecksumError, checksum, decode, encode, is_encoded

HEADER = 32


@pytest.fixture(params=["avx2", "sse2"])
def kernel(request):
    """Each test under both stripe kernels (the portable one is forced; AVX2 needs the CPU)."""
    try:
        name = _codec._select_kernel(request.param == "avx2")
        if name != request.param:
            pytest.skip(f"this CPU has no {request.param}")  # only AVX2 can be missing
        yield name
    finally:
        _codec._select_kernel(True)


def _data_start(value: bytes) -> int:
    meta_len = struct.unpack_from("<I", value, 4)[0]
    return (HEADER + meta_len + 63) // 64 * 64


def _swap(buf: bytearray, a: int, b: int, n: int) -> None:
    buf[a : a + n], buf[b : b + n] = buf[b : b + n], buf[a : a + n]


def _value() -> bytes:
    return encode(np.arange(4096, dtype=np.int64))  # 32 KiB of data: 32 blocks of 16 stripes


DAMAGE = {
    "two stripes swapped": lambda b, d: _swap(b, d, d + 64, 64),
    "stripes 3 and 12 of the second block swapped": lambda b, d: _swap(
        b, d + 1024 + 3 * 64, d + 1024 + 12 * 64, 64
    ),
    "the two 512-byte halves of a block swapped": lambda b, d: _swap(b, d, d + 512, 512),
    "one word swapped with the same word of another stripe": lambda b, d: _swap(b, d + 8, d + 5 * 64 + 8, 8),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_data_moved_within_a_block_is_a_checksum_error(kernel, damage):
    value = _value()
    assert value[:4] == b"TLC\x02"
    damaged = bytearray(value)
    DAMAGE[damage](damaged, _data_start(value))
    assert damaged != value
    with pytest.raises(
        ChecksumError, match="damaged value: checksum 0x[0-9a-f]{16} != stored 0x[0-9a-f]{16}"
    ):
        decode(bytes(damaged))


def test_stripes_swapped_in_the_metadata_are_a_checksum_error(kernel):
    # a bytes value lives in the metadata section, as do strings and pickled objects
    rnd = random.Random(3)
    blob = bytes(rnd.getrandbits(8) for _ in range(1024))
    value = encode({"blob": blob})
    start = value.index(blob)
    start += -(start - HEADER) % 64  # the metadata's checksum runs in stripes from the header's end
    damaged = bytearray(value)
    _swap(damaged, start, start + 64, 64)
    with pytest.raises(ChecksumError, match="damaged value"):
        decode(bytes(damaged))


def _format_1(value: bytes) -> bytes:
    """``value`` as format 1 wrote it: magic b"TLC\\x01" and format 1's checksum."""
    data_len = struct.unpack_from("<Q", value, 8)[0]
    start = _data_start(value)
    h = checksum(value[HEADER:start], data_len, version=1)
    h = checksum(value[start:], h, version=1)
    return b"TLC\x01" + value[4:16] + struct.pack("<Q", h) + value[24:]


def test_values_of_format_1_still_decode_and_are_still_checked(kernel):
    old = _format_1(_value())
    assert is_encoded(old)
    np.testing.assert_array_equal(decode(old), np.arange(4096, dtype=np.int64))
    flipped = bytearray(old)
    flipped[_data_start(old) + 100] ^= 0x10
    with pytest.raises(ChecksumError, match="damaged value"):
        decode(bytes(flipped))
    # (what format 2 fixes: format 1's checksum does not see two stripes swapped)
    swapped = bytearray(old)
    _swap(swapped, _data_start(old), _data_start(old) + 64, 64)
    assert decode(bytes(swapped))[:8].tolist() == [8, 9, 10, 11, 12, 13, 14, 15]


def test_both_formats_checksums_are_pinned_and_equal_on_both_kernels(kernel):
    # Changing either would make every stored value read as damaged: format 1's values are those
    # of the build before format 2 (b5c1392's _codec gave the same four).
    rnd = random.Random(11)
    data = bytes(rnd.getrandbits(8) for _ in range(5000))
    sizes = (300, 1024, 1088, 5000)
    assert [checksum(data[:n], 7, version=1) for n in sizes] == [
        0x24CD10146A01D2E8,
        0x16758C0790B4BA30,
        0x7DADC910B63DA343,
        0xCDF893EEAB528F4E,
    ]
    assert [checksum(data[:n], 7) for n in sizes] == [
        0x6EBC67FACE3A4A56,
        0x4EB7CDB6E0EE45CE,
        0x8AF60BACED79AFA4,
        0x0C99BA31979EB30A,
    ]


def test_an_unknown_checksum_version_is_refused():
    with pytest.raises(ValueError, match="^checksum: version must be 1 or 2, got 3$"):
        checksum(b"x" * 300, version=3)


def test_the_cache_recomputes_a_stored_value_whose_stripes_were_swapped(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="sw", flush_interval=None)
    want = np.arange(4096, dtype=np.int64)
    loader.get(0, lambda i: want)
    loader.flush()
    key = loader.key(0)
    value = bytearray(loader.store.get(key))
    _swap(value, _data_start(bytes(value)), _data_start(bytes(value)) + 64, 64)
    loader.store.mset({key: bytes(value)})  # the damaged value, as a disk or a copy could leave it
    computed = []
    got = loader.get(0, lambda i: (computed.append(i), want)[1])
    np.testing.assert_array_equal(got, want)
    s = loader.stats()
    assert computed == [0] and (s["corrupt"], s["hits"]) == (1, 0)
    loader.close()
