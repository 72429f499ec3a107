"""Tests for cpindex.reference against a brute-force oracle written straight from
docs/contract.md §3."""

from __future__ import annotations

import math
import time

import pytest
import torch

from cpindex import formats, partition, reference, testing

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --------------------------------------------------------------------------- the oracle


def _e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round float64 values to e4m3 (nearest, ties to even, saturating at 448) with float64
    arithmetic alone: 3 mantissa bits below the leading one for normals (exponent >= -6), a
    fixed step of 2**-9 for subnormals. Independent of torch's fp8 cast."""
    a = x.abs()
    e = torch.floor(torch.log2(a.clamp_min(2.0**-20))).clamp_min(-6)
    step = torch.pow(2.0, e - 3)
    r = torch.round(a / step) * step  # torch.round: half to even
    return torch.copysign(r.clamp_max(448.0), x)


def _oracle_keys(cache, fmt: str) -> torch.Tensor:
    """Keys as float64 [pages, 128, 128], decoded independently of cpindex.formats (contract:
    nvfp4 keys are e4m3_rn_satfinite(e2m1 * scale))."""
    if fmt in ("bf16", "fp8"):
        return cache.double()
    if isinstance(cache, tuple):
        packed, scales = cache
    else:  # page-major, [pages, 9216] or [pages, 128, 72]: per page 8192 code bytes (64 per
        # token), then 1024 scale bytes (8 per token)
        flat = cache.reshape(-1, 9216)
        packed = flat[:, :8192].reshape(-1, 128, 64)
        scales = flat[:, 8192:].reshape(-1, 128, 8)
    scale = scales.view(torch.uint8).view(torch.float8_e4m3fn).double()  # [p, 128, 8]
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    lo = lut[(packed & 0xF).long()]  # element 2i: low nibble of byte i
    hi = lut[(packed >> 4).long()]  # element 2i + 1
    vals = torch.stack([lo, hi], dim=-1).reshape(-1, 128, 128)
    return _e4m3_round(vals * scale.repeat_interleave(16, dim=-1))


def oracle(q, cache, table, lens, *, init, local, width, sm_scale=128**-0.5, query_len=1):
    """Loop over rows and columns applying the contract's rules in the stated order, every
    head at once (each product is exact in float64, so the sums do not depend on the order)."""
    fmt = formats.detect_format(cache)
    keys = _oracle_keys(cache, fmt)
    qd = q.double() if q.dim() == 3 else q.double().unsqueeze(1)
    rows, heads, _ = qd.shape
    t = query_len
    out = torch.empty(heads, rows, width, dtype=torch.float64)
    for i in range(rows):
        r = i // t
        seq = int(lens[r]) - t + 1 + i % t  # token i % t of request r
        assert seq >= 1
        n = math.ceil(seq / 128)
        for j in range(width):
            if j >= n:
                out[:, i, j] = -math.inf
            elif j >= n - local:
                out[:, i, j] = 1e29
            elif j < init:
                out[:, i, j] = 1e30
            else:
                page = int(table[r, j])
                valid = min(128, seq - j * 128)  # tokens t of block j with t < seq
                assert valid >= 1
                dots = keys[page, :valid] @ qd[i].T  # [valid, heads]
                out[:, i, j] = dots.amax(dim=0) * sm_scale
    return out.float()


def _scores(prob, init, local, width=None, **kw):
    args = (prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    w = width or prob.width
    kw.setdefault("query_len", prob.query_len)
    got = reference.block_scores(*args, init_blocks=init, local_blocks=local, width=w, **kw)
    want = oracle(*args, init=init, local=local, width=w, **kw)
    return got, want


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32
    assert got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got, want), (got - want).abs().nan_to_num(0).max()


# --------------------------------------------------------------------------- block_scores

FORMATS = [
    "bf16", "fp8", "nvfp4", "nvfp4-page_major_3d", "nvfp4-pool", "nvfp4-pair", "nvfp4-interleaved"
]  # fmt: skip
LENGTHS = [1, 127, 128, 129, 255, 256, 300, 641, 1000]  # partial and full last blocks


