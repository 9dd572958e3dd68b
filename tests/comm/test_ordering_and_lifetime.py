"""Async hierarchical ordering, fp16/bf16 AVG, re-init, a vanished store host, gloo send/recv queues and
global ranks in errors: real 2- to 4-process runs (4 ranks = 2 logical nodes via TRAINLOOM_NODE_ID)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from commutil import (
    bagua_example_flow,
    concurrent_first_ops,
    getter_on_one_rank,
    half_avg,
    hier_async_ordering,
    hier_timeout,
    neighbour_exchange,
    one_element_strided,
    p2p_exchange,
    p2p_recv_timeout,
    reinit_keeping_groups,
    script_patterns,
    shm_segments,
    store_host_gone,
    store_port_in_use,
    sub_comm_timeout,
)
from multiproc import free_port, popen_rank, run_ranks


@pytest.mark.parametrize("ws", [2, 4])
def test_async_hierarchical_allreduce_is_ordered_before_later_calls(ws):
    # ws=2: one node (global and intra on shm); ws=4: 2x2 (global and inter on gloo, intra on shm)
    before = shm_segments()
    res = run_ranks(hier_async_ordering, ws, 25, timeout=240)
    assert res == [[]] * ws, "\n".join(line for r in res for line in r[:10])
    assert shm_segments() == before


@pytest.mark.parametrize(("ws", "engine"), [(2, "gloo"), (2, "auto"), (4, "auto")])
def test_half_precision_avg_sums_in_fp32_on_every_path(ws, engine):
    res = run_ranks(half_avg, ws, engine, timeout=120)
    for rank, r in enumerate(res):
        assert r.pop("engine") == ("gloo" if engine == "gloo" or ws == 4 else "shm")
        assert r.pop("float16/column_neighbours_zero") is True
        assert r.pop("bfloat16/column_neighbours_zero") is True
        want = {
            f"{dt}/{k}": "ok"
            for dt in ("float16", "bfloat16")
            for k in (
                "allreduce",
                "hierarchical",
                "hierarchical_async",
                "hierarchical_async_column",
                "reduce_scatter",
            )
            + (("reduce",) if rank == ws - 1 else ())
        }
        assert r == want, (rank, r)


def test_reinit_while_holding_old_groups_under_a_plain_launch():
    res = run_ranks(reinit_keeping_groups, 2, timeout=120)
    for r in res:
        assert r["sums"] == [[1.0] * 3, [3.0] * 3, [5.0] * 3]
        assert r["old_default"] == (
            "CommError: allreduce: communicator default/global was used after destroy_process_group(); "
            "call init_process_group()/new_group() again and use the new communicators"
        )
        assert r["old_sub"].startswith("CommError: broadcast: communicator g"), r["old_sub"]
        assert r["old_sub"].endswith(
            "/global was used after destroy_process_group(); "
            "call init_process_group()/new_group() again and use the new communicators"
        )


def test_a_client_that_catches_the_old_store_closing_connects_again(monkeypatch):
    # Re-initializing under a plain launch: a client that asked the earlier generation's store just
    # as rank 0 closed it got "Failed to recv, got 0 bytes" and gave up at once (rank 0 then waited
    # 30 s for it). The race cannot be timed from a test; the closing store is simulated.
    import torch.distributed as dist

    from trainloom.comm import group

    class Closing:
        def check(self, keys):
            raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")

    good = dist.HashStore()
    made = []

    def tcp_store(*args, **kwargs):
        made.append(args)
        return Closing() if len(made) == 1 else good

    monkeypatch.setattr(group.dist, "TCPStore", tcp_store)
    monkeypatch.setattr(group, "_await_listener", lambda addr, port, deadline: None)  # nothing listens
    launch = group.LaunchEnv(
        rank=1,
        world_size=2,
        local_rank=1,
        local_world_size=2,
        master_addr="127.0.0.1",
        master_port=1,
        single_process=False,
    )
    assert group._connect_store(launch, host=False, timeout=5) is good and len(made) == 2
    made.clear()
    monkeypatch.setattr(group.dist, "TCPStore", lambda *a, **k: Closing())
    with pytest.raises(RuntimeError, match="Failed to recv"):  # not forever: until the deadline
        group._connect_store(launch, host=False, timeout=0.2)


def test_store_port_in_use_is_reported_at_once_and_as_such():
    (err,) = run_ranks(store_port_in_use, 1, timeout=60)
    assert err.startswith("CommError: init_process_group (rank 0 of 2): could not host the TCPStore at "), err
    assert ": the port is already in use (" in err
    assert "EADDRINUSE" in err
    assert "within" not in err


@pytest.mark.parametrize("engine", ["gloo", "shm"])
def test_group_connecting_after_the_store_host_exited_says_so(engine):
    res = run_ranks(store_host_gone, 3, engine, timeout=120)
    assert res[0] == {}
    for rank in (1, 2):
        err = res[rank]["error"]
        gone = "could not connect because the store is gone ("
        if engine == "gloo":
            assert err.startswith("CommError: gloo communicator tl/1/g"), err
            assert f"/global/gloo (rank {rank - 1} of 2): {gone}" in err
        else:  # (it was torch's DistNetworkError, unexplained)
            assert err.startswith("CommError: ShmCommunicator(prefix='tl/1/g"), err
            assert f"/global/shm') rank {rank - 1} of 2: {gone}" in err
        assert "rank 0 must stay alive until every group has been used once" in err
        assert err.endswith("[communicator " + err.split("[communicator ")[1])
        assert "its ranks are global ranks 0->1, 1->2]" in err


@pytest.mark.parametrize("engine", ["gloo", "shm"])
def test_async_send_or_recv_first_exchange_with_the_same_peer(engine):
    """Sends and receives have a queue each on both CPU engines: neither an isend/recv nor an
    irecv/send exchange deadlocks, also with messages larger than the shm pair channel."""
    res = run_ranks(p2p_exchange, 2, engine, timeout=120)
    for rank, r in enumerate(res):
        peer = rank ^ 1
        assert r["engine"] == engine
        assert r["irecv_send_big"] is True
        assert r["isend_recv"] == [[float(10 * peer + i)] * 4 for i in range(3)]
        assert r["isend_irecv_allreduce"] == ([11.0] * 6, True)  # 5 + 6: sent and received before
        assert r["irecv_send"] == [float(peer + 7)] * 2
        assert r["ordered"] == [0.0, 1.0, 2.0]


def test_timeout_on_a_sub_communicator_names_global_ranks():
    res = run_ranks(sub_comm_timeout, 3, timeout=120)
    assert res[0] == {} and res[2] == {}
    err = res[1]["error"]
    assert err.startswith(
        "allreduce #2 (gloo, rank 0 of 2): timed out after 3s; ranks [1] did not arrive within 3s of "
        "this rank."
    ), err
    assert err.endswith("its ranks are global ranks 0->1, 1->2; missing: global ranks [2]]"), err
    op, seq, missing, global_missing, name = res[1]["attrs"]
    assert (op, seq, missing, global_missing) == ("allreduce", 2, [1], [2])
    assert name.startswith("g") and name.endswith("/global")


def test_hierarchical_timeout_names_the_global_ranks_each_rank_waits_for():
    before = shm_segments()
    res = run_ranks(hier_timeout, 4, timeout=120)
    assert res[3] == {}
    # rank 2 waits in the intra-node reduce (shm) for its node peer, global rank 3
    err2 = res[2]["error"]
    assert err2.startswith(
        "CommTimeoutError: shm reduce #3 on rank 0/2 (prefix 'tl/1/default/intra1/shm'): "
        "timed out after 3 s waiting for ranks [1]."
    ), err2
    assert err2.endswith(
        " [communicator default/intra1: its ranks are global ranks 0->2, 1->3; missing: global ranks [3]]"
    ), err2
    assert res[2]["global_missing"] == [3]
    # rank 0 waits in the inter-node allreduce (gloo) for the other leader, global rank 2
    err0 = res[0]["error"]
    assert err0.startswith(
        "CommTimeoutError: allreduce #2 (gloo, rank 0 of 2): timed out after 3s; ranks [1] did not arrive "
        "within 3s of this rank."
    ), err0
    assert err0.endswith(
        " [communicator default/inter: its ranks are global ranks 0->0, 1->2; missing: global ranks [2]]"
    ), err0
    assert res[0]["global_missing"] == [2]
    assert shm_segments() == before


@pytest.mark.parametrize("engine", ["gloo", "auto"])
def test_communicators_whose_engines_connect_at_the_same_time(engine):
    """Engines connect at their communicator's first operation; an asynchronous first operation
    connects in the issuing thread, so two of them back to back connect in issue order: on two
    worker threads at once, over the one TCPStore client, they failed at random (timeouts)."""
    before = shm_segments()
    res = run_ranks(concurrent_first_ops, 2, engine, 8, timeout=240)
    assert res == [[], []], "\n".join(line for r in res for line in r[:5])
    assert shm_segments() == before


def test_one_element_strided_views_through_gloo():
    """m[:, 1] of a 1 x 3 m has stride 3 and is contiguous by torch's rule; gloo's byte view needed
    stride 1 (RuntimeError "stride(-1) must be 1") for broadcast, send/recv and hierarchical."""
    res = run_ranks(one_element_strided, 2, timeout=120)
    for r in res:
        assert r["broadcast"] == [[7.0, 2.0, 7.0]]
        assert r["hierarchical"] == r["hierarchical_async"] == [[7.0, 3.0, 7.0]]
        assert r["send_recv"] == [[7.0, 5.0, 7.0]]


def test_gloo_recv_timeout_names_the_missing_send_not_the_idle_ranks():
    res = run_ranks(p2p_recv_timeout, 3, timeout=120)
    assert res[0] == {
        "error": "CommTimeoutError: recv #1 (gloo, rank 0 of 3): timed out after 3s; the peer (rank 1) did "
        "not post the matching send. Check that every recv has a matching send on the peer, or raise the "
        "timeout",
        "missing": None,
        "waited_the_timeout": True,
    }
    assert res[1] == res[2] == {}


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_bagua_example_p2p_between_two_ranks_first_while_the_others_go_on(engine):
    """Bagua connects a communicator when ranks ask for it: the p2p-first start of Bagua's
    communication example ran into the connection of ranks 2/3 and waited for the timeout."""
    res = run_ranks(bagua_example_flow, 4, engine, timeout=90)
    for rank, r in enumerate(res):
        assert r["engine"] == engine
        assert r["recv"] == ([4.0] * 3 if rank == 1 else [0.0] * 3)
        assert r["world"] == [10.0, 10.0]
        assert r["env"] == (rank, 4, rank, 4)
        assert r["from_torch_group"] == (([1], (0, 1)) if rank == 1 else ([], True))
        assert r["object"] == {"from": 1}


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_receives_from_two_neighbours_posted_before_the_sends_complete(engine):
    """Sends and receives are queued per peer: a rank waiting for its left neighbour's message does
    not hold up the receive from its right one (the cycle of one queue per direction deadlocked)."""
    res = run_ranks(neighbour_exchange, 3, engine, timeout=120)
    for rank, r in enumerate(res):
        nxt, prv = float((rank + 1) % 3), float((rank - 1) % 3)
        for n in (1 << 20, 3):
            assert r[f"recv_first_{n}"] == ([nxt], [prv])
            assert r[f"send_first_{n}"] == ([10 + nxt], [10 + prv])


def test_a_getter_called_on_one_rank_only_times_out_saying_every_member_must_call_it():
    res = run_ranks(getter_on_one_rank, 2, timeout=60)
    err = res[0]["error"]
    assert err.startswith("CommTimeoutError: "), err
    assert err.endswith(
        ". Asking for a communicator (get_global_communicator() and the other getters) connects it, "
        "as in Bagua: every member must ask for it"
    ), err


def _torchrun_2(script, **env: str) -> subprocess.CompletedProcess:
    """``script`` on 2 processes under torchrun (--standalone; no launch variable inherited), with
    ``env`` added; its text output captured."""
    launch_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    full = {k: v for k, v in os.environ.items() if k not in launch_vars}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
    )


_CTRL_C_SCRIPT = """
import os, signal, sys
import torch
import trainloom.comm as C

