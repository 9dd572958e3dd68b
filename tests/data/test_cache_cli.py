"""`trainloom cache info|clear` on real LMDB caches and a real Redis server."""

from __future__ import annotations

import re

import pytest
from redisutil import requires_redis

from trainloom.cli import main
from trainloom.data.cache import CacheLoader
from trainloom.data.stores import StoreUnavailableError


def test_cache_info_and_clear_lmdb(tmp_path, capsys):
    for name, n in (("alpha", 3), ("beta", 5)):
        loader = CacheLoader(path=tmp_path, dataset_name=name)
        for i in range(n):
            loader.get(i, lambda k: k)
        loader.close()
    assert main(["cache", "info", "--path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "namespace 'alpha': 3 entries" in out and "namespace 'beta': 5 entries" in out
    assert main(["cache", "clear", "--path", str(tmp_path), "--namespace", "alpha"]) == 0
    assert "cleared 3 entries of namespace 'alpha'" in capsys.readouterr().out
    assert CacheLoader(path=tmp_path, dataset_name="beta").num_keys() == 5
    assert CacheLoader(path=tmp_path, dataset_name="alpha").num_keys() == 0
    assert main(["cache", "clear", "--path", str(tmp_path), "--all"]) == 0
    assert CacheLoader(path=tmp_path, dataset_name="beta").num_keys() == 0


def test_counts_leave_out_the_fingerprint_entry(tmp_path, capsys):
    # CachedDataset keeps its fingerprint in the namespace: 5 samples were shown as 6 entries by the
    # CLI and by a CacheLoader opened on the namespace without the fingerprint.
    from trainloom.data.cache import CachedDataset

    ds = CachedDataset(list(range(5)), path=tmp_path, dataset_name="five", fingerprint="v1")
    [ds[i] for i in range(5)]
    ds.close()
    assert CacheLoader(path=tmp_path, dataset_name="five").num_keys() == 5
    assert CacheLoader(path=tmp_path, dataset_name="five", readonly=True).num_keys() == 5
    assert main(["cache", "info", "--path", str(tmp_path)]) == 0
    assert "namespace 'five': 5 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--path", str(tmp_path), "--namespace", "five"]) == 0
    assert "cleared 5 entries of namespace 'five'" in capsys.readouterr().out


def test_cache_info_accepts_the_cache_dir_holding_lmdb(tmp_path, capsys, monkeypatch):
    # $TRAINLOOM_CACHE_DIR is the cache directory; the default LMDB store lives in its lmdb/.
    monkeypatch.setenv("TRAINLOOM_CACHE_DIR", str(tmp_path))
    loader = CacheLoader(dataset_name="gamma")
    loader.get(1, lambda k: k)
    loader.close()
    assert (tmp_path / "lmdb" / "data.mdb").exists()
    for args in (["--path", str(tmp_path)], ["--path", str(tmp_path / "lmdb")], []):
        assert main(["cache", "info", *args]) == 0
        assert "namespace 'gamma': 1 entries" in capsys.readouterr().out


def test_cache_cli_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRAINLOOM_CACHE_DIR", str(tmp_path / "none"))
    # Errors go to stderr (they went to stdout), with nothing on stdout.
    for cmd in (["info"], ["info", "--path", str(tmp_path / "none" / "lmdb")], ["clear", "--all"]):
        assert main(["cache", *cmd]) == 1
        assert capsys.readouterr() == ("", f"no LMDB cache at {tmp_path / 'none' / 'lmdb'}\n")
    assert main(["cache", "clear"]) == 2
    assert "name a --namespace, or pass --all" in capsys.readouterr().err
    CacheLoader(path=tmp_path, dataset_name="x").get(1, lambda k: k)
    assert main(["cache", "clear", "--path", str(tmp_path), "--namespace", "nope"]) == 1
    assert "namespace 'nope' not found" in capsys.readouterr().err
    assert main(["cache", "info", "--redis", "localhost"]) == 1
    assert (
        "--redis must be HOST:PORT ([ADDR]:PORT for IPv6, or redis://[[USER]:PASSWORD@]HOST:PORT[/DB]), "
        "got 'localhost'" in (capsys.readouterr().err)
    )
    assert main(["cache", "info", "--redis", "127.0.0.1:99999"]) == 1
    assert "--redis: port 99999 is outside 1..65535" in capsys.readouterr().err
    assert main(["cache", "info", "--redis", "redis://127.0.0.1"]) == 1
    assert (
        "--redis must be HOST:PORT or redis://[[USER]:PASSWORD@]HOST:PORT[/DB], got 'redis://127.0.0.1'"
        in (capsys.readouterr().err)
    )
    assert main(["cache", "info", "--redis", "rediss://:pw@127.0.0.1:6380"]) == 1
    assert "--redis: TLS (rediss://) is not supported, got 'rediss://:***@127.0.0.1:6380'" in (
        capsys.readouterr().err
    )
    assert main(["cache", "info", "--redis", "redis://127.0.0.1:6379/x"]) == 1
    assert "got 'redis://127.0.0.1:6379/x'" in capsys.readouterr().err
    assert main(["cache"]) == 2


