"""Shared-memory collective engine for CPU tensors of ranks on one node.

A thin Python layer over the compiled core ``trainloom.comm._shm``: it runs the rendezvous through
a ``torch.distributed`` store, validates tensors and arguments, maps dtypes and reduce ops to the
core's codes and turns the core's status codes into exceptions. The engine does not read the
environment and knows nothing of Bagua's API; ``trainloom.comm`` builds the public API on top.

Example::

    store = torch.distributed.TCPStore("127.0.0.1", port, world_size, rank == 0)
    comm = ShmCommunicator(store, rank, world_size, prefix="tl/shm/group0", timeout=30.0)
    t = torch.full((4,), float(rank + 1))
    comm.allreduce(t, t, op=ReduceOp.SUM)      # t == 1 + 2 + ... + world_size everywhere
    comm.close()

See docs/shm.md for the design, the failure behaviour and the benchmark.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from trainloom._build_check import import_compiled
from trainloom.comm.env import STORE_GONE_HINT, as_int
from trainloom.comm.ops import OP_NAMES, ReduceOp
from trainloom.errors import CommError, CommTimeoutError, ConfigError

_shm = import_compiled("trainloom.comm._shm")

__all__ = ["ShmCommunicator", "ReduceOp", "node_identity", "shm_supported"]

log = logging.getLogger("trainloom.comm")


_OP_NAMES = OP_NAMES

# kernel dtype codes of _shm_kernels.h
_K_F16, _K_BF16, _K_F32, _K_F64, _K_I8, _K_U8, _K_I16, _K_I32, _K_I64, _K_BOOL = range(10)

# dtype -> (code carried in descriptors, kernel dtype, kernel element size, kernel elements per element)
_DTYPES: Dict[torch.dtype, Tuple[int, int, int, int]] = {
    torch.float16: (0, _K_F16, 2, 1),
    torch.bfloat16: (1, _K_BF16, 2, 1),
    torch.float32: (2, _K_F32, 4, 1),
    torch.float64: (3, _K_F64, 8, 1),
    torch.int8: (4, _K_I8, 1, 1),
    torch.uint8: (5, _K_U8, 1, 1),
    torch.int16: (6, _K_I16, 2, 1),
    torch.int32: (7, _K_I32, 4, 1),
    torch.int64: (8, _K_I64, 8, 1),
    torch.bool: (9, _K_BOOL, 1, 1),
    # complex reduces as pairs of reals (SUM and AVG only)
    torch.complex64: (10, _K_F32, 4, 2),
    torch.complex128: (11, _K_F64, 8, 2),
}
_DTYPE_BY_CODE = {v[0]: k for k, v in _DTYPES.items()}
_FLOAT = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_COMPLEX = {torch.complex64, torch.complex128}
# the dtypes the fast path of ShmCommunicator._tensor accepts (complex ones take the slow path)
_REAL_DTYPES = {k: v for k, v in _DTYPES.items() if k not in _COMPLEX}

_OPKIND_NAMES = {
    _shm.OP_ALLREDUCE: "allreduce",
    _shm.OP_REDUCE: "reduce",
    _shm.OP_BROADCAST: "broadcast",
    _shm.OP_ALLGATHER: "allgather",
    _shm.OP_GATHER: "gather",
    _shm.OP_SCATTER: "scatter",
    _shm.OP_REDUCE_SCATTER: "reduce_scatter",
    _shm.OP_ALLTOALL: "alltoall",
    _shm.OP_ALLTOALL_V: "alltoall_v",
    _shm.OP_BARRIER: "barrier",
    _shm.OP_SEND: "send/recv",
}

_ABORT_REASONS = {
    _shm.ABORT_USER: "abort() was called",
    _shm.ABORT_TIMEOUT: "an operation timed out there",
    _shm.ABORT_DEAD: "it found a peer dead or closed",
    _shm.ABORT_INTERRUPTED: "a signal handler (Ctrl-C) interrupted an operation there",
    _shm.ABORT_CMA: "reading a peer's memory with process_vm_readv failed there",
    _shm.ABORT_BUSY: (
        "a call started there while another call ran on another thread (one collective at a time, "
        "and one send to or receive from each peer at a time)"
    ),
}

#: default bytes per slot (two per rank): about the size of a private L2, where two-shot
#: chunks stay cache-resident between the reduce and the gather phase (FINDINGS: ~1 MiB).
DEFAULT_SLOT_BYTES = 1 << 20
#: messages up to this size use the one-shot allreduce (one barrier, every rank reduces all).
DEFAULT_SMALL_BYTES = 32 << 10
#: total budget for the per-pair send/recv buffers of one communicator
_PAIR_BUDGET = 8 << 20
#: smallest per-peer message (bytes) that allgather/gather/alltoall/alltoall_v move by cross-memory
#: attach (process_vm_readv straight from the peer's buffer) instead of through the slots, when it
#: is enabled: below it the syscall and page pinning cost more than the two in-cache copies.
DEFAULT_CMA_BYTES = 256 << 10
#: environment variable read when ``cma=None``: "1", "true", "yes" or "on" (any case) turn cross-memory
#: attach on; unset, empty, "0", "false", "no" or "off" leave it off (default); anything else is off
#: with one warning
CMA_ENV = "TRAINLOOM_SHM_CMA"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"", "0", "false", "no", "off"})
_cma_env_warned = False
#: fallback for the size of the last-level cache shared by the ranks (bytes)
_DEFAULT_LLC_BYTES = 32 << 20


def _llc_bytes() -> int:
    """Size of the largest CPU cache (the L3 the ranks share), from sysfs; 32 MiB if unknown.

    An allgather/alltoall whose recv buffers (summed over ranks) reach it is memory-bound: it
    takes the slot path with streaming stores into recv instead of cross-memory attach.
    """
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        names = os.listdir(base)
    except OSError:
        return _DEFAULT_LLC_BYTES
    for name in names:
        try:
            with open(f"{base}/{name}/size") as f:
                txt = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:].upper(), 1)
        digits = txt[:-1] if mult != 1 else txt
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or _DEFAULT_LLC_BYTES


# (op, dtype) -> op code for every supported combination; looked up on each reduction call
_VALID_OPS: Dict[Tuple[int, torch.dtype], int] = {}
for _dt in _DTYPES:
    for _op in _OP_NAMES:
        if _dt in _COMPLEX and _op not in (ReduceOp.SUM, ReduceOp.AVG):
            continue
        if _dt in _FLOAT and _op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            continue
        if _dt == torch.bool and _op == ReduceOp.AVG:
            continue
        _VALID_OPS[(_op, _dt)] = _op
del _dt, _op
# the same keyed by (op, descriptor dtype code): allreduce has the code already, not the dtype
_VALID_OPS_BY_CODE: Dict[Tuple[int, int], int] = {(o, _DTYPES[dt][0]): c for (o, dt), c in _VALID_OPS.items()}


def node_identity() -> str:
    """``"hostname:boot_id"`` of this machine; ranks with equal identities share /dev/shm.

    The boot id (``/proc/sys/kernel/random/boot_id``) tells apart two machines or containers that
    report the same hostname; LOCAL_WORLD_SIZE alone cannot tell whether a sub-group is intra-node.

    Example::

        >>> node_identity()            # doctest: +SKIP
        'worker-3:0b5b1c6e-...'
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}:{boot}"


def _yama_ptrace_scope() -> Optional[int]:
    """kernel.yama.ptrace_scope, or None without Yama (then only uid/dumpable checks apply)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def shm_supported() -> bool:
    """True if the engine can run here (Linux with a writable /dev/shm and futex). Never raises."""
    try:
        return (
            sys.platform.startswith("linux") and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        )
    except OSError:
        return False


def _cma_from_env() -> bool:
    """The ``TRAINLOOM_SHM_CMA`` setting: True/False; an unrecognised value is off, warned about once."""
    global _cma_env_warned
    raw = os.environ.get(CMA_ENV, "")
    word = raw.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word not in _FALSE_WORDS and not _cma_env_warned:
        _cma_env_warned = True
        log.warning(
            "%s=%r is not one of 1/true/yes/on or 0/false/no/off; cross-memory attach stays off",
            CMA_ENV,
            raw,
        )
    return False


def _pid_namespace() -> str:
    """This process's pid namespace ("pid:[4026531836]"), or "" if /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


