"""Train a small sequence model end to end with every part of trainloom, on this machine's CPUs.

``trainloom demo`` starts ``--nproc`` local processes (2 by default) that train a small 1-D
convolutional classifier on a synthetic variable-length dataset whose samples are expensive to
produce. Every part of trainloom is in the loop:

* the dataset is wrapped in :class:`~trainloom.data.CachedDataset` (LMDB by default, Redis with
  ``--backend redis``): the first epoch computes and caches every sample, later epochs read them back;
* batches come from :class:`~trainloom.data.LoadBalancingDistributedBatchSampler` in budget mode:
  every rank gets the same number of padded tokens at every step;
* gradients live in the flat buffers of :func:`~trainloom.optim.fuse_optimizer` and are averaged with
  one :func:`trainloom.comm.allreduce_inplace` per buffer (the shared-memory engine on one node);
* parameters are updated by ``optimizer.fuse_step()``.

At the end it prints a report: samples/s of the first (cache-filling) and later epochs, cache hit
rate, the measured per-step straggler ratio, time in communication and in the optimizer step, and the
loss per epoch. ``--compare`` runs the same training with plain torch (DistributedSampler, no cache,
gloo all_reduce, the optimizer's own ``step()``) and prints both side by side.

The demo leaves nothing behind: its processes and (with ``--backend redis``) its redis-server stop,
the shared-memory segments are unlinked, and its LMDB cache, created under the user's cache directory,
is removed unless ``--keep-cache`` is given.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

VOCAB = 64
PAD = 0


# ------------------------------------------------------------------------------------------------
# The synthetic dataset
# ------------------------------------------------------------------------------------------------
class SyntheticSequences(torch.utils.data.Dataset):
    """Variable-length token sequences whose samples cost CPU time to produce.

    Lengths follow a log-normal distribution (like sentences or utterances) and are known up front
    (``self.lengths``: the metadata a load-balancing sampler reads). A sample's label says whether
    tokens from the lower half of the vocabulary outnumber the upper half; producing a sample burns
    ``cost_us_per_token`` microseconds per token, standing in for decoding or feature extraction.
    """

    def __init__(self, num_samples: int, seed: int = 0, cost_us_per_token: float = 8.0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        rng = np.random.default_rng(seed)
        lengths = np.exp(rng.normal(math.log(48.0), 0.7, size=num_samples))
        self.lengths = np.clip(lengths, 4, 384).astype(np.int64)
        self.seed = seed
        self.cost_us_per_token = float(cost_us_per_token)
        if not (math.isfinite(self.cost_us_per_token) and self.cost_us_per_token >= 0):
            raise ValueError(f"cost_us_per_token must be a finite number >= 0, got {cost_us_per_token}")

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        n = int(self.lengths[index])
        rng = np.random.default_rng((self.seed, index))
        bias = rng.uniform(0.3, 0.7)
        low = rng.random(n) < bias
        tokens = np.where(low, rng.integers(1, VOCAB // 2, n), rng.integers(VOCAB // 2, VOCAB, n))
        label = int(low.sum() * 2 > n)
        deadline = time.perf_counter() + n * self.cost_us_per_token * 1e-6
        while time.perf_counter() < deadline:  # the "expensive" part: decoding, feature extraction
            pass
        return torch.from_numpy(tokens.astype(np.int64)), label


def collate_padded(batch: Sequence[Tuple[torch.Tensor, int]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pad a batch of (tokens, label) to its longest sequence with token 0."""
    longest = max(int(t.shape[0]) for t, _ in batch)
    tokens = torch.full((len(batch), longest), PAD, dtype=torch.int64)
    for row, (t, _) in enumerate(batch):
        tokens[row, : t.shape[0]] = t
    labels = torch.tensor([label for _, label in batch], dtype=torch.int64)
    return tokens, labels


