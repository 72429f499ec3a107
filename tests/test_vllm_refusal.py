"""The drop-in's own argument checks (``grid``, rows not ``requests * T``, ``T`` past
``max_query_len``) are this rank's refusal of its call: with one rank refusing and its peer
calling correctly, both raise at once (never a peer left to wait out ``timeout_s``), and a
``reset()`` on both brings exact results back."""

from __future__ import annotations

import time

import pytest
import torch

from cpindex import reference, testing
from cpindex import vllm as dropin
from cpindex.errors import CPIndexError
from cpindex.world import run_threads


@pytest.mark.parametrize("bad", ["grid", "rows"])
def test_one_rank_refusing_makes_both_raise_at_once(bad, monkeypatch):
    monkeypatch.setenv("CPINDEX_TIMEOUT_S", "20")
    monkeypatch.setenv("CPINDEX_CACHE_FORMAT", "fp8")
    prob = testing.make_problem(3, 900, "fp8", query_len=2, num_heads=2, seed=5, width=8)

    def body(comm):
        cp = dropin.IndexCP(comm.rank, None, "cpu", 8, 8, comm=comm)
        iq = prob.rank_queries(comm.rank, 2)
        args = (prob.index_cache, prob.block_table, prob.seq_lens, 0, 1, prob.width)
        t0 = time.monotonic()
        try:
            if comm.rank == 1 and bad == "grid":
                cp.score_push(iq, *args, -1)
            else:
                cp.score_push(iq[:-1] if comm.rank == 1 else iq, *args)
            got = None
        except (CPIndexError, ValueError) as e:
            got = type(e).__name__
        took = time.monotonic() - t0
        cp.cp.reset()
        out = cp.score_push(iq, *args).clone()
        cp.close()
        return got, took, out

    res = run_threads(2, body)
    assert [r[0] for r in res] == ["OutOfStepError", "ValueError"]
    assert all(r[1] < 5 for r in res), [r[1] for r in res]
    want = reference.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, init_blocks=0,
        local_blocks=1, width=prob.width, query_len=2,
    )  # fmt: skip
    for rank, (_, _, out) in enumerate(res):
        torch.testing.assert_close(out[0], want[rank], rtol=0, atol=0)
