"""NVFP4 key values are e4m3_rn_satfinite(e2m1 * scale): checked against a bit-level oracle.

The oracle works on the exact rational value ``(-1)**sign * n * 2**k`` with Python integers only
(no torch fp8 cast, no float rounding): it finds the value's binade, the e4m3 quantum there (3
mantissa bits for normals, exponent >= -6; a fixed 2**-9 step for subnormals), rounds half to
even with integer shifts and saturates at 448.
"""

from __future__ import annotations

import math

import pytest
import torch

from cpindex import formats as F

E2M1_HALVES = (0, 1, 2, 3, 4, 6, 8, 12)  # e2m1 magnitudes in units of 1/2
NAN_BYTES = (0x7F, 0xFF)
FINITE_SCALE_BYTES = [b for b in range(256) if b not in NAN_BYTES]
# every form a cache is taken in: page-major [pages, 9216] and [pages, 128, 72], the pair, and
# the pair views of a token-interleaved cache
FORMS = ("page_major", "page_major_3d", "pair", "interleaved")


# --------------------------------------------------------------------------- the oracle


def e2m1_exact(code: int) -> tuple[int, int, int]:
    """e2m1 code -> (sign, n, k) with value (-1)**sign * n * 2**k."""
    return code >> 3, E2M1_HALVES[code & 7], -1


def e4m3_exact(byte: int) -> tuple[int, int, int]:
    """e4m3 (bias 7) byte -> (sign, n, k); exponent field 0 is subnormal: mantissa * 2**-9."""
    sign, exp, man = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if exp == 0:
        return sign, man, -9
    return sign, 8 + man, exp - 10  # (1 + man/8) * 2**(exp-7)


def round_e4m3(sign: int, n: int, k: int) -> float:
    """Round (-1)**sign * n * 2**k to e4m3, nearest even, saturating at +-448 (exact)."""
    if n == 0:
        return -0.0 if sign else 0.0
    exp = n.bit_length() - 1 + k  # floor(log2 |value|)
    quantum = max(exp, -6) - 3  # log2 of the spacing of e4m3 values at this magnitude
    shift = quantum - k
    if shift <= 0:
        m = n << -shift  # already a multiple of the quantum
    else:
        m = n >> shift
        rem = n - (m << shift)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and m & 1):
            m += 1
    # saturate: compare m * 2**quantum with 448 = 7 * 2**6 in integers
    too_big = m << max(quantum, 0) > 448 << max(-quantum, 0)
    mag = 448.0 if too_big else math.ldexp(m, quantum)
    return -mag if sign else mag


def product_oracle(code: int, scale_byte: int) -> float:
    s1, n1, k1 = e2m1_exact(code)
    s2, n2, k2 = e4m3_exact(scale_byte)
    return round_e4m3(s1 ^ s2, n1 * n2, k1 + k2)


def float_oracle(x: float) -> float:
    """The oracle for any finite float (its exact value, via the integer ratio)."""
    if math.isinf(x):
        return math.copysign(448.0, x)
    num, den = abs(x).as_integer_ratio()  # den is a power of two
    return round_e4m3(int(math.copysign(1.0, x) < 0), num, -(den.bit_length() - 1))


def assert_same_bits(got: torch.Tensor, want: list[float]) -> None:
    """Equal values and equal signs (so -0 and +0 differ), reported element-wise."""
    w = torch.tensor(want, dtype=torch.float32).reshape(got.shape)
    assert got.dtype == torch.float32
    bad = (got.view(torch.int32) != w.view(torch.int32)).nonzero()
    assert bad.numel() == 0, [(i, got[tuple(i)].item(), w[tuple(i)].item()) for i in bad[:8]]


def test_oracle_self_check() -> None:
    """The oracle decodes every finite e4m3 byte to a value it then rounds to itself."""
    for b in FINITE_SCALE_BYTES:
        s, n, k = e4m3_exact(b)
        v = math.ldexp(n, k) * (-1) ** s
        assert round_e4m3(s, n, k) == v
    assert e4m3_exact(0x7E)[1:] == (14, 5) and math.ldexp(14, 5) == 448
    assert math.ldexp(*e4m3_exact(0x01)[1:]) == 2.0**-9
    assert math.ldexp(*e4m3_exact(0x08)[1:]) == 2.0**-6
    assert round_e4m3(0, 464, 0) == 448.0  # tie between 448 (even) and 480, then saturation
    assert round_e4m3(0, 1, -10) == 0.0 and round_e4m3(1, 1, -10) == -0.0  # tie to 0
    assert round_e4m3(0, 3, -10) == 2.0**-8  # 1.5 * 2**-9: tie, to the even 2 * 2**-9


# --------------------------------------------------------------------------- e4m3_rn_satfinite