#: longest pause between two polls of the store while watching the ranks that must set the keys
_POLL_MAX = 0.02
#: how often such a wait checks that those ranks are still alive (seconds)
_LIVENESS_EVERY = 0.1


class _ViewBits(Exception):
    """Internal: a tensor argument is a conjugate or negative view (see ShmCommunicator._resolved)."""


class ShmCommunicator:
    """A communicator over one shared-memory segment for ranks on one node.

    Construction is COLLECTIVE: every rank of the group calls it with the same ``prefix``. Rank 0
    creates the segment; the others map it after a rendezvous through ``store``; rank 0 unlinks it
    as soon as every rank has mapped it, so nothing is left in /dev/shm even if the job is killed.

    Args:
        store: a ``torch.distributed`` store shared by the group (TCPStore, PrefixStore, ...).
        rank: this process's rank in the group, ``0 <= rank < world_size``.
        world_size: number of ranks in the group (1 works: every op is a copy or a no-op).
        prefix: store key prefix, unique per communicator on ``store`` (e.g. ``"tl/shm/group3"``);
            a prefix that was already used on the store raises CommError (create every
            communicator under a new prefix).
        timeout: default deadline in seconds of every operation (settable attribute); a positive
            number, ``float("inf")`` for no deadline.
        pin_cpu: pin this process to CPU ``rank % ncpu`` of its allowed set (restored by close()).
        slot_bytes: bytes per slot (two per rank); a multiple of 4096. Default 1 MiB.
        heap_bytes: bytes per rank reserved for :meth:`shared_empty` (multiple of 4096; default 0).
        cma: move large allgather/gather/alltoall/alltoall_v messages by cross-memory attach (a peer
            reads them straight from this process with process_vm_readv: one copy instead of two).
            None (default): the environment variable ``TRAINLOOM_SHM_CMA`` (1/true/yes/on, any
            case: on; unset or 0/false/no/off: off; anything else: off with one warning).
            Off by default: on the 2-core VMs it was measured on it was 1.3-2x faster than the
            slots in some runs and 1.3-1.8x slower in others (page pinning under memory
            contention), see docs/shm.md. When on, every rank test-reads every peer at
            construction; if any rank cannot (or did not enable it), ALL ranks use the slot path
            and one log line says why.
        cma_bytes: smallest per-peer message (bytes) that goes by cross-memory attach (default
            256 KiB); rank 0's value is used by every rank.

    Raises:
        CommError: ranks are on different nodes (names them), the segment could not be created
            or mapped (says why: /dev/shm full, stale segment, ...), a rank died during the
            rendezvous (names it and its pid), or ``prefix`` was already used on ``store``.
        CommTimeoutError: a rank did not join within ``timeout``.
        TypeError: ``store`` is not a store.
        ValueError: bad arguments.

    Example::

        comm = ShmCommunicator(store, rank, world, prefix="tl/shm/g0", timeout=30.0)
        comm.allreduce(t, t, ReduceOp.SUM)
        comm.close()

    .. warning:: one communicator runs one collective at a time, and one send to or receive from
       each peer at a time: sends and receives of different (direction, peer) may run at once on
       several threads, beside each other and beside a collective (they use their own channels). A
       call that overlaps another of its kind otherwise raises CommError and aborts the
       communicator on every rank (the peers may wait for it). Every rank must issue the same
       collectives in the same order.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        prefix: str,
        timeout: float = 300.0,
        pin_cpu: bool = False,
        slot_bytes: Optional[int] = None,
        heap_bytes: int = 0,
        cma: Optional[bool] = None,
        cma_bytes: Optional[int] = None,
    ) -> None:
        self._engine: Any = None
        self._closed = True
        ws = as_int(world_size)
        if ws is None or ws < 1:
            raise ValueError(f"ShmCommunicator: world_size must be an int >= 1, got {world_size!r}")
        world_size = ws
        if world_size > 65535:
            raise ValueError(
                f"ShmCommunicator: world_size {world_size} is too large for one node (max 65535)"
            )
        r = as_int(rank)
        if r is None or not 0 <= r < world_size:
            raise ValueError(f"ShmCommunicator: rank must be an int in [0, {world_size}), got {rank!r}")
        rank = r
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"ShmCommunicator: prefix must be a non-empty str, got {prefix!r}")
        self._timeout = self._check_timeout(timeout, "ShmCommunicator: timeout")
        slot = DEFAULT_SLOT_BYTES if slot_bytes is None else slot_bytes
        sizes = []
        for name, v, lo in (("slot_bytes", slot, 4096), ("heap_bytes", heap_bytes, 0)):
            vi = as_int(v)
            if vi is None or vi < lo or vi % 4096:
                raise ValueError(f"ShmCommunicator: {name} must be a multiple of 4096 >= {lo}, got {v!r}")
            sizes.append(vi)
        slot, heap_bytes = sizes
        if cma is not None and not isinstance(cma, bool):
            raise ValueError(f"ShmCommunicator: cma must be None, True or False, got {cma!r}")
        if not isinstance(pin_cpu, bool):
            raise ValueError(f"ShmCommunicator: pin_cpu must be True or False, got {pin_cpu!r}")
        cma_thr = as_int(DEFAULT_CMA_BYTES if cma_bytes is None else cma_bytes)
        if cma_thr is None or cma_thr < 1:
            raise ValueError(f"ShmCommunicator: cma_bytes must be an int >= 1, got {cma_bytes!r}")
        if cma is None:
            cma = _cma_from_env()
        if slot < 64 * world_size:
            # alltoall, reduce_scatter and scatter give every rank a piece of each slot per step
            raise ValueError(
                f"ShmCommunicator: slot_bytes={slot} is too small for world_size {world_size}; "
                f"use at least {(64 * world_size + 4095) // 4096 * 4096}"
            )
        missing = [m for m in ("set", "get", "check", "wait") if not callable(getattr(store, m, None))]
        if missing:
            raise TypeError(
                "ShmCommunicator: store must be a torch.distributed Store (TCPStore, FileStore, HashStore, "
                f"PrefixStore, ...), got {type(store).__name__} (no {', '.join(missing)} method)"
            )
        if not shm_supported():
            raise CommError("ShmCommunicator: shared-memory collectives need Linux with a writable /dev/shm")
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self._seq = 0
        self._p2p_seq = 0
        self._heap_used = 0
        self._heap_lock = threading.Lock()
        self._saved_affinity: Optional[set] = None
        pair = max(4096, min(slot // 4, _PAIR_BUDGET // (2 * world_size * world_size)) // 4096 * 4096)
        try:
            self._engine = self._rendezvous(store, slot, pair, heap_bytes)
        except RuntimeError as exc:
            raise self._store_gone(exc) from None
        self._closed = False
        try:
            self._setup_cma(store, cma, cma_thr)
        except BaseException as exc:
            self.close()
            if isinstance(exc, RuntimeError):
                raise self._store_gone(exc) from None
            raise
        self._heap_bytes = heap_bytes
        self._heap_base = self._engine.heap_address(rank) if heap_bytes else 0
        ncpu = len(os.sched_getaffinity(0))
        # Spin only while every rank can own a core; oversubscribed ranks must sleep at once
        # (FINDINGS: spinning 4 ranks on 2 cores fell to gloo speed, futex sleep kept 3.8 GB/s).
        self._engine.spin_s = 50e-6 if world_size <= ncpu else 2e-6
        self._engine.small_bytes = min(DEFAULT_SMALL_BYTES, self._engine.slot_bytes)
        if pin_cpu:
            cpus = sorted(os.sched_getaffinity(0))
            self._saved_affinity = set(cpus)
            os.sched_setaffinity(0, {cpus[rank % len(cpus)]})

    # ---------------------------------------------------------------------------- set-up
    def _rendezvous(self, store: Any, slot: int, pair: int, heap: int) -> Any:
        W, r, pre = self.world_size, self.rank, self.prefix
        ident = node_identity()
        mine = f"{pre}/node/{r}"
        # A second communicator under a used prefix would read the first one's keys (its segment
        # name, its "mapped" flags) and fail at random: refuse it before writing anything.
        if store.check([mine]):
            raise CommError(
                f"ShmCommunicator(prefix={pre!r}) rank {r}: the prefix is already in use on this store "
                f"(key {mine!r} exists, written by an earlier communicator). Every communicator needs "
                "its own prefix on a store, e.g. with a counter: f'tl/shm/g{n}'."
            )
        store.set(mine, f"{ident}|{_pid_namespace()}|{os.getpid()}")
        node_keys = [f"{pre}/node/{p}" for p in range(W)]
        try:
            self._store_wait(store, node_keys, "exchanging node identities")
        except CommTimeoutError as exc:
            # Ranks that never came: they skipped the first operation on this group (the engine
            # connects at the first one, e.g. under `if rank == 0: allreduce(...)`) or are busy.
            try:
                missing = [p for p in range(W) if not store.check([node_keys[p]])]
            except RuntimeError:  # the store is gone as well: keep the report of the keys
                raise exc from None
            err = CommTimeoutError(
                f"ShmCommunicator(prefix={pre!r}) rank {r} of {W}: connecting failed after "
                f"{self._timeout:g} s; ranks {missing} never joined. Every rank must create the "
                "communicator, with the same prefix; trainloom.comm creates it at the first operation on "
                "a group, so every rank must call that operation (one that skipped it, e.g. under "
                "`if rank == 0:`, or is still busy elsewhere never joins), or raise the timeout"
            )
            err.op, err.seq, err.missing_ranks = "connect", 0, missing  # type: ignore[attr-defined]
            raise err from None
        infos = [store.get(k).decode().rsplit("|", 2) for k in node_keys]
        elsewhere = [p for p in range(W) if infos[p][0] != infos[0][0]]
        if elsewhere:
            # Every rank raises; wait until all have read the identities first, so that the rank
            # hosting the store does not exit (closing it) while others still read.
            store.set(f"{pre}/node_seen/{r}", "1")
            try:
                self._store_wait(store, [f"{pre}/node_seen/{p}" for p in range(W)], "reporting other nodes")
            except CommTimeoutError as exc:
                log.warning("shm communicator %s: %s", pre, exc)
            except CommError as exc:
                # the store is gone: its host (rank 0) left after every rank had read the
                # identities (it waits for that too), so the report below is complete
                log.debug("shm communicator %s: %s", pre, exc)
            raise CommError(
                f"ShmCommunicator(prefix={pre!r}): ranks {elsewhere} are not on the node of rank 0 "
                f"({infos[0][0]}); they report {sorted({infos[p][0] for p in elsewhere})}. Shared-memory "
                "collectives need every rank of the group on one machine: use gloo for this group."
            )
        pids = [int(i[2]) for i in infos]
        self._pids = pids
        # Ranks whose pid means something here (their death can be seen): the same pid namespace,
        # or, if /proc does not say, a pid that answers kill(pid, 0) now. Others: deadline only.
        my_ns = infos[r][1]
        self._watch = [
            p != r and (infos[p][1] == my_ns if my_ns and infos[p][1] else self._pid_visible(pids[p]))
            for p in range(W)
        ]
        seg_key = f"{pre}/segment"
        if r == 0:
            name = f"/tl-shm-{os.getpid()}-{secrets.token_hex(6)}"
            gen = secrets.randbits(63)
            try:
                eng = _shm.Engine.create(name.encode(), 0, W, slot, pair, heap, gen)
            except OSError as exc:
                total = _shm.layout(W, slot, pair, heap)[5]
                raise CommError(
                    f"ShmCommunicator rank 0: cannot create a {total / 2**20:.1f} MiB segment in /dev/shm "
                    f"({exc}). Free space in /dev/shm or enlarge it (docker run --shm-size=1g), or "
                    "pass a smaller slot_bytes."
                ) from exc
            try:
                store.set(seg_key, f"{name}|{gen}")
                mapped = [f"{pre}/mapped/{p}" for p in range(1, W)]
                # watches the peers: a rank that dies before mapping ends the wait at once, so the
                # name is unlinked (below) within about 0.1 s instead of after the whole timeout
                self._store_wait(
                    store, mapped, "waiting for the ranks to map the segment", owners=list(range(1, W))
                )
                errors = {}
                for p, k in enumerate(mapped, start=1):
                    v = store.get(k).decode()
                    if v != "ok":
                        errors[p] = v
                if errors:
                    raise CommError(f"ShmCommunicator: ranks could not map segment {name}: {errors}")
            except BaseException:
                eng.close()
                raise
            finally:
                # every rank has mapped it (or gave up, or died): no name is left behind in /dev/shm
                _shm.Engine.unlink(name.encode())
        else:
            self._store_wait(store, [seg_key], "waiting for rank 0 to create the segment", owners=[0])
            name, gen_s = store.get(seg_key).decode().rsplit("|", 1)
            try:
                eng = _shm.Engine.attach(name.encode(), r, W, int(gen_s))
            except (OSError, ValueError) as exc:
                store.set(f"{pre}/mapped/{r}", f"rank {r}: {exc}")
                raise CommError(f"ShmCommunicator rank {r}: cannot map segment {name}: {exc}") from exc
            if eng.attach_order == W:
                # The last rank to map the segment removes its name at once; rank 0 would do it
                # too, but only after it has read every rank's "mapped" key from the store.
                _shm.Engine.unlink(name.encode())
            store.set(f"{pre}/mapped/{r}", "ok")
        # Dead-peer detection uses kill(pid, 0): only possible for peers in our pid namespace.
        for p in range(W):
            if p == r:
                continue
            visible = self._watch[p]
            eng.set_check_pid(p, visible)
            if not visible:
                log.warning(
                    "shm communicator %s: rank %d (pid %d) is not visible from rank %d (another pid "
                    "namespace?); a death of that rank is detected by timeout only",
                    pre,
                    p,
                    pids[p],
                    r,
                )
        return eng

    def _store_gone(self, exc: RuntimeError) -> RuntimeError:
        """``exc`` itself if it is trainloom's; else (the store raised: torch's DistNetworkError
        and the like) the error for a store that went away while this communicator connected."""
        if isinstance(exc, (CommError, ConfigError)):
            return exc
        detail = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        return CommError(
            f"ShmCommunicator(prefix={self.prefix!r}) rank {self.rank} of {self.world_size}: could not "
            f"connect because the store is gone ({detail}). {STORE_GONE_HINT}"
        )

    @staticmethod
    def _pid_visible(pid: int) -> bool:
        """kill(pid, 0) finds the process (it may belong to another user)."""
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _setup_cma(self, store: Any, want: bool, threshold: int) -> None:
        """Probe cross-memory attach and make every rank agree on using it (or not).

        Each rank publishes the address of a random word in its own memory; every rank reads
        every peer's word with process_vm_readv and publishes "ok" or why not. The protocol is
        on only if all ranks said "ok": a rank that cannot read (Yama ptrace_scope, seccomp, a
        non-dumpable process, another pid namespace) or that disabled it turns it off for all,
        because a collective must not run half on one protocol and half on the other.
        """
        eng, W, r, pre = self._engine, self.world_size, self.rank, self.prefix
        big = _llc_bytes()
        eng.big_bytes = big
        if W == 1:
            eng.set_cma(False, threshold)
            return
        reason = "" if want else f"not enabled on rank {r} (cma=False, or cma=None without {CMA_ENV}=1)"
        if not reason:
            scope = _yama_ptrace_scope()
            if scope is not None and scope >= 2:
                reason = f"rank {r}: kernel.yama.ptrace_scope={scope} forbids process_vm_readv between peers"
            elif scope == 1:
                # Yama lets only ancestors read a process unless it names a tracer; peers are
                # siblings, so allow any process of this user (Open MPI's CMA path does the same)
                err = _shm.allow_ptrace_any()
                if err:
                    reason = f"rank {r}: prctl(PR_SET_PTRACER) failed: {os.strerror(err)}"
        token = secrets.randbits(63) | 1
        eng.set_probe(token)
        mine = f"off|{reason}" if reason else f"{eng.probe_address()}|{token}|{threshold}|{big}"
        store.set(f"{pre}/cma/{r}", mine)
        keys = [f"{pre}/cma/{p}" for p in range(W)]
        self._store_wait(store, keys, "probing cross-memory attach", owners=list(range(W)))
        vals = [store.get(k).decode() for k in keys]
        result = reason
        for p in range(W):
            if result:
                break
            if vals[p].startswith("off|"):
                result = vals[p][4:]
            elif p != r:
                addr, tok = vals[p].split("|")[:2]
                try:
                    got = _shm.cma_read(self._pids[p], int(addr), 8)
                except OSError as exc:
                    result = f"rank {r} cannot read rank {p} (pid {self._pids[p]}): {exc}"
                    break
                if int.from_bytes(got, sys.byteorder) != int(tok):
                    result = f"rank {r} read a wrong probe value from rank {p} (pid {self._pids[p]})"
        store.set(f"{pre}/cma_ok/{r}", result or "ok")
        ok_keys = [f"{pre}/cma_ok/{p}" for p in range(W)]
        self._store_wait(store, ok_keys, "agreeing on cross-memory attach", owners=list(range(W)))
        problems = [v for v in (store.get(k).decode() for k in ok_keys) if v != "ok"]
        # No rank may leave before all have read the store: the rank hosting it (often rank 0)
        # could exit and take the store down under the others. A barrier through the segment
        # (sequence 0: user ops keep their numbers from 1).
        rc = eng.barrier((_shm.OP_BARRIER, 0, 0, -1, -1, 0, 0, ()), self._timeout)
        if rc:
            self._raise(rc, "barrier (set-up)", 0, self._timeout)
        if problems:
            eng.set_cma(False, threshold)
            # a rank that asked for it hears why it is off (a warning if a probe failed); a rank
            # that did not ask (the default) logs at debug level only
            level = logging.DEBUG
            if want:
                level = logging.INFO if all("not enabled on rank" in p for p in problems) else logging.WARNING
            log.log(
                level,
                "shm communicator %s rank %d: cross-memory attach off (%s); large messages are copied "
                "through the shared segment",
                pre,
                r,
                problems[0],
            )
        else:
            # every rank uses rank 0's thresholds: the protocol choice must not differ between ranks
            _, _, thr0, big0 = vals[0].split("|")
            eng.big_bytes = int(big0)
            eng.set_cma(True, int(thr0))

    def _store_wait(self, store: Any, keys: List[str], what: str, owners: Optional[List[int]] = None) -> None:
        """Wait until every key of ``keys`` is in the store, for at most ``self.timeout`` seconds.

        The store is polled (0.5 ms doubling to 20 ms between checks): a blocking wait cannot be cut
        short, holds the thread in C++ where Ctrl-C waited for the whole timeout, and every
        timed-out TCPStore wait logs warnings. ``owners[i]`` is the rank that sets ``keys[i]``; with
        owners, those of missing keys are checked every 0.1 s: one that died ends the wait with a
        CommError that names it and its pid (without owners their pids are not known yet).
        """
        deadline = time.monotonic() + self._timeout
        pause = 0.0005
        next_check = time.monotonic() + _LIVENESS_EVERY
        while True:
            try:
                if store.check(keys):
                    return
            except RuntimeError as exc:  # the store went away (the rank hosting it exited?)
                if owners is not None:
                    self._check_owners(store, keys, owners, what)
                raise CommError(
                    f"ShmCommunicator(prefix={self.prefix!r}) rank {self.rank}: the store failed while "
                    f"this rank was {what}: {exc}"
                ) from exc
            now = time.monotonic()
            if owners is not None and now >= next_check:
                self._check_owners(store, keys, owners, what)
                next_check = now + _LIVENESS_EVERY
            if now >= deadline:
                self._wait_failed(store, keys, what, None, owners)
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, _POLL_MAX)

    def _check_owners(self, store: Any, keys: List[str], owners: List[int], what: str) -> None:
        """Raise CommError if a (visible) rank that still has to set one of ``keys`` is dead."""
        for p in sorted(set(owners)):
            if not self._watch[p] or not _shm.pid_dead(self._pids[p]):
                continue
            for k, o in zip(keys, owners):
                if o != p:
                    continue
                try:
                    if store.check([k]):
                        continue
                except RuntimeError:
                    pass
                raise CommError(
                    f"ShmCommunicator(prefix={self.prefix!r}) rank {self.rank}: rank {p} (pid "
                    f"{self._pids[p]}) died before setting store key {k!r} while this rank was {what}; "
                    "the communicator cannot be created"
                )

    def _wait_failed(
        self,
        store: Any,
        keys: List[str],
        what: str,
        exc: Optional[BaseException],
        owners: Optional[List[int]],
    ) -> None:
        """Raise CommTimeoutError naming the keys (and the ranks that should set them) still missing."""
        missing = []
        for k in keys:
            try:
                if not store.check([k]):
                    missing.append(k)
            except RuntimeError:
                missing.append(k)
        who = ""
        if owners is not None:
            late = sorted({o for k, o in zip(keys, owners) if k in missing})
            who = f" (to be set by ranks {late})"
        detail = f" ({exc})" if exc is not None else ""
        raise CommTimeoutError(
            f"ShmCommunicator(prefix={self.prefix!r}) rank {self.rank}: timed out after "
            f"{self._timeout:g} s {what}; missing store keys {missing}{who}{detail}. Every rank of the "
            "group must construct the communicator with the same prefix."
        ) from exc

    # ---------------------------------------------------------------------------- helpers
    @staticmethod
    def _check_timeout(timeout: Any, what: str = "timeout") -> float:
        """A deadline in seconds: a positive int or float; ``inf`` (or an int beyond floats) = none."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(
                f"{what} must be a positive number of seconds, got {timeout!r} (float('inf') for no deadline)"
            )
        try:
            return float(timeout)
        except OverflowError:  # an int too large for a float: no deadline either
            return float("inf")

    def _deadline(self, timeout: Optional[float]) -> float:
        return self._timeout if timeout is None else self._check_timeout(timeout)

    def _open(self, op: str) -> Any:
        if self._closed or self._engine is None:
            raise CommError(f"shm {op}: communicator (prefix {self.prefix!r}) used after close()")
        return self._engine

    def _tensor(self, op: str, name: str, t: Any) -> Tuple[int, int, int, int]:
        # fast path first: these checks run on every call and cost ~0.1 us each. Complex dtypes are
        # not in _REAL_DTYPES: only they can carry the conjugate bit, which the slow path checks.
        if isinstance(t, torch.Tensor):
            info = _REAL_DTYPES.get(t.dtype)
            if (
                info is not None
                and t.is_cpu
                and t.layout is torch.strided
                and t.is_contiguous()
                and not t.is_neg()
            ):
                return info
        return self._tensor_slow(op, name, t)

    def _tensor_slow(self, op: str, name: str, t: Any) -> Tuple[int, int, int, int]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"shm {op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"shm {op}: {name} must be a CPU tensor, got device {t.device}")
        if t.layout != torch.strided:
            raise ValueError(f"shm {op}: {name} must be a dense (strided) tensor, got {t.layout}")
        if not t.is_contiguous():
            raise ValueError(
                f"shm {op}: {name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                "pass t.contiguous() and copy the result back"
            )
        if t.dtype not in _DTYPES:
            raise ValueError(
                f"shm {op}: {name} has unsupported dtype {t.dtype}; supported: "
                + ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
            )
        if t.is_conj() or t.is_neg():
            # its memory holds conj(x) or -x of the values it shows: the public method catches
            # this (before anything is shared) and runs again on plain copies (_resolved)
            raise _ViewBits(name)
        return _DTYPES[t.dtype]

    def _resolved(self, method: Callable[..., None], args: Tuple[Any, ...], outputs: Sequence[int]) -> None:
        """Run ``method(*args)`` with conjugate and negative views replaced by plain tensors.

        The engine moves raw memory, and such a view's memory holds ``conj(x)`` or ``-x`` of the
        values it shows. Each view is materialised (``resolve_conj()``/``resolve_neg()``, one copy;
        a tensor passed twice, e.g. in place, gets one copy), and the results in the plain stand-ins
        of ``args[i]`` for ``i`` in ``outputs`` are copied back through the views (``copy_``
        applies the conjugation or negation). Rare, so the fast path does not pay for it.
        """
        subs: Dict[int, torch.Tensor] = {}
        new = list(args)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and (a.is_conj() or a.is_neg()):
                if id(a) not in subs:
                    subs[id(a)] = a.resolve_conj().resolve_neg()
                new[i] = subs[id(a)]
        method(*new)
        with torch.no_grad():
            for i in outputs:
                a = args[i]
                if isinstance(a, torch.Tensor) and id(a) in subs:
                    a.copy_(subs[id(a)])

    def _same_dtype(self, op: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.dtype != b.dtype:
            raise ValueError(f"shm {op}: send and recv dtypes differ ({a.dtype} vs {b.dtype})")

    def _check_rank(self, op: str, what: str, r: Any, allow_self: bool = True) -> int:
        ri = r if type(r) is int else as_int(r)  # the common case without a call
        if ri is None or not 0 <= ri < self.world_size:
            raise ValueError(f"shm {op}: {what} must be a rank in [0, {self.world_size}), got {r!r}")
        r = ri
        if not allow_self and r == self.rank:
            raise ValueError(f"shm {op}: {what} must differ from this rank ({self.rank})")
        return r

    def _check_op(self, opname: str, op: Any, t: torch.Tensor) -> int:
        try:
            return _VALID_OPS[(op, t.dtype)]
        except (KeyError, TypeError):
            return self._check_op_slow(opname, op, t)

    def _check_op_slow(self, opname: str, op: Any, t: torch.Tensor) -> int:
        try:
            code = int(op)
        except (TypeError, ValueError):
            raise ValueError(f"shm {opname}: op must be a ReduceOp int, got {op!r}") from None
        if code not in _OP_NAMES:
            raise ValueError(f"shm {opname}: unknown reduce op {op!r}; use one of {_OP_NAMES}")
        name = _OP_NAMES[code]
        dt = t.dtype
        if (code, dt) in _VALID_OPS:
            return code
        if dt in _COMPLEX and code not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"shm {opname}: {name} is not defined for complex dtype {dt}; use SUM or AVG")
        if dt in _FLOAT and code in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            raise ValueError(f"shm {opname}: bitwise {name} needs an integer or bool tensor, got {dt}")
        if dt == torch.bool and code == ReduceOp.AVG:
            raise ValueError(f"shm {opname}: AVG is not defined for bool tensors")
        return code

    @staticmethod
    def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
        a0, b0 = a.data_ptr(), b.data_ptr()
        a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
        return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1

    def _no_partial_overlap(self, op: str, send: torch.Tensor, recv: torch.Tensor, ok_offset: int) -> None:
        # In-place use (send is recv, or send is this rank's block of recv) is safe: each chunk is
        # copied into the slot before the same region of the output is written.
        if self._overlap(send, recv) and send.data_ptr() - recv.data_ptr() != ok_offset:
            raise ValueError(
                f"shm {op}: send and recv overlap partially; pass the same tensor (in place) or "
                "separate tensors"
            )

    def _heap_offset(self, ptr: int, nbytes: int) -> int:
        """Offset of [ptr, ptr + nbytes) in this rank's heap (a shared_empty tensor), else -1."""
        if not self._heap_base:
            return -1
        off = ptr - self._heap_base
        return off if 0 <= off and off + nbytes <= self._heap_bytes else -1

    def _desc(
        self, kind: int, dcode: int, redop: int, root: int, numel: int, extra: int, shape: Any
    ) -> tuple:
        # shape: a torch.Size (a tuple of ints) or (); the core keeps the first 8 dims for messages
        self._seq += 1
        return (kind, self._seq, dcode, redop, root, numel, extra, shape)

    def _p2p_desc(self, dcode: int, numel: int, shape: Any) -> tuple:
        # Sends and receives are numbered apart from the collectives, whose numbers then stay equal
        # on every rank (messages and CommTimeoutError.seq name the same call), as on gloo.
        self._p2p_seq += 1
        return (_shm.OP_SEND, self._p2p_seq, dcode, -1, -1, numel, 0, shape)

    def _fmt_desc(self, d: Dict[str, Any], small: bool = False) -> str:
        """One rank's descriptor for a message; ``small``: add its small_bytes (allreduce/reduce)."""
        kind = _OPKIND_NAMES.get(d["opkind"], f"op#{d['opkind']}")
        parts = [kind]
        # alltoall_v's sizes differ per rank by design and a barrier has none: their descriptors carry
        # placeholders (shape (), numel 0, dtype -1), not values worth printing.
        if d["opkind"] not in (_shm.OP_ALLTOALL_V, _shm.OP_BARRIER):
            parts.append(f"shape={d['shape']} numel={d['numel']}")
        if d["dtype"] >= 0:
            parts.append("dtype=" + str(_DTYPE_BY_CODE.get(d["dtype"], d["dtype"])).replace("torch.", ""))
        if d["redop"] >= 0:
            parts.append(f"op={_OP_NAMES.get(d['redop'], d['redop'])}")
        if d["root"] >= 0:
            parts.append(f"root={d['root']}")
        if small:
            parts.append(f"small_bytes={d['extra']}")
        return " ".join(parts)

    def _raise(self, rc: int, op: str, seq: int, timeout: float, peer: Optional[int] = None) -> None:
        eng = self._engine
        info = eng.error_info()
        if peer is not None:
            # a send or receive may fail beside another one or a collective on other threads: each
            # knows its own peer (the core keeps error_info()'s peer for the collectives)
            info["peer"] = peer
        where = f"shm {op} #{seq} on rank {self.rank}/{self.world_size} (prefix {self.prefix!r})"
        if rc == _shm.ERR_TIMEOUT:
            missing = info["missing"] if peer is None else [peer]
            exc = CommTimeoutError(
                f"{where}: timed out after {timeout:g} s waiting for ranks {missing}. The communicator "
                "is aborted (its peers fail fast). Check that every rank issues the same collectives "
                "in the same order, or pass a larger timeout."
            )
            exc.op, exc.seq, exc.missing_ranks = op, seq, missing  # type: ignore[attr-defined]
            raise exc
        if rc == _shm.ERR_ABORT:
            reason, who = eng.abort_word()
            why = _ABORT_REASONS.get(reason, f"reason {reason}")
            if reason == _shm.ABORT_DEAD:
                why += self._gone_peers(eng)
            raise CommError(
                f"{where}: the communicator was aborted by rank {who} ({why}); no further operation "
                "can run on it, create a new communicator"
            )
        if rc == _shm.ERR_DEAD:
            p = info["peer"]
            raise CommError(
                f"{where}: rank {p} (pid {eng.peer_pid(p)}) died while this rank waited for it or read "
                "its memory; the communicator is aborted"
            )
        if rc == _shm.ERR_CMA:
            p = info["peer"]
            raise CommError(
                f"{where}: reading rank {p}'s buffer (pid {eng.peer_pid(p)}) with process_vm_readv "
                f"failed: {os.strerror(info['errno'])}; the communicator is aborted. Pass cma=False "
                f"(or leave {CMA_ENV} unset) to copy through the shared segment instead."
            )
        if rc == _shm.ERR_CLOSED:
            p = info["peer"]
            raise CommError(f"{where}: rank {p} closed its communicator while this rank waited for it")
        if rc == _shm.ERR_LOCAL_CLOSE:
            raise CommError(f"{where}: the communicator was closed by another thread during the call")
        if rc == _shm.ERR_MISMATCH:
            other = info["rank"]
            mine_d = eng.last_desc(self.rank)
            theirs = eng.last_desc(other)
            # allreduce/reduce carry small_bytes (it picks the algorithm): show it if it differs
            # (only when both run the same one: another collective carries no small_bytes at all)
            small = (
                mine_d["extra"] != theirs["extra"]
                and mine_d["opkind"] == theirs["opkind"]
                and mine_d["opkind"] in (_shm.OP_ALLREDUCE, _shm.OP_REDUCE)
            )
            hint = " Every rank must call the same collective with the same size, dtype, op and root" + (
                ", and set small_bytes to the same value." if small else "."
            )
            raise CommError(
                f"{where}: ranks disagree on the call: rank {self.rank} has {self._fmt_desc(mine_d, small)}; "
                f"rank {other} has {self._fmt_desc(theirs, small)}.{hint}"
            )
        if rc == _shm.ERR_COUNTS:
            p, q = info["rank"], info["rank2"]
            raise CommError(
                f"{where}: rank {p} sends {info['send_count']} elements to rank {q}, but rank {q} "
                f"expects {info['recv_count']} from rank {p}: send_counts[{q}] on rank {p} must equal "
                f"recv_counts[{p}] on rank {q}"
            )
        if rc == _shm.ERR_POISON:
            p = info["peer"]
            src, dst = (p, self.rank) if op == "recv" else (self.rank, p)
            hdr, poison = eng.p2p_info(src, dst)
            hdr["root"] = -1  # a chunk header's root field holds the sender's chunk count, not a root
            raise CommError(
                f"{where}: the message from rank {src} to rank {dst} does not match: the sender "
                f"sent {self._fmt_desc(hdr)}, the receiver expected {self._fmt_desc(poison)}. The "
                f"channel {src}->{dst} is unusable now; create a new communicator."
            )
        raise CommError(f"{where}: engine error code {rc}")

    def _gone_peers(self, eng: Any) -> str:
        """The text naming the peers behind an abort for a dead or closed peer, e.g.
        ``": rank 2 (pid N) is dead"``; empty if none is found.

        The abort word names only the rank that aborted. Dead peers are named; closed ones only if
        none is dead (after an abort the survivors close too, which says nothing). Error path only.
        """
        dead, closed = [], []
        for p in range(self.world_size):
            if p != self.rank:
                state = eng.peer_gone(p)
                if state == 1:
                    dead.append(f"rank {p} (pid {eng.peer_pid(p)}) is dead")
                elif state == 2:
                    closed.append(f"rank {p} (pid {eng.peer_pid(p)}) closed its communicator")
        gone = dead or closed
        return ": " + ", ".join(gone) if gone else ""

    # ---------------------------------------------------------------------------- properties
    @property
    def slot_bytes(self) -> int:
        """Bytes per slot (each rank owns two)."""
        return int(self._open("slot_bytes").slot_bytes)

    @property
    def small_bytes(self) -> int:
        """Largest message (bytes) that uses the one-shot allreduce (at most :attr:`slot_bytes`)."""
        return int(self._open("small_bytes").small_bytes)

    @small_bytes.setter
    def small_bytes(self, value: int) -> None:
        """Set on EVERY rank to the same value: each allreduce/reduce carries it in its descriptor,
        and ranks whose values differ raise CommError (on every rank) at their next allreduce or
        reduce. Values above :attr:`slot_bytes` act as slot_bytes (and read back as it)."""
        v = as_int(value)
        if v is None or v < 0:
            raise ValueError(f"small_bytes must be an int >= 0, got {value!r}")
        eng = self._open("small_bytes")
        eng.small_bytes = min(v, eng.slot_bytes)

    @property
    def timeout(self) -> float:
        """Default deadline (seconds) of every operation; settable (a positive number, or inf)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = self._check_timeout(value, "ShmCommunicator.timeout")

    @property
    def cma(self) -> bool:
        """True if large messages move by cross-memory attach (agreed by all ranks at creation)."""
        return bool(self._open("cma").cma)

    @property
    def cma_bytes(self) -> int:
        """Smallest per-peer message (bytes) moved by cross-memory attach when :attr:`cma` is on."""
        return int(self._open("cma_bytes").cma_bytes)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---------------------------------------------------------------------------- collectives
    def allreduce(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, timeout: Optional[float] = None
    ) -> None:
        """Reduce ``send`` over all ranks into ``recv`` on every rank (``send`` may be ``recv``).

        Results are bitwise identical on every rank (slices are reduced in rank order); fp16/bf16
        accumulate in fp32 and round once; AVG divides the sum by the world size.

        Args:
            send: contiguous CPU tensor.
            recv: contiguous CPU tensor of the same dtype and numel.
            op: a ReduceOp value (SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG).
            timeout: seconds (None: ``self.timeout``).

        Example::

            comm.allreduce(t, t, ReduceOp.SUM)
        """
        try:
            # the hottest path: every check here is on the per-op budget of a 4 KiB allreduce
            if self._closed:
                self._open("allreduce")
            eng = self._engine
            info = self._tensor("allreduce", "send", send)
            if recv is not send:  # in place is the common case: skip the second set of checks
                # one info tuple per dtype: the same object means the same dtype
                if self._tensor("allreduce", "recv", recv) is not info:
                    self._same_dtype("allreduce", send, recv)
                if recv.numel() != send.numel():
                    raise ValueError(
                        f"shm allreduce: recv has {recv.numel()} elements, send has {send.numel()}"
                    )
                self._no_partial_overlap("allreduce", send, recv, 0)
            try:
                code = _VALID_OPS_BY_CODE[(op, info[0])]
            except (KeyError, TypeError):
                code = self._check_op("allreduce", op, send)  # raises the right error
            t = self._timeout if timeout is None else self._check_timeout(timeout)
            self._reduce_impl(eng, "allreduce", _shm.OP_ALLREDUCE, info, send, recv, code, -1, t)
        except _ViewBits:
            self._resolved(self.allreduce, (send, recv, op, timeout), (1,))

    def _reduce_impl(
        self,
        eng: Any,
        name: str,
        kind: int,
        info: Tuple[int, int, int, int],
        send: torch.Tensor,
        recv: torch.Tensor,
        code: int,
        dst: int,
        t: float,
    ) -> None:
        dcode, kdt, kes, mult = info  # what _tensor returned for send
        numel = send.numel()
        d = self._desc(kind, dcode, code, dst, numel, 0, send.shape)
        if self.world_size == 1:
            if (dst < 0 or dst == self.rank) and recv.data_ptr() != send.data_ptr():
                recv.copy_(send.view_as(recv) if send.shape != recv.shape else send)
            return
        n = numel * mult
        sp = send.data_ptr()
        out = recv.data_ptr() if (dst < 0 or dst == self.rank) else 0
        # a shared_empty tensor reduced in place: peers read it where it is (no copy into the slots)
        zc = self._heap_offset(sp, n * kes) if (dst < 0 and sp == out) else -1
        rc = eng.allreduce(d, sp, out, n, kes, kdt, code, self.world_size, dst, t, zc)
        if rc:
            self._raise(rc, name, d[1], t)

    def reduce(
        self, send: torch.Tensor, recv: torch.Tensor, dst: int, op: int, timeout: Optional[float] = None
    ) -> None:
        """Reduce ``send`` over all ranks into ``recv`` on rank ``dst`` (``recv`` unused elsewhere).

        Example::

            comm.reduce(t, out, dst=0, op=ReduceOp.MAX)
        """
        try:
            if self._closed:  # inlined self._open(): a call less per op
                self._open("reduce")
            eng = self._engine
            info = self._tensor("reduce", "send", send)
            dst = self._check_rank("reduce", "dst", dst)
            code = self._check_op("reduce", op, send)
            if self.rank == dst:
                if self._tensor("reduce", "recv", recv) is not info:  # one info tuple per dtype
                    self._same_dtype("reduce", send, recv)
                if recv.numel() != send.numel():
                    raise ValueError(f"shm reduce: recv has {recv.numel()} elements, send has {send.numel()}")
                self._no_partial_overlap("reduce", send, recv, 0)
            self._reduce_impl(
                eng, "reduce", _shm.OP_REDUCE, info, send, recv, code, dst, self._deadline(timeout)
            )
        except _ViewBits:
            self._resolved(self.reduce, (send, recv, dst, op, timeout), (1,))

    def broadcast(self, tensor: torch.Tensor, src: int, timeout: Optional[float] = None) -> None:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank.

        Example::

            comm.broadcast(t, src=0)
        """
        try:
            if self._closed:  # inlined self._open(): a call less per op
                self._open("broadcast")
            eng = self._engine
            dcode = self._tensor("broadcast", "tensor", tensor)[0]
            if type(src) is not int or not 0 <= src < self.world_size:  # a bool is refused
                src = self._check_rank("broadcast", "src", src)
            t = self._deadline(timeout)
            d = self._desc(_shm.OP_BROADCAST, dcode, -1, src, tensor.numel(), 0, tensor.shape)
            if self.world_size == 1:
                return
            nbytes = tensor.numel() * tensor.element_size()
            zc = self._heap_offset(tensor.data_ptr(), nbytes) if self.rank == src else -1
            rc = eng.broadcast(d, tensor.data_ptr(), nbytes, src, t, zc)
            if rc:
                self._raise(rc, "broadcast", d[1], t)
        except _ViewBits:
            self._resolved(self.broadcast, (tensor, src, timeout), (0,))

    def _gather_impl(
        self,
        opname: str,
        kind: int,
        send: torch.Tensor,
        recv: torch.Tensor,
        dst: int,
        timeout: Optional[float],
    ) -> None:
        if self._closed:  # inlined self._open(): a call less per op
            self._open(opname)
        eng = self._engine
        info = self._tensor(opname, "send", send)
        dcode = info[0]
        if dst >= 0:
            dst = self._check_rank(opname, "dst", dst)
        if dst < 0 or dst == self.rank:
            if self._tensor(opname, "recv", recv) is not info:  # one info tuple per dtype
                self._same_dtype(opname, send, recv)
            if recv.numel() != send.numel() * self.world_size:
                raise ValueError(
                    f"shm {opname}: recv must have world_size * send.numel() = "
                    f"{self.world_size} * {send.numel()} elements, got {recv.numel()}"
                )
            self._no_partial_overlap(opname, send, recv, self.rank * send.numel() * send.element_size())
        t = self._deadline(timeout)
        d = self._desc(kind, dcode, -1, dst, send.numel(), 0, send.shape)
        if self.world_size == 1:
            if send.data_ptr() != recv.data_ptr():
                recv.view(-1).copy_(send.view(-1))
            return
        out = recv.data_ptr() if (dst < 0 or dst == self.rank) else 0
        nbytes = send.numel() * send.element_size()
        zc = self._heap_offset(send.data_ptr(), nbytes)
        rc = eng.allgather(d, send.data_ptr(), out, nbytes, dst, t, zc)
        if rc:
            self._raise(rc, opname, d[1], t)

    def allgather(self, send: torch.Tensor, recv: torch.Tensor, timeout: Optional[float] = None) -> None:
        """Concatenate every rank's ``send`` in rank order into ``recv`` (numel = world * send numel).

        ``send`` may be this rank's block of ``recv`` (in place).

        Example::

            comm.allgather(t, out)      # out[r * t.numel():(r + 1) * t.numel()] is rank r's t
        """
        try:
            self._gather_impl("allgather", _shm.OP_ALLGATHER, send, recv, -1, timeout)
        except _ViewBits:
            self._resolved(self.allgather, (send, recv, timeout), (1,))

    def gather(
        self, send: torch.Tensor, recv: torch.Tensor, dst: int, timeout: Optional[float] = None
    ) -> None:
        """Like :meth:`allgather`, but only rank ``dst`` receives (``recv`` unused elsewhere)."""
        try:
            dst = self._check_rank("gather", "dst", dst)
            self._gather_impl("gather", _shm.OP_GATHER, send, recv, dst, timeout)
        except _ViewBits:
            self._resolved(self.gather, (send, recv, dst, timeout), (1,))

    def scatter(
        self, send: torch.Tensor, recv: torch.Tensor, src: int, timeout: Optional[float] = None
    ) -> None:
        """Rank ``src`` sends block r of ``send`` (numel = world * recv numel) to rank r's ``recv``.

        Example::

            comm.scatter(blocks, mine, src=0)
        """
        try:
            if self._closed:  # inlined self._open(): a call less per op
                self._open("scatter")
            eng = self._engine
            info = self._tensor("scatter", "recv", recv)
            dcode = info[0]
            src = self._check_rank("scatter", "src", src)
            if self.rank == src:
                if self._tensor("scatter", "send", send) is not info:  # one info tuple per dtype
                    self._same_dtype("scatter", send, recv)
                if send.numel() != recv.numel() * self.world_size:
                    raise ValueError(
                        f"shm scatter: send must have world_size * recv.numel() = "
                        f"{self.world_size} * {recv.numel()} elements, got {send.numel()}"
                    )
                self._no_partial_overlap(
                    "scatter", recv, send, self.rank * recv.numel() * recv.element_size()
                )
            t = self._deadline(timeout)
            d = self._desc(_shm.OP_SCATTER, dcode, -1, src, recv.numel(), 0, recv.shape)
            if self.world_size == 1:
                if send.data_ptr() != recv.data_ptr():
                    recv.view(-1).copy_(send.view(-1))
                return
            inp = send.data_ptr() if self.rank == src else 0
            rc = eng.scatter(d, inp, recv.data_ptr(), recv.numel() * recv.element_size(), src, t)
            if rc:
                self._raise(rc, "scatter", d[1], t)
        except _ViewBits:
            self._resolved(self.scatter, (send, recv, src, timeout), (1,))

    def reduce_scatter(
        self, send: torch.Tensor, recv: torch.Tensor, op: int, timeout: Optional[float] = None
    ) -> None:
        """Reduce ``send`` (world blocks of recv numel) over ranks; rank r gets reduced block r.

        Example::

            comm.reduce_scatter(grads, my_shard, ReduceOp.SUM)
        """
        try:
            if self._closed:  # inlined self._open(): a call less per op
                self._open("reduce_scatter")
            eng = self._engine
            info = self._tensor("reduce_scatter", "send", send)
            dcode, kdt, kes, mult = info
            if self._tensor("reduce_scatter", "recv", recv) is not info:  # one info tuple per dtype
                self._same_dtype("reduce_scatter", send, recv)
            if send.numel() != recv.numel() * self.world_size:
                raise ValueError(
                    f"shm reduce_scatter: send must have world_size * recv.numel() = "
                    f"{self.world_size} * {recv.numel()} elements, got {send.numel()}"
                )
            code = self._check_op("reduce_scatter", op, send)
            self._no_partial_overlap(
                "reduce_scatter", recv, send, self.rank * recv.numel() * recv.element_size()
            )
            t = self._deadline(timeout)
            d = self._desc(_shm.OP_REDUCE_SCATTER, dcode, code, -1, recv.numel(), 0, recv.shape)
            if self.world_size == 1:
                if send.data_ptr() != recv.data_ptr():
                    recv.view(-1).copy_(send.view(-1))
                return
            rc = eng.exchange(
                d, send.data_ptr(), recv.data_ptr(), recv.numel() * mult, kes, kdt, code, self.world_size, t
            )
            if rc:
                self._raise(rc, "reduce_scatter", d[1], t)
        except _ViewBits:
            self._resolved(self.reduce_scatter, (send, recv, op, timeout), (1,))

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor, timeout: Optional[float] = None) -> None:
        """Block q of rank p's ``send`` goes to block p of rank q's ``recv`` (equal blocks).

        Example::

            comm.alltoall(send, recv)   # both of numel world_size * block
        """
        try:
            if self._closed:  # inlined self._open(): a call less per op
                self._open("alltoall")
            eng = self._engine
            info = self._tensor("alltoall", "send", send)
            dcode = info[0]
            if self._tensor("alltoall", "recv", recv) is not info:  # one info tuple per dtype
                self._same_dtype("alltoall", send, recv)
            W = self.world_size
            if send.numel() != recv.numel() or send.numel() % W:
                raise ValueError(
                    f"shm alltoall: send and recv need the same numel, a multiple of world_size {W}; "
                    f"got {send.numel()} and {recv.numel()}"
                )
            self._no_partial_overlap("alltoall", send, recv, 0)
            t = self._deadline(timeout)
            block = send.numel() // W
            d = self._desc(_shm.OP_ALLTOALL, dcode, -1, -1, send.numel(), 0, send.shape)
            if W == 1:
                if send.data_ptr() != recv.data_ptr():
                    recv.view(-1).copy_(send.view(-1))
                return
            es = send.element_size()
            rc = eng.exchange(d, send.data_ptr(), recv.data_ptr(), block * es, 1, 0, -1, 1, t)
            if rc:
                self._raise(rc, "alltoall", d[1], t)
        except _ViewBits:
            self._resolved(self.alltoall, (send, recv, timeout), (1,))

    def alltoall_v(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        send_displs: Sequence[int],
        recv: torch.Tensor,
        recv_counts: Sequence[int],
        recv_displs: Sequence[int],
        timeout: Optional[float] = None,
    ) -> None:
        """Rank p sends ``send[send_displs[q]:+send_counts[q]]`` to rank q, which stores it at
        ``recv[recv_displs[p]:+recv_counts[p]]``. Counts and displacements are in elements.

        Every rank checks the whole count matrix, so inconsistent counts raise on every rank.

        Example::

            comm.alltoall_v(send, [1, 2], [0, 1], recv, [1, 1], [0, 1])
        """
        try:
            if self._closed:  # inlined self._open(): a call less per op
                self._open("alltoall_v")
            eng = self._engine
            info = self._tensor("alltoall_v", "send", send)
            dcode = info[0]
            if self._tensor("alltoall_v", "recv", recv) is not info:  # one info tuple per dtype
                self._same_dtype("alltoall_v", send, recv)
            W = self.world_size
            arrays = []
            for name, seq in (
                ("send_counts", send_counts),
                ("send_displs", send_displs),
                ("recv_counts", recv_counts),
                ("recv_displs", recv_displs),
            ):
                vals = [int(v) for v in seq]
                if len(vals) != W:
                    raise ValueError(
                        f"shm alltoall_v: {name} needs {W} entries (one per rank), got {len(vals)}"
                    )
                if any(v < 0 for v in vals):
                    raise ValueError(f"shm alltoall_v: {name} has a negative entry: {vals}")
                arrays.append(vals)
            for cname, counts, displs, t_ in (
                ("send", arrays[0], arrays[1], send),
                ("recv", arrays[2], arrays[3], recv),
            ):
                for q in range(W):
                    if counts[q] and displs[q] + counts[q] > t_.numel():
                        raise ValueError(
                            f"shm alltoall_v: {cname}_displs[{q}] + {cname}_counts[{q}] = "
                            f"{displs[q] + counts[q]} exceeds {cname}.numel() = {t_.numel()}"
                        )
            if self._overlap(send, recv):
                raise ValueError("shm alltoall_v: send and recv must not overlap")
            t = self._deadline(timeout)
            d = self._desc(_shm.OP_ALLTOALL_V, dcode, -1, -1, 0, 0, ())
            if W == 1:
                if arrays[0][0] != arrays[2][0]:
                    raise CommError(
                        f"shm alltoall_v #{d[1]} on rank 0/1: rank 0 sends {arrays[0][0]} elements to "
                        f"rank 0 but expects {arrays[2][0]}"
                    )
                c = arrays[0][0]
                recv.view(-1)[arrays[3][0] : arrays[3][0] + c].copy_(
                    send.view(-1)[arrays[1][0] : arrays[1][0] + c]
                )
                return
            import array as _array

            mvs = [memoryview(_array.array("q", a)) for a in arrays]
            rc = eng.alltoall_v(
                d, send.data_ptr(), mvs[0], mvs[1], recv.data_ptr(), mvs[2], mvs[3], send.element_size(), t
            )
            if rc:
                self._raise(rc, "alltoall_v", d[1], t)
        except _ViewBits:
            self._resolved(
                self.alltoall_v,
                (send, send_counts, send_displs, recv, recv_counts, recv_displs, timeout),
                (3,),
            )

    def barrier(self, timeout: Optional[float] = None) -> None:
        """Return once every rank has entered the barrier.

        Example::

            comm.barrier(timeout=10.0)
        """
        if self._closed:  # inlined self._open(): a call less per op
            self._open("barrier")
        eng = self._engine
        t = self._deadline(timeout)
        d = self._desc(_shm.OP_BARRIER, -1, -1, -1, 0, 0, ())
        if self.world_size == 1:
            return
        rc = eng.barrier(d, t)
        if rc:
            self._raise(rc, "barrier", d[1], t)

    # ---------------------------------------------------------------------------- point to point
    def send(self, tensor: torch.Tensor, dst: int, timeout: Optional[float] = None) -> None:
        """Send ``tensor`` to rank ``dst`` (which calls :meth:`recv` with the same numel and dtype).

        Returns once the data is in the pair's buffers: messages up to two pair buffers
        (``pair_bytes`` each) do not wait for the receiver; larger ones wait until the receiver has
        taken all but the last two chunks. A size/dtype mismatch raises on the receiver at once and
        on the sender at its next send to that rank (or at once if it is still sending).

        Example::

            if rank == 0:
                comm.send(t, dst=1)
            else:
                comm.recv(t, src=0)
        """
        try:
            if self._closed:  # inlined self._open(): a call less per op
                self._open("send")
            eng = self._engine
            dcode = self._tensor("send", "tensor", tensor)[0]
            dst = self._check_rank("send", "dst", dst, allow_self=False)
            t = self._deadline(timeout)
            d = self._p2p_desc(dcode, tensor.numel(), tensor.shape)
            rc = eng.send(d, tensor.data_ptr(), tensor.numel() * tensor.element_size(), dst, t)
            if rc:
                self._raise(rc, "send", d[1], t, peer=dst)
        except _ViewBits:
            self._resolved(self.send, (tensor, dst, timeout), ())

    def recv(self, tensor: torch.Tensor, src: int, timeout: Optional[float] = None) -> None:
        """Receive into ``tensor`` the message rank ``src`` sends with :meth:`send` (FIFO per pair).

        Example::

            comm.recv(t, src=0)
        """
        try:
            if self._closed:  # inlined self._open(): a call less per op
                self._open("recv")
            eng = self._engine
            dcode = self._tensor("recv", "tensor", tensor)[0]
            src = self._check_rank("recv", "src", src, allow_self=False)
            t = self._deadline(timeout)
            d = self._p2p_desc(dcode, tensor.numel(), tensor.shape)
            rc = eng.recv(d, tensor.data_ptr(), tensor.numel() * tensor.element_size(), src, t)
            if rc:
                self._raise(rc, "recv", d[1], t, peer=src)
        except _ViewBits:
            self._resolved(self.recv, (tensor, src, timeout), (0,))

    # ---------------------------------------------------------------------------- lifetime
    def abort(self) -> None:
        """Set the shared abort word: every pending and later op on every rank raises CommError fast.

        Example::

            comm.abort()      # e.g. from an exception handler before exiting
        """
        if self._engine is not None and not self._closed:
            self._engine.abort()

    def close(self) -> None:
        """Unmap the segment (idempotent). Later calls raise ``CommError("... used after close")``."""
        if self._closed:
            return
        self._closed = True
        if self._saved_affinity is not None:
            try:
                os.sched_setaffinity(0, self._saved_affinity)
            except OSError as exc:
                log.warning("shm communicator %s: could not restore CPU affinity: %s", self.prefix, exc)
            self._saved_affinity = None
        if self._engine is not None:
            self._engine.close()

    def __enter__(self) -> ShmCommunicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"ShmCommunicator(rank={self.rank}, world_size={self.world_size}, prefix={self.prefix!r}, "
            f"{state})"
        )

    def shared_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``numel`` elements allocated in this rank's part of the shared segment.

        Needs ``heap_bytes`` at construction (per rank). Memory comes from a bump allocator
        (64-byte aligned) and is returned only with the communicator; the mapping stays valid while
        any such tensor is alive, also after :meth:`close`. An in-place :meth:`allreduce` of such a
        tensor (or of a view of it) above ``small_bytes`` is zero-copy: peers read it where it is
        and the reduced parts are written back in place (about half the CPU time and memory
        traffic); :meth:`broadcast` from such a tensor (root) and :meth:`allgather`/:meth:`gather`
        of one (send) are read in place too. Every other op copies them like any other tensor.

        Raises:
            CommError: the heap is exhausted (says how much is left) or the communicator is closed.

        Example::

            comm = ShmCommunicator(store, rank, world, prefix="tl/shm/g", heap_bytes=1 << 20)
            buf = comm.shared_empty(1000, torch.float32)
        """
        eng = self._open("shared_empty")
        if dtype not in _DTYPES:
            raise ValueError(f"shm shared_empty: unsupported dtype {dtype}")
        n = as_int(numel)
        if n is None or n < 0:
            raise ValueError(f"shm shared_empty: numel must be an int >= 0, got {numel!r}")
        numel = n
        es = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * es
        with self._heap_lock:
            off = self._heap_used
            if off + nbytes > eng.heap_bytes:
                raise CommError(
                    f"shm shared_empty: {nbytes} bytes requested, {eng.heap_bytes - off} of heap_bytes="
                    f"{eng.heap_bytes} left on rank {self.rank}; construct the communicator with a larger "
                    "heap_bytes"
                )
            self._heap_used = off + (nbytes + 63) // 64 * 64
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        buf = eng.heap_buffer(off, nbytes)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
