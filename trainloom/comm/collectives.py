"""Bagua's collective API (``bagua.torch_api.communication``), routed per tensor device.

Every function validates its arguments on the calling rank before any engine sees a tensor (type,
device, dtype, sizes, ranks, reduce op) and raises ``TypeError``/``ValueError`` naming the argument.
Differences *between* ranks (sizes, dtypes, ops, roots) are caught by the engines and raise
:class:`~trainloom.errors.CommError` on every rank with each rank's values. Non-contiguous tensors
are staged through a contiguous copy and the result is copied back into the caller's view.

Every collective takes ``async_op``: with ``True`` it returns a :class:`~trainloom.comm.work.Work`
(``wait(timeout=None)``, ``is_completed()``, ``result()``); otherwise it returns ``None`` once the
result is in place (CPU) or ordered before the current stream (CUDA).

Given ``comm=NON_COMM_MEMBER`` (what the group getters return on ranks outside a communicator, as
in Bagua), every collective returns at once: no argument check, no tensor touched, and with
``async_op=True`` an already completed Work.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch
import torch.distributed as dist

from trainloom.comm.env import as_int
from trainloom.comm.group import _STATE, NON_COMM_MEMBER, WORLD, Communicator, NonCommMember, _span
from trainloom.comm.ops import ReduceOp, divide_, writing
from trainloom.comm.work import CompletedWork, FutureWork, ThenWork, Work
from trainloom.errors import CommError

__all__ = [
    "ReduceOp",
    "allreduce",
    "allreduce_inplace",
    "broadcast",
    "reduce",
    "reduce_inplace",
    "allgather",
    "allgather_inplace",
    "gather",
    "gather_inplace",
    "scatter",
    "scatter_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "send",
    "recv",
    "barrier",
    "SUPPORTED_DTYPES",
]


#: torch.distributed.ReduceOp values (torch's numbering: SUM=0, AVG=1, PRODUCT=2, MIN=3, MAX=4, BAND=5,
#: BOR=6, BXOR=7) -> ours (Bagua's numbering). The two numberings overlap, and a torch value compares
#: equal to (and hashes like) its integer, so lookups must never mix torch values with ints.
_TORCH_TO_OURS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.BOR: ReduceOp.BOR,
    dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BXOR: ReduceOp.BXOR,
    dist.ReduceOp.AVG: ReduceOp.AVG,
}

#: dtypes every engine handles.
SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_SUPPORTED_SET = frozenset(SUPPORTED_DTYPES)
_BITWISE = (ReduceOp.BOR, ReduceOp.BAND, ReduceOp.BXOR)
_TORCH_OP_TYPE = type(dist.ReduceOp.SUM)  # torch's ReduceOp.RedOpType: not an int subclass
# (torch's stubs omit RedOpType.__int__ and ReduceOp instances' .op / .factor: hence the ignores.)
_TORCH_BY_INT = {int(k): v for k, v in _TORCH_TO_OURS.items()}  # type: ignore[call-overload]

#: The type of the ``comm`` argument of every collective.
CommArg = Union[None, Communicator, NonCommMember]


# --------------------------------------------------------------------------- validation
def _not_member(opname: str, async_op: bool, result: Any) -> Optional[Work]:
    """What a collective returns on a rank given ``NON_COMM_MEMBER``: nothing ran, nothing changed."""
    if not async_op:
        return None
    return CompletedWork(opname, result if isinstance(result, torch.Tensor) else None)


def _early_tensor(opname: str, send_tensor: Any, recv_tensor: Any, tensor: Any) -> Any:
    """``send_tensor``, or Bagua's early keyword ``tensor=`` (in place) standing for it."""
    if tensor is None:
        if send_tensor is None:
            raise TypeError(
                f"{opname}() missing its input tensor: pass send_tensor (or tensor=, Bagua's early name)"
            )
        return send_tensor
    if send_tensor is not None:
        raise TypeError(
            f"{opname}: got both send_tensor and tensor; tensor= is Bagua's early name for the in-place "
            "tensor, pass only one of them"
        )
    if recv_tensor is not None:
        raise TypeError(
            f"{opname}: tensor= is Bagua's early in-place form and takes no recv_tensor; "
            "write send_tensor=..., recv_tensor=... instead"
        )
    return tensor


def _is_comm(x: Any) -> bool:
    """Whether ``x`` is a communicator argument (Bagua's early positional ``comm``)."""
    return isinstance(x, Communicator) or x is NON_COMM_MEMBER or x is WORLD


def _comm(comm: object, opname: str) -> Communicator:
    if comm is None or comm is WORLD:
        pg = _STATE.default
        if pg is None:
            raise CommError(
                f"{opname}: the default process group is not initialized; call "
                "trainloom.comm.init_process_group() first (or pass comm=)"
            )
        comm = pg.global_communicator_unconnected()
    if not isinstance(comm, Communicator):
        raise TypeError(
            f"{opname}: comm must be a trainloom Communicator (group.get_global_communicator()), "
            f"got {type(comm).__name__}"
        )
    comm.check_alive(opname)
    return comm


