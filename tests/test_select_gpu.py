"""``select_blocks`` on one GPU through the public API: the one-process W-rank world (one thread
and stream per rank), every transport that runs there, ``topk`` on both sides of what a
transport fuses (up to 16 on ``ipc``; larger goes through the default path).

The headline is graph replay: one graph per batch size, replayed 10,000 times in an order that
shrinks and grows the batch, with new lengths copied in before each replay and every output
poisoned first. A slot left over from an earlier, larger call must never be taken as fresh: each
replay must equal the eager call on the same inputs, bit for bit.

The rules of the one-process world (docs/design.md) shape these tests: results are copied with
kernels into buffers allocated before the first call, rank threads synchronize their stream
before blocking reads, and reductions or allocations wait until every rank met at a barrier.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import FORMATS, kernel_copy, needs_gpu, unambiguous

from cpindex import CPIndexConfig, IndexCP, reference, selection, testing
from cpindex.comm import Comm
from cpindex.world import in_turn, run_threads

pytestmark = [needs_gpu, pytest.mark.gpu]
DEV = "cuda:0"


def _world(world: int, fn, **cfg_kw):
    cfg = CPIndexConfig(**{"max_rows": 32, "max_width": 128, "max_topk": 64, **cfg_kw})

    def body(comm: Comm):
        with IndexCP(cfg, device=DEV, comm=comm) as cp:
            return fn(cp, comm)

    return run_threads(world, body, device=DEV)


def _cpu(prob: testing.Problem) -> tuple:
    cache = prob.index_cache
    cache = tuple(c.cpu() for c in cache) if isinstance(cache, tuple) else cache.cpu()
    return prob.q.cpu(), cache, prob.block_table.cpu(), prob.seq_lens.cpu()


def _problems(
    fmt: str, t: int, seed: int, lengths: list[list[int]], heads: int = 4
) -> list[testing.Problem]:
    out = []
    for i, lens in enumerate(lengths):
        p = testing.make_problem(
            len(lens), max(lens), fmt, num_heads=heads, query_len=t, seed=seed + i,
            lengths=torch.tensor(lens),
        )  # fmt: skip
        out.append(p.to(DEV))
    # exact ties: every block of the last problem's first request on one page
    out[-1].block_table[0] = out[-1].block_table[0, 0]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("world", "t", "heads"), [(2, 1, 4), (4, 4, 4), (4, 2, 2)])
@pytest.mark.parametrize("topk", [16, 64])
def test_transports_agree_and_match_the_scores_selection(fmt, world, t, heads, topk):
    """ipc and collective give the same ids and scores; both equal the selection of the same
    call's ``score_push`` scores, and the reference wherever it has no near-tie. Heads shared
    by two ranks (W = 4, H = 2) included."""
    lengths = [[100 * 128, t, 129], [7, 128 * 20, 128 * 90 + 5, 300, 2000, 128 * 16], [4000] * 3]
    lengths = [[max(x, t) for x in ls] for ls in lengths]
    probs = _problems(fmt, t, 10 * world + t, lengths, heads)

    def job(cp, comm):
        qs = [p.rank_queries(comm.rank, world) for p in probs]
        hpr = qs[0].shape[1]
        keep = [
            (
                torch.empty(hpr, p.rows, topk, dtype=torch.int32, device=DEV),
                torch.empty(hpr, p.rows, topk, device=DEV),
                torch.empty(hpr, p.rows, p.width, device=DEV),
            )
            for p in probs
        ]
        comm.barrier()  # every rank's allocations done before the first push
        for p, q, (ids, vals, full) in zip(probs, qs, keep, strict=True):
            plan = cp.plan(p.block_table, p.seq_lens, query_len=t, init_blocks=1, width=p.width)
            args = (q, p.index_cache, plan)
            got_ids, got_vals = cp.select_blocks(*args, topk=topk, return_scores=True)
            kernel_copy(ids, got_ids)
            kernel_copy(vals, got_vals)
            got_ids.fill_(-7)
            got_vals.fill_(float("nan"))
            kernel_copy(full, cp.score_push(*args))
        torch.cuda.current_stream().synchronize()
        comm.barrier()  # no push in flight anywhere: allocations are safe now
        return [tuple(x.cpu() for x in k) for k in keep]

    ipc = _world(world, job, transport="ipc", cache_format=fmt, num_heads=heads)
    coll = _world(world, job, transport="collective", cache_format=fmt, num_heads=heads)
    for rank in range(world):
        for p, (ids, vals, full), (c_ids, c_vals, _) in zip(
            probs, ipc[rank], coll[rank], strict=True
        ):
            assert torch.equal(ids, c_ids), f"rank {rank}: ipc and collective ids differ"
            assert torch.equal(vals, c_vals), f"rank {rank}: ipc and collective scores differ"
            want_ids = torch.empty_like(ids)
            want_vals = torch.empty_like(vals)
            selection.select(full, topk, want_ids, want_vals)
            assert torch.equal(ids, want_ids), f"rank {rank}: not the scores' selection"
            assert torch.equal(vals, want_vals)
            hpr = ids.shape[0]
            heads = [(rank * hpr + h) % p.q.shape[1] for h in range(hpr)]
            ref = reference.select_blocks(
                *_cpu(p), init_blocks=1, local_blocks=1, width=p.width, query_len=t, topk=topk
            )[heads]
            ok = unambiguous(full, topk)
            assert torch.equal(ids[ok], ref[ok]), f"rank {rank}: differs from the reference"


@pytest.mark.parametrize("topk", [16, 64])
def test_10k_graph_replays_batches_shrink_and_grow(topk):
    """One graph per batch size (requests 8, 1, 5, 2, 8 with longer rows), each holding one
    select_blocks call, replayed 10,000 times in a random order with one of three length sets
    copied in first; outputs are poisoned (ids -7, scores NaN) before every replay. Each replay
    is compared on the device with the eager call on the same inputs; nothing allocates in the
    loop."""
    fmt, t, world, replays, n_var = "nvfp4", 2, 4, 10_000, 3
    shapes = [(8, 40), (1, 12), (5, 64), (2, 3), (8, 64)]  # requests, blocks
    gen = torch.Generator().manual_seed(7)
    base = [
        testing.make_problem(r, b * 128, fmt, query_len=t, seed=20 + i, device=DEV)
        for i, (r, b) in enumerate(shapes)
    ]
    base[2].block_table[1] = base[2].block_table[1, 0]  # exact ties in one request
    lens = [
        [testing.random_lengths(r, b * 128, gen, min_len=t).to(DEV) for _ in range(n_var)]
        for r, b in shapes
    ]
    order = torch.randint(0, len(shapes), (replays,), generator=gen).tolist()
    variant = torch.randint(0, n_var, (replays,), generator=gen).tolist()

    def job(cp, comm):
        r = comm.rank
        st = [(p.rank_queries(r, world).clone(), p.seq_lens.clone()) for p in base]
        # one plan per shape over the captured tensors (lengths refilled in place)
        plans = [
            cp.plan(p.block_table, sl, query_len=t, width=p.width)
            for (_, sl), p in zip(st, base, strict=True)
        ]

        def call(g: int):
            q, p = st[g][0], base[g]
            return cp.select_blocks(q, p.index_cache, plans[g], topk=topk, return_scores=True)

        hpr = st[0][0].shape[1]
        want = [
            [
                (
                    torch.empty(hpr, p.rows, topk, dtype=torch.int32, device=DEV),
                    torch.empty(hpr, p.rows, topk, device=DEV),
                )
                for _ in range(n_var)
            ]
            for p in base
        ]
        comm.barrier()
        for g in range(len(shapes)):  # eager: the expected results (and the warm-up)
            for v in range(n_var):
                kernel_copy(st[g][1], lens[g][v])
                ids, vals = call(g)
                kernel_copy(want[g][v][0], ids)
                kernel_copy(want[g][v][1], vals)
        torch.cuda.current_stream().synchronize()
        comm.barrier()
        graphs = [torch.cuda.CUDAGraph() for _ in shapes]
        outs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def capture():  # one rank at a time: concurrent captures from threads fail
            for g, graph in enumerate(graphs):
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    outs.append(call(g))

        in_turn(comm, capture)
        diff_i = [torch.empty(o[0].shape, dtype=torch.bool, device=DEV) for o in outs]
        diff_v = [torch.empty(o[1].shape, dtype=torch.bool, device=DEV) for o in outs]
        seen = [torch.zeros(o[0].shape, dtype=torch.bool, device=DEV) for o in outs]
        torch.cuda.current_stream().synchronize()
        comm.barrier()
        for i in range(replays):
            g, v = order[i], variant[i]
            kernel_copy(st[g][1], lens[g][v])
            ids, vals = outs[g]
            ids.fill_(-7)
            vals.fill_(float("nan"))
            graphs[g].replay()
            torch.ne(ids, want[g][v][0], out=diff_i[g])
            torch.ne(vals, want[g][v][1], out=diff_v[g])  # NaN (unwritten) differs too
            seen[g].logical_or_(diff_i[g]).logical_or_(diff_v[g])
            if i % 50 == 49:  # bound the work in flight (a full queue blocks launches)
                torch.cuda.current_stream().synchronize()
        torch.cuda.current_stream().synchronize()  # releases the GIL; int() would hold it
        comm.barrier()  # no push in flight anywhere: reductions are safe now
        return [int(s.sum()) for s in seen], [[w[0].cpu() for w in ws] for ws in want]

    res = _world(world, job, max_topk=topk)
    for rank, (bad, want) in enumerate(res):
        assert bad == [0] * len(shapes), f"rank {rank}: replays differed from eager calls: {bad}"
        for g, p in enumerate(base):  # the eager results themselves, against the reference
            for v in range(n_var):
                q, cache, table, _ = _cpu(p)
                ref_lens = lens[g][v].cpu()
                kw = dict(init_blocks=0, local_blocks=1, width=p.width, query_len=t)
                ref = reference.select_blocks(q, cache, table, ref_lens, topk=topk, **kw)
                scores = reference.block_scores(q, cache, table, ref_lens, **kw)
                ok = unambiguous(scores[rank : rank + 1], topk)
                assert torch.equal(want[g][v][ok], ref[rank : rank + 1][ok])
