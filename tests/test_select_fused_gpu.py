"""``select_blocks`` through the fused kernel (``ipc``): one launch scores this rank's share,
keeps its top-k per (row, head), pushes the candidates to the head's owner and merges them.

Runs in the one-process world on one GPU (docs/design.md, its rules apply: results are copied
with kernels into buffers allocated before the first push, and compared after every rank has
synchronized and met at a barrier). The merged selection must equal, exactly, the selection of
the same call's full scores (``score_push`` then :func:`cpindex.selection.select`), and the
float64 reference's wherever the reference has no near-tie at the top-k boundary (the kernel's
scores differ from float64 in fp32 summation order only). One problem per case has exact ties
(neighbouring blocks read the same page). Graph replay of the fused path is covered by
tests/test_select.py (its tests marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from _gpu import FORMATS, force_warpgroup_mma, kernel_copy, needs_gpu, unambiguous

from cpindex import CPIndexConfig, IndexCP, reference, selection, testing
from cpindex.comm import Comm
from cpindex.kernels import structs
from cpindex.world import run_threads

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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("world", "t", "wg"), [(2, 1, 0), (4, 1, 0), (4, 4, 0), (4, 8, 0), (4, 8, 1)]
)
@pytest.mark.parametrize("topk", [1, 16, 32])
def test_fused_selection_matches_scores_and_reference(fmt, world, t, wg, topk, monkeypatch):
    if wg:  # T * H = 32: the warpgroup-mma instance as well as the launcher's choice
        force_warpgroup_mma(monkeypatch)
    probs = _problems(fmt, t, seed=world * 10 + t)

    def job(cp, comm):
        qs = [p.rank_queries(comm.rank, world) for p in probs]
        hpr = qs[0].shape[1]
        ids = [torch.empty(hpr, p.rows, topk, dtype=torch.int32, device=DEV) for p in probs]
        vals = [torch.empty(hpr, p.rows, topk, device=DEV) for p in probs]
        full = [torch.empty(hpr, p.rows, p.width, device=DEV) for p in probs]
        comm.barrier()
        for p, q, i_, v_, f_ in zip(probs, qs, ids, vals, full, strict=True):
            args = (
                q,
                p.index_cache,
                cp.plan(p.block_table, p.seq_lens, query_len=t, width=p.width),
            )
            got_ids, got_vals = cp.select_blocks(*args, topk=topk, return_scores=True)
            kernel_copy(i_, got_ids)
            kernel_copy(v_, got_vals)
            got_ids.fill_(-7)  # poison: the next call must write every slot it returns
            kernel_copy(f_, cp.score_push(*args))
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
            ok = unambiguous(f_.cpu(), topk)
            assert torch.equal(i_.cpu()[ok], ref[heads][ok]), f"rank {rank}: differs from reference"
