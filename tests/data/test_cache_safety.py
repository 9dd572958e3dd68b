"""Cache safety: one namespace per fingerprint, reused entries, content fingerprints, Redis value limit,
``__getitems__`` contract, tensors with Python state. Real LMDB files, real redis-server processes,
real DataLoader workers."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import trainloom.data.cache as cache_mod
from trainloom import cli
from trainloom.data.cache import META_KEY, CachedDataset, CacheLoader, fingerprint_digest
from trainloom.data.stores import LmdbStore, StoreError, StoreFullError, StoreValueRefusedError
from trainloom.data.stores.redis_server import RedisServer
from trainloom.errors import ConfigError


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    """Each test sees the cache module as a new process would (nothing warned, nothing opened yet)."""
    monkeypatch.setattr(cache_mod, "_PROCESS_WARNED", set())
    monkeypatch.setattr(cache_mod, "_OPENED", set())
    monkeypatch.setattr(cache_mod, "_LIVE", {})


class Tagged(Dataset):
    """Sample i is (tag, i)."""

    def __init__(self, tag: str, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return (self.tag, i)


def _messages(rec, needle: str) -> list:
    return [str(r.message) for r in rec if needle in str(r.message)]


# -- F1: one namespace, one fingerprint per process ------------------------------------------------


def test_two_unnamed_datasets_of_different_lengths_raise_naming_both(tmp_path):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        train = CachedDataset(Tagged("train", 10), path=tmp_path)
        assert [train[i] for i in range(10)][3] == ("train", 3)
        train.cache_loader.flush()
        with pytest.raises(ConfigError) as err:
            CachedDataset(Tagged("val", 5), path=tmp_path)
    assert str(err.value) == (
        "CachedDataset(Tagged of length 5, dataset_name='') with fingerprint ('len', 5, None) would share "
        f"the cache namespace '' of the LMDB cache at {str(tmp_path)!r} with CachedDataset(Tagged of length "
        "10, dataset_name='') with fingerprint ('len', 10, None), created earlier in this process and "
        "still open: their fingerprints differ, so the new one would drop the other's entries and both "
        "would then read and write each other's values under the same keys. Pass distinct dataset_name= "
        "values (e.g. dataset_name='train' and dataset_name='val'), or close() the other one first if it "
        "is no longer used."
    )
    # Refused before the namespace was touched: train's entries are intact and still served.
    assert train.cache_loader.num_keys() == 10
    assert train[3] == ("train", 3) and train.stats()["hits"] == 1
    # The unnamed persistent cache was warned about once in this process (two constructions).
    unnamed = _messages(rec, "no dataset_name was given")
    assert unnamed == [
        "CacheLoader(''): no dataset_name was given (Bagua's default ''), and the LMDB cache at "
        f"{str(tmp_path)!r} persists across runs: every unnamed dataset of every run shares its one "
        "namespace '', so datasets of different lengths drop each other's entries and datasets of the "
        "same length read each other's samples. Pass a distinct dataset_name= per dataset (e.g. "
        "dataset_name='imagenet-train-224')."
    ]
    # Distinct names: both live, each reads its own samples.
    train.close()
    tr = CachedDataset(Tagged("train", 10), path=tmp_path, dataset_name="train")
    va = CachedDataset(Tagged("val", 5), path=tmp_path, dataset_name="val")
    assert [tr[3], va[3], tr[3], va[3]] == [("train", 3), ("val", 3)] * 2


def test_two_unnamed_datasets_of_the_same_length_warn_that_they_share_samples(tmp_path):
    # Nothing tells them apart (one namespace, one fingerprint): b is served a's samples. They cannot
    # be refused (the same data may be wrapped twice), so the second one warns, once, on any store.
    where = f"the LMDB cache at {str(tmp_path)!r}"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = CachedDataset(Tagged("a", 6), path=tmp_path)
        assert a[3] == ("a", 3)
        a.cache_loader.flush()
        b = CachedDataset(Tagged("b", 6), path=tmp_path)
        assert b[3] == ("a", 3)  # what the warning is about
        CachedDataset(Tagged("c", 6), path=tmp_path)  # warned once per process and store
        CachedDataset(a.dataset, path=tmp_path)  # the same dataset object again: no warning
        CachedDataset(Tagged("d", 6), path=tmp_path, dataset_name="d")  # named: no warning
    shared = _messages(rec, "another unnamed CachedDataset")
    assert shared == [
        "CachedDataset(Tagged of length 6, dataset_name=''): another unnamed CachedDataset (Tagged of "
        "length 6), created earlier in this process and still open, wraps another dataset object and uses "
        f"the same namespace '' of {where}: they read and write the same keys, so if their samples differ "
        "each is served the other's. Pass a distinct dataset_name= to each, or the same one if they hold "
        "the same data."
    ]


def test_an_unnamed_dataset_after_the_other_was_closed_does_not_warn(tmp_path):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        CachedDataset(Tagged("a", 6), path=tmp_path).cache_loader.close()
        CachedDataset(Tagged("b", 6), path=tmp_path)
        CachedDataset(Tagged("c", 6), path=tmp_path / "elsewhere")  # another store
    assert _messages(rec, "another unnamed CachedDataset") == []


def test_same_dataset_wrapped_twice_is_not_a_conflict(tmp_path):
    a = CachedDataset(Tagged("x", 6), path=tmp_path, dataset_name="x", fingerprint={"v": 1, "size": 224})
    b = CachedDataset(Tagged("x", 6), path=tmp_path, dataset_name="x", fingerprint={"size": 224, "v": 1})
    assert [a[i] for i in range(6)] == [b[i] for i in range(6)] == [("x", i) for i in range(6)]
    a.cache_loader.flush()
    assert b.cache_loader.num_keys() == 6
    # Loaders without a fingerprint never conflict (a CacheLoader opened to inspect the namespace).
    # It counts the values only, as the datasets' own loaders do (it counted the fingerprint entry too).
    assert CacheLoader(path=tmp_path, dataset_name="x").num_keys() == 6


def test_conflict_between_cache_loaders_and_on_redis(tmp_path, own_redis):
    first = CacheLoader(path=tmp_path, dataset_name="k", fingerprint="v1")
    with pytest.raises(ConfigError, match=r"^CacheLoader\('k'\) with fingerprint 'v2' would share the cache"):
        CacheLoader(path=tmp_path, dataset_name="k", fingerprint="v2")
    CacheLoader(path=tmp_path / "other", dataset_name="k", fingerprint="v2")  # another LMDB: fine
    first.close()
    CacheLoader(path=tmp_path, dataset_name="k", fingerprint="v2")  # closed first: fine
    hosts = [own_redis().address()]
    keep = CacheLoader("redis", "k", hosts=hosts, fingerprint="v1")
    with pytest.raises(ConfigError, match=r"with fingerprint 'v1', created earlier in this process"):
        CacheLoader("redis", "k", hosts=hosts, fingerprint="v2")
    keep.get(1, lambda k: "one")
    keep.flush()
    assert keep.num_keys() == 1  # the refused loader dropped nothing
    CacheLoader("redis", "k", hosts=[own_redis().address()], fingerprint="v2")  # another server: fine


def test_a_closed_or_collected_loader_is_not_a_conflict(tmp_path):
    old = CachedDataset(Tagged("a", 4), path=tmp_path, dataset_name="d")
    [old[i] for i in range(4)]
    old.close()
    new = CachedDataset(Tagged("b", 3), path=tmp_path, dataset_name="d")  # closed first: fine
    assert new.cache_loader.num_keys() == 0  # the length changed: the old entries were dropped
    new.close()

    # Dropped without close(), with values buffered: its flush thread (flush_interval=600) still holds
    # the loader. The buffered values are written before the new one resets the namespace, then dropped.
    old = CachedDataset(Tagged("a", 4), path=tmp_path, dataset_name="d", flush_interval=600)
    [old[i] for i in range(4)]
    assert old.stats()["buffered"] == 4
    assert [t for t in threading.enumerate() if t.name == "trainloom-cache-flush[d]"]
    del old
    gc.collect()
    new = CachedDataset(Tagged("b", 3), path=tmp_path, dataset_name="d")
    assert not [t for t in threading.enumerate() if t.name == "trainloom-cache-flush[d]"]
    assert new.cache_loader.num_keys() == 0  # no stale value can be written after the reset
    assert [new[i] for i in range(3)] == [("b", i) for i in range(3)]

    # Rebinding a still-referenced dataset is refused (the old one is alive during the construction).
    keep = new
    with pytest.raises(ConfigError, match="close\\(\\) the other one first"):
        new = CachedDataset(Tagged("c", 7), path=tmp_path, dataset_name="d")
    assert keep[1] == ("b", 1)


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([i * i])


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_are_not_conflicts(tmp_path, method):
    train = CachedDataset(Squares(12), path=tmp_path, dataset_name="train", writer_buffer_size=3)
    val = CachedDataset(Squares(5), path=tmp_path, dataset_name="val", writer_buffer_size=3)
    # Spawned workers unpickle the datasets afresh each epoch, as in the first: one epoch (a spawn costs
    # ~2 s here); forked workers run two.
    for _epoch in range(2 if method == "fork" else 1):
        for ds, n in ((train, 12), (val, 5)):
            dl = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=method)
            assert torch.cat(list(dl)).flatten().tolist() == [i * i for i in range(n)]
    # A worker process creating its own loader on the parent's namespace (same fingerprint) is fine too.
    again = DataLoader(_Reopen(str(tmp_path)), batch_size=None, num_workers=1, multiprocessing_context=method)
    assert list(again) == [12]


class _Reopen(Dataset):
    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        ds = CachedDataset(Squares(12), path=self.path, dataset_name="train")
        n = ds.cache_loader.num_keys()
        ds.close()
        return n


# -- F2: entries reused from an earlier run without a fingerprint ------------------------------------


def _earlier_run(path, name: str, n: int, fingerprint=None) -> None:
    code = textwrap.dedent(
        f"""
        import torch
        from trainloom.data import CachedDataset
        class DS(torch.utils.data.Dataset):
            def __len__(self): return {n}
            def __getitem__(self, i): return torch.tensor([float(i)])
        ds = CachedDataset(DS(), path={str(path)!r}, dataset_name={name!r}, fingerprint={fingerprint!r})
        [ds[i] for i in range({n})]
        ds.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_only_local_rank_0_judges_whether_entries_are_from_an_earlier_run(tmp_path, monkeypatch):
    # Another rank of the same job may have flushed before this one opened: not an earlier run.
    _earlier_run(tmp_path, "imgs", 8)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        CachedDataset(Squares(8), path=tmp_path, dataset_name="imgs").close()
    assert not _messages(rec, "reusing")
    cache_mod._OPENED.clear()
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.warns(RuntimeWarning, match="reusing 8 cached entries written by an earlier run"):
        CachedDataset(Squares(8), path=tmp_path, dataset_name="imgs").close()


