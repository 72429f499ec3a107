"""The CP gate (docs/design.md, "CP per call: the gate"): on the CPU in real gloo processes, on
one GPU (tests marked ``gpu``, below) in the one-process world.

One spawn of 4 processes runs every scenario on the world group (W = 4) and then on a group of
ranks 0 and 1 (W = 2); the checks run here, in the test process. A threshold of
:data:`THRESHOLD` blocks (``requests * width``) splits the cases: both paths must equal the
reference bit for bit (on the CPU both score with it), in the transport's own views; below the
gate a call takes no header round, completes while its peers make no call, and a rank's bad
input there stays its own; at or above it the lockstep checks still hold.
"""

from __future__ import annotations

import functools
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _gpu import (
    FORMATS,
    assert_scores,
    expected,
    for_rank,
    kernel_copy,
    settle,
    unambiguous,
)

from cpindex import BadBlockTableError, CPIndexConfig, IndexCP, gate, partition, reference, testing
from cpindex.comm import Comm, TorchComm
from cpindex.spawn import spawn_processes
from cpindex.world import in_turn, run_threads

THRESHOLD = 24
TOPK = 4
SPAWN_TIMEOUT_S = 120.0  # a failure bound for the whole spawn, not its expected time


@dataclass(frozen=True)
class Case:
    name: str
    requests: int
    width: int
    query_len: int
    fmt: str = "nvfp4"
    heads: int = 4
    init: int = 0
    local: int = 1

    @property
    def cp(self) -> bool:
        return self.requests * self.width >= THRESHOLD

    def problem(self) -> testing.Problem:
        p = testing.make_problem(
            self.requests, (self.width - 2) * 128 + 5, self.fmt, query_len=self.query_len,
            num_heads=self.heads, seed=sum(self.name.encode()),
        )  # fmt: skip
        p.width = self.width  # past the longest request's blocks: -inf columns too
        return p


CASES = (
    Case("T1-below", 2, 11, 1),  # 22 blocks
    Case("T1-at", 2, 12, 1),  # 24: context-parallel from here
    Case("T4-below", 1, 20, 4, init=1),
    Case("T4-above", 3, 12, 4, local=2),
    Case("fp8-replicated-below", 2, 9, 1, fmt="fp8", heads=2),  # W = 4: two ranks per head
    Case("fp8-replicated-above", 3, 10, 4, fmt="fp8", heads=2),
)
SMALL = Case("small", 2, 10, 1)  # 20 blocks: below
BIG = Case("big", 2, 14, 1)  # 28 blocks: above


def _cfg(fmt: str = "nvfp4", heads: int = 4, **kw: Any) -> CPIndexConfig:
    base = dict(
        cache_format=fmt, num_heads=heads, max_rows=16, max_width=24, max_topk=16,
        cp_min_blocks=THRESHOLD, timeout_s=5.0,
    )  # fmt: skip
    return CPIndexConfig(**{**base, **kw})


def _args(p: testing.Problem, case: Case, rank: int, world: int) -> tuple:
    return (
        p.rank_queries(rank, world), p.index_cache, p.block_table, p.seq_lens, case.init,
        case.local, p.width,
    )  # fmt: skip


def _call(cp: IndexCP, args: tuple, op: str = "score_push", query_len: int = 1, **kw):
    """``op`` on :func:`_args`' tuple, through a plan made for this call."""
    iq, cache, table, lens, init, local, width = args
    plan = cp.plan(
        table, lens, query_len=query_len, init_blocks=init, local_blocks=local, width=width
    )
    return getattr(cp, op)(iq, cache, plan, **kw)


def _rounds(cp: IndexCP) -> int:
    """Header rounds this group has taken so far (every context-parallel call takes one)."""
    return cp.comm.counters.get("call", 0)


