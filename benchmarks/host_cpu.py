"""Host time per eager call of cpindex's entry points, on the CPU, with the launch stubbed.

``cpindex bench --host`` (cpindex/bench/host_cost.py) times the host side beside the GPU on a
GPU machine. This script times the same entry points on any machine, without a GPU: everything
cpindex does in Python per call, down to the C++ binding, whose ``score`` is replaced by a no-op.

    PYTHONPATH=. python benchmarks/host_cpu.py                  # table of median µs per call
    PYTHONPATH=. python benchmarks/host_cpu.py --calls 20000    # steadier medians
    PYTHONPATH=. python benchmarks/host_cpu.py --profile ipc.score_push(plan)   # cProfile one
    PYTHONPATH=/other/checkout python benchmarks/host_cpu.py    # time another checkout
    PYTHONPATH=. python benchmarks/host_cpu.py --gpu            # collective's own work on a GPU

STUBS, here and nowhere else (never in tests or the library):

* the compiled module (``cpindex.kernels.launcher.load``) is :class:`NoOpBinding`: ``score`` and
  ``merge`` do nothing; the occupancy queries answer constants. Everything above it runs as on a
  GPU: the runner, validation, the transport's Python, the parameter images, grid choice, error
  checks.
* ``ipc``: its :class:`~cpindex.transports.peer.PushEngine` is built over a CPU byte buffer in
  place of the peer-mapped region (``view_bytes``), and pinned memory is plain CPU memory.
* ``collective``: the communication is stubbed (the header round returns this rank's header,
  the all-gather and all-to-all do nothing) and the scorer is the stubbed kernel scorer, so the
  timed work is the path's own (header, views, copies); ``config.fingerprint`` is off (its
  hash is device work on a GPU, CPU-only host work here). Its ``score_push`` copies run on the
  CPU's data here: they are compute, not launches, so that row overstates the host time a GPU
  caller pays (``select_blocks`` at ``topk`` 16 selects in the stubbed kernel).
* content checks that cpindex makes only for CPU tensors (``validation._check_contents`` and
  ``_check_pages``, which on a GPU the kernel makes) are no-ops, so the CPU times what a GPU
  caller pays.
* ``torch.ops.cpindex.block_scores``: its CPU scorer (the float64 reference) is replaced by what
  the op does on a GPU: allocate the output and call the stubbed kernel scorer.

``--gpu`` times the ``collective`` rows on GPU 0 instead, with nothing stubbed but the
communication (as above): the real kernel, the device agreement (``fingerprint`` on) and every
torch op it launches, so the rows are the path's own host work apart from its communication
(``bench --host`` times the one-rank world's exchange with it, host barriers included). The
stream is synchronized between batches of 100 calls, outside the timed region.

The problem: 8 requests x 4 query tokens (T = 4), 4 heads on one rank, 32K tokens of context,
nvfp4; one rank in the one-process world (nothing to wait for).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch

import cpindex
from cpindex import CPIndexConfig, IndexCP, ops, testing, validation
from cpindex import vllm as dropin
from cpindex.kernels import launcher
from cpindex.runner import Runner
from cpindex.transports import peer
from cpindex.transports.base import Context
from cpindex.transports.ipc import IpcTransport
from cpindex.world import run_threads

REQUESTS, QUERY_LEN, CONTEXT, FMT, TOPK = 8, 4, 32 * 1024, "nvfp4", 16


class NoOpBinding:
    """Stands in for the compiled kernel module: launches do nothing."""

    def score(self, *args: object) -> None:
        return None

    def merge(self, *args: object) -> None:
        return None

    def occupancy(self, fmt: int, tiles: int, wgmma: bool, split: int) -> int:
        return 8

    def host_device_pointer(self, ptr: int) -> int:
        return ptr


@contextlib.contextmanager
def fake_gpu_layer() -> Iterator[None]:
    """While constructing: the no-op binding, an H200's arch, name and SM count, plain memory for
    pinned."""
    saved = (launcher.load, launcher.device_arch, torch.cuda.get_device_properties, torch.zeros,
             peer.view_bytes)  # fmt: skip
    zeros = torch.zeros

    def plain_zeros(*args: object, pin_memory: bool = False, **kw: object) -> torch.Tensor:
        return zeros(*args, **kw)

    launcher.load = lambda *args, **kwargs: NoOpBinding()  # type: ignore[assignment]
    launcher.device_arch = lambda device=None: "sm_90"  # type: ignore[assignment]
    h200 = SimpleNamespace(multi_processor_count=132, name="NVIDIA H200")
    torch.cuda.get_device_properties = lambda d=None: h200  # type: ignore[assignment]
    torch.zeros = plain_zeros  # type: ignore[assignment]
    regions: list[torch.Tensor] = []
    peer.view_bytes = lambda ptr, n, dev: next(r for r in regions if r.data_ptr() == ptr)  # type: ignore[assignment]
    fake_gpu_layer.regions = regions  # type: ignore[attr-defined]
    try:
        yield
    finally:
        (launcher.load, launcher.device_arch, torch.cuda.get_device_properties, torch.zeros,
         peer.view_bytes) = saved  # fmt: skip


def stub_content_checks() -> None:
    """CPU-only content checks off (a GPU caller never pays them: the kernel makes them)."""
    validation._check_contents = lambda *a, **k: None  # type: ignore[assignment]
    validation._check_pages = lambda *a, **k: None  # type: ignore[assignment]


def as_ipc(cp: IndexCP) -> None:
    """Swap ``cp``'s transport for an ``ipc`` one over a CPU buffer and the no-op binding."""
    ctx = Context(cp.config, cp.comm, cp.device, 1)
    layout = peer.PeerLayout(cp.config, cp.world_size)
    with fake_gpu_layer():
        region = torch.zeros(layout.total, dtype=torch.uint8)
        fake_gpu_layer.regions.append(region)  # type: ignore[attr-defined]
        engine = peer.PushEngine(ctx, layout, [region.data_ptr()], 1e9)
    t = IpcTransport.__new__(IpcTransport)
    t.ctx, t.engine, t._ptr, t._opened = ctx, engine, 0, []
    t._region = region  # keeps the buffer alive
    r = cp._runner
    cp._transport = t
    cp._runner = Runner(cp.config, cp.comm, t, r.instance, cp.device, cp._local, cp._gate)


