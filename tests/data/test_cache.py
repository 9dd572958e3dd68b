"""CacheLoader / CachedDataset over real LMDB files and real redis-server processes."""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from redisutil import requires_redis
from torch.utils.data import DataLoader, Dataset

from trainloom.data import cache as cache_module
from trainloom.data.cache import CacheClosedError, CachedDataset, CacheLoader
from trainloom.data.codec import CodecError, encode
from trainloom.data.stores import LmdbStore, StoreError
from trainloom.data.stores.base import StoreUnavailableError
from trainloom.errors import ConfigError


class CountingDataset(Dataset):
    """Each computation appends one line to a log file, so computations in workers are counted too."""

    def __init__(self, n: int, log_path: str, shape=(3, 4)) -> None:
        self.n = n
        self.log_path = str(log_path)
        self.shape = shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with open(self.log_path, "a") as fh:
            fh.write(f"{i}\n")
        return torch.full(self.shape, i, dtype=torch.int32), {"label": i, "name": f"s{i}"}

    def computed(self) -> list:
        if not os.path.exists(self.log_path):
            return []
        with open(self.log_path) as fh:
            return [int(x) for x in fh.read().split()]


def check_batch(batch, start=None):
    x, meta = batch
    assert torch.equal(x[:, 0, 0], meta["label"].to(torch.int32))


def test_cache_loader_get_and_stats(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="sq")
    assert loader.get(3, lambda k: k * k) == 9
    assert loader.get(3, lambda k: -1) == 9
    assert loader.key(3) == b"sq_3" and loader.key("x") == b"sq_x"
    assert loader.store.get("sq_3") is not None
    s = loader.stats()
    assert (s["hits"], s["misses"], s["writes"]) == (1, 1, 1) and s["bytes_read"] > 0
    assert loader.num_keys() == 1
    loader.close()
    loader.close()  # idempotent


def test_bagua_style_positional_arguments(tmp_path):
    loader = CacheLoader("lmdb", "ds", 2, path=tmp_path)
    assert (loader.dataset_name, loader.writer_buffer_size, loader.backend) == ("ds", 2, "lmdb")
    ds = CachedDataset(CountingDataset(4, tmp_path / "log"), "lmdb", "ds2", 3, path=tmp_path)
    assert ds.cache_loader.writer_buffer_size == 3 and len(ds) == 4


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError) as e:
        CacheLoader(path=tmp_path, writer_buffer_size=-1)
    assert str(e.value) == (
        "writer_buffer_size must be an int >= 0 (0 writes every value at once, as 1 does), got -1"
    )
    with pytest.raises(ValueError, match=r"writer_buffer_size must be an int >= 0 .*, got 2.0"):
        CacheLoader(path=tmp_path, writer_buffer_size=2.0)
    loader = CacheLoader(path=tmp_path, dataset_name="zero", writer_buffer_size=0)  # Bagua's max(1, n)
    assert loader.writer_buffer_size == 1
    loader.close()
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'bypass', got 'ignore'"):
        CacheLoader(path=tmp_path, on_error="ignore")
    with pytest.raises(ValueError, match="unknown cache backend 'memcached'"):
        CacheLoader("memcached")
    with pytest.raises(TypeError, match="dataset_name must be a str, got int"):
        CacheLoader(path=tmp_path, dataset_name=3)
    with pytest.raises(TypeError, match="map-style dataset"):
        CachedDataset(iter([1, 2]), path=tmp_path)
    ds = CachedDataset(CountingDataset(5, tmp_path / "log"), path=tmp_path)
    with pytest.raises(IndexError, match="index 5 out of range for a dataset of length 5"):
        ds[5]
    with pytest.raises(TypeError, match="indices must be integers, got str"):
        ds["1"]
    assert torch.equal(ds[-1][0], ds[4][0])


def test_buffered_writes_flush_on_flush_and_close(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="b", writer_buffer_size=10)
    for i in range(7):
        loader.get(i, lambda k: k)
    assert loader.store.num_keys() == 0 and loader.stats()["buffered"] == 7
    assert loader.get(3, lambda k: -1) == 3  # served from the write buffer, not recomputed
    loader.flush()
    assert loader.store.num_keys() == 7 and loader.stats()["buffered"] == 0
    for i in range(7, 10):
        loader.get(i, lambda k: k)
    loader.close()
    assert CacheLoader(path=tmp_path, dataset_name="b").num_keys() == 10


