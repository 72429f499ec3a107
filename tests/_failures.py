"""Rank-side scenarios of the failure tests (tests/test_failures.py, tests/test_construction.py,
benchmarks/adversarial.py): each runs on every rank of a real gloo world, with one rank
misbehaving as a caller could, and returns plain data (every rank's outcome and its time)."""

from __future__ import annotations

import functools
import os
import resource
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cpindex
from cpindex import construction, partition, reference, testing
from cpindex.comm import TorchComm
from cpindex.config import CPIndexConfig
from cpindex.spawn import spawn_processes

TIMEOUT_S = 1.0  # every instance's timeout_s: what a "bounded" wait may take
SLACK = 1.5  # what an "at once" error may take (store round trips, scheduling on 2 cores)
WORLD_BUDGET_S = 120.0  # a world that takes longer hangs somewhere: it is killed, the test fails


@functools.cache
def prob(heads: int = 4, seed: int = 3) -> testing.Problem:
    return testing.make_problem(3, 1200, "fp8", num_heads=heads, seed=seed)


def cfg(**kw: Any) -> CPIndexConfig:
    base = dict(
        cache_format="fp8", max_rows=8, max_width=24, transport="collective", num_heads=4,
        cp_min_blocks=0, timeout_s=TIMEOUT_S,
    )  # fmt: skip
    return CPIndexConfig(**{**base, **kw})


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """``fn()``'s outcome as plain data (it crosses processes): the exception's type, message,
    peer, cause's type, and whether it is a library error, or ``type`` None; and the seconds
    it took."""
    t0 = time.monotonic()
    try:
        fn()
        out: dict[str, Any] = {"type": None}
    except Exception as e:
        cause = e.__cause__
        out = {
            "type": type(e).__name__,
            "msg": str(e),
            "peer": getattr(e, "peer", None),
            "cause": type(cause).__name__ if cause is not None else None,
            "cpindex": isinstance(e, cpindex.CPIndexError),
            "arg": isinstance(e, (TypeError, ValueError)),
        }
    out["s"] = time.monotonic() - t0
    return out


def correct(cp: cpindex.IndexCP, tag: int = 0) -> bool:
    """One planned call on fresh inputs, compared with the reference."""
    p, rank, w = prob(), cp.rank, cp.world_size
    plan = cp.plan(p.block_table, p.seq_lens, width=p.width)
    got = cp.score_push(p.rank_queries(rank, w), p.index_cache, plan, tag=tag).clone()
    full = reference.block_scores(
        p.q, p.index_cache, p.block_table, p.seq_lens, init_blocks=0, local_blocks=1,
        width=p.width,
    )  # fmt: skip
    return bool(torch.equal(got, full[partition.heads_of_rank(rank, full.shape[0], w)]))


def build_and_check(**kw: Any) -> bool:
    with cpindex.IndexCP(cfg(**kw), device="cpu") as cp:
        return correct(cp)


# ---- reset -------------------------------------------------------------------------------


def sc_reset_lone_negative(rank: int, value: float = -1.0) -> dict:
    """Rank 0 calls ``reset(-1.0)`` while its peers do not reset: it raises ValueError
    naming timeout_s within timeout_s (never blocks); a reset on every rank then works."""
    with cpindex.IndexCP(cfg(), device="cpu") as cp:
        if rank == 0:
            lone = outcome(lambda: cp.reset(value))
        else:
            time.sleep(TIMEOUT_S + 0.5)  # past rank 0's refusal round
            lone = {"type": None, "s": 0.0}
        after = outcome(cp.reset)
        return {"lone": lone, "after": after, "correct": correct(cp)}


BAD_TIMEOUTS = (float("inf"), float("nan"), "1", 1e300, -0.5, 0, True)


def sc_reset_bad_values(rank: int) -> dict:
    """Rank 0 calls ``reset(bad)`` while its peers call ``reset()``: rank 0 raises
    TypeError/ValueError naming timeout_s, every peer OutOfStepError at once (one outcome,
    no peer left for a later time-out); a reset on every rank then works."""
    out: dict[str, Any] = {}
    with cpindex.IndexCP(cfg(), device="cpu") as cp:
        for v in BAD_TIMEOUTS:
            out[repr(v)] = outcome(lambda v=v: cp.reset(v) if rank == 0 else cp.reset())
            out[repr(v) + "/after"] = outcome(cp.reset)
        out["correct"] = correct(cp)
    return out


# ---- calls -------------------------------------------------------------------------------


def sc_negative_width(rank: int) -> dict:
    """Rank 0 makes its plan with width -1 (a refusal), its peers call with a good plan: rank
    0 raises ValueError, every peer OutOfStepError at once; reset() then works."""
    p = prob()
    with cpindex.IndexCP(cfg(), device="cpu") as cp:
        iq = p.rank_queries(rank, cp.world_size)

        def call() -> None:
            width = -1 if rank == 0 else p.width
            plan = cp.plan(p.block_table, p.seq_lens, width=width)
            cp.score_push(iq, p.index_cache, plan, tag=1)

        res = {"call": outcome(call)}
        cp.reset()
        res["correct"] = correct(cp)
    return res


