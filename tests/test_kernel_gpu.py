"""The fused kernel alone (local mode, one device) against the reference, on fresh random data.

Runs on a GPU only. Every case poisons the output first (the op allocates; the in-place path is
covered by the transport tests) and checks forced columns exactly and scanned ones within 1e-5
of the row's largest |score|.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import FORMATS, assert_scores, expected, force_warpgroup_mma, needs_gpu

from cpindex import BadBlockTableError, formats, ops, testing
from cpindex.kernels import device_arch, launcher, structs, variants

pytestmark = [needs_gpu, pytest.mark.gpu]

# nvfp4 pages in the other forms the kernel reads in place (testing.NVFP4_FORMS): page-major
# [pages, 128, 72], the same inside a larger pool, and the pair views of a token-interleaved
# cache (8-byte aligned tokens: the NVFP4_NARROW instance)
NVFP4_FORMS = ["nvfp4-page_major_3d", "nvfp4-pool", "nvfp4-interleaved"]

CASES = [
    # rows, max_len, init, local, extra width
    (1, 1, 0, 1, 0),
    (1, 129, 0, 1, 3),
    (3, 1000, 0, 0, 0),
    (5, 4096 + 77, 1, 1, 5),
    (7, 20_000, 2, 3, 0),
    (64, 8_192, 0, 1, 0),
    (2, 256 * 1024, 0, 1, 0),
]


@pytest.mark.parametrize("fmt", [*FORMATS, *NVFP4_FORMS])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}-len{c[1]}-i{c[2]}l{c[3]}")
def test_kernel_matches_reference(fmt, case):
    rows, max_len, init, local, extra = case
    prob = testing.make_problem(rows, max_len, fmt, seed=hash(case) % 1000, device="cuda")
    prob.width += extra
    got = ops.block_scores(
        prob.q,
        prob.index_cache,
        prob.block_table,
        prob.seq_lens,
        init_blocks=init,
        local_blocks=local,
        width=prob.width,
    )
    assert_scores(got, expected(prob, init, local))


# requests, T, heads, max_len, init, local: T * H of 1 .. 64 query vectors (1, 2 and 4 query
# tiles, and 64 = two passes over each page); lengths equal to T; rows = max (64 * 4 = 256);
# four tiles (the warpgroup-mma instances on Hopper) over many ragged requests
MULTI = [
    (5, 2, 4, 3000, 0, 1),
    (7, 3, 2, 900, 1, 1),
    (6, 4, 4, 4096 + 2, 0, 1),
    (3, 4, 4, 4, 0, 1),
    (64, 4, 4, 2000, 0, 1),
    (4, 8, 4, 20_000, 2, 2),
    (3, 8, 8, 5000, 0, 1),
    (2, 5, 1, 700, 0, 0),
    (33, 8, 4, 9000, 1, 1),
    (9, 4, 8, 3000, 0, 1),
    (6, 8, 4, 8, 0, 1),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", MULTI, ids=lambda c: f"r{c[0]}-T{c[1]}-H{c[2]}-len{c[3]}")
def test_multi_token_requests_match_reference(fmt, case):
    """One pass over a request's pages scores its T rows x H heads, each row with its own
    causal cut (inside the last block the rows' cuts differ) and its own forcing."""
    requests, t, heads, max_len, init, local = case
    prob = testing.make_problem(
        requests, max_len, fmt, query_len=t, num_heads=heads, seed=sum(case), device="cuda"
    )
    got = ops.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
        init_blocks=init, local_blocks=local, width=prob.width, query_len=t,
    )  # fmt: skip
    assert got.shape == (heads, requests * t, prob.width)
    assert_scores(got, expected(prob, init, local))


@pytest.mark.parametrize("fmt", [*FORMATS, *NVFP4_FORMS])
@pytest.mark.parametrize(
    "case", [c for c in MULTI if c[1] * c[2] > 16], ids=lambda c: f"wg-r{c[0]}-T{c[1]}-H{c[2]}"
)
def test_warpgroup_instance_matches_reference(fmt, case, monkeypatch):
    """Four query tiles through the warpgroup mma (sm_90a), whatever the batch size: CTAs share
    groups, warps short of pages stream a dummy one, T * H = 64 takes two passes."""
    force_warpgroup_mma(monkeypatch)
    requests, t, heads, max_len, init, local = case
    prob = testing.make_problem(
        requests, max_len, fmt, query_len=t, num_heads=heads, seed=sum(case) + 1, device="cuda"
    )
    got = ops.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
        init_blocks=init, local_blocks=local, width=prob.width, query_len=t,
    )  # fmt: skip
    assert_scores(got, expected(prob, init, local))


