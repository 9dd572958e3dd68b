"""Turn a missing or stale compiled module into an ImportError that says how to rebuild.

Modelled on scikit-learn's ``sklearn/__check_build``: the bare ``No module named
'trainloom.optim._fused'`` a user otherwise sees does not tell them that the package was never
compiled (a source checkout used without building) or was compiled for another Python.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

_REBUILD = (
    "Rebuild the compiled extensions:\n"
    "    pip install -e .            # from the source checkout, or\n"
    "    python setup.py build_ext --inplace\n"
    "(set TRAINLOOM_DEBUG_CYTHON=1 for a build with bounds checks)."
)


def _describe_dir(pkg_dir: Path, stem: str) -> str:
    found = sorted(p.name for p in pkg_dir.glob(stem + ".*") if p.suffix in (".so", ".pyd"))
    if found:
        return f"Found {', '.join(found)} in {pkg_dir}, but none loads with this Python."
    return f"No compiled file {stem}.*.so in {pkg_dir}."


def _shadow_hint(pkg_root: Path) -> str:
    """When this trainloom is an unbuilt source checkout that shadows an installed copy (Python run
    from inside the clone that was installed with ``pip install .``): say so."""
    if not (pkg_root.parent / "setup.py").exists():
        return ""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        installed = Path(str(distribution("trainloom").locate_file("trainloom"))).resolve()
    except (PackageNotFoundError, OSError):
        return ""
    if installed == pkg_root or not (installed / "__init__.py").exists():
        return ""
    return (
        f" This trainloom is the source checkout {pkg_root.parent} (the current directory or "
        f"PYTHONPATH comes first on sys.path), which is not built; an installed copy is at {installed}: "
        "run Python from another directory to use it, or build the checkout."
    )


def import_compiled(name: str) -> ModuleType:
    """Import the compiled module ``name`` (e.g. ``"trainloom.optim._fused"``).

    Raises:
        ImportError: naming the module, what was found on disk, and the rebuild command.
    """
    check_stale(name)
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        # Only the module itself missing or unloadable is a build problem; re-raise anything a
        # compiled module raised while importing its own dependencies unchanged.
        if exc.name not in (None, name) and not str(exc).startswith(("dynamic module", "/")):
            raise
        parts = name.split(".")
        pkg_dir = Path(__file__).resolve().parent.joinpath(*parts[1:-1])
        where = _describe_dir(pkg_dir, parts[-1])
        src = Path(__file__).resolve().parent.parent / "pyx" / Path(*parts[1:]).with_suffix(".pyx")
        hint = f" Its source is {src}." if src.exists() else ""
        shadow = _shadow_hint(Path(__file__).resolve().parent)
        msg = (
            f"trainloom's compiled module {name!r} could not be imported ({exc}). {where}{hint}{shadow}\n"
            f"{_REBUILD}"
        )
        raise ImportError(msg, name=name, path=os.fspath(pkg_dir)) from exc


#: Files a .pyx may cimport or include (setup.py records its hashes with source_hash() below).
_DEP_SUFFIXES = (".pxd", ".pxi", ".h")


def _pyx_root(pyx: Path) -> Path:
    root = pyx.parent
    while root.name != "pyx" and root != root.parent:
        root = root.parent
    return root


def source_hash(pyx: Path) -> str:
    """The hash setup.py records for a .pyx: the file, then the path and contents of every
    .pxd/.pxi/.h under pyx/ (a header a module includes, e.g. comm/_shm_kernels.h, changes the
    build as much as the .pyx does)."""
    import hashlib

    root = _pyx_root(pyx)
    h = hashlib.sha256(pyx.read_bytes())
    for dep in sorted(p for p in root.rglob("*") if p.suffix in _DEP_SUFFIXES and p.is_file()):
        h.update(dep.relative_to(root).as_posix().encode())
        h.update(dep.read_bytes())
    return h.hexdigest()


def check_stale(name: str) -> None:
    """Raise ImportError when a source checkout's .pyx differs from the one that was compiled.

    Only applies where the sources sit next to the package (an editable or in-place build); an
    installed wheel has no pyx/ directory and is never stale. ``TRAINLOOM_ALLOW_STALE=1`` turns the
    check off, for developers who edit one module's .pyx while testing another.
    """
    if os.environ.get("TRAINLOOM_ALLOW_STALE") == "1":
        return
    try:
        from trainloom._build_info import BUILD_INFO
    except ImportError:
        return
    recorded = BUILD_INFO.get("source_hashes", {}).get(name)
    parts = name.split(".")
    src = Path(__file__).resolve().parent.parent / "pyx" / Path(*parts[1:]).with_suffix(".pyx")
    if recorded is None or not src.exists():
        return
    if source_hash(src) != recorded:
        raise ImportError(
            f"trainloom's compiled module {name!r} is stale: {src} (or a .pxd/.pxi/.h file under "
            f"{_pyx_root(src)}) changed after it was built.\n{_REBUILD}\n"
            "(While developing, TRAINLOOM_ALLOW_STALE=1 imports it anyway.)",
            name=name,
        )
