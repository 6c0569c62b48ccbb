"""One rank of the job, in four layers (see each module's docstring):

- ``trainer.py``: the training loop, with no Ray in it;
- ``process_group.py``: the process group re-formed generation after generation, and every
  private torch call;
- ``actor.py``: the rank's typed RPCs (``Rank``);
- ``remote.py``: the Ray actor ``TrainWorker``, a shell over ``Rank`` that names nothing
  heavy, so that a process handed its handle (a node agent) does not import torch.

The actor is imported lazily, so that ``elastic.worker.trainer`` and its neighbours import
where Ray is not installed (a GPU machine running ``make gpu-check``).

This package is the first of a rank's modules that a Ray worker imports (``TrainWorker``'s
``__init__`` imports ``actor.py``), so it leaves Ray's worker niceness here, before anything
heavy (torch) is imported: see ``elastic.priority.leave_ray_worker_niceness``.
"""

from elastic import priority

priority.leave_ray_worker_niceness()

__all__ = ["CONCURRENCY_GROUPS", "TrainWorker", "capture_rng", "restore_rng", "start_args"]


def __getattr__(name: str):
    if name in ("CONCURRENCY_GROUPS", "TrainWorker", "start_args"):
        from elastic.worker import remote

        return getattr(remote, name)
    if name in ("capture_rng", "restore_rng"):
        from elastic.worker import rng

        return getattr(rng, name)
    raise AttributeError(name)
