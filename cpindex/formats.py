"""Index-key cache formats: bf16, fp8 (e4m3) and nvfp4 (e2m1 values + e4m3 group scales).

One page holds ``PAGE_TOKENS`` tokens of ``HEAD_DIM`` index-key elements. Layouts:

* ``bf16``:  ``torch.bfloat16 [pages, 128, 128]``
* ``fp8``:   ``torch.float8_e4m3fn [pages, 128, 128]`` (no scale)
* ``nvfp4``: 64 bytes of packed e2m1 codes per token (element ``2i`` in the low nibble of byte
  ``i``) and 8 e4m3 scales per token (scale g covers elements ``[16g, 16g + 16)``), in one of
  three layouts (``NVFP4_LAYOUTS``):

  - ``"product"``: ``uint8 [pages, 9216]``; per page the 8192 value bytes (token t at
    ``[64t, 64t + 64)``), then the 1024 scale bytes (token t at ``8192 + 8t``);
  - ``"vllm"``: ``uint8 [pages, 128, 72]``; per token its 64 value bytes, then its 8 scales;
  - ``"pair"``: ``(packed uint8 [pages, 128, 64], scales e4m3|uint8 [pages, 128, 8])``.

  Every nvfp4 layout is accepted wherever a cache is, and :func:`nvfp4_views` turns any of them
  into the same two zero-copy views. Key values are ``e4m3_rn_satfinite(e2m1 * scale)``.

See docs/formats.md.
"""

from __future__ import annotations

from typing import Literal, TypeAlias, overload

import torch
from torch import Tensor

PAGE_TOKENS = 128
HEAD_DIM = 128
NVFP4_GROUP = 16
NVFP4_VALUE_BYTES = PAGE_TOKENS * HEAD_DIM // 2  # 8192
NVFP4_SCALE_BYTES = PAGE_TOKENS * HEAD_DIM // NVFP4_GROUP  # 1024
NVFP4_PAGE_BYTES = NVFP4_VALUE_BYTES + NVFP4_SCALE_BYTES  # 9216
NVFP4_TOKEN_VALUE_BYTES = HEAD_DIM // 2  # 64 packed bytes per token
NVFP4_TOKEN_SCALES = HEAD_DIM // NVFP4_GROUP  # 8 scales per token
NVFP4_VLLM_TOKEN_BYTES = NVFP4_TOKEN_VALUE_BYTES + NVFP4_TOKEN_SCALES  # 72
NVFP4_LAYOUTS = ("product", "vllm", "pair")
BYTES_PER_TOKEN = {"bf16": 256, "fp8": 128, "nvfp4": 72}

FP8_MAX = 448.0
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0**-9

Cache: TypeAlias = Tensor | tuple[Tensor, Tensor]
"""A cache argument: one tensor, or the nvfp4 ``(packed, scales)`` pair."""

_GROUPS = NVFP4_TOKEN_SCALES
_ROW_BYTES = NVFP4_TOKEN_VALUE_BYTES
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

