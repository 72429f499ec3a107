"""Below the CP gate, ``select_blocks`` selects in the fused kernel (``transports/local.py``):
bit for bit the context-parallel path's result and the contract's selection (§6).

The one-process world on one GPU, every rank of W = 2 (two heads per rank) and W = 4 (one;
and two ranks per head with H = 2), ``ipc`` and ``collective`` as the context-parallel path.
Every format, T = 1, 4 and 8, ragged lengths (rows with fewer blocks than ``topk``), a width
below ``topk``, forced blocks (``init_blocks``/``local_blocks``), exact ties (blocks that read
one page) and every ``topk`` from 1 to 16. Per call, the local path's ids and scores must equal:

* the context-parallel path's, bit for bit;
* the selection the contract defines, made here by a stable sort (§6: ties to the lower block
  id, ids ascending, ``-1`` and ``-inf`` padding) from the local path's own scores
  (``score_push`` below the gate, itself tested equal to the CP path's), bit for bit;
* the float64 reference's ids, wherever the k-th and (k+1)-th scores are apart by more than
  fp32 summation noise.

The rules of the one-process world apply (docs/design.md): every buffer a rank copies results
into is allocated before the first push of a case, and results are copied with kernels.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import FORMATS, kernel_copy, needs_gpu, settle, unambiguous

from cpindex import CPIndexConfig, IndexCP, partition, reference, testing
from cpindex.comm import Comm
from cpindex.world import run_threads

pytestmark = [needs_gpu, pytest.mark.gpu]
DEV = "cuda:0"
MAX_TOPK = 16
LOCAL_ALWAYS = 1 << 40  # cp_min_blocks no call reaches: every call below the gate

#: (requests, width, init_blocks, local_blocks): a width below topk, ragged rows, forcing, and
#: a width past two keys per lane (the kernel's selection by rounds rather than by counting).
SIZES = [(3, 7, 0, 1), (2, 40, 2, 1), (5, 21, 1, 2), (2, 150, 1, 1)]


def _cfg(fmt: str, transport: str, heads: int, **kw) -> CPIndexConfig:
    base = dict(
        transport=transport, cache_format=fmt, num_heads=heads, max_rows=5 * 8,
        max_query_len=8, max_width=160, max_topk=MAX_TOPK, timeout_s=20.0,
    )  # fmt: skip
    return CPIndexConfig(**{**base, **kw})


def _problems(fmt: str, t: int, heads: int) -> list[tuple[testing.Problem, int, int]]:
    out = []
    for i, (requests, width, init, local) in enumerate(SIZES):
        p = testing.make_problem(
            requests, (width - 1) * 128, fmt, query_len=t, num_heads=heads,
            seed=100 * t + 10 * i + heads,
        )  # fmt: skip
        p.width = width  # the last columns lie past every row: -inf
        if width >= 8:  # exact ties: blocks 4 and 6 read block 3's page (ties to the lower id)
            p.block_table[:, 4] = p.block_table[:, 3]
            p.block_table[:, 6] = p.block_table[:, 3]
        out.append((p.to(DEV), init, local))
    return out


def select_from(scores: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """§6's selection of float32 ``scores [..., width]``, obviously right: a stable sort by
    descending score keeps equal scores in ascending id order; ``-inf`` is never selected."""
    width = scores.shape[-1]
    k = min(topk, width)
    order = torch.sort(-scores, dim=-1, stable=True).indices[..., :k]
    vals = scores.gather(-1, order)
    ids, perm = torch.where(vals > float("-inf"), order, width).sort(dim=-1, stable=True)
    vals = torch.where(ids == width, float("-inf"), vals.gather(-1, perm))
    ids = torch.where(ids == width, -1, ids)
    pad = topk - k
    ids = torch.nn.functional.pad(ids, (0, pad), value=-1).to(torch.int32)
    vals = torch.nn.functional.pad(vals, (0, pad), value=float("-inf"))
    return ids, vals


def _run(fmt: str, t: int, world: int, heads: int, transport: str) -> list:
    probs = _problems(fmt, t, heads)

    def body(comm: Comm):
        r = comm.rank
        with (
            IndexCP(_cfg(fmt, transport, heads, cp_min_blocks=LOCAL_ALWAYS), device=DEV,
                    comm=comm) as local,
            IndexCP(_cfg(fmt, transport, heads, cp_min_blocks=0), device=DEV, comm=comm) as cp,
        ):  # fmt: skip
            hpr = local.heads_per_rank
            out = []
            for p, init, lb in probs:
                plan_l = local.plan(
                    p.block_table, p.seq_lens, query_len=t, init_blocks=init, local_blocks=lb,
                    width=p.width,
                )  # fmt: skip
                plan_c = cp.plan(
                    p.block_table, p.seq_lens, query_len=t, init_blocks=init, local_blocks=lb,
                    width=p.width,
                )  # fmt: skip
                assert not local.uses_cp(plan_l) and cp.uses_cp(plan_c)
                iq = p.rank_queries(r, world)
                shape = (MAX_TOPK, hpr, p.rows, MAX_TOPK)
                kept = {
                    name: (
                        torch.full(shape, -9, dtype=torch.int32, device=DEV),
                        torch.full(shape, float("nan"), device=DEV),
                    )
                    for name in ("local", "cp")
                }
                scores = torch.empty(hpr, p.rows, p.width, device=DEV)
                settle(comm)  # every allocation done before the first push
                kernel_copy(scores, local.score_push(iq, p.index_cache, plan_l))
                # Every local call, then every pushed one, a host barrier between: a local
                # kernel need not fit beside a peer's spinning push on a shared GPU
                # (docs/design.md, the one-process world, rule 5).
                for name, inst, plan in (("local", local, plan_l), ("cp", cp, plan_c)):
                    for k in range(1, MAX_TOPK + 1):
                        ids, vals = inst.select_blocks(
                            iq, p.index_cache, plan, topk=k, return_scores=True, tag=k
                        )
                        kernel_copy(kept[name][0][k - 1, ..., :k], ids)
                        kernel_copy(kept[name][1][k - 1, ..., :k], vals)
                        ids.fill_(-7)  # the next call must write what it returns
                        vals.fill_(float("nan"))
                    settle(comm)
                local.check()
                cp.check()
                out.append(
                    {
                        "scores": scores.cpu(),
                        **{n: (a.cpu(), b.cpu()) for n, (a, b) in kept.items()},
                    }
                )
                comm.barrier()
            return out

    res = run_threads(world, body, device=DEV)
    return [(probs, res[rank]) for rank in range(world)]


def _check(results: list, world: int, t: int) -> None:
    for rank, (probs, got) in enumerate(results):
        for (p, init, lb), g in zip(probs, got, strict=True):
            where = f"rank {rank}/{world}, {p.requests} x {p.width}, T={t}, init {init} local {lb}"
            heads = partition.heads_of_rank(rank, p.q.shape[1], world)
            cache = p.index_cache
            cache = tuple(x.cpu() for x in cache) if isinstance(cache, tuple) else cache.cpu()
            ref_scores = reference.block_scores(
                p.q.cpu(), cache, p.block_table.cpu(), p.seq_lens.cpu(), init_blocks=init,
                local_blocks=lb, width=p.width, query_len=t,
            )[heads]  # fmt: skip
            for k in range(1, MAX_TOPK + 1):
                at = f"{where}, topk {k}"
                ids, vals = g["local"][0][k - 1, ..., :k], g["local"][1][k - 1, ..., :k]
                assert torch.equal(ids, g["cp"][0][k - 1, ..., :k]), f"{at}: ids differ from CP"
                assert torch.equal(vals, g["cp"][1][k - 1, ..., :k]), f"{at}: scores differ"
                # bit for bit, -0.0 included (the keys make -0.0 into +0.0 on both paths)
                want_ids, want_vals = select_from(g["scores"], k)
                assert torch.equal(ids, want_ids), f"{at}: ids differ from §6's selection"
                assert torch.equal(vals.view(torch.int32), (want_vals + 0.0).view(torch.int32)), at
                ok = unambiguous(g["scores"], k)
                ref_ids = select_from(ref_scores, k)[0]
                assert torch.equal(ids[ok], ref_ids[ok]), f"{at}: ids differ from the reference"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t", [1, 4, 8])
@pytest.mark.parametrize("world", [2, 4])
def test_local_fused_selection_is_the_cp_paths_and_the_contracts(fmt, t, world):
    _check(_run(fmt, t, world, 4, "ipc"), world, t)


def test_replicated_heads_and_the_collective_path():
    """H = 2 on W = 4 (ranks r and r + 2 own head r): the local path selects for the one head
    a rank holds; the collective transport's CP path gives the same."""
    for transport in ("collective", "ipc"):
        _check(_run("nvfp4", 4, 4, 2, transport), 4, 4)