def test_buffered_writes_flush_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(f"""
        from trainloom.data.cache import CacheLoader
        loader = CacheLoader(path={str(tmp_path)!r}, dataset_name="exit", writer_buffer_size=1000)
        for i in range(25):
            loader.get(i, lambda k: [k] * 3)
        # no flush(), no close()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    loader = CacheLoader(path=tmp_path, dataset_name="exit")
    assert loader.num_keys() == 25 and loader.get(24, lambda k: None) == [24] * 3


@pytest.mark.parametrize(
    "method,persistent",
    [("fork", False), ("fork", True), ("spawn", False), ("forkserver", True)],
)
def test_dataloader_workers_lose_no_writes(tmp_path, method, persistent):
    base = CountingDataset(50, tmp_path / "log")
    ds = CachedDataset(base, path=tmp_path / "db", dataset_name="w", writer_buffer_size=20)
    ds[0]  # the parent's LMDB environment is open (and holds a buffered write) when workers start
    dl = DataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context=method, persistent_workers=persistent
    )
    for batch in dl:
        check_batch(batch)
    if persistent:  # the workers are alive: their counts so far are seen
        live = ds.stats()
        assert live["processes"] == 3 and live["hits"] + live["misses"] == 1 + 50
    del dl  # persistent workers stop here; their Finalize flushes
    ds.cache_loader.flush()  # the parent's own ds[0]
    # 25 per worker, buffer of 20: 5 values per worker were flushed only when the worker stopped.
    assert ds.cache_loader.store.num_keys() == 1 + 50
    computed = base.computed()
    assert sorted(set(computed)) == list(range(50))
    # stats() counts the workers' reads and writes too (they exited: their final counts).
    s = ds.stats()
    assert s["processes"] == 3 and s["hits"] + s["misses"] == 1 + 50 and s["misses"] == len(computed)
    assert s["writes"] == len(computed) and s["buffered"] == 0
    mine = ds.stats(this_process=True)
    assert (mine["processes"], mine["hits"], mine["misses"], mine["writes"]) == (1, 0, 1, 1)
    for batch in DataLoader(ds, batch_size=4):
        check_batch(batch)
    assert len(base.computed()) == len(computed)  # second epoch: nothing recomputed
    assert ds.stats()["hits"] == s["hits"] + 50 and ds.stats(this_process=True)["hits"] == 50


def test_dataloader_no_workers_and_batched_reads(tmp_path):
    class CountingStore(LmdbStore):
        calls = 0

        def mget_decode(self, keys):
            CountingStore.calls += 1
            return super().mget_decode(keys)

    base = CountingDataset(30, tmp_path / "log")
    ds = CachedDataset(base, CountingStore(tmp_path / "db", namespace="n"), "n", writer_buffer_size=7)
    for batch in DataLoader(ds, batch_size=8):
        check_batch(batch)
    assert ds.cache_loader.store.num_keys() == 1 + 28  # fingerprint + 4 full buffers of 7; 2 buffered
    assert ds.cache_loader.num_keys() == 30  # flushes this process's buffer first
    CountingStore.calls = 0
    for batch in DataLoader(ds, batch_size=8):
        check_batch(batch)
    assert CountingStore.calls == 4  # one batched read per batch (__getitems__)
    assert ds.stats()["hits"] == 30 and len(base.computed()) == 30


def test_damaged_values_are_detected_and_recomputed(tmp_path):
    base = CountingDataset(6, tmp_path / "log")
    ds = CachedDataset(base, path=tmp_path, dataset_name="c", writer_buffer_size=1)
    for i in range(6):
        ds[i]
    store, key = ds.cache_loader.store, ds.cache_loader.key
    good = store.get(key(2))
    bad = bytearray(good)
    bad[-3] ^= 0xFF
    store.mset({key(2): bytes(bad), key(4): b"not an encoded value"})
    out = ds.__getitems__([1, 2, 3, 4])
    assert [int(x[0][0, 0]) for x in out] == [1, 2, 3, 4]
    assert ds.stats()["corrupt"] == 2
    assert base.computed().count(2) == 2 and base.computed().count(4) == 2
    assert store.get(key(2)) == good  # rewritten
    assert int(ds[2][0][0, 0]) == 2 and ds.stats()["corrupt"] == 2


def test_dataset_names_never_collide(tmp_path):
    a = CacheLoader(path=tmp_path, dataset_name="a")
    ab = CacheLoader(path=tmp_path, dataset_name="a_b")
    assert a.key("b_1") == ab.key("1") == b"a_b_1"  # same key text, different namespaces
    a.get("b_1", lambda k: "from a")
    assert ab.get("1", lambda k: "from a_b") == "from a_b"
    assert a.get("b_1", lambda k: None) == "from a"
    ab.clear()
    assert a.num_keys() == 1 and ab.num_keys() == 0


def test_fingerprint_and_length_invalidate(tmp_path):
    log1 = tmp_path / "log"
    ds = CachedDataset(CountingDataset(4, log1), path=tmp_path, dataset_name="f", fingerprint="v1")
    [ds[i] for i in range(4)]
    ds.close()
    ds = CachedDataset(CountingDataset(4, log1), path=tmp_path, dataset_name="f", fingerprint="v1")
    assert ds.cache_loader.num_keys() == 4
    ds.close()  # still open, it would make the next one raise (one namespace, two fingerprints)
    ds = CachedDataset(CountingDataset(4, log1), path=tmp_path, dataset_name="f", fingerprint="v2")
    assert ds.cache_loader.num_keys() == 0
    [ds[i] for i in range(4)]
    ds.close()
    ds = CachedDataset(CountingDataset(5, log1), path=tmp_path, dataset_name="f", fingerprint="v2")
    assert ds.cache_loader.num_keys() == 0  # the length changed


def test_unserializable_sample_names_the_index(tmp_path):
    class Bad(Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return {"x": torch.ones(2), "lock": threading.Lock()} if i == 3 else torch.ones(2)

    ds = CachedDataset(Bad(), path=tmp_path, dataset_name="bad")
    ds[1]
    with pytest.raises(CodecError, match="value for dataset index 3 cannot be serialized"):
        ds[3]
    with pytest.raises(CodecError, match="dataset index 3"):
        ds.__getitems__([2, 3])


def test_lmdb_full_raises_through_the_loader(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="full", map_size=1 << 20, max_map_size=2 << 20)
    with pytest.raises(StoreError, match="max_map_size=2097152"):
        for i in range(40):
            loader.get(i, lambda k: np.zeros(100_000, np.uint8))


def test_warmup_fills_the_cache(tmp_path, capsys):
    base = CountingDataset(40, tmp_path / "log")
    ds = CachedDataset(base, path=tmp_path, dataset_name="warm")
    ds[5]
    ds.cache_loader.flush()
    assert ds.warmup(num_workers=2, progress=True, batch_size=8, multiprocessing_context="fork") == 39
    assert "caching 'warm'" in capsys.readouterr().err
    assert ds.cache_loader.num_keys() == 40
    assert ds.warmup(progress=False) == 0
    assert sorted(base.computed()) == list(range(40))


def test_every_small_int_is_served_from_the_cache(tmp_path, caplog):
    # The marker for "did not decode" once shared its name with the stats column of corrupt values
    # (an int, 7): a cached sample equal to 7 was then taken for a damaged entry on every read,
    # recomputed, rewritten and logged.
    values = list(range(-6, 20)) + [None, True, False, 7.0]
    base = {i: v for i, v in enumerate(values)}
    calls: list = []
    loader = CacheLoader(path=tmp_path, dataset_name="ints")
    for i, v in base.items():
        assert loader.get(str(i), lambda k, v=v: calls.append(k) or v) == v
    loader.flush()
    with caplog.at_level(logging.WARNING, logger="trainloom"):
        for i, v in base.items():
            got = loader.get(str(i), lambda k: calls.append(k) or "recomputed")
            assert got == v and type(got) is type(v)
        ds = CachedDataset(values, path=tmp_path, dataset_name="ints-ds")
        ds.warmup(progress=False)
        assert ds.__getitems__(list(range(len(values)))) == values
    assert len(calls) == len(values)  # the first pass only
    stats = loader.stats()
    assert (stats["corrupt"], stats["hits"]) == (0, len(values))
    assert ds.stats()["corrupt"] == 0
    assert not [r for r in caplog.records if "did not decode" in r.getMessage()]
    ds.close()
    loader.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": None}, "warmup: batch_size must be an int >= 1, got None"),
        ({"batch_size": 0}, "warmup: batch_size must be an int >= 1, got 0"),
        ({"batch_size": True}, "warmup: batch_size must be an int >= 1, got True"),
        ({"batch_size": 8.0}, "warmup: batch_size must be an int >= 1, got 8.0"),
        ({"num_workers": -1}, "warmup: num_workers must be an int >= 0, got -1"),
        ({"num_workers": "2"}, "warmup: num_workers must be an int >= 0, got '2'"),
    ],
)
def test_warmup_refuses_bad_arguments_before_reading_a_sample(tmp_path, kwargs, message):
    base = CountingDataset(4, tmp_path / "log")
    ds = CachedDataset(base, path=tmp_path, dataset_name="warm-bad")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ds.warmup(progress=False, **kwargs)
    assert base.computed() == []
    ds.close()


def test_warmup_dataset_counts_samples_one_at_a_time_too(tmp_path):
    # DataLoader(batch_size=None) reads a map-style dataset through __getitem__: it counts 1 per
    # index, like __getitems__ counts its batch (it used to call len() on that count).
    from trainloom.data.cache import _Warm

    base = CountingDataset(4, tmp_path / "log")
    ds = CachedDataset(base, path=tmp_path, dataset_name="warm-one")
    warm = _Warm(ds, [2, 3])
    assert (warm[1], warm.__getitems__([0, 1]), len(warm)) == (1, 2, 2)
    ds.cache_loader.flush()
    assert ds.cache_loader.contains_many([0, 1, 2, 3]) == [False, False, True, True]
    ds.close()


# -- Redis ----------------------------------------------------------------------------------------


@requires_redis
def test_redis_backend_with_workers(tmp_path, redis_hosts):
    base = CountingDataset(24, tmp_path / "log")
    ds = CachedDataset(base, "redis", "rw", 5, hosts=redis_hosts)
    ds.cache_loader.clear()
    for _ in range(2):
        for batch in DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork"):
            check_batch(batch)
    assert ds.cache_loader.num_keys() == 24 and len(base.computed()) == 24
    ds.cache_loader.clear()


@requires_redis
def test_num_keys_counts_values_not_fingerprints_on_every_shard(tmp_path, own_redis):
    # The fingerprint entry lives on every shard; num_keys subtracted one copy only (21 for 20 values
    # on two servers).
    hosts = [own_redis().address(), own_redis().address()]
    base = CountingDataset(20, tmp_path / "log")
    ds = CachedDataset(base, "redis", "shards", 5, hosts=hosts)
    for i in range(20):
        ds[i]
    assert ds.cache_loader.num_keys() == 20
    loader = CacheLoader("redis", "fp", hosts=hosts, fingerprint="v1")
    for i in range(5):
        loader.get(i, lambda k: k)
    assert loader.num_keys() == 5
    assert loader.store.copies(b"\x00trainloom-meta") == 2
    loader.clear()
    assert loader.num_keys() == 0
    ds.close()
    loader.close()


@requires_redis
def test_redis_started_by_the_loader_and_shut_down(tmp_path):
    loader = CacheLoader("redis", "own", capacity_per_node=64 << 20)
    assert loader.get(1, lambda k: "one") == "one" and loader.get(1, lambda k: None) == "one"
    host = loader.store.hosts[0]
    loader.store.shutdown()
    with pytest.raises(StoreUnavailableError):
        CacheLoader("redis", "own", hosts=[host]).num_keys()


@requires_redis
@pytest.mark.timeout(60)
def test_redis_dies_mid_epoch_raises(tmp_path, own_redis):
    srv = own_redis()
    ds = CachedDataset(CountingDataset(40, tmp_path / "log"), "redis", "die", 4, hosts=[srv.address()])
    with pytest.raises(StoreUnavailableError, match="unreachable"):
        for n, _batch in enumerate(DataLoader(ds, batch_size=4)):
            if n == 2:
                srv.proc.kill()
                srv.proc.wait()


@requires_redis
@pytest.mark.timeout(60)
@pytest.mark.parametrize("failure", ["kill", "pause"])
def test_redis_failure_bypass_mode(tmp_path, own_redis, failure):
    srv = own_redis()
    base = CountingDataset(60, tmp_path / "log", shape=(64, 64))  # 16 KiB per sample
    ds = CachedDataset(
        base, "redis", "bypass", 4, hosts=[srv.address()], on_error="bypass", max_buffer_bytes=100_000,
        retry_interval=60.0,
    )  # fmt: skip
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for n, batch in enumerate(DataLoader(ds, batch_size=4)):
                check_batch(batch)
                if n == 3:
                    if failure == "kill":
                        srv.proc.kill()
                        srv.proc.wait()
                    else:
                        os.kill(srv.proc.pid, signal.SIGSTOP)
        bypass_warnings = [x for x in w if "on_error='bypass'" in str(x.message)]
        assert len(bypass_warnings) == 1
        asked = []
        store = ds.cache_loader.store
        store.evicted_keys = lambda: asked.append(1) or 0  # stats() reads it from the servers ...
        s = ds.stats()
        assert asked == []  # ... but not from a store found down, before retry_interval (it stalled)
        assert s["errors"] == 1  # then the store is skipped until retry_interval, not retried per batch
        assert s["bypassed"] >= 40 and s["dropped"] > 0
        assert s["buffered_bytes"] <= 100_000
        assert len(base.computed()) == 60
    finally:
        if failure == "pause" and srv.proc is not None:
            os.kill(srv.proc.pid, signal.SIGCONT)
        ds.close()  # ends its background flush thread (it would retry the dead server every 60 s)


@requires_redis
def test_redis_out_of_memory_stops_writes_with_one_warning(tmp_path, own_redis):
    srv = own_redis(maxmemory=3 << 20)
    base = CountingDataset(80, tmp_path / "log", shape=(256, 256))  # 256 KiB per sample
    ds = CachedDataset(base, "redis", "oom", 4, hosts=[srv.address()])
    with pytest.warns(RuntimeWarning, match="out of memory") as rec:
        for batch in DataLoader(ds, batch_size=4):
            check_batch(batch)
    (msg,) = [str(r.message) for r in rec if "out of memory" in str(r.message)]
    # hosts= is the user's server: capacity_per_node= (for servers trainloom starts) would not help
    assert msg.endswith(
        "Raise the server's maxmemory, set an evicting maxmemory-policy (allkeys-lru) or clear old caches."
    )
    s = ds.stats()
    assert s["oom"] == 1 and s["dropped"] > 0 and s["buffered"] == 0
    assert 0 < ds.cache_loader.num_keys() < 80
    for batch in DataLoader(ds, batch_size=4):  # reads keep working
        check_batch(batch)
    assert ds.stats()["hits"] > 0


def test_redis_evicting_keys_is_counted_and_warned_once(tmp_path, own_redis, monkeypatch):
    # allkeys-lru: a full server drops old keys instead of refusing writes. Nothing fails, but cached
    # samples vanish and are computed again: counted from the server and warned about once. (The
    # count is read after a write at most every 5 s per process: here after every write.)
    monkeypatch.setattr(cache_module, "_EVICTION_CHECK_S", 0.0)
    srv = own_redis(maxmemory=3 << 20, maxmemory_policy="allkeys-lru")
    base = CountingDataset(80, tmp_path / "log", shape=(256, 256))  # 256 KiB per sample: 20 MiB
    ds = CachedDataset(base, "redis", "lru", 4, hosts=[srv.address()])
    assert ds.stats()["evicted"] == 0
    with pytest.warns(RuntimeWarning, match="evicted") as rec:
        for _ in range(2):
            for batch in DataLoader(ds, batch_size=4):
                check_batch(batch)
    msgs = [str(r.message) for r in rec if "evicted" in str(r.message)]
    assert len(msgs) == 1, msgs
    assert re.fullmatch(
        r"CacheLoader\('lru'\): RedisStore\(\[127\.0\.0\.1:\d+\], cluster_mode=True, namespace='lru'\) "
        r"evicted \d+ keys since this cache was opened \(its maxmemory-policy drops old keys when it is "
        r"full\): cached values are being dropped and computed again\. Raise the server's maxmemory or "
        r"cache less \(stats\(\)\['evicted'\] counts them\)\.",
        msgs[0],
    ), msgs[0]
    s = ds.stats()
    assert s["evicted"] > 0 and s["oom"] == 0 and s["dropped"] == 0
    assert s["misses"] > 80  # the second epoch computed evicted samples again
    ds.cache_loader.close()
    assert ds.stats()["evicted"] == s["evicted"]  # the last count, once closed
    lmdb = CachedDataset(CountingDataset(2, tmp_path / "log2"), path=tmp_path / "l", dataset_name="l")
    assert lmdb[0] is not None and lmdb.stats()["evicted"] == 0


def test_unusual_indices_and_keys(tmp_path):
    base = CountingDataset(6, tmp_path / "log")
    ds = CachedDataset(base, path=tmp_path, dataset_name="idx")
    out = ds.__getitems__([np.int64(1), torch.tensor(2), -1])  # numpy/tensor ints, negative
    assert [int(x[0][0, 0]) for x in out] == [1, 2, 5]
    # operator.index(True) is 1: a bool index is almost always a mask or a bug, so it is refused.
    for bad in (True, np.bool_(False), torch.tensor(True)):
        with pytest.raises(TypeError, match=r"CachedDataset indices must be integers, got (bool|Tensor)"):
            ds[bad]
        with pytest.raises(TypeError, match=r"CachedDataset indices must be integers, got (bool|Tensor)"):
            ds.__getitems__([0, bad])
    with pytest.raises(IndexError, match="index 6 out of range"):
        ds.__getitems__([0, 6])
    with pytest.raises(IndexError, match=r"index 1180591620717411303424 out of range"):
        ds.__getitems__([2**70])
    loader = CacheLoader(path=tmp_path, dataset_name="keys")
    got = loader.get_many([-3, 2**70, "path/x.jpg", (1, 2)], lambda k: str(k))
    assert got == ["-3", str(2**70), "path/x.jpg", "(1, 2)"]
    assert loader.store.get("keys_-3") is not None and loader.store.get("keys_(1, 2)") is not None


def test_big_buffers_flush_early_instead_of_dropping(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="big", writer_buffer_size=1000, max_buffer_bytes=50_000)
    for i in range(20):
        loader.get(i, lambda k: np.zeros(10_000, np.uint8))  # 10 KB each: 5 fit in the byte bound
    s = loader.stats()
    assert s["dropped"] == 0 and s["flushes"] >= 3 and s["buffered_bytes"] < 50_000
    assert loader.num_keys() == 20


# -- use after close ------------------------------------------------------------------------------


def test_closed_loader_raises_and_never_reopens_its_store(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="ac", writer_buffer_size=10)
    loader.get(1, lambda k: k)
    loader.close()
    closed = r"CacheLoader\('ac'\) is closed: close\(\) flushed its values and released the store"
    calls = [
        lambda: loader.get(2, lambda k: k * 10),
        lambda: loader.get_many([1, 2], lambda k: k),
        lambda: loader.contains_many([1]),
        loader.num_keys,
        loader.flush,
        loader.clear,
    ]
    for call in calls:
        with pytest.raises(CacheClosedError, match=closed):
            call()
    assert isinstance(CacheClosedError("x"), (StoreError, ValueError))
    assert loader.store._env is None  # nothing reopened the environment
    loader.close()  # still idempotent
    assert loader.stats()["misses"] == 1 and loader.stats()["buffered"] == 0  # final counts stay readable
    assert "closed" in repr(loader)
    with pytest.raises(CacheClosedError, match=closed):  # also in a worker it is pickled into
        pickle.loads(pickle.dumps(loader)).get(3, lambda k: k)
    fresh = CacheLoader(path=tmp_path, dataset_name="ac")
    assert fresh.contains_many([1, 2]) == [True, False] and fresh.num_keys() == 1


def test_closed_cached_dataset_raises(tmp_path):
    ds = CachedDataset(CountingDataset(4, tmp_path / "log"), path=tmp_path, dataset_name="acd")
    ds[0]
    ds.close()
    ds.close()
    closed = r"CacheLoader\('acd'\) is closed"
    with pytest.raises(CacheClosedError, match=closed):
        ds[1]
    with pytest.raises(CacheClosedError, match=closed):
        ds.__getitems__([1, 2])
    with pytest.raises(CacheClosedError, match=closed):
        ds.warmup(progress=False)
    assert len(ds) == 4 and ds.stats()["misses"] == 1


def test_closed_loader_writes_nothing_silently_at_exit(tmp_path):
    code = textwrap.dedent(f"""
        from trainloom.data.cache import CacheClosedError, CacheLoader
        cl = CacheLoader(path={str(tmp_path)!r}, dataset_name="ac2", writer_buffer_size=10)
        cl.get(1, lambda k: k)
        cl.close()
        try:
            cl.get(2, lambda k: k * 10)
        except CacheClosedError:
            print("raised")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True
    )
    assert out.stdout.strip() == "raised"
    assert CacheLoader(path=tmp_path, dataset_name="ac2").contains_many([1, 2]) == [True, False]


