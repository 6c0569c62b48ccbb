"""The GPU check's own plumbing, on CPU (``python -m benchmarks.gpu_check --dry-run``).

The dry run trains nothing worth measuring; what it proves here is what the one short call
on a lent GPU relies on: every part runs in its own process and writes its figures, a part
that hangs is killed at its bound and recorded as ``timeout`` while the others go on, a part
that crashes is recorded as ``error``, the sweep's out-of-memory trial ends ``oom``, and the
JSON report holds the device facts and every part. And: nothing the check or the ``gpu``
tests import needs Ray at import time (the GPU machine has none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.cluster  # gloo process groups, one per part process
@pytest.mark.timeout(300)
def test_dry_run_records_every_part_and_kills_a_hung_one(tmp_path):
    hang_bound = 8
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(tmp_path)]
    cmd += ["--inject", "tests=hang", "--bound", f"tests={hang_bound}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    wall = time.monotonic() - t0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = report["parts"]
    print(f"dry run: {wall:.1f} s; " + ", ".join(f"{n} {p['status']} {p['duration_s']} s" for n, p in parts.items()))
    assert proc.returncode == 1, proc.stdout[-3000:]  # one part timed out: the check did not pass
    assert list(parts) == ["device", "tests", "throughput", "memory", "sweep", "snapshot"]
    assert parts["tests"]["status"] == "timeout"
    assert hang_bound <= parts["tests"]["duration_s"] < hang_bound + 8
    others = {name: p["status"] for name, p in parts.items() if name != "tests"}
    assert others == dict.fromkeys(others, "pass"), {n: parts[n]["error"] for n in others}
    assert report["dry_run"] and not report["passed"]
    assert report["device"]["torch"] and report["device"]["device"] == "cpu" and report["device"]["date"]
    trials = parts["sweep"]["figures"]["trials"]
    assert [t["status"] for t in trials.values()] == ["ok", "oom", "ok"]
    assert "OutOfMemoryError" in trials["dp1-tp1-pp1-z0-mb8"]["reason"]
    assert parts["throughput"]["figures"]["ours"]["tokens_per_s"] > 0
    assert parts["throughput"]["figures"]["baseline"]["tokens_per_s"] > 0
    assert set(parts["memory"]["figures"]["layouts"]) == {"mb2-seq32", "mb2-ac-seq64"}
    assert parts["snapshot"]["figures"]["result"]["snapshots_measured"] >= 2
    assert all(not g["enforced"] for p in parts.values() for n, g in p["goals"].items() if "over" in n)
    log = (tmp_path / "gpu_check.log").read_text()
    assert "[tests] timeout" in log and "[snapshot] pass" in log


@pytest.mark.timeout(60)
def test_a_crashing_part_is_recorded_as_an_error(tmp_path):
    from benchmarks.gpu_check import runner

    args = runner._parse(["--dry-run", "--inject", "device=crash"])
    log = runner.Log(str(tmp_path / "log"))
    result = runner.run_part(runner.PARTS[0], 60, args, str(tmp_path), log)
    log.close()
    assert result["status"] == "error"
    assert result["error"] == "RuntimeError: injected crash"


GPU_MODULES = [
    "benchmarks.gpu_check.runner",
    "benchmarks.gpu_check.parts",
    "benchmarks.gpu_check.tests_part",
    "benchmarks.gpu_check.throughput",
    "benchmarks.gpu_check.memory",
    "benchmarks.gpu_check.sweep",
    "benchmarks.gpu_check.snapshot",
    "elastic.testing.single_rank",
    "elastic.tune.trial",
    "elastic.worker.sdc",
    "elastic.faults",
    "jobs",
]


@pytest.mark.timeout(120)
def test_gpu_tests_are_listed_and_nothing_they_import_needs_ray():
    from benchmarks.gpu_check.tests_part import GPU_TEST_PATHS

    listed = {os.path.join(ROOT, p) for p in GPU_TEST_PATHS}
    marked = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tests")):
        for name in files:
            path = os.path.join(folder, name)
            if name.startswith("test_") and name.endswith(".py") and "mark.gpu" in open(path).read():
                marked.append(path)
    unlisted = [p for p in marked if p not in listed and os.path.dirname(p) not in listed]
    assert marked and not unlisted, f"gpu tests outside GPU_TEST_PATHS: {unlisted}"
    test_dirs = sorted({os.path.dirname(p) for p in marked})
    modules = GPU_MODULES + [os.path.splitext(os.path.basename(p))[0] for p in marked]
    script = textwrap.dedent(
        f"""
        import importlib, sys
        class NoRay:
            def find_spec(self, name, path=None, target=None):
                if name == "ray" or name.startswith("ray."):
                    raise ImportError("ray is not installed on the GPU machine")
        sys.meta_path.insert(0, NoRay())
        sys.path[:0] = {test_dirs!r}
        for name in {modules!r}:
            importlib.import_module(name)
        print("imported", len({modules!r}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
