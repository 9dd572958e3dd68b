"""Stores: LMDB (namespaces, growth, reader slots, fork), ClusterStore hashing, Redis (real servers)."""

from __future__ import annotations

import hashlib
import os
import pickle
import queue
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from redisutil import requires_redis

from trainloom.data.cache import CacheLoader
from trainloom.data.stores import ClusterStore, LmdbStore, Store, StoreError, StoreFullError, shard_of
from trainloom.data.stores.base import StoreOutOfMemoryError, StoreUnavailableError
from trainloom.errors import ConfigError


def test_lmdb_basic_api(tmp_path):
    with LmdbStore(tmp_path / "db", namespace="a") as s:
        assert s.get("k") is None
        s.set("k", b"v")
        s.set(b"k2", "text")
        s.mset({"x": b"1", "y": bytearray(b"2"), "z": memoryview(b"3")})
        assert s.mget(["x", "nope", "z", "k2"]) == [b"1", None, b"3", b"text"]
        assert s.num_keys() == 5 and s.status()
        s.delete(["x", "missing"])
        assert s.num_keys() == 4
        s.clear()
        assert s.num_keys() == 0


def test_lmdb_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="map_size must be a positive int"):
        LmdbStore(tmp_path, map_size=0)
    with pytest.raises(ValueError, match="max_map_size .* is smaller than map_size"):
        LmdbStore(tmp_path, map_size=1 << 30, max_map_size=1 << 20)
    with pytest.raises(TypeError, match="store keys must be str or bytes, got int"):
        LmdbStore(tmp_path / "a").set(3, b"x")
    with pytest.raises(TypeError, match="store values must be bytes-like or str, got int for key 'k'"):
        LmdbStore(tmp_path / "b").set("k", 3)
    with pytest.raises(StoreError, match="no LMDB environment"):
        LmdbStore(tmp_path / "nothing", readonly=True).num_keys()


def test_lmdb_namespaces_are_isolated(tmp_path):
    a = LmdbStore(tmp_path, namespace="a")
    b = LmdbStore(tmp_path, namespace="a_b")
    a.mset({"k": b"from a", "b_1": b"a"})
    b.set("k", b"from b")
    assert a.get("k") == b"from a" and b.get("k") == b"from b"
    assert a.num_keys() == 2 and b.num_keys() == 1
    b.clear()
    assert a.num_keys() == 2 and b.num_keys() == 0
    assert sorted(a.namespaces()) == ["a", "a_b"]
    a.close()
    b.close()


def test_lmdb_map_grows_and_retries_the_batch(tmp_path):
    s = LmdbStore(tmp_path, map_size=1 << 20, max_map_size=64 << 20)
    batch = {f"k{i}": os.urandom(50_000) for i in range(60)}  # 3 MB into a 1 MB map
    s.mset(batch)
    assert s.grow_count >= 1 and s.num_keys() == 60
    assert s.mget(list(batch)) == list(batch.values())


def test_lmdb_full_at_cap_names_the_cap(tmp_path):
    s = LmdbStore(tmp_path, map_size=1 << 20, max_map_size=2 << 20)
    with pytest.raises(StoreFullError, match="full at max_map_size=2097152 bytes .*namespace ''"):
        s.mset({f"k{i}": os.urandom(100_000) for i in range(40)})
    s.set("small", b"still works")  # the store is usable
    assert s.get("small") == b"still works"


