"""A few launches of the fused kernel alone, for a profiler to look at (docs/kernel.md):

    ncu --clock-control none -k regex:score_kernel --launch-skip 3 --launch-count 1 \\
        python benchmarks/profile_kernel.py nvfp4 32 131072 [QUERY_LEN]

REQUESTS requests of CONTEXT tokens each, QUERY_LEN (default 1) query rows per request, 4 heads.
"""

from __future__ import annotations

import sys

import torch

from cpindex import ops
from cpindex.bench.timing import synthetic_cache, synthetic_queries


def main() -> None:
    if len(sys.argv) not in (4, 5):
        sys.exit("usage: profile_kernel.py FORMAT REQUESTS CONTEXT [QUERY_LEN]")
    fmt, requests, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    query_len = int(sys.argv[4]) if len(sys.argv) == 5 else 1
    dev = torch.device("cuda", 0)
    blocks = ctx // 128
    cache = synthetic_cache(requests * blocks, fmt, dev)
    table = torch.arange(requests * blocks, device=dev, dtype=torch.int32).view(requests, blocks)
    lens = torch.full((requests,), ctx, dtype=torch.int32, device=dev)
    q = synthetic_queries(requests * query_len, 4, fmt, dev)
    for _ in range(6):
        ops.block_scores(q, cache, table, lens, width=blocks, query_len=query_len)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
