"""Where the time of a pushed call goes, phase by phase, in the one-process world.

    python benchmarks/phase_trace.py --formats fp8 --rows 8,32 --context 32k,128k --query-len 4

Builds the kernel with ``CP_PHASE_TRACE`` (a measurement switch of the kernel: thread 0 of CTA 0
and of the last CTA to finish print the SM clock at each phase of every 128th call), runs
``python -m cpindex bench --select`` for each shape on the ``ipc`` transport, and prints, per
mode (``score_push`` or ``select_blocks``), rank and CTA, the median microseconds each phase took:

    queries   the query exchange (deliver this rank's queries, wait for every peer's)
    score     this CTA's share of the pages
    barrier   select: every CTA of the rank done scoring
    local     select: this rank's top k per (row, head), pushed to the owners
    ticket    the fences and the completion ticket
    wait      every peer's signal (the last CTA, or every CTA when selecting)
    merge     select: the owner's top k of the W * k candidates

and ``skew``: how much later than the earliest rank this rank's CTA ended the same call. The
trace build adds a CTA-wide sync per phase and a printf, so its totals run a little above the
benchmark's; the split is what it is for.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import defaultdict

PHASES = ["queries", "score", "barrier", "local", "ticket", "wait", "merge"]


def _parse(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        if not line.startswith("cp-trace "):
            continue
        f = line.split()
        rec = {"rank": int(f[2]), "call": int(f[4]), "cta": int(f[6]), "last": int(f[8]),
               "select": int(f[10]), "start_ns": int(f[12]), "end_ns": int(f[14]),
               "total": int(f[16])}  # fmt: skip
        marks = [int(x) for x in f[17:24]]  # phases 1..7, -1 where not passed
        prev = 0
        for name, m in zip(PHASES, marks, strict=True):
            rec[name] = m - prev if m >= 0 else None
            prev = m if m >= 0 else prev
        out.append(rec)
    return out


def _median(recs: list[dict], key: str, scale: float) -> str:
    vals = [r[key] for r in recs if r[key] is not None]
    return f"{statistics.median(vals) / scale:8.2f}" if vals else f"{'-':>8}"


def _summary(recs: list[dict], mhz: float) -> list[str]:
    ends: dict[tuple, list[int]] = defaultdict(list)
    for r in recs:
        ends[(r["select"], r["call"])].append(r["end_ns"])
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in recs:
        r["skew"] = (r["end_ns"] - min(ends[(r["select"], r["call"])])) / 1e3
        groups[(r["select"], r["rank"], "last" if r["last"] else "cta0")].append(r)
    lines = [f"{'mode':>7} {'rank':>4} {'cta':>4} {'n':>3} "
             + " ".join(f"{p:>8}" for p in PHASES) + f" {'total':>8} {'skew':>8}"]  # fmt: skip
    for (sel, rank, cta), rs in sorted(groups.items()):
        cells = [_median(rs, p, mhz) for p in [*PHASES, "total"]] + [_median(rs, "skew", 1.0)]
        mode = "select" if sel else "push"
        lines.append(f"{mode:>7} {rank:>4} {cta:>4} {len(rs):>3} " + " ".join(cells))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="fp8")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--context", default="32k,128k")
    ap.add_argument("--query-len", default="4")
    ap.add_argument("--world", default="4")
    ap.add_argument("--iters", default="40")
    args = ap.parse_args()
    env = {**os.environ, "CPINDEX_KERNEL_DEFINES": "CP_PHASE_TRACE=1"}
    for fmt in args.formats.split(","):
        for rows in args.rows.split(","):
            for ctx in args.context.split(","):
                shape = ["--formats", fmt, "--rows", rows, "--context", ctx]
                cmd = [sys.executable, "-m", "cpindex", "bench", "--world", args.world,
                       "--transports", "ipc", *shape, "--query-len", args.query_len,
                       "--iters", args.iters, "--select"]  # fmt: skip
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
                recs = _parse(proc.stdout.splitlines())
                if not recs:
                    sys.exit(f"no cp-trace lines from {' '.join(cmd)}")
                # SM cycles per µs, from the calls themselves (clock64 against globaltimer; the
                # longest half of the calls, where the timer's granularity matters least)
                spans = sorted(recs, key=lambda r: r["end_ns"] - r["start_ns"])[len(recs) // 2 :]
                mhz = statistics.median(
                    r["total"] * 1e3 / max(r["end_ns"] - r["start_ns"], 1) for r in spans
                )
                print(f"== {fmt} {rows} requests x {ctx}, T = {args.query_len} "
                      f"(SM clock {mhz:.0f} MHz; µs)")  # fmt: skip
                print("\n".join(_summary(recs, mhz)))
                # the benchmark's own selection table (header and the ipc row) for comparison
                print("\n".join(ln for ln in proc.stdout.splitlines()
                                if "select us" in ln or ln.split()[4:5] == ["ipc"]))  # fmt: skip


if __name__ == "__main__":
    main()
