"""Exact message of the NCCL binding's alltoall_v argument check.

trainloom.comm's alltoall_v checks the counts first ("... has N entries, expected W (one per
rank)"), so this guard of trainloom.comm._nccl is reached only by calling the binding directly; a
missing one would read past the count arrays. Runs on the fake libnccl in a process of its own
(the test process must not load a libnccl)."""

from __future__ import annotations

import array
from typing import Any, Dict

from commutil import build_fake_nccl
from multiproc import run_ranks


def _alltoall_v_short_counts(rank: int, ws: int) -> Dict[str, Any]:
    import torch

    from trainloom.comm import _nccl, nccl

    comm = _nccl.Communicator(1, nccl.get_unique_id(), 0)
    x = torch.zeros(4)
    one, none = array.array("q", [1]), array.array("q")
    out: Dict[str, Any] = {}
    for name, counts in (("send_counts", (none, one, one, one)), ("recv_displs", (one, one, one, none))):
        try:
            comm.alltoall_v(x.data_ptr(), counts[0], counts[1], x.data_ptr(), counts[2], counts[3], 4, 7, 0)
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(exc).__name__}: {exc}"
    comm.close()
    return out


def test_alltoall_v_counts_of_the_wrong_length(tmp_path):
    lib = build_fake_nccl(tmp_path)
    (res,) = run_ranks(_alltoall_v_short_counts, 1, env={"TRAINLOOM_NCCL_LIBRARY": lib})
    msg = "ValueError: alltoall_v: counts and displacements need one entry per rank (1) each"
    assert res == {"send_counts": msg, "recv_displs": msg}
