"""tools/bench_cache.py runs end to end with tiny sizes (a smoke test; nothing is timed here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_cache.py"


@pytest.mark.timeout(170)
def test_bench_cache_quick(tmp_path):
    env = dict(os.environ, TRAINLOOM_BENCH_LOCK=str(tmp_path / "bench.lock"))  # never wait for real runs
    cmd = [sys.executable, str(BENCH), "--quick", "--small", "256", "--images", "32", "--objects", "64"]
    cmd += ["--out", str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=160)
    assert out.returncode == 0, out.stderr[-3000:]
    report = (tmp_path / "cache.md").read_text()
    for row in (
        "CachedDataset (LMDB)",
        "raw py-lmdb get",
        "miss epoch (LMDB)",
        "DataLoader 2 workers: uncached",
    ):
        for kind in ("small", "image", "objects"):
            assert f"| {kind} | {row} |" in report, (kind, row)
    assert "CachedDataset(LMDB) / raw py-lmdb get" in report
    # objects (dataclass annotations) only: the raw py-lmdb + pickle loop is their peer
    assert "| objects | raw py-lmdb get + pickle.loads |" in report
    assert "| small | raw py-lmdb get + pickle.loads |" not in report
    assert "objects: CachedDataset(LMDB) / raw py-lmdb get + pickle.loads = " in report
    assert "objects n=64 (50 boxes each)" in report
    assert (tmp_path / "cache.png").stat().st_size > 0
