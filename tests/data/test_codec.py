"""The sample codec: round trips, raw tensors, view-only bytes, pickle-5 fallback, checksums."""

from __future__ import annotations

import collections
import gc
import itertools
import pickle
import struct
import threading
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainloom.data import CacheLoader, _codec
from trainloom.data.codec import ChecksumError, CodecError, checksum, decode, encode, hash64, is_encoded

Point = collections.namedtuple("Point", "x y")


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        )
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


TENSOR_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                 torch.uint16, torch.uint32, torch.uint64]  # fmt: skip


@pytest.mark.parametrize("dtype", TENSOR_DTYPES)
def test_tensor_dtypes_round_trip(dtype):
    t = (torch.arange(24) % 5).to(dtype).reshape(2, 3, 4)
    out = decode(encode(t))
    assert same(t, out)
    out.fill_(1)  # writable, and its own memory
    assert bool(out.flatten()[0] == 1) and not torch.equal(t, out)
    assert out.data_ptr() != t.data_ptr()


@pytest.mark.parametrize(
    "dtype", ["bool", "uint8", "int16", "int64", "float16", "float32", "float64", "complex128"]
)
def test_ndarray_dtypes_round_trip(dtype):
    a = (np.arange(12) % 3).astype(dtype).reshape(3, 4)
    out = decode(encode(a))
    assert same(a, out) and out.flags.writeable


def test_nested_sample_round_trip():
    x = {
        "img": torch.randint(0, 255, (3, 8, 8), dtype=torch.uint8),
        "arr": [np.zeros(0, np.float32), np.ones((2, 0)), np.float32(2.5), np.int64(-3)],
        "meta": ("name", b"\x00raw", None, True, False, -(2**63), 2**63 - 1, 1.5, float("inf")),
        7: {"nested": [[[]]], (1, 2): "tuple key"},
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
    }
    out = decode(encode(x))
    assert same(x, out)


def test_big_int_and_other_objects_fall_back_to_pickle():
    x = [2**100, {1, 2}, complex(1, 2), Point(1, "a")]
    assert decode(encode(x)) == x


def test_views_store_only_their_elements():
    base = torch.zeros(1_000_000)
    view = base[10:20]
    assert len(pickle.dumps(view)) > 4_000_000  # what the issue is about
    assert len(encode(view)) < 200
    col = torch.arange(12.0).reshape(3, 4)[:, 1]  # non-contiguous
    assert same(col.contiguous(), decode(encode(col)))
    npv = np.arange(1_000_000)[::100_000]
    assert len(encode(npv)) < 250 and same(np.ascontiguousarray(npv), decode(encode(npv)))


def test_tensors_inside_pickled_objects_stay_raw():
    img = torch.randint(0, 255, (3, 224, 224), dtype=torch.uint8)
    x = Point(img, np.arange(4))
    b = encode(x)
    assert len(b) < img.numel() + 1000  # raw bytes + small overhead, not torch.save's pickle
    out = decode(b)
    assert type(out) is Point and same(img, out.x) and same(np.arange(4), out.y)


def test_requires_grad_and_conj_tensors():
    t = torch.ones(3, requires_grad=True) * 2
    assert same(t.detach(), decode(encode(t)))
    c = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert same(c.resolve_conj(), decode(encode(c)))


def test_decode_copies_once_and_owns_its_memory():
    img = torch.arange(100, dtype=torch.int32)
    buf = bytearray(encode((img, 1)))
    out = decode(memoryview(buf))
    buf[:] = b"\x00" * len(buf)  # the source may be reused right after decode (LMDB)
    assert same(img, out[0])


def test_copy_false_shares_memory_and_checksum_then_fails():
    buf = bytearray(encode(np.zeros(4, np.int64)))
    out = decode(buf, copy=False)
    out[0] = 7
    with pytest.raises(ChecksumError, match="checksum"):
        decode(buf)


def test_damage_anywhere_is_detected():
    b = encode({"a": torch.arange(1000), "b": "text", "c": np.ones(300)})
    for pos in range(0, len(b), 7):
        if 24 <= pos < 32:  # reserved header bytes are not covered
            continue
        bad = bytearray(b)
        bad[pos] ^= 0x10
        with pytest.raises(CodecError):
            decode(bytes(bad))


