"""The sample codec on tensor subclasses and on tensors of more dimensions than numpy arrays have.

Tensor subclasses (``class Image(torch.Tensor)``, torchvision's tv_tensors) used to go through torch's
pickling, which writes a view's whole storage (a 10-element view of 1M floats: 4,000,576 bytes) and
decodes to a tensor holding all of it. Tensors of 65+ dimensions used to encode but not decode, so a
cache recomputed them on every read as damaged entries.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest
import torch

from trainloom.data import CacheLoader
from trainloom.data.codec import CodecError, decode, encode

Point = collections.namedtuple("Point", "x y")

# The most dimensions a raw array node has: numpy's limit (64 in numpy 2, 32 in numpy 1).
MAX_NDIM = 64 if int(np.__version__.split(".")[0]) >= 2 else 32
T_TENSOR, T_PICKLE = 11, 13  # tag of the first node (byte 32 of an encoded value)


class Image(torch.Tensor):
    pass


class Slotted(torch.Tensor):
    __slots__ = ("quality",)


class KeepsState(torch.Tensor):
    def __setstate__(self, state):
        self.restored = ("setstate", state)


class MyParam(torch.nn.Parameter):
    pass


class OwnReduce(torch.Tensor):
    """A subclass that customises its pickling: torch's pickling is kept, from a compact copy."""

    def __reduce_ex__(self, proto):
        return super().__reduce_ex__(proto)


class Registered(torch.Tensor):
    """A subclass whose pickling the user registered with copyreg."""


def _registered_as_list(t: Registered):
    return (list, (t.as_subclass(torch.Tensor).tolist(),))


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


# -- tensor subclasses ------------------------------------------------------------------------------


def test_a_subclass_view_stores_only_its_elements():
    base = torch.arange(1_000_000, dtype=torch.float32)
    view = base.as_subclass(Image)[10:20]
    assert len(encode(base[10:20])) == 104
    for x in (view, {"img": view}, [view, 1]):
        assert len(encode(x)) < 400  # was 4,000,576: the whole storage through torch's pickle
    out = decode(encode(view))
    assert type(out) is Image and out.shape == (10,) and out.dtype == torch.float32
    assert torch.equal(plain(out), base[10:20])
    assert storage_bytes(out) == 40  # was 4,000,000
    out[0] = -1  # writable, its own memory
    assert base[10] == 10


def test_subclass_type_and_attributes_round_trip():
    base = torch.arange(100, dtype=torch.float32)
    img = base.as_subclass(Image)[:6].reshape(2, 3)
    img.source, img.meta = "a.jpg", {"label": 3, "box": torch.tensor([1, 2])}
    out = decode(encode(img))
    assert type(out) is Image and out.shape == (2, 3) and torch.equal(plain(out), base[:6].reshape(2, 3))
    assert (
        out.source == "a.jpg"
        and out.meta["label"] == 3
        and torch.equal(out.meta["box"], torch.tensor([1, 2]))
    )

    s = base.as_subclass(Slotted)[:4]
    s.quality = 95
    out = decode(encode(s))
    assert type(out) is Slotted and out.quality == 95 and storage_bytes(out) == 16

    k = base.as_subclass(KeepsState)[:4]
    k.a = 1
    out = decode(encode(k))  # a custom __setstate__ gets the state, as with torch's own pickling
    assert type(out) is KeepsState and out.restored == ("setstate", {"a": 1})


