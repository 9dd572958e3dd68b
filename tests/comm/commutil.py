"""Helpers for the comm tests: the fake libnccl build and the functions run on each rank.

Rank functions are module-level (run_ranks pickles them by reference) and return plain data; the
tests assert in the parent process so failures show every rank's view.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

import trainloom.comm as C
from trainloom.comm import ReduceOp
from trainloom.errors import CommError, CommTimeoutError

FAKES = Path(__file__).resolve().parent.parent / "fakes"

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
_ALL_NUMERIC_OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
    ReduceOp.AVG: dist.ReduceOp.SUM,
}


def build_fake_nccl(out_dir: Path, no_p2p: bool = False) -> str:
    """Compile tests/fakes/fake_nccl.c into ``out_dir``; returns the .so path."""
    name = "libnccl-fake-nop2p.so.2" if no_p2p else "libnccl-fake.so.2"
    target = out_dir / name
    cmd = ["gcc", "-shared", "-fPIC", "-O1", "-o", str(target), str(FAKES / "fake_nccl.c"), "-lpthread"]
    if no_p2p:
        cmd.insert(1, "-DFAKE_NO_P2P")
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return str(target)


def ops_for(dtype: torch.dtype) -> List[ReduceOp]:
    if dtype.is_complex:
        return [ReduceOp.SUM, ReduceOp.AVG]
    if dtype.is_floating_point:
        return [*_ALL_NUMERIC_OPS, ReduceOp.AVG]
    return [*_ALL_NUMERIC_OPS, ReduceOp.BOR, ReduceOp.BAND, ReduceOp.BXOR]


def data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Deterministic small values (sums and products stay exact in bfloat16)."""
    g = torch.Generator().manual_seed(7919 * rank + 104729 * salt + 13)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        re = torch.randint(-3, 4, (n,), generator=g).float()
        im = torch.randint(-3, 4, (n,), generator=g).float()
        return torch.complex(re, im).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 200, (n,), generator=g).to(dtype)
    return torch.randint(-3, 4, (n,), generator=g).to(dtype)