@requires_redis
def test_cache_info_and_clear_redis(redis_server, capsys):
    addr = f"{redis_server.host}:{redis_server.port}"
    loader = CacheLoader("redis", "cli", hosts=[redis_server.address()])
    loader.clear()
    for i in range(4):
        loader.get(i, lambda k: k)
    pw = ["--password", redis_server.password]
    assert main(["cache", "info", "--redis", addr, *pw, "--namespace", "cli"]) == 0
    assert "namespace 'cli': 4 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--redis", addr, *pw]) == 2
    assert main(["cache", "clear", "--redis", addr, *pw, "--namespace", "cli"]) == 0
    assert loader.num_keys() == 0


@requires_redis
def test_cache_clear_of_an_unknown_redis_namespace_fails_as_for_lmdb(own_redis, capsys):
    # It said "cleared 0 entries" and exited 0; LMDB says the namespace is not found and exits 1.
    srv = own_redis()  # a server of its own on 127.0.0.1 and a free port, stopped after the test
    loader = CacheLoader("redis", "kept", hosts=[srv.address()])
    for i in range(3):
        loader.get(i, lambda k: k)
    loader.flush()
    addr = f"{srv.host}:{srv.port}"
    pw = ["--password", srv.password]
    assert main(["cache", "clear", "--redis", addr, *pw, "--namespace", "nonexist"]) == 1
    assert capsys.readouterr() == (
        "",
        f"namespace 'nonexist' not found on redis {srv.host}:{srv.port} (have: ['kept'])\n",
    )
    assert loader.num_keys() == 3
    assert main(["cache", "clear", "--redis", addr, *pw, "--namespace", "kept"]) == 0
    assert capsys.readouterr() == ("cleared 3 entries of namespace 'kept' on " + addr + "\n", "")
    assert loader.num_keys() == 0
    loader.close()


@requires_redis
def test_cache_cli_redis_url_ipv4_brackets_and_password_from_the_environment(
    redis_server, capsys, monkeypatch
):
    loader = CacheLoader("redis", "cli2", hosts=[redis_server.address()])
    loader.clear()
    loader.get(1, lambda k: k)
    loader.flush()
    port, pw = redis_server.port, redis_server.password
    url = f"redis://:{pw}@{redis_server.host}:{port}"
    assert main(["cache", "info", "--redis", url, "--namespace", "cli2"]) == 0
    assert "namespace 'cli2': 1 entries" in capsys.readouterr().out
    monkeypatch.setenv("REDISCLI_AUTH", pw)  # redis-cli's variable: the password stays out of `ps`
    assert main(["cache", "info", "--redis", f"[{redis_server.host}]:{port}", "--namespace", "cli2"]) == 0
    assert "namespace 'cli2': 1 entries" in capsys.readouterr().out
    # Without --namespace every namespace is listed (it showed namespace '' with 0 entries); an unknown
    # one is an error, as for LMDB (it showed 0 entries and exited 0).
    assert main(["cache", "info", "--redis", url]) == 0
    assert "\n  namespace 'cli2': 1 entries\n" in capsys.readouterr().out
    assert main(["cache", "info", "--redis", url, "--namespace", "nope"]) == 1
    err = capsys.readouterr().err
    assert f"namespace 'nope' not found on redis {redis_server.host}:{port} (have: [" in err
    assert "'cli2'" in err
    loader.clear()