def _torch_e4m3_values() -> torch.Tensor:
    return torch.tensor(FINITE_SCALE_BYTES, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def test_rn_satfinite_dense_grid() -> None:
    """Every m * 2**e for 9-bit m over all binades that matter: all ties and near-ties of
    normals and subnormals, and values up to 4.5x past the saturation point."""
    mags = [math.ldexp(m, e) for e in range(-19, 3) for m in range(512)]
    xs = mags + [-v for v in mags]
    got = F.e4m3_rn_satfinite(torch.tensor(xs, dtype=torch.float32))
    assert_same_bits(got, [float_oracle(x) for x in xs])


def test_rn_satfinite_random_float32() -> None:
    g = torch.Generator().manual_seed(0)
    n = 20000
    # random sign and mantissa, exponent from 2**-14 (below e4m3's range) to 2**11 (above it)
    bits = torch.randint(0, 1 << 23, (n,), generator=g, dtype=torch.int32)
    bits |= torch.randint(127 - 14, 127 + 12, (n,), generator=g, dtype=torch.int32) << 23
    x = bits.view(torch.float32)
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    assert_same_bits(F.e4m3_rn_satfinite(x), [float_oracle(v) for v in x.tolist()])


def test_rn_satfinite_specials() -> None:
    xs = [0.0, -0.0, 448.0, 449.0, 464.0, 465.0, 480.0, 1e30, float("inf"), -464.0, -1e30]
    xs += [float("-inf"), 2.0**-10, -(2.0**-10), 2.0**-11, 1.5 * 2.0**-9, 2.0**-6 - 2.0**-10]
    got = F.e4m3_rn_satfinite(torch.tensor(xs))
    assert_same_bits(got, [float_oracle(x) for x in xs])
    assert got[:11].tolist() == [0.0, 0.0, 448, 448, 448, 448, 448, 448, 448, -448, -448]
    assert torch.signbit(got[1]) and not torch.signbit(got[0])
    assert got[13].item() == 0.0 and torch.signbit(got[13])  # -2**-10 rounds to -0
    assert got[15].item() == 2.0**-8 and got[16].item() == 2.0**-6  # subnormal ties to even
    assert torch.isnan(F.e4m3_rn_satfinite(torch.tensor([float("nan")]))).all()


def test_rn_satfinite_fixed_points_and_dtypes() -> None:
    v = _torch_e4m3_values()
    assert torch.equal(F.e4m3_rn_satfinite(v).view(torch.int32), v.view(torch.int32))
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 50
    for dt in (torch.float16, torch.bfloat16):
        xd = x.to(dt)
        got = F.e4m3_rn_satfinite(xd)
        assert got.dtype == torch.float32
        assert_same_bits(got, [float_oracle(t) for t in xd.float().tolist()])
    with pytest.raises(TypeError, match=r"x: expected a float32"):
        F.e4m3_rn_satfinite(x.double())
    with pytest.raises(TypeError, match=r"x: expected a float32"):
        F.e4m3_rn_satfinite(torch.ones(3, dtype=torch.int32))


# --------------------------------------------------------------------------- dequantize


def _in_form(pair: tuple[torch.Tensor, torch.Tensor], form: str) -> F.Cache:
    if form == "pair":
        return pair
    if form == "interleaved":
        c = F.to_page_layout(pair, "interleaved").view(-1, 128, 72)
        return F.nvfp4_views(c, layout="interleaved")
    c = F.to_page_layout(pair)
    return c.view(-1, 128, 72) if form == "page_major_3d" else c


def _all_products_cache(layout: str) -> tuple[F.Cache, list[list[float]]]:
    """One page where group g of token t holds the 16 codes 0..15 with scale byte
    FINITE_SCALE_BYTES[8t + g]: every (code, finite scale) pair once (254 groups, 32 tokens;
    the rest of the page is code 0 with scale 0)."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(128 * 8)  # [128 tok * 128 elements]
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 128, 64)
    packed[:, 32:] = 0
    scale_bytes = torch.zeros(128 * 8, dtype=torch.uint8)
    scale_bytes[: len(FINITE_SCALE_BYTES)] = torch.tensor(FINITE_SCALE_BYTES, dtype=torch.uint8)
    scales = scale_bytes.reshape(1, 128, 8)
    cache = _in_form((packed, scales.view(torch.float8_e4m3fn)), layout)
    want = [[0.0] * 128 for _ in range(128)]
    for t in range(32):
        for g in range(8):
            b = int(scale_bytes[8 * t + g])
            for c in range(16):
                want[t][16 * g + c] = product_oracle(c, b)
    return cache, want


@pytest.mark.parametrize("layout", FORMS)
def test_dequantize_every_code_times_every_scale(layout: str) -> None:
    cache, want = _all_products_cache(layout)
    assert F.nvfp4_layout(cache) == ("page_major" if layout.startswith("page") else "pair")
    got = F.dequantize(cache, "nvfp4")
    assert got.shape == (1, 128, 128)
    assert_same_bits(got[0], want)


def _one(code: int, scale_byte: int, layout: str = "page_major") -> torch.Tensor:
    """The dequantized key of one (code, scale byte) pair, element 0 of token 0."""
    packed = torch.zeros(1, 128, 64, dtype=torch.uint8)
    scales = torch.zeros(1, 128, 8, dtype=torch.uint8)
    packed[0, 0, 0] = code
    scales[0, 0, 0] = scale_byte
    pair = F.quantize(torch.zeros(1, 128, 128), "nvfp4", layout="pair")
    cache = _in_form(pair, layout)
    v, s = F.nvfp4_views(cache)
    v.copy_(packed)
    s.copy_(scales)
    return F.dequantize(cache, "nvfp4")[0, 0, 0]


@pytest.mark.parametrize(
    ("code", "scale_byte", "want"),
    [
        (7, 0x7E, 448.0),  # 6 * 448 saturates
        (15, 0x7E, -448.0),
        (7, 0xFE, -448.0),  # negative scale
        (2, 0x7E, 448.0),  # 1 * 448, the largest scale, exact
        (1, 0x7E, 224.0),
        (3, 0x39, 1.75),  # 1.5 * 1.125 = 1.6875: tie between 1.625 and 1.75 -> even mantissa
        (3, 0x3F, 2.75),  # 1.5 * 1.875 = 2.8125 -> nearest, 2.75
        (7, 0x07, 0.078125),  # 6 * 7*2**-9 = 10.5 * 2**-7: tie -> 10 * 2**-7
        (1, 0x01, 0.0),  # 0.5 * 2**-9 (smallest product): tie between 0 and 2**-9 -> +0
        (9, 0x01, -0.0),  # ... negative: -0
        (3, 0x01, 2.0**-8),  # 1.5 * 2**-9: subnormal tie -> 2 * 2**-9
        (2, 0x01, 2.0**-9),  # smallest scale, exact
        (5, 0x03, 9 * 2.0**-9),  # 3 * 3*2**-9 lands on the first normal binade, exact
        (0, 0x38, 0.0),
        (8, 0x38, -0.0),  # e2m1 -0 times a positive scale
        (0, 0xB8, -0.0),  # +0 times a negative scale
        (8, 0xB8, 0.0),  # -0 times -1
        (7, 0x00, 0.0),  # scale +0
        (7, 0x80, -0.0),  # scale -0
        (15, 0x80, 0.0),
    ],
)
def test_dequantize_edges(code: int, scale_byte: int, want: float) -> None:
    assert product_oracle(code, scale_byte) == want
    assert math.copysign(1, product_oracle(code, scale_byte)) == math.copysign(1, want)
    for layout in FORMS:
        got = _one(code, scale_byte, layout)
        assert got.item() == want and bool(torch.signbit(got)) == (math.copysign(1, want) < 0)


def test_rounding_matters_on_random_keys() -> None:
    """On quantized RMS-normed keys the rounded values differ from the exact product often
    enough that the rule is observable (guards against silently scoring the exact product)."""
    keys = torch.randn(4, 128, 128, generator=torch.Generator().manual_seed(3))
    cache = F.quantize(keys, "nvfp4")
    v, s = F.nvfp4_views(cache)
    codes = torch.stack([v & 0xF, v >> 4], dim=-1).reshape(4, 128, 128)
    exact = F.e2m1_decode(codes) * s.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
    changed = (F.dequantize(cache, "nvfp4") != exact).float().mean().item()
    assert 0.05 < changed < 0.5


def test_kernel_tables_match_the_oracle() -> None:
    """The GPU kernel decodes nvfp4 through two per-scale tables (f16 bytes and e4m3 bytes of
    every magnitude) and applies a code's sign by flipping the sign bit: every entry, and every
    entry with the sign applied, equals the bit-level oracle."""
    from cpindex.kernels.launcher import nvfp4_lut

    lut = nvfp4_lut()
    assert lut.dtype == torch.uint8 and lut.shape == (6144,)
    f16 = lut[:4096].view(256, 16).to(torch.int32)
    f16_bits = ((f16[:, :8] << 8) | f16[:, 8:]).to(torch.int16)
    e4m3_bits = lut[4096:].view(256, 8)
    for b in FINITE_SCALE_BYTES:
        for code in range(16):
            sign = code >> 3
            h = f16_bits[b, code & 7] ^ (-0x8000 if sign else 0)
            e = e4m3_bits[b, code & 7] ^ (0x80 if sign else 0)
            got_h = torch.tensor([h], dtype=torch.int16).view(torch.float16).float()
            got_e = torch.tensor([e], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            assert_same_bits(got_h, [product_oracle(code, b)])
            assert_same_bits(got_e, [product_oracle(code, b)])
