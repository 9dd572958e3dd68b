"""Bad input to the samplers, the cache and the stores: each check raises its exact message."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from trainloom._locate import find_redis_server
from trainloom.data.cache import CachedDataset, CacheLoader
from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from trainloom.data.stores import LmdbStore
from trainloom.errors import ConfigError

SAMPLER = "LoadBalancingDistributedSampler"
BATCH = "LoadBalancingDistributedBatchSampler"


def _sampler(n=20, world=2, rank=0, **kw):
    lens = np.random.default_rng(n).integers(1, 100, n)
    return LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=world, rank=rank, **kw)


def _nest(levels):
    """``levels`` lists, one inside the other, around a 0."""
    x = 0
    for _ in range(levels):
        x = [x]
    return x


# --------------------------------------------------------------------------- samplers: arguments
def test_ragged_complexities_name_numpys_reason():
    ragged = [[1, 2], [3]]
    with pytest.raises(ValueError) as np_info:
        np.asarray(ragged)
    with pytest.raises(ConfigError) as info:
        LoadBalancingDistributedSampler(None, complexities=ragged)
    assert str(info.value) == f"{SAMPLER}: complexities must be a 1-D array of numbers ({np_info.value})"


def test_complexity_fn_without_a_dataset():
    with pytest.raises(ConfigError) as info:
        LoadBalancingDistributedSampler(None, complexity_fn=len)
    assert str(info.value) == f"{SAMPLER}: complexity_fn needs a dataset to read samples from"


def test_batch_fn_must_be_callable():
    with pytest.raises(ConfigError) as info:
        LoadBalancingDistributedBatchSampler(_sampler(), batch_fn=[[0, 1]])
    assert str(info.value) == f"{BATCH}: batch_fn must be callable, got list"


@pytest.mark.parametrize("cost", [(1.0,), (1, 2, 3), 5, None, ("a", 1)], ids=repr)
def test_cost_must_be_a_pair_of_numbers(cost):
    with pytest.raises(ConfigError) as info:
        LoadBalancingDistributedBatchSampler(_sampler(), max_complexity=100, cost=cost)
    assert str(info.value) == f"{BATCH}: cost must be a pair (a, b) of numbers, got {cost!r}"


@pytest.mark.parametrize(
    "value, name", [("100", "str"), (True, "bool"), ([100], "list"), (torch.tensor([50.0, 60.0]), "Tensor")]
)
def test_max_complexity_must_be_a_number(value, name):
    with pytest.raises(ConfigError) as info:
        LoadBalancingDistributedBatchSampler(_sampler(), max_complexity=value)
    assert str(info.value) == f"{BATCH}: max_complexity must be a number, got {name}"


@pytest.mark.parametrize("out, name", [(None, "NoneType"), ("0 1", "str"), (b"\x00", "bytes"), (3, "int")])
def test_batch_fn_returning_no_list_of_batches(out, name):
    bs = LoadBalancingDistributedBatchSampler(_sampler(), batch_fn=lambda idx: out)
    with pytest.raises(ConfigError) as info:
        len(bs)
    assert str(info.value) == f"batch_fn returned {name} for rank 0; it must return a list of index lists"


def test_batch_fn_returning_no_list_names_the_rank():
    calls = []

    def batch_fn(idx):  # fine for rank 0's indices, None for rank 1's
        calls.append(idx)
        return [idx] if len(calls) == 1 else None

    bs = LoadBalancingDistributedBatchSampler(_sampler(), batch_fn=batch_fn)
    with pytest.raises(ConfigError) as info:
        list(bs)
    assert str(info.value) == "batch_fn returned NoneType for rank 1; it must return a list of index lists"


# --------------------------------------------------------------------------- samplers: load_state_dict
@pytest.mark.parametrize("batch", [False, True], ids=["sampler", "batch_sampler"])
@pytest.mark.parametrize("state", [[("epoch", 0)], None, "state"], ids=["list", "None", "str"])
def test_load_state_dict_needs_a_dict(batch, state):
    obj = LoadBalancingDistributedBatchSampler(_sampler(), max_complexity=100) if batch else _sampler()
    with pytest.raises(ConfigError) as info:
        obj.load_state_dict(state)
    assert str(info.value) == (
        f"load_state_dict: expected a dict from state_dict(), got {type(state).__name__}"
    )


@pytest.mark.parametrize("batch", [False, True], ids=["sampler", "batch_sampler"])
@pytest.mark.parametrize("version", [0, 2, "1"])
def test_load_state_dict_rejects_another_state_version(batch, version):
    obj = LoadBalancingDistributedBatchSampler(_sampler(), max_complexity=100) if batch else _sampler()
    state = obj.state_dict()
    state["version"] = version
    with pytest.raises(ConfigError) as info:
        obj.load_state_dict(state)
    assert str(info.value) == (
        f"load_state_dict: the state has version {version}; this trainloom reads version 1 only (save it "
        "again with this version's state_dict())"
    )


@pytest.mark.parametrize(
    "key, saved, mine",
    [("shuffle", True, False), ("drop_last", True, False), ("random_level", 0.25, 0.0)],
)
def test_sampler_load_state_dict_rejects_another_configuration(key, saved, mine):
    state = _sampler(**{key: saved}).state_dict()
    target = _sampler(**{key: mine})
    with pytest.raises(ConfigError) as info:
        target.load_state_dict(state)
    assert str(info.value) == (
        f"load_state_dict: the state was saved with {key}={saved!r}, this sampler has {mine!r}; "
        "the resumed order would differ"
    )


@pytest.mark.parametrize("consumed", [-1, 12, 10**6])
def test_sampler_load_state_dict_consumed_outside_the_epoch(consumed):
    s = _sampler(n=21)  # 11 samples per rank
    state = s.state_dict()
    state["consumed"] = consumed
    with pytest.raises(ConfigError) as info:
        s.load_state_dict(state)
    assert str(info.value) == f"load_state_dict: consumed={consumed} is outside [0, 11]"
    state["consumed"] = 11  # the whole epoch: accepted
    s.load_state_dict(state)
    assert list(s) == []


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_batch_sampler_load_state_dict_consumed_outside_the_epoch_changes_nothing(mode):
    s = _sampler(n=60, seed=1)
    bs = LoadBalancingDistributedBatchSampler(s, max_complexity=150, mode=mode)
    other = LoadBalancingDistributedBatchSampler(_sampler(n=60, seed=7), max_complexity=150, mode=mode)
    other.set_epoch(3)
    total = len(other)
    first = next(iter(other))
    state = other.state_dict(consumed=0)
    for consumed in (-1, total + 1):
        state["consumed"] = consumed
        with pytest.raises(ConfigError) as info:
            bs.load_state_dict(state)
        assert str(info.value) == f"load_state_dict: consumed={consumed} is outside [0, {total}]"
        # The rejected state changed neither sampler: same seed, epoch and position.
        assert (s.seed, s.epoch, bs.epoch) == (1, 0, 0)
        assert bs.state_dict()["consumed"] == 0
    state["consumed"] = 0
    bs.load_state_dict(state)
    assert (s.seed, s.epoch) == (7, 3) and len(bs) == total and next(iter(bs)) == first


def test_plan_with_no_complete_step_is_unreachable_through_the_constructor():
    # The planners' "no complete step (drop_last=True)" errors need fewer samples than ranks, which
    # the constructor refuses first.
    s = LoadBalancingDistributedSampler(None, complexities=[5, 6, 7], num_replicas=4, rank=0)
    for mode in ("padded", "packed"):
        with pytest.raises(ConfigError) as info:
            LoadBalancingDistributedBatchSampler(s, max_complexity=10, mode=mode, drop_last=True)
        assert str(info.value) == (
            f"{BATCH}: num_replicas=4 is larger than the dataset (3 samples) and drop_last=True would "
            "leave no complete step; use drop_last=False or fewer replicas"
        )


# --------------------------------------------------------------------------- cache
def test_store_arguments_with_a_store_instance(tmp_path):
    store = LmdbStore(tmp_path / "db", namespace="ds")
    with pytest.raises(ValueError) as info:
        CacheLoader(store, "ds", path=tmp_path / "other", map_size=1 << 20)
    assert str(info.value) == "store arguments ['map_size', 'path'] cannot be used with a Store instance"


@pytest.mark.parametrize("value", [-1, 1.5, "64", None, True], ids=repr)
def test_max_buffer_bytes_must_be_an_int(tmp_path, value):
    with pytest.raises(ValueError) as info:
        CacheLoader(path=tmp_path, dataset_name="ds", max_buffer_bytes=value)
    assert str(info.value) == f"max_buffer_bytes must be an int >= 0, got {value!r}"


@pytest.mark.parametrize("value", [-0.5, float("nan"), "5", None, True], ids=repr)
def test_retry_interval_must_be_a_number_of_seconds(tmp_path, value):
    with pytest.raises(ValueError) as info:
        CacheLoader(path=tmp_path, dataset_name="ds", retry_interval=value)
    assert str(info.value) == f"retry_interval must be a number of seconds >= 0, got {value!r}"


def test_retry_interval_accepts_numpy_numbers(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="ds", retry_interval=np.int64(2))
    assert loader.retry_interval == 2.0
    loader.close()


def test_fingerprint_nesting_limit_is_the_same_for_cache_loader_and_cached_dataset(tmp_path):
    deepest = "fingerprint" + "[0]" * 101
    message = f"fingerprint= nests more than 100 levels deep (at {deepest})"
    with pytest.raises(TypeError) as info:
        CacheLoader(path=tmp_path, dataset_name="a", fingerprint=_nest(101))
    assert str(info.value) == message
    with pytest.raises(TypeError) as info:
        CachedDataset(list(range(3)), path=tmp_path, dataset_name="b", fingerprint=_nest(101))
    assert str(info.value) == message
    # 100 levels: accepted by both
    CacheLoader(path=tmp_path, dataset_name="c", fingerprint=_nest(100)).close()
    ds = CachedDataset(list(range(3)), path=tmp_path, dataset_name="d", fingerprint=_nest(100))
    ds.cache_loader.close()


def test_load_many_returning_too_few_values(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="lm")
    assert loader.get(1, lambda k: k * 10) == 10
    with pytest.raises(ValueError) as info:
        loader.get_many([0, 1, 2], lambda k: k * 10, load_many=lambda ks: [k * 10 for k in ks][:1])
    assert str(info.value) == "load_many returned 1 values for 2 keys"  # the two misses
    assert loader.get_many([0, 1, 2], lambda k: -1, load_many=lambda ks: [k * 10 for k in ks]) == [0, 10, 20]
    loader.close()


# --------------------------------------------------------------------------- stores
@pytest.mark.parametrize("namespace, name", [(None, "NoneType"), (b"ds", "bytes"), (3, "int")])
def test_namespace_must_be_a_str(tmp_path, namespace, name):
    with pytest.raises(TypeError) as info:
        LmdbStore(tmp_path, namespace=namespace)
    assert str(info.value) == f"namespace must be a str, got {name}"


@pytest.mark.parametrize("namespace", ["a\x00b", "x" * 401, "é" * 201], ids=["NUL", "401 bytes", "402 bytes"])
def test_namespace_without_nul_and_at_most_400_bytes(tmp_path, namespace):
    message = f"namespace {namespace!r} must not contain NUL and be at most 400 bytes of UTF-8"
    with pytest.raises(ValueError) as info:
        LmdbStore(tmp_path, namespace=namespace)
    assert str(info.value) == message
    with pytest.raises(ValueError) as info:  # the cache's dataset_name is the namespace
        CacheLoader(path=tmp_path, dataset_name=namespace)
    assert str(info.value) == message
    assert LmdbStore(tmp_path, namespace="é" * 200).namespace == "é" * 200  # 400 bytes


@pytest.mark.parametrize("retries", [-1, 1.5, "2", None, True], ids=repr)
def test_redis_store_retries_must_be_an_int(retries):
    pytest.importorskip("redis")
    from trainloom.data.stores.redis_store import RedisStore

    with pytest.raises(ValueError) as info:  # checked before any connection is made
        RedisStore(hosts=[{"host": "127.0.0.1", "port": 1}], retries=retries)
    assert str(info.value) == f"RedisStore: retries must be an int >= 0, got {retries!r}"


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"retries": -1}, ValueError("RedisStore: retries must be an int >= 0, got -1")),
        ({"timeout": 0}, ValueError("RedisStore: timeout must be > 0 seconds, got 0")),
        ({"timeout": "1"}, ValueError("RedisStore: timeout must be > 0 seconds, got '1'")),
        ({"namespace": 3}, TypeError("namespace must be a str, got int")),
    ],
    ids=["retries", "timeout", "timeout-str", "namespace"],
)
def test_redis_store_checks_its_arguments_before_starting_a_server(kwargs, error, monkeypatch):
    # hosts=None starts a redis-server for the node: a bad client argument used to be found only
    # after it had started (and then left it running for nothing).
    pytest.importorskip("redis")
    from trainloom.data.stores import redis_store

    started = []
    monkeypatch.setattr(redis_store, "_spawn_hosts", lambda *a: started.append(a) or [])
    with pytest.raises(type(error)) as info:
        redis_store.RedisStore(**kwargs)
    assert str(info.value) == str(error) and started == []


@pytest.mark.skipif(find_redis_server() is None, reason="needs a redis-server binary")
def test_redis_server_handle_cannot_be_pickled():
    from trainloom.data.stores.redis_server import RedisServer

    srv = RedisServer()  # not started: pickling is refused all the same
    with pytest.raises(TypeError) as info:
        pickle.dumps(srv)
    assert str(info.value) == (
        "a RedisServer handle cannot be pickled; pickle the RedisStore (it drops the handle)"
    )
