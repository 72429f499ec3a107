"""Every launch shape the fused kernel could take for a call, timed beside the one the launcher
picks and the Triton scorer (docs/BENCHMARKS.md, "The kernel alone"): full scans (W = 1) and rank
0's share of W = 4, T = 1, 4 and 8.

    python benchmarks/launch_shapes.py [--formats bf16,fp8] [--variants ship,s23,...]
                                       [--query-lens 1,4,8] [--json FILE]

Shapes (``K`` CTAs per SM, never more than fit): ``ship``, the launcher's own choice; ``ringK``,
a warp per whole page (``mma.sync`` with four query tiles); ``s4K`` and ``s2K``, pages split over
four or two warps; ``wgK``, the warpgroup-mma instance (sm_90a builds, four query tiles). A shape
that does not apply prints ``-``; an ``s``/``w`` after a time marks split and warpgroup shapes. Each
shape's scores are checked against the launcher's own (a mismatch is printed). µs per call:
median of 15 replays of a CUDA graph of 8 calls over tables rotating through 512 MiB of pages.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from cpindex import formats, partition
from cpindex.bench.timing import copy_bandwidth_gbs, synthetic_cache, synthetic_queries, time_graph
from cpindex.kernels.launcher import ErrorMonitor, KernelScorer
from cpindex.kernels.variants import LaunchShape, Variant, instances, query_tiles

SHAPES = [  # world, requests, context (K tokens)
    (1, 32, 32), (1, 8, 128), (1, 32, 128), (4, 8, 32), (4, 32, 32), (4, 8, 128), (4, 32, 128)
]  # fmt: skip
VARIANTS = ["ship", "ring1", "ring2", "ring3", "s41", "s42", "s43", "s44", "s21", "s22", "s23",
            "s24", "s25", "s45", "wg1", "wg2", "wg4"]  # fmt: skip
ROTATE_BYTES = 512 << 20
SM_SCALE = 128**-0.5


def forced(sc: KernelScorer, variant: str, requests: int, width: int, t: int) -> LaunchShape | None:
    """The launch shape ``variant`` names for this call, or None where it does not apply."""
    base = _launcher_grid(sc, requests, width, False, t)
    if variant == "ship":
        return base
    items, sms = requests * -(-width // sc.world), sc.gpu.sms
    tiles = query_tiles(sc.build, t * sc.num_heads)
    kind, k = variant[:-1], int(variant[-1])

    def on(split: int, wgmma: bool = False) -> LaunchShape:  # K CTAs per SM, at most all it needs
        v = Variant(sc.fmt_id, tiles, wgmma, split)
        cap = max(1, sms * sc.occupancy(v) // sc.gpu.ranks)
        return LaunchShape(v, min(-(-items * max(split, 1) // 4), cap, k * sms))

    if kind == "ring":
        return on(0)
    if kind in ("s4", "s2"):
        return on(int(kind[1]))
    if kind == "wg" and Variant(sc.fmt_id, tiles, True) in instances(sc.build, sc.fmt_id):
        return on(0, wgmma=True)
    return None


_launcher_grid = KernelScorer.grid
_choice: list[LaunchShape | None] = [None]  # the shape the next launch takes (None: the launcher's)


def _grid(self, requests, width, push, query_len=1, fmt_id=None):
    return _choice[0] or _launcher_grid(self, requests, width, push, query_len, fmt_id)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="the shapes to time")
    ap.add_argument("--query-lens", default="1,4,8", help="T values")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {','.join(VARIANTS)}")
    query_lens = [int(t) for t in args.query_lens.split(",")]
    KernelScorer.grid = _grid  # the launch takes _choice; its shape cache is reset per shape
    dev = torch.device("cuda", 0)
    copy = copy_bandwidth_gbs(dev)
    print(f"{torch.cuda.get_device_name(dev)}; copy {copy:.0f} GB/s; µs per call:")
    print("shape".ljust(40) + " ".join(v.rjust(8) for v in variants) + "   triton")
    rows = []
    for fmt in args.formats.split(","):
        for world, requests, ck in SHAPES:
            rows += sweep(fmt, world, requests, ck * 1024, dev, variants, query_lens)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            name = torch.cuda.get_device_name(dev)
            json.dump({"device": name, "copy_gbs": copy, "rows": rows}, f, indent=1)


def sweep(
    fmt: str, world: int, requests: int, ctx: int, dev: torch.device, variants: list[str],
    query_lens: list[int],
) -> list[dict]:  # fmt: skip
    from cpindex.bench.triton_baseline import triton_block_scores

    blocks = ctx // 128
    sc = KernelScorer(
        dev, fmt, num_heads=4, rank=0, world=world, sm_scale=SM_SCALE, monitor=ErrorMonitor(dev, 0)
    )
    lens = torch.full((requests,), ctx, dtype=torch.int32, device=dev)
    page_bytes = 128 * formats.BYTES_PER_TOKEN[fmt]
    nbytes = partition.scanned_blocks(lens, 0, world, 0, 1) * page_bytes
    sets = max(1, min(16, -(-ROTATE_BYTES // nbytes)))
    cache = synthetic_cache(sets * requests * blocks, fmt, dev)
    tables = torch.arange(sets * requests * blocks, device=dev, dtype=torch.int32)
    tables = tables.view(sets, requests, blocks)
    cols = partition.blocks_owned(blocks, 0, world)
    found = []
    for t in query_lens:
        q = synthetic_queries(requests * t, 4, fmt, dev)
        out = torch.empty(4, requests * t, cols, device=dev)

        def call(i, q=q, out=out, t=t):
            sc.score_local(
                q, cache, tables[i % sets], lens, out, init_blocks=0, local_blocks=1,
                width=blocks, query_len=t, shard=True,
            )  # fmt: skip

        row = {"format": fmt, "world": world, "requests": requests, "context": ctx, "T": t,
               "bytes": nbytes, "us": {}}  # fmt: skip
        cells, ref = [], None
        for v in variants:
            _choice[0] = None
            shape = _choice[0] = forced(sc, v, requests, blocks, t)
            sc._shapes = type(sc._shapes)()
            if shape is None:
                cells.append("-".rjust(8))
                continue
            out.fill_(float("nan"))
            call(0)
            if ref is None:
                ref = out.clone()
            else:
                fin = torch.isfinite(ref)
                same = torch.equal(fin, torch.isfinite(out)) and torch.allclose(
                    out[fin], ref[fin], rtol=1e-5, atol=1e-4
                )
                if not same:
                    print(f"MISMATCH: {v} against the launcher's shape", flush=True)
            us = statistics.median(time_graph(call, 8, 15, 2)) * 1e3
            row["us"][v] = us
            row.setdefault("shapes", {})[v] = list(shape)
            kind = "s" if shape.variant.split else "w" if shape.variant.wgmma else " "
            cells.append(f"{us:7.1f}{kind}")
        _choice[0] = None
        sc._shapes = type(sc._shapes)()
        line = f"{fmt:5} W={world} {requests:2} x {ctx // 1024:3}K T={t} ({nbytes >> 20:4} MiB)"
        line = line.ljust(40) + " ".join(cells)
        if fmt == "bf16":
            tout = torch.empty(4, requests * t, cols, device=dev)

            def peer(i, q=q, t=t, tout=tout):
                triton_block_scores(
                    q, cache, tables[i % sets], lens, init_blocks=0, local_blocks=1, width=blocks,
                    sm_scale=SM_SCALE, out=tout, query_len=t, world=world,
                )  # fmt: skip

            row["triton_us"] = statistics.median(time_graph(peer, 8, 15, 2)) * 1e3
            line += f"  {row['triton_us']:7.1f}"
        print(line, flush=True)
        found.append(row)
    return found


if __name__ == "__main__":
    main()
