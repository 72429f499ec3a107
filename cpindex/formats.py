"""Index-key cache formats: bf16, fp8 (e4m3) and nvfp4 (e2m1 values + e4m3 group scales).

One page holds ``PAGE_TOKENS`` tokens of ``HEAD_DIM`` index-key elements. Layouts:

* ``bf16``:  ``torch.bfloat16 [pages, 128, 128]``
* ``fp8``:   ``torch.float8_e4m3fn [pages, 128, 128]`` (no scale)
* ``nvfp4``: 64 bytes of packed e2m1 codes per token (element ``2i`` in the low nibble of byte
  ``i``) and 8 e4m3 scales per token (scale g covers elements ``[16g, 16g + 16)``), taken in
  one of two forms (``NVFP4_LAYOUTS``):

  - ``"page_major"``: one tensor, ``uint8 [pages, 9216]`` or ``uint8 [pages, 128, 72]`` (the
    same bytes): per page the 8192 code bytes (token t at ``64t``), then the 1024 scale bytes
    (token t at ``8192 + 8t``);
  - ``"pair"``: ``(codes uint8 [pages, 128, 64], scales e4m3|uint8 [pages, 128, 8])``, any
    token and page strides. A cache with another in-page layout (the token-interleaved one,
    ``NVFP4_PAGE_LAYOUTS["interleaved"]``, or any :class:`Nvfp4PageLayout`) is passed as the
    pair of views ``nvfp4_views(cache, layout=...)``.

  :func:`nvfp4_views` turns any of them into the same two zero-copy views. Key values are
  ``e4m3_rn_satfinite(e2m1 * scale)``.

:func:`write_keys` stores keys at slots of any cache (one fused kernel on a GPU); :func:`quantize`
encodes whole pages with the same quantizer. See docs/formats.md.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal, TypeAlias, overload

import torch
from torch import Tensor

from .errors import CPIndexError

if TYPE_CHECKING:
    from .kernels.launcher import ErrorMonitor

PAGE_TOKENS = 128
HEAD_DIM = 128
NVFP4_GROUP = 16
NVFP4_VALUE_BYTES = PAGE_TOKENS * HEAD_DIM // 2  # 8192
NVFP4_SCALE_BYTES = PAGE_TOKENS * HEAD_DIM // NVFP4_GROUP  # 1024
NVFP4_PAGE_BYTES = NVFP4_VALUE_BYTES + NVFP4_SCALE_BYTES  # 9216
NVFP4_TOKEN_VALUE_BYTES = HEAD_DIM // 2  # 64 packed bytes per token
NVFP4_TOKEN_SCALES = HEAD_DIM // NVFP4_GROUP  # 8 scales per token
NVFP4_TOKEN_BYTES = NVFP4_TOKEN_VALUE_BYTES + NVFP4_TOKEN_SCALES  # 72
NVFP4_LAYOUTS = ("page_major", "pair")
BYTES_PER_TOKEN = {"bf16": 256, "fp8": 128, "nvfp4": 72}

FP8_MAX = 448.0
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0**-9
#: The writer's floor on a group's amax before dividing by 6 (MiniMax's writer).
NVFP4_AMAX_FLOOR = 1e-12

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
_KEY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_PAIR = "a pair (torch.uint8 [pages, 128, 64], torch.float8_e4m3fn|torch.uint8 [pages, 128, 8])"
_EXPECTED = {
    "bf16": "torch.bfloat16 [pages, 128, 128]",
    "fp8": "torch.float8_e4m3fn [pages, 128, 128]",
    "nvfp4": f"torch.uint8 [pages, 9216] or torch.uint8 [pages, 128, 72] (page-major) or {_PAIR}",
}


# --------------------------------------------------------------------------- in-page layouts


@dataclass(frozen=True)
class Nvfp4PageLayout:
    """Where one nvfp4 page keeps its bytes: token ``t``'s 64 code bytes start at byte
    ``codes_offset + t * codes_token_stride`` of the page, its 8 scale bytes at
    ``scales_offset + t * scales_token_stride``; a page is ``page_bytes`` contiguous bytes.

    A cache in such a layout is a ``uint8 [pages, page_bytes]`` tensor (or ``[pages, 128,
    page_bytes // 128]``) with any page stride; :func:`nvfp4_views` with ``layout=`` gives the
    ``(codes, scales)`` pair every cpindex function takes. Construction checks that every byte
    lies inside the page and that no byte belongs to two tokens.
    """

    codes_offset: int
    codes_token_stride: int
    scales_offset: int
    scales_token_stride: int
    page_bytes: int = NVFP4_PAGE_BYTES

    def __post_init__(self) -> None:
        for field, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Nvfp4PageLayout.{field}: expected an int >= 0, got {value!r}")
        spans = sorted(
            (off + t * stride, size, f"token {t}'s {what}")
            for off, stride, size, what in (
                (self.codes_offset, self.codes_token_stride, _ROW_BYTES, "codes"),
                (self.scales_offset, self.scales_token_stride, _GROUPS, "scales"),
            )
            for t in range(PAGE_TOKENS)
        )
        end = 0
        for start, size, what in spans:
            if start < end:
                raise ValueError(
                    f"Nvfp4PageLayout: {what} (bytes from {start}) overlap other bytes"
                )
            end = start + size
        if end > self.page_bytes:
            raise ValueError(
                f"Nvfp4PageLayout: bytes reach {end}, past page_bytes={self.page_bytes}"
            )


_PAGE_MAJOR = Nvfp4PageLayout(0, _ROW_BYTES, NVFP4_VALUE_BYTES, _GROUPS)

#: The named in-page layouts. ``page_major``: what a one-tensor nvfp4 cache is read as (vLLM's
#: ``[pages, 128, 72]`` NVFP4 pages, the same bytes as ``[pages, 9216]``). ``interleaved``: 64
#: code bytes then 8 scale bytes per 72-byte token; read it as ``nvfp4_views(cache,
#: layout="interleaved")``. Another layout is one more :class:`Nvfp4PageLayout`, passed as
#: ``layout=`` wherever one is taken.
NVFP4_PAGE_LAYOUTS: Mapping[str, Nvfp4PageLayout] = MappingProxyType(
    {
        "page_major": _PAGE_MAJOR,
        "interleaved": Nvfp4PageLayout(0, NVFP4_TOKEN_BYTES, _ROW_BYTES, NVFP4_TOKEN_BYTES),
    }
)

PageLayoutArg: TypeAlias = str | Nvfp4PageLayout
"""A name in ``NVFP4_PAGE_LAYOUTS`` or an :class:`Nvfp4PageLayout`."""


def page_layout(layout: PageLayoutArg) -> Nvfp4PageLayout:
    """The :class:`Nvfp4PageLayout` a ``layout`` argument names (instances pass through)."""
    if isinstance(layout, Nvfp4PageLayout):
        return layout
    if isinstance(layout, str) and layout in NVFP4_PAGE_LAYOUTS:
        return NVFP4_PAGE_LAYOUTS[layout]
    raise ValueError(
        f"layout: expected one of {tuple(NVFP4_PAGE_LAYOUTS)} or an Nvfp4PageLayout, got {layout!r}"
    )


# --------------------------------------------------------------------------- helpers


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} {list(x.shape)}"
    if isinstance(x, (tuple, list)) and len(x) <= 3:  # a pair, or close to one
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


def _is_page_tensor(cache: Tensor, page_bytes: int = NVFP4_PAGE_BYTES) -> bool:
    """``uint8 [pages, page_bytes]`` or ``uint8 [pages, 128, page_bytes // 128]``."""
    if cache.dtype != torch.uint8:
        return False
    if cache.dim() == 2:
        return cache.shape[1] == page_bytes
    return (
        cache.dim() == 3
        and page_bytes % PAGE_TOKENS == 0
        and tuple(cache.shape[1:]) == (PAGE_TOKENS, page_bytes // PAGE_TOKENS)
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
        if _is_page_tensor(cache):
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
    the pair's tensors may be views with any token and page stride.
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
                f"'{fmt}' (each page is one run of bytes), got strides {list(t.stride())}"
            )
        expected_stride *= inner[i - 1]
    return t.shape[0]


def _check_pair(cache: tuple | list, name: str) -> int:
    if len(cache) != 2:
        raise TypeError(f"{name}: expected {_PAIR}, got {_describe(cache)}")
    fmt = "nvfp4"
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
    return pages


def _check_page_tensor(cache: object, name: str, page: Nvfp4PageLayout) -> int:
    """Validate a one-tensor nvfp4 cache whose pages follow ``page``; return ``pages``."""
    n = page.page_bytes
    shapes = f"torch.uint8 [pages, {n}]"
    if n % PAGE_TOKENS == 0:
        shapes += f" or torch.uint8 [pages, 128, {n // PAGE_TOKENS}]"
    if page == _PAGE_MAJOR:
        shapes += f" (page-major) or {_PAIR}"
    inner: tuple[int, ...] = (n,)
    if isinstance(cache, Tensor) and cache.dim() == 3 and n % PAGE_TOKENS == 0:
        inner = (PAGE_TOKENS, n // PAGE_TOKENS)
    return _check_tensor(cache, (torch.uint8,), inner, shapes, name, "nvfp4")


def _check_nvfp4(cache: object, name: str) -> tuple[str, int]:
    """Validate an nvfp4 cache in either form; return ``(layout, pages)``."""
    if isinstance(cache, (tuple, list)):
        return "pair", _check_pair(cache, name)
    return "page_major", _check_page_tensor(cache, name, _PAGE_MAJOR)


def check_cache(cache: Cache, fmt: str, name: str = "index_cache") -> int:
    """Validate a cache for ``fmt`` and return its page count.

    Raises TypeError for a wrong dtype/kind and ValueError for a wrong shape, a non-contiguous
    layout, or an NVFP4 pair whose halves disagree. bf16/fp8 and page-major nvfp4 tensors need
    contiguous pages; the pair's tensors need only a contiguous last dim. The page stride is
    always free.
    """
    _check_fmt(fmt)
    if fmt in ("bf16", "fp8"):
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
        return _check_tensor(cache, (dtype,), (PAGE_TOKENS, HEAD_DIM), _EXPECTED[fmt], name, fmt)
    return _check_nvfp4(cache, name)[1]


def cache_device(cache: Cache) -> torch.device:
    """The device a (validated) cache lives on."""
    return cache[0].device if isinstance(cache, (tuple, list)) else cache.device


# --------------------------------------------------------------------------- nvfp4 views


def nvfp4_layout(cache: Cache, name: str = "index_cache") -> str:
    """Which of ``NVFP4_LAYOUTS`` an nvfp4 cache uses (validated like :func:`check_cache`)."""
    return _check_nvfp4(cache, name)[0]


def nvfp4_views(
    cache: Cache,
    name: str = "index_cache",
    *,
    layout: PageLayoutArg = "page_major",
    checked: bool = False,
) -> tuple[Tensor, Tensor]:
    """Zero-copy views ``(values uint8 [pages, 128, 64], scales uint8 [pages, 128, 8])``.

    A one-tensor cache is read with the in-page ``layout`` (page-major by default; a name in
    ``NVFP4_PAGE_LAYOUTS`` or an :class:`Nvfp4PageLayout`): the views start at the layout's
    offsets inside the first page, with the tensor's page stride and the layout's token
    strides (page-major: 64 and 8, scales at +8192). A pair is returned as given (e4m3 scales
    reinterpreted as uint8); ``layout`` must then be left at its default. The views alias
    ``cache``'s storage, so writes through them change the cache. ``checked=True`` skips the
    validation for a cache :func:`check_cache` has already accepted (the launch path splits
    the cache on every call).
    """
    page = page_layout(layout)
    if isinstance(cache, (tuple, list)):
        if page != _PAGE_MAJOR:
            raise ValueError(
                f"layout: {name} is a (packed, scales) pair, already split; layout "
                f"{layout!r} applies to a one-tensor cache"
            )
        if not checked:
            _check_pair(cache, name)
        packed, scales = cache
        return packed, scales.view(torch.uint8)
    if not checked:
        _check_page_tensor(cache, name, page)
    pages, page_stride, base = cache.shape[0], cache.stride(0), cache.storage_offset()
    values = cache.as_strided(
        (pages, PAGE_TOKENS, _ROW_BYTES),
        (page_stride, page.codes_token_stride, 1),
        base + page.codes_offset,
    )
    scales = cache.as_strided(
        (pages, PAGE_TOKENS, _GROUPS),
        (page_stride, page.scales_token_stride, 1),
        base + page.scales_offset,
    )
    return values, scales


def _empty_nvfp4(
    pages: int, layout: str | Nvfp4PageLayout, device: torch.device
) -> tuple[Cache, Tensor, Tensor]:
    """A fresh zeroed cache in ``layout`` ("pair" or an in-page layout) and its views."""
    if isinstance(layout, str) and layout == "pair":
        values = torch.zeros(pages, PAGE_TOKENS, _ROW_BYTES, dtype=torch.uint8, device=device)
        scales = torch.zeros(pages, PAGE_TOKENS, _GROUPS, dtype=torch.uint8, device=device)
        return (values, scales.view(torch.float8_e4m3fn)), values, scales
    page = page_layout(layout)
    out = torch.zeros(pages, page.page_bytes, dtype=torch.uint8, device=device)
    values, scales = nvfp4_views(out, layout=page, checked=True)
    return out, values, scales


def to_page_layout(cache: Cache, layout: PageLayoutArg = "page_major") -> Tensor:
    """Copy an nvfp4 cache (either form) into a new contiguous ``uint8 [pages, page_bytes]``
    in the in-page ``layout`` (page-major ``[pages, 9216]`` by default; ``.view(pages, 128,
    72)`` of it is the same cache). Bytes no token owns are zero."""
    values, scales = nvfp4_views(cache)
    out, v, s = _empty_nvfp4(values.shape[0], page_layout(layout), values.device)
    v.copy_(values)
    s.copy_(scales)
    assert isinstance(out, Tensor)
    return out


def to_nvfp4_pair(cache: Cache) -> tuple[Tensor, Tensor]:
    """Copy an nvfp4 cache (either form) into contiguous tensors of the public pair
    ``(packed uint8 [pages,128,64], scales float8_e4m3fn [pages,128,8])``."""
    values, scales = nvfp4_views(cache)
    out, v, s = _empty_nvfp4(values.shape[0], "pair", values.device)
    v.copy_(values)
    s.copy_(scales)
    assert isinstance(out, tuple)
    return out


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


# --------------------------------------------------------------------------- write_keys


def _key_bytes(cache: Cache, fmt: str) -> tuple[Tensor, Tensor | None]:
    """Integer views of where a token's bytes go: ``[pages, 128, n]`` each (index_put has no
    fp8 kernel, so bf16/fp8 pages are written as their bits)."""
    if fmt == "nvfp4":
        return nvfp4_views(cache, checked=True)
    assert isinstance(cache, Tensor)
    return cache.view(torch.int16 if fmt == "bf16" else torch.uint8), None


def _check_write(
    cache: Cache, keys: object, slot_mapping: object
) -> tuple[str, int, Tensor, Tensor]:
    """Host-only checks of a write; returns ``(fmt, pages, keys, slot_mapping)``."""
    fmt = detect_format(cache)
    pages = check_cache(cache, fmt)
    device = cache_device(cache)
    if not isinstance(keys, Tensor) or keys.dtype not in _KEY_DTYPES:
        raise TypeError(f"keys: expected a bf16/fp16/fp32 tensor, got {_describe(keys)}")
    for arg, t in (("keys", keys), ("slot_mapping", slot_mapping)):
        if isinstance(t, Tensor) and (t.is_nested or t.layout != torch.strided):
            kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
            raise TypeError(f"{arg}: expected a dense (strided) tensor, got a {kind} one")
    if keys.dim() != 2 or keys.shape[1] != HEAD_DIM:
        raise ValueError(f"keys: expected shape [tokens, 128], got {list(keys.shape)}")
    if not isinstance(slot_mapping, Tensor) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise TypeError(
            f"slot_mapping: expected a torch.int32 or torch.int64 tensor, "
            f"got {_describe(slot_mapping)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != keys.shape[0]:
        raise ValueError(
            f"slot_mapping: expected shape [tokens] = [{keys.shape[0]}] (one slot per key), "
            f"got {list(slot_mapping.shape)}"
        )
    for arg, t in (("keys", keys), ("slot_mapping", slot_mapping)):
        if t.device != device:
            raise ValueError(
                f"{arg}: expected a tensor on the cache's device {device}, got {t.device}"
            )
    return fmt, pages, keys, slot_mapping


def write_keys(index_cache: Cache, keys: Tensor, slot_mapping: Tensor) -> None:
    """Store ``keys`` at ``slot_mapping``'s slots of ``index_cache``, quantized for its format.

    Args:
        index_cache: a cache of any format, in any form :func:`check_cache` accepts (a
            page-major nvfp4 tensor of either shape, a slice of a larger pool, or the
            ``(packed, scales)`` pair, e.g. ``nvfp4_views(cache, layout="interleaved")``); the
            format is inferred as :func:`detect_format` does. Written in place.
        keys: bf16/fp16/fp32 ``[tokens, 128]``, on the cache's device.
        slot_mapping: int32/int64 ``[tokens]``: key ``i`` goes to page ``s // 128``, token
            ``s % 128`` for ``s = slot_mapping[i]``. A negative slot skips the key, leaving its
            bytes untouched. Each slot should appear at most once (else which key lands there
            is unspecified).

    Encoding: exactly :func:`quantize`'s (bf16 cast; fp8 clamp to +-448 then round to nearest
    even; nvfp4 per 16 elements ``scale = max(e4m3(max(amax, 1e-12) / 6), 2**-9)``, codes e2m1
    of ``x / scale``, ties to the even code, saturating at +-6, never -0).

    On the CPU, non-finite keys and a slot >= ``pages * 128`` raise ``ValueError`` before
    anything is written. On a GPU, shapes, dtypes and devices are checked on the host and one
    fused kernel writes on the current stream, with no host synchronization (so a write can
    be captured in a CUDA graph); keys must be finite, and a slot >= ``pages * 128`` is
    skipped and recorded in the device's write error word, which :func:`check_writes` raises
    as :class:`~cpindex.errors.BadSlotError`.
    """
    fmt, pages, keys, slot_mapping = _check_write(index_cache, keys, slot_mapping)
    if keys.shape[0] == 0:
        return
    if keys.device.type != "cpu":
        _write_on_device(index_cache, fmt, keys, slot_mapping)
        return
    _check_finite(keys)
    slots = slot_mapping.long()
    capacity = pages * PAGE_TOKENS
    bad = (slots >= capacity).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"slot_mapping: token {i} has slot {int(slots[i])}, outside the cache's {capacity} "
            f"slots (pages * 128 = {pages} * 128); nothing was written"
        )
    keep = slots >= 0
    slots = slots[keep]
    stored, scales = _encode(keys[keep], fmt)
    page, token = slots // PAGE_TOKENS, slots % PAGE_TOKENS
    dst, dst_scales = _key_bytes(index_cache, fmt)
    dst[page, token] = stored
    if dst_scales is not None:
        dst_scales[page, token] = scales


_monitors: dict[torch.device, ErrorMonitor] = {}
_monitors_lock = threading.Lock()


def _device(device: torch.device | str | int | None) -> torch.device:
    if device is None or isinstance(device, int):
        index = torch.cuda.current_device() if device is None else device
        return torch.device("cuda", index)
    dev = torch.device(device)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, torch.cuda.current_device())
    return dev


def _write_monitor(device: torch.device) -> ErrorMonitor:
    """The error word of ``device``'s writes (created with the first write there)."""
    with _monitors_lock:
        monitor = _monitors.get(device)
        if monitor is None:
            from .kernels.launcher import ErrorMonitor

            monitor = _monitors[device] = ErrorMonitor(device, 0)
        return monitor


def _write_on_device(cache: Cache, fmt: str, keys: Tensor, slot_mapping: Tensor) -> None:
    from .kernels import KernelUnavailable, load, structs
    from .kernels.launcher import cache_parts

    mod = load(keys.device)
    if not hasattr(mod, "write_keys"):
        raise KernelUnavailable(
            "write_keys: the kernel module built for this device has no write_keys binding"
        )
    monitor = _write_monitor(keys.device)
    # The binding takes rows with stride 1 that start 16-byte aligned, and int64 slots.
    row_bytes = keys.stride(0) * keys.element_size()
    if keys.stride(1) != 1 or row_bytes % 16 or keys.data_ptr() % 16:
        keys = keys.clone(memory_format=torch.contiguous_format)
    slots = slot_mapping.to(torch.int64).contiguous()
    kv, ks = cache_parts(cache)
    mod.write_keys(
        keys,
        slots,
        kv,
        ks,
        structs.FORMAT_IDS[fmt],
        monitor.device_ptr,
        monitor.host_device_ptr,
    )


def check_writes(device: torch.device | str | int | None = None) -> None:
    """Raise :class:`~cpindex.errors.BadSlotError` if a :func:`write_keys` on ``device`` (the
    current CUDA device by default) met a slot past its cache since the last check.

    Reads host memory only (the kernel mirrors its error word there), so it costs no device
    sync. The first bad slot is reported, once: raising clears the word (after a device
    synchronize, outside graph capture), so later writes report their own. A no-op on the
    CPU, where :func:`write_keys` raises at once.
    """
    if not _monitors:  # no GPU write yet (always so on a CPU-only machine)
        return
    dev = _device(device)
    if dev.type == "cpu":
        return
    monitor = _monitors.get(dev)
    if monitor is None:
        return
    try:
        monitor.check()
    except CPIndexError:
        if not torch.cuda.is_current_stream_capturing():
            monitor.reset()
        raise