def test_subclass_views_of_any_layout_and_dtype():
    col = torch.arange(12.0).reshape(3, 4).as_subclass(Image)[:, 1]  # non-contiguous
    out = decode(encode(col))
    assert type(out) is Image and out.tolist() == [1.0, 5.0, 9.0] and storage_bytes(out) == 12
    bf = torch.arange(8.0).to(torch.bfloat16).as_subclass(Image)[::2]
    out = decode(encode(bf))
    assert type(out) is Image and out.dtype == torch.bfloat16 and torch.equal(plain(out), plain(bf))
    if hasattr(torch, "float8_e4m3fn"):  # a raw-view dtype, made contiguous through uint8
        f8 = torch.arange(16.0).to(torch.float8_e4m3fn).reshape(4, 4).as_subclass(Image)[:, 1]
        out = decode(encode(f8))
        assert type(out) is Image and out.dtype == torch.float8_e4m3fn
        assert out.float().tolist() == [1.0, 5.0, 9.0, 13.0]
    meta = torch.empty(3, device="meta").as_subclass(Image)
    with pytest.raises(CodecError, match="a tensor on the meta device holds no data"):
        encode(meta)


def test_requires_grad_is_dropped_as_for_plain_tensors_but_kept_for_parameter_subclasses():
    g = (torch.ones(3, requires_grad=True) * 2).as_subclass(Image)
    out = decode(encode(g))
    assert type(out) is Image and not out.requires_grad and out.tolist() == [2.0, 2.0, 2.0]
    p = MyParam(torch.ones(3))
    out = decode(encode(p))
    assert type(out) is MyParam and out.requires_grad and out.tolist() == [1.0, 1.0, 1.0]
    out = decode(encode(MyParam(torch.ones(3), requires_grad=False)))
    assert type(out) is MyParam and not out.requires_grad


def test_subclasses_inside_pickled_objects_stay_raw():
    base = torch.zeros(1_000_000)
    view = base.as_subclass(Image)[:10]
    view.source = "b.png"
    b = encode(Point(view, view))
    assert len(b) < 500  # was 4,000,000+
    out = decode(b)
    assert type(out) is Point and type(out.x) is Image and out.x is out.y and out.x.source == "b.png"
    assert storage_bytes(out.x) == 40


def test_a_subclass_with_its_own_pickling_goes_through_it_from_a_compact_copy():
    base = torch.arange(1_000_000, dtype=torch.float32)
    view = base.as_subclass(OwnReduce)[5:15]
    view.k = 3
    b = encode(view)
    assert len(b) < 2000  # torch's pickling of a 10-element copy, not of the 4 MB storage
    out = decode(b)
    assert type(out) is OwnReduce and out.k == 3 and torch.equal(plain(out), base[5:15])
    assert storage_bytes(out) == 40


def test_a_subclass_pickle_cannot_find_raises_codec_error():
    def make():
        class Local(torch.Tensor):
            pass

        return Local

    x = torch.zeros(1_000_000).as_subclass(make())[:10]
    with pytest.raises(CodecError, match="cannot serialize a value of type Local: .*local object"):
        encode(x)


def test_subclass_views_through_a_cache_loader_on_lmdb(tmp_path):
    base = torch.arange(1_000_000, dtype=torch.float32)

    def sample(i):
        img = base.as_subclass(Image)[i : i + 10]
        img.source = f"{i}.jpg"
        return {"img": img, "label": i}

    with CacheLoader(path=tmp_path, dataset_name="sub") as loader:
        first = loader.get(3, sample)
        loader.flush()
        assert len(loader.store.get(loader.key(3))) < 400  # was 4,000,576
    with CacheLoader(path=tmp_path, dataset_name="sub") as again:

        def never(key):
            raise AssertionError(f"recomputed key {key}")

        out = again.get(3, never)
        (batched,) = again.get_many([3], never)
        stats = again.stats(this_process=True)
    assert (stats["hits"], stats["misses"], stats["corrupt"]) == (2, 0, 0)
    for got in (out, batched):
        img = got["img"]
        assert type(img) is Image and img.source == "3.jpg" and got["label"] == 3
        assert torch.equal(plain(img), plain(first["img"])) and storage_bytes(img) == 40


# -- tensors of more dimensions than numpy arrays have ----------------------------------------------


