"""Shared pytest set-up: markers for hardware-bound tests and the multi-process harness on sys.path."""

from __future__ import annotations

import os
import signal
import sys
import tempfile

import pytest
import torch

# hypothesis would otherwise write ./.hypothesis into the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", tempfile.mkdtemp(prefix="trainloom-hypothesis-"))

# A suite started in the background by a non-interactive shell (`pytest ... &`, nohup) inherits
# SIGINT ignored, and an ignored signal stays ignored across exec: every process the tests start
# would ignore it too, and the Ctrl-C tests (tests/comm/test_ordering_and_lifetime.py) would fail.
# A handler, unlike SIG_IGN, is reset to the default at exec, where Python installs its own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# tests/multiproc.py is imported by the forkserver that starts ranks; make it importable by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HAS_GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU; this machine has none")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; this machine has none"))
        if "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 or more CUDA GPUs"))