class ConvClassifier(torch.nn.Module):
    """Embedding, two 1-D convolutions and a masked mean: a small sequence classifier."""

    def __init__(self, dim: int = 48) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.conv1 = torch.nn.Conv1d(dim, dim, 5, padding=2)
        self.conv2 = torch.nn.Conv1d(dim, dim, 5, padding=2)
        self.head = torch.nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != PAD).unsqueeze(1).float()
        x = self.embed(tokens).transpose(1, 2)
        x = torch.relu(self.conv1(x)) * mask
        x = torch.relu(self.conv2(x)) * mask
        pooled = x.sum(2) / mask.sum(2).clamp_min(1.0)
        return self.head(pooled)


# ------------------------------------------------------------------------------------------------
# One rank's training
# ------------------------------------------------------------------------------------------------
@dataclass
class DemoConfig:
    mode: str = "trainloom"  # or "torch"
    epochs: int = 3
    nproc: int = 2
    backend: str = "lmdb"
    samples: int = 1536
    budget: int = 2048  # padded tokens per rank per step
    cost_us_per_token: float = 8.0
    lr: float = 3e-3
    seed: int = 0
    cache_dir: str = ""
    progress: bool = True


@dataclass
class EpochStats:
    seconds: float
    samples: int
    loss: float
    steps: int
    comm_s: float
    optim_s: float
    straggler_mean: float
    straggler_p99: float
    padding_waste: float = 0.0
    hits: int = 0
    misses: int = 0


@dataclass
class RunResult:
    mode: str
    engine: str
    epochs: List[EpochStats] = field(default_factory=list)
    plan: Dict[str, Any] = field(default_factory=dict)


def _straggler(step_times: torch.Tensor) -> Tuple[float, float]:
    """max/mean over ranks of each step's compute time -> (mean, p99) over the epoch's steps."""
    if step_times.numel() == 0:
        return 1.0, 1.0
    ratio = step_times.max(0).values / step_times.mean(0).clamp_min(1e-12)
    return float(ratio.mean()), float(torch.quantile(ratio, 0.99))


def _train_trainloom(cfg: DemoConfig, rank: int, world: int) -> RunResult:
    import trainloom.comm as comm
    from trainloom.data.cache import CachedDataset
    from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler
    from trainloom.optim import flat_buffers, fuse_optimizer

    group = comm.init_process_group()
    engine = group.get_global_communicator().cpu_engine_kind()
    base = SyntheticSequences(cfg.samples, cfg.seed, cfg.cost_us_per_token)
    store_kwargs: Dict[str, Any] = {"path": cfg.cache_dir} if cfg.backend == "lmdb" else {}
    dataset = CachedDataset(base, backend=cfg.backend, dataset_name="trainloom-demo", **store_kwargs)
    sampler = LoadBalancingDistributedSampler(
        dataset, complexities=base.lengths, num_replicas=world, rank=rank, seed=cfg.seed
    )
    batches = LoadBalancingDistributedBatchSampler(sampler, max_complexity=cfg.budget, mode="padded")
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=collate_padded)

    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    model = ConvClassifier()
    optimizer = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=cfg.lr))
    result = RunResult(
        "trainloom", engine, plan=batches.plan_stats() if hasattr(batches, "plan_stats") else {}
    )
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        batches.set_epoch(epoch)
        before = dataset.stats()
        stats = _run_epoch(
            cfg,
            rank,
            world,
            epoch,
            loader,
            model,
            optimizer,
            len(batches),
            _avg_fused(comm, flat_buffers),
            optimizer.fuse_step,
        )
        dataset.cache_loader.flush()  # make this rank's last samples visible to the others
        after = dataset.stats()
        stats.hits = after["hits"] - before["hits"]
        stats.misses = after["misses"] - before["misses"]
        counts = torch.tensor([stats.hits, stats.misses], dtype=torch.int64)
        comm.allreduce_inplace(counts, op=comm.ReduceOp.SUM)
        stats.hits, stats.misses = int(counts[0]), int(counts[1])
        result.epochs.append(stats)
    dataset.cache_loader.close()
    comm.destroy_process_group()
    return result