def test_a_redis_server_of_the_users_own_is_persistent_too(own_redis, monkeypatch):
    # hosts= servers outlive the job like LMDB, but reused entries and the unnamed namespace were only
    # warned about for LMDB: a second run with other values and no fingerprint got 20/20 stale samples.
    srv = own_redis()
    hosts = [srv.address()]
    earlier = CacheLoader("redis", "r", hosts=hosts)
    [earlier.get(i, lambda k: ("earlier", k)) for i in range(3)]
    earlier.close()
    cache_mod._OPENED.clear()  # as in a new run
    monkeypatch.setenv("RANK", "1")  # Redis is shared by every node: only global rank 0 judges
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        CacheLoader("redis", "r", hosts=hosts).close()
    assert not _messages(rec, "reusing")
    cache_mod._OPENED.clear()
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(RuntimeWarning) as rec:
        CacheLoader("redis", "r", hosts=hosts).close()
    assert _messages(rec, "reusing") == [
        f"CacheLoader('r'): reusing 3 cached entries written by an earlier run from "
        f"RedisStore([{srv.host}:{srv.port}], cluster_mode=True, namespace='r') (namespace 'r'). No "
        "fingerprint= was given, so they are served as they are even if the preprocessing changed "
        "since. Pass fingerprint= (e.g. a version string or the transform parameters; a change drops "
        "the old entries once), or clear the "
        f"cache (`trainloom cache clear --redis {srv.host}:{srv.port} --namespace r`) when the "
        "preprocessing changes."
    ]
    with pytest.warns(RuntimeWarning, match=r"^CacheLoader\(''\): no dataset_name was given"):
        CacheLoader("redis", "", hosts=hosts).close()
    with warnings.catch_warnings(record=True) as rec:  # a server trainloom started dies with the job
        warnings.simplefilter("always")
        CacheLoader("redis", "", hosts=None).get(0, lambda k: k)
    assert not _messages(rec, "dataset_name") and not _messages(rec, "reusing")


