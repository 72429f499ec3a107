"""``cpindex bench --gate`` (the CP gate): where context parallelism starts to pay.

For one format, transport, query length and call, a sweep of requests x context, each size
timed twice on the same inputs: with the gate forced off (``cp_min_blocks=0``: every call
context-parallel) and forced on (every call scored by each rank alone for its own heads). The
table shows both times per size and what scoring locally saves where it is faster; under it, the
crossover the sweep finds (the fewest blocks from which context parallelism is faster at every
larger size), what calls below it save, and where ``cp_min_blocks="auto"`` put the threshold on
the same ranks (docs/design.md, "CP per call: the gate").

World: one process per GPU over NCCL when there are enough GPUs (the setting the gate is
for); on a CPU machine, the one-process world of CPU ranks (the reference scorer).

**One GPU (deployment mode).** With fewer GPUs than ranks, the sweep measures per rank and per
call what a deployment of W such GPUs would see, as CUDA graph replays on the one GPU: CP is
rank 0's share of the call for all H heads (the fused kernel in local mode over columns 0, W,
2W, ...; for ``select_blocks`` also the shard's candidates and the merge of W ranks' top-k),
with the exchange left out and its latency added from the gate's model
(``gate.DEFAULT_EXCHANGE_S`` of the transport ``auto`` would take there, ``ipc``); local is the
rank's own heads over every block, through ``IndexCP``'s local path (a world of one holding
those heads). Consecutive calls read other copies of the pages, as a decode step's other
layers would. Per size it also times the host µs of eager calls on both paths, checks the local
scores against the share's bit for bit (and the local selection against the torch one of those
scores), and says whether ``auto``'s path (the model's threshold per op for W GPUs of this
bandwidth) is within 5 % of the faster one. Under the tables: each op's crossover and
threshold per format and T, and the local path's targets (select_blocks' host µs against
score_push's, and its graph time against the scan's). One command covers the whole grid (about
2 to 4 minutes on an H100)::

    python -m cpindex bench --gate --select --formats nvfp4,fp8 --query-len 1,4 \\
        --out gate.json
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
        **_head(spec, w, device),
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


# ---- one GPU: per rank per call as a W-GPU deployment sees it ---------------------------------

#: Copies of a size's pages that consecutive timed calls rotate over (and the calls a graph
#: holds, at least 8).
MAX_SETS = 32
#: Eager calls timed per path and size for the host µs (median).
HOST_CALLS = 60
#: Within this share of the faster path, ``auto``'s pick counts as right (issue target).
AUTO_SLACK = 0.05


def model_transport(spec: Spec) -> str:
    """The transport a deployment's ``auto`` would take: ``ipc`` on NVLink/xGMI GPUs."""
    return "ipc" if spec.transport == "auto" else spec.transport


def _with(cfg: CPIndexConfig, **changes) -> CPIndexConfig:
    """``cfg`` with ``changes``, validated again."""
    return CPIndexConfig(**{**cfg.model_dump(), **changes})


