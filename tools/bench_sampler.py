"""Benchmark: trainloom's load-balancing samplers against torch's DistributedSampler + fixed batches.

Data: the token counts of every triple-quoted string literal (docstrings, almost all of them) in
the installed Python standard library and site-packages, counted with a word/punctuation
tokenizer. Nobody here wrote them. They are computed on the first run and cached in a temp file.
Literals longer than --max-len tokens (embedded data blobs; training pipelines filter them too)
are left out, so that the budget can hold any single sample. N = 100k and 2M are drawn from them
(with replacement when N is larger than the corpus).

For W = 2, 8, 64 it reports, per rank: plan time (construct + one epoch, consumed the way a training
loop consumes it, each index or batch dropped once used, for every sampler alike), the per-step straggler
ratio (max over ranks of a step's cost / mean over ranks; mean and p99 over the epoch) with a
batch's cost taken as sum(len), sum(len^2) and the padded cost count * max(len), padding waste,
the largest batch relative to the budget, and duplicates / drops / empty rank-steps per epoch.

Run: ``trainloom bench sampler [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from benchutil import (
    bench_lock,
    doc_summary,
    machine_line,
    markdown_table,
    measure,
    median,
    out_dir,
    plot_lines,
    positive_float,
    positive_int,
    write_report,
)
from torch.utils.data import BatchSampler, DistributedSampler

from trainloom.data import _partition
from trainloom.data.samplers import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

CACHE = Path(tempfile.gettempdir()) / "trainloom-bench-sampler-docstring-tokens.npy"
_LITERAL = re.compile(r"(\"\"\"|''')(.*?)\1", re.S)
_TOKEN = re.compile(r"\w+|[^\w\s]")


def docstring_lengths(cache: Path, quick: bool = False) -> np.ndarray:
    """Token counts of every triple-quoted literal of the stdlib and site-packages (cached).

    With ``quick``, only the stdlib's top-level modules are read (a second or so, for smoke tests).
    """
    if cache.exists():
        return np.load(cache)
    paths = sysconfig.get_paths()
    stdlib = os.path.realpath(paths["stdlib"])
    roots = [stdlib] if quick else [stdlib, *{os.path.realpath(paths[k]) for k in ("purelib", "platlib")}]
    seen_files = set()
    lens: List[int] = []
    for root in roots:
        for d, dirs, files in os.walk(root):
            if quick:
                dirs[:] = []
            elif root == stdlib:
                dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages")]
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.realpath(os.path.join(d, f))
                if path in seen_files:
                    continue
                seen_files.add(path)
                try:
                    text = Path(path).read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                lens.extend(len(_TOKEN.findall(m.group(2))) for m in _LITERAL.finditer(text))
    arr = np.asarray(lens, dtype=np.int64)
    tmp = cache.with_name(cache.name + ".tmp.npy")
    np.save(tmp, arr)
    os.replace(tmp, cache)
    return arr


def epoch(sampler: Iterable[object]) -> None:
    """Consume one epoch as a training loop does: each index or batch is dropped once used.

    (Not ``list()``: that keeps the whole epoch's int objects alive, which no training loop does.)
    """
    collections.deque(sampler, maxlen=0)


def cpu_time(fn: Callable[[], object], repeat: int) -> float:
    """Smallest CPU time of one call (less disturbed than wall time on a shared machine)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def ratio(costs: np.ndarray) -> Tuple[float, float]:
    mean = costs.mean(axis=1)
    r = np.where(mean > 0, costs.max(axis=1) / np.where(mean > 0, mean, 1), 1.0)
    return float(r.mean()), float(np.percentile(r, 99))


def torch_baseline(lens: np.ndarray, world: int, batch: int, budget: float) -> Dict[str, float]:
    """DistributedSampler (shuffled) + fixed batch size: balance and padding of epoch 0.

    Ratios are over the full batches (the last, partial batch of each rank is left out).
    """
    n = lens.shape[0]
    per_rank = []
    for r in range(world):
        ds = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=0)
        per_rank.append(np.fromiter(iter(ds), dtype=np.int64, count=len(ds)))
    idx = np.stack(per_rank)  # (world, samples)
    batch = min(batch, idx.shape[1])  # tiny --quick sizes
    steps = idx.shape[1] // batch
    b = lens[idx[:, : steps * batch]].reshape(world, steps, batch).astype(np.float64)
    s_len = b.sum(axis=2).T
    s_len2 = (b * b).sum(axis=2).T
    padded = (b.max(axis=2) * batch).T
    dup = world * idx.shape[1] - n
    return {
        "len": ratio(s_len),
        "len2": ratio(s_len2),
        "padded": ratio(padded),
        "waste": float(1 - s_len.sum() / padded.sum()),
        "max_ratio": float(padded.max() / budget),
        "dup": dup,
        "drop": 0,  # DistributedSampler pads, BatchSampler(drop_last=False) keeps the partial batch
    }


