"""Packed mode's fill of the free ranks of the last over-budget step (_partition.packed_fill).

The fill ran in Python, one iteration per run of equal costs, until it moved into the compiled
core; these tests hold the kernel to that loop (kept here as the oracle, float rounding included)
and pin the plans it gives."""

from __future__ import annotations

import numpy as np
import pytest

from trainloom.data import samplers as S
from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

P = S._P


def _fill_ref(rc, re, p, budget, slots):
    """The Python loop packed_fill replaced (as it was in _packed_over_budget): (ends, position)."""
    n = int(re[-1])
    r = 0
    fill = []
    while len(fill) < slots and p < n:  # a free rank: items from p while they fit
        load = 0.0
        while p < n:
            while re[r] <= p:
                r += 1
            c, avail = float(rc[r]), int(re[r]) - p
            take = avail if c <= 0.0 or (budget - load) / c >= avail else int((budget - load) // c)
            while take > 0 and load + take * c > budget:
                take -= 1
            load += take * c
            p += take
            if take < avail:
                break  # the next item does not fit this rank
        fill.append(p)
    return fill + [p] * (slots - len(fill)), p


def _fill_items(costs, p, budget, slots):
    """The fill item by item: each rank takes the next items while its total stays <= budget."""
    ends = []
    for _ in range(slots):
        load = 0
        while p < len(costs) and load + costs[p] <= budget:
            load += costs[p]
            p += 1
        ends.append(p)
    return ends


def _fill(rc, re, p, budget, slots):
    fill = np.full(slots, -1, dtype=np.int64)
    q = P.packed_fill(np.asarray(rc, dtype=np.float64), np.asarray(re, dtype=np.int64), p, budget, fill)
    return fill.tolist(), q


@pytest.mark.parametrize(
    "rc, re, p, budget, slots, ends",
    [
        ([5.0, 3.0, 1.0], [2, 5, 9], 0, 10.0, 3, [2, 6, 9]),
        ([2.0], [3], 0, 4.0, 4, [2, 3, 3, 3]),  # the items run out: the last ranks stay empty
        ([3.0, 0.0], [2, 5], 0, 4.0, 2, [1, 5]),  # zero-cost items all go to the rank that reaches them
        ([9.0, 3.0], [1, 4], 1, 6.0, 1, [3]),  # from p: the item over the budget is not walked
        ([0.1], [100], 0, 1.0, 3, [9, 18, 27]),  # 1.0 // 0.1 is 9.0 in Python, as floor(1.0 / 0.1) is not
        ([1.0], [5], 5, 3.0, 2, [5, 5]),  # nothing left from p
    ],
)
def test_packed_fill_pinned(rc, re, p, budget, slots, ends):
    assert _fill(rc, re, p, budget, slots) == (ends, ends[-1])
    assert _fill_ref(np.array(rc), np.array(re), p, budget, slots) == (ends, ends[-1])


def test_packed_fill_with_no_ranks_returns_p():
    assert _fill([2.0, 1.0], [3, 6], 4, 10.0, 0) == ([], 4)


def test_packed_fill_matches_an_item_by_item_fill_on_integer_costs():
    rng = np.random.default_rng(0)
    for _ in range(300):
        costs = np.sort(rng.integers(0, 12, int(rng.integers(1, 60))))[::-1]
        rc, re = P.key_runs(costs.astype(np.float64))
        budget = int(rng.integers(max(1, int(costs[0])), 40))
        p, slots = int(rng.integers(0, costs.shape[0] + 1)), int(rng.integers(1, 8))
        ends = _fill_items(costs.tolist(), p, budget, slots)
        assert _fill(rc, re, p, float(budget), slots) == (ends, ends[-1])


# Costs whose quotients round: 0.1-style decimals, thirds, subnormals, zeros, and uniform floats.
_POOLS = [
    [0.1, 0.2, 0.3, 0.7, 1 / 3, 2 / 7, 0.01, 1.1, 0.0, 5e-324, 1e-300, 3.0, 7.0],
    list(np.random.default_rng(1).uniform(0, 1, 40)),
    list(np.random.default_rng(2).uniform(0, 1e6, 40)),
]


@pytest.mark.parametrize("pool", range(len(_POOLS)))
def test_packed_fill_matches_the_python_loop_bit_for_bit(pool):
    rng = np.random.default_rng(10 + pool)
    for t in range(3000):
        rc = np.unique(rng.choice(_POOLS[pool], int(rng.integers(1, 25))))[::-1].copy()
        re = np.cumsum(rng.integers(1, [3, 30, 500][t % 3], rc.shape[0])).astype(np.int64)
        if t % 2:
            budget = float(rng.choice([0.1, 0.3, 0.7, 1.0, 1.1, 3.3, 10.0, 1e-300, 0.0, 1e8]))
        else:
            budget = float(rng.uniform(0, 2 * rc[0] + 1e-9))
        p, slots = int(rng.integers(0, re[-1] + 1)), int(rng.integers(0, 9))
        assert _fill(rc, re, p, budget, slots) == _fill_ref(rc, re, p, budget, slots), (rc, re, p, budget)


def test_packed_fill_rounds_like_python_floor_division():
    # A rank whose room r and cost c give r // c != floor(r / c) (Python snaps (r - fmod(r, c)) / c);
    # the plan kept Python's count, and must keep it.
    rng = np.random.default_rng(3)
    seen = 0
    for _ in range(4000):
        c = float(rng.choice([0.1, 0.3, 0.7, 1 / 3, 0.6, 0.05]) * rng.choice([1.0, 10.0, 1e-3]))
        budget = float(rng.choice([1.0, 0.3, 0.7, 2.1, 3.3, 7.7]) * rng.choice([1.0, 10.0, 1e-3]))
        if c > budget:
            continue
        rc, re = np.array([c, c / 3]), np.array([int(rng.integers(1, 3000)), 4000], dtype=np.int64)
        seen += budget / c < re[0] and budget // c != np.floor(budget / c)
        assert _fill(rc, re, 0, budget, 5) == _fill_ref(rc, re, 0, budget, 5), (c, budget)
    assert seen > 100


@pytest.mark.parametrize(
    "call, msg",
    [
        (
            lambda f: P.packed_fill(np.array([2.0, 1.0]), np.array([3]), 0, 4.0, f),
            "2 run costs but 1 run ends",
        ),
        (lambda f: P.packed_fill(np.zeros(0), np.zeros(0, dtype=np.int64), 0, 4.0, f), "no items"),
        (lambda f: P.packed_fill(np.array([1.0]), np.array([2**31]), 0, 4.0, f), "2147483648 items"),
        (lambda f: P.packed_fill(np.array([1.0]), np.array([3]), 4, 4.0, f), r"p=4 is outside \[0, 3\]"),
        (lambda f: P.packed_fill(np.array([1.0]), np.array([3]), -1, 4.0, f), r"p=-1 is outside"),
        (lambda f: P.packed_fill(np.array([1.0]), np.array([3]), 0, float("nan"), f), "budget=nan"),
        (lambda f: P.packed_fill(np.array([1.0]), np.array([3]), 0, float("inf"), f), "budget=inf"),
        (lambda f: P.packed_fill(np.array([1.0]), np.array([3]), 0, -1.0, f), "budget=-1.0"),
        (
            lambda f: P.packed_fill(np.array([2.0, 3.0]), np.array([1, 4]), 0, 9.0, f),
            "run 1 has cost 3.0; costs must be finite, >= 0 and non-increasing",
        ),
        (
            lambda f: P.packed_fill(np.array([2.0, 1.0, 1.0]), np.array([2, 1, 4]), 0, 9.0, f),
            "run 1 ends at 1; run ends must be positive and increasing",
        ),
        (
            lambda f: P.packed_fill(np.array([2.0, 1.0]), np.array([9, 4]), 0, 9.0, f),
            "run 0 ends at 9; run ends must be positive and increasing",
        ),
    ],
)
def test_packed_fill_guards(call, msg):
    with pytest.raises(ValueError, match=msg):
        call(np.empty(3, dtype=np.int64))


# --------------------------------------------------------------------------- through the sampler
def _batches(lens, world, budget):
    lens = np.asarray(lens, dtype=np.float64)
    samplers = [
        LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=world, rank=r, shuffle=False)
        for r in range(world)
    ]
    return [
        list(LoadBalancingDistributedBatchSampler(s, max_complexity=budget, mode="packed")) for s in samplers
    ]


