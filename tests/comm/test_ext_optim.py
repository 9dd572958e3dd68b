"""Distributed optimizers: exact data-parallel SGD, decentralized SGD converging like allreduce SGD."""

from __future__ import annotations

import pytest
import test_ext_ranks as R
import torch
from commutil import engines
from multiproc import run_ranks

ENGINE = engines()[-1]


def full_batch_reference(steps: int = 25):
    """Single-process full-batch gradient descent: what averaged shard gradients must reproduce."""
    x, y = R.regression_data(4)
    model = R.regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def test_allreduce_optimizer_equals_full_batch_sgd():
    res = run_ranks(R.train, 2, ENGINE, "allreduce", "-", timeout=90)
    ref = full_batch_reference()
    want = [p.detach().reshape(-1) for p in ref.parameters()]
    for r in res:
        assert r["isinstance"] is True and r["state_keys"] == 4  # SGD's own state_dict, 4 params
        assert r["buckets"] >= 2
        assert r["overlap"] >= 1  # at least one bucket launched from a hook, during backward
        for got, w in zip(r["params"], want):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("topo,ws", [("ring", 3), ("exp2", 4)])
def test_decentralized_sgd_reaches_the_allreduce_loss_region(topo, ws):
    dsgd = run_ranks(R.train, ws, ENGINE, "neighbor", topo, timeout=90)
    ref = full_batch_reference()
    x, y = R.regression_data(4)
    with torch.no_grad():
        ref_loss = float(torch.nn.functional.mse_loss(ref(x), y))
        init_loss = float(torch.nn.functional.mse_loss(R.regression_model()(x), y))
    assert ref_loss < 0.5 * init_loss
    for r in dsgd:
        assert r["overlap"] >= 1
        # same loss region as allreduce SGD, far below the start
        assert r["loss"] < ref_loss * 1.25 + 0.002, (r["loss"], ref_loss)
    # near consensus: ranks' parameters are close to each other
    p0 = torch.tensor([v for p in dsgd[0]["params"] for v in p])
    for r in dsgd[1:]:
        p = torch.tensor([v for q in r["params"] for v in q])
        assert (p - p0).abs().max().item() < 0.05
    # control, same processes, no communication: both checks above fail
    ls = [torch.tensor([v for p in r["local_params"] for v in p]) for r in dsgd]
    assert max((p - ls[0]).abs().max().item() for p in ls) > 0.1
    assert max(r["local_loss"] for r in dsgd) > ref_loss * 1.25 + 0.002


def test_optimizer_bad_inputs_and_accumulation():
    res = run_ranks(R.optimizer_errors, 2, timeout=60)
    for r in res:
        assert r["not_opt"] == (
            "TypeError: DistributedAllreduceOptimizer: optimizer must be a torch.optim.Optimizer, got object"
        )
        assert r["missing"].startswith(
            "ValueError: DistributedAllreduceOptimizer: 1 of the optimizer's parameters are not in "
            "named_parameters"
        )
        assert (
            r["dup"]
            == "ValueError: DistributedAllreduceOptimizer: named_parameters has duplicate names ['w']"
        )
        assert r["bucket"] == (
            "ValueError: DistributedNeighborAllreduceOptimizer: bucket_bytes must be an int >= 1, got 0"
        )
        assert r["passes"].endswith("backward_passes_per_step must be an int >= 1, got 0")
        assert r["twice"].startswith(
            "ValueError: DistributedAllreduceOptimizer: the optimizer is already distributed"
        )
        assert r["accumulated"] == pytest.approx(-3.0)  # mean of 2*1 and 2*2
