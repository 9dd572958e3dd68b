"""Faults around the redis-server trainloom starts: restarts under torch.distributed, a server that never
answers, the exit order against the cache's flush, and bad ``bind=`` / ``capacity_per_node=``."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
from multiproc import free_port, run_ranks
from redisutil import requires_redis

from trainloom.errors import ConfigError, StoreError

pytestmark = requires_redis


def _temp_dirs() -> set:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "trainloom-redis-*")))


def _running(needle: str) -> list:
    """Pids of live (not zombie) processes whose command line mentions ``needle``."""
    found = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{d}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
            with open(f"{d}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            found.append(int(d.rsplit("/", 1)[1]))
    return found


# -- 1. a managed server stopped and started again under torch.distributed ----------------------------


def _restart_rounds(rank, world_size):
    import torch.distributed as dist

    from trainloom.data.stores.redis_store import RedisStore

    dist.init_process_group("gloo")
    try:
        hosts = []
        first = RedisStore(namespace="first", capacity_per_node=64 << 20)
        first.set(f"k{rank}", b"1")
        hosts.append(first.hosts)
        dist.barrier()
        first.shutdown()  # rank 0 stops its server; the other ranks close their clients
        dist.barrier()
        second = RedisStore(namespace="second", capacity_per_node=64 << 20)
        second.set(f"k{rank}", b"2")
        hosts.append(second.hosts)
        dist.barrier()
        seen = second.mget(["k0", "k1"])
        dist.barrier()
        # No barrier between rank 0's shutdown and the next store: a rank that gets there first still
        # waits for the new server's address.
        second.shutdown()
        third = RedisStore(namespace="third", capacity_per_node=64 << 20)
        third.set(f"k{rank}", b"3")
        hosts.append(third.hosts)
        dist.barrier()
        seen += third.mget(["k0", "k1"])
        dist.barrier()
        third.shutdown()
        return hosts, seen
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_rank_gets_the_restarted_server():
    out = run_ranks(_restart_rounds, 2, timeout=90)
    (hosts0, seen0), (hosts1, seen1) = out
    assert hosts0 == hosts1  # each round: the same (live) server and password on both ranks
    passwords = [h[0]["password"] for h in hosts0]
    assert len(set(passwords)) == 3  # three servers, one per round
    assert seen0 == seen1 == [b"2", b"2", b"3", b"3"]


# -- 2. a binary that accepts connections but never answers PING --------------------------------------

_MUTE_SERVER = """
import socket, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen(16)
conns = []
while True:
    conns.append(s.accept()[0])
"""


def test_server_that_never_answers_is_stopped_within_startup_timeout(tmp_path):
    from trainloom.data.stores.redis_server import _RUNNING, RedisServer

    binary = tmp_path / "mute-redis-server"
    binary.write_text(f"#!{sys.executable}\n{_MUTE_SERVER}")
    binary.chmod(0o755)
    before = _temp_dirs()
    port = free_port()
    srv = RedisServer(binary=str(binary), port=port, startup_timeout=1)
    t0 = time.monotonic()
    with pytest.raises(StoreError) as info:
        srv.start()
    elapsed = time.monotonic() - t0
    assert re.fullmatch(
        re.escape(
            f"redis-server ({binary}) on 127.0.0.1:{port} did not answer PING within startup_timeout=1s"
        )
        + r" \(last error: TimeoutError: Timeout (reading from socket|connecting to server)\); it was "
        r"stopped\. Raise startup_timeout= on a slow machine",
        str(info.value),
    ), str(info.value)
    assert info.value.backend == "redis"
    assert elapsed < 6.0  # startup_timeout=1; redis-py's default retries made it ~9 s (loose: shared CI)
    assert srv.proc is None and srv not in _RUNNING
    assert _running(str(binary)) == []  # the child was killed
    assert _temp_dirs() - before == set()  # and its directory removed


def test_server_that_exits_reports_its_log(tmp_path):
    from trainloom.data.stores.redis_server import RedisServer

    binary = tmp_path / "broken-redis-server"
    binary.write_text("#!/bin/sh\necho 'FATAL: bad config'\nexit 1\n")
    binary.chmod(0o755)
    before = _temp_dirs()
    with pytest.raises(StoreError) as info:
        RedisServer(binary=str(binary), startup_timeout=5).start()
    assert str(info.value) == f"redis-server ({binary}) did not start on 127.0.0.1: FATAL: bad config"
    assert _temp_dirs() - before == set()


# -- 3. the server outlives the cache's flush at interpreter exit -------------------------------------

_EXIT_SCRIPT = """
import logging, multiprocessing.util, warnings
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
warnings.simplefilter("ignore")
import redis
from trainloom.data import CacheLoader
from trainloom.data.stores import redis_store

ld = CacheLoader("redis", "exitorder", writer_buffer_size=50, flush_interval=None)
for i in range(5):
    ld.get(i, lambda k: k * 10)
(srv,) = redis_store._NODE_SERVERS.values()
print("PID", srv.proc.pid, "BUFFERED", ld.stats()["buffered"], flush=True)

def look(addr):  # priority 5: after the cache's exit flush (10)
    c = redis.Redis(host=addr["host"], port=addr["port"], password=addr["password"], socket_timeout=2)
    print("KEYS", b" ".join(sorted(c.keys())).decode(), flush=True)
    c.close()

multiprocessing.util.Finalize(None, look, args=(srv.address(),), exitpriority=5)
"""


def test_server_stops_after_the_exit_flush(tmp_path):
    script = tmp_path / "exit_order.py"
    script.write_text(textwrap.dedent(_EXIT_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    # Before: "ERROR trainloom.data: CacheLoader('exitorder'): could not flush 5 buffered values at exit:
    # ... Connection refused", and look() below failed the same way.
    assert "ERROR" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("PID ") and lines[0].endswith(" BUFFERED 5"), proc.stdout
    keys = " ".join(f"tl:9:exitorder:exitorder_{i}" for i in range(5))
    assert lines[1:] == [f"KEYS {keys}"], proc.stdout  # the flush reached the live server
    pid = int(lines[0].split()[1])
    deadline = time.monotonic() + 5
    while _running_pid(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running_pid(pid)  # and the server still died with the job


def _running_pid(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- 4, 5. bad bind= and capacity_per_node= ------------------------------------------------------------


def test_bind_to_an_address_not_on_this_machine():
    from trainloom.data.stores import redis_store

    before, servers = _temp_dirs(), dict(redis_store._NODE_SERVERS)
    with pytest.raises(ConfigError) as info:
        redis_store.RedisStore(namespace="bind", bind="192.0.2.1", capacity_per_node=64 << 20)
    assert str(info.value) == (
        "RedisServer: cannot listen on bind='192.0.2.1': binding a socket to '192.0.2.1' failed ([Errno "
        "99] Cannot assign requested address); pass an address of one of this machine's interfaces (the "
        "node's private address for multi-node use) or '127.0.0.1'"
    )
    assert redis_store._NODE_SERVERS == servers and _temp_dirs() - before == set()


@pytest.mark.parametrize("bad", [True, False])
def test_capacity_per_node_rejects_bool(bad):
    from trainloom.data.stores import redis_store

    servers = dict(redis_store._NODE_SERVERS)
    with pytest.raises(ValueError) as info:
        redis_store.RedisStore(namespace="cap", capacity_per_node=bad)
    assert str(info.value) == f"RedisStore: capacity_per_node must be a positive int, got {bad}"
    assert redis_store._NODE_SERVERS == servers  # refused before any server was started
