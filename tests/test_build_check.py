"""A missing or stale compiled module gives an ImportError that says how to rebuild."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
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
        ImportError,
        match=r"'trainloom._openmp_helpers' is stale: .*_openmp_helpers.pyx \(or a .pxd/.pxi/.h file "
        r"under .*pyx\) changed after it was built",
    ) as info:
        _build_check.import_compiled(name)
    assert str(info.value).endswith("\n(While developing, TRAINLOOM_ALLOW_STALE=1 imports it anyway.)")
    # The developers' escape hatch turns the check off.
    monkeypatch.setenv("TRAINLOOM_ALLOW_STALE", "1")
    assert _build_check.import_compiled(name).openmp_enabled() in (True, False)


def test_current_build_is_not_stale():
    assert _build_check.import_compiled("trainloom._openmp_helpers").openmp_enabled() in (True, False)


def test_setup_and_the_stale_check_hash_alike(monkeypatch):
    # setup.py's _source_hash and _build_check.source_hash must agree on every module, including
    # those that include a header (comm/_shm includes comm/_shm_kernels.h).
    info = pytest.importorskip("trainloom._build_info")
    if not (ROOT / "pyx").is_dir():
        pytest.skip("installed without sources: nothing can be stale")
    monkeypatch.delenv("TRAINLOOM_ALLOW_STALE", raising=False)
    names = sorted(info.BUILD_INFO["source_hashes"])
    assert "trainloom.comm._shm" in names
    for name in names:
        _build_check.check_stale(name)


def _copy_package(dest: Path, setup_py: bool = False) -> None:
    """trainloom/ (with its compiled modules and build record) and pyx/ into ``dest``, as a source
    checkout built in place."""
    skip = shutil.ignore_patterns("__pycache__", "*.c", "*.html")
    shutil.copytree(ROOT / "trainloom", dest / "trainloom", ignore=skip)
    shutil.copytree(ROOT / "pyx", dest / "pyx", ignore=skip)
    if setup_py:
        shutil.copy(ROOT / "setup.py", dest)


# An editable install's finder would resolve what the copy lacks from the checkout: drop it.
_IN_COPY = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "EditableFinder" not in repr(f)]
"""

_STALE_STATES = (
    _IN_COPY
    + """
from pathlib import Path
from trainloom._build_check import check_stale
assert __import__("trainloom").__file__.startswith(sys.argv[1])

def state():
    try:
        check_stale("trainloom.comm._shm")
    except ImportError as exc:
        return str(exc).splitlines()[0]
    return "not stale"

pyx = Path(sys.argv[1]) / "pyx"
header = pyx / "comm" / "_shm_kernels.h"
original = header.read_bytes()
print(state())
header.write_bytes(original + b"/* x */\\n")
print(state())
header.write_bytes(original)
print(state())
(pyx / "data" / "_extra.pxd").write_text("cdef extern from *:\\n    pass\\n")
print(state())
"""
)


