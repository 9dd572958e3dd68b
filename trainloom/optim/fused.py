"""``fuse_optimizer`` / ``fuse_step``: update all parameters of a param group in one pass.

Bagua's API (``bagua.torch_api.contrib.fuse_optimizer``), made to work with every torch 2.x
elementwise optimizer and bitwise equal to the unfused optimizer:

* :func:`fuse_optimizer` moves the parameters, gradients and per-element optimizer state of each
  param group (per device and dtype) into one contiguous buffer each: every tensor becomes a view
  at a 64-byte aligned offset, with its shape, strides and values kept. 0-d state (torch's
  ``step``) and non-tensor state are never flattened.
* :func:`fuse_step` (also bound as ``optimizer.fuse_step``) updates each run of adjacent parameters
  that have gradients in one go: with a compiled kernel for SGD, Adam and AdamW on CPU
  float32/float64, otherwise with the optimizer's own math on flat views of the run. ``step()``
  is untouched; the two can be interleaved.

Exactness: every path reproduces the configured torch path bit for bit (tests/optim compare 100
interleaved steps bitwise with an unfused twin). Where a kernel cannot (see ``docs/optim.md``),
torch's own code runs instead.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import ctypes
import itertools
import logging
import math
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, cast

import numpy as np
import torch
from torch.optim import optimizer as _torch_optimizer

from trainloom._build_check import import_compiled
from trainloom._warnings import warn_at_caller
from trainloom.errors import ConfigError

_K = import_compiled("trainloom.optim._fused")

# torch's global step hooks (dicts that register_optimizer_step_*_hook fill in place) and its check
# for a recording profiler, bound once: fuse_step looks at them on every call.
_GLOBAL_PRE_HOOKS = _torch_optimizer._global_optimizer_pre_hooks
_GLOBAL_POST_HOOKS = _torch_optimizer._global_optimizer_post_hooks
_profiler_enabled = torch._C._autograd._profiler_enabled

logger = logging.getLogger("trainloom.optim")

__all__ = [
    "FuseError",
    "fuse_optimizer",
    "fuse_step",
    "is_fused_optimizer",
    "calculate_mutual_groups",
    "flat_buffers",
    "kernel_checks",
]

#: Every view starts at a multiple of this many bytes (one cache line; also full AVX-512 vectors).
ALIGN_BYTES = 64
#: Work items of the compiled kernels: big enough to amortise scheduling, small enough to balance.
_CHUNK = 1 << 16
#: Below this many elements per call the kernels run on one thread: waking OpenMP workers costs
#: more than it saves (tools/bench_optim.py, 4-tensor MLP).
_PARALLEL_MIN = 1 << 15

_ATTR = "_trainloom_fused"

if TYPE_CHECKING:

    class FusedOptimizer(torch.optim.Optimizer):
        """For type checkers only: what :func:`fuse_optimizer` returns, the same optimizer object
        with a ``fuse_step()`` method (no such class exists at run time)."""

        def fuse_step(self, closure: Optional[Callable[[], Any]] = None) -> Any: ...


class FuseError(ConfigError):
    """An optimizer cannot be fused, or was used in a way fusing does not support."""


class _AlreadyFusedError(FuseError, RuntimeError):
    """Fusing an optimizer a second time: a FuseError, and a RuntimeError as in Bagua (whose
    ``fuse_optimizer`` raised ``RuntimeError("trying to fuse an optimizer twice!")``)."""


# Elementwise torch optimizers: each element's update depends only on that element's parameter,
# gradient and state plus per-tensor scalars that are equal for all tensors of a run (step
# counts, learning rates). Their math on a flat view equals their math per tensor.
_ELEMENTWISE: Tuple[Type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "RMSprop",
        "Rprop",
        "ASGD",
        "Adamax",
        "Adadelta",
        "Adagrad",
        "NAdam",
        "RAdam",
    )
    if hasattr(torch.optim, name)
)
# Optimizers refused by class name (anywhere in the class's MRO, so third-party LAMB/LARS classes
# deriving from SGD or Adam are caught too), with the reason given to the user. Keep docs/optim.md
# ("Which optimizers are fused") in step with this table.
_PER_TENSOR = "computes per-tensor quantities ({}); flattening would change its results"
_REFUSED: Dict[str, str] = {
    "LBFGS": (
        "is not elementwise (a quasi-Newton line search over dot products of all gradients, "
        "re-evaluating the closure); fusing cannot speed it up"
    ),
    "SparseAdam": (
        "needs sparse gradients (it raises on dense ones), while fusing works on dense flat gradient "
        "buffers; there is nothing to fuse"
    ),
    "Adafactor": _PER_TENSOR.format("factored row and column second moments of each tensor"),
    "Muon": _PER_TENSOR.format("an orthogonalisation of each 2-D gradient matrix"),
    "LAMB": _PER_TENSOR.format("a trust ratio from each tensor's norms"),
    "Lamb": _PER_TENSOR.format("a trust ratio from each tensor's norms"),
    "LARS": _PER_TENSOR.format("a trust ratio from each tensor's norms"),
    "Lars": _PER_TENSOR.format("a trust ratio from each tensor's norms"),
    "Shampoo": _PER_TENSOR.format("preconditioner matrices of each tensor"),
}


# --------------------------------------------------------------------------------------------
# Public helpers
# --------------------------------------------------------------------------------------------


def is_fused_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` has been converted by :func:`fuse_optimizer`.

    Args:
        optimizer: any object.

    Returns:
        True for an optimizer returned by :func:`fuse_optimizer`.

    Example::

        >>> opt = fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> is_fused_optimizer(opt)
        True
    """
    return isinstance(getattr(optimizer, _ATTR, None), _FusedInfo)


def calculate_mutual_groups(tensor_lists: Sequence[Sequence[torch.Tensor]]) -> List[List[int]]:
    """Groups of indices whose tensors are contiguous and adjacent in memory in every list.

    Index ``j`` follows index ``i`` in a group when, in every list, tensor ``j`` starts exactly
    where tensor ``i`` ends in the same storage (same device and dtype, both contiguous).

    Args:
        tensor_lists: lists of tensors, all of the same length (e.g. params, grads, exp_avgs).

    Returns:
        The groups with at least two indices, each in memory order, sorted by first index.

    Raises:
        FuseError: if the lists differ in length or hold something other than tensors.

    Example::

        >>> flat = torch.zeros(10)
        >>> a, b, c = flat[0:4], flat[4:6], flat[7:10]
        >>> calculate_mutual_groups([[a, b, c]])
        [[0, 1]]
    """
    for li, lst in enumerate(tensor_lists):
        if isinstance(lst, torch.Tensor):  # list(tensor) would iterate its elements
            raise FuseError(
                f"calculate_mutual_groups: item {li} is a tensor, not a list of tensors; pass a list of "
                "lists, e.g. [params, grads]"
            )
    lists = [list(lst) for lst in tensor_lists]
    if not lists:
        return []
    n = len(lists[0])
    for li, lst in enumerate(lists):
        if len(lst) != n:
            raise FuseError(
                f"calculate_mutual_groups: list {li} has {len(lst)} tensors, list 0 has {n}; "
                "pass lists of equal length"
            )
        for ti, t in enumerate(lst):
            if not isinstance(t, torch.Tensor):
                raise FuseError(
                    f"calculate_mutual_groups: list {li} item {ti} is {type(t).__name__}, not a tensor"
                )
    edges: Optional[Dict[int, int]] = None
    for lst in lists:
        nxt: Dict[int, int] = {}
        by_end: Dict[Tuple[Any, int], int] = {}
        for i, t in enumerate(lst):
            if t.numel() == 0 or not t.is_contiguous() or t.is_sparse:
                continue
            key = (t.untyped_storage().data_ptr(), t.device, t.dtype)
            by_end[(key, t.data_ptr() + t.numel() * t.element_size())] = i
        for j, t in enumerate(lst):
            if t.numel() == 0 or not t.is_contiguous() or t.is_sparse:
                continue
            key = (t.untyped_storage().data_ptr(), t.device, t.dtype)
            prev = by_end.get((key, t.data_ptr()))
            if prev is not None and prev != j:
                nxt[prev] = j
        edges = nxt if edges is None else {i: j for i, j in edges.items() if nxt.get(i) == j}
    if edges is None:
        return []
    heads = set(edges) - set(edges.values())
    groups = []
    for h in heads:
        chain = [h]
        while chain[-1] in edges and len(chain) <= n:
            chain.append(edges[chain[-1]])
        groups.append(chain)
    groups.sort(key=lambda g: g[0])
    return groups


def flat_buffers(optimizer: torch.optim.Optimizer, kind: str = "grad") -> List[torch.Tensor]:
    """The flat buffers of a fused optimizer, one per (param group, device, dtype).

    Use the ``"grad"`` buffers to reduce all gradients with one collective (DDP-style flows):
    after ``backward()`` every gradient of a fused parameter is a view into them.

    Args:
        optimizer: an optimizer returned by :func:`fuse_optimizer` with ``do_flatten=True``.
        kind: ``"grad"`` or ``"param"``.

    A fused parameter without a gradient (``p.grad`` None: ``zero_grad()`` ran and this backward did
    not reach it) has zeros in its slot of the ``"grad"`` buffers when this returns; the slot would
    otherwise still hold its last gradient, and a collective would mix that into the other ranks'
    gradients. ``fuse_step`` still skips the parameter on a rank where its ``p.grad`` is None, as
    torch does, so that rank's copy drifts from the others' (docs/optim.md says how to avoid it).
    A gradient of its own, assigned by hand (``p.grad = t``), re-pointed (``p.grad.data = t``,
    ``set_``) or made by ``backward(create_graph=True)``, is copied into its slot, and ``p.grad``
    becomes the slot (without the gradient's graph), so the collective reaches it too and
    ``fuse_step`` steps with what the collective made of it.

    Returns:
        1-D tensors. Alignment padding between views is always zero in ``"grad"`` buffers.

    Raises:
        FuseError: if the optimizer is not fused with flattening, or ``kind`` is unknown.
    """
    info = _info(optimizer, "flat_buffers")
    if not info.do_flatten:
        raise FuseError("flat_buffers: the optimizer was fused with do_flatten=False; it has no flat buffers")
    if kind not in ("grad", "param"):
        raise FuseError(f"flat_buffers: kind must be 'grad' or 'param', got {kind!r}")
    _sync(optimizer, info)
    moved = _moved(info)
    if moved is not None:
        _sync(optimizer, info, moved)
    _adopt_unfrozen(info)  # no hooked parameter may have run a backward to do it
    if kind == "param":
        return [b.flat_param for b in info.buckets]
    for b in info.buckets:
        _scan(b, optimizer.state, light=True)
        for i in np.flatnonzero(b.status == 1):  # p.grad is None: its slot holds a stale gradient
            b.grad_views[i].zero_()
        for i in np.flatnonzero(b.status == 2):  # a gradient of its own (p.grad = ...): into the slot
            _grad_into_slot(b, int(i))
    return [b.flat_grad for b in info.buckets]


