"""Every module imports in a fresh interpreter with no GPU and no NCCL, and importing does nothing heavy."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainloom

PKG = Path(trainloom.__file__).resolve().parent

SCRIPT = r"""
import importlib, json, pkgutil, sys, threading
import trainloom
mods = sorted(m.name for m in pkgutil.walk_packages(trainloom.__path__, "trainloom."))
failed = {}
for name in mods:
    if name.endswith("__main__"):
        continue
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
maps = open("/proc/self/maps").read()
import torch
print(json.dumps({
    "modules": mods,
    "failed": failed,
    "nccl_loaded": "libnccl" in maps,
    "cuda": torch.cuda.is_available(),
    "threads": threading.active_count(),
}))
"""


def _run(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # Importing prints nothing and warns about nothing: the script's one line is all there is.
    assert out.stderr == "", out.stderr
    (line,) = out.stdout.strip().splitlines()
    return json.loads(line)


def test_every_module_imports_without_gpu_or_nccl(tmp_path):
    res = _run({"CUDA_VISIBLE_DEVICES": "", "TRAINLOOM_NCCL_LIBRARY": str(tmp_path / "no-libnccl.so.2")})
    assert res["failed"] == {}
    assert "trainloom.cli" in res["modules"] and "trainloom.errors" in res["modules"]
    assert res["cuda"] is False
    # Importing must not load NCCL (it is dlopen'ed at first use) nor start helper threads.
    assert res["nccl_loaded"] is False
    assert res["threads"] == 1


def test_every_pyx_has_its_compiled_module():
    root = PKG.parent / "pyx"
    if not root.is_dir():  # an installed wheel has no sources to compare with
        return
    for src in root.rglob("_*.pyx"):
        rel = src.relative_to(root).with_suffix("")
        target = PKG.joinpath(*rel.parts[:-1])
        assert list(target.glob(rel.parts[-1] + ".*.so")), f"{src} was not built"


PACKAGES = ["trainloom", "trainloom.comm", "trainloom.data", "trainloom.data.stores", "trainloom.optim"]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_of_a_package_is_in_its_all(name):
    # trainloom ships py.typed: pyright (Pylance) and mypy with implicit_reexport=False count a name
    # a package's __init__ imports as public only when its __all__ lists it. trainloom.data had no
    # __all__, so `from trainloom.data import CacheLoader` was an error in their eyes.
    mod = importlib.import_module(name)
    exported = set(getattr(mod, "__all__", ()))
    public = {
        k
        for k, v in vars(mod).items()
        if not k.startswith("_")
        and not inspect.ismodule(v)
        and (getattr(v, "__module__", None) or "").startswith("trainloom")
    }
    assert sorted(public - exported) == []
    assert sorted(n for n in exported if not hasattr(mod, n)) == []
