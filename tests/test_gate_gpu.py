"""The CP gate on one GPU: the one-process world, W = 4, ``ipc``.

Below the threshold each rank runs the fused kernel in local mode for its own heads, writing into
the transport's own views; at or above it the push runs as before. Checked: both sides equal the
reference and the always-CP path bit for bit (score_push and select_blocks, T = 1 and 4); below
it rank 0 calls while the others make no call, and the device call count (the handshake's) does
not move; a device error of a call below the gate (a page outside the cache) is raised on that
rank only, naming it, and leaves every instance usable; captured graphs take the same path at
every replay (a graph of calls below the gate replays on rank 0 alone); ``auto`` is 0 in this
world.

The rules of the one-process world apply (docs/design.md): results are copied with kernels into
buffers allocated before the first push, and every rank synchronizes and meets at a barrier
after each selection below the gate (torch's top-k may allocate) and before host comparisons.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import (
    FORMATS,
    assert_scores,
    expected,
    for_rank,
    kernel_copy,
    needs_gpu,
    settle,
    unambiguous,
)

from cpindex import BadBlockTableError, CPIndexConfig, IndexCP, reference, testing
from cpindex.comm import Comm
from cpindex.world import in_turn, run_threads

pytestmark = [needs_gpu, pytest.mark.gpu]
DEV = "cuda:0"
W = 4
THRESHOLD = 64
TOPK = 16


def _cfg(fmt: str = "nvfp4", **kw) -> CPIndexConfig:
    base = dict(
        transport="ipc", cache_format=fmt, max_rows=32, max_query_len=4, max_width=64,
        max_topk=TOPK, cp_min_blocks=THRESHOLD, timeout_s=10.0,
    )  # fmt: skip
    return CPIndexConfig(**{**base, **kw})


def _problem(requests: int, width: int, fmt: str, t: int, seed: int) -> testing.Problem:
    """Ragged lengths up to ``width - 1`` blocks; ``width`` columns (the last ones -inf)."""
    p = testing.make_problem(requests, (width - 1) * 128, fmt, query_len=t, seed=seed)
    p.width = width
    return p.to(DEV)


def _device_calls(cp: IndexCP) -> torch.Tensor:
    """The push handshake's device call count (the first word of this rank's region)."""
    return cp._transport.engine.local[:8].view(torch.int64)


def _cases(fmt: str, t: int) -> list[tuple[testing.Problem, bool]]:
    """(problem, goes context-parallel) on either side of THRESHOLD, and at it."""
    sizes = [(2, 20), (2, 32), (4, 24)] if t == 1 else [(1, 40), (4, 16), (6, 20)]
    return [
        (_problem(r, w, fmt, t, seed=10 * i + t), r * w >= THRESHOLD)
        for i, (r, w) in enumerate(sizes)
    ]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t", [1, 4])
def test_both_sides_equal_the_reference_and_the_cp_path(fmt, t):
    cases = _cases(fmt, t)
    assert [cp for _, cp in cases] == [False, True, True]

    def body(comm: Comm):
        r = comm.rank
        with (
            IndexCP(_cfg(fmt), device=DEV, comm=comm) as gated,
            IndexCP(_cfg(fmt, cp_min_blocks=0), device=DEV, comm=comm) as always,
        ):
            out = []
            keep = []
            for p, _ in cases:
                hpr = gated.heads_per_rank
                keep.append(
                    {
                        k: (
                            torch.empty(hpr, p.rows, p.width, device=DEV),
                            torch.empty(hpr, p.rows, TOPK, dtype=torch.int32, device=DEV),
                            torch.empty(hpr, p.rows, TOPK, device=DEV),
                        )
                        for k in ("gated", "always")
                    }
                )
            settle(comm)  # every allocation done before the first push
            for (p, _), kept in zip(cases, keep, strict=True):
                q = p.rank_queries(r, W)
                for name, cp in (("gated", gated), ("always", always)):
                    s_, i_, v_ = kept[name]
                    plan = cp.plan(p.block_table, p.seq_lens, query_len=t, width=p.width)
                    args = (q, p.index_cache, plan)
                    scores = cp.score_push(*args)
                    kernel_copy(s_, scores)
                    scores.fill_(float("nan"))  # the next call must write what it returns
                    ids, vals = cp.select_blocks(*args, topk=TOPK, return_scores=True)
                    kernel_copy(i_, ids)
                    kernel_copy(v_, vals)
                    ids.fill_(-7)
                    settle(comm)  # a selection below the gate may allocate: nobody pushes now
            gated.check()
            always.check()
            for (p, _), kept in zip(cases, keep, strict=True):
                out.append(
                    {
                        "uses_cp": gated.uses_cp((p.requests, p.width)),
                        **{k: tuple(x.cpu() for x in v) for k, v in kept.items()},
                    }
                )
            return out

    res = run_threads(W, body, device=DEV)
    for rank in range(W):
        for (p, cp), got in zip(cases, res[rank], strict=True):
            where = f"rank {rank}, {p.requests} x {p.width}, T={t}"
            assert got["uses_cp"] == cp, where
            for a, b in zip(got["gated"], got["always"], strict=True):
                assert torch.equal(a, b), f"{where}: the gate's path differs from CP's"
            scores, ids, _ = got["gated"]
            assert_scores(scores, for_rank(expected(p, 0, 1), rank, W).cpu())
            ref = reference.select_blocks(
                p.q.cpu(), p.index_cache.cpu(), p.block_table.cpu(), p.seq_lens.cpu(),
                init_blocks=0, local_blocks=1, width=p.width, query_len=t, topk=TOPK,
            )  # fmt: skip
            ok = unambiguous(scores, TOPK)
            assert torch.equal(ids[ok], for_rank(ref, rank, W)[ok]), where


def test_below_the_gate_rank_0_calls_alone():
    """Rank 0 calls below the gate while the others wait at a barrier (a call that waited for
    them would time out); the handshake's device count does not move. Then the others make the
    same calls and a context-parallel call finds every rank in step. ``auto`` is 0 here."""
    small = _problem(2, 20, "nvfp4", 1, seed=3)
    big = _problem(4, 20, "nvfp4", 1, seed=4)

    def body(comm: Comm):
        r = comm.rank
        with IndexCP(_cfg(cp_min_blocks="auto"), device=DEV, comm=comm) as cp:
            auto = (cp.cp_min_blocks, cp.gate.source)
        with IndexCP(_cfg(), device=DEV, comm=comm) as cp:
            hpr = cp.heads_per_rank
            lone = torch.empty(hpr, small.rows, small.width, device=DEV)
            ids = torch.empty(hpr, small.rows, TOPK, dtype=torch.int32, device=DEV)
            after = torch.empty(hpr, big.rows, big.width, device=DEV)
            count = torch.empty(2, dtype=torch.int64, device=DEV)
            sargs = (
                small.rank_queries(r, W), small.index_cache,
                cp.plan(small.block_table, small.seq_lens, width=small.width),
            )  # fmt: skip
            settle(comm)

            def alone():
                kernel_copy(count[0:1], _device_calls(cp))
                kernel_copy(lone, cp.score_push(*sargs))
                kernel_copy(ids, cp.select_blocks(*sargs, topk=TOPK))
                kernel_copy(count[1:2], _device_calls(cp))
                torch.cuda.current_stream().synchronize()
                cp.check()

            if r == 0:
                alone()
                comm.barrier()
            else:
                comm.barrier()
                alone()
            settle(comm)
            bargs = (
                big.rank_queries(r, W), big.index_cache,
                cp.plan(big.block_table, big.seq_lens, width=big.width),
            )  # fmt: skip
            kernel_copy(after, cp.score_push(*bargs))
            settle(comm)
            cp.check()
            return auto, lone.cpu(), ids.cpu(), after.cpu(), count.cpu().tolist()

    res = run_threads(W, body, device=DEV)
    for rank, (auto, lone, ids, after, count) in enumerate(res):
        assert auto == (0, "shared device")
        assert count[0] == count[1], f"rank {rank}: a call below the gate moved the handshake"
        assert_scores(lone, for_rank(expected(small, 0, 1), rank, W).cpu())
        ok = unambiguous(lone, TOPK)
        assert torch.equal(ids[ok], for_rank(_select(small), rank, W)[ok])
        assert_scores(after, for_rank(expected(big, 0, 1), rank, W).cpu())


def _select(p: testing.Problem) -> torch.Tensor:
    return reference.select_blocks(
        p.q.cpu(), p.index_cache.cpu(), p.block_table.cpu(), p.seq_lens.cpu(), init_blocks=0,
        local_blocks=1, width=p.width, query_len=p.query_len, topk=TOPK,
    )  # fmt: skip


def test_a_bad_page_below_the_gate_is_that_ranks_own():
    """Rank 1 names a page outside the cache in a call below the gate: its next check raises
    BadBlockTableError naming rank 1 (not the local kernel's rank 0 of a world of one), once;
    every rank, rank 1 included, goes on with a context-parallel call."""
    small = _problem(2, 20, "fp8", 1, seed=5)
    big = _problem(4, 20, "fp8", 1, seed=6)
    bad_table = small.block_table.clone()
    bad_table[0, 0] = 1 << 30  # scanned (init_blocks 0), far past the cache

    def body(comm: Comm):
        r = comm.rank
        with IndexCP(_cfg("fp8"), device=DEV, comm=comm) as cp:
            after = torch.empty(cp.heads_per_rank, big.rows, big.width, device=DEV)
            table = bad_table if r == 1 else small.block_table
            q = small.rank_queries(r, W)
            settle(comm)
            cp.score_push(q, small.index_cache, cp.plan(table, small.seq_lens))
            torch.cuda.current_stream().synchronize()
            try:
                cp.check()
                first = None
            except BadBlockTableError as e:
                first = str(e)
            cp.check()  # raised once: cleared
            comm.barrier()
            bargs = (
                big.rank_queries(r, W), big.index_cache,
                cp.plan(big.block_table, big.seq_lens, width=big.width),
            )  # fmt: skip
            kernel_copy(after, cp.score_push(*bargs))
            settle(comm)
            cp.check()
            return first, after.cpu()

    res = run_threads(W, body, device=DEV)
    for rank, (first, after) in enumerate(res):
        if rank == 1:
            assert first is not None and first.startswith("rank 1: block_table row 0"), first
        else:
            assert first is None, (rank, first)
        assert_scores(after, for_rank(expected(big, 0, 1), rank, W).cpu())


def test_graph_replays_take_the_same_path():
    """One graph per rank holds a score_push and a select_blocks below the gate and a
    score_push above it; replays with q, lengths and tables changed in place equal the
    reference. A second graph holds only calls below the gate: rank 0 replays it alone,
    and the handshake's device count does not move."""
    fmt, n_var = "nvfp4", 3
    shapes = [(2, 20), (4, 24)]  # below, above
    base = [_problem(r, w, fmt, 1, seed=20 + i) for i, (r, w) in enumerate(shapes)]
    gen = torch.Generator().manual_seed(7)
    variants = []
    for v in range(n_var):
        vs = []
        for i, (r, w) in enumerate(shapes):
            q = testing.make_problem(r, (w - 1) * 128, fmt, seed=60 + 3 * v + i).q.to(DEV)
            lens = testing.random_lengths(r, (w - 1) * 128, gen).to(DEV)
            pages = base[i].index_cache.shape[0]
            table = torch.randint(0, pages, base[i].block_table.shape, generator=gen)
            vs.append(
                testing.Problem(q, base[i].index_cache, table.to(torch.int32).to(DEV), lens, w, fmt)
            )
        variants.append(vs)

    def body(comm: Comm):
        r = comm.rank
        with IndexCP(_cfg(fmt), device=DEV, comm=comm) as cp:
            st = [
                (p.rank_queries(r, W).clone(), p.block_table.clone(), p.seq_lens.clone())
                for p in base
            ]
            plans = [
                cp.plan(bt, sl, width=p.width) for (_, bt, sl), p in zip(st, base, strict=True)
            ]
            small, big = base
            paths = [cp.uses_cp(pl) for pl in plans]
            settle(comm)  # every rank's copies made before any push

            def calls():
                a = cp.score_push(st[0][0], small.index_cache, plans[0]).clone()
                ids = cp.select_blocks(st[0][0], small.index_cache, plans[0], topk=TOPK).clone()
                b = cp.score_push(st[1][0], big.index_cache, plans[1]).clone()
                return a, ids, b

            def gated_only():
                return cp.score_push(st[0][0], small.index_cache, plans[0]).clone()

            # Eager first, so the call images exist before the capture; settled between the
            # calls below the gate (the selection may allocate) and the push.
            cp.score_push(st[0][0], small.index_cache, plans[0])
            cp.select_blocks(st[0][0], small.index_cache, plans[0], topk=TOPK)
            settle(comm)
            cp.score_push(st[1][0], big.index_cache, plans[1])
            settle(comm)
            g, g_alone = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            outs: list = []
            alone: list = []

            def capture():  # one rank at a time: concurrent captures from threads fail
                with torch.cuda.graph(g, capture_error_mode="thread_local"):
                    outs.extend(calls())
                with torch.cuda.graph(g_alone, capture_error_mode="thread_local"):
                    alone.append(gated_only())

            in_turn(comm, capture)
            got = []
            for vs in variants:
                for (q, bt, sl), p in zip(st, vs, strict=True):
                    kernel_copy(q, p.rank_queries(r, W))
                    kernel_copy(bt, p.block_table)
                    kernel_copy(sl, p.seq_lens)
                for o in outs:
                    o.fill_(float("nan") if o.is_floating_point() else -7)
                for pl in plans:
                    pl.refresh()
                settle(comm)  # every rank's inputs in place before any push
                g.replay()
                settle(comm)
                got.append([o.cpu() for o in outs])
                comm.barrier()
            counts = []
            if r == 0:  # alone: the others are at the barrier below
                for _ in range(5):
                    counts.append(int(_device_calls(cp).cpu()))
                    alone[0].fill_(float("nan"))
                    g_alone.replay()
                    torch.cuda.current_stream().synchronize()
                counts.append(int(_device_calls(cp).cpu()))
            comm.barrier()
            cp.check()
            last = alone[0].cpu() if r == 0 else None
            g = g_alone = None  # freed before close: they hold the instance's buffers
            return paths, got, counts, last

    res = run_threads(W, body, device=DEV)
    for rank, (paths, got, counts, last) in enumerate(res):
        assert paths == [False, True]
        for vs, (a, ids, b) in zip(variants, got, strict=True):
            assert_scores(a, for_rank(expected(vs[0], 0, 1), rank, W).cpu())
            assert_scores(b, for_rank(expected(vs[1], 0, 1), rank, W).cpu())
            ok = unambiguous(a, TOPK)
            assert torch.equal(ids[ok], for_rank(_select(vs[0]), rank, W)[ok])
        if rank == 0:
            assert len(set(counts)) == 1, f"replays below the gate moved the handshake: {counts}"
            assert_scores(last, for_rank(expected(variants[-1][0], 0, 1), 0, W).cpu())
