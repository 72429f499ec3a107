"""Test-session setup, before anything starts CUDA.

CUDA loads kernels lazily by default, and loading one may synchronize the context. The GPU tests
run W ranks in one process (the one-process world) and launch torch kernels between pushes; the
first launch of such a kernel while a peer's push spins would then never return (docs/design.md,
the one-process world, rule 3). Eager loading takes that off the table for the whole session.

Tests marked ``gpu`` (and parameters marked so, e.g. ``_gpu.DEVICES``' CUDA device) skip where no
GPU is visible: CPU and GPU cases of one behaviour live in one file and share its helpers. Tests
marked ``slow`` (another world size of a case the default run has) run when the marker
expression names them (``-m slow``, ``-m "slow or not slow"``).
"""

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    not_asked = pytest.mark.skip(reason="slow: run with -m slow")
    slow_asked = "slow" in (config.option.markexpr or "")
    for item in items:
        if not torch.cuda.is_available() and item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu)
        if not slow_asked and item.get_closest_marker("slow") is not None:
            item.add_marker(not_asked)
