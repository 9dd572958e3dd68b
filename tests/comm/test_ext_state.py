"""broadcast_parameters / broadcast_optimizer_state in real 2- and 3-process runs."""

from __future__ import annotations

import pytest
import test_ext_ranks as R
import torch
from commutil import engines
from multiproc import run_ranks

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
    assert (
        "(rank 1: entry 0: here ('w', (4,), 'float32'), on the root ('w', (3,), 'float32'))"
        in res[1]["layout"]
    )
    assert "parameter group sizes [1], root has [2]" in res[1]["opt_layout"]
