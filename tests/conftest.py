"""Test-session setup, before anything starts CUDA.

CUDA loads kernels lazily by default, and loading one may synchronize the context. The GPU tests
run W ranks in one process (the one-process world) and launch torch kernels between pushes; the
first launch of such a kernel while a peer's push spins would then never return (docs/design.md,
the one-process world, rule 3). Eager loading takes that off the table for the whole session.
"""

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
