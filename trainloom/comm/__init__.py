"""trainloom.comm: Bagua's communication API over NCCL, a shared-memory engine and gloo.

Bagua scripts move over by changing their import::

    import trainloom.comm as bagua            # was: import bagua.torch_api as bagua
    from trainloom.comm import allreduce      # was: from bagua.torch_api import allreduce

Importing this package loads neither libnccl nor the shared-memory engine's segment; NCCL is
dlopen'ed at the first CUDA collective (see :mod:`trainloom.comm.nccl`).
"""

# ``bagua.torch_api.communication`` is an attribute of Bagua's package after ``import bagua.torch_api``;
# the same holds here (the module only re-exports names loaded below: a cheap import).
from trainloom.comm import communication as communication
from trainloom.comm.collectives import (
    SUPPORTED_DTYPES,
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
from trainloom.comm.communication import broadcast_object
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
    NonCommMember,
    ProcessGroup,
    RepeatedInitializationError,
    destroy_process_group,
    from_torch_group,
    get_default_group,
    init_process_group,
    is_initialized,
    new_group,
)
from trainloom.comm.neighbor import neighbor_allgather, neighbor_allreduce, poll, synchronize
from trainloom.comm.optimizers import DistributedAllreduceOptimizer, DistributedNeighborAllreduceOptimizer
from trainloom.comm.state import broadcast_optimizer_state, broadcast_parameters
from trainloom.comm.topology import load_topology, set_topology
from trainloom.comm.work import Work

# Drop-in namespaces for scripts written against other libraries (import them directly):
#   import trainloom.comm.bluefog as bf          (Bluefog: bluefog.torch)
#   import trainloom.comm.colossal as collective (ColossalAI: colossalai.communication.collective)
#   import trainloom.comm.classic as dist        (early torch.distributed)

__all__ = [
    "WORLD",
    "ReduceOp",
    "SUPPORTED_DTYPES",
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
    "get_default_bucket_size",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "BaguaProcessGroup",
    "CommMember",
    "Communicator",
    "NON_COMM_MEMBER",
    "NonCommMember",
    "ProcessGroup",
    "RepeatedInitializationError",
    "destroy_process_group",
    "from_torch_group",
    "get_default_group",
    "init_process_group",
    "is_initialized",
    "new_group",
    "Work",
    "neighbor_allgather",
    "neighbor_allreduce",
    "poll",
    "synchronize",
    "DistributedAllreduceOptimizer",
    "DistributedNeighborAllreduceOptimizer",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "load_topology",
    "set_topology",
]
