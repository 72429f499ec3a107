"""``cpindex bench --kernel``: the fused kernel alone on one GPU against the HBM roofline and a
straightforward Triton scorer (bf16).

Every row is a full-length request (all blocks scanned except the forced local one). With
``world`` W > 1 both kernels score rank 0's share of W instead (blocks 0, W, 2W, ... of every
request), which is what one GPU of a W-way context-parallel deployment scans per call. Inputs
rotate over block tables pointing into disjoint page ranges, so the pages read by consecutive
calls together exceed the L2 and the timings measure HBM, not cache. Calls are timed as CUDA
graph replays (8 calls per graph), so host launch overhead stays out of kernel times.
"""

from __future__ import annotations

import statistics
import sys

import torch

from .. import formats, ops, partition, testing  # noqa: F401  (ops: registers torch.ops.cpindex.*)
from .timing import copy_bandwidth_gbs, synthetic_cache, synthetic_queries, time_graph

ROTATE_BYTES = 512 << 20  # pages touched by consecutive calls, >> the H200's 60 MB L2
SM_SCALE = 128**-0.5


def share_scorer(device: torch.device, fmt: str, world: int, heads: int = 4):
    """The fused kernel on rank 0's share of ``world`` for ``heads`` heads, as ``score_push``
    scans it before any exchange: ``fn(q, cache, block_table, seq_lens, out, width,
    query_len)`` fills ``out``, float32 ``[heads, rows, ceil(width / world)]``, and returns it."""
    from ..kernels.launcher import ErrorMonitor, KernelScorer

    sc = KernelScorer(
        device, fmt, num_heads=heads, rank=0, world=world, sm_scale=SM_SCALE,
        monitor=ErrorMonitor(device, 0),
    )  # fmt: skip

    def fn(q, cache, block_table, seq_lens, out, width, query_len):
        sc.score_local(
            q, cache, block_table, seq_lens, out, init_blocks=0, local_blocks=1, width=width,
            query_len=query_len, shard=True,
        )  # fmt: skip
        return out

    return fn


def _scorer(device: torch.device, fmt: str, world: int):
    """``fn(q, cache, block_table, seq_lens, query_len)`` -> scores of every block (world 1,
    through the op) or of rank 0's share (an output buffer per shape, allocated by the first,
    eager call and reused, so graph replays write where the capture did)."""
    if world == 1:
        return lambda q, cache, bt, lens, t: torch.ops.cpindex.block_scores(
            q, cache, None, bt, lens, 0, 1, bt.shape[1], SM_SCALE, t
        )
    share = share_scorer(device, fmt, world)
    bufs: dict[tuple[int, ...], torch.Tensor] = {}

    def fn(q, cache, bt, lens, t):
        shape = (4, q.shape[0], partition.blocks_owned(bt.shape[1], 0, world))
        if shape not in bufs:
            bufs[shape] = torch.empty(shape, device=device)
        return share(q, cache, bt, lens, bufs[shape], bt.shape[1], t)

    return fn


