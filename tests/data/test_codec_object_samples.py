"""The sample codec on samples holding objects its tree cannot express (dataclasses, big ints, ...).

Such values used to be pickled one by one, each with its own pickler: a list of 2,000 small token
objects encoded in 9x the time of ``pickle.dumps`` and took 3x its size, and the same object twice
decoded as two objects. A sample holding any of them is now pickled once as a whole (tensors and arrays
inside still stored raw). What decodes is what decoded before, shared references apart; values written
the old way still decode.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import datetime
import decimal
import fractions
import pickle
import types
import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainloom.data import CacheLoader, _codec
from trainloom.data.codec import CodecError, decode, encode

T_DICT, T_PICKLE = 9, 13  # tag of the first node (byte 32 of an encoded value)
Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Tok:
    text: str
    start: int
    end: int


class Image(torch.Tensor):
    pass


class MyParam(torch.nn.Parameter):
    pass


def tokens(n: int) -> list:
    return [Tok(f"w{i}", i, i + 1) for i in range(n)]


def describe(v, seen=None):
    """A comparable picture of a decoded value: types, values, tensor kind, requires_grad, attributes,
    and which objects are the same object."""
    seen = {} if seen is None else seen
    if isinstance(v, (list, tuple, dict, torch.Tensor, np.ndarray, Tok)):
        if id(v) in seen:
            return ("same as", seen[id(v)])
        seen[id(v)] = len(seen)
    if isinstance(v, torch.Tensor):
        attrs = {k: describe(x, seen) for k, x in sorted(getattr(v, "__dict__", {}).items())}
        plain = v.as_subclass(torch.Tensor).detach()
        return (type(v), plain.dtype, tuple(plain.shape), plain.flatten().tolist(), v.requires_grad, attrs)
    if isinstance(v, np.ndarray):
        return (type(v), v.dtype, v.shape, v.tolist())
    if isinstance(v, (list, tuple)):  # namedtuples too
        return (type(v), [describe(x, seen) for x in v])
    if isinstance(v, dict):
        return (type(v), [(describe(k, seen), describe(x, seen)) for k, x in v.items()])
    if isinstance(v, Tok):
        return (Tok, v.text, v.start, describe(v.end, seen))
    if isinstance(v, types.SimpleNamespace):
        return (type(v), describe(vars(v), seen))
    return (type(v), v)


# -- one pickle for the whole sample -------------------------------------------------------------------


def test_a_sample_of_small_objects_is_pickled_once_with_its_arrays_raw():
    x = {"tokens": tokens(500), "img": torch.arange(4096, dtype=torch.uint8), "ids": np.arange(100)}
    b = encode(x)
    assert b[32] == T_PICKLE  # one pickled node (was a dict node holding 500 pickled nodes)
    # was 55,904 bytes: a pickler's header and class reference per token
    assert len(b) < len(pickle.dumps(x["tokens"], protocol=5)) + 4096 + 800 + 400
    out = decode(b)
    assert describe(out) == describe(x)
    # The tensor and the array are still raw data views of the decoded block, not torch's pickle.
    assert type(out["ids"].base).__name__ == "_Block"
    assert out["img"].numpy().base is not None and out["img"].is_contiguous()


def test_the_same_object_twice_decodes_as_one_object_twice():
    tok = Tok("a", 0, 1)
    shared = [tok, Tok("b", 1, 2)]
    out = decode(encode({"x": [tok, tok], "a": shared, "b": shared}))
    assert out["x"][0] is out["x"][1]  # was two equal objects
    assert out["a"] is out["b"] and out["a"][0] is out["x"][0]
    assert out["x"][0] == tok and out["a"] == shared


def test_tensors_and_arrays_are_still_stored_once_per_occurrence():
    t = torch.arange(1000)
    a = np.arange(1000)
    b = encode([t, t, a, a, Tok("a", 0, 1)])
    out = decode(b)
    assert b[32] == T_PICKLE and len(b) > 4 * 8000
    assert out[0] is not out[1] and out[2] is not out[3]
    assert torch.equal(out[0], t) and torch.equal(out[1], t) and np.array_equal(out[3], a)


class _CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_a_tensor_the_first_pass_made_contiguous_is_not_copied_again():
    img = torch.arange(3 * 8 * 8, dtype=torch.uint8).reshape(8, 8, 3).permute(2, 0, 1)  # HWC -> CHW
    x = {"image": img, "boxes": tokens(3)}
    with _CountCopies() as mode:
        b = encode(x)
    assert b[32] == T_PICKLE and mode.copies == 1  # 2 if the whole-sample pass copied it again
    assert torch.equal(decode(b)["image"], img)
    arr = np.arange(48).reshape(4, 12)[:, ::2]
    out = decode(encode({"a": arr, "b": tokens(1)}))
    assert np.array_equal(out["a"], arr) and out["a"].flags.c_contiguous


def test_an_array_pickled_after_an_out_of_band_buffer_decodes():
    """numpy pickles an array of a dtype the codec has no code for (big-endian, structured) with an
    out-of-band buffer; the persistent ids of the arrays after it were one too high (the buffer counted
    as an id), so the value did not decode: "bad persistent id 1". Whole-sample pickling puts such an
    array and the sample's other arrays in one pickle far more often."""
    odd = np.arange(3).astype(">i4")
    for x in (
        Pair(odd, np.arange(4)),
        {"odd": odd, "t": torch.arange(2), "a": np.arange(4), "tok": Tok("a", 0, 1)},
    ):
        assert describe(decode(encode(x))) == describe(x)


