"""The ``collective`` transport's trailer stamp and its per-size views, on the CPU.

On a GPU each rank's slot of the gathered queries ends in a trailer (the plan's fingerprint and,
with replicated heads, a hash of its queries) that the scoring kernel compares
(tests/test_collective_agreement_gpu.py). Here: what the stamp writes, and that the views cached
per call size never serve another size.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import for_rank

from cpindex import CPIndexConfig, IndexCP, fingerprint, reference, testing
from cpindex.comm import Comm
from cpindex.transports.collective import DeviceAgreement
from cpindex.world import run_threads


def test_stamp_writes_queries_fingerprint_and_hash():
    iq = torch.arange(64, dtype=torch.int16).view(2, 32)
    fp = torch.tensor([-3], dtype=torch.int64)
    for heads, want_hash in ((4, None), (2, int(fingerprint.query_hash(iq)))):
        slot = torch.full((128 + 16,), 0xAB, dtype=torch.uint8)
        DeviceAgreement(4, 1, heads, torch.device("cpu"), 256).stamp(slot, iq, fp)
        assert torch.equal(slot[:128], iq.view(-1).view(torch.uint8))
        assert int(slot[128:136].view(torch.int64)) == -3
        if want_hash is None:  # no replicas: the hash word is not written (nor compared)
            assert slot[136:].tolist() == [0xAB] * 8
        else:
            assert int(slot[136:].view(torch.int64)) == want_hash


def test_the_verdict_mask_is_the_state_words_low_byte():
    a = DeviceAgreement(2, 0, 4, torch.device("cpu"), 256)
    assert not bool(a.bad)
    a.state[1] = 1  # what the kernel writes for a call whose ranks disagree
    assert bool(a.bad)
    a.reset()
    assert a.state.tolist() == [0, 0] and not bool(a.bad)


# ---- per-size views ------------------------------------------------------------------------

MAX_ROWS, MAX_WIDTH = 8, 40


def _prob(heads: int, rows: int = 3, max_len: int = 12 * 128, seed: int = 50) -> testing.Problem:
    return testing.make_problem(rows, max_len, "fp8", num_heads=heads, seed=seed)


#: (rows, extra width): widths W divides, does not divide, and below W; the cached views of
#: one size must never serve another.
SIZES = [(3, 0), (5, 3), (3, 1), (8, 0), (2, 0), (5, 3)]


def _sizes(comm: Comm, heads: int) -> list[tuple[torch.Tensor, ...]]:
    rank, w = comm.rank, comm.world_size
    cfg = CPIndexConfig(
        transport="collective", cache_format="fp8", num_heads=heads, max_rows=MAX_ROWS,
        max_width=MAX_WIDTH, cp_min_blocks=0, timeout_s=10.0,
    )  # fmt: skip
    outs = []
    with IndexCP(cfg, device="cpu", comm=comm) as cp:
        for i, (rows, extra) in enumerate(SIZES):
            p = _prob(heads, rows, 128 * (1 + 7 * (i % 3)), seed=i)
            width = p.width + extra
            q = p.rank_queries(rank, w)
            plan = cp.plan(p.block_table, p.seq_lens, width=width)
            scores = cp.score_push(q, p.index_cache, plan, tag=i).clone()
            ids, vals = cp.select_blocks(q, p.index_cache, plan, topk=4, return_scores=True)
            outs.append((scores, ids.clone(), vals.clone()))
        cp.check()
    return outs


@pytest.mark.parametrize(("world", "heads"), [(1, 4), (2, 4), (4, 4), (4, 2)])
def test_sizes_change_between_calls(world, heads):
    results = run_threads(world, lambda comm: _sizes(comm, heads))
    for i, (rows, extra) in enumerate(SIZES):
        p = _prob(heads, rows, 128 * (1 + 7 * (i % 3)), seed=i)
        width = p.width + extra
        args = (p.q, p.index_cache, p.block_table, p.seq_lens)
        kw = dict(init_blocks=0, local_blocks=1, width=width, sm_scale=128**-0.5)
        want = reference.block_scores(*args, **kw).float()
        want_ids, want_vals = reference.select_blocks(*args, topk=4, return_scores=True, **kw)
        for rank, outs in enumerate(results):
            scores, ids, vals = outs[i]
            assert torch.equal(scores, for_rank(want, rank, world)), (i, rank)
            assert torch.equal(ids, for_rank(want_ids, rank, world)), (i, rank)
            assert torch.equal(vals, for_rank(want_vals.float(), rank, world)), (i, rank)
