"""Bluefog's ``bluefog.common.topology_util`` over trainloom's :class:`~trainloom.comm.topology.Topology`.

A Bluefog script moves over by changing this import too::

    from trainloom.comm import topology_util      # was: from bluefog.common import topology_util

    bf.set_topology(topology_util.StarGraph(bf.size()), is_weighted=True)
    self_weight, neighbor_weights = topology_util.GetRecvWeights(bf.load_topology(), bf.rank())

The builders compute Bluefog's weight matrices with Bluefog's own numpy formulas (so the weights
are the same floats, including the diagonal of :func:`MeshGrid2DGraph`, which Bluefog computes as
``2.0 - row.sum()``) and return them as weighted Topology objects (:meth:`Topology.from_matrix`),
not ``networkx.DiGraph``; ``W[i][j]`` is the weight rank ``j`` gives to rank ``i``'s value, as in
Bluefog. The queries (:func:`GetRecvWeights`, :func:`GetSendWeights`, :func:`IsTopologyEquivalent`,
:func:`IsRegularGraph`) take any Topology, e.g. the one :func:`~trainloom.comm.topology.load_topology`
returns. ``Topology`` also answers the networkx calls Bluefog scripts make on a topology
(``number_of_nodes``, ``number_of_edges``, ``predecessors``, ``successors``, ``in_degree``,
``out_degree``; self loops counted as networkx counts them), and ``topo.matrix()`` replaces
``nx.to_numpy_matrix(topo)``.

Not provided: the dynamic-topology generators (``GetDynamicSendRecvRanks``,
``GetInnerOuterRingDynamicSendRecvRanks``, ``GetInnerOuterExp2DynamicSendRecvRanks``,
``GetExp2DynamicSendRecvMachineRanks``) and the machine-level ``InnerOuterRingGraph`` /
``InnerOuterExp2Graph``: trainloom's neighbour collectives have no dynamic (``send_neighbors`` /
``dst_weights``) mode.

Example::

    from trainloom.comm import topology_util as tu

    tu.StarGraph(4).in_weights(0)              # {1: 0.25, 2: 0.25, 3: 0.25}
    tu.GetRecvWeights(tu.RingGraph(4, 1), 0)   # (0.5, {1: 0.5})
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np

from trainloom.comm.env import as_int
from trainloom.comm.topology import Topology, _check_size

__all__ = [
    "ExponentialTwoGraph",
    "PowerTwoRingGraph",
    "ExponentialGraph",
    "PowerGraph",
    "SymmetricExponentialGraph",
    "SymmetricPowerGraph",
    "MeshGrid2DGraph",
    "StarGraph",
    "RingGraph",
    "FullyConnectedGraph",
    "GetRecvWeights",
    "GetSendWeights",
    "IsTopologyEquivalent",
    "IsRegularGraph",
]


def _circulant(x: np.ndarray) -> Topology:
    """Bluefog's ``topo[i] = np.roll(x, i)``: rank ``i`` sends to ``i + k`` with weight ``x[k]``."""
    size = len(x)
    topo = np.empty((size, size))
    for i in range(size):
        topo[i] = np.roll(x, i)
    return Topology.from_matrix(topo)


def _base(base: Any, who: str) -> int:
    b = as_int(base)
    if b is None:
        raise TypeError(f"{who}: base must be an int > 1, got {base!r} ({type(base).__name__})")
    if b <= 1:
        raise ValueError(f"{who}: base must be an int > 1, got {b}")
    return b


def _is_power_of(x: int, base: int) -> bool:
    # Bluefog's isPowerOf, with its float logarithm: it misses powers whose log rounds down, e.g.
    # 243 = 3**5 (math.log(243, 3) = 4.999...), so ExponentialGraph(244, 3) has no edge at offset 243
    # in Bluefog either.
    return bool(base ** int(math.log(x, base)) == x)


