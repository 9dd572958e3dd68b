"""``ClusterStore``: shard keys over several stores with a stable 64-bit hash (Bagua's ``ClusterStore``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, cast

from trainloom.data.codec import hash64
from trainloom.data.stores.base import (
    Key,
    Store,
    StoreFullError,
    StoreValueRefusedError,
    Value,
    check_mapping,
    key_bytes,
    mget_decode_missing,
)
from trainloom.errors import ConfigError, StoreError

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
        written: List[bytes] = []  # the keys of shards that took their whole part
        failed: List[Tuple[int, Dict[Key, Value], Exception]] = []
        for shard, part in groups.items():
            try:
                self.stores[shard].mset(part)
            except (StoreError, ConfigError) as exc:  # the other shards are still written
                failed.append((shard, part, exc))
            else:
                written.extend(key_bytes(k) for k in part)
        if failed:
            raise self._batch_error(dictionary, written, failed)

    def _batch_error(
        self,
        batch: Mapping[Key, Value],
        written: List[bytes],
        failed: List[Tuple[int, Dict[Key, Value], Exception]],
    ) -> Exception:
        """The error of a batch some shards failed to write, saying what the whole batch became: a
        caller (the cache) takes a StoreFullError's ``written`` and a StoreValueRefusedError's
        ``keys``/``others_written`` as facts about every key it passed, not only the failing shard's.

        - every failing shard refused values it names and wrote the rest: one StoreValueRefusedError
          naming them all, ``others_written=True``;
        - else every failing shard is full (LMDB at ``max_map_size``) or refused named values: one
          StoreFullError whose ``written`` holds the other shards' keys, what each full shard says it
          wrote (nothing when it does not say) and the refusing shards' other keys;
        - else (a shard unreachable, out of memory, or a failure that says nothing of what was
          written) the first such error, as the shard raised it: the caller must assume none of
          the batch was written."""
        for _, _, e in failed:
            known = isinstance(e, StoreValueRefusedError) and e.accounts_for_batch
            if not (known or isinstance(e, StoreFullError)):
                return e
        stored = list(written)
        refused: List[bytes] = []
        for _, part, e in failed:
            if isinstance(e, StoreFullError):
                stored.extend(e.written or ())
            else:
                gone = set(cast(StoreValueRefusedError, e).keys or ())
                refused.extend(gone)
                stored.extend(k for k in map(key_bytes, part) if k not in gone)
        shard, _, first = next((f for f in failed if isinstance(f[2], StoreFullError)), failed[0])
        e0 = cast(StoreError, first)
        message = (
            f"{e0.message} (ClusterStore shard {shard} of {len(self.stores)}; {len(stored)} of the batch's "
            f"{len(batch)} value(s) written)"
        )
        err: StoreError
        if isinstance(e0, StoreFullError):
            done = set(stored)
            rest = [k for k in map(key_bytes, batch) if k not in done]
            err = StoreFullError(message, e0.backend, e0.key, written=stored, not_written=rest)
        else:
            err = StoreValueRefusedError(message, e0.backend, e0.key, keys=refused, others_written=True)
        err.__cause__ = first
        return err

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