_PAIR = "a pair (torch.uint8 [pages, 128, 64], torch.float8_e4m3fn|torch.uint8 [pages, 128, 8])"
_EXPECTED = {
    "bf16": "torch.bfloat16 [pages, 128, 128]",
    "fp8": "torch.float8_e4m3fn [pages, 128, 128]",
    "nvfp4": f"torch.uint8 [pages, 9216] or torch.uint8 [pages, 128, 72] or {_PAIR}",
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


# --------------------------------------------------------------------------- validation


def query_dtype(fmt: str) -> torch.dtype:
    """Dtype of the query the scorer uses for ``fmt``: bf16 for bf16, e4m3 otherwise."""
    _check_fmt(fmt)
    return torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn


def _is_vllm(cache: Tensor) -> bool:
    return (
        cache.dtype == torch.uint8
        and cache.dim() == 3
        and tuple(cache.shape[1:]) == (PAGE_TOKENS, NVFP4_VLLM_TOKEN_BYTES)
    )


def detect_format(cache: Cache, name: str = "index_cache") -> str:
    """Infer the cache format from a cache tensor (or NVFP4 pair) without validating strides.

    ``bfloat16`` -> bf16, ``float8_e4m3fn`` -> fp8, ``uint8 [pages, 9216]``,
    ``uint8 [pages, 128, 72]`` or any 2-tuple -> nvfp4; anything else raises ``TypeError``.
    """
    if isinstance(cache, (tuple, list)) and len(cache) == 2:
        return "nvfp4"
    if isinstance(cache, Tensor):
        if cache.dtype == torch.bfloat16:
            return "bf16"
        if cache.dtype == torch.float8_e4m3fn:
            return "fp8"
        if cache.dtype == torch.uint8 and cache.dim() == 2 and cache.shape[1] == NVFP4_PAGE_BYTES:
            return "nvfp4"
        if _is_vllm(cache):
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
    *,
    last_dim_only: bool = False,
) -> int:
    """Check dtype and shape ``[pages, *inner]``; return ``pages``.

    The inner dims must be contiguous, or with ``last_dim_only`` just the last one (stride 1):
    nvfp4 layouts may be views with any token and page stride.
    """
    prefix = f"{name}: expected {what} for cache_format '{fmt}', got {_describe(t)}"
    if not isinstance(t, Tensor):
        raise TypeError(prefix)
    if t.dtype not in dtypes:
        raise TypeError(prefix)
    if t.dim() != 1 + len(inner) or tuple(t.shape[1:]) != inner:
        raise ValueError(prefix)
    if last_dim_only:
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name}: the last dim must be contiguous (stride 1) for cache_format '{fmt}', "
                f"got strides {list(t.stride())}"
            )
        return t.shape[0]
    expected_stride = 1
    for i in range(len(inner), 0, -1):
        if inner[i - 1] > 1 and t.stride(i) != expected_stride:
            raise ValueError(
                f"{name}: the trailing {list(inner)} dims must be contiguous for cache_format "
                f"'{fmt}', got strides {list(t.stride())}"
            )
        expected_stride *= inner[i - 1]
    return t.shape[0]


def _check_nvfp4(cache: object, name: str) -> tuple[str, int]:
    """Validate any nvfp4 layout; return ``(layout, pages)``."""
    fmt = "nvfp4"
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2:
            raise TypeError(f"{name}: expected {_PAIR}, got {_describe(cache)}")
        packed, scales = cache
        pages = _check_tensor(
            packed,
            (torch.uint8,),
            (PAGE_TOKENS, _ROW_BYTES),
            "torch.uint8 [pages, 128, 64]",
            f"{name}[0] (packed)",
            fmt,
            last_dim_only=True,
        )
        s_pages = _check_tensor(
            scales,
            (torch.float8_e4m3fn, torch.uint8),
            (PAGE_TOKENS, _GROUPS),
            "torch.float8_e4m3fn or torch.uint8 [pages, 128, 8]",
            f"{name}[1] (scales)",
            fmt,
            last_dim_only=True,
        )
        if pages != s_pages or packed.device != scales.device:
            raise ValueError(
                f"{name}: NVFP4 pair disagrees: packed {_describe(packed)} on {packed.device}, "
                f"scales {_describe(scales)} on {scales.device}"
            )
        return "pair", pages
    if isinstance(cache, Tensor) and cache.dim() == 3:
        inner: tuple[int, ...] = (PAGE_TOKENS, NVFP4_VLLM_TOKEN_BYTES)
        layout = "vllm"
    else:
        inner, layout = (NVFP4_PAGE_BYTES,), "product"
    pages = _check_tensor(
        cache, (torch.uint8,), inner, _EXPECTED["nvfp4"], name, fmt, last_dim_only=True
    )
    return layout, pages


def check_cache(cache: Cache, fmt: str, name: str = "index_cache") -> int:
    """Validate a cache for ``fmt`` and return its page count.

    Raises TypeError for a wrong dtype/kind and ValueError for a wrong shape, a non-contiguous
    layout, or an NVFP4 pair whose halves disagree. bf16/fp8 need contiguous ``[128, 128]``
    pages; nvfp4 layouts need only a contiguous last dim. The page stride is always free.
    """
    _check_fmt(fmt)
    if fmt in ("bf16", "fp8"):
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
        return _check_tensor(cache, (dtype,), (PAGE_TOKENS, HEAD_DIM), _EXPECTED[fmt], name, fmt)
    return _check_nvfp4(cache, name)[1]


