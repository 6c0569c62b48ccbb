"""The run's configuration, with Ray Train V2's names and defaults (``ray.train``).

Each class checks its own fields when made and names the field in a one-line
``ValueError``; ``TorchTrainer`` checks what needs the cluster (resources, storage) before
any actor starts (``elastic/train/trainer.py``).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any


class TrainConfigError(ValueError):
    """A field of the run's configuration is wrong: one line naming it. A script that does
    not catch it ends with that line and exit status 2 (``elastic/train/__init__.py``)."""


KNOWN_RESOURCES = ("CPU", "GPU", "memory")  # besides the cluster's custom resources
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ScalingConfig:
    """``num_workers``: an int (a fixed size) or ``(min, max)`` (elastic between the two)."""

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    placement_strategy: str = "PACK"

    def __post_init__(self) -> None:
        n = self.num_workers
        if isinstance(n, list):
            n = self.num_workers = (n[0], n[1]) if len(n) == 2 else n
        if isinstance(n, bool) or not isinstance(n, (int, tuple)):
            raise TrainConfigError(f"ScalingConfig.num_workers: an int or a (min, max) pair, got {n!r}")
        if isinstance(n, tuple):
            if len(n) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in n):
                raise TrainConfigError(f"ScalingConfig.num_workers: a (min, max) pair of ints, got {n!r}")
            if n[0] < 1 or n[0] > n[1]:
                raise TrainConfigError(f"ScalingConfig.num_workers: need 1 <= min <= max, got {n!r}")
        elif n < 1:
            raise TrainConfigError(f"ScalingConfig.num_workers: must be at least 1, got {n}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise TrainConfigError(
                f"ScalingConfig.placement_strategy: one of {', '.join(PLACEMENT_STRATEGIES)}, "
                f"got {self.placement_strategy!r}"
            )
        for key, value in (self.resources_per_worker or {}).items():
            if not isinstance(value, (int, float)) or value < 0:
                raise TrainConfigError(f"ScalingConfig.resources_per_worker[{key!r}]: a number >= 0, got {value!r}")

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def elasticity_enabled(self) -> bool:
        return self.min_workers != self.max_workers

    def worker_resources(self) -> dict[str, float]:
        """One worker's Ray resources: ``resources_per_worker``, else 1 CPU (and 1 GPU with ``use_gpu``)."""
        res = dict(self.resources_per_worker or {})
        if not res:
            res = {"CPU": 1.0}
        if self.use_gpu and "GPU" not in res:
            res["GPU"] = 1.0
        return {k: float(v) for k, v in res.items()}


@dataclass
class FailureConfig:
    """``max_failures``: recoveries allowed (a lost worker or node each); -1 for no limit."""

    max_failures: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_failures, bool) or not isinstance(self.max_failures, int) or self.max_failures < -1:
            raise TrainConfigError(f"FailureConfig.max_failures: an int >= -1, got {self.max_failures!r}")


@dataclass
class CheckpointConfig:
    """``num_to_keep``: committed checkpoints kept in storage (None: all)."""

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"

    def __post_init__(self) -> None:
        k = self.num_to_keep
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise TrainConfigError(f"CheckpointConfig.num_to_keep: None or an int >= 1, got {k!r}")
        if self.checkpoint_score_order not in ("max", "min"):
            raise TrainConfigError(
                f"CheckpointConfig.checkpoint_score_order: 'max' or 'min', got {self.checkpoint_score_order!r}"
            )


@dataclass
class RunConfig:
    """Where the run lives: ``storage_path/name`` holds its checkpoints and run files."""

    name: str | None = None
    storage_path: str | None = None
    failure_config: FailureConfig | None = None
    checkpoint_config: CheckpointConfig | None = None
    callbacks: list[Any] | None = None
    verbose: int | None = None

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name or "/" in self.name):
            raise TrainConfigError(f"RunConfig.name: a non-empty name without '/', got {self.name!r}")
        if self.storage_path is not None and not isinstance(self.storage_path, str):
            self.storage_path = os.fspath(self.storage_path)
        self.failure_config = self.failure_config or FailureConfig()
        self.checkpoint_config = self.checkpoint_config or CheckpointConfig()
        self.callbacks = list(self.callbacks or [])

    def resolved_storage_path(self) -> str:
        """``storage_path``, else ``~/ray_results`` as Ray Train (a local path made absolute)."""
        path = self.storage_path or os.path.join(os.path.expanduser("~"), "ray_results")
        return path if "://" in path else os.path.abspath(os.path.expanduser(path))


@dataclass
class DataConfig:
    """Which datasets are split between the workers (all of them by default), as Ray Train's."""

    datasets_to_split: str | list[str] = "all"
    extra: dict[str, Any] = field(default_factory=dict)

    def splits(self, name: str) -> bool:
        return self.datasets_to_split == "all" or name in self.datasets_to_split


def check_writable(storage_path: str) -> None:
    """A local ``storage_path`` must be creatable and writable (one line naming the field)."""
    if "://" in storage_path and not storage_path.startswith("file://"):
        return
    path = storage_path.removeprefix("file://")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise TrainConfigError(f"RunConfig.storage_path: {path!r} cannot be written ({exc.strerror or exc})") from None