def run(
    formats_: list[str],
    rows_list: list[int],
    contexts: list[int],
    iters: int,
    query_lens: list[int] = (1,),  # type: ignore[assignment]
    world: int = 1,
) -> dict:
    """``rows_list`` counts requests; each scores ``T`` query rows for every ``T`` in
    ``query_lens`` over the same pages (read once per call whatever T is). ``world`` > 1:
    rank 0's share of the blocks, for the fused kernel and the Triton scorer alike."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    dev = torch.device("cuda", torch.cuda.current_device())
    copy_gbs = copy_bandwidth_gbs(dev)
    results = []
    total = len(formats_) * len(rows_list) * len(contexts) * len(query_lens)
    try:
        from .triton_baseline import triton_block_scores
    except Exception:  # triton missing: the column stays empty
        triton_block_scores = None
    triton_ms: dict[tuple[int, int, int], float] = {}  # (requests, context, T), from bf16 inputs
    t1_ms: dict[tuple[str, int, int], float] = {}
    scorers = {}  # format -> its _scorer
    # bf16 first: its inputs time the Triton baseline every format is compared with
    for fmt in sorted(formats_, key=lambda f: f != "bf16"):
        for rows in rows_list:
            for ctx in contexts:
                blocks = ctx // 128
                # nvfp4-<form>: the same pages handed over in another form (testing.NVFP4_FORMS)
                base, form = testing.split_format(fmt)
                page_bytes = 128 * formats.BYTES_PER_TOKEN[base]
                lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
                # what one call reads: (rank 0's) blocks but the forced local one
                nbytes = partition.scanned_blocks(lens, 0, world, 0, 1) * page_bytes
                sets = max(1, min(16, -(-ROTATE_BYTES // max(nbytes, 1))))
                cache = synthetic_cache(sets * rows * blocks, base, dev)
                if form != "page_major":
                    cache = testing.nvfp4_form(cache, form)
                tables = torch.arange(sets * rows * blocks, device=dev, dtype=torch.int32)
                tables = tables.view(sets, rows, blocks)
                if base not in scorers:
                    scorers[base] = _scorer(dev, base, world)
                for t in query_lens:
                    q = synthetic_queries(rows * t, 4, base, dev)

                    def call(i, q=q, cache=cache, tables=tables, lens=lens, sets=sets, t=t,
                             score=scorers[base]):  # fmt: skip
                        return score(q, cache, tables[i % sets], lens, t)

                    # graph replays of 8 calls over rotating tables: no host gaps between kernels
                    ms = statistics.median(time_graph(call, 8, iters, 2))
                    row = {
                        "format": fmt, "rows": rows, "query_len": t, "context": ctx,
                        "world": world, "bytes": nbytes, "kernel_ms": ms,
                        "gbs": nbytes / (ms * 1e-3) / 1e9,
                    }  # fmt: skip
                    # HBM traffic against HBM traffic: the copy's read + write, the kernel's reads
                    row["of_copy"] = row["gbs"] / copy_gbs
                    if t == 1:
                        t1_ms[(fmt, rows, ctx)] = ms
                    if (fmt, rows, ctx) in t1_ms:
                        row["vs_t1"] = ms / t1_ms[(fmt, rows, ctx)]
                    if fmt == "bf16" and triton_block_scores is not None:
                        cols = partition.blocks_owned(blocks, 0, world)  # rank 0's columns
                        out = torch.empty(4, rows * t, cols, device=dev)

                        def tcall(i, q=q, cache=cache, tables=tables, lens=lens, sets=sets,
                                  out=out, t=t):  # fmt: skip
                            triton_block_scores(
                                q, cache, tables[i % sets], lens, init_blocks=0, local_blocks=1,
                                width=tables.shape[2], sm_scale=SM_SCALE, out=out, query_len=t,
                                world=world,
                            )  # fmt: skip

                        triton_ms[(rows, ctx, t)] = statistics.median(
                            time_graph(tcall, 8, iters, 2)
                        )
                        ref = call(0)
                        tcall(0)
                        torch.cuda.synchronize()
                        fin = torch.isfinite(ref)
                        row["triton_agrees"] = bool(
                            torch.equal(fin, torch.isfinite(out))
                            and torch.allclose(out[fin], ref[fin], rtol=1e-3, atol=1e-3)
                        )
                    if (rows, ctx, t) in triton_ms:
                        row["triton_ms"] = triton_ms[(rows, ctx, t)]
                    results.append(row)
                    print(
                        f"bench --kernel: {len(results)}/{total} done", file=sys.stderr, flush=True
                    )
                del cache, tables
                torch.cuda.empty_cache()
    return {"copy_gbs": copy_gbs, "world": world, "kernel": results}


LEGEND = "\n".join(
    [
        "Times: median of graph replays of 8 calls over rotating block tables (HBM, not L2).",
        "  rows       requests, each full length; T: query rows per request (4 heads each)",
        "  MiB read   index-cache bytes one call reads (once per request, whatever T is): every",
        "             block, or with --world W > 1 rank 0's share (blocks 0, W, 2W, ...)",
        "  kernel us  one call of the fused kernel",
        "  vs T=1     kernel us over the same requests' T = 1 call",
        "  GB/s       MiB read over kernel us",
        "  % copy     GB/s over the device-to-device copy bandwidth above (a copy reads and",
        "             writes, so a read-only kernel can pass 100 %)",
        "  triton us  a straightforward Triton scorer of the same requests and T, on bf16 inputs",
        "             (one program per request and block: each page read once for its T rows)",
        "  speedup    triton us over kernel us (above 1: the fused kernel is faster)",
    ]
)


def header() -> str:
    return (
        f"{'fmt':>10} {'rows':>4} {'T':>2} {'context':>7} {'MiB read':>9} {'kernel us':>10} "
        f"{'GB/s':>6} {'% copy':>6} {'vs T=1':>6} {'triton us':>10} {'speedup':>7}"
    )


def _line(r: dict) -> str:
    t = r.get("triton_ms")
    extra = f"{t * 1e3:>10.1f} {t / r['kernel_ms']:>6.2f}x" if t else f"{'':>10} {'':>7}"
    vs = f"{r['vs_t1']:>5.2f}x" if "vs_t1" in r else f"{'':>6}"
    return (
        f"{r['format']:>10} {r['rows']:>4} {r.get('query_len', 1):>2} {r['context'] // 1024:>6}K "
        f"{r['bytes'] / 2**20:>9.1f} {r['kernel_ms'] * 1e3:>10.1f} {r['gbs']:>6.0f} "
        f"{100 * r['of_copy']:>5.0f}% {vs} {extra}"
    )


def table(res: dict) -> str:
    w = res.get("world", 1)
    what = "every block" if w == 1 else f"rank 0's share of W = {w} (every {w}th block)"
    return "\n".join([f"each call scores {what} of every request", header(),
                      *(_line(r) for r in res["kernel"])])  # fmt: skip
