"""Where workers run: resources per worker and Ray placement groups."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

logger = logging.getLogger(__name__)

RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class ResourcesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: Literal["cpu", "cuda"] = "cpu"
    cpus_per_worker: float = Field(1, ge=0)
    gpus_per_worker: float = Field(0, ge=0)
    custom: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="extra Ray resources per worker"
    )

    @field_validator("custom")
    @classmethod
    def _custom_names(cls, v: dict[str, float]) -> dict[str, float]:
        reserved = sorted(set(v) & RAY_BUILTIN_RESOURCES)
        if reserved:  # these have their own keys (or are Ray's own); a custom entry would override them
            raise ValueError(
                f"{', '.join(reserved)} is a Ray built-in resource: use resources.cpus_per_worker / gpus_per_worker"
            )
        return v


class ReplicaSlots:
    """Capacity for model replicas, held as one Ray placement group per replica.

    Each group has ``replica_size`` worker bundles (tp x pp workers). The controller keeps
    ``max_dp`` groups requested at all times: groups that Ray cannot place yet stay
    *pending*, and they are the standing request for capacity. A pending group that
    becomes ready means a node (re)joined, which is the signal to grow back.

    The strategy is STRICT_PACK for a GPU tensor-parallel replica (its TP group stays on
    one node) and PACK otherwise (a replica's workers as close together as the cluster
    allows). Replicas are then ranked rack by rack (``WorkerGroup.reform``), so the DP
    ring crosses racks as few times as possible.
    """

    def __init__(self, resources: ResourcesConfig, replica_size: int, tp: int = 1, pp: int = 1):
        self.resources = resources
        self.replica_size = replica_size
        # A GPU replica without pipeline stages is one TP group: it must share a node
        # (NVLink), so its group is STRICT_PACK. Pipeline replicas may span nodes.
        self.strategy = "STRICT_PACK" if resources.device == "cuda" and pp == 1 and tp > 1 else "PACK"
        self._groups: list[Any] = []
        self.excluded: set[str] = set()  # lemon nodes (docs/health.md): never placed on again

    def bundle(self) -> dict[str, float]:
        r = self.resources
        bundle = {"CPU": float(r.cpus_per_worker)}
        if r.gpus_per_worker:
            bundle["GPU"] = float(r.gpus_per_worker)
        bundle.update({k: float(v) for k, v in r.custom.items()})
        return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}

    def request(self, total: int) -> None:
        from ray.util.placement_group import placement_group

        while len(self._groups) < total:
            selector = None
            if self.excluded:  # Ray's node-id label; "!in(...)" keeps the bundles off these nodes
                selector = [{"ray.io/node-id": f"!in({','.join(sorted(self.excluded))})"}] * self.replica_size
            self._groups.append(
                placement_group(
                    [self.bundle()] * self.replica_size, strategy=self.strategy, bundle_label_selector=selector
                )
            )

    def ready(self, timeout: float = 0.0) -> list[Any]:
        """Placement groups whose bundles are all placed now: one read of the GCS table for
        all of them per look, not one per group."""
        deadline = time.monotonic() + timeout
        while True:
            table = group_tables(self._groups)
            created = [
                g
                for g in self._groups
                if table[g.id.hex()].get("state") == "CREATED"
                and not self.excluded & set(table[g.id.hex()].get("bundles_to_node_id", {}).values())
            ]
            if created or time.monotonic() >= deadline:
                return created
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def exclude(self, nodes: set[str], keep: set[int]) -> None:
        """Never place on ``nodes`` again: groups there or still pending (placed by a request
        without this exclusion) are released, except those in ``keep`` (ids of groups with
        live workers); ``request`` replaces them with groups that avoid these nodes."""
        self.excluded |= set(nodes)
        table = group_tables(self._groups)
        for g in list(self._groups):
            if id(g) in keep:
                continue
            info = table[g.id.hex()]
            if info.get("state") != "CREATED" or self.excluded & set(info.get("bundles_to_node_id", {}).values()):
                self.release(g)

    def release(self, group: Any) -> None:
        from ray.util.placement_group import remove_placement_group

        if group in self._groups:
            self._groups.remove(group)
            try:
                remove_placement_group(group)
            except Exception as exc:  # already gone with its node
                logger.debug("placement group removal failed: %s", exc)

    def release_all(self) -> None:
        for g in list(self._groups):
            self.release(g)

    def bundle_nodes(self, groups: Sequence[Any]) -> list[str]:
        """The node of each worker bundle of ``groups`` (ready groups), read from the GCS in
        one call: where their workers will run, known before they are created."""
        table = group_tables(list(groups))
        return [n for g in groups for n in (table[g.id.hex()].get("bundles_to_node_id") or {}).values()]

    def actor_options(self, group: Any, bundle_index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        r = self.resources
        return {
            "num_cpus": r.cpus_per_worker,
            "num_gpus": r.gpus_per_worker,
            "resources": dict(r.custom),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group,
                placement_group_bundle_index=bundle_index,
                placement_group_capture_child_tasks=False,
            ),
        }


def group_tables(groups: list[Any]) -> dict[str, dict[str, Any]]:
    """The GCS record of each of ``groups`` by id (hex), read in one call ({} for one the GCS
    no longer knows)."""
    if not groups:
        return {}
    from ray.util.placement_group import placement_group_table

    table = placement_group_table()  # every group of the cluster, in one call
    return {g.id.hex(): table.get(g.id.hex(), {}) for g in groups}
