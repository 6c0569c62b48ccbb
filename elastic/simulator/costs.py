"""The costs the failure simulator charges, each measured here or cited (docs/simulate.md).

Measured costs are read from the benchmark results files in ``benchmarks/results/`` (each
names where and when it was measured) and scaled to a cluster by the models stated next to
them. Cited costs carry their source. Every cost ends up in ``elastic simulate --json``'s
``params``, by name, with its source in ``params["sources"]``.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elastic.simulator.control_plane import load_control_plane
from elastic.simulator.scaling import load_curve

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

# Llama 3 (arXiv 2407.21783, Table 5): the 419 unexpected interruptions of a 54-day
# snapshot of 405B pre-training on 16,384 H100s, grouped into the simulator's causes.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
LLAMA3_CAUSES: dict[str, tuple[int, str]] = {
    "gpu": (190, "faulty GPU 148, GPU SRAM 19, GPU system processor 17, GPU thermal interface/sensor 6"),
    "hbm": (72, "GPU HBM3 memory 72"),
    "network": (49, "network switch/cable 35, NIC 7, NCCL watchdog timeouts 7"),
    "host": (46, "host maintenance 32, SSD 3, power supply 3, chassis 2, IO expansion board 2, CPU 2, system memory 2"),
    "software": (56, "software bug 54, dependency 2"),
    "sdc": (6, "silent data corruption 6"),
}
CAUSES = tuple(LLAMA3_CAUSES)
# Causes after which the node stays usable (the process is restarted in place, nobody is evicted).
NODE_STAYS = frozenset({"software"})

# MegaScale (Jiang et al., NSDI 2024, section 4.1): process-group initialisation of a
# 2,048-GPU job brought from 1,047 s down to under 5 s.
MEGASCALE_INIT_GPUS = 2048
MEGASCALE_INIT_S = 5.0

# Llama 3 (arXiv 2407.21783, section 3.3): Tectonic storage sustains 2 TB/s (7 TB/s peak);
# GPUs are linked by 400 Gb/s RoCE; 405B trained with TP 8 x PP 16 x DP 128 on 16,384
# GPUs at 400 TFLOPs/GPU (Table 4) with 16M-token batches of 8,192-token sequences.
LLAMA3_STORAGE_BPS = 2e12
LLAMA3_NET_BPS_PER_GPU = 400e9 / 8
LLAMA3_PARAMS = 405e9
LLAMA3_TFLOPS_PER_GPU = 400e12
LLAMA3_SEQ_LEN = 8192
# Bytes of training state per parameter: bf16 weights, fp32 master weights, fp32 Adam m and v.
STATE_BYTES_PER_PARAM = 2 + 4 + 4 + 4
# Host<->GPU copies: PCIe Gen5 x16 is 64 GB/s per direction; half of it is assumed reached.
HOST_DEVICE_BPS = 32e9


@dataclass(frozen=True)
class Costs:
    """Every cost of one strategy at one scale, in seconds unless named otherwise."""

    detect_s: dict[str, float]  # per cause: failure -> the controller knows
    reconfigure_s: float  # in place: re-form the process group (init included), survivors rebuild
    pg_init_s: float  # process-group init at this world size (part of reconfigure_s / restart_s)
    restore_memory_s: float  # in place: survivors load their own memory snapshot
    restore_peer_s: float  # in place: a newcomer gets its state from a live peer's memory
    restore_storage_s: float  # staggered storage read: one DP rank reads, the others get a broadcast
    restart_s: float  # restart (u0): reschedule + init + storage restore, after detection
    grow_s: float  # in place: pause to add returned capacity (spawn, init, peer restore)
    step_s: float  # one training step at full DP
    snapshot_blocking_s: float  # memory snapshot's training-blocking time per step (0 for restart)
    ckpt_blocking_s: float  # storage checkpoint's blocking time, w
    ckpt_write_s: float  # until a storage checkpoint is usable for a restore (>= blocking)
    sdc_check_every_steps: int  # silent corruption is found at the next check
    sources: dict[str, str] = field(default_factory=dict)
    control_plane_s: float = 0.0  # the driver's decision time in each re-formation (part of reconfigure_s, grow_s)

    def as_params(self) -> dict[str, Any]:
        d = asdict(self)
        d["detect_s"] = dict(self.detect_s)
        return d


# --------------------------------------------------------------------------- measured inputs


def _read(name: str) -> dict[str, Any]:
    path = RESULTS_DIR / name
    with open(path) as f:
        return json.load(f)


def _median_from_log(runs: list[dict], pattern: str) -> float:
    vals = [
        float(m.group(1)) for r in runs for line in r.get("controller_log", []) for m in [re.search(pattern, line)] if m
    ]
    if not vals:
        raise ValueError(f"benchmarks/results/recovery.json: no controller_log line matches {pattern!r}")
    return statistics.median(vals)


def _init_s(rec: dict[str, Any]) -> float:
    """Process-group init at the benchmark's size: the recovery breakdown's rendezvous phase
    (``restore`` event ``breakdown.rendezvous_s``); older result files only have it in the log."""
    phases = rec["summary"]["ours"].get("phases", {})
    if "rendezvous_s" in phases:
        return float(phases["rendezvous_s"]["median"])
    return _median_from_log(rec["runs"]["ours"], r"'init_s': ([0-9.]+)")


@dataclass(frozen=True)
class Measured:
    """What the 4-node benchmarks measured (medians), with the files they come from."""

    detect_s: float
    reconfigure_excl_restore_s: float
    init_s: float
    state_restore_s: float
    first_step_s: float
    grow_s: float
    state_mb: float
    nodes: int
    raytrain_restart_s: float  # Ray Train tuned: detect + restart the worker group
    raytrain_restore_s: float  # Ray Train tuned: build DDP + load the checkpoint
    raytrain_first_step_s: float
    recovery_ours_s: float
    recovery_raytrain_s: float
    lost_ours: float
    lost_raytrain: float
    kill_step: int
    global_batch: int
    memory_blocking_over_step: float
    async_over_sync_blocking: float
    local_write_bps: float  # sync checkpoint bytes / sync blocking, local disk
    node_back_s: float  # ours: SIGKILL -> the replacement node is up (Cluster.add_node returned)
    sources: dict[str, str]


def load_measured() -> Measured:
    rec = _read("recovery.json")
    stall = _read("checkpoint_stall.json")
    s = rec["summary"]
    ours, rt = s["ours"], s["raytrain_tuned"]
    where = f"benchmarks/results/recovery.json ({rec['date_utc']}, {rec['host']['cpus']} cores)"
    swhere = f"benchmarks/results/checkpoint_stall.json ({stall['date_utc']}, {stall['host']['cpus']} cores)"
    st = stall["summary"]
    return Measured(
        detect_s=ours["breakdown"]["detect"]["median"],
        reconfigure_excl_restore_s=ours["breakdown"]["reconfigure_excl_restore"]["median"],
        init_s=_init_s(rec),
        state_restore_s=ours["breakdown"]["state_restore"]["median"],
        first_step_s=ours["breakdown"]["first_step"]["median"],
        grow_s=_median_from_log(rec["runs"]["ours"], r"grew from dp=\d+ to dp=\d+ in ([0-9.]+)s"),
        state_mb=rec["scenario"]["state_mb"],
        nodes=rec["scenario"]["nodes"],
        raytrain_restart_s=rt["breakdown"]["detect_and_restart_worker_group"]["median"],
        raytrain_restore_s=rt["breakdown"]["build_ddp_and_checkpoint_restore"]["median"],
        raytrain_first_step_s=rt["breakdown"]["first_step"]["median"],
        recovery_ours_s=ours["recovery_s"]["median"],
        recovery_raytrain_s=rt["recovery_s"]["median"],
        lost_ours=ours["lost_steps"]["median"],
        lost_raytrain=rt["lost_steps"]["median"],
        kill_step=rec["scenario"]["kill_step"],
        global_batch=rec["scenario"]["global_batch"],
        memory_blocking_over_step=st["memory_blocking_over_step"]["median"],
        async_over_sync_blocking=st["async_over_sync_blocking"]["median"],
        local_write_bps=st["checkpoint_bytes"]["median"] / st["sync_blocking_s"]["median"],
        node_back_s=statistics.median(r["node_added_done_ts"] - r["kill_ts"] for r in rec["runs"]["ours"]),
        sources={"recovery": where, "checkpoint_stall": swhere},
    )


# --------------------------------------------------------------------------- scaling models


def pg_init_s(world: int, m: Measured) -> float:
    """Process-group init, linear in the world size through two points: ours measured at
    the benchmark's world size, and MegaScale's 2,048 GPUs in 5 s (TCPStore rendezvous is
    one round trip per rank to one store)."""
    slope = (MEGASCALE_INIT_S - m.init_s) / (MEGASCALE_INIT_GPUS - m.nodes)
    return m.init_s + slope * max(0, world - m.nodes)


def cluster_costs(
    strategy: str,
    gpus: int,
    tp: int,
    pp: int,
    batch: int = 2048,
    params: float = LLAMA3_PARAMS,
    step_s: float | None = None,
    collective_timeout_s: float | None = None,
    m: Measured | None = None,
) -> Costs:
    """Costs of a GPU cluster at ``gpus``: measured parts scaled by the models stated here."""
    from elastic.control.config import ElasticConfig

    m = m or load_measured()
    if collective_timeout_s is None:
        collective_timeout_s = ElasticConfig().collective_timeout_s
    unique = params * STATE_BYTES_PER_PARAM  # one replica's state
    shard = unique / (tp * pp)  # per GPU (DDP replicas hold the same shards)
    if step_s is None:  # Llama 3's per-GPU throughput on `batch` sequences of 8,192 tokens
        step_s = 6 * params * batch * LLAMA3_SEQ_LEN / (LLAMA3_TFLOPS_PER_GPU * gpus)
    init = pg_init_s(gpus, m)
    detect = {c: m.detect_s for c in CAUSES}
    detect["network"] = collective_timeout_s  # a dead link hangs a collective until it times out
    read = unique / LLAMA3_STORAGE_BPS + shard / LLAMA3_NET_BPS_PER_GPU + shard / HOST_DEVICE_BPS
    write = unique / LLAMA3_STORAGE_BPS
    restore_memory = shard / HOST_DEVICE_BPS
    restore_peer = shard / LLAMA3_NET_BPS_PER_GPU + shard / HOST_DEVICE_BPS
    reconfigure = m.reconfigure_excl_restore_s - m.init_s + init
    curve = load_curve()  # the measured re-formation curve (elastic/simulator/scaling.py), when there is one
    if curve is not None:
        init = curve.comm_s(gpus)  # both strategies: the same communicator library
        # the driver's decision is added once below, from the control-plane benchmark
        # (load_control_plane), so not through curve.control_s (the same figure) as well
        reconfigure = curve.fixed_s + curve.comm_s(gpus)
        if curve.kept_state:
            restore_memory = curve.survivor_restore_s(shard)
    ray_reschedule = m.raytrain_restart_s - m.detect_s
    sync_blocking = shard / HOST_DEVICE_BPS + write
    inplace = strategy == "inplace"
    control = load_control_plane()
    control_s = control.decision_s(gpus) if control is not None else 0.0
    if control is not None:  # a loss at this scale may take the driver longer to see than at 4 nodes
        for cause in detect:
            if cause != "network":
                detect[cause] = max(detect[cause], control.detect_s(gpus))
    src = {
        "detect_s": f"{m.detect_s:.2f} s for a crash (measured, {m.sources['recovery']}); network: a hang "
        f"found by elastic.collective_timeout_s ({collective_timeout_s:g} s default)",
        "pg_init_s": f"linear in world size through {m.init_s:.2f} s at {m.nodes} (measured) and MegaScale's "
        f"{MEGASCALE_INIT_S:g} s at {MEGASCALE_INIT_GPUS} GPUs",
        "reconfigure_s": "measured re-forming excluding restore and init "
        f"({m.reconfigure_excl_restore_s - m.init_s:.2f} s) + pg_init_s",
        "restore_memory_s": f"shard {shard / 1e9:.1f} GB / host->GPU {HOST_DEVICE_BPS / 1e9:g} GB/s (PCIe Gen5, half)",
        "restore_peer_s": f"shard over {LLAMA3_NET_BPS_PER_GPU * 8 / 1e9:g} Gb/s per GPU (Llama 3) + host->GPU",
        "restore_storage_s": f"staggered read: {unique / 1e12:.2f} TB once at {LLAMA3_STORAGE_BPS / 1e12:g} TB/s "
        "(Llama 3 Tectonic), DP broadcast of the shard, host->GPU",
        "restart_s": f"Ray Train tuned reschedule {ray_reschedule:.1f} s (measured at {m.nodes} nodes, not scaled) "
        "+ pg_init_s + restore_storage_s",
        "grow_s": f"measured grow pause {m.grow_s:.2f} s - init + pg_init_s + restore_peer_s",
        "step_s": "6 * params * batch * 8192 tokens / (400 TFLOPs/GPU * gpus) (Llama 3 Table 4)",
        "snapshot_blocking_s": f"measured memory-snapshot blocking {100 * m.memory_blocking_over_step:.2f}% of a step "
        f"({m.sources['checkpoint_stall']}) + any D2H copy longer than a step",
        "ckpt_blocking_s": (
            f"async: measured async/sync blocking {100 * m.async_over_sync_blocking:.2f}% x sync blocking"
            if inplace
            else "sync (Ray Train report): shard D2H + state / storage bandwidth"
        ),
        "ckpt_write_s": f"{unique / 1e12:.2f} TB / {LLAMA3_STORAGE_BPS / 1e12:g} TB/s",
        "sdc_check_every_steps": "assumed: a cross-replica check every 100 steps",
        "control_plane_s": control.describe(gpus) if control is not None else "not measured here: 0",
    }
    if curve is not None:
        src["pg_init_s"] = curve.sources["comm_s"]
        src["reconfigure_s"] = "; ".join(
            f"{k}: {curve.sources[k]}" for k in ("fixed_s", "comm_s", "rendezvous_per_rank_s")
        )
        if curve.kept_state:
            src["restore_memory_s"] = curve.sources["survivor_restore_s"]
    if control is not None:
        src["detect_s"] += f"; at least the node-loss detection measured by {control.source}"
        src["reconfigure_s"] += " + control_plane_s"
    return Costs(
        detect_s=detect,
        reconfigure_s=reconfigure + control_s,
        pg_init_s=init,
        restore_memory_s=restore_memory,
        restore_peer_s=restore_peer,
        restore_storage_s=read,
        restart_s=ray_reschedule + init + read,
        grow_s=max(0.0, m.grow_s - m.init_s) + init + restore_peer + control_s,
        step_s=step_s,
        snapshot_blocking_s=(m.memory_blocking_over_step * step_s + max(0.0, shard / HOST_DEVICE_BPS - step_s))
        if inplace
        else 0.0,
        ckpt_blocking_s=m.async_over_sync_blocking * sync_blocking if inplace else sync_blocking,
        ckpt_write_s=write if inplace else 0.0,
        sdc_check_every_steps=100,
        sources=src,
        control_plane_s=control_s,
    )


def local_costs(strategy: str, m: Measured | None = None) -> Costs:
    """The 4-node local cluster of benchmarks/recovery_vs_raytrain.py, from its own measurements:
    the simulator fed with these must reproduce what that benchmark measured."""
    m = m or load_measured()
    state_bytes = m.state_mb * 1e6
    inplace = strategy == "inplace"
    detect = {c: m.detect_s for c in CAUSES}
    # The measured first step ran at DP nodes-1 with the same global batch: scale it to full DP.
    step = m.first_step_s * (m.nodes - 1) / m.nodes
    write = state_bytes / m.local_write_bps
    return Costs(
        detect_s=detect,
        reconfigure_s=m.reconfigure_excl_restore_s,
        pg_init_s=m.init_s,
        restore_memory_s=m.state_restore_s,
        restore_peer_s=m.state_restore_s,
        restore_storage_s=m.raytrain_restore_s,
        restart_s=m.raytrain_restart_s - m.detect_s + m.raytrain_restore_s,
        grow_s=m.grow_s,
        step_s=step,
        snapshot_blocking_s=m.memory_blocking_over_step * step if inplace else 0.0,
        ckpt_blocking_s=0.0 if inplace else write,
        ckpt_write_s=write,
        sdc_check_every_steps=100,
        sources={
            "all": f"{m.sources['recovery']}; {m.sources['checkpoint_stall']}",
            "ckpt_write_s": f"{m.state_mb:g} MB / local write bandwidth measured by checkpoint_stall",
        },
    )


def optimal_interval_closed_form(nodes: int, rate_per_node_s: float, w: float) -> float:
    """Young's first-order optimum sqrt(2 w / (N r)) of the closed form's interval."""
    return math.sqrt(2 * w / (nodes * rate_per_node_s)) if w > 0 and rate_per_node_s > 0 else math.inf