_COLD = """
import collections, sys, time
import numpy as np, torch
from trainloom.data.samplers import LoadBalancingDistributedBatchSampler as Batches
from trainloom.data.samplers import LoadBalancingDistributedSampler
lens = torch.from_numpy(np.load(sys.argv[1]))
w, mode, budget = int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
t = time.perf_counter()
s = LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=w, rank=0)
collections.deque(s if mode == "plain" else Batches(s, max_complexity=budget, mode=mode), maxlen=0)
print((time.perf_counter() - t) * 1e3)
"""


_COLD_LABEL = {"plain": "LB sampler (per item)", "padded": "LB batch, padded", "packed": "LB batch, packed"}


def cold_ms(lens_path: Path, w: int, mode: str, budget: float) -> float:
    """Wall ms of the first plan (construct + one epoch) in a fresh interpreter: no kept scratch,
    no pooled blocks, every page fresh (the figure a one-off job sees; later epochs see the warm one)."""
    out = subprocess.run(
        [sys.executable, "-c", _COLD, str(lens_path), str(w), mode, str(budget)],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def coverage(bs: LoadBalancingDistributedBatchSampler, n: int) -> Tuple[int, int, int]:
    """(duplicates, drops, empty rank-steps) counted from the plan of all ranks."""
    plan = bs._plan()
    counts = np.bincount(plan.item_ids(), minlength=n)
    return (
        int(np.maximum(counts - 1, 0).sum()),
        int((counts == 0).sum()),
        int((np.diff(plan.bounds) == 0).sum()),
    )


def _grouped_straggler(costs: np.ndarray, world: int) -> Tuple[float, float]:
    """Padded-cost straggler (mean, p99) of batches grouped as the planner groups them.

    Batches are sorted by padded cost and taken ``world`` at a time; a last, incomplete step is
    left out (the planner would split batches to fill it, which can only make it less even).
    """
    c = np.sort(costs)[::-1]
    steps = c.shape[0] // world
    if steps == 0:
        return float("nan"), float("nan")
    return ratio(c[: steps * world].reshape(steps, world))


def padding_tradeoff(lens: np.ndarray, world: int, budget: float) -> List[List[object]]:
    """Rows of the padding-against-balance table at one N and W.

    Two families of plans, both over cuts of the sorted order (the only kind worth having: a
    batch padded to its longest pads least when it holds neighbours in length):

    - the padded planner at a lower budget (max_complexity = f * budget): every batch of a step
      aims at one cost, so steps stay balanced, and padding falls as batches shrink;
    - exact minimum-padding cuts (the planner's dynamic program) at decreasing prices per batch:
      least padding for a given number of batches, but batches of uneven cost, grouped into
      steps by cost as the planner does.
    """
    rows: List[List[object]] = []
    total = float(lens.sum())
    for frac in (1.0, 0.8, 0.6, 0.4, 0.3, 0.2):
        s = LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=world, rank=0)
        st = LoadBalancingDistributedBatchSampler(s, max_complexity=budget * frac, mode="padded").plan_stats()
        rows.append(
            [
                f"padded planner, max_complexity = {frac:g} x budget",
                st["steps"],
                f"{100 * st['padding_waste']:.3f} %",
                f"{st['straggler_mean']:.4f}",
            ]
        )
    cs = np.sort(lens)[::-1].astype(np.float64)
    runs = _partition.key_runs(cs)
    ends = np.empty(cs.shape[0], dtype=np.int64)
    for div in (500, 2000, 8000, 32000, 128000):
        nb = _partition.padded_min_padding_cut(*runs, budget, budget / div, ends)
        starts = np.concatenate(([0], ends[: nb - 1]))
        padded = (ends[:nb] - starts) * cs[starts]
        mean, _ = _grouped_straggler(padded, world)
        rows.append(
            [
                f"minimum-padding cut, price per batch = budget / {div}",
                f"{nb / world:.1f}",
                f"{100 * (1 - total / padded.sum()):.3f} %",
                f"{mean:.4f}",
            ]
        )
    return rows


