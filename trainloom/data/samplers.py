"""Complexity-aware load-balancing samplers: every rank's work costs the same at every step.

In distributed training on variable-size samples a step takes as long as its slowest rank. These
samplers take a complexity per sample (a length, a token count, a cost) and plan each epoch so that
all ranks get work of the same cost at every step, with every rank yielding the same number of
items or batches (a mismatch hangs DDP at the end of the epoch).

The API is Bagua's (``bagua.torch_api.contrib.LoadBalancingDistributedSampler`` and
``LoadBalancingDistributedBatchSampler``): a Bagua script moves over by changing the import. On top
of it: ``complexities=`` (an array, so no sample is read), a budget mode for the batch sampler
(``max_complexity=``, padded or packed, cost model ``a*len + b*len**2``), ``state_dict()`` for
mid-epoch resume, and ``plan_stats()``.

The plan is computed by the compiled core ``trainloom.data._partition`` (radix/counting argsort,
greedy cuts of sorted runs, a longest-first deal to the least-loaded rank) with the GIL released;
Python only validates, chooses the policy and slices the result.
"""

from __future__ import annotations

import collections.abc
import hashlib
import logging
import math
import operator
import os
import struct
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Sampler

from trainloom._build_check import import_compiled
from trainloom._numbers import is_real
from trainloom._warnings import warn_at_caller
from trainloom.errors import ConfigError

_P = import_compiled("trainloom.data._partition")

#: numpy < 1.24 makes an object array of a ragged list (with a VisibleDeprecationWarning) where later
#: versions raise ValueError; the batch check treats both as a malformed batch.
_NP_RAGGED_WARNS = np.lib.NumpyVersion(np.__version__) < "1.24.0"

log = logging.getLogger("trainloom.data")

__all__ = [
    "LoadBalancingDistributedSampler",
    "LoadBalancingDistributedBatchSampler",
    "planning_memory",
    "release_planning_memory",
]

_STATE_VERSION = 1
_MODES = ("padded", "packed")
_INT32_MAX = 2**31 - 1  # plans of fewer samples keep their item ids or positions as int32
# Padded mode's minimum-padding cut: a batch costs budget / this (2 tokens at a 16384-token budget)
# times (budget / its padded cost)^2, so a full batch is worth 2 tokens of padding and a quarter-full
# one 33: small batches (which make uneven steps) are avoided. Tuned on docstring token counts at
# N = 100k: 2000 (8 tokens) padded 0.156 % (W = 2), 8000 pads 0.090 % with 18 % more steps; when
# a cut still pads more than _PAD_DP_WASTE, the next divisor (a cheaper batch) is tried.
_PAD_BATCH_PENALTY_DIVS = (8000.0, 32000.0)
# ... tried only when the step-wise cut pads more than this share of the padded cost.
_PAD_DP_WASTE = 1e-3


def planning_memory() -> Dict[str, int]:
    """Memory the planning core keeps between plans, in bytes.

    Every epoch's plan needs a few temporaries and a few result arrays of the dataset's size. The
    compiled core keeps its scratch buffer (up to 256 MiB) and a pool of freed result blocks (up to
    128 MiB) so that the next plan reuses them instead of faulting in fresh pages (on small VMs a
    100k-sample plan spent half its time in page faults).

    Returns:
        dict: ``scratch`` (the kept scratch buffer) and ``pool`` (freed result blocks kept).

    Example::

        >>> sorted(planning_memory())
        ['pool', 'scratch']
    """
    return {"scratch": int(_P.scratch_bytes()), "pool": int(_P.pool_bytes())}


def release_planning_memory() -> None:
    """Give the kept planning memory back (the next plan allocates afresh).

    Arrays of live samplers are not touched; only the scratch buffer and the pool of freed blocks
    are released.

    Raises:
        RuntimeError: another thread is planning right now.
    """
    _P.release_scratch()
    _P.release_pool()


def _seed64(*parts: object) -> int:
    """A 64-bit seed from (seed, epoch, purpose): the same on every rank, platform and run."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return struct.unpack("<Q", h.digest())[0]


def _is_bool(value: Any) -> bool:
    """Whether ``value`` is a bool: Python's, numpy's, or a bool tensor or array."""
    if isinstance(value, (bool, np.bool_)):
        return True
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    return isinstance(value, np.ndarray) and value.dtype == np.bool_


def _index(value: Any) -> Optional[int]:
    """``value`` as an int (int, numpy integer, 0-d integer tensor or array), or None for anything
    else: bool (also a bool tensor or array), float, str, None."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _as_int(value: Any, what: str, minimum: Optional[int] = None) -> int:
    """An integer argument (int, numpy integer, 0-d integer tensor; not bool or float), else ConfigError."""
    out = _index(value)
    if out is None:
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    if minimum is not None and out < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {out}")
    return out


def _scalar(value: Any) -> Any:
    """A 0-d tensor or array as its Python number (as seed=, set_epoch and max_complexity take
    them); anything else as it is. A bool tensor or array gives a bool, which is_real refuses."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return value.item()
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf":
        return value.item()
    return value


def _real_as_float(value: Any, what: str, need: str) -> float:
    """``float(value)`` of a number is_real accepted. One beyond float64's range (a Python int such as
    10**400, which float() refuses with OverflowError) is a ConfigError, as the argument's other
    bad values are: ``{what} must be {need}``; the message leaves its digits out."""
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(
            f"{what} must be {need}, got {type(value).__name__} too large for a float64"
        ) from None


def _launcher_world_size() -> Optional[int]:
    """WORLD_SIZE as set by a launcher (torchrun, torch.distributed.launch, SLURM scripts), or None."""
    try:
        return int(os.environ.get("WORLD_SIZE", "").strip())
    except ValueError:
        return None


def _world(num_replicas: Any, rank: Any, who: str) -> Tuple[int, int]:
    """num_replicas and rank, defaulting to torch.distributed's, or 1 and 0 when not initialized
    and no launcher set WORLD_SIZE > 1."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not initialized and (num_replicas is None or rank is None):
        env = _launcher_world_size()
        if env is not None and env > 1:
            # Under torchrun, a sampler built before init_process_group would plan as rank 0 of 1:
            # every process the whole dataset (torch's DistributedSampler raises here too).
            raise ConfigError(
                f"{who}: torch.distributed is not initialized while WORLD_SIZE={env} is set (a "
                "launcher started this process); call torch.distributed.init_process_group() before "
                "building the sampler, or pass num_replicas= and rank="
            )
    if num_replicas is None:
        num_replicas = torch.distributed.get_world_size() if initialized else 1
    if rank is None:
        rank = torch.distributed.get_rank() if initialized else 0
    w = _index(num_replicas)
    if w is None or w < 1:
        raise ConfigError(f"{who}: num_replicas must be an integer >= 1, got {num_replicas!r}")
    r = _index(rank)
    if r is None or not 0 <= r < w:
        raise ConfigError(
            f"{who}: rank {rank!r} is outside [0, {w}) for num_replicas={w}; "
            "pass the process's rank in the distributed group"
        )
    return w, r


def _check_finite(c: np.ndarray, who: str) -> None:
    bad = ~np.isfinite(c)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ConfigError(
            f"{who}: complexities[{i}] is {float(c[i])!r}; every complexity must be a finite number "
            f"({int(bad.sum())} are not)"
        )


def _as_complexities(values: Any, n_expected: Optional[int], who: str) -> Tuple[np.ndarray, bool]:
    """Validated complexities: (array, owned). int32 and int64 values come back as they are
    (contiguous; the caller's memory, owned=False): the sampler sorts them at once and keeps no
    copy. Anything else is copied to our own float64 array (owned=True)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds every value
            values = values.float()
        values = values.numpy()
    if isinstance(values, collections.abc.Iterator):
        raise ConfigError(
            f"{who}: complexities must be a sequence or an array with one number per sample, got the "
            f"iterator {type(values).__name__}; pass list(...) of it"
        )
    if isinstance(values, (list, tuple)):
        # numpy reads [1, True] as the ints [1, 1] (and [torch.tensor(True), 3] as [1., 3.]): refuse
        # a bool among numbers, as an all-bool list (dtype bool) and a bool from complexity_fn are
        # refused (one C-level pass over types; the values are looked at only when a bool, a
        # tensor or an array is among them).
        kinds = set(map(type, values))
        maybe_bool = (bool, np.bool_, torch.Tensor, np.ndarray)
        if not kinds <= {bool, np.bool_} and any(issubclass(k, maybe_bool) for k in kinds):
            i = next((i for i, v in enumerate(values) if _is_bool(v)), -1)
            if i >= 0:
                v = values[i]
                kind = type(v).__name__
                if isinstance(v, (torch.Tensor, np.ndarray)):
                    kind += f" of dtype {v.dtype}"
                raise ConfigError(f"{who}: complexities[{i}] is {kind}; complexities must be real numbers")
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{who}: complexities must be a 1-D array of numbers ({exc})") from exc
    if arr.dtype == np.object_ and arr.ndim == 1:
        arr = _object_complexities(arr, who)  # e.g. Python ints beyond int64, or mixed int/float
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise ConfigError(f"{who}: complexities must be a 1-D array of real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ConfigError(f"{who}: complexities must be 1-D (one number per sample), got shape {arr.shape}")
    if n_expected is not None and arr.shape[0] != n_expected:
        raise ConfigError(
            f"{who}: complexities has {arr.shape[0]} entries but the dataset has {n_expected} samples"
        )
    if arr.dtype == np.int64 or arr.dtype == np.int32:
        # Token counts, usually: sorted straight from these values (the sort reads them as the
        # doubles a copy would hold), then never read again, so no copy (16 MB at 2M samples).
        return np.ascontiguousarray(arr), False
    # Our own copy: the plan caches orders computed from these values, and the sampler marks
    # them read-only; neither may leak into (or be changed through) the caller's array.
    # (_P.empty: a pooled block, not fresh pages; see _partition.)
    own = _P.empty(arr.shape[0], np.float64)
    np.copyto(own, arr, casting="unsafe")
    if np.issubdtype(arr.dtype, np.floating):  # integers are finite (2.5 ms and 2 MB saved at 2M)
        _check_finite(own, who)
    return own, True


def _object_complexities(arr: np.ndarray, who: str) -> np.ndarray:
    """A 1-D object array of real numbers (as numpy makes of Python ints beyond int64) as float64,
    checked one by one as complexity_fn's results are; anything else is left to the dtype error."""
    for i, v in enumerate(arr):
        if not is_real(v):
            raise ConfigError(
                f"{who}: complexities[{i}] is {type(v).__name__}; complexities must be real numbers"
            )
    try:
        return arr.astype(np.float64)
    except OverflowError:
        raise ConfigError(f"{who}: complexities hold an int too large for a float64") from None


