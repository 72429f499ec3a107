"""Read-bandwidth ceilings of this GPU, beside the device-to-device copy bandwidth: bytes read
per second by ``torch.sum``, ``torch.amax`` and a plain Triton streaming read over 512 MiB of
bf16 (CUDA graph replays). What a memory-bound scorer can reach (docs/BENCHMARKS.md)::

    python benchmarks/read_ceiling.py [OUT.json]
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from cpindex.bench.timing import copy_bandwidth_gbs, time_graph

NBYTES = 512 << 20
# (elements per program step, steps per program, warps): the best of these is the ceiling
TRITON_CONFIGS = ((4096, 8, 4), (8192, 4, 8), (2048, 16, 4), (4096, 32, 8))


@triton.jit
def _read(x_ptr, o_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        acc = tl.maximum(
            acc, tl.load(x_ptr + base + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
        )
    tl.store(o_ptr + tl.program_id(0), tl.max(acc, 0))


def main() -> None:
    dev = torch.device("cuda", 0)
    x = torch.randn(NBYTES // 2, device=dev, dtype=torch.bfloat16)

    def gbs(fn) -> float:
        return NBYTES / (statistics.median(time_graph(lambda i: fn(), 8, 20, 2)) * 1e-3) / 1e9

    res = {"copy_gbs": copy_bandwidth_gbs(dev), "torch_sum_gbs": gbs(x.sum),
           "torch_amax_gbs": gbs(x.amax)}  # fmt: skip
    for block, iters, warps in TRITON_CONFIGS:
        grid = (x.numel() // (block * iters),)
        o = torch.empty(grid[0], device=dev)
        res[f"triton_read_{block}x{iters}_w{warps}_gbs"] = gbs(
            lambda: _read[grid](x, o, BLOCK=block, ITERS=iters, num_warps=warps)  # noqa: B023
        )
    print(json.dumps(res, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