C.init_process_group(timeout=300)
C.barrier()
if C.get_rank() == 0:
    w = C.recv(torch.zeros(4), 1, async_op=True)  # rank 1 never sends
    raise KeyboardInterrupt  # Ctrl-C while the receive is in flight
# torchrun's agent terminates the other workers once rank 0 has failed: on gloo rank 1 learns of it
# from the same exit (its connections close), so it would race the agent's SIGTERM to print
signal.signal(signal.SIGTERM, signal.SIG_IGN)
try:
    C.barrier()
except Exception as exc:
    print("rank 1:", type(exc).__name__, str(exc).split(": ", 1)[1][:200], flush=True)
"""


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_ctrl_c_with_an_async_receive_in_flight_exits_now_and_peers_fail_fast(tmp_path, engine):
    """The interpreter joins the worker threads before atexit: without the exit hook the process
    stayed until the receive's 300 s timeout (the 120 s limit below would end the test). On gloo
    the worker thread's wait also had to end (it waits in slices and sees the abort), and the
    process group, whose destructor would wait for the receive, is left to the process's exit."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_SCRIPT)
    out = _torchrun_2(script, TRAINLOOM_CPU_ENGINE="shm" if engine == "shm" else "gloo")
    assert "KeyboardInterrupt" in out.stderr, out.stderr[-2000:]
    if engine == "shm":
        expected = "rank 1: CommError the communicator was aborted by rank 0 (abort() was called)"
    else:  # gloo: rank 0's connections close with its process
        expected = "rank 1: CommError a peer died or left the job ("
    assert expected in out.stdout, (out.stdout, out.stderr[-2000:])


