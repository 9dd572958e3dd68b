"""Run a function on several real processes, one per rank, as torchrun would.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes with the torchrun environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set, calls
``fn(rank, world_size, *args)`` in each, and returns the results ordered by rank. A rank that raises
makes the call raise ``RankFailed`` with that rank's traceback; a run that exceeds ``timeout`` kills
every process and raises ``TimeoutError``; a rank that dies without a result is reported with its
exit code. ``fn`` must be a module-level function (it is pickled by reference).

Processes come from a forkserver that has already imported torch and trainloom, so a fresh set of
ranks costs tens of milliseconds instead of seconds per test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

_CTX: Optional[Any] = None


def _ctx() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "trainloom", "multiproc"])
    return _CTX


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    """One or more ranks raised; ``errors`` maps rank to (exception type name, traceback text)."""

    def __init__(self, errors: Dict[int, tuple]) -> None:
        self.errors = errors
        parts = [f"--- rank {r} raised {t}:\n{tb}" for r, (t, tb) in sorted(errors.items())]
        super().__init__("\n".join(parts))


def popen_rank(
    argv: Sequence[str], rank: int, world_size: int, port: int, **env: str
) -> subprocess.Popen[str]:
    """Start ``python argv...`` as ``rank`` of a plain launch (the launch variables torchrun would set,
    MASTER_PORT=port on 127.0.0.1, none inherited), with pipes for its text output and ``env`` added."""
    from trainloom.comm.env import LAUNCH_VARS

    full = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    full.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **env,
    )
    return subprocess.Popen(
        [sys.executable, *argv], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _entry(fn: Callable, rank: int, world_size: int, env: Dict[str, str], args: Sequence, q: Any) -> None:
    os.environ.update(env)
    try:
        result = fn(rank, world_size, *args)
        q.put((rank, True, result))
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        q.put((rank, False, (type(exc).__name__, traceback.format_exc())))


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    env: Optional[Dict[str, str]] = None,
    local_world_size: Optional[int] = None,
    allow_death: Sequence[int] = (),
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results by rank.

    Args:
        local_world_size: LOCAL_WORLD_SIZE to advertise (default: world_size, one node).
        allow_death: ranks that may exit without a result (tests that kill a peer); their entry
            in the returned list is None.
    """
    ctx = _ctx()
    port = free_port()
    lws = local_world_size or world_size
    q = ctx.Queue()
    procs = []
    for rank in range(world_size):
        e = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % lws),
            "LOCAL_WORLD_SIZE": str(lws),
            "GROUP_RANK": str(rank // lws),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        e.update(env or {})
        p = ctx.Process(target=_entry, args=(fn, rank, world_size, e, args, q), daemon=True)
        p.start()
        procs.append(p)
    results: Dict[int, Any] = {}
    errors: Dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout}s; errors: {errors}")
            try:
                rank, ok, payload = q.get(timeout=min(remaining, 0.2))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                for r, p in enumerate(procs):
                    if r in results or r in errors or p.is_alive():
                        continue
                    if r in allow_death:
                        results[r] = None
                    else:
                        time.sleep(0.2)  # a result may still be in flight in the queue
                        if q.empty():
                            errors[r] = ("ProcessDied", f"exit code {p.exitcode}")
                continue
            (results if ok else errors)[rank] = payload
        finished = True
    finally:
        # After a timeout nothing is worth waiting for; otherwise give ranks a moment to exit
        # cleanly (their atexit handlers unlink shared memory, stop servers).
        grace = 5.0 if finished else 0.0
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankFailed(errors)
    return [results[r] for r in range(world_size)]