def test_truncated_and_foreign_values():
    b = encode([1, 2, 3])
    with pytest.raises(ChecksumError, match="header says"):
        decode(b[:-1])
    with pytest.raises(CodecError, match="bad magic"):
        decode(b"hello world, not a value at all!")
    with pytest.raises(CodecError, match="bad magic"):
        decode(b"")
    assert is_encoded(b) and not is_encoded(b"xyz")


def test_forged_header_with_valid_checksum_is_rejected():
    # A structurally bad meta section with a correct checksum must raise, not crash.
    meta = bytes([7]) + struct.pack("<Q", 10**9)  # tuple claiming 1e9 items
    header = b"TLC\x02" + struct.pack("<IQ", len(meta), 0)
    padded = meta + b"\x00" * (-(32 + len(meta)) % 64)
    h = checksum(b"", checksum(padded, 0))
    body = header + struct.pack("<Q", h) + b"\x00" * 8 + padded
    with pytest.raises(CodecError, match="malformed"):
        decode(body)


def forge(meta: bytes, data: bytes = b"") -> bytes:
    """A value with the given meta and data sections and a correct checksum."""
    header = b"TLC\x02" + struct.pack("<IQ", len(meta), len(data))
    padded = meta + b"\x00" * (-(32 + len(meta)) % 64)
    h = checksum(data, checksum(padded, len(data)))
    return header + struct.pack("<Q", h) + b"\x00" * 8 + padded + data


@pytest.mark.parametrize("tag", [10, 11])  # ndarray, tensor
def test_forged_shapes_with_valid_checksum_are_rejected(tag):
    # Arrays are made over the decoder's block with numpy's C API, so the codec itself must refuse
    # shapes that overflow or run past the data: a forged value must raise, never read out of bounds.
    data = bytes(64)
    ok = bytes([tag, 5, 2]) + struct.pack("<QQQ", 2, 4, 0)  # int64, 2 x 4, offset 0
    assert decode(forge(ok, data)).shape == (2, 4)
    past = bytes([tag, 5, 2]) + struct.pack("<QQQ", 2, 5, 0)  # 80 bytes of 64
    with pytest.raises(CodecError, match="runs past the data section"):
        decode(forge(past, data))
    overflow = bytes([tag, 5, 2]) + struct.pack("<QQQ", 1 << 40, 1 << 40, 0)
    with pytest.raises(CodecError, match="shape overflows"):
        decode(forge(overflow, data))
    wrap = bytes([tag, 5, 1]) + struct.pack("<QQ", (1 << 61) + 1, 0)  # 8 * numel wraps to 8
    with pytest.raises(CodecError, match="runs past the data section"):
        decode(forge(wrap, data))
    many = bytes([tag, 5, 65]) + struct.pack("<65Q", *([1] * 65)) + struct.pack("<Q", 0)
    with pytest.raises(CodecError, match="an array with 65 dimensions"):
        decode(forge(many, data))


@pytest.mark.parametrize("tag", [7, 8])  # tuple, list
def test_container_whose_item_fails_midway_raises_codec_error(tag):
    # Tuples and lists are filled in place as their items decode: an item failing after others were
    # made must raise cleanly (the half-filled container is freed), and a good value still decodes.
    data = bytes(64)
    arr = bytes([10, 5, 1]) + struct.pack("<QQ", 8, 0)  # ndarray, int64, 1 dim of 8, offset 0
    five = bytes([3]) + struct.pack("<q", 5)  # int 5
    bad = bytes([tag]) + struct.pack("<Q", 3) + arr + five + bytes([99])  # third item: unknown tag
    with pytest.raises(CodecError, match="unknown tag 99"):
        decode(forge(bad, data))
    gc.collect()
    out = decode(forge(bytes([tag]) + struct.pack("<Q", 2) + arr + five, data))
    assert type(out) is (tuple if tag == 7 else list) and len(out) == 2 and out[1] == 5
    assert same(out[0], np.zeros(8, np.int64))


def test_containers_decode_while_the_gc_runs_at_every_allocation():
    # The garbage collector may visit a tuple or list whose later slots are not filled yet.
    x = [(np.arange(i), [i, (str(i), torch.full((2,), i))], {"k": (i,)}) for i in range(30)]
    b = encode((x, tuple(x)))
    old = gc.get_threshold()
    gc.set_threshold(1)
    try:
        out = decode(b)
    finally:
        gc.set_threshold(*old)
    assert same((x, tuple(x)), out)


