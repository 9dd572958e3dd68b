"""Alias of Bagua's ``bagua.torch_api.communication`` module path.

``from bagua.torch_api.communication import allreduce, ReduceOp`` becomes
``from trainloom.comm.communication import allreduce, ReduceOp``; the same names are also exported
by :mod:`trainloom.comm` itself (Bagua's ``bagua.torch_api``).
"""

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
from trainloom.comm.group import (
    BaguaProcessGroup,
    ProcessGroup,
    RepeatedInitializationError,
    destroy_process_group,
    from_torch_group,
    init_process_group,
    is_initialized,
    new_group,
)

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
    "ProcessGroup",
    "RepeatedInitializationError",
    "destroy_process_group",
    "from_torch_group",
    "init_process_group",
    "is_initialized",
    "new_group",
]
