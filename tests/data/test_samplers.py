"""Load-balancing samplers: compiled kernels against slow oracles, behaviour, resume, bad input."""

from __future__ import annotations

import heapq
import logging
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from trainloom.data import samplers as S
from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from trainloom.errors import ConfigError

P = S._P


def _lens(n: int, seed: int = 0, hi: int = 300) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, hi, n)


def _ranks(lens, world, **kw):
    return [
        LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=world, rank=r, **kw)
        for r in range(world)
    ]


def _batch_ranks(lens, world, skw=None, **kw):
    return [LoadBalancingDistributedBatchSampler(s, **kw) for s in _ranks(lens, world, **(skw or {}))]


# --------------------------------------------------------------------------- compiled kernels
@pytest.mark.parametrize("kind", ["int", "float", "negative", "sparse"])
@pytest.mark.parametrize("descending", [False, True])
def test_argsort_is_a_stable_sort(kind, descending):
    rng = np.random.default_rng(1)
    keys = {
        "int": rng.integers(0, 50, 3000).astype(np.float64),  # counting-sort path
        "float": rng.standard_normal(3000),  # radix path
        "negative": rng.integers(-20, 20, 3000).astype(np.float64),
        "sparse": rng.integers(0, 2**40, 3000).astype(np.float64),  # too sparse for counting
    }[kind]
    keys[:5] = [0.0, -0.0, 0.0, 1.5, -1.5] if kind != "int" else [0, 0, 0, 1, 1]
    order_in = np.concatenate([rng.permutation(3000), rng.integers(0, 3000, 100)]).astype(np.int64)
    got = P.argsort(keys, order_in, descending)
    k = keys[order_in]
    ref = order_in[np.argsort(-k if descending else k, kind="stable")]
    assert np.array_equal(got, ref)


@pytest.mark.parametrize(
    "keys", [np.array([3.0, 1.0, 3.0, 0.0, 2.0, 1.0]), np.array([0.5, -2.0, 0.5, 1e300, -0.0])]
)
def test_sort_desc_returns_the_stable_descending_order(keys):
    assert np.array_equal(P.sort_desc(keys), np.argsort(-keys, kind="stable"))


def _runs_oracle(sorted_keys):
    change = np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1
    ends = np.append(change, sorted_keys.shape[0]).astype(np.int64)
    return sorted_keys[ends - 1], ends


@pytest.mark.parametrize("kind", ["int", "float", "sparse", "one", "single"])
def test_sort_desc_runs_gives_the_order_and_its_run_table(kind):
    rng = np.random.default_rng(3)
    keys = {
        "int": rng.integers(0, 40, 2000).astype(np.float64),  # from the counting sort's buckets
        "float": np.round(rng.standard_normal(2000), 1),  # radix sort, then a scan
        "sparse": rng.integers(0, 2**40, 2000).astype(np.float64),
        "one": np.full(50, 7.0),
        "single": np.array([3.0]),
    }[kind]
    order, run_keys, run_ends = P.sort_desc_runs(keys)
    assert order.dtype == np.int32  # ids of fewer than 2^31 items: half the pages of int64
    assert np.array_equal(order, np.argsort(-keys, kind="stable"))
    ref_k, ref_e = _runs_oracle(keys[order])
    assert np.array_equal(run_keys, ref_k) and np.array_equal(run_ends, ref_e)
    # key_runs gives the same table from an order, or from keys already sorted.
    for k, e in (P.key_runs(keys, order.astype(np.int64)), P.key_runs(keys[order])):
        assert np.array_equal(k, run_keys) and np.array_equal(e, run_ends)


def _lowest_target_oracle(rc, re, p, q, budget, want, ends):
    """The bisection the tail cut used to run in Python, one greedy_cut per halving, over [0, hi]:
    hi the budget, or the padded cost of the whole range when smaller and enough."""
    lo, hi = 0.0, budget
    whole = (q - p) * rc[np.searchsorted(re, p, side="right")]
    if whole < hi and P.greedy_cut(rc, re, p, q, whole, budget, ends, want) <= want:
        hi = whole
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if P.greedy_cut(rc, re, p, q, mid, budget, ends, want) <= want:
            hi = mid
        else:
            lo = mid
    return P.greedy_cut(rc, re, p, q, hi, budget, ends, want)


@pytest.mark.parametrize("seed", range(6))
def test_lowest_target_cut_matches_the_bisection_over_greedy_cut(seed):
    rng = np.random.default_rng(seed)
    cs = np.sort(rng.integers(1, 400, 3000).astype(np.float64))[::-1].copy()
    rc, re = P.key_runs(cs)
    budget = 2000.0
    p, q = int(rng.integers(0, 1000)), 3000
    ends, ref = np.empty(q - p, dtype=np.int64), np.empty(q - p, dtype=np.int64)
    need = P.greedy_cut(rc, re, p, q, budget, budget, ends, q - p)
    for want in (need, need + 3, need + 17):
        k = P.lowest_target_cut(rc, re, p, q, budget, want, ends)
        assert k == _lowest_target_oracle(rc, re, p, q, budget, want, ref) and k <= want
        assert np.array_equal(ends[:k], ref[:k]) and ends[k - 1] == q
    assert P.lowest_target_cut(rc, re, 5, 5, budget, 3, ends) == 0
    assert P.lowest_target_cut(rc, re, 0, 5, budget, 0, ends) == 1  # no room: more than allowed
    with pytest.raises(ValueError, match=r"lowest_target_cut: bad range \[5, 3001\) of 3000"):
        P.lowest_target_cut(rc, re, 5, 3001, budget, 3, ends)
    with pytest.raises(ValueError, match="lowest_target_cut: ends too small"):
        P.lowest_target_cut(rc, re, 0, 5, budget, 9, np.empty(3, dtype=np.int64))
    with pytest.raises(ValueError, match="lowest_target_cut: run 0 has cost -1.0"):
        P.lowest_target_cut(np.array([-1.0]), np.array([2]), 0, 2, budget, 3, ends)


@pytest.mark.parametrize("budget", [1e18, 2.0**62, 1e19, 1e300])
def test_budgets_far_beyond_the_items_cut_evenly(budget):
    # 1e19 / 1.0 was cast to int64 (undefined; it gave 1 item per batch), and the tail's bisection
    # of [0, 2^62] in 60 halvings stopped 4 wide of the even target (batches of 8 and 2).
    rc, re = np.array([1.0]), np.array([10], dtype=np.int64)
    ends = np.empty(10, dtype=np.int64)
    assert P.greedy_cut(rc, re, 0, 10, budget, budget, ends, 10) == 1 and ends[0] == 10
    assert P.lowest_target_cut(rc, re, 0, 10, budget, 2, ends) == 2 and ends[:2].tolist() == [5, 10]
    assert P.padded_steps(rc, re, 2, budget, ends) == (0, 0)  # one batch takes all: the tail's job
    out = [
        [len(b) for b in _batch_ranks([1.0] * 10, 2, max_complexity=budget, skw={"shuffle": False})[r]]
        for r in range(2)
    ]
    assert out == [[5], [5]]


def test_run_tables_are_checked():
    ends = np.empty(8, dtype=np.int64)
    rising = "run 1 has cost 6.0; costs must be finite, >= 0 and non-increasing"
    with pytest.raises(ValueError, match=f"padded_steps: {rising}"):
        P.padded_steps(np.array([5.0, 6.0]), np.array([2, 4]), 2, 10.0, ends)
    with pytest.raises(ValueError, match="greedy_cut: run 0 has cost nan"):
        P.greedy_cut(np.array([np.nan]), np.array([2]), 0, 2, 5.0, 10.0, ends, 8)
    repeated = "run 1 ends at 2; run ends must be positive and increasing"
    with pytest.raises(ValueError, match=f"padded_min_padding_cut: {repeated}"):
        P.padded_min_padding_cut(np.array([5.0, 4.0]), np.array([2, 2]), 10.0, 1.0, ends)
    with pytest.raises(ValueError, match="packed_plan: 2 run costs but 1 run ends"):
        P.packed_plan(np.array([5.0, 4.0]), np.array([2]), 2, 10.0, 1, None)
    with pytest.raises(ValueError, match=r"key_runs: order\[0\] = 5 is outside \[0, 2\)"):
        P.key_runs(np.zeros(2), np.array([5], dtype=np.int64))


def test_permutation_is_seeded_and_complete():
    a = P.permutation(1000, 7)
    assert np.array_equal(np.sort(a), np.arange(1000))
    assert np.array_equal(a, P.permutation(1000, 7))
    assert not np.array_equal(a, P.permutation(1000, 8))


def test_randint_and_uniform_are_seeded_and_in_range():
    a = P.randint(20000, 7, 11)
    assert a.dtype == np.int64 and a.min() == 0 and a.max() == 6
    counts = np.bincount(a, minlength=7)
    assert counts.min() > 20000 / 7 * 0.9 and counts.max() < 20000 / 7 * 1.1
    assert np.array_equal(a, P.randint(20000, 7, 11))
    assert not np.array_equal(a, P.randint(20000, 7, 12))
    u = P.uniform(20000, 5)
    assert u.dtype == np.float64 and u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.01
    assert np.array_equal(u, P.uniform(20000, 5))
    assert P.randint(0, 3, 1).shape == (0,) and P.uniform(0, 1).shape == (0,)


def test_int_stream_yields_python_ints_on_demand_with_a_length_hint():
    import operator
    import pickle

    a = np.array([5, -3, 2**40, 0], dtype=np.int64)
    it = P.IntStream(a, 1)
    assert iter(it) is it and operator.length_hint(it) == 3
    first = next(it)
    assert first == -3 and type(first) is int
    assert operator.length_hint(it) == 2
    rest = pickle.loads(pickle.dumps(it))  # a sampler mid-epoch can be copied
    assert list(it) == [2**40, 0] and operator.length_hint(it) == 0
    assert list(rest) == [2**40, 0]
    with pytest.raises(StopIteration):
        next(it)
    assert list(P.IntStream(a, 4)) == [] and list(P.IntStream(np.zeros(0, np.int64))) == []
    with pytest.raises(ValueError, match=r"IntStream: start 5 outside \[0, 4\]"):
        P.IntStream(a, 5)
    with pytest.raises(ValueError, match=r"Buffer dtype mismatch, expected 'const int64_t' but got 'double'"):
        P.IntStream(np.zeros(3))