def _expect(name: str, fn) -> str:
    """Runs ``fn``; the name of the exception it raised (with its message), or 'none'."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "none"


# ---- the ranks ------------------------------------------------------------------------------


def _calls(rank: int, world: int, group) -> dict:
    """Every case, score_push and select_blocks, with a plan reused and one made per call;
    outputs kept with where they live and whether a header round ran."""
    out: dict[str, Any] = {}
    cps: dict[tuple[str, int], IndexCP] = {}
    for case in CASES:
        if case.heads < 4 and world < 4:
            continue
        key = (case.fmt, case.heads)
        if key not in cps:
            cps[key] = IndexCP(_cfg(case.fmt, case.heads), group=group, device="cpu")
        cp = cps[key]
        p = case.problem()
        args = _args(p, case, rank, world)
        plan = cp.plan(
            p.block_table, p.seq_lens, query_len=case.query_len, init_blocks=case.init,
            local_blocks=case.local, width=p.width,
        )  # fmt: skip
        t = cp._transport
        before = _rounds(cp)
        scores = cp.score_push(args[0], args[1], plan, tag=7)
        kept = scores.clone()  # the view is the next call's too
        after_push = _rounds(cp)
        ids, vals = cp.select_blocks(args[0], args[1], plan, topk=TOPK, return_scores=True)
        after_select = _rounds(cp)
        again = _call(cp, args, query_len=case.query_len)  # a plan made for the call
        out[case.name] = {
            "uses_cp": cp.uses_cp(plan),
            "uses_cp_sizes": cp.uses_cp((case.requests, case.width)),
            "scores": kept,
            "again": again.clone(),
            "ids": ids.clone(),
            "vals": vals.clone(),
            "rounds": [after_push - before, after_select - after_push],
            "same_views": [
                scores.data_ptr() == t.scores_out(p.rows, p.width).data_ptr(),
                ids.data_ptr() == t.selected_out(p.rows, TOPK)[0].data_ptr(),
                vals.data_ptr() == t.selected_out(p.rows, TOPK)[1].data_ptr(),
            ],
        }
    for cp in cps.values():
        out["threshold"] = cp.cp_min_blocks
        cp.close()
    return out


def _lone(rank: int, world: int, group) -> dict:
    """Below the gate, rank 0 calls while its peers make no call: they wait for it at a
    barrier, so a call that waited for them would never return (it would time out). Then the
    peers make the same call, and a context-parallel call finds every rank in step."""
    res: dict[str, Any] = {}
    with IndexCP(_cfg(), group=group, device="cpu") as cp:
        p, pb = SMALL.problem(), BIG.problem()
        if rank == 0:
            t0 = time.monotonic()
            res["lone"] = _call(cp, _args(p, SMALL, rank, world)).clone()
            res["lone_s"] = time.monotonic() - t0
            dist.barrier(group=group)
        else:
            dist.barrier(group=group)
            time.sleep(0.1)  # rank 0 is done and gone on meanwhile
            res["lone"] = _call(cp, _args(p, SMALL, rank, world)).clone()
        res["after"] = _call(cp, _args(pb, BIG, rank, world)).clone()
    return res


def _refusals(rank: int, world: int, group) -> dict:
    """A rank's bad input below the gate is its own: it raises there only, is not counted, and
    the instance goes on; tags are not compared below the gate. At or above it, the lockstep
    checks hold: other tags, other shapes."""
    res: dict[str, Any] = {}
    with IndexCP(_cfg(), group=group, device="cpu") as cp:
        p, pb = SMALL.problem(), BIG.problem()
        args = _args(p, SMALL, rank, world)
        if rank == 0:
            bad = (args[0].float(), *args[1:])
            res["bad_input"] = _expect("bad iq", lambda: _call(cp, bad))
            res["bad_plan"] = _expect(
                "bad plan", lambda: cp.plan(p.block_table.long(), p.seq_lens, width=p.width)
            )
        res["good"] = _call(cp, args).clone()
        res["tags_below"] = _expect("tags", lambda: _call(cp, args, tag=100 + rank))
        bargs = _args(pb, BIG, rank, world)
        res["after"] = _call(cp, bargs).clone()
        res["tags_above"] = _expect("tags", lambda: _call(cp, bargs, tag=100 + rank))
        cp.reset()
        if rank == 0:  # a wider call on rank 0: both above the gate, other shapes
            wide = (*bargs[:-1], BIG.width + 1)
            res["shapes_above"] = _expect("shapes", lambda: _call(cp, wide))
        else:
            res["shapes_above"] = _expect("shapes", lambda: _call(cp, bargs))
        cp.reset()
        res["after_reset"] = _call(cp, bargs).clone()
    return res


def _construction(rank: int, world: int, group) -> dict:
    """cp_min_blocks is shared: a rank with another value makes every rank refuse the
    construction. ``auto`` on the CPU resolves to 0 (every call goes through the exchange)."""
    res: dict[str, Any] = {}
    res["differs"] = _expect(
        "differs", lambda: IndexCP(_cfg(cp_min_blocks=THRESHOLD + rank), group=group, device="cpu")
    )
    mixed = "auto" if rank == 0 else 0
    res["auto_vs_0"] = _expect(
        "auto vs 0", lambda: IndexCP(_cfg(cp_min_blocks=mixed), group=group, device="cpu")
    )
    with IndexCP(_cfg(cp_min_blocks="auto"), group=group, device="cpu") as cp:
        res["auto"] = (cp.cp_min_blocks, cp.gate.source, cp.uses_cp((1, 1)))
    return res


def gloo_rank(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # 4 processes share CI's cores
    pair = dist.new_group([0, 1])  # every rank takes part in making it
    res: dict[Any, Any] = {}
    try:
        for w, group in ((4, None), (2, pair)):
            if rank < w:
                res[w] = {
                    "calls": _calls(rank, w, group),
                    "lone": _lone(rank, w, group),
                    "refusals": _refusals(rank, w, group),
                    "construction": _construction(rank, w, group),
                    "comm_rank": TorchComm(group).rank,
                }
            dist.barrier()
    except BaseException:
        res = {"error": traceback.format_exc()}
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


# ---- the checks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Every rank's results, from one spawn for the whole module (a failure is cached too)."""
    d = tmp_path_factory.mktemp("gate-gloo")
    spawn_processes(4, gloo_rank, str(d), backend="gloo", timeout_s=SPAWN_TIMEOUT_S)
    got = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for r, res in enumerate(got):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return got


