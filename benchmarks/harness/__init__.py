"""What the benchmarks share; it runs in each benchmark's driver process and in the child
processes a benchmark starts.

- ``cluster``: a local multi-node Ray cluster on a private ``TMPDIR``;
- ``kill``: kill a node of it with the project's fault tool, stamped;
- ``stats``: median and range over repetitions, slopes, ratios;
- ``results``: results files (atomic JSON, date, host, machine load);
- ``proc``: child processes (own session, hard limit, log), work directories, deadlines;
- ``cpu``: CPU seconds of a process tree, sampled from ``/proc``;
- ``s3``: a moto S3 server on loopback;
- ``ddp_step``: the hand-written DDP step of the baselines;
- ``plain_prepare``: the single-process loop that ``elastic prepare`` is measured against;
- ``virtual_cluster``: the project's worker group over virtual ranks and stand-in raylets;
- ``store_ops``: store operations per rank per re-formation, counted on gloo.
- ``options``: command-line options the benchmarks share (a comma-separated choice).
"""

from __future__ import annotations

import os

BENCHMARKS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(BENCHMARKS_DIR)
RESULTS_DIR = os.path.join(BENCHMARKS_DIR, "results")
QUICKSTART = os.path.join(REPO_ROOT, "examples", "quickstart.yaml")
