"""Transports on one GPU: the one-process W-rank world (one thread and stream per rank).

This is the same kernel and handshake as the multi-GPU path; only the peers' buffers are plain
allocations of the shared GPU. Covers: ipc == collective bit for bit and == reference, many
consecutive calls with changing shapes, graph capture and replay, the late-peer timeout and
recovery, and a cross-process IPC mapping (no spin).

The rules of that world (docs/design.md) shape these tests: a rank thread never blocks on the
GPU while holding the GIL (``.item()``, ``torch.equal``) — synchronize the stream first, which
releases it; nothing that implicitly synchronizes the device (a new device allocation,
``clone()`` included, a memset, a device-to-device ``copy_``, a pinned allocation) is issued
while a push kernel may be in flight — buffers are preallocated and copied with kernels, or all
ranks meet at a host barrier first; and kernels load eagerly (``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import torch
from _gpu import (
    FORMATS,
    assert_scores,
    expected,
    for_rank,
    force_warpgroup_mma,
    kernel_copy,
    needs_gpu,
)

from cpindex import CPIndexConfig, IndexCP, OutOfStepError, PeerTimeoutError, testing
from cpindex.comm import Comm
from cpindex.kernels import variants
from cpindex.spawn import spawn_processes
from cpindex.world import in_turn, run_threads

pytestmark = [needs_gpu, pytest.mark.gpu]
DEV = "cuda:0"


def _world(world: int, fn, **cfg_kw):
    cfg = CPIndexConfig(**{"max_rows": 32, "max_width": 256, **cfg_kw})

    def body(comm: Comm):
        with IndexCP(cfg, device=DEV, comm=comm) as cp:
            return fn(cp, comm)

    return run_threads(world, body, device=DEV)


def _problems(fmt, n, seed, num_heads=4, max_rows=32, max_len=256 * 128, query_len=1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    max_req = max_rows // query_len
    for i in range(n):
        rows = int(torch.randint(1, max_req + 1, (1,), generator=gen))
        rows = [1, max_req][i] if i < 2 else rows
        max_len_i = int(torch.randint(query_len, max_len + 1, (1,), generator=gen))
        p = testing.make_problem(
            rows, max_len_i, fmt, query_len=query_len, num_heads=num_heads,
            seed=seed * 100 + i, device=DEV,
        )  # fmt: skip
        p.width = min(256, p.width + int(torch.randint(0, 4, (1,), generator=gen)))
        out.append(p)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("world", "t", "inst"),
    [(2, 1, ""), (4, 1, ""), (4, 4, ""), (2, 8, ""), (4, 8, ""), (4, 8, "wg"), (4, 4, "halves")],
)
def test_ipc_matches_collective_and_reference(fmt, world, t, inst, monkeypatch):
    if inst == "wg":  # T * H = 32: the warpgroup-mma instance as well as the launcher's choice
        force_warpgroup_mma(monkeypatch)
    if inst == "halves":  # pushed calls that split pages over two warps where the format does
        monkeypatch.setattr(variants, "SPLIT_WARPS", (2,))
    probs = _problems(fmt, 6, seed=world + t, query_len=t)
    refs = [expected(p, 0, 1) for p in probs]

    def job(cp, comm):
        qs = [p.rank_queries(comm.rank, comm.world_size) for p in probs]
        outs = [
            torch.empty(q.shape[1], p.rows, p.width, device=DEV)
            for p, q in zip(probs, qs, strict=True)
        ]
        comm.barrier()  # every rank's allocations done before the first push
        for p, q, keep in zip(probs, qs, outs, strict=True):
            plan = cp.plan(p.block_table, p.seq_lens, query_len=t, width=p.width)
            out = cp.score_push(q, p.index_cache, plan)
            kernel_copy(keep, out)
            out.fill_(float("nan"))  # poison: the next call must rewrite everything it returns
        return cp.transport_name, outs

    ipc = _world(world, job, transport="ipc", cache_format=fmt)
    coll = _world(world, job, transport="collective", cache_format=fmt)
    for rank in range(world):
        assert ipc[rank][0] == "ipc" and coll[rank][0] == "collective"
        for ref, a, b in zip(refs, ipc[rank][1], coll[rank][1], strict=True):
            assert torch.equal(a, b), "ipc and collective differ"
            assert_scores(a, for_rank(ref, rank, world))


def test_replicated_heads_and_pair_layout():
    """num_heads=2 on 4 ranks: head h lands on ranks h and h+2; nvfp4 as (packed, scales)."""
    from cpindex import formats

    probs = _problems("nvfp4", 3, seed=9, num_heads=2)
    for p in probs:
        p.index_cache = formats.to_nvfp4_pair(p.index_cache)

    def job(cp, comm):
        qs = [p.rank_queries(comm.rank, 4) for p in probs]
        outs = [torch.empty(1, p.rows, p.width, device=DEV) for p in probs]
        comm.barrier()
        for p, q, keep in zip(probs, qs, outs, strict=True):
            plan = cp.plan(p.block_table, p.seq_lens, width=p.width)
            out = cp.score_push(q, p.index_cache, plan)
            kernel_copy(keep, out)
        return outs

    res = _world(4, job, transport="ipc", num_heads=2)
    for rank in range(4):
        for p, got in zip(probs, res[rank], strict=True):
            assert_scores(got, for_rank(expected(p, 0, 1), rank, 4))


def test_auto_picks_ipc_on_one_gpu():
    res = _world(4, lambda cp, comm: cp.transport_name)
    assert res == ["ipc"] * 4


def test_many_consecutive_calls_stay_correct():
    """10,000 calls per rank cycling through changing shapes; every output is compared on the
    device, bit for bit, with the first pass (itself checked against the reference); outputs
    are poisoned between calls. Nothing allocates inside the loop."""
    probs = _problems("fp8", 8, seed=21, max_len=64 * 128)
    calls = 10_000

    def job(cp, comm):
        qs = [p.rank_queries(comm.rank, 4) for p in probs]
        args = [(p.index_cache, cp.plan(p.block_table, p.seq_lens, width=p.width)) for p in probs]
        first = [torch.empty(1, p.rows, p.width, device=DEV) for p in probs]
        # Only elementwise ops with preallocated outputs in the loop: a large reduction (sum,
        # any) memsets its semaphores, which implicitly synchronizes the device (design.md).
        diff = [torch.empty(1, p.rows, p.width, dtype=torch.bool, device=DEV) for p in probs]
        seen = [torch.zeros(1, p.rows, p.width, dtype=torch.bool, device=DEV) for p in probs]
        comm.barrier()
        for keep, q, a in zip(first, qs, args, strict=True):
            kernel_copy(keep, cp.score_push(q, *a))
        for i in range(calls):
            k = i % len(probs)
            out = cp.score_push(qs[k], *args[k])
            torch.ne(out, first[k], out=diff[k])
            seen[k].logical_or_(diff[k])
            out.fill_(float("nan"))
            if k == len(probs) - 1:  # bound the work in flight (a full queue blocks launches)
                torch.cuda.current_stream().synchronize()
        torch.cuda.current_stream().synchronize()  # releases the GIL; int() would hold it
        comm.barrier()  # no push in flight anywhere: reductions are safe now
        return first, sum(int(s.sum()) for s in seen)

    res = _world(4, job, transport="ipc", cache_format="fp8")
    for rank, (first, bad) in enumerate(res):
        assert bad == 0, f"rank {rank}: {bad} elements differed in some of {calls} calls"
        for p, got in zip(probs, first, strict=True):
            assert_scores(got, for_rank(expected(p, 0, 1), rank, 4))


def test_graph_capture_replays_handshake():
    """Each rank captures 3 calls of different shapes in one graph, then 1,000 replays with
    q / seq_lens / block_table changed in place; counts on the device keep the handshake in
    step. Spot checks against the reference."""
    fmt, replays, n_var = "nvfp4", 1000, 4
    shapes = [(1, 8), (5, 20), (17, 32)]  # rows, blocks
    gen = torch.Generator().manual_seed(3)
    base = [
        testing.make_problem(r, b * 128, fmt, seed=i, device=DEV) for i, (r, b) in enumerate(shapes)
    ]
    pages = [p.index_cache.shape[0] for p in base]
    var = [
        [
            (
                testing.make_problem(r, b * 128, fmt, seed=50 + 3 * v + i).q.to(DEV),
                testing.random_lengths(r, b * 128, gen).to(DEV),
                torch.randint(0, pages[i], (r, b), generator=gen, dtype=torch.int32).to(DEV),
            )
            for i, (r, b) in enumerate(shapes)
        ]
        for v in range(n_var)
    ]
    want = [
        [
            expected(testing.Problem(q, base[i].index_cache, bt, sl, base[i].width, fmt), 0, 1)
            for i, (q, sl, bt) in enumerate(vs)
        ]
        for vs in var
    ]

    def job(cp, comm):
        r = comm.rank
        st = [
            (p.rank_queries(r, 4).clone(), p.block_table.clone(), p.seq_lens.clone()) for p in base
        ]
        # one plan per shape over the captured tensors (refilled in place before each replay)
        plans = [cp.plan(bt, sl, width=p.width) for (_, bt, sl), p in zip(st, base, strict=True)]
        for (q, _, _), p, plan in zip(st, base, plans, strict=True):  # warm up outside capture
            cp.score_push(q, p.index_cache, plan)
        torch.cuda.current_stream().synchronize()
        comm.barrier()
        g = torch.cuda.CUDAGraph()
        outs: list[torch.Tensor] = []

        def capture():  # one rank at a time: concurrent captures from threads fail
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                for (q, _, _), p, plan in zip(st, base, plans, strict=True):
                    outs.append(cp.score_push(q, p.index_cache, plan).clone())

        in_turn(comm, capture)
        for i in range(replays):
            v = i % n_var
            for (q, bt, sl), (vq, vsl, vbt) in zip(st, var[v], strict=True):
                kernel_copy(q, vq[:, r : r + 1])
                kernel_copy(sl, vsl)
                kernel_copy(bt, vbt)
            for o in outs:
                o.fill_(float("nan"))
            g.replay()
            if i % 97 == 0 or i == replays - 1:
                torch.cuda.current_stream().synchronize()  # never block holding the GIL
                comm.barrier()  # nobody replays ahead while checks allocate
                for o, w in zip(outs, want[v], strict=True):
                    assert_scores(o, for_rank(w, r, 4))
                comm.barrier()
        return True

    assert _world(4, job, transport="ipc") == [True] * 4


def test_late_peer_times_out_names_it_and_recovers():
    probs = _problems("fp8", 2, seed=5, max_len=16 * 128)

    def job(cp, comm):
        p = probs[0]
        q = p.rank_queries(comm.rank, 4)
        args = (p.index_cache, cp.plan(p.block_table, p.seq_lens, width=p.width))
        cp.score_push(q, *args)
        torch.cuda.current_stream().synchronize()
        comm.barrier()
        if comm.rank != 3:  # rank 3 skips this call
            cp.score_push(q, *args)
            torch.cuda.current_stream().synchronize()
        comm.barrier()
        err = None
        try:
            cp.check()
        except PeerTimeoutError as e:
            err = (e.peer, e.phase, str(e))
        out = torch.empty(1, p.rows, p.width, device=DEV)
        cp.reset()  # collective: ends with a barrier, so the allocation above is settled
        kernel_copy(out, cp.score_push(q, *args))
        torch.cuda.current_stream().synchronize()
        return err, out

    res = _world(4, job, transport="ipc", cache_format="fp8", timeout_s=0.5)
    ref = expected(probs[0], 0, 1)
    for rank, (err, out) in enumerate(res):
        if rank == 3:
            assert err is None
        else:
            assert err is not None and err[0] == 3 and err[1] == "queries", err
            assert "rank 3" in err[2] and "timed out" in err[2]
        assert_scores(out, for_rank(ref, rank, 4))


def test_ranks_pairing_different_calls_all_raise():
    """Rank 2 calls with another width (same rows): the call identities carried with the
    queries differ, so every rank raises OutOfStepError and nobody exchanges scores; reset()
    brings the group back."""
    probs = _problems("nvfp4", 1, seed=6, max_len=16 * 128)

    def job(cp, comm):
        p = probs[0]
        q = p.rank_queries(comm.rank, 4)
        width = p.width + (1 if comm.rank == 2 else 0)
        cp.score_push(q, p.index_cache, cp.plan(p.block_table, p.seq_lens, width=width))
        torch.cuda.current_stream().synchronize()
        comm.barrier()
        err = None
        try:
            cp.check()
        except OutOfStepError as e:
            err = str(e)
        out = torch.empty(1, p.rows, p.width, device=DEV)
        cp.reset()
        plan = cp.plan(p.block_table, p.seq_lens, width=p.width)
        kernel_copy(out, cp.score_push(q, p.index_cache, plan))
        torch.cuda.current_stream().synchronize()
        return err, out

    res = _world(4, job, transport="ipc", timeout_s=2.0)
    ref = expected(probs[0], 0, 1)
    for rank, (err, out) in enumerate(res):
        assert err is not None and "different call" in err, (rank, err)
        assert_scores(out, for_rank(ref, rank, 4))


def _ipc_pair(rank: int, world: int, path: str) -> None:
    """Process 0 exports a buffer; process 1 maps it and writes through the real kernel."""
    import torch.distributed as dist

    from cpindex import kernels
    from cpindex.kernels import launcher
    from cpindex.transports.peer import view_bytes

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    mod = kernels.load(dev)
    prob = testing.make_problem(2, 1500, "fp8", seed=1, device=dev)
    nbytes = 4 * prob.rows * prob.width * 4
    if rank == 0:
        ptr = mod.peer_malloc(nbytes, 0)
        view_bytes(ptr, nbytes, dev).view(torch.float32).fill_(float("nan"))
        torch.cuda.synchronize()
        dist.broadcast_object_list([mod.ipc_handle(ptr, 0)], src=0)
        dist.barrier()  # rank 1 has written
        got = view_bytes(ptr, nbytes, dev).view(torch.float32).view(4, prob.rows, prob.width)
        assert_scores(got.clone(), expected(prob, 0, 1))
        dist.barrier()
        mod.peer_free(ptr, 0)
    else:
        h = [None]
        dist.broadcast_object_list(h, src=0)
        peer = mod.ipc_open(h[0], 0)
        mon = launcher.ErrorMonitor(dev, 1)
        sc = launcher.KernelScorer(
            dev, "fp8", num_heads=4, rank=0, world=1, sm_scale=128**-0.5, monitor=mon
        )
        out = view_bytes(peer, nbytes, dev).view(torch.float32).view(4, prob.rows, prob.width)
        sc.score_local(
            prob.q,
            prob.index_cache,
            prob.block_table,
            prob.seq_lens,
            out,
            init_blocks=0,
            local_blocks=1,
            width=prob.width,
        )
        torch.cuda.synchronize()
        dist.barrier()
        dist.barrier()
        mod.ipc_close(peer, 0)


def test_cross_process_ipc_write_lands(tmp_path):
    spawn_processes(2, _ipc_pair, str(tmp_path), backend="gloo")
