"""Ranks that disagree raise on every rank, never return a result (docs/design.md, "Ranks in
step"): call tags, the agreement fingerprint, replicated heads' queries, a bad tensor on one
rank, ``reset()`` after any history of lone resets, instances called from threads, and a store
host that dies inside a call.

Every scenario runs over the ``collective`` transport in real gloo worlds of 2 and 4
processes (one world per size runs every scenario in turn; the last one kills rank 0), and
the cheap ones in the in-process world too. Each must end in an error on every rank naming
what differs, at once (no rank waits out ``timeout_s``), and after ``reset()`` the ranks
compute correct results again.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import itertools
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _failures import outcome
from _gpu import assert_scores, expected, for_rank, kernel_copy, settle
from _worlds import Worlds

import cpindex
from cpindex import CPIndexConfig, IndexCP, OutOfStepError, partition, reference, testing
from cpindex.comm import Comm, TorchComm
from cpindex.world import in_turn, run_threads

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")

SLACK = 1.5  # what an "at once" error may take (store round trips, scheduling on 2 cores)
LONE = 0.05  # timeout_s of a lone reset: nobody comes, it gives up after this
GUARD_S = 240


@pytest.fixture(autouse=True)
def _hang_guard():
    faulthandler.dump_traceback_later(GUARD_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# --------------------------------------------------------------------------- helpers


@functools.cache
def _prob(heads: int = 4, seed: int = 3) -> testing.Problem:
    return testing.make_problem(3, 1200, "fp8", num_heads=heads, seed=seed)


def _cfg(heads: int = 4, **kw: Any) -> CPIndexConfig:
    base = dict(
        cache_format="fp8", max_rows=8, max_width=24, transport="collective", num_heads=heads
    )
    return CPIndexConfig(**{**base, "timeout_s": 5.0, **kw})


def _args(rank: int, world: int, prob: testing.Problem) -> dict[str, Any]:
    return dict(
        iq=prob.rank_queries(rank, world),
        index_cache=prob.index_cache,
        block_table=prob.block_table,
        seq_lens=prob.seq_lens,
        width=prob.width,
    )


def _push(cp: cpindex.IndexCP, a: dict[str, Any]) -> torch.Tensor:
    """``cp.score_push`` on the arguments ``a`` (as :func:`_args` names them), its plan first."""
    plan = cp.plan(a["block_table"], a["seq_lens"], width=a["width"])
    return cp.score_push(a["iq"], a["index_cache"], plan)


def _want(rank: int, world: int, prob: testing.Problem) -> torch.Tensor:
    full = reference.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, init_blocks=0,
        local_blocks=1, width=prob.width,
    )  # fmt: skip
    return full[partition.heads_of_rank(rank, full.shape[0], world)]


def _correct(cp: cpindex.IndexCP, heads: int = 4) -> bool:
    p = _prob(heads)
    got = _push(cp, _args(cp.rank, cp.world_size, p)).clone()
    return bool(torch.equal(got, _want(cp.rank, cp.world_size, p)))


def _flip(table: torch.Tensor) -> torch.Tensor:
    """Two read entries of row 0 (the longest request) swapped: equal shapes and pages,
    another table."""
    t = table.clone()
    t[0, 0], t[0, 1] = table[0, 1].item(), table[0, 0].item()
    return t


# --------------------------------------------------------------------------- scenarios
# Each takes the comm and returns plain data; the tests below check it.


def sc_tags(comm: Comm) -> dict:
    """Rank 1 skips the call tagged 1: every rank raises naming both tags; without a tag on
    either side the ranks of a healthy step agree; a plan serves several tagged layers."""
    rank, w = comm.rank, comm.world_size
    p = _prob()
    with cpindex.IndexCP(_cfg(), device="cpu", comm=comm) as cp:
        args = _args(rank, w, p)
        plan = cp.plan(args.pop("block_table"), args.pop("seq_lens"), width=args.pop("width"))
        layers = []
        for layer in range(3):  # the same plan, three tagged layers
            layers.append(cp.score_push(args["iq"], args["index_cache"], plan, tag=layer).clone())
        good = all(torch.equal(o, _want(rank, w, p)) for o in layers)
        iq, cache = args["iq"], args["index_cache"]
        same = outcome(lambda: cp.score_push(iq, cache, plan, tag=10))
        skipped = 12 if rank == 1 else 11  # rank 1 skipped the call tagged 11
        second = outcome(lambda: cp.select_blocks(iq, cache, plan, tag=skipped))
        third = outcome(lambda: cp.score_push(iq, cache, plan, tag=13))
        cp.reset()
        bad_tags = []
        for t in (-1, 1 << 63, 1.0, True):
            bad_tags.append(outcome(lambda t=t: cp.score_push(iq, cache, plan, tag=t)))
            cp.reset()
        return {"good": good, "same": same, "second": second, "third": third,
                "bad_tags": bad_tags, "correct": _correct(cp)}  # fmt: skip


def sc_tables(comm: Comm) -> dict:
    """Equal shapes, different contents: a flipped table, one page, one length; padding that
    differs (entries no call reads) is not a difference; with ``fingerprint=False`` tables are
    not compared."""
    rank, w = comm.rank, comm.world_size
    p = _prob()
    out: dict[str, Any] = {}
    with cpindex.IndexCP(_cfg(), device="cpu", comm=comm) as cp:
        one_page = p.block_table.clone()
        pages = p.index_cache.shape[0]
        unused = sorted(set(range(pages)) - set(p.block_table.flatten().tolist()))
        one_page[0, 2] = unused[0]  # a spare page (make_problem keeps 3); row 0 reads column 2
        changes = {"flipped": _flip(p.block_table), "one_page": one_page}
        for name, table in changes.items():
            args = _args(rank, w, p)
            if rank == 1:
                args["block_table"] = table
            out[name] = outcome(lambda a=args: _push(cp, a))
            out[name + "_after"] = outcome(lambda: _correct(cp))  # broken until reset
            cp.reset()
        # A plan without a fingerprint slot (not made by this instance) is compared too.
        args = _args(rank, w, p)
        if rank == 1:
            args["block_table"] = _flip(p.block_table)
        plan = cp.plan(args.pop("block_table"), args.pop("seq_lens"), width=args.pop("width"))
        bare = dataclasses.replace(plan, fingerprint=None)
        out["bare_plan"] = outcome(lambda: cp.score_push(args["iq"], args["index_cache"], bare))
        cp.reset()
        padded = _args(rank, w, p)  # entries past each row's read columns: garbage per rank
        table = p.block_table.clone()
        n = (p.seq_lens.long() + 127) // 128
        for r in range(table.shape[0]):
            table[r, n[r] - 1 :] = 1000 + rank  # the local block and padding: never read
        padded["block_table"] = table
        got = _push(cp, padded).clone()
        out["padding_ok"] = bool(torch.equal(got, _want(rank, w, p)))
        out["correct"] = _correct(cp)
    with cpindex.IndexCP(_cfg(fingerprint=False), device="cpu", comm=comm) as cp:
        args = _args(rank, w, p)
        if rank == 1:
            args["block_table"] = _flip(p.block_table)
        out["unchecked"] = outcome(lambda: _push(cp, args))
    return out


def sc_replicas(comm: Comm) -> dict:
    """More ranks than heads: the last rank, a replica of its head, passes other queries."""
    rank, w = comm.rank, comm.world_size
    heads = w // 2
    p = _prob(heads)
    with cpindex.IndexCP(_cfg(heads), device="cpu", comm=comm) as cp:
        args = _args(rank, w, p)
        if rank == w - 1:
            args["iq"] = (args["iq"].float() * 0.5).to(torch.float8_e4m3fn)
        res = outcome(lambda: _push(cp, args))
        cp.reset()
        return {"call": res, "correct": _correct(cp, heads)}


def sc_bad_tensor(comm: Comm) -> dict:
    """A nested-tensor iq, or a plan refused, on rank 1: a refusal every peer hears at once."""
    rank, w = comm.rank, comm.world_size
    p = _prob()
    with cpindex.IndexCP(_cfg(), device="cpu", comm=comm) as cp:
        args = _args(rank, w, p)
        if rank == 1:
            rows = [r.float() for r in args["iq"].unbind(0)]
            args["iq"] = torch.nested.nested_tensor(rows).to(torch.float8_e4m3fn)
        nested = outcome(lambda: _push(cp, args))
        cp.reset()
        width = p.width + (100 if rank == 1 else 0)  # rank 1's plan: past max_width
        planned = outcome(
            lambda: cp.score_push(
                _args(rank, w, p)["iq"], p.index_cache, cp.plan(p.block_table, p.seq_lens,
                                                                width=width)
            )
        )  # fmt: skip
        cp.reset()
        return {"nested": nested, "plan": planned, "correct": _correct(cp)}


def _sequences(world: int) -> list[tuple[int, ...]]:
    """Every order of up to three lone resets, with ranks 1..W-1 taken as interchangeable
    (rank 0, which serves the store, is not)."""
    out = []
    for n in range(4):
        for seq in itertools.product(range(world), repeat=n):
            names: dict[int, int] = {}
            canon = tuple(names.setdefault(r, len(names) + 1) if r else 0 for r in seq)
            if canon == seq:
                out.append(seq)
    return out


def sc_resets(comm: Comm) -> dict:
    """After every interleaving of up to three lone resets (and a few lone calls and partial
    resets), one reset() on every rank brings the group back, at once. Lone calls go to a
    second instance (``timeout_s=LONE``) on the same group: they move the group's round
    counter as a missed round does."""
    rank, w = comm.rank, comm.world_size
    histories = [[("reset", frozenset({r})) for r in seq] for seq in _sequences(w)]
    histories += [
        [("call", frozenset({1}))],  # a rank's lone call times out: it is a round ahead
        [("call", frozenset({0})), ("reset", frozenset({1})), ("call", frozenset({1}))],
        [("reset", frozenset(range(w - 1)))],  # all but the last rank
    ]
    if w == 4:
        histories.append([("reset", frozenset({0, 1})), ("reset", frozenset({2}))])
    out = []
    p = _prob()
    a = cpindex.IndexCP(_cfg(), device="cpu", comm=comm)
    b = cpindex.IndexCP(_cfg(timeout_s=LONE), device="cpu", comm=comm)
    for history in histories:
        lone = []
        for kind, who in history:
            comm.barrier()
            if rank in who:
                if kind == "reset":
                    lone.append(outcome(lambda: a.reset(timeout_s=LONE)))
                else:
                    lone.append(outcome(lambda: _push(b, _args(rank, w, p))))
        comm.barrier()
        joint = outcome(a.reset)
        again = outcome(a.reset)  # repeated: harmless
        b.reset(timeout_s=5.0)
        out.append({
            "history": [(k, sorted(r)) for k, r in history], "lone": lone, "joint": joint,
            "again": again, "correct": _correct(a),
        })  # fmt: skip
    a.close()
    b.close()
    return {"runs": out}


def sc_threads(comm: Comm) -> dict:
    """Several instances of a process, on one group and on their own groups, called from one
    thread in one order on every rank: correct. Two threads inside calls at once (instances
    on one group or on two) is refused at once on the second, saying what works: over
    torch.distributed every instance's rounds go through the process's one store connection,
    so overlapping calls would wait on one another across ranks until their timeouts."""
    rank, w = comm.rank, comm.world_size
    group = dist.new_group(list(range(w)), backend="gloo")
    a = cpindex.IndexCP(_cfg(), device="cpu", comm=comm)
    b = cpindex.IndexCP(_cfg(), device="cpu", comm=comm)
    c = cpindex.IndexCP(_cfg(), group=group, device="cpu")
    one_thread = all(_correct(x) for x in (a, b, c, c, a, b, a))
    refused = []
    for other in (b, c):  # on a's group, and on another group
        comm.barrier()
        if rank == 0:  # thread A waits inside a call on a for the others (late by 0.5 s)
            t = threading.Thread(target=lambda: _correct(a))
            t.start()
            while not a._runner.others.locked():
                time.sleep(0.001)
            refused.append(outcome(lambda o=other: _correct(o)))
            t.join()
        else:
            time.sleep(0.5)
            _correct(a)
    res = {"one_thread": one_thread, "refused": refused, "after": _correct(b) and _correct(c)}
    for x in (a, b, c):
        x.close()
    return res


def sc_store_host_dies(comm: Comm, save: Callable[[], None]) -> dict:
    """Last: rank 0, whose process serves the store, dies inside a call (after the header
    round, in its all-to-all). The survivors raise PeerConnectionError naming it."""
    cp = cpindex.IndexCP(_cfg(timeout_s=3.0), device="cpu", comm=comm)
    rank, w = comm.rank, comm.world_size
    if rank == 0:
        save()

        def die(*a: Any, **k: Any) -> None:
            os._exit(0)

        comm.all_to_all_into = die  # type: ignore[method-assign]
    return outcome(lambda: _push(cp, _args(rank, w, _prob())))


SCENARIOS: dict[str, Callable[[Comm], dict]] = {
    "tags": sc_tags,
    "tables": sc_tables,
    "replicas": sc_replicas,
    "bad_tensor": sc_bad_tensor,
    "resets": sc_resets,
}
GLOO_ONLY: dict[str, Callable[[Comm], dict]] = {"threads": sc_threads}
THREAD_SCENARIOS = ["tags", "tables", "replicas", "bad_tensor"]


def _run(comm: Comm, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = {**SCENARIOS, **GLOO_ONLY}[name](comm)
        except Exception:
            out[name] = {"crash": traceback.format_exc()}
            break  # the ranks may be out of step now
    return out


def gloo_rank(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    comm = TorchComm()
    res = _run(comm, [*SCENARIOS, *GLOO_ONLY])

    def save() -> None:
        torch.save(res, Path(path) / f"rank{rank}.pt")

    try:
        res["store_host_dies"] = sc_store_host_dies(comm, save)
    except Exception:
        res["store_host_dies"] = {"crash": traceback.format_exc()}
    save()
    os._exit(0)  # skip destroy_process_group: rank 0 is gone


_WORLDS = Worlds(
    "agreement",
    gloo_rank,
    lambda comm: _run(comm, THREAD_SCENARIOS),
    gloo_timeout_s=200,
    threads_timeout_s=60,
)
KINDS = [("gloo", 2), ("gloo", 4), ("threads", 2)]


def _scenario(kind: str, world: int, name: str, tmp_path_factory) -> list[dict]:
    per_rank = [
        r.get(name, {"crash": "not reached"})
        for r in _WORLDS.results(kind, world, tmp_path_factory)
    ]
    for rank, res in enumerate(per_rank):
        assert "crash" not in res, f"rank {rank}:\n{res['crash']}"
    return per_rank


def _all_raise_at_once(results: list[dict], key: str, kind: str = "OutOfStepError") -> None:
    for rank, r in enumerate(results):
        e = r[key]
        assert e["type"] == kind, (rank, e)
        assert e["s"] < SLACK, (rank, e)


# --------------------------------------------------------------------------- the checks


@pytest.mark.parametrize(("kind", "world"), KINDS)
def test_a_skipped_call_raises_naming_both_tags(kind, world, tmp_path_factory):
    res = _scenario(kind, world, "tags", tmp_path_factory)
    _all_raise_at_once(res, "second")
    for rank, r in enumerate(res):
        assert r["good"], rank
        assert r["same"]["type"] is None, r["same"]
        msg = r["second"]["msg"]
        if rank == 1:
            assert "tag 12 here, tag 11 on rank 0" in msg, msg
        else:
            assert "tag 11 here, tag 12 on rank 1" in msg, msg
        assert r["third"]["type"] == "BrokenInstanceError"  # broken until reset
        types = [(e["type"], e["msg"].split(":")[0]) for e in r["bad_tags"]]
        assert types == [("ValueError", "tag")] * 2 + [("TypeError", "tag")] * 2, types
        assert r["correct"]


@pytest.mark.parametrize(("kind", "world"), KINDS)
@pytest.mark.parametrize("change", ["flipped", "one_page"])
def test_equal_shaped_tables_that_differ_raise_on_every_rank(kind, world, change, tmp_path_factory):
    res = _scenario(kind, world, "tables", tmp_path_factory)
    _all_raise_at_once(res, change)
    for rank, r in enumerate(res):
        msg = r[change]["msg"]
        assert "block-table entries and lengths with fingerprint" in msg, msg
        assert "different block tables or lengths" in msg, msg
        assert r[change + "_after"]["type"] == "BrokenInstanceError"
        assert r["padding_ok"] and r["correct"], rank


@pytest.mark.parametrize(("kind", "world"), KINDS)
def test_a_plan_without_a_fingerprint_slot_is_compared_too(kind, world, tmp_path_factory):
    res = _scenario(kind, world, "tables", tmp_path_factory)
    _all_raise_at_once(res, "bare_plan")
    for r in res:
        assert "different block tables or lengths" in r["bare_plan"]["msg"], r["bare_plan"]


@pytest.mark.parametrize(("kind", "world"), KINDS)
def test_fingerprint_off_compares_no_tables(kind, world, tmp_path_factory):
    for r in _scenario(kind, world, "tables", tmp_path_factory):
        assert r["unchecked"]["type"] is None, r["unchecked"]


@pytest.mark.parametrize(("kind", "world"), KINDS)
def test_replicas_with_different_queries_raise_on_every_rank(kind, world, tmp_path_factory):
    res = _scenario(kind, world, "replicas", tmp_path_factory)
    _all_raise_at_once(res, "call")
    heads, last = world // 2, world - 1
    for r in res:
        msg = r["call"]["msg"]
        head = last % heads
        assert f"ranks {head} and {last} both own head {head} but passed different iq" in msg
        assert r["correct"]


@pytest.mark.parametrize(("kind", "world"), KINDS)
def test_a_bad_tensor_on_one_rank_is_a_refusal_every_peer_hears_at_once(
    kind, world, tmp_path_factory
):
    res = _scenario(kind, world, "bad_tensor", tmp_path_factory)
    for key, error in [("nested", "TypeError: iq"), ("plan", "ValueError: width")]:
        for rank, r in enumerate(res):
            e = r[key]
            if rank == 1:
                assert e["type"] == error.split(":")[0], e
                assert e["msg"].startswith(error.split(": ")[1]), e
            else:
                assert e["type"] == "OutOfStepError", (rank, e)
                assert f"refused by rank 1: {error}" in e["msg"], e
            assert e["s"] < SLACK, (rank, key, e)
    for r in res:
        assert r["correct"]


@pytest.mark.parametrize("world", [2, 4])
def test_reset_recovers_after_any_lone_resets(world, tmp_path_factory):
    res = _scenario("gloo", world, "resets", tmp_path_factory)
    runs = list(zip(*(r["runs"] for r in res), strict=True))
    assert len(runs) == len(_sequences(world)) + (4 if world == 4 else 3)
    for per_rank in runs:
        history = per_rank[0]["history"]
        for rank, run in enumerate(per_rank):
            for lone in run["lone"]:  # alone: a timeout naming a rank that did not come
                assert lone["type"] == "PeerTimeoutError", (history, rank, lone)
            assert run["joint"]["type"] is None, (history, rank, run["joint"])
            assert run["joint"]["s"] < SLACK, (history, rank, run["joint"])
            assert run["again"]["type"] is None, (history, rank, run["again"])
            assert run["correct"], (history, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_instances_are_called_from_one_thread(world, tmp_path_factory):
    res = _scenario("gloo", world, "threads", tmp_path_factory)
    for rank, r in enumerate(res):
        assert r["one_thread"] and r["after"], rank
    for refused in res[0]["refused"]:
        assert refused["type"] == "CPIndexError", refused
        assert (
            "another IndexCP of this process is inside a call on another thread" in (refused["msg"])
        )
        assert "call every IndexCP of a process from one thread" in refused["msg"]
        assert refused["s"] < SLACK


@pytest.mark.parametrize("world", [2, 4])
def test_store_host_dying_mid_call_is_a_lost_connection(world, tmp_path_factory):
    res = _WORLDS.results("gloo", world, tmp_path_factory)
    for rank in range(1, world):
        e = res[rank]["store_host_dies"]
        assert "crash" not in e, e
        assert e["type"] == "PeerConnectionError" and e["cpindex"], (rank, e)
        assert "rank 0" in e["msg"] and e["peer"] == 0, (rank, e)
        assert e["s"] < 3.0 + SLACK, (rank, e)


# --------------------------------------------------------------------------- on a GPU
# Tags and the agreement hash of the peer-push transports (``ipc``) in the one-process GPU
# world (docs/contract.md §5): ranks whose calls carry different tags, read different
# block-table entries or lengths, or (replicated heads) deliver different queries all raise
# ``OutOfStepError`` and never return a mix of their data; entries a call does not read never
# count; a captured call replays its tag. Skipped without a GPU.

DEV = "cuda:0"


def _ipc_cfg(**kw: Any) -> CPIndexConfig:
    base = dict(transport="ipc", cache_format="fp8", max_rows=16, max_width=32, timeout_s=2.0)
    return CPIndexConfig(**{**base, **kw})


def _gpu_prob(query_len: int = 1, num_heads: int = 4) -> testing.Problem:
    return testing.make_problem(
        3, 12 * 128, "fp8", query_len=query_len, num_heads=num_heads, seed=77, device=DEV
    )


def _call(cp: IndexCP, comm: Comm, prob: testing.Problem, **over: Any) -> dict[str, Any]:
    """One score_push; after every rank settled, what it raised (at once or from check()),
    and a copy of its output."""
    args = dict(
        query_len=prob.query_len,
        width=prob.width,
        tag=None,
    )
    args.update(over)
    bt = args.pop("block_table", prob.block_table)
    lens = args.pop("seq_lens", prob.seq_lens)
    iq = args.pop("iq", prob.rank_queries(cp.rank, cp.world_size))
    out = torch.empty(cp.heads_per_rank, prob.rows, prob.width, device=DEV)
    t, w, tag = args.pop("query_len"), args.pop("width"), args.pop("tag")

    def call() -> None:
        plan = cp.plan(bt, lens, query_len=t, width=w, **args)
        kernel_copy(out, cp.score_push(iq, prob.index_cache, plan, tag=tag))

    res = outcome(call)
    settle(comm)
    if res["type"] is None:
        res = outcome(cp.check)
    res["out"] = out
    return res


def _gpu_want(prob: testing.Problem, rank: int, world: int) -> torch.Tensor:
    return for_rank(expected(prob, 0, 1), rank, world)


def _world(world: int, fn):
    return run_threads(world, fn, device=DEV, timeout_s=60)


@pytest.mark.gpu
def test_equal_tags_pass_and_different_tags_raise_on_every_rank_naming_both():
    prob = _gpu_prob()

    def job(comm):
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            same = _call(cp, comm, prob, tag=41)
            differ = _call(cp, comm, prob, tag=42 + comm.rank)
            cp.reset()
            after = _call(cp, comm, prob, tag=43)
            return same, differ, after

    for rank, (same, differ, after) in enumerate(_world(2, job)):
        assert same["type"] is None, same
        assert_scores(same["out"], _gpu_want(prob, rank, 2))
        assert differ["type"] == OutOfStepError.__name__, differ
        mine, theirs = 42 + rank, 43 - rank
        assert f"tag {mine} here, tag {theirs} on rank {1 - rank}" in differ["msg"], differ
        assert after["type"] is None, after
        assert_scores(after["out"], _gpu_want(prob, rank, 2))


@pytest.mark.gpu
def test_a_tag_against_no_tag_raises():
    prob = _gpu_prob()

    def job(comm):
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            return _call(cp, comm, prob, tag=7 if comm.rank == 0 else None)

    for r in _world(2, job):
        assert r["type"] == OutOfStepError.__name__ and "no tag" in r["msg"], r


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["page", "length", "swapped rows"])
def test_ranks_reading_other_tables_raise_and_return_nan(what):
    prob = _gpu_prob()

    def job(comm):
        bt, lens = prob.block_table.clone(), prob.seq_lens.clone()
        if comm.rank == 1:
            if what == "page":  # request 0 is the longest (12 blocks): block 2 is read
                bt[0, 2] = (bt[0, 2] + 1) % prob.index_cache.shape[0]
            elif what == "length":
                lens[0] -= 1
            else:
                bt[[0, 2]] = bt[[2, 0]]
        torch.cuda.synchronize()
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            bad = _call(cp, comm, prob, block_table=bt, seq_lens=lens)
            cp.reset()
            good = _call(cp, comm, prob)
            return bad, good

    for rank, (bad, good) in enumerate(_world(2, job)):
        assert bad["type"] == OutOfStepError.__name__, (rank, bad)
        assert "disagree" in bad["msg"], bad
        assert torch.isnan(bad["out"]).all(), "a disagreeing call's scores must all be NaN"
        assert good["type"] is None, good
        assert_scores(good["out"], _gpu_want(prob, rank, 2))


@pytest.mark.gpu
def test_entries_a_call_does_not_read_never_count():
    """Padding past a request's blocks, forced blocks and columns past width may differ."""
    prob = _gpu_prob()

    def job(comm):
        bt = torch.cat([prob.block_table, prob.block_table[:, :3]], dim=1).contiguous()
        if comm.rank == 1:
            n = (prob.seq_lens.long() + 127) // 128
            for i in range(bt.shape[0]):
                bt[i, int(n[i]) - 1 :] = 12345 + i  # the local block and the padding
        torch.cuda.synchronize()
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            return _call(cp, comm, prob, block_table=bt)

    for rank, r in enumerate(_world(2, job)):
        assert r["type"] is None, r
        assert_scores(r["out"], _gpu_want(prob, rank, 2))


