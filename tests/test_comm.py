"""The store host (rank 0's process) dying mid-call: the survivors get the library's own error.

Real gloo processes, W = 2. Rank 0 hosts the group's TCP store, so once it is gone every store
request the survivor makes (the call's header round, the tensor collectives' arrival counts)
fails at the socket; each must surface as :class:`cpindex.PeerConnectionError` (or
:class:`cpindex.PeerTimeoutError`) naming the rank and phase, never a raw ``torch.distributed``
error, and within ``timeout_s`` plus a few seconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import cpindex
from cpindex import testing
from cpindex.comm import TorchComm
from cpindex.config import CPIndexConfig
from cpindex.spawn import spawn_processes

TIMEOUT_S = 3.0
SLACK_S = 3.0
CALLS_BEFORE = 2  # rank 0 dies in call CALLS_BEFORE + 1, after calls that completed


def _push(cp: cpindex.IndexCP, p: testing.Problem) -> torch.Tensor:
    plan = cp.plan(p.block_table, p.seq_lens, width=p.width, query_len=p.query_len)
    return cp.score_push(p.rank_queries(cp.rank, cp.world_size), p.index_cache, plan)


def _store_host_dies(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    p = testing.make_problem(2, 600, "fp8", seed=3, num_heads=4)
    comm = TorchComm()
    cfg = CPIndexConfig(
        cache_format="fp8", max_rows=4, max_width=8, transport="collective", timeout_s=TIMEOUT_S
    )
    cp = cpindex.IndexCP(cfg, device="cpu", comm=comm)
    for _ in range(CALLS_BEFORE):
        _push(cp, p)
    if rank == 0:  # dies inside the call, after its header round
        comm.all_to_all_into = lambda *a, **k: os._exit(0)  # type: ignore[method-assign]
    else:
        # Come to the collective after the store host is gone: its first store request fails.
        real = comm.all_to_all_into

        def late(*a, **k):
            time.sleep(1.0)
            return real(*a, **k)

        comm.all_to_all_into = late  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        _push(cp, p)
        got = {"type": None}
    except BaseException as e:
        got = {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__]}
        got["msg"] = str(e)
    got["s"] = time.monotonic() - t0
    torch.save(got, Path(path) / f"rank{rank}.pt")
    os._exit(0)  # skip destroy_process_group: its peer is gone


def test_store_host_dying_mid_call_is_a_peer_error_on_the_survivor(tmp_path):
    """(Rank 0 dying between calls: tests/test_lockstep.py's dead-peer test.)"""
    spawn_processes(2, _store_host_dies, str(tmp_path), timeout_s=90)
    got = torch.load(tmp_path / "rank1.pt")
    assert got["type"] in ("PeerConnectionError", "PeerTimeoutError"), got
    assert "CPIndexError" in got["mro"], got
    assert "rank 1" in got["msg"], got
    assert got["s"] < TIMEOUT_S + SLACK_S, got
