"""Index-key cache layouts: what a bf16, fp8 or nvfp4 cache argument looks like, its checks, and
the zero-copy views of nvfp4 pages. Pure data: no kernel, no quantizer (:mod:`cpindex.quant`).
Users reach all of it through :mod:`cpindex.formats`, whose docstring describes the layouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeAlias

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
NVFP4_TOKEN_BYTES = NVFP4_TOKEN_VALUE_BYTES + NVFP4_TOKEN_SCALES  # 72
NVFP4_LAYOUTS = ("page_major", "pair")
BYTES_PER_TOKEN = {"bf16": 256, "fp8": 128, "nvfp4": 72}

Cache: TypeAlias = Tensor | tuple[Tensor, Tensor]
"""A cache argument: one tensor, or the nvfp4 ``(packed, scales)`` pair."""

_GROUPS = NVFP4_TOKEN_SCALES
_ROW_BYTES = NVFP4_TOKEN_VALUE_BYTES

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
