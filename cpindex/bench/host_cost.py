"""``cpindex bench --host``: the host time of one eager call beside the GPU time of that call,
per entry point, on one GPU.

Entry points: ``IndexCP.score_push`` and ``IndexCP.select_blocks`` (topk 16) with a plan made
for each call (:meth:`IndexCP.plan` inside the timed call) and with a plan made once before the
timed calls (as a decode step's layers share one); per transport (``ipc``; ``collective`` for
its own host work, its communication being a one-rank round here);
``torch.ops.cpindex.block_scores`` and its eager wrapper ``ops.block_scores`` (which calls the
kernel around the dispatcher); the kernel launcher beneath them (``KernelScorer.score_local``:
the floor the entry points add to); and the Triton peer (``triton_block_scores``, on bf16 inputs
of the same shape: it reads bf16 only). IndexCP runs in a one-rank one-process world
(``run_threads(1, ...)``), so nothing waits on a peer and the host time is the call's own.

Host time: ``time.perf_counter`` around each eager call; the device runs behind, and every
:data:`SYNC_EVERY` calls the stream is synchronized outside the timed region (so the launch
queue never fills and blocks a launch). GPU time: CUDA graph replays of 8 calls where the entry
point is capturable, else CUDA events around eager calls (``collective``: those then include any
host gap the device waits through). Inputs rotate over block tables pointing into disjoint page
ranges, as in the kernel sweep, so GPU times measure HBM, not L2.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from .. import formats, ops, partition
from .kernel_sweep import ROTATE_BYTES, SM_SCALE, share_scorer
from .timing import copy_bandwidth_gbs, synthetic_cache, synthetic_queries, time_calls, time_graph

K = 1024
SYNC_EVERY = 50  # eager calls between two stream synchronizations (outside the timed region)
HOST_CALLS = 400  # timed eager calls per entry point
HOST_WARMUP = 20
SELECT_TOPK = 16  # MiniMax-M3's sparse_topk_blocks
TRANSPORTS = ("ipc", "collective")


def host_times(fn: Callable[[int], object], calls: int = HOST_CALLS, warmup: int = HOST_WARMUP):
    """Host µs of each of ``calls`` eager calls ``fn(i)`` (``time.perf_counter`` around the call
    alone). The device runs behind; the current stream is synchronized every
    :data:`SYNC_EVERY` calls and at the end, outside the timed region."""
    for i in range(warmup):
        fn(i)
    torch.cuda.current_stream().synchronize()
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e6)
        if i % SYNC_EVERY == SYNC_EVERY - 1:
            torch.cuda.current_stream().synchronize()
    torch.cuda.current_stream().synchronize()
    return out


def host_us(fn: Callable[[int], object], calls: int = HOST_CALLS) -> dict[str, float]:
    """Median and p90 of :func:`host_times`, in µs."""
    s = sorted(host_times(fn, calls))
    return {"host_us": statistics.median(s), "host_p90_us": s[min(len(s) - 1, int(0.9 * len(s)))]}


def gpu_us(fn: Callable[[int], object], capturable: bool, iters: int) -> tuple[float, str]:
    """Median GPU µs per call and how it was timed (``"graph"`` or ``"events"``)."""
    if capturable:
        return 1e3 * statistics.median(time_graph(fn, 8, iters, 2)), "graph"
    dev = torch.device("cuda", torch.cuda.current_device())
    return 1e3 * statistics.median(time_calls(fn, iters, 3, dev)), "events"


def has_plan() -> bool:
    """Whether this cpindex has the plan form (``IndexCP.plan``)."""
    from ..api import IndexCP

    return hasattr(IndexCP, "plan")


def _config(transport: str, fmt: str, rows: int, t: int, width: int, fingerprint: bool | None):
    from ..config import CPIndexConfig

    kw: dict = {"cp_min_blocks": 0}  # one rank: the transport's path, not the gate's local one
    if fingerprint is not None:
        if "fingerprint" not in CPIndexConfig.model_fields:
            raise SystemExit("cpindex bench --host: this cpindex has no config field 'fingerprint'")
        kw["fingerprint"] = fingerprint
    return CPIndexConfig(
        transport=transport, cache_format=fmt, max_rows=rows * t, max_query_len=t,
        max_width=width, **kw,
    )  # fmt: skip


def _rotation(rows: int, ctx: int, fmt: str, dev: torch.device):
    """Synthetic pages for ``sets`` rotating block tables (disjoint page ranges) whose pages
    together exceed the L2: ``(cache, tables [sets, rows, blocks], seq_lens, bytes a call
    reads)``."""
    blocks = ctx // 128
    lens_host = torch.full((rows,), ctx, dtype=torch.int32)
    nbytes = partition.scanned_blocks(lens_host, 0, 1, 0, 1) * 128 * formats.BYTES_PER_TOKEN[fmt]
    sets = max(1, min(16, -(-ROTATE_BYTES // max(nbytes, 1))))
    cache = synthetic_cache(sets * rows * blocks, fmt, dev)
    tables = torch.arange(sets * rows * blocks, device=dev, dtype=torch.int32)
    return cache, tables.view(sets, rows, blocks), lens_host.to(dev), nbytes


def _entries(cps: dict, fmt: str, rows: int, ctx: int, t: int, dev: torch.device):
    """``(name, transport, fn(i), capturable, bytes a call reads)`` per entry point."""
    cache, table_stack, lens, nbytes = _rotation(rows, ctx, fmt, dev)
    sets, blocks = table_stack.shape[0], table_stack.shape[2]
    tables = table_stack.unbind(0)  # a list: picking one costs no tensor indexing per call
    q = synthetic_queries(rows * t, 4, fmt, dev)  # one rank: all 4 heads are its own
    out: list[tuple] = []
    for name, cp in cps.items():
        cap = cp.capturable

        def push(i, cp=cp):  # a plan made per call (what the positional form did)
            plan = cp.plan(tables[i % sets], lens, query_len=t, width=blocks)
            return cp.score_push(q, cache, plan)

        def select(i, cp=cp):
            plan = cp.plan(tables[i % sets], lens, query_len=t, width=blocks)
            return cp.select_blocks(q, cache, plan, topk=SELECT_TOPK)

        out += [("IndexCP.score_push", name, push, cap, nbytes),
                ("IndexCP.select_blocks", name, select, cap, nbytes)]  # fmt: skip
        plans = [
            cp.plan(tables[s], lens, query_len=t, init_blocks=0, local_blocks=1, width=blocks)
            for s in range(sets)
        ]

        def push_plan(i, cp=cp, plans=plans):
            return cp.score_push(q, cache, plans[i % sets])

        def select_plan(i, cp=cp, plans=plans):
            return cp.select_blocks(q, cache, plans[i % sets], topk=SELECT_TOPK)

        out += [("IndexCP.score_push(plan)", name, push_plan, cap, nbytes),
                ("IndexCP.select_blocks(plan)", name, select_plan, cap, nbytes)]  # fmt: skip
    op = torch.ops.cpindex.block_scores  # the one-tensor cache: scales None
    out.append((
        "torch.ops.cpindex.block_scores", "", lambda i: op(
            q, cache, None, tables[i % sets], lens, 0, 1, blocks, SM_SCALE, t
        ), True, nbytes,
    ))  # fmt: skip
    out.append((
        "ops.block_scores", "", lambda i: ops.block_scores(
            q, cache, tables[i % sets], lens, width=blocks, sm_scale=SM_SCALE, query_len=t
        ), True, nbytes,
    ))  # fmt: skip
    launcher = share_scorer(dev, fmt, 1)
    buf = torch.empty(4, rows * t, blocks, device=dev)
    out.append((
        "launcher (KernelScorer)", "", lambda i: launcher(
            q, cache, tables[i % sets], lens, buf, blocks, t
        ), True, nbytes,
    ))  # fmt: skip
    out += _floors(q, cache, tables, lens, buf, blocks, t, fmt, dev)
    try:
        from .triton_baseline import triton_block_scores
    except Exception:  # triton missing: no peer row
        return out
    if fmt == "bf16":
        bcache, btables, bq, bbytes = cache, tables, q, nbytes
    else:
        bcache, bstack, _, bbytes = _rotation(rows, ctx, "bf16", dev)
        btables = bstack.unbind(0)
        bq = synthetic_queries(rows * t, 4, "bf16", dev)
    bsets = len(btables)
    tout = torch.empty(4, rows * t, blocks, device=dev)

    def peer(i):
        return triton_block_scores(
            bq, bcache, btables[i % bsets], lens, init_blocks=0, local_blocks=1, width=blocks,
            sm_scale=SM_SCALE, out=tout, query_len=t,
        )  # fmt: skip

    out.append(("Triton peer (bf16)", "", peer, True, bbytes))
    return out


def _floors(q, cache, tables, lens, buf, blocks: int, t: int, fmt: str, dev: torch.device):
    """What no entry point can go below on this host: the binding's ``score`` called with
    every argument made beforehand (the pybind call and the launch), and one tiny torch op
    (any GPU op launched from Python)."""
    from ..kernels.launcher import ErrorMonitor, KernelScorer

    sc = KernelScorer(dev, fmt, num_heads=4, rank=0, world=1, sm_scale=SM_SCALE,
                      monitor=ErrorMonitor(dev, 0))  # fmt: skip
    sets = len(tables)
    preps = []
    for s in range(sets):  # the launcher's own arguments for each table, as it passes them
        sc.score_local(q, cache, tables[s], lens, buf, init_blocks=0, local_blocks=1,
                       width=blocks, query_len=t)  # fmt: skip
        img = sc._images[next(reversed(sc._images))]
        shape = sc._shapes[next(reversed(sc._shapes))]
        kv, ks, _ = sc.parts(cache)  # the variant holds the format id
        preps.append((q, kv, ks, tables[s], lens, img, None, *shape.variant, shape.grid, -1))
    one = torch.zeros(1, device=dev)
    binding = ("binding, arguments prepared", "", lambda i: sc.mod.score(*preps[i % sets]))
    tiny = ("one tiny torch op (add_)", "", lambda i: one.add_(1))
    return [(*binding, True, 0), (*tiny, True, 0)]


def _job(comm, formats_, rows_list, contexts, query_lens, iters, calls, transports, fingerprint):
    from ..api import IndexCP

    dev = torch.device("cuda", torch.cuda.current_device())
    results: list[dict] = []
    total = len(formats_) * len(rows_list) * len(contexts) * len(query_lens)
    done = 0
    for fmt in formats_:
        for rows in rows_list:
            for ctx in contexts:
                for t in query_lens:
                    cfgs = {tr: _config(tr, fmt, rows, t, ctx // 128, fingerprint)
                            for tr in transports}  # fmt: skip
                    cps = {tr: IndexCP(c, device=dev, comm=comm) for tr, c in cfgs.items()}
                    try:
                        for name, tr, fn, cap, nbytes in _entries(cps, fmt, rows, ctx, t, dev):
                            rec = {"format": fmt, "rows": rows, "query_len": t, "context": ctx,
                                   "entry": name, "transport": tr, "bytes": nbytes}  # fmt: skip
                            rec.update(host_us(fn, calls))
                            rec["gpu_us"], rec["gpu_how"] = gpu_us(fn, cap, iters)
                            results.append(rec)
                    finally:
                        for cp in cps.values():
                            cp.close()
                    done += 1
                    print(f"bench --host: {done}/{total} done", file=sys.stderr, flush=True)
                    torch.cuda.empty_cache()
    return results


def run(
    formats_: Sequence[str] = ("nvfp4",),
    rows_list: Sequence[int] = (8,),
    contexts: Sequence[int] = (32 * K,),
    query_lens: Sequence[int] = (4,),
    iters: int = 20,
    calls: int = HOST_CALLS,
    transports: Sequence[str] = TRANSPORTS,
    fingerprint: bool | None = None,
) -> dict:
    """Host µs (median and p90 of ``calls`` eager calls) and GPU µs (median of ``iters``
    graph replays, or of eager calls timed by events) per entry point, for every format,
    request count, context and T. ``fingerprint``: the config's agreement hash on or off
    (None: the config's default; needs a cpindex with that field)."""
    from ..world import run_threads

    dev = torch.device("cuda", torch.cuda.current_device())
    copy_gbs = copy_bandwidth_gbs(dev)
    args = (list(formats_), list(rows_list), list(contexts), list(query_lens), iters, calls,
            list(transports), fingerprint)  # fmt: skip
    rows = run_threads(1, lambda comm: _job(comm, *args), device=dev)[0]
    return {"copy_gbs": copy_gbs, "plan": has_plan(), "fingerprint": fingerprint, "host": rows}


LEGEND = "\n".join(
    [
        "host us   median (p90) host time of one eager call: perf_counter around the call, the",
        "          device running behind (stream synchronized every 50 calls, outside the timing)",
        "gpu us    median device time of one call: graph replays of 8 calls (graph), or CUDA",
        "          events around eager calls (events: includes host gaps the device waits out)",
        "host/gpu  host us over gpu us: above 1, an eager caller cannot keep the device busy",
        "MiB read  index-cache bytes one call reads (every block but the forced local one)",
        "GB/s      MiB read over gpu us; % copy: that over the copy bandwidth above (a copy",
        "          reads and writes, so a read-only call can pass 100 %)",
        "(plan)    the call with a plan made once before (IndexCP.plan), as a step's layers share",
        "launcher  KernelScorer.score_local, the kernel launch beneath the entry points",
        "binding   the compiled score() with every argument made beforehand: pybind and launch",
        "tiny op   one torch op on one element: what any GPU op launched from Python costs here",
        "Triton    the Triton peer on bf16 inputs of the same shape (it reads bf16 only)",
        "IndexCP runs in a one-rank world: no peer to wait for, the host time is the call's own",
    ]
)


def table(res: dict) -> str:
    copy = res.get("copy_gbs")
    fp = res.get("fingerprint")
    lines = [
        f"host time per eager call beside GPU time; copy bandwidth {copy:.0f} GB/s"
        + ("" if fp is None else f"; fingerprint {'on' if fp else 'off'}")
        + ("" if res.get("plan", True) else "; no IndexCP.plan in this cpindex: no plan rows"),
    ]
    shape = None
    for r in res["host"]:
        key = (r["format"], r["rows"], r.get("query_len", 1), r["context"])
        if key != shape:
            shape = key
            lines += [
                "",
                f"{r['format']}, {r['rows']} requests x {r['context'] // K}K, "
                f"T = {r.get('query_len', 1)}",
                f"{'entry point':>31} {'transport':>10} {'host us':>8} {'(p90)':>7} "
                f"{'gpu us':>8} {'timed':>6} {'host/gpu':>8} {'MiB read':>9} {'GB/s':>6} "
                f"{'% copy':>6}",
            ]
        gbs = r["bytes"] / (r["gpu_us"] * 1e-6) / 1e9
        pct = f"{100 * gbs / copy:>5.0f}%" if copy and gbs else f"{'':>6}"
        read = f"{r['bytes'] / 2**20:>9.1f} {gbs:>6.0f}" if gbs else f"{'':>9} {'':>6}"
        lines.append(
            f"{r['entry']:>31} {r['transport']:>10} {r['host_us']:>8.1f} "
            f"{r['host_p90_us']:>7.1f} {r['gpu_us']:>8.1f} {r['gpu_how']:>6} "
            f"{r['host_us'] / r['gpu_us']:>7.2f}x {read} {pct}"
        )
    return "\n".join(lines)
