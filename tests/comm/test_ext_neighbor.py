"""Topologies, neighbour collectives, functional forms and async handles, in real 1- to 4-process runs."""

from __future__ import annotations

import extutil_allgather as X
import pytest
import test_ext_ranks as R
import torch
from commutil import engines, shm_segments
from multiproc import run_ranks

from trainloom.comm import topology as tp
from trainloom.comm.neighbor import then_work
from trainloom.comm.work import Work
from trainloom.errors import CommError

ENGINES = engines()


def reference(topo: tp.Topology, weighted: bool, rank: int, xs, self_weight=None, weights=None):
    """Weighted average computed from the topology's matrix (or uniform weights), in float64."""
    ins = topo.in_neighbors(rank)
    if weights is None:
        if weighted:
            self_weight, weights = topo.self_weight(rank), topo.in_weights(rank)
        else:
            self_weight = 1.0 / (len(ins) + 1)
            weights = {i: self_weight for i in ins}
    out = xs[rank].double() * self_weight
    for i, w in weights.items():
        out = out + xs[i].double() * w
    return out


@pytest.mark.parametrize(
    "ws,engine,strategy",
    [
        (2, "shm", "auto"),
        (3, "gloo", "auto"),
        (3, "shm", "exchange"),
        (4, "shm", "auto"),
        (4, "shm", "exchange"),
    ],
)
def test_neighbor_collectives_match_reference(ws, engine, strategy):
    if engine not in ENGINES:
        pytest.skip(f"engine {engine} unavailable: {ENGINES}")
    before = shm_segments()
    res = run_ranks(R.neighbor_suite, ws, engine, strategy, timeout=90)
    xs = [R.value(r) for r in range(ws)]
    for rank, out in enumerate(res):
        assert out["engine"] == engine
        for name, topo in R.topologies(ws).items():
            weighted = name == "custom"
            ins = topo.in_neighbors(rank)
            assert out[f"{name}/in"] == ins
            want = reference(topo, weighted, rank, xs)
            torch.testing.assert_close(torch.tensor(out[f"{name}/avg"], dtype=torch.float64), want)
            torch.testing.assert_close(
                torch.tensor(out[f"{name}/bf16"], dtype=torch.float64), want, rtol=1e-2, atol=0.0
            )
            gathered = torch.cat([xs[i] for i in ins]) if ins else torch.empty(0, 3, dtype=torch.float64)
            assert out[f"{name}/gather"] == gathered.tolist()
            if ins:
                want_e = reference(topo, weighted, rank, xs, 0.7, {ins[0]: 0.3})
                torch.testing.assert_close(torch.tensor(out[f"{name}/explicit"], dtype=torch.float64), want_e)
            a_avg, a_gather, polled = out[f"{name}/async"]
            torch.testing.assert_close(torch.tensor(a_avg, dtype=torch.float64), want, rtol=1e-6, atol=1e-5)
            assert a_gather == (torch.cat([xs[i][0] for i in ins]).tolist() if ins else [])
            assert polled is True
        assert out["input_unchanged"] is True
        mean = sum(xs) / ws
        torch.testing.assert_close(torch.tensor(out["allreduce"], dtype=torch.float64), mean)
        assert out["allreduce_sum"] == sum(xs).tolist()
        assert out["allreduce_"] == mean.tolist() or torch.allclose(
            torch.tensor(out["allreduce_"], dtype=torch.float64), mean
        )
        assert out["allgather"] == torch.cat(xs).tolist()
        assert out["broadcast"] == xs[ws - 1].tolist()
        assert out["broadcast_"] == xs[0].tolist()
        assert out["allreduce_async_int"] == [sum(range(1, ws + 1)) * k for k in (1, 2)]
    assert shm_segments() == before


