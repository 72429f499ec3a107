"""``cpindex.vllm``, the drop-in for the seed's ``IndexCP``: real gloo process groups of 2 and 4
ranks (heads = ranks), plus the one-process world's ``comm=`` path on the CPU.

Four gloo processes are started once (module cache): they run every case on two groups of 2
ranks at once, then on the world group of 4. Each rank saves clones of its outputs and what it
observed, and the checks run here. On the CPU the collective
transport scores with the reference itself, so outputs must equal ``cpindex.reference`` exactly.
On one GPU (tests marked ``gpu``, below): the drop-in captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import functools
import inspect
import os
import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _gpu import assert_scores, kernel_copy, unambiguous
from _worlds import Worlds

import cpindex
from cpindex import formats, reference, testing
from cpindex import vllm as dropin
from cpindex.world import in_turn, run_threads

MAX_ROWS, MAX_WIDTH = 32, 12
REQUESTS, MAX_LEN = 3, 1000
# (name, T, iq as [rows, 128], init_blocks, local_blocks, seed)
SCORE_CASES = [
    ("T1/3d", 1, False, 0, 1, 1),
    ("T1/2d", 1, True, 1, 1, 2),
    ("T4/3d", 4, False, 0, 1, 3),
    ("T4/2d", 4, True, 2, 3, 4),
    ("T8/3d", 8, False, 0, 1, 5),
    ("T8/2d", 8, True, 1, 2, 6),
]
TAGGED = "tag" in inspect.signature(cpindex.IndexCP.score_push).parameters


def vllm_cache(cache: formats.Cache) -> torch.Tensor:
    """The same keys in vLLM's nvfp4 cache tensor, ``uint8 [pages, 128, 72]``, written through
    :func:`formats.nvfp4_views` so the bytes land wherever that layout keeps them."""
    values, scales = formats.nvfp4_views(cache)
    out = torch.empty(values.shape[0], 128, 72, dtype=torch.uint8)
    v, s = formats.nvfp4_views(out)
    v.copy_(values)
    s.copy_(scales)
    return out


@functools.cache
def problem(world: int, t: int, seed: int, fmt: str = "nvfp4", requests: int = REQUESTS):
    """A random step of ``requests`` requests at ``T = t`` (the same one on every call: the
    ranks and the checks build it alike); nvfp4 in vLLM's cache tensor."""
    prob = testing.make_problem(
        requests, MAX_LEN, fmt, query_len=t, num_heads=world, seed=seed, width=MAX_WIDTH - 2
    )
    if fmt == "nvfp4":
        prob.index_cache = vllm_cache(prob.index_cache)
    return prob


def want(prob: testing.Problem, rank: int, init: int, local: int) -> torch.Tensor:
    """Rank ``rank``'s head of the reference's scores (all heads computed once per problem)."""
    key = (id(prob), init, local)
    if key not in _WANT:
        _WANT[key] = (prob, reference.block_scores(
            prob.q, prob.index_cache, prob.block_table, prob.seq_lens, init_blocks=init,
            local_blocks=local, width=prob.width, query_len=prob.query_len,
        ))  # fmt: skip
    return _WANT[key][1][rank : rank + 1]


_WANT: dict[tuple[int, int, int], tuple[testing.Problem, torch.Tensor]] = {}


def _poison(cp: dropin.IndexCP) -> None:
    """NaN into the transport's float buffers: an element this call does not write shows."""
    for v in vars(cp.cp._transport).values():
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32:
            v.fill_(float("nan"))


def _args(prob: testing.Problem, rank: int, world: int, two_dim: bool = False):
    iq = prob.rank_queries(rank, world)  # [rows, 1, 128]
    if two_dim:
        iq = iq[:, 0]
    return iq, prob.index_cache, prob.block_table, prob.seq_lens