def test_lmdb_batch_filling_the_map_part_way_names_the_keys_written(tmp_path):
    # A batch that fails at max_map_size is written value by value: the values before the map filled
    # up are stored. The StoreFullError did not say which, so a caller could not tell what the store
    # held (the cache counted them as not written and wrote them again).
    s = LmdbStore(tmp_path, namespace="cap", map_size=1 << 20, max_map_size=4 << 20)
    s.mset({f"a{i}": b"x" * 200_000 for i in range(14)})  # 1.3 MB of the 4 MiB left
    batch = {f"b{i}": b"y" * 200_000 for i in range(8)}
    with pytest.raises(StoreFullError) as info:
        s.mset(batch)
    stored = [k.encode() for k, v in zip(batch, s.mget(list(batch))) if v is not None]
    rest = [k.encode() for k in batch if k.encode() not in stored]
    assert 3 < len(stored) < 8 and stored == [k.encode() for k in list(batch)[: len(stored)]]
    assert (info.value.written, info.value.not_written) == (tuple(stored), tuple(rest))
    assert str(info.value) == (
        f"LmdbStore: {tmp_path} is full at max_map_size={4 << 20} bytes (namespace 'cap'); pass a larger "
        "max_map_size= or clear old caches with `trainloom cache clear`. Of the 8 values of this mset, "
        f"written: {len(stored)} ('b0', 'b1', 'b2' and {len(stored) - 3} more); not written: {len(rest)} "
        f"({', '.join(repr(k.decode()) for k in rest)})"
    )
    back = pickle.loads(pickle.dumps(info.value))
    assert (back.written, back.not_written, str(back)) == (tuple(stored), tuple(rest), str(info.value))
    # A batch of which nothing is written says so; a single value needs no list.
    with pytest.raises(StoreFullError) as info:
        s.mset({"c0": os.urandom(300_000), "c1": os.urandom(300_000)})
    assert str(info.value).endswith("`trainloom cache clear`. None of the 2 values of this mset was written")
    assert (info.value.written, info.value.not_written) == ((), (b"c0", b"c1"))
    with pytest.raises(StoreFullError) as info:
        s.set("d", os.urandom(300_000))
    assert str(info.value).endswith("`trainloom cache clear`")
    assert (info.value.written, info.value.not_written) == ((), (b"d",))
    assert StoreFullError("full").written is None  # a store that does not say
    s.close()


def test_lmdb_reclaims_reader_slots_of_killed_processes(tmp_path):
    path = tmp_path / "db"
    # Kept open: the environment stays open, so the reader slots are reclaimed by reader_check() on
    # ReadersFullError (a fresh open by the only process left resets LMDB's reader table itself).
    first = LmdbStore(path, max_readers=4)
    first.set("k", b"v")
    code = textwrap.dedent(f"""
        import lmdb, os, signal, sys
        env = lmdb.open({str(path)!r}, max_readers=4, max_dbs=256)
        txn = env.begin()
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    procs = []
    for _ in range(4):  # fill every slot, then kill the holders
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"ready"
        procs.append(p)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdin.close()
        p.stdout.close()
    s = LmdbStore(path, max_readers=4, namespace="other")
    s.set("x", b"y")
    assert s.get("x") == b"y"  # would be ReadersFullError without reader_check()
    assert s.reader_checks >= 1
    s.close()
    first.close()


def _lmdb_value(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest() * 3125  # 100,000 bytes, different for every key


def _grow_concurrently(path, who, barrier, q):
    """One of several processes writing 24 MB into a map that starts at 1 MiB, reading back as it goes."""
    s = LmdbStore(path, namespace="grow", map_size=1 << 20, max_map_size=1 << 30)
    barrier.wait(30)
    for b in range(12):
        batch = {f"{who}-{b}-{i}": _lmdb_value(f"{who}-{b}-{i}") for i in range(20)}
        s.mset(batch)
        if s.mget(list(batch)) != list(batch.values()):
            q.put((who, "read back differs", s.grow_count))
            return
    q.put((who, "ok", s.grow_count))


def test_lmdb_map_grown_by_several_processes_at_once_keeps_every_value(tmp_path):
    # Three processes fill a 1 MiB map with 72 MB at the same time: each hits MapFullError, grows under
    # the per-node lock (or adopts another's larger size) and retries; readers in the others see
    # MapResizedError. Every value must then be intact, read by a fresh process.
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_grow_concurrently, args=(tmp_path, w, barrier, q)) for w in range(3)]
    for p in procs:
        p.start()
    results, deadline = [], time.monotonic() + 120
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            results.append(q.get(timeout=0.5))
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and q.empty():
                break  # one died without a result (its traceback is on stderr)
    results.sort()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert [r[:2] for r in results] == [(0, "ok"), (1, "ok"), (2, "ok")], results
    assert sum(r[2] for r in results) >= 2  # 1 MiB -> 65 MiB -> 129 MiB at least
    code = textwrap.dedent(f"""
        import hashlib
        from trainloom.data.stores import LmdbStore
        s = LmdbStore({str(tmp_path)!r}, namespace="grow", readonly=True)
        keys = [f"{{w}}-{{b}}-{{i}}" for w in range(3) for b in range(12) for i in range(20)]
        want = [hashlib.sha256(k.encode()).digest() * 3125 for k in keys]
        print(s.num_keys(), s.mget(keys) == want)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["720", "True"], out.stderr[-2000:]


def _child_reads(store, q):
    q.put(store.get("k"))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_lmdb_store_in_child_processes(tmp_path, method):
    import multiprocessing as mp

    s = LmdbStore(tmp_path, namespace="n")
    s.set("k", b"v")
    s.get("k")  # the parent's environment is open when forking
    assert pickle.loads(pickle.dumps(s))._env is None
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_child_reads, args=(s, q))
    p.start()
    assert q.get(timeout=60) == b"v"
    p.join(30)
    assert p.exitcode == 0
    assert s.get("k") == b"v"  # the parent's handle still works


