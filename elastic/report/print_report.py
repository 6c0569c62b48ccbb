"""The report at the end of ``elastic run``: written, its path printed, and never an error."""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger(__name__)


def print_report(run_dir: str) -> str | None:
    """Write ``RUN_DIR/report`` and print the path of its ``report.md``; a failure is logged
    and printed as one line, and never changes how the run ends."""
    t = time.perf_counter()
    try:
        from elastic.report.cli import write_report

        path = write_report(run_dir)
    except Exception as exc:  # the run's outcome stands whatever happens here
        logger.debug("report failed", exc_info=True)
        print(f"report: not written ({type(exc).__name__}: {exc}); try: elastic report {run_dir}", file=sys.stderr)
        return None
    print(f"  report            {path} ({time.perf_counter() - t:.1f}s to write)", flush=True)
    return path
