"""Key-value stores behind the cache: ``Store`` (interface), ``LmdbStore`` (embedded default),
``RedisStore`` (one server per node, or servers you name) and ``ClusterStore`` (stable sharding).

``RedisStore`` is imported lazily (it needs the ``redis`` extra).
"""

from typing import Any

from trainloom.data.stores.base import (
    Store,
    StoreError,
    StoreFullError,
    StoreOutOfMemoryError,
    StoreUnavailableError,
    StoreValueRefusedError,
)
from trainloom.data.stores.cluster import ClusterStore, shard_of
from trainloom.data.stores.lmdb_store import LmdbStore, default_cache_dir

__all__ = [
    "Store",
    "StoreError",
    "StoreFullError",
    "StoreOutOfMemoryError",
    "StoreUnavailableError",
    "StoreValueRefusedError",
    "ClusterStore",
    "LmdbStore",
    "RedisStore",
    "default_cache_dir",
    "shard_of",
]


def __getattr__(name: str) -> Any:  # PEP 562: import redis only when RedisStore is used
    if name == "RedisStore":
        from trainloom.data.stores.redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
