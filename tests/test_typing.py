"""trainloom's annotations type-check, and a user's script sees real types through them (PEP 561).

mypy runs once, on the package (with pyproject.toml's [tool.mypy] settings) and on a short script
written the way a training script uses trainloom. A fresh cache directory keeps the run independent
of earlier ones (about 15 s on 2 cores).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trainloom

ROOT = Path(trainloom.__file__).resolve().parent.parent

USER_SCRIPT = """
import torch

from trainloom.comm import allreduce
from trainloom.data import CacheLoader, LoadBalancingDistributedSampler
from trainloom.data.stores import LmdbStore
from trainloom.optim import fuse_optimizer

model = torch.nn.Linear(4, 4)
optimizer = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
optimizer.fuse_step()
optimizer.zero_grad()
reveal_type(optimizer)

with LmdbStore("/tmp/x", namespace="n") as store:
    reveal_type(store)

loader = CacheLoader(backend="lmdb", dataset_name="d")
reveal_type(loader.get("k", lambda key: 1))
sampler = LoadBalancingDistributedSampler(None, complexities=[1, 2, 3])
reveal_type(sampler.plan_stats())
work = allreduce(torch.ones(2), torch.zeros(2), async_op=True)
reveal_type(work)
if work is not None:
    work.wait()

# Misuse a type checker must report (the test checks that it does):
optimizer.fuse_stepp()
sampler.set_epoch("1")
"""


@pytest.fixture(scope="module")
def mypy_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    pytest.importorskip("mypy", reason="mypy is in the test extras: pip install -e '.[test]'")
    tmp = tmp_path_factory.mktemp("typing")
    script = tmp / "user_script.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp / "cache"), "--no-error-summary",
         "--config-file", str(ROOT / "pyproject.toml"), str(ROOT / "trainloom"), str(script)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # Lines about the script start with its path; the rest are about the package.
    return (proc.stdout + proc.stderr).replace(str(script), "user_script.py")


def test_the_package_type_checks(mypy_output: str) -> None:
    problems = [line for line in mypy_output.splitlines() if not line.startswith("user_script.py:")]
    assert problems == [], "\n".join(problems)


def test_a_user_script_sees_the_public_types(mypy_output: str) -> None:
    out = "\n".join(line for line in mypy_output.splitlines() if line.startswith("user_script.py:"))
    revealed = [
        re.sub(r"^Union\[(.*), None\]$", r"\1 | None", t.replace("builtins.", ""))  # older mypy spelling
        for t in re.findall(r'note: Revealed type is "([^"]+)"', out)
    ]
    assert revealed == [
        "trainloom.optim.fused.FusedOptimizer",
        "trainloom.data.stores.lmdb_store.LmdbStore",
        "int",
        "dict[str, Any]",
        "trainloom.comm.work.Work | None",
    ], out
    errors = re.findall(r"error: (.*)", out)
    assert errors == [
        '"FusedOptimizer" has no attribute "fuse_stepp"; maybe "fuse_step"?  [attr-defined]',
        'Argument 1 to "set_epoch" of "LoadBalancingDistributedSampler" has incompatible type "str"; '
        'expected "int"  [arg-type]',
    ], out


def test_the_package_ships_its_py_typed_marker() -> None:
    # PEP 561: without it, a user's type checker treats every trainloom name as Any.
    assert (ROOT / "trainloom" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'\[tool\.setuptools\.package-data\]\ntrainloom = \["py\.typed"\]', pyproject)
