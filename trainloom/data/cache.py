"""``CacheLoader`` and ``CachedDataset``: compute each sample once, read it back fast afterwards.

Values are encoded with :mod:`trainloom.data.codec` (checksummed, tensors raw) and kept in a
key-value store: :class:`~trainloom.data.stores.LmdbStore` (embedded, the default) or
:class:`~trainloom.data.stores.RedisStore` (shared by every node). The API is Bagua's
(``bagua.torch_api.contrib.CacheLoader`` / ``CachedDataset``): a Bagua user changes the import; the
default backend is ``"lmdb"`` instead of ``"redis"``, so it works with no server at all.

What is guaranteed:

* nothing computed is lost: buffered writes are flushed when the buffer is full, on :meth:`flush`,
  :meth:`close`, at interpreter exit and when a DataLoader worker process stops (through
  ``multiprocessing.util.Finalize``, which runs in forked, spawned and forkserver workers, where
  ``atexit`` does not);
* a buffered value waits at most ``flush_interval`` seconds (default 1) before a background thread of
  its process writes it, so the other processes (DataLoader workers, persistent or not) read it
  instead of computing it again, also when this process stops computing (a persistent worker
  between epochs, a process that only reads from then on);
* a damaged value is detected by its checksum, counted (``stats()["corrupt"]``) and recomputed;
  so is any value that no longer decodes (e.g. a pickled class that was renamed since);
* a stored ``None`` is a hit like any other value;
* two loaders open in one process never share a namespace with different fingerprints
  (:class:`~trainloom.errors.ConfigError`), and a persistent cache reused without a fingerprint warns;
* a closed loader raises :class:`CacheClosedError` instead of silently reopening its store;
* a failing store raises :class:`~trainloom.errors.StoreError`, or with ``on_error="bypass"`` is
  skipped with one warning, counted, and retried every ``retry_interval`` seconds while writes wait
  in a buffer bounded by ``max_buffer_bytes``;
* Redis running out of memory stops new writes with one warning (``stats()["oom"]``).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import inspect
import logging
import multiprocessing.util
import operator
import os
import shlex
import struct
import sys
import threading
import time
import urllib.parse
import warnings
import weakref
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from trainloom._build_check import import_compiled
from trainloom._numbers import is_integral, is_real
from trainloom._warnings import log_if_configured, warn_at_caller
from trainloom.data.codec import ChecksumError, CodecError
from trainloom.data.shared_counters import SharedCounters
from trainloom.data.stores.base import (
    Key,
    Store,
    StoreError,
    StoreFullError,
    StoreOutOfMemoryError,
    StoreUnavailableError,
    StoreValueRefusedError,
    as_bytes,
    mget_decode_missing,
)
from trainloom.errors import ConfigError

_codec = import_compiled("trainloom.data._codec")

__all__ = [
    "CacheLoader",
    "CachedDataset",
    "CacheClosedError",
    "CodecError",
    "ChecksumError",
    "make_store",
    "fingerprint_digest",
]

log = logging.getLogger("trainloom.data")

#: Key of the entry holding a namespace's fingerprint (cannot collide: cache keys never start with NUL).
META_KEY = b"\x00trainloom-meta"
#: Markers in the list of values read: no entry in the store; an entry that does not decode. (A decoded
#: ``None`` is a stored None, a hit.)
_MISSING = object()
_UNDECODABLE = object()
#: What _decode_one returns for a stored None (mget_apply reports absent keys as None).
_STORED_NONE = object()
#: The type of a cached value (what load_fn returns).
_V = TypeVar("_V")
#: Serialises the store calls of the loaders of this process with their background flushes: LMDB must
#: not resize its map (which a write may do) while another thread of the process is inside a
#: transaction, and a Store subclass is not assumed to be thread-safe. Reads take it only while such a
#: background flush thread is alive (``_flushers``); calls to Redis stores (thread-safe clients) never
#: take it, so a dead server never blocks the other loaders of the process.
_STORE_LOCK = threading.RLock()
_NO_LOCK = contextlib.nullcontext()
#: Background flush threads alive in this process whose store calls take _STORE_LOCK.
_flushers = 0
#: Buffers of loaders of this process garbage-collected without close(), waiting to be written by
#: _write_orphans at the start of the next public call of a loader (or by their exit handler). The
#: collector's finalizer only appends here (deque.append is atomic: no lock is taken inside the
#: collector, which may run in a thread holding any lock).
_ORPHANS: Deque[_Pending] = collections.deque()


def _after_fork_in_child() -> None:
    # The parent's flush threads do not exist in the child, and one of them may hold the lock. The
    # parent writes the buffers of its collected loaders itself (see _ORPHANS).
    global _STORE_LOCK, _flushers
    _STORE_LOCK = threading.RLock()
    _flushers = 0
    _ORPHANS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_STAT_NAMES = (
    "hits",
    "misses",
    "writes",
    "bytes_read",
    "bytes_written",
    "errors",
    "corrupt",
    "bypassed",
    "dropped",
    "oom",
    "flushes",
)
#: Gauges: this process's buffered values and their bytes now (summed over live processes only).
_GAUGE_NAMES = ("buffered", "buffered_bytes")
# Columns of a process's counter slot (column 0 is the pid; see shared_counters.py).
(
    _HITS,
    _MISSES,
    _WRITES,
    _BYTES_READ,
    _BYTES_WRITTEN,
    _ERRORS,
    _CORRUPT,
    _BYPASSED,
    _DROPPED,
    _OOM,
    _FLUSHES,
    _BUFFERED,
    _BUFFERED_BYTES,
) = range(1, 1 + len(_STAT_NAMES) + len(_GAUGE_NAMES))


class CacheClosedError(StoreError, ValueError):
    """A :class:`CacheLoader` (or the :class:`CachedDataset` over it) was used after :meth:`close`.

    A ``ValueError`` like I/O on a closed file, and a :class:`~trainloom.errors.StoreError`.
    """


def cached_values(store: Store) -> int:
    """The values cached in ``store``'s namespace: its entries without the fingerprint entry that
    CachedDataset and CacheLoader(fingerprint=...) keep there (one per shard of a Redis cluster)."""
    n = store.num_keys()
    return n - store.copies(META_KEY) if n else 0


def _redis_cli_target(h: Mapping[str, Any]) -> str:
    """``trainloom cache clear --redis``'s form of one server of a RedisStore: HOST:PORT, or a
    redis:// URL when it names a user or a db other than 0 (never the password: the CLI takes it
    from REDISCLI_AUTH or --password)."""
    host = str(h["host"])
    shown = f"[{host}]" if ":" in host else host
    user, db = h.get("username"), int(h.get("db") or 0)
    if not user and db == 0:
        return f"{shown}:{int(h['port'])}"
    userinfo = f"{urllib.parse.quote(str(user), safe='')}@" if user else ""
    return f"redis://{userinfo}{shown}:{int(h['port'])}" + (f"/{db}" if db else "")


def _short_repr(key: Any, limit: int = 80) -> str:
    r = repr(key)
    return r if len(r) <= limit else r[: limit - 3] + "..."


#: What ``fingerprint=`` accepts (compared by content, see :func:`fingerprint_digest`).
FINGERPRINT_TYPES = (
    "str, bytes, int, float, bool, None, tuples, lists and dicts of these, numpy arrays and scalars "
    "(not of dtype object) and torch tensors (strided)"
)
#: What a stored fingerprint starts with. v3: cache keys carry the fingerprint's tag (CacheLoader.key);
#: a namespace whose fingerprint is of an older version (v1: a repr, v2: a digest, both with untagged
#: keys) is dropped once.
_FP_V3 = b"trainloom-cache-v3|"
_FP_OLD = (b"trainloom-cache-v1|", b"trainloom-cache-v2|")
#: Hex digits of the fingerprint digest in each key (64 bits: two fingerprints of one namespace
#: collide with probability 2**-64).
_TAG_HEX = 16


def _fp_feed(h: Any, x: Any, where: str, depth: int) -> None:
    """Feed a canonical, type-tagged encoding of ``x`` into the hash ``h`` (TypeError on other types)."""
    if depth > 100:
        raise TypeError(f"fingerprint= nests more than 100 levels deep (at {where})")
    t = type(x)
    if x is None:
        h.update(b"N")
    elif t is bool:
        h.update(b"T" if x else b"F")
    elif t is int:
        b = x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True)
        h.update(b"i%d:" % len(b) + b)
    elif t is float:
        h.update(b"f" + struct.pack("<d", x))
    elif t is str:
        b = x.encode("utf-8", "surrogatepass")
        h.update(b"s%d:" % len(b) + b)
    elif t is bytes or t is bytearray:
        h.update(b"b%d:" % len(x) + bytes(x))
    elif t is tuple or t is list:
        h.update(b"%c%d:" % (ord("(") if t is tuple else ord("["), len(x)))
        for i, item in enumerate(x):
            _fp_feed(h, item, f"{where}[{i}]", depth + 1)
    elif t is dict:
        # Order-insensitive: the items sorted by the digest of their key.
        items = []
        for k, v in x.items():
            hk = hashlib.sha256()
            _fp_feed(hk, k, f"{where} key {_short_repr(k, 40)}", depth + 1)
            hv = hashlib.sha256()
            _fp_feed(hv, v, f"{where}[{_short_repr(k, 40)}]", depth + 1)
            items.append((hk.digest(), hv.digest()))
        h.update(b"{%d:" % len(items))
        for kd, vd in sorted(items):
            h.update(kd + vd)
    elif t is np.ndarray or isinstance(x, np.generic):
        a = np.ascontiguousarray(x)
        if a.dtype.hasobject:
            raise TypeError(
                f"fingerprint= does not accept numpy arrays of dtype object (at {where}): their bytes are "
                f"pointers; convert them, e.g. with .tolist() or .astype(str). It accepts {FINGERPRINT_TYPES}"
            )
        head = f"{'a' if t is np.ndarray else 'g'}{a.dtype.str}|{a.dtype!s}|{a.shape}:".encode()
        h.update(head)
        h.update(a.tobytes())
    elif t is torch.Tensor or t is torch.nn.Parameter:
        if x.layout is not torch.strided or x.is_quantized or x.is_nested or x.is_meta:
            raise TypeError(
                f"fingerprint= accepts strided tensors only, got a {x.layout} tensor (at {where}); "
                f"it accepts {FINGERPRINT_TYPES}"
            )
        c = x.detach().cpu().resolve_conj().resolve_neg().contiguous()
        h.update(f"t{c.dtype}|{tuple(c.shape)}:".encode())
        h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        raise TypeError(
            f"fingerprint= does not accept a {t.__module__}.{t.__qualname__} (at {where}): it is compared by "
            f"content and accepts {FINGERPRINT_TYPES}. Pass what describes the preprocessing, e.g. a version "
            "string or a tuple of its parameters (not a function or transform object, whose repr changes "
            "every run)"
        )


def _dataset_fingerprint_digest(length: int, user: Any) -> bytes:
    """:func:`fingerprint_digest` of ``("len", length, user)``, with errors naming ``user`` alone."""
    h = hashlib.sha256()
    h.update(b"(3:")
    _fp_feed(h, "len", "", 1)
    _fp_feed(h, length, "len(dataset)", 1)
    _fp_feed(h, user, "fingerprint", 0)  # depth 0: the same nesting limit as CacheLoader(fingerprint=)
    return _FP_V3 + h.hexdigest().encode("ascii")


def fingerprint_digest(fingerprint: Any) -> bytes:
    """The value stored as a namespace's fingerprint: a SHA-256 of ``fingerprint``'s content.

    Two fingerprints get the same digest exactly when they hold the same content: the same types and
    values for str/bytes/int/float/bool/None, the same items for tuples and lists, the same key/value
    pairs for dicts (in any order), the same dtype, shape and bytes for numpy arrays/scalars and
    tensors (whatever their size: no element is summarised).

    Raises:
        TypeError: ``fingerprint`` holds another type (named, with what is accepted).
    """
    h = hashlib.sha256()
    _fp_feed(h, fingerprint, "fingerprint", 0)
    return _FP_V3 + h.hexdigest().encode("ascii")


class _DatasetFingerprint:
    """The fingerprint CachedDataset gives its loader: ``("len", len(dataset), fingerprint)``."""

    __slots__ = ("length", "user", "owner")

    def __init__(self, length: int, user: Any, owner: str) -> None:
        self.length = length
        self.user = user
        self.owner = owner

    def value(self) -> tuple:
        return ("len", self.length, self.user)


# -- tensors with Python state ---------------------------------------------------------------------
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


#: How deep the codec encodes nested containers (MAX_DEPTH in pyx/data/_codec.pyx). The tensor-state
#: walks below go as deep, so a Parameter or a tensor with attributes the codec stores is also kept on
#: hits; anything deeper fails to encode anyway (CodecError).
_CODEC_MAX_DEPTH: int = _codec.CODEC_MAX_DEPTH
#: The types the tensor-state walk looks into (anything else is a leaf without tensor state).
_STATE_LOOK = frozenset((_Tensor, _Parameter, tuple, list, dict))


def _has_tensor_state(x: Any, depth: int = 0) -> bool:
    """Whether ``x`` (a sample) holds, in its tuples/lists/dicts, an ``nn.Parameter`` or a plain tensor
    with Python attributes, which the codec's raw tensor path would drop. (On the miss path of every
    sample: kept to one type test per item.)"""
    t = type(x)
    if t is tuple or t is list:
        items: Any = x
    elif t is dict:
        items = x.values()
    elif t is _Tensor:
        return bool(x.__dict__)
    else:
        return t is _Parameter
    if depth >= _CODEC_MAX_DEPTH:  # its items would be deeper than the codec encodes
        return False
    for item in items:
        ti = type(item)
        if ti in _STATE_LOOK:
            if ti is _Tensor:
                if item.__dict__:
                    return True
            elif _has_tensor_state(item, depth + 1):
                return True
    return False


class _TensorWithState:
    """Stands for a Parameter or a tensor with attributes while a sample is encoded: pickled (by the
    codec) as its plain data, still stored raw, plus its type and attributes."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> Any:
        x = self.tensor
        is_param = type(x) is _Parameter
        return (
            _rebuild_tensor_with_state,
            (is_param, x.detach(), is_param and x.requires_grad, dict(x.__dict__)),
        )


