"""A real node loss on a 4-node Ray cluster, seen four ways: the live metrics read from Ray's
Prometheus endpoint during the run, ``elastic report`` on its run directory afterwards, the
TensorBoard files ``train.tensorboard`` wrote (read back by ``tensorboard``), and the
experiment trackers: MLflow's real local file store and a stand-in for ``wandb``."""

from __future__ import annotations

import os
import re
import statistics
import sys
import threading
import time
import urllib.request

import pytest
from elastic_testlib import FAULT_STEP, STEPS, elastic_spec, events_of

from elastic import ElasticTrainer
from elastic.faults import Fault, FaultInjector, WorkerFaults, worker_fault
from elastic.report import load_run, scale_factors, write_report

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
LABEL = re.compile(r'(\w+)="([^"]*)"')


@pytest.fixture
def fast_metrics(monkeypatch):
    """Ray's processes flush metrics every RAY_metrics_report_interval_ms (10 s by default);
    every 0.5 s here so that a short run shows up. Set before the cluster starts."""
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")


def scrape(run: str) -> dict[tuple[str, tuple], float]:
    """Every ``ray_elastic_*`` sample of this run on every node's metrics export endpoint,
    keyed by (name, the labels other than Ray's own)."""
    import ray

    samples = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            body = urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            continue
        for line in body.splitlines():
            m = SAMPLE.match(line)
            if not m or not m.group(1).startswith("ray_elastic_"):
                continue
            labels = dict(LABEL.findall(m.group(2)))
            if labels.get("run") != run:
                continue
            key = tuple(sorted((k, v) for k, v in labels.items() if k in ("cause", "tier", "le")))
            samples[(m.group(1), key)] = float(m.group(3))
    return samples


class Scraper(threading.Thread):
    """Scrapes the endpoints every 0.2 s; keeps (time, samples) and the latest value of each
    sample. (Ray exports a gauge only in the flushes after it was set: once the run stops
    setting it, it leaves the endpoint, so the last values are caught while they are there.)"""

    def __init__(self, run: str):
        super().__init__(daemon=True)
        self.run_name, self.scrapes, self.latest, self.stop = run, [], {}, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            s = scrape(self.run_name)
            if s:
                self.scrapes.append((time.time(), s))
                self.latest = {**self.latest, **s}


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


