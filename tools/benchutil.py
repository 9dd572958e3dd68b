"""Shared plumbing for tools/bench_*.py: one benchmark at a time, medians, tables, plots.

Every benchmark script:
  * takes ``--quick`` (a short run for smoke tests) and ``--out DIR`` (write ``NAME.md`` and PNG
    plots there; ``trainloom bench all`` collects them into one report);
  * holds :func:`bench_lock` while it measures, so two benchmarks never share the two cores;
  * compares against the peer (gloo, raw py-lmdb, torch's optimizer) in the same run and reports
    medians and ratios, never a single timing.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, TypeVar

T = TypeVar("T")

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
    """The median of ``xs``."""
    return statistics.median(xs)


def machine_line() -> str:
    """One line describing where a figure was measured, for the report."""
    import torch

    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def doc_summary(doc: Optional[str], paragraph: bool = False) -> Optional[str]:
    """A module docstring's first line (or first paragraph) for an argparse ``description=``.

    None when there is no docstring: ``python -OO`` strips them, and ``--help`` must still work.
    """
    if not doc:
        return None
    text = doc.strip().split("\n\n", 1)[0] if paragraph else doc.strip().splitlines()[0]
    return text or None


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
    """Bytes as a short string: 4096 -> '4K', 1536 -> '1.5K'."""
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" or n == int(n) else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}G"


_SIZE_HINT = "a number of bytes with an optional K, M or G suffix (e.g. 4096, 4K, 128M)"


def parse_size(text: str) -> int:
    """'4K' -> 4096, '128M' -> 134217728, '1G', '1.5K', or a plain number of bytes.

    Raises ValueError (quoting ``text`` as given) for anything else, including sizes that are not
    a whole number of bytes. Zero and negative sizes parse; use :func:`size_arg` to bound them.
    """
    body = text.strip().upper()
    body = body[:-1] if body.endswith("B") else body
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(body[-1:], 1)
    number = body[:-1] if mult > 1 else body
    try:
        value = float(number) * mult
    except ValueError:
        raise ValueError(f"invalid size {text!r}: expected {_SIZE_HINT}") from None
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


# ------------------------------------------------------------------------------------------------
# argparse ``type=`` functions: a bad argument fails at parse time (``error: argument --x: ...``,
# exit code 2), before any worker starts or anything is measured.
# ------------------------------------------------------------------------------------------------
def size_arg(minimum: int = 1, multiple: int = 1) -> Callable[[str], int]:
    """An argparse type: a size (see :func:`parse_size`) >= ``minimum`` and a multiple of ``multiple``."""

    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value < minimum:
            bound = "> 0" if minimum == 1 else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound} bytes, got {text!r}")
        if value % multiple:
            raise argparse.ArgumentTypeError(f"must be a multiple of {multiple} bytes, got {text!r}")
        return value

    parse.__name__ = "size"
    return parse


def int_arg(minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text!r}")
        return value

    parse.__name__ = "int"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


positive_int = int_arg(1)
positive_size = size_arg(1)


def list_arg(item: Callable[[str], T]) -> Callable[[str], List[T]]:
    """An argparse type: a comma-separated list, each entry parsed by ``item`` (another type function)."""

    def parse(text: str) -> List[T]:
        parts = [x.strip() for x in text.split(",")]
        if not any(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        if not all(parts):
            raise argparse.ArgumentTypeError(f"empty entry in the list {text!r}")
        out = []
        for x in parts:
            try:
                out.append(item(x))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"{exc} (in {text!r})" if x != text else str(exc)) from None
        return out

    parse.__name__ = "list"
    return parse


def choice_list(choices: Sequence[str], every: Optional[str] = None) -> Callable[[str], List[str]]:
    """An argparse type: a comma-separated list of ``choices``; ``every`` (e.g. "all") means all of them."""

    def item(x: str) -> str:
        if x not in choices:
            known = ", ".join(choices) + (f" or {every}" if every else "")
            raise argparse.ArgumentTypeError(f"unknown {x!r} (choose from {known})")
        return x

    as_list = list_arg(item)

    def parse(text: str) -> List[str]:
        if every is not None and text.strip() == every:
            return list(choices)
        return as_list(text)

    parse.__name__ = "list"
    return parse


def out_dir(text: str) -> str:
    """An argparse type for ``--out``: create the directory now and check that a file can be written there.

    So an unusable --out is reported before anything is measured, not after.
    """
    d = Path(text)
    if d.exists() and not d.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot create directory {text!r}: {exc.strerror or exc}") from None
    try:
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot write to directory {text!r}: {exc.strerror or exc}"
        ) from None
    return text


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