def fake_scorer(heads: int) -> launcher.KernelScorer:
    with fake_gpu_layer():
        monitor = launcher.ErrorMonitor(torch.device("cpu"), 0)
        return launcher.KernelScorer(
            torch.device("cpu"), FMT, num_heads=heads, rank=0, world=1,
            sm_scale=128**-0.5, monitor=monitor,
        )  # fmt: skip


def stub_communication(cp: IndexCP) -> None:
    """``cp``'s header round returns this rank's header; its data collectives do nothing."""
    comm = cp.comm
    comm.rendezvous = lambda key, payload, timeout_s: [payload]
    comm.all_gather_into = lambda out, inp, timeout_s=None: None
    comm.all_to_all_into = lambda out, inp, timeout_s=None: None


def as_collective(cp: IndexCP) -> None:
    """Stub ``cp``'s (collective) communication and give it the stubbed kernel scorer."""
    stub_communication(cp)
    t = cp._transport
    t.scorer = fake_scorer(cp.config.num_heads)
    t.monitor = t.scorer.monitor


def stub_op_reference() -> None:
    """``block_scores`` on CPU runs the reference; make it run what the op runs on a GPU."""
    scorers: dict[int, launcher.KernelScorer] = {}

    def gpu_body(q, index_cache, block_table, seq_lens, *, init_blocks, local_blocks, width,
                 sm_scale, query_len):  # fmt: skip
        heads = q.shape[1]
        scorer = scorers.get(heads) or scorers.setdefault(heads, fake_scorer(heads))
        scorer.monitor.check()
        out = torch.empty(heads, q.shape[0], width, device=q.device)
        scorer.score_local(
            q, index_cache, block_table, seq_lens, out, init_blocks=init_blocks,
            local_blocks=local_blocks, width=width, query_len=query_len,
        )  # fmt: skip
        return out

    ops.reference = SimpleNamespace(block_scores=gpu_body)  # type: ignore[assignment]