def test_multi_token_short_request_is_reported():
    prob = testing.make_problem(3, 2000, "fp8", query_len=4, seed=8, device="cuda")
    prob.seq_lens[1] = 3  # shorter than its 4 query tokens
    ops.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens, query_len=4)
    torch.cuda.synchronize()
    with pytest.raises(BadBlockTableError, match="request 1 has seq_lens 3"):
        ops.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens, query_len=4)
    ops._scorers.clear()


def test_nvfp4_forms_score_the_same():
    """One set of pages as uint8 [pages, 9216], as [pages, 128, 72], as [pages, 128, 72] pages
    inside a larger pool, as the (packed, scales) pair and as the pair views of a
    token-interleaved cache (contiguous and every other page): the same scores, bit for bit."""
    prob = testing.make_problem(6, 3000, "nvfp4", query_len=2, seed=7, device="cuda")
    pm = prob.index_cache
    pages = pm.shape[0]
    packed, scales = formats.to_nvfp4_pair(pm)
    # scale tokens only 2-byte aligned (a token stride of 10 bytes)
    odd = torch.zeros(*scales.shape[:2], 10, dtype=torch.uint8, device=scales.device)
    odd[:, :, :8] = scales.view(torch.uint8)
    iv = formats.to_page_layout(pm, "interleaved").view(pages, 128, 72)
    # the interleaved cache at every other page of a pool twice its size
    iv_pool = torch.randint(0, 256, (2 * pages, 128, 72), dtype=torch.uint8, device="cuda")
    iv_pool[1::2] = iv
    caches = [
        pm.view(pages, 128, 72),
        testing.nvfp4_form(pm, "pool"),
        (packed, scales),
        formats.nvfp4_views(iv, layout="interleaved"),
        (iv[:, :, :64], iv[:, :, 64:]),
        formats.nvfp4_views(iv_pool[1::2], layout="interleaved"),
        (packed, odd[:, :, :8].view(scales.dtype)),
    ]
    args = (prob.block_table, prob.seq_lens)
    a = ops.block_scores(prob.q, pm, *args, query_len=2)
    assert_scores(a, expected(prob, 0, 1))
    for cache in caches:
        assert torch.equal(a, ops.block_scores(prob.q, cache, *args, query_len=2))


@pytest.mark.parametrize("form", ["pool", "interleaved"])
def test_nvfp4_cache_is_read_in_place(form):
    """No copy of the cache: the kernel reads the pages where they are (writing through them
    changes the scores) and a call allocates nothing near the cache's size. ``pool``:
    page-major [pages, 128, 72] pages at a page stride of 9280 bytes inside a pool;
    ``interleaved``: the pair views of a token-interleaved cache."""
    prob = testing.make_problem(4, 64 * 128, f"nvfp4-{form}", seed=12, device="cuda")
    cache = prob.index_cache
    values, _ = formats.nvfp4_views(cache)
    args = (prob.q, cache, prob.block_table, prob.seq_lens)
    before = ops.block_scores(*args)
    assert_scores(before, expected(prob, 0, 1))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    again = ops.block_scores(*args)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < values.shape[0] * 9216 // 4
    assert torch.equal(before, again)
    values ^= 0x11  # flip value bits in place
    assert not torch.equal(before, ops.block_scores(*args))


def test_nvfp4_pair_equals_page_major():
    prob = testing.make_problem(6, 3000, "nvfp4", seed=7, device="cuda")
    pair = formats.to_nvfp4_pair(prob.index_cache)
    a = ops.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    b = ops.block_scores(prob.q, pair, prob.block_table, prob.seq_lens)
    assert torch.equal(a, b)


# (format, portable build): the instances that split pages (every format, over four warps or
# two)
SPLITTING = [
    ("nvfp4", False),
    ("nvfp4-pool", False),
    ("nvfp4-interleaved", False),
    ("bf16", False),
    ("fp8", False),
    ("bf16", True),
    ("fp8", True),
    ("nvfp4", True),
]


