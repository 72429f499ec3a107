"""A world of W processes on one GPU: gloo for the host side, real CUDA IPC handles for the
``ipc`` transport's buffers. Production refuses ranks of several processes on one GPU; each rank
here turns on the test switch :func:`cpindex.transports.peer.allow_shared_gpu_processes`.

The GPU time-slices between the processes, so each handoff of the spin handshake costs tens of
ms (about 24 ms on an H200): calls are few, and every timeout allows for it.

The parent never touches CUDA (in a session that ran other GPU tests first, its context stays
idle). It reads the inputs (built on the CPU) from a file, spawns the ranks, waits for each
phase's report file with a bound, kills the victim rank in the last phase, and kills every rank
still running at the end, whatever happened. Each rank runs the phases in
order, reports each one (``rank{r}.{phase}.pt``), and stops at its first exception, which its
report carries. Results are compared with the reference in the parent, on the CPU.

Phases: ``ready`` (group joined, kernel module loaded), ``calls`` (every format, T = 1 and 4,
``score_push`` and ``select_blocks``), ``graph`` (capture and replays), ``cycles`` (construct
and close, memory before and after), ``kill-loop`` then ``kill`` (calls in a loop until a peer
is killed).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpindex import CPIndexConfig, IndexCP, kernels, testing
from cpindex.spawn import free_port
from cpindex.transports.peer import allow_shared_gpu_processes

DEV = "cuda:0"
FORMATS = ("bf16", "fp8", "nvfp4")
TOPK = 16
TIMEOUT_S = 20.0  # a peer wait: hundreds of handoffs
KILL_TIMEOUT_S = 10.0  # the kill phase's own: the survivors wait it out once
GROUP_TIMEOUT_S = 120.0  # gloo collectives and the store
KILL_DELAY_S = 0.5  # calls in the loop before the kill
KILL_LOOP_S = 60.0 + KILL_TIMEOUT_S  # a rank's loop ends by itself after this
CYCLES, CYCLE_WARMUP = 200, 3

# Parent-side bounds on each phase (failure bounds, not expected durations). "ready" covers a
# cold build of the kernel module, once for all ranks (the build holds a file lock).
PHASE_BUDGET_S = {"ready": 600.0, "calls": 300.0, "graph": 120.0, "cycles": 300.0}
PHASES = ("calls", "graph", "cycles", "kill")
FAILED_GRACE_S = 30.0  # once a rank failed, how long the others get to report theirs

CALLS_CFG = dict(
    transport="ipc", max_rows=32, max_query_len=4, max_width=32, max_topk=TOPK,
    timeout_s=TIMEOUT_S,
)  # fmt: skip
GRAPH_CFG = dict(
    transport="ipc", cache_format="nvfp4", max_rows=8, max_width=32, max_topk=TOPK,
    timeout_s=TIMEOUT_S,
)  # fmt: skip
# A region of 0.5-1 MiB per rank (W = 4, 2), so a leaked region or mapping shows in
# cudaMemGetInfo at once; no self-test, so a cycle runs no kernel and no handshake.
CYCLES_CFG = dict(
    transport="ipc", max_rows=32, max_width=4096, ipc_self_test=False, timeout_s=TIMEOUT_S
)
KILL_CFG = dict(
    transport="ipc", cache_format="fp8", max_rows=8, max_width=16, timeout_s=KILL_TIMEOUT_S,
    error_check="sync",
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One checked call shape of the ``calls`` phase."""

    name: str
    requests: int
    query_len: int
    max_len: int
    init: int
    local: int
    extra_width: int  # columns past the longest row's blocks
    seed: int


# The first case fills max_rows x max_width: the warm-up call on it writes (and then poisons)
# every element any later call returns.
CASES = (
    Case("T1-full", 32, 1, 32 * 128, 0, 1, 0, 11),
    Case("T1-ragged", 3, 1, 20 * 128 + 5, 1, 1, 2, 12),
    Case("T4-full", 8, 4, 32 * 128, 0, 1, 0, 13),
    Case("T4-ragged", 2, 4, 9 * 128, 1, 1, 3, 14),
)
GRAPH_REQUESTS, GRAPH_BLOCKS, GRAPH_VARIANTS = 5, 20, 4