@requires_redis
def test_cache_acl_user_and_db_from_hosts_and_from_the_cli_url(own_redis, capsys):
    # "username" in hosts= was dropped (then "authentication failed ... check the password" although
    # it was right), "db" was dropped (data went to db 0), and the CLI ignored USER@ and /DB in URLs.
    import redis

    srv = own_redis()
    admin = redis.Redis(srv.host, srv.port, password=srv.password)
    admin.execute_command("ACL", "SETUSER", "cache", "on", ">s3cret", "~*", "&*", "+@all")
    host = {"host": srv.host, "port": srv.port, "username": "cache", "password": "s3cret", "db": 3}
    loader = CacheLoader("redis", "acl", hosts=[host])
    assert loader.get(1, lambda k: "one") == "one"
    loader.flush()
    assert admin.dbsize() == 0 and redis.Redis(srv.host, srv.port, password=srv.password, db=3).dbsize() == 1
    url = f"redis://cache:s3cret@{srv.host}:{srv.port}/3"
    assert main(["cache", "info", "--redis", url, "--namespace", "acl"]) == 0
    assert "namespace 'acl': 1 entries" in capsys.readouterr().out
    loader.close()
    with pytest.raises(
        StoreUnavailableError, match=r"authentication failed .*; check the username and password$"
    ):
        CacheLoader("redis", "acl", hosts=[dict(host, password="wrong")]).get(2, lambda k: k)
    with pytest.raises(
        ValueError,
        match=r"^RedisStore: hosts\[0\] has unknown keys \['ssl'\]; each entry takes \['db', 'host', "
        r"'password', 'port', 'username'\] \(TLS is not supported\)$",
    ):
        CacheLoader("redis", "acl", hosts=[dict(host, ssl=True)])
    with pytest.raises(ValueError, match=r"^RedisStore: db must be an int >= 0, got '3'$"):
        CacheLoader("redis", "acl", hosts=[dict(host, db="3")])


@pytest.mark.parametrize(
    "cmd,expected", [(["cache", "--help"], "{info,clear}"), (["cache", "info", "--help"], "--namespace")]
)
def test_cache_help(cmd, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main(cmd)
    assert exc.value.code == 0 and expected in capsys.readouterr().out


def _committed_map_size(path):
    from trainloom.data.stores.lmdb_store import _committed_map_size

    return _committed_map_size(path)


def test_cache_cli_keeps_and_reports_the_committed_map_size(tmp_path, capsys):
    # The CLI opened the cache with LmdbStore's default map_size (1 GiB): `info` printed "map 1.0 GiB"
    # for a 2 MiB cache, and `clear` committed a 1 GiB map, which a store with a smaller
    # max_map_size then adopted when it grew.
    from trainloom.data.stores import LmdbStore

    with LmdbStore(tmp_path, namespace="a", map_size=2 << 20, max_map_size=2 << 20) as s:
        s.mset({f"k{i}": b"x" * 1000 for i in range(20)})
    assert _committed_map_size(tmp_path) == 2 << 20
    assert main(["cache", "info", "--path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"LMDB cache {tmp_path}: ") and ", map 2.0 MiB, " in out, out
    assert main(["cache", "clear", "--path", str(tmp_path), "--namespace", "a"]) == 0
    assert capsys.readouterr().out == f"cleared 20 entries of namespace 'a' in {tmp_path}\n"
    assert _committed_map_size(tmp_path) == 2 << 20
    assert main(["cache", "info", "--path", str(tmp_path)]) == 0
    assert ", map 2.0 MiB, " in capsys.readouterr().out


def test_cache_clear_of_a_cache_full_at_its_max_map_size(tmp_path, capsys):
    # The error of a full cache says to run `trainloom cache clear`: it failed with MDB_MAP_FULL.
    from trainloom.data.stores import LmdbStore, StoreFullError

    s = LmdbStore(tmp_path, namespace="full", map_size=1 << 20, max_map_size=2 << 20)
    with pytest.raises(StoreFullError, match="trainloom cache clear"):
        for i in range(10_000):
            s.mset({f"k{i}_{j}": bytes(1000) for j in range(8)})
    n = s.num_keys()
    s.close()
    assert main(["cache", "clear", "--path", str(tmp_path), "--all"]) == 0
    assert capsys.readouterr() == (f"cleared {n} entries of namespace 'full' in {tmp_path}\n", "")
    with LmdbStore(tmp_path, namespace="full", map_size=1 << 20, max_map_size=2 << 20) as s:
        assert s.num_keys() == 0
        s.mset({f"g{j}": bytes(50_000) for j in range(4)})


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["clear", "--namespace", "a", "--all"],
            "trainloom cache clear: error: argument --all: not allowed with argument --namespace",
        ),
        (
            ["info", "--redis", "127.0.0.1:1", "--path", "X"],
            "trainloom cache info: error: argument --path: not allowed with argument --redis",
        ),
        (
            ["clear", "--path", "X", "--redis", "127.0.0.1:1", "--namespace", "a"],
            "trainloom cache clear: error: argument --redis: not allowed with argument --path",
        ),
    ],
)
def test_cache_cli_conflicting_arguments_are_a_usage_error(tmp_path, capsys, args, line):
    # `clear --namespace a --all` cleared every namespace and exited 0; `info --redis ... --path X`
    # ignored --path.
    loader = CacheLoader(path=tmp_path, dataset_name="a")
    loader.get(1, lambda k: k)
    loader.close()
    args = [str(tmp_path) if a == "X" else a for a in args]
    with pytest.raises(SystemExit) as exc:
        main(["cache", *args])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.splitlines()[-1] == line
    assert CacheLoader(path=tmp_path, dataset_name="a").num_keys() == 1


