"""The sample codec: one checksummed buffer per sample, tensors stored raw.

A sample is any nesting of ``tuple``, ``list`` and ``dict`` holding torch tensors, numpy arrays,
numpy scalars, ``int``, ``float``, ``bool``, ``None``, ``str`` and ``bytes``. :func:`encode` writes it
into one ``bytes`` value: a 32-byte header, a small metadata section describing the tree, and the raw
C-contiguous bytes of every array (only the elements a view covers, never its whole storage).
Anything else is pickled with protocol 5, but tensors and arrays inside such objects are still
pulled out and stored raw, so tensors never go through pickle. A sample holding such objects (a list of
dataclass tokens or boxes, a big int, a tensor subclass) is pickled as a whole, once: one pickler
for all of them, which takes about the time and size of ``pickle.dumps`` for the objects, and an object
the sample holds twice decodes as one object twice, as with ``pickle``; plain tensors and arrays of a
dtype the codec has a code for are still stored once per occurrence and decode as separate tensors
(those pickle handles itself, such as tensor subclasses, sparse tensors and big-endian or structured
arrays, keep their sharing on this path, as with ``pickle``). A sample with an ``nn.Parameter`` in its
tuples/lists/dicts has its objects pickled one by one instead, so that the Parameter still decodes as
a plain tensor. A tensor subclass (torchvision's
``tv_tensors``, ``class Image(torch.Tensor)``) is stored as its plain data, raw, plus its type and
attributes, and decodes as that type (``requires_grad`` is dropped as for plain tensors, except for
``nn.Parameter`` subclasses); one with its own ``__reduce_ex__`` is pickled by it from a compact copy of
the elements it views. Tensors of more dimensions than numpy arrays have (64) are stored as their flat
data, raw, plus their shape. Tensors of dtypes numpy lacks
(bfloat16, float8, float4, the bits types, complex32, the sub-byte ints) are stored as the integers of
their width, bit for bit. A ``str`` holding a lone surrogate (a file name ``os.listdir`` could not
decode) and nested tensors are pickled; meta tensors, which hold no data, raise :class:`CodecError`.

:func:`decode` verifies the checksum, then copies the array bytes once into a fresh buffer (fused
with the checksum pass) and returns tensors/arrays that view it. A damaged value raises
:class:`ChecksumError`; the cache counts it and recomputes the sample.

Example::

    >>> from trainloom.data.codec import decode, encode
    >>> x = (torch.arange(3), {"label": 7})
    >>> decode(encode(x))
    (tensor([0, 1, 2]), {'label': 7})
"""

from __future__ import annotations

from typing import Any, Union

from trainloom._build_check import import_compiled
from trainloom.errors import TrainloomError

_codec = import_compiled("trainloom.data._codec")

__all__ = [
    "encode",
    "decode",
    "checksum",
    "hash64",
    "is_encoded",
    "set_decode_threads",
    "get_decode_threads",
    "CodecError",
    "ChecksumError",
]

BytesLike = Union[bytes, bytearray, memoryview]


class CodecError(TrainloomError, ValueError):
    """A sample cannot be encoded, or a buffer is not a valid encoded value."""


class ChecksumError(CodecError):
    """An encoded value is damaged (its checksum does not match); it is never returned as a sample."""


def encode(obj: Any) -> bytes:
    """Encode a sample into one checksummed ``bytes`` value.

    Args:
        obj: the sample (see the module docstring for what is stored natively).

    Returns:
        The encoded value.

    Raises:
        CodecError: the sample (or something inside it) cannot be serialized, e.g. a lambda or an
            open file, or it nests more than 200 levels deep.

    Example::

        >>> len(encode(torch.zeros(10, dtype=torch.uint8)))  # 32 header + 19 metadata, pad to 64, + 10
        74
    """
    try:
        return _codec.encode(obj)
    except _codec.CodecError as exc:
        raise CodecError(str(exc)) from exc


def decode(buf: BytesLike, copy: bool = True) -> Any:
    """Decode a value produced by :func:`encode`.

    Args:
        buf: the encoded value (any bytes-like object; read only inside this call when ``copy``).
        copy: ``True`` (default) copies the array bytes once into a new buffer, so ``buf`` may be
            released or reused afterwards (required for LMDB buffers). ``False`` with a writable
            ``buf`` (a ``bytearray``) returns arrays that view ``buf`` itself, with no copy at all.

    Returns:
        The sample, with tensors and arrays writable; except an array pickle handles itself (a dtype
        the codec has no code for, e.g. big-endian ``>i4`` or structured) that was read-only when
        encoded, which decodes read-only as pickle returns it (a cache hit then matches its miss).

    Raises:
        ChecksumError: the value is damaged.
        CodecError: ``buf`` is not an encoded value, or a pickled object in it cannot be unpickled
            any more (its class was renamed, ...), or it holds a tensor dtype this torch lacks.
    """
    try:
        return _codec.decode(buf, copy)
    except _codec.ChecksumError as exc:
        raise ChecksumError(str(exc)) from exc
    except _codec.CodecError as exc:
        raise CodecError(str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise CodecError(f"encoded value is malformed (bad UTF-8 in a string: {exc})") from exc


def checksum(buf: BytesLike, seed: int = 0, version: int = 2) -> int:
    """The 64-bit checksum the codec stores (SSE2/AVX2 multiply-accumulate lanes + XXH64 finish).

    ``version=1``: the checksum of values of format 1 (magic ``b"TLC\\x01"``), which mixed every
    64-byte stripe with the same key, so that stripes swapped within 1 KiB went unnoticed; such
    values are still read, and new values are written in format 2."""
    return _codec.checksum(buf, seed, version)


def hash64(data: Union[str, BytesLike], seed: int = 0) -> int:
    """XXH64 of ``data`` (a str is hashed as UTF-8): stable across processes, runs and machines.

    Example::

        >>> hex(hash64(b"abc"))
        '0x44bc2cf5ad770999'
    """
    return _codec.hash64(data, seed)


def is_encoded(buf: BytesLike) -> bool:
    """Whether ``buf`` starts with the codec's magic (cheap; does not verify the checksum)."""
    return bool(_codec.is_encoded(buf))


def set_decode_threads(n: int) -> int:
    """Set how many threads decode one batch of cached samples (``CachedDataset.__getitems__``).

    Decoding a batch of large samples (images) is bound by memory bandwidth, which one core does not
    saturate: the checksum+copy passes of the batch's values of 64 KiB or more run on up to ``n``
    threads once the batch holds at least 1 MiB of them. Smaller batches and small samples are decoded
    on the calling thread only.

    Args:
        n: number of threads, the calling one included; ``0`` (the default) follows
            ``torch.get_num_threads()``, which torch sets to 1 inside DataLoader workers, so workers
            never oversubscribe the cores. ``1`` turns the threads off.

    Returns:
        The previous setting.

    Raises:
        ValueError: ``n`` is negative.

    Example::

        >>> old = set_decode_threads(1)   # decode on the calling thread only
        >>> set_decode_threads(old)
        1
    """
    return int(_codec.set_decode_threads(n))


def get_decode_threads() -> int:
    """The setting of :func:`set_decode_threads` (``0``: follow ``torch.get_num_threads()``)."""
    return int(_codec.get_decode_threads())