def waste_by_length(lens: np.ndarray, world: int, budget: float) -> List[List[object]]:
    """Rows of where the padded planner's padding is: per band of batch length (its longest item),
    the share of the epoch's tokens, the padding in points of the epoch's waste, and the batches."""
    s = LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=world, rank=0)
    plan = LoadBalancingDistributedBatchSampler(s, max_complexity=budget, mode="padded")._plan()
    items, bounds = plan.item_ids(), plan.bounds
    counts = np.diff(bounds)
    keep = counts > 0
    starts = bounds[:-1][keep]
    item_lens = lens[items].astype(np.float64)
    longest = np.maximum.reduceat(item_lens, starts)
    tokens = np.add.reduceat(item_lens, starts)
    pad = counts[keep] * longest - tokens
    total_padded = float((counts[keep] * longest).sum())
    edges = [0, 100, 200, 400, 800, 1600, 3200, np.inf]
    rows: List[List[object]] = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (longest >= lo) & (longest < hi)
        rows.append(
            [
                f"{lo}-{hi - 1:.0f}" if np.isfinite(hi) else f">= {lo}",
                f"{100 * tokens[m].sum() / tokens.sum():.1f} %",
                f"{100 * pad[m].sum() / total_padded:.3f} %",
                int(m.sum()),
            ]
        )
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``trainloom bench sampler`` (each value checked as it is parsed)."""
    ap = argparse.ArgumentParser(prog="trainloom bench sampler", description=doc_summary(__doc__))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    ap.add_argument("--out", default=None, type=out_dir, help="write sampler.md and PNGs here")
    ap.add_argument(
        "--budget", type=positive_float, default=16384.0, help="max_complexity (tokens per rank per step)"
    )
    ap.add_argument("--max-len", type=positive_int, default=8192, help="leave out literals longer than this")
    ap.add_argument("--cache", type=Path, default=None, help=f"length cache file (default {CACHE})")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run the benchmark and print (and with --out, write) its report."""
    args = build_parser().parse_args(argv)

    t0 = time.perf_counter()
    cache = args.cache or (CACHE.with_name(CACHE.stem + "-quick.npy") if args.quick else CACHE)
    corpus = docstring_lengths(cache, args.quick)
    corpus = corpus[corpus <= args.max_len]
    load_s = time.perf_counter() - t0
    sizes = [2_000, 20_000] if args.quick else [100_000, 2_000_000]
    worlds = [2, 8] if args.quick else [2, 8, 64]
    repeat = 1 if args.quick else 3
    cold_runs = 1 if args.quick else 5  # fresh interpreters per cold figure (their median)
    budget = args.budget
    fixed_batch = max(1, int(budget // corpus.mean()))

    plan_rows, bal_rows, pad_rows, cold_rows = [], [], [], []
    trade_rows: List[List[object]] = []
    band_rows: List[List[object]] = []
    trade_at = (sizes[0], worlds[-1])
    times: Dict[str, Dict[int, List[float]]] = {}
    cold_times: Dict[str, Dict[int, float]] = {}  # first plan in a fresh interpreter, ms
    tmpdir = tempfile.TemporaryDirectory(prefix="trainloom-bench-sampler-")
    with bench_lock(), tmpdir:
        for n in sizes:
            rng = np.random.default_rng(0)
            lens = rng.choice(corpus, size=n, replace=n > corpus.shape[0]).astype(np.int64)
            lens_t = torch.from_numpy(lens)
            lens_path = Path(tmpdir.name) / f"lens-{n}.npy"
            np.save(lens_path, lens)
            for w in worlds:
                if not args.quick or (n == sizes[0] and w == worlds[0]):
                    # --quick: one fresh interpreter (seconds), to show that the path works.
                    modes = ["plain", "padded", "packed"] if not args.quick else ["packed"]
                    runs: Dict[str, List[float]] = {m: [] for m in modes}
                    for _ in range(cold_runs):  # the modes interleaved: a noisy spell hits them alike
                        for m in modes:
                            runs[m].append(cold_ms(lens_path, w, m, budget))
                    cold = {m: median(runs[m]) for m in modes}
                    for m in modes:
                        cold_times.setdefault(f"{_COLD_LABEL[m]}, N={n:,}", {})[w] = cold[m]
                    cold_rows.append(
                        [
                            f"{n:,}",
                            w,
                            *(f"{cold[m]:.3g}" if m in cold else "-" for m in ("plain", "padded", "packed")),
                        ]
                    )

                def plain(lens_t: torch.Tensor = lens_t, w: int = w) -> object:
                    s = LoadBalancingDistributedSampler(None, complexities=lens_t, num_replicas=w, rank=0)
                    return epoch(s)

                def budgeted(mode: str, lens_t: torch.Tensor = lens_t, w: int = w) -> object:
                    s = LoadBalancingDistributedSampler(None, complexities=lens_t, num_replicas=w, rank=0)
                    return epoch(LoadBalancingDistributedBatchSampler(s, max_complexity=budget, mode=mode))

                def peer(n: int = n, w: int = w) -> object:
                    ds = DistributedSampler(range(n), num_replicas=w, rank=0, shuffle=True, seed=0)
                    return epoch(BatchSampler(ds, fixed_batch, drop_last=False))

                row: List[object] = [f"{n:,}", w]
                cpus: List[float] = []
                for name, fn in [
                    ("torch DistributedSampler + BatchSampler", peer),
                    ("LB sampler (per item)", plain),
                    ("LB batch, padded", lambda: budgeted("padded")),
                    ("LB batch, packed", lambda: budgeted("packed")),
                ]:
                    t = median(measure(fn, repeat=repeat, warmup=1))
                    cpu = cpu_time(fn, repeat)
                    times.setdefault(f"{name}, N={n:,}", {}).setdefault(w, []).append(t)
                    row.append(f"{t * 1e3:.3g} ({cpu * 1e3:.3g})")
                    cpus.append(cpu)
                row.append(cpus[-4] / cpus[-1])
                plan_rows.append(row)

                if (n, w) == trade_at:
                    trade_rows = padding_tradeoff(lens, w, budget)
                    band_rows = waste_by_length(lens, w, budget)
                base = torch_baseline(lens, w, fixed_batch, budget)
                stats = {}
                for label, mode, cost in [
                    ("padded", "padded", (1.0, 0.0)),
                    ("packed len", "packed", (1.0, 0.0)),
                    ("packed len^2", "packed", (0.0, 1.0)),
                ]:
                    s = LoadBalancingDistributedSampler(None, complexities=lens, num_replicas=w, rank=0)
                    bs = LoadBalancingDistributedBatchSampler(
                        s, max_complexity=budget if cost[1] == 0 else budget**2 / 2, mode=mode, cost=cost
                    )
                    st = bs.plan_stats()
                    stats[label] = (st, coverage(bs, n))
                pk, pk2, pd = stats["packed len"][0], stats["packed len^2"][0], stats["padded"][0]
                bal_rows.append(
                    [
                        f"{n:,}",
                        w,
                        f"{base['len'][0]:.3f} / {base['len'][1]:.3f}",
                        f"{pk['straggler_len_mean']:.5f} / {pk['straggler_len_p99']:.5f}",
                        f"{base['len2'][0]:.3f} / {base['len2'][1]:.3f}",
                        f"{pk2['straggler_len2_mean']:.5f} / {pk2['straggler_len2_p99']:.5f}",
                        f"{base['padded'][0]:.3f} / {base['padded'][1]:.3f}",
                        f"{pd['straggler_mean']:.5f} / {pd['straggler_p99']:.5f}",
                    ]
                )
                cov = {k: v[1] for k, v in stats.items()}
                pad_rows.append(
                    [
                        f"{n:,}",
                        w,
                        f"{100 * base['waste']:.1f} %",
                        f"{100 * pd['padding_waste']:.3f} %",
                        f"{base['max_ratio']:.2f}x",
                        f"{pd['max_batch_cost_ratio']:.3f}x / {pk['max_batch_cost_ratio']:.3f}x",
                        f"{base['dup']} / {base['drop']} / 0",
                        " ; ".join(f"{k}: {d}/{r}/{e}" for k, (d, r, e) in cov.items()),
                        f"{pd['steps']} / {pk['steps']}",
                    ]
                )

    md = [
        "# Load-balancing samplers",
        "",
        f"Machine: {machine_line()}. Run under the project's machine lock (no other heavy work at the same "
        "time); wall times still vary by some 10 % between runs.",
        f"Data: {corpus.shape[0]:,} token counts of triple-quoted literals (docstrings) of the installed "
        f"stdlib and site-packages (<= {args.max_len} tokens; mean {corpus.mean():.1f}, "
        f"median {np.median(corpus):.0f}, "
        f"max {corpus.max()}), loaded in {load_s:.1f} s; N drawn with replacement. Budget "
        f"max_complexity={budget:.0f} tokens per rank per step (packed len^2: {budget**2 / 2:.3g}); the "
        f"fixed batch size of the peer is {fixed_batch} (budget / mean length).",
        "",
        "## Plan time per rank (construct + one epoch): wall ms, median (CPU ms, best) of "
        f"{repeat} warm runs. The epoch is consumed as a training loop consumes it (each index or batch "
        "dropped once used), for the torch peer too.",
        "",
        markdown_table(
            [
                "N",
                "W",
                "torch DS + BatchSampler",
                "LB sampler",
                "LB padded",
                "LB packed",
                "torch / packed (CPU)",
            ],
            plan_rows,
        ),
        "",
        "The runs above are warm: the compiled core keeps its scratch buffer and a pool of freed plan "
        "arrays between plans (as every epoch's replan does in training). The first plan in a fresh "
        "interpreter pays for fresh pages (about 2.4-3.4 us per 4 KiB page on this VM); wall ms, median of "
        f"{cold_runs} fresh interpreters:",
        "",
        markdown_table(["N", "W", "LB sampler", "LB padded", "LB packed"], cold_rows),
        "",
        "## Per-step straggler ratio, mean / p99 over the epoch",
        "",
        "Cost of a rank's batch: sum(len) (packed, cost=(1,0)), sum(len^2) (packed, cost=(0,1)), and the "
        "padded cost count * max(len) (padded mode). The peer's batches are the fixed-size ones.",
        "",
        markdown_table(
            [
                "N",
                "W",
                "torch sum(len)",
                "packed sum(len)",
                "torch sum(len^2)",
                "packed sum(len^2)",
                "torch padded",
                "padded padded",
            ],
            bal_rows,
        ),
        "",
        "## Padding waste, largest batch, coverage",
        "",
        markdown_table(
            [
                "N",
                "W",
                "torch waste",
                "padded waste",
                "torch max/budget",
                "max/budget padded / packed",
                "torch dup/drop/empty",
                "LB dup/drop/empty (from the plan of all ranks)",
                "steps padded / packed",
            ],
            pad_rows,
        ),
        "",
        f"## Padding against balance at N = {trade_at[0]:,}, W = {trade_at[1]}",
        "",
        "Where the sorted order has few samples per length, a batch that fills the budget spans several "
        "lengths and pads to its longest. Two ways to pad less, both measured here on the same data: "
        "smaller batches that keep every step's batches at one cost (the padded planner at a lower "
        "budget), or the exact minimum-padding cut (ends batches where lengths change; batches of "
        "uneven cost, grouped into steps by cost). Steps per epoch (fractional: batches / W), padding "
        "waste, and the padded-cost straggler mean (complete steps):",
        "",
        markdown_table(["plan", "steps", "padding waste", "straggler mean"], trade_rows),
        "",
        "Where the padded planner's padding is (same N and W, the default budget), by the length of a "
        "batch's longest item. Short items pad most: a batch of 3,000 five-token items that reaches "
        "into the four-token ones pads a token per item, 20 % of those items' length.",
        "",
        markdown_table(
            ["batch length (tokens)", "share of tokens", "padding (of all padded tokens)", "batches"],
            band_rows,
        ),
        "",
        "References (FINDINGS.md, same data kind, N = 2M): Bagua 6.4-10.9 s plan (+3.6 s reading samples), "
        "Lhotse 10.7-51.6 s, fairseq's Cython batch_by_size 0.17-0.46 s; straggler at W = 64: "
        "DistributedSampler 1.47 / 1.81, fairseq grouped 1.011 / 1.062 (drops samples).",
    ]
    text = "\n".join(md)
    print(text)
    path = write_report(args.out, "sampler", text)
    if path is not None:
        series = {}
        for name, by_w in times.items():
            xs = sorted(by_w)
            series[name] = (xs, [1e3 * by_w[x][0] for x in xs])
        plot_lines(
            path.parent / "sampler_plan_time.png",
            "Plan time per rank (construct + epoch, warm)",
            "world size",
            "ms (log scale)",
            series,
            logy=True,
            hlines={"target at 2M: 150 ms": 150.0, "target at 100k: 5 ms": 5.0},
        )
        if cold_times:
            plot_lines(
                path.parent / "sampler_first_plan_time.png",
                "First plan per rank in a fresh process (construct + epoch)",
                "world size",
                "ms (log scale)",
                {name: (sorted(by_w), [by_w[x] for x in sorted(by_w)]) for name, by_w in cold_times.items()},
                logy=True,
                hlines={"target at 2M: 150 ms": 150.0, "target at 100k: 5 ms": 5.0},
            )
        if trade_rows:
            plot_tradeoff(path.parent / "sampler_padding_tradeoff.png", trade_rows, trade_at)


def plot_tradeoff(path: Path, rows: List[List[object]], at: Tuple[int, int]) -> None:
    """Padding waste against steps per epoch for both families, straggler written at each point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    families = (
        ("padded planner", "balanced steps (planner, lower budget)"),
        ("minimum", "minimum-padding cut"),
    )
    for prefix, label in families:
        mine = [r for r in rows if str(r[0]).startswith(prefix)]
        pts = [(float(r[1]), float(str(r[2]).split()[0]), str(r[3])) for r in mine]
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        ax.plot(xs, ys, marker="o", label=label)
        for x, y, st in pts:
            ax.annotate(st, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(0.1, color="grey", linestyle="--", linewidth=1, label="0.1 % waste")
    ax.set_yscale("log")
    ax.set_xlabel("steps per epoch")
    ax.set_ylabel("padding waste (%)")
    ax.set_title(f"Padding against steps at N = {at[0]:,}, W = {at[1]} (labels: straggler mean)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
