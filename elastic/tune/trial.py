"""Step 2 of a sweep: one Ray Tune trial runs one configuration as a real elastic job.

Tune reserves the trial's whole footprint as one placement group (``trial_resources``):
bundle 0 for this trainable (a sliver of a CPU), then one bundle per worker, replica after
replica. The job's worker group places its actors in those bundles (``TrialSlots``)
instead of asking Ray for placement groups of its own, so Tune knows every resource a
trial uses, trials never oversubscribe the cluster, and several run at once when they fit.
When Tune stops a trial (early stopping), its actor dies; the workers it owns die with it
and Tune removes the placement group.

Every committed step is reported to Tune: tokens/s (the mean over the steps after the
warm-up: step 1 allocates the optimizer state, and the first steps pay for allocation and
lazy initialisation), MFU on GPUs, the measured peak memory and the memory model's figure.
On CPU the peak is the live-tensor peak of step ``PROBE_STEP`` (``elastic/parallel/memtrack.py``;
``ru_maxrss`` would count the whole process); on CUDA ``max_memory_allocated``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from elastic.parallel.config import ParallelConfig
from elastic.parallel.memory_model import estimate_for_spec
from elastic.placement.slots import ReplicaSlots, group_tables
from elastic.tune.space import config_key, trial_spec_dict

if TYPE_CHECKING:
    from elastic.control.controller import Controller

DRIVER_CPU = 0.01  # bundle 0: the trainable (the job's driver); it only polls workers
PROBE_STEP = 2  # after step 1 created the optimizer state


class ProbedParallel(ParallelConfig):
    """``parallel`` plus the engine's memory-probe step (not a spec key)."""

    memory_probe_step: int | None = None


def worker_bundle(resources: Any) -> dict[str, float]:
    return ReplicaSlots(resources, 1).bundle()


def trial_resources(spec: Any, config: dict[str, Any]):
    """The ``PlacementGroupFactory`` of one configuration: the trainable, then every worker."""
    from ray.tune import PlacementGroupFactory

    world = config["dp"] * config["tp"] * config["pp"] * config.get("ep", 1) * config.get("cp", 1)
    tp_on_gpus = spec.resources.device == "cuda" and config["tp"] > 1
    return PlacementGroupFactory(
        [{"CPU": DRIVER_CPU}] + [worker_bundle(spec.resources)] * world,
        strategy="STRICT_PACK" if tp_on_gpus else "PACK",
    )


class _Slice:
    """One replica's bundles inside the trial's placement group."""

    def __init__(self, first: int):
        self.first = first


class TrialSlots(ReplicaSlots):
    """Replica slots carved out of the trial's placement group (Tune owns and removes it)."""

    def __init__(self, resources: Any, replica_size: int, pg: Any, dp: int):
        super().__init__(resources, replica_size)
        self.pg = pg
        self._groups = [_Slice(1 + i * replica_size) for i in range(dp)]

    def request(self, total: int) -> None:  # the capacity is the trial's, all there from the start
        return None

    def ready(self, timeout: float = 0.0) -> list[Any]:
        return list(self._groups)

    def release(self, group: Any) -> None:
        if group in self._groups:
            self._groups.remove(group)

    def actor_options(self, group: Any, bundle_index: int) -> dict[str, Any]:
        return super().actor_options(self.pg, group.first + bundle_index)

    def bundle_nodes(self, groups: Sequence[Any]) -> list[str]:
        where = group_tables([self.pg])[self.pg.id.hex()].get("bundles_to_node_id") or {}
        return [where[g.first + b] for g in groups for b in range(self.replica_size) if g.first + b in where]


def _controller_for(pg: Any, dp: int, listener: Any) -> type[Controller]:
    # Imported here: the rest of this module (the trial's spec, metrics and status) is also
    # used without Ray, by the GPU check (benchmarks/gpu_check/sweep.py).
    from elastic.control.controller import Controller
    from elastic.control.worker_group import WorkerGroup

    class _TrialGroup(WorkerGroup):
        def __init__(self, spec: Any, *args: Any, **kwargs: Any):
            super().__init__(spec, *args, **kwargs)
            self.slots = TrialSlots(spec.resources, self.replica_size, pg, dp)

    class _TrialController(Controller):
        worker_group_cls = _TrialGroup

        def __init__(self, spec: Any, events: Any, *args: Any, **kwargs: Any):
            events.subscribe(listener)
            super().__init__(spec, events, *args, **kwargs)

    return _TrialController


