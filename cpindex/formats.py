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

This module is the public face: the layouts and their checks live in :mod:`cpindex.layouts`,
the number formats and the quantizer in :mod:`cpindex.quant` (both below the kernels, which
use them), the GPU writer in :mod:`cpindex.kernels.writer`; :func:`write_keys` checks a write
here and hands a GPU one to it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels.writer import check_writes, write_on_device
from .layouts import (
    BYTES_PER_TOKEN,
    HEAD_DIM,
    NVFP4_GROUP,
    NVFP4_LAYOUTS,
    NVFP4_PAGE_BYTES,
    NVFP4_PAGE_LAYOUTS,
    NVFP4_SCALE_BYTES,
    NVFP4_TOKEN_BYTES,
    NVFP4_TOKEN_SCALES,
    NVFP4_TOKEN_VALUE_BYTES,
    NVFP4_VALUE_BYTES,
    PAGE_TOKENS,
    Cache,
    Nvfp4PageLayout,
    PageLayoutArg,
    _describe,
    cache_device,
    check_cache,
    detect_format,
    nvfp4_layout,
    nvfp4_views,
    page_layout,
    query_dtype,
    to_nvfp4_pair,
    to_page_layout,
)
from .quant import (
    _KEY_DTYPES,
    E2M1_MAX,
    E4M3_MIN_SUBNORMAL,
    FP8_MAX,
    NVFP4_AMAX_FLOOR,
    _check_finite,
    _encode,
    dequantize,
    e2m1_decode,
    e2m1_encode,
    e4m3_rn_satfinite,
    quantize,
)

__all__ = [
    "BYTES_PER_TOKEN",
    "E2M1_MAX",
    "E4M3_MIN_SUBNORMAL",
    "FP8_MAX",
    "HEAD_DIM",
    "NVFP4_AMAX_FLOOR",
    "NVFP4_GROUP",
    "NVFP4_LAYOUTS",
    "NVFP4_PAGE_BYTES",
    "NVFP4_PAGE_LAYOUTS",
    "NVFP4_SCALE_BYTES",
    "NVFP4_TOKEN_BYTES",
    "NVFP4_TOKEN_SCALES",
    "NVFP4_TOKEN_VALUE_BYTES",
    "NVFP4_VALUE_BYTES",
    "PAGE_TOKENS",
    "Cache",
    "Nvfp4PageLayout",
    "PageLayoutArg",
    "cache_device",
    "check_cache",
    "check_writes",
    "dequantize",
    "detect_format",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_rn_satfinite",
    "nvfp4_layout",
    "nvfp4_views",
    "page_layout",
    "quantize",
    "query_dtype",
    "to_nvfp4_pair",
    "to_page_layout",
    "write_keys",
]

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
        write_on_device(index_cache, fmt, keys, slot_mapping)
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
