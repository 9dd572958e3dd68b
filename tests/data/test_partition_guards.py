"""Exact messages of the planning core's own argument checks.

The samplers (trainloom/data/samplers.py) validate everything before they call
trainloom.data._partition, so none of these is reachable through them (an empty dataset, for one,
is a ConfigError there). Each guard stops an index or a size that would read or write outside an
array once the loops run without bounds checks, so each is called here directly."""

from __future__ import annotations

import numpy as np
import pytest

from trainloom.data import _partition as P


def i64(*values):
    return np.array(values, dtype=np.int64)


def f64(*values):
    return np.array(values, dtype=np.float64)


RC, RE = f64(3.0, 1.0), i64(1, 3)  # a valid run table: 1 item of cost 3, then 2 of cost 1
ITEMS = np.arange(4, dtype=np.int64)

# (id, call, exact message); every one raises ValueError
GUARDS = [
    ("permutation-negative", lambda: P.permutation(-1, 0), "permutation: n must be >= 0, got -1"),
    (
        "shuffle_runs-order-past-keys",
        lambda: P.shuffle_runs(f64(1.0, 2.0), i64(0, 2), 0),
        "shuffle_runs: order[1] = 2 is outside [0, 2)",
    ),
    (
        "shuffle_runs-order-negative",
        lambda: P.shuffle_runs(f64(1.0, 2.0), i64(-1, 0), 0),
        "shuffle_runs: order[0] = -1 is outside [0, 2)",
    ),
    (
        "rank_stream-items-for-chunks",
        lambda: P.rank_stream(ITEMS[:3], i64(0, 1), i64(0, 0), 2, 0),
        "rank_stream: 3 items, 2 rotations for 2 chunks",
    ),
    (
        "rank_stream-rotations-for-chunks",
        lambda: P.rank_stream(ITEMS, i64(0, 1), i64(0), 2, 0),
        "rank_stream: 4 items, 1 rotations for 2 chunks",
    ),
    # 4 chunks * 2**62 ranks wrapped to 0 items and passed: reads far outside items (fixed)
    (
        "rank_stream-chunks-times-world-wraps",
        lambda: P.rank_stream(ITEMS[:0], i64(0, 1, 2, 3), i64(0, 0, 0, 0), 2**62, 0),
        "rank_stream: 0 items, 4 rotations for 4 chunks",
    ),
    (
        "rank_stream-chunk_order",
        lambda: P.rank_stream(ITEMS, i64(0, 2), i64(0, 0), 2, 0),
        "rank_stream: chunk_order[1] = 2 outside [0, 2)",
    ),
    # a negative rotation read before the chunk (C's % under cdivision keeps the sign) (fixed)
    (
        "rank_stream-rot-negative",
        lambda: P.rank_stream(ITEMS, i64(0, 1), i64(0, -1), 2, 0),
        "rank_stream: rot[1] = -1 outside [0, 2)",
    ),
    (
        "rank_stream-rot-past-world",
        lambda: P.rank_stream(ITEMS, i64(0, 1), i64(2, 0), 2, 0),
        "rank_stream: rot[0] = 2 outside [0, 2)",
    ),
    (
        "padded_steps-world",
        lambda: P.padded_steps(RC, RE, 0, 4.0, np.empty(3, np.int64)),
        "padded_steps: world=0, budget=4.0",
    ),
    (
        "padded_steps-budget-nan",
        lambda: P.padded_steps(RC, RE, 2, float("nan"), np.empty(3, np.int64)),
        "padded_steps: world=2, budget=nan",
    ),
    (
        "padded_steps-ends-too-short",
        lambda: P.padded_steps(RC, RE, 2, 4.0, np.empty(2, np.int64)),
        "padded_steps: ends has 2 slots for 3 items",
    ),
    (
        "packed_plan-world",
        lambda: P.packed_plan(RC, RE, 0, 4.0, 1, None),
        "packed_plan: world=0, nsteps=1, budget=4.0",
    ),
    (
        "packed_plan-nsteps",
        lambda: P.packed_plan(RC, RE, 2, 4.0, 0, 5),
        "packed_plan: world=2, nsteps=0, budget=4.0",
    ),
    (
        "packed_plan-budget",
        lambda: P.packed_plan(RC, RE, 2, 0.0, 1, None),
        "packed_plan: world=2, nsteps=1, budget=0.0",
    ),
    ("packed_plan-no-items", lambda: P.packed_plan(f64(), i64(), 2, 4.0, 1, None), "packed_plan: no items"),
    (
        "gather_batches-bounds-decrease",
        lambda: P.gather_batches(ITEMS, i64(0, 3, 2, 4), i64(0, 1, 2)),
        "gather_batches: bounds decrease at 1",
    ),
]


@pytest.mark.parametrize("call,msg", [g[1:] for g in GUARDS], ids=[g[0] for g in GUARDS])
def test_partition_guard(call, msg):
    with pytest.raises(ValueError) as info:
        call()
    assert type(info.value) is ValueError
    assert str(info.value) == msg


def test_rank_stream_accepts_what_the_guards_allow():
    """The new rot/size checks leave valid calls alone: rank r takes position (r + rot[c]) % world."""
    got = [P.rank_stream(ITEMS, i64(1, 0), i64(1, 0), 2, r).tolist() for r in range(2)]
    assert got == [[2, 1], [3, 0]]