def ExponentialTwoGraph(size: int) -> Topology:  # noqa: N802 - Bluefog's name
    """Rank ``i`` sends to ``i + 2**k (mod size)``; weights ``1 / (number of offsets + 1)``.

    Bluefog's ``ExponentialTwoGraph`` (``PowerTwoRingGraph`` in older releases) and default topology.

    Example::

        ExponentialTwoGraph(4).in_weights(0)        # {2: 1/3, 3: 1/3}
    """
    size = _check_size(size, "ExponentialTwoGraph")
    x = np.array([1.0 if i & (i - 1) == 0 else 0 for i in range(size)])
    x /= x.sum()
    return _circulant(x)


def PowerTwoRingGraph(size: int) -> Topology:  # noqa: N802 - Bluefog's name
    """Older Bluefog name of :func:`ExponentialTwoGraph`."""
    return ExponentialTwoGraph(size)


def ExponentialGraph(size: int, base: int = 2) -> Topology:  # noqa: N802 - Bluefog's name
    """Rank ``i`` sends to ``i + base**k (mod size)``; uniform weights (Bluefog's ``ExponentialGraph``).

    Raises:
        TypeError: ``size`` or ``base`` is not an integer.
        ValueError: ``size < 1`` or ``base < 2``.

    Example::

        ExponentialGraph(5, base=3).in_neighbors(0)   # [2, 4]
    """
    size = _check_size(size, "ExponentialGraph")
    base = _base(base, "ExponentialGraph")
    x = np.array([1.0] + [1.0 if _is_power_of(i, base) else 0.0 for i in range(1, size)])
    x /= x.sum()
    return _circulant(x)


def PowerGraph(size: int, base: int = 2) -> Topology:  # noqa: N802 - Bluefog's name
    """Older Bluefog name of :func:`ExponentialGraph`."""
    return ExponentialGraph(size, base)


def SymmetricExponentialGraph(size: int, base: int = 4) -> Topology:  # noqa: N802 - Bluefog's name
    """Offsets ``base**k`` and their mirrors ``size - base**k``; uniform weights.

    Raises:
        TypeError: ``size`` or ``base`` is not an integer.
        ValueError: ``size < 1`` or ``base < 2``.
    """
    size = _check_size(size, "SymmetricExponentialGraph")
    base = _base(base, "SymmetricExponentialGraph")
    x = [1.0]
    for i in range(1, size):
        index = i if i <= size // 2 else size - i
        x.append(1.0 if _is_power_of(index, base) else 0.0)
    xa = np.array(x)
    xa /= xa.sum()
    return _circulant(xa)


def SymmetricPowerGraph(size: int, base: int = 4) -> Topology:  # noqa: N802 - Bluefog's name
    """Older Bluefog name of :func:`SymmetricExponentialGraph`."""
    return SymmetricExponentialGraph(size, base)


