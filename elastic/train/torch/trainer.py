"""``TorchTrainer``: a user's loop on this platform's elastic runtime, with Ray Train's API.

``fit()`` checks everything that can be checked before an actor starts (each failure one
line naming the field: ``TrainConfigError``, which an uncaught script reports in one line
with exit 2), joins the Ray cluster the script is connected to (or ``RAY_ADDRESS``, or
starts an embedded one as ``elastic run`` does), and hands the run to ``LoopDriver``
(``elastic/train/driver.py``). The run's files (``events.jsonl``, ``summary.json``, as
``elastic run`` writes them) and its checkpoints are under ``storage_path/name``.

A ``TorchTrainer`` is a Tune trainable: ``Tuner(trainer, param_space={"train_loop_config":
{...}})`` calls it with each trial's config (``__call__``), which runs the trial's own
elastic fit and reports its final metrics to Tune.
"""

from __future__ import annotations

import datetime
import inspect
import os
import tempfile
from collections.abc import Callable
from typing import Any

from elastic.train.checkpoint import Checkpoint
from elastic.train.config import (
    KNOWN_RESOURCES,
    DataConfig,
    RunConfig,
    ScalingConfig,
    TrainConfigError,
    check_writable,
)
from elastic.train.result import Result


class TrainingFailedError(RuntimeError):
    """The run failed; ``__cause__`` (when it can be rebuilt) is the loop's own exception."""