# -- what decodes is what decoded before -----------------------------------------------------------

_ATTR = torch.arange(2.0)
_ATTR.source = "img.jpg"
_IMAGE = torch.arange(4.0).as_subclass(Image)
_IMAGE.quality = 3
_NEXT_TO_A_PICKLED_LEAF = {
    "tensor subclass": _IMAGE,
    "tensor with attributes (dropped)": _ATTR,
    "lone surrogate": "img_\udcff.png",
    "int beyond 64 bits": 2**70,
    "65-dimension tensor": torch.arange(3.0).reshape([1] * 65 + [3]),
    "requires_grad tensor": torch.ones(2, requires_grad=True) * 2,
    "Parameter inside an object": types.SimpleNamespace(p=torch.nn.Parameter(torch.ones(2))),
    "Parameter subclass": MyParam(torch.ones(2)),
    "numpy scalar and odd arrays": [np.float32(1.5), np.arange(3).astype(">i4"), np.arange(4)[::2]],
    "a tensor after an out-of-band buffer": [np.arange(3).astype(">i4"), torch.arange(3), np.arange(2)],
}


@pytest.mark.parametrize("name", list(_NEXT_TO_A_PICKLED_LEAF))
@pytest.mark.parametrize("where", ["before", "after"])
def test_values_next_to_a_pickled_leaf_decode_as_with_per_leaf_pickling(name, where):
    v = _NEXT_TO_A_PICKLED_LEAF[name]
    x = [Tok("z", 0, 1), {"v": v}] if where == "after" else [{"v": v}, Tok("z", 0, 1)]
    b = encode(x)
    assert b[32] == T_PICKLE
    assert describe(decode(b)) == describe(decode(_codec._encode_per_leaf(x)))


def test_a_parameter_in_the_tree_keeps_the_per_leaf_encoding():
    """The tree stores an nn.Parameter as a plain tensor; pickled whole it would decode as a Parameter,
    so a sample with one in its tuples/lists/dicts is encoded as before."""
    p = torch.nn.Parameter(torch.ones(2))
    for x in ({"p": p, "tok": Tok("a", 0, 1)}, {"tok": Tok("a", 0, 1), "p": [p]}):
        b = encode(x)
        assert b[32] == T_DICT and b == _codec._encode_per_leaf(x)
        out = decode(b)
        assert type(out["tok"]) is Tok
        q = out["p"][0] if isinstance(out["p"], list) else out["p"]
        assert type(q) is torch.Tensor and not q.requires_grad


def test_samples_without_such_values_are_encoded_exactly_as_before():
    for x in (
        {"img": torch.rand(3, 4, 4), "ids": list(range(20)), "name": "s1", "y": (1.5, None, b"b")},
        (np.arange(32, dtype=np.float32), np.arange(8)[::2], 7),
        [torch.nn.Parameter(torch.ones(2)), 2**63 - 1],
        Tok("top level", 0, 1),  # the whole sample: one pickled node, as always
    ):
        assert encode(x) == _codec._encode_per_leaf(x)


def _local_class_instance():
    class Local:
        pass

    return Local()


def _self_referencing_list():
    x: list = [1]
    x.append(x)
    return x