def test_topology_builders():
    assert tp.RingGraph(4).in_neighbors(0) == [1, 3]
    # Bluefog's directions: style 1 is the edge i -> i - 1 (rank i receives from i + 1), style 2 the
    # edge i -> i + 1 (rank i receives from i - 1)
    assert tp.RingGraph(4, connect_style=1).in_neighbors(0) == [1]
    assert tp.RingGraph(4, connect_style=1).out_neighbors(0) == [3]
    assert tp.RingGraph(4, connect_style=2).in_neighbors(0) == [3]
    assert tp.RingGraph(4, connect_style=2).out_neighbors(0) == [1]
    assert tp.RingGraph(2, connect_style=1).in_neighbors(0) == [1]
    assert tp.RingGraph(2).in_neighbors(0) == [1]
    assert tp.RingGraph(1).in_neighbors(0) == []
    e = tp.ExponentialTwoGraph(8)
    assert e.out_neighbors(0) == [1, 2, 4] and e.in_neighbors(0) == [4, 6, 7]
    assert tp.ExponentialTwoGraph(4).in_neighbors(0) == [2, 3]
    f = tp.FullyConnectedGraph(3)
    assert f.in_neighbors(1) == [0, 2] and f.self_weight(1) == pytest.approx(1 / 3)
    w = tp.Topology.from_matrix([[0.5, 0.25], [0.5, 0.75]])
    assert w.in_weights(0) == {1: 0.5} and w.self_weight(1) == 0.75 and w.weighted
    assert w.matrix() == [[0.5, 0.25], [0.5, 0.75]]
    assert tp.Topology.from_matrix(w.matrix()) == w
    d = tp.Topology.from_edges(3, [(0, 1), (1, 2), (2, 0)])
    assert d.in_neighbors(1) == [0] and d.out_neighbors(1) == [2] and not d.weighted
    assert d.in_weights(1) == {0: 0.5} and d.num_edges() == 3


def test_topology_bad_inputs():
    with pytest.raises(ValueError, match=r"^Topology: weight of edge 1 -> 0 must be finite, got nan$"):
        tp.Topology.from_matrix([[1.5, 0.5], [float("nan"), 0.5]])
    with pytest.raises(ValueError, match=r"^Topology: self weight of rank 1 must be finite, got inf$"):
        tp.Topology.from_matrix([[1.0, 0.5], [0.0, float("inf")]])
    with pytest.raises(ValueError, match=r"need a square matrix"):
        tp.Topology.from_matrix([[1.0, 0.0]])
    with pytest.raises(ValueError, match=r"edge \(0, 3\) names rank 3 outside 0..2"):
        tp.Topology.from_edges(3, [(0, 3)])
    with pytest.raises(ValueError, match=r"edge \(1, 1\) is a self loop"):
        tp.Topology.from_edges(3, [(1, 1)])
    with pytest.raises(ValueError, match=r"weighted edges need self_weights"):
        tp.Topology.from_edges(2, {(0, 1): 1.0})
    with pytest.raises(ValueError, match=r"self_weights given with unweighted edges"):
        tp.Topology.from_edges(2, [(0, 1)], self_weights=[1.0, 0.5])
    with pytest.raises(ValueError, match=r"an edge must be a pair"):
        tp.Topology.from_edges(2, [(0, 1, 2)])
    with pytest.raises(TypeError, match=r"self weight of rank 0 must be a real number"):
        tp.Topology(1, [{}], ["1"])
    with pytest.raises(ValueError, match=r"must be finite, got inf"):
        tp.Topology.from_edges(2, {(0, 1): float("inf")}, self_weights=[1.0, 0.0])
    with pytest.raises(ValueError, match=r"connect_style must be 0, 1 or 2"):
        tp.RingGraph(3, connect_style=3)
    with pytest.raises(ValueError, match=r"size must be an int >= 1"):
        tp.ExponentialTwoGraph(0)
    with pytest.raises(ValueError, match=r"rank 5 is outside 0..2"):
        tp.RingGraph(3).in_neighbors(5)


def test_exchange_strategy(monkeypatch):
    monkeypatch.delenv("TRAINLOOM_NEIGHBOR_EXCHANGE", raising=False)
    assert tp.exchange_strategy(tp.FullyConnectedGraph(4), 4096) == "allgather"
    assert tp.exchange_strategy(tp.FullyConnectedGraph(4), 1 << 20) == "exchange"
    assert tp.exchange_strategy(tp.RingGraph(16)) == "exchange"
    assert tp.exchange_strategy(tp.RingGraph(2)) == "exchange"
    monkeypatch.setenv("TRAINLOOM_NEIGHBOR_EXCHANGE", "allgather")
    assert tp.exchange_strategy(tp.RingGraph(16)) == "allgather"
    monkeypatch.setenv("TRAINLOOM_NEIGHBOR_EXCHANGE", "mpi")
    from trainloom.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"TRAINLOOM_NEIGHBOR_EXCHANGE='mpi': use auto, allgather or exchange"
    ):
        tp.exchange_strategy(tp.RingGraph(16))


