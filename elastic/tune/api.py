"""``elastic.sweep(spec, space=...)``: prune, measure with Ray Tune, report (docs/sweep.md)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.tune import Callback

from elastic import ray_join
from elastic.errors import SpecError
from elastic.ingest.preflight import check_corpus
from elastic.run_dirs import make_private_dir
from elastic.tune import report as rep
from elastic.tune.space import Cluster, config_key, default_space, enumerate_space, parse_space
from elastic.tune.trial import DRIVER_CPU, run_trial, trial_resources, worker_bundle

if TYPE_CHECKING:
    from elastic.spec import JobSpec

METRIC = "tokens_per_s"
WARMUP_STEPS = 2


@dataclass
class SweepOutcome:
    grid: Any  # ray.tune.ResultGrid (None when nothing was launched)
    entries: list[dict[str, Any]]
    out: str
    best: dict[str, Any] | None
    wall_s: float
    files: dict[str, str] = field(default_factory=dict)


def sweep(spec: Any, space: dict[str, list[Any]] | None = None, **kwargs: Any):
    """Run a sweep and write its files; returns the ``ray.tune.ResultGrid`` of the trials.

    Keyword arguments: see :func:`run_sweep`. The experiment lives in ``<out>/tune`` and
    can be restored with ``ray.tune.Tuner.restore(path, trainable=restore_trainable(out))``.
    """
    return run_sweep(spec, space, **kwargs).grid


def run_sweep(
    spec: Any,
    space: dict[str, list[Any]] | None = None,
    *,
    trial_steps: int = 10,
    max_trials: int | None = None,
    exhaustive: bool = False,
    memory_per_worker_gb: float | None = None,
    out: str | None = None,
    address: str | None = None,
    warmup_steps: int = WARMUP_STEPS,
    refine_groups: int | None = None,
    grace_period: int | None = None,
    reduction_factor: int = 3,
    faults: list[tuple[dict[str, Any], Any]] | None = None,
    worker_slots: int | None = None,
    progress: bool = False,
) -> SweepOutcome:
    """``faults``: ``(match, step_hook)`` pairs; a trial whose configuration contains every item
    of ``match`` runs with that ``StepHook`` (``elastic/worker/hooks.py``; fault injection:
    ``elastic.faults.WorkerFaults``), the first match only.
    ``worker_slots`` sizes the embedded cluster (default ``elastic.max_dp`` replicas of the spec's layout)."""
    if trial_steps <= warmup_steps:
        raise SpecError("--trial-steps", f"must be larger than the {warmup_steps} warm-up steps, got {trial_steps}")
    if max_trials is not None and max_trials < 1:
        raise SpecError("--max-trials", f"must be >= 1, got {max_trials}")
    if memory_per_worker_gb is not None and not (0 < memory_per_worker_gb < math.inf):  # NaN: pruning disabled
        raise SpecError("--memory-per-worker-gb", f"must be a finite number > 0, got {memory_per_worker_gb}")
    raw_spec = spec.model_dump(by_alias=True)
    parsed = parse_space(space, spec) if space is not None else None
    out = os.path.abspath(out or _default_out(spec.name))
    if os.path.exists(os.path.join(out, "sweep.json")):  # its trials' run directories would be refused one by one
        raise SpecError("--out", f"{out} holds another sweep; choose a new --out")
    check_corpus(spec.data, spec.model.seq_len, spec.model.vocab_size)
    target = None if ray.is_initialized() else ray_join.resolve(address)
    make_private_dir(out, "--out")  # 0750, as a run dir
    started = _connect(target, spec, worker_slots)
    t0 = time.monotonic()
    try:
        cluster = cluster_facts(spec, memory_per_worker_gb, worker_slots if started else None)
        parsed = parsed if parsed is not None else default_space(spec, cluster)
        candidates = enumerate_space(spec, parsed, cluster)
        feasible = [c for c in candidates if c.status == "feasible"]
        _say(progress, _pruning_line(candidates, cluster))
        ctx = {
            "spec": raw_spec,
            "spec_cls": type(spec),
            "trial_steps": trial_steps,
            "warmup_steps": warmup_steps,
            "out": out,
            "device": spec.resources.device,
            "corpus_cache": _prepare_corpus(spec, out),
            "faults": [(dict(m), hook) for m, hook in faults or []],
        }
        plain = dict(
            ctx,
            faults=[m for m, _ in ctx["faults"]],  # the hooks are objects: their matches only
            spec_cls=None,
            spec=rep.without_storage_options(raw_spec)[0],  # no credentials in a file
        )
        record = {"context": plain, "space": parsed, "exhaustive": exhaustive}
        rep.write_private(os.path.join(out, "sweep.json"), json.dumps(record, indent=2, default=str))
        grid = None
        by_key: dict[str, Any] = {}
        if feasible:
            grid = _tune(
                spec, ctx, [c.config for c in feasible], exhaustive, max_trials, refine_groups,
                grace_period or min(trial_steps, warmup_steps + 2), reduction_factor, progress,
            )  # fmt: skip
            by_key = {config_key(r.config["cfg"]): r for r in grid if r.config and "cfg" in r.config}
        entries = []
        for c in candidates:
            result = by_key.get(c.key)
            entry = rep.entry_from_result(c, result, trial_steps)
            if c.status == "feasible" and result is None:
                entry["status"] = "stopped_early"
                entry["reason"] = "not launched: the search measured other configurations of this group instead"
                if max_trials is not None:
                    entry["reason"] = f"not launched: --max-trials {max_trials} reached or not chosen by the search"
            entries.append(entry)
        wall = time.monotonic() - t0
        best = rep.best_entry(entries)
        files = {"results": rep.write_results(out, entries)}
        if best is not None:
            files["best"] = rep.write_best(out, spec, best)
        files["heatmap"] = rep.write_heatmap(out, entries)
        return SweepOutcome(grid, entries, out, best, wall, files)
    finally:
        if started:
            ray.shutdown()


def restore_trainable(out: str, spec_cls: type[JobSpec], spec: JobSpec | None = None):
    """The trainable (with its resources) of the sweep in ``out``, for ``Tuner.restore``;
    ``spec_cls`` is ``jobs.JobSpec``. ``sweep.json`` holds no credentials: a sweep whose
    spec had ``storage_options`` is restored with ``spec``, the user's own, to take them from."""
    from ray import tune

    with open(os.path.join(out, "sweep.json")) as f:
        ctx = json.load(f)["context"]
    ctx["faults"] = []  # step hooks are not restored
    ctx["spec_cls"] = spec_cls
    if spec is not None:
        given = spec.model_dump(by_alias=True)
        for section, body in ctx["spec"].items():
            if isinstance(body, dict) and "storage_options" in body and isinstance(given.get(section), dict):
                body["storage_options"] = given[section].get("storage_options", {})
    restored = spec_cls.from_dict(ctx["spec"])
    return tune.with_resources(
        tune.with_parameters(run_trial, ctx=ctx), resources=lambda config: trial_resources(restored, config["cfg"])
    )


def _tune(spec, ctx, configs, exhaustive, max_trials, refine_groups, grace, rf, progress):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from elastic.tune.search import StagedSearch

    trainable = tune.with_resources(
        tune.with_parameters(run_trial, ctx=ctx), resources=lambda config: trial_resources(spec, config["cfg"])
    )
    if exhaustive:
        chosen = configs[:max_trials] if max_trials else configs
        param_space = {"cfg": tune.grid_search(chosen)}
        tune_config = tune.TuneConfig(metric=METRIC, mode="max", scheduler=FIFOScheduler(), reuse_actors=False)
    else:
        param_space = {}
        tune_config = tune.TuneConfig(
            metric=METRIC,
            mode="max",
            search_alg=StagedSearch(configs, max_trials, refine_groups, metric=METRIC, mode="max"),
            scheduler=ASHAScheduler(
                time_attr="training_iteration", max_t=ctx["trial_steps"], grace_period=grace, reduction_factor=rf
            ),
            num_samples=-1,
            reuse_actors=False,
        )
    run_config = tune.RunConfig(
        name="tune",
        storage_path=ctx["out"],
        verbose=0,
        callbacks=[_Progress(len(configs), exhaustive)] if progress else [],
    )
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # the classic reporter honours verbose=0: no banner
    tuner = tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config)
    return tuner.fit()