# --------------------------------------------------------------------------- nvfp4 layouts


def nvfp4_layout(cache: Cache, name: str = "index_cache") -> str:
    """Which of ``NVFP4_LAYOUTS`` an nvfp4 cache uses (validated like :func:`check_cache`)."""
    return _check_nvfp4(cache, name)[0]


def nvfp4_views(
    cache: Cache, name: str = "index_cache", *, checked: bool = False
) -> tuple[Tensor, Tensor]:
    """Zero-copy views ``(values uint8 [pages, 128, 64], scales uint8 [pages, 128, 8])``.

    Works for every nvfp4 layout and never copies: the views alias ``cache``'s storage, so
    writes through them change the cache. Strides follow the layout: product (page stride of
    the input, token strides 64 and 8), vllm (token stride 72 for both), pair (as given; e4m3
    scales are reinterpreted as uint8). The last dim always has stride 1. ``checked=True``
    skips the validation for a cache :func:`check_cache` has already accepted (the launch path
    splits the cache on every call).
    """
    if not checked:
        _check_nvfp4(cache, name)
    if isinstance(cache, (tuple, list)):
        packed, scales = cache
        return packed, scales.view(torch.uint8)
    if cache.dim() == 3:  # vllm
        return cache[:, :, :_ROW_BYTES], cache[:, :, _ROW_BYTES:]
    # Splitting the contiguous last dim of a page slice is always a view.
    pages = cache.shape[0]
    values = cache[:, :NVFP4_VALUE_BYTES].view(pages, PAGE_TOKENS, _ROW_BYTES)
    scales = cache[:, NVFP4_VALUE_BYTES:].view(pages, PAGE_TOKENS, _GROUPS)
    return values, scales


def _empty_nvfp4(pages: int, layout: str, device: torch.device) -> tuple[Cache, Tensor, Tensor]:
    """A fresh contiguous cache in ``layout`` and its (values, scales) views."""
    if layout == "pair":
        values = torch.empty(pages, PAGE_TOKENS, _ROW_BYTES, dtype=torch.uint8, device=device)
        scales = torch.empty(pages, PAGE_TOKENS, _GROUPS, dtype=torch.uint8, device=device)
        return (values, scales.view(torch.float8_e4m3fn)), values, scales
    if layout == "vllm":
        shape: tuple[int, ...] = (pages, PAGE_TOKENS, NVFP4_VLLM_TOKEN_BYTES)
    elif layout == "product":
        shape = (pages, NVFP4_PAGE_BYTES)
    else:
        raise ValueError(f"layout must be one of {NVFP4_LAYOUTS}, got {layout!r}")
    out = torch.empty(shape, dtype=torch.uint8, device=device)
    values, scales = nvfp4_views(out)
    return out, values, scales


def _convert(cache: Cache, layout: str) -> Cache:
    values, scales = nvfp4_views(cache)
    out, v, s = _empty_nvfp4(values.shape[0], layout, values.device)
    v.copy_(values)
    s.copy_(scales)
    return out


def from_nvfp4_pair(packed: Tensor, scales: Tensor) -> Tensor:
    """Copy the public pair (packed uint8 [p,128,64], scales e4m3/uint8 [p,128,8], any token
    and page stride) into the product layout ``uint8 [pages, 9216]``."""
    out = _convert((packed, scales), "product")
    assert isinstance(out, Tensor)
    return out


def to_product_layout(cache: Cache) -> Tensor:
    """Copy any nvfp4 layout into a new contiguous product-layout ``uint8 [pages, 9216]``."""
    out = _convert(cache, "product")
    assert isinstance(out, Tensor)
    return out


def to_vllm_layout(cache: Cache) -> Tensor:
    """Copy any nvfp4 layout into a new contiguous vLLM-layout ``uint8 [pages, 128, 72]``."""
    out = _convert(cache, "vllm")
    assert isinstance(out, Tensor)
    return out


def to_nvfp4_pair(cache: Cache) -> tuple[Tensor, Tensor]:
    """Copy any nvfp4 layout into contiguous tensors of the public pair
    ``(packed uint8 [pages,128,64], scales float8_e4m3fn [pages,128,8])``."""
    out = _convert(cache, "pair")
    assert isinstance(out, tuple)
    return out