_CTRL_C_SYNC_SCRIPT = """
import os, sys, time
from pathlib import Path
import torch
import trainloom.comm as C

flag = Path(sys.argv[1])
C.init_process_group(timeout=300)
C.barrier()
if C.get_rank() == 0:
    print("waiting", flush=True)
    if sys.argv[2] == "recv":
        C.recv(torch.empty(4), 1)  # rank 1 never sends: Ctrl-C arrives here
    else:
        C.allreduce(torch.ones(4), torch.empty(4))  # rank 1 does not join: Ctrl-C arrives here
    print("returned", flush=True)
else:
    while not flag.exists():  # the test creates it once rank 0 has exited
        time.sleep(0.05)
    try:
        C.barrier()
    except Exception as exc:
        print("rank 1:", type(exc).__name__, flush=True)
"""


@pytest.mark.parametrize("op", ["allreduce", "recv"])
def test_ctrl_c_during_a_blocking_gloo_collective_raises_now(tmp_path, op):
    """gloo's wait blocks in C++, where Python runs no signal handler: Ctrl-C on a rank waiting for a
    peer took effect only when the operation timed out (300 s here; the 60 s limit below would end
    the test), and the process group's destructor then waited for it again at exit. A receive is
    waited for on a helper thread (a gloo send/recv cannot be waited in slices)."""
    script = tmp_path / "ctrl_c_sync.py"
    script.write_text(_CTRL_C_SYNC_SCRIPT)
    flag = tmp_path / "rank0_exited"
    port = free_port()
    procs = []
    for rank in range(2):
        procs.append(popen_rank([str(script), str(flag), op], rank, 2, port, TRAINLOOM_CPU_ENGINE="gloo"))
    try:
        assert procs[0].stdout.readline() == "waiting\n"
        time.sleep(0.5)  # inside the allreduce's wait
        procs[0].send_signal(signal.SIGINT)
        out0, err0 = procs[0].communicate(timeout=60)
        flag.touch()
        out1, err1 = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode != 0 and "returned" not in out0
    assert err0.rstrip().endswith("KeyboardInterrupt"), err0[-2000:]
    assert "Operation timed out" not in err0  # the wait's slices stay out of the traceback
    assert out1 == "rank 1: CommError\n", (out1, err1[-2000:])


