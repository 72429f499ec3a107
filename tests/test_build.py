"""The library builds only what ships (Hopper gets its warpgroup-mma build, nothing else is
switched), and the digest that names the kernel sources in results is the one device.sh
prints."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import cpindex.kernels
from cpindex.kernels import build
from cpindex.kernels.build import build_defines, sources_digest


def test_hopper_builds_the_warpgroup_mma(monkeypatch):
    assert build_defines("sm_90") == ["CP_WGMMA=1"]
    assert build_defines("sm_90", portable=True) == []
    assert build_defines("sm_80") == build_defines("gfx950") == []
    # the library builds only what ships: the environment adds nothing
    monkeypatch.setenv("CPINDEX_KERNEL_DEFINES", "CP_WGMMA=0 CP_GROUP_MAX=1")
    assert build_defines("sm_90") == ["CP_WGMMA=1"]


def test_shipped_sources_have_no_measurement_switches():
    # the only #ifndef CP_ switch left is CP_WGMMA, which the build sets for sm_90a
    here = Path(cpindex.kernels.__file__).parent
    text = "".join(f.read_text() for f in sorted(here.glob("*.h")) + sorted(here.glob("*.hip")))
    switches = re.findall(r"^#ifndef (CP_\w+)", text, flags=re.M)
    assert switches == ["CP_WGMMA"]
    assert "printf" not in text and "CPINDEX_KERNEL_DEFINES" not in text


def test_sources_digest_is_the_shell_one():
    # = cat cpindex/kernels/*.hip cpindex/kernels/*.h | sha256sum | cut -c1-12
    here = Path(cpindex.kernels.__file__).parent
    files = sorted(here.glob("*.hip")) + sorted(here.glob("*.h"))
    assert files[0].name == "score.hip" and {"compat.h", "config.h", "launch.h"} <= {
        f.name for f in files
    }
    want = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    assert sources_digest() == want


def test_the_wrapper_source_is_written_once(tmp_path):
    """The .cu wrapper keeps its mtime when it already holds the text: a rewrite on every load
    makes the builder recompile the kernel in every process."""
    path = tmp_path / "score.cu"
    build._write_once(path, "a\n")
    os.utime(path, (1, 1))
    build._write_once(path, "a\n")
    assert path.stat().st_mtime == 1 and path.read_text() == "a\n"
    build._write_once(path, "b\n")
    assert path.read_text() == "b\n" and path.stat().st_mtime > 1
    assert [p.name for p in tmp_path.iterdir()] == ["score.cu"]