def test_sample_draws_distinct_sorted_values_uniformly():
    counts = np.zeros(10)
    for seed in range(4000):
        s = P.sample(10, 3, seed)
        assert s.shape == (3,) and np.all(np.diff(s) > 0) and 0 <= s[0] and s[-1] < 10
        counts[s] += 1
    assert np.abs(counts / 1200 - 1).max() < 0.1  # each value picked 3/10 of the time
    big = P.sample(2_000_000, 5000, 9)  # sparse: the hash set, no n-sized array
    assert np.unique(big).shape == (5000,) and big.max() < 2_000_000
    assert np.array_equal(P.sample(6, 6, 1), np.arange(6))
    assert P.sample(0, 0, 1).shape == (0,)
    assert np.array_equal(big, P.sample(2_000_000, 5000, 9))


def test_draws_reject_bad_sizes():
    with pytest.raises(ValueError, match=r"randint: need n >= 0 and bound >= 1, got n=3, bound=0"):
        P.randint(3, 0, 1)
    with pytest.raises(ValueError, match=r"uniform: n must be >= 0, got -1"):
        P.uniform(-1, 1)
    with pytest.raises(ValueError, match=r"sample: need 0 <= k <= n, got n=3, k=4"):
        P.sample(3, 4, 1)


def test_planning_does_not_import_numpy_random():
    # numpy.random is imported lazily and its first import costs ~7 ms, more than a 100k-sample
    # plan; the samplers draw from the compiled generator instead.
    code = (
        "import sys, numpy as np, torch\n"
        "from trainloom.data.samplers import LoadBalancingDistributedSampler as S, "
        "LoadBalancingDistributedBatchSampler as B\n"
        "before = 'numpy.random' in sys.modules\n"
        "s = S(None, complexities=np.arange(1, 1002), num_replicas=8, rank=3, random_level=0.5)\n"
        "list(s); list(B(s, max_complexity=5000)); list(B(s, max_complexity=5000, mode='packed'))\n"
        "print(before, 'numpy.random' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = out.stdout.split()
    assert after == before


def test_shuffle_runs_only_permutes_ties():
    keys = np.repeat(np.arange(10.0), 50)
    order = np.arange(500, dtype=np.int64)
    P.shuffle_runs(keys, order, 3)
    assert np.array_equal(keys[order], keys)  # still sorted
    assert not np.array_equal(order, np.arange(500))
    assert np.array_equal(np.sort(order), np.arange(500))


def _lpt_oracle(costs_desc, world):
    heap = [(0.0, j) for j in range(world)]
    for c in costs_desc:
        load, j = heapq.heappop(heap)
        heapq.heappush(heap, (load + c, j))
    return sorted(load for load, _ in heap)


def test_packed_plan_matches_a_python_longest_first_deal():
    lens = np.sort(_lens(500, 4).astype(np.float64))[::-1].copy()
    desc = np.arange(500, dtype=np.int64)
    items, bounds, steps = P.packed_plan(*P.key_runs(lens), 7, 1e12, 1, None)
    assert items.dtype == np.int32 and bounds.dtype == np.int64  # positions: half the pages
    items = desc[items]
    assert steps == 1
    loads = sorted(lens[items[bounds[j] : bounds[j + 1]]].sum() for j in range(7))
    assert np.allclose(loads, _lpt_oracle(lens, 7))


_M64 = (1 << 64) - 1


def _rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & _M64


class _Xoshiro:
    """xoshiro256** seeded through splitmix64, as the compiled core draws it (slow)."""

    def __init__(self, seed):
        x, self.s = seed, []
        for _ in range(4):
            x = (x + 0x9E3779B97F4A7C15) & _M64
            z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
            self.s.append(z ^ (z >> 31))

    def next(self):
        s0, s1, s2, s3 = self.s
        out = (_rotl((s1 * 5) & _M64, 7) * 9) & _M64
        t = (s1 << 17) & _M64
        s2 ^= s0
        s3 ^= s1
        s1 ^= s2
        s0 ^= s3
        s2 ^= t
        self.s = [s0, s1, s2, _rotl(s3, 45)]
        return out

    def shuffle(self, a):
        for i in range(len(a) - 1, 0, -1):
            j = (self.next() * (i + 1)) >> 64
            a[i], a[j] = a[j], a[i]


def _packed_oracle(run_costs, run_ends, world, budget, nsteps, seed):
    """packed_plan done the slow way, from an array of every position's cost."""
    cost = np.repeat(run_costs, np.diff(run_ends, prepend=0)).tolist()
    n = len(cost)
    rng = _Xoshiro(0 if seed is None else seed)
    perm = list(range(nsteps))
    if seed is not None:
        rng.shuffle(perm)
    steps = [[] for _ in range(nsteps)]
    nfull, rem = divmod(n, nsteps)
    for k in range(nfull):  # block k deals one of its positions to every step
        tile = list(range(nsteps))
        if seed is not None:
            rng.shuffle(tile)
        for s in range(nsteps):
            steps[s].append(k * nsteps + tile[s])
    for j in range(rem):  # the partial last block: one more item for the first `rem` of perm
        steps[perm[j]].append(nfull * nsteps + j)
    rr = 0

    def reset():
        return [[0.0, j] for j in range(world)], [0] * world, [world]

    def place(c, heap, cnt, size):  # the bin, or None when no open bin takes the item
        nonlocal rr
        if size[0] == 0:
            return None
        if c == 0.0:
            b = heap[rr % size[0]][1]
            rr += 1
        else:
            b = heap[0][1]
            if c > budget:
                if cnt[b] != 0:
                    return None
                size[0] -= 1
                heap[0] = heap[size[0]]
            elif heap[0][0] + c > budget:
                return None
            else:
                heap[0][0] += c
            i, x = 0, heap[0]  # sift the root down (a min-heap on load; ties keep the left child)
            while 2 * i + 1 < size[0]:
                m = 2 * i + 1
                if m + 1 < size[0] and heap[m + 1][0] < heap[m][0]:
                    m += 1
                if not heap[m][0] < x[0]:
                    break
                heap[i] = heap[m]
                i = m
            heap[i] = x
        cnt[b] += 1
        return b

    slots, left = [], []
    for items in steps:
        heap, cnt, size = reset()
        bins = [[] for _ in range(world)]
        for p in items:
            b = place(cost[p], heap, cnt, size)
            (left if b is None else bins[b]).append(p)
        slots += bins
    heap, cnt, size = reset()
    bins = [[] for _ in range(world)]
    for p in sorted(left):  # extra steps: the left-over items, longest first
        b = place(cost[p], heap, cnt, size)
        if b is None:
            slots += bins
            heap, cnt, size = reset()
            bins = [[] for _ in range(world)]
            b = place(cost[p], heap, cnt, size)
        bins[b].append(p)
    if left:
        slots += bins
    bounds = np.cumsum([0] + [len(x) for x in slots])
    return [p for x in slots for p in sorted(x)], bounds.tolist(), len(slots) // world


def test_xoshiro_oracle_draws_what_the_compiled_core_draws():
    for seed in (0, 1, 2**63 + 5):
        a = list(range(50))
        _Xoshiro(seed).shuffle(a)
        assert a == P.permutation(50, seed).tolist()


@pytest.mark.parametrize("case", range(300))
def test_packed_plan_matches_a_slow_oracle(case):
    # Every decision of the deal compared: step membership (blocks, shuffles, the partial block),
    # longest first to the least-loaded bin, zero-cost round robin, items over budget alone, the
    # drain. The compiled plan keeps no per-item cost (it carries each item's run), the oracle does.
    rng = np.random.default_rng(1000 + case)
    n = int(rng.integers(1, 300))
    kind = case % 4
    if kind == 0:
        lens = rng.integers(0, 30, n).astype(np.float64)  # ties and zero costs
    elif kind == 1:
        lens = rng.random(n) * 10.0  # nearly all distinct (a run per item)
        lens[rng.random(n) < 0.2] = 0.0
    elif kind == 2:
        lens = rng.integers(0, 4, n).astype(np.float64) ** 2 * 3.5
    else:
        lens = np.round(rng.exponential(5.0, n), 1)
    lens = np.sort(lens)[::-1].copy()
    world = int(rng.integers(1, 41))
    top = float(lens[0]) if lens[0] > 0 else 1.0
    budget = top * float(rng.choice([0.3, 0.7, 1.0, 1.5, 3.0, 10.0]))  # below 1: items over budget
    nsteps = int(rng.integers(1, n // world + 4))  # may exceed n: steps without items
    seed = None if case % 3 == 0 else int(rng.integers(0, 2**63))
    runs = P.key_runs(lens)
    items, bounds, steps = P.packed_plan(*runs, world, budget, nsteps, seed)
    ref_items, ref_bounds, ref_steps = _packed_oracle(*runs, world, budget, nsteps, seed)
    assert (items.tolist(), bounds.tolist(), steps) == (ref_items, ref_bounds, ref_steps)


@pytest.mark.parametrize("world,budget", [(1, 1.7), (3, 0.9)])
def test_packed_plan_matches_the_oracle_when_runs_and_offsets_overflow_int32(world, budget):
    # 2^16 steps and blocks spanning 2^16 runs (every cost distinct): an item's offset in its
    # block (16 bits) and its run within the block (17 bits) do not fit one int32 together, so the
    # plan keeps plain positions and searches each item's run. The budgets make the deal depend
    # on every item's exact cost (which items fit, which are over budget).
    n = 3 * 2**16 + 5
    lens = np.linspace(1.0, 0.01, n)
    lens[-3:] = 0.0  # the last run: zero-cost items, dealt round robin
    runs = P.key_runs(lens)
    items, bounds, steps = P.packed_plan(*runs, world, budget, 2**16, 9)
    ref_items, ref_bounds, ref_steps = _packed_oracle(*runs, world, budget, 2**16, 9)
    assert (items.tolist(), bounds.tolist(), steps) == (ref_items, ref_bounds, ref_steps)


def test_packed_plan_respects_the_budget_and_places_every_item():
    rng = np.random.default_rng(5)
    lens = np.sort(rng.integers(1, 120, 4000).astype(np.float64))[::-1].copy()
    lens[:3] = [500, 400, 300]  # over the budget: a bin of their own
    desc = rng.permutation(4000).astype(np.int64)
    cost = np.empty(4000)
    cost[desc] = lens
    items, bounds, steps = P.packed_plan(*P.key_runs(lens), 5, 200.0, 30, 11)
    items = desc[items]
    assert np.array_equal(np.sort(items), np.arange(4000))
    for j in range(steps * 5):
        c = cost[items[bounds[j] : bounds[j + 1]]]
        assert c.sum() <= 200.0 or c.shape[0] == 1


def test_padded_steps_cap_and_contiguity():
    cs = np.sort(_lens(3000, 6).astype(np.float64))[::-1].copy()
    ends = np.empty(3000, dtype=np.int64)
    nb, p = P.padded_steps(*P.key_runs(cs), 4, 1000.0, ends)
    assert nb % 4 == 0 and 0 < p <= 3000
    starts = np.concatenate([[0], ends[: nb - 1]])
    assert np.all(ends[:nb] > starts)
    assert np.all((ends[:nb] - starts) * cs[starts] <= 1000.0)


def test_gather_batches_moves_whole_batches():
    items = np.arange(10, dtype=np.int64) * 10
    bounds = np.array([0, 3, 4, 8, 10], dtype=np.int64)
    out, ob = P.gather_batches(items, bounds, np.array([2, 0, 3, 1], dtype=np.int64))
    assert out.tolist() == [40, 50, 60, 70, 0, 10, 20, 80, 90, 30]
    assert ob.tolist() == [0, 4, 7, 9, 10]
    with pytest.raises(ValueError, match=r"gather_batches: perm\[1\] = 2 is out of range or repeated"):
        P.gather_batches(items, bounds, np.array([2, 2, 0, 1], dtype=np.int64))
    with pytest.raises(ValueError, match="gather_batches: 3 entries in perm for 4 batches"):
        P.gather_batches(items, bounds, np.array([0, 1, 2], dtype=np.int64))


def test_gather_batches_narrow_writes_the_same_items_as_int32():
    rng = np.random.default_rng(4)
    items = rng.integers(0, 2**31 - 1, 500).astype(np.int64)
    items[:2] = [0, 2**31 - 1]  # both ends of the int32 range
    bounds = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 500), 40, replace=False)), [500]])
    perm = rng.permutation(bounds.shape[0] - 1).astype(np.int64)
    wide, wb = P.gather_batches(items, bounds, perm)
    narrow, nb = P.gather_batches(items, bounds, perm, narrow=True)
    assert wide.dtype == np.int64 and narrow.dtype == np.int32
    assert np.array_equal(narrow, wide) and np.array_equal(nb, wb)
    big = items.copy()
    big[7] = 2**31
    with pytest.raises(
        ValueError, match=r"gather_batches: items\[7\] = 2147483648 does not fit int32 \(narrow=True\)"
    ):
        P.gather_batches(big, bounds, perm, narrow=True)
    big[7] = -1
    with pytest.raises(ValueError, match=r"gather_batches: items\[7\] = -1 does not fit int32"):
        P.gather_batches(big, bounds, perm, narrow=True)