# -- stored None ----------------------------------------------------------------------------------


class NoneForOdd(Dataset):
    """Returns None for odd indices (a "bad sample" a collate_fn filters out), counting computations."""

    def __init__(self, n: int, log_path) -> None:
        self.n = n
        self.log_path = str(log_path)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with open(self.log_path, "a") as fh:
            fh.write(f"{i}\n")
        return None if i % 2 else torch.full((2,), i)


def _drop_none(batch):
    return [x for x in batch if x is not None]


def _check_stored_none(loader):
    calls = []

    def load(k):
        calls.append(k)

    for _ in range(3):
        assert loader.get(1, load) is None
    s = loader.stats()
    assert len(calls) == 1 and (s["hits"], s["misses"], s["writes"]) == (2, 1, 1)
    # Batched reads: a stored None is a hit too, next to real values and real misses.
    out = loader.get_many([1, 2, 3], lambda k: None if k == 3 else k * 10)
    assert out == [None, 20, None]
    assert loader.get_many([1, 2, 3], lambda k: pytest.fail(f"recomputed {k}")) == [None, 20, None]
    s = loader.stats()
    assert (s["hits"], s["misses"]) == (2 + 1 + 3, 1 + 2)


def test_stored_none_is_a_hit_lmdb(tmp_path):
    with CacheLoader(path=tmp_path, dataset_name="n") as loader:
        _check_stored_none(loader)
        assert loader.num_keys() == 3


