"""Entry of ``python -m cpindex bench``: the transport A/B (then the nccl-tests/rccl-tests
comparison), or one of the other modes (the kernel sweep, the gate sweep, the write, host and
agreement costs); JSON and an optional plot."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from collections.abc import Callable

import torch

from .. import formats, kernels
from ..cli_common import (
    BENCH_EXTRA,
    DEVICE_OVERHEAD,
    FORMATS,
    GPU_TRANSPORTS,
    HOST_OVERHEAD,
    UsageError,
    check_world_memory,
    check_writable,
    first_error,
    problem_bytes,
)
from ..config import MAX_QUERY_LEN, CPIndexConfig
from . import ab, agree_cost, gate_sweep, host_cost, kernel_sweep, nccl_tests, write_sweep

K = 1024


def _device_name() -> str:
    return (
        torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    )


def require_matplotlib() -> None:
    """Refuse ``--plot``, naming the extra, when matplotlib cannot be imported (before any
    timing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise UsageError(f"--plot needs matplotlib ({e}); install it with: {BENCH_EXTRA}") from None


def _transports(args: argparse.Namespace, gpu: bool, default: list[str]) -> list[str]:
    """``--transports`` as a list (``default`` where it is not given); a transport that needs
    GPUs is a :class:`UsageError` on a CPU machine."""
    if args.transports is None:
        return default
    transports = args.transports.split(",")
    need_gpus = [t for t in transports if t in GPU_TRANSPORTS]
    if need_gpus and not gpu:
        raise UsageError(
            f"--transports {args.transports}: {', '.join(need_gpus)} "
            f"need{'s' if len(need_gpus) == 1 else ''} GPUs and this machine has none; on "
            "a CPU machine only collective (or auto) runs"
        )
    return transports


def _formats(args: argparse.Namespace) -> list[str]:
    """``--formats`` as a list of plain cache formats (the other nvfp4 forms are the kernel
    sweep's alone)."""
    fmts = args.formats.split(",")
    forms = [f for f in fmts if f not in FORMATS]
    if forms:
        raise UsageError(f"--formats {','.join(forms)}: only with --kernel (the kernel sweep)")
    return fmts


def _check_world(world: int, query_lens: list[int]) -> None:
    """What every rank's configuration would refuse of ``--world`` and ``--query-len``."""
    try:
        CPIndexConfig(world_size=world)  # the heads (4) split over the ranks
    except ValueError as e:
        raise UsageError(f"--world {world}: {first_error(e)}") from None
    if max(query_lens) > MAX_QUERY_LEN:
        raise UsageError(f"--query-len: at most {MAX_QUERY_LEN} query tokens per request")


def _check_sizes(build: Callable[[], object]) -> None:
    """``build()`` makes the ranks' configurations: what it refuses names the size options."""
    try:
        build()
    except ValueError as e:
        raise UsageError(f"--rows/--context/--query-len: {first_error(e)}") from None


def ab_spec(args: argparse.Namespace, gpu: bool) -> ab.Spec:
    """The transport A/B's spec from the options, checked before any rank starts: what every
    rank would refuse is a :class:`UsageError` naming the option."""
    transports = _transports(args, gpu, ["collective", "ipc"] if gpu else ["collective"])
    fmts = _formats(args)
    if args.rccl_tests and not gpu:
        raise UsageError("--rccl-tests: the all-to-all comparison needs GPUs")
    spec = ab.Spec(
        transports=transports,
        world=4 if args.world is None else args.world,
        formats=fmts,
        rows=args.rows or ([1, 8, 32] if gpu else [1, 8]),
        contexts=args.context or ([8 * K, 32 * K, 128 * K] if gpu else [2 * K, 8 * K]),
        graphs=args.graphs,
        iters=args.iters or (50 if gpu else 5),
        query_lens=args.query_len,
        select=args.select,
    )
    _check_world(spec.world, spec.query_lens)
    _check_sizes(lambda: ab.configs(spec, spec.world))
    _check_ab_memory(spec, gpu)
    return spec


def _check_ab_memory(spec: ab.Spec, gpu: bool) -> None:
    """Refuse an A/B whose largest shape this machine's memory cannot hold: a rank holds one
    format's instances at a time, one per transport."""
    cfgs = ab.configs(spec, spec.world)
    buffers = max(
        sum(cfgs[f, t].buffer_bytes(spec.world) for t in spec.transports) for f in spec.formats
    )
    _check_memory(spec.world, gpu, spec.formats, max(spec.rows), max(spec.contexts), buffers)


def _check_memory(
    world: int, gpu: bool, fmts: list[str], requests: int, context: int, buffers: int
) -> None:
    """Refuse sizes this machine's memory cannot hold, before any rank starts. Each rank holds
    ``buffers`` bytes of instances and one shape's problem at a time (``ab._problem``): built on
    the host by ``testing.make_problem`` on a CPU machine, random pages made on the GPU
    otherwise, where rank 0 also times a 1 GiB copy."""
    gpus = torch.cuda.device_count() if gpu else 0
    bpt = max(formats.BYTES_PER_TOKEN[f] for f in fmts)
    host, cache = problem_bytes(requests, context, bpt)
    if gpu:
        host, device = HOST_OVERHEAD, cache + buffers + DEVICE_OVERHEAD + (2 << 30)
    else:
        host, device = host + HOST_OVERHEAD + buffers, 0
    what = f"--rows {requests} --context {context} on {world} ranks"
    fix = "lower --rows, --context or --world"
    check_world_memory(what, world, gpus, host, device, fix)


def gate_specs(args: argparse.Namespace, gpu: bool) -> list[gate_sweep.Spec]:
    """The gate sweeps from the options (``--gate``), checked before any rank starts: one per
    format, query length and call (``score_push``; with ``--select`` also ``select_blocks``),
    all on one transport and one world. What every rank would refuse, and an option the sweep
    cannot use, is a :class:`UsageError` naming the option."""
    if args.transports is not None and "," in args.transports:
        raise UsageError(
            f"--gate --transports {args.transports}: one transport at a time (the sweep times "
            "one transport's context-parallel path against the local path)"
        )
    for option, given in (("--rccl-tests", args.rccl_tests), ("--plot", args.plot)):
        if given:
            raise UsageError(f"{option}: not with --gate (its table and --out hold every figure)")
    (transport,) = _transports(args, gpu, ["auto"])
    world = 4 if args.world is None else args.world
    _check_world(world, args.query_len)
    specs = [
        gate_sweep.Spec(
            fmt=fmt,
            world=world,
            transport=transport,
            requests=args.rows or ([1, 2, 4, 8, 16, 32] if gpu else [1, 8]),
            contexts=args.context or ([4 * K, 16 * K, 64 * K, 128 * K] if gpu else [2 * K, 8 * K]),
            query_len=t,
            op=op,
            iters=args.iters or (50 if gpu else 5),
            graphs=args.graphs,
        )
        for fmt in _formats(args)
        for t in args.query_len
        for op in (gate_sweep.OPS if args.select else gate_sweep.OPS[:1])
    ]
    _check_sizes(lambda: [gate_sweep.config(s, world) for s in specs])
    # a sweep holds its two instances (context-parallel, local) at a time
    buffers = max(2 * gate_sweep.config(s, world).buffer_bytes(world) for s in specs)
    s0 = specs[0]
    _check_memory(world, gpu, _formats(args), max(s0.requests), max(s0.contexts), buffers)
    return specs


def main(args: argparse.Namespace) -> dict:
    gpu = torch.cuda.is_available()
    for option, path in (("--out", args.out), ("--plot", args.plot)):
        if path:
            check_writable(path, option)  # before the run, not after it
    specs = gate_specs(args, gpu) if args.gate else None
    if args.plot:
        require_matplotlib()
    fmts = args.formats.split(",")
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_name(),
        "torch": torch.__version__,
        "kernel_sources": kernels.sources_digest(),
        "kernel_defines": kernels.build_defines(kernels.device_arch()) if gpu else [],
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }
    gpu_only = [m for m in ("kernel", "write", "host", "agree") if getattr(args, m)]
    if gpu_only and not gpu:
        raise UsageError(f"--{gpu_only[0]} needs a GPU")
    if args.write:
        res = write_sweep.run(
            [f for f in fmts if f in FORMATS], args.rows or [32, 256, 65536], args.iters or 20
        )
        print(write_sweep.table(res))
        print(write_sweep.LEGEND)
        out = {"meta": meta, **res}
    elif args.host:
        res = host_cost.run(
            [f for f in fmts if f in FORMATS],
            args.rows or [8],
            args.context or [32 * K],
            args.query_len if args.query_len != [1] else [4],
            args.iters or 20,
        )
        print(host_cost.table(res))
        print(host_cost.LEGEND)
        out = {"meta": meta, **res}
    elif args.agree:
        shapes = [(r, c) for r in (args.rows or [8, 32]) for c in (args.context or [32 * K])]
        if not (args.rows or args.context):
            shapes = [(8, 32 * K), (32, 128 * K)]
        res = agree_cost.run(
            shapes,
            max(args.query_len),
            fmts[0],
            args.iters or 50,
            4 if args.world is None else args.world,
        )
        print(agree_cost.table(res))
        print(agree_cost.LEGEND)
        out = {"meta": meta, **res}
    elif specs is not None:
        results = gate_sweep.run_all(specs)
        print("\n\n".join(gate_sweep.table(res) for res in results))
        print(gate_sweep.legend(results))
        out = {"meta": meta, "gate": results}
    elif args.kernel:
        res = kernel_sweep.run(
            fmts,
            args.rows or [1, 8, 32, 128],
            args.context or [8 * K, 32 * K, 128 * K, 512 * K],
            args.iters or 20,
            args.query_len,
            1 if args.world is None else args.world,
        )
        print(f"device-to-device copy: {res['copy_gbs']:.0f} GB/s (read + write)")
        print(kernel_sweep.table(res))
        print(kernel_sweep.LEGEND)
        out = {"meta": meta, **res}
    else:
        spec = ab_spec(args, gpu)
        rows = ab.run(spec)
        print(ab.table(rows, spec.transports))
        print(ab.legend(spec, rows))
        out = {"meta": meta, "spec": ab.as_dict(spec), "results": rows}
        out["nccl_tests"] = _nccl_tests(args, rows, spec) if gpu else None
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    if args.plot:
        _plot(out, args.plot)
    return out


