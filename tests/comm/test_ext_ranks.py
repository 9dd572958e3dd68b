"""Rank functions for the tests of neighbour collectives, state broadcast and the collective styles.

They run on every rank under tests/multiproc.run_ranks and return plain data; the tests compare it
with references computed in the parent. This module holds no tests itself.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

import trainloom.comm as C
from trainloom.comm import neighbor as nb
from trainloom.comm import state as st
from trainloom.comm import topology as tp
from trainloom.errors import CommError


def _expect(fn: Callable, exc: type, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except exc as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _engine(engine: str) -> None:
    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    # The forkserver imported torch before OMP_NUM_THREADS=1 was set: intra-op threads on 2 shared
    # cores made a tiny backward take ~30 ms.
    torch.set_num_threads(1)


def value(rank: int, shape=(2, 3), dtype=torch.float64) -> torch.Tensor:
    """Each rank's input: distinct, exactly representable values."""
    return (torch.arange(6, dtype=dtype).reshape(shape) + 10.0 * rank + 1.0).to(dtype)


def topologies(ws: int) -> Dict[str, tp.Topology]:
    """The topologies every neighbour test runs (same objects built in the parent for references)."""
    out = {"ring": tp.RingGraph(ws), "exp2": tp.ExponentialTwoGraph(ws), "full": tp.FullyConnectedGraph(ws)}
    if ws > 1:
        # A weighted directed graph: rank j receives from j-1 with 0.25 and (for ws > 2) from j+1 with 0.15.
        edges = {((j - 1) % ws, j): 0.25 for j in range(ws)}
        selfw = [0.75] * ws
        if ws > 2:
            for j in range(ws):
                edges[((j + 1) % ws, j)] = 0.15
            selfw = [0.6] * ws
        out["custom"] = tp.Topology.from_edges(ws, edges, self_weights=selfw)
    return out


def neighbor_suite(rank: int, ws: int, engine: str, strategy: str = "auto") -> Dict[str, Any]:
    _engine(engine)
    os.environ["TRAINLOOM_NEIGHBOR_EXCHANGE"] = strategy
    C.init_process_group(timeout=30)
    out: Dict[str, Any] = {"engine": C.get_default_group().get_global_communicator().cpu_engine_kind()}
    x = value(rank)
    for name, topo in topologies(ws).items():
        tp.set_topology(topo, is_weighted=name == "custom")
        out[f"{name}/in"] = tp.in_neighbor_ranks()
        out[f"{name}/avg"] = nb.neighbor_allreduce(x).tolist()
        out[f"{name}/gather"] = nb.neighbor_allgather(x).tolist()
        ins = tp.in_neighbor_ranks()
        if ins:
            # explicit weights: everything on the first in-neighbour and self
            w = {ins[0]: 0.3}
            out[f"{name}/explicit"] = nb.neighbor_allreduce(x, self_weight=0.7, neighbor_weights=w).tolist()
        h1 = nb.neighbor_allreduce_async(x.float(), name="a")
        h2 = nb.neighbor_allgather_async(x[0], name="b")
        out[f"{name}/async"] = [nb.synchronize(h1).tolist(), nb.synchronize(h2).tolist(), nb.poll(h1)]
        # half precision accumulates in float32
        out[f"{name}/bf16"] = nb.neighbor_allreduce(x.to(torch.bfloat16)).float().tolist()
    x_in = x.clone()
    out["input_unchanged"] = torch.equal(x, x_in)
    # functional forms
    out["allreduce"] = nb.allreduce(x).tolist()
    out["allreduce_sum"] = nb.allreduce(x, average=False).tolist()
    y = x.clone()
    out["allreduce_"] = nb.allreduce_(y) is y and y.tolist()
    out["allgather"] = nb.allgather(x).tolist()
    out["broadcast"] = nb.broadcast(x, ws - 1).tolist()
    z = x.clone()
    nb.broadcast_(z, 0)
    out["broadcast_"] = z.tolist()
    h = nb.allreduce_async(torch.tensor([1, 2]) * (rank + 1), average=False)
    out["allreduce_async_int"] = nb.synchronize(h).tolist()
    nb.barrier()
    C.destroy_process_group()
    return out


def neighbor_errors(rank: int, ws: int) -> Dict[str, Any]:
    C.init_process_group(timeout=20)
    tp.set_topology(tp.RingGraph(ws, connect_style=2))  # Bluefog's "right connection": in-neighbour rank - 1
    x = torch.ones(3)
    left, right = (rank - 1) % ws, (rank + 1) % ws
    out = {
        "not_neighbor": _expect(nb.neighbor_allreduce, ValueError, x, 0.5, {right: 0.5}),
        "nan": _expect(nb.neighbor_allreduce, ValueError, x, float("nan"), {left: 0.5}),
        "inf": _expect(nb.neighbor_allreduce, ValueError, x, 0.5, {left: float("-inf")}),
        "weight_type": _expect(nb.neighbor_allreduce, TypeError, x, 0.5, {left: "0.5"}),
        "both": _expect(nb.neighbor_allreduce, TypeError, x, 0.5, {left: 0.5}, src_weights={left: 0.5}),
        "src_not_neighbor": _expect(nb.neighbor_allreduce, ValueError, x, 0.5, src_weights={right: 0.5}),
        "one_only": _expect(nb.neighbor_allreduce, ValueError, x, 0.5),
        "int": _expect(nb.neighbor_allreduce, TypeError, torch.ones(3, dtype=torch.int64)),
        "not_tensor": _expect(nb.neighbor_allgather, TypeError, [1.0]),
        "weights_type": _expect(nb.neighbor_allreduce, TypeError, x, 0.5, [0.5]),
        "key_type": _expect(nb.neighbor_allreduce, TypeError, x, 0.5, {"1": 0.5}),
        "poll": _expect(nb.poll, TypeError, 3),
        "synchronize": _expect(nb.synchronize, TypeError, None),
        "size": _expect(tp.set_topology, ValueError, tp.RingGraph(ws + 1)),
        "topo_type": _expect(tp.set_topology, TypeError, [[1.0]]),
        "avg_int": _expect(nb.allreduce, TypeError, torch.ones(2, dtype=torch.int32)),
        "comm_type": _expect(nb.allreduce, TypeError, x, True, None, "default"),
        "right": right,
    }
    # shapes that differ between ranks: every rank raises CommError naming both
    out["shape_mismatch"] = _expect(nb.neighbor_allreduce, CommError, torch.ones(4 + 4 * rank))
    # topologies that differ between ranks (a fresh group: the failed communicator refuses calls)
    pg = C.new_group()
    os.environ["TRAINLOOM_NEIGHBOR_EXCHANGE"] = "exchange"  # allgather mode reads only in-neighbours
    tp.set_topology(tp.RingGraph(ws, connect_style=1 + rank % 2), comm=pg)
    out["topo_mismatch"] = _expect(nb.neighbor_allreduce, CommError, torch.ones(4), comm=pg)
    C.destroy_process_group()
    return out


