"""``cpindex bench --write``: :func:`cpindex.formats.write_keys` on one GPU against the copy
bandwidth measured in the same run, beside a plain torch scatter of the same slots.

A decode step writes a few keys per layer (requests x T), a prefill many: both ends are timed,
with the slot pattern each has. Below :data:`PREFILL_MIN_TOKENS` keys (decode) every key goes
to a page of its own at a random token (each request appends to its own last page); from there
on (prefill) the keys fill whole pages in order, the pages in a random order (a request's keys
fill its pages). Inputs rotate over sets of keys and disjoint slots, so consecutive calls
together touch more memory than the L2 holds (as in the kernel sweep).

Bytes moved per call: the keys read (bf16, 256 B a key), the slots read (8 B a key) and the
cache bytes written (256 / 128 / 72 B a key for bf16 / fp8 / nvfp4). The baseline, ``scatter``,
is an index-copy of pre-quantized bytes to the same slots (``cache.view(-1, bytes_per_token)
[slots] = src``): it reads ``bytes_per_token`` a key instead of 256 and writes as many bytes (for
nvfp4 in one 72-byte row, where the writer puts 64 code bytes and 8 scale bytes in two places of
the page). Kernel times are CUDA graph replays (8 calls a graph), so host launch overhead stays
out of them; ``host us`` is an eager call's host time. Every format's written bytes are checked
against :func:`cpindex.formats.quantize` (``agree``).
"""

from __future__ import annotations

import statistics
import sys

import torch

from .. import formats
from .host_cost import host_us
from .kernel_sweep import ROTATE_BYTES
from .timing import copy_bandwidth_gbs, synthetic_cache, time_graph

SLOT_BYTES = 8  # int64 slots
KEY_BYTES = 2 * formats.HEAD_DIM  # bf16 keys in
PREFILL_MIN_TOKENS = 1024  # from here on keys fill whole pages (prefill), below one per page
HOST_CALLS = 200


def _writer():
    """``(write_keys, check_writes)``, looked up at call time: they come with the writer's
    branch of cpindex.formats."""
    write = getattr(formats, "write_keys", None)
    check = getattr(formats, "check_writes", None)
    if write is None or check is None:
        raise SystemExit(
            "cpindex bench --write: this cpindex has no formats.write_keys / check_writes"
        )
    return write, check


def pattern(tokens: int) -> str:
    """``"decode"`` (a page per key) below :data:`PREFILL_MIN_TOKENS` keys, else
    ``"prefill"`` (whole pages in order)."""
    return "decode" if tokens < PREFILL_MIN_TOKENS else "prefill"