class TorchTrainer:
    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        torch_config: Any = None,
        resume_from_checkpoint: Checkpoint | None = None,
        metadata: dict[str, Any] | None = None,
    ):
        _check_loop(train_loop_per_worker)
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise TrainConfigError(f"TorchTrainer.train_loop_config: a dict, got {type(train_loop_config).__name__}")
        if scaling_config is None:
            scaling_config = ScalingConfig()
        if not isinstance(scaling_config, ScalingConfig):
            raise TrainConfigError(
                f"TorchTrainer.scaling_config: an elastic.train.ScalingConfig, got {type(scaling_config).__name__}"
            )
        if run_config is not None and not isinstance(run_config, RunConfig):
            raise TrainConfigError(
                f"TorchTrainer.run_config: an elastic.train.RunConfig, got {type(run_config).__name__}"
            )
        if datasets is not None:
            if not isinstance(datasets, dict):
                raise TrainConfigError(f"TorchTrainer.datasets: a dict of Ray Datasets, got {type(datasets).__name__}")
            for key, ds in datasets.items():
                if not _is_ray_dataset(ds):
                    raise TrainConfigError(
                        f"TorchTrainer.datasets[{key!r}]: a ray.data.Dataset, got {type(ds).__name__}"
                    )
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.scaling_config = scaling_config
        self.run_config = run_config or RunConfig()
        self.datasets = dict(datasets or {})
        self.dataset_config = dataset_config or DataConfig()
        self.metadata = metadata

    # ------------------------------------------------------------------ fit
    def fit(self) -> Result:
        from elastic.train.callbacks import LoopCallbacks, RunContext, check_callbacks
        from elastic.train.driver import LoopDriver
        from elastic.train.loop_record import Job

        run = self.run_config
        check_callbacks(run.callbacks or [])
        name = run.name or f"TorchTrainer_{datetime.datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}"
        storage = run.resolved_storage_path()
        check_writable(storage)
        storage_dir = storage.rstrip("/") + "/" + name
        local = "://" not in storage or storage.startswith("file://")
        run_dir = storage_dir.removeprefix("file://") if local else tempfile.mkdtemp(prefix=f"elastic-{name}-")
        os.makedirs(run_dir, exist_ok=True)
        _connect(self.scaling_config)
        self._check_cluster()
        datasets = {k: (_blocks(ds), self.dataset_config.splits(k)) for k, ds in self.datasets.items()}
        sc = self.scaling_config
        cc = run.checkpoint_config
        fc = run.failure_config
        assert cc is not None and fc is not None
        job = Job(
            fn=self.train_loop_per_worker,
            config=self.train_loop_config,
            min_workers=sc.min_workers,
            max_workers=sc.max_workers,
            resources=sc.worker_resources(),
            use_gpu=sc.use_gpu,
            placement_strategy=sc.placement_strategy,
            max_failures=fc.max_failures,
            num_to_keep=cc.num_to_keep,
            score_attribute=cc.checkpoint_score_attribute,
            score_order=cc.checkpoint_score_order,
            name=name,
            trial_name=None,
            storage_dir=storage_dir,
            run_dir=run_dir,
            datasets=datasets,
            callbacks=LoopCallbacks(
                run.callbacks,
                RunContext(run, self.train_loop_config, sc, self.dataset_config),
                progress=run.verbose != 0,
                tensorboard_dir=os.path.join(run_dir, "tensorboard"),
            ),
        )
        out = LoopDriver(job).run()
        committed = out["committed"]
        best = [(Checkpoint(c["path"]), c["metrics"]) for c in committed]
        history = [{k: v for k, v in m.items() if not k.startswith("_")} for m in out["metrics"]]
        result = Result(
            metrics=history[-1] if history else {},
            checkpoint=best[-1][0] if best else None,
            error=out["error"],
            path=storage_dir,
            best_checkpoints=best,
            metrics_history=history,
            return_values=out["values"],
        )
        self.last_run = out
        if out["error"] is not None:
            cause = getattr(out["error"], "error", None)
            raise TrainingFailedError(str(out["error"])) from cause
        return result

    def _check_cluster(self) -> None:
        import ray

        have = ray.cluster_resources()
        for key in self.scaling_config.worker_resources():
            if key not in KNOWN_RESOURCES and key not in have:
                raise TrainConfigError(
                    f"ScalingConfig.resources_per_worker[{key!r}]: no node of the cluster has this resource "
                    f"(it has: {', '.join(sorted(k for k in have if not k.startswith('node:')))})"
                )
        if self.scaling_config.use_gpu and have.get("GPU", 0) < 1:
            raise TrainConfigError("ScalingConfig.use_gpu: the Ray cluster has no GPU")

    # ------------------------------------------------------------------ Tune
    def __call__(self, config: dict[str, Any]) -> None:
        """One Tune trial: this trainer with the trial's ``train_loop_config`` (merged over
        the trainer's own) and, when given, its ``scaling_config``, fitted as an elastic run
        of its own (``storage_path/<name>_<trial id>``), its final metrics reported to Tune."""
        from ray import tune

        trial_id = tune.get_context().get_trial_id()
        loop_config, scaling = self._trial_fields(config)
        trial = TorchTrainer(
            self.train_loop_per_worker,
            train_loop_config={**(self.train_loop_config or {}), **loop_config},
            scaling_config=scaling,
            run_config=RunConfig(
                name=f"{self.run_config.name or 'TorchTrainer'}_{trial_id}",
                storage_path=self.run_config.storage_path,
                failure_config=self.run_config.failure_config,
                checkpoint_config=self.run_config.checkpoint_config,
            ),
            datasets=self.datasets,
            dataset_config=self.dataset_config,
        )
        result = trial.fit()
        tune.report(dict(result.metrics or {}))

    def _trial_fields(self, config: dict[str, Any]) -> tuple[dict[str, Any], ScalingConfig]:
        unknown = sorted(set(config) - {"train_loop_config", "scaling_config"})
        if unknown:
            raise TrainConfigError(
                f"param_space[{unknown[0]!r}]: a TorchTrainer trial takes train_loop_config and scaling_config"
            )
        loop_config = config.get("train_loop_config") or {}
        if not isinstance(loop_config, dict):
            raise TrainConfigError(f"param_space['train_loop_config']: a dict, got {type(loop_config).__name__}")
        scaling = config.get("scaling_config", self.scaling_config)
        if not isinstance(scaling, ScalingConfig):
            raise TrainConfigError(
                f"param_space['scaling_config']: an elastic.train.ScalingConfig, got {type(scaling).__name__}"
            )
        return dict(loop_config), scaling

    def _trial_resources(self, config: dict[str, Any]) -> Any:
        """What Tune reserves for one trial (read by Tune as ``_resources``): a bundle for
        the trial's driver (1 CPU) and one per worker, ``max`` of them: the trial's workers
        start inside its reservation (Tune places a trial's actors there)."""
        from ray.tune import PlacementGroupFactory

        _, scaling = self._trial_fields(config)
        worker = scaling.worker_resources()
        return PlacementGroupFactory([{"CPU": 1.0}] + [worker] * scaling.max_workers, strategy="PACK")

    @property
    def _resources(self) -> Any:  # Tune's function-trainable hook (``tune.with_resources`` sets it)
        return self.__dict__.get("_resources_override", self._trial_resources)

    @_resources.setter
    def _resources(self, value: Any) -> None:
        self.__dict__["_resources_override"] = value

    @property
    def __name__(self) -> str:  # Tune names a function trainable by it
        return "TorchTrainer"


def _check_loop(fn: Any) -> None:
    if not callable(fn):
        raise TrainConfigError(f"TorchTrainer.train_loop_per_worker: a function, got {type(fn).__name__}")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    required_kw = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) > 1 or required_kw:
        names = ", ".join(p.name for p in [*required, *required_kw])
        raise TrainConfigError(
            f"TorchTrainer.train_loop_per_worker: takes no argument or one (the config), not ({names})"
        )


def _is_ray_dataset(ds: Any) -> bool:
    try:
        from ray.data import Dataset
    except ImportError:
        return False
    return isinstance(ds, Dataset)


def _blocks(ds: Any) -> list[tuple[Any, int]]:
    """The dataset's rows, in a fixed order, as blocks in the object store."""
    import ray

    return [(ray.put(t), t.num_rows) for t in ds.iter_batches(batch_size=4096, batch_format="pyarrow") if t.num_rows]


def _connect(scaling: ScalingConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    from elastic import ray_join

    cpus = max(os.cpu_count() or 1, int(scaling.max_workers * scaling.worker_resources().get("CPU", 1.0)) + 1)
    ray_join.connect(ray_join.resolve(None), ray_join.embedded(cpus))
