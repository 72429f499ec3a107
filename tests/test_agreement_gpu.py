"""Tags and the agreement hash of the peer-push transports (``ipc``) in the one-process GPU
world (docs/contract.md §5): ranks whose calls carry different tags, read different
block-table entries or lengths, or (replicated heads) deliver different queries all raise
``OutOfStepError`` and never return a mix of their data; entries a call does not read never
count; a captured call replays its tag. Skipped without a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _gpu import assert_scores, expected, for_rank, kernel_copy, needs_gpu

from cpindex import CPIndexConfig, IndexCP, OutOfStepError, testing
from cpindex.comm import Comm
from cpindex.world import in_turn, run_threads

pytestmark = [needs_gpu, pytest.mark.gpu]
DEV = "cuda:0"


def _cfg(**kw: Any) -> CPIndexConfig:
    base = dict(transport="ipc", cache_format="fp8", max_rows=16, max_width=32, timeout_s=2.0)
    return CPIndexConfig(**{**base, **kw})


def _prob(query_len: int = 1, num_heads: int = 4) -> testing.Problem:
    return testing.make_problem(
        3, 12 * 128, "fp8", query_len=query_len, num_heads=num_heads, seed=77, device=DEV
    )


def _settle(comm: Comm) -> None:
    torch.cuda.current_stream().synchronize()
    comm.barrier()


def _try(fn) -> dict[str, Any]:
    try:
        fn()
        return {"type": None}
    except Exception as e:
        return {"type": type(e).__name__, "msg": str(e), "peer": getattr(e, "peer", None)}


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

    res = _try(call)
    _settle(comm)
    if res["type"] is None:
        res = _try(cp.check)
    res["out"] = out
    return res


def _want(prob: testing.Problem, rank: int, world: int) -> torch.Tensor:
    return for_rank(expected(prob, 0, 1), rank, world)


def _world(world: int, fn):
    return run_threads(world, fn, device=DEV, timeout_s=60)


def test_equal_tags_pass_and_different_tags_raise_on_every_rank_naming_both():
    prob = _prob()

    def job(comm):
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            same = _call(cp, comm, prob, tag=41)
            differ = _call(cp, comm, prob, tag=42 + comm.rank)
            cp.reset()
            after = _call(cp, comm, prob, tag=43)
            return same, differ, after

    for rank, (same, differ, after) in enumerate(_world(2, job)):
        assert same["type"] is None, same
        assert_scores(same["out"], _want(prob, rank, 2))
        assert differ["type"] == OutOfStepError.__name__, differ
        mine, theirs = 42 + rank, 43 - rank
        assert f"tag {mine} here, tag {theirs} on rank {1 - rank}" in differ["msg"], differ
        assert after["type"] is None, after
        assert_scores(after["out"], _want(prob, rank, 2))


def test_a_tag_against_no_tag_raises():
    prob = _prob()

    def job(comm):
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            return _call(cp, comm, prob, tag=7 if comm.rank == 0 else None)

    for r in _world(2, job):
        assert r["type"] == OutOfStepError.__name__ and "no tag" in r["msg"], r


@pytest.mark.parametrize("what", ["page", "length", "swapped rows"])
def test_ranks_reading_other_tables_raise_and_return_nan(what):
    prob = _prob()

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
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            bad = _call(cp, comm, prob, block_table=bt, seq_lens=lens)
            cp.reset()
            good = _call(cp, comm, prob)
            return bad, good

    for rank, (bad, good) in enumerate(_world(2, job)):
        assert bad["type"] == OutOfStepError.__name__, (rank, bad)
        assert "disagree" in bad["msg"], bad
        assert torch.isnan(bad["out"]).all(), "a disagreeing call's scores must all be NaN"
        assert good["type"] is None, good
        assert_scores(good["out"], _want(prob, rank, 2))


def test_entries_a_call_does_not_read_never_count():
    """Padding past a request's blocks, forced blocks and columns past width may differ."""
    prob = _prob()

    def job(comm):
        bt = torch.cat([prob.block_table, prob.block_table[:, :3]], dim=1).contiguous()
        if comm.rank == 1:
            n = (prob.seq_lens.long() + 127) // 128
            for i in range(bt.shape[0]):
                bt[i, int(n[i]) - 1 :] = 12345 + i  # the local block and the padding
        torch.cuda.synchronize()
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            return _call(cp, comm, prob, block_table=bt)

    for rank, r in enumerate(_world(2, job)):
        assert r["type"] is None, r
        assert_scores(r["out"], _want(prob, rank, 2))


def test_replicated_heads_with_other_queries_raise():
    """W = 4, H = 2: ranks 0 and 2 hold head 0; rank 2's queries differ."""
    prob = _prob(num_heads=2)

    def job(comm):
        iq = prob.rank_queries(comm.rank, comm.world_size).clone()
        if comm.rank == 2:
            iq[0, 0, 0] = (iq[0, 0, 0].float() + 1).to(iq.dtype)
        torch.cuda.synchronize()
        with IndexCP(_cfg(num_heads=2), device=DEV, comm=comm) as cp:
            return _call(cp, comm, prob, iq=iq)

    for r in _world(4, job):
        assert r["type"] == OutOfStepError.__name__, r
        assert "rank 2's queries differ from rank 0's" in r["msg"], r


def test_agreement_can_be_turned_off():
    prob = _prob()

    def job(comm):
        bt = prob.block_table.clone()
        if comm.rank == 1:
            bt[0, 2] = (bt[0, 2] + 1) % prob.index_cache.shape[0]
        torch.cuda.synchronize()
        with IndexCP(_cfg(fingerprint=False), device=DEV, comm=comm) as cp:
            return _call(cp, comm, prob, block_table=bt)

    for r in _world(2, job):
        assert r["type"] is None, r  # unchecked: the contract says so


def test_select_blocks_disagreement_poisons_ids_and_scores():
    prob = _prob()

    def job(comm):
        bt = prob.block_table.clone()
        if comm.rank == 1:
            bt[0, 3] = (bt[0, 3] + 1) % prob.index_cache.shape[0]
        torch.cuda.synchronize()
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            ids = torch.empty(cp.heads_per_rank, prob.rows, 4, dtype=torch.int32, device=DEV)
            vals = torch.empty(cp.heads_per_rank, prob.rows, 4, device=DEV)

            def go():
                i, v = cp.select_blocks(
                    prob.rank_queries(cp.rank, cp.world_size), prob.index_cache,
                    cp.plan(bt, prob.seq_lens, width=prob.width), topk=4, return_scores=True,
                )  # fmt: skip
                kernel_copy(ids, i)
                kernel_copy(vals, v)

            res = _try(go)
            _settle(comm)
            if res["type"] is None:
                res = _try(cp.check)
            return res, ids, vals

    for res, ids, vals in _world(2, job):
        assert res["type"] == OutOfStepError.__name__, res
        assert (ids == -1).all() and torch.isnan(vals).all()


def test_a_captured_call_replays_its_tag():
    prob = _prob()

    def job(comm):
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
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

            _settle(comm)
            in_turn(comm, capture)
            _settle(comm)
            view = views[0]
            outs = []
            for _ in range(3):
                graph.replay()
                _settle(comm)
                outs.append(_try(cp.check) | {"out": view.clone()})
                _settle(comm)
            return outs

    for rank, outs in enumerate(_world(2, job)):
        for r in outs:
            assert r["type"] is None, r
            assert_scores(r["out"], _want(prob, rank, 2))