def test_the_reuse_warning_names_a_clear_command_per_shard_with_its_db(own_redis, monkeypatch, capsys):
    # The hint named the first server in db 0 only: on a cache sharded over two servers it cleared
    # one shard, and for a server in db 3 it cleared another cache of the same name in db 0. Now one
    # command per server, with its db; running them clears every entry.
    a, b = own_redis(), own_redis()
    hosts = [a.address(), {**b.address(), "db": 3}]
    earlier = CacheLoader("redis", "r2", hosts=hosts)
    [earlier.get(i, lambda k: ("earlier", k)) for i in range(12)]
    earlier.close()
    cache_mod._OPENED.clear()  # as in a new run
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(RuntimeWarning) as rec:
        CacheLoader("redis", "r2", hosts=hosts).close()
    [message] = _messages(rec, "reusing")
    first = f"trainloom cache clear --redis {a.host}:{a.port} --namespace r2"
    second = f"trainloom cache clear --redis redis://{b.host}:{b.port}/3 --namespace r2"
    assert f"(`{first}`, then `{second}` (the entries are sharded over these 2 servers))" in message
    for command, srv in ((first, a), (second, b)):
        monkeypatch.setenv("REDISCLI_AUTH", srv.password or "")
        assert cli.main(command.split()[1:]) == 0
    capsys.readouterr()
    cache_mod._OPENED.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        later = CacheLoader("redis", "r2", hosts=hosts)
        assert later.contains_many(range(12)) == [False] * 12
        later.close()
    assert not _messages(rec, "reusing")


def test_entries_of_an_earlier_run_without_fingerprint_warn_once(tmp_path, caplog):
    _earlier_run(tmp_path, "imgs", 8)
    caplog.set_level(logging.WARNING, logger="trainloom.data")
    with pytest.warns(RuntimeWarning) as rec:
        ds = CachedDataset(Squares(8), path=tmp_path, dataset_name="imgs")
    expected = (
        f"CacheLoader('imgs'): reusing 8 cached entries written by an earlier run from the LMDB cache at "
        f"{str(tmp_path)!r} (namespace 'imgs'). No fingerprint= was given, so they are served as they are "
        "even if the preprocessing changed since. Pass fingerprint= (e.g. a version string or the "
        "transform parameters; a change drops the old entries once), or clear the cache (`trainloom cache "
        f"clear --path {tmp_path} --namespace imgs`) when the preprocessing changes."
    )
    assert _messages(rec, "reusing") == [expected]
    assert rec[0].filename == __file__  # points at the caller, not at trainloom
    assert caplog.messages.count(expected) == 1
    assert ds[3].tolist() == [3.0]  # the earlier run's value, as the warning says
    ds.close()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        CachedDataset(Squares(8), path=tmp_path, dataset_name="imgs").close()  # once per process
        fresh = CachedDataset(Squares(8), path=tmp_path, dataset_name="new")
        [fresh[i] for i in range(8)]
        fresh.close()
        CachedDataset(Squares(8), path=tmp_path, dataset_name="new").close()  # written by this run
        CachedDataset(Squares(8), path=tmp_path / "fp", dataset_name="v", fingerprint="v1")
    assert not _messages(again, "reusing")

    # With a fingerprint nothing is said, and a changed fingerprint drops the old samples.
    _earlier_run(tmp_path / "fp2", "imgs", 8, fingerprint={"scale": 1.0})
    cache_mod._OPENED.clear()
    with warnings.catch_warnings(record=True) as rec2:
        warnings.simplefilter("always")
        ds = CachedDataset(
            Squares(8), path=tmp_path / "fp2", dataset_name="imgs", fingerprint={"scale": 10.0}
        )
    assert not _messages(rec2, "reusing") and ds.cache_loader.num_keys() == 0
    assert ds[3].tolist() == [9]


