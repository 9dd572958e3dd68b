"""Forged encoded values (correct checksum, damaged structure): decode raises the exact CodecError.

Layout (see pyx/data/_codec.pyx): a 32-byte header (magic, meta length u32, data length u64,
checksum u64, 8 reserved bytes), the metadata padded to 64 bytes, then the data section. Metadata
nodes are a tag byte and little-endian fields.
"""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from trainloom.data import _codec
from trainloom.data.codec import CodecError, checksum, decode, encode

# Tags and reference kinds of _codec.pyx.
T_NONE, T_INT, T_STR, T_LIST, T_DICT = 0, 3, 5, 8, 9
T_NDARRAY, T_TENSOR, T_NPSCALAR, T_PICKLE = 10, 11, 12, 13
K_RAW = 2


def forge(meta: bytes, data: bytes = b"") -> bytes:
    """A value with the given meta and data sections and a correct checksum."""
    header = b"TLC\x02" + struct.pack("<IQ", len(meta), len(data))
    padded = meta + b"\x00" * (-(32 + len(meta)) % 64)
    h = checksum(data, checksum(padded, len(data)))
    return header + struct.pack("<Q", h) + b"\x00" * 8 + padded + data


def decode_error(buf: bytes) -> str:
    with pytest.raises(CodecError) as info:
        decode(buf)
    return str(info.value)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def test_forge_matches_encode():
    assert forge(bytes([T_INT]) + struct.pack("<q", 5)) == encode(5)


def test_bad_utf8_in_a_string():
    with pytest.raises(UnicodeDecodeError) as utf8:
        b"ok\xff".decode("utf-8")
    with pytest.raises(CodecError) as info:
        decode(forge(bytes([T_STR]) + u64(3) + b"ok\xff"))
    assert str(info.value) == f"encoded value is malformed (bad UTF-8 in a string: {utf8.value})"
    assert isinstance(info.value.__cause__, UnicodeDecodeError)


@pytest.mark.parametrize(
    "meta",
    [
        b"",  # no root node
        bytes([T_INT]) + b"\x01\x02\x03\x04",  # an int of 4 bytes
        bytes([T_STR]) + u64(10) + b"short",
        bytes([T_DICT]) + u64(1) + bytes([T_NONE]),  # a key without its value
        bytes([T_LIST]) + b"\x01\x00",  # its length is cut
    ],
    ids=["empty", "int", "str", "dict-value", "list-length"],
)
def test_metadata_runs_past_its_end(meta):
    assert decode_error(forge(meta)) == "encoded value is truncated or malformed (metadata runs past its end)"


def _array_node(tag: int, code: int) -> bytes:
    return bytes([tag, code, 1]) + u64(2) + u64(0)  # 1 dimension of 2, offset 0


def test_unknown_tensor_dtype_code():
    n = len(_codec._TORCH_DTYPES)
    assert decode(forge(_array_node(T_TENSOR, n - 1), bytes(64))).shape == (2,)  # the last code is known
    for code in (n, 255):
        bad = forge(_array_node(T_TENSOR, code), bytes(64))
        assert decode_error(bad) == f"unknown tensor dtype code {code}"


def test_unknown_array_dtype_code():
    n = len(_codec._NP_DTYPES)
    assert decode(forge(_array_node(T_NDARRAY, n - 1), bytes(64))).shape == (2,)
    for code in (n, 255):
        bad = forge(_array_node(T_NDARRAY, code), bytes(64))
        assert decode_error(bad) == f"unknown array dtype code {code}"


def test_unknown_numpy_scalar_dtype_code():
    n = len(_codec._NP_DTYPES)
    last = _codec._NP_DTYPES[n - 1]
    scalar = decode(forge(bytes([T_NPSCALAR, n - 1]) + bytes(last.itemsize)))
    assert isinstance(scalar, np.generic) and scalar.dtype == last
    for code in (n, 255):
        bad = forge(bytes([T_NPSCALAR, code]) + bytes(16))
        assert decode_error(bad) == f"unknown array dtype code {code}"


def _nested_lists(levels: int) -> bytes:
    return (bytes([T_LIST]) + u64(1)) * levels + bytes([T_NONE])


def test_nesting_deeper_than_the_encoder_writes():
    deepest = None
    for _ in range(200):
        deepest = [deepest]
    assert encode(deepest) == forge(_nested_lists(200))  # the deepest value encode() writes
    assert decode(forge(_nested_lists(200))) == deepest
    assert decode_error(forge(_nested_lists(201))) == "encoded value nests too deeply"


@pytest.mark.parametrize("n", [3, 2**64 - 1])
def test_dict_longer_than_its_metadata(n):
    meta = bytes([T_DICT]) + u64(n) + bytes([T_NONE, T_NONE])  # one byte short of a second entry
    assert decode_error(forge(meta)) == "encoded value is malformed (dict longer than its metadata)"


@pytest.mark.parametrize("n", [3, 2**64 - 1])
def test_list_longer_than_its_metadata(n):
    meta = bytes([T_LIST]) + u64(n) + bytes([T_NONE, T_NONE])
    assert decode_error(forge(meta)) == "encoded value is malformed (container longer than its metadata)"


# A pickle that takes one out-of-band buffer (the codec stores a PickleBuffer's bytes raw).
_PAYLOAD = pickle.dumps(pickle.PickleBuffer(b"ab"), protocol=5, buffer_callback=lambda b: False)


def _pickled(kind: int, nbytes: int, off: int) -> bytes:
    """A pickled node with one reference: ``kind``, dtype code 0, shape (nbytes,), offset ``off``."""
    ref = bytes([kind, 0, 1]) + u64(nbytes) + u64(off)
    return bytes([T_PICKLE]) + struct.pack("<I", 1) + ref + u64(len(_PAYLOAD)) + _PAYLOAD


@pytest.mark.parametrize("off", [63, 65, 2**64 - 1, 2**64 - 2])  # the last two wrap off + 2 around
def test_a_buffer_runs_past_the_data_section(off):
    data = bytes(range(64))
    assert bytes(decode(forge(_pickled(K_RAW, 2, 62), data))) == b"\x3e\x3f"  # the last two bytes
    assert decode_error(forge(_pickled(K_RAW, 2, off), data)) == (
        "encoded value is malformed (a buffer runs past the data section)"
    )


@pytest.mark.parametrize("kind", [3, 255])
def test_unknown_reference_kind(kind):
    assert decode_error(forge(_pickled(kind, 2, 0), bytes(64))) == (
        f"encoded value is malformed (unknown reference kind {kind})"
    )


def test_trailing_metadata():
    assert decode_error(forge(bytes([T_NONE, T_NONE]))) == "encoded value is malformed (trailing metadata)"
    big = 1 << 16  # a large value: the batch decoder checks it after its threaded checksum pass
    trailing = forge(_array_node(T_NDARRAY, 1)[:3] + u64(big) + u64(0) + bytes([T_NONE]), bytes(big))
    with pytest.raises(_codec.CodecError) as info:
        _codec.decode_list([trailing])
    assert str(info.value) == "encoded value is malformed (trailing metadata)"