def _python_in_copy(copy: Path, code: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -c code args`` importing the package copy at ``copy`` (the stale check enabled)."""
    env = {k: v for k, v in os.environ.items() if k != "TRAINLOOM_ALLOW_STALE"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=copy,
        env={**env, "PYTHONPATH": str(copy)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_an_edited_header_makes_the_module_that_includes_it_stale(tmp_path):
    # _shm.pyx includes pyx/comm/_shm_kernels.h, but only the .pyx and the top-level pyx/*.pxd were
    # hashed: a changed header left the old kernels in use without a word.
    if not (ROOT / "pyx" / "comm" / "_shm_kernels.h").exists():
        pytest.skip("installed without sources")
    pytest.importorskip("trainloom._build_info")
    _copy_package(tmp_path)
    out = _python_in_copy(tmp_path, _STALE_STATES, str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    pyx = tmp_path / "pyx" / "comm" / "_shm.pyx"
    stale = (
        f"trainloom's compiled module 'trainloom.comm._shm' is stale: {pyx} "
        f"(or a .pxd/.pxi/.h file under {tmp_path / 'pyx'}) changed after it was built."
    )
    assert out.stdout.splitlines() == ["not stale", stale, "not stale", stale]


_INFO = _IN_COPY + "from trainloom.cli import main\nsys.exit(main(['info']))\n"


@pytest.mark.parametrize("how", ["stale", "missing"])
def test_info_says_which_module_is_unusable_when_the_fused_kernels_are_stale_or_missing(tmp_path, how):
    # `trainloom info` (show_config checks the fused kernels) crashed with the ImportError's
    # traceback when trainloom.optim._fused was stale or not built; only OpenMP's was caught.
    if not (ROOT / "pyx" / "optim" / "_fused.pyx").exists():
        pytest.skip("installed without sources")
    _copy_package(tmp_path)
    src = tmp_path / "pyx" / "optim" / "_fused.pyx"
    if how == "stale":
        pytest.importorskip("trainloom._build_info")
        with src.open("a") as f:
            f.write("# changed\n")
        why = f"is stale: {src} (or a .pxd/.pxi/.h file under {tmp_path / 'pyx'}) changed after it was built."
    else:
        for so in (tmp_path / "trainloom" / "optim").glob("_fused.*"):
            so.unlink()
        why = (
            "could not be imported (No module named 'trainloom.optim._fused'). No compiled file "
            f"_fused.*.so in {tmp_path / 'trainloom' / 'optim'}. Its source is {src}."
        )
    out = _python_in_copy(tmp_path, _INFO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr == ""
    lines = out.stdout.splitlines()
    at = lines.index("fused optimizer kernels (bit-exact with torch's own step here?):")
    assert lines[at + 1 :] == [
        "  not checked (compiled module unusable: trainloom's compiled module "
        f"'trainloom.optim._fused' {why})"
    ]


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
    shutil.copy(ROOT / "trainloom" / "_build_check.py", work / "trainloom")  # setup.py hashes with it
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


_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):  # as if these compiled modules had not been built
    def find_spec(self, name, path=None, target=None):
        if name in ("trainloom._openmp_helpers", "trainloom.data._codec"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
from trainloom.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_info_and_help_work_and_say_what_is_missing_without_a_compiled_module():
    # `trainloom info` exists to diagnose a build, but with a compiled module missing it (and
    # --help, --version) crashed with a traceback: the package imported one at import time.
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", _BLOCK, *args], capture_output=True, text=True, timeout=120
        )

    info = run("info")
    assert info.returncode == 0, info.stderr
    assert (
        "OpenMP            : no (compiled module missing: trainloom's compiled module "
        "'trainloom._openmp_helpers' could not be imported" in info.stdout
    )
    helped = run("--help")
    assert helped.returncode == 0, helped.stderr
    assert (
        "unavailable here: cache: inspect or clear trainloom caches (info, clear) [unavailable: "
        "trainloom's compiled module 'trainloom.data._codec' could not be imported"
    ) in " ".join(helped.stdout.split())
    cache = run("cache", "info")
    assert cache.returncode == 2
    assert (
        "trainloom cache: " in cache.stderr
        and "'trainloom.data._codec' could not be imported" in cache.stderr
    )


def _copy_sources(dest: Path) -> None:
    """The checkout's tracked files, and its generated C files with their times (so that cythonize
    finds them up to date), into ``dest``."""
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files += [str(p.relative_to(ROOT)) for p in (ROOT / "pyx").rglob("*.c")]
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)


def test_sdist_carries_the_sources_and_does_not_touch_the_build_record(tmp_path):
    # The sdist had the generated .c files but no .pyx/.pxd: a wheel built from it had no compiled
    # module at all (and pip reported success). setup.py also rewrote trainloom/_build_info.py on
    # every run (sdist, metadata), so an edited .pyx no longer counted as stale.
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs the git checkout")
    src = tmp_path / "src"
    _copy_sources(src)
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (src / "trainloom" / "_build_info.py").exists()
    import tarfile

    (sdist,) = (tmp_path / "dist").glob("trainloom-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "pyx").rglob("*.p[xy][xd]")}
    assert sources and sources <= names
    assert {"LICENSE", "MANIFEST.in", "tests/conftest.py", "tests/multiproc.py", "docs/cache.md"} <= names


def test_setup_without_sources_refuses_to_build(tmp_path):
    if not (ROOT / "setup.py").exists():
        pytest.skip("installed without sources")
    (tmp_path / "pyx").mkdir()
    (tmp_path / "trainloom").mkdir()
    shutil.copy(ROOT / "setup.py", tmp_path)
    out = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert (
        f"trainloom: no Cython sources (pyx/**/_*.pyx) under {tmp_path / 'pyx'}; nothing to build."
        in out.stderr
    )


_SHADOWED = """
import sys
# An editable install's finder would resolve trainloom's submodules from its own checkout.
sys.meta_path[:] = [f for f in sys.meta_path if "EditableFinder" not in repr(f)]
import trainloom
trainloom._openmp_helpers
"""


def test_an_unbuilt_checkout_shadowing_an_installed_copy_says_so(tmp_path):
    # Python started inside a clone that was installed with `pip install .` imports the clone (not
    # built): the error only said "rebuild", not that a working installed copy was being shadowed.
    src, site = tmp_path / "src", tmp_path / "site"
    shutil.copytree(ROOT / "trainloom", src / "trainloom", ignore=shutil.ignore_patterns("*.so", "*cache__"))
    (src / "setup.py").write_text("")
    (site / "trainloom").mkdir(parents=True)
    (site / "trainloom" / "__init__.py").write_text("")
    dist = site / "trainloom-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: trainloom\nVersion: 0.1.0\n")
    out = subprocess.run(
        [sys.executable, "-c", _SHADOWED],
        cwd=src,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert (
        f"This trainloom is the source checkout {src} (the current directory or PYTHONPATH comes first on "
        f"sys.path), which is not built; an installed copy is at {site / 'trainloom'}: run Python from "
        "another directory to use it, or build the checkout."
    ) in " ".join(out.stderr.split())
