"""Timing and synthetic data for the benchmarks (never imported by the library itself)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from .. import formats
from ..comm import Comm
from ..world import in_turn


class Progress:
    """Progress on stderr (the tables go to stdout once, at the end): a tqdm bar where tqdm is
    installed (``cpindex[bench]``), else a line per step; nothing where not ``enabled`` (every
    rank but 0)."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total, self.desc, self.enabled, self.done = total, desc, enabled, 0
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc=desc, unit="shape", leave=False, file=sys.stderr)

    def step(self, what: str) -> None:
        """One step done; ``what`` names it on the line printed where there is no bar."""
        if not self.enabled:
            return
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            print(f"{self.desc}: {self.done}/{self.total} {what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summarize(ms: list[float]) -> dict[str, float]:
    s = sorted(ms)
    return {"median_ms": statistics.median(s), "p90_ms": s[min(len(s) - 1, int(0.9 * len(s)))]}


def time_calls(
    fn: Callable[[int], object], iters: int, warmup: int, device: torch.device
) -> list[float]:
    """Per-call times in ms: CUDA events around each call on the current stream, or the host
    clock on CPU. ``fn(i)`` runs call ``i`` (rotate inputs with ``i``)."""
    for i in range(warmup):
        fn(i)
    if device.type != "cuda":
        out = []
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i)
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.current_stream().synchronize()  # releases the GIL (one-process world)
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def time_graph(
    fn: Callable[[int], object],
    per_graph: int,
    replays: int,
    warmup: int,
    comm: Comm | None = None,
) -> list[float]:
    """Per-call ms from replays of a CUDA graph holding ``per_graph`` calls. With ``comm``
    (every rank calls this), ranks capture one at a time (see :func:`cpindex.world.in_turn`),
    and every eager warm-up call ends with all ranks settled: an eager call may allocate or
    memset (``torch.topk`` of a long row does), which in the one-process world must not sit
    between two ranks' pushes (docs/design.md, the one-process world, rule 2)."""
    for i in range(warmup):
        fn(i)
        torch.cuda.current_stream().synchronize()  # releases the GIL (one-process world)
        if comm is not None:
            comm.barrier()
    g = torch.cuda.CUDAGraph()

    def capture() -> None:
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for i in range(per_graph):
                fn(i)

    if comm is None:
        capture()
    else:
        in_turn(comm, capture)
    times = time_calls(lambda i: g.replay(), replays, 2, torch.device("cuda"))
    return [t / per_graph for t in times]


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus written (the roofline)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = statistics.median(time_calls(lambda i: dst.copy_(src), 20, 3, device))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def synthetic_cache(pages: int, fmt: str, device: torch.device, seed: int = 0) -> formats.Cache:
    """Random, finite cache pages made directly on the device (fast for many GB)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if fmt == "bf16":
        return torch.randn(pages, 128, 128, device=device, dtype=torch.bfloat16, generator=g)
    if fmt == "fp8":
        out = torch.empty(pages, 128, 128, device=device, dtype=torch.float8_e4m3fn)
        for p0 in range(0, pages, 4096):  # chunked: no full-size bf16 temporary
            p1 = min(pages, p0 + 4096)
            out[p0:p1] = torch.randn(p1 - p0, 128, 128, device=device, generator=g)
        return out
    cache = torch.randint(
        0, 256, (pages, formats.NVFP4_PAGE_BYTES), device=device, dtype=torch.uint8, generator=g
    )
    # any nibble is a valid e2m1 value; scales: e4m3 bytes 0x30..0x3f (0.5 .. ~0.94)
    cache[:, formats.NVFP4_VALUE_BYTES :] = 0x30 + (cache[:, formats.NVFP4_VALUE_BYTES :] & 0x0F)
    return cache


def synthetic_queries(rows: int, heads: int, fmt: str, device: torch.device, seed: int = 1):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, heads, 128, device=device, generator=g).to(formats.query_dtype(fmt))
