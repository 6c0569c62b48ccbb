"""``python -m benchmarks.gpu_check [--dry-run] ...``: see ``runner.py``."""

import sys

from benchmarks.gpu_check.runner import main

if __name__ == "__main__":
    sys.exit(main())
