"""The library builds only what ships (Hopper gets its warpgroup-mma build, nothing else is
switched) and only what a process uses (a module per cache format, and a base module with no
scoring instance), and the digest that names the kernel sources in results is the one device.sh
prints. All on the CPU: flags, cache keys and the kernel source's own compile of a module's
instances (clang, no GPU)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import cpindex.kernels
from cpindex.kernels import build, variants
from cpindex.kernels.build import build_defines, sources_digest


def test_hopper_builds_the_warpgroup_mma(monkeypatch):
    assert build_defines("sm_90") == ["CP_WGMMA=1"]
    assert build_defines("sm_90", portable=True) == []
    assert build_defines("sm_80") == build_defines("gfx950") == []
    # the library builds only what ships: the environment adds nothing
    monkeypatch.setenv("CPINDEX_KERNEL_DEFINES", "CP_WGMMA=0 CP_GROUP_MAX=1")
    assert build_defines("sm_90") == ["CP_WGMMA=1"]


def test_shipped_sources_have_no_measurement_switches():
    # the only #ifndef CP_ switches: CP_WGMMA, which the build sets for sm_90a, and CP_FORMATS,
    # which names a module's formats
    here = Path(cpindex.kernels.__file__).parent
    text = "".join(f.read_text() for f in sorted(here.glob("*.h")) + sorted(here.glob("*.hip")))
    switches = re.findall(r"^#ifndef (CP_\w+)", text, flags=re.M)
    assert sorted(switches) == ["CP_FORMATS", "CP_WGMMA"]
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


# ------------------------------------------------------------------------- a module per format


_HERE = Path(cpindex.kernels.__file__).parent


def test_each_format_builds_its_own_instances_only():
    """CP_FORMATS holds the CacheFormat bits (launch.h) of the module's cache format: nvfp4 also
    its narrow-token kernel; the base module none. Every other flag is the same for all."""
    enum = re.search(r"enum CacheFormat : int \{([^}]*)\}", (_HERE / "launch.h").read_text())
    ids = {k.strip(): int(v) for k, v in (e.split("=") for e in enum.group(1).split(","))}
    assert {
        None: 0,
        "bf16": 1 << ids["kBF16"],
        "fp8": 1 << ids["kFP8"],
        "nvfp4": 1 << ids["kNVFP4"] | 1 << ids["kNVFP4Narrow"],
    } == build.FORMAT_BITS
    for fmt, bits in build.FORMAT_BITS.items():
        flags = build.build_flags("sm_90", fmt)
        assert flags == ["-O3", "-std=c++17", "-DCP_WGMMA=1", f"-DCP_FORMATS={bits}"]
        assert build.build_flags("gfx942", fmt) == ["-O3", "-std=c++17", f"-DCP_FORMATS={bits}"]
        assert build.build_flags("sm_90", fmt, portable=True) == [
            "-O3", "-std=c++17", "-DCP_PORTABLE=1", f"-DCP_FORMATS={bits}",
        ]  # fmt: skip
    with pytest.raises(ValueError, match="fmt: expected one of"):
        build.build_flags("sm_90", "int4")


def test_the_cache_key_is_arch_format_mode_and_source_hash():
    names = {
        (arch, fmt, portable): build.module_name(arch, fmt, portable=portable)
        for arch in ("sm_90", "sm_100", "gfx942")
        for fmt in build.FORMAT_BITS
        for portable in (False, True)
    }
    assert len(set(names.values())) == len(names)  # every module has a cache entry of its own
    for (arch, fmt, portable), name in names.items():
        digest = build._source_hash(build.build_flags(arch, fmt, portable=portable))
        mode = "portable_" if portable else ""
        assert name == f"cpindex_{arch}_{fmt or 'base'}_{mode}{digest}"
        assert build.module_name(arch, fmt, portable=portable) == name  # stable


def test_the_source_hash_covers_sources_flags_and_torch(monkeypatch, tmp_path):
    flags = build.build_flags("sm_90", "fp8")
    before = build._source_hash(flags)
    assert build._source_hash(build.build_flags("sm_90", "bf16")) != before
    for f in [*_HERE.glob("*.h"), *_HERE.glob("*.hip"), *_HERE.glob("*.cpp")]:
        (tmp_path / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(build, "_HERE", tmp_path)
    assert build._source_hash(flags) == before  # the same sources
    for name in ("score.hip", "launch.h", "binding.cpp"):
        text = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(text + b"\n")
        assert build._source_hash(flags) != before, name
        (tmp_path / name).write_bytes(text)
    monkeypatch.setattr(build.torch, "__version__", "0.0.0")
    assert build._source_hash(flags) != before


_CLANG = shutil.which("clang++-19")
_HIP_INC = os.environ.get("HIP_INC", "/usr/include/hip")


@pytest.mark.skipif(not _CLANG or not Path(_HIP_INC).is_dir(), reason="needs clang-19, HIP headers")
@pytest.mark.parametrize(("fmt", "kernel_ids"), [(None, set()), ("fp8", {1})])
def test_a_module_instantiates_its_formats_only(tmp_path, fmt, kernel_ids):
    """score.hip compiled (gfx942, warnings are errors) with a module's CP_FORMATS holds that
    format's scoring instances and no other, exactly those the launcher chooses among
    (variants.instances); the key writer and the merge are in every module."""
    out = tmp_path / "score.s"
    subprocess.run(
        [_CLANG, "-x", "hip", "--offload-arch=gfx942", "--cuda-device-only", "-nogpulib", "-O1",
         "-Wall", "-Werror", "-S", f"-I{_HIP_INC}", f"-DCP_FORMATS={build.FORMAT_BITS[fmt]}",
         "-o", str(out), str(_HERE / "score.hip")],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    text = out.read_text()
    kernels = set(re.findall(r"^(_Z\w+):", text, flags=re.M))
    scored = {int(m) for k in kernels for m in re.findall(r"score_kernelILi(\d+)E", k)}
    assert scored == kernel_ids
    held = {
        (int(f), int(n), w == "1", int(s))
        for k in kernels
        for f, n, w, s in re.findall(r"score_kernelILi(\d+)ELi(\d+)ELb([01])ELi(\d+)E", k)
    }
    mfma = variants.build_of("gfx942")
    assert held == {v for f in kernel_ids for v in variants.instances(mfma, f)}
    assert any("write_keys_kernel" in k for k in kernels)
    assert any("merge_kernel" in k for k in kernels)


def test_a_process_loads_only_the_modules_it_uses(monkeypatch):
    """``load(device, fmt)`` builds that format's module once; ``load(device)`` (the writer's,
    the peer memory's) takes a format's module already loaded for the arch, as every module
    holds those functions, and builds the base module only where none is. (The compiler is
    replaced by a record of what it was asked for: no GPU here.)"""
    built: list[tuple] = []

    def fake_build(arch, fmt, portable):
        built.append((arch, fmt, portable))
        return f"module {arch} {fmt} {portable}"

    monkeypatch.setattr(build, "_modules", {})
    monkeypatch.setattr(build, "_build", fake_build)
    monkeypatch.setattr(build, "device_arch", lambda device=None: device or "sm_90")
    assert build.load("gfx942") == "module gfx942 None False"  # nothing loaded yet: the base
    assert build.load(None, "fp8") == build.load(None, "fp8") == "module sm_90 fp8 False"
    assert build.load() == "module sm_90 fp8 False"  # fp8's module serves the base functions
    assert build.load(None, "nvfp4", portable=True) == "module sm_90 nvfp4 True"
    assert build.load("gfx942") == "module gfx942 None False"
    assert built == [("gfx942", None, False), ("sm_90", "fp8", False), ("sm_90", "nvfp4", True)]
    assert build.available(None, "bf16") == (True, "fused kernel built for sm_90")
    assert built[-1] == ("sm_90", "bf16", False) and len(built) == 4  # no base module