@pytest.mark.fresh_cluster  # a handed-on head's metrics agent counted earlier runs' node losses (19, not 1)
def test_node_loss_live_metrics_and_report(fast_metrics, ray_cluster, tmp_path, monkeypatch):
    from tracking_fakes import FakeWandb

    from elastic.report.trackers import MlflowCallback, WandbCallback

    spec = elastic_spec(min_dp=1, max_dp=4)
    spec.train = spec.train.model_copy(update={"tensorboard": True})
    run_dir = str(tmp_path / "run")
    run = os.path.basename(run_dir)
    injector = FaultInjector([Fault("kill_node", at_step=FAULT_STEP, node_index=1)], cluster=ray_cluster)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow_uri = (tmp_path / "mlruns").as_uri()
    fake_wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    trackers = [MlflowCallback(tracking_uri=mlflow_uri, run_name=run), WandbCallback(project="tests")]
    # Steps of at least 0.15 s: the run lasts long enough for a few metric flushes.
    slow = WorkerFaults([worker_fault("slow", step=1, rank=r, seconds=0.15) for r in range(4)])
    scraper = Scraper(run)
    scraper.start()
    try:
        result = ElasticTrainer(spec, run_dir=run_dir, callbacks=[injector, *trackers], step_hook=slow).fit()

        def final():  # the last flush after the last step
            s = scraper.latest
            done = s.get(("ray_elastic_step", ())) == STEPS
            return s if done and ("ray_elastic_last_recovery_downtime_s", ()) in s else None

        try:
            s = wait_for(final, 30, "the final metric values")
        finally:
            print("latest samples:", scraper.latest)
    finally:
        scraper.stop.set()
        scraper.join(timeout=10)
    assert result.status == "succeeded" and result.steps == STEPS
    assert [dp for _, dp in result.dp_history] == [4, 3]
    job_end = events_of(run_dir, "job_end")[0]["ts"]

    # Live: the endpoint showed the run's progress before it ended.
    during = [(t, s) for t, s in scraper.scrapes if t < job_end and s.get(("ray_elastic_step", ())) is not None]
    assert during, f"no elastic metric on the endpoint during the run ({len(scraper.scrapes)} scrapes)"
    print(f"{len(during)} scrapes during the run; first at step {during[0][1][('ray_elastic_step', ())]:.0f}")

    # After the last flush: the final values, equal to what events.jsonl and summary.json say.
    steps = events_of(run_dir, "step")
    rec = result.recoveries[0]
    assert s[("ray_elastic_dp", ())] == 3
    assert s[("ray_elastic_failures_total", (("cause", "node_lost"),))] == 1
    assert s[("ray_elastic_steps_completed_total", ())] == len(steps)
    assert s[("ray_elastic_step_duration_s_count", ())] == len(steps)
    assert abs(s[("ray_elastic_last_recovery_downtime_s", ())] - rec.downtime_s) < 1e-9
    assert abs(s[("ray_elastic_loss", ())] - steps[-1]["loss"]) < 1e-6 * abs(steps[-1]["loss"])
    assert abs(s[("ray_elastic_tokens_per_s", ())] - steps[-1]["tokens_per_s"]) < 1e-6 * steps[-1]["tokens_per_s"]
    assert abs(s[("ray_elastic_data_wait_s", ())] - steps[-1]["data_wait_s"]) < 1e-9

    # The report, against figures computed here from events.jsonl.
    t = time.perf_counter()
    md_path = write_report(run_dir)
    print(f"report written in {time.perf_counter() - t:.2f}s")
    md = open(md_path).read()
    out = os.path.dirname(md_path)
    for name in ("loss.png", "throughput.png", "timeline.png", "step_breakdown.png"):
        assert os.path.getsize(os.path.join(out, name)) > 20_000, name
    med = {dp: statistics.median(e["tokens_per_s"] for e in steps if e["dp"] == dp) for dp in (3, 4)}
    factor4 = med[4] / (4 * med[3] / 3)
    assert abs(scale_factors(load_run(run_dir).steps)[4] - factor4) < 1e-12
    assert f"| 4 | {med[4]:,.0f} | {sum(e['dp'] == 4 for e in steps)} | {factor4:.3f} |" in md
    failure = events_of(run_dir, "failure")[0]
    before = max(e["ts"] for e in steps if e["ts"] <= failure["ts"])
    after = min(e["ts"] for e in steps if e["ts"] > failure["ts"])
    assert f"| node_lost | {failure['ranks']} | {after - before:.2f} | {rec.downtime_s:.2f} |" in md
    assert "DP over the run: 4 -> 3" in md

    # The trackers, against events.jsonl: every committed step (a redone one twice), in order.
    check_trackers(run_dir, steps, mlflow_uri, fake_wandb)


def check_trackers(run_dir: str, steps: list[dict], mlflow_uri: str, fake_wandb) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    want = [(e["step"], e["loss"]) for e in steps]
    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = [(s.step, s.value) for s in acc.Scalars("train/loss")]
    assert [s for s, _ in tb] == [s for s, _ in want]
    assert all(abs(v - w) <= 1e-6 * abs(w) for (_, v), (_, w) in zip(tb, want))  # float32 in the file
    assert [s.value for s in acc.Scalars("elastic/failures")] == [1.0]
    assert [s.value for s in acc.Scalars("elastic/recoveries")] == [1.0]
    assert [s.value for s in acc.Scalars("elastic/dp")][-1] == 3.0
    for name, key in (("train/grad_norm", "grad_norm"), ("perf/tokens_per_s", "tokens_per_s")):
        got = [s.value for s in acc.Scalars(name)]
        assert got == [pytest.approx(e[key], rel=1e-6) for e in steps], name
    client = MlflowClient(mlflow_uri)
    (found,) = client.search_runs([client.get_experiment_by_name("elastic").experiment_id])
    assert found.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "train/loss")] == want
    logged = [c[1] for c in fake_wandb.calls if c[0] == "log" and "train/loss" in c[1]]
    assert [(d["step"], d["train/loss"]) for d in logged] == want
    assert fake_wandb.calls[-1] == ("finish",)
