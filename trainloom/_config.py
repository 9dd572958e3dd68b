"""``trainloom.show_config()``: build facts and which optional parts are usable on this machine."""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import sys
from typing import Any, Dict, List, Optional, TextIO, Tuple

logger = logging.getLogger("trainloom")


def _build_info() -> Dict[str, Any]:
    try:
        from trainloom._build_info import BUILD_INFO
    except ImportError:
        return {}
    return dict(BUILD_INFO)


def _nccl_status() -> Dict[str, Any]:
    """Loads libnccl (only when asked, never at import) and reports its version and path."""
    from trainloom._locate import nccl_candidates

    info: Dict[str, Any] = {"candidates": nccl_candidates()}
    try:
        from trainloom.comm import nccl
    except ImportError as exc:  # the binding is not built in this checkout
        info.update(available=False, reason=f"NCCL binding not importable: {exc}")
        return info
    if nccl.is_available():
        info.update(available=True, version=nccl.get_version(), path=nccl.library_path())
    else:
        info.update(available=False, reason=nccl.unavailable_reason())
    return info


def nccl_version_string(code: int) -> str:
    """``ncclGetVersion()``'s code as a version: 23203 -> "2.32.3" (NCCL >= 2.9 encodes
    major*10000 + minor*100 + patch, earlier releases major*1000 + minor*100 + patch)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _cpu_capability() -> str:
    """torch's CPU kernel level ("AVX512", "AVX2", "DEFAULT", ...; ATEN_CPU_CAPABILITY sets it lower)."""
    import torch

    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return str(get()) if get is not None else "unknown"


def config(kernels: bool = False) -> Dict[str, Any]:
    """The facts :func:`show_config` prints, as a dict (for tests and bug reports).

    Args:
        kernels: also check the fused optimizer's compiled kernels against torch's own step
            (``trainloom.optim.kernel_checks()``, about 2 s in a fresh process) under
            ``"fused_kernels"``: a list of rows, or ``{"error": ...}`` (the ImportError's text)
            when the compiled module is missing or stale.
    """
    import torch

    from trainloom import __version__
    from trainloom._build_check import import_compiled
    from trainloom._locate import find_redis_server

    build = _build_info()
    try:
        omp = import_compiled("trainloom._openmp_helpers")  # the ImportError says how to rebuild

        openmp = {
            "compiled": omp.openmp_enabled(),
            "max_threads": omp.openmp_max_threads(),
        }
    except ImportError as exc:
        openmp = {"compiled": False, "error": str(exc)}
    lmdb_version: Optional[str]
    try:
        import lmdb

        lmdb_version = lmdb.version_string() if hasattr(lmdb, "version_string") else lmdb.__version__
    except ImportError:
        lmdb_version = None
    return {
        "trainloom": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": _cpu_capability(),
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "build": build,
        "openmp": openmp,
        "lmdb": lmdb_version,
        "redis_py": importlib.util.find_spec("redis") is not None,
        "redis_server": find_redis_server(),
        "nccl": _nccl_status(),
        **({"fused_kernels": _kernel_checks()} if kernels else {}),
    }


def _kernel_checks() -> Any:
    try:
        from trainloom.optim import kernel_checks
    except ImportError as exc:  # trainloom.optim._fused missing or stale: the message says how to rebuild
        return {"error": str(exc)}
    return kernel_checks()


def _kernel_lines(rows: Any) -> List[str]:
    """One line per (optimizer, dtype): each torch path and whether the kernel matches it."""
    by: Dict[Tuple[str, str], List[str]] = {}
    for r in rows:
        verdict = "yes" if r["matches_torch"] else "no, steps through torch"
        if r["vector_split"]:
            verdict += f" (vector split {r['vector_split']})"
        by.setdefault((r["optimizer"], r["dtype"]), []).append(f"{r['path']} {verdict}")
    return [f"  {f'{opt} {dt}':<18}: " + "; ".join(parts) for (opt, dt), parts in by.items()]


def show_config(file: Optional[TextIO] = None, kernels: bool = True) -> None:
    """Print how trainloom was built and which optional parts work here.

    Args:
        file: where to print; standard output by default.
        kernels: also check the fused optimizer's compiled kernels against torch's own step on
            this machine and print which ones ``fuse_step`` uses (about 2 s in a fresh process).

    Example::

        >>> import trainloom
        >>> trainloom.show_config()  # doctest: +SKIP
    """
    out = file if file is not None else sys.stdout
    c = config(kernels=kernels)
    b = c["build"]
    omp = c["openmp"]
    nccl = c["nccl"]

    def yes(v: Any) -> str:
        return "yes" if v else "no"

    omp_line = yes(omp.get("compiled"))
    if omp.get("compiled"):
        omp_line += f" ({omp['max_threads']} threads)"
    elif "error" in omp:
        omp_line += f" (compiled module missing: {omp['error'].splitlines()[0]})"
    if nccl.get("available"):
        nccl_line = f"yes, {nccl_version_string(nccl['version'])} at {nccl['path']}"
    else:
        nccl_line = f"no ({nccl.get('reason', 'not found')})"
    lines = [
        f"trainloom {c['trainloom']}",
        "build:",
        f"  OpenMP            : {omp_line}",
        f"  debug directives  : {yes(b.get('debug'))}",
        f"  compiler          : {b.get('compiler', 'unknown (no build info: not built by setup.py)')}",
        f"  compile args      : {' '.join(b.get('compile_args', []))}",
        f"  Cython            : {b.get('cython', 'unknown')}",
        f"  extensions        : {', '.join(b.get('extensions', [])) or 'none'}",
        "runtime:",
        f"  python            : {c['python']} on {c['platform']}",
        f"  torch             : {c['torch']} ({c['torch_threads']} threads, CPU kernels "
        f"{c['torch_cpu_capability']})",
        f"  CPU count         : {c['cpu_count']}",
        f"  CUDA available    : {yes(c['cuda_available'])}",
        "optional parts:",
        f"  lmdb              : {c['lmdb'] or 'no (pip install lmdb)'}",
        f"  redis-py          : {yes(c['redis_py'])}"
        + ("" if c["redis_py"] else " (pip install trainloom[redis])"),
        f"  redis-server      : {c['redis_server'] or 'not found (pip install trainloom[redis])'}",
        f"  NCCL              : {nccl_line}",
    ]
    if kernels:
        lines.append("fused optimizer kernels (bit-exact with torch's own step here?):")
        fused = c["fused_kernels"]
        if isinstance(fused, dict):
            lines.append(f"  not checked (compiled module unusable: {fused['error'].splitlines()[0]})")
        else:
            lines += _kernel_lines(fused)
    print("\n".join(lines), file=out)
