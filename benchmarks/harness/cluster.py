"""Local multi-node Ray clusters for the benchmarks (``ray.cluster_utils.Cluster``), each on a
private ``TMPDIR``, and a private single-node Ray. Runs in a benchmark's driver process.

A private ``TMPDIR`` keeps Ray's session files and its ``ray_current_cluster`` address file
away from ``/tmp/ray``: no other process on this shared machine joins the benchmark's
cluster by accident (a plain ``ray.init()`` looks there), and the benchmark joins no one
else's. A child process started with ``proc.child_env(private_tmp=...)`` already runs in
one; ``start_cluster`` then keeps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PRIVATE_TMP_ENV = "BENCH_PRIVATE_TMPDIR"  # set beside TMPDIR by whoever made it private


def private_tmpdir(prefix: str = "rb") -> str:
    """A fresh directory directly under ``/tmp``: short, because Ray's Unix socket paths
    live below it and must stay under 108 characters."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def in_private_tmpdir() -> bool:
    tmp = os.environ.get(PRIVATE_TMP_ENV)
    return bool(tmp) and os.environ.get("TMPDIR") == tmp


@dataclass
class LocalCluster:
    """A started cluster; ``stop()`` shuts Ray down and removes the ``TMPDIR`` it made."""

    cluster: Any
    tmpdir: str | None = None  # made by start_cluster for this cluster alone
    previous_env: dict[str, str | None] | None = None

    def stop(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            try:
                if self.cluster is not None:
                    self.cluster.shutdown()
            finally:
                self._leave_tmpdir()

    def _leave_tmpdir(self) -> None:
        if self.tmpdir is None:
            return
        for key, value in (self.previous_env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.tmpdir = None


def _enter_private_tmpdir() -> tuple[str | None, dict[str, str | None] | None]:
    if in_private_tmpdir():
        return None, None
    # Python's own temporary files stay where they were: fix tempfile's choice before TMPDIR moves.
    tempfile.gettempdir()
    tmp = private_tmpdir()
    previous = {k: os.environ.get(k) for k in ("TMPDIR", PRIVATE_TMP_ENV)}
    os.environ["TMPDIR"] = os.environ[PRIVATE_TMP_ENV] = tmp
    return tmp, previous


def start_cluster(
    nodes: int = 4,
    *,
    head_cpus: float = 0,
    node_cpus: float = 1,
    node_resources: dict[str, float] | None = None,
    system_config: dict[str, Any] | None = None,
    dashboard: bool | None = None,
    log_level: int = logging.WARNING,
) -> LocalCluster:
    """A head with ``head_cpus`` and ``nodes`` worker nodes of ``node_cpus`` each, all up,
    and this process connected to it. ``dashboard`` None leaves Ray's default."""
    import ray
    from ray.cluster_utils import Cluster

    tmp, previous = _enter_private_tmpdir()
    started = LocalCluster(None, tmp, previous)
    try:
        head: dict[str, Any] = {"num_cpus": head_cpus}
        if dashboard is not None:
            head["include_dashboard"] = dashboard
        if system_config:
            head["_system_config"] = system_config
        started.cluster = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(nodes):
            started.cluster.add_node(num_cpus=node_cpus, **({"resources": node_resources} if node_resources else {}))
        started.cluster.wait_for_nodes()
        ray.init(address=started.cluster.address, log_to_driver=False, logging_level=log_level)
    except BaseException:
        started.stop()
        raise
    return started


@contextlib.contextmanager
def local_cluster(nodes: int = 4, **kwargs: Any) -> Iterator[Any]:
    """``start_cluster`` as a context: yields the ``ray.cluster_utils.Cluster``."""
    started = start_cluster(nodes, **kwargs)
    try:
        yield started.cluster
    finally:
        started.stop()


def embedded_cpus(spec: Any) -> int:
    """The logical CPUs of the embedded Ray ``ElasticTrainer`` starts for ``spec``: enough for
    ``max_dp`` replicas even on a 2-core machine."""
    workers = spec.elastic.max_dp * spec.parallel.replica_size
    return max(os.cpu_count() or 1, workers * max(int(spec.resources.cpus_per_worker), 1) + 1)


@contextlib.contextmanager
def local_ray(num_cpus: int, log_level: int = logging.WARNING) -> Iterator[None]:
    """A new single-node Ray in this process for the block (``address="local"``): a trainer
    started inside it never joins a cluster that another process on the machine recorded."""
    import ray

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, logging_level=log_level)
    try:
        yield
    finally:
        ray.shutdown()
