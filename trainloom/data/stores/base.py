"""The key-value store interface shared by every backend (Bagua's ``Store``), plus trainloom's errors.

Keys are ``str`` (or ``bytes``); values are ``bytes``-like. A store lives in a *namespace*: ``num_keys()``
and ``clear()`` act on that namespace only, never on the whole database, so two caches sharing one
LMDB file or one Redis server never see or delete each other's entries.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from trainloom.data.codec import _codec
from trainloom.errors import StoreError

__all__ = [
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "StoreFullError",
    "StoreOutOfMemoryError",
    "StoreValueRefusedError",
    "Key",
    "Value",
]

Key = Union[str, bytes]
Value = Union[bytes, bytearray, memoryview, str]
T = TypeVar("T")
_S = TypeVar("_S", bound="Store")


class StoreUnavailableError(StoreError, ConnectionError):
    """The store cannot be reached (server down, paused, timed out, refused the password)."""


class StoreFullError(StoreError):
    """The store is full and could not grow (LMDB map at its ``max_map_size`` cap, or a full disk).

    Attributes:
        written: the keys of the ``mset`` batch stored before the store was found full (LMDB writes a
            batch that fails at ``max_map_size`` value by value), as bytes (str keys UTF-8); ``None``
            when the store does not say.
        not_written: the other keys of that batch, not stored; ``None`` when the store does not say.
    """

    def __init__(
        self,
        message: str,
        backend: Optional[str] = None,
        key: Optional[str] = None,
        written: Optional[Sequence[bytes]] = None,
        not_written: Optional[Sequence[bytes]] = None,
    ) -> None:
        super().__init__(message, backend, key)
        self.written = None if written is None else tuple(written)
        self.not_written = None if not_written is None else tuple(not_written)


class StoreOutOfMemoryError(StoreError):
    """A Redis server refused a write because it reached ``maxmemory`` (policy ``noeviction``)."""


class StoreValueRefusedError(StoreError):
    """The store refuses one value itself (e.g. larger than a Redis server's ``proto-max-bulk-len``),
    before anything is sent; the store is fine and other values can be written.

    The cache drops such a value (not cached, recomputed when next read) and writes the others.

    Attributes:
        keys: every refused key of the ``mset`` batch, as bytes (str keys UTF-8), or ``None`` when the
            store names only the first one (:attr:`key`).
        others_written: whether every other value of the batch was written (LMDB's value-by-value
            write at ``max_map_size``); ``False`` when nothing was written (Redis checks sizes before
            sending anything). With ``keys`` and ``others_written`` the cache drops exactly ``keys``
            and counts the rest as written, without writing anything again.
    """

    def __init__(
        self,
        message: str,
        backend: Optional[str] = None,
        key: Optional[str] = None,
        keys: Optional[Sequence[bytes]] = None,
        others_written: bool = False,
    ) -> None:
        super().__init__(message, backend, key)
        self.keys: Optional[Tuple[bytes, ...]] = tuple(keys) if keys is not None else None
        self.others_written = bool(others_written)

    @property
    def accounts_for_batch(self) -> bool:
        """Whether it names every refused key and says every other value of the batch was written
        (the caller then knows the fate of each value without writing anything again)."""
        return self.keys is not None and self.others_written


def key_bytes(key: Key) -> bytes:
    """A key as bytes (str keys are UTF-8)."""
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, (bytes, bytearray)):
        return bytes(key)
    raise TypeError(f"store keys must be str or bytes, got {type(key).__name__} ({key!r})")


def as_bytes(value: Any) -> bytes:
    """A stored value as ``bytes``; a ``str`` value (Bagua's stores may return them) as its UTF-8."""
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


def check_mapping(dictionary: Any, who: str) -> None:
    """Raise TypeError unless ``dictionary`` is a mapping (``mset`` takes ``{key: value}``)."""
    if not isinstance(dictionary, Mapping):
        raise TypeError(
            f"{who}.mset takes a mapping of key -> value (e.g. dict(pairs)), got {type(dictionary).__name__}"
        )


def value_bytes(key: Key, value: Value) -> Union[bytes, bytearray, memoryview]:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value
    raise TypeError(f"store values must be bytes-like or str, got {type(value).__name__} for key {key!r}")


class Store(abc.ABC):
    """Base class of key-value stores: ``get``/``set``/``mget``/``mset``, ``num_keys``, ``clear``,
    ``status``, ``shutdown``, ``close`` and use as a context manager.

    Subclasses implement :meth:`mset`, :meth:`num_keys`, :meth:`clear` and :meth:`status`, and
    either :meth:`mget_apply` (trainloom's stores: no copy of the values) or :meth:`mget` (Bagua's
    interface; ``get`` alone also works). :meth:`close` is a no-op unless overridden; the rest is
    derived. A store written to Bagua's ``Store`` (``get, set, mget, mset, num_keys, clear, status,
    shutdown``) works as is, also when its values come back as ``str``.

    Example::

        >>> class DictStore(Store):   # Bagua's interface
        ...     def __init__(self): self.d = {}
        ...     def mget(self, keys): return [self.d.get(k) for k in keys]
        ...     def mset(self, dictionary): self.d.update(dictionary)
        ...     def num_keys(self): return len(self.d)
        ...     def clear(self): self.d.clear()
        ...     def status(self): return True
        >>> CacheLoader(DictStore(), "ds").get(1, lambda k: k + 1)
        2
    """

    #: short backend name used in errors and stats ("lmdb", "redis", "cluster").
    backend: str = "store"
    #: the namespace (the cache's dataset_name) this store reads and writes; set by every subclass.
    namespace: Optional[str]
    #: longest key in bytes the store accepts, or None (no limit the cache must check).
    max_key_size: Optional[int] = None
    #: whether two threads of one process may call the store at once (the cache serialises its calls
    #: with its background flush otherwise).
    thread_safe: bool = False

    # -- required -----------------------------------------------------------------------------
    def mget_apply(self, keys: Sequence[Key], fn: Callable[[Any], T]) -> List[Optional[T]]:
        """For each key, ``fn(value_buffer)`` or ``None`` when the key is missing.

        ``value_buffer`` may be a buffer that is only valid during the call to ``fn`` (LMDB hands out
        views of its memory map inside the read transaction): ``fn`` must copy what it keeps.

        The default is built on the subclass's :meth:`mget` (or :meth:`get`), with ``str`` values
        passed to ``fn`` as UTF-8 bytes.
        """
        cls = type(self)
        if cls.mget is not Store.mget:
            values = self.mget(keys)
        elif cls.get is not Store.get:
            values = [self.get(k) for k in keys]
        else:
            raise NotImplementedError(
                f"{cls.__name__} must implement mget_apply(keys, fn) or mget(keys) (or get(key))"
            )
        return [None if v is None else fn(v.encode("utf-8") if isinstance(v, str) else v) for v in values]

    @abc.abstractmethod
    def mset(self, dictionary: Mapping[Key, Value]) -> None:
        """Set every key-value pair of ``dictionary`` (one batch, one round trip or transaction)."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """The number of keys in this store's namespace."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Delete every key of this store's namespace (and nothing else)."""

    @abc.abstractmethod
    def status(self) -> bool:
        """``True`` when the store is alive and answers."""

    def close(self) -> None:
        """Release this process's handles (idempotent). The data stays; see :meth:`shutdown`.

        The default does nothing (a store with no handles, or one written to Bagua's interface,
        which has no ``close``)."""
        return None

    # -- derived ------------------------------------------------------------------------------
    def mget_decode(self, keys: Sequence[Key], missing: Any = None) -> Tuple[List[Any], int]:
        """Values of ``keys`` decoded with :func:`trainloom.data.codec.decode` (``missing`` when a key
        has no entry, so that a stored ``None`` can be told apart), and the number of bytes read.
        Backends override this with a batched loop in C.

        Raises:
            CodecError: a value is damaged or not an encoded value (the caller retries per item).
        """
        return _codec.decode_list(self.mget_apply(keys, as_bytes), missing)

    def get(self, key: Key) -> Optional[bytes]:
        """The value of ``key`` as ``bytes``, or ``None`` if it does not exist."""
        return self.mget([key])[0]

    def mget(self, keys: Sequence[Key]) -> List[Optional[bytes]]:
        """The values of ``keys`` (``None`` for missing keys), in the same order."""
        return self.mget_apply(keys, as_bytes)

    def set(self, key: Key, value: Value) -> None:
        """Set ``key`` to ``value``."""
        self.mset({key: value})

    def reset_if_changed(self, key: Key, value: bytes) -> bool:
        """When ``key`` holds another value than ``value``: clear the namespace, then set ``key`` to
        ``value``. When it holds none (a new namespace, or the entry was evicted or flushed), only set it.

        Used for the cache fingerprint. Backends make this atomic where they can (LMDB does it in one
        write transaction).

        Returns:
            True when entries were dropped.
        """
        cur = self.get(key)
        if cur is not None and as_bytes(cur) == value:
            return False
        dropped = cur is not None and self.num_keys() > 0
        if dropped:
            self.clear()
        self.set(key, value)
        return dropped

    def copies(self, key: Key) -> int:
        """How many entries ``key`` has in this store: 0 or 1 (a cluster counts one per shard holding it).

        :meth:`num_keys` counts them all; the cache subtracts its fingerprint entries with this.
        """
        return int(self.get(key) is not None)

    def shutdown(self) -> None:
        """Stop the servers this store started (none for embedded stores) and close it."""
        self.close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _takes_missing(store: Store) -> bool:
    fn = type(store).mget_decode
    cached = _TAKES_MISSING.get(fn)
    if cached is None:
        params: Mapping[str, inspect.Parameter]
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        cached = _TAKES_MISSING[fn] = "missing" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
    return cached


_TAKES_MISSING: dict = {}


def mget_decode_missing(store: Store, keys: Sequence[Key], missing: Any) -> Tuple[List[Any], int]:
    """``store.mget_decode(keys, missing=missing)``, also for a subclass that overrides
    ``mget_decode(keys)`` without ``missing`` (written for an older trainloom): its None results (absent
    key or stored None) are read again through ``mget_apply``, which tells the two apart."""
    if _takes_missing(store):
        return store.mget_decode(keys, missing=missing)
    out, nbytes = store.mget_decode(keys)
    again = [i for i, v in enumerate(out) if v is None]
    if again:

        def one(buf: Any) -> Any:
            nonlocal nbytes
            b = as_bytes(buf) if isinstance(buf, str) else buf
            nbytes += len(b)
            return (_codec.decode(b, True),)  # boxed: a decoded None is not "absent"

        for i, v in zip(again, store.mget_apply([keys[i] for i in again], one)):
            out[i] = missing if v is None else v[0]
    return out, nbytes


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    try:
        encoded = namespace.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"namespace {namespace!r} (the dataset_name) holds a lone surrogate "
            f"({namespace[exc.start]!r} at position {exc.start}), e.g. from a file name that is not valid "
            "UTF-8; pass a name that is valid text, e.g. name.encode('utf-8', 'surrogateescape')"
            ".decode('utf-8', 'replace')"
        ) from None
    if "\x00" in namespace or len(encoded) > 400:
        raise ValueError(f"namespace {namespace!r} must not contain NUL and be at most 400 bytes of UTF-8")
    return namespace
