"""What the controller needs from a worker group: the ``WorkerGroupAPI`` protocol and the
typed values that cross it.

``elastic.control.worker_group.group.WorkerGroup`` implements it on Ray. The controller tests'
scripted fake (``tests/control/fake_group.py``) implements it without actors, and a test
checks both against it, so the fake cannot drift from the real group. The group carries
decisions out and reports what it saw; it decides nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from elastic.errors import WorkerFailure
from elastic.messages import WorkerReport

if TYPE_CHECKING:
    from elastic.control.drain import DrainNotice
    from elastic.control.recovery_plan import Holdings, ReformPlan
    from elastic.spec import JobSpec
    from elastic.worker.hooks import StepHook

Slot = Hashable  # a placement group (one whole replica's bundles): opaque to the controller


class Member(Protocol):
    """One rank's worker as the controller sees it (``rank`` -1 until configured)."""

    rank: int
    node_id: str
    ip: str
    pid: int
    group: Slot
    dead: bool
    step: int  # the newest step it reported completing (its last poll answer)
    last_ok: float  # driver clock: when it last answered


@dataclass
class Observation:
    """What one look at the group found."""

    results: list[tuple[int, WorkerReport]] = field(default_factory=list)  # (rank, report)
    failure: WorkerFailure | None = None
    finished: bool = False
    stopped: bool = False


@dataclass(frozen=True)
class ConfigureResult:
    """A whole group's answer to a re-formation: the slowest rank's time in each phase."""

    step: int  # the step every rank resumes from
    init_s: float  # the rendezvous: the group and its mesh sub-groups
    build_s: float  # the model engine: parallel wrappers, optimizer
    restore_s: float  # loading the state (memory snapshots or storage)
    restore_bytes_read: int = 0  # from storage, all ranks together
    store_ops_per_rank: int = 0  # rendezvous store operations of the rank that made the most
    ranks_kept_state: int = 0  # ranks that resumed from their own live state (restored nothing)
    peer_bytes: int = 0  # snapshot bytes fetched from peers' memory, all ranks together
    cpu_s: float = 0.0  # the most CPU time one worker spent configuring


# A group's own member type: it is handed back only the members it made (WorkerGroup's carry
# their actors), so its methods take that type, not any ``Member``.
M = TypeVar("M", bound=Member)


@runtime_checkable
class WorkerGroupAPI(Protocol[M]):
    @property
    def members(self) -> Sequence[M]:  # ordered by rank; read-only here, so a group may keep a list
        ...

    dp: int
    storage_uri: str

    # capacity
    def request_capacity(self) -> None: ...

    def spare_groups(self, timeout: float = 0.0) -> list[Slot]: ...

    def wait_spare(self, count: int, timeout: float) -> list[Slot]: ...

    def spawn(self, groups: Sequence[Slot]) -> list[M]: ...

    # a start the controller does not wait for: begin, then collect (None: still starting), or cancel
    def spawn_begin(self, groups: Sequence[Slot]) -> Any: ...

    def spawn_end(self, pending: Any, wait_s: float) -> list[M] | None: ...

    def spawn_cancel(self, pending: Any) -> None: ...

    def release_group(self, group: Slot) -> None: ...

    def exclude_nodes(self, nodes: list[str]) -> None: ...

    def draining_nodes(self) -> dict[str, DrainNotice]: ...

    def avoid(self, nodes: set[str]) -> None: ...

    # (re)configuration
    def snapshot_holdings(self, members: Sequence[M]) -> list[Holdings | None]: ...

    def reform(self, plan: ReformPlan[M]) -> ConfigureResult: ...

    def rack_of(self, node_id: str) -> str: ...

    # running
    def launch(self, last_step: int) -> None: ...

    def observe(self, timeout: float = ...) -> Observation: ...

    def drain_results(self, members: Sequence[M], timeout: float = 10.0) -> list[tuple[int, WorkerReport]]: ...

    def request_stop(self) -> None: ...

    def wait_runs(self, members: Sequence[M], timeout: float) -> list[M]: ...

    def save_checkpoints(self, timeout: float) -> None: ...

    def kill(self, members: Sequence[M]) -> None: ...

    def shrink(self, members: Sequence[M], excluded: Sequence[int]) -> None: ...

    def abort_steps(self, members: Sequence[M], lost: Sequence[M] = ()) -> None: ...

    def shutdown(self) -> None: ...

    def placement(self) -> dict[str, Any]: ...  # the ``placement`` event's fields

    # for fault tools and callbacks
    def pid_of(self, rank: int) -> int: ...

    def pids_on_node(self, node_id: str) -> list[int]: ...


class WorkerGroupFactory(Protocol):
    """How the controller makes its group (``Controller.worker_group_cls``): the group class
    itself, or a test's or the benchmark's subclass. It says nothing of the member type: the
    controller only hands a group back the members that group made."""

    def __call__(
        self, spec: JobSpec, corpus_uri: str, *, step_hook: StepHook | None = None, storage_uri: str = ""
    ) -> WorkerGroupAPI[Any]: ...
