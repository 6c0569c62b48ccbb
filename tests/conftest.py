"""Shared fixtures: one Ray runtime at a time, reused across tests, and the fault-free
reference trajectory of the elastic tests, computed once.

A process can be connected to one Ray cluster at a time, so the fixtures below switch
between a single-node local Ray (most tests) and a multi-node ``ray.cluster_utils.Cluster``
(elastic tests) only when a test needs the other kind.

The tree mirrors the runtime packages (``tests/control`` tests ``elastic/control`` ...);
``tests/integration`` holds the multi-node scenarios that cross packages. Helpers shared
across folders sit here (``elastic_testlib.py``, ``waiting.py``, ``cluster_guard.py``); a folder's own helpers sit
in it.
"""

from __future__ import annotations

import logging
import os
import sys

import cluster_guard
import pytest

# Test folders are not packages: each imports its helpers by module name.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "storage"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


# --------------------------------------------------------------------------- the cluster marker


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """An unmarked test runs (setup to teardown) with the cluster entry points guarded."""
    if item.get_closest_marker("cluster") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        cluster_guard.install(item, patch)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that caught the guard's failure (``except BaseException``) still fails."""
    outcome = yield
    report = outcome.get_result()
    failures = cluster_guard.failures(item)
    if failures and report.passed and call.when in ("setup", "call"):
        report.outcome = "failed"
        report.longrepr = failures[0]


# --------------------------------------------------------------------------- Ray runtimes


CLUSTER_NODES = 4  # ray_cluster's one-CPU worker nodes


def pytest_collection_modifyitems(config, items):
    """The tests on the 4-node cluster run last, one after another, so that the cluster is made
    once and repaired between them (``ray_cluster``), not made again each time a test on a
    single-node Ray ran in between. Otherwise the files' order (the sort is stable).

    Under ``pytest -n 2 --dist loadgroup`` (pytest-xdist; ``make test`` runs serially) they
    are one ``xdist_group``: one worker runs all of them, in that order, on its one cluster,
    while the other worker takes the rest."""
    items.sort(key=lambda item: "ray_cluster" in getattr(item, "fixturenames", ()))
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray_cluster"))


def _private_tmpdir_per_worker() -> None:
    """Each xdist worker keeps Ray's session files and its ``ray_current_cluster`` record in
    its own ``TMPDIR`` (Ray reads ``TMPDIR`` on Linux), so that neither worker's ``auto`` or
    ``/tmp/ray`` ever names the other's cluster. Short, under ``/tmp``: Ray's socket paths
    live below it and must stay under 108 characters."""
    import tempfile

    global _WORKER_TMPDIR
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or os.environ.get("ELASTIC_TEST_TMPDIR_WORKER") == worker:
        return
    path = tempfile.mkdtemp(prefix=f"et-{worker}-", dir="/tmp")
    os.environ["TMPDIR"] = path
    os.environ["ELASTIC_TEST_TMPDIR_WORKER"] = worker
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    _WORKER_TMPDIR = path  # removed in pytest_unconfigure, once Ray is down


_WORKER_TMPDIR: str | None = None
_private_tmpdir_per_worker()


class _RayState:
    kind: str | None = None
    cluster = None
    cluster_nodes: set = set()


def _shutdown() -> None:
    ray = sys.modules.get("ray")
    if ray is None:  # never started (and maybe not installed: the gpu tests run where Ray is not)
        return
    if ray.is_initialized():
        ray.shutdown()
    if _RayState.cluster is not None:
        _RayState.cluster.shutdown()
        _RayState.cluster = None
    _RayState.kind = None


@pytest.fixture
def no_ray():
    """No Ray runtime in this process: for tests that check a command started none (a runtime
    left up by an earlier test would make ``ray.is_initialized()`` prove nothing)."""
    _shutdown()
    yield


@pytest.fixture
def ray_local():
    """A single-node Ray with 6 logical CPUs (enough for 4 workers on 2 real cores)."""
    import ray

    if _RayState.kind != "local" or not ray.is_initialized():
        _shutdown()
        ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
        _RayState.kind = "local"
    yield ray


@pytest.fixture
def ray_cluster(request):
    """A 4-node local cluster: a CPU-less head and 4 one-worker nodes, as a test found it.

    Tests remove, add and drain nodes, so a cluster is handed on only when the last test left
    it as it was made: the same five nodes alive, none draining, every CPU free once the last
    driver's actors are gone (a new driver connection each test). Otherwise it is repaired
    (the nodes a test lost, drained or added replaced by fresh ones) or, failing that, made anew.
    A test marked ``fresh_cluster`` always gets a new one (Ray's metrics agent on the head keeps
    counting across the runs a cluster has seen).
    """
    import ray

    fresh = request.node.get_closest_marker("fresh_cluster") is not None
    if fresh or (not _cluster_as_made() and not _repaired()):
        _shutdown()
        _new_cluster()
    yield _RayState.cluster
    if ray.is_initialized():
        ray.shutdown()  # the test's actors end with its driver


# The GCS declares a node whose raylet was SIGKILLed dead after this many failed health
# checks this far apart: 2 s, where Ray's defaults (5 x 3 s) left the killed node counted
# alive, with its CPU, for up to 15 s after a test, and the next test's cluster repair
# waited that out (8-14 s of setup after each node-loss test, 2026-11-28 suite). A live
# raylet, however loaded, answers within the check's 10 s timeout; the product's own
# detection of a lost node does not use the GCS's (docs/architecture.md).
GCS_HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 2}
HEAD_NODE = {"num_cpus": 0, "include_dashboard": False, "_system_config": GCS_HEALTH_CHECK}


