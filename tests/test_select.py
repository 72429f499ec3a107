"""``select_blocks`` end to end. On the CPU: a real gloo process group (2 processes) and the
in-process world (1 and 4 ranks). Every rank's ids (and scores) must equal the reference
selection's rows for that rank's heads exactly, both through ``collective``'s candidate exchange
and through the default every transport can use (``score_push``, then a local selection).

Each world is started once (module cache) and runs every case; the rank functions only call and
save clones, and the checks run here in the test process.
"""

from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _gpu import kernel_copy, unambiguous
from _worlds import Worlds, load_problems

import cpindex
from cpindex import CPIndexConfig, IndexCP, ops, partition, reference, selection, testing
from cpindex.comm import Comm
from cpindex.transports.base import Transport
from cpindex.world import in_turn, run_threads

MAX_REQUESTS, MAX_T, MAX_WIDTH, MAX_TOPK = 5, 4, 68, 64  # MAX_WIDTH > MAX_TOPK: a cut


@dataclass(frozen=True)
class Case:
    name: str
    fmt: str = "nvfp4"  # bf16 | fp8 | nvfp4 | nvfp4-<form> (testing.NVFP4_FORMS)
    heads: int = 4
    lengths: tuple[int, ...] | None = None  # None: random ragged lengths
    requests: int = 4
    max_len: int = 20 * 128  # the longest row: 20 blocks, more than topk 16
    query_len: int = 1
    width_extra: int = 0
    init: int = 0
    local: int = 1
    topk: int = 16
    one_page: bool = False  # every block of a row on one page: exact ties
    two_dim: bool = False
    seed: int = 0

    @property
    def base_fmt(self) -> str:
        return self.fmt.split("-")[0]

    def problem(self) -> testing.Problem:
        lens = None if self.lengths is None else torch.tensor(self.lengths)
        prob = testing.make_problem(
            self.requests if lens is None else len(lens),
            self.max_len if lens is None else max(self.lengths),
            self.fmt,
            query_len=self.query_len,
            num_heads=self.heads,
            seed=self.seed,
            lengths=lens,
        )
        if self.one_page:
            prob.block_table[:] = prob.block_table[:, :1]
        prob.width += self.width_extra
        return prob


FORMATS = ["bf16", "fp8", "nvfp4", "nvfp4-pool", "nvfp4-pair", "nvfp4-interleaved"]


def cases(world: int) -> list[Case]:
    out: list[Case] = []
    for k, fmt in enumerate(FORMATS):
        s = 10 * k
        out += [
            Case(f"{fmt}/t1-ragged", fmt, seed=s),
            Case(f"{fmt}/t4-ragged", fmt, query_len=4, init=1, seed=s + 1),
            Case(f"{fmt}/short-rows", fmt, lengths=(1, 129, 900, 15 * 128 + 3), seed=s + 2),
        ]
    out += [
        # exact ties inside and across ranks' shares; forced blocks among them
        Case("ties/one-page", "fp8", one_page=True, init=1, local=2, seed=100),
        Case("ties/one-page-t4", "nvfp4", one_page=True, query_len=4, seed=101),
        Case("ties/one-page-topk1", "bf16", one_page=True, local=0, topk=1, seed=102),
        Case("forced/more-than-topk", "fp8", init=3, local=4, topk=2, seed=103),
        Case("forced/init2-local3", "nvfp4", init=2, local=3, seed=104),
        Case("forced/none", "nvfp4", init=0, local=0, seed=105),
        Case("topk/1", "nvfp4", topk=1, seed=106),
        Case("topk/64", "nvfp4", requests=2, max_len=MAX_WIDTH * 128, topk=64, seed=107),
        Case("topk/64-t4", "fp8", requests=2, max_len=MAX_WIDTH * 128, query_len=4, topk=64,
             seed=108),
        Case("width/gt-needed", "nvfp4", width_extra=9, init=1, seed=109),
        Case("width/1", "fp8", lengths=(100, 1, 128), seed=110),
        # head layouts: several heads per rank, one (2-D iq), replicated heads
        Case("heads8/ragged", "fp8", heads=8, seed=120),
        Case("heads2/ragged", "nvfp4", heads=2, query_len=4, seed=121),
        Case("heads1/two-dim-iq", "nvfp4", heads=1, two_dim=True, seed=122),
        # consecutive calls growing and shrinking on one instance
        Case("seq/big", "fp8", requests=MAX_REQUESTS, max_len=MAX_WIDTH * 128, topk=64, seed=130),
        Case("seq/small", "fp8", lengths=(300,), topk=3, seed=131),
        Case("seq/mid-t4", "fp8", lengths=(700, 4, 1200), query_len=4, seed=132),
        Case("seq/big-again", "fp8", requests=MAX_REQUESTS, max_len=MAX_WIDTH * 128 - 7,
             seed=133),
    ]  # fmt: skip
    return out


