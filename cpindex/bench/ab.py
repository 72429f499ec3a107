"""``cpindex bench``: the transports A/B on the same inputs, beside the scoring alone and the
no-CP baseline.

World: one process per GPU over NCCL when there are enough GPUs, the one-process world on a
single GPU (ranks share that GPU's memory bandwidth, so its CP times show the exchange overhead,
not the CP speedup), gloo processes on a CPU machine.

Columns per shape: each transport's time per call (median, p90) and its ratio to the fastest;
``score``: this rank's share scored alone (the fused kernel in local mode, or the reference on
CPU), which is what each GPU spends scanning in a real W-GPU deployment; ``no-CP``: one rank
scanning every block for its own head (what TP does without CP); and the scan bytes per rank.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import torch

from .. import formats, ops, partition, reference, testing  # noqa: F401  (ops: registers the op)
from ..api import IndexCP
from ..comm import Comm, TorchComm
from ..config import CPIndexConfig
from ..spawn import spawn_processes
from ..world import run_threads
from . import kernel_sweep
from .timing import (
    Progress,
    copy_bandwidth_gbs,
    summarize,
    synthetic_cache,
    synthetic_queries,
    time_calls,
    time_graph,
)

SELECT_TOPK = 16  # MiniMax-M3's sparse_topk_blocks


@dataclass
class Spec:
    transports: list[str]
    world: int
    formats: list[str]
    rows: list[int]
    contexts: list[int]
    graphs: bool
    iters: int
    query_lens: list[int] = field(default_factory=lambda: [1])  # query rows per request
    select: bool = False  # also time select_blocks and score_push + torch.topk (topk 16)


def blocks(context: int) -> int:
    """Blocks of a ``context``-token request (a partial last block counts)."""
    return -(-context // 128)


def tokens(n: int) -> str:
    """A context length for the table: ``32K`` for whole KiB of tokens, else the count."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def configs(spec: Spec, world_size: int | None = None) -> dict[tuple[str, str], CPIndexConfig]:
    """The instances' configurations by (format, transport), sized for every shape of ``spec``
    (``world_size`` given: bound to it, as the ranks' instances bind it)."""
    t_max = max(spec.query_lens)
    return {
        (fmt, t): CPIndexConfig(
            transport=t,
            cache_format=fmt,
            max_rows=max(spec.rows) * t_max,
            max_query_len=t_max,
            max_width=blocks(max(spec.contexts)),
            world_size=world_size,
            cp_min_blocks=0,  # the A/B times the exchange at every size
        )
        for fmt in spec.formats
        for t in spec.transports
    }


def _problem(fmt: str, rows: int, ctx: int, t: int, device: torch.device) -> testing.Problem:
    """``rows`` full-length requests of ``t`` query rows; the same data on every rank."""
    if device.type != "cuda":
        lens = torch.full((rows,), ctx, dtype=torch.int32)
        return testing.make_problem(rows, ctx, fmt, query_len=t, lengths=lens, seed=rows * 7 + ctx)
    nb = blocks(ctx)
    cache = synthetic_cache(rows * nb, fmt, device, seed=rows + ctx)
    table = torch.arange(rows * nb, dtype=torch.int32, device=device).view(rows, nb)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device=device)
    q = synthetic_queries(rows * t, 4, fmt, device, seed=ctx)
    return testing.Problem(q, cache, table, lens, nb, fmt, t)


def _time(fn, spec: Spec, device: torch.device, capturable: bool = True, comm=None):
    if device.type == "cuda" and spec.graphs and capturable:
        return time_graph(fn, per_graph=8, replays=spec.iters, warmup=3, comm=comm)
    return time_calls(fn, spec.iters, 3, device)


