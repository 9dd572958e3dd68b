"""Every bad input of trainloom.comm gets its exact error: launch environment, timeouts, process groups,
the torch-classic, ColossalAI and Bluefog styles, windows, state broadcasts, the NCCL and shared-memory
engines' own checks.

Almost every check fires before any communication, so a world of one in this process is enough; the
checks that need a second rank (or a second node) share one 2-rank run.
"""

from __future__ import annotations

import datetime
import os
import re
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
from multiproc import free_port, run_ranks

import trainloom.comm as C
from trainloom.comm import ReduceOp, classic, colossal, group, nccl, state, windows
from trainloom.comm.env import read_launch_env
from trainloom.comm.optimizers import DistributedAllreduceOptimizer
from trainloom.comm.shm import ShmCommunicator
from trainloom.comm.topology import Topology
from trainloom.errors import CommError, ConfigError


def _exact(exc: type, message: str) -> Any:
    """pytest.raises for exactly ``message``."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def _check(cases) -> None:  # noqa: ANN001
    for fn, exc, message in cases:
        with pytest.raises(exc) as info:
            fn()
        assert (type(info.value), str(info.value)) == (exc, message)


# ------------------------------------------------------------------------------ launch environment
def _torchrun(env, rank=1, world=2, lr=1, lws=2, port=29500) -> None:  # noqa: ANN001
    values = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=lr, LOCAL_WORLD_SIZE=lws, MASTER_PORT=port)
    env.setenv("MASTER_ADDR", "127.0.0.1")
    for k, v in values.items():
        env.setenv(k, str(v))


def test_launch_env_values_out_of_range(clean_env):
    with _exact(ConfigError, "world_size must be >= 1, got 0"):
        read_launch_env(rank=0, world_size=0, need_master=False)
    _torchrun(clean_env, rank=0, world=0, lr=0, lws=1)
    with _exact(ConfigError, "world_size must be >= 1, got 0"):
        read_launch_env()
    _torchrun(clean_env, rank=1, world=4, lr=2, lws=2)
    with _exact(ConfigError, "LOCAL_RANK=2 is outside 0..1 (LOCAL_WORLD_SIZE=2)"):
        read_launch_env()
    for port in (0, 65536):
        _torchrun(clean_env, port=port)
        with _exact(ConfigError, f"MASTER_PORT={port} is not a TCP port (1..65535)"):
            read_launch_env()
    _torchrun(clean_env, port=65535)
    assert read_launch_env().master_port == 65535


# ------------------------------------------------------------------------------ init_process_group
def test_bad_timeouts_are_refused_before_anything_starts(clean_env):
    _check(
        [
            (
                lambda: C.init_process_group(timeout="10"),
                ConfigError,
                "timeout must be seconds or a datetime.timedelta, got '10'",
            ),
            (
                lambda: C.init_process_group(timeout=True),
                ConfigError,
                "timeout must be seconds or a datetime.timedelta, got True",
            ),
            (lambda: C.init_process_group(timeout=0), ConfigError, "timeout must be > 0 seconds, got 0.0"),
            (
                lambda: C.init_process_group(timeout=datetime.timedelta(seconds=-1)),
                ConfigError,
                "timeout must be > 0 seconds, got -1.0",
            ),
            (
                lambda: C.init_process_group(timeout=float("nan")),
                ConfigError,
                "timeout must be > 0 seconds, got nan",
            ),
            (  # was an OverflowError from datetime.timedelta
                lambda: C.init_process_group(timeout=float("inf")),
                ConfigError,
                "timeout must be below 8.64e+13 seconds (datetime.timedelta's limit), got inf",
            ),
        ]
    )
    env_cases = [
        ("5m", "TRAINLOOM_COMM_TIMEOUT='5m' is not a number of seconds"),
        ("-5", "TRAINLOOM_COMM_TIMEOUT='-5': timeout must be > 0 seconds, got -5.0"),
        (
            "1e20",
            "TRAINLOOM_COMM_TIMEOUT='1e20': timeout must be below 8.64e+13 seconds "
            "(datetime.timedelta's limit), got 1e+20",
        ),
    ]
    for value, message in env_cases:
        clean_env.setenv("TRAINLOOM_COMM_TIMEOUT", value)
        with _exact(ConfigError, message):
            C.init_process_group()
    assert C.is_initialized() is False


def test_not_initialized(clean_env):
    _check(
        [
            (
                C.get_default_group,
                CommError,
                "the default process group is not initialized; call trainloom.comm.init_process_group()",
            ),
            (
                lambda: C.new_group([0]),
                CommError,
                "new_group: the default process group is not initialized; call init_process_group() first",
            ),
            (
                lambda: C.from_torch_group(None),
                CommError,
                "from_torch_group: call init_process_group() first",
            ),
            (
                lambda: C.ProcessGroup([0], None, "g"),
                CommError,
                "the default process group is not initialized; call init_process_group() first",
            ),
        ]
    )


def test_torch_distributed_initialized_as_another_rank(clean_env, monkeypatch):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with _exact(
            ConfigError,
            "torch.distributed is already initialized as rank 0 of 1, but rank=/world_size= says rank 1 of 2",
        ):
            C.init_process_group(store=dist.HashStore(), rank=1, world_size=2, timeout=5)
        assert C.is_initialized() is False
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", "1")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        with _exact(
            ConfigError,
            "torch.distributed is already initialized as rank 0 of 1, but the environment says rank 1 of 2",
        ):
            C.init_process_group(store=dist.HashStore(), timeout=5)
        assert C.is_initialized() is False
    finally:
        dist.destroy_process_group()


def test_cpu_engine_variable(world1, monkeypatch):
    comm = world1.global_communicator_unconnected()
    monkeypatch.setenv("TRAINLOOM_CPU_ENGINE", "SHMEM")
    with _exact(ConfigError, "TRAINLOOM_CPU_ENGINE='SHMEM': use auto, gloo or shm"):
        world1.get_global_communicator()
    # the engine cannot run here: the reason comes from the shared-memory module
    monkeypatch.setenv("TRAINLOOM_CPU_ENGINE", "shm")
    monkeypatch.delitem(group._SHM_STATE, "why", raising=False)
    monkeypatch.setattr("trainloom.comm.shm.shm_supported", lambda: False)
    with _exact(
        ConfigError,
        "TRAINLOOM_CPU_ENGINE=shm but the shared-memory engine is unavailable: "
        "shm_supported() is False on this OS",
    ):
        world1.get_global_communicator()
    monkeypatch.setenv("TRAINLOOM_CPU_ENGINE", "gloo")
    assert world1.get_global_communicator() is comm and comm.cpu_engine_kind() == "gloo"


def test_new_group_ranks(world1):
    _check(
        [
            (lambda: C.new_group(["0"]), TypeError, "new_group: ranks must be ints, got '0'"),
            (lambda: C.new_group([0.0]), TypeError, "new_group: ranks must be ints, got 0.0"),
            (lambda: C.new_group([]), ValueError, "new_group: ranks is empty"),
            (lambda: C.new_group(()), ValueError, "new_group: ranks is empty"),
        ]
    )


# ------------------------------------------------------------------------------ torch-classic style
def test_classic_init_method(clean_env):
    _check(
        [
            (
                lambda: classic.init_process_group(init_method="tcp://:29500", rank=0, world_size=1),
                ConfigError,
                "init_process_group: init_method 'tcp://:29500' must be tcp://host:port",
            ),
            (
                lambda: classic.init_process_group(init_method="tcp://localhost", rank=0, world_size=1),
                ConfigError,
                "init_process_group: init_method 'tcp://localhost' must be tcp://host:port",
            ),
            (
                lambda: classic.init_process_group(init_method="tcp://127.0.0.1:29500", world_size=2),
                ConfigError,
                "init_process_group: init_method tcp:// needs rank= and world_size=",
            ),
            (
                lambda: classic.init_process_group(init_method="tcp://127.0.0.1:29500", rank=0),
                ConfigError,
                "init_process_group: init_method tcp:// needs rank= and world_size=",
            ),
            (
                lambda: classic.init_process_group(init_method="file:///tmp/rendezvous"),
                ConfigError,
                "init_process_group: init_method 'file:///tmp/rendezvous': use env:// or tcp://host:port",
            ),
        ]
    )
    # the timeout is checked before the TCPStore starts (a bad one was a ValueError from float(), and
    # 0 silently became 300 s for the store)
    url = f"tcp://127.0.0.1:{free_port()}"
    _check(
        [
            (
                lambda: classic.init_process_group(init_method=url, rank=0, world_size=1, timeout="5s"),
                ConfigError,
                "timeout must be seconds or a datetime.timedelta, got '5s'",
            ),
            (
                lambda: classic.init_process_group(init_method=url, rank=0, world_size=1, timeout=0),
                ConfigError,
                "timeout must be > 0 seconds, got 0.0",
            ),
        ]
    )
    assert C.is_initialized() is False
    classic.init_process_group(init_method=url, rank=0, world_size=1, timeout=datetime.timedelta(seconds=5))
    try:
        assert classic.get_world_size() == 1 and group._STATE.timeout == 5.0
    finally:
        classic.destroy_process_group()


def test_classic_arguments(world1):
    t = torch.ones(2)
    _check(
        [
            (
                lambda: classic.irecv(t, 0),
                ValueError,
                "irecv: src=0 is this rank; receive from another rank",
            ),
            (lambda: classic.recv(t, 0), ValueError, "recv: src=0 is this rank; receive from another rank"),
            (
                lambda: classic.broadcast(t, "0"),
                TypeError,
                "broadcast: src must be an int (global rank), got '0'",
            ),
            (
                lambda: classic.all_gather(t, t),
                TypeError,
                "all_gather: tensor_list must be a list of 1 tensors, got Tensor",
            ),
            (
                lambda: classic.all_gather([torch.ones(2, dtype=torch.float64)], t),
                TypeError,
                "all_gather: tensor_list[0] has dtype torch.float64 but tensor has torch.float32",
            ),
            (
                lambda: classic.scatter(t, 0),
                ValueError,
                "scatter: scatter_list is required on the source rank 0",
            ),
            (
                lambda: classic.scatter(t),
                ValueError,
                "scatter: scatter_list is required on the source rank 0",
            ),
        ]
    )


# ------------------------------------------------------------------------------ core and ColossalAI style
class _OnCuda(torch.Tensor):
    """A CPU tensor that reports CUDA device 0: the only way to reach the device comparison of two
    tensors without a GPU (every check before it reads is_cpu/is_cuda, which stay true/false)."""

    def get_device(self) -> int:
        return 0

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def test_core_arguments(world1):
    f32 = torch.ones(4)
    on_cuda = torch.ones(4).as_subclass(_OnCuda)
    _check(
        [
            (
                lambda: C.allreduce(f32, on_cuda),
                ValueError,
                "allreduce: send_tensor is on cpu but recv_tensor is on cuda:0; they must match",
            ),
            (
                lambda: C.scatter_inplace(f32, "2", 0),
                TypeError,
                "scatter_inplace: count must be an int, got '2'",
            ),
            (
                lambda: C.gather_inplace(f32, 2.0, 0),
                TypeError,
                "gather_inplace: count must be an int, got 2.0",
            ),
        ]
    )


def test_colossal_arguments(world1):
    t = torch.ones(2, 2)
    _check(
        [
            (
                lambda: colossal.register_parallel_mode("data", [0, 1]),
                TypeError,
                "register_parallel_mode: group must be a trainloom ProcessGroup or Communicator, got list",
            ),
            (lambda: colossal.all_gather(t, "1"), TypeError, "all_gather: dim must be an int, got '1'"),
            (
                lambda: colossal.reduce_scatter(t, 1.0),
                TypeError,
                "reduce_scatter: dim must be an int, got 1.0",
            ),
        ]
    )
    assert "data" not in colossal._MODES


# ------------------------------------------------------------------------------ topology and windows
def test_topology_construction():
    _check(
        [
            (
                lambda: Topology(2, [{}], [0.5, 0.5]),
                ValueError,
                "Topology: in_weights and self_weights need 2 entries (one per rank), got 1 and 2",
            ),
            (
                lambda: Topology(2, [{}, {}], [1.0]),
                ValueError,
                "Topology: in_weights and self_weights need 2 entries (one per rank), got 2 and 1",
            ),
            (
                lambda: Topology(2, [{}, {1: 0.5}], [1.0, 0.5]),
                ValueError,
                "Topology: rank 1 lists itself as in-neighbour; use self_weights",
            ),
            (
                lambda: Topology.from_matrix([[0.5, 0.5], [1.0]]),
                ValueError,
                "Topology.from_matrix: need a square matrix, got rows of lengths [2, 1]",
            ),
            (
                lambda: Topology.from_matrix([[1.0, 0.0]]),
                ValueError,
                "Topology.from_matrix: need a square matrix, got rows of lengths [2]",
            ),
            (
                lambda: Topology.from_matrix([]),
                ValueError,
                "Topology.from_matrix: need a square matrix, got rows of lengths []",
            ),
        ]
    )


def test_window_arguments(world1):
    t = torch.ones(4)
    assert windows.win_create(t, "w") is True
    try:
        _check(
            [
                (lambda: windows.win_sync(3), TypeError, "win_sync: name must be a str, got int"),
                (
                    lambda: windows.win_put(t, "w", [1.0]),
                    TypeError,
                    "win_put: dst_weights must be a dict {rank: weight}, got list",
                ),
                (
                    lambda: windows.win_get("w", {"0": 1.0}),
                    TypeError,
                    "win_get: src_weights keys must be int ranks, got '0'",
                ),
                (
                    lambda: windows.win_sync("w", self_weight=0.5),
                    ValueError,
                    "win_sync: self_weight and neighbor_weights must be given together (or neither)",
                ),
                (
                    lambda: windows.win_sync("w", neighbor_weights={}),
                    ValueError,
                    "win_sync: self_weight and neighbor_weights must be given together (or neither)",
                ),
                (
                    lambda: windows.win_accumulate([1.0] * 4, "w"),
                    TypeError,
                    "win_accumulate: tensor must be a torch.Tensor, got list",
                ),
                (
                    lambda: windows.win_put(torch.ones(4, device="meta"), "w"),
                    ValueError,
                    "win_put: tensor is on meta; window 'w' is a CPU window",
                ),
                (lambda: windows.win_poll(True), TypeError, "win_poll: handle must be a Work, got bool"),
                (lambda: windows.win_wait(None), TypeError, "win_wait: handle must be a Work, got NoneType"),
                (
                    lambda: windows.win_create([1.0], "v"),
                    TypeError,
                    "win_create: tensor must be a torch.Tensor, got list",
                ),
                (
                    lambda: windows.win_create(t.clone(), ""),
                    TypeError,
                    "win_create: name must be a non-empty str, got ''",
                ),
                (
                    lambda: windows.win_create(torch.ones(4, device="meta"), "v"),
                    NotImplementedError,
                    "win_create: windows are implemented for CPU tensors on one node; for meta tensors use "
                    "trainloom.comm.neighbor.neighbor_allreduce (or DistributedNeighborAllreduceOptimizer)",
                ),
                (
                    lambda: windows.win_create(torch.ones(4, 2).t(), "v"),
                    ValueError,
                    "win_create: tensor must be contiguous (win_sync writes it in place)",
                ),
            ]
        )
        assert windows._live_windows() == ["w"]
        # the handle checks pass for a real handle
        assert windows.win_wait(windows.win_put_async(t, "w")) is True
    finally:
        windows.win_free("w")


# ------------------------------------------------------------------------------ state and optimizers
def test_state_and_optimizer_arguments(world1):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["params"].append(p)  # past torch's own check at construction
    _check(
        [
            (
                lambda: state.broadcast_parameters({"w": torch.ones(2), "b": [0.0]}, 0),
                TypeError,
                "broadcast_parameters: params['b'] is list, not a tensor",
            ),
            (
                lambda: state.broadcast_optimizer_state(opt.state_dict(), 0),
                TypeError,
                "broadcast_optimizer_state: optimizer must be a torch.optim.Optimizer "
                "(state_dict/load_state_dict), got dict",
            ),
            (
                lambda: DistributedAllreduceOptimizer(opt),
                ValueError,
                "DistributedAllreduceOptimizer: a parameter appears twice in the optimizer's param_groups",
            ),
        ]
    )


# ------------------------------------------------------------------------------ engines
def test_nccl_version_and_op_checks(monkeypatch):
    """Checks of the NCCL engine that need no GPU, called on the class (the library is not loaded)."""
    monkeypatch.setattr(nccl, "_version_tuple", lambda: (2, 9, 9))
    monkeypatch.setattr(nccl, "get_version", lambda: 20909)
    eng = nccl.NcclEngine
    i32 = torch.ones(4, dtype=torch.int32)
    _check(
        [
            (
                lambda: eng._dtype(torch.ones(2, dtype=torch.bfloat16), "allreduce"),
                NotImplementedError,
                "allreduce: bfloat16 needs NCCL >= 2.10 (loaded 2.9.9)",
            ),
            (
                lambda: eng._op(None, torch.ones(2), int(ReduceOp.AVG), "reduce"),
                NotImplementedError,
                "reduce: ReduceOp.AVG needs NCCL >= 2.10 (loaded 2.9.9)",
            ),
            (
                lambda: eng.reduce_scatter(None, i32, i32[:2], int(ReduceOp.BOR)),
                TypeError,
                "reduce_scatter: NCCL has no bitwise reductions, so op=BOR is not supported for CUDA "
                "tensors; allreduce the tensor instead (it emulates them) and take this rank's chunk",
            ),
            (
                lambda: eng.reduce_scatter(None, i32.bool(), i32[:2].bool(), int(ReduceOp.BXOR)),
                TypeError,
                "reduce_scatter: NCCL has no bitwise reductions, so op=BXOR is not supported for CUDA "
                "tensors; allreduce the tensor instead (it emulates them) and take this rank's chunk",
            ),
        ]
    )
    # the same checks pass on NCCL 2.10
    monkeypatch.setattr(nccl, "_version_tuple", lambda: (2, 10, 3))
    assert eng._dtype(torch.ones(2, dtype=torch.bfloat16), "allreduce")[1] == nccl.NCCL_DTYPES[torch.bfloat16]
    assert eng._op(None, torch.ones(2), int(ReduceOp.AVG), "reduce") == nccl._OPS[int(ReduceOp.AVG)]


def test_shm_engine_arguments():
    with _exact(ValueError, "ShmCommunicator: world_size 65536 is too large for one node (max 65535)"):
        ShmCommunicator(dist.HashStore(), 0, 65536, prefix="p")
    c = ShmCommunicator(dist.HashStore(), 0, 1, prefix=f"bad-inputs-{os.getpid()}", timeout=5.0)
    x = torch.ones(8)
    try:
        _check(
            [
                (
                    lambda: c.allreduce(x.to_sparse(), x, ReduceOp.SUM),
                    ValueError,
                    "shm allreduce: send must be a dense (strided) tensor, got torch.sparse_coo",
                ),
                (
                    lambda: c.reduce(x, torch.ones(7), 0, ReduceOp.SUM),
                    ValueError,
                    "shm reduce: recv has 7 elements, send has 8",
                ),
                (
                    lambda: c.scatter(torch.ones(3), x, 0),
                    ValueError,
                    "shm scatter: send must have world_size * recv.numel() = 1 * 8 elements, got 3",
                ),
                (
                    lambda: c.alltoall(x, torch.ones(7)),
                    ValueError,
                    "shm alltoall: send and recv need the same numel, a multiple of world_size 1; "
                    "got 8 and 7",
                ),
                (
                    lambda: c.alltoall_v(x, [4], [0], x, [4], [4]),
                    ValueError,
                    "shm alltoall_v: send and recv must not overlap",
                ),
                (
                    lambda: c.alltoall_v(x[:4], [4], [0], x[2:], [4], [0]),
                    ValueError,
                    "shm alltoall_v: send and recv must not overlap",
                ),
                (
                    lambda: c.shared_empty(4, torch.uint16),
                    ValueError,
                    "shm shared_empty: unsupported dtype torch.uint16",
                ),
            ]
        )
        # the same calls with good arguments pass
        r = torch.zeros(8)
        c.alltoall_v(x, [4], [0], r, [4], [4])
        assert r.tolist() == [0.0] * 4 + [1.0] * 4
    finally:
        c.close()


# ------------------------------------------------------------------------------ two ranks
def _expect(fn, exc_type: type) -> str:  # noqa: ANN001
    try:
        fn()
    except exc_type as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def two_ranks_two_nodes(rank: int, ws: int) -> Dict[str, Any]:
    """Each rank its own node, the shared-memory engine forced: checks that need another rank. First,
    LOCAL_RANK/LOCAL_WORLD_SIZE that contradict the layout: both ranks on this machine say
    "local rank 0 of 1"; then, with a logical node each, both say "local rank 0 of 2" (fits neither
    the logical nodes nor the machine); then "0 of 1" again, which fits the logical nodes."""
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    out: Dict[str, Any] = {"one_machine": _expect(lambda: C.init_process_group(timeout=30), ConfigError)}
    out["left_initialized"] = C.is_initialized() or dist.is_initialized()
    os.environ.update(LOCAL_WORLD_SIZE="2", TRAINLOOM_NODE_ID=f"n{rank}")
    out["logical_nodes"] = _expect(lambda: C.init_process_group(timeout=30), ConfigError)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["TRAINLOOM_CPU_ENGINE"] = "shm"
    C.init_process_group(timeout=30)
    out["local"] = (C.get_local_rank(), C.get_local_size())
    t = torch.ones(2)
    other = 1 - rank
    out["gather"] = _expect(lambda: classic.gather(t, other, [t, t]), ValueError)
    out["engine"] = _expect(lambda: C.get_default_group().get_global_communicator(), ConfigError)
    C.destroy_process_group()
    return out


def test_checks_that_need_two_ranks():
    """LOCAL_RANK/LOCAL_WORLD_SIZE that contradict the node layout were accepted: ranks on one
    machine that each said "local rank 0 of 1" all reported get_local_rank() 0 (one GPU for all)
    while their intra-node communicator had every rank. Every rank raises now, and nothing is left
    initialized (the next init_process_group() works)."""
    from trainloom.comm.shm import node_identity

    here = node_identity()
    res = run_ranks(two_ranks_two_nodes, 2, timeout=60)
    for rank, r in enumerate(res):
        head = (
            f"ConfigError: init_process_group (rank {rank} of 2): LOCAL_RANK/LOCAL_WORLD_SIZE contradict the "
        )
        tail = (
            "Set LOCAL_RANK and LOCAL_WORLD_SIZE as the launcher placed the ranks (torchrun does); to run "
            "several launcher nodes on one machine, give each its own TRAINLOOM_NODE_ID (e.g. its node rank)"
        )
        assert r == {
            "one_machine": f"{head}node layout found at the rendezvous: ranks [0, 1] run on one node "
            f"({here}), so each needs LOCAL_WORLD_SIZE=2 and its own LOCAL_RANK in 0..1, but they have "
            f"rank 0: LOCAL_RANK=0 LOCAL_WORLD_SIZE=1, rank 1: LOCAL_RANK=0 LOCAL_WORLD_SIZE=1. {tail}",
            "left_initialized": False,
            "logical_nodes": f"{head}node layout found at the rendezvous: ranks [0] run on one node "
            f"({here}/n0), so each needs LOCAL_WORLD_SIZE=1 and its own LOCAL_RANK in 0..0 (or, as "
            "TRAINLOOM_NODE_ID splits machines into logical nodes, the values that fit the ranks [0, 1] "
            f"on its machine), but they have rank 0: LOCAL_RANK=0 LOCAL_WORLD_SIZE=2. {tail}",
            "local": (0, 1),
            "gather": f"ValueError: gather: gather_list must be empty on rank {rank}, which is not "
            f"dst={1 - rank}",
            "engine": "ConfigError: TRAINLOOM_CPU_ENGINE=shm but this communicator spans several nodes",
        }
