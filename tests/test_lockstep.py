"""Ranks out of step never get wrong scores (docs/design.md, "Ranks in step"; issue 14).

Every scenario runs on 2 ranks of the ``collective`` transport in two worlds: real gloo
processes (one spawn runs every scenario in turn, its results are checked here) and the
in-process world. Scenarios: construction with differing configurations or transports, a rank
refusing its own bad input, ranks calling with different shapes, forcing counts or lengths, two
instances called in different orders, a late peer, a reset a rank misses, close's bounded
barrier, a rank that stalls inside a call, and a dead peer. Each one must end in an error on
every rank that names what differs (or who is missing) within ``timeout_s`` plus a stated
slack, never wrong scores, a hang or an abort; after ``reset()`` the ranks compute correct
scores again.

Everything is bounded: small ``timeout_s``, ``spawn_processes(timeout_s=)``, and a
faulthandler guard that ends the test process if a test hangs anyway.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from _failures import outcome
from _gpu import assert_scores, expected, for_rank, kernel_copy, settle
from _worlds import Worlds

import cpindex
from cpindex import (
    BadBlockTableError,
    BrokenInstanceError,
    ConfigMismatchError,
    CPIndexConfig,
    IndexCP,
    OutOfStepError,
    PeerTimeoutError,
    lockstep,
    partition,
    reference,
    testing,
)
from cpindex.comm import Comm, TorchComm
from cpindex.plan import Plan
from cpindex.spawn import spawn_processes
from cpindex.validation import Call
from cpindex.world import run_threads

TIMEOUT = 0.75  # config.timeout_s of the scenarios that wait for a late rank
SLACK = 1.5  # what a bounded wait may take past its timeout_s (store round trips, scheduling)
GUARD_S = 240  # no test of this file may run longer (the first gloo test starts the world)


@pytest.fixture(autouse=True)
def _hang_guard():
    """A regression that hangs ends the test process with every thread's traceback instead of
    stalling CI."""
    faulthandler.dump_traceback_later(GUARD_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# --------------------------------------------------------------------------- scenario helpers


@functools.cache
def _prob(requests: int = 3, query_len: int = 1) -> testing.Problem:
    return testing.make_problem(
        requests, 1200, "fp8", seed=7 + requests, query_len=query_len, num_heads=4
    )


def _cfg(**kw: Any) -> CPIndexConfig:
    base = dict(cache_format="fp8", max_rows=8, max_width=24, transport="collective")
    return CPIndexConfig(**{**base, "timeout_s": 3.0, **kw})


def _push(cp: cpindex.IndexCP, prob: testing.Problem | None = None, **over: Any) -> torch.Tensor:
    p = prob or _prob()
    args = dict(
        iq=p.rank_queries(cp.rank, cp.world_size),
        index_cache=p.index_cache,
        block_table=p.block_table,
        seq_lens=p.seq_lens,
        init_blocks=0,
        local_blocks=1,
        width=p.width,
        query_len=p.query_len,
    )
    args.update(over)
    counts = ("query_len", "init_blocks", "local_blocks", "width")
    plan = cp.plan(args["block_table"], args["seq_lens"], **{k: args[k] for k in counts})
    return cp.score_push(args["iq"], args["index_cache"], plan, tag=args.get("tag"))


def _want(rank: int, world: int, prob: testing.Problem | None = None) -> torch.Tensor:
    p = prob or _prob()
    full = reference.block_scores(
        p.q, p.index_cache, p.block_table, p.seq_lens, init_blocks=0, local_blocks=1,
        width=p.width, query_len=p.query_len,
    )  # fmt: skip
    return full[partition.heads_of_rank(rank, full.shape[0], world)]


def _correct(cp: cpindex.IndexCP) -> bool:
    out = _push(cp).clone()
    return bool(torch.equal(out, _want(cp.rank, cp.world_size)))


# --------------------------------------------------------------------------- scenarios
# Each takes (comm, rank) and returns plain data; the tests below check it.


def sc_config_mismatch(comm: Comm, rank: int) -> dict:
    def build(**kw: Any) -> dict[str, Any]:
        return outcome(lambda: cpindex.IndexCP(_cfg(**kw), device="cpu", comm=comm).close())

    res = build(max_rows=8 if rank == 0 else 16)
    # transport and prefer_mori decide what 'auto' tries: both are shared fields
    res2 = build(transport="collective" if rank == 0 else "auto")
    res3 = build(sm_scale=0.1 * (rank + 1))
    return {"max_rows": res, "transport": res2, "sm_scale": res3}


def sc_local_knobs(comm: Comm, rank: int) -> dict:
    cfg = _cfg(timeout_s=2.0 + rank, error_check="sync" if rank else "next_call")
    with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
        return {"correct": _correct(cp)}


def sc_refused(comm: Comm, rank: int) -> dict:
    with cpindex.IndexCP(_cfg(), device="cpu", comm=comm) as cp:
        # rank 1's width is past max_width: refused before anything is exchanged, and rank 0
        # learns it at once (no timeout)
        first = outcome(lambda: _push(cp, width=25 if rank == 1 else 10))
        then = outcome(lambda: _push(cp))
        cp.reset()
        return {"first": first, "then": then, "correct": _correct(cp)}


#: Per field: what rank 1 passes instead (rank 0 passes the valid call).
MISMATCHES: dict[str, Callable[[], dict[str, Any]]] = {
    "width": lambda: {"width": 11},
    "rows": lambda: dict(
        iq=_prob(2).rank_queries(1, 2),
        block_table=_prob(2).block_table,
        seq_lens=_prob(2).seq_lens,
        width=_prob(2).width,
    ),
    "init_blocks": lambda: {"init_blocks": 1},
    "local_blocks": lambda: {"local_blocks": 2},
    "seq_lens": lambda: {"seq_lens": _prob().seq_lens - (torch.arange(3) == 0).int()},
    "query_len": lambda: dict(  # the same rows (4), split as 2 requests of 2 tokens
        iq=_prob(2, 2).rank_queries(1, 2),
        block_table=_prob(2, 2).block_table,
        seq_lens=_prob(2, 2).seq_lens,
        width=_prob(2, 2).width,
        query_len=2,
    ),
}
ROWS4 = {"query_len"}  # rank 0 needs 4 rows too, or rows would differ first


def sc_mismatch(comm: Comm, rank: int) -> dict:
    out = {}
    with cpindex.IndexCP(_cfg(), device="cpu", comm=comm) as cp:
        for field, change in MISMATCHES.items():
            base = _prob(4) if field in ROWS4 else None
            over = change() if rank == 1 else {}
            res = outcome(lambda p=base, o=over: _push(cp, p, **o))
            after = outcome(lambda: _push(cp))
            cp.reset()
            out[field] = {"call": res, "after": after, "correct": _correct(cp)}
    return out


def sc_instances_order(comm: Comm, rank: int) -> dict:
    a = cpindex.IndexCP(_cfg(), device="cpu", comm=comm)
    b = cpindex.IndexCP(_cfg(), device="cpu", comm=comm)
    order = (a, b) if rank == 0 else (b, a)
    first = outcome(lambda: _push(order[0]))
    second = outcome(lambda: _push(order[1]))
    a.reset()
    b.reset()
    res = {"first": first, "second": second, "a": _correct(a), "b": _correct(b)}
    a.close()
    b.close()
    return res


def sc_late_peer(comm: Comm, rank: int) -> dict:
    with cpindex.IndexCP(_cfg(timeout_s=TIMEOUT), device="cpu", comm=comm) as cp:
        if rank == 1:
            time.sleep(1.5 * TIMEOUT)  # rank 0 gives up on the call meanwhile
            late = outcome(lambda: _push(cp))  # joins the abandoned call: raises at once
            res = {"late": late}
        else:
            timed_out = outcome(lambda: _push(cp))
            refused = outcome(lambda: _push(cp))  # broken until reset, nothing exchanged
            res = {"timed_out": timed_out, "refused": refused}
        res["reset"] = outcome(cp.reset)  # rank 0 waits here for rank 1 (within TIMEOUT)
        res["correct"] = _correct(cp)
    return res


def sc_reset_missed(comm: Comm, rank: int) -> dict:
    """Rank 1 misses rank 0's reset; rank 0 tries again, and rank 1's one late reset walks
    past the abandoned round and meets rank 0's second."""
    with cpindex.IndexCP(_cfg(timeout_s=TIMEOUT), device="cpu", comm=comm) as cp:
        _push(cp)
        if rank == 1:
            time.sleep(1.5 * TIMEOUT)  # misses rank 0's reset
            res = {"first": outcome(cp.reset)}
        else:
            res = {"first": outcome(cp.reset), "second": outcome(cp.reset)}
        res["correct"] = _correct(cp)
        return res