def _deep_list():
    deep: list = []
    cur = deep
    for _ in range(300):
        cur.append([])
        cur = cur[0]
    return deep


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: lambda v: v, "cannot serialize a value of type function: "),
        (_local_class_instance, "cannot serialize a value of type Local: "),
        (_self_referencing_list, "sample nested deeper than 200 levels"),
        (_deep_list, "sample nested deeper than 200 levels"),
        (lambda: torch.empty(2, device="meta"), "a tensor on the meta device holds no data"),
    ],
)
@pytest.mark.parametrize("where", ["before", "after"])
def test_errors_next_to_a_pickled_leaf_are_those_of_per_leaf_pickling(bad, message, where):
    """Pickling the whole sample fails ("a value of type dict") or would accept a self-referencing list;
    the codec then encodes leaf by leaf, which fails as it always did, naming the value's type."""
    v = bad()
    x = [Tok("z", 0, 1), {"v": v}] if where == "after" else [{"v": v}, Tok("z", 0, 1)]
    with pytest.raises(CodecError) as got:
        encode(x)
    with pytest.raises(_codec.CodecError) as per_leaf:
        _codec._encode_per_leaf(x)
    assert message in str(got.value) and str(got.value) == str(per_leaf.value)


class _TruncatedImage:
    """An object whose own pickling fails the way a lazily loaded image does (PIL reads the file in
    __getstate__)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def __getstate__(self):
        raise self.exc


@pytest.mark.parametrize(
    "exc",
    [OSError("image file is truncated"), IndexError("list index out of range"), KeyError("k")],
    ids=lambda e: type(e).__name__,
)
@pytest.mark.parametrize("where", ["alone", "in a dict", "next to a pickled leaf"])
def test_any_error_of_an_objects_own_pickling_is_a_codec_error_naming_its_type(exc, where):
    # OSError and IndexError escaped as themselves, from deep inside pickle (KeyError was caught).
    obj = _TruncatedImage(exc)
    sample = {
        "alone": obj,
        "in a dict": {"img": obj, "label": 3},
        "next to a pickled leaf": [Tok("a", 0, 1), obj],
    }
    with pytest.raises(CodecError) as got:
        encode(sample[where])
    assert str(got.value) == f"cannot serialize a value of type _TruncatedImage: {type(exc).__name__}: {exc}"
    assert got.value.__cause__.__cause__ is exc  # (codec.CodecError from _codec.CodecError from exc)


def test_the_cache_names_the_key_of_a_sample_whose_pickling_raises_oserror(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="e", flush_interval=None)
    with pytest.raises(CodecError) as got:
        loader.get(3, lambda i: {"img": _TruncatedImage(OSError("image file is truncated")), "label": i})
    assert str(got.value) == (
        "CacheLoader('e'): the value for key 3 cannot be serialized for the cache: cannot serialize a value "
        "of type _TruncatedImage: OSError: image file is truncated. Return tensors, numpy arrays, numbers, "
        "str, bytes or picklable objects."
    )
    loader.close()


# -- values written before still decode ------------------------------------------------------------


def _old_samples():
    return [
        {
            "frac": [fractions.Fraction(1, 3), fractions.Fraction(2, 5)],
            "t": torch.arange(4),
            "ns": types.SimpleNamespace(a=torch.ones(2), b="x"),
        },
        [2**70, "a\udcff", collections.OrderedDict(a=1), np.arange(3, dtype=np.int16)],
        (
            decimal.Decimal("1.5"),
            {"k": datetime.date(2020, 1, 2)},
            np.float32(1.5),
            types.SimpleNamespace(p=torch.nn.Parameter(torch.tensor([1.0, 2.0]))),
        ),
    ]


# _old_samples() encoded by trainloom at b5c1392, before whole-sample pickling: pickled nodes inside
# the tree (a dict, a list and a tuple node at the top).
_OLD_VALUES = [
    (
        "VExDARoBAABIAAAAAAAAAPGSzPBdksXuAAAAAAAAAAAJAwAAAAAAAAAFBAAAAAAAAABmcmFjCAIAAAAAAAAADQAAAAAtAAAAAAAA"
        "AIAFlSIAAAAAAAAAjAlmcmFjdGlvbnOUjAhGcmFjdGlvbpSTlEsBSwOGlFKULg0AAAAALQAAAAAAAACABZUiAAAAAAAAAIwJZnJh"
        "Y3Rpb25zlIwIRnJhY3Rpb26Uk5RLAksFhpRSlC4FAQAAAAAAAAB0CwUBBAAAAAAAAAAAAAAAAAAAAAUCAAAAAAAAAG5zDQEAAAAB"
        "BwECAAAAAAAAAEAAAAAAAAAAPwAAAAAAAACABZU0AAAAAAAAAIwFdHlwZXOUjA9TaW1wbGVOYW1lc3BhY2WUk5QpUpR9lCiMAWGU"
        "SwBRjAFilIwBeJR1Yi4AAAAAAAAAAAAAAAAAAAEAAAAAAAAAAgAAAAAAAAADAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        "AAAAAAAAAAAAAACAPwAAgD8="
    ),
    (
        "VExDAaEAAAAGAAAAAAAAAKrRZZ3JHrgNAAAAAAAAAAAIBAAAAAAAAAANAAAAABcAAAAAAAAAgAWVDAAAAAAAAACKCQAAAAAAAAAA"
        "QC4NAAAAABMAAAAAAAAAgAWVCAAAAAAAAACMBGHts7+ULg0AAAAANAAAAAAAAACABZUpAAAAAAAAAIwLY29sbGVjdGlvbnOUjAtP"
        "cmRlcmVkRGljdJSTlClSlIwBYZRLAXMuCgMBAwAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAQACAA=="
    ),
    (
        "VExDATUBAAAIAAAAAAAAAA8Z347GjxrNAAAAAAAAAAAHBAAAAAAAAAANAAAAACwAAAAAAAAAgAWVIQAAAAAAAACMB2RlY2ltYWyU"
        "jAdEZWNpbWFslJOUjAMxLjWUhZRSlC4JAQAAAAAAAAAFAQAAAAAAAABrDQAAAAArAAAAAAAAAIAFlSAAAAAAAAAAjAhkYXRldGlt"
        "ZZSMBGRhdGWUk5RDBAfkAQKUhZRSlC4MBwAAwD8NAQAAAAEHAQIAAAAAAAAAAAAAAAAAAACCAAAAAAAAAIAFlXcAAAAAAAAAjAV0"
        "eXBlc5SMD1NpbXBsZU5hbWVzcGFjZZSTlClSlH2UjAFwlIwMdG9yY2guX3V0aWxzlIwSX3JlYnVpbGRfcGFyYW1ldGVylJOUSwBR"
        "iIwLY29sbGVjdGlvbnOUjAtPcmRlcmVkRGljdJSTlClSlIeUUpRzYi4AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        "AAAAAAAAAAAAAACAPwAAAEA="
    ),
]


@pytest.mark.parametrize("i", range(3))
def test_values_written_with_per_leaf_pickling_still_decode(i):
    old = base64.b64decode(_OLD_VALUES[i])
    expected = _old_samples()[i]
    assert old[32] in (7, 8, 9)  # a tuple, list or dict node holding pickled nodes
    assert describe(decode(old)) == describe(expected)
    if i < 2:  # (the third pickles an nn.Parameter: its bytes follow torch's own reduction)
        # the old writer, kept as the fallback: the same bytes apart from the format byte of the
        # magic and the checksum (format 2's checksum keys each stripe by its place)
        again = _codec._encode_per_leaf(expected)
        assert again[:4] == b"TLC\x02" and old[:4] == b"TLC\x01"
        assert again[4:16] == old[4:16] and again[24:] == old[24:]
    new = encode(expected)
    assert new[32] == T_PICKLE and describe(decode(new)) == describe(expected)


# -- through the cache ---------------------------------------------------------------------------


def test_the_cache_keeps_parameters_and_tensor_attributes_next_to_objects(tmp_path):
    """The cache wraps Parameters and attribute-carrying tensors in a small pickled object; with the
    wrapper pickled in the same pickle as the sample's objects, hits still return them as the miss did."""
    p = torch.nn.Parameter(torch.ones(3))
    t = torch.arange(4.0)
    t.source = "a.jpg"
    tok = Tok("a", 0, 1)

    def compute(k):
        return {"p": p, "t": t, "toks": [tok, tok], "n": 2**70}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "did not decode ... recomputed and rewritten" would be a warning
        with CacheLoader(path=tmp_path, dataset_name="objs") as loader:
            outs = [loader.get(0, compute) for _ in range(2)]
            (batched,) = loader.get_many([0], compute)
            stats = loader.stats()
    assert (stats["hits"], stats["misses"], stats["corrupt"]) == (2, 1, 0)
    for out in outs[1:] + [batched]:
        assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
        assert torch.equal(out["p"].detach(), p.detach())
        assert out["t"].source == "a.jpg" and torch.equal(out["t"], t)
        assert out["toks"][0] == tok and out["toks"][0] is out["toks"][1] and out["n"] == 2**70
