"""CacheLoader fixes from the data audit: values of a loader dropped without close(), a value too large
for LMDB's max_map_size, bypass in contains_many()/warmup(), numpy numbers as arguments, deeply nested
Parameters, and a Store instance shared by two dataset names."""

from __future__ import annotations

import gc
import logging
import multiprocessing.util
import subprocess
import sys
import textwrap
import warnings
import weakref

import numpy as np
import pytest
import torch
from test_stores import BaguaDictStore

from trainloom.data import CachedDataset, CacheLoader, cache
from trainloom.data.stores import LmdbStore, Store, StoreError, StoreUnavailableError, StoreValueRefusedError
from trainloom.errors import ConfigError


class Squares:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i * i


class DownStore(Store):
    """A store whose server is down: every call fails."""

    namespace = "down"

    def mget_apply(self, keys, fn):
        raise StoreUnavailableError("server down", backend="store")

    def mset(self, dictionary):
        raise StoreUnavailableError("server down", backend="store")

    def num_keys(self):
        raise StoreUnavailableError("server down", backend="store")

    def clear(self):
        raise StoreUnavailableError("server down", backend="store")

    def status(self):
        return False

    def reset_if_changed(self, key, value):
        raise StoreUnavailableError("server down", backend="store")


class DictStore(BaguaDictStore):
    """A store written to Bagua's interface (no namespace of its own)."""


# -- 1: a loader collected without close() ----------------------------------------------------------


def _exit_handlers() -> int:
    """The loaders' exit handlers registered with multiprocessing.util: one per loader that buffered and
    was neither closed nor written since (a collected one keeps it until the next loader call)."""
    entries = list(multiprocessing.util._finalizer_registry.values())
    return sum(1 for f in entries if getattr(f, "_callback", None) is cache._flush_at_exit)


def _settle() -> int:
    """Collect what earlier tests left (a loader only a reference cycle holds would otherwise be freed
    in the middle of a test), let a loader call write what they buffered, and count the exit handlers."""
    gc.collect()
    CacheLoader(DictStore(), "settle", flush_interval=None).close()
    return _exit_handlers()


def test_values_of_a_loader_collected_without_close_are_written(tmp_path):
    before = _settle()
    other = CacheLoader(DictStore(), "other", flush_interval=None)
    loader = CacheLoader(path=tmp_path, dataset_name="gc", writer_buffer_size=10, flush_interval=None)
    for i in range(3):
        loader.get(i, lambda k: k * k)
    assert loader.stats()["buffered"] == 3
    assert _exit_handlers() == before + 1
    ref = weakref.ref(loader)
    loader.me = loader  # a reference cycle: freed by the cyclic collector, at any allocation
    del loader
    gc.collect()
    assert ref() is None  # nothing (no exit handler) keeps the loader alive
    # Not written inside the collector (see test_a_collection_inside_a_read_writes_nothing_then): the
    # exit handler still holds the values, so they are written at exit at the latest.
    raw = LmdbStore(tmp_path, namespace="gc")
    assert raw.num_keys() == 0 and _exit_handlers() == before + 1
    # The next call of any loader of the process writes them and unregisters the exit handler.
    assert other.contains_many([1]) == [False]
    assert raw.num_keys() == 3 and _exit_handlers() == before
    raw.close()
    other.close()
    with CacheLoader(path=tmp_path, dataset_name="gc") as again:
        assert again.num_keys() == 3
        assert again.get_many([0, 1, 2], lambda k: pytest.fail(f"recomputed {k}")) == [0, 1, 4]
        assert again.stats()["hits"] == 3


def test_dropped_and_closed_loaders_leave_no_exit_entries(tmp_path):
    before = _settle()
    for i in range(30):
        loader = CacheLoader(
            path=tmp_path, dataset_name=f"d{i % 3}", writer_buffer_size=5, flush_interval=None
        )
        loader.get(i, lambda k: k)
        if i % 2:
            loader.close()
        else:
            loader.me = loader  # dropped in a reference cycle
        del loader
        gc.collect()
        # Only the loader just dropped waits (the next loader's construction writes it): the registry
        # does not grow with the number of loaders dropped.
        assert _exit_handlers() <= before + 1
    assert _exit_handlers() == before
    assert sum(CacheLoader(path=tmp_path, dataset_name=f"d{j}").num_keys() for j in range(3)) == 30


