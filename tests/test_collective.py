"""The ``collective`` transport end to end: a real gloo process group (4 processes) and the
in-process world (1 and 2 ranks). Every rank's output must equal the reference's rows for
that rank's heads exactly: on the CPU the collective path scores with the reference itself.

Each world is started once (module cache) and runs every case; the rank functions only call
``score_push`` and save a clone of each output before the next call (the returned view may be
overwritten by the next call), and the checks run here in the test process.
"""

from __future__ import annotations

import functools
import math
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _worlds import Worlds, load_problems

import cpindex
from cpindex import partition, reference, testing
from cpindex.config import CPIndexConfig
from cpindex.world import run_threads

MAX_ROWS, MAX_WIDTH = 8, 24


@dataclass(frozen=True)
class Case:
    name: str
    fmt: str = "nvfp4"  # bf16 | fp8 | nvfp4 | nvfp4-pair
    heads: int = 4
    lengths: tuple[int, ...] | None = None  # None: random ragged lengths
    rows: int = 5
    max_len: int = 2000
    width_extra: int = 0
    init: int = 0
    local: int = 1
    two_dim: bool = False  # pass iq as [rows, 128] (one head per rank only)
    seed: int = 0

    @property
    def config_key(self) -> tuple[str, int]:
        return self.fmt.removesuffix("-pair"), self.heads

    def problem(self) -> testing.Problem:
        lens = None if self.lengths is None else torch.tensor(self.lengths)
        rows = self.rows if self.lengths is None else len(self.lengths)
        max_len = self.max_len if self.lengths is None else max(self.lengths)
        prob = testing.make_problem(
            rows,
            max_len,
            self.fmt,
            num_heads=self.heads,
            seed=self.seed,
            lengths=lens,
        )
        prob.width += self.width_extra
        return prob


FORMATS = ["bf16", "fp8", "nvfp4", "nvfp4-pair"]


def cases(world: int) -> list[Case]:
    out: list[Case] = []
    for k, fmt in enumerate(FORMATS):
        s = 10 * k
        out += [
            Case(f"{fmt}/ragged", fmt, seed=s),
            Case(f"{fmt}/partial-blocks", fmt, lengths=(129, 255, 1, 641, 1000, 128), seed=s + 1),
            Case(f"{fmt}/init1-local1", fmt, init=1, local=1, seed=s + 2),
            Case(f"{fmt}/init2-local3", fmt, lengths=(1, 200, 300, 385, 2000), init=2, local=3,
                 seed=s + 3),
            Case(f"{fmt}/init0-local0", fmt, init=0, local=0, seed=s + 4),
            Case(f"{fmt}/rows1", fmt, lengths=(1500,), seed=s + 5),
            Case(f"{fmt}/rows-max", fmt, rows=MAX_ROWS, seed=s + 6),
            Case(f"{fmt}/width-gt-needed", fmt, width_extra=MAX_WIDTH - 16, init=1, seed=s + 7),
        ]  # fmt: skip
    # head layouts: several heads per rank, one head per rank (2-D iq), replicated heads
    out += [
        Case("heads8/ragged", "fp8", heads=8, seed=100),
        Case("heads8/rows-max", "nvfp4", heads=8, rows=MAX_ROWS, init=1, seed=101),
        Case("heads2/ragged", "nvfp4", heads=2, seed=102),
        Case("heads2/init2-local3", "bf16", heads=2, init=2, local=3, seed=103),
        Case("heads1/two-dim-iq", "nvfp4", heads=1, two_dim=True, seed=104),
        Case("heads1/ragged", "fp8", heads=1, seed=105),
    ]
    if world == 4:
        out.append(Case("heads4/two-dim-iq", "nvfp4", heads=4, two_dim=True, seed=106))
    # consecutive calls with shrinking and growing shapes on one instance
    out += [
        Case("seq/big", "fp8", rows=MAX_ROWS, max_len=MAX_WIDTH * 128, seed=200),
        Case("seq/small", "fp8", lengths=(300,), seed=201),
        Case("seq/mid", "fp8", lengths=(700, 1, 1200), init=1, local=2, seed=202),
        Case("seq/big-again", "fp8", rows=MAX_ROWS, max_len=MAX_WIDTH * 128 - 7, seed=203),
    ]
    return out