def _avg_fused(comm: Any, flat_buffers: Any) -> Any:
    def average(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for buf in flat_buffers(optimizer, "grad"):
            comm.allreduce_inplace(buf, op=comm.ReduceOp.AVG)

    return average


def _train_torch(cfg: DemoConfig, rank: int, world: int) -> RunResult:
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  (before the group: see below)
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    # The optimizer below imports torch.distributed.nn.functional, whose default arguments
    # (group=group.WORLD) would keep the group, and its gloo threads, until the rank's exit, where a
    # thread could abort it; trainloom's init_process_group() imports the module first too.
    dist.init_process_group("gloo", rank=rank, world_size=world)
    base = SyntheticSequences(cfg.samples, cfg.seed, cfg.cost_us_per_token)
    # The same number of steps per epoch as trainloom's budgeted plan: a fixed batch size a user would pick.
    batch_size = max(1, math.ceil(cfg.samples / (world * _trainloom_steps(cfg, base, world))))
    sampler: torch.utils.data.DistributedSampler = torch.utils.data.DistributedSampler(
        base, num_replicas=world, rank=rank, seed=cfg.seed
    )
    loader = torch.utils.data.DataLoader(
        base, batch_size=batch_size, sampler=sampler, collate_fn=collate_padded
    )
    torch.manual_seed(cfg.seed)
    model = ConvClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def average(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat /= world
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    result = RunResult("torch", "gloo")
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        stats = _run_epoch(
            cfg, rank, world, epoch, loader, model, optimizer, len(loader), average, optimizer.step
        )
        stats.misses = len(sampler) * world
        result.epochs.append(stats)
    dist.destroy_process_group()
    return result


def _trainloom_steps(cfg: DemoConfig, base: SyntheticSequences, world: int) -> int:
    from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

    s = LoadBalancingDistributedSampler(None, complexities=base.lengths, num_replicas=world, rank=0)
    return len(LoadBalancingDistributedBatchSampler(s, max_complexity=cfg.budget, mode="padded"))


def _gather_all(t: torch.Tensor, world: int) -> torch.Tensor:
    """All ranks' copies of ``t`` stacked (uses whichever process group is initialized)."""
    import torch.distributed as dist

    if world == 1:
        return t.unsqueeze(0)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return torch.stack(out)


def _run_epoch(
    cfg: DemoConfig,
    rank: int,
    world: int,
    epoch: int,
    loader: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    num_steps: int,
    average: Any,
    step: Any,
) -> EpochStats:
    from tqdm.auto import tqdm

    loss_fn = torch.nn.CrossEntropyLoss()
    step_times: List[float] = []
    comm_s = optim_s = 0.0
    loss_sum = 0.0
    samples = 0
    real_tokens = padded_tokens = 0
    bar = tqdm(
        total=num_steps,
        desc=f"[{cfg.mode}] epoch {epoch + 1}/{cfg.epochs}",
        unit="step",
        disable=True if not (cfg.progress and rank == 0) else None,  # None: only on a terminal
        leave=True,
        file=sys.stderr,
    )
    t_epoch = time.perf_counter()
    it = iter(loader)
    for _ in range(num_steps):
        t0 = time.perf_counter()
        tokens, labels = next(it)
        optimizer.zero_grad()
        loss = loss_fn(model(tokens), labels)
        loss.backward()
        t1 = time.perf_counter()
        average(model, optimizer)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        step_times.append(t1 - t0)  # data + compute: what differs between ranks
        comm_s += t2 - t1
        optim_s += t3 - t2
        loss_sum += float(loss.detach()) * labels.shape[0]
        real_tokens += int((tokens != PAD).sum())
        padded_tokens += int(tokens.numel())
        samples += int(labels.shape[0])
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    seconds = time.perf_counter() - t_epoch
    bar.close()
    local = torch.tensor(
        [seconds, float(samples), loss_sum, comm_s, optim_s, float(real_tokens), float(padded_tokens)],
        dtype=torch.float64,
    )
    every = _gather_all(local, world)
    times = _gather_all(torch.tensor(step_times, dtype=torch.float64), world)
    s_mean, s_p99 = _straggler(times)
    total_samples = int(every[:, 1].sum())
    return EpochStats(
        seconds=float(every[:, 0].max()),
        samples=total_samples,
        loss=float(every[:, 2].sum()) / max(total_samples, 1),
        steps=num_steps,
        comm_s=float(every[:, 3].mean()),
        optim_s=float(every[:, 4].mean()),
        straggler_mean=s_mean,
        straggler_p99=s_p99,
        padding_waste=1.0 - float(every[:, 5].sum()) / max(float(every[:, 6].sum()), 1.0),
    )


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (a multi-line message's lines joined with "; ")."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {'; '.join(lines)}" if lines else type(exc).__name__


def _interrupt_once(signum: int, frame: Any) -> None:
    """A rank's SIGINT handler: one KeyboardInterrupt, then SIGINT is ignored. A Ctrl-C reaches a
    rank twice (from the terminal and forwarded by the parent); the second must not interrupt its exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _worker(rank: int, cfg: DemoConfig, port: int, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(cfg.nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(cfg.nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.nproc))
    signal.signal(signal.SIGINT, _interrupt_once)  # launch() started this rank ignoring SIGINT
    try:
        train = _train_trainloom if cfg.mode == "trainloom" else _train_torch
        result = train(cfg, rank, cfg.nproc)
    except KeyboardInterrupt:  # Ctrl-C: the parent says so, once
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which prints it and exits 1
        # Report the failure to the parent, which prints one line for the run, and exit non-zero
        # without re-raising: a re-raised exception makes multiprocessing print a traceback per rank.
        # A rank that failed only because a peer died is marked as such, so that the parent names
        # the rank that failed first.
        queue.put((rank, "error", (_one_line(exc), _peer_lost(exc))))
        sys.exit(1)
    queue.put((rank, "ok", result if rank == 0 else None))


def _peer_lost(exc: BaseException) -> bool:
    """Whether a rank's error only says that another rank is gone: torch's DistError (a closed
    connection), or trainloom's CommError, which the demo's own calls raise only when a peer died or
    left (they never disagree between ranks)."""
    import torch.distributed as dist

    from trainloom.errors import CommError

    return isinstance(exc, (dist.DistError, CommError))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cfg: DemoConfig, timeout: float = 600.0) -> RunResult:
    """Run one training on ``cfg.nproc`` local processes and return rank 0's result.

    Raises:
        RuntimeError: a rank failed, or the run timed out. The message is one line naming the rank
            that failed first and its error (``the trainloom run failed on rank 0: StoreError: ...``).
    """
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg, port, queue), daemon=True) for r in range(cfg.nproc)]
    # When one rank fails, the others lose their connection to it, and torch's C++ side logs each lost
    # connection as a warning with a stack dump. The failure is reported once, by the parent; the
    # user's own TORCH_CPP_LOG_LEVEL wins. (Ranks are spawned: they read the variable at start.)
    saved = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # Ctrl-C is the parent's to report. The ranks start with SIGINT ignored (kept across exec), so a
    # Ctrl-C while they import torch prints no traceback per rank; _worker takes SIGINT back once
    # it can end quietly, and the parent forwards its own to them (see below).
    own_sigint = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT)
    if own_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        if own_sigint:
            signal.signal(signal.SIGINT, own_sigint)
    result: Optional[RunResult] = None
    errors: List[Tuple[int, str, bool]] = []
    reported: Set[int] = set()
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(reported) < cfg.nproc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if errors:  # only ranks that lost a peer reported: name the first of them
                    break
                raise RuntimeError(f"the {cfg.mode} run did not finish within {timeout:.0f}s")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:  # see whether a rank died without reporting
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reported]
                if dead and queue.empty():
                    time.sleep(0.5)
                    if queue.empty():
                        if errors:
                            break
                        codes = ", ".join(f"rank {r} exit code {procs[r].exitcode}" for r in dead)
                        raise RuntimeError(
                            f"the {cfg.mode} run failed: ranks died without a report ({codes})"
                        ) from None
                continue
            reported.add(rank)
            if status == "error":
                message, peer_lost = payload
                errors.append((rank, message, peer_lost))
                if not peer_lost:
                    break
                # this rank lost a peer: wait a little for the report of the rank that failed first
                deadline = min(deadline, time.monotonic() + 5.0)
                continue
            if rank == 0:
                result = payload
        finished = not errors
    except BaseException:  # timed out, or interrupted: ask the ranks to stop (KeyboardInterrupt in them)
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGINT)
        raise
    finally:
        for p in procs:
            p.join(timeout=10 if finished else 2)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        first = next((e for e in errors if not e[2]), errors[0])
        raise RuntimeError(f"the {cfg.mode} run failed on rank {first[0]}: {first[1]}")
    if result is None:
        raise RuntimeError(f"the {cfg.mode} run: rank 0 returned no result")
    return result


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def _rate(e: EpochStats) -> float:
    return e.samples / e.seconds if e.seconds > 0 else float("nan")


def report(results: Sequence[RunResult]) -> str:
    """The end-of-run report, one column per run."""
    cols = []
    for r in results:
        first, later = r.epochs[0], r.epochs[1:]
        later_rate = float(np.median([_rate(e) for e in later])) if later else float("nan")
        lookups = sum(e.hits + e.misses for e in later)
        hit_rate = sum(e.hits for e in later) / lookups if lookups and r.mode == "trainloom" else 0.0
        # per-step costs in the steady state, as the rate: the first epoch also holds one-off work
        # (lazy optimizer state, the fused kernels' check against torch, cache misses)
        steady = later if later else r.epochs
        steps = sum(e.steps for e in steady)
        tag = " (later)" if later else ""
        cols.append(
            {
                "engine": f"{r.mode} ({r.engine})",
                "first epoch samples/s": f"{_rate(first):,.0f}",
                "later epochs samples/s": f"{later_rate:,.0f}" if later else "n/a",
                # with one epoch there is no later epoch: every lookup filled the cache
                "cache hit rate (later epochs)": (f"{hit_rate:.1%}" if later else "n/a")
                if r.mode == "trainloom"
                else "no cache",
                "straggler ratio mean/p99": f"{np.mean([e.straggler_mean for e in r.epochs]):.3f} / "
                f"{np.max([e.straggler_p99 for e in r.epochs]):.3f}",
                "padding waste": f"{float(np.mean([e.padding_waste for e in r.epochs])):.1%}",
                f"communication ms/step{tag}": f"{1e3 * sum(e.comm_s for e in steady) / steps:.3f}",
                f"optimizer step ms/step{tag}": f"{1e3 * sum(e.optim_s for e in steady) / steps:.3f}",
                "loss per epoch": " -> ".join(f"{e.loss:.3f}" for e in r.epochs),
                "total time s": f"{sum(e.seconds for e in r.epochs):.1f}",
            }
        )
    keys = list(cols[0])
    width = max(len(k) for k in keys) + 2
    colw = [max(len(c["engine"]), *(len(c[k]) for k in keys)) + 2 for c in cols]
    lines = ["", "trainloom demo report", "=" * (width + sum(colw))]
    for k in keys:
        lines.append(k.ljust(width) + "".join(c[k].ljust(w) for c, w in zip(cols, colw)))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``trainloom demo``."""
    p.add_argument(
        "--epochs", type=int, default=3, help="training epochs (default 3; the first fills the cache)"
    )
    p.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    p.add_argument("--backend", choices=("lmdb", "redis"), default="lmdb", help="cache store (default lmdb)")
    p.add_argument("--samples", type=int, default=1536, help="dataset size (default 1536)")
    p.add_argument("--budget", type=int, default=2048, help="padded tokens per rank per step (default 2048)")
    p.add_argument(
        "--cost-us", type=float, default=8.0, help="CPU microseconds to produce one token (default 8)"
    )
    p.add_argument("--compare", action="store_true", help="also train with plain torch and compare")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, model and sampler (default 0)")
    p.add_argument("--keep-cache", action="store_true", help="keep the demo's LMDB cache after the run")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _cache_root() -> Path:
    env = os.environ.get("TRAINLOOM_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trainloom"


def _redis_problem() -> Optional[str]:
    """Why ``--backend redis`` cannot run here (missing redis-py or redis-server), or None."""
    import importlib.util

    from trainloom._locate import REDIS_SERVER_ENV, find_redis_server

    if importlib.util.find_spec("redis") is None:
        return "--backend redis needs redis-py: pip install 'trainloom[redis]', or use --backend lmdb"
    if find_redis_server() is not None:
        return None
    explicit = os.environ.get(REDIS_SERVER_ENV)
    if explicit:
        return (
            f"--backend redis: {REDIS_SERVER_ENV}={explicit} is not an executable file; point it at a "
            "redis-server binary or unset it, or use --backend lmdb"
        )
    return (
        "--backend redis needs a redis-server binary: install one on PATH, set "
        f"{REDIS_SERVER_ENV}, or pip install 'trainloom[redis]' (bundles one); or use --backend lmdb"
    )


def _cache_dir_problem(root: Path, exc: OSError) -> str:
    """One line for a cache directory that could not be made under ``root``, and how to fix it."""
    why = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
    for p in (root, *root.parents):  # the usual cause: part of the path is a file
        if p.exists():
            if not p.is_dir():
                why = f"{p} is not a directory"
            break
    if os.environ.get("TRAINLOOM_CACHE_DIR"):
        where, fix = f"TRAINLOOM_CACHE_DIR={root}", "set TRAINLOOM_CACHE_DIR to a writable directory"
    else:
        where, fix = str(root), "set TRAINLOOM_CACHE_DIR to a writable directory for it"
    return f"cannot create the demo's cache directory in {where} ({why}); {fix}"


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; returns the exit code."""
    for name in ("epochs", "nproc", "samples", "budget"):
        if getattr(args, name) < 1:
            print(f"trainloom demo: --{name} must be >= 1", file=sys.stderr)
            return 2
    if args.nproc > args.samples:
        print("trainloom demo: --nproc must not exceed --samples", file=sys.stderr)
        return 2
    if not (math.isfinite(args.cost_us) and args.cost_us >= 0):
        # inf would make every sample busy-wait forever (and nan never ends the wait either)
        print(f"trainloom demo: --cost-us must be a finite number >= 0, got {args.cost_us}", file=sys.stderr)
        return 2
    if args.backend == "redis":
        problem = _redis_problem()
        if problem is not None:  # found before any rank starts, instead of a failure on every rank
            print(f"trainloom demo: {problem}", file=sys.stderr)
            return 1
    root = _cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        cache_dir = tempfile.mkdtemp(prefix="demo-", dir=root)
    except OSError as exc:
        print(f"trainloom demo: {_cache_dir_problem(root, exc)}", file=sys.stderr)
        return 1
    cfg = DemoConfig(
        epochs=args.epochs,
        nproc=args.nproc,
        backend=args.backend,
        samples=args.samples,
        budget=args.budget,
        cost_us_per_token=args.cost_us,
        seed=args.seed,
        cache_dir=cache_dir,
        progress=not args.no_progress,
    )
    where = (
        f"LMDB cache in {cache_dir}"
        if cfg.backend == "lmdb"
        else "Redis cache on a redis-server started for the job"
    )
    print(
        f"trainloom demo: {cfg.nproc} processes, {cfg.samples} variable-length samples, {cfg.epochs} epochs, "
        f"{where}",
        flush=True,
    )
    results = []
    try:
        results.append(launch(cfg))
        if args.compare:
            results.append(launch(DemoConfig(**{**cfg.__dict__, "mode": "torch"})))
    except (OSError, RuntimeError) as exc:  # a rank failed (launch names it), or processes could not start
        print(f"trainloom demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("trainloom demo: interrupted", file=sys.stderr)
        return 130
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    print(report(results), flush=True)
    print(f"\n{_loss_trend(results[0].epochs)}")
    return 0


def _loss_trend(epochs: Sequence[EpochStats]) -> str:
    """The last line of the report: how the loss moved from the first epoch to the last."""
    first, last = epochs[0].loss, epochs[-1].loss
    if len(epochs) == 1:
        return f"loss after 1 epoch: {first:.3f} (no trend from one epoch; run --epochs 2 or more)"
    if f"{first:.3f}" == f"{last:.3f}":
        return f"loss did not change over {len(epochs)} epochs: {first:.3f}"
    return f"loss went {'down' if last < first else 'UP'}: {first:.3f} -> {last:.3f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    # __doc__ is None under python -OO
    p = argparse.ArgumentParser(prog="trainloom demo", description=(__doc__ or "").split("\n", 1)[0] or None)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