@pytest.mark.parametrize("fmt,portable", SPLITTING, ids=lambda v: str(v))
@pytest.mark.parametrize("split", [4, 2, 0], ids=["quarters", "halves", "whole"])
@pytest.mark.parametrize("t,heads", [(1, 4), (4, 4), (8, 4), (8, 8)], ids=lambda v: str(v))
def test_split_and_whole_pages_match(fmt, portable, split, t, heads, monkeypatch):
    """A call whose CTAs all fit the grid splits each page over four warps (a CTA per item) or
    two (two items a CTA), a part each, maxima combined in shared memory; otherwise a warp
    scores whole pages. All three on one ragged batch: partial last blocks and causal cuts fall
    inside one warp's part, forcing, 1, 2 and 4 query tiles, two passes (T * H = 64), and an odd
    item count, so that with halves the last CTA's second pair has no item."""
    monkeypatch.setattr(variants, "SPLIT_WARPS", (split,) if split else ())
    lengths = torch.tensor([2900, 1025, 129, 2048, 700])  # 23 blocks: 115 items
    prob = testing.make_problem(
        5, 2900, fmt, query_len=t, num_heads=heads, seed=40 + t + heads, lengths=lengths,
        device="cuda",
    )  # fmt: skip
    dev = torch.device("cuda", torch.cuda.current_device())
    scorer = launcher.KernelScorer(
        dev, prob.fmt, num_heads=heads, rank=0, world=1, sm_scale=128**-0.5,
        monitor=launcher.ErrorMonitor(dev, 0), portable=portable,
    )  # fmt: skip
    fid = structs.NVFP4_NARROW if fmt == "nvfp4-interleaved" else None  # launch()'s instance
    shape = scorer.grid(prob.requests, prob.width, False, t, fid)
    assert shape.variant.split == split and not shape.variant.wgmma, shape  # the one under test
    assert prob.requests * prob.width == 115
    assert shape.grid == -(-115 * split // 4) or not split, shape
    out = torch.full((heads, prob.rows, prob.width), float("nan"), device="cuda")
    scorer.score_local(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, out,
        init_blocks=1, local_blocks=1, width=prob.width, query_len=t,
    )  # fmt: skip
    assert_scores(out, expected(prob, 1, 1))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("split", [4, 2], ids=["quarters", "halves"])
@pytest.mark.parametrize("t,heads", [(1, 4), (4, 4), (8, 8)], ids=lambda v: str(v))
def test_split_pages_stream_over_rounds(fmt, split, t, heads, monkeypatch):
    """Split pages on a persistent grid of a few CTAs, many rounds each (the launcher takes it
    for bf16 at every size; benchmarks/launch_shapes.py times every split on any grid): a ragged
    batch with forced and unread items between read ones, one page read by consecutive items
    and by two requests, and T * H = 64 (two passes over each page), against the reference."""
    if torch.version.hip is not None:
        pytest.skip("split pages stream through the ring on CUDA builds only")
    lengths = torch.tensor([2900, 1025, 129, 2048, 700, 3000, 9, 640])
    prob = testing.make_problem(
        8, 3000, fmt, query_len=t, num_heads=heads, seed=50 + t + split, lengths=lengths,
        device="cuda",
    )  # fmt: skip
    prob.block_table[:, 5] = prob.block_table[:, 4]  # consecutive items on one page
    prob.block_table[2, 1] = prob.block_table[1, 7]  # and across requests
    dev = torch.device("cuda", torch.cuda.current_device())
    scorer = launcher.KernelScorer(
        dev, prob.fmt, num_heads=heads, rank=0, world=1, sm_scale=128**-0.5,
        monitor=launcher.ErrorMonitor(dev, 0),
    )  # fmt: skip
    tiles = variants.query_tiles(scorer.build, t * heads)
    shape = variants.LaunchShape(variants.Variant(scorer.fmt_id, tiles, False, split), 7)
    monkeypatch.setattr(launcher.KernelScorer, "grid", lambda self, *args: shape)  # 7 CTAs
    for init_blocks in (0, 2):
        out = torch.full((heads, prob.rows, prob.width), float("nan"), device="cuda")
        scorer.score_local(
            prob.q, prob.index_cache, prob.block_table, prob.seq_lens, out,
            init_blocks=init_blocks, local_blocks=1, width=prob.width, query_len=t,
        )  # fmt: skip
        assert_scores(out, expected(prob, init_blocks, 1))


@pytest.mark.parametrize("heads", [1, 2, 8])
def test_head_counts(heads):
    prob = testing.make_problem(4, 5000, "fp8", num_heads=heads, seed=heads, device="cuda")
    got = ops.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    assert_scores(got, expected(prob, 0, 1))


@pytest.mark.parametrize("fmt", [*FORMATS, *NVFP4_FORMS])
@pytest.mark.parametrize("t", [1, 3])
def test_portable_path_matches(fmt, t):
    """The portable fallback (CP_PORTABLE: AMD GPUs without matrix cores), run on this GPU."""
    prob = testing.make_problem(9, 7000, fmt, query_len=t, seed=11, device="cuda")
    dev = torch.device("cuda", torch.cuda.current_device())
    mon = launcher.ErrorMonitor(dev, 0)
    scorer = launcher.KernelScorer(
        dev, prob.fmt, num_heads=4, rank=0, world=1, sm_scale=128**-0.5, monitor=mon,
        portable=True,
    )  # fmt: skip
    out = torch.full((4, prob.rows, prob.width), float("nan"), device="cuda")
    scorer.score_local(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, out,
        init_blocks=1, local_blocks=1, width=prob.width, query_len=t,
    )  # fmt: skip
    assert_scores(out, expected(prob, 1, 1))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_mode_covers_rank_columns(world):
    """Local shard mode (what 'collective' runs): rank r's columns j = r + W*k at column k."""
    prob = testing.make_problem(5, 9000, "nvfp4", seed=world, device="cuda")
    full = expected(prob, 0, 1)
    dev = torch.device("cuda", torch.cuda.current_device())
    mon = launcher.ErrorMonitor(dev, 0)
    for rank in range(world):
        sc = launcher.KernelScorer(
            dev, "nvfp4", num_heads=4, rank=rank, world=world, sm_scale=128**-0.5, monitor=mon
        )
        kw = -(-prob.width // world)
        out = torch.full((4, prob.rows, kw), float("nan"), device="cuda")
        sc.score_local(
            prob.q,
            prob.index_cache,
            prob.block_table,
            prob.seq_lens,
            out,
            init_blocks=0,
            local_blocks=1,
            width=prob.width,
            shard=True,
        )
        cols = torch.arange(rank, prob.width, world)
        assert_scores(out[:, :, : cols.numel()], full[:, :, cols])


def test_bad_page_is_reported_not_read():
    prob = testing.make_problem(3, 2000, "fp8", seed=3, device="cuda")
    prob.block_table[0, 2] = 10**6  # row 0 is the longest: column 2 is scanned
    ops.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    torch.cuda.synchronize()
    with pytest.raises(BadBlockTableError, match="row 0, column 2"):
        ops.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    ops._scorers.clear()  # the error word is sticky for that scorer


def test_row_longer_than_width_is_reported():
    prob = testing.make_problem(2, 3000, "nvfp4", seed=4, device="cuda")
    ops.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens, width=5)
    torch.cuda.synchronize()
    with pytest.raises(BadBlockTableError, match=r"request \d needs \d+ blocks"):
        ops.block_scores(prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    ops._scorers.clear()


def test_graph_capture_replays_with_new_inputs():
    """Grid and parameters come from static sizes only: capture once, change seq_lens /
    block_table / q in place, replay, and match the reference each time."""
    rows, max_len = 6, 6000
    base = testing.make_problem(rows, max_len, "nvfp4", seed=1, device="cuda")
    q, bt, sl = base.q.clone(), base.block_table.clone(), base.seq_lens.clone()
    cache = base.index_cache
    ops.block_scores(q, cache, bt, sl, width=base.width)  # build + warm up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.block_scores(q, cache, bt, sl, width=base.width)
    gen = torch.Generator().manual_seed(5)
    for step in range(5):
        new = testing.make_problem(rows, max_len, "nvfp4", seed=100 + step, device="cuda")
        q.copy_(new.q)
        sl.copy_(testing.random_lengths(rows, max_len, gen).cuda())
        bt.copy_(
            torch.randperm(bt.numel(), generator=gen).view_as(bt).cuda().int() % cache.shape[0]
        )
        out.fill_(float("nan"))
        g.replay()
        want = testing.Problem(q, cache, bt, sl, base.width, "nvfp4")
        assert_scores(out, expected(want, 0, 1))


@pytest.mark.parametrize(
    ("fmt", "requests", "t", "max_len", "init", "wg"),
    [("fp8", 5, 4, 3000, 0, False), ("nvfp4", 7, 8, 6000, 1, True)],
)
def test_graph_capture_multi_token_lengths_changed_in_place(
    fmt, requests, t, max_len, init, wg, monkeypatch
):
    """T fixed at capture; lengths (some rows' cuts inside a block) and tables change. wg: the
    warpgroup-mma instance, forced whatever the batch size."""
    if wg:
        force_warpgroup_mma(monkeypatch)
    base = testing.make_problem(requests, max_len, fmt, query_len=t, seed=2, device="cuda")
    q, bt, sl = base.q.clone(), base.block_table.clone(), base.seq_lens.clone()
    cache = base.index_cache
    kw = dict(width=base.width, query_len=t, init_blocks=init)
    ops.block_scores(q, cache, bt, sl, **kw)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.block_scores(q, cache, bt, sl, **kw)
    gen = torch.Generator().manual_seed(9)
    for _ in range(4):
        sl.copy_(testing.random_lengths(requests, max_len, gen, min_len=t).cuda())
        out.fill_(float("nan"))
        g.replay()
        want = testing.Problem(q, cache, bt, sl, base.width, fmt, t)
        assert_scores(out, expected(want, init, 1))


def test_torch_compile_traces_the_op():
    prob = testing.make_problem(3, 2000, "bf16", seed=2, device="cuda")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, cache, bt, sl):
        return torch.ops.cpindex.block_scores(q, cache, None, bt, sl, 0, 1, 16, 128**-0.5) * 2

    out = f(prob.q, prob.index_cache, prob.block_table, prob.seq_lens)
    prob.width = 16
    assert_scores(out / 2, expected(prob, 0, 1))


def _many_rounds(fmt: str, t: int, seed: int):
    """A ragged batch of ``variants.RING_MIN_ITEMS_PER_SM`` items per SM (80-block requests,
    many rounds of any persistent grid) and a local scorer for it."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = 80
    requests = -(-variants.RING_MIN_ITEMS_PER_SM * sms // blocks)
    lengths = torch.randint(1, blocks * 128, (requests,))
    lengths[0] = blocks * 128
    prob = testing.make_problem(
        requests, blocks * 128, fmt, query_len=t, seed=seed, lengths=lengths, device="cuda"
    )
    dev = torch.device("cuda", torch.cuda.current_device())
    scorer = launcher.KernelScorer(
        dev, fmt, num_heads=4, rank=0, world=1, sm_scale=128**-0.5,
        monitor=launcher.ErrorMonitor(dev, 0),
    )  # fmt: skip
    return prob, scorer, sms


def _scored(scorer, prob, init_blocks: int) -> torch.Tensor:
    """The scorer's local scores of ``prob`` into a poisoned buffer, checked against the
    reference."""
    out = torch.full((4, prob.rows, prob.width), float("nan"), device="cuda")
    scorer.score_local(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, out,
        init_blocks=init_blocks, local_blocks=1, width=prob.width, query_len=prob.query_len,
    )  # fmt: skip
    assert_scores(out, expected(prob, init_blocks, 1))
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 4, 8])
def test_ring_grid_holds_its_bytes_in_flight(fmt, t, monkeypatch):
    """bf16 and fp8 whole pages of a large call (``variants.RING_MIN_ITEMS_PER_SM`` items per
    SM or more) run on a grid sized by bytes in flight per SM (``variants.RING_BYTES_PER_SM``),
    fewer CTAs than fit: each warp takes several rounds of a ragged batch. The same scores as
    the grid of every CTA that fits, and as the reference."""
    if torch.version.hip is not None:
        pytest.skip("the ring grid is sized on CUDA builds only")
    monkeypatch.setattr(variants, "WGMMA_MIN_ITEMS_PER_SM", 1 << 30)  # the mma.sync instances
    monkeypatch.setattr(variants, "SPLIT_WARPS", ())  # whole pages at every size below
    prob, scorer, sms = _many_rounds(fmt, t, 70 + t)
    # a CTA keeps 4 warps x 3 tiles in flight: 48 KiB of bf16, 24 KiB of fp8
    per_sm = variants.RING_BYTES_PER_SM // (48 * 1024 if fmt == "bf16" else 24 * 1024)
    ring = variants.RING_BYTES_PER_SM
    below = [scorer.grid(r, prob.width, False, t) for r in (prob.requests - 1, 4)]
    assert scorer.grid(prob.requests, prob.width, False, t).grid == sms * per_sm
    monkeypatch.setattr(variants, "RING_BYTES_PER_SM", 0)
    # one request fewer is below the threshold: the grid of every CTA that fits
    assert below == [scorer.grid(r, prob.width, False, t) for r in (prob.requests - 1, 4)]
    assert below[1].grid == prob.width  # 4 requests: a CTA per four items
    outs = []
    for ring_bytes in (ring, 0):
        monkeypatch.setattr(variants, "RING_BYTES_PER_SM", ring_bytes)
        outs.append(_scored(scorer, prob, 0))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_warpgroup_instance_by_gpu(fmt):
    """From ``variants.WGMMA_MIN_ITEMS_PER_SM`` items per SM, four query tiles take the
    warpgroup-mma instance: nvfp4 on every sm_90a GPU, bf16 and fp8 only on the GPUs named in
    ``variants.WGMMA_RING_GPUS`` (elsewhere whole pages with ``mma.sync``)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if not variants.build_of(device_arch(dev)).wgmma:
        pytest.skip("no warpgroup-mma instance in this build (sm_90a only)")
    scorer = launcher.KernelScorer(
        dev, fmt, num_heads=4, rank=0, world=1, sm_scale=128**-0.5,
        monitor=launcher.ErrorMonitor(dev, 0),
    )  # fmt: skip
    sms, name = (
        torch.cuda.get_device_properties(dev).multi_processor_count,
        torch.cuda.get_device_name(dev),
    )
    requests = -(-variants.WGMMA_MIN_ITEMS_PER_SM * sms // 64)  # 64 blocks each: enough items
    default = any(n in name for n in variants.WGMMA_RING_GPUS)
    for gpus, ring_takes_it in [(variants.WGMMA_RING_GPUS, default), ((name,), True), ((), False)]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(variants, "WGMMA_RING_GPUS", gpus)
            got = scorer.grid(requests, 64, False, 8).variant.wgmma
            assert got == (ring_takes_it or fmt == "nvfp4")
            assert not scorer.grid(requests - 1, 8, False, 8).variant.wgmma  # below the threshold


@pytest.mark.parametrize(
    "fmt,t,split", [("bf16", 1, 4), ("bf16", 4, 2), ("bf16", 8, 4), ("fp8", 1, 2)]
)
def test_ring_split_pages_at_every_size(fmt, t, split, monkeypatch):
    """The ring formats split pages past the size whose CTAs fit at once where
    ``variants.RING_SPLIT_PAGES`` says so: bf16 over four warps with one query tile and two with
    two, and over four with four tiles from ``RING_MIN_ITEMS_PER_SM`` items per SM (whole pages
    below), fp8 over two with one; that instance on its whole resident grid, each CTA taking
    several rounds of a ragged batch. The reference's scores, and those of whole pages."""
    if torch.version.hip is not None:
        pytest.skip("split pages at scale are for the ring (CUDA builds)")
    monkeypatch.setattr(variants, "WGMMA_MIN_ITEMS_PER_SM", 1 << 30)
    prob, scorer, sms = _many_rounds(fmt, t, 90 + t + split)
    tiles = variants.query_tiles(scorer.build, 4 * t)
    resident = sms * scorer.occupancy(variants.Variant(scorer.fmt_id, tiles, False, split))
    shape = scorer.grid(prob.requests, prob.width, False, t)
    assert shape == (variants.Variant(scorer.fmt_id, tiles, False, split), resident), shape
    assert prob.requests * prob.width > 4 // split * resident  # several rounds a CTA
    small = scorer.grid(1, 8, False, t)  # fits at once: four warps a page, a CTA per item
    assert small == (variants.Variant(scorer.fmt_id, tiles, False, 4), 8), small
    below = scorer.grid(prob.requests - 1, prob.width, False, t)  # under the items per SM
    assert below.variant.split == (0 if t == 8 else split), below
    outs = []
    for table in (variants.RING_SPLIT_PAGES, ()):
        monkeypatch.setattr(variants, "RING_SPLIT_PAGES", table)
        got = scorer.grid(prob.requests, prob.width, False, t).variant.split
        assert got == (split if table else 0)
        outs.append(_scored(scorer, prob, 1))
    fin = torch.isfinite(outs[1])
    assert torch.equal(fin, torch.isfinite(outs[0]))
    torch.testing.assert_close(outs[0][fin], outs[1][fin], rtol=0, atol=1e-5)
