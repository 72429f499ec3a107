"""How many bytes in flight per SM the bf16 and fp8 page streams should keep (docs/kernel.md,
"Where the time goes"): full scans timed with the persistent grid sized by each value of
``launcher.RING_BYTES_PER_SM`` (0: every CTA that fits), the Triton scorer beside bf16.

    python benchmarks/inflight_sweep.py [KIB ...]      (default: 0 24 48 96)

Prints one line per (format, shape, T): microseconds per call for each value (CUDA graph of
4 calls, median of 15 replays), the kernel's GB/s at the best one, and the copy bandwidth
measured in the same run.
"""

from __future__ import annotations

import statistics
import sys

import torch

from cpindex import ops
from cpindex.bench.timing import copy_bandwidth_gbs, synthetic_cache, synthetic_queries, time_graph
from cpindex.kernels import launcher

SHAPES = [(8, 32768), (32, 32768), (8, 131072), (32, 131072)]  # requests, context


def main() -> None:
    values = [int(v) * 1024 for v in sys.argv[1:]] or [0, 24 * 1024, 48 * 1024, 96 * 1024]
    dev = torch.device("cuda", 0)
    try:
        from cpindex.bench.triton_baseline import triton_block_scores
    except Exception:  # triton missing: no column
        triton_block_scores = None
    copy = copy_bandwidth_gbs(dev)
    print(f"{torch.cuda.get_device_name(dev)}; copy {copy:.0f} GB/s; RING_BYTES_PER_SM (KiB): "
          + " ".join(str(v // 1024) for v in values))  # fmt: skip
    for fmt in ("bf16", "fp8"):
        for requests, ctx in SHAPES:
            sweep(fmt, requests, ctx, values, copy, triton_block_scores if fmt == "bf16" else None)
            torch.cuda.empty_cache()


def sweep(fmt: str, requests: int, ctx: int, values: list[int], copy: float, peer_fn) -> None:
    """One line per T of ``requests`` full scans of ``ctx`` tokens."""
    dev = torch.device("cuda", 0)
    blocks = ctx // 128
    cache = synthetic_cache(requests * blocks, fmt, dev)
    table = torch.arange(requests * blocks, device=dev, dtype=torch.int32).view(requests, blocks)
    lens = torch.full((requests,), ctx, dtype=torch.int32, device=dev)
    nbytes = cache.numel() * cache.element_size()
    for t in (1, 4, 8):
        q = synthetic_queries(requests * t, 4, fmt, dev)
        out = torch.empty(4, requests * t, blocks, device=dev)

        def call(i, q=q, t=t):
            ops.block_scores(q, cache, table, lens, width=blocks, query_len=t)

        def peer(i, q=q, t=t, out=out):
            peer_fn(
                q, cache, table, lens, init_blocks=0, local_blocks=1, width=blocks,
                sm_scale=128**-0.5, out=out, query_len=t,
            )  # fmt: skip

        times = []
        for v in values:
            launcher.RING_BYTES_PER_SM = v
            times.append(statistics.median(time_graph(call, 4, 15, 2)) * 1e3)
        gbs = nbytes / min(times) / 1e3
        line = (
            f"{fmt:4} {requests:2} x {ctx // 1024:3}K T={t}: "
            + " ".join(f"{x:7.1f}" for x in times)
            + f" us; best {gbs:5.0f} GB/s ({gbs / copy:.2f} of copy)"
        )
        if peer_fn is not None:
            line += f"; triton {statistics.median(time_graph(peer, 4, 15, 2)) * 1e3:.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
