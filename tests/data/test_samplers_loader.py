"""Samplers inside real DataLoaders with 2 workers, resume under prefetching, and the benchmark."""

from __future__ import annotations

import itertools
import operator
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
from trainloom.errors import ConfigError

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


def make_plain(rank=1):
    s = LoadBalancingDistributedSampler(Tokens(LENS), complexities=LENS, num_replicas=2, rank=rank, seed=5)
    s.set_epoch(2)
    return s


def test_plain_sampler_track_counts_the_samples_the_loop_received_under_prefetch():
    ds = Tokens(LENS)
    ref = make_plain().rank_indices().tolist()
    s = make_plain()
    loader = DataLoader(
        ds, sampler=s, batch_size=16, num_workers=2, prefetch_factor=2, collate_fn=collate_ids
    )
    got = []
    for batch in s.track(loader):
        got += batch
        if len(got) == 5 * 16:
            break
    yielded = s._iter_end - operator.length_hint(s._iter)
    assert yielded > 80  # the workers' prefetch drew indices ahead of the loop...
    state = s.state_dict()
    assert state["consumed"] == 80  # ...the state counts the 5 batches the loop received
    del loader

    resumed = make_plain()
    resumed.load_state_dict(state)
    loader = DataLoader(ds, sampler=resumed, batch_size=16, num_workers=2, collate_fn=collate_ids)
    more = []
    for batch in resumed.track(loader):  # a resumed iteration counts on from the saved position
        more += batch
        if len(more) == 2 * 16:
            break
    assert resumed.state_dict()["consumed"] == 80 + 32
    assert got + more == ref[: 80 + 32]
    del loader

    again = make_plain()
    again.load_state_dict(resumed.state_dict())
    rest = [
        i for batch in DataLoader(ds, sampler=again, batch_size=16, collate_fn=collate_ids) for i in batch
    ]
    assert got + more + rest == ref


def test_plain_sampler_track_through_a_batch_sampler_and_to_the_end_of_the_epoch():
    ds = Tokens(LENS)
    s = make_plain()
    loader = DataLoader(
        ds, batch_sampler=BatchSampler(s, 7, drop_last=False), num_workers=2, collate_fn=collate_ids
    )
    seen = [i for batch in s.track(loader) for i in batch]
    assert seen == make_plain().rank_indices().tolist()
    assert s.state_dict()["consumed"] == 300  # 42 batches of 7 and one of 6, not 43 x 7
    s = make_plain()
    items = DataLoader(ds, sampler=s, batch_size=None, collate_fn=lambda x: int(x[0]))  # unbatched: 1 each
    first = list(itertools.islice(s.track(items), 9))
    assert s.state_dict()["consumed"] == 9 and first == make_plain().rank_indices()[:9].tolist()


def test_track_rejects_loaders_it_cannot_count():
    ds = Tokens(LENS)
    s = make_plain()
    other = DataLoader(ds, sampler=make_plain(), batch_size=4)
    with pytest.raises(ConfigError) as e:
        s.track(other)
    assert str(e.value) == (
        "track: the DataLoader does not draw its indices from this LoadBalancingDistributedSampler; "
        "pass the loader that was built with it"
    )
    with pytest.raises(ConfigError) as e:
        s.track(DataLoader(ds, sampler=s, batch_size=4, num_workers=2, in_order=False))
    assert str(e.value) == (
        "track: the DataLoader was built with in_order=False, so the batches it delivers are not a "
        "prefix of the epoch and a count of them cannot be resumed from; use in_order=True"
    )
    with pytest.raises(ConfigError) as e:
        s.track([3, 1, 2])
    assert str(e.value) == (
        "track: cannot tell how many samples each batch of this loader holds; pass batch_size="
    )
    with pytest.raises(ConfigError) as e:
        s.track([3, 1, 2], batch_size=0)
    assert str(e.value) == "track: batch_size must be >= 1, got 0"
    with pytest.raises(ConfigError) as e:
        s.track([3, 1, 2], batch_size=2.0)
    assert str(e.value) == "track: batch_size must be an integer, got 2.0"
    bs = make()
    with pytest.raises(ConfigError) as e:
        bs.track(DataLoader(ds, batch_sampler=make(), collate_fn=collate_ids))
    assert str(e.value) == (
        "track: the DataLoader does not draw its indices from this LoadBalancingDistributedBatchSampler; "
        "pass the loader that was built with it"
    )
    # any iterable that draws in order can be counted with an explicit batch size
    s = make_plain()
    it = s.track(iter(s), batch_size=1)
    assert [next(it) for _ in range(3)] == make_plain().rank_indices()[:3].tolist()
    assert s.state_dict()["consumed"] == 3