# -- F3: fingerprints compared by content ---------------------------------------------------------


def test_large_array_fingerprint_change_is_detected(tmp_path):
    names = np.array([f"img_{i:05d}.jpg" for i in range(5000)])
    ds = CachedDataset(Tagged("A", 3), path=tmp_path, dataset_name="f", fingerprint=names)
    [ds[i] for i in range(3)]
    ds.close()
    ds = CachedDataset(Tagged("A", 3), path=tmp_path, dataset_name="f", fingerprint=names.copy())
    assert ds.cache_loader.num_keys() == 3  # same content: kept
    ds.close()
    changed = names.copy()
    changed[2500] = "other.jpg"  # repr() shows neither element: "..." in the middle
    assert repr(changed) == repr(names)
    ds = CachedDataset(Tagged("B", 3), path=tmp_path, dataset_name="f", fingerprint=changed)
    assert ds.cache_loader.num_keys() == 0 and ds[1] == ("B", 1)
    ds.close()
    t = torch.arange(5000, dtype=torch.bfloat16)
    ds = CachedDataset(Tagged("B", 3), path=tmp_path, dataset_name="f", fingerprint=("t", t))
    [ds[i] for i in range(3)]
    ds.close()
    t2 = t.clone()
    t2[2500] = 1
    ds = CachedDataset(Tagged("B", 3), path=tmp_path, dataset_name="f", fingerprint=("t", t2))
    assert ds.cache_loader.num_keys() == 0


def transform(x):
    return x


def test_fingerprint_of_other_types_is_a_type_error_and_touches_nothing(tmp_path):
    ds = CachedDataset(Tagged("A", 3), path=tmp_path, dataset_name="f", fingerprint="v1")
    [ds[i] for i in range(3)]
    ds.close()
    with pytest.raises(TypeError) as err:
        CachedDataset(Tagged("A", 3), path=tmp_path, dataset_name="f", fingerprint=("v1", transform))
    assert str(err.value) == (
        "fingerprint= does not accept a builtins.function (at fingerprint[1]): it is compared by content "
        "and accepts str, bytes, int, float, bool, None, tuples, lists and dicts of these, numpy arrays "
        "and scalars (not of dtype object) and torch tensors (strided). Pass what describes the "
        "preprocessing, e.g. a version string or a tuple of its parameters (not a function or transform "
        "object, whose repr changes every run)"
    )
    with pytest.raises(TypeError, match=r"numpy arrays of dtype object \(at fingerprint\)"):
        CacheLoader(path=tmp_path, dataset_name="f", fingerprint=np.array([object()]))
    with pytest.raises(TypeError, match="accepts strided tensors only"):
        CacheLoader(path=tmp_path, dataset_name="f", fingerprint=torch.eye(2).to_sparse())
    ds = CachedDataset(Tagged("A", 3), path=tmp_path, dataset_name="f", fingerprint="v1")
    assert ds.cache_loader.num_keys() == 3  # nothing was dropped by the refused constructions


def test_digest_is_by_content():
    d = fingerprint_digest
    assert d({"a": 1, "b": [2.0, "x"]}) == d({"b": [2.0, "x"], "a": 1})
    assert len({d(1), d(True), d(1.0), d("1"), d(b"1"), d((1,)), d([1]), d(None)}) == 8
    assert d(np.arange(3, dtype=np.int64)) != d(np.arange(3, dtype=np.int32))
    assert d(np.arange(6).reshape(2, 3)) != d(np.arange(6).reshape(3, 2))
    assert d(np.arange(6).reshape(2, 3).T) == d(np.ascontiguousarray(np.arange(6).reshape(2, 3).T))
    assert d(torch.arange(4)) == d(torch.arange(4).clone()) != d(torch.arange(4).float())
    assert d(np.float32(1.5)) != d(1.5)
    assert d(2**100) != d(2**100 + 1)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_caches_of_older_versions_are_dropped_once(tmp_path, caplog, version):
    # Older trainloom stored b"trainloom-cache-v1|" + repr(("len", n, fingerprint)), then
    # b"trainloom-cache-v2|" + a digest, both with keys "{dataset_name}_{index}"; keys now carry the
    # fingerprint's tag, so those entries cannot be read and are dropped once.
    store = LmdbStore(tmp_path, namespace="old")
    if version == "v1":
        old = b"trainloom-cache-v1|" + repr(("len", 3, "v1")).encode()
    else:
        old = b"trainloom-cache-v2|" + fingerprint_digest(("len", 3, "v1")).split(b"|", 1)[1]
    store.mset({META_KEY: old})
    store.mset({f"old_{i}": cache_mod._codec.encode(("old", i)) for i in range(3)})
    store.close()
    with caplog.at_level("WARNING", logger="trainloom.data"):
        ds = CachedDataset(Tagged("new", 3), path=tmp_path, dataset_name="old", fingerprint="v1")
    assert [r.getMessage() for r in caplog.records] == [
        "CacheLoader('old'): the cache was written by an older trainloom (other keys); dropped the stale "
        "entries of namespace 'old'"
    ]
    assert ds.cache_loader.num_keys() == 0 and ds[2] == ("new", 2)
    assert ds.cache_loader.store.get(META_KEY) == fingerprint_digest(("len", 3, "v1"))
    ds.close()


