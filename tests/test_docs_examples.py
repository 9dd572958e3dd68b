"""Every ``python`` code block of docs/*.md runs, as written, in a fresh interpreter.

A block that names ``--nproc_per_node=N`` (in the block or in the two lines before it) runs under
torchrun with N processes, as its text tells users to launch it. The blocks that cannot run here are
listed in NOT_RUN with the reason; every other block must run, so a new example is tested as soon as
it is written.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
NPROC = re.compile(r"--nproc_per_node=(\d+)")

# (doc file, a line that only that block has) -> why it is not run.
NOT_RUN = {
    ("cache.md", '{"host": "10.0.0.1", "port": 7000, "password": "..."},'): (
        "connects to Redis servers on other machines"
    ),
}


class Block(NamedTuple):
    doc: str
    index: int
    code: str
    nproc: int  # 0: a plain script


def _blocks() -> List[Block]:
    out = []
    for path in sorted(DOCS.glob("*.md")) if DOCS.is_dir() else []:
        text = path.read_text()
        for i, m in enumerate(re.finditer(r"```python\n(.*?)```", text, flags=re.S)):
            lead = "\n".join(text[: m.start()].rstrip().splitlines()[-2:])
            nproc = NPROC.search(m.group(1)) or NPROC.search(lead)
            out.append(Block(path.name, i, m.group(1), int(nproc.group(1)) if nproc else 0))
    return out


BLOCKS = _blocks()


def _has_line(block: Block, doc: str, line: str) -> bool:
    return block.doc == doc and line in (x.strip() for x in block.code.splitlines())


RUN = [b for b in BLOCKS if not any(_has_line(b, doc, line) for doc, line in NOT_RUN)]


def test_docs_have_examples_and_every_excluded_block_exists() -> None:
    if not DOCS.is_dir():
        pytest.skip("installed without the source checkout")
    assert len(RUN) >= 10
    for doc, line in NOT_RUN:  # an exclusion outlives its block only by mistake
        assert any(_has_line(b, doc, line) for b in BLOCKS), (doc, line)


@pytest.mark.parametrize("block", RUN, ids=[f"{b.doc}:{b.index}" for b in RUN])
def test_docs_example_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(block.code)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["TRAINLOOM_CACHE_DIR"] = str(tmp_path / "cache")
    env["TMPDIR"] = str(tmp_path)
    cmd = [sys.executable, str(script)]
    if block.nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node", str(block.nproc), str(script)]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, (
        f"docs/{block.doc} example {block.index} failed:\n{block.code}\n"
        f"{out.stdout[-1500:]}{out.stderr[-3000:]}"
    )
