"""The CP gate: which calls go context-parallel (docs/design.md, "CP per call: the gate").

A call's size is its **blocks**, ``requests * width``: both are static sizes every rank shares
(``width`` defaults to ``block_table.shape[1]``), so every rank decides alike, all T rows of a
request take one path, and a captured graph makes the same choice at every replay. A call of
at least its operation's threshold goes context-parallel; a smaller one is scored (and
selected) by each rank alone for its own heads (``cpindex/transports/local.py``), with the same
results. ``score_push`` and ``select_blocks`` have a threshold each; an explicit
``cp_min_blocks`` sets both.

**The model** (``cp_min_blocks="auto"``). Per call and per rank, a path costs its fixed costs
(kernel launches, the merge, the exchange) plus its scan; the scan is bandwidth-bound, so
scanning ``b`` blocks takes ``t_scan(b) = b * page_bytes / bandwidth``:

    local(op, b) = F_local(op) + t_scan(b)          this rank's heads over every block
    cp(op, b)    = F_cp(op)    + t_scan(b) / W      all heads over 1/W of the blocks

(the scan of H heads over ``b / W`` blocks reads ``b / W`` pages: the pages, not the heads,
cost). CP pays from ``cp < local``, that is from

    b*(op) = D(op) * bandwidth / (page_bytes * (1 - 1/W)),   D(op) = F_cp(op) - F_local(op)

blocks. ``D(op)``, what a context-parallel call costs beyond a local one apart from the scan,
is the exchange plus the difference in launches:

    D(op) = t_exchange + (LAUNCHES[cp path][op] - LAUNCHES["local"][op]) * LAUNCH_S

=====================  ==========  ===============  ============================================
path                   score_push  select_blocks    launches (device ops) beside the exchange
=====================  ==========  ===============  ============================================
local                  1           2                scoring; + selection and merge (one kernel)
push (ipc, mori)       1           1                one launch: score, select, merge, handshake
collective             3           4                query stamp, scoring, interleave copy; for
                                                    select: stamp, scoring, selection, merge
=====================  ==========  ===============  ============================================

On the push transports ``select_blocks`` crosses over earlier than ``score_push`` (its local
path pays a launch past the scoring that the push does not); on ``collective`` the two cross
together.

The inputs:

* ``page_bytes``: the format's (bf16 32 KiB, fp8 16 KiB, nvfp4 9 KiB);
* ``bandwidth``: the device's nominal HBM bandwidth (from its memory clock and bus width, else
  :data:`DEFAULT_BANDWIDTH`);
* ``W``: the group's size;
* ``D(op)``: measured at construction where the ranks are real, distinct GPUs. The push
  transports time tiny calls of each op (every column forced, no page read: fixed costs only)
  context-parallel and locally, back to back on the device, and take the difference, which
  is ``D(op)`` itself. ``collective`` times a header round and a tiny all-gather and
  all-to-all on the host (its exchange, ``t_exchange``) and adds the launch difference above.
  Where not measured: ``t_exchange`` from :data:`DEFAULT_EXCHANGE_S` and the table, with
  ``LAUNCH_S`` = :data:`LAUNCH_S`.

Every rank computes its own ``b*`` per op and the ranks take the largest of each, so all hold
the same two thresholds: both stay static-size decisions shared by every rank. Where the ranks
share a device (the one-process world, processes on one GPU) or run on the CPU, ``auto`` is 0:
W ranks on one device share its bandwidth, so the model does not hold there, and those worlds
exist to run the exchange. With one rank, ``auto`` never goes context-parallel.

**The gate and disagreement.** The path is decided from the call's own static sizes, by each
rank alone: a call below the gate then needs no exchange, host round or wait, and a captured
one replays with no host code at all. The price is that a call below the gate is compared with
nothing (docs/contract.md, "The gate and disagreement").
"""

from __future__ import annotations

import logging
import math
import socket
import time
from dataclasses import dataclass

import torch

from . import formats, lockstep
from .comm import Comm
from .config import MAX_FUSED_TOPK, CPIndexConfig
from .plan import Call, Plan
from .transports.base import Transport
from .transports.local import LocalPath

log = logging.getLogger("cpindex")

