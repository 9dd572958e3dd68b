"""Benchmark: fuse_step against torch's own optimizer step (for-loop, foreach=True, fused=True).

Models (parameter shapes only; gradients are random):
  * ``gpt2``: GPT-2 small, 148 tensors, 124M parameters;
  * ``many``: 2000 tensors of 1k-50k elements (log-uniform, seed 0), 20M parameters;
  * ``mlp``: a 4-tensor MLP (Linear(32, 64), Linear(64, 10)), 2.8k parameters.

For SGD (momentum 0.9), Adam and AdamW, on 1 and 2 threads: milliseconds per step of torch's default
(a per-tensor for-loop on CPU), foreach=True and fused=True, and of ``fuse_step`` on the same
optimizer configured like torch's default and like fused=True (fuse_step is bitwise equal to the
configuration it runs). GB/s counts the bytes a single pass must move: 28 per fp32 parameter for
Adam (read p, g, m, v; write p, m, v), 20 for SGD with momentum.

Run: ``trainloom bench optim [--quick] [--out DIR] [--models gpt2 many mlp] [--threads 1 2]``.
"""

from __future__ import annotations

import argparse
import gc
import math
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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
    positive_int,
    write_report,
)

from trainloom.optim import fuse_optimizer

BYTES = {"SGD": 20, "Adam": 28, "AdamW": 28}


def gpt2_shapes(scale: int = 1) -> List[Tuple[int, ...]]:
    d, v, ctx, layers = 768 // scale, 50257 // scale, 1024 // scale, 12
    shapes: List[Tuple[int, ...]] = [(v, d), (ctx, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (d, 3 * d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (d, 4 * d),
            (4 * d,),
            (4 * d, d),
            (d,),
        ]
    return shapes + [(d,), (d,)]


def many_shapes(
    n: int = 2000, lo: int = 1000, hi: int = 50_000, total: int = 20_000_000
) -> List[Tuple[int, ...]]:
    """n sizes in [lo, hi], log-uniform (seed 0), scaled so that they add up to about ``total``."""
    g = torch.Generator().manual_seed(0)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    raw = [math.exp(math.log(lo) + float(x) * (math.log(hi) - math.log(lo))) for x in u]
    scale = total / sum(raw)
    return [(min(hi, max(lo, int(r * scale))),) for r in raw]


def mlp_shapes() -> List[Tuple[int, ...]]:
    return [(64, 32), (64,), (10, 64), (10,)]


def make_params(shapes: List[Tuple[int, ...]]) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(1)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g)
        params.append(p)
    return params


def make_opt(name: str, params: List[torch.nn.Parameter], variant: str) -> torch.optim.Optimizer:
    kw: Dict[str, object] = {}
    if variant == "foreach":
        kw["foreach"] = True
    elif variant == "fused":
        kw["fused"] = True
    if name == "SGD":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kw)
    if name == "Adam":
        return torch.optim.Adam(params, lr=1e-3, **kw)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw)


VARIANTS = [
    ("torch default", "default", False),
    ("torch foreach", "foreach", False),
    ("torch fused", "fused", False),
    ("fuse_step (default cfg)", "default", True),
    ("fuse_step (fused cfg)", "fused", True),
]


