"""The CP gate: which calls go context-parallel (docs/design.md, "CP per call: the gate").

A call's size is its **blocks**, ``requests * width``: both are static sizes every rank shares
(``width`` defaults to ``block_table.shape[1]``), so every rank decides alike, all T rows of a
request take one path, and a captured graph makes the same choice at every replay. A call of at
least ``threshold`` blocks goes context-parallel; a smaller one is scored by each rank alone for
its own heads (``cpindex/transports/local.py``), with the same results.

``cp_min_blocks="auto"`` takes the threshold from a model. Scanning is bandwidth-bound: a call
of ``b`` blocks costs ``t_scan(b) = b * page_bytes / bandwidth`` on one GPU. Context-parallel,
each of W GPUs scans ``b / W`` of the pages and the exchange adds ``t_exchange``; alone, a GPU
scans them all. CP pays from ``t_scan(b) / W + t_exchange < t_scan(b)``, that is from

    b* = t_exchange * bandwidth / (page_bytes * (1 - 1/W))

blocks. ``page_bytes`` is the format's (bf16 32 KiB, fp8 16 KiB, nvfp4 9 KiB); ``bandwidth``
the device's nominal HBM bandwidth (from its memory clock and bus width, else
:data:`DEFAULT_BANDWIDTH`); ``t_exchange`` is measured at construction where the ranks are real,
distinct GPUs, else :data:`DEFAULT_EXCHANGE_S`. Every rank computes its own ``b*`` and the
ranks take the largest, so all hold one threshold. Where the ranks share a device (the
one-process world, processes on one GPU) or run on the CPU, ``auto`` is 0: W ranks on one device
share its bandwidth, so the model does not hold there, and those worlds exist to run the
exchange. With one rank, ``auto`` never goes context-parallel.
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
from .config import CPIndexConfig
from .plan import Call, Plan
from .transports.base import Transport
from .transports.local import LocalPath

log = logging.getLogger("cpindex")

#: The exchange's fixed cost per call where it is not measured: the push handshake of ``ipc``
#: and ``mori`` over NVLink/xGMI, and ``collective``'s rounds over NCCL/RCCL.
DEFAULT_EXCHANGE_S = {"ipc": 8e-6, "mori": 8e-6, "collective": 30e-6}
#: Nominal HBM bandwidth (bytes/s) of a device that reports no memory clock or bus width.
DEFAULT_BANDWIDTH = 3e12
#: Tiny calls timed at construction, after warm-up calls.
MEASURE_CALLS, MEASURE_WARMUP = 20, 5


@dataclass(frozen=True)
class Gate:
    """An instance's resolved gate: calls of at least ``threshold`` blocks go
    context-parallel. ``source``: ``"config"`` (an explicit ``cp_min_blocks``), ``"one rank"``,
    ``"shared device"`` (CPU, or ranks sharing a GPU: ``auto`` is 0), ``"model"`` (the default
    exchange latency) or ``"measured"``. The model's inputs, where it ran: this rank's
    ``t_exchange_s`` (the ranks' largest when measured), ``bandwidth`` (bytes/s) and
    ``page_bytes``."""

    threshold: int
    source: str
    t_exchange_s: float | None = None
    bandwidth: float | None = None
    page_bytes: int | None = None

    def uses_cp(self, blocks: int) -> bool:
        return blocks >= self.threshold


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


def crossover_blocks(t_exchange_s: float, bandwidth: float, page: int, world: int) -> int:
    """The model's ``b*``: the fewest blocks for which W GPUs scanning ``1/W`` each plus the
    exchange beat one GPU scanning all (module docstring). ``world >= 2``."""
    if world < 2:
        raise ValueError(f"world: expected >= 2, got {world}")
    return math.ceil(t_exchange_s * bandwidth / (page * (1.0 - 1.0 / world)))


def resolve(
    config: CPIndexConfig,
    comm: Comm,
    device: torch.device,
    transport: Transport,
    local: LocalPath,
) -> Gate:
    """The instance's gate (collective for ``auto`` with peers: every rank takes the same
    steps and ends with the same threshold). Called once the transport is built."""
    if config.cp_min_blocks != "auto":  # a shared field: construction compared it already
        return Gate(config.cp_min_blocks, "config")
    never = config.max_rows * config.max_width + 1  # past every call of the instance
    if comm.world_size == 1:
        return Gate(never, "one rank")
    places = comm.all_gather_object(_placement(device))
    if None in places or len(set(places)) < len(places):
        return Gate(0, "shared device")
    page, bw = page_bytes(config.cache_format), hbm_bandwidth(device)
    t_ex = DEFAULT_EXCHANGE_S.get(transport.name, DEFAULT_EXCHANGE_S["collective"])
    measured, note = _measure(config, comm, device, transport, local)
    if measured is not None:
        t_ex = measured
    mine = crossover_blocks(t_ex, bw, page, comm.world_size)
    reports = comm.all_gather_object((mine, note))
    threshold = max(r[0] for r in reports)
    if "gate" in comm.counters:  # every rank is past the measurement's last round now
        comm.forget(f"gate/{comm.counters['gate']}")
    failed = [f"rank {r}: {n}" for r, (_, n) in enumerate(reports) if n]
    if failed and comm.rank == 0:
        log.warning("cpindex: CP gate: default exchange latency on %s", "; ".join(failed))
    if comm.rank == 0:
        log.info(
            "cpindex: CP gate at %d blocks (t_exchange %.1f us%s, %.2f TB/s, %d-byte pages, "
            "W=%d)",
            threshold, t_ex * 1e6, " measured" if measured is not None else "", bw / 1e12,
            page, comm.world_size,
        )  # fmt: skip
    source = "measured" if measured is not None and not failed else "model"
    return Gate(threshold, source, t_ex, bw, page)


def _placement(device: torch.device) -> tuple[str, str] | None:
    """(host, GPU UUID), or None on the CPU: ranks whose placements repeat share a device."""
    if device.type != "cuda":
        return None
    return socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid)


def tiny_call(config: CPIndexConfig, heads_per_rank: int, device: torch.device) -> Call:
    """One request whose every column is forced (no page is read) and one column per rank:
    a call that costs the launch and the exchange, and nothing else."""
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
) -> tuple[float | None, str]:
    """This rank's exchange latency in seconds (None where it could not be measured) and why
    not. Collective: each step is taken by every rank alike; a rank that cannot prepare says
    so first and then no rank measures."""
    prepared, why = None, ""
    try:
        prepared = _prepare(config, comm, device, transport, local)
    except Exception as e:  # a preparation must never leave the others in a collective
        why = f"{type(e).__name__}: {e}"
    ready = comm.all_gather_object(prepared is not None)
    if not all(ready):
        return None, why or "a peer could not prepare the measurement"
    return prepared(), ""  # type: ignore[misc]


def _prepare(config, comm, device, transport, local):
    """What times the exchange: tiny pushed calls against the same calls scored locally (the
    push transports), or a header round plus a tiny all-gather and all-to-all
    (host-lockstep transports such as ``collective``)."""
    w = comm.world_size
    if not transport.host_lockstep:
        call = tiny_call(config, config.heads_per_rank(w), device)

        def push() -> float:
            t_cp = _time_gpu(lambda: transport.score_push(call), comm, device)
            t_local = _time_gpu(lambda: local.score_push(call), comm, device)
            transport.check()
            error = local.take_error()
            if error is not None:
                raise error
            return max(t_cp - t_local, 0.0)

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

    def rounds() -> float:
        for _ in range(MEASURE_WARMUP):
            one()
        torch.cuda.synchronize(device)
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(MEASURE_CALLS):
            one()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / MEASURE_CALLS

    return rounds


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