#: The operations the gate decides for, each with its own threshold.
OPS = ("score_push", "select_blocks")
#: The exchange's fixed cost per call where it is not measured: the push handshake of ``ipc``
#: and ``mori`` over NVLink/xGMI, and ``collective``'s rounds over NCCL/RCCL.
DEFAULT_EXCHANGE_S = {"ipc": 8e-6, "mori": 8e-6, "collective": 30e-6}
#: Kernel launches (or small device ops) per call beside the exchange, per path and op (the
#: module docstring's table). The push transports' one launch scores, selects and merges.
LAUNCHES = {
    "local": {"score_push": 1, "select_blocks": 2},
    "push": {"score_push": 1, "select_blocks": 1},
    "collective": {"score_push": 3, "select_blocks": 4},
}
#: What one more launch costs a call on the device where not measured: the gap between two
#: dependent kernels on a stream or in a graph, and a tiny kernel's own run.
LAUNCH_S = 2e-6
#: Nominal HBM bandwidth (bytes/s) of a device that reports no memory clock or bus width.
DEFAULT_BANDWIDTH = 3e12
#: Tiny calls timed at construction, after warm-up calls.
MEASURE_CALLS, MEASURE_WARMUP = 20, 5


@dataclass(frozen=True)
class Gate:
    """An instance's resolved gate: ``score_push`` calls of at least ``threshold`` blocks go
    context-parallel, ``select_blocks`` calls of at least ``select_threshold`` (None: the
    same). ``source``: ``"config"`` (an explicit ``cp_min_blocks``, both ops), ``"one rank"``,
    ``"shared device"`` (CPU, or ranks sharing a GPU: ``auto`` is 0), ``"model"`` (the
    default fixed costs) or ``"measured"``. The model's inputs, where it ran: this rank's
    ``t_exchange_s`` (the ranks' largest when measured), ``bandwidth`` (bytes/s),
    ``page_bytes`` and ``extra_s``, ``D(op)`` per op in :data:`OPS` order (what a
    context-parallel call costs beyond a local one apart from the scan; the ranks' largest)."""

    threshold: int
    source: str
    t_exchange_s: float | None = None
    bandwidth: float | None = None
    page_bytes: int | None = None
    select_threshold: int | None = None
    extra_s: tuple[float, float] | None = None

    def threshold_for(self, op: str = "score_push") -> int:
        """The threshold of ``op`` (``"score_push"`` or ``"select_blocks"``)."""
        if op == "select_blocks" and self.select_threshold is not None:
            return self.select_threshold
        return self.threshold

    def uses_cp(self, blocks: int, op: str = "score_push") -> bool:
        return blocks >= self.threshold_for(op)


def disagreement_note(gate: Gate) -> str | None:
    """What a context-parallel call that timed out waiting for its peers adds to its error
    where the gate sends some calls below it (None where it sends none): the ranks it waited
    for may have made the call below the gate (docs/contract.md, "The gate and
    disagreement"). Its peers' sizes are not known here: that is the blind spot."""
    score, select = gate.threshold_for("score_push"), gate.threshold_for("select_blocks")
    if max(score, select) <= 0:
        return None
    sizes = f"{score} blocks" if score == select else f"{score} blocks ({select} for select_blocks)"
    return (
        f"A rank waited for here that passed this call fewer than {sizes}, requests x width, "
        "made it below the CP gate: alone, compared with nothing, and returned. Ranks that "
        'pass other sizes can fall on both sides of the gate (docs/contract.md, "The gate '
        'and disagreement").'
    )


def page_bytes(fmt: str) -> int:
    """Bytes of one 128-token page of the index cache in ``fmt``."""
    return formats.PAGE_TOKENS * formats.BYTES_PER_TOKEN[fmt]


def hbm_bandwidth(device: torch.device) -> float:
    """The device's nominal memory bandwidth in bytes/s: double data rate over its memory clock
    and bus width, or :data:`DEFAULT_BANDWIDTH` where it reports none (or nothing plausible)."""
    if device.type != "cuda":
        return DEFAULT_BANDWIDTH
    props = torch.cuda.get_device_properties(device)
    khz = getattr(props, "memory_clock_rate", 0) or 0
    bits = getattr(props, "memory_bus_width", 0) or 0
    bw = 2.0 * khz * 1e3 * bits / 8
    return bw if 1e11 <= bw <= 1e14 else DEFAULT_BANDWIDTH


def crossover_blocks(extra_s: float, bandwidth: float, page: int, world: int) -> int:
    """The model's ``b*``: the fewest blocks for which W GPUs scanning ``1/W`` each, plus
    ``extra_s`` (``D(op)``: the exchange and the launch difference), beat one GPU scanning
    all (module docstring). ``world >= 2``; a negative ``extra_s`` counts as 0."""
    if world < 2:
        raise ValueError(f"world: expected >= 2, got {world}")
    return math.ceil(max(extra_s, 0.0) * bandwidth / (page * (1.0 - 1.0 / world)))


