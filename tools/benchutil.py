"""Shared plumbing for tools/bench_*.py: one benchmark at a time, medians, tables, plots.

Every benchmark script:
  * takes ``--quick`` (a short run for smoke tests) and ``--out DIR`` (write ``NAME.md`` and PNG
    plots there; ``trainloom bench all`` collects them into one report);
  * holds :func:`bench_lock` while it measures, so two benchmarks never share the two cores;
  * compares against the peer (gloo, raw py-lmdb, torch's optimizer) in the same run and reports
    medians and ratios, never a single timing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

LOCK_PATH = os.environ.get("TRAINLOOM_BENCH_LOCK", "/tmp/trainloom-bench.lock")


@contextlib.contextmanager
def bench_lock() -> Iterator[None]:
    """Hold an exclusive lock on LOCK_PATH while measuring (waits for other benchmarks)."""
    with open(LOCK_PATH, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def measure(fn: Callable[[], object], repeat: int = 5, number: int = 1, warmup: int = 1) -> List[float]:
    """Seconds per call of ``fn`` for ``repeat`` rounds of ``number`` calls (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        out.append((time.perf_counter() - t0) / number)
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def machine_line() -> str:
    """One line describing where a figure was measured, for the report."""
    import torch

    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; floats are printed with 3 significant digits."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e5 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" or n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}G"


def parse_size(text: str) -> int:
    """'4K' -> 4096, '128M' -> 134217728, '1G', or a plain number of bytes."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def write_report(out: Optional[str], name: str, markdown: str) -> Optional[Path]:
    """Write ``markdown`` to OUT/NAME.md (when --out was given) and return the path."""
    if not out:
        return None
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.md"
    path.write_text(markdown + "\n")
    return path


def plot_lines(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict,
    logx: bool = True,
    logy: bool = False,
    hlines: Optional[dict] = None,
) -> Path:
    """Save a line plot of {label: (xs, ys)} to ``path`` (matplotlib, headless).

    With ``logy`` the y axis is logarithmic (series that differ by orders of magnitude) and the
    legend goes below the plot, clear of the lines. ``hlines`` ({label: y}) draws dashed
    horizontal lines, e.g. targets.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    for label, y in (hlines or {}).items():
        ax.axhline(y, linestyle="--", color="grey", linewidth=1)
        ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), va="bottom", fontsize="small")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, which="both" if logy else "major")
    if logy:
        fig.set_size_inches(7, 5.6)
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    else:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight" if logy else None)
    plt.close(fig)
    return path