def _connect(target: ray_join.Target | None, spec: Any, worker_slots: int | None) -> bool:
    """Join ``target`` (``ray_join.resolve(--address)``), else start an embedded cluster sized
    to the sweep; True if started here. None: already connected."""
    if target is None:
        return False
    workers = worker_slots or spec.elastic.max_dp * spec.parallel.replica_size
    r = spec.resources
    embedded = ray_join.embedded(
        math.ceil(workers * r.cpus_per_worker + 1),
        num_gpus=int(math.ceil(workers * r.gpus_per_worker)) or None,
        resources={k: v * workers for k, v in r.custom.items()} or None,
    )
    return ray_join.connect(target, embedded)


def cluster_facts(spec: Any, memory_per_worker_gb: float | None, embedded_slots: int | None = None) -> Cluster:
    """Worker slots of the live cluster, per node and in all, and the memory budget."""
    bundle = worker_bundle(spec.resources)
    per_node = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        slots = min(int(have.get(k, 0) // v) if v > 0 else 10**6 for k, v in bundle.items())
        per_node.append(slots)
    total = sum(per_node)
    cpus = sum(n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive"))
    if cpus - total * bundle.get("CPU", 0) < DRIVER_CPU:
        total -= 1  # room for the trial's own bundle
    if embedded_slots is not None:
        total = min(total, embedded_slots)
    node_slots = min(max(per_node, default=0), total)
    if memory_per_worker_gb is not None:
        budget = memory_per_worker_gb * (1 << 30)
    elif spec.resources.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SpecError("--memory-per-worker-gb", "required: the driver sees no CUDA device to read its memory")
        budget = torch.cuda.get_device_properties(0).total_memory
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = ram / max(1, node_slots)
    return Cluster(max(0, total), max(0, node_slots), float(budget), spec.resources.device)


def _prepare_corpus(spec: Any, out: str) -> str | None:
    """Write the synthetic corpus once for every trial."""
    if spec.data.source != "synthetic":
        return None
    from elastic.ingest.corpus import synthetic_corpus

    cache = spec.data.cache_dir or os.path.join(out, "data")
    m = spec.model
    synthetic_corpus(cache, spec.data.num_samples, m.seq_len, m.vocab_size, spec.seed)
    return cache


def _pruning_line(candidates, cluster: Cluster) -> str:
    counts: dict[str, int] = {}
    for c in candidates:
        counts[c.status] = counts.get(c.status, 0) + 1
    parts = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    return (
        f"sweep: {len(candidates)} configurations ({parts}) on {cluster.worker_slots} worker slots "
        f"({cluster.slots_per_node} per node), memory budget {cluster.memory_per_worker_bytes / (1 << 30):.2f} GiB"
        " per worker"
    )


def _say(on: bool, text: str) -> None:
    if on:
        print(text, flush=True)


def _default_out(name: str) -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return os.path.join("sweeps", f"{name}-{stamp}")


class _Progress(Callback):
    """Live progress: one line per finished trial."""

    def __init__(self, feasible: int, exhaustive: bool):
        self.feasible, self.done = feasible, 0

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._line(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._line(trial)

    def _line(self, trial) -> None:
        self.done += 1
        m = trial.last_result or {}
        cfg = (trial.config or {}).get("cfg")
        name = config_key(cfg) if cfg else trial.trial_id
        tps = m.get("tokens_per_s")
        print(
            f"  trial {self.done:>3} {name:<28} {m.get('status', 'error'):<8} step {m.get('step', 0):>3} "
            f"{(tps or 0):>9.0f} tokens/s  {(m.get('trial_s') or 0):6.1f}s",
            file=sys.stdout,
            flush=True,
        )