class _Share:
    """Rank 0's share of a W-rank call for all H heads, as the context-parallel path scans it
    before any exchange: the fused kernel in local mode over columns ``0, W, 2W, ...``
    (``score_push``), and for ``select_blocks`` the shard's candidates (in the scoring launch)
    and the merge of the W ranks' candidates. The peers' candidates are absent (one GPU): the
    merge reads rank 0's and W - 1 slots of filler, the same work as W ranks' keys."""

    def __init__(self, device: torch.device, fmt: str, world: int, heads: int) -> None:
        from ..kernels.launcher import ErrorMonitor, KernelScorer

        self.world, self.heads = world, heads
        self.hpr = max(1, heads // world)
        self.scorer = KernelScorer(
            device, fmt, num_heads=heads, rank=0, world=world, sm_scale=128**-0.5,
            monitor=ErrorMonitor(device, 0),
        )  # fmt: skip
        self.device = device

    def prepare(self, rows: int, width: int, topk: int | None):
        """Buffers and targets for one size (allocated here, outside any capture)."""
        from .. import partition, selection
        from ..kernels.launcher import SelectTargets

        w, h, hpr, dev = self.world, self.heads, self.hpr, self.device
        shard = torch.empty(h, rows, partition.shard_width(width, w), device=dev)
        if topk is None:
            return shard, None, None
        send = torch.full((w, hpr, rows, topk), selection.FILLER, dtype=torch.int64, device=dev)
        recv = torch.full_like(send, selection.FILLER)
        ids = torch.empty(hpr, rows, topk, dtype=torch.int32, device=dev)
        vals = torch.empty(hpr, rows, topk, device=dev)
        owners = partition.head_owners(h, w)
        targets = SelectTargets(
            topk=topk,
            heads_per_rank=hpr,
            cand_copies=len(owners[0]),
            cand_dst=tuple(
                send[d, partition.heads_of_rank(d, h, w).index(hh)].data_ptr()
                for hh in range(h)
                for d in owners[hh]
            ),
            cand=recv.data_ptr(),
            ids_out=ids.data_ptr(),
            scores_out=vals.data_ptr(),
        )
        return shard, targets, (send, recv)

    def call(self, q, cache, table, lens, width, t, shard, targets) -> None:
        img = self.scorer.score_local(
            q, cache, table, lens, shard, init_blocks=0, local_blocks=1, width=width,
            query_len=t, shard=True, select=targets,
        )  # fmt: skip
        if targets is not None:
            self.scorer.merge(img)


def _deploy_sweep(comm: Comm, spec: Spec, device: torch.device, progress: Progress) -> dict:
    """One sweep on one GPU in deployment terms (module docstring): per size, rank 0's CP share
    and the local path as graph replays, the exchange's latency from the model, the host µs
    of eager calls on both paths, and the local path checked against the share bit for bit."""
    from .. import gate, partition, selection
    from .host_cost import host_us
    from .kernel_sweep import ROTATE_BYTES
    from .timing import synthetic_cache, synthetic_queries

    w, heads = spec.world, 4
    hpr = max(1, heads // w)
    transport = model_transport(spec)
    g = gate.modeled(spec.fmt, transport, w, gate.hbm_bandwidth(device))
    t_ex = g.t_exchange_s or 0.0
    topk = SELECT_TOPK if spec.op == "select_blocks" else None
    base = config(spec, 1)
    # The local path exactly as a rank of W runs it: a world of one holding this rank's heads
    # (auto never goes context-parallel there). The CP host path: the same rank pushing.
    local_cfg = _with(base, num_heads=hpr, transport="auto")
    local = IndexCP(local_cfg, device=device, comm=comm)
    try:
        cp_host = IndexCP(
            _with(local_cfg, cp_min_blocks=0, transport=transport), device=device, comm=comm
        )
    except Exception:  # the transport cannot run as a world of one here: the default one
        cp_host = IndexCP(_with(local_cfg, cp_min_blocks=0), device=device, comm=comm)
    host_transport = cp_host.transport_name
    share = _Share(device, spec.fmt, w, heads)
    local_op, host_op = getattr(local, spec.op), getattr(cp_host, spec.op)
    page = gate.page_bytes(spec.fmt)
    rows_out: list[dict] = []
    for requests in spec.requests:
        for ctx in spec.contexts:
            nb = blocks(ctx)
            t = spec.query_len
            # Consecutive calls read other pages (another layer's cache, as in a decode step),
            # over up to MAX_SETS copies, so that the calls near the crossover read HBM.
            sets = max(1, min(MAX_SETS, -(-ROTATE_BYTES // (requests * nb * page))))
            per_graph = max(8, sets)
            cache = synthetic_cache(sets * requests * nb, spec.fmt, device, seed=requests + ctx)
            tables = torch.arange(sets * requests * nb, dtype=torch.int32, device=device)
            tables = tables.view(sets, requests, nb)
            lens = torch.full((requests,), ctx, dtype=torch.int32, device=device)
            q = synthetic_queries(requests * t, heads, spec.fmt, device, seed=ctx)
            iq = q[:, :hpr].contiguous()  # rank 0's heads
            plans = [local.plan(tables[s], lens, query_len=t, width=nb) for s in range(sets)]
            host_plans = [cp_host.plan(tables[s], lens, query_len=t, width=nb) for s in range(sets)]
            shard, targets, cands = share.prepare(requests * t, nb, topk)
            kw = {} if topk is None else {"topk": topk}

            def cp_call(i, a=(q, cache, tables, lens, nb, t, shard, targets, sets)):
                q_, cache_, tables_, lens_, nb_, t_, shard_, targets_, sets_ = a
                share.call(q_, cache_, tables_[i % sets_], lens_, nb_, t_, shard_, targets_)

            def local_call(i, a=(local_op, iq, cache, plans, kw)):
                op, iq_, cache_, plans_, kw_ = a
                op(iq_, cache_, plans_[i % len(plans_)], **kw_)

            def host_call(i, a=(host_op, iq, cache, host_plans, kw)):
                op, iq_, cache_, plans_, kw_ = a
                op(iq_, cache_, plans_[i % len(plans_)], **kw_)

            # correctness first: the local scores are the share's at rank 0's columns (and
            # the local selection the torch one of those scores), bit for bit
            cp_call(0)
            if cands is not None:  # the merge reads rank 0's candidates, the rest filler
                cands[1][0].copy_(cands[0][0])
            got = local.score_push(iq, cache, plans[0]).clone()
            mine = shard[partition.heads_of_rank(0, heads, w)]
            agree = bool(torch.equal(got[..., ::w], mine[..., : got[..., ::w].shape[-1]]))
            if topk is not None:
                ids, vals = local.select_blocks(iq, cache, plans[0], topk=topk, return_scores=True)
                want_ids = torch.empty_like(ids)
                want_vals = torch.empty_like(vals)
                selection.select(got, topk, want_ids, want_vals)
                agree = agree and torch.equal(ids, want_ids) and torch.equal(vals, want_vals)
            torch.cuda.current_stream().synchronize()
            share_t = summarize(time_graph(cp_call, per_graph, spec.iters, 3))
            local_t = summarize(time_graph(local_call, per_graph, spec.iters, 3))
            cp_t = {k: v + t_ex * 1e3 for k, v in share_t.items()}  # + the exchange, in ms
            host = {
                "cp": host_us(host_call, HOST_CALLS)["host_us"],
                "local": host_us(local_call, HOST_CALLS)["host_us"],
            }
            b = requests * nb
            auto_cp = g.uses_cp(b, spec.op)
            best = min(cp_t["median_ms"], local_t["median_ms"])
            picked = cp_t["median_ms"] if auto_cp else local_t["median_ms"]
            rows_out.append(
                {
                    "requests": requests,
                    "context": ctx,
                    "blocks": b,
                    "agree": agree,
                    "auto_cp": auto_cp,
                    "auto_within": picked <= best * (1 + AUTO_SLACK),
                    "cp": cp_t,
                    "cp_share": share_t,
                    "local": local_t,
                    "host_us": host,
                }
            )
            progress.step(f"{spec.fmt} {spec.op} T={t} {requests} x {tokens(ctx)} (one GPU)")
    local.close()
    cp_host.close()
    return {
        **_head(spec, w, device),
        "mode": "deployment",
        "distinct_gpus": False,
        "transport": transport,
        "host_transport": host_transport,
        "graphs": True,
        "gate": {
            "threshold": g.threshold_for(spec.op),
            "thresholds": {op: g.threshold_for(op) for op in gate.OPS},
            "source": "model",
            "t_exchange_s": t_ex,
            "extra_s": dict(zip(gate.OPS, g.extra_s or (), strict=True)),
            "bandwidth": g.bandwidth,
            "page_bytes": g.page_bytes,
        },
        "rows": rows_out,
    }


def _head(spec: Spec, world: int, device: torch.device) -> dict:
    """What every sweep's results start with."""
    return {
        "format": spec.fmt,
        "world": world,
        "query_len": spec.query_len,
        "op": spec.op,
        "iters": spec.iters,
        "device": str(device),
    }


def _rank_job(comm: Comm, specs: list[Spec], device: torch.device) -> list[dict]:
    """Every sweep on this rank, in order (one world for all of them)."""
    total = sum(len(s.requests) * len(s.contexts) for s in specs)
    progress = Progress(total, "bench --gate", comm.rank == 0)
    try:
        return [_sweep(comm, spec, device, progress) for spec in specs]
    finally:
        progress.close()


def _deploy_job(comm: Comm, specs: list[Spec], device: torch.device) -> list[dict]:
    """Every sweep in deployment terms on this one GPU, in order."""
    total = sum(len(s.requests) * len(s.contexts) for s in specs)
    progress = Progress(total, "bench --gate (one GPU)", True)
    try:
        return [_deploy_sweep(comm, spec, device, progress) for spec in specs]
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
    elif gpus and world > 1:  # one GPU: per rank per call as W GPUs would see it
        dev = torch.device("cuda", 0)
        results = run_threads(1, lambda c: _deploy_job(c, specs, dev), device=dev)[0]
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
        **(_deploy_summary(rows) if res.get("mode") == "deployment" else {}),
    }


def _deploy_summary(rows: list[dict]) -> dict:
    """Deployment mode: at how many sizes ``auto``'s path is within :data:`AUTO_SLACK` of the
    faster one, and the median host µs per eager call of each path over the sizes."""
    return {
        "auto_within_5pct_at": sum(bool(r["auto_within"]) for r in rows),
        "host_us": {
            path: statistics.median(r["host_us"][path] for r in rows) for path in ("cp", "local")
        },
    }


def _setting(res: dict) -> str:
    if res.get("mode") == "deployment":
        ex = res["gate"]["t_exchange_s"] * 1e6
        return (
            f" (one GPU, per rank per call as {res['world']} GPUs would see it: CP = rank 0's "
            f"share for all heads + the model's {ex:.1f} us exchange)"
        )
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
    if "auto_within_5pct_at" in s:
        host = s["host_us"]
        line += (
            f"; within 5 % of the faster path at {s['auto_within_5pct_at']} of {s['sizes']} "
            f"sizes\nhost us per eager call (median over the sizes): CP {host['cp']:.1f}, "
            f"local {host['local']:.1f}"
        )
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
    deploy = res.get("mode") == "deployment"
    out = [
        head,
        f"{'req':>4} {'ctx':>6} {'blocks':>7} {'CP us':>9} {'local us':>9} {'local/CP':>8} "
        f"{'saved us':>9} {'auto':>5} {'agree':>5}"
        + (f" {'host CP':>8} {'host loc':>8}" if deploy else ""),
    ]
    for r in rows:
        cp, local = r["cp"]["median_ms"] * 1e3, r["local"]["median_ms"] * 1e3
        saved = f"{saved_us(r):.1f}" if local < cp else "-"
        host = f" {r['host_us']['cp']:>8.1f} {r['host_us']['local']:>8.1f}" if deploy else ""
        out.append(
            f"{r['requests']:>4} {tokens(r['context']):>6} {r['blocks']:>7} {cp:>9.1f} "
            f"{local:>9.1f} {local / cp:>8.2f} {saved:>9} "
            f"{'CP' if r['auto_cp'] else 'local':>5} {'yes' if r['agree'] else 'NO':>5}" + host
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
            *_deploy_legend([r for r in results if r.get("mode") == "deployment"]),
        ]
    )


def _deploy_legend(results: list[dict]) -> list[str]:
    """Deployment mode: what its columns mean, then per format and T each op's crossover and
    threshold, and the local path's targets: select_blocks' host µs against score_push's and
    its graph time against the scan's (score_push)."""
    if not results:
        return []
    out = [
        "One GPU (deployment mode): CP us = rank 0's share of the call for all heads (graph",
        "  replays; select_blocks: scoring, the shard's candidates and the merge) + the model's",
        "  exchange latency; local us = the rank's own heads over every block, through IndexCP's",
        "  local path. Consecutive calls read other copies of the pages (as other layers' caches",
        "  would; 8 to 32 calls a graph). host CP / host loc: host us per eager call (IndexCP, a",
        "  world of one; CP: the transport pushing alone).",
        "per op (crossover from the times above; auto: the model's threshold on W such GPUs):",
    ]
    by = {(r["format"], r["query_len"], r["op"]): r for r in results}
    for fmt, t in sorted({(f, q) for f, q, _ in by}):
        parts = []
        for op in OPS:
            r = by.get((fmt, t, op))
            if r is None:
                continue
            s = r.get("summary") or summary(r)
            cross = s["crossover_blocks"] if s["in_range"] else "none in range"
            parts.append(
                f"{op} crossover {cross}, auto {r['gate']['threshold']} "
                f"(within 5 % at {s['auto_within_5pct_at']}/{s['sizes']})"
            )
        line = f"  {fmt} T={t}: " + "; ".join(parts)
        score, select = by.get((fmt, t, "score_push")), by.get((fmt, t, "select_blocks"))
        if score is not None and select is not None:
            rows = {(x["requests"], x["context"]): x for x in score["rows"]}
            pairs = [
                (rows[k], x) for x in select["rows"] if (k := (x["requests"], x["context"])) in rows
            ]
            ratio = statistics.median(
                b["host_us"]["local"] / a["host_us"]["local"] for a, b in pairs
            )
            over = max((b["local"]["median_ms"] - a["local"]["median_ms"]) * 1e3 for a, b in pairs)
            line += (
                f"; local select/score host {ratio:.2f}x, local select - scan in a graph "
                f"at most {over:.1f} us"
            )
        out.append(line)
    return out
