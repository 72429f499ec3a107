"""The kernel variant choice (cpindex/kernels/variants.py), on the host with an arch name: which
build an arch gets, which instances it holds, and which instance and grid a call takes. The
table pins the choice for representative calls on sm_90 (warpgroup mma), sm_90 portable,
gfx942 and gfx950 (MFMA) and a portable AMD GPU; a GPU's part (its SMs, its name, each
instance's occupancy) is given. The GPU side checks at load that a module holds exactly
``instances()`` (kernels/build.py)."""

from __future__ import annotations

import pytest

from cpindex.kernels import structs, variants
from cpindex.kernels.variants import Build, Gpu, Variant

BF16, FP8, NVFP4, NARROW = 0, 1, 2, structs.NVFP4_NARROW

# CTAs per SM of each instance, (tiles, wgmma, split): given, as the GPU's occupancy query
# would answer (the choice reads them, not the hardware).
OCCUPANCY = {
    (1, False, 0): 4, (1, False, 2): 4, (1, False, 4): 3, (2, False, 0): 3, (2, False, 2): 3,
    (2, False, 4): 2, (4, False, 0): 2, (4, False, 2): 2, (4, False, 4): 3, (4, True, 0): 3,
}  # fmt: skip
H100 = Gpu(132, "NVIDIA H100 80GB HBM3")
H200 = Gpu(132, "NVIDIA H200")
MI300X, MI355X = Gpu(304, "AMD Instinct MI300X"), Gpu(256, "AMD Instinct MI355X")
H100_4, MI355X_2, MI250X = H100._replace(ranks=4), MI355X._replace(ranks=2), Gpu(110, "MI250X")

# (arch, portable, format id, T, H, requests, width, world, push, gpu) -> (variant, grid)
CHOICES = [
    # sm_90 (sm_90a): nvfp4 splits small calls, takes the warpgroup mma at four tiles from
    # WGMMA_MIN_ITEMS_PER_SM items per SM (two passes too), whole pages otherwise
    (("sm_90", False, NVFP4, 1, 4, 1, 64, 1, False, H100), (Variant(NVFP4, 1, False, 4), 64)),
    (("sm_90", False, NVFP4, 1, 4, 32, 1024, 1, False, H100), (Variant(NVFP4, 1), 528)),
    (("sm_90", False, NVFP4, 8, 4, 128, 512, 1, False, H100), (Variant(NVFP4, 4, True), 396)),
    (("sm_90", False, NVFP4, 8, 4, 16, 128, 1, False, H100), (Variant(NVFP4, 4), 264)),
    (("sm_90", False, NVFP4, 16, 4, 128, 512, 1, False, H100), (Variant(NVFP4, 4, True), 396)),
    (("sm_90", False, NARROW, 4, 4, 64, 1024, 1, False, H100), (Variant(NARROW, 2), 396)),
    # the ring formats: RING_SPLIT_PAGES past the resident grid, bytes in flight per SM, the
    # warpgroup mma on the H200 only, no split with two passes
    (("sm_90", False, BF16, 1, 4, 64, 1024, 1, False, H100), (Variant(BF16, 1, False, 4), 396)),
    (("sm_90", False, BF16, 4, 4, 64, 1024, 1, False, H100), (Variant(BF16, 2, False, 2), 396)),
    (("sm_90", False, BF16, 8, 4, 128, 512, 1, False, H100), (Variant(BF16, 4, False, 4), 396)),
    (("sm_90", False, BF16, 8, 4, 128, 512, 1, False, H200), (Variant(BF16, 4, True), 396)),
    (("sm_90", False, BF16, 8, 4, 8, 256, 1, False, H100), (Variant(BF16, 4), 264)),
    (("sm_90", False, BF16, 16, 4, 128, 512, 1, False, H100), (Variant(BF16, 4), 132)),
    (("sm_90", False, FP8, 1, 4, 64, 1024, 1, False, H100), (Variant(FP8, 1, False, 2), 528)),
    (("sm_90", False, FP8, 4, 4, 64, 1024, 1, False, H100), (Variant(FP8, 2), 264)),
    (("sm_90", False, FP8, 2, 8, 64, 1024, 4, True, H100), (Variant(FP8, 2), 264)),
    (("sm_90", False, FP8, 8, 4, 128, 1024, 4, True, H200), (Variant(FP8, 4, True), 396)),
    # push grids hold at least a CTA per rank; four ranks on one GPU share its CTAs
    (("sm_90", False, NVFP4, 1, 8, 1, 4, 4, True, H100), (Variant(NVFP4, 1, False, 4), 4)),
    (("sm_90", False, NVFP4, 2, 8, 32, 1024, 4, True, H100_4), (Variant(NVFP4, 2), 99)),
    # sm_90 portable: one query tile, no ring, no warpgroup mma
    (("sm_90", True, NVFP4, 8, 4, 128, 512, 1, False, H100), (Variant(NVFP4, 1), 528)),
    (("sm_90", True, BF16, 4, 4, 128, 1024, 1, False, H100), (Variant(BF16, 1), 528)),
    (("sm_90", True, FP8, 1, 4, 2, 64, 1, False, H100), (Variant(FP8, 1, False, 4), 128)),
    # MFMA (gfx942, gfx950): the tensor-core tiles, no ring, no warpgroup mma
    (("gfx942", False, NVFP4, 4, 4, 64, 1024, 1, False, MI300X), (Variant(NVFP4, 2), 912)),
    (("gfx942", False, FP8, 1, 4, 1, 128, 1, False, MI300X), (Variant(FP8, 1, False, 4), 128)),
    (("gfx942", False, BF16, 8, 4, 128, 1024, 8, True, MI300X), (Variant(BF16, 4), 608)),
    (("gfx950", False, BF16, 8, 4, 128, 1024, 1, False, MI355X), (Variant(BF16, 4), 512)),
    (("gfx950", False, FP8, 2, 4, 4, 300, 1, False, MI355X), (Variant(FP8, 1, False, 2), 600)),
    (("gfx950", False, NARROW, 16, 4, 256, 1024, 2, True, MI355X_2), (Variant(NARROW, 4), 256)),
    # other AMD GPUs: the portable path
    (("gfx90a", False, BF16, 8, 4, 128, 1024, 1, False, MI250X), (Variant(BF16, 1), 440)),
]  # fmt: skip