def test_neighbor_bad_inputs_raise_exact_errors():
    res = run_ranks(R.neighbor_errors, 3, timeout=60)
    for rank, r in enumerate(res):
        left = (rank - 1) % 3
        assert r["not_neighbor"] == (
            f"ValueError: neighbor_allreduce: rank {(rank + 1) % 3} in neighbor_weights is not an "
            "in-neighbour "
            f"of rank {rank} (in-neighbours: [{left}]); change the topology with set_topology() or drop it"
        )
        assert r["nan"] == "ValueError: neighbor_allreduce: self_weight must be finite, got nan"
        assert (
            r["inf"] == f"ValueError: neighbor_allreduce: neighbor_weights[{left}] must be finite, got -inf"
        )
        assert (
            r["weight_type"]
            == f"TypeError: neighbor_allreduce: neighbor_weights[{left}] must be a real number, got '0.5'"
        )
        assert r["both"] == (
            "TypeError: neighbor_allreduce: pass neighbor_weights or src_weights (its newer Bluefog name), "
            "not both"
        )
        assert r["src_not_neighbor"] == (
            f"ValueError: neighbor_allreduce: rank {(rank + 1) % 3} in neighbor_weights is not an "
            f"in-neighbour of rank {rank} (in-neighbours: [{left}]); change the topology with "
            "set_topology() or drop it"
        )
        assert r["one_only"].startswith(
            "ValueError: neighbor_allreduce: self_weight and neighbor_weights must be"
        )
        assert r["int"].startswith(
            "TypeError: neighbor_allreduce: averaging needs a floating or complex tensor, got torch.int64"
        )
        assert r["not_tensor"] == "TypeError: neighbor_allgather: tensor must be a torch.Tensor, got list"
        assert (
            r["weights_type"]
            == "TypeError: neighbor_allreduce: neighbor_weights must be a dict {rank: weight}, got list"
        )
        assert (
            r["key_type"] == "TypeError: neighbor_allreduce: neighbor_weights keys must be int ranks, got '1'"
        )
        assert r["poll"].startswith("TypeError: poll: handle must be the Work returned by an *_async")
        assert r["synchronize"].endswith("got NoneType")
        assert (
            r["size"]
            == "ValueError: set_topology: the topology has 4 ranks but communicator default/global has 3"
        )
        assert r["topo_type"].startswith(
            "TypeError: set_topology: topology must be a trainloom.comm.topology.Topology"
        )
        assert r["avg_int"].startswith("TypeError: allreduce: averaging needs a floating or complex tensor")
        assert r["avg_int"].endswith("pass average=False for a sum")
        assert r["comm_type"].startswith(
            "TypeError: allreduce: comm must be a trainloom Communicator or ProcessGroup"
        )
        assert r["shape_mismatch"].startswith("CommError"), r["shape_mismatch"]
        assert "alltoall_v" in r["shape_mismatch"] or "allgather" in r["shape_mismatch"]
        assert r["topo_mismatch"].startswith("CommError"), r["topo_mismatch"]


@pytest.mark.parametrize("engine", ENGINES)
def test_two_handles_in_flight_at_once(engine):
    res = run_ranks(R.overlap, 3, engine, timeout=60)
    assert res[0]["both_pending"] is True
    for r in res:
        assert "error" not in r, r
        assert r["r1"] == [1.0, 1.0]  # mean of 0, 1, 2
        assert r["r2"] == [1.0, 1.0]  # ring of 3: everyone is a neighbour
        assert r["done"] is True


def test_world_size_one():
    (r,) = run_ranks(R.world_one, 1, timeout=60)
    x = R.value(0)
    assert r["in"] == [] and r["avg"] == x.tolist() and r["gather"] == [0, 3]
    assert r["allreduce"] == x.tolist() and r["allgather"] == x.tolist() and r["broadcast"] == x.tolist()
    assert r["poll"] is True and r["params_same"] is True and r["win"] == [0.0, 1.0, 2.0]


