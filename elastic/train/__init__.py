"""Ray Train V2's public names on this platform (DESIGN.md §11; issue 46): the configuration,
``Checkpoint`` and the loop's session functions. ``TorchTrainer`` and ``elastic.train.torch``
are not built yet."""

from elastic.train.checkpoint import Checkpoint
from elastic.train.config import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from elastic.train.session import TrainContext, get_checkpoint, get_context, get_dataset_shard, report

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "DataConfig",
    "FailureConfig",
    "RunConfig",
    "ScalingConfig",
    "TrainContext",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
]