@pytest.mark.gpu
def test_replicated_heads_with_other_queries_raise():
    """W = 4, H = 2: ranks 0 and 2 hold head 0; rank 2's queries differ."""
    prob = _gpu_prob(num_heads=2)

    def job(comm):
        iq = prob.rank_queries(comm.rank, comm.world_size).clone()
        if comm.rank == 2:
            iq[0, 0, 0] = (iq[0, 0, 0].float() + 1).to(iq.dtype)
        torch.cuda.synchronize()
        with IndexCP(_ipc_cfg(num_heads=2), device=DEV, comm=comm) as cp:
            return _call(cp, comm, prob, iq=iq)

    for r in _world(4, job):
        assert r["type"] == OutOfStepError.__name__, r
        assert "rank 2's queries differ from rank 0's" in r["msg"], r


@pytest.mark.gpu
def test_agreement_can_be_turned_off():
    prob = _gpu_prob()

    def job(comm):
        bt = prob.block_table.clone()
        if comm.rank == 1:
            bt[0, 2] = (bt[0, 2] + 1) % prob.index_cache.shape[0]
        torch.cuda.synchronize()
        with IndexCP(_ipc_cfg(fingerprint=False), device=DEV, comm=comm) as cp:
            return _call(cp, comm, prob, block_table=bt)

    for r in _world(2, job):
        assert r["type"] is None, r  # unchecked: the contract says so