def overlap(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Two handles in flight at once on rank 0: the other ranks only join once rank 0 saw both pending."""
    _engine(engine)
    C.init_process_group(timeout=20)
    tp.set_topology(tp.RingGraph(ws))
    store = dist.distributed_c10d._get_default_store()
    x = torch.full((1000,), float(rank))
    out: Dict[str, Any] = {}
    nb.barrier()  # creates the engine on every rank
    if rank == 0:
        h1 = nb.allreduce_async(x)
        h2 = nb.neighbor_allreduce_async(x)
        # (the engine exists already: creating it would need the store, which the main thread uses)
        out["both_pending"] = (not nb.poll(h1)) and (not nb.poll(h2)) and not h1.is_completed()
        # compute while the operations wait for the peers
        a = torch.randn(64, 64)
        out["computed"] = float((a @ a).trace()) != 0.0 or True
        store.set("ext/overlap/go", "1")
    else:
        try:
            store.get("ext/overlap/go")  # blocks until rank 0 has checked
        except dist.DistStoreError as exc:
            return {"error": f"rank 0 never saw both handles pending: {exc}"}
        h1 = nb.allreduce_async(x)
        h2 = nb.neighbor_allreduce_async(x)
    try:
        out["r1"] = nb.synchronize(h1)[:2].tolist()
        h2.wait()
        out["r2"] = h2.result()[:2].tolist()
        out["done"] = nb.poll(h1) and nb.poll(h2)
    except CommError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    C.destroy_process_group()
    return out


def world_one(rank: int, ws: int) -> Dict[str, Any]:
    C.init_process_group()
    x = value(0)
    out = {
        "in": tp.in_neighbor_ranks(),
        "avg": nb.neighbor_allreduce(x).tolist(),
        "gather": list(nb.neighbor_allgather(x).shape),
        "allreduce": nb.allreduce(x).tolist(),
        "allgather": nb.allgather(x).tolist(),
        "broadcast": nb.broadcast(x, 0).tolist(),
        "poll": nb.poll(nb.neighbor_allreduce_async(x)),
    }
    m = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in m.parameters()]
    st.broadcast_parameters(m.state_dict(), 0)
    opt = torch.optim.Adam(m.parameters())
    st.broadcast_optimizer_state(opt, 0)
    out["params_same"] = all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    from trainloom.comm import windows as win

    w = torch.arange(3.0)
    win.win_create(w, "one")
    win.win_put(w, "one")
    out["win"] = win.win_sync("one").tolist()
    win.win_free()
    C.destroy_process_group()
    return out


# ---------------------------------------------------------------------------- state
def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    m.register_buffer("counter", torch.tensor([seed], dtype=torch.int64))
    return m


def _flat(m: torch.nn.Module) -> List[List[float]]:
    return [t.detach().double().reshape(-1).tolist() for t in m.state_dict().values()]


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    xb = torch.randn(5, 4, generator=g)
    opt.zero_grad()
    m(xb).square().sum().backward()
    opt.step()


def state_suite(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    _engine(engine)
    C.init_process_group(timeout=30)
    out: Dict[str, Any] = {}
    root = ws - 1
    m = _model(100 + rank)
    st.broadcast_parameters(m.state_dict(), root)
    out["state_dict"] = _flat(m)
    m2 = _model(200 + rank)
    st.broadcast_parameters(m2.named_parameters(), 0)
    out["named"] = [p.detach().reshape(-1).tolist() for p in m2.parameters()]
    out["named_buffer_untouched"] = int(m2.counter.item())
    m3 = _model(300 + rank)
    st.broadcast_parameters(list(m3.parameters()), 0)
    out["list"] = [p.detach().reshape(-1).tolist() for p in m3.parameters()]
    # a non-contiguous tensor in a dict
    d = {"t": (torch.arange(6.0).view(2, 3) + rank).t(), "i": torch.tensor([rank, rank])}
    st.broadcast_parameters(d, 0)
    out["dict"] = [d["t"].tolist(), d["i"].tolist()]
    # optimizer state: the root has stepped (state full), the others have not (state empty)
    for kind in ("adam", "sgd", "rmsprop", "adamw_capturable_off"):
        m = _model(7)
        if kind == "adam":
            opt = torch.optim.Adam(m.parameters(), lr=0.01 * (rank + 1), betas=(0.8, 0.9))
        elif kind == "sgd":
            opt = torch.optim.SGD(m.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
        elif kind == "rmsprop":
            opt = torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5)
        else:
            opt = torch.optim.AdamW(m.parameters(), lr=0.01, amsgrad=True)
        if rank == 0:
            _step(m, opt, 1)
            _step(m, opt, 2)
        st.broadcast_parameters(m.state_dict(), 0)
        st.broadcast_optimizer_state(opt, 0)
        sd = opt.state_dict()
        out[f"{kind}/lr"] = sd["param_groups"][0]["lr"]
        out[f"{kind}/nstate"] = len(sd["state"])
        _step(m, opt, 3)  # the same step everywhere now gives the same parameters and state
        out[f"{kind}/params"] = _flat(m)
        out[f"{kind}/state"] = {
            str(k): {n: (v.double().reshape(-1).tolist() if torch.is_tensor(v) else v) for n, v in s.items()}
            for k, s in opt.state_dict()["state"].items()
        }
    out["object"] = st.broadcast_object({"a": [1, 2], "rank": rank}, 0)
    # bad inputs, same on every rank
    out["bad_params"] = _expect(st.broadcast_parameters, TypeError, torch.ones(2), 0)
    out["bad_entry"] = _expect(st.broadcast_parameters, TypeError, [torch.ones(1), 3], 0)
    out["bad_pair"] = _expect(st.broadcast_parameters, TypeError, ["w"], 0)
    out["bad_root"] = _expect(st.broadcast_parameters, ValueError, [torch.ones(1)], ws)
    out["bad_root_type"] = _expect(st.broadcast_parameters, TypeError, [torch.ones(1)], "0")
    out["bad_opt"] = _expect(st.broadcast_optimizer_state, TypeError, object(), 0)
    # layouts that differ: every rank raises
    shape = (3,) if rank == 0 else (4,)
    out["layout"] = _expect(st.broadcast_parameters, CommError, {"w": torch.ones(shape)}, 0)
    mm = torch.nn.Linear(2, 2)
    params = list(mm.parameters()) if rank == 0 else [mm.weight]
    out["opt_layout"] = _expect(st.broadcast_optimizer_state, CommError, torch.optim.SGD(params, lr=0.1), 0)
    C.destroy_process_group()
    return out


def late_neighbor(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Rank 1 never calls neighbor_allreduce: the others time out instead of hanging."""
    _engine(engine)
    C.init_process_group(timeout=3)
    tp.set_topology(tp.RingGraph(ws))
    nb.barrier()  # every rank has joined the engine; only the neighbour operation is missing
    if rank == 1:
        time.sleep(4.5)  # longer than the 3 s timeout
        return {}
    t0 = time.monotonic()
    err = _expect(nb.neighbor_allreduce, CommError, torch.ones(8))
    return {"error": err, "seconds": time.monotonic() - t0}


# ---------------------------------------------------------------------------- ColossalAI and classic forms
def styles_suite(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    from trainloom.comm import classic as cd
    from trainloom.comm import colossal as col

    _engine(engine)
    cd.init_process_group("gloo", timeout=30)
    out: Dict[str, Any] = {"rank": cd.get_rank(), "ws": cd.get_world_size(), "init": cd.is_initialized()}
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * rank
    for d in (0, 1, 2, -1):
        out[f"ag{d}"] = col.all_gather(x, d).tolist()
        y = torch.cat([x] * ws, dim=d) * (rank + 1)  # shape[d] divisible by ws
        out[f"rs{d}"] = col.reduce_scatter(y, d).tolist()
    t, w = col.all_gather(x, 1, async_op=True)
    w.wait()
    out["ag_async"] = t.tolist()
    t, w = col.reduce_scatter(torch.ones(2, 2 * ws), 1, op=dist.ReduceOp.MAX, async_op=True)
    out["rs_async"] = [nb.synchronize(w) is t, t.tolist()]
    out["all_reduce"] = col.all_reduce(torch.full((2,), rank + 1.0)).tolist()
    t, w = col.all_reduce(torch.full((2,), rank + 1.0), op=C.ReduceOp.MAX, async_op=True)
    out["all_reduce_async"] = [w.wait(), t.tolist()]
    out["broadcast"] = col.broadcast(torch.full((2,), float(rank)), ws - 1).tolist()
    out["reduce"] = col.reduce(torch.full((2,), float(rank)), 0).tolist()
    pg = C.new_group([0, ws - 1])
    col.register_parallel_mode("pair", pg)
    if rank in (0, ws - 1):
        out["mode"] = col.all_reduce(torch.ones(1), "pair").tolist()
        out["mode_bcast"] = col.broadcast(torch.full((1,), float(rank)), ws - 1, "pair").tolist()
    out["bad_dim"] = _expect(col.all_gather, ValueError, x, 3)
    out["bad_div"] = _expect(col.reduce_scatter, ValueError, torch.ones(ws + 1), 0)
    out["bad_0d"] = _expect(col.reduce_scatter, ValueError, torch.tensor(1.0), 0)
    out["bad_mode"] = _expect(col.all_reduce, ValueError, torch.ones(1), "tensor")
    out["bad_src"] = _expect(col.broadcast, ValueError, torch.ones(1), ws)

    # classic: isend/irecv ring, recv from any source, list-based collectives
    right, left = (rank + 1) % ws, (rank - 1) % ws
    sbuf = torch.full((3,), float(rank))
    rbuf = torch.empty(3)
    # odd ranks receive first: crossing sends would wait for each other on the gloo engine
    if rank % 2 == 0:
        reqs = [cd.isend(sbuf, right), cd.irecv(rbuf, left)]
    else:
        reqs = [cd.irecv(rbuf, left), cd.isend(sbuf, right)]
    for r in reqs:
        r.wait()
    out["ring"] = [rbuf.tolist(), all(r.is_completed() for r in reqs)]
    if rank == 0:
        senders = []
        for _ in range(ws - 1):
            buf = torch.empty(2)
            s = cd.recv(buf)
            senders.append((s, buf.tolist()))
        out["any"] = sorted(senders)
    else:
        cd.send(torch.full((2,), float(rank)), 0)
    # (a message sent before the barrier could be matched by either any-source recv: MPI semantics)
    cd.barrier()
    if rank == 0:
        # an explicit src after any-source receives; then any-source skips the announcement it consumed
        buf = torch.empty(1)
        out["explicit"] = cd.recv(buf, src=ws - 1), buf.tolist()
        buf = torch.empty(3)
        out["any_after"] = cd.recv(buf), buf.tolist()
    elif rank == ws - 1:
        cd.send(torch.full((1,), 42.0), 0)
        cd.send(torch.full((3,), 7.0), 0)
    cd.barrier()
    # a refused isend announces nothing and a refused irecv skips nothing: any-source receives that
    # follow get every real message (a phantom announcement paired them with the wrong sender)
    sparse = torch.ones(2).to_sparse()
    if rank == 0:
        got = []
        for _ in range(ws - 1):
            buf = torch.empty(2)
            got.append((cd.recv(buf), buf.tolist()))
        out["after_refused_isend"] = sorted(got)
    else:
        if rank == ws - 1:
            out["refused_isend"] = _expect(cd.isend, TypeError, sparse, 0)
        cd.send(torch.full((2,), 10.0 * rank), 0)
    cd.barrier()
    if rank == 0:
        out["refused_irecv"] = _expect(cd.irecv, TypeError, sparse, 1)
        buf = torch.empty(2)
        out["after_refused_irecv"] = (cd.recv(buf), buf.tolist())
    elif rank == 1:
        cd.send(torch.full((2,), 5.0), 0)
    cd.barrier()
    lst = [torch.empty(2, 2) for _ in range(ws)]
    cd.all_gather(lst, torch.full((2, 2), float(rank)))
    out["all_gather"] = [t[0, 0].item() for t in lst]
    if rank == 0:
        gl = [torch.empty(3) for _ in range(ws)]
        cd.gather(torch.full((3,), rank * 2.0), dst=0, gather_list=gl)
        out["gather"] = [t.tolist() for t in gl]
        recv = torch.empty(2)
        cd.scatter(recv, src=0, scatter_list=[torch.full((2,), 10.0 * i) for i in range(ws)])
    else:
        cd.gather(torch.full((3,), rank * 2.0), dst=0)
        recv = torch.empty(2)
        cd.scatter(recv, src=0)
    out["scatter"] = recv.tolist()
    t = torch.full((2,), float(rank + 1))
    cd.all_reduce(t, cd.reduce_op.MAX)
    out["c_all_reduce"] = t.tolist()
    t = torch.full((2,), float(rank + 1))
    w = cd.reduce(t, ws - 1, async_op=True)
    w.wait()
    out["c_reduce"] = t.tolist()
    t = torch.full((2,), float(rank))
    cd.broadcast(t, ws - 1)
    out["c_broadcast"] = t.tolist()
    out["c_bad_list"] = _expect(cd.all_gather, ValueError, [torch.empty(2)], torch.empty(2))
    out["c_bad_numel"] = _expect(cd.all_gather, ValueError, [torch.empty(3)] * ws, torch.empty(2))
    out["c_gather_list"] = _expect(cd.gather, ValueError, torch.empty(1), dst=rank)
    out["c_scatter_other"] = _expect(
        cd.scatter, ValueError, torch.empty(1), src=(rank + 1) % ws, scatter_list=[torch.empty(1)] * ws
    )
    out["c_self"] = _expect(cd.isend, ValueError, torch.empty(1), rank)
    out["c_backend"] = _expect(cd.init_process_group, Exception, "ucc")
    cd.destroy_process_group()
    return out


def classic_world_one(rank: int, ws: int) -> Dict[str, Any]:
    from trainloom.comm import classic as cd
    from trainloom.comm import colossal as col

    cd.init_process_group()
    x = torch.arange(6.0).reshape(2, 3)
    out = {
        "ag": col.all_gather(x, 1).tolist(),
        "rs": col.reduce_scatter(x, 1).tolist(),
        "any": _expect(cd.recv, ValueError, torch.empty(1)),
    }
    lst = [torch.empty(2, 3)]
    cd.all_gather(lst, x)
    out["list"] = lst[0].tolist()
    cd.destroy_process_group()
    return out


def classic_timeout(rank: int, ws: int) -> Dict[str, Any]:
    from trainloom.comm import classic as cd

    cd.init_process_group(timeout=2)
    out: Dict[str, Any] = {}
    if rank == 0:
        t0 = time.monotonic()
        out["error"] = _expect(cd.recv, Exception, torch.empty(1))
        out["seconds"] = time.monotonic() - t0
    cd.destroy_process_group()
    return out


def classic_mixed_apis(rank: int, ws: int, engine: str) -> Dict[str, Any]:
    """Announced (classic) and unannounced (Bagua-style) messages from one sender, received with
    an explicit src by either API and with any-source receives (ws >= 3). Every receive has a short
    timeout: a mismatch shows as a CommTimeoutError in the result instead of a hang."""
    from trainloom.comm import classic as cd

    _engine(engine)
    cd.init_process_group("gloo", timeout=5)
    cd.barrier()  # engines exist before any-source receives wait in store.get
    last = ws - 1
    out: Dict[str, Any] = {}

    def take(fn: Callable[[], Any], buf: torch.Tensor) -> Any:
        try:
            got = fn()
        except CommError as e:
            return f"{type(e).__name__}: {e}"
        return [got, buf.tolist()]

    # 1. An unannounced message taken by classic's recv(src=) does not make the next any-source
    #    receive pass over a real announcement (it did: that receive waited until the timeout).
    if rank == 0:
        b1, b2 = torch.empty(1), torch.empty(2)
        out["classic_src_bagua_msg"] = take(lambda: cd.recv(b1, src=last), b1)
        out["any_after_it"] = take(lambda: cd.recv(b2), b2)
        out["bagua_src_bagua_msg"] = take(lambda: C.recv(b1, last), b1)
        out["any_after_that"] = take(lambda: cd.recv(b2), b2)
    elif rank == last:
        C.send(torch.full((1,), 1.0), 0)
        cd.send(torch.full((2,), 2.0), 0)
        C.send(torch.full((1,), 3.0), 0)
        cd.send(torch.full((2,), 4.0), 0)
    cd.barrier()
    # 2. An announced message taken by a Bagua-style recv(src): a later any-source receive passes
    #    over its announcement and takes another sender's message (it waited on the first sender).
    if rank == 0:
        b1, b2 = torch.empty(1), torch.empty(2)
        out["bagua_src_announced"] = take(lambda: C.recv(b1, last), b1)
    elif rank == last:
        cd.send(torch.full((1,), 5.0), 0)
    cd.barrier()
    if rank == 0:
        out["any_other_sender"] = take(lambda: cd.recv(b2), b2)
    elif rank == 1:
        cd.send(torch.full((2,), 6.0), 0)
    cd.barrier()
    cd.destroy_process_group()
    return out


# ---------------------------------------------------------------------------- distributed optimizers
def regression_data(ws: int):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, 1, generator=g, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(96, 1, generator=g, dtype=torch.float64)
    return x, y


def regression_model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1)).double()