@pytest.mark.parametrize("engine", ["gloo", "shm"])
def test_patterns_of_real_training_scripts(engine):
    """Found by a probe; each used to fail on one engine or silently leave an old value:
    gloo refused a recv of another shape (same count) with torch's broadcasting error, and reduce then
    left the other ranks waiting for the timeout; shm refused reduce_scatter into a chunk of its own
    send buffer on some ranks only; an asynchronous result into a non-contiguous view was written only
    by wait() (is_completed(), a later barrier and destroy saw the old values); a tensor made under
    inference_mode raised after the exchange; shm numbered collectives differently on ranks that had
    sent; a child made by os.fork() that exited normally closed its parent's rank for every peer;
    composite operations (list all_gather/gather, ColossalAI all_gather along dim 1, neighbour
    allreduce) unpacked their results only in wait()."""
    ws = 3
    res = run_ranks(script_patterns, ws, engine, timeout=120)
    total = float(sum(range(1, ws + 1)))
    for rank, r in enumerate(res):
        assert r["engine"] == engine
        assert r["reshaped"] == ([total] * 8, [total] * 8 if rank == 0 else [0.0] * 8)
        assert r["rs_own_chunk"] == [ws * (4 * rank + i) + ws * (ws - 1) / 2 for i in range(4)]
        assert r["completed_col"] == r["after_barrier_col"] == r["destroyed_col"] == [total] * 4
        assert r["hier_col"] == [total] * 4
        assert r["rs_inplace_view"] == [
            [total] * 2 if row // 2 == rank else [float(rank + 1)] * 2 for row in range(2 * ws)
        ]
        assert r["inference"] == [[total] * 3] * 3
        ranks = [[float(q + 1)] * 2 for q in range(ws)]
        along_dim1 = [[float(q + 1) for q in range(ws)]] * 2
        assert r["composite_lists"] == (ranks, ranks if rank == 0 else None, along_dim1)
        sq = total * ws  # an allreduce of the allreduced values
        assert r["after_pending"][:4] == [[sq] * 2, [total], [sq] * 4, [sq]], r["after_pending"]
        assert len(r["after_pending"][4]) == 1 and r["after_pending"][4][0] == pytest.approx(total)
        for values in r["composite_neighbor"]:  # small (allgather path), large (exchange), inference
            assert len(values) == 1 and values[0] == pytest.approx(total / ws), r["composite_neighbor"]
        assert r["after_fork"] == [float(ws)] * 2
        if engine == "shm":
            assert len(set(r["seqs"])) == 1, r["seqs"]


