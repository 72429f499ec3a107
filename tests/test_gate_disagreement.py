"""Ranks that disagree on a call's sizes near the CP gate (docs/contract.md, "The gate and
disagreement"): real gloo processes, W = 4 on the world group, then W = 2 on ranks 0 and 1.

With ``cp_min_blocks=50`` and 4 requests, rank 0 passes width 12 (48 blocks: below the gate)
and the others width 13 (52: above). The path is each rank's own decision from its own sizes,
so:

* **alone**: rank 0 scores alone and returns; the others wait for it in the call's header
  round and raise ``PeerTimeoutError`` naming rank 0 within ``timeout_s`` + 1 s, with a note
  that rank 0 may have made the call below the gate. ``reset()`` on every rank, then every
  rank is in step again (bit-exact results).
* **then a context-parallel call**: rank 0 goes on to a call above the gate before the others
  time out. It meets their waiting call: the call numbers differ (they count the calls below
  the gate too), and every rank raises ``OutOfStepError``, rank 0 in its second call.
* **both below**: rank 0 width 12, the others width 11 (44 blocks): every rank returns its own
  correct result, and nothing is compared (the documented blind spot).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpindex import CPIndexConfig, IndexCP, partition, reference, testing
from cpindex.spawn import spawn_processes

THRESHOLD = 50
TIMEOUT_S = 1.0  # waited out on purpose (the "alone" case), once per world size
REQUESTS = 4
SPAWN_TIMEOUT_S = 180.0


def _cfg() -> CPIndexConfig:
    return CPIndexConfig(
        max_rows=8, max_width=16, max_topk=16, cp_min_blocks=THRESHOLD, timeout_s=TIMEOUT_S
    )


def _problem() -> testing.Problem:
    """4 requests of up to 11 blocks; a block table of 13 columns, so widths 11 to 13 are
    all valid for it."""
    p = testing.make_problem(REQUESTS, 10 * 128 + 7, "nvfp4", seed=5)
    table = p.block_table
    pad = table[:, :1].expand(-1, 13 - table.shape[1])
    p.block_table = torch.cat([table, pad], dim=1).contiguous()
    return p


def _outcome(fn) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        out = fn()
    except Exception as e:
        return {
            "error": type(e).__name__,
            "text": str(e),
            "notes": " ".join(getattr(e, "__notes__", [])),
            "peer": getattr(e, "peer", None),
            "s": time.monotonic() - t0,
        }
    return {"error": None, "out": out.clone(), "s": time.monotonic() - t0}


def _scenarios(rank: int, world: int, group) -> dict[str, Any]:
    p = _problem()
    iq = p.rank_queries(rank, world)
    res: dict[str, Any] = {}
    with IndexCP(_cfg(), group=group, device="cpu") as cp:
        plans = {w: cp.plan(p.block_table, p.seq_lens, width=w) for w in (11, 12, 13)}
        assert [cp.uses_cp(plans[w]) for w in (11, 12, 13)] == [False, False, True]

        def call(width: int):
            return lambda: cp.score_push(iq, p.index_cache, plans[width])

        # alone: rank 0 below, the others above; they time out waiting for it
        res["alone"] = _outcome(call(12 if rank == 0 else 13))
        dist.barrier(group=group)
        cp.reset()
        res["alone_after"] = _outcome(call(13))

        # then a context-parallel call on rank 0, before the others time out
        if rank == 0:
            res["then_first"] = _outcome(call(12))
            res["then_cp"] = _outcome(call(13))
        else:
            res["then_cp"] = _outcome(call(13))
        dist.barrier(group=group)
        cp.reset()
        res["then_after"] = _outcome(call(13))

        # both below, other sizes: nothing compared, each rank its own result
        res["below"] = _outcome(call(12 if rank == 0 else 11))
        res["below_after"] = _outcome(call(13))
    return res


def gloo_rank(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])
    res: dict[Any, Any] = {}
    try:
        for w, group in ((4, None), (2, pair)):
            if rank < w:
                res[w] = _scenarios(rank, w, group)
            dist.barrier()
    except BaseException:
        res = {"error": traceback.format_exc()}
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def _want(rank: int, world: int, width: int) -> torch.Tensor:
    p = _problem()
    full = reference.block_scores(
        p.q, p.index_cache, p.block_table, p.seq_lens, init_blocks=0, local_blocks=1,
        width=width,
    )  # fmt: skip
    return full[partition.heads_of_rank(rank, full.shape[0], world)]


def test_disagreement_near_the_gate(tmp_path):
    spawn_processes(4, gloo_rank, str(tmp_path), backend="gloo", timeout_s=SPAWN_TIMEOUT_S)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for r, res in enumerate(got):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    for world in (4, 2):
        for rank in range(world):
            res, where = got[rank][world], f"rank {rank}/{world}"
            wide = _want(rank, world, 13)
            # alone: rank 0 returns its result; every other rank times out naming it
            alone = res["alone"]
            if rank == 0:
                assert alone["error"] is None, (where, alone)
                assert torch.equal(alone["out"], _want(0, world, 12)), where
                assert alone["s"] < TIMEOUT_S, where  # it waited for nobody
            else:
                assert alone["error"] == "PeerTimeoutError", (where, alone)
                assert alone["peer"] == 0, (where, alone)  # the late rank is named
                assert "below the CP gate" in alone["notes"], (where, alone)
                assert "fewer than 50 blocks" in alone["notes"], (where, alone)
                assert alone["s"] < TIMEOUT_S + 1.0, (where, alone["s"])
            # then a CP call on rank 0: every rank raises OutOfStepError (rank 0 in its 2nd call)
            if rank == 0:
                assert res["then_first"]["error"] is None, where
            then = res["then_cp"]
            assert then["error"] == "OutOfStepError", (where, then)
            # rank 0's third call since reset() meets the others' second: calls below count
            assert "call=3" in then["text"] and "call=2" in then["text"], (where, then)
            # both below with other sizes: each returns its own result, nothing is compared
            below = res["below"]
            assert below["error"] is None, (where, below)
            assert torch.equal(below["out"], _want(rank, world, 12 if rank == 0 else 11)), where
            # reset() brings every rank back in step
            for key in ("alone_after", "then_after", "below_after"):
                assert res[key]["error"] is None, (where, key, res[key])
                assert torch.equal(res[key]["out"], wide), (where, key)
