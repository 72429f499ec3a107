"""The number formats and the one quantizer: e2m1 and e4m3 rounding, :func:`quantize` and
:func:`dequantize` of whole pages, and the per-token encoding :func:`cpindex.formats.write_keys`
shares (and the GPU writer mirrors bit for bit). Users reach it through :mod:`cpindex.formats`.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from .layouts import (
    _GROUPS,
    HEAD_DIM,
    NVFP4_GROUP,
    PAGE_TOKENS,
    Cache,
    Nvfp4PageLayout,
    PageLayoutArg,
    _check_fmt,
    _describe,
    _empty_nvfp4,
    check_cache,
    nvfp4_views,
    page_layout,
)

FP8_MAX = 448.0
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0**-9
#: The writer's floor on a group's amax before dividing by 6 (MiniMax's writer).
NVFP4_AMAX_FLOOR = 1e-12

_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision boundaries between grid codes c and c+1, and whether a tie moves up (c odd -> up to
# the even code c+1, c even -> stay): round-to-nearest-even on the mantissa bit.
_E2M1_BOUNDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)
_KEY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def e2m1_decode(nibbles: Tensor) -> Tensor:
    """Decode e2m1 codes (uint8, low 4 bits used; bit 3 = sign) to float32.

    Code 8 decodes to ``-0.0``.
    """
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32, device=nibbles.device)
    lut = torch.cat([grid, -grid])
    return lut[(nibbles & 0xF).long()]


def e2m1_encode(x: Tensor) -> Tensor:
    """Round float values to the nearest e2m1 code (ties to even, saturating at +-6).

    Returns uint8 nibbles in ``[0, 16)``; bit 3 is the sign. Zero (and -0) encode as +0.
    """
    x = x.float()
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in _E2M1_BOUNDS:  # 7 vectorized comparisons, not a loop over elements
        code += (mag >= bound if tie_up else mag > bound).to(torch.uint8)
    sign = ((x < 0) & (code != 0)).to(torch.uint8) << 3
    return code | sign


def e4m3_rn_satfinite(x: Tensor) -> Tensor:
    """Round to the nearest e4m3 value (ties to even), saturating at +-448; float32 out.

    ``x`` must be float32, float16 or bfloat16 (widened to float32 exactly; float64 is refused
    because rounding it to float32 first could move a tie). The result holds e4m3 values as
    float32. Signs are kept, so ``-0`` and negatives that round to zero give ``-0.0``; +-inf
    give +-448; NaN stays NaN. This is the rounding of PTX ``cvt.rn.satfinite.e4m3x2``.
    """
    if not isinstance(x, Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x: expected a float32/float16/bfloat16 tensor, got {_describe(x)}")
    # Clamping first equals rounding then saturating: rounding is monotonic and 448 is an e4m3
    # value, so every |x| >= 448 rounds to a magnitude >= 448 and saturates to 448, exactly what
    # rounding the clamped 448 gives; below 448 the clamp is the identity. It also keeps the
    # result independent of how a torch version treats out-of-range casts (NaN or saturate).
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


# --------------------------------------------------------------------------- the quantizer


def _encode(keys: Tensor, fmt: str) -> tuple[Tensor, Tensor | None]:
    """The one quantizer, shared by :func:`quantize` and :func:`write_keys` (and mirrored bit
    for bit by the GPU writer): float keys ``[..., 128]`` -> the stored bytes of each token.

    bf16: ``(int16 [..., 128] bf16 bits, None)``; fp8: ``(uint8 [..., 128] e4m3 bytes,
    None)``; nvfp4: ``(packed codes uint8 [..., 64], scale bytes uint8 [..., 8])``.
    """
    x = keys.float()  # exact for bf16/fp16 keys
    if fmt == "bf16":
        return x.to(torch.bfloat16).view(torch.int16), None
    if fmt == "fp8":
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), None
    g = x.unflatten(-1, (_GROUPS, NVFP4_GROUP))
    amax = g.abs().amax(dim=-1, keepdim=True).clamp_min(NVFP4_AMAX_FLOOR)
    # fp32 division by a tensor, never by a Python scalar: on CUDA torch turns x / scalar into
    # x * (1 / scalar), which rounds differently from the writer kernel's IEEE division.
    scale = e4m3_rn_satfinite(amax / torch.full_like(amax, E2M1_MAX))
    scale = scale.clamp_min(E4M3_MIN_SUBNORMAL)
    codes = e2m1_encode(g / scale).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale.squeeze(-1).to(torch.float8_e4m3fn).view(torch.uint8)


def _check_finite(keys: Tensor) -> None:
    if not bool(torch.isfinite(keys).all()):
        raise ValueError("keys: contains NaN or Inf")


def _check_keys(keys: Tensor) -> None:
    if not isinstance(keys, Tensor) or keys.dtype not in _KEY_DTYPES:
        raise TypeError(f"keys: expected a bf16/fp16/fp32 tensor, got {_describe(keys)}")
    if keys.dim() != 3 or tuple(keys.shape[1:]) != (PAGE_TOKENS, HEAD_DIM):
        raise ValueError(f"keys: expected shape [pages, 128, 128], got {list(keys.shape)}")
    _check_finite(keys)


@overload
def quantize(keys: Tensor, fmt: str, *, layout: Literal["pair"]) -> tuple[Tensor, Tensor]: ...
@overload
def quantize(
    keys: Tensor, fmt: str, *, layout: Literal["page_major"] | Nvfp4PageLayout = "page_major"
) -> Tensor: ...
@overload
def quantize(keys: Tensor, fmt: str, *, layout: PageLayoutArg) -> Cache: ...
def quantize(keys: Tensor, fmt: str, *, layout: PageLayoutArg = "page_major") -> Cache:
    """Quantize float keys ``[pages, 128, 128]`` into a new cache for ``fmt``.

    Encodes exactly as :func:`write_keys` does (docs/formats.md, the writer's rules). bf16:
    cast. fp8: clamp to +-448, then round to nearest even. nvfp4: per group of 16 elements,
    ``scale = max(e4m3(max(amax, 1e-12) / 6), 2**-9)``, codes = e2m1 of ``x / scale`` (ties to
    even, saturating at +-6), in ``layout``: an in-page layout (``"page_major"`` by default,
    giving ``uint8 [pages, 9216]``; a name in ``NVFP4_PAGE_LAYOUTS`` or an
    :class:`Nvfp4PageLayout` gives ``uint8 [pages, page_bytes]``) or ``"pair"`` (a tuple).
    bf16/fp8 have one layout, ``"page_major"``. Non-finite keys raise ``ValueError``.
    """
    _check_fmt(fmt)
    if fmt != "nvfp4" and layout != "page_major":
        raise ValueError(
            f"layout: cache_format '{fmt}' has only layout 'page_major', got {layout!r}"
        )
    if fmt == "nvfp4" and layout != "pair":
        page_layout(layout)
    _check_keys(keys)
    stored, scales = _encode(keys, fmt)
    if fmt == "bf16":
        return stored.view(torch.bfloat16)
    if fmt == "fp8":
        return stored.view(torch.float8_e4m3fn)
    assert scales is not None
    out, v, s = _empty_nvfp4(keys.shape[0], layout, keys.device)
    v.copy_(stored)
    s.copy_(scales)
    return out


def dequantize(cache: Cache, fmt: str) -> Tensor:
    """Read a cache back to float32 ``[pages, 128, 128]``: the key values the scorer uses.

    bf16/fp8: the stored values. nvfp4 (either form): ``k[d] = e4m3_rn_satfinite(e2m1(d) *
    e4m3_scale(d // 16))``; the product is exact in fp32 and then rounded to e4m3 (nearest
    even, saturating at +-448), as the model's kernels score it. A zero product keeps its sign.
    """
    check_cache(cache, fmt)
    if fmt in ("bf16", "fp8"):
        assert isinstance(cache, Tensor)
        return cache.float()
    values, scales = nvfp4_views(cache, checked=True)
    pages = values.shape[0]
    codes = torch.stack([values & 0xF, values >> 4], dim=-1).reshape(pages, PAGE_TOKENS, HEAD_DIM)
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(NVFP4_GROUP, dim=-1)
    # |e2m1| has <= 2 significant bits and an e4m3 scale <= 4, so the fp32 product is exact.
    return e4m3_rn_satfinite(e2m1_decode(codes) * s)
