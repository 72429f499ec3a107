"""A stress probe of the one-process world's `ipc` handshake on one GPU (docs/design.md, the
one-process world's rules; docs/BENCHMARKS.md, "GPU test results"): does code run between
pushes stall it?

    python benchmarks/handshake_probe.py VARIANT [WORLD]      # or: bash benchmarks/device.sh probe

Runs 400 calls per rank over 8 fp8 problems of changing shape (those of the 10,000-call test)
with `timeout_s=2`, in one of these variants, and prints PASS or the first error of every rank
(run it under CUDA_MODULE_LOADING=EAGER and =LAZY to see rule 3):

    full      the test: a first pass copied out with a kernel, then push / ne / or / fill,
              synchronizing every 8 calls
    pushonly  only score_push, synchronizing every 8 calls
    synceach  the full loop, synchronizing after every call
    onegrid   the full loop with one shape only (rows 32, width 67)
"""

from __future__ import annotations

import sys

import torch

from cpindex import CPIndexConfig, IndexCP, testing
from cpindex.world import run_threads

DEV = "cuda:0"


def problems(one_shape: bool) -> list[testing.Problem]:
    gen = torch.Generator().manual_seed(21)
    out = []
    for i in range(8):
        rows = int(torch.randint(1, 33, (1,), generator=gen))
        rows = [1, 32][i] if i < 2 else rows
        length = int(torch.randint(1, 64 * 128 + 1, (1,), generator=gen))
        if one_shape:
            rows, length = 32, 64 * 128
        prob = testing.make_problem(rows, length, "fp8", num_heads=4, seed=2100 + i, device=DEV)
        out.append(prob)
    return out


def main() -> None:
    variants = ("full", "pushonly", "synceach", "onegrid")
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in variants:
        sys.exit(f"usage: handshake_probe.py {{{','.join(variants)}}} [WORLD]")
    variant = sys.argv[1]
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    probs = problems(variant == "onegrid")
    calls = 400

    def job(comm):
        cfg = CPIndexConfig(max_rows=32, max_width=256, transport="ipc", cache_format="fp8",
                            timeout_s=2.0)  # fmt: skip
        with IndexCP(cfg, device=DEV, comm=comm) as cp:
            qs = [p.rank_queries(comm.rank, world) for p in probs]
            args = [
                (p.index_cache, cp.plan(p.block_table, p.seq_lens, width=p.width)) for p in probs
            ]
            keep = [torch.empty(q.shape[1], p.rows, p.width, device=DEV) for p, q in
                    zip(probs, qs, strict=True)]  # fmt: skip
            diff = [torch.empty_like(k, dtype=torch.bool) for k in keep]
            comm.barrier()
            if variant != "pushonly":
                for k, q, a in zip(keep, qs, args, strict=True):
                    torch.mul(cp.score_push(q, *a), 1, out=k)
            for i in range(calls):
                k = i % len(probs)
                out = cp.score_push(qs[k], *args[k])
                if variant != "pushonly":
                    torch.ne(out, keep[k], out=diff[k])
                    out.fill_(float("nan"))
                if variant == "synceach" or k == len(probs) - 1:
                    torch.cuda.current_stream().synchronize()
            torch.cuda.current_stream().synchronize()
            cp.check()
            comm.barrier()
        return True

    try:
        run_threads(world, job, device=DEV, timeout_s=12)
        print(f"{variant} world {world}: PASS")
    except Exception as e:  # a probe: report, don't raise
        notes = " | ".join(getattr(e, "__notes__", []))
        print(f"{variant} world {world}: FAIL {type(e).__name__}: {e} | {notes}"[:600])


if __name__ == "__main__":
    main()