def sc_close_meet(comm: Comm, rank: int) -> dict:
    """close()'s bounded barrier, which ipc and mori ranks hold before freeing memory their
    peers write into: a rank that misses it is named within timeout_s; the next round finds
    both."""
    if rank == 1:
        time.sleep(1.5 * TIMEOUT)  # misses round a
    missed = outcome(lambda: lockstep.meet(comm, "close-test/a", TIMEOUT, what="close"))
    both = outcome(lambda: lockstep.meet(comm, "close-test/b", TIMEOUT, what="close"))
    return {"missed": missed, "both": both}


def sc_stall_in_call(comm: Comm, rank: int) -> dict:
    """Rank 1 stalls inside a call, after the header (two instances share the group): rank 0's
    data collective times out naming rank 1, and reset() says the group cannot be reused."""
    a = cpindex.IndexCP(_cfg(timeout_s=TIMEOUT), device="cpu", comm=comm)
    b = cpindex.IndexCP(_cfg(timeout_s=TIMEOUT), device="cpu", comm=comm)
    for _ in range(3):
        _push(b)
    if rank == 1:
        real = reference.block_scores

        def slow(*args: Any, **kw: Any) -> torch.Tensor:
            time.sleep(2.5 * TIMEOUT)
            return real(*args, **kw)

        from cpindex.transports import collective

        collective.reference.block_scores = slow  # type: ignore[attr-defined]
    stalled = outcome(lambda: _push(a))
    if rank == 0:
        time.sleep(2 * TIMEOUT)  # reset once rank 1 is back (its call ends after its stall)
    reset = outcome(a.reset)
    return {"stalled": stalled, "reset": reset}


