"""benchmarks/amd_report.py on a small hand-written gfx950 assembly file (no compiler): the
instance named from its symbol, the metadata's resources, the waves-per-SIMD rule, the page loop
and its counts, and the roofline arithmetic."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("amd_report", ROOT / "benchmarks" / "amd_report.py")
amd_report = importlib.util.module_from_spec(_spec)
sys.modules["amd_report"] = amd_report  # dataclasses look their module up
_spec.loader.exec_module(amd_report)

needs_demangler = pytest.mark.skipif(
    not any(shutil.which(t) for t in ("llvm-cxxfilt-19", "llvm-cxxfilt", "c++filt")),
    reason="needs llvm-cxxfilt or c++filt",
)

# fp8 (F = 1), two query tiles, whole pages
SYM = "_ZN7cpindex12_GLOBAL__N_112score_kernelILi1ELi2ELb0ELi0EEEvNS_11ScoreParamsENS_9PushStateE"
OTHER = "_ZN7cpindex12_GLOBAL__N_112merge_kernelENS_11ScoreParamsE"

ASM = f"""\t.text
\t.globl\t{SYM}
\t.type\t{SYM},@function
{SYM}: ; @{SYM}
\ts_load_dwordx4 s[4:7], s[0:1], 0x0
\tv_mov_b32_e32 v1, 0
.LBB0_1: ; the item loop
\ts_add_i32 s8, s8, 1
.LBB0_2: ; the page loop
\tglobal_load_dwordx4 v[2:5], v1, s[4:5]
\tglobal_load_dwordx4 v[6:9], v1, s[4:5] offset:1024
\tflat_load_dwordx4 v[40:43], v[60:61] nt
\tflat_load_dwordx2 v[44:45], v[60:61] ; a twin: the same bytes again
\tv_lshl_add_u64 v[60:61], v[60:61], 0, 64
\tflat_load_dwordx4 v[48:51], v[60:61] ; a new address in the same registers
\ts_waitcnt vmcnt(0)
\tds_read_b128 v[10:13], v1
\tv_mfma_f32_16x16x128_f8f6f4 v[20:23], v[2:9], v[10:17], v[20:23]
\tv_mfma_f32_16x16x128_f8f6f4 v[24:27], v[2:9], v[10:17], v[24:27]
\tv_max_f32_e32 v30, v30, v20
\tv_exp_f32_e32 v31, v30
\tv_accvgpr_read_b32 v32, a0
\ts_add_u32 s4, s4, 0x800
\ts_cmp_lg_u32 s4, s9
\ts_cbranch_scc1 .LBB0_2
; %bb.3:
\ts_cmp_lg_u32 s8, s10
\ts_cbranch_scc1 .LBB0_1
\ts_endpgm
.Lfunc_end0:
\t.size\t{SYM}, .Lfunc_end0-{SYM}
; Occupancy: 2
\t.globl\t{OTHER}
\t.type\t{OTHER},@function
{OTHER}:
\tv_mfma_f32_16x16x128_f8f6f4 v[20:23], v[2:9], v[10:17], v[20:23]
\ts_endpgm
.Lfunc_end1:
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .agpr_count:     8
    .group_segment_fixed_size: 4096
    .max_flat_workgroup_size: 256
    .name:           {SYM}
    .private_segment_fixed_size: 0
    .sgpr_count:     40
    .sgpr_spill_count: 0
    .symbol:         {SYM}.kd
    .vgpr_count:     200
    .vgpr_spill_count: 0
  - .agpr_count:     0
    .name:           {OTHER}
    .vgpr_count:     24
amdhsa.version:
  - 1
  - 2
...

