"""``select_blocks`` through the fused kernel (``ipc``): one launch scores this rank's share,
keeps its top-k per (row, head), pushes the candidates to the head's owner and merges them.

Runs in the one-process world on one GPU (docs/design.md, its rules apply: results are copied
with kernels into buffers allocated before the first push, and compared after every rank has
synchronized and met at a barrier). The merged selection must equal, exactly, the selection of
the same call's full scores (``score_push`` then :func:`cpindex.selection.select`), and the
float64 reference's wherever the reference has no near-tie at the top-k boundary (the kernel's
scores differ from float64 in fp32 summation order only).
"""

from __future__ import annotations

import pytest
import torch
from _gpu import FORMATS, kernel_copy, needs_gpu

from cpindex import CPIndexConfig, IndexCP, reference, selection, testing
from cpindex.kernels import structs
from cpindex.world import Comm, in_turn, run_threads

pytestmark = [needs_gpu, pytest.mark.gpu]
DEV = "cuda:0"


def _world(world: int, fn, **cfg_kw):
    cfg = CPIndexConfig(**{"max_rows": 32, "max_width": 256, "max_topk": 32, **cfg_kw})

    def body(comm: Comm):
        with IndexCP(cfg, device=DEV, comm=comm) as cp:
            return fn(cp, comm)

    return run_threads(world, body, device=DEV)