def test_missing_neighbor_times_out():
    res = run_ranks(R.late_neighbor, 3, "shm" if "shm" in ENGINES else "gloo", timeout=60)
    for rank in (0, 2):
        assert res[rank]["error"].startswith("CommTimeoutError") or res[rank]["error"].startswith("CommError")
        # the call the user made comes first, then the engine's step (a ring of 3 is dense: allgather)
        text = res[rank]["error"].split(": ", 1)[1]
        assert text.startswith("neighbor_allreduce: ") and "allgather #2" in text, res[rank]
        assert res[rank]["seconds"] < 30


def test_half_precision_non_contiguous_inputs_match_float32():
    res = run_ranks(R.neighbor_half_strided, 2, timeout=60)
    for r in res:
        assert len(r) == 8
        for key, (dtype_ok, shape_ok, equal, equal_explicit, contiguous) in r.items():
            assert dtype_ok and shape_ok, key
            assert equal and equal_explicit, key  # bit-identical to the float32 result rounded once
            assert contiguous is False, key  # every case really is a strided input


def test_topology_ranks_accept_numpy_integers_and_reject_other_types():
    np = pytest.importorskip("numpy")
    t = tp.Topology.from_edges(np.int64(3), [(np.int64(0), np.int64(1)), (np.int32(1), 2)])
    assert t == tp.Topology.from_edges(3, [(0, 1), (1, 2)])
    assert t.in_neighbors(np.int64(1)) == [0] and type(t.in_neighbors(1)[0]) is int
    assert tp.ExponentialTwoGraph(np.int64(4)) == tp.ExponentialTwoGraph(4)
    assert tp.RingGraph(np.int16(3)).in_neighbors(0) == [1, 2]
    w = tp.Topology.from_edges(2, {(np.int64(0), 1): 0.5}, self_weights=[1.0, 0.5])
    assert w.in_weights(1) == {0: 0.5}
    with pytest.raises(
        TypeError, match=r"^Topology.from_edges: edge '01' names rank '0', which is not an int \(str\)$"
    ):
        tp.Topology.from_edges(3, ["01"])
    with pytest.raises(
        TypeError, match=r"^Topology.from_edges: edge \(0, 1.0\) names rank 1.0, which is not an int"
    ):
        tp.Topology.from_edges(3, [(0, 1.0)])
    with pytest.raises(
        ValueError, match=r"^Topology.from_edges: edge \(0, .*\) names rank 3 outside 0\.\.2$"
    ):
        tp.Topology.from_edges(3, [(0, np.int64(3))])  # in range is the check, not the type
    with pytest.raises(
        TypeError, match=r"^Topology.from_edges: size must be an int >= 1, got 2.0 \(float\)$"
    ):
        tp.Topology.from_edges(2.0, [])
    with pytest.raises(TypeError, match=r"^RingGraph: size must be an int >= 1, got '3' \(str\)$"):
        tp.RingGraph("3")
    with pytest.raises(TypeError, match=r"^Topology: rank must be an int, got '1' \(str\)$"):
        tp.RingGraph(3).in_neighbors("1")
    with pytest.raises(
        TypeError, match=r"^Topology: rank 1 has in-neighbour '0', which is not an int rank \(str\)$"
    ):
        tp.Topology(2, [{}, {"0": 0.5}], [1.0, 0.5])


def test_from_matrix_rejects_non_matrices_clearly():
    msg = (
        r"^Topology.from_matrix: need a square 2-D matrix \(a sequence of rows\), but row 0 is 0.5, "
        r"not a sequence \(a 1-D input is not a matrix\)$"
    )
    with pytest.raises(ValueError, match=msg):
        tp.Topology.from_matrix([0.5, 0.5])
    with pytest.raises(ValueError, match=msg):
        tp.Topology.from_matrix(torch.tensor([0.5, 0.5]))
    with pytest.raises(
        ValueError, match=r"^Topology.from_matrix: need a square 2-D matrix \(a sequence of rows\), got 1.0$"
    ):
        tp.Topology.from_matrix(torch.tensor(1.0))
    with pytest.raises(
        TypeError, match=r"^Topology.from_matrix: entry \[0\]\[1\] must be a real number, got 'x'$"
    ):
        tp.Topology.from_matrix([[1.0, "x"], [0.0, 1.0]])


