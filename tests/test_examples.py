"""The scripts in examples/ run as a user would run them (a subprocess each, CPU worlds here;
they use GPUs where there are enough)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_decode_step():
    """One format: the library's paths per format are tests/test_collective.py's."""
    res = _run("decode_step.py", "--world", "2", "--steps", "2", "--format", "nvfp4")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    steps = [ln for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 2, res.stdout
    assert all("3 requests x 4 tokens" in ln and "matches the reference" in ln for ln in steps)
    assert "every rank matched the reference at every step" in res.stdout


def test_ab_transports():
    res = _run("ab_transports.py", "--world", "2", "--requests", "3", "--context", "1000",
               "--query-len", "2", "--calls", "2")  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    ran = [ln for ln in lines if "us/call" in ln]
    assert ran and all("same bits as" in ln and ln.count(": yes") == 2 for ln in ran), res.stdout
    assert any(ln.split()[0] == "collective" for ln in ran), res.stdout
    if not _gpus():  # a CPU machine: ipc says why it cannot run
        assert any(ln.split()[:2] == ["ipc", "unavailable:"] for ln in lines), res.stdout


def test_vllm_swap():
    res = _run("vllm_swap.py", "--world", "2", "--steps", "3")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    steps = [ln for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 3, res.stdout
    assert all("3 requests x 4 rows" in ln and "matches the reference" in ln for ln in steps)
    assert "every rank matched the reference at every step" in res.stdout


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_examples_are_listed():
    """Every example is exercised above."""
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == [
        "ab_transports.py",
        "decode_step.py",
        "vllm_swap.py",
    ]