def _problems(fmt: str, t: int, seed: int, n: int = 4):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        requests = (
            [1, 32 // t][i] if i < 2 else int(torch.randint(1, 32 // t + 1, (1,), generator=gen))
        )
        max_len = int(torch.randint(t, 200 * 128, (1,), generator=gen))
        p = testing.make_problem(requests, max_len, fmt, query_len=t, seed=seed * 10 + i)
        if i == 3:  # ties: every other block reads the same page as its neighbour
            p.block_table[:, 1::2] = p.block_table[:, 0:-1:2][:, : p.block_table[:, 1::2].shape[1]]
        out.append(p.to(DEV))
    return out


def _unambiguous(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th best finite scores differ by more than fp32 summation noise."""
    top = scores.double().nan_to_num(neginf=-1e300).topk(min(k + 1, scores.shape[-1]), -1).values
    if top.shape[-1] <= k:
        return torch.ones(scores.shape[:-1], dtype=torch.bool)
    scale = scores.double().abs().nan_to_num(posinf=0, neginf=0).clamp(max=1e3).amax(-1)
    return (top[..., k - 1] - top[..., k]).abs() > 1e-4 * scale.clamp(min=1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("world", "t"), [(2, 1), (4, 1), (4, 4)])
@pytest.mark.parametrize("topk", [1, 16, 32])
def test_fused_selection_matches_scores_and_reference(fmt, world, t, topk):
    probs = _problems(fmt, t, seed=world * 10 + t)

    def job(cp, comm):
        qs = [p.rank_queries(comm.rank, world) for p in probs]
        hpr = qs[0].shape[1]
        ids = [torch.empty(hpr, p.rows, topk, dtype=torch.int32, device=DEV) for p in probs]
        vals = [torch.empty(hpr, p.rows, topk, device=DEV) for p in probs]
        full = [torch.empty(hpr, p.rows, p.width, device=DEV) for p in probs]
        comm.barrier()
        for p, q, i_, v_, f_ in zip(probs, qs, ids, vals, full, strict=True):
            args = (q, p.index_cache, p.block_table, p.seq_lens, 0, 1, p.width)
            got_ids, got_vals = cp.select_blocks(*args, query_len=t, topk=topk, return_scores=True)
            kernel_copy(i_, got_ids)
            kernel_copy(v_, got_vals)
            got_ids.fill_(-7)  # poison: the next call must write every slot it returns
            kernel_copy(f_, cp.score_push(*args, query_len=t))
        torch.cuda.current_stream().synchronize()
        comm.barrier()  # no push in flight anywhere: torch ops may allocate now
        return cp.exchange_bytes(probs[0].rows, probs[0].width, topk), ids, vals, full

    res = _world(world, job, transport="ipc", cache_format=fmt)
    for rank, (nbytes, ids, vals, full) in enumerate(res):
        if topk <= structs.MAX_FUSED_TOPK:  # candidates only: independent of width
            assert nbytes == (world - 1) * ids[0].shape[0] * probs[0].rows * topk * 8
        for p, i_, v_, f_ in zip(probs, ids, vals, full, strict=True):
            want_i = torch.empty_like(i_)
            want_v = torch.empty_like(v_)
            selection.select(f_, topk, want_i, want_v)
            assert torch.equal(i_, want_i), f"rank {rank}: ids differ from the scores' selection"
            assert torch.equal(v_, want_v), f"rank {rank}: scores differ"
            ref = reference.select_blocks(
                p.q.cpu(), tuple(x.cpu() for x in p.index_cache)
                if isinstance(p.index_cache, tuple) else p.index_cache.cpu(),
                p.block_table.cpu(), p.seq_lens.cpu(), init_blocks=0, local_blocks=1,
                width=p.width, query_len=t, topk=topk,
            )  # fmt: skip
            heads = list(range(rank * i_.shape[0], (rank + 1) * i_.shape[0]))
            heads = [h % ref.shape[0] for h in heads]
            ok = _unambiguous(f_.cpu(), topk)
            assert torch.equal(i_.cpu()[ok], ref[heads][ok]), f"rank {rank}: differs from reference"


def test_fused_selection_under_graph_replay_batches_shrink_and_grow():
    """Three select_blocks calls of different row counts in one graph, replayed with new
    lengths; the id buffer is poisoned before every replay. A slot left over from a larger
    call is never taken as fresh: every replay equals the eager selection of new scores."""
    fmt, t, topk, replays = "nvfp4", 2, 16, 300
    shapes = [(8, 40), (1, 12), (5, 64)]  # requests, blocks: large, small, medium
    gen = torch.Generator().manual_seed(4)
    base = [
        testing.make_problem(r, b * 128, fmt, query_len=t, seed=i, device=DEV)
        for i, (r, b) in enumerate(shapes)
    ]
    lens = [
        [testing.random_lengths(r, b * 128, gen, min_len=t).to(DEV) for _ in range(3)]
        for r, b in shapes
    ]

    def job(cp, comm):
        r = comm.rank
        st = [(p.rank_queries(r, 4).clone(), p.seq_lens.clone()) for p in base]
        for (q, sl), p in zip(st, base, strict=True):  # warm up outside capture
            cp.select_blocks(q, p.index_cache, p.block_table, sl, 0, 1, p.width, query_len=t)
        torch.cuda.current_stream().synchronize()
        comm.barrier()
        g = torch.cuda.CUDAGraph()
        outs: list[torch.Tensor] = []

        def capture():
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                for (q, sl), p in zip(st, base, strict=True):
                    outs.append(
                        cp.select_blocks(
                            q, p.index_cache, p.block_table, sl, 0, 1, p.width, query_len=t
                        )
                    )

        in_turn(comm, capture)
        kept = [[torch.empty_like(o) for o in outs] for _ in range(3)]
        diff = [torch.empty(o.shape, dtype=torch.bool, device=DEV) for o in outs]
        seen = [torch.zeros(o.shape, dtype=torch.bool, device=DEV) for o in outs]
        comm.barrier()
        for i in range(replays):
            v = i % 3
            for (_, sl), ls in zip(st, lens, strict=True):
                kernel_copy(sl, ls[v])
            for o in outs:
                o.fill_(-7)
            g.replay()
            for o, k, d, s_ in zip(outs, kept[v], diff, seen, strict=True):
                if i < 3:
                    kernel_copy(k, o)
                else:  # the same inputs again: the same selection, every slot written
                    torch.ne(o, k, out=d)
                    s_.logical_or_(d)
            if i % 30 == 29:  # bound the work in flight
                torch.cuda.current_stream().synchronize()
        torch.cuda.current_stream().synchronize()
        comm.barrier()
        return kept, [int(s_.sum()) for s_ in seen]

    res = _world(4, job, transport="ipc", max_topk=16)
    for rank, (kept, changed) in enumerate(res):
        assert changed == [0, 0, 0], f"rank {rank}: replays disagreed with the first ones"
        for v in range(3):
            for p, got, ls in zip(base, kept[v], lens, strict=True):
                assert not bool((got == -7).any()), "an id slot was not written"
                p2 = testing.Problem(p.q, p.index_cache, p.block_table, ls[v], p.width, fmt, t)
                want = reference.select_blocks(
                    p2.q.cpu(), p2.index_cache.cpu(), p2.block_table.cpu(), p2.seq_lens.cpu(),
                    init_blocks=0, local_blocks=1, width=p2.width, query_len=t, topk=topk,
                )[rank : rank + 1]  # fmt: skip
                scores = reference.block_scores(
                    p2.q.cpu(), p2.index_cache.cpu(), p2.block_table.cpu(), p2.seq_lens.cpu(),
                    init_blocks=0, local_blocks=1, width=p2.width, query_len=t,
                )[rank : rank + 1]  # fmt: skip
                ok = _unambiguous(scores, topk)
                assert torch.equal(got.cpu()[ok], want[ok])
