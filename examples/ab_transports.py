"""Compare cpindex's transports from Python: time each one on the same decode step and check
that they agree with each other and with the reference.

    python examples/ab_transports.py [--world 4] [--requests 8] [--context 4096] [--calls 20]

The world fits the machine: one NCCL process per GPU with at least ``--world`` GPUs; on a single
GPU the one-process world (``cpindex.world.run_threads``: ranks are threads, each with its own
stream, sharing the GPU, which is how ``ipc`` runs on one GPU); gloo processes on a CPU machine.
A transport this machine cannot run (``ipc`` and ``mori`` need GPUs) is reported with the reason
every rank agreed on, and the comparison goes on without it. For graph-replay timings and the
full sweep, use ``python -m cpindex bench``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # before CUDA starts (docs/design.md)

import torch

from cpindex import CPIndexConfig, IndexCP, TransportUnavailable, partition, reference, testing
from cpindex.comm import Comm, TorchComm
from cpindex.spawn import spawn_processes
from cpindex.world import run_threads

TRANSPORTS = ["ipc", "mori", "collective", "auto"]


def job(comm: Comm, args: argparse.Namespace, device: torch.device) -> dict:
    """Every rank: the same problem, each transport in turn; rank-local results."""
    prob = testing.make_problem(
        args.requests, args.context, args.format, query_len=args.query_len, seed=1, device=device
    )
    iq = prob.rank_queries(comm.rank, comm.world_size)  # this rank's heads only
    sizes = dict(max_rows=prob.rows, max_query_len=args.query_len, max_width=prob.width)
    results: dict = {}
    for name in TRANSPORTS:
        config = CPIndexConfig(transport=name, cache_format=args.format, **sizes)
        try:
            cp = IndexCP(config, device=device, comm=comm)  # collective: all ranks agree
        except TransportUnavailable as e:  # raised on every rank alike
            results[name] = {"unavailable": str(e).splitlines()[0]}
            continue
        with cp:  # close() on the way out, collectively
            plan = cp.plan(
                prob.block_table, prob.seq_lens, query_len=args.query_len, width=prob.width
            )
            first = cp.score_push(iq, prob.index_cache, plan)
            sync(device)
            comm.barrier()  # nobody launches again while the results are copied out
            scores = first.cpu()
            comm.barrier()
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                cp.score_push(iq, prob.index_cache, plan)
                sync(device)  # one call at a time: the time includes the wait for every peer
                times.append(time.perf_counter() - t0)
            comm.barrier()
            results[name] = {
                "resolved": cp.transport_name,
                "median_us": sorted(times)[len(times) // 2] * 1e6,
                "scores": scores,
            }
    heads = partition.heads_of_rank(comm.rank, 4, comm.world_size)
    want = reference.block_scores(
        prob.q.cpu(), prob.to("cpu").index_cache, prob.block_table.cpu(), prob.seq_lens.cpu(),
        init_blocks=0, local_blocks=1, width=prob.width, query_len=args.query_len,
    )[heads[0] : heads[-1] + 1]  # fmt: skip
    return {"rank": comm.rank, "results": results, "want": want}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def report(per_rank: list[dict], world: int, where: str) -> None:
    """Print the comparison (rank 0's view) and fail if any rank's transports disagree."""
    print(f"{world} ranks, {where}")
    ran = [t for t, r in per_rank[0]["results"].items() if "unavailable" not in r]
    base = ran[0]
    for name, r in per_rank[0]["results"].items():
        if "unavailable" in r:
            why = r["unavailable"]
            print(f"  {name:<20} unavailable: {why if len(why) < 150 else why[:150] + ' ...'}")
            continue
        same = all(torch.equal(p["results"][name]["scores"], p["results"][base]["scores"])
                   for p in per_rank)  # fmt: skip
        close = all(agrees(p["results"][name]["scores"], p["want"]) for p in per_rank)
        label = name if r["resolved"] == name else f"{name} ({r['resolved']})"
        print(f"  {label:<20} {r['median_us']:>10.1f} us/call   same bits as {base}: "
              f"{yes(same)}   matches the reference: {yes(close)}")  # fmt: skip
        if not (same and close):
            raise SystemExit(f"{name} disagrees")


def yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Forced and -inf columns exactly, scanned ones within 1e-5 of the row's largest |score|
    (docs/contract.md §3)."""
    scanned = torch.isfinite(want) & (want.abs() < 1e29)
    if not torch.equal(got[~scanned], want[~scanned]):
        return False
    if not scanned.any():
        return True
    return bool((got - want)[scanned].abs().max() <= 1e-5 * want[scanned].abs().max())


def process_main(rank: int, world: int, args: argparse.Namespace, use_cuda: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    comm = TorchComm()  # the default process group, which spawn_processes set up
    per_rank = comm.all_gather_object(job(comm, args, device))
    if rank == 0:
        report(per_rank, world, f"one process each ({'NCCL' if use_cuda else 'gloo, CPU'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4, choices=[2, 4], help="ranks")
    ap.add_argument("--requests", type=int, default=8, help="requests per step")
    ap.add_argument("--context", type=int, default=4096, help="longest request, tokens")
    ap.add_argument("--query-len", type=int, default=1, help="query tokens per request")
    ap.add_argument("--format", default="nvfp4", choices=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--calls", type=int, default=20, help="timed calls per transport")
    args = ap.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= args.world:
        spawn_processes(args.world, process_main, args, True, backend="nccl")
    elif gpus >= 1:
        dev = torch.device("cuda", 0)
        per_rank = run_threads(args.world, lambda comm: job(comm, args, dev), device=dev)
        report(per_rank, args.world, "threads of one process sharing one GPU")
    else:
        spawn_processes(args.world, process_main, args, False, backend="gloo")


if __name__ == "__main__":
    main()