def _rebuild_tensor_with_state(is_param: bool, data: torch.Tensor, requires_grad: bool, state: dict) -> Any:
    """Decode side of :class:`_TensorWithState` (referenced by name in stored values: keep it here)."""
    out = _Parameter(data, requires_grad=requires_grad) if is_param else data
    out.__dict__.update(state)
    return out


def _wrap_tensor_state(x: Any, depth: int = 0) -> Any:
    """``x`` with every Parameter and tensor with attributes in its tuples/lists/dicts wrapped."""
    t = type(x)
    if t is _Parameter or (t is _Tensor and x.__dict__):
        return _TensorWithState(x)
    if depth >= _CODEC_MAX_DEPTH:
        return x
    if t is tuple or t is list:
        return t(_wrap_tensor_state(i, depth + 1) for i in x)
    if t is dict:
        return {k: _wrap_tensor_state(v, depth + 1) for k, v in x.items()}
    return x


# -- one namespace, one fingerprint per process ------------------------------------------------------
#: Loaders created in this process, by (store location, namespace): [(weakref to the loader, fingerprint
#: digest or None, description, pid)]. Entries of another pid (inherited through fork) are ignored.
_LIVE: Dict[Tuple[Any, ...], List[Tuple[Any, Optional[bytes], str, int]]] = {}
_LIVE_LOCK = threading.Lock()
#: Warnings given once per process ("unnamed", ("reuse", location)).
_PROCESS_WARNED: set = set()
#: Seconds between two looks (in one process, after a write) at how many keys the Redis servers evicted.
_EVICTION_CHECK_S = 5.0
#: Unnamed CachedDatasets of this process by store location: (weak reference, pid), for the warning
#: about two different datasets sharing the namespace '' (see CachedDataset._note_unnamed).
_UNNAMED: Dict[Tuple[Any, ...], List[Tuple[Any, int]]] = {}
#: Store locations opened by a CacheLoader of this process (or of its parent, before a fork): entries
#: found there later were not written by an earlier run.
_OPENED: set = set()


def _store_location(store: Store) -> Tuple[Any, ...]:
    """Where ``store`` keeps its data and which namespace it uses (loaders with the same location
    read and write the same entries)."""
    from trainloom.data.stores.cluster import ClusterStore
    from trainloom.data.stores.lmdb_store import LmdbStore

    if isinstance(store, LmdbStore):
        return ("lmdb", os.path.realpath(store.path), store.namespace)
    if isinstance(store, ClusterStore):
        return ("cluster", tuple(_store_location(s) for s in store.stores))
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if store.backend == "redis" and host is not None and port is not None:
        return ("redis", str(host), int(port), getattr(store, "db", 0), getattr(store, "namespace", None))
    return ("store", id(store), getattr(store, "namespace", None))


def _live_other(
    location: Tuple[Any, ...], digest: Optional[bytes], name: str
) -> Optional[Tuple[CacheLoader, str]]:
    """A loader of this process, open, on ``location`` with another ``dataset_name`` than ``name`` (only
    loaders over a Store instance can: the namespace of the others is their name), or with a
    fingerprint other than ``digest`` (when both have one)."""
    pid = os.getpid()
    with _LIVE_LOCK:
        entries = _LIVE.get(location, [])
        entries[:] = [e for e in entries if e[3] == pid and e[0]() is not None and not e[0]()._closed]
        for ref, d, desc, _ in entries:
            other = ref()
            if other is None:
                continue
            if other.dataset_name != name or (d is not None and digest is not None and d != digest):
                return other, desc
    return None


def _register_live(
    loader: CacheLoader, location: Tuple[Any, ...], digest: Optional[bytes], desc: str
) -> None:
    pid = os.getpid()
    with _LIVE_LOCK:
        entries = _LIVE.setdefault(location, [])
        entries[:] = [e for e in entries if e[3] == pid and e[0]() is not None]
        entries.append((weakref.ref(loader), digest, desc, pid))


def _unregister_live(loader: CacheLoader) -> None:
    with _LIVE_LOCK:
        for location in list(_LIVE):
            entries = [e for e in _LIVE[location] if e[0]() is not None and e[0]() is not loader]
            if entries:
                _LIVE[location] = entries
            else:
                del _LIVE[location]


def _warn_process_once(key: Any, message: str) -> None:
    if key not in _PROCESS_WARNED:
        _PROCESS_WARNED.add(key)
        warn_at_caller(message, RuntimeWarning, __file__, log)


def make_store(backend: Any, namespace: str, **store_kwargs: Any) -> Store:
    """Build the store for ``backend`` ("lmdb", "redis" or a :class:`Store` instance)."""
    if isinstance(backend, Store):
        if store_kwargs:
            raise ValueError(f"store arguments {sorted(store_kwargs)} cannot be used with a Store instance")
        return backend
    cls: Any
    if backend == "lmdb":
        from trainloom.data.stores.lmdb_store import LmdbStore as cls
    elif backend == "redis":
        from trainloom.data.stores.redis_store import RedisStore as cls
    else:
        raise ValueError(
            f"unknown cache backend {backend!r}: use 'lmdb', 'redis' or a trainloom Store instance"
        )
    # Name the caller's arguments, not the store class's __init__ (e.g. early Bagua's key_prefix=).
    params = inspect.signature(cls).parameters
    accepted = [n for n, q in params.items() if n != "namespace" and q.kind is not q.VAR_KEYWORD]
    unknown = sorted(set(store_kwargs) - set(accepted))
    if unknown and not any(q.kind is q.VAR_KEYWORD for q in params.values()):
        raise TypeError(
            f"unexpected keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"for backend={backend!r}; its store takes {', '.join(accepted)}"
        )
    return cls(namespace=namespace, **store_kwargs)


#: Errors a store raises when it cannot take any write now (not only the value at hand).
_STORE_WIDE = (StoreUnavailableError, StoreOutOfMemoryError, StoreFullError)


class _Pending:
    """The values one loader buffered in one process, and what writing them needs (the store, the lock,
    the counters), kept apart from the loader: the exit handler and :func:`_write_orphans` write them
    without referencing the loader, so a loader dropped without :meth:`CacheLoader.close` is collected
    (flush_interval=None leaves no thread to keep it alive) and its values are written afterwards."""

    __slots__ = (
        "buffer",
        "nbytes",
        "lock",
        "store",
        "stats",
        "name",
        "pid",
        "serialized",
        "timer_error",
        "at_exit",
        "at_gc",
    )

    def __init__(self, store: Store, stats: Any, name: str, serialized: bool) -> None:
        self.buffer: Dict[bytes, bytes] = {}
        self.nbytes = 0
        self.lock = threading.RLock()
        self.store = store
        #: This process's counter slot (a memoryview; see SharedCounters).
        self.stats = stats
        self.name = name
        self.pid = os.getpid()
        self.serialized = serialized
        #: The error of a failed background flush, raised by the loader's next call (logged at exit).
        self.timer_error: Optional[Exception] = None
        #: multiprocessing.util.Finalize writing the buffer at exit (made by the first buffered value).
        self.at_exit: Optional[multiprocessing.util.Finalize] = None
        #: weakref.finalize on the loader: queues the buffer in _ORPHANS when the loader is collected.
        self.at_gc: Optional[weakref.finalize] = None

    def cancel(self) -> None:
        """Unregister both handlers (the loader was closed, or collected and its buffer written)."""
        at_exit, self.at_exit = self.at_exit, None
        at_gc, self.at_gc = self.at_gc, None
        if at_exit is not None:
            at_exit.cancel()  # drops its entry from multiprocessing.util._finalizer_registry
        if at_gc is not None:
            at_gc.detach()


