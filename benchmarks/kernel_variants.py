"""Kernel build variants timed side by side, for deciding what ships (see docs/kernel.md).

    python benchmarks/kernel_variants.py --out DIR base= regs=CP_SMEM_RING=0 ...

Each ``name=DEFINES`` (space-separated ``MACRO=VALUE`` list, may be empty) is built through
``CPINDEX_KERNEL_DEFINES`` (all builds in parallel first), then timed with the kernel sweep of
``python -m cpindex bench --kernel`` in its own process. Prints % of copy bandwidth and µs per
call for every (format, rows, context) and variant, and writes DIR/variants.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

BUILD = "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0))"


def _variant(arg: str) -> tuple[str, str]:
    name, sep, defines = arg.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{arg!r}: expected NAME=DEFINES, e.g. 'regs=CP_SMEM_RING=0'"
        )
    return name, defines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", default="bf16,fp8,nvfp4")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--context", default="32k,128k")
    ap.add_argument("--iters", default="20")
    ap.add_argument("--query-len", default="1", help="comma list of query rows per request")
    ap.add_argument("--world", default="1", help="W > 1: rank 0's share of W (bench --kernel)")
    ap.add_argument("variants", nargs="+", type=_variant, help="name=DEFINES")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = dict(args.variants)
    envs = {n: {**os.environ, "CPINDEX_KERNEL_DEFINES": d} for n, d in variants.items()}
    builds = {n: subprocess.Popen([sys.executable, "-c", BUILD], env=e) for n, e in envs.items()}
    for n, proc in builds.items():
        if proc.wait() != 0:
            sys.exit(f"build of variant {n!r} failed")
    results = {}
    for n, env in envs.items():
        path = args.out / f"kernel-{n}.json"
        cmd = [sys.executable, "-m", "cpindex", "bench", "--kernel", "--formats", args.formats,
               "--rows", args.rows, "--context", args.context, "--iters", args.iters,
               "--query-len", args.query_len, "--world", args.world,
               "--out", str(path)]  # fmt: skip
        print(f"== {n}: {variants[n] or '(defaults)'}", flush=True)
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        results[n] = json.loads(path.read_text())
    names = list(results)
    print(f"{'fmt':>5} {'rows':>4} {'T':>2} {'ctx':>5} " + " ".join(f"{n:>16}" for n in names))
    for i, r in enumerate(results[names[0]]["kernel"]):
        cells = []
        for n in names:
            v = results[n]["kernel"][i]
            cells.append(f"{100 * v['of_copy']:>5.0f}% {v['kernel_ms'] * 1e3:>7.1f}us")
        t = r.get("query_len", 1)
        print(
            f"{r['format']:>5} {r['rows']:>4} {t:>2} {r['context'] // 1024:>4}K " + " ".join(cells)
        )
    (args.out / "variants.json").write_text(json.dumps({"defines": variants, **results}))


if __name__ == "__main__":
    main()
