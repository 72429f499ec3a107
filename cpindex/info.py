"""``python -m cpindex info``: what this machine offers and what ``auto`` would pick."""

from __future__ import annotations

import torch

from .transports import candidates
from .transports.mori import mori_status


def main() -> None:
    from .config import CPIndexConfig

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    vendor = "AMD (ROCm/HIP)" if torch.version.hip else ("NVIDIA (CUDA)" if gpus else "none")
    print(f"torch {torch.__version__}; GPU vendor: {vendor}; GPUs visible: {gpus}")
    kernel_ok, kernel_why = False, "no GPU; the reference scorer serves, collective over gloo"
    if gpus:
        from . import kernels

        for i in range(gpus):
            print(
                f"  GPU {i}: {torch.cuda.get_device_name(i)} "
                f"({kernels.device_arch(torch.device('cuda', i))})"
            )
        kernel_ok, kernel_why = kernels.available(torch.device("cuda", 0))
        if gpus > 1:
            mod = kernels.load(torch.device("cuda", 0))
            print("peer access matrix (row can write into column):")
            print("     " + " ".join(f"{j:>3}" for j in range(gpus)))
            for i in range(gpus):
                cells = [
                    "  -" if i == j else ("yes" if mod.can_access_peer(i, j) else " no")
                    for j in range(gpus)
                ]
                print(f"  {i:>2} " + " ".join(cells))
    print(f"fused kernel: {'available' if kernel_ok else 'unavailable'} ({kernel_why})")
    ok, why = mori_status()
    print(f"MORI: {'available' if ok else 'unavailable'} ({why})")
    order = candidates(CPIndexConfig())
    print(f"'auto' tries, in order: {', '.join(order)} (prefer_mori=True puts mori first)")
    if gpus >= 2 and kernel_ok:
        pick = (
            "ipc, if every pair of ranks' GPUs has peer access and the self-test passes; "
            "else collective"
        )
    elif gpus == 1 and kernel_ok:
        pick = (
            "ipc in the one-process world (cpindex.world.run_threads), else collective; "
            "one process per GPU needs a GPU per rank"
        )
    else:
        pick = "collective (no GPU peer writes possible here)"
    print(f"'auto' would pick: {pick}")
