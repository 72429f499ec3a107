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
#: -inf's float bits made order-preserving (:func:`_ordered`): the lowest real score.
_ORDERED_NEG_INF = -0x00800000 ^ 0x7FFFFFFF
#: Keys below this one carry a ``-inf`` score (or are FILLER): never selected.
_PAD_BELOW = _ORDERED_NEG_INF * _LOW + _LOW
#: The id the ascending re-sort gives a padded slot, so padding lands after every real id.
_PAD_ID = 0x7FFFFFFF


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """int32 float bits -> int32 whose signed order is the floats' order. Negative floats
    have their magnitude bits flipped (``bits >> 31`` is -1 for them, else 0); the map is its
    own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def id_bits(ids: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of the keys at block ``ids`` (int64 in ``[0, 2**31)``), as int64."""
    return _MASK - ids


def pack(
    scores: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Keys of float32 ``scores [..., n]`` at block ``ids`` (int64, broadcastable, in
    ``[0, 2**31)``); where ``valid`` is False the key is :data:`FILLER`. Returns int64
    ``[..., n]``."""
    key = pack_bits(scores, id_bits(ids))
    return key if valid is None else torch.where(valid, key, FILLER)


def pack_bits(scores: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """:func:`pack` with the ids' key bits made beforehand (:func:`id_bits`): five ops."""
    # -0.0 + 0.0 is +0.0: equal scores get one key, so their tie goes to the lower id.
    hi = _ordered((scores + 0.0).view(torch.int32))
    return torch.add(low, hi, alpha=_LOW)  # in int64: hi * 2**32 + low


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
    """Writes the selected keys ``best`` (int64 ``[..., k]``, any order, last dim contiguous)
    as the contract's result: block ids ascending with ``-1`` padding after them (int32
    ``ids_out``) and their scores aligned (float32 ``scores_out``, ``-inf`` where padded).
    Outputs are ``[..., k]``."""
    # A key's 32-bit halves, little-endian: low = 0xFFFFFFFF - id, i.e. ~id as int32.
    halves = best.view(torch.int32).unflatten(-1, (-1, 2))
    pad = best < _PAD_BELOW
    ids = torch.where(pad, _PAD_ID, torch.bitwise_not(halves[..., 0]))
    # One sort by id (ids are distinct, padding last), written straight into ids_out.
    order = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
    torch.topk(ids, ids.shape[-1], largest=False, sorted=True, out=(ids_out, order))
    ids_out.masked_fill_(ids_out == _PAD_ID, -1)
    # Scores: the high halves in that order; padding (FILLER, -inf) clamped to -inf's bits.
    hi = torch.gather(halves[..., 1], -1, order).clamp_(min=_ORDERED_NEG_INF)
    torch.bitwise_xor(hi, (hi >> 31) & 0x7FFFFFFF, out=scores_out.view(torch.int32))


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