def time_us(
    fn: Callable[[], object], calls: int, between: Callable[[], object] = lambda: None
) -> list[float]:
    """Per-call µs of ``calls`` calls, in batches of 100 (one clock read per batch);
    ``between`` runs before each batch, untimed."""
    for _ in range(min(calls, 500)):
        fn()
    out = []
    for _ in range(max(1, calls // 100)):
        between()
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        out.append((time.perf_counter() - t0) * 1e4)
    return out


def configs(width: int, **kw: object) -> CPIndexConfig:
    return CPIndexConfig(
        cache_format=FMT, max_rows=REQUESTS * QUERY_LEN, max_query_len=QUERY_LEN,
        max_width=width, cp_min_blocks=0, **kw,
    )  # fmt: skip


def call_entries(name: str, cp: IndexCP, prob: testing.Problem) -> dict[str, Callable[[], object]]:
    """``cp``'s two calls on ``prob``, with a plan made once (as a decode step's layers share
    one)."""
    q, cache, bt, sl, width = prob.q, prob.index_cache, prob.block_table, prob.seq_lens, prob.width
    plan = cp.plan(bt, sl, query_len=QUERY_LEN, width=width)
    return {
        f"{name}.score_push(plan)": lambda: cp.score_push(q, cache, plan, tag=3),
        f"{name}.select_blocks(plan)": lambda: cp.select_blocks(q, cache, plan, topk=TOPK, tag=3),
    }


def dropin_entries(comm, width: int) -> dict[str, Callable[[], object]]:
    """The seed's positional calls through ``cpindex.vllm`` (one head: heads = ranks), on
    ``ipc``: its plan reused across calls, its tag derived from the cache."""
    env = {"CPINDEX_CACHE_FORMAT": FMT, "CPINDEX_MAX_QUERY_LEN": str(QUERY_LEN),
           "CPINDEX_CP_MIN_BLOCKS": "0"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cp = dropin.IndexCP(0, None, "cpu", REQUESTS * QUERY_LEN, width, comm=comm)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    as_ipc(cp.cp)
    prob = testing.make_problem(
        REQUESTS, CONTEXT, FMT, query_len=QUERY_LEN, num_heads=1, seed=0, width=width
    )
    args = (prob.q, prob.index_cache, prob.block_table, prob.seq_lens, 0, 1, width)
    return {
        "vllm.score_push": lambda: cp.score_push(*args),
        "vllm.select_blocks": lambda: cp.select_blocks(*args, topk=TOPK),
    }


def entries(comm) -> dict[str, Callable[[], object]]:
    prob = testing.make_problem(REQUESTS, CONTEXT, FMT, query_len=QUERY_LEN, seed=0)
    width = prob.width
    q, cache, bt, sl = prob.q, prob.index_cache, prob.block_table, prob.seq_lens
    ipc = IndexCP(configs(width), device="cpu", comm=comm)
    coll = IndexCP(configs(width, fingerprint=False), device="cpu", comm=comm)
    as_ipc(ipc)
    as_collective(coll)
    out = call_entries("ipc", ipc, prob) | call_entries("collective", coll, prob)
    out |= dropin_entries(comm, width)
    op = torch.ops.cpindex.block_scores
    out["torch.ops.cpindex.block_scores"] = lambda: op(
        q, cache, None, bt, sl, 0, 1, width, 128**-0.5, QUERY_LEN
    )
    out["ops.block_scores"] = lambda: ops.block_scores(
        q, cache, bt, sl, width=width, query_len=QUERY_LEN
    )
    scorer = fake_scorer(4)
    buf = torch.empty(4, REQUESTS * QUERY_LEN, width)
    out["launcher.score_local"] = lambda: scorer.score_local(
        q, cache, bt, sl, buf, init_blocks=0, local_blocks=1, width=width, query_len=QUERY_LEN
    )
    return out


def gpu_entries(comm) -> dict[str, Callable[[], object]]:
    """``--gpu``: the collective rows on GPU 0, only the communication stubbed."""
    dev = torch.device("cuda", 0)
    prob = testing.make_problem(REQUESTS, CONTEXT, FMT, query_len=QUERY_LEN, seed=0, device=dev)
    coll = IndexCP(configs(prob.width, transport="collective"), device=dev, comm=comm)
    stub_communication(coll)
    assert coll._transport.agree_on_device
    return call_entries("collective", coll, prob)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=5000, help="timed calls per entry point")
    ap.add_argument("--profile", metavar="ENTRY", help="cProfile this entry point instead")
    ap.add_argument("--only", nargs="*", help="time only these entry points")
    ap.add_argument("--gpu", action="store_true", help="the collective rows on GPU 0 (above)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    between: Callable[[], object] = lambda: None  # noqa: E731
    if args.gpu:
        between = torch.cuda.synchronize
    else:
        stub_content_checks()
        stub_op_reference()

    def job(comm):
        fns = gpu_entries(comm) if args.gpu else entries(comm)
        if args.profile:
            fn = fns[args.profile]
            for _ in range(500):
                fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        print(f"cpindex from {cpindex.__file__}")
        print(f"{'entry point':<32} {'median us':>10} {'min us':>8}")
        for name, fn in fns.items():
            if args.only and name not in args.only:
                continue
            s = time_us(fn, args.calls, between)
            print(f"{name:<32} {statistics.median(s):>10.1f} {min(s):>8.1f}")

    run_threads(1, job, device="cuda:0" if args.gpu else "cpu")


if __name__ == "__main__":
    main()
