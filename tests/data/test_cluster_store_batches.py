"""A ClusterStore batch that one shard fails to write, on real LMDB shards.

ClusterStore.mset used to stop at the first shard that raised and pass its error on unchanged, so
that the error spoke for that shard only while the cache reads it as a fact about the whole batch:
- a shard refusing one value (StoreValueRefusedError, others_written=True) before the other shard
  was written: the cache counted every other value as written, but none of the other shard's was
  stored, so they were computed again at their next read;
- a shard filling up part-way (StoreFullError naming the keys it wrote) after the other shard took
  its whole part: the cache kept that shard's stored values buffered and wrote them again at every
  later flush (with on_error="bypass", counted them as dropped).
Now every shard is written, and the error describes the batch (ClusterStore._batch_error).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from trainloom.data import CacheLoader
from trainloom.data.stores import ClusterStore, LmdbStore, StoreFullError, StoreValueRefusedError, shard_of
from trainloom.errors import ConfigError, StoreError

MB = 1 << 20


def _shards(tmp_path: Path, caps: List[int], namespace: str = "ds") -> List[LmdbStore]:
    return [
        LmdbStore(tmp_path / f"s{i}", namespace=namespace, map_size=MB, max_map_size=cap)
        for i, cap in enumerate(caps)
    ]


def _on(shard: int, names: List[str]) -> List[str]:
    return [k for k in names if shard_of(k, 2) == shard]


def _count_msets(monkeypatch: pytest.MonkeyPatch) -> List[tuple]:
    """(shard directory name, number of values) of every LmdbStore.mset call."""
    calls: List[tuple] = []
    real = LmdbStore.mset

    def mset(self: LmdbStore, dictionary: Dict) -> None:
        calls.append((Path(self.path).name, len(dictionary)))
        real(self, dictionary)

    monkeypatch.setattr(LmdbStore, "mset", mset)
    return calls


def test_a_shard_refusing_a_value_still_lets_the_other_shard_write_and_names_the_batch(tmp_path):
    cluster = ClusterStore(_shards(tmp_path, [4 * MB, 4 * MB]))
    names = [f"k{i}" for i in range(40)]
    big = _on(0, names)[0]
    batch = {k: k.encode() * 10 for k in names} | {big: b"H" * (6 * MB)}  # more than shard 0's map
    # dict order decides which shard is written first: put the refusing shard first
    batch = {big: batch.pop(big), **batch}
    with pytest.raises(StoreValueRefusedError) as info:
        cluster.mset(batch)
    err = info.value
    assert err.keys == (big.encode(),) and err.others_written
    assert str(err).endswith(
        "so it is not stored; the other values of the batch were written. Pass a larger max_map_size= to "
        "store values this large (ClusterStore shard 0 of 2; 39 of the batch's 40 value(s) written)"
    )
    assert isinstance(err.__cause__, StoreValueRefusedError)
    got = cluster.mget(names)
    assert [v is not None for v in got] == [k != big for k in names]
    assert all(v == k.encode() * 10 for k, v in zip(names, got) if k != big)


@pytest.mark.parametrize("on_error", ["raise", "bypass"])
def test_the_cache_counts_only_what_a_cluster_stored_when_a_shard_refuses_a_value(
    tmp_path, monkeypatch, on_error
):
    cluster = ClusterStore(_shards(tmp_path, [4 * MB, 4 * MB]))
    loader = CacheLoader(cluster, "ds", writer_buffer_size=1000, flush_interval=None, on_error=on_error)
    items = list(range(60))
    keys = {i: loader.key(i) for i in items}
    big = next(i for i in items if shard_of(keys[i], 2) == 0)
    others = [i for i in items if shard_of(keys[i], 2) == 1][:20]
    values = {big: np.full(6 * MB, 1, np.uint8)} | {i: np.full(100, i, np.uint8) for i in others}
    computed: List[int] = []

    def compute(i: int) -> np.ndarray:
        computed.append(i)
        return values[i]

    for i in [big, *others]:  # buffered in this order: the refusing shard's part is written first
        loader.get(i, compute)
    calls = _count_msets(monkeypatch)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        if on_error == "raise":
            with pytest.raises(StoreError, match=r"refused 1 value\(s\), dropped .* The other 20 buffered"):
                loader.flush()
        else:
            loader.flush()
    assert calls == [("s0", 1), ("s1", 20)]  # one batch, each shard once, nothing written twice
    s = loader.stats()
    assert (s["writes"], s["dropped"], s["buffered"]) == (20, 1, 0)
    assert [v is not None for v in cluster.mget([keys[i] for i in others])] == [True] * 20
    del computed[:]
    for i in others:
        np.testing.assert_array_equal(loader.get(i, compute), values[i])
    assert computed == []  # read back, not computed again
    loader.close()


@pytest.mark.parametrize("on_error", ["raise", "bypass"])
def test_a_shard_filling_up_part_way_counts_the_other_shards_values_as_written(
    tmp_path, monkeypatch, on_error
):
    loader0 = CacheLoader(ClusterStore(_shards(tmp_path / "probe", [MB])), "ds", flush_interval=None)
    items = list(range(400))
    keys = {i: loader0.key(i) for i in items}
    loader0.close()
    # shard 1 has a 2 MiB cap, so it fills up part-way; shard 0 has room for its whole part
    cluster = ClusterStore(_shards(tmp_path, [64 * MB, 2 * MB]))
    loader = CacheLoader(cluster, "ds", writer_buffer_size=10_000, flush_interval=None, on_error=on_error)
    first = [i for i in items if shard_of(keys[i], 2) == 0]
    second = [i for i in items if shard_of(keys[i], 2) == 1]
    for i in first + second:  # shard 0's part is written first
        loader.get(i, lambda i: np.full(20_000, i % 251, np.uint8))
    calls = _count_msets(monkeypatch)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        if on_error == "raise":
            with pytest.raises(StoreFullError) as info:
                loader.flush()
            message = str(info.value)
        else:
            loader.flush()
            [message] = [str(r.message) for r in rec if "full at max_map_size" in str(r.message)]
    stored = [i for i, v in zip(second, cluster.mget([keys[i] for i in second])) if v is not None]
    n = len(first) + len(stored)
    assert 0 < len(stored) < len(second)
    assert f"(ClusterStore shard 1 of 2; {n} of the batch's 400 value(s) written)" in message
    assert calls == [("s0", len(first)), ("s1", len(second))]
    assert all(v is not None for v in cluster.mget([keys[i] for i in first]))
    s = loader.stats()
    if on_error == "raise":
        assert set(info.value.written) == {keys[i] for i in first + stored}
        assert set(info.value.not_written) == {keys[i] for i in second if i not in stored}
        assert (s["writes"], s["dropped"], s["buffered"]) == (n, 0, 400 - n)
        del calls[:]
        with pytest.raises(StoreFullError):
            loader.flush()  # only the values not written are sent again, all to the full shard
        assert calls == [("s1", 400 - n)]
    else:
        assert (s["writes"], s["dropped"], s["buffered"]) == (n, 400 - n, 0)
    with pytest.raises(StoreFullError) if on_error == "raise" else warnings.catch_warnings():
        loader.close()


def test_a_failure_that_says_nothing_of_what_was_written_is_raised_as_the_shard_raised_it(tmp_path):
    # An over-long key: LmdbStore checks the keys before writing, so its shard writes none of its part
    # and says so by raising ConfigError; the other shard is still written.
    cluster = ClusterStore(_shards(tmp_path, [8 * MB, 8 * MB]))
    names = [f"k{i}" for i in range(12)]
    long_key = next(k for k in (f"{'L' * 600}{i}" for i in range(100)) if shard_of(k, 2) == 1)
    batch = {long_key: b"z", **{k: b"x" for k in names}}
    with pytest.raises(ConfigError, match=r"is 601 bytes; LMDB keys are limited to 511 bytes"):
        cluster.mset(batch)
    assert cluster.mget(names) == [b"x" if shard_of(k, 2) == 0 else None for k in names]
