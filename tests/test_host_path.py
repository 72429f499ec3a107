"""The host path's caches never answer for an input they have not seen (docs/design.md, "The
host path"): verdicts memoized by tensor metadata, per-tensor views, per-shape output views.

On the CPU, behind ``IndexCP`` and ``torch.ops.cpindex.block_scores``, the reference scores: each
call here is compared with the reference computed afresh from that call's inputs, after calls
that warmed every cache with other data, other metadata at the same address, or the same
tensors changed in place. And every check still fires once the caches are warm, before
anything is scored (the outputs stay poisoned).

On a GPU (tests marked ``gpu``) the same against the real kernel, below."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable

import pytest
import torch
from _gpu import assert_scores, expected, unambiguous

from cpindex import (
    BadBlockTableError,
    CPIndexConfig,
    IndexCP,
    formats,
    memo,
    ops,
    reference,
    testing,
)
from cpindex.plan import Plan
from cpindex.world import run_threads

REQ, T, MAX_LEN, W = 3, 2, 900, 8  # 900 tokens: 8 blocks
H = 4  # one rank: every head is its own
CFG = dict(max_rows=16, max_query_len=4, max_width=16, cp_min_blocks=0)


def _problem(seed: int, fmt: str = "nvfp4", requests: int = REQ, t: int = T) -> testing.Problem:
    return testing.make_problem(requests, MAX_LEN, fmt, query_len=t, seed=seed, width=W)


def _want(p: testing.Problem, q=None, cache=None) -> torch.Tensor:
    return reference.block_scores(
        p.q if q is None else q, p.index_cache if cache is None else cache, p.block_table,
        p.seq_lens, init_blocks=0, local_blocks=1, width=p.width, query_len=p.query_len,
    )  # fmt: skip


def _top(p: testing.Problem, q=None, cache=None, topk: int = 4) -> torch.Tensor:
    return reference.select_blocks(
        p.q if q is None else q, p.index_cache if cache is None else cache, p.block_table,
        p.seq_lens, init_blocks=0, local_blocks=1, width=p.width, query_len=p.query_len,
        topk=topk,
    )  # fmt: skip


def _on_instance(fn: Callable, fmt: str = "nvfp4", world: int = 1, **cfg) -> list:
    def rank(comm):
        config = CPIndexConfig(cache_format=fmt, **{**CFG, **cfg})
        with IndexCP(config, device="cpu", comm=comm) as cp:
            return fn(cp, comm)

    return run_threads(world, rank)


def _plan(cp: IndexCP, p: testing.Problem) -> Plan:
    return cp.plan(p.block_table, p.seq_lens, query_len=p.query_len, width=p.width)


def _push(cp: IndexCP, p: testing.Problem, q=None, cache=None, plan=None) -> torch.Tensor:
    """``cp.score_push`` on ``p`` with ``plan``, or a plan made for this call alone."""
    q = p.q if q is None else q
    cache = p.index_cache if cache is None else cache
    return cp.score_push(q, cache, _plan(cp, p) if plan is None else plan, tag=1).clone()


# ---- the caches themselves -------------------------------------------------------------------
def test_check_key_tells_apart_what_checks_read():
    buf = torch.zeros(4096, dtype=torch.uint8)
    a = buf[:2048].view(16, 128)
    assert memo.check_key(a) == memo.check_key(buf[:2048].view(16, 128))
    assert memo.check_key(a) == memo.check_key(buf[32:2080].view(16, 128))  # same alignment
    assert memo.check_key(a) != memo.check_key(buf[1:2049].view(16, 128))  # misaligned
    assert memo.check_key(a) != memo.check_key(a.view(torch.float8_e4m3fn))
    assert memo.check_key(a) != memo.check_key(a.view(8, 256))
    assert memo.check_key(a) != memo.check_key(a.t())
    for exotic in (a.float().to_sparse(), 3, None):
        with pytest.raises(Exception):  # noqa: B017 - whatever it raises, callers check in full
            memo.check_key(exotic)


def test_memo_is_bounded():
    m: memo.Memo[int] = memo.Memo(capacity=4)
    for i in range(10):
        m.put(i, i)
        assert len(m) <= 4 and m.get(i) == i


def test_per_tensor_values_follow_the_object_and_its_metadata():
    pt: memo.PerTensor[str] = memo.PerTensor()
    t = torch.zeros(8, 16)
    pt.put(t, "v")
    assert pt.get(t) == "v"
    assert pt.get(t.view(8, 16)) is None  # another object, same metadata: not this entry
    t.resize_(4, 16)  # shape changed in place
    assert pt.get(t) is None
    pt.put(t, "w")
    t.set_(torch.zeros(4, 16).untyped_storage(), 0, (4, 16), (16, 1))  # another storage
    assert pt.get(t) is None
    pt.put(t, "x")
    t.as_strided_((2, 16), (32, 1))  # strides changed in place
    assert pt.get(t) is None
    pt.put(t, "y")
    assert pt.get(t, memo.view_key(t)) == "y"  # the key a caller just read: the same entry
    assert pt.get(t, memo.view_key(t[:1])) is None  # a key of other metadata: a miss
    del t
    gc.collect()
    assert len(pt) == 0  # dropped with its tensor: nothing kept alive


def test_a_cache_changed_in_place_is_checked_again():
    """The cache's verdict and the launch's views are keyed by its whole metadata, address
    included, read once per call (``Call.cache_key``): a cache changed in place is another
    key, checked again and handed on as what it now is."""
    from cpindex.validation import Checker

    cfg = CPIndexConfig(cache_format="nvfp4", **CFG).with_world_size(1)
    checker = Checker(cfg, H, torch.device("cpu"))
    cache = torch.zeros(4, 9216, dtype=torch.uint8)
    _, key = checker.cache(cache)
    assert key == memo.view_key(cache)
    cache.resize_(2, 9216)  # fewer pages, same object
    _, shrunk = checker.cache(cache)
    assert shrunk != key and shrunk == memo.view_key(cache)
    other = torch.zeros(4, 9216, dtype=torch.uint8)  # same metadata, another address
    assert checker.cache(other)[1] != key
    cache.set_(torch.zeros(4 * 9216 + 8, dtype=torch.uint8).untyped_storage(), 8, (4, 9216))
    with pytest.raises(ValueError, match="index_cache: data must"):  # misaligned in place
        checker.cache(cache)
    pair = formats.to_nvfp4_pair(other)
    assert checker.cache(pair)[1] == (memo.view_key(pair[0]), memo.view_key(pair[1]))


# ---- IndexCP: results follow every call's own inputs ------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
def test_same_shapes_new_data_every_call(world):
    probs = [_problem(seed) for seed in range(3)]

    def job(cp, comm):
        out = []
        for p in probs:
            q = p.rank_queries(comm.rank, comm.world_size)
            plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W)
            out.append((
                _push(cp, p, q), _push(cp, p, q, plan=plan),
                cp.select_blocks(q, p.index_cache, plan, topk=4).clone(),
            ))  # fmt: skip
        return out

    hpr = H // world
    for rank, results in enumerate(_on_instance(job, world=world)):
        heads = slice(rank * hpr, (rank + 1) * hpr)
        for p, (fresh, planned, ids) in zip(probs, results, strict=True):
            assert torch.equal(fresh, _want(p)[heads])
            assert torch.equal(planned, _want(p)[heads])
            assert torch.equal(ids, _top(p)[heads])


def test_tensors_changed_in_place_between_calls():
    p = _problem(10)
    other = _problem(11)

    def job(cp, comm):
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W)
        first = (_push(cp, p), _push(cp, p, plan=plan))
        p.q.copy_(other.q)
        p.index_cache.copy_(other.index_cache)
        p.block_table.copy_(other.block_table)
        p.seq_lens.copy_(other.seq_lens)
        return first, (_push(cp, p), _push(cp, p, plan=plan))

    want_before = _want(_problem(10))
    (a, b), (c, d) = _on_instance(job)[0]
    assert torch.equal(a, want_before) and torch.equal(b, want_before)
    assert torch.equal(c, _want(other)) and torch.equal(d, _want(other))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "nvfp4-pair", "nvfp4-interleaved"])
def test_one_plan_across_layers(fmt):
    base, form = testing.split_format(fmt)
    p = _problem(20, base)
    layers = []
    for seed in range(21, 24):  # each layer its own queries and cache (same pages)
        lp = _problem(seed, base)
        cache = lp.index_cache if base != "nvfp4" else testing.nvfp4_form(lp.index_cache, form)
        layers.append((lp.q, cache))

    def job(cp, comm):
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W)
        return [_push(cp, p, q, cache, plan=plan) for q, cache in layers for _ in range(2)]

    got = _on_instance(job, fmt=base)[0]
    for i, (q, cache) in enumerate(layers):
        want = _want(p, q, cache)
        assert torch.equal(got[2 * i], want) and torch.equal(got[2 * i + 1], want)


def test_one_address_other_metadata():
    """Tensors that start at one address but differ in shape, strides or dtype: each call is
    checked and scored as what it is."""
    p, small = _problem(30), _problem(31, requests=2)
    cache = p.index_cache  # uint8 [pages, 9216]
    pages = cache.shape[0]
    qbuf = torch.empty(16 * H * 128, dtype=torch.float8_e4m3fn)  # one address for every iq

    def at_start(q: torch.Tensor) -> torch.Tensor:
        view = qbuf[: q.numel()].view(q.shape)
        view.copy_(q)
        return view

    def job(cp, comm):
        out = [_push(cp, p, at_start(p.q))]
        out.append(_push(cp, small, at_start(small.q)))  # fewer rows, same address
        out.append(_push(cp, p, at_start(p.q), cache.view(pages, 128, 72)))  # the 3-D form
        with pytest.raises(ValueError, match="iq: expected a contiguous"):
            strided = qbuf.as_strided((REQ * T, H, 128), (2 * H * 128, 128, 1))
            cp.score_push(strided, cache, _plan(cp, p))
        with pytest.raises(TypeError, match="index_cache"):
            cp.score_push(p.q, cache.view(torch.float8_e4m3fn), _plan(cp, p))
        with pytest.raises(ValueError, match="seq_lens"):  # the table's rows as one row
            cp.plan(p.block_table.view(1, -1), p.seq_lens, query_len=T, width=W)
        out.append(_push(cp, p))
        return out

    got = _on_instance(job)[0]
    assert torch.equal(got[0], _want(p)) and torch.equal(got[2], _want(p))
    assert torch.equal(got[1], _want(small)) and torch.equal(got[3], _want(p))


def test_returned_views_are_fresh_aliases():
    p = _problem(40)

    def job(cp, comm):
        plan = _plan(cp, p)
        a = cp.score_push(p.q, p.index_cache, plan)
        ids, scores = cp.select_blocks(p.q, p.index_cache, plan, topk=4, return_scores=True)
        a.unsqueeze_(0)  # the caller changes what it got, in place
        ids.transpose_(0, 1)
        scores.resize_(1)
        b = cp.score_push(p.q, p.index_cache, plan)
        ids2, scores2 = cp.select_blocks(p.q, p.index_cache, plan, topk=4, return_scores=True)
        assert b.data_ptr() == a.data_ptr() and b is not a  # a view of the same buffer
        return b.clone(), b.shape, ids2.clone(), scores2.shape

    b, shape, ids, sshape = _on_instance(job)[0]
    assert shape == (H, REQ * T, W) and sshape == (H, REQ * T, 4)
    assert torch.equal(b, _want(p)) and torch.equal(ids, _top(p))


# ---- every check fires with the caches warm ------------------------------------------------
def _offset(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``t``'s shape and strides, starting ``nbytes`` further into a fresh buffer (on its
    device)."""
    buf = torch.zeros(t.numel() * t.element_size() + 64, dtype=torch.uint8, device=t.device)
    start = 16 + nbytes
    out = buf[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _bad_pages(p: testing.Problem) -> testing.Problem:
    p.block_table[0, 0] = 10**6
    return p


# (name, edit of the arguments dict, the error, what it names)
BAD: list[tuple[str, Callable[[dict], None], type, str]] = [
    ("iq dtype", lambda a: a.update(iq=a["iq"].view(torch.uint8)), TypeError, "iq"),
    ("iq heads", lambda a: a.update(iq=a["iq"][:, :2].contiguous()), ValueError, "iq"),
    ("iq misaligned", lambda a: a.update(iq=_offset(a["iq"], 1)), ValueError, "iq: data must"),
    (
        "iq strides",
        lambda a: a.update(iq=a["iq"].transpose(0, 1).contiguous().transpose(0, 1)),
        ValueError,
        "iq: expected a contiguous",
    ),
    ("iq rows", lambda a: a.update(iq=a["iq"][:-1]), ValueError, "iq"),
    (
        "cache dtype",
        lambda a: a.update(index_cache=a["index_cache"].view(torch.int8)),
        TypeError,
        "index_cache",
    ),
    (
        "cache misaligned",
        lambda a: a.update(index_cache=_offset(a["index_cache"], 8)),
        ValueError,
        "index_cache: data must",
    ),
    (
        "cache page stride",
        lambda a: a.update(
            index_cache=torch.zeros(a["index_cache"].shape[0], 9224, dtype=torch.uint8)[:, :9216]
        ),
        ValueError,
        "index_cache: pages must",
    ),
    (
        "block_table dtype",
        lambda a: a.update(block_table=a["block_table"].long()),
        TypeError,
        "block_table",
    ),
    (
        "block_table rows",
        lambda a: a.update(block_table=a["block_table"][:-1]),
        ValueError,
        "block_table|seq_lens",
    ),
    (
        "block_table strides",
        lambda a: a.update(block_table=a["block_table"].t().contiguous().t()),
        ValueError,
        "block_table: rows must",
    ),
    ("seq_lens dtype", lambda a: a.update(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens"),
    ("seq_lens shape", lambda a: a.update(seq_lens=a["seq_lens"][:-1]), ValueError, "seq_lens"),
    ("init_blocks bool", lambda a: a.update(init_blocks=False), TypeError, "init_blocks"),
    ("local_blocks bool", lambda a: a.update(local_blocks=True), TypeError, "local_blocks"),
    ("width bool", lambda a: a.update(width=True), TypeError, "width"),
    ("width too small", lambda a: a.update(width=3), ValueError, "width"),
    ("width past max", lambda a: a.update(width=17), ValueError, "width"),
    ("query_len", lambda a: a.update(query_len=4), ValueError, "iq: expected 12 rows|seq_lens"),
    ("query_len bool", lambda a: a.update(query_len=True), TypeError, "query_len"),
    ("tag bool", lambda a: a.update(tag=True), TypeError, "tag"),
    ("tag negative", lambda a: a.update(tag=-1), ValueError, "tag"),
    (
        "page outside the cache",
        lambda a: a["block_table"].__setitem__((0, 0), 10**6),
        ValueError,
        "block_table: row 0",
    ),
    (
        "length past the table",
        lambda a: a["seq_lens"].__setitem__(0, 16 * 128),
        ValueError,
        "width",
    ),
]
PLAN_ARGS = ("block_table", "seq_lens", "init_blocks", "local_blocks", "width", "query_len")


def _args(p: testing.Problem) -> dict:
    return dict(
        iq=p.q, index_cache=p.index_cache, block_table=p.block_table, seq_lens=p.seq_lens,
        init_blocks=0, local_blocks=1, width=W, query_len=T, tag=5,
    )  # fmt: skip


def _call(cp: IndexCP, op: Callable, args: dict, plan: Plan | None = None) -> object:
    """``op`` with ``args``: through ``plan``, or a plan made of them for this call."""
    plan = plan or cp.plan(
        args["block_table"], args["seq_lens"], init_blocks=args["init_blocks"],
        local_blocks=args["local_blocks"], width=args["width"], query_len=args["query_len"],
    )  # fmt: skip
    return op(args["iq"], args["index_cache"], plan, tag=args["tag"])


@pytest.mark.parametrize("bad", BAD, ids=[b[0] for b in BAD])
def test_a_warm_cache_skips_no_check(bad):
    _, edit, error, match = bad
    p = _problem(50)

    def job(cp, comm):
        args = _args(p)
        for _ in range(2):  # warm every cache with the same tensors, valid
            _call(cp, cp.score_push, args)
            _call(cp, cp.select_blocks, args)
        poisoned = cp._transport.scores_out(REQ * T, W)
        poisoned.fill_(float("nan"))
        edit(args)
        for op in (cp.score_push, cp.select_blocks):
            with pytest.raises(error, match=match):
                _call(cp, op, args)
        assert poisoned.isnan().all(), "something was scored before the check"
        return True

    assert _on_instance(job)[0]


def test_a_warm_plan_form_checks_the_plan():
    p = _problem(60)

    def job(cp, comm):
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=W)
        cp.score_push(p.q, p.index_cache, plan)
        with pytest.raises(ValueError, match=f"plan: changed since plan.. checked it .width {W} "):
            cp.score_push(p.q, p.index_cache, dataclasses.replace(plan, width=W + 1))
        foreign = CPIndexConfig(cache_format="nvfp4", **{**CFG, "max_rows": 12})
        other = testing.make_problem(REQ, MAX_LEN, "nvfp4", query_len=T, width=W).block_table
        with pytest.raises(ValueError, match="plan: made by"):
            cp.score_push(p.q, p.index_cache, Plan(other, p.seq_lens, T, 0, 1, W, None, foreign))
        return True

    assert _on_instance(job)[0]


# ---- torch.ops.cpindex.block_scores ---------------------------------------------------------
def test_op_follows_new_data_and_checks_when_warm():
    op = torch.ops.cpindex.block_scores
    probs = [_problem(seed) for seed in (70, 71)]

    def call(p: testing.Problem, **kw) -> torch.Tensor:
        a = dict(q=p.q, cache=p.index_cache, bt=p.block_table, sl=p.seq_lens, w=W, t=T) | kw
        return op(a["q"], a["cache"], None, a["bt"], a["sl"], 0, 1, a["w"], 128**-0.5, a["t"])

    first = call(probs[0])
    for p in probs * 2:
        got = call(p)
        assert got is not first and torch.equal(got, _want(p))  # a fresh tensor each call
    p = probs[0]
    assert torch.equal(first, _want(p))  # untouched by the calls after it
    with pytest.raises(ValueError, match="iq: data must"):
        call(p, q=_offset(p.q, 1))
    with pytest.raises(ValueError, match="index_cache: data must"):
        call(p, cache=_offset(p.index_cache, 8))
    with pytest.raises(TypeError, match="block_table"):
        call(p, bt=p.block_table.long())
    with pytest.raises(ValueError, match="width"):
        call(p, w=3)
    with pytest.raises(ValueError, match="block_table: row 0"):
        call(_bad_pages(_problem(72)))
    pair = formats.to_nvfp4_pair(p.index_cache)
    got = op(p.q, pair[0], pair[1], p.block_table, p.seq_lens, 0, 1, W, 128**-0.5, T)
    assert torch.equal(got, _want(p))
    assert torch.equal(
        ops.block_scores(p.q, p.index_cache, p.block_table, p.seq_lens, width=W, query_len=T),
        _want(p),
    )


# --------------------------------------------------------------------------- on a GPU
# The host path's caches against the real kernel (docs/design.md, "The host path"): parameter
# images, grid choices, nvfp4 views kept per cache tensor, result views kept per size, verdicts
# memoized by metadata. Fresh random inputs every call, outputs poisoned before every call, each
# result compared with the pure-torch reference of that call's own inputs; tensors changed in
# place (contents and metadata) between calls; one plan across layers; and every check still
# fires, before anything is launched, once the caches are warm.
#
# One rank in the one-process world (``ipc``, ``collective`` and the path below the CP gate), so
# nothing waits on a peer; ``torch.ops.cpindex.block_scores`` on its own.

DEV = "cuda:0"
GPU_REQ, GPU_MAX_LEN, TOPK = 5, 40 * 128, 8  # T: as on the CPU
GPU_W = GPU_MAX_LEN // 128 + 2  # two columns of padding past the longest request
#: The paths a call can take on one GPU: pushed through ipc, collective, scored below the gate.
PATHS = {
    "ipc": dict(transport="ipc", cp_min_blocks=0),
    "collective": dict(transport="collective", cp_min_blocks=0),
    "below-gate": dict(transport="ipc", cp_min_blocks=1 << 40),
}
FORMS = ["bf16", "fp8", "nvfp4", "nvfp4-pair", "nvfp4-interleaved"]


def _problem_gpu(fmt: str, seed: int, requests: int = GPU_REQ) -> testing.Problem:
    """Fresh random inputs; every problem of ``requests`` requests has the same shapes (its
    cache the same page count)."""
    return testing.make_problem(
        requests, GPU_MAX_LEN, fmt, query_len=T, seed=seed, width=GPU_W, device=DEV
    )


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
    cp._transport.scores_out(rows, GPU_W).fill_(float("nan"))
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
        width=GPU_W, query_len=T, topk=TOPK,
    )  # fmt: skip
    sure = unambiguous(full.cpu(), TOPK).to(DEV)
    assert torch.equal(ids[sure], ref[sure])


def _both_forms(cp: IndexCP, p: testing.Problem, q=None, cache=None, plan=None) -> list:
    """score_push and select_blocks, with ``plan`` (default: one made here) and with a plan
    made for the call, each on poisoned outputs; copies of what they returned."""
    q = p.q if q is None else q
    cache = p.index_cache if cache is None else cache
    if plan is None:
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=GPU_W)
    out = []
    for fresh in (False, True):
        _poison(cp, p.rows)
        pl = cp.plan(p.block_table, p.seq_lens, query_len=T, width=GPU_W) if fresh else plan
        scores = cp.score_push(q, cache, pl, tag=2).clone()
        _poison(cp, p.rows)
        ids = cp.select_blocks(q, cache, pl, topk=TOPK, tag=2).clone()
        out.append((scores, ids))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fmt", FORMS)
