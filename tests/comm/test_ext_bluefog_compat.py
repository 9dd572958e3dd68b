"""Bluefog's own expectations, in real 2- to 4-process runs: ring directions, weighted sums, later names.

The expected values are those of Bluefog-Lib/bluefog test/torch_ops_test.py
(test_neighbor_allreduce_avg_ring_topo, test_neighbor_allreduce_sum, test_neighbor_allreduce_sum_precision,
the star and meshgrid tests) and of its ``win_sync_then_collect`` docstring.
"""

from __future__ import annotations

import math

import pytest
import test_ext_ranks as R
import torch
from multiproc import run_ranks
from test_topology_util import bf_mesh  # Bluefog's MeshGrid2DGraph formula

import trainloom.comm.bluefog as bf
from trainloom.comm import optimizers as dopt


@pytest.mark.parametrize("ws", [3, 4])
def test_bluefog_ring_directions_sums_and_later_names(ws):
    res = run_ranks(R.bluefog_directions_and_sums, ws, timeout=120)
    for rank, r in enumerate(res):
        left, right = (rank - 1) % ws, (rank + 1) % ws
        # Bluefog: sum_value = rank + (rank + (1 if connect_direction == 1 else -1)) % size
        for cd in (1, 2):
            sum_value = rank + (rank + (1 if cd == 1 else -1)) % ws
            for label in ("tp", "tu"):
                assert r[f"ring{cd}/{label}"] == [[right if cd == 1 else left], [float(sum_value)] * 23], (
                    cd,
                    label,
                )
        nbrs = [(rank - 2**i) % ws for i in range(int(math.ceil(math.log2(ws))))]
        assert r["exp2_in"] == sorted(nbrs)
        sum_value = float(rank + sum(nbrs))
        assert r["sum"] == [sum_value] * 23  # exact: the plain sum
        assert r["sum_precision"] == [[(len(nbrs) + 1) * 2.0**-256] * 3] * 2  # exact, as Bluefog asserts
        assert r["negative"] == [2.0 * rank - nbrs[0]] * 23
        assert r["nonblocking"] == [sum_value] * 23
        assert r["nonblocking_src"] == [0.5 * rank + 0.5 * nbrs[0]] * 23
        assert r["allreduce_nb"] == [(ws - 1) / 2] * 2
        assert r["allreduce_nb_"] == [True, [ws * (ws - 1) / 2] * 2]
        assert r["broadcast_nb"] == [float(ws - 1)] * 2
        assert r["broadcast_nb_"] == [0.0] * 2
        assert r["allgather_nb"] == [float(i) for i in range(ws)]
        assert r["neighbor_allgather_nb"] == [float(i) for i in sorted(nbrs)]
        assert r["hierarchical"] == (
            "NotImplementedError: allreduce_nonblocking: is_hierarchical_local=True (an allreduce within "
            "each machine) is not supported; call allreduce_async(tensor, comm=...) with a process group of "
            "the machine's ranks"
        )
        assert r["send_neighbors"] == (
            "TypeError: neighbor_allreduce_nonblocking: name must be a str, got list; send_neighbors "
            "(dynamic topologies) is not supported"
        )
        # Bluefog's test_neighbor_allreduce_weighted_avg (star, is_weighted=True), centre 0
        want = (ws - 1) / 2 if rank == 0 else rank * (1 - 1 / ws)
        torch.testing.assert_close(
            torch.tensor(r["weighted_star"], dtype=torch.float64),
            torch.full((23,), want, dtype=torch.float64),
            rtol=0,
            atol=1e-12,
        )
        # Bluefog's test_neighbor_allreduce_avg_meshgrid_topo: uniform over the row's non-zeros
        m = bf_mesh(ws)
        with_self = [int(j) for j in m[rank].nonzero()[0]]
        assert r["mesh"][0] == [j for j in with_self if j != rank]
        torch.testing.assert_close(
            torch.tensor(r["mesh"][1], dtype=torch.float64),
            torch.full((23,), sum(with_self) / len(with_self), dtype=torch.float64),
            rtol=0,
            atol=1e-12,
        )
        recv = {j: float(m[j][rank]) for j in with_self if j != rank}
        assert r["recv_weights"] == (float(m[rank][rank]), recv)
        # windows on a ring: every window value below is exact
        s = [q + (q - 1) % ws + (q + 1) % ws for q in range(ws)]  # rank + its two neighbours
        assert r["win_sum"] == [float(s[rank])] * 3
        assert r["win_sum_sync"] == [float(rank)] * 3  # reset=True zeroed the slots
        assert r["collect"] == [float(s[rank])] * 3 and r["collect_in_place"] == r["collect"]
        assert r["collect_again"] == [float(s[rank])] * 3
        assert r["win_negative"] == [-2.0] * 3
        assert r["put_nb"] == [0.5 * s[left]] * 3
        assert r["accumulate_nb"] == [1.5 * s[left]] * 3
        assert r["get_nb"] == [float(s[left])] * 3
        assert r["put_self_weight"] == (
            "NotImplementedError: win_put_nonblocking: self_weight=0.5 (scaling the tensor after the put) "
            "is not supported; leave it None (1.0) and scale the tensor yourself"
        )


def test_optimizers_take_bluefogs_model_argument():
    res = run_ranks(R.optimizer_model_arg, 2, timeout=90)
    for r in res:
        for kind in ("neighbor", "allreduce"):
            named = r[f"{kind}/named"]
            assert r[f"{kind}/model"] == named
            assert r[f"{kind}/positional"] == named
            assert r[f"{kind}/list"] == named
    # allreduce keeps the replicas identical
    assert res[0]["allreduce/named"] == res[1]["allreduce/named"]