SCENARIOS: dict[str, Callable[[Comm, int], dict]] = {
    "config_mismatch": sc_config_mismatch,
    "local_knobs": sc_local_knobs,
    "refused": sc_refused,
    "mismatch": sc_mismatch,
    "instances_order": sc_instances_order,
    "late_peer": sc_late_peer,
    "reset_missed": sc_reset_missed,
    "close_meet": sc_close_meet,
}
GLOO_ONLY = {"stall_in_call": sc_stall_in_call}  # last: it leaves the group unusable


def _run_scenarios(comm: Comm, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        fn = {**SCENARIOS, **GLOO_ONLY}[name]
        try:
            out[name] = fn(comm, comm.rank)
        except Exception:
            out[name] = {"crash": traceback.format_exc()}
            break  # the ranks may be out of step now: later scenarios would only add noise
    return out


def gloo_rank(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    res = _run_scenarios(TorchComm(), [*SCENARIOS, *GLOO_ONLY])
    torch.save(res, Path(path) / f"rank{rank}.pt")


_WORLDS = Worlds(
    "lockstep",
    gloo_rank,
    lambda comm: _run_scenarios(comm, list(SCENARIOS)),
    gloo_timeout_s=180,
    threads_timeout_s=60,
)


def _results(kind: str, tmp_path_factory) -> list[dict]:
    return _WORLDS.results(kind, 2, tmp_path_factory)


def _scenario(kind: str, name: str, tmp_path_factory) -> list[dict]:
    per_rank = [r.get(name, {"crash": "not reached"}) for r in _results(kind, tmp_path_factory)]
    for rank, res in enumerate(per_rank):
        assert "crash" not in res, f"rank {rank}:\n{res['crash']}"
    return per_rank


KINDS = ["gloo", "threads"]


# --------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("kind", KINDS)
def test_construction_compares_shared_fields_on_every_rank(kind, tmp_path_factory):
    res = _scenario(kind, "config_mismatch", tmp_path_factory)
    for rank, r in enumerate(res):
        for field, values in [
            ("max_rows", "rank 0: 8, rank 1: 16"),
            ("transport", "rank 0: 'collective', rank 1: 'auto'"),
            ("sm_scale", "rank 0: 0.1, rank 1: 0.2"),
        ]:
            e = r[field]
            assert e["type"] == "ConfigMismatchError", (rank, field, e)
            assert f"{field}: {values}" in e["msg"], (rank, e["msg"])
            assert e["s"] < SLACK, (rank, field, e["s"])
            assert "KeyError" not in e["msg"]


@pytest.mark.parametrize("kind", KINDS)
def test_local_knobs_may_differ(kind, tmp_path_factory):
    for r in _scenario(kind, "local_knobs", tmp_path_factory):
        assert r["correct"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_call_makes_every_rank_raise_at_once(kind, tmp_path_factory):
    r0, r1 = _scenario(kind, "refused", tmp_path_factory)
    assert r1["first"]["type"] == "ValueError" and "width" in r1["first"]["msg"]
    assert r0["first"]["type"] == "OutOfStepError", r0["first"]
    assert "refused by rank 1: ValueError: width" in r0["first"]["msg"]
    assert r0["first"]["s"] < SLACK  # told at once, not after timeout_s (3 s here)
    for r in (r0, r1):
        # broken until reset: the next call refuses, naming the first error as its cause
        assert r["then"]["type"] == "BrokenInstanceError", r["then"]
        assert r["then"]["cause"] == r["first"]["type"]
        assert r["correct"]  # after reset()


@pytest.mark.parametrize("field", list(MISMATCHES))
@pytest.mark.parametrize("kind", KINDS)
def test_ranks_with_different_calls_all_raise(kind, field, tmp_path_factory):
    """No data collective is posted (gloo would abort on differing sizes), every rank raises
    naming the first field that differs, and reset() brings back correct scores."""
    for rank, r in enumerate(_scenario(kind, "mismatch", tmp_path_factory)):
        res = r[field]
        call = res["call"]
        assert call["type"] == "OutOfStepError", (rank, call)
        assert f"out of step with rank {1 - rank}: {field}" in call["msg"], call["msg"]
        assert call["peer"] == 1 - rank
        assert res["after"]["type"] == "BrokenInstanceError"
        assert res["correct"]


@pytest.mark.parametrize("kind", KINDS)
def test_two_instances_called_in_different_orders(kind, tmp_path_factory):
    for rank, r in enumerate(_scenario(kind, "instances_order", tmp_path_factory)):
        assert r["first"]["type"] == "OutOfStepError", (rank, r["first"])
        assert (
            "instance #" in r["first"]["msg"]
            and "different IndexCP instances" in (r["first"]["msg"])
        )
        # the other instance is still healthy on both ranks, but the ranks call it with its
        # own peer's broken twin: it raises too (a header round with a refusing peer)
        assert r["second"]["type"] in ("OutOfStepError", "BrokenInstanceError"), r["second"]
        assert r["a"] and r["b"]


@pytest.mark.parametrize("kind", KINDS)
def test_late_peer_times_out_within_timeout_and_recovers(kind, tmp_path_factory):
    r0, r1 = _scenario(kind, "late_peer", tmp_path_factory)
    t = r0["timed_out"]
    assert t["type"] == "PeerTimeoutError" and t["peer"] == 1, t
    assert "waiting for rank(s) 1, which did not come" in t["msg"]
    assert TIMEOUT * 0.9 <= t["s"] < TIMEOUT + SLACK
    assert r0["refused"]["type"] == "BrokenInstanceError"
    assert r0["refused"]["cause"] == "PeerTimeoutError"
    # the late rank joins a call its peer gave up on: it raises at once, not after a timeout
    late = r1["late"]
    assert late["type"] == "PeerTimeoutError" and "gave up waiting" in late["msg"], late
    assert late["s"] < SLACK
    for r in (r0, r1):
        assert r["reset"]["type"] is None, r["reset"]
        assert r["correct"]


@pytest.mark.parametrize("kind", KINDS)
def test_reset_is_bounded_and_names_who_did_not_come(kind, tmp_path_factory):
    r0, r1 = _scenario(kind, "reset_missed", tmp_path_factory)
    first = r0["first"]
    assert (
        first["type"] == "PeerTimeoutError"
        and "waiting for rank(s) 1, which did not come" in first["msg"]
    )
    assert first["s"] < TIMEOUT + SLACK
    assert r0["second"]["type"] is None, r0["second"]
    assert r1["first"]["type"] is None, r1["first"]  # walked past the abandoned round
    assert r1["first"]["s"] < TIMEOUT
    for r in (r0, r1):
        assert r["correct"]


@pytest.mark.parametrize("kind", KINDS)
def test_close_meeting_is_bounded_and_names_who_did_not_come(kind, tmp_path_factory):
    r0, r1 = _scenario(kind, "close_meet", tmp_path_factory)
    missed = r0["missed"]
    assert missed["type"] == "PeerTimeoutError" and missed["peer"] == 1, missed
    assert "close timed out" in missed["msg"] and "rank(s) 1" in missed["msg"], missed
    assert TIMEOUT * 0.9 <= missed["s"] < TIMEOUT + SLACK
    late = r1["missed"]
    assert late["type"] == "PeerTimeoutError" and "gave up waiting" in late["msg"], late
    assert late["s"] < SLACK
    for r in (r0, r1):
        assert r["both"]["type"] is None, r["both"]


def test_gloo_stall_inside_a_call_names_the_rank_and_refuses_reset(tmp_path_factory):
    r0, r1 = _scenario("gloo", "stall_in_call", tmp_path_factory)
    s = r0["stalled"]
    assert s["type"] == "PeerTimeoutError" and s["peer"] == 1, s
    assert "rank(s) 1" in s["msg"] and "unknown" not in s["msg"]
    assert s["s"] < TIMEOUT + SLACK
    for r in (r0, r1):
        assert "cannot be reused" in r["reset"]["msg"], r["reset"]


# --------------------------------------------------------------------------- one rank


def test_one_rank_bad_input_leaves_the_instance_usable():
    """With no peer waiting, a refused call does not break the instance."""

    def rank_fn(comm):
        with cpindex.IndexCP(_cfg(), device="cpu", comm=comm) as cp:
            with pytest.raises(ValueError, match="width"):
                _push(cp, width=99)
            return _correct(cp)

    assert run_threads(1, rank_fn) == [True]


def test_one_rank_reset_is_harmless():
    def rank_fn(comm):
        with cpindex.IndexCP(_cfg(), device="cpu", comm=comm) as cp:
            cp.reset()
            ok = _correct(cp)
            cp.reset()
            return ok and _correct(cp)

    assert run_threads(1, rank_fn) == [True]


# --------------------------------------------------------------------------- dead peer


def _dead_peer_rank(rank: int, world: int, path: str, who_dies: int) -> None:
    """Rank ``who_dies`` exits: rank 1 inside a call's all-to-all (gloo loses the connection),
    or rank 0 (the store's host) right after construction (the store is gone)."""
    import os

    torch.set_num_threads(1)
    comm = TorchComm()
    cp = cpindex.IndexCP(_cfg(timeout_s=5.0), device="cpu", comm=comm)
    if rank == who_dies:
        if rank == 0:
            os._exit(0)
        comm.all_to_all_into = lambda *a, **k: os._exit(0)  # type: ignore[method-assign]
    time.sleep(0.2 if who_dies == 0 else 0.0)
    lost = outcome(lambda: _push(cp))
    torch.save(lost, Path(path) / f"rank{rank}.pt")
    os._exit(0)  # skip destroy_process_group: its peer is gone


@pytest.mark.parametrize("who_dies", [1, 0])
def test_dead_peer_is_reported_as_a_lost_connection(tmp_path, who_dies):
    spawn_processes(2, _dead_peer_rank, str(tmp_path), who_dies, timeout_s=60)
    lost = torch.load(tmp_path / f"rank{1 - who_dies}.pt")
    assert lost["type"] == "PeerConnectionError", lost
    assert "lost" in lost["msg"] and "timed out" not in lost["msg"], lost
    assert lost["s"] < 5.0  # as soon as the backend reports it, not after timeout_s


def test_rendezvous_returns_every_rank_s_payload():
    """Every rank's JSON payload comes back decoded, in rank order."""

    def job(comm: Comm) -> tuple[list[Any], list[Any]]:
        same = {"call": 1, "extra": {"topk": 16}, "queries": None}
        got_same = lockstep.rendezvous(comm, "t/same", same, 10.0)
        other = {"call": 1, "rank": comm.rank}
        return got_same, lockstep.rendezvous(comm, "t/other", other, 10.0)

    for same, other in run_threads(3, job):
        assert same == [{"call": 1, "extra": {"topk": 16}, "queries": None}] * 3
        assert other == [{"call": 1, "rank": r} for r in range(3)]


def _meta_call(requests: int, tag: int | None) -> Call:
    """A validated-looking call whose tensors live off the host (``meta``), as on a GPU."""
    table = torch.empty(requests, 8, dtype=torch.int32, device="meta")
    lengths = torch.empty(requests, dtype=torch.int32, device="meta")
    plan = Plan(table, lengths, query_len=4, init_blocks=1, local_blocks=2, width=8)
    iq = torch.empty(requests * 4, 4, 64, device="meta")
    return Call(iq=iq, index_cache=iq, plan=plan, tag=tag)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_header_texts_are_the_encoded_headers(device: str):
    """Cached or not, a header's text is ``json.dumps(call_header(...))``: what a rank sends
    does not depend on whether its tensors live on a GPU."""
    texts = lockstep.HeaderTexts(instance=2, config_digest=0xABC, replica_head=None)
    for requests, tag, call_no, topk in [(3, 7, 1, None), (3, 7, 2, 16), (5, None, 3, None)]:
        call = _meta_call(requests, tag)
        if device == "cpu":
            plan = call.plan
            table = torch.randint(0, 9, plan.block_table.shape, dtype=torch.int32)
            lengths = torch.randint(1, 9, plan.seq_lens.shape, dtype=torch.int32)
            call = call._replace(plan=replace(plan, block_table=table, seq_lens=lengths))
        for _ in range(2):  # the second from the cache
            got = texts.text("select_blocks", call_no, call, topk)
            extra = {} if topk is None else {"topk": topk}
            header = lockstep.call_header("select_blocks", 2, call_no, call, 0xABC, extra)
            assert got == json.dumps(header)


def test_header_round_over_cached_texts_names_the_difference():
    """Ranks whose headers come from the cache still raise on any difference, naming it."""

    def job(comm: Comm) -> str:
        texts = lockstep.HeaderTexts(instance=0, config_digest=1, replica_head=None)
        for call_no in (1, 2):  # equal calls agree
            lockstep.agree_call(
                comm, texts.text("score_push", call_no, _meta_call(3, 5), None), call_no, 10.0
            )
        call = _meta_call(3, 5 if comm.rank == 0 else 6)
        with pytest.raises(OutOfStepError) as e:
            lockstep.agree_call(comm, texts.text("score_push", 3, call, None), 3, 10.0)
        return str(e.value)

    messages = run_threads(2, job)
    assert (
        "call 3 (score_push) is out of step with rank 1: tag 5 here, tag 6 on rank 1" in messages[0]
    )
    assert "tag 6 here, tag 5 on rank 0" in messages[1]


# --------------------------------------------------------------------------- on a GPU
# The scenarios above for ``ipc`` in the one-process GPU world, through the public API only.
#
# ``ipc`` compares call identities in the kernel (the host sends nothing per call), so a refused
# or skipped call shows up on its peers as a kernel timeout, and calls that differ as
# ``OutOfStepError``; both are recorded in the error word and raised by ``check()`` (or the next
# call). The rules of the one-process world apply (docs/design.md): every rank synchronizes its
# stream and meets the others at a host barrier before it allocates, copies or checks.

DEV = "cuda:0"
W = 2
IPC_TIMEOUT = 0.5


def _ipc_cfg(**kw: Any) -> CPIndexConfig:
    base = dict(
        transport="ipc", cache_format="fp8", max_rows=8, max_width=32, timeout_s=IPC_TIMEOUT
    )
    return CPIndexConfig(**{**base, **kw})


def _gpu_prob(requests: int = 3, query_len: int = 1, seed: int = 0) -> testing.Problem:
    return testing.make_problem(
        requests, 12 * 128, "fp8", query_len=query_len, seed=40 + seed, device=DEV
    )


GPU_PROB = None


def _gpu_p() -> testing.Problem:
    global GPU_PROB
    if GPU_PROB is None:
        GPU_PROB = _gpu_prob()
    return GPU_PROB


def _call_and_check(cp: IndexCP, comm: Comm, prob: testing.Problem, **over: Any) -> dict[str, Any]:
    """One call, then (after every rank settled) what it raised, at once or from check()."""
    res = outcome(lambda: _push(cp, prob, **over))
    settle(comm)
    if res["type"] is None:
        res = outcome(cp.check)
    return res


def _good(cp: IndexCP, comm: Comm) -> torch.Tensor:
    """A correct call after recovery; returns a copy of its output (compared by the test)."""
    p = _gpu_p()
    out = torch.empty(cp.heads_per_rank, p.rows, p.width, device=DEV)
    settle(comm)
    kernel_copy(out, _push(cp, p))
    settle(comm)
    return out


def _gpu_want(rank: int) -> torch.Tensor:
    return for_rank(expected(_gpu_p(), 0, 1), rank, W)


def _world(fn):
    _gpu_p()  # built before the ranks start: nothing allocates while a push may spin
    return run_threads(W, fn, device=DEV, timeout_s=60)


# --------------------------------------------------------------------------- construction


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("field", "values"),
    [("max_rows", (8, 16)), ("transport", ("ipc", "auto")), ("sm_scale", (0.1, 0.2))],
)
def test_construction_mismatch_raises_on_every_rank(field, values):
    def job(comm):
        return outcome(
            lambda: IndexCP(_ipc_cfg(**{field: values[comm.rank]}), device=DEV, comm=comm)
        )

    for r in _world(job):
        assert r["type"] == ConfigMismatchError.__name__, r
        assert f"{field}: rank 0: {values[0]!r}, rank 1: {values[1]!r}" in r["msg"]
        assert r["s"] < IPC_TIMEOUT + 1.5


# --------------------------------------------------------------------------- calls


@pytest.mark.gpu
def test_refused_input_times_out_the_peer_and_reset_recovers():
    def job(comm):
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            width = 33 if comm.rank == 1 else _gpu_p().width  # past max_width on rank 1
            first = _call_and_check(cp, comm, _gpu_p(), width=width)
            then = outcome(lambda: _push(cp, _gpu_p()))
            settle(comm)
            cp.reset()
            return first, then, _good(cp, comm)

    (f0, t0, out0), (f1, t1, out1) = _world(job)
    assert f1["type"] == "ValueError" and "width" in f1["msg"]
    assert f0["type"] == PeerTimeoutError.__name__ and f0["peer"] == 1, f0
    for t in (t0, t1):
        assert t["type"] == BrokenInstanceError.__name__, t
    assert t0["cause"] == PeerTimeoutError.__name__ and t1["cause"] == "ValueError"
    assert_scores(out0, _gpu_want(0))
    assert_scores(out1, _gpu_want(1))


IPC_MISMATCHES = {
    "width": lambda: {"width": _gpu_p().width + 1},
    "init_blocks": lambda: {"init_blocks": 1},
    "local_blocks": lambda: {"local_blocks": 2},
}


@pytest.mark.gpu
@pytest.mark.parametrize("field", list(IPC_MISMATCHES))
def test_ranks_with_different_calls_all_raise_ipc(field):
    change = IPC_MISMATCHES[field]()

    def job(comm):
        with IndexCP(_ipc_cfg(timeout_s=2.0), device=DEV, comm=comm) as cp:
            over = change if comm.rank == 1 else {}
            res = _call_and_check(cp, comm, _gpu_p(), **over)
            cp.reset()
            return res, _good(cp, comm)

    for rank, (res, out) in enumerate(_world(job)):
        assert res["type"] == OutOfStepError.__name__, (rank, res)
        assert res["peer"] == 1 - rank
        assert_scores(out, _gpu_want(rank))


@pytest.mark.gpu
def test_ranks_with_different_rows_all_raise():
    other = _gpu_prob(requests=2, seed=1)

    def job(comm):
        with IndexCP(_ipc_cfg(timeout_s=2.0), device=DEV, comm=comm) as cp:
            prob = other if comm.rank == 1 else _gpu_p()
            res = _call_and_check(cp, comm, prob)
            cp.reset()
            return res, _good(cp, comm)

    for rank, (res, out) in enumerate(_world(job)):
        assert res["type"] in (OutOfStepError.__name__, PeerTimeoutError.__name__), (rank, res)
        assert_scores(out, _gpu_want(rank))


@pytest.mark.gpu
def test_two_instances_called_in_different_orders_ipc():
    def job(comm):
        a = IndexCP(_ipc_cfg(), device=DEV, comm=comm)
        b = IndexCP(_ipc_cfg(), device=DEV, comm=comm)
        first, second = (a, b) if comm.rank == 0 else (b, a)
        r1 = _call_and_check(first, comm, _gpu_p())
        r2 = _call_and_check(second, comm, _gpu_p())
        a.reset()
        b.reset()
        outs = _good(a, comm), _good(b, comm)
        a.close()
        b.close()
        return r1, r2, outs

    for rank, (r1, _r2, outs) in enumerate(_world(job)):
        # never wrong data: the first pairing fails on both ranks (identities or flags differ)
        assert r1["type"] in (OutOfStepError.__name__, PeerTimeoutError.__name__), (rank, r1)
        for out in outs:
            assert_scores(out, _gpu_want(rank))


@pytest.mark.gpu
def test_late_peer_times_out_refuses_calls_and_recovers():
    def job(comm):
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            iq = _gpu_p().rank_queries(cp.rank, cp.world_size)  # before any push may spin
            if comm.rank == 1:
                time.sleep(3 * IPC_TIMEOUT)  # rank 0's kernel gives up meanwhile
            first = outcome(lambda: _push(cp, _gpu_p(), iq=iq))
            torch.cuda.current_stream().synchronize()
            checked = outcome(cp.check)
            then = outcome(lambda: _push(cp, _gpu_p(), iq=iq))
            settle(comm)
            cp.reset()
            return first, checked, then, _good(cp, comm)

    (_f0, c0, t0, out0), (_f1, c1, _t1, out1) = _world(job)
    assert c0["type"] == PeerTimeoutError.__name__ and c0["peer"] == 1, c0
    assert t0["type"] == BrokenInstanceError.__name__ and t0["cause"] == PeerTimeoutError.__name__
    # rank 1 came late: its kernel found rank 0 gone (no wrong data) and says so
    assert c1["type"] == PeerTimeoutError.__name__ and c1["peer"] == 0, c1
    assert_scores(out0, _gpu_want(0))
    assert_scores(out1, _gpu_want(1))


@pytest.mark.gpu
def test_reset_is_bounded_and_names_who_did_not_come_ipc():
    def job(comm):
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            if comm.rank == 1:
                time.sleep(1.5 * IPC_TIMEOUT)  # misses rank 0's first reset, joins its second
            first = outcome(cp.reset)
            # rank 0 resets again; rank 1's one late reset walks past the round rank 0 gave up
            # on and meets rank 0's second
            second = outcome(cp.reset) if comm.rank == 0 else {"type": None}
            return first, second, _good(cp, comm)

    (f0, s0, out0), (f1, s1, out1) = _world(job)
    assert f0["type"] == PeerTimeoutError.__name__ and f0["peer"] == 1, f0
    assert f0["s"] < IPC_TIMEOUT + 1.5
    assert f1["type"] is None, f1
    assert s0["type"] is None and s1["type"] is None, (s0, s1)
    assert_scores(out0, _gpu_want(0))
    assert_scores(out1, _gpu_want(1))


@pytest.mark.gpu
def test_close_is_bounded_and_names_who_did_not_come():
    """ipc ranks meet before freeing memory their peers write into; a rank that does not come
    is named within timeout_s and the memory is kept (not freed under a late peer)."""

    def job(comm):
        cp = IndexCP(_ipc_cfg(), device=DEV, comm=comm)
        _good(cp, comm)
        if comm.rank == 1:
            time.sleep(1.5 * IPC_TIMEOUT)  # rank 0 gives up waiting for this rank's close
        return outcome(cp.close)

    c0, c1 = _world(job)
    assert c0["type"] == PeerTimeoutError.__name__ and c0["peer"] == 1, c0
    assert "close timed out" in c0["msg"], c0
    assert c0["s"] < IPC_TIMEOUT + 1.5
    assert c1["type"] == PeerTimeoutError.__name__  # came after rank 0 gave up: told at once


@pytest.mark.gpu
def test_sync_error_check_raises_in_the_failing_call():
    def job(comm):
        with IndexCP(_ipc_cfg(error_check="sync"), device=DEV, comm=comm) as cp:
            over = {"init_blocks": 1} if comm.rank == 1 else {}
            res = outcome(lambda: _push(cp, _gpu_p(), **over))
            settle(comm)
            cp.reset()
            return res, _good(cp, comm)

    for rank, (res, out) in enumerate(_world(job)):
        assert res["type"] == OutOfStepError.__name__, (rank, res)
        assert_scores(out, _gpu_want(rank))


# --------------------------------------------------------------------------- bounds, NaN


@pytest.mark.gpu
def test_negative_length_is_reported_by_the_kernel_and_reset_recovers():
    lens = _gpu_p().seq_lens.clone()
    lens[1] = -5

    def job(comm):
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            res = _call_and_check(cp, comm, _gpu_p(), seq_lens=lens)
            cp.reset()
            return res, _good(cp, comm)

    for rank, (res, out) in enumerate(_world(job)):
        assert res["type"] == BadBlockTableError.__name__ and "seq_lens -5" in res["msg"], res
        assert_scores(out, _gpu_want(rank))


@pytest.mark.gpu
def test_nan_inputs_score_like_the_reference():
    """A NaN dot never wins on the GPU either (fmaxf from -inf): equal to the reference."""
    prob = testing.make_problem(2, 3 * 128, "fp8", seed=11, lengths=torch.tensor([384, 384]))
    nan = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    p0, p1 = int(prob.block_table[0, 0]), int(prob.block_table[0, 1])
    prob.index_cache[p1, 5, 7] = nan
    prob.index_cache[p0] = nan
    prob.q[1, 2, 0] = nan
    prob = prob.to(DEV)
    want = expected(prob, 0, 1)

    def job(comm):
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            out = torch.empty(cp.heads_per_rank, prob.rows, prob.width, device=DEV)
            settle(comm)
            kernel_copy(out, _push(cp, prob))
            settle(comm)
            return out

    for rank, out in enumerate(_world(job)):
        assert_scores(out, for_rank(want, rank, W))
