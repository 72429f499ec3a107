"""formats.write_keys on the GPU (the fused writer kernel) against the CPU writer, bit for bit.

The CPU writer is checked element by element against a pure-Python one (test_write_keys.py);
here every format, form and key dtype must give the same bytes on the device, every byte of the
buffers included (skipped slots, pool bytes). Also: a slot past the cache reported through the
error word (``check_writes``), and a write captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import needs_gpu
from _write_cases import KEY_DTYPES, KINDS, make_keys, make_slots, make_target

from cpindex import formats
from cpindex.errors import BadSlotError

pytestmark = [needs_gpu, pytest.mark.gpu]

DEV = "cuda"


@pytest.fixture(autouse=True, scope="module")
def _writer_kernel():
    from cpindex.kernels import load

    if not hasattr(load(torch.device(DEV, torch.cuda.current_device())), "write_keys"):
        pytest.skip("the kernel module has no write_keys binding")


def _same_on_both(kind: str, pages: int, keys: torch.Tensor, slots: torch.Tensor, seed: int):
    """Write on the CPU and on the GPU into identical poisoned caches; both targets."""
    cpu = make_target(kind, pages, "cpu", seed)
    gpu = make_target(kind, pages, DEV, seed)
    formats.write_keys(cpu.cache, keys, slots)
    formats.write_keys(gpu.cache, keys.to(DEV), slots.to(DEV))
    torch.cuda.synchronize()
    return cpu, gpu


def _assert_same(cpu, gpu) -> None:
    for a, b in zip(cpu.snapshot(), gpu.snapshot(), strict=True):
        diff = (a != b).nonzero().flatten()
        assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:8].tolist()}"


@pytest.mark.parametrize("dtype", KEY_DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_equals_cpu(kind: str, dtype: torch.dtype) -> None:
    pages = 40
    keys = make_keys(3000, dtype, seed=KINDS.index(kind))
    slots = make_slots(3000, pages * 128, seed=3)
    for slot_dtype in (torch.int64, torch.int32):
        cpu, gpu = _same_on_both(kind, pages, keys, slots.to(slot_dtype), seed=4)
        _assert_same(cpu, gpu)
    formats.check_writes(DEV)


@pytest.mark.parametrize("kind", ["bf16", "fp8-pool", "nvfp4-pool", "nvfp4-interleaved"])
def test_gpu_strided_keys_and_slots(kind: str) -> None:
    """Keys with a row stride and a strided int32 slot_mapping, as a stack may hand them."""
    keys = torch.zeros(500, 2, 128)
    keys[:, 1] = make_keys(500, torch.float32, seed=5)
    slots = torch.stack([make_slots(500, 8 * 128, seed=6), torch.zeros(500, dtype=torch.int64)])
    slots = slots.T.to(torch.int32)
    cpu = make_target(kind, 8, "cpu", seed=7)
    gpu = make_target(kind, 8, DEV, seed=7)
    formats.write_keys(cpu.cache, keys[:, 1], slots[:, 0])
    formats.write_keys(gpu.cache, keys.to(DEV)[:, 1], slots.to(DEV)[:, 0])
    torch.cuda.synchronize()
    _assert_same(cpu, gpu)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "nvfp4", "nvfp4-interleaved"])
def test_slot_past_the_cache_is_reported(kind: str) -> None:
    """A slot >= pages * 128 is skipped and reported; the other keys are written."""
    pages, bad_token = 4, 13
    keys = make_keys(50, torch.float32, seed=8)
    slots = make_slots(50, pages * 128, seed=9)
    past = slots.clone()
    past[bad_token] = pages * 128 + 5
    cpu = make_target(kind, pages, "cpu", seed=10)
    gpu = make_target(kind, pages, DEV, seed=10)
    skipped = past.clone()
    skipped[bad_token] = -1
    formats.write_keys(cpu.cache, keys, skipped)
    formats.write_keys(gpu.cache, keys.to(DEV), past.to(DEV))  # no error at launch
    torch.cuda.synchronize()
    _assert_same(cpu, gpu)
    with pytest.raises(
        BadSlotError, match=rf"token {bad_token} has slot_mapping {pages * 128 + 5}"
    ):
        formats.check_writes(DEV)
    formats.check_writes(DEV)  # reported once; the word is clear again
    formats.write_keys(gpu.cache, keys.to(DEV), slots.to(DEV))
    torch.cuda.synchronize()
    formats.check_writes(torch.device(DEV, torch.cuda.current_device()))


def test_bad_input_refused_on_the_host() -> None:
    """Shape, dtype and device errors raise before anything is launched."""
    target = make_target("nvfp4", 2, DEV, seed=11)
    before = target.snapshot()
    keys = make_keys(4, torch.float32).to(DEV)
    slots = torch.tensor([0, 1, 2, 3], device=DEV)
    with pytest.raises(ValueError, match=r"keys: expected a tensor on the cache's device"):
        formats.write_keys(target.cache, keys.cpu(), slots)
    with pytest.raises(ValueError, match=r"slot_mapping: expected a tensor on the cache's device"):
        formats.write_keys(target.cache, keys, slots.cpu())
    with pytest.raises(TypeError, match=r"slot_mapping: expected a torch\.int32 or torch\.int64"):
        formats.write_keys(target.cache, keys, slots.float())
    with pytest.raises(ValueError, match=r"keys: expected shape \[tokens, 128\]"):
        formats.write_keys(target.cache, keys[:, :64], slots)
    torch.cuda.synchronize()
    for a, b in zip(before, target.snapshot(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["fp8", "nvfp4-page_major_3d", "nvfp4-interleaved"])
def test_graph_capture_and_replay(kind: str) -> None:
    """A write captured in a CUDA graph (the first write on the device, made eagerly, sets up
    its error word) writes the static inputs' current contents at every replay."""
    pages = 16
    target = make_target(kind, pages, DEV, seed=12)
    static_keys = make_keys(300, torch.bfloat16, seed=13).to(DEV)
    static_slots = make_slots(300, pages * 128, seed=14).to(DEV).to(torch.int32)
    formats.write_keys(target.cache, static_keys, static_slots)  # warm-up, outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        formats.write_keys(target.cache, static_keys, static_slots)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(3):
        keys = make_keys(300, torch.bfloat16, seed=20 + step)
        slots = make_slots(300, pages * 128, seed=30 + step).to(torch.int32)
        cpu = make_target(kind, pages, "cpu", seed=12)
        for i, buf in enumerate(target.snapshot()):  # the CPU copy starts where the GPU is
            cpu.buffers[i].copy_(buf)
        formats.write_keys(cpu.cache, keys, slots)
        static_keys.copy_(keys)
        static_slots.copy_(slots)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(cpu, target)
    formats.check_writes(DEV)
