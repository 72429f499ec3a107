"""Adversarial checks of cpindex's failure handling on the CPU (real gloo processes): families
of out-of-step and failure attacks, each made by one rank as a hostile caller would, then a
mixed soak of good calls with injected out-of-step ones. Bounded in count and time.

    PYTHONPATH=. python benchmarks/adversarial.py --worlds 2 4 --rounds 3 --soak-calls 300

Prints, per world and in total: attacks, their outcomes by kind, soak calls, rank-executions,
injected calls and mismatches. Outcome kinds of an attack:

* ``raised``: every rank raised a cpindex error (the misbehaving rank may raise the
  TypeError/ValueError naming its own bad argument), each within ``timeout_s`` + 1 s;
* ``silent``: every rank returned (the attack went unnoticed);
* ``split``: some ranks returned, others raised;
* ``raw``: a rank raised something else (a raw torch/gloo error, or a bad-argument error on a
  rank that passed good ones);
* ``slow``: a rank took longer than ``timeout_s`` + 1 s.

After every attack each rank calls ``reset()`` and makes one checked call: ``recovered`` counts
the attacks after which every rank computed the reference's bits again.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cpindex
from cpindex import partition, reference, testing
from cpindex.comm import TorchComm
from cpindex.config import CPIndexConfig
from cpindex.spawn import spawn_processes

TIMEOUT_S = 1.0
HEADS = 4
TOPK = 8


def _cfg(**kw: Any) -> CPIndexConfig:
    base = dict(
        cache_format="fp8", max_rows=16, max_width=32, max_topk=TOPK, transport="collective",
        num_heads=HEADS, cp_min_blocks=0, timeout_s=TIMEOUT_S,
    )  # fmt: skip
    return CPIndexConfig(**{**base, **kw})


def _problems() -> list[testing.Problem]:
    return [
        testing.make_problem(3, 1200, "fp8", num_heads=HEADS, seed=1),
        testing.make_problem(5, 2500, "fp8", num_heads=HEADS, seed=2),
        testing.make_problem(2, 4 * 128, "fp8", num_heads=HEADS, seed=3, query_len=2),
    ]


def _outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
        out: dict[str, Any] = {"type": None}
    except Exception as e:
        out = {
            "type": type(e).__name__,
            "lib": isinstance(e, cpindex.CPIndexError),
            "arg": isinstance(e, (TypeError, ValueError))
            and not isinstance(e, cpindex.CPIndexError),
        }
    out["s"] = time.monotonic() - t0
    return out


class Rank:
    """One rank's side: its instance, the problems and their reference results."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.probs = _problems()
        self.heads = partition.heads_of_rank(rank, HEADS, world)
        self.want_scores, self.want_ids = [], []
        for p in self.probs:
            kw = dict(init_blocks=0, local_blocks=1, width=p.width, query_len=p.query_len)
            scores = reference.block_scores(p.q, p.index_cache, p.block_table, p.seq_lens, **kw)
            ids = reference.select_blocks(
                p.q, p.index_cache, p.block_table, p.seq_lens, topk=TOPK, **kw
            )
            self.want_scores.append(scores[self.heads])
            self.want_ids.append(ids[self.heads])
        self.cp = cpindex.IndexCP(_cfg(), device="cpu")

    def call(
        self, i: int, tag: int, op: str = "score", *, table=None, lens=None, width=None,
        init: int = 0, iq=None, rows: int | None = None,
    ) -> bool:  # fmt: skip
        """Problem ``i``'s call (altered where asked); True when it matches the reference."""
        p, cp = self.probs[i], self.cp
        table = p.block_table if table is None else table
        lens = p.seq_lens if lens is None else lens
        if rows is not None:
            table, lens = table[:rows], lens[:rows]
        plan = cp.plan(
            table, lens, query_len=p.query_len, init_blocks=init,
            width=p.width if width is None else width,
        )  # fmt: skip
        q = p.rank_queries(self.rank, self.world) if iq is None else iq
        if rows is not None:
            q = q[: rows * p.query_len]
        if op == "score":
            got = cp.score_push(q, p.index_cache, plan, tag=tag)
            return bool(torch.equal(got, self.want_scores[i]))
        got = cp.select_blocks(q, p.index_cache, plan, topk=TOPK, tag=tag)
        return bool(torch.equal(got, self.want_ids[i]))

    def recover(self) -> bool:
        try:
            self.cp.reset()
            return self.call(0, 0)
        except Exception:
            return False