def _poison(cp: cpindex.IndexCP) -> None:
    """Fill the transport's float work buffers with NaN, so a read of anything not written by
    this call shows up in the output."""
    for v in vars(cp._transport).values():
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32:
            v.fill_(float("nan"))


_PROBLEMS: dict[str, testing.Problem] = {}  # by case name: made once per process (or loaded)


def _problem(case: Case) -> testing.Problem:
    """``case.problem()``, made once per process: the in-process ranks and the reference read
    the same tensors (nothing writes its inputs)."""
    if case.name not in _PROBLEMS:
        _PROBLEMS[case.name] = case.problem()
    return _PROBLEMS[case.name]


def _problems(world: int) -> dict[str, testing.Problem]:
    return {case.name: _problem(case) for case in cases(world)}


def _run_cases(rank: int, world: int, comm, names: list[str] | None = None) -> dict:
    """Runs every case on this rank; ``comm`` None means the default torch.distributed group."""
    instances: dict[tuple[str, int], cpindex.IndexCP] = {}
    outs: dict[str, torch.Tensor] = {}
    transports = set()
    for case in cases(world):
        if names is not None and case.name not in names:
            continue
        cp = instances.get(case.config_key)
        if cp is None:
            fmt, heads = case.config_key
            cfg = CPIndexConfig(
                transport="collective" if len(instances) % 2 else "auto",
                cache_format=fmt,
                num_heads=heads,
                max_rows=MAX_ROWS,
                max_width=MAX_WIDTH,
            )
            cp = instances[case.config_key] = cpindex.IndexCP(cfg, device="cpu", comm=comm)
            transports.add(cp.transport_name)
            _poison(cp)
        prob = _problem(case)
        iq = prob.rank_queries(rank, world)
        if case.two_dim:
            iq = iq[:, 0]
        plan = cp.plan(
            prob.block_table, prob.seq_lens, init_blocks=case.init, local_blocks=case.local,
            width=prob.width,
        )  # fmt: skip
        out = cp.score_push(iq, prob.index_cache, plan)
        outs[case.name] = out.clone()  # before the next call may overwrite it
    for cp in instances.values():
        cp.close()
    return {"outs": outs, "transports": sorted(transports)}


def _api_check(rank: int, world: int) -> str:
    """cpindex.init / get / shutdown on the default group; returns 'ok' or the traceback."""
    try:
        assert world == 1
        case = Case("api", "nvfp4", lengths=(900, 1, 333), init=1, seed=300)
        prob = case.problem()
        cfg = CPIndexConfig(max_rows=4, max_width=16)
        cp = cpindex.init(cfg, device="cpu")
        assert cpindex.get() is cp
        assert cp.transport_name == "collective"
        assert (cp.rank, cp.world_size, cp.heads_per_rank) == (0, 1, 4)
        assert cpindex.init(cfg, device="cpu") is cp  # the same arguments: the same instance
        try:
            cpindex.init(CPIndexConfig(max_rows=8, max_width=16), device="cpu")
        except cpindex.CPIndexError as e:
            assert "called again with other arguments" in str(e), e
        else:
            raise AssertionError("init with other arguments did not raise")
        plan = cp.plan(prob.block_table, prob.seq_lens, init_blocks=1, width=prob.width)
        out = cpindex.get().score_push(prob.q, prob.index_cache, plan)
        want = reference.block_scores(
            prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
            init_blocks=1, local_blocks=1, width=prob.width,
        )  # fmt: skip
        assert torch.equal(out, want)
        cpindex.shutdown()
        try:
            cpindex.get()
        except cpindex.CPIndexError as e:
            assert "before cpindex.init" in str(e)
        else:
            raise AssertionError("get() after shutdown did not raise")
        try:
            cp.score_push(prob.q, prob.index_cache, plan)
        except cpindex.CPIndexError as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("score_push after shutdown did not raise")
        cpindex.shutdown()  # no instance: a no-op
        again = cpindex.init(CPIndexConfig(max_rows=4, max_width=16, cache_format="fp8"))
        assert again is not cp and cpindex.get() is again
        cpindex.shutdown()
        return "ok"
    except BaseException:
        return traceback.format_exc()