def _error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _run_rank(group: dist.ProcessGroup | None) -> dict:
    """Every case on this process's rank of ``group``; returns what the checks need."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    res: dict = {}
    # The environment configures what the arguments do not; the arguments win where both do.
    os.environ.update(
        CPINDEX_TIMEOUT_S="30", CPINDEX_MAX_ROWS="1", CPINDEX_NUM_HEADS="1", CPINDEX_MAX_TOPK="20"
    )
    res["rank_mismatch"] = _error(
        lambda: dropin.IndexCP((rank + 1) % world, group, "cpu", MAX_ROWS, MAX_WIDTH)
    )
    cp = dropin.IndexCP(rank, group, "cpu", MAX_ROWS, MAX_WIDTH)
    c = cp.config
    res["config"] = (c.num_heads, c.max_rows, c.max_width, c.timeout_s, c.max_topk, c.cache_format)
    res["identity"] = (cp.rank, cp.world_size, cp.transport_name, cp.capturable)

    for name, t, two_dim, init, local, seed in SCORE_CASES:
        prob = problem(world, t, seed)
        _poison(cp)
        out = cp.score_push(*_args(prob, rank, world, two_dim), init, local, prob.width)
        res[f"score/{name}"] = out.clone()

    # The returned view: [1, rows, width] float32, the instance's memory, overwritten by the
    # next call of the same shape.
    p1, p2 = problem(world, 4, 20), problem(world, 4, 21)
    a = cp.score_push(*_args(p1, rank, world), 0, 1, p1.width)
    a_before = a.clone()
    b = cp.score_push(*_args(p2, rank, world), 0, 1, p2.width)
    res["view"] = {
        "shape": tuple(a.shape),
        "dtype": a.dtype,
        "same_memory": a.data_ptr() == b.data_ptr(),
        "a_shows_b": torch.equal(a, b),
        "a_before": a_before,
        "b": b.clone(),
    }

    # Refused before any launch: rows not a multiple of the requests, T past max_query_len, a
    # bad grid. Each is this rank's refusal of its call, told to the peers (every rank refuses
    # alike here), so the instance refuses calls until reset() on every rank.
    good = problem(world, 4, 30)
    iq, cache, bt, sl = _args(good, rank, world)
    res["bad_ratio"] = _error(lambda: cp.score_push(iq[:-1], cache, bt, sl, 0, 1, good.width))
    res["bad_ratio_2d"] = _error(
        lambda: cp.select_blocks(iq[:-2, 0], cache, bt, sl, 0, 1, good.width)
    )
    one = problem(world, 8, 31, requests=1)
    iq9 = torch.cat([one.rank_queries(rank, world)] * 2)[:9]
    res["t_too_big"] = _error(
        lambda: cp.score_push(iq9, one.index_cache, one.block_table[:1], one.seq_lens[:1], 0, 1,
                              one.width)
    )  # fmt: skip
    res["grid_negative"] = _error(lambda: cp.score_push(iq, cache, bt, sl, 0, 1, good.width, -1))
    res["grid_float"] = _error(lambda: cp.score_push(iq, cache, bt, sl, 0, 1, good.width, 2.0))
    cp.cp.reset()
    _poison(cp)
    res["after_refusals"] = cp.score_push(iq, cache, bt, sl, 0, 1, good.width).clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g1 = cp.score_push(iq, cache, bt, sl, 0, 1, good.width, 64).clone()
        g2 = cp.score_push(iq, cache, bt, sl, 0, 1, good.width, grid=8).clone()
    res["grid_positive"] = (g1, g2, [str(w.message) for w in caught])

    sel = problem(world, 4, 40)
    ids = cp.select_blocks(*_args(sel, rank, world), 1, 1, sel.width).clone()
    ids5 = cp.select_blocks(*_args(sel, rank, world, True), 1, 1, sel.width, topk=5).clone()
    res["select"] = (ids, ids5)
    if TAGGED:
        res["tagged"] = cp.score_push(iq, cache, bt, sl, 0, 1, good.width, tag=7).clone()
    cp.close()

    # fp8 and bf16 caches, as CPINDEX_CACHE_FORMAT configures them.
    for fmt in ("fp8", "bf16"):
        os.environ["CPINDEX_CACHE_FORMAT"] = fmt
        with dropin.IndexCP(rank, group, torch.device("cpu"), MAX_ROWS, MAX_WIDTH) as cpf:
            prob = problem(world, 4, 50, fmt)
            res[f"format/{fmt}"] = (
                cpf.config.cache_format,
                cpf.score_push(*_args(prob, rank, world, True), 0, 1, prob.width).clone(),
            )
    del os.environ["CPINDEX_CACHE_FORMAT"]

    # init(): one instance per process, the same one again for the same arguments.
    first = dropin.init(rank, group, "cpu", MAX_ROWS, MAX_WIDTH)
    res["init"] = {
        "get_is_it": dropin.get() is first,
        "again_is_it": dropin.init(rank, group, "cpu", MAX_ROWS, MAX_WIDTH) is first,
        "other_args": _error(lambda: dropin.init(rank, group, "cpu", MAX_ROWS, 8)),
        "out": dropin.get().score_push(*_args(good, rank, world), 0, 1, good.width).clone(),
    }
    dropin.shutdown()
    res["init"]["get_after"] = _error(dropin.get)
    return res


def gloo_rank(rank: int, world: int, out_dir: str) -> None:
    """Four processes: the cases on two groups of 2 ranks ({0, 1} and {2, 3}, both at once; in
    {2, 3} the group ranks differ from the global ones), then on the world group of 4."""
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        res: dict | str = {2: _run_rank(pairs[rank // 2]), 4: _run_rank(None)}
    except BaseException:
        res = traceback.format_exc()
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


WORLDS = Worlds("vllm", gloo_rank, lambda comm: None, gloo_timeout_s=180)


@pytest.fixture(params=[2, 4], ids=lambda w: f"gloo{w}")
def ranks(request, tmp_path_factory) -> tuple[int, list[tuple[int, dict]]]:
    """``(W, [(group rank, that rank's results), ...])`` for every process's group of W."""
    world = request.param
    procs = WORLDS.results("gloo", 4, tmp_path_factory)
    return world, [(p % world, res[world]) for p, res in enumerate(procs)]


@pytest.mark.parametrize("case", SCORE_CASES, ids=[c[0] for c in SCORE_CASES])
def test_equals_reference(ranks, case):
    world, res = ranks
    name, t, _, init, local, seed = case
    prob = problem(world, t, seed)
    for rank, r in res:
        got = r[f"score/{name}"]
        assert got.shape == (1, REQUESTS * t, prob.width)
        assert torch.equal(got, want(prob, rank, init, local)), f"rank {rank}"


def test_config_from_env_and_arguments(ranks):
    world, res = ranks
    for _, r in res:
        assert r["config"] == (world, MAX_ROWS, MAX_WIDTH, 30.0, 20, "nvfp4")
        assert r["identity"][1:] == (world, "collective", False)
    assert [r["identity"][0] for _, r in res] == [p % world for p in range(4)]


def test_rank_mismatch_refused(ranks):
    _, res = ranks
    for rank, r in res:
        kind, msg = r["rank_mismatch"]
        assert kind == "ValueError"
        assert msg.startswith("rank:") and f"this process is rank {rank}" in msg


def test_returns_a_view_valid_until_the_next_call(ranks):
    world, res = ranks
    p1, p2 = problem(world, 4, 20), problem(world, 4, 21)
    for rank, r in res:
        v = r["view"]
        assert v["shape"] == (1, REQUESTS * 4, p1.width) and v["dtype"] == torch.float32
        assert v["same_memory"] and v["a_shows_b"]
        assert torch.equal(v["a_before"], want(p1, rank, 0, 1))
        assert torch.equal(v["b"], want(p2, rank, 0, 1))


def test_bad_input_refused_before_any_exchange(ranks):
    world, res = ranks
    good = problem(world, 4, 30)
    for rank, r in res:
        kind, msg = r["bad_ratio"]
        assert kind == "ValueError" and msg.startswith("iq, block_table:")
        assert "11 iq rows for 3 block_table rows" in msg
        kind, msg = r["bad_ratio_2d"]
        assert kind == "ValueError" and "10 iq rows for 3 block_table rows" in msg
        kind, msg = r["t_too_big"]
        assert kind == "ValueError" and "9 query rows per request" in msg
        assert "max_query_len=8" in msg
        assert r["grid_negative"][0] == "ValueError" and r["grid_negative"][1].startswith("grid:")
        assert r["grid_float"][0] == "TypeError" and r["grid_float"][1].startswith("grid:")
        # the instance was left usable: no exchange began
        assert torch.equal(r["after_refusals"], want(good, rank, 0, 1))


def test_positive_grid_is_accepted_and_warned_once(ranks):
    world, res = ranks
    good = problem(world, 4, 30)
    for rank, r in res:
        g1, g2, caught = r["grid_positive"]
        assert torch.equal(g1, want(good, rank, 0, 1)) and torch.equal(g2, g1)
        assert len(caught) == 1 and caught[0].startswith("grid=64 has no effect")


def test_select_blocks(ranks):
    world, res = ranks
    prob = problem(world, 4, 40)
    for rank, r in res:
        ids, ids5 = r["select"]
        kw = dict(init_blocks=1, local_blocks=1, width=prob.width, query_len=4)
        full = reference.select_blocks(
            prob.q, prob.index_cache, prob.block_table, prob.seq_lens, **kw
        )
        assert ids.dtype == torch.int32 and ids.shape == (1, REQUESTS * 4, 16)
        assert torch.equal(ids, full[rank : rank + 1])
        full5 = reference.select_blocks(
            prob.q, prob.index_cache, prob.block_table, prob.seq_lens, topk=5, **kw
        )
        assert torch.equal(ids5, full5[rank : rank + 1])


@pytest.mark.skipif(not TAGGED, reason="cpindex.IndexCP.score_push takes no tag here")
def test_tag_passes_through(ranks):
    world, res = ranks
    good = problem(world, 4, 30)
    for rank, r in res:
        assert torch.equal(r["tagged"], want(good, rank, 0, 1))


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_cache_format_from_env(ranks, fmt):
    world, res = ranks
    prob = problem(world, 4, 50, fmt)
    for rank, r in res:
        got_fmt, out = r[f"format/{fmt}"]
        assert got_fmt == fmt
        assert torch.equal(out, want(prob, rank, 0, 1))


def test_init_once_per_process(ranks):
    world, res = ranks
    good = problem(world, 4, 30)
    for rank, r in res:
        i = r["init"]
        assert i["get_is_it"] and i["again_is_it"]
        assert i["other_args"][0] == "CPIndexError" and "shutdown() first" in i["other_args"][1]
        assert torch.equal(i["out"], want(good, rank, 0, 1))
        assert i["get_after"][0] == "CPIndexError"


def test_one_process_world_comm(monkeypatch):
    """The ``comm=`` path the one-process world uses (the GPU test's), here on the CPU."""
    monkeypatch.setenv("CPINDEX_TIMEOUT_S", "30")
    prob = problem(2, 4, 60)

    def body(comm):
        bad = _error(lambda: dropin.IndexCP(1 - comm.rank, None, "cpu", 16, 16, comm=comm))
        with dropin.IndexCP(comm.rank, None, "cpu", 16, 24, comm=comm) as cp:
            out = cp.score_push(*_args(prob, comm.rank, 2, True), 0, 1, prob.width).clone()
        return bad, out

    for rank, (bad, out) in enumerate(run_threads(2, body)):
        assert bad[0] == "ValueError" and f"this process is rank {rank}" in bad[1]
        assert torch.equal(out, want(prob, rank, 0, 1))


def test_no_process_group():
    with pytest.raises(ValueError, match=r"group: torch\.distributed is not initialized"):
        dropin.IndexCP(0, None, "cpu", 8, 8)
    with pytest.raises(TypeError, match="rank: expected an int"):
        dropin.IndexCP("0", None, "cpu", 8, 8)  # type: ignore[arg-type]


def test_untagged_calls_are_tagged_by_cache_so_a_skipped_layer_is_caught(monkeypatch):
    """The seed's calls carry no tag: the drop-in numbers each layer's cache object in the order
    it first sees them, the same on every rank. A rank that skips a layer's call then makes a
    call whose tag differs from its peers': every rank raises OutOfStepError at once (equal
    shapes, so counting calls alone would pair layer 2's queries with layer 1's silently)."""
    monkeypatch.setenv("CPINDEX_TIMEOUT_S", "30")
    prob = problem(2, 4, 70)
    layers = [prob.index_cache.clone() for _ in range(3)]  # one cache object per layer

    def body(comm):
        iq, _, bt, sl = _args(prob, comm.rank, 2)
        with dropin.IndexCP(comm.rank, None, "cpu", 16, 24, comm=comm) as cp:
            step1 = [cp.score_push(iq, c, bt, sl, 0, 1, prob.width).clone() for c in layers]
            plan = cp._plan
            skipped = layers[2] if comm.rank == 1 else layers[1]  # rank 1 skips layer 1
            err = _error(lambda: cp.score_push(iq, skipped, bt, sl, 0, 1, prob.width))
            cp.reset()
            again = cp.score_push(iq, layers[0], bt, sl, 0, 1, prob.width).clone()
            return step1, plan is cp._plan, err, again

    for rank, (step1, reused, err, again) in enumerate(run_threads(2, body)):
        assert all(torch.equal(out, want(prob, rank, 0, 1)) for out in step1)
        assert reused  # one plan for every layer of the step
        assert err is not None and err[0] == "OutOfStepError", err
        assert "tag" in err[1], err
        assert torch.equal(again, want(prob, rank, 0, 1))


def test_a_given_tag_wins_and_a_resized_table_is_planned_again(monkeypatch):
    monkeypatch.setenv("CPINDEX_TIMEOUT_S", "30")
    prob = problem(2, 4, 71)

    def body(comm):
        iq, cache, bt, sl = _args(prob, comm.rank, 2)
        bt, sl = bt.clone(), sl.clone()
        with dropin.IndexCP(comm.rank, None, "cpu", 16, 24, comm=comm) as cp:
            given = _error(
                lambda: cp.score_push(iq, cache, bt, sl, 0, 1, prob.width, tag=comm.rank)
            )
            cp.reset()
            first = cp._plan
            wider = torch.cat([bt, torch.zeros(bt.shape[0], 2, dtype=torch.int32)], dim=1)
            bt.resize_(wider.shape).copy_(wider)  # the same object, resized in place
            out = cp.score_push(iq, cache, bt, sl, 0, 1, prob.width).clone()
            return given, cp._plan is not first, out

    for rank, (given, replanned, out) in enumerate(run_threads(2, body)):
        assert given is not None and given[0] == "OutOfStepError"  # tags 0 and 1, as given
        assert replanned and torch.equal(out, want(prob, rank, 0, 1))


# --------------------------------------------------------------------------- on a GPU
# ``cpindex.vllm`` on one GPU: the drop-in inside the one-process world (one thread and stream
# per rank, heads = ranks), its calls captured in a CUDA graph and replayed with new inputs
# written in place, checked against ``cpindex.reference``.
#
# The one-process world's rules (docs/design.md; tests/test_transports_gpu.py) shape the rank
# bodies: every buffer is allocated before the first push, inputs are refreshed with kernels
# (``kernel_copy``), and results leave the GPU only after every rank has synchronized and met.

DEV = "cuda:0"
TOPK = 16


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("world", "t", "two_dim"), [(4, 4, True), (4, 1, False), (2, 8, True), (4, 8, False)]
)
def test_graph_capture_and_replay(world, t, two_dim, monkeypatch):
    """Each rank builds the drop-in with its comm, checks the eager view, captures
    ``score_push`` and ``select_blocks`` in one graph, then replays it 60 times over 3 sets of
    queries, lengths and block tables. Every replay must repeat its set's first result (outputs
    are poisoned before each), and those results must match the reference."""
    monkeypatch.setenv("CPINDEX_TRANSPORT", "ipc")
    monkeypatch.setenv("CPINDEX_CACHE_FORMAT", "nvfp4")
    requests, blocks, n_var, replays = 5, 40, 3, 60
    base = testing.make_problem(
        requests, blocks * 128, "nvfp4", query_len=t, num_heads=world, seed=world * 10 + t
    )
    cache_cpu = vllm_cache(base.index_cache)
    pages, width, rows = cache_cpu.shape[0], base.width, base.rows
    gen = torch.Generator().manual_seed(t)
    var = []  # (q [rows, W, 128], seq_lens, block_table) on the CPU
    for v in range(n_var):
        q = testing.make_problem(
            requests, blocks * 128, "nvfp4", query_len=t, num_heads=world, seed=100 + v
        ).q
        lens = testing.random_lengths(requests, blocks * 128, gen, min_len=t)
        table = torch.randint(0, pages, (requests, blocks), generator=gen, dtype=torch.int32)
        var.append((q, lens, table))
    cache = cache_cpu.to(DEV)

    def rank_inputs(q: torch.Tensor, rank: int) -> torch.Tensor:
        iq = q[:, rank : rank + 1].contiguous()
        return (iq[:, 0] if two_dim else iq).contiguous().to(DEV)

    var_dev = [
        [(rank_inputs(q, r), lens.to(DEV), table.to(DEV)) for (q, lens, table) in var]
        for r in range(world)
    ]
    base_dev = [
        (rank_inputs(base.q, r), base.seq_lens.to(DEV), base.block_table.to(DEV))
        for r in range(world)
    ]

    def body(comm):
        r = comm.rank
        cp = dropin.IndexCP(r, None, DEV, rows, width, comm=comm)
        try:
            assert (cp.rank, cp.world_size, cp.transport_name) == (r, world, "ipc")
            assert cp.capturable
            iq, sl, bt = (x.clone() for x in base_dev[r])  # the graph's static inputs
            eager = torch.empty(1, rows, width, device=DEV)
            out = torch.empty(1, rows, width, device=DEV)
            ids = torch.empty(1, rows, TOPK, dtype=torch.int32, device=DEV)
            keep = [(torch.empty_like(out), torch.empty_like(ids)) for _ in range(n_var)]
            seen = torch.zeros(1, rows, width, dtype=torch.bool, device=DEV)
            seen_ids = torch.zeros(1, rows, TOPK, dtype=torch.bool, device=DEV)
            diff = torch.empty_like(seen)
            diff_ids = torch.empty_like(seen_ids)
            torch.cuda.current_stream().synchronize()
            comm.barrier()  # every rank's buffers exist before any push

            # Eager, as the seed is called: a [1, rows, width] float32 view of the instance's
            # memory, the same memory on the next call.
            a = cp.score_push(iq, cache, bt, sl, 0, 1, width)
            kernel_copy(eager, a)
            b = cp.score_push(iq, cache, bt, sl, 0, 1, width, 0)
            view = (tuple(a.shape), a.dtype, a.data_ptr() == b.data_ptr())
            cp.select_blocks(iq, cache, bt, sl, 0, 1, width)
            torch.cuda.current_stream().synchronize()
            comm.barrier()

            graph = torch.cuda.CUDAGraph()

            def capture():  # one rank at a time: concurrent captures from threads fail
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    kernel_copy(out, cp.score_push(iq, cache, bt, sl, 0, 1, width))
                    kernel_copy(ids, cp.select_blocks(iq, cache, bt, sl, 0, 1, width, topk=TOPK))

            in_turn(comm, capture)
            torch.cuda.current_stream().synchronize()
            comm.barrier()
            for i in range(replays):
                v = i % n_var
                vq, vsl, vbt = var_dev[r][v]
                kernel_copy(iq, vq)
                kernel_copy(sl, vsl)
                kernel_copy(bt, vbt)
                out.fill_(float("nan"))
                ids.fill_(-7)
                graph.replay()
                if i < n_var:
                    kernel_copy(keep[v][0], out)
                    kernel_copy(keep[v][1], ids)
                else:  # the same inputs again: the same result (NaN, unwritten, differs too)
                    torch.ne(out, keep[v][0], out=diff)
                    torch.ne(ids, keep[v][1], out=diff_ids)
                    seen.logical_or_(diff)
                    seen_ids.logical_or_(diff_ids)
                if i % 20 == 19:  # bound the work in flight
                    torch.cuda.current_stream().synchronize()
            torch.cuda.current_stream().synchronize()  # releases the GIL; .cpu() would hold it
            comm.barrier()  # no push in flight anywhere: host copies are safe now
            return (
                view,
                eager.cpu(),
                [(s.cpu(), k.cpu()) for s, k in keep],
                int(seen.sum()) + int(seen_ids.sum()),
            )
        finally:
            cp.close()

    res = run_threads(world, body, device=DEV)

    want_base = reference.block_scores(
        base.q, cache_cpu, base.block_table, base.seq_lens, init_blocks=0, local_blocks=1,
        width=width, query_len=t,
    )  # fmt: skip
    wants = []
    for q, lens, table in var:
        kw = dict(init_blocks=0, local_blocks=1, width=width, query_len=t)
        scores = reference.block_scores(q, cache_cpu, table, lens, **kw)
        sel = reference.select_blocks(q, cache_cpu, table, lens, topk=TOPK, **kw)
        wants.append((scores, sel))
    for rank, (view, eager, kept, differing) in enumerate(res):
        assert view == ((1, rows, width), torch.float32, True), f"rank {rank}: {view}"
        assert_scores(eager, want_base[rank : rank + 1])
        assert differing == 0, f"rank {rank}: {differing} elements of replays differed"
        for (scores, ids), (want_scores, want_ids) in zip(kept, wants, strict=True):
            assert_scores(scores, want_scores[rank : rank + 1])
            ok = unambiguous(want_scores[rank : rank + 1], TOPK)
            assert torch.equal(ids[ok], want_ids[rank : rank + 1][ok]), f"rank {rank}"
