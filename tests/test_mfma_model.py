"""The host models of the MFMA instructions the AMD path uses (tests/amd/harness.cpp) against
AMD's layout tables (tests/data/mfma_layouts.json: AMD's matrix instruction calculator for
CDNA3, AMD's published layouts for CDNA4): every lane and item of A, B and D, and the product
of random operands placed by the tables alone."""

from __future__ import annotations

import ctypes
import json
import re
from pathlib import Path

import pytest
import torch
from test_amd_emulation import build_harness

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT / "tests" / "data" / "mfma_layouts.json"
# the instructions the kernel issues (mfma.h / dot.h): LLVM builtin -> the tables' name, and
# the fp8 bytes or bf16 elements a lane holds of A and B
USED = {
    "__builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8": ("v_mfma_f32_16x16x32_fp8_fp8", 8),
    "__builtin_amdgcn_mfma_f32_16x16x16bf16_1k": ("v_mfma_f32_16x16x16_bf16", 4),
}
ARCHS = ["gfx942", "gfx950"]


@pytest.fixture(scope="module")
def tables() -> dict:
    if not TABLES.exists():
        pytest.skip(f"{TABLES.relative_to(ROOT)} is missing (AMD's MFMA layout tables)")
    return json.loads(TABLES.read_text())


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> ctypes.CDLL:
    return build_harness(tmp_path_factory.getbasetemp())


def test_the_kernel_issues_only_modelled_instructions():
    text = "".join(p.read_text() for p in (ROOT / "cpindex" / "kernels").glob("*.h"))
    text += (ROOT / "cpindex" / "kernels" / "score.hip").read_text()
    assert set(re.findall(r"__builtin_amdgcn_mfma_\w+", text)) == set(USED)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("builtin", list(USED))
def test_model_layout_is_amds(harness, tables, arch, builtin):
    name, kk = USED[builtin]
    t = tables[arch][name]
    assert (t["M"], t["N"], t["K"]) == (16, 16, 4 * kk)
    i, j = ctypes.c_int(), ctypes.c_int()
    for op, key in enumerate("ABD"):
        for lane in range(64):
            items = t[key][lane]
            assert len(items) == (kk if key != "D" else 4)
            for item, want in enumerate(items):
                harness.cp_mfma_layout(kk, op, lane, item, ctypes.byref(i), ctypes.byref(j))
                assert [i.value, j.value] == want, (arch, name, key, lane, item)


def _matrix(table: list, values: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The matrix a lane/item table places `values` [64, items] into."""
    out = torch.full((rows, cols), float("nan"), dtype=torch.float64)
    for lane, items in enumerate(table):
        for item, (r, c) in enumerate(items):
            out[r, c] = values[lane, item]
    assert not out.isnan().any()
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("builtin", list(USED))
def test_model_computes_the_tables_product(harness, tables, arch, builtin):
    """D = A x B + C with A, B, C placed by AMD's tables and decoded as the arch's operand type
    (fp8: FNUZ on gfx942, OCP e4m3 on gfx950; bf16)."""
    name, kk = USED[builtin]
    t = tables[arch][name]
    fp8, fnuz = kk == 8, arch == "gfx942"
    g = torch.Generator().manual_seed(kk + fnuz)
    if fp8:
        dtype = torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn
        bits, width = torch.uint8, 8
        ops = [(torch.randn(64, 8, generator=g) * 3).to(dtype) for _ in range(2)]
    else:
        bits, width = torch.int16, 16
        ops = [torch.randn(64, 4, generator=g).to(torch.bfloat16) for _ in range(2)]
    # each lane's items packed into one 64-bit register image, item 0 in the low bits
    mask, shift = (1 << width) - 1, width * torch.arange(kk)
    wa, wb = (((x.view(bits).to(torch.int64) & mask) << shift).sum(1) for x in ops)
    c = torch.randn(64, 4, generator=g)
    a = _matrix(t["A"], ops[0].double(), 16, t["K"])
    b = _matrix(t["B"], ops[1].double(), t["K"], 16)
    want = a @ b + _matrix(t["D"], c, 16, 16)
    d = c.clone()
    harness.cp_mfma_model(int(fp8), int(fnuz), wa.data_ptr(), wb.data_ptr(), d.data_ptr())
    got = _matrix(t["D"], d, 16, 16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
