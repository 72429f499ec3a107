"""``python -m cpindex demo``: the main job end to end on whatever this machine has.

Spawns a W-rank world (gloo processes on a CPU machine, NCCL processes with W GPUs, the
one-process world on a single GPU), builds one random ragged decode step, runs ``score_push`` on
every rank, checks each rank's scores against the single-process reference, runs the top-16
selection (``select_blocks``) against the reference's, and prints a short summary.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass

import torch

from . import formats, partition, reference, testing
from .api import IndexCP
from .cli_common import (
    DEVICE_OVERHEAD,
    GPU_TRANSPORTS,
    HOST_OVERHEAD,
    UsageError,
    check_world_memory,
    first_error,
    problem_bytes,
)
from .comm import Comm, TorchComm
from .config import CPIndexConfig
from .spawn import spawn_processes
from .world import run_threads


@dataclass
class DemoArgs:
    world: int = 4
    rows: int = 8
    context: int = 8192
    fmt: str = "nvfp4"
    transport: str = "auto"
    seed: int = 0
    repeats: int = 5


def config(args: DemoArgs, world_size: int | None = None) -> CPIndexConfig:
    """The configuration every rank builds (``world_size`` given: bound to it, as the ranks'
    instances bind it)."""
    return CPIndexConfig(
        transport=args.transport,
        cache_format=args.fmt,
        max_rows=max(args.rows, 8),
        max_width=-(-args.context // 128),
        world_size=world_size,
    )


def check(args: DemoArgs) -> None:
    """Refuse, before any rank starts, what every rank would refuse, and sizes this machine's
    memory cannot hold (one line naming the options)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 and args.transport in GPU_TRANSPORTS:
        raise UsageError(
            f"--transport {args.transport} needs GPUs and this machine has none; use "
            "--transport collective (or auto)"
        )
    try:
        CPIndexConfig(world_size=args.world)  # the heads (4) split over the ranks
    except ValueError as e:
        raise UsageError(f"--world {args.world}: {first_error(e)}") from None
    sizes = f"--rows {args.rows} --context {args.context}"
    try:
        cfg = config(args, args.world)
    except ValueError as e:
        raise UsageError(f"{sizes}: {first_error(e)}") from None
    # Every rank builds the whole problem on the host, moves it to its device and checks its
    # share against the reference there; its buffers are on its device (or the host).
    host, cache = problem_bytes(args.rows, args.context, formats.BYTES_PER_TOKEN[args.fmt])
    buffers = cfg.buffer_bytes(args.world)
    host += HOST_OVERHEAD + (0 if gpus else buffers)
    device = cache + buffers + DEVICE_OVERHEAD
    fix = "lower --rows, --context or --world"
    check_world_memory(f"{sizes} on {args.world} ranks", args.world, gpus, host, device, fix)


def _rank_job(comm: Comm, args: DemoArgs, device: torch.device) -> dict:
    cfg = config(args)
    prob = testing.make_problem(args.rows, args.context, args.fmt, seed=args.seed, device=device)
    with IndexCP(cfg, device=device, comm=comm) as cp:
        iq = prob.rank_queries(comm.rank, comm.world_size)
        plan = cp.plan(prob.block_table, prob.seq_lens, width=prob.width)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = cp.score_push(iq, prob.index_cache, plan)
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            times.append(time.perf_counter() - t0)
        out = out.clone()
        picked = cp.select_blocks(iq, prob.index_cache, plan).clone()
        heads = partition.heads_of_rank(comm.rank, cfg.num_heads, comm.world_size)
        kw = dict(init_blocks=0, local_blocks=1, width=prob.width, sm_scale=cfg.sm_scale)
        inputs = (prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
        want = reference.block_scores(*inputs, **kw)[heads]
        picked_ref = reference.select_blocks(*inputs, **kw)[heads]
        finite = torch.isfinite(want)
        err = (out - want).abs()[finite].max().item() if finite.any() else 0.0
        scale = want[finite].abs().max().item() if finite.any() else 1.0
        same_inf = torch.equal(torch.isinf(out), torch.isinf(want))
        match = same_inf and err <= 1e-3 * max(scale, 1.0)
        scanned = partition.scanned_blocks(prob.seq_lens, comm.rank, comm.world_size, 0, 1)
        return {
            "rank": comm.rank,
            "transport": cp.transport_name,
            "device": str(device),
            "median_ms": sorted(times)[len(times) // 2] * 1e3,
            "bytes": scanned * 128 * formats.BYTES_PER_TOKEN[args.fmt],
            "max_err": err,
            "match": bool(match),
            "topk_match": bool(torch.equal(picked, picked_ref)),
        }


def _process_job(rank: int, world: int, args: DemoArgs, use_cuda: bool, path: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    comm = TorchComm()
    res = _rank_job(comm, args, device)
    results = comm.all_gather_object(res)
    if rank == 0:  # the parent prints them
        with open(path, "w") as f:
            json.dump(results, f)


def report(results: list[dict], args: DemoArgs) -> bool:
    """Print the summary; True when every rank matched the reference."""
    total = -(-args.context // 128)
    print(
        f"cpindex demo: {args.world} ranks, {args.rows} rows up to {args.context} tokens "
        f"({total} blocks), format {args.fmt}, transport {results[0]['transport']}"
    )
    print(
        f"{'rank':>4} {'device':>8} {'time/call':>11} {'scanned':>10} {'max|err|':>9}"
        "  match  top-16"
    )
    for r in results:
        print(
            f"{r['rank']:>4} {r['device']:>8} {r['median_ms']:>8.2f} ms "
            f"{r['bytes'] / 2**20:>7.2f} MiB "
            f"{r['max_err']:>9.2e}  {'yes' if r['match'] else 'NO':>5}  "
            f"{'same' if r['topk_match'] else 'DIFF':>6}"
        )
    ok = all(r["match"] and r["topk_match"] for r in results)
    print("all ranks match the reference" if ok else "MISMATCH")
    return ok


def run(args: DemoArgs) -> list[dict]:
    """Pick the world that fits this machine, run the demo in it, and return every rank's
    result. A failed rank raises (:class:`cpindex.spawn.RanksFailed` for processes)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 1 <= gpus < args.world:  # one GPU: the one-process world, one stream per rank
        dev = torch.device("cuda", 0)
        return run_threads(args.world, lambda c: _rank_job(c, args, dev), device=dev)
    with tempfile.TemporaryDirectory(prefix="cpindex-demo-") as tmp:
        path = os.path.join(tmp, "results.json")  # rank 0's process hands the results back here
        on_gpus = gpus >= args.world
        backend = "nccl" if on_gpus else "gloo"
        spawn_processes(args.world, _process_job, args, on_gpus, path, backend=backend)
        with open(path) as f:
            return json.load(f)
