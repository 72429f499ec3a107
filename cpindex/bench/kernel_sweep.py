"""``cpindex bench --kernel``: the fused kernel alone on one GPU against the HBM roofline and a
straightforward Triton scorer (bf16).

Every row is a full-length request (all blocks scanned except the forced local one). Inputs
rotate over block tables pointing into disjoint page ranges, so the pages read by consecutive
calls together exceed the L2 and the timings measure HBM, not cache. Calls are timed as CUDA
graph replays (8 calls per graph), so host launch overhead stays out of kernel times.
"""

from __future__ import annotations

import statistics
import sys

import torch

from .. import formats, ops  # noqa: F401  (registers torch.ops.cpindex.*)
from .timing import copy_bandwidth_gbs, synthetic_cache, synthetic_queries, time_graph

ROTATE_BYTES = 512 << 20  # pages touched by consecutive calls, >> the H200's 60 MB L2


def run(formats_: list[str], rows_list: list[int], contexts: list[int], iters: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    copy_gbs = copy_bandwidth_gbs(dev)
    results = []
    total = len(formats_) * len(rows_list) * len(contexts)
    try:
        from .triton_baseline import triton_block_scores
    except Exception:  # triton missing: the column stays empty
        triton_block_scores = None
    for fmt in formats_:
        for rows in rows_list:
            for ctx in contexts:
                blocks = ctx // 128
                page_bytes = 128 * formats.BYTES_PER_TOKEN[fmt]
                set_bytes = rows * blocks * page_bytes
                sets = max(1, min(16, -(-ROTATE_BYTES // set_bytes)))
                cache = synthetic_cache(sets * rows * blocks, fmt, dev)
                tables = torch.arange(sets * rows * blocks, device=dev, dtype=torch.int32)
                tables = tables.view(sets, rows, blocks)
                lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
                q = synthetic_queries(rows, 4, fmt, dev)
                scanned = rows * (blocks - 1)  # the local block is forced, never read
                nbytes = scanned * page_bytes

                def call(i, q=q, cache=cache, tables=tables, lens=lens, sets=sets):
                    return torch.ops.cpindex.block_scores(
                        q, cache, None, tables[i % sets], lens, 0, 1, tables.shape[2], 128**-0.5
                    )

                # graph replays of 8 calls over rotating tables: no host gaps between kernels
                ms = statistics.median(time_graph(call, 8, iters, 2))
                row = {
                    "format": fmt, "rows": rows, "context": ctx, "bytes": nbytes,
                    "kernel_ms": ms, "gbs": nbytes / (ms * 1e-3) / 1e9,
                }  # fmt: skip
                # HBM traffic against HBM traffic: the copy's read + write, the kernel's reads
                row["of_copy"] = row["gbs"] / copy_gbs
                if fmt == "bf16" and triton_block_scores is not None:
                    out = torch.empty(4, rows, blocks, device=dev)

                    def tcall(i, q=q, cache=cache, tables=tables, lens=lens, sets=sets, out=out):
                        triton_block_scores(
                            q,
                            cache,
                            tables[i % sets],
                            lens,
                            init_blocks=0,
                            local_blocks=1,
                            width=tables.shape[2],
                            sm_scale=128**-0.5,
                            out=out,
                        )

                    row["triton_ms"] = statistics.median(time_graph(tcall, 8, iters, 2))
                    ref = call(0)
                    tcall(0)
                    torch.cuda.synchronize()
                    fin = torch.isfinite(ref)
                    row["triton_agrees"] = bool(
                        torch.allclose(out[fin], ref[fin], rtol=1e-3, atol=1e-3)
                    )
                results.append(row)
                print(f"bench --kernel: {len(results)}/{total} done", file=sys.stderr, flush=True)
                del cache, tables
                torch.cuda.empty_cache()
    return {"copy_gbs": copy_gbs, "kernel": results}


LEGEND = "\n".join(
    [
        "Times: median of graph replays of 8 calls over rotating block tables (HBM, not L2).",
        "  MiB read   index-cache bytes one call reads (every row full length, 4 heads)",
        "  kernel us  one call of the fused kernel",
        "  GB/s       MiB read over kernel us",
        "  % copy     GB/s over the device-to-device copy bandwidth above (a copy reads and",
        "             writes, so a read-only kernel can pass 100 %)",
        "  triton us  a straightforward Triton scorer on the same bf16 inputs",
        "  speedup    triton us over kernel us (above 1: the fused kernel is faster)",
    ]
)


def header() -> str:
    return (
        f"{'fmt':>5} {'rows':>4} {'context':>7} {'MiB read':>9} {'kernel us':>10} "
        f"{'GB/s':>6} {'% copy':>6} {'triton us':>10} {'speedup':>7}"
    )


def _line(r: dict) -> str:
    t = r.get("triton_ms")
    extra = f"{t * 1e3:>10.1f} {t / r['kernel_ms']:>6.2f}x" if t else f"{'':>10} {'':>7}"
    return (
        f"{r['format']:>5} {r['rows']:>4} {r['context'] // 1024:>6}K "
        f"{r['bytes'] / 2**20:>9.1f} {r['kernel_ms'] * 1e3:>10.1f} {r['gbs']:>6.0f} "
        f"{100 * r['of_copy']:>5.0f}% {extra}"
    )


def table(res: dict) -> str:
    return "\n".join([header(), *(_line(r) for r in res["kernel"])])
