"""Inspect or clear trainloom caches.

trainloom cache info                       # the default LMDB cache: size, readers, namespaces
trainloom cache info --path DIR            # another LMDB cache directory
trainloom cache info --redis HOST:PORT --password PW --namespace NAME
trainloom cache clear --namespace NAME     # drop one dataset's entries (others are kept)
trainloom cache clear --all                # drop every namespace of the LMDB cache

``--path`` and ``--redis``, and ``--namespace`` and ``--all``, exclude each other (a usage error,
exit 2). LMDB caches are opened with the map size their writers committed, which is also the map
size ``info`` shows (opening with a larger one would commit it at the next write, past the
``max_map_size`` of the cache's stores). Redis addresses are echoed as HOST:PORT, never with the
password of a URL.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainloom.data.cache import cached_values
from trainloom.data.stores.base import StoreError
from trainloom.data.stores.lmdb_store import LmdbStore, _committed_map_size, default_cache_dir

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``info`` and ``clear`` to the ``trainloom cache`` parser."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="cache_command", metavar="{info,clear}")
    for name, help_text in (("info", "show caches and their sizes"), ("clear", "delete cached entries")):
        p = sub.add_parser(name, help=help_text)
        where = p.add_mutually_exclusive_group()
        where.add_argument(
            "--path",
            type=Path,
            default=None,
            help="LMDB cache directory, or the cache directory holding it in lmdb/ "
            "(default: $TRAINLOOM_CACHE_DIR/lmdb, else $XDG_CACHE_HOME/trainloom/lmdb, else "
            "~/.cache/trainloom/lmdb)",
        )
        which = p.add_mutually_exclusive_group() if name == "clear" else p
        which.add_argument("--namespace", default=None, help="the dataset_name of the cache")
        where.add_argument(
            "--redis",
            default=None,
            metavar="HOST:PORT",
            help="a Redis server instead of LMDB (also [IPv6]:PORT or redis://[[USER]:PASSWORD@]HOST:PORT[/DB])",
        )
        p.add_argument(
            "--password", default=None, help="the Redis server's password (default: $REDISCLI_AUTH)"
        )
        if name == "clear":
            which.add_argument("--all", action="store_true", help="every namespace of the LMDB cache")
    parser.set_defaults(cache_command=None)


def _human(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _lmdb_store(path: Path, namespace: Optional[str], readonly: bool) -> LmdbStore:
    """A store on the existing cache at ``path`` with the map size its writers committed: LMDB maps
    the ``map_size`` it is given (at least the pages in use) and the next commit persists it, so the
    default 1 GiB made ``info`` show 1 GiB and ``clear`` commit it, past the cache's max_map_size.
    A clear at that size may take a few pages past it (LmdbStore.clear)."""
    size = _committed_map_size(path)
    if size is None:  # no environment there (the store's own error says so), or not readable
        return LmdbStore(path, namespace=namespace, readonly=readonly)
    return LmdbStore(path, namespace=namespace, map_size=size, max_map_size=size, readonly=readonly)


def _lmdb_namespaces(path: Path) -> List[str]:
    with _lmdb_store(path, None, readonly=True) as store:
        return store.namespaces()


def _lmdb_path(args: argparse.Namespace) -> Path:
    """--path, or the default LMDB directory; a cache directory ($TRAINLOOM_CACHE_DIR) holding the
    LMDB directory ``lmdb/`` is accepted for it."""
    if args.path is None:
        return default_cache_dir() / "lmdb"
    path: Path = args.path
    if not (path / "data.mdb").exists() and (path / "lmdb" / "data.mdb").exists():
        return path / "lmdb"
    return path


def _redacted(spec: str) -> str:
    """``spec`` with the password of a URL shown as ``***`` (for messages: it must not reach logs)."""
    scheme, sep, rest = spec.partition("://")
    prefix = f"{scheme}://" if sep else ""
    rest = rest if sep else spec
    if "@" not in rest:
        return spec
    userinfo, _, hostpart = rest.rpartition("@")  # the host part holds no '@'; a password may
    user, colon, _ = userinfo.partition(":")
    return f"{prefix}{user}:***@{hostpart}" if colon else f"{prefix}***@{hostpart}"


def _redis_address(spec: str) -> Dict[str, Any]:
    """host, port and, from a URL, password, username and db of HOST:PORT, [IPv6]:PORT or
    redis://[[USER]:PASSWORD@]HOST:PORT[/DB]. Error messages show the URL without its password."""
    scheme = spec.partition("://")[0].lower() if "://" in spec else ""
    if scheme == "rediss":
        # Connecting without TLS would send the password in clear to a server that expects TLS.
        raise ValueError(f"--redis: TLS (rediss://) is not supported, got {_redacted(spec)!r}")
    if scheme == "redis":  # (any case, as URL schemes)
        url = urllib.parse.urlsplit(spec)
        try:
            port = url.port
        except ValueError:
            port = None
        db_s = url.path.strip("/")
        if not url.hostname or port is None or not (db_s == "" or db_s.isdigit()) or url.query:
            raise ValueError(
                "--redis must be HOST:PORT or redis://[[USER]:PASSWORD@]HOST:PORT[/DB], "
                f"got {_redacted(spec)!r}"
            )
        return {
            "host": url.hostname,
            "port": port,
            "password": urllib.parse.unquote(url.password) if url.password else None,
            "username": urllib.parse.unquote(url.username) if url.username else None,
            "db": int(db_s or 0),
        }
    host, _, port_s = spec.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # [::1]:6379
    if not host or not port_s.isdigit() or scheme or "@" in host:  # (another scheme, or credentials)
        raise ValueError(
            "--redis must be HOST:PORT ([ADDR]:PORT for IPv6, or redis://[[USER]:PASSWORD@]HOST:PORT[/DB]), "
            f"got {_redacted(spec)!r}"
        )
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"--redis: port {port} is outside 1..65535")
    return {"host": host, "port": port, "password": None, "username": None, "db": 0}


