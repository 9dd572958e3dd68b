"""Alias of Bagua's ``bagua.torch_api.communication`` module path.

``from bagua.torch_api.communication import allreduce, ReduceOp`` becomes
``from trainloom.comm.communication import allreduce, ReduceOp``; the same names are also exported
by :mod:`trainloom.comm` itself (Bagua's ``bagua.torch_api``). Like Bagua's module it also holds the
``env`` getters (``get_rank``...), ``_get_default_group`` (its examples call it) and
``broadcast_object`` (which Lightning's Bagua strategy imports from here).
"""

from typing import Any, Optional, Union

from trainloom.comm.collectives import (
    ReduceOp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_inplace,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    alltoall_v_inplace,
    barrier,
    broadcast,
    gather,
    gather_inplace,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
    send,
)
from trainloom.comm.env import (
    get_default_bucket_size,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
)
from trainloom.comm.group import (
    NON_COMM_MEMBER,
    WORLD,
    BaguaProcessGroup,
    CommMember,
    Communicator,
    ProcessGroup,
    RepeatedInitializationError,
    destroy_process_group,
    from_torch_group,
    get_default_group,
    init_process_group,
    is_initialized,
    new_group,
)
from trainloom.comm.state import broadcast_object as _broadcast_object

#: Bagua's private name for :func:`get_default_group`, used by its examples.
_get_default_group = get_default_group


def broadcast_object(obj: Any, src: int = 0, comm: Optional[Union[Communicator, ProcessGroup]] = None) -> Any:
    """Return rank ``src``'s ``obj`` (pickled; trusted peers only) on every rank of ``comm``.

    Bagua 0.9's signature (Lightning's ``BaguaStrategy.broadcast`` calls ``broadcast_object(obj,
    src)``); the same as :func:`trainloom.comm.state.broadcast_object` with ``root_rank=src``.

    Raises:
        TypeError: (on every rank) the root could not pickle ``obj``.
        ValueError: ``src`` outside the communicator.

    Example::

        cfg = broadcast_object({"lr": 0.1} if get_rank() == 0 else None, src=0)
    """
    return _broadcast_object(obj, root_rank=src, comm=comm)


__all__ = [
    "ReduceOp",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    "broadcast",
    "gather",
    "gather_inplace",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
    "BaguaProcessGroup",
    "CommMember",
    "NON_COMM_MEMBER",
    "WORLD",
    "broadcast_object",
    "get_default_bucket_size",
    "get_default_group",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "ProcessGroup",
    "RepeatedInitializationError",
    "destroy_process_group",
    "from_torch_group",
    "init_process_group",
    "is_initialized",
    "new_group",
]
