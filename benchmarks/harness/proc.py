"""Child processes of a benchmark: each in its own session with a hard time limit and a log
file, its environment cut off from any running cluster; work directories; and a deadline that
ends a child with what it measured so far. Runs in the benchmark's driver and its children.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.cluster import PRIVATE_TMP_ENV
from benchmarks.harness.results import write_json


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args``: how a benchmark starts a child of its own code."""
    return [sys.executable, "-m", module, *args]


def child_env(private_tmp: str | None = None, extra_paths: list[str] | None = None) -> dict[str, str]:
    """This process's environment for a child that must start its own Ray, never join a
    running one. ``private_tmp``: its ``TMPDIR`` (see ``cluster``); ``extra_paths``: put
    on its ``PYTHONPATH`` ahead of what is there (e.g. a directory torchft is installed in)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    if extra_paths:
        env["PYTHONPATH"] = os.pathsep.join(extra_paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if private_tmp is not None:
        env["TMPDIR"] = env[PRIVATE_TMP_ENV] = private_tmp
    return env


def run_logged(
    cmd: list[str],
    timeout: float,
    env: dict[str, str],
    log_path: str,
    watch: Callable[[int], Any] | None = None,
) -> tuple[int, float, Any]:
    """Run ``cmd`` from the repository root in its own session, output to ``log_path``; on
    ``timeout`` the whole session is killed and the exit status is 124. ``watch(pid)`` starts
    an observer of the child (it must have ``stop()``). Returns (exit status, wall s, observer)."""
    t0 = time.time()
    observer = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        if watch is not None:
            observer = watch(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        finally:
            if observer is not None:
                observer.stop()
    return rc, time.time() - t0, observer


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


@contextlib.contextmanager
def work_dir(prefix: str, keep: bool = False) -> Iterator[str]:
    """A temporary working directory, removed at the end unless ``keep`` (then its path is printed)."""
    work = tempfile.mkdtemp(prefix=prefix)
    try:
        yield work
    finally:
        if keep:
            print(f"working directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def arm_deadline(seconds: float, out_path: str, partial: dict[str, Any]) -> None:
    """In a child: after ``seconds``, write what was measured so far (``partial``, marked
    ``status: timeout`` unless it has a status) to ``out_path`` and kill the whole process
    group (this child and its Ray cluster). Nothing outlives the budget."""

    def fire() -> None:
        partial.setdefault("status", "timeout")
        partial["timed_out_after_s"] = seconds
        try:
            write_json(out_path, {k: v for k, v in partial.items() if not callable(v)})
        finally:
            os.killpg(os.getpgid(0), signal.SIGKILL)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