# The checks below run on every call: they use the cheap tensor properties (is_cpu, is_cuda,
# get_device) rather than building torch.device objects, and cache op validation per (op, dtype).
def _tensor(t: Any, arg: str, opname: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{opname}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise TypeError(f"{opname}: {arg} must be a dense (strided) tensor, got layout {t.layout}")
    if not (t.is_cpu or t.is_cuda):
        raise ValueError(f"{opname}: {arg} is on {t.device}; collectives take CPU or CUDA tensors")
    if t.dtype not in _SUPPORTED_SET:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{opname}: {arg} has dtype {t.dtype}, which is not supported (supported: {names})")
    return t


def _same(a: torch.Tensor, b: torch.Tensor, an: str, bn: str, opname: str) -> None:
    if a is b:
        return
    if a.dtype is not b.dtype:
        raise TypeError(f"{opname}: {an} has dtype {a.dtype} but {bn} has {b.dtype}; they must match")
    if a.get_device() != b.get_device():  # -1 for CPU, the CUDA index otherwise
        raise ValueError(f"{opname}: {an} is on {a.device} but {bn} is on {b.device}; they must match")


def _numel(t: torch.Tensor, want: int, arg: str, opname: str, why: str) -> None:
    if t.numel() != want:
        raise ValueError(f"{opname}: {arg} has {t.numel()} elements, expected {want} ({why})")


def _rank_arg(value: Any, arg: str, comm: Communicator, opname: str) -> int:
    rank = as_int(value)
    if rank is None:
        raise TypeError(f"{opname}: {arg} must be an int rank, got {value!r}")
    value = rank
    if not 0 <= value < comm.nranks():
        raise ValueError(
            f"{opname}: {arg}={value} is outside the communicator's ranks 0..{comm.nranks() - 1} "
            f"(rank {comm.rank()} of {comm.name})"
        )
    return value


def _count_arg(value: Any, arg: str, opname: str) -> int:
    count = as_int(value)
    if count is None:
        raise TypeError(f"{opname}: {arg} must be an int, got {value!r}")
    value = count
    if value < 0:
        raise ValueError(f"{opname}: {arg}={value} must be >= 0")
    return value


# Keyed on the op's type too: torch's ReduceOp.MIN == 3 == ReduceOp.MAX (same hash), so an
# (op, dtype) key would let whichever came first decide the meaning of the other for good.
_OP_CACHE: Dict[Tuple[type, Any, torch.dtype], ReduceOp] = {}


def _op(op: Any, dtype: torch.dtype, opname: str) -> ReduceOp:
    key = (type(op), op, dtype)
    try:
        return _OP_CACHE[key]
    except (KeyError, TypeError):  # TypeError: an unhashable op, rejected below
        pass
    value = _check_op(op, dtype, opname)
    _OP_CACHE[key] = value  # only the types accepted above get here, all hashable
    return value


def _check_op(op: Any, dtype: torch.dtype, opname: str) -> ReduceOp:
    if isinstance(op, ReduceOp):
        value = op
    elif isinstance(op, _TORCH_OP_TYPE):  # by type first: its int is torch's numbering, not Bagua's
        mapped = _TORCH_BY_INT.get(int(op))  # type: ignore[call-overload]
        if mapped is None:
            raise TypeError(
                f"{opname}: op=torch.distributed.ReduceOp.{op.name} has no trainloom equivalent "
                "(use a trainloom.comm.ReduceOp)"
            )
        value = mapped
    elif isinstance(op, dist.ReduceOp):  # an instance: ReduceOp(ReduceOp.MAX), _make_nccl_premul_sum(f)
        if op.op == dist.ReduceOp.PREMUL_SUM:  # type: ignore[attr-defined]
            raise TypeError(
                f"{opname}: op=torch.distributed premul-sum (factor {op.factor!r}) has no trainloom "
                "equivalent: multiply the tensor by the factor and use ReduceOp.SUM"
            )
        return _check_op(op.op, dtype, opname)  # type: ignore[attr-defined]
    elif as_int(op) is not None:
        try:
            value = ReduceOp(int(op))
        except ValueError:
            raise ValueError(
                f"{opname}: op={op} is not a ReduceOp ("
                + ", ".join(f"{o.name}={o.value}" for o in ReduceOp)
                + ")"
            ) from None
    else:
        raise TypeError(f"{opname}: op must be a trainloom.comm.ReduceOp, got {op!r}")
    is_int = not dtype.is_floating_point and not dtype.is_complex
    if value in _BITWISE and not is_int:
        raise TypeError(f"{opname}: op={value.name} needs an integer or bool dtype, got {dtype}")
    if dtype.is_complex and value not in (ReduceOp.SUM, ReduceOp.AVG):
        raise TypeError(f"{opname}: op={value.name} is not defined for complex dtype {dtype}; use SUM or AVG")
    if value == ReduceOp.AVG and is_int:
        raise TypeError(
            f"{opname}: op=AVG needs a floating or complex dtype, got {dtype} (use SUM and divide)"
        )
    return value


def _op_like(x: Any) -> bool:
    """Whether ``x`` can only be a reduce op (Bagua's early positional ``op``), not a tensor."""
    return isinstance(x, (ReduceOp, _TORCH_OP_TYPE, dist.ReduceOp)) or as_int(x) is not None


def _counts(v: Any, arg: str, n: int, opname: str) -> List[int]:
    try:
        items = list(v)
    except TypeError:
        raise TypeError(f"{opname}: {arg} must be a sequence of {n} ints, got {v!r}") from None
    for i, x in enumerate(items):
        if as_int(x) is None:
            raise TypeError(
                f"{opname}: {arg} must be a sequence of {n} ints, got {v!r} "
                f"({arg}[{i}]={x!r} is a {type(x).__name__})"
            )
    out = [int(x) for x in items]
    if len(out) != n:
        raise ValueError(f"{opname}: {arg} has {len(out)} entries, expected {n} (one per rank)")
    if any(x < 0 for x in out):
        raise ValueError(f"{opname}: {arg} must be non-negative, got {out}")
    return out


def _check_v(
    counts: List[int],
    displs: List[int],
    size: int,
    carg: str,
    darg: str,
    targ: str,
    opname: str,
    disjoint: bool = False,
) -> None:
    """Every range ``[displs[i], displs[i] + counts[i])`` lies in the tensor; with ``disjoint`` (the
    receive side, where two ranks writing one element would make the result depend on timing) no two
    non-empty ranges share an element."""
    for i, (c, d) in enumerate(zip(counts, displs)):
        if d + c > size:
            raise ValueError(f"{opname}: {darg}[{i}]={d} + {carg}[{i}]={c} exceeds {targ}'s {size} elements")
    if not disjoint:
        return
    ranges = sorted((d, d + c, i) for i, (c, d) in enumerate(zip(counts, displs)) if c > 0)
    for (_, a_end, i), (b_start, _, j) in zip(ranges, ranges[1:]):
        if b_start < a_end:
            i, j = min(i, j), max(i, j)
            raise ValueError(
                f"{opname}: the {targ} ranges of ranks {i} and {j} overlap "
                f"({darg}[{i}]={displs[i]}, {carg}[{i}]={counts[i]}; {darg}[{j}]={displs[j]}, "
                f"{carg}[{j}]={counts[j]}); each rank's data needs its own elements"
            )


class _Staged:
    """Contiguous stand-ins for the caller's tensors; copies results back into non-contiguous outputs.

    A CPU tensor's values are copied into its stand-in when the operation starts (on the thread
    that runs it, after the earlier asynchronous operations it follows), not when it is issued:
    those operations may still write it, and waiting for them in the issuing thread blocked it
    (two ranks that each sent twice, the second time a view, before receiving hung).
    Conjugate and negative views (``z.conj()``, ``z.conj().imag``) are taken by their values on every
    engine: their memory holds the other sign, so they are staged like non-contiguous tensors (the
    gloo engine raised torch's internal error on them while the other ranks waited)."""

    __slots__ = ("_back", "_load", "_opname")

    def __init__(self, opname: str) -> None:
        self._back: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._load: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (stand-in, source) at the start
        self._opname = opname

    def _deferred(self, t: torch.Tensor) -> torch.Tensor:
        """A new contiguous tensor that takes ``t``'s values when the operation starts."""
        s = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        self._load.append((s, t))
        return s

    def input(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            return t
        if t.is_cpu:
            return self._deferred(t)
        return t.resolve_conj().resolve_neg().contiguous()  # CUDA: ordered by the stream

    def fill(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (a buffer the operation reads) when the operation starts."""
        if src.is_cpu:
            self._load.append((dst, src))
        else:
            dst.copy_(src)  # CUDA: ordered by the stream

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (an input that overlaps the output), taken when the operation starts."""
        return self._deferred(t) if t.is_cpu else t.clone()

    def output(self, t: torch.Tensor, load: bool = True, arg: str = "recv_tensor") -> torch.Tensor:
        if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            return t
        if torch._debug_has_internal_overlap(t) == 1:  # 1: yes (0: no, 2: too hard to tell)
            raise ValueError(
                f"{self._opname}: {arg} (shape {tuple(t.shape)}, stride {t.stride()}) has elements that "
                "share memory (e.g. made by expand()), so the results cannot be written to it; pass a "
                "tensor whose elements have their own memory (t.clone())"
            )
        if load and t.is_cpu:
            s = self._deferred(t)
        elif load:
            s = t.resolve_conj().resolve_neg().contiguous()
            if s.data_ptr() == t.data_ptr():  # contiguous already: the staging copy must not alias t
                s = s.clone()
        else:
            s = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        self._back.append((t, s))
        return s

    def sources(self) -> List[torch.Tensor]:
        """The caller's tensors behind the stand-ins: those read when the operation starts and those
        written back at its end (the stand-ins themselves are new memory nothing else uses)."""
        return [src for _, src in self._load] + [dst for dst, _ in self._back]

    def wrap(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``fn`` preceded by the deferred copies into the stand-ins."""
        if not self._load:
            return fn
        load = self._load

        def staged(engine: Any) -> Any:
            with torch.no_grad():
                for dst, src in load:
                    dst.copy_(src)  # copy_ takes a conjugate or negative view's values
            return fn(engine)

        return staged

    def finish(self) -> Optional[Callable[[], None]]:
        if not self._back:
            return None
        back = self._back

        def _copy_back() -> None:
            with torch.no_grad():
                for dst, src in back:
                    _write(dst, src)

        return _copy_back


def _go(
    comm: Communicator,
    opname: str,
    device: Union[str, torch.device],
    fn: Callable[[Any], Any],
    async_op: bool,
    result: Optional[torch.Tensor],
    staged: _Staged,
    keep: Sequence[torch.Tensor] = (),
    check: Optional[Tuple[Any, ...]] = None,
    p2p: Optional[str] = None,
    touches: Optional[Sequence[Any]] = None,
) -> Optional[Work]:
    """Issue ``fn`` on ``comm``. ``keep``: the tensors ``fn`` reads or writes (the caller's
    contiguous tensors, or stand-ins of ``staged``). On CPU the operation follows only the pending
    operations of the other kind (collectives for a send or receive, sends and receives for a
    collective) on memory it uses, and an asynchronous one is booked with that memory (see
    ``Communicator.execute``'s ``touches``): for a collective ``keep``, ``staged``'s sources and
    ``result`` unless ``touches`` names them (a rank that does not use an argument: reduce's and
    gather's output elsewhere than on ``dst``); for a send or receive (``p2p``) ``touches``, the
    caller's tensor."""
    if device != "cpu":
        return comm.execute(
            opname, device, staged.wrap(fn), async_op, result, staged.finish(), keep, check=check, p2p=p2p
        )
    if p2p is None and touches is None:
        touches = (*keep, *staged.sources(), result)
    return comm.execute(
        opname,
        device,
        staged.wrap(fn),
        async_op,
        result,
        staged.finish(),
        keep,
        check=check,
        p2p=p2p,
        touches=touches,
    )


# ------------------------------------------------------------ sends and receives beside collectives
# A CPU collective used to wait for every pending asynchronous send and receive on its communicator,
# so `w = recv(buf, 1, async_op=True); allreduce(x); w.wait()` on rank 0, against `allreduce(x);
# send(t, 0)` on rank 1, waited until the timeout (rank 0's allreduce for its receive, which waited
# for rank 1's send, which came after rank 1's allreduce); torch's gloo runs it. Both engines run
# sends and receives beside a collective, so a collective now waits only for the pending ones whose
# tensors share memory with its own: they still order a read after a write (recv into x, then
# allreduce(x) sums the received values) and a write after a read (send x, then allreduce(x) sends
# the values from before). Each communicator books its asynchronous CPU sends and receives with the
# address ranges they use (Communicator._p2p_book).
#
# The other direction is the same (Communicator._coll_book): every asynchronous CPU collective,
# composite step (_then, the neighbour gathers) and hierarchical fence is booked with the address
# ranges of the caller's tensors it reads or writes (staged sources included), and a send or receive
# follows only the booked ones that intersect its tensor (a send reads it, a receive writes it: both
# conflict with any overlap), besides the earlier operations of its own direction and peer. So `w =
# allreduce(x, async_op=True); send(t, 1); w.wait()` on rank 0 runs against `recv(buf, 0);
# allreduce(x)` on rank 1 (it waited until the timeout: the send waited for the allreduce, which
# waited for rank 1's, which came after rank 1's receive), while a send of x after an asynchronous
# allreduce(x) still sends the reduced values, and a receive into x after it does not overwrite x
# before the allreduce read it, nor is overwritten by its result.


def _where(t: torch.Tensor) -> Union[str, torch.device]:
    """``"cpu"`` (cheap), or the tensor's CUDA device."""
    return "cpu" if t.is_cpu else t.device


def _local(async_op: bool, result: Optional[torch.Tensor], body: Callable[[], None]) -> Optional[Work]:
    """World size 1: every collective is a copy or a no-op."""
    with torch.no_grad():
        body()
    return CompletedWork("local", result) if async_op else None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, also into a tensor made under ``torch.inference_mode()`` (an eval metric):
    torch refuses in-place updates of those outside inference mode, and the engines write them."""
    with writing(dst):
        dst.copy_(src)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if _same_view(dst, src):
        return
    src = src.reshape(dst.shape)
    _write(dst, src.clone() if _overlaps(src, dst) else src)


# --------------------------------------------------------------------------- reductions
def allreduce(
    send_tensor: Optional[torch.Tensor] = None,
    recv_tensor: Optional[torch.Tensor] = None,
    op: ReduceOp = ReduceOp.SUM,
    comm: CommArg = None,
    async_op: bool = False,
    hierarchical: bool = False,
    *,
    tensor: Optional[torch.Tensor] = None,
) -> Optional[Work]:
    """Reduce ``send_tensor`` over all ranks into ``recv_tensor`` (bitwise identical on every rank).

    Args:
        send_tensor: input.
        recv_tensor: output, same number of elements, dtype and device as ``send_tensor`` (may be
            ``send_tensor`` itself). Bagua's early in-place form ``allreduce(tensor, op, comm)`` is
            accepted too: without a tensor here the operation runs in place.
        op: a :class:`ReduceOp`.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a Work instead of blocking.
        hierarchical: reduce inside each node, allreduce between node leaders, then broadcast inside
            the node (``comm`` must be a global communicator).
        tensor: Bagua's early keyword for the in-place tensor (``allreduce(tensor=t)``): the same as
            ``send_tensor`` with no ``recv_tensor``. Giving it with either of them is a TypeError.

    Returns:
        None, or a Work when ``async_op``.

    Raises:
        TypeError, ValueError: bad arguments on this rank (named in the message).
        CommError: the ranks disagree (every rank raises, with both ranks' values) or a peer failed.
        CommTimeoutError: a peer did not arrive in time.

    Example::

        send = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
        recv = torch.zeros(2, dtype=torch.int64)
        allreduce(send, recv)            # recv == [4, 6] on both of 2 ranks
    """
    name = "allreduce"
    send_tensor = _early_tensor(name, send_tensor, recv_tensor, tensor)
    if not isinstance(recv_tensor, torch.Tensor) and (recv_tensor is None or _op_like(recv_tensor)):
        # Bagua's early API: allreduce(tensor, op=SUM, comm=None), in place.
        if recv_tensor is not None:
            if _is_comm(op) and comm is None:
                comm = op
            op = recv_tensor
        recv_tensor = send_tensor
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, recv_tensor)
    c = _comm(comm, name)
    s = _tensor(send_tensor, "send_tensor", name)
    r = _tensor(recv_tensor, "recv_tensor", name)
    _same(s, r, "send_tensor", "recv_tensor", name)
    _numel(r, s.numel(), "recv_tensor", name, "same as send_tensor")
    o = _op(op, s.dtype, name)
    if c.nranks() == 1:
        return _local(async_op, r, lambda: _copy(r, s))
    if hierarchical:
        return _hierarchical(c, s, r, o, async_op)
    st = _Staged(name)
    if _same_view(s, r):
        rc = st.output(r, load=True, arg="tensor")
        sc = rc
    else:
        sc = st.input(s)
        if _overlaps(sc, r):
            sc = st.copy_of(sc)
        rc = st.output(r, load=False)
    return _go(
        c, name, _where(s), lambda e: e.allreduce(sc, rc, int(o)), async_op, r, st, (sc, rc), (s, int(o))
    )


def allreduce_inplace(
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    comm: CommArg = None,
    async_op: bool = False,
    hierarchical: bool = False,
) -> Optional[Work]:
    """The in-place version of :func:`allreduce`.

    Args:
        tensor: input and output.
        op: a :class:`ReduceOp`.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.
        hierarchical: see :func:`allreduce`.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        t = torch.ones(4) * (get_rank() + 1)
        allreduce_inplace(t, ReduceOp.MAX)  # every rank: [world, ...]
    """
    return allreduce(tensor, tensor, op, comm, async_op, hierarchical)


_HALF = (torch.float16, torch.bfloat16)


def _hierarchical(
    c: Communicator, s: torch.Tensor, r: torch.Tensor, o: ReduceOp, async_op: bool
) -> Optional[Work]:
    """Reduce to the node leader (intra rank 0), combine the leaders, then fan out inside the node.

    AVG sums and divides by the world size on the leader before the broadcast; fp16/bf16 AVG sums
    in fp32 and rounds once, as the shared-memory engine does, so that an average that fits the dtype
    never overflows on the way. Asynchronous CPU calls queue each step on the communicator it uses
    (intra, inter, intra), each after the previous one, so every later call on the global, intra-
    or inter-node communicator is ordered after them on every rank.
    """
    if c.intra is None:
        raise ValueError(
            "allreduce(hierarchical=True): comm must be a process group's global communicator "
            f"(got {c.name}), which knows its intra- and inter-node communicators"
        )
    intra, inter, leader = c.intra, c.inter, c.is_inter_leader
    if inter is not None and inter.nranks() == 1:
        inter = None
    n = c.nranks()
    avg = o == ReduceOp.AVG
    wide = avg and s.dtype in _HALF  # accumulate in fp32
    sub = ReduceOp.SUM if avg else o

    def body() -> None:
        acc = s.detach().float() if wide else s
        out = acc if wide else r
        reduce(acc, out, 0, sub, comm=intra)
        if leader:
            if inter is not None:
                allreduce(out, out, sub, comm=inter)
            with torch.no_grad():
                if wide:
                    r.copy_(out.div_(n).reshape(r.shape))
                elif avg:
                    divide_(r, n)
        broadcast(r, 0, comm=intra)

    if s.device.type == "cuda":
        body()  # every step is enqueued on CUDA streams and ordered before the current stream
        return CompletedWork("allreduce(hierarchical)", r) if async_op else None
    if not async_op:
        # A synchronous call follows the asynchronous collectives issued before it (none when
        # called from inside a running operation), and the sends and receives on memory it uses.
        c.wait_pending(touches=(s, r))
        body()
        return None
    return _hierarchical_async(c, intra, inter, leader, s, r, sub, n, avg, wide)


def _hierarchical_async(
    c: Communicator,
    intra: Communicator,
    inter: Optional[Communicator],
    leader: bool,
    s: torch.Tensor,
    r: torch.Tensor,
    sub: ReduceOp,
    n: int,
    avg: bool,
    wide: bool,
) -> Work:
    """The CPU asynchronous hierarchical allreduce: three queued steps, each after the previous one."""
    name = "allreduce(hierarchical)"
    st = _Staged(name)
    out = st.output(r, load=False)  # contiguous r, or a staging tensor copied back by Work.wait()
    src = st.input(s)
    if not _same_view(src, out) and _overlaps(src, out):
        src = st.copy_of(src)
    acc = torch.empty(out.shape, dtype=torch.float32) if wide else out
    one = intra.nranks() == 1

    def prior(dep: Any, what: str) -> None:
        """Stop when the previous step failed: this step would run on wrong data."""
        exc = dep.exception()  # done: the step was queued after it
        if exc is not None:
            raise CommError(f"{name}: the {what} did not run because an earlier step failed: {exc}") from exc

    def fan_in(e: Any) -> None:
        with torch.no_grad():
            if wide:
                acc.copy_(src.reshape(acc.shape))
                if not one:
                    e.reduce(acc, acc, 0, int(sub))
            elif one:
                _copy(acc, src)
            else:
                e.reduce(src, acc, 0, int(sub))

    def across(dep: Any) -> Callable[[Any], None]:
        def step(e: Any) -> None:
            prior(dep, "inter-node allreduce")
            with torch.no_grad():
                e.allreduce(acc, acc, int(sub))

        return step

    def fan_out(dep: Any) -> Callable[[Any], None]:
        def step(e: Any) -> None:
            prior(dep, "intra-node broadcast")
            with torch.no_grad():
                if leader:
                    if wide:
                        out.copy_(acc.div_(n))
                    elif avg:
                        divide_(out, n)
                if not one:
                    e.broadcast(out, 0)

        return step

    cpu = "cpu"
    prior_ops = c.pending_futures(touches=(s, r))
    # Every step is booked with the caller's tensors (the staging and fp32 buffers are its own) on
    # the communicator it runs on, and the last one, as a fence, on the global and inter-node ones
    # (the inter-node step's own booking ends before the broadcast writes r): a later send or
    # receive on s or r, on any of them, waits for the whole operation; one on other memory does not.
    sp = (s, r)
    w = intra.execute(
        name, cpu, st.wrap(fan_in), True, None, after=prior_ops, needs_engine=not one, touches=sp
    )
    dep = w._future  # type: ignore[union-attr]
    if leader and inter is not None:
        w = inter.execute(name, cpu, across(dep), True, None, after=[dep], touches=sp)
        dep = w._future  # type: ignore[union-attr]
    # the copy into a non-contiguous output runs on the worker as the last step's end, as for flat calls
    w = intra.execute(
        name, cpu, fan_out(dep), True, None, st.finish(), after=[dep], needs_engine=not one, touches=sp
    )
    last = w._future  # type: ignore[union-attr]
    c.set_fence(last, sp)  # later calls on the global communicator wait for the whole operation
    if leader and inter is not None:
        inter.set_fence(last, sp)  # and those on the inter-node one, which ran only its middle step
    return FutureWork(name, last, r)


def reduce(
    send_tensor: Optional[torch.Tensor] = None,
    recv_tensor: Optional[torch.Tensor] = None,
    dst: Optional[int] = None,
    op: ReduceOp = ReduceOp.SUM,
    comm: CommArg = None,
    async_op: bool = False,
    *,
    tensor: Optional[torch.Tensor] = None,
) -> Optional[Work]:
    """Reduce over all ranks; only rank ``dst`` receives the result, in ``recv_tensor``.

    Args:
        send_tensor: input.
        recv_tensor: output on ``dst`` (same number of elements as ``send_tensor``); not written on
            other ranks. Bagua's early in-place form ``reduce(tensor, dst, op, comm)`` is accepted too.
        dst: destination rank in the communicator.
        op: a :class:`ReduceOp`.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.
        tensor: Bagua's early keyword for the in-place tensor (``reduce(tensor=t, dst=0)``): the same
            as ``send_tensor`` with no ``recv_tensor``. Giving it with either of them is a TypeError.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        out = torch.zeros(4)
        reduce(torch.ones(4), out, dst=0)  # rank 0: [world] * 4; others: unchanged
    """
    name = "reduce"
    send_tensor = _early_tensor(name, send_tensor, recv_tensor, tensor)
    if not isinstance(recv_tensor, torch.Tensor):
        if as_int(recv_tensor) is not None:
            # Bagua's early API, positionally: reduce(tensor, dst, op=SUM, comm=None), in place.
            # (The arguments shift by one place: each is checked below for what it now holds.)
            if dst is not None:
                if _is_comm(op) and comm is None:
                    comm = cast(CommArg, op)
                op = cast(ReduceOp, dst)
            dst, recv_tensor = cast(int, recv_tensor), send_tensor
        elif recv_tensor is None:  # reduce(tensor, dst=...): the early form by keyword
            recv_tensor = send_tensor
    if dst is None:
        raise TypeError("reduce: dst (the destination rank) is required")
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, recv_tensor)
    c = _comm(comm, name)
    s = _tensor(send_tensor, "send_tensor", name)
    r = _tensor(recv_tensor, "recv_tensor", name)
    _same(s, r, "send_tensor", "recv_tensor", name)
    _numel(r, s.numel(), "recv_tensor", name, "same as send_tensor")
    d = _rank_arg(dst, "dst", c, name)
    o = _op(op, s.dtype, name)
    if c.nranks() == 1:
        return _local(async_op, r, lambda: _copy(r, s))
    st = _Staged(name)
    sc = st.input(s)
    if c.rank() == d:
        same = _same_view(s, r)
        rc = st.output(r, load=same)
        if same:
            sc = rc
        elif _overlaps(sc, r):
            sc = st.copy_of(sc)
        touches = None
    else:
        # recv_tensor is neither read nor written here (both engines): not booked, so that a send
        # or receive of it issued meanwhile does not wait for this reduce (torch's gloo runs that)
        rc = r if r.is_contiguous() else torch.empty(r.shape, dtype=r.dtype, device=r.device)
        touches = (sc, *st.sources())
    return _go(
        c,
        name,
        _where(s),
        lambda e: e.reduce(sc, rc, d, int(o)),
        async_op,
        r,
        st,
        (sc, rc),
        (s, int(o), d),
        touches=touches,
    )


def reduce_inplace(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    comm: CommArg = None,
    async_op: bool = False,
) -> Optional[Work]:
    """The in-place version of :func:`reduce` (the tensor of non-``dst`` ranks is left unchanged).

    Args:
        tensor: input, and output on ``dst``.
        dst: destination rank.
        op: a :class:`ReduceOp`.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        t = torch.ones(4)
        reduce_inplace(t, dst=0, op=ReduceOp.SUM)
    """
    return reduce(tensor, tensor, dst, op, comm, async_op)


def reduce_scatter(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    comm: CommArg = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Reduce ``send_tensor`` over all ranks and give rank ``i`` the ``i``-th chunk, in ``recv_tensor``.

    Args:
        send_tensor: input, ``nranks * recv_tensor.numel()`` elements.
        recv_tensor: output chunk.
        op: a :class:`ReduceOp`.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        out = torch.zeros(2)
        reduce_scatter(torch.ones(2 * get_world_size()), out)  # [world, world]
    """
    name = "reduce_scatter"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, recv_tensor)
    c = _comm(comm, name)
    s = _tensor(send_tensor, "send_tensor", name)
    r = _tensor(recv_tensor, "recv_tensor", name)
    _same(s, r, "send_tensor", "recv_tensor", name)
    n = c.nranks()
    _numel(s, n * r.numel(), "send_tensor", name, f"nranks={n} * recv_tensor's {r.numel()}")
    o = _op(op, s.dtype, name)
    if n == 1:
        return _local(async_op, r, lambda: _copy(r, s))
    return _reduce_scatter_staged(c, name, s, r, o, async_op, _Staged(name), r)


def _reduce_scatter_staged(
    c: Communicator,
    name: str,
    s: torch.Tensor,
    r: torch.Tensor,
    o: ReduceOp,
    async_op: bool,
    st: _Staged,
    result: torch.Tensor,
) -> Optional[Work]:
    """:func:`reduce_scatter` of checked arguments, staged by ``st`` (which an in-place form may
    have given a stand-in for its tensor already); the Work's result is ``result``."""
    sc = st.input(s)
    if _overlaps(sc, r):  # e.g. into a chunk of its own send buffer (other chunks are still read)
        sc = st.copy_of(sc)
    rc = st.output(r, load=False)
    return _go(
        c,
        name,
        _where(s),
        lambda e: e.reduce_scatter(sc, rc, int(o)),
        async_op,
        result,
        st,
        (sc, rc),
        (r, int(o)),
    )


def reduce_scatter_inplace(
    tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    comm: CommArg = None,
    async_op: bool = False,
) -> Optional[Work]:
    """In-place :func:`reduce_scatter`: rank ``i``'s result lands in chunk ``i`` of ``tensor``.

    Args:
        tensor: input, and output at chunk ``rank``; ``numel`` divisible by ``nranks``.
        op: a :class:`ReduceOp`.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        ValueError: ``tensor.numel()`` is not divisible by ``nranks``.

    Example::

        t = torch.ones(2 * get_world_size())
        reduce_scatter_inplace(t)  # t[2*rank : 2*rank+2] == world
    """
    name = "reduce_scatter_inplace"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, tensor)
    c = _comm(comm, name)
    t = _tensor(tensor, "tensor", name)
    n = c.nranks()
    if t.numel() % n:
        raise ValueError(f"{name}: tensor has {t.numel()} elements, not divisible by nranks={n}")
    k = t.numel() // n
    me = c.rank()
    o = _op(op, t.dtype, name)
    if n == 1:
        return _local(async_op, t, lambda: None)
    # A non-contiguous tensor gets a contiguous stand-in that takes its values when the operation
    # starts and is written back at its end. Either way the send buffer holds the output chunk, so
    # reduce_scatter copies it when the operation starts too: nothing is copied here, in the issuing
    # thread, where the copy would first have to wait for the earlier asynchronous operations.
    st = _Staged(name)
    flat = st.output(t, arg="tensor").view(-1)
    return _reduce_scatter_staged(c, name, flat, flat[me * k : (me + 1) * k], o, async_op, st, t)


def _then(
    comm: Communicator,
    work: Optional[Work],
    after: Callable[[], None],
    async_op: bool,
    result: Optional[torch.Tensor],
    op_name: Optional[str] = None,
    touches: Optional[Sequence[torch.Tensor]] = None,
) -> Optional[Work]:
    """Run ``after`` (local copies or arithmetic into the results) once ``work`` completed.

    A CPU operation (a :class:`FutureWork`) runs ``after`` as the next operation of ``comm``'s worker,
    so the results are complete when ``is_completed()`` says so, before any later collective on
    ``comm`` and at destroy, without a ``wait()``, as the operation itself is; it runs in the issuing
    thread's inference mode (tensors made under ``torch.inference_mode()`` can only be updated in
    it). A CUDA operation runs ``after`` in ``wait()``. ``op_name`` names the returned Work
    (default: ``work``'s). ``touches``: the caller's tensors ``after`` writes besides ``result``;
    the step then follows only the pending sends and receives on memory they (or ``result``) use,
    and later sends and receives wait for it only when they use that memory. None: it follows every
    pending send and receive, and every later one follows it (its memory is unknown).
    """
    if work is None or isinstance(work, CompletedWork):
        after()
        return CompletedWork(op_name or "local", result) if async_op else None
    if not async_op:
        work.wait()
        after()
        return None
    if isinstance(work, FutureWork):
        inference = torch.is_inference_mode_enabled()

        def then(_engine: Any) -> None:
            try:
                work.wait()  # done already (the worker runs operations in order); re-raises its error
            except CommError as exc:
                if op_name and op_name != work.op_name and exc.args and isinstance(exc.args[0], str):
                    # name the call the user made, before the engine's step (e.g. its allgather)
                    exc.args = (f"{op_name}: {exc.args[0]}",) + tuple(exc.args[1:])
                raise
            with torch.inference_mode(inference):
                after()

        name = op_name or work.op_name
        mem = None if touches is None else (*touches, result)
        return comm.execute(name, "cpu", then, True, result, needs_engine=False, touches=mem)
    return ThenWork(op_name or work.op_name, work, after, result)


# --------------------------------------------------------------------------- data movement
def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    comm: CommArg = None,
    async_op: bool = False,
    *,
    root: Optional[int] = None,
) -> Optional[Work]:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank.

    Args:
        tensor: data on ``src``, output elsewhere; same number of elements on every rank.
        src: source rank. Default 0.
        root: Bagua's early name for ``src``; when given it wins.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        w = torch.randn(3) if get_rank() == 0 else torch.zeros(3)
        broadcast(w, src=0)
    """
    name = "broadcast"
    if root is not None:
        src = root
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, tensor)
    c = _comm(comm, name)
    t = _tensor(tensor, "tensor", name)
    s = _rank_arg(src, "src", c, name)
    if c.nranks() == 1:
        return _local(async_op, t, lambda: None)
    st = _Staged(name)
    tc = st.output(t, load=c.rank() == s, arg="tensor")
    return _go(c, name, _where(t), lambda e: e.broadcast(tc, s), async_op, t, st, (tc,), (t, -1, s))


def allgather(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    comm: CommArg = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Gather every rank's ``send_tensor`` into ``recv_tensor`` (in rank order) on every rank.

    Args:
        send_tensor: input.
        recv_tensor: output with ``nranks * send_tensor.numel()`` elements.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        out = torch.zeros(3 * get_world_size())
        allgather(torch.full((3,), float(get_rank())), out)  # [0,0,0, 1,1,1, ...]
    """
    name = "allgather"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, recv_tensor)
    c = _comm(comm, name)
    s = _tensor(send_tensor, "send_tensor", name)
    r = _tensor(recv_tensor, "recv_tensor", name)
    _same(s, r, "send_tensor", "recv_tensor", name)
    n = c.nranks()
    _numel(r, n * s.numel(), "recv_tensor", name, f"nranks={n} * send_tensor's {s.numel()}")
    if n == 1:
        return _local(async_op, r, lambda: _copy(r, s))
    return _allgather_staged(c, name, s, r, async_op, _Staged(name), r)


def _allgather_staged(
    c: Communicator,
    name: str,
    s: torch.Tensor,
    r: torch.Tensor,
    async_op: bool,
    st: _Staged,
    result: torch.Tensor,
) -> Optional[Work]:
    """:func:`allgather` of checked arguments, staged by ``st`` (see :func:`_reduce_scatter_staged`)."""
    sc = st.input(s)
    if _overlaps(sc, r):
        sc = st.copy_of(sc)
    rc = st.output(r, load=False)
    return _go(c, name, _where(s), lambda e: e.allgather(sc, rc), async_op, result, st, (sc, rc), (s,))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory ranges of ``a`` and ``b`` intersect (a conservative test for aliasing)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + _span(b) and b0 < a0 + _span(a)


def allgather_inplace(tensor: torch.Tensor, comm: CommArg = None, async_op: bool = False) -> Optional[Work]:
    """In-place :func:`allgather`: rank ``i``'s input is chunk ``i`` of ``tensor``.

    Args:
        tensor: input at chunk ``rank``, output everywhere; ``numel`` divisible by ``nranks``.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        ValueError: ``tensor.numel()`` is not divisible by ``nranks``.

    Example::

        t = torch.zeros(2 * get_world_size())
        t[2 * get_rank() : 2 * get_rank() + 2] = get_rank()
        allgather_inplace(t)
    """
    name = "allgather_inplace"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, tensor)
    c = _comm(comm, name)
    t = _tensor(tensor, "tensor", name)
    n = c.nranks()
    if t.numel() % n:
        raise ValueError(f"{name}: tensor has {t.numel()} elements, not divisible by nranks={n}")
    k = t.numel() // n
    me = c.rank()
    if n == 1:
        return _local(async_op, t, lambda: None)
    # This rank's chunk of the tensor (or of its stand-in, see reduce_scatter_inplace) is sent from
    # inside the output: allgather copies it when the operation starts, none is made here.
    st = _Staged(name)
    whole = st.output(t, arg="tensor")
    return _allgather_staged(c, name, whole.view(-1)[me * k : (me + 1) * k], whole, async_op, st, t)


def gather(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    dst: int,
    comm: CommArg = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Gather every rank's ``send_tensor`` into ``recv_tensor`` on rank ``dst``.

    Args:
        send_tensor: input.
        recv_tensor: output on ``dst`` with ``nranks * send_tensor.numel()`` elements (ignored elsewhere).
        dst: destination rank.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        out = torch.zeros(get_world_size())
        gather(torch.tensor([float(get_rank())]), out, dst=0)  # rank 0: [0, 1, ...]
    """
    name = "gather"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, recv_tensor)
    c = _comm(comm, name)
    s = _tensor(send_tensor, "send_tensor", name)
    d = _rank_arg(dst, "dst", c, name)
    n = c.nranks()
    if c.rank() == d:
        r = _tensor(recv_tensor, "recv_tensor", name)
        _same(s, r, "send_tensor", "recv_tensor", name)
        _numel(r, n * s.numel(), "recv_tensor", name, f"nranks={n} * send_tensor's {s.numel()}")
        if n == 1:
            return _local(async_op, r, lambda: _copy(r, s))
    else:
        r = recv_tensor if isinstance(recv_tensor, torch.Tensor) else None
    return _gather_staged(c, name, s, r, d, async_op, _Staged(name), r)


def _gather_staged(
    c: Communicator,
    name: str,
    s: torch.Tensor,
    r: Optional[torch.Tensor],
    d: int,
    async_op: bool,
    st: _Staged,
    result: Optional[torch.Tensor],
) -> Optional[Work]:
    """:func:`gather` of checked arguments (``r`` is used on ``d`` only), staged by ``st`` (see
    :func:`_reduce_scatter_staged`)."""
    sc = st.input(s)
    touches = None
    if c.rank() == d and r is not None:
        if _overlaps(sc, r):
            sc = st.copy_of(sc)
        rc = st.output(r, load=False)
    else:
        rc = torch.empty(0, dtype=s.dtype, device=s.device)
        touches = (sc, *st.sources())  # recv_tensor (the result) is not used here: not booked
    return _go(
        c,
        name,
        _where(s),
        lambda e: e.gather(sc, rc, d),
        async_op,
        result,
        st,
        (sc, rc),
        (s, -1, d),
        touches=touches,
    )


def gather_inplace(
    tensor: torch.Tensor, count: int, dst: int, comm: CommArg = None, async_op: bool = False
) -> Optional[Work]:
    """In-place :func:`gather`.

    Args:
        tensor: on ``dst``: ``nranks * count`` elements, its own input at chunk ``dst``; elsewhere
            ``count`` elements.
        count: elements per rank.
        dst: destination rank.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        t = torch.zeros(2 * get_world_size()) if get_rank() == 0 else torch.ones(2)
        gather_inplace(t, count=2, dst=0)
    """
    name = "gather_inplace"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, tensor)
    c = _comm(comm, name)
    t = _tensor(tensor, "tensor", name)
    k = _count_arg(count, "count", name)
    d = _rank_arg(dst, "dst", c, name)
    n = c.nranks()
    if c.rank() == d:
        _numel(t, n * k, "tensor", name, f"on dst: nranks={n} * count={k}")
        if n == 1:
            return _local(async_op, t, lambda: None)
        # (copied when the operation starts, as in allgather_inplace)
        st = _Staged(name)
        whole = st.output(t, arg="tensor")
        return _gather_staged(c, name, whole.view(-1)[d * k : (d + 1) * k], whole, d, async_op, st, t)
    _numel(t, k, "tensor", name, "count, on ranks other than dst")
    return gather(t, t, d, c, async_op)


def scatter(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    src: int,
    comm: CommArg = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Give rank ``i`` chunk ``i`` of ``send_tensor`` on rank ``src``.

    Args:
        send_tensor: on ``src``, ``nranks * recv_tensor.numel()`` elements (ignored elsewhere).
        recv_tensor: output.
        src: source rank.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        out = torch.zeros(2)
        scatter(torch.arange(2.0 * get_world_size()), out, src=0)  # rank r: [2r, 2r+1]
    """
    name = "scatter"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, recv_tensor)
    c = _comm(comm, name)
    r = _tensor(recv_tensor, "recv_tensor", name)
    sr = _rank_arg(src, "src", c, name)
    n = c.nranks()
    if c.rank() == sr:
        s = _tensor(send_tensor, "send_tensor", name)
        _same(s, r, "send_tensor", "recv_tensor", name)
        _numel(s, n * r.numel(), "send_tensor", name, f"nranks={n} * recv_tensor's {r.numel()}")
        if n == 1:
            return _local(async_op, r, lambda: _copy(r, s))
    else:
        s = None
    return _scatter_staged(c, name, s, r, sr, async_op, _Staged(name))


def _scatter_staged(
    c: Communicator,
    name: str,
    s: Optional[torch.Tensor],
    r: torch.Tensor,
    sr: int,
    async_op: bool,
    st: _Staged,
    result: Optional[torch.Tensor] = None,
) -> Optional[Work]:
    """:func:`scatter` of checked arguments (``s`` is used on ``sr`` only), staged by ``st`` (see
    :func:`_reduce_scatter_staged`); the Work's ``result()`` is ``result``, by default ``r``."""
    if c.rank() == sr and s is not None:
        sc = st.input(s)
        if _overlaps(sc, r):
            sc = st.copy_of(sc)
    else:
        sc = torch.empty(0, dtype=r.dtype, device=r.device)
    rc = st.output(r, load=False)
    out = r if result is None else result
    return _go(c, name, _where(r), lambda e: e.scatter(sc, rc, sr), async_op, out, st, (sc, rc), (r, -1, sr))


def scatter_inplace(
    tensor: torch.Tensor, count: int, src: int, comm: CommArg = None, async_op: bool = False
) -> Optional[Work]:
    """In-place :func:`scatter`.

    Args:
        tensor: on ``src``: ``nranks * count`` elements (its own chunk stays at chunk ``src``);
            elsewhere ``count`` elements, the output.
        count: elements per rank.
        src: source rank.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        t = torch.arange(2.0 * get_world_size()) if get_rank() == 0 else torch.zeros(2)
        scatter_inplace(t, count=2, src=0)
    """
    name = "scatter_inplace"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, tensor)
    c = _comm(comm, name)
    t = _tensor(tensor, "tensor", name)
    k = _count_arg(count, "count", name)
    s = _rank_arg(src, "src", c, name)
    n = c.nranks()
    if c.rank() == s:
        _numel(t, n * k, "tensor", name, f"on src: nranks={n} * count={k}")
        if n == 1:
            return _local(async_op, t, lambda: None)
        # Rank src's chunk is already in place: the engine writes it into a scratch chunk, and the
        # Work's result() is still the caller's tensor.
        own = torch.empty(k, dtype=t.dtype, device=t.device)
        return _scatter_staged(c, name, t, own, s, async_op, _Staged(name), result=t)
    _numel(t, k, "tensor", name, "count, on ranks other than src")
    return scatter(t, t, s, c, async_op)


def alltoall(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    comm: CommArg = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Send chunk ``j`` of ``send_tensor`` to rank ``j``; receive from rank ``i`` into chunk ``i``.

    Args:
        send_tensor: input, ``numel`` divisible by ``nranks``.
        recv_tensor: output, same number of elements.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        out = torch.zeros(get_world_size())
        alltoall(torch.full((get_world_size(),), float(get_rank())), out)  # [0, 1, ...]
    """
    name = "alltoall"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, recv_tensor)
    c = _comm(comm, name)
    s = _tensor(send_tensor, "send_tensor", name)
    r = _tensor(recv_tensor, "recv_tensor", name)
    _same(s, r, "send_tensor", "recv_tensor", name)
    n = c.nranks()
    if s.numel() % n:
        raise ValueError(f"{name}: send_tensor has {s.numel()} elements, not divisible by nranks={n}")
    _numel(r, s.numel(), "recv_tensor", name, "same as send_tensor")
    if n == 1:
        return _local(async_op, r, lambda: _copy(r, s))
    st = _Staged(name)
    sc = st.input(s)
    if _overlaps(sc, r):
        sc = st.copy_of(sc)
    rc = st.output(r, load=False)
    return _go(c, name, _where(s), lambda e: e.alltoall(sc, rc), async_op, r, st, (sc, rc), (s,))


def alltoall_inplace(tensor: torch.Tensor, comm: CommArg = None, async_op: bool = False) -> Optional[Work]:
    """The in-place version of :func:`alltoall`.

    Args:
        tensor: input and output, ``numel`` divisible by ``nranks``.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        t = torch.full((get_world_size(),), float(get_rank()))
        alltoall_inplace(t)
    """
    if comm is NON_COMM_MEMBER:
        return _not_member("alltoall_inplace", async_op, tensor)
    t = _tensor(tensor, "tensor", "alltoall_inplace")
    return alltoall(t.detach(), tensor, comm, async_op)  # the input is copied when the operation starts


def alltoall_v(
    send_tensor: torch.Tensor,
    send_counts: Sequence[int],
    send_displs: Sequence[int],
    recv_tensor: torch.Tensor,
    recv_counts: Sequence[int],
    recv_displs: Sequence[int],
    comm: CommArg = None,
    async_op: bool = False,
) -> Optional[Work]:
    """All-to-all with per-rank counts and displacements (in elements).

    Args:
        send_tensor: input.
        send_counts: elements sent to each rank (``nranks`` entries).
        send_displs: where each rank's data starts in ``send_tensor``.
        recv_tensor: output.
        recv_counts: elements received from each rank; must equal what that rank sends here.
        recv_displs: where each rank's data lands in ``recv_tensor``.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        # 2 ranks: rank 0 sends 1 element to itself and 2 to rank 1; rank 1 sends 2 and 1
        sc = [1, 2] if get_rank() == 0 else [2, 1]
        rc = [1, 2] if get_rank() == 0 else [2, 1]
        alltoall_v(send, sc, [0, sc[0]], recv, rc, [0, rc[0]])
    """
    name = "alltoall_v"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, recv_tensor)
    c = _comm(comm, name)
    s = _tensor(send_tensor, "send_tensor", name)
    r = _tensor(recv_tensor, "recv_tensor", name)
    _same(s, r, "send_tensor", "recv_tensor", name)
    n = c.nranks()
    sc_ = _counts(send_counts, "send_counts", n, name)
    sd_ = _counts(send_displs, "send_displs", n, name)
    rc_ = _counts(recv_counts, "recv_counts", n, name)
    rd_ = _counts(recv_displs, "recv_displs", n, name)
    _check_v(sc_, sd_, s.numel(), "send_counts", "send_displs", "send_tensor", name)
    _check_v(rc_, rd_, r.numel(), "recv_counts", "recv_displs", "recv_tensor", name, disjoint=True)
    if n == 1:
        if sc_[0] != rc_[0]:
            raise ValueError(f"{name}: send_counts[0]={sc_[0]} != recv_counts[0]={rc_[0]} with one rank")

        def body() -> None:
            vals = s.reshape(-1)[sd_[0] : sd_[0] + sc_[0]].clone()
            full = r if r.is_contiguous() else r.contiguous()
            full.view(-1)[rd_[0] : rd_[0] + rc_[0]] = vals
            if full is not r:
                r.copy_(full)

        return _local(async_op, r, body)
    st = _Staged(name)
    sc = st.input(s)
    if _overlaps(sc, r):
        sc = st.copy_of(sc)
    rc = st.output(r, load=True)  # untouched regions keep their values
    return _go(
        c,
        name,
        _where(s),
        lambda e: e.alltoall_v(sc, sc_, sd_, rc, rc_, rd_),
        async_op,
        r,
        st,
        (sc, rc),
        (s, -1, -1, 0, (sc_, rc_)),
    )


def alltoall_v_inplace(
    tensor: torch.Tensor,
    counts: Sequence[int],
    displs: Sequence[int],
    comm: CommArg = None,
    async_op: bool = False,
) -> Optional[Work]:
    """The in-place version of :func:`alltoall_v` (the same counts and displacements both ways).

    Args:
        tensor: input and output.
        counts: elements exchanged with each rank.
        displs: where each rank's block starts.
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        alltoall_v_inplace(t, [2] * get_world_size(), [2 * j for j in range(get_world_size())])
    """
    if comm is NON_COMM_MEMBER:
        return _not_member("alltoall_v_inplace", async_op, tensor)
    t = _tensor(tensor, "tensor", "alltoall_v_inplace")
    # the input is copied when the operation starts
    return alltoall_v(t.detach(), counts, displs, tensor, counts, displs, comm, async_op)


# --------------------------------------------------------------------------- point to point, barrier
def send(tensor: torch.Tensor, dst: int, comm: CommArg = None, async_op: bool = False) -> Optional[Work]:
    """Send ``tensor`` to rank ``dst``, which must call :func:`recv` with the same dtype and size.

    Args:
        tensor: the data.
        dst: destination rank (not this rank).
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op``.

    Raises:
        ValueError: ``dst`` is this rank or outside the communicator.

    .. warning:: on CPU a send follows the earlier sends to ``dst``, and the pending asynchronous
       collectives only when their tensors share memory with ``tensor`` (then it sends their
       results: ``w = allreduce_inplace(x, async_op=True); send(x, 1)`` sends the sum), so
       ``w = allreduce(x, async_op=True); send(t, 1); w.wait()`` runs against ``recv(buf, 0);
       allreduce(x)`` on rank 1. A later collective waits for an asynchronous send only when their
       tensors share memory (then it cannot overwrite what is being sent). Messages to one peer
       arrive in issue order.

    Example::

        if get_rank() == 0:
            send(torch.ones(3), dst=1)
        elif get_rank() == 1:
            recv(buf, src=0)
    """
    name = "send"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, None)
    c = _comm(comm, name)
    t = _tensor(tensor, "tensor", name)
    d = _rank_arg(dst, "dst", c, name)
    if d == c.rank():
        raise ValueError(f"{name}: dst={d} is this rank; send to another rank")
    st = _Staged(name)
    tc = st.input(t)
    return _go(
        c, name, _where(t), lambda e: e.send(tc, d), async_op, None, st, (tc,), p2p=f"send:{d}", touches=(t,)
    )


def recv(tensor: torch.Tensor, src: int, comm: CommArg = None, async_op: bool = False) -> Optional[Work]:
    """Receive into ``tensor`` from rank ``src``.

    Args:
        tensor: output; dtype and size must match the sender's tensor.
        src: source rank (not this rank).
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op`` (its ``result()`` is the output tensor).

    Raises:
        ValueError: ``src`` is this rank or outside the communicator.

    .. warning:: on CPU a receive follows the earlier receives from ``src``, and the pending
       asynchronous collectives only when their tensors share memory with ``tensor`` (then they
       read its old values and it overwrites their results), so ``w = allreduce(x,
       async_op=True); recv(buf, 1); w.wait()`` runs against ``send(t, 0); allreduce(x)`` on rank
       1. A later collective waits for an asynchronous receive only when their tensors share memory
       (then it reads the received values), so ``w = recv(buf, 1, async_op=True); allreduce(x);
       w.wait()`` runs against ``allreduce(x); send(t, 0)`` on rank 1. Call ``w.wait()`` before
       reading ``buf`` yourself.

    Example::

        buf = torch.zeros(3)
        recv(buf, src=0)
    """
    name = "recv"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, tensor)
    c = _comm(comm, name)
    t = _tensor(tensor, "tensor", name)
    s = _rank_arg(src, "src", c, name)
    if s == c.rank():
        raise ValueError(f"{name}: src={s} is this rank; receive from another rank")
    st = _Staged(name)
    tc = st.output(t, load=False, arg="tensor")
    return _go(
        c, name, _where(t), lambda e: e.recv(tc, s), async_op, t, st, (tc,), p2p=f"recv:{s}", touches=(t,)
    )


def barrier(comm: CommArg = None, async_op: bool = False) -> Optional[Work]:
    """Block until every rank of the communicator reached the barrier (runs on the CPU engine).

    Args:
        comm: the communicator; None means the default group's global communicator.
        async_op: return a :class:`~trainloom.comm.work.Work` instead of blocking.

    Returns:
        None, or a Work when ``async_op``.

    Raises:
        TypeError, ValueError: a bad argument on this rank (named in the message).
        CommError: the ranks disagree (raised on every rank) or a peer failed; CommTimeoutError on timeout.

    Example::

        barrier()
    """
    name = "barrier"
    if comm is NON_COMM_MEMBER:
        return _not_member(name, async_op, None)
    c = _comm(comm, name)
    if c.nranks() == 1:
        return _local(async_op, None, lambda: None)
    return _go(c, name, "cpu", lambda e: e.barrier(), async_op, None, _Staged(name))
