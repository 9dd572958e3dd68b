"""Fused-optimizer tests run torch and the kernels on one thread unless a test asks for more: the
machine is shared, and torch's own fused CPU kernels spend most of their time waking threads for
the tiny tensors used here."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