_OTHER_JOB = """
import json, sys
from trainloom.data import CachedDataset
from torch.utils.data import Dataset

class Tagged(Dataset):
    def __init__(self, tag, n): self.tag, self.n = tag, n
    def __len__(self): return self.n
    def __getitem__(self, i): return (self.tag, i)

kw = json.loads(sys.argv[1])
ds = CachedDataset(Tagged("B", 6), dataset_name="shared", fingerprint="v2", writer_buffer_size=1, **kw)
print(json.dumps([list(ds[i]) for i in range(6)]))
ds.close()
"""


def _run_other_job(**kwargs) -> list:
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_JOB, json.dumps(kwargs)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_jobs_with_different_fingerprints_at_once_never_read_each_others_values(tmp_path, own_redis, backend):
    # A re-run with changed preprocessing started while the old job still runs: the new job's check
    # drops the namespace, then each job wrote its values under the same keys and read the other's
    # (on Redis 803 of 1840 samples wrong), with no warning. Keys carry the fingerprint's tag now.
    kw = {"path": str(tmp_path)} if backend == "lmdb" else {"hosts": [own_redis().address()]}
    kw["backend"] = backend
    a = CachedDataset(Tagged("A", 6), dataset_name="shared", writer_buffer_size=1, fingerprint="v1", **kw)
    assert [a[i] for i in range(6)] == [("A", i) for i in range(6)]
    assert _run_other_job(**kw) == [["B", i] for i in range(6)]  # drops A's entries, writes its own
    assert [a[i] for i in range(6)] == [("A", i) for i in range(6)]  # recomputed, not B's values
    assert a.stats()["misses"] == 12
    assert [a[i] for i in range(6)] == [("A", i) for i in range(6)] and a.stats()["hits"] == 6
    assert _run_other_job(**kw) == [["B", i] for i in range(6)]  # A's writes are not B's values
    a.close()


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_a_lost_fingerprint_entry_keeps_the_cache(tmp_path, own_redis, backend, caplog):
    # The fingerprint entry evicted (allkeys-lru evicts it first: it is read once) or flushed: the next
    # run with the same data took that for a change and dropped everything. Keys carry the tag, so a
    # namespace without the entry keeps its values.
    kw = {"path": str(tmp_path)} if backend == "lmdb" else {"hosts": [own_redis().address()]}
    ds = CachedDataset(Tagged("A", 5), backend, dataset_name="lost", fingerprint="v1", **kw)
    assert [ds[i] for i in range(5)] == [("A", i) for i in range(5)]
    ds.cache_loader.flush()
    if backend == "lmdb":
        ds.cache_loader.store.delete([META_KEY])
    else:
        (node,) = ds.cache_loader.store.stores
        assert node._c().delete(node.prefix + META_KEY) == 1
    ds.close()
    with caplog.at_level("WARNING", logger="trainloom.data"):
        again = CachedDataset(Tagged("A", 5), backend, dataset_name="lost", fingerprint="v1", **kw)
    assert caplog.records == []
    assert [again[i] for i in range(5)] == [("A", i) for i in range(5)] and again.stats()["hits"] == 5
    assert again.cache_loader.store.get(META_KEY) == fingerprint_digest(("len", 5, "v1"))
    again.close()


def test_a_failed_fingerprint_check_in_bypass_mode_serves_nothing_stale(own_redis):
    # The server stalled while a job with changed data was constructed: with on_error="bypass" the
    # check failed once, was never retried, and the job then served the old data's values as hits.
    import os
    import signal

    srv = own_redis()
    hosts = [srv.address()]
    old = CachedDataset(Tagged("old", 6), "redis", "bp", 1, fingerprint="v1", hosts=hosts)
    assert [old[i] for i in range(6)] == [("old", i) for i in range(6)]
    old.close()
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        with pytest.warns(RuntimeWarning, match=r"failed during the fingerprint check .*on_error='bypass'"):
            new = CachedDataset(
                Tagged("new", 6),
                "redis",
                "bp",
                1,
                fingerprint="v2",
                hosts=hosts,
                on_error="bypass",
                retry_interval=0,
            )
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert [new[i] for i in range(6)] == [("new", i) for i in range(6)]
    assert [new[i] for i in range(6)] == [("new", i) for i in range(6)] and new.stats()["hits"] == 6
    new.close()


# -- F4: Redis values over proto-max-bulk-len ------------------------------------------------------