def test_a_collected_loader_that_cannot_write_logs_what_it_lost(caplog):
    _settle()
    other = CacheLoader(DictStore(), "other", flush_interval=None)
    loader = CacheLoader(DownStore(), "x", writer_buffer_size=10, flush_interval=None, on_error="bypass")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bypass warning (tested elsewhere)
        assert loader.get(0, lambda k: 7) == 7
    counters = loader._counters
    with caplog.at_level(logging.ERROR, logger="trainloom.data"):
        del loader
        gc.collect()
        # Nothing is written (or tried) inside the collector.
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert other.get(1, lambda k: 2) == 2  # the next loader call tries, and does not raise
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "CacheLoader('x'): could not write 1 of 1 buffered value(s) left by a CacheLoader garbage-collected "
        "without close() (not cached; computed again when next read): key b'x_0': server down"
    ]
    s, _ = counters.total()
    assert (s["dropped"], s["buffered"], s["buffered_bytes"]) == (1, 0, 0)
    other.close()


class RefusingStore(DictStore):
    """Refuses every value larger than 64 bytes (as Redis's proto-max-bulk-len does) and counts mset calls."""

    def __init__(self) -> None:
        super().__init__()
        self.msets = 0

    def mset(self, dictionary):
        self.msets += 1
        big = [k for k, v in dictionary.items() if len(v) > 64]
        if big:
            raise StoreValueRefusedError(f"value of {len(dictionary[big[0]])} bytes over 64", backend="store")
        super().mset(dictionary)


