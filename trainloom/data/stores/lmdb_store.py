"""``LmdbStore``: the embedded default store (one LMDB environment, one named database per namespace).

No server: every process of a node maps the same file. Reads are zero-copy views of the memory map
handed to a callback inside the read transaction; writes are one transaction per batch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import (
    AbstractSet,
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

from trainloom._numbers import is_integral
from trainloom.data.codec import _codec
from trainloom.data.stores.base import (
    Key,
    Store,
    StoreError,
    StoreFullError,
    StoreValueRefusedError,
    Value,
    check_mapping,
    check_namespace,
    key_bytes,
    value_bytes,
)
from trainloom.errors import ConfigError

__all__ = ["LmdbStore", "default_cache_dir", "CACHE_DIR_ENV"]

log = logging.getLogger("trainloom.data")
T = TypeVar("T")

#: Environment variable naming the directory for caches created without an explicit path.
CACHE_DIR_ENV = "TRAINLOOM_CACHE_DIR"
_DB_PREFIX = b"tl:"
_GIB = 1 << 30
#: A failed write with less free space than this on the cache's filesystem is a full disk.
_DISK_FULL_BYTES = 64 << 20
#: A map at max_map_size with less room than this (or a sixteenth of the cap, if smaller) is full:
#: a value that does not fit then is StoreFullError (the store takes no more), not a refused value.
_FULL_ROOM = 1 << 20
#: LMDB's MDB_MAXKEYSIZE as py-lmdb builds it (the store reads the real value when it opens).
_DEFAULT_MAX_KEY = 511
#: Pages a freeing transaction (clear, delete, a fingerprint reset) may take beyond max_map_size, on
#: top of its free list: the copied pages of the main and free-list trees and a small put.
_FREEING_PAGES = 64
#: Keys deleted per write transaction by LmdbStore.delete: each copies at most its keys' paths, so
#: that a delete at max_map_size takes a bounded number of pages past it.
_DELETE_CHUNK = 32
#: Key of the empty write (main database, put and deleted at once) that makes pages freed by the last
#: commit reusable; not a namespace (those start with _DB_PREFIX).
_ADVANCE_KEY = b"trainloom:advance"


def default_cache_dir() -> Path:
    """``$TRAINLOOM_CACHE_DIR``, else ``$XDG_CACHE_HOME/trainloom``, else ``~/.cache/trainloom``."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "trainloom"


def _names(keys: Sequence[bytes], shown: int = 3) -> str:
    """The first ``shown`` of ``keys`` for a message (each cut to 60 characters), and how many more."""
    names = [repr(k.decode("utf-8", "replace")) for k in keys[:shown]]
    out = ", ".join(r if len(r) <= 60 else r[:57] + "..." for r in names)
    return out + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


def _import_lmdb() -> Any:
    try:
        import lmdb
    except ImportError as exc:  # pragma: no cover - lmdb is a core dependency
        raise ImportError(
            "LmdbStore needs the 'lmdb' package, a dependency of trainloom: pip install lmdb"
        ) from exc
    return lmdb


def _committed_map_size(path: Union[str, os.PathLike]) -> Optional[int]:
    """The map size last committed to the LMDB environment at ``path``; None when there is none.

    Opening an environment maps the ``map_size`` it is given (at least the pages in use), whatever
    size was committed, and the next commit persists it; given 0, LMDB maps the committed size.
    ``trainloom cache`` opens with this size so that it leaves the map as the cache's writers made it.
    (A brief read-only open without the lock file; a path this process holds open: that map's size.)"""
    if not (Path(path) / "data.mdb").is_file():
        return None
    with _ENVS_LOCK:  # held open by this process (py-lmdb opens a path once per process): its map
        entry = _ENVS.get(os.path.realpath(path))
        if entry is not None and entry[1] == os.getpid():
            return int(entry[0].info()["map_size"])
    lmdb = _import_lmdb()
    try:
        env = lmdb.open(os.fspath(path), map_size=0, subdir=True, readonly=True, lock=False)
    except lmdb.Error:
        return None
    try:
        return int(env.info()["map_size"]) or None
    finally:
        env.close()


