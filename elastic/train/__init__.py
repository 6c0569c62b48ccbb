"""Ray Train V2's public names on this platform (DESIGN.md §11; docs/train_api.md): a
script written for Ray Train runs elastic when every ``ray.train`` in it is replaced by
``elastic.train``.

A ``TrainConfigError`` (a field of the run's configuration is wrong) that the script does
not catch ends it with one line naming the field and exit status 2, as the CLI's errors do.
"""

import sys as _sys

from elastic.train import torch
from elastic.train.checkpoint import Checkpoint
from elastic.train.config import (
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    TrainConfigError,
)
from elastic.train.result import Result
from elastic.train.session import TrainContext, get_checkpoint, get_context, get_dataset_shard, report
from elastic.train.torch.trainer import TrainingFailedError

_previous_hook = _sys.excepthook


def _excepthook(kind, exc, tb):
    if isinstance(exc, TrainConfigError):
        import os

        print(f"error: {exc}", file=_sys.stderr, flush=True)
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            _sys.stdout.flush()
            os._exit(2)
    _previous_hook(kind, exc, tb)


_sys.excepthook = _excepthook

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "DataConfig",
    "FailureConfig",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TrainConfigError",
    "TrainContext",
    "TrainingFailedError",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
    "torch",
]
