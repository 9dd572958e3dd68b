"""Batched decoding (the path of CachedDataset.__getitems__ and every store's mget): the same results
as decode() one value at a time, on any number of threads, and damaged or malformed values still
raise. Large values (64 KiB or more) in batches of at least 1 MiB are checksummed and copied by
worker threads, so these tests use 3x160x160 uint8 images (76.8 KB) in batches of 20 (1.5 MB)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainloom.data import _codec
from trainloom.data.cache import CachedDataset
from trainloom.data.codec import decode, encode, get_decode_threads, set_decode_threads


def image(i: int):
    g = torch.Generator().manual_seed(i)
    return (torch.randint(0, 256, (3, 160, 160), generator=g, dtype=torch.uint8), i, f"img{i}")


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.fixture
def threads():
    """Restore the process-wide setting after each test."""
    old = get_decode_threads()
    yield set_decode_threads
    set_decode_threads(old)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_batch_equals_one_by_one_on_any_number_of_threads(threads, n_threads):
    # Large images, small samples and missing values interleaved, as a cache batch has them.
    samples = []
    for i in range(24):
        samples.append(image(i) if i % 3 else (np.arange(i, i + 5, dtype=np.float32), {"k": i}))
    values = [encode(s) for s in samples]
    values[5] = None
    threads(n_threads)
    started = _codec.threads_started()
    out, nbytes = _codec.decode_list(values)
    assert nbytes == sum(len(v) for v in values if v is not None)
    assert out[5] is None
    for i, (v, o) in enumerate(zip(values, out)):
        if v is not None:
            assert same(decode(v), o), i
    # Worker threads ran exactly when more than one thread was allowed.
    assert (_codec.threads_started() > started) == (n_threads > 1)
    # The same through a getter (LMDB's txn.get), and the tensors own their memory.
    table = {f"k{i}".encode(): v for i, v in enumerate(values) if v is not None}
    out2, nbytes2 = _codec.decode_many_get(table.get, [f"k{i}".encode() for i in range(24)])
    assert nbytes2 == nbytes and out2[5] is None
    assert all(same(a, b) for a, b in zip(out, out2))
    out2[1][0].add_(1)  # writable, and not shared with out
    assert same(out[1], decode(values[1]))


def test_missing_marker_tells_absent_keys_from_stored_none():
    miss = object()
    values = [encode(None), None, encode(image(1)), encode([None])]
    out, nbytes = _codec.decode_list(values, miss)
    assert out[0] is None and out[1] is miss and same(out[2], image(1)) and out[3] == [None]
    table = {b"a": values[0], b"c": values[2]}
    out2, _ = _codec.decode_many_get(table.get, [b"a", b"b", b"c"], miss)
    assert out2[0] is None and out2[1] is miss and same(out2[2], image(1))
    assert _codec.decode_list([None, encode(None)])[0] == [None, None]  # default marker: None
    assert _codec.missing_positions([None, miss, 3, miss], miss, None) == [0, 1, 3]
    corrupt = object()
    assert _codec.missing_positions([None, miss, corrupt, 0], miss, corrupt) == [1, 2]


def test_small_batches_stay_on_the_calling_thread(threads):
    threads(2)
    started = _codec.threads_started()
    # 10 large values of 76.8 KB: below the 1 MiB that pays for starting a thread.
    out, _ = _codec.decode_list([encode(image(i)) for i in range(10)])
    assert same(out[9], image(9))
    assert _codec.threads_started() == started


def test_damaged_value_in_a_threaded_batch_raises(threads):
    threads(2)
    values = [encode(image(i)) for i in range(20)]
    bad = bytearray(values[13])
    bad[-1000] ^= 0x01  # one bit of image 13's pixels
    values[13] = bytes(bad)
    with pytest.raises(_codec.ChecksumError, match=r"damaged value: checksum 0x[0-9a-f]{16} != stored"):
        _codec.decode_list(values)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_batches_of_more_than_64_values(threads, n_threads):
    # Batches over 64 values keep their per-value bookkeeping on the heap instead of the stack: the
    # same results, and a damaged value still raises.
    samples = [image(i) if i % 10 == 0 else (np.arange(i, i + 8, dtype=np.int64), i) for i in range(150)]
    values = [encode(s) for s in samples]
    values[77] = None
    threads(n_threads)
    out, nbytes = _codec.decode_list(values)
    assert nbytes == sum(len(v) for v in values if v is not None)
    assert out[77] is None and all(same(o, s) for i, (o, s) in enumerate(zip(out, samples)) if i != 77)
    damaged = bytearray(values[121])
    damaged[-3] ^= 0x01  # one bit of the int64 array of sample 121
    values[121] = bytes(damaged)
    with pytest.raises(_codec.ChecksumError, match="damaged value"):
        _codec.decode_list(values)


def test_int_keys_are_the_decimal_indices_after_the_prefix():
    idx = [0, 1, 9, 10, 99, 100, 12345, 2**31, 2**63 - 1]
    assert _codec.int_keys(b"ds_", idx, -1) == [b"ds_%d" % i for i in idx]
    assert _codec.int_keys(b"", (7, 70), 71) == [b"7", b"70"]
    assert _codec.int_keys(b"ds_", [], 5) == []
    # Anything unusual is left to the caller's checked path (None).
    assert _codec.int_keys(b"ds_", [0, 71], 71) is None
    assert _codec.int_keys(b"ds_", [-1], -1) is None
    assert _codec.int_keys(b"ds_", [2**63], -1) is None
    assert _codec.int_keys(b"ds_", [True], -1) is None
    assert _codec.int_keys(b"ds_", [np.int64(3)], -1) is None


def test_malformed_value_while_workers_run_stops_them_cleanly(threads):
    threads(2)
    started = _codec.threads_started()
    values = [encode(image(i)) for i in range(20)] + [b"not an encoded value, just bytes"]
    with pytest.raises(_codec.CodecError, match="bad magic"):
        _codec.decode_list(values)
    assert _codec.threads_started() > started  # the workers had been started, and were joined
    out, _ = _codec.decode_list(values[:20])  # the process is fine afterwards
    assert same(out[19], image(19))


def test_decode_threads_setting(threads):
    assert threads(4) == 0  # the default follows torch.get_num_threads()
    assert get_decode_threads() == 4
    with pytest.raises(
        ValueError, match=r"decode threads must be >= 0 \(0 follows torch.get_num_threads\(\)\), got -1"
    ):
        set_decode_threads(-1)
    assert get_decode_threads() == 4


class Images(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return image(i)


class ProbedCache(CachedDataset):
    """Returns, with each sample, how many decode threads its process had started by then."""

    def __getitems__(self, indices):
        out = super().__getitems__(indices)
        return [(s, _codec.threads_started()) for s in out]


def _two_decode_threads(worker_id: int) -> None:
    # torch sets 1 thread in DataLoader workers; force 2 so the threaded path runs after fork().
    set_decode_threads(2)


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_threaded_decoding_in_dataloader_workers(tmp_path, threads, ctx):
    # The parent decodes threaded batches first, then workers are forked (or spawned) and decode
    # threaded batches of their own: per-batch threads leave no state a forked child could trip on.
    threads(2)
    ds = ProbedCache(Images(), path=tmp_path / "c", dataset_name="img")
    ds.warmup(progress=False, batch_size=20)
    started = _codec.threads_started()
    first = [s for s, _ in ds.__getitems__(list(range(20)))]
    assert _codec.threads_started() > started
    loader = DataLoader(
        ds,
        batch_size=20,
        num_workers=2,
        multiprocessing_context=ctx,
        worker_init_fn=_two_decode_threads,
        collate_fn=list,
    )
    got = [s for batch in loader for s in batch]
    assert len(got) == 40 and all(same(got[i][0], image(i)) for i in range(40))
    # Every worker decoded on threads of its own (a forked worker inherits the parent's count).
    inherited = _codec.threads_started() if ctx == "fork" else 0
    assert all(n > inherited for _, n in got)
    assert same(first[7], image(7))
    ds.close()


def test_damaged_large_value_is_recomputed_by_the_cache(tmp_path, threads):
    threads(2)
    ds = CachedDataset(Images(), path=tmp_path / "c", dataset_name="img")
    ds.warmup(progress=False, batch_size=20)
    store, k11 = ds.cache_loader.store, ds.cache_loader.key(11)
    good = store.get(k11)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x40
    store.mset({k11: bytes(bad)})
    out = ds.__getitems__(list(range(20)))
    assert all(same(out[i], image(i)) for i in range(20))
    assert ds.stats()["corrupt"] == 1
    ds.cache_loader.flush()
    assert store.get(k11) == good  # rewritten
    ds.close()