def _known_refusal(exc: BaseException, items: Mapping[bytes, Any]) -> Optional[List[bytes]]:
    """The keys of ``items`` the store refused, when ``exc`` names them all and says that every other
    value of ``items`` was written (LmdbStore at max_map_size); else None (the caller then writes the
    values one by one to find out)."""
    if not isinstance(exc, StoreValueRefusedError) or not exc.accounts_for_batch:
        return None
    keys = list(dict.fromkeys(exc.keys or ()))
    if not keys or any(k not in items for k in keys):
        return None
    return keys


def _write_each(
    store: Store, items: Mapping[bytes, bytes], first: Exception
) -> Tuple[List[bytes], Dict[bytes, Exception], Optional[Exception]]:
    """After ``store.mset(items)`` raised ``first``: write what can be written, value by value, so
    that one value the store refuses loses only itself. The caller holds the store lock.

    Returns the keys written, the error of each value the store refused, and the store-wide error
    (unreachable, full, out of memory) that stopped the writing, if one did: the keys after it are in
    neither. When ``first`` names every refused value and says all the others were written
    (LmdbStore at max_map_size), nothing is written again; a store-wide ``first`` stops at once (the
    keys written are those a StoreFullError names in ``written``: LmdbStore filling up part-way); a
    batch of one value that the store refused is not tried again."""
    known = _known_refusal(first, items)
    if known is not None:
        refused = dict.fromkeys(known, first)
        return [k for k in items if k not in refused], refused, None
    if isinstance(first, _STORE_WIDE):
        stored = set(getattr(first, "written", None) or ())
        return [k for k in items if k in stored], {}, first
    if len(items) == 1 and isinstance(first, (StoreValueRefusedError, ConfigError)):
        return [], dict.fromkeys(items, first), None
    written: List[bytes] = []
    refused = {}
    for k, v in items.items():
        try:
            store.mset({k: v})
        except (StoreError, ConfigError) as exc:  # ConfigError: a key the store refuses
            if isinstance(exc, _STORE_WIDE):
                return written, refused, exc
            refused[k] = exc
        else:
            written.append(k)
    return written, refused, None


def _write_items(p: _Pending, items: Dict[bytes, bytes]) -> Tuple[List[bytes], Dict[bytes, Exception]]:
    """Write ``items`` to ``p``'s store for :func:`_flush_pending`: the keys written, and the error of
    each value that could not be (:func:`_write_each`; after a store-wide failure, that error for
    every value not written)."""
    with _STORE_LOCK if p.serialized else _NO_LOCK:
        try:
            p.store.mset(cast(Mapping[Key, bytes], items))
        except (StoreError, ConfigError) as exc:  # ConfigError: a key the store refuses
            written, failed, wide = _write_each(p.store, items, exc)
            if wide is not None:
                done = set(written)
                failed.update((k, wide) for k in items if k not in done and k not in failed)
            return written, failed
    return list(items), {}


def _flush_pending(p: _Pending, when: str) -> None:
    """Write what ``p`` holds, without its loader (at exit, or for a loader collected without close()):
    nobody is left to raise to, so failures are logged; values that cannot be written are dropped and
    counted, whatever the store raised (an exception that is not a StoreError, e.g. a bug in a Store
    subclass, with its traceback)."""
    if p.pid != os.getpid():  # inherited through fork: the parent writes its own buffer
        return
    with p.lock:
        err, p.timer_error = p.timer_error, None
        if err is not None:
            log.error("CacheLoader(%r): a background flush failed: %s", p.name, err)
        items = p.buffer
        stats = p.stats
        if not items:
            stats[_BUFFERED] = stats[_BUFFERED_BYTES] = 0
            return
        try:
            written, failed = _write_items(p, items)
        except Exception:  # noqa: BLE001 - nobody to raise to: logged with its traceback and counted
            # (A BaseException such as KeyboardInterrupt leaves the buffer as it is: the exit handler,
            # still registered, writes it.)
            p.buffer, p.nbytes = {}, 0
            stats[_BUFFERED] = stats[_BUFFERED_BYTES] = 0
            stats[_DROPPED] += len(items)
            stats[_ERRORS] += 1
            log.exception(
                "CacheLoader(%r): could not write %d buffered value(s) %s (not cached; computed again when "
                "next read): the store raised an unexpected error",
                p.name,
                len(items),
                when,
            )
            return
        p.buffer, p.nbytes = {}, 0
        if written:
            stats[_WRITES] += len(written)
            stats[_BYTES_WRITTEN] += sum(len(items[k]) for k in written)
            stats[_FLUSHES] += 1
        stats[_BUFFERED] = stats[_BUFFERED_BYTES] = 0
        if failed:
            stats[_DROPPED] += len(failed)
            stats[_ERRORS] += 1
            k0, e0 = next(iter(failed.items()))
            log.error(
                "CacheLoader(%r): could not write %d of %d buffered value(s) %s (not cached; computed again "
                "when next read): key %s: %s",
                p.name,
                len(failed),
                len(items),
                when,
                _short_repr(k0),
                e0,
            )


#: The counter tables of this process's live loaders (with their flush_interval): at exit, the
#: workers they reach get time to write what they hold (_await_workers_flush).
_AWAITED: weakref.WeakKeyDictionary[SharedCounters, float] = weakref.WeakKeyDictionary()
_AWAIT_PID = 0


def _await_at_exit(counters: SharedCounters, flush_interval: float) -> None:
    global _AWAIT_PID
    _AWAITED[counters] = flush_interval
    if _AWAIT_PID != os.getpid():  # once per process (a forked child registers its own)
        _AWAIT_PID = os.getpid()
        # exitpriority 10: multiprocessing runs it before it terminates daemonic children.
        multiprocessing.util.Finalize(None, _await_workers_flush, args=(_AWAIT_PID,), exitpriority=10)


def _await_workers_flush(owner: int) -> None:
    """At exit: wait (at most the longest ``flush_interval`` + 1 s) until the other live processes
    of this process's loaders, their DataLoader workers, hold no buffered value. Their flush threads
    write within ``flush_interval``; multiprocessing then terminates daemonic workers (persistent
    ones, or any whose iterator is still referenced) with SIGTERM, which lost what they held."""
    if os.getpid() != owner:
        return
    tables = list(_AWAITED.items())
    if not tables:
        return
    deadline = time.monotonic() + max(f for _, f in tables) + 1.0
    while True:
        others = 0
        for counters, _ in tables:
            totals, _ = counters.total()
            others += totals["buffered"] - counters.local()["buffered"]
        if others <= 0:
            return
        if time.monotonic() >= deadline:
            log.warning(
                "%d value(s) buffered in DataLoader workers were not written before exit (not cached; "
                "computed again next run)",
                others,
            )
            return
        time.sleep(0.02)


def _flush_at_exit(p: _Pending) -> None:
    _flush_pending(p, "at exit")


def _orphaned(p: _Pending) -> None:
    """The loader owning ``p`` was garbage-collected without close() (weakref.finalize).

    No store I/O here: the cyclic collector runs at whatever allocation crosses its threshold, which
    may be inside a store call of another loader of this thread (``_STORE_LOCK`` is reentrant, so it
    does not keep that out): an LMDB write growing the map there would unmap the buffers of an open
    read transaction (a segfault), and LMDB refuses a write transaction nested in another one. The
    buffer is only queued; :func:`_write_orphans` writes it at the next safe point, and its exit handler
    stays registered until then."""
    p.at_gc = None
    _ORPHANS.append(p)


def _write_orphans() -> None:
    """Write the buffers of this process's loaders garbage-collected without close() (:func:`_orphaned`)
    and unregister their exit handlers.

    Called at the start of the public calls of :class:`CacheLoader` and :class:`CachedDataset` (and at
    construction), outside any store transaction and loader lock. Never raises into that caller, whose
    loader is another one: each failure is logged (one line per buffer) and its values counted as
    dropped in their own loader's counters."""
    while True:
        try:
            p = _ORPHANS.popleft()
        except IndexError:
            return
        _flush_pending(p, "left by a CacheLoader garbage-collected without close()")
        p.cancel()


class _FlushThread(threading.Thread):
    """Writes a loader's buffered values once they have waited ``flush_interval`` seconds.

    Started by the process that owns the buffer when the buffer holds values and no such thread runs
    (never inherited: a forked child starts its own); it ends as soon as the buffer is empty, the
    loader is closed or :meth:`stop` is called. It keeps the loader alive until then, so values
    buffered by a loader nobody references any more are still written.
    """

    def __init__(self, loader: CacheLoader, delay: float) -> None:
        super().__init__(name=f"trainloom-cache-flush[{loader.dataset_name}]", daemon=True)
        self.loader: Optional[CacheLoader] = loader
        self.delay = delay
        self.stopped = threading.Event()
        #: Counted in _flushers (its loader's store calls take _STORE_LOCK).
        self.counted = False

    def stop(self) -> None:
        """Ask the thread to end (it does at once unless it is writing)."""
        self.stopped.set()

    def run(self) -> None:
        global _flushers
        try:
            delay: Optional[float] = self.delay
            while delay is not None and not self.stopped.wait(delay) and self.loader is not None:
                delay = self.loader._background_flush(self)
        finally:
            self.loader = None
            if self.counted:
                with _STORE_LOCK:
                    _flushers -= 1


