"""Run every benchmark in tools/ and write one report: ``trainloom bench all --out DIR``.

Each ``tools/bench_NAME.py`` is run in its own process with ``--out DIR`` (and ``--quick`` when
given); its Markdown lands in ``DIR/NAME.md`` and its plots next to it. This script then writes
``DIR/report.md``: the machine, the command line of each benchmark, its table and its plots, and a
line for any benchmark that failed (with the end of its output), so one broken benchmark does not
hide the others. Only tables and plots written by this run go into the report, never files an earlier
run left in DIR. Each benchmark runs in its own process group: when it exceeds ``--timeout`` (or this
script is interrupted) the whole group, the benchmark's worker processes included, gets SIGTERM and,
5 seconds later, SIGKILL.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchutil import doc_summary, machine_line, out_dir, positive_float  # noqa: E402


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


#: Seconds a timed-out benchmark's processes get to exit after SIGTERM before they are SIGKILLed.
STOP_GRACE_S = 5.0


def _group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running.

    Zombies do not count: no signal stops them, and where PID 1 does not reap orphans (some
    containers) a worker whose parent died stays one.
    """
    proc_dir = Path("/proc")
    if not (proc_dir / "self" / "stat").exists():  # not Linux: ask the kernel (zombies count there)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def _stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """Stop every process of ``proc``'s process group: SIGTERM, ``grace`` seconds, then SIGKILL.

    A benchmark starts workers of its own (bench_comm: one process per rank), which killing only
    ``proc`` would leave running, still holding CPUs and the benchmark's shared memory.
    """
    pgid = proc.pid  # start_new_session=True: the benchmark leads its own group
    proc.poll()  # reap the leader if it has exited
    if not _group_running(pgid):
        return  # nothing left: never signal a group id the system may have handed out again
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader
        if not _group_running(pgid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()


def _run(cmd: List[str], timeout: float) -> Tuple[bool, str]:
    """Run one benchmark in its own process group; (succeeded, the end of its output).

    On a timeout, or when this script is interrupted, the whole group is stopped, not only the
    benchmark's own process; so is anything it left running after exiting.
    """
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        try:  # what it printed before it was stopped (a process outside its group may hold the pipes)
            out, err = proc.communicate(timeout=5.0)
        except subprocess.TimeoutExpired:
            out, err = "", ""
        said = (out + err)[-1500:].strip()
        return False, f"timed out after {timeout:g}s; its processes were stopped" + (
            f". Its output until then:\n{said}" if said else ""
        )
    finally:
        # KeyboardInterrupt (its own session does not get the terminal's Ctrl-C) or workers left behind
        _stop_group(proc, grace=1.0)
    return proc.returncode == 0, (out + err)[-2000:]


def _pngs(out: Path, name: str) -> Dict[Path, int]:
    """The benchmark's plots in ``out`` (NAME.png, NAME_*.png) and their modification times."""
    found = {}
    for png in out.glob(f"{name}*.png"):
        if png.stem == name or png.stem.startswith(name + "_"):
            found[png] = png.stat().st_mtime_ns
    return found


def _mtime(path: Path) -> Optional[int]:
    return path.stat().st_mtime_ns if path.exists() else None


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``trainloom bench all`` (each value checked as it is parsed)."""
    ap = argparse.ArgumentParser(prog="trainloom bench all", description=doc_summary(__doc__))
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
        md = out / f"{name}.md"
        # Files of earlier runs in --out belong to no benchmark of this run: only files this run
        # wrote (new, or rewritten since) go into the report.
        md_before, pngs_before = _mtime(md), _pngs(out, name)
        t0 = time.monotonic()
        try:
            ok, tail = _run(cmd, args.timeout)
        except KeyboardInterrupt:  # _run stopped the benchmark's processes
            print(f"[bench all] interrupted during {name}; no report written", file=sys.stderr)
            return 130
        took = time.monotonic() - t0
        sections += [f"## {name}", "", f"`{shown}` ({took:.0f} s)", ""]
        written = md.exists() and _mtime(md) != md_before
        if ok and written:
            text = md.read_text().strip()
            sections.append(text)
            for png, mtime in sorted(_pngs(out, name).items()):
                if pngs_before.get(png) != mtime and f"]({png.name})" not in text:  # new, not shown yet
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