def path_kind(transport_name: str, host_lockstep: bool) -> str:
    """The row of :data:`LAUNCHES` a transport's context-parallel calls take."""
    return "collective" if host_lockstep or transport_name == "collective" else "push"


def extra_costs(t_exchange_s: float, kind: str) -> tuple[float, float]:
    """``D(op)`` for each op of :data:`OPS` from the exchange's latency and the launch
    table (module docstring)."""
    return tuple(  # type: ignore[return-value]
        t_exchange_s + (LAUNCHES[kind][op] - LAUNCHES["local"][op]) * LAUNCH_S for op in OPS
    )


def modeled(
    fmt: str,
    transport_name: str,
    world: int,
    bandwidth: float,
    t_exchange_s: float | None = None,
    extra_s: tuple[float, float] | None = None,
) -> Gate:
    """The gate ``auto`` resolves to on ``world`` distinct GPUs of ``bandwidth`` with the
    model's defaults (or the given exchange latency, or ``D(op)`` per op): what a
    deployment's ranks would hold, computed without them."""
    t_ex = (
        DEFAULT_EXCHANGE_S.get(transport_name, DEFAULT_EXCHANGE_S["collective"])
        if t_exchange_s is None
        else t_exchange_s
    )
    if extra_s is None:
        extra_s = extra_costs(t_ex, path_kind(transport_name, False))
    page = page_bytes(fmt)
    score, select = (crossover_blocks(d, bandwidth, page, world) for d in extra_s)
    return Gate(score, "model", t_ex, bandwidth, page, select, extra_s)


def resolve(
    config: CPIndexConfig,
    comm: Comm,
    device: torch.device,
    transport: Transport,
    local: LocalPath,
) -> Gate:
    """The instance's gate (collective for ``auto`` with peers: every rank takes the same
    steps and ends with the same thresholds). Called once the transport is built."""
    if config.cp_min_blocks != "auto":  # a shared field: construction compared it already
        return Gate(config.cp_min_blocks, "config")
    never = config.max_rows * config.max_width + 1  # past every call of the instance
    if comm.world_size == 1:
        return Gate(never, "one rank")
    places = comm.all_gather_object(_placement(device))
    if None in places or len(set(places)) < len(places):
        return Gate(0, "shared device")
    page, bw, w = page_bytes(config.cache_format), hbm_bandwidth(device), comm.world_size
    kind = path_kind(transport.name, transport.host_lockstep)
    t_ex = DEFAULT_EXCHANGE_S.get(transport.name, DEFAULT_EXCHANGE_S["collective"])
    measured, note = _measure(config, comm, device, transport, local)
    if measured is None:
        extra = extra_costs(t_ex, kind)
    elif kind == "collective":  # the rounds' latency: the launches from the table
        t_ex = measured[0]
        extra = extra_costs(t_ex, kind)
    else:  # D(op) itself, per op; the exchange is score_push's (one launch on either path)
        extra = measured
        t_ex = measured[0]
    mine = [crossover_blocks(d, bw, page, w) for d in extra]
    reports = comm.all_gather_object((mine, list(extra), t_ex, note))
    score = max(r[0][0] for r in reports)
    select = max(r[0][1] for r in reports)
    extra = tuple(max(r[1][i] for r in reports) for i in range(len(OPS)))  # type: ignore[assignment]
    t_ex = max(r[2] for r in reports)
    if "gate" in comm.counters:  # every rank is past the measurement's last round now
        comm.forget(f"gate/{comm.counters['gate']}")
    failed = [f"rank {r}: {rep[3]}" for r, rep in enumerate(reports) if rep[3]]
    if failed and comm.rank == 0:
        log.warning("cpindex: CP gate: default exchange latency on %s", "; ".join(failed))
    if comm.rank == 0:
        log.info(
            "cpindex: CP gate at %d blocks (score_push), %d (select_blocks) (extra per CP call "
            "%.1f / %.1f us, t_exchange %.1f us%s, %.2f TB/s, %d-byte pages, W=%d)",
            score, select, extra[0] * 1e6, extra[1] * 1e6, t_ex * 1e6,
            " measured" if measured is not None else "", bw / 1e12, page, w,
        )  # fmt: skip
    source = "measured" if measured is not None and not failed else "model"
    return Gate(score, source, t_ex, bw, page, select, extra)  # type: ignore[arg-type]


def _placement(device: torch.device) -> tuple[str, str] | None:
    """(host, GPU UUID), or None on the CPU: ranks whose placements repeat share a device."""
    if device.type != "cuda":
        return None
    return socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid)