def _complexities_from_fn(dataset: Any, fn: Callable[[Any], Any], who: str) -> np.ndarray:
    n = len(dataset)
    out = np.empty(n, dtype=np.float64)
    for i in range(n):
        try:
            v = fn(dataset[i])
        except Exception as exc:  # noqa: BLE001 - re-raised with the index, never swallowed
            raise ConfigError(
                f"{who}: complexity_fn raised {type(exc).__name__} at index {i}: {exc}"
            ) from exc
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool:
            v = v.item()
        elif isinstance(v, np.ndarray) and v.ndim == 0:  # e.g. np.array(n); .item() of a bool array is
            v = v.item()  # a bool, which is_real refuses, as it refuses a bool tensor above
        if not is_real(v):
            raise ConfigError(
                f"{who}: complexity_fn returned {type(v).__name__} at index {i}; "
                "it must return a real number (int or float)"
            )
        try:
            out[i] = float(v)
        except OverflowError:
            raise ConfigError(
                f"{who}: complexity_fn returned {type(v).__name__} {str(v)[:20]}... at index {i}, "
                "too large for a float64"
            ) from None
    _check_finite(out, who)
    return out


def _digest(c: np.ndarray) -> str:
    return hashlib.blake2b(c.tobytes(), digest_size=16).hexdigest()


def _ratio_stats(costs: np.ndarray) -> Tuple[float, float]:
    """Mean and p99 over steps of max/mean of a (steps, ranks) cost matrix (1.0 for all-zero)."""
    if costs.size == 0:
        return 1.0, 1.0
    mean = costs.mean(axis=1)
    mx = costs.max(axis=1)
    r = np.where(mean > 0, mx / np.where(mean > 0, mean, 1.0), 1.0)
    return float(r.mean()), float(np.percentile(r, 99))


@dataclass
class _Plan:
    """One epoch's plan for all ranks: slot ``step * world + j`` holds items[bounds[s]:bounds[s+1]].

    Rank r's i-th batch is slot ``order[i] * world + (r + rot[order[i]]) % world``.
    """

    items: np.ndarray
    bounds: np.ndarray
    order: np.ndarray
    rot: np.ndarray
    world: int
    duplicates: int
    dropped: int
    ids: Optional[np.ndarray] = None  # when set, items are positions and ids[items] the indices

    def item_ids(self) -> np.ndarray:
        """Dataset indices of all slots (maps positions to indices when needed)."""
        return self.items if self.ids is None else self.ids[self.items]

    @property
    def steps(self) -> int:
        return int(self.order.shape[0])

    def slots(self, rank: int) -> np.ndarray:
        return self.order * self.world + (rank + self.rot[self.order]) % self.world

    def slot_matrix(self) -> np.ndarray:
        """(steps, world) slot ids in yield order."""
        j = np.arange(self.world)[None, :]
        return self.order[:, None] * self.world + (j + self.rot[self.order][:, None]) % self.world


class _ResumeMixin:
    """Epoch, warn-once on reuse, and resume bookkeeping shared by both samplers."""

    epoch: int
    _resume: Optional[Tuple[int, int]]
    _last_iter_epoch: Optional[int]
    _warned_reuse: bool
    _position: int

    def _init_resume(self) -> None:
        self.epoch = 0
        self._resume = None
        self._last_iter_epoch = None
        self._warned_reuse = False
        self._position = 0

    def _resume_applies(self) -> bool:
        """Whether a loaded position is for the epoch about to be iterated."""
        return self._resume is not None and self._resume[0] == self.epoch

    def _start(self, shuffle: bool) -> int:
        """Called when an iteration starts: returns how many entries of this epoch to skip."""
        start = 0
        if self._resume_applies():
            start = self._resume[1]  # type: ignore[index]
        elif shuffle and self._last_iter_epoch == self.epoch and not self._warned_reuse:
            self._warned_reuse = True
            msg = (
                f"{type(self).__name__} is iterated a second time in epoch {self.epoch}: the order "
                "repeats. Call set_epoch(epoch) at the start of every epoch."
            )
            warn_at_caller(msg, UserWarning, __file__, log)
        self._resume = None
        self._last_iter_epoch = self.epoch
        self._position = start
        return start

    def _remaining_skip(self) -> int:
        return self._resume[1] if self._resume_applies() else 0  # type: ignore[index]

    def _check_tracked_loader(self, loader: Iterable[Any], draws_from_self: bool) -> None:
        """``track()``'s checks: counting delivered batches gives the consumed prefix of the epoch
        only when the loader draws from this sampler and delivers its batches in order."""
        if not isinstance(loader, torch.utils.data.DataLoader):
            return
        if not draws_from_self:
            raise ConfigError(
                f"track: the DataLoader does not draw its indices from this {type(self).__name__}; "
                "pass the loader that was built with it"
            )
        if getattr(loader, "in_order", True) is False:
            raise ConfigError(
                "track: the DataLoader was built with in_order=False, so the batches it delivers are "
                "not a prefix of the epoch and a count of them cannot be resumed from; use in_order=True"
            )


