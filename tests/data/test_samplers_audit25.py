"""Audit 25 of the samplers: batch_fn mode's plan_stats() counts, arguments too large for a
float64, and 0-d bool tensors or arrays among the complexities."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from trainloom.errors import ConfigError


def _batch_ranks(lens, world, batch_fn, batch_drop_last, **skw):
    samplers = [
        LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=world, rank=r, **skw)
        for r in range(world)
    ]
    return [
        LoadBalancingDistributedBatchSampler(s, batch_fn=batch_fn, drop_last=batch_drop_last)
        for s in samplers
    ]


def _real_counts(bss, n):
    """(duplicates, dropped) of the epoch's batches over every rank, counted per sample."""
    counts = np.bincount([i for bs in bss for b in bs for i in b], minlength=n)
    return int(np.clip(counts - 1, 0, None).sum()), int((counts == 0).sum())


# --------------------------------------------------------------------------- batch_fn plan_stats
def test_batch_fn_plan_stats_do_not_count_a_cut_padding_copy_as_duplicated_and_dropped():
    # N=3 on W=2: the wrapped sampler repeats sample 0 (padding), rank 0 puts its copy in a second
    # batch that drop_last=True cuts, so every sample appears exactly once. plan_stats() said
    # duplicates=1 (the padding) and dropped=1 (the cut batch's sample).
    def batch_fn(ix):
        return [[i] for i in reversed(ix)] if ix == [0, 1] else [ix]

    bss = _batch_ranks([1, 2, 3], 2, batch_fn, batch_drop_last=True, shuffle=False)
    assert [bs.sampler.rank_indices().tolist() for bs in bss] == [[0, 1], [0, 2]]
    assert [list(bs) for bs in bss] == [[[1]], [[0, 2]]]
    assert _real_counts(bss, 3) == (0, 0)
    st = bss[0].plan_stats()
    assert (st["duplicates"], st["dropped"]) == (0, 0)


@pytest.mark.parametrize("sampler_drop_last", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_fn_plan_stats_match_the_per_sample_counts(sampler_drop_last, drop_last):
    checked = 0
    for seed in range(60):
        rng = random.Random(seed)
        world = rng.choice([2, 3, 4])
        n = rng.choice([world + 1, 2 * world - 1, 9, 17])
        lens = [rng.randint(0, 20) for _ in range(n)]

        def batch_fn(ix, seed=seed):
            r = random.Random(seed * 1000 + len(ix) + ix[0])
            out, i = [], 0
            while i < len(ix):
                k = r.randint(1, 4)
                out.append(ix[i : i + k])
                i += k
            return out

        bss = _batch_ranks(
            lens, world, batch_fn, drop_last, shuffle=True, seed=seed, drop_last=sampler_drop_last
        )
        for bs in bss:
            bs.set_epoch(seed % 3)
        st = bss[0].plan_stats()
        assert (st["duplicates"], st["dropped"]) == _real_counts(bss, n), seed
        checked += 1
    assert checked == 60


# --------------------------------------------------------------------------- ints beyond float64
@pytest.mark.parametrize("value", [10**400, -(10**400)], ids=["1e400", "-1e400"])
def test_max_complexity_too_large_for_a_float64_is_a_config_error(value):
    s = LoadBalancingDistributedSampler(None, complexities=[1, 2, 3], num_replicas=1, rank=0)
    with pytest.raises(
        ConfigError,
        match=r"^LoadBalancingDistributedBatchSampler: max_complexity must be finite and > 0, got int too "
        r"large for a float64$",
    ):
        LoadBalancingDistributedBatchSampler(s, max_complexity=value)


@pytest.mark.parametrize("cost, i", [((10**400, 0), 0), ((1, 10**400), 1), ((0, -(10**400)), 1)])
def test_cost_too_large_for_a_float64_is_a_config_error(cost, i):
    s = LoadBalancingDistributedSampler(None, complexities=[1, 2, 3], num_replicas=1, rank=0)
    with pytest.raises(
        ConfigError,
        match=rf"^LoadBalancingDistributedBatchSampler: cost\[{i}\] must be finite and >= 0, got int too "
        r"large for a float64$",
    ):
        LoadBalancingDistributedBatchSampler(s, max_complexity=5, cost=cost)


@pytest.mark.parametrize("level", [10**400, -(10**400)], ids=["1e400", "-1e400"])
def test_random_level_too_large_for_a_float64_is_a_config_error(level):
    with pytest.raises(
        ConfigError,
        match=r"^LoadBalancingDistributedSampler: random_level must be in \[0, 1\], got int too large for "
        r"a float64$",
    ):
        LoadBalancingDistributedSampler(
            None, complexities=[1, 2, 3], num_replicas=1, rank=0, random_level=level
        )


# --------------------------------------------------------------------------- bools among complexities
@pytest.mark.parametrize(
    "values, i, kind",
    [
        ([torch.tensor(True), 3], 0, "Tensor of dtype torch.bool"),
        ([np.array(True), 3], 0, "ndarray of dtype bool"),
        ((2.5, 4, np.array(False)), 2, "ndarray of dtype bool"),
        ([3, torch.tensor(1.0), torch.tensor(False)], 2, "Tensor of dtype torch.bool"),
    ],
)
def test_a_0d_bool_tensor_or_array_among_the_complexities_is_refused(values, i, kind):
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"LoadBalancingDistributedSampler: complexities[{i}] is {kind}; complexities must be real numbers"
        )
        + "$",
    ):
        LoadBalancingDistributedSampler(None, complexities=values, num_replicas=1, rank=0)


def test_0d_number_tensors_and_arrays_among_the_complexities_are_still_taken():
    values = [torch.tensor(1.5), np.array(2), 3, torch.tensor(4, dtype=torch.int32)]
    s = LoadBalancingDistributedSampler(None, complexities=values, num_replicas=1, rank=0)
    assert s.complexities.tolist() == [1.5, 2.0, 3.0, 4.0]
