"""The trainloom command: --version, info, bench discovery, and clear errors."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

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
    assert f"CPU kernels {torch.backends.cpu.get_cpu_capability()})" in text
    # one line per (optimizer, dtype), each naming torch's three paths
    lines = text.split("fused optimizer kernels (bit-exact with torch's own step here?):\n")[1].splitlines()
    assert [ln.split(":")[0].strip() for ln in lines] == [
        "SGD float32",
        "SGD float64",
        "Adam/AdamW float32",
        "Adam/AdamW float64",
    ]
    assert all(ln.count("; ") == 2 and "fused=True" in ln for ln in lines)


def test_info_says_which_fused_kernels_torch_rounds_otherwise():
    """Under torch's DEFAULT CPU capability (no FMA: older x86 CPUs) no compiled kernel reproduces
    torch's rounding, so fuse_step steps through torch; `trainloom info` says so per kernel."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run(
        [sys.executable, "-m", "trainloom", "info"], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CPU kernels DEFAULT)" in out.stdout
    no = "no, steps through torch"
    assert f"  SGD float32       : for-loop {no}; foreach {no}; fused=True {no}" in out.stdout
    assert f"  Adam/AdamW float64: for-loop {no}; foreach {no}; fused=True {no}" in out.stdout


def test_kernel_checks_match_torch_where_torch_runs_avx2_or_better():
    """On AVX2 and AVX512 machines every compiled kernel must reproduce torch's step: a check that
    failed there would silently take fuse_step's single pass away (its tests would only skip)."""
    from trainloom.optim import kernel_checks

    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        pytest.skip(f"torch runs its {cap} kernels here; the compiled kernels copy its AVX2 rounding")
    rows = kernel_checks()
    assert len(rows) == 12
    assert [r for r in rows if not r["matches_torch"]] == []
    assert {(r["dtype"], r["vector_split"]) for r in rows if r["path"] == "fused=True"} == {
        ("float32", 8),
        ("float64", 4),
    }


def test_show_config_matches_config_dict():
    c = trainloom.config()
    assert c["trainloom"] == trainloom.__version__
    assert c["cpu_count"] >= 1
    buf = io.StringIO()
    trainloom.show_config(file=buf)
    assert f"CPU count         : {c['cpu_count']}" in buf.getvalue()


def test_nccl_version_codes_read_as_versions():
    from trainloom._config import nccl_version_string

    assert [nccl_version_string(c) for c in (23203, 21899, 21003, 2708, 2408)] == [
        "2.32.3",
        "2.18.99",
        "2.10.3",
        "2.7.8",
        "2.4.8",
    ]
    nccl = trainloom.config()["nccl"]
    if nccl.get("available"):  # the test extra installs libnccl (it loads without a GPU)
        buf = io.StringIO()
        trainloom.show_config(file=buf)
        assert f"NCCL              : yes, {nccl_version_string(nccl['version'])} at " in buf.getvalue()


