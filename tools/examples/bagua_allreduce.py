"""A script written for Bagua's communication API, moved to trainloom by changing one import.

Run it like a Bagua script, under torchrun::

    torchrun --nproc_per_node=2 tools/examples/bagua_allreduce.py

or alone (``python tools/examples/bagua_allreduce.py``: rank 0 of a world of 1). With Bagua the two
import lines read ``import bagua.torch_api as bagua`` and
``from bagua.torch_api.communication import ReduceOp``; nothing else changes.
"""

import torch

import trainloom.comm as bagua  # was: import bagua.torch_api as bagua
from trainloom.comm.communication import ReduceOp  # was: from bagua.torch_api.communication import ReduceOp


def main() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(bagua.get_local_rank())  # as Bagua's docs ask, before init_process_group
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    # The example from Bagua's allreduce docstring.
    send_tensor = torch.arange(2, dtype=torch.int64, device=device) + 1 + 2 * rank
    recv_tensor = torch.zeros(2, dtype=torch.int64, device=device)
    bagua.allreduce(send_tensor, recv_tensor)
    expected = sum(torch.arange(2, dtype=torch.int64) + 1 + 2 * r for r in range(world))
    assert recv_tensor.cpu().tolist() == expected.tolist(), recv_tensor  # noqa: S101 - a user script

    send_tensor = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat, device=device) + 2 * rank * (1 + 1j)
    recv_tensor = torch.zeros(2, dtype=torch.cfloat, device=device)
    bagua.allreduce(send_tensor, recv_tensor, op=ReduceOp.SUM)

    # Gradient averaging over a process group's communicator, as Bagua algorithms do.
    group = bagua.new_group()
    comm = group.get_global_communicator()
    grad = torch.full((4,), float(rank), device=device)
    bagua.allreduce_inplace(grad, op=ReduceOp.AVG, comm=comm)

    # Broadcast rank 0's weights, gather everyone's metric on rank 0.
    weights = torch.randn(3, device=device) if rank == 0 else torch.zeros(3, device=device)
    bagua.broadcast(weights, src=0)
    metric = torch.tensor([float(rank)], device=device)
    gathered = torch.zeros(comm.nranks(), device=device)
    bagua.gather(metric, gathered, dst=0)
    bagua.barrier()
    if rank == 0:
        print(
            f"world={world} bucket={bagua.get_default_bucket_size()} allreduce={recv_tensor.tolist()} "
            f"avg_grad={grad.tolist()} gathered={gathered.tolist()}"
        )


if __name__ == "__main__":
    main()