# --------------------------------------------------------------------------------------------
# Bookkeeping
# --------------------------------------------------------------------------------------------


class _Bucket:
    """One flat buffer set: the parameters of one param group on one device with one dtype."""

    def __init__(self, group_index: int, params: List[torch.Tensor]) -> None:
        self.group_index = group_index
        self.params = params
        p0 = params[0]
        self.device = p0.device
        self.dtype = p0.dtype
        align = max(1, ALIGN_BYTES // p0.element_size())
        self.offsets: List[int] = []
        self.numels: List[int] = []
        self.strides: List[Tuple[int, ...]] = []
        off = 0
        for p in params:
            self.offsets.append(off)
            n = p.numel()
            self.numels.append(n)
            self.strides.append(_dense_strides(p))
            off += -(-max(n, 1) // align) * align
        self.length = off
        self.flat_param = torch.zeros(off, dtype=self.dtype, device=self.device)
        self.flat_grad = torch.zeros(off, dtype=self.dtype, device=self.device)
        self.param_views: List[torch.Tensor] = []
        self.grad_views: List[torch.Tensor] = []
        for i, p in enumerate(params):
            pv = self._view(self.flat_param, i)
            with torch.no_grad():
                pv.copy_(p.detach())
            self.param_views.append(pv)
            self.grad_views.append(self._view(self.flat_grad, i))
        self.ptrs = [v.data_ptr() for v in self.param_views]
        self.state_flat: Dict[Any, torch.Tensor] = {}
        self.state_views: Dict[Any, List[Optional[torch.Tensor]]] = {}
        # (view, its address in the flat state buffer) of one view per key (see state_repointed)
        self.state_probe: Optional[List[Tuple[torch.Tensor, int]]] = None
        self.index = {id(p): i for i, p in enumerate(params)}
        self.hooks: List[Any] = []
        self.plan_cache: Dict[Any, Any] = {}
        self.scratch: Optional[torch.Tensor] = None
        # fuse_step's per-step check (see _K.scan) and the cached steady-state layout
        self.ptr_arr = np.array(self.ptrs, dtype=np.int64)
        self.grad_ptr_arr = np.array([v.data_ptr() for v in self.grad_views], dtype=np.int64)
        self.status = np.zeros(len(params), dtype=np.uint8)
        self.keys: Tuple[Any, ...] = ()
        self.key_views: List[List[Optional[torch.Tensor]]] = []
        self.step_objs: Optional[List[Any]] = None
        self.n_extra = -1
        self.fast_status = b""
        self.cfg: Tuple[Any, ...] = ()
        # indices of parameters that did not require grad when hooks were installed (no hook yet)
        self.unhooked: List[int] = []

    def _view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat.as_strided(p.shape, self.strides[i], self.offsets[i])

    def state_view(self, key: Any, i: int, like: torch.Tensor) -> torch.Tensor:
        flat = self.state_flat.get(key)
        if flat is None:
            flat = torch.zeros(self.length, dtype=like.dtype, device=self.device)
            self.state_flat[key] = flat
            self.state_views[key] = [None] * len(self.params)
        views = self.state_views[key]
        v = views[i]
        if v is None:
            v = self._view(flat, i)
            views[i] = v
            self.state_probe = None
        return v

    def _state_addr(self, key: Any, i: int) -> int:
        """Where parameter ``i``'s view of state ``key`` lives in the flat state buffer."""
        flat = self.state_flat[key]
        return flat.data_ptr() + self.offsets[i] * flat.element_size()

    def state_repointed(self) -> bool:
        """Whether a state view's storage was replaced in place (``v.data = t``, ``v.set_(t)``: the
        forum's "move the optimizer state" snippet does it to every state tensor). The state is
        checked by identity per step; this looks at one view of each key only (one data_ptr() call
        per key, ~0.1 us a step), enough for code that re-points them all."""
        probe = self.state_probe
        if probe is None:
            probe = self.state_probe = []
            for key, views in self.state_views.items():
                for i, v in enumerate(views):
                    if v is not None:
                        probe.append((v, self._state_addr(key, i)))
                        break
        for v, ptr in probe:
            if v.data_ptr() != ptr:
                return True
        return False

    def repair_state(self, state: Any) -> None:
        """After :meth:`state_repointed`: every state view whose storage was replaced gets a fresh
        view of the flat buffer holding its values, in its place in ``state`` too (a tensor of another
        shape, dtype or device stays where it is: the state is then not flat, and torch's own
        handling takes it)."""
        self.state_probe = None
        with torch.no_grad():
            for key, views in self.state_views.items():
                for i, v in enumerate(views):
                    if v is None or v.data_ptr() == self._state_addr(key, i):
                        continue
                    fresh = views[i] = self._view(self.state_flat[key], i)
                    st = state.get(self.params[i])
                    if v.shape == fresh.shape and v.dtype == fresh.dtype and v.device == fresh.device:
                        fresh.copy_(v)
                        if st is not None and st.get(key) is v:
                            st[key] = fresh

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


class _FusedInfo:
    def __init__(self, do_flatten: bool, check_flatten: bool) -> None:
        self.do_flatten = do_flatten
        self.check_flatten = check_flatten
        self.buckets: List[_Bucket] = []
        self.groups: List[Dict[str, Any]] = []
        self.group_params: List[List[torch.Tensor]] = []
        self.state_obj: Any = None
        self.warned = False
        self.fast: Optional[List[Any]] = None
        self.step_hook: Any = None
        self.load_hook: Any = None
        # per param group: parameters that stay outside the flat buffers (0-d, complex, ...)
        self.outside: List[List[torch.Tensor]] = []
        self.warned_shared = False
        self.warned_shm = False
        self.warned_duplicate = False
        # id() of the parameters whose memory overlaps another's (found when the optimizer is fused
        # or re-fused, not per step: ~6 us a parameter); with do_flatten=False also those listed more
        # than once (_kept_apart: neither goes into a span)
        self.shared: set = set()
        # whether some bucket has parameters without a gradient hook (frozen when fused), and the
        # autograd graph task that last queued _adopt_unfrozen
        self.unhooked_any = False
        self.adopt_task: Optional[int] = -1
        # the optimizer state's per-parameter dicts and their sizes when the fast path was set up
        self.state_type: Any = None
        self.state_dicts: List[Any] = []
        self.state_sizes = np.zeros(0, dtype=np.int64)
        # and the objects those dicts held (a state tensor replaced by hand must be seen)
        self.state_values: List[Any] = []
        # id() of the parameters in this optimizer's flat buffers, and whether it warned about
        # parameters it left where another fused optimizer's buffers hold them
        self.bucketed: set = set()
        self.warned_held = False


# Which fused optimizer's flat buffers hold each parameter: id(p) -> (weakref to p, weakref to that
# optimizer's _FusedInfo). Two fused optimizers over one parameter would otherwise take it out of
# each other's buffers at every step (each fuse_step saw it moved and re-fused).
_HOLDER: Dict[int, Tuple[weakref.ref[torch.Tensor], weakref.ref[_FusedInfo]]] = {}


def _held_elsewhere(p: torch.Tensor, info: _FusedInfo) -> bool:
    """Whether another live fused optimizer's flat buffers hold ``p``."""
    entry = _HOLDER.get(id(p))
    if entry is None or entry[0]() is not p:
        return False
    other = entry[1]()
    return other is not None and other is not info and id(p) in other.bucketed


def _hold(p: torch.Tensor, info: _FusedInfo) -> None:
    key = id(p)

    def forget(ref: weakref.ref[torch.Tensor]) -> None:
        entry = _HOLDER.get(key)
        if entry is not None and entry[0] is ref:
            del _HOLDER[key]

    _HOLDER[key] = (weakref.ref(p, forget), weakref.ref(info))


def _dense_strides(p: torch.Tensor) -> Tuple[int, ...]:
    """Strides of a dense tensor with ``p``'s memory layout (channels_last, transposes...)."""
    # empty_like keeps the strides of a non-overlapping dense tensor and picks a dense layout
    # (by memory format) for anything else, e.g. a slice with gaps. On "meta": no allocation.
    return tuple(torch.empty_like(p, device="meta").stride())


def _info(optimizer: Any, where: str) -> _FusedInfo:
    info = getattr(optimizer, _ATTR, None)
    if not isinstance(info, _FusedInfo):
        raise FuseError(
            f"{where}: {type(optimizer).__name__} is not fused; call fuse_optimizer(optimizer) first"
        )
    return info


def _check_supported(
    optimizer: torch.optim.Optimizer, cls: Optional[Type[torch.optim.Optimizer]] = None
) -> None:
    """Raise FuseError unless ``optimizer`` (checked as ``cls``, default its type) can be fused."""
    cls = cls or type(optimizer)
    for base in cls.__mro__:
        if base.__name__ in _REFUSED:
            what = cls.__name__ if base is cls else f"{cls.__name__} (a subclass of {base.__name__})"
            raise FuseError(f"fuse_optimizer: {what} {_REFUSED[base.__name__]}. Keep it unfused.")
    if not isinstance(optimizer, _ELEMENTWISE):
        raise FuseError(
            f"fuse_optimizer: {cls.__name__} is not one of the elementwise torch optimizers fusing "
            f"supports ({', '.join(c.__name__ for c in _ELEMENTWISE)}); keep it unfused"
        )
    base = next(c for c in cls.__mro__ if c in _ELEMENTWISE)
    if _peel_profiling(cls.step) is not _peel_profiling(base.step):
        raise FuseError(
            f"fuse_optimizer: {cls.__name__} overrides step() of {base.__name__}; its math may not "
            "be elementwise, so it cannot be fused"
        )


def _warn(message: str) -> None:
    """A UserWarning attributed to the first caller outside this module (the user's line)."""
    warn_at_caller(message, UserWarning, __file__)


def _profiling_wrapper_code() -> Any:
    """The code object of torch's ``Optimizer.profile_hook_step`` wrapper (None if torch has none)."""
    make = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    return getattr(make(lambda *a, **k: None), "__code__", None) if callable(make) else None


_PROFILING_WRAPPER_CODE = _profiling_wrapper_code()


def _peel_profiling(fn: Any) -> Any:
    """``fn`` without torch's own profiling wrapper around it.

    torch wraps the ``step()`` an optimizer class resolves to in ``Optimizer.profile_hook_step``
    (hooks, profiler range) and stores the wrapper on that class. Only that wrapper is peeled off, told
    by its code object: its ``hooked`` attribute and ``__wrapped__`` are no mark, as ``functools.wraps``
    copies ``hooked`` onto a user's own wrapper and sets ``__wrapped__`` there too, and a ``step()``
    decorated so overrides the base's."""
    while _PROFILING_WRAPPER_CODE is not None and getattr(fn, "__code__", None) is _PROFILING_WRAPPER_CODE:
        fn = fn.__wrapped__
    return fn


# --------------------------------------------------------------------------------------------
# Fusing
# --------------------------------------------------------------------------------------------


def fuse_optimizer(
    optimizer: torch.optim.Optimizer, do_flatten: bool = True, check_flatten: bool = True
) -> FusedOptimizer:
    """Convert an optimizer into a fused optimizer (in place) and return it.

    Unlike Bagua's (which accepts any optimizer), only torch's elementwise optimizers and their
    subclasses that do not override ``step()`` are accepted; see docs/optim.md.

    Args:
        optimizer: a torch elementwise optimizer (SGD, Adam, AdamW, RMSprop, Rprop, ASGD,
            Adamax, Adadelta, Adagrad, NAdam, RAdam), or a subclass of one that does not
            override ``step()``.
        do_flatten: move parameters, gradients and per-element state of each param group (per
            device and dtype) into one contiguous buffer each. With False, nothing moves and
            :func:`fuse_step` fuses only tensors that already happen to be adjacent in memory.
        check_flatten: warn (once) when the flat layout had to be rebuilt because parameters,
            param groups or state changed behind the optimizer's back (``load_state_dict()``
            rebuilds it quietly: a resume is routine).

    Returns:
        The same optimizer object; ``optimizer.fuse_step(closure=None)`` is bound on it. Keep a
        reference to it: the bound method holds the optimizer weakly.

    Raises:
        FuseError: if the optimizer is already fused (then also a ``RuntimeError``, as in Bagua);
            is LBFGS, SparseAdam (sparse gradients),
            Adafactor, Muon or a LAMB/LARS/Shampoo-named class (per-tensor quantities), a
            subclass overriding ``step()``, or any other optimizer class; or its parameters
            are not floating point.

    Parameters whose memory overlaps another parameter's (e.g. ``Parameter(w)`` and
    ``Parameter(w.view(-1))``) are not moved: they keep sharing memory, torch updates them per
    tensor (bit-exact), their gradients are not in :func:`flat_buffers`, and a ``UserWarning``
    names them. The same Parameter object used twice (tied weights) is fused normally.

    Copies and checkpoints: ``copy.deepcopy(optimizer)`` returns a fused deep copy (torch's
    deep copy, fused again with the same flags). Pickling the optimizer object (``torch.save(
    optimizer)``, ``copy.copy``) gives a plain, unfused optimizer, as torch's ``__getstate__``
    keeps only defaults, state and param groups; call ``fuse_optimizer`` on it again. To
    checkpoint, save ``optimizer.state_dict()`` (stock torch format) and ``load_state_dict`` it
    into a fused or unfused optimizer: training continues bit-identically.

    Example::

        >>> opt = fuse_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
        >>> loss = model(x).sum(); loss.backward()
        >>> opt.fuse_step()
        >>> opt.zero_grad()

    .. warning::
        With ``do_flatten=True`` the parameters' storage is replaced (``p.data`` becomes a view
        of the flat buffer); fuse before creating anything that caches parameter storage
        (e.g. DDP's buckets) and do not call ``p.set_()`` on fused parameters.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise FuseError(f"fuse_optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_fused_optimizer(optimizer):
        raise _AlreadyFusedError(
            f"fuse_optimizer: this {type(optimizer).__name__} is already fused; fuse each optimizer once"
        )
    if not isinstance(do_flatten, bool) or not isinstance(check_flatten, bool):
        raise FuseError("fuse_optimizer: do_flatten and check_flatten must be bool")
    _check_supported(optimizer)
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if not (p.is_floating_point() or p.is_complex()):
                raise FuseError(
                    f"fuse_optimizer: param group {gi} parameter {pi} has dtype {p.dtype}; only "
                    "floating point parameters can be optimized"
                )
    info = _FusedInfo(do_flatten, check_flatten)
    setattr(optimizer, _ATTR, info)
    if do_flatten:
        _build(optimizer, info)
    else:
        info.groups = list(optimizer.param_groups)
        info.group_params = [list(g["params"]) for g in optimizer.param_groups]
        info.state_obj = optimizer.state
        info.shared = _kept_apart([p for g in optimizer.param_groups for p in g["params"]])
    # A step() between two fuse_steps changes step counts and may create state: recheck then.
    info.step_hook = optimizer.register_step_post_hook(lambda *_: _invalidate(info))

    # A checkpoint loaded through the optimizer's own load_state_dict() is moved into the flat
    # buffers at once and quietly (a resume is routine; only changes behind its back warn).
    def _after_load(opt: torch.optim.Optimizer) -> None:
        _sync(opt, info, quiet=True)

    info.load_hook = optimizer.register_load_state_dict_post_hook(_after_load)
    # Bound on this instance only: no class-wide patching.
    optimizer.fuse_step = _BoundFuseStep(optimizer)  # type: ignore[attr-defined]
    # copy.deepcopy looks __deepcopy__ up on the instance: a deep copy is fused too.
    optimizer.__deepcopy__ = _FusedDeepcopy(optimizer)  # type: ignore[attr-defined]
    return cast("FusedOptimizer", optimizer)


class _BoundFuseStep:
    """``optimizer.fuse_step(closure=None)``: :func:`fuse_step` bound to one optimizer.

    Holds the optimizer through a weak reference, so that binding it on the instance creates no
    reference cycle and a dropped optimizer (with its flat buffers) is freed at once.
    """

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._ref = weakref.ref(optimizer)

    def __call__(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        optimizer = self._ref()
        if optimizer is None:
            raise FuseError(
                "fuse_step: the optimizer this method was bound to no longer exists: the method holds it "
                "through a weak reference, so an optimizer nothing else refers to (as in "
                "fuse_optimizer(torch.optim.SGD(...)).fuse_step()) is freed first. Keep a reference to "
                "the optimizer returned by fuse_optimizer: opt = fuse_optimizer(...); opt.fuse_step()"
            )
        return fuse_step(optimizer, closure)

    # What a bound method exposes: torch's LR scheduler wraps ``optimizer.step`` through
    # ``step.__func__.__get__(optimizer)``, also after ``opt.step = opt.fuse_step`` (Bagua's
    # fuse_step was a real bound method).
    @property
    def __func__(self) -> Callable[..., Any]:
        return fuse_step

    @property
    def __self__(self) -> Optional[torch.optim.Optimizer]:
        return self._ref()

    def __repr__(self) -> str:
        return f"<bound fuse_step of {type(self._ref()).__name__} optimizer>"


class _FusedDeepcopy:
    """``copy.deepcopy(fused_optimizer)``: torch's deep copy of the optimizer, fused again.

    Does what ``copy.deepcopy`` does for a plain optimizer (``__getstate__``: defaults, state and
    param groups, copied with the caller's memo; hooks are not copied), then calls
    :func:`fuse_optimizer` on the copy with the original's ``do_flatten`` and ``check_flatten``.
    The copy's parameters are torch's deep copies of the parameters (the same objects as in a
    model copied with the same ``deepcopy`` call), moved into the copy's own flat buffers.
    Holds the optimizer weakly, like :class:`_BoundFuseStep`.
    """

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._ref = weakref.ref(optimizer)

    def __call__(self, memo: Optional[Dict[int, Any]] = None) -> torch.optim.Optimizer:
        optimizer = self._ref()
        if optimizer is None:  # pragma: no cover - deepcopy holds the object it copies
            raise FuseError("deepcopy: the optimizer this method was bound to no longer exists")
        if memo is None:
            memo = {}
        info = _info(optimizer, "deepcopy")
        cls = type(optimizer)
        new = cls.__new__(cls)
        memo[id(optimizer)] = new
        new.__setstate__(copy.deepcopy(optimizer.__getstate__(), memo))
        return fuse_optimizer(new, info.do_flatten, info.check_flatten)


def _invalidate(info: _FusedInfo) -> None:
    # fuse_step's own calls of torch's step() run no hooks (_torch_step), so this is the user's step()
    info.fast = None


def _fusable_param(p: torch.Tensor) -> bool:
    # 0-d parameters and complex ones stay as they are (0-d state is indistinguishable from a
    # 0-d `step`; complex math runs on view_as_real); sparse and non-strided layouts cannot be
    # viewed into a flat buffer.
    return p.dim() > 0 and p.layout == torch.strided and p.is_floating_point() and not p.is_complex()


def _build(optimizer: torch.optim.Optimizer, info: _FusedInfo) -> None:
    """(Re)build every bucket from the optimizer's current params and state."""
    for b in info.buckets:
        b.remove_hooks()
    info.buckets = []
    listed = [p for g in optimizer.param_groups for p in g["params"]]
    shared = info.shared = _overlapping(listed)
    if shared:
        _warn_left_out(optimizer, info, "shared", shared)
    seen: set = set(shared)
    # A parameter listed twice (torch warns, then updates it once per listing): one flat view cannot
    # be updated twice by one kernel run, so torch steps it per tensor, as often as it is listed.
    twice = _listed_twice(listed)
    if twice:
        _warn_left_out(optimizer, info, "duplicate", twice)
    seen |= twice
    in_shm = {
        id(p)
        for g in optimizer.param_groups
        for p in g["params"]
        # is_shared() raises for a sparse layout (no storage); such parameters stay out anyway
        if id(p) not in seen and p.layout == torch.strided and p.device.type == "cpu" and p.is_shared()
    }
    if in_shm:
        _warn_left_out(optimizer, info, "shm", in_shm, shapes=False)
    seen |= in_shm
    held = {
        id(p)
        for g in optimizer.param_groups
        for p in g["params"]
        if id(p) not in seen and _held_elsewhere(p, info)
    }
    if held:
        _warn_left_out(optimizer, info, "held", held)
    seen |= held
    for gi, group in enumerate(optimizer.param_groups):
        by_key: Dict[Tuple[Any, Any], List[torch.Tensor]] = {}
        for p in group["params"]:
            if id(p) in seen or not _fusable_param(p):
                continue
            seen.add(id(p))
            by_key.setdefault((p.device, p.dtype), []).append(p)
        for params in by_key.values():
            bucket = _Bucket(gi, params)
            for i, p in enumerate(params):
                grad = p.grad
                p.data = bucket.param_views[i]
                if (
                    grad is not None
                    and not grad.is_sparse
                    and grad.shape == p.shape
                    and grad.dtype == p.dtype
                ):
                    with torch.no_grad():
                        bucket.grad_views[i].copy_(grad)
                    p.grad = bucket.grad_views[i]
            info.buckets.append(bucket)
            _flatten_state(optimizer, bucket, range(len(params)))
            _install_hooks(info, bucket)
    info.unhooked_any = any(b.unhooked for b in info.buckets)
    info.groups = list(optimizer.param_groups)
    info.group_params = [list(g["params"]) for g in optimizer.param_groups]
    info.state_obj = optimizer.state
    bucketed = info.bucketed = {id(p) for b in info.buckets for p in b.params}
    for b in info.buckets:
        for p in b.params:
            _hold(p, info)
    info.outside = [[p for p in g["params"] if id(p) not in bucketed] for g in optimizer.param_groups]


def _listed_twice(params: Sequence[torch.Tensor]) -> set:
    """``id()`` of every parameter listed more than once (in one param group or in several)."""
    listings = collections.Counter(id(p) for p in params)
    return {i for i, k in listings.items() if k > 1}


def _kept_apart(params: Sequence[torch.Tensor]) -> set:
    """do_flatten=False: ``id()`` of the parameters never put in a span of adjacent ones. Those whose
    memory overlaps another's, and those listed more than once: torch steps such a parameter once per
    listing, while a span stands in for one listing of each of its members."""
    return _overlapping(params) | _listed_twice(params)


def _overlapping(params: Sequence[torch.Tensor]) -> set:
    """``id()`` of every parameter whose memory overlaps another parameter's.

    Conservative: each tensor counts as the whole byte range from its first to its last element,
    so interleaved views (``w[::2]`` and ``w[1::2]``) count as overlapping too. Distinct Parameter
    objects only (the same Parameter listed twice is not sharing); meta tensors have no memory.
    """
    spans: List[Tuple[Any, int, int, int]] = []
    unique: set = set()
    for p in params:
        if id(p) in unique:
            continue
        unique.add(id(p))
        if p.numel() == 0 or p.layout != torch.strided or p.device.type == "meta":
            continue
        # torch strides are never negative: the last element is at sum((size - 1) * stride)
        extent = 1 + sum((n - 1) * st for n, st in zip(p.shape, p.stride()))
        start = p.data_ptr()
        spans.append((str(p.device), start, start + extent * p.element_size(), id(p)))
    spans.sort()
    out: set = set()
    max_end = -1
    for k, (dev, start, end, pid) in enumerate(spans):
        if k and spans[k - 1][0] != dev:
            max_end = -1
        if start < max_end:  # overlaps one that starts earlier
            out.add(pid)
        if k + 1 < len(spans) and spans[k + 1][0] == dev and spans[k + 1][1] < end:
            out.add(pid)  # overlaps the next one to start
        max_end = max(max_end, end)
    return out


def _warn_left_out(
    optimizer: torch.optim.Optimizer, info: _FusedInfo, reason: str, ids: set, shapes: bool = True
) -> None:
    """Once per optimizer and ``reason``: which parameters stay out of the flat buffers, and why."""
    flag = f"warned_{reason}"
    if getattr(info, flag):
        return
    setattr(info, flag, True)
    n, names = _param_names(optimizer, ids, shapes)
    if reason == "shared":
        text = (
            "parameters whose memory overlaps (views of one tensor) would stop sharing it in the flat "
            "buffers, so they stay where they are and torch updates them per tensor: "
            f"{names}. flat_buffers(optimizer, 'grad') does not hold their gradients."
        )
    elif reason == "shm":
        text = (
            f"{n} parameters live in shared memory (model.share_memory(), e.g. Hogwild training); moving "
            "them into the flat buffers would take them out of it, so the other processes would stop "
            "seeing their updates. They stay where they are and torch updates them per tensor (not "
            f"fused): {names}."
        )
    elif reason == "duplicate":
        text = (
            "a parameter listed more than once in the optimizer's param groups (torch warns about this "
            "and updates it once per listing) stays where it is, and torch updates it per tensor, as often "
            f"as it is listed (not fused). The listings: {names}."
        )
    else:  # "held"
        text = (
            f"{n} parameters are already in the flat buffers of another fused optimizer (two optimizers "
            "over the same parameters). Moving them here would take them out of that optimizer's "
            "buffers, and each would re-fuse at every step, so they stay there and this optimizer "
            f"updates them per tensor through torch (not fused): {names}."
        )
    _warn(f"fuse_optimizer: {text}")


def _param_names(optimizer: torch.optim.Optimizer, ids: set, shapes: bool) -> Tuple[int, str]:
    """How many of the optimizer's parameters have their ``id()`` in ``ids``, and the first 8 named."""
    names = [
        f"param group {gi} parameter {pi}" + (f" (shape {tuple(p.shape)})" if shapes else "")
        for gi, g in enumerate(optimizer.param_groups)
        for pi, p in enumerate(g["params"])
        if id(p) in ids
    ]
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return len(names), ", ".join(names[:8]) + more


def _outside_with_grad(info: _FusedInfo) -> Dict[int, List[torch.Tensor]]:
    out: Dict[int, List[torch.Tensor]] = {}
    for gi, ps in enumerate(info.outside):
        with_grad = [p for p in ps if p.grad is not None]
        if with_grad:
            out[gi] = with_grad
    return out


def _flatten_state(optimizer: torch.optim.Optimizer, bucket: _Bucket, indices: Iterable[int]) -> None:
    """Move the per-element state tensors of the given params into the bucket's flat state."""
    state = optimizer.state
    for i in indices:
        p = bucket.params[i]
        st = state.get(p)
        if not st:
            continue
        for key, val in list(st.items()):
            if not _per_element(val, p):
                continue
            if val.dtype != bucket.dtype:
                # e.g. model.double() after state exists: the kernels take one dtype per bucket,
                # so this param stays per tensor and torch does what it does with mixed dtypes
                continue
            view = bucket.state_view(key, i, val)
            if val is view:
                continue
            with torch.no_grad():
                view.copy_(val)
            st[key] = view


def _per_element(val: Any, p: torch.Tensor) -> bool:
    return (
        isinstance(val, torch.Tensor)
        and val.dim() > 0
        and val.layout == torch.strided
        and val.shape == p.shape
        and val.device == p.device
        and val.is_floating_point()
    )


def _install_hooks(info: _FusedInfo, bucket: _Bucket) -> None:
    """Keep gradients landing in the flat gradient buffer.

    torch 2's ``zero_grad()`` sets ``p.grad = None``; the next backward then allocates a fresh
    gradient. A post-accumulate-grad hook copies it into the parameter's flat view and re-points
    ``p.grad`` there, so the flat buffer always holds the gradients (and a collective on it
    reaches every parameter). While ``p.grad`` already is the view, autograd accumulates into it
    in place and the hook does nothing.

    A parameter that does not require grad now cannot take a hook; it is remembered in
    ``bucket.unhooked``, and once unfrozen it is adopted at the end of the first backward that
    reaches any hooked parameter of the optimizer (:func:`_adopt_unfrozen`, queued by the hooks),
    so its gradient is in the flat buffer before a collective runs on it.
    """
    bucket.unhooked = []
    for i, p in enumerate(bucket.params):
        if p.requires_grad:
            bucket.hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(info, bucket, i)))
        else:
            bucket.unhooked.append(i)


#: The running backward pass's id (torch 2.x; without it the adoption is queued from every hook).
_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def _grad_hook(info: _FusedInfo, bucket: _Bucket, i: int) -> Callable[[torch.Tensor], None]:
    ref = weakref.ref(bucket)
    info_ref = weakref.ref(info)

    def hook(param: torch.Tensor) -> None:
        b = ref()
        if b is None or i >= len(b.params) or b.params[i] is not param:
            return
        _to_flat(b, i, param)
        owner = info_ref()
        if owner is not None and owner.unhooked_any:
            # Once per backward pass: adopt parameters unfrozen since fusing when it ends.
            task = _GRAPH_TASK_ID() if _GRAPH_TASK_ID is not None else None
            if task is None or owner.adopt_task != task:
                owner.adopt_task = task
                torch.autograd.Variable._execution_engine.queue_callback(lambda: _adopt_unfrozen(owner))

    return hook


def _to_flat(b: _Bucket, i: int, param: torch.Tensor) -> None:
    """Copy ``param``'s gradient into its flat view and re-point ``param.grad`` there."""
    g = param.grad
    if g is None or g is b.grad_views[i] or g.is_sparse:
        return  # sparse: fuse_step falls back to torch's own handling for this parameter
    if g.requires_grad:
        return  # backward(create_graph=True): keep the gradient's graph, as torch does (fuse_step copies it)
    _grad_into_slot(b, i)


def _grad_into_slot(b: _Bucket, i: int) -> None:
    """A gradient of its own (status 2: ``p.grad = t``, ``p.grad.data = t`` or ``set_``, a gradient
    with a graph from ``backward(create_graph=True)``) into its slot of the flat buffer, and
    ``p.grad`` re-pointed there (the graph is not kept: the step and a collective on the buffer
    must see the same tensor). One of another shape, dtype or device stays (torch's own handling)."""
    p = b.params[i]
    g, view = cast(torch.Tensor, p.grad), b.grad_views[i]
    if g is view:  # the view object itself was re-pointed (p.grad.data = t, set_)
        view = b.grad_views[i] = b._view(b.flat_grad, i)
    if g.shape == view.shape and g.dtype == view.dtype and g.device == view.device:
        with torch.no_grad():
            view.copy_(g)
        p.grad = view


def _adopt_unfrozen(info: _FusedInfo) -> None:
    """Give parameters that require grad since their hooks were installed a hook, and move the
    gradient they already have into the flat buffer."""
    if not info.unhooked_any:
        return
    for b in info.buckets:
        if not b.unhooked:
            continue
        still = []
        for i in b.unhooked:
            p = b.params[i]
            if not p.requires_grad:
                still.append(i)
                continue
            b.hooks.append(p.register_post_accumulate_grad_hook(_grad_hook(info, b, i)))
            _to_flat(b, i, p)
        b.unhooked = still
    info.unhooked_any = any(b.unhooked for b in info.buckets)


def _sync(
    optimizer: torch.optim.Optimizer, info: _FusedInfo, moved: Optional[str] = None, quiet: bool = False
) -> bool:
    """Detect changes made behind the fused layout's back and re-fuse; True if it re-fused.

    ``quiet``: called after ``load_state_dict()``, whose changes are expected (logged, no warning).
    """
    reason = moved
    groups = optimizer.param_groups
    if reason is not None:
        pass
    elif len(groups) != len(info.groups):
        reason = f"param groups changed ({len(info.groups)} -> {len(groups)})"
    elif optimizer.state is not info.state_obj:
        reason = "optimizer state was replaced"
    else:
        for gi, g in enumerate(groups):
            if g is not info.groups[gi]:
                reason = f"param group {gi} was replaced"
                break
            if not _K.same_objects(g["params"], info.group_params[gi]):
                reason = f"the parameters of param group {gi} changed"
                break
    if reason is None:
        return False
    if info.check_flatten and not info.warned and not quiet:
        _warn(f"fuse_step: {reason}; re-fusing the optimizer's flat buffers")
        info.warned = True
    logger.info("re-fusing %s: %s", type(optimizer).__name__, reason)
    # Fused, then wrapped by trainloom.comm.optimizers (load_state_dict on the wrapper re-fuses): checked
    # as the class it wraps, whose step() the wrapper runs after communicating.
    _check_supported(optimizer, getattr(type(optimizer), "_tl_base", None))
    info.fast = None
    if info.do_flatten:
        _build(optimizer, info)
    else:
        info.groups = list(groups)
        info.group_params = [list(g["params"]) for g in groups]
        info.state_obj = optimizer.state
        info.shared = _kept_apart([p for g in groups for p in g["params"]])
    return True


def _moved(info: _FusedInfo) -> Optional[str]:
    for b in info.buckets:
        for i, p in enumerate(b.params):
            if p.data_ptr() != b.ptrs[i] or p.stride() != b.strides[i]:
                return (
                    f"parameter {i} of param group {b.group_index} no longer lives in the flat buffer "
                    "(p.data was replaced)"
                )
    return None


# --------------------------------------------------------------------------------------------
# Stepping
# --------------------------------------------------------------------------------------------


def fuse_step(optimizer: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
    """Perform a fused parameter update.

    Gradients that are not in the flat gradient buffer (set by hand, or by code that replaced
    ``p.grad``) are copied there first; parameters whose gradient is None are skipped exactly as
    ``step()`` skips them; sparse gradients are handed to ``step()`` and get torch's own handling
    (an error for Adam). Param groups added after fusing, replaced parameters and loaded state
    are detected and re-fused first.

    Args:
        optimizer: an optimizer returned by :func:`fuse_optimizer`.
        closure: reevaluates the model and returns the loss (optional, as for ``step``).

    Returns:
        The closure's loss, or None.

    Raises:
        FuseError: if ``optimizer`` is not fused.

    Example::

        >>> opt = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        >>> for x in batches:
        ...     model(x).sum().backward()
        ...     opt.fuse_step()
        ...     opt.zero_grad()
    """
    info = _info(optimizer, "fuse_step")
    # An LR scheduler tracks "optimizer stepped before scheduler" by wrapping the instance's step
    # (an instance attribute; looked up in __dict__: hasattr on the bound method costs ~0.7 us).
    lr_step = optimizer.__dict__.get("step")
    if lr_step is not None and hasattr(lr_step, "_wrapped_by_lr_sched"):
        optimizer._opt_called = True  # type: ignore[attr-defined]  # fuse_step is a step too
    if (
        _GLOBAL_PRE_HOOKS
        or _GLOBAL_POST_HOOKS
        or optimizer._optimizer_step_pre_hooks
        or len(optimizer._optimizer_step_post_hooks) > 1  # fuse_optimizer registered one
        or _profiler_enabled()
    ):
        return _with_step_hooks(optimizer, info, closure)
    return _fuse_step(optimizer, info, closure)


def _with_step_hooks(
    optimizer: torch.optim.Optimizer, info: _FusedInfo, closure: Optional[Callable[[], Any]]
) -> Any:
    """:func:`fuse_step` as torch's ``step()`` wrapper runs ``step()``: the global and the
    optimizer's step pre-hooks (which may replace the arguments), the update, then the post-hooks,
    inside the profiler's ``Optimizer.step#<class>.step`` range. Once per ``fuse_step``, with the
    real param groups; the internal ``step()`` calls of the torch-math paths run no hooks."""
    args: Tuple[Any, ...] = (optimizer,) if closure is None else (optimizer, closure)
    kwargs: Dict[str, Any] = {}
    profiling = _profiler_enabled()
    name = f"Optimizer.step#{type(optimizer).__name__}.step"
    with torch.autograd.profiler.record_function(name) if profiling else contextlib.nullcontext():
        for hook in itertools.chain(_GLOBAL_PRE_HOOKS.values(), optimizer._optimizer_step_pre_hooks.values()):
            result = hook(optimizer, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"fuse_step: the step pre-hook {hook!r} must return None or a tuple of "
                        f"(new_args, new_kwargs), but got {result!r}"
                    )
                args, kwargs = result
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        out = _fuse_step(optimizer, info, closure)
        optimizer._optimizer_step_code()
        mine = info.step_hook.id
        post = itertools.chain(optimizer._optimizer_step_post_hooks.items(), _GLOBAL_POST_HOOKS.items())
        for key, hook in post:
            if key != mine:
                hook(optimizer, args, kwargs)
    return out


def _torch_step(optimizer: torch.optim.Optimizer) -> None:
    """torch's ``step()`` of the optimizer's class without the step hooks (fuse_step runs them). For
    an optimizer wrapped by trainloom.comm.optimizers, the wrapped class's: the wrapper's own step()
    would communicate a second time (fuse_step already did, through ``_tl_before_step``)."""
    cls = type(optimizer)
    _peel_profiling(getattr(cls, "_tl_base", cls).step)(optimizer)


def _fuse_step(
    optimizer: torch.optim.Optimizer, info: _FusedInfo, closure: Optional[Callable[[], Any]]
) -> Any:
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    # A distributed wrapper (trainloom.comm.optimizers) finishes its communication first.
    before = optimizer.__dict__.get("_tl_before_step")
    if before is not None:
        before(optimizer)
    _sync(optimizer, info)
    if info.do_flatten:
        if info.fast is not None and _step_fast(optimizer, info):
            return loss
        _step_flat(optimizer, info)
    else:
        if not _sparse_fallback(optimizer, info):
            _step_adjacent(optimizer, info)
    return loss


def _sparse_fallback(optimizer: torch.optim.Optimizer, info: _FusedInfo) -> bool:
    """Sparse gradients: torch's own step() (SGD and Adagrad update, the others raise)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and g.is_sparse:
                info.fast = None
                _torch_step(optimizer)
                for b in info.buckets:
                    _flatten_state(optimizer, b, range(len(b.params)))
                return True
    return False


#: Configuration flags: compared by value.
_CFG_FLAGS = (
    "fused",
    "foreach",
    "differentiable",
    "capturable",
    "amsgrad",
    "maximize",
    "nesterov",
    "decoupled_weight_decay",
)
#: Hyperparameters: compared by type (float vs Tensor decides the math torch runs).
_CFG_NUMBERS = ("lr", "weight_decay", "eps", "dampening")


def _cfg_key(group: Dict[str, Any]) -> Tuple[Any, ...]:
    """What decides the kernel choice: flags by value, numbers by type (float vs Tensor); and
    whether SGD's momentum is 0 (torch then keeps no momentum buffer, and creates one at the
    first step with momentum). Computed on every fuse_step: kept to a few list comprehensions."""
    get = group.get
    betas = get("betas")
    momentum = get("momentum")
    return (
        tuple([get(k) for k in _CFG_FLAGS]),
        tuple([type(get(k)) for k in _CFG_NUMBERS]),
        None if betas is None else tuple([type(b) for b in betas]),
        None if momentum is None else (type(momentum), bool(momentum == 0)),
    )


def _scan(b: _Bucket, state: Any, light: bool = False) -> None:
    """Refresh ``b.status`` (and the pointer array) for the bucket's parameters, grads and state
    (compiled; ``light`` skips the state checks, for the fast path)."""
    _K.scan(
        b.params,
        b.grad_views,
        b.ptr_arr,
        b.grad_ptr_arr,
        state,
        b.keys,
        b.key_views,
        b.step_objs,
        b.n_extra,
        b.status,
        light,
    )


def _step_fast(optimizer: torch.optim.Optimizer, info: _FusedInfo) -> bool:
    """Repeat the previous step's kernel runs when nothing about the layout changed."""
    fast = info.fast
    if fast is None:
        return False
    if _scaled(optimizer):  # GradScaler's unscale and skip happen in torch's step; see _kernel_for
        info.fast = None
        return False
    state = optimizer.state
    groups = optimizer.param_groups
    # State cleared, deleted, replaced or emptied by hand, or a state tensor replaced (a warm
    # restart, a re-initialised layer): torch starts it afresh or steps the new tensor, so must the
    # slow path.
    if type(state) is not info.state_type or not _K.same_state(
        state, info.state_dicts, info.state_sizes, info.state_values
    ):
        info.fast = None
        return False
    for b in info.buckets:
        if b.state_views and b.state_repointed():  # the slow path repairs it
            info.fast = None
            return False
        # light: the state tensors are only re-checked on the slow path; step() and
        # load_state_dict() invalidate info.fast (step post-hook, state identity in _sync).
        _scan(b, state, light=True)
        if b.status.tobytes() != b.fast_status or _cfg_key(groups[b.group_index]) != b.cfg:
            info.fast = None
            return False
    for _kern, _b, run in fast:
        # A step counter set in place (st["step"].zero_() at a warm restart) changes the math.
        if run.step_ptrs is not None and not _K.steps_equal(run.step_ptrs, run.sig):
            info.fast = None
            return False
    for kern, b, run in fast:
        kern.run(optimizer, groups[b.group_index], b, run)
    outside = _outside_with_grad(info)
    if outside:
        _step_torch(optimizer, info, outside, [], keep_fast=True)
    return True


class _Run:
    __slots__ = ("bucket", "idx", "sig", "step_ptrs")

    def __init__(self, bucket: _Bucket, idx: List[int], sig: Any) -> None:
        self.bucket = bucket
        self.idx = idx
        self.sig = sig
        self.step_ptrs: Optional[np.ndarray] = None


def _scalar_sig(st: Dict[Any, Any], flat_keys: Iterable[Any]) -> Any:
    items: List[Tuple[Any, ...]] = []
    for k, v in st.items():
        if k in flat_keys:
            continue
        if isinstance(v, torch.Tensor):
            if v.dim() != 0:
                return None  # unexpected non-scalar state: keep this param per tensor
            items.append((k, v.dtype, v.device, v.item()))
        else:
            items.append((k, v))
    items.sort(key=lambda kv: repr(kv[0]))
    return tuple(items)


def _scan_args(b: _Bucket, kern: Optional[_Kernel]) -> None:
    b.keys = tuple(b.state_views)
    b.key_views = [b.state_views[k] for k in b.keys]
    if isinstance(kern, _AdamKernel):
        if b.step_objs is None:
            b.step_objs = [None] * len(b.params)
        b.n_extra = 1
    else:
        b.step_objs = None
        b.n_extra = 0 if isinstance(kern, _SgdKernel) else -1


def _record_state(info: _FusedInfo, state: Any) -> None:
    """Remember the state's dicts and sizes for the fast path's check (:func:`_step_fast`)."""
    if isinstance(state, dict) and all(type(v) is dict for v in state.values()):
        info.state_type = type(state)
        info.state_dicts = list(state.values())
        info.state_sizes = np.fromiter((len(v) for v in info.state_dicts), dtype=np.int64)
        info.state_values = [x for d in info.state_dicts for x in d.values()]
    else:  # an unusual state container: no fast path
        info.fast = None


def _step_flat(optimizer: torch.optim.Optimizer, info: _FusedInfo) -> None:
    if _sparse_fallback(optimizer, info):
        return
    _adopt_unfrozen(info)
    state = optimizer.state
    groups = optimizer.param_groups
    for _ in range(2):
        moved = None
        for b in info.buckets:
            if b.state_views and b.state_repointed():
                b.repair_state(state)
            kern = _kernel_for(optimizer, groups[b.group_index], b)
            _scan_args(b, kern)
            _scan(b, state)
            if (b.status == 4).any():
                moved = _moved(info) or "a parameter no longer lives in the flat buffer"
                break
        if moved is None:
            break
        _sync(optimizer, info, moved)
    loose: Dict[int, List[torch.Tensor]] = {}
    runs: List[Tuple[_Kernel, _Bucket, _Run]] = []
    generic: List[_Run] = []
    for b in info.buckets:
        group = groups[b.group_index]
        kern = _kernel_for(optimizer, group, b)
        _scan_args(b, kern)
        status = b.status
        if (status == 2).any():
            for i in np.flatnonzero(status == 2).tolist():
                _grad_into_slot(b, i)
            _scan(b, state)
        stateless = isinstance(optimizer, torch.optim.SGD) and group["momentum"] == 0
        # Without a compiled kernel that reproduces torch's per-tensor rounding, stay per tensor.
        per_tensor = kern is None and _cpu_tails_differ(group, b)
        flat_keys = b.state_flat.keys()
        run_idx: List[int] = []
        run_sig: Any = None
        for i, code in enumerate(status.tolist()):
            sig = None
            eligible = False
            if code != 1:
                p = b.params[i]
                st = state.get(p)
                if code == 0 or (code == 3 and p.grad is b.grad_views[i]):
                    if not st:
                        eligible = stateless
                        sig = 0
                    elif _state_is_flat(st, b, i):
                        if kern is not None:
                            sig = kern.signature(st, b, i)
                        else:
                            sig = _scalar_sig(st, flat_keys)
                        eligible = sig is not None
                if per_tensor:
                    eligible = False
                if not eligible:
                    loose.setdefault(b.group_index, []).append(p)
            if eligible and run_idx and sig == run_sig and i == run_idx[-1] + 1:
                run_idx.append(i)
                continue
            if run_idx:
                (runs if kern is not None else generic).append(_Run(b, run_idx, run_sig))  # type: ignore[arg-type]
                run_idx = []
            if eligible:
                run_idx = [i]
                run_sig = sig
        if run_idx:
            (runs if kern is not None else generic).append(_Run(b, run_idx, run_sig))  # type: ignore[arg-type]
    kernel_runs = []
    for run in runs:
        b = run.bucket  # type: ignore[attr-defined]
        kern = _kernel_for(optimizer, groups[b.group_index], b)
        kernel_runs.append((kern, b, run))
        kern.run(optimizer, groups[b.group_index], b, run)  # type: ignore[union-attr, arg-type]
    outside = _outside_with_grad(info)
    if not loose and not generic:
        # Steady state: remember this layout; the next fuse_step only re-checks it (_step_fast).
        for b in info.buckets:
            _scan(b, state)
            b.fast_status = b.status.tobytes()
            b.cfg = _cfg_key(groups[b.group_index])
        info.fast = kernel_runs
        if outside:
            _step_torch(optimizer, info, outside, [], keep_fast=True)
        _record_state(info, state)
        return
    for gi, ps in outside.items():
        loose.setdefault(gi, []).extend(ps)
    _step_torch(optimizer, info, loose, generic)


def _step_torch(
    optimizer: torch.optim.Optimizer,
    info: _FusedInfo,
    loose: Dict[int, List[torch.Tensor]],
    generic: List[_Run],
    keep_fast: bool = False,
) -> None:
    """torch's own step over loose parameters and over flat views of the generic runs."""
    state = optimizer.state
    shadow: Dict[int, List[torch.Tensor]] = {gi: list(ps) for gi, ps in loose.items()}
    shadow_states: List[Tuple[torch.Tensor, _Run, Dict[Any, Any]]] = []
    for run in generic:
        b = run.bucket
        # torch's own math on a flat view covering the run (alignment padding included: it is
        # zero in params, grads and state, and every elementwise update maps zeros to zeros).
        first, last = run.idx[0], run.idx[-1]
        start, end = b.offsets[first], b.offsets[last] + b.numels[last]
        sp = b.flat_param[start:end]
        sp.grad = b.flat_grad[start:end]
        # get, not []: torch's state is a defaultdict, and a stateless run (SGD without momentum)
        # must not leave an empty dict per parameter behind (torch's state_dict() has none)
        st0 = state.get(b.params[first], {})
        sst: Dict[Any, Any] = {}
        for k, v in st0.items():
            if k in b.state_flat:
                sst[k] = b.state_flat[k][start:end]
            else:
                sst[k] = v.clone() if isinstance(v, torch.Tensor) else v
        shadow.setdefault(b.group_index, []).append(sp)
        shadow_states.append((sp, run, sst))
    if not shadow:
        return
    if not keep_fast:
        info.fast = None
    saved_groups = optimizer.param_groups
    shadow_groups = []
    for gi, g in enumerate(saved_groups):
        sg = dict(g)
        sg["params"] = shadow.get(gi, [])
        shadow_groups.append(sg)
    for sp, _, sst in shadow_states:
        state[sp] = sst
    optimizer.param_groups = shadow_groups
    try:
        _torch_step(optimizer)
    finally:
        optimizer.param_groups = saved_groups
        for sp, _, _ in shadow_states:
            state.pop(sp, None)
    for _sp, run, sst in shadow_states:
        b = run.bucket
        scalars = [(k, v) for k, v in sst.items() if k not in b.state_flat]
        if not scalars:  # nothing but flat state (already in place), or no state at all
            continue
        for i in run.idx:
            st = state[b.params[i]]
            for k, v in scalars:
                cur = st.get(k)
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == v.shape:
                    cur.copy_(v)
                else:
                    st[k] = v.clone() if isinstance(v, torch.Tensor) else v
    # State that torch created lazily for loose params goes into the flat buffers.
    for b in info.buckets:
        if b.group_index in loose:
            ids = {id(p) for p in loose[b.group_index]}
            _flatten_state(optimizer, b, [i for i, p in enumerate(b.params) if id(p) in ids])


def _state_is_flat(st: Dict[Any, Any], b: _Bucket, i: int) -> bool:
    n_flat = 0
    for k, v in st.items():
        views = b.state_views.get(k)
        if views is not None:
            if views[i] is not v:
                return False
            n_flat += 1
        elif isinstance(v, torch.Tensor) and v.dim() > 0:
            return False
    return n_flat == len(b.state_views)


def _step_adjacent(optimizer: torch.optim.Optimizer, info: _FusedInfo) -> None:
    """do_flatten=False: fuse only what already is adjacent in memory; the rest per tensor."""
    state = optimizer.state
    saved_groups = optimizer.param_groups
    shadow_groups = []
    shadow_states: List[Tuple[torch.Tensor, List[torch.Tensor], Dict[Any, Any]]] = []
    for g in saved_groups:
        with_grad = [p for p in g["params"] if p.grad is not None]
        # Parameters sharing memory keep their relative order in torch's step (the spans go first).
        # info.shared also holds the parameters listed twice: a span would replace all their listings.
        ready = [p for p in with_grad if state.get(p) and _fusable_param(p) and id(p) not in info.shared]
        # A span of those would not be bitwise equal to torch's steps per tensor: they stay per tensor.
        ready = [p for p in ready if not _cpu_tails_differ(g, p)]
        keys = sorted({k for p in ready for k, v in state[p].items() if _per_element(v, p)}, key=repr)
        ready = [p for p in ready if all(_per_element(state[p].get(k), p) for k in keys)]
        lists = [ready, [p.grad for p in ready]] + [[state[p][k] for p in ready] for k in keys]
        fused_ids: set = set()
        params: List[torch.Tensor] = []
        for grp in calculate_mutual_groups(lists) if ready else []:
            members = [ready[i] for i in grp]
            sigs = {_scalar_sig(state[p], keys) for p in members}
            if len(sigs) != 1 or None in sigs:
                continue
            sp = _span(members)
            sp.grad = _span([p.grad for p in members])
            sst = {k: _span([state[p][k] for p in members]) for k in keys}
            for k, v in state[members[0]].items():
                if k not in sst:
                    sst[k] = v.clone() if isinstance(v, torch.Tensor) else v
            shadow_states.append((sp, members, sst))
            params.append(sp)
            fused_ids.update(id(p) for p in members)
        params.extend(p for p in with_grad if id(p) not in fused_ids)
        sg = dict(g)
        sg["params"] = params
        shadow_groups.append(sg)
    for sp, _, sst in shadow_states:
        state[sp] = sst
    optimizer.param_groups = shadow_groups
    try:
        _torch_step(optimizer)
    finally:
        optimizer.param_groups = saved_groups
        for sp, _, _ in shadow_states:
            state.pop(sp, None)
    for _, members, sst in shadow_states:
        for p in members:
            st = state[p]
            for k, v in sst.items():
                if isinstance(v, torch.Tensor) and v.dim() == 0 and isinstance(st.get(k), torch.Tensor):
                    st[k].copy_(v)
                elif not isinstance(v, torch.Tensor):
                    st[k] = v


def _cpu_tails_differ(group: Dict[str, Any], t: Any) -> bool:
    """Whether torch's CPU step rounds the tail of each tensor (a parameter, or a bucket's ``t``)
    differently from the rest, so that the same step on a flat view or span is not bitwise equal.

    torch's fused=True CPU kernels round the last (numel % vector width) elements of each tensor
    differently; ATen's CPU bf16/fp16 kernels do too (SGD, RMSprop, ASGD: measured). CUDA's fused
    kernels compute every element the same way."""
    wide = t.dtype in (torch.float32, torch.float64)
    return t.device.type == "cpu" and (bool(group.get("fused")) or not wide)


def _span(ts: List[torch.Tensor]) -> torch.Tensor:
    """A 1-D view over adjacent contiguous tensors (checked by calculate_mutual_groups)."""
    t0 = ts[0]
    n = sum(t.numel() for t in ts)
    return t0.as_strided((n,), (1,), t0.storage_offset())


# --------------------------------------------------------------------------------------------
# Compiled kernels
# --------------------------------------------------------------------------------------------


def _nthreads(n: int) -> int:
    return 1 if n < _PARALLEL_MIN else max(1, torch.get_num_threads())


def _is_float(x: Any) -> bool:
    return isinstance(x, (float, int)) and not isinstance(x, bool)


class _Kernel:
    """Per (optimizer class, configuration): how a run is updated by the compiled kernel."""

    def signature(self, st: Dict[Any, Any], b: _Bucket, i: int) -> Any:  # pragma: no cover
        raise NotImplementedError

    def run(self, opt: Any, group: Dict[str, Any], b: _Bucket, run: _Run) -> None:  # pragma: no cover
        raise NotImplementedError


_PlanT = Tuple[np.ndarray, np.ndarray, np.ndarray, int]


def _kept_plan(b: _Bucket, key: Any, plan: _PlanT) -> _PlanT:
    """Keep ``plan`` in ``b``'s plan cache under ``key`` (emptied when it holds more than 64)."""
    if len(b.plan_cache) > 64:
        b.plan_cache.clear()
    b.plan_cache[key] = plan
    return plan


def _plan(b: _Bucket, run: _Run, body_mod: int) -> _PlanT:
    key = (run.idx[0], run.idx[-1], body_mod)
    plan = b.plan_cache.get(key)
    if plan is not None:  # every step after the first takes this path
        return plan
    starts = np.array([b.offsets[i] for i in run.idx], dtype=np.int64)
    lens = np.array([b.numels[i] for i in run.idx], dtype=np.int64)
    bodies = lens - lens % body_mod if body_mod > 1 else lens.copy()
    return _kept_plan(b, key, (*_K.make_plan(starts, lens, bodies, _CHUNK), int(lens.sum())))


#: ATen's elementwise CPU loops (cpu_kernel_vec) hand each thread one chunk of a tensor of more than
#: this many elements (TensorIterator's grain size, at::internal::GRAIN_SIZE).
_ATEN_GRAIN = 32768


def _maximum_plan(b: _Bucket, run: _Run) -> _PlanT:
    """A plan for the for-loop/foreach AMSGrad kernels whose "body" of each segment is what torch's
    ``torch.maximum(max_exp_avg_sq, exp_avg_sq)`` computes in its vector loop: a NaN there is the
    all-ones NaN, in the scalar tail the quiet NaN (see the .pyx).

    ATen's loop runs two 32-byte vectors at a time from the start of each tensor, or of each thread's
    chunk of it when the tensor has more than ``_ATEN_GRAIN`` elements and torch runs more than one
    thread: ``min(threads, ceil(n / grain))`` chunks of ``ceil(n / chunks)`` elements
    (at::parallel_for over OpenMP). So the segments are those chunks, with a body of ``len - len % w``
    (w: 16 float32, 8 float64 elements)."""
    threads = torch.get_num_threads()  # ~0.1 us; a run without big tensors caches one plan per count
    key = (run.idx[0], run.idx[-1], "maximum", threads)
    plan = b.plan_cache.get(key)
    if plan is not None:
        return plan
    width = 64 // b.flat_param.element_size()
    starts: List[int] = []
    lens: List[int] = []
    for i in run.idx:
        n = b.numels[i]
        chunks = min(threads, -(-n // _ATEN_GRAIN)) if n > _ATEN_GRAIN else 1
        size = max(1, -(-n // chunks))
        for off in range(0, n, size):
            starts.append(b.offsets[i] + off)
            lens.append(min(size, n - off))
    lens_a = np.array(lens, dtype=np.int64)
    starts_a = np.array(starts, dtype=np.int64)
    plan = (*_K.make_plan(starts_a, lens_a, lens_a - lens_a % width, _CHUNK), int(lens_a.sum()))
    return _kept_plan(b, key, plan)


def _dtype_code(dt: torch.dtype) -> int:
    return _K.DTYPE_F32 if dt == torch.float32 else _K.DTYPE_F64


class _SgdKernel(_Kernel):
    def __init__(self, fused: bool) -> None:
        self.fused = fused

    def signature(self, st: Dict[Any, Any], b: _Bucket, i: int) -> Any:
        return 0  # SGD keeps no scalar state

    def run(self, opt: Any, group: Dict[str, Any], b: _Bucket, run: _Run) -> None:
        # torch's fused=True kernel rounds the momentum update of each tensor's scalar tail
        # differently from its vector body; the for-loop/foreach paths use one formula.
        plan = _plan(b, run, _FUSED_SPLIT[("sgd", b.dtype)] if self.fused else 1)
        mom = float(group["momentum"])
        buf = b.state_flat.get("momentum_buffer") if mom != 0 else None
        _K.sgd_step(
            _dtype_code(b.dtype),
            b.flat_param.data_ptr(),
            b.flat_grad.data_ptr(),
            buf.data_ptr() if buf is not None else 0,
            plan[0],
            plan[1],
            plan[2],
            float(group["lr"]),
            float(group["weight_decay"]),
            mom,
            float(group["dampening"]),
            bool(group["nesterov"]),
            bool(group["maximize"]),
            False,
            1 if self.fused else 0,
            _nthreads(plan[3]),
        )


class _AdamKernel(_Kernel):
    def __init__(self, fused: bool, decoupled: bool, amsgrad: bool) -> None:
        self.fused = fused
        self.decoupled = decoupled
        self.amsgrad = amsgrad

    def signature(self, st: Dict[Any, Any], b: _Bucket, i: int) -> Any:
        s = st.get("step")
        if (
            not isinstance(s, torch.Tensor)
            or s.dim() != 0
            or s.dtype != torch.float32
            or s.device.type != "cpu"
        ):
            return None
        if len(st) != (4 if self.amsgrad else 3):
            return None
        if b.step_objs is not None:
            b.step_objs[i] = s  # scan() then checks identity; run() bumps it through its pointer
        return s.item()

    def _loop_plan(self, b: _Bucket, run: _Run, beta1: float) -> _PlanT:
        """The plan of the for-loop/foreach kernels: with AMSGrad, segments ending where
        torch.maximum's vector loop ends in each tensor (the NaN it gives there differs), and with
        beta1 == 0 where lerp's does (its scalar tail gives +0.0 where its vector loop gives -0.0)."""
        return _maximum_plan(b, run) if self.amsgrad or beta1 == 0 else _plan(b, run, 1)

    def run(self, opt: Any, group: Dict[str, Any], b: _Bucket, run: _Run) -> None:
        if run.step_ptrs is None:
            steps = [b.step_objs[i] for i in run.idx]  # type: ignore[index]
            run.step_ptrs = np.fromiter((s.data_ptr() for s in steps), dtype=np.int64, count=len(steps))
        # torch counts in a float32 tensor: step_t += 1, then item()
        step = float(np.float32(run.sig) + np.float32(1.0))
        run.sig = step
        beta1, beta2 = group["betas"]
        beta1 = float(beta1)
        beta2 = float(beta2)
        lr = float(group["lr"])
        wd = float(group["weight_decay"])
        eps = float(group["eps"])
        bc1 = 1 - beta1**step
        bc2 = 1 - beta2**step
        # torch's fused kernel takes sqrt in C++; its for-loop/foreach paths use Python's ** 0.5.
        bc2s = math.sqrt(bc2) if self.fused else bc2**0.5
        sf = b.state_flat
        vmax = sf["max_exp_avg_sq"].data_ptr() if self.amsgrad else 0
        code = _dtype_code(b.dtype)
        decay = (1 - lr * wd) if self.decoupled else 1.0
        if not self.fused and _vml_ready():
            # torch's for-loop and foreach paths in one cache-blocked pass, with torch's own sqrt
            plan = self._loop_plan(b, run, beta1)
            _K.adam_loop_step(
                code,
                b.flat_param.data_ptr(),
                b.flat_grad.data_ptr(),
                sf["exp_avg"].data_ptr(),
                sf["exp_avg_sq"].data_ptr(),
                vmax,
                plan[0],
                plan[1],
                plan[2],
                1 - beta1,
                beta2,
                1 - beta2,
                bc2s,
                eps,
                -(lr / bc1),
                wd if not self.decoupled else 0.0,
                decay,
                self.amsgrad,
                bool(group["maximize"]),
                (wd != 0 and not self.decoupled),
                (wd != 0 and self.decoupled),
                _nthreads(plan[3]),
            )
            _K.bump_steps(run.step_ptrs, 1.0)
            return
        if not self.fused:
            # torch's for-loop and foreach paths: the same rounding sequence, but the square root
            # comes from torch (MKL's vectorised sqrt is not correctly rounded): moments kernel,
            # torch.sqrt over the run's flat range, then the update kernel.
            plan = self._loop_plan(b, run, beta1)
            n = plan[3]
            nt = _nthreads(n)
            _K.adam_moments(
                code,
                b.flat_param.data_ptr(),
                b.flat_grad.data_ptr(),
                sf["exp_avg"].data_ptr(),
                sf["exp_avg_sq"].data_ptr(),
                vmax,
                plan[0],
                plan[1],
                plan[2],
                1 - beta1,
                beta2,
                1 - beta2,
                wd if not self.decoupled else 0.0,
                self.amsgrad,
                bool(group["maximize"]),
                (wd != 0 and not self.decoupled),
                nt,
            )
            first, last = run.idx[0], run.idx[-1]
            start, end = b.offsets[first], b.offsets[last] + b.numels[last]
            if b.scratch is None:
                b.scratch = torch.empty(b.length, dtype=b.dtype, device=b.device)
            src = sf["max_exp_avg_sq"] if self.amsgrad else sf["exp_avg_sq"]
            torch.sqrt(src[start:end], out=b.scratch[start:end])
            _K.adam_apply(
                code,
                b.flat_param.data_ptr(),
                sf["exp_avg"].data_ptr(),
                b.scratch.data_ptr(),
                plan[0],
                plan[1],
                bc2s,
                eps,
                -(lr / bc1),
                decay,
                (wd != 0 and self.decoupled),
                nt,
            )
            _K.bump_steps(run.step_ptrs, 1.0)
            return
        plan = _plan(b, run, _FUSED_SPLIT[("adam", b.dtype)])
        n = plan[3]
        _K.adam_step(
            code,
            b.flat_param.data_ptr(),
            b.flat_grad.data_ptr(),
            sf["exp_avg"].data_ptr(),
            sf["exp_avg_sq"].data_ptr(),
            vmax,
            plan[0],
            plan[1],
            plan[2],
            1 - beta1,
            beta2,
            1 - beta2,
            bc2s,
            eps,
            -(lr / bc1),
            wd if not self.decoupled else 0.0,
            decay,
            self.amsgrad,
            bool(group["maximize"]),
            (wd != 0 and not self.decoupled),
            (wd != 0 and self.decoupled),
            0,
            1,
            _nthreads(n),
        )
        _K.bump_steps(run.step_ptrs, 1.0)


# ATen's vml.h calls MKL as vm?Sqrt(n, in, out, VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE).
_VML_MODE = 0x2 | 0x140000 | 0x100
_VML_STATE: List[bool] = []


def _vml_ready() -> bool:
    """Whether the one-pass for-loop Adam kernel can use torch's own square root.

    torch.sqrt on CPU calls MKL's vmsSqrt/vmdSqrt in x86 builds; those functions are exported by
    libtorch_cpu. They are looked up in the already loaded library (never loaded here) and used
    only if they reproduce torch.sqrt bit for bit on a sample covering every binade, zeros,
    subnormals, infinities and NaN. Otherwise (other builds, TRAINLOOM_NO_VML=1) the kernel runs
    in three passes around torch.sqrt itself, which is exact too, only slower.
    """
    if not _VML_STATE:
        _VML_STATE.append(_install_vml())
    return _VML_STATE[0]


def _install_vml() -> bool:
    if os.environ.get("TRAINLOOM_NO_VML", "").strip() not in ("", "0"):
        return False
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        fs = ctypes.cast(lib.vmsSqrt, ctypes.c_void_p).value
        fd = ctypes.cast(lib.vmdSqrt, ctypes.c_void_p).value
    except (OSError, AttributeError) as exc:
        logger.info("torch's MKL square root not found (%s): Adam for-loop kernel runs in three passes", exc)
        return False
    if not fs or not fd:
        return False
    _K.set_vml_sqrt(fs, fd, _VML_MODE)
    g = torch.Generator().manual_seed(12345)
    for dt, code in ((torch.float32, _K.DTYPE_F32), (torch.float64, _K.DTYPE_F64)):
        lo, hi = (-149, 128) if dt == torch.float32 else (-1074, 1024)
        x = torch.ldexp(
            torch.rand(1 << 16, generator=g, dtype=torch.float64) + 0.5,
            torch.randint(lo, hi, (1 << 16,), generator=g),
        )
        x = x.to(dt)
        x[:6] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), -1.0, 1.0], dtype=dt)
        out = torch.empty_like(x)
        _K.vml_sqrt(code, x.data_ptr(), out.data_ptr(), x.numel())
        ref = torch.sqrt(x)
        ints = torch.int32 if dt == torch.float32 else torch.int64
        if not torch.equal(out.view(ints), ref.view(ints)):
            _K.set_vml_sqrt(0, 0, 0)
            logger.info(
                "MKL's square root differs from torch.sqrt here: Adam for-loop kernel runs in three passes"
            )
            return False
    return True


# Per (kernel, flavour, dtype): whether the compiled kernel reproduces torch's step bit for bit on
# this machine and torch build, checked once per process (see _kernel_verified).
_KERNEL_OK: Dict[Tuple[str, str, torch.dtype], bool] = {}
# Per (kernel, dtype): how many leading elements of each tensor torch's fused=True CPU kernel
# computes with its vector formula (numel - numel % split), as measured by _kernel_verified.
_FUSED_SPLIT: Dict[Tuple[str, torch.dtype], int] = {}
# Sizes whose tails differ under every candidate split (8/16 float32, 4/8 float64 elements).
_PROBE_SIZES = (15, 7, 31, 3, 47, 13, 23, 9) * 4
_PROBE_LOCK = threading.RLock()
_PROBING = threading.local()


def _flavour(group: Dict[str, Any], foreach_first: bool = False) -> str:
    """Which of torch's code paths a group takes: "fused", "foreach" or "loop". With both flags set
    (the constructors refuse that, but param_groups can be edited) torch's adam() takes fused and
    its sgd() takes foreach (``foreach_first``)."""
    if group.get("foreach") and foreach_first:
        return "foreach"
    if group.get("fused"):
        return "fused"
    return "foreach" if group.get("foreach") else "loop"


def _kernel_verified(kind: str, flavour: str, dt: torch.dtype) -> bool:
    """Whether the compiled ``kind`` ("sgd", "adam") kernel reproduces torch's ``flavour`` path.

    The kernels copy torch's rounding (which products are fused into an FMA, where the vector body
    of a fused=True kernel ends), and that depends on the machine and the torch build: a torch or
    CPU without FMA (torch's DEFAULT capability, e.g. ``ATEN_CPU_CAPABILITY=default``) rounds
    otherwise, and torch's fused=True kernels split each tensor at the vector width they run at,
    which is not the CPU's on AVX512 machines (torch registers them with ``REGISTER_DISPATCH``, which
    runs their AVX2 build there). So, once per process and configuration, a probe runs torch's
    optimizer and a fused twin (through ``fuse_step`` itself) for three steps over tensors whose
    tails differ under every candidate split, with every flag the kernel implements, and compares
    parameters and state bit for bit; for fused=True each candidate split is tried. Without a match
    the kernel is not used: such groups step through torch (flat views; per tensor for fused=True),
    exact but without the single pass.
    """
    key = (kind, flavour, dt)
    ok = _KERNEL_OK.get(key)
    if ok is not None:
        return ok
    if getattr(_PROBING, "key", None) == key:
        return True  # inside the probe's own fuse_step
    with _PROBE_LOCK:
        ok = _KERNEL_OK.get(key)
        if ok is not None:
            return ok
        item = 4 if dt == torch.float32 else 8
        # fused=True: 32-byte vectors first (torch 2.13 runs them on AVX2 and AVX512 CPUs alike)
        splits = [32 // item, 64 // item] if flavour == "fused" else [1]
        found: Optional[int] = None
        _PROBING.key = key
        try:
            for split in splits:
                if flavour == "fused":
                    _FUSED_SPLIT[(kind, dt)] = split
                if _probe_matches_torch(kind, flavour, dt):
                    found = split
                    break
        finally:
            _PROBING.key = None
            _KERNEL_OK[key] = found is not None
    if found is None:
        logger.info(
            "the compiled %s kernel does not reproduce torch's %s path for %s here: such groups step "
            "through torch (exact, without the single pass)",
            kind,
            flavour,
            dt,
        )
    elif flavour == "fused":
        logger.debug("torch's fused=True %s for %s: vector body of numel - numel %% %d", kind, dt, found)
    return found is not None


def kernel_checks() -> List[Dict[str, Any]]:
    """Check every compiled kernel against torch's own step on this machine, as the first
    ``fuse_step`` of each configuration does (once per process; checks already made are reused).

    Returns:
        One dict per (optimizer, torch path, dtype): ``optimizer`` ("SGD" or "Adam/AdamW"),
        ``path`` ("for-loop", "foreach" or "fused=True"), ``dtype`` ("float32", "float64"),
        ``matches_torch`` (False: such groups step through torch, exact but without the single
        pass) and ``vector_split`` (fused=True: each tensor's first ``numel - numel % split``
        elements take torch's vector formula; None otherwise).

    Example::

        >>> from trainloom.optim import kernel_checks
        >>> [r for r in kernel_checks() if not r["matches_torch"]]  # doctest: +SKIP
        []
    """
    names = {"loop": "for-loop", "foreach": "foreach", "fused": "fused=True"}
    rows: List[Dict[str, Any]] = []
    for kind in ("sgd", "adam"):
        for dt in (torch.float32, torch.float64):
            for flavour in ("loop", "foreach", "fused"):
                ok = _kernel_verified(kind, flavour, dt)
                split = _FUSED_SPLIT.get((kind, dt)) if ok and flavour == "fused" else None
                rows.append(
                    {
                        "optimizer": "SGD" if kind == "sgd" else "Adam/AdamW",
                        "path": names[flavour],
                        "dtype": str(dt).replace("torch.", ""),
                        "matches_torch": ok,
                        "vector_split": split,
                    }
                )
    return rows


def _probe_optimizers(kind: str, flavour: str) -> List[Callable[[List[torch.Tensor]], torch.optim.Optimizer]]:
    """Optimizers over the probe tensors that use every flag of ``kind``'s kernel, in ``flavour``."""
    flag: Dict[str, Any] = {"fused": True} if flavour == "fused" else {"foreach": flavour == "foreach"}

    def deal(ps: List[torch.Tensor], *kws: Dict[str, Any]) -> List[Dict[str, Any]]:
        """One param group per ``kws``, the tensors dealt to them in turn."""
        return [dict(params=ps[i :: len(kws)], **kw) for i, kw in enumerate(kws)]

    if kind == "sgd":
        return [
            lambda ps: torch.optim.SGD(
                deal(
                    ps,
                    dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
                    dict(lr=0.01, momentum=0.8, dampening=0.3, maximize=True),
                    dict(lr=0.05, weight_decay=0.1),
                ),
                **flag,
            )
        ]
    return [
        lambda ps: torch.optim.Adam(
            deal(
                ps,
                dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
                dict(lr=1e-3, betas=(0.3, 0.9), maximize=True),
            ),
            **flag,
        ),
        lambda ps: torch.optim.AdamW(
            deal(ps, dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-3, amsgrad=True, maximize=True)), **flag
        ),
    ]


def _probe_matches_torch(kind: str, flavour: str, dt: torch.dtype) -> bool:
    """Three steps of torch's optimizer and of a fused twin: parameters and state bitwise equal?

    Both step without hooks and profiler ranges (torch's step() unwrapped, fuse_step's update): the
    user's global step hooks and a recording profiler must see only the user's own steps."""
    g = torch.Generator().manual_seed(20261128)
    n = sum(_PROBE_SIZES)
    p0 = torch.randn(n, generator=g, dtype=torch.float64).to(dt)
    grads = [torch.randn(n, generator=g, dtype=torch.float64).to(dt) for _ in range(3)]
    for make in _probe_optimizers(kind, flavour):
        ref = [t.clone().requires_grad_() for t in p0.split(_PROBE_SIZES)]
        mine = [t.clone().requires_grad_() for t in p0.split(_PROBE_SIZES)]
        opt_r = make(ref)
        opt_f = fuse_optimizer(make(mine))
        info = _info(opt_f, "fuse_step")
        for gr in grads:
            for a, b, gp in zip(ref, mine, gr.split(_PROBE_SIZES)):
                a.grad = gp.clone()
                b.grad = gp.clone()
            _torch_step(opt_r)
            _fuse_step(opt_f, info, None)
        for a, b in zip(ref, mine):
            pairs = [(a.detach(), b.detach())]
            pairs += [
                (v, opt_f.state[b][k]) for k, v in opt_r.state[a].items() if isinstance(v, torch.Tensor)
            ]
            if not all(_same_bits(x, y) for x, y in pairs):
                return False
    return True


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit-for-bit equality (torch.equal takes 0.0 for -0.0)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()]
    return torch.equal(x.contiguous().view(ints), y.contiguous().view(ints))


def _scaled(opt: Any) -> bool:
    """Whether a GradScaler handed this step its scale and inf flag (fused torch optimizers): torch's
    step then divides the gradients by the scale and skips the update on inf, which no kernel does."""
    return getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None


def _kernel_for(opt: Any, group: Dict[str, Any], b: _Bucket) -> Optional[_Kernel]:
    """The compiled kernel that reproduces this group's configured torch path, if any."""
    if b.device.type != "cpu" or b.dtype not in (torch.float32, torch.float64):
        return None
    if group.get("differentiable") or group.get("capturable"):
        return None
    if _scaled(opt):
        return None
    if isinstance(opt, torch.optim.SGD):
        if not all(_is_float(group[k]) for k in ("lr", "momentum", "dampening", "weight_decay")):
            return None
        flavour = _flavour(group, foreach_first=True)
        if not _kernel_verified("sgd", flavour, b.dtype):
            return None
        return _SgdKernel(flavour == "fused")
    if isinstance(opt, torch.optim.Adam):
        betas = group["betas"]
        if not all(
            _is_float(x) for x in (group["lr"], betas[0], betas[1], group["weight_decay"], group["eps"])
        ):
            return None
        if not _kernel_verified("adam", _flavour(group), b.dtype):
            return None
        # torch >= 2.6 reads the group's flag (an AdamW group may set it False: L2 decay, as Adam);
        # an older torch's AdamW is a class of its own, without the flag
        if "decoupled_weight_decay" in group:
            decoupled = bool(group["decoupled_weight_decay"])
        else:
            decoupled = isinstance(opt, torch.optim.AdamW)
        return _AdamKernel(bool(group.get("fused")), decoupled, bool(group["amsgrad"]))
    return None