def _slot_sets(tokens: int, sets: int, gen: torch.Generator, dev: torch.device):
    """``(pages, slots int64 [sets, tokens])``: disjoint slots per set, in the pattern of
    :func:`pattern`."""
    if pattern(tokens) == "decode":
        pages = max(64, sets * tokens)
        page = torch.randperm(pages, device=dev, generator=gen)[: sets * tokens]
        token = torch.randint(0, formats.PAGE_TOKENS, (sets * tokens,), device=dev, generator=gen)
        return pages, (page * formats.PAGE_TOKENS + token).view(sets, tokens)
    per_set = -(-tokens // formats.PAGE_TOKENS)
    pages = sets * per_set
    page = torch.randperm(pages, device=dev, generator=gen).view(sets, per_set, 1)
    slots = page * formats.PAGE_TOKENS + torch.arange(formats.PAGE_TOKENS, device=dev)
    return pages, slots.view(sets, -1)[:, :tokens].contiguous()


def written_bytes(cache: formats.Cache, fmt: str, slots: torch.Tensor) -> torch.Tensor:
    """The bytes stored for each slot, uint8 ``[tokens, bytes_per_token]`` (nvfp4: the 64 code
    bytes, then the 8 scale bytes)."""
    page, token = slots // formats.PAGE_TOKENS, slots % formats.PAGE_TOKENS
    if fmt == "nvfp4":
        values, scales = formats.nvfp4_views(cache)
        return torch.cat([values[page, token], scales[page, token]], dim=1)
    return cache.view(torch.uint8)[page, token]


def expected_bytes(keys: torch.Tensor, fmt: str) -> torch.Tensor:
    """What :func:`cpindex.formats.quantize` stores for ``keys`` ``[tokens, 128]``, in the
    row form of :func:`written_bytes`."""
    n = keys.shape[0]
    pad = -n % formats.PAGE_TOKENS
    pages = torch.cat([keys, keys.new_zeros(pad, formats.HEAD_DIM)]).view(
        -1, formats.PAGE_TOKENS, formats.HEAD_DIM
    )
    if fmt == "nvfp4":
        packed, scales = formats.quantize(pages, fmt, layout="pair")
        return torch.cat(
            [packed.reshape(-1, 64)[:n], scales.view(torch.uint8).reshape(-1, 8)[:n]], dim=1
        )
    q = formats.quantize(pages, fmt)
    return q.view(torch.uint8).reshape(-1, formats.BYTES_PER_TOKEN[fmt])[:n]


def run(formats_: list[str], token_counts: list[int], iters: int) -> dict:
    """Per format and key count: the writer's time per call (graph replays), bytes moved, GB/s
    and its share of the copy bandwidth, the eager call's host µs, and the same for the torch
    scatter of pre-quantized bytes to the same slots; ``agree``: the writer's bytes equal
    :func:`cpindex.formats.quantize`'s."""
    write_keys, check_writes = _writer()
    dev = torch.device("cuda", torch.cuda.current_device())
    copy_gbs = copy_bandwidth_gbs(dev)
    results = []
    total = len(formats_) * len(token_counts)
    for fmt in formats_:
        bpt = formats.BYTES_PER_TOKEN[fmt]
        for tokens in token_counts:
            nbytes = tokens * (KEY_BYTES + SLOT_BYTES + bpt)
            sets = max(1, min(16, -(-ROTATE_BYTES // nbytes)))
            g = torch.Generator(device=dev).manual_seed(tokens)
            pages, slots = _slot_sets(tokens, sets, g, dev)
            cache = synthetic_cache(pages, fmt, dev)
            keys = torch.randn(sets, tokens, formats.HEAD_DIM, device=dev, generator=g)
            keys = keys.to(torch.bfloat16)
            rows = cache.view(torch.uint8).view(-1, bpt)  # the scatter's view: a row per slot
            src = torch.randint(0, 256, (sets, tokens, bpt), dtype=torch.uint8, device=dev,
                                generator=g)  # fmt: skip

            def scatter(i, rows=rows, src=src, slots=slots, sets=sets):
                rows[slots[i % sets]] = src[i % sets]

            def call(i, cache=cache, keys=keys, slots=slots, sets=sets):
                write_keys(cache, keys[i % sets], slots[i % sets])

            # the scatter first: the writer then overwrites every slot the check reads
            base_ms = statistics.median(time_graph(scatter, 8, iters, 2))
            base_host = host_us(scatter, HOST_CALLS)["host_us"]
            ms = statistics.median(time_graph(call, 8, iters, 2))
            host = host_us(call, HOST_CALLS)["host_us"]
            torch.cuda.synchronize()
            check_writes(dev)
            agree = all(
                torch.equal(written_bytes(cache, fmt, slots[s]), expected_bytes(keys[s], fmt))
                for s in range(sets)
            )
            base_bytes = tokens * (2 * bpt + SLOT_BYTES)
            row = {
                "format": fmt, "tokens": tokens, "pattern": pattern(tokens), "sets": sets,
                "bytes": nbytes, "kernel_ms": ms, "gbs": nbytes / (ms * 1e-3) / 1e9,
                "host_us": host, "agree": agree, "scatter_bytes": base_bytes,
                "scatter_ms": base_ms, "scatter_gbs": base_bytes / (base_ms * 1e-3) / 1e9,
                "scatter_host_us": base_host,
            }  # fmt: skip
            # HBM traffic against HBM traffic: the copy's read + write, the calls' reads + writes
            row["of_copy"] = row["gbs"] / copy_gbs
            row["scatter_of_copy"] = row["scatter_gbs"] / copy_gbs
            results.append(row)
            print(f"bench --write: {len(results)}/{total} done", file=sys.stderr, flush=True)
            del cache, keys, slots, src, rows
            torch.cuda.empty_cache()
    return {"copy_gbs": copy_gbs, "write": results}


LEGEND = "\n".join(
    [
        "Times: median of graph replays of 8 calls over rotating key and slot sets.",
        "  tokens     keys written per call; pattern: decode (a page per key, random token) or",
        "             prefill (whole pages in order, pages in random order)",
        "  KiB moved  keys read (bf16) + slots read (int64) + cache bytes written",
        "  write us   one write_keys call; GB/s: KiB moved over it; % copy: that over the",
        "             copy bandwidth above (both count bytes read plus bytes written)",
        "  host us    host time of one eager call (the device running behind)",
        "  scatter    cache.view(-1, bytes_per_token)[slots] = src, pre-quantized bytes to the",
        "             same slots (reads bytes_per_token a key, not 256): an index-copy of the",
        "             same write size; x: scatter us over write us (above 1: the writer is faster)",
        "  agree      every set's written bytes equal formats.quantize's",
    ]
)


def table(res: dict) -> str:
    lines = [
        f"write_keys: bf16 keys in; copy bandwidth {res['copy_gbs']:.0f} GB/s (read + write)",
        f"{'fmt':>6} {'tokens':>7} {'pattern':>7} {'KiB moved':>10} {'write us':>9} "
        f"{'GB/s':>6} {'% copy':>6} {'host us':>8} | {'KiB moved':>10} {'scatter us':>10} "
        f"{'GB/s':>6} {'% copy':>6} {'host us':>8} {'x':>6} {'agree':>5}",
    ]
    for r in res["write"]:
        lines.append(
            f"{r['format']:>6} {r['tokens']:>7} {r.get('pattern', ''):>7} "
            f"{r['bytes'] / 1024:>10.1f} {r['kernel_ms'] * 1e3:>9.2f} {r['gbs']:>6.0f} "
            f"{100 * r['of_copy']:>5.1f}% {r['host_us']:>8.1f} | "
            f"{r['scatter_bytes'] / 1024:>10.1f} {r['scatter_ms'] * 1e3:>10.2f} "
            f"{r['scatter_gbs']:>6.0f} {100 * r['scatter_of_copy']:>5.1f}% "
            f"{r['scatter_host_us']:>8.1f} {r['scatter_ms'] / r['kernel_ms']:>5.2f}x "
            f"{'yes' if r['agree'] else 'NO':>5}"
        )
    return "\n".join(lines)