_LATE_RANK_SCRIPT = """
import sys, time
import torch
import trainloom.comm as C
from trainloom.comm import classic

mode = sys.argv[1]
if mode.startswith("init"):
    print("ready", flush=True)
    C.init_process_group(timeout=300)  # the other rank never starts
else:
    C.init_process_group(timeout=300)
    if mode == "any-source":
        C.barrier()  # engines exist; rank 1 then sends nothing
    if C.get_rank() == 1:
        time.sleep(120)
        sys.exit(0)
    print("ready", flush=True)
    if mode == "any-source":
        classic.recv(torch.empty(1))
    else:
        C.barrier()  # rank 1 never comes: the first operation connects the engine
print("returned", flush=True)
"""


@pytest.mark.parametrize(
    "mode,engine,ranks",
    [
        ("init-host", "gloo", [0]),
        ("init-client", "gloo", [1]),
        ("first-operation", "shm", [0, 1]),
        ("first-operation", "gloo", [0, 1]),
        ("any-source", "shm", [0, 1]),
    ],
)
def test_ctrl_c_while_waiting_for_a_late_rank_raises_now(tmp_path, mode, engine, ranks):
    """Every wait for another rank is interruptible: the TCPStore's constructor (the host waited
    for every client, a client retried its connect), torch's gloo rendezvous, an engine's first
    connect and an any-source receive each blocked in C++ for the whole timeout (300 s here; the
    30 s limit below would end the test): they now poll the store, or connect in short attempts."""
    script = tmp_path / "late_rank.py"
    script.write_text(_LATE_RANK_SCRIPT)
    port = free_port()
    procs = []
    try:
        for rank in ranks:
            cpu_engine = "auto" if engine == "shm" else "gloo"
            procs.append(popen_rank([str(script), mode], rank, 2, port, TRAINLOOM_CPU_ENGINE=cpu_engine))
        waiting = procs[0]  # rank 0, or the lone client
        assert waiting.stdout.readline() == "ready\n"
        time.sleep(1.0)  # inside the wait
        waiting.send_signal(signal.SIGINT)
        out, err = waiting.communicate(timeout=30)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert waiting.returncode != 0 and "returned" not in out
    assert err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]


