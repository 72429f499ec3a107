"""Test-session setup, before anything starts CUDA.

CUDA loads kernels lazily by default, and loading one may synchronize the context. The GPU tests
run W ranks in one process (the one-process world) and launch torch kernels between pushes; the
first launch of such a kernel while a peer's push spins would then never return (docs/design.md,
the one-process world, rule 3). Eager loading takes that off the table for the whole session.

Tests marked ``gpu`` (and parameters marked so, e.g. ``_gpu.DEVICES``' CUDA device) skip where no
GPU is visible: CPU and GPU cases of one behaviour live in one file and share its helpers.
"""

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
