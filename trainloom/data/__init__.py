"""trainloom.data: cached datasets (LMDB, Redis) and load-balancing distributed samplers."""

from trainloom.data.cache import CacheClosedError, CachedDataset, CacheLoader
from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from trainloom.data.stores import ClusterStore, LmdbStore, Store
from trainloom.data.stores.redis_store import RedisStore

__all__ = [
    "CacheClosedError",
    "CacheLoader",
    "CachedDataset",
    "ClusterStore",
    "LmdbStore",
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "RedisStore",
    "Store",
]
