"""What the controller needs from a worker group: the ``WorkerGroupAPI`` protocol.

``elastic.control.worker_group.WorkerGroup`` implements it on Ray. The controller tests' scripted
fake (``tests/elastic/fake_group.py``) implements it without actors, and
``tests/elastic/test_worker_group_api.py`` checks both against it, so the fake cannot
drift from the real group.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from elastic.messages import WorkerReport


@runtime_checkable
class WorkerGroupAPI(Protocol):
    members: list[Any]  # ordered by rank; each has rank, node_id, group, dead, step, last_ok, pid
    dp: int
    storage_uri: str

    # capacity
    def request_capacity(self) -> None: ...

    def spare_groups(self, timeout: float = 0.0) -> list[Any]: ...

    def wait_spare(self, count: int, timeout: float) -> list[Any]: ...

    def spawn(self, groups: list[Any]) -> list[Any]: ...

    def release_group(self, group: Any) -> None: ...

    # (re)configuration
    def configure(
        self, members: list[Any], dp: int, step: int, restore_step: int | None, source: str
    ) -> dict[str, float]: ...

    def rank_order(self, members: list[Any]) -> list[Any]: ...

    def complete_replicas(self, members: list[Any]) -> list[list[Any]]: ...

    def common_snapshot_step(self, members: list[Any]) -> int | None: ...

    # running
    def launch(self, last_step: int) -> None: ...

    def observe(self, timeout: float = ...) -> Any: ...

    def drain_results(self, members: list[Any], timeout: float = 10.0) -> list[tuple[int, WorkerReport]]: ...

    def request_stop(self) -> None: ...

    def wait_runs(self, members: list[Any], timeout: float) -> list[Any]: ...

    def kill(self, members: list[Any]) -> None: ...

    def shutdown(self) -> None: ...

    def placement(self) -> dict[str, Any]: ...

    # for fault tools and callbacks
    def pid_of(self, rank: int) -> int: ...

    def pids_on_node(self, node_id: str) -> list[int]: ...
