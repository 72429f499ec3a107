"""The host path's caches against the real kernel (docs/design.md, "The host path"): parameter
images, grid choices, nvfp4 views kept per cache tensor, result views kept per size, verdicts
memoized by metadata. Fresh random inputs every call, outputs poisoned before every call, each
result compared with the pure-torch reference of that call's own inputs; tensors changed in
place (contents and metadata) between calls; one plan across layers; and every check still
fires, before anything is launched, once the caches are warm.

One rank in the one-process world (``ipc``, ``collective`` and the path below the CP gate), so
nothing waits on a peer; ``torch.ops.cpindex.block_scores`` on its own."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _gpu import assert_scores, expected, needs_gpu, unambiguous

from cpindex import (
    BadBlockTableError,
    CPIndexConfig,
    IndexCP,
    formats,
    ops,  # noqa: F401  (registers torch.ops.cpindex.*)
    reference,
    testing,
)
from cpindex.world import run_threads

pytestmark = [needs_gpu, pytest.mark.gpu]
DEV = "cuda:0"
REQ, T, MAX_LEN, TOPK = 5, 2, 40 * 128, 8
W = MAX_LEN // 128 + 2  # two columns of padding past the longest request
#: The paths a call can take on one GPU: pushed through ipc, collective, scored below the gate.
PATHS = {
    "ipc": dict(transport="ipc", cp_min_blocks=0),
    "collective": dict(transport="collective", cp_min_blocks=0),
    "below-gate": dict(transport="ipc", cp_min_blocks=1 << 40),
}
FORMS = ["bf16", "fp8", "nvfp4", "nvfp4-pair", "nvfp4-interleaved"]


def _problem(fmt: str, seed: int, requests: int = REQ) -> testing.Problem:
    """Fresh random inputs; every problem of ``requests`` requests has the same shapes (its
    cache the same page count)."""
    return testing.make_problem(requests, MAX_LEN, fmt, query_len=T, seed=seed, width=W, device=DEV)


def _split(cache: formats.Cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    return cache if isinstance(cache, tuple) else (cache, None)


def _on_gpu(fn: Callable, fmt: str, path: str, **cfg) -> object:
    config = CPIndexConfig(
        cache_format=testing.split_format(fmt)[0], max_rows=32, max_query_len=4, max_width=64,
        error_check="sync", **{**PATHS[path], **cfg},
    )  # fmt: skip

    def rank(comm):
        with IndexCP(config, device=DEV, comm=comm) as cp:
            return fn(cp)

    return run_threads(1, rank, device=DEV)[0]


def _poison(cp: IndexCP, rows: int) -> None:
    """NaN over every output view a call of ``rows`` rows can return (-1 over the ids)."""
    cp._transport.scores_out(rows, W).fill_(float("nan"))
    ids, vals = cp._transport.selected_out(rows, TOPK)
    ids.fill_(-1)
    vals.fill_(float("nan"))


def _check(p: testing.Problem, scores: torch.Tensor, ids: torch.Tensor, q=None, cache=None):
    """``scores`` and ``ids`` are the reference's for ``p`` (with ``q``/``cache`` in place of
    its own): every score, and the ids wherever the k-th best has no near-tie."""
    want = testing.Problem(
        p.q if q is None else q, p.index_cache if cache is None else cache, p.block_table,
        p.seq_lens, p.width, p.fmt, p.query_len,
    )  # fmt: skip
    full = expected(want, 0, 1)
    assert_scores(scores, full)
    ref = reference.select_blocks(
        want.q, want.index_cache, want.block_table, want.seq_lens, init_blocks=0, local_blocks=1,
        width=W, query_len=T, topk=TOPK,
    )  # fmt: skip
    sure = unambiguous(full.cpu(), TOPK).to(DEV)
    assert torch.equal(ids[sure], ref[sure])


def _both_forms(cp: IndexCP, p: testing.Problem, q=None, cache=None, plan=None) -> list:
    """score_push and select_blocks, with ``plan`` (default: one made here) and with a plan
    made for the call, each on poisoned outputs; copies of what they returned."""
    q = p.q if q is None else q
    cache = p.index_cache if cache is None else cache
    if plan is None:
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W)
    out = []
    for fresh in (False, True):
        _poison(cp, p.rows)
        pl = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W) if fresh else plan
        scores = cp.score_push(q, cache, pl, tag=2).clone()
        _poison(cp, p.rows)
        ids = cp.select_blocks(q, cache, pl, topk=TOPK, tag=2).clone()
        out.append((scores, ids))
    return out


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fmt", FORMS)
def test_new_data_every_call(fmt, path):
    probs = [_problem(fmt, seed) for seed in range(4)] + [_problem(fmt, 9, requests=3)]

    def job(cp):
        return [_both_forms(cp, p) for p in probs + probs[:1]]  # and back to the first shape

    for p, results in zip(probs + probs[:1], _on_gpu(job, fmt, path), strict=True):
        for scores, ids in results:
            _check(p, scores, ids)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fmt", FORMS)
def test_one_plan_across_layers(fmt, path):
    p = _problem(fmt, 20)
    layers = [(lp.q, lp.index_cache) for lp in (_problem(fmt, s) for s in (21, 22, 23))]

    def job(cp):
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W)
        return [_both_forms(cp, p, q, cache, plan) for q, cache in layers * 2]

    for (q, cache), results in zip(layers * 2, _on_gpu(job, fmt, path), strict=True):
        for scores, ids in results:
            _check(p, scores, ids, q, cache)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fmt", FORMS)
def test_tensors_changed_in_place(fmt, path):
    """Contents between calls (the plan refreshed, as the contract asks), then the cache's
    tensor objects given other storage (``set_``): views kept per tensor must follow them."""
    p, other, third = _problem(fmt, 30), _problem(fmt, 31), _problem(fmt, 32)
    parts = [t for t in _split(p.index_cache) if t is not None]
    new_parts = [t for t in _split(third.index_cache) if t is not None]

    def job(cp):
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W)
        out = [_both_forms(cp, p, plan=plan)]
        p.q.copy_(other.q)
        for part, src in zip(parts, _split(other.index_cache), strict=False):
            part.copy_(src)
        p.block_table.copy_(other.block_table)
        p.seq_lens.copy_(other.seq_lens)
        out.append(_both_forms(cp, p, plan=plan.refresh()))
        for part, new in zip(parts, new_parts, strict=True):  # same objects, other storage
            part.set_(new.untyped_storage(), new.storage_offset(), new.shape, new.stride())
        out.append(_both_forms(cp, p, plan=plan))
        return out

    before = _problem(fmt, 30)
    results = _on_gpu(job, fmt, path)
    for want, q, cache, got in zip(
        (before, other, other), (before.q, other.q, other.q),
        (before.index_cache, other.index_cache, third.index_cache), results, strict=True,
    ):  # fmt: skip
        for scores, ids in got:
            _check(want, scores, ids, q, cache)


@pytest.mark.parametrize("path", ["ipc", "below-gate"])
def test_a_cache_shrunk_in_place_is_read_with_its_new_page_count(path):
    """Kept nvfp4 views would still see the old page count: a page past the new one must be
    reported, not read."""
    p = _problem("nvfp4", 40)
    cache = p.index_cache  # uint8 [pages, 9216]
    last = int(p.block_table[0, 0])  # row 0's first block: scanned

    def job(cp):
        _both_forms(cp, p)
        keep = cache.shape[0]
        cache.set_(cache.untyped_storage(), 0, (last, cache.shape[1]), cache.stride())
        try:
            with pytest.raises(BadBlockTableError):
                plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W)
                cp.score_push(p.q, cache, plan)
        finally:
            cache.set_(cache.untyped_storage(), 0, (keep, cache.shape[1]), cache.stride())
        return True

    assert _on_gpu(job, "nvfp4", path)  # error_check="sync": raised by the call itself


def test_returned_views_are_fresh_aliases():
    p = _problem("nvfp4", 50)

    def job(cp):
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W)
        a = cp.score_push(p.q, p.index_cache, plan)
        a.unsqueeze_(0)  # the caller reshapes what it got, in place
        b = cp.score_push(p.q, p.index_cache, plan)
        assert b.shape == (4, p.rows, W) and b.data_ptr() == a.data_ptr()
        return b.clone()

    assert_scores(_on_gpu(job, "nvfp4", "ipc"), expected(p, 0, 1))


def _offset(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``t``'s shape and strides, starting ``nbytes`` past a 16-byte boundary."""
    n = t.numel() * t.element_size()
    buf = torch.zeros(n + 64, dtype=torch.uint8, device=t.device)
    out = buf[16 + nbytes : 16 + nbytes + n].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