def test_shard_of_is_stable_across_processes():
    keys = [f"ds_{i}" for i in range(50)]
    here = [shard_of(k, 3) for k in keys]
    code = f"import trainloom.data.stores as s; print([s.shard_of(k, 3) for k in {keys!r}])"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert eval(out.stdout) == here
    assert set(here) == {0, 1, 2}
    # Pinned: a change of hash would silently re-shard every existing Redis cluster cache.
    assert here[:10] == [0, 1, 2, 0, 2, 0, 0, 0, 1, 0]


def test_cluster_store_shards_and_keeps_order(tmp_path):
    stores = [LmdbStore(tmp_path / f"s{i}", namespace="c") for i in range(3)]
    c = ClusterStore(stores)
    data = {f"k{i}": str(i).encode() for i in range(60)}
    c.mset(data)
    assert c.mget(list(data)) == list(data.values())
    counts = [s.num_keys() for s in stores]
    assert sum(counts) == 60 == c.num_keys() and min(counts) > 5
    for k in data:
        assert stores[shard_of(k, 3)].get(k) == data[k]
    c.clear()
    assert c.num_keys() == 0 and c.status()


def test_cluster_store_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="at least one store"):
        ClusterStore([])
    with pytest.raises(TypeError, match=r"stores\[1\] is a dict, not a trainloom Store"):
        ClusterStore([LmdbStore(tmp_path), {}])


# -- Redis ----------------------------------------------------------------------------------------


@requires_redis
def test_redis_fingerprint_reset_waits_for_another_ranks_reset(redis_hosts):
    # Two ranks opening a cache whose fingerprint changed each dropped the namespace in turn (the
    # second dropped what the first had written since). A lock key serialises the reset, and the
    # waiting rank finds the new fingerprint set and drops nothing.
    import threading
    import time

    from trainloom.data.stores.redis_store import RedisNodeStore

    addr = redis_hosts[0]
    store = RedisNodeStore(addr["host"], addr["port"], addr["password"], namespace="fp")
    store.clear()
    store.mset({"a": b"1", "b": b"2", "meta": b"v1"})
    lock = b"tl-reset:" + store.prefix
    store._c().set(lock, b"another rank", px=30_000)  # another rank is resetting
    result = []
    waiter = threading.Thread(target=lambda: result.append(store.reset_if_changed("meta", b"v2")))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and result == []  # it waits for the lock
    store.set("meta", b"v2")  # the other rank's reset: new fingerprint ...
    store._c().delete(lock)  # ... and lock released
    waiter.join(10)
    assert result == [False] and store.num_keys() == 3  # nothing dropped a second time
    assert store.reset_if_changed("meta", b"v3") is True and store.num_keys() == 1  # unlocked: resets
    assert store._c().get(lock) is None  # released after its own reset; not counted in num_keys()


@requires_redis
def test_redis_fingerprint_reset_whose_lock_command_was_retried_does_not_wait_for_itself(own_redis):
    # A stall longer than the client timeout just as the lock's SET NX was sent (DEBUG SLEEP, a fork
    # for BGSAVE): the server ran it, redis-py sent it again, the second found the lock taken by
    # this very process, and the reset waited for the lock until its deadline (60 s), blaming
    # "another process". The client's resend is reproduced here by sending every SET NX twice.
    import time

    from trainloom.data.stores.redis_store import RedisNodeStore

    addr = own_redis().address()
    store = RedisNodeStore(addr["host"], addr["port"], addr["password"], namespace="fp2")
    store.RESET_LOCK_MS = 5000  # the deadline, shortened so that the old behaviour fails in 5 s
    store.mset({"a": b"1", "meta": b"v1"})
    client = store._c()
    set_once = client.set

    def set_resent(*args, **kwargs):
        first = set_once(*args, **kwargs)
        return set_once(*args, **kwargs) if kwargs.get("nx") else first

    client.set = set_resent
    t0 = time.monotonic()
    assert store.reset_if_changed("meta", b"v2") is True
    assert time.monotonic() - t0 < 4
    assert store.get("meta") == b"v2" and store.num_keys() == 1
    assert client.get(b"tl-reset:" + store.prefix) is None  # released


