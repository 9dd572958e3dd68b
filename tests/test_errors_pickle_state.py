"""Errors keep what was added to them after construction across a pickle round trip (DataLoader
workers, multiprocessing): the communicator note and attributes a subgroup adds, and ``__notes__``."""

from __future__ import annotations

import pickle

import pytest

from trainloom.data.stores.base import StoreUnavailableError
from trainloom.errors import CommError, NcclError, StoreError

_NOTE = " [communicator group1: its ranks are global ranks 0->2, 1->3]"


def _annotated(exc: BaseException) -> BaseException:
    # What trainloom/comm/group.py's Communicator._annotate does to an error of a subgroup.
    exc.communicator = "group1"  # type: ignore[attr-defined]
    exc.global_missing_ranks = [3]  # type: ignore[attr-defined]
    exc.args = (f"{exc.args[0]}{_NOTE}",) + tuple(exc.args[1:])
    exc.add_note("while running allreduce")
    return exc


@pytest.mark.parametrize(
    ("exc", "text"),
    [
        (CommError("ncclCommInitRank failed"), "ncclCommInitRank failed"),
        (
            NcclError(2, "ncclCommInitRank", "unhandled system error"),
            "ncclCommInitRank: unhandled system error (code=2)",
        ),
        (NcclError(5, "ncclAllReduce"), "ncclAllReduce (code=5)"),
        (StoreError("redis: down", backend="redis", key="ds_1"), "redis: down"),
        (StoreUnavailableError("redis: refused", backend="redis"), "redis: refused"),
    ],
)
def test_annotations_survive_pickling(exc, text):
    # NcclError and StoreError pickled their constructor arguments only: the note in args and the
    # communicator attribute were lost (a plain CommError kept them).
    back = pickle.loads(pickle.dumps(_annotated(exc)))
    assert type(back) is type(exc)
    assert str(back) == text + _NOTE
    assert back.args == (text + _NOTE,)
    assert back.communicator == "group1"
    assert back.global_missing_ranks == [3]
    assert back.__notes__ == ["while running allreduce"]
    if isinstance(exc, NcclError):
        assert (back.status, back.where, back.message) == (exc.status, exc.where, exc.message)
    if isinstance(exc, StoreError):
        assert (back.message, back.backend, back.key) == (exc.message, exc.backend, exc.key)


def test_unannotated_errors_round_trip_unchanged():
    e = NcclError(1, "ncclCommInitRank", "unhandled cuda error")
    back = pickle.loads(pickle.dumps(e))
    assert (back.status, back.where, back.message) == (1, "ncclCommInitRank", "unhandled cuda error")
    assert back.args == e.args
    assert not hasattr(back, "communicator") and not hasattr(back, "__notes__")
    s = pickle.loads(pickle.dumps(StoreError("lmdb: full")))
    assert (str(s), s.backend, s.key) == ("lmdb: full", None, None)