BAD: list[tuple[str, Callable[[dict], None], type, str]] = [
    ("iq misaligned", lambda a: a.update(iq=_offset(a["iq"], 2)), ValueError, "iq: data must"),
    (
        "iq strides",
        lambda a: a.update(iq=a["iq"].transpose(0, 1).contiguous().transpose(0, 1)),
        ValueError,
        "iq: expected a contiguous",
    ),
    ("iq rows", lambda a: a.update(iq=a["iq"][:-1]), ValueError, "iq: expected"),
    (
        "cache misaligned",
        lambda a: a.update(index_cache=_offset(a["index_cache"], 8)),
        ValueError,
        "index_cache: data must",
    ),
    (
        "cache dtype",
        lambda a: a.update(index_cache=a["index_cache"].view(torch.int8)),
        TypeError,
        "index_cache",
    ),
    (
        "block_table strides",
        lambda a: a.update(block_table=a["block_table"].t().contiguous().t()),
        ValueError,
        "block_table: rows must",
    ),
    ("seq_lens dtype", lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens"),
    ("init_blocks bool", lambda a: a.update(init_blocks=False), TypeError, "init_blocks"),
    ("width past max", lambda a: a.update(width=65), ValueError, "width"),
    ("tag bool", lambda a: a.update(tag=True), TypeError, "tag"),
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_a_warm_cache_skips_no_check(bad, path):
    _, edit, error, match = bad
    p = _problem("nvfp4", 60)

    def job(cp):
        for _ in range(2):
            _both_forms(cp, p)
        args = dict(
            iq=p.q, index_cache=p.index_cache, block_table=p.block_table, seq_lens=p.seq_lens,
            init_blocks=0, local_blocks=1, width=W, query_len=T, tag=2,
        )  # fmt: skip
        edit(args)
        torch.cuda.synchronize()
        _poison(cp, p.rows)
        counts = ("init_blocks", "local_blocks", "width", "query_len")
        for op in (cp.score_push, cp.select_blocks):
            with pytest.raises(error, match=match):
                plan = cp.plan(
                    args["block_table"], args["seq_lens"], **{k: args[k] for k in counts}
                )
                op(args["iq"], args["index_cache"], plan, tag=args["tag"])
        torch.cuda.synchronize()
        assert cp._transport.scores_out(p.rows, W).isnan().all(), "launched before the check"
        assert (cp._transport.selected_out(p.rows, TOPK)[0] == -1).all()
        _both_forms(cp, p)  # still usable (one rank: a refusal breaks nothing)
        return True

    assert _on_gpu(job, "nvfp4", path)


@pytest.mark.parametrize("fmt", FORMS)
def test_op_fresh_output_every_call(fmt):
    op = torch.ops.cpindex.block_scores
    probs = [_problem(fmt, seed) for seed in (70, 71, 72)]

    def call(p: testing.Problem, q: torch.Tensor | None = None) -> torch.Tensor:
        cache, scales = _split(p.index_cache)
        q = p.q if q is None else q
        return op(q, cache, scales, p.block_table, p.seq_lens, 0, 1, W, 128**-0.5, T)

    first = call(probs[0])
    for p in probs + probs:
        got = call(p)
        assert got.data_ptr() != first.data_ptr()  # a fresh tensor while the first lives
        assert_scores(got, expected(p, 0, 1))
    assert_scores(first, expected(probs[0], 0, 1))  # untouched by the calls after it
    with pytest.raises(ValueError, match="iq: data must"):
        call(probs[0], _offset(probs[0].q, 2))
    with pytest.raises(ValueError, match="width"):
        cache, scales = _split(probs[0].index_cache)
        op(probs[0].q, cache, scales, probs[0].block_table, probs[0].seq_lens, 0, 1, 1 << 21,
           128**-0.5, T)  # fmt: skip
