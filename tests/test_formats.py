"""Tests for cpindex.formats (CPU)."""

from __future__ import annotations

import pytest
import torch

from cpindex import formats as F

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _keys(pages: int = 3, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pages, 128, 128, generator=g) * scale


def _random_pair(pages: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random nibbles and random finite e4m3 scale bytes (0x7F/0xFF are NaN)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (pages, 128, 64), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (pages, 128, 8), generator=g, dtype=torch.uint8)
    sign = torch.randint(0, 2, scales.shape, generator=g, dtype=torch.uint8) << 7
    return packed, scales | sign


def _exact_product(packed: torch.Tensor, scales_u8: torch.Tensor) -> torch.Tensor:
    """The unrounded product e2m1 * scale, from an explicit nibble split and a bitwise e4m3
    decode in fp64 (exact; returned as fp32, still exact)."""
    lo = (packed & 0xF).long()
    hi = (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).flatten(-2)  # [p, 128, 128], even element = low
    mag = torch.tensor(GRID, dtype=torch.float64)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    s = scales_u8.long()
    exp = (s >> 3) & 0xF
    man = (s & 7).double()
    smag = torch.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7).double())
    sval = torch.where(s >= 128, -smag, smag)
    return (vals * sval.repeat_interleave(16, dim=-1)).float()


def _reference_dequant(packed: torch.Tensor, scales_u8: torch.Tensor) -> torch.Tensor:
    """The key values: the exact product rounded by e4m3_rn_satfinite (which
    tests/test_nvfp4_rounding.py checks against a bit-level oracle)."""
    return F.e4m3_rn_satfinite(_exact_product(packed, scales_u8))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including the sign of zero."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# --------------------------------------------------------------------------- round trips


