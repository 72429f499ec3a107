"""``cpindex bench --agree``: what the per-call agreement hash costs (``CPIndexConfig
.fingerprint`` on against off).

``score_push`` and ``select_blocks`` (topk 16) through ``ipc`` in the one-process world (W ranks
as threads sharing one GPU, as the transport A/B runs there), on the same inputs, one instance
with the hash and one without, timed as CUDA graph replays of 8 calls. Each call is timed in the
positional form and with a plan made once before; ``ipc`` hashes the block-table entries and
lengths a call reads inside its kernel on every call either way (``collective`` on a GPU takes
the plan's hash instead). Rounds alternate the order of off and on, and each time is the median
over rounds, so drift of the shared device between the two falls on both alike. ``refresh us``:
a plan's torch-side hash recomputed (``Plan.refresh``), rank 0 alone, where the plan carries
one (not with ``ipc``, whose plans carry none).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence

import torch

from .. import formats, partition
from ..comm import Comm
from .ab import SELECT_TOPK, _problem
from .timing import copy_bandwidth_gbs, time_graph

K = 1024
SHAPES: tuple[tuple[int, int], ...] = ((8, 32 * K), (32, 128 * K))  # (requests, context)
CALLS = ("score_push", "select_blocks")


def has_fingerprint() -> bool:
    """Whether this cpindex's config has the ``fingerprint`` field."""
    from ..config import CPIndexConfig

    return "fingerprint" in CPIndexConfig.model_fields


def _forms(cp) -> list[str]:
    return ["positional", "plan"] if hasattr(cp, "plan") else ["positional"]


def _settle(comm: Comm) -> None:
    """This rank's stream drained, then every rank met: no push is in flight anywhere, so the
    next host work may allocate or block (docs/design.md, the one-process world, rules 1-2)."""
    torch.cuda.current_stream().synchronize()  # releases the GIL
    comm.barrier()


def _callable(cp, call: str, form: str, iq, prob, plan, t: int):
    """``fn(i)``: one ``call`` of ``cp`` in ``form`` (positional, or with ``plan``)."""
    cache = prob.index_cache
    if form == "plan":
        if call == "score_push":
            return lambda i: cp.score_push(iq, cache, plan)
        return lambda i: cp.select_blocks(iq, cache, plan, topk=SELECT_TOPK)
    # "positional": a plan made for each call, as the positional form did
    bt, sl, w = prob.block_table, prob.seq_lens, prob.width
    if call == "score_push":
        return lambda i: cp.score_push(iq, cache, cp.plan(bt, sl, query_len=t, width=w))
    return lambda i: cp.select_blocks(
        iq, cache, cp.plan(bt, sl, query_len=t, width=w), topk=SELECT_TOPK
    )


def _shape(comm: Comm, cps: dict, rows: int, ctx: int, t: int, fmt: str, iters: int,
           rounds: int) -> list[dict]:  # fmt: skip
    """Every call and form of one shape, off against on; rank 0's records."""
    dev = torch.device("cuda", torch.cuda.current_device())
    prob = _problem(fmt, rows, ctx, t, dev)
    iq = prob.rank_queries(comm.rank, comm.world_size)
    forms = _forms(cps[False])
    # Plans before any push: making one runs the hash's device ops once, which also leaves
    # their blocks in this stream's allocator cache, so the positional calls' hashes never
    # allocate while a peer's push is in flight (docs/design.md, the one-process world, rule 2).
    plans = {fp: None for fp in cps}
    if "plan" in forms:
        plans = {
            fp: cp.plan(prob.block_table, prob.seq_lens, query_len=t, init_blocks=0,
                        local_blocks=1, width=prob.width)
            for fp, cp in cps.items()
        }  # fmt: skip
    _settle(comm)
    fns = {
        (call, form, fp): _callable(cps[fp], call, form, iq, prob, plans[fp], t)
        for call in CALLS for form in forms for fp in cps
    }  # fmt: skip

    # the hash never changes what a call computes: both instances' outputs, bit for bit
    agree = {}
    for call in CALLS:
        for form in forms:
            got = {}
            for fp in (False, True):
                res = fns[(call, form, fp)](0)
                _settle(comm)
                got[fp] = res.clone()  # settled: no push in flight meets the allocation
                _settle(comm)
            agree[(call, form)] = bool(torch.equal(got[False], got[True]))
            _settle(comm)
    times: dict[tuple[str, str, bool], list[float]] = {key: [] for key in fns}
    for rnd in range(rounds):
        order = (False, True) if rnd % 2 == 0 else (True, False)
        for call in CALLS:
            for form in forms:
                for fp in order:
                    ms = time_graph(fns[(call, form, fp)], 8, iters, 3, comm)
                    times[(call, form, fp)].append(statistics.median(ms))
                    _settle(comm)
    refresh_ms = None
    plan = plans[True]
    # Only a plan that carries a hash has one to refresh (ipc's kernel hashes every call).
    if plan is not None and plan.fingerprint is not None and comm.rank == 0:
        # alone: the others wait, settled, at the barrier
        refresh_ms = statistics.median(time_graph(lambda i: plan.refresh(), 8, iters, 2))
    _settle(comm)
    # a plan holds a fingerprint only where the instance compares one (Plan.fingerprint)
    compared = None if plan is None else plan.fingerprint is not None
    lens = torch.full((rows,), ctx, dtype=torch.int32)  # on the host: no device read
    full = partition.scanned_blocks(lens, 0, 1, 0, 1) * 128 * formats.BYTES_PER_TOKEN[fmt]
    out = []
    for call in CALLS:
        for form in forms:
            off = statistics.median(times[(call, form, False)])
            on = statistics.median(times[(call, form, True)])
            out.append({
                "format": fmt, "rows": rows, "query_len": t, "context": ctx,
                "world": comm.world_size, "call": call, "form": form, "off_ms": off,
                "on_ms": on, "diff_us": (on - off) * 1e3, "diff_pct": 100 * (on - off) / off,
                "off_rounds_ms": times[(call, form, False)],
                "on_rounds_ms": times[(call, form, True)],
                "agree": agree[(call, form)], "bytes": full,
                "refresh_ms": refresh_ms if form == "plan" else None, "compared": compared,
            })  # fmt: skip
    return out


