"""A loop whose module raises at import in any process but the test's own (a worker's
missing dependency, say): ``tests/train/test_train_run_failures.py``."""

import sys

if "pytest" not in sys.modules:
    raise ImportError("libfoo.so.1: cannot open shared object file (this module imports on the test's driver only)")


def loop(config):
    pass
