"""The key-value store interface shared by every backend (Bagua's ``Store``), plus trainloom's errors.

Keys are ``str`` (or ``bytes``); values are ``bytes``-like. A store lives in a *namespace*: ``num_keys()``
and ``clear()`` act on that namespace only, never on the whole database, so two caches sharing one
LMDB file or one Redis server never see or delete each other's entries.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from trainloom.errors import StoreError

__all__ = [
    "Store",
    "StoreError",
    "StoreUnavailableError",
    "StoreFullError",
    "StoreOutOfMemoryError",
    "Key",
    "Value",
]

Key = Union[str, bytes]
Value = Union[bytes, bytearray, memoryview, str]
T = TypeVar("T")


class StoreUnavailableError(StoreError, ConnectionError):
    """The store cannot be reached (server down, paused, timed out, refused the password)."""


class StoreFullError(StoreError):
    """The store is full and could not grow (LMDB map at its ``max_map_size`` cap)."""


class StoreOutOfMemoryError(StoreError):
    """A Redis server refused a write because it reached ``maxmemory`` (policy ``noeviction``)."""


def key_bytes(key: Key) -> bytes:
    """A key as bytes (str keys are UTF-8)."""
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, (bytes, bytearray)):
        return bytes(key)
    raise TypeError(f"store keys must be str or bytes, got {type(key).__name__} ({key!r})")


def value_bytes(key: Key, value: Value) -> Union[bytes, bytearray, memoryview]:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value
    raise TypeError(f"store values must be bytes-like or str, got {type(value).__name__} for key {key!r}")


class Store(abc.ABC):
    """Base class of key-value stores: ``get``/``set``/``mget``/``mset``, ``num_keys``, ``clear``,
    ``status``, ``shutdown``, ``close`` and use as a context manager.

    Subclasses implement :meth:`mget_apply`, :meth:`mset`, :meth:`num_keys`, :meth:`clear`,
    :meth:`status` and :meth:`close`; the rest is derived.
    """

    #: short backend name used in errors and stats ("lmdb", "redis", "cluster").
    backend: str = "store"

    # -- required -----------------------------------------------------------------------------
    @abc.abstractmethod
    def mget_apply(self, keys: Sequence[Key], fn: Callable[[Any], T]) -> List[Optional[T]]:
        """For each key, ``fn(value_buffer)`` or ``None`` when the key is missing.

        ``value_buffer`` may be a buffer that is only valid during the call to ``fn`` (LMDB hands out
        views of its memory map inside the read transaction): ``fn`` must copy what it keeps.
        """

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

    @abc.abstractmethod
    def close(self) -> None:
        """Release this process's handles (idempotent). The data stays; see :meth:`shutdown`."""

    # -- derived ------------------------------------------------------------------------------
    def mget_decode(self, keys: Sequence[Key]) -> Tuple[List[Any], int]:
        """Values of ``keys`` decoded with :func:`trainloom.data.codec.decode` (``None`` when missing),
        and the number of bytes read. Backends override this with a batched loop in C.

        Raises:
            CodecError: a value is damaged or not an encoded value (the caller retries per item).
        """
        from trainloom.data.codec import _codec

        return _codec.decode_list(self.mget_apply(keys, bytes))

    def get(self, key: Key) -> Optional[bytes]:
        """The value of ``key`` as ``bytes``, or ``None`` if it does not exist."""
        return self.mget([key])[0]

    def mget(self, keys: Sequence[Key]) -> List[Optional[bytes]]:
        """The values of ``keys`` (``None`` for missing keys), in the same order."""
        return self.mget_apply(keys, bytes)

    def set(self, key: Key, value: Value) -> None:
        """Set ``key`` to ``value``."""
        self.mset({key: value})

    def reset_if_changed(self, key: Key, value: bytes) -> bool:
        """Unless ``key`` already holds ``value``: clear the namespace, then set ``key`` to ``value``.

        Used for the cache fingerprint. Backends make this atomic where they can (LMDB does it in one
        write transaction).

        Returns:
            True when entries were dropped.
        """
        cur = self.get(key)
        if cur is not None and cur == value:
            return False
        dropped = self.num_keys() > 0
        if dropped:
            self.clear()
        self.set(key, value)
        return dropped

    def shutdown(self) -> None:
        """Stop the servers this store started (none for embedded stores) and close it."""
        self.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
    if "\x00" in namespace or len(namespace.encode("utf-8")) > 400:
        raise ValueError(f"namespace {namespace!r} must not contain NUL and be at most 400 bytes of UTF-8")
    return namespace