def build_inputs() -> dict[str, Any]:
    """Every phase's inputs, on the CPU (fresh random data, never zeros)."""
    calls: dict[str, dict[str, testing.Problem]] = {}
    for fmt in FORMATS:
        calls[fmt] = {}
        for c in CASES:
            p = testing.make_problem(c.requests, c.max_len, fmt, query_len=c.query_len, seed=c.seed)
            p.width += c.extra_width
            calls[fmt][c.name] = p
    # Graph replays: the captured problem, then variants of q, seq_lens and block_table copied
    # into the captured tensors (same cache, same shapes).
    base = testing.make_problem(GRAPH_REQUESTS, GRAPH_BLOCKS * 128, "nvfp4", seed=30)
    gen = torch.Generator().manual_seed(31)
    pages = base.index_cache.shape[0]
    graph = [base]
    for v in range(1, GRAPH_VARIANTS):
        q = testing.make_problem(GRAPH_REQUESTS, GRAPH_BLOCKS * 128, "nvfp4", seed=30 + v).q
        lens = testing.random_lengths(GRAPH_REQUESTS, GRAPH_BLOCKS * 128, gen)
        table = torch.randint(0, pages, base.block_table.shape, generator=gen, dtype=torch.int32)
        graph.append(testing.Problem(q, base.index_cache, table, lens, base.width, "nvfp4"))
    kill = testing.make_problem(4, 10 * 128, "fp8", seed=40)
    return {"calls": calls, "graph": graph, "kill": kill}


# ---- the ranks ----------------------------------------------------------------------------


def _report(out_dir: Path, rank: int, phase: str, payload: dict) -> None:
    """Write a report atomically: the parent never reads half a file."""
    tmp = out_dir / f".rank{rank}.{phase}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, out_dir / f"rank{rank}.{phase}.pt")


@dataclass
class _Rank:
    rank: int
    world: int
    out_dir: Path
    inputs: dict[str, Any]


def _timed(fn) -> tuple[Any, float]:
    """``fn()`` between a barrier (every rank ready, no peer still busy with this rank's
    buffers) and the end of this rank's device work: the call's wall time, handoffs
    included."""
    dist.barrier()
    t0 = time.monotonic()
    out = fn()
    torch.cuda.synchronize()
    return out, time.monotonic() - t0


def _calls(r: _Rank) -> dict:
    """Every format, T = 1 and 4: ``score_push`` and ``select_blocks`` on fresh inputs, every
    output poisoned before it is written again (NaN scores, ids -7)."""
    results, times, mappings, transports = {}, [], {}, {}
    for fmt in FORMATS:
        probs = {name: p.to(DEV) for name, p in r.inputs["calls"][fmt].items()}
        qs = {name: p.rank_queries(r.rank, r.world) for name, p in probs.items()}
        with IndexCP(CPIndexConfig(cache_format=fmt, **CALLS_CFG), device=DEV) as cp:
            transports[fmt] = cp.transport_name
            # Peers' buffers opened through IPC handles (not the one-process world's pointers).
            mappings[fmt] = len(getattr(cp._transport, "_opened", []))

            def call(case: Case, op: str, cp=cp, probs=probs, qs=qs):
                p = probs[case.name]
                plan = cp.plan(
                    p.block_table, p.seq_lens, query_len=case.query_len, init_blocks=case.init,
                    local_blocks=case.local, width=p.width,
                )  # fmt: skip
                if op == "score_push":
                    return cp.score_push(qs[case.name], p.index_cache, plan)
                return cp.select_blocks(
                    qs[case.name], p.index_cache, plan, topk=TOPK, return_scores=True
                )

            # Warm-up on the largest case, then poison everything it returned.
            scores, _ = _timed(lambda c=CASES[0]: call(c, "score_push"))
            (ids, vals), _ = _timed(lambda c=CASES[0]: call(c, "select_blocks"))
            cp.check()
            scores.fill_(float("nan"))
            ids.fill_(-7)
            vals.fill_(float("nan"))
            torch.cuda.synchronize()  # poisoned before any peer's next push can land
            for case in CASES:
                scores, t_s = _timed(lambda c=case: call(c, "score_push"))
                cp.check()
                got_scores = scores.cpu()
                scores.fill_(float("nan"))
                torch.cuda.synchronize()
                (ids, vals), t_k = _timed(lambda c=case: call(c, "select_blocks"))
                cp.check()
                results[f"{fmt}/{case.name}"] = {
                    "scores": got_scores, "ids": ids.cpu(), "vals": vals.cpu()
                }  # fmt: skip
                ids.fill_(-7)
                vals.fill_(float("nan"))
                torch.cuda.synchronize()
                times += [
                    {"op": "score_push", "fmt": fmt, "case": case.name, "s": t_s},
                    {"op": "select_blocks", "fmt": fmt, "case": case.name, "s": t_k},
                ]
    return {"results": results, "times": times, "ipc_mappings": mappings, "transports": transports}