def _rank_job(comm: Comm, spec: Spec, device: torch.device) -> list[dict]:
    out: list[dict] = []
    shapes = len(spec.formats) * len(spec.rows) * len(spec.contexts) * len(spec.query_lens)
    progress = Progress(shapes, "bench", comm.rank == 0)
    copy_gbs = None
    if comm.rank == 0:  # alone on the device: the roofline the 'score' column is read against
        copy_gbs = copy_bandwidth_gbs(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    comm.barrier()
    cfgs = configs(spec)
    for fmt in spec.formats:
        cps = {t: IndexCP(cfgs[fmt, t], device=device, comm=comm) for t in spec.transports}
        for rows, ctx, t_len in itertools.product(spec.rows, spec.contexts, spec.query_lens):
            prob = _problem(fmt, rows, ctx, t_len, device)
            iq = prob.rank_queries(comm.rank, comm.world_size)
            cache = prob.index_cache
            plans = {
                t: cp.plan(prob.block_table, prob.seq_lens, query_len=t_len, width=prob.width)
                for t, cp in cps.items()
            }
            rec = {
                "copy_gbs": copy_gbs,
                "format": fmt,
                "rows": rows,
                "query_len": t_len,
                "context": ctx,
                "world": comm.world_size,
                "device": str(device),
                "graphs": spec.graphs and device.type == "cuda",
            }
            # correctness first: every transport == the full single-device result
            full = _full_fn(prob, prob.q, device)(0)
            heads = partition.heads_of_rank(comm.rank, 4, comm.world_size)
            mine = full[heads[0] : heads[-1] + 1]  # a slice: no host-to-device index copy
            comm.barrier()  # all prep done before anyone launches push kernels
            agree = {}
            for t, cp in cps.items():
                got = cp.score_push(iq, cache, plans[t])
                if device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                comm.barrier()  # nobody launches the next push while equal() allocates
                agree[t] = bool(torch.equal(got, mine))
                comm.barrier()
            rec["agree"] = agree
            for t, cp in cps.items():
                fn = lambda i, cp=cp, iq=iq, c=cache, p=plans[t]: cp.score_push(iq, c, p)  # noqa: E731
                rec[t] = summarize(_time(fn, spec, device, cp.capturable, comm))
                rec[t]["graph"] = bool(spec.graphs and cp.capturable)
                rec["transport_" + t] = cp.transport_name
                if spec.select:
                    _time_selection(rec, t, cp, iq, cache, plans[t], spec, device, comm)
            comm.barrier()
            if comm.rank == 0:  # alone on the device: share scoring and no-CP baseline
                rec["score"] = summarize(_time(_share_fn(prob, comm, device), spec, device))
                own = prob.q[:, partition.heads_of_rank(0, 4, comm.world_size)].contiguous()
                rec["nocp"] = summarize(_time(_full_fn(prob, own, device), spec, device))
            comm.barrier()
            page = 128 * formats.BYTES_PER_TOKEN[fmt]
            rec["scan_bytes_rank"] = (
                max(
                    partition.scanned_blocks(prob.seq_lens, r, comm.world_size, 0, 1)
                    for r in range(comm.world_size)
                )
                * page
            )
            rec["scan_bytes_rank0"] = (
                partition.scanned_blocks(prob.seq_lens, 0, comm.world_size, 0, 1) * page
            )
            rec["scan_bytes_full"] = partition.scanned_blocks(prob.seq_lens, 0, 1, 0, 1) * page
            out.append(rec)
            progress.step(f"{fmt} rows={rows} T={t_len} context={ctx}")
            del prob
        for cp in cps.values():
            cp.close()
    progress.close()
    return out


def _time_selection(rec, t, cp, iq, cache, plan, spec, device, comm) -> None:
    """``select_blocks`` (topk 16) beside ``score_push`` + ``torch.topk`` of its scores, and the
    bytes each exchange sends per call from this rank.

    torch.topk is timed on its own, on a settled score_push output, and push+topk is the sum of
    the two medians (they run back to back on one stream). Timing them in one graph is not
    possible in the one-process world: topk of a long row memsets its semaphores, and a memset
    between two ranks' pushes stalls them (docs/design.md, the one-process world, rule 2)."""

    def select(i):
        return cp.select_blocks(iq, cache, plan, topk=SELECT_TOPK)

    scores = cp.score_push(iq, cache, plan)
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    comm.barrier()  # every rank's push done: topk alone from here on
    k = min(SELECT_TOPK, scores.shape[-1])
    rec[t + "_select"] = summarize(_time(select, spec, device, cp.capturable, comm))
    comm.barrier()  # every rank's selections done before any topk (which may memset) starts
    rec[t + "_topk"] = summarize(_time(lambda i: scores.topk(k, dim=-1), spec, device, True, comm))
    rec[t + "_push_topk"] = {"median_ms": rec[t]["median_ms"] + rec[t + "_topk"]["median_ms"]}
    rows, width = iq.shape[0], plan.width
    rec[t + "_bytes_scores"] = cp.exchange_bytes(rows, width)
    rec[t + "_bytes_select"] = cp.exchange_bytes(rows, width, SELECT_TOPK)


def _share_fn(prob: testing.Problem, comm: Comm, device: torch.device):
    w = comm.world_size
    if device.type == "cuda":
        share = kernel_sweep.share_scorer(device, prob.fmt, w)
        shard = torch.empty(4, prob.rows, partition.shard_width(prob.width, w), device=device)
        return lambda i: share(
            prob.q, prob.index_cache, prob.block_table, prob.seq_lens, shard, prob.width,
            prob.query_len,
        )  # fmt: skip
    cols = partition.owned_columns(0, w, prob.width)
    return lambda i: reference.block_scores(
        prob.q,
        prob.index_cache,
        prob.block_table,
        prob.seq_lens,
        init_blocks=0,
        local_blocks=1,
        width=prob.width,
        columns=cols,
        query_len=prob.query_len,
    )


def _full_fn(prob: testing.Problem, q_own: torch.Tensor, device: torch.device):
    if device.type == "cuda":
        return lambda i: torch.ops.cpindex.block_scores(
            q_own,
            prob.index_cache,
            None,
            prob.block_table,
            prob.seq_lens,
            0,
            1,
            prob.width,
            128**-0.5,
            prob.query_len,
        )
    return lambda i: reference.block_scores(
        q_own,
        prob.index_cache,
        prob.block_table,
        prob.seq_lens,
        init_blocks=0,
        local_blocks=1,
        width=prob.width,
        query_len=prob.query_len,
    )


def header(transports: list[str]) -> str:
    cols = "".join(f" {t + ' us':>13} {'x':>5}" for t in transports)
    return (
        f"{'fmt':>5} {'rows':>4} {'T':>2} {'ctx':>5} {'MiB/rank':>8} {'GB/s':>7}{cols} "
        f"{'score us':>9} {'% copy':>6} {'no-CP us':>9} {'CP gain':>7} {'agree':>5}"
    )


def line(r: dict, transports: list[str]) -> str:
    times = {t: r[t]["median_ms"] for t in transports}
    best = min(times.values())
    cols = "".join(f" {times[t] * 1e3:>13.1f} {times[t] / best:>5.2f}" for t in transports)
    score = r.get("score", {}).get("median_ms")
    nocp = r.get("nocp", {}).get("median_ms")
    gain = f"{nocp / best:>6.2f}x" if nocp else ""  # no-CP time over the fastest CP transport
    copy = r.get("copy_gbs")
    share = f"{r['scan_bytes_rank0'] / score / 1e6 / copy:>6.0%}" if score and copy else ""
    return (
        f"{r['format']:>5} {r['rows']:>4} {r.get('query_len', 1):>2} {tokens(r['context']):>5} "
        f"{r['scan_bytes_rank'] / 2**20:>8.2f} {r['scan_bytes_rank'] / best / 1e6:>7.2f}{cols} "
        f"{(score or 0) * 1e3:>9.1f} {share:>6} {(nocp or 0) * 1e3:>9.1f} {gain:>7} "
        f"{'yes' if all(r['agree'].values()) else 'NO':>5}"
    )


def table(rows: list[dict], transports: list[str]) -> str:
    copy = rows[0].get("copy_gbs") if rows else None
    out = [f"copy bandwidth: {copy:.0f} GB/s (read + write, rank 0 alone)"] if copy else []
    out += [header(transports), *(line(r, transports) for r in rows)]
    if any(t + "_select" in r for r in rows for t in transports):
        out += ["", select_header(), *(select_line(r, t) for r in rows for t in transports)]
    return "\n".join(out)


def select_header() -> str:
    return (
        f"{'fmt':>5} {'rows':>4} {'T':>2} {'ctx':>5} {'transport':>10} {'push us':>9} "
        f"{'select us':>10} {'sel/push':>8} {'push+topk us':>13} {'score B':>10} {'select B':>9}"
    )


def select_line(r: dict, t: str) -> str:
    push, sel = r[t]["median_ms"], r[t + "_select"]["median_ms"]
    ptk = r[t + "_push_topk"]["median_ms"]
    return (
        f"{r['format']:>5} {r['rows']:>4} {r.get('query_len', 1):>2} {tokens(r['context']):>5} "
        f"{t:>10} {push * 1e3:>9.1f} {sel * 1e3:>10.1f} {sel / push:>7.2f}x {ptk * 1e3:>13.1f} "
        f"{r[t + '_bytes_scores']:>10} {r[t + '_bytes_select']:>9}"
    )


def legend(spec: Spec, rows: list[dict]) -> str:
    """What the table's columns mean, printed under it."""
    graphs = any(r["graphs"] for r in rows)
    how = "CUDA graph replays of 8 calls where capturable" if graphs else "eager calls"
    lines = [
        f"Times: median per call in us over {spec.iters} timed repetitions ({how}).",
        "  rows, T   requests, and the query rows each scores (its pages are read once)",
        "  MiB/rank  index-cache bytes the busiest rank reads per call",
        "  GB/s      MiB/rank over the fastest transport's time",
        "  <t> us    one score_push call with transport <t>, exchange included",
        "  x         that time over the fastest transport's (1.00 = fastest)",
        "  score     rank 0's share scored alone, no exchange: what each GPU spends",
        "            scanning in a real W-GPU deployment",
        "  % copy    rank 0's share's bytes over that time, against the copy bandwidth above",
        "  no-CP     one rank scoring every block for its own head (TP without CP)",
        "  CP gain   no-CP over the fastest transport",
        "  agree     every transport's output equals the single-device result, bit for bit",
    ]
    if spec.select:
        lines += [
            "Selection (topk 16): push = score_push; select = select_blocks;",
            "  push+topk = score_push plus torch.topk of its scores (timed apart, medians added);",
            "  score B / select B = bytes",
            "  this rank sends its peers per call in the score / candidate exchange",
        ]
    return "\n".join(lines)


def _process_job(rank: int, world: int, spec: Spec, use_cuda: bool, results_path: str) -> None:
    import json

    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    comm = TorchComm()
    res = _rank_job(comm, spec, device)
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(res, f)


def run(spec: Spec) -> list[dict]:
    """Every shape on every transport; rank 0's records (progress on stderr, nothing on
    stdout)."""
    import json
    import os
    import tempfile

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 1 or (gpus > 1 and gpus < spec.world):
        dev = torch.device("cuda", 0)
        return run_threads(spec.world, lambda c: _rank_job(c, spec, dev), device=dev)[0]
    with tempfile.TemporaryDirectory(prefix="cpindex-bench-") as tmp:
        path = os.path.join(tmp, "rank0.json")  # rank 0's process hands its records back here
        spawn_processes(
            spec.world,
            _process_job,
            spec,
            gpus >= spec.world,
            path,
            backend="nccl" if gpus >= spec.world else "gloo",
        )
        with open(path) as f:
            return json.load(f)


def as_dict(spec: Spec) -> dict:
    return asdict(spec)
