"""``TrainWorker``: the Ray actor of one rank, a thin shell over ``actor.Rank``.

Why a shell: a process handed an actor's handle has Ray load the actor's class (for its
methods' metadata), and Ray unpickles the class by value, importing every module its
methods name. ``Rank`` names torch and the training stack, so every node agent handed its
ranks' handles (``Attach``) imported torch before it could pass on the first command:
1.8 s and 240 MB more than now per agent (``benchmarks/job_start.py``), all of it in the
first configure's wait. This class names nothing heavy: a holder of its handles loads
``ray`` and nothing else, and the rank's own process imports the training stack in
``__init__``, where it did before (``elastic.worker`` leaves Ray's worker niceness first).

Its arguments travel as one pickle (``start_args``), opened in ``__init__`` once Ray's
worker niceness is left. Ray deserializes an actor's arguments before it loads the class,
and unpickling the spec imports ``elastic.spec`` and, through the data config, torch: 3 s
of one core that ran at niceness 15. Beside one nice-0 busy process per core, a rank gets
about 4% of a core there, and no worker of a 4-rank start had answered after 120 s (with
Linux's autogroups off; they share a host's cores between sessions instead of by niceness,
which hid it where they are on).

Each method runs in the same concurrency group as before and only forwards; the contract
of each is in ``actor.Rank``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray
from ray import cloudpickle

from elastic import priority

if TYPE_CHECKING:
    from elastic.messages import ConfigureReply, ConfigureRequest, PollReply, RunOutcome, WorkerInfo
    from elastic.worker.hooks import StepHook

# ``train`` (one thread): configure and run, the only code that touches the model or the
# process group. ``control``: polls, stops, snapshot queries and transfers (actor.py).
CONCURRENCY_GROUPS = {"train": 1, "control": 4}


# The ignore: Ray's stubs for ray.remote(**options) list task options, not concurrency_groups.
@ray.remote(concurrency_groups=CONCURRENCY_GROUPS, max_restarts=0)  # type: ignore[call-overload]
class TrainWorker:
    def __init__(self, args: bytes):
        """``args``: ``start_args(spec, corpus_uri, step_hook)`` (module docstring)."""
        priority.leave_ray_worker_niceness()  # before the spec's imports, not after
        spec, corpus_uri, step_hook = cloudpickle.loads(args)
        from elastic.worker.actor import Rank  # the training stack: in the rank's process only

        self._rank = Rank(spec, corpus_uri, step_hook)

    # ------------------------------------------------------------------ control group
    @ray.method(concurrency_group="control")
    def info(self) -> WorkerInfo:
        return self._rank.info()

    # No task events (Ray's per-task records sent to the GCS) for the polls: nobody reads them.
    @ray.method(concurrency_group="control", enable_task_events=False)
    def poll(self, wait_s: float = 0.0, ack: int | None = None, have: int | None = None) -> PollReply:
        return self._rank.poll(wait_s, ack, have)

    @ray.method(concurrency_group="control")
    def request_stop(self) -> None:
        self._rank.request_stop()

    @ray.method(concurrency_group="control")
    def abandon_rendezvous(self, generation: int) -> None:
        self._rank.abandon_rendezvous(generation)

    @ray.method(concurrency_group="control")
    def abort_step(self, generation: int = 0, links: frozenset = frozenset()) -> None:
        self._rank.abort_step(generation, links)

    @ray.method(concurrency_group="control")
    def shrink_group(self, excluded: tuple[int, ...]) -> bool:
        return self._rank.shrink_group(excluded)

    @ray.method(concurrency_group="control")
    def snapshot_holdings(self, after_run_s: float = 0.0) -> dict[int, list[int]]:
        return self._rank.snapshot_holdings(after_run_s)

    @ray.method(concurrency_group="control")
    def offer_snapshot(self, owner: int, step: int, timeout_s: float) -> dict[str, Any]:
        return self._rank.offer_snapshot(owner, step, timeout_s)

    @ray.method(concurrency_group="control")
    def snapshot_layout(self, owner: int, step: int) -> dict[str, dict[str, Any]]:
        return self._rank.snapshot_layout(owner, step)

    @ray.method(concurrency_group="control")
    def store_replica(self, wire: dict[str, Any]) -> bool:
        return self._rank.store_replica(wire)

    # ------------------------------------------------------------------ train group
    @ray.method(concurrency_group="train")
    def reconfigure(self, req: ConfigureRequest) -> ConfigureReply:
        return self._rank.reconfigure(req)

    @ray.method(concurrency_group="train")
    def save_checkpoint(self, timeout_s: float) -> bool:
        return self._rank.save_checkpoint(timeout_s)

    @ray.method(concurrency_group="train")
    def run(self, last_step: int) -> RunOutcome:
        return self._rank.run(last_step)


def start_args(spec: Any, corpus_uri: str, step_hook: StepHook | None = None) -> bytes:
    """A new rank's arguments, pickled: ``TrainWorker.remote(start_args(...))``."""
    return cloudpickle.dumps((spec, corpus_uri, step_hook))