def test_stored_none_is_a_hit_in_a_dataloader(tmp_path):
    base = NoneForOdd(12, tmp_path / "log")
    ds = CachedDataset(base, path=tmp_path / "db", dataset_name="dn", writer_buffer_size=4)
    for _ in range(3):
        got = [int(x[0]) for batch in DataLoader(ds, batch_size=4, collate_fn=_drop_none) for x in batch]
        assert got == [0, 2, 4, 6, 8, 10]
    computed = [int(x) for x in Path(base.log_path).read_text().split()]
    assert sorted(computed) == list(range(12))  # each sample computed once, None ones included
    s = ds.stats()
    assert (s["hits"], s["misses"], s["writes"]) == (24, 12, 12)


@requires_redis
def test_stored_none_is_a_hit_redis(redis_hosts):
    loader = CacheLoader("redis", "none", hosts=redis_hosts)
    loader.clear()
    try:
        _check_stored_none(loader)
    finally:
        loader.clear()
        loader.close()


# -- keys LMDB cannot hold --------------------------------------------------------------------------


def test_long_keys_raise_at_once_and_block_nothing(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="p", writer_buffer_size=3)
    long_key = "/very/long/" + "z" * 600
    for k in ["short0", long_key] + [f"short{i}" for i in range(1, 8)]:
        if k == long_key:
            with pytest.raises(
                ConfigError,
                match=r"CacheLoader\('p'\): the key '/very/long/z+\.\.\. is 613 bytes in the store "
                r"\(with the 'p_' prefix\); keys of the lmdb store are limited to 511 bytes\. Hash long keys",
            ):
                loader.get(k, len)
        else:
            assert loader.get(k, len) == len(k)
    s = loader.stats()
    assert s["errors"] == 0 and s["buffered"] == 2 and s["misses"] == 8
    loader.close()
    assert CacheLoader(path=tmp_path, dataset_name="p").num_keys() == 8  # every valid value was kept
    # The limit counts bytes, prefix included: 509 + "p_" = 511 is fine, one more byte is not.
    loader = CacheLoader(path=tmp_path, dataset_name="p")
    assert loader.get("k" * 509, lambda k: 1) == 1
    with pytest.raises(ConfigError, match="is 512 bytes in the store"):
        loader.get("é" + "k" * 508, lambda k: 1)