def test_zero_weight_edges_and_equality():
    # a zero-weight edge is no edge, whichever builder made it
    e = tp.Topology.from_edges(2, {(0, 1): 0.0, (1, 0): 0.5}, self_weights=[0.5, 1.0])
    m = tp.Topology.from_matrix([[0.5, 0.0], [0.5, 1.0]])
    assert e.in_neighbors(1) == [] and e.out_neighbors(0) == [] and e.num_edges() == 1
    assert e == m and e.matrix() == m.matrix()
    # equality includes whether the weights are user-chosen
    uniform = tp.Topology.from_edges(2, [(0, 1), (1, 0)])
    weighted = tp.Topology.from_edges(2, {(0, 1): 0.5, (1, 0): 0.5}, self_weights=[0.5, 0.5])
    assert uniform.matrix() == weighted.matrix()
    assert uniform != weighted and weighted == tp.Topology.from_matrix(weighted.matrix())
    assert uniform == tp.Topology.from_edges(2, [(1, 0), (0, 1)])


# ---------------------------------------------------------------------------- allgather, neighbor_allgather
def _mismatch(opname: str, shapes) -> str:
    each = "; ".join(f"rank {r} has {s}" for r, s in enumerate(shapes))
    return (
        f"CommError: {opname}: ranks disagree on the tensor: only the first dimension may differ between "
        f"ranks, the dtype and the other dimensions must be the same ({each})"
    )


@pytest.mark.parametrize("engine,strategy", [("shm", "auto"), ("shm", "exchange"), ("gloo", "auto")])
def test_allgather_first_dimension_may_differ_between_ranks(engine, strategy):
    # Bluefog: the output's first dimension "is the sum of all first dimensions of the tensors in
    # different Bluefog processes" (its test_allgather_variable_size); trainloom raised CommError.
    if engine not in ENGINES:
        pytest.skip(f"engine {engine} unavailable: {ENGINES}")
    ws, firsts = 3, [2, 1, 3]
    res = run_ranks(X.variable_size, ws, engine, strategy, firsts, timeout=90)
    xs = [X.rows(r, firsts[r]) for r in range(ws)]
    everything = torch.cat(xs).tolist()
    wide = [X.rows(r, firsts[r], cols=6)[:, ::2] for r in range(ws)]
    same = torch.cat([X.rows(r, 2) for r in range(ws)]).tolist()
    for rank, out in enumerate(res):
        left = (rank - 1) % ws  # RingGraph(connect_style=2): the only in-neighbour
        assert out["allgather"] == ([sum(firsts), 3], everything)
        assert out["allgather_async"] == everything and out["allgather_result"] == everything
        assert out["nag"] == xs[left].tolist()
        assert out["nag_polled"] == xs[left].tolist()
        assert out["strided"] == torch.cat(wide).tolist()
        assert out["empty"] == [4, 3]  # rank 0 has no rows
        assert out["nag_empty"] == ([] if left == 0 else X.rows(left, 2).tolist())
        assert out["same"] == same and out["nag_same"] == X.rows(left, 2).tolist()
        assert out["scalar"] == [0.0, 1.0, 2.0] and out["nag_scalar"] == [float(left)]


