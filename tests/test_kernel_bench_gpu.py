"""`python -m cpindex bench --kernel` on a GPU: the full scan and rank 0's share of W.

The timings are not checked (speed is measured, not asserted); what is: the share scores the
reference's owned columns, each row reads the bytes it claims, and the Triton scorer agrees with
the fused kernel on the same share.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import assert_scores, expected, needs_gpu

from cpindex import partition, testing
from cpindex.bench import kernel_sweep

pytestmark = [needs_gpu, pytest.mark.gpu]


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("world", [2, 4])
def test_share_scorer_is_rank0s_columns(fmt, world):
    prob = testing.make_problem(5, 3000, fmt, seed=world, device="cuda", query_len=4)
    out = torch.full(
        (4, prob.rows, partition.shard_width(prob.width, world)), float("nan"), device="cuda"
    )
    share = kernel_sweep.share_scorer(torch.device("cuda", 0), fmt, world)
    got = share(prob.q, prob.index_cache, prob.block_table, prob.seq_lens, out, prob.width, 4)
    torch.cuda.synchronize()
    want = expected(prob, 0, 1)[:, :, partition.owned_columns(0, world, prob.width).cuda()]
    assert_scores(got, want)


@pytest.mark.parametrize("world", [1, 4])
def test_kernel_sweep_rows(world):
    res = kernel_sweep.run(["bf16", "fp8"], [3], [4096], iters=2, query_lens=[1, 4], world=world)
    assert res["world"] == world and len(res["kernel"]) == 4
    blocks = 4096 // 128
    for r in res["kernel"]:
        page = 128 * (256 if r["format"] == "bf16" else 128)
        owned = len(range(0, blocks - 1, world))  # rank 0's blocks but the forced last one
        assert r["world"] == world and r["bytes"] == 3 * owned * page
        assert r["kernel_ms"] > 0 and r.get("triton_agrees", True)
    assert "rank 0's share" in kernel_sweep.table(res) or world == 1