def _nccl_tests(args: argparse.Namespace, rows: list[dict], spec: ab.Spec) -> dict | None:
    """alltoall_perf at the score exchange's message sizes, beside the collective's time."""
    path = nccl_tests.find_binary("alltoall_perf", args.rccl_tests)
    if path is None:
        print(
            "nccl-tests/rccl-tests: no alltoall_perf binary (--rccl-tests DIR, or on PATH); skipped"
        )
        return None
    sizes = sorted({4 * r["rows"] * ab.blocks(r["context"]) for r in rows})  # fp32 scores per rank
    table = nccl_tests.run_binary(
        path,
        min_bytes=min(sizes),
        max_bytes=max(sizes),
        ngpus=min(spec.world, torch.cuda.device_count() or 1),
    )
    print("alltoall_perf at the score exchange's sizes (out-of-place time):")
    print(f"{'bytes':>10} {'alltoall_perf us':>17}")
    for t in table:
        print(f"{t.size_bytes:>10} {t.oop_time_us:>17.1f}")
    return {"binary": path, "rows": [t.__dict__ for t in table]}


def _plot(out: dict, path: str) -> None:
    """Time vs context, log-log: one panel per format, a colour per series, a line style per
    row count."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows_key = "kernel" if "kernel" in out else "results"
    recs = out[rows_key]
    fmts = sorted({r["format"] for r in recs})
    fig, axes = plt.subplots(1, len(fmts), figsize=(5.5 * len(fmts), 4.5), squeeze=False)
    if rows_key == "kernel":
        series = ["kernel_ms", "triton_ms"]
        labels = {"kernel_ms": "cpindex kernel", "triton_ms": "Triton bf16 scorer"}
        title = f"cpindex kernel alone ({out['meta']['device']})"
    else:
        series = [*out["spec"]["transports"], "score", "nocp"]
        labels = {
            **{t: f"CP, {t}" for t in out["spec"]["transports"]},
            "score": "score: one rank's share scored alone, no exchange",
            "nocp": "no-CP: one rank scans every block for its own head",
        }
        title = f"cpindex, world {out['spec']['world']} ({out['meta']['device']})"
    styles = ["-", "--", ":", "-."]
    for ax, fmt in zip(axes[0], fmts, strict=True):
        all_rows = sorted({r["rows"] for r in recs if r["format"] == fmt})
        for si, name in enumerate(series):
            for ri, rows in enumerate(all_rows):
                pts = [r for r in recs if r["format"] == fmt and r["rows"] == rows and name in r]
                if not pts:
                    continue
                ys = [r[name] if rows_key == "kernel" else r[name]["median_ms"] for r in pts]
                ax.plot([r["context"] for r in pts], [y * 1e3 for y in ys], marker="o",
                        color=f"C{si}", linestyle=styles[ri % len(styles)])  # fmt: skip
        # one legend entry per series (colour) and per row count (line style)
        shown = [
            (si, n)
            for si, n in enumerate(series)
            if any(n in r for r in recs if r["format"] == fmt)
        ]
        handles = [Line2D([], [], color=f"C{si}", marker="o", label=labels[name])
                   for si, name in shown]  # fmt: skip
        handles += [Line2D([], [], color="grey", linestyle=styles[ri % len(styles)],
                           label=f"{rows} rows") for ri, rows in enumerate(all_rows)]  # fmt: skip
        ax.legend(handles=handles, fontsize=6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("time per call (us)")
        ax.set_title(fmt)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