@requires_redis
def test_cache_cli_never_prints_the_redis_password(own_redis, capsys):
    # `clear --redis redis://:PW@host:port` echoed the URL, password included, on stdout.
    srv = own_redis()
    loader = CacheLoader("redis", "secret", hosts=[srv.address()])
    for i in range(3):
        loader.get(i, lambda k: k)
    loader.flush()
    pw = srv.password
    url = f"redis://:{pw}@{srv.host}:{srv.port}"
    assert main(["cache", "clear", "--redis", url, "--namespace", "secret"]) == 0
    assert capsys.readouterr() == (f"cleared 3 entries of namespace 'secret' on {srv.host}:{srv.port}\n", "")
    assert main(["cache", "info", "--redis", url]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"redis {srv.host}:{srv.port}: used ") and pw not in out + err
    # Invalid addresses are echoed without the password too.
    for bad in (f"redis://:{pw}@{srv.host}", f"redis://user:{pw}@{srv.host}:{srv.port}/x"):
        assert main(["cache", "info", "--redis", bad]) == 1
        out, err = capsys.readouterr()
        assert out == "" and pw not in err and "redis://" in err and ":***@" in err, err
    # A scheme in capitals is a URL too; credentials without a scheme are not an address (both were
    # taken as HOST:PORT with the password in the host, and echoed).
    assert main(["cache", "info", "--redis", f"REDIS://:{pw}@{srv.host}:{srv.port}"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"redis {srv.host}:{srv.port}: used ") and pw not in out + err
    for bad in (f"user:{pw}@{srv.host}:{srv.port}", f"http://:{pw}@{srv.host}:{srv.port}"):
        assert main(["cache", "info", "--redis", bad]) == 1
        out, err = capsys.readouterr()
        assert out == "" and pw not in err and ":***@" in err, err
    loader.close()


def test_cache_info_counts_the_reader_slots_in_use_not_ever_used(tmp_path, capsys):
    # LMDB's num_readers is a high-water mark: `cache info` said "2/126 reader slots in use" after
    # every reader had exited (LMDB's own reader list was empty), misleading whoever chases a
    # "readers full" error.
    import subprocess
    import sys

    script = (
        "from trainloom.data.cache import CacheLoader\n"
        f"c = CacheLoader(path={str(tmp_path)!r}, dataset_name='ds', flush_interval=None)\n"
        "[c.get(i, lambda k: k) for i in range(3)]\n"
        "c.flush()\n"
        "assert c.contains_many(range(3)) == [True] * 3\n"
        "c.close()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)  # a reader that has exited
    assert main(["cache", "info", "--path", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.search(
        r", 0/\d+ reader slots in use \([1-9]\d* used since the environment was created\)$", first
    ), first


def test_cache_clear_all_of_a_cache_without_namespaces_says_so(tmp_path, capsys):
    import lmdb

    lmdb.open(str(tmp_path), max_dbs=1).close()  # an environment with no trainloom namespace
    assert main(["cache", "clear", "--path", str(tmp_path), "--all"]) == 0
    assert capsys.readouterr().out == f"nothing to clear in {tmp_path}: it holds no namespaces\n"
