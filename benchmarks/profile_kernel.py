"""A few launches of the fused kernel alone, for a profiler to look at (docs/kernel.md):

    ncu --clock-control none -k regex:score_kernel --launch-skip 3 --launch-count 1 \\
        python benchmarks/profile_kernel.py nvfp4 32 131072
"""

from __future__ import annotations

import sys

import torch

from cpindex import ops  # noqa: F401  (registers torch.ops.cpindex.*)
from cpindex.bench.timing import synthetic_cache, synthetic_queries


def main() -> None:
    fmt, rows, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dev = torch.device("cuda", 0)
    blocks = ctx // 128
    cache = synthetic_cache(rows * blocks, fmt, dev)
    table = torch.arange(rows * blocks, device=dev, dtype=torch.int32).view(rows, blocks)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    q = synthetic_queries(rows, 4, fmt, dev)
    for _ in range(6):
        torch.ops.cpindex.block_scores(q, cache, None, table, lens, 0, 1, blocks, 128**-0.5)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