@pytest.mark.parametrize("items_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("seed", range(4))
def test_gather_batches_shuffles_ties_and_repeats_as_the_separate_passes_do(seed, items_dtype):
    # The fused tie shuffle must give exactly the plan of: copy the order, shuffle_runs it, append
    # the repeated positions (padding) or cut the tail (drop_last), then gather.
    rng = np.random.default_rng(seed)
    for _ in range(150):
        n = int(rng.integers(1, 80))
        keys = rng.integers(0, int(rng.integers(1, 9)), n).astype(np.float64)
        desc = P.sort_desc(keys).astype(items_dtype)  # the sampler's order is int32
        runs = P.key_runs(keys, desc.astype(np.int64))[1]
        tie_seed = int(rng.integers(0, 2**63))
        kind = int(rng.integers(0, 3))
        repeat = rng.integers(0, n, int(rng.integers(1, 6))).astype(np.int64) if kind == 2 else None
        m = int(rng.integers(0, n + 1)) if kind == 1 else n + (0 if repeat is None else repeat.shape[0])
        nb = int(rng.integers(1, 9))
        bounds = np.concatenate([[0], np.sort(rng.integers(0, m + 1, nb - 1)), [m]]).astype(np.int64)
        perm = rng.permutation(nb).astype(np.int64)
        shuffled = desc.astype(np.int64)
        P.shuffle_runs(keys, shuffled, tie_seed)
        for tie_runs, source in ((runs, shuffled), (None, desc)):
            ref = source if repeat is None else np.concatenate([source, source[repeat]])
            for narrow in (False, True):
                want, want_b = P.gather_batches(np.ascontiguousarray(ref[:m]), bounds, perm, narrow=narrow)
                got, got_b = P.gather_batches(
                    desc, bounds, perm, narrow=narrow, tie_runs=tie_runs, seed=tie_seed, repeat=repeat
                )
                assert got.dtype == want.dtype and np.array_equal(got, want) and np.array_equal(got_b, want_b)


def test_gather_batches_rejects_bad_tie_runs_and_repeats():
    items = np.arange(6, dtype=np.int64)
    bounds = np.array([0, 2, 6], dtype=np.int64)
    perm = np.array([1, 0], dtype=np.int64)
    with pytest.raises(ValueError, match=r"gather_batches: tie_runs must end at 6"):
        P.gather_batches(items, bounds, perm, tie_runs=np.array([2, 5], dtype=np.int64))
    with pytest.raises(ValueError, match=r"gather_batches: tie_runs\[1\] = 2 does not increase"):
        P.gather_batches(items, bounds, perm, tie_runs=np.array([2, 2, 6], dtype=np.int64))
    with pytest.raises(ValueError, match=r"gather_batches: bounds must run from 0 to at most 6"):
        P.gather_batches(items, np.array([0, 2, 7], dtype=np.int64), perm)
    rep = np.array([5, 6], dtype=np.int64)
    with pytest.raises(ValueError, match=r"gather_batches: repeat\[1\] = 6 is outside \[0, 6\)"):
        P.gather_batches(items, np.array([0, 2, 8], dtype=np.int64), perm, repeat=rep)
    with pytest.raises(
        ValueError, match=r"gather_batches: bounds must run from 0 to 8 \(6 items, 2 repeated\)"
    ):
        P.gather_batches(items, bounds, perm, repeat=np.array([5, 4], dtype=np.int64))


def test_padded_plan_keeps_int32_item_ids():
    lens = _lens(3000, 22, hi=200)
    bs = _batch_ranks(lens, 4, max_complexity=1500)[0]
    plan = bs._plan()
    assert plan.items.dtype == np.int32
    counts = np.bincount(plan.item_ids(), minlength=lens.shape[0])
    assert counts.min() == 1 and counts.sum() == lens.shape[0] + plan.duplicates


def test_padded_steps_group_batches_of_similar_cost():
    # A long tail of unique lengths: contiguous steps mixed 2 x 900 with 3 x 520 and the like.
    lens = np.concatenate([_lens(4000, 21, hi=60), 300 + np.arange(200) * 3])
    bs = _batch_ranks(lens, 8, max_complexity=2000)[0]
    plan = bs._plan()
    first = lens[plan.items[plan.bounds[:-1]]]
    cost = np.diff(plan.bounds) * first
    steps = cost[plan.slot_matrix()]
    assert np.all(steps.max(axis=1) <= 2000)
    # Steps are neighbours in padded cost: sorted by cost, no two steps overlap.
    srt = steps[np.argsort(-steps.max(axis=1))]
    assert np.all(srt[:-1].min(axis=1) >= srt[1:].max(axis=1))
    assert bs.plan_stats()["straggler_mean"] < 1.02


def test_min_padding_cut_ends_batches_where_lengths_change():
    cs = np.array([5.0] * 3 + [4.0] * 4 + [3.0] * 5)
    runs = P.key_runs(cs)
    ends = np.empty(12, dtype=np.int64)
    # The greedy cut (4 x 5, 5 x 4, 3 x 3) pads 3; runs of one length fit the budget whole.
    assert P.padded_min_padding_cut(*runs, 20.0, 1.0, ends) == 3
    assert ends[:3].tolist() == [3, 7, 12]
    # A high price per batch buys fewer batches with padding; the cap still holds.
    nb = P.padded_min_padding_cut(*runs, 20.0, 1e6, ends)
    starts = np.concatenate([[0], ends[: nb - 1]])
    assert nb == 3 and ends[nb - 1] == 12 and np.all((ends[:nb] - starts) * cs[starts] <= 20.0)
    with pytest.raises(ValueError, match="padded_min_padding_cut: budget=0.0, batch_penalty=1.0"):
        P.padded_min_padding_cut(*runs, 0.0, 1.0, ends)
    with pytest.raises(ValueError, match="padded_min_padding_cut: ends has 11 slots for 12 items"):
        P.padded_min_padding_cut(*runs, 20.0, 1.0, ends[:11])


def _min_padding_oracle(cs, budget, penalty):
    """The minimum-padding program over every position, one item at a time (slow, obvious)."""
    n = cs.shape[0]
    pre = np.concatenate([[0.0], np.cumsum(cs)])
    run_end = {int(e) for e in np.flatnonzero(np.diff(cs) != 0) + 1} | {n}
    f = [0.0] + [np.inf] * n
    prev = [0] * (n + 1)
    for i in range(n):
        if f[i] == np.inf:
            continue
        c = cs[i]
        k = n - i if c <= 0 else min(max(int(budget // c), 1), n - i)
        for j in range(i + 1, i + k + 1):
            if j != i + k and j not in run_end:
                continue
            v = (j - i) * c
            val = f[i] + v - (pre[j] - pre[i]) + penalty * (budget / v) ** 2 if v > 0 else f[i] + penalty
            if val < f[j]:
                f[j], prev[j] = val, i
    ends, j = [], n
    while j > 0:
        ends.append(j)
        j = prev[j]
    return ends[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_min_padding_cut_matches_a_per_item_program(seed):
    # The compiled program works on the run table (values per run end and per fullest end); the
    # oracle on every position. Integer costs keep both sums exact.
    rng = np.random.default_rng(seed)
    hi = [5, 40, 400, 3000, 40, 2][seed]
    cs = np.sort(rng.integers(0, hi, int(rng.integers(1, 400))).astype(np.float64))[::-1].copy()
    budget = float(rng.choice([50.0, 500.0, 4000.0]))
    ends = np.empty(cs.shape[0], dtype=np.int64)
    for penalty in (0.0, budget / 1000, budget / 10, budget * 10):
        nb = P.padded_min_padding_cut(*P.key_runs(cs), budget, penalty, ends)
        assert ends[:nb].tolist() == _min_padding_oracle(cs, budget, penalty)


@pytest.mark.parametrize(
    "cs, budget",
    [
        # 150 run ends whose fullest ends (200 to 318 items on) land inside one long run, each then
        # pushing the next: ~150 fullest ends wait at once (the window grows from 64 and slides).
        (np.concatenate([np.arange(400, 250, -1), np.full(2000, 250)]), 80000.0),
        # Short items last: many fullest ends clamped to n (the only place two can coincide), and
        # zero-cost items (one batch takes all that are left).
        (np.concatenate([np.full(40, 90), np.arange(60, 0, -1).repeat(3), np.zeros(30)]), 1000.0),
        # Items over the budget (a batch of one each: every position is reachable), then small ones.
        (np.concatenate([np.arange(120, 60, -1), np.full(50, 7)]), 50.0),
        # Items so cheap that more than 2^63 fit the budget: their batch takes all that are left.
        (np.array([5.0, 5.0, 3.0] + [1e-19] * 20), 10.0),
        (np.array([3.0]), 10.0),
        (np.array([30.0]), 10.0),
        (np.array([0.0]), 10.0),
    ],
)
def test_min_padding_cut_through_fullest_ends_matches_a_per_item_program(cs, budget):
    # The compiled program keeps values per run end and, for the fullest ends that are not run
    # ends, only while they wait to be processed; the walk back finds their predecessors from the
    # run table. The per-item program keeps every position.
    cs = cs.astype(np.float64)
    ends = np.empty(cs.shape[0], dtype=np.int64)
    for penalty in (0.0, budget / 8000, budget / 10, budget * 10):
        nb = P.padded_min_padding_cut(*P.key_runs(cs), budget, penalty, ends)
        assert ends[:nb].tolist() == _min_padding_oracle(cs, budget, penalty)
    # No cut has a finite cost: no batches (the sampler then keeps its step-wise cut).
    assert P.padded_min_padding_cut(*P.key_runs(cs), budget, np.inf, ends) == 0


def test_padded_mode_cuts_where_lengths_change(monkeypatch):
    # Few samples per length (a long tail): batches straddling two lengths pad.
    lens = np.random.default_rng(22).geometric(0.02, 20000)
    lens = np.minimum(lens, 2000)
    new = _batch_ranks(lens, 2, max_complexity=4096)[0].plan_stats()
    monkeypatch.setattr(LoadBalancingDistributedBatchSampler, "_padded_min_padding", lambda *a: None)
    old = _batch_ranks(lens, 2, max_complexity=4096)[0].plan_stats()
    assert new["padding_waste"] < 0.5 * old["padding_waste"]
    assert new["max_batch_cost_ratio"] <= 1.0 and new["duplicates"] == new["dropped"] == 0


def test_packed_plan_deals_left_over_items_to_extra_steps():
    # Coarse items against the budget: many fit no bin of their planned step and go to the
    # extra steps at the end, longest first.
    rng = np.random.default_rng(8)
    lens = np.sort(rng.integers(20, 90, 3000).astype(np.float64))[::-1].copy()
    lens[:40] = np.linspace(400, 260, 40)  # over the budget: a bin each
    items, bounds, steps = P.packed_plan(*P.key_runs(lens), 6, 250.0, 100, 3)
    assert steps > 100 and bounds.shape[0] == steps * 6 + 1
    assert np.array_equal(np.sort(items), np.arange(3000))
    for j in range(steps * 6):
        part = items[bounds[j] : bounds[j + 1]]
        assert lens[part].sum() <= 250.0 or part.shape[0] == 1
    extra = items[bounds[100 * 6] :]  # the extra steps hold the left-over items
    assert extra.shape[0] > 0 and np.all(lens[extra] > 0)
    for j in range(100 * 6, steps * 6):  # each bin longest first
        assert np.all(np.diff(items[bounds[j] : bounds[j + 1]]) > 0)


def test_kernels_reject_bad_arrays():
    with pytest.raises(ValueError, match=r"argsort: order_in\[1\] = 9 is outside \[0, 3\)"):
        P.argsort(np.zeros(3), np.array([0, 9], dtype=np.int64))
    rising = "packed_plan: run 1 has cost 2.0; costs must be finite, >= 0 and non-increasing"
    with pytest.raises(ValueError, match=rising):
        P.packed_plan(np.array([1.0, 2.0]), np.array([1, 2]), 2, 10.0, 1, None)
    with pytest.raises(ValueError, match=r"rank_stream: rank 2 outside \[0, 2\)"):
        P.rank_stream(np.zeros(4, dtype=np.int64), np.arange(2), np.zeros(2, dtype=np.int64), 2, 2)
    # Packed positions are int32: more than 2^31 - 1 items is refused before any scratch is taken
    # (a run table of one run of 2^31 items).
    msg = r"packed_plan: 2147483648 items; packed mode plans at most 2147483647"
    with pytest.raises(ValueError, match=msg):
        P.packed_plan(np.array([1.0]), np.array([2**31]), 2, 10.0, 1, None)


# --------------------------------------------------------------------------- plain sampler
def test_bagua_style_construction_with_complexity_fn():
    n = 24
    ds = torch.utils.data.TensorDataset(torch.randn(n, 2), torch.randperm(n))
    samplers = [
        LoadBalancingDistributedSampler(ds, complexity_fn=lambda x: x[1], num_replicas=3, rank=r)
        for r in range(3)
    ]
    outs = [list(s) for s in samplers]
    assert [len(o) for o in outs] == [8, 8, 8]
    assert sorted(sum(outs, [])) == list(range(n))
    # Position by position, the ranks hold neighbours in complexity order.
    comp = ds.tensors[1].numpy()
    spread = [np.ptp(comp[[o[i] for o in outs]]) for i in range(8)]
    assert max(spread) <= 2


def test_complexities_tensor_fast_path_and_defaults_without_distributed():
    s = LoadBalancingDistributedSampler(None, complexities=torch.arange(10))
    assert (s.num_replicas, s.rank, len(s)) == (1, 0, 10)
    assert sorted(s) == list(range(10))


def test_complexities_are_copied_not_frozen_or_aliased():
    values = np.arange(10, dtype=np.float64)
    s = LoadBalancingDistributedSampler(None, complexities=values)
    values[0] = 99.0  # the caller's array stays writable and changing it does not reach the sampler
    assert s.complexities[0] == 0.0 and not s.complexities.flags.writeable


def test_padding_duplicates_are_documented_and_balanced():
    lens = _lens(10, 2)
    outs = [list(s) for s in _ranks(lens, 4)]
    assert [len(o) for o in outs] == [3, 3, 3, 3]
    flat = sum(outs, [])
    assert set(flat) == set(range(10)) and len(flat) - 10 == 2
    stats = _ranks(lens, 4)[0].plan_stats()
    assert stats["duplicates"] == 2 and stats["dropped"] == 0


def test_drop_last_drops_fewer_than_world():
    outs = [list(s) for s in _ranks(_lens(10, 2), 4, drop_last=True)]
    assert [len(o) for o in outs] == [2, 2, 2, 2]
    assert len(set(sum(outs, []))) == 8


def test_world_larger_than_dataset_gives_equal_lengths():
    outs = [list(s) for s in _ranks([3.0, 1.0, 2.0], 5)]
    assert [len(o) for o in outs] == [1] * 5
    assert set(sum(outs, [])) == {0, 1, 2}


def test_no_shuffle_is_sorted_and_epoch_independent():
    lens = _lens(40, 3)
    s = _ranks(lens, 2, shuffle=False)[0]
    a = list(s)
    s.set_epoch(5)
    assert list(s) == a
    assert np.all(np.diff(lens[a]) >= 0)


def test_set_epoch_changes_order_and_reuse_warns_once():
    s = _ranks(_lens(200, 3), 2)[0]
    first = list(s)
    with pytest.warns(
        UserWarning, match="iterated a second time in epoch 0: the order repeats. Call set_epoch"
    ):
        again = list(s)
    assert again == first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s)  # warned once only
        s.set_epoch(1)
        assert list(s) != first


@pytest.mark.parametrize("mode", ["padded", "packed", "batch_fn"])
def test_batch_sampler_iterated_twice_in_an_epoch_warns_once(mode):
    kw: dict = {"max_complexity": 900, "mode": mode}
    if mode == "batch_fn":
        kw = {"batch_fn": lambda idx: [idx[i : i + 7] for i in range(0, len(idx), 7)]}
    b = _batch_ranks(_lens(200, 3), 2, **kw)[0]
    first = list(b)
    with pytest.warns(
        UserWarning,
        match=r"^LoadBalancingDistributedBatchSampler is iterated a second time in epoch 0: the order "
        r"repeats\. Call set_epoch\(epoch\) at the start of every epoch\.$",
    ):
        again = list(b)
    assert again == first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(b)  # warned once only
        b.set_epoch(1)
        assert list(b) != first
        b.sampler.set_epoch(2)  # the wrapped sampler's epoch counts too (Bagua's loops set either)
        second = list(b)
        assert b.epoch == 2 and second != first


_REUSE_SCRIPT = """
import logging, sys
if sys.argv[1] == "logging":
    logging.basicConfig(format="LOG %(name)s %(levelname)s %(message)s")
from trainloom.data import LoadBalancingDistributedSampler
s = LoadBalancingDistributedSampler(list(range(10)), complexities=list(range(10)), num_replicas=1, rank=0)
list(s)
list(s)  # the line the warning names
"""


@pytest.mark.parametrize("setup", ["plain", "logging"])
def test_reuse_warning_is_printed_once_and_logged_when_logging_is_set_up(setup):
    out = subprocess.run(
        [sys.executable, "-c", _REUSE_SCRIPT, setup], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    msg = (
        "LoadBalancingDistributedSampler is iterated a second time in epoch 0: the order repeats. "
        "Call set_epoch(epoch) at the start of every epoch."
    )
    lines = [line for line in out.stderr.splitlines() if msg in line]
    assert lines[0] == f"<string>:8: UserWarning: {msg}"  # attributed to the user's line
    if setup == "plain":  # no second copy from logging's last-resort handler
        assert lines == [f"<string>:8: UserWarning: {msg}"]
    else:
        assert lines == [f"<string>:8: UserWarning: {msg}", f"LOG trainloom.data WARNING {msg}"]


def test_random_level_one_is_close_to_random():
    lens = np.arange(2000)
    s0 = _ranks(lens, 2, random_level=0)[0]
    s1 = _ranks(lens, 2, random_level=1)[0]
    assert s0.plan_stats(batch_size=8)["straggler_mean"] < s1.plan_stats(batch_size=8)["straggler_mean"]
    assert sorted(
        list(_ranks(lens, 2, random_level=1)[0]) + list(_ranks(lens, 2, random_level=1)[1])
    ) == list(range(2000))


def test_plain_sampler_resume_equals_uninterrupted():
    lens = _lens(101, 8)
    ref = list(_ranks(lens, 3)[1])
    s = _ranks(lens, 3)[1]
    s.set_epoch(0)
    it = iter(s)
    head = [next(it) for _ in range(10)]
    state = s.state_dict()
    assert state["consumed"] == 10
    t = _ranks(lens, 3, seed=99)[1]  # the state's seed wins
    t.load_state_dict(state)
    assert len(t) == len(ref) - 10
    assert head + list(t) == ref


def test_plain_sampler_copied_mid_epoch_goes_on_where_it_was():
    import copy
    import pickle

    lens = _lens(101, 8)
    ref = list(_ranks(lens, 3)[1])
    s = _ranks(lens, 3)[1]
    it = iter(s)
    head = [next(it) for _ in range(7)]
    for clone in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert clone.state_dict()["consumed"] == 7
        assert head + list(clone._iter) == ref
    assert head + list(it) == ref


# --------------------------------------------------------------------------- batch sampler
@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_budget_mode_hard_cap_and_exact_coverage(mode):
    lens = _lens(3000, 9, hi=400)
    lens[7] = 5000  # over the budget: a batch of its own
    bss = _batch_ranks(lens, 4, max_complexity=2000, mode=mode)
    outs = [list(b) for b in bss]
    assert len({len(o) for o in outs}) == 1 and len(outs[0]) == len(bss[0])
    flat = [i for o in outs for b in o for i in b]
    assert sorted(flat) == list(range(3000))
    for o in outs:
        for b in o:
            cost = len(b) * max(lens[b]) if mode == "padded" else sum(lens[b])
            assert cost <= 2000 or b == [7]
    st = bss[0].plan_stats()
    assert st["duplicates"] == st["dropped"] == st["empty_rank_steps"] == 0
    assert st["straggler_mean"] >= 1.0 and st["max_batch_cost"] >= 5000


def _over_budget_steps(outs, lens, budget):
    """Per step: how many ranks hold an item over the budget."""
    return [sum(int(lens[b].max() > budget) for b in step) for step in zip(*outs)]


def test_packed_gives_items_over_the_budget_steps_of_their_own():
    # 1 % of the items over the budget used to be dealt one per step, each holding up a step of
    # ordinary items (31 of 32 steps): straggler mean 2.08 where padded mode has 1.004.
    lens = np.random.default_rng(0).integers(1, 200, 4000)
    lens[:40] = 5000
    bss = _batch_ranks(lens, 8, max_complexity=2000, mode="packed")
    st = bss[0].plan_stats()
    assert st["straggler_mean"] <= 1.01
    assert st["duplicates"] == st["dropped"] == st["empty_rank_steps"] == 0
    outs = [list(b) for b in bss]
    assert sorted(i for o in outs for b in o for i in b) == list(range(4000))
    assert sorted(x for x in _over_budget_steps(outs, lens, 2000) if x) == [8] * 5  # 40 in 5 steps
    assert all(len(b) == 1 for o in outs for b in o if lens[b].max() > 2000)
    # Ties among them are grouped afresh each epoch (the steps are W of one cost here).
    groups = []
    for epoch in (1, 2):
        for bs in bss:
            bs.set_epoch(epoch)
        groups.append({frozenset(b[0] for b in step if lens[b[0]] > 2000) for step in zip(*map(list, bss))})
    assert groups[0] != groups[1]


def test_packed_fills_the_free_ranks_of_the_last_over_budget_step():
    lens = np.random.default_rng(1).integers(1, 200, 3000)
    lens[:43] = np.repeat([9000, 7000, 5000], [16, 24, 3])  # 5 steps of 8, then 3 with 5 free ranks
    bss = _batch_ranks(lens, 8, max_complexity=2000, mode="packed")
    outs = [list(b) for b in bss]
    assert sorted(i for o in outs for b in o for i in b) == list(range(3000))
    per_step = _over_budget_steps(outs, lens, 2000)
    assert sorted(x for x in per_step if x) == [3, 8, 8, 8, 8, 8]
    last = list(zip(*outs))[per_step.index(3)]
    free = [lens[b].sum() for b in last if lens[b].max() <= 2000]
    assert len(free) == 5 and all(2000 - 200 < f <= 2000 for f in free)  # filled up to the budget
    # neighbours in cost share a step (here each step's are of one cost)
    for step in zip(*outs):
        assert len({int(lens[b].max()) for b in step if lens[b].max() > 2000}) <= 1
    assert bss[0].plan_stats()["straggler_mean"] <= 1.05


def test_packed_balances_the_quadratic_cost_model():
    lens = _lens(20000, 10, hi=500).astype(float)
    bs = _batch_ranks(lens, 8, max_complexity=4e6, mode="packed", cost=(0.0, 1.0))[0]
    st = bs.plan_stats()
    assert st["straggler_len2_mean"] < 1.01
    assert st["max_batch_cost"] <= 4e6


def test_padded_mode_wastes_little():
    lens = _lens(20000, 11, hi=200)
    st = _batch_ranks(lens, 4, max_complexity=4096)[0].plan_stats()
    assert st["padding_waste"] < 0.01
    assert st["max_batch_cost_ratio"] <= 1.0


@pytest.mark.parametrize("mode", ["padded", "packed"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_tiny_dataset_tail(mode, drop_last):
    lens = [5, 4, 3]
    bss = _batch_ranks(lens, 2 if drop_last else 5, max_complexity=100, mode=mode, drop_last=drop_last)
    outs = [list(b) for b in bss]
    assert len({len(o) for o in outs}) == 1
    assert all(len(b) > 0 for o in outs for b in o)
    st = bss[0].plan_stats()
    flat = [i for o in outs for b in o for i in b]
    assert len(flat) == 3 + st["duplicates"] - st["dropped"]
    if not drop_last:
        assert set(flat) == {0, 1, 2} and st["duplicates"] == 2


def test_batch_fn_mode_equalises_batch_counts():
    lens = _lens(50, 12)

    def batch_fn(indices):  # uneven on purpose: Bagua yielded [2, 4] batches here and hung DDP
        size = 3 if indices[0] % 2 else 5
        return [indices[i : i + size] for i in range(0, len(indices), size)]

    for drop_last in (False, True):
        outs = [list(b) for b in _batch_ranks(lens, 3, batch_fn=batch_fn, drop_last=drop_last)]
        assert len({len(o) for o in outs}) == 1


def test_set_epoch_on_batch_sampler_reshuffles_steps():
    bss = _batch_ranks(_lens(2000, 13), 2, max_complexity=1500)
    a = [list(bs) for bs in bss]
    for bs in bss:
        bs.set_epoch(1)
    assert bss[0].sampler.epoch == 1
    b = [list(bs) for bs in bss]
    assert a[0] != b[0]
    assert (
        sorted(i for o in a for x in o for i in x)
        == sorted(i for o in b for x in o for i in x)
        == list(range(2000))
    )


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_batch_resume_equals_uninterrupted(mode):
    lens = _lens(3000, 14)
    ref_bs = _batch_ranks(lens, 4, max_complexity=2000, mode=mode)[2]
    ref_bs.set_epoch(3)
    ref = list(ref_bs)
    bs = _batch_ranks(lens, 4, max_complexity=2000, mode=mode)[2]
    bs.set_epoch(3)
    it = iter(bs)
    head = [next(it) for _ in range(7)]
    state = bs.state_dict()
    assert (state["epoch"], state["consumed"]) == (3, 7)
    new = _batch_ranks(lens, 4, max_complexity=2000, mode=mode)[2]
    new.load_state_dict(state)
    new.set_epoch(3)  # a resume loop calls set_epoch(start_epoch) again: the position is kept
    assert len(new) == len(ref) - 7
    assert head + list(new) == ref
    new.set_epoch(4)
    assert len(new) == len(list(new))


@pytest.mark.parametrize("tracked", [False, True])
@pytest.mark.parametrize("via", ["batch sampler", "wrapped sampler"])
def test_batch_state_taken_after_set_epoch_starts_that_epoch(via, tracked):
    # A checkpoint at the start of epoch 1 (set_epoch called, nothing iterated yet) used to carry
    # epoch 0's batch count as epoch 1's "consumed": the resumed run skipped the whole epoch.
    lens = _lens(200, 40, hi=60)

    def make():
        return _batch_ranks(lens, 2, max_complexity=300, skw={"seed": 1})[0]

    bs = make()
    for epoch in range(2):
        (bs if via == "batch sampler" else bs.sampler).set_epoch(epoch)
        if epoch == 1:
            state = bs.state_dict()
        if tracked:
            list(bs.track(torch.utils.data.DataLoader(range(200), batch_sampler=bs)))
        else:
            epoch_1 = list(bs)
    if tracked:
        ref = make()
        ref.set_epoch(1)
        epoch_1 = list(ref)
    assert (state["epoch"], state["consumed"]) == (1, 0)
    new = make()
    new.load_state_dict(state)
    assert new.state_dict()["consumed"] == 0
    assert len(new) == len(epoch_1) > 0
    assert list(new) == epoch_1


def test_batch_state_right_after_load_state_dict_is_the_loaded_one():
    lens = _lens(500, 41)
    bs = _batch_ranks(lens, 2, max_complexity=900)[1]
    bs.set_epoch(2)
    it = iter(bs)
    for _ in range(3):
        next(it)
    state = bs.state_dict()
    new = _batch_ranks(lens, 2, max_complexity=900)[1]
    new.load_state_dict(state)
    assert new.state_dict() == state


# --------------------------------------------------------------------------- bad input
def test_empty_dataset():
    with pytest.raises(ConfigError, match=r"the dataset is empty \(0 samples\); there is nothing to sample"):
        LoadBalancingDistributedSampler(None, complexities=[])


def test_world_larger_than_dataset_with_drop_last():
    with pytest.raises(
        ConfigError, match=r"num_replicas=4 is larger than the dataset \(3 samples\) and drop_last=True"
    ):
        LoadBalancingDistributedSampler(None, complexities=[1, 2, 3], num_replicas=4, rank=0, drop_last=True)
    s = LoadBalancingDistributedSampler(None, complexities=[1, 2, 3], num_replicas=4, rank=0)
    with pytest.raises(
        ConfigError, match=r"num_replicas=4 is larger than the dataset \(3 samples\) and drop_last"
    ):
        LoadBalancingDistributedBatchSampler(s, max_complexity=10, drop_last=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_complexities_name_the_first_index(bad):
    c = [1.0, 2.0, 3.0, bad, bad]
    with pytest.raises(
        ConfigError, match=rf"complexities\[3\] is {re.escape(repr(bad))}; every complexity must be a finite"
    ):
        LoadBalancingDistributedSampler(None, complexities=c)


@pytest.mark.parametrize(
    "make",
    [
        lambda v: np.array(v, dtype=np.float32),
        lambda v: np.array(v, dtype=np.float16),
        lambda v: torch.tensor(v, dtype=torch.float32),
        lambda v: torch.tensor(v, dtype=torch.bfloat16),
    ],
    ids=["numpy-float32", "numpy-float16", "torch-float32", "torch-bfloat16"],
)
def test_non_finite_complexities_of_every_float_dtype_name_the_first_index(make):
    with pytest.raises(ConfigError, match=r"complexities\[2\] is inf; every complexity must be a finite"):
        LoadBalancingDistributedSampler(None, complexities=make([1.0, 2.0, float("inf"), 3.0]))
    ok = LoadBalancingDistributedSampler(None, complexities=make([1.5, 3.0, 2.0]), shuffle=False)
    assert ok.complexities.dtype == np.float64 and list(ok) == [0, 2, 1]


def test_integer_complexities_of_every_width_are_accepted():
    for dt in (np.int8, np.uint16, np.int32, np.int64, np.uint64):
        s = LoadBalancingDistributedSampler(None, complexities=np.array([5, 1, 3], dtype=dt), shuffle=False)
        assert list(s) == [1, 2, 0]
    t = LoadBalancingDistributedSampler(
        None, complexities=torch.tensor([5, 1, 3], dtype=torch.uint8), shuffle=False
    )
    assert list(t) == [1, 2, 0]


def test_negative_complexities_ok_for_plain_sampler_error_in_budget_mode():
    s = LoadBalancingDistributedSampler(
        None, complexities=[3, -1, 2, -5], num_replicas=2, rank=0, shuffle=False
    )
    assert list(s) == [3, 2]  # sorted: -5, -1 | 2, 3
    with pytest.raises(ConfigError, match=r"complexities\[1\] = -1.0 is negative; budget mode"):
        LoadBalancingDistributedBatchSampler(s, max_complexity=10)
    LoadBalancingDistributedBatchSampler(s, batch_fn=lambda idx: [idx])  # batch_fn mode: order only


def test_complexity_fn_that_raises_names_the_index():
    ds = list(range(5))

    def fn(x):
        if x == 3:
            raise KeyError("no length")
        return x

    with pytest.raises(ConfigError, match=r"complexity_fn raised KeyError at index 3: 'no length'"):
        LoadBalancingDistributedSampler(ds, complexity_fn=fn)


@pytest.mark.parametrize("value, name", [("7", "str"), (None, "NoneType"), ([1], "list"), (True, "bool")])
def test_complexity_fn_non_number_names_index_and_type(value, name):
    ds = list(range(4))
    with pytest.raises(
        ConfigError, match=rf"complexity_fn returned {name} at index 2; it must return a real number"
    ):
        LoadBalancingDistributedSampler(ds, complexity_fn=lambda x: value if x == 2 else 1)


def test_complexities_beyond_int64_and_zero_d_arrays_are_numbers():
    """numpy makes an object array of Python ints beyond int64, and complexity_fn may return a 0-d
    array: both used to be refused ("got dtype object", "returned ndarray") though complexity_fn's
    ints and 0-d tensors were accepted."""
    big = [2**64 + 3, 2**64 + 1, 2**65, 5]
    want = np.array(big, dtype=np.float64)
    got = LoadBalancingDistributedSampler(None, complexities=big, num_replicas=2, rank=0)
    assert np.array_equal(got.complexities, want)
    assert np.array_equal(
        LoadBalancingDistributedSampler(big, complexity_fn=lambda x: x, num_replicas=2, rank=0).complexities,
        want,
    )
    s = LoadBalancingDistributedSampler([3, 1, 2], complexity_fn=np.array, num_replicas=1, rank=0)
    assert s.complexities.tolist() == [3.0, 1.0, 2.0]
    with pytest.raises(ConfigError, match=r"complexity_fn returned bool at index 0; it must return a real"):
        LoadBalancingDistributedSampler([True], complexity_fn=np.array, num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match=r"complexities hold an int too large for a float64$"):
        LoadBalancingDistributedSampler(None, complexities=[10**400, 1], num_replicas=1, rank=0)
    with pytest.raises(
        ConfigError, match=r"complexities\[1\] is NoneType; complexities must be real numbers$"
    ):
        LoadBalancingDistributedSampler(None, complexities=[2**70, None], num_replicas=1, rank=0)
    with pytest.raises(
        ConfigError,
        match=r"complexities must be a sequence or an array with one number per sample, got the iterator "
        r"generator; pass list\(\.\.\.\) of it$",
    ):
        LoadBalancingDistributedSampler(None, complexities=(x for x in [3, 1, 2]), num_replicas=1, rank=0)


@pytest.mark.parametrize("rank", [-1, 4, 9])
def test_rank_outside_range(rank):
    with pytest.raises(ConfigError, match=rf"rank {rank} is outside \[0, 4\) for num_replicas=4"):
        LoadBalancingDistributedSampler(None, complexities=[1, 2], num_replicas=4, rank=rank)


def test_bad_num_replicas_and_arguments():
    with pytest.raises(ConfigError, match="num_replicas must be an integer >= 1, got 0"):
        LoadBalancingDistributedSampler(None, complexities=[1], num_replicas=0, rank=0)
    with pytest.raises(ConfigError, match="pass complexity_fn or complexities, not both"):
        LoadBalancingDistributedSampler([1], complexity_fn=len, complexities=[1])
    with pytest.raises(ConfigError, match="pass complexities="):
        LoadBalancingDistributedSampler([1])
    with pytest.raises(ConfigError, match=r"complexities has 2 entries but the dataset has 3 samples"):
        LoadBalancingDistributedSampler([1, 2, 3], complexities=[1, 2])
    with pytest.raises(
        ConfigError, match=r"complexities must be 1-D \(one number per sample\), got shape \(2, 2\)"
    ):
        LoadBalancingDistributedSampler(None, complexities=[[1, 2], [3, 4]])
    with pytest.raises(ConfigError, match=r"random_level must be in \[0, 1\], got 2"):
        LoadBalancingDistributedSampler(None, complexities=[1], random_level=2)
    for level in (True, "0.5", None):  # a bool is not a level (it used to be read as 1.0)
        with pytest.raises(ConfigError, match=rf"random_level must be in \[0, 1\], got {level!r}$"):
            LoadBalancingDistributedSampler(None, complexities=[1], random_level=level)
    with pytest.raises(ConfigError, match="complexities must be a 1-D array of real numbers, got dtype <U1"):
        LoadBalancingDistributedSampler(None, complexities=["a"])


def test_number_arguments_take_0d_tensors_and_refuse_bools_alike():
    # random_level and num_replicas refused 0-d tensors that seed= and max_complexity= take;
    # complexities=[1, True] was read as [1, 1] while [True, True] and complexity_fn's True were
    # refused.
    s = LoadBalancingDistributedSampler(
        None,
        complexities=[3, 1, 2],
        num_replicas=torch.tensor(2),
        rank=np.int64(1),
        random_level=torch.tensor(0.5),
    )
    assert (s.num_replicas, s.rank, s.random_level) == (2, 1, 0.5)
    assert type(s.num_replicas) is int and type(s.rank) is int
    assert (
        LoadBalancingDistributedSampler(None, complexities=[1], random_level=np.array(0.25)).random_level
        == 0.25
    )
    for level in (torch.tensor(True), torch.tensor(1.5)):
        with pytest.raises(ConfigError) as info:
            LoadBalancingDistributedSampler(None, complexities=[1], random_level=level)
        assert (
            str(info.value)
            == f"LoadBalancingDistributedSampler: random_level must be in [0, 1], got {level!r}"
        )
    with pytest.raises(ConfigError) as info:
        LoadBalancingDistributedSampler(None, complexities=[1], num_replicas=torch.tensor(True), rank=0)
    assert str(info.value) == (
        "LoadBalancingDistributedSampler: num_replicas must be an integer >= 1, got tensor(True)"
    )
    with pytest.raises(ConfigError) as info:
        LoadBalancingDistributedSampler(None, complexities=[1], seed=torch.tensor(True))
    assert str(info.value) == "LoadBalancingDistributedSampler: seed must be an integer, got tensor(True)"
    for values, i in (([1, True], 1), ((2.5, 4, False), 2)):
        with pytest.raises(ConfigError) as info:
            LoadBalancingDistributedSampler(None, complexities=values)
        assert str(info.value) == (
            f"LoadBalancingDistributedSampler: complexities[{i}] is bool; complexities must be real numbers"
        )


def test_cost_and_mode_arguments_are_checked():
    s = LoadBalancingDistributedSampler(None, complexities=[1, 2, 3])
    who = "LoadBalancingDistributedBatchSampler"
    for cost in ("12", b"12", (True, 0), (1, "2"), np.array(1.0)):  # "12" was read as (1.0, 2.0)
        with pytest.raises(ConfigError) as info:
            LoadBalancingDistributedBatchSampler(s, max_complexity=3, cost=cost)
        assert str(info.value) == f"{who}: cost must be a pair (a, b) of numbers, got {cost!r}"
    b = LoadBalancingDistributedBatchSampler(s, max_complexity=3, cost=(torch.tensor(0.5), np.float32(2)))
    assert b.cost == (0.5, 2.0)
    # mode= and cost= with batch_fn were ignored without a word; their defaults pass.
    for kw, given in (
        ({"mode": "packed", "cost": (0, 1)}, "mode='packed', cost=(0, 1)"),
        ({"mode": "packed"}, "mode='packed'"),
        ({"cost": [2.0, 0.0]}, "cost=[2.0, 0.0]"),
    ):
        with pytest.raises(ConfigError) as info:
            LoadBalancingDistributedBatchSampler(s, batch_fn=_threes, **kw)
        assert str(info.value) == (
            f"{who}: {given} given with batch_fn; mode= and cost= are for budget mode (max_complexity=), "
            "batch_fn makes its own batches"
        )
    b = LoadBalancingDistributedBatchSampler(s, _threes, False, None, "padded", (1, 0))  # Bagua's order
    assert b.mode == "batch_fn" and sorted(i for x in b for i in x) == [0, 1, 2]


def test_a_state_whose_cost_is_a_tuple_loads():
    # state_dict() saves cost as a list; a tuple (a state built or kept as Python objects) was
    # refused as "saved with cost=(1.0, 0.0), this batch sampler has [1.0, 0.0]".
    bs = _batch_ranks(_lens(100, 47), 4, max_complexity=500)[0]
    state = dict(bs.state_dict(consumed=2), cost=(1.0, 0.0))
    bs.load_state_dict(state)
    assert len(bs) == len(_batch_ranks(_lens(100, 47), 4, max_complexity=500)[0]) - 2
    with pytest.raises(ConfigError) as info:
        bs.load_state_dict(dict(state, cost=(0.0, 1.0)))
    assert str(info.value) == (
        "load_state_dict: the state was saved with cost=(0.0, 1.0), this batch sampler has [1.0, 0.0]; "
        "the resumed batches would differ"
    )


def test_bad_batch_sampler_arguments():
    s = LoadBalancingDistributedSampler(None, complexities=[1, 2, 3])
    with pytest.raises(ConfigError, match="pass max_complexity= .budget per rank per step. or batch_fn="):
        LoadBalancingDistributedBatchSampler(s)
    with pytest.raises(ConfigError, match="pass batch_fn or max_complexity, not both"):
        LoadBalancingDistributedBatchSampler(s, batch_fn=lambda i: [i], max_complexity=3)
    with pytest.raises(ConfigError, match=r"mode must be one of \('padded', 'packed'\), got 'pad'"):
        LoadBalancingDistributedBatchSampler(s, max_complexity=3, mode="pad")
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="max_complexity must be finite and > 0"):
            LoadBalancingDistributedBatchSampler(s, max_complexity=bad)
    with pytest.raises(ConfigError, match=r"cost=\(a, b\) needs finite a >= 0 and b >= 0, not both 0"):
        LoadBalancingDistributedBatchSampler(s, max_complexity=3, cost=(0, 0))
    with pytest.raises(ConfigError, match=r"cost=\(a, b\) needs finite a >= 0 and b >= 0"):
        LoadBalancingDistributedBatchSampler(s, max_complexity=3, cost=(1, -1))
    with pytest.raises(ConfigError, match="sampler must be a LoadBalancingDistributedSampler, got list"):
        LoadBalancingDistributedBatchSampler([1, 2], max_complexity=3)


def test_batch_fn_empty_or_out_of_range_batches():
    s = LoadBalancingDistributedSampler(None, complexities=list(range(10)), num_replicas=2, rank=0)
    with pytest.raises(
        ConfigError, match=r"batch_fn returned an empty or malformed batch \(batch 1, rank 0\): \[\]"
    ):
        list(LoadBalancingDistributedBatchSampler(s, batch_fn=lambda idx: [idx, []]))
    with pytest.raises(
        ConfigError, match=r"batch_fn returned index 99 \(batch 0, rank 0\) that is not among the 5"
    ):
        list(LoadBalancingDistributedBatchSampler(s, batch_fn=lambda idx: [idx + [99]]))
    with pytest.raises(ConfigError, match=r"batch_fn returned index -1 \(batch 0, rank 0\)"):
        list(LoadBalancingDistributedBatchSampler(s, batch_fn=lambda idx: [[-1]]))
    other = LoadBalancingDistributedSampler(None, complexities=list(range(10)), num_replicas=2, rank=1)
    theirs = other.rank_indices(1)[0]  # in range, but another rank's index
    with pytest.raises(
        ConfigError, match=rf"batch_fn returned index {theirs} \(batch 0, rank 0\) that is not among"
    ):
        list(LoadBalancingDistributedBatchSampler(s, batch_fn=lambda idx: [[int(theirs)]]))
    with pytest.raises(ConfigError, match="batch_fn returned no batches for rank 0"):
        len(LoadBalancingDistributedBatchSampler(s, batch_fn=lambda idx: []))


def test_load_state_dict_rejects_other_world_dataset_or_config():
    lens = _lens(100, 15)
    state = _batch_ranks(lens, 4, max_complexity=500)[0].state_dict()
    with pytest.raises(
        ConfigError, match="saved with num_replicas=4, this sampler has num_replicas=2; resuming needs"
    ):
        _batch_ranks(lens, 2, max_complexity=500)[0].load_state_dict(state)
    other = lens.copy()
    other[0] += 1
    with pytest.raises(ConfigError, match=r"saved for another dataset \(100 samples, complexities digest"):
        _batch_ranks(other, 4, max_complexity=500)[0].load_state_dict(state)
    with pytest.raises(ConfigError, match=r"saved with mode='padded', this batch sampler has 'packed'"):
        _batch_ranks(lens, 4, max_complexity=500, mode="packed")[0].load_state_dict(state)
    with pytest.raises(ConfigError, match="the state is a LoadBalancingDistributedBatchSampler's, not a"):
        _ranks(lens, 4)[0].load_state_dict(state)
    with pytest.raises(ConfigError, match=r"the state lacks \['kind'"):
        _ranks(lens, 4)[0].load_state_dict({})
    with pytest.raises(ConfigError, match=r"state_dict: consumed=999 is outside \[0, "):
        _batch_ranks(lens, 4, max_complexity=500)[0].state_dict(consumed=999)


def test_a_launcher_world_without_an_initialized_group_raises(monkeypatch):
    # Under torchrun, a sampler built before init_process_group used to plan as rank 0 of 1 in
    # every process: each rank trained on the whole dataset.
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "4")
    msg = (
        "LoadBalancingDistributedSampler: torch.distributed is not initialized while WORLD_SIZE=4 is set "
        "(a launcher started this process); call torch.distributed.init_process_group() before building "
        "the sampler, or pass num_replicas= and rank="
    )
    for kw in ({}, {"num_replicas": 4}, {"rank": 1}):
        with pytest.raises(ConfigError) as info:
            LoadBalancingDistributedSampler(None, complexities=[3, 1, 2], **kw)
        assert str(info.value) == msg
    s = LoadBalancingDistributedSampler(None, complexities=[3, 1, 2], num_replicas=4, rank=1)
    assert (s.num_replicas, s.rank) == (4, 1)
    for value in ("1", "", "x"):  # one process, or no launcher: the documented 1 and 0
        monkeypatch.setenv("WORLD_SIZE", value)
        s = LoadBalancingDistributedSampler(None, complexities=[3, 1, 2])
        assert (s.num_replicas, s.rank) == (1, 0)


def test_defaults_come_from_an_initialized_process_group(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")  # what a launcher of one process sets
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        s = LoadBalancingDistributedSampler(None, complexities=[1, 2, 3])
        assert (s.num_replicas, s.rank) == (1, 0)
        with pytest.raises(ConfigError, match=r"rank 1 is outside \[0, 1\) for num_replicas=1"):
            LoadBalancingDistributedSampler(None, complexities=[1, 2, 3], rank=1)
    finally:
        torch.distributed.destroy_process_group()


def test_planning_releases_the_gil():
    import threading

    runs = P.key_runs(np.sort(_lens(1_000_000, 30).astype(np.float64))[::-1].copy())
    count = 0
    stop = threading.Event()

    def spin():
        nonlocal count
        while not stop.is_set():
            count += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        during = []
        for _ in range(6):  # several calls: on a loaded machine the spinner may miss one
            before = count
            P.packed_plan(*runs, 8, 2000.0, 400, 1)
            during.append(count - before)
    finally:
        stop.set()
        t.join()
    # With the GIL held for the whole call the spinner could not run at all inside it.
    assert max(during) > 100, during


# --------------------------------------------------------------------------- bad input: types
@pytest.mark.parametrize("seed", [None, "a", 1.5, True])
def test_seed_must_be_an_integer(seed):
    with pytest.raises(
        ConfigError,
        match=rf"LoadBalancingDistributedSampler: seed must be an integer, got {re.escape(repr(seed))}$",
    ):
        LoadBalancingDistributedSampler(None, complexities=[1, 2], num_replicas=1, rank=0, seed=seed)


def test_integer_arguments_accept_numpy_and_tensor_integers():
    s = LoadBalancingDistributedSampler(
        None, complexities=[3, 1, 2], num_replicas=2, rank=0, seed=np.int64(4)
    )
    s.set_epoch(torch.tensor(2))
    assert s.epoch == 2 and type(s.epoch) is int
    assert list(s.rank_indices(np.int32(1))) == list(s.rank_indices(1))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: s.set_epoch(1.9), "set_epoch: epoch must be an integer, got 1.9"),
        (lambda s: s.set_epoch(None), "set_epoch: epoch must be an integer, got None"),
        (lambda s: s.rank_indices("1"), "rank_indices: rank must be an integer, got '1'"),
        (lambda s: s.rank_indices(0, epoch=0.5), "rank_indices: epoch must be an integer, got 0.5"),
        (lambda s: s.plan_stats("2"), "plan_stats: batch_size must be an integer, got '2'"),
        (lambda s: s.plan_stats(2.5), "plan_stats: batch_size must be an integer, got 2.5"),
        (lambda s: s.plan_stats(0), "plan_stats: batch_size must be >= 1, got 0"),
        (lambda s: s.state_dict(consumed="3"), "state_dict: consumed must be an integer, got '3'"),
    ],
)
def test_plain_sampler_integer_arguments(call, message):
    s = LoadBalancingDistributedSampler(None, complexities=_lens(20, 42), num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match=re.escape(message) + "$"):
        call(s)


def test_plan_stats_batch_larger_than_the_epoch_is_one_step():
    s = LoadBalancingDistributedSampler(None, complexities=_lens(20, 43), num_replicas=2, rank=0)
    assert s.plan_stats(10**30)["steps"] == s.plan_stats(10)["steps"] == 1


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("key", ["dataset_size", "seed", "shuffle", "drop_last", "mode", "random_level"])
def test_load_state_dict_names_a_missing_key(batch, key):
    lens = _lens(50, 44)
    obj = _batch_ranks(lens, 2, max_complexity=500)[0] if batch else _ranks(lens, 2)[0]
    state = obj.state_dict()
    if key not in state:
        return  # mode is the batch sampler's, random_level the plain sampler's
    del state[key]
    with pytest.raises(
        ConfigError,
        match=re.escape(f"load_state_dict: the state lacks ['{key}']; pass what state_dict() returned") + "$",
    ):
        obj.load_state_dict(state)


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize(
    "key, value",
    [
        ("epoch", "abc"),
        ("consumed", None),
        ("seed", 1.5),
        # These were compared as they were: num_replicas="4" gave "the state was saved with
        # num_replicas=4, this sampler has num_replicas=4".
        ("num_replicas", "2"),
        ("num_replicas", 2.0),
        ("dataset_size", "50"),
        ("seed", torch.tensor(True)),
    ],
)
def test_load_state_dict_rejects_fields_of_the_wrong_type_as_malformed(batch, key, value):
    lens = _lens(50, 45)
    obj = _batch_ranks(lens, 2, max_complexity=500)[0] if batch else _ranks(lens, 2)[0]
    state = obj.state_dict()
    state[key] = value
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"load_state_dict: the state is malformed: its {key} must be an integer, got {value!r}"
        )
        + "$",
    ):
        obj.load_state_dict(state)
    state[key] = np.int64(obj.state_dict()[key])  # numpy integers (a state kept in an array) load
    obj.load_state_dict(state)


def _threes(indices):
    return [indices[i : i + 3] for i in range(0, len(indices), 3)]


@pytest.mark.parametrize(
    "key, saved, mine, message",
    [
        ("random_level", 0.0, 1.0, "random_level=0.0, the wrapped sampler has 1.0"),
        ("drop_last", False, True, "sampler_drop_last=False, the wrapped sampler has True"),
    ],
)
def test_batch_fn_state_checks_the_wrapped_samplers_configuration(key, saved, mine, message, caplog):
    # batch_fn is given the wrapped sampler's streams: another random_level or drop_last there
    # resumed into other batches without a word.
    lens = list(range(1, 101))
    bs = _batch_ranks(lens, 4, skw={key: saved}, batch_fn=_threes)[0]
    bs.set_epoch(1)
    it = iter(bs)
    next(it), next(it)
    state = bs.state_dict()
    other = _batch_ranks(lens, 4, skw={key: mine}, batch_fn=_threes)[0]
    with pytest.raises(ConfigError) as info:
        other.load_state_dict(state)
    assert str(info.value) == (
        f"load_state_dict: the state was saved with {message}; the resumed order would differ"
    )
    rest = list(it)
    same = _batch_ranks(lens, 4, skw={key: saved}, batch_fn=_threes)[0]
    same.load_state_dict(state)
    assert list(same) == rest
    # A state saved before these keys were recorded loads unchecked, with a warning.
    del state["random_level"], state["sampler_drop_last"]
    old = _batch_ranks(lens, 4, skw={key: saved}, batch_fn=_threes)[0]
    with caplog.at_level(logging.WARNING, logger="trainloom.data"):
        old.load_state_dict(state)
    assert [r.getMessage() for r in caplog.records] == [
        "LoadBalancingDistributedBatchSampler.load_state_dict: the state has no ['random_level', "
        "'sampler_drop_last'] (saved by an earlier trainloom); not checked against the wrapped sampler's"
    ]
    assert list(old) == rest


@pytest.mark.parametrize("sampler_drop_last", [False, True])
def test_batch_fn_plan_stats_count_the_wrapped_samplers_padding_and_drops(sampler_drop_last):
    # 5 samples on 2 ranks: the wrapped sampler repeats one (or leaves one out), which
    # plan_stats() used to leave out of duplicates (dropped).
    lens = [5, 1, 9, 3, 7]
    bss = _batch_ranks(lens, 2, skw={"drop_last": sampler_drop_last}, batch_fn=lambda ix: [[i] for i in ix])
    yielded = [i for bs in bss for b in bs for i in b]
    st = bss[0].plan_stats()
    assert (st["duplicates"], st["dropped"]) == ((0, 1) if sampler_drop_last else (1, 0))
    assert len(yielded) == 5 + st["duplicates"] - st["dropped"]
    assert len(set(yielded)) == 5 - st["dropped"]


def test_a_batch_state_loaded_into_a_plain_sampler_names_the_kind():
    lens = _lens(50, 46)
    state = _batch_ranks(lens, 2, max_complexity=500)[0].state_dict()
    with pytest.raises(
        ConfigError,
        match=r"load_state_dict: the state is a LoadBalancingDistributedBatchSampler's, not a "
        r"LoadBalancingDistributedSampler's$",
    ):
        _ranks(lens, 2)[0].load_state_dict(state)


def test_complexity_fn_returning_an_int_too_large_for_float64():
    with pytest.raises(
        ConfigError,
        match=r"LoadBalancingDistributedSampler: complexity_fn returned int 10000000000000000000\.\.\. "
        r"at index 1, too large for a float64$",
    ):
        LoadBalancingDistributedSampler(
            [1, 2, 3], complexity_fn=lambda x: 10**400 if x == 2 else x, num_replicas=1, rank=0
        )


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_budget_costs_that_overflow_float64(mode):
    s = LoadBalancingDistributedSampler(None, complexities=[1.0, 1e200, 2.0], num_replicas=1, rank=0)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "LoadBalancingDistributedBatchSampler: the cost 1 * len + 1 * len**2 of complexities[1] = 1e+200 "
            "overflows float64; scale the complexities (and max_complexity) down"
        )
        + "$",
    ):
        LoadBalancingDistributedBatchSampler(s, max_complexity=1e300, mode=mode, cost=(1, 1))
    s = LoadBalancingDistributedSampler(None, complexities=[1e308] * 6, num_replicas=2, rank=0)
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "LoadBalancingDistributedBatchSampler: max_complexity=1.5e+308 is too large: the plan's total "
            "cost (6 samples) overflows float64; scale the complexities and max_complexity down"
        )
        + "$",
    ):
        LoadBalancingDistributedBatchSampler(s, max_complexity=1.5e308, mode=mode)


