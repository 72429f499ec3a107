"""The AMD matrix-core (MFMA) scoring path against the reference, on the CPU.

tests/amd/harness.cpp runs the kernel's own fragment code (cpindex/kernels/mfma.h: which lane
loads which key and query bytes, the operand packing with gfx942's FNUZ fix-up and nvfp4's
decode, the result layout, causal masks, the maxima over registers and lanes) for one wave of
64 lanes, through host models of the two MFMA instructions and of ds_bpermute (checked against
AMD's layout tables in test_mfma_model.py). This file drives it the way score.hip drives
score_page: per (request, block) item that some row reads, per pass of 8 * NT query vectors,
over the whole page or (split pages) four one-tile parts, then the contract's forcing as
write_score applies it, and compares every (head, row, block) with cpindex.reference.

Not emulated (plain code shared with the CUDA and portable paths, which the GPU suite runs, or
hardware behaviour a CPU cannot show): the global and LDS loads themselves (the harness reads
the same byte offsets from host memory), the work split over waves and CTAs, the stash and
write_score (mirrored here in Python), the push handshake, tags, agreement and fused
selection, and instruction scheduling, timing and register allocation.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from _gpu import assert_scores, expected

from cpindex import formats, testing
from cpindex.kernels import structs, variants
from cpindex.kernels.launcher import nvfp4_lut

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "amd" / "harness.cpp"
KERNELS = ROOT / "cpindex" / "kernels"
FORMAT_IDS = {"bf16": structs.FORMAT_IDS["bf16"], "fp8": structs.FORMAT_IDS["fp8"]}
ARCHS = {"gfx950": 0, "gfx942": 1}  # the fnuz flag: CDNA3's fp8 operands are FNUZ
SM_SCALE = 128**-0.5


@functools.cache
def build_harness(directory: Path) -> ctypes.CDLL:
    """Compiles tests/amd/harness.cpp with the kernel headers into a shared library (once per
    test session: test_mfma_model.py shares it)."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not installed: the MFMA emulator needs a host C++ compiler")
    out = directory / "mfma_harness.so"
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Wno-unknown-pragmas"]
    subprocess.run([*cmd, f"-I{KERNELS}", str(HARNESS), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.cp_emulate_page.restype = ctypes.c_int
    lib.cp_emulate_page.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_int,  # fmt, fnuz, nt
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,  # keys, scales
        ctypes.c_void_p,  # lut8
        ctypes.c_void_p, ctypes.c_int64,  # queries
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # count, heads, T, v0
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # limit, full, t_first, tiles
        ctypes.c_float, ctypes.c_void_p,
    ]  # fmt: skip
    lib.cp_fnuz_from_fn.restype = ctypes.c_uint32
    lib.cp_fnuz_from_fn.argtypes = [ctypes.c_uint32]
    lib.cp_e4m3.restype = ctypes.c_float
    lib.cp_e4m3.argtypes = [ctypes.c_uint32, ctypes.c_int]
    lib.cp_mfma_model.restype = None
    lib.cp_mfma_model.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
    lib.cp_mfma_layout.restype = None
    lib.cp_mfma_layout.argtypes = [ctypes.c_int] * 4 + [ctypes.POINTER(ctypes.c_int)] * 2
    return lib


@pytest.fixture(scope="session")
def harness(tmp_path_factory) -> ctypes.CDLL:
    return build_harness(tmp_path_factory.getbasetemp())


@functools.cache
def lut8() -> torch.Tensor:
    """The nvfp4 e4m3 table the kernel keeps in shared memory (launcher.nvfp4_lut's tail)."""
    return nvfp4_lut()[4096:].contiguous()


def emulate(
    lib: ctypes.CDLL,
    prob: testing.Problem,
    init: int,
    local: int,
    arch: str,
    *,
    split: bool = False,
) -> torch.Tensor:
    """[H, rows, width] scores as the MFMA kernel computes them (rank 0 of world 1)."""
    t, heads = prob.query_len, prob.q.shape[1]
    vectors = t * heads
    nt = variants.query_tiles(variants.build_of(arch), vectors)  # the launcher's instance
    q = prob.q.contiguous()
    elem = q.element_size()
    if prob.fmt == "nvfp4":
        kv, ks = formats.nvfp4_views(prob.index_cache)
        fid = variants.cache_format("nvfp4", kv.stride(1))
        kv_page, kv_tok, ks_page, ks_tok = kv.stride(0), kv.stride(1), ks.stride(0), ks.stride(1)
        kv_ptr, ks_ptr = kv.data_ptr(), ks.data_ptr()
    else:
        cache = prob.index_cache
        fid = FORMAT_IDS[prob.fmt]
        kv_page, kv_tok = cache.stride(0) * elem, cache.stride(1) * elem
        kv_ptr, ks_ptr, ks_page, ks_tok = cache.data_ptr(), 0, 0, 0
    rows, width = q.shape[0], prob.width
    out = torch.empty(heads, rows, width)
    val = torch.empty(8 * nt)
    part = torch.empty(8 * nt)
    for r in range(prob.requests):
        length = int(prob.seq_lens[r])
        n = -(-length // formats.PAGE_TOKENS)
        q_base = q[r * t].data_ptr()
        for j in range(width):
            read = init <= j < n - local
            scores = torch.zeros(vectors)
            if read:
                page = int(prob.block_table[r, j])
                limit = length - j * formats.PAGE_TOKENS
                full = int(limit - (t - 1) >= formats.PAGE_TOKENS)
                for v0 in range(0, vectors, 8 * nt):
                    args = [fid, ARCHS[arch], nt, kv_ptr + page * kv_page, kv_tok]
                    args += [ks_ptr + page * ks_page if ks_ptr else None, ks_tok, lut8().data_ptr()]
                    args += [q_base, formats.HEAD_DIM * elem, vectors, heads, t, v0, limit, full]
                    if split:  # a split page: four one-tile parts, their maxima combined
                        val.fill_(float("-inf"))
                        for t_first in range(4):
                            rc = lib.cp_emulate_page(*args, t_first, 1, SM_SCALE, part.data_ptr())
                            assert rc == 0
                            torch.maximum(val, part, out=val)
                    else:
                        assert lib.cp_emulate_page(*args, 0, 4, SM_SCALE, val.data_ptr()) == 0
                    m = min(8 * nt, vectors - v0)
                    scores[v0 : v0 + m] = val[:m]
            for v in range(vectors):  # write_score's forcing per row
                tok, h = divmod(v, heads)
                len_row = length - (t - 1 - tok)
                n_row = -(-len_row // formats.PAGE_TOKENS) if len_row > 0 else 0
                if j >= n_row:
                    x = float("-inf")
                elif j >= n_row - local:
                    x = 1e29
                elif j < init:
                    x = 1e30
                else:
                    x = float(scores[v])
                out[h, r * t + tok, j] = x
    return out


def poison_zeros(prob: testing.Problem, seed: int) -> None:
    """Writes e4m3 -0 (0x80) bytes into every fp8 key and query of some dims, and e2m1 -0
    codes into nvfp4 keys: -0 is NaN to gfx942's FNUZ operands unless the kernel fixes it."""
    g = torch.Generator().manual_seed(seed)
    dims = torch.randperm(formats.HEAD_DIM, generator=g)[:5]
    if prob.fmt == "fp8":
        prob.index_cache.view(torch.uint8)[:, :, dims] = 0x80
    if prob.fmt in ("fp8", "nvfp4"):
        prob.q.view(torch.uint8)[:, :, dims[:3]] = 0x80
    if prob.fmt == "nvfp4":
        kv, _ = formats.nvfp4_views(prob.index_cache)
        kv[:, :, dims[:3] // 2] = (kv[:, :, dims[:3] // 2] & 0xF0) | 0x08


FORMATS = ["bf16", "fp8", "nvfp4", "nvfp4-interleaved"]
# requests, T, heads, max_len, init, local: T = 1, 4, 8 with the seed's 4 heads (1, 2 and 4
# query tiles), 16 heads at T = 8 (4 passes of 32 vectors), T * H = 6 (a part-filled tile);
# ragged lengths, partial last blocks, forced blocks
CASES = [
    (3, 1, 4, 700, 0, 1),
    (3, 4, 4, 900, 1, 1),
    (2, 8, 4, 1000, 0, 2),
    (2, 8, 16, 300, 0, 0),
    (3, 3, 2, 520, 2, 1),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c[0]}-T{c[1]}-H{c[2]}-len{c[3]}")
def test_mfma_wave_matches_reference(harness, fmt, case):
    """Both archs (gfx950's OCP fp8 operands, gfx942's FNUZ ones) against one reference."""
    requests, t, heads, max_len, init, local = case
    seed = hash((fmt, case)) % 1000
    prob = testing.make_problem(requests, max_len, fmt, query_len=t, num_heads=heads, seed=seed)
    poison_zeros(prob, seed)
    want = expected(prob, init, local, SM_SCALE)
    for arch in ARCHS:
        assert_scores(emulate(harness, prob, init, local, arch), want)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_mfma_split_pages_match_reference(harness, fmt):
    """Split pages: four waves score a one-tile part each (the kernel's kSplitTiles)."""
    prob = testing.make_problem(3, 600, fmt, query_len=4, num_heads=4, seed=7)
    want = expected(prob, 0, 1, SM_SCALE)
    for arch in ARCHS:
        assert_scores(emulate(harness, prob, 0, 1, arch, split=True), want)


def test_fnuz_fixup_is_exact(harness):
    """Every finite e4m3fn byte, after gfx942's fix-up, read as FNUZ is half its value (and
    -0 becomes +0, never FNUZ's NaN); the model's decoders agree with torch's."""
    fn = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    fnuz = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fnuz).float()
    for b in range(256):
        for flag, table in ((0, fn), (1, fnuz)):
            got, ref = harness.cp_e4m3(b, flag), float(table[b])
            assert got == ref or (got != got and ref != ref), (b, flag)
        if b & 0x7F == 0x7F:  # e4m3fn's NaN: never in a cache or a query
            continue
        word = b | (b << 8) | (b << 16) | (b << 24)
        fixed = harness.cp_fnuz_from_fn(word)
        assert all((fixed >> (8 * i)) & 0xFF == fixed & 0xFF for i in range(4))
        assert harness.cp_e4m3(fixed & 0xFF, 1) * 2 == float(fn[b]), hex(b)
