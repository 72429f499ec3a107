"""Triton baseline block scorer vs a pure-torch oracle (docs/contract.md §2-§3).

Two ways to run the kernel:

* ``test_triton_baseline_gpu``: in-process on a CUDA/ROCm device (skipped without one).
* ``test_triton_baseline_interpreter``: on CPU through Triton's interpreter. ``TRITON_INTERPRET``
  must be set before triton is first imported / the kernel is decorated, and setting it in this
  pytest process would silently switch every other triton user in the session to the interpreter
  (or be ignored, if triton was already imported). So the check runs in a fresh subprocess whose
  environment alone carries ``TRITON_INTERPRET=1``; this process never touches the variable.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
REPO_ROOT = Path(__file__).resolve().parents[1]

BLOCK = 128
DIM = 128

# (heads, seq_lens, init_blocks, local_blocks, width, query_len): ragged lengths, partial last
# blocks, lengths shorter than init + local, width larger than needed, multi-token requests
# whose rows' causal cuts fall in different blocks.
CASES = [
    (1, [300], 0, 1, 5, 1),
    (4, [1, 129, 700], 1, 1, 8, 1),
    (3, [128, 256], 2, 2, 4, 1),
    (8, [600, 50], 0, 0, 6, 1),
    (2, [385, 200, 130], 1, 2, 7, 1),
    (4, [130, 4, 700], 0, 1, 6, 4),
    (4, [257, 1000], 1, 1, 8, 8),
]

# Context-parallel shares (heads, seq_lens, init, local, width, query_len, world, rank): a rank's
# blocks rank, rank + world, ... of each row, forced blocks and the width's last column included.
SHARE_CASES = [
    (4, [130, 4, 700], 0, 1, 6, 4, 4, 0),
    (4, [1000, 257], 1, 1, 9, 8, 4, 3),
    (2, [600, 50, 385], 2, 1, 7, 1, 2, 1),
]


def oracle(q, cache, block_table, seq_lens, init_blocks, local_blocks, width, sm_scale, t=1):
    rows, heads, _ = q.shape
    out = torch.full((heads, rows, width), float("-inf"), dtype=torch.float32)
    qf, kf = q.float().cpu(), cache.float().cpu()
    bt = block_table.cpu().repeat_interleave(t, dim=0).tolist()
    sl = (seq_lens.cpu().repeat_interleave(t) - (t - 1) + torch.arange(rows) % t).tolist()
    for i in range(rows):
        n = math.ceil(sl[i] / BLOCK)
        for j in range(min(n, width)):
            if j >= n - local_blocks:
                out[:, i, j] = 1e29
            elif j < init_blocks:
                out[:, i, j] = 1e30
            else:
                valid = min(BLOCK, sl[i] - j * BLOCK)
                k = kf[bt[i][j], :valid]  # [valid, D]
                out[:, i, j] = (qf[i] @ k.T * sm_scale).amax(dim=1)
    return out


def _make_case(heads, seq_lens, width, device, gen, t=1):
    rows = len(seq_lens)
    max_blocks = max(math.ceil(s / BLOCK) for s in seq_lens) + 1
    pages = rows * max_blocks + 3
    q = torch.randn(rows * t, heads, DIM, generator=gen).to(torch.bfloat16)
    cache = torch.randn(pages, BLOCK, DIM, generator=gen).to(torch.bfloat16)
    # Distinct shuffled pages per row; the spare column points at a valid page too.
    block_table = torch.randperm(pages, generator=gen)[: rows * max_blocks]
    block_table = block_table.view(rows, max_blocks).to(torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return q.to(device), cache.to(device), block_table.to(device), sl.to(device)


def check_cases(device: str) -> None:
    from cpindex.bench.triton_baseline import triton_block_scores

    gen = torch.Generator().manual_seed(0)
    sm_scale = DIM**-0.5
    for heads, seq_lens, init_b, local_b, width, t in CASES:
        q, cache, bt, sl = _make_case(heads, seq_lens, width, device, gen, t)
        got = triton_block_scores(
            q, cache, bt, sl, init_blocks=init_b, local_blocks=local_b, width=width,
            sm_scale=sm_scale, query_len=t,
        )  # fmt: skip
        want = oracle(q, cache, bt, sl, init_b, local_b, width, sm_scale, t)
        assert got.shape == (heads, len(seq_lens) * t, width) and got.dtype == torch.float32
        torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)

        # out= is written in place and returned.
        out = torch.full((heads, len(seq_lens) * t, width), 7.0, device=device)
        ret = triton_block_scores(
            q, cache, bt, sl, init_blocks=init_b, local_blocks=local_b, width=width,
            sm_scale=sm_scale, out=out, query_len=t,
        )  # fmt: skip
        assert ret is out
        torch.testing.assert_close(out.cpu(), want, rtol=1e-3, atol=1e-3)

    for heads, seq_lens, init_b, local_b, width, t, world, rank in SHARE_CASES:
        q, cache, bt, sl = _make_case(heads, seq_lens, width, device, gen, t)
        got = triton_block_scores(
            q, cache, bt, sl, init_blocks=init_b, local_blocks=local_b, width=width,
            sm_scale=sm_scale, query_len=t, world=world, rank=rank,
        )  # fmt: skip
        want = oracle(q, cache, bt, sl, init_b, local_b, width, sm_scale, t)[:, :, rank::world]
        assert got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_triton_baseline_gpu():
    check_cases("cuda")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_baseline_interpreter():
    if importlib.util.find_spec("triton.runtime.interpreter") is None:
        pytest.skip("this triton has no interpreter mode")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('_tb', {str(Path(__file__))!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "mod.check_cases('cpu')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"


def test_import_without_triton_is_guarded():
    from cpindex.bench import triton_baseline

    if triton_baseline.triton is None:
        with pytest.raises(RuntimeError, match="triton is not installed"):
            triton_baseline.triton_block_scores(
                None, None, None, None, init_blocks=0, local_blocks=1, width=1, sm_scale=1.0
            )
