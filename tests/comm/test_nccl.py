"""The NCCL binding: real libnccl (nvidia-nccl-cu12) without a GPU, a fake libnccl for the plumbing."""

from __future__ import annotations

import threading
import types

import pytest
import torch
from commutil import (
    build_fake_nccl,
    fake_nccl_no_p2p,
    fake_nccl_plumbing,
    gpu_collectives,
    local_reduce,
    nccl_engine_on_fake,
    nccl_unavailable,
    real_nccl,
)
from multiproc import run_ranks

from trainloom.comm import ReduceOp
from trainloom.errors import CommError


@pytest.fixture(scope="module")
def fake_libs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake_nccl")
    return build_fake_nccl(d), build_fake_nccl(d, no_p2p=True)


def test_real_libnccl_loads_at_first_use_and_fails_cleanly_without_gpu():
    (res,) = run_ranks(real_nccl, 1, env={"CUDA_VISIBLE_DEVICES": ""})
    # importing trainloom.comm maps no libnccl; the first query loads the wheel's copy
    assert res["maps_before"] is False and res["loaded_after_import"] is False
    assert res["available"] is True and res["maps_after"] is True
    assert res["version"] >= 21800
    assert res["path"].endswith("libnccl.so.2") and "nvidia/nccl/lib" in res["path"]
    assert res["uid"] == (128, True)
    status, where, text = res["init"]
    assert status != 0 and where == "ncclCommInitRank" and f"(code={status})" in text
    assert res["config"] == (True, res["version"], res["path"])  # show_config() reports it


def test_missing_libnccl_lists_the_path_tried(tmp_path):
    missing = str(tmp_path / "no-such-libnccl.so.2")
    (res,) = run_ranks(nccl_unavailable, 1, env={"TRAINLOOM_NCCL_LIBRARY": missing})
    assert res["available"] is False
    assert missing in res["reason"] and "No such file" in res["reason"]
    assert "pip install nvidia-nccl-cu12" in res["error"]
    assert missing in res["error"]


def test_a_bare_library_name_is_explained():
    (res,) = run_ranks(nccl_unavailable, 1, env={"TRAINLOOM_NCCL_LIBRARY": "libnccl-no-such.so.2"})
    assert res["available"] is False
    assert "A bare file name is looked up by the dynamic loader only" in res["error"], res["error"]


def test_a_library_that_is_not_nccl_is_named_as_such():
    import ctypes.util

    name = ctypes.util.find_library("z")  # zlib: loads fine, exports no NCCL symbol
    if name is None:
        pytest.skip("no zlib shared library to load")
    (res,) = run_ranks(nccl_unavailable, 1, env={"TRAINLOOM_NCCL_LIBRARY": name})
    assert res["available"] is False
    assert res["error"] == f"NCCL unavailable: {name} is not an NCCL library (it exports no ncclGetVersion)"


def test_fake_libnccl_plumbing(fake_libs):
    lib, lib_nop2p = fake_libs
    (res,) = run_ranks(fake_nccl_plumbing, 1, lib, lib_nop2p, env={"TRAINLOOM_NCCL_LIBRARY": lib})
    assert res["loaded_before"] is False
    assert res["available"] is True and res["version"] == 21899 and res["path"] == lib
    assert res["has_alltoall"] is False
    assert res["rank_count"] == (0, 1, 1)
    assert res["allreduce"] == list(map(float, range(8)))
    assert res["alltoall"] == list(map(float, range(8)))
    assert res["alltoall_v"] == [0, 0, 0, 0, 2, 3, 4, 0]
    assert res["gather"] == list(map(float, range(8)))
    status, where, text = res["error"]
    assert (status, where) == (
        4,
        "ncclAllReduce",
    ) and text == "ncclAllReduce: invalid argument (fake) (code=4)"
    assert res["gil_released"] is True
    assert res["live_after_close"] == 0
    assert "used after close() or abort()" in res["after_close"]
    assert res["live_after_del"] == 0
    assert res["ctx_live"] == 1 and res["live_after_abort"] == 0
    assert res["init_error"] == (5, "ncclCommInitRank")
    assert res["bad_uid"] == "unique_id must be 128 bytes (ncclUniqueId), got 5"
    assert res["bad_world_rank_0_0"] == "world_size must be >= 1, got 0"
    assert res["bad_world_rank_2_2"] == "rank 2 is outside 0..1"


