"""Warnings attributed to the user's line rather than to trainloom's internals."""

from __future__ import annotations

import sys
import warnings
from typing import Type


def warn_at_caller(message: str, category: Type[Warning], module_file: str) -> None:
    """``warnings.warn`` at the first frame outside ``module_file`` (the caller's ``__file__``), however
    deep inside that module the warning is raised."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_code.co_filename in (__file__, module_file):
        level += 1
        frame = frame.f_back
    warnings.warn(message, category, stacklevel=level)
