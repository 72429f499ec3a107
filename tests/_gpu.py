"""Helpers shared by the GPU tests (skipped cleanly on machines without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cpindex import partition, reference, testing

HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm GPU")
FORMATS = ["bf16", "fp8", "nvfp4"]
#: Where a test runs on the CPU and, marked ``gpu`` (skipped without one), on GPU 0.
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu, id="cuda")]


def force_warpgroup_mma(monkeypatch) -> None:
    """Run the warpgroup-mma instance (sm_90a builds, T * H of 17..32) at any batch size: the
    launcher otherwise picks it for large batches only. Skips where the build has none."""
    from cpindex.kernels import device_arch, variants

    if not variants.build_of(device_arch(torch.device("cuda", 0))).wgmma:
        pytest.skip("no warpgroup-mma instance in this build (sm_90a only)")
    monkeypatch.setattr(variants, "WGMMA_MIN_ITEMS_PER_SM", 0)
    monkeypatch.setattr(variants, "WGMMA_RING_GPUS", ("",))  # bf16 and fp8 on any GPU too


def in_child(code: str, timeout_s: float = 300) -> str:
    """Run ``code`` in a child Python process (this directory importable) and return its
    output: a crash there fails the calling test instead of ending the whole run."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout_s, env=env)  # fmt: skip
    assert r.returncode == 0, f"the child process ended with {r.returncode}:\n{r.stderr[-3000:]}"
    return r.stdout


def needs_gpus(n: int):
    count = torch.cuda.device_count() if HAS_GPU else 0
    return pytest.mark.skipif(count < n, reason=f"needs {n} GPUs, found {count}")


def expected(prob: testing.Problem, init: int, local: int, sm_scale: float = 128**-0.5):
    """All heads' reference scores ``[H, rows, width]`` on the problem's device."""
    return reference.block_scores(
        prob.q, prob.index_cache, prob.block_table, prob.seq_lens,
        init_blocks=init, local_blocks=local, width=prob.width, sm_scale=sm_scale,
        query_len=prob.query_len,
    )  # fmt: skip


def for_rank(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return full[partition.heads_of_rank(rank, full.shape[0], world)]


def assert_scores(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """Equal forcing/-inf pattern; scanned scores within ``rel`` of each row's largest |score|.

    Every product the kernel forms is exact (bf16 x bf16, and fp8/fp4 values widened exactly to
    f16), so the only error is fp32 summation order against the float64 reference.
    """
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not torch.isnan(got).any(), "NaN in output (unwritten poisoned element?)"
    forced = ~torch.isfinite(want) | (want.abs() >= 1e29)
    assert torch.equal(got[forced], want[forced]), "forced / -inf columns differ"
    scanned = torch.where(forced, torch.zeros_like(want), want)
    row_max = scanned.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    err = ((got - want).abs() / row_max)[~forced]
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= rel, f"max relative error {worst:.3e} > {rel:.1e}"


def settle(comm) -> None:
    """Nothing of this rank in flight, and every rank here: in the one-process world, safe to
    allocate, copy and check (docs/design.md)."""
    torch.cuda.current_stream().synchronize()  # releases the GIL
    comm.barrier()


def kernel_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` through an elementwise kernel. ``copy_``/``clone`` of contiguous tensors
    on one device are a device-to-device memcpy, which CUDA lists among the implicitly
    synchronizing operations: between two pushes of the one-process world that deadlocks
    (docs/design.md, rule 2)."""
    if dst.dtype.is_floating_point and dst.element_size() >= 2:
        torch.mul(src, 1, out=dst)  # exact; keeps -0 and inf
    else:
        torch.bitwise_or(src.view(torch.uint8), 0, out=dst.view(torch.uint8))


def unambiguous(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(head, row)s whose k-th and (k+1)-th best scores differ by more than fp32 summation
    noise: there the kernel's selection must equal the float64 reference's."""
    s = scores.double().nan_to_num(neginf=-1e300)
    if s.shape[-1] <= k:
        return torch.ones(s.shape[:-1], dtype=torch.bool)
    top = s.topk(k + 1, dim=-1).values
    scale = scores.double().abs().nan_to_num(posinf=0, neginf=0).clamp(max=1e3).amax(-1)
    return (top[..., k - 1] - top[..., k]).abs() > 1e-4 * scale.clamp(min=1)