def _problem(fmt: str, lengths, seed: int, num_heads: int = 4, width=None, query_len=1):
    return testing.make_problem(
        len(lengths),
        max(lengths),
        fmt,  # nvfp4-<form>: the same pages in another form (testing.NVFP4_FORMS)
        query_len=query_len,
        num_heads=num_heads,
        seed=seed,
        lengths=torch.tensor(lengths),
        width=width,
    )


# Every format with the usual forcing and with more forced blocks; every forcing on nvfp4 (the
# forcing rules do not depend on the format: its decoding is what each format adds).
FORMAT_FORCING = [(f, 0, 1) for f in FORMATS] + [(f, 2, 3) for f in FORMATS]
FORMAT_FORCING += [("nvfp4", 1, 1), ("nvfp4", 0, 0)]


@pytest.mark.parametrize(("fmt", "init", "local"), FORMAT_FORCING)
def test_block_scores_matches_oracle(fmt, init, local):
    prob = _problem(fmt, LENGTHS, seed=init * 10 + local)
    if fmt == "nvfp4-pair":
        assert isinstance(prob.index_cache, tuple)
    got, want = _scores(prob, init, local)
    assert got.shape == (4, len(LENGTHS), 8)
    _assert_same(got, want)
    # the forcing rules as docs/contract.md §3 states them, spot-checked on the result
    n = (prob.seq_lens.long() + 127) // 128
    for i, ni in enumerate(n.tolist()):
        row = got[:, i]
        assert bool(torch.isinf(row[:, ni:]).all()) and bool((row[:, ni:] < 0).all())
        for j in range(ni):
            if j >= ni - local:
                assert bool((row[:, j] == 1e29).all())
            elif j < init:
                assert bool((row[:, j] == 1e30).all())
            else:
                assert bool(row[:, j].abs().lt(1e3).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_scores_random_ragged(fmt):
    g = torch.Generator().manual_seed(7)
    lens = testing.random_lengths(6, 1500, g)
    prob = _problem(fmt, lens.tolist(), seed=3)
    got, want = _scores(prob, 0, 1)
    _assert_same(got, want)


# --------------------------------------------------------------------------- multi-token requests


# T: the fewest, an odd count, the most (T = 1 is every other test here)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("query_len", [2, 3, 8])
def test_multi_token_requests_match_oracle(fmt, query_len):
    # lengths where the T rows' causal cuts fall inside the last block for some rows and not
    # others (128 + 2: with T = 4 the first rows end in block 0, the last in block 1), lengths
    # equal to T, and full blocks
    lengths = [query_len, 130, 256, 257 + query_len, 1000, 128 * 5 + 1]
    prob = _problem(fmt, lengths, seed=20 + query_len, query_len=query_len)
    assert prob.q.shape[0] == len(lengths) * query_len
    for init, local in [(0, 1), (1, 1), (2, 2)]:
        got, want = _scores(prob, init, local)
        assert got.shape == (4, len(lengths) * query_len, prob.width)
        _assert_same(got, want)


def test_multi_token_rows_are_single_token_rows():
    """A T-row request is T one-row requests sharing pages, with lengths L - T + 1 + t."""
    t = 4
    prob = _problem("nvfp4", [4, 131, 700, 1024], seed=31, query_len=t)
    kw = dict(init_blocks=1, local_blocks=1, width=prob.width)
    multi = reference.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, query_len=t, **kw
    )
    lens = prob.seq_lens.repeat_interleave(t) - (t - 1) + torch.arange(prob.rows) % t
    single = reference.block_scores(
        prob.q, prob.index_cache, prob.block_table.repeat_interleave(t, dim=0), lens.int(), **kw
    )
    assert torch.equal(multi, single)


