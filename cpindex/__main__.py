import sys

from .cli import main

if __name__ == "__main__":  # spawned ranks re-import this module; they must not re-run the CLI
    sys.exit(main())
