"""Random decode problems for tests, the demo and the benchmark (never zeros: real data only).

Pages are scattered: every row's blocks map to a random permutation of the cache's pages, so a
kernel that assumed contiguous or ordered pages fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import formats, partition


@dataclass
class Problem:
    """One decode step: all heads' queries and the shared cache."""

    q: torch.Tensor  # [requests * query_len, H, 128] in the format's query dtype
    index_cache: formats.Cache
    block_table: torch.Tensor  # int32 [requests, max_blocks]
    seq_lens: torch.Tensor  # int32 [requests], through each request's last query token
    width: int
    fmt: str
    query_len: int = 1

    @property
    def rows(self) -> int:
        """Query rows: ``requests * query_len``."""
        return self.q.shape[0]

    @property
    def requests(self) -> int:
        return self.block_table.shape[0]

    def rank_queries(self, rank: int, world: int) -> torch.Tensor:
        """What rank ``rank`` passes to ``score_push``: its heads' rows ``[rows, hpr, 128]``."""
        heads = partition.heads_of_rank(rank, self.q.shape[1], world)
        # a slice, not a list index: no host-to-device index copy (which would sync the stream)
        return self.q[:, heads[0] : heads[-1] + 1].contiguous()

    def to(self, device: torch.device | str) -> Problem:
        cache = self.index_cache
        moved = tuple(t.to(device) for t in cache) if isinstance(cache, tuple) else cache.to(device)
        return Problem(
            self.q.to(device),
            moved,  # type: ignore[arg-type]
            self.block_table.to(device),
            self.seq_lens.to(device),
            self.width,
            self.fmt,
            self.query_len,
        )


def random_lengths(
    rows: int, max_len: int, generator: torch.Generator, *, min_len: int = 1
) -> torch.Tensor:
    """Ragged lengths in ``[min_len, max_len]``; includes ``max_len`` (and ``min_len`` if
    rows > 2)."""
    lens = torch.randint(min_len, max_len + 1, (rows,), generator=generator)
    lens[0] = max_len
    if rows > 2:
        lens[1] = min_len
    return lens.to(torch.int32)


def make_problem(
    requests: int,
    max_len: int,
    fmt: str = "nvfp4",
    *,
    query_len: int = 1,
    num_heads: int = 4,
    seed: int = 0,
    lengths: torch.Tensor | None = None,
    width: int | None = None,
    nvfp4_pair: bool = False,
    spare_pages: int = 3,
    device: torch.device | str = "cpu",
) -> Problem:
    """A random problem of ``requests`` requests with ragged causal lengths up to ``max_len``
    tokens (at least ``query_len``), each scoring ``query_len`` query rows.

    Keys are RMS-normed like MiniMax-M3's index keys, queries are O(1); both are quantized to
    ``fmt``. ``width`` defaults to the blocks the longest request needs.
    """
    rows = requests
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lens = random_lengths(rows, max(max_len, query_len), g, min_len=query_len)
    else:
        lens = lengths.to(torch.int32).cpu()
    max_blocks = max(1, -(-int(lens.max()) // formats.PAGE_TOKENS))
    pages = rows * max_blocks + spare_pages
    keys = torch.randn(pages, formats.PAGE_TOKENS, formats.HEAD_DIM, generator=g)
    keys = keys / keys.pow(2).mean(-1, keepdim=True).sqrt()
    cache: formats.Cache = formats.quantize(keys, fmt)
    if nvfp4_pair:
        cache = formats.to_nvfp4_pair(cache)
    table = torch.randperm(pages, generator=g)[: rows * max_blocks].view(rows, max_blocks)
    q = torch.randn(rows * query_len, num_heads, formats.HEAD_DIM, generator=g) * 2.0
    q = q.to(formats.query_dtype(fmt))
    prob = Problem(q, cache, table.to(torch.int32), lens, width or max_blocks, fmt, query_len)
    return prob.to(device)
