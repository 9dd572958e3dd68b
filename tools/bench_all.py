"""Run every benchmark in tools/ and write one report: ``trainloom bench all --out DIR``.

Each ``tools/bench_NAME.py`` is run in its own process with ``--out DIR`` (and ``--quick`` when
given); its Markdown lands in ``DIR/NAME.md`` and its plots next to it. This script then writes
``DIR/report.md``: the machine, the command line of each benchmark, its table and its plots, and a
line for any benchmark that failed (with the end of its output), so one broken benchmark does not
hide the others.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchutil import machine_line, out_dir, positive_float  # noqa: E402


def known() -> list[str]:
    """The benchmarks next to this script (bench_NAME.py), without ``all`` itself."""
    return sorted(p.stem[len("bench_") :] for p in HERE.glob("bench_*.py") if p.stem != "bench_all")


def discover(only: list[str] | None = None) -> list[str]:
    """The benchmarks to run: all of them, or those in ``only``."""
    names = known()
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SystemExit(f"bench all: unknown benchmarks {unknown} (known: {', '.join(names)})")
        names = [n for n in names if n in only]
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``trainloom bench all`` (each value checked as it is parsed)."""
    ap = argparse.ArgumentParser(prog="trainloom bench all", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", required=True, type=out_dir, help="directory for report.md, per-benchmark tables and plots"
    )
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test, figures not meaningful)")
    ap.add_argument("--only", nargs="+", choices=known(), help="run only these benchmarks (e.g. comm optim)")
    ap.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds allowed per benchmark")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and write DIR/report.md; 1 if any of them failed."""
    args = build_parser().parse_args(argv)
    out = Path(args.out).resolve()
    sections = [
        "# trainloom benchmark report",
        "",
        f"Machine: {machine_line()}. Medians; ratios compare against the peer measured in the same run.",
        "",
    ]
    failures = 0
    for name in discover(args.only):
        cmd = [sys.executable, str(HERE / f"bench_{name}.py"), "--out", str(out)]
        if args.quick:
            cmd.append("--quick")
        shown = " ".join(["trainloom", "bench", name, *cmd[2:]])
        print(f"[bench all] {shown}", flush=True)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            ok, tail = proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            ok, tail = False, f"timed out after {args.timeout:.0f}s"
        took = time.monotonic() - t0
        sections += [f"## {name}", "", f"`{shown}` ({took:.0f} s)", ""]
        md = out / f"{name}.md"
        if ok and md.exists():
            sections.append(md.read_text().strip())
            for png in sorted(out.glob(f"{name}*.png")):
                sections += ["", f"![{png.stem}]({png.name})"]
        else:
            failures += 1
            why = "no report written" if ok else "failed"
            sections += [f"**{why}**:", "", "```", tail.strip(), "```"]
        sections.append("")
        print(f"[bench all] {name}: {'ok' if ok else 'FAILED'} in {took:.0f}s", flush=True)
    report = out / "report.md"
    report.write_text("\n".join(sections) + "\n")
    print(f"[bench all] report: {report}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
