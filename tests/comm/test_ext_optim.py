"""Distributed optimizers: exact data-parallel SGD, decentralized SGD converging like allreduce SGD."""

from __future__ import annotations

import pytest
import test_ext_ranks as R
import torch
from commutil import engines
from multiproc import run_ranks

import trainloom.comm as C

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


# ---------------------------------------------------------------------------- rank functions
# Module level so that run_ranks can pickle them by reference.


def _weight0(bias: bool = False, n_in: int = 1) -> torch.nn.Linear:
    m = torch.nn.Linear(n_in, 1, bias=bias).double()
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(0.0)
    return m


def accumulation_ranks(rank: int, ws: int, engine: str) -> dict:
    """Too many backward passes raise (in backward and in step); N passes accumulate exactly."""
    from trainloom.comm import optimizers as dopt

    R._engine(engine)
    C.init_process_group(timeout=30)
    out: dict = {}
    # backward_passes_per_step=1 and a second backward before step(): Horovod's error, nothing lost.
    m = _weight0()
    opt = dopt.DistributedAllreduceOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), m.named_parameters())
    (m.weight * (rank + 1)).sum().backward()
    out["second_backward"] = R._expect(lambda: (m.weight * (rank + 1)).sum().backward(), RuntimeError)
    out["grad_before_step"] = m.weight.grad.item()
    out["step_after_error"] = R._expect(opt.step, RuntimeError)
    out["weight_after_error"] = m.weight.item()  # the step was not taken
    opt.zero_grad()
    (m.weight * (rank + 1)).sum().backward()
    opt.step()
    out["recovered"] = m.weight.item()  # -(1 + 2) / 2
    # backward_passes_per_step=2, two buckets (weight and bias), two steps: exact accumulated means.
    m = _weight0(bias=True, n_in=2)
    opt = dopt.DistributedAllreduceOptimizer(
        torch.optim.SGD(m.parameters(), lr=1.0), bucket_bytes=8, backward_passes_per_step=2
    )
    out["buckets"] = len(opt._tl_reducer.buckets)
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    for step in range(2):
        opt.zero_grad()
        for k in range(2):
            m(x * (rank + 1) * (k + 1) * (step + 1)).sum().backward()
        opt.step()
        out[f"n2_step{step}"] = [m.weight.reshape(-1).tolist(), m.bias.tolist()]
    out["n2_overlap"] = opt._tl_reducer.launched_in_backward
    # a third pass with backward_passes_per_step=2
    opt.zero_grad()
    for _ in range(2):
        m(x).sum().backward()
    out["third_backward"] = R._expect(lambda: m(x).sum().backward(), RuntimeError)
    out["third_step"] = R._expect(opt.step, RuntimeError)
    C.destroy_process_group()
    return out


def test_too_many_backward_passes_raise_and_n_passes_accumulate():
    res = run_ranks(accumulation_ranks, 2, ENGINE, timeout=90)
    msg1 = (
        "RuntimeError: DistributedAllreduceOptimizer: gradients were computed more than "
        "backward_passes_per_step=1 time(s) before step() (parameter 'weight' got gradient number 2); "
        "increase backward_passes_per_step to accumulate gradients locally, or call step() after each "
        "backward pass"
    )
    msg2 = (
        "RuntimeError: DistributedAllreduceOptimizer: gradients were computed more than "
        "backward_passes_per_step=2 time(s) before step() (parameter param_groups[0]['params'][1] got "
        "gradient number 3); increase backward_passes_per_step to accumulate gradients locally, or call "
        "step() after each backward pass"
    )
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    w = torch.zeros(2, dtype=torch.float64)
    b = torch.zeros(1, dtype=torch.float64)
    want = []
    for step in range(2):
        # per rank: sum over the 2 passes of d/dw of sum(w . x*s + b) = x*s, with s = (rank+1)(k+1)(step+1)
        gw = sum(x * (r + 1) * (k + 1) * (step + 1) for r in range(2) for k in range(2)) / 2
        gb = torch.tensor([2.0])  # 2 passes, 1 each, the same on both ranks
        w, b = w - gw, b - gb
        want.append([w.tolist(), b.tolist()])
    for rank, r in enumerate(res):
        assert r["second_backward"] == msg1
        # the hook runs after accumulation: the local .grad holds both passes, but it is never stepped on
        assert r["grad_before_step"] == 2.0 * (rank + 1)
        assert r["step_after_error"] == msg1
        assert r["weight_after_error"] == 0.0
        assert r["recovered"] == -1.5
        assert r["buckets"] == 2
        assert r["n2_step0"] == want[0] and r["n2_step1"] == want[1]
        assert r["n2_overlap"] == 2  # both buckets launched from the hooks of the 2nd pass
        assert r["third_backward"] == msg2
        assert r["third_step"] == msg2