def test_redis_value_over_the_server_limit_is_refused_alone(own_redis):
    srv = own_redis(proto_max_bulk_len=1 << 20)
    hosts = [srv.address()]
    big = np.ones((1 << 20) + 1, dtype=np.uint8)  # encoded: over 1 MiB
    loader = CacheLoader("redis", "big", writer_buffer_size=4, hosts=hosts, on_error="bypass")
    assert loader.store.stores[0].max_value_size() == 1 << 20
    with pytest.warns(RuntimeWarning) as rec:
        for i in range(8):
            loader.get(i, lambda k: big if k == 5 else np.full(1000, k))
    msgs = _messages(rec, "refused")
    assert len(msgs) == 1
    size = len(cache_mod._codec.encode(big))
    assert (
        f"the redis store refused 1 value(s), dropped (not cached; recomputed when next read): key "
        f"b'big_5': RedisStore.mset on {srv.host}:{srv.port} (namespace 'big'): the value of key 'big_5' "
        f"is {size} bytes, over the server's proto-max-bulk-len of 1048576 bytes (Redis would drop the "
        "connection); not sent." in msgs[0]
    )
    s = loader.stats()
    assert (s["writes"], s["dropped"], s["bypassed"], s["buffered"]) == (7, 1, 0, 0)
    assert loader.num_keys() == 7 and loader.store.status()
    out = loader.get_many(list(range(8)), lambda k: big if k == 5 else None)
    assert [int(v[0]) for i, v in enumerate(out) if i != 5] == [0, 1, 2, 3, 4, 6, 7]
    assert loader.stats()["hits"] == 7 and loader.stats()["bypassed"] == 0

    # on_error="raise": the others are written, the StoreError names the key, its size and the limit.
    strict = CacheLoader("redis", "big2", writer_buffer_size=2, hosts=hosts)
    strict.get(0, lambda k: np.zeros(3))
    with pytest.raises(StoreError, match=rf"key b'big2_1'.*is {size} bytes, over the server's proto-max"):
        strict.get(1, lambda k: big)
    assert strict.num_keys() == 1 and strict.stats()["buffered"] == 0
    # Alone in its batch it is still a refused value, not a failing store (nothing stays buffered).
    strict.get(2, lambda k: big)
    with pytest.raises(StoreError, match="refused 1 value"):
        strict.flush()
    assert strict.stats()["buffered"] == 0 and strict.store.status()
    # The store itself refuses before sending anything.
    with pytest.raises(StoreValueRefusedError, match="over the server's proto-max-bulk-len"):
        strict.store.mset({"x": b"1", "y": bytes((1 << 20) + 1)})
    assert strict.store.get("x") is None


def test_redis_value_over_the_servers_query_buffer_limit_is_refused_alone(own_redis):
    # A server with a lower client-query-buffer-limit disconnects a client sending a larger value:
    # that read as "server unreachable ... is redis-server running?", raised at that sample every
    # epoch, and with "bypass" switched the whole store off (nothing was ever written).
    import redis

    srv = own_redis()
    redis.Redis(srv.host, srv.port, password=srv.password).config_set("client-query-buffer-limit", 1 << 20)
    loader = CacheLoader("redis", "qb", writer_buffer_size=1, hosts=[srv.address()])
    limit = (1 << 20) - 1024
    assert loader.store.stores[0].max_value_size() == limit
    loader.get(0, lambda k: np.zeros(3))
    big = np.ones(3 << 19, dtype=np.uint8)  # 1.5 MiB
    size = len(cache_mod._codec.encode(big))
    with pytest.raises(
        StoreError,
        match=rf"key b'qb_1'.*is {size} bytes, over the server's client-query-buffer-limit \(less 1024 "
        rf"bytes\) of {limit} bytes \(Redis would drop the connection\); not sent. Raise the server's limit "
        r"\(redis-server --client-query-buffer-limit, CONFIG SET\)",
    ):
        loader.get(1, lambda k: big)
    loader.get(2, lambda k: np.zeros(3))
    assert loader.num_keys() == 2 and loader.store.status() and loader.stats()["buffered"] == 0
    loader.close()


def test_redis_server_proto_max_bulk_len_argument():
    with pytest.raises(ValueError, match=r"proto_max_bulk_len must be an int >= 1 MiB \(1048576\), got 10"):
        RedisServer(proto_max_bulk_len=10)


# -- F6: __getitems__ must return a list of samples -------------------------------------------------


