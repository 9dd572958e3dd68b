"""Every collective against torch.distributed (gloo) in real 2- and 3-process runs, on each CPU engine."""

from __future__ import annotations

import re

import pytest
import torch
from commutil import (
    EVERY_COLLECTIVE,
    absent_at_init,
    absent_rank,
    agent_store,
    composites_behind_a_pending_collective,
    dying_peer,
    engines,
    features,
    gloo_p2p_mismatch,
    inplace_results,
    late_p2p_peer,
    late_rank,
    mismatches,
    nccl_cross_checks,
    non_members,
    op_numbering,
    reduce_views,
    reduce_views_input,
    shm_segments,
    special_views,
    staged_send_behind_a_pending_send,
    sweep,
    two_issuing_threads,
)
from multiproc import run_ranks

import trainloom.comm as C
from trainloom.comm import collectives
from trainloom.errors import CommError

ENGINES = engines()


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("engine", ENGINES)
def test_every_collective_matches_torch_distributed(engine, ws):
    before = shm_segments()
    res = run_ranks(sweep, ws, engine, timeout=150)
    assert res == [[]] * ws, "\n".join(line for r in res for line in r[:20])
    assert shm_segments() == before  # nothing left in /dev/shm


def _expected_inplace(ws: int, rank: int) -> dict:
    """What each call of commutil.inplace_results leaves in this rank's tensor."""
    full = [[float(i + 10 * r) for i in range(2 * ws)] for r in range(ws)]
    chunk = lambda r, j: full[r][2 * j : 2 * j + 2]  # noqa: E731
    total = [sum(full[r][i] for r in range(ws)) for i in range(2 * ws)]
    mine = full[rank]
    want = {
        "allreduce_inplace": total,
        "reduce_inplace": total if rank == 0 else mine,
        "reduce_scatter_inplace": mine[: 2 * rank] + total[2 * rank : 2 * rank + 2] + mine[2 * rank + 2 :],
        "broadcast": full[0],
        "allgather_inplace": [x for r in range(ws) for x in chunk(r, r)],
        "alltoall_inplace": [x for r in range(ws) for x in chunk(r, rank)],
        "alltoall_v_inplace": [x for r in range(ws) for x in chunk(r, rank)],
    }
    for root in range(ws):
        want[f"scatter_inplace src={root}"] = mine if rank == root else chunk(root, rank)
        gathered = [x for r in range(ws) for x in chunk(r, r)]
        want[f"gather_inplace dst={root}"] = gathered if rank == root else chunk(rank, rank)
    return want


@pytest.mark.parametrize("engine", ENGINES)
def test_every_inplace_form_returns_its_own_tensor_as_the_result(engine):
    """``result()`` of an in-place form's Work is the tensor it was given, on every rank. On the
    source rank, scatter_inplace's used to be a scratch chunk."""
    ws = 2
    res = run_ranks(inplace_results, ws, engine, timeout=90)
    for rank, r in enumerate(res):
        want = _expected_inplace(ws, rank)
        assert [name for name, _, _ in r] == list(want)
        for name, is_own, values in r:
            assert is_own, (rank, name)
            assert values == want[name], (rank, name)