@requires_redis
def test_redis_maxclients_reached_says_so(own_redis):
    import redis

    from trainloom.data.stores.redis_store import RedisNodeStore

    srv = own_redis()
    admin = redis.Redis(srv.host, srv.port, password=srv.password)
    admin.config_set("maxclients", 1)
    admin.ping()  # the one connection allowed
    store = RedisNodeStore(srv.host, srv.port, srv.password, namespace="mc")
    with pytest.raises(
        StoreUnavailableError,
        match=r": the server refused the connection: its maxclients is reached \(.*max number of clients "
        r"reached.*\); raise the server's maxclients or use fewer processes \(each process and each "
        r"persistent DataLoader worker holds one connection per server\)$",
    ):
        store.get("k")
    admin.close()


@requires_redis
def test_redis_node_api_and_namespaces(redis_hosts):
    from trainloom.data.stores.redis_store import RedisStore

    a = RedisStore(redis_hosts, namespace="t1")
    b = RedisStore(redis_hosts, namespace="t1:x")  # "t1"'s prefix must not match "t1:x" keys
    a.clear()
    b.clear()
    a.mset({f"k{i}": bytes([i]) * 10 for i in range(150)})  # > one MGET chunk
    b.set("k1", b"other")
    assert a.mget([f"k{i}" for i in range(150)]) == [bytes([i]) * 10 for i in range(150)]
    assert a.get("k1") != b.get("k1")
    assert a.num_keys() == 150 and b.num_keys() == 1
    a.clear()
    assert a.num_keys() == 0 and b.num_keys() == 1
    assert a.status()
    c = pickle.loads(pickle.dumps(b))
    assert c.get("k1") == b"other"
    b.clear()


@requires_redis
def test_redis_cluster_mode_over_two_servers(own_redis):
    from trainloom.data.stores.redis_store import RedisStore

    hosts = [own_redis().address(), own_redis().address()]
    s = RedisStore(hosts, cluster_mode=True, namespace="c")
    s.mset({f"k{i}": b"x" for i in range(40)})
    per = [n.num_keys() for n in s.stores]
    assert sum(per) == 40 and min(per) > 5
    single = RedisStore(hosts, cluster_mode=False, namespace="c")
    assert len(single.stores) == 1 and single.stores[0].port == hosts[0]["port"]  # node 0 -> server 0


@requires_redis
def test_redis_bad_arguments(redis_hosts):
    from trainloom.data.stores.redis_store import RedisStore

    with pytest.raises(ValueError, match="hosts must be a non-empty list"):
        RedisStore([])
    with pytest.raises(ValueError, match=r"hosts\[0\] = .* must be a dict with 'host' and 'port'"):
        RedisStore([{"host": "127.0.0.1"}])
    with pytest.raises(ValueError, match="timeout must be > 0"):
        RedisStore(redis_hosts, timeout=0)
    with pytest.raises(ValueError, match="capacity_per_node must be a positive int"):
        RedisStore(redis_hosts, capacity_per_node=-1)
    wrong = [dict(redis_hosts[0], password="wrong")]
    with pytest.raises(StoreUnavailableError, match="password"):
        RedisStore(wrong).get("k")


@requires_redis
@pytest.mark.timeout(30)
def test_redis_dead_and_paused_servers_raise_quickly(own_redis):
    from trainloom.data.stores.redis_store import RedisStore

    srv = own_redis()
    s = RedisStore([srv.address()], namespace="d")
    s.set("k", b"v")
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailableError, match="unreachable after 2 attempts with a 0.5s timeout"):
            s.get("k")
        assert not s.status()
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert s.get("k") == b"v"
    srv.proc.kill()
    srv.proc.wait()
    with pytest.raises(StoreUnavailableError, match="is redis-server running"):
        s.mset({"a": b"b"})


@requires_redis
def test_redis_out_of_memory_is_reported(own_redis):
    from trainloom.data.stores.redis_store import RedisStore

    srv = own_redis(maxmemory=3 << 20)
    s = RedisStore([srv.address()], namespace="oom")
    with pytest.raises(StoreOutOfMemoryError, match="OOM"):
        for i in range(100):
            s.set(f"k{i}", os.urandom(200_000))