\t.end_amdgpu_metadata
"""

SOURCE = "template <int F, int NT, bool W, int S>\n__global__ void CP_BOUNDS score_kernel(int);\n"


@pytest.fixture
def asm_dir(tmp_path):
    (tmp_path / "score.gfx950.s").write_text(ASM)
    (tmp_path / "score.hip").write_text(SOURCE)
    return tmp_path


def test_classify_and_load_bytes():
    c = amd_report.classify
    assert c("v_mfma_f32_32x32x16_fp8_fp8") == "mfma"
    assert c("v_pk_fma_f32") == c("v_accvgpr_read_b32") == "valu"
    assert c("global_load_dwordx4") == c("buffer_load_dword") == "vmem"
    assert c("scratch_load_dwordx2") == "scratch"
    assert c("ds_bpermute_b32") == "lds"
    assert c("s_add_u32") == "salu"
    assert c("s_waitcnt") == c("s_cbranch_scc1") == "other"
    assert c("s_load_dwordx2") == "smem"
    assert amd_report.load_bytes("global_load_dwordx4") == 16
    assert amd_report.load_bytes("buffer_load_ubyte") == 1
    assert amd_report.load_bytes("global_load_lds_dwordx4") == 16
    assert amd_report.load_bytes("global_store_dwordx4") == 0


@pytest.mark.parametrize(
    ("vgprs", "waves"), [(24, 8), (64, 8), (65, 7), (128, 4), (200, 2), (256, 2), (257, 1)]
)
def test_waves_per_simd(vgprs, waves):
    k = amd_report.Kernel("gfx950", "x", "score_kernel", {}, {".vgpr_count": vgprs})
    assert k.waves_vgpr == waves


@needs_demangler
def test_instance_resources_and_page_loop(asm_dir):
    pattern = amd_report.re.compile(r"^score\w*kernel")
    kernels = amd_report.read_asm(
        asm_dir / "score.gfx950.s", "gfx950", pattern, asm_dir / "score.hip"
    )
    assert len(kernels) == 1  # merge_kernel is no scoring kernel
    (k,) = kernels
    assert k.params == {"F": "1", "NT": "2", "W": "0", "S": "0"}
    assert k.fmt == "fp8" and k.vgprs == 200 and k.occupancy_note == "2"
    gpu = amd_report.GPUS[0]
    assert k.waves(gpu) == 2  # 160 KiB of LDS hold 40 work-groups: registers limit it
    loop = k.loop
    assert loop is not None and len(loop.ops) == 16  # .LBB0_2 up to its branch, not the item loop
    assert (loop.count("mfma"), loop.count("valu"), loop.count("vmem")) == (2, 4, 5)
    assert (loop.count("lds"), loop.count("salu")) == (1, 2)
    assert loop.key_bytes == 4 * 16 * 64  # the twin adds nothing
    assert loop.valu_cycles() == 4 + 16 + 4 + 4  # v_exp is a transcendental
    assert loop.mfma_cycles(amd_report.mfma_cycles("gfx950")) == 2 * 32


@needs_demangler
def test_roofline_arithmetic(asm_dir):
    pattern = amd_report.re.compile(r"^score\w*kernel")
    kernels = amd_report.read_asm(
        asm_dir / "score.gfx950.s", "gfx950", pattern, asm_dir / "score.hip"
    )
    gpu = amd_report.GPUS[0]
    rows = {r.t: r for r in amd_report.roofline(kernels, gpu, per_tile=8)}
    assert set(rows) == {1, 4, 8}
    # fp8 page: 16 KiB / 4 KiB of key loads an iteration = 4 iterations
    assert all(r.iters == 4 for r in rows.values())
    # T = 1 and 4 fit two tiles of 8 vectors; T = 8 (32 vectors) takes two passes
    assert [rows[t].passes for t in (1, 4, 8)] == [1, 1, 2]
    r = rows[8]
    assert r.mfma == pytest.approx(4 * 2 * 64 / 4)
    assert r.valu == pytest.approx(4 * 2 * 28 / 4)
    assert r.hbm == pytest.approx(16384 / (8e12 / 256 / 2.4e9))
    assert r.ratio == pytest.approx(r.mfma / r.hbm)
    text = amd_report.report(asm_dir, asm_dir / "score.hip", pattern, 8)
    assert "| fp8 | 8 |" in text and "gfx950 (MI355X): 1 scoring kernel" in text
    short = amd_report.report(asm_dir, asm_dir / "score.hip", pattern, 8, summary=True)
    assert f"| fp8 | 8 | 200, 2 | 0 | {r.ratio:.2f} |" in short
