"""JIT build of the fused kernel: the only place that knows compiler flags.

A process builds and loads only what it uses: one module per cache format, holding that
format's scoring instances (``-DCP_FORMATS``, launch.h), and a base module with none (the key
writer, the merge, the agreement hash, peer memory and streams). Each is cached per (vendor
arch, format, source hash, flags) under ``CPINDEX_CACHE_DIR`` (default ``~/.cache/cpindex``);
torch's builder holds a file lock around build and load, so concurrent processes build once.
``python -m cpindex build`` fills the cache ahead of time (:func:`prebuild`). CPU-only machines
never build: the reference scorer serves there.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from ..errors import TransportUnavailable
from . import structs, variants

_HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_modules: dict[tuple[str, str | None, bool], ModuleType] = {}

#: The CacheFormat bits (launch.h) whose scoring instances each module holds: a cache format's
#: own (nvfp4 also has the narrow-token kernel), none for the base module (``None``).
FORMAT_BITS: dict[str | None, int] = {
    None: 0,
    **{fmt: 1 << fid for fmt, fid in structs.FORMAT_IDS.items()},
}
FORMAT_BITS["nvfp4"] |= 1 << structs.NVFP4_NARROW


class KernelUnavailable(TransportUnavailable):
    """The fused kernel cannot be built or loaded here (no GPU, no compiler, build error)."""


def device_arch(device: torch.device | None = None) -> str:
    """``sm_90``-style (CUDA) or ``gfx950``-style (ROCm) name of the device's architecture."""
    if not torch.cuda.is_available():
        raise KernelUnavailable("no CUDA/ROCm device is visible to torch")
    props = torch.cuda.get_device_properties(device or torch.cuda.current_device())
    if torch.version.hip:
        return props.gcnArchName.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def _kernel_sources() -> list[Path]:
    """The kernel's sources: ``score.hip`` and the headers it includes, sorted by name."""
    return sorted(_HERE.glob("*.hip")) + sorted(_HERE.glob("*.h"))


def _source_hash(flags: list[str]) -> str:
    h = hashlib.sha256()
    for path in [*_kernel_sources(), _HERE / "binding.cpp"]:
        h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def sources_digest() -> str:
    """12 hex digits of the sha256 of the kernel sources (``score.hip``, then its headers by
    name): the same as ``cat cpindex/kernels/*.hip cpindex/kernels/*.h | sha256sum``, which
    ``benchmarks/device.sh`` prints, so a result names the code it ran."""
    h = hashlib.sha256()
    for path in _kernel_sources():
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def build_defines(arch: str, *, portable: bool = False) -> list[str]:
    """The macros a build for ``arch`` compiles with: ``CP_WGMMA=1`` on sm_90 (Hopper builds
    sm_90a, whose four-tile instances use the warpgroup mma; docs/kernel.md), none elsewhere or
    for the portable path. The library builds only what ships: no environment variable adds
    any."""
    return ["CP_WGMMA=1"] if variants.build_of(arch, portable=portable).wgmma else []


def _write_once(path: Path, text: str) -> Path:
    """``path`` holding ``text``, rewritten only when it holds something else: the builder
    (ninja) rebuilds whatever is newer than its object, so a rewrite on every load would
    recompile the kernel in every process. Written whole (a temporary file renamed), so a
    process loading beside this one never reads half of it."""
    try:
        if path.read_text() == text:
            return path
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def build_flags(arch: str, fmt: str | None = None, *, portable: bool = False) -> list[str]:
    """The compiler flags of ``fmt``'s module for ``arch`` (``fmt=None``: the base module)."""
    if fmt not in FORMAT_BITS:
        raise ValueError(
            f"fmt: expected one of {[f for f in FORMAT_BITS if f]} or None, got {fmt!r}"
        )
    portable = variants.build_of(arch, portable=portable).path == "portable"
    flags = ["-O3", "-std=c++17"] + (["-DCP_PORTABLE=1"] if portable else [])
    flags += [f"-D{d}" for d in build_defines(arch, portable=portable)]
    return [*flags, f"-DCP_FORMATS={FORMAT_BITS[fmt]}"]


def module_name(arch: str, fmt: str | None = None, *, portable: bool = False) -> str:
    """The cache key of a module: its arch, format and mode, and a hash of its sources, flags
    and the torch version (a source or flag change builds anew)."""
    flags = build_flags(arch, fmt, portable=portable)
    mode = "portable_" if portable else ""
    return f"cpindex_{arch}_{fmt or 'base'}_{mode}{_source_hash(flags)}"


def cache_dir() -> Path:
    """Where built modules live: ``CPINDEX_CACHE_DIR``, default ``~/.cache/cpindex``."""
    return Path(os.environ.get("CPINDEX_CACHE_DIR", Path.home() / ".cache" / "cpindex"))