def _limit_memory(headroom: int) -> tuple[int, int]:
    """Cap this process's address space at what it maps now plus ``headroom`` bytes."""
    old = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, old[1]))
    return old


def _flip(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0, 0], t[0, 1] = int(t[0, 1]), int(t[0, 0])
    return t


def _attack(r: Rank, family: str, bad: bool, rng: random.Random) -> Callable[[], Any]:
    """What this rank does in one attack of ``family`` (``bad``: it is the misbehaving rank)."""
    p = r.probs[0]
    tag = rng.randrange(1, 1 << 40)
    good = lambda: r.call(0, tag)  # noqa: E731
    if family == "construction_mismatch":
        return lambda: cpindex.IndexCP(_cfg(max_rows=8 if bad else 16), device="cpu").close()
    if family == "construction_type":
        cfg: Any = "not a config" if bad else _cfg()
        return lambda: cpindex.IndexCP(cfg, device="cpu").close()
    if family == "construction_device":
        dev = "meta" if bad else "cpu"
        return lambda: cpindex.IndexCP(_cfg(), device=dev).close()
    if family == "construction_stall":  # the bad rank's first round after the agreement is late
        comm = TorchComm()
        if bad:
            real, first = comm.all_gather_object, [True]

            def late(obj: Any) -> list[Any]:
                if first and first.pop():
                    time.sleep(TIMEOUT_S + 0.5)
                return real(obj)

            comm.all_gather_object = late  # type: ignore[method-assign]
        return lambda: cpindex.IndexCP(_cfg(), device="cpu", comm=comm).close()
    if family == "construction_alloc":  # the bad rank cannot allocate its buffers
        big = _cfg(max_rows=256, max_width=1 << 18, max_buffer_bytes=1 << 40)

        def build() -> None:
            old = _limit_memory(128 << 20) if bad else None
            try:
                cpindex.IndexCP(big, device="cpu").close()
            finally:
                if old is not None:
                    resource.setrlimit(resource.RLIMIT_AS, old)

        return build
    if family == "reset_argument":
        value = rng.choice([-1.0, -0.5, 0, float("inf"), float("nan"), "1", 1e300, True])
        return (lambda: r.cp.reset(value)) if bad else r.cp.reset
    if family == "skip":  # the bad rank skips the call tagged t: its next pairs with it
        return (lambda: r.call(0, tag + 1)) if bad else (lambda: (good(), r.call(0, tag + 1)))
    if not bad:
        return good
    return {
        "tag": lambda: r.call(0, tag + 1),
        "op": lambda: r.call(0, tag, "select"),
        "rows": lambda: r.call(0, tag, rows=p.block_table.shape[0] - 1),
        "width": lambda: r.call(0, tag, width=p.width + 1),
        "forcing": lambda: r.call(0, tag, init=1),
        "table": lambda: r.call(0, tag, table=_flip(p.block_table)),
        "lengths": lambda: r.call(0, tag, lens=p.seq_lens - 1),
        "problem": lambda: r.call(1, tag),
        "bad_dtype": lambda: r.call(0, tag, iq=p.rank_queries(r.rank, r.world).float()),
        "negative_width": lambda: r.call(0, tag, width=-1),
        "bad_tag": lambda: r.cp.score_push(
            p.rank_queries(r.rank, r.world),
            p.index_cache,
            r.cp.plan(p.block_table, p.seq_lens, width=p.width),
            tag=-1,
        ),
        "stall": lambda: (time.sleep(TIMEOUT_S + 0.5), r.call(0, tag)),
    }[family]


FAMILIES = (
    "tag", "skip", "op", "rows", "width", "forcing", "table", "lengths", "problem", "bad_dtype",
    "negative_width", "bad_tag", "stall", "reset_argument", "construction_mismatch",
    "construction_type", "construction_device", "construction_stall", "construction_alloc",
)  # fmt: skip


def rank_main(rank: int, world: int, out_dir: str, seed: int, rounds: int, soak: int) -> None:
    torch.set_num_threads(1)
    res: dict[str, Any] = {"attacks": [], "soak": {}}
    try:
        r = Rank(rank, world)
        rng = random.Random(seed)  # the same on every rank: every rank knows the plan
        for _ in range(rounds):
            for family in FAMILIES:
                bad_rank = rng.randrange(world)
                act = _attack(r, family, rank == bad_rank, rng)
                out = _outcome(act)
                out.update(family=family, bad=rank == bad_rank, recovered=r.recover())
                res["attacks"].append(out)
        res["soak"] = _soak(r, rng, soak)
        r.cp.close()
    except Exception:
        res["crash"] = traceback.format_exc()
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    os._exit(0)