@pytest.mark.parametrize("ndim", [MAX_NDIM, MAX_NDIM + 1, 70, 200])
def test_tensors_of_many_dimensions_round_trip(ndim):
    t = torch.arange(6, dtype=torch.float64).reshape([1] * (ndim - 2) + [2, 3])
    b = encode(t)
    # Up to numpy's limit a raw tensor node; beyond it pickled as its flat data, still raw.
    assert b[32] == (T_TENSOR if ndim <= MAX_NDIM else T_PICKLE)
    assert len(b) < 200 + 8 * ndim  # the shape (8 bytes a dimension in a raw node) and 48 bytes of data
    out = decode(b)  # was CodecError "an array with 65 dimensions" beyond 64
    assert type(out) is torch.Tensor and out.shape == t.shape and torch.equal(out, t)
    out.fill_(1)  # writable, its own memory
    assert t.flatten()[0] == 0


def test_many_dimensional_views_dtypes_and_containers():
    nd = MAX_NDIM + 2
    t = torch.arange(6.0).reshape([1] * (nd - 2) + [2, 3])
    view = t.transpose(-1, -2)  # non-contiguous
    big = torch.zeros(1_000_000)[:6].reshape([1] * (nd - 2) + [2, 3])  # a view of a 4 MB storage
    for x in (view, view.to(torch.bfloat16), Point(view, 1), [view]):
        out = decode(encode(x))
        got = out[0] if isinstance(out, (tuple, list)) else out
        want = x[0] if isinstance(x, (tuple, list)) else x
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert got.is_contiguous()
    assert len(encode(big)) < 600 and len(encode(Point(big, 1))) < 700
    assert decode(encode(torch.zeros([1] * nd + [0]))).shape == (1,) * nd + (0,)
    # A Parameter decodes as a plain tensor without requires_grad, as with fewer dimensions.
    out = decode(encode(torch.nn.Parameter(t.clone())))
    assert type(out) is torch.Tensor and not out.requires_grad and torch.equal(out, t)
    sub = view.as_subclass(Image)
    sub.source = "c.jpg"
    out = decode(encode(sub))
    assert type(out) is Image and out.source == "c.jpg" and torch.equal(plain(out), view)


def test_many_dimensional_tensors_are_hits_through_a_cache_loader(tmp_path):
    t = torch.arange(3.0).reshape([1] * 65 + [3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "did not decode ... recomputed and rewritten" would be a warning
        with CacheLoader(path=tmp_path, dataset_name="nd") as loader:
            for _ in range(3):
                out = loader.get(0, lambda k: t)
                assert torch.equal(out, t)
            (batched,) = loader.get_many([0], lambda k: t)
            stats = loader.stats()
    assert torch.equal(batched, t)
    # was hits 0, misses 3, corrupt 2: recomputed on every read as a damaged entry
    assert (stats["hits"], stats["misses"], stats["corrupt"], stats["writes"]) == (3, 1, 0, 1)


class OddState(torch.Tensor):
    def __getstate__(self):
        return ["no", "setstate", "to", "read", "this"]


def test_a_subclass_state_only_its_own_setstate_could_read_is_refused_when_encoding():
    # Refused by encode, never stored as a value that cannot decode (the cache would recompute it
    # on every read).
    with pytest.raises(
        CodecError, match="cannot serialize a value of type OddState: its __getstate__ returned a list"
    ):
        encode(torch.zeros(3).as_subclass(OddState))


def test_a_copyreg_registration_of_a_subclass_is_honoured(monkeypatch):
    """pickle asks reducer_override before copyreg's dispatch_table: the codec's reduction of tensor
    subclasses used to bypass the user's copyreg.pickle(cls, reducer)."""
    import copyreg

    monkeypatch.setitem(copyreg.dispatch_table, Registered, _registered_as_list)
    x = torch.arange(6.0)[1:4].as_subclass(Registered)
    assert decode(encode(x)) == [1.0, 2.0, 3.0]
    assert decode(encode({"x": x, "n": 1})) == {"x": [1.0, 2.0, 3.0], "n": 1}