def p2p_then_reinit(rank: int, ws: int, engine: str) -> list:
    """Send/recv (core and classic, sync and async), a failure, destroy, init again: three times,
    then one more init and allreduce. The failures: an asynchronous allreduce whose sizes differ
    between the ranks (CommError from Work.wait() on both), a timeout in an allreduce rank 1 skips,
    and a timeout connecting a new group's communicator that rank 1 never asks for."""
    import torch

    import trainloom.comm as C
    from trainloom.comm import classic, group
    from trainloom.comm._gloo import poll_keys
    from trainloom.errors import CommError

    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    got = []
    for cycle in range(3):
        C.init_process_group(timeout=20 if cycle == 0 else 1)
        t = torch.full((4,), float(rank + cycle))
        if rank == 0:
            C.send(t, 1)
            classic.isend(t, 1).wait()
        else:
            C.recv(t, 0)
            classic.irecv(t, 0).wait()
        failed = None
        try:
            if cycle == 0:
                C.allreduce_inplace(torch.ones(2 + rank), async_op=True).wait()
            elif rank == 0:
                comm = None if cycle == 1 else C.new_group([0, 1]).global_communicator_unconnected()
                C.allreduce_inplace(torch.ones(2), comm=comm)
            else:
                C.new_group([0, 1])  # (every rank makes the group; rank 1 never uses it)
        except CommError as exc:
            failed = type(exc).__name__
        if cycle > 0:  # rank 1 stays until rank 0 timed out, rank 0 (the store's host) until rank 1 knows
            if rank == 0:
                group._STATE.store.set("test/timed_out", "1")
                poll_keys(group._STATE.store, ["test/seen"], 30)
            else:
                poll_keys(group._STATE.store, ["test/timed_out"], 30)
                group._STATE.store.set("test/seen", "1")
        got.append((t.tolist(), failed))
        C.destroy_process_group()
    C.init_process_group(timeout=20)
    t = torch.ones(2)
    C.allreduce_inplace(t)
    C.destroy_process_group()
    return [*got, t.tolist()]


@pytest.mark.parametrize("engine", ["gloo", "shm"])
def test_destroy_then_init_again_after_send_and_recv_and_after_failures(engine):
    """After a gloo send/recv, destroy_process_group() left rank 0's TCPStore server alive (the gloo
    Work objects stayed referenced by the p2p waiter thread), so the next init_process_group() found
    its port in use. After a failed operation the same happened on gloo (and after a connect timeout
    on shm too): the failure's exception, kept by the Work's future or by reference cycles through
    its traceback, held the engine's frames and through them the store until the garbage collector
    ran; rank 1 then timed out reaching the store."""
    res = run_ranks(p2p_then_reinit, 2, engine, timeout=120)
    assert res[0] == [
        ([0.0] * 4, "CommError"),
        ([1.0] * 4, "CommTimeoutError"),
        ([2.0] * 4, "CommTimeoutError"),
        [2.0, 2.0],
    ]
    assert res[1] == [([0.0] * 4, "CommError"), ([1.0] * 4, None), ([2.0] * 4, None), [2.0, 2.0]]


def classic_groups_in_rotated_order(rank: int, ws: int, engine: str) -> list:
    """torch.distributed code: three overlapping groups made in the same order everywhere, then
    asynchronous all_reduces on this rank's two groups, in an order that differs between ranks."""
    import datetime

    import torch

    from trainloom.comm import classic as dist

    os.environ["TRAINLOOM_CPU_ENGINE"] = "auto" if engine == "shm" else engine
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    groups = {"01": dist.new_group([0, 1]), "12": dist.new_group([1, 2]), "02": dist.new_group([0, 2])}
    order = {0: ["01", "02"], 1: ["12", "01"], 2: ["02", "12"]}[rank]
    ts = {k: torch.full((3,), float(rank + 1)) for k in order}
    works = [dist.all_reduce(ts[k], group=groups[k], async_op=True) for k in order]
    for w in works:
        w.wait()
    dist.destroy_process_group()
    return [(k, ts[k].tolist()) for k in order]


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_classic_groups_connect_when_made_as_in_torch(engine):
    """The classic API connected a group at its first operation (the core API's rule), so the
    rotated order above waited in a cycle until the timeout; torch.distributed runs it."""
    res = run_ranks(classic_groups_in_rotated_order, 3, engine, timeout=120)
    for r in res:
        assert r == [(k, [float(sum(int(c) + 1 for c in k))] * 3) for k, _ in r]
    assert [k for k, _ in res[0]] == ["01", "02"]