class LoadBalancingDistributedSampler(_ResumeMixin, Sampler[int]):
    """Sampler that gives every rank, at every position, samples of similar complexity.

    Samples are sorted by complexity and cut into chunks of ``num_replicas`` neighbours; each rank
    takes one sample of every chunk, and the chunks are visited in a seeded random order. Every
    rank yields ``len(sampler)`` indices and every sample appears exactly once per epoch across
    ranks, except for padding: with ``drop_last=False`` up to ``num_replicas - 1`` randomly chosen
    samples appear twice (each next to its original, so balance holds); with ``drop_last=True`` up
    to ``num_replicas - 1`` randomly chosen samples are left out of the epoch.

    Args:
        dataset: the dataset (only ``len(dataset)`` is used when ``complexities`` is given; may be
            None then).
        complexity_fn: Bagua's way: called once per sample as ``complexity_fn(dataset[i])``; the
            results are kept. Reads every sample: prefer ``complexities``.
        num_replicas: number of ranks; default torch.distributed's world size, or 1 when it is not
            initialized and no launcher set ``WORLD_SIZE`` > 1 (then a ConfigError: call
            ``init_process_group`` first, or pass ``num_replicas`` and ``rank``).
        rank: this process's rank; default torch.distributed's rank, or 0 (as num_replicas).
        shuffle: shuffle the chunk order and ties (seeded by ``seed`` and the epoch).
        seed: random seed, identical on every rank.
        drop_last: drop, instead of duplicate, samples to make the dataset divisible by ranks.
        random_level: 0 (best balance) to 1 (close to random): noise added to the sort key (a
            number, or a 0-d tensor or array; not a bool).
        complexities: per-sample numbers (array, list or tensor; not bools): the fast path, no
            sample read.
            Sorted here; int32 / int64 values are not copied (nor read again), others are copied
            to float64. ``sampler.complexities`` gives them back as a read-only float64 array.

    Raises:
        ConfigError: empty dataset, NaN/infinite complexities (naming the first index), a
            complexity_fn that raises or returns a non-number (naming index and type), a rank
            outside ``[0, num_replicas)``, more replicas than samples with ``drop_last=True``,
            num_replicas or rank left out under a launcher (``WORLD_SIZE`` > 1) before
            torch.distributed is initialized.

    Example::

        >>> lengths = [5, 1, 9, 3, 7, 2, 8, 4]
        >>> s0 = LoadBalancingDistributedSampler(None, complexities=lengths, num_replicas=2, rank=0)
        >>> s1 = LoadBalancingDistributedSampler(None, complexities=lengths, num_replicas=2, rank=1)
        >>> sorted(list(s0) + list(s1)) == list(range(8))
        True
    """

    def __init__(
        self,
        dataset: Any,
        complexity_fn: Optional[Callable[[Any], Any]] = None,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0,
        complexities: Any = None,
    ) -> None:
        who = type(self).__name__
        self.num_replicas, self.rank = _world(num_replicas, rank, who)
        if complexity_fn is not None and complexities is not None:
            raise ConfigError(f"{who}: pass complexity_fn or complexities, not both")
        if complexities is not None:
            n_expected = None if dataset is None else len(dataset)
            c, owned = _as_complexities(complexities, n_expected, who)
        elif complexity_fn is not None:
            if dataset is None:
                raise ConfigError(f"{who}: complexity_fn needs a dataset to read samples from")
            c, owned = _complexities_from_fn(dataset, complexity_fn, who), True
        else:
            raise ConfigError(
                f"{who}: pass complexities= (one number per sample, the fast path) or complexity_fn="
            )
        if c.shape[0] == 0:
            raise ConfigError(f"{who}: the dataset is empty (0 samples); there is nothing to sample")
        level = _scalar(random_level)  # a 0-d tensor or array counts as its number
        if not is_real(level) or not 0 <= _real_as_float(level, f"{who}: random_level", "in [0, 1]") <= 1:
            raise ConfigError(f"{who}: random_level must be in [0, 1], got {random_level!r}")
        n = int(c.shape[0])
        if drop_last and n < self.num_replicas:
            raise ConfigError(
                f"{who}: num_replicas={self.num_replicas} is larger than the dataset ({n} samples) and "
                "drop_last=True would leave every rank empty; use drop_last=False or fewer replicas"
            )
        # Sorted once, here (every plan starts from this order and its run table): the values are
        # not read again, so integer values need no copy that outlives this call.
        self._desc, keys, ends = _P.sort_desc_runs(c)
        self._desc.setflags(write=False)
        self._runs: Tuple[np.ndarray, np.ndarray] = (keys, ends)
        self._n = n
        if owned:
            c.setflags(write=False)
        self._complexities: Optional[np.ndarray] = c if owned else None
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = _as_int(seed, f"{who}: seed")
        self.drop_last = bool(drop_last)
        self.random_level = float(level)
        w = self.num_replicas
        self.num_samples = n // w if self.drop_last else -(-n // w)
        self.total_size = self.num_samples * w
        self._digest: Optional[str] = None
        self._cache: Optional[Tuple[int, np.ndarray, np.ndarray, np.ndarray]] = None
        self._iter: Optional[Iterator[int]] = None
        self._iter_start = 0
        self._iter_end = 0
        # Set by track(): the samples of this iteration the training loop has received.
        self._tracked_pos: Optional[int] = None
        self._init_resume()
        # How many times set_epoch() changed the epoch (see LoadBalancingDistributedBatchSampler).
        self._epoch_changes = 0

    # ----------------------------------------------------------------------------- plan
    @property
    def complexities(self) -> np.ndarray:
        """The per-sample complexities, float64, read-only.

        int32 / int64 complexities are not copied at construction (the sort reads them there):
        this array is rebuilt from the sorted order and its run table when first asked for.
        """
        if self._complexities is None:
            keys, ends = self._desc_runs()
            c = np.empty(self._n, dtype=np.float64)
            c[self._desc_order()] = np.repeat(keys, np.diff(ends, prepend=0))
            c.setflags(write=False)
            self._complexities = c
        return self._complexities

    def _desc_order(self) -> np.ndarray:
        """Items by complexity, largest first, ties by index (sorted once, at construction)."""
        return self._desc

    def _desc_runs(self) -> Tuple[np.ndarray, np.ndarray]:
        """Runs of equal complexity in ``_desc_order()``: (complexity of each run, end position).

        The planners work on this table (a few thousand runs for token counts) instead of an
        array of sorted costs: no n-sized array of fresh pages on the first plan.
        """
        return self._runs

    def digest(self) -> str:
        """A digest of the complexities (identifies the dataset in ``state_dict``)."""
        if self._digest is None:
            self._digest = _digest(self.complexities)
        return self._digest

    def _epoch_plan(self, epoch: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sorted items with padding/drops, chunk order, per-chunk rotation) for ``epoch``."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1], self._cache[2], self._cache[3]
        n = self._n
        w = self.num_replicas
        tag = epoch if self.shuffle else 0
        run_keys, run_ends = self._desc_runs()
        if self.shuffle and self.random_level > 0:
            # Python floats: a span over the float64 range (1e308 and -1e308) is clipped, not inf
            # (inf * a zero draw would be NaN); keys that overflow are ties at inf.
            span = min(float(run_keys[0]) - float(run_keys[-1]), np.finfo(np.float64).max) or 1.0
            noise = _P.uniform(n, _seed64(self.seed, tag, "noise"))
            with np.errstate(over="ignore"):
                keys = self.complexities + self.random_level * span * noise
            order = _P.argsort(keys, _P.permutation(n, _seed64(self.seed, tag, "perm")), False)
        else:
            order = _P.empty(n, np.int64)
            order[:] = self._desc_order()[::-1]
            if self.shuffle:
                # Shuffle the ties: the runs of the ascending order are the run table's, reversed.
                ends = n - np.concatenate(([0], run_ends[:-1]))[::-1]
                _P.shuffle_runs_at(order, ends, _seed64(self.seed, tag, "ties"))
        # Random draws come from the compiled core's generator (xoshiro256**, seeded from seed,
        # epoch and purpose): the same on every rank, and no numpy.random import on the first plan.
        pad_seed = _seed64(self.seed, tag, "pad")
        # Fewer than W samples are padded or dropped: draw just those (_P.sample), not a
        # permutation of all n (two arrays of n fresh pages for a handful of picks).
        if self.total_size > n:
            pad = self.total_size - n
            if pad <= n:
                pick = _P.sample(n, pad, pad_seed) if self.shuffle else np.arange(pad)
            else:
                pick = np.resize(_P.permutation(n, pad_seed) if self.shuffle else np.arange(n), pad)
            pos = np.sort(pick)
            order = np.insert(order, pos + 1, order[pos])
        elif self.total_size < n:
            k = n - self.total_size
            order = np.delete(order, _P.sample(n, k, pad_seed) if self.shuffle else np.arange(k))
        chunks = self.num_samples
        if self.shuffle:
            chunk_order = _P.permutation(chunks, _seed64(self.seed, tag, "chunks"))
            rot = _P.randint(chunks, w, _seed64(self.seed, tag, "rotations"))
        else:
            chunk_order = np.arange(chunks, dtype=np.int64)
            rot = np.zeros(chunks, dtype=np.int64)
        order = np.ascontiguousarray(order, dtype=np.int64)
        self._cache = (epoch, order, chunk_order, rot)
        return order, chunk_order, rot

    def rank_indices(self, rank: Optional[int] = None, epoch: Optional[int] = None) -> np.ndarray:
        """The indices ``rank`` yields in ``epoch`` (defaults: this rank, the current epoch).

        Returns:
            numpy.ndarray: int64 array of ``num_samples`` dataset indices.
        """
        r = self.rank if rank is None else _as_int(rank, "rank_indices: rank")
        if not 0 <= r < self.num_replicas:
            raise ConfigError(f"rank_indices: rank {r} is outside [0, {self.num_replicas})")
        order, chunk_order, rot = self._epoch_plan(
            self.epoch if epoch is None else _as_int(epoch, "rank_indices: epoch")
        )
        return _P.rank_stream(order, chunk_order, rot, self.num_replicas, r)

    # ----------------------------------------------------------------------------- Sampler API
    def __iter__(self) -> Iterator[int]:
        start = self._start(self.shuffle)
        # A compiled iterator over the int64 array, not a generator (no Python frame per index) and
        # not a list (a million int objects per rank at N = 2M, W = 2): each int is made when the
        # consumer asks for it. The position is read back from its length hint in state_dict().
        self._iter = _P.IntStream(self.rank_indices(), start)
        self._iter_start = start
        self._iter_end = self.num_samples
        self._tracked_pos = None
        return self._iter

    def _consumed(self) -> int:
        if self._tracked_pos is not None:
            return self._tracked_pos
        if self._iter is None:
            return self._position
        return self._iter_end - operator.length_hint(self._iter)

    def track(self, loader: Iterable[Any], batch_size: Optional[int] = None) -> Iterator[Any]:
        """Iterate ``loader`` and count the samples handed to the training loop.

        A DataLoader with workers draws indices from this sampler ahead of the loop (prefetch);
        with ``track``, :meth:`state_dict` counts the samples of the batches the loop actually
        received (each batch ``batch_size`` samples, the last one what is left of the epoch).

        Args:
            loader: a DataLoader built with ``sampler=`` this sampler (or with a ``batch_sampler``
                that wraps it), or any iterable that draws from it in order.
            batch_size: samples per delivered batch. Default: the DataLoader's (1 when it does not
                batch); required for other iterables.

        Raises:
            ConfigError: the DataLoader draws from another sampler or delivers out of order
                (``in_order=False``); ``batch_size`` is not a positive int or cannot be found.

        Example::

            >>> for batch in sampler.track(loader):  # doctest: +SKIP
            ...     train_step(batch)
            ...     if time_to_checkpoint:
            ...         save(sampler.state_dict())
        """
        bsampler = getattr(loader, "batch_sampler", None)
        if getattr(loader, "sampler", None) is self:  # DataLoader(sampler=self, batch_size=...)
            found, draws = (loader.batch_size or 1), True  # type: ignore[attr-defined]
        elif bsampler is not None and getattr(bsampler, "sampler", None) is self:
            if isinstance(bsampler, LoadBalancingDistributedBatchSampler) and batch_size is None:
                raise ConfigError(
                    "track: this loader's batches come from a LoadBalancingDistributedBatchSampler, whose "
                    "batches differ in size; track the batch sampler instead: "
                    "batch_sampler.track(loader), and checkpoint batch_sampler.state_dict()"
                )
            found, draws = getattr(bsampler, "batch_size", None), True
        else:
            found, draws = None, False
        self._check_tracked_loader(loader, draws)
        size = found if batch_size is None else batch_size
        if size is None:
            raise ConfigError(
                "track: cannot tell how many samples each batch of this loader holds; pass batch_size="
            )
        return self._track(loader, _as_int(size, "track: batch_size", minimum=1))

    def _track(self, loader: Iterable[Any], size: int) -> Iterator[Any]:
        received = 0
        for batch in loader:  # __iter__ (start and end of this iteration) ran before the first batch
            received += 1
            self._tracked_pos = min(self._iter_start + received * size, self._iter_end)
            yield batch

    def __len__(self) -> int:
        """Indices the next iteration yields: ``num_samples``, less what a restored state consumed."""
        return self.num_samples - self._remaining_skip()

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch: with ``shuffle=True`` each epoch has its own order (same on every rank).

        Args:
            epoch: epoch number.
        """
        epoch = _as_int(epoch, "set_epoch: epoch")
        if epoch != self.epoch:
            self._iter = None
            self._tracked_pos = None
            self._position = 0
            self._epoch_changes += 1  # a batch sampler wrapping this one forgets a loaded position
        self.epoch = epoch
        if self._resume is not None and self._resume[0] != self.epoch:
            self._resume = None

    # ----------------------------------------------------------------------------- resume
    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """The position in the epoch, for resuming mid-epoch.

        Args:
            consumed: samples of this epoch the training loop has used. Default: the number this
                sampler has yielded, which equals it without DataLoader workers.

        .. warning::
            A DataLoader with workers draws indices ahead of the training loop (prefetching):
            iterate it through :meth:`track` (or pass ``consumed=``, batches seen times batch
            size) or the resumed run skips the prefetched samples.

        Returns:
            dict: epoch, seed, consumed, num_replicas, rank, dataset size and digest.
        """
        pos = self._consumed() if consumed is None else _as_int(consumed, "state_dict: consumed")
        if not 0 <= pos <= self.num_samples:
            raise ConfigError(f"state_dict: consumed={pos} is outside [0, {self.num_samples}]")
        return {
            "kind": type(self).__name__,
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "consumed": pos,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "dataset_size": self._n,
            "digest": self.digest(),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "random_level": self.random_level,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume: the next iteration continues the saved epoch after its consumed samples.

        Raises:
            ConfigError: the state comes from another world size, dataset or configuration.
        """
        _check_state(
            state,
            type(self).__name__,
            self.num_replicas,
            self._n,
            self.digest,
            ("shuffle", "drop_last", "random_level"),
        )
        for key in ("shuffle", "drop_last", "random_level"):
            if state[key] != getattr(self, key):
                raise ConfigError(
                    f"load_state_dict: the state was saved with {key}={state[key]!r}, this sampler has "
                    f"{getattr(self, key)!r}; the resumed order would differ"
                )
        if not 0 <= int(state["consumed"]) <= self.num_samples:
            raise ConfigError(
                f"load_state_dict: consumed={state['consumed']} is outside [0, {self.num_samples}]"
            )
        self.seed = int(state["seed"])
        self._cache = None
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, int(state["consumed"]))
        self._iter = None
        self._tracked_pos = None
        self._position = int(state["consumed"])

    # ----------------------------------------------------------------------------- diagnostics
    def plan_stats(self, batch_size: int = 1) -> Dict[str, Any]:
        """Balance of this epoch's plan, over all ranks.

        Args:
            batch_size: group positions as a DataLoader with this batch size would (the straggler
                ratio is then per batch).

        Returns:
            dict: ``steps``; ``straggler_mean`` / ``straggler_p99`` (max over ranks of a step's
            summed complexity divided by the mean over ranks); ``duplicates`` and ``dropped``.
        """
        batch_size = _as_int(batch_size, "plan_stats: batch_size", 1)
        order, chunk_order, rot = self._epoch_plan(self.epoch)
        w = self.num_replicas
        mat = np.stack([_P.rank_stream(order, chunk_order, rot, w, r) for r in range(w)], axis=1)
        cost = self.complexities[mat]
        batch_size = min(batch_size, max(1, mat.shape[0]))  # a larger batch is the whole epoch
        steps = -(-mat.shape[0] // batch_size)
        starts = np.arange(0, mat.shape[0], batch_size)
        per_step = np.add.reduceat(cost, starts, axis=0) if mat.shape[0] else cost
        mean, p99 = _ratio_stats(per_step)
        n = self._n
        return {
            "steps": steps,
            "world_size": w,
            "straggler_mean": mean,
            "straggler_p99": p99,
            "duplicates": max(0, self.total_size - n),
            "dropped": max(0, n - self.total_size),
        }


def _as_cost(cost: Any, who: str) -> Tuple[float, float]:
    """The budget mode's cost=(a, b): two real numbers (0-d tensors and arrays too; not bools or
    strings, not a string of two digits), finite, >= 0, not both 0."""
    pair = None
    if not isinstance(cost, (str, bytes)) and isinstance(cost, Iterable):
        try:
            pair = [_scalar(x) for x in cost]
        except TypeError:
            pair = None
    if pair is None or len(pair) != 2 or not all(is_real(x) for x in pair):
        raise ConfigError(f"{who}: cost must be a pair (a, b) of numbers, got {cost!r}")
    a, b = (_real_as_float(x, f"{who}: cost[{i}]", "finite and >= 0") for i, x in enumerate(pair))
    if not (math.isfinite(a) and math.isfinite(b)) or a < 0 or b < 0 or a == b == 0:
        raise ConfigError(f"{who}: cost=(a, b) needs finite a >= 0 and b >= 0, not both 0; got {cost!r}")
    return a, b


def _check_state(
    state: Dict[str, Any],
    kind: str,
    world: int,
    n: int,
    digest: Callable[[], str],
    config: Tuple[str, ...],
) -> None:
    """Checks a state from state_dict(): its keys, kind, version, integers, world size and dataset."""
    if not isinstance(state, dict):
        raise ConfigError(f"load_state_dict: expected a dict from state_dict(), got {type(state).__name__}")
    if "kind" in state and state["kind"] != kind:
        raise ConfigError(f"load_state_dict: the state is a {state['kind']}'s, not a {kind}'s")
    required = ("kind", "version", "epoch", "seed", "consumed", "num_replicas", "dataset_size", "digest")
    missing = [k for k in required + config if k not in state]
    if missing:
        raise ConfigError(f"load_state_dict: the state lacks {missing}; pass what state_dict() returned")
    if state["version"] != _STATE_VERSION:
        raise ConfigError(
            f"load_state_dict: the state has version {state['version']}; this trainloom reads version "
            f"{_STATE_VERSION} only (save it again with this version's state_dict())"
        )
    # Types before values: a field of the wrong type (a str "4" from a hand-edited or re-encoded
    # state) is a malformed state, not a mismatch ("saved with num_replicas=4, this sampler has 4").
    for key in ("epoch", "seed", "consumed", "num_replicas", "dataset_size"):
        if _index(state[key]) is None:
            raise ConfigError(
                f"load_state_dict: the state is malformed: its {key} must be an integer, got {state[key]!r}"
            )
    if state["num_replicas"] != world:
        raise ConfigError(
            f"load_state_dict: the state was saved with num_replicas={state['num_replicas']}, this sampler "
            f"has num_replicas={world}; resuming needs the same world size (or start the epoch afresh)"
        )
    if state["dataset_size"] != n or state["digest"] != digest():
        raise ConfigError(
            f"load_state_dict: the state was saved for another dataset ({state['dataset_size']} samples, "
            f"complexities digest {state['digest']}); this sampler has {n} samples, digest {digest()}"
        )


class LoadBalancingDistributedBatchSampler(_ResumeMixin, Sampler[List[int]]):
    """Batches whose cost is the same on every rank at every step.

    Two ways to form batches:

    * Bagua's: ``batch_fn(indices) -> list of index lists`` is called on every rank's indices (of
      the wrapped sampler); the batch counts are then made equal on every rank: cut to the
      smallest count (``drop_last=True``) or padded to the largest by repeating the rank's own
      first batches (``drop_last=False``).
    * Budget mode, ``max_complexity=B`` per rank per step (like max_tokens), a hard cap: no batch
      ever costs more than B, and an item that alone costs more gets a batch of its own. Costs
      use the model ``a * len + b * len**2`` (``cost=(a, b)``, ``len`` being the complexity).

      - ``mode="padded"``: each batch is a run of similar lengths, padded to its longest item:
        its cost is ``count * cost(longest)``. The batches of a step cost the same.
      - ``mode="packed"``: for models that do not pad: a batch costs ``sum(cost(len))``; each step's
        items are dealt longest first to the least-loaded rank. Items that alone cost more than
        B get steps of their own, ``num_replicas`` of similar cost per step (the free ranks of
        the last such step take the next items up to B each), so they do not each hold up a
        step of ordinary ones.

      Every sample appears exactly once per epoch, except at the tail: when the last step has fewer
      items than ranks, ``drop_last=False`` gives the empty ranks one duplicated item each (at
      most ``num_replicas - 1``) and ``drop_last=True`` leaves that step out.

    Every rank yields ``len(batch_sampler)`` batches, the same on every rank. The order of steps is
    shuffled with the wrapped sampler's ``shuffle``, ``seed`` and epoch.

    Args:
        sampler: a :class:`LoadBalancingDistributedSampler` (complexities, ranks, shuffle, seed).
        batch_fn: Bagua's batch function (exclusive with ``max_complexity``).
        drop_last: see above.
        max_complexity: the budget B per rank per step.
        mode: ``"padded"`` (default) or ``"packed"`` (budget mode only).
        cost: ``(a, b)`` of the cost model, both >= 0, not both 0 (numbers or 0-d tensors; not a
            str). Default ``(1, 0)``: the length (budget mode only).

    Raises:
        ConfigError: bad arguments, negative complexities in budget mode, a batch_fn returning an
            empty batch or an index it was not given, ``mode`` or ``cost`` other than the
            defaults given with ``batch_fn``.

    Example::

        >>> lengths = [3, 9, 4, 1, 7, 7, 2, 8, 5, 6]
        >>> sampler = LoadBalancingDistributedSampler(None, complexities=lengths, num_replicas=2, rank=0)
        >>> batches = LoadBalancingDistributedBatchSampler(sampler, max_complexity=16)
        >>> all(len(b) * max(lengths[i] for i in b) <= 16 for b in batches)
        True
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Optional[Callable[[List[int]], Sequence[Sequence[int]]]] = None,
        drop_last: bool = False,
        max_complexity: Optional[float] = None,
        mode: str = "padded",
        cost: Tuple[float, float] = (1.0, 0.0),
    ) -> None:
        who = type(self).__name__
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ConfigError(
                f"{who}: sampler must be a LoadBalancingDistributedSampler, got {type(sampler).__name__}"
            )
        if batch_fn is not None and max_complexity is not None:
            raise ConfigError(f"{who}: pass batch_fn or max_complexity, not both")
        if batch_fn is None and max_complexity is None:
            raise ConfigError(f"{who}: pass max_complexity= (budget per rank per step) or batch_fn=")
        if batch_fn is not None and not callable(batch_fn):
            raise ConfigError(f"{who}: batch_fn must be callable, got {type(batch_fn).__name__}")
        if mode not in _MODES:
            raise ConfigError(f"{who}: mode must be one of {_MODES}, got {mode!r}")
        a, b = _as_cost(cost, who)
        if batch_fn is not None and (mode != "padded" or (a, b) != (1.0, 0.0)):
            # Budget-mode settings that batch_fn mode would ignore. (Their defaults pass: an
            # explicit None is still refused as a cost, so the defaults stay values, not None.)
            given = [f"mode={mode!r}"] if mode != "padded" else []
            given += [f"cost={cost!r}"] if (a, b) != (1.0, 0.0) else []
            raise ConfigError(
                f"{who}: {', '.join(given)} given with batch_fn; mode= and cost= are for budget mode "
                "(max_complexity=), batch_fn makes its own batches"
            )
        n = sampler._n
        if max_complexity is not None:
            max_complexity = _scalar(max_complexity)  # a 0-d tensor or array, as seed=/epoch= accept
            if not is_real(max_complexity):
                raise ConfigError(
                    f"{who}: max_complexity must be a number, got {type(max_complexity).__name__}"
                )
            budget = _real_as_float(max_complexity, f"{who}: max_complexity", "finite and > 0")
            if not (math.isfinite(budget) and max_complexity > 0):
                raise ConfigError(f"{who}: max_complexity must be finite and > 0, got {max_complexity!r}")
            run_keys, run_ends = sampler._desc_runs()
            if run_keys[-1] < 0:  # the runs are largest first: the negative ones are last
                k = int(np.flatnonzero(run_keys < 0)[0])
                # the first such index: the smallest in those runs
                i = int(sampler._desc_order()[run_ends[k - 1] if k > 0 else 0 :].min())
                raise ConfigError(
                    f"{who}: complexities[{i}] = {float(sampler.complexities[i])!r} is negative; budget mode "
                    "(max_complexity) needs complexities >= 0"
                )
            # The planners sum costs in float64: the largest item's cost, and n batches at the
            # budget, must stay finite.
            top = float(run_keys[0])
            top_cost = a * top + b * top * top
            if not math.isfinite(top_cost):
                i = int(sampler._desc_order()[0])
                raise ConfigError(
                    f"{who}: the cost {a:g} * len + {b:g} * len**2 of complexities[{i}] = {top!r} overflows "
                    "float64; scale the complexities (and max_complexity) down"
                )
            if not math.isfinite(n * min(top_cost, float(max_complexity))):
                raise ConfigError(
                    f"{who}: max_complexity={max_complexity!r} is too large: the plan's total cost ({n} "
                    "samples) overflows float64; scale the complexities and max_complexity down"
                )
            if drop_last and n < sampler.num_replicas:
                raise ConfigError(
                    f"{who}: num_replicas={sampler.num_replicas} is larger than the dataset ({n} samples) "
                    "and drop_last=True would leave no complete step; use drop_last=False or fewer replicas"
                )
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = bool(drop_last)
        self.max_complexity = None if max_complexity is None else float(max_complexity)
        self.mode = mode if max_complexity is not None else "batch_fn"
        self.cost = (a, b)
        self.num_replicas = sampler.num_replicas
        self.rank = sampler.rank
        self._cost_run_table: Optional[Tuple[np.ndarray, np.ndarray]] = None
        self._cs_sum: Optional[float] = None
        self._plan_cache: Optional[Tuple[Tuple[Any, ...], _Plan]] = None
        self._delivered = 0
        # Whether the current iteration is counted by track(): set by the iteration that track()
        # started (_track_next), so an epoch iterated directly afterwards counts yielded batches.
        self._tracked = False
        self._track_next = False
        self._init_resume()
        # The wrapped sampler's epoch-change count when a state was loaded: changing its epoch
        # directly (sampler.set_epoch) forgets the loaded position, as this one's set_epoch does.
        self._resume_changes = 0
        self.epoch = sampler.epoch
        # The epoch whose batches _position / _delivered count: set when an iteration starts or a
        # state is loaded. A state taken in any other epoch (set_epoch called on this or on the
        # wrapped sampler, not iterated yet) has consumed nothing of it.
        self._counted_epoch: Optional[int] = None

    # ----------------------------------------------------------------------------- planning
    @property
    def _key(self) -> Tuple[Any, ...]:
        s = self.sampler
        return (s.epoch, s.seed, s.shuffle)

    def _plan(self) -> _Plan:
        key = self._key
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]
        if self.mode == "batch_fn":
            plan = self._plan_batch_fn()
        elif self.mode == "padded":
            plan = self._plan_padded()
        else:
            plan = self._plan_packed()
        self._plan_cache = (key, plan)
        return plan

    def _cost_runs(self) -> Tuple[np.ndarray, np.ndarray]:
        """(cost of each run of equal complexity, largest first; run end positions), computed once."""
        if self._cost_run_table is None:
            keys, ends = self.sampler._desc_runs()
            a, b = self.cost
            rc = keys if a == 1 and b == 0 else (a * keys if b == 0 else a * keys + b * keys * keys)
            self._cost_run_table = (np.ascontiguousarray(rc, dtype=np.float64), ends)
        return self._cost_run_table

    def _cost_sum(self) -> float:
        """Sum of all items' costs (computed once, from the run table)."""
        if self._cs_sum is None:
            rc, ends = self._cost_runs()
            self._cs_sum = float(rc @ np.diff(ends, prepend=0)) if rc.shape[0] else 0.0
        return self._cs_sum

    def _step_order(self, steps: int) -> Tuple[np.ndarray, np.ndarray]:
        s = self.sampler
        if not s.shuffle:
            return np.arange(steps, dtype=np.int64), np.zeros(steps, dtype=np.int64)
        return (
            _P.permutation(steps, _seed64(s.seed, s.epoch, "steps")),
            _P.randint(steps, self.num_replicas, _seed64(s.seed, s.epoch, "rotations")),
        )

    def _plan_padded(self) -> _Plan:
        s = self.sampler
        w = self.num_replicas
        budget = float(self.max_complexity)  # type: ignore[arg-type]
        n = s._n
        rc, re = self._cost_runs()
        ends = np.empty(n, dtype=np.int64)
        nb, p = _P.padded_steps(rc, re, w, budget, ends)
        if 0 < n - p < w and nb >= w:
            # A tail shorter than a step cannot give every rank an item: re-cut the last full
            # step together with it.
            nb -= w
            p = int(ends[nb - 1]) if nb else 0
        bounds = [0, *ends[:nb].tolist()]
        # The cuts are positions in the sorted order (longest first). Which of a run of equal
        # complexities fills which position is shuffled each epoch; gather_batches does that
        # while it lays the batches out (no shuffled copy of the order). drop_last leaves out the
        # positions after the last whole step; padding repeats positions of the last one (repeat).
        repeat: Optional[np.ndarray] = None
        duplicates = dropped = 0
        if p < n:
            tail = _cut_tail(rc, re, p, n, w, budget)
            whole = len(tail) // w * w
            bounds += tail[:whole]
            if whole < len(tail):
                last = bounds[-1]  # where the incomplete last step starts
                if self.drop_last:
                    dropped = n - last
                else:
                    bounds += tail[whole:]
                    k = w - (len(tail) - whole)
                    repeat = np.asarray([n - 1 - (i % (n - last)) for i in range(k)], dtype=np.int64)
                    duplicates = k
                    bounds += list(range(n + 1, n + 1 + k))
        if len(bounds) == 1:
            raise ConfigError(
                "LoadBalancingDistributedBatchSampler: the plan has no complete step (drop_last=True)"
            )
        bounds_a = np.asarray(bounds, dtype=np.int64)
        starts = bounds_a[:-1]
        if repeat is not None:  # a repeated position costs what the position it repeats costs
            starts = np.where(starts >= n, repeat[np.clip(starts - n, 0, repeat.shape[0] - 1)], starts)
        first = _run_cost_at(rc, re, starts)  # each batch's longest item comes first
        padded_total = float((np.diff(bounds_a) * first).sum())
        perm, span = self._group_by_cost(bounds_a, first)
        if (
            duplicates == dropped == 0
            and padded_total > 0
            and 1.0 - self._cost_sum() / padded_total > _PAD_DP_WASTE
        ):
            # The step-wise cut pads more than _PAD_DP_WASTE (few samples per length): try the
            # minimum-padding cut. Dense epochs (2M samples: 0.03 %) skip its extra passes.
            alt = self._padded_min_padding(rc, re, budget)
            if alt is not None and alt[2] < span:
                bounds_a, perm = alt[0], alt[1]
        # Only the kept plan is laid out (one gather of the items, not one per candidate), as int32
        # ids when they fit: the plan is kept for the epoch, and an int64 one is 16 MB at 2M samples.
        order, bounds_a = _P.gather_batches(
            s._desc_order(),
            bounds_a,
            perm,
            narrow=n <= _INT32_MAX + 1,
            tie_runs=re if s.shuffle else None,
            seed=_seed64(s.seed, s.epoch, "ties"),
            repeat=repeat,
        )
        steps = (bounds_a.shape[0] - 1) // w
        step_order, rot = self._step_order(steps)
        return _Plan(order, bounds_a, step_order, rot, w, duplicates, dropped)

    def _padded_min_padding(
        self, rc: np.ndarray, re: np.ndarray, budget: float
    ) -> Optional[Tuple[np.ndarray, np.ndarray, float]]:
        """The other padded plan: cuts that minimise padding, then grouped by cost: (bounds, perm, span).

        The step-wise cut fills batches to a common target and pays padding wherever a batch
        straddles two lengths; with few samples per length (a 100k-sample epoch) that is 0.5 % of
        the padded tokens. This cut weighs padding against a price per batch (see
        ``_PAD_BATCH_PENALTY_DIVS``), so batches end where lengths change. Its batches are less even,
        so the caller keeps whichever plan has the smaller sum over steps of the step's largest
        padded cost (the epoch's time). Returns None when the batches cannot fill whole steps.
        """
        w = self.num_replicas
        n = int(re[-1])
        ends = np.empty(n, dtype=np.int64)
        total = self._cost_sum()
        for div in _PAD_BATCH_PENALTY_DIVS:
            nb = _P.padded_min_padding_cut(rc, re, budget, budget / div, ends)
            if nb == 0:
                return None  # no cut with a finite cost (sums past the float range): keep the step-wise one
            starts = np.concatenate(([0], ends[: nb - 1]))
            padded = float(((ends[:nb] - starts) * _run_cost_at(rc, re, starts)).sum())
            if padded <= 0 or 1.0 - total / padded <= _PAD_DP_WASTE:
                break
        want = -(-nb // w) * w
        if nb == 0 or want > n:
            return None
        bounds = np.concatenate([[0], ends[:nb]]).astype(np.int64)
        if want > nb:
            # Whole steps: split the W - 1 or fewer batches with the most items in two (a part of a
            # batch is within the cap and pads no more). want <= n, so when fewer batches than
            # splits have 2 items or more, the loop splits the largest one repeatedly.
            sizes = np.diff(bounds)
            big = np.argsort(-sizes, kind="stable")[: want - nb]
            if sizes[big[-1]] >= 2:
                bounds = np.sort(np.concatenate([bounds, bounds[big] + sizes[big] // 2]))
            else:
                cuts = bounds.tolist()
                for _ in range(want - nb):
                    sz = np.diff(np.asarray(cuts, dtype=np.int64))
                    i = int(np.argmax(sz))
                    cuts.insert(i + 1, cuts[i] + int(sz[i]) // 2)
                bounds = np.asarray(cuts, dtype=np.int64)
        perm, span = self._group_by_cost(bounds, _run_cost_at(rc, re, bounds[:-1]))
        return bounds, perm, span

    def _group_by_cost(self, bounds: np.ndarray, first: np.ndarray) -> Tuple[np.ndarray, float]:
        """Put batches of similar padded cost into the same step: the batch order, and its time.

        The cuts leave some steps mixing coarse batches (2 items of 8000 tokens next to 3 of 4500);
        sorted by padded cost (stable, so deterministic) and taken W at a time, every step holds
        neighbours in cost. Steps are the unit that the epoch's shuffle permutes, so the grouping
        survives it; each batch stays a contiguous run of items, longest first. ``first`` is the
        cost of each batch's first (longest) item. Returns the permutation of the batches (for
        ``gather_batches``) and the epoch's time in cost units.
        """
        padded = np.diff(bounds) * first
        perm = np.argsort(-padded, kind="stable").astype(np.int64)
        # The epoch's time in cost units: each step waits for its largest batch, which is the first
        # of its W in this descending order.
        span = float(padded[perm[:: self.num_replicas]].sum())
        return perm, span

    def _plan_packed(self) -> _Plan:
        s = self.sampler
        w = self.num_replicas
        budget = float(self.max_complexity)  # type: ignore[arg-type]
        rc, re = self._cost_runs()
        seed = _seed64(s.seed, s.epoch, "stream") if s.shuffle else None
        # Positions, not ids: mapping all 2M positions is a random gather, and a rank only needs
        # to map its own share (done per batch in __iter__).
        if rc[0] > budget:
            items, bounds = self._packed_over_budget(rc, re, budget, seed)
        else:
            items, bounds, _ = _P.packed_plan(rc, re, w, budget, _packed_steps(rc, re, w, budget), seed)
        items, bounds, duplicates, dropped = _fix_empty(items, bounds, w, self.drop_last)
        steps = (bounds.shape[0] - 1) // w
        if steps == 0:
            raise ConfigError(
                "LoadBalancingDistributedBatchSampler: the plan has no complete step (drop_last=True)"
            )
        step_order, rot = self._step_order(steps)
        return _Plan(items, bounds, step_order, rot, w, duplicates, dropped, ids=s._desc_order())

    def _packed_over_budget(
        self, rc: np.ndarray, re: np.ndarray, budget: float, seed: Optional[int]
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Packed mode's (positions, bounds) when some items alone cost more than the budget.

        Those items (the first positions of the longest-first order) cannot share a bin, and
        dealt among the others each would make one step wait for it alone (a plan with 1 % of
        its items over the budget had a straggler mean of 2.1). They get steps of their own
        instead, W neighbours in cost per step, as padded mode groups its batches by cost (ties
        shuffled with the epoch). When their count is not a multiple of W, the free ranks of
        their last step take the next items, longest first, each up to the budget: that step
        lasts as long as its over-budget items anyway. The other items are dealt as usual.
        """
        s = self.sampler
        w = self.num_replicas
        n = int(re[-1])
        if n > _INT32_MAX:
            raise ValueError(f"packed_plan: {n} items; packed mode plans at most {_INT32_MAX}")
        r1 = int(np.count_nonzero(rc > budget))  # costs are non-increasing: a prefix of the runs
        m = int(re[r1 - 1])
        over = np.arange(m, dtype=np.int64)
        if s.shuffle:
            _P.shuffle_runs_at(over, np.ascontiguousarray(re[:r1]), _seed64(s.seed, s.epoch, "over"))
        head = [np.arange(m + 1, dtype=np.int64)]  # one over-budget item per slot
        p = m
        if m % w:
            # The free ranks, in turn: items from p while they fit (compiled: one iteration per run
            # of equal costs, and 2M distinct float costs are 2M runs). Ranks still free (no items
            # left) stay empty here: _fix_empty then fills or drops the step.
            fill = np.empty(w - m % w, dtype=np.int64)
            p = int(_P.packed_fill(rc, re, m, budget, fill))
            head.append(fill)
        parts = [over.astype(np.int32), np.arange(m, p, dtype=np.int32)]
        if p < n:
            r0 = int(np.searchsorted(re, p, side="right"))  # the run holding position p
            sub_rc, sub_re = rc[r0:], re[r0:] - p
            rest, rest_bounds, _ = _P.packed_plan(
                sub_rc, sub_re, w, budget, _packed_steps(sub_rc, sub_re, w, budget), seed
            )
            parts.append(rest + np.int32(p))
            head.append(rest_bounds[1:] + p)
        return np.concatenate(parts), np.concatenate(head)

    def _plan_batch_fn(self) -> _Plan:
        s = self.sampler
        w = self.num_replicas
        n = s._n
        per_rank: List[List[np.ndarray]] = []
        for r in range(w):
            given = s.rank_indices(r)
            allowed = np.zeros(n, dtype=bool)
            allowed[given] = True
            try:
                out = self.batch_fn(given.tolist())  # type: ignore[misc]
            except Exception as exc:  # noqa: BLE001 - re-raised with the rank, never swallowed
                raise ConfigError(
                    f"batch_fn raised {type(exc).__name__} on rank {r}'s {given.shape[0]} indices: {exc}"
                ) from exc
            if isinstance(out, (str, bytes)) or not isinstance(out, Iterable):
                raise ConfigError(
                    f"batch_fn returned {type(out).__name__} for rank {r}; "
                    "it must return a list of index lists"
                )
            batches = []
            for j, batch in enumerate(out):
                try:
                    if _NP_RAGGED_WARNS:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            arr = np.asarray(batch)
                    else:
                        arr = np.asarray(batch)
                except ValueError:  # ragged: a batch holding lists
                    arr = np.empty((0, 0))
                if arr.ndim != 1 or arr.size == 0 or arr.dtype == object:
                    raise ConfigError(
                        f"batch_fn returned an empty or malformed batch (batch {j}, rank {r}): {batch!r}; "
                        "every batch must be a non-empty list of indices"
                    )
                if not np.issubdtype(arr.dtype, np.integer):
                    raise ConfigError(
                        f"batch_fn returned non-integer indices (batch {j}, rank {r}): {batch!r}"
                    )
                bad = (arr < 0) | (arr >= n)
                if not bad.any():
                    bad = ~allowed[arr]
                if bad.any():
                    k = int(arr[np.flatnonzero(bad)[0]])
                    raise ConfigError(
                        f"batch_fn returned index {k} (batch {j}, rank {r}) that is not among the "
                        f"{given.shape[0]} indices it was given"
                    )
                batches.append(arr.astype(np.int64))
            if not batches:
                raise ConfigError(
                    f"batch_fn returned no batches for rank {r} ({given.shape[0]} indices given)"
                )
            per_rank.append(batches)
        counts = [len(b) for b in per_rank]
        steps = min(counts) if self.drop_last else max(counts)
        slots: List[np.ndarray] = []
        for i in range(steps):
            for r in range(w):
                bl = per_rank[r]
                slots.append(bl[i % len(bl)])
        sizes = np.array([x.shape[0] for x in slots], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        items = np.concatenate(slots).astype(np.int64)
        # Counted from the plan, as the budget modes count them: the extra appearances of the
        # samples that appear more than once, and the samples that do not appear. Both take in the
        # wrapped sampler's padding and drop_last and this sampler's repeated and cut batches, and
        # a padding copy in a cut batch is neither (counting those separately counted it as both).
        present = int(np.count_nonzero(np.bincount(items, minlength=n)))
        duplicates = int(items.shape[0]) - present
        dropped = n - present
        return _Plan(
            items,
            bounds,
            np.arange(steps, dtype=np.int64),
            np.zeros(steps, dtype=np.int64),
            w,
            duplicates,
            dropped,
        )

    def _resume_applies(self) -> bool:
        return super()._resume_applies() and self.sampler._epoch_changes == self._resume_changes

    # ----------------------------------------------------------------------------- Sampler API
    def __iter__(self) -> Iterator[List[int]]:
        plan = self._plan()
        self.epoch = self.sampler.epoch
        start = self._start(self.sampler.shuffle)
        self._delivered = start
        self._tracked, self._track_next = self._track_next, False
        self._counted_epoch = self.epoch
        # Each batch's list is made when it is asked for, from a memoryview slice (no numpy call
        # per batch): the epoch's int objects never all live at once.
        slots = plan.slots(self.rank)
        if plan.ids is None:
            # The plan holds the dataset indices: slice it where this rank's batches are.
            values = plan.items.data  # a memoryview
            lo, hi = plan.bounds[slots].tolist(), plan.bounds[slots + 1].tolist()
        else:
            # The plan holds positions in the sorted order: map this rank's share (one compiled
            # pass; 1/W of the plan), not the whole plan, as int32 ids when they fit (ids is an
            # order of the dataset): 4 bytes an item instead of 8, half the rank share's pages.
            flat, offs = _P.rank_batches(
                plan.items, plan.bounds, slots, plan.ids, narrow=plan.ids.shape[0] <= _INT32_MAX + 1
            )
            values = memoryview(flat)
            lo, hi = offs[:-1].tolist(), offs[1:].tolist()
        for i in range(start, plan.steps):
            self._position = i + 1
            yield values[lo[i] : hi[i]].tolist()

    def __len__(self) -> int:
        """Batches the next iteration yields (the same on every rank), less a restored state's."""
        self.epoch = self.sampler.epoch
        return self._plan().steps - self._remaining_skip()

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of this and the wrapped sampler (Bagua's ``set_epoch``).

        Args:
            epoch: epoch number.
        """
        self.sampler.set_epoch(epoch)
        self.epoch = self.sampler.epoch
        if self._resume is not None and self._resume[0] != self.epoch:
            self._resume = None

    def track(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``loader`` and count the batches handed to the training loop.

        A DataLoader with workers draws batches from this sampler ahead of the loop (prefetch);
        with ``track``, :meth:`state_dict` counts the batches the loop actually received.

        Args:
            loader: a DataLoader built with ``batch_sampler=`` this sampler, or with ``sampler=``
                it and ``batch_size=None`` (a dataset whose ``__getitem__`` takes a whole batch of
                indices), or any iterable that draws from it in order.

        Raises:
            ConfigError: a DataLoader that draws from another (batch) sampler, or that delivers out
                of order (``in_order=False``).

        Example::

            >>> for batch in batch_sampler.track(loader):  # doctest: +SKIP
            ...     train_step(batch)
            ...     if time_to_checkpoint:
            ...         save(batch_sampler.state_dict())
        """
        # DataLoader(batch_sampler=self), or DataLoader(sampler=self, batch_size=None): each index
        # the loader draws is then one of these batches (a dataset that fetches a batch at once).
        draws = getattr(loader, "batch_sampler", None) is self or (
            getattr(loader, "sampler", None) is self and getattr(loader, "batch_size", 0) is None
        )
        self._check_tracked_loader(loader, draws)
        return self._track(loader)

    def _track(self, loader: Iterable[Any]) -> Iterator[Any]:
        self._track_next = True  # the iteration the loader starts now is the tracked one
        for batch in loader:
            self._delivered += 1
            yield batch

    # ----------------------------------------------------------------------------- resume
    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """The position in the epoch, for resuming mid-epoch.

        Args:
            consumed: batches of this epoch the training loop has used. Default: those delivered
                through :meth:`track` if it is used, else those yielded by this sampler (equal
                without DataLoader workers).

        .. warning::
            A DataLoader with workers prefetches batches from this sampler: iterate through
            :meth:`track` (or pass ``consumed=``) or the resumed run skips the prefetched batches.

        Returns:
            dict: epoch, seed, consumed, num_replicas, rank, dataset size and digest, mode, budget;
            in batch_fn mode also the wrapped sampler's ``random_level`` and ``drop_last``
            (``sampler_drop_last``), which decide the indices batch_fn is given.
        """
        s = self.sampler
        if consumed is not None:
            pos = _as_int(consumed, "state_dict: consumed")
        elif self._counted_epoch != s.epoch:
            pos = 0  # this epoch has not been iterated (set_epoch was called since)
        elif self._tracked:
            pos = self._delivered
        else:
            pos = self._position
        total = self._plan().steps
        if not 0 <= pos <= total:
            raise ConfigError(f"state_dict: consumed={pos} is outside [0, {total}]")
        return {
            "kind": type(self).__name__,
            "version": _STATE_VERSION,
            "epoch": s.epoch,
            "seed": s.seed,
            "consumed": pos,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "dataset_size": s._n,
            "digest": s.digest(),
            "mode": self.mode,
            "max_complexity": self.max_complexity,
            "cost": list(self.cost),
            "drop_last": self.drop_last,
            "shuffle": s.shuffle,
            **self._sampler_config(),
        }

    def _sampler_config(self) -> Dict[str, Any]:
        """The wrapped sampler's settings that decide this one's batches beyond those above: in
        batch_fn mode its streams (random_level, its own drop_last) are what batch_fn is given;
        budget mode plans from the complexities alone and uses neither."""
        if self.mode != "batch_fn":
            return {}
        return {"random_level": self.sampler.random_level, "sampler_drop_last": self.sampler.drop_last}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume: the next iteration continues the saved epoch after its consumed batches.

        Raises:
            ConfigError: the state comes from another world size, dataset or configuration.
        """
        s = self.sampler
        mine = {
            "mode": self.mode,
            "max_complexity": self.max_complexity,
            "cost": list(self.cost),
            "drop_last": self.drop_last,
            "shuffle": s.shuffle,
        }
        _check_state(state, type(self).__name__, self.num_replicas, s._n, s.digest, tuple(mine))
        for key, value in mine.items():
            saved = state[key]
            if key == "cost" and isinstance(saved, tuple):
                saved = list(saved)  # a state kept as Python objects, or re-made by hand
            if saved != value:
                raise ConfigError(
                    f"load_state_dict: the state was saved with {key}={state[key]!r}, this batch sampler "
                    f"has {value!r}; the resumed batches would differ"
                )
        # After the mode: a budget-mode state lacks batch_fn mode's keys of the wrapped sampler,
        # and the mismatch of modes is the error to report.
        sampler_config = self._sampler_config()
        missing = [k for k in sampler_config if k not in state]
        if missing:
            # Saved by a trainloom that did not record them (their check is newer): loaded unchecked.
            log.warning(
                "%s.load_state_dict: the state has no %s (saved by an earlier trainloom); not checked "
                "against the wrapped sampler's",
                type(self).__name__,
                missing,
            )
        for key, value in sampler_config.items():
            if key in state and state[key] != value:
                raise ConfigError(
                    f"load_state_dict: the state was saved with {key}={state[key]!r}, the wrapped sampler "
                    f"has {value!r}; the resumed order would differ"
                )
        seed, epoch = int(state["seed"]), int(state["epoch"])
        # The saved epoch's step count, planned without changing the sampler: a state rejected here
        # leaves its seed and epoch as they were (the plan stays cached for the accepted case).
        kept = (s.seed, s.epoch, s._cache)
        s.seed, s.epoch, s._cache = seed, epoch, None
        try:
            total = self._plan().steps
        finally:
            s.seed, s.epoch, s._cache = kept
        if not 0 <= int(state["consumed"]) <= total:
            raise ConfigError(f"load_state_dict: consumed={state['consumed']} is outside [0, {total}]")
        s.seed = seed
        s._cache = None
        s.set_epoch(epoch)
        self.epoch = s.epoch
        self._resume = (self.epoch, int(state["consumed"]))
        self._resume_changes = s._epoch_changes
        self._position = self._delivered = int(state["consumed"])
        self._counted_epoch = self.epoch

    # ----------------------------------------------------------------------------- diagnostics
    def plan_stats(self) -> Dict[str, Any]:
        """Balance and padding of this epoch's plan, over all ranks.

        Returns:
            dict with ``steps``, ``world_size``, ``mode``; ``straggler_mean`` / ``straggler_p99``:
            max over ranks of a step's cost (the mode's: padded cost, or summed cost) over the mean
            over ranks; the same for ``sum(len)`` (``straggler_len_*``) and ``sum(len**2)``
            (``straggler_len2_*``); ``padding_waste`` (share of a padded batch that is padding; in
            packed mode what padding would waste, for comparison: packed models do not pad);
            ``max_batch_cost`` and ``max_batch_cost_ratio`` (to the budget); ``duplicates``,
            ``dropped`` (in batch_fn mode these include the wrapped sampler's padding and
            drop_last) and ``empty_rank_steps``.
        """
        plan = self._plan()
        w = self.num_replicas
        c = self.sampler.complexities
        a, b = self.cost
        lens = c[plan.item_ids()]
        starts = plan.bounds[:-1]
        counts = np.diff(plan.bounds)
        nonempty = counts > 0
        safe = np.minimum(starts, max(lens.shape[0] - 1, 0))

        def per_slot(values: np.ndarray, op: Any) -> np.ndarray:
            out = op.reduceat(values, safe) if values.shape[0] else np.zeros(starts.shape[0])
            return np.where(nonempty, out, 0.0)

        s_len = per_slot(lens, np.add)
        s_len2 = per_slot(lens * lens, np.add)
        mx = per_slot(lens, np.maximum)
        padded_len = counts * mx
        item_cost = a * lens + b * lens * lens
        summed_cost = per_slot(item_cost, np.add)
        padded_cost = counts * (a * mx + b * mx * mx)
        mode_cost = padded_cost if self.mode == "padded" else summed_cost
        mat = plan.slot_matrix()
        mean, p99 = _ratio_stats(mode_cost[mat])
        l_mean, l_p99 = _ratio_stats(s_len[mat])
        l2_mean, l2_p99 = _ratio_stats(s_len2[mat])
        total_padded = float(padded_len.sum())
        budget = self.max_complexity
        max_cost = float(mode_cost.max()) if mode_cost.size else 0.0
        return {
            "steps": plan.steps,
            "world_size": w,
            "mode": self.mode,
            "straggler_mean": mean,
            "straggler_p99": p99,
            "straggler_len_mean": l_mean,
            "straggler_len_p99": l_p99,
            "straggler_len2_mean": l2_mean,
            "straggler_len2_p99": l2_p99,
            "padding_waste": (total_padded - float(s_len.sum())) / total_padded if total_padded > 0 else 0.0,
            "max_batch_cost": max_cost,
            "max_batch_cost_ratio": max_cost / budget if budget else None,
            "duplicates": plan.duplicates,
            "dropped": plan.dropped,
            "empty_rank_steps": int((~nonempty).sum()),
        }


def _packed_steps(rc: np.ndarray, re: np.ndarray, world: int, budget: float) -> int:
    """Steps to plan packed mode's deal of a run table in (the deal adds a few for left-overs)."""
    n = int(re[-1])
    # sum(min(cost, budget)) over the items, from the run table.
    eff = float(np.minimum(rc, budget) @ np.diff(re, prepend=0))
    # Plan each step a little under W * budget: about half an average item of slack per rank,
    # so the longest-first deal rarely leaves an item that fits no rank.
    # (eff / n, not eff: the mean can round to 0.0 when eff is a subnormal; per_bin >= 1, as
    # every item counts at most the budget.)
    per_bin = budget / (eff / n) if eff / n > 0 else float(n)
    fill = min(0.999, max(0.5, 1.0 - 0.5 / per_bin))
    nsteps = max(1, math.ceil(eff / (world * budget * fill))) if eff > 0 else 1
    return min(nsteps, max(1, n // world))  # a step needs >= world items, or a rank goes empty


def _run_cost_at(rc: np.ndarray, re: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Cost of the items at ``positions`` of the sorted order (clamped to the last), from the run table."""
    return rc[np.minimum(np.searchsorted(re, positions, side="right"), rc.shape[0] - 1)]


def _cut_tail(rc: np.ndarray, re: np.ndarray, p: int, q: int, world: int, budget: float) -> List[int]:
    """Cut positions [p, q) of the run table (longest first) into whole steps of ``world`` batches
    of similar padded cost.

    Returns the batch ends: a multiple of ``world`` of them, except when the items cannot fill
    whole steps (fewer items than batches needed), where the last step is left incomplete for the
    caller to pad or drop.
    """
    n = q - p
    if n <= world:
        return list(range(p + 1, q + 1))
    ends = np.empty(n, dtype=np.int64)
    need = _P.greedy_cut(rc, re, p, q, budget, budget, ends, n)  # fewest batches the cap allows
    steps = -(-need // world)
    if steps * world > n:
        return ends[:need].tolist()  # degenerate: not enough items for whole steps
    want = steps * world
    k = _P.lowest_target_cut(rc, re, p, q, budget, want, ends)  # the most even cut into <= want batches
    cuts = [p, *ends[:k].tolist()]
    while len(cuts) - 1 < want:
        # Split the batch with the most items (any part of a batch is within the cap).
        sizes = [cuts[i + 1] - cuts[i] for i in range(len(cuts) - 1)]
        i = int(np.argmax(sizes))
        cuts.insert(i + 1, cuts[i] + sizes[i] // 2)
    return cuts[1:]


def _fix_empty(
    items: np.ndarray, bounds: np.ndarray, world: int, drop_last: bool
) -> Tuple[np.ndarray, np.ndarray, int, int]:
    """Give every rank of every step at least one item (packed mode's tail and tiny datasets).

    Moves the shortest item of the fullest rank to an empty one while possible; a step that still
    has an empty rank then gets duplicated items (drop_last=False) or is left out (drop_last=True).
    """
    counts = np.diff(bounds).reshape(-1, world)
    bad_steps = np.flatnonzero((counts == 0).any(axis=1))
    if bad_steps.size == 0:
        return items, bounds, 0, 0
    duplicates = dropped = 0
    slots: List[np.ndarray] = [items[bounds[i] : bounds[i + 1]] for i in range(bounds.shape[0] - 1)]
    keep = np.ones(counts.shape[0], dtype=bool)
    for st in bad_steps.tolist():
        bins = [list(slots[st * world + j].tolist()) for j in range(world)]
        while True:
            empty = [j for j in range(world) if not bins[j]]
            if not empty:
                break
            full = max(range(world), key=lambda j: len(bins[j]))
            if len(bins[full]) < 2:
                break
            bins[empty[0]].append(bins[full].pop())
        empty = [j for j in range(world) if not bins[j]]
        if len(empty) == world:
            keep[st] = False  # the equal-cost cut can leave a step with no item at all
            continue
        if empty:
            if drop_last:
                keep[st] = False
                dropped += sum(len(x) for x in bins)
                continue
            pool = [x for bn in bins for x in bn]
            for k, j in enumerate(empty):
                bins[j].append(pool[-1 - (k % len(pool))])
                duplicates += 1
        for j in range(world):
            slots[st * world + j] = np.asarray(bins[j], dtype=items.dtype)
    kept = [slots[st * world + j] for st in np.flatnonzero(keep).tolist() for j in range(world)]
    sizes = np.array([x.shape[0] for x in kept], dtype=np.int64)
    new_bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    new_items = np.concatenate(kept) if kept else np.empty(0, dtype=items.dtype)
    return new_items, new_bounds, duplicates, dropped
