"""``trainloom bench``: help under ``python -OO``, and ``bench all``'s process cleanup and report.

``bench all`` is run as users run it (``python -m trainloom bench all``), over a copy of its script and
``benchutil.py`` next to small stand-in benchmarks (``TRAINLOOM_TOOLS_DIR``), so that a test controls
what a benchmark does (hang with a worker, write plots) and takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _trainloom(*args: str, env: dict | None = None, opt: tuple = (), timeout: float = 120):
    env = {k: v for k, v in os.environ.items() if k != "TRAINLOOM_TOOLS_DIR"} | (env or {})
    cmd = [sys.executable, *opt, "-m", "trainloom", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


BENCHES = ["all", "cache", "comm", "neighbor", "optim", "sampler"]

# Each ``trainloom bench NAME --help`` in one ``python -OO`` process (one torch import, not six: the
# six processes took 17 s); the module entry point itself under -OO is test_cli's business.
_HELP_UNDER_OO = """
import contextlib, io, json, sys
from trainloom.cli import main
out = {}
for name in sys.argv[1:]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(["bench", name, "--help"])
        except SystemExit as exc:
            code = exc.code
    out[name] = [code, stdout.getvalue(), stderr.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def help_under_OO() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRAINLOOM_TOOLS_DIR"}
    cmd = [sys.executable, "-OO", "-c", _HELP_UNDER_OO, *BENCHES]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", BENCHES)
def test_bench_help_under_OO(name: str, help_under_OO: dict) -> None:
    """-OO strips docstrings; the benchmarks' --help used their first line."""
    code, stdout, stderr = help_under_OO[name]
    assert code == 0, stderr[-3000:]
    assert stdout.startswith(f"usage: trainloom bench {name} [-h]"), stdout[:500]
    assert stderr == ""


def _tools(tmp_path: Path, benches: dict) -> Path:
    """tmp_path/tools: bench_all.py and benchutil.py from tools/, plus bench_NAME.py from ``benches``."""
    d = tmp_path / "tools"
    d.mkdir()
    for f in ("bench_all.py", "benchutil.py"):
        shutil.copy(TOOLS / f, d / f)
    for name, body in benches.items():
        (d / f"bench_{name}.py").write_text(textwrap.dedent(body))
    return d


def _with_marker(marker: str) -> list:
    return [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or ())]


def test_bench_all_timeout_stops_the_benchmarks_workers(tmp_path: Path) -> None:
    """A timed-out benchmark's own workers are stopped too, not only the benchmark's process."""
    marker = f"tl-test-worker-{uuid.uuid4().hex}"
    started = tmp_path / "started"
    hang = f"""
        import subprocess, sys, time
        from pathlib import Path
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", {marker!r}])
        Path({str(started)!r}).write_text(str(worker.pid))
        time.sleep(120)
    """
    tools = _tools(tmp_path, {"hang": hang})
    out_dir = tmp_path / "out"
    try:
        t0 = time.monotonic()
        out = _trainloom(
            "bench", "all", "--only", "hang", "--timeout", "2", "--out", str(out_dir),
            env={"TRAINLOOM_TOOLS_DIR": str(tools)},
        )  # fmt: skip
        took = time.monotonic() - t0
        assert started.exists(), out.stdout + out.stderr  # the worker did start before the timeout
        assert _with_marker(marker) == []
        assert out.returncode == 1, out.stderr[-3000:]
        lines = out.stdout.splitlines()
        assert lines[0] == f"[bench all] trainloom bench hang --out {out_dir.resolve()}"
        assert re.fullmatch(r"\[bench all\] hang: FAILED in \d+s", lines[1]), lines
        assert lines[2:] == [f"[bench all] report: {out_dir.resolve() / 'report.md'}"]
        report = (out_dir / "report.md").read_text()
        assert "**failed**:\n\n```\ntimed out after 2s; its processes were stopped\n```\n" in report
        assert took < 60
    finally:
        for p in _with_marker(marker):
            p.kill()


def test_stop_group_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    """After the grace period, what is left of the group (here a worker ignoring SIGTERM) is SIGKILLed."""
    sys.path.insert(0, str(TOOLS))
    try:
        import bench_all
    finally:
        sys.path.remove(str(TOOLS))
    marker = f"tl-test-stubborn-{uuid.uuid4().hex}"
    ready = tmp_path / "ready"
    child = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "stubborn = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'\n"
        "w = subprocess.Popen([sys.executable, '-c', stubborn, sys.argv[1]])\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, marker], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        t0 = time.monotonic()
        bench_all._stop_group(proc, grace=0.5)
        assert 0.5 <= time.monotonic() - t0 < 10
        assert proc.returncode == -signal.SIGKILL
        assert _with_marker(marker) == []
        assert not bench_all._group_running(proc.pid)
    finally:
        for p in _with_marker(marker):
            p.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


PLOTS = """
    import sys
    from pathlib import Path
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    (out / "plots_new.png").write_bytes(b"png")
    (out / "plots_own.png").write_bytes(b"png")
    (out / "plots.md").write_text("| a |\\n|---|\\n| 1 |\\n\\n![own](plots_own.png)\\n")
"""
SILENT = """
    # exits 0 without writing silent.md
"""


def test_bench_all_report_embeds_only_this_runs_files(tmp_path: Path) -> None:
    """Plots and tables left in --out by earlier runs are not in the report; a plot the benchmark's
    own table already shows is not added twice."""
    tools = _tools(tmp_path, {"plots": PLOTS, "silent": SILENT})
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for stale in ("plots_old.png", "plots.png", "silent.png"):
        (out_dir / stale).write_bytes(b"old png")
    (out_dir / "silent.md").write_text("| stale table of an earlier run |\n")
    out = _trainloom(
        "bench", "all", "--only", "plots", "silent", "--out", str(out_dir),
        env={"TRAINLOOM_TOOLS_DIR": str(tools)},
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]  # silent wrote no report
    report = (out_dir / "report.md").read_text()
    plots = report.split("## plots\n")[1].split("## silent\n")[0]
    assert plots.split("\n")[3:] == [
        "| a |",
        "|---|",
        "| 1 |",
        "",
        "![own](plots_own.png)",
        "",
        "![plots_new](plots_new.png)",
        "",
        "",
    ]
    silent = report.split("## silent\n")[1]
    assert silent.split("\n")[3:6] == ["**no report written**:", "", "```"]
    for stale in ("plots_old.png", "(plots.png)", "silent.png", "stale table"):
        assert stale not in report