def test_decoded_arrays_own_a_block_nobody_can_resize():
    a, t = decode(encode((np.arange(5), torch.arange(3))))
    assert type(a.base).__name__ == "_Block" and a.flags.writeable and a.flags.c_contiguous
    with pytest.raises(AttributeError):
        a.base.extend(b"x")  # a bytearray base could be resized under the array
    del a
    assert t.tolist() == [0, 1, 2]


def test_unserializable_raises_codec_error():
    with pytest.raises(CodecError, match="cannot serialize a value of type function"):
        encode({"f": lambda x: x})
    with pytest.raises(CodecError, match="cannot serialize"):
        encode([threading.Lock()])
    deep: list = []
    cur = deep
    for _ in range(300):
        cur.append([])
        cur = cur[0]
    with pytest.raises(CodecError, match="nested deeper"):
        encode(deep)


def test_hash64_is_xxh64_and_stable():
    assert hash64(b"") == 0xEF46DB3751D8E999
    assert hash64(b"a") == 0xD24EC4F1A98C6E5B
    assert hash64(b"abc") == 0x44BC2CF5AD770999
    assert hash64("abc") == hash64(b"abc")
    assert hash64(b"x" * 100_000) == hash64(bytearray(b"x" * 100_000))


def test_checksum_covers_every_length_and_position():
    data = bytes(range(256)) * 40
    seen = set()
    for n in (0, 1, 31, 32, 63, 64, 255, 256, 1023, 1024, 1025, 4097, len(data)):
        h = checksum(data[:n])
        assert h not in seen
        seen.add(h)
        if n:
            flipped = bytearray(data[:n])
            flipped[n // 2] ^= 1
            assert checksum(bytes(flipped)) != h


_np_leaf = st.builds(
    lambda n, s: np.arange(n, dtype=s), st.integers(0, 50), st.sampled_from(["int8", "float32", "uint64"])
)
_torch_leaf = st.builds(lambda n: torch.arange(n, dtype=torch.float64), st.integers(0, 50))
_leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary()
samples = st.recursive(
    _leaves | _np_leaf | _torch_leaf,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.tuples(kids, kids)
        | st.dictionaries(st.text(max_size=5), kids, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(samples)
def test_round_trip_property(x):
    assert same(x, decode(encode(x)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.one_of(st.integers(-5, 256), samples), min_size=1, max_size=16))  # CPython's shared ints
def test_every_sample_is_a_hit_through_a_cache_loader(tmp_path_factory, values):
    # Through the loader, not just the codec: every sample read back from the store, one by one
    # and batched, is a hit equal to what was cached. The loader's markers in its lists of values
    # read (a missing key, an entry that does not decode) once matched a cached int 7; that case is
    # pinned by test_cache.py::test_every_small_int_is_served_from_the_cache (60 examples here do
    # not reliably draw a 7).
    path = tmp_path_factory.getbasetemp() / "codec-through-loader"
    name = f"p{next(_EXAMPLE)}"
    with CacheLoader(path=path, dataset_name=name) as first:
        for i, v in enumerate(values):
            first.get(i, lambda k, v=v: v)
    with CacheLoader(path=path, dataset_name=name) as again:

        def never(key):
            raise AssertionError(f"recomputed key {key}")

        one_by_one = [again.get(i, never) for i in range(len(values))]
        batched = again.get_many(list(range(len(values))), never)
        stats = again.stats(this_process=True)
    assert all(same(v, a) and same(v, b) for v, a, b in zip(values, one_by_one, batched))
    assert (stats["hits"], stats["misses"], stats["corrupt"]) == (2 * len(values), 0, 0)


_EXAMPLE = itertools.count()


def test_avx2_and_portable_checksums_agree():
    # The kernel is picked at import ($TRAINLOOM_CODEC_NO_AVX2 forces the portable one); both must give
    # the very same values, or a cache written on one machine would read as damaged on another.
    import random

    from trainloom.data import _codec

    rnd = random.Random(5)
    data = bytes(rnd.getrandbits(8) for _ in range(70000))
    value = encode(torch.arange(20000, dtype=torch.int32))
    results = {}
    try:
        for allow in (True, False):
            name = _codec._select_kernel(allow)
            results[name] = [checksum(data[:n], 7) for n in (256, 1000, 1024, 4096, 70000)]
            assert same(decode(value), torch.arange(20000, dtype=torch.int32))  # fused copy path too
    finally:
        _codec._select_kernel(True)
    assert "sse2" in results
    assert len({tuple(v) for v in results.values()}) == 1


# -- dtypes numpy lacks whose torch pickle does not load back: stored raw ----------------------------

RAW_VIEW = [(name, width) for name, width in _codec._RAW_VIEW_DTYPES if hasattr(torch, name)]
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def test_raw_view_dtype_codes_are_pinned():
    # Codes are part of the on-disk format: appended after bfloat16 (14), never renumbered.
    names = [n for n, _ in _codec._RAW_VIEW_DTYPES]
    assert names[:7] == [
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2", "bits8",
    ]  # fmt: skip
    assert _codec._TORCH_NAMES[15:] == names
    assert _codec._TORCH_CODE[torch.bfloat16] == 14 and _codec._TORCH_CODE[torch.float8_e4m3fn] == 15


@pytest.mark.parametrize("name,width", RAW_VIEW, ids=[n for n, _ in RAW_VIEW])
def test_raw_view_dtypes_round_trip_bit_exactly(name, width):
    dt = getattr(torch, name)
    raw = _INT_OF_WIDTH[width]
    bits = torch.randint(
        -(2**31), 2**31 - 1, (6, 8), dtype=torch.int64, generator=torch.Generator().manual_seed(1)
    )
    x = bits.to(raw).view(dt)  # every bit pattern, NaN encodings included
    assert dt in _codec._TORCH_CODE and len(encode(x)) < 64 + 64 + x.numel() * width  # raw, not pickled
    for v in (x, x[:, 1::3], x.t(), x[2, 5], x[:0]):
        out = decode(encode(v))
        assert out.dtype == dt and out.shape == v.shape
        assert torch.equal(out.view(raw), v.view(raw).contiguous())
    # Inside an object that goes through pickle (persistent_id), and inside containers.
    p = decode(encode(Point(x[:, ::2], {"k": x})))
    assert (
        type(p) is Point and p.x.dtype == dt and torch.equal(p.x.view(raw), x.view(raw)[:, ::2].contiguous())
    )
    assert torch.equal(p.y["k"].view(raw), x.view(raw))


def test_a_raw_view_dtype_this_torch_lacks_raises_codec_error():
    b = encode(torch.zeros(4, dtype=torch.uint8).view(torch.float8_e5m2))
    saved = _codec._TORCH_DTYPES[16]
    _codec._TORCH_DTYPES[16] = None  # as if this torch had no float8_e5m2
    try:
        with pytest.raises(
            CodecError, match=r"tensor dtype float8_e5m2 \(code 16\) is not available in torch"
        ):
            decode(b)
    finally:
        _codec._TORCH_DTYPES[16] = saved


def test_strings_with_lone_surrogates_round_trip():
    name = b"/data/img_\xff.png".decode("utf-8", "surrogateescape")  # what os.listdir returns
    x = (name, {name: [name, "\ud800"]}, "plain")
    assert decode(encode(x)) == x
    assert decode(encode(name)) == name


def test_nested_tensors_round_trip_and_meta_tensors_raise():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the PyTorch API of nested tensors is in prototype stage"
        n = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
    for v in (n, Point(n, 1)):
        out = decode(encode(v))
        out = out.x if isinstance(out, Point) else out
        assert out.is_nested and [t.tolist() for t in out.unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]
    meta = torch.empty(3, device="meta")
    for v in (meta, [1, meta], Point(meta, 1)):
        with pytest.raises(
            CodecError, match="a tensor on the meta device holds no data and cannot be stored"
        ):
            encode(v)


def _gone():
    raise AttributeError("Can't get attribute 'OldName' on <module 'mymodule'>")


class _Unloadable:
    def __reduce__(self):
        return (_gone, ())


def test_objects_that_cannot_be_unpickled_raise_codec_error():
    b = encode({"x": _Unloadable(), "t": torch.ones(2)})
    with pytest.raises(
        CodecError, match=r"cannot unpickle an object in the encoded value \(AttributeError: Can't"
    ):
        decode(b)


def test_torch_refusing_to_pickle_is_a_codec_error():
    class Refuses:
        def __reduce__(self):
            raise RuntimeError("torch says no")

    with pytest.raises(
        CodecError, match="cannot serialize a value of type Refuses: RuntimeError: torch says no"
    ):
        encode([Refuses()])
