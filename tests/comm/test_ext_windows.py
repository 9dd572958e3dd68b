"""One-sided windows on shared memory, in real 3-process runs; cross-node groups get a clear error."""

from __future__ import annotations

import test_ext_ranks as R
from multiproc import run_ranks


def test_windows_put_accumulate_get_sync():
    ws = 3
    res = run_ranks(R.windows_suite, ws, timeout=90)
    for rank, r in enumerate(res):
        left, right = (rank - 1) % ws, (rank + 1) % ws
        assert r["created_sync"] == [rank / 3.0] * 5
        want = (rank + left + right) / 3.0  # ring of 3: both other ranks are neighbours
        assert r["sync"] == [want] * 5 and r["in_place"] == [want] * 5
        # the left neighbour accumulated 2 * 1 twice on top of its put (its value before the sync)
        # the left neighbour's slot holds its put (its value then, = left) plus 2 * 1 accumulated twice
        assert r["accumulated"] == [0.5 * want + 0.5 * (left + 4.0)] * 5
        assert r["got"] == res[left]["in_place"]  # the left neighbour's published (synced) value
        assert r["handle"] is True
        assert r["bad_dst"].startswith(f"ValueError: win_put: rank {rank} in dst_weights is not allowed")
        assert r["bad_shape"].startswith("ValueError: win_put: tensor has shape (3,) and dtype torch.float64")
        assert r["bad_weight"] == f"ValueError: win_accumulate: dst_weights[{right}] must be >= 0, got -1.0"
        assert r["bad_sum"].startswith(f"ValueError: win_sync on rank {rank}: self weight 0.5 plus neighbour")
        assert r["dup"] == "ValueError: win_create: a window named 'w' already exists; win_free it first"
        assert r["after_free"].startswith("ValueError: win_sync: no window named 'w'")
        assert r["shm_left"] == []


def test_windows_across_nodes_raise_not_implemented():
    res = run_ranks(R.windows_two_nodes, 2, timeout=60)
    for r in res:
        assert r["error"].startswith(
            "NotImplementedError: win_create: communicator default/global spans several"
        )
        assert "neighbor_allreduce" in r["error"]
