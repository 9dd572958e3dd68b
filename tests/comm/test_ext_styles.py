"""ColossalAI dim-aware collectives and the early torch.distributed API, in real 1-, 2- and 3-process runs."""

from __future__ import annotations

import pytest
import test_ext_ranks as R
import torch
from commutil import engines
from multiproc import run_ranks

ENGINES = engines()


@pytest.mark.parametrize("ws,engine", [(2, "gloo"), (3, ENGINES[-1]), (4, ENGINES[-1])])
def test_colossal_and_classic_forms(ws, engine):
    res = run_ranks(R.styles_suite, ws, engine, timeout=90)
    xs = [torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * r for r in range(ws)]
    for rank, r in enumerate(res):
        assert (r["rank"], r["ws"], r["init"]) == (rank, ws, True)
        for d in (0, 1, 2, -1):
            assert r[f"ag{d}"] == torch.cat(xs, dim=d).tolist(), d
            total = sum(torch.cat([x] * ws, dim=d) * (i + 1) for i, x in enumerate(xs))
            assert r[f"rs{d}"] == total.chunk(ws, dim=d)[rank].tolist(), d
        assert r["ag_async"] == torch.cat(xs, dim=1).tolist()
        assert r["rs_async"] == [True, [[1.0, 1.0]] * 2]
        assert r["all_reduce"] == [ws * (ws + 1) / 2] * 2
        assert r["all_reduce_async"] == [True, [float(ws)] * 2]
        assert r["broadcast"] == [float(ws - 1)] * 2
        assert r["reduce"] == ([ws * (ws - 1) / 2] * 2 if rank == 0 else [float(rank)] * 2)
        if rank in (0, ws - 1):
            assert r["mode"] == [2.0] and r["mode_bcast"] == [float(ws - 1)]
        assert r["bad_dim"] == "ValueError: all_gather: dim=3 is out of range for a tensor of shape (2, 3, 4)"
        assert r["bad_div"] == (
            f"ValueError: reduce_scatter: tensor.shape[0]={ws + 1} (shape ({ws + 1},)) is not divisible by "
            f"the group's {ws} ranks"
        )
        assert r["bad_0d"] == (
            f"ValueError: reduce_scatter: a 0-d tensor (shape ()) has 1 element, which is not divisible by "
            f"the group's {ws} ranks"
        )
        assert r["bad_mode"].startswith(
            "ValueError: all_reduce: parallel_mode 'tensor' is not a ProcessGroup"
        )
        assert (
            r["bad_src"] == f"ValueError: broadcast: src={ws} is not a member of the group (global ranks "
            f"{list(range(ws))})"
        )
        assert r["ring"] == [[float((rank - 1) % ws)] * 3, True]
        assert r["all_gather"] == [float(i) for i in range(ws)]
        assert r["scatter"] == [10.0 * rank] * 2
        assert r["c_all_reduce"] == [float(ws)] * 2
        assert r["c_reduce"] == ([ws * (ws + 1) / 2] * 2 if rank == ws - 1 else [rank + 1.0] * 2)
        assert r["c_broadcast"] == [float(ws - 1)] * 2
        assert (
            r["c_bad_list"]
            == f"ValueError: all_gather: tensor_list has 1 tensors, expected {ws} (one per rank of the group)"
        )
        assert (
            r["c_bad_numel"]
            == "ValueError: all_gather: tensor_list[0] has 3 elements but tensor has 2; they must match"
        )
        assert (
            r["c_gather_list"]
            == f"ValueError: gather: gather_list is required on the destination rank {rank}"
        )
        assert r["c_scatter_other"] == (
            f"ValueError: scatter: scatter_list must be empty on rank {rank}, which is not "
            f"src={(rank + 1) % ws}"
        )
        assert r["c_self"] == f"ValueError: isend: dst={rank} is this rank; send to another rank"
        assert r["c_backend"].startswith("ConfigError: init_process_group: backend 'ucc' is not one of")
    assert res[0]["any"] == [(s, [float(s)] * 2) for s in range(1, ws)]
    assert res[0]["explicit"] == (ws - 1, [42.0])
    assert res[0]["any_after"] == (ws - 1, [7.0] * 3)
    assert res[0]["after_refused_isend"] == [(r, [10.0 * r] * 2) for r in range(1, ws)]
    assert res[0]["after_refused_irecv"] == (1, [5.0, 5.0])
    layout = "must be a dense (strided) tensor, got layout torch.sparse_coo"
    assert res[0]["refused_irecv"] == f"TypeError: irecv: tensor {layout}"
    assert res[ws - 1]["refused_isend"] == f"TypeError: isend: tensor {layout}"
    assert res[0]["gather"] == [[2.0 * i] * 3 for i in range(ws)]


def test_world_size_one_styles():
    (r,) = run_ranks(R.classic_world_one, 1, timeout=60)
    x = torch.arange(6.0).reshape(2, 3)
    assert r["ag"] == x.tolist() and r["rs"] == x.tolist() and r["list"] == x.tolist()
    assert r["any"] == "ValueError: recv: src=None (any source) in a group of one rank: there is no sender"


def test_recv_from_any_source_times_out():
    res = run_ranks(R.classic_timeout, 2, timeout=60)
    assert res[0]["error"].startswith(
        "CommTimeoutError: recv(src=None) on rank 0: no message was sent to this rank"
    )
    assert res[0]["seconds"] < 30


@pytest.mark.parametrize("engine", ["gloo", ENGINES[-1]])
def test_classic_any_source_with_bagua_style_messages_from_the_same_sender(engine):
    """Bagua-style sends are not announced but hold their place in the sender's stream: receiving
    them (or an announced message) with an explicit src keeps any-source receives paired."""
    res = run_ranks(R.classic_mixed_apis, 3, engine, timeout=60)
    assert res[0] == {
        "classic_src_bagua_msg": [2, [1.0]],
        "any_after_it": [2, [2.0, 2.0]],
        "bagua_src_bagua_msg": [None, [3.0]],
        "any_after_that": [2, [4.0, 4.0]],
        "bagua_src_announced": [None, [5.0]],
        "any_other_sender": [1, [6.0, 6.0]],
    }


def test_bluefog_script_moves_over_by_changing_the_import():
    res = run_ranks(R.bluefog_script, 3, timeout=60)
    w0 = None
    for rank, r in enumerate(res):
        assert (r["size"], r["rank"], r["local"]) == (3, rank, (rank, 3))
        assert r["in"] == sorted({(rank - 1) % 3, (rank + 1) % 3})
        assert r["nar"] == [1.0] * 3  # ring of 3: (0 + 1 + 2) / 3
        assert r["ar"] == [1.0] * 3
        assert r["nag"] == [float(i) for i in r["in"]]
        w0 = w0 or r["w"]
    # same start, averaged (identical) parameters, then each rank's own gradient (its input scale)
    for rank, r in enumerate(res):
        torch.testing.assert_close(
            torch.tensor(r["w"]), torch.tensor(res[0]["w"]) - 0.1 * rank * torch.ones(2), rtol=0, atol=1e-6
        )


def test_bluefog_rank_queries_raise_before_init_and_after_shutdown():
    res = run_ranks(R.bluefog_not_initialized, 2, timeout=60)
    for rank, r in enumerate(res):
        want = [
            f"ValueError: {q}: BlueFog has not been initialized; use bf.init()."
            for q in ("size", "rank", "local_size", "local_rank")
        ]
        assert r["before"] == want and r["after"] == want
        assert r["during"] == [2, rank, 2, rank]