@pytest.mark.parametrize(
    "lens, world, budget, want",
    [
        # 9 and 8 over the budget; the two free ranks take 3, then 3 + 2.
        ([9, 8, 3, 3, 2, 2, 1, 1, 1], 4, 5.0, [[[0], [5]], [[1], [6]], [[2], [8]], [[3, 4], [7]]]),
        # The free rank takes 9 items of 0.1 (1.0 // 0.1 == 9.0), as the Python fill did.
        (
            [0.1] * 30 + [1.5, 1.2],
            3,
            1.0,
            [
                [[30], [9, 13, 17, 18, 22, 26, 27]],
                [[31], [10, 14, 15, 19, 23, 24, 28]],
                [[0, 1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 16, 20, 21, 25, 29]],
            ],
        ),
        # 4 over the budget for 3 ranks: the last step's 2 free ranks take 2 + 2, then 2 + 1 + 0 + 0.
        ([7, 6, 6, 5, 0, 0, 2, 2, 2, 1], 3, 4.0, [[[0], [3]], [[1], [6, 7]], [[2], [8, 9, 4, 5]]]),
    ],
)
def test_packed_over_budget_plan_pinned(lens, world, budget, want):
    assert _batches(lens, world, budget) == want


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("kind", ["int", "float"])
def test_packed_over_budget_head_matches_the_python_fill(world, kind):
    rng = np.random.default_rng(world)
    for t in range(20):
        n = int(rng.integers(5, 400))
        lens = rng.integers(1, 60, n).astype(np.float64) if kind == "int" else rng.uniform(0.5, 60.0, n)
        k = int(rng.integers(1, 2 * world + 2))
        lens[rng.choice(n, min(k, n), replace=False)] = rng.choice([500.0, 700.0, 900.0], min(k, n))
        bs = LoadBalancingDistributedBatchSampler(
            LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=world, rank=0, seed=t),
            max_complexity=100.0,
            mode="packed",
        )
        rc, re = bs._cost_runs()
        items, bounds = bs._packed_over_budget(rc, re, 100.0, None)
        m = int(re[int(np.count_nonzero(rc > 100.0)) - 1])
        head = list(range(m + 1))
        if m % world:
            head += _fill_ref(rc, re, m, 100.0, world - m % world)[0]
        assert bounds[: len(head)].tolist() == head
        assert np.array_equal(np.sort(items), np.arange(n))
        assert np.array_equal(items[m : head[-1]], np.arange(m, head[-1]))


