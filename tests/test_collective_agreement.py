"""The ``collective`` transport's trailer stamp and its per-size views, on the CPU.

Each rank's slot of the gathered queries ends in a trailer (the plan's fingerprint and, with
replicated heads, a hash of its queries). On the CPU: what the stamp writes. On a GPU (tests
marked ``gpu``, one-process world on one GPU) the scoring kernel compares the trailers with no
host sync: ranks that disagree get NaN outputs (ids -1) and an ``OutOfStepError`` naming the call
from ``check()`` or the next call on every rank (at once with ``error_check="sync"``); ranks that
agree (padding may differ) get the reference. On both: the views (and kernel images) cached per
call size never serve another size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _gpu import DEVICES, assert_scores, expected, for_rank, in_child

from cpindex import BrokenInstanceError, CPIndexConfig, IndexCP, fingerprint, reference, testing
from cpindex.comm import Comm
from cpindex.transports.collective import DeviceAgreement
from cpindex.world import run_threads


def test_stamp_writes_queries_fingerprint_and_hash():
    iq = torch.arange(64, dtype=torch.int16).view(2, 32)
    fp = torch.tensor([-3], dtype=torch.int64)
    for heads, want_hash in ((4, None), (2, int(fingerprint.query_hash(iq)))):
        slot = torch.full((128 + 16,), 0xAB, dtype=torch.uint8)
        DeviceAgreement(4, 1, heads, torch.device("cpu"), 256).stamp(slot, iq, fp)
        assert torch.equal(slot[:128], iq.view(-1).view(torch.uint8))
        assert int(slot[128:136].view(torch.int64)) == -3
        if want_hash is None:  # no replicas: the hash word is not written (nor compared)
            assert slot[136:].tolist() == [0xAB] * 8
        else:
            assert int(slot[136:].view(torch.int64)) == want_hash


def test_the_verdict_mask_is_the_state_words_low_byte():
    a = DeviceAgreement(2, 0, 4, torch.device("cpu"), 256)
    assert not bool(a.bad)
    a.state[1] = 1  # what the kernel writes for a call whose ranks disagree
    assert bool(a.bad)
    a.reset()
    assert a.state.tolist() == [0, 0] and not bool(a.bad)


# --------------------------------------------------------------------------- on a GPU: agreement

DEV = "cuda:0"


def _prob(heads: int = 4) -> testing.Problem:
    return testing.make_problem(3, 12 * 128, "fp8", num_heads=heads, seed=50, device=DEV)


def _cfg(heads: int = 4, **kw: Any) -> CPIndexConfig:
    base = dict(
        transport="collective", cache_format="fp8", num_heads=heads, max_rows=8, max_width=32,
        timeout_s=10.0,
    )  # fmt: skip
    return CPIndexConfig(**{**base, **kw})


def _flipped(table: torch.Tensor) -> torch.Tensor:
    t = table.clone()
    t[0, [0, 1]] = table[0, [1, 0]]  # row 0 is the longest request: both entries are read
    return t


def _outcome(fn) -> str | None:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def _disagree(comm: Comm, *, heads: int, error_check: str, what: str, op: str) -> dict:
    rank, w = comm.rank, comm.world_size
    p = _prob(heads)
    topk = int(op.partition(":")[2] or 16)  # past MAX_FUSED_TOPK: the torch selection
    cfg = _cfg(heads, error_check=error_check, max_topk=max(16, topk))
    with IndexCP(cfg, device=DEV, comm=comm) as cp:
        iq = p.rank_queries(rank, w)
        table = p.block_table.clone()
        if rank == w - 1:
            if what in ("table", "bare plan"):
                table = _flipped(p.block_table)
            elif what == "queries":  # the last rank shares its head with another
                iq = (iq.float() * 0.5).to(torch.float8_e4m3fn)
        plan = cp.plan(table, p.seq_lens)
        if what == "bare plan":  # no fingerprint slot (not made by this instance)
            plan = dataclasses.replace(plan, fingerprint=None)
        if what == "in place" and rank == w - 1:  # the plan's table changes after it was made
            table.copy_(_flipped(table))
        good_plan = cp.plan(p.block_table, p.seq_lens)
        for _ in range(2):  # two calls that agree: the third is call 3
            cp.score_push(p.rank_queries(rank, w), p.index_cache, good_plan)
        res: dict[str, Any] = {}
        if error_check == "sync":
            res["call"] = _outcome(lambda: cp.score_push(iq, p.index_cache, plan, tag=1))
        else:
            if op == "score_push":
                out = cp.score_push(iq, p.index_cache, plan, tag=1)
                torch.cuda.current_stream().synchronize()
                res["poisoned"] = bool(out.isnan().all())
            else:
                ids, scores = cp.select_blocks(
                    iq, p.index_cache, plan, topk=topk, tag=1, return_scores=True
                )
                torch.cuda.current_stream().synchronize()
                res["poisoned"] = bool(scores.isnan().all()) and bool((ids == -1).all())
            res["call"] = _outcome(cp.check)
            res["next"] = _outcome(lambda: cp.score_push(iq, p.index_cache, plan, tag=2))
        cp.reset()
        good = cp.score_push(p.rank_queries(rank, w), p.index_cache, good_plan)
        torch.cuda.current_stream().synchronize()
        res["good"] = good.cpu()
    return res


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("error_check", "op"),
    [
        ("next_call", "score_push"),
        ("next_call", "select_blocks"),
        ("next_call", "select_blocks:20"),
        ("sync", "score_push"),
    ],
)
@pytest.mark.parametrize(
    ("what", "world", "heads"),
    [("table", 2, 4), ("in place", 2, 4), ("bare plan", 2, 4), ("queries", 4, 2)],
)
def test_disagreement_poisons_and_raises_on_every_rank(error_check, op, what, world, heads):
    results = run_threads(
        world,
        lambda comm: _disagree(comm, heads=heads, error_check=error_check, what=what, op=op),
        device=DEV,
    )
    want = expected(_prob(heads), 0, 1).cpu()
    for rank, r in enumerate(results):
        assert r["call"] is not None and r["call"].startswith("OutOfStepError"), (rank, r)
        assert "call 3:" in r["call"], r["call"]
        if what != "queries":
            peer = 0 if rank == world - 1 else world - 1
            assert f"rank {peer} read other block-table entries" in r["call"], r["call"]
        else:  # ranks 1 and 3 own head 1: rank 3's queries are compared with rank 1's
            assert "rank 3's queries differ from rank 1's" in r["call"], r["call"]
        if error_check == "next_call":
            assert r["poisoned"], rank
            assert r["next"].startswith(BrokenInstanceError.__name__), r["next"]
        assert_scores(r["good"], for_rank(want, rank, world))


def _agree(comm: Comm, fingerprint: bool) -> dict:
    """Padding (entries no call reads) differs per rank: no disagreement."""
    rank, w = comm.rank, comm.world_size
    p = _prob()
    table = p.block_table.clone()
    n = (p.seq_lens.long() + 127) // 128
    cols = torch.arange(table.shape[1], device=DEV)
    table[cols >= (n - 1).unsqueeze(1)] = 7000 + rank  # local blocks and padding
    with IndexCP(_cfg(fingerprint=fingerprint), device=DEV, comm=comm) as cp:
        plan = cp.plan(table, p.seq_lens)
        outs = []
        for layer in range(3):
            outs.append(cp.score_push(p.rank_queries(rank, w), p.index_cache, plan, tag=layer))
            torch.cuda.current_stream().synchronize()
            outs[-1] = outs[-1].cpu()
        cp.check()
    return {"outs": outs}


@pytest.mark.gpu
@pytest.mark.parametrize("fingerprint", [True, False])
def test_agreeing_ranks_get_the_reference(fingerprint):
    results = run_threads(2, lambda comm: _agree(comm, fingerprint), device=DEV)
    want = expected(_prob(), 0, 1).cpu()
    for rank, r in enumerate(results):
        for out in r["outs"]:
            assert_scores(out, for_rank(want, rank, 2))


@pytest.mark.gpu
def test_fingerprint_is_computed_on_the_device_without_a_sync():
    """The plan's fingerprint equals the CPU one for the same contents, and making a plan
    inside a graph capture records its computation (replays recompute it)."""
    from cpindex import fingerprint as fp

    p = _prob()
    cpu = torch.zeros(1, dtype=torch.int64)
    fp.plan_fingerprint(p.block_table.cpu(), p.seq_lens.cpu(), 0, 1, cpu)
    dev = torch.zeros(1, dtype=torch.int64, device=DEV)
    table = p.block_table.clone()
    fp.plan_fingerprint(table, p.seq_lens, 0, 1, dev)
    torch.cuda.synchronize()
    assert int(dev.cpu()[0]) == int(cpu[0])
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        fp.plan_fingerprint(table, p.seq_lens, 0, 1, dev)
    table[0, 0] += 1
    graph.replay()
    torch.cuda.synchronize()
    assert int(dev.cpu()[0]) != int(cpu[0])


@pytest.mark.gpu
def test_fingerprint_binding_refuses_mismatched_lengths():
    """The raw binding raises with the sizes in its message (in a child process: such messages
    once crashed the process, binding.cpp)."""
    out = in_child(
        """
        import torch
        from cpindex.kernels import load

        mod = load(torch.device("cuda", 0))
        table = torch.zeros(3, 4, dtype=torch.int32, device="cuda")
        out = torch.zeros(1, dtype=torch.int64, device="cuda")
        try:
            mod.plan_fingerprint(table, torch.zeros(2, dtype=torch.int32, device="cuda"), 0, 1, out)
        except RuntimeError as e:
            print(str(e).splitlines()[0])
        """
    )
    assert out.startswith(
        "plan_fingerprint: seq_lens must be a contiguous int32 [3] tensor on cuda:0"
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("requests", "cols", "init", "local", "view"),
    [(1, 1, 0, 0, False), (8, 300, 0, 1, False), (64, 2048, 1, 3, False), (5, 40, 2, 1, True),
     (3, 17, 9, 0, True)],
)  # fmt: skip
def test_fingerprint_kernel_equals_the_torch_ops(requests, cols, init, local, view):
    """On a GPU the plan fingerprint is one kernel launch: the same int64 as the torch ops
    (the CPU's), for ragged lengths (0, shorter than the local blocks, past the table), any
    int32 entries, and a table whose rows are a wider tensor's (row stride > cols)."""
    from cpindex import fingerprint as fp

    g = torch.Generator().manual_seed(requests * 1000 + cols)
    wide = torch.randint(-(2**31), 2**31 - 1, (requests, cols + 5 * view), generator=g,
                         dtype=torch.int32)  # fmt: skip
    table = wide[:, :cols]
    lens = torch.randint(0, 128 * (cols + 2), (requests,), generator=g, dtype=torch.int32)
    lens[0] = 128 * cols + 1  # past the table
    lens[-1] = 0
    cpu = torch.zeros(1, dtype=torch.int64)
    fp.plan_fingerprint(table, lens, init, local, cpu)
    dev_table = wide.to(DEV)[:, :cols]
    assert fp._kernel(dev_table, lens.to(DEV)) is not None
    dev = torch.full((1,), 12345, dtype=torch.int64, device=DEV)
    fp.plan_fingerprint(dev_table, lens.to(DEV), init, local, dev)
    assert int(dev.cpu()[0]) == int(cpu[0])


# --------------------------------------------------------------------------- per-size views

#: (rows, extra width): widths W divides, does not divide, and below W; the views and kernel
#: images cached for one size must never serve another.
SIZES = [(3, 0), (5, 3), (3, 1), (8, 0), (2, 0), (5, 3)]


def _sizes_prob(heads: int, i: int, rows: int, device: str) -> testing.Problem:
    return testing.make_problem(rows, 128 * (1 + 7 * (i % 3)), "fp8", num_heads=heads, seed=i,
                                device=device)  # fmt: skip


def _sizes(comm: Comm, heads: int, device: str) -> list[tuple[torch.Tensor, ...]]:
    rank, w = comm.rank, comm.world_size
    outs = []
    with IndexCP(_cfg(heads, max_width=40, cp_min_blocks=0), device=device, comm=comm) as cp:
        if device != "cpu":
            assert cp._transport.agree_on_device
        for i, (rows, extra) in enumerate(SIZES):
            p = _sizes_prob(heads, i, rows, device)
            q = p.rank_queries(rank, w)
            plan = cp.plan(p.block_table, p.seq_lens, width=p.width + extra)
            scores = cp.score_push(q, p.index_cache, plan, tag=i).clone()
            ids, vals = cp.select_blocks(q, p.index_cache, plan, topk=4, return_scores=True)
            if device != "cpu":
                torch.cuda.current_stream().synchronize()
            outs.append((scores.cpu(), ids.clone().cpu(), vals.clone().cpu()))
        cp.check()
    return outs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("world", "heads"), [(1, 4), (2, 4), (4, 4), (4, 2)])
