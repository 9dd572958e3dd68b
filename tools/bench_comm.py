"""nccl-tests style benchmark of CPU collectives: trainloom's shared-memory engine against gloo.

    trainloom bench comm --op allreduce --nproc 2 --min 4K --max 128M --backend shm,gloo

For every size (bytes, nccl-tests convention: the whole buffer for allreduce/broadcast, the gathered
buffer for allgather, the send buffer for reduce_scatter/alltoall) and engine it prints the time per
call, the algorithm bandwidth (size / time) and the bus bandwidth (algbw x the nccl-tests factor:
2(n-1)/n for allreduce, (n-1)/n for reduce_scatter/allgather/alltoall, 1 for broadcast), plus the
ratio gloo time / shm time. Both engines run in the SAME worker processes, size by size, so machine
load affects them alike. Each figure is the median over rounds of (max over ranks of the mean time
per call in that round). Results are checked once per size (shm against gloo, and against the
expected sum). Writes comm.md and comm_<op>_<nproc>p.png with --out.
"""

from __future__ import annotations

import argparse
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

OPS = ("allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast")


def busbw_factor(op: str, n: int) -> float:
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "allgather", "alltoall"):
        return (n - 1) / n
    return 1.0


# ------------------------------------------------------------------------------------------------
# worker side (runs in a subprocess per rank)
# ------------------------------------------------------------------------------------------------
def _worker(cfg: Dict[str, Any]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(1)
    if cfg["pin"]:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    store = dist.TCPStore("127.0.0.1", cfg["port"], world, rank == 0, datetime.timedelta(seconds=300))
    comm = None
    if "gloo" in cfg["backends"]:
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=world)
    zc_buf = None
    comms: Dict[str, Any] = {}
    if "shm-cma" in cfg["backends"]:
        from trainloom.comm.shm import ShmCommunicator

        # the same engine with cross-memory attach on (opt-in: off by default)
        comms["shm-cma"] = ShmCommunicator(
            store,
            rank,
            world,
            prefix="bench/shm-cma",
            timeout=300.0,
            slot_bytes=cfg["slot_bytes"],
            cma=True,
            cma_bytes=cfg["cma_bytes"],
        )
        if cfg["small_bytes"] is not None:
            comms["shm-cma"].small_bytes = cfg["small_bytes"]
    if "shm" in cfg["backends"] or "shm-zc" in cfg["backends"]:
        from trainloom.comm.shm import ReduceOp, ShmCommunicator

        dt0 = getattr(torch, cfg["dtype"])
        heap = 0
        if "shm-zc" in cfg["backends"]:
            heap = (max(cfg["sizes"]) + 4095) // 4096 * 4096
        comm = ShmCommunicator(
            store,
            rank,
            world,
            prefix="bench/shm",
            timeout=300.0,
            slot_bytes=cfg["slot_bytes"],
            heap_bytes=heap,
            cma_bytes=cfg["cma_bytes"],
        )
        if heap:
            # zero-copy: tensors allocated inside the segment (like a flattened gradient bucket)
            zc_buf = comm.shared_empty(heap // torch.empty((), dtype=dt0).element_size(), dt0)
        if cfg["small_bytes"] is not None:
            comm.small_bytes = cfg["small_bytes"]
    dt = getattr(torch, cfg["dtype"])
    es = torch.empty((), dtype=dt).element_size()
    comm_main = comm

    from trainloom.comm.shm import ReduceOp

    def barrier(backend: str) -> None:
        if backend == "shm-cma":
            comms[backend].barrier()
        elif backend.startswith("shm"):
            comm.barrier()
        else:
            dist.barrier()

    def bcast_int(backend: str, v: int) -> int:
        t = torch.tensor([v], dtype=torch.int64)
        if backend.startswith("shm"):
            comms.get(backend, comm_main).broadcast(t, 0)
        else:
            dist.broadcast(t, 0)
        return int(t[0])

    def make(op: str, backend: str, size: int):
        comm = comms.get(backend, comm_main)
        count = max(world, size // es // world * world)
        blk = count // world
        base = (torch.arange(count) % 7).to(dt)
        if op == "allreduce":
            t = base + rank
            if backend == "shm-zc":
                t = zc_buf[:count]
                t.copy_(base + rank)
            if backend.startswith("shm"):
                return (lambda: comm.allreduce(t, t, ReduceOp.SUM)), t, count * es
            return (lambda: dist.all_reduce(t)), t, count * es
        if op == "broadcast":
            t = base + rank
            if backend in ("shm", "shm-cma"):
                return (lambda: comm.broadcast(t, 0)), t, count * es
            return (lambda: dist.broadcast(t, 0)), t, count * es
        if op == "allgather":
            s, r = base[:blk] + rank, torch.empty(count, dtype=dt)
            if backend in ("shm", "shm-cma"):
                return (lambda: comm.allgather(s, r)), r, count * es
            return (lambda: dist.all_gather_into_tensor(r, s)), r, count * es
        if op == "reduce_scatter":
            s, r = base + rank, torch.empty(blk, dtype=dt)
            if backend in ("shm", "shm-cma"):
                return (lambda: comm.reduce_scatter(s, r, ReduceOp.SUM)), r, count * es
            return (lambda: dist.reduce_scatter_tensor(r, s)), r, count * es
        if op == "alltoall":
            s, r = base + rank, torch.empty(count, dtype=dt)
            if backend in ("shm", "shm-cma"):
                return (lambda: comm.alltoall(s, r)), r, count * es
            return (lambda: dist.all_to_all_single(r, s)), r, count * es
        raise ValueError(op)

    out: List[Dict[str, Any]] = []
    for op in cfg["ops"]:
        for size in cfg["sizes"]:
            first_result = {}
            for backend in cfg["backends"]:
                fn, res, nbytes = make(op, backend, size)
                fn()  # result check on fresh inputs (one call)
                first_result[backend] = res.clone()
                fn()  # warm-up
                barrier(backend)
                t0 = time.perf_counter()
                fn()
                one = time.perf_counter() - t0
                iters = bcast_int(backend, max(1, min(cfg["max_iters"], int(cfg["target"] / max(one, 1e-7)))))
                times, cpus = [], []
                for _ in range(cfg["rounds"]):
                    barrier(backend)
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(iters):
                        fn()
                    times.append((time.perf_counter() - t0) / iters)
                    cpus.append((time.process_time() - c0) / iters)  # all threads of this process
                out.append(
                    {
                        "op": op,
                        "size": nbytes,
                        "backend": backend,
                        "times": times,
                        "cpus": cpus,
                        "iters": iters,
                    }
                )
            ok = True
            if op == "allreduce":
                expect = (torch.arange(nbytes // es) % 7).to(dt) * world + world * (world - 1) // 2
                ok = all(torch.equal(r, expect) for r in first_result.values())
            elif op == "broadcast":
                ok = all(
                    torch.equal(r, (torch.arange(nbytes // es) % 7).to(dt)) for r in first_result.values()
                )
            # every engine must give the same result bits as the first one
            vals = list(first_result.values())
            ok = ok and all(torch.equal(vals[0], v) for v in vals[1:])
            for k in range(len(cfg["backends"])):
                out[-1 - k]["ok"] = ok
    if comm is not None:
        comm.close()
    for c in comms.values():
        c.close()
    if "gloo" in cfg["backends"]:
        dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------------------------------------
# parent side
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_set(nproc: int, cfg: Dict[str, Any], timeout: float) -> List[List[Dict[str, Any]]]:
    """Start nproc worker processes, return each rank's result list."""
    port = _free_port()
    procs = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for rank in range(nproc):
        c = dict(cfg, rank=rank, world=nproc, port=port)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(c)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    results = []
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"bench worker rank {rank} failed (exit {p.returncode}):\n{err[-3000:]}")
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise RuntimeError(
                    f"bench worker rank {rank} printed no result:\n{out[-2000:]}\n{err[-2000:]}"
                )
            results.append(json.loads(line[-1][len("RESULT ") :]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def summarise(results: List[List[Dict[str, Any]]]) -> Dict[tuple, Dict[str, Any]]:
    """(op, size, backend) -> {time: median over rounds of max over ranks, ok, iters}."""
    table: Dict[tuple, Dict[str, Any]] = {}
    for i, entry in enumerate(results[0]):
        per_round = [max(r[i]["times"][k] for r in results) for k in range(len(entry["times"]))]
        ok = all(r[i].get("ok", True) for r in results)
        cpu = [benchutil.median(r[i]["cpus"]) for r in results]
        table[(entry["op"], entry["size"], entry["backend"])] = {
            "time": benchutil.median(per_round),
            "cpu": benchutil.median(cpu),
            "ok": ok,
            "iters": entry["iters"],
        }
    return table


#: dtypes the benchmark can fill and check (torch names)
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64")
BACKENDS = ("shm", "gloo", "shm-zc", "shm-cma")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``trainloom bench comm`` (each value checked as it is parsed)."""
    ap = argparse.ArgumentParser(
        description=benchutil.doc_summary(__doc__, paragraph=True), prog="trainloom bench comm"
    )
    ap.add_argument(
        "--op",
        default=["allreduce"],
        type=benchutil.choice_list(OPS, every="all"),
        help=f"comma list of {', '.join(OPS)} (or 'all')",
    )
    ap.add_argument(
        "--nproc",
        default=[2],
        type=benchutil.list_arg(benchutil.positive_int),
        help="processes, comma list (e.g. 2,4)",
    )
    ap.add_argument(
        "--min", default="4K", type=benchutil.positive_size, help="smallest size (bytes; K/M/G suffixes)"
    )
    ap.add_argument("--max", default="128M", type=benchutil.positive_size, help="largest size")
    ap.add_argument(
        "--factor", type=benchutil.int_arg(2), default=2, help="size multiplier between steps (>= 2)"
    )
    ap.add_argument(
        "--backend",
        default=["shm", "gloo"],
        type=benchutil.choice_list(BACKENDS),
        help="comma list of shm, gloo, shm-zc (shm with tensors from shared_empty: zero-copy allreduce), "
        "shm-cma (shm with cross-memory attach on, cma=True; off by default)",
    )
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument(
        "--rounds", type=benchutil.positive_int, default=5, help="timed rounds per size (median reported)"
    )
    ap.add_argument(
        "--target", type=benchutil.positive_float, default=0.05, help="seconds per round (sets iterations)"
    )
    ap.add_argument("--pin", action="store_true", help="pin rank r to CPU r %% ncpu")
    ap.add_argument(
        "--slot-bytes",
        default=None,
        type=benchutil.size_arg(4096, multiple=4096),
        help="shm slot size, a multiple of 4K (default: the engine's, 1M)",
    )
    ap.add_argument(
        "--small-bytes",
        default=None,
        type=benchutil.size_arg(0),
        help="shm one-shot allreduce limit (default 32K)",
    )
    ap.add_argument(
        "--cma-bytes",
        default=None,
        type=benchutil.size_arg(1),
        help="cross-memory attach threshold per peer message for shm-cma (default 256K)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few rounds (smoke test)")
    ap.add_argument("--out", default=None, type=benchutil.out_dir, help="directory for comm.md and PNG plots")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def parse_args(argv: List[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; a bad one exits with code 2 before anything starts."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.worker:
        return args
    if "shm-zc" in args.backend and args.op != ["allreduce"]:
        ap.error("shm-zc (zero-copy) applies to allreduce only")
    if args.min > args.max:
        lo, hi = benchutil.human_bytes(args.min), benchutil.human_bytes(args.max)
        ap.error(f"--min ({lo}) is larger than --max ({hi})")
    return args


def main(argv: List[str] | None = None) -> int:
    """Run the benchmark (or, with --worker, one rank of it)."""
    args = parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    ops, backends, nprocs = args.op, args.backend, args.nproc
    lo, hi = args.min, args.max
    rounds, target, max_iters = args.rounds, args.target, 2000
    if args.quick:
        lo, hi, rounds, target, max_iters = 4096, 64 << 10, 2, 0.005, 50
        args.factor = 4
    sizes = []
    s = lo
    while s <= hi:
        sizes.append(s)
        s *= args.factor
    cfg = {
        "ops": ops,
        "sizes": sizes,
        "backends": backends,
        "dtype": args.dtype,
        "rounds": rounds,
        "target": target,
        "max_iters": max_iters,
        "pin": args.pin,
        "slot_bytes": args.slot_bytes,
        "small_bytes": args.small_bytes,
        "cma_bytes": args.cma_bytes,
    }
    load = os.getloadavg()
    md = [
        "# CPU collectives: trainloom shm engine vs gloo",
        "",
        f"Machine: {benchutil.machine_line()}; load average before the run {load[0]:.2f}, {load[1]:.2f}.",
        f"Command: `trainloom bench comm {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"dtype {args.dtype}, SUM; {rounds} rounds of ~{target * 1e3:.0f} ms; median over rounds of the "
        "slowest rank's mean time per call; busbw as in nccl-tests; cpu = median over ranks of the "
        "process CPU time (all threads) per call: on a loaded machine time >> cpu means the ranks "
        "waited for a core. Shared machine: figures are noisy/depressed.",
    ]
    with benchutil.bench_lock():
        for nproc in nprocs:
            t0 = time.monotonic()
            results = run_set(nproc, cfg, timeout=900)
            table = summarise(results)
            for op in ops:
                rows, series = [], {}
                bf = busbw_factor(op, nproc)
                for size in sorted({k[1] for k in table if k[0] == op}):
                    row: List[Any] = [benchutil.human_bytes(size)]
                    times = {}
                    for b in backends:
                        e = table[(op, size, b)]
                        t = e["time"]
                        times[b] = t
                        alg = size / t / 1e9
                        row += [t * 1e6, alg, alg * bf, e["cpu"] * 1e6]
                        series.setdefault(b, ([], []))
                        series[b][0].append(size)
                        series[b][1].append(alg * bf)
                    if "gloo" in backends and "shm" in backends:
                        row.append(times["gloo"] / times["shm"])
                    row.append("ok" if all(table[(op, size, b)]["ok"] for b in backends) else "WRONG")
                    rows.append(row)
                headers = ["size"]
                for b in backends:
                    headers += [f"{b} time (us)", f"{b} algbw (GB/s)", f"{b} busbw (GB/s)", f"{b} cpu (us)"]
                if "gloo" in backends and "shm" in backends:
                    headers.append("gloo/shm time")
                headers.append("check")
                title = f"{op}, {nproc} processes"
                text = benchutil.markdown_table(headers, rows)
                md += ["", f"## {title}", "", text]
                print(f"\n{title} ({time.monotonic() - t0:.0f} s)\n{text}", flush=True)
                if args.out:
                    png = Path(args.out) / f"comm_{op}_{nproc}p.png"
                    benchutil.plot_lines(
                        png, f"{title}: bus bandwidth", "size (bytes)", "busbw (GB/s)", series
                    )
                    md += ["", f"![{title}]({png.name})"]
    path = benchutil.write_report(args.out, "comm", "\n".join(md))
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