def _soak(r: Rank, rng: random.Random, calls: int) -> dict[str, int]:
    """Good calls of random problems, ops and tags, with out-of-step ones injected: a good call
    must give the reference's bits, an injected one must raise on every rank."""
    got = Counter()
    for i in range(calls):
        which, op = rng.randrange(len(r.probs)), rng.choice(["score", "select"])
        inject = rng.random() < 0.05
        bad_rank = rng.randrange(r.world)
        tag = i + 1
        got["calls"] += 1
        if inject:
            got["injected"] += 1
            bad = r.rank == bad_rank
            alt = (which + 1) % len(r.probs)
            e = _outcome(lambda w=(alt if bad else which), t=tag, o=op: r.call(w, t, o))
            got["injected_raised"] += e["type"] is not None and (e["lib"] or (bad and e["arg"]))
            r.recover()
            continue
        try:
            ok = r.call(which, tag, op)
        except Exception:
            ok = False
            r.recover()
        got["mismatches"] += not ok
    return dict(got)


def _classify(per_rank: list[dict[str, Any]]) -> str:
    limit = TIMEOUT_S + 1.0
    late = TIMEOUT_S + 0.5 if "stall" in per_rank[0]["family"] else 0.0  # the stall itself
    if any(o["s"] > limit + late for o in per_rank):
        return "slow"
    raised = [o["type"] is not None for o in per_rank]
    if not any(raised):
        return "silent"
    if not all(raised):
        return "split"
    if all(o["lib"] or (o["bad"] and o["arg"]) for o in per_rank):
        return "raised"
    return "raw"


def run_world(world: int, seed: int, rounds: int, soak: int, budget_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        spawn_processes(world, rank_main, d, seed, rounds, soak, backend="gloo", timeout_s=budget_s)
        ranks = [torch.load(Path(d) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    crashes = [f"rank {r}: {x['crash']}" for r, x in enumerate(ranks) if "crash" in x]
    if crashes:
        raise RuntimeError("\n".join(crashes))
    attacks = list(zip(*(x["attacks"] for x in ranks), strict=True))
    outcomes = Counter(_classify(list(a)) for a in attacks)
    soak_calls = ranks[0]["soak"]
    return {
        "world": world,
        "attacks": len(attacks),
        "outcomes": dict(outcomes),
        "recovered": sum(all(o["recovered"] for o in a) for a in attacks),
        "by_family": {
            f: dict(Counter(_classify(list(a)) for a in attacks if a[0]["family"] == f))
            for f in FAMILIES
        },
        "soak_calls": soak_calls.get("calls", 0),
        "rank_executions": soak_calls.get("calls", 0) * world,
        "injected": soak_calls.get("injected", 0),
        "injected_raised_everywhere": min(x["soak"].get("injected_raised", 0) for x in ranks),
        "mismatches": sum(x["soak"].get("mismatches", 0) for x in ranks),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=2, help="passes over every attack family")
    ap.add_argument("--soak-calls", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=600.0, help="per world; killed past it")
    args = ap.parse_args(argv)
    total: Counter = Counter()
    failed = False
    for w in args.worlds:
        t0 = time.monotonic()
        got = run_world(w, args.seed + w, args.rounds, args.soak_calls, args.budget_s)
        print(
            f"W={w}: {got['attacks']} attacks {got['outcomes']}, recovered {got['recovered']}; "
            f"soak {got['soak_calls']} calls ({got['rank_executions']} rank-executions), "
            f"{got['injected']} injected, raised everywhere {got['injected_raised_everywhere']}, "
            f"mismatches {got['mismatches']} ({time.monotonic() - t0:.0f} s)"
        )
        bad = {f: o for f, o in got["by_family"].items() if set(o) - {"raised"}}
        if bad:
            print(f"  not raised everywhere: {bad}")
        failed |= bool(bad) or got["mismatches"] > 0
        failed |= got["injected_raised_everywhere"] != got["injected"]
        total.update({k: got[k] for k in ("attacks", "recovered", "soak_calls", "rank_executions")})
        total.update({k: got[k] for k in ("injected", "injected_raised_everywhere", "mismatches")})
        total.update({f"outcome:{k}": v for k, v in got["outcomes"].items()})
    print("total:", dict(total))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
