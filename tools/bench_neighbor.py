"""Benchmark of neighbor_allreduce: trainloom's two data paths against a torch.distributed peer.

    trainloom bench neighbor --nproc 4 --sizes 4K,256K,4M --topologies ring,full [--quick] [--out DIR]

For each topology and size (bytes of the fp32 tensor) every rank averages its tensor with its
in-neighbours (uniform weights) with:

* ``exchange``: trainloom's neighbour exchange (one ``alltoall_v``, zero counts for non-neighbours);
* ``allgather``: trainloom's dense path (one ``allgather``, then the weighted sum);
* ``torch``: the peer, torch.distributed (gloo) ``batch_isend_irecv`` with every neighbour and the
  same weighted sum -- what a script without trainloom writes.

All three run in the SAME worker processes, size by size, on the default CPU engine (the
shared-memory engine on one node). Each figure is the median over rounds of the slowest rank's mean
time per call. Results are checked against each other once per size. Writes neighbor.md with --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchutil  # noqa: E402

METHODS = ("exchange", "allgather", "torch")
TOPOLOGIES = ("ring", "exp2", "full")


def _methods(x: Any, ins: List[int], outs: List[int]) -> Dict[str, Any]:
    """The three ways to average ``x`` with its in-neighbours (uniform weights)."""
    import torch
    import torch.distributed as dist

    from trainloom.comm import neighbor as nb

    w = 1.0 / (len(ins) + 1)
    bufs = [torch.empty_like(x) for _ in ins]

    def peer() -> Any:
        ops = [dist.P2POp(dist.isend, x, o) for o in outs] + [
            dist.P2POp(dist.irecv, b, i) for b, i in zip(bufs, ins)
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        y = x * w
        for b in bufs:
            y.add_(b, alpha=w)
        return y

    def ours(strategy: str) -> Any:
        def run() -> Any:
            os.environ["TRAINLOOM_NEIGHBOR_EXCHANGE"] = strategy
            return nb.neighbor_allreduce(x)

        return run

    return {"exchange": ours("exchange"), "allgather": ours("allgather"), "torch": peer}


def _worker(args: argparse.Namespace) -> None:
    import torch

    import trainloom.comm as C
    from trainloom.comm import topology as tp

    torch.set_num_threads(1)
    C.init_process_group(timeout=120)
    rank, ws = C.get_rank(), C.get_world_size()
    builders = {"ring": tp.RingGraph, "exp2": tp.ExponentialTwoGraph, "full": tp.FullyConnectedGraph}
    results: List[Dict[str, Any]] = []
    for topo_name in args.topologies:
        topo = builders[topo_name](ws)
        tp.set_topology(topo)
        ins, outs = topo.in_neighbors(rank), topo.out_neighbors(rank)
        for size in args.sizes:
            x = torch.full((size // 4,), float(rank + 1))
            fns = _methods(x, ins, outs)
            ref = fns["torch"]()
            for m in ("exchange", "allgather"):
                if not torch.allclose(fns[m](), ref):
                    raise RuntimeError(f"{m} differs from the torch peer: {size} bytes, topology {topo_name}")
            number = max(1, min(200, int(args.budget_bytes // max(size, 1))))
            row: Dict[str, Any] = {"topology": topo_name, "size": size, "degree": len(ins)}
            for m in METHODS:
                rounds = []
                for _ in range(args.rounds):
                    C.barrier()
                    t0 = time.perf_counter()
                    for _ in range(number):
                        fns[m]()
                    t = torch.tensor([(time.perf_counter() - t0) / number], dtype=torch.float64)
                    C.allreduce_inplace(t, C.ReduceOp.MAX)
                    rounds.append(t.item())
                row[m] = benchutil.median(rounds)
            results.append(row)
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    C.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``trainloom bench neighbor`` (each value checked as it is parsed)."""
    p = argparse.ArgumentParser(prog="trainloom bench neighbor", description=benchutil.doc_summary(__doc__))
    p.add_argument("--nproc", type=benchutil.int_arg(2), default=4, help="ranks (>= 2)")
    p.add_argument(
        "--sizes",
        type=benchutil.list_arg(benchutil.size_arg(4, multiple=4)),
        default=[4 << 10, 256 << 10, 4 << 20],
        help="comma list of fp32 tensor sizes in bytes (K/M/G suffixes; multiples of 4)",
    )
    p.add_argument(
        "--topologies",
        type=benchutil.choice_list(TOPOLOGIES),
        default=list(TOPOLOGIES),
        help=f"comma list of {', '.join(TOPOLOGIES)}",
    )
    p.add_argument("--rounds", type=benchutil.positive_int, default=5)
    p.add_argument(
        "--budget-bytes", type=benchutil.positive_float, default=64e6, help="bytes moved per round and method"
    )
    p.add_argument("--quick", action="store_true", help="tiny smoke test: 2 ranks, 1 round, no lock")
    p.add_argument("--out", default=None, type=benchutil.out_dir, help="directory for neighbor.md and a plot")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: List[str] | None = None) -> int:
    """Run the benchmark (or, with --worker, one rank of it)."""
    args = build_parser().parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.quick:
        args.nproc, args.sizes, args.topologies, args.rounds, args.budget_bytes = (
            2,
            [4 << 10, 64 << 10],
            ["ring", "full"],
            2,
            1e5,
        )
    port = _free_port()
    procs = []
    # --quick only shows that the benchmark runs: no lock, no figures worth keeping.
    lock = contextlib.nullcontext() if args.quick else benchutil.bench_lock()
    with lock:
        for r in range(args.nproc):
            env = dict(os.environ)
            env.update(
                RANK=str(r),
                WORLD_SIZE=str(args.nproc),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(args.nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                "--sizes",
                ",".join(map(str, args.sizes)),
                "--topologies",
                ",".join(args.topologies),
                "--rounds",
                str(args.rounds),
                "--budget-bytes",
                str(args.budget_bytes),
            ]
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        outs = [pr.communicate(timeout=900) for pr in procs]
    failed = [
        (i, pr.returncode, err[-2000:]) for i, (pr, (_, err)) in enumerate(zip(procs, outs)) if pr.returncode
    ]
    if failed:
        for i, rc, err in failed:
            print(f"rank {i} exited with {rc}:\n{err}", file=sys.stderr)
        return 1
    line = next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))
    rows = json.loads(line[len("RESULT ") :])
    table = [
        [
            r["topology"],
            r["degree"],
            benchutil.human_bytes(r["size"]),
            r["exchange"] * 1e6,
            r["allgather"] * 1e6,
            r["torch"] * 1e6,
            r["torch"] / r["exchange"],
            r["torch"] / min(r["exchange"], r["allgather"]),
        ]
        for r in rows
    ]
    md = "\n".join(
        [
            f"# neighbor_allreduce, {args.nproc} ranks, fp32, uniform weights",
            "",
            f"Machine: {benchutil.machine_line()}. Median over {args.rounds} rounds of the slowest rank's "
            "mean "
            "time per call (us); ratios > 1 mean trainloom is faster than the torch.distributed peer.",
            "",
            benchutil.markdown_table(
                [
                    "topology",
                    "in-degree",
                    "size",
                    "exchange us",
                    "allgather us",
                    "torch p2p us",
                    "torch/exchange",
                    "torch/best",
                ],
                table,
            ),
        ]
    )
    print(md)
    path = benchutil.write_report(args.out, "neighbor", md)
    if path is not None:
        series = {}
        for topo in args.topologies:
            sel = [r for r in rows if r["topology"] == topo]
            for m in METHODS:
                series[f"{topo} {m}"] = ([r["size"] for r in sel], [r[m] * 1e6 for r in sel])
        benchutil.plot_lines(
            path.parent / "neighbor.png", "neighbor_allreduce", "bytes", "us per call", series
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