@pytest.mark.gpu
def test_select_blocks_disagreement_poisons_ids_and_scores():
    prob = _gpu_prob()

    def job(comm):
        bt = prob.block_table.clone()
        if comm.rank == 1:
            bt[0, 3] = (bt[0, 3] + 1) % prob.index_cache.shape[0]
        torch.cuda.synchronize()
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            ids = torch.empty(cp.heads_per_rank, prob.rows, 4, dtype=torch.int32, device=DEV)
            vals = torch.empty(cp.heads_per_rank, prob.rows, 4, device=DEV)

            def go():
                i, v = cp.select_blocks(
                    prob.rank_queries(cp.rank, cp.world_size), prob.index_cache,
                    cp.plan(bt, prob.seq_lens, width=prob.width), topk=4, return_scores=True,
                )  # fmt: skip
                kernel_copy(ids, i)
                kernel_copy(vals, v)

            res = outcome(go)
            settle(comm)
            if res["type"] is None:
                res = outcome(cp.check)
            return res, ids, vals

    for res, ids, vals in _world(2, job):
        assert res["type"] == OutOfStepError.__name__, res
        assert (ids == -1).all() and torch.isnan(vals).all()


@pytest.mark.gpu
def test_a_captured_call_replays_its_tag():
    prob = _gpu_prob()

    def job(comm):
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            iq = prob.rank_queries(cp.rank, cp.world_size)
            args = (
                iq,
                prob.index_cache,
                cp.plan(prob.block_table, prob.seq_lens, width=prob.width),
            )
            _call(cp, comm, prob, tag=5)  # warm-up outside capture
            graph = torch.cuda.CUDAGraph()
            views = []

            def capture():  # one rank at a time: concurrent captures from threads fail
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    views.append(cp.score_push(*args, tag=9))

            settle(comm)
            in_turn(comm, capture)
            settle(comm)
            view = views[0]
            outs = []
            for _ in range(3):
                graph.replay()
                settle(comm)
                outs.append(outcome(cp.check) | {"out": view.clone()})
                settle(comm)
            return outs

    for rank, outs in enumerate(_world(2, job)):
        for r in outs:
            assert r["type"] is None, r
            assert_scores(r["out"], _gpu_want(prob, rank, 2))