def _rank_job(comm: Comm, shapes, t: int, fmt: str, iters: int, rounds: int) -> list[dict]:
    from ..api import IndexCP
    from ..config import CPIndexConfig

    dev = torch.device("cuda", torch.cuda.current_device())
    copy_gbs = None
    if comm.rank == 0:  # alone on the device: the roofline the GB/s column is read against
        copy_gbs = copy_bandwidth_gbs(dev)
    comm.barrier()
    rows_max = max(r for r, _ in shapes)
    width_max = max(c for _, c in shapes) // 128

    def config(fp: bool) -> CPIndexConfig:
        return CPIndexConfig(
            transport="ipc", cache_format=fmt, max_rows=rows_max * t, max_query_len=t,
            max_width=width_max, fingerprint=fp, cp_min_blocks=0,
        )  # fmt: skip

    cps = {fp: IndexCP(config(fp), device=dev, comm=comm) for fp in (False, True)}
    out: list[dict] = []
    try:
        for rows, ctx in shapes:
            for rec in _shape(comm, cps, rows, ctx, t, fmt, iters, rounds):
                out.append({**rec, "copy_gbs": copy_gbs})
            if comm.rank == 0:
                print(f"bench --agree: {rows} x {ctx // K}K done", file=sys.stderr, flush=True)
            _settle(comm)
    finally:
        for cp in cps.values():
            cp.close()
    return out


def run(
    shapes: Sequence[tuple[int, int]] = SHAPES,
    query_len: int = 4,
    fmt: str = "nvfp4",
    iters: int = 50,
    world: int = 4,
    rounds: int = 3,
) -> dict:
    """Fingerprint off and on per (requests, context) in ``shapes``, ``query_len`` rows per
    request, ``world`` ranks sharing the current GPU: rank 0's median µs per call (``iters``
    graph replays a round, median over ``rounds``). Returns ``{"skipped": why}`` where the
    config has no ``fingerprint`` field."""
    if not has_fingerprint():
        return {"skipped": "this cpindex's CPIndexConfig has no 'fingerprint' field: nothing to "
                "compare (the agreement hash comes with the lockstep work)"}  # fmt: skip
    from ..world import run_threads

    dev = torch.device("cuda", torch.cuda.current_device())
    args = (list(shapes), query_len, fmt, iters, rounds)
    recs = run_threads(world, lambda comm: _rank_job(comm, *args), device=dev)[0]
    return {"world": world, "format": fmt, "query_len": query_len, "agree": recs}


LEGEND = "\n".join(
    [
        "off us / on us  rank 0's median time per call, fingerprint off / on (graph replays of",
        "                8 calls; median over rounds that alternate the order)",
        "diff            on minus off, in us and in % of the call without the hash",
        "form            positional, or with a plan made once before (IndexCP.plan); ipc's",
        "                kernel hashes what each call reads in both",
        "refresh us      Plan.refresh, rank 0 alone, once per step: only where the plan carries",
        "                the hash (collective); blank for ipc",
        "MiB read        index-cache bytes all ranks read per call together (the one GPU's)",
        "GB/s, % copy    MiB read over off us, and that over the copy bandwidth (read + write)",
        "agree           the outputs with and without the hash are equal, bit for bit",
    ]
)


def table(res: dict) -> str:
    if "skipped" in res:
        return f"bench --agree skipped: {res['skipped']}"
    recs = res["agree"]
    copy = next((r["copy_gbs"] for r in recs if r.get("copy_gbs")), None)
    lines = [
        f"agreement hash (fingerprint) off vs on: ipc, W = {res['world']} ranks on one GPU, "
        f"{res['format']}, T = {res['query_len']}"
        + (f"; copy bandwidth {copy:.0f} GB/s" if copy else ""),
    ]
    lines.append(
        f"{'rows':>4} {'ctx':>5} {'call':>13} {'form':>10} {'off us':>8} {'on us':>8} "
        f"{'diff us':>8} {'diff %':>7} {'refresh us':>10} {'MiB read':>9} {'GB/s':>6} "
        f"{'% copy':>6} {'agree':>5}"
    )
    for r in recs:
        gbs = r["bytes"] / (r["off_ms"] * 1e-3) / 1e9
        pct = f"{100 * gbs / copy:>5.0f}%" if copy else f"{'':>6}"
        ref = r.get("refresh_ms")
        ref_s = f"{ref * 1e3:>10.2f}" if ref is not None and r["form"] == "plan" else f"{'':>10}"
        lines.append(
            f"{r['rows']:>4} {r['context'] // K:>4}K {r['call']:>13} {r['form']:>10} "
            f"{r['off_ms'] * 1e3:>8.2f} {r['on_ms'] * 1e3:>8.2f} {r['diff_us']:>+8.2f} "
            f"{r['diff_pct']:>+6.2f}% {ref_s} {r['bytes'] / 2**20:>9.1f} {gbs:>6.0f} {pct} "
            f"{'yes' if r['agree'] else 'NO':>5}"
        )
    return "\n".join(lines)