def MeshGrid2DGraph(size: int, shape: Optional[Tuple[int, int]] = None) -> Topology:  # noqa: N802
    """A 2-D grid (rows of ``ncol`` ranks, neighbours left/right/up/down) with Hastings weights.

    Args:
        size: number of ranks.
        shape: ``(nrow, ncol)`` with ``nrow * ncol == size``; default the two closest factors of
            ``size`` (``nrow <= ncol``; a prime size gives one row).

    Weights (Bluefog's, Hastings rule): ``1 / max(deg_i, deg_j)`` per edge, degrees counting the rank
    itself; each rank's self weight makes its row sum to 1.

    Raises:
        TypeError: ``size`` or an entry of ``shape`` is not an integer, ``shape`` is not a pair.
        ValueError: ``size < 1``, or ``nrow * ncol != size``.

    Example::

        MeshGrid2DGraph(4).in_neighbors(0)           # [1, 2]  (a 2 x 2 grid)
    """
    size = _check_size(size, "MeshGrid2DGraph")
    if shape is None:
        i = int(np.sqrt(size))
        while size % i != 0:
            i -= 1
        nrow, ncol = i, size // i
    else:
        try:
            a, b = shape
        except (TypeError, ValueError):
            raise TypeError(f"MeshGrid2DGraph: shape must be a pair (nrow, ncol), got {shape!r}") from None
        nrow_i, ncol_i = as_int(a), as_int(b)
        if nrow_i is None or ncol_i is None:
            raise TypeError(f"MeshGrid2DGraph: shape must be a pair of ints (nrow, ncol), got {shape!r}")
        nrow, ncol = nrow_i, ncol_i
        if nrow < 1 or ncol < 1 or nrow * ncol != size:
            raise ValueError(
                f"MeshGrid2DGraph: shape {shape!r} does not match size {size} (need nrow * ncol == size)"
            )
    topo = np.zeros((size, size))
    for i in range(size):
        topo[i][i] = 1.0
        if (i + 1) % ncol != 0:
            topo[i][i + 1] = 1.0
            topo[i + 1][i] = 1.0
        if i + ncol < size:
            topo[i][i + ncol] = 1.0
            topo[i + ncol][i] = 1.0
    with_self = [np.nonzero(topo[i])[0] for i in range(size)]
    for i in range(size):
        for j in with_self[i]:
            if i != j:
                topo[i][j] = 1.0 / max(len(with_self[i]), len(with_self[j]))
        topo[i][i] = 2.0 - topo[i].sum()
    return Topology.from_matrix(topo)


def StarGraph(size: int, center_rank: int = 0) -> Topology:  # noqa: N802 - Bluefog's name
    """Every rank exchanges with ``center_rank`` in both directions (Bluefog's ``StarGraph``).

    Weights: ``1 / size`` on every edge and on the centre's own value; ``1 - 1 / size`` on the
    other ranks' own values (so the centre averages everyone uniformly).

    Raises:
        TypeError: ``size`` or ``center_rank`` is not an integer.
        ValueError: ``size < 1`` or ``center_rank`` outside ``0..size-1``.

    Example::

        StarGraph(4, center_rank=1).in_neighbors(0)    # [1]
    """
    size = _check_size(size, "StarGraph")
    c = as_int(center_rank)
    if c is None:
        raise TypeError(f"StarGraph: center_rank must be an int, got {center_rank!r}")
    if not 0 <= c < size:
        raise ValueError(f"StarGraph: center_rank={c} is outside 0..{size - 1}")
    topo = np.zeros((size, size))
    for i in range(size):
        topo[i, i] = 1 - 1 / size
        topo[c, i] = 1 / size
        topo[i, c] = 1 / size
    return Topology.from_matrix(topo)


def RingGraph(size: int, connect_style: int = 0) -> Topology:  # noqa: N802 - Bluefog's name
    """A ring with Bluefog's weights (the same graph as :func:`trainloom.comm.topology.RingGraph`).

    Args:
        size: number of ranks.
        connect_style: 0 both directions (weights 1/3); 1 rank ``i`` sends to ``i - 1`` (so it
            receives from ``i + 1``), 2 rank ``i`` sends to ``i + 1`` (receives from ``i - 1``),
            weights 1/2. 1 or 2 ranks: ``[[1.0]]`` and ``[[0.5, 0.5], [0.5, 0.5]]`` for every style.

    Raises:
        ValueError: ``size < 1`` or ``connect_style`` not 0, 1 or 2.
    """
    size = _check_size(size, "RingGraph")
    if connect_style not in (0, 1, 2):
        raise ValueError(f"RingGraph: connect_style must be 0, 1 or 2, got {connect_style!r}")
    if size == 1:
        return Topology.from_matrix([[1.0]])
    if size == 2:
        return Topology.from_matrix([[0.5, 0.5], [0.5, 0.5]])
    x = np.zeros(size)
    x[0] = 0.5
    if connect_style == 0:
        x[0] = 1 / 3.0
        x[-1] = 1 / 3.0
        x[1] = 1 / 3.0
    elif connect_style == 1:
        x[-1] = 0.5
    else:
        x[1] = 0.5
    return _circulant(x)


