"""Virtual topologies for neighbour collectives (Bluefog's ``set_topology`` and ``topology_util``).

A :class:`Topology` is a weighted directed graph over the ranks of a communicator. An edge
``i -> j`` means rank ``j`` receives rank ``i``'s value in :func:`trainloom.comm.neighbor.neighbor_allreduce`
and weighs it with ``weight(i, j)``; ``self_weight(j)`` weighs rank ``j``'s own value. As in Bluefog,
the weight matrix ``W[i][j]`` (``W[j][j]`` the self weight) is read column by column: rank ``j``
computes ``W[j][j] * x_j + sum_i W[i][j] * x_i``. The builders here make columns that sum to 1 (a
weighted *average*); like Bluefog, a topology may hold any finite weights (e.g. a weighted sum).

Builders: :func:`ExponentialTwoGraph` (Bluefog's default), :func:`RingGraph`,
:func:`FullyConnectedGraph`, :meth:`Topology.from_edges`, :meth:`Topology.from_matrix`, and the
Bluefog ``topology_util`` builders in :mod:`trainloom.comm.topology_util`. Each communicator has
one topology, set with :func:`set_topology` and read with :func:`load_topology`; a communicator
without one uses ``ExponentialTwoGraph(nranks)``.

Example::

    import trainloom.comm as C
    from trainloom.comm.topology import RingGraph, set_topology, in_neighbor_ranks

    C.init_process_group()
    set_topology(RingGraph(C.get_world_size()))
    in_neighbor_ranks()          # [rank - 1, rank + 1] (mod world size)
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

from trainloom._numbers import is_real
from trainloom.comm.env import as_int, get_rank
from trainloom.comm.group import NON_COMM_MEMBER, WORLD, Communicator, ProcessGroup, get_default_group
from trainloom.errors import CommError, ConfigError

__all__ = [
    "Topology",
    "ExponentialTwoGraph",
    "RingGraph",
    "FullyConnectedGraph",
    "set_topology",
    "load_topology",
    "is_topo_weighted",
    "in_neighbor_ranks",
    "out_neighbor_ranks",
    "resolve_comm",
]


def _check_weight(value: Any, what: str) -> float:
    """``value`` as a float: TypeError unless a real number, ValueError unless finite.

    Any finite value is a weight, negative ones and sums other than 1 included, as in Bluefog
    (which checks only the types and the ranks of weights).
    """
    if not is_real(value):
        raise TypeError(f"{what} must be a real number, got {value!r}")
    w = float(value)
    if not math.isfinite(w):
        raise ValueError(f"{what} must be finite, got {w}")
    return w


def _check_size(size: Any, who: str) -> int:
    """``size`` as an int >= 1 (numpy integers accepted): TypeError for non-integers, ValueError < 1."""
    n = as_int(size)
    if n is None:
        raise TypeError(f"{who}: size must be an int >= 1, got {size!r} ({type(size).__name__})")
    if n < 1:
        raise ValueError(f"{who}: size must be an int >= 1, got {n}")
    return n


class Topology:
    """A weighted directed graph over ``size`` ranks (edge ``i -> j``: ``j`` receives from ``i``).

    Args:
        size: number of ranks.
        in_weights: for every rank ``j``, a mapping ``{i: weight}`` of its in-neighbours ``i != j``.
        self_weights: for every rank, the weight of its own value.
        weighted: whether the weights are user-chosen (Bluefog's ``is_weighted``); unweighted
            topologies average uniformly over in-neighbours and self.

    Weights are any finite numbers (as in Bluefog's ``networkx.DiGraph`` topologies): columns that
    sum to 1 average, others give a weighted sum. A weight of 0 is no edge.

    Raises:
        ValueError: a rank outside ``0..size-1``, a self edge in ``in_weights``, a non-finite weight.
        TypeError: a weight that is not a real number, a rank that is not an integer.

    Example::

        topo = Topology.from_edges(3, [(0, 1), (1, 2), (2, 0)])    # a directed ring, uniform weights
        topo.in_neighbors(1)                                        # [0]
    """

    def __init__(
        self,
        size: int,
        in_weights: Sequence[Mapping[int, float]],
        self_weights: Sequence[float],
        weighted: bool = True,
    ) -> None:
        size = _check_size(size, "Topology")
        if len(in_weights) != size or len(self_weights) != size:
            raise ValueError(
                f"Topology: in_weights and self_weights need {size} entries (one per rank), got "
                f"{len(in_weights)} and {len(self_weights)}"
            )
        self.size = size
        self.weighted = bool(weighted)
        self._in: List[Dict[int, float]] = []
        self._self: List[float] = []
        for j in range(size):
            row: Dict[int, float] = {}
            for key, w in dict(in_weights[j]).items():
                i = as_int(key)
                if i is None:
                    raise TypeError(
                        f"Topology: rank {j} has in-neighbour {key!r}, which is not an int rank "
                        f"({type(key).__name__})"
                    )
                if not 0 <= i < size:
                    raise ValueError(f"Topology: rank {j} has in-neighbour {i} outside 0..{size - 1}")
                if i == j:
                    raise ValueError(f"Topology: rank {j} lists itself as in-neighbour; use self_weights")
                weight = _check_weight(w, f"Topology: weight of edge {i} -> {j}")
                if weight != 0.0:  # a zero weight is no edge (as a 0 in from_matrix)
                    row[i] = weight
            sw = _check_weight(self_weights[j], f"Topology: self weight of rank {j}")
            self._in.append(dict(sorted(row.items())))
            self._self.append(sw)
        self._out: List[List[int]] = [[] for _ in range(size)]
        for j in range(size):
            for i in self._in[j]:
                self._out[i].append(j)
        for lst in self._out:
            lst.sort()

    # ------------------------------------------------------------ builders
    @classmethod
    def from_edges(
        cls,
        size: int,
        edges: Union[Iterable[Tuple[int, int]], Mapping[Tuple[int, int], float]],
        self_weights: Optional[Sequence[float]] = None,
    ) -> Topology:
        """A topology from directed edges ``(src, dst)``.

        Args:
            size: number of ranks.
            edges: pairs ``(src, dst)`` (uniform weights ``1 / (in_degree + 1)`` for every rank), or
                a mapping ``{(src, dst): weight}`` together with ``self_weights``.
            self_weights: one per rank; required with weighted edges.

        An edge given weight 0 is no edge (it is dropped, as a 0 in :meth:`from_matrix`): the
        receiver does not list the sender as an in-neighbour, also when the topology is later used
        unweighted. Ranks may be Python or numpy integers.

        Raises:
            ValueError: weighted edges without ``self_weights`` (or the reverse), ranks outside
                ``0..size-1``, self loops, bad weights.
            TypeError: a rank or the size that is not an integer.

        Example::

            Topology.from_edges(2, {(0, 1): 0.5, (1, 0): 0.25}, self_weights=[0.75, 0.5])
        """
        size = _check_size(size, "Topology.from_edges")
        ins: List[Dict[int, float]] = [{} for _ in range(size)]
        if isinstance(edges, Mapping):
            if self_weights is None:
                raise ValueError("Topology.from_edges: weighted edges need self_weights (one per rank)")
            for key, w in edges.items():
                src, dst = _edge(key, size)
                ins[dst][src] = w
            return cls(size, ins, list(self_weights), weighted=True)
        if self_weights is not None:
            raise ValueError(
                "Topology.from_edges: self_weights given with unweighted edges; pass {(src, dst): weight}"
            )
        for key in edges:
            src, dst = _edge(key, size)
            ins[dst][src] = 1.0
        uniform = [{i: 1.0 / (len(row) + 1) for i in row} for row in ins]
        return cls(size, uniform, [1.0 / (len(row) + 1) for row in ins], weighted=False)

    @classmethod
    def from_matrix(cls, matrix: Any) -> Topology:
        """A weighted topology from a ``size x size`` matrix ``W``.

        ``W[i][j]`` (``i != j``) is the weight rank ``j`` gives to rank ``i``'s value (0: no edge);
        ``W[j][j]`` is rank ``j``'s self weight (Bluefog's layout: row = sender, column = receiver).
        Any finite weights are accepted, as Bluefog accepts any ``networkx.DiGraph`` weights:
        columns summing to 1 give weighted averages, others weighted sums. Accepts nested lists,
        numpy arrays and tensors.

        Raises:
            ValueError: not a square 2-D matrix (e.g. a 1-D vector), a non-finite entry.
            TypeError: an entry that is not a real number.

        Example::

            Topology.from_matrix([[0.5, 0.5], [0.5, 0.5]])
        """
        who = "Topology.from_matrix"
        data = matrix.tolist() if hasattr(matrix, "tolist") else matrix
        if isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
            raise ValueError(f"{who}: need a square 2-D matrix (a sequence of rows), got {data!r}")
        rows: List[List[float]] = []
        for i, r in enumerate(data):
            if isinstance(r, (str, bytes)) or not isinstance(r, Iterable):
                raise ValueError(
                    f"{who}: need a square 2-D matrix (a sequence of rows), but row {i} is {r!r}, not a "
                    "sequence (a 1-D input is not a matrix)"
                )
            row = []
            for j, v in enumerate(r):
                if not is_real(v):
                    raise TypeError(f"{who}: entry [{i}][{j}] must be a real number, got {v!r}")
                row.append(float(v))
            rows.append(row)
        size = len(rows)
        if size < 1 or any(len(r) != size for r in rows):
            raise ValueError(f"{who}: need a square matrix, got rows of lengths {[len(r) for r in rows]}")
        ins = [{i: rows[i][j] for i in range(size) if i != j and rows[i][j] != 0.0} for j in range(size)]
        return cls(size, ins, [rows[j][j] for j in range(size)], weighted=True)

    # ------------------------------------------------------------ queries
    def in_neighbors(self, rank: int) -> List[int]:
        """Ranks whose values ``rank`` receives (sorted)."""
        return list(self._in[self._rank(rank)])

    def out_neighbors(self, rank: int) -> List[int]:
        """Ranks that receive ``rank``'s value (sorted)."""
        return list(self._out[self._rank(rank)])

    def in_weights(self, rank: int) -> Dict[int, float]:
        """``{in-neighbour: weight}`` of ``rank``."""
        return dict(self._in[self._rank(rank)])

    def self_weight(self, rank: int) -> float:
        """The weight ``rank`` gives its own value."""
        return self._self[self._rank(rank)]

    def num_edges(self) -> int:
        """Number of directed edges (self weights not counted)."""
        return sum(len(r) for r in self._in)

    def matrix(self) -> List[List[float]]:
        """The weight matrix ``W`` (see :meth:`from_matrix`)."""
        w = [[0.0] * self.size for _ in range(self.size)]
        for j in range(self.size):
            w[j][j] = self._self[j]
            for i, v in self._in[j].items():
                w[i][j] = v
        return w

    # ------------------------------------------------------------ networkx-style queries
    # Bluefog's load_topology() returns a networkx.DiGraph whose diagonal entries are self loops;
    # these read a Topology the same way (a rank with a non-zero self weight is its own neighbour).
    def number_of_nodes(self) -> int:
        """Number of ranks (networkx's ``number_of_nodes``)."""
        return self.size

    def number_of_edges(self) -> int:
        """Edges of the weight matrix *including* self loops (non-zero self weights), as networkx counts
        a Bluefog topology; :meth:`num_edges` leaves the self loops out."""
        return self.num_edges() + sum(1 for w in self._self if w != 0.0)

    def predecessors(self, rank: int) -> List[int]:
        """Ranks whose values ``rank`` receives, with ``rank`` itself if its self weight is non-zero
        (networkx's ``predecessors`` of a Bluefog topology), sorted."""
        r = self._rank(rank)
        return sorted([*self._in[r], r]) if self._self[r] != 0.0 else list(self._in[r])

    def successors(self, rank: int) -> List[int]:
        """Ranks that receive ``rank``'s value, with ``rank`` itself if its self weight is non-zero
        (networkx's ``successors`` of a Bluefog topology), sorted."""
        r = self._rank(rank)
        return sorted([*self._out[r], r]) if self._self[r] != 0.0 else list(self._out[r])

    def in_degree(self, rank: int) -> int:
        """``len(predecessors(rank))`` (a self loop counts, as in networkx)."""
        return len(self.predecessors(rank))

    def out_degree(self, rank: int) -> int:
        """``len(successors(rank))`` (a self loop counts, as in networkx)."""
        return len(self.successors(rank))

    def _rank(self, rank: int) -> int:
        if type(rank) is int and 0 <= rank < self.size:  # the common case, kept cheap
            return rank
        r = as_int(rank)
        if r is None:
            raise TypeError(f"Topology: rank must be an int, got {rank!r} ({type(rank).__name__})")
        if not 0 <= r < self.size:
            raise ValueError(f"Topology: rank {r} is outside 0..{self.size - 1}")
        return r

    def __eq__(self, other: object) -> bool:
        """Same size, edges, weights and whether the weights are user-chosen (``weighted``)."""
        return (
            isinstance(other, Topology)
            and self.size == other.size
            and self.weighted == other.weighted
            and self._in == other._in
            and self._self == other._self
        )

    def __repr__(self) -> str:
        kind = "weighted" if self.weighted else "uniform"
        return f"<Topology size={self.size} edges={self.num_edges()} {kind}>"


def _edge(key: Any, size: int) -> Tuple[int, int]:
    try:
        src, dst = key
    except (TypeError, ValueError):
        raise ValueError(f"Topology.from_edges: an edge must be a pair (src, dst), got {key!r}") from None
    ends = []
    for v in (src, dst):
        r = as_int(v)
        if r is None:
            raise TypeError(
                f"Topology.from_edges: edge {key!r} names rank {v!r}, which is not an int "
                f"({type(v).__name__})"
            )
        if not 0 <= r < size:
            raise ValueError(f"Topology.from_edges: edge {key!r} names rank {r} outside 0..{size - 1}")
        ends.append(r)
    src, dst = ends
    if src == dst:
        raise ValueError(f"Topology.from_edges: edge {key!r} is a self loop; use self_weights")
    return src, dst


def ExponentialTwoGraph(size: int) -> Topology:  # noqa: N802 - Bluefog's name
    """Rank ``i`` sends to ``i + 2**k (mod size)`` for every ``2**k < size``; uniform weights.

    Every rank has ``ceil(log2(size))`` in-neighbours (fewer when offsets coincide); averaging over
    it mixes information across the whole group in ``log2(size)`` steps. Bluefog's default topology.

    Example::

        ExponentialTwoGraph(4).in_neighbors(0)      # [2, 3]
    """
    size = _check_size(size, "ExponentialTwoGraph")
    edges: Set[Tuple[int, int]] = set()
    k = 1
    while k < size:
        edges.update((i, (i + k) % size) for i in range(size))
        k *= 2
    return Topology.from_edges(size, sorted(e for e in edges if e[0] != e[1]))


def RingGraph(size: int, connect_style: int = 0) -> Topology:  # noqa: N802 - Bluefog's name
    """A ring; uniform weights.

    Args:
        size: number of ranks.
        connect_style: Bluefog's values and directions. 0: both directions (in-neighbours ``i - 1``
            and ``i + 1``). 1 ("left connection"): rank ``i`` sends to ``i - 1``, so it receives
            from ``i + 1`` only. 2 ("right connection"): rank ``i`` sends to ``i + 1``, so it
            receives from ``i - 1`` only. With 2 ranks every style is the same two-way pair.

    Example::

        RingGraph(4).in_neighbors(0)                    # [1, 3]
        RingGraph(4, connect_style=1).in_neighbors(0)   # [1]
        RingGraph(4, connect_style=2).in_neighbors(0)   # [3]
    """
    size = _check_size(size, "RingGraph")
    if connect_style not in (0, 1, 2):
        raise ValueError(f"RingGraph: connect_style must be 0, 1 or 2, got {connect_style!r}")
    edges = set()
    for i in range(size):
        # Bluefog builds row i (sender i) as np.roll(x, i) with x[-1] (style 1) or x[1] (style 2)
        # set: style 1 is the edge i -> i - 1, style 2 the edge i -> i + 1.
        if connect_style in (0, 1):
            edges.add((i, (i - 1) % size))
        if connect_style in (0, 2):
            edges.add((i, (i + 1) % size))
    return Topology.from_edges(size, sorted(e for e in edges if e[0] != e[1]))


def FullyConnectedGraph(size: int) -> Topology:  # noqa: N802 - Bluefog's name
    """Every rank receives from every other rank; uniform weights ``1 / size`` (a global average).

    Example::

        FullyConnectedGraph(3).in_neighbors(1)      # [0, 2]
    """
    size = _check_size(size, "FullyConnectedGraph")
    return Topology.from_edges(size, [(i, j) for i in range(size) for j in range(size) if i != j])


# ---------------------------------------------------------------------------- per-communicator state
_TOPOLOGIES: weakref.WeakKeyDictionary[Communicator, Tuple[Topology, bool]] = weakref.WeakKeyDictionary()


def resolve_comm(comm: Union[None, Communicator, ProcessGroup], opname: str) -> Communicator:
    """``comm`` as a Communicator: None is the default group's global one; a ProcessGroup its global one.

    Raises:
        CommError: not initialized / used after destroy_process_group(), or this rank is not a member
            (``comm`` is :data:`~trainloom.comm.group.NON_COMM_MEMBER` or a group without this rank).
        TypeError: ``comm`` is something else.
    """
    c: object = comm
    if c is None or c is WORLD:
        c = get_default_group().global_communicator_unconnected()
    elif isinstance(c, ProcessGroup):
        group = c
        c = group.global_communicator_unconnected()
        if c is NON_COMM_MEMBER:
            raise CommError(
                f"{opname}: rank {get_rank()} is not a member of process group {group.group_name} "
                f"(ranks {group.ranks})"
            )
    if c is NON_COMM_MEMBER:
        raise CommError(
            f"{opname}: comm is NON_COMM_MEMBER (rank {get_rank()} is not a member of that communicator); "
            "unlike Bagua's collectives, this operation needs a member"
        )
    if not isinstance(c, Communicator):
        raise TypeError(
            f"{opname}: comm must be a trainloom Communicator or ProcessGroup (None: the default group), "
            f"got {type(c).__name__}"
        )
    c.check_alive(opname)
    return c


def group_rank_of(rank: Any, arg: str, c: Communicator, opname: str) -> int:
    """The group rank of global rank ``rank`` in ``c`` (the ColossalAI and torch-classic styles take
    global ranks); TypeError or ValueError naming ``arg`` otherwise."""
    r = as_int(rank)
    if r is None:
        raise TypeError(f"{opname}: {arg} must be an int (global rank), got {rank!r}")
    rank = r
    if rank not in c.global_ranks:
        raise ValueError(
            f"{opname}: {arg}={rank} is not a member of the group (global ranks {c.global_ranks})"
        )
    return c.global_ranks.index(rank)


def set_topology(
    topology: Optional[Topology] = None,
    is_weighted: bool = False,
    comm: Union[None, Communicator, ProcessGroup] = None,
) -> bool:
    """Set the virtual topology of a communicator (Bluefog's ``set_topology``).

    Local: no communication. Every rank must set the same topology (a different one makes the next
    neighbour collective raise CommError on every rank, as the ranks then disagree on who sends what).

    Args:
        topology: a :class:`Topology` (None: ``ExponentialTwoGraph(nranks)``).
        is_weighted: use the topology's weights in :func:`neighbor_allreduce`; otherwise every rank
            averages uniformly over its in-neighbours and itself (Bluefog's default).
        comm: communicator or process group (None: the default group).

    Returns:
        True.

    Raises:
        ValueError: the topology's size differs from the communicator's number of ranks.
        TypeError: ``topology`` is not a Topology.

    Example::

        set_topology(RingGraph(get_world_size()))
    """
    c = resolve_comm(comm, "set_topology")
    if topology is None:
        topology = ExponentialTwoGraph(c.nranks())
    if not isinstance(topology, Topology):
        raise TypeError(
            "set_topology: topology must be a trainloom.comm.topology.Topology (build one with "
            f"RingGraph, ExponentialTwoGraph, Topology.from_edges/from_matrix), got {type(topology).__name__}"
        )
    if topology.size != c.nranks():
        raise ValueError(
            f"set_topology: the topology has {topology.size} ranks but communicator {c.name} has {c.nranks()}"
        )
    _TOPOLOGIES[c] = (topology, bool(is_weighted))
    return True


def _entry(c: Communicator) -> Tuple[Topology, bool]:
    got = _TOPOLOGIES.get(c)
    if got is None:
        got = (ExponentialTwoGraph(c.nranks()), False)
        _TOPOLOGIES[c] = got
    return got


def load_topology(comm: Union[None, Communicator, ProcessGroup] = None) -> Topology:
    """The communicator's topology (``ExponentialTwoGraph`` when none was set)."""
    return _entry(resolve_comm(comm, "load_topology"))[0]


def is_topo_weighted(comm: Union[None, Communicator, ProcessGroup] = None) -> bool:
    """Whether :func:`set_topology` was called with ``is_weighted=True``."""
    return _entry(resolve_comm(comm, "is_topo_weighted"))[1]


def in_neighbor_ranks(comm: Union[None, Communicator, ProcessGroup] = None) -> List[int]:
    """This rank's in-neighbours in the communicator's topology."""
    c = resolve_comm(comm, "in_neighbor_ranks")
    return _entry(c)[0].in_neighbors(c.rank())


def out_neighbor_ranks(comm: Union[None, Communicator, ProcessGroup] = None) -> List[int]:
    """This rank's out-neighbours in the communicator's topology."""
    c = resolve_comm(comm, "out_neighbor_ranks")
    return _entry(c)[0].out_neighbors(c.rank())


def topology_entry(c: Communicator) -> Tuple[Topology, bool]:
    """(topology, is_weighted) of a resolved communicator (for trainloom.comm.neighbor)."""
    return _entry(c)


#: With at least this fraction of possible edges a topology is dense.
DENSE_FRACTION = 0.5
#: Dense topologies use one allgather for tensors below this many bytes, the neighbour exchange
#: (alltoall_v) above: measured with `trainloom bench neighbor` (docs/comm-ext.md), the exchange was
#: faster at 4 MiB even on a fully connected graph of 4 ranks, the allgather at 4 KiB.
DENSE_ALLGATHER_BYTES = 64 * 1024


def exchange_strategy(topo: Topology, nbytes: int = 0) -> str:
    """``"allgather"`` or ``"exchange"``: how neighbour collectives move ``nbytes`` for ``topo``.

    Depends only on the topology and the tensor size (equal on every rank), so every rank picks the
    same collective. ``TRAINLOOM_NEIGHBOR_EXCHANGE`` (``auto``, ``allgather``, ``exchange``)
    overrides it.
    """
    choice = os.environ.get("TRAINLOOM_NEIGHBOR_EXCHANGE", "auto").strip().lower() or "auto"
    if choice not in ("auto", "allgather", "exchange"):
        raise ConfigError(f"TRAINLOOM_NEIGHBOR_EXCHANGE={choice!r}: use auto, allgather or exchange")
    if choice != "auto":
        return choice
    n = topo.size
    if n <= 2:
        return "exchange"
    dense = topo.num_edges() >= DENSE_FRACTION * n * (n - 1)
    return "allgather" if dense and nbytes < DENSE_ALLGATHER_BYTES else "exchange"
