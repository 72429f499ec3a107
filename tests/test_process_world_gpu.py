"""The process boundary on one GPU: the ``ipc`` transport between W processes, all on
``cuda:0`` (``tests/_process_world.py``): gloo for the host side, real CUDA IPC handles for the
buffers, allowed by the test switch ``cpindex.transports.peer.allow_shared_gpu_processes``.

Covers what the one-process world cannot (it exchanges raw pointers): IPC handle export and
open, every format's ``score_push`` and ``select_blocks`` across processes, graph capture and
replay in each process, 200 construct/close cycles without leaked mappings or memory, and a peer
process killed with SIGKILL mid-call. The GPU time-slices between the processes, so each call
costs tens of ms of handoffs; each world runs once for all its tests (W = 2, then W = 4).

Run: ``PYTHONPATH=$PWD python -m pytest -q -s tests/test_process_world_gpu.py`` (set
``PROCESS_WORLD_RESULTS`` to keep the measurements as ``process_world.json`` there).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
from typing import Any

import pytest
import torch
from _gpu import assert_scores, expected, for_rank, needs_gpu, unambiguous
from _process_world import (
    CASES,
    CYCLES,
    FORMATS,
    KILL_TIMEOUT_S,
    TOPK,
    WorldRun,
    build_inputs,
    run_world,
    save_inputs,
)

from cpindex import reference, selection, testing

pytestmark = [needs_gpu, pytest.mark.gpu]

VICTIM = {2: 1, 4: 0}  # W = 4 kills rank 0, the host of the group's store
# cudaMemGetInfo is device-wide; one leaked region (or a mapping that keeps a peer's region
# alive) is 0.5-1 MiB per rank per cycle, so a leak shows as hundreds of MiB.
LEAK_BYTES = 16 << 20
ALLOCATOR_BYTES = 1 << 20  # this process's caching allocator: one leaked instance holds more
FD_SLACK = 8

RECORD: dict[str, dict[str, Any]] = {}


def _record(world: int, key: str, value: Any) -> None:
    """Print a measurement and keep it in ``$PROCESS_WORLD_RESULTS/process_world.json``."""
    RECORD.setdefault(f"W{world}", {})[key] = value
    print(f"\n[process world, W={world}] {key}: {json.dumps(value)}")
    out = os.environ.get("PROCESS_WORLD_RESULTS")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "process_world.json"), "w") as f:
            json.dump(RECORD, f, indent=2)


def _ms(xs: list[float]) -> dict[str, float]:
    return {
        "n": len(xs),
        "median_ms": round(1e3 * statistics.median(xs), 2),
        "min_ms": round(1e3 * min(xs), 2),
        "max_ms": round(1e3 * max(xs), 2),
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[dict[str, Any], Any]:
    """Every world's inputs, built here on the CPU (the parent never touches CUDA) and written
    once for the ranks to read."""
    data = build_inputs()
    path = tmp_path_factory.mktemp("procworld-inputs") / "inputs.pt"
    save_inputs(data, path)
    return data, path


@pytest.fixture(scope="module", params=sorted(VICTIM), ids=lambda w: f"W{w}")
def run(request, inputs, tmp_path_factory) -> WorldRun:
    w = request.param
    res = run_world(w, tmp_path_factory.mktemp(f"procworld-W{w}"), VICTIM[w], inputs[1])
    _record(w, "world_s", round(res.seconds, 2))
    return res


def _phase(run: WorldRun, phase: str) -> dict[int, Any]:
    """Every rank's data from ``phase``, or the test fails with the ranks' errors."""
    reports = run.reports.get(phase)
    if reports is None:
        pytest.fail(f"phase {phase!r} was not reached; {run.failure()}")
    bad = [f"rank {r}: {rep['error']}" for r, rep in sorted(reports.items()) if not rep["ok"]]
    if bad:
        pytest.fail(f"phase {phase!r} failed:\n" + "\n".join(bad))
    return {r: rep["data"] for r, rep in reports.items()}


_REFS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _reference(prob: testing.Problem, init: int, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All heads' reference scores and top-``TOPK`` ids (computed once per problem)."""
    key = id(prob)
    if key not in _REFS:
        scores = expected(prob, init, local)
        ids = reference.select_blocks(
            prob.q, prob.index_cache, prob.block_table, prob.seq_lens, init_blocks=init,
            local_blocks=local, width=prob.width, query_len=prob.query_len, topk=TOPK,
        )  # fmt: skip
        _REFS[key] = (scores, ids)
    return _REFS[key]