def _choose(arch, portable, fid, t, heads, requests, width, world, push, gpu):
    return variants.choose(
        variants.build_of(arch, portable=portable), fid, gpu, requests=requests, width=width,
        vectors=t * heads, world=world, push=push, occupancy=lambda v: OCCUPANCY[v[1:]],
    )  # fmt: skip


@pytest.mark.parametrize(("call", "want"), CHOICES, ids=lambda v: str(v))
def test_the_choice_per_call(call, want):
    shape = _choose(*call)
    assert shape == want
    build = variants.build_of(call[0], portable=call[1])
    assert shape.variant in variants.instances(build, call[2])  # one the module holds


def test_the_build_per_arch():
    assert variants.build_of("sm_90") == Build("mma", True)  # built as sm_90a
    assert variants.build_of("sm_90", portable=True) == Build("portable", False)
    assert variants.build_of("sm_100") == variants.build_of("sm_80") == Build("mma", False)
    for arch in ("gfx940", "gfx942", "gfx950"):
        assert variants.build_of(arch) == Build("mfma", False)
        assert variants.build_of(arch, portable=True) == Build("portable", False)
    assert variants.build_of("gfx90a") == variants.build_of("gfx1100") == Build("portable", False)


def test_the_instances_a_module_holds():
    """Per format: whole pages and both splits of each query-tile count the path has, and the
    four-tile warpgroup instance on sm_90a."""
    ids = [BF16, FP8, NVFP4, NARROW]
    builds = [("sm_90", False), ("sm_90", True), ("gfx942", False), ("gfx90a", False)]
    count = {
        (arch, p): sum(len(variants.instances(variants.build_of(arch, portable=p), f)) for f in ids)
        for arch, p in builds
    }
    assert count == dict(zip(builds, [40, 12, 36, 12], strict=True))
    assert variants.instances(variants.build_of("sm_90"), FP8)[-1] == Variant(FP8, 4, True)
    assert variants.instances(variants.build_of("gfx90a"), FP8) == [
        Variant(FP8, 1, False, s) for s in (0, 2, 4)
    ]


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_query_tiles_per_pass(arch):
    build = variants.build_of(arch)
    got = [variants.query_tiles(build, v) for v in (1, 8, 9, 16, 17, 32, 33, 64, 128)]
    assert got == [1, 1, 2, 2, 4, 4, 4, 4, 4]  # past 32 vectors: several passes of four
    assert {variants.query_tiles(variants.build_of(arch, portable=True), v) for v in got} == {1}


def test_every_choice_is_an_instance():
    """Over a sweep of calls, every chosen variant is one its build holds."""
    for arch, portable in [("sm_90", False), ("sm_90", True), ("gfx942", False), ("gfx950", False)]:
        build = variants.build_of(arch, portable=portable)
        for fid in (BF16, FP8, NVFP4, NARROW):
            held = set(variants.instances(build, fid))
            for t, heads, requests, width, world in [
                (t, h, r, w, world)
                for t in (1, 2, 4, 8, 16) for h in (1, 4, 8) for r in (1, 7, 64, 512)
                for w in (1, 33, 1024) for world in (1, 4)
            ]:  # fmt: skip
                gpu = H200 if arch.startswith("sm") else MI300X
                shape = _choose(arch, portable, fid, t, heads, requests, width, world, True, gpu)
                assert shape.variant in held and shape.grid >= world, (arch, fid, shape)


def test_tunables_steer_the_choice(monkeypatch):
    call = ("sm_90", False, BF16, 1, 4, 64, 1024, 1, False, H100)
    monkeypatch.setattr(variants, "RING_SPLIT_PAGES", ())
    assert _choose(*call) == (Variant(BF16, 1), 132)  # whole pages, 48 KiB in flight per SM
    monkeypatch.setattr(variants, "RING_BYTES_PER_SM", 0)
    assert _choose(*call) == (Variant(BF16, 1), 528)  # every CTA that fits
    monkeypatch.setattr(variants, "SPLIT_WARPS", ())
    small = ("sm_90", False, NVFP4, 1, 4, 1, 64, 1, False, H100)
    assert _choose(*small) == (Variant(NVFP4, 1), 16)  # a warp per item
    monkeypatch.setattr(variants, "WGMMA_MIN_ITEMS_PER_SM", 1 << 30)
    assert _choose("sm_90", False, NVFP4, 8, 4, 128, 512, 1, False, H100)[0] == Variant(NVFP4, 4)
    assert variants.tunables()[0] == 1 << 30  # the launcher's cached choices key on them


def test_nvfp4_tokens_only_8_byte_aligned_take_their_own_kernel():
    assert variants.cache_format("nvfp4", 72) == NARROW  # vLLM's 72-byte tokens
    assert variants.cache_format("nvfp4", 64) == variants.cache_format("nvfp4", 144) == NVFP4
    assert variants.cache_format("bf16", 256) == BF16 and variants.cache_format("fp8", 72) == FP8
