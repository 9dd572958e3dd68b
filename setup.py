"""Build script for trainloom's Cython extensions.

Every ``pyx/<area>/_name.pyx`` becomes the extension ``trainloom.<area>._name`` (and
``pyx/_name.pyx`` becomes ``trainloom._name``), so adding a compiled module never needs an edit here.
The extensions build against the C library only: no torch headers, no CUDA, no NCCL (NCCL is
dlopen'ed at run time).

Environment switches:

``TRAINLOOM_NO_OPENMP=1``      build without OpenMP even if the compiler supports it.
``TRAINLOOM_DEBUG_CYTHON=1``   turn on bounds/wraparound/initialized checks and line tracing.
``TRAINLOOM_ANNOTATE=1``       also write ``cython -a`` HTML next to each .pyx.
``TRAINLOOM_BUILD_ONLY=a,b``   (development) build only these modules, e.g. ``trainloom.data._codec``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

ROOT = Path(__file__).resolve().parent
PYX = ROOT / "pyx"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _has_openmp() -> tuple[bool, str]:
    """Compile and link a two-line OpenMP program; return (works, compiler used)."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc_argv = cc.split()
    if shutil.which(cc_argv[0]) is None:
        return False, cc
    src = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        c_file = Path(tmp) / "probe.c"
        c_file.write_text(src)
        cmd = [*cc_argv, "-fopenmp", str(c_file), "-o", str(Path(tmp) / "probe")]
        ok = subprocess.run(cmd, capture_output=True).returncode == 0
    return ok, cc


def _discover() -> list[tuple[str, str]]:
    """(module name, source path) for every pyx/**/_*.pyx, or those named in TRAINLOOM_BUILD_ONLY."""
    only = {m.strip() for m in os.environ.get("TRAINLOOM_BUILD_ONLY", "").split(",") if m.strip()}
    found = []
    for src in sorted(PYX.rglob("_*.pyx")):
        rel = src.relative_to(PYX).with_suffix("")
        name = "trainloom." + ".".join(rel.parts)
        if not only or name in only:
            found.append((name, str(src.relative_to(ROOT))))
    unknown = only - {name for name, _ in found}
    if unknown:
        sys.exit(f"trainloom: TRAINLOOM_BUILD_ONLY names unknown modules: {sorted(unknown)}")
    return found


NO_OMP_REQUESTED = _truthy("TRAINLOOM_NO_OPENMP")
OMP_OK, CC = _has_openmp()
USE_OMP = OMP_OK and not NO_OMP_REQUESTED
DEBUG = _truthy("TRAINLOOM_DEBUG_CYTHON")
OMP_FLAGS = ["-fopenmp"] if USE_OMP else []

# -O3 lets gcc vectorize the reduction and optimizer loops. -ffp-contract=off keeps the rounding
# sequence exactly as written (fused optimizer kernels must match torch bit for bit; they use explicit
# fma() where torch does). No -march=native: wheels must run on any x86-64 / aarch64 CPU.
COMPILE_ARGS = ["-O3", "-ffp-contract=off", "-fno-strict-aliasing", *OMP_FLAGS]
if DEBUG:
    COMPILE_ARGS = ["-O0", "-g", "-ffp-contract=off", *OMP_FLAGS]
MACROS = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
MACROS += [("TRAINLOOM_OPENMP", "1" if USE_OMP else "0"), ("TRAINLOOM_DEBUG", "1" if DEBUG else "0")]
if DEBUG:
    MACROS += [("CYTHON_TRACE_NOGIL", "1")]

DIRECTIVES = {
    "language_level": "3",
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
    "linetrace": DEBUG,
}


def _numpy_include() -> str:
    try:
        import numpy
    except ImportError:
        sys.exit("trainloom: building needs numpy's C headers (pip install numpy).")
    return numpy.get_include()


def _extensions() -> list[Extension]:
    inc = _numpy_include()
    return [
        Extension(
            name,
            [src],
            include_dirs=[inc],
            define_macros=MACROS,
            extra_compile_args=COMPILE_ARGS,
            extra_link_args=[*OMP_FLAGS, "-ldl"],
        )
        for name, src in _discover()
    ]


def _cythonize(exts: list[Extension]) -> list[Extension]:
    try:
        import Cython
        from Cython.Build import cythonize
    except ImportError:
        sys.exit("trainloom: building needs Cython >= 3 (pip install 'Cython>=3').")
    if int(Cython.__version__.split(".")[0]) < 3:
        sys.exit(f"trainloom: building needs Cython >= 3, found {Cython.__version__}.")
    return cythonize(
        exts,
        include_path=[str(PYX)],
        compiler_directives=DIRECTIVES,
        annotate=_truthy("TRAINLOOM_ANNOTATE"),
        compile_time_env={"TRAINLOOM_OPENMP": USE_OMP, "TRAINLOOM_DEBUG": DEBUG},
        quiet=True,
    )