@pytest.mark.parametrize("engine", ENGINES)
def test_allgather_other_dimensions_and_dtype_must_match(engine):
    res = run_ranks(X.shape_mismatch, 3, engine, timeout=90)
    cols = ["float32 (1, 3)", "float32 (2, 4)", "float32 (3, 3)"]
    for out in res:
        assert out["cols"] == _mismatch("allgather(w)", cols)
        assert out["nag_cols"] == _mismatch("neighbor_allgather", cols)
        assert out["dtype"] == _mismatch("allgather", ["float32 (2, 3)", "float32 (2, 3)", "float64 (2, 3)"])
        assert out["ndim"] == _mismatch(
            "neighbor_allgather(n)", ["float32 (2, 3, 1)", "float32 (2, 3)", "float32 (2, 3)"]
        )
        # the same element count no longer passes for a different shape
        assert out["same_numel"] == _mismatch(
            "allgather", ["float32 (2, 3)", "float32 (3, 2)", "float32 (3, 2)"]
        )
        # (1, 1000004) and (2, 1) hashed alike under the header's first hash (the engine's generic error
        # came out), and (2, 1000003) against (1, 2000006) gathered silently into different shapes
        assert out["collision"] == _mismatch(
            "allgather", ["uint8 (1, 1, 1000004)", "uint8 (1, 2, 1)", "uint8 (1, 2, 1)"]
        )
        assert out["collision_same_numel"] == _mismatch(
            "allgather", ["uint8 (1, 2, 1000003)", "uint8 (1, 1, 2000006)", "uint8 (1, 1, 2000006)"]
        )
        a = _mismatch("neighbor_allgather(a)", ["float32 (2, 3)", "float32 (2, 4)", "float32 (2, 3)"])
        assert out["async_wait"] == a and out["async_again"] == a
        assert out["after"] == [0.0, 1.0, 2.0]
        supported = "float16, bfloat16, float32, float64, int8, uint8, int16, int32, int64, bool, "
        supported += "complex64, complex128"
        for fn in ("allgather", "neighbor_allgather_async"):
            op = fn.replace("_async", "")
            assert out[f"uint16/{fn}"] == (
                f"{op}(b): tensor has dtype torch.uint16, which is not supported (supported: {supported})"
            )
            assert out[f"sparse/{fn}"] == (
                f"{op}(b): tensor must be a dense (strided) tensor, got layout torch.sparse_coo"
            )


@pytest.mark.parametrize("engine", ENGINES)
def test_neighbor_allgather_exchange_errors_name_the_call(engine):
    # The exchange path (80 KB) used to raise the engine's "shm alltoall_v #2 ..." without the call.
    res = run_ranks(X.exchange_errors, 3, engine, timeout=90)
    for rank, out in enumerate(res):
        for key, seq in (("sync", 2), ("async_wait", 4), ("async_sync", 4)):
            if engine == "shm":
                step = (
                    f"shm alltoall_v #{seq} on rank {rank}/3 (prefix 'tl/1/default/global/shm'): rank 0 "
                    "sends 0 elements to rank 1, but rank 1 expects 20000 from rank 0: send_counts[1] on "
                    "rank 0 must equal recv_counts[0] on rank 1"
                )
            else:
                step = (
                    f"alltoall_v #{seq}: rank 0 sends 0 elements to rank 1 (its send_counts[1]), but rank 1 "
                    "expects 20000 from rank 0 (its recv_counts[0])"
                )
            assert out[key].startswith("CommError: neighbor_allgather(grads): "), (key, out[key])
            assert out[key] == f"CommError: neighbor_allgather(grads): {step}", (key, out[key])


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("engine", ENGINES)
def test_neighbor_allgather_timeout_names_the_call(engine, mode):
    res = run_ranks(X.late_rank, 3, engine, mode, timeout=60)
    for rank in (0, 2):
        kind, text = res[rank]["error"].split(": ", 1)
        assert kind in ("CommTimeoutError", "CommError"), res[rank]
        step = (
            f"shm allgather #2 on rank {rank}/3 "
            if engine == "shm"
            else f"allgather #2 (gloo, rank {rank} of 3)"
        )
        assert text.startswith("neighbor_allgather(grads): "), res[rank]
        assert text.startswith(f"neighbor_allgather(grads): {step}"), res[rank]
        assert res[rank]["seconds"] < 20


class _FailingWork(Work):
    """A Work (not a CPU FutureWork: the CUDA branch) whose wait raises the engine's error."""

    def wait(self, timeout=None):
        raise CommError("nccl alltoall_v #3: rank 1 died")

    def is_completed(self):
        return True


@pytest.mark.parametrize("after", [None, lambda: None])
def test_then_work_names_the_call_in_every_error(after):
    h = then_work(None, "neighbor_allgather(g)", _FailingWork("alltoall_v", None), after, None)
    for _ in range(2):  # a second wait re-raises without naming the call twice
        with pytest.raises(CommError) as info:
            h.wait()
        assert str(info.value) == "neighbor_allgather(g): nccl alltoall_v #3: rank 1 died"