class CacheLoader:
    """Caches values computed by an expensive function under their keys.

    Values are stored under ``"{dataset_name}_{key}"`` in the store's namespace ``dataset_name``, so
    loaders with different ``dataset_name`` never see each other's entries (even for names like
    ``"a"`` + key ``"b_1"`` and ``"a_b"`` + key ``"1"``).

    A loader over a :class:`~trainloom.data.stores.Store` instance owns that store's whole namespace
    (the store's own ``namespace=``): ``dataset_name`` then only prefixes the keys, while
    :meth:`clear`, :meth:`num_keys` and the fingerprint entry act on the whole namespace. A Store
    instance therefore holds one dataset: give each dataset its own store namespace, e.g.
    ``LmdbStore(path, namespace="val")``. Opening a second loader with another ``dataset_name`` on
    that namespace while the first is open raises :class:`~trainloom.errors.ConfigError`; a namespace
    used by several names one after the other cannot be checked cheaply (the :meth:`clear` of one
    deletes the others' entries, and a different fingerprint drops them).

    Args:
        backend: ``"lmdb"`` (default, embedded), ``"redis"``, or a :class:`~trainloom.data.stores.Store`.
        dataset_name: name of the dataset; the store namespace and the key prefix.
        writer_buffer_size: number of computed values collected before one batched write.
        fingerprint: optional description of how values are computed (dataset version,
            preprocessing parameters, file list): str, bytes, int, float, bool, None, tuples, lists
            and dicts of these, numpy arrays/scalars and tensors, compared by content (see
            :func:`fingerprint_digest`; other types raise ``TypeError``). When it differs from the one
            stored with the namespace, the stale entries are dropped once, at construction. Without
            it, a persistent (LMDB) cache that already holds entries of an earlier run is reused as
            is, with one warning per process.
        on_error: ``"raise"`` (default): a failing store raises :class:`~trainloom.errors.StoreError`.
            ``"bypass"``: warn once, count the error, serve misses (compute with ``load_fn``) and
            retry the store after ``retry_interval`` seconds; writes wait in a buffer of at most
            ``max_buffer_bytes`` (the oldest are dropped and counted beyond that).
        max_buffer_bytes: bound of the write buffer (default 64 MiB): reaching it flushes early, and
            while the store is down (bypass mode) the oldest buffered values are dropped beyond it.
        retry_interval: seconds between attempts to use a failed store in bypass mode.
        flush_interval: the longest a computed value waits in the write buffer, in seconds (default
            1.0): a daemon thread of the process that buffered it then writes it, so other processes
            (DataLoader workers) read it instead of computing it again even when this process stops
            computing (a persistent worker between epochs). The thread exists only while the buffer
            holds values. A failed background write follows ``on_error``: with ``"raise"`` the error
            is raised by the next call of this process; with ``"bypass"`` it warns once and the
            write is retried every ``retry_interval`` seconds. ``None`` or ``0``: values wait until
            the buffer is full, :meth:`flush`, :meth:`close` or the process exits.
        **store_kwargs: passed to the store (``path=``, ``map_size=`` for LMDB; ``hosts=``,
            ``cluster_mode=``, ``capacity_per_node=`` for Redis).

    Raises:
        ConfigError: another loader of this process, still open, uses the same store and namespace
            with a different fingerprint (it would drop this one's entries or the reverse, and both
            would read each other's values): pass distinct ``dataset_name`` values, or close it first.
            Over a Store instance's namespace: another open loader has another ``dataset_name`` or
            fingerprint (give each dataset its own store namespace).
        TypeError: ``fingerprint`` holds a type that cannot be compared by content.

    With the persistent LMDB store, an empty ``dataset_name`` (Bagua's default) warns once per process.

    Example::

        >>> loader = CacheLoader(path=tmp_path / "cache", dataset_name="squares")
        >>> loader.get(3, lambda k: k * k)   # computed and stored
        9
        >>> loader.get(3, lambda k: -1)      # read from the cache
        9
    """

    def __init__(
        self,
        backend: Any = "lmdb",
        dataset_name: str = "",
        writer_buffer_size: int = 1,
        *,
        fingerprint: Any = None,
        on_error: str = "raise",
        max_buffer_bytes: int = 64 << 20,
        retry_interval: float = 5.0,
        flush_interval: Optional[float] = 1.0,
        **store_kwargs: Any,
    ) -> None:
        if not isinstance(dataset_name, str):
            raise TypeError(f"dataset_name must be a str, got {type(dataset_name).__name__}")
        # Integers and reals of any kind (numpy scalars too), never bool.
        if not is_integral(writer_buffer_size) or int(writer_buffer_size) < 0:
            raise ValueError(
                f"writer_buffer_size must be an int >= 0 (0 writes every value at once, as 1 does), "
                f"got {writer_buffer_size!r}"
            )
        writer_buffer_size = max(1, int(writer_buffer_size))  # Bagua's BatchFetcher reads 0 as 1 too
        if on_error not in ("raise", "bypass"):
            raise ValueError(f"on_error must be 'raise' or 'bypass', got {on_error!r}")
        if not is_integral(max_buffer_bytes) or int(max_buffer_bytes) < 0:
            raise ValueError(f"max_buffer_bytes must be an int >= 0, got {max_buffer_bytes!r}")
        max_buffer_bytes = int(max_buffer_bytes)
        if not is_real(retry_interval) or not float(retry_interval) >= 0:
            raise ValueError(f"retry_interval must be a number of seconds >= 0, got {retry_interval!r}")
        if flush_interval is not None and (
            not is_real(flush_interval) or not 0 <= float(flush_interval) < float("inf")
        ):
            raise ValueError(
                f"flush_interval must be None or a finite number of seconds >= 0, got {flush_interval!r}"
            )
        # The fingerprint is checked (TypeError) before any store is made or opened.
        if isinstance(fingerprint, _DatasetFingerprint):
            shown, user_fp, owner = fingerprint.value(), fingerprint.user, fingerprint.owner
        else:
            shown, user_fp, owner = fingerprint, fingerprint, f"CacheLoader({dataset_name!r})"
        digest: Optional[bytes] = None
        if shown is not None:
            if isinstance(fingerprint, _DatasetFingerprint):
                digest = _dataset_fingerprint_digest(fingerprint.length, fingerprint.user)
            else:
                digest = fingerprint_digest(shown)
        self.dataset_name = dataset_name
        self.writer_buffer_size = writer_buffer_size
        self.on_error = on_error
        self.max_buffer_bytes = max_buffer_bytes
        self.retry_interval = float(retry_interval)
        #: Seconds a buffered value waits at most before a background write; None: no background writes.
        self.flush_interval: Optional[float] = float(flush_interval) if flush_interval else None
        if _ORPHANS:  # (before this loader's fingerprint check may reset their namespace)
            _write_orphans()
        self.store = make_store(backend, dataset_name, **store_kwargs)
        # Made here for this dataset_name (its namespace), or a Store instance the caller passed (whose
        # whole namespace this loader then owns, whatever its dataset_name).
        self._owns_store = not isinstance(backend, Store)
        self.backend = self.store.backend
        # Whether the store calls take _STORE_LOCK (see there).
        self._serialized = not self.store.thread_safe
        # With a fingerprint, keys carry its tag: a loader reads only values computed under its own
        # fingerprint, whatever another job with another one (running at the same time), a restored
        # snapshot or an evicted fingerprint entry left in the namespace.
        tag = "" if digest is None else digest[len(_FP_V3) : len(_FP_V3) + _TAG_HEX].decode("ascii") + "_"
        self._prefix = (dataset_name + "_" + tag).encode("utf-8")
        limit = getattr(self.store, "max_key_size", None)
        self._max_key = int(limit) if limit else sys.maxsize
        self._closed = False
        # Counted by every process that uses this loader (its DataLoader workers too): stats().
        self._counters = SharedCounters(_STAT_NAMES, _GAUGE_NAMES)
        if flush_interval is not None:
            _await_at_exit(self._counters, float(flush_interval))
        self._reset_process_state()
        self._has_meta = False
        self._location = _store_location(self.store)
        try:
            self._open_checks(digest, shown, user_fp, owner)
        except BaseException:
            self._closed = self._blocked = True
            if self._owns_store:
                self.store.close()
            raise
        # An evicting Redis (maxmemory-policy allkeys-lru...) drops cached values instead of refusing
        # writes: counted from the servers' own count, from here on (see _check_evictions).
        # (Not while the store is known to be down, bypassed: the first later check takes the base.)
        self._counts_evictions = hasattr(self.store, "evicted_keys")  # Redis stores
        down = self._down_until > time.monotonic()
        self._evicted_base: Optional[int] = None if down else self._server_evictions()
        self._evicted = 0

    def _open_checks(self, digest: Optional[bytes], shown: Any, user_fp: Any, owner: str) -> None:
        """At construction: refuse a namespace another open loader of this process uses with another
        fingerprint, check the fingerprint, and warn (once per process) about an unnamed persistent
        cache and about entries reused from an earlier run without a fingerprint."""
        from trainloom.data.stores.lmdb_store import LmdbStore

        store = self.store
        # A cache that outlives the job: LMDB on disk, or Redis servers the user runs (hosts=).
        persistent = (isinstance(store, LmdbStore) and not store.readonly) or (
            store.backend == "redis" and getattr(store, "managed", None) is False
        )
        where = self._where()
        if persistent and store.namespace == "":
            _warn_process_once(
                "unnamed",
                f"CacheLoader(''): no dataset_name was given (Bagua's default ''), and {where} persists "
                "across runs: every unnamed dataset of every run shares its one namespace '', so datasets "
                "of different lengths drop each other's entries and datasets of the same length read each "
                "other's samples. Pass a distinct dataset_name= per dataset (e.g. "
                "dataset_name='imagenet-train-224').",
            )
        desc = owner if shown is None else f"{owner} with fingerprint {_short_repr(shown)}"
        found = _live_other(self._location, digest, self.dataset_name)
        if found is not None:
            # A loader that is only kept alive by its flush thread (nobody uses it any more) is not a
            # conflict: write its values (before this one resets the namespace) and let it go.
            found[0]._quiesce()
            found = None
            gc.collect()
            _write_orphans()  # loaders this collection freed: written before the namespace is reset
            found = _live_other(self._location, digest, self.dataset_name)
        if found is not None:
            other, other_desc = found
            if not (self._owns_store and other._owns_store):
                raise ConfigError(self._shared_store_message(desc, other_desc))
            raise ConfigError(
                f"{desc} would share the cache namespace "
                f"{getattr(store, 'namespace', self.dataset_name)!r} of {where} with {other_desc}, "
                "created earlier in this process and still open: their fingerprints differ, so the new "
                "one would drop the other's entries and both would then read and write each other's "
                "values under the same keys. Pass distinct dataset_name= values (e.g. "
                "dataset_name='train' and dataset_name='val'), or close() the other one first if it is "
                "no longer used."
            )
        if digest is not None:
            self._check_fingerprint(digest, shown)
        first_open = self._location not in _OPENED
        _OPENED.add(self._location)
        _register_live(self, self._location, digest, desc)
        # Only one process judges, per node for LMDB and per job for Redis (shared by the nodes): the
        # ranks of one job open the cache at about the same time, and one that opens after another
        # rank has flushed would take that for an earlier run (DataLoader workers never get here:
        # their loaders are unpickled, not constructed).
        judge = "RANK" if store.backend == "redis" else "LOCAL_RANK"
        leader = os.environ.get(judge, "0").strip() in ("", "0")
        if user_fp is None and persistent and first_open and leader:
            self._warn_reused(where)

    def _shared_store_message(self, desc: str, other_desc: str) -> str:
        """The ConfigError of a second loader opened, with another dataset_name or fingerprint, on the
        namespace of a Store instance an open loader of this process uses."""
        from trainloom.data.stores.lmdb_store import LmdbStore

        store = self.store
        ns = getattr(store, "namespace", None)
        shared = f"the namespace {ns!r} of {self._where()}" if ns is not None else self._where()
        name = self.dataset_name or "val"
        if isinstance(store, LmdbStore):
            fix = f"e.g. LmdbStore(path, namespace={name!r})"
        elif store.backend == "redis":
            fix = f"e.g. RedisStore(hosts, namespace={name!r})"
        else:
            fix = "e.g. a store of its own"
        return (
            f"{desc} would share {shared} with {other_desc}, created earlier in this process and still "
            "open. A Store instance holds one dataset: a CacheLoader over it owns the store's whole "
            "namespace (dataset_name= only prefixes the keys; clear(), num_keys() and the fingerprint "
            "entry act on the whole namespace), so the two would count, drop and clear each other's "
            f"entries. Give each dataset its own store namespace, {fix}, or close() the other one first "
            "if it is no longer used."
        )

    def _where(self) -> str:
        """The store's location, for messages."""
        path = getattr(self.store, "path", None)
        if self.store.backend == "lmdb" and path is not None:
            return f"the LMDB cache at {str(path)!r}"
        return repr(self.store)

    def _warn_reused(self, where: str) -> None:
        """Warn once when a persistent cache opened without a fingerprint already holds entries."""
        try:
            with self._store_lock():
                n = cached_values(self.store)
        except StoreError as exc:  # the first real use reports it (raised, or bypassed)
            log.debug("CacheLoader(%r): could not count the reused entries: %s", self.dataset_name, exc)
            return
        if n <= 0:
            return
        ns = getattr(self.store, "namespace", self.dataset_name)
        if self.store.backend == "redis":
            # one command per server the keys are sharded over, each with its db and user (the
            # hint named the first server, db 0, only: it cleared another cache there, or a shard)
            hosts = self.store.hosts  # type: ignore[attr-defined]
            quoted_ns = shlex.quote(ns)
            commands = [
                f"trainloom cache clear --redis {shlex.quote(_redis_cli_target(h))} --namespace {quoted_ns}"
                for h in hosts
            ]
            clear = "`" + "`, then `".join(commands) + "`"
            if len(hosts) > 1:
                clear += f" (the entries are sharded over these {len(hosts)} servers)"
        else:
            where_opt = f"--path {shlex.quote(os.path.abspath(str(getattr(self.store, 'path', ''))))}"
            clear = f"`trainloom cache clear {where_opt} --namespace {shlex.quote(ns)}`"
        _warn_process_once(
            ("reuse", self._location),
            f"CacheLoader({self.dataset_name!r}): reusing {n} cached entries written by an earlier run "
            f"from {where} (namespace {ns!r}). No fingerprint= was given, so they are served as they are "
            "even if the preprocessing changed since. Pass fingerprint= (e.g. a version string or the "
            f"transform parameters; a change drops the old entries once), or clear the cache ({clear}) "
            "when the preprocessing changes.",
        )

    def _quiesce(self) -> None:
        """Write this loader's buffered values and end its flush thread (another loader of this process
        is about to reset the namespace; the thread no longer keeps this loader alive).

        The loader is live, so its own flush applies: a store that is unreachable or full keeps the
        values buffered, one found down in bypass mode is not tried before ``retry_interval``, and
        refused values are dropped and counted. A failure is logged, not raised into the construction
        of the other loader."""
        if self._pid != os.getpid() or self._closed:
            return
        try:
            if not self._is_down():
                self._flush_now()
        except StoreError as exc:
            log.error(
                "CacheLoader(%r): could not write its buffered values before another loader of this "
                "process opened the namespace (%d still buffered): %s",
                self.dataset_name,
                len(self._pending.buffer),
                exc,
            )
        finally:
            self._stop_timer(join=True)

    # -- process-local state ----------------------------------------------------------------------
    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        # This process's counters: its slot of the table shared with the other processes.
        self._counters.after_fork()
        self._stats = self._counters.values
        # This process's write buffer (a forked child starts empty: the parent writes its own).
        self._pending = _Pending(self.store, self._stats, self.dataset_name, self._serialized)
        self._lock = self._pending.lock
        self._down_until = 0.0
        self._warned: set = set()
        # Out of memory (set later), or a store opened read-only (values computed for misses are
        # then dropped, with one warning).
        self._writes_disabled = bool(getattr(self.store, "readonly", False))
        # The first decode error since the last "did not decode" warning (named in that warning).
        self._decode_failure: Optional[BaseException] = None
        # When the oldest value now buffered was buffered (time.monotonic()).
        self._buffered_since = 0.0
        # This process's background flush thread (None while the buffer is empty or flush_interval is
        # None), and the error of a failed background flush, raised by the next call.
        self._timer: Optional[_FlushThread] = None
        # Every flush thread started here that may still run (close() joins them).
        self._timers: List[_FlushThread] = []
        self._evictions_checked = 0.0  # when this process last looked (time.monotonic())
        # Whether the next call must raise (closed, or a background flush failed): one test per call.
        self._blocked = self._closed

    def _check_pid(self) -> None:
        # Every public call starts here, outside any store transaction and lock: the safe point at
        # which the buffers of collected loaders are written (see _orphaned).
        if _ORPHANS:
            _write_orphans()
        if self._blocked:
            self._raise_blocked()
        if self._pid != os.getpid():
            # A forked child: the parent flushes its own buffer; the child starts empty.
            self._reset_process_state()

    def _raise_blocked(self) -> None:
        """The slow path of :meth:`_check_pid`: raise CacheClosedError, or a background flush's error."""
        if self._pid != os.getpid():
            self._reset_process_state()  # a background flush of the parent failed: the parent's error
        if self._closed:
            raise CacheClosedError(
                f"CacheLoader({self.dataset_name!r}) is closed: close() flushed its values and released the "
                "store; create a new CacheLoader to use the cache again",
                backend=self.backend,
            )
        exc = self._take_timer_error()
        if exc is not None:
            raise exc

    def _take_timer_error(self) -> Optional[Exception]:
        """The error of a failed background flush (once), annotated; None when there is none."""
        with self._lock:
            exc, self._pending.timer_error = self._pending.timer_error, None
            self._blocked = self._closed
        if exc is not None and hasattr(exc, "add_note"):
            exc.add_note(
                f"(raised by the background flush of CacheLoader({self.dataset_name!r}), "
                f"flush_interval={self.flush_interval:g}s)"
            )
        return exc

    def __getstate__(self) -> Dict[str, Any]:
        if self._pid != os.getpid():
            self._reset_process_state()  # the inherited lock may be held by a thread of the parent
        with self._lock:
            if not self._closed:
                self._flush_now()
            state = dict(self.__dict__)
        # _counters stays: it shares its table with a process being spawned (not with a plain pickle).
        for k in ("_pending", "_lock", "_stats", "_warned", "_timer", "_timers"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def _ensure_finalizer(self) -> None:
        """Register the handlers that write this process's buffer if the loader is never closed (the
        lock is held; at the first buffered value)."""
        p = self._pending
        if p.at_exit is None:
            # atexit and weakref.finalize do not run when a forked DataLoader worker exits; Finalize
            # with an exitpriority runs from multiprocessing's _exit_function in every worker kind
            # and, through atexit, in the main process. It holds the buffer, not the loader.
            p.at_exit = multiprocessing.util.Finalize(None, _flush_at_exit, args=(p,), exitpriority=10)
            # A loader collected without close(): its values are written at the next call of a loader
            # of this process (never inside the collector: see _orphaned), or at exit by the above.
            p.at_gc = weakref.finalize(self, _orphaned, p)
            p.at_gc.atexit = False  # at exit, the Finalize above writes them (in every process kind)

    # -- background flush -------------------------------------------------------------------------
    def _start_timer(self) -> None:
        """Start this process's flush thread (lock held; the buffer holds values, none runs)."""
        global _flushers
        delay = self.flush_interval
        if delay is None:
            return
        t = _FlushThread(self, max(0.0, self._buffered_since + delay - time.monotonic()))
        if self._serialized:
            t.counted = True
            with _STORE_LOCK:
                _flushers += 1
        try:
            t.start()
        except BaseException:
            if t.counted:
                with _STORE_LOCK:
                    _flushers -= 1
            raise
        self._timer = t
        self._timers = [x for x in self._timers if x.is_alive()]
        self._timers.append(t)

    def _stop_timer(self, join: bool) -> None:
        """End this process's flush thread; with ``join`` (the lock not held), wait until every flush
        thread started here has ended."""
        with self._lock:
            t, self._timer = self._timer, None
            threads = self._timers
            if join:
                self._timers = []
        if t is not None:
            t.stop()
        if join:
            for x in threads:
                x.stop()
                if x is not threading.current_thread():
                    x.join()

    def _background_flush(self, thread: _FlushThread) -> Optional[float]:
        """Run by the flush thread: write the buffer once its oldest value has waited
        ``flush_interval``. Returns the seconds until the next check, or None when the thread ends."""
        with self._lock:
            if self._timer is not thread or self._closed or self._pid != os.getpid():
                return None
            if not self._pending.buffer or self.flush_interval is None:
                self._timer = None
                return None
            now = time.monotonic()
            wait = self._buffered_since + self.flush_interval - now
            if wait > 0:
                return wait
            if not self._is_down():
                try:
                    self._flush_locked()
                except Exception as exc:  # noqa: BLE001 - raised by the next call of this process
                    # on_error="raise" (or a bug in a Store subclass): the next call raises it. With
                    # "bypass" a failing store does not raise here: flush warned once and counted.
                    log.debug("CacheLoader(%r): background flush failed: %r", self.dataset_name, exc)
                    self._pending.timer_error = exc
                    self._blocked = True
                    self._timer = None
                    return None
                if not self._pending.buffer:
                    self._timer = None
                    return None
            # The store is down (on_error="bypass"): retry when it may be used again.
            return max(self._down_until - time.monotonic(), self.flush_interval)

    # -- helpers ----------------------------------------------------------------------------------
    def key(self, key: Any) -> bytes:
        """The store key of ``key``: ``"{dataset_name}_{key}"`` as UTF-8 (lone surrogates, as in names
        ``os.listdir`` could not decode, are kept with ``surrogatepass``); with a fingerprint
        ``"{dataset_name}_{tag}_{key}"``, ``tag`` being the first 16 hex digits of its digest, so that
        values computed under another fingerprint are never read.

        Raises:
            ConfigError: the key is longer than the store allows (LMDB: 511 bytes, prefix included).
        """
        if type(key) is int:
            k = b"%b%d" % (self._prefix, key)
        else:
            k = self._prefix + str(key).encode("utf-8", "surrogatepass")
        if len(k) > self._max_key:
            raise ConfigError(
                f"CacheLoader({self.dataset_name!r}): the key {_short_repr(key)} is {len(k)} bytes in the "
                f"store (with the {self._prefix.decode('utf-8', 'replace')!r} prefix); keys of the "
                f"{self.backend} store are limited to {self._max_key} bytes. Hash long keys, e.g. "
                "hashlib.sha1(key.encode()).hexdigest()"
            )
        return k

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            log_if_configured(log, message)

    def _store_failed(self, exc: StoreError, action: str) -> None:
        self._stats[_ERRORS] += 1
        if self.on_error == "raise":
            raise exc
        self._down_until = time.monotonic() + self.retry_interval
        self._warn_once(
            "bypass",
            f"CacheLoader({self.dataset_name!r}): the {self.backend} store failed during {action} ({exc}); "
            f"on_error='bypass': serving misses and retrying every {self.retry_interval:g}s. "
            "See stats() for the error, bypass and drop counts.",
        )

    def _store_lock(self) -> Any:
        """What store calls outside the read path hold: _STORE_LOCK unless the store is thread-safe."""
        return _STORE_LOCK if self._serialized else _NO_LOCK

    def _is_down(self) -> bool:
        return self._down_until > 0.0 and time.monotonic() < self._down_until

    def _decode_one(self, buf: Any) -> Any:
        """Decode one stored value; _UNDECODABLE for a value that does not decode, _STORED_NONE for None."""
        try:
            self._stats[_BYTES_READ] += len(buf)
            v = _codec.decode(buf, True)
        except Exception as exc:  # noqa: BLE001 - any failure to decode stored bytes means a bad entry
            # Only decoding runs here (no load_fn, no store call): whatever it raises (CodecError,
            # UnicodeDecodeError, a bytes-like check, an unpickled class's own error) is about the
            # stored value. The caller counts it, logs it with this cause and recomputes the value.
            if self._decode_failure is None:
                self._decode_failure = exc
            return _UNDECODABLE
        return _STORED_NONE if v is None else v

    def _read(self, keys: List[bytes]) -> List[Any]:
        """Values (or _MISSING / _UNDECODABLE) for store keys; counts; honours bypass."""
        # Taken before the store is read: a background flush replaces the buffer after writing it, so
        # a value is found either in the store or in this dict.
        buf = self._pending.buffer
        down = self._down_until
        if down > 0.0 and time.monotonic() < down:  # self._is_down(), inlined on the hot path
            self._stats[_BYPASSED] += len(keys)
            return [_MISSING] * len(keys)
        stats = self._stats
        try:
            try:
                if _flushers and self._serialized:  # a background flush may write meanwhile
                    with _STORE_LOCK:
                        out, nbytes = mget_decode_missing(self.store, keys, _MISSING)
                else:
                    out, nbytes = mget_decode_missing(self.store, keys, _MISSING)
                stats[_BYTES_READ] += nbytes
            except StoreError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried item by item below, which re-raises store bugs
                # Some value does not decode (damaged, or its pickled class changed): redo the batch
                # item by item, marking only the bad ones. A failure of the store itself raises again
                # from mget_apply; only decoding errors are turned into _UNDECODABLE, by _decode_one.
                log.debug(
                    "CacheLoader(%r): batched decode failed (%r); decoding one by one", self.dataset_name, exc
                )
                with self._store_lock():
                    raw = self.store.mget_apply(keys, self._decode_one)
                out = [_MISSING if v is None else (None if v is _STORED_NONE else v) for v in raw]
        except StoreError as exc:
            self._store_failed(exc, "a read")
            stats[_BYPASSED] += len(keys)
            return [_MISSING] * len(keys)
        if buf:
            for i, k in enumerate(keys):
                if out[i] is _MISSING:
                    v = buf.get(k)
                    if v is not None:
                        out[i] = _codec.decode(v, True)
        return out

    def _report_corrupt(self, n: int, what: str) -> None:
        """Count ``n`` values that did not decode and log one warning naming the first cause."""
        self._stats[_CORRUPT] += n
        cause, self._decode_failure = self._decode_failure, None
        detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        log.warning(
            "CacheLoader(%r): %s did not decode%s; recomputed and rewritten", self.dataset_name, what, detail
        )

    def _encode(self, value: Any, what: str) -> bytes:
        try:
            if _has_tensor_state(value):
                # Keep what a miss returned (the Parameter type, tensor attributes) for later hits too.
                return _codec.encode(_wrap_tensor_state(value))
            return _codec.encode(value)
        except (_codec.CodecError, RecursionError, UnicodeEncodeError) as exc:
            raise CodecError(
                f"CacheLoader({self.dataset_name!r}): {what} cannot be serialized for the cache: {exc}. "
                "Return tensors, numpy arrays, numbers, str, bytes or picklable objects."
            ) from exc

    def _put(self, k: bytes, encoded: bytes) -> None:
        if self._writes_disabled:
            self._stats[_DROPPED] += 1
            if getattr(self.store, "readonly", False):
                self._warn_once(
                    "readonly",
                    f"CacheLoader({self.dataset_name!r}): {self._where()} was opened read-only "
                    "(readonly=True): values computed for misses are returned but not stored (counted in "
                    "stats()['dropped']).",
                )
            return
        with self._lock:
            buffer = self._pending.buffer
            if not buffer:
                self._buffered_since = time.monotonic()
            old = buffer.pop(k, None)
            if old is not None:
                self._pending.nbytes -= len(old)
            buffer[k] = encoded
            self._pending.nbytes += len(encoded)
            self._ensure_finalizer()
            full = len(buffer) >= self.writer_buffer_size or self._pending.nbytes >= self.max_buffer_bytes
            if full and not self._is_down():
                try:
                    self._flush_locked()
                except BaseException:
                    # Raised to this caller, who now knows the values wait: no background retry
                    # raises it again (the next value buffered starts the thread again).
                    self._stop_timer(join=False)
                    raise
            if self._is_down():
                self._trim_buffer()
            # Values left in the buffer are written within flush_interval even if no other value comes.
            # A full buffer flushed above leaves a running thread alone: it ends at its next check if
            # the buffer is empty then (no thread started and stopped per buffer of values).
            if self._timer is None and self._pending.buffer and self.flush_interval is not None:
                self._start_timer()
            self._publish_buffered()

    def _publish_buffered(self) -> None:
        """Show this process's buffer in the shared gauges (for stats() in other processes)."""
        self._stats[_BUFFERED] = len(self._pending.buffer)
        self._stats[_BUFFERED_BYTES] = self._pending.nbytes

    def _trim_buffer(self) -> None:
        # The buffer only outgrows writer_buffer_size/max_buffer_bytes while the store is down
        # (bypass mode): then the oldest values are dropped, so it stays bounded in bytes.
        p = self._pending
        while p.buffer and p.nbytes > self.max_buffer_bytes and len(p.buffer) > 1:
            k = next(iter(p.buffer))
            p.nbytes -= len(p.buffer.pop(k))
            self._stats[_DROPPED] += 1

    def _check_fingerprint(self, digest: bytes, shown: Any) -> None:
        """Store ``digest`` as the namespace's fingerprint, dropping its entries when another one was
        stored (they can no longer be read: keys carry the fingerprint's tag, see :meth:`key`). A
        namespace without one (new, or its entry evicted or flushed) keeps its entries. A read-only
        store is only read: its fingerprint must match."""
        if getattr(self.store, "readonly", False):
            self._check_fingerprint_readonly(digest, shown)
            return
        try:
            with self._store_lock():
                before = self.store.get(META_KEY)  # only for the message below
                dropped = self.store.reset_if_changed(META_KEY, digest)
        except StoreError as exc:
            # Nothing stale can be served (keys carry this fingerprint's tag): only the old entries
            # stay until a later check drops them.
            self._store_failed(exc, "the fingerprint check")
            return
        self._has_meta = True
        if dropped:
            old = before is not None and as_bytes(before).startswith(_FP_OLD)
            log.warning(
                "CacheLoader(%r): %s; dropped the stale entries of namespace %r",
                self.dataset_name,
                "the cache was written by an older trainloom (other keys)"
                if old
                else f"fingerprint changed ({_short_repr(shown)})",
                getattr(self.store, "namespace", self.dataset_name),
            )

    def _check_fingerprint_readonly(self, digest: bytes, shown: Any) -> None:
        """The fingerprint check of a store opened read-only: nothing can be dropped or written, so
        stored entries are served only when the stored fingerprint matches."""
        try:
            with self._store_lock():
                cur = self.store.get(META_KEY)
                n = self.store.num_keys()
        except StoreError as exc:
            self._store_failed(exc, "the fingerprint check")
            return
        if cur is not None and as_bytes(cur) == digest:
            self._has_meta = True
            return
        if cur is None and n == 0:
            return  # nothing cached yet: nothing to verify (and nothing will be written)
        if cur is None:
            found = "no fingerprint"
        elif as_bytes(cur).startswith(_FP_OLD):
            found = "the fingerprint of an older trainloom (whose keys this version does not read)"
        else:
            found = "another fingerprint"
        ns = getattr(self.store, "namespace", self.dataset_name)
        raise ConfigError(
            f"CacheLoader({self.dataset_name!r}) with fingerprint {_short_repr(shown)}: {self._where()} was "
            f"opened read-only (readonly=True) and its namespace {ns!r} holds {found}, so its entries were "
            "made for other data or preprocessing (for CachedDataset the fingerprint includes the dataset's "
            "length). A read-only cache cannot be rebuilt: pass the fingerprint it was built with, open it "
            "writable to rebuild it, or use another path."
        )

    # -- public API -------------------------------------------------------------------------------
    def get(self, key: Any, load_fn: Callable[[Any], _V]) -> _V:
        """The cached value of ``key``, or ``load_fn(key)`` computed, stored and returned.

        Args:
            key: any key whose ``str()`` identifies the value (an int index, a path...).
            load_fn: computes the value from ``key`` on a miss.

        Raises:
            CodecError: the computed value cannot be serialized (names the key).
            StoreError: the store failed (unless ``on_error="bypass"``).
        """
        self._check_pid()
        k = self.key(key)
        v = self._read([k])[0]
        if v is not _MISSING and v is not _UNDECODABLE:
            self._stats[_HITS] += 1
            return v
        if v is _UNDECODABLE:
            self._report_corrupt(1, f"the stored value for key {_short_repr(key)}")
        self._stats[_MISSES] += 1
        value = load_fn(key)
        self._put(k, self._encode(value, f"the value for key {key!r}"))
        return value

    def get_many(
        self,
        keys: Sequence[Any],
        load_fn: Callable[[Any], _V],
        load_many: Optional[Callable[[List[Any]], List[_V]]] = None,
        what: str = "key",
        store_keys: Optional[List[bytes]] = None,
    ) -> List[_V]:
        """Values for several keys with one batched read; misses computed with ``load_many(keys)``
        when given, else ``load_fn(key)`` each. ``store_keys`` (internal) are the keys already
        formatted by :meth:`key`."""
        self._check_pid()
        # Fast path for int keys (dataset indices): formatted in one C loop.
        ks = store_keys if store_keys is not None else _codec.int_keys(self._prefix, keys, -1)
        if ks is None:
            ks = [self.key(k) for k in keys]
        vals = self._read(ks)
        missing = _codec.missing_positions(vals, _MISSING, _UNDECODABLE)
        self._stats[_HITS] += len(ks) - len(missing)
        if missing:
            bad = [i for i in missing if vals[i] is _UNDECODABLE]
            if bad:
                first = _short_repr(keys[bad[0]])
                self._report_corrupt(len(bad), f"{len(bad)} stored value(s) ({what} {first} first)")
            # A key repeated in the batch (a sampler drawing with replacement) is computed, counted
            # and written once; its positions share the computed value.
            first_at: Dict[bytes, int] = {}
            for i in missing:
                first_at.setdefault(ks[i], i)
            once = list(first_at.values())
            self._stats[_MISSES] += len(once)
            todo = [keys[i] for i in once]
            computed = load_many(todo) if load_many is not None else [load_fn(k) for k in todo]
            if len(computed) != len(todo):
                raise ValueError(f"load_many returned {len(computed)} values for {len(todo)} keys")
            for i, value in zip(once, computed):
                vals[i] = value
                self._put(ks[i], self._encode(value, f"the value for {what} {keys[i]!r}"))
            if len(once) != len(missing):
                for i in missing:
                    vals[i] = vals[first_at[ks[i]]]
        return vals

    def contains_many(self, keys: Sequence[Any]) -> List[bool]:
        """Whether each key is cached: in the store or in this process's write buffer (reads no
        value, decodes nothing).

        Raises:
            StoreError: the store failed (with ``on_error="bypass"``: one warning, the error counted,
            and the keys not buffered reported as not cached, as :meth:`get` serves misses).
        """
        self._check_pid()
        ks = [self.key(k) for k in keys]
        buffered = self._pending.buffer  # before the store is read, as in _read
        if self._is_down():
            self._stats[_BYPASSED] += len(ks)
            return [k in buffered for k in ks]
        try:
            with self._store_lock():
                out = self.store.mget_apply(ks, lambda buf: True)
        except StoreError as exc:
            self._store_failed(exc, "a read")
            self._stats[_BYPASSED] += len(ks)
            return [k in buffered for k in ks]
        return [v is not None or k in buffered for k, v in zip(ks, out)]

    def num_keys(self) -> int:
        """The number of cached values of this loader's ``dataset_name``: of its store namespace.

        Flushes this process's write buffer first, so every value computed here is counted.

        With a Store instance as backend, the count is of that store's whole namespace, whatever
        ``dataset_name`` wrote them (see :class:`CacheLoader`)."""
        self._check_pid()
        self.flush()
        with self._store_lock():
            return cached_values(self.store)

    def flush(self) -> None:
        """Write the buffered values to the store now.

        When a batch fails with a plain :class:`StoreError` (not an unreachable, full or out-of-memory
        store) its values are written one by one, so one value the store refuses (a bad key, a value
        over its size limit) cannot block the others: the refused values are dropped (counted in
        ``stats()["dropped"]``) and reported like any store failure (raised, or one warning with
        ``on_error="bypass"``). When every value fails, the store is failing: the values stay buffered.
        """
        self._check_pid()
        self._flush_now()

    def _flush_now(self) -> None:
        """Flush; end the background flush thread when the buffer is empty after it, or when the
        flush raised (to this caller: no background retry raises it again)."""
        with self._lock:
            try:
                self._flush_locked()
            except BaseException:
                self._stop_timer(join=False)
                raise
            if not self._pending.buffer:
                self._stop_timer(join=False)

    def _flush_locked(self) -> None:
        """The body of :meth:`flush` (the loader's lock is held)."""
        try:
            self._write_buffer()
        finally:
            self._publish_buffered()

    def _write_buffer(self) -> None:
        with self._store_lock():
            if not self._pending.buffer:
                return
            if self._writes_disabled:
                self._stats[_DROPPED] += len(self._pending.buffer)
                self._pending.buffer.clear()
                self._pending.nbytes = 0
                return
            items = self._pending.buffer
            try:
                self.store.mset(cast(Mapping[Key, bytes], items))  # (Mapping's key type is invariant)
            except (StoreError, ConfigError) as exc:
                self._flush_one_by_one(exc)
                return
            self._stats[_WRITES] += len(items)
            self._stats[_BYTES_WRITTEN] += self._pending.nbytes
            self._stats[_FLUSHES] += 1
            self._pending.buffer = {}
            self._pending.nbytes = 0
            self._down_until = 0.0
        self._check_evictions()

    def _server_evictions(self) -> Optional[int]:
        """How many keys the store's Redis servers evicted since they started; None for other stores,
        or when they cannot tell now."""
        if not self._counts_evictions:
            return None
        try:
            with self._store_lock():
                return int(self.store.evicted_keys())  # type: ignore[attr-defined]
        except StoreError as exc:  # the next real use reports an unreachable server
            log.debug("CacheLoader(%r): could not read the evicted-key count: %s", self.dataset_name, exc)
            return None

    def _check_evictions(self, now: bool = False) -> int:
        """Update (at most every ``_EVICTION_CHECK_S`` per process unless ``now``) and return the keys
        the Redis servers evicted since this loader was made; warn once per process when there are."""
        if not self._counts_evictions:  # (after every write: one attribute test for LMDB)
            return 0
        t = time.monotonic()
        if (not now and t - self._evictions_checked < _EVICTION_CHECK_S) or self._down_until > t:
            return self._evicted  # (a store found down in bypass mode is not asked before its retry)
        self._evictions_checked = t
        n = self._server_evictions()
        if n is None:
            return self._evicted
        if self._evicted_base is None:  # the servers could not tell when the loader was made
            self._evicted_base = n
        self._evicted = max(self._evicted, n - self._evicted_base)
        if self._evicted > 0:
            self._warn_once(
                "evicted",
                f"CacheLoader({self.dataset_name!r}): {self.store!r} evicted {self._evicted} keys since this "
                "cache was opened (its maxmemory-policy drops old keys when it is full): cached values are "
                "being dropped and computed again. "
                + (
                    "Raise capacity_per_node= or cache less (stats()['evicted'] counts them)."
                    if getattr(self.store, "managed", False)
                    else "Raise the server's maxmemory or cache less (stats()['evicted'] counts them)."
                ),
            )
        return self._evicted

    def _store_wide_failure(self, exc: Exception) -> None:
        """Handle a write failure of the whole store (one of ``_STORE_WIDE``): out of memory, or full
        in bypass mode: this process stops writing; unreachable, or full with on_error='raise': the
        buffer is trimmed and the failure reported (raised, or the store bypassed for a while)."""
        if isinstance(exc, StoreOutOfMemoryError):
            self._out_of_memory(exc)
        elif isinstance(exc, StoreFullError) and self.on_error == "bypass":
            self._full(exc)
        else:
            self._trim_buffer()
            self._store_failed(cast(StoreError, exc), "a write")

    def _full(self, exc: StoreFullError) -> None:
        """Bypass mode, store full (disk or LMDB map cap): stop writing, keep serving what is cached
        (retrying the write and skipping reads meanwhile served nothing while the disk stayed full)."""
        self._stop_writing(
            _ERRORS,
            "full",
            f"CacheLoader({self.dataset_name!r}): {exc}. on_error='bypass': no new values will be "
            "written by this process (reads of cached values continue).",
        )

    def _out_of_memory(self, exc: StoreOutOfMemoryError) -> None:
        self._stop_writing(
            _OOM,
            "oom",
            f"CacheLoader({self.dataset_name!r}): the store is out of memory ({exc}); no new values "
            "will be written by this process (reads continue). "
            + (
                "Raise capacity_per_node= or clear old caches."
                if getattr(self.store, "managed", False)
                else "Raise the server's maxmemory, set an evicting maxmemory-policy (allkeys-lru) or "
                "clear old caches."
            ),
        )

    def _stop_writing(self, counter: int, what: str, message: str) -> None:
        """This process writes nothing more (its buffer is dropped and counted); reads continue."""
        self._stats[counter] += 1
        self._stats[_DROPPED] += len(self._pending.buffer)
        self._writes_disabled = True
        self._pending.buffer = {}
        self._pending.nbytes = 0
        self._warn_once(what, message)

    def _flush_one_by_one(self, first: Exception) -> None:
        """After a failed batch: write what can be written (:func:`_write_each`); drop the values the
        store refuses. A store-wide failure is handled as one of the batch (the values not written
        stay buffered, or are dropped when writing stops)."""
        buffer = self._pending.buffer
        done, refused, wide = _write_each(self.store, buffer, first)
        for k in done:
            v = buffer.pop(k)
            self._pending.nbytes -= len(v)
            self._stats[_WRITES] += 1
            self._stats[_BYTES_WRITTEN] += len(v)
        written = len(done)
        if written:
            self._stats[_FLUSHES] += 1
            self._down_until = 0.0
        if wide is not None:
            self._store_wide_failure(wide)
            return
        item_specific = {
            k: e
            for k, e in refused.items()
            if written or isinstance(e, (ConfigError, StoreValueRefusedError))
        }
        if refused and not item_specific:
            # Every value failed alone too: the store is failing, not a value. Keep them buffered.
            self._trim_buffer()
            failure = next(e for e in (first, *refused.values()) if isinstance(e, StoreError))
            self._store_failed(failure, "a write")
            return
        if not item_specific:
            return
        for k in item_specific:
            self._pending.nbytes -= len(self._pending.buffer.pop(k))
        self._stats[_DROPPED] += len(item_specific)
        self._stats[_ERRORS] += 1
        k0, e0 = next(iter(item_specific.items()))
        message = (
            f"CacheLoader({self.dataset_name!r}): the {self.backend} store refused {len(item_specific)} "
            f"value(s), dropped (not cached; recomputed when next read): key {_short_repr(k0)}: {e0}. "
            f"The other {written} buffered value(s) were written."
        )
        if self.on_error == "raise":
            raise StoreError(message, backend=self.backend, key=k0.decode("utf-8", "replace")) from e0
        self._warn_once("refused", message + " on_error='bypass': further refusals are only counted.")

    def stats(self, this_process: bool = False) -> Dict[str, int]:
        """Counters of this loader in every process that used it: hits, misses, writes, bytes_read,
        bytes_written, errors, corrupt (damaged values recomputed), bypassed (reads skipped in bypass
        mode), dropped (values not written: buffer bound, OOM, refused by the store), oom, flushes;
        buffered and buffered_bytes (values waiting to be written now); processes (how many counted);
        evicted: keys the Redis servers evicted since the loader was made, read from the servers (their
        own count, so every namespace's keys; 0 for LMDB). An evicting ``maxmemory-policy`` drops
        cached values when a server is full; their samples are then computed again (misses).

        The processes are the one that made the loader and every process it reached by fork or
        while spawning: DataLoader workers, live or exited (with their final counts). Counts of a
        live worker are current to its last call. A copy made by plain pickling counts on its own.
        Still readable after :meth:`close` (the final counts).

        Args:
            this_process: count this process only (``processes`` is then 1).
        """
        if self._pid != os.getpid():
            self._reset_process_state()
        if this_process:
            out = self._counters.local()
            out["processes"] = 1
        else:
            out, processes = self._counters.total()
            out["processes"] = processes
        # read from the servers now while open, else the last count seen (server-wide, see above)
        out["evicted"] = self._evicted if self._closed else self._check_evictions(now=True)
        return out

    def clear(self) -> None:
        """Delete every cached value of this ``dataset_name`` (other names are untouched): its store
        namespace, and this process's write buffer.

        .. warning::
            With a Store instance as backend, this clears that store's whole namespace, including
            entries other ``dataset_name`` values wrote there (see :class:`CacheLoader`: a Store
            instance holds one dataset).
        """
        self._check_pid()
        with self._lock:
            self._pending.buffer.clear()
            self._pending.nbytes = 0
            self._publish_buffered()
            self._stop_timer(join=False)
            with self._store_lock():
                self.store.clear()
            self._has_meta = False

    def close(self) -> None:
        """Flush, then release this process's store handles (idempotent).

        Every later call but :meth:`stats`, :meth:`key` and :meth:`close` raises
        :class:`CacheClosedError`; the store is never silently reopened (writes made after ``close``
        would not be flushed at exit). The background flush thread has ended when it returns. The
        error of a failed background flush not raised yet is raised after closing."""
        if self._closed:
            return
        if _ORPHANS:
            _write_orphans()
        if self._pid != os.getpid():
            self._reset_process_state()
        pending = self._take_timer_error()
        try:
            self._flush_now()
        finally:
            self._closed = True
            self._blocked = True
            _unregister_live(self)
            self._stop_timer(join=True)  # no thread outlives close(), none writes after it
            self._pending.cancel()
            with self._store_lock():
                self.store.close()
        if pending is not None:
            raise pending

    def __enter__(self) -> CacheLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        closed = ", closed" if self._closed else ""
        return f"CacheLoader(store={self.store!r}, dataset_name={self.dataset_name!r}{closed})"


class _Warm(Dataset):
    """Computes and caches a batch in a worker; returns only the count (no sample crosses processes)."""

    def __init__(self, ds: CachedDataset, indices: List[int]) -> None:
        self.ds = ds
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> int:
        return self.__getitems__([i])

    def __getitems__(self, positions: List[int]) -> int:
        self.ds.__getitems__([self.indices[p] for p in positions])
        return len(positions)


class CachedDataset(Dataset):
    """A map-style dataset whose samples are computed once by ``dataset`` and then read from a cache.

    Samples are stored under ``"{dataset_name}_{index}"``. ``__getitems__`` lets torch's DataLoader
    fetch a whole batch with one batched read (``dataset.__getitems__``, when it exists, must return a
    list with one sample per index: ``TypeError`` otherwise). The cache is invalidated (once, at
    construction) when ``len(dataset)`` or ``fingerprint`` changes. The default LMDB cache outlives
    the run: pass ``fingerprint=`` so that changed preprocessing is not served stale samples, and a
    distinct ``dataset_name`` per dataset (see :class:`CacheLoader` for the checks).

    Args:
        dataset: the map-style dataset to cache.
        backend: ``"lmdb"`` (default), ``"redis"`` or a :class:`~trainloom.data.stores.Store`.
        dataset_name: name of the dataset (store namespace and key prefix).
        writer_buffer_size: computed samples collected before one batched write.
        fingerprint: optional description of the dataset version/preprocessing; see
            :class:`CacheLoader`.
        **kwargs: passed to :class:`CacheLoader` (``on_error=``, ``flush_interval=``...) and the store
            (``path=``...).

    Example::

        >>> ds = CachedDataset(SlowDataset(64), path=tmp_path / "cache", dataset_name="slow")
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=2)
        >>> for batch in loader: ...      # first epoch computes, later epochs read the cache
    """

    def __init__(
        self,
        dataset: Any,
        backend: Any = "lmdb",
        dataset_name: str = "",
        writer_buffer_size: int = 20,
        *,
        fingerprint: Any = None,
        **kwargs: Any,
    ) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(
                "CachedDataset needs a map-style dataset with __getitem__ and __len__, "
                f"got {type(dataset).__name__}"
            )
        self.dataset = dataset
        self._len = len(dataset)
        self.cache_loader = CacheLoader(
            backend,
            dataset_name,
            writer_buffer_size,
            fingerprint=_DatasetFingerprint(
                self._len,
                fingerprint,
                f"CachedDataset({type(dataset).__name__} of length {self._len}, "
                f"dataset_name={dataset_name!r})",
            ),
            **kwargs,
        )
        if dataset_name == "":
            self._note_unnamed()

    def _note_unnamed(self) -> None:
        """Warn (once per process and store) when another unnamed CachedDataset of this process, still
        open, wraps another dataset object of the same length on the same store. Both use the namespace
        '' and one fingerprint, so nothing else tells them apart: if their samples differ, each is served
        the other's. (Of different lengths they conflict, and the second one is refused.)"""
        loader = self.cache_loader
        location, pid = loader._location, os.getpid()
        with _LIVE_LOCK:
            entries = _UNNAMED.setdefault(location, [])
            entries[:] = [
                e for e in entries if e[1] == pid and e[0]() is not None and not e[0]().cache_loader._closed
            ]
            other = next((e[0]() for e in entries if e[0]().dataset is not self.dataset), None)
            entries.append((weakref.ref(self), pid))
        if other is not None:
            _warn_process_once(
                ("unnamed-shared", location),
                f"CachedDataset({type(self.dataset).__name__} of length {self._len}, dataset_name=''): "
                f"another unnamed CachedDataset ({type(other.dataset).__name__} of length {other._len}), "
                f"created earlier in this process and still open, wraps another dataset object and uses "
                f"the same namespace '' of {loader._where()}: they read and write the same keys, so if "
                "their samples differ each is served the other's. Pass a distinct dataset_name= to each, or "
                "the same one if they hold the same data.",
            )

    def __len__(self) -> int:
        return self._len

    def _index(self, index: Any) -> int:
        try:
            if type(index) is not int and (
                isinstance(index, (bool, np.bool_))
                or (isinstance(index, torch.Tensor) and index.dtype == torch.bool)
            ):
                raise TypeError  # operator.index accepts True as 1: almost always a mask or a bug
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"CachedDataset indices must be integers, got {type(index).__name__} ({index!r})"
            ) from None
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"CachedDataset index {index} out of range for a dataset of length {self._len}")
        return i

    def _load(self, index: int) -> Any:
        return self.dataset[index]

    def _load_many(self, indices: List[int]) -> List[Any]:
        many = getattr(self.dataset, "__getitems__", None)
        if many is None:
            return [self.dataset[i] for i in indices]
        out = many(indices)
        if type(out) is not list:
            raise TypeError(
                f"{type(self.dataset).__name__}.__getitems__ returned a {type(out).__name__}; CachedDataset "
                "(like torch's DataLoader) needs it to return a list with one sample per index, which it "
                "caches one by one. Return [sample for each index] and batch them in collate_fn, or remove "
                "__getitems__."
            )
        if len(out) != len(indices):
            raise ValueError(
                f"{type(self.dataset).__name__}.__getitems__ returned {len(out)} samples for "
                f"{len(indices)} indices; it must return a list with one sample per index"
            )
        return out

    def __getitem__(self, index: Any) -> Any:
        i = self._index(index)
        return self.cache_loader.get_many([i], self._load, self._load_many, what="dataset index")[0]

    def __getitems__(self, indices: Sequence[Any]) -> List[Any]:
        loader = self.cache_loader
        # One C loop validates the indices and formats their keys; anything unusual (negative,
        # numpy ints, out of range) takes the checked path that names the bad index.
        ks = _codec.int_keys(loader._prefix, indices, self._len)
        idx = indices if ks is not None else [self._index(i) for i in indices]
        return loader.get_many(idx, self._load, self._load_many, what="dataset index", store_keys=ks)

    def stats(self, this_process: bool = False) -> Dict[str, int]:
        """The cache counters, summed over this process and its DataLoader workers (see
        :meth:`CacheLoader.stats`)."""
        return self.cache_loader.stats(this_process)

    def warmup(
        self,
        num_workers: int = 0,
        progress: bool = True,
        batch_size: int = 64,
        multiprocessing_context: Optional[str] = None,
    ) -> int:
        """Compute and cache every sample not cached yet, with a tqdm progress bar.

        Args:
            num_workers: DataLoader worker processes computing samples (0: this process).
            progress: show a progress bar.
            batch_size: samples per batched read/write.
            multiprocessing_context: start method for the workers (default: torch's).

        Returns:
            The number of samples computed.

        Raises:
            ValueError: ``batch_size`` is not an int >= 1 or ``num_workers`` not an int >= 0 (checked
                before any sample is read).
        """
        from torch.utils.data import DataLoader
        from tqdm.auto import tqdm

        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"warmup: batch_size must be an int >= 1, got {batch_size!r}")
        if type(num_workers) is not int or num_workers < 0:
            raise ValueError(f"warmup: num_workers must be an int >= 0, got {num_workers!r}")

        missing: List[int] = []
        for start in range(0, self._len, 4096):
            idx = list(range(start, min(start + 4096, self._len)))
            missing += [i for i, hit in zip(idx, self.cache_loader.contains_many(idx)) if not hit]
        if not missing:
            return 0
        loader = DataLoader(
            _Warm(self, missing),
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=_identity,
            multiprocessing_context=multiprocessing_context if num_workers else None,
        )
        with tqdm(
            total=len(missing),
            disable=not progress,
            desc=f"caching {self.cache_loader.dataset_name!r}",
            unit="sample",
        ) as bar:
            for n in loader:
                bar.update(n)
        self.cache_loader.flush()
        return len(missing)

    def close(self) -> None:
        """Flush and close the cache (see :meth:`CacheLoader.close`)."""
        self.cache_loader.close()


def _identity(x: Any) -> Any:
    return x
