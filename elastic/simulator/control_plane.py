"""The control plane's own costs at scale, from ``benchmarks/results/control_plane.json``.

``benchmarks/control_plane.py`` runs the real driver over thousands of virtual ranks and
measures, per rank count, the driver's decision time after a node loss (failure seen ->
every configure request sent) and how long the loss took to be seen. The simulator adds
the decision time to every re-formation and takes the larger of the two detection times,
at the job's size: a power law through the two largest measured sizes (one size: that
value up to it), evaluated at ``gpus``, and named in ``--json``'s sources with the file's
date. Beyond the largest run the decision grows at least linearly (its work is O(N) in the
ranks: a smaller run measured on a busier machine must not make it shrink with the job),
and the detection does not shrink.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "control_plane.json"


@dataclass(frozen=True)
class ControlPlane:
    points: tuple[tuple[int, float, float], ...]  # (ranks, decision_s, detect_s), by ranks
    source: str

    def decision_s(self, gpus: int) -> float:
        return _power_law([(r, d) for r, d, _ in self.points], gpus, min_k=1.0)

    def detect_s(self, gpus: int) -> float:
        return _power_law([(r, d) for r, _, d in self.points], gpus, min_k=0.0)

    def describe(self, gpus: int) -> str:
        sizes = ", ".join(f"{r:,}" for r, _, _ in self.points)
        beyond = " (extrapolated)" if gpus > self.points[-1][0] else ""
        return (
            f"driver decision time after a node loss (failure seen -> every configure sent) at {gpus:,} ranks"
            f"{beyond}: power law through the runs at {sizes} ranks of {self.source}"
        )


def _power_law(points: list[tuple[int, float]], x: int, min_k: float) -> float:
    """Through the two largest points; beyond the largest with an exponent of ``min_k`` at least."""
    (x1, y1), (x2, y2) = (points[-2], points[-1]) if len(points) > 1 else (points[-1], points[-1])
    k = math.log(y2 / y1) / math.log(x2 / x1) if x1 != x2 and y1 > 0 and y2 > 0 else 0.0
    if x > x2:
        k = max(k, min_k)
    return y2 * (x / x2) ** k


def load_control_plane(path: Path = RESULTS) -> ControlPlane | None:
    """The measured control plane, or None when the benchmark has not been run here."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    runs = [r for r in data["runs"].values() if r.get("recovery_decision_s") and r.get("detect_s")]
    if not runs:
        return None
    runs.sort(key=lambda r: r["ranks"])
    points = tuple((r["ranks"], r["recovery_decision_s"], r["detect_s"]) for r in runs)
    last = runs[-1]
    load = last["host"].get("loadavg_start", [None])[0]
    where = f"benchmarks/results/control_plane.json ({data['date_utc']}, {last['host']['cpus']} cores, load {load})"
    return ControlPlane(points, where)
