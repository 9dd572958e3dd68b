"""A DDP-style flow on two real processes: one all_reduce over the flat gradient buffer."""

from __future__ import annotations

from multiproc import run_ranks
from optimutil import ddp_rank


def test_collective_on_flat_grad_buffer_matches_per_tensor_allreduce():
    assert run_ranks(ddp_rank, 2, 5, timeout=120) == [True, True]


def test_a_layer_unfrozen_after_fusing_joins_the_collective():
    # The first layer does not require grad when fused (no gradient hook could be registered) and is
    # unfrozen at step 2: from that backward on, its gradient is in the flat buffer the collective
    # reduces. Before, it stayed outside and the ranks drifted apart silently.
    assert run_ranks(ddp_rank, 2, 5, 2, timeout=120) == [True, True]
