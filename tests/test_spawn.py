"""cpindex.spawn: a failed run of W processes is one error in the parent, naming the rank whose
own error explains it, and leaves no files behind."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from cpindex.spawn import GRACE_S, RanksFailed, spawn_processes


def _scenario(rank: int, world: int, what: str) -> None:
    if what == "bad input on rank 1":
        if rank == 1:
            raise ValueError("max_rows: expected at most 8\nsecond line of detail")
        dist.barrier()  # rank 0 waits for a peer that never comes: stopped after the grace
    elif what == "a bug on rank 0":
        if rank == 0:
            raise KeyError("oops")
        dist.barrier()
    elif what == "rank 1 exits":
        if rank == 1:
            os._exit(3)
        time.sleep(60)  # stopped after the grace
    elif what == "all fine":
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [world, world]


def test_failed_runs_are_one_error_and_leave_no_files(tmp_path, monkeypatch):
    """One spawn per scenario, one test: each start costs seconds on a small machine."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # re-read TMPDIR here too
    try:
        spawn_processes(2, _scenario, "all fine", timeout_s=60)

        t0 = time.monotonic()
        with pytest.raises(RanksFailed) as ei:
            spawn_processes(2, _scenario, "bad input on rank 1", timeout_s=60)
        assert time.monotonic() - t0 < 30 + GRACE_S  # not the barrier's own (30 min) timeout
        e = ei.value
        assert str(e) == "rank 1: ValueError: max_rows: expected at most 8"  # one line
        assert e.primary.rank == 1 and e.primary.expected
        assert "second line of detail" in e.primary.message
        assert "raise ValueError" in e.primary.traceback

        with pytest.raises(RanksFailed) as ei:
            spawn_processes(2, _scenario, "a bug on rank 0", timeout_s=60)
        assert ei.value.primary.rank == 0 and not ei.value.primary.expected
        assert str(ei.value) == "rank 0: KeyError: 'oops'"

        with pytest.raises(RanksFailed) as ei:
            spawn_processes(2, _scenario, "rank 1 exits", timeout_s=60)
        assert str(ei.value) == "rank 1: ProcessExit: the process exited with code 3"
    finally:
        tempfile.tempdir = None
    assert list(tmp_path.iterdir()) == []  # no pytorch-errorfile-*.pickle
