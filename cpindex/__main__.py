import os
import sys

# The demo and bench run W ranks in one process on one GPU: load kernels eagerly, before CUDA
# starts, so no first launch synchronizes the context while a push spins (docs/design.md).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

from .cli import main

if __name__ == "__main__":  # spawned ranks re-import this module; they must not re-run the CLI
    sys.exit(main())
