"""Caches and keys the write_keys tests share (CPU and GPU).

A :class:`Target` is a cache in one format and form, built inside raw byte buffers filled with
random bytes (poison), with the byte offsets of every token spelled out by hand, independently
of ``cpindex.formats``: a test can predict the whole buffer after a write, pool bytes and
untouched tokens included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cpindex import formats

#: Every format and form a cache is written in: bf16/fp8 tensors and page slices of a pool;
#: nvfp4 page-major [pages, 9216], [pages, 128, 72], [pages, 128, 72] pages inside a pool, the
#: pair (scales as uint8 or e4m3), and the pair views of a token-interleaved cache.
KINDS = (
    "bf16",
    "bf16-pool",
    "fp8",
    "fp8-pool",
    "nvfp4",
    "nvfp4-page_major_3d",
    "nvfp4-pool",
    "nvfp4-pair",
    "nvfp4-pair_e4m3",
    "nvfp4-interleaved",
)
KEY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (buffer index, byte offset) of a token's stored bytes: bf16/fp8 one run, nvfp4 (codes, scales)
Spans = Callable[[int, int], list[tuple[int, int]]]


@dataclass
class Target:
    kind: str
    fmt: str
    pages: int
    buffers: list[torch.Tensor]  # flat uint8 allocations the cache lives in
    cache: formats.Cache
    spans: Spans

    def snapshot(self) -> list[torch.Tensor]:
        return [b.cpu().clone() for b in self.buffers]


def make_target(kind: str, pages: int, device: torch.device | str = "cpu", seed: int = 0) -> Target:
    """A cache of ``pages`` pages in ``kind`` (one of ``KINDS``), all bytes random."""
    g = torch.Generator().manual_seed(seed)

    def buffer(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(device)

    fmt = kind.split("-")[0]
    if fmt in ("bf16", "fp8"):
        dtype, page = (torch.bfloat16, 32768) if fmt == "bf16" else (torch.float8_e4m3fn, 16384)
        tok = page // 128
        if kind.endswith("-pool"):  # every other page of a pool, after one spare page
            buf = buffer((2 * pages + 1) * page)
            cache = buf.view(dtype).view(2 * pages + 1, 128, 128)[1::2]
            return Target(
                kind, fmt, pages, [buf], cache, lambda p, t: [(0, (1 + 2 * p) * page + tok * t)]
            )
        buf = buffer(pages * page)
        cache = buf.view(dtype).view(pages, 128, 128)
        return Target(kind, fmt, pages, [buf], cache, lambda p, t: [(0, p * page + tok * t)])
    form = kind.partition("-")[2] or "page_major"
    if form in ("page_major", "page_major_3d"):
        buf = buffer(pages * 9216)
        cache = buf.view(pages, 9216) if form == "page_major" else buf.view(pages, 128, 72)
        spans: Spans = lambda p, t: [(0, 9216 * p + 64 * t), (0, 9216 * p + 8192 + 8 * t)]  # noqa: E731
        return Target(kind, fmt, pages, [buf], cache, spans)
    if form == "pool":  # a spare page in front, 64 spare bytes after each page
        buf = buffer((pages + 1) * 9280)
        cache = buf.view(pages + 1, 9280)[1:, :9216].view(pages, 128, 72)
        spans = lambda p, t: [(0, 9280 * (p + 1) + 64 * t), (0, 9280 * (p + 1) + 8192 + 8 * t)]  # noqa: E731
        return Target(kind, fmt, pages, [buf], cache, spans)
    if form in ("pair", "pair_e4m3"):
        vals, scales = buffer(pages * 8192), buffer(pages * 1024)
        s = scales.view(pages, 128, 8)
        cache = (
            vals.view(pages, 128, 64),
            s.view(torch.float8_e4m3fn) if form == "pair_e4m3" else s,
        )
        spans = lambda p, t: [(0, 8192 * p + 64 * t), (1, 1024 * p + 8 * t)]  # noqa: E731
        return Target(kind, fmt, pages, [vals, scales], cache, spans)
    assert form == "interleaved", kind
    buf = buffer(pages * 9216)
    c = buf.view(pages, 128, 72)
    cache = (c[:, :, :64], c[:, :, 64:])
    spans = lambda p, t: [(0, 9216 * p + 72 * t), (0, 9216 * p + 72 * t + 64)]  # noqa: E731
    return Target(kind, fmt, pages, [buf], cache, spans)


# Groups of 16 whose quantization hits the rules' edges (nvfp4 reads each as one group).
_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _tie_group(scale: float) -> list[float]:
    """amax 6 * scale (scale an e4m3 value, so it is the group's scale): every e2m1 tie."""
    return [6 * scale] + [v * scale for v in _TIES] + [-v * scale for v in _TIES] + [0.0]


EDGE_GROUPS: list[list[float]] = [
    _tie_group(1.0),
    _tie_group(1.125),  # scale byte 0x39
    _tie_group(2.0**-9),  # the smallest scale
    _tie_group(-1.0)[::-1],  # amax from a negative element
    # amax / 6 = 1.0625 rounds (tie, even) to scale 1: 6.375 and 6.2 saturate to +-6
    [6.375, -6.375, 6.2, -6.2, 5.9, 5.0, -5.0, 4.9, 0.1, -0.1, 0.26, -0.24, 1e-3, 0.0, -0.0, 3.0],
    # amax / 6 = 1.1875: a tie between scales 1.125 (odd) and 1.25 (even) -> 1.25
    [7.125, 1.0, -2.0, 3.3, 0.3125, -0.3125, 0.9375, 2.1875, 3.75, -4.375, 6.0, 0, 1.5, 2, 0.5, 7],
    # beyond 6 * 448 (finite in fp16 too): scale 448, codes saturate
    [6e4, -3e4, 2688.0, 448.0, 1.0, -1.0, 0.0, 5e4, -6e4, 2e3, 3e3, -4e3, 10.0, 0.5, 4e4, 5.5e4],
    [0.0] * 8 + [-0.0] * 8,  # all zero: scale 2**-9, codes +0
    [1e-6, -1e-7, 0.0, -0.0, 3e-7, -2e-6, 1e-9, -1e-9] * 2,  # tiny: scale 2**-9, codes +0
    # fp8: saturation, ties (1.0625 -> 1, 1.1875 -> 1.25), subnormal ties, signed zeros
    [448.0, 465.0, 1000.0, -6e4, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10,
     -(2.0**-10), -0.0, 1.5 * 2.0**-9, -240.0, 0.0137, 17.0, 2.0**-7, -(2.0**-12)],
    # bf16: ties (1 + 2**-8 -> 1, 1 + 3 * 2**-8 -> 1 + 2**-6) and values off the bf16 grid
    [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 3.14159, -2.71828, 1e-3, 65504.0, 0.1,
     1.0, -1.0, 2.0, 0.5, 0.25, 3.0, -3.0, 0.0],
]  # fmt: skip


def make_keys(tokens: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Keys ``[tokens, 128]`` in ``dtype``: the edge groups first, then random groups of
    magnitudes from 1e-4 to 30 (fresh random data, never all zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 8, 16, generator=g)
    mags = torch.tensor([1.0, 0.01, 30.0, 1e-4, 0.3, 3.0])
    x *= mags[torch.randint(0, len(mags), (tokens, 8, 1), generator=g)]
    flat = x.view(-1, 16)
    for i, grp in enumerate(EDGE_GROUPS[: flat.shape[0]]):
        flat[i] = torch.tensor(grp)
    return x.view(tokens, 128).to(dtype)


def make_slots(tokens: int, capacity: int, seed: int = 0) -> torch.Tensor:
    """Distinct slots for ``tokens`` keys: the first and last slot of the cache, random ones,
    and a few negative ones (skipped)."""
    g = torch.Generator().manual_seed(seed)
    inner = torch.randperm(capacity - 2, generator=g)[: tokens - 2] + 1
    slots = torch.cat([torch.tensor([capacity - 1, 0]), inner])
    skip = torch.randperm(tokens - 2, generator=g)[:3] + 2
    slots[skip] = torch.tensor([-1, -1, -7])
    return slots
