"""The early torch.distributed launcher (the distributed tutorial's ``init_processes`` with one
``multiprocessing.Process`` per rank and only MASTER_ADDR/MASTER_PORT set) over trainloom.comm.classic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from multiproc import free_port

SCRIPT = """
import os, sys
import torch
import torch.multiprocessing as mp
import trainloom.comm.classic as dist
import trainloom.comm as tc


def run(rank, size, q):
    out = {"local": (tc.get_local_rank(), tc.get_local_size())}
    # the tutorial's ring exchange, with messages larger than the shm pair channel (4 MiB): each
    # rank isends to the right and receives from the left
    send = torch.full((1 << 20,), float(rank))
    recv = torch.empty(1 << 20)
    req = dist.isend(send, (rank + 1) % size)
    dist.recv(recv, (rank - 1) % size)
    req.wait()
    out["ring"] = float(recv[0]) == (rank - 1) % size and bool((recv == recv[0]).all())
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t, op=dist.reduce_op.SUM, group=0)  # pre-0.4 world group id
    out["group0"] = t.tolist()
    try:
        dist.all_reduce(t, group=1)
    except TypeError as exc:
        out["group1"] = str(exc)
    q.put((rank, out))


def init_processes(rank, size, fn, q, mode, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    os.environ["TRAINLOOM_NODE_ID"] = str(rank // 2)  # two logical nodes: ranks {0, 1} and {2}
    if mode == "env":
        dist.init_process_group("gloo", rank=rank, world_size=size)
    else:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=size)
    fn(rank, size, q)
    dist.destroy_process_group()


if __name__ == "__main__":
    size, mode, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=init_processes, args=(r, size, run, q, mode, port)) for r in range(size)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    print(repr([results[r] for r in range(size)]))
    sys.exit(max(p.exitcode for p in procs))
"""


@pytest.mark.parametrize("mode", ["env", "tcp"])
def test_tutorial_launcher_with_multiprocessing_runs(mode, tmp_path: Path) -> None:
    script = tmp_path / "tuto.py"
    script.write_text(SCRIPT)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    }
    env["TRAINLOOM_COMM_TIMEOUT"] = "30"
    out = subprocess.run(
        [sys.executable, str(script), "3", mode, str(free_port())],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr of dicts
    for rank, r in enumerate(results):
        assert r["local"] == [(0, 2), (1, 2), (0, 1)][rank]  # from the ranks that share its node
        assert r["ring"] is True
        assert r["group0"] == [6.0, 6.0]
        assert r["group1"] == (
            "all_reduce: group must be a ProcessGroup from new_group(), group.WORLD or None (the world), "
            "got int 1"
        )
