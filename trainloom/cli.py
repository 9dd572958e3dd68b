"""The ``trainloom`` command.

Subcommands live in their own modules, each exposing ``add_arguments(parser)`` and
``run(args) -> int``; :data:`SUBCOMMANDS` maps a name to that module. A subcommand whose module is
not importable (an optional part not installed) is listed with the reason instead of crashing the
whole command.

``trainloom bench NAME [ARGS...]`` runs ``tools/bench_NAME.py`` from the source checkout with the
remaining arguments (benchmarks are not part of the installed API).
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

#: name -> (module implementing add_arguments/run, one-line help)
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "demo": ("trainloom.demo", "train a small model end to end with every part of trainloom"),
    "cache": ("trainloom.data.cache_cli", "inspect or clear trainloom caches (info, clear)"),
}


def tools_dir() -> Optional[Path]:
    """The checkout's ``tools/`` directory, or None for an install without sources."""
    env = os.environ.get("TRAINLOOM_TOOLS_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parent.parent / "tools")
    # A trainloom checkout in the current directory (not any project's tools/: `trainloom bench x`
    # must not run some other ./tools/bench_x.py).
    if (Path.cwd() / "pyx").is_dir() and (Path.cwd() / "tools" / "benchutil.py").is_file():
        candidates.append(Path.cwd() / "tools")
    for c in candidates:
        if c.is_dir() and any(c.glob("bench_*.py")):
            return c
    return None


def benchmarks() -> List[str]:
    """Names accepted by ``trainloom bench``."""
    d = tools_dir()
    return sorted(p.stem[len("bench_") :] for p in d.glob("bench_*.py")) if d else []


def _run_bench(name: str, argv: Sequence[str]) -> int:
    """Run ``tools/bench_NAME.py`` in this process with ``argv``; return its exit code.

    ``SystemExit`` is handled as the interpreter would: None is 0, an int is the code, and any other
    value (``sys.exit("message")``) is printed to stderr and gives 1.
    """
    d = tools_dir()
    if d is None:
        print(
            "trainloom bench: no tools/ directory found. Benchmarks ship with the source checkout: "
            "run from a clone (pip install -e .), or set TRAINLOOM_TOOLS_DIR.",
            file=sys.stderr,
        )
        return 2
    script = d / f"bench_{name}.py"
    if not script.is_file():
        known = ", ".join(benchmarks()) or "none"
        print(f"trainloom bench: unknown benchmark {name!r} (known: {known})", file=sys.stderr)
        return 2
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(d))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv = old_argv
        sys.path[:] = old_path
    return 0


def _build_parser() -> Tuple[argparse.ArgumentParser, Dict[str, str]]:
    from trainloom import __version__

    parser = argparse.ArgumentParser(
        prog="trainloom",
        description="trainloom: cached data, load-balanced samplers, fast collectives and fused "
        "optimizer steps for PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"trainloom {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("info", help="show how trainloom was built and which optional parts work here")
    bench = sub.add_parser(
        "bench",
        help="run a benchmark from tools/ (trainloom bench NAME --help)",
        description="Run tools/bench_NAME.py with the remaining arguments.",
    )
    bench.add_argument("name", nargs="?", help="benchmark name: " + (", ".join(benchmarks()) or "none found"))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    unavailable: Dict[str, str] = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            # Only trainloom's own parts missing (an optional module, or a compiled module that is
            # missing or stale: import_compiled's message says how to rebuild) make a subcommand
            # unavailable; anything else is a bug and raises.
            missing = exc.name or ""
            if not missing or not (module.startswith(missing) or missing.startswith("trainloom.")):
                raise
            if isinstance(exc, ModuleNotFoundError):
                unavailable[name] = f"{help_text} [unavailable: {module} is not in this build]"
            else:
                unavailable[name] = f"{help_text} [unavailable: {str(exc).splitlines()[0]}]"
            continue
        # (raw: the module docstring's paragraphs and bullet lists stay as written)
        p = sub.add_parser(
            name,
            help=help_text,
            description=(mod.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    if unavailable:
        parser.epilog = "unavailable here: " + "; ".join(f"{n}: {why}" for n, why in unavailable.items())
    return parser, unavailable


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``trainloom`` console script."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader of stdout went away (`trainloom info | head -1`): no traceback. Python's own
        # recipe: the rest of the output to /dev/null (its flush at exit would raise again), exit 1.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: Optional[Sequence[str]]) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser, unavailable = _build_parser()
    if args_list and args_list[0] in unavailable:
        print(f"trainloom {args_list[0]}: {unavailable[args_list[0]]}", file=sys.stderr)
        return 2
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "info":
        from trainloom import show_config

        show_config()
        return 0
    if args.command == "bench":
        if not args.name:
            print("benchmarks: " + (", ".join(benchmarks()) or "none found"))
            return 0
        return _run_bench(args.name, args.bench_args)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
