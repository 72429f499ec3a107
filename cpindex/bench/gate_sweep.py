"""``cpindex bench --gate`` (the CP gate): where context parallelism starts to pay.

For one format, transport, query length and call, a sweep of requests x context, each size
timed twice on the same inputs: with the gate forced off (``cp_min_blocks=0``: every call
context-parallel) and forced on (every call scored by each rank alone for its own heads). The
table shows both times per size and what scoring locally saves where it is faster; under it, the
crossover the sweep finds (the fewest blocks from which context parallelism is faster at every
larger size), what calls below it save, and where ``cp_min_blocks="auto"`` put the threshold on
the same ranks (docs/design.md, "CP per call: the gate").

World: one process per GPU over NCCL when there are enough GPUs (the setting the gate is
for), else the one-process world on one GPU, where the ranks share one GPU's bandwidth, so
context parallelism shows its overhead only and rarely wins; on a CPU machine, the one-process
world of CPU ranks (the reference scorer).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field

import torch

from ..api import IndexCP
from ..comm import Comm, TorchComm
from ..config import CPIndexConfig, CpMinBlocks
from ..spawn import spawn_processes
from ..world import run_threads
from .ab import SELECT_TOPK, _problem, blocks, tokens
from .timing import Progress, summarize, time_calls, time_graph

K = 1024
#: ``cp_min_blocks`` that no call reaches: every call below the gate.
LOCAL_ALWAYS = 1 << 40
#: The calls a sweep can time: ``select_blocks`` selects the top 16 (:data:`SELECT_TOPK`).
OPS = ("score_push", "select_blocks")


@dataclass
class Spec:
    """One sweep: every (requests, context) size of one format, transport, query length and
    call on a ``world``-rank world."""

    fmt: str = "nvfp4"
    world: int = 4
    transport: str = "auto"
    requests: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    contexts: list[int] = field(default_factory=lambda: [4 * K, 16 * K, 64 * K, 128 * K])
    query_len: int = 1
    op: str = "score_push"  # or "select_blocks" (topk 16)
    iters: int = 50
    graphs: bool = True


def config(spec: Spec, world: int | None, cp_min_blocks: CpMinBlocks = "auto") -> CPIndexConfig:
    """The ranks' configuration for ``spec`` on ``world`` ranks (None: the group's size), sized
    for its largest call; raises ``ValueError`` where no such configuration exists."""
    return CPIndexConfig(
        transport=spec.transport,
        cache_format=spec.fmt,
        max_rows=max(spec.requests) * spec.query_len,
        max_query_len=spec.query_len,
        max_width=blocks(max(spec.contexts)),
        max_topk=SELECT_TOPK,
        world_size=world,
        cp_min_blocks=cp_min_blocks,
    )


def _time(fn, spec: Spec, device: torch.device, capturable: bool, comm: Comm) -> dict:
    if device.type == "cuda" and spec.graphs and capturable:
        ms = time_graph(fn, per_graph=8, replays=spec.iters, warmup=3, comm=comm)
    else:
        ms = time_calls(fn, spec.iters, 3, device)
    return summarize(ms)


def _caller(fn, args: tuple, kw: dict):
    """``fn(*args, **kw)`` as the timers' ``fn(i)``."""
    return lambda i: fn(*args, **kw)


def _settle(comm: Comm, device: torch.device) -> None:
    """Every rank's work done before anyone goes on (in the one-process world nothing may sit
    between two ranks' pushes: docs/design.md, rule 2)."""
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    comm.barrier()