def test_bf16_round_trip() -> None:
    x = _keys(seed=1)
    c = F.quantize(x, "bf16")
    assert c.dtype == torch.bfloat16 and c.shape == (3, 128, 128)
    assert torch.equal(F.dequantize(c, "bf16"), x.bfloat16().float())
    assert F.detect_format(c) == "bf16" and F.check_cache(c, "bf16") == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_matches_torch_cast(dtype: torch.dtype) -> None:
    x = (_keys(seed=2) * 3).to(dtype)
    c = F.quantize(x, "fp8")
    assert c.dtype == torch.float8_e4m3fn and c.shape == (3, 128, 128)
    assert torch.equal(c.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(F.dequantize(c, "fp8"), x.to(torch.float8_e4m3fn).float())
    assert F.detect_format(c) == "fp8" and F.check_cache(c, "fp8") == 3


def test_fp8_saturates() -> None:
    x = _keys(pages=1, seed=3)
    x[0, 0, :4] = torch.tensor([1000.0, -1e6, 448.0, 465.0])
    d = F.dequantize(F.quantize(x, "fp8"), "fp8")
    assert d[0, 0, :4].tolist() == [448.0, -448.0, 448.0, 448.0]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rejected(fmt: str, bad: float) -> None:
    x = _keys(pages=1, seed=4)
    x[0, 7, 9] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        F.quantize(x, fmt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_error_bound(dtype: torch.dtype) -> None:
    x = _keys(pages=4, seed=5, scale=2.0).to(dtype)
    c = F.quantize(x, "nvfp4")
    assert c.dtype == torch.uint8 and c.shape == (4, F.NVFP4_PAGE_BYTES)
    assert F.detect_format(c) == "nvfp4" and F.check_cache(c, "nvfp4") == 4

    xf = x.float()
    groups = xf.reshape(4, 128, 8, 16)
    amax = groups.abs().amax(-1).clamp_min(1e-12)
    expected_scale = F.e4m3_rn_satfinite(amax / 6).clamp_min(2.0**-9).to(torch.float8_e4m3fn)
    _, scales = F.to_nvfp4_pair(c)
    assert torch.equal(scales.view(torch.uint8), expected_scale.view(torch.uint8))

    # the encoder's choice, judged on the exact (unrounded) product
    s = scales.float().repeat_interleave(16, dim=-1)
    packed, _ = F.nvfp4_views(c)
    exact = _exact_product(packed, scales.view(torch.uint8))
    q = (xf / s).abs()
    half_step = torch.where(q <= 2, 0.25, torch.where(q <= 4, 0.5, 1.0))
    saturated = q >= 6
    err = (exact - xf).abs()
    assert bool((err[~saturated] <= (half_step * s)[~saturated] * (1 + 1e-6)).all())
    assert torch.equal(exact[saturated], (torch.sign(xf) * 6 * s)[saturated])
    # every group's amax element lands on or near 6*scale, so the grid is actually used
    assert (exact.abs().reshape(4, 128, 8, 16).amax(-1) > 0).all()

    # the key values: that product rounded to e4m3 (half an e4m3 step, 2**-4 relative)
    d = F.dequantize(c, "nvfp4")
    assert _same_bits(d, F.e4m3_rn_satfinite(exact))
    assert bool(((d - exact).abs() <= exact.abs() * 2.0**-4 + 2.0**-10).all())


def test_e2m1_encode_matches_brute_force() -> None:
    x = torch.arange(-8 * 32, 8 * 32 + 1, dtype=torch.float32) / 32  # includes every tie
    grid = torch.tensor(GRID + [-v for v in GRID])
    dist = (x[:, None] - grid[None, :]).abs()
    expected = []
    for i in range(x.numel()):
        best = dist[i].min()
        codes = [c for c in range(16) if dist[i, c] == best]
        even = [c for c in codes if c % 2 == 0] or codes  # ties to even mantissa
        code = min(even, key=lambda c: c & 7)  # +-0 collapse to +0
        expected.append(code & 7 if float(grid[code]) == 0 else code)
    assert F.e2m1_encode(x).tolist() == expected
    assert torch.equal(F.e2m1_decode(F.e2m1_encode(x)), grid[torch.tensor(expected)])


def test_e2m1_edge_values() -> None:
    x = torch.tensor([0.0, -0.0, 6.0, -6.0, 0.5, -0.5, 7.0, -100.0, 0.25, 0.75])
    codes = F.e2m1_encode(x)
    assert codes.tolist() == [0, 0, 7, 15, 1, 9, 7, 15, 0, 2]
    assert F.e2m1_decode(codes).tolist() == [0.0, 0.0, 6.0, -6.0, 0.5, -0.5, 6.0, -6.0, 0.0, 1.0]


# ---------------------------------------------------------------------- nvfp4 values / edge cases


def test_pair_dequant_and_round_trip() -> None:
    packed, scales_u8 = _random_pair(pages=3, seed=6)
    ref = _reference_dequant(packed, scales_u8)
    for scales in (scales_u8, scales_u8.view(torch.float8_e4m3fn)):
        c = F.to_page_layout((packed, scales))
        assert c.shape == (3, F.NVFP4_PAGE_BYTES) and c.dtype == torch.uint8
        assert _same_bits(F.dequantize(c, "nvfp4"), ref)
        assert _same_bits(F.dequantize((packed, scales), "nvfp4"), ref)
        p2, s2 = F.to_nvfp4_pair(c)
        assert s2.dtype == torch.float8_e4m3fn and p2.is_contiguous() and s2.is_contiguous()
        assert torch.equal(p2, packed) and torch.equal(s2.view(torch.uint8), scales_u8)
        # the byte layout: values page-major/token-major, then scales
        flat = c.reshape(3, -1)
        assert torch.equal(flat[:, : F.NVFP4_VALUE_BYTES], packed.reshape(3, -1))
        assert torch.equal(flat[:, F.NVFP4_VALUE_BYTES :], scales_u8.reshape(3, -1))


def test_quantize_exact_on_grid() -> None:
    """Keys whose products are already e4m3 values come back bit-exact and re-quantize to the
    same bytes. Power-of-two scales up to 2**6 keep every product (<= 2 significant bits,
    <= 384) representable in e4m3, so rounding leaves them alone."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (2, 128, 128), generator=g, dtype=torch.uint8)
    codes[..., ::16] = 7  # each group holds +6, so amax/6 == scale exactly
    scale_bytes = torch.randint(1, 14, (2, 128, 8), generator=g, dtype=torch.uint8) << 3
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    c = F.to_page_layout((packed, scale_bytes))
    d = F.dequantize(c, "nvfp4")
    assert _same_bits(d, _exact_product(packed, scale_bytes))
    c2 = F.quantize(d, "nvfp4")
    assert torch.equal(F.dequantize(c2, "nvfp4"), d)
    v_ref, s_ref = F.nvfp4_views(c)
    v2, s2 = F.nvfp4_views(c2)
    assert torch.equal(s2, s_ref)

    def nibbles(v: torch.Tensor) -> torch.Tensor:  # -0 (code 8) may be re-encoded as +0
        n = torch.stack([v & 0xF, v >> 4])
        return torch.where(n == 8, 0, n)

    assert torch.equal(nibbles(v2), nibbles(v_ref))


def test_byte_placement() -> None:
    x = torch.zeros(2, 128, 128)
    x[1, 5, 0] = 1.0  # even element -> low nibble, code 2
    x[1, 5, 1] = -6.0  # odd element -> high nibble, code 15; group 0 scale = 1.0
    x[1, 5, 127] = 0.5  # group 7: scale e4m3(0.5/6), value saturates near 6
    c = F.quantize(x, "nvfp4")
    assert c[1, 64 * 5].item() == 0xF2
    assert c[1, 8192 + 8 * 5].item() == 0x38  # e4m3(1.0)
    s7 = torch.tensor(0.5 / 6).to(torch.float8_e4m3fn)
    assert c[1, 8192 + 8 * 5 + 7].item() == s7.view(torch.uint8).item()
    assert c[:, :8192].nonzero().tolist() == [[1, 320], [1, 383]]
    # every other group is all zero: codes 0, scale 2**-9 (byte 0x01)
    scales = c[:, 8192:].clone()
    assert scales[1, 8 * 5] != 1 and scales[1, 8 * 5 + 7] != 1
    scales[1, 8 * 5], scales[1, 8 * 5 + 7] = 1, 1
    assert bool((scales == 1).all())


def test_nvfp4_scale_edges() -> None:
    x = _keys(pages=1, seed=8)
    x[0, 0, 0:16] = 0.0  # all-zero group
    x[0, 1, 0:16] = torch.tensor(GRID * 2) * 448  # largest scale, exact
    x[0, 1, 16:32] = -x[0, 1, 0:16]
    x[0, 2, 0:16] = torch.tensor(GRID * 2) * 2.0**-9  # smallest subnormal scale, exact
    x[0, 3, 0:16] = 1e5  # beyond 6*448: scale clamps to 448, values saturate
    x[0, 4, 0:16] = 6.375  # amax/6 = 1.0625 rounds (tie, even) to scale 1.0 -> saturation
    x[0, 4, 0] = -6.375
    x[0, 5, 0:16] = 1e-6  # amax/6 underflows e4m3: smallest scale kept, values round to 0
    c = F.quantize(x, "nvfp4")
    d = F.dequantize(c, "nvfp4")
    _, s = F.to_nvfp4_pair(c)
    s = s.float()

    # an all-zero group: codes +0 and the smallest scale, 2**-9 (the writer's floor), not 0
    assert s[0, 0, 0] == 2.0**-9 and bool((d[0, 0, 0:16] == 0).all())
    assert bool((c[0, 0:8] == 0).all()) and c[0, 8192].item() == 0x01
    assert s[0, 0, 1] > 0  # neighbouring group unaffected
    packed, scale_bytes = F.nvfp4_views(c)
    exact = _exact_product(packed, scale_bytes)
    assert s[0, 1, 0] == 448 and s[0, 1, 1] == 448
    assert torch.equal(exact[0, 1, 0:32], x[0, 1, 0:32])
    # key values: 0.5 * 448 = 224 and 1 * 448 stay, larger codes saturate to 448
    want = torch.tensor([0.0, 224.0] + [448.0] * 6).repeat(2)
    assert torch.equal(d[0, 1, 0:16], want) and torch.equal(d[0, 1, 16:32], -want)
    assert s[0, 2, 0] == 2.0**-9 and torch.equal(exact[0, 2, 0:16], x[0, 2, 0:16])
    # 0.5 * 2**-9 rounds to 0 (tie, even), 1.5 * 2**-9 to 2**-8 (tie, even); the rest are exact
    want = torch.tensor([0.0, 0.0, 1.0, 2.0, 2.0, 3.0, 4.0, 6.0]).repeat(2) * 2.0**-9
    assert torch.equal(d[0, 2, 0:16], want)
    assert s[0, 3, 0] == 448 and bool((exact[0, 3, 0:16] == 6 * 448).all())
    assert bool((d[0, 3, 0:16] == 448).all())
    assert s[0, 4, 0] == 1.0 and d[0, 4, 0] == -6.0 and bool((d[0, 4, 1:16] == 6.0).all())
    assert s[0, 5, 0] == 2.0**-9 and bool((d[0, 5, 0:16] == 0).all())


# --------------------------------------------------------------------------- layouts / views


def _inside(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Every byte the view can address lies inside base's storage."""
    lo = base.untyped_storage().data_ptr()
    hi = lo + base.untyped_storage().nbytes()
    last = view.data_ptr() + sum(
        (n - 1) * st for n, st in zip(view.shape, view.stride(), strict=True)
    )
    return lo <= view.data_ptr() and last + view.element_size() <= hi


def _forms(pages: int = 3, seed: int = 20) -> dict[str, F.Cache]:
    """The same keys in every form a cache is taken in (uint8 [pages, 9216] and its
    [pages, 128, 72] view, the pair, the pair views of a token-interleaved cache)."""
    keys = _keys(pages=pages, seed=seed)
    keys[0, 0, :4] = torch.tensor([0.0, -0.0, -1e-30, 1e-30])  # zeros with signs, in one group
    page_major = F.quantize(keys, "nvfp4")
    interleaved = F.quantize(keys, "nvfp4", layout="interleaved").view(pages, 128, 72)
    return {
        "page_major": page_major,
        "page_major_3d": page_major.view(pages, 128, 72),
        "pair": F.quantize(keys, "nvfp4", layout="pair"),
        "interleaved": F.nvfp4_views(interleaved, layout="interleaved"),
    }


FORMS = ("page_major", "page_major_3d", "pair", "interleaved")
LAYOUT_OF = {"page_major": "page_major", "page_major_3d": "page_major"}


def test_layout_names() -> None:
    assert F.NVFP4_LAYOUTS == ("page_major", "pair")
    assert tuple(F.NVFP4_PAGE_LAYOUTS) == ("page_major", "interleaved")
    assert F.NVFP4_PAGE_LAYOUTS["page_major"] == F.Nvfp4PageLayout(0, 64, 8192, 8, 9216)
    assert F.NVFP4_PAGE_LAYOUTS["interleaved"] == F.Nvfp4PageLayout(0, 72, 64, 72, 9216)
    assert F.NVFP4_TOKEN_BYTES == 72 == F.BYTES_PER_TOKEN["nvfp4"]
    for old in ("product", "vllm"):
        with pytest.raises(ValueError, match=r"layout: expected one of \('page_major', 'inter"):
            F.page_layout(old)
    with pytest.raises(TypeError):
        F.NVFP4_PAGE_LAYOUTS["x"] = F.NVFP4_PAGE_LAYOUTS["page_major"]  # type: ignore[index]


def test_forms_hold_the_same_keys() -> None:
    caches = _forms()
    pm, pm3, pair, (iv, isc) = (caches[f] for f in FORMS)
    assert isinstance(pm, torch.Tensor) and pm.shape == (3, 9216) and pm.dtype == torch.uint8
    assert isinstance(pm3, torch.Tensor) and pm3.shape == (3, 128, 72) and pm3.is_contiguous()
    assert isinstance(pair, tuple) and pair[0].shape == (3, 128, 64)
    assert pair[1].shape == (3, 128, 8)
    assert pair[0].dtype == torch.uint8 and pair[1].dtype == torch.float8_e4m3fn
    want = F.dequantize(pm, "nvfp4")
    for form, c in caches.items():
        assert F.detect_format(c) == "nvfp4" and F.check_cache(c, "nvfp4") == 3
        assert F.nvfp4_layout(c) == LAYOUT_OF.get(form, "pair")
        assert _same_bits(F.dequantize(c, "nvfp4"), want)
    # page-major: token t's codes at [64t, 64t + 64) of its page, its scales at 8192 + 8t,
    # whatever the shape; row t of [pages, 128, 72] is not token t
    flat = pm3.reshape(3, 9216)
    assert torch.equal(flat, pm)
    for t in (0, 1, 77, 127):
        assert torch.equal(pm[:, 64 * t : 64 * t + 64], pair[0][:, t])
        assert torch.equal(pm[:, 8192 + 8 * t : 8192 + 8 * t + 8], pair[1][:, t].view(torch.uint8))
        assert torch.equal(iv[:, t], pair[0][:, t])  # interleaved: 64 codes, then 8 scales
        assert torch.equal(isc[:, t], pair[1][:, t].view(torch.uint8))
    assert not torch.equal(pm3[:, 1, :64], pair[0][:, 1])


def test_conversions_between_forms() -> None:
    caches = _forms(pages=2, seed=21)
    pair_want = caches["pair"]
    for c in caches.values():
        pm = F.to_page_layout(c)
        packed, scales = F.to_nvfp4_pair(c)
        iv = F.to_page_layout(c, "interleaved")
        assert torch.equal(pm, caches["page_major"]) and pm.is_contiguous()
        assert torch.equal(packed, pair_want[0]) and packed.is_contiguous()
        assert scales.dtype == torch.float8_e4m3fn and scales.is_contiguous()
        assert torch.equal(scales.view(torch.uint8), pair_want[1].view(torch.uint8))
        iv3 = iv.view(2, 128, 72)
        assert torch.equal(iv3[:, :, :64], packed)
        assert torch.equal(iv3[:, :, 64:], scales.view(torch.uint8))
        for out in (pm, packed, scales, iv):  # copies, never aliases of the input
            parts = c if isinstance(c, tuple) else (c,)
            assert all(
                out.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p in parts
            )


def test_custom_page_layouts() -> None:
    """One more in-page layout is one Nvfp4PageLayout: scales first, or padded tokens."""
    keys = _keys(pages=2, seed=25)
    want = F.dequantize(F.quantize(keys, "nvfp4"), "nvfp4")
    scales_first = F.Nvfp4PageLayout(1024, 64, 0, 8)
    padded = F.Nvfp4PageLayout(0, 80, 64, 80, page_bytes=128 * 80)  # 8 spare bytes per token
    for layout, shape3 in ((scales_first, (2, 128, 72)), (padded, (2, 128, 80))):
        c = F.quantize(keys, "nvfp4", layout=layout)
        assert c.shape == (2, layout.page_bytes) and c.dtype == torch.uint8
        for cache in (c, c.view(shape3)):
            pair = F.nvfp4_views(cache, layout=layout)
            assert _same_bits(F.dequantize(pair, "nvfp4"), want)
            _check_zero_copy(pair, cache)
        assert torch.equal(F.to_page_layout(F.nvfp4_views(c, layout=layout), layout), c)
    v, s = F.nvfp4_views(F.quantize(keys, "nvfp4", layout=padded), layout=padded)
    assert v.stride() == (10240, 80, 1) and s.stride() == (10240, 80, 1)
    assert s.storage_offset() == 64


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 64, 4096, 8), r"token 64's codes \(bytes from 4096\) overlap other bytes"),
        ((0, 64, 8192, 8, 9000), "past page_bytes=9000"),
        ((0, 72, 64, 64), "overlap"),
        ((0, 60, 8192, 8), "overlap"),  # code runs of 64 bytes 60 apart
        ((-8, 64, 8192, 8), r"codes_offset: expected an int >= 0"),
        ((0, 64, 8192.0, 8), r"scales_offset: expected an int >= 0"),
        ((0, True, 8192, 8), r"codes_token_stride: expected an int >= 0"),
    ],
)
def test_page_layout_checked(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        F.Nvfp4PageLayout(*args)


def _check_zero_copy(cache: F.Cache, base: F.Cache | None = None) -> None:
    """nvfp4_views aliases the input: inside its storage, and writes show through."""
    base = cache if base is None else base
    parts = base if isinstance(base, tuple) else (base, base)
    before = F.dequantize(cache, "nvfp4").clone()
    v, s = F.nvfp4_views(cache)
    assert v.shape[1:] == (128, 64) and s.shape[1:] == (128, 8)
    assert v.dtype == s.dtype == torch.uint8 and v.stride(-1) == s.stride(-1) == 1
    assert _inside(v, parts[0]) and _inside(s, parts[1])
    pages = v.shape[0]
    p, t = pages - 1, 5
    saved = int(v[p, t, 0]), int(s[p, t, 0])
    v[p, t, 0] = 0x7F  # element 0 -> code 15 (-6), element 1 -> code 7 (+6)
    s[p, t, 0] = 0x38  # scale 1.0
    after = F.dequantize(cache, "nvfp4")
    assert after[p, t, :2].tolist() == [-6.0, 6.0]
    assert torch.equal(after[:p], before[:p]) and torch.equal(after[p, :t], before[p, :t])
    assert torch.equal(after[p, t + 1 :], before[p, t + 1 :])
    v[p, t, 0], s[p, t, 0] = saved  # leave the cache as it was
    assert _same_bits(F.dequantize(cache, "nvfp4"), before)


@pytest.mark.parametrize("form", FORMS)
def test_views_are_zero_copy(form: str) -> None:
    _check_zero_copy(_forms(pages=2, seed=9)[form])


def test_view_strides() -> None:
    caches = _forms(pages=2, seed=9)
    for form in ("page_major", "page_major_3d"):
        c = caches[form]
        v, s = F.nvfp4_views(c)
        assert v.data_ptr() == c.data_ptr() and s.data_ptr() == c.data_ptr() + 8192
        assert v.stride() == (9216, 64, 1) and s.stride() == (9216, 8, 1)
    iv = caches["interleaved"][0]
    v, s = F.nvfp4_views(caches["interleaved"])
    assert v.data_ptr() == iv.data_ptr() and s.data_ptr() == iv.data_ptr() + 64
    assert v.stride() == (9216, 72, 1) and s.stride() == (9216, 72, 1)
    packed, scales = caches["pair"]
    v, s = F.nvfp4_views(caches["pair"])
    assert v is packed and s.data_ptr() == scales.data_ptr() and s.stride() == scales.stride()


def test_strided_views_accepted() -> None:
    """Caches that are views of larger pools: page strides, slices, interleaved pair views."""
    keys = _keys(pages=6, seed=22)
    want = F.dequantize(F.quantize(keys, "nvfp4"), "nvfp4")
    pm = F.quantize(keys, "nvfp4")
    pm3 = pm.view(6, 128, 72)
    iv = F.quantize(keys, "nvfp4", layout="interleaved").view(6, 128, 72)
    g = torch.Generator().manual_seed(26)
    # page-major pages in a pool: a spare page in front, 64 spare bytes after each page
    pool = torch.randint(0, 256, (7, 9216 + 64), generator=g, dtype=torch.uint8)
    pool[1:, :9216] = pm
    pool3 = torch.randint(0, 256, (12, 128, 72), generator=g, dtype=torch.uint8)
    pool3[1::2] = pm3  # every other page of a [pages, 128, 72] pool
    # an interleaved cache inside a pool with 8 spare bytes per token (token stride 80)
    pool80 = torch.randint(0, 256, (6, 128, 80), generator=g, dtype=torch.uint8)
    pool80[:, :, :72] = iv
    cases: list[tuple[F.Cache, str, torch.Tensor]] = [
        (pool[1:, :9216], "page_major", want),
        (pool[1:, :9216].view(6, 128, 72), "page_major", want),
        (pool3[1::2], "page_major", want),
        (pm[::3], "page_major", want[::3]),
        (pm3[1::2], "page_major", want[1::2]),
        ((iv[:, :, :64], iv[:, :, 64:]), "pair", want),  # the two slices of an interleaved cache
        ((iv[:, :, :64], iv[:, :, 64:].view(torch.float8_e4m3fn)), "pair", want),
        ((iv[::2, :, :64], iv[::2, :, 64:]), "pair", want[::2]),
        (F.nvfp4_views(iv[1::2], layout="interleaved"), "pair", want[1::2]),
        ((pool80[:, :, :64], pool80[:, :, 64:72]), "pair", want),
        (F.nvfp4_views(pm), "pair", want),  # the page-major views, as a pair
    ]
    for cache, layout, expected in cases:
        parts = cache if isinstance(cache, tuple) else (cache,)
        assert not all(part.is_contiguous() for part in parts)
        assert F.detect_format(cache) == "nvfp4"
        assert F.check_cache(cache, "nvfp4") == expected.shape[0]
        assert F.nvfp4_layout(cache) == layout
        assert _same_bits(F.dequantize(cache, "nvfp4"), expected)
        assert _same_bits(F.dequantize(F.to_page_layout(cache), "nvfp4"), expected)
        assert _same_bits(F.dequantize(F.to_nvfp4_pair(cache), "nvfp4"), expected)
        _check_zero_copy(cache)


def test_pages_must_be_contiguous() -> None:
    """A one-tensor nvfp4 cache is page-major: each page is 9216 contiguous bytes."""
    pool80 = torch.zeros(2, 128, 80, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"index_cache: the trailing \[128, 72\] dims must be"):
        F.check_cache(pool80[:, :, :72], "nvfp4")
    with pytest.raises(ValueError, match=r"trailing \[128, 72\] dims must be contiguous"):
        F.nvfp4_views(pool80[:, :, :72], layout="interleaved")
    t = torch.zeros(2, 72, 128, dtype=torch.uint8).transpose(1, 2)
    with pytest.raises(ValueError, match=r"trailing \[128, 72\] dims must be contiguous"):
        F.nvfp4_views(t)


def test_pair_with_page_stride_accepted() -> None:
    packed, scales = _random_pair(pages=6, seed=10)
    sub_p, sub_s = packed[::2], scales[::2].view(torch.float8_e4m3fn)
    assert not sub_p.is_contiguous()
    assert F.detect_format((sub_p, sub_s)) == "nvfp4"
    assert F.check_cache((sub_p, sub_s), "nvfp4") == 3
    c = F.to_page_layout((sub_p, sub_s))
    assert _same_bits(F.dequantize(c, "nvfp4"), F.dequantize((sub_p, sub_s), "nvfp4"))
    assert _same_bits(F.dequantize(c, "nvfp4"), _reference_dequant(packed[::2], scales[::2]))


def test_quantize_layout_argument() -> None:
    keys = _keys(pages=1, seed=23)
    assert torch.equal(F.quantize(keys, "nvfp4"), F.quantize(keys, "nvfp4", layout="page_major"))
    for old in ("product", "vllm", "72"):
        with pytest.raises(ValueError, match=r"layout: expected one of \('page_major', 'inter"):
            F.quantize(keys, "nvfp4", layout=old)
    with pytest.raises(
        ValueError, match=r"layout: cache_format 'fp8' has only layout 'page_major'"
    ):
        F.quantize(keys, "fp8", layout="interleaved")
    with pytest.raises(ValueError, match=r"layout: cache_format 'bf16' has only layout"):
        F.quantize(keys, "bf16", layout=F.NVFP4_PAGE_LAYOUTS["page_major"])
    assert F.quantize(keys, "bf16", layout="page_major").dtype == torch.bfloat16
    pair = F.quantize(keys, "nvfp4", layout="pair")
    assert torch.equal(F.to_page_layout(pair), F.quantize(keys, "nvfp4"))


def test_pair_takes_no_layout() -> None:
    pair = _forms(pages=1)["pair"]
    with pytest.raises(ValueError, match=r"layout: index_cache is a \(packed, scales\) pair"):
        F.nvfp4_views(pair, layout="interleaved")
    assert F.nvfp4_views(pair, layout="page_major")[0] is pair[0]


# --------------------------------------------------------------------------- errors


def test_query_dtype() -> None:
    assert F.query_dtype("bf16") == torch.bfloat16
    assert F.query_dtype("fp8") == torch.float8_e4m3fn
    assert F.query_dtype("nvfp4") == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="cache_format"):
        F.query_dtype("int4")