# --------------------------------------------------------------------------- quantize


def _check_keys(keys: Tensor) -> None:
    if not isinstance(keys, Tensor) or not keys.is_floating_point() or keys.element_size() < 2:
        raise TypeError(f"keys: expected a bf16/fp16/fp32 tensor, got {_describe(keys)}")
    if keys.dim() != 3 or tuple(keys.shape[1:]) != (PAGE_TOKENS, HEAD_DIM):
        raise ValueError(f"keys: expected shape [pages, 128, 128], got {list(keys.shape)}")
    if not bool(torch.isfinite(keys).all()):
        raise ValueError("keys: contains NaN or Inf")


@overload
def quantize(
    keys: Tensor, fmt: str, *, layout: Literal["product", "vllm"] = "product"
) -> Tensor: ...
@overload
def quantize(keys: Tensor, fmt: str, *, layout: Literal["pair"]) -> tuple[Tensor, Tensor]: ...
@overload
def quantize(keys: Tensor, fmt: str, *, layout: str) -> Cache: ...
def quantize(keys: Tensor, fmt: str, *, layout: str = "product") -> Cache:
    """Quantize float keys ``[pages, 128, 128]`` into a new cache for ``fmt``.

    bf16: cast. fp8: clamp to +-448, then cast (round to nearest even). nvfp4: per group of
    16 elements, scale = e4m3(amax / 6) (at least the smallest e4m3 subnormal 2**-9 for a
    non-zero group, 0 for an all-zero group), values = e2m1_encode(x / scale), written in
    ``layout`` (one of ``NVFP4_LAYOUTS``; "product" by default). bf16/fp8 have one layout,
    "product".
    """
    _check_fmt(fmt)
    if fmt != "nvfp4" and layout != "product":
        raise ValueError(f"layout: cache_format '{fmt}' has only layout 'product', got {layout!r}")
    if fmt == "nvfp4" and layout not in NVFP4_LAYOUTS:
        raise ValueError(f"layout must be one of {NVFP4_LAYOUTS}, got {layout!r}")
    _check_keys(keys)
    if fmt == "bf16":
        return keys.to(torch.bfloat16).contiguous()
    if fmt == "fp8":
        return keys.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()

    pages = keys.shape[0]
    x = keys.float().reshape(pages, PAGE_TOKENS, _GROUPS, NVFP4_GROUP)
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = e4m3_rn_satfinite(amax / E2M1_MAX)
    tiny = (scale == 0) & (amax > 0)  # amax/6 rounded below e4m3 range: keep the smallest scale
    scale = torch.where(tiny, torch.full_like(scale, E4M3_MIN_SUBNORMAL), scale)
    q = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
    codes = e2m1_encode(q).reshape(pages, PAGE_TOKENS, _ROW_BYTES, 2)

    out, v, s = _empty_nvfp4(pages, layout, keys.device)
    v.copy_(codes[..., 0] | (codes[..., 1] << 4))
    s.copy_(scale.reshape(pages, PAGE_TOKENS, _GROUPS).to(torch.float8_e4m3fn).view(torch.uint8))
    return out


def dequantize(cache: Cache, fmt: str) -> Tensor:
    """Read a cache back to float32 ``[pages, 128, 128]``: the key values the scorer uses.

    bf16/fp8: the stored values. nvfp4 (any layout): ``k[d] = e4m3_rn_satfinite(e2m1(d) *
    e4m3_scale(d // 16))``; the product is exact in fp32 and then rounded to e4m3 (nearest
    even, saturating at +-448), as the model's kernels score it. A zero product keeps its sign.
    """
    check_cache(cache, fmt)
    if fmt in ("bf16", "fp8"):
        assert isinstance(cache, Tensor)
        return cache.float()
    values, scales = nvfp4_views(cache)
    pages = values.shape[0]
    codes = torch.stack([values & 0xF, values >> 4], dim=-1).reshape(pages, PAGE_TOKENS, HEAD_DIM)
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(NVFP4_GROUP, dim=-1)
    # |e2m1| has <= 2 significant bits and an e4m3 scale <= 4, so the fp32 product is exact.
    return e4m3_rn_satfinite(e2m1_decode(codes) * s)
