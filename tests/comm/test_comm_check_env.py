"""TRAINLOOM_COMM_CHECK takes 0, 1 or all (and their spellings); anything else is a ConfigError, as
for the other TRAINLOOM_* variables, raised by init_process_group before any rendezvous."""

from __future__ import annotations

import pytest

import trainloom.comm as C
from trainloom.comm import _gloo
from trainloom.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        ("0", "0"),
        ("false", "0"),
        (" No ", "0"),
        ("OFF", "0"),
        ("1", "1"),
        ("true", "1"),
        ("Yes", "1"),
        (" on", "1"),
        ("", "1"),
        ("all", "all"),
        (" ALL\n", "all"),
        (None, "1"),
    ],
)
def test_accepted_values(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("TRAINLOOM_COMM_CHECK", raising=False)
    else:
        monkeypatch.setenv("TRAINLOOM_COMM_CHECK", value)
    assert _gloo.comm_check_mode() == mode
    assert _gloo._check_enabled() is (mode != "0")


@pytest.mark.parametrize("value", ["al", "banana", "2", "-1", "allx", "0 1"])
def test_other_values_are_config_errors(monkeypatch, value):
    # They acted as 1 (only the "off" spellings were tested for).
    monkeypatch.setenv("TRAINLOOM_COMM_CHECK", value)
    with pytest.raises(ConfigError) as info:
        _gloo.comm_check_mode()
    assert str(info.value) == f"TRAINLOOM_COMM_CHECK={value!r}: use 0, 1 or all"
    with pytest.raises(ConfigError):
        _gloo._check_enabled()


def test_init_process_group_refuses_a_bad_value(clean_env):
    clean_env.setenv("TRAINLOOM_COMM_CHECK", "banana")
    try:
        with pytest.raises(ConfigError) as info:
            C.init_process_group(timeout=10)
        assert str(info.value) == "TRAINLOOM_COMM_CHECK='banana': use 0, 1 or all"
        assert C.is_initialized() is False
    finally:
        if C.is_initialized():  # the check failed: leave no process group to the next test
            C.destroy_process_group()


def test_cuda_check_policy_and_a_value_changed_after_init(clean_env):
    clean_env.setenv("TRAINLOOM_CPU_ENGINE", "gloo")
    clean_env.setenv("TRAINLOOM_COMM_CHECK", "1")
    C.init_process_group(timeout=10)
    try:
        comm = C.get_default_group().get_global_communicator()
        assert comm.nccl_checks() is False  # 1: only through the shared-memory engine
        for value, expected in (("all", True), ("0", False), ("on", False), ("ALL", True)):
            clean_env.setenv("TRAINLOOM_COMM_CHECK", value)
            assert comm.nccl_checks() is expected, value
        clean_env.setenv("TRAINLOOM_COMM_CHECK", "al")
        with pytest.raises(ConfigError, match=r"^TRAINLOOM_COMM_CHECK='al': use 0, 1 or all$"):
            comm.nccl_checks()
    finally:
        C.destroy_process_group()
