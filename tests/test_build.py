"""The kernel build's measurement switches are checked before anything is compiled."""

from __future__ import annotations

import pytest

from cpindex.kernels.build import measurement_defines


@pytest.mark.parametrize("bad", ["-O0", "CP_X=1;rm", "cp_lower=1", "CP_X=$(id)"])
def test_bad_kernel_defines_are_refused(monkeypatch, bad):
    monkeypatch.setenv("CPINDEX_KERNEL_DEFINES", f"CP_META_PREFETCH=0 {bad}")
    with pytest.raises(ValueError, match=r"CPINDEX_KERNEL_DEFINES: .* is not a kernel switch"):
        measurement_defines()


def test_kernel_defines_parse(monkeypatch):
    monkeypatch.delenv("CPINDEX_KERNEL_DEFINES", raising=False)
    assert measurement_defines() == []
    monkeypatch.setenv("CPINDEX_KERNEL_DEFINES", "CP_META_PREFETCH=0  CP_MEASURE_LOADS_ONLY")
    assert measurement_defines() == ["CP_META_PREFETCH=0", "CP_MEASURE_LOADS_ONLY"]
