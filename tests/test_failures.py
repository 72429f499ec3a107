"""Every failure a caller can cause is a library error on every rank, and every wait is
bounded (docs/contract.md, "Failure handling, tested"): ``reset()``'s argument, a refused call
of sizes no call may have, ``write_keys``' inputs, and a config file that would block.

Real gloo worlds of 2 and 4 processes (one per size runs every scenario of
``tests/_failures.py`` in turn, shared with tests/test_construction.py); rank 0 misbehaves,
the others call as they should. After each, the ranks compute correct results again.
"""

from __future__ import annotations

import faulthandler
import os
import threading

import pytest
import torch
from _failures import BAD_TIMEOUTS, SLACK, TIMEOUT_S, scenario

from cpindex import formats
from cpindex.config import CPIndexConfig

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support"),
]
WORLDS = [2, 4]


@pytest.fixture(autouse=True)
def _hang_guard():
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("world", WORLDS)
def test_a_lone_reset_with_a_negative_timeout_raises_within_the_timeout(world, tmp_path_factory):
    res = scenario("main", world, "reset_lone_negative", tmp_path_factory)
    lone = res[0]["lone"]
    assert lone["type"] == "ValueError" and "timeout_s" in lone["msg"], lone
    assert lone["s"] < TIMEOUT_S + 1.0, lone
    for rank, r in enumerate(res):
        assert r["after"]["type"] is None, (rank, r["after"])
        assert r["correct"], rank


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("value", [repr(v) for v in BAD_TIMEOUTS])
def test_a_bad_reset_timeout_on_one_rank_is_one_outcome_for_all(world, value, tmp_path_factory):
    res = scenario("main", world, "reset_bad_values", tmp_path_factory)
    bad = res[0][value]
    assert bad["arg"] and "timeout_s" in bad["msg"], bad
    assert bad["s"] < SLACK, bad
    for rank in range(1, world):
        e = res[rank][value]
        assert e["type"] == "OutOfStepError" and e["peer"] == 0, (rank, e)
        assert "refused by rank 0" in e["msg"] and "timeout_s" in e["msg"], (rank, e)
        assert e["s"] < SLACK, (rank, e)
    for rank, r in enumerate(res):
        assert r[value + "/after"]["type"] is None, (rank, r[value + "/after"])
        assert r["correct"], rank


@pytest.mark.parametrize("world", WORLDS)
def test_a_negative_width_is_a_refusal_every_peer_hears_at_once(world, tmp_path_factory):
    res = scenario("main", world, "negative_width", tmp_path_factory)
    own = res[0]["call"]
    assert own["type"] == "ValueError" and "width" in own["msg"], own
    for rank in range(1, world):
        e = res[rank]["call"]
        assert e["type"] == "OutOfStepError" and e["peer"] == 0, (rank, e)
        assert e["s"] < SLACK, (rank, e)
    assert all(r["correct"] for r in res)


@pytest.mark.parametrize("world", WORLDS)
def test_a_group_with_a_half_done_collective_is_refused_before_gloo(world, tmp_path_factory):
    res = scenario("main", world, "half_done_group", tmp_path_factory)
    for rank, r in enumerate(res):
        if rank < world - 1:  # the last rank raises the error it was made to raise
            assert r["call"]["type"] == "PeerTimeoutError", (rank, r["call"])
        assert r["reset"]["type"] == "CPIndexError", (rank, r["reset"])
        assert "cannot be reused" in r["reset"]["msg"], (rank, r["reset"])
        new = r["new"]  # the process is alive to report it: gloo did not abort it
        assert new["type"] == "CPIndexError", (rank, new)
        assert "cannot be used again" in new["msg"] and "new group" in new["msg"], (rank, new)
        assert new["s"] < SLACK, (rank, new)


# ---- one process -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nested", "sparse_coo", "sparse_csr"])
def test_write_keys_refuses_nested_and_sparse_keys_naming_them(kind):
    cache = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    dense = torch.randn(3, 128)
    keys = {
        "nested": lambda: torch.nested.nested_tensor([dense[:2], dense[2:]]),
        "sparse_coo": dense.to_sparse,
        "sparse_csr": dense.to_sparse_csr,
    }[kind]()
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="keys: expected a dense"):
        formats.write_keys(cache, keys, slots)
    with pytest.raises(TypeError, match="slot_mapping: expected a dense"):
        formats.write_keys(cache, dense, slots.to_sparse())
    assert not cache.any()  # nothing written


def test_a_config_fifo_without_a_writer_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "cfg.json"
    os.mkfifo(fifo)
    got: list[BaseException | None] = []

    def load() -> None:
        try:
            CPIndexConfig.from_file(fifo)
            got.append(None)
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(5.0)
    if t.is_alive():  # blocked in open(): release it, then fail
        with open(fifo, "w"):
            pass
        t.join(5.0)
        pytest.fail("CPIndexConfig.from_file blocked on a FIFO with no writer")
    assert isinstance(got[0], ValueError) and "FIFO" in str(got[0]), got
    d = tmp_path / "dir.yaml"
    d.mkdir()
    with pytest.raises(ValueError, match="directory"):
        CPIndexConfig.from_file(d)
