"""Broadcast model parameters and optimizer state from one rank (Bluefog's / Horovod's helpers).

* :func:`broadcast_parameters` takes a ``state_dict()``, ``named_parameters()``, a dict or a list of
  tensors and overwrites them, in place, with the root rank's values.
* :func:`broadcast_optimizer_state` makes every rank's optimizer equal the root's: hyper-parameters
  (``lr``, ``betas``, ...), tensor state and scalar state (``step``), also when this rank's state is
  still empty (before the first step) and the root's is not, e.g. after the root loaded a checkpoint.

Both first check that every rank holds the same layout (names, shapes, dtypes, or the optimizer's
class, parameter groups and parameter shapes) and raise :class:`~trainloom.errors.CommError` on every
rank otherwise, with the same message naming the first difference; nothing is changed then.
Tensors are flattened into one buffer per dtype and device, so a model costs one broadcast per
dtype rather than one per tensor.

Example::

    model = torch.nn.Linear(4, 2)
    broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.Adam(model.parameters())
    broadcast_optimizer_state(opt, root_rank=0)
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from trainloom.comm import collectives as _core
from trainloom.comm.env import as_int
from trainloom.comm.group import Communicator, ProcessGroup
from trainloom.comm.topology import resolve_comm
from trainloom.errors import CommError

logger = logging.getLogger("trainloom.comm")

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object"]

CommArg = Union[None, Communicator, ProcessGroup]


def _root(root_rank: Any, c: Communicator, opname: str) -> int:
    r = as_int(root_rank)
    if r is None:
        raise TypeError(f"{opname}: root_rank must be an int, got {root_rank!r}")
    root_rank = r
    if not 0 <= root_rank < c.nranks():
        raise ValueError(
            f"{opname}: root_rank={root_rank} is outside the communicator's ranks 0..{c.nranks() - 1}"
        )
    return root_rank


def _named(params: Any, opname: str) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, torch.Tensor):
        raise TypeError(
            f"{opname}: params must be a state_dict, named_parameters(), a dict or a list of tensors, "
            "got a single tensor (wrap it in a list)"
        )
    if isinstance(params, dict):
        items = list(params.items())
    else:
        try:
            items = list(params)
        except TypeError:
            raise TypeError(
                f"{opname}: params must be a state_dict, named_parameters(), a dict or a list of tensors, "
                f"got {type(params).__name__}"
            ) from None
        if items and isinstance(items[0], torch.Tensor):
            for i, x in enumerate(items):
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"{opname}: params entry {i} is {type(x).__name__}, not a tensor")
            items = [(str(i), t) for i, t in enumerate(items)]
    out: List[Tuple[str, torch.Tensor]] = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                f"{opname}: params entry {i} is {type(item).__name__}; expected a (name, tensor) pair"
            )
        name, t = item
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{opname}: params[{name!r}] is {type(t).__name__}, not a tensor")
        out.append((str(name), t))
    return out


def broadcast_object(obj: Any, root_rank: int = 0, comm: CommArg = None) -> Any:
    """Return ``root_rank``'s ``obj`` (pickled) on every rank; two broadcasts (header, bytes).

    Only for trusted peers: the bytes are unpickled. If the root cannot pickle ``obj``, it sends a
    failure marker and the error text instead, so every rank raises the same ``TypeError`` in the
    same call and the ranks stay in step. With one rank ``obj`` is returned as is (not pickled).

    Raises:
        TypeError: (on every rank) the root could not pickle ``obj``; the message names its type and
            the pickling error. On the root the pickling error is chained as ``__cause__``.
        ValueError: ``root_rank`` outside the communicator.

    Example::

        cfg = broadcast_object({"lr": 0.1} if rank == 0 else None, root_rank=0)
    """
    c = resolve_comm(comm, "broadcast_object")
    root = _root(root_rank, c, "broadcast_object")
    what = f"the object (a {type(obj).__module__}.{type(obj).__qualname__})"
    return _broadcast_object(obj, root, c, "broadcast_object", what)


def _broadcast_object(obj: Any, root: int, c: Communicator, opname: str, what: str) -> Any:
    """:func:`broadcast_object` after argument checks; errors are reported as ``opname``'s."""
    if c.nranks() == 1:
        return obj
    me = c.rank()
    cause: Optional[BaseException] = None
    # header: [payload length, 1 if the payload is the pickled object, 0 if it is an error text]
    if me == root:
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            ok = 1
        except Exception as exc:  # noqa: BLE001 - reported on every rank; __reduce__ may raise anything
            cause = exc
            data = f"{opname}: root rank {root} could not pickle {what}: {type(exc).__name__}: {exc}".encode(
                "utf-8", "replace"
            )
            ok = 0
        header = torch.tensor([len(data), ok], dtype=torch.int64)
    else:
        data = b""
        header = torch.zeros(2, dtype=torch.int64)
    _core.broadcast(header, root, comm=c)
    length, ok = (int(v) for v in header.tolist())
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if me == root
        else torch.empty(length, dtype=torch.uint8)
    )
    if length:
        _core.broadcast(buf, root, comm=c)
    if not ok:
        raise TypeError(buf.numpy().tobytes().decode("utf-8", "replace")) from cause
    return obj if me == root else pickle.loads(buf.numpy().tobytes())