def test_new_data_every_call(fmt, path):
    probs = [_problem_gpu(fmt, seed) for seed in range(4)] + [_problem_gpu(fmt, 9, requests=3)]

    def job(cp):
        return [_both_forms(cp, p) for p in probs + probs[:1]]  # and back to the first shape

    for p, results in zip(probs + probs[:1], _on_gpu(job, fmt, path), strict=True):
        for scores, ids in results:
            _check(p, scores, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fmt", FORMS)
def test_one_plan_across_layers_gpu(fmt, path):
    p = _problem_gpu(fmt, 20)
    layers = [(lp.q, lp.index_cache) for lp in (_problem_gpu(fmt, s) for s in (21, 22, 23))]

    def job(cp):
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=GPU_W)
        return [_both_forms(cp, p, q, cache, plan) for q, cache in layers * 2]

    for (q, cache), results in zip(layers * 2, _on_gpu(job, fmt, path), strict=True):
        for scores, ids in results:
            _check(p, scores, ids, q, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fmt", FORMS)
def test_tensors_changed_in_place(fmt, path):
    """Contents between calls (the plan refreshed, as the contract asks), then the cache's
    tensor objects given other storage (``set_``): views kept per tensor must follow them."""
    p, other, third = _problem_gpu(fmt, 30), _problem_gpu(fmt, 31), _problem_gpu(fmt, 32)
    parts = [t for t in _split(p.index_cache) if t is not None]
    new_parts = [t for t in _split(third.index_cache) if t is not None]

    def job(cp):
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=GPU_W)
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

    before = _problem_gpu(fmt, 30)
    results = _on_gpu(job, fmt, path)
    for want, q, cache, got in zip(
        (before, other, other), (before.q, other.q, other.q),
        (before.index_cache, other.index_cache, third.index_cache), results, strict=True,
    ):  # fmt: skip
        for scores, ids in got:
            _check(want, scores, ids, q, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["ipc", "below-gate"])
