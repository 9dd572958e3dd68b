"""The trainloom command: --version, info, bench discovery, and clear errors."""

from __future__ import annotations

import io
import subprocess
import sys
from contextlib import redirect_stdout

import trainloom
from trainloom import cli


def test_version_via_console_script_module():
    out = subprocess.run([sys.executable, "-m", "trainloom.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"trainloom {trainloom.__version__}"


def test_info_prints_build_and_optional_parts():
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["info"]) == 0
    text = buf.getvalue()
    for field in ("OpenMP", "debug directives", "Cython", "CPU count", "lmdb", "redis-server", "NCCL"):
        assert field in text, field


def test_show_config_matches_config_dict():
    c = trainloom.config()
    assert c["trainloom"] == trainloom.__version__
    assert c["cpu_count"] >= 1
    buf = io.StringIO()
    trainloom.show_config(file=buf)
    assert f"CPU count         : {c['cpu_count']}" in buf.getvalue()


def test_bench_unknown_name(capsys):
    assert cli.main(["bench", "no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no_such_bench'" in err or "no tools/ directory found" in err


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    assert "usage: trainloom" in capsys.readouterr().out