def _agree(c: Communicator, root: int, problem: Optional[str], opname: str) -> None:
    """Every rank learns whether any rank's layout differs from the root's; all raise together.

    The message is the same on every rank: it names the differing ranks and the first difference
    seen on the lowest of them.
    """
    if c.nranks() == 1:
        return
    flags = torch.zeros(c.nranks(), dtype=torch.int64)
    _core.allgather(torch.tensor([1 if problem else 0], dtype=torch.int64), flags, comm=c)
    bad = [r for r, f in enumerate(flags.tolist()) if f]
    if bad:
        first = _broadcast_object(
            problem if c.rank() == bad[0] else None, bad[0], c, opname, "the difference"
        )
        raise CommError(
            f"{opname}: ranks {bad} do not have the same layout as root rank {root} "
            f"(rank {bad[0]}: {first}); build the same model/optimizer on every rank before broadcasting"
        )


def _describe(named: List[Tuple[str, torch.Tensor]]) -> List[Tuple[str, Tuple[int, ...], str]]:
    return [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in named]


def _first_difference(mine: List[Any], root: List[Any]) -> Optional[str]:
    for i, (a, b) in enumerate(zip(mine, root)):
        if a != b:
            return f"entry {i}: here {a}, on the root {b}"
    if len(mine) != len(root):
        return f"{len(mine)} entries here, {len(root)} on the root"
    return None


