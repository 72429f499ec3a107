"""The ``collective`` transport's device-side agreement (:class:`DeviceAgreement`) and its
per-size views, on the CPU.

On a GPU the transport compares the ranks' fingerprints (and replicated heads' query hashes)
beside the gathered queries, with no host sync (tests/test_collective_agreement_gpu.py). The
same torch ops run on the CPU here: directly on made-up trailers, and end to end in the
one-process world with the device agreement switched on for every rank (its record word is
then plain memory) and the call header stripped of the content hashes a GPU header never
carries, so that the device comparison, not the host one, must catch what differs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _gpu import expected, for_rank

from cpindex import BrokenInstanceError, CPIndexConfig, IndexCP, lockstep, reference, testing
from cpindex.comm import Comm
from cpindex.transports.collective import KIND_QUERIES, KIND_TABLES, DeviceAgreement
from cpindex.world import run_threads

# ---- DeviceAgreement on made-up trailers ------------------------------------------------------


def _trailers(fps: list[int], hashes: list[int] | None = None) -> torch.Tensor:
    """Every rank's trailer as the gathered buffer holds it: a strided int64 [W, 2] view."""
    w = len(fps)
    buf = torch.full((w, 6), -5, dtype=torch.int64)  # 4 words of "queries" per slot
    buf[:, 4] = torch.tensor(fps)
    buf[:, 5] = torch.tensor(hashes if hashes is not None else [0] * w)
    return buf[:, 4:]


def _agreement(world: int, rank: int, heads: int) -> DeviceAgreement:
    return DeviceAgreement(world, rank, heads, torch.zeros(3, dtype=torch.int64), 256)


def _compare(a: DeviceAgreement, trailers: torch.Tensor, call: int) -> bool:
    a.compare(a.views(trailers), call)
    return bool(a.bad)


def test_agreeing_ranks_record_nothing():
    for rank in range(4):
        a = _agreement(4, rank, 4)
        assert not _compare(a, _trailers([7, 7, 7, 7]), 1)
        assert a.word.tolist()[0] == 0


@pytest.mark.parametrize("rank", range(4))
def test_table_disagreement_names_the_first_peer_that_differs(rank):
    a = _agreement(4, rank, 4)
    fps = [7, 7, -9, 7]
    assert _compare(a, _trailers(fps), 3)
    kind, peer, call, detail = a.decode(a.word.tolist())
    want_peer = 0 if rank == 2 else 2  # any pair that differs shows against this rank
    assert (kind, peer, call, detail) == (KIND_TABLES, want_peer, 3, fps[want_peer])


def test_the_first_disagreement_stays_recorded():
    a = _agreement(2, 0, 4)
    assert _compare(a, _trailers([1, 2]), 4)
    assert not _compare(a, _trailers([5, 5]), 5)
    assert _compare(a, _trailers([1, 3]), 6)
    assert a.decode(a.word.tolist()) == (KIND_TABLES, 1, 4, 2)
    a.word.zero_()  # what reset() does
    assert _compare(a, _trailers([1, 3]), 1)
    assert a.decode(a.word.tolist()) == (KIND_TABLES, 1, 1, 3)


def test_replicated_heads_compare_their_query_hashes():
    # W = 4, H = 2: ranks 0 and 2 own head 0, ranks 1 and 3 head 1.
    for rank in range(4):
        a = _agreement(4, rank, 2)
        assert not _compare(a, _trailers([7] * 4, [10, 11, 10, 11]), 1)
        assert _compare(a, _trailers([7] * 4, [10, 11, 10, 12]), 2)
        assert a.decode(a.word.tolist()) == (KIND_QUERIES, 3, 2, 12)
    # Tables and queries both differ: the tables are named (they explain best).
    a = _agreement(4, 0, 2)
    assert _compare(a, _trailers([7, 7, 7, 8], [10, 11, 13, 11]), 1)
    assert a.decode(a.word.tolist()) == (KIND_TABLES, 3, 1, 8)


def test_stamp_writes_queries_fingerprint_and_hash():
    from cpindex import fingerprint

    iq = torch.arange(64, dtype=torch.int16).view(2, 32)
    fp = torch.tensor([-3], dtype=torch.int64)
    for heads, want_hash in ((4, None), (2, int(fingerprint.query_hash(iq)))):
        slot = torch.full((128 + 16,), 0xAB, dtype=torch.uint8)
        _agreement(4, 1, heads).stamp(slot, iq, fp)
        assert torch.equal(slot[:128], iq.view(-1).view(torch.uint8))
        assert int(slot[128:136].view(torch.int64)) == -3
        if want_hash is None:  # no replicas: the hash word is not written (nor compared)
            assert slot[136:].tolist() == [0xAB] * 8
        else:
            assert int(slot[136:].view(torch.int64)) == want_hash


# ---- end to end: the one-process world with the device agreement on -------------------------

MAX_ROWS, MAX_WIDTH = 8, 40


def _gpu_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call header as a GPU caller's: no content hashes (the device compares them)."""
    real = lockstep.call_header

    def header(*args: Any, **kw: Any) -> dict[str, Any]:
        h = real(*args, **kw)
        return {**h, "seq_lens": None, "fingerprint": None, "queries": None}

    monkeypatch.setattr(lockstep, "call_header", header)


