"""cpindex.spawn: a failed run of W processes is one error in the parent, naming the rank whose
own error explains it, and leaves no files behind."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch.distributed as dist

from cpindex.spawn import GRACE_S, RanksFailed, spawn_processes


def _ranks_fail(rank: int, world: int) -> None:
    """Every way a rank can end a run, at once (one spawn: each start costs seconds)."""
    dist.barrier()  # all started: the failures below come close together
    if rank == 0:
        raise KeyError("oops")  # a bug, first
    if rank == 1:
        time.sleep(0.3)
        raise ValueError("max_rows: expected at most 8\nsecond line of detail")  # bad input
    if rank == 2:
        os._exit(3)
    dist.barrier()  # rank 3 waits for peers that never come: stopped after the grace


def test_a_failed_run_is_one_error_and_leaves_no_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # re-read TMPDIR here too
    t0 = time.monotonic()
    try:
        with pytest.raises(RanksFailed) as ei:
            spawn_processes(4, _ranks_fail, timeout_s=60)
    finally:
        tempfile.tempdir = None
    assert time.monotonic() - t0 < 30 + GRACE_S  # not the barrier's own (30 min) timeout
    e = ei.value
    # bad input explains a run before a bug, a bug before an exit or a peer's reaction
    assert str(e) == "rank 1: ValueError: max_rows: expected at most 8"  # one line
    assert e.primary.rank == 1 and e.primary.expected
    assert "second line of detail" in e.primary.message
    assert "raise ValueError" in e.primary.traceback
    others = {f.rank: f for f in e.failures[1:]}
    assert others[0].line() == "rank 0: KeyError: 'oops'" and not others[0].expected
    assert others[2].line() == "rank 2: ProcessExit: the process exited with code 3"
    assert list(tmp_path.iterdir()) == []  # no pytorch-errorfile-*.pickle