def _redis_store(args: argparse.Namespace, namespace: Optional[str] = None) -> Any:
    from trainloom.data.stores.redis_store import RedisNodeStore

    addr = _redis_address(args.redis)
    # A password on the command line shows in `ps`: REDISCLI_AUTH (redis-cli's variable) or the URL too.
    password = args.password or addr["password"] or os.environ.get("REDISCLI_AUTH") or None
    return RedisNodeStore(
        addr["host"],
        addr["port"],
        password,
        namespace=(args.namespace or "") if namespace is None else namespace,
        username=addr["username"],
        db=addr["db"],
    )


def _info(args: argparse.Namespace) -> int:
    if args.redis:
        store = _redis_store(args)
        info: Dict[str, Any] = store.info()
        print(
            f"redis {info['host']}: used {_human(info['used_memory'])} of maxmemory "
            f"{_human(info['maxmemory']) if info['maxmemory'] else 'unlimited'} "
            f"(policy {info['maxmemory_policy']})"
        )
        names = store.namespaces()
        if args.namespace is not None and args.namespace not in names:
            print(
                f"namespace {args.namespace!r} not found on redis {info['host']} (have: {list(names)})",
                file=sys.stderr,
            )
            store.close()
            return 1
        for ns in [args.namespace] if args.namespace is not None else names:
            ns_store = store if ns == store.namespace else _redis_store(args, ns)
            print(f"  namespace {ns!r}: {cached_values(ns_store)} entries")
            if ns_store is not store:
                ns_store.close()
        store.close()
        return 0
    path = _lmdb_path(args)
    if not (path / "data.mdb").exists():
        print(f"no LMDB cache at {path}", file=sys.stderr)
        return 1
    names = _lmdb_namespaces(path)
    if args.namespace is not None:
        if args.namespace not in names:
            print(f"namespace {args.namespace!r} not found in {path} (have: {names})", file=sys.stderr)
            return 1
        names = [args.namespace]
    first = True
    for ns in names:
        with _lmdb_store(path, ns, readonly=True) as store:
            i = store.info()
            i["entries"] = cached_values(store)
        if first:
            print(
                f"LMDB cache {path}: {_human(i['used_bytes'])} used, map {_human(i['map_size'])}, "
                f"{i['active_readers']}/{i['max_readers']} reader slots in use "
                f"({i['readers']} used since the environment was created)"
            )
            first = False
        print(f"  namespace {ns!r}: {i['entries']} entries")
    if first:
        print(f"LMDB cache {path}: empty (no namespaces)")
    return 0


def _clear(args: argparse.Namespace) -> int:
    if args.redis:
        if args.namespace is None:
            print(
                "trainloom cache clear --redis needs --namespace (only that namespace is deleted)",
                file=sys.stderr,
            )
            return 2
        store = _redis_store(args)
        try:
            names = store.namespaces()
            if args.namespace not in names:
                # As for LMDB: a mistyped name must not read as a successful (empty) clear.
                print(
                    f"namespace {args.namespace!r} not found on redis {store.host}:{store.port} "
                    f"(have: {list(names)})",
                    file=sys.stderr,
                )
                return 1
            n = cached_values(store)
            store.clear()
        finally:
            store.close()
        # HOST:PORT, as in the other messages: a URL's password must not be printed.
        print(f"cleared {n} entries of namespace {args.namespace!r} on {store.host}:{store.port}")
        return 0
    if args.namespace is None and not args.all:
        print("trainloom cache clear: name a --namespace, or pass --all", file=sys.stderr)
        return 2
    path = _lmdb_path(args)
    if not (path / "data.mdb").exists():
        print(f"no LMDB cache at {path}", file=sys.stderr)
        return 1
    names = _lmdb_namespaces(path)
    targets = names if args.all else [args.namespace]
    if not targets:  # --all on a cache without namespaces (it printed nothing)
        print(f"nothing to clear in {path}: it holds no namespaces")
        return 0
    for ns in targets:
        if ns not in names:
            print(f"namespace {ns!r} not found in {path} (have: {names})", file=sys.stderr)
            return 1
        with _lmdb_store(path, ns, readonly=False) as store:
            n = cached_values(store)
            store.clear()
        print(f"cleared {n} entries of namespace {ns!r} in {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``trainloom cache info|clear``; returns the exit code."""
    try:
        if args.cache_command == "info":
            return _info(args)
        if args.cache_command == "clear":
            return _clear(args)
    except (StoreError, ValueError) as exc:
        print(f"trainloom cache {args.cache_command}: {exc}", file=sys.stderr)
        return 1
    print(
        "usage: trainloom cache {info,clear} [--path DIR] [--namespace NAME] [--redis HOST:PORT]",
        file=sys.stderr,
    )
    return 2