def test_python_dash_m_trainloom_and_the_demo_under_OO():
    out = subprocess.run([sys.executable, "-m", "trainloom", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == f"trainloom {trainloom.__version__}\n"
    # docstrings are stripped under -OO; the demo's help used its docstring's first line
    out = subprocess.run(
        [sys.executable, "-OO", "-m", "trainloom.demo", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: trainloom demo [-h]")


def test_bench_unknown_name(capsys):
    assert cli.main(["bench", "no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'no_such_bench'" in err or "no tools/ directory found" in err


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    assert "usage: trainloom" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# trainloom bench NAME: every bad argument fails at parse time with argparse's message and code 2,
# before a lock is taken, a worker starts or anything is measured.
# ------------------------------------------------------------------------------------------------
TOOLS = Path(__file__).resolve().parent.parent / "tools"
SIZE_HINT = "expected a number of bytes with an optional K, M or G suffix (e.g. 4096, 4K, 128M)"


@pytest.fixture
def no_measuring(monkeypatch):
    """Make any start of a measurement (bench lock, worker or child process) raise instead of running."""
    monkeypatch.delenv("TRAINLOOM_TOOLS_DIR", raising=False)
    monkeypatch.syspath_prepend(str(TOOLS))
    import benchutil

    def started(*args, **kwargs):
        raise RuntimeError("the benchmark accepted its arguments and started")

    monkeypatch.setattr(benchutil, "bench_lock", started)
    monkeypatch.setattr(subprocess, "Popen", started)
    monkeypatch.setattr(subprocess, "run", started)


def _bench_error(capsys, name: str, args: list) -> str:
    """Run ``trainloom bench NAME ARGS`` in this process; check code 2; return the error line. (That
    nothing was measured is checked by the ``no_measuring`` fixture, not by a clock.)"""
    rc = cli.main(["bench", name, *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"usage: trainloom bench {name} "), err
    return lines[-1]


# name, arguments, the exact message after "trainloom bench NAME: error: "
BAD_ARGS = [
    # sizes: zero / negative (this looped forever), unparsable, not whole bytes, --min > --max
    ("comm", ["--min", "0", "--max", "1K"], "argument --min: must be > 0 bytes, got '0'"),
    ("comm", ["--min=-4K", "--max", "1K"], "argument --min: must be > 0 bytes, got '-4K'"),
    ("comm", ["--max", "0"], "argument --max: must be > 0 bytes, got '0'"),
    ("comm", ["--min", "abc"], f"argument --min: invalid size 'abc': {SIZE_HINT}"),
    (
        "comm",
        ["--max", "1.3"],
        "argument --max: invalid size '1.3': not a whole number of bytes",
    ),
    ("comm", ["--max", "1K", "--min", "1M"], "--min (1M) is larger than --max (1K)"),
    ("comm", ["--slot-bytes", "1000"], "argument --slot-bytes: must be >= 4096 bytes, got '1000'"),
    ("comm", ["--slot-bytes", "6K"], "argument --slot-bytes: must be a multiple of 4096 bytes, got '6K'"),
    ("comm", ["--small-bytes", "-1"], "argument --small-bytes: must be >= 0 bytes, got '-1'"),
    ("comm", ["--cma-bytes", "0"], "argument --cma-bytes: must be > 0 bytes, got '0'"),
    # process counts
    ("comm", ["--nproc", "0"], "argument --nproc: must be >= 1, got '0'"),
    ("comm", ["--nproc", "-1"], "argument --nproc: must be >= 1, got '-1'"),
    ("comm", ["--nproc", "abc"], "argument --nproc: invalid integer 'abc'"),
    ("comm", ["--nproc", "2,,4"], "argument --nproc: empty entry in the list '2,,4'"),
    ("comm", ["--nproc", "2,x"], "argument --nproc: invalid integer 'x' (in '2,x')"),
    ("neighbor", ["--nproc", "0"], "argument --nproc: must be >= 2, got '0'"),
    ("neighbor", ["--nproc", "-2"], "argument --nproc: must be >= 2, got '-2'"),
    ("neighbor", ["--nproc", "1"], "argument --nproc: must be >= 2, got '1'"),
    ("neighbor", ["--nproc", "abc"], "argument --nproc: invalid integer 'abc'"),
    # other counts and numbers
    ("comm", ["--factor", "1"], "argument --factor: must be >= 2, got '1'"),
    ("comm", ["--factor", "-3"], "argument --factor: must be >= 2, got '-3'"),
    ("comm", ["--rounds", "0"], "argument --rounds: must be >= 1, got '0'"),
    ("comm", ["--target", "0"], "argument --target: must be a finite number > 0, got '0'"),
    ("comm", ["--target", "x"], "argument --target: invalid number 'x'"),
    ("neighbor", ["--rounds", "0"], "argument --rounds: must be >= 1, got '0'"),
    ("neighbor", ["--budget-bytes", "-1"], "argument --budget-bytes: must be a finite number > 0, got '-1'"),
    ("cache", ["--small", "0"], "argument --small: must be >= 1, got '0'"),
    ("cache", ["--images", "-1"], "argument --images: must be >= 1, got '-1'"),
    ("cache", ["--small", "abc"], "argument --small: invalid integer 'abc'"),
    ("optim", ["--threads", "0"], "argument --threads: must be >= 1, got '0'"),
    ("optim", ["--threads", "1", "abc"], "argument --threads: invalid integer 'abc'"),
    ("optim", ["--threads"], "argument --threads: expected at least one argument"),
    ("sampler", ["--budget", "0"], "argument --budget: must be a finite number > 0, got '0'"),
    ("sampler", ["--budget", "-1"], "argument --budget: must be a finite number > 0, got '-1'"),
    ("sampler", ["--budget", "inf"], "argument --budget: must be a finite number > 0, got 'inf'"),
    ("sampler", ["--max-len", "0"], "argument --max-len: must be >= 1, got '0'"),
    (
        "all",
        ["--out", "{tmp}/o", "--timeout", "0"],
        "argument --timeout: must be a finite number > 0, got '0'",
    ),
    # lists of names, checked in the parent (they failed only inside the workers)
    ("neighbor", ["--sizes", "abc"], f"argument --sizes: invalid size 'abc': {SIZE_HINT}"),
    ("neighbor", ["--sizes", "4K,,8K"], "argument --sizes: empty entry in the list '4K,,8K'"),
    ("neighbor", ["--sizes", "4K,0"], "argument --sizes: must be >= 4 bytes, got '0' (in '4K,0')"),
    ("neighbor", ["--sizes", "6"], "argument --sizes: must be a multiple of 4 bytes, got '6'"),
    (
        "neighbor",
        ["--topologies", "ring,bogus"],
        "argument --topologies: unknown 'bogus' (choose from ring, exp2, full) (in 'ring,bogus')",
    ),
    (
        "comm",
        ["--op", "foo"],
        "argument --op: unknown 'foo' (choose from allreduce, reduce_scatter, allgather, alltoall, broadcast "
        "or all)",
    ),
    ("comm", ["--backend", ""], "argument --backend: expected a comma-separated list, got ''"),
    ("comm", ["--op", "allgather", "--backend", "shm-zc"], "shm-zc (zero-copy) applies to allreduce only"),
    # --out that cannot be used: found before measuring (it was found only when the first file was written)
    (
        "comm",
        ["--out", "/proc/nope"],
        "argument --out: cannot create directory '/proc/nope': No such file or directory",
    ),
    ("comm", ["--out", "{file}"], "argument --out: '{file}' exists and is not a directory"),
    (
        "comm",
        ["--out", "{file}/sub"],
        "argument --out: cannot create directory '{file}/sub': Not a directory",
    ),
    ("neighbor", ["--out", "{file}"], "argument --out: '{file}' exists and is not a directory"),
    ("cache", ["--out", "{file}"], "argument --out: '{file}' exists and is not a directory"),
    ("optim", ["--out", "{file}"], "argument --out: '{file}' exists and is not a directory"),
    ("sampler", ["--out", "{file}"], "argument --out: '{file}' exists and is not a directory"),
    (
        "all",
        ["--out", "/proc/nope"],
        "argument --out: cannot create directory '/proc/nope': No such file or directory",
    ),
    ("all", ["--out", "{file}"], "argument --out: '{file}' exists and is not a directory"),
]

# argparse's own ``choices`` message quotes the choices differently across Python versions:
# only its start is checked
BAD_CHOICES = [
    ("comm", ["--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus' (choose from "),
    ("optim", ["--models", "gpt3"], "argument --models: invalid choice: 'gpt3' (choose from "),
    ("optim", ["--optims", "Lion"], "argument --optims: invalid choice: 'Lion' (choose from "),
    (
        "all",
        ["--out", "{tmp}/o", "--only", "nosuch"],
        "argument --only: invalid choice: 'nosuch' (choose from ",
    ),
]


def _fill(items: list, tmp_path: Path) -> list:
    afile = tmp_path / "afile"
    afile.write_text("")
    return [x.replace("{tmp}", str(tmp_path)).replace("{file}", str(afile)) for x in items]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,args,message", BAD_ARGS, ids=[f"{n}:{' '.join(a)}" for n, a, _ in BAD_ARGS])
def test_bench_bad_argument_fails_fast(no_measuring, capsys, tmp_path, name, args, message):
    line = _bench_error(capsys, name, _fill(args, tmp_path))
    assert line == f"trainloom bench {name}: error: {_fill([message], tmp_path)[0]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name,args,start", BAD_CHOICES, ids=[f"{n}:{' '.join(a)}" for n, a, _ in BAD_CHOICES]
)
def test_bench_bad_choice_fails_fast(no_measuring, capsys, tmp_path, name, args, start):
    line = _bench_error(capsys, name, _fill(args, tmp_path))
    assert line.startswith(f"trainloom bench {name}: error: {start}"), line


@pytest.mark.parametrize("name", ["all", "cache", "comm", "neighbor", "optim", "sampler"])
def test_bench_usage_names_trainloom_bench(no_measuring, capsys, name):
    assert cli.main(["bench", name, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: trainloom bench {name} [-h]")


def test_bench_good_arguments_parse(no_measuring, tmp_path):
    import bench_all
    import bench_cache
    import bench_comm
    import bench_neighbor
    import bench_optim
    import bench_sampler

    out = tmp_path / "new" / "dir"
    a = bench_comm.parse_args(
        ["--op", "all", "--nproc", "1,4", "--min", "1.5K", "--max", "1M", "--small-bytes", "0"]
        + ["--slot-bytes", "64K", "--dtype", "bfloat16", "--out", str(out)]
    )
    assert (a.op, a.nproc, a.min, a.max) == (list(bench_comm.OPS), [1, 4], 1536, 1 << 20)
    assert (a.small_bytes, a.slot_bytes, a.cma_bytes, a.dtype) == (0, 65536, None, "bfloat16")
    assert out.is_dir()  # --out is created (and checked) at parse time, before measuring
    a = bench_comm.parse_args(["--min", "4K", "--max", "4K", "--backend", "shm-zc,gloo"])
    assert (a.min, a.max, a.backend, a.op, a.factor) == (4096, 4096, ["shm-zc", "gloo"], ["allreduce"], 2)
    a = bench_neighbor.build_parser().parse_args(
        ["--sizes", "4K, 1M", "--topologies", "exp2", "--nproc", "2"]
    )
    assert (a.sizes, a.topologies, a.nproc) == ([4096, 1 << 20], ["exp2"], 2)
    assert bench_neighbor.build_parser().parse_args([]).sizes == [4096, 256 << 10, 4 << 20]
    a = bench_cache.build_parser().parse_args(["--small", "256", "--images", "32"])
    assert (a.small, a.images) == (256, 32)
    assert bench_optim.build_parser().parse_args(["--threads", "1", "2"]).threads == [1, 2]
    assert bench_sampler.build_parser().parse_args(["--budget", "4096"]).budget == 4096.0
    a = bench_all.build_parser().parse_args(["--out", str(tmp_path), "--only", "comm", "optim"])
    assert a.only == ["comm", "optim"]


def test_parse_size():
    sys.path.insert(0, str(TOOLS))
    try:
        import benchutil
    finally:
        sys.path.remove(str(TOOLS))
    assert [benchutil.parse_size(x) for x in ("4096", "4K", "4kb", "1.5K", "128M", "1G", " 2M ")] == [
        4096,
        4096,
        4096,
        1536,
        128 << 20,
        1 << 30,
        2 << 20,
    ]
    for bad in ("", "K", "abc", "1.3", "nan", "inf", "1e400"):
        with pytest.raises(ValueError, match="invalid size"):
            benchutil.parse_size(bad)


def _fake_tools(tmp_path: Path, monkeypatch, body: str) -> None:
    (tmp_path / "bench_x.py").write_text(body)
    monkeypatch.setenv("TRAINLOOM_TOOLS_DIR", str(tmp_path))


def test_bench_runs_tools_of_a_trainloom_checkout_only(tmp_path, monkeypatch, capsys):
    # Installed without sources, `trainloom bench x` ran ./tools/bench_x.py of whatever project the
    # current directory was.
    monkeypatch.delenv("TRAINLOOM_TOOLS_DIR", raising=False)
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site" / "trainloom" / "cli.py"))
    other = tmp_path / "other"
    (other / "tools").mkdir(parents=True)
    (other / "tools" / "bench_x.py").write_text("raise SystemExit('ran')\n")
    monkeypatch.chdir(other)
    assert cli.tools_dir() is None and cli.main(["bench", "x"]) == 2
    assert "trainloom bench: no tools/ directory found." in capsys.readouterr().err
    (other / "pyx").mkdir()  # a trainloom checkout
    (other / "tools" / "benchutil.py").write_text("")
    assert cli.tools_dir() == other / "tools" and cli.main(["bench", "x"]) == 1
    assert capsys.readouterr().err == "ran\n"


def test_bench_systemexit_message_is_printed(tmp_path, monkeypatch, capsys):
    _fake_tools(tmp_path, monkeypatch, "raise SystemExit(\"bench x: unknown benchmarks ['nosuch']\")\n")
    assert cli.main(["bench", "x"]) == 1
    assert capsys.readouterr().err == "bench x: unknown benchmarks ['nosuch']\n"


@pytest.mark.parametrize("code,rc", [("3", 3), ("0", 0), ("None", 0)])
def test_bench_systemexit_code_is_kept(tmp_path, monkeypatch, capsys, code, rc):
    _fake_tools(tmp_path, monkeypatch, f"import sys\nsys.exit({code})\n")
    assert cli.main(["bench", "x"]) == rc
    assert capsys.readouterr().err == ""


def test_bench_all_unknown_only_via_discover(no_measuring):
    import bench_all

    with pytest.raises(SystemExit, match=r"bench all: unknown benchmarks \['nosuch'\]"):
        bench_all.discover(["nosuch"])


def test_bench_leaves_sys_path_and_argv(no_measuring, capsys):
    before_path, before_argv = list(sys.path), list(sys.argv)
    assert cli.main(["bench", "comm", "--min", "0"]) == 2
    assert (sys.path, sys.argv) == (before_path, before_argv)


def test_output_into_a_closed_pipe_ends_without_a_traceback():
    # `trainloom info | head -1`: stdout's reader is gone; a BrokenPipeError traceback ended it
    r, w = os.pipe()
    os.close(r)  # every write to w now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "trainloom", "info"],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(w)
    assert proc.stderr == ""
    assert proc.returncode == 1


def test_an_unreadable_sys_path_entry_is_not_an_nccl_candidate(monkeypatch, tmp_path):
    # Path.is_file() raises for ENAMETOOLONG/EACCES (it swallows only ENOENT and the like): with a
    # sys.path directory whose name is near PATH_MAX, <dir>/nvidia/nccl/lib/libnccl.so.2 is too long,
    # and nccl.is_available(), documented never to raise, and `trainloom info` raised OSError.
    from trainloom import _locate

    deep = str(tmp_path)
    while len(deep) < 4080:
        deep = os.path.join(deep, "x" * min(200, 4080 - len(deep) - 1))
    os.makedirs(deep)
    monkeypatch.setattr(sys, "path", [deep, *sys.path])
    assert "libnccl.so.2" in _locate.nccl_candidates()
    proc = subprocess.run(
        [sys.executable, "-m", "trainloom", "info"],
        env={**os.environ, "PYTHONPATH": deep},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "NCCL" in proc.stdout


def test_a_relative_nccl_library_path_is_made_absolute(monkeypatch, tmp_path):
    # library_path() echoed "./libnccl.so.2", which named another file (or none) after a chdir
    from trainloom import _locate

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINLOOM_NCCL_LIBRARY", "./libnccl-custom.so.2")
    assert _locate.nccl_candidates()[0] == str(tmp_path / "libnccl-custom.so.2")
    monkeypatch.setenv("TRAINLOOM_NCCL_LIBRARY", "libnccl-custom.so.2")  # a bare name: the loader's search
    assert _locate.nccl_candidates()[0] == "libnccl-custom.so.2"
