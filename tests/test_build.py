"""The kernel build's switches are checked before anything is compiled (and Hopper gets its
warpgroup-mma build), and the digest that names the kernel sources in results is the one
device.sh prints."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import cpindex.kernels
from cpindex.kernels.build import build_defines, measurement_defines, sources_digest


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


def test_hopper_builds_the_warpgroup_mma_unless_told_not_to(monkeypatch):
    monkeypatch.delenv("CPINDEX_KERNEL_DEFINES", raising=False)
    assert build_defines("sm_90") == ["CP_WGMMA=1"]
    assert build_defines("sm_90", portable=True) == []
    assert build_defines("sm_80") == build_defines("gfx950") == []
    monkeypatch.setenv("CPINDEX_KERNEL_DEFINES", "CP_WGMMA=0 CP_GROUP_MAX=1")
    assert build_defines("sm_90") == ["CP_WGMMA=0", "CP_GROUP_MAX=1"]
    monkeypatch.setenv("CPINDEX_KERNEL_DEFINES", "CP_GROUP_MAX=1")
    assert build_defines("sm_90") == ["CP_WGMMA=1", "CP_GROUP_MAX=1"]


def test_sources_digest_is_the_shell_one():
    # = cat cpindex/kernels/*.hip cpindex/kernels/*.h | sha256sum | cut -c1-12
    here = Path(cpindex.kernels.__file__).parent
    files = sorted(here.glob("*.hip")) + sorted(here.glob("*.h"))
    assert files[0].name == "score.hip" and {"compat.h", "config.h", "launch.h"} <= {
        f.name for f in files
    }
    want = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    assert sources_digest() == want
