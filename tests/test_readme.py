"""Every ``python`` code block of README.md runs, as written, in a fresh interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S) if README.exists() else []


def test_readme_has_examples() -> None:
    if not README.exists():
        pytest.skip("installed without the source checkout")
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["TRAINLOOM_CACHE_DIR"] = str(tmp_path)
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"README example {index} failed:\n{BLOCKS[index]}\n{out.stderr[-3000:]}"


DISTRIBUTED = [i for i, block in enumerate(BLOCKS) if "init_process_group()" in block]


def test_readme_has_a_distributed_example() -> None:
    if not README.exists():
        pytest.skip("installed without the source checkout")
    assert DISTRIBUTED


@pytest.mark.parametrize("index", DISTRIBUTED)
def test_readme_distributed_example_runs_under_torchrun(index: int, tmp_path: Path) -> None:
    """The examples that call init_process_group() also run as 2 processes, as users launch them."""
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[index])
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["TRAINLOOM_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, (
        f"README example {index} failed on 2 ranks:\n{BLOCKS[index]}\n{out.stderr[-3000:]}"
    )