@pytest.mark.parametrize("collected", [False, True])
def test_a_refused_batch_is_written_value_by_value_once_by_both_write_paths(collected, caplog):
    """The loader's flush and the writer of a collected loader's buffer share one loop: the other
    values of a refused batch are written, the refused one dropped, and a batch of that one value
    alone is not sent twice (the collected loader's writer sent it again)."""
    _settle()
    other = CacheLoader(DictStore(), "other", flush_interval=None)
    for values in ({0: 1, 1: "x" * 100, 2: 3}, {1: "x" * 100}):
        store = RefusingStore()
        loader = CacheLoader(store, "r", writer_buffer_size=10, flush_interval=None, on_error="bypass")
        for k, v in values.items():
            loader.get(k, lambda _, v=v: v)
        with caplog.at_level(logging.ERROR, logger="trainloom.data"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the loader's "refused" warning
            if collected:
                del loader
                gc.collect()
                other.get(9, lambda k: 9)  # a loader call: writes the collected loader's buffer
            else:
                loader.flush()
                loader.close()
        # one batch, then each value alone (none for a single value)
        assert store.msets == (1 + len(values) if len(values) > 1 else 1)
        assert sorted(store.d) == [f"r_{k}".encode() for k in values if k != 1]
    other.close()


def test_a_collection_inside_a_read_writes_nothing_then(tmp_path, monkeypatch):
    """The cyclic collector may free a dropped loader inside another loader's LMDB read transaction (at
    any allocation there): a write then could grow the map under the reader's buffers (a segfault) or
    nest a write transaction. Its values are written at the next loader call instead."""
    from trainloom.data.stores import lmdb_store

    _settle()
    events = []
    real_codec, real_mset = lmdb_store._codec, LmdbStore.mset

    class CollectingCodec:
        def __getattr__(self, name):
            return getattr(real_codec, name)

        def decode_many_get(self, get, keys, missing):  # runs inside the read transaction
            events.append("read begins")
            gc.collect()  # what an allocation crossing the collector's threshold does here
            events.append(f"collected={ref() is None}")
            out = real_codec.decode_many_get(get, keys, missing)
            events.append("read ends")
            return out

    def mset(self, dictionary):
        events.append(f"mset {self.namespace} {sorted(dictionary)}")
        return real_mset(self, dictionary)

    reader = CacheLoader(path=tmp_path, dataset_name="r", flush_interval=None)
    reader.get(0, lambda k: "zero")
    gc.disable()  # the collection happens where the test puts it
    try:
        dropped = CacheLoader(path=tmp_path, dataset_name="d", writer_buffer_size=10, flush_interval=None)
        for i in range(3):
            dropped.get(i, lambda k: k)
        dropped.me = dropped
        ref = weakref.ref(dropped)
        del dropped
        monkeypatch.setattr(LmdbStore, "mset", mset)
        monkeypatch.setattr(lmdb_store, "_codec", CollectingCodec())
        assert reader.get(0, lambda k: pytest.fail("recomputed")) == "zero"
    finally:
        gc.enable()
    assert events == ["read begins", "collected=True", "read ends"]  # no write inside the read
    monkeypatch.setattr(lmdb_store, "_codec", real_codec)
    assert reader.get(1, lambda k: "one") == "one"
    # Written at the start of the next call, before its own read and write.
    assert events[3:] == ["mset d [b'd_0', b'd_1', b'd_2']", "mset r [b'r_1']"]
    reader.close()
    with CacheLoader(path=tmp_path, dataset_name="d") as again:
        assert again.get_many([0, 1, 2], lambda k: pytest.fail(f"recomputed {k}")) == [0, 1, 2]


def test_a_dropped_loaders_values_are_written_at_exit_without_another_call(tmp_path):
    script = textwrap.dedent(
        f"""
        import gc
        from trainloom.data import CacheLoader
        from trainloom.data.stores import LmdbStore

        loader = CacheLoader(path={str(tmp_path)!r}, dataset_name="exit", writer_buffer_size=10,
                             flush_interval=None)
        for i in range(3):
            loader.get(i, lambda k: k * 10)
        loader.me = loader
        del loader
        gc.collect()
        # No loader call follows: only its exit handler can write the values.
        print(LmdbStore({str(tmp_path)!r}, namespace="exit").num_keys())
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0"]  # not written inside the collector
    assert "could not write" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reusing the entries of an earlier run (that script)
        again = CacheLoader(path=tmp_path, dataset_name="exit")
    assert again.get_many([0, 1, 2], lambda k: pytest.fail(f"recomputed {k}")) == [0, 10, 20]
    again.close()


class FlakyStore(DictStore):
    """A Bagua-style store whose server can be taken down; counts the writes tried."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.msets = 0

    def mset(self, dictionary):
        self.msets += 1
        if self.down:
            raise StoreUnavailableError("server down", backend="store")
        super().mset(dictionary)


@pytest.mark.parametrize("on_error", ["raise", "bypass"])
def test_a_live_loader_keeps_its_values_when_another_opens_while_the_store_is_down(on_error, caplog):
    store = FlakyStore()
    a = CacheLoader(
        store,
        "a",
        writer_buffer_size=10,
        flush_interval=None,
        on_error=on_error,
        retry_interval=60,
        fingerprint=1,
    )
    for i in range(3):
        a.get(i, lambda k: k + 100)
    store.down = True
    if on_error == "bypass":
        with pytest.warns(RuntimeWarning, match="server down"):
            a.flush()  # fails: the store is known down for retry_interval
    tried = store.msets
    with caplog.at_level(logging.ERROR, logger="trainloom.data"), pytest.raises(ConfigError):
        CacheLoader(store, "a", fingerprint=2)  # a is still open and used: a conflict
    s = a.stats()
    assert (len(a._pending.buffer), s["buffered"], s["dropped"]) == (3, 3, 0)  # kept, as after flush()
    if on_error == "bypass":
        assert store.msets == tried  # not tried before retry_interval
    else:
        assert store.msets == tried + 1
        assert [r.getMessage() for r in caplog.records] == [
            "CacheLoader('a'): could not write its buffered values before another loader of this process "
            "opened the namespace (3 still buffered): server down"
        ]
    store.down = False
    a._down_until = 0.0  # (the retry time has come)
    a.flush()
    s = a.stats()
    assert (s["writes"], s["dropped"], s["buffered"]) == (3, 0, 0)
    assert a.get_many([0, 1, 2], lambda k: pytest.fail(f"recomputed {k}")) == [100, 101, 102]
    a.close()


class BuggyStore(DictStore):
    """A Store subclass with a bug in mset."""

    def mset(self, dictionary):
        raise RuntimeError("bug in mset")


def test_a_store_bug_writing_a_collected_loaders_values_is_logged_counted_and_not_raised(caplog):
    _settle()
    other = CacheLoader(DictStore(), "other", flush_interval=None)
    loader = CacheLoader(BuggyStore(), "bug", writer_buffer_size=10, flush_interval=None)
    loader.get(0, lambda k: 1)
    loader.get(1, lambda k: 2)
    counters = loader._counters
    with caplog.at_level(logging.ERROR, logger="trainloom.data"):
        del loader
        gc.collect()
        assert other.get(5, lambda k: 6) == 6  # not raised into the unrelated caller
    [rec] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rec.getMessage() == (
        "CacheLoader('bug'): could not write 2 buffered value(s) left by a CacheLoader garbage-collected "
        "without close() (not cached; computed again when next read): the store raised an unexpected error"
    )
    assert rec.exc_info is not None and rec.exc_info[0] is RuntimeError  # logged with its traceback
    s, _ = counters.total()
    assert (s["dropped"], s["errors"], s["writes"], s["buffered"], s["buffered_bytes"]) == (2, 1, 0, 0, 0)
    other.close()


# -- 2: a value too large for LMDB's max_map_size ---------------------------------------------------


def test_lmdb_batch_at_the_cap_writes_the_values_that_fit(tmp_path):
    s = LmdbStore(tmp_path, namespace="cap", map_size=1 << 20, max_map_size=4 << 20)
    small = {f"s{i}": bytes([i]) * 200_000 for i in range(3)}
    with pytest.raises(StoreValueRefusedError) as info:
        s.mset({**small, "big": b"x" * (8 << 20)})
    room = s._room(s._handles())  # (what it was when "big" failed: nothing was written since)
    assert str(info.value) == (
        f"LmdbStore.mset on {tmp_path} (namespace 'cap'): the value of key 'big' ({8 << 20} bytes) does not "
        f"fit in the {room} bytes left at max_map_size={4 << 20} bytes, so it is not stored; the other "
        "values of the batch were written. Pass a larger max_map_size= to store values this large"
    )
    assert info.value.key == "big" and 3 << 20 < room < 4 << 20
    assert (info.value.keys, info.value.others_written) == ((b"big",), True)
    assert s.mget(["s0", "s1", "s2", "big"]) == [*small.values(), None]
    s.close()


def test_a_value_too_large_for_the_cap_is_dropped_alone_and_later_values_are_cached(tmp_path):
    loader = CacheLoader(path=tmp_path, dataset_name="g", map_size=1 << 20, max_map_size=8 << 20)
    for i in range(2):
        loader.get(i, lambda k: np.full(1 << 20, k, np.uint8))
    with pytest.raises(StoreError) as info:
        loader.get(99, lambda k: np.zeros(16 << 20, np.uint8))
    room = loader.store._room(loader.store._handles())
    size = len(loader._encode(np.zeros(16 << 20, np.uint8), "x"))
    assert str(info.value) == (
        "CacheLoader('g'): the lmdb store refused 1 value(s), dropped (not cached; recomputed when next "
        f"read): key b'g_99': LmdbStore.mset on {tmp_path} (namespace 'g'): the value of key 'g_99' "
        f"({size} bytes) does not fit in the {room} bytes left at max_map_size={8 << 20} bytes, so it is "
        "not stored. Pass a larger max_map_size= to store values this large. The other 0 buffered "
        "value(s) were written."
    )
    # The store is not full: later values are cached (each get used to raise StoreFullError again).
    assert [loader.get(i, lambda k: k) for i in range(100, 103)] == [100, 101, 102]
    s = loader.stats()
    assert (s["buffered"], s["dropped"], s["writes"]) == (0, 1, 5)
    assert loader.num_keys() == 5
    loader.close()


def test_bypass_drops_the_large_value_and_caches_the_rest_of_its_batch(tmp_path):
    loader = CacheLoader(
        path=tmp_path,
        dataset_name="gb",
        writer_buffer_size=4,
        on_error="bypass",
        map_size=1 << 20,
        max_map_size=8 << 20,
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(4):  # the 4th value fills the buffer: one batch with the large value in it
            loader.get(i, lambda k: np.zeros(16 << 20 if k == 1 else 1000, np.uint8))
        for i in range(4, 8):
            loader.get(i, lambda k: k)
    refused = [str(r.message) for r in rec if "refused" in str(r.message)]
    size = len(loader._encode(np.zeros(16 << 20, np.uint8), "x"))
    assert len(refused) == 1 and f"key 'gb_1' ({size} bytes) does not fit" in refused[0]
    assert refused[0].endswith(
        "The other 3 buffered value(s) were written. on_error='bypass': further refusals are only counted."
    )
    assert loader.contains_many(range(8)) == [True, False] + [True] * 6
    assert loader.stats()["dropped"] == 1
    loader.close()


def _one_too_large(k):
    """Three values that fit at an 8 MiB cap together, then one that never does."""
    return np.zeros(16 << 20 if k == 3 else (2 << 20) - 4096, np.uint8)


def _count_msets(monkeypatch) -> list:
    calls: list = []
    real = LmdbStore.mset

    def mset(self, dictionary):
        calls.append(sorted(dictionary))
        return real(self, dictionary)

    monkeypatch.setattr(LmdbStore, "mset", mset)
    return calls


@pytest.mark.parametrize("on_error", ["raise", "bypass"])
def test_values_lmdb_stored_before_refusing_one_count_as_written_and_are_not_rewritten(
    tmp_path, monkeypatch, on_error
):
    calls = _count_msets(monkeypatch)
    loader = CacheLoader(
        path=tmp_path,
        dataset_name="g",
        writer_buffer_size=4,
        on_error=on_error,
        map_size=1 << 20,
        max_map_size=8 << 20,
        flush_interval=None,
    )
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(3):
            loader.get(i, _one_too_large)
        if on_error == "raise":
            with pytest.raises(StoreError) as info:
                loader.get(3, _one_too_large)  # fills the buffer: one batch of 4
            message = str(info.value)
            assert info.value.key == "g_3"
        else:
            loader.get(3, _one_too_large)
            [message] = [str(r.message) for r in rec if "refused" in str(r.message)]
    assert calls == [[b"g_0", b"g_1", b"g_2", b"g_3"]]  # one batch; nothing written twice
    assert message.startswith(
        "CacheLoader('g'): the lmdb store refused 1 value(s), dropped (not cached; recomputed when next "
        "read): key b'g_3': LmdbStore.mset on "
    )
    assert "The other 3 buffered value(s) were written." in message
    s = loader.stats()
    assert (s["writes"], s["dropped"], s["buffered"], s["flushes"]) == (3, 1, 0, 1)
    assert loader.contains_many(range(4)) == [True, True, True, False]
    loader.close()


def test_a_collected_loaders_batch_at_the_lmdb_cap_loses_only_the_refused_value(
    tmp_path, monkeypatch, caplog
):
    _settle()
    calls = _count_msets(monkeypatch)
    loader = CacheLoader(
        path=tmp_path,
        dataset_name="o",
        writer_buffer_size=10,
        map_size=1 << 20,
        max_map_size=8 << 20,
        flush_interval=None,
    )
    for i in range(4):
        loader.get(i, _one_too_large)
    counters = loader._counters
    del loader
    gc.collect()
    with caplog.at_level(logging.ERROR, logger="trainloom.data"):
        with CacheLoader(path=tmp_path, dataset_name="p") as other:  # a loader call: writes the orphan
            other.contains_many([0])
    assert calls == [[b"o_0", b"o_1", b"o_2", b"o_3"]]
    [rec] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert rec.getMessage().startswith(
        "CacheLoader('o'): could not write 1 of 4 buffered value(s) left by a CacheLoader garbage-collected "
        "without close() (not cached; computed again when next read): key b'o_3': "
    )
    s, _ = counters.total()
    assert (s["writes"], s["dropped"], s["buffered"]) == (3, 1, 0)


# -- 3: bypass in contains_many() and warmup() ------------------------------------------------------


def test_contains_many_is_bypassed_like_get(tmp_path):
    loader = CacheLoader(DownStore(), "sq", writer_buffer_size=10, on_error="bypass", retry_interval=60)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert loader.contains_many([1, 2, 3]) == [False, False, False]
        assert loader.get(2, lambda k: k * k) == 4  # a miss, computed and buffered
        assert loader.contains_many([1, 2]) == [False, True]  # store skipped until the retry
    assert [str(r.message) for r in rec] == [
        "CacheLoader('sq'): the store store failed during a read (server down); on_error='bypass': "
        "serving misses and retrying every 60s. See stats() for the error, bypass and drop counts."
    ]
    s = loader.stats()
    assert (s["errors"], s["bypassed"]) == (1, 3 + 1 + 2)
    loader.close()
    with pytest.raises(StoreUnavailableError, match="server down"):  # on_error="raise" still raises
        CacheLoader(DownStore(), "sq2").contains_many([1])


def test_warmup_with_a_failing_store_in_bypass_mode(tmp_path):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ds = CachedDataset(
            Squares(), backend=DownStore(), dataset_name="sq", on_error="bypass", retry_interval=0
        )
        assert ds.warmup(progress=False) == 8
    assert len([r for r in rec if "on_error='bypass'" in str(r.message)]) == 1
    assert ds.stats()["errors"] >= 2  # the fingerprint check, contains_many, the writes
    ds.close()


# -- 4: numpy numbers as arguments ------------------------------------------------------------------


def test_numpy_numbers_are_accepted(tmp_path):
    loader = CacheLoader(
        path=tmp_path,
        dataset_name="n",
        writer_buffer_size=np.int64(20),
        max_buffer_bytes=np.uint32(1 << 20),
        flush_interval=np.float32(0.5),
        map_size=np.int64(1 << 24),
    )
    assert (loader.writer_buffer_size, loader.max_buffer_bytes, loader.flush_interval) == (20, 1 << 20, 0.5)
    assert type(loader.writer_buffer_size) is int and type(loader.max_buffer_bytes) is int
    assert loader.store.map_size == 1 << 24 and type(loader.store.map_size) is int
    assert loader.get(1, lambda k: 2) == 2
    loader.close()


@pytest.mark.parametrize(
    "kw,message",
    [
        (
            {"writer_buffer_size": np.int64(-1)},
            "writer_buffer_size must be an int >= 0 (0 writes every value at once, as 1 does), "
            "got np.int64(-1)",
        ),
        (
            {"writer_buffer_size": np.bool_(True)},
            "writer_buffer_size must be an int >= 0 (0 writes every value at once, as 1 does), got np.True_",
        ),
        (
            {"max_buffer_bytes": np.float64(64.0)},
            "max_buffer_bytes must be an int >= 0, got np.float64(64.0)",
        ),
        ({"max_buffer_bytes": np.int8(-3)}, "max_buffer_bytes must be an int >= 0, got np.int8(-3)"),
        (
            {"flush_interval": np.float32("nan")},
            "flush_interval must be None or a finite number of seconds >= 0, got np.float32(nan)",
        ),
        (
            {"flush_interval": np.float64(-0.5)},
            "flush_interval must be None or a finite number of seconds >= 0, got np.float64(-0.5)",
        ),
        ({"map_size": np.int64(0)}, "LmdbStore: map_size must be a positive int, got np.int64(0)"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_numpy_numbers_name_the_value(tmp_path, kw, message):
    with pytest.raises(ValueError) as info:
        CacheLoader(path=tmp_path, dataset_name="n", **kw)
    assert str(info.value) == message


# -- 5: deeply nested Parameters and tensors with attributes ------------------------------------------


def _nest(x, depth: int):
    for _ in range(depth):
        x = [x]
    return x


def _unnest(x, depth: int):
    for _ in range(depth):
        x = x[0]
    return x


@pytest.mark.parametrize("depth", [60, 199])
def test_deeply_nested_parameters_come_back_as_parameters(tmp_path, depth):
    def make(k):
        t = torch.ones(2)
        t.src = "img.jpg"
        return {"p": _nest(torch.nn.Parameter(torch.ones(2)), depth), "t": _nest(t, depth)}

    loader = CacheLoader(path=tmp_path, dataset_name="p")
    loader.get(0, make)
    hit = loader.get(0, lambda k: pytest.fail("recomputed"))
    assert loader.stats()["hits"] == 1
    p, t = _unnest(hit["p"], depth), _unnest(hit["t"], depth)
    assert type(p) is torch.nn.Parameter and p.requires_grad and torch.equal(p, torch.ones(2))
    assert type(t) is torch.Tensor and t.src == "img.jpg"
    loader.close()


# -- 6: a Store instance holds one dataset ----------------------------------------------------------


def _shared(desc: str, ns_where: str, other: str, fix: str) -> str:
    return (
        f"{desc} would share {ns_where} with {other}, created earlier in this process and still open. A "
        "Store instance holds one dataset: a CacheLoader over it owns the store's whole namespace "
        "(dataset_name= only prefixes the keys; clear(), num_keys() and the fingerprint entry act on the "
        "whole namespace), so the two would count, drop and clear each other's entries. Give each dataset "
        f"its own store namespace, {fix}, or close() the other one first if it is no longer used."
    )


class Offset:
    def __init__(self, n: int, off: int) -> None:
        self.n, self.off = n, off

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i + self.off


def test_two_datasets_over_one_store_instance_are_refused_with_the_fix(tmp_path):
    store = LmdbStore(tmp_path, namespace="shared")
    train = CachedDataset(Offset(10, 0), backend=store, dataset_name="train")
    assert [train[i] for i in range(10)][3] == 3
    with pytest.raises(ConfigError) as info:
        CachedDataset(Offset(5, 100), backend=store, dataset_name="val")
    assert str(info.value) == _shared(
        "CachedDataset(Offset of length 5, dataset_name='val') with fingerprint ('len', 5, None)",
        f"the namespace 'shared' of the LMDB cache at {str(tmp_path)!r}",
        "CachedDataset(Offset of length 10, dataset_name='train') with fingerprint ('len', 10, None)",
        "e.g. LmdbStore(path, namespace='val')",
    )
    assert train.cache_loader.num_keys() == 10 and train[3] == 3  # train untouched
    # The fix the message gives: a namespace of its own; both are then cached side by side.
    val = CachedDataset(Offset(5, 100), backend=LmdbStore(tmp_path, namespace="val"), dataset_name="val")
    assert [val[i] for i in range(5)] == [100, 101, 102, 103, 104]
    assert (train.cache_loader.num_keys(), val.cache_loader.num_keys()) == (10, 5)
    train.close()
    val.close()


def test_second_dataset_name_over_one_store_instance_without_fingerprints(tmp_path):
    store = LmdbStore(tmp_path, namespace="shared")
    a = CacheLoader(store, "a")
    a.get(1, lambda k: k)
    with pytest.raises(ConfigError) as info:
        CacheLoader(store, "b")  # clear() of either would delete the other's entries
    assert str(info.value) == _shared(
        "CacheLoader('b')",
        f"the namespace 'shared' of the LMDB cache at {str(tmp_path)!r}",
        "CacheLoader('a')",
        "e.g. LmdbStore(path, namespace='b')",
    )
    # Also a loader made from path= whose namespace is that store's.
    with pytest.raises(ConfigError) as info:
        CacheLoader(path=tmp_path, dataset_name="shared")
    assert str(info.value) == _shared(
        "CacheLoader('shared')",
        f"the namespace 'shared' of the LMDB cache at {str(tmp_path)!r}",
        "CacheLoader('a')",
        "e.g. LmdbStore(path, namespace='shared')",
    )
    bagua = DictStore()
    first = CacheLoader(bagua, "train")
    with pytest.raises(ConfigError) as info:
        CacheLoader(bagua, "val")
    assert str(info.value) == _shared(
        "CacheLoader('val')", repr(bagua), "CacheLoader('train')", "e.g. a store of its own"
    )
    # Same dataset_name over the same store: one dataset, allowed; and after close() another one.
    CacheLoader(store, "a").close()
    a.close()
    first.close()
    with CacheLoader(store, "b") as b:
        assert b.get(1, lambda k: -1) == -1
    # Loaders made from path= (one namespace per dataset_name) never conflict.
    with CacheLoader(path=tmp_path, dataset_name="x") as x, CacheLoader(path=tmp_path, dataset_name="y") as y:
        assert x.get(1, lambda k: 1) == 1 and y.get(1, lambda k: 2) == 2


def test_clear_and_num_keys_document_the_store_instance_namespace():
    for doc in (CacheLoader.clear.__doc__, CacheLoader.num_keys.__doc__, CacheLoader.__doc__):
        assert "Store instance" in doc and "whole namespace" in " ".join(doc.split())


# -- a key repeated within one batch ----------------------------------------------------------------


class CountingDataset:
    """Records every index it computes."""

    def __init__(self) -> None:
        self.calls: list = []

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        self.calls.append(i)
        return torch.tensor([i, 3 * i])


class BatchedCountingDataset(CountingDataset):
    """With torch's batched fetch, recorded per batch."""

    def __getitems__(self, idx: list) -> list:
        self.calls.append(tuple(idx))
        return [torch.tensor([i, 3 * i]) for i in idx]


@pytest.mark.parametrize("batched", [False, True])
def test_an_index_repeated_in_a_batch_is_computed_once(tmp_path, batched):
    """A sampler drawing with replacement repeats indices within a batch: each used to be computed,
    counted as a miss and written once per position."""
    inner = BatchedCountingDataset() if batched else CountingDataset()
    ds = CachedDataset(inner, path=tmp_path, dataset_name="rep")
    out = ds.__getitems__([1, 1, 2, 1, 2, 3])
    assert [x.tolist() for x in out] == [[1, 3], [1, 3], [2, 6], [1, 3], [2, 6], [3, 9]]
    assert inner.calls == ([(1, 2, 3)] if batched else [1, 2, 3])
    stats = ds.stats()
    assert (stats["misses"], stats["hits"], stats["buffered"]) == (3, 0, 3)
    out = ds.__getitems__([1, 1, 4])
    assert [x.tolist() for x in out] == [[1, 3], [1, 3], [4, 12]]
    assert (ds.stats()["misses"], ds.stats()["hits"]) == (4, 2)
    ds.close()


# -- persistent DataLoader workers at the end of a script --------------------------------------------

_PERSISTENT_RUN = """
import sys, torch
from torch.utils.data import DataLoader
from trainloom.data import CachedDataset

class D(torch.utils.data.Dataset):
    def __len__(self): return 50
    def __getitem__(self, i): return i

if __name__ == "__main__":
    ds = CachedDataset(D(), path=sys.argv[1], dataset_name="p", fingerprint=1)
    dl = DataLoader(
        ds, batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context=sys.argv[2]
    )
    for b in dl:
        pass
    ds.close()
    print(ds.stats()["buffered"])
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_persistent_workers_write_what_they_hold_when_the_script_ends(tmp_path, method):
    """With persistent workers the DataLoader iterator is alive at exit, so torch skips its worker
    shutdown and multiprocessing terminates the workers (SIGTERM): what they computed in the last
    flush_interval was lost (40 of 50 stored). The main process now gives their flush threads time."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_PERSISTENT_RUN)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cache"), method],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 0  # the workers still held values when the loop ended
    with LmdbStore(tmp_path / "cache", namespace="p") as store:
        assert cache.cached_values(store) == 50