def frozen_unused_ranks(rank: int, ws: int, engine: str, mode: str) -> dict:
    """Frozen, unused-everywhere and used-on-rank-1-only parameters, SGD with momentum and weight decay."""
    from trainloom.comm import optimizers as dopt

    R._engine(engine)
    C.init_process_group(timeout=30)
    torch.manual_seed(0)
    model = _FrozenUnused()
    opt = dopt.DistributedAllreduceOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
        model.named_parameters(),
        bucket_bytes=1,  # one bucket per parameter
    )
    out: dict = {"buckets": len(opt._tl_reducer.buckets), "overlap": []}
    for _ in range(2):
        opt.zero_grad()
        model(rank).backward()
        opt.step()
        out["overlap"].append(opt._tl_reducer.launched_in_backward)
    out["params"] = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    out["grad_none"] = sorted(n for n, p in model.named_parameters() if p.grad is None)
    # unfreezing after wrapping: a clear error, not a silently local gradient
    model.a.bias.requires_grad_(True)
    opt.zero_grad()
    model(rank).backward()
    before = model.a.weight.detach().clone()
    out["unfrozen"] = R._expect(opt.step, RuntimeError)
    out["unfrozen_untouched"] = torch.equal(before, model.a.weight)
    C.destroy_process_group()
    return out


