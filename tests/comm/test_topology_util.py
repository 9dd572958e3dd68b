"""trainloom.comm.topology_util against Bluefog's own formulas (bluefog/common/topology_util.py).

The reference functions below are Bluefog's builders, transcribed (numpy, ``topo[i][j]`` = weight
of the edge i -> j); ``_bf_recv``/``_bf_send`` are its GetRecvWeights/GetSendWeights read off a
matrix (networkx's predecessors/successors of ``from_numpy_array`` are the non-zero entries of a
column/row, in node order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainloom.comm import topology as tp
from trainloom.comm import topology_util as tu

SIZES = range(1, 10)


def _roll(x: np.ndarray) -> np.ndarray:
    size = len(x)
    topo = np.empty((size, size))
    for i in range(size):
        topo[i] = np.roll(x, i)
    return topo


def _is_power_of(x: int, base: int) -> bool:
    return (base ** int(math.log(x, base))) == x


def bf_exp2(size):
    x = np.array([1.0 if i & (i - 1) == 0 else 0 for i in range(size)])
    x /= x.sum()
    return _roll(x)


def bf_exp(size, base=2):
    x = [1.0]
    for i in range(1, size):
        x.append(1.0 if _is_power_of(i, base) else 0.0)
    x = np.array(x)
    x /= x.sum()
    return _roll(x)


def bf_sym_exp(size, base=4):
    x = [1.0]
    for i in range(1, size):
        index = i if i <= size // 2 else size - i
        x.append(1.0 if _is_power_of(index, base) else 0.0)
    x = np.array(x)
    x /= x.sum()
    return _roll(x)


def bf_mesh(size, shape=None):
    if shape is None:
        i = int(np.sqrt(size))
        while size % i != 0:
            i -= 1
        shape = (i, size // i)
    nrow, ncol = shape
    topo = np.zeros((size, size))
    for i in range(size):
        topo[i][i] = 1.0
        if (i + 1) % ncol != 0:
            topo[i][i + 1] = 1.0
            topo[i + 1][i] = 1.0
        if i + ncol < size:
            topo[i][i + ncol] = 1.0
            topo[i + ncol][i] = 1.0
    nb = [np.nonzero(topo[i])[0] for i in range(size)]
    for i in range(size):
        for j in nb[i]:
            if i != j:
                topo[i][j] = 1.0 / max(len(nb[i]), len(nb[j]))
        topo[i][i] = 2.0 - topo[i].sum()
    return topo


def bf_star(size, center_rank=0):
    topo = np.zeros((size, size))
    for i in range(size):
        topo[i, i] = 1 - 1 / size
        topo[center_rank, i] = 1 / size
        topo[i, center_rank] = 1 / size
    return topo


def bf_ring(size, connect_style=0):
    if size == 1:
        return np.array([[1.0]])
    if size == 2:
        return np.array([[0.5, 0.5], [0.5, 0.5]])
    x = np.zeros(size)
    x[0] = 0.5
    if connect_style == 0:
        x[0] = 1 / 3.0
        x[-1] = 1 / 3.0
        x[1] = 1 / 3.0
    elif connect_style == 1:
        x[-1] = 0.5
    elif connect_style == 2:
        x[1] = 0.5
    return _roll(x)


def bf_full(size):
    return _roll(np.array([1 / size] * size))


def _bf_recv(m, rank):
    self_weight, nw = 0.0, {}
    for src in range(len(m)):
        if m[src][rank] != 0:
            if src == rank:
                self_weight = m[src][rank]
            else:
                nw[src] = m[src][rank]
    return self_weight, nw


def _bf_send(m, rank):
    self_weight, nw = 0.0, {}
    for dst in range(len(m)):
        if m[rank][dst] != 0:
            if dst == rank:
                self_weight = m[rank][dst]
            else:
                nw[dst] = m[rank][dst]
    return self_weight, nw


def cases():
    for n in SIZES:
        yield f"exp2-{n}", tu.ExponentialTwoGraph(n), bf_exp2(n)
        yield f"power2ring-{n}", tu.PowerTwoRingGraph(n), bf_exp2(n)
        for base in (2, 3, 4):
            yield f"exp{base}-{n}", tu.ExponentialGraph(n, base), bf_exp(n, base)
            yield f"power{base}-{n}", tu.PowerGraph(n, base), bf_exp(n, base)
        yield f"symexp-{n}", tu.SymmetricExponentialGraph(n), bf_sym_exp(n)
        yield f"symexp2-{n}", tu.SymmetricPowerGraph(n, 2), bf_sym_exp(n, 2)
        yield f"mesh-{n}", tu.MeshGrid2DGraph(n), bf_mesh(n)
        yield f"mesh1x{n}", tu.MeshGrid2DGraph(n, (1, n)), bf_mesh(n, (1, n))
        for c in range(n):
            yield f"star{c}-{n}", tu.StarGraph(n, c), bf_star(n, c)
        for style in (0, 1, 2):
            yield f"ring{style}-{n}", tu.RingGraph(n, style), bf_ring(n, style)
        yield f"full-{n}", tu.FullyConnectedGraph(n), bf_full(n)
    yield "mesh2x3", tu.MeshGrid2DGraph(6, (2, 3)), bf_mesh(6, (2, 3))
    yield "mesh3x2", tu.MeshGrid2DGraph(6, (3, 2)), bf_mesh(6, (3, 2))
    yield "exp3-28", tu.ExponentialGraph(28, 3), bf_exp(28, 3)
    yield "exp3-244", tu.ExponentialGraph(244, 3), bf_exp(244, 3)  # Bluefog's float log misses 243


@pytest.mark.parametrize("name,topo,ref", list(cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_builders_match_bluefogs_matrices_exactly(name, topo, ref):
    assert topo.matrix() == ref.tolist()  # the same floats, bit for bit
    assert topo.weighted
    n = len(ref)
    for r in range(n):
        assert tu.GetRecvWeights(topo, r) == _bf_recv(ref, r)
        assert tu.GetSendWeights(topo, r) == _bf_send(ref, r)
        # the networkx-style queries Bluefog scripts make on load_topology()
        assert topo.predecessors(r) == [int(i) for i in np.nonzero(ref[:, r])[0]]
        assert topo.successors(r) == [int(j) for j in np.nonzero(ref[r])[0]]
        assert topo.in_degree(r) == np.count_nonzero(ref[:, r])
        assert topo.out_degree(r) == np.count_nonzero(ref[r])
    assert topo.number_of_nodes() == n
    assert topo.number_of_edges() == np.count_nonzero(ref)


def test_against_networkx_when_installed():
    nx = pytest.importorskip("networkx")
    for _name, topo, ref in cases():
        g = nx.from_numpy_array(ref, create_using=nx.DiGraph)
        assert topo.number_of_edges() == g.number_of_edges()
        for r in range(len(ref)):
            assert topo.predecessors(r) == list(g.predecessors(r))
            assert topo.successors(r) == list(g.successors(r))
            assert topo.in_degree(r) == g.in_degree(r) and topo.out_degree(r) == g.out_degree(r)
        degrees = [g.degree(r) for r in range(len(ref))]
        assert tu.IsRegularGraph(topo) == all(d == degrees[0] for d in degrees)


def test_ring_directions_are_bluefogs():
    # style 1: x[-1] = 0.5, row i = np.roll(x, i): the edge i -> i - 1, so rank 0 receives from 1
    assert tu.RingGraph(4, 1).in_neighbors(0) == [1] == tp.RingGraph(4, 1).in_neighbors(0)
    assert tu.RingGraph(4, 2).in_neighbors(0) == [3] == tp.RingGraph(4, 2).in_neighbors(0)
    for n in SIZES:
        for style in (0, 1, 2):
            assert tu.IsTopologyEquivalent(tp.RingGraph(n, style), tu.RingGraph(n, style)), (n, style)
        assert tu.IsTopologyEquivalent(tp.ExponentialTwoGraph(n), tu.ExponentialTwoGraph(n))
        assert tu.IsTopologyEquivalent(tp.FullyConnectedGraph(n), tu.FullyConnectedGraph(n))


def test_topology_equivalence():
    assert tu.IsTopologyEquivalent(tu.StarGraph(4), tu.StarGraph(4))
    assert not tu.IsTopologyEquivalent(tu.StarGraph(4), tu.StarGraph(4, 1))
    assert not tu.IsTopologyEquivalent(tu.StarGraph(4), tu.StarGraph(5))
    assert not tu.IsTopologyEquivalent(tu.RingGraph(4, 1), tu.RingGraph(4, 2))
    assert not tu.IsTopologyEquivalent(None, tu.StarGraph(4))
    assert not tu.IsTopologyEquivalent(tu.StarGraph(4), None)
    # same edges, other weights
    a = tp.Topology.from_matrix([[0.5, 0.5], [0.5, 0.5]])
    b = tp.Topology.from_matrix([[0.75, 0.5], [0.25, 0.5]])
    assert not tu.IsTopologyEquivalent(a, b)
    assert tu.IsRegularGraph(tu.RingGraph(5)) and not tu.IsRegularGraph(tu.StarGraph(4))


def test_topologies_accept_any_finite_weights_as_bluefog_does():
    # a weighted sum (columns summing to 2) and a negative weight, as a networkx.DiGraph may hold
    t = tp.Topology.from_matrix([[1.0, 1.0], [1.0, 1.0]])
    assert tu.GetRecvWeights(t, 0) == (1.0, {1: 1.0}) and t.number_of_edges() == 4
    n = tp.Topology.from_matrix([[1.5, -0.5], [-0.5, 1.5]])
    assert n.in_weights(1) == {0: -0.5} and n.self_weight(1) == 1.5
    e = tp.Topology.from_edges(3, {(0, 1): 2.0, (2, 1): -1.0}, self_weights=[1.0, 0.0, 1.0])
    assert e.predecessors(1) == [0, 2] and e.successors(1) == [] and e.in_degree(0) == 1


def test_bad_inputs_raise_exact_errors():
    def err(exc, fn, *args):
        with pytest.raises(exc) as e:
            fn(*args)
        return str(e.value)

    assert err(ValueError, tu.ExponentialGraph, 4, 1) == "ExponentialGraph: base must be an int > 1, got 1"
    assert err(TypeError, tu.ExponentialGraph, 4, 2.5) == (
        "ExponentialGraph: base must be an int > 1, got 2.5 (float)"
    )
    assert err(ValueError, tu.SymmetricExponentialGraph, 4, 0) == (
        "SymmetricExponentialGraph: base must be an int > 1, got 0"
    )
    assert err(ValueError, tu.ExponentialTwoGraph, 0) == (
        "ExponentialTwoGraph: size must be an int >= 1, got 0"
    )
    assert err(TypeError, tu.StarGraph, "4") == "StarGraph: size must be an int >= 1, got '4' (str)"
    assert err(ValueError, tu.StarGraph, 4, 4) == "StarGraph: center_rank=4 is outside 0..3"
    assert err(TypeError, tu.StarGraph, 4, None) == "StarGraph: center_rank must be an int, got None"
    assert err(ValueError, tu.MeshGrid2DGraph, 6, (4, 2)) == (
        "MeshGrid2DGraph: shape (4, 2) does not match size 6 (need nrow * ncol == size)"
    )
    assert err(TypeError, tu.MeshGrid2DGraph, 6, 6) == (
        "MeshGrid2DGraph: shape must be a pair (nrow, ncol), got 6"
    )
    assert err(TypeError, tu.MeshGrid2DGraph, 6, (2.0, 3)) == (
        "MeshGrid2DGraph: shape must be a pair of ints (nrow, ncol), got (2.0, 3)"
    )
    assert err(ValueError, tu.RingGraph, 4, 3) == "RingGraph: connect_style must be 0, 1 or 2, got 3"
    assert err(TypeError, tu.GetRecvWeights, [[1.0]], 0) == (
        "GetRecvWeights: topo must be a trainloom.comm.topology.Topology (e.g. load_topology()), got list"
    )
    assert err(TypeError, tu.GetSendWeights, None, 0).startswith("GetSendWeights: topo must be a trainloom")
    assert err(ValueError, tu.GetSendWeights, tu.StarGraph(3), 3) == "Topology: rank 3 is outside 0..2"
    assert err(TypeError, tu.IsTopologyEquivalent, tu.StarGraph(3), "x").startswith(
        "IsTopologyEquivalent: topo must be a trainloom.comm.topology.Topology"
    )
    assert err(TypeError, tu.IsRegularGraph, 3).endswith("got int")
    assert err(TypeError, tu.StarGraph(3).predecessors, "0") == "Topology: rank must be an int, got '0' (str)"
