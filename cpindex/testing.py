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
    fmt: str  # bf16 | fp8 | nvfp4
    query_len: int = 1
    form: str = "page_major"  # how an nvfp4 cache is handed over: one of NVFP4_FORMS

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
        """The problem on ``device``; an nvfp4 cache keeps its form (strides included)."""
        cache = self.index_cache
        if self.fmt == "nvfp4" and self.form != "page_major":
            moved = nvfp4_form(formats.to_page_layout(cache).to(device), self.form)
        elif isinstance(cache, tuple):
            moved = (cache[0].to(device), cache[1].to(device))
        else:
            moved = cache.to(device)
        return Problem(
            self.q.to(device),
            moved,
            self.block_table.to(device),
            self.seq_lens.to(device),
            self.width,
            self.fmt,
            self.query_len,
            self.form,
        )


#: The forms a test (or the benchmark) hands an nvfp4 cache over in, all read in place:
#: ``page_major`` uint8 [pages, 9216]; ``page_major_3d`` uint8 [pages, 128, 72], the same bytes;
#: ``pool`` page-major [pages, 128, 72] pages inside a larger pool (a spare page in front and 64
#: spare bytes after each page, all random); ``pair`` contiguous (packed, scales e4m3);
#: ``interleaved`` the pair views ``(c[..., :64], c[..., 64:])`` of a token-interleaved uint8
#: [pages, 128, 72] cache ``c``. Format names ``"nvfp4-<form>"`` name them in tests and benchmarks.
NVFP4_FORMS = ("page_major", "page_major_3d", "pool", "pair", "interleaved")


def split_format(name: str) -> tuple[str, str]:
    """``"nvfp4-pool"`` -> ``("nvfp4", "pool")``; a bare format has form ``"page_major"``."""
    fmt, _, form = name.partition("-")
    form = form or "page_major"
    if fmt not in formats.BYTES_PER_TOKEN or (form != "page_major" and fmt != "nvfp4"):
        raise ValueError(f"unknown cache format {name!r}")
    if form not in NVFP4_FORMS:
        raise ValueError(f"unknown nvfp4 form {form!r} in {name!r}; expected one of {NVFP4_FORMS}")
    return fmt, form


def nvfp4_form(cache: formats.Cache, form: str) -> formats.Cache:
    """A copy of an nvfp4 cache, in ``form`` (one of ``NVFP4_FORMS``), on its device."""
    pages = formats.check_cache(cache, "nvfp4")
    page_major = formats.to_page_layout(cache)  # [pages, 9216]
    if form == "page_major":
        return page_major
    if form == "page_major_3d":
        return page_major.view(pages, formats.PAGE_TOKENS, formats.NVFP4_TOKEN_BYTES)
    if form == "pool":
        dev = page_major.device
        g = torch.Generator(device=dev).manual_seed(pages)
        shape = (pages + 1, formats.NVFP4_PAGE_BYTES + 64)
        pool = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8, device=dev)
        pool[1:, : formats.NVFP4_PAGE_BYTES] = page_major
        return pool[1:, : formats.NVFP4_PAGE_BYTES].view(
            pages, formats.PAGE_TOKENS, formats.NVFP4_TOKEN_BYTES
        )
    if form == "pair":
        return formats.to_nvfp4_pair(cache)
    if form == "interleaved":
        c = formats.to_page_layout(cache, "interleaved").view(
            pages, formats.PAGE_TOKENS, formats.NVFP4_TOKEN_BYTES
        )
        return formats.nvfp4_views(c, layout="interleaved")
    raise ValueError(f"form must be one of {NVFP4_FORMS}, got {form!r}")


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
    spare_pages: int = 3,
    device: torch.device | str = "cpu",
) -> Problem:
    """A random problem of ``requests`` requests with ragged causal lengths up to ``max_len``
    tokens (at least ``query_len``), each scoring ``query_len`` query rows.

    Keys are RMS-normed like MiniMax-M3's index keys, queries are O(1); both are quantized to
    ``fmt``: ``bf16``, ``fp8``, ``nvfp4`` or ``nvfp4-<form>`` (a form of ``NVFP4_FORMS``).
    ``width`` defaults to the blocks the longest request needs.
    """
    fmt, form = split_format(fmt)
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
    table = torch.randperm(pages, generator=g)[: rows * max_blocks].view(rows, max_blocks)
    q = torch.randn(rows * query_len, num_heads, formats.HEAD_DIM, generator=g) * 2.0
    q = q.to(formats.query_dtype(fmt))
    prob = Problem(q, cache, table.to(torch.int32), lens, width or max_blocks, fmt, query_len)
    prob.form = form  # to() builds the form on the device (a copy would lose its strides)
    return prob.to(device)