def test_a_cache_shrunk_in_place_is_read_with_its_new_page_count(path):
    """Kept nvfp4 views would still see the old page count: a page past the new one must be
    reported, not read."""
    p = _problem_gpu("nvfp4", 40)
    cache = p.index_cache  # uint8 [pages, 9216]
    last = int(p.block_table[0, 0])  # row 0's first block: scanned

    def job(cp):
        _both_forms(cp, p)
        keep = cache.shape[0]
        cache.set_(cache.untyped_storage(), 0, (last, cache.shape[1]), cache.stride())
        try:
            with pytest.raises(BadBlockTableError):
                plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=GPU_W)
                cp.score_push(p.q, cache, plan)
        finally:
            cache.set_(cache.untyped_storage(), 0, (keep, cache.shape[1]), cache.stride())
        return True

    assert _on_gpu(job, "nvfp4", path)  # error_check="sync": raised by the call itself


@pytest.mark.gpu
def test_returned_views_are_fresh_aliases_gpu():
    p = _problem_gpu("nvfp4", 50)

    def job(cp):
        plan = cp.plan(p.block_table, p.seq_lens, query_len=T, width=GPU_W)
        a = cp.score_push(p.q, p.index_cache, plan)
        a.unsqueeze_(0)  # the caller reshapes what it got, in place
        b = cp.score_push(p.q, p.index_cache, plan)
        assert b.shape == (4, p.rows, GPU_W) and b.data_ptr() == a.data_ptr()
        return b.clone()

    assert_scores(_on_gpu(job, "nvfp4", "ipc"), expected(p, 0, 1))


