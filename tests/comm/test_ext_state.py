"""broadcast_parameters / broadcast_optimizer_state in real 2- and 3-process runs."""

from __future__ import annotations

import pytest
import test_ext_ranks as R
import torch
from commutil import engines
from multiproc import run_ranks

import trainloom.comm as C
from trainloom.comm import state as st
from trainloom.errors import CommError

ENGINES = engines()


@pytest.mark.parametrize("ws,engine", [(3, ENGINES[-1]), (2, "gloo")])
def test_broadcast_parameters_and_optimizer_state(ws, engine):
    res = run_ranks(R.state_suite, ws, engine, timeout=90)
    root = ws - 1
    want = R._flat(R._model(100 + root))
    for rank, r in enumerate(res):
        assert r["state_dict"] == want  # weights, biases and the int64 buffer
        assert r["named"] == [p.detach().reshape(-1).tolist() for p in R._model(200).parameters()]
        assert r["named_buffer_untouched"] == 200 + rank  # named_parameters() has no buffers
        assert r["list"] == [p.detach().reshape(-1).tolist() for p in R._model(300).parameters()]
        assert r["dict"] == [(torch.arange(6.0).view(2, 3)).t().tolist(), [0, 0]]
        for kind in ("adam", "sgd", "rmsprop", "adamw_capturable_off"):
            assert r[f"{kind}/nstate"] == 4, kind  # rank 0 stepped; the others got its state
            assert r[f"{kind}/params"] == res[0][f"{kind}/params"], kind
            assert r[f"{kind}/state"] == res[0][f"{kind}/state"], kind
        assert r["adam/lr"] == 0.01 and r["sgd/lr"] == pytest.approx(0.1)
        assert r["object"] == {"a": [1, 2], "rank": 0}
        assert r["bad_params"].startswith(
            "TypeError: broadcast_parameters: params must be a state_dict, named_parameters(), a dict or a "
            "list of tensors, got a single tensor"
        )
        assert r["bad_entry"] == "TypeError: broadcast_parameters: params entry 1 is int, not a tensor"
        assert r["bad_pair"] == (
            "TypeError: broadcast_parameters: params entry 0 is str; expected a (name, tensor) pair"
        )
        assert r["bad_root"] == (
            f"ValueError: broadcast_parameters: root_rank={ws} is outside the communicator's ranks "
            f"0..{ws - 1}"
        )
        assert r["bad_root_type"] == "TypeError: broadcast_parameters: root_rank must be an int, got '0'"
        assert r["bad_opt"].startswith(
            "TypeError: broadcast_optimizer_state: optimizer must be a torch.optim"
        )
        assert r["layout"].startswith(
            f"CommError: broadcast_parameters: ranks {list(range(1, ws))} do not have the same layout as "
            "root rank 0"
        )
        assert r["opt_layout"].startswith(
            f"CommError: broadcast_optimizer_state: ranks {list(range(1, ws))} do not have the same layout"
        )
    for r in res:  # the same message on every rank, naming the first difference on the lowest rank
        assert r["layout"] == res[0]["layout"] and r["opt_layout"] == res[0]["opt_layout"]
        assert (
            "(rank 1: entry 0: here ('w', (4,), 'float32'), on the root ('w', (3,), 'float32'))"
            in r["layout"]
        )
        assert "(rank 1: parameter group sizes [1], root has [2])" in r["opt_layout"]


# ---------------------------------------------------------------------------- rank functions
# Module level so that run_ranks can pickle them by reference.


def object_failure_ranks(rank: int, ws: int, engine: str) -> dict:
    """An object the root cannot pickle: every rank raises in the same call and stays in step."""
    R._engine(engine)
    C.init_process_group(timeout=30)
    out: dict = {}
    out["call1"] = R._expect(st.broadcast_object, TypeError, (lambda: 1) if rank == 0 else None, 0)
    out["call2"] = st.broadcast_object("config-A" if rank == 0 else None, 0)
    out["call3"] = st.broadcast_object("config-B" if rank == 0 else None, 0)
    # broadcast_optimizer_state sends the root's state_dict() the same way
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1 * (rank + 1))
    if rank == 0:
        opt.param_groups[0]["schedule"] = lambda step: step
    out["opt"] = R._expect(st.broadcast_optimizer_state, TypeError, opt, 0)
    out["opt_lr_unchanged"] = opt.param_groups[0]["lr"]
    out["call4"] = st.broadcast_object({"after": rank == 0} if rank == 0 else None, 0)
    C.destroy_process_group()
    return out


def test_broadcast_object_unpicklable_raises_on_every_rank_in_the_same_call():
    res = run_ranks(object_failure_ranks, 2, ENGINES[-1], timeout=60)
    assert res[0]["call1"] == res[1]["call1"]
    assert res[0]["call1"].startswith(
        "TypeError: broadcast_object: root rank 0 could not pickle the object (a builtins.function): "
    )
    assert "<lambda>" in res[0]["call1"]  # the pickling error's own text names the lambda
    assert res[0]["opt"] == res[1]["opt"]
    assert res[0]["opt"].startswith(
        "TypeError: broadcast_optimizer_state: root rank 0 could not pickle its optimizer state_dict(): "
    )
    for rank, r in enumerate(res):
        assert r["call2"] == "config-A" and r["call3"] == "config-B"
        assert r["opt_lr_unchanged"] == pytest.approx(0.1 * (rank + 1))
        assert r["call4"] == {"after": True}


