"""The torch custom ops compose with torch.compile (CPU: the reference path behind them)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

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
            iq = prob.rank_queries(comm.rank, comm.world_size)
            plan = cp.plan(prob.block_table, prob.seq_lens, width=8)
            h, ph = ops.handle(cp), ops.plan_handle(plan)

            @torch.compile(fullgraph=True, backend="aot_eager")
            def f(iq, cache, bt, sl):
                return torch.ops.cpindex.score_push(h, iq, cache, None, ph, bt, sl, 8) * 1

            got = f(iq, prob.index_cache, prob.block_table, prob.seq_lens)
            eager = ops.score_push(cp, iq, prob.index_cache, plan)
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
                return torch.ops.cpindex.score_push(h, iq, cache, None, ph, bt, sl, 8, tag)

            compiled = f(iq, prob.index_cache, prob.block_table, prob.seq_lens, 7)
            eager = ops.score_push(cp, iq, prob.index_cache, plan, tag=8)
            ids, _ = ops.select_blocks(cp, iq, prob.index_cache, plan, topk=4, tag=9)
            # tensors or width other than the plan's: refused (before anything is exchanged,
            # on every rank alike here, so the instance stays usable)
            errors = []
            for args in ((prob.block_table.clone(), prob.seq_lens, 8),
                         (prob.block_table, prob.seq_lens, 7)):  # fmt: skip
                try:
                    torch.ops.cpindex.score_push(h, iq, prob.index_cache, None, ph, *args)
                except ValueError as e:
                    errors.append(str(e))
            return compiled, eager, ids, errors

    full = reference.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
                                  init_blocks=0, local_blocks=1, width=8)  # fmt: skip
    top = reference.select_blocks(prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
                                  init_blocks=0, local_blocks=1, width=8, topk=4)  # fmt: skip
    for rank, (compiled, eager, ids, errors) in enumerate(run_threads(2, rank_fn)):
        heads = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(compiled, full[heads]) and torch.equal(eager, full[heads])
        assert torch.equal(ids, top[heads])
        assert len(errors) == 2 and all(e.startswith("plan: block_table, seq_lens") for e in errors)


# ---- ops.block_scores' eager path: the op's kernel called directly only where the dispatcher
# would call nothing else -------------------------------------------------------------------
def _counting_kernel(monkeypatch) -> list[int]:
    """Counts the wrapper's direct calls of the kernel (the op holds the original function)."""
    calls: list[int] = []
    kernel = ops._block_scores

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(ops, "_block_scores", counted)
    return calls


def test_eager_block_scores_is_the_op(monkeypatch):
    calls = _counting_kernel(monkeypatch)
    for fmt in ("bf16", "fp8", "nvfp4", "nvfp4-pair"):
        base, form = testing.split_format(fmt)
        p = testing.make_problem(3, 900, base, query_len=2, seed=3)
        cache = testing.nvfp4_form(p.index_cache, form) if base == "nvfp4" else p.index_cache
        cache_t, scales = cache if isinstance(cache, tuple) else (cache, None)
        kw = dict(init_blocks=1, local_blocks=1, width=8, sm_scale=0.1, query_len=2)
        direct = ops.block_scores(p.q, cache, p.block_table, p.seq_lens, **kw)
        op = torch.ops.cpindex.block_scores(
            p.q, cache_t, scales, p.block_table, p.seq_lens, 1, 1, 8, 0.1, 2
        )
        assert torch.equal(direct, op)
    assert len(calls) == 4  # every call above went around the dispatcher
    bad = testing.make_problem(3, 900, "nvfp4", seed=4)
    bad.block_table[0, 0] = 10**6
    for call in (
        lambda: ops.block_scores(bad.q, bad.index_cache, bad.block_table, bad.seq_lens),
        lambda: torch.ops.cpindex.block_scores(
            bad.q, bad.index_cache, None, bad.block_table, bad.seq_lens, 0, 1, 8, 0.1, 1
        ),
    ):
        with pytest.raises(ValueError, match="block_table: row 0"):
            call()


def test_block_scores_format_per_cache_shape():
    """The format remembered for a cache's dtype and shape never answers for another cache: a
    uint8 cache of another shape, after a page-major nvfp4 one, is still refused by name."""
    p = testing.make_problem(2, 700, "nvfp4", seed=5)
    want = reference.block_scores(
        p.q, p.index_cache, p.block_table, p.seq_lens, init_blocks=0, local_blocks=1, width=6
    )
    for _ in range(2):
        got = ops.block_scores(p.q, p.index_cache, p.block_table, p.seq_lens, width=6)
        assert torch.equal(got, want)
    other = torch.randint(0, 256, (p.index_cache.shape[0], 128, 70), dtype=torch.uint8)
    for _ in range(2):
        with pytest.raises(TypeError, match="index_cache: cannot infer cache_format"):
            ops.block_scores(p.q, other, p.block_table, p.seq_lens, width=6)


def test_block_scores_takes_the_op_under_compile_modes_and_grad(monkeypatch):
    p = testing.make_problem(3, 900, "bf16", seed=5)
    want = ops.block_scores(p.q, p.index_cache, p.block_table, p.seq_lens)
    calls = _counting_kernel(monkeypatch)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(fullgraph=True, backend=backend)
    def f(q, cache, bt, sl):
        return ops.block_scores(q, cache, bt, sl) + 0

    assert torch.equal(f(p.q, p.index_cache, p.block_table, p.seq_lens), want)
    targets = {n.target for g in graphs for n in g.graph.nodes}
    op = torch.ops.cpindex.block_scores
    assert {op, op.default} & targets  # dynamo records the packet

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (p.q, p.index_cache, p.block_table, p.seq_lens)]
        out = ops.block_scores(*fake)
        assert isinstance(out, FakeTensor) and out.shape == want.shape

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Log():
        assert torch.equal(ops.block_scores(p.q, p.index_cache, p.block_table, p.seq_lens), want)
    assert op.default in seen

    q = p.q.clone().requires_grad_()  # the autograd fallback sees it
    assert torch.equal(ops.block_scores(q, p.index_cache, p.block_table, p.seq_lens), want)
    assert calls == []  # none of these went around the dispatcher