def _sweep(comm: Comm, spec: Spec, device: torch.device, progress: Progress) -> dict:
    """One sweep on this rank: its sizes in order, both paths checked bit for bit, then
    timed."""
    w = comm.world_size
    auto = IndexCP(config(spec, w), device=device, comm=comm)
    gate = auto.gate
    auto.close()
    cps = {
        name: IndexCP(config(spec, w, value), device=device, comm=comm)
        for name, value in (("cp", 0), ("local", LOCAL_ALWAYS))
    }
    rows: list[dict] = []
    for requests in spec.requests:
        for ctx in spec.contexts:
            prob = _problem(spec.fmt, requests, ctx, spec.query_len, device)
            iq = prob.rank_queries(comm.rank, w)
            plans = {
                name: cp.plan(
                    prob.block_table, prob.seq_lens, query_len=spec.query_len, width=prob.width
                )
                for name, cp in cps.items()
            }
            kw: dict = {}
            if spec.op == "select_blocks":
                kw["topk"] = SELECT_TOPK
            fns = {
                name: _caller(getattr(cp, spec.op), (iq, prob.index_cache, plans[name]), kw)
                for name, cp in cps.items()
            }
            outs = {}
            _settle(comm, device)
            for name, fn in fns.items():  # correctness first: both paths, bit for bit
                got = fn(0)
                _settle(comm, device)  # the clone allocates: never beside a peer's push
                outs[name] = got.clone()
                _settle(comm, device)
            agree = bool(torch.equal(outs["cp"], outs["local"]))
            _settle(comm, device)
            rec = {
                "requests": requests,
                "context": ctx,
                "blocks": requests * prob.width,
                "agree": agree,
                "auto_cp": gate.uses_cp(requests * prob.width),
            }
            for name, fn in fns.items():
                rec[name] = _time(fn, spec, device, cps[name].capturable, comm)
                _settle(comm, device)
            rows.append(rec)
            progress.step(f"{spec.fmt} {spec.op} T={spec.query_len} {requests} x {tokens(ctx)}")
            del prob, outs
    transport = cps["cp"].transport_name
    for cp in cps.values():
        cp.close()
    return {
        "format": spec.fmt,
        "world": w,
        "query_len": spec.query_len,
        "op": spec.op,
        "iters": spec.iters,
        "device": str(device),
        "distinct_gpus": gate.source in ("measured", "model"),
        "transport": transport,
        "graphs": spec.graphs and device.type == "cuda",
        "gate": {
            "threshold": gate.threshold,
            "source": gate.source,
            "t_exchange_s": gate.t_exchange_s,
            "bandwidth": gate.bandwidth,
            "page_bytes": gate.page_bytes,
        },
        "rows": rows,
    }


def _rank_job(comm: Comm, specs: list[Spec], device: torch.device) -> list[dict]:
    """Every sweep on this rank, in order (one world for all of them)."""
    total = sum(len(s.requests) * len(s.contexts) for s in specs)
    progress = Progress(total, "bench --gate", comm.rank == 0)
    try:
        return [_sweep(comm, spec, device, progress) for spec in specs]
    finally:
        progress.close()


