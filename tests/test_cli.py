"""The command line: ``python -m cpindex`` in a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _cpindex(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cpindex", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_two_ranks_matches():
    res = _cpindex("demo", "--world", "2", "--rows", "3", "--context", "1000")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "all ranks match" in res.stdout, out
    assert "MISMATCH" not in out
    assert "cpindex demo: 2 ranks, 3 rows up to 1000 tokens (8 blocks), format nvfp4" in out
    assert "transport collective" in out
    # one line per rank, both matching, same top-16
    rank_lines = [ln.split() for ln in res.stdout.splitlines() if ln.split()[:1] in (["0"], ["1"])]
    assert len(rank_lines) == 2, out
    assert all(ln[-2:] == ["yes", "same"] for ln in rank_lines), out


def test_help():
    res = _cpindex("--help", timeout=60)
    assert res.returncode == 0, res.stderr
    for word in ("demo", "bench", "info"):
        assert word in res.stdout


def test_demo_help_lists_options():
    res = _cpindex("demo", "--help", timeout=60)
    assert res.returncode == 0, res.stderr
    for opt in ("--world", "--rows", "--context", "--format", "--transport", "--seed"):
        assert opt in res.stdout


@pytest.mark.parametrize("args", [[], ["demo", "--format", "int4"], ["frobnicate"]])
def test_bad_arguments_exit_2(args):
    res = _cpindex(*args, timeout=60)
    assert res.returncode == 2
    assert "usage: cpindex" in res.stderr


def test_bench_cpu_writes_json(tmp_path):
    """`cpindex bench` on a CPU machine: collective + scoring + no-CP baseline, JSON out."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "cpindex", "bench", "--world", "2", "--rows", "1,3",
           "--context", "1k", "--iters", "2", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipping ipc" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["rows"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        assert r["agree"] == {"collective": True}
        assert r["collective"]["median_ms"] > 0 and r["nocp"]["median_ms"] > 0