def test_fake_libnccl_without_send_recv_raises_not_implemented(fake_libs):
    _, lib_nop2p = fake_libs
    (res,) = run_ranks(fake_nccl_no_p2p, 1, env={"TRAINLOOM_NCCL_LIBRARY": lib_nop2p})
    assert "ncclSend is not exported by the loaded libnccl (version 21899" in res["alltoall"]
    assert res["allreduce"] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_collectives_on_gpus():  # pragma: no cover - needs GPUs
    ws = min(torch.cuda.device_count(), 2)
    assert run_ranks(gpu_collectives, ws, timeout=120) == [[]] * ws


def test_local_reference_semantics():
    # the reference the GPU test uses agrees with the CPU engines' bool semantics
    stack = torch.tensor([[True, False, False], [True, True, False]])
    assert local_reduce(stack, ReduceOp.SUM).tolist() == [True, True, False]
    assert local_reduce(stack, ReduceOp.PRODUCT).tolist() == [True, False, False]
    assert local_reduce(stack, ReduceOp.BXOR).tolist() == [False, True, False]
    ints = torch.tensor([[6, 3], [5, 1]])
    assert local_reduce(ints, ReduceOp.BAND).tolist() == [4, 1]
    assert local_reduce(ints, ReduceOp.MIN).tolist() == [5, 1]


def test_nccl_engine_plumbing_on_the_fake(fake_libs):
    lib, _ = fake_libs
    (res,) = run_ranks(nccl_engine_on_fake, 1, env={"TRAINLOOM_NCCL_LIBRARY": lib})
    assert res["uid_in_store"] == 128
    bad = [k for k, ok in res["ops"].items() if not ok]
    assert bad == [] and len(res["ops"]) > 60
    assert res["int16"].startswith("TypeError: allreduce: NCCL has no torch.int16")
    assert res["send_status"] == "NcclError: ncclSend: invalid usage (fake) (code=5)"
    assert res["work"] == (True, True, [1.0])
    assert res["after_abort"] == "CommError: allreduce: the NCCL communicator was aborted: test abort"
    assert res["after_close"].startswith("CommError: allreduce: NCCL communicator used after close()")
    assert (
        res["watchdog"] == "CommError: allreduce: the NCCL communicator was aborted: allreduce exceeded 0.3s"
    )
    assert res["work_timeout"].startswith(
        "CommTimeoutError: NCCL operation did not finish before the deadline"
    )
    assert res["work_timeout_aborted"] == "Work.wait timeout"
    assert res["live"] == 1  # only `eng` is still open at that point: aborted/closed ones were freed


def test_conjugate_and_negative_views_are_refused_before_nccl_sees_them():
    from trainloom.comm.nccl import NcclEngine

    z = torch.tensor([1 + 2j, 3 + 4j])
    with pytest.raises(TypeError, match=r"^allreduce: a conjugate view holds other values in memory"):
        NcclEngine._dtype(z.conj(), "allreduce")
    with pytest.raises(TypeError, match=r"^broadcast: a negative view holds other values in memory"):
        NcclEngine._dtype(z.conj().imag, "broadcast")  # the imaginary part of a conj view has the neg bit
    t, _ = NcclEngine._dtype(z.conj().resolve_conj(), "allreduce")
    assert t.shape == (2, 2)


# ------------------------------------------------------------------------------------------------
# device checks before an NCCL engine is made (group.Communicator._cuda_engine): no GPU here, so
# torch.cuda's answers and NcclEngine are replaced; the communicators, their store and the checks
# are real. Each rank is a Communicator in its own thread, over one HashStore.
# ------------------------------------------------------------------------------------------------
class _StubNcclEngine:
    def __init__(self, store, rank, world_size, *, prefix, device, stream=None, timeout=300.0):
        self.rank, self.device = rank, device


