"""Warnings attributed to the user's line rather than to trainloom's internals."""

from __future__ import annotations

import logging
import sys
import warnings
from types import FrameType
from typing import Optional, Type


def warn_at_caller(
    message: str, category: Type[Warning], module_file: str, logger: Optional[logging.Logger] = None
) -> None:
    """``warnings.warn`` at the first frame outside ``module_file`` (the caller's ``__file__``), however
    deep inside that module the warning is raised.

    With ``logger``, the message is also logged as a warning when logging is set up (a handler on
    the logger or an ancestor), so it reaches the user's log files too; without a handler logging's
    last-resort handler would print it to stderr a second time, next to the warning."""
    level = 1
    frame: Optional[FrameType] = sys._getframe(0)
    while frame is not None and frame.f_code.co_filename in (__file__, module_file):
        level += 1
        frame = frame.f_back
    warnings.warn(message, category, stacklevel=level)
    if logger is not None:
        log_if_configured(logger, message)


def log_if_configured(logger: logging.Logger, message: str) -> None:
    """``logger.warning(message)`` when logging is set up (a handler on the logger or an ancestor),
    for a message also given to ``warnings.warn``: without a handler, logging's last-resort handler
    would print it to stderr a second time."""
    if logger.hasHandlers():
        logger.warning(message)