# ---- construction ------------------------------------------------------------------------


def sc_construction_refused(rank: int) -> dict:
    """Rank 1's constructor refuses its argument (a config of the wrong type; a device that
    does not exist): every peer raises at once naming rank 1, no message says reset(), and a
    correct construction right after works on every rank."""
    out: dict[str, Any] = {}
    bad = {"config": lambda: cpindex.IndexCP("not a config", device="cpu")}  # type: ignore[arg-type]
    bad["device"] = lambda: cpindex.IndexCP(cfg(), device="meta")
    for name, make in bad.items():
        if rank == 1:
            out[name] = outcome(make)
        else:
            out[name] = outcome(lambda: cpindex.IndexCP(cfg(), device="cpu").close())
        out[name + "/again"] = outcome(build_and_check)
    return out


def sc_construction_env(rank: int) -> dict:
    """Rank 1 holds a bad ``CPINDEX_*`` variable and refuses as a constructor does before
    building (``construction.refuse``, what the vLLM drop-in calls): its peers raise at once
    naming it, and the next construction on every rank works."""
    env = {"CPINDEX_MAX_ROWS": "-3"} if rank == 1 else {}

    def make() -> None:
        try:
            config = CPIndexConfig.from_env(env, num_heads=4)
        except ValueError as e:
            construction.refuse(e)
        cpindex.IndexCP(config, device="cpu").close()

    return {"env": outcome(make), "again": outcome(build_and_check)}


def sc_construction_alone(rank: int) -> dict:
    """Rank 1 constructs alone and times out (its peers are elsewhere); then every rank
    constructs: the group is not out of step for good."""
    if rank == 1:
        alone = outcome(lambda: cpindex.IndexCP(cfg(timeout_s=0.3), device="cpu"))
    else:
        time.sleep(0.6)
        alone = {"type": None, "s": 0.0}
    return {"alone": alone, "again": outcome(build_and_check)}


def sc_stall_after_agreement(rank: int) -> dict:
    """Rank 1 stalls right after the agreement (its first round after it comes 2 s late): the
    others raise PeerTimeoutError naming rank 1 within timeout_s + 1 s; rank 1 raises too
    when it comes; a construction on every rank then works."""
    comm = TorchComm()
    if rank == 1:
        real = comm.all_gather_object
        state = {"slept": False}

        def late(obj: Any) -> list[Any]:
            if not state["slept"]:
                state["slept"] = True
                time.sleep(TIMEOUT_S + 1.0)
            return real(obj)

        comm.all_gather_object = late  # type: ignore[method-assign]
    res = {"stall": outcome(lambda: cpindex.IndexCP(cfg(), device="cpu", comm=comm))}
    if rank != 1:
        time.sleep(1.5)  # rank 1 is still asleep: it comes back to a round given up on
    res["again"] = outcome(build_and_check)
    return res


def _limit_memory(headroom: int) -> tuple[int, int]:
    """Cap this process's address space at what it maps now plus ``headroom`` bytes (an
    allocation past it fails as it would on a full machine); returns the old limits."""
    old = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, old[1]))
    return old


BIG = dict(max_rows=256, max_width=1 << 18, max_buffer_bytes=1 << 40)  # ~0.7 GiB a rank


def sc_alloc_one_rank(rank: int) -> dict:
    """Buffer allocation fails on rank 1 only (its address space is capped): every rank
    raises one library error naming rank 1's allocation, at once; a construction after works."""
    old = _limit_memory(128 << 20) if rank == 1 else None
    try:
        res = {"alloc": outcome(lambda: cpindex.IndexCP(cfg(**BIG), device="cpu"))}
    finally:
        if old is not None:
            resource.setrlimit(resource.RLIMIT_AS, old)
    res["again"] = outcome(build_and_check)
    return res


HUGE = dict(max_rows=65536, max_width=1 << 20, num_heads=8, max_buffer_bytes=2**62)


def sc_alloc_every_rank(rank: int) -> dict:
    """Buffers no rank can allocate (``max_buffer_bytes=2**62``, terabytes of buffers): every
    rank raises one library error, at once; a construction after works."""
    old = _limit_memory(1 << 30)  # terabytes fail anyway; the cap makes it so everywhere
    try:
        res = {"alloc": outcome(lambda: cpindex.IndexCP(cfg(**HUGE), device="cpu"))}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)
    res["again"] = outcome(build_and_check)
    return res


def sc_half_done_group(rank: int) -> dict:
    """Last on a group: the last rank leaves a call after its header round (its all-to-all
    raises before posting), so the others' all-to-all times out half done; reset() says the
    group cannot be reused; a new IndexCP on it is refused on every rank with what to do,
    before any collective (gloo would abort the process)."""
    comm = TorchComm()
    cp = cpindex.IndexCP(cfg(), device="cpu", comm=comm)
    p = prob()
    if rank == cp.world_size - 1:

        def leave(*a: Any, **k: Any) -> None:
            raise RuntimeError("left the call")

        comm.all_to_all_into = leave  # type: ignore[method-assign]
    plan = cp.plan(p.block_table, p.seq_lens, width=p.width)
    iq = p.rank_queries(rank, cp.world_size)
    res = {"call": outcome(lambda: cp.score_push(iq, p.index_cache, plan, tag=1))}
    if rank == cp.world_size - 1:
        time.sleep(TIMEOUT_S)  # the others' all-to-all waits out its timeout first
    res["reset"] = outcome(cp.reset)
    res["new"] = outcome(lambda: cpindex.IndexCP(cfg(), device="cpu"))
    return res


