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
        assert r["bad_weight"] == f"ValueError: win_accumulate: dst_weights[{right}] must be finite, got inf"
        assert r["bad_nan"] == f"ValueError: win_sync: neighbor_weights[{left}] must be finite, got nan"
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


def test_win_create_with_differing_arguments_raises_the_same_error_on_every_rank():
    ws = 3
    res = run_ranks(R.windows_mismatch, ws, timeout=90)
    tail = (
        "; every rank must create the window with the same name, shape and dtype under the same "
        "topology (set_topology); no window was created on any rank"
    )
    for rank, r in enumerate(res):
        assert r["shape"] == (
            "CommError: win_create: the ranks disagree on the window's shape: rank 0 has (4,), "
            "ranks [1, 2] have (3,)" + tail
        )
        assert r["big"] == (
            "CommError: win_create: the ranks disagree on the window's shape: rank 0 has (100,), "
            "ranks [1, 2] have (10,)" + tail
        )
        assert r["dtype"] == (
            "CommError: win_create: the ranks disagree on the window's dtype: rank 0 has float32, "
            "ranks [1, 2] have float64" + tail
        )
        assert r["name"] == (
            "CommError: win_create: the ranks disagree on the window's name: rank 0 has 'n0', "
            "rank 1 has 'n1', rank 2 has 'n2'" + tail
        )
        int_error = (
            "TypeError: win_create: windows average their values, so the tensor must be floating point "
            "or complex, got torch.int64; convert it first (e.g. tensor.double())"
        )
        if rank == 1:
            assert r["local"] == int_error
        else:
            assert r["local"] == (
                f"CommError: win_create('a'): rank 1 could not create the window ({int_error}); "
                "no window was created on any rank"
            )
        # rank 0 built connect_style=2 (receive from the left), the others connect_style=1 (receive
        # from the right), Bluefog's directions
        assert r["topology"] == (
            "CommError: win_create: the ranks disagree on the window's topology: rank 0 has "
            "in-neighbours [[2], [0], [1]], ranks [1, 2] have in-neighbours [[1], [2], [0]]" + tail
        )
        assert r["fds_leaked"] == 0
        assert r["shm_left"] == [] and r["live"] == []
        assert r["after"] == [(rank + (rank - 1) % ws + (rank + 1) % ws) / 3.0] * 2


def test_window_dtypes_accumulate_exactly():
    import torch

    res = run_ranks(R.windows_dtypes, 2, timeout=60)
    for rank, r in enumerate(res):
        other = 1 - rank
        # float64 keeps 2**40 + 1 exactly (float32 accumulation gave 2**40)
        assert r["float64"] == [
            "torch.float64",
            [0.25 * (2.0**40 + 1 + rank) + 0.75 * (2.0**40 + 1 + other)] * 3,
            [2.0**40 + 1 + rank] * 3,
        ]
        for name in ("float32", "float16", "bfloat16"):
            dtype = getattr(torch, name)
            base = (
                torch.tensor([0.1, 1.0 / 3.0, 1e-8], dtype=torch.float32)
                if name == "float32"
                else torch.tensor([1000.0, 0.6, 3.0], dtype=dtype)
            )
            mine, theirs = base * (rank + 1), base * (other + 1)
            # half types accumulate in float32 and round once; float32 in float32
            want = (mine.float() * 0.25).add_(theirs.float(), alpha=0.75).to(dtype)
            assert r[name][0] == f"torch.{name}"
            assert r[name][1] == want.tolist(), name
            assert r[name][2] == mine.tolist(), name
        assert r["complex64"] == [
            "torch.complex64",
            [complex(0.25 * (rank + 1) + 0.75 * (other + 1), 0.25 * (rank + 1) + 0.75 * (other + 1))] * 2,
            [complex(rank + 1, rank + 1)] * 2,
        ]
        v = 0.25 * (2.0**40 + rank) + 0.75 * (2.0**40 + other)
        assert r["complex128"] == [
            "torch.complex128",
            [complex(v, -2 * v)] * 2,
            [(2.0**40 + rank) * (1 - 2j)] * 2,
        ]
        assert r["int64"] == (
            "TypeError: win_create: windows average their values, so the tensor must be floating point or "
            "complex, got torch.int64; convert it first (e.g. tensor.double())"
        )
        assert (
            r["bool"].startswith("TypeError: win_create: windows average their values")
            and "torch.bool" in r["bool"]
        )
        assert r["live"] == []


def test_win_free_works_after_the_communicator_is_gone():
    ws = 2
    res = run_ranks(R.windows_free_after_destroy, ws, timeout=60)
    for r in res:
        assert r["use_after"].startswith("CommError: win_sync: communicator ")
        assert "was used after destroy_process_group()" in r["use_after"]
        assert (
            r["dup_before_free"]
            == "ValueError: win_create: a window named 'w' already exists; win_free it first"
        )
        assert r["free"] is True
        assert r["again"].startswith("ValueError: win_free: no window named 'w'")
        assert r["recreated"] == [0.5] * 3
        assert r["free_after_destroy"] is True and r["live"] == []
        assert r["fds_released"] == 2 * ws  # per rank's file: the lock fd and the mapping's own
        assert r["shm_left"] == []