def _new_cluster() -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(HEAD_NODE))
    for _ in range(CLUSTER_NODES):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    _RayState.kind, _RayState.cluster = "cluster", cluster
    _RayState.cluster_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _repaired() -> bool:
    """Bring back to how ``_new_cluster`` made it a cluster whose head still answers (a test
    lost, drained or added nodes): the nodes that are not one of the made ones alive and
    undrained go, fresh one-CPU nodes take the lost ones' places. Some seconds per node,
    against a new head and four nodes; False (then a fresh cluster) when it cannot."""
    import ray
    from ray._private.state import state as gcs_state

    cluster = _RayState.cluster
    if _RayState.kind != "cluster" or cluster is None or cluster.head_node is None:
        return False
    try:
        if not ray.is_initialized():
            ray.init(address=cluster.address, log_to_driver=False)
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        draining = set(gcs_state.get_draining_nodes())
        kept = {cluster.head_node.node_id}
        for node in list(cluster.worker_nodes):
            nid = node.node_id
            if nid in _RayState.cluster_nodes and nid in alive and nid not in draining and len(kept) <= CLUSTER_NODES:
                kept.add(nid)
            else:
                cluster.remove_node(node)
        while len(kept) <= CLUSTER_NODES:
            kept.add(cluster.add_node(num_cpus=1).node_id)
        cluster.wait_for_nodes()
    except Exception:  # anything amiss: a fresh cluster
        return False
    _RayState.cluster_nodes = kept
    return _cluster_as_made()


def _cluster_as_made(timeout_s: float = 15.0) -> bool:
    """Whether the cluster the last test used is as ``_new_cluster`` made it (see ray_cluster)."""
    import time

    import ray
    from ray._private.state import state as gcs_state

    if _RayState.kind != "cluster" or _RayState.cluster is None:
        return False
    try:
        if not ray.is_initialized():
            ray.init(address=_RayState.cluster.address, log_to_driver=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            if alive != _RayState.cluster_nodes or gcs_state.get_draining_nodes():
                return False
            if ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0) == CLUSTER_NODES:
                return True
            time.sleep(0.25)
    except Exception:  # a cluster that cannot answer is not handed on
        return False
    return False


@pytest.fixture
def rack_cluster():
    """A fresh labelled cluster: a CPU-less head and 4 nodes in 2 racks (w0, w1 in r0; w2, w3
    in r1), each with 2 CPUs and 4 logical GPUs (docs/placement.md). Fresh: tests remove nodes."""
    import ray
    from ray.cluster_utils import Cluster

    _shutdown()
    cluster = Cluster(initialize_head=True, head_node_args=dict(HEAD_NODE))
    for i in range(4):
        cluster.add_node(num_cpus=2, num_gpus=4, labels={"rack": f"r{i // 2}", "name": f"w{i}"})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    _RayState.kind, _RayState.cluster = "cluster", cluster
    yield cluster
    _shutdown()


def pytest_sessionfinish(session, exitstatus):
    _shutdown()
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process here, with pytest's exit status, once every report (the summary, the
    JUnit XML) is written. A clean-clone run of the whole suite (2026-11-29, 922 passed) died
    of a segmentation fault after its summary, in the interpreter's finalization, where the
    threads that Ray's client, torch and gloo leave behind are torn down in no set order;
    `make test` then failed a run whose every test passed. What is still alive is named on
    stderr, so that a leak of the product's own threads stays visible."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:  # the session never ran (--help, a usage error): leave as pytest does
        return
    import threading

    alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    if alive:
        sys.stderr.write(f"threads alive at exit ({len(alive)}): {', '.join(alive)}\n")
    if _WORKER_TMPDIR is not None:
        import shutil

        shutil.rmtree(_WORKER_TMPDIR, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


class _Reference:
    """The fault-free trajectory of ``elastic_spec()`` at dp 2, once per session."""

    losses: dict[int, tuple[float, float]] | None = None


def _reference(tmp_path_factory) -> dict[int, tuple[float, float]]:
    """Computed on whichever Ray is up."""
    if _Reference.losses is None:
        from elastic_testlib import elastic_spec, step_metrics

        from elastic import ElasticTrainer

        run_dir = str(tmp_path_factory.mktemp("reference"))
        result = ElasticTrainer(elastic_spec(min_dp=2, max_dp=2), run_dir=run_dir).fit()
        assert result.status == "succeeded"
        _Reference.losses = step_metrics(run_dir)
    return _Reference.losses


@pytest.fixture
def reference_losses(ray_local, tmp_path_factory):
    return _reference(tmp_path_factory)


@pytest.fixture
def reference_losses_cluster(tmp_path_factory):
    """For tests that own a Ray cluster: computed on it if no earlier test did."""
    return _reference(tmp_path_factory)


@pytest.fixture
def tiny_spec_dict():
    """A spec small enough for a step in milliseconds on one core."""
    return {
        "name": "tiny",
        "seed": 0,
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
        "data": {"num_samples": 4000},
        "parallel": {"micro_batch": 2},
        "elastic": {"min_dp": 1, "max_dp": 2, "heartbeat_timeout_s": 5, "collective_timeout_s": 10},
        "train": {"steps": 8, "global_batch": 8, "lr": 3.0e-3},
        "checkpoint": {"every_steps": 0},
    }


@pytest.fixture
def python():
    return sys.executable


@pytest.fixture(scope="session")
def moto_s3():
    """A real S3 API server (moto, in-process) on loopback, shared by the whole session."""
    from storage_testlib import MotoS3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = MotoS3()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(moto_s3):
    """A fresh bucket on the (running) server; restarts the server if a test left it down."""
    if moto_s3._server is None:
        moto_s3.start()
    yield moto_s3.new_bucket()
    if moto_s3._server is None:
        moto_s3.start()
