"""Fixtures of the single-process comm tests: a clean launch environment and a world of one."""

from __future__ import annotations

import pytest

import trainloom.comm as C
from trainloom.comm.env import LAUNCH_VARS


@pytest.fixture
def clean_env(monkeypatch):
    """No launch or trainloom comm variables: the process is rank 0 of 1 unless a test sets them."""
    for k in (*LAUNCH_VARS, "TRAINLOOM_COMM_TIMEOUT", "TRAINLOOM_CPU_ENGINE"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.fixture
def world1(clean_env):
    """The default process group of a one-process world, destroyed after the test."""
    pg = C.init_process_group(timeout=10)
    yield pg
    C.destroy_process_group()