def test_undecodable_utf8_key_is_kept_with_surrogatepass(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="s")
    name = b"/data/img_\xff.png".decode("utf-8", "surrogateescape")  # as os.listdir returns it
    assert loader.get(name, lambda k: k) == name
    assert loader.get(name, lambda k: pytest.fail("recomputed")) == name
    assert loader.key(name) == b"s_/data/img_\xed\xb3\xbf.png"


class RefusingStore(LmdbStore):
    """An LMDB store that refuses values holding b"POISON" (like Redis refusing a value over its
    size limit), or every write while ``down`` is set."""

    down = False

    def mset(self, dictionary):
        if self.down:
            raise StoreError("refusing every write", backend="lmdb")
        if any(b"POISON" in bytes(v) for v in dictionary.values()):
            raise StoreError("value refused", backend="lmdb")
        super().mset(dictionary)


def test_a_refused_value_does_not_block_the_others(tmp_path):
    store = RefusingStore(tmp_path, namespace="r")
    loader = CacheLoader(store, "r", writer_buffer_size=3)
    loader.get(0, lambda k: b"ok")
    loader.get(1, lambda k: b"POISON")
    with pytest.raises(
        StoreError, match=r"refused 1 value\(s\), dropped .*key b'r_1': value refused\. The other 2"
    ):
        loader.get(2, lambda k: b"ok")
    s = loader.stats()
    assert (s["writes"], s["dropped"], s["errors"], s["buffered"]) == (2, 1, 1, 0)
    for i in range(3, 9):
        loader.get(i, lambda k: b"ok")  # the buffer is not poisoned
    assert loader.stats()["errors"] == 1
    loader.close()
    assert store.__class__(tmp_path, namespace="r").num_keys() == 8  # all but the refused one

    # The store refusing everything is a failing store, not a bad value: the values stay buffered.
    store = RefusingStore(tmp_path, namespace="r2")
    loader = CacheLoader(store, "r2", writer_buffer_size=2)
    store.down = True
    loader.get(0, lambda k: b"a")
    with pytest.raises(StoreError, match="refusing every write"):
        loader.get(1, lambda k: b"b")
    assert loader.stats()["buffered"] == 2 and loader.stats()["dropped"] == 0
    store.down = False
    loader.flush()
    assert loader.num_keys() == 2