def test_packed_over_budget_large_float_case():
    # The case that was slow in Python: 2M distinct float costs (a run each), budget 1e8, one item
    # over it; the 7 free ranks of its step take the longest ~0.9M of the others.
    n, world, budget = 2_000_000, 8, 1e8
    lens = np.random.default_rng(0).uniform(1.0, 1000.0, n)
    lens[123] = 2e8
    bs = LoadBalancingDistributedBatchSampler(
        LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=world, rank=0, seed=0),
        max_complexity=budget,
        mode="packed",
    )
    rc, re = bs._cost_runs()
    assert rc.shape[0] == n and rc[0] == 2e8 and rc[1] <= budget
    fill, p = _fill_ref(rc, re, 1, budget, world - 1)
    plan = bs._plan()
    assert plan.bounds[:world].tolist() == [0, 1] + fill[:-1] and int(plan.bounds[world]) == p
    assert np.array_equal(plan.items[:p], np.arange(p))  # the over-budget item, then the fill in order
    assert 800_000 < p < 1_000_000
    for lo, hi in zip([1] + fill[:-1], fill):
        load = float(rc[lo:hi].sum())  # each rank's fill is within the budget and stopped at the next item
        assert load <= budget * (1 + 1e-12) and load + rc[hi] > budget * (1 - 1e-12)
    counts = np.bincount(plan.item_ids(), minlength=n)
    assert counts.min() >= 1 and int(counts.sum()) == n + plan.duplicates
