"""The in-process world's helpers: ordering of in_turn, timeouts that name late ranks, and the
rank streams' checks."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from cpindex.comm import CollectiveTimeout
from cpindex.world import in_turn, run_threads


def test_in_turn_runs_one_rank_at_a_time_in_rank_order():
    order: list[int] = []
    active = []
    lock = threading.Lock()

    def rank_fn(comm):
        def body():
            with lock:
                active.append(comm.rank)
                assert len(active) == 1, f"ranks {active} inside at once"
            time.sleep(0.01)
            order.append(comm.rank)
            with lock:
                active.remove(comm.rank)
            return comm.rank * 10

        return in_turn(comm, body)

    assert run_threads(4, rank_fn) == [0, 10, 20, 30]
    assert order == [0, 1, 2, 3]


def test_exchange_timeout_names_the_ranks_that_never_came():
    def rank_fn_timed(comm):
        comm.all_gather_object("hello")
        if comm.rank == 2:
            return None  # skips the tensor collective below
        import torch

        out = torch.empty(3 * 4)
        comm.all_gather_into(out, torch.ones(4), timeout_s=0.3)
        return None

    with pytest.raises(CollectiveTimeout) as ei:
        run_threads(3, rank_fn_timed)
    assert ei.value.late == [2]


def test_every_failing_rank_is_reported():
    """The first rank's own error is raised; the others' ride along as notes, so a late rank and
    the ranks that timed out waiting for it are all visible."""

    def rank_fn(comm):
        if comm.rank in (1, 2):
            raise RuntimeError(f"boom on {comm.rank}")
        comm.barrier()  # ranks 0 and 3 are released by the abort, with a CollectiveTimeout

    with pytest.raises(RuntimeError, match="boom on 1") as info:
        run_threads(4, rank_fn, timeout_s=5)
    notes = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))  # 3.10: in str
    assert "rank 2 failed too: RuntimeError: boom on 2" in notes
    assert "rank 0 failed too" in notes and "rank 3 failed too" in notes
    # the ranks released by the abort say why, rather than "timed out"
    assert re.search(r"rank 0 failed too: CollectiveTimeout: .* abandoned: rank [12] failed", notes)


def test_more_ranks_than_hardware_queues_is_refused(monkeypatch):
    from cpindex.world import rank_streams

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    monkeypatch.setenv("GPU_MAX_HW_QUEUES", "4")
    with pytest.raises(ValueError, match="world_size=5 ranks on one GPU need 5 hardware work"):
        rank_streams(torch.device("cuda", 0), 5)


def test_hardware_queue_count_must_be_a_number(monkeypatch):
    from cpindex.world import rank_streams

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "eight")
    monkeypatch.setenv("GPU_MAX_HW_QUEUES", "eight")
    with pytest.raises(ValueError, match="expected a whole number"):
        rank_streams(torch.device("cuda", 0), 2)
