"""How each row's blocks are split over ranks (docs/contract.md §5).

Rank ``r`` of ``W`` owns logical blocks ``j = r, r + W, r + 2W, ...``: round-robin, so every
rank holds ``n // W`` or ``n // W + 1`` of a row's ``n`` blocks, and any rank knows any other
rank's share from ``(r, W)`` alone.
"""

from __future__ import annotations

import torch


def owned_columns(rank: int, world: int, width: int) -> torch.Tensor:
    """Score columns (logical block indices) rank ``rank`` computes, as int64 ``[k]``."""
    return torch.arange(min(rank, width), width, world, dtype=torch.int64)


def shard_width(width: int, world: int) -> int:
    """Columns in the largest rank's share of ``width`` columns: ``ceil(width / world)``."""
    return -(-width // world)


def blocks_owned(n: int, rank: int, world: int) -> int:
    """How many of a row's ``n`` blocks rank ``rank`` owns."""
    return max(0, -(-(n - rank) // world))


def head_owners(num_heads: int, world: int) -> list[list[int]]:
    """``owners[h]``: the ranks that receive head ``h``'s scores.

    With ``num_heads >= world`` rank ``r`` owns heads ``[r*hpr, (r+1)*hpr)``; with more ranks
    than heads, head ``h`` is replicated on ranks ``h, h + H, h + 2H, ...``.
    """
    if num_heads >= world:
        hpr = num_heads // world
        return [[h // hpr] for h in range(num_heads)]
    return [list(range(h, world, num_heads)) for h in range(num_heads)]


def heads_of_rank(rank: int, num_heads: int, world: int) -> list[int]:
    """The heads whose scores rank ``rank`` receives, in output order."""
    if num_heads >= world:
        hpr = num_heads // world
        return list(range(rank * hpr, (rank + 1) * hpr))
    return [rank % num_heads]


def scanned_blocks(
    seq_lens: torch.Tensor, rank: int, world: int, init_blocks: int, local_blocks: int
) -> int:
    """Blocks rank ``rank`` must read (owned, inside the context, not forced) over all rows."""
    n = (seq_lens.to(torch.int64).cpu() + 127) // 128
    total = 0
    for ni in n.tolist():
        lo, hi = init_blocks, max(init_blocks, ni - local_blocks)
        total += len(range(lo + (rank - lo) % world, hi, world))
    return total
