"""A DDP-style flow on two real processes: one all_reduce over the flat gradient buffer."""

from __future__ import annotations

from multiproc import run_ranks
from optimutil import ddp_rank


def test_collective_on_flat_grad_buffer_matches_per_tensor_allreduce():
    assert run_ranks(ddp_rank, 2, 5, timeout=120) == [True, True]