def _ref_allreduce(t: torch.Tensor, op: ReduceOp, ws: int) -> torch.Tensor:
    x = t.clone()
    dist.all_reduce(x, _TORCH_OPS[op])
    if op == ReduceOp.AVG:
        x = x / ws
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` (a result) equals ``b`` (the reference). A bool result must hold the bytes 0/1 of the
    reference's truth values: torch's gloo SUM leaves the count of True values in each byte (2 from
    two ranks), which torch.equal calls equal to True while bytewise ops (BXOR, BAND) get it wrong."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8).ne(0).view(torch.uint8)))
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return bool(torch.allclose(a, b, rtol=1e-2 if a.dtype == torch.bfloat16 else 1e-6, atol=0))
    return bool(torch.equal(a, b))


def sweep(rank: int, ws: int, engine: str) -> List[str]:
    """Every collective, every listed dtype and op, against torch.distributed (gloo) results."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=30)
    bad: List[str] = []
    kind = C.get_default_group().get_global_communicator().cpu_engine_kind()
    if kind != engine:
        bad.append(f"rank {rank}: CPU engine is {kind}, expected {engine}")

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not _same(got, want):
            bad.append(f"rank {rank} {what}: got {got.tolist()} want {want.tolist()}")

    n = 6 * ws  # divisible by ws for the chunked ops
    last = ws - 1
    for dt in DTYPES:
        x = data(rank, n, dt)
        for op in ops_for(dt):
            want = _ref_allreduce(x, op, ws)
            out = torch.zeros_like(x)
            C.allreduce(x, out, op)
            check(f"allreduce {dt} {op.name}", out, want)
            # reduce to the last rank; the others' recv must stay untouched
            ref = x.clone()
            dist.reduce(ref, last, _TORCH_OPS[op])
            if op == ReduceOp.AVG:
                ref = ref / ws
            out = torch.zeros_like(x)
            C.reduce(x, out, last, op)
            check(f"reduce {dt} {op.name}", out, ref if rank == last else torch.zeros_like(x))
            # reduce_scatter: chunk `rank` of the allreduce
            out = torch.zeros(n // ws, dtype=dt)
            C.reduce_scatter(x, out, op)
            check(f"reduce_scatter {dt} {op.name}", out, want[rank * 6 : (rank + 1) * 6])
        # in-place reductions (SUM, plus MAX for variety)
        for op in (ReduceOp.SUM, ReduceOp.MAX) if not dt.is_complex else (ReduceOp.SUM,):
            want = _ref_allreduce(x, op, ws)
            t = x.clone()
            C.allreduce_inplace(t, op)
            check(f"allreduce_inplace {dt} {op.name}", t, want)
            t = x.clone()
            C.reduce_inplace(t, 0, op)
            check(f"reduce_inplace {dt} {op.name}", t, want if rank == 0 else x)
            t = x.clone()
            C.reduce_scatter_inplace(t, op)
            exp = x.clone()
            exp[rank * 6 : (rank + 1) * 6] = want[rank * 6 : (rank + 1) * 6]
            check(f"reduce_scatter_inplace {dt} {op.name}", t, exp)
        # data movement, against torch.distributed's own results
        t = x.clone()
        C.broadcast(t, 1 % ws)
        ref = x.clone()
        dist.broadcast(ref, 1 % ws)
        check(f"broadcast {dt}", t, ref)
        small = data(rank, 5, dt, salt=1)
        out = torch.zeros(5 * ws, dtype=dt)
        C.allgather(small, out)
        ref = torch.zeros(5 * ws, dtype=dt)
        dist.all_gather_into_tensor(ref, small)
        check(f"allgather {dt}", out, ref)
        t = torch.zeros(5 * ws, dtype=dt)
        t[rank * 5 : (rank + 1) * 5] = small
        C.allgather_inplace(t)
        check(f"allgather_inplace {dt}", t, ref)
        out = torch.zeros(5 * ws, dtype=dt)
        C.gather(small, out, last)
        check(f"gather {dt}", out, ref if rank == last else torch.zeros(5 * ws, dtype=dt))
        if rank == 0:
            t = torch.zeros(5 * ws, dtype=dt)
            t[:5] = small
        else:
            t = small.clone()
        C.gather_inplace(t, 5, 0)
        check(f"gather_inplace {dt}", t, ref if rank == 0 else small)
        # scatter from the last rank: reference with dist.scatter (complex through view_as_real)
        src_data = data(last, 4 * ws, dt, salt=2)
        out = torch.zeros(4, dtype=dt)
        C.scatter(src_data if rank == last else torch.zeros(0, dtype=dt), out, last)
        real = (lambda v: torch.view_as_real(v)) if dt.is_complex else (lambda v: v)
        ref = torch.zeros(4, dtype=dt)
        dist.scatter(real(ref), [real(c.clone()) for c in src_data.chunk(ws)] if rank == last else None, last)
        check(f"scatter {dt}", out, ref)
        t = src_data.clone() if rank == last else torch.zeros(4, dtype=dt)
        C.scatter_inplace(t, 4, last)
        check(f"scatter_inplace {dt}", t, src_data if rank == last else ref)
        out = torch.zeros_like(x)
        C.alltoall(x, out)
        ref = torch.zeros_like(x)
        dist.all_to_all_single(ref, x)
        check(f"alltoall {dt}", out, ref)
        t = x.clone()
        C.alltoall_inplace(t)
        check(f"alltoall_inplace {dt}", t, ref)
        # alltoall_v: rank i sends (i + j) % 3 + 1 elements to rank j, packed; displacements with a gap
        sc = [(rank + j) % 3 + 1 for j in range(ws)]
        rc = [(i + rank) % 3 + 1 for i in range(ws)]
        sd = [sum(sc[:j]) + j for j in range(ws)]  # one unused element between blocks
        rd = [sum(rc[:i]) for i in range(ws)]
        send_buf = data(rank, sum(sc) + ws, dt, salt=3)
        packed = torch.cat([send_buf[sd[j] : sd[j] + sc[j]] for j in range(ws)])
        ref = torch.zeros(sum(rc), dtype=dt)
        dist.all_to_all_single(ref, packed, rc, sc)
        out = torch.zeros(sum(rc), dtype=dt)
        C.alltoall_v(send_buf, sc, sd, out, rc, rd)
        check(f"alltoall_v {dt}", out, ref)
        # in place: symmetric counts c (both ways), contiguous displacements
        cnt = [2] * ws
        dsp = [2 * j for j in range(ws)]
        t = data(rank, 2 * ws, dt, salt=4)
        ref = torch.zeros_like(t)
        dist.all_to_all_single(ref, t, cnt, cnt)
        C.alltoall_v_inplace(t, cnt, dsp)
        check(f"alltoall_v_inplace {dt}", t, ref)
        # send/recv around a ring
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        got = torch.zeros(3, dtype=dt)
        if rank % 2 == 0:
            C.send(data(rank, 3, dt, salt=5), nxt)
            C.recv(got, prv)
        else:
            C.recv(got, prv)
            C.send(data(rank, 3, dt, salt=5), nxt)
        check(f"send/recv {dt}", got, data(prv, 3, dt, salt=5))
    C.barrier()
    C.destroy_process_group()
    return bad


def inplace_results(rank: int, ws: int, engine: str) -> List[Any]:
    """Every in-place form with ``async_op=True``, on every rank (also the root of a rooted one):
    (name, whether ``result()`` is the tensor it was given, the tensor's values after ``wait()``)."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=30)
    full = lambda: torch.arange(2.0 * ws) + 10 * rank  # noqa: E731  two elements per rank
    calls = [
        ("allreduce_inplace", full(), lambda t: C.allreduce_inplace(t, async_op=True)),
        ("reduce_inplace", full(), lambda t: C.reduce_inplace(t, dst=0, async_op=True)),
        ("reduce_scatter_inplace", full(), lambda t: C.reduce_scatter_inplace(t, async_op=True)),
        ("broadcast", full(), lambda t: C.broadcast(t, src=0, async_op=True)),
        ("allgather_inplace", full(), lambda t: C.allgather_inplace(t, async_op=True)),
        ("alltoall_inplace", full(), lambda t: C.alltoall_inplace(t, async_op=True)),
        (
            "alltoall_v_inplace",
            full(),
            lambda t: C.alltoall_v_inplace(t, [2] * ws, [2 * j for j in range(ws)], async_op=True),
        ),
    ]
    for root in range(ws):  # the rooted forms take a whole tensor on the root and a chunk elsewhere
        t = full() if rank == root else torch.full((2,), -1.0)
        calls.append(
            (f"scatter_inplace src={root}", t, lambda t, r=root: C.scatter_inplace(t, 2, r, async_op=True))
        )
        t = full() if rank == root else full()[2 * rank : 2 * rank + 2]
        calls.append(
            (f"gather_inplace dst={root}", t, lambda t, r=root: C.gather_inplace(t, 2, r, async_op=True))
        )
    out: List[Any] = []
    for name, t, call in calls:
        w = call(t)
        w.wait()
        out.append((name, w.result() is t, t.tolist()))
    C.destroy_process_group()
    return out


def features(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Async Work, non-contiguous views, empty tensors, groups, hierarchical allreduce."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    # Three ranks on two logical nodes: {0, 1} and {2}.
    os.environ["TRAINLOOM_NODE_ID"] = "a" if rank < 2 else "b"
    pg = C.init_process_group(timeout=30)
    out: Dict[str, Any] = {}
    # async: several ops in flight, completed in order
    ts = [torch.full((4,), float(rank + i)) for i in range(3)]
    works = [C.allreduce_inplace(t, async_op=True) for t in ts]
    out["async"] = [w.wait() and w.result().tolist() for w in works]
    out["async_completed"] = all(w.is_completed() for w in works)
    # a composite operation on the worker thread may call the same communicator synchronously
    gc = pg.get_global_communicator()
    t = torch.ones(2)
    w = gc.execute(
        "composite", "cpu", lambda _e: C.allreduce_inplace(t, comm=gc), True, t, needs_engine=False
    )
    w.wait(timeout=20)
    out["composite"] = t.tolist()
    # a sync call after async ones keeps the order on every rank
    w = C.broadcast(torch.full((2,), float(rank)), 0, async_op=True)
    t = torch.full((2,), float(rank))
    C.allreduce_inplace(t)
    w.wait()
    out["mixed"] = t.tolist()
    # non-contiguous: a column of a matrix, the neighbouring column must stay
    m = torch.arange(12, dtype=torch.float32).view(4, 3) + 100 * rank
    C.allreduce_inplace(m[:, 1])
    out["column"] = m.tolist()
    m = torch.zeros(2, 3 * ws)
    C.allgather(torch.full((3,), float(rank)), m[1, :])
    out["gather_into_row"] = m.tolist()
    t = torch.arange(6.0).view(2, 3).t()  # transposed view, broadcast into it
    if rank != 0:
        t.zero_()
    C.broadcast(t, 0)
    out["transposed"] = t.tolist()
    # more non-contiguous outputs: a column gathered into, a column reduce-scattered in place
    m2 = torch.full((3 * ws, 2), -1.0)
    C.allgather(torch.full((3,), float(rank)), m2[:, 0])
    out["allgather_column"] = m2.tolist()
    m3 = torch.ones(2 * ws, 2)
    C.reduce_scatter_inplace(m3[:, 1])
    out["rs_column"] = m3.tolist()
    # empty tensors, every collective
    e = torch.empty(0)
    C.allreduce_inplace(e)
    C.reduce(e, torch.empty(0), 0)
    C.broadcast(e, 0)
    C.allgather(e, torch.empty(0))
    C.gather(e, torch.empty(0), 1)
    C.scatter(torch.empty(0), e, 2)
    C.reduce_scatter(e, torch.empty(0))
    C.alltoall(e, torch.empty(0))
    C.alltoall_v(e, [0] * ws, [0] * ws, torch.empty(0), [0] * ws, [0] * ws)
    if rank == 0:
        C.send(e, 1)
    elif rank == 1:
        C.recv(torch.empty(0), 0)
    C.barrier()
    out["empty"] = True
    # groups
    sub = C.new_group([0, 2])
    if rank in (0, 2):
        c = sub.get_global_communicator()
        t = torch.full((3,), float(rank))
        C.allreduce_inplace(t, comm=c)
        out["subgroup"] = (c.rank(), c.nranks(), t.tolist())
    else:
        out["subgroup"] = sub.get_global_communicator() is C.NON_COMM_MEMBER
    tg = dist.new_group([0, 1])
    if rank in (0, 1):
        g = C.from_torch_group(tg)
        t = torch.ones(2) * (rank + 1)
        C.allreduce_inplace(t, comm=g.get_global_communicator())
        out["from_torch"] = (g.ranks, t.tolist())
    else:
        C.new_group([0, 1])  # keep the group bookkeeping identical (non-members may call it too)
    # intra/inter-node communicators and hierarchical allreduce
    intra = pg.get_intra_node_communicator()
    inter = pg.get_inter_node_communicator()
    out["intra"] = (intra.rank(), intra.nranks(), intra.global_ranks, intra.cpu_engine_kind())
    out["inter"] = (
        inter if not inter else (inter.rank(), inter.nranks(), inter.global_ranks, inter.cpu_engine_kind())
    )
    out["global_engine"] = pg.get_global_communicator().cpu_engine_kind()
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG):
        x = data(rank, 7, torch.float64)
        h = torch.zeros_like(x)
        C.allreduce(x, h, op, hierarchical=True)
        flat = torch.zeros_like(x)
        C.allreduce(x, flat, op)
        out[f"hier_{op.name}"] = bool(torch.allclose(h, flat))
    x = data(rank, 5, torch.int64)
    w = C.allreduce_inplace(x, async_op=True, hierarchical=True)
    w.wait()
    out["hier_async"] = x.tolist()
    # bool SUM is "any" (bytes 0/1) on every path, the hierarchical one's inter-node gloo step too:
    # gloo's own SUM left the count of True values (2, 3) in each byte, and BXOR/BAND then erred
    b = torch.ones(3, dtype=torch.bool)
    C.allreduce_inplace(b, ReduceOp.SUM, hierarchical=True)
    h = torch.full((3,), rank < 2, dtype=torch.bool)
    C.allreduce_inplace(h, ReduceOp.SUM)
    sums = (b.view(torch.uint8).tolist(), h.view(torch.uint8).tolist())
    x = b if rank == 0 else torch.full((3,), rank == 1, dtype=torch.bool)
    C.allreduce_inplace(x, ReduceOp.BXOR)  # True ^ True ^ False
    y = h if rank == 0 else torch.tensor([True, rank == 2, True])
    C.allreduce_inplace(y, ReduceOp.BAND)
    out["bool_sum"] = (*sums, x.tolist(), y.tolist())
    # the other dtypes the engines take (gloo has no int16: reduced in int32 and wrapped back)
    extra = []
    for dt in (torch.float16, torch.int8, torch.int16, torch.complex128):
        x = data(rank, 9, dt)
        got = torch.zeros_like(x)
        C.allreduce(x, got, ReduceOp.SUM)
        want = local_reduce(torch.stack([data(r, 9, dt) for r in range(ws)]), ReduceOp.SUM)
        extra.append(_same(got, want))
    big = torch.full((3,), 30000, dtype=torch.int16)
    C.allreduce_inplace(big)
    extra.append(big.tolist() == [(90000 + 2**15) % 2**16 - 2**15] * 3)  # int16 wraps around
    out["extra_dtypes"] = extra
    out["env"] = (C.get_rank(), C.get_world_size(), C.get_local_rank(), C.get_local_size())
    C.destroy_process_group()
    try:
        C.allreduce_inplace(torch.ones(1), comm=intra)
    except CommError as exc:
        out["after_destroy"] = str(exc)
    return out


def _expect(fn, exc_type, *args, **kwargs) -> str:  # noqa: ANN001
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def mismatches(rank: int, ws: int, engine: str) -> Dict[str, str]:
    """Cross-rank differences raise CommError on every rank, naming both ranks' values."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=20)
    out: Dict[str, str] = {}

    def fresh():  # a new communicator per case: engines may retire a communicator after an error
        return C.new_group().get_global_communicator()

    out["numel"] = _expect(C.allreduce_inplace, CommError, torch.ones(4 if rank == 0 else 8), comm=fresh())
    out["dtype"] = _expect(
        C.allreduce_inplace,
        CommError,
        torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64),
        comm=fresh(),
    )
    out["op"] = _expect(
        C.allreduce_inplace,
        CommError,
        torch.ones(4),
        ReduceOp.SUM if rank == 0 else ReduceOp.MAX,
        comm=fresh(),
    )
    out["root"] = _expect(C.broadcast, CommError, torch.ones(4), rank % 2, comm=fresh())
    out["alltoall_v"] = _expect(
        C.alltoall_v,
        CommError,
        torch.ones(4),
        [2, 2],
        [0, 2],
        torch.zeros(5),
        [2, 3] if rank == 0 else [2, 2],
        [0, 2],
        comm=fresh(),
    )
    if rank == 0:  # different collectives
        out["other"] = _expect(C.allreduce_inplace, CommError, torch.ones(4), comm=fresh())
    else:
        out["other"] = _expect(C.allgather, CommError, torch.ones(4), torch.zeros(4 * ws), comm=fresh())
    # an asynchronous call reports the mismatch from Work.wait()
    w = C.allreduce_inplace(torch.ones(2 if rank == 0 else 3), comm=fresh(), async_op=True)
    out["async"] = _expect(w.wait, CommError)
    # the default communicator still works afterwards
    t = torch.ones(3)
    C.allreduce_inplace(t)
    out["after"] = str(t.tolist())
    C.destroy_process_group()
    return out


def late_rank(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 1 calls the second allreduce only after the others gave up on it, and rank 2 calls it
    1.2 s after rank 0: the others time out naming the op and rank 1 only; rank 1 hears that they
    timed out (not that a peer died)."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=2)
    C.allreduce_inplace(torch.ones(2))
    res: Dict[str, Any] = {}
    store = C.group._STATE.store  # every rank waits (through the store) until the others gave up
    if rank == 2:
        time.sleep(1.2)
    if rank != 1:
        t0 = time.monotonic()
        res["error"] = _expect(C.allreduce_inplace, CommError, torch.ones(2))
        res["seconds"] = time.monotonic() - t0
    else:
        store.wait(["late_done/0", "late_done/2"], datetime.timedelta(seconds=30))
        res["late"] = _expect(C.allreduce_inplace, CommError, torch.ones(2))
    store.set(f"late_done/{rank}", "1")  # (rank 0 hosts the store: it must not exit first)
    store.wait([f"late_done/{r}" for r in range(ws)], datetime.timedelta(seconds=30))
    C.destroy_process_group()
    return res


def late_p2p_peer(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Sends and receives whose peer comes 0.7 s late (past the gloo engine's 0.2 s wait slices),
    blocking and asynchronous, in both directions; then the pair is used again."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=10)
    C.barrier()
    peer = 1 - rank
    res: Dict[str, Any] = {}
    for mode in ("blocking", "async"):
        for late in (0, 1):  # the late rank: it sends (first round) or receives (second) 0.7 s late
            got = torch.zeros(3)
            try:
                if rank == late:
                    time.sleep(0.7)
                if rank == 0:
                    w = C.send(torch.full((3,), 7.0 + late), peer, async_op=mode == "async")
                else:
                    w = C.recv(got, peer, async_op=mode == "async")
                if w is not None:
                    w.wait()
                res[f"{mode}_{late}"] = got.tolist()
            except CommError as exc:
                res[f"{mode}_{late}"] = f"{type(exc).__name__}: {exc}"[:300]
    back = torch.zeros(2)
    C.recv(back, peer) if rank == 0 else C.send(torch.ones(2), peer)
    res["after"] = back.tolist()
    C.barrier()
    C.destroy_process_group()
    return res


def staged_send_behind_a_pending_send(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Both ranks send twice, the second time a non-contiguous view, then receive twice, all
    asynchronous. The second send's copy must wait for the first send in the send queue, not in
    the issuing thread: a send completes only once the peer receives (gloo: posts the receive;
    shm: beyond two pair buffers), and the peer's receives come after its own sends."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=8)
    C.barrier()
    peer = 1 - rank
    n = 1 << 18  # 1 MiB messages, larger than the shm pair channel
    m = torch.arange(2.0 * n).view(n, 2) + rank
    first, got1, got2 = torch.full((n,), float(rank)), torch.zeros(n), torch.zeros(n)
    t0 = time.monotonic()
    res: Dict[str, Any] = {}
    try:
        works = [C.send(first, peer, async_op=True), C.send(m.t()[1], peer, async_op=True)]
        works += [C.recv(got1, peer, async_op=True), C.recv(got2, peer, async_op=True)]
        for w in works:
            w.wait()
        res["got1"] = got1.unique().tolist()
        res["got2_ok"] = torch.equal(got2, torch.arange(1.0, 2.0 * n, 2.0) + peer)
    except CommError as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:300]
    res["seconds"] = time.monotonic() - t0
    if "error" not in res:
        C.barrier()
        C.destroy_process_group()
    return res


def composites_behind_a_pending_collective(rank: int, ws: int, engine: str, tmp: str) -> Dict[str, Any]:
    """Composite operations on non-contiguous views of a tensor that an asynchronous allreduce
    is still writing: each copies its input when the operation starts, after the allreduce
    (not earlier: stale values), and not in the issuing thread either (it would wait there).

    Rank 1 joins the allreduce only once rank 0 has issued everything (a file in ``tmp``): if an
    issue on rank 0 waits for the allreduce, rank 1 gives up waiting after 5 s and goes on, and
    says so (``blocked``)."""
    from trainloom.comm import classic, colossal, neighbor

    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=30)
    C.barrier()
    flag = os.path.join(tmp, "issued")
    out: Dict[str, Any] = {"blocked": False}
    shape = (7, 2, 2 * ws)
    ref = torch.arange(1.0, 1.0 + 4 * 7 * ws).view(shape)
    big = ref * (rank + 1)
    ref = ref * (ws * (ws + 1) // 2)  # what the allreduce leaves in big
    small = torch.full((4, 4), float(rank + 1)).t()[:2, :2]  # gather_inplace's input off dst
    if rank == 1:
        deadline = time.monotonic() + 5
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        out["blocked"] = not os.path.exists(flag)
    works = [C.allreduce_inplace(big, async_op=True), C.allreduce_inplace(small, async_op=True)]
    nag = neighbor.neighbor_allgather_async(big[4].t())
    nar = neighbor.neighbor_allreduce_async(big[5].t())
    inplace = [big[0].t(), big[1].t(), big[2].t() if rank == 0 else small]
    inplace_works = [
        C.allgather_inplace(inplace[0], async_op=True),
        C.reduce_scatter_inplace(inplace[1], async_op=True),
        C.gather_inplace(inplace[2], count=4, dst=0, async_op=True),
    ]
    works += inplace_works
    crs, w = colossal.reduce_scatter(big[3], dim=1, async_op=True)
    works.append(w)
    scattered_in = torch.zeros(4)
    works.append(
        classic.scatter(scattered_in, 0, list(big[6].view(ws, 4)) if rank == 0 else None, async_op=True)
    )
    if rank == 0:
        with open(flag, "w"):
            pass
    for w in works:
        w.wait()
    got_nag, got_nar = neighbor.synchronize(nag), neighbor.synchronize(nar)
    # an in-place form's Work gives the tensor it was given (reduce_scatter_inplace gave this rank's
    # chunk of a contiguous tensor)
    out["inplace_results"] = [w.result() is t for w, t in zip(inplace_works, inplace)]
    n_in = got_nag.shape[0] // (2 * ws)
    k = 4
    scattered = ref[1].t().reshape(-1).clone()
    scattered[rank * k : (rank + 1) * k] *= ws
    checks = {
        "neighbor_allgather": (got_nag, ref[4].t().repeat(n_in, 1)),
        "neighbor_allreduce": (got_nar, ref[5].t()),
        "allgather_inplace": (big[0], ref[0]),
        "reduce_scatter_inplace": (big[1].t().reshape(-1), scattered),
        "colossal_reduce_scatter": (crs, ws * ref[3][:, 2 * rank : 2 * rank + 2]),
        "classic_scatter": (scattered_in, ref[6].view(ws, 4)[rank]),
    }
    if rank == 0:  # chunk 0 is its own; the others are the other ranks' allreduced ``small``
        gathered = ref[2].t().reshape(-1).clone()
        gathered[k:] = ws * (ws + 1) // 2
        checks["gather_inplace"] = (big[2].t().reshape(-1), gathered)
    for name, (got, want) in checks.items():
        out[name] = True if torch.equal(got, want) else got.tolist()
    C.barrier()
    C.destroy_process_group()
    return out


def dying_peer(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 1 exits in the middle of the job: the survivors raise instead of hanging."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=5)
    C.allreduce_inplace(torch.ones(2))
    if rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    err = _expect(C.allreduce_inplace, CommError, torch.ones(2))
    return {"error": err, "seconds": time.monotonic() - t0}


def fake_nccl_plumbing(rank: int, ws: int, lib: str, lib_nop2p: str) -> Dict[str, Any]:
    """The compiled binding against the fake libnccl (one rank, host memory)."""
    import ctypes
    import threading

    from trainloom.comm import _nccl, nccl
    from trainloom.errors import NcclError

    out: Dict[str, Any] = {}
    out["loaded_before"] = _nccl.is_loaded()
    out["available"] = nccl.is_available()
    out["version"] = nccl.get_version()
    out["path"] = nccl.library_path()
    out["has_alltoall"] = _nccl.has_symbol("ncclAlltoAll")
    fake = ctypes.CDLL(lib)  # the same mapping the binding uses (dlopen returns the loaded copy)
    uid = nccl.get_unique_id()
    comm = _nccl.Communicator(1, uid, 0)
    out["rank_count"] = (comm.user_rank(), comm.count(), fake.fake_nccl_live_comms())
    f32 = nccl.NCCL_DTYPES[torch.float32]
    s = torch.arange(8, dtype=torch.float32)
    r = torch.zeros(8)
    comm.allreduce(s.data_ptr(), r.data_ptr(), 8, f32, 0, 0)
    out["allreduce"] = r.tolist()
    r.zero_()
    comm.alltoall(s.data_ptr(), r.data_ptr(), 8, 4, f32, 0)  # the grouped send/recv fallback
    out["alltoall"] = r.tolist()
    r.zero_()
    counts = __import__("array").array("q", [3])
    comm.alltoall_v(
        s.data_ptr(),
        counts,
        __import__("array").array("q", [2]),
        r.data_ptr(),
        counts,
        __import__("array").array("q", [4]),
        4,
        f32,
        0,
    )
    out["alltoall_v"] = r.tolist()
    r.zero_()
    comm.gather(s.data_ptr(), r.data_ptr(), 8, 4, f32, 0, 0)
    out["gather"] = r.tolist()
    fake.fake_nccl_fail_next(4)
    try:
        comm.allreduce(s.data_ptr(), r.data_ptr(), 8, f32, 0, 0)
    except NcclError as exc:
        out["error"] = (exc.status, exc.where, str(exc))
    # The GIL is released during the call: another Python thread must be able to run and release it.
    fake.fake_nccl_block_next()
    res: Dict[str, Any] = {}

    def call() -> None:
        try:
            comm.allreduce(s.data_ptr(), r.data_ptr(), 8, f32, 0, 0)
            res["ok"] = True
        except NcclError as exc:
            res["ok"] = str(exc)

    th = threading.Thread(target=call)
    th.start()
    time.sleep(0.05)
    fake.fake_nccl_release()  # only runs if the call above let go of the GIL
    th.join()
    out["gil_released"] = res["ok"]
    comm.close()
    comm.close()  # idempotent
    out["live_after_close"] = fake.fake_nccl_live_comms()
    try:
        comm.allreduce(s.data_ptr(), r.data_ptr(), 8, f32, 0, 0)
    except CommError as exc:
        out["after_close"] = str(exc)
    c2 = _nccl.Communicator(1, uid, 0)
    del c2  # __dealloc__ destroys it
    out["live_after_del"] = fake.fake_nccl_live_comms()
    with _nccl.Communicator(1, uid, 0) as c3:
        out["ctx_live"] = fake.fake_nccl_live_comms()
        c3.abort()
    out["live_after_abort"] = fake.fake_nccl_live_comms()
    try:
        _nccl.Communicator(2, uid, 0)
    except NcclError as exc:
        out["init_error"] = (exc.status, exc.where)
    try:
        _nccl.Communicator(1, b"short", 0)
    except ValueError as exc:
        out["bad_uid"] = str(exc)
    for world, rank in ((0, 0), (2, 2)):
        try:
            _nccl.Communicator(world, uid, rank)
        except ValueError as exc:
            out[f"bad_world_rank_{world}_{rank}"] = str(exc)
    return out


def fake_nccl_no_p2p(rank: int, ws: int) -> Dict[str, Any]:
    """A libnccl without ncclSend/ncclRecv: optional symbols raise NotImplementedError with the version."""
    from trainloom.comm import _nccl, nccl

    comm = _nccl.Communicator(1, nccl.get_unique_id(), 0)
    s = torch.ones(4)
    r = torch.zeros(4)
    try:
        comm.alltoall(s.data_ptr(), r.data_ptr(), 4, 4, 7, 0)
        msg = "no error"
    except NotImplementedError as exc:
        msg = str(exc)
    comm.allreduce(s.data_ptr(), r.data_ptr(), 4, 7, 0, 0)
    comm.close()
    return {"alltoall": msg, "allreduce": r.tolist()}


def nccl_unavailable(rank: int, ws: int) -> Dict[str, Any]:
    from trainloom.comm import nccl
    from trainloom.errors import NcclUnavailableError

    out: Dict[str, Any] = {"available": nccl.is_available(), "reason": nccl.unavailable_reason()}
    try:
        nccl.get_version()
    except NcclUnavailableError as exc:
        out["error"] = str(exc)
    return out


def real_nccl(rank: int, ws: int) -> Dict[str, Any]:
    """The real libnccl from nvidia-nccl-cu12: loads, versions and ids work without a GPU."""
    from trainloom.comm import _nccl, nccl
    from trainloom.errors import NcclError

    maps_before = "libnccl" in Path("/proc/self/maps").read_text()
    import trainloom.comm  # noqa: F401

    out: Dict[str, Any] = {"maps_before": maps_before, "loaded_after_import": _nccl.is_loaded()}
    out["available"] = nccl.is_available()
    out["version"] = nccl.get_version()
    out["path"] = nccl.library_path()
    out["maps_after"] = "libnccl" in Path("/proc/self/maps").read_text()
    a, b = nccl.get_unique_id(), nccl.get_unique_id()
    out["uid"] = (len(a), a != b)
    try:
        _nccl.Communicator(1, a, 0)
    except NcclError as exc:
        out["init"] = (exc.status, exc.where, str(exc))
    import trainloom

    cfg = trainloom.config()["nccl"]
    out["config"] = (cfg["available"], cfg.get("version"), cfg.get("path"))
    return out


def local_reduce(stack: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Reference reduction over dim 0 with trainloom's semantics (bool SUM = any, PRODUCT = all)."""
    import functools

    if stack.dtype == torch.bool:
        table = {
            ReduceOp.SUM: torch.any,
            ReduceOp.MAX: torch.any,
            ReduceOp.BOR: torch.any,
            ReduceOp.PRODUCT: torch.all,
            ReduceOp.MIN: torch.all,
            ReduceOp.BAND: torch.all,
        }
        if op == ReduceOp.BXOR:
            return functools.reduce(torch.bitwise_xor, stack.unbind(0))
        return table[op](stack, dim=0)
    if op in (ReduceOp.BOR, ReduceOp.BAND, ReduceOp.BXOR):
        fn = {
            ReduceOp.BOR: torch.bitwise_or,
            ReduceOp.BAND: torch.bitwise_and,
            ReduceOp.BXOR: torch.bitwise_xor,
        }[op]
        return functools.reduce(fn, stack.unbind(0))
    if op == ReduceOp.SUM:
        return stack.sum(0, dtype=stack.dtype)
    if op == ReduceOp.PRODUCT:
        return stack.prod(0, dtype=stack.dtype)
    if op == ReduceOp.MIN:
        return stack.amin(0)
    if op == ReduceOp.MAX:
        return stack.amax(0)
    return stack.sum(0) / stack.shape[0]


def gpu_collectives(rank: int, ws: int) -> List[str]:  # pragma: no cover - needs GPUs
    """CUDA tensors through the NCCL engine, against a local reference of every rank's data."""
    torch.cuda.set_device(rank % torch.cuda.device_count())
    C.init_process_group(timeout=60)
    bad: List[str] = []
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64):
        x = data(rank, 12, dt).cuda()
        stack = torch.stack([data(r, 12, dt) for r in range(ws)])
        for op in ops_for(dt):
            got = torch.zeros_like(x)
            C.allreduce(x, got, op)
            if not _same(got.cpu(), local_reduce(stack, op)):
                bad.append(f"allreduce {dt} {op.name}: {got.cpu().tolist()}")
        g = torch.zeros(12 * ws, dtype=dt, device="cuda")
        C.allgather(x, g)
        if not _same(g.cpu(), stack.reshape(-1)):
            bad.append(f"allgather {dt}")
    w = C.allreduce_inplace(torch.ones(4, device="cuda"), async_op=True)
    w.wait(timeout=30)
    if w.result().cpu().tolist() != [float(ws)] * 4:
        bad.append("async allreduce")
    C.destroy_process_group()
    return bad


def shm_segments() -> List[str]:
    """trainloom segments in /dev/shm whose creating process is gone (leaks; live ones are in use)."""
    leaked = []
    for name in os.listdir("/dev/shm"):
        if not name.startswith("tl-"):
            continue
        pid = next((int(p) for p in name.split("-") if p.isdigit()), None)
        if pid is None or not os.path.exists(f"/proc/{pid}"):
            leaked.append(name)
    return sorted(leaked)


def engines() -> List[str]:
    """CPU engines to test: gloo always, shm when trainloom.comm.shm imports."""
    from trainloom.comm.group import _shm_status

    return ["gloo"] + (["shm"] if _shm_status() is None else [])


def validation_two_ranks(rank: int, ws: int) -> Dict[str, Any]:
    """Argument checks that depend on the communicator size (raised identically on both ranks)."""
    C.init_process_group(timeout=20)
    out: Dict[str, Any] = {}
    out["rs_inplace"] = _expect(C.reduce_scatter_inplace, ValueError, torch.ones(5))
    out["alltoall"] = _expect(C.alltoall, ValueError, torch.ones(3), torch.ones(3))
    out["allgather"] = _expect(C.allgather, ValueError, torch.ones(3), torch.ones(4))
    intra = C.get_default_group().get_intra_node_communicator()
    out["hierarchical_sub"] = _expect(
        C.allreduce_inplace, ValueError, torch.ones(2), comm=intra, hierarchical=True
    )
    t = torch.ones(2)
    C.allreduce_inplace(t)
    out["ok"] = t.tolist()
    # Bagua's early API (bagua-communication-early.txt): in-place allreduce/reduce, broadcast(root=)
    comm = C.get_default_group().get_global_communicator()
    early = {}
    t = torch.full((2,), float(rank + 1))
    C.allreduce(t)
    early["allreduce(t)"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    C.allreduce(t, dist.ReduceOp.MAX, comm)
    early["allreduce(t, MAX, comm)"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    C.allreduce(t, dist.ReduceOp(dist.ReduceOp.MAX))  # an op instance in the op slot (was recv_tensor)
    early["allreduce(t, ReduceOp(MAX))"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    C.allreduce(t, op=ReduceOp.PRODUCT)
    early["allreduce(t, op=PRODUCT)"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    C.reduce(t, 1, ReduceOp.MAX, comm)
    early["reduce(t, 1, MAX, comm)"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    C.reduce(t, dst=0)
    early["reduce(t, dst=0)"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    C.broadcast(t, root=1)
    early["broadcast(t, root=1)"] = t.tolist()
    out["early"] = early
    # numpy integers are ranks (as in torch.distributed); receive ranges may not overlap
    import numpy as np

    t = torch.full((2,), float(rank + 1))
    C.broadcast(t, np.int64(1))
    out["broadcast_np_src"] = t.tolist()
    out["recv_overlap"] = _expect(
        C.alltoall_v, ValueError, torch.ones(4), [2, 2], [0, 2], torch.zeros(4), [2, 2], [0, 0]
    )
    out["recv_overlap_partial"] = _expect(
        C.alltoall_v, ValueError, torch.ones(4), [2, 2], [0, 2], torch.zeros(5), [2, 2], [1, 0]
    )
    out["inplace_overlap"] = _expect(C.alltoall_v_inplace, ValueError, torch.ones(4), [2, 2], [1, 0])
    # ranges that only touch, and empty ranges anywhere, are fine (neighbor ops use recv_displs=0 for
    # ranks they receive nothing from)
    send = torch.arange(4.0) + 10 * rank
    recv = torch.zeros(4)
    C.alltoall_v(send, [2, 2], [0, 2], recv, [2, 2], [2, 0])
    out["touching"] = recv.tolist()
    recv = torch.zeros(2)
    C.alltoall_v(send, [1, 1], [0, 1], recv, [1, 1], [1, 0])
    out["swapped"] = recv.tolist()
    C.destroy_process_group()
    return out


def absent_rank(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 1 never makes the first CPU collective: connecting the engine times out, naming rank 1."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=2)
    store = C.group._STATE.store
    res: Dict[str, Any] = {}
    if rank != 1:
        try:
            C.allreduce_inplace(torch.ones(2))
        except CommError as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"
            res["attrs"] = (exc.op, exc.seq, exc.missing_ranks, exc.global_missing_ranks)  # type: ignore[attr-defined]
    store.set(f"absent_done/{rank}", "1")  # every rank waits: rank 0 hosts the store
    store.wait([f"absent_done/{r}" for r in range(ws)], datetime.timedelta(seconds=30))
    C.destroy_process_group()
    return res


def nccl_cross_checks(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """The header exchange CUDA operations run through the CPU engine, exercised with CPU tensors."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=20)
    comm = C.get_default_group().get_global_communicator()
    out: Dict[str, Any] = {}
    comm.cross_check("allreduce", torch.ones(4), int(ReduceOp.SUM))  # agreeing ranks pass
    out["numel"] = _expect(comm.cross_check, CommError, "allreduce", torch.ones(4 if rank == 0 else 8), 0)
    out["root"] = _expect(comm.cross_check, CommError, "broadcast", torch.ones(4), -1, rank)
    counts = ([2, 2], [2, 3] if rank == 0 else [2, 2])
    out["counts"] = _expect(comm.cross_check, CommError, "alltoall_v", torch.ones(4), -1, -1, 0, counts)
    policy = {}
    for mode in ("1", "all", "0"):
        os.environ["TRAINLOOM_COMM_CHECK"] = mode
        policy[mode] = comm.nccl_checks()
    out["policy"] = policy
    t = torch.ones(2)
    C.allreduce_inplace(t)
    out["after"] = t.tolist()
    C.destroy_process_group()
    return out


def nccl_engine_on_fake(rank: int, ws: int) -> Dict[str, Any]:
    """NcclEngine's Python plumbing over the fake libnccl, with host tensors standing in for device memory.

    The fake library treats pointers as host memory and has one rank; the CUDA stream/event/device
    calls the engine makes are replaced by inert stand-ins (there is no CUDA runtime here). What is
    tested is trainloom's side: dtype/op tables, complex and bool handling, the bitwise fallback,
    counts for alltoall_v, status -> NcclError, abort/close, the Work handle.
    """
    import contextlib

    from trainloom.comm import nccl
    from trainloom.comm.work import CudaWork
    from trainloom.errors import NcclError

    class _Stream:
        cuda_stream = 0

        def wait_stream(self, other: Any) -> None:
            pass

        def wait_event(self, event: Any) -> None:
            pass

    class _Event:
        def record(self, stream: Any = None) -> None:
            pass

        def query(self) -> bool:
            return True

    stream = _Stream()
    torch.cuda.current_stream = lambda device=None: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.device = lambda d: contextlib.nullcontext()
    torch.cuda.Event = _Event
    store = dist.HashStore()
    eng = nccl.NcclEngine(store, 0, 1, prefix="fake", device=torch.device("cuda", 0), timeout=5)
    out: Dict[str, Any] = {"uid_in_store": len(bytes(store.get("fake/nccl_uid")))}
    res = {}
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64):
        x = data(0, 6, dt)
        for op in ops_for(dt):
            got = torch.zeros_like(x)
            eng.allreduce(x, got, int(op))
            res[f"allreduce {dt} {op.name}"] = _same(got, x)
        got = torch.zeros_like(x)
        eng.reduce(
            x, got, 0, int(ReduceOp.BXOR if not (dt.is_floating_point or dt.is_complex) else ReduceOp.SUM)
        )
        res[f"reduce {dt}"] = _same(got, x)
        for name in ("allgather", "alltoall", "reduce_scatter"):
            got = torch.zeros_like(x)
            fn = getattr(eng, name)
            fn(x, got, 0) if name == "reduce_scatter" else fn(x, got)
            res[f"{name} {dt}"] = _same(got, x)
        got = torch.zeros_like(x)
        eng.gather(x, got, 0)
        res[f"gather {dt}"] = _same(got, x)
        got = torch.zeros_like(x)
        eng.scatter(x, got, 0)
        res[f"scatter {dt}"] = _same(got, x)
        b = x.clone()
        eng.broadcast(b, 0)
        res[f"broadcast {dt}"] = _same(b, x)
        got = torch.zeros(8, dtype=dt)
        eng.alltoall_v(x, [3], [2], got, [3], [4])
        want = torch.zeros(8, dtype=dt)
        want[4:7] = x[2:5]
        res[f"alltoall_v {dt}"] = _same(got, want)
    out["ops"] = res
    out["int16"] = _expect(
        eng.allreduce, TypeError, torch.ones(2, dtype=torch.int16), torch.ones(2, dtype=torch.int16), 0
    )
    # ncclSend outside a group is refused by the fake: the status becomes an NcclError
    out["send_status"] = _expect(eng.send, NcclError, torch.ones(2), 0)
    w = CudaWork("allreduce", _Event(), torch.ones(1), [], eng._check_deadline)
    out["work"] = (w.is_completed(), w.wait(timeout=1.0), w.result().tolist())

    # A collective that never completes: the watchdog aborts the communicator after its timeout, and
    # Work.wait(timeout) gives up instead of hanging.
    class _Stuck(_Event):
        def query(self) -> bool:
            return False

    torch.cuda.Event = _Stuck
    hung = nccl.NcclEngine(store, 0, 1, prefix="fake2", device=torch.device("cuda", 0), timeout=0.3)
    ev = hung.allreduce(torch.ones(2), torch.zeros(2), 0)
    deadline = time.monotonic() + 10
    while hung._error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    out["watchdog"] = _expect(hung.allreduce, CommError, torch.ones(2), torch.zeros(2), 0)
    hung.close()
    hung2 = nccl.NcclEngine(store, 0, 1, prefix="fake3", device=torch.device("cuda", 0), timeout=60)
    ev = hung2.allreduce(torch.ones(2), torch.zeros(2), 0)
    w = CudaWork("allreduce", ev, None, [], hung2._check_deadline)
    out["work_timeout"] = _expect(w.wait, CommTimeoutError, 0.2)
    out["work_timeout_aborted"] = hung2._error
    hung2.close()
    out["live"] = __import__("ctypes").CDLL(os.environ["TRAINLOOM_NCCL_LIBRARY"]).fake_nccl_live_comms()
    eng.abort("test abort")
    out["after_abort"] = _expect(eng.allreduce, CommError, torch.ones(2), torch.ones(2), 0)
    eng.close()
    out["after_close"] = _expect(eng.allreduce, CommError, torch.ones(2), torch.ones(2), 0)
    return out


def absent_at_init(rank: int, ws: int) -> Dict[str, Any]:
    """Rank 2 never calls init_process_group: the others get a timeout naming it, not a hang."""
    if rank == 2:
        return {}
    store = dist.TCPStore(
        "127.0.0.1",
        int(os.environ["MASTER_PORT"]),
        None,
        rank == 0,
        datetime.timedelta(seconds=20),
        wait_for_workers=False,
    )
    err = _expect(C.init_process_group, CommError, store, 2)
    out = {"error": err, "initialized": C.is_initialized(), "torch": dist.is_initialized()}
    store.set(f"done/{rank}", "1")
    if rank == 0:  # keep hosting the store until rank 1 is done with it
        store.wait(["done/1"], datetime.timedelta(seconds=20))
    return out


# --------------------------------------------------------------------------- review fixes (2 ranks)
def op_numbering(rank: int, ws: int) -> Dict[str, Any]:
    """torch.distributed.ReduceOp and trainloom's ReduceOp share integers with other meanings
    (torch MIN=3 = Bagua MAX): each must keep its own meaning whichever one a process used first."""
    from trainloom.comm import collectives

    collectives._OP_CACHE.clear()
    C.init_process_group(timeout=20)
    out: Dict[str, Any] = {}
    x = torch.tensor([1.0, 5.0]) if rank == 0 else torch.tensor([3.0, 2.0])
    seq = [
        ("dist.MIN", dist.ReduceOp.MIN),
        ("MAX", ReduceOp.MAX),  # 3, torch's MIN
        ("MIN", ReduceOp.MIN),  # 2, torch's PRODUCT
        ("dist.PRODUCT", dist.ReduceOp.PRODUCT),
        ("dist.AVG", dist.ReduceOp.AVG),  # 1, Bagua's PRODUCT
        ("PRODUCT", ReduceOp.PRODUCT),
    ]
    for label, op in seq:
        t = x.clone()
        C.allreduce_inplace(t, op)
        out[label] = t.tolist()
    i = torch.tensor([0b0110, 0b0011]) if rank == 0 else torch.tensor([0b0101, 0b0011])
    for label, op in (("BOR", ReduceOp.BOR), ("dist.BXOR", dist.ReduceOp.BXOR)):  # both 7
        t = i.clone()
        C.allreduce_inplace(t, op)
        out[label] = t.tolist()
    C.destroy_process_group()
    return out


EVERY_COLLECTIVE = [
    "allreduce",
    "allreduce(early positional)",
    "allreduce_inplace",
    "reduce",
    "reduce_inplace",
    "broadcast",
    "allgather",
    "allgather_inplace",
    "gather",
    "gather_inplace",
    "scatter",
    "scatter_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "send",
    "recv",
    "barrier",
]


def _run_every_collective(comm: Any) -> Dict[str, Any]:
    """Every collective with ``comm``, on tensors filled with 7: what each returned, whether any tensor
    changed, how long it took. (On a real communicator several of these calls would block: send/recv
    with no peer, barrier and the collectives with no other rank joining.)"""
    calls = {
        "allreduce": lambda a, b: C.allreduce(a, b, ReduceOp.MAX, comm),
        "allreduce(early positional)": lambda a, b: C.allreduce(a, ReduceOp.MAX, comm),
        "allreduce_inplace": lambda a, b: C.allreduce_inplace(a, comm=comm),
        "reduce": lambda a, b: C.reduce(a, b, 0, comm=comm),
        "reduce_inplace": lambda a, b: C.reduce_inplace(a, 0, comm=comm),
        "broadcast": lambda a, b: C.broadcast(a, 0, comm),
        "allgather": lambda a, b: C.allgather(a, b, comm),
        "allgather_inplace": lambda a, b: C.allgather_inplace(a, comm),
        "gather": lambda a, b: C.gather(a, b, 0, comm),
        "gather_inplace": lambda a, b: C.gather_inplace(a, 4, 0, comm),
        "scatter": lambda a, b: C.scatter(a, b, 0, comm),
        "scatter_inplace": lambda a, b: C.scatter_inplace(a, 4, 0, comm),
        "reduce_scatter": lambda a, b: C.reduce_scatter(a, b, comm=comm),
        "reduce_scatter_inplace": lambda a, b: C.reduce_scatter_inplace(a, comm=comm),
        "alltoall": lambda a, b: C.alltoall(a, b, comm),
        "alltoall_inplace": lambda a, b: C.alltoall_inplace(a, comm),
        "alltoall_v": lambda a, b: C.alltoall_v(a, [4], [0], b, [4], [0], comm),
        "alltoall_v_inplace": lambda a, b: C.alltoall_v_inplace(a, [4], [0], comm),
        "send": lambda a, b: C.send(a, 1, comm),
        "recv": lambda a, b: C.recv(a, 1, comm),
        "barrier": lambda a, b: C.barrier(comm),
    }
    got: Dict[str, Any] = {}
    for name in EVERY_COLLECTIVE:
        a, b = torch.full((4,), 7.0), torch.full((4,), 7.0)
        before = (a.clone(), b.clone())
        t0 = time.monotonic()
        try:
            res = calls[name](a, b)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            res = f"{type(exc).__name__}: {exc}"
        unchanged = torch.equal(a, before[0]) and torch.equal(b, before[1])
        got[name] = (res, unchanged, time.monotonic() - t0)
    return got


def non_members(rank: int, ws: int) -> Dict[str, Any]:
    """Rank 1 is not in the inter-node communicator (one node: rank 0 leads it) nor in new_group([0]):
    its getters give NON_COMM_MEMBER and every collective given it returns at once, changing nothing,
    as Bagua's _rank_not_in_comm does; the members still get their results."""
    pg = C.init_process_group(timeout=20)
    out: Dict[str, Any] = {}
    inter = pg.get_inter_node_communicator()
    out["inter"] = repr(inter) if not inter else (inter.rank(), inter.nranks(), inter.global_ranks)
    out["inter_is_placeholder"] = inter is C.NON_COMM_MEMBER
    if rank == 1:
        out["every"] = _run_every_collective(inter)
        t = torch.full((2,), 7.0)
        w = C.allreduce_inplace(t, comm=inter, async_op=True)
        out["async"] = (type(w).__name__, w.is_completed(), w.wait(), w.result() is t, t.tolist())
        w = C.barrier(comm=inter, async_op=True)
        out["async_barrier"] = (w.is_completed(), w.result())
    # the Bagua pattern: every rank calls the collective with the inter-node communicator
    t = torch.full((2,), float(rank + 1))
    C.allreduce_inplace(t, comm=inter)
    out["inter_allreduce"] = t.tolist()
    sub = C.new_group([0])
    comms = (
        sub.get_global_communicator(),
        sub.get_intra_node_communicator(),
        sub.get_inter_node_communicator(),
    )
    out["sub_getters"] = [c is C.NON_COMM_MEMBER for c in comms]
    t = torch.full((2,), float(rank + 1))
    t0 = time.monotonic()
    C.allreduce_inplace(t, ReduceOp.SUM, sub.get_global_communicator())
    out["sub_allreduce"] = (t.tolist(), time.monotonic() - t0 < 2.0)
    # extension APIs that need a member say so instead of skipping
    out["neighbor"] = _expect(C.neighbor_allreduce, CommError, torch.ones(2), comm=sub)
    # members and non-members are still in step: a world allreduce right after
    t = torch.full((2,), float(rank + 1))
    C.allreduce_inplace(t)
    out["world_after"] = t.tolist()
    C.destroy_process_group()
    return out


def agent_store(rank: int, ws: int) -> Dict[str, Any]:
    """init_process_group under TORCHELASTIC_USE_AGENT_STORE=True: every rank is a client of the store
    the (simulated) agent already serves on MASTER_PORT; c10d logs nothing to stderr about it. Twice:
    the agent's store outlives destroy_process_group, so the second init must not read the first one's
    keys (Bluefog scripts call init/shutdown/init; test_api runs that under a real torchrun)."""
    import tempfile

    saved = os.dup(2)
    results = []
    with tempfile.TemporaryFile() as err:
        os.dup2(err.fileno(), 2)
        try:
            for k in range(2):
                C.init_process_group(timeout=10)
                t = torch.full((2,), float(rank + 1 + k))
                C.allreduce_inplace(t)
                results.append(t.tolist())
                C.destroy_process_group()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return {"stderr": stderr, "allreduce": results[0], "allreduce_after_reinit": results[1]}


# --------------------------------------------------------------------------- ordering, AVG, lifetime
def _two_nodes(rank: int, ws: int) -> None:
    """ws=4: logical nodes a={0,1}, b={2,3} (global gloo, intra shm, inter gloo); ws=2: one node."""
    if ws == 4:
        os.environ["TRAINLOOM_NODE_ID"] = "a" if rank < 2 else "b"


def hier_async_ordering(rank: int, ws: int, iters: int) -> List[str]:
    """An async hierarchical allreduce followed by calls on the communicators it drives, same order
    on every rank: every result must be exact (before the fix they were swapped or mixed)."""
    _two_nodes(rank, ws)
    pg = C.init_process_group(timeout=30)
    intra = pg.get_intra_node_communicator()
    inter = pg.get_inter_node_communicator()
    total = float(sum(range(1, ws + 1)))
    bad: List[str] = []

    def check(what: str, it: int, t: torch.Tensor, want: float) -> None:
        if not bool((t == want).all()):
            bad.append(f"rank {rank} it {it} {what}: got {t[0].item()} want {want}")

    for it in range(iters):
        # (a) async hierarchical, then a sync hierarchical
        a = torch.full((64,), float(rank + 1))
        b = torch.full((64,), 100.0 * (rank + 1))
        w = C.allreduce(a, a, hierarchical=True, async_op=True)
        C.allreduce(b, b, hierarchical=True)
        w.wait()
        check("a/async-hier", it, a, total)
        check("a/sync-hier", it, b, 100 * total)
        # (b) async hierarchical, then a sync broadcast on the intra-node communicator
        t = torch.full((33,), float(rank + 1))
        x = torch.full((33,), 10.0 * (rank + 1))
        w = C.allreduce(t, t, hierarchical=True, async_op=True)
        C.broadcast(x, 0, comm=intra)
        w.wait()
        check("b/async-hier", it, t, total)
        check("b/intra-broadcast", it, x, 10.0 * (intra.global_ranks[0] + 1))
        # (c) async hierarchical, async intra allreduce, async inter allreduce, async global op
        t = torch.full((17,), float(rank + 1))
        y = torch.full((17,), float(rank + 1))
        z = torch.full((5,), float(rank + 1))
        g = torch.full((9,), float(rank + 1))
        works = [C.allreduce(t, t, ReduceOp.AVG, hierarchical=True, async_op=True)]
        works.append(C.allreduce_inplace(y, comm=intra, async_op=True))
        works.append(C.allreduce_inplace(z, comm=inter, async_op=True))
        works.append(C.allreduce_inplace(g, ReduceOp.MAX, async_op=True))
        for wk in works:
            wk.wait()
        check("c/async-hier-avg", it, t, total / ws)
        check("c/intra", it, y, float(sum(r + 1 for r in intra.global_ranks)))
        if inter:
            check("c/inter", it, z, float(sum(r + 1 for r in inter.global_ranks)))
        check("c/global-max", it, g, float(ws))
    C.destroy_process_group()
    return bad


def _half_avg_want(dtype: torch.dtype, ws: int) -> torch.Tensor:
    """What the shared-memory engine computes: sum in fp32, divide, round once."""
    rows = torch.stack([_half_avg_input(r, dtype) for r in range(ws)]).float()
    return (rows.sum(0) / ws).to(dtype)


def _half_avg_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    # fp16: 40000 + 32 * rank sums past 65504 (inf) in fp16; bf16: the same idea near 1e38 / 4
    base = 40000.0 if dtype == torch.float16 else 8.0e37
    step = 32.0 if dtype == torch.float16 else 2.0e35
    return torch.tensor([base + step * rank, -base, 1.5, base / 2], dtype=torch.float32).to(dtype)


def half_avg(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """fp16/bf16 AVG on every path returns what the shared-memory engine returns (finite)."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    _two_nodes(rank, ws)
    pg = C.init_process_group(timeout=30)
    out: Dict[str, Any] = {"engine": pg.get_global_communicator().cpu_engine_kind()}
    for dt in (torch.float16, torch.bfloat16):
        name = str(dt).replace("torch.", "")
        want = _half_avg_want(dt, ws)
        x = _half_avg_input(rank, dt)
        got: Dict[str, Any] = {}
        t = x.clone()
        C.allreduce_inplace(t, ReduceOp.AVG)
        got["allreduce"] = t
        t = x.clone()
        C.allreduce_inplace(t, ReduceOp.AVG, hierarchical=True)
        got["hierarchical"] = t
        t = x.clone()
        C.allreduce_inplace(t, ReduceOp.AVG, hierarchical=True, async_op=True).wait()
        got["hierarchical_async"] = t
        m = torch.zeros(4, 3, dtype=dt)  # a non-contiguous output (a column)
        C.allreduce(x, m[:, 1], ReduceOp.AVG, hierarchical=True, async_op=True).wait()
        got["hierarchical_async_column"] = m[:, 1].clone()
        out[f"{name}/column_neighbours_zero"] = bool((m[:, 0] == 0).all() and (m[:, 2] == 0).all())
        r = torch.zeros_like(x)
        C.reduce(x, r, ws - 1, ReduceOp.AVG)
        if rank == ws - 1:
            got["reduce"] = r
        rs_in = torch.cat([x] * ws)
        rs = torch.zeros_like(x)
        C.reduce_scatter(rs_in, rs, ReduceOp.AVG)
        got["reduce_scatter"] = rs
        for k, v in got.items():
            out[f"{name}/{k}"] = "ok" if torch.equal(v, want) else f"got {v.tolist()} want {want.tolist()}"
    C.destroy_process_group()
    return out


def reinit_keeping_groups(rank: int, ws: int) -> Dict[str, Any]:
    """Plain launch (rank 0 hosts the TCPStore): init, keep a group, destroy, init again, 3 times."""
    kept = []
    out: Dict[str, Any] = {"sums": []}
    for gen in range(3):
        pg = C.init_process_group(timeout=30)
        kept.append((pg, C.new_group([0, 1])))
        t = torch.full((3,), float(gen + rank))
        C.allreduce_inplace(t, comm=kept[-1][1].get_global_communicator())
        out["sums"].append(t.tolist())
        C.destroy_process_group()
    out["old_default"] = _expect(
        C.allreduce_inplace, CommError, torch.ones(2), comm=kept[0][0].get_global_communicator()
    )
    out["old_sub"] = _expect(
        C.broadcast, CommError, torch.ones(2), 0, comm=kept[1][1].get_global_communicator()
    )
    return out


def store_port_in_use(rank: int, ws: int) -> str:
    """Rank 0 of a plain launch cannot host the store: the port is taken. Raised at once, no timeout."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        os.environ.update(MASTER_PORT=str(s.getsockname()[1]), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        return _expect(C.init_process_group, CommError, timeout=30)


def store_host_gone(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 0 (the store host) is not in group [1, 2] and exits; 1 and 2 then ask for (which
    connects it) and use the group's communicator."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    C.init_process_group(timeout=20)
    pg = C.new_group([1, 2])
    if rank == 0:
        C.destroy_process_group()
        return {}
    store = C.group._STATE.store
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:  # until rank 0's process (and its store server) is gone
        try:
            store.check(["nothing"])
        except RuntimeError:
            break
        time.sleep(0.1)
    err = _expect(lambda: C.allreduce_inplace(torch.ones(2), comm=pg.get_global_communicator()), CommError)
    return {"error": err}


def p2p_exchange(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """isend + recv with the same peer (and the other mixes) on ``engine``: exact data, no deadlock."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    C.init_process_group(timeout=20)
    out: Dict[str, Any] = {"engine": C.get_default_group().get_global_communicator().cpu_engine_kind()}
    peer = rank ^ 1
    got = []
    for i in range(3):  # async send, then a synchronous receive from the same peer
        o = torch.zeros(4)
        w = C.send(torch.full((4,), float(10 * rank + i)), peer, async_op=True)
        C.recv(o, peer)
        w.wait()
        got.append(o.tolist())
    out["isend_recv"] = got
    # both asynchronous, then a collective on both their tensors waits for both: it sums the
    # received values, and the send sends the values from before it
    buf = torch.zeros(6)
    buf[:3] = float(rank + 5)
    ws_ = [C.send(buf[:3], peer, async_op=True), C.recv(buf[3:], peer, async_op=True)]
    C.allreduce_inplace(buf)
    out["isend_irecv_allreduce"] = (buf.tolist(), all(w.is_completed() for w in ws_))
    # asynchronous receive first, then a synchronous send
    o = torch.zeros(2)
    w = C.recv(o, peer, async_op=True)
    C.send(torch.full((2,), float(rank + 7)), peer)
    w.wait()
    out["irecv_send"] = o.tolist()
    # the same with a message of 4 MiB, over two pair buffers: the send waits for the peer's receive
    big = torch.empty(1 << 20)
    w = C.recv(big, peer, async_op=True)
    C.send(torch.arange(1 << 20, dtype=torch.float32) + 100 * peer + 100 * (1 - peer), peer)
    w.wait()
    out["irecv_send_big"] = torch.equal(big, torch.arange(1 << 20, dtype=torch.float32) + 100)
    # several sends in flight to the same peer keep their order
    outs = [torch.zeros(1) for _ in range(3)]
    sends = [C.send(torch.full((1,), float(k)), peer, async_op=True) for k in range(3)]
    for o in outs:
        C.recv(o, peer)
    for w in sends:
        w.wait()
    out["ordered"] = [o.item() for o in outs]
    C.destroy_process_group()
    return out


def sub_comm_timeout(rank: int, ws: int) -> Dict[str, Any]:
    """Group [1, 2] on gloo: global rank 2 skips the second allreduce; rank 1 names global rank 2."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "gloo"
    C.init_process_group(timeout=3)
    comm = C.new_group([1, 2]).get_global_communicator()
    C.allreduce_inplace(torch.ones(2), comm=comm)
    out: Dict[str, Any] = {}
    store = C.group._STATE.store
    if rank == 1:
        try:
            C.allreduce_inplace(torch.ones(2), comm=comm)
        except CommTimeoutError as exc:
            out["error"] = str(exc)
            out["attrs"] = (
                exc.op,  # type: ignore[attr-defined]
                exc.seq,  # type: ignore[attr-defined]
                exc.missing_ranks,  # type: ignore[attr-defined]
                exc.global_missing_ranks,  # type: ignore[attr-defined]
                exc.communicator,  # type: ignore[attr-defined]
            )
        store.set("sub_timeout_done", "1")
    else:
        store.wait(["sub_timeout_done"], datetime.timedelta(seconds=30))
    C.destroy_process_group()
    return out


def hier_timeout(rank: int, ws: int) -> Dict[str, Any]:
    """2x2 nodes: global rank 3 skips the second hierarchical allreduce. Rank 2 (waiting on the
    intra-node communicator) and rank 0 (on the inter-node one) name the global ranks they miss."""
    _two_nodes(rank, ws)
    C.init_process_group(timeout=3)
    C.allreduce_inplace(torch.ones(2), hierarchical=True)  # every engine connected
    out: Dict[str, Any] = {}
    store = C.group._STATE.store
    if rank != 3:
        try:
            C.allreduce_inplace(torch.ones(2), hierarchical=True)
        except CommError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["global_missing"] = getattr(exc, "global_missing_ranks", None)
        store.set(f"hier_timeout_done/{rank}", "1")
    else:
        store.wait([f"hier_timeout_done/{r}" for r in range(3)], datetime.timedelta(seconds=30))
    C.destroy_process_group()
    return out


def concurrent_first_ops(rank: int, ws: int, engine: str, rounds: int) -> List[str]:
    """Fresh communicators whose first operations are asynchronous, issued back to back (they would
    connect on two worker threads at once). Returns the failures (none expected)."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    torch.set_num_threads(1)
    C.init_process_group(timeout=20)
    bad: List[str] = []
    want = float(sum(range(1, ws + 1)))
    for i in range(rounds):
        a = C.new_group().get_global_communicator()
        b = C.new_group().get_global_communicator()
        x, y = torch.full((8,), rank + 1.0), torch.full((8,), 10.0 * (rank + 1))
        wa = C.allreduce_inplace(x, comm=a, async_op=True)
        wb = C.allreduce_inplace(y, comm=b, async_op=True)
        for name, w, t, v in (("a", wa, x, want), ("b", wb, y, 10 * want)):
            try:
                w.wait()
                if not bool((t == v).all()):
                    bad.append(f"round {i} {name}: {t[0].item()} != {v}")
            except CommError as exc:
                bad.append(f"round {i} {name}: {exc}")
        if bad:
            break
    C.destroy_process_group()
    return bad


def one_element_strided(rank: int, ws: int) -> Dict[str, Any]:
    """A one-element column view (stride 3; torch calls it contiguous) through gloo's byte paths."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "gloo"
    torch.set_num_threads(1)
    C.init_process_group(timeout=30)

    def col(v: float) -> Tuple[torch.Tensor, torch.Tensor]:
        m = torch.full((1, 3), 7.0)
        m[0, 1] = v
        return m, m[:, 1]

    out: Dict[str, Any] = {}
    m, c = col(rank + 1.0)
    C.broadcast(c, 1)
    out["broadcast"] = m.tolist()
    m, c = col(0.0)
    C.allreduce(torch.tensor([rank + 1.0]), c, hierarchical=True)
    out["hierarchical"] = m.tolist()
    m, c = col(0.0)
    C.allreduce(torch.tensor([rank + 1.0]), c, hierarchical=True, async_op=True).wait()
    out["hierarchical_async"] = m.tolist()
    m, c = col(rank + 5.0)
    C.send(c, 1) if rank == 0 else C.recv(c, 0)
    out["send_recv"] = m.tolist()
    C.destroy_process_group()
    return out


def special_views(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Conjugate and negative views (taken by their values) and an output whose elements share
    memory (refused before the data moves), through the API on one engine."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=20)
    out: Dict[str, Any] = {}
    base = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (rank + 1)
    z = base.clone().conj() if rank == 0 else base.conj().resolve_conj()  # rank 0 only: a conj view
    C.allreduce_inplace(z)
    out["conj_inplace"] = (z.is_conj(), z.tolist())
    g = torch.zeros(2 * ws, dtype=torch.complex64)
    C.allgather(base.conj(), g)  # a conjugate view sent
    out["conj_send"] = g.tolist()
    im = base.conj().imag  # a negative view: shows -imag
    C.allreduce_inplace(im)
    out["neg_inplace"] = (im.is_neg(), im.tolist())
    b = torch.tensor([7.0, 8.0])._neg_view() if rank == 0 else torch.zeros(2)._neg_view()
    C.broadcast(b, 0)  # a negative view received
    out["neg_recv"] = b.tolist()
    try:
        C.allreduce_inplace(torch.zeros(1).expand(4))
    except ValueError as exc:
        out["expanded"] = str(exc)
    # the in-place forms refuse it before any data moves (reduce_scatter_inplace used to fail in its
    # final copy, allgather_inplace named its internal recv_tensor); gather_inplace checks on dst:
    # each rank is its own dst here, so that every rank refuses
    refusing = {
        "allgather_inplace": lambda t: C.allgather_inplace(t),
        "reduce_scatter_inplace": lambda t: C.reduce_scatter_inplace(t),
        "gather_inplace": lambda t: C.gather_inplace(t, count=2, dst=rank),
    }
    for name, call in refusing.items():
        try:
            call(torch.zeros(1).expand(2 * ws))
        except ValueError as exc:
            out[f"expanded_{name}"] = str(exc)
    t = torch.ones(3)
    C.allreduce_inplace(t)  # the communicator is fine: nothing was sent
    out["after"] = t.tolist()
    C.destroy_process_group()
    return out


def two_issuing_threads(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """First :func:`send_beside_a_collective`. Then rank 0 starts a second collective from another
    thread while a thread's allreduce waits for rank 1 (which comes 1 s late): refused and the
    communicator aborted on every rank. (In this order: gloo keeps a process group whose operation
    is still in flight, and with it the store, so init_process_group() cannot follow it.)"""
    import threading

    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    out: Dict[str, Any] = send_beside_a_collective(rank)
    C.init_process_group(timeout=20)
    C.barrier()

    def first() -> None:
        try:
            C.allreduce_inplace(torch.ones(4))
            out["first"] = "no error"
        except CommError as exc:
            out["first"] = type(exc).__name__

    if rank == 0:
        th = threading.Thread(target=first, name="metrics")
        th.start()
        time.sleep(0.3)  # "metrics" is inside its allreduce, waiting for rank 1
        try:
            C.allreduce_inplace(torch.ones(4))
        except CommError as exc:
            out["second"] = str(exc)
        th.join(30)
    else:
        time.sleep(1.0)
        first()
    try:
        C.allreduce_inplace(torch.ones(4))
        out["after"] = "no error"
    except CommError as exc:
        out["after"] = type(exc).__name__
    C.destroy_process_group()
    return out


def send_beside_a_collective(rank: int) -> Dict[str, Any]:
    """Rank 0 sends 4 MiB to rank 1 on a thread (the send waits for rank 1's receive: more than the
    shared-memory engine's two pair buffers) and, while it waits, runs an allreduce on the main
    thread; rank 1 runs the allreduce, then receives. Both engines run the two at once (the
    shared-memory engine used to refuse the allreduce and abort the communicator)."""
    import threading

    C.init_process_group(timeout=20)
    C.barrier()
    comm = C.get_default_group().get_global_communicator()
    n = 1 << 20
    out: Dict[str, Any] = {}

    def outcome(fn: Any) -> str:
        try:
            fn()
        except CommError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    t = torch.ones(4)
    if rank == 0:
        box: Dict[str, str] = {}
        th = threading.Thread(target=lambda: box.update(send=outcome(lambda: C.send(torch.ones(n), 1))))
        th.start()
        if comm.cpu_engine_kind() == "shm":
            engine = comm._cpu._engine  # the send is in the engine once it published its first chunk
            while engine.p2p_info(0, 1)[0]["opkind"] == 0:
                time.sleep(0.001)
        else:
            time.sleep(0.2)  # (either order works on gloo)
        out["allreduce"] = outcome(lambda: C.allreduce_inplace(t))
        th.join(30)
        out["send"] = box["send"]
    else:
        out["allreduce"] = outcome(lambda: C.allreduce_inplace(t))
        if out["allreduce"] == "no error":
            big = torch.zeros(n)
            out["recv"] = outcome(lambda: C.recv(big, 0))
            out["received"] = bool((big == 1).all())
    out["t"] = t.tolist()
    C.destroy_process_group()
    return out


def p2p_recv_timeout(rank: int, ws: int) -> Dict[str, Any]:
    """Rank 0 receives from rank 1, which never sends (the other ranks are idle): the gloo timeout
    names the missing matching send, not every rank but the peer."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "gloo"
    C.init_process_group(timeout=3)
    C.barrier()
    out: Dict[str, Any] = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            C.recv(torch.zeros(4), 1)
        except CommError as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "missing": getattr(exc, "missing_ranks", "unset")}
        out["waited_the_timeout"] = time.monotonic() - t0 >= 2.9  # not one 0.2 s wait slice
    else:
        time.sleep(5)  # past rank 0's timeout, so that rank 0 never gets its send
    C.destroy_process_group()
    return out


def bagua_example_flow(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """The start of Bagua's examples/communication_primitives/main.py on 4 ranks: every rank takes
    the global communicator, then ranks 0/1 exchange with send/recv while ranks 2/3 go on to a
    collective. Plus the other names Bagua scripts use from its communication module."""
    import trainloom.comm.communication as B

    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    C.init_process_group(timeout=10)
    out: Dict[str, Any] = {}
    comm = B._get_default_group().get_global_communicator()  # Bagua connects here, collectively
    out["engine"] = comm.cpu_engine_kind()
    t = torch.zeros(3)
    if rank == 0:
        C.send(torch.full((3,), 4.0), 1, comm=comm)
    elif rank == 1:
        C.recv(t, 0, comm=comm)
    dist.barrier()  # ranks 2/3 reach a collective while 0/1 are still in their first operation
    out["recv"] = t.tolist()
    x = torch.ones(2) * (rank + 1)
    C.allreduce_inplace(x, comm=B.CommMember.WORLD)  # Bagua's alias of comm=None
    out["world"] = x.tolist()
    out["env"] = (B.get_rank(), B.get_world_size(), B.get_local_rank(), B.get_local_size())
    g = B.from_torch_group(dist.new_group([1]))  # every rank calls it, as Bagua's test does
    gc = g.get_global_communicator()
    out["from_torch_group"] = (g.ranks, gc is B.NON_COMM_MEMBER or (gc.rank(), gc.nranks()))
    out["object"] = B.broadcast_object({"from": rank} if rank == 1 else None, 1)
    C.destroy_process_group()
    return out


def neighbour_exchange(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """The halo exchange: receive from both ring neighbours, then send to both, all asynchronous,
    with messages larger than the shm pair channel; then both orders again with small ones."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = engine
    C.init_process_group(timeout=20)
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    out: Dict[str, Any] = {}
    for n in (1 << 20, 3):
        a, b = torch.zeros(n), torch.zeros(n)
        works = [C.recv(a, nxt, async_op=True), C.recv(b, prv, async_op=True)]
        works += [C.send(torch.full((n,), float(rank)), p, async_op=True) for p in (nxt, prv)]
        for w in works:
            w.wait()
        out[f"recv_first_{n}"] = (a.unique().tolist(), b.unique().tolist())
        works = [C.send(torch.full((n,), float(10 + rank)), p, async_op=True) for p in (prv, nxt)]
        works += [C.recv(b, prv, async_op=True), C.recv(a, nxt, async_op=True)]
        for w in works:
            w.wait()
        out[f"send_first_{n}"] = (a.unique().tolist(), b.unique().tolist())
    C.destroy_process_group()
    return out


def getter_on_one_rank(rank: int, ws: int) -> Dict[str, Any]:
    """Only rank 0 asks for the global communicator: its connection times out, saying why."""
    C.init_process_group(timeout=3)
    out: Dict[str, Any] = {}
    if rank == 0:
        out["error"] = _expect(C.get_default_group().get_global_communicator, CommTimeoutError)
    else:
        time.sleep(5)
    return out


def script_patterns(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Tensors and call patterns of real training scripts (found by a probe): a reshaped output,
    reduce_scatter into its own buffer, asynchronous results into non-contiguous views without a
    wait(), tensors made under inference_mode, op numbers after sends, a child made by os.fork()."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=20)
    out: Dict[str, Any] = {"engine": C.get_default_group().get_global_communicator().cpu_engine_kind()}
    total = float(sum(range(1, ws + 1)))
    # recv of another shape, same count (gloo broadcast send's shape onto recv's and failed)
    g = torch.full((2, 4), float(rank + 1))
    flat = torch.zeros(8)
    C.allreduce(g, flat)
    red = torch.zeros(8)
    C.reduce(g, red, 0)
    out["reshaped"] = (flat.tolist(), red.tolist())
    # reduce_scatter into a chunk of its own send buffer (shm refused it on some ranks only)
    buf = torch.arange(4.0 * ws) + rank
    C.reduce_scatter(buf, buf[0:4])
    out["rs_own_chunk"] = buf[0:4].tolist()
    # asynchronous results into non-contiguous views: done when is_completed() says so, after a later
    # synchronous call, and at destroy, without a wait()
    m = torch.full((4, 3), float(rank + 1))
    w = C.allreduce_inplace(m[:, 0], async_op=True)
    deadline = time.monotonic() + 20
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    out["completed_col"] = m[:, 0].tolist()
    C.allreduce_inplace(m[:, 1], async_op=True)
    C.barrier()
    out["after_barrier_col"] = m[:, 1].tolist()
    h = torch.full((4, 2), float(rank + 1))
    w = C.allreduce(h[:, 0], h[:, 0], async_op=True, hierarchical=True)
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    out["hier_col"] = h[:, 0].tolist()
    s = torch.full((2, 2 * ws), float(rank + 1)).t()  # reduce_scatter_inplace on a transposed view
    w = C.reduce_scatter_inplace(s, async_op=True)
    while not w.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    out["rs_inplace_view"] = s.tolist()
    # composite operations unpack their results after the exchange (the early torch.distributed list
    # API, ColossalAI's all_gather along a dim, Bluefog's neighbour ops): done when is_completed()
    # says so and after a later barrier, without a wait(); also for tensors made under inference_mode
    import trainloom.comm.classic as tdist
    from trainloom.comm import colossal, neighbor
    from trainloom.comm.topology import RingGraph, set_topology

    def _done(work: Any) -> None:
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)

    mine = torch.full((2,), float(rank + 1))
    outs = [torch.zeros(2) for _ in range(ws)]
    _done(tdist.all_gather(outs, mine, async_op=True))
    gathered = [torch.zeros(2) for _ in range(ws)] if rank == 0 else None
    tdist.gather(mine, 0, gathered, async_op=True)
    C.barrier()
    cat, w = colossal.all_gather(mine.view(2, 1), dim=1, async_op=True)
    _done(w)
    out["composite_lists"] = (
        [o.tolist() for o in outs],
        [o.tolist() for o in gathered] if gathered is not None else None,
        cat.tolist(),
    )
    set_topology(RingGraph(ws))  # with 3 ranks every rank is a neighbour: the mean of all ranks
    small = neighbor.neighbor_allreduce_async(torch.full((3,), float(rank + 1)))  # allgather path
    large = neighbor.neighbor_allreduce_async(torch.full((16384,), float(rank + 1)))  # exchange path
    with torch.inference_mode():
        inf = neighbor.neighbor_allreduce_async(torch.full((3,), float(rank + 1)))
    for w in (small, large, inf):
        _done(w)
    out["composite_neighbor"] = [sorted(set(w.tensor.tolist())) for w in (small, large, inf)]
    # a call issued while an earlier asynchronous call that writes its tensor is pending reads the
    # written values (the copies made at issue time read the old ones)
    x = torch.full((2 * ws,), float(rank + 1))
    C.allreduce_inplace(x, async_op=True)
    C.reduce_scatter_inplace(x)  # clones x
    y = torch.full((2 * ws,), float(rank + 1))
    C.allreduce_inplace(y, async_op=True)
    C.alltoall_inplace(y)  # clones y
    col = torch.full((4, 2), float(rank + 1))[:, 0]
    C.allreduce_inplace(col, async_op=True)
    C.allreduce_inplace(col, async_op=True).wait()  # stages the column: a contiguous copy
    wide = torch.full((2, 2 * ws), float(rank + 1))
    colossal.all_reduce(wide, async_op=True)
    part = colossal.reduce_scatter(wide, dim=1)  # copies it into rank-major rows
    z = torch.full((3,), float(rank + 1))
    C.allreduce_inplace(z, async_op=True)
    mean = neighbor.neighbor_allreduce(z)  # its own term
    out["after_pending"] = [
        x.view(ws, 2)[rank].tolist(),
        sorted(set(y.tolist())),
        col.tolist(),
        sorted(set(part.flatten().tolist())),
        sorted(set(mean.tolist())),
    ]
    # eval metrics made under inference_mode, reduced outside it
    with torch.inference_mode():
        conf = torch.full((3, 3), float(rank + 1))
    C.allreduce_inplace(conf.t())
    C.broadcast(conf[:, 0], 0)
    out["inference"] = conf.tolist()
    # collectives keep equal numbers on every rank after sends and receives
    if ws >= 2 and rank in (0, 1):
        for _ in range(3):
            if rank == 0:
                C.send(torch.ones(2), 1)
            else:
                C.recv(torch.zeros(2), 0)
    comm = C.get_default_group().get_global_communicator()
    if engine == "shm":
        seq = torch.tensor([float(comm._cpu._seq)])
        seqs = torch.zeros(ws)
        C.allgather(seq, seqs)
        out["seqs"] = seqs.tolist()
    # a child forked after init that exits normally (atexit) must leave the parent's rank open
    if rank == 0:
        pid = os.fork()
        if pid == 0:
            from trainloom.comm import group

            group._destroy_at_exit()  # what the child's interpreter exit runs
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(0.5)  # the other ranks wait for this one in the next collective
    t = torch.ones(2)
    try:
        C.allreduce_inplace(t)
        out["after_fork"] = t.tolist()
    except CommError as exc:
        out["after_fork"] = f"{type(exc).__name__}: {exc}"
    last = m[:, 2]
    C.allreduce_inplace(last, async_op=True)  # never waited
    C.destroy_process_group()
    out["destroyed_col"] = last.tolist()
    out["total"] = total
    return out


def gloo_p2p_mismatch(rank: int, ws: int) -> Dict[str, Any]:
    """Sends and receives that disagree on the number of elements or the dtype, on gloo: both ranks
    raise before any data moves, and the pair (and the collectives) go on afterwards."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "gloo"
    C.init_process_group(timeout=10)
    out: Dict[str, Any] = {"engine": C.get_default_group().get_global_communicator().cpu_engine_kind()}
    peer = 1 - rank
    # rank 0 sends 3 float32, rank 1 expects 5
    got = torch.full((5,), -1.0)
    if rank == 0:
        out["size"] = _expect(C.send, CommError, torch.ones(3), peer)
    else:
        out["size"] = _expect(C.recv, CommError, got, peer)
        out["size_recv_untouched"] = got.tolist()
    # rank 0 sends 4 float32, rank 1 expects 4 float64
    got = torch.full((4,), -1.0, dtype=torch.float64)
    if rank == 0:
        out["dtype"] = _expect(C.send, CommError, torch.ones(4), peer)
    else:
        out["dtype"] = _expect(C.recv, CommError, got, peer)
        out["dtype_recv_untouched"] = got.tolist()
    # the other direction, asynchronous on both sides: the error comes from Work.wait()
    got = torch.full((6,), -1, dtype=torch.int64)
    if rank == 1:
        w = C.send(torch.ones(2, dtype=torch.int64), peer, async_op=True)
    else:
        w = C.recv(got, peer, async_op=True)
    out["async"] = _expect(w.wait, CommError)
    # the pair still works both ways (another shape with the same count is accepted) ...
    after = []
    for sender in (0, 1):
        got = torch.zeros(6)
        if rank == sender:
            C.send(torch.arange(6.0).view(2, 3) + 10 * rank, peer)
        else:
            C.recv(got, peer)
            after.append(got.tolist())
    out["after_p2p"] = after
    # ... and so do the collectives (their numbers stayed in step)
    t = torch.full((2,), float(rank + 1))
    C.allreduce_inplace(t)
    out["after_allreduce"] = t.tolist()
    C.destroy_process_group()
    return out


def reduce_views(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """reduce and reduce_inplace (SUM, to rank 1) on non-contiguous tensors: a transposed view and a
    matrix column, as input and output, synchronous and asynchronous. Every rank returns the whole
    matrices behind the views: the root's view holds the sum and its neighbours are untouched; on the
    other ranks nothing is written."""
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    C.init_process_group(timeout=20)
    out: Dict[str, Any] = {"engine": C.get_default_group().get_global_communicator().cpu_engine_kind()}
    root = 1
    base = reduce_views_input(rank)
    # in place on a transposed view
    m = base.clone()
    C.reduce_inplace(m.t(), root)
    out["inplace_t"] = m.tolist()
    # in place on a column (asynchronous: the copy back is part of the operation)
    m = base.clone()
    C.reduce_inplace(m[:, 1], root, async_op=True).wait()
    out["inplace_col"] = m.tolist()
    # out of place: a transposed view into a transposed view, a column into a column
    m = base.clone()
    dst = torch.full((4, 3), -1.0)
    C.reduce(m.t(), dst.t(), root)
    out["t_to_t"] = (m.tolist(), dst.tolist())
    dst = torch.full((4, 3), -1.0)
    C.reduce(m[:, 0], dst[:, 2], root)
    out["col_to_col"] = (m.tolist(), dst.tolist())
    C.destroy_process_group()
    return out


def reduce_views_input(rank: int) -> torch.Tensor:
    """A 4 x 3 matrix with different values on every rank and in every element."""
    return torch.arange(12.0).view(4, 3) * (rank + 1) + 100 * rank