def gloo_rank(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # W processes share CI's 2 cores
    _PROBLEMS.update(load_problems(out_dir))
    res = _run_cases(rank, world, None)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


# --------------------------------------------------------------------------- worlds (cached)

_WORLDS = Worlds(
    "collective",
    gloo_rank,
    lambda comm: _run_cases(comm.rank, comm.world_size, comm),
    problems=_problems,
)


def _world(kind: str, world: int, tmp_path_factory) -> list[dict]:
    return _WORLDS.results(kind, world, tmp_path_factory)


@functools.cache
def _full_reference(case: Case) -> torch.Tensor:
    prob = _problem(case)
    return reference.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
        init_blocks=case.init, local_blocks=case.local, width=prob.width,
    )  # fmt: skip


def _expected(case: Case, rank: int, world: int) -> torch.Tensor:
    return _full_reference(case)[partition.heads_of_rank(rank, case.heads, world)]


# The transport cannot tell its comm apart (both are Comm): each world size runs once, gloo
# processes at W = 4, the in-process world at W = 1 and 2 (tests/test_select.py pairs them the
# other way round, so both comms run at W = 2 and 4 across the two files).
WORLDS = [("threads", 1), ("threads", 2), ("gloo", 4)]
PARAMS = [
    pytest.param(kind, w, c, id=f"{kind}{w}-{c.name}") for kind, w in WORLDS for c in cases(w)
]


