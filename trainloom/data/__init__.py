"""trainloom.data."""

from trainloom.data.cache import CacheClosedError, CachedDataset, CacheLoader  # noqa: E402,F401
from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler  # noqa: E402,F401
from trainloom.data.stores import ClusterStore, LmdbStore, Store  # noqa: E402,F401
from trainloom.data.stores.redis_store import RedisStore  # noqa: E402,F401