def _gpu_comms(monkeypatch, n, uuids):
    """``n`` ranks of communicator "g"; ``uuids``: device index -> the uuid torch reports for it."""
    import datetime

    import torch.distributed as dist

    from trainloom.comm import group, nccl

    monkeypatch.setattr(nccl, "NcclEngine", _StubNcclEngine)
    monkeypatch.setattr(group, "node_identity", lambda: "node-a")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))  # a rank that never writes its GPU: no hang
    return [group.Communicator("g", list(range(n)), r, store, timeout=5, same_node=True) for r in range(n)]


def _on_threads(fns):
    """Run each rank's function in its own thread; each rank's result or exception, by rank."""
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as exc:  # noqa: BLE001 -- reported to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_tensor_on_another_gpu_than_the_communicators_is_refused(monkeypatch):
    comms = _gpu_comms(monkeypatch, 2, {0: "GPU-aaaa", 1: "GPU-bbbb", 2: "GPU-cccc"})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # rank 0 takes cuda:0 through the current device (a device without an index), rank 1 cuda:1
    engines = _on_threads([lambda: comms[0].engine(torch.device("cuda")), lambda: comms[1].engine("cuda:1")])
    assert [(type(e), e.device) for e in engines] == [
        (_StubNcclEngine, torch.device("cuda", 0)),
        (_StubNcclEngine, torch.device("cuda", 1)),
    ]
    assert comms[1].engine(torch.device("cuda", 1)) is engines[1]  # made once
    # rank 1 then gets a tensor on cuda:2: refused before the operation runs, through execute()
    ran = []
    with pytest.raises(ValueError) as info:
        comms[1].execute("allreduce", torch.device("cuda", 2), ran.append, False, None)
    assert str(info.value) == (
        "tensor is on cuda:2 but communicator g uses cuda:1 on rank 1; call "
        "torch.cuda.set_device(local_rank) before the first collective and keep each rank's tensors on "
        "its own device"
    )
    assert ran == []
    # a set_device() after the first operation: "cuda" now means cuda:2 on rank 0
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    with pytest.raises(ValueError) as info:
        comms[0].engine(torch.device("cuda"))
    assert str(info.value).startswith("tensor is on cuda:2 but communicator g uses cuda:0 on rank 0; ")
    assert comms[0]._cuda == {0: engines[0]} and comms[1]._cuda == {1: engines[1]}


def test_two_ranks_on_one_gpu_are_refused_on_every_rank(monkeypatch):
    # ranks 1 and 2 both on cuda:1: every rank raises, rank 0 (on its own GPU) too, and no NCCL
    # engine is made
    comms = _gpu_comms(monkeypatch, 3, {0: "GPU-aaaa", 1: "GPU-bbbb"})
    devices = [0, 1, 1]
    out = _on_threads([lambda r=r: comms[r].engine(torch.device("cuda", devices[r])) for r in range(3)])
    for rank, exc in enumerate(out):
        assert isinstance(exc, CommError), (rank, exc)
        assert str(exc) == (
            "ranks 1 and 2 of g use the same GPU (node-a#GPU-bbbb); give each rank its own device with "
            "torch.cuda.set_device(get_local_rank())"
        ), (rank, str(exc))
        assert comms[rank]._cuda == {}
    # the same index on two ranks is fine when it is two GPUs (the uuid is what counts)
    comms = _gpu_comms(monkeypatch, 2, {0: "GPU-aaaa", 1: "GPU-bbbb"})
    uuids = iter(["GPU-aaaa", "GPU-cccc"])  # one per call: each rank's cuda:0 is another GPU
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=next(uuids))
    )
    out = _on_threads([lambda r=r: comms[r].engine(torch.device("cuda", 0)) for r in range(2)])
    assert [type(e) for e in out] == [_StubNcclEngine, _StubNcclEngine], out