# One environment per path per process: py-lmdb refuses to open a path twice in one process, and
# several stores (namespaces) commonly share the default path. path -> [env, pid, users, readonly].
_ENVS: Dict[str, List[Any]] = {}
_ENVS_LOCK = threading.Lock()
# (path, pid) of stores garbage-collected without close(). Their weakref.finalize callback only
# queues the release (it may run at any allocation, e.g. inside _acquire_env holding _ENVS_LOCK, or
# inside another store's transaction); _acquire_env and _release_env apply it under the lock.
_COLLECTED: deque[Tuple[str, int]] = deque()


def _collected(key: str, pid: int) -> None:
    """weakref.finalize callback of an open LmdbStore: queue the release of its environment."""
    _COLLECTED.append((key, pid))


def _release_collected() -> None:
    """Release the environments of collected stores (caller holds _ENVS_LOCK). The count keeps an
    environment open while any other store of this process uses it."""
    pid = os.getpid()
    while _COLLECTED:
        key, owner = _COLLECTED.popleft()
        if owner == pid:  # (else opened before a fork, in the parent)
            _decref(key)


def _decref(key: str) -> None:
    """Drop one user of this process's environment at ``key``; close it with the last (caller holds
    _ENVS_LOCK). An entry inherited through fork() is the parent's: left alone."""
    entry = _ENVS.get(key)
    if entry is None or entry[1] != os.getpid():
        return
    entry[2] -= 1
    if entry[2] <= 0:
        del _ENVS[key]
        entry[0].close()


def _acquire_env(store: LmdbStore) -> Tuple[Any, str]:
    lmdb = _import_lmdb()
    key = os.path.realpath(store.path)
    pid = os.getpid()
    with _ENVS_LOCK:
        _release_collected()
        entry = _ENVS.get(key)
        if entry is not None and entry[1] != pid:
            # Inherited through fork(): LMDB environments must not be used across fork, and py-lmdb
            # refuses to open the path again while the inherited handle is open. Closing it in the
            # child drops only the child's mapping and descriptors (reader slots belong to pids).
            with contextlib.suppress(lmdb.Error):
                entry[0].close()
            del _ENVS[key]
            entry = None
        if entry is not None and entry[3] and not store.readonly:
            raise StoreError(
                f"LmdbStore: {store.path} is already open read-only in this process (LMDB allows one "
                "environment per path and process); close the read-only stores first",
                backend="lmdb",
            )
        if entry is None:

            def open_env(lock: bool) -> Any:
                return lmdb.open(
                    key,
                    map_size=store.map_size,
                    subdir=True,
                    readonly=store.readonly,
                    max_dbs=store.max_dbs,
                    max_readers=store.max_readers,
                    readahead=False,
                    meminit=False,
                    sync=store.sync,
                    metasync=store.sync,
                    lock=lock,
                )

            locked = True
            try:
                env = open_env(True)
            except lmdb.Error as exc:
                if not store.readonly:
                    raise StoreError(f"LmdbStore: cannot open {store.path}: {exc}", backend="lmdb") from exc
                # A pre-built cache this user may read but not write (a shared one owned by another
                # user): LMDB's lock file needs write access. Read it without (as a read-only mount
                # does): nothing may write it meanwhile, which such a directory rules out for us.
                try:
                    env = open_env(False)
                except lmdb.Error:
                    raise StoreError(f"LmdbStore: cannot open {store.path}: {exc}", backend="lmdb") from exc
                locked = False
                log.warning(
                    "LmdbStore: %s opened read-only without LMDB's lock file (%s); no process may "
                    "write this cache while it is read",
                    store.path,
                    exc,
                )
            # Reclaim reader slots of processes that died (killed DataLoader workers) at every open.
            if locked:
                store.reader_checks += env.reader_check()
            entry = _ENVS[key] = [env, pid, 0, store.readonly]
        entry[2] += 1
        return entry[0], key


def _release_env(key: str) -> None:
    with _ENVS_LOCK:
        _release_collected()
        _decref(key)