def _process_job(rank: int, world: int, specs: list[Spec], path: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    res = _rank_job(TorchComm(), specs, device)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(res, f)


def run_all(specs: list[Spec]) -> list[dict]:
    """Every sweep of ``specs`` (one world size) on one world, started once; rank 0's results,
    each with its ``spec`` and its :func:`summary`. Progress on stderr, nothing on stdout."""
    if len({s.world for s in specs}) != 1:
        raise ValueError("specs: expected one world size for every sweep")
    bad = [s.op for s in specs if s.op not in OPS]
    if bad:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {bad[0]!r}")
    world = specs[0].world
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= world > 1:
        with tempfile.TemporaryDirectory(prefix="cpindex-gate-") as tmp:
            path = os.path.join(tmp, "rank0.json")  # rank 0's process hands its results here
            spawn_processes(world, _process_job, specs, path, backend="nccl")
            with open(path) as f:
                results = json.load(f)
    else:
        dev = torch.device("cuda", 0) if gpus else torch.device("cpu")
        results = run_threads(world, lambda c: _rank_job(c, specs, dev), device=dev)[0]
    for spec, res in zip(specs, results, strict=True):
        res["spec"] = asdict(spec)
        res["summary"] = summary(res)
    return results


def run(spec: Spec | None = None, **kw) -> dict:
    """One sweep (``Spec`` fields as keywords, or a ``spec``); rank 0's results."""
    return run_all([spec or Spec(**kw)])[0]


def saved_us(row: dict) -> float:
    """What scoring locally saves per call at this size, in µs (negative: CP is faster)."""
    return (row["cp"]["median_ms"] - row["local"]["median_ms"]) * 1e3


def crossover(rows: list[dict]) -> int | None:
    """The fewest blocks from which context parallelism is faster at every size of the sweep
    that large or larger (every size of a block count: sizes can share one); None when it is not
    faster at the largest."""
    by_blocks: dict[int, bool] = {}
    for r in rows:
        cp_wins = r["cp"]["median_ms"] < r["local"]["median_ms"]
        by_blocks[r["blocks"]] = by_blocks.get(r["blocks"], True) and cp_wins
    found = None
    for b in sorted(by_blocks, reverse=True):
        if not by_blocks[b]:
            break
        found = b
    return found


def _saved(below: list[dict]) -> dict | None:
    """Mean, median and sum over ``below`` of what scoring locally saves per call (µs), and the
    mean share of the CP time that is; None where ``below`` is empty."""
    if not below:
        return None
    saved = [saved_us(r) for r in below]
    pct = [100 * saved_us(r) / (r["cp"]["median_ms"] * 1e3) for r in below]
    return {
        "mean": statistics.mean(saved),
        "median": statistics.median(saved),
        "sum": sum(saved),
        "mean_pct_of_cp": statistics.mean(pct),
    }


def summary(res: dict) -> dict:
    """What the table prints under its rows, as data: the crossover (``crossover_blocks``;
    ``in_range``: the sweep has a size below it), what the sizes below it save per call in µs
    (mean, median, sum over those sizes; None where there is none), and how
    ``cp_min_blocks="auto"`` did on the same ranks."""
    rows = res["rows"]
    cross = crossover(rows)
    sizes = sorted({r["blocks"] for r in rows})
    below = [r for r in rows if cross is None or r["blocks"] < cross]
    gate = res["gate"]
    return {
        "crossover_blocks": cross,
        "in_range": cross is not None and cross > sizes[0],
        "smallest_blocks": sizes[0],
        "largest_blocks": sizes[-1],
        "largest_below": max((r["blocks"] for r in below), default=None),
        "sizes_below": len(below),
        "saved_us": _saved(below),
        "auto_threshold": gate["threshold"],
        "auto_source": gate["source"],
        "auto_faster_at": sum(
            r["auto_cp"] == (r["cp"]["median_ms"] < r["local"]["median_ms"]) for r in rows
        ),
        "sizes": len(rows),
    }


def _setting(res: dict) -> str:
    if res["device"].startswith("cpu"):
        return " (CPU ranks: the reference scorer)"
    if not res.get("distinct_gpus"):
        return " (the ranks share one GPU: CP shows its overhead only)"
    return ""


def crossover_line(s: dict) -> str:
    """``crossover: N blocks (...)``, or that the sweep found none in its range and why."""
    cross, lo, hi = s["crossover_blocks"], s["smallest_blocks"], s["largest_blocks"]
    if s["in_range"]:
        return (
            f"crossover: {cross} blocks (CP is faster at every size from there on; local at "
            f"{s['largest_below']} blocks, the largest size below)"
        )
    if cross is None:
        why = f"local is faster at the largest size, so any crossover lies above {hi} blocks"
    else:
        why = f"CP is faster at every size, so the crossover lies at or below {lo} blocks"
    return f"crossover: none found in the swept range ({lo} to {hi} blocks): {why}"


def saved_line(s: dict) -> str:
    """What the calls below the crossover save per call: mean, median and sum over the sizes."""
    saved = s["saved_us"]
    if saved is None:
        return "below the crossover: no size of the sweep, nothing saved"
    where = (
        "at every size of the sweep (all below any crossover)"
        if s["crossover_blocks"] is None
        else f"below {s['crossover_blocks']} blocks"
    )
    return (
        f"{where}, scoring locally saves per call: mean {saved['mean']:.1f} us, median "
        f"{saved['median']:.1f} us, sum {saved['sum']:.1f} us over {s['sizes_below']} sizes "
        f"(mean {saved['mean_pct_of_cp']:.0f} % of the CP time)"
    )


def auto_line(res: dict, s: dict) -> str:
    """Where ``cp_min_blocks="auto"`` put the threshold on these ranks, from what, and at how
    many sizes that takes the faster path."""
    gate = res["gate"]
    model = ""
    if gate.get("t_exchange_s") is not None:
        model = (
            f": t_exchange {gate['t_exchange_s'] * 1e6:.1f} us, "
            f"{gate['bandwidth'] / 1e12:.2f} TB/s, {gate['page_bytes']}-byte pages"
        )
    line = (
        f"cp_min_blocks='auto' on these ranks: {gate['threshold']} blocks ({gate['source']}"
        f"{model}); it takes the faster path at {s['auto_faster_at']} of {s['sizes']} sizes"
    )
    if s["in_range"] and s["crossover_blocks"] != gate["threshold"]:
        line += f"; cp_min_blocks={s['crossover_blocks']} gates at the crossover"
    return line


def table(res: dict) -> str:
    """One sweep's table: a row per size (fewest blocks first), then the crossover, what the
    calls below it save and where ``auto`` put the threshold (:func:`summary`)."""
    rows = sorted(res["rows"], key=lambda r: (r["blocks"], r["requests"]))
    s = res.get("summary") or summary(res)
    head = (
        f"CP gate: {res['format']}, {res['op']}, W = {res['world']}, T = {res['query_len']}, "
        f"transport {res['transport']} on {res['device']}" + _setting(res)
    )
    out = [
        head,
        f"{'req':>4} {'ctx':>6} {'blocks':>7} {'CP us':>9} {'local us':>9} {'local/CP':>8} "
        f"{'saved us':>9} {'auto':>5} {'agree':>5}",
    ]
    for r in rows:
        cp, local = r["cp"]["median_ms"] * 1e3, r["local"]["median_ms"] * 1e3
        saved = f"{saved_us(r):.1f}" if local < cp else "-"
        out.append(
            f"{r['requests']:>4} {tokens(r['context']):>6} {r['blocks']:>7} {cp:>9.1f} "
            f"{local:>9.1f} {local / cp:>8.2f} {saved:>9} "
            f"{'CP' if r['auto_cp'] else 'local':>5} {'yes' if r['agree'] else 'NO':>5}"
        )
    out += [crossover_line(s), saved_line(s), auto_line(res, s)]
    return "\n".join(out)


def legend(results: list[dict]) -> str:
    """What the tables' columns mean, printed once under them."""
    graphs = any(r["graphs"] for r in results)
    how = "CUDA graph replays of 8 calls where capturable" if graphs else "eager calls"
    iters = sorted({r["iters"] for r in results})
    return "\n".join(
        [
            f"Times: median per call in us over {','.join(map(str, iters))} timed repetitions "
            f"({how}). blocks = requests x width, what the gate counts.",
            "  CP us     every call context-parallel (cp_min_blocks=0)",
            "  local us  every call scored by each rank alone for its own heads",
            "  saved us  CP us - local us where local is faster: what the gate saves per call",
            "            at that size ('-': CP is faster)",
            "  auto      the path cp_min_blocks='auto' takes at that size on these ranks",
            "  agree     both paths' outputs equal, bit for bit",
            "crossover: the fewest blocks from which CP is faster at every larger size of the",
            "sweep; the saved figures sum CP us - local us over the sizes below it (negative",
            "where CP is faster at a size below it).",
        ]
    )
