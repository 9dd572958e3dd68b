"""Samplers inside real DataLoaders with 2 workers, resume under prefetching, and the benchmark."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

ROOT = Path(__file__).resolve().parents[2]


class Tokens(Dataset):
    """Variable-length samples: item i is a tensor of lens[i] copies of i."""

    def __init__(self, lens):
        self.lens = np.asarray(lens)

    def __len__(self):
        return len(self.lens)

    def __getitem__(self, i):
        return torch.full((int(self.lens[i]),), i, dtype=torch.int64)


def collate_ids(batch):
    return [int(x[0]) for x in batch]


LENS = np.random.default_rng(21).integers(1, 60, 600)


def make(mode="packed", rank=1):
    s = LoadBalancingDistributedSampler(Tokens(LENS), complexities=LENS, num_replicas=2, rank=rank, seed=5)
    s.set_epoch(2)
    return LoadBalancingDistributedBatchSampler(s, max_complexity=400, mode=mode)


def test_batch_sampler_in_a_two_worker_dataloader_and_resume_counts_consumed_batches():
    ds = Tokens(LENS)
    ref = list(make())
    loaded = list(DataLoader(ds, batch_sampler=make(), num_workers=2, collate_fn=collate_ids))
    assert loaded == ref  # workers deliver the sampler's batches, in order
    for batch in loaded:
        assert sum(LENS[batch]) <= 400

    bs = make()
    loader = DataLoader(ds, batch_sampler=bs, num_workers=2, prefetch_factor=2, collate_fn=collate_ids)
    got = []
    for batch in bs.track(loader):
        got.append(batch)
        if len(got) == 5:
            break
    assert bs._position > 5  # the DataLoader drew batches ahead of the loop...
    state = bs.state_dict()
    assert state["consumed"] == 5  # ...but the state counts the 5 the loop received
    del loader

    resumed = make()
    resumed.load_state_dict(state)
    rest = list(DataLoader(ds, batch_sampler=resumed, num_workers=2, collate_fn=collate_ids))
    assert got + rest == ref


def test_plain_sampler_in_a_two_worker_dataloader():
    ds = Tokens(LENS)
    samplers = [
        LoadBalancingDistributedSampler(ds, complexities=LENS, num_replicas=2, rank=r) for r in range(2)
    ]
    outs = []
    for s in samplers:
        loader = DataLoader(ds, sampler=s, batch_size=16, num_workers=2, collate_fn=collate_ids)
        outs.append([i for batch in loader for i in batch])
    assert outs[0] == samplers[0].rank_indices().tolist() and len(outs[0]) == len(outs[1]) == 300
    assert sorted(outs[0] + outs[1]) == list(range(600))


def test_benchmark_quick_run(tmp_path):
    env = dict(os.environ, TRAINLOOM_BENCH_LOCK=str(tmp_path / "bench.lock"))
    cmd = [
        sys.executable,
        "-m",
        "trainloom.cli",
        "bench",
        "sampler",
        "--quick",
        "--out",
        str(tmp_path / "out"),
        "--cache",
        str(tmp_path / "lengths.npy"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "out" / "sampler.md").read_text()
    assert "Plan time per rank" in report and "straggler" in report
    # The first-plan (fresh interpreter) table has a figure for packed mode in --quick.
    cold = [ln for ln in report.splitlines() if ln.startswith("| 2,000 | 2 | - | - |")]
    assert len(cold) == 1 and float(cold[0].split("|")[-2]) > 0
    assert (tmp_path / "out" / "sampler_plan_time.png").stat().st_size > 0
    assert np.load(tmp_path / "lengths.npy").size > 100
