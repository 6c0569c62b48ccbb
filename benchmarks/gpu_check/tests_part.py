"""GPU check, part ``tests``: the ``gpu``-marked tests, run by pytest in a child process.

Runs in its own process (``parts.py``). ``GPU_TEST_PATHS`` lists where they live; none of
them imports Ray (``tests/gpu/test_gpu_test_paths.py`` checks that every test module that
marks a test ``gpu`` is listed, and that none imports Ray at the top). The outcome of every
test (passed, failed, skipped, xfailed) is recorded from pytest's JUnit XML. On the GPU the
part passes when none failed and some ran; in the dry run (CPU) they all skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_TEST_PATHS = ("tests/gpu", "tests/checkpoint/test_memory_tier_cuda.py")
PER_TEST_TIMEOUT_S = 60


def run(rec: Any, dry_run: bool) -> None:
    xml = os.path.join(tempfile.mkdtemp(prefix="gpu-check-tests-"), "junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfEsxX"]
    cmd += [f"--junitxml={xml}", f"--timeout={PER_TEST_TIMEOUT_S}", *GPU_TEST_PATHS]
    rec.say(" ".join(cmd[1:]))
    sys.stdout.flush()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=sys.stdout, stderr=subprocess.STDOUT)
    outcomes = junit_outcomes(xml)
    counts = {k: sum(1 for o in outcomes.values() if o["outcome"] == k) for k in OUTCOMES}
    rec.figure("pytest_exit_code", proc.returncode)
    rec.figure("counts", counts)
    rec.figure("tests", outcomes)
    rec.goal("failed_or_errors", counts["failed"] + counts["error"], "==", 0, performance=False)
    rec.goal("pytest_exit_code", proc.returncode, "==", 0, performance=False)
    if not dry_run:
        rec.goal("tests_that_ran", counts["passed"] + counts["failed"] + counts["error"], ">=", 1, performance=False)
    if proc.returncode not in (0, 5) and not outcomes:
        raise RuntimeError(f"pytest exited {proc.returncode} without a report (collection error?)")


OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")


def junit_outcomes(path: str) -> dict[str, dict[str, Any]]:
    """``{test id: {outcome, time_s, message}}`` from pytest's JUnit XML (empty if none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = ("failed" if child.tag == "failure" else "error"), child.get("message", "")
            elif child.tag == "skipped":
                xfail = child.get("type") == "pytest.xfail"
                outcome, message = ("xfailed" if xfail else "skipped"), child.get("message", "")
        out[name] = {"outcome": outcome, "time_s": float(case.get("time") or 0), "message": message[:300]}
    return out
