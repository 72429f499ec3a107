"""Command line: ``python -m cpindex {demo,bench,build,info}`` (also the ``cpindex`` script)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from .cli_common import (
    BENCH_EXTRA,
    FORMATS,
    NVFP4_FORMS,
    TRANSPORTS,
    UsageError,
    first_error,
)

DESCRIPTION = (
    "cpindex: context-parallel decode block scoring for MiniMax-M3 sparse attention. "
    "'demo' runs one decode step on a W-rank world and checks every rank against the "
    "reference; 'bench' times the transports (or the kernel alone, or the CP gate's "
    "crossover); 'build' builds the kernel's modules ahead of first use; 'info' shows this "
    "machine's GPUs and what transport 'auto' would pick."
)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except where it is None: those options say in their help
    what they fall back to."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in the one style of every other refusal: one line
    ``cpindex COMMAND: error: ...``, exit status 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _parse_ints(text: str) -> list[int]:
    """``"1,8,32"`` or ``"8k,32k"`` (k = 1024) as ints; empty where it is not such a list."""
    try:
        return [
            int(float(x[:-1]) * 1024) if x.lower().endswith("k") else int(x)
            for x in text.split(",")
        ]
    except ValueError:
        return []


def _ints(text: str) -> list[int]:
    """A comma list of integers, each at least 1 (row counts, lengths, query lengths)."""
    values = _parse_ints(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma list of integers >= 1, e.g. 1,8,32 or 8k,32k"
        )
    return values


def _count(text: str) -> int:
    """One integer, at least 1 (a world size, a row count, a length, repetitions)."""
    values = _parse_ints(text)
    if len(values) != 1 or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one integer >= 1")
    return values[0]


def _archs(text: str) -> list[str]:
    archs = [a.strip() for a in text.split(",")]
    if not all(archs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list, e.g. sm_90,gfx942")
    return archs


def _names(choices: list[str]):
    def parse(text: str) -> str:
        bad = [x for x in text.split(",") if x not in choices]
        if bad or not text:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma list of {', '.join(choices)}"
            )
        return text

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cpindex",
        description=DESCRIPTION,
        formatter_class=_Formatter,
        epilog="Run 'cpindex COMMAND --help' for a command's options.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    d = sub.add_parser(
        "demo",
        help="run score_push on a W-rank world and check every rank against the reference",
        description="One random ragged decode step on a W-rank world (gloo processes on a CPU "
        "machine, NCCL processes with W GPUs, the one-process world on one GPU); every rank's "
        "scores and top-16 are checked against the single-process reference.",
        formatter_class=_Formatter,
    )
    d.add_argument("--world", type=_count, default=4, help="number of ranks W")
    d.add_argument("--rows", type=_count, default=8, help="decode rows (requests)")
    d.add_argument("--context", type=_count, default=8192, help="longest row, in tokens")
    d.add_argument(
        "--format", dest="fmt", choices=FORMATS, default="nvfp4", help="index-cache format"
    )
    d.add_argument("--transport", choices=TRANSPORTS, default="auto", help="transport to use")
    d.add_argument("--seed", type=int, default=0, help="seed of the random problem")

    b = sub.add_parser(
        "bench",
        help="time the transports (or the kernel alone, or the CP gate) on this machine",
        description="Times every transport on the same full-length decode steps, beside one "
        "rank's share scored alone ('score') and the full scan of one head without CP "
        "('no-CP'); with --kernel, the fused kernel alone against the copy bandwidth; with "
        "--gate, each size context-parallel and scored locally, the crossover between them "
        "and what calls below it save. Each mode takes the options below that apply to it. "
        f"The progress bar and --plot need the bench extra: {BENCH_EXTRA}.",
        formatter_class=_Formatter,
    )
    b.add_argument(
        "--transports",
        type=_names(TRANSPORTS),
        metavar="LIST",
        default=None,
        help="comma list of transports to compare; ipc and mori need GPUs (default: "
        "collective,ipc on a GPU machine, collective on a CPU machine; --gate: one transport, "
        "auto)",
    )
    b.add_argument(
        "--world",
        type=_count,
        default=None,
        help="number of ranks W; --kernel with W > 1: the kernel and the Triton scorer score "
        "rank 0's share, as one GPU of W does per call (default: 4; --kernel: 1, every block)",
    )
    b.add_argument(
        "--formats",
        type=_names([*FORMATS, *NVFP4_FORMS]),
        metavar="LIST",
        default="nvfp4",
        help="comma list of cache formats (--kernel also takes nvfp4 pages in another form: "
        "nvfp4-page_major_3d [pages, 128, 72], nvfp4-pool (those pages in a larger pool), "
        "nvfp4-pair, nvfp4-interleaved (the pair views of a token-interleaved cache))",
    )
    b.add_argument(
        "--rows",
        type=_ints,
        metavar="LIST",
        default=None,
        help="comma list of row counts (default: 1,8,32 on a GPU, 1,8 on CPU; "
        "--kernel: 1,8,32,128; --gate: requests 1,2,4,8,16,32 on a GPU)",
    )
    b.add_argument(
        "--context",
        type=_ints,
        metavar="LIST",
        default=None,
        help="comma list of context lengths in tokens, k = 1024 (default: 8k,32k,128k on a "
        "GPU, 2k,8k on CPU; --kernel: 8k,32k,128k,512k; --gate: 4k,16k,64k,128k on a GPU)",
    )
    b.add_argument(
        "--query-len",
        dest="query_len",
        type=_ints,
        metavar="LIST",
        default="1",  # parsed by _ints like a given value, so the help shows "1"
        help="comma list of query tokens per request (speculative/MTP decode); --rows counts "
        "requests, each scoring T rows; --gate: one sweep per T",
    )
    b.add_argument(
        "--select",
        action="store_true",
        help="transport A/B: also time select_blocks (topk 16) beside score_push + torch.topk, "
        "with the bytes each exchange sends; --gate: also sweep select_blocks",
    )
    b.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time capturable transports as CUDA graph replays of 8 calls",
    )
    mode = b.add_mutually_exclusive_group()
    mode.add_argument(
        "--kernel", action="store_true", help="time the fused kernel alone (one GPU) instead"
    )
    mode.add_argument(
        "--write",
        action="store_true",
        help="time formats.write_keys (one GPU) against the copy bandwidth and an index-copy "
        "of the same bytes; --rows counts keys a call writes (default: 32,256,65536)",
    )
    mode.add_argument(
        "--host",
        action="store_true",
        help="host µs per eager call beside GPU µs: IndexCP.score_push/select_blocks (plan and "
        "positional), the block_scores op, the kernel launcher and the Triton scorer (one GPU)",
    )
    mode.add_argument(
        "--agree",
        action="store_true",
        help="the agreement hash's cost: score_push and select_blocks through ipc with "
        "config.fingerprint off and on (the one-process world, --world ranks on one GPU)",
    )
    mode.add_argument(
        "--gate",
        action="store_true",
        help="the CP gate: each size (--rows requests x --context) timed context-parallel "
        "(cp_min_blocks=0) and scored locally on the same inputs, with one transport; prints "
        "the crossover, what calls below it save and where cp_min_blocks='auto' puts the "
        "threshold (one process per GPU with --world GPUs, else the one-process world)",
    )
    b.add_argument(
        "--iters",
        type=_count,
        default=None,
        help="timed repetitions per shape (default: 50 on a GPU, 5 on CPU; --kernel: 20)",
    )
    b.add_argument(
        "--rccl-tests",
        dest="rccl_tests",
        metavar="PATH",
        default=None,
        help="directory or alltoall_perf binary of nccl-tests/rccl-tests, to time an "
        "all-to-all of the score exchange's sizes beside the transports "
        "(default: alltoall_perf on PATH, else skipped)",
    )
    b.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="write every figure as JSON here (default: no file)",
    )
    b.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help=f"draw the results into this PNG, needs {BENCH_EXTRA} (default: no plot)",
    )

    k = sub.add_parser(
        "build",
        help="build the kernel's modules into the cache ahead of first use (container images)",
        description="Builds the base module and each format's module for each architecture into "
        "the cache (CPINDEX_CACHE_DIR, default ~/.cache/cpindex), as a process's first use would, "
        "and prints how long each took to build (or find) and load. Needs a CUDA or ROCm build of "
        "torch and its compiler (nvcc, hipcc), not a GPU: name the target with --arch where none "
        "is visible.",
        formatter_class=_Formatter,
    )
    k.add_argument(
        "--arch",
        type=_archs,
        metavar="LIST",
        default=None,
        help="comma list of GPU architectures, e.g. sm_90 or gfx942,gfx950 (default: the current "
        "GPU's; needed without a GPU)",
    )
    k.add_argument(
        "--formats",
        type=_names(FORMATS),
        metavar="LIST",
        default=",".join(FORMATS),
        help="comma list of cache formats whose modules to build (the base module is always built)",
    )

    sub.add_parser(
        "info",
        help="detected hardware and what transport 'auto' would pick",
        description="The GPUs torch sees, peer access between them, whether the fused kernel "
        "and MORI are available, and what transport 'auto' would pick here.",
        formatter_class=_Formatter,
    )
    return parser


def _build(archs: list[str] | None, formats: list[str]) -> int:
    """``cpindex build``: every module a process may load, per architecture, into the cache,
    with the seconds each took to build (or find) and import, and on a GPU to load there (its
    first use of one scoring instance; ``CUDA_MODULE_LOADING=EAGER`` loads the whole module)."""
    import time

    import torch

    from .kernels import build, structs

    gpu = None
    if archs is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not gpus:
            raise UsageError("no GPU visible: name the target with --arch (e.g. sm_90, gfx942)")
        gpu = torch.device("cuda", torch.cuda.current_device())
        archs = [build.device_arch(gpu)]
        torch.zeros(1, device=gpu)  # the context: its start is not a module's load
    for arch in archs:
        try:
            build.check_arch(arch)
        except build.KernelUnavailable as e:
            raise UsageError(f"--arch {arch}: {e}") from None
    for arch in archs:
        try:
            done = build.prebuild(arch, [None, *formats])
        except build.KernelUnavailable as e:  # a compiler error: its whole output is the report
            print(f"cpindex build: error: {e}", file=sys.stderr)
            return 1
        for b in done:
            line = f"{b.name}: {'built' if b.built else 'found'} and imported in {b.seconds:.1f} s"
            if gpu is not None and b.fmt is not None:
                t0 = time.perf_counter()
                b.module.occupancy(structs.FORMAT_IDS[b.fmt], 1, False, 0)
                line += f", loaded on {gpu} in {time.perf_counter() - t0:.1f} s"
            print(line)
    print(f"cache: {build.cache_dir()}")
    return 0


_OOM_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def _out_of_memory(type_name: str, message: str) -> bool:
    return type_name in ("OutOfMemoryError", "MemoryError") or any(
        w in message.lower() for w in _OOM_WORDS
    )


def _failure(e: BaseException) -> tuple[int, str] | None:
    """The exit status and one line for a failure the user can cause or fix (bad input, a
    refusal, too little memory, a kernel this machine cannot build); None for a bug, whose
    traceback is the report."""
    from .errors import CPIndexError, TransportUnavailable
    from .spawn import RanksFailed

    if isinstance(e, UsageError):
        return 2, str(e)
    if isinstance(e, RanksFailed):
        f = e.primary
        if f.type_name == "ProcessExit" and "SIGKILL" in f.message:
            return 2, f"{f.line()} (most likely out of memory: lower the sizes)"
        if _out_of_memory(f.type_name, f.message):
            return 2, f"{f.line()} (lower the sizes)"
        return (2, str(e)) if f.expected else None
    if _out_of_memory(type(e).__name__, str(e)):
        return 2, f"{type(e).__name__}: {first_error(e)} (lower the sizes)"
    if isinstance(e, (ValueError, TypeError, TransportUnavailable)):
        return 2, f"{type(e).__name__}: {first_error(e)}"
    if isinstance(e, CPIndexError):  # a peer's failure or a timeout: not the user's doing
        return 1, f"{type(e).__name__}: {first_error(e)}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status: 0 done, 1 a check failed (the demo's
    mismatch) or the run failed on its own, 2 the user's error (one line on stderr)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.cmd == "demo":
            from . import demo

            demo_args = demo.DemoArgs(
                args.world, args.rows, args.context, args.fmt, args.transport, args.seed
            )
            demo.check(demo_args)
            return 0 if demo.report(demo.run(demo_args), demo_args) else 1
        if args.cmd == "bench":
            from .bench.runner import main as bench_main

            bench_main(args)
            return 0
        if args.cmd == "build":
            return _build(args.arch, args.formats.split(","))
        from .info import main as info_main

        info_main()
        return 0
    except Exception as e:
        failure = _failure(e)
        if failure is None:
            raise  # a bug: its traceback (a rank's, attached) is the report
        code, line = failure
        print(f"cpindex {args.cmd}: error: {line}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
