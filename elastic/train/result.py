"""``Result``: what ``TorchTrainer.fit`` returns, with Ray Train's fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elastic.train.checkpoint import Checkpoint


@dataclass
class Result:
    """``metrics``: rank 0's last report; ``checkpoint``: the newest committed one;
    ``best_checkpoints``: every kept one with its report's metrics; ``path``: the run's
    directory (``storage_path/name``); ``error``: why the run failed (None when it finished)."""

    metrics: dict[str, Any] | None
    checkpoint: Checkpoint | None
    error: BaseException | None
    path: str
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    return_values: list[Any] = field(default_factory=list)  # each rank's loop's return value

    @property
    def metrics_dataframe(self) -> Any:
        import pandas as pd  # type: ignore[import-untyped]

        return pd.DataFrame(self.metrics_history)

    @property
    def config(self) -> dict[str, Any] | None:
        return None

    def __repr__(self) -> str:
        return f"Result(metrics={self.metrics}, path={self.path!r}, checkpoint={self.checkpoint}, error={self.error!r})"
