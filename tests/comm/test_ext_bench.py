"""The neighbour benchmark runs end to end (--quick, tiny sizes; not timed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def test_bench_neighbor_quick(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "bench_neighbor.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "neighbor.md").read_text()
    assert "| topology | in-degree | size | exchange us | allgather us | torch p2p us |" in report
    assert "| ring | 1 | 4K |" in report and "| full | 1 | 4K |" in report
    assert (tmp_path / "neighbor.png").stat().st_size > 0
