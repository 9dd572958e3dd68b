"""CacheLoader / CachedDataset over real LMDB files and real redis-server processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainloom._locate import find_redis_server
from trainloom.data.cache import CachedDataset, CacheLoader
from trainloom.data.codec import CodecError
from trainloom.data.stores import LmdbStore, StoreError
from trainloom.data.stores.base import StoreUnavailableError

requires_redis = pytest.mark.skipif(find_redis_server() is None, reason="needs a redis-server binary")


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
    with pytest.raises(ValueError, match="writer_buffer_size must be an int >= 1, got 0"):
        CacheLoader(path=tmp_path, writer_buffer_size=0)
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
    del dl  # persistent workers stop here; their Finalize flushes
    ds.cache_loader.flush()  # the parent's own ds[0]
    # 25 per worker, buffer of 20: 5 values per worker were flushed only when the worker stopped.
    assert ds.cache_loader.store.num_keys() == 1 + 50
    computed = base.computed()
    assert sorted(set(computed)) == list(range(50))
    for batch in DataLoader(ds, batch_size=4):
        check_batch(batch)
    assert len(base.computed()) == len(computed)  # second epoch: nothing recomputed


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
    store = ds.cache_loader.store
    good = store.get("c_2")
    bad = bytearray(good)
    bad[-3] ^= 0xFF
    store.mset({"c_2": bytes(bad), "c_4": b"not an encoded value"})
    out = ds.__getitems__([1, 2, 3, 4])
    assert [int(x[0][0, 0]) for x in out] == [1, 2, 3, 4]
    assert ds.stats()["corrupt"] == 2
    assert base.computed().count(2) == 2 and base.computed().count(4) == 2
    assert store.get("c_2") == good  # rewritten
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
        s = ds.stats()
        assert s["errors"] == 1  # then the store is skipped until retry_interval, not retried per batch
        assert s["bypassed"] >= 40 and s["dropped"] > 0
        assert s["buffered_bytes"] <= 100_000
        assert len(base.computed()) == 60
    finally:
        if failure == "pause" and srv.proc is not None:
            os.kill(srv.proc.pid, signal.SIGCONT)


@requires_redis
def test_redis_out_of_memory_stops_writes_with_one_warning(tmp_path, own_redis):
    srv = own_redis(maxmemory=3 << 20)
    base = CountingDataset(80, tmp_path / "log", shape=(256, 256))  # 256 KiB per sample
    ds = CachedDataset(base, "redis", "oom", 4, hosts=[srv.address()])
    with pytest.warns(RuntimeWarning, match="out of memory") as rec:
        for batch in DataLoader(ds, batch_size=4):
            check_batch(batch)
    assert len([r for r in rec if "out of memory" in str(r.message)]) == 1
    s = ds.stats()
    assert s["oom"] == 1 and s["dropped"] > 0 and s["buffered"] == 0
    assert 0 < ds.cache_loader.num_keys() < 80
    for batch in DataLoader(ds, batch_size=4):  # reads keep working
        check_batch(batch)
    assert ds.stats()["hits"] > 0


def test_unusual_indices_and_keys(tmp_path):
    base = CountingDataset(6, tmp_path / "log")
    ds = CachedDataset(base, path=tmp_path, dataset_name="idx")
    out = ds.__getitems__([np.int64(1), torch.tensor(2), -1, True])  # numpy/tensor ints, negative, bool
    assert [int(x[0][0, 0]) for x in out] == [1, 2, 5, 1]
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