def _graph(r: _Rank) -> dict:
    """One graph per process holding a ``score_push`` and a ``select_blocks``; replays with
    each variant's q, seq_lens and block_table copied into the captured tensors, outputs
    poisoned before each replay."""
    probs = [p.to(DEV) for p in r.inputs["graph"]]
    base = probs[0]
    cache, width = base.index_cache, base.width
    q = base.rank_queries(r.rank, r.world).clone()
    table, lens = base.block_table.clone(), base.seq_lens.clone()
    variants = [(p.rank_queries(r.rank, r.world), p.block_table, p.seq_lens) for p in probs]
    out: dict[str, Any] = {"replays": [], "times": []}
    with IndexCP(CPIndexConfig(**GRAPH_CFG), device=DEV) as cp:
        plan = cp.plan(table, lens, width=width)  # the captured tensors: refilled per replay

        def calls():
            scores = cp.score_push(q, cache, plan)
            kept = scores.clone()
            ids, vals = cp.select_blocks(q, cache, plan, topk=TOPK, return_scores=True)
            return scores, kept, ids, vals

        _timed(calls)  # eager first: the call images exist before the capture
        cp.check()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            scores, kept, ids, vals = calls()
        for vq, vt, vl in variants:
            q.copy_(vq)
            table.copy_(vt)
            lens.copy_(vl)
            for t in (scores, kept, vals):
                t.fill_(float("nan"))
            ids.fill_(-7)
            torch.cuda.synchronize()
            _, t_r = _timed(graph.replay)
            cp.check()
            out["replays"].append({"scores": kept.cpu(), "ids": ids.cpu(), "vals": vals.cpu()})
            out["times"].append(t_r)
        del graph  # before close: it holds the instance's buffers
    return out


