"""Single-process API behaviour: the launch environment, argument validation, world size 1, python -O."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from commutil import validation_two_ranks
from multiproc import free_port, popen_rank, run_ranks

import trainloom.comm as C
from trainloom.comm import ReduceOp
from trainloom.comm.env import LAUNCH_VARS, read_launch_env
from trainloom.errors import CommError, ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(env, rank=1, world=2, lr=1, lws=2):
    values = dict(
        RANK=rank,
        WORLD_SIZE=world,
        LOCAL_RANK=lr,
        LOCAL_WORLD_SIZE=lws,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=29500,
    )
    for k, v in values.items():
        env.setenv(k, str(v))


def test_launch_env_single_process_and_torchrun(clean_env):
    e = read_launch_env()
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.single_process) == (0, 1, 0, 1, True)
    _torchrun(clean_env, rank=3, world=4, lr=1, lws=2)
    e = read_launch_env()
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.master_port) == (3, 4, 1, 2, 29500)
    assert e.single_process is False


def test_launch_env_errors_name_the_missing_variable(clean_env):
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ConfigError, match=r"LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set, but RANK"
    ):
        read_launch_env()
    _torchrun(clean_env)
    clean_env.delenv("MASTER_PORT")
    with pytest.raises(ConfigError, match=r"^init_process_group: MASTER_PORT not set, but LOCAL_RANK"):
        read_launch_env()
    # a store replaces MASTER_ADDR/MASTER_PORT
    assert read_launch_env(need_master=False).rank == 1
    clean_env.setenv("MASTER_PORT", "http")
    with pytest.raises(ConfigError, match=r"MASTER_PORT='http' is not an integer"):
        read_launch_env()
    clean_env.setenv("MASTER_PORT", "29500")
    clean_env.setenv("RANK", "2")
    with pytest.raises(ConfigError, match=r"rank 2 is outside the world 0..1"):
        read_launch_env()


def test_getters_before_init_name_themselves_in_launch_errors(clean_env):
    """get_rank() and the other getters read the environment before init; their errors used to
    start with "init_process_group:"."""
    clean_env.setenv("RANK", "0")
    for getter in (C.get_rank, C.get_world_size, C.get_local_rank, C.get_local_size):
        with pytest.raises(
            ConfigError,
            match=rf"^{getter.__name__}: WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE not set, but RANK is\. ",
        ):
            getter()


def test_launch_env_master_only_with_explicit_rank_leaves_the_node_layout_to_the_rendezvous(clean_env):
    """The early launchers set MASTER_ADDR/MASTER_PORT and pass rank=/world_size= (no LOCAL_*)."""
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", "29500")
    e = read_launch_env(rank=2, world_size=3)
    assert (e.rank, e.world_size, e.local_known) == (2, 3, False)
    e = read_launch_env(rank=2, world_size=4, local_world_size=2)
    assert (e.local_rank, e.local_world_size, e.local_known) == (0, 2, True)
    clean_env.setenv("WORLD_SIZE", "3")  # a torchrun variable: then all of torchrun's are needed
    with pytest.raises(ConfigError, match=r"^init_process_group: LOCAL_WORLD_SIZE not set, but MASTER_ADDR"):
        read_launch_env(rank=2)


def test_launch_env_explicit_overrides(clean_env):
    e = read_launch_env(rank=0, world_size=1)
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (0, 1, 0, 1)
    with pytest.raises(ConfigError, match=r"MASTER_ADDR, MASTER_PORT not set"):
        read_launch_env(rank=1, world_size=4)
    e = read_launch_env(rank=5, world_size=8, local_world_size=4, need_master=False)
    assert (e.local_rank, e.local_world_size) == (1, 4)
    with pytest.raises(ConfigError, match=r"local_world_size must be in 1..8"):
        read_launch_env(rank=5, world_size=8, local_world_size=9, need_master=False)
    with pytest.raises(ConfigError, match=r"rank must be an int, got '1'"):
        read_launch_env(rank="1", world_size=2)


def test_env_getters_and_bucket_size(clean_env):
    assert (C.get_rank(), C.get_world_size(), C.get_local_rank(), C.get_local_size()) == (0, 1, 0, 1)
    assert C.get_default_bucket_size() == 10 * 1024 * 1024
    clean_env.setenv("BAGUA_DEFAULT_BUCKET_SIZE", "4096")
    assert C.get_default_bucket_size() == 4096
    clean_env.setenv("TRAINLOOM_DEFAULT_BUCKET_SIZE", "-1")
    with pytest.raises(ConfigError, match=r"TRAINLOOM_DEFAULT_BUCKET_SIZE='-1' must be a positive"):
        C.get_default_bucket_size()


def test_reduce_op_values():
    assert {o.name: int(o) for o in ReduceOp} == dict(
        SUM=0, PRODUCT=1, MIN=2, MAX=3, BOR=7, BAND=8, BXOR=9, AVG=10
    )


def test_not_initialized_repeated_and_after_destroy(clean_env):
    assert C.is_initialized() is False
    with pytest.raises(CommError, match=r"allreduce: the default process group is not initialized"):
        C.allreduce_inplace(torch.ones(2))
    pg = C.init_process_group(timeout=5)
    assert C.is_initialized() is True
    with pytest.raises(C.RepeatedInitializationError, match=r"already called"):
        C.init_process_group()
    comm = pg.get_global_communicator()
    assert (comm.rank(), comm.nranks()) == (0, 1)
    C.destroy_process_group()
    C.destroy_process_group()  # idempotent
    assert C.is_initialized() is False
    with pytest.raises(CommError, match=r"allreduce: communicator default/global was used after destroy"):
        C.allreduce_inplace(torch.ones(2), comm=comm)


def test_torch_distributed_gets_nccl_for_cuda_tensors_where_there_is_a_gpu(world1, monkeypatch):
    # Bagua initialised torch.distributed with NCCL; DDP and the user's own torch.distributed calls on
    # CUDA tensors would crawl through gloo. Here (no GPU) the group init_process_group made is gloo.
    assert dist.get_backend() == "gloo"
    from trainloom.comm import group

    cases = [(True, True, "cpu:gloo,cuda:nccl"), (True, False, "gloo"), (False, True, "gloo")]
    for cuda, nccl, want in cases:
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(dist, "is_nccl_available", lambda nccl=nccl: nccl)
        assert group.torch_backend() == want


def test_classic_has_early_torch_distributeds_availability_guard():
    from trainloom.comm import classic

    assert classic.is_available() is True and "is_available" in classic.__all__


def test_world_size_one_every_collective(world1):
    x = torch.arange(6, dtype=torch.float32)
    out = torch.zeros(6)
    C.allreduce(x, out, ReduceOp.AVG)
    assert torch.equal(out, x)
    t = x.clone()
    C.allreduce_inplace(t)
    C.reduce_inplace(t, 0)
    C.broadcast(t, 0)
    C.reduce_scatter_inplace(t)
    C.allgather_inplace(t)
    C.alltoall_inplace(t)
    assert torch.equal(t, x)
    out = torch.zeros(6)
    for fn in (C.allgather, C.alltoall, C.reduce_scatter):
        out.zero_()
        fn(x, out)
        assert torch.equal(out, x), fn.__name__
    out.zero_()
    C.gather(x, out, 0)
    assert torch.equal(out, x)
    out.zero_()
    C.scatter(x, out, 0)
    assert torch.equal(out, x)
    out.zero_()
    C.alltoall_v(x, [3], [1], out, [3], [2])
    assert out.tolist() == [0, 0, 1, 2, 3, 0]
    w = C.allreduce_inplace(torch.ones(0), async_op=True)
    assert w.is_completed() and w.wait() and w.result().numel() == 0
    for fn in (C.reduce_scatter_inplace, C.allgather_inplace):  # an in-place form's result: its tensor
        t = x.clone().view(2, 3)
        assert fn(t, async_op=True).result() is t, fn.__name__
    C.barrier()
    col = torch.zeros(3, 2)
    C.allgather(torch.ones(3), col[:, 1])
    assert col.tolist() == [[0, 1], [0, 1], [0, 1]]


def test_world1_output_overlapping_a_strided_input_gets_the_input_as_it_was(world1):
    """``x[0::2]`` spans 7 elements of ``x``, not 4: the overlap test used to measure it as 4, so the
    copy into ``x[4:8]`` read elements it had already written ([0, 2, 0, 0] instead of [0, 2, 4, 6])."""
    calls = {
        "allreduce": lambda s, r: C.allreduce(s, r),
        "reduce": lambda s, r: C.reduce(s, r, dst=0),
        "reduce_scatter": lambda s, r: C.reduce_scatter(s, r),
        "allgather": lambda s, r: C.allgather(s, r),
        "gather": lambda s, r: C.gather(s, r, dst=0),
        "scatter": lambda s, r: C.scatter(s, r, src=0),
        "alltoall": lambda s, r: C.alltoall(s, r),
        "alltoall_v": lambda s, r: C.alltoall_v(s, [4], [0], r, [4], [0]),
    }
    for name, call in calls.items():
        x = torch.arange(8.0)
        call(x[0::2], x[4:8])
        assert x.tolist() == [0, 1, 2, 3, 0, 2, 4, 6], name
        x = torch.arange(8.0)
        call(x[4:8], x[1::2])  # the output strided, over the input
        assert x.tolist() == [0, 4, 2, 5, 4, 6, 6, 7], name


def test_bad_arguments_raise_before_any_engine(world1):
    f32, f64 = torch.ones(4), torch.ones(4, dtype=torch.float64)
    cases = [
        (
            lambda: C.allreduce([1, 2], f32),
            TypeError,
            r"allreduce: send_tensor must be a torch.Tensor, got list",
        ),
        (
            lambda: C.allreduce(f32, f64),
            TypeError,
            r"allreduce: send_tensor has dtype torch.float32 but recv_tensor",
        ),
        (lambda: C.allreduce(f32, torch.ones(5)), ValueError, r"recv_tensor has 5 elements, expected 4"),
        (lambda: C.allreduce_inplace(torch.ones(2, device="meta")), ValueError, r"tensor is on meta"),
        (lambda: C.allreduce_inplace(torch.ones(2, dtype=torch.uint16)), TypeError, r"dtype torch.uint16"),
        (lambda: C.allreduce_inplace(torch.ones(2).to_sparse()), TypeError, r"dense \(strided\) tensor"),
        (lambda: C.allreduce_inplace(f32, 4), ValueError, r"op=4 is not a ReduceOp \(SUM=0"),
        (lambda: C.allreduce_inplace(f32, "sum"), TypeError, r"op must be a trainloom.comm.ReduceOp"),
        (
            lambda: C.allreduce_inplace(f32, ReduceOp.BAND),
            TypeError,
            r"op=BAND needs an integer or bool dtype",
        ),
        (
            lambda: C.allreduce_inplace(f32.to(torch.complex64), ReduceOp.MAX),
            TypeError,
            r"MAX is not defined",
        ),
        (
            lambda: C.allreduce_inplace(torch.ones(2, dtype=torch.int32), ReduceOp.AVG),
            TypeError,
            r"AVG needs",
        ),
        (
            lambda: C.broadcast(f32, 1),
            ValueError,
            r"broadcast: src=1 is outside the communicator's ranks 0..0",
        ),
        (lambda: C.broadcast(f32, True), TypeError, r"src must be an int rank, got True"),
        (lambda: C.reduce(f32, f32.clone(), -1), ValueError, r"reduce: dst=-1 is outside"),
        (
            lambda: C.allgather(f32, torch.ones(5)),
            ValueError,
            r"allgather: recv_tensor has 5 elements, expected 4",
        ),
        (
            lambda: C.gather(f32, torch.ones(3), 0),
            ValueError,
            r"gather: recv_tensor has 3 elements, expected 4",
        ),
        (
            lambda: C.gather_inplace(f32, 3, 0),
            ValueError,
            r"gather_inplace: tensor has 4 elements, expected 3",
        ),
        (lambda: C.scatter_inplace(f32, -1, 0), ValueError, r"scatter_inplace: count=-1 must be >= 0"),
        (lambda: C.scatter(torch.ones(3), f32, 0), ValueError, r"scatter: send_tensor has 3 elements"),
        (
            lambda: C.reduce_scatter(f32, torch.ones(3)),
            ValueError,
            r"reduce_scatter: send_tensor has 4 elements",
        ),
        (
            lambda: C.alltoall(f32, torch.ones(3)),
            ValueError,
            r"alltoall: recv_tensor has 3 elements, expected 4",
        ),
        (
            lambda: C.alltoall_v(f32, [1, 1], [0], f32, [1], [0]),
            ValueError,
            r"send_counts has 2 entries, expected 1",
        ),
        (
            lambda: C.alltoall_v(f32, [-1], [0], f32, [1], [0]),
            ValueError,
            r"send_counts must be non-negative",
        ),
        (
            lambda: C.alltoall_v(f32, [3], [2], f32, [3], [0]),
            ValueError,
            r"send_displs\[0\]=2 \+ send_counts\[0\]=3",
        ),
        (
            lambda: C.alltoall_v(f32, [2], [0], f32, [3], [0]),
            ValueError,
            r"send_counts\[0\]=2 != recv_counts\[0\]=3",
        ),
        (
            lambda: C.alltoall_v(f32, "ab", [0], f32, [1], [0]),
            TypeError,
            r"send_counts must be a sequence of 1 ints",
        ),
        (lambda: C.send(f32, 0), ValueError, r"send: dst=0 is this rank"),
        (lambda: C.recv(f32, 0), ValueError, r"recv: src=0 is this rank"),
        (lambda: C.allreduce_inplace(f32, comm="world"), TypeError, r"comm must be a trainloom Communicator"),
        (lambda: C.new_group([1]), ValueError, r"new_group: rank 1 is outside the world 0..0"),
        (lambda: C.new_group([0, 0]), ValueError, r"contain duplicates"),
        (lambda: C.reduce(f32), TypeError, r"reduce: dst \(the destination rank\) is required"),
        (
            lambda: C.allreduce(f32, [1.0] * 4),
            TypeError,
            r"allreduce: recv_tensor must be a torch.Tensor, got list",
        ),
        (lambda: C.broadcast(f32, np.int64(1)), ValueError, r"broadcast: src=1 is outside the communicator"),
        (lambda: C.broadcast(f32, np.True_), TypeError, r"src must be an int rank, got np.True_"),
        (lambda: C.broadcast(f32, 0.0), TypeError, r"src must be an int rank, got 0.0"),
        (
            lambda: C.alltoall_v(f32, [2.0], [0], f32, [2], [0]),
            TypeError,
            r"^alltoall_v: send_counts must be a sequence of 1 ints, got \[2.0\] "
            r"\(send_counts\[0\]=2.0 is a float\)$",
        ),
        (
            lambda: C.alltoall_v(f32, [2], [0], f32, [2], [np.float64(1)]),
            TypeError,
            r"recv_displs\[0\]=np.float64\(1.0\) is a float64\)$",
        ),
        (
            lambda: C.allreduce_inplace(torch.ones(2, dtype=torch.int64), dist.ReduceOp.PREMUL_SUM),
            TypeError,
            r"^allreduce: op=torch.distributed.ReduceOp.PREMUL_SUM has no trainloom equivalent",
        ),
        (
            lambda: C.allreduce_inplace(f32, dist._make_nccl_premul_sum(2.0)),
            TypeError,
            r"^allreduce: op=torch.distributed premul-sum \(factor 2.0\) has no trainloom equivalent: "
            r"multiply the tensor by the factor and use ReduceOp.SUM$",
        ),
        (
            lambda: C.allreduce_inplace(f32, dist.ReduceOp(dist.ReduceOp.BAND)),
            TypeError,
            r"^allreduce: op=BAND needs an integer or bool dtype, got torch.float32$",
        ),
        (
            lambda: C.allreduce_inplace(f32, True),
            TypeError,
            r"op must be a trainloom.comm.ReduceOp, got True",
        ),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fn()


def test_validation_that_needs_two_ranks():
    res = run_ranks(validation_two_ranks, 2, timeout=60)
    for r in res:
        assert (
            r["rs_inplace"]
            == "ValueError: reduce_scatter_inplace: tensor has 5 elements, not divisible by nranks=2"
        )
        assert r["alltoall"] == "ValueError: alltoall: send_tensor has 3 elements, not divisible by nranks=2"
        assert r["allgather"] == (
            "ValueError: allgather: recv_tensor has 4 elements, expected 6 (nranks=2 * send_tensor's 3)"
        )
        assert r["hierarchical_sub"].startswith("ValueError: allreduce(hierarchical=True): comm must be")
        assert r["ok"] == [2.0, 2.0]
    for rank, r in enumerate(res):
        e = r["early"]
        assert e["allreduce(t)"] == [3.0, 3.0]
        assert e["allreduce(t, MAX, comm)"] == [2.0, 2.0]
        assert e["allreduce(t, ReduceOp(MAX))"] == [2.0, 2.0]
        assert e["allreduce(t, op=PRODUCT)"] == [2.0, 2.0]
        assert e["reduce(t, 1, MAX, comm)"] == ([2.0, 2.0] if rank == 1 else [1.0, 1.0])
        assert e["reduce(t, dst=0)"] == ([3.0, 3.0] if rank == 0 else [2.0, 2.0])
        assert e["broadcast(t, root=1)"] == [2.0, 2.0]
        assert r["broadcast_np_src"] == [2.0, 2.0]
        assert r["recv_overlap"] == (
            "ValueError: alltoall_v: the recv_tensor ranges of ranks 0 and 1 overlap (recv_displs[0]=0, "
            "recv_counts[0]=2; recv_displs[1]=0, recv_counts[1]=2); each rank's data needs its own elements"
        )
        assert r["recv_overlap_partial"] == (
            "ValueError: alltoall_v: the recv_tensor ranges of ranks 0 and 1 overlap (recv_displs[0]=1, "
            "recv_counts[0]=2; recv_displs[1]=0, recv_counts[1]=2); each rank's data needs its own elements"
        )
        assert r["inplace_overlap"] == r["recv_overlap_partial"]
    assert res[0]["touching"] == [10.0, 11.0, 0.0, 1.0] and res[1]["touching"] == [12.0, 13.0, 2.0, 3.0]
    assert res[0]["swapped"] == [10.0, 0.0] and res[1]["swapped"] == [11.0, 1.0]


def test_python_O_still_validates(tmp_path):
    script = tmp_path / "check_O.py"
    script.write_text(
        "import sys, torch\n"
        "assert False, 'asserts are stripped under -O'\n"
        "import trainloom.comm as C\n"
        "C.init_process_group()\n"
        "try:\n"
        "    C.allgather(torch.ones(4), torch.ones(5))\n"
        "except ValueError as e:\n"
        "    print('VALIDATED', e)\n"
        "try:\n"
        "    C.allreduce_inplace(torch.ones(4), C.ReduceOp.BXOR)\n"
        "except TypeError as e:\n"
        "    print('VALIDATED', e)\n"
        "print('NCCL_MAPPED', 'libnccl' in open('/proc/self/maps').read())\n"
        "C.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out = subprocess.run(
        [sys.executable, "-O", str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert (
        lines[0] == "VALIDATED allgather: recv_tensor has 5 elements, expected 4 (nranks=1 * send_tensor's 4)"
    )
    assert lines[1].startswith("VALIDATED allreduce: op=BXOR needs an integer or bool dtype")
    assert lines[2] == "NCCL_MAPPED False"


def test_bagua_example_script_runs_after_changing_its_import():
    script = ROOT / "tools" / "examples" / "bagua_allreduce.py"
    port = free_port()
    procs = []
    for rank in range(2):
        procs.append(popen_rank([str(script)], rank, 2, port, OMP_NUM_THREADS="1"))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0].strip() == (
        "world=2 bucket=10485760 allreduce=[(4+4j), (6+6j)] avg_grad=[0.5, 0.5, 0.5, 0.5] gathered=[0.0, 1.0]"
    )


def test_work_wait_timeout_and_result():
    import concurrent.futures

    from trainloom.comm.work import FutureWork
    from trainloom.errors import CommTimeoutError

    fut: concurrent.futures.Future = concurrent.futures.Future()
    done = []
    w = FutureWork("allreduce", fut, torch.ones(2), finish=lambda: done.append(1))
    assert w.is_completed() is False
    with pytest.raises(CommTimeoutError, match=r"allreduce: Work.wait\(timeout=0.01\) expired"):
        w.wait(timeout=0.01)
    fut.set_result(None)
    assert w.wait() is True and w.is_completed() and done == [1]
    assert w.result().tolist() == [1.0, 1.0] and done == [1]  # finish runs once
    bad: concurrent.futures.Future = concurrent.futures.Future()
    bad.set_exception(CommError("allreduce #3: ranks disagree"))
    with pytest.raises(CommError, match=r"ranks disagree"):
        FutureWork("allreduce", bad, None).wait()
    # an operation that itself timed out reports its own error, not "Work.wait expired"
    late: concurrent.futures.Future = concurrent.futures.Future()
    late.set_exception(CommTimeoutError("allreduce #4 (gloo, rank 0 of 2): timed out after 2s; ranks [1]"))
    with pytest.raises(CommTimeoutError, match=r"allreduce #4 \(gloo, rank 0 of 2\): timed out after 2s"):
        FutureWork("allreduce", late, None).wait()


def test_unreachable_master_is_a_timeout_not_a_hang(clean_env):
    from trainloom.errors import CommTimeoutError

    _torchrun(clean_env, rank=1, world=2)
    clean_env.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    with pytest.raises(CommTimeoutError, match=r"rank 1 of 2\): could not reach the TCPStore at 127.0.0.1:"):
        C.init_process_group(timeout=1)
    assert C.is_initialized() is False


def test_nccl_enum_tables_match_the_installed_header():
    import re

    import nvidia.nccl

    from trainloom.comm import nccl

    header = (Path(list(nvidia.nccl.__path__)[0]) / "include" / "nccl.h").read_text()
    values = {
        m.group(1): int(m.group(2)) for m in re.finditer(r"\b(nccl[A-Z][A-Za-z0-9]*)\s*=\s*(\d+)", header)
    }
    names = {
        torch.int8: "ncclInt8",
        torch.uint8: "ncclUint8",
        torch.int32: "ncclInt32",
        torch.int64: "ncclInt64",
        torch.float16: "ncclFloat16",
        torch.float32: "ncclFloat32",
        torch.float64: "ncclFloat64",
        torch.bfloat16: "ncclBfloat16",
        torch.bool: "ncclUint8",
    }
    for dtype, name in names.items():
        assert nccl.NCCL_DTYPES[dtype] == values[name], name
    ops = {
        ReduceOp.SUM: "ncclSum",
        ReduceOp.PRODUCT: "ncclProd",
        ReduceOp.MIN: "ncclMin",
        ReduceOp.MAX: "ncclMax",
        ReduceOp.AVG: "ncclAvg",
    }
    for op, name in ops.items():
        assert nccl._OPS[int(op)] == values[name], name


def _pairs_sharing_an_int():
    """(torch op, trainloom op) with the same integer: torch numbers SUM=0, AVG=1, PRODUCT=2, MIN=3, ...,
    Bagua SUM=0, PRODUCT=1, MIN=2, MAX=3, BOR=7, BAND=8, ..."""
    torch_ops = [getattr(dist.ReduceOp, n) for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR")]
    torch_ops += [dist.ReduceOp.BXOR, dist.ReduceOp.PREMUL_SUM]
    return [(t, o) for t in torch_ops for o in ReduceOp if int(t) == int(o)]


def test_op_cache_keeps_torch_and_bagua_numbering_apart():
    from trainloom.comm import collectives

    pairs = _pairs_sharing_an_int()
    names = {(t.name, o.name) for t, o in pairs}
    assert names == {
        ("SUM", "SUM"),
        ("AVG", "PRODUCT"),
        ("PRODUCT", "MIN"),
        ("MIN", "MAX"),
        ("BXOR", "BOR"),
    } | {("PREMUL_SUM", "BAND")}
    for t, o in pairs:
        dtype = torch.int64 if o in (ReduceOp.BOR, ReduceOp.BAND) else torch.float64
        want_t = getattr(ReduceOp, t.name, None)  # what the torch op means (None: refused)
        for order in ((t, o), (o, t)):
            collectives._OP_CACHE.clear()
            for op in order + order:  # the second round is served from the cache
                if op is t and want_t is None:
                    with pytest.raises(TypeError, match=r"op=torch.distributed.ReduceOp.PREMUL_SUM has no"):
                        collectives._op(op, dtype, "allreduce")
                    continue
                got = collectives._op(op, dtype, "allreduce")
                assert got is (want_t if op is t else o), (t.name, o.name, order, op)
            # plain ints and numpy ints are Bagua's numbering whatever came before
            assert collectives._op(int(o), dtype, "allreduce") is o
            assert collectives._op(np.int64(int(o)), dtype, "allreduce") is o


def test_the_two_bagua_module_paths_carry_the_same_names():
    # docs/comm.md says so; bagua.WORLD, bagua.broadcast_object and
    # communication.get_default_bucket_size were missing from one of them.
    public = {n for n in C.communication.__all__}
    assert public <= set(C.__all__), sorted(public - set(C.__all__))
    for name in sorted(public):
        assert getattr(C, name) is getattr(C.communication, name), name
    for name in ("get_rank", "get_world_size", "get_local_rank", "get_local_size", "get_default_bucket_size"):
        assert getattr(C.communication, name) is getattr(C.env, name), name
    assert C.WORLD is C.CommMember.WORLD


def test_non_comm_member_placeholder(world1):
    x = C.NON_COMM_MEMBER
    assert x is C.CommMember.NON_COMM_MEMBER is C.communication.NON_COMM_MEMBER
    assert isinstance(x, C.NonCommMember) and C.NonCommMember() is x
    assert not x and x is not None
    assert (
        repr(x)
        == "NON_COMM_MEMBER (this rank is not a member of the communicator; collectives on it do nothing)"
    )
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(x)) is x and copy.deepcopy(x) is x
    with pytest.raises(AttributeError, match=r"^NON_COMM_MEMBER has no attribute 'rank': this rank is not a"):
        x.rank()
    # on a world of one every rank is a member of every communicator of the default group
    pg = C.get_default_group()
    assert pg.get_inter_node_communicator() is pg.get_global_communicator().inter
    # collectives given it do nothing, without looking at their arguments (as Bagua's _rank_not_in_comm)
    t = torch.ones(3)
    assert C.allreduce(t, "not a tensor", comm=x) is None and t.tolist() == [1.0, 1.0, 1.0]
    w = C.broadcast(t, 5, comm=x, async_op=True)
    assert w.is_completed() and w.wait() is True and w.result() is t
    # the extension APIs need a member and say so
    with pytest.raises(
        CommError, match=r"^neighbor_allreduce: comm is NON_COMM_MEMBER \(rank 0 is not a member of that "
    ):
        C.neighbor_allreduce(t, comm=x)


def test_getters_connect_the_default_device_engine_once(world1, monkeypatch):
    """A getter connects (collectively, as Bagua's get_communicator) the engine Bagua would: the
    current CUDA device's when CUDA and NCCL are there, else the CPU's. ``comm=None`` stays lazy."""
    from trainloom.comm import nccl

    comm = world1.global_communicator_unconnected()
    asked = []
    monkeypatch.setattr(comm, "engine", lambda device: asked.append(str(device)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(nccl, "is_available", lambda: False)
    assert world1.get_global_communicator() is comm
    assert asked == ["cpu"]  # no NCCL: the CPU engine
    world1.get_global_communicator()
    assert asked == ["cpu"]  # once
    comm._connected = False
    monkeypatch.setattr(nccl, "is_available", lambda: True)
    world1.get_global_communicator()
    assert asked == ["cpu", "cuda:1"]


def test_early_tensor_keyword_is_accepted(world1):
    # bagua-communication-early.txt: allreduce(tensor, op, comm) / reduce(tensor, dst, op, comm)
    t = torch.full((2,), 3.0)
    C.allreduce(tensor=t, op=ReduceOp.MAX)
    C.reduce(tensor=t, dst=0)
    w = C.allreduce(tensor=t, async_op=True)
    assert w.result() is t and t.tolist() == [3.0, 3.0]
    cases = [
        (
            lambda: C.allreduce(t, tensor=t),
            r"^allreduce: got both send_tensor and tensor; tensor= is Bagua's early name for the in-place "
            r"tensor, pass only one of them$",
        ),
        (
            lambda: C.reduce(tensor=t, recv_tensor=t.clone(), dst=0),
            r"^reduce: tensor= is Bagua's early in-place form and takes no recv_tensor; write "
            r"send_tensor=..., recv_tensor=... instead$",
        ),
        (
            lambda: C.allreduce(),
            r"^allreduce\(\) missing its input tensor: pass send_tensor \(or tensor=, Bagua's early name\)$",
        ),
        (lambda: C.reduce(dst=0), r"^reduce\(\) missing its input tensor"),
    ]
    for fn, pattern in cases:
        with pytest.raises(TypeError, match=pattern):
            fn()


def test_communication_submodule_is_an_attribute_after_importing_the_package():
    # Bagua: `import bagua.torch_api as bagua; bagua.communication.new_group(...)`; a fresh interpreter,
    # since this test process may have imported the submodule already
    code = (
        "import sys, trainloom.comm as bagua\n"
        "print(bagua.communication.allreduce is bagua.allreduce,"
        " bagua.communication.new_group is bagua.new_group, 'trainloom.comm.communication' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True True True"


_REINIT = """
import sys
import torch
import trainloom.comm.bluefog as bf

lines = []
for k in range(2):
    bf.init()
    out = bf.neighbor_allreduce(torch.ones(2) * (bf.rank() + k))
    lines.append(f"rank {bf.rank()} round {k}: {out.tolist()}")
    rank = bf.rank()
    bf.shutdown()
with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as f:  # a file per rank: stdout lines may interleave
    f.write("\\n".join(lines))
"""


def test_init_shutdown_init_under_torchrun(tmp_path):
    # torchrun's agent store outlives shutdown(): the second init read the first one's gloo keys
    # (rank 0 connected to stale addresses; rank 1 timed out in gloo's connectFullMesh).
    script = tmp_path / "reinit.py"
    script.write_text(_REINIT)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(TRAINLOOM_COMM_TIMEOUT="20", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
            *[str(script), str(tmp_path)],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for r in range(2) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()]
    assert lines == [
        "rank 0 round 0: [0.5, 0.5]",
        "rank 0 round 1: [1.5, 1.5]",
        "rank 1 round 0: [0.5, 0.5]",
        "rank 1 round 1: [1.5, 1.5]",
    ]


def test_gloo_header_descriptions():
    from trainloom.comm import _gloo

    t = torch.ones(2, 3)
    assert _gloo.describe(_gloo.make_header("allreduce", 5, t, op=0).tolist()) == (
        "allreduce #5 dtype=float32 numel=6 shape=(2, 3) op=SUM"
    )
    # alltoall_v's counts differ per rank by design: no placeholder numel=0 beside a real shape
    assert _gloo.describe(_gloo.make_header("alltoall_v", 7, t.double(), numel=0).tolist()) == (
        "alltoall_v #7 dtype=float64"
    )
