"""``ClusterStore``: shard keys over several stores with a stable 64-bit hash (Bagua's ``ClusterStore``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

from trainloom.data.codec import hash64
from trainloom.data.stores.base import Key, Store, Value, check_mapping, key_bytes, mget_decode_missing

__all__ = ["ClusterStore", "shard_of"]

T = TypeVar("T")


def shard_of(key: Key, num_shards: int) -> int:
    """The shard of ``key``: XXH64(key as UTF-8) mod ``num_shards``, the same in every process and run."""
    return hash64(key_bytes(key)) % num_shards


class ClusterStore(Store):
    """Shards entries over ``stores`` by a stable 64-bit hash of the key (XXH64, not Python's ``hash``,
    which is salted per process).

    Args:
        stores: the stores to shard over (at least one). Their order defines the shards.

    Example::

        >>> cluster = ClusterStore([LmdbStore(tmp_path / "a"), LmdbStore(tmp_path / "b")])
        >>> cluster.mset({"x": b"1", "y": b"2"})
        >>> cluster.mget(["x", "y"])
        [b'1', b'2']
    """

    backend = "cluster"

    def __init__(self, stores: Sequence[Store]) -> None:
        stores = list(stores)
        if not stores:
            raise ValueError("ClusterStore needs at least one store")
        for i, s in enumerate(stores):
            if not isinstance(s, Store):
                raise TypeError(f"ClusterStore: stores[{i}] is a {type(s).__name__}, not a trainloom Store")
        self.stores = stores

    def _shard(self, key: Key) -> int:
        return shard_of(key, len(self.stores)) if len(self.stores) > 1 else 0

    def mget_apply(self, keys: Sequence[Key], fn: Callable[[Any], T]) -> List[Optional[T]]:
        if len(self.stores) == 1:
            return self.stores[0].mget_apply(keys, fn)
        groups: Dict[int, List[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self._shard(k), []).append(i)
        out: List[Optional[T]] = [None] * len(keys)
        for shard, idx in groups.items():
            vals = self.stores[shard].mget_apply([keys[i] for i in idx], fn)
            for i, v in zip(idx, vals):
                out[i] = v
        return out

    @property
    def thread_safe(self) -> bool:  # type: ignore[override]
        return bool(self.stores) and all(s.thread_safe for s in self.stores)

    @property
    def max_key_size(self) -> Optional[int]:  # type: ignore[override]
        """The smallest key limit of the shards (None: none has one)."""
        limits = [s.max_key_size for s in self.stores if s.max_key_size]
        return min(limits) if limits else None

    def mget_decode(self, keys: Sequence[Key], missing: Any = None) -> Tuple[List[Any], int]:
        if len(self.stores) == 1:
            return mget_decode_missing(self.stores[0], keys, missing)
        groups: Dict[int, List[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self._shard(k), []).append(i)
        out: List[Any] = [missing] * len(keys)
        total = 0
        for shard, idx in groups.items():
            vals, n = mget_decode_missing(self.stores[shard], [keys[i] for i in idx], missing)
            total += n
            for i, v in zip(idx, vals):
                out[i] = v
        return out, total

    def mset(self, dictionary: Mapping[Key, Value]) -> None:
        check_mapping(dictionary, type(self).__name__)
        if len(self.stores) == 1:
            self.stores[0].mset(dictionary)
            return
        groups: Dict[int, Dict[Key, Value]] = {}
        for k, v in dictionary.items():
            groups.setdefault(self._shard(k), {})[k] = v
        for shard, part in groups.items():
            self.stores[shard].mset(part)

    def num_keys(self) -> int:
        return sum(s.num_keys() for s in self.stores)

    def copies(self, key: Key) -> int:
        # reset_if_changed puts the fingerprint on every shard, not only on key's own shard.
        return sum(s.copies(key) for s in self.stores)

    def clear(self) -> None:
        for s in self.stores:
            s.clear()

    def reset_if_changed(self, key: Key, value: bytes) -> bool:
        # The fingerprint lives on every shard, so each shard checks its own entries atomically.
        dropped = False
        for s in self.stores:
            dropped = s.reset_if_changed(key, value) or dropped
        return dropped

    def status(self) -> bool:
        return all(s.status() for s in self.stores)

    def shutdown(self) -> None:
        for s in self.stores:
            s.shutdown()

    def close(self) -> None:
        for s in self.stores:
            s.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.stores!r})"
