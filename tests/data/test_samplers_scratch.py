"""Planning scratch kept between plans, and the compiled helpers that avoid fresh memory."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trainloom.data import samplers as S
from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from trainloom.errors import ConfigError

P = S._P
HUGE = 2 * 1024 * 1024


def _lens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 3000, n)


def _plan_ranks(lens, world, mode):
    out = []
    for r in range(world):
        s = LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=world, rank=r)
        out.append(list(LoadBalancingDistributedBatchSampler(s, max_complexity=6000, mode=mode)))
    return out


def test_scratch_is_kept_huge_page_sized_and_released():
    keys = _lens(100_000).astype(np.float64)
    P.release_scratch()
    assert P.scratch_bytes() == 0
    order = P.sort_desc(keys)
    kept = P.scratch_bytes()
    assert kept >= (4 * keys.shape[0] + 2048) * 8 and kept % HUGE == 0  # 2 MiB-aligned block
    again = P.sort_desc(keys)
    assert P.scratch_bytes() == kept  # reused, not grown
    assert np.array_equal(order, again)
    P.release_scratch()
    assert P.scratch_bytes() == 0


def test_small_scratch_uses_plain_malloc_and_grows():
    P.release_scratch()
    keys = np.array([3.0, 1.0, 2.0])
    P.argsort(keys, np.arange(3, dtype=np.int64))
    small = P.scratch_bytes()
    assert 0 < small < HUGE
    P.argsort(_lens(80_000).astype(np.float64), np.arange(80_000, dtype=np.int64))
    assert P.scratch_bytes() > small


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_plans_equal_with_busy_scratch_and_after_release(mode):
    lens = _lens(5000, 3)
    ref = _plan_ranks(lens, 3, mode)
    P._hold_scratch(True)  # as if another thread were planning: every kernel mallocs its own
    try:
        busy = _plan_ranks(lens, 3, mode)
        with pytest.raises(RuntimeError, match="a plan in another thread is using the scratch buffer"):
            P.release_scratch()
    finally:
        P._hold_scratch(False)
    P.release_scratch()
    assert busy == ref
    assert _plan_ranks(lens, 3, mode) == ref


def test_threads_planning_at_once_agree():
    lens = _lens(60_000, 5)
    ref = _plan_ranks(lens, 2, "padded")
    got = {}

    def work(i: int) -> None:
        got[i] = _plan_ranks(lens, 2, "padded")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[i] == ref for i in range(3))


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.float64])
def test_integer_complexities_are_sorted_at_construction_and_not_kept(dtype):
    lens = _lens(1000, 7)
    src = lens.astype(dtype)
    s = LoadBalancingDistributedSampler(None, complexities=src, num_replicas=2, rank=0)
    kept = s._complexities is not None
    assert kept == (dtype not in (np.int64, np.int32))  # int32 / int64: no copy at all
    order = s._desc_order()
    assert np.array_equal(order, np.argsort(-lens, kind="stable"))
    keys, ends = s._desc_runs()
    ref_keys, ref_ends = P.key_runs(lens.astype(np.float64), order.astype(np.int64))
    assert np.array_equal(keys, ref_keys) and np.array_equal(ends, ref_ends)
    first = [s.rank_indices(r) for r in range(2)]
    digest = s.digest()
    src[:] = 0  # the caller's array is not read after construction
    s._cache = None
    assert all(np.array_equal(a, s.rank_indices(r)) for r, a in enumerate(first))
    # The complexities are rebuilt from the order and its runs: float64, read-only, our own.
    c = s.complexities
    assert c.dtype == np.float64 and not c.flags.writeable and not np.shares_memory(c, src)
    assert np.array_equal(c, lens.astype(np.float64))
    assert digest == LoadBalancingDistributedSampler(None, complexities=lens.astype(np.float64)).digest()


def test_integer_complexities_outside_the_counting_range_sort_as_their_doubles():
    # Negative and huge int64 values take the radix sort, on the doubles a float64 copy holds
    # (2**60 + 1 rounds to 2**60: a tie, as it was when the sampler copied to float64).
    src = np.array([-3, 2**60 + 1, 5, -3, 2**60, 7, 0], dtype=np.int64)
    as_f64 = src.astype(np.float64)
    for keys in (src, src[[0, 2, 3, 5, 6]].astype(np.int32)):
        order, run_keys, run_ends = P.sort_desc_runs(keys)
        f = keys.astype(np.float64)
        assert np.array_equal(order, np.argsort(-f, kind="stable"))
        ref_k, ref_e = P.key_runs(f, order.astype(np.int64))
        assert np.array_equal(run_keys, ref_k) and np.array_equal(run_ends, ref_e)
    s = LoadBalancingDistributedSampler(None, complexities=src, num_replicas=2, rank=0)
    assert np.array_equal(s.complexities, as_f64)
    assert s.digest() == LoadBalancingDistributedSampler(None, complexities=as_f64).digest()
    with pytest.raises(ConfigError, match=r"complexities\[0\] = -3.0 is negative"):
        LoadBalancingDistributedBatchSampler(s, max_complexity=10.0)


def test_shuffle_runs_at_draws_what_shuffle_runs_draws():
    rng = np.random.default_rng(4)
    for case in range(50):
        top, n = int(rng.integers(1, 40)), int(rng.integers(1, 300))
        keys = np.sort(rng.integers(0, top, n)).astype(np.float64)
        a = np.arange(keys.shape[0], dtype=np.int64)
        b = a.copy()
        P.shuffle_runs(keys, a, case)
        P.shuffle_runs_at(b, P.key_runs(keys)[1], case)
        assert np.array_equal(a, b)
    order = np.arange(5, dtype=np.int64)
    with pytest.raises(ValueError, match=r"shuffle_runs_at: run_ends must end at 5"):
        P.shuffle_runs_at(order, np.array([2, 4], dtype=np.int64), 0)
    with pytest.raises(ValueError, match=r"shuffle_runs_at: run_ends\[1\] = 2 does not increase"):
        P.shuffle_runs_at(order, np.array([2, 2, 5], dtype=np.int64), 0)
    with pytest.raises(ValueError, match=r"shuffle_runs_at: run_ends must end at 0"):
        P.shuffle_runs_at(order[:0], np.array([1], dtype=np.int64), 0)
    P.shuffle_runs_at(order[:0], np.array([], dtype=np.int64), 0)  # nothing to shuffle


def _rank_batches_ref(items, bounds, slots, ids):
    parts = [items[bounds[s] : bounds[s + 1]] for s in slots]
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    if ids is not None:
        flat = ids[flat]
    offs = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
    return flat, offs


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("with_ids", [None, np.int64, np.int32])
def test_rank_batches_matches_numpy(with_ids, dtype, narrow):
    rng = np.random.default_rng(2)
    sizes = rng.integers(0, 5, 40)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    items = rng.permutation(int(bounds[-1])).astype(dtype)
    slots = rng.permutation(40)[:25].astype(np.int64)
    ids = None if with_ids is None else (rng.permutation(int(bounds[-1])) * 3).astype(with_ids)
    flat, offs = P.rank_batches(items, bounds, slots, ids, narrow=narrow)
    ref_flat, ref_offs = _rank_batches_ref(items, bounds, slots, ids)
    assert flat.dtype == (np.int32 if narrow else np.int64) and offs.dtype == np.int64
    assert np.array_equal(flat, ref_flat) and np.array_equal(offs, ref_offs)


def test_rank_batches_rejects_bad_input():
    items = np.arange(4, dtype=np.int64)
    bounds = np.array([0, 2, 4], dtype=np.int64)
    with pytest.raises(ValueError, match=r"rank_batches: slots\[1\] = 2 is outside \[0, 2\)"):
        P.rank_batches(items, bounds, np.array([0, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="rank_batches: bounds must run from 0 to 4"):
        P.rank_batches(items, np.array([0, 3], dtype=np.int64), np.array([0], dtype=np.int64))
    with pytest.raises(ValueError, match="rank_batches: bounds decrease at 1"):
        P.rank_batches(items, np.array([0, 5, 4], dtype=np.int64), np.array([0], dtype=np.int64))
    with pytest.raises(ValueError, match=r"rank_batches: items\[3\] = 3 is outside \[0, 3\)"):
        P.rank_batches(items, bounds, np.array([0, 1], dtype=np.int64), np.arange(3, dtype=np.int64))
    neg = np.array([0, 1, -2, 3], dtype=np.int32)
    with pytest.raises(ValueError, match=r"rank_batches: items\[2\] = -2 is outside \[0, 4\)"):
        P.rank_batches(neg, bounds, np.array([1], dtype=np.int64), np.arange(4, dtype=np.int64))
    # Only the rank's own slots are read: a bad position in another rank's slot is not this one's.
    flat, _ = P.rank_batches(items, bounds, np.array([0], dtype=np.int64), np.arange(3, dtype=np.int64))
    assert flat.tolist() == [0, 1]
    with pytest.raises(TypeError, match="No matching signature found"):  # int32 or int64 positions only
        P.rank_batches(items.astype(np.int16), bounds, np.array([0], dtype=np.int64))


def test_rank_batches_narrow_refuses_values_that_do_not_fit_int32():
    bounds = np.array([0, 2, 4], dtype=np.int64)
    both = np.array([0, 1], dtype=np.int64)
    ids = np.array([5, 2**31 - 1, 2**31, 7], dtype=np.int64)
    pos = np.array([0, 1, 3, 2], dtype=np.int32)
    with pytest.raises(
        ValueError, match=r"rank_batches: ids\[2\] = 2147483648 does not fit int32 \(narrow=True\)"
    ):
        P.rank_batches(pos, bounds, both, ids, narrow=True)
    ids[2] = -1
    with pytest.raises(ValueError, match=r"rank_batches: ids\[2\] = -1 does not fit int32 \(narrow=True\)"):
        P.rank_batches(pos, bounds, both, ids, narrow=True)
    # The largest int32 fits, and only the values written are checked (slot 1 is not this rank's).
    flat, _ = P.rank_batches(pos, bounds, both[:1], ids, narrow=True)
    assert flat.dtype == np.int32 and flat.tolist() == [5, 2**31 - 1]
    items = np.array([0, 1, 2**31, 3], dtype=np.int64)
    with pytest.raises(
        ValueError, match=r"rank_batches: items\[2\] = 2147483648 does not fit int32 \(narrow=True\)"
    ):
        P.rank_batches(items, bounds, both, narrow=True)
    assert P.rank_batches(items, bounds, both)[0].tolist() == [0, 1, 2**31, 3]  # int64 without narrow
    ids32 = np.array([5, 9, -4, 7], dtype=np.int32)  # int32 ids (the sampler's order)
    with pytest.raises(ValueError, match=r"rank_batches: ids\[2\] = -4 does not fit int32 \(narrow=True\)"):
        P.rank_batches(pos, bounds, both, ids32, narrow=True)
    assert P.rank_batches(pos, bounds, both[:1], ids32, narrow=True)[0].tolist() == [5, 9]
    with pytest.raises(ValueError, match=r"rank_batches: items\[1\] = 4 is outside \[0, 4\)"):
        P.rank_batches(np.array([0, 4, 1, 2], dtype=np.int32), bounds, both, ids32)


def test_plain_padding_and_drops_still_cover_once():
    lens = _lens(1003, 9)
    for drop_last in (False, True):
        ranks = [
            LoadBalancingDistributedSampler(
                None, complexities=lens, num_replicas=8, rank=r, drop_last=drop_last, seed=4
            )
            for r in range(8)
        ]
        got = np.concatenate([np.asarray(list(s)) for s in ranks])
        counts = np.bincount(got, minlength=1003)
        if drop_last:
            assert got.shape[0] == 1000 and counts.max() == 1 and (counts == 0).sum() == 3
        else:
            assert got.shape[0] == 1008 and counts.min() == 1 and (counts == 2).sum() == 5


def _record_dp(monkeypatch):
    calls = []
    real = S._P

    class Rec:
        def __getattr__(self, name):
            return getattr(real, name)

        def padded_min_padding_cut(self, rc, re, budget, penalty, ends):
            nb = real.padded_min_padding_cut(rc, re, budget, penalty, ends)
            cs = np.repeat(rc, np.diff(re, prepend=0))
            starts = np.concatenate(([0], ends[: nb - 1]))
            calls.append(
                (budget / penalty, 1.0 - cs.sum() / float(((ends[:nb] - starts) * cs[starts]).sum()))
            )
            return nb

    monkeypatch.setattr(S, "_P", Rec())
    return calls


def test_min_padding_cut_tries_a_cheaper_batch_while_it_pads_too_much(monkeypatch):
    # Very few samples per length: the first price per batch still pads > 0.1 %.
    lens = np.round(np.random.default_rng(2).lognormal(4, 1.2, 5000)).clip(1, 4000)
    calls = _record_dp(monkeypatch)
    st = LoadBalancingDistributedBatchSampler(
        LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=2, rank=0), max_complexity=8192
    ).plan_stats()
    assert [d for d, _ in calls] == list(S._PAD_BATCH_PENALTY_DIVS)
    assert calls[0][1] > S._PAD_DP_WASTE and calls[1][1] < calls[0][1]
    assert st["max_batch_cost_ratio"] <= 1.0 and st["duplicates"] == st["dropped"] == 0


def test_min_padding_cut_stops_at_the_first_price_that_pads_little(monkeypatch):
    lens = np.minimum(np.random.default_rng(22).geometric(0.02, 20000), 2000)
    calls = _record_dp(monkeypatch)
    st = LoadBalancingDistributedBatchSampler(
        LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=2, rank=0), max_complexity=4096
    ).plan_stats()
    assert len(calls) == 1 and calls[0][1] <= S._PAD_DP_WASTE
    assert st["padding_waste"] <= S._PAD_DP_WASTE


def test_empty_gives_pooled_arrays_that_are_reused():
    import gc
    import pickle

    P.release_pool()
    assert P.pool_bytes() == 0
    big = P.empty(300_000, np.int64)
    assert big.ctypes.data % HUGE == 0  # 2.4 MB: a huge-page-aligned block
    del big
    gc.collect()
    P.release_pool()
    a = P.empty(200_000, np.int64)
    assert a.dtype == np.int64 and a.shape == (200_000,) and a.flags.writeable and a.flags.c_contiguous
    a[:] = np.arange(200_000)
    b = pickle.loads(pickle.dumps(a))
    assert np.array_equal(a, b)
    a.setflags(write=False)
    addr = a.ctypes.data
    del a
    gc.collect()
    assert P.pool_bytes() >= 200_000 * 8
    c = P.empty(150_000, np.float64)  # fits the pooled block: reused
    assert c.ctypes.data == addr and P.pool_bytes() == 0
    view = c[10:20]
    del c
    gc.collect()
    assert P.pool_bytes() == 0  # a view keeps the block alive
    view[:] = 1.0
    del view
    gc.collect()
    assert P.pool_bytes() > 0
    P.release_pool()
    assert P.pool_bytes() == 0
    small = P.empty(10, np.float32)
    assert small.shape == (10,) and small.dtype == np.float32
    assert P.empty(0, np.int64).shape == (0,)
    with pytest.raises(ValueError, match="empty: n must be >= 0, got -1"):
        P.empty(-1, np.int64)


def test_samplers_on_pooled_arrays_keep_the_callers_array_apart():
    lens = _lens(100_000, 11)
    s = LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=2, rank=0)
    assert not np.shares_memory(s.complexities, lens)
    assert np.array_equal(s.complexities, lens.astype(np.float64)) and not s.complexities.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        s.complexities[0] = 1.0
    first = list(s)
    P.release_pool()
    P.release_scratch()
    again = LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=2, rank=0)
    assert list(again) == first


def test_planning_memory_is_reported_and_released():
    lens = _lens(120_000, 13)
    s = LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=4, rank=1)
    first = list(LoadBalancingDistributedBatchSampler(s, max_complexity=20_000, mode="packed"))
    del s
    import gc

    gc.collect()
    mem = S.planning_memory()
    assert mem["scratch"] >= 4 * 120_000 * 8 and mem["pool"] > 0
    S.release_planning_memory()
    assert S.planning_memory() == {"scratch": 0, "pool": 0}
    s = LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=4, rank=1)
    assert list(LoadBalancingDistributedBatchSampler(s, max_complexity=20_000, mode="packed")) == first
    P._hold_scratch(True)
    try:
        with pytest.raises(RuntimeError, match="a plan in another thread is using the scratch buffer"):
            S.release_planning_memory()
    finally:
        P._hold_scratch(False)


def test_padded_plan_keeps_the_step_wise_cut_when_the_program_finds_no_cut(monkeypatch):
    # padded_min_padding_cut returns 0 when no cut has a finite cost (sums past the float range):
    # the sampler must then keep its step-wise cut, not read the unused ends array.
    lens = np.minimum(np.random.default_rng(22).geometric(0.02, 20000), 2000)
    real = S._P

    def ranks():
        return [
            LoadBalancingDistributedBatchSampler(
                LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=2, rank=r),
                max_complexity=4096,
            )
            for r in range(2)
        ]

    class NoCut:
        def __getattr__(self, name):
            return getattr(real, name)

        def padded_min_padding_cut(self, rc, re, budget, penalty, ends):
            ends[:] = -7  # what an unused ends array might hold
            return 0

    with_program = ranks()[0].plan_stats()["padding_waste"]
    monkeypatch.setattr(S, "_P", NoCut())
    bs = ranks()
    st = bs[0].plan_stats()
    assert st["max_batch_cost_ratio"] <= 1.0 and st["duplicates"] == st["dropped"] == 0
    assert sorted(i for b in bs for batch in b for i in batch) == list(range(20000))
    assert st["padding_waste"] > 2 * with_program  # the step-wise cut: the program's was not used