@functools.cache
def _reference(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every head's reference scores, ids and values for ``case``."""
    p = case.problem()
    kw = dict(
        init_blocks=case.init, local_blocks=case.local, width=p.width,
        query_len=case.query_len,
    )  # fmt: skip
    scores = reference.block_scores(p.q, p.index_cache, p.block_table, p.seq_lens, **kw)
    ids, vals = reference.select_blocks(
        p.q, p.index_cache, p.block_table, p.seq_lens, **kw, topk=TOPK, return_scores=True
    )
    return scores, ids, vals


def _want(case: Case, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s heads' rows of the reference."""
    heads = partition.heads_of_rank(rank, case.heads, world)
    scores, ids, vals = _reference(case)
    return {"scores": scores[heads], "ids": ids[heads], "vals": vals[heads]}


@pytest.mark.parametrize("world", [2, 4])
def test_both_paths_equal_the_reference(results, world):
    for rank in range(world):
        calls = results[rank][world]["calls"]
        assert calls["threshold"] == THRESHOLD
        for case in CASES:
            if case.heads < 4 and world < 4:
                continue
            got, want = calls[case.name], _want(case, rank, world)
            where = f"rank {rank}/{world}, {case.name}"
            assert got["uses_cp"] == got["uses_cp_sizes"] == case.cp, where
            for k in ("scores", "ids", "vals"):
                assert torch.equal(got[k], want[k]), f"{where}: {k} differ from the reference"
            assert torch.equal(got["again"], want["scores"]), where
            # the same views as the transport's, and a header round exactly when CP
            assert got["same_views"] == [True, True, True], where
            assert got["rounds"] == ([1, 1] if case.cp else [0, 0]), where


@pytest.mark.parametrize("world", [2, 4])
def test_below_the_gate_a_call_needs_no_peer(results, world):
    for rank in range(world):
        lone = results[rank][world]["lone"]
        want_small = _want(SMALL, rank, world)["scores"]
        want_big = _want(BIG, rank, world)["scores"]
        assert torch.equal(lone["lone"], want_small), rank
        assert torch.equal(lone["after"], want_big), rank
    assert results[0][world]["lone"]["lone_s"] < 5.0  # well inside timeout_s: nothing waited


@pytest.mark.parametrize("world", [2, 4])
def test_refusals_below_stay_local_and_lockstep_holds_above(results, world):
    for rank in range(world):
        res = results[rank][world]["refusals"]
        if rank == 0:
            assert res["bad_input"].startswith("TypeError: iq: expected"), res["bad_input"]
            assert res["bad_plan"].startswith("TypeError: block_table"), res["bad_plan"]
        assert torch.equal(res["good"], _want(SMALL, rank, world)["scores"])
        assert res["tags_below"] == "none", res["tags_below"]  # nothing is compared below
        big = _want(BIG, rank, world)["scores"]
        assert torch.equal(res["after"], big)
        assert res["tags_above"].startswith("OutOfStepError") and "tag 10" in res["tags_above"]
        assert res["shapes_above"].startswith("OutOfStepError"), res["shapes_above"]
        assert "width" in res["shapes_above"], res["shapes_above"]
        assert torch.equal(res["after_reset"], big)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_min_blocks_is_shared_and_auto_is_0_on_cpu(results, world):
    for rank in range(world):
        res = results[rank][world]["construction"]
        assert res["differs"].startswith("ConfigMismatchError"), res["differs"]
        assert "cp_min_blocks" in res["differs"]
        assert res["auto_vs_0"].startswith("ConfigMismatchError"), res["auto_vs_0"]
        assert res["auto"] == (0, "shared device", True)


def test_one_rank_never_goes_context_parallel():
    """W = 1: ``auto`` scores locally (no header round); an explicit 0 still takes the
    exchange's path. Both equal the reference."""
    case = Case("one-rank", 2, 12, 2, init=1)
    p = case.problem()
    want = _want(case, 0, 1)

    def body(comm):
        out = {}
        for value in ("auto", 0):
            with IndexCP(_cfg(cp_min_blocks=value), device="cpu", comm=comm) as cp:
                before = _rounds(cp)
                got = _call(cp, _args(p, case, 0, 1), query_len=case.query_len).clone()
                ids, vals = _call(
                    cp, _args(p, case, 0, 1), "select_blocks", case.query_len, topk=TOPK,
                    return_scores=True,
                )  # fmt: skip
                out[value] = (cp.cp_min_blocks, _rounds(cp) - before, got, ids.clone(), vals)
        return out

    out = run_threads(1, body)[0]
    never = 16 * 24 + 1  # max_rows * max_width + 1: past every call
    assert out["auto"][:2] == (never, 0) and out[0][:2] == (0, 2)
    for value in ("auto", 0):
        _, _, got, ids, vals = out[value]
        assert torch.equal(got, want["scores"]) and torch.equal(ids, want["ids"]), value
        assert torch.equal(vals, want["vals"]), value


def test_uses_cp_refuses_bad_sizes():
    def body(comm):
        with IndexCP(_cfg(), device="cpu", comm=comm) as cp:
            return [
                _expect("t", lambda: cp.uses_cp((1, 2, 3))),
                _expect("t", lambda: cp.uses_cp((0, 5))),
                _expect("t", lambda: cp.uses_cp(5)),
                cp.uses_cp((2, 12)),
                cp.uses_cp((2, 11)),
            ]

    got = run_threads(1, body)[0]
    assert got[0].startswith("TypeError: plan_or_sizes") and got[2].startswith("TypeError")
    assert got[1].startswith("ValueError: plan_or_sizes")
    assert got[3:] == [True, False]


def test_config_field():
    assert CPIndexConfig().cp_min_blocks == "auto"
    assert CPIndexConfig.from_env({"CPINDEX_CP_MIN_BLOCKS": "4096"}).cp_min_blocks == 4096
    assert CPIndexConfig.from_env({"CPINDEX_CP_MIN_BLOCKS": "auto"}).cp_min_blocks == "auto"
    for bad in (-1, True, 2.5, "some", None):
        with pytest.raises(ValueError, match="cp_min_blocks"):
            CPIndexConfig(cp_min_blocks=bad)


# ---- the model (gate.py's docstring) ---------------------------------------------------------


@pytest.mark.parametrize("transport", ["ipc", "mori", "collective"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_model_gives_each_op_its_crossover(transport, fmt, world):
    """Each op's threshold is the fewest blocks from which the model's CP time (its fixed
    costs, the scan of 1/W of the pages) is below the local time (its fixed costs, the scan of
    every page): at it CP is not slower, one block below it CP is slower."""
    bw = 3.35e12
    g = gate.modeled(fmt, transport, world, bw)
    kind = "collective" if transport == "collective" else "push"
    t_ex = gate.DEFAULT_EXCHANGE_S[transport]
    assert g.t_exchange_s == t_ex and g.page_bytes == gate.page_bytes(fmt) and g.source == "model"
    for i, op in enumerate(gate.OPS):
        launches = gate.LAUNCHES[kind][op] - gate.LAUNCHES["local"][op]
        extra = t_ex + launches * gate.LAUNCH_S
        assert g.extra_s[i] == pytest.approx(extra)
        b = g.threshold_for(op)
        scan = g.page_bytes / bw  # seconds per block
        local = gate.LAUNCHES["local"][op] * gate.LAUNCH_S
        cp = local + extra
        assert cp + b * scan / world <= local + b * scan + 1e-15, (op, b)
        assert cp + (b - 1) * scan / world > local + (b - 1) * scan, (op, b)
        assert g.uses_cp(b, op) and not g.uses_cp(b - 1, op)
    # push: select_blocks' local path pays a launch the push does not: it crosses first
    score, select = g.threshold, g.select_threshold
    assert (select < score) if kind == "push" else (select == score)


def test_gate_thresholds_per_op():
    one = gate.Gate(40, "config")
    assert one.threshold_for("select_blocks") == one.threshold_for("score_push") == 40
    assert one.uses_cp(40, "select_blocks") and not one.uses_cp(39)
    two = gate.Gate(40, "model", select_threshold=25)
    assert two.uses_cp(30, "select_blocks") and not two.uses_cp(30, "score_push")
    assert gate.crossover_blocks(-1e-6, 3e12, 9216, 4) == 0  # CP has no extra cost: always
    with pytest.raises(ValueError, match="world"):
        gate.crossover_blocks(1e-5, 3e12, 9216, 1)
    assert gate.disagreement_note(gate.Gate(0, "shared device")) is None
    note = gate.disagreement_note(two)
    assert "fewer than 40 blocks (25 for select_blocks)" in note and "below the CP gate" in note


def test_each_op_takes_its_own_threshold(monkeypatch):
    """A gate whose thresholds differ (score_push 24 blocks, select_blocks 30): a call of 28
    blocks pushes its scores context-parallel (a header round) and selects locally (none); one
    of 32 blocks does both context-parallel. Every result is the reference's."""
    monkeypatch.setattr(
        gate, "resolve", lambda *a: gate.Gate(THRESHOLD, "model", select_threshold=30)
    )
    mid, big = Case("mid", 2, 14, 1), Case("big", 2, 16, 1)

    def body(comm):
        out = {}
        with IndexCP(_cfg(), device="cpu", comm=comm) as cp:
            for case in (mid, big):
                p = case.problem()
                args = _args(p, case, comm.rank, comm.world_size)
                before = _rounds(cp)
                scores = _call(cp, args).clone()
                pushed = _rounds(cp)
                ids, vals = _call(cp, args, "select_blocks", topk=TOPK, return_scores=True)
                out[case.name] = {
                    "rounds": [pushed - before, _rounds(cp) - pushed],
                    "scores": scores,
                    "ids": ids.clone(),
                    "vals": vals.clone(),
                }
        return out

    res = run_threads(2, body)
    for rank, out in enumerate(res):
        assert out["mid"]["rounds"] == [1, 0] and out["big"]["rounds"] == [1, 1], out
        for case in (mid, big):
            want = _want(case, rank, 2)
            for k in ("scores", "ids", "vals"):
                assert torch.equal(out[case.name][k], want[k]), (rank, case.name, k)


def test_auto_on_distinct_devices_measures_and_agrees(monkeypatch):
    """Ranks placed on distinct devices run the model (CPU ranks told here that they are on
    distinct GPUs): ``collective`` times its rounds, adds each op's launch difference, and
    every rank holds the largest measurement's two thresholds."""
    import threading

    monkeypatch.setattr(gate, "_placement", lambda device: ("host", threading.get_ident()))

    def body(comm):
        with IndexCP(_cfg(cp_min_blocks="auto"), device="cpu", comm=comm) as cp:
            g = cp.gate
            return g.source, g.threshold, g.select_threshold, g.extra_s, g.t_exchange_s

    got = run_threads(2, body)
    assert got[0] == got[1]
    source, score, select, extra, t_ex = got[0]
    assert source == "measured" and t_ex > 0
    assert extra == pytest.approx(gate.extra_costs(t_ex, "collective"))
    page = gate.page_bytes("nvfp4")
    assert score == gate.crossover_blocks(extra[0], gate.DEFAULT_BANDWIDTH, page, 2)
    assert select == gate.crossover_blocks(extra[1], gate.DEFAULT_BANDWIDTH, page, 2)


# --------------------------------------------------------------------------- on a GPU
# The CP gate on one GPU: the one-process world, W = 4, ``ipc``.
#
# Below the threshold each rank runs the fused kernel in local mode for its own heads, writing into
# the transport's own views; at or above it the push runs as before. Checked: both sides equal the
# reference and the always-CP path bit for bit (score_push and select_blocks, T = 1 and 4); below
# it rank 0 calls while the others make no call, and the device call count (the handshake's) does
# not move; a device error of a call below the gate (a page outside the cache) is raised on that
# rank only, naming it, and leaves every instance usable; captured graphs take the same path at
# every replay (a graph of calls below the gate replays on rank 0 alone); ``auto`` is 0 in this
# world.
#
# The rules of the one-process world apply (docs/design.md): results are copied with kernels into
# buffers allocated before the first push, and every rank synchronizes and meets at a barrier
# after each selection below the gate (torch's top-k may allocate) and before host comparisons.

DEV = "cuda:0"
W = 4
GPU_THRESHOLD = 64
GPU_TOPK = 16


def _ipc_cfg(fmt: str = "nvfp4", **kw) -> CPIndexConfig:
    base = dict(
        transport="ipc", cache_format=fmt, max_rows=32, max_query_len=4, max_width=64,
        max_topk=GPU_TOPK, cp_min_blocks=GPU_THRESHOLD, timeout_s=10.0,
    )  # fmt: skip
    return CPIndexConfig(**{**base, **kw})


def _problem(requests: int, width: int, fmt: str, t: int, seed: int) -> testing.Problem:
    """Ragged lengths up to ``width - 1`` blocks; ``width`` columns (the last ones -inf)."""
    p = testing.make_problem(requests, (width - 1) * 128, fmt, query_len=t, seed=seed)
    p.width = width
    return p.to(DEV)


def _device_calls(cp: IndexCP) -> torch.Tensor:
    """The push handshake's device call count (the first word of this rank's region)."""
    return cp._transport.engine.local[:8].view(torch.int64)


def _cases(fmt: str, t: int) -> list[tuple[testing.Problem, bool]]:
    """(problem, goes context-parallel) on either side of THRESHOLD, and at it."""
    sizes = [(2, 20), (2, 32), (4, 24)] if t == 1 else [(1, 40), (4, 16), (6, 20)]
    return [
        (_problem(r, w, fmt, t, seed=10 * i + t), r * w >= GPU_THRESHOLD)
        for i, (r, w) in enumerate(sizes)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t", [1, 4])
def test_both_sides_equal_the_reference_and_the_cp_path(fmt, t):
    cases = _cases(fmt, t)
    assert [cp for _, cp in cases] == [False, True, True]

    def body(comm: Comm):
        r = comm.rank
        with (
            IndexCP(_ipc_cfg(fmt), device=DEV, comm=comm) as gated,
            IndexCP(_ipc_cfg(fmt, cp_min_blocks=0), device=DEV, comm=comm) as always,
        ):
            out = []
            keep = []
            for p, _ in cases:
                hpr = gated.heads_per_rank
                keep.append(
                    {
                        k: (
                            torch.empty(hpr, p.rows, p.width, device=DEV),
                            torch.empty(hpr, p.rows, GPU_TOPK, dtype=torch.int32, device=DEV),
                            torch.empty(hpr, p.rows, GPU_TOPK, device=DEV),
                        )
                        for k in ("gated", "always")
                    }
                )
            settle(comm)  # every allocation done before the first push
            for (p, _), kept in zip(cases, keep, strict=True):
                q = p.rank_queries(r, W)
                for name, cp in (("gated", gated), ("always", always)):
                    s_, i_, v_ = kept[name]
                    plan = cp.plan(p.block_table, p.seq_lens, query_len=t, width=p.width)
                    args = (q, p.index_cache, plan)
                    scores = cp.score_push(*args)
                    kernel_copy(s_, scores)
                    scores.fill_(float("nan"))  # the next call must write what it returns
                    ids, vals = cp.select_blocks(*args, topk=GPU_TOPK, return_scores=True)
                    kernel_copy(i_, ids)
                    kernel_copy(v_, vals)
                    ids.fill_(-7)
                    settle(comm)  # a selection below the gate may allocate: nobody pushes now
            gated.check()
            always.check()
            for (p, _), kept in zip(cases, keep, strict=True):
                out.append(
                    {
                        "uses_cp": gated.uses_cp((p.requests, p.width)),
                        **{k: tuple(x.cpu() for x in v) for k, v in kept.items()},
                    }
                )
            return out

    res = run_threads(W, body, device=DEV)
    for rank in range(W):
        for (p, cp), got in zip(cases, res[rank], strict=True):
            where = f"rank {rank}, {p.requests} x {p.width}, T={t}"
            assert got["uses_cp"] == cp, where
            for a, b in zip(got["gated"], got["always"], strict=True):
                assert torch.equal(a, b), f"{where}: the gate's path differs from CP's"
            scores, ids, _ = got["gated"]
            assert_scores(scores, for_rank(expected(p, 0, 1), rank, W).cpu())
            ref = reference.select_blocks(
                p.q.cpu(), p.index_cache.cpu(), p.block_table.cpu(), p.seq_lens.cpu(),
                init_blocks=0, local_blocks=1, width=p.width, query_len=t, topk=GPU_TOPK,
            )  # fmt: skip
            ok = unambiguous(scores, GPU_TOPK)
            assert torch.equal(ids[ok], for_rank(ref, rank, W)[ok]), where


@pytest.mark.gpu
def test_below_the_gate_rank_0_calls_alone():
    """Rank 0 calls below the gate while the others wait at a barrier (a call that waited for
    them would time out); the handshake's device count does not move. Then the others make the
    same calls and a context-parallel call finds every rank in step. ``auto`` is 0 here."""
    small = _problem(2, 20, "nvfp4", 1, seed=3)
    big = _problem(4, 20, "nvfp4", 1, seed=4)

    def body(comm: Comm):
        r = comm.rank
        with IndexCP(_ipc_cfg(cp_min_blocks="auto"), device=DEV, comm=comm) as cp:
            auto = (cp.cp_min_blocks, cp.gate.source)
        with IndexCP(_ipc_cfg(), device=DEV, comm=comm) as cp:
            hpr = cp.heads_per_rank
            lone = torch.empty(hpr, small.rows, small.width, device=DEV)
            ids = torch.empty(hpr, small.rows, GPU_TOPK, dtype=torch.int32, device=DEV)
            after = torch.empty(hpr, big.rows, big.width, device=DEV)
            count = torch.empty(2, dtype=torch.int64, device=DEV)
            sargs = (
                small.rank_queries(r, W), small.index_cache,
                cp.plan(small.block_table, small.seq_lens, width=small.width),
            )  # fmt: skip
            settle(comm)

            def alone():
                kernel_copy(count[0:1], _device_calls(cp))
                kernel_copy(lone, cp.score_push(*sargs))
                kernel_copy(ids, cp.select_blocks(*sargs, topk=GPU_TOPK))
                kernel_copy(count[1:2], _device_calls(cp))
                torch.cuda.current_stream().synchronize()
                cp.check()

            if r == 0:
                alone()
                comm.barrier()
            else:
                comm.barrier()
                alone()
            settle(comm)
            bargs = (
                big.rank_queries(r, W), big.index_cache,
                cp.plan(big.block_table, big.seq_lens, width=big.width),
            )  # fmt: skip
            kernel_copy(after, cp.score_push(*bargs))
            settle(comm)
            cp.check()
            return auto, lone.cpu(), ids.cpu(), after.cpu(), count.cpu().tolist()

    res = run_threads(W, body, device=DEV)
    for rank, (auto, lone, ids, after, count) in enumerate(res):
        assert auto == (0, "shared device")
        assert count[0] == count[1], f"rank {rank}: a call below the gate moved the handshake"
        assert_scores(lone, for_rank(expected(small, 0, 1), rank, W).cpu())
        ok = unambiguous(lone, GPU_TOPK)
        assert torch.equal(ids[ok], for_rank(_select(small), rank, W)[ok])
        assert_scores(after, for_rank(expected(big, 0, 1), rank, W).cpu())


def _select(p: testing.Problem) -> torch.Tensor:
    return reference.select_blocks(
        p.q.cpu(), p.index_cache.cpu(), p.block_table.cpu(), p.seq_lens.cpu(), init_blocks=0,
        local_blocks=1, width=p.width, query_len=p.query_len, topk=GPU_TOPK,
    )  # fmt: skip


@pytest.mark.gpu
def test_a_bad_page_below_the_gate_is_that_ranks_own():
    """Rank 1 names a page outside the cache in a call below the gate: its next check raises
    BadBlockTableError naming rank 1 (not the local kernel's rank 0 of a world of one), once;
    every rank, rank 1 included, goes on with a context-parallel call."""
    small = _problem(2, 20, "fp8", 1, seed=5)
    big = _problem(4, 20, "fp8", 1, seed=6)
    bad_table = small.block_table.clone()
    bad_table[0, 0] = 1 << 30  # scanned (init_blocks 0), far past the cache

    def body(comm: Comm):
        r = comm.rank
        with IndexCP(_ipc_cfg("fp8"), device=DEV, comm=comm) as cp:
            after = torch.empty(cp.heads_per_rank, big.rows, big.width, device=DEV)
            table = bad_table if r == 1 else small.block_table
            q = small.rank_queries(r, W)
            settle(comm)
            cp.score_push(q, small.index_cache, cp.plan(table, small.seq_lens))
            torch.cuda.current_stream().synchronize()
            try:
                cp.check()
                first = None
            except BadBlockTableError as e:
                first = str(e)
            cp.check()  # raised once: cleared
            comm.barrier()
            bargs = (
                big.rank_queries(r, W), big.index_cache,
                cp.plan(big.block_table, big.seq_lens, width=big.width),
            )  # fmt: skip
            kernel_copy(after, cp.score_push(*bargs))
            settle(comm)
            cp.check()
            return first, after.cpu()

    res = run_threads(W, body, device=DEV)
    for rank, (first, after) in enumerate(res):
        if rank == 1:
            assert first is not None and first.startswith("rank 1: block_table row 0"), first
        else:
            assert first is None, (rank, first)
        assert_scores(after, for_rank(expected(big, 0, 1), rank, W).cpu())


@pytest.mark.gpu
def test_graph_replays_take_the_same_path():
    """One graph per rank holds a score_push and a select_blocks below the gate and a
    score_push above it; replays with q, lengths and tables changed in place equal the
    reference. A second graph holds only calls below the gate: rank 0 replays it alone,
    and the handshake's device count does not move."""
    fmt, n_var = "nvfp4", 3
    shapes = [(2, 20), (4, 24)]  # below, above
    base = [_problem(r, w, fmt, 1, seed=20 + i) for i, (r, w) in enumerate(shapes)]
    gen = torch.Generator().manual_seed(7)
    variants = []
    for v in range(n_var):
        vs = []
        for i, (r, w) in enumerate(shapes):
            q = testing.make_problem(r, (w - 1) * 128, fmt, seed=60 + 3 * v + i).q.to(DEV)
            lens = testing.random_lengths(r, (w - 1) * 128, gen).to(DEV)
            pages = base[i].index_cache.shape[0]
            table = torch.randint(0, pages, base[i].block_table.shape, generator=gen)
            vs.append(
                testing.Problem(q, base[i].index_cache, table.to(torch.int32).to(DEV), lens, w, fmt)
            )
        variants.append(vs)

    def body(comm: Comm):
        r = comm.rank
        with IndexCP(_ipc_cfg(fmt), device=DEV, comm=comm) as cp:
            st = [
                (p.rank_queries(r, W).clone(), p.block_table.clone(), p.seq_lens.clone())
                for p in base
            ]
            plans = [
                cp.plan(bt, sl, width=p.width) for (_, bt, sl), p in zip(st, base, strict=True)
            ]
            small, big = base
            paths = [cp.uses_cp(pl) for pl in plans]
            settle(comm)  # every rank's copies made before any push

            def calls():
                a = cp.score_push(st[0][0], small.index_cache, plans[0]).clone()
                ids = cp.select_blocks(st[0][0], small.index_cache, plans[0], topk=GPU_TOPK).clone()
                b = cp.score_push(st[1][0], big.index_cache, plans[1]).clone()
                return a, ids, b

            def gated_only():
                return cp.score_push(st[0][0], small.index_cache, plans[0]).clone()

            # Eager first, so the call images exist before the capture; settled between the
            # calls below the gate (the selection may allocate) and the push.
            cp.score_push(st[0][0], small.index_cache, plans[0])
            cp.select_blocks(st[0][0], small.index_cache, plans[0], topk=GPU_TOPK)
            settle(comm)
            cp.score_push(st[1][0], big.index_cache, plans[1])
            settle(comm)
            g, g_alone = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            outs: list = []
            alone: list = []

            def capture():  # one rank at a time: concurrent captures from threads fail
                with torch.cuda.graph(g, capture_error_mode="thread_local"):
                    outs.extend(calls())
                with torch.cuda.graph(g_alone, capture_error_mode="thread_local"):
                    alone.append(gated_only())

            in_turn(comm, capture)
            got = []
            for vs in variants:
                for (q, bt, sl), p in zip(st, vs, strict=True):
                    kernel_copy(q, p.rank_queries(r, W))
                    kernel_copy(bt, p.block_table)
                    kernel_copy(sl, p.seq_lens)
                for o in outs:
                    o.fill_(float("nan") if o.is_floating_point() else -7)
                for pl in plans:
                    pl.refresh()
                settle(comm)  # every rank's inputs in place before any push
                g.replay()
                settle(comm)
                got.append([o.cpu() for o in outs])
                comm.barrier()
            counts = []
            if r == 0:  # alone: the others are at the barrier below
                for _ in range(5):
                    counts.append(int(_device_calls(cp).cpu()))
                    alone[0].fill_(float("nan"))
                    g_alone.replay()
                    torch.cuda.current_stream().synchronize()
                counts.append(int(_device_calls(cp).cpu()))
            comm.barrier()
            cp.check()
            last = alone[0].cpu() if r == 0 else None
            g = g_alone = None  # freed before close: they hold the instance's buffers
            return paths, got, counts, last

    res = run_threads(W, body, device=DEV)
    for rank, (paths, got, counts, last) in enumerate(res):
        assert paths == [False, True]
        for vs, (a, ids, b) in zip(variants, got, strict=True):
            assert_scores(a, for_rank(expected(vs[0], 0, 1), rank, W).cpu())
            assert_scores(b, for_rank(expected(vs[1], 0, 1), rank, W).cpu())
            ok = unambiguous(a, GPU_TOPK)
            assert torch.equal(ids[ok], for_rank(_select(vs[0]), rank, W)[ok])
        if rank == 0:
            assert len(set(counts)) == 1, f"replays below the gate moved the handshake: {counts}"
            assert_scores(last, for_rank(expected(variants[-1][0], 0, 1), 0, W).cpu())
