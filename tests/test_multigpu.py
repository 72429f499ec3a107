"""The production path: one process per GPU over NCCL, worlds of 2 and 4. Every call goes
through the exchange (``cp_min_blocks=0``; the gate has its own tests).

``ipc`` (IPC handles, peer writes over NVLink, device-side counts) and ``collective`` (NCCL)
against the reference and each other, graph capture and replay, and the late-peer timeout.
Skipped unless the machine has enough GPUs.
"""

from __future__ import annotations

import json

import pytest
import torch
from _gpu import assert_scores, expected, for_rank

from cpindex import CPIndexConfig, IndexCP, PeerTimeoutError, testing
from cpindex.spawn import spawn_processes

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def _suite(rank: int, world: int, path: str) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    report: dict = {}
    probs = [
        testing.make_problem(r, n, fmt, seed=10 * i + world, device=dev)
        for i, (r, n, fmt) in enumerate(
            [(1, 1, "nvfp4"), (7, 5000, "fp8"), (32, 60_000, "nvfp4"), (5, 3000, "bf16")]
        )
    ]
    outs = {}
    for t in ("ipc", "collective"):
        for p in probs:
            cfg = CPIndexConfig(
                transport=t, cache_format=p.fmt, max_rows=32, max_width=512, cp_min_blocks=0
            )
            with IndexCP(cfg, device=dev) as cp:
                assert cp.transport_name == t
                plan = cp.plan(p.block_table, p.seq_lens, width=p.width)
                got = cp.score_push(p.rank_queries(rank, world), p.index_cache, plan).clone()
                torch.cuda.synchronize()
                assert_scores(got, for_rank(expected(p, 0, 1), rank, world))
                outs[(t, id(p))] = got
    report["ipc_equals_collective"] = all(
        torch.equal(outs[("ipc", id(p))], outs[("collective", id(p))]) for p in probs
    )

    # graph capture: 2 calls per graph, 200 replays with q changed in place
    p = probs[2]
    with IndexCP(
        CPIndexConfig(transport="ipc", max_rows=32, max_width=512, cp_min_blocks=0), device=dev
    ) as cp:
        q = p.rank_queries(rank, world).clone()
        args = (p.index_cache, p.block_table, p.seq_lens, 0, 1, p.width)
        plan = cp.plan(p.block_table, p.seq_lens, width=p.width)
        cp.score_push(q, p.index_cache, plan)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            a = cp.score_push(q, p.index_cache, plan).clone()
            b = cp.score_push(q, p.index_cache, plan).clone()
        for i in range(200):
            new = testing.make_problem(p.rows, 60_000, "nvfp4", seed=500 + i % 4, device=dev)
            q.copy_(new.rank_queries(rank, world))
            g.replay()
            if i % 50 == 0:
                torch.cuda.synchronize()
                want = testing.Problem(new.q, *args[:3], p.width, "nvfp4")
                ref = for_rank(expected(want, 0, 1), rank, world)
                assert_scores(a, ref)
                assert torch.equal(a, b)
        report["graph_replays"] = 200

    # late peer: the last rank skips one call
    cfg = CPIndexConfig(transport="ipc", max_rows=32, max_width=512, timeout_s=1.0, cp_min_blocks=0)
    with IndexCP(cfg, device=dev) as cp:
        p = probs[1]
        q = p.rank_queries(rank, world)
        plan = cp.plan(p.block_table, p.seq_lens, width=p.width)
        if rank != world - 1:
            cp.score_push(q, p.index_cache, plan)
        torch.cuda.synchronize()
        try:
            cp.check()
            report["timeout"] = None
        except PeerTimeoutError as e:
            report["timeout"] = [e.peer, e.phase]
        cp.reset()
        got = cp.score_push(q, p.index_cache, plan).clone()
        torch.cuda.synchronize()
        assert_scores(got, for_rank(expected(p, 0, 1), rank, world))
    with open(f"{path}/rank{rank}.json", "w") as f:
        json.dump(report, f)


@pytest.mark.parametrize("world", [2, 4])
def test_multi_gpu_suite(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    spawn_processes(world, _suite, str(tmp_path), backend="nccl")
    for rank in range(world):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep["ipc_equals_collective"]
        assert rep["graph_replays"] == 200
        if rank == world - 1:
            assert rep["timeout"] is None
        else:
            assert rep["timeout"] == [world - 1, "queries"], rep