def time_variant(
    params: List[torch.nn.Parameter], opt_name: str, variant: str, fused_step: bool, repeat: int, number: int
) -> float:
    """Median seconds per step. The parameters are shared by all variants of a model (only their
    values change), so that a 124M-parameter model is generated once."""
    opt = make_opt(opt_name, params, variant)
    step: Callable[[], object] = opt.step
    if fused_step:
        opt = fuse_optimizer(opt)
        step = opt.fuse_step  # type: ignore[attr-defined]
    step()  # state initialisation happens on the first step; not measured
    t = median(measure(step, repeat=repeat, number=number, warmup=0 if number == 1 else 1))
    del opt, step
    if sum(p.numel() for p in params) > 1_000_000:
        gc.collect()  # free the previous variant's state before the next one allocates its own
    return t


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``trainloom bench optim`` (each value checked as it is parsed)."""
    ap = argparse.ArgumentParser(prog="trainloom bench optim", description=doc_summary(__doc__))
    ap.add_argument("--quick", action="store_true", help="tiny models, one round (a smoke test)")
    ap.add_argument("--out", type=out_dir, help="directory for optim.md and the plots")
    ap.add_argument("--models", nargs="+", default=["gpt2", "many", "mlp"], choices=["gpt2", "many", "mlp"])
    ap.add_argument(
        "--threads", nargs="+", type=positive_int, default=[1, 2], help="torch thread counts (>= 1)"
    )
    ap.add_argument("--optims", nargs="+", default=["SGD", "Adam", "AdamW"], choices=["SGD", "Adam", "AdamW"])
    return ap


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run the benchmark and print (and with --out, write) its report."""
    args = build_parser().parse_args(argv)
    models = {
        "gpt2": gpt2_shapes(16 if args.quick else 1),
        "many": many_shapes(60, 100, 2000, 30_000) if args.quick else many_shapes(),
        "mlp": mlp_shapes(),
    }
    rows = []
    series: Dict[str, Dict[str, Tuple[List[int], List[float]]]] = {}
    before = torch.get_num_threads()
    with bench_lock():
        try:
            for model in args.models:
                shapes = models[model]
                nparam = sum(math.prod(s) for s in shapes)
                small = nparam < 1_000_000
                params = make_params(shapes)
                repeat = 1 if args.quick else (7 if small else (3 if nparam > 50_000_000 else 7))
                number = (200 if small else 1) if not args.quick else 2
                for nt in args.threads:
                    torch.set_num_threads(nt)
                    for opt_name in args.optims:
                        times = {
                            label: time_variant(params, opt_name, variant, fs, repeat, number)
                            for label, variant, fs in VARIANTS
                        }
                        best_fs = min(times["fuse_step (default cfg)"], times["fuse_step (fused cfg)"])
                        gbs = BYTES[opt_name] * nparam / times["fuse_step (fused cfg)"] / 1e9
                        unit = 1e6 if small else 1e3
                        rows.append(
                            [
                                model,
                                opt_name,
                                nt,
                                *(times[label] * unit for label, _, _ in VARIANTS),
                                gbs,
                                times["torch fused"] / times["fuse_step (fused cfg)"],
                                times["torch default"] / times["fuse_step (default cfg)"],
                                times["torch default"] / best_fs,
                            ]
                        )
                        print(
                            model, opt_name, nt, {k: f"{v * unit:.3g}" for k, v in times.items()}, flush=True
                        )
                        if opt_name == "Adam":
                            per = series.setdefault(model, {})
                            for label, _, _ in VARIANTS:
                                xs, ys = per.setdefault(label, ([], []))
                                xs.append(nt)
                                ys.append(times[label] * unit)
                del params
                gc.collect()
        finally:
            torch.set_num_threads(before)
    headers = [
        "model",
        "optimizer",
        "threads",
        *(f"{label} (ms or us)" for label, _, _ in VARIANTS),
        "fuse_step (fused cfg) GB/s",
        "x vs torch fused",
        "x vs torch default (same cfg)",
        "x best fuse_step vs torch default",
    ]
    sizes = ", ".join(
        f"{m}: {len(models[m])} tensors, {sum(math.prod(s) for s in models[m]) / 1e6:.3g}M params"
        for m in args.models
    )
    quick_note = "QUICK run (tiny models; figures meaningless). " if args.quick else ""
    md = "\n".join(
        [
            "## fuse_step vs torch optimizers",
            "",
            f"Machine: {machine_line()}. {quick_note}"
            "The machine was shared with other jobs: figures are depressed and noisy.",
            f"Models: {sizes}. Times are medians per step: milliseconds for gpt2/many, microseconds for mlp.",
            "Ratios > 1 mean fuse_step is faster. Each fuse_step is bitwise equal to torch with the same "
            "configuration.",
            "",
            markdown_table(headers, rows),
        ]
    )
    print(md)
    path = write_report(args.out, "optim", md)
    if path is not None:
        for model, per in series.items():
            plot_lines(
                Path(args.out) / f"optim_{model}_adam.png",
                f"Adam step, {model}",
                "threads",
                "time per step (ms; us for mlp)",
                per,
                logx=False,
            )


if __name__ == "__main__":
    main()
