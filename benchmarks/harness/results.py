"""Results files: JSON written atomically, UTC stamps, the host and its load (a shared machine's
load decides how far a timing can be trusted, so every results file records it). Runs in a
benchmark's driver process.

Each benchmark keeps its own file layout (``elastic demo``, ``elastic simulate`` and the
docs read some of them); these are the pieces they are made of.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Any

from benchmarks.harness import RESULTS_DIR


def results_path(name: str) -> str:
    """``benchmarks/results/<name>``, the published results of a benchmark's default run."""
    return os.path.join(RESULTS_DIR, name)


def utc_stamp(when: datetime.datetime | None = None) -> str:
    """``2026-11-23T16:04:05Z``."""
    return (when or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_iso() -> str:
    """``2026-11-23T16:04:05+00:00``."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def measured_now() -> dict[str, Any]:
    """``measured_at`` (UTC), ``host`` and ``cpus``: the head of the data benchmarks' results files."""
    return {"measured_at": utc_iso(), "host": platform.node(), "cpus": os.cpu_count()}


def machine() -> dict[str, Any]:
    """The host, its CPU count and its load averages (1, 5, 15 minutes) now."""
    return {"hostname": platform.node(), "cpus": os.cpu_count(), "loadavg": list(os.getloadavg())}


def package_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def write_json(path: str, obj: Any, indent: int = 2, newline: bool = True) -> None:
    """Write ``obj`` to ``path`` through a temporary file and a rename: a reader (or a
    deadline that kills the writer) never sees half a file. Creates the directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=indent)
        if newline:
            f.write("\n")
    os.replace(path + ".tmp", path)


def write_stamped(path: str, doc: dict[str, Any]) -> None:
    """``doc`` with the date and the machine (``date_utc``, ``machine``) added at the end,
    written to ``path``, and said."""
    write_json(path, {**doc, "date_utc": utc_stamp(), "machine": machine()}, newline=False)
    print(f"wrote {path}")