@pytest.mark.parametrize(
    "cls", [dopt.DistributedAllreduceOptimizer, dopt.DistributedNeighborAllreduceOptimizer]
)
def test_model_argument_bad_inputs(cls):
    who = cls.__name__
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(TypeError) as e:
        cls(opt, m.named_parameters(), model=m)
    assert str(e.value) == (
        f"{who}: pass model= or named_parameters=, not both (model=m stands for "
        "named_parameters=m.named_parameters())"
    )
    with pytest.raises(TypeError) as e:
        cls(opt, m, model=m)
    assert str(e.value) == (
        f"{who}: got a model both positionally (second argument) and as model=; pass it once"
    )
    with pytest.raises(TypeError) as e:
        cls(opt, model="m")
    assert str(e.value) == f"{who}: model must be a torch.nn.Module or a non-empty list of them, got str"
    with pytest.raises(TypeError) as e:
        cls(opt, model=[])
    assert str(e.value) == f"{who}: model must be a torch.nn.Module or a non-empty list of them, got list"
    # a model that does not hold the optimizer's parameters: the named_parameters check applies
    with pytest.raises(ValueError) as e:
        cls(opt, model=torch.nn.Linear(2, 1))
    assert str(e.value).startswith(f"{who}: 2 of the optimizer's parameters are not in named_parameters")
    # two models with the same parameter names: duplicates, as Bluefog's _check_named_parameters
    with pytest.raises(ValueError) as e:
        cls(opt, model=[m, torch.nn.Linear(2, 1)])
    assert str(e.value) == f"{who}: named_parameters has duplicate names ['bias', 'weight']"


def test_later_bluefog_names_are_the_same_functions():
    assert bf.allgather_nonblocking is bf.allgather_async
    assert bf.broadcast_nonblocking is bf.broadcast_async
    assert bf.broadcast_nonblocking_ is bf.broadcast_async_
    assert bf.neighbor_allgather_nonblocking is bf.neighbor_allgather_async
    assert bf.win_get_nonblocking is bf.win_get_async
    assert bf.wait is bf.synchronize
    for name in bf.__all__:
        assert hasattr(bf, name), name
    # docs/comm-ext.md: bluefog is every module of the table plus init, shutdown, ...
    import trainloom.comm.state as state

    assert set(state.__all__) <= set(bf.__all__)
    assert bf.broadcast_object is state.broadcast_object


def autograd_ranks(rank: int, ws: int) -> dict:
    import trainloom.comm.bluefog as bf

    bf.init()
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (2 * x + bf.broadcast(x, root_rank=0)).sum().backward()
    out = {"broadcast": x.grad.tolist()}
    x.grad = None
    bf.allreduce(x * (rank + 1)).sum().backward()  # mean over ranks; its backward averages too
    out["allreduce"] = x.grad.tolist()
    x.grad = None
    bf.allreduce(x * (rank + 1), average=False).sum().backward()
    out["allreduce_sum"] = x.grad.tolist()
    with torch.no_grad():
        out["no_grad"] = bf.broadcast(x, root_rank=0).requires_grad
    bf.shutdown()
    return out


def test_broadcast_and_allreduce_are_differentiable_as_in_bluefog():
    # Bluefog documents broadcast as "a thin wrapper around an autograd function"; trainloom's output
    # had no gradient history, so a loss through it silently lost that term.
    res = run_ranks(autograd_ranks, 2, timeout=90)
    assert res[0]["broadcast"] == [4.0] * 3  # 2 (local) + the sum of both ranks' gradients, on the root
    assert res[1]["broadcast"] == [2.0] * 3  # the local path only
    for rank, r in enumerate(res):
        assert r["allreduce"] == [float(rank + 1)] * 3  # d/dx of mean_r((r+1) x) through averaged grads
        assert r["allreduce_sum"] == [2.0 * (rank + 1)] * 3  # summed forward, summed backward
        assert r["no_grad"] is False


def init_twice_ranks(rank: int, ws: int) -> dict:
    import trainloom.comm as C
    import trainloom.comm.bluefog as bf

    bf.init(lambda n: bf.RingGraph(n, 2))
    first = bf.neighbor_allreduce(torch.full((1,), float(rank)), name="x").item()
    bf.init()  # as in a unittest setUp: keeps the group, sets the default topology again
    out = {"first": first, "in_neighbors": bf.in_neighbor_ranks(), "initialized": C.is_initialized()}
    out["second"] = bf.neighbor_allreduce(torch.full((1,), float(rank)), name="x").item()
    bf.shutdown()
    return out


def test_init_again_keeps_the_group_and_resets_the_topology_as_bluefog():
    """Bluefog's init is InitializeBluefogOnce and its own tests call bf.init() in every setUp; the
    second call used to raise RepeatedInitializationError."""
    ws = 3
    res = run_ranks(init_twice_ranks, ws, timeout=90)
    for rank, r in enumerate(res):
        assert r["first"] == 0.5 * rank + 0.5 * ((rank - 1) % ws)  # RingGraph(n, 2): from r - 1 only
        assert r["initialized"] is True
        assert sorted(r["in_neighbors"]) == sorted({(rank - 1) % ws, (rank - 2) % ws})  # ExponentialTwo of 3
        assert r["second"] == sum(range(ws)) / ws  # uniform over self and both in-neighbours