def check_arch(arch: str) -> None:
    """Raise :class:`KernelUnavailable` unless this torch can build for ``arch`` here: a CUDA
    (``sm_90``) or ROCm (``gfx942``) name matching torch's vendor, with its compiler found."""
    from torch.utils import cpp_extension

    hip = torch.version.hip is not None
    if not (hip or torch.version.cuda):
        raise KernelUnavailable(
            f"this torch ({torch.__version__}) has no CUDA or ROCm support; the kernel builds "
            "with a CUDA or ROCm build of torch"
        )
    pattern, vendor, example = (
        (r"gfx[0-9a-f]+", "ROCm", "gfx942") if hip else (r"sm_[0-9]+", "CUDA", "sm_90")
    )
    if not re.fullmatch(pattern, arch):
        raise KernelUnavailable(f"arch {arch!r}: this torch builds for {vendor}, e.g. {example}")
    home = cpp_extension.ROCM_HOME if hip else cpp_extension.CUDA_HOME
    compiler = "hipcc" if hip else "nvcc"
    if not home or not (Path(home) / "bin" / compiler).exists():  # where torch's builder looks
        raise KernelUnavailable(
            f"no {compiler} found (set {'ROCM_HOME' if hip else 'CUDA_HOME'}); building the "
            f"kernel for {arch} needs the {vendor} compiler"
        )


def _build(arch: str, fmt: str | None, portable: bool) -> ModuleType:
    """Build (or find in the cache) and import ``fmt``'s module for ``arch``; no GPU needed.
    Call with ``_lock`` held."""
    from torch.utils import cpp_extension

    flags = build_flags(arch, fmt, portable=portable)
    name = module_name(arch, fmt, portable=portable)
    build_dir = cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if torch.version.hip:
        os.environ["PYTORCH_ROCM_ARCH"] = arch
        kernel_src = _HERE / "score.hip"
    else:
        sm90a = "-DCP_WGMMA=1" in flags
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{arch[3:-1]}.{arch[-1]}" + ("a" if sm90a else "")
        # nvcc needs a .cu name; the wrapper includes the one HIP source.
        kernel_src = _write_once(build_dir / "score.cu", f'#include "{_HERE / "score.hip"}"\n')
    what = f"the cpindex kernel ({fmt or 'base'} module) for {arch}"
    try:
        mod = cpp_extension.load(
            name=name,
            sources=[str(_HERE / "binding.cpp"), str(kernel_src)],
            extra_include_paths=[str(_HERE)],
            extra_cflags=flags,
            extra_cuda_cflags=flags,
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as e:  # the compiler's output is in the message
        raise KernelUnavailable(f"building {what} failed: {e}") from e
    structs.check_layout(mod.params_layout())
    if mod.formats() != FORMAT_BITS[fmt]:
        raise KernelUnavailable(f"{what}: the module holds formats {mod.formats():#x}")
    # the launcher chooses among variants.instances(): the module must hold exactly those
    held = variants.build_of(arch, portable=portable)
    ids = [*structs.FORMAT_IDS.values(), structs.NVFP4_NARROW]
    want = sorted(v for f in ids if FORMAT_BITS[fmt] >> f & 1 for v in variants.instances(held, f))
    if sorted(mod.instances()) != want:
        raise KernelUnavailable(f"{what}: the module holds instances {mod.instances()}, not {want}")
    return mod


def load(
    device: torch.device | None = None, fmt: str | None = None, *, portable: bool = False
) -> ModuleType:
    """The compiled extension for ``device``'s architecture (built on first use): ``fmt``'s
    module (``score`` runs that cache format only), or for ``fmt=None`` the base functions (the
    key writer, merge, agreement hash, peer memory and streams): every module holds them, so a
    format's module already loaded here serves, else the base module (no scoring instance).

    ``portable=True`` builds the scalar path (no tensor-core mma or MFMA) on CUDA, so that path
    is tested on NVIDIA hardware too. On ROCm, gfx942 and gfx950 build the MFMA path; other
    AMD GPUs always build the portable one.
    """
    arch = device_arch(device)
    # the MFMA path's instructions are CDNA3/CDNA4 ones: other AMD GPUs build the portable path
    portable = variants.build_of(arch, portable=portable).path == "portable"
    with _lock:
        mod = _modules.get((arch, fmt, portable))
        if mod is None and fmt is None and not portable:
            # every format's module holds the base module's functions too: one loaded serves
            mod = next((m for (a, _, p), m in _modules.items() if a == arch and not p), None)
        if mod is None:
            mod = _modules[arch, fmt, portable] = _build(arch, fmt, portable)
        return mod


class Prebuilt(NamedTuple):
    """One module :func:`prebuild` made ready."""

    name: str  # the cache entry (:func:`module_name`)
    fmt: str | None  # its cache format; None: the base module
    built: bool  # compiled now (False: found in the cache)
    seconds: float  # to build (or find) and import it
    module: ModuleType


def prebuild(arch: str, formats: list[str | None]) -> list[Prebuilt]:
    """Build ``formats``' modules (None: the base module) for ``arch`` into the cache, as a
    process's first use would, with no GPU needed (``python -m cpindex build``)."""
    check_arch(arch)
    out = []
    for fmt in formats:
        name = module_name(arch, fmt)
        cached = any((cache_dir() / name).glob(f"{name}*.so"))
        t0 = time.perf_counter()
        with _lock:
            mod = _modules.get((arch, fmt, False))
            if mod is None:
                mod = _modules[arch, fmt, False] = _build(arch, fmt, False)
        out.append(Prebuilt(name, fmt, not cached, time.perf_counter() - t0, mod))
    return out


def available(device: torch.device | None = None, fmt: str | None = None) -> tuple[bool, str]:
    """Whether the kernel can run on ``device`` (the base module, and ``fmt``'s where given:
    both built or found here), and why not."""
    try:
        if fmt is not None:  # first: it then serves the base functions too
            load(device, fmt)
        load(device)
    except KernelUnavailable as e:
        return False, str(e)
    return True, f"fused kernel built for {device_arch(device)}"
