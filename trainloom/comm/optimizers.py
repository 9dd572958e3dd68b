"""Distributed optimizers: Bluefog's DistributedAllreduceOptimizer and DistributedNeighborAllreduceOptimizer.

Both wrap any ``torch.optim.Optimizer``. The result *is* an instance of the optimizer's class (a
subclass made on the fly that shares the original's parameter groups and state, as Horovod and
Bluefog do), so ``state_dict()``, ``load_state_dict()``, schedulers and
:func:`~trainloom.comm.state.broadcast_optimizer_state` work unchanged.

Communication overlaps backward: every parameter gets a post-accumulate-grad hook; parameters are
grouped into buckets (``bucket_bytes``, in reverse registration order, which is roughly the order
gradients arrive); a bucket is launched asynchronously as soon as all its gradients are final and
every earlier bucket was launched (so every rank issues the same sequence of collectives). ``step()``
launches what is left (parameters that got no gradient), waits, writes the results back and calls
the wrapped optimizer's step. Parameters with ``requires_grad=False`` when the optimizer is wrapped
are left out entirely (no hook, no bucket, no gradient), as a plain optimizer leaves them alone.

* :func:`DistributedAllreduceOptimizer` averages gradients over all ranks (data-parallel SGD).
* :func:`DistributedNeighborAllreduceOptimizer` averages *parameters* with the in-neighbours of the
  communicator's virtual topology (:func:`~trainloom.comm.neighbor.neighbor_allreduce`), then applies
  the local gradient: decentralized SGD, ``x <- sum_j W_ij x_j - lr * grad_i(x_i)``.

Example::

    model = torch.nn.Linear(8, 1)
    opt = DistributedAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    loss = model(x).square().mean()
    loss.backward()            # buckets are averaged while backward runs
    opt.step()
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from trainloom.comm import collectives as _core
from trainloom.comm.collectives import ReduceOp
from trainloom.comm.env import as_int
from trainloom.comm.group import Communicator, ProcessGroup
from trainloom.comm.neighbor import neighbor_allreduce_async
from trainloom.comm.topology import resolve_comm
from trainloom.comm.work import Work

logger = logging.getLogger("trainloom.comm")

__all__ = ["DistributedAllreduceOptimizer", "DistributedNeighborAllreduceOptimizer", "DEFAULT_BUCKET_BYTES"]

#: Default bucket size: large enough to amortise per-call cost, small enough to start during backward.
DEFAULT_BUCKET_BYTES = 1 << 20

CommArg = Union[None, Communicator, ProcessGroup]


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter]) -> None:
        self.params = params
        self.ready = 0
        self.flat: Optional[torch.Tensor] = None
        self.work: Optional[Work] = None


class _Reducer:
    """Buckets, hooks and in-order asynchronous launches for one wrapped optimizer.

    Only parameters with ``requires_grad=True`` at wrap time are bucketed and hooked. In gradient
    mode every bucket carries one presence flag per parameter after the gradients (1 if this rank
    has a gradient for it, else 0), so every rank learns in the same collective whether a parameter
    got a gradient anywhere.
    """

    def __init__(
        self,
        named: List[Tuple[str, torch.nn.Parameter]],
        comm: Communicator,
        mode: str,
        bucket_bytes: int,
        backward_passes_per_step: int,
        who: str,
    ) -> None:
        self.comm = comm
        self.mode = mode
        #: neighbour mode: Bluefog's optimizer attributes, passed to every neighbor_allreduce (None:
        #: the topology's weights).
        self.self_weight: Optional[float] = None
        self.neighbor_weights: Optional[Dict[int, float]] = None
        self.passes = backward_passes_per_step
        self.who = who
        #: for messages: repr(name) from named_parameters, else the position in param_groups.
        self.names: Dict[int, str] = {id(p): n for n, p in named}
        params = [p for _, p in named if p.requires_grad]
        #: parameters left out (requires_grad=False when wrapped): never reduced, never given a grad.
        self.frozen: List[torch.nn.Parameter] = [p for _, p in named if not p.requires_grad]
        self.buckets: List[_Bucket] = []
        cur: List[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if cur and (size + nbytes > bucket_bytes or p.dtype != cur[0].dtype or p.device != cur[0].device):
                self.buckets.append(_Bucket(cur))
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            self.buckets.append(_Bucket(cur))
        self.where: Dict[int, int] = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        #: how many parameters the optimizer had when wrapped (a cheap test for add_param_group)
        self.known_count = len(named)
        self.counts: Dict[int, int] = {id(p): 0 for p in params}
        self.next = 0
        #: the first misuse seen during backward (raised again by the next synchronize()).
        self.error: Optional[str] = None
        #: buckets launched from a backward hook (before step()) in the last step: the overlap.
        self.launched_in_backward = 0
        self._backward_launches = 0
        #: an explicit synchronize() finished this step's communication: step() must not repeat it (a
        #: second neighbour average would average the averaged parameters). Cleared by the step and by
        #: the next gradient.
        self.synced = False
        self.handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._hook, id(p))) for p in params
        ]

    def _hook(self, key: int, _p: torch.Tensor) -> None:
        self.synced = False  # a new gradient: a new step's communication
        n = self.counts[key] + 1
        if n > self.passes:
            # Horovod raises here too: the bucket was already reduced, so this gradient would be lost.
            msg = (
                f"{self.who}: gradients were computed more than backward_passes_per_step={self.passes} "
                f"time(s) before step() (parameter {self.names[key]} got gradient number {n}); increase "
                "backward_passes_per_step to accumulate gradients locally, or call step() after each "
                "backward pass"
            )
            if self.error is None:
                self.error = msg
            raise RuntimeError(msg)
        self.counts[key] = n
        if n != self.passes:
            return
        self.buckets[self.where[key]].ready += 1
        while self.next < len(self.buckets) and self.buckets[self.next].ready == len(
            self.buckets[self.next].params
        ):
            self._launch(self.buckets[self.next])
            self.next += 1
            self._backward_launches += 1

    def _launch(self, b: _Bucket) -> None:
        with torch.no_grad():
            if self.mode == "grad":
                parts = []
                flags = []
                for p in b.params:
                    g = p.grad
                    if g is None:
                        parts.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
                        flags.append(0.0)
                        continue
                    if g.is_sparse:
                        g = g.to_dense()  # averaged densely: right in value, dense in memory
                    parts.append(g.reshape(-1))
                    flags.append(1.0)
                first = b.params[0]
                parts.append(torch.tensor(flags, dtype=first.dtype, device=first.device))
                b.flat = torch.cat(parts)  # a copy: later changes to .grad do not race the transfer
                b.work = _core.allreduce_inplace(b.flat, ReduceOp.AVG, comm=self.comm, async_op=True)
            else:
                b.flat = torch.cat([p.detach().reshape(-1) for p in b.params])
                b.work = neighbor_allreduce_async(
                    b.flat, self.self_weight, self.neighbor_weights, comm=self.comm
                )

    def _unknown_with_grad(self, groups: List[Dict[str, Any]]) -> Optional[str]:
        """A parameter added to the optimizer after wrapping (add_param_group) that has a gradient."""
        if sum(len(g["params"]) for g in groups) == self.known_count:
            return None
        for gi, g in enumerate(groups):
            for i, p in enumerate(g["params"]):
                if p.grad is not None and id(p) not in self.names:
                    return (
                        f"{self.who}: param_groups[{gi}]['params'][{i}] was added to the optimizer after it "
                        "was wrapped (add_param_group), so it is not averaged across ranks, but it has a "
                        "gradient now; add the param group to the original optimizer and wrap it again"
                    )
        return None

    def _frozen_with_grad(self) -> Optional[str]:
        for p in self.frozen:
            if p.grad is not None:
                return (
                    f"{self.who}: parameter {self.names[id(p)]} had requires_grad=False when the optimizer "
                    "was wrapped, so it is not averaged across ranks, but it has a gradient now; set "
                    "requires_grad before wrapping (wrap the original optimizer again after changing it)"
                )
        return None

    def synchronize(self, groups: Optional[List[Dict[str, Any]]] = None) -> None:
        """Launch the buckets not launched yet (in order), wait for all, write the results back.

        Args:
            groups: the optimizer's param_groups, checked for parameters added after wrapping.

        Raises:
            RuntimeError: a misuse was seen (too many backward passes, a frozen parameter or one
                added after wrapping with a gradient). Every launched collective still completes (the
                ranks stay in step) and nothing is written back, so the wrapped optimizer must not step.
        """
        problem = (
            self.error
            or self._frozen_with_grad()
            or (self._unknown_with_grad(groups) if groups is not None else None)
        )
        try:
            while self.next < len(self.buckets):
                self._launch(self.buckets[self.next])
                self.next += 1
            with torch.no_grad():
                for b in self.buckets:
                    if b.work is None:
                        continue
                    b.work.wait()
                    if problem is None:
                        self._write_back(b)
        finally:
            for b in self.buckets:
                b.work, b.flat, b.ready = None, None, 0
            for k in self.counts:
                self.counts[k] = 0
            self.error = None
            self.launched_in_backward = self._backward_launches
            self._backward_launches = 0
            self.next = 0
        if problem is not None:
            raise RuntimeError(problem)

    def _write_back(self, b: _Bucket) -> None:
        res = b.work.tensor if self.mode == "neighbor" else b.flat  # type: ignore[union-attr]
        total = sum(p.numel() for p in b.params)
        present = res[total:].tolist() if self.mode == "grad" else [1.0] * len(b.params)  # type: ignore[index]
        off = 0
        for p, here in zip(b.params, present):
            n = p.numel()
            chunk = res[off : off + n].view_as(p)  # type: ignore[index]
            off += n
            if self.mode != "grad":
                p.copy_(chunk)
            elif here == 0:
                continue  # no rank had a gradient: leave .grad alone (None), as a plain optimizer would
            elif p.grad is None or p.grad.is_sparse:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class _DistributedMixin:
    """Methods that the generated subclass puts in front of the wrapped optimizer's class."""

    _tl_reducer: _Reducer
    _tl_original: Callable[[], Optional[torch.optim.Optimizer]]  # a weakref to the wrapped optimizer

    def synchronize(self) -> None:
        """Finish this step's communication now, e.g. to clip the averaged gradients before
        ``step()``; ``step()`` then does not communicate again (as in Bluefog, where the handles are
        gone once synchronized). Calling it again before the next backward pass does nothing."""
        r = self._tl_reducer
        if r.synced:
            return
        r.synchronize(self.param_groups)  # type: ignore[attr-defined]
        r.synced = True

    def _finish_communication(self) -> None:
        """Before the update: this step's communication, unless :meth:`synchronize` already did it."""
        r = self._tl_reducer
        if not r.synced:
            r.synchronize(self.param_groups)  # type: ignore[attr-defined]
        r.synced = False

    def _neighbor_only(self, name: str) -> _Reducer:
        r = self._tl_reducer
        if r.mode != "neighbor":
            raise AttributeError(
                f"{type(self).__name__} has no {name}: only DistributedNeighborAllreduceOptimizer "
                "averages with neighbour weights"
            )
        return r

    @property
    def self_weight(self) -> Optional[float]:
        """Bluefog's attribute: the weight of this rank's own parameters in the neighbour average
        (set together with :attr:`neighbor_weights`; None: the topology's weights)."""
        return self._neighbor_only("self_weight").self_weight

    @self_weight.setter
    def self_weight(self, value: Optional[float]) -> None:
        self._neighbor_only("self_weight").self_weight = value

    @property
    def neighbor_weights(self) -> Optional[Dict[int, float]]:
        """Bluefog's attribute: ``{in-neighbour rank: weight}`` for the neighbour average (set
        together with :attr:`self_weight`; None: the topology's weights). Checked as
        :func:`~trainloom.comm.neighbor.neighbor_allreduce` checks its arguments, at the next launch."""
        return self._neighbor_only("neighbor_weights").neighbor_weights

    @neighbor_weights.setter
    def neighbor_weights(self, value: Optional[Dict[int, float]]) -> None:
        self._neighbor_only("neighbor_weights").neighbor_weights = value

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # noqa: D102
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._finish_communication()
        super().step()  # type: ignore[misc]
        return loss

    def fuse_step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """``fuse_step`` of a fused optimizer underneath (``fuse_optimizer`` before wrapping): the
        closure, this step's communication, then the fused update. ``trainloom.optim.fuse_step(opt)``
        does the same (it finishes the communication through ``_tl_before_step``)."""
        from trainloom.optim.fused import fuse_step

        return fuse_step(self, closure)  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # noqa: D102
        super().load_state_dict(state_dict)  # type: ignore[misc]
        # torch's load_state_dict rebinds state and param_groups on this object: keep sharing them
        # with the original optimizer (an LR scheduler made on it, or its step() without communication).
        original = self._tl_original()
        if original is not None:
            original.__dict__["state"] = self.state  # type: ignore[attr-defined]
            original.__dict__["param_groups"] = self.param_groups  # type: ignore[attr-defined]

    def remove_hooks(self) -> None:
        """Detach the backward hooks: ``step()`` still communicates, but no longer overlaps backward.

        Every bucket is then launched from ``step()`` (after the whole backward), and
        ``backward_passes_per_step`` is no longer checked. To step without any communication, call
        the original, unwrapped optimizer's ``step()``: it shares the parameter groups and state.
        """
        self._tl_reducer.remove()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refuse pickling (``torch.save``, ``copy``): the optimizer holds hooks and a communicator."""
        raise TypeError(
            f"cannot pickle or copy a {type(self).__name__}: it holds gradient hooks and a communicator. "
            "Save optimizer.state_dict() instead, and load_state_dict() it into a freshly wrapped optimizer"
        )


def _params(optimizer: Any, named_parameters: Any, who: str) -> List[Tuple[str, torch.nn.Parameter]]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{who}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError(f"{who}: the optimizer is already distributed; wrap the original optimizer once")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    labels = {
        id(p): f"param_groups[{gi}]['params'][{i}]"
        for gi, g in enumerate(optimizer.param_groups)
        for i, p in enumerate(g["params"])
    }
    if len({id(p) for p in params}) != len(params):
        raise ValueError(f"{who}: a parameter appears twice in the optimizer's param_groups")
    if named_parameters is not None:
        named: List[Tuple[str, torch.Tensor]] = list(named_parameters)
        names = [n for n, _ in named]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{who}: named_parameters has duplicate names {dup}")
        known = {id(p) for _, p in named}
        missing = [i for i, p in enumerate(params) if id(p) not in known]
        if missing:
            raise ValueError(
                f"{who}: {len(missing)} of the optimizer's parameters are not in named_parameters (optimizer "
                f"parameter indices {missing[:8]}); pass the named_parameters() of the model being optimized"
            )
        order = {id(p): i for i, (_, p) in enumerate(named)}
        params.sort(key=lambda p: order[id(p)])
        labels.update({id(p): repr(n) for n, p in named})
    return [(labels[id(p)], p) for p in params]


ModelArg = Union[torch.nn.Module, List[torch.nn.Module], None]


def _is_models(value: Any) -> bool:
    """A Module, or a non-empty list of Modules (the ``model`` argument of later Bluefog releases)."""
    return isinstance(value, torch.nn.Module) or (
        isinstance(value, list) and bool(value) and all(isinstance(m, torch.nn.Module) for m in value)
    )


def _named_from_model(named_parameters: Any, model: Any, who: str) -> Any:
    """``named_parameters``, or the named parameters of ``model`` (one Module or a list of them).

    Later Bluefog releases take ``(optimizer, model)``; a Module (or a list of Modules) passed
    positionally in the ``named_parameters`` slot is therefore read as ``model``.
    """
    if _is_models(named_parameters):
        if model is not None:
            raise TypeError(
                f"{who}: got a model both positionally (second argument) and as model=; pass it once"
            )
        named_parameters, model = None, named_parameters
    if model is None:
        return named_parameters
    if named_parameters is not None:
        raise TypeError(
            f"{who}: pass model= or named_parameters=, not both (model=m stands for "
            "named_parameters=m.named_parameters())"
        )
    if not _is_models(model):
        raise TypeError(
            f"{who}: model must be a torch.nn.Module or a non-empty list of them, got {type(model).__name__}"
        )
    models = [model] if isinstance(model, torch.nn.Module) else model
    return [item for m in models for item in m.named_parameters()]


def _wrap(
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
    comm: CommArg,
    mode: str,
    bucket_bytes: int,
    backward_passes_per_step: int,
    who: str,
    model: ModelArg = None,
) -> torch.optim.Optimizer:
    named_parameters = _named_from_model(named_parameters, model, who)
    named = _params(optimizer, named_parameters, who)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            f"{who}: LBFGS evaluates its closure several times per step (line search), and the wrapper "
            "averages one gradient per step; the steps would use local gradients. Use a first-order "
            "optimizer, or average the gradients inside the closure yourself"
        )
    if mode == "grad" and isinstance(optimizer, torch.optim.SparseAdam):
        raise TypeError(
            f"{who}: SparseAdam needs sparse gradients, but gradients are averaged as dense tensors "
            "(a sparse gradient, e.g. from nn.Embedding(sparse=True), becomes a dense average); use Adam, "
            "or DistributedNeighborAllreduceOptimizer, which keeps the local (sparse) gradient"
        )
    checked = []
    for name, v in (("bucket_bytes", bucket_bytes), ("backward_passes_per_step", backward_passes_per_step)):
        vi = as_int(v)
        if vi is None or vi < 1:
            raise ValueError(f"{who}: {name} must be an int >= 1, got {v!r}")
        checked.append(vi)
    bucket_bytes, backward_passes_per_step = checked
    c = resolve_comm(comm, who)
    base = type(optimizer)
    # _tl_base: the wrapped class, compared by broadcast_optimizer_state across ranks.
    cls = type(f"{who}[{base.__name__}]", (_DistributedMixin, base), {"_tl_base": base})
    wrapped: Any = cls.__new__(cls)  # type: ignore[call-overload]  # the optimizer's __new__, not type's
    # Share (not copy) the original's param_groups, state, defaults and hooks.
    wrapped.__dict__.update(optimizer.__dict__)
    # A fused optimizer's fuse_step bound to the original would step without communicating: the
    # class's fuse_step (synchronize, then the fused update) takes its place.
    wrapped.__dict__.pop("fuse_step", None)
    wrapped._tl_reducer = _Reducer(named, c, mode, bucket_bytes, backward_passes_per_step, who)
    wrapped._tl_original = weakref.ref(optimizer)
    #: called by trainloom.optim.fuse_step with the optimizer, before the fused update (the function,
    #: not the bound method: no reference cycle)
    wrapped._tl_before_step = _DistributedMixin._finish_communication
    return wrapped


def DistributedAllreduceOptimizer(  # noqa: N802 - Bluefog's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
    comm: CommArg = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    backward_passes_per_step: int = 1,
    *,
    model: ModelArg = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (not already wrapped).
        named_parameters: ``model.named_parameters()``: fixes the bucket order by name order and
            checks that it covers every parameter of the optimizer. Default: the optimizer's order.
            A ``torch.nn.Module`` (or a list of them) here is read as ``model`` (later Bluefog
            releases take ``(optimizer, model)``).
        comm: communicator or process group (None: the default group).
        bucket_bytes: gradient bytes per bucket (one collective each).
        backward_passes_per_step: backward passes accumulated locally before a bucket is reduced.
            A parameter that gets more gradients than this before ``step()`` makes that backward
            (and the next ``step()``) raise ``RuntimeError``, as Horovod does.
        model: a ``torch.nn.Module`` or a list of them (keyword; later Bluefog releases): the same
            as ``named_parameters=model.named_parameters()`` (the lists' parameters chained).

    Returns:
        An instance of ``type(optimizer)`` sharing its state, with ``step()`` synchronizing first.

    Which gradients are averaged (the same rule on every rank, as torch DDP does):

    * ``requires_grad=False`` at wrap time: never averaged, never given a gradient, never waited for.
    * a gradient on at least one rank: every rank gets the average over *all* ranks, a rank without
      a gradient (``.grad`` None) counting as zeros.
    * no gradient on any rank: ``.grad`` stays None everywhere, so the wrapped optimizer skips the
      parameter (no weight decay, no momentum), exactly as it would without the wrapper.
    * a sparse gradient (``nn.Embedding(sparse=True)``) is averaged as a dense tensor and written back
      dense: right in value, but it takes the dense gradient's memory.

    Raises:
        TypeError: not an optimizer; ``torch.optim.SparseAdam`` (it needs sparse gradients); both
            ``model`` and ``named_parameters``; a ``model`` that is not a Module (or list of them).
        ValueError: already wrapped, duplicate names, parameters missing from named_parameters, bad sizes.
        RuntimeError: (from ``backward()``/``step()``) more than ``backward_passes_per_step`` gradients
            for a parameter before ``step()``; a parameter frozen at wrap time has a gradient at
            ``step()``. The step is not taken; the launched collectives still complete, so the ranks
            stay in step.

    Example::

        opt = DistributedAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
        # or, as later Bluefog releases write it: DistributedAllreduceOptimizer(sgd, model=model)
        model(x).sum().backward()
        opt.step()
    """
    return _wrap(
        optimizer,
        named_parameters,
        comm,
        "grad",
        bucket_bytes,
        backward_passes_per_step,
        "DistributedAllreduceOptimizer",
        model,
    )


def DistributedNeighborAllreduceOptimizer(  # noqa: N802 - Bluefog's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
    comm: CommArg = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    backward_passes_per_step: int = 1,
    *,
    model: ModelArg = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` for decentralized SGD: parameters averaged with neighbours, then the local step.

    Each bucket's parameters are sent to the out-neighbours (weights of the communicator's topology,
    see :func:`~trainloom.comm.topology.set_topology`) as soon as the bucket's gradients are ready,
    overlapping the rest of backward; ``step()`` replaces the parameters with the neighbour average
    and applies this rank's own gradient to it. Every parameter with ``requires_grad=True`` at wrap
    time is averaged (also one that got no gradient); frozen ones are left alone. Gradients are not
    communicated, so sparse gradients and ``SparseAdam`` work.

    Args: as for :func:`DistributedAllreduceOptimizer`.

    Example::

        set_topology(ExponentialTwoGraph(world_size))
        opt = DistributedNeighborAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        model(x).sum().backward()
        opt.step()
    """
    return _wrap(
        optimizer,
        named_parameters,
        comm,
        "neighbor",
        bucket_bytes,
        backward_passes_per_step,
        "DistributedNeighborAllreduceOptimizer",
        model,
    )