def _config(fmt: str, heads: int, transport: str = "auto") -> CPIndexConfig:
    return CPIndexConfig(
        transport=transport,
        cache_format=fmt,
        num_heads=heads,
        max_rows=MAX_REQUESTS * MAX_T,
        max_query_len=MAX_T,
        max_width=MAX_WIDTH,
        max_topk=MAX_TOPK,
    )


def _poison(cp: cpindex.IndexCP) -> None:
    """Fill the transport's work and result buffers with values that would show in (or win)
    the output if a call read anything it did not write itself."""
    t = cp._transport
    for name, v in vars(t).items():
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32:
            v.fill_(float("nan"))
        elif isinstance(v, torch.Tensor) and name == "_cand":
            v.fill_(torch.iinfo(torch.int64).max)  # the best key there is
        elif isinstance(v, selection.Outputs):
            v._ids.fill_(12345)
            v._scores.fill_(float("nan"))


_PROBLEMS: dict[str, testing.Problem] = {}  # by case name: made once per process (or loaded)


def _problem(case: Case) -> testing.Problem:
    """``case.problem()``, made once per process: the in-process ranks and the reference read
    the same tensors (nothing writes its inputs)."""
    if case.name not in _PROBLEMS:
        _PROBLEMS[case.name] = case.problem()
    return _PROBLEMS[case.name]


def _problems(world: int) -> dict[str, testing.Problem]:
    return {case.name: _problem(case) for case in cases(world)}


def _run_cases(rank: int, world: int, comm) -> dict:
    """Every case on this rank; ``comm`` None means the default torch.distributed group."""
    instances: dict[tuple[str, int], cpindex.IndexCP] = {}
    outs: dict[str, dict] = {}
    for case in cases(world):
        key = (case.base_fmt, case.heads)
        cp = instances.get(key)
        if cp is None:
            transport = "collective" if len(instances) % 2 else "auto"
            cp = instances[key] = cpindex.IndexCP(_config(*key, transport), device="cpu", comm=comm)
        prob = _problem(case)
        iq = prob.rank_queries(rank, world)
        if case.two_dim:
            iq = iq[:, 0]
        plan = cp.plan(
            prob.block_table, prob.seq_lens, query_len=case.query_len, init_blocks=case.init,
            local_blocks=case.local, width=prob.width,
        )  # fmt: skip
        args = (iq, prob.index_cache, plan)
        _poison(cp)
        ids, scores = cp.select_blocks(*args, topk=case.topk, return_scores=True)
        res = {"ids": ids.clone(), "scores": scores.clone()}
        if case.name.startswith("ties/"):  # the ids-only return, on a few cases
            res["plain"] = cp.select_blocks(*args, topk=case.topk).clone()
        _poison(cp)
        call = cp._runner.checker.planned(*args)  # the validated call, for the default path
        ids, scores = Transport.select_blocks(cp._transport, call, case.topk)
        res["default_ids"], res["default_scores"] = ids.clone(), scores.clone()
        res["bytes"] = cp.exchange_bytes(prob.rows, prob.width, case.topk)
        res["score_bytes"] = cp.exchange_bytes(prob.rows, prob.width)
        res["transport"] = cp.transport_name
        outs[case.name] = res
    for cp in instances.values():
        cp.close()
    return outs


def gloo_rank(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)  # W processes share CI's 2 cores
    try:
        _PROBLEMS.update(load_problems(out_dir))
        res: dict | str = _run_cases(rank, world, None)
    except BaseException:
        res = traceback.format_exc()
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


# --------------------------------------------------------------------------- worlds (cached)

_WORLDS = Worlds(
    "select",
    gloo_rank,
    lambda comm: _run_cases(comm.rank, comm.world_size, comm),
    problems=_problems,
)


def _world(kind: str, world: int, tmp_path_factory) -> list[dict]:
    return _WORLDS.results(kind, world, tmp_path_factory)


