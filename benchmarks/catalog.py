"""The list of benchmarks: what each measures, the results file its default run publishes, its
quick settings, and what it needs that a machine may lack. ``python -m benchmarks`` (``make
bench``, ``make bench-list``) reads it; the order is the order ``make bench`` runs them in:
one process first, then rank groups, embedded Ray, multi-node clusters, the longest last.
Pure data and checks; runs in the process that lists or runs the benchmarks.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from benchmarks.harness.results import results_path


@dataclass(frozen=True)
class Need:
    """Something a benchmark needs: a Python module, or ``cuda`` (a GPU torch can see)."""

    what: str
    how: str  # how to get it, or why it cannot be had here

    def missing(self) -> bool:
        if self.what == "cuda":
            import torch

            return not torch.cuda.is_available()
        return importlib.util.find_spec(self.what) is None


@dataclass(frozen=True)
class Benchmark:
    name: str  # the module: python -m benchmarks.<name>
    measures: str
    results: str | None  # the file in benchmarks/results/ its published run writes (None: prints only)
    out_flag: str | None  # the option that names its results file (None: it writes none)
    quick: tuple[str, ...]  # the settings `make bench` runs it with
    needs: tuple[Need, ...] = ()  # without one of these it cannot run here
    optional: tuple[Need, ...] = ()  # without one of these a side is reported skipped
    full: tuple[str, ...] = ()  # the published run's settings, where they are not the defaults
    # the settings the test suite runs it with (tests/test_benchmarks_run.py), its smallest
    # that still goes through every phase ("{out}": a results file the test names, "{out_dir}":
    # a directory); None only where ``needs`` names what a machine may lack
    smoke: tuple[str, ...] | None = None
    smoke_timeout_s: int = 100  # the smoke run's wall-clock limit: several times its time on an idle machine

    @property
    def module(self) -> str:
        return f"benchmarks.{self.name}"

    def published(self) -> str | None:
        return results_path(self.results) if self.results else None

    def missing(self) -> list[Need]:
        return [n for n in self.needs if n.missing()]


TORCHFT = Need("torchft", "make bench-deps installs torchft 0.2.0")
TORCHTITAN = Need("torchtitan", "pip install torchtitan (into .venv)")
CUDA = Need("cuda", "written for GPUs: torchtitan cannot train on CPU (docs/models.md)")

BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "checkpoint_stall",
        "training-blocking time per checkpoint: async vs sync storage, memory snapshot vs step time",
        "checkpoint_stall.json",
        "--json",
        ("--d-model", "128", "--layers", "2", "--checkpoints", "3", "--every", "2", "--reps", "1"),
        full=("--d-model", "256", "--layers", "4", "--checkpoints", "3"),
        smoke=(
            *("--d-model", "64", "--layers", "1", "--vocab", "256", "--seq", "16"),
            *("--checkpoints", "1", "--every", "1", "--reps", "1", "--json", "{out}"),
        ),
    ),
    Benchmark(
        "tp_data_sharing",
        "feeding a TP group: every TP rank reads vs TP rank 0 reads and broadcasts",
        None,
        "--json",
        ("--shapes", "quickstart", "--steps", "30", "--warmup", "2"),
        smoke=("--shapes", "quickstart", "--steps", "3", "--warmup", "1", "--json", "{out}"),
    ),
    Benchmark(
        "playbook_memory",
        "the memory model's estimate vs the Ultra-Scale Playbook's published peaks (Llama 3.1 8B, 8 H100)",
        None,
        "--json",
        ("--model", "llama3.1-8b"),
        smoke=("--model", "llama3.1-8b", "--json", "{out}"),
    ),
    Benchmark(
        "parallel_layouts",
        "tokens/s and per-rank memory of DP/TP/PP/ZeRO layouts, and the memory model's prediction",
        None,
        "--json",
        ("--warmup", "1", "--rounds", "1", "--steps-per-round", "1"),
        smoke=(
            *("--layers", "2", "--d-model", "32", "--global-batch", "8"),
            *("--warmup", "0", "--rounds", "1", "--steps-per-round", "1", "--json", "{out}"),
        ),
        smoke_timeout_s=300,
    ),
    Benchmark(
        "reconfigure_profile",
        "where a re-formation's time goes in the workers; restoring build vs full rebuild",
        None,
        None,
        ("--generations", "2"),
        smoke=("--generations", "1", "--world", "2"),
    ),
    Benchmark(
        "survivor_rebuild",
        "a survivor's own rebuild and state take-back by state size (one process, fake group): 0.5 GB vs 50 MB",
        "survivor_rebuild.json",
        "--json",
        ("--reps", "1", "--models", "50mb,500mb_4l"),
        smoke=("--reps", "1", "--models", "50mb", "--json", "{out}"),
    ),
    Benchmark(
        "survivor_first_step",
        "a survivor's first step after a re-formation vs its next steps (2 gloo ranks, DDP and HSDP)",
        "survivor_first_step.json",
        "--json",
        ("--generations", "1", "--steps", "2", "--models", "50mb"),
        smoke=("--generations", "1", "--steps", "2", "--models", "50mb", "--json", "{out}"),
    ),
    Benchmark(
        "sft_packing",
        "SFT counted (non-padding) tokens/s: chat rows packed with document masks vs one conversation padded a row",
        "sft_packing.json",
        "--json",
        ("--conversations", "400", "--reps", "1", "--steps", "3"),
        smoke=(
            *("--conversations", "40", "--seq-len", "128", "--d-model", "32", "--layers", "1"),
            *("--steps", "1", "--warmup", "1", "--reps", "1", "--json", "{out}"),
        ),
    ),
    Benchmark(
        "restore_waves",
        "checkpoint restore from S3 in waves vs unstaggered: peak GETs in flight, restore time",
        "restore_waves.json",
        "--out",
        ("--repeats", "1"),
        smoke=("--repeats", "1", "--out", "{out}"),
        smoke_timeout_s=300,
    ),
    Benchmark(
        "prepare_throughput",
        "`elastic prepare` tokens/s vs a plain single-process loop",
        "prepare_throughput.json",
        "--out",
        ("--sizes-mb", "1", "--repeats", "1"),
        smoke=("--sizes-mb", "1", "--repeats", "1", "--out", "{out}"),
    ),
    Benchmark(
        "overhead",
        "steady-state tokens/s and CPU per step: elastic DDP vs a plain torchrun DDP script",
        "overhead.json",
        "--json",
        ("--size", "tiny", "--steps", "12", "--warmup", "4", "--reps", "1"),
        smoke=("--size", "tiny", "--steps", "6", "--warmup", "2", "--reps", "1", "--json", "{out}"),
        smoke_timeout_s=300,
    ),
    Benchmark(
        "sdc_overhead",
        "step time with the SDC check every 10 steps vs off",
        "sdc_overhead.json",
        "--json",
        ("--steps", "24", "--warmup", "4", "--reps", "1"),
        smoke=("--steps", "8", "--warmup", "2", "--reps", "1", "--json", "{out}"),
    ),
    Benchmark(
        "held_step_cost",
        "a held loop's step (prepare_optimizer: model and optimizer snapshot after every step) vs the same "
        "optimizer not held, the same model and data (one process, one torch thread)",
        "held_step_cost.json",
        "--json",
        ("--steps", "10", "--reps", "1"),
        smoke=("--width", "256", "--depth", "2", "--steps", "5", "--warmup", "1", "--reps", "1", "--json", "{out}"),
    ),
    Benchmark(
        "rank_start",
        "a new rank's start beside busy nice-0 processes: its arguments opened at 0 vs at Ray's worker niceness (15)",
        "rank_start.json",
        "--json",
        ("--reps", "1"),
        smoke=("--reps", "1", "--busy", "1", "--json", "{out}"),
    ),
    Benchmark(
        "job_start",
        "a job's start and an agent's cost of holding its ranks' handles: the rank's actor as a shell vs its class",
        "job_start.json",
        "--json",
        ("--reps", "1"),
        smoke=("--reps", "1", "--json", "{out}"),
        smoke_timeout_s=300,
    ),
    Benchmark(
        "peer_fetch",
        "a peer's memory snapshot fetched across nodes: one TCP connection vs Ray's object store",
        "peer_fetch.json",
        "--json",
        ("--sizes-mb", "64", "--reps", "1"),
        smoke=("--sizes-mb", "4", "--reps", "1", "--json", "{out}"),
    ),
    Benchmark(
        "control_plane",
        "the real driver over thousands of virtual ranks (node agents, aggregators): driver CPU per step "
        "and per recovery, decision time, false failures under a driver stall",
        "control_plane.json",
        "--results",
        ("--ranks", "64", "--steps", "12", "--step-s", "0.5", "--heartbeat-timeout-s", "2", "--no-store-ops"),
        full=("--ranks", "16384", "--json"),
        smoke=(
            *("--ranks", "32", "--steps", "8", "--step-s", "0.25", "--heartbeat-timeout-s", "1"),
            *("--real-agents", "2", "--fan-in", "2", "--no-store-ops", "--no-save", "--json"),
        ),
    ),
    Benchmark(
        "peer_replication",
        "ZeRO-3 throughput with snapshots copied to a peer vs not, then a rank killed in each",
        None,
        None,
        ("--steps", "16", "--reps", "1"),
        smoke=("--steps", "12", "--reps", "1"),
        smoke_timeout_s=480,
    ),
    Benchmark(
        "drain_vs_kill",
        "training gap of an announced node loss (Ray drain) vs a SIGKILLed node",
        "drain_vs_kill.json",
        "--out",
        ("--repeats", "1", "--steps", "14", "--at", "6"),
        smoke=("--repeats", "1", "--steps", "10", "--at", "4", "--out", "{out}"),
        smoke_timeout_s=400,
    ),
    Benchmark(
        "recovery_scaling",
        "re-formation cost (downtime - first step) by world size and state size; store operations per rank",
        "recovery_scaling.json",
        "--out",
        ("--reps", "1", "--scenarios", "dp_4,hsdp_50mb", "--store-ops-worlds", "4"),
        smoke=("--reps", "1", "--scenarios", "dp_4", "--store-ops-worlds", "4", "--out", "{out}"),
        smoke_timeout_s=400,
    ),
    Benchmark(
        "recovery_vs_raytrain",
        "node-loss recovery and lost steps: ours vs Ray Train V2 (tuned, default), TorchFT, Ray Train + TorchFT",
        "recovery.json",
        "--results",
        ("--reps", "1", "--steps", "24", "--rejoin-steps", "40", "--kill-step", "8"),
        optional=(TORCHFT,),
        smoke=(
            *("--reps", "1", "--sides", "ours,raytrain_tuned", "--nodes", "2", "--steps", "10"),
            *("--rejoin-steps", "10", "--kill-step", "4", "--return-delay", "-1", "--results", "{out}"),
        ),
        smoke_timeout_s=400,
    ),
    Benchmark(
        "train_api_recovery",
        "a Ray Train user's own loop through a node loss: Ray Train V2 (tuned) vs elastic.train, the same script: "
        "recovery, steps trained again, rows trained once/twice/never (DataLoader and Ray Dataset)",
        "train_api_recovery.json",
        "--results",
        ("--repeats", "1", "--rows", "960", "--kill-step", "7"),
        smoke=(
            *("--sides", "raytrain,ours", "--repeats", "1", "--rows", "960", "--kill-step", "7"),
            *("--step-sleep-s", "0.05", "--timeout", "240", "--json"),
        ),
    ),
    Benchmark(
        "data_ingest",
        "S3 GET bursts at start and after a node loss (waves), data wait, prepare, duplicate reads under TP",
        "data_ingest.json",
        "--out",
        ("--only", "1"),
        smoke=("--smoke", "--out", "{out}"),
        smoke_timeout_s=1200,
    ),
    Benchmark(
        "data_bytes_per_host",
        "bytes read from storage per host at 4 and 8 hosts: row groups a host's replicas consume with their own "
        "metadata (index v3) vs after every shard's footer (v2) vs whole shards (v1)",
        "data_bytes_per_host.json",
        "--out",
        ("--hosts", "4", "--batches", "24", "--engine", "threads"),
        smoke=(
            *("--hosts", "4", "--batches", "6", "--engine", "threads", "--seq-len", "127"),
            *("--global-batch", "16", "--out", "{out}"),
        ),
        smoke_timeout_s=600,
    ),
    Benchmark(
        "sweep_vs_grid",
        "`elastic sweep` vs the exhaustive grid: best tokens/s found, search time, memory model error",
        "sweep_vs_grid.json",
        "--json",
        ("--trial-steps", "3", "--sweeps", "1"),
        smoke=("--smoke", "--trial-steps", "3", "--sweeps", "1", "--json", "{out}"),
        smoke_timeout_s=900,
    ),
    Benchmark(
        "engine_vs_torchtitan",
        "tokens/s, peak memory and MFU: our engine vs torchtitan on the same Llama 3",
        None,
        None,
        ("--steps", "3", "--warmup", "1", "--repeats", "1", "--seq", "256"),
        needs=(CUDA, TORCHTITAN),
    ),
    Benchmark(
        "gpu_check",
        "every device path on one GPU in one call (make gpu-check): gpu tests, engine tokens/s and MFU "
        "vs a plain loop, memory model vs CUDA peaks, a sweep with a real OOM, snapshot cost",
        "gpu_check.json",
        None,
        ("--dry-run",),
        smoke=("--dry-run", "--out", "{out_dir}"),
        smoke_timeout_s=300,
    ),
)

# Modules under benchmarks/ that are parts of a benchmark, not benchmarks themselves.
NOT_BENCHMARKS = ("catalog", "torchrun_ddp_baseline")  # the latter: overhead's baseline, run by torchrun


def by_name(names: list[str]) -> list[Benchmark]:
    """The benchmarks named, in catalog order; raises ValueError naming any unknown one."""
    known = {b.name: b for b in BENCHMARKS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; choose from {', '.join(known)}")
    return [b for b in BENCHMARKS if b.name in names]