def test_multi_token_shape_and_length_errors():
    prob = _problem("fp8", [10, 300], seed=3, query_len=4)
    args = (prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    kw = dict(init_blocks=0, local_blocks=1, width=prob.width)
    with pytest.raises(ValueError, match="query_len"):
        reference.block_scores(*args, query_len=3, **kw)
    short = prob.seq_lens.clone()
    short[0] = 3
    with pytest.raises(ValueError, match="seq_lens"):
        reference.block_scores(*args[:3], short, query_len=4, **kw)


def test_nvfp4_pair_equals_page_major():
    prob = _problem("nvfp4", LENGTHS, seed=11)
    pair = formats.to_nvfp4_pair(prob.index_cache)
    args = (prob.q, prob.block_table, prob.seq_lens)
    kw = dict(init_blocks=1, local_blocks=1, width=prob.width)
    a = reference.block_scores(args[0], prob.index_cache, *args[1:], **kw)
    b = reference.block_scores(args[0], pair, *args[1:], **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_lengths_shorter_than_forced_blocks(fmt):
    # n <= init + local: every block of the row is forced, nothing is scanned
    lengths = [1, 128, 129, 300, 384, 385, 700]
    prob = _problem(fmt, lengths, seed=5)
    pairs = [(2, 3), (3, 2), (4, 4), (0, 6), (6, 0)] if fmt == "fp8" else [(2, 3)]
    for init, local in pairs:  # the forcing does not depend on the format
        got, want = _scores(prob, init, local)
        _assert_same(got, want)
    # one block: local wins over init (local is tested first)
    got, _ = _scores(prob, 1, 1)
    assert bool((got[:, 0, 0] == 1e29).all())
    got, _ = _scores(prob, 1, 0)
    assert bool((got[:, 0, 0] == 1e30).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_width_larger_than_needed(fmt):
    prob = _problem(fmt, [1, 200, 130, 640], seed=9)
    got, want = _scores(prob, 1, 1, width=prob.width + 5)
    assert got.shape[-1] == prob.width + 5
    _assert_same(got, want)
    assert bool(torch.isneginf(got[:, :, prob.width :]).all())


def test_two_dim_query_and_sm_scale():
    prob = _problem("fp8", [1000, 333, 1], seed=2, num_heads=1)
    q2 = prob.q[:, 0].contiguous()
    args = (prob.index_cache, prob.block_table, prob.seq_lens)
    for scale in (128**-0.5, 1.0, 0.0625):
        got = reference.block_scores(
            q2, *args, init_blocks=0, local_blocks=1, width=prob.width, sm_scale=scale
        )
        want = oracle(q2, *args, init=0, local=1, width=prob.width, sm_scale=scale)
        assert got.shape == (1, 3, prob.width)
        _assert_same(got, want)


def test_only_visible_tokens_count():
    """A huge key past seq_lens must not change the block's score; one before it must."""
    prob = _problem("bf16", [200], seed=4, num_heads=1)
    cache = prob.index_cache.clone()
    page = int(prob.block_table[0, 1])
    q = prob.q[0, 0].float()
    big = (q / q.norm() * 300).to(torch.bfloat16)
    kw = dict(init_blocks=0, local_blocks=0, width=2)
    base = reference.block_scores(prob.q, cache, prob.block_table, prob.seq_lens, **kw)
    cache[page, 72] = big  # token 128 + 72 = 200 is past the causal length
    after = reference.block_scores(prob.q, cache, prob.block_table, prob.seq_lens, **kw)
    assert torch.equal(base, after)
    cache[page, 71] = big  # token 199 is the row's own token: it counts
    after = reference.block_scores(prob.q, cache, prob.block_table, prob.seq_lens, **kw)
    assert after[0, 0, 1] > base[0, 0, 1]
    assert after[0, 0, 0] == base[0, 0, 0]


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "nvfp4-pair"])
def test_columns_subset_equals_slicing(fmt):
    prob = _problem(fmt, [1000, 5, 700, 129, 1000], seed=6, width=11)
    kw = dict(init_blocks=1, local_blocks=2, width=prob.width)
    args = (prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    full = reference.block_scores(*args, **kw)
    g = torch.Generator().manual_seed(1)
    subsets = [
        torch.arange(prob.width),
        torch.tensor([0]),
        torch.tensor([10]),
        torch.tensor([3, 1, 7]),  # unsorted
        torch.randperm(prob.width, generator=g)[:5],
        torch.tensor([], dtype=torch.int64),
        torch.tensor([2, 9], dtype=torch.int32),
    ]
    subsets += [partition.owned_columns(r, 4, prob.width) for r in range(4)]
    for cols in subsets:
        part = reference.block_scores(*args, columns=cols, **kw)
        assert part.shape == (4, 5, cols.numel())
        assert torch.equal(part, full[:, :, cols.long()])


# --------------------------------------------------------------------------- select_blocks


def _select_oracle(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/contract.md §6 in plain Python: the k best columns by (score desc, id asc), -inf
    never, ids ascending with -1 after them; scores aligned, -inf where padded."""
    h, rows, width = scores.shape
    ids = torch.full((h, rows, k), -1, dtype=torch.int32)
    vals = torch.full((h, rows, k), -math.inf)
    for a in range(h):
        for i in range(rows):
            v = scores[a, i].tolist()
            best = sorted(range(width), key=lambda j: (-v[j], j))[:k]
            picked = sorted(j for j in best if v[j] != -math.inf)
            ids[a, i, : len(picked)] = torch.tensor(picked, dtype=torch.int32)
            vals[a, i, : len(picked)] = torch.tensor([v[j] for j in picked])
    return ids, vals


def _select(prob, init, local, topk, width=None):
    args = (prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    kw = dict(init_blocks=init, local_blocks=local, width=width or prob.width,
              query_len=prob.query_len)  # fmt: skip
    ids, vals = reference.select_blocks(*args, topk=topk, return_scores=True, **kw)
    want = _select_oracle(reference.block_scores(*args, **kw), topk)
    return (ids, vals), want


def _assert_selected(got, want) -> None:
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


SELECT_LENGTHS = [1, 128 * 3, 128 * 16, 128 * 16 + 1, 128 * 30 - 5, 128 * 17, 129]


# Every format at MiniMax-M3's topk; every topk on fp8 (the selection reads scores only).
FORMAT_TOPK = [(f, 16) for f in FORMATS] + [("fp8", k) for k in (1, 5, 64)]


@pytest.mark.parametrize(("fmt", "topk"), FORMAT_TOPK)
def test_select_blocks_matches_oracle(fmt, topk):
    prob = _problem(fmt, SELECT_LENGTHS, seed=8, width=32)
    for init, local in [(0, 1), (1, 1), (2, 3)]:
        got, want = _select(prob, init, local, topk)
        assert got[0].shape == (4, len(SELECT_LENGTHS), topk)
        _assert_selected(got, want)
    # ascending, -1 only after the ids and only where fewer than topk blocks are in context
    ids = got[0]
    n = ((prob.seq_lens.long() + 127) // 128).tolist()
    for i, ni in enumerate(n):
        have = min(topk, ni)
        assert bool((ids[:, i, :have] >= 0).all()) and bool((ids[:, i, have:] == -1).all())
        assert bool((ids[:, i, 1:have] > ids[:, i, : have - 1]).all())


@pytest.mark.parametrize("query_len", [1, 4])
def test_select_blocks_multi_token_requests(query_len):
    lengths = [query_len, 130, 128 * 20 + 3, 257 + query_len]
    prob = _problem("nvfp4", lengths, seed=40 + query_len, query_len=query_len)
    got, want = _select(prob, 1, 1, 16)
    assert got[0].shape == (4, len(lengths) * query_len, 16)
    _assert_selected(got, want)


def test_select_blocks_ties_go_to_the_lower_block_id():
    """Every block of a row on one page: all scanned blocks score exactly the same, so the
    selection is the forced blocks plus the lowest ids."""
    prob = _problem("fp8", [128 * 30, 128 * 10 + 5, 128 * 40], seed=12, width=40)
    prob.block_table[:] = prob.block_table[:, :1]
    got, want = _select(prob, 1, 2, 6)
    _assert_selected(got, want)
    assert got[0][:, 0].tolist() == [[0, 1, 2, 3, 28, 29]] * 4  # init 0, local 28-29
    assert got[0][:, 1].tolist() == [[0, 1, 2, 3, 9, 10]] * 4
    assert bool((got[1][:, 0, 1:4] == got[1][:, 0, 1:2]).all())  # really tied


def test_select_blocks_forced_blocks_beyond_topk():
    """More forced blocks than topk: init (1e30) beats local (1e29), lower ids first."""
    prob = _problem("bf16", [128 * 12, 128 * 5], seed=13)
    got, want = _select(prob, 3, 4, 2)
    _assert_selected(got, want)
    assert got[0][:, 0].tolist() == [[0, 1]] * 4
    got, _ = _select(prob, 1, 4, 3)
    assert got[0][:, 0].tolist() == [[0, 8, 9]] * 4  # init 0, then local 8-11's lowest
    assert got[1][0, 0].tolist() == torch.tensor([1e30, 1e29, 1e29]).tolist()


def test_select_blocks_width_and_topk_beyond_the_context():
    prob = _problem("nvfp4", [1, 200, 640], seed=14)
    got, want = _select(prob, 0, 1, 8, width=prob.width + 3)
    _assert_selected(got, want)
    assert got[0][0].tolist() == [[0] + [-1] * 7, [0, 1] + [-1] * 6, [0, 1, 2, 3, 4] + [-1] * 3]
    assert bool(torch.isneginf(got[1][0, 0, 1:]).all())


def test_select_blocks_defaults_and_errors():
    prob = _problem("fp8", [128 * 40, 300], seed=15, width=40)
    args = (prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    ids = reference.select_blocks(*args, init_blocks=0, local_blocks=1, width=40)
    assert isinstance(ids, torch.Tensor) and ids.shape == (4, 2, 16)
    with pytest.raises(ValueError, match="topk"):
        reference.select_blocks(*args, init_blocks=0, local_blocks=1, width=40, topk=0)


# --------------------------------------------------------------------------- speed


def test_speed_16_rows_32k_nvfp4():
    """The oracle must stay usable at decode scale: 32K tokens, nvfp4, 16 rows (its time is
    linear in the rows: 64 rows take four times as long)."""
    g = torch.Generator().manual_seed(0)
    rows, ctx, pool = 16, 32 * 1024, 256
    keys = torch.randn(pool, 128, 128, generator=g)
    cache = formats.quantize(keys, "nvfp4")
    blocks = ctx // 128
    table = torch.randint(0, pool, (rows, blocks), generator=g, dtype=torch.int32)
    lens = torch.full((rows,), ctx, dtype=torch.int32)
    lens[1::2] = torch.randint(ctx // 2, ctx, (rows // 2,), generator=g, dtype=torch.int32)
    q = (torch.randn(rows, 4, 128, generator=g) * 2).to(torch.float8_e4m3fn)
    t0 = time.perf_counter()
    out = reference.block_scores(q, cache, table, lens, init_blocks=0, local_blocks=1, width=blocks)
    dt = time.perf_counter() - t0
    print(f"reference.block_scores {rows} rows x 32K nvfp4: {dt:.2f} s")
    assert out.shape == (4, rows, blocks)
    assert bool(torch.isfinite(out[:, 0, :-1]).all())
    # spot-check one row against the oracle
    want = oracle(q[:1], cache, table[:1], lens[:1], init=0, local=1, width=blocks)
    assert torch.equal(out[:, :1], want)
    assert dt < 8.0, f"reference took {dt:.1f} s for {rows} rows x 32K tokens"