def test_constants() -> None:
    assert F.NVFP4_PAGE_BYTES == 9216 == 128 * F.BYTES_PER_TOKEN["nvfp4"]
    assert F.NVFP4_VALUE_BYTES % 16 == 0 and F.NVFP4_PAGE_BYTES % 16 == 0
    assert F.BYTES_PER_TOKEN == {"bf16": 256, "fp8": 128, "nvfp4": 72}


def test_detect_format_errors() -> None:
    with pytest.raises(TypeError, match=r"index_cache.*bfloat16.*float8_e4m3fn.*9216"):
        F.detect_format(torch.zeros(2, 128, 128))
    with pytest.raises(TypeError, match="index_cache"):
        F.detect_format(torch.zeros(2, 100, dtype=torch.uint8))
    with pytest.raises(TypeError, match="index_cache"):
        F.detect_format([1, 2, 3])


def test_check_cache_errors() -> None:
    x = _keys(pages=10, seed=11)
    bf = x.bfloat16()
    msg = (
        r"index_cache: expected torch\.float8_e4m3fn \[pages, 128, 128\] for cache_format "
        r"'fp8', got torch\.bfloat16 \[10, 128, 128\]"
    )
    with pytest.raises(TypeError, match=msg):
        F.check_cache(bf, "fp8")
    with pytest.raises(ValueError, match=r"my_cache: expected torch\.bfloat16.*\[10, 128, 64\]"):
        F.check_cache(bf[:, :, :64], "bf16", name="my_cache")
    with pytest.raises(ValueError, match="contiguous"):
        F.check_cache(bf.transpose(1, 2), "bf16")
    with pytest.raises(ValueError, match=r"uint8 \[pages, 9216\]"):
        F.check_cache(torch.zeros(2, 9000, dtype=torch.uint8), "nvfp4")
    with pytest.raises(TypeError, match="index_cache"):
        F.check_cache(bf, "nvfp4")
    with pytest.raises(ValueError, match="cache_format"):
        F.check_cache(bf, "fp4")

    packed, scales = _random_pair(pages=3, seed=12)
    with pytest.raises(ValueError, match="disagrees"):
        F.check_cache((packed, scales[:2]), "nvfp4")
    with pytest.raises(ValueError, match=r"packed.*\[pages, 128, 64\]"):
        F.check_cache((packed[:, :, :32], scales), "nvfp4")
    with pytest.raises(TypeError, match=r"scales.*float8_e4m3fn or torch\.uint8"):
        F.check_cache((packed, scales.float()), "nvfp4")
    with pytest.raises(ValueError, match="contiguous"):
        F.check_cache((packed.transpose(1, 2).contiguous().transpose(1, 2), scales), "nvfp4")
    with pytest.raises(TypeError, match="index_cache"):
        F.to_page_layout((packed.to(torch.int8), scales))


