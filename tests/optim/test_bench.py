"""tools/bench_optim.py runs end to end with tiny models (a smoke test; nothing is timed here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_optim.py"


def test_bench_optim_quick(tmp_path):
    env = dict(os.environ, TRAINLOOM_BENCH_LOCK=str(tmp_path / "bench.lock"))  # never wait for real runs
    cmd = [sys.executable, str(BENCH), "--quick", "--out", str(tmp_path), "--models", "mlp", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (tmp_path / "optim.md").read_text()
    assert "fuse_step (fused cfg)" in report and "| mlp | AdamW | 1 |" in report
    assert (tmp_path / "optim_mlp_adam.png").stat().st_size > 0