def test_sizes_change_between_calls(world, heads, device):
    """On the CPU the outputs equal the reference bit for bit (ids too); on a GPU the scores are
    within fp32 summation noise of it."""
    results = run_threads(world, lambda comm: _sizes(comm, heads, device), device=device)
    for i, (rows, extra) in enumerate(SIZES):
        p = _sizes_prob(heads, i, rows, device)
        args = (p.q, p.index_cache, p.block_table, p.seq_lens)
        kw = dict(init_blocks=0, local_blocks=1, width=p.width + extra, sm_scale=128**-0.5)
        want = reference.block_scores(*args, **kw).float().cpu()
        want_ids, want_vals = reference.select_blocks(*args, topk=4, return_scores=True, **kw)
        want_ids, want_vals = want_ids.cpu(), want_vals.float().cpu()
        for rank, outs in enumerate(results):
            scores, ids, vals = outs[i]
            if device == "cpu":
                assert torch.equal(scores, for_rank(want, rank, world)), (i, rank)
                assert torch.equal(ids, for_rank(want_ids, rank, world)), (i, rank)
                assert torch.equal(vals, for_rank(want_vals, rank, world)), (i, rank)
            else:
                assert_scores(scores, for_rank(want, rank, world))
                assert_scores(vals, for_rank(want_vals, rank, world))