def tiny_call(config: CPIndexConfig, heads_per_rank: int, device: torch.device) -> Call:
    """One request whose every column is forced (no page is read) and one column per rank:
    a call that costs the launches and the exchange, and nothing else."""
    w = max(1, config.world_size or 1)
    width = min(config.max_width, w)
    fmt = config.cache_format
    if fmt == "nvfp4":
        cache = torch.zeros(1, formats.NVFP4_PAGE_BYTES, dtype=torch.uint8, device=device)
    else:
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
        cache = torch.zeros(1, 128, 128, dtype=dtype, device=device)
    plan = Plan(
        block_table=torch.zeros(1, width, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([width * config.block_size], dtype=torch.int32, device=device),
        init_blocks=0,
        local_blocks=width,
        width=width,
    )
    q = torch.zeros(1, heads_per_rank, config.head_dim, device=device)
    return Call(iq=q.to(formats.query_dtype(fmt)), index_cache=cache, plan=plan)


def _measure(
    config: CPIndexConfig,
    comm: Comm,
    device: torch.device,
    transport: Transport,
    local: LocalPath,
) -> tuple[tuple[float, float] | None, str]:
    """This rank's measurement (None where it could not be made) and why not: ``D(op)`` per
    op (push transports), or the exchange's latency twice (host-lockstep transports), in
    seconds. Collective: each step is taken by every rank alike; a rank that cannot prepare
    says so first and then no rank measures."""
    prepared, why = None, ""
    try:
        prepared = _prepare(config, comm, device, transport, local)
    except Exception as e:  # a preparation must never leave the others in a collective
        why = f"{type(e).__name__}: {e}"
    ready = comm.all_gather_object(prepared is not None)
    if not all(ready):
        return None, why or "a peer could not prepare the measurement"
    try:  # every rank reaches the gather of reports after it, whatever happens here
        return prepared(), ""  # type: ignore[misc]
    except Exception as e:
        return None, f"the measurement failed: {type(e).__name__}: {e}"


def _prepare(config, comm, device, transport, local):
    """What times the fixed costs: tiny calls of each op pushed against the same calls made
    locally (the push transports), or a header round plus a tiny all-gather and all-to-all
    (host-lockstep transports such as ``collective``)."""
    w = comm.world_size
    if not transport.host_lockstep:
        call = tiny_call(config, config.heads_per_rank(w), device)
        k = max(1, min(config.max_topk, MAX_FUSED_TOPK))

        def push() -> tuple[float, float]:
            extra = []
            for cp_fn, local_fn in (
                (lambda: transport.score_push(call), lambda: local.score_push(call)),
                (
                    lambda: transport.select_blocks(call, k),
                    lambda: local.select_blocks(call, k),
                ),
            ):
                t_cp = _time_gpu(cp_fn, comm, device)
                t_local = _time_gpu(local_fn, comm, device)
                extra.append(t_cp - t_local)
            transport.check()
            error = local.take_error()
            if error is not None:
                raise error
            return extra[0], extra[1]

        return push
    small = torch.zeros(16, dtype=torch.uint8, device=device)
    gathered = torch.empty(w * 16, dtype=torch.uint8, device=device)
    sent = torch.zeros(w, 16, dtype=torch.uint8, device=device)
    got = torch.empty(w, 16, dtype=torch.uint8, device=device)
    timeout = config.timeout_s

    def one() -> None:
        n = lockstep.next_round(comm, "gate")
        lockstep.exchange(comm, f"gate/{n}", 0, timeout, what="the CP gate's measurement")
        comm.forget(f"gate/{n - 1}")  # every rank is past the previous round
        comm.all_gather_into(gathered, small, timeout_s=timeout)
        comm.all_to_all_into(got, sent, timeout_s=timeout)

    def rounds() -> tuple[float, float]:
        for _ in range(MEASURE_WARMUP):
            one()
        _sync(device)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(MEASURE_CALLS):
            one()
        _sync(device)
        t = (time.perf_counter() - t0) / MEASURE_CALLS
        return t, t

    return rounds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_gpu(fn, comm: Comm, device: torch.device) -> float:
    """Seconds per call of ``fn`` over :data:`MEASURE_CALLS` back-to-back calls on the current
    stream (CUDA events), after warm-up calls and with every rank starting together."""
    for _ in range(MEASURE_WARMUP):
        fn()
    torch.cuda.synchronize(device)
    comm.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(MEASURE_CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / MEASURE_CALLS