def test_packed_plan_with_a_mean_cost_that_underflows():
    # eff / n rounds to 0.0 here (5e-324 / 2): the step sizing must not divide by it.
    s = LoadBalancingDistributedSampler(None, complexities=[5e-324, 0.0], num_replicas=1, rank=0)
    bs = LoadBalancingDistributedBatchSampler(s, max_complexity=1.0, mode="packed")
    assert sorted(i for b in bs for i in b) == [0, 1]


def test_random_level_over_the_whole_float64_range_is_a_permutation():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = [list(s) for s in _ranks([1e308, 1e308, -1e308, 0.0], 2, random_level=0.5)]
    assert sorted(outs[0] + outs[1]) == [0, 1, 2, 3]


def test_batch_fn_that_raises_names_the_rank():
    def batch_fn(indices):
        return [[indices[0]]] if len(indices) < 3 else 1 / 0

    s = LoadBalancingDistributedSampler(None, complexities=_lens(5, 47), num_replicas=2, rank=0)
    with pytest.raises(
        ConfigError, match=r"batch_fn raised ZeroDivisionError on rank 0's 3 indices: division by zero$"
    ):
        list(LoadBalancingDistributedBatchSampler(s, batch_fn=batch_fn))


def test_batch_fn_returning_a_ragged_batch():
    s = LoadBalancingDistributedSampler(None, complexities=_lens(6, 48), num_replicas=2, rank=0)
    with pytest.raises(
        ConfigError,
        match=r"batch_fn returned an empty or malformed batch \(batch 0, rank 0\): \[\d+, \[\d+\]\]; every "
        r"batch must be a non-empty list of indices$",
    ):
        list(LoadBalancingDistributedBatchSampler(s, batch_fn=lambda idx: [[idx[0], [idx[1]]]]))
    # an object array (numpy < 1.24 makes one of a ragged batch, with a warning; None does on any)
    with pytest.raises(
        ConfigError,
        match=r"batch_fn returned an empty or malformed batch \(batch 0, rank 0\): \[\d+, None\]; ",
    ):
        list(LoadBalancingDistributedBatchSampler(s, batch_fn=lambda idx: [[idx[0], None]]))
    with pytest.raises(
        ConfigError, match=r"^batch_fn returned non-integer indices \(batch 0, rank 0\): \[1.0, 2.0\]$"
    ):
        list(LoadBalancingDistributedBatchSampler(s, batch_fn=lambda idx: [[1.0, 2.0]]))
