"""``cpindex bench`` (the CP gate): where context parallelism starts to pay.

For one format, a sweep of requests x context, each size timed twice on the same inputs: with
the gate forced off (``cp_min_blocks=0``: every call context-parallel) and forced on (every
call scored by each rank alone for its own heads). The table shows both times per size, the
crossover the sweep finds (the fewest blocks from which context parallelism is faster at every
larger size), what calls below it save, and where ``cp_min_blocks="auto"`` put the threshold on
the same ranks (docs/design.md, "CP per call: the gate").

World: one process per GPU over NCCL when there are enough GPUs (the setting the gate is
for), else the one-process world on one GPU, where the ranks share one GPU's bandwidth, so
context parallelism shows its overhead only and rarely wins; on a CPU machine, the one-process
world of CPU ranks (the reference scorer).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field

import torch

from .. import testing
from ..api import IndexCP
from ..comm import Comm, TorchComm
from ..config import CPIndexConfig
from ..spawn import spawn_processes
from ..world import run_threads
from .timing import summarize, synthetic_cache, synthetic_queries, time_calls, time_graph

K = 1024
#: ``cp_min_blocks`` that no call reaches: every call below the gate.
LOCAL_ALWAYS = 1 << 40
SELECT_TOPK = 16


@dataclass
class Spec:
    fmt: str = "nvfp4"
    world: int = 4
    requests: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    contexts: list[int] = field(default_factory=lambda: [4 * K, 16 * K, 64 * K, 128 * K])
    query_len: int = 1
    op: str = "score_push"  # or "select_blocks" (topk 16)
    iters: int = 50
    graphs: bool = True


def _problem(spec: Spec, requests: int, ctx: int, device: torch.device) -> testing.Problem:
    """``requests`` full-length requests of ``ctx`` tokens; the same data on every rank."""
    t = spec.query_len
    if device.type != "cuda":
        lens = torch.full((requests,), ctx, dtype=torch.int32)
        return testing.make_problem(requests, ctx, spec.fmt, query_len=t, lengths=lens, seed=ctx)
    blocks = -(-ctx // 128)
    cache = synthetic_cache(requests * blocks, spec.fmt, device, seed=requests + ctx)
    table = torch.arange(requests * blocks, dtype=torch.int32, device=device)
    lens = torch.full((requests,), ctx, dtype=torch.int32, device=device)
    q = synthetic_queries(requests * t, 4, spec.fmt, device, seed=ctx)
    return testing.Problem(q, cache, table.view(requests, blocks), lens, blocks, spec.fmt, t)


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


def _rank_job(comm: Comm, spec: Spec, device: torch.device) -> dict:
    rows_max = max(spec.requests) * spec.query_len
    base = dict(
        cache_format=spec.fmt, max_rows=rows_max, max_query_len=spec.query_len,
        max_width=-(-max(spec.contexts) // 128), max_topk=SELECT_TOPK,
    )  # fmt: skip
    auto = IndexCP(CPIndexConfig(**base), device=device, comm=comm)
    gate = auto.gate
    auto.close()
    cps = {
        name: IndexCP(CPIndexConfig(**base, cp_min_blocks=value), device=device, comm=comm)
        for name, value in (("cp", 0), ("local", LOCAL_ALWAYS))
    }
    rows: list[dict] = []
    for requests in spec.requests:
        for ctx in spec.contexts:
            prob = _problem(spec, requests, ctx, device)
            iq = prob.rank_queries(comm.rank, comm.world_size)
            args = (prob.index_cache, prob.block_table, prob.seq_lens, 0, 1, prob.width)
            kw: dict = {"query_len": spec.query_len}
            if spec.op == "select_blocks":
                kw["topk"] = SELECT_TOPK
            fns = {name: _caller(getattr(cp, spec.op), (iq, *args), kw) for name, cp in cps.items()}
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
            del prob, outs
    transport = cps["cp"].transport_name
    for cp in cps.values():
        cp.close()
    return {
        "format": spec.fmt,
        "world": comm.world_size,
        "query_len": spec.query_len,
        "op": spec.op,
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


def _process_job(rank: int, world: int, spec: Spec, path: str) -> None:
    import json

    device = torch.device("cuda", torch.cuda.current_device())
    res = _rank_job(TorchComm(), spec, device)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(res, f)


def run(spec: Spec | None = None, **kw) -> dict:
    """The sweep (``Spec`` fields as keywords, or a ``spec``); rank 0's results."""
    import json

    spec = spec or Spec(**kw)
    if spec.op not in ("score_push", "select_blocks"):
        raise ValueError(f"op: expected 'score_push' or 'select_blocks', got {spec.op!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= spec.world > 1:
        with tempfile.TemporaryDirectory(prefix="cpindex-gate-") as tmp:
            path = os.path.join(tmp, "rank0.json")
            spawn_processes(spec.world, _process_job, spec, path, backend="nccl")
            with open(path) as f:
                res = json.load(f)
    else:
        dev = torch.device("cuda", 0) if gpus else torch.device("cpu")
        res = run_threads(spec.world, lambda c: _rank_job(c, spec, dev), device=dev)[0]
    res["spec"] = asdict(spec)
    return res


def crossover(rows: list[dict]) -> int | None:
    """The fewest blocks from which context parallelism is faster at every larger size of the
    sweep; None when it is not faster at the largest."""
    points = sorted((r["blocks"], r["cp"]["median_ms"] < r["local"]["median_ms"]) for r in rows)
    found = None
    for blocks, cp_wins in reversed(points):
        if not cp_wins:
            break
        found = blocks
    return found


def _setting(res: dict) -> str:
    if res["device"].startswith("cpu"):
        return " (CPU ranks: the reference scorer)"
    if not res.get("distinct_gpus"):
        return " (the ranks share one GPU: CP shows its overhead only)"
    return ""


def table(res: dict) -> str:
    rows = sorted(res["rows"], key=lambda r: (r["blocks"], r["requests"]))
    gate = res["gate"]
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
        out.append(
            f"{r['requests']:>4} {r['context'] / K:>5g}K {r['blocks']:>7} {cp:>9.1f} "
            f"{local:>9.1f} {local / cp:>8.2f} {cp - local:>9.1f} "
            f"{'CP' if r['auto_cp'] else 'local':>5} {'yes' if r['agree'] else 'NO':>5}"
        )
    cross = crossover(rows)
    below = [r for r in rows if cross is None or r["blocks"] < cross]
    saved = [(r["cp"]["median_ms"] - r["local"]["median_ms"]) * 1e3 for r in below]
    if cross is None:
        found = f"CP is not faster at the sweep's largest size ({rows[-1]['blocks']} blocks)"
    elif cross == rows[0]["blocks"]:
        found = f"CP is faster at every size, from the smallest ({cross} blocks)"
    else:
        found = f"crossover at {cross} blocks: CP is faster from there on"
    out.append(found)
    if saved:
        mean = sum(saved) / len(saved)
        pct = sum(
            (r["cp"]["median_ms"] - r["local"]["median_ms"]) / r["cp"]["median_ms"] for r in below
        )
        out.append(
            f"below it, scoring locally saves {mean:.1f} us per call on average "
            f"({100 * pct / len(below):.0f} % of the CP time; {len(below)} sizes)"
        )
    model = ""
    if gate.get("t_exchange_s") is not None:
        model = (
            f": t_exchange {gate['t_exchange_s'] * 1e6:.1f} us, "
            f"{gate['bandwidth'] / 1e12:.2f} TB/s, {gate['page_bytes']}-byte pages"
        )
    picks = sum((r["auto_cp"] == (r["cp"]["median_ms"] < r["local"]["median_ms"])) for r in rows)
    out.append(
        f"cp_min_blocks='auto' on these ranks: {gate['threshold']} blocks ({gate['source']}"
        f"{model}); it takes the faster path at {picks} of {len(rows)} sizes"
    )
    return "\n".join(out)


LEGEND = "\n".join(
    [
        "Times: median per call over the timed repetitions (CUDA graph replays of 8 calls where",
        "capturable). blocks = requests x width, what the gate counts.",
        "  CP us     every call context-parallel (cp_min_blocks=0)",
        "  local us  every call scored by each rank alone for its own heads",
        "  saved us  CP us - local us: what the gate saves at that size (negative: CP pays)",
        "  auto      the path cp_min_blocks='auto' takes at that size on these ranks",
        "  agree     both paths' outputs equal, bit for bit",
    ]
)
