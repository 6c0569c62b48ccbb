"""The cost of an in-place re-formation as a function of the world size, for the failure
simulator (docs/simulate.md): measured where it can be measured here, cited where not.

Runs in the CLI's process; pure apart from reading two results files:

- ``benchmarks/results/recovery_scaling.json`` (``benchmarks/recovery_scaling.py``): real
  node-loss recoveries on gloo at 4 to 16 ranks and at 50 MB and 535 MB of state. From it:
  the work of a re-formation that does not depend on the world (decide, free the
  survivors, rebuild what changed, restore, the RPCs), the rendezvous' growth per rank,
  the cost ratios by world and state size, and whether the survivors restored nothing.
- ``benchmarks/results/control_plane.json`` (``benchmarks/control_plane.py``, if present):
  the driver's decision time at thousands of ranks (failure seen -> every request sent).

What cannot be measured here is the communicator at GPU scale. A re-formation there shrinks
the existing NCCL communicator and splits its sub-groups from it (no store bootstrap:
``elastic/worker/process_group.py``); no published figure times that, so it is bounded
from above by what a cold initialisation of the whole job costs, through two published
points: MegaScale's 2,048 GPUs in under 5 s and NCCLX's 96k GPUs in 265 s / 11 (stock NCCL
265 s, NCCLX 11 times faster), a power law between them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.simulator.control_plane import ControlPlane, load_control_plane

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RECOVERY_SCALING = "recovery_scaling.json"
CONTROL_PLANE = "control_plane.json"

MEGASCALE = (2048, 5.0)  # Jiang et al., NSDI 2024, section 4.1: 2,048-GPU init under 5 s
NCCLX = (96_000, 265.0 / 11)  # Si et al., arXiv 2510.20171: stock NCCL ~265 s at 96k GPUs, NCCLX 11x faster
HBM_BPS = 3.35e12  # H100 SXM HBM3 (NVIDIA's datasheet): a survivor's copy of its own shards
WORLD_FREE = ("decide_s", "free_s", "rebuild_s", "restore_s", "configure_other_s")


@dataclass(frozen=True)
class ReformCurve:
    fixed_s: float  # the world-independent part of a re-formation, measured (median, largest measured scale)
    rendezvous_per_rank_s: float  # measured gloo rendezvous growth per rank (reported, not used at GPU scale)
    ratios: dict[str, float | None]  # measured cost ratios by world and state size
    kept_state: bool  # the measured survivors restored nothing
    control: ControlPlane | None = None  # the driver's decision, from control_plane.json
    sources: dict[str, str] = field(default_factory=dict)

    def comm_s(self, gpus: int) -> float:
        """Upper bound of forming the communicators at ``gpus``: a cold initialisation,
        power law through the two published points."""
        (n1, t1), (n2, t2) = MEGASCALE, NCCLX
        k = math.log(t2 / t1) / math.log(n2 / n1)
        return t1 * (max(gpus, 1) / n1) ** k

    def control_s(self, gpus: int) -> float:
        """The driver's decision at ``gpus`` ranks, as the cost model charges it
        (``ControlPlane.decision_s``: one extrapolation of control_plane.json for both); 0
        without control_plane.json (the decision measured at 16 ranks is in ``fixed_s``)."""
        return self.control.decision_s(gpus) if self.control is not None else 0.0

    def reconfigure_s(self, gpus: int) -> float:
        return self.fixed_s + self.comm_s(gpus) + self.control_s(gpus)

    def survivor_restore_s(self, shard_bytes: float) -> float:
        """A survivor that keeps its state copies only its parameter shards into the new
        wrapper (fp32 master weights: 4 of the 14 bytes per parameter) in device memory."""
        return shard_bytes * 4 / 14 / HBM_BPS if self.kept_state else math.nan


def _read(name: str) -> dict[str, Any] | None:
    path = RESULTS_DIR / name
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def _median(s: dict[str, Any] | None) -> float | None:
    return None if not s else s.get("median")


def load_curve() -> ReformCurve | None:
    """The curve from the results files; None when recovery_scaling.json is absent."""
    res = _read(RECOVERY_SCALING)
    if res is None:
        return None
    sc = res["scenarios"]
    where = f"benchmarks/results/{RECOVERY_SCALING} ({res['measured_at']}, {res['machine']['cores']} cores, gloo)"
    big = [n for n in ("tp2pp2_16", "hsdp_500mb", "ddp_500mb") if sc.get(n, {}).get("cost_s")]
    fixed = max(sum(_median(sc[n]["breakdown"].get(k)) or 0.0 for k in WORLD_FREE) for n in big) if big else 0.0
    dp = [(int(n.split("_")[1]), _median(sc[n]["breakdown"].get("rendezvous_s"))) for n in ("dp_4", "dp_16") if n in sc]
    slope = 0.0
    if len(dp) == 2:
        (w0, r0), (w1, r1) = dp
        slope = (r1 - r0) / (w1 - w0) if r0 is not None and r1 is not None else 0.0
    kept = [k for n in big for k in sc[n].get("ranks_kept_state", []) if k]
    control = load_control_plane(RESULTS_DIR / CONTROL_PLANE)
    sources = {
        "fixed_s": f"{fixed:.2f} s: decide + free + rebuild + restore + RPCs, the largest median of {big} ({where})",
        "comm_s": f"bounded by a cold NCCL init: power law through MegaScale {MEGASCALE[1]:g} s at {MEGASCALE[0]} GPUs "
        f"(NSDI 2024) and NCCLX {NCCLX[1]:.1f} s at {NCCLX[0]} GPUs (arXiv 2510.20171: stock 265 s, 11x faster); "
        "a shrink in place needs no bootstrap",
        "control_s": (
            f"driver decision from benchmarks/results/{CONTROL_PLANE} at {[r for r, _, _ in control.points]} ranks"
            if control is not None
            else f"{CONTROL_PLANE} absent: the driver's decision measured at 16 ranks (in fixed_s), not scaled"
        ),
        "survivor_restore_s": f"survivors kept their state in the measured runs ({kept}): parameter shards copied "
        f"at {HBM_BPS / 1e12:g} TB/s (H100 HBM3)",
        "rendezvous_per_rank_s": f"{slope * 1e3:.2f} ms per rank, gloo, dp 4 -> 16 ({where})",
    }
    return ReformCurve(fixed, slope, dict(res.get("goals", {})), bool(kept), control, sources)


def summary(curve: ReformCurve, gpus: int) -> dict[str, Any]:
    """What ``elastic simulate --json`` reports about the curve at ``gpus``."""
    return {
        "reconfigure_s": round(curve.reconfigure_s(gpus), 3),
        "fixed_s": round(curve.fixed_s, 3),
        "comm_s": round(curve.comm_s(gpus), 3),
        "control_s": round(curve.control_s(gpus), 3),
        "measured_ratios": curve.ratios,
        "rendezvous_per_rank_s": curve.rendezvous_per_rank_s,
        "sources": dict(curve.sources),
    }