def FullyConnectedGraph(size: int) -> Topology:  # noqa: N802 - Bluefog's name
    """Every rank receives from every other; weights ``1 / size`` (Bluefog's ``FullyConnectedGraph``)."""
    size = _check_size(size, "FullyConnectedGraph")
    return _circulant(np.array([1 / size] * size))


def _topology(topo: Any, who: str) -> Topology:
    if not isinstance(topo, Topology):
        raise TypeError(
            f"{who}: topo must be a trainloom.comm.topology.Topology (e.g. load_topology()), "
            f"got {type(topo).__name__}"
        )
    return topo


def GetRecvWeights(topo: Topology, rank: int) -> Tuple[float, Dict[int, float]]:  # noqa: N802
    """``(self_weight, {in-neighbour: weight})`` of ``rank``: column ``rank`` of the weight matrix.

    As Bluefog: the self weight is ``W[rank][rank]`` (0.0 without a self loop), the dict holds
    ``W[src][rank]`` for every in-neighbour ``src``, in rank order. For a uniform topology (e.g.
    :func:`trainloom.comm.topology.RingGraph`) these are its uniform weights.

    Raises:
        TypeError: ``topo`` is not a Topology, ``rank`` not an int.
        ValueError: ``rank`` outside the topology.

    Example::

        GetRecvWeights(StarGraph(4), 0)      # (0.25, {1: 0.25, 2: 0.25, 3: 0.25})
    """
    t = _topology(topo, "GetRecvWeights")
    return t.self_weight(rank), t.in_weights(rank)


def GetSendWeights(topo: Topology, rank: int) -> Tuple[float, Dict[int, float]]:  # noqa: N802
    """``(self_weight, {out-neighbour: weight})`` of ``rank``: row ``rank`` of the weight matrix.

    As Bluefog: the dict holds ``W[rank][dst]``, the weight each out-neighbour ``dst`` gives to
    ``rank``'s value.

    Raises:
        TypeError: ``topo`` is not a Topology, ``rank`` not an int.
        ValueError: ``rank`` outside the topology.

    Example::

        GetSendWeights(StarGraph(4), 1)      # (0.75, {0: 0.25})
    """
    t = _topology(topo, "GetSendWeights")
    r = t._rank(rank)
    return t.self_weight(r), {dst: t.in_weights(dst)[r] for dst in t.out_neighbors(r)}


def IsTopologyEquivalent(topo1: Optional[Topology], topo2: Optional[Topology]) -> bool:  # noqa: N802
    """Whether two topologies have the same weight matrix (Bluefog: no isomorphism, None is never equal).

    Unlike ``==``, whether the weights are uniform or user-chosen (``Topology.weighted``) is not
    compared: ``IsTopologyEquivalent(topology.RingGraph(4), topology_util.RingGraph(4))`` is True.

    Raises:
        TypeError: an argument that is neither None nor a Topology.
    """
    if topo1 is None or topo2 is None:
        return False
    t1 = _topology(topo1, "IsTopologyEquivalent")
    t2 = _topology(topo2, "IsTopologyEquivalent")
    if t1.number_of_nodes() != t2.number_of_nodes() or t1.number_of_edges() != t2.number_of_edges():
        return False
    return t1.matrix() == t2.matrix()


def IsRegularGraph(topo: Topology) -> bool:  # noqa: N802 - Bluefog's name
    """Whether every rank has the same degree (in + out, self loops counted twice, as networkx).

    Raises:
        TypeError: ``topo`` is not a Topology.
    """
    t = _topology(topo, "IsRegularGraph")
    degree = t.in_degree(0) + t.out_degree(0)
    return all(t.in_degree(r) + t.out_degree(r) == degree for r in range(1, t.size))