def test_quantize_rejects_bad_keys() -> None:
    with pytest.raises(ValueError, match=r"\[pages, 128, 128\]"):
        F.quantize(torch.randn(2, 128, 64), "nvfp4")
    with pytest.raises(TypeError, match="keys"):
        F.quantize(torch.ones(1, 128, 128, dtype=torch.int32), "fp8")
    with pytest.raises(ValueError, match="cache_format"):
        F.quantize(torch.randn(1, 128, 128), "int8")


def test_nvfp4_layout_errors() -> None:
    pm3 = F.quantize(_keys(pages=2, seed=24), "nvfp4").view(2, 128, 72)
    wide = torch.zeros(2, 128, 144, dtype=torch.uint8)
    # wrong dtype: TypeError naming the argument and the accepted forms
    for fn in (F.check_cache, lambda c, _: F.nvfp4_views(c), lambda c, _: F.nvfp4_layout(c)):
        with pytest.raises(TypeError, match=r"index_cache: expected torch\.uint8 \[pages, 9216\]"):
            fn(pm3.to(torch.int8), "nvfp4")
    with pytest.raises(TypeError, match=r"index_cache: cannot infer cache_format.*128, 72"):
        F.detect_format(pm3.to(torch.int8))
    with pytest.raises(TypeError, match=r"kv: expected .*got torch\.bfloat16"):
        F.nvfp4_views(_keys(pages=1).bfloat16(), name="kv")
    # wrong shapes: ValueError
    for bad in (torch.zeros(2, 128, 73, dtype=torch.uint8), pm3[:, :127], wide[:, :, :64]):
        with pytest.raises(ValueError, match=r"index_cache: expected .*\[pages, 128, 72\]"):
            F.check_cache(bad, "nvfp4")
    with pytest.raises(TypeError, match="index_cache"):
        F.detect_format(torch.zeros(2, 128, 64, dtype=torch.uint8))
    # a page that is not contiguous: ValueError naming the argument and the strides
    with pytest.raises(ValueError, match=r"index_cache: the trailing \[9216\] dims.*\[18432, 2\]"):
        F.check_cache(torch.zeros(2, 2 * 9216, dtype=torch.uint8)[:, ::2], "nvfp4")
    with pytest.raises(ValueError, match=r"index_cache: the trailing \[128, 72\] dims"):
        F.nvfp4_views(wide[:, :, ::2])
    packed, scales = F.nvfp4_views(pm3)
    with pytest.raises(ValueError, match=r"index_cache\[0\] \(packed\): the last dim must be"):
        F.check_cache((wide[:, :, ::2][:, :, :64], scales), "nvfp4")
    with pytest.raises(ValueError, match=r"index_cache\[1\] \(scales\): the last dim must be"):
        F.nvfp4_views((packed, wide[:, :, :16:2]))
    with pytest.raises(TypeError, match=r"index_cache: expected a pair"):
        F.nvfp4_views((packed, scales, scales))  # type: ignore[arg-type]