class BatchedGetitems(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return {"x": torch.tensor([i]), "y": torch.tensor(i % 2)}

    def __getitems__(self, idx):
        return {"x": torch.tensor(idx).view(-1, 1), "y": torch.tensor(idx) % 2}


class ShortGetitems(BatchedGetitems):
    def __getitems__(self, idx):
        return [self[i] for i in idx[:-1]]


def test_getitems_returning_a_batch_is_a_type_error(tmp_path):
    ds = CachedDataset(BatchedGetitems(), path=tmp_path, dataset_name="b")
    dl = DataLoader(ds, batch_size=2, collate_fn=lambda b: b)
    with pytest.raises(TypeError) as err:
        next(iter(dl))
    assert str(err.value) == (
        "BatchedGetitems.__getitems__ returned a dict; CachedDataset (like torch's DataLoader) needs it to "
        "return a list with one sample per index, which it caches one by one. Return [sample for each "
        "index] and batch them in collate_fn, or remove __getitems__."
    )
    assert ds.cache_loader.num_keys() == 0
    short = CachedDataset(ShortGetitems(), path=tmp_path, dataset_name="s")
    with pytest.raises(ValueError, match=r"ShortGetitems.__getitems__ returned 3 samples for 4 indices"):
        short.__getitems__([0, 1, 2, 3])


# -- F7: tensors with Python state ----------------------------------------------------------------


class WithState(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        x = torch.full((3,), float(i))
        x.source = f"img_{i:04d}.jpg"
        w = torch.nn.Parameter(torch.ones(2) * i)
        return {"x": x, "w": [w], "plain": torch.arange(i + 1)}


def _describe(sample):
    x, w, plain = sample["x"], sample["w"][0], sample["plain"]
    return (
        type(x).__name__,
        getattr(x, "source", None),
        x.tolist(),
        type(w).__name__,
        w.requires_grad,
        w.tolist(),
        type(plain).__name__,
        plain.__dict__,
        plain.tolist(),
    )


def test_tensor_attributes_and_parameters_survive_the_cache(tmp_path):
    ds = CachedDataset(WithState(), path=tmp_path, dataset_name="st", writer_buffer_size=1)
    epoch0 = [_describe(ds[i]) for i in range(4)]
    epoch1 = [_describe(ds[i]) for i in range(4)]
    assert ds.stats()["hits"] == 4
    assert epoch1 == epoch0
    assert epoch0[2] == (
        "Tensor",
        "img_0002.jpg",
        [2.0] * 3,
        "Parameter",
        True,
        [2.0, 2.0],
        "Tensor",
        {},
        [0, 1, 2],
    )
    # Through DataLoader workers, cached samples arrive as the uncached ones do (torch's own transfer
    # between processes drops tensor attributes: the same for both).
    for workers in (0, 2):
        kw = dict(batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None)
        uncached = [_describe(s) for s in DataLoader(WithState(), **kw)]
        assert [_describe(s) for s in DataLoader(ds, **kw)] == uncached
        assert workers or uncached == epoch0
    # The data of such a tensor is still stored raw (not pickled twice); plain tensors never pickle.
    big = torch.zeros(1 << 18)
    big.note = "n"
    enc = ds.cache_loader._encode({"x": big}, "x")
    assert len(enc) < big.numel() * 4 + 4096
    assert b"_rebuild_tensor_with_state" in enc
    plain = (torch.zeros(3), {"y": [torch.ones(2)]}, 1)
    assert ds.cache_loader._encode(plain, "x") == cache_mod._codec.encode(plain)  # the raw path, as before


_REUSE_SCRIPT = """
import logging, sys
if sys.argv[2] == "logging":
    logging.basicConfig(format="LOG %(name)s %(levelname)s %(message)s")
from trainloom.data import CacheLoader
loader = CacheLoader(path=sys.argv[1], dataset_name="sq")
print(loader.get(3, lambda k: k * k))
loader.close()
"""


@pytest.mark.parametrize("setup", ["plain", "logging"])
def test_reuse_warning_is_printed_once_on_a_plain_console_and_logged_when_logging_is_set_up(setup, tmp_path):
    def run(mode):
        out = subprocess.run(
            [sys.executable, "-c", _REUSE_SCRIPT, str(tmp_path), mode],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0 and out.stdout.strip() == "9", out.stderr
        return [line for line in out.stderr.splitlines() if "reusing 1 cached entries" in line]

    assert run("plain") == []  # the first run computes and stores
    lines = run(setup)
    assert len(lines) == (1 if setup == "plain" else 2), lines
    assert lines[0].startswith("<string>:6: RuntimeWarning: CacheLoader('sq'): reusing 1 cached entries"), (
        lines
    )
    if setup == "logging":
        assert lines[1].startswith(
            "LOG trainloom.data WARNING CacheLoader('sq'): reusing 1 cached entries"
        ), lines


def test_unknown_store_arguments_name_the_argument_and_what_the_backend_takes(tmp_path):
    with pytest.raises(TypeError) as e:
        CacheLoader(path=tmp_path, dataset_name="a", key_prefix="x")  # early Bagua's argument
    assert str(e.value) == (
        "unexpected keyword argument 'key_prefix' for backend='lmdb'; its store takes path, map_size, "
        "max_map_size, max_readers, max_dbs, sync, readonly"
    )
    with pytest.raises(TypeError) as e:
        CachedDataset(Squares(4), backend="redis", dataset_name="a", batch_writes=1, foo=2)
    assert str(e.value) == (
        "unexpected keyword arguments 'batch_writes', 'foo' for backend='redis'; its store takes hosts, "
        "cluster_mode, capacity_per_node, password, bind, timeout, retries, maxmemory_policy, "
        "startup_timeout"
    )


def test_a_read_only_cache_serves_hits_and_drops_misses_with_one_warning(tmp_path):
    # A pre-built cache on read-only storage, opened with the LmdbStore argument readonly=True: the
    # fingerprint check used to open a write transaction, and the first miss raised.
    ds = CachedDataset(Tagged("a", 6), path=tmp_path, dataset_name="ro", fingerprint="v1")
    [ds[i] for i in range(4)]
    ds.close()
    ro = CachedDataset(Tagged("a", 6), path=tmp_path, dataset_name="ro", fingerprint="v1", readonly=True)
    assert [ro[i] for i in range(4)] == [("a", i) for i in range(4)]
    with pytest.warns(RuntimeWarning) as rec:
        assert ro[5] == ("a", 5) and ro[5] == ("a", 5)  # computed twice: not stored
    assert [str(r.message) for r in rec] == [
        f"CacheLoader('ro'): the LMDB cache at {str(tmp_path)!r} was opened read-only (readonly=True): "
        "values computed for misses are returned but not stored (counted in stats()['dropped'])."
    ]
    s = ro.stats()
    assert (s["hits"], s["misses"], s["dropped"], s["writes"], s["buffered"]) == (4, 2, 2, 0, 0)
    assert ro.cache_loader.num_keys() == 4
    ro.close()
    with pytest.raises(ConfigError) as info:
        CachedDataset(Tagged("a", 7), path=tmp_path, dataset_name="ro", fingerprint="v1", readonly=True)
    assert str(info.value) == (
        "CacheLoader('ro') with fingerprint ('len', 7, 'v1'): the LMDB cache at "
        f"{str(tmp_path)!r} was opened read-only (readonly=True) and its namespace 'ro' holds another "
        "fingerprint, so its entries were made for other data or preprocessing (for CachedDataset the "
        "fingerprint includes the dataset's length). A read-only cache cannot be rebuilt: pass the "
        "fingerprint it was built with, open it writable to rebuild it, or use another path."
    )
    assert CacheLoader(path=tmp_path, dataset_name="ro").num_keys() == 4  # nothing was dropped


def test_dataset_name_with_a_lone_surrogate_and_an_empty_path(tmp_path):
    with pytest.raises(ValueError) as info:
        CachedDataset(Tagged("a", 2), path=tmp_path, dataset_name="imgs_\udcff")
    assert str(info.value) == (
        "namespace 'imgs_\\udcff' (the dataset_name) holds a lone surrogate ('\\udcff' at position 5), e.g. "
        "from a file name that is not valid UTF-8; pass a name that is valid text, e.g. "
        "name.encode('utf-8', 'surrogateescape').decode('utf-8', 'replace')"
    )
    with pytest.raises(ValueError) as info:
        CachedDataset(Tagged("a", 2), path="", dataset_name="x")
    assert str(info.value) == (
        "LmdbStore: path is empty (it would put the cache in the current directory); pass a directory, "
        "or None for the default cache directory"
    )


_FULL_DISK = """
import sys, warnings
import torch
from trainloom.data import CachedDataset
from trainloom.data.stores import StoreFullError

class Big(torch.utils.data.Dataset):
    def __len__(self):
        return 40
    def __getitem__(self, i):
        return torch.full((256 * 1024,), float(i))  # 1 MiB

path = sys.argv[1]
ds = CachedDataset(Big(), path=path, dataset_name="full", writer_buffer_size=4, map_size=64 << 20)
try:
    [ds[i] for i in range(40)]
except StoreFullError as exc:
    print("raise:", str(exc).split(":")[0], "|", "the disk is full" in str(exc), ds.stats()["writes"])
try:
    ds.close()  # flushes what is still buffered: the disk is still full
except StoreFullError:
    print("close: StoreFullError")
ds = CachedDataset(Big(), path=path, dataset_name="full", writer_buffer_size=4, on_error="bypass",
                   map_size=64 << 20)
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    for epoch in range(2):
        assert all(ds[i][0].item() == i for i in range(40))
s = ds.stats()
full = [r for r in rec if "disk is full" in str(r.message)]
print("bypass:", s["hits"], s["errors"], s["bypassed"], len(full))
"""


def test_a_full_disk_is_a_store_full_error_and_bypass_keeps_reading(tmp_path):
    # LMDB reports a short write (ENOSPC) as EIO at commit: it read as "the store refused 11 values",
    # and in bypass mode every failed retry switched reads off too, so nothing was served.
    script = tmp_path / "full.py"
    script.write_text(_FULL_DISK)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = f"mount -t tmpfs -o size=24m tmpfs {mnt} && {sys.executable} {script} {mnt}"
    try:
        out = subprocess.run(
            ["unshare", "--mount", "sh", "-c", cmd], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:  # pragma: no cover - util-linux is part of the machines this runs on
        pytest.fail("this test needs util-linux's unshare (a private mount namespace for a small tmpfs)")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    n = int(lines[0].split()[-1])
    assert lines[0] == f"raise: LmdbStore.mset on {mnt} (namespace 'full') | True {n}" and 8 <= n < 24
    # bypass: what was written is served in both epochs; one warning; the store is never skipped
    assert lines[1] == "close: StoreFullError"
    assert lines[2] == f"bypass: {2 * n} 1 0 1"


# -- a batch that fills the LMDB map part-way ------------------------------------------------------


@pytest.mark.parametrize("on_error", ["raise", "bypass"])
def test_values_stored_before_the_lmdb_map_filled_up_count_as_written_and_are_not_rewritten(
    tmp_path, monkeypatch, on_error
):
    # LmdbStore writes a batch that fails at max_map_size value by value; its StoreFullError did not
    # say which values it stored first, so the cache counted none as written: with "raise" they stayed
    # buffered and every later flush wrote them again, with "bypass" they were counted as dropped.
    calls: list = []
    real = LmdbStore.mset

    def mset(self, dictionary):
        calls.append(len(dictionary))
        return real(self, dictionary)

    monkeypatch.setattr(LmdbStore, "mset", mset)
    loader = CacheLoader(
        path=tmp_path,
        dataset_name="f",
        writer_buffer_size=40,
        on_error=on_error,
        map_size=1 << 20,
        max_map_size=8 << 20,
        flush_interval=None,
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(39):
            loader.get(i, lambda k: np.full(300_000, k, np.uint8))
        if on_error == "raise":
            with pytest.raises(StoreFullError) as info:  # the 40th value fills the buffer: 12 MB
                loader.get(39, lambda k: np.full(300_000, k, np.uint8))
            full = info.value
        else:
            loader.get(39, lambda k: np.full(300_000, k, np.uint8))
            [message] = _messages(rec, "is full at max_map_size")
    stored = [k for k, v in zip(range(40), loader.store.mget([f"f_{i}" for i in range(40)])) if v is not None]
    n = len(stored)
    assert 20 < n < 40 and stored == list(range(n))
    text = (
        f"Of the 40 values of this mset, written: {n} ('f_0', 'f_1', 'f_2' and {n - 3} more); not written: "
        f"{40 - n} ('f_{n}', 'f_{n + 1}', 'f_{n + 2}' and {40 - n - 3} more)"
    )
    s = loader.stats()
    if on_error == "raise":
        assert str(full).endswith(text)
        assert full.written == tuple(f"f_{i}".encode() for i in range(n))
        assert (s["writes"], s["dropped"], s["buffered"], s["errors"]) == (n, 0, 40 - n, 1)
        with pytest.raises(StoreFullError):
            loader.close()  # its flush tries again only the values not written
        assert calls == [40, 40 - n]
    else:
        assert f"{text}. on_error='bypass': no new values will be written" in message
        assert (s["writes"], s["dropped"], s["buffered"], s["errors"]) == (n, 40 - n, 0, 1)
        loader.close()
        assert calls == [40]