def _broadcast_flat(tensors: List[torch.Tensor], root: int, c: Communicator) -> None:
    """Broadcast ``tensors`` in place, one flat buffer per (device, dtype), in a fixed order."""
    buckets: Dict[Tuple[str, torch.dtype], List[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((str(t.device), t.dtype), []).append(t)
    me = c.rank()
    with torch.no_grad():
        for key in sorted(buckets, key=lambda k: (k[0], str(k[1]))):
            ts = [t for t in buckets[key] if t.numel()]
            if not ts:
                continue
            if len(ts) == 1 and ts[0].is_contiguous():
                _core.broadcast(ts[0], root, comm=c)
                continue
            flat = (
                torch.cat([t.reshape(-1) for t in ts])
                if me == root
                else torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device)
            )
            _core.broadcast(flat, root, comm=c)
            if me != root:
                off = 0
                for t in ts:
                    t.copy_(flat[off : off + t.numel()].view_as(t))
                    off += t.numel()


def broadcast_parameters(params: Any, root_rank: int, comm: CommArg = None) -> None:
    """Overwrite ``params`` on every rank with ``root_rank``'s values, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()``, a dict ``{name: tensor}``, or a
            list of tensors (``model.parameters()``). Entries are matched by position; every rank must
            pass the same names, shapes and dtypes.
        root_rank: the rank whose values everyone gets.
        comm: communicator or process group (None: the default group).

    Raises:
        TypeError: ``params`` is not one of the accepted forms.
        ValueError: ``root_rank`` outside the communicator.
        CommError: (on every rank) some rank's names/shapes/dtypes differ from the root's.

    Example::

        model = torch.nn.Linear(4, 2)
        broadcast_parameters(model.state_dict(), root_rank=0)
    """
    opname = "broadcast_parameters"
    named = _named(params, opname)
    c = resolve_comm(comm, opname)
    root = _root(root_rank, c, opname)
    if c.nranks() == 1:
        return
    layout = _describe(named)
    root_layout = broadcast_object(layout if c.rank() == root else None, root, c)
    _agree(c, root, _first_difference(layout, root_layout), opname)
    _broadcast_flat([t for _, t in named], root, c)


def _split_state(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a placeholder; the tensors are appended to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, dict):
        return {k: _split_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        seq = [_split_state(v, tensors) for v in obj]
        return seq if isinstance(obj, list) else tuple(seq)
    return obj


class _Slot:
    """Placeholder of a tensor in a pickled optimizer state (index, shape, dtype, device type)."""

    def __init__(self, index: int, shape: Tuple[int, ...], dtype: torch.dtype, device: str) -> None:
        self.index, self.shape, self.dtype, self.device = index, shape, dtype, device


def _fill_state(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        seq = [_fill_state(v, tensors) for v in obj]
        return seq if isinstance(obj, list) else tuple(seq)
    return obj


def _slots(obj: Any, out: List[_Slot]) -> List[_Slot]:
    if isinstance(obj, _Slot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _slots(v, out)
    return out


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, comm: CommArg = None) -> None:
    """Make every rank's optimizer equal ``root_rank``'s (hyper-parameters, tensor and scalar state).

    Works for any ``torch.optim.Optimizer`` (also one wrapped by the distributed optimizers, which
    forward ``state_dict``/``load_state_dict``), including the case where this rank's state is empty
    (no step taken yet) while the root's is not, and 0-d ``step`` tensors. The root's
    ``state_dict()`` is sent as a pickled structure plus its tensors (one broadcast per dtype); the
    other ranks ``load_state_dict`` it, so their parameters are matched by position as torch does.

    Args:
        optimizer: the optimizer (same parameter groups and sizes on every rank).
        root_rank: the rank whose state everyone gets.
        comm: communicator or process group (None: the default group).

    Raises:
        TypeError: ``optimizer`` has no ``state_dict``/``load_state_dict``; (on every rank) the root's
            state could not be pickled (e.g. a lambda in a parameter group).
        ValueError: ``root_rank`` outside the communicator.
        CommError: (on every rank, before anything is loaded) some rank's optimizer class (the wrapped
            class for the distributed optimizers), number of parameter groups, group sizes or a
            parameter's shape differs from the root's; the same message on every rank names the
            first difference. Also (on that rank only) if ``load_state_dict`` fails anyway; that
            rank's optimizer is then restored to its previous state.

    Example::

        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if rank == 0:
            opt.load_state_dict(torch.load("ckpt.pt")["optimizer"])
        broadcast_optimizer_state(opt, root_rank=0)
    """
    opname = "broadcast_optimizer_state"
    if not (hasattr(optimizer, "state_dict") and hasattr(optimizer, "load_state_dict")):
        raise TypeError(
            f"{opname}: optimizer must be a torch.optim.Optimizer (state_dict/load_state_dict), "
            f"got {type(optimizer).__name__}"
        )
    c = resolve_comm(comm, opname)
    root = _root(root_rank, c, opname)
    if c.nranks() == 1:
        return
    layout = _optimizer_layout(optimizer)
    sd = optimizer.state_dict()
    me = c.rank()
    tensors: List[torch.Tensor] = []
    structure = _split_state(sd, tensors) if me == root else None
    root_layout, root_structure = _broadcast_object(
        (layout, structure) if me == root else None, root, c, opname, "its optimizer state_dict()"
    )
    # Everything is compared before anything is loaded: a mismatch leaves every optimizer unchanged.
    _agree(c, root, _optimizer_difference(layout, root_layout), opname)
    if me != root:
        dev = _param_device(optimizer)
        tensors = [
            torch.empty(
                s.shape, dtype=s.dtype, device=dev if s.device == dev.type else torch.device(s.device)
            )
            for s in _slots(root_structure, [])
        ]
    # Contiguous copies on the root: broadcast reads them; the optimizer's own tensors are not touched.
    send = [t.contiguous() for t in tensors] if me == root else tensors
    _broadcast_flat(send, root, c)
    if me != root:
        _load_or_restore(optimizer, _fill_state(root_structure, tensors), sd, opname, me)


def _optimizer_class(optimizer: Any) -> str:
    """The optimizer's class (the wrapped class for the distributed optimizers), module-qualified."""
    cls = getattr(optimizer, "_tl_base", type(optimizer))
    return f"{cls.__module__}.{cls.__qualname__}"


def _optimizer_layout(optimizer: Any) -> Tuple[str, List[List[Tuple[int, ...]]]]:
    """(class, per parameter group the shapes of its parameters): what must match the root's."""
    shapes = [[tuple(p.shape) for p in g["params"]] for g in optimizer.param_groups]
    return _optimizer_class(optimizer), shapes


def _optimizer_difference(mine: Any, root: Any) -> Optional[str]:
    """The first difference between this rank's optimizer layout and the root's, or None."""
    (cls, shapes), (root_cls, root_shapes) = mine, root
    if cls != root_cls:
        return f"optimizer class {cls} here, {root_cls} on the root"
    sizes, root_sizes = [len(g) for g in shapes], [len(g) for g in root_shapes]
    if sizes != root_sizes:
        return f"parameter group sizes {sizes}, root has {root_sizes}"
    for gi, (g, rg) in enumerate(zip(shapes, root_shapes)):
        for i, (a, b) in enumerate(zip(g, rg)):
            if a != b:
                return f"param_groups[{gi}] parameter {i} has shape {a} here, {b} on the root"
    return None


def _load_or_restore(
    optimizer: Any, new_sd: Dict[str, Any], old_sd: Dict[str, Any], opname: str, me: int
) -> None:
    """``load_state_dict(new_sd)``; if that fails, put ``old_sd`` back so no half-loaded state remains."""
    try:
        optimizer.load_state_dict(new_sd)
    except Exception as exc:
        try:
            optimizer.load_state_dict(old_sd)
        except Exception:  # pragma: no cover - restoring what state_dict() returned should not fail
            logger.exception("%s: rank %d could not restore its optimizer state", opname, me)
        raise CommError(
            f"{opname}: rank {me} could not load root's optimizer state ({type(exc).__name__}: {exc}); "
            "its optimizer was left unchanged"
        ) from exc


def _param_device(optimizer: Any) -> torch.device:
    for g in optimizer.param_groups:
        for p in g["params"]:
            return p.device
    return torch.device("cpu")