@requires_redis
@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["main", "thread"])
def test_started_server_is_private_and_dies_with_its_killed_job(tmp_path, where):
    # "thread": started from a thread pool (as Ray Train runs the training function), the server died
    # as soon as that thread ended: PR_SET_PDEATHSIG follows the thread that forked it.
    code = textwrap.dedent("""
        import json, sys, time
        from concurrent.futures import ThreadPoolExecutor
        from trainloom.data.stores.redis_store import RedisStore, _NODE_SERVERS
        if sys.argv[1] == "main":
            s = RedisStore(namespace="job")
        else:
            with ThreadPoolExecutor(1) as pool:
                s = pool.submit(RedisStore, namespace="job").result()
            time.sleep(0.5)  # the pool's thread has ended
            assert s.get("k") is None  # the server still answers
        srv = next(iter(_NODE_SERVERS.values()))
        print(json.dumps(dict(s.hosts[0], pid=srv.proc.pid)), flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code, where], stdout=subprocess.PIPE, text=True)
    import json

    import psutil

    line = p.stdout.readline()
    assert line, f"the job exited with {p.wait()}"
    info = json.loads(line)
    try:
        assert info["host"] == "127.0.0.1" and len(info["password"]) == 32
        server = psutil.Process(info["pid"])
        conns = [c for c in server.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert conns and all(c.laddr.ip == "127.0.0.1" for c in conns)
        assert server.ppid() == p.pid  # not daemonized
        assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
        from trainloom.data.stores.redis_store import RedisStore

        with pytest.raises(StoreUnavailableError, match="authentication|password|NOAUTH|unreachable"):
            RedisStore([{"host": info["host"], "port": info["port"]}]).get("k")
    finally:
        p.kill()  # SIGKILL: no atexit runs in the job
        p.wait()
    server.wait(timeout=10)  # raises psutil.TimeoutExpired if the server outlived its job
    assert not psutil.pid_exists(info["pid"]) or server.status() == psutil.STATUS_ZOMBIE


def test_store_errors_pickle_across_processes():
    from trainloom.data.codec import ChecksumError
    from trainloom.errors import StoreError as BaseStoreError

    for exc in (
        StoreUnavailableError("redis 127.0.0.1:1: down", backend="redis", key="k"),
        StoreFullError("full", backend="lmdb"),
        StoreOutOfMemoryError("OOM", backend="redis"),
    ):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and (back.message, back.backend, back.key) == (
            exc.message,
            exc.backend,
            exc.key,
        )
        assert isinstance(back, BaseStoreError)
    assert isinstance(StoreUnavailableError("x"), ConnectionError)
    c = pickle.loads(pickle.dumps(ChecksumError("damaged value")))
    assert type(c) is ChecksumError and isinstance(c, ValueError) and str(c) == "damaged value"


def test_lmdb_readonly_and_writer_in_one_process(tmp_path):
    with LmdbStore(tmp_path, namespace="a") as w:
        w.set("k", b"v")
    ro = LmdbStore(tmp_path, namespace="a", readonly=True)
    assert ro.get("k") == b"v"
    with pytest.raises(StoreError, match="already open read-only in this process"):
        LmdbStore(tmp_path, namespace="a").set("k", b"w")
    with pytest.raises(StoreError, match="opened read-only"):
        ro.set("k", b"w")
    with pytest.raises(StoreError, match="namespace 'zz' does not exist"):
        LmdbStore(tmp_path, namespace="zz", readonly=True).num_keys()
    ro.close()
    LmdbStore(tmp_path, namespace="a").set("k", b"w")


# -- argument checks ------------------------------------------------------------------------------


def test_mset_takes_a_mapping(tmp_path):
    msg = r"LmdbStore.mset takes a mapping of key -> value \(e.g. dict\(pairs\)\), got list"
    with pytest.raises(TypeError, match=msg):
        LmdbStore(tmp_path).mset([("k", b"v")])
    with pytest.raises(TypeError, match=r"ClusterStore.mset takes a mapping of key -> value .*got tuple"):
        ClusterStore([LmdbStore(tmp_path / "a"), LmdbStore(tmp_path / "b")]).mset((("k", b"v"),))


def test_lmdb_keys_are_checked_against_the_limit(tmp_path):
    s = LmdbStore(tmp_path, namespace="ns")
    with pytest.raises(ConfigError, match=r"LmdbStore \(namespace 'ns'\): LMDB keys cannot be empty"):
        s.set("", b"v")
    with pytest.raises(ConfigError, match=r"LMDB keys cannot be empty"):
        s.get("")  # MDB_BAD_VALSIZE on a read is explained too
    with pytest.raises(
        ConfigError,
        match=r"the key 'k+\.\.\. is 600 bytes; LMDB keys are limited to 511 bytes\. Hash long keys",
    ):
        s.mset({"ok": b"1", "k" * 600: b"v"})
    assert s.num_keys() == 0  # nothing of the refused batch was written
    s.set("k" * 511, b"v")
    assert s.get("k" * 511) == b"v" and s.get("k" * 600) is None  # too long to exist: missing
    assert s.max_key_size == 511


def test_lmdb_path_that_is_a_file_or_cannot_be_created(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"LmdbStore: path '.*/file' exists and is not a directory"):
        LmdbStore(f)
    with pytest.raises(
        StoreError, match=r"LmdbStore: cannot create the directory '.*/file/sub' .*NotADirectoryError"
    ):
        LmdbStore(f / "sub").set("k", b"v")


# -- stores written to Bagua's interface ------------------------------------------------------------


class BaguaDictStore(Store):
    """Exactly Bagua's eight methods (``get, set, mget, mset, num_keys, clear, status, shutdown``);
    values kept as given, or as ``str`` when ``as_str`` (Bagua allows ``Union[str, bytes]``)."""

    def __init__(self, as_str: bool = False) -> None:
        self.d: dict = {}
        self.as_str = as_str
        self.shut = False

    def _out(self, v):
        return v.decode("latin-1") if self.as_str and v is not None else v

    def get(self, key):
        return self._out(self.d.get(key))

    def set(self, key, value):
        self.d[key] = bytes(value)

    def mget(self, keys):
        return [self._out(self.d.get(k)) for k in keys]

    def mset(self, dictionary):
        for k, v in dictionary.items():
            self.set(k, v)

    def num_keys(self):
        return len(self.d)

    def clear(self):
        self.d.clear()

    def status(self):
        return True

    def shutdown(self):
        self.shut = True


def test_a_bagua_style_store_works_with_the_cache():
    store = BaguaDictStore()
    loader = CacheLoader(store, "bagua", fingerprint="v1")
    assert loader.get(1, lambda k: (k, torch.ones(2))) is not None
    assert loader.get_many([1, 2, 3], lambda k: None if k == 3 else k)[1:] == [2, None]
    x, t = loader.get(1, lambda k: pytest.fail("recomputed"))
    assert x == 1 and torch.equal(t, torch.ones(2))
    assert loader.get(3, lambda k: pytest.fail("recomputed")) is None  # a stored None is a hit
    assert loader.contains_many([1, 4]) == [True, False] and loader.num_keys() == 3
    loader.close()  # Store.close defaults to a no-op: it must not shut a Bagua store down
    assert not store.shut
    store.shutdown()
    assert store.shut
    # The fingerprint is recognised again: nothing dropped.
    assert CacheLoader(store, "bagua", fingerprint="v1").num_keys() == 3


def test_str_values_from_a_bagua_store_in_a_cluster():
    shards = [BaguaDictStore(as_str=True), BaguaDictStore(as_str=True)]
    cluster = ClusterStore(shards)
    cluster.mset({f"k{i}": f"v{i}".encode() for i in range(20)})
    assert cluster.mget([f"k{i}" for i in range(20)] + ["nope"]) == [f"v{i}".encode() for i in range(20)] + [
        None
    ]
    assert cluster.get("k3") == b"v3" and min(s.num_keys() for s in shards) > 2
    # str values that held encoded samples come back as UTF-8 bytes: not the value, so recomputed.
    loader = CacheLoader(cluster, "c")
    loader.get(1, lambda k: "one")
    assert loader.get(1, lambda k: "again") == "again" and loader.stats()["corrupt"] == 1


def test_a_store_must_define_mget_or_mget_apply():
    class Nothing(Store):
        def mset(self, dictionary):
            pass

        def num_keys(self):
            return 0

        def clear(self):
            pass

        def status(self):
            return True

    with pytest.raises(
        NotImplementedError, match=r"Nothing must implement mget_apply\(keys, fn\) or mget\(keys\)"
    ):
        Nothing().get("k")


def test_an_older_mget_decode_override_still_tells_none_from_missing(tmp_path):
    class Counting(LmdbStore):  # written for a trainloom whose mget_decode took keys only
        calls = 0

        def mget_decode(self, keys):
            Counting.calls += 1
            return super().mget_decode(keys)

    loader = CacheLoader(Counting(tmp_path, namespace="old"), "old")
    assert loader.get_many([1, 2], lambda k: None) == [None, None]
    assert loader.get_many([1, 2], lambda k: pytest.fail("recomputed")) == [None, None]
    assert loader.stats()["hits"] == 2 and Counting.calls == 2  # the override is still used


# -- LMDB at max_map_size: freeing operations, the cap, read-only stores, collected stores ----------


def _fill_to_the_cap(store, size, batch):
    with pytest.raises(StoreFullError, match="is full at max_map_size="):
        for i in range(100_000):
            store.mset({f"k{i}_{j}": os.urandom(size) for j in range(batch)})


def test_lmdb_clear_delete_and_reset_at_max_map_size(tmp_path):
    # Before: clear() of a store full at its cap failed with "mdb_txn_commit: MDB_MAP_FULL" (a drop
    # frees pages, but its commit writes the free list to new pages), although the StoreFullError
    # tells users to clear old caches; delete() and a fingerprint reset failed the same way.
    cap = 4 << 20
    s = LmdbStore(tmp_path, namespace="ds", map_size=1 << 20, max_map_size=cap)
    _fill_to_the_cap(s, 1000, 8)
    n = s.num_keys()
    s.delete([f"k{i}_{j}" for i in range(50) for j in range(8)])
    assert s.num_keys() == n - 400
    s.clear()
    assert s.num_keys() == 0
    env = s._handles()
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    assert used <= cap + (512 << 10)  # a bounded overshoot for the free lists and copied pages
    assert env.info()["map_size"] == max(cap, used)  # and the map is set back to the cap
    _fill_to_the_cap(s, 1000, 8)
    assert s.reset_if_changed("fp", b"one") is False
    _fill_to_the_cap(s, 1000, 8)
    assert s.reset_if_changed("fp", b"two") is True
    assert s.num_keys() == 1 and s.get("fp") == b"two"
    s.close()


def test_lmdb_freeing_leaves_the_map_and_atomicity_as_they_were_when_not_at_the_cap(tmp_path):
    """Review of the fix above: the map was taken back to this store's cap after every clear, delete
    and fingerprint reset, also when it did not grow them: a store with a small cap shrank the map
    another store on the same path had grown (and set_mapsize failed outright while another thread
    was in a write transaction); delete always committed per 32 keys (not atomic, an fsync each)."""
    big = LmdbStore(tmp_path, namespace="big", map_size=1 << 20, max_map_size=1 << 30)
    big.mset({f"k{i}": os.urandom(100_000) for i in range(60)})  # grows the map past 4 MiB
    env = big._handles()
    grown = env.info()["map_size"]
    small = LmdbStore(tmp_path, namespace="small", map_size=1 << 20, max_map_size=4 << 20)
    small.mset({f"s{i}": b"x" for i in range(100)})
    txn = env.info()["last_txnid"]
    small.delete([f"s{i}" for i in range(100)])
    assert env.info()["last_txnid"] == txn + 1 and small.num_keys() == 0  # one transaction
    small.mset({"s": b"x"})
    small.clear()
    assert small.reset_if_changed("fp", b"1") is False
    assert env.info()["map_size"] == grown
    # trainloom cache clear in this process (the path is held open) keeps the map too (it opened
    # the store with map_size 1 when it could not open the path a second time).
    from trainloom.cli import main

    assert main(["cache", "clear", "--path", str(tmp_path), "--namespace", "small"]) == 0
    assert env.info()["map_size"] == grown
    small.close()
    big.close()


def test_lmdb_writes_after_clear_at_max_map_size_reuse_the_freed_pages(tmp_path):
    # Before: every write after clear() at the cap raised StoreFullError until another write
    # committed (LMDB reuses pages freed by the last committed transaction only after a newer one).
    s = LmdbStore(tmp_path, namespace="a", map_size=1 << 20, max_map_size=4 << 20)
    _fill_to_the_cap(s, 50_000, 4)
    s.clear()
    batch = {f"g{j}": os.urandom(50_000) for j in range(4)}
    s.mset(batch)
    assert s.mget(list(batch)) == list(batch.values()) and s.num_keys() == 4
    s.close()


def test_lmdb_write_at_the_cap_after_a_commit_that_freed_pages(tmp_path):
    # Overwriting large values with small ones frees their pages; the next write could not use them
    # (StoreFullError) until another transaction committed: the map growth now commits one first.
    s = LmdbStore(tmp_path, namespace="a", map_size=1 << 20, max_map_size=4 << 20)
    _fill_to_the_cap(s, 50_000, 4)
    s.mset({f"k{i}_{j}": b"x" for i in range(20) for j in range(4)})
    batch = {f"g{j}": os.urandom(50_000) for j in range(4)}
    s.mset(batch)
    assert s.mget(list(batch)) == list(batch.values())
    s.close()


def test_lmdb_max_map_size_holds_after_another_open_committed_a_larger_map(tmp_path):
    # A store (or, before, `trainloom cache clear`, which opened with 1 GiB) committed a 64 MiB map:
    # a store with max_map_size=2 MiB adopted it when growing and wrote past its cap.
    with LmdbStore(tmp_path, namespace="big", map_size=64 << 20) as big:
        big.set("k", b"v")
    s = LmdbStore(tmp_path, namespace="a", map_size=1 << 20, max_map_size=2 << 20)
    with pytest.raises(StoreFullError, match="is full at max_map_size=2097152 bytes"):
        for i in range(20):  # 4 MB
            s.mset({f"k{i}_{j}": os.urandom(100_000) for j in range(2)})
    env = s._handles()
    assert env.info()["map_size"] == 2 << 20
    assert (env.info()["last_pgno"] + 1) * env.stat()["psize"] <= 2 << 20
    assert os.path.getsize(tmp_path / "data.mdb") <= 2 << 20
    s.close()


def test_lmdb_readonly_store_refuses_every_write_while_a_writer_is_open(tmp_path):
    # The read-only store shares the writer's environment: delete, clear and reset_if_changed wrote.
    w = LmdbStore(tmp_path, namespace="a", map_size=1 << 20)
    w.mset({"k": b"v", "k2": b"v"})
    ro = LmdbStore(tmp_path, namespace="a", readonly=True)
    assert ro.get("k") == b"v"
    msg = f"^LmdbStore: {tmp_path} was opened read-only$"
    for call in (lambda: ro.delete(["k"]), ro.clear, lambda: ro.reset_if_changed("fp", b"x")):
        with pytest.raises(StoreError, match=msg):
            call()
    assert w.num_keys() == 2 and ro.get("fp") is None
    ro.close()
    w.close()


def test_lmdb_store_collected_without_close_releases_its_environment(tmp_path):
    import gc

    with LmdbStore(tmp_path, namespace="a", map_size=1 << 20) as w:
        w.set("k", b"v")
    keep = LmdbStore(tmp_path, namespace="a", readonly=True)
    r = LmdbStore(tmp_path, namespace="a", readonly=True)
    assert r.get("k") == b"v" and keep.get("k") == b"v"
    r.cycle = r  # freed by the cyclic collector, at an arbitrary point
    del r
    gc.collect()
    assert keep.get("k") == b"v"  # the environment stays open for the other store
    keep.close()
    r = LmdbStore(tmp_path, namespace="a", readonly=True)
    assert r.get("k") == b"v"
    del r
    gc.collect()
    # Before: "already open read-only in this process" (the collected store never released it).
    with LmdbStore(tmp_path, namespace="a") as w:
        w.set("k2", b"w")
        assert w.get("k2") == b"w"


@requires_redis
def test_redis_hosts_entry_with_password_none_takes_password_argument(redis_server):
    # h.get("password", password) kept the entry's None: the server refused the unauthenticated client.
    from trainloom.data.stores.redis_store import RedisStore

    hosts = [{"host": redis_server.host, "port": redis_server.port, "password": None}]
    s = RedisStore(hosts, password=redis_server.password, namespace="pwnone")
    s.set("k", b"v")
    assert s.get("k") == b"v"
    s.clear()
    s.close()


def test_a_cache_in_a_directory_this_user_may_only_read_opens_read_only(tmp_path):
    # A pre-built cache owned by another user (files 444, directory 555): LMDB's lock file needs
    # write access, so readonly=True and `trainloom cache info` failed with "Permission denied"
    # (plain lmdb.open(readonly=True, lock=False) read it). Root ignores permissions, so the reader
    # runs without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH (util-linux's setpriv).
    path = tmp_path / "shared"
    with LmdbStore(path, namespace="ds") as store:
        store.mset({"k": b"v" * 100})
    for f in path.iterdir():
        f.chmod(0o444)
    path.chmod(0o555)
    script = textwrap.dedent(
        f"""
        from trainloom.data.stores import LmdbStore, StoreError
        with LmdbStore({str(path)!r}, namespace="ds", readonly=True) as s:
            print(s.get("k") == b"v" * 100, s.num_keys())
        try:
            LmdbStore({str(path)!r}, namespace="ds").mset({{"x": b"1"}})
        except StoreError as exc:
            print(type(exc).__name__, "cannot open" in str(exc))
        """
    )
    drop = "-dac_override,-dac_read_search"
    cmd = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", sys.executable, "-c", script]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        path.chmod(0o755)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["True 1", "StoreError True"]
    assert "opened read-only without LMDB's lock file" in proc.stderr
