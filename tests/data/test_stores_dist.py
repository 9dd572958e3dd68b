"""RedisStore(hosts=None) under torch.distributed: one server per node, shared by every rank of the job."""

from __future__ import annotations

import pytest
from multiproc import run_ranks
from redisutil import requires_redis


def _ranks_share_one_server(rank, world_size):
    import torch.distributed as dist

    from trainloom.data.cache import CacheLoader
    from trainloom.data.stores import redis_store

    dist.init_process_group("gloo")
    try:
        loader = CacheLoader("redis", "dist", capacity_per_node=64 << 20)
        started = len(redis_store._NODE_SERVERS)
        loader.get(f"from{rank}", lambda k: k.upper())
        loader.flush()
        dist.barrier()
        seen = sorted(loader.get(f"from{r}", lambda k: None) for r in range(world_size))
        n = loader.num_keys()
        dist.barrier()  # rank 0 owns the server: keep it up until everyone has read
        if rank == 0:
            loader.store.shutdown()
        return loader.store.hosts, started, seen, n
    finally:
        dist.destroy_process_group()


@requires_redis
@pytest.mark.timeout(120)
def test_one_server_per_node_shared_by_ranks():
    out = run_ranks(_ranks_share_one_server, 2, timeout=90)
    hosts0, started0, seen0, n0 = out[0]
    hosts1, started1, seen1, n1 = out[1]
    assert hosts0 == hosts1 and len(hosts0) == 1  # one node, one server, same password
    assert (started0, started1) == (1, 0)  # only local rank 0 started a server
    assert seen0 == seen1 == ["FROM0", "FROM1"] and n0 == n1 == 2


def _two_nodes(rank, world_size):
    import torch.distributed as dist

    from trainloom.data.stores.redis_store import RedisStore
    from trainloom.errors import ConfigError

    dist.init_process_group("gloo")
    try:
        try:
            RedisStore(namespace="nodes", cluster_mode=True, capacity_per_node=64 << 20)
            err = None
        except ConfigError as exc:
            err = str(exc)
        dist.barrier()
        # The same node servers (started above) serve cluster_mode=False: node n uses server n.
        store = RedisStore(namespace="nodes", cluster_mode=False, capacity_per_node=64 << 20)
        store.set(f"k{rank}", b"x")
        port = store.stores[0].port
        dist.barrier()
        n = store.num_keys()
        dist.barrier()
        store.shutdown()
        return err, port, n
    finally:
        dist.destroy_process_group()


@requires_redis
@pytest.mark.timeout(120)
def test_two_nodes_each_start_a_server():
    # LOCAL_WORLD_SIZE=1: every rank is local rank 0 of its own "node".
    out = run_ranks(_two_nodes, 2, timeout=90, local_world_size=1)
    for err, _, _ in out:
        assert "listen on 127.0.0.1, which other nodes cannot reach. Pass bind=" in err
    assert out[0][1] != out[1][1] and out[0][2] == out[1][2] == 1