def test_batch_sampler_iterated_directly_after_a_tracked_epoch_counts_its_own_batches():
    # track() used to leave the batch sampler counting delivered batches for good: a later epoch
    # iterated directly reported consumed=0, and a resume replayed the epoch from its start.
    ds = Tokens(LENS)
    bs = make()
    loader = DataLoader(ds, batch_sampler=bs, collate_fn=collate_ids)  # no workers: yielded = used
    for _ in bs.track(loader):
        pass
    bs.set_epoch(3)
    for i, _ in enumerate(loader):
        if i == 4:
            break
    assert bs.state_dict()["consumed"] == 5
    bs.set_epoch(4)
    for i, _ in enumerate(bs.track(loader)):  # and tracked again
        if i == 2:
            break
    assert bs.state_dict()["consumed"] == 3


def test_the_wrapped_samplers_set_epoch_forgets_a_loaded_position():
    bs = make()
    state = bs.state_dict(consumed=5)  # epoch 2
    full = len(bs)
    again = make()
    again.load_state_dict(state)
    assert len(again) == full - 5
    again.sampler.set_epoch(4)
    again.sampler.set_epoch(2)  # back to the saved epoch through the wrapped sampler: started anew
    assert len(again) == full and len(list(again)) == full
    again.load_state_dict(state)
    assert len(again) == full - 5 and len(list(again)) == full - 5  # a fresh load applies again


def test_plain_track_on_a_budget_batch_sampler_points_to_the_batch_sampler():
    bs = make()
    loader = DataLoader(Tokens(LENS), batch_sampler=bs, collate_fn=collate_ids)
    with pytest.raises(ConfigError) as e:
        bs.sampler.track(loader)
    assert str(e.value) == (
        "track: this loader's batches come from a LoadBalancingDistributedBatchSampler, whose batches "
        "differ in size; track the batch sampler instead: batch_sampler.track(loader), and checkpoint "
        "batch_sampler.state_dict()"
    )
    b = LoadBalancingDistributedBatchSampler(bs.sampler, max_complexity=torch.tensor(400), mode="packed")
    assert b.max_complexity == 400.0 and len(b) == len(bs)


class WholeBatches(Tokens):
    """A dataset that fetches a whole batch per ``__getitem__`` (as Hugging Face datasets do)."""

    def __getitem__(self, idx):
        return [int(i) for i in idx]


def test_batch_sampler_track_counts_a_loader_that_draws_it_as_its_sampler():
    # DataLoader(sampler=batch_sampler, batch_size=None) draws whole batches from it: track()
    # used to refuse it ("does not draw its indices from this LoadBalancingDistributedBatchSampler").
    bs = make()
    loader = DataLoader(WholeBatches(LENS), sampler=bs, batch_size=None)
    got = list(itertools.islice(bs.track(loader), 4))
    assert got == list(make())[:4]
    assert bs.state_dict()["consumed"] == 4
    # Batching its batches again (batch_size=2) is not a stream of this sampler's batches.
    with pytest.raises(ConfigError) as e:
        bs.track(DataLoader(WholeBatches(LENS), sampler=bs, batch_size=2, collate_fn=list))
    assert str(e.value) == (
        "track: the DataLoader does not draw its indices from this LoadBalancingDistributedBatchSampler; "
        "pass the loader that was built with it"
    )
