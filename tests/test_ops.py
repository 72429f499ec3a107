"""The torch custom ops compose with torch.compile (CPU: the reference path behind them)."""

from __future__ import annotations

import torch

from cpindex import CPIndexConfig, IndexCP, ops, reference, testing
from cpindex.world import run_threads


def test_block_scores_op_compiles_and_matches_reference():
    prob = testing.make_problem(3, 1500, "nvfp4", seed=1)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, cache, bt, sl):
        return torch.ops.cpindex.block_scores(q, cache, None, bt, sl, 0, 1, 12, 128**-0.5) + 0

    got = f(prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    want = reference.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
                                  init_blocks=0, local_blocks=1, width=12)  # fmt: skip
    assert torch.equal(got, want)
    eager = ops.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens, width=12)
    assert torch.equal(eager, want)


def test_score_push_op_compiles_in_a_world():
    prob = testing.make_problem(2, 900, "fp8", seed=2)

    def rank_fn(comm):
        cfg = CPIndexConfig(cache_format="fp8", max_rows=4, max_width=8)
        with IndexCP(cfg, device="cpu", comm=comm) as cp:
            h = ops.handle(cp)
            iq = prob.rank_queries(comm.rank, comm.world_size)

            @torch.compile(fullgraph=True, backend="aot_eager")
            def f(iq, cache, bt, sl):
                return torch.ops.cpindex.score_push(h, iq, cache, None, bt, sl, 0, 1, 8) * 1

            got = f(iq, prob.index_cache, prob.block_table, prob.seq_lens)
            eager = ops.score_push(cp, iq, prob.index_cache, prob.block_table, prob.seq_lens,
                                   width=8)  # fmt: skip
            return got, eager

    full = reference.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
                                  init_blocks=0, local_blocks=1, width=8)  # fmt: skip
    for rank, (got, eager) in enumerate(run_threads(2, rank_fn)):
        want = full[2 * rank : 2 * rank + 2]
        assert torch.equal(got, want) and torch.equal(eager, want)


def test_ops_take_a_plan_and_a_tag():
    prob = testing.make_problem(2, 900, "fp8", seed=3)

    def rank_fn(comm):
        cfg = CPIndexConfig(cache_format="fp8", max_rows=4, max_width=8)
        with IndexCP(cfg, device="cpu", comm=comm) as cp:
            iq = prob.rank_queries(comm.rank, comm.world_size)
            plan = cp.plan(prob.block_table, prob.seq_lens, width=8)
            h, ph = ops.handle(cp), ops.plan_handle(plan)

            @torch.compile(fullgraph=True, backend="aot_eager")
            def f(iq, cache, bt, sl, tag):
                return torch.ops.cpindex.score_push(h, iq, cache, None, bt, sl, 0, 1, 8, 1, tag, ph)

            compiled = f(iq, prob.index_cache, prob.block_table, prob.seq_lens, 7)
            eager = ops.score_push(cp, iq, prob.index_cache, plan, tag=8)
            ids, _ = ops.select_blocks(cp, iq, prob.index_cache, plan, topk=4, tag=9)
            return compiled, eager, ids

    full = reference.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
                                  init_blocks=0, local_blocks=1, width=8)  # fmt: skip
    top = reference.select_blocks(prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
                                  init_blocks=0, local_blocks=1, width=8, topk=4)  # fmt: skip
    for rank, (compiled, eager, ids) in enumerate(run_threads(2, rank_fn)):
        heads = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(compiled, full[heads]) and torch.equal(eager, full[heads])
        assert torch.equal(ids, top[heads])