@functools.cache
def _build_check() -> object:
    """trainloom/_build_check.py (standard library only), loaded by path: setup.py records the
    hashes with the same function that compares them at import, so the two can never disagree."""
    path = ROOT / "trainloom" / "_build_check.py"
    spec = importlib.util.spec_from_file_location("_trainloom_build_check", path)
    if spec is None or spec.loader is None:
        sys.exit(f"trainloom: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source_hash(src: str) -> str:
    return str(_build_check().source_hash(ROOT / src))  # type: ignore[attr-defined]


def _build_info() -> dict[str, object]:
    import Cython

    return {
        "openmp": USE_OMP,
        "openmp_compiler_support": OMP_OK,
        "openmp_disabled_by_env": NO_OMP_REQUESTED,
        "debug": DEBUG,
        "compiler": CC,
        "compile_args": COMPILE_ARGS,
        "cython": Cython.__version__,
        "python": sys.version.split()[0],
        "extensions": [name for name, _ in _discover()],
        # sha256 of each .pyx (and the .pxd/.pxi/.h files under pyx/) at build time: trainloom._build_check
        # compares them with the sources of a checkout to report a stale build.
        "source_hashes": {name: _source_hash(src) for name, src in _discover()},
    }


def _write_build_info(info: dict[str, object], target: Path) -> None:
    # Read back by trainloom.show_config(); generated, not tracked by git. A partial build
    # (TRAINLOOM_BUILD_ONLY) keeps what the previous build recorded for the other modules.
    target.parent.mkdir(parents=True, exist_ok=True)
    if os.environ.get("TRAINLOOM_BUILD_ONLY") and target.exists():
        previous: dict = {}
        exec(compile(target.read_text(), str(target), "exec"), previous)
        old = previous.get("BUILD_INFO", {})
        hashes = {**old.get("source_hashes", {}), **info["source_hashes"]}  # type: ignore[dict-item]
        info = {**info, "source_hashes": hashes, "extensions": sorted(hashes)}
    text = (
        "# Generated by setup.py at build time. Do not edit.\nfrom typing import Any, Dict\n\n"
        "BUILD_INFO: Dict[str, Any] = " + repr(info) + "\n"
    )
    target.write_text(text)


def _summary(info: dict[str, object]) -> None:
    bar = "=" * 64
    lines = [
        bar,
        "trainloom build configuration",
        f"  OpenMP            : {'yes' if USE_OMP else 'NO'}",
        f"  debug directives  : {'yes (boundscheck, wraparound, linetrace)' if DEBUG else 'no'}",
        f"  compiler          : {CC}",
        f"  compile args      : {' '.join(COMPILE_ARGS)}",
        f"  Cython            : {info['cython']}",
        f"  extensions        : {len(info['extensions'])}",  # type: ignore[arg-type]
        bar,
    ]
    print("\n".join(lines), file=sys.stderr)
    if not USE_OMP:
        why = "TRAINLOOM_NO_OPENMP is set" if NO_OMP_REQUESTED else f"{CC} cannot compile with -fopenmp"
        print(
            "\n" + "!" * 64 + "\n"
            f"WARNING: building trainloom WITHOUT OpenMP ({why}).\n"
            "The optimizer and reduction kernels will run on one thread.\n"
            "Install a compiler with OpenMP (gcc, or clang with libomp) and rebuild.\n" + "!" * 64,
            file=sys.stderr,
        )


class build_ext(_build_ext):  # noqa: N801 - the command's name
    """build_ext that records what it built (trainloom/_build_info.py) next to the modules it
    writes: in the checkout for an in-place or editable build, in the build tree for a wheel. Only
    a build records: an sdist, a metadata query or a wheel built elsewhere must not mark the
    checkout's compiled modules as up to date (the stale-build check reads these hashes)."""

    def run(self) -> None:
        super().run()
        info = _build_info()
        root = ROOT if self.inplace or getattr(self, "editable_mode", False) else Path(self.build_lib)
        _write_build_info(info, root / "trainloom" / "_build_info.py")
        _summary(info)


_exts = _extensions()
if not _exts:
    # An sdist without the .pyx sources would otherwise build a pure-Python wheel that cannot import.
    sys.exit(f"trainloom: no Cython sources (pyx/**/_*.pyx) under {PYX}; nothing to build.")
setup(ext_modules=_cythonize(_exts), cmdclass={"build_ext": build_ext})