class _FrozenUnused(torch.nn.Module):
    """``a.bias`` frozen, ``unused`` never used, ``only1`` used on rank 1 only; float64."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.only1 = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.a = torch.nn.Linear(2, 2).double()
        self.a.bias.requires_grad_(False)

    def forward(self, rank: int) -> torch.Tensor:
        x = torch.full((1, 2), float(rank + 1), dtype=torch.float64)
        loss = self.a(x).sum()
        if rank == 1:
            loss = loss + (self.only1 * 3.0).sum()
        return loss


def test_frozen_and_unused_parameters_match_a_plain_optimizer():
    res = run_ranks(frozen_unused_ranks, 2, ENGINE, "grad", timeout=90)
    # Plain single-process reference with the averaged gradients set by hand:
    # a.weight: x = (rank+1) * ones -> mean over ranks 1.5 everywhere; only1: 3 on rank 1, none on
    # rank 0 -> 1.5; unused: no gradient anywhere -> skipped; a.bias: frozen -> skipped.
    torch.manual_seed(0)
    ref = _FrozenUnused()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for _ in range(2):
        ref_opt.zero_grad()
        ref.a.weight.grad = torch.full((2, 2), 1.5, dtype=torch.float64)
        ref.only1.grad = torch.full((2,), 1.5, dtype=torch.float64)
        ref_opt.step()
    want = {n: p.detach().reshape(-1).tolist() for n, p in ref.named_parameters()}
    torch.manual_seed(0)
    init = {n: p.detach().reshape(-1).tolist() for n, p in _FrozenUnused().named_parameters()}
    assert want["unused"] == init["unused"] and want["a.bias"] == init["a.bias"]
    assert want["only1"] != init["only1"]
    for rank, r in enumerate(res):
        assert r["buckets"] == 3  # a.bias is in no bucket
        # a.weight's bucket (first in reverse order) is launched during backward on both ranks: the
        # frozen bias no longer holds it back. Then only1's on rank 1 (on rank 0 it gets no gradient
        # and waits for step()); unused gets no gradient anywhere and waits for step().
        assert r["overlap"] == ([1, 1] if rank == 0 else [2, 2])
        for n in want:
            torch.testing.assert_close(r["params"][n], want[n], rtol=0, atol=1e-15, msg=n)
        assert r["params"]["unused"] == init["unused"] and r["params"]["a.bias"] == init["a.bias"]
        assert r["grad_none"] == ["a.bias", "unused"]
        assert r["unfrozen"] == (
            "RuntimeError: DistributedAllreduceOptimizer: parameter 'a.bias' had requires_grad=False when "
            "the optimizer was wrapped, so it is not averaged across ranks, but it has a gradient now; set "
            "requires_grad before wrapping (wrap the original optimizer again after changing it)"
        )
        assert r["unfrozen_untouched"] is True


def sparse_ranks(rank: int, ws: int, engine: str) -> dict:
    from trainloom.comm import optimizers as dopt

    R._engine(engine)
    C.init_process_group(timeout=30)
    out: dict = {}
    emb = torch.nn.Embedding(5, 2, sparse=True).double()
    with torch.no_grad():
        emb.weight.zero_()
    opt = dopt.DistributedAllreduceOptimizer(
        torch.optim.SGD(emb.parameters(), lr=1.0), emb.named_parameters()
    )
    idx = torch.tensor([1, 2]) if rank == 0 else torch.tensor([2, 3, 3])
    emb(idx).sum().backward()
    out["sparse_before"] = emb.weight.grad.is_sparse
    opt.step()
    out["weight"] = emb.weight.detach().tolist()
    out["grad_dense"] = not emb.weight.grad.is_sparse
    out["sparse_adam"] = R._expect(
        dopt.DistributedAllreduceOptimizer, TypeError, torch.optim.SparseAdam(list(emb.parameters()))
    )
    # decentralized SGD communicates parameters, not gradients: SparseAdam works there
    nopt = dopt.DistributedNeighborAllreduceOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1))
    nopt.zero_grad()
    emb(idx).sum().backward()
    nopt.step()
    out["neighbor_ok"] = bool(torch.isfinite(emb.weight).all())
    C.destroy_process_group()
    return out


def test_sparse_gradients_are_averaged_densely_and_sparse_adam_is_refused():
    res = run_ranks(sparse_ranks, 2, ENGINE, timeout=90)
    # d/dW of sum(emb(idx)): one per lookup. rank 0: rows 1, 2; rank 1: row 2, row 3 twice. Mean:
    want = -torch.tensor([[0, 0], [0.5, 0.5], [1.0, 1.0], [1.0, 1.0], [0, 0]], dtype=torch.float64)
    for r in res:
        assert r["sparse_before"] is True
        assert r["weight"] == want.tolist()
        assert r["grad_dense"] is True
        assert r["sparse_adam"] == (
            "TypeError: DistributedAllreduceOptimizer: SparseAdam needs sparse gradients, but gradients are "
            "averaged as dense tensors (a sparse gradient, e.g. from nn.Embedding(sparse=True), becomes a "
            "dense average); use Adam, or DistributedNeighborAllreduceOptimizer, which keeps the local "
            "(sparse) gradient"
        )
        assert r["neighbor_ok"] is True


def hooks_pickle_ranks(rank: int, ws: int, engine: str) -> dict:
    import copy
    import io

    from trainloom.comm import optimizers as dopt

    R._engine(engine)
    C.init_process_group(timeout=30)
    out: dict = {}
    m = _weight0()
    base = torch.optim.SGD(m.parameters(), lr=1.0)
    opt = dopt.DistributedAllreduceOptimizer(base)
    opt.remove_hooks()
    (m.weight * (rank + 1)).sum().backward()
    opt.step()
    out["after_remove_hooks"] = m.weight.item()  # still averaged: -(1 + 2) / 2
    out["overlap"] = opt._tl_reducer.launched_in_backward  # everything launched from step()
    base.zero_grad()
    (m.weight * (rank + 1)).sum().backward()
    base.step()  # the original optimizer steps locally
    out["local_step"] = m.weight.item()
    out["save"] = R._expect(torch.save, TypeError, opt, io.BytesIO())
    out["deepcopy"] = R._expect(copy.deepcopy, TypeError, opt)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf))
    out["state_dict_roundtrip"] = True
    C.destroy_process_group()
    return out


def test_remove_hooks_keeps_averaging_and_pickling_points_to_state_dict():
    res = run_ranks(hooks_pickle_ranks, 2, ENGINE, timeout=90)
    msg = (
        "TypeError: cannot pickle or copy a DistributedAllreduceOptimizer[SGD]: it holds gradient hooks and "
        "a communicator. Save optimizer.state_dict() instead, and load_state_dict() it into a freshly "
        "wrapped optimizer"
    )
    for rank, r in enumerate(res):
        assert r["after_remove_hooks"] == -1.5
        assert r["overlap"] == 0
        assert r["local_step"] == -1.5 - (rank + 1)
        assert r["save"] == msg and r["deepcopy"] == msg
        assert r["state_dict_roundtrip"] is True


def test_neighbor_optimizer_takes_bluefogs_weight_attributes():
    res = run_ranks(R.optimizer_weight_attributes, 3, timeout=120)
    for rank, r in enumerate(res):
        assert r["topology"] == [1.0, 1.0]
        assert r["left"] == [float((rank - 1) % 3)] * 2  # self_weight=0, all weight on the left one
        assert r["read"] == (0.0, {(rank - 1) % 3: 1.0})
        assert r["allreduce"] == (
            "DistributedAllreduceOptimizer[SGD] has no self_weight: only "
            "DistributedNeighborAllreduceOptimizer averages with neighbour weights"
        )


def wrapper_lifecycle_ranks(rank: int, ws: int, engine: str) -> dict:
    """A fused optimizer under the allreduce wrapper stepped with fuse_step (both forms), a param
    group added after wrapping, and load_state_dict keeping the original optimizer in sync."""
    from trainloom.comm import optimizers as dopt
    from trainloom.optim import fuse_optimizer, fuse_step

    R._engine(engine)
    C.init_process_group(timeout=30)
    out: dict = {}
    lin = torch.nn.Linear(3, 1, bias=False).double()
    torch.nn.init.zeros_(lin.weight)
    base = fuse_optimizer(torch.optim.SGD(lin.parameters(), lr=1.0))
    opt = dopt.DistributedAllreduceOptimizer(base, model=lin)
    x = torch.full((1, 3), float(rank + 1), dtype=torch.float64)
    for step in (lambda: opt.fuse_step(), lambda: fuse_step(opt)):
        opt.zero_grad()
        lin(x).sum().backward()  # gradient rank + 1: averaged 1.5 over 2 ranks
        step()
    out["fused_weight"] = lin.weight.detach().reshape(-1).tolist()  # -1.5 twice: -3.0
    # a param group added after wrapping: refused at step() on every rank, nothing stepped
    head, body = torch.nn.Linear(2, 1).double(), torch.nn.Linear(2, 2).double()
    opt2 = dopt.DistributedAllreduceOptimizer(torch.optim.SGD(head.parameters(), lr=0.1), model=head)
    opt2.add_param_group({"params": body.parameters()})
    head(body(torch.ones(1, 2, dtype=torch.float64))).sum().backward()
    before = body.weight.detach().clone()
    out["added"] = R._expect(opt2.step, RuntimeError)
    out["added_untouched"] = torch.equal(before, body.weight)
    # load_state_dict on the wrapper: the original optimizer (and a scheduler made on it) still share
    orig = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(orig, step_size=1, gamma=0.5)
    opt3 = dopt.DistributedAllreduceOptimizer(orig, model=head)
    opt3.load_state_dict(opt3.state_dict())
    sched.step()
    out["shared"] = (opt3.param_groups is orig.param_groups, opt3.state is orig.state)
    out["lr_seen"] = opt3.param_groups[0]["lr"]
    C.destroy_process_group()
    return out


def test_wrapper_with_fuse_step_added_groups_and_loaded_state():
    # fuse_step on a wrapped fused optimizer stepped with the local gradient (no communication);
    # a group added after wrapping was stepped with local gradients; load_state_dict unshared the
    # original's param_groups (a scheduler on it stopped acting). All silent before.
    for r in run_ranks(wrapper_lifecycle_ranks, 2, ENGINE, timeout=90):
        assert r["fused_weight"] == [-3.0, -3.0, -3.0]
        assert r["added"] == (
            "RuntimeError: DistributedAllreduceOptimizer: param_groups[1]['params'][0] was added to the "
            "optimizer after it was wrapped (add_param_group), so it is not averaged across ranks, but it "
            "has a gradient now; add the param group to the original optimizer and wrap it again"
        )
        assert r["added_untouched"] is True
        assert r["shared"] == (True, True) and r["lr_seen"] == 0.05


def test_lbfgs_is_refused_with_the_reason():
    from trainloom.comm import optimizers as dopt

    lin = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError) as info:
        dopt.DistributedAllreduceOptimizer(torch.optim.LBFGS(lin.parameters()), comm=None)
    assert str(info.value) == (
        "DistributedAllreduceOptimizer: LBFGS evaluates its closure several times per step (line search), "
        "and the wrapper averages one gradient per step; the steps would use local gradients. Use a "
        "first-order optimizer, or average the gradients inside the closure yourself"
    )


def synchronize_then_step_ranks(rank: int, ws: int, engine: str) -> dict:
    """opt.synchronize() (to clip or inspect before the update), then step() or fuse_step()."""
    import trainloom.comm.bluefog as bf
    from trainloom.optim import fuse_optimizer

    R._engine(engine)
    bf.init(lambda n: bf.RingGraph(n, 2))  # rank r receives from r - 1: half its own, half r - 1's
    out: dict = {}
    # neighbour mode, lr=0: the parameters are the neighbour average itself, once
    w = torch.nn.Parameter(torch.full((1,), float(rank), dtype=torch.float64))
    opt = bf.DistributedNeighborAllreduceOptimizer(torch.optim.SGD([w], lr=0.0), [("w", w)])
    (w * 0).sum().backward()
    opt.synchronize()
    opt.synchronize()  # again before the next backward: nothing to do
    out["neighbor_synchronized"] = w.item()
    opt.step()
    out["neighbor_stepped"] = w.item()
    opt.zero_grad()
    (w * 0).sum().backward()
    opt.step()  # the next step communicates again
    out["neighbor_next_step"] = w.item()
    # gradient mode: a change to the averaged gradient after synchronize() reaches the update
    # (step() used to average the changed gradients again), with step() and with fuse_step()
    for fused in (False, True):
        m = _weight0()
        inner = torch.optim.SGD(m.parameters(), lr=1.0)
        opt = bf.DistributedAllreduceOptimizer(
            fuse_optimizer(inner) if fused else inner, m.named_parameters()
        )
        (m.weight * (rank + 1)).sum().backward()
        opt.synchronize()
        out[f"averaged fused={fused}"] = m.weight.grad.item()
        m.weight.grad.mul_(rank + 1)  # a per-rank change, e.g. a clip with this rank's norm
        opt.fuse_step() if fused else opt.step()
        out[f"weight fused={fused}"] = m.weight.item()
    bf.shutdown()
    return out


def test_step_after_an_explicit_synchronize_does_not_communicate_again():
    """synchronize() is Bluefog's "finish this step's communication now": step() used to communicate
    a second time, which averaged the neighbour-averaged parameters again (W W x instead of W x) and
    undid a per-rank change to the averaged gradients."""
    ws = 3
    res = run_ranks(synchronize_then_step_ranks, ws, ENGINE, timeout=90)
    mean = sum(r + 1 for r in range(ws)) / ws
    for rank, r in enumerate(res):
        left = (rank - 1) % ws
        once = 0.5 * rank + 0.5 * left
        assert r["neighbor_synchronized"] == r["neighbor_stepped"] == once, (rank, r)
        assert r["neighbor_next_step"] == 0.5 * once + 0.5 * (0.5 * left + 0.5 * ((left - 1) % ws)), (rank, r)
        for fused in (False, True):
            assert r[f"averaged fused={fused}"] == mean, (rank, r)
            assert r[f"weight fused={fused}"] == -mean * (rank + 1), (rank, r)


def fused_under_wrapper_ranks(rank: int, ws: int, engine: str) -> dict:
    """Both wrappers over fused optimizers whose update goes through torch's own step (Adam's first
    step, Adagrad always) against the same wrappers over the plain optimizers."""
    import trainloom.comm.bluefog as bf
    from trainloom.optim import fuse_optimizer

    R._engine(engine)
    bf.init(lambda n: bf.RingGraph(n, 2))
    out: dict = {}
    for wrap in (bf.DistributedNeighborAllreduceOptimizer, bf.DistributedAllreduceOptimizer):
        for name in ("SGD", "Adam", "Adagrad"):
            got = []
            for fused in (False, True):
                torch.manual_seed(0)
                m = torch.nn.Linear(3, 2).double()
                with torch.no_grad():
                    for p in m.parameters():
                        p.add_(rank)  # different weights per rank: the average shows
                inner = getattr(torch.optim, name)(m.parameters(), lr=0.1)
                opt = wrap(fuse_optimizer(inner) if fused else inner, m.named_parameters())
                x = torch.ones(4, 3, dtype=torch.float64) * (rank + 1)
                for _ in range(3):
                    opt.zero_grad()
                    m(x).square().sum().backward()
                    opt.fuse_step() if fused else opt.step()
                got.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]).tolist())
            out[f"{wrap.__name__} {name}"] = got
    bf.shutdown()
    return out


def test_fused_optimizers_under_a_wrapper_communicate_once_per_step():
    """fuse_step of a wrapped fused optimizer ran the wrapper's step() again wherever torch's own
    update is used (Adam's first step, Adagrad): the neighbour optimizer averaged twice, and with more
    than one parameter the second round raised a false 'added after it was wrapped' error."""
    res = run_ranks(fused_under_wrapper_ranks, 2, ENGINE, timeout=120)
    for r in res:
        for key, (plain, fused) in r.items():
            assert fused == pytest.approx(plain, rel=1e-12, abs=1e-12), key