def test_a_refused_value_in_bypass_mode_warns_once(tmp_path):
    store = RefusingStore(tmp_path, namespace="rb")
    loader = CacheLoader(store, "rb", writer_buffer_size=2, on_error="bypass")
    with pytest.warns(RuntimeWarning, match=r"refused 1 value\(s\).*on_error='bypass'") as rec:
        for i in range(8):
            loader.get(i, lambda k: b"POISON" if k % 4 == 1 else b"ok")
    assert len([r for r in rec if "refused" in str(r.message)]) == 1
    loader.flush()
    s = loader.stats()
    assert (s["dropped"], s["errors"], s["writes"]) == (2, 2, 6)


# -- values that do not decode ----------------------------------------------------------------------


class Renamed:
    """Stands for a user class that is renamed after samples holding it were cached."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return type(other).__name__ == "Renamed" and other.v == self.v


def test_value_whose_class_is_gone_is_recomputed(tmp_path, monkeypatch, caplog):
    loader = CacheLoader(path=tmp_path, dataset_name="gone")
    loader.get_many([0, 1, 2], lambda k: (Renamed(k), torch.ones(2)))
    monkeypatch.delattr(sys.modules[__name__], "Renamed")
    with caplog.at_level(logging.WARNING, logger="trainloom.data"):
        out = loader.get_many([0, 1, 2], lambda k: ("fresh", k))
        assert out == [("fresh", 0), ("fresh", 1), ("fresh", 2)]
    warned = [r for r in caplog.records if "did not decode" in r.getMessage()]
    assert len(warned) == 1
    assert (
        "3 stored value(s) (key 0 first) did not decode (CodecError: cannot unpickle"
        in warned[0].getMessage()
    )
    assert "AttributeError" in warned[0].getMessage()
    s = loader.stats()
    assert (s["corrupt"], s["misses"], s["writes"]) == (3, 6, 6)
    assert loader.get(1, lambda k: pytest.fail("recomputed again")) == ("fresh", 1)  # rewritten


class JunkStore(LmdbStore):
    """Returns a value that is not even bytes-like for keys ending in "7": decoding it raises TypeError."""

    def mget_apply(self, keys, fn):
        return [fn(12345) if k.endswith(b"7") else v for k, v in zip(keys, super().mget_apply(keys, fn))]

    def mget_decode(self, keys, missing=None):
        if any(k.endswith(b"7") for k in keys):
            raise TypeError("a bytes-like object is required, not 'int'")
        return super().mget_decode(keys, missing)


def test_any_decode_failure_is_a_damaged_entry_but_load_fn_errors_propagate(tmp_path, caplog):
    loader = CacheLoader(JunkStore(tmp_path, namespace="j"), "j")
    with caplog.at_level(logging.WARNING, logger="trainloom.data"):
        assert loader.get(7, lambda k: "computed") == "computed"
        assert loader.get_many([6, 7], lambda k: k) == [6, 7]
    assert loader.stats()["corrupt"] == 2
    assert any("did not decode (TypeError:" in r.getMessage() for r in caplog.records)

    def broken(k):
        raise KeyError("a bug in load_fn")

    with pytest.raises(KeyError, match="a bug in load_fn"):
        loader.get(8, broken)
    with pytest.raises(KeyError, match="a bug in load_fn"):
        loader.get_many([9], broken)


def test_float8_samples_are_cached_and_read_back(tmp_path):
    dtypes = [
        getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn_x2") if hasattr(torch, n)
    ]

    class F8(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return [torch.full((3,), i, dtype=torch.uint8).view(dt) for dt in dtypes]

    ds = CachedDataset(F8(), path=tmp_path, dataset_name="f8", writer_buffer_size=1)
    first = [ds[i] for i in range(4)]
    again = [ds[i] for i in range(4)]  # epoch 1 read the cache
    assert ds.stats()["hits"] == 4 and ds.stats()["corrupt"] == 0
    for a, b in zip(first, again):
        for x, y in zip(a, b):
            assert y.dtype == x.dtype and torch.equal(y.view(torch.uint8), x.view(torch.uint8))


def test_samples_the_codec_cannot_store_name_the_index(tmp_path):
    class Odd(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i == 1:
                return torch.empty(2, device="meta")
            if i == 2:
                return ("/data/img_\udcff.png", torch.zeros(2))  # a name os.listdir could not decode
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "the PyTorch API of nested tensors is in prototype stage"
                return torch.nested.nested_tensor([torch.zeros(2), torch.ones(3)])

    ds = CachedDataset(Odd(), path=tmp_path, dataset_name="odd", writer_buffer_size=1)
    with pytest.raises(
        CodecError,
        match=r"CacheLoader\('odd'\): the value for dataset index 1 cannot be serialized for the cache: "
        "a tensor on the meta device holds no data",
    ):
        ds[1]
    for _ in range(2):
        name, t = ds[2]
        assert name == "/data/img_\udcff.png" and torch.equal(t, torch.zeros(2))
        nested = ds[3]
        assert nested.is_nested and [x.tolist() for x in nested.unbind()] == [[0.0, 0.0], [1.0, 1.0, 1.0]]
    assert ds.stats()["hits"] == 2


def test_lmdb_path_that_is_a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"LmdbStore: path '.*a-file' exists and is not a directory"):
        CacheLoader(path=f, dataset_name="w")


def test_old_entries_that_pickled_a_float8_tensor_are_recomputed(tmp_path):
    # What the codec wrote before float8 was stored raw: torch's own pickle of the tensor, which this
    # torch cannot load back (AttributeError inside torch/serialization.py).
    import pickle as _pickle

    x = torch.zeros(3, dtype=torch.uint8).view(torch.float8_e4m3fn)
    try:
        _pickle.loads(_pickle.dumps(x))
    except AttributeError:
        pass
    else:
        pytest.skip("this torch loads its pickled float8 tensors")
    loader = CacheLoader(path=tmp_path, dataset_name="old")
    payload = _pickle.dumps(x, protocol=5)
    # T_PICKLE node with no array references, wrapped in a valid header (see test_codec.forge).
    import struct

    from trainloom.data.codec import checksum

    meta = bytes([13]) + struct.pack("<I", 0) + struct.pack("<Q", len(payload)) + payload
    header = b"TLC\x02" + struct.pack("<IQ", len(meta), 0)
    padded = meta + b"\x00" * (-(32 + len(meta)) % 64)
    value = header + struct.pack("<Q", checksum(b"", checksum(padded, 0))) + b"\x00" * 8 + padded
    loader.store.mset({loader.key(0): value})
    out = loader.get(0, lambda k: torch.ones(3).to(torch.float8_e4m3fn))
    assert out.dtype == torch.float8_e4m3fn and loader.stats()["corrupt"] == 1
    loader.flush()
    assert loader.store.get(loader.key(0)) == encode(out)


# -- background flush (flush_interval) --------------------------------------------------------------


def _flush_threads(dataset_name: str) -> list:
    """The live flush threads of the loaders named ``dataset_name`` (other tests may leave theirs, e.g.
    a bypass-mode loader retrying a killed server)."""
    return [t for t in threading.enumerate() if t.name == f"trainloom-cache-flush[{dataset_name}]"]


def _wait_for(condition, what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds (a generous deadline: the machine is shared)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


class RotatingBatches:
    """Batches of 4 in order, rotated by ``epoch`` batches: with 2 workers (round robin from the
    first batch every epoch) and an even number of batches, every batch goes to the other worker in
    the next epoch."""

    def __init__(self, n: int) -> None:
        self.batches = [list(range(i, min(i + 4, n))) for i in range(0, n, 4)]
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        k = self.epoch % len(self.batches)
        return iter(self.batches[k:] + self.batches[:k])


@pytest.mark.parametrize(
    "method,flush_interval", [("fork", 1.0), ("spawn", 1.0), ("fork", None)], ids=["fork", "spawn", "off"]
)
def test_persistent_workers_compute_each_sample_once(tmp_path, method, flush_interval):
    # Each worker computes 24 samples: 20 are written when its buffer fills, 4 stay buffered. Without
    # the background flush they stayed there for the whole run, and the other worker, which gets those
    # batches in the next epoch, computed them again.
    base = CountingDataset(48, tmp_path / "log")
    ds = CachedDataset(base, path=tmp_path / "db", dataset_name="pw", flush_interval=flush_interval)
    assert ds.cache_loader.writer_buffer_size == 20
    sampler = RotatingBatches(48)
    dl = DataLoader(
        ds, batch_sampler=sampler, num_workers=2, persistent_workers=True, multiprocessing_context=method
    )
    store = ds.cache_loader.store
    try:
        for batch in dl:
            check_batch(batch)
        assert sorted(base.computed()) == list(range(48))
        if flush_interval is None:
            assert store.num_keys() == 1 + 40  # the fingerprint and 2 full buffers; 2 x 4 values wait
        else:
            _wait_for(lambda: store.num_keys() == 1 + 48, "the workers' background flushes")
        for epoch in (1, 2):
            sampler.epoch = epoch
            for batch in dl:
                check_batch(batch)
        if flush_interval is None:
            assert len(base.computed()) > 48  # the old behaviour: buffered samples computed again
        else:
            assert len(base.computed()) == 48  # epochs 1 and 2 computed nothing
    finally:
        del dl  # the persistent workers stop
    assert ds.cache_loader.num_keys() == 48


def test_flush_interval_writes_the_values_of_a_process_that_stops_computing(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="fi", writer_buffer_size=10, flush_interval=0.5)
    assert loader.flush_interval == 0.5 and _flush_threads("fi") == []
    assert loader.get_many([0, 1, 2], lambda k: k * 10) == [0, 10, 20]
    assert len(loader._timers) == 1  # one thread started for the buffer, not one per value
    _wait_for(lambda: loader.store.num_keys() == 3, "the background flush")
    _wait_for(lambda: _flush_threads("fi") == [], "the flush thread to end once the buffer is empty")
    s = loader.stats()
    assert (s["writes"], s["flushes"], s["buffered"], s["errors"]) == (3, 1, 0, 0)
    other = CacheLoader(path=tmp_path, dataset_name="fi")  # e.g. another DataLoader worker
    assert other.get_many([0, 1, 2], lambda k: pytest.fail(f"recomputed {k}")) == [0, 10, 20]
    for _ in range(3):  # reads only: no thread
        assert loader.get_many([0, 1, 2], lambda k: pytest.fail(f"recomputed {k}")) == [0, 10, 20]
    assert _flush_threads("fi") == []
    # flush() ends the thread (here after a buffer written because it was full).
    for i in range(10, 20):
        loader.get(i, lambda k: k)
    loader.get(20, lambda k: k)
    loader.flush()
    _wait_for(lambda: _flush_threads("fi") == [], "the flush thread to end after flush()")
    with CacheLoader(path=tmp_path, dataset_name="fi1") as unbuffered:  # writer_buffer_size=1
        for i in range(5):
            unbuffered.get(i, lambda k: k)
        assert _flush_threads("fi1") == [] and unbuffered.store.num_keys() == 5
    loader.close()
    other.close()


@pytest.mark.parametrize("off", [None, 0])
def test_flush_interval_none_keeps_values_buffered(tmp_path, off):
    loader = CacheLoader(path=tmp_path, dataset_name="off", writer_buffer_size=10, flush_interval=off)
    assert loader.flush_interval is None
    for i in range(3):
        loader.get(i, lambda k: k)
    time.sleep(0.5)  # nothing may happen: a wait that can only make a wrong test pass, not flake
    assert _flush_threads("off") == [] and loader.store.num_keys() == 0 and loader.stats()["buffered"] == 3
    for i in range(3, 10):
        loader.get(i, lambda k: k)
    assert loader.store.num_keys() == 10  # written when the buffer filled, as before
    loader.close()


def test_bad_flush_interval(tmp_path):
    for bad in (-1, float("inf"), float("nan"), "1", True):
        with pytest.raises(
            ValueError, match="flush_interval must be None or a finite number of seconds >= 0"
        ):
            CacheLoader(path=tmp_path, flush_interval=bad)


def test_flush_thread_never_outlives_close(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="oc", writer_buffer_size=10, flush_interval=60.0)
    loader.get(1, lambda k: "one")
    assert [t.daemon for t in _flush_threads("oc")] == [True]
    loader.close()
    assert _flush_threads("oc") == []  # close() joined it
    assert CacheLoader(path=tmp_path, dataset_name="oc").get(1, lambda k: pytest.fail("lost")) == "one"
    # The same for a CachedDataset, and with a thread busy flushing when close() is called.
    ds = CachedDataset(
        CountingDataset(30, tmp_path / "log"), path=tmp_path, dataset_name="oc2", flush_interval=0.01
    )
    for i in range(30):
        ds[i]
    ds.close()
    assert _flush_threads("oc2") == []
    assert CacheLoader(path=tmp_path, dataset_name="oc2").num_keys() == 30  # the values (not the fingerprint)


def test_a_failed_background_flush_raises_from_the_next_call(tmp_path):
    store = RefusingStore(tmp_path, namespace="bg")
    loader = CacheLoader(store, "bg", writer_buffer_size=10, flush_interval=0.05)
    store.down = True
    loader.get(0, lambda k: b"zero")
    _wait_for(lambda: loader.stats()["errors"] == 1, "the background flush to fail")
    _wait_for(lambda: _flush_threads("bg") == [], "the flush thread to end after the failure")
    with pytest.raises(StoreError, match="refusing every write") as info:
        loader.get(1, lambda k: b"one")
    if sys.version_info >= (3, 11):  # exceptions take notes
        assert "raised by the background flush of CacheLoader('bg')" in "\n".join(info.value.__notes__)
    s = loader.stats()
    assert (s["buffered"], s["misses"], s["writes"]) == (1, 1, 0)  # kept; get(1) did not run
    store.down = False
    assert loader.get(1, lambda k: b"one") == b"one"  # raised once; the next call works
    _wait_for(lambda: store.num_keys() == 2, "the retried background flush")
    assert loader.stats()["errors"] == 1

    # A failure not raised yet is raised by close(), after closing.
    store.down = True
    loader.get(2, lambda k: b"two")
    _wait_for(lambda: loader.stats()["errors"] == 2, "the background flush to fail")
    store.down = False
    with pytest.raises(StoreError, match="refusing every write"):
        loader.close()
    assert _flush_threads("bg") == [] and store.num_keys() == 3  # close() flushed the value
    with pytest.raises(CacheClosedError):
        loader.get(3, lambda k: b"three")


def test_a_failed_background_flush_in_bypass_mode_warns_once_and_retries(tmp_path):
    store = RefusingStore(tmp_path, namespace="bgb")
    loader = CacheLoader(
        store, "bgb", writer_buffer_size=10, flush_interval=0.05, on_error="bypass", retry_interval=0.2
    )
    store.down = True
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        loader.get(0, lambda k: b"zero")
        _wait_for(lambda: loader.stats()["errors"] >= 2, "two failed background flushes")
    assert len([x for x in w if "on_error='bypass'" in str(x.message)]) == 1
    assert len(_flush_threads("bgb")) == 1  # still trying
    store.down = False
    _wait_for(lambda: store.num_keys() == 1, "the background flush after the store came back")
    _wait_for(lambda: _flush_threads("bgb") == [], "the flush thread to end")
    assert loader.get(0, lambda k: pytest.fail("recomputed")) == b"zero"  # nothing raised in bypass mode
    loader.close()


def test_background_flush_and_reads_share_lmdb_safely(tmp_path):
    # A write that grows the LMDB map remaps it (LMDB: no transaction of the process may be open
    # meanwhile): the background writes and the reads of every loader of the process are serialised
    # while a flush thread is alive. Small map; a second loader on the same environment reads all along.
    loader = CacheLoader(
        path=tmp_path, dataset_name="grow", writer_buffer_size=1000, flush_interval=0.001, map_size=1 << 20
    )
    reader = CacheLoader(path=tmp_path, dataset_name="grow", writer_buffer_size=10_000, flush_interval=None)
    value = np.arange(16_000, dtype=np.float64)  # 128 KB
    for i in range(200):
        loader.get(i, lambda k: value + k)
        for j in range(max(0, i - 8), i + 1):
            got = reader.get_many([j], lambda k: value + k)[0]  # a miss while not written yet
            assert float(got[5]) == j + 5
    _wait_for(lambda: loader.store.num_keys() == 200, "the background flushes")
    assert loader.store.grow_count > 0 and reader.stats()["hits"] > 0
    assert float(reader.get_many([199], lambda k: pytest.fail("lost"))[0][0]) == 199.0
    loader.close()
    reader.close()


@requires_redis
def test_background_flush_to_redis(redis_hosts):
    # Redis clients are thread-safe: the background flush takes no process-wide lock.
    loader = CacheLoader("redis", "bgr", writer_buffer_size=10, flush_interval=0.05, hosts=redis_hosts)
    loader.clear()
    try:
        assert not loader._serialized
        for i in range(3):
            loader.get(i, lambda k: [k] * 2)
        assert [t.counted for t in loader._timers] == [False]  # reads of the process do not wait for it
        _wait_for(lambda: loader.store.num_keys() == 3, "the background flush")
        other = CacheLoader("redis", "bgr", hosts=redis_hosts)
        assert other.get_many([0, 1, 2], lambda k: pytest.fail(f"recomputed {k}")) == [[0, 0], [1, 1], [2, 2]]
        other.close()
    finally:
        loader.clear()
        loader.close()
    assert _flush_threads("bgr") == []