def _instance(comm: Comm, heads: int) -> IndexCP:
    cfg = CPIndexConfig(
        transport="collective", cache_format="fp8", num_heads=heads, max_rows=MAX_ROWS,
        max_width=MAX_WIDTH, cp_min_blocks=0, timeout_s=10.0,
    )  # fmt: skip
    cp = IndexCP(cfg, device="cpu", comm=comm)
    t = cp._transport
    word = torch.zeros(3, dtype=torch.int64)
    t._use_device_agreement(word, word)
    return cp


def _prob(heads: int, rows: int = 3, max_len: int = 12 * 128, seed: int = 50) -> testing.Problem:
    return testing.make_problem(rows, max_len, "fp8", num_heads=heads, seed=seed)


def _disagree(comm: Comm, *, heads: int, what: str, op: str) -> dict[str, Any]:
    rank, w = comm.rank, comm.world_size
    p = _prob(heads)
    with _instance(comm, heads) as cp:
        iq, table = p.rank_queries(rank, w), p.block_table
        if rank == w - 1:
            if what == "table":
                table = table.clone()
                table[0, [0, 1]] = p.block_table[0, [1, 0]]  # both entries are read
            else:  # the last rank shares its head with another and passes other queries
                iq = (iq.float() * 0.5).to(torch.float8_e4m3fn)
        plan = cp.plan(table, p.seq_lens)
        res: dict[str, Any] = {}
        if op == "score_push":
            res["poisoned"] = bool(cp.score_push(iq, p.index_cache, plan, tag=1).isnan().all())
        else:
            ids, scores = cp.select_blocks(iq, p.index_cache, plan, tag=1, return_scores=True)
            res["poisoned"] = bool(scores.isnan().all()) and bool((ids == -1).all())
        try:
            cp.check()
        except Exception as e:
            res["call"] = f"{type(e).__name__}: {e}"
        try:
            cp.score_push(iq, p.index_cache, plan, tag=2)
        except Exception as e:
            res["next"] = type(e).__name__
        cp.reset()
        res["good"] = cp.score_push(
            p.rank_queries(rank, w), p.index_cache, p.block_table, p.seq_lens
        ).clone()
        cp.check()
    return res


@pytest.mark.parametrize("op", ["score_push", "select_blocks"])
@pytest.mark.parametrize(("what", "world", "heads"), [("table", 2, 4), ("queries", 4, 2)])
def test_disagreement_poisons_and_raises_on_every_rank(monkeypatch, op, what, world, heads):
    _gpu_header(monkeypatch)
    results = run_threads(world, lambda comm: _disagree(comm, heads=heads, what=what, op=op))
    want = expected(_prob(heads), 0, 1)
    for rank, r in enumerate(results):
        assert r["poisoned"], rank
        assert r["call"].startswith("OutOfStepError") and "call 1:" in r["call"], r["call"]
        if what == "table":
            assert "other block-table entries or lengths" in r["call"], r["call"]
        else:
            assert "both own head 1 but passed different iq" in r["call"], r["call"]
        assert r["next"] == BrokenInstanceError.__name__
        assert torch.equal(r["good"], for_rank(want, rank, world).float())


#: (rows, extra width): widths W divides, does not divide, and below W; the cached views of
#: one size must never serve another.
SIZES = [(3, 0), (5, 3), (3, 1), (8, 0), (2, 0), (5, 3)]


def _sizes(comm: Comm, heads: int, agree: bool) -> list[tuple[torch.Tensor, ...]]:
    rank, w = comm.rank, comm.world_size
    cfg = CPIndexConfig(
        transport="collective", cache_format="fp8", num_heads=heads, max_rows=MAX_ROWS,
        max_width=MAX_WIDTH, cp_min_blocks=0, timeout_s=10.0,
    )  # fmt: skip
    outs = []
    with _instance(comm, heads) if agree else IndexCP(cfg, device="cpu", comm=comm) as cp:
        for i, (rows, extra) in enumerate(SIZES):
            p = _prob(heads, rows, 128 * (1 + 7 * (i % 3)), seed=i)
            width = p.width + extra
            q = p.rank_queries(rank, w)
            plan = cp.plan(p.block_table, p.seq_lens, width=width)
            scores = cp.score_push(q, p.index_cache, plan, tag=i).clone()
            ids, vals = cp.select_blocks(q, p.index_cache, plan, topk=4, return_scores=True)
            outs.append((scores, ids.clone(), vals.clone()))
        cp.check()
    return outs


@pytest.mark.parametrize("agree", [True, False])
@pytest.mark.parametrize(("world", "heads"), [(1, 4), (2, 4), (4, 4), (4, 2)])
def test_sizes_change_between_calls(monkeypatch, agree, world, heads):
    _gpu_header(monkeypatch)
    results = run_threads(world, lambda comm: _sizes(comm, heads, agree))
    for i, (rows, extra) in enumerate(SIZES):
        p = _prob(heads, rows, 128 * (1 + 7 * (i % 3)), seed=i)
        width = p.width + extra
        args = (p.q, p.index_cache, p.block_table, p.seq_lens)
        kw = dict(init_blocks=0, local_blocks=1, width=width, sm_scale=128**-0.5)
        want = reference.block_scores(*args, **kw).float()
        want_ids, want_vals = reference.select_blocks(*args, topk=4, return_scores=True, **kw)
        for rank, outs in enumerate(results):
            scores, ids, vals = outs[i]
            assert torch.equal(scores, for_rank(want, rank, world)), (i, rank)
            assert torch.equal(ids, for_rank(want_ids, rank, world)), (i, rank)
            assert torch.equal(vals, for_rank(want_vals.float(), rank, world)), (i, rank)