@functools.cache
def _reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    prob = _problem(case)
    return reference.select_blocks(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, init_blocks=case.init,
        local_blocks=case.local, width=prob.width, query_len=case.query_len, topk=case.topk,
        return_scores=True,
    )  # fmt: skip


# The transport cannot tell its comm apart (both are Comm): each world size runs once, gloo
# processes at W = 2 and the in-process world at W = 1 and 4 (tests/test_collective.py pairs
# them the other way round, so both comms run at W = 2 and 4 across the two files).
WORLDS = [("threads", 1), ("gloo", 2), ("threads", 4)]
PARAMS = [
    pytest.param(kind, w, c, id=f"{kind}{w}-{c.name}") for kind, w in WORLDS for c in cases(w)
]


@pytest.mark.parametrize(("kind", "world", "case"), PARAMS)
def test_rank_selection_equals_reference(kind, world, case, tmp_path_factory):
    results = _world(kind, world, tmp_path_factory)
    want_ids, want_scores = _reference(case)
    hpr = max(1, case.heads // world)
    rows = want_ids.shape[1]
    for rank, res in enumerate(results):
        heads = partition.heads_of_rank(rank, case.heads, world)
        got = res[case.name]
        assert got["transport"] == "collective"
        for path in ("", "default_"):
            ids, scores = got[path + "ids"], got[path + "scores"]
            assert ids.dtype == torch.int32 and scores.dtype == torch.float32
            assert ids.shape == scores.shape == (hpr, rows, case.topk)
            assert torch.equal(ids, want_ids[heads]), f"rank {rank} {path or 'collective'} ids"
            assert torch.equal(scores, want_scores[heads]), f"rank {rank} {path}scores"
        if "plain" in got:
            assert torch.equal(got["plain"], want_ids[heads])


@pytest.mark.parametrize(("kind", "world"), [("gloo", 2), ("threads", 4)])
def test_candidate_bytes_do_not_grow_with_width(kind, world, tmp_path_factory):
    results = _world(kind, world, tmp_path_factory)
    for case in cases(world):
        prob_rows = _reference(case)[0].shape[1]
        hpr = max(1, case.heads // world)
        res = results[0][case.name]
        assert res["bytes"] == (world - 1) * hpr * prob_rows * case.topk * 8
        width = _problem(case).width
        assert res["score_bytes"] == (world - 1) * hpr * prob_rows * -(-width // world) * 4


# --------------------------------------------------------------------------- API edges


def _one_rank(fn):
    return run_threads(1, fn)[0]


def test_topk_and_return_scores_are_validated():
    prob = testing.make_problem(2, 900, "fp8", seed=1)

    def fn(comm):
        cfg = CPIndexConfig(cache_format="fp8", max_rows=4, max_width=8, max_topk=20)
        with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
            args = (prob.q, prob.index_cache, cp.plan(prob.block_table, prob.seq_lens))
            errors = []
            for kw in ({"topk": 0}, {"topk": 21}, {"topk": 2.0}, {"topk": True},
                       {"return_scores": 1}):  # fmt: skip
                try:
                    cp.select_blocks(*args, **kw)
                except (TypeError, ValueError) as e:
                    errors.append((type(e).__name__, str(e)))
            ids = cp.select_blocks(*args, topk=20).clone()
            return errors, ids

    errors, ids = _one_rank(fn)
    assert [t for t, _ in errors] == ["ValueError", "ValueError", "TypeError", "TypeError",
                                      "TypeError"]  # fmt: skip
    assert all(m.startswith("topk:") for _, m in errors[:4]), errors
    assert "max_topk=20" in errors[1][1]
    assert errors[4][1].startswith("return_scores:")
    want = reference.select_blocks(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, init_blocks=0,
        local_blocks=1, width=prob.width, topk=20,
    )  # fmt: skip
    assert torch.equal(ids, want)


def test_select_blocks_on_a_closed_instance_raises():
    prob = testing.make_problem(1, 300, "fp8", seed=2)

    def fn(comm):
        cfg = CPIndexConfig(cache_format="fp8", max_rows=4, max_width=8)
        cp = cpindex.IndexCP(cfg, device="cpu", comm=comm)
        plan = cp.plan(prob.block_table, prob.seq_lens)
        cp.close()
        with pytest.raises(cpindex.CPIndexError, match="closed"):
            cp.select_blocks(prob.q, prob.index_cache, plan)
        with pytest.raises(cpindex.CPIndexError, match="closed"):
            cp.plan(prob.block_table, prob.seq_lens)
        return True

    assert _one_rank(fn)


def test_select_blocks_op_compiles_in_a_world():
    prob = testing.make_problem(3, 2000, "nvfp4", seed=3, query_len=2)
    width = prob.width

    def rank_fn(comm):
        cfg = CPIndexConfig(max_rows=8, max_width=width)
        with cpindex.IndexCP(cfg, device="cpu", comm=comm) as cp:
            plan = cp.plan(prob.block_table, prob.seq_lens, query_len=2, init_blocks=1, width=width)
            h, ph = ops.handle(cp), ops.plan_handle(plan)
            iq = prob.rank_queries(comm.rank, comm.world_size)

            @torch.compile(fullgraph=True, backend="aot_eager")
            def f(iq, cache, bt, sl):
                ids, scores = torch.ops.cpindex.select_blocks(
                    h, iq, cache, None, ph, bt, sl, width, 5
                )
                return ids + 0, scores * 1

            got = f(iq, prob.index_cache, prob.block_table, prob.seq_lens)
            eager = ops.select_blocks(cp, iq, prob.index_cache, plan, topk=5)
            return got, eager

    want = reference.select_blocks(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens, init_blocks=1,
        local_blocks=1, width=width, query_len=2, topk=5, return_scores=True,
    )  # fmt: skip
    for rank, (got, eager) in enumerate(run_threads(2, rank_fn)):
        for ids, scores in (got, eager):
            assert torch.equal(ids, want[0][2 * rank : 2 * rank + 2])
            assert torch.equal(scores, want[1][2 * rank : 2 * rank + 2])


# --------------------------------------------------------------------------- packed keys


def test_packed_keys_order_scores_then_lower_id():
    scores = torch.tensor(
        [float("-inf"), -3.5, -0.0, 0.0, 1e-40, 2.0, 2.0, 1e29, 1e30, float("inf")]
    )
    ids = torch.tensor([9, 3, 8, 2, 7, 6, 1, 5, 4, 0])
    keys = selection.pack(scores, ids).tolist()
    order = sorted(range(len(keys)), key=lambda i: -keys[i])
    want = sorted(range(len(keys)), key=lambda i: (-scores[i].item(), ids[i].item()))
    assert order == want
    assert keys[2] < keys[3]  # -0.0 == +0.0: the tie goes to the lower id (2 < 8)
    assert min(keys) > selection.FILLER
    out_ids = torch.empty(len(keys), dtype=torch.int32)
    out_scores = torch.empty(len(keys))
    selection.finish(torch.tensor(keys), out_ids, out_scores)
    assert out_ids.tolist() == [*range(9), -1]  # -inf is never selected
    back = dict(zip(ids.tolist(), scores.tolist(), strict=True))
    assert out_scores[:9].tolist() == [back[i] if back[i] != 0 else 0.0 for i in range(9)]
    assert out_scores[9].item() == float("-inf")


# --------------------------------------------------------------------------- on a GPU
# ``select_blocks`` on one GPU through the public API: the one-process W-rank world (one thread
# and stream per rank), every transport that runs there, ``topk`` on both sides of what a
# transport fuses (up to 16 on ``ipc``; larger goes through the default path).
#
# The headline is graph replay: one graph per batch size, replayed 10,000 times in an order that
# shrinks and grows the batch, with new lengths copied in before each replay and every output
# poisoned first. A slot left over from an earlier, larger call must never be taken as fresh: each
# replay must equal the eager call on the same inputs, bit for bit.
#
# The rules of the one-process world (docs/design.md) shape these tests: results are copied with
# kernels into buffers allocated before the first call, rank threads synchronize their stream
# before blocking reads, and reductions or allocations wait until every rank met at a barrier.

DEV = "cuda:0"
GPU_FORMATS = [f for f in FORMATS if "-" not in f]  # bf16, fp8, nvfp4 (page-major)


def _gpu_world(world: int, fn, **cfg_kw):
    cfg = CPIndexConfig(**{"max_rows": 32, "max_width": 128, "max_topk": 64, **cfg_kw})

    def body(comm: Comm):
        with IndexCP(cfg, device=DEV, comm=comm) as cp:
            return fn(cp, comm)

    return run_threads(world, body, device=DEV)


def _cpu(prob: testing.Problem) -> tuple:
    cache = prob.index_cache
    cache = tuple(c.cpu() for c in cache) if isinstance(cache, tuple) else cache.cpu()
    return prob.q.cpu(), cache, prob.block_table.cpu(), prob.seq_lens.cpu()


def _gpu_problems(
    fmt: str, t: int, seed: int, lengths: list[list[int]], heads: int = 4
) -> list[testing.Problem]:
    out = []
    for i, lens in enumerate(lengths):
        p = testing.make_problem(
            len(lens), max(lens), fmt, num_heads=heads, query_len=t, seed=seed + i,
            lengths=torch.tensor(lens),
        )  # fmt: skip
        out.append(p.to(DEV))
    # exact ties: every block of the last problem's first request on one page
    out[-1].block_table[0] = out[-1].block_table[0, 0]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_FORMATS)
@pytest.mark.parametrize(("world", "t", "heads"), [(2, 1, 4), (4, 4, 4), (4, 2, 2)])
@pytest.mark.parametrize("topk", [16, 64])
def test_transports_agree_and_match_the_scores_selection(fmt, world, t, heads, topk):
    """ipc and collective give the same ids and scores; both equal the selection of the same
    call's ``score_push`` scores, and the reference wherever it has no near-tie. Heads shared
    by two ranks (W = 4, H = 2) included."""
    lengths = [[100 * 128, t, 129], [7, 128 * 20, 128 * 90 + 5, 300, 2000, 128 * 16], [4000] * 3]
    lengths = [[max(x, t) for x in ls] for ls in lengths]
    probs = _gpu_problems(fmt, t, 10 * world + t, lengths, heads)

    def job(cp, comm):
        qs = [p.rank_queries(comm.rank, world) for p in probs]
        hpr = qs[0].shape[1]
        keep = [
            (
                torch.empty(hpr, p.rows, topk, dtype=torch.int32, device=DEV),
                torch.empty(hpr, p.rows, topk, device=DEV),
                torch.empty(hpr, p.rows, p.width, device=DEV),
            )
            for p in probs
        ]
        comm.barrier()  # every rank's allocations done before the first push
        for p, q, (ids, vals, full) in zip(probs, qs, keep, strict=True):
            plan = cp.plan(p.block_table, p.seq_lens, query_len=t, init_blocks=1, width=p.width)
            args = (q, p.index_cache, plan)
            got_ids, got_vals = cp.select_blocks(*args, topk=topk, return_scores=True)
            kernel_copy(ids, got_ids)
            kernel_copy(vals, got_vals)
            got_ids.fill_(-7)
            got_vals.fill_(float("nan"))
            kernel_copy(full, cp.score_push(*args))
        torch.cuda.current_stream().synchronize()
        comm.barrier()  # no push in flight anywhere: allocations are safe now
        return [tuple(x.cpu() for x in k) for k in keep]

    ipc = _gpu_world(world, job, transport="ipc", cache_format=fmt, num_heads=heads)
    coll = _gpu_world(world, job, transport="collective", cache_format=fmt, num_heads=heads)
    for rank in range(world):
        for p, (ids, vals, full), (c_ids, c_vals, _) in zip(
            probs, ipc[rank], coll[rank], strict=True
        ):
            assert torch.equal(ids, c_ids), f"rank {rank}: ipc and collective ids differ"
            assert torch.equal(vals, c_vals), f"rank {rank}: ipc and collective scores differ"
            want_ids = torch.empty_like(ids)
            want_vals = torch.empty_like(vals)
            selection.select(full, topk, want_ids, want_vals)
            assert torch.equal(ids, want_ids), f"rank {rank}: not the scores' selection"
            assert torch.equal(vals, want_vals)
            hpr = ids.shape[0]
            heads = [(rank * hpr + h) % p.q.shape[1] for h in range(hpr)]
            ref = reference.select_blocks(
                *_cpu(p), init_blocks=1, local_blocks=1, width=p.width, query_len=t, topk=topk
            )[heads]
            ok = unambiguous(full, topk)
            assert torch.equal(ids[ok], ref[ok]), f"rank {rank}: differs from the reference"


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [16, 64])
def test_10k_graph_replays_batches_shrink_and_grow(topk):
    """One graph per batch size (requests 8, 1, 5, 2, 8 with longer rows), each holding one
    select_blocks call, replayed 10,000 times in a random order with one of three length sets
    copied in first; outputs are poisoned (ids -7, scores NaN) before every replay. Each replay
    is compared on the device with the eager call on the same inputs; nothing allocates in the
    loop."""
    fmt, t, world, replays, n_var = "nvfp4", 2, 4, 10_000, 3
    shapes = [(8, 40), (1, 12), (5, 64), (2, 3), (8, 64)]  # requests, blocks
    gen = torch.Generator().manual_seed(7)
    base = [
        testing.make_problem(r, b * 128, fmt, query_len=t, seed=20 + i, device=DEV)
        for i, (r, b) in enumerate(shapes)
    ]
    base[2].block_table[1] = base[2].block_table[1, 0]  # exact ties in one request
    lens = [
        [testing.random_lengths(r, b * 128, gen, min_len=t).to(DEV) for _ in range(n_var)]
        for r, b in shapes
    ]
    order = torch.randint(0, len(shapes), (replays,), generator=gen).tolist()
    variant = torch.randint(0, n_var, (replays,), generator=gen).tolist()

    def job(cp, comm):
        r = comm.rank
        st = [(p.rank_queries(r, world).clone(), p.seq_lens.clone()) for p in base]
        # one plan per shape over the captured tensors (lengths refilled in place)
        plans = [
            cp.plan(p.block_table, sl, query_len=t, width=p.width)
            for (_, sl), p in zip(st, base, strict=True)
        ]

        def call(g: int):
            q, p = st[g][0], base[g]
            return cp.select_blocks(q, p.index_cache, plans[g], topk=topk, return_scores=True)

        hpr = st[0][0].shape[1]
        want = [
            [
                (
                    torch.empty(hpr, p.rows, topk, dtype=torch.int32, device=DEV),
                    torch.empty(hpr, p.rows, topk, device=DEV),
                )
                for _ in range(n_var)
            ]
            for p in base
        ]
        comm.barrier()
        for g in range(len(shapes)):  # eager: the expected results (and the warm-up)
            for v in range(n_var):
                kernel_copy(st[g][1], lens[g][v])
                ids, vals = call(g)
                kernel_copy(want[g][v][0], ids)
                kernel_copy(want[g][v][1], vals)
        torch.cuda.current_stream().synchronize()
        comm.barrier()
        graphs = [torch.cuda.CUDAGraph() for _ in shapes]
        outs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def capture():  # one rank at a time: concurrent captures from threads fail
            for g, graph in enumerate(graphs):
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    outs.append(call(g))

        in_turn(comm, capture)
        diff_i = [torch.empty(o[0].shape, dtype=torch.bool, device=DEV) for o in outs]
        diff_v = [torch.empty(o[1].shape, dtype=torch.bool, device=DEV) for o in outs]
        seen = [torch.zeros(o[0].shape, dtype=torch.bool, device=DEV) for o in outs]
        torch.cuda.current_stream().synchronize()
        comm.barrier()
        for i in range(replays):
            g, v = order[i], variant[i]
            kernel_copy(st[g][1], lens[g][v])
            ids, vals = outs[g]
            ids.fill_(-7)
            vals.fill_(float("nan"))
            graphs[g].replay()
            torch.ne(ids, want[g][v][0], out=diff_i[g])
            torch.ne(vals, want[g][v][1], out=diff_v[g])  # NaN (unwritten) differs too
            seen[g].logical_or_(diff_i[g]).logical_or_(diff_v[g])
            if i % 50 == 49:  # bound the work in flight (a full queue blocks launches)
                torch.cuda.current_stream().synchronize()
        torch.cuda.current_stream().synchronize()  # releases the GIL; int() would hold it
        comm.barrier()  # no push in flight anywhere: reductions are safe now
        return [int(s.sum()) for s in seen], [[w[0].cpu() for w in ws] for ws in want]

    res = _gpu_world(world, job, max_topk=topk)
    for rank, (bad, want) in enumerate(res):
        assert bad == [0] * len(shapes), f"rank {rank}: replays differed from eager calls: {bad}"
        for g, p in enumerate(base):  # the eager results themselves, against the reference
            for v in range(n_var):
                q, cache, table, _ = _cpu(p)
                ref_lens = lens[g][v].cpu()
                kw = dict(init_blocks=0, local_blocks=1, width=p.width, query_len=t)
                ref = reference.select_blocks(q, cache, table, ref_lens, topk=topk, **kw)
                scores = reference.block_scores(q, cache, table, ref_lens, **kw)
                ok = unambiguous(scores[rank : rank + 1], topk)
                assert torch.equal(want[g][v][ok], ref[rank : rank + 1][ok])
