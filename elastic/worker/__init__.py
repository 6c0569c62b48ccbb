"""One rank of the job, in three layers (see each module's docstring):

- ``trainer.py``: the training loop, with no Ray in it;
- ``process_group.py``: the process group re-formed generation after generation, and every
  private torch call;
- ``actor.py``: the Ray actor, typed RPCs only.

The actor is imported lazily, so that ``elastic.worker.trainer`` and its neighbours import
where Ray is not installed (a GPU machine running ``make gpu-check``).
"""

from elastic.worker.rng import capture_rng, restore_rng

__all__ = ["CONCURRENCY_GROUPS", "TrainWorker", "capture_rng", "restore_rng"]


def __getattr__(name: str):
    if name in ("CONCURRENCY_GROUPS", "TrainWorker"):
        from elastic.worker import actor

        return getattr(actor, name)
    raise AttributeError(name)
