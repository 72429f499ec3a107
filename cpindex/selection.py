"""Top-k block selection on packed (score, block id) keys (docs/contract.md §6).

A candidate is one int64 key: the score's float32 bits made order-preserving in the high 32 bits,
``0xFFFFFFFF - block_id`` in the low 32. Comparing keys compares scores first and, between equal
scores, prefers the lower block id, so one ``torch.topk`` over keys gives the contract's order with
deterministic ties, and a candidate travels between ranks as one 8-byte word.

Everything here is torch ops with static shapes (no host syncs), so it runs inside CUDA graphs and
on the CPU alike. The pure oracle is :func:`cpindex.reference.select_blocks`.
"""

from __future__ import annotations

import torch

from .config import CPIndexConfig
from .memo import Memo

_LOW = 1 << 32
_MASK = _LOW - 1
#: Fills slots that hold no candidate (padding, columns past ``width``); below every real key.
FILLER = -(1 << 63)
#: Keys below this one carry a ``-inf`` score (or are FILLER): never selected.
_PAD_BELOW = (-0x00800000 ^ 0x7FFFFFFF) * _LOW + _LOW  # ordered bits of -inf, plus one
#: The id the ascending re-sort gives a padded slot, so padding lands after every real id.
_PAD_ID = 0x7FFFFFFF
_NEG_INF_BITS = 0xFF800000


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """int32 float bits (held in int64) -> int64 whose signed order is the floats' order.
    Negative floats have their magnitude bits flipped; the map is its own inverse."""
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def pack(
    scores: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Keys of float32 ``scores [..., n]`` at block ``ids`` (int64, broadcastable, in
    ``[0, 2**31)``); where ``valid`` is False the key is :data:`FILLER`. Returns int64
    ``[..., n]``."""
    # -0.0 and +0.0 are equal scores: give them one key so their tie goes to the lower id.
    s = torch.where(scores == 0, torch.zeros_like(scores), scores)
    hi = _ordered(s.view(torch.int32).to(torch.int64))
    key = hi * _LOW + (_MASK - ids)
    return key if valid is None else torch.where(valid, key, torch.full_like(key, FILLER))


def top_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest keys along the last dim (in no particular order), :data:`FILLER`-padded
    when there are fewer than ``k``: int64 ``[..., k]``."""
    n = keys.shape[-1]
    if n > k:
        return keys.topk(k, dim=-1, sorted=False).values
    if n == k:
        return keys
    pad = keys.new_full((*keys.shape[:-1], k - n), FILLER)
    return torch.cat([keys, pad], dim=-1)


def finish(best: torch.Tensor, ids_out: torch.Tensor, scores_out: torch.Tensor) -> None:
    """Writes the selected keys ``best`` (int64 ``[..., k]``, any order) as the contract's
    result: block ids ascending with ``-1`` padding after them (int32 ``ids_out``) and their
    scores aligned (float32 ``scores_out``, ``-inf`` where padded). Outputs are ``[..., k]``."""
    pad = best < _PAD_BELOW
    hi = torch.div(best, _LOW, rounding_mode="floor")
    block = _MASK - (best & _MASK)
    bits = _ordered(hi) & _MASK  # the float's raw bits, as an unsigned 32-bit value
    # Re-key by (block id, score bits): one more top-k over k keys sorts ascending by id.
    key = torch.where(pad, _PAD_ID, block) * _LOW + torch.where(pad, _NEG_INF_BITS, bits)
    key = key.topk(key.shape[-1], dim=-1, largest=False, sorted=True).values
    block = torch.div(key, _LOW, rounding_mode="floor")
    ids_out.copy_(torch.where(block == _PAD_ID, -1, block))
    bits = key & _MASK
    scores_out.view(torch.int32).copy_(torch.where(bits >= 1 << 31, bits - _LOW, bits))


def select(
    scores: torch.Tensor, topk: int, ids_out: torch.Tensor, scores_out: torch.Tensor
) -> None:
    """Selection from full score rows: float32 ``scores [..., width]`` (column = block id) into
    ``ids_out``/``scores_out`` ``[..., topk]`` (see :func:`finish`)."""
    ids = torch.arange(scores.shape[-1], device=scores.device)
    finish(top_keys(pack(scores, ids), topk), ids_out, scores_out)


class Outputs:
    """The result buffers of ``select_blocks``, sized once from the config's bounds; each call
    returns ``[heads_per_rank, rows, topk]`` views of them, valid until the next call."""

    def __init__(self, cfg: CPIndexConfig, heads_per_rank: int, device: torch.device) -> None:
        n = heads_per_rank * cfg.max_rows * cfg.max_topk
        self.heads_per_rank = heads_per_rank
        self._ids = torch.empty(n, dtype=torch.int32, device=device)
        self._scores = torch.empty(n, dtype=torch.float32, device=device)
        self._views: Memo[tuple[torch.Tensor, torch.Tensor]] = Memo()

    def views(self, rows: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh aliases of the views for this size (made once per size): a caller that
        changes a returned tensor's metadata in place changes nothing a later call returns."""
        got = self._views.get((rows, topk))
        if got is None:
            shape = (self.heads_per_rank, rows, topk)
            n = shape[0] * rows * topk
            got = self._views.put(
                (rows, topk), (self._ids[:n].view(shape), self._scores[:n].view(shape))
            )
        return got[0].detach(), got[1].detach()


def score_bytes(cfg: CPIndexConfig, world: int, rows: int, width: int) -> int:
    """Bytes one rank sends its peers in a ``score_push`` score exchange: its share of every
    column (``ceil(width / W)``) of every row, float32, for each head a peer owns."""
    hpr = cfg.heads_per_rank(world)
    return (world - 1) * hpr * rows * (-(-width // world)) * 4


def candidate_bytes(cfg: CPIndexConfig, world: int, rows: int, topk: int) -> int:
    """Bytes one rank sends its peers in a ``select_blocks`` candidate exchange: ``topk``
    8-byte (score, block id) keys per row for each head a peer owns. Independent of width."""
    hpr = cfg.heads_per_rank(world)
    return (world - 1) * hpr * rows * topk * 8
