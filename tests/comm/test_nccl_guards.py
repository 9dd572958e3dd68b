"""Exact message of the NCCL binding's alltoall_v argument check, and library paths that are not UTF-8.

trainloom.comm's alltoall_v checks the counts first ("... has N entries, expected W (one per
rank)"), so this guard of trainloom.comm._nccl is reached only by calling the binding directly; a
missing one would read past the count arrays. Runs on the fake libnccl in a process of its own
(the test process must not load a libnccl)."""

from __future__ import annotations

import array
import os
import shutil
import subprocess
import sys
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


def _load(rank: int, ws: int) -> Dict[str, Any]:
    from trainloom.comm import nccl

    out: Dict[str, Any] = {"available": nccl.is_available()}
    if out["available"]:
        out.update(version=nccl.get_version(), path=nccl.library_path())
    else:
        out["reason"] = nccl.unavailable_reason()
    return out


def test_a_library_path_that_is_not_utf8(tmp_path):
    # $TRAINLOOM_NCCL_LIBRARY with a byte that is not UTF-8 (os.environ holds it as a surrogate):
    # is_available() raised UnicodeEncodeError (str.encode()), and `trainloom info` crashed with it.
    lib = build_fake_nccl(tmp_path)
    raw = os.fsencode(tmp_path) + b"/\xff-libnccl.so.2"
    shutil.copy(lib, raw)
    (res,) = run_ranks(_load, 1, env={"TRAINLOOM_NCCL_LIBRARY": os.fsdecode(raw)})
    assert res == {"available": True, "version": 21899, "path": f"{tmp_path}/\ufffd-libnccl.so.2"}

    missing = os.fsdecode(os.fsencode(tmp_path) + b"/\xfe-libnccl.so.2")
    shown = f"{tmp_path}/\ufffd-libnccl.so.2"
    reason = (
        f"NCCL unavailable: $TRAINLOOM_NCCL_LIBRARY={missing!r} could not be loaded: {shown}: {shown}: "
        "cannot open shared object file: No such file or directory\nPoint $TRAINLOOM_NCCL_LIBRARY at a "
        "loadable libnccl.so.2, or unset it to search the usual places (`pip install nvidia-nccl-cu12` "
        "provides one)."
    )
    (res,) = run_ranks(_load, 1, env={"TRAINLOOM_NCCL_LIBRARY": missing})
    assert res == {"available": False, "reason": reason}

    env = {**os.environ, "TRAINLOOM_NCCL_LIBRARY": missing, "PYTHONIOENCODING": "utf-8"}
    out = subprocess.run(
        [sys.executable, "-m", "trainloom", "info"],
        env=env,
        capture_output=True,
        encoding="utf-8",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"\n  NCCL              : no ({reason})\n" in out.stdout
