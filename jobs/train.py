"""Entry point for Ray Jobs: ``ray job submit --working-dir . -- python -m jobs.train CONFIG``.

Behaves exactly like ``elastic run`` (same flags, ``--fault`` included, same exit codes).
Inside a Ray job the driver joins the job's cluster (``RAY_ADDRESS`` is set by Ray), so
``--fault kill_node`` (which needs the embedded multi-node cluster) is refused with exit 2.
The head must serve the Jobs API: ``ray[default]`` and a dashboard (``cluster_configs/local.sh``).
"""

from __future__ import annotations

import sys

from jobs.cli import main


def run(argv: list[str] | None = None) -> int:
    return main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(run())