class LmdbStore(Store):
    """A key-value store in an LMDB environment; the default backend of the cache.

    Args:
        path: directory of the LMDB environment. Default: ``<cache dir>/lmdb`` where the cache dir is
            ``$TRAINLOOM_CACHE_DIR``, ``$XDG_CACHE_HOME/trainloom`` or ``~/.cache/trainloom``.
        namespace: the named database this store reads and writes; ``num_keys()`` and ``clear()``
            act on it only.
        map_size: initial size of the memory map in bytes (default 1 GiB). The map grows by doubling
            when full, and the failed batch is retried.
        max_map_size: cap of that growth (default 1 TiB); reaching it raises :class:`StoreFullError`
            (its ``written`` and ``not_written`` name the keys of the batch stored before the map
            filled up, and the others), or :class:`StoreValueRefusedError` for a value larger than the
            room left while there is room for others (the other values of its batch are written).
        max_readers: reader slots, shared by every process on the node (ranks x DataLoader workers x
            threads). Slots left by killed processes are reclaimed with ``reader_check()``.
        max_dbs: how many namespaces the environment can hold.
        (keys) LMDB keys are 1 to ``max_key_size`` (511) bytes; writing an empty or longer key raises
        :class:`~trainloom.errors.ConfigError` naming it (hash long keys).
        sync: fsync on every commit. Off by default: a cache survives a process crash either way,
            only an operating-system crash may lose (or, rarely, damage) the last writes.
        readonly: open read-only (``trainloom cache info``).

    The store pickles without its handles; each process (DataLoader workers under fork, spawn or
    forkserver) opens its own environment lazily, and an environment inherited through ``fork()``
    is closed in the child, never used.

    Example::

        >>> with LmdbStore(tmp_path / "db", namespace="ds") as store:
        ...     store.set("a", b"1")
        ...     store.mget(["a", "b"])
        [b'1', None]
    """

    backend = "lmdb"
    #: longest key LMDB accepts, in bytes (updated from ``env.max_key_size()`` when the store opens).
    max_key_size: int = _DEFAULT_MAX_KEY

    def __init__(
        self,
        path: Union[str, os.PathLike, None] = None,
        namespace: Optional[str] = "",
        map_size: int = _GIB,
        max_map_size: int = 1024 * _GIB,
        max_readers: int = 1024,
        max_dbs: int = 256,
        sync: bool = False,
        readonly: bool = False,
    ) -> None:
        _import_lmdb()
        for name, v in (("map_size", map_size), ("max_map_size", max_map_size), ("max_readers", max_readers)):
            # Any integer (numpy's too), not bool.
            if not is_integral(v) or int(v) <= 0:
                raise ValueError(f"LmdbStore: {name} must be a positive int, got {v!r}")
        if max_map_size < map_size:
            raise ValueError(
                f"LmdbStore: max_map_size ({max_map_size}) is smaller than map_size ({map_size})"
            )
        if path is not None and str(path) == "":
            # Path("") is the current directory: os.environ.get("CACHE_DIR", "") would put the cache there
            raise ValueError(
                "LmdbStore: path is empty (it would put the cache in the current directory); pass a "
                "directory, or None for the default cache directory"
            )
        self.path = Path(path) if path is not None else default_cache_dir() / "lmdb"
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(
                f"LmdbStore: path {str(self.path)!r} exists and is not a directory; an LMDB environment "
                "is a directory (data.mdb, lock.mdb): pass a directory path"
            )
        # namespace=None (read-only only): no named database, for namespaces() / inspection.
        self.namespace = None if (namespace is None and readonly) else check_namespace(namespace)
        self.map_size = int(map_size)
        self.max_map_size = int(max_map_size)
        self.max_readers = int(max_readers)
        self.max_dbs = int(max_dbs)
        self.sync = bool(sync)
        self.readonly = bool(readonly)
        self._env: Any = None
        self._db: Any = None
        self._pid = -1
        # weakref.finalize releasing the environment of a store collected without close().
        self._finalizer: Optional[weakref.finalize] = None
        self.grow_count = 0
        self.reader_checks = 0

    # -- process-local handles -------------------------------------------------------------------
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_env"] = state["_db"] = state["_finalizer"] = None
        state["_pid"] = -1
        return state

    def _handles(self) -> Any:
        if self._env is not None and self._pid == os.getpid():
            return self._env
        self._env = self._db = None
        if self._finalizer is not None:  # the parent's, inherited through fork(): not ours to release
            self._finalizer.detach()
            self._finalizer = None
        self._open()
        return self._env

    def _open(self) -> None:
        lmdb = _import_lmdb()
        if not self.readonly:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # a regular file on the path, no permission...
                raise StoreError(
                    f"LmdbStore: cannot create the directory {str(self.path)!r} for the LMDB environment: "
                    f"{type(exc).__name__}: {exc}",
                    backend="lmdb",
                ) from exc
        elif not (self.path / "data.mdb").exists():
            raise StoreError(f"LmdbStore: no LMDB environment at {self.path}", backend="lmdb")
        env, key = _acquire_env(self)
        try:
            self.max_key_size = env.max_key_size()
            if self.namespace is None:
                self._opened(env, key)
                return
            name = _DB_PREFIX + self.namespace.encode("utf-8")
            if self.readonly:
                with env.begin() as txn:
                    exists = txn.get(name) is not None
                if not exists:
                    raise StoreError(
                        f"LmdbStore: namespace {self.namespace!r} does not exist in {self.path}",
                        backend="lmdb",
                    )
                self._db = env.open_db(name, create=False)
            else:
                self._db = self._retry_grow(env, lambda: env.open_db(name, create=True))
        except lmdb.Error as exc:
            _release_env(key)
            raise StoreError(
                f"LmdbStore: cannot open namespace {self.namespace!r} in {self.path}: {exc}", backend="lmdb"
            ) from exc
        except BaseException:
            _release_env(key)
            raise
        self._opened(env, key)

    def _opened(self, env: Any, key: str) -> None:
        self._env = env
        self._pid = os.getpid()
        # A store dropped without close() releases the environment when it is collected (else a
        # read-only one kept the path from being opened for writing in this process).
        self._finalizer = weakref.finalize(self, _collected, key, self._pid)
        self._finalizer.atexit = False

    # -- error handling ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _grow_lock(self) -> Iterator[None]:
        # Resizing from two processes at once can corrupt the environment: serialise growth per node.
        with open(self.path / "trainloom-grow.lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    @staticmethod
    def _used(env: Any) -> int:
        """Bytes up to the last page in use (pages on LMDB's free list included)."""
        return int((env.info()["last_pgno"] + 1) * env.stat()["psize"])

    def _adopt_committed(self, env: Any, cap: int) -> None:
        """Map the size last committed (by another process: MDB_MAP_RESIZED), but not beyond ``cap``."""
        env.set_mapsize(0)
        if env.info()["map_size"] > cap:
            env.set_mapsize(cap)  # LMDB keeps at least the pages in use

    def _freeing_limit(self, env: Any, extra_pages: int = 0) -> int:
        """The map size a freeing transaction (clear, delete, a fingerprint reset) may grow to: past
        max_map_size (or the pages in use, if more) by its free list and the pages it copies
        (``extra_pages`` beyond _FREEING_PAGES). Committing a drop writes the list of the pages it
        frees to new pages: at the cap it could not commit."""
        psize = int(env.stat()["psize"])
        used = self._used(env)
        # The free list holds an 8-byte number per freed page, at most every page in use.
        pages = -(-8 * (used // psize + 2) // psize) + _FREEING_PAGES + extra_pages
        return max(self.max_map_size, used) + pages * psize

    def _grow(self, env: Any, limit: Optional[int] = None) -> None:
        """Grow the map after MDB_MAP_FULL, up to max_map_size (or ``limit``, see _freeing_limit);
        raises StoreFullError there."""
        with self._grow_lock():
            if limit is None:
                limit = self.max_map_size
            # set_mapsize(0) adopts a larger size another process committed (not beyond the limit:
            # a store or an old `trainloom cache clear` opened with a larger map_size committed it);
            # it also falls back to the last committed size, which is below ours when our own growth
            # was never committed.
            before = env.info()["map_size"]
            if before >= limit:
                self._adopt_committed(env, limit)
                raise StoreFullError(
                    f"LmdbStore: {self.path} is full at max_map_size={self.max_map_size} bytes "
                    f"(namespace {self.namespace!r}); pass a larger max_map_size= or clear old caches "
                    "with `trainloom cache clear`",
                    backend="lmdb",
                )
            env.set_mapsize(0)
            cur = min(max(before, env.info()["map_size"]), limit)
            new = cur if cur > before else min(max(cur * 2, cur + (64 << 20)), limit)
            env.set_mapsize(new)
            self.grow_count += 1
            log.info("LmdbStore: grew the map of %s from %d to %d bytes", self.path, before, new)

    def _advance(self, env: Any) -> None:
        """Commit a write transaction that leaves no trace (a key of the main database put and
        deleted). LMDB reuses the pages freed by a transaction only once a newer one has committed:
        after a clear at max_map_size every write failed until some other write committed."""
        with env.begin(write=True) as t:
            t.put(_ADVANCE_KEY, b"")
            t.delete(_ADVANCE_KEY)

    def _retry_grow(self, env: Any, fn: Callable[[], T], limit: Optional[int] = None) -> T:
        lmdb = _import_lmdb()
        advanced = False
        while True:
            try:
                return fn()
            except lmdb.MapFullError:
                # The failed transaction was rolled back as a whole: grow, then redo the same batch.
                try:
                    self._grow(env, limit)
                except StoreFullError as full:
                    # At the cap: pages the last commit freed (another process's clear, values
                    # overwritten by smaller ones) are reusable only after a newer commit. Commit an
                    # empty write, then retry once.
                    if advanced:
                        raise
                    advanced = True
                    try:
                        self._advance(env)
                    except lmdb.MapFullError:
                        raise full from None
            except lmdb.MapResizedError:
                self._adopt_committed(env, self.max_map_size)

    def _freeing(self, env: Any, txn: Callable[[], T], extra_pages: int = 0) -> T:
        """Run ``txn``, a write that frees pages (clear, delete, a fingerprint reset), as any write;
        when the map is full at max_map_size, run it again allowed a bounded overshoot
        (:meth:`_freeing_limit`: committing a drop writes the list of the pages it frees to new
        pages, which at the cap do not exist). Then commit an empty write, so that the next write
        reuses the freed pages, and take the map back to its size before (best effort: another
        thread of the process may be in a write transaction, which set_mapsize refuses)."""
        try:
            return self._retry_grow(env, txn)
        except StoreFullError:
            pass
        before = int(env.info()["map_size"])
        limit = self._freeing_limit(env, extra_pages)
        out = self._retry_grow(env, txn, limit)
        with contextlib.suppress(StoreFullError):  # (a write that finds no room commits one itself)
            self._retry_grow(env, lambda: self._advance(env), limit)
        target = max(before, self.max_map_size)
        if env.info()["map_size"] > target:
            with self._grow_lock():
                try:
                    env.set_mapsize(target)  # LMDB keeps at least the pages in use
                except _import_lmdb().Error as exc:
                    log.debug(
                        "LmdbStore: could not take the map of %s back to %d bytes: %s", self.path, target, exc
                    )
        return out

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreError(f"LmdbStore: {self.path} was opened read-only", backend="lmdb")

    def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        """Run fn(env) with the recoveries LMDB needs: reader slots, map resized by another process."""
        lmdb = _import_lmdb()
        env = self._handles()
        for attempt in range(3):
            try:
                return fn(env)
            except lmdb.ReadersFullError as exc:
                self.reader_checks += env.reader_check()
                if attempt == 2:
                    raise StoreError(
                        f"LmdbStore.{what}: all {self.max_readers} reader slots of {self.path} are in use "
                        "by live processes; pass a larger max_readers=",
                        backend="lmdb",
                    ) from exc
            except lmdb.MapResizedError:
                self._adopt_committed(env, self.max_map_size)
            except lmdb.Error as exc:
                full = self._disk_full(exc)
                if full is not None:
                    raise StoreFullError(
                        f"LmdbStore.{what} on {self.path} (namespace {self.namespace!r}): the disk is full "
                        f"({full} bytes free; LMDB reports it as {exc}). Free space, clear old caches with "
                        "`trainloom cache clear`, or pass path= on a larger disk",
                        backend="lmdb",
                    ) from exc
                raise StoreError(
                    f"LmdbStore.{what} on {self.path} (namespace {self.namespace!r}): {exc}", backend="lmdb"
                ) from exc
        raise StoreError(f"LmdbStore.{what}: map resized repeatedly by other processes", backend="lmdb")

    def _disk_full(self, exc: Exception) -> Optional[int]:
        """The free bytes of the cache's filesystem when ``exc`` is a failed write on a (nearly) full
        disk, else None. LMDB turns a short write (ENOSPC) into EIO at commit."""
        text = str(exc)
        if "Input/output error" not in text and "No space left" not in text:
            return None
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            return None
        return free if free < _DISK_FULL_BYTES else None

    # -- keys ---------------------------------------------------------------------------------------
    def _bad_key(self, k: bytes, key: Any) -> ConfigError:
        r = repr(key)
        r = r if len(r) <= 80 else r[:77] + "..."
        if not k:
            return ConfigError(f"LmdbStore (namespace {self.namespace!r}): LMDB keys cannot be empty")
        return ConfigError(
            f"LmdbStore (namespace {self.namespace!r}): the key {r} is {len(k)} bytes; LMDB keys are "
            f"limited to {self.max_key_size} bytes. Hash long keys, e.g. hashlib.sha1(key).hexdigest()"
        )

    def _write_key(self, key: Key) -> bytes:
        k = key_bytes(key)
        if not 0 < len(k) <= self.max_key_size:
            raise self._bad_key(k, key)
        return k

    def _check_read_keys(self, kb: List[bytes], keys: Sequence[Key]) -> None:
        """After MDB_BAD_VALSIZE on a read: the error naming the bad key (an empty one: a key too long
        to exist reads as missing)."""
        for k, key in zip(kb, keys):
            if not 0 < len(k) <= self.max_key_size:
                raise self._bad_key(k, key)

    # -- the Store API ----------------------------------------------------------------------------
    def mget_apply(self, keys: Sequence[Key], fn: Callable[[Any], T]) -> List[Optional[T]]:
        kb = [k if type(k) is bytes else key_bytes(k) for k in keys]

        def run(env: Any) -> List[Optional[T]]:
            # buffers=True: values are views of the map, valid only inside this transaction; fn copies.
            with env.begin(db=self._db, buffers=True) as txn:
                get = txn.get
                out: List[Optional[T]] = []
                for k in kb:
                    v = get(k)
                    out.append(None if v is None else fn(v))
                return out

        return self._read_call(run, kb, keys)

    def mget_decode(self, keys: Sequence[Key], missing: Any = None) -> Tuple[List[Any], int]:
        kb = [k if type(k) is bytes else key_bytes(k) for k in keys]

        def run(env: Any) -> Tuple[List[Any], int]:
            # One C loop inside the read transaction: each map buffer is decoded (copied) before the
            # next get, and no buffer outlives the transaction.
            with env.begin(db=self._db, buffers=True) as txn:
                return _codec.decode_many_get(txn.get, kb, missing)

        return self._read_call(run, kb, keys)

    def _read_call(self, run: Callable[[Any], T], kb: List[bytes], keys: Sequence[Key]) -> T:
        try:
            return self._call("mget", run)
        except StoreError as exc:
            if isinstance(exc.__cause__, _import_lmdb().BadValsizeError):
                self._check_read_keys(kb, keys)
            raise

    def mset(self, dictionary: Mapping[Key, Value]) -> None:
        self._check_writable()
        check_mapping(dictionary, "LmdbStore")
        wk = self._write_key
        items = [(wk(k), value_bytes(k, v)) for k, v in dictionary.items()]
        if not items:
            return
        # batches committed (a batch at the cap is written value by value); read only on failure
        committed: List[List[Tuple[bytes, Any]]] = []

        def put(env: Any, batch: List[Tuple[bytes, Any]]) -> None:
            def txn() -> None:
                with env.begin(write=True, db=self._db) as t:
                    t.cursor().putmulti(batch, dupdata=False, overwrite=True)

            self._retry_grow(env, txn)
            committed.append(batch)

        def write(env: Any) -> None:
            try:
                put(env, items)
            except StoreFullError as exc:  # the map is at max_map_size (raised by _grow only)
                self._write_one_by_one(env, items, put, exc)

        try:
            self._call("mset", write)
        except StoreFullError as exc:
            written = {k for batch in committed for k, _ in batch}
            raise self._batch_full(exc, items, written).with_traceback(exc.__traceback__) from exc.__cause__

    def _batch_full(
        self, exc: StoreFullError, items: List[Tuple[bytes, Any]], written: AbstractSet[bytes]
    ) -> StoreFullError:
        """``exc`` (the map at max_map_size, or the disk full), raised by an mset of ``items``, naming
        the keys stored before it (``written``: a batch at the cap is written value by value) and the
        others, so that the caller knows what the store holds."""
        keys = list(dict.fromkeys(k for k, _ in items))
        done = [k for k in keys if k in written]
        rest = [k for k in keys if k not in written]
        message = exc.message
        if len(keys) > 1 and done:
            message += (
                f". Of the {len(keys)} values of this mset, written: {len(done)} ({_names(done)}); "
                f"not written: {len(rest)} ({_names(rest)})"
            )
        elif len(keys) > 1:
            message += f". None of the {len(keys)} values of this mset was written"
        return StoreFullError(message, "lmdb", exc.key, written=done, not_written=rest)

    def _write_one_by_one(
        self,
        env: Any,
        items: List[Tuple[bytes, Any]],
        put: Callable[[Any, List[Tuple[bytes, Any]]], None],
        full: StoreFullError,
    ) -> None:
        """After a batch failed at ``max_map_size``: write its values one transaction each, so that one
        value too large for the room left does not keep the others out. Raises StoreValueRefusedError
        (naming the first such key and its size; ``keys``: every refused key, ``others_written``: the
        rest of the batch is stored) when only such values failed, StoreFullError when the map has no
        room left for ordinary values (:meth:`mset` names the keys written before it)."""
        refused: List[Tuple[bytes, int, int]] = []  # (key, bytes, room left when it failed)
        for item in items:
            if len(items) > 1:  # (a batch of one value has just failed alone)
                try:
                    put(env, [item])
                    continue
                except StoreFullError:
                    pass
            room = self._room(env)
            if room < self._full_room():
                raise full
            refused.append((item[0], len(item[1]), room))
        if refused:
            k, size, room = refused[0]
            others = f" ({len(refused) - 1} other value(s) of the batch too)" if len(refused) > 1 else ""
            # Every other value of the batch was written (a value that failed alone with the map
            # full raised StoreFullError above): the caller drops exactly these keys and writes
            # nothing again (a rewrite needs fresh pages, which the map at its cap may not have).
            raise StoreValueRefusedError(
                f"LmdbStore.mset on {self.path} (namespace {self.namespace!r}): the value of key "
                f"{k.decode('utf-8', 'replace')!r} ({size} bytes) does not fit in the {room} bytes left at "
                f"max_map_size={self.max_map_size} bytes{others}, so it is not stored"
                + ("; the other values of the batch were written" if len(items) > 1 else "")
                + ". Pass a larger max_map_size= to store values this large",
                backend="lmdb",
                key=k.decode("utf-8", "replace"),
                keys=[r[0] for r in refused],
                others_written=True,
            )

    def _full_room(self) -> int:
        """Room left at max_map_size below which the map counts as full (StoreFullError) rather than
        refusing only values that are too large (StoreValueRefusedError)."""
        return min(_FULL_ROOM, self.max_map_size // 16)

    def _room(self, env: Any) -> int:
        """Bytes of a map of max_map_size past the last page in use (pages on LMDB's free list are not
        counted). (Not env.info()'s map_size: _grow's set_mapsize(0) falls back to the committed size.)"""
        return max(0, self.max_map_size - self._used(env))

    def delete(self, keys: Sequence[Key]) -> None:
        """Delete ``keys`` from this namespace (missing keys are ignored), in one write transaction.
        On a store full at ``max_map_size`` it works too, in transactions of 32 keys that may take a
        few pages past the cap (a failure there leaves the earlier ones deleted), like :meth:`clear`."""
        self._check_writable()
        kb = [self._write_key(k) for k in keys]
        if not kb:
            return

        def txn(env: Any, chunks: int) -> None:
            for i in range(0, len(kb), chunks):
                with env.begin(write=True, db=self._db) as t:
                    for k in kb[i : i + chunks]:
                        t.delete(k)

        def run(env: Any) -> None:
            try:
                self._retry_grow(env, functools.partial(txn, env, len(kb)))
                return
            except StoreFullError:
                pass
            with env.begin(db=self._db) as t:
                depth = int(t.stat(self._db)["depth"])
            # Each key deleted copies at most the pages of its path (depth); deleting a key twice
            # (a chunk redone after the map grew) is harmless.
            self._freeing(env, functools.partial(txn, env, _DELETE_CHUNK), _DELETE_CHUNK * max(depth, 1))

        self._call("delete", run)

    def num_keys(self) -> int:
        def run(env: Any) -> int:
            with env.begin(db=self._db) as t:
                return t.stat(self._db)["entries"]

        return self._call("num_keys", run)

    def clear(self) -> None:
        """Delete every entry of this namespace. Works on a store full at ``max_map_size``: the
        commit of the freed pages' list may take a few pages past it (the map is set back to the cap
        afterwards), and the freed pages are reusable by the next write."""
        self._check_writable()

        def run(env: Any) -> None:
            def txn() -> None:
                with env.begin(write=True) as t:
                    t.drop(self._db, delete=False)

            self._freeing(env, txn)

        self._call("clear", run)

    def reset_if_changed(self, key: Key, value: bytes) -> bool:
        """Atomically (one write transaction): when ``key`` holds another value than ``value``, clear
        the namespace and set ``key`` to ``value``; when it holds none, only set it. Used for the
        cache fingerprint.

        Like :meth:`clear`, it works on a store full at ``max_map_size``.

        Returns:
            True when entries were dropped.
        """
        self._check_writable()
        kb = self._write_key(key)

        def run(env: Any) -> bool:
            def txn() -> bool:
                with env.begin(write=True, db=self._db) as t:
                    cur = t.get(kb)
                    if cur is not None and bytes(cur) == value:
                        return False
                    dropped = cur is not None and t.stat(self._db)["entries"] > 0
                    if dropped:
                        t.drop(self._db, delete=False)
                    t.put(kb, value)
                    return dropped

            return self._freeing(env, txn)

        return self._call("reset_if_changed", run)

    def status(self) -> bool:
        try:
            self._call("status", lambda env: env.stat())
        except StoreError:
            return False
        return True

    def close(self) -> None:
        fin, self._finalizer = self._finalizer, None
        env, self._env, self._db = self._env, None, None
        # detach(): None when the collector's callback already queued the release (or it was detached).
        released = fin.detach() if fin is not None else None
        if env is not None and released is not None and self._pid == os.getpid():
            _release_env(released[2][0])
        self._pid = -1

    # -- inspection (trainloom cache info) --------------------------------------------------------
    def namespaces(self) -> List[str]:
        """Every namespace held by this environment."""

        def run(env: Any) -> List[str]:
            out = []
            with env.begin() as t:
                for k in t.cursor().iternext(values=False):
                    if k.startswith(_DB_PREFIX):
                        out.append(k[len(_DB_PREFIX) :].decode("utf-8", "replace"))
            return out

        return self._call("namespaces", run)

    def info(self) -> Dict[str, Any]:
        """Path, map size, bytes used, reader slots and this namespace's entry count.

        ``readers`` is LMDB's count of reader slots ever used in the environment's lock file (its
        high-water mark, not what is in use: it stays after every reader exited); ``active_readers``
        counts the slots held by live readers now."""

        def run(env: Any) -> Dict[str, Any]:
            i, s = env.info(), env.stat()
            used = (i["last_pgno"] + 1) * s["psize"]
            table = env.readers()  # "(no active readers)", or a header line and one line per reader
            active = 0 if "no active readers" in table else max(0, len(table.strip().splitlines()) - 1)
            return {
                "path": str(self.path),
                "namespace": self.namespace,
                "map_size": i["map_size"],
                "used_bytes": used,
                "readers": i["num_readers"],
                "active_readers": active,
                "max_readers": i["max_readers"],
                "entries": self.num_keys(),
            }

        return self._call("info", run)

    def __repr__(self) -> str:
        return f"LmdbStore(path={str(self.path)!r}, namespace={self.namespace!r})"