#: The CPU cases the GPU path must refuse too, and its own (alignment, max_width 64).
GPU_BAD: list[tuple[str, Callable[[dict], None], type, str]] = [
    ("iq misaligned", lambda a: a.update(iq=_offset(a["iq"], 2)), ValueError, "iq: data must"),
    *(b for b in BAD if b[0] in ("iq strides", "cache misaligned", "cache dtype")),
    *(b for b in BAD if b[0] in ("block_table strides", "seq_lens dtype", "init_blocks bool")),
    ("iq rows", lambda a: a.update(iq=a["iq"][:-1]), ValueError, "iq: expected"),
    ("width past max", lambda a: a.update(width=65), ValueError, "width"),
    *(b for b in BAD if b[0] == "tag bool"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bad", GPU_BAD, ids=[b[0] for b in GPU_BAD])
def test_a_warm_cache_skips_no_check_gpu(bad, path):
    _, edit, error, match = bad
    p = _problem_gpu("nvfp4", 60)

    def job(cp):
        for _ in range(2):
            _both_forms(cp, p)
        args = dict(
            iq=p.q, index_cache=p.index_cache, block_table=p.block_table, seq_lens=p.seq_lens,
            init_blocks=0, local_blocks=1, width=GPU_W, query_len=T, tag=2,
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
        assert cp._transport.scores_out(p.rows, GPU_W).isnan().all(), "launched before the check"
        assert (cp._transport.selected_out(p.rows, TOPK)[0] == -1).all()
        _both_forms(cp, p)  # still usable (one rank: a refusal breaks nothing)
        return True

    assert _on_gpu(job, "nvfp4", path)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMS)
def test_op_fresh_output_every_call(fmt):
    op = torch.ops.cpindex.block_scores
    probs = [_problem_gpu(fmt, seed) for seed in (70, 71, 72)]

    def call(p: testing.Problem, q: torch.Tensor | None = None) -> torch.Tensor:
        cache, scales = _split(p.index_cache)
        q = p.q if q is None else q
        return op(q, cache, scales, p.block_table, p.seq_lens, 0, 1, GPU_W, 128**-0.5, T)

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