@pytest.mark.parametrize(("kind", "world", "case"), PARAMS)
def test_rank_outputs_equal_reference(kind, world, case, tmp_path_factory):
    results = _world(kind, world, tmp_path_factory)
    hpr = max(1, case.heads // world)
    rows, width = _full_reference(case).shape[1:]
    for rank, res in enumerate(results):
        got = res["outs"][case.name]
        assert got.dtype == torch.float32
        assert got.device.type == "cpu"
        assert got.shape == (hpr, rows, width)
        want = _expected(case, rank, world)
        assert not bool(got.isnan().any()), f"rank {rank}: NaN (an unwritten buffer was read)"
        assert torch.equal(got, want), (
            f"rank {rank}: max |diff| {(got - want).abs().nan_to_num(0).max().item()}"
        )


@pytest.mark.parametrize(("kind", "world"), WORLDS)
def test_auto_resolves_collective(kind, world, tmp_path_factory):
    for res in _world(kind, world, tmp_path_factory):
        assert res["transports"] == ["collective"]


@pytest.mark.parametrize(("kind", "world"), [("threads", 2), ("gloo", 4)])
def test_replicated_heads_agree(kind, world, tmp_path_factory):
    """num_heads < world: ranks r and r + H receive the same head's scores."""
    results = _world(kind, world, tmp_path_factory)
    heads = 2 if world == 4 else 1
    name = "heads2/ragged" if heads == 2 else "heads1/ragged"
    for r in range(world - heads):
        a = results[r]["outs"][name]
        b = results[r + heads]["outs"][name]
        assert torch.equal(a, b)
    if world == 4:  # ...and different heads differ
        assert not torch.equal(results[0]["outs"][name], results[1]["outs"][name])


def test_init_get_shutdown_one_rank_gloo():
    """On a one-rank gloo group of this process (its TCP store, as ``env://`` makes it)."""
    import torch.distributed as dist

    from cpindex.spawn import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert _api_check(0, 1) == "ok"
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- width below world

OWNED_COLUMNS_BUG = (
    "partition.owned_columns(rank, world, width) = torch.arange(rank, width, world) raises when "
    "rank > width, so collective.score_push crashes on ranks >= 2 whenever width < world - 1 "
    "(e.g. 4 ranks, every row <= 128 tokens, width=1)"
)


def _narrow(comm) -> torch.Tensor:
    case = Case("narrow", "fp8", lengths=(100, 1, 128), seed=400)
    prob = case.problem()
    cfg = CPIndexConfig(cache_format="fp8", max_rows=MAX_ROWS, max_width=MAX_WIDTH)
    with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
        iq = prob.rank_queries(comm.rank, comm.world_size)
        out = cp.score_push(iq, prob.index_cache, cp.plan(prob.block_table, prob.seq_lens, width=1))
        return out.clone()


def test_width_below_world_size():
    outs = run_threads(4, _narrow)
    case = Case("narrow", "fp8", lengths=(100, 1, 128), seed=400)
    for rank, got in enumerate(outs):
        assert torch.equal(got, _expected(case, rank, 4))


def test_width_at_world_minus_one_ok():
    """width == world - 1: the last rank owns no column, which works today."""
    case = Case("w3", "nvfp4", lengths=(300, 5, 257), seed=401)

    def rank_fn(comm):
        prob = case.problem()
        cfg = CPIndexConfig(max_rows=MAX_ROWS, max_width=MAX_WIDTH)
        with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
            iq = prob.rank_queries(comm.rank, comm.world_size)
            out = cp.score_push(iq, prob.index_cache, cp.plan(prob.block_table, prob.seq_lens))
            return out.clone()

    outs = run_threads(4, rank_fn)
    for rank, got in enumerate(outs):
        assert got.shape == (1, 3, 3)
        assert torch.equal(got, _expected(case, rank, 4))
        assert math.isinf(got[0, 1, 1].item())


# --------------------------------------------------------------------------- failure contract

BAD_PAGE_BUG = (
    "collective on CPU scores with reference.block_scores, which does not check block_table "
    "pages: a page >= num_pages raises IndexError on the owning rank only (its peers then wait "
    "in the all-to-all: a hang under gloo), and a negative page silently wraps to another page; "
    "the GPU kernel reports both as BadBlockTableError (docs/kernel.md, masking and forcing)"
)


def _bad_page(page: int):
    def rank_fn(comm):
        case = Case("bad-page", "fp8", lengths=(900, 700), seed=500)
        prob = case.problem()
        prob.block_table[0, 3] = page  # column 3 belongs to rank 1 of 2
        cfg = CPIndexConfig(cache_format="fp8", max_rows=MAX_ROWS, max_width=MAX_WIDTH)
        with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
            iq = prob.rank_queries(comm.rank, comm.world_size)
            cp.score_push(iq, prob.index_cache, cp.plan(prob.block_table, prob.seq_lens))
            cp.check()

    return rank_fn


@pytest.mark.parametrize("page", [10**6, -1])
def test_bad_page_rejected_on_every_rank_before_any_collective(page):
    """On CPU the page check reads the table on the host: ValueError on every rank, nothing
    launched (on GPU the kernel reports BadBlockTableError instead; see test_kernel_gpu)."""
    with pytest.raises(ValueError, match="block_table: row 0, block 3 names page"):
        run_threads(2, _bad_page(page), timeout_s=20)


PEER_TIMEOUT_GAP = (
    "docs/contract.md §5: a peer that never arrives must end in an error naming the rank and "
    "the call within config.timeout_s; the collective transport never reads timeout_s (gloo "
    "waits its own 30-minute default, the in-process world its barrier timeout) and raises no "
    "PeerTimeoutError"
)


def test_missing_peer_times_out_with_config_timeout():
    """(Over gloo processes: tests/test_lockstep.py, the late peer.)"""

    def rank_fn(comm):
        case = Case("timeout", "fp8", lengths=(500,), seed=600)
        prob = case.problem()
        cfg = CPIndexConfig(cache_format="fp8", max_rows=4, max_width=8, timeout_s=0.5)
        cp = cpindex.IndexCP(cfg, device="cpu", comm=comm)
        if comm.rank == 1:
            return None  # rank 1 never calls score_push
        iq = prob.rank_queries(comm.rank, comm.world_size)
        cp.score_push(iq, prob.index_cache, cp.plan(prob.block_table, prob.seq_lens))
        cp.check()
        return None

    with pytest.raises(cpindex.PeerTimeoutError, match=r"rank") as ei:
        run_threads(2, rank_fn, timeout_s=4)
    assert ei.value.rank == 0 and ei.value.peer == 1