class _FailingSGD(torch.optim.SGD):
    """SGD whose next load_state_dict raises after loading (a half-loaded optimizer), if asked to."""

    fail_next_load = False

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102
        super().load_state_dict(state_dict)
        if self.fail_next_load:
            self.fail_next_load = False
            raise RuntimeError("boom")


def optimizer_mismatch_ranks(rank: int, ws: int, engine: str) -> dict:
    """Shapes and classes that differ from the root's: CommError everywhere, nothing loaded."""
    from trainloom.comm import optimizers as dopt

    R._engine(engine)
    C.init_process_group(timeout=30)
    out: dict = {}

    def snapshot(opt: torch.optim.Optimizer) -> dict:
        sd = opt.state_dict()
        return {
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]],
            "state": {
                k: {n: torch.as_tensor(v).tolist() for n, v in s.items()} for k, s in sd["state"].items()
            },
        }

    # same counts, different shapes (root Linear(3, 2), the other ranks Linear(2, 3)), Adam stepped
    torch.manual_seed(rank)
    m = torch.nn.Linear(3, 2) if rank == 0 else torch.nn.Linear(2, 3)
    opt = torch.optim.Adam(m.parameters(), lr=0.01 * (rank + 1))
    m(torch.ones(1, m.in_features)).sum().backward()
    opt.step()
    before = snapshot(opt)
    out["shapes"] = R._expect(st.broadcast_optimizer_state, CommError, opt, 0)
    out["shapes_unchanged"] = snapshot(opt) == before
    opt.step()  # still a working Adam
    # different classes: SGD with momentum on the root, Adam elsewhere
    m = torch.nn.Linear(2, 2)
    opt = (
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        if rank == 0
        else torch.optim.Adam(m.parameters())
    )
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    before = snapshot(opt)
    out["classes"] = R._expect(st.broadcast_optimizer_state, CommError, opt, 0)
    out["classes_unchanged"] = snapshot(opt) == before
    opt.step()  # not half-loaded: Adam still steps (before: KeyError 'betas')
    # load_state_dict failing half-way on one rank anyway: that rank's previous state is put back
    m = torch.nn.Linear(2, 2)
    opt = _FailingSGD(m.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    opt.fail_next_load = rank == 1
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    before = snapshot(opt)
    out["load_fails"] = R._expect(st.broadcast_optimizer_state, CommError, opt, 0)
    out["load_fails_unchanged"] = snapshot(opt) == before
    # a wrapped optimizer compares as the class it wraps
    m = torch.nn.Linear(2, 2)
    base = torch.optim.SGD(m.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    opt = dopt.DistributedAllreduceOptimizer(base) if rank == 0 else base
    st.broadcast_optimizer_state(opt, 0)
    out["wrapped_lr"] = opt.param_groups[0]["lr"]
    C.destroy_process_group()
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_broadcast_optimizer_state_checks_class_and_shapes_before_loading(ws):
    res = run_ranks(optimizer_mismatch_ranks, ws, ENGINES[-1], timeout=90)
    others = list(range(1, ws))
    for r in res:
        head = f"CommError: broadcast_optimizer_state: ranks {others} do not have the same layout as root "
        tail = "; build the same model/optimizer on every rank before broadcasting"
        assert r["shapes"] == (
            f"{head}rank 0 (rank 1: param_groups[0] parameter 0 has shape (3, 2) here, (2, 3) on the "
            f"root){tail}"
        )
        assert r["classes"] == (
            f"{head}rank 0 (rank 1: optimizer class torch.optim.adam.Adam here, torch.optim.sgd.SGD on the "
            f"root){tail}"
        )
        assert r["shapes_unchanged"] is True and r["classes_unchanged"] is True
        assert r["wrapped_lr"] == pytest.approx(0.1)
    # rank 1 restored its own state; the root and rank 2 (ws 3) loaded normally
    assert [r["load_fails_unchanged"] for r in res] == [True, True, False][:ws]
    assert [r["load_fails"] for rank, r in enumerate(res) if rank != 1] == ["no error"] * (ws - 1)
    assert res[1]["load_fails"] == (
        "CommError: broadcast_optimizer_state: rank 1 could not load root's optimizer state (RuntimeError: "
        "boom); its optimizer was left unchanged"
    )


def test_numpy_integers_are_ranks_dims_and_counts_in_the_extension_apis():
    res = run_ranks(R.numpy_integer_ranks, 2, timeout=60)
    for rank, r in enumerate(res):
        left = (rank - 1) % 2
        assert r["group"] == ["int", "int"]
        assert r["object"] == "from 1"
        assert r["all_gather"] == [0.0, 0.0, 1.0, 1.0]
        assert r["broadcast"] == [1.0, 1.0]
        assert r["neighbor"] == [0.5 * rank + 0.5 * left] * 2
        assert r["window"] == [float(left)] * 2
        assert r["passes"] == "int" and r["buckets"] == 2