def train(rank: int, ws: int, engine: str, mode: str, topo: str, steps: int = 25) -> Dict[str, Any]:
    from trainloom.comm import optimizers as dopt

    _engine(engine)
    C.init_process_group(timeout=30)
    x, y = regression_data(ws)
    # different data on every rank
    xs, ys = x.chunk(ws)[rank], y.chunk(ws)[rank]
    model = regression_model()
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # broadcast_parameters must fix this
    st.broadcast_parameters(model.state_dict(), 0)
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    if mode == "local":
        opt = base
    elif mode == "allreduce":
        opt = dopt.DistributedAllreduceOptimizer(base, model.named_parameters(), bucket_bytes=64)
    else:
        tp.set_topology(tp.RingGraph(ws) if topo == "ring" else tp.ExponentialTwoGraph(ws))
        opt = dopt.DistributedNeighborAllreduceOptimizer(base, model.named_parameters(), bucket_bytes=64)
    out: Dict[str, Any] = {"isinstance": isinstance(opt, torch.optim.SGD)}
    overlap = []
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
        if mode != "local":
            overlap.append(opt._tl_reducer.launched_in_backward)
    with torch.no_grad():
        out["loss"] = float(torch.nn.functional.mse_loss(model(x), y))
    out["params"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    out["buckets"] = len(opt._tl_reducer.buckets) if mode != "local" else 0
    out["overlap"] = min(overlap) if overlap else 0
    out["state_keys"] = len(opt.state_dict()["param_groups"][0]["params"])
    if mode == "neighbor":
        # control in the same processes: the same training without any communication
        local = regression_model()
        lopt = torch.optim.SGD(local.parameters(), lr=0.05)
        for _ in range(steps):
            lopt.zero_grad()
            torch.nn.functional.mse_loss(local(xs), ys).backward()
            lopt.step()
        with torch.no_grad():
            out["local_loss"] = float(torch.nn.functional.mse_loss(local(x), y))
        out["local_params"] = [p.detach().reshape(-1).tolist() for p in local.parameters()]
    C.destroy_process_group()
    return out


def optimizer_errors(rank: int, ws: int) -> Dict[str, Any]:
    from trainloom.comm import optimizers as dopt

    C.init_process_group(timeout=20)
    m = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out = {
        "not_opt": _expect(dopt.DistributedAllreduceOptimizer, TypeError, object()),
        "missing": _expect(dopt.DistributedAllreduceOptimizer, ValueError, opt, [("w", m.weight)]),
        "dup": _expect(dopt.DistributedAllreduceOptimizer, ValueError, opt, [("w", m.weight), ("w", m.bias)]),
        "bucket": _expect(dopt.DistributedNeighborAllreduceOptimizer, ValueError, opt, bucket_bytes=0),
        "passes": _expect(dopt.DistributedAllreduceOptimizer, ValueError, opt, backward_passes_per_step=0),
    }
    wrapped = dopt.DistributedAllreduceOptimizer(opt)
    out["twice"] = _expect(dopt.DistributedAllreduceOptimizer, ValueError, wrapped)
    # gradient accumulation: two backward passes per step, then the averaged sum
    m2 = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m2.weight.fill_(0.0)
    o2 = dopt.DistributedAllreduceOptimizer(
        torch.optim.SGD(m2.parameters(), lr=1.0), backward_passes_per_step=2
    )
    for _ in range(2):
        (m2.weight * (rank + 1)).sum().backward()
    o2.step()
    out["accumulated"] = m2.weight.item()  # -(mean over ranks of 2 * (rank + 1))
    C.destroy_process_group()
    return out


def bluefog_script(rank: int, ws: int) -> Dict[str, Any]:
    """A Bluefog-style script, unchanged except for the import."""
    import trainloom.comm.bluefog as bf

    torch.set_num_threads(1)
    bf.init(lambda n: bf.RingGraph(n))
    x = torch.full((3,), float(bf.rank()))
    out: Dict[str, Any] = {"size": bf.size(), "rank": bf.rank(), "local": (bf.local_rank(), bf.local_size())}
    out["in"] = bf.in_neighbor_ranks()
    out["nar"] = bf.neighbor_allreduce(x).tolist()
    h = bf.allreduce_async(x, average=True, name="x")
    out["ar"] = bf.synchronize(h).tolist()
    out["nag"] = bf.neighbor_allgather(x[:1]).tolist()
    model = torch.nn.Linear(2, 1)
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bf.DistributedNeighborAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    bf.broadcast_optimizer_state(opt, root_rank=0)
    model(torch.ones(1, 2) * (rank + 1)).sum().backward()
    opt.step()
    out["w"] = model.weight.detach().reshape(-1).tolist()
    bf.barrier()
    bf.shutdown()
    return out


# ---------------------------------------------------------------------------- windows
def windows_suite(rank: int, ws: int) -> Dict[str, Any]:
    from trainloom.comm import windows as win

    torch.set_num_threads(1)
    C.init_process_group(timeout=30)
    tp.set_topology(tp.RingGraph(ws))
    left, right = (rank - 1) % ws, (rank + 1) % ws
    x = torch.full((5,), float(rank), dtype=torch.float64)
    out: Dict[str, Any] = {}
    win.win_create(x, "w", zero_init=True)
    out["created_sync"] = win.win_sync("w", clone=True).tolist()  # zero neighbour slots
    nb.barrier()
    win.win_put(x, "w")
    nb.barrier()
    out["sync"] = win.win_sync("w").tolist()  # uniform average with the neighbours' puts
    out["in_place"] = x.tolist()
    nb.barrier()
    win.win_accumulate(torch.ones(5, dtype=torch.float64), "w", dst_weights={right: 2.0})
    win.win_accumulate(torch.ones(5, dtype=torch.float64), "w", dst_weights={right: 2.0})
    nb.barrier()
    ins = tp.in_neighbor_ranks()
    weights = {i: (0.5 if i == left else 0.0) for i in ins}
    out["accumulated"] = win.win_sync("w", self_weight=0.5, neighbor_weights=weights, clone=True).tolist()
    nb.barrier()
    win.win_get("w", src_weights={left: 1.0})
    out["got"] = win.win_sync("w", self_weight=0.0, neighbor_weights={left: 1.0}, clone=True).tolist()
    nb.barrier()
    out["collect"] = win.win_sync_then_collect("w").tolist()
    out["handle"] = win.win_poll(win.win_put_async(x, "w")) and win.win_wait(win.win_get_async("w"))
    nb.barrier()
    out["bad_dst"] = _expect(win.win_put, ValueError, x, "w", {rank: 1.0}) if ws > 2 else "skip"
    out["bad_shape"] = _expect(win.win_put, ValueError, torch.ones(3, dtype=torch.float64), "w")
    out["bad_weight"] = _expect(win.win_accumulate, ValueError, x, "w", {right: float("inf")})
    out["bad_nan"] = _expect(win.win_sync, ValueError, "w", 0.5, {left: float("nan")})
    out["dup"] = _expect(win.win_create, ValueError, x, "w")
    win.win_free("w")
    out["after_free"] = _expect(win.win_sync, ValueError, "w")
    out["shm_left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("tlwin-"))
    C.destroy_process_group()
    return out


def windows_two_nodes(rank: int, ws: int) -> Dict[str, Any]:
    from trainloom.comm import windows as win

    os.environ["TRAINLOOM_NODE_ID"] = f"n{rank}"
    C.init_process_group(timeout=30)
    out = {"error": _expect(win.win_create, NotImplementedError, torch.ones(2), "w")}
    C.destroy_process_group()
    return out


def _fds() -> int:
    """Open file descriptors other than sockets (windows use files and mappings; sockets come and go
    with the store: rank 0 hosts the TCPStore, and other ranks' clients connect and close at their
    own times)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # the fd listing itself, closed by now
            pass
    return n


def _tlwin() -> List[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("tlwin-"))


def windows_mismatch(rank: int, ws: int) -> Dict[str, Any]:
    """win_create with arguments that differ between ranks: the same CommError everywhere, nothing left."""
    from trainloom.comm import windows as win

    torch.set_num_threads(1)
    C.init_process_group(timeout=30)
    tp.set_topology(tp.RingGraph(ws))
    pg = C.new_group()
    tp.set_topology(tp.RingGraph(ws, connect_style=1 + (rank == 0)), comm=pg)  # differs on rank 0
    nb.barrier()
    nb.barrier(comm=pg)  # engines exist, so the fd count below compares like with like
    fds = _fds()
    out: Dict[str, Any] = {}
    out["shape"] = _expect(win.win_create, CommError, torch.ones(4 if rank == 0 else 3), "a")
    out["big"] = _expect(win.win_create, CommError, torch.ones(100 if rank == 0 else 10), "a")
    x = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)
    out["dtype"] = _expect(win.win_create, CommError, x, "a")
    out["name"] = _expect(win.win_create, CommError, torch.ones(4), f"n{rank}")
    # one rank's bad argument: that rank raises its own error, the others a CommError naming it
    bad = torch.ones(4, dtype=torch.int64 if rank == 1 else torch.float32)
    out["local"] = _expect(win.win_create, Exception, bad, "a")
    out["topology"] = _expect(win.win_create, CommError, torch.ones(4), "a", comm=pg)
    out["fds_leaked"] = _fds() - fds
    out["shm_left"] = _tlwin()
    out["live"] = win._live_windows()
    # the communicator is still usable: a matching window works
    y = torch.full((2,), float(rank))
    win.win_create(y, "a")
    win.win_put(y, "a")
    nb.barrier()
    out["after"] = win.win_sync("a", clone=True).tolist()
    nb.barrier()
    win.win_free("a")
    C.destroy_process_group()
    return out


def windows_dtypes(rank: int, ws: int) -> Dict[str, Any]:
    """Window averages in each dtype (2 ranks: each is the other's only neighbour)."""
    from trainloom.comm import windows as win

    torch.set_num_threads(1)
    C.init_process_group(timeout=30)
    tp.set_topology(tp.RingGraph(ws))
    other = 1 - rank
    out: Dict[str, Any] = {}
    values = {
        "float64": torch.full((3,), 2.0**40 + 1 + rank, dtype=torch.float64),
        "float32": torch.tensor([0.1, 1.0 / 3.0, 1e-8], dtype=torch.float32) * (rank + 1),
        "float16": torch.tensor([1000.0, 0.6, 3.0], dtype=torch.float16) * (rank + 1),
        "bfloat16": torch.tensor([1000.0, 0.6, 3.0], dtype=torch.bfloat16) * (rank + 1),
        "complex64": torch.full((2,), (rank + 1) * (1 + 1j), dtype=torch.complex64),
        "complex128": torch.full((2,), (2.0**40 + rank) * (1 - 2j), dtype=torch.complex128),
    }
    for name, x in values.items():
        win.win_create(x, name)
        win.win_put(x, name)
    nb.barrier()
    for name in values:
        avg = win.win_sync(name, 0.25, {other: 0.75}, clone=True)
        own = win.win_sync(name, 1.0, {other: 0.0}, clone=True)
        out[name] = [str(avg.dtype), avg.tolist(), own.tolist()]
    nb.barrier()
    win.win_free()
    out["int64"] = _expect(win.win_create, TypeError, torch.ones(2, dtype=torch.int64), "i")
    out["bool"] = _expect(win.win_create, TypeError, torch.ones(2, dtype=torch.bool), "b")
    out["live"] = win._live_windows()
    C.destroy_process_group()
    return out


def windows_free_after_destroy(rank: int, ws: int) -> Dict[str, Any]:
    """win_free(name) is local: it works once the window's communicator is gone."""
    from trainloom.comm import windows as win

    torch.set_num_threads(1)
    C.init_process_group(timeout=30)
    out: Dict[str, Any] = {}
    pg = C.new_group()
    win.win_create(torch.ones(3), "w", comm=pg)
    nb.barrier()
    pg.destroy()  # the window's communicator is gone
    out["use_after"] = _expect(win.win_sync, CommError, "w")
    out["dup_before_free"] = _expect(win.win_create, ValueError, torch.ones(3), "w")
    out["free"] = win.win_free("w")
    out["again"] = _expect(win.win_free, ValueError, "w")
    y = torch.full((3,), float(rank))
    win.win_create(y, "w")  # the name is free again, on the default group
    win.win_put(y, "w")
    nb.barrier()
    out["recreated"] = win.win_sync("w", clone=True).tolist()
    nb.barrier()
    C.destroy_process_group()
    fds = _fds()
    out["free_after_destroy"] = win.win_free("w")
    out["live"] = win._live_windows()
    out["fds_released"] = fds - _fds()  # one per rank's window file
    out["shm_left"] = _tlwin()
    return out


def neighbor_half_strided(rank: int, ws: int) -> Dict[str, Any]:
    """float16/bfloat16 inputs that are not contiguous average like their float32 values."""
    torch.set_num_threads(1)
    C.init_process_group(timeout=30)
    tp.set_topology(tp.RingGraph(ws))
    base = torch.arange(24.0).reshape(2, 3, 4) * (rank + 1) + 0.1 * rank
    cases = {
        "transposed": lambda t: t[0].t(),
        "permuted": lambda t: t.permute(2, 0, 1),
        "channels_last": lambda t: t.reshape(1, 2, 3, 4).contiguous(memory_format=torch.channels_last),
        "sliced": lambda t: t[:, :, ::2],
    }
    out: Dict[str, Any] = {}
    for dtype in (torch.float16, torch.bfloat16):
        for name, view in cases.items():
            x = view(base.to(dtype))
            want = nb.neighbor_allreduce(x.float()).to(dtype)  # the same sums in float32, rounded once
            got = nb.neighbor_allreduce(x)
            explicit = nb.neighbor_allreduce(x, 0.25, {(rank + 1) % ws: 0.75})
            want_e = nb.neighbor_allreduce(x.float(), 0.25, {(rank + 1) % ws: 0.75}).to(dtype)
            key = f"{str(dtype)[6:]}/{name}"
            out[key] = [
                got.dtype == dtype,
                tuple(got.shape) == tuple(x.shape),
                torch.equal(got, want),
                torch.equal(explicit, want_e),
                x.is_contiguous(),
            ]
    C.destroy_process_group()
    return out


def bluefog_not_initialized(rank: int, ws: int) -> Dict[str, Any]:
    """bf.size()/rank()/local_size()/local_rank() raise before init() and after shutdown(), as Bluefog."""
    import trainloom.comm.bluefog as bf

    def queries() -> List[str]:
        return [_expect(f, ValueError) for f in (bf.size, bf.rank, bf.local_size, bf.local_rank)]

    out: Dict[str, Any] = {"before": queries()}
    bf.init()
    out["during"] = [bf.size(), bf.rank(), bf.local_size(), bf.local_rank()]
    bf.shutdown()
    out["after"] = queries()
    return out


def numpy_integer_ranks(rank: int, ws: int) -> Dict[str, Any]:
    """numpy integers work wherever the extension APIs take a rank, a dim or a count (as in torch)."""
    import numpy as np

    from trainloom.comm import colossal as col
    from trainloom.comm import windows as win
    from trainloom.comm.optimizers import DistributedAllreduceOptimizer

    torch.set_num_threads(1)
    C.init_process_group(timeout=30)
    tp.set_topology(tp.RingGraph(ws))
    left, right, last = np.int64((rank - 1) % ws), np.int32((rank + 1) % ws), np.int64(ws - 1)
    out: Dict[str, Any] = {}
    pg = C.new_group(np.arange(ws))
    out["group"] = [type(r).__name__ for r in pg.ranks]
    out["object"] = st.broadcast_object(f"from {rank}", root_rank=last)
    x = torch.full((2,), float(rank))
    out["all_gather"] = col.all_gather(x, np.int64(0)).tolist()
    out["broadcast"] = col.broadcast(x.clone(), last).tolist()
    out["neighbor"] = nb.neighbor_allreduce(x, 0.5, {left: 0.5}).tolist()
    y = torch.full((2,), float(rank), dtype=torch.float64)
    win.win_create(y, "np", zero_init=True)
    win.win_put(y, "np", {right: 1.0})
    nb.barrier()
    out["window"] = win.win_sync("np", 0.0, {left: 1.0}, clone=True).tolist()
    win.win_free("np")
    model = torch.nn.Linear(2, 1)
    opt = DistributedAllreduceOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        bucket_bytes=np.int64(8),
        backward_passes_per_step=np.int8(2),
    )
    out["passes"] = type(opt._tl_reducer.passes).__name__
    out["buckets"] = len(opt._tl_reducer.buckets)  # 8 bytes: one bucket per parameter
    C.destroy_process_group()
    return out


# ---------------------------------------------------------------------------- Bluefog's expectations
def bluefog_directions_and_sums(rank: int, ws: int) -> Dict[str, Any]:
    """Bluefog's ring directions, weighted sums, topology_util topologies and later-release names."""
    import math

    import trainloom.comm.bluefog as bf
    from trainloom.comm import topology_util as tu

    torch.set_num_threads(1)
    bf.init()
    out: Dict[str, Any] = {}
    x = torch.full((23,), float(rank), dtype=torch.float64)
    # Bluefog's test_neighbor_allreduce_avg_ring_topo, with trainloom's and topology_util's RingGraph
    for cd in (1, 2):
        for label, builder in (("tp", bf.RingGraph), ("tu", tu.RingGraph)):
            bf.set_topology(builder(ws, cd))
            out[f"ring{cd}/{label}"] = [bf.in_neighbor_ranks(), (bf.neighbor_allreduce(x) * 2).tolist()]
    # Bluefog's test_neighbor_allreduce_sum and _sum_precision: self weight 1.0, neighbour weights 1.0
    bf.set_topology(bf.ExponentialTwoGraph(ws))
    nbrs = [(rank - 2**i) % ws for i in range(int(math.ceil(math.log2(ws))))]
    ones = {i: 1.0 for i in nbrs}
    out["exp2_in"] = sorted(bf.in_neighbor_ranks())
    out["sum"] = bf.neighbor_allreduce(x, self_weight=1.0, neighbor_weights=ones).tolist()
    tiny = torch.full((2, 3), 2.0**-256, dtype=torch.float64)
    out["sum_precision"] = bf.neighbor_allreduce(tiny, self_weight=1.0, src_weights=ones, name="p").tolist()
    out["negative"] = bf.neighbor_allreduce(x, self_weight=2.0, neighbor_weights={nbrs[0]: -1.0}).tolist()
    # later names: *_nonblocking, wait, src_weights
    h = bf.neighbor_allreduce_nonblocking(x, 1.0, ones, "n")
    out["nonblocking"] = bf.wait(h).tolist()
    h = bf.neighbor_allreduce_nonblocking(x, self_weight=0.5, src_weights={nbrs[0]: 0.5})
    out["nonblocking_src"] = bf.synchronize(h).tolist()
    out["allreduce_nb"] = bf.wait(bf.allreduce_nonblocking(x[:2], True, False, "a")).tolist()
    y = x[:2].clone()
    h = bf.allreduce_nonblocking_(y, average=False)
    out["allreduce_nb_"] = [bf.wait(h) is y, y.tolist()]
    out["broadcast_nb"] = bf.wait(bf.broadcast_nonblocking(x[:2], ws - 1)).tolist()
    z = x[:2].clone()
    bf.wait(bf.broadcast_nonblocking_(z, 0))
    out["broadcast_nb_"] = z.tolist()
    out["allgather_nb"] = bf.wait(bf.allgather_nonblocking(x[:1])).tolist()
    out["neighbor_allgather_nb"] = bf.wait(bf.neighbor_allgather_nonblocking(x[:1])).tolist()
    out["hierarchical"] = _expect(bf.allreduce_nonblocking, NotImplementedError, x, True, True)
    out["send_neighbors"] = _expect(bf.neighbor_allreduce_nonblocking, TypeError, x, 0.5, {nbrs[0]: 0.5}, [1])
    # topology_util topologies as Bluefog's torch_ops_test sets them
    bf.set_topology(tu.StarGraph(ws), is_weighted=True)
    out["weighted_star"] = bf.neighbor_allreduce(x).tolist()
    bf.set_topology(tu.MeshGrid2DGraph(ws))
    out["mesh"] = [bf.in_neighbor_ranks(), bf.neighbor_allreduce(x).tolist()]
    out["recv_weights"] = tu.GetRecvWeights(bf.load_topology(), bf.rank())
    # windows: win_update / win_update_then_collect and weights that do not sum to 1
    bf.set_topology(bf.RingGraph(ws))
    left, right = (rank - 1) % ws, (rank + 1) % ws
    ins = bf.in_neighbor_ranks()
    w = torch.full((3,), float(rank), dtype=torch.float64)
    bf.win_create(w, "w", zero_init=True)
    bf.win_put(w, "w")
    bf.barrier()
    # Bluefog: win_sync_then_collect "is equivalent to win_sync(name, self_weight=1.0,
    # neighbor_weights={neighbor: 1.0}, reset=True)"
    out["win_sum"] = bf.win_update("w", 1.0, {n: 1.0 for n in ins}, reset=True, clone=True).tolist()
    out["win_sum_sync"] = bf.win_sync("w", 1.0, {n: 1.0 for n in ins}, clone=True).tolist()  # slots reset
    bf.barrier()
    bf.win_put(w, "w")
    bf.barrier()
    out["collect"] = bf.win_update_then_collect("w").tolist()
    out["collect_in_place"] = w.tolist()
    bf.barrier()
    out["collect_again"] = bf.win_sync_then_collect("w").tolist()  # slots were zeroed
    bf.barrier()
    bf.win_accumulate(torch.ones(3, dtype=torch.float64), "w", dst_weights={right: -2.0})
    bf.barrier()
    out["win_negative"] = bf.win_sync("w", 0.0, {left: 1.0}, clone=True).tolist()
    bf.barrier()
    bf.win_wait(bf.win_put_nonblocking(w, "w", None, {right: 0.5}))
    bf.barrier()
    out["put_nb"] = bf.win_sync("w", 0.0, {left: 1.0}, clone=True).tolist()
    bf.barrier()
    bf.win_wait(bf.win_accumulate_nonblocking(w, "w", 1.0, {right: 1.0}))
    bf.barrier()
    out["accumulate_nb"] = bf.win_sync("w", 0.0, {left: 1.0}, clone=True).tolist()
    bf.barrier()
    bf.win_wait(bf.win_get_nonblocking("w", {left: 1.0}))
    out["get_nb"] = bf.win_sync("w", 0.0, {left: 1.0}, clone=True).tolist()
    out["put_self_weight"] = _expect(bf.win_put_nonblocking, NotImplementedError, w, "w", 0.5)
    bf.barrier()
    bf.win_free("w")
    bf.shutdown()
    return out


def optimizer_model_arg(rank: int, ws: int) -> Dict[str, Any]:
    """The distributed optimizers with Bluefog's later ``model`` argument and with named_parameters."""
    import trainloom.comm.bluefog as bf

    torch.set_num_threads(1)
    bf.init(lambda n: bf.RingGraph(n))
    out: Dict[str, Any] = {}
    data = torch.arange(8, dtype=torch.float64).reshape(4, 2) * (rank + 1)

    def run(make: Callable[[torch.nn.Module, torch.optim.Optimizer], torch.optim.Optimizer]) -> List[float]:
        torch.manual_seed(0)
        m = torch.nn.Linear(2, 1).double()
        opt = make(m, torch.optim.SGD(m.parameters(), lr=0.1))
        for _ in range(3):
            opt.zero_grad()
            m(data).square().mean().backward()
            opt.step()
        return [*m.weight.detach().reshape(-1).tolist(), *m.bias.detach().tolist()]

    for kind, cls in (
        ("neighbor", bf.DistributedNeighborAllreduceOptimizer),
        ("allreduce", bf.DistributedAllreduceOptimizer),
    ):
        out[f"{kind}/named"] = run(lambda m, o, c=cls: c(o, named_parameters=m.named_parameters()))
        out[f"{kind}/model"] = run(lambda m, o, c=cls: c(o, model=m))
        out[f"{kind}/positional"] = run(lambda m, o, c=cls: c(o, m))
        out[f"{kind}/list"] = run(lambda m, o, c=cls: c(o, model=[m]))
    bf.shutdown()
    return out


def optimizer_weight_attributes(rank: int, ws: int) -> Dict[str, Any]:
    """Bluefog's ``opt.self_weight`` / ``opt.neighbor_weights`` on the neighbour optimizer."""
    import trainloom.comm.bluefog as bf

    torch.set_num_threads(1)
    bf.init(lambda n: bf.RingGraph(n))
    out: Dict[str, Any] = {}

    def step(set_weights: Callable[[torch.optim.Optimizer], None]) -> List[float]:
        w = torch.nn.Parameter(torch.full((2,), float(rank)))
        opt = bf.DistributedNeighborAllreduceOptimizer(torch.optim.SGD([w], lr=0.0))
        set_weights(opt)
        opt.zero_grad()
        w.sum().backward()
        opt.step()  # lr=0: the parameters are the neighbour combination itself
        return w.detach().tolist()

    out["topology"] = step(lambda o: None)  # ring of 3: (r-1 + r + r+1) / 3 = 1 everywhere
    left = (rank - 1) % ws

    def take_left(o: torch.optim.Optimizer) -> None:
        o.self_weight = 0.0
        o.neighbor_weights = {left: 1.0}

    out["left"] = step(take_left)
    opt = bf.DistributedNeighborAllreduceOptimizer(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    )
    take_left(opt)
    out["read"] = (opt.self_weight, opt.neighbor_weights)
    ar = bf.DistributedAllreduceOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    try:
        ar.self_weight = 0.5
    except AttributeError as exc:
        out["allreduce"] = str(exc)
    bf.shutdown()
    return out
