"""Construction is as bounded as a call, and a failed one leaves the group usable
(docs/contract.md, "Failure handling, tested"): a rank that refuses its arguments, constructs
alone, stalls or dies after the agreement, or cannot allocate its buffers makes every rank raise
one library error naming it, within ``timeout_s`` + 1 s (at once where the rank can say so), and
a construction on every rank right after works.

Real gloo worlds of 2 and 4 processes (tests/_failures.py; the ``main`` world is shared with
tests/test_failures.py); each death ends its own world.
"""

from __future__ import annotations

import faulthandler

import pytest
from _failures import SLACK, TIMEOUT_S, scenario

WORLDS = [2, 4]


@pytest.fixture(autouse=True)
def _hang_guard():
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _no_reset_advice(e: dict) -> None:
    assert "reset()" not in e["msg"], e  # a construction has no reset()
    assert "construct IndexCP again on every rank" in e["msg"], e


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("arg", ["config", "device"])
def test_a_refused_constructor_argument_reaches_every_peer_at_once(world, arg, tmp_path_factory):
    res = scenario("main", world, "construction_refused", tmp_path_factory)
    own = res[1][arg]
    assert own["arg"] and arg in own["msg"], own
    for rank, r in enumerate(res):
        if rank != 1:
            e = r[arg]
            assert e["type"] == "CPIndexError" and "failed on rank 1" in e["msg"], (rank, e)
            assert e["s"] < SLACK, (rank, e)
            _no_reset_advice(e)
        assert r[arg + "/again"] == {**r[arg + "/again"], "type": None}, (rank, r)


@pytest.mark.parametrize("world", WORLDS)
def test_a_refusal_before_building_reaches_every_peer_at_once(world, tmp_path_factory):
    res = scenario("main", world, "construction_env", tmp_path_factory)
    own = res[1]["env"]
    assert own["arg"] and "max_rows" in own["msg"], own
    for rank, r in enumerate(res):
        if rank != 1:
            e = r["env"]
            assert e["type"] == "CPIndexError" and "failed on rank 1" in e["msg"], (rank, e)
            assert "max_rows" in e["msg"] and e["s"] < SLACK, (rank, e)
            _no_reset_advice(e)
        assert r["again"]["type"] is None, (rank, r["again"])


@pytest.mark.parametrize("world", WORLDS)
def test_a_construction_alone_leaves_the_group_in_step(world, tmp_path_factory):
    res = scenario("main", world, "construction_alone", tmp_path_factory)
    alone = res[1]["alone"]
    assert alone["type"] == "PeerTimeoutError", alone
    _no_reset_advice(alone)
    for rank, r in enumerate(res):
        assert r["again"]["type"] is None, (rank, r["again"])


@pytest.mark.parametrize("world", WORLDS)
def test_a_peer_stalling_after_the_agreement_is_a_bounded_timeout(world, tmp_path_factory):
    res = scenario("main", world, "stall_after_agreement", tmp_path_factory)
    for rank, r in enumerate(res):
        e = r["stall"]
        assert e["type"] == "PeerTimeoutError", (rank, e)
        if rank != 1:
            assert e["peer"] == 1 and "rank(s) 1" in e["msg"], (rank, e)
            assert e["s"] < TIMEOUT_S + 1.0, (rank, e)
        _no_reset_advice(e)
        assert r["again"]["type"] is None, (rank, r["again"])


@pytest.mark.parametrize("world", WORLDS)
def test_an_allocation_failing_on_one_rank_is_one_error_on_every_rank(world, tmp_path_factory):
    res = scenario("main", world, "alloc_one_rank", tmp_path_factory)
    for rank, r in enumerate(res):
        e = r["alloc"]
        assert e["cpindex"], (rank, e)
        assert "rank 1: allocating its buffers" in e["msg"], (rank, e)
        assert e["s"] < SLACK, (rank, e)
        assert r["again"]["type"] is None, (rank, r["again"])


@pytest.mark.parametrize("world", WORLDS)
def test_an_allocation_failing_everywhere_is_one_library_error(world, tmp_path_factory):
    res = scenario("main", world, "alloc_every_rank", tmp_path_factory)
    for rank, r in enumerate(res):
        e = r["alloc"]
        assert e["cpindex"] and "allocating its buffers" in e["msg"], (rank, e)
        assert all(f"rank {q}: allocating" in e["msg"] for q in range(world)), (rank, e)
        assert e["s"] < SLACK, (rank, e)
        assert r["again"]["type"] is None, (rank, r["again"])


# Each death ends its world: one size each in the default run, the other marked slow.
DEATHS = [
    ("dies_after_agreement", 2),
    pytest.param("dies_after_agreement", 4, marks=pytest.mark.slow),
    ("dies_mid_call", 4),
    pytest.param("dies_mid_call", 2, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("when", "world"), DEATHS)
def test_a_dead_peer_is_named_by_every_survivor(when, world, tmp_path_factory):
    res = scenario(when, world, when, tmp_path_factory)
    victim = world - 1
    for rank in range(victim):
        e = res[rank]
        assert e["type"] == "PeerConnectionError", (rank, e)
        assert e["peer"] == victim and f"rank {victim}" in e["msg"], (rank, e)
        assert "process is gone" in e["msg"], (rank, e)
        assert e["s"] < 3.0 + 1.0, (rank, e)
