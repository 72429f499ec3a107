"""The fused HIP/CUDA scoring kernel: source (``score.hip`` and the headers it includes),
torch binding (``binding.cpp``), JIT build (:mod:`.build`), the choice of kernel instance
(:mod:`.variants`) and launcher (:mod:`.launcher`)."""

from .build import (
    KernelUnavailable,
    available,
    build_defines,
    device_arch,
    load,
    prebuild,
    sources_digest,
)

__all__ = [
    "KernelUnavailable",
    "available",
    "build_defines",
    "device_arch",
    "load",
    "prebuild",
    "sources_digest",
]
