"""JIT build of the fused kernel: the only place that knows compiler flags.

The module is cached per (vendor arch, source hash, flags) under ``CPINDEX_CACHE_DIR`` (default
``~/.cache/cpindex``); torch's builder holds a file lock around build and load, so concurrent
processes build once. CPU-only machines never build: the reference scorer serves there.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

from ..errors import TransportUnavailable

_HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_modules: dict[tuple[str, bool], ModuleType] = {}


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


#: AMD architectures the matrix-core (MFMA) path is built for (CDNA3, CDNA4); a HIP build for
#: any other AMD GPU takes the portable path (compat.h, CP_MFMA).
MFMA_ARCHS = ("gfx940", "gfx941", "gfx942", "gfx950")


def build_defines(arch: str, *, portable: bool = False) -> list[str]:
    """The macros a build for ``arch`` compiles with: ``CP_WGMMA=1`` on sm_90 (Hopper builds
    sm_90a, whose four-tile instances use the warpgroup mma; docs/kernel.md), none elsewhere or
    for the portable path. The library builds only what ships: no environment variable adds
    any."""
    return ["CP_WGMMA=1"] if arch == "sm_90" and not portable else []


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


def load(device: torch.device | None = None, *, portable: bool = False) -> ModuleType:
    """The compiled extension for ``device``'s architecture (built on first use).

    ``portable=True`` builds the scalar path (no tensor-core mma or MFMA) on CUDA, so that path
    is tested on NVIDIA hardware too. On ROCm, gfx942 and gfx950 build the MFMA path; other
    AMD GPUs always build the portable one.
    """
    arch = device_arch(device)
    if torch.version.hip and arch not in MFMA_ARCHS:
        portable = True  # the MFMA path's instructions are CDNA3/CDNA4 ones
    key = (arch, portable)
    with _lock:
        if key in _modules:
            return _modules[key]
        from torch.utils import cpp_extension

        defines = build_defines(arch, portable=portable)
        sm90a = "CP_WGMMA=1" in defines
        flags = ["-O3", "-std=c++17"] + (["-DCP_PORTABLE=1"] if portable else [])
        flags += [f"-D{d}" for d in defines]
        name = f"cpindex_{arch}_{'portable_' if portable else ''}{_source_hash(flags)}"
        cache = Path(os.environ.get("CPINDEX_CACHE_DIR", Path.home() / ".cache" / "cpindex"))
        build_dir = cache / name
        build_dir.mkdir(parents=True, exist_ok=True)
        if torch.version.hip:
            os.environ["PYTORCH_ROCM_ARCH"] = arch
            kernel_src = _HERE / "score.hip"
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = f"{arch[3:-1]}.{arch[-1]}" + ("a" if sm90a else "")
            # nvcc needs a .cu name; the wrapper includes the one HIP source.
            kernel_src = _write_once(build_dir / "score.cu", f'#include "{_HERE / "score.hip"}"\n')
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
            raise KernelUnavailable(f"building the cpindex kernel for {arch} failed: {e}") from e
        from .structs import check_layout

        check_layout(mod.params_layout())
        _modules[key] = mod
        return mod


def available(device: torch.device | None = None) -> tuple[bool, str]:
    """Whether the kernel can run on ``device``, and why not."""
    try:
        load(device)
    except KernelUnavailable as e:
        return False, str(e)
    return True, f"fused kernel built for {device_arch(device)}"
