"""Input checks of ``score_push``: the one place they live, run before anything is launched.

Transports trust what reaches them. Shape, dtype, device and size checks are host-only and run
on every call. Checks that read tensor *contents* (``width`` and ``block_table`` wide enough for
the longest row, page indices inside the cache) run here only when the tensors are on the CPU,
where they are free. On a GPU they would cost a device sync per call and break graph capture,
so the fused kernel makes them instead and records a failure in its error word, which the next
call (or :meth:`cpindex.IndexCP.check`) raises as :class:`~cpindex.BadBlockTableError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import formats
from .config import CPIndexConfig


@dataclass(frozen=True)
class Call:
    """One validated ``score_push`` call."""

    iq: torch.Tensor  # [requests * query_len, heads_per_rank, 128], contiguous
    index_cache: formats.Cache
    block_table: torch.Tensor  # [requests, max_blocks]
    seq_lens: torch.Tensor  # [requests]
    init_blocks: int
    local_blocks: int
    width: int
    query_len: int = 1

    @property
    def rows(self) -> int:
        """Query rows: ``requests * query_len``."""
        return self.iq.shape[0]

    @property
    def requests(self) -> int:
        return self.block_table.shape[0]


def _desc(t: torch.Tensor) -> str:
    return f"{t.dtype} {list(t.shape)} on {t.device}"


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _count(name: str, v: object, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected {bound}, got {v}")
    return v


def _on(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {_desc(t)}")


def _aligned(name: str, t: torch.Tensor, *, pages: bool = False) -> None:
    """The kernel reads 16 bytes at a time: a view that starts (or, for a cache, whose pages
    start) off a 16-byte boundary would fault on the GPU, so it is refused here."""
    if t.data_ptr() % 16:
        raise ValueError(
            f"{name}: data must start on a 16-byte boundary (the kernel reads 16 bytes at a "
            f"time); this view starts {t.data_ptr() % 16} bytes past one"
        )
    if pages and t.dim() > 1 and t.shape[0] > 1 and t.stride(0) * t.element_size() % 16:
        raise ValueError(
            f"{name}: pages must be a multiple of 16 bytes apart (the kernel reads 16 bytes "
            f"at a time), got a page stride of {t.stride(0) * t.element_size()} bytes"
        )


def _nvfp4_tokens_aligned(cache: formats.Cache) -> None:
    """The kernel reads a token's nvfp4 values 8 or 16 bytes at a time (16 when tokens lie a
    multiple of 16 bytes apart, as in a page-major cache; else 8, as in the pair views of a
    token-interleaved cache's 72-byte tokens) and its two scales of a lane as one 2-byte word.
    A page-major tensor always passes (token strides 64 and 8); only a pair can fail."""
    values, scales = formats.nvfp4_views(cache, checked=True)
    pair = isinstance(cache, tuple)
    if values.stride(1) % 8:
        raise ValueError(
            f"{'index_cache[0]' if pair else 'index_cache'}: nvfp4 value tokens must lie a "
            f"multiple of 8 bytes apart (the kernel reads them 8 or 16 bytes at a time), got a "
            f"token stride of {values.stride(1)} bytes"
        )
    if scales.stride(1) % 2:
        raise ValueError(
            f"{'index_cache[1]' if pair else 'index_cache'}: nvfp4 scale tokens must lie an "
            f"even number of bytes apart (the kernel reads two scales as one 2-byte word), got "
            f"a token stride of {scales.stride(1)} bytes"
        )


def check_call(
    cfg: CPIndexConfig,
    heads_per_rank: int,
    device: torch.device,
    iq: object,
    index_cache: object,
    block_table: object,
    seq_lens: object,
    init_blocks: object,
    local_blocks: object,
    width: object,
    query_len: object = 1,
) -> Call:
    """Validates one call; raises ``TypeError``/``ValueError`` naming the argument."""
    query_len = _count("query_len", query_len, 1, cfg.max_query_len)
    iq = _tensor("iq", iq)
    qdt = formats.query_dtype(cfg.cache_format)
    if iq.dtype != qdt:
        raise TypeError(
            f"iq: expected {qdt} for cache_format '{cfg.cache_format}', got {_desc(iq)}"
        )
    given = iq
    if iq.dim() == 2 and heads_per_rank == 1:
        iq = iq.unsqueeze(1)
    if iq.dim() != 3 or iq.shape[1:] != (heads_per_rank, cfg.head_dim):
        raise ValueError(
            f"iq: expected [rows, {heads_per_rank}, {cfg.head_dim}]"
            + (f" or [rows, {cfg.head_dim}]" if heads_per_rank == 1 else "")
            + f", got {_desc(given)}"
        )
    if not iq.is_contiguous():
        raise ValueError(f"iq: expected a contiguous tensor, got strides {iq.stride()}")
    _on("iq", iq, device)
    _aligned("iq", iq)
    rows = iq.shape[0]
    if not 1 <= rows <= cfg.max_rows:
        raise ValueError(f"iq: rows must be in [1, max_rows={cfg.max_rows}], got {rows}")
    if rows % query_len:
        raise ValueError(
            f"iq: rows must be requests * query_len (query_len={query_len}), got {rows} rows"
        )
    requests = rows // query_len

    if not isinstance(index_cache, (torch.Tensor, tuple)):
        raise TypeError(
            f"index_cache: expected a tensor (or a (packed, scales) pair for nvfp4), "
            f"got {type(index_cache).__name__}"
        )
    formats.check_cache(index_cache, cfg.cache_format)
    for k, part in enumerate(index_cache if isinstance(index_cache, tuple) else (index_cache,)):
        name = "index_cache" if not isinstance(index_cache, tuple) else f"index_cache[{k}]"
        _on(name, part, device)
        _aligned(name, part, pages=True)
    if cfg.cache_format == "nvfp4":
        _nvfp4_tokens_aligned(index_cache)

    block_table = _tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(
            f"block_table: expected torch.int32 [rows, max_blocks], got {_desc(block_table)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != requests or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table: expected torch.int32 [{requests}, max_blocks >= 1] (one row per "
            f"request: iq's {rows} rows / query_len {query_len}), got {_desc(block_table)}"
        )
    if block_table.stride(1) != 1:
        raise ValueError(
            f"block_table: rows must be contiguous, got strides {block_table.stride()}"
        )
    _on("block_table", block_table, device)

    seq_lens = _tensor("seq_lens", seq_lens)
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"seq_lens: expected torch.int32 [{requests}], got {_desc(seq_lens)}")
    if seq_lens.shape != (requests,):
        raise ValueError(
            f"seq_lens: expected torch.int32 [{requests}] (one length per request), "
            f"got {_desc(seq_lens)}"
        )
    if not seq_lens.is_contiguous():
        raise ValueError(
            f"seq_lens: expected a contiguous tensor, got strides {list(seq_lens.stride())}"
        )
    _on("seq_lens", seq_lens, device)

    init_blocks = _count("init_blocks", init_blocks, 0)
    local_blocks = _count("local_blocks", local_blocks, 0)
    # Forcing counts past max_width (at most 2**20) force nothing more; bounding them keeps
    # every count the kernel receives inside its C int (rows <= max_rows <= 65536 likewise).
    for name, v in (("init_blocks", init_blocks), ("local_blocks", local_blocks)):
        if v > cfg.max_width:
            raise ValueError(f"{name}: expected <= max_width ({cfg.max_width}), got {v}")
    width = _count("width", width, 1, cfg.max_width)

    if seq_lens.device.type == "cpu":
        _check_contents(
            cfg, index_cache, block_table, seq_lens, init_blocks, local_blocks, width, query_len
        )
    return Call(iq, index_cache, block_table, seq_lens, init_blocks, local_blocks, width, query_len)


def check_topk(cfg: CPIndexConfig, topk: object, return_scores: object = False) -> int:
    """Validates ``select_blocks``' own arguments; raises ``TypeError``/``ValueError`` naming
    them. ``topk`` is bounded by ``config.max_topk``, which sized the result buffers."""
    topk = _count("topk", topk, 1)
    if topk > cfg.max_topk:
        raise ValueError(f"topk: expected in [1, config.max_topk={cfg.max_topk}], got {topk}")
    if not isinstance(return_scores, bool):
        raise TypeError(f"return_scores: expected a bool, got {type(return_scores).__name__}")
    return topk


def _check_contents(
    cfg: CPIndexConfig,
    index_cache: formats.Cache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    init_blocks: int,
    local_blocks: int,
    width: int,
    query_len: int,
) -> None:
    """Checks that read CPU tensors' contents (see the module docstring)."""
    short = (seq_lens < query_len).nonzero()
    if short.numel():
        r = int(short[0, 0])
        raise ValueError(
            f"seq_lens: request {r} has length {int(seq_lens[r])}, but each request's length "
            f"counts its own query tokens, so it must be >= query_len ({query_len})"
        )
    longest = int(seq_lens.max())
    need = -(-longest // cfg.block_size)
    if need > width:
        raise ValueError(
            f"width: the longest row ({longest} tokens) needs {need} columns, got width={width}"
        )
    if need > block_table.shape[1]:
        raise ValueError(
            f"block_table: the longest row ({longest} tokens) needs {need} blocks, "
            f"got max_blocks={block_table.shape[1]}"
        )
    pages = (index_cache[0] if isinstance(index_cache, tuple) else index_cache).shape[0]
    n = (seq_lens.to(torch.int64) + cfg.block_size - 1) // cfg.block_size
    j = torch.arange(block_table.shape[1])
    scanned = (j < (n - local_blocks).unsqueeze(1)) & (j >= init_blocks)
    used = block_table[scanned]
    bad = (used < 0) | (used >= pages)
    if bad.any():
        row, col = scanned.nonzero()[bad.nonzero()[0, 0]].tolist()
        raise ValueError(
            f"block_table: row {row}, block {col} names page {int(block_table[row, col])}, "
            f"outside index_cache's {pages} pages"
        )
