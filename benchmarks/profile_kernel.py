"""A few launches of the fused kernel alone, for a profiler to look at (docs/kernel.md):

    ncu --clock-control none -k regex:scores?_kernel --launch-skip 3 --launch-count 1 \\
        python benchmarks/profile_kernel.py nvfp4 32 131072 [QUERY_LEN [WORLD]]

REQUESTS requests of CONTEXT tokens each, QUERY_LEN (default 1) query rows per request, 4 heads.
Every block of every request, or with WORLD > 1 rank 0's share of WORLD (blocks 0, W, 2W, ...),
as ``python -m cpindex bench --kernel --world W`` times it. FORMAT ``triton`` runs the Triton
bf16 scorer the benchmarks compare against on the same problem.
"""

from __future__ import annotations

import sys

import torch

from cpindex import ops, partition
from cpindex.bench.kernel_sweep import SM_SCALE, share_scorer
from cpindex.bench.timing import synthetic_cache, synthetic_queries
from cpindex.bench.triton_baseline import triton_block_scores


def main() -> None:
    if len(sys.argv) not in (4, 5, 6):
        sys.exit("usage: profile_kernel.py FORMAT REQUESTS CONTEXT [QUERY_LEN [WORLD]]")
    fmt, requests, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    query_len = int(sys.argv[4]) if len(sys.argv) >= 5 else 1
    world = int(sys.argv[5]) if len(sys.argv) == 6 else 1
    dev = torch.device("cuda", 0)
    triton = fmt == "triton"
    fmt = "bf16" if triton else fmt
    blocks = ctx // 128
    cache = synthetic_cache(requests * blocks, fmt, dev)
    table = torch.arange(requests * blocks, device=dev, dtype=torch.int32).view(requests, blocks)
    lens = torch.full((requests,), ctx, dtype=torch.int32, device=dev)
    q = synthetic_queries(requests * query_len, 4, fmt, dev)
    if triton:
        for _ in range(6):
            triton_block_scores(
                q, cache, table, lens, init_blocks=0, local_blocks=1, width=blocks,
                sm_scale=SM_SCALE, query_len=query_len, world=world,
            )  # fmt: skip
    elif world > 1:
        share = share_scorer(dev, fmt, world)
        cols = partition.blocks_owned(blocks, 0, world)
        out = torch.empty(4, requests * query_len, cols, device=dev)
        for _ in range(6):
            share(q, cache, table, lens, out, blocks, query_len)
    else:
        for _ in range(6):
            ops.block_scores(q, cache, table, lens, width=blocks, query_len=query_len)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
