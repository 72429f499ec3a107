"""Plain Triton bf16 block scorer: the baseline the fused kernel must beat.

Straightforward on purpose: one program per (block column, row), the whole 128x128 key page is
loaded as one tile and multiplied by the (padded) query heads with ``tl.dot``. No autotuning,
no split-K, no persistent scheduling. Semantics follow docs/contract.md §2-§3.

Importing this module never fails when triton is absent; calling ``triton_block_scores`` then
raises ``RuntimeError("triton is not installed")``.
"""

from __future__ import annotations

import torch

from .. import partition

try:  # module-level guard: the benchmark imports us even where triton is missing
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

BLOCK = 128  # tokens per page / block
DIM = 128  # index head dim

__all__ = ["triton_block_scores"]


if triton is not None:

    @triton.jit
    def _block_scores_kernel(
        q_ptr,
        cache_ptr,
        bt_ptr,
        seq_lens_ptr,
        out_ptr,
        sm_scale,
        H,
        stride_qr,
        stride_qh,
        stride_cp,
        stride_btr,
        stride_oh,
        stride_or,
        world,
        rank,
        T: tl.constexpr,
        INIT_BLOCKS: tl.constexpr,
        LOCAL_BLOCKS: tl.constexpr,
        VP: tl.constexpr,
        BLOCK_T: tl.constexpr,
        D: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        j = tl.program_id(0)  # output column: block b = rank + j * world of the request
        req = tl.program_id(1)  # request: its T query rows share the page, read once
        b = rank + j * world

        offs_v = tl.arange(0, VP)  # query vector v = t * H + h
        offs_t = tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, D)
        v_ok = offs_v < T * H
        head = offs_v % H
        tok = offs_v // H
        row = req * T + tok

        seq_len = tl.load(seq_lens_ptr + req)
        n_last = (seq_len + BLOCK_T - 1) // BLOCK_T
        len_v = seq_len - (T - 1) + tok  # each row's causal length
        n_v = (len_v + BLOCK_T - 1) // BLOCK_T

        val = tl.full([VP], float("-inf"), tl.float32)
        if (b >= INIT_BLOCKS) & (b < n_last - LOCAL_BLOCKS):
            page = tl.load(bt_ptr + req.to(tl.int64) * stride_btr + b).to(tl.int64)
            k_ptrs = cache_ptr + page * stride_cp + offs_t[:, None] * D + offs_d[None, :]
            k = tl.load(k_ptrs)  # [BLOCK_T, D] bf16, token-major page
            q_ptrs = (
                q_ptr
                + row.to(tl.int64)[:, None] * stride_qr
                + head[:, None] * stride_qh
                + offs_d[None, :]
            )
            q = tl.load(q_ptrs, mask=v_ok[:, None], other=0.0)  # [VP, D] bf16
            if UPCAST:  # interpreter only: its tl.dot multiplies bf16 as raw uint16 bits
                q = q.to(tl.float32)
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k))  # [VP, BLOCK_T] fp32 accumulation
            tok_ok = (b * BLOCK_T + offs_t)[None, :] < len_v[:, None]
            s = tl.where(tok_ok, s * sm_scale, float("-inf"))
            val = tl.max(s, axis=1)
        val = tl.where(b < INIT_BLOCKS, 1e30, val)
        val = tl.where(b >= n_v - LOCAL_BLOCKS, 1e29, val)
        val = tl.where(b >= n_v, float("-inf"), val)

        out_ptrs = out_ptr + head.to(tl.int64) * stride_oh + row.to(tl.int64) * stride_or + j
        tl.store(out_ptrs, val, mask=v_ok)

    # Under TRITON_INTERPRET=1 (set before this module is imported) triton.jit returns an
    # InterpretedFunction. Triton 3.9's interpreter runs tl.dot on bf16 operands as np.matmul of
    # their uint16 storage, i.e. garbage; upcasting to fp32 there is exact (bf16 products fit fp32).
    _INTERPRETED = type(_block_scores_kernel).__name__ == "InterpretedFunction"


def triton_block_scores(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    init_blocks: int,
    local_blocks: int,
    width: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    query_len: int = 1,
    world: int = 1,
    rank: int = 0,
) -> torch.Tensor:
    """Score every 128-token block of every row; returns float32 ``[H, rows, width]``. With
    ``world > 1``, only rank ``rank``'s share of them, as a context-parallel scorer scans it:
    blocks ``rank, rank + world, ...`` of each row into columns ``0, 1, ...`` of ``[H, rows,
    ceil((width - rank) / world)]``.

    q: bf16 ``[requests * query_len, H, 128]`` (``[rows, 128]`` is taken as H = 1), request-
    major; cache: bf16 ``[pages, 128, 128]`` token-major; block_table: int32
    ``[requests, max_blocks]``; seq_lens: int32 ``[requests]`` (through each request's last
    query token). One program per (block, request) reads the page once for all
    ``query_len * H`` query vectors. Never reads ``seq_lens`` on the host (graph-capturable).
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    if q.dim() == 2:
        q = q.unsqueeze(1)
    if q.dim() != 3 or q.shape[-1] != DIM:
        raise ValueError(f"q must be [rows, H, {DIM}], got {tuple(q.shape)}")
    rows, heads, _ = q.shape
    if not 1 <= heads <= 8:
        raise ValueError(f"H must be in 1..8, got {heads}")
    if query_len < 1 or rows % query_len:
        raise ValueError(f"q rows ({rows}) must be requests * query_len ({query_len})")
    requests = rows // query_len
    if q.dtype != torch.bfloat16 or cache.dtype != torch.bfloat16:
        raise TypeError(f"q and cache must be bf16, got {q.dtype} / {cache.dtype}")
    if cache.dim() != 3 or tuple(cache.shape[1:]) != (BLOCK, DIM):
        raise ValueError(f"cache must be [pages, {BLOCK}, {DIM}], got {tuple(cache.shape)}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("block_table and seq_lens must be int32")
    if block_table.dim() != 2 or block_table.shape[0] != requests or seq_lens.shape != (requests,):
        raise ValueError("block_table must be [requests, max_blocks] and seq_lens [requests]")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if world < 1 or not 0 <= rank < world or rank >= width:
        raise ValueError(f"need 0 <= rank < world and rank < width, got {rank}, {world}, {width}")
    cols = partition.blocks_owned(width, rank, world)  # this rank's columns

    # The kernel assumes unit stride on the innermost dims; copy only when needed.
    if q.stride(-1) != 1:
        q = q.contiguous()
    if cache.stride(-1) != 1 or cache.stride(-2) != DIM:
        cache = cache.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()

    if out is None:
        out = torch.empty((heads, rows, cols), dtype=torch.float32, device=q.device)
    elif out.shape != (heads, rows, cols) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be float32 [{heads}, {rows}, {cols}] with unit last stride")
    if rows == 0:
        return out

    vp = max(16, triton.next_power_of_2(heads * query_len))  # tl.dot needs M >= 16
    _block_scores_kernel[(cols, requests)](
        q,
        cache,
        block_table,
        seq_lens,
        out,
        float(sm_scale),
        heads,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        int(world),
        int(rank),
        T=int(query_len),
        INIT_BLOCKS=int(init_blocks),
        LOCAL_BLOCKS=int(local_blocks),
        VP=vp,
        BLOCK_T=BLOCK,
        D=DIM,
        UPCAST=_INTERPRETED,
    )
    return out
