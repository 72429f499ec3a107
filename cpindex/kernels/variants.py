"""Which scoring instance a call runs, and on how many CTAs: the one place that decides.

``score.hip`` compiles ``score_kernel<F, NT, W, S>`` per cache format ``F``: ``NT`` query
n-tiles of 8 vectors per pass, ``W`` the warpgroup mma (sm_90a), ``S`` warps sharing a page
(0: a warp per item). :func:`choose` picks one, a :class:`Variant`, and its persistent grid; the
launcher hands the variant's fields to the binding, which maps them onto that template instance
and refuses any other (score.hip, ``with_instance``). The choice is host arithmetic on an arch
name and static sizes: what a GPU adds (its SM count and name, each instance's occupancy) comes
in as arguments, so it is tested without one (tests/test_variants.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .. import layouts
from . import structs

#: AMD architectures the matrix-core (MFMA) path is built for (CDNA3, CDNA4); a HIP build for
#: any other AMD GPU takes the portable path (compat.h, CP_MFMA).
MFMA_ARCHS = ("gfx940", "gfx941", "gfx942", "gfx950")

WARPS_PER_CTA = 4  # launch.h kWarpsPerCta
RING_TILES = 4  # config.h kRingTiles

# The warpgroup-mma instance (sm_90a builds, T * H of 17..32) is faster once a call gives each SM
# a few pages per warp, and slower on small batches, where its warps wait on each other
# (docs/BENCHMARKS.md): it runs from this many items (request, block) per SM of a rank's share.
WGMMA_MIN_ITEMS_PER_SM = 32

# bf16 and fp8 (the cp.async ring formats) take the warpgroup-mma instance only on GPUs whose
# name holds one of these: on an H100 the mma.sync instance (whole pages, its own registers
# holding the queries) read them 1-5 % (bf16) and 3-12 % (fp8) faster at every size from
# WGMMA_MIN_ITEMS_PER_SM, while on the H200, with 1.4x the bandwidth per SM, the warpgroup
# instance was 8-14 % faster (docs/kernel.md, "Four query tiles on Hopper"). nvfp4, bound by its
# decode, takes it on every sm_90a GPU.
WGMMA_RING_GPUS: tuple[str, ...] = ("H200",)

# A call whose items (request, block) of the busiest rank's share all fit the resident grid at
# once splits each page over several warps of a CTA (score.hip, split pages): a small call has
# more warps loading and decoding. The warps per page, most first: a call takes the first whose
# CTAs (4 / warps items each) fit the split instance's resident grid (every build has both).
# () keeps a warp per item.
SPLIT_WARPS: tuple[int, ...] = (4, 2)

# bf16 and fp8 whole pages stream through a per-warp cp.async ring (RING_TILES tiles of 16
# tokens, all but one in flight). HBM is read faster with about this many of those bytes in
# flight per SM than with the 120-144 KiB of a fully occupied SM (91-92 % of its peak), so these
# instances' persistent grid holds this many bytes per SM rather than as many CTAs as fit
# (docs/BENCHMARKS.md, "The kernel alone"). 0: every CTA that fits. Only calls of at least
# RING_MIN_ITEMS_PER_SM items per SM: below that, a call that fits one or two rounds of the full
# grid loses more to extra rounds than it gains (fp8 at 8 x 32K 20-25 % slower). The
# warpgroup-mma instance and the split pages keep their own grids, so this applies to bf16 with
# four query tiles and fp8 with two or more (RING_SPLIT_PAGES splits the others).
RING_BYTES_PER_SM = 48 * 1024
RING_MIN_ITEMS_PER_SM = 32

# The ring formats split pages past what fits at once with these query tiles (one pass of T * H
# <= 8: one, <= 16: two, <= 32: four), from this many items per SM of a rank's share: (format,
# tiles, warps a page, items per SM). That split instance then runs on its whole resident grid,
# each CTA taking several rounds. On an H100, against whole pages on any grid: bf16 0-2 % faster
# in quarters with one tile and 0-6 % in halves with two (four warps a page with two tiles 3-20 %
# slower); fp8 1-6 % faster in halves with one tile (1-18 % slower with two, and with four
# query tiles every format). bf16 with four tiles (where the warpgroup instance does not take
# them) in quarters that keep the queries in shared memory: 1-6 % faster from 62 items per SM,
# 1-4 % slower at 16 (docs/BENCHMARKS.md, "The kernel alone"). Only where SPLIT_WARPS holds that
# split; () keeps whole pages past the resident grid.
RING_SPLIT_PAGES: tuple[tuple[str, int, int, int], ...] = (
    ("bf16", 1, 4, 0), ("bf16", 2, 2, 0), ("bf16", 4, 4, RING_MIN_ITEMS_PER_SM), ("fp8", 1, 2, 0)
)  # fmt: skip


def tunables() -> tuple:
    """The module's tunables as they stand (tests patch them): part of a cached choice's key."""
    return (
        WGMMA_MIN_ITEMS_PER_SM, WGMMA_RING_GPUS, SPLIT_WARPS, RING_BYTES_PER_SM,
        RING_MIN_ITEMS_PER_SM, RING_SPLIT_PAGES,
    )  # fmt: skip


class Build(NamedTuple):
    """What a module built for an arch holds (build.py compiles it so)."""

    path: str  # "mma" (CUDA tensor cores), "mfma" (AMD matrix cores) or "portable" (scalar)
    wgmma: bool  # four-tile warpgroup-mma instances (sm_90a, CP_WGMMA)


def build_of(arch: str, *, portable: bool = False) -> Build:
    """The build of ``arch`` (``sm_90``, ``gfx942``...): the portable path where asked or on an
    AMD GPU without the MFMA path, the warpgroup mma on sm_90 (built as sm_90a)."""
    if portable or (arch.startswith("gfx") and arch not in MFMA_ARCHS):
        return Build("portable", False)
    if arch.startswith("gfx"):
        return Build("mfma", False)
    return Build("mma", arch == "sm_90")


class Variant(NamedTuple):
    """One scoring instance, ``score_kernel<fmt_id, tiles, wgmma, split>``: the binding's
    ``score`` and ``occupancy`` take these four fields as they are."""

    fmt_id: int  # structs.FORMAT_IDS, or structs.NVFP4_NARROW
    tiles: int  # query n-tiles of 8 vectors per pass: 1, 2 or 4
    wgmma: bool = False
    split: int = 0  # warps sharing a page: 4 or 2; 0: a warp per item


class LaunchShape(NamedTuple):
    """Which kernel instance a call runs and on how many CTAs."""

    variant: Variant
    grid: int


def query_tiles(build: Build, vectors: int) -> int:
    """Query n-tiles per pass for ``vectors`` = T * H: registers hold every tile's query
    fragment, so more than 4 tiles take several passes (the later ones find the page in L2).
    The portable path scores 8 vectors a pass."""
    if build.path == "portable":
        return 1
    return 1 if vectors <= 8 else 2 if vectors <= 16 else 4


def instances(build: Build, fmt_id: int) -> list[Variant]:
    """Every instance of ``fmt_id`` in a module of ``build`` (score.hip compiles exactly these;
    the build checks its module's own list against this one at load)."""
    tiles = (1,) if build.path == "portable" else (1, 2, 4)
    out = [Variant(fmt_id, n, False, s) for n in tiles for s in (0, 2, WARPS_PER_CTA)]
    return [*out, Variant(fmt_id, 4, True, 0)] if build.wgmma else out


def cache_format(fmt: str, value_token_stride: int) -> int:
    """The instance's format id for a cache of ``fmt`` whose (nvfp4: value) tokens are
    ``value_token_stride`` bytes apart: nvfp4 tokens only 8-byte aligned (vLLM's 72-byte
    tokens) take a kernel of their own."""
    if fmt == "nvfp4" and value_token_stride % 16:
        return structs.NVFP4_NARROW
    return structs.FORMAT_IDS[fmt]


class Gpu(NamedTuple):
    """What the choice needs of the device: its SMs (CUs), its name, the ranks sharing it."""

    sms: int
    name: str
    ranks: int = 1


def _ring_cta_bytes(build: Build, fmt_id: int) -> int:
    """Bytes in flight per CTA of a whole-page ring instance (bf16 and fp8 on tensor cores;
    keys.h Fmt::kRing); 0 for the other instances."""
    if build.path != "mma" or fmt_id not in (structs.FORMAT_IDS["bf16"], structs.FORMAT_IDS["fp8"]):
        return 0
    elem = 2 if fmt_id == structs.FORMAT_IDS["bf16"] else 1
    return WARPS_PER_CTA * (RING_TILES - 1) * 16 * layouts.HEAD_DIM * elem


def choose(
    build: Build,
    fmt_id: int,
    gpu: Gpu,
    *,
    requests: int,
    width: int,
    vectors: int,
    world: int,
    push: bool,
    occupancy: Callable[[Variant], int],
) -> LaunchShape:
    """The instance and persistent grid of a call of ``requests`` requests of ``width`` blocks
    and ``vectors`` = T * H query vectors on one rank of ``world``, from static sizes only.
    ``occupancy``: an instance's CTAs per SM. Push grids must all be resident at once (every CTA
    may wait for peers) and deliver queries from CTAs 0..world-1."""
    items = requests * -(-width // world)
    busy = items * gpu.ranks  # the rank's share's items, over the whole GPU
    tiles = query_tiles(build, vectors)
    ring = _ring_cta_bytes(build, fmt_id)

    def cap(wgmma: bool, split: int) -> int:  # CTAs of this rank's share one instance keeps
        return max(1, gpu.sms * occupancy(Variant(fmt_id, tiles, wgmma, split)) // gpu.ranks)

    wgmma = (
        build.wgmma
        and tiles == 4
        and busy >= WGMMA_MIN_ITEMS_PER_SM * gpu.sms
        and (not ring or any(n in gpu.name for n in WGMMA_RING_GPUS))
    )
    # Split pages where the call's CTAs all fit the split instance's resident grid at once (4 /
    # split items a CTA), and past that where RING_SPLIT_PAGES says so; otherwise four warps a
    # CTA, one item each, on at most the whole-page instance's resident grid.
    split = 0
    for k in SPLIT_WARPS if not wgmma else ():
        if -(-items * k // WARPS_PER_CTA) <= cap(False, k):
            split = k
            break
    every = next(
        (
            w
            for f, n, w, per_sm in RING_SPLIT_PAGES
            if structs.FORMAT_IDS[f] == fmt_id
            and n == tiles
            and vectors <= 8 * tiles  # one pass
            and busy >= per_sm * gpu.sms
        ),
        0,
    )
    if not split and not wgmma and ring and every in SPLIT_WARPS:
        split = every
        ctas = min(-(-items * split // WARPS_PER_CTA), cap(False, split))
    elif split:
        ctas = -(-items * split // WARPS_PER_CTA)
    else:
        ctas = min(-(-items // WARPS_PER_CTA), cap(wgmma, 0))
        if ring and RING_BYTES_PER_SM and not wgmma and busy >= RING_MIN_ITEMS_PER_SM * gpu.sms:
            per_sm = max(1, RING_BYTES_PER_SM // ring)
            ctas = min(ctas, max(1, gpu.sms * per_sm // gpu.ranks))
    grid = max(ctas, world if push else 1)
    return LaunchShape(Variant(fmt_id, tiles, wgmma, split), grid)