def _memory() -> dict:
    """Device memory once every rank has released what it can: cudaMemGetInfo's free bytes
    (device-wide: every process's allocations and mappings), this process's allocator, and its
    open file descriptors."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()  # every rank released before anyone measures
    free, total = torch.cuda.mem_get_info()
    got = {
        "free": free,
        "total": total,
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "fds": len(os.listdir("/proc/self/fd")),
    }
    dist.barrier()  # nobody allocates again before everyone measured
    return got


def _cycles(r: _Rank) -> dict:
    cfg = CPIndexConfig(**CYCLES_CFG)

    def cycle() -> None:
        IndexCP(cfg, device=DEV).close()

    for _ in range(CYCLE_WARMUP):  # first-use allocations (module tables, pinned pools)
        cycle()
    before = _memory()
    t0 = time.monotonic()
    for _ in range(CYCLES):
        cycle()
    seconds = time.monotonic() - t0
    return {"cycles": CYCLES, "seconds": seconds, "before": before, "after": _memory()}


def _kill(r: _Rank) -> dict:
    """Calls in a loop (each synchronized and checked, ``error_check="sync"``) until one raises
    or the loop runs out; the parent kills the victim meanwhile. With the GPU time-sliced, the
    ranks spend nearly all of the loop inside calls, so the kill lands mid-call. The instance is
    never closed: its group has lost a rank (the process ends right after its report)."""
    p = r.inputs["kill"].to(DEV)
    cp = IndexCP(CPIndexConfig(**KILL_CFG), device=DEV)
    args = (p.rank_queries(r.rank, r.world), p.index_cache, cp.plan(p.block_table, p.seq_lens))
    _timed(lambda: cp.score_push(*args))
    _report(r.out_dir, r.rank, "kill-loop", {"ok": True, "data": {"pid": os.getpid()}})
    calls, t0 = 1, time.monotonic()
    while time.monotonic() - t0 < KILL_LOOP_S:
        try:
            cp.score_push(*args)
        except Exception as e:
            t = time.monotonic()
            return {
                "error_type": type(e).__name__,
                "message": str(e),
                "peer": getattr(e, "peer", None),
                "t_error": t,
                "calls": calls,
                "loop_s": t - t0,
            }
        calls += 1
    return {"error_type": None, "calls": calls, "loop_s": time.monotonic() - t0}


_PHASE_FNS = {"calls": _calls, "graph": _graph, "cycles": _cycles, "kill": _kill}


def _rank_main(rank: int, world: int, port: int, out_dir: str, phases: tuple[str, ...]) -> None:
    """One rank's process (spawned: everything it needs is imported at the top of this module).
    Always ends with ``os._exit``: after a peer died, destructors and the group's teardown
    could wait on it."""
    out = Path(out_dir)
    phase = "ready"
    try:
        # W processes share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (2 * world)))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
        )
        torch.cuda.set_device(DEV)
        allow_shared_gpu_processes(True)
        t0 = time.monotonic()
        for fmt in (None, *FORMATS):  # cold builds happen here, before any timed wait
            kernels.load(torch.device(DEV), fmt)
        load_s = time.monotonic() - t0
        inputs = torch.load(out / "inputs.pt", weights_only=False)
        dist.barrier()
        ready = {"pid": os.getpid(), "load_s": load_s, "device": torch.cuda.get_device_name(DEV)}
        _report(out, rank, phase, {"ok": True, "data": ready})
        r = _Rank(rank, world, out, inputs)
        for phase in phases:
            t0 = time.monotonic()
            data = _PHASE_FNS[phase](r)
            _report(out, rank, phase, {"ok": True, "data": data, "s": time.monotonic() - t0})
    except BaseException:
        try:
            _report(out, rank, phase, {"ok": False, "error": traceback.format_exc()})
        except BaseException:
            traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ---- the parent ---------------------------------------------------------------------------


@contextlib.contextmanager
def _environ(**values: str):
    """``os.environ`` with ``values`` set (what a spawned child inherits), then as before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class WorldRun:
    """What a process world reported: ``reports[phase][rank]`` is ``{"ok": True, "data": ...}``
    or ``{"ok": False, "error": text}``; phases after a failed one are absent."""

    world: int
    victim: int
    reports: dict[str, dict[int, dict]] = field(default_factory=dict)
    t_kill: float | None = None  # time.monotonic() just before the SIGKILL (system-wide clock)
    exitcodes: list[int | None] = field(default_factory=list)
    seconds: float = 0.0

    def failure(self) -> str | None:
        """The first failed phase's errors, if any."""
        for phase, reps in self.reports.items():
            bad = [f"rank {r}: {rep['error']}" for r, rep in sorted(reps.items()) if not rep["ok"]]
            if bad:
                return f"phase {phase!r} failed:\n" + "\n".join(bad)
        return None


