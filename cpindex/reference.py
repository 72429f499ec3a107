"""The pure-torch oracle of docs/contract.md §3: every other path is tested against it.

Written to be obviously right: dequantize the pages a row uses, compute every dot product in
float64, mask tokens at or past the row's causal length, take the max per block, then apply the
forcing rules in the contract's order. Rows are processed in chunks so 64 rows x 32K tokens
stays within a few hundred MB on a CPU. NaN inputs are the caller's bug, but their result is
defined (a NaN dot product never wins) and is the GPU kernel's.
"""

from __future__ import annotations

import torch

from . import formats

FORCED_LOCAL = 1e29
FORCED_INIT = 1e30
_CHUNK_ELEMS = 1 << 25  # keys of one chunk, in elements (256 MB of float64)


def _page_keys(index_cache: formats.Cache, fmt: str, pages: torch.Tensor) -> torch.Tensor:
    """Keys of the given pages as float64 ``[len(pages), 128, 128]``."""
    if fmt == "nvfp4" and isinstance(index_cache, tuple):
        sel: formats.Cache = (index_cache[0][pages], index_cache[1][pages])
    else:
        sel = index_cache[pages]  # type: ignore[index]
    return formats.dequantize(sel, fmt).double()


def block_scores(
    q: torch.Tensor,
    index_cache: formats.Cache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    init_blocks: int,
    local_blocks: int,
    width: int,
    sm_scale: float = 128**-0.5,
    columns: torch.Tensor | None = None,
    query_len: int = 1,
) -> torch.Tensor:
    """Scores of every head over blocks ``columns`` (default: all ``width`` columns).

    Args:
        q: ``[rows, H, 128]`` (or ``[rows, 128]``) queries, bf16 / fp8 e4m3 / float;
            ``rows = requests * query_len``, request-major (token t of request r is row
            ``r * query_len + t``).
        index_cache: a cache in any layout :func:`cpindex.formats.detect_format` accepts.
        block_table: int ``[requests, max_blocks]``; request r's block j is page
            ``block_table[r, j]``.
        seq_lens: int ``[requests]`` causal lengths through each request's last query token;
            token t of request r sees ``seq_lens[r] - query_len + 1 + t`` keys (so
            ``seq_lens[r] >= query_len``).
        init_blocks, local_blocks: forced-selection counts.
        width: number of score columns.
        sm_scale: positive scale applied to every dot product.
        columns: optional int ``[C]`` subset of ``range(width)`` to compute.
        query_len: query tokens per request (speculative/MTP decode), ``T`` above.

    Returns:
        float32 ``[H, rows, C]`` on ``q``'s device: ``-inf`` past the context, ``1e29`` for
        local blocks, ``1e30`` for init blocks, else the max scaled dot product over the
        block's tokens before the row's causal length.
    """
    fmt = formats.detect_format(index_cache)
    qf = q.double() if q.dim() == 3 else q.double().unsqueeze(1)
    rows, heads, dim = qf.shape
    device = qf.device
    cols = torch.arange(width) if columns is None else columns.to(torch.int64).cpu()
    n_cols = cols.numel()
    t = query_len
    if t < 1 or rows != block_table.shape[0] * t or seq_lens.shape != (block_table.shape[0],):
        raise ValueError(
            f"q: expected requests * query_len = {block_table.shape[0]} * {t} rows and seq_lens "
            f"[{block_table.shape[0]}], got {rows} rows and seq_lens {list(seq_lens.shape)}"
        )
    if bool((seq_lens < t).any()):
        raise ValueError(f"seq_lens: every request's length must be >= query_len ({t})")
    # One row per query token: its request's pages, its own causal length.
    tok_of_row = torch.arange(rows) % t
    lens = seq_lens.to(torch.int64).cpu().repeat_interleave(t) - (t - 1) + tok_of_row
    table = block_table.to(torch.int64).cpu().repeat_interleave(t, dim=0)
    n_blocks = (lens + formats.PAGE_TOKENS - 1) // formats.PAGE_TOKENS
    out = torch.full((heads, rows, n_cols), float("-inf"), dtype=torch.float64)

    # Only blocks that are neither forced nor past the context are scanned.
    j = cols.unsqueeze(0).expand(rows, n_cols)
    n = n_blocks.unsqueeze(1)
    scanned = (j < n - local_blocks) & (j >= init_blocks)
    tok = torch.arange(formats.PAGE_TOKENS)
    per_chunk = max(1, _CHUNK_ELEMS // max(1, n_cols * formats.PAGE_TOKENS * dim))
    for r0 in range(0, rows, per_chunk):
        r1 = min(rows, r0 + per_chunk)
        ri, ci = scanned[r0:r1].nonzero(as_tuple=True)
        if ri.numel() == 0:
            continue
        ri = ri + r0
        jj = cols[ci]
        keys = _page_keys(index_cache, fmt, table[ri, jj].to(device))  # [S, 128 tok, 128]
        dots = torch.einsum("shd,std->sht", qf[ri.to(device)], keys)  # [S, H, 128 tok]
        valid = (jj.unsqueeze(1) * formats.PAGE_TOKENS + tok) < lens[ri].unsqueeze(1)
        # A NaN product never wins (docs/design.md, NaN and Inf): the kernel's running max
        # (fmaxf from -inf) drops NaN operands, so here a NaN dot counts like a key past the
        # context, and a block whose dots are all NaN scores -inf.
        dots = dots.masked_fill(~valid.to(device).unsqueeze(1) | dots.isnan(), float("-inf"))
        out[:, ri, ci] = (dots.amax(dim=2) * sm_scale).T.cpu()

    # Forcing, in the contract's order (§3): local blocks are tested first, then init blocks.
    init = (j < init_blocks) & (j < n)
    local = (j >= n - local_blocks) & (j < n)
    out[:, init] = FORCED_INIT
    out[:, local] = FORCED_LOCAL
    out[:, j >= n] = float("-inf")
    return out.float().to(device)


def select_blocks(
    q: torch.Tensor,
    index_cache: formats.Cache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    init_blocks: int,
    local_blocks: int,
    width: int,
    sm_scale: float = 128**-0.5,
    query_len: int = 1,
    topk: int = 16,
    return_scores: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The selection of docs/contract.md §6, from :func:`block_scores` (same arguments).

    Per (head, row): the ``topk`` columns with the highest scores, forced blocks included and
    ``-inf`` columns never; equal scores go to the lower block id. Written to be obviously right:
    a stable sort by descending score keeps equal scores in ascending id order.

    Returns:
        int32 ``[H, rows, topk]``: the selected block ids in ascending order, then ``-1`` for
        each slot left when the row has fewer than ``topk`` blocks in its context. With
        ``return_scores``, also float32 ``[H, rows, topk]``: each id's score, ``-inf`` where
        padded.
    """
    if topk < 1:
        raise ValueError(f"topk: expected >= 1, got {topk}")
    scores = block_scores(
        q, index_cache, block_table, seq_lens, init_blocks=init_blocks,
        local_blocks=local_blocks, width=width, sm_scale=sm_scale, query_len=query_len,
    )  # fmt: skip
    k = min(topk, width)
    order = torch.sort(-scores, dim=-1, stable=True).indices[..., :k]
    vals = scores.gather(-1, order)
    chosen = vals > float("-inf")
    # ascending ids, padding (past the context) after them
    ids, perm = torch.where(chosen, order, width).sort(dim=-1, stable=True)
    vals = vals.gather(-1, perm)
    ids = torch.where(ids == width, -1, ids)
    pad = topk - k
    ids = torch.nn.functional.pad(ids, (0, pad), value=-1).to(torch.int32)
    vals = torch.nn.functional.pad(vals, (0, pad), value=float("-inf"))
    return (ids, vals) if return_scores else ids
