"""Index-key cache formats: bf16, fp8 (e4m3) and nvfp4 (e2m1 values + e4m3 group scales).

One page holds ``PAGE_TOKENS`` tokens of ``HEAD_DIM`` index-key elements. Layouts:

* ``bf16``:  ``torch.bfloat16 [pages, 128, 128]``
* ``fp8``:   ``torch.float8_e4m3fn [pages, 128, 128]`` (no scale)
* ``nvfp4``: ``torch.uint8 [pages, 9216]``; per page 8192 bytes of packed e2m1 values
  (token t at bytes ``[64t, 64t + 64)``, element ``2i`` in the low nibble of byte ``i``), then
  1024 bytes of e4m3 scales (token t's 8 scales at ``8192 + 8t``; scale g covers elements
  ``[16g, 16g + 16)``). The public pair ``(packed [pages,128,64], scales [pages,128,8])`` is
  accepted wherever a cache is.

See docs/formats.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

PAGE_TOKENS = 128
HEAD_DIM = 128
NVFP4_GROUP = 16
NVFP4_VALUE_BYTES = PAGE_TOKENS * HEAD_DIM // 2  # 8192
NVFP4_SCALE_BYTES = PAGE_TOKENS * HEAD_DIM // NVFP4_GROUP  # 1024
NVFP4_PAGE_BYTES = NVFP4_VALUE_BYTES + NVFP4_SCALE_BYTES  # 9216
BYTES_PER_TOKEN = {"bf16": 256, "fp8": 128, "nvfp4": 72}

FP8_MAX = 448.0
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0**-9

_GROUPS = HEAD_DIM // NVFP4_GROUP  # 8 scales per token
_ROW_BYTES = HEAD_DIM // 2  # 64 packed bytes per token
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

_EXPECTED = {
    "bf16": "torch.bfloat16 [pages, 128, 128]",
    "fp8": "torch.float8_e4m3fn [pages, 128, 128]",
    "nvfp4": "torch.uint8 [pages, 9216] or a pair (torch.uint8 [pages, 128, 64], "
    "torch.float8_e4m3fn|torch.uint8 [pages, 128, 8])",
}


# --------------------------------------------------------------------------- helpers


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} {list(x.shape)}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_describe(t) for t in x) + ")"
    return type(x).__name__


def _check_fmt(fmt: str) -> None:
    if fmt not in BYTES_PER_TOKEN:
        raise ValueError(f"cache_format must be one of {sorted(BYTES_PER_TOKEN)}, got {fmt!r}")


def e2m1_decode(nibbles: Tensor) -> Tensor:
    """Decode e2m1 codes (uint8, low 4 bits used; bit 3 = sign) to float32."""
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


# --------------------------------------------------------------------------- validation


def query_dtype(fmt: str) -> torch.dtype:
    """Dtype of the query the scorer uses for ``fmt``: bf16 for bf16, e4m3 otherwise."""
    _check_fmt(fmt)
    return torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn


def detect_format(cache: Tensor | tuple[Tensor, Tensor], name: str = "index_cache") -> str:
    """Infer the cache format from a cache tensor (or NVFP4 pair) without validating shapes."""
    if isinstance(cache, (tuple, list)) and len(cache) == 2:
        return "nvfp4"
    if isinstance(cache, Tensor):
        if cache.dtype == torch.bfloat16:
            return "bf16"
        if cache.dtype == torch.float8_e4m3fn:
            return "fp8"
        if cache.dtype == torch.uint8 and cache.dim() == 2 and cache.shape[1] == NVFP4_PAGE_BYTES:
            return "nvfp4"
    accepted = "; ".join(f"{k}: {v}" for k, v in _EXPECTED.items())
    raise TypeError(
        f"{name}: cannot infer cache_format; accepted {accepted}; got {_describe(cache)}"
    )


def _check_tensor(
    t: object,
    dtypes: tuple[torch.dtype, ...],
    inner: tuple[int, ...],
    what: str,
    name: str,
    fmt: str,
) -> int:
    """Check dtype, shape ``[pages, *inner]`` and that the inner dims are contiguous."""
    prefix = f"{name}: expected {what} for cache_format '{fmt}', got {_describe(t)}"
    if not isinstance(t, Tensor):
        raise TypeError(prefix)
    if t.dtype not in dtypes:
        raise TypeError(prefix)
    if t.dim() != 1 + len(inner) or tuple(t.shape[1:]) != inner:
        raise ValueError(prefix)
    expected_stride = 1
    for i in range(len(inner), 0, -1):
        if inner[i - 1] > 1 and t.stride(i) != expected_stride:
            raise ValueError(
                f"{name}: the trailing {list(inner)} dims must be contiguous for cache_format "
                f"'{fmt}', got strides {list(t.stride())}"
            )
        expected_stride *= inner[i - 1]
    return t.shape[0]


def check_cache(cache: Tensor | tuple[Tensor, Tensor], fmt: str, name: str = "index_cache") -> int:
    """Validate a cache for ``fmt`` and return its page count.

    Raises TypeError for a wrong dtype/kind and ValueError for a wrong shape, non-contiguous
    inner dims, or a NVFP4 pair whose halves disagree. The page (outermost) stride is free.
    """
    _check_fmt(fmt)
    if fmt == "bf16":
        return _check_tensor(
            cache, (torch.bfloat16,), (PAGE_TOKENS, HEAD_DIM), _EXPECTED["bf16"], name, fmt
        )
    if fmt == "fp8":
        return _check_tensor(
            cache, (torch.float8_e4m3fn,), (PAGE_TOKENS, HEAD_DIM), _EXPECTED["fp8"], name, fmt
        )
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2:
            raise TypeError(f"{name}: expected {_EXPECTED['nvfp4']}, got {_describe(cache)}")
        packed, scales = cache
        pages = _check_tensor(
            packed,
            (torch.uint8,),
            (PAGE_TOKENS, _ROW_BYTES),
            "torch.uint8 [pages, 128, 64]",
            f"{name}[0] (packed)",
            fmt,
        )
        s_pages = _check_tensor(
            scales,
            (torch.float8_e4m3fn, torch.uint8),
            (PAGE_TOKENS, _GROUPS),
            "torch.float8_e4m3fn or torch.uint8 [pages, 128, 8]",
            f"{name}[1] (scales)",
            fmt,
        )
        if pages != s_pages or packed.device != scales.device:
            raise ValueError(
                f"{name}: NVFP4 pair disagrees: packed {_describe(packed)} on {packed.device}, "
                f"scales {_describe(scales)} on {scales.device}"
            )
        return pages
    return _check_tensor(cache, (torch.uint8,), (NVFP4_PAGE_BYTES,), _EXPECTED["nvfp4"], name, fmt)


# --------------------------------------------------------------------------- nvfp4 layout


def nvfp4_views(cache: Tensor) -> tuple[Tensor, Tensor]:
    """Zero-copy views ``(values uint8 [pages,128,64], scales uint8 [pages,128,8])``."""
    pages = check_cache(cache, "nvfp4")
    if not isinstance(cache, Tensor):
        raise TypeError("index_cache: nvfp4_views needs the product layout uint8 [pages, 9216]")
    values = cache[:, :NVFP4_VALUE_BYTES].view(pages, PAGE_TOKENS, _ROW_BYTES)
    scales = cache[:, NVFP4_VALUE_BYTES:].view(pages, PAGE_TOKENS, _GROUPS)
    return values, scales


def from_nvfp4_pair(packed: Tensor, scales: Tensor) -> Tensor:
    """Copy the public pair (packed uint8 [p,128,64], scales e4m3/uint8 [p,128,8]) into
    the product layout ``uint8 [pages, 9216]``."""
    pages = check_cache((packed, scales), "nvfp4")
    out = torch.empty(pages, NVFP4_PAGE_BYTES, dtype=torch.uint8, device=packed.device)
    v, s = nvfp4_views(out)
    v.copy_(packed)
    s.copy_(scales.view(torch.uint8))
    return out


def to_nvfp4_pair(cache: Tensor) -> tuple[Tensor, Tensor]:
    """Split a product-layout cache into contiguous copies of the public pair
    ``(packed uint8 [pages,128,64], scales float8_e4m3fn [pages,128,8])``."""
    v, s = nvfp4_views(cache)
    return v.contiguous(), s.contiguous().view(torch.float8_e4m3fn)


def _nvfp4_parts(cache: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    if isinstance(cache, (tuple, list)):
        check_cache(cache, "nvfp4")
        return cache[0], cache[1].view(torch.uint8)
    return nvfp4_views(cache)


# --------------------------------------------------------------------------- quantize


def _check_keys(keys: Tensor) -> None:
    if not isinstance(keys, Tensor) or not keys.is_floating_point() or keys.element_size() < 2:
        raise TypeError(f"keys: expected a bf16/fp16/fp32 tensor, got {_describe(keys)}")
    if keys.dim() != 3 or tuple(keys.shape[1:]) != (PAGE_TOKENS, HEAD_DIM):
        raise ValueError(f"keys: expected shape [pages, 128, 128], got {list(keys.shape)}")
    if not bool(torch.isfinite(keys).all()):
        raise ValueError("keys: contains NaN or Inf")


def quantize(keys: Tensor, fmt: str) -> Tensor:
    """Quantize float keys ``[pages, 128, 128]`` into the product page layout for ``fmt``.

    bf16: cast. fp8: clamp to +-448, then cast (round to nearest even). nvfp4: per group of
    16 elements, scale = e4m3(amax / 6) (at least the smallest e4m3 subnormal 2**-9 for a
    non-zero group, 0 for an all-zero group), values = e2m1_encode(x / scale).
    """
    _check_fmt(fmt)
    _check_keys(keys)
    if fmt == "bf16":
        return keys.to(torch.bfloat16).contiguous()
    if fmt == "fp8":
        return keys.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()

    pages = keys.shape[0]
    x = keys.float().reshape(pages, PAGE_TOKENS, _GROUPS, NVFP4_GROUP)
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale8 = (amax / E2M1_MAX).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    scale = scale8.float()
    tiny = (scale == 0) & (amax > 0)  # amax/6 rounded below e4m3 range: keep the smallest scale
    scale = torch.where(tiny, torch.full_like(scale, E4M3_MIN_SUBNORMAL), scale)
    scale8 = scale.to(torch.float8_e4m3fn)
    q = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
    codes = e2m1_encode(q).reshape(pages, PAGE_TOKENS, _ROW_BYTES, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)

    out = torch.empty(pages, NVFP4_PAGE_BYTES, dtype=torch.uint8, device=keys.device)
    v, s = nvfp4_views(out)
    v.copy_(packed)
    s.copy_(scale8.reshape(pages, PAGE_TOKENS, _GROUPS).view(torch.uint8))
    return out


def dequantize(cache: Tensor | tuple[Tensor, Tensor], fmt: str) -> Tensor:
    """Read a cache back to float32 ``[pages, 128, 128]`` exactly.

    For nvfp4: ``k[d] = e2m1(d) * e4m3_scale(d // 16)`` in fp32 (the product is exact).
    """
    pages = check_cache(cache, fmt)
    if fmt in ("bf16", "fp8"):
        return cache.float()
    values, scales = _nvfp4_parts(cache)
    codes = torch.stack([values & 0xF, values >> 4], dim=-1).reshape(pages, PAGE_TOKENS, HEAD_DIM)
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(NVFP4_GROUP, dim=-1)
    return e2m1_decode(codes) * s
