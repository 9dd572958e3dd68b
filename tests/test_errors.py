"""The exception hierarchy: builtin bases users catch, and pickling across processes."""

import pickle

import pytest

from trainloom.errors import (
    CommError,
    CommTimeoutError,
    ConfigError,
    NcclError,
    NcclUnavailableError,
    StoreError,
    TrainloomError,
)


def test_bases():
    assert issubclass(CommError, RuntimeError) and issubclass(CommError, TrainloomError)
    assert issubclass(CommTimeoutError, TimeoutError) and issubclass(CommTimeoutError, CommError)
    assert issubclass(NcclError, CommError) and issubclass(NcclUnavailableError, CommError)
    assert issubclass(ConfigError, ValueError)
    assert issubclass(StoreError, TrainloomError)


def test_nccl_error_message_and_pickle():
    e = NcclError(1, "ncclCommInitRank", "unhandled cuda error")
    assert str(e) == "ncclCommInitRank: unhandled cuda error (code=1)"
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.status, e2.where, str(e2)) == (1, "ncclCommInitRank", str(e))


@pytest.mark.parametrize(
    "exc",
    [StoreError("redis: down", backend="redis", key="ds_1"), ConfigError("bad"), CommTimeoutError("late")],
)
def test_pickle_round_trip(exc):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    if isinstance(exc, StoreError):
        assert (back.backend, back.key) == ("redis", "ds_1")