# ---- deaths (each ends its world) -------------------------------------------------------


def sc_dies_after_agreement(rank: int, victim: int, save: Callable[[], None]) -> dict:
    """``victim``'s process exits right after the construction agreement: the survivors
    raise PeerConnectionError naming it (peer = victim) within timeout_s + 1 s."""
    comm = TorchComm()
    if rank == victim:
        save()

        def die(obj: Any) -> list[Any]:
            os._exit(0)

        comm.all_gather_object = die  # type: ignore[method-assign]
    return outcome(lambda: cpindex.IndexCP(cfg(), device="cpu", comm=comm))


def sc_dies_mid_call(rank: int, victim: int, save: Callable[[], None]) -> dict:
    """``victim`` (not the store's host) exits inside a call, after the header round: the
    survivors raise PeerConnectionError naming it (peer = victim), not the store's host."""
    comm = TorchComm()
    cp = cpindex.IndexCP(cfg(timeout_s=3.0), device="cpu", comm=comm)
    p = prob()
    if rank == victim:
        save()

        def die(*a: Any, **k: Any) -> None:
            os._exit(0)

        comm.all_to_all_into = die  # type: ignore[method-assign]
    plan = cp.plan(p.block_table, p.seq_lens, width=p.width)
    iq = p.rank_queries(rank, cp.world_size)
    return outcome(lambda: cp.score_push(iq, p.index_cache, plan, tag=1))


def run(rank: int, names: list[str], scenarios: dict[str, Callable[[int], dict]]) -> dict:
    """Every scenario of ``names`` in turn; the first that crashes ends the run (the ranks
    may be out of step then)."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = scenarios[name](rank)
        except Exception:
            out[name] = {"crash": traceback.format_exc()}
            break
    return out


MAIN = {
    "reset_lone_negative": sc_reset_lone_negative,
    "reset_bad_values": sc_reset_bad_values,
    "negative_width": sc_negative_width,
    "construction_refused": sc_construction_refused,
    "construction_env": sc_construction_env,
    "construction_alone": sc_construction_alone,
    "stall_after_agreement": sc_stall_after_agreement,
    "alloc_one_rank": sc_alloc_one_rank,
    "alloc_every_rank": sc_alloc_every_rank,
    "half_done_group": sc_half_done_group,  # last: the group is unusable after it
}
DEATHS = {"dies_after_agreement": sc_dies_after_agreement, "dies_mid_call": sc_dies_mid_call}


def gloo_rank(rank: int, world: int, out_dir: str) -> None:
    """A world's rank: ``out_dir``'s name says which (``main``, or a death and its victim)."""
    torch.set_num_threads(1)
    path = Path(out_dir)
    kind = path.name
    res: dict[str, Any] = {}

    def save() -> None:
        torch.save(res, path / f"rank{rank}.pt")

    if kind == "main":
        only = os.environ.get("FAILURES_ONLY")  # a comma list: run just these (debugging)
        res = run(rank, only.split(",") if only else list(MAIN), MAIN)
    else:
        victim = world - 1
        res[kind] = {"victim": True}  # what the victim saves before it dies
        try:
            res[kind] = DEATHS[kind](rank, victim, save)
        except Exception:
            res[kind] = {"crash": traceback.format_exc()}
    # No rank exits while another may still read the last round from the store rank 0's
    # process serves, or still look for the dead.
    time.sleep(1.0)
    save()
    os._exit(0)  # skip destroy_process_group: the group may have lost a rank


_RESULTS: dict[tuple[str, int], list[dict] | BaseException] = {}


def results(kind: str, world: int, tmp_path_factory) -> list[dict]:
    """Every rank's results of the world ``kind`` (``main`` or a death) of ``world`` ranks,
    started once per test session."""
    key = (kind, world)
    if key not in _RESULTS:
        d = Path(tmp_path_factory.mktemp(f"failures-w{world}")) / kind
        d.mkdir()
        try:
            spawn_processes(world, gloo_rank, str(d), backend="gloo", timeout_s=WORLD_BUDGET_S)
            _RESULTS[key] = [
                torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(world)
            ]
        except BaseException as e:
            _RESULTS[key] = e
    got = _RESULTS[key]
    if isinstance(got, BaseException):
        raise RuntimeError(f"the {kind} world of {world} ranks failed") from got
    return got


def scenario(kind: str, world: int, name: str, tmp_path_factory) -> list[dict]:
    per_rank = [
        r.get(name, {"crash": "not reached"}) for r in results(kind, world, tmp_path_factory)
    ]
    for rank, res in enumerate(per_rank):
        assert "crash" not in res, f"rank {rank}:\n{res['crash']}"
    return per_rank