def _check(got: dict, ref: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> None:
    """A rank's ``score_push`` scores equal the reference; its ``select_blocks`` ids and scores
    are exactly the selection of those scores, and the reference's ids wherever the k-th and
    (k+1)-th scores are not within summation noise."""
    scores, ids, vals = got["scores"], got["ids"], got["vals"]
    assert_scores(scores, for_rank(ref[0], rank, world))
    want_ids, want_vals = torch.empty_like(ids), torch.empty_like(vals)
    selection.select(scores, TOPK, want_ids, want_vals)
    assert torch.equal(ids, want_ids), "select_blocks ids are not the selection of the scores"
    assert torch.equal(vals, want_vals), "select_blocks scores are not the selected scores"
    ok = unambiguous(scores, TOPK)
    assert torch.equal(ids[ok], for_rank(ref[1], rank, world)[ok]), "ids differ from reference"


def test_ranks_are_separate_processes_on_one_gpu(run):
    ready = _phase(run, "ready")
    _record(run.world, "device", ready[0]["device"])
    _record(run.world, "kernel_load_s", round(max(d["load_s"] for d in ready.values()), 2))
    assert len({d["pid"] for d in ready.values()}) == run.world


def test_calls_equal_the_reference(run, inputs):
    """Every format, T = 1 and 4 (full and ragged batches, forcing counts 0/1 and 1/1): each
    rank's ``score_push`` and ``select_blocks`` equal the reference; outputs were poisoned
    before every call."""
    data = _phase(run, "calls")
    probs = inputs[0]["calls"]
    for op in ("score_push", "select_blocks"):
        times = [t["s"] for d in data.values() for t in d["times"] if t["op"] == op]
        _record(run.world, f"{op}_call", _ms(times))
    failures = []
    for rank, d in sorted(data.items()):
        assert d["transports"] == dict.fromkeys(FORMATS, "ipc"), d["transports"]
        assert d["ipc_mappings"] == dict.fromkeys(FORMATS, run.world - 1), (
            f"rank {rank}: peers' buffers were not opened through IPC handles"
        )
        for fmt in FORMATS:
            for case in CASES:
                ref = _reference(probs[fmt][case.name], case.init, case.local)
                try:
                    _check(d["results"][f"{fmt}/{case.name}"], ref, rank, run.world)
                except AssertionError as e:
                    failures.append(f"rank {rank}, {fmt}, {case.name}: {e}")
    assert not failures, "\n".join(failures)


def test_graph_capture_and_replay_in_each_process(run, inputs):
    """Each process captures a ``score_push`` and a ``select_blocks`` in one graph and replays
    it with new q, seq_lens and block_table copied into the captured tensors."""
    data = _phase(run, "graph")
    variants = inputs[0]["graph"]
    _record(run.world, "graph_replay", _ms([t for d in data.values() for t in d["times"]]))
    failures = []
    for rank, d in sorted(data.items()):
        assert len(d["replays"]) == len(variants)
        for v, (prob, got) in enumerate(zip(variants, d["replays"], strict=True)):
            try:
                _check(got, _reference(prob, 0, 1), rank, run.world)
            except AssertionError as e:
                failures.append(f"rank {rank}, replay {v}: {e}")
    assert not failures, "\n".join(failures)


def test_construct_close_cycles_leak_nothing(run):
    """200 constructions and closes (IPC handles exported, opened, closed, regions freed):
    device memory (cudaMemGetInfo), this process's allocator and its file descriptors end
    where they started."""
    data = _phase(run, "cycles")

    def most(what: str) -> int:
        return max(d["after"][what] - d["before"][what] for d in data.values())

    summary = {
        "cycles": CYCLES,
        "per_cycle_ms": round(1e3 * max(d["seconds"] for d in data.values()) / CYCLES, 2),
        "device_free_lost_bytes": max(
            d["before"]["free"] - d["after"]["free"] for d in data.values()
        ),
        "allocated_delta_bytes": most("allocated"),
        "fd_delta": most("fds"),
    }
    _record(run.world, "cycles", summary)
    for rank, d in sorted(data.items()):
        before, after = d["before"], d["after"]
        assert d["cycles"] == CYCLES
        lost = before["free"] - after["free"]
        assert lost <= LEAK_BYTES, f"rank {rank}: {lost:,} bytes of device memory lost"
        grown = after["allocated"] - before["allocated"]
        assert grown <= ALLOCATOR_BYTES, f"rank {rank}: allocator grew {grown:,} bytes"
        fds = after["fds"] - before["fds"]
        assert fds <= FD_SLACK, f"rank {rank}: {fds} more open file descriptors"


def test_killed_peer_is_named_by_every_survivor_in_time(run):
    """A rank killed with SIGKILL while the ranks call in a loop: every survivor's call raises
    ``PeerTimeoutError`` or ``PeerConnectionError`` naming it, within ``timeout_s`` + 1 s of
    the kill (measured on the survivors' clock, the system-wide monotonic one)."""
    data = _phase(run, "kill")
    v = run.victim
    assert run.t_kill is not None
    latency = {r: d["t_error"] - run.t_kill for r, d in data.items() if d["error_type"]}
    _record(
        run.world,
        "kill",
        {
            "victim": v,
            "timeout_s": KILL_TIMEOUT_S,
            "errors": {r: d["error_type"] for r, d in sorted(data.items())},
            "kill_to_error_s": {r: round(t, 3) for r, t in sorted(latency.items())},
            "calls_before_error": {r: d["calls"] for r, d in sorted(data.items())},
        },
    )
    assert run.exitcodes[v] == -signal.SIGKILL, f"victim exit code {run.exitcodes[v]}"
    for rank, d in sorted(data.items()):
        kind, message = d["error_type"], d.get("message", "")
        assert kind in ("PeerTimeoutError", "PeerConnectionError"), (
            f"rank {rank}: {kind}: {message} (after {d['calls']} calls, {d['loop_s']:.1f} s)"
        )
        assert re.search(rf"\brank {v}\b", message), (
            f"rank {rank} does not name rank {v}: {message}"
        )
        if kind == "PeerTimeoutError":
            assert d["peer"] == v, f"rank {rank} blames rank {d['peer']}: {message}"
        assert 0 < latency[rank] <= KILL_TIMEOUT_S + 1.0, (
            f"rank {rank} raised {latency[rank]:.2f} s after the kill: {message}"
        )