def build_trial_spec(ctx: dict[str, Any], config: dict[str, Any]):
    """The job a trial runs: the user's spec at this configuration, for ``trial_steps`` steps,
    at exactly the sweep's DP, failing at the first failure, without storage checkpoints."""
    raw = trial_spec_dict(_Spec(ctx["spec"]), config)
    raw["name"] = f"{raw.get('name', 'job')}-{config_key(config)}"
    raw["run_dir"] = None
    raw["train"]["steps"] = ctx["trial_steps"]
    raw["elastic"].update(min_dp=config["dp"], max_dp=config["dp"], max_failures=0, min_dp_wait_s=60.0)
    raw["checkpoint"]["every_steps"] = 0
    if ctx.get("corpus_cache"):
        raw["data"]["cache_dir"] = ctx["corpus_cache"]
    spec = ctx["spec_cls"].from_dict(raw)  # jobs.JobSpec, passed in (elastic does not import jobs)
    if spec.resources.device == "cpu":
        spec.parallel = ProbedParallel(**spec.parallel.model_dump(), memory_probe_step=PROBE_STEP)
    return spec


class _Spec:
    """Just enough of a JobSpec for ``trial_spec_dict`` from a plain dict."""

    def __init__(self, raw: dict[str, Any]):
        self._raw = raw

    def model_dump(self, by_alias: bool = True) -> dict[str, Any]:
        import copy

        return copy.deepcopy(self._raw)


def trial_status(reason: str) -> str:
    """A failed trial's status: ``oom`` when it ran out of device memory, else ``failed``.

    ``reason`` is what the workers reported (``TypeName: message``): a CUDA
    ``torch.OutOfMemoryError`` is a result of the sweep (the configuration does not fit),
    not an error of the trial.
    """
    return "oom" if ("OutOfMemoryError" in reason or "out of memory" in reason.lower()) else "failed"


class _Reporter:
    """An ``EventLog`` listener: every committed step becomes one Tune report (or, given
    ``report``, one call of it: the GPU check runs the trial body without Tune)."""

    def __init__(
        self, ctx: dict[str, Any], config: dict[str, Any], predicted: int | None, t0: float, report: Any = None
    ):
        self.ctx, self.config, self.predicted, self.t0 = ctx, config, predicted, t0
        self.report = report
        self.world = config["dp"] * config["tp"] * config["pp"] * config.get("ep", 1) * config.get("cp", 1)
        self.tps: list[float] = []
        self.step_s: list[float] = []
        self.mfu: list[float] = []
        self.peak = 0
        self.failures: list[str] = []
        self.last_step = 0

    def __call__(self, event: dict[str, Any]) -> None:
        if event["kind"] == "failure":
            self.failures.append(f"{event['cause']}: {event['detail']}")
        if event["kind"] != "step":
            return
        step = event["step"]
        self.last_step = step
        if step > self.ctx["warmup_steps"]:
            self.tps.append(event["tokens_per_s"])
            self.step_s.append(event["step_time_s"])
            if event.get("mfu") is not None:
                self.mfu.append(event["mfu"])
        if step >= PROBE_STEP or self.ctx["device"] == "cuda":
            self.peak = max(self.peak, int(event.get("peak_mem_bytes") or 0))
        metrics = self.metrics(step, "ok" if step >= self.ctx["trial_steps"] else "running")
        if self.report is not None:
            self.report(metrics)
        else:
            from ray import tune

            tune.report(metrics)

    def metrics(self, step: int, status: str, reason: str = "") -> dict[str, Any]:
        tps = sum(self.tps) / len(self.tps) if self.tps else 0.0
        return {
            "step": step,
            "status": status,
            "reason": reason,
            "tokens_per_s": tps,
            "tokens_per_s_per_worker": tps / self.world,
            "step_time_s": sum(self.step_s) / len(self.step_s) if self.step_s else 0.0,
            "measured_steps": len(self.tps),
            "mfu": sum(self.mfu) / len(self.mfu) if self.mfu else None,
            "peak_mem_bytes": self.peak or None,
            "predicted_mem_bytes": self.predicted,
            "trial_s": time.monotonic() - self.t0,
        }


def run_trial(config: dict[str, Any], ctx: dict[str, Any]) -> None:
    """The Tune trainable: run ``config['cfg']`` as an elastic job of ``ctx['trial_steps']`` steps."""
    import ray
    from ray import tune

    from elastic.api import ElasticTrainer

    t0 = time.monotonic()
    cfg = config["cfg"]
    reporter = _Reporter(ctx, cfg, None, t0)
    try:
        spec = build_trial_spec(ctx, cfg)
        reporter.predicted = estimate_for_spec(spec, cfg["dp"], dtype_bytes=4).total
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError("a trial must run in its Tune placement group (trial_resources)")
        hooks = [h for match, h in ctx.get("faults", []) if all(cfg.get(k) == v for k, v in match.items())]
        trainer = ElasticTrainer(
            spec,
            run_dir=os.path.join(ctx["out"], "trials", config_key(cfg)),
            step_hook=hooks[0] if hooks else None,
        )
        trainer.controller_cls = _controller_for(pg, cfg["dp"], reporter)
        trainer.fit()
    except Exception as exc:  # a failed trial is a result, not an error of the sweep
        reason = "; ".join(reporter.failures) or f"{type(exc).__name__}: {exc}"
        status = trial_status(reason)
        tune.report(reporter.metrics(reporter.last_step, status, " ".join(reason.split())[:500]))
