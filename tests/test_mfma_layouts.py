"""The MFMA layout tables (tests/data/mfma_layouts.json) are whole: per instruction, every element
of A (M x K), B (K x N) and D (M x N) sits in exactly one (lane, item) of the wave's 64 lanes, and
every lane holds the same number of items. The tables are the ground truth the CPU emulation of
the matrix instructions is checked against, so a hole or a duplicate here would hide a bug there.
Where they come from is in the file's "source" field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data" / "mfma_layouts.json"
LAYOUTS = json.loads(DATA.read_text())
CASES = [(arch, inst) for arch in LAYOUTS if arch != "source" for inst in LAYOUTS[arch]]

# What the MFMA path may use on each target: each must be in the tables.
EXPECTED = {
    "gfx942": {
        "v_mfma_f32_16x16x32_fp8_fp8",
        "v_mfma_f32_32x32x16_fp8_fp8",
        "v_mfma_f32_16x16x16_bf16",
        "v_mfma_f32_32x32x8_bf16",
    },
    "gfx950": {
        "v_mfma_f32_16x16x32_fp8_fp8",
        "v_mfma_f32_32x32x16_fp8_fp8",
        "v_mfma_f32_16x16x16_bf16",
        "v_mfma_f32_32x32x8_bf16",
        "v_mfma_f32_16x16x32_bf16",
        "v_mfma_f32_32x32x16_bf16",
        "v_mfma_f32_16x16x128_f8f6f4",
        "v_mfma_f32_32x32x64_f8f6f4",
    },
}


def test_source_and_instruction_sets():
    assert "amd_matrix_instruction_calculator" in LAYOUTS["source"]
    for arch, names in EXPECTED.items():
        assert names <= set(LAYOUTS[arch]), arch


@pytest.mark.parametrize(("arch", "inst"), CASES)
def test_layout_is_a_bijection(arch, inst):
    e = LAYOUTS[arch][inst]
    m, n, k = e["M"], e["N"], e["K"]
    assert e["blocks"] == 1 and e["cycles"] > 0
    # the instruction's shape is in its name: ..._MxNxK...
    assert f"_{m}x{n}x{k}" in inst
    for mat, rows, cols in (("A", m, k), ("B", k, n), ("D", m, n)):
        lanes = e[mat]
        assert len(lanes) == 64, (mat, len(lanes))
        per_lane = {len(items) for items in lanes}
        assert per_lane == {rows * cols // 64}, (mat, per_lane)
        seen = [tuple(item) for items in lanes for item in items]
        assert len(seen) == len(set(seen)), f"{mat}: an element sits in two places"
        assert set(seen) == {(r, c) for r in range(rows) for c in range(cols)}, mat


@pytest.mark.parametrize(("arch", "inst"), CASES)
def test_lane_owns_one_row_or_column(arch, inst):
    """A lane's A items share a row, its B items a column and its D items a column: the rule the
    kernel's fragment code builds on (lane % M picks a key or query row)."""
    e = LAYOUTS[arch][inst]
    for lane in range(64):
        assert {i for i, _ in e["A"][lane]} == {lane % e["M"]}
        assert {j for _, j in e["B"][lane]} == {lane % e["N"]}
        assert {j for _, j in e["D"][lane]} == {lane % e["N"]}


def test_shared_instructions_agree_across_targets():
    """What CDNA4 kept from CDNA3 has one layout on both."""
    for inst in EXPECTED["gfx942"]:
        assert LAYOUTS["gfx950"][inst] == LAYOUTS["gfx942"][inst], inst