class ProcessWorld:
    """W spawned rank processes on ``cuda:0`` and bounded waits for their reports."""

    def __init__(self, world: int, out_dir: Path) -> None:
        self.world, self.out_dir = world, out_dir
        self.procs: list[Any] = []

    def start(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        port = free_port()
        # Each rank is a process with its own CUDA context, so a lazy kernel load waits only for
        # that process's own work, never for a peer (docs/design.md, the one-process world, rule
        # 3): the ranks start without loading every kernel of torch's libraries up front.
        with _environ(CUDA_MODULE_LOADING="LAZY"):
            for rank in range(self.world):
                p = ctx.Process(
                    target=_rank_main,
                    args=(rank, self.world, port, str(self.out_dir), PHASES),
                    name=f"cpindex-rank{rank}",
                    daemon=True,
                )
                p.start()
                self.procs.append(p)

    def wait(self, phase: str, ranks: list[int], timeout_s: float) -> dict[int, dict]:
        """Each rank's report of ``phase``; a rank that exits without one, or does not report
        within ``timeout_s``, gets a failed report saying so. Once a rank has failed, the
        others get ``FAILED_GRACE_S`` to report their own view of it."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, dict] = {}
        while True:
            for r in ranks:
                if r in got:
                    continue
                path = self.out_dir / f"rank{r}.{phase}.pt"
                alive = self.procs[r].is_alive()
                if path.exists():  # after is_alive: a report written just before exit counts
                    got[r] = torch.load(path, weights_only=False)
                elif not alive:
                    got[r] = {
                        "ok": False,
                        "error": f"exited (code {self.procs[r].exitcode}) without reporting "
                        f"{phase!r}{self._failed_report(r)}",
                    }
                if r in got and not got[r]["ok"]:
                    deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
            if len(got) == len(ranks):
                return got
            if time.monotonic() > deadline:
                for r in ranks:
                    got.setdefault(r, {"ok": False, "error": f"no report of {phase!r} in time"})
                return got
            time.sleep(0.05)

    def _failed_report(self, rank: int) -> str:
        """A rank's failed report of another phase (it stopped there), as a suffix."""
        for path in sorted(self.out_dir.glob(f"rank{rank}.*.pt")):
            rep = torch.load(path, weights_only=False)
            if not rep["ok"]:
                return f"; it failed in {path.name.split('.')[1]!r}:\n{rep['error']}"
        return ""

    def kill(self, rank: int) -> float:
        """SIGKILL ``rank``; the time just before (a rank already gone is left as it is)."""
        t = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[rank].pid, signal.SIGKILL)
        return t

    def stop(self) -> list[int | None]:
        """Kill every rank still running; their exit codes (-9: killed)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        return [p.exitcode for p in self.procs]


def save_inputs(inputs: dict[str, Any], path: Path) -> None:
    """Write :func:`build_inputs`' result where the ranks read it."""
    torch.save(inputs, path)


def run_world(world: int, out_dir: Path, victim: int, inputs_path: Path) -> WorldRun:
    """Run every phase in a world of ``world`` processes reading ``inputs_path``; kill
    ``victim`` in the last phase. Never raises for what the ranks do: their failures are in the
    reports."""
    os.symlink(inputs_path, out_dir / "inputs.pt")
    run = WorldRun(world, victim)
    pw = ProcessWorld(world, out_dir)
    everyone = list(range(world))
    t0 = time.monotonic()
    try:
        pw.start()
        for phase in ("ready", *PHASES[:-1], "kill-loop"):
            run.reports[phase] = pw.wait(phase, everyone, PHASE_BUDGET_S.get(phase, 120.0))
            if run.failure():
                return run
        time.sleep(KILL_DELAY_S)
        run.t_kill = pw.kill(victim)
        survivors = [r for r in everyone if r != victim]
        run.reports["kill"] = pw.wait("kill", survivors, KILL_TIMEOUT_S + 60.0)
        return run
    finally:
        run.exitcodes = pw.stop()
        run.seconds = time.monotonic() - t0
