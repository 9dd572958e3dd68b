"""The multi-process harness itself: results by rank, errors carried back, deaths and timeouts."""

import os
import time

import pytest
from multiproc import RankFailed, run_ranks


def _env(rank, world_size):
    return (rank, world_size, os.environ["RANK"], os.environ["LOCAL_WORLD_SIZE"], os.getpid())


def _raise_on_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _die_on_0(rank, world_size):
    if rank == 0:
        os._exit(7)
    return rank


def _sleep(rank, world_size):
    time.sleep(30)


def test_results_by_rank_in_separate_processes():
    out = run_ranks(_env, 3)
    assert [o[:4] for o in out] == [(r, 3, str(r), "3") for r in range(3)]
    assert len({o[4] for o in out} | {os.getpid()}) == 4


def test_error_carries_rank_and_traceback():
    with pytest.raises(RankFailed, match="rank 1 raised ValueError") as info:
        run_ranks(_raise_on_1, 2)
    assert "boom from rank 1" in str(info.value)


def test_dead_rank_is_reported_with_exit_code():
    with pytest.raises(RankFailed, match="exit code 7"):
        run_ranks(_die_on_0, 2)


def test_timeout_kills_ranks():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish"):
        run_ranks(_sleep, 2, timeout=1.0)
    assert time.monotonic() - t0 < 15
