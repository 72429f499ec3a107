"""Command line: ``python -m cpindex {demo,bench,info}`` (also the ``cpindex`` script)."""

from __future__ import annotations

import argparse
import logging
import sys


def _ints(text: str) -> list[int]:
    return [
        int(float(x[:-1]) * 1024) if x.lower().endswith("k") else int(x) for x in text.split(",")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpindex", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="run score_push on a W-rank world and check every rank")
    d.add_argument("--world", type=int, default=4)
    d.add_argument("--rows", type=int, default=8)
    d.add_argument("--context", type=int, default=8192, help="longest row, in tokens")
    d.add_argument("--format", dest="fmt", choices=["bf16", "fp8", "nvfp4"], default="nvfp4")
    d.add_argument("--transport", choices=["auto", "ipc", "mori", "collective"], default="auto")
    d.add_argument("--seed", type=int, default=0)

    b = sub.add_parser("bench", help="A/B the transports (and the kernel alone) on this machine")
    b.add_argument("--transports", default="collective,ipc", help="comma list (auto allowed)")
    b.add_argument("--world", type=int, default=4)
    b.add_argument("--formats", default="nvfp4")
    b.add_argument("--rows", type=_ints, default=None, help="e.g. 1,8,32")
    b.add_argument("--context", type=_ints, default=None, help="e.g. 8k,32k,128k")
    b.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True)
    b.add_argument("--kernel", action="store_true", help="kernel-only sweep (single GPU)")
    b.add_argument("--iters", type=int, default=None)
    b.add_argument(
        "--rccl-tests",
        dest="rccl_tests",
        default=None,
        help="directory or alltoall_perf binary of nccl-tests/rccl-tests",
    )
    b.add_argument("--out", default=None, help="write every figure as JSON here")
    b.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")

    sub.add_parser("info", help="detected hardware and what transport 'auto' would pick")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "demo":
        from .demo import DemoArgs, run

        run(DemoArgs(args.world, args.rows, args.context, args.fmt, args.transport, args.seed))
    elif args.cmd == "bench":
        from .bench.runner import main as bench_main

        bench_main(args)
    else:
        from .info import main as info_main

        info_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