def test_release_frames_clears_only_trainloom_frames_and_never_a_paused_generator():
    """_release_frames (which lets a failed operation drop the store) cleared every frame of the
    traceback: a user's callback lost its locals (for pdb.post_mortem), and a user's generator paused
    in a frame that a caught exception held was finalized (its remaining items lost)."""
    from trainloom.comm import group

    # A function compiled as if it were trainloom's (its frames are cleared) that calls the user.
    ns: dict = {}
    exec(compile("def run(fn):\n    engine_local = object()\n    fn()\n", group.__file__, "exec"), ns)

    def batches():
        for i in range(5):
            try:
                if i == 1:
                    raise ValueError("bad batch")
            except ValueError as e:
                batches.last = e  # type: ignore[attr-defined]
            yield i

    g = batches()
    assert [next(g), next(g)] == [0, 1]  # paused; batches.last holds its frame

    def user_callback():
        batch_id = 17  # noqa: F841 - inspected below
        raise RuntimeError("callback failed") from batches.last  # type: ignore[attr-defined]

    try:
        ns["run"](user_callback)
    except RuntimeError as exc:
        caught = exc
    group._release_frames(caught)
    tb, frames = caught.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    by_name = {f.f_code.co_name: f for f in frames}
    assert by_name["run"].f_locals == {}  # trainloom's: cleared
    assert by_name["user_callback"].f_locals["batch_id"] == 17
    assert list(g) == [2, 3, 4]


_OPTIMIZER_AFTER_INIT_SCRIPT = """
import json, os, sys
import torch
import trainloom.comm as C

def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

if "torch.distributed.nn.functional" in sys.modules:  # the test would prove nothing
    raise SystemExit("torch.distributed.nn.functional was imported before init_process_group()")
C.init_process_group(timeout=60)
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # the first optimizer imports torch._dynamo
dynamo = "torch._dynamo" in sys.modules
C.destroy_process_group()
after = threads()
C.init_process_group(timeout=60)
x = torch.full((2,), float(C.get_rank() + 1))
C.allreduce_inplace(x)
C.destroy_process_group()
print(json.dumps({"dynamo": dynamo, "threads": after, "allreduce": x.tolist()}), flush=True)
"""


def test_an_optimizer_made_after_init_leaves_nothing_of_torchs_group_after_destroy(tmp_path):
    """torch.distributed.nn.functional takes group=group.WORLD as default arguments; the first
    optimizer imports it (with torch._dynamo), and imported while torch's group existed it kept the
    group, its gloo worker threads and rank 0's store until exit: init_process_group() again said
    the port was in use, and at exit a worker thread could abort the process ("terminate called
    without an active exception", seen in the demo's ranks). Plain launch: rank 0 hosts the store."""
    script = tmp_path / "optimizer_after_init.py"
    script.write_text(_OPTIMIZER_AFTER_INIT_SCRIPT)
    port = free_port()
    procs = [popen_rank([str(script)], rank, 2, port) for rank in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        res = json.loads(out)
        assert res["dynamo"] is True
        # torch's group runs threads named pt_gloo_runloop and gloo_tcp_loop; rank 0's store pt_tcpstore_uv
        assert not [t for t in res["threads"] if t.startswith(("pt_", "gloo"))], res["threads"]
        assert res["allreduce"] == [3.0, 3.0]
        assert "stays alive" not in err


_KEEPING_IMPORT_SCRIPT = """
import torch
import trainloom.comm as C

C.init_process_group(timeout=60)
import torch.distributed.optim.zero_redundancy_optimizer  # noqa: E402  (after init: keeps the group)
C.destroy_process_group()
C.init_process_group(timeout=60)
C.destroy_process_group()  # warned once per process
print("done", flush=True)
"""


def test_a_torch_module_imported_after_init_that_keeps_torchs_group_is_named_once(tmp_path):
    """ZeroRedundancyOptimizer's module evaluates dist.group.WORLD in a signature: imported after
    init, it keeps torch's group; destroy_process_group() names it, with what to do (under torchrun
    the store is the agent's, so initializing again still works)."""
    script = tmp_path / "keeping_import.py"
    script.write_text(_KEEPING_IMPORT_SCRIPT)
    out = _torchrun_2(script)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("done") == 2, out.stdout  # (the ranks' lines may interleave)
    zero = "torch.distributed.optim.zero_redundancy_optimizer"
    warning = (
        "RuntimeWarning: destroy_process_group(): torch's process group stays alive until the process "
        f"exits: the default arguments of {zero}._broadcast_object hold it (group=group.WORLD, evaluated "
        f"at import, and {zero} was imported after init_process_group()). Its worker threads and store "
        "stay too, so a later init_process_group() may find the store port in use. Import that module "
        "before init_process_group()"
    )
    assert out.stderr.count(warning) == 2, out.stderr[-3000:]  # once per rank
    assert f"{script}:7: {warning}" in out.stderr  # at the user's line