@pytest.mark.parametrize("engine", ENGINES)
def test_async_views_empty_groups_hierarchical(engine):
    res = run_ranks(features, 3, engine, timeout=90)
    for rank, r in enumerate(res):
        assert r["async"] == [[3.0 + 3 * i] * 4 for i in range(3)]
        assert r["async_completed"] is True
        assert r["mixed"] == [3.0, 3.0]
        assert r["composite"] == [3.0, 3.0]
        col = [
            [float(3 * i + 0 + 100 * rank), float(3 * (3 * i + 1) + 300), float(3 * i + 2 + 100 * rank)]
            for i in range(4)
        ]
        assert r["column"] == col
        assert r["gather_into_row"] == [[0.0] * 9, [0.0] * 3 + [1.0] * 3 + [2.0] * 3]
        assert r["transposed"] == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
        assert r["empty"] is True
        assert r["allgather_column"] == [[float(i // 3), -1.0] for i in range(9)]
        rs_col = [[1.0, 3.0 if i // 2 == rank else 1.0] for i in range(6)]
        assert r["rs_column"] == rs_col
        for op in ("SUM", "MAX", "AVG"):
            assert r[f"hier_{op}"] is True, op
        assert r["hier_async"] == res[0]["hier_async"]
        assert r["bool_sum"] == ([1, 1, 1], [1, 1, 1], [False] * 3, [True, False, True])
        assert r["env"] == (rank, 3, rank, 3)
        assert r["extra_dtypes"] == [True] * 5
        assert "used after destroy_process_group()" in r["after_destroy"]
    assert res[0]["subgroup"] == (0, 2, [2.0, 2.0, 2.0]) and res[2]["subgroup"] == (1, 2, [2.0, 2.0, 2.0])
    assert res[1]["subgroup"] is True  # NON_COMM_MEMBER, as in Bagua
    assert res[0]["from_torch"] == ([0, 1], [3.0, 3.0]) and res[1]["from_torch"] == ([0, 1], [3.0, 3.0])
    # node "a" = ranks 0, 1; node "b" = rank 2; leaders 0 and 2
    assert res[0]["intra"][:3] == (0, 2, [0, 1]) and res[1]["intra"][:3] == (1, 2, [0, 1])
    assert res[2]["intra"][:3] == (0, 1, [2])
    assert res[0]["inter"][:3] == (0, 2, [0, 2]) and res[2]["inter"][:3] == (1, 2, [0, 2])
    assert res[1]["inter"] is C.NON_COMM_MEMBER  # pickled back as the same object
    assert res[0]["inter"][3] == "gloo" and res[0]["global_engine"] == "gloo"  # spans two "nodes"
    assert res[0]["intra"][3] == engine


@pytest.mark.parametrize("engine", ENGINES)
def test_cross_rank_mismatch_raises_on_every_rank(engine):
    res = run_ranks(mismatches, 2, engine, timeout=90)
    for r in res:
        assert "numel=4" in r["numel"] and "numel=8" in r["numel"] and "CommError" in r["numel"]
        assert "float32" in r["dtype"] and "float64" in r["dtype"]
        assert "op=SUM" in r["op"] and "op=MAX" in r["op"]
        assert "root" in r["root"] or "src" in r["root"]
        assert "CommError" in r["alltoall_v"]
        assert "numel=2" in r["async"] and "numel=3" in r["async"]
        # both ranks name both calls; shm told the allreduce rank to "set small_bytes to the same value"
        assert "allreduce" in r["other"] and "allgather" in r["other"], r["other"]
        assert "small_bytes" not in r["other"], r["other"]
        assert r["after"] == "[2.0, 2.0, 2.0]"
    assert "rank 0" in res[0]["numel"] and "rank 1" in res[0]["numel"]
    assert "rank 0" in res[1]["numel"] and "rank 1" in res[1]["numel"]


@pytest.mark.parametrize("engine", ENGINES)
def test_missing_rank_times_out_instead_of_hanging(engine):
    res = run_ranks(late_rank, 3, engine, timeout=60)
    timeouts = []
    for rank in (0, 2):
        err = res[rank]["error"]
        assert err.startswith("Comm") and "allreduce" in err, err
        assert res[rank]["seconds"] < 30
        if err.startswith("CommTimeoutError"):
            timeouts.append(err)
    # At least one rank reports the timeout, naming the op, its sequence number and the missing rank (the
    # shm engine aborts the communicator at the first timeout, so the other rank may see that abort).
    assert timeouts, res
    assert any("#2" in e and "[1]" in e for e in timeouts), timeouts
    if engine == "gloo":
        # Both report it, and rank 0 does not name rank 2, which arrived 1.2 s after it (gloo learns
        # arrivals from the other ranks' timeouts: a census of 1 s named [1, 2]).
        for rank in (0, 2):
            assert res[rank]["error"].startswith(
                f"CommTimeoutError: allreduce #2 (gloo, rank {rank} of 3): timed out after 2s; ranks [1] "
                "did not arrive within 2s of this rank."
            ), res[rank]["error"]
        assert res[1]["late"].startswith(
            "CommError: allreduce #2 (gloo, rank 1 of 3): ranks [0, 2] timed out in this operation "
            "before this rank reached it, and closed their connections. Check that every rank calls "
            "the same collectives in the same order, or raise the timeout ("
        ), res[1]["late"]
    else:
        assert res[1]["late"].startswith("CommError: shm allreduce #2 on rank 1/3 "), res[1]["late"]
        assert ": the communicator was aborted by rank " in res[1]["late"], res[1]["late"]


@pytest.mark.parametrize("engine", ENGINES)
def test_dead_peer_raises_instead_of_hanging(engine):
    before = shm_segments()
    res = run_ranks(dying_peer, 2, engine, timeout=60, allow_death=[1])
    assert res[1] is None
    assert res[0]["error"].startswith("Comm"), res[0]["error"]
    assert res[0]["seconds"] < 30
    assert shm_segments() == before


@pytest.mark.parametrize("engine", ENGINES)
def test_member_that_never_connects_times_out_naming_it(engine):
    # (the shared-memory engine said "missing store keys [...] ... construct the communicator with the
    # same prefix", without .op or .missing_ranks)
    res = run_ranks(absent_rank, 3, engine, timeout=60)
    kind = "gloo communicator" if engine == "gloo" else "ShmCommunicator("
    for rank in (0, 2):
        assert res[rank]["error"].startswith(f"CommTimeoutError: {kind}"), res[rank]
        assert "connecting failed after 2" in res[rank]["error"], res[rank]
        assert "ranks [1] never joined" in res[rank]["error"], res[rank]
        assert res[rank]["attrs"] == ("connect", 0, [1], [1])
    assert res[1] == {}


@pytest.mark.parametrize("engine", ENGINES)
def test_cross_rank_check_used_for_nccl_operations(engine):
    res = run_ranks(nccl_cross_checks, 2, engine, timeout=60)
    for r in res:
        assert "ranks disagree on the number of elements" in r["numel"] and "numel=8" in r["numel"]
        assert "ranks disagree on the root: rank 0: broadcast #3" in r["root"]
        assert "rank 0 sends 2 elements to rank 1 (its send_counts[1]), but rank 1 expects" not in r["counts"]
        assert "rank 1 sends 2 elements to rank 0 (its send_counts[0]), but rank 0 expects 3" in r["counts"]
        assert r["policy"] == {"1": engine == "shm", "all": True, "0": False}
        assert r["after"] == [2.0, 2.0]


def test_rank_missing_at_init_times_out_naming_it():
    res = run_ranks(absent_at_init, 3, timeout=60)
    for rank in (0, 1):
        err = res[rank]["error"]
        assert err.startswith("CommTimeoutError: init_process_group (rank"), err
        assert "ranks [2] never arrived" in err, err
        assert res[rank]["initialized"] is False and res[rank]["torch"] is False


def test_a_rendezvous_that_fails_at_once_is_not_called_a_timeout(monkeypatch):
    # torchrun restarts used to fail in 2 s with "did not complete within 300s" (gloo refused the
    # connection to a dead attempt's address): a failure well before the deadline is a CommError
    # saying when it failed. A real store, with both ranks' node keys; gloo's connect is made to fail.
    import torch.distributed as dist

    from trainloom.comm import group
    from trainloom.errors import CommTimeoutError

    store = dist.HashStore()
    ns = group._namespace(group._STATE.generation + 1)
    store.set(f"{ns}/node/1", "- - somewhere")  # no LOCAL_RANK/LOCAL_WORLD_SIZE, another node

    def refuse(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed with ... Connection refused\nmore")

    monkeypatch.setattr(group.dist, "init_process_group", refuse)
    with pytest.raises(CommError) as info:
        C.init_process_group(rank=0, world_size=2, store=store, timeout=30)
    assert not isinstance(info.value, CommTimeoutError)
    assert re.fullmatch(
        r"init_process_group \(rank 0 of 2\): the rendezvous failed after \d+\.\ds \(timeout 30s\); "
        r"every rank arrived but the rendezvous failed "
        r"\(Gloo connectFullMesh failed with \.\.\. Connection refused\)",
        str(info.value),
    ), str(info.value)
    assert not C.is_initialized()


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_send_and_recv_wait_for_a_late_peer(engine):
    """A send or receive whose peer comes 0.7 s late completes, and the pair works afterwards. On
    gloo the engine's 0.2 s wait slices (for Ctrl-C) had made every such wait fail after one slice
    as "timed out after 10s": a gloo send/recv wait that runs out closes the pair."""
    res = run_ranks(late_p2p_peer, 2, engine, timeout=60)
    for mode in ("blocking", "async"):
        for late in (0, 1):
            assert res[0][f"{mode}_{late}"] == [0.0] * 3, res[0]
            assert res[1][f"{mode}_{late}"] == [7.0 + late] * 3, res[1]
    assert res[0]["after"] == [1.0, 1.0]


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_an_async_send_of_a_non_contiguous_view_does_not_block_the_caller(engine):
    """The copy of a non-contiguous input used to wait, in the issuing thread, for the earlier
    asynchronous operations it follows: two ranks that each sent twice (the second a view) before
    posting their receives hung until the timeout, each waiting for its first send to be received."""
    res = run_ranks(staged_send_behind_a_pending_send, 2, engine, timeout=60)
    for rank in range(2):
        r = res[rank]
        assert "error" not in r, r
        assert r["got1"] == [float(1 - rank)] and r["got2_ok"], r
        assert r["seconds"] < 6, r  # the timeout is 8 s


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_composites_on_views_read_after_a_pending_collective_without_blocking_the_caller(engine, tmp_path):
    """allgather_inplace, reduce_scatter_inplace, gather_inplace, neighbor_allreduce/allgather and
    ColossalAI's reduce_scatter along dim 1, on non-contiguous views that an asynchronous allreduce
    still writes, and the classic scatter of a list of its rows, all issued asynchronously. They used
    to copy their input when issued: neighbor_allgather and the classic scatter without waiting (they
    sent the values from before the allreduce), the others after waiting in the issuing thread (rank 0
    then never got to tell rank 1 to join the allreduce)."""
    res = run_ranks(composites_behind_a_pending_collective, 2, engine, str(tmp_path), timeout=90)
    assert [r["blocked"] for r in res] == [False, False], res
    assert [r["inplace_results"] for r in res] == [[True, True, True]] * 2
    for rank, r in enumerate(res):
        for name in (
            "neighbor_allgather",
            "neighbor_allreduce",
            "allgather_inplace",
            "reduce_scatter_inplace",
        ):
            assert r[name] is True, (rank, name, r[name])
        assert r["colossal_reduce_scatter"] is True, (rank, r["colossal_reduce_scatter"])
        assert r["classic_scatter"] is True, (rank, r["classic_scatter"])
    assert res[0]["gather_inplace"] is True, res[0]["gather_inplace"]


def test_gloo_connect_with_an_absent_member_is_a_timeout_naming_it(monkeypatch):
    # A member that never joined (per the store) stops the connect at the member poll, before
    # gloo's own connect is tried (which would block in C++ for the whole timeout). A real store.
    import torch.distributed as dist

    from trainloom.comm import _gloo
    from trainloom.errors import CommTimeoutError

    calls = []
    monkeypatch.setattr(_gloo.dist, "ProcessGroupGloo", lambda *a, **k: calls.append(a))
    expected = r"connecting failed after 1s; ranks \[1\] never joined"
    with pytest.raises(CommTimeoutError, match=expected) as info:
        _gloo.GlooEngine(dist.HashStore(), 0, 2, prefix="g", timeout=1)
    assert info.value.missing_ranks == [1] and info.value.op == "connect"
    assert calls == []


@pytest.mark.parametrize(
    "message, kind",
    [
        ("Socket Timeout", "CommTimeoutError"),
        ("Timed out waiting 2000ms for recv operation to complete", "CommTimeoutError"),
        ("Connection closed by peer", "CommError"),
    ],
)
def test_gloo_connect_failure_after_every_member_joined_is_classified_by_words(monkeypatch, message, kind):
    # Every member joined, then gloo's connect failed: torch and gloo say "Timeout" or "Timed out"
    # for a deadline (a CommTimeoutError); anything else is a CommError. Both name no missing rank.
    import torch.distributed as dist

    from trainloom.comm import _gloo

    def refuse(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(_gloo.dist, "ProcessGroupGloo", refuse)
    store = dist.HashStore()
    store.set("g/joined/1", "1")
    with pytest.raises(CommError) as info:
        _gloo.GlooEngine(store, 0, 2, prefix="g", timeout=30)
    assert type(info.value).__name__ == kind
    assert str(info.value) == (
        f"gloo communicator g (rank 0 of 2): connecting failed after 30s; every rank joined but could "
        f"not connect ({message})"
    )
    assert info.value.missing_ranks == []


class _SlicedWork:
    """A gloo Work whose waits give the outcomes listed, one per call; ``done_after``: the call from
    which is_completed() says True."""

    def __init__(self, outcomes, done_after):
        self.outcomes, self.done_after, self.calls = list(outcomes), done_after, 0

    def wait(self, timeout=None):
        self.calls += 1
        out = self.outcomes.pop(0)
        if out is not None:
            raise RuntimeError(out)

    def is_completed(self):
        return self.calls >= self.done_after


def _engine_with_a_stub_group(monkeypatch):
    import torch.distributed as dist

    from trainloom.comm import _gloo

    class StubGroup:
        def abort(self):
            pass

    monkeypatch.setattr(_gloo.dist, "ProcessGroupGloo", lambda *a, **k: StubGroup())
    store = dist.HashStore()
    store.set("g/joined/1", "1")
    return _gloo.GlooEngine(store, 0, 2, prefix="g", timeout=30)


def test_gloo_waits_in_slices_and_reports_the_operations_own_failure(monkeypatch):
    """The gloo engine waits in 0.2 s slices (so that Ctrl-C works). A slice that runs out while the
    operation goes on is waited again; one that runs out just as the operation fails must report
    that failure, not the slice's "Operation timed out!" (it was reported as a 300 s timeout)."""
    from trainloom.errors import CommError, CommTimeoutError

    eng = _engine_with_a_stub_group(monkeypatch)
    pending = _SlicedWork(["Operation timed out!", "Operation timed out!", None], done_after=3)
    eng._wait(pending, "barrier", 1, None)
    assert pending.calls == 3 and eng._unfinished == []
    closed = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:61056"
    ends_with_the_slice = _SlicedWork(["Operation timed out!", closed], done_after=1)
    with pytest.raises(CommError) as info:
        eng._wait(ends_with_the_slice, "barrier", 2, None)
    assert not isinstance(info.value, CommTimeoutError)
    assert str(info.value) == f"barrier #2 (gloo, rank 0): a peer died or left the job ({closed})"
    assert ends_with_the_slice.calls == 2


def test_an_aborted_gloo_engine_ends_a_wait_at_the_next_slice(monkeypatch):
    from trainloom.errors import CommError

    eng = _engine_with_a_stub_group(monkeypatch)
    eng.abort("the exit hook aborted it")
    never = _SlicedWork(["Operation timed out!"] * 3, done_after=10**9)
    with pytest.raises(CommError, match=r"barrier #4 \(gloo, rank 0 of 2\): the communicator was aborted "):
        eng._wait(never, "barrier", 4, None)
    assert never.calls == 1 and eng._unfinished == [never]  # close() will not wait for it


def test_torch_and_bagua_reduce_ops_keep_their_meaning_in_a_real_allreduce():
    # torch's MIN is 3 == Bagua's MAX (same hash): a cache keyed on the op alone made MAX mean MIN
    res = run_ranks(op_numbering, 2, timeout=60)
    for r in res:
        assert r == {
            "dist.MIN": [1.0, 2.0],
            "MAX": [3.0, 5.0],
            "MIN": [1.0, 2.0],
            "dist.PRODUCT": [3.0, 10.0],
            "dist.AVG": [2.0, 3.5],
            "PRODUCT": [3.0, 10.0],
            "BOR": [7, 3],
            "dist.BXOR": [3, 0],
        }


def test_non_members_get_a_placeholder_and_every_collective_returns_at_once():
    res = run_ranks(non_members, 2, timeout=90)
    r0, r1 = res
    # rank 0 leads the (single-node) inter-node communicator; rank 1 gets Bagua's placeholder
    assert r0["inter"] == (0, 1, [0]) and r0["inter_is_placeholder"] is False
    assert r1["inter"] == (
        "NON_COMM_MEMBER (this rank is not a member of the communicator; collectives on it do nothing)"
    )
    assert r1["inter_is_placeholder"] is True
    assert list(r1["every"]) == EVERY_COLLECTIVE
    # The list covers the whole API: a new collective must be added to it.
    api = set(collectives.__all__) - {"SUPPORTED_DTYPES", "ReduceOp"}
    assert set(EVERY_COLLECTIVE) - {"allreduce(early positional)"} == api
    for name, (returned, unchanged, _seconds) in r1["every"].items():
        # A collective that waited for peers would have raised CommTimeoutError, not returned None.
        assert returned is None, (name, returned)
        assert unchanged is True, name
    assert r1["async"] == ("CompletedWork", True, True, True, [7.0, 7.0])
    assert r1["async_barrier"] == (True, None)
    # members get their result, the non-member's tensor is left alone
    assert r0["inter_allreduce"] == [1.0, 1.0] and r1["inter_allreduce"] == [2.0, 2.0]
    assert r0["sub_getters"] == [False, False, False] and r1["sub_getters"] == [True, True, True]
    assert r0["sub_allreduce"] == ([1.0, 1.0], True) and r1["sub_allreduce"] == ([2.0, 2.0], True)
    assert r0["neighbor"] == "no error"
    assert r1["neighbor"] == (
        "CommError: neighbor_allreduce: rank 1 is not a member of process group gb6589fc6ab.0 (ranks [0])"
    )
    assert r0["world_after"] == r1["world_after"] == [3.0, 3.0]


def test_init_under_torchrun_connects_to_the_agent_store():
    # torchrun's agent serves a TCPStore on MASTER_PORT and sets TORCHELASTIC_USE_AGENT_STORE=True;
    # rank 0 hosting a second server there made c10d log "failed to bind ... ignoring the error".
    import datetime

    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_PORT": str(agent.port)}
    res = run_ranks(agent_store, 2, timeout=60, env=env)
    for r in res:
        assert r["allreduce"] == [3.0, 3.0]
        assert r["allreduce_after_reinit"] == [5.0, 5.0]  # init, destroy, init again on the same store
        assert "TCPStore" not in r["stderr"] and "failed to bind" not in r["stderr"], r["stderr"]
    assert agent.check(["tl/1/node/0", "tl/1/node/1"])  # both ranks wrote to the agent's store
    assert agent.check(["tl/2/node/0", "tl/2/node/1"])  # the second init under its own prefix


@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_workers_restarted_by_torchrun_use_a_fresh_namespace(engine):
    # torchrun --max-restarts: the agent's store keeps the failed attempt's keys and the new workers
    # count generations from 1 again. They failed: shm refused the prefix as taken, gloo connected
    # to the dead workers' addresses.
    import datetime

    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    for attempt in range(2):
        env = {
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "MASTER_PORT": str(agent.port),
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "TRAINLOOM_CPU_ENGINE": engine,
        }
        for r in run_ranks(agent_store, 2, timeout=60, env=env):
            assert r["allreduce"] == [3.0, 3.0] and r["allreduce_after_reinit"] == [5.0, 5.0]
    assert agent.check(["tl/1/node/0", "tl/2/node/1"])  # attempt 0, as without torchrun's restarts
    assert agent.check(["tl/r1.1/node/0", "tl/r1.2/node/1"])  # attempt 1


@pytest.mark.parametrize("engine", ENGINES)
def test_conjugate_negative_and_self_overlapping_views(engine):
    # gloo raised torch's internal view_as_real error on a conjugate view (the other ranks then
    # waited for the timeout); an expand()ed output failed only after the data had moved.
    res = run_ranks(special_views, 2, engine, timeout=90)
    for r in res:
        assert r["conj_send"] == [1 - 2j, 3 + 1j, 2 - 4j, 6 + 2j]
        assert r["neg_inplace"] == (True, [-6.0, 3.0])
        assert r["neg_recv"] == [-7.0, -8.0]
        assert r["expanded"] == (
            "allreduce: tensor (shape (4,), stride (0,)) has elements that share memory (e.g. "
            "made by expand()), so the results cannot be written to it; pass a tensor whose elements have "
            "their own memory (t.clone())"
        )
        for name in ("allgather_inplace", "reduce_scatter_inplace", "gather_inplace"):
            assert r[f"expanded_{name}"] == (
                f"{name}: tensor (shape (4,), stride (0,)) has elements that share memory (e.g. "
                "made by expand()), so the results cannot be written to it; pass a tensor whose elements "
                "have their own memory (t.clone())"
            )
        assert r["after"] == [2.0, 2.0, 2.0]
    assert res[0]["conj_inplace"] == (True, [3 - 6j, 9 + 3j])  # the sum of the values the views show
    assert res[1]["conj_inplace"] == (False, [3 - 6j, 9 + 3j])


@pytest.mark.parametrize("engine", ENGINES)
def test_two_threads_issuing_collectives_at_once_abort_instead_of_mispairing(engine):
    # Two threads' allreduces started in a different order on each rank and were summed with each
    # other's (wrong results, no error). The overlap is refused and the communicator aborted.
    r0, r1 = run_ranks(two_issuing_threads, 2, engine, timeout=90)
    assert r0["second"] == (
        "allreduce: another thread ('metrics') is issuing an operation on communicator default/global at "
        "the same time. Collectives issued from several threads on one communicator can start in a "
        "different order on each rank, which pairs different calls (wrong results or a hang), so the "
        "communicator was aborted on every rank. Issue them from one thread, or give each thread its own "
        "communicator (new_group())"
    )
    # The allreduce already waiting is aborted on both ranks (on gloo since its waits run in slices
    # that see the abort; before, it completed there, correctly paired: the second call sent nothing).
    assert r0["first"] == r1["first"] == "CommError"
    assert r0["after"] == r1["after"] == "CommError"  # no rank goes on
    # A send on a thread while the main thread runs an allreduce (commutil.send_beside_a_collective):
    # both engines run both. (The shared-memory engine refused the allreduce and aborted the
    # communicator: it ran a send only beside other sends and receives.)
    assert (r0["allreduce"], r0["send"], r0["t"]) == ("no error", "no error", [2.0] * 4)
    assert (r1["allreduce"], r1["recv"], r1["received"], r1["t"]) == ("no error",) * 2 + (True, [2.0] * 4)


def test_gloo_send_recv_that_disagree_raise_on_both_ranks_and_the_pair_goes_on():
    """GlooEngine._compare_p2p: a send and a receive that disagree on the number of elements or the
    dtype raise CommError on both ranks (from Work.wait() when asynchronous), naming both sides,
    before any data moves: the receive buffer is left as it was, and since both headers were taken
    the pair (and the collectives) still work afterwards. "send #2" is the second message from that
    rank to that peer (it said "#0" for every message)."""
    res = run_ranks(gloo_p2p_mismatch, 2, timeout=60)
    tail = "dtype and number of elements must be equal"
    for rank, r in enumerate(res):
        assert r["engine"] == "gloo"
        mine = "send" if rank == 0 else "recv"
        assert r["size"] == (
            f"CommError: {mine}: send on rank 0 (send #1 dtype=float32 numel=3 shape=(3,)) does not match "
            f"recv on rank 1 (recv #1 dtype=float32 numel=5 shape=(5,)): {tail}"
        ), r["size"]
        assert r["dtype"] == (
            f"CommError: {mine}: send on rank 0 (send #2 dtype=float32 numel=4 shape=(4,)) does not match "
            f"recv on rank 1 (recv #2 dtype=float64 numel=4 shape=(4,)): {tail}"
        ), r["dtype"]
        mine = "recv" if rank == 0 else "send"
        assert r["async"] == (
            f"CommError: {mine}: send on rank 1 (send #1 dtype=int64 numel=2 shape=(2,)) does not match "
            f"recv on rank 0 (recv #1 dtype=int64 numel=6 shape=(6,)): {tail}"
        ), r["async"]
        assert r["after_allreduce"] == [3.0, 3.0]
    assert res[1]["size_recv_untouched"] == [-1.0] * 5
    assert res[1]["dtype_recv_untouched"] == [-1.0] * 4
    assert res[0]["after_p2p"] == [[10.0, 11.0, 12.0, 13.0, 14.0, 15.0]]  # from rank 1
    assert res[1]["after_p2p"] == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]  # from rank 0


@pytest.mark.parametrize("engine", ENGINES)
def test_reduce_and_reduce_inplace_on_non_contiguous_views(engine):
    """reduce/reduce_inplace to rank 1 of 3 on transposed views and columns: the root's view gets
    the sum and the memory around it is untouched; the other ranks' tensors (input and output) are
    left exactly as they were ("not written on other ranks", "left unchanged")."""
    res = run_ranks(reduce_views, 3, engine, timeout=60)
    inputs = [reduce_views_input(r) for r in range(3)]
    total = sum(inputs)
    blank = torch.full((4, 3), -1.0)
    for rank, r in enumerate(res):
        assert r["engine"] == engine
        mine = inputs[rank]
        if rank == 1:
            col = mine.clone()
            col[:, 1] = total[:, 1]
            into_col = blank.clone()
            into_col[:, 2] = total[:, 0]
            want = {
                "inplace_t": total,
                "inplace_col": col,
                "t_to_t": (mine, total),
                "col_to_col": (mine, into_col),
            }
        else:
            untouched = (mine, blank)
            want = {"inplace_t": mine, "inplace_col": mine, "t_to_t": untouched, "col_to_col": untouched}
        for name, w in want.items():
            w = tuple(x.tolist() for x in w) if isinstance(w, tuple) else w.tolist()
            assert r[name] == w, (rank, name, r[name])


def test_gloo_failure_reports_after_close_do_not_touch_the_dropped_store(monkeypatch):
    """close() drops the store (so a failed engine does not keep rank 0's TCPStore alive); an
    operation failing on another thread after destroy_process_group() then raised AttributeError
    ('NoneType' object has no attribute 'set') from the census of late ranks instead of its error."""
    eng = _engine_with_a_stub_group(monkeypatch)
    eng.close()
    assert eng._missing_ranks(2, 0.1) == [] and eng._timed_out_peers(2) == []
