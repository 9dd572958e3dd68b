"""A missing or stale compiled module gives an ImportError that says how to rebuild."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import trainloom
from trainloom import _build_check

ROOT = Path(trainloom.__file__).resolve().parent.parent


def test_missing_module_names_it_and_the_rebuild_command():
    with pytest.raises(ImportError) as info:
        _build_check.import_compiled("trainloom._does_not_exist")
    msg = str(info.value)
    assert "'trainloom._does_not_exist' could not be imported" in msg
    assert "No compiled file _does_not_exist.*.so" in msg
    assert "pip install -e ." in msg and "build_ext --inplace" in msg
    assert info.value.name == "trainloom._does_not_exist"


def test_stale_module_is_reported(monkeypatch):
    pytest.importorskip("trainloom._build_info")
    from trainloom._build_info import BUILD_INFO

    name = "trainloom._openmp_helpers"
    if not (ROOT / "pyx" / "_openmp_helpers.pyx").exists():
        pytest.skip("installed without sources: nothing can be stale")
    monkeypatch.delenv("TRAINLOOM_ALLOW_STALE", raising=False)
    hashes = dict(BUILD_INFO["source_hashes"])
    hashes[name] = "0" * 64
    monkeypatch.setitem(BUILD_INFO, "source_hashes", hashes)
    with pytest.raises(
        ImportError, match=r"'trainloom._openmp_helpers' is stale: .*_openmp_helpers.pyx changed"
    ):
        _build_check.import_compiled(name)
    # The developers' escape hatch turns the check off.
    monkeypatch.setenv("TRAINLOOM_ALLOW_STALE", "1")
    assert _build_check.import_compiled(name).openmp_enabled() in (True, False)


def test_current_build_is_not_stale():
    assert _build_check.import_compiled("trainloom._openmp_helpers").openmp_enabled() in (True, False)


def test_openmp_runtime_forks_threads():
    from trainloom import _openmp_helpers as omp

    if not omp.openmp_enabled():
        pytest.skip("built without OpenMP")
    assert omp.openmp_threads_used(2) == 2
    with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
        omp.openmp_threads_used(0)


def test_build_without_openmp_warns_and_runs_serially(tmp_path):
    """A real build with TRAINLOOM_NO_OPENMP=1 (what a compiler without OpenMP gets)."""
    if not (ROOT / "setup.py").exists():
        pytest.skip("installed without sources")
    work = tmp_path / "src"
    (work / "pyx").mkdir(parents=True)
    (work / "trainloom").mkdir()
    shutil.copy(ROOT / "setup.py", work)
    for f in (ROOT / "pyx").glob("*.pxd"):
        shutil.copy(f, work / "pyx")
    shutil.copy(ROOT / "pyx" / "_openmp_helpers.pyx", work / "pyx")
    env = {"PATH": "/usr/bin:/bin", "TRAINLOOM_NO_OPENMP": "1", "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "WARNING: building trainloom WITHOUT OpenMP (TRAINLOOM_NO_OPENMP is set)" in out.stderr
    assert "OpenMP            : NO" in out.stderr
    so = next((work / "trainloom").glob("_openmp_helpers.*.so"))
    loader = importlib.machinery.ExtensionFileLoader("trainloom._openmp_helpers", str(so))
    spec = importlib.util.spec_from_file_location("trainloom._openmp_helpers", so, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    assert mod.openmp_enabled() is False
    assert mod.openmp_max_threads() == 1
    assert mod.openmp_threads_used(4) == 1
    info = (work / "trainloom" / "_build_info.py").read_text()
    assert "'openmp': False" in info and "'openmp_disabled_by_env': True" in info
