"""``TorchTrainer.fit`` on a real 4-node Ray cluster (one CPU each): a user's loop trained
elastic, held against one process replaying the run's own batches (tests/train/loops.py),
through a node killed with SIGKILL and a node added back."""

from __future__ import annotations

import collections
import json
import os
import threading
import time

import pytest
import torch

import elastic.train as train
from elastic.events import read_events
from elastic.train.data import global_order, rank_slice
from elastic.train.torch import TorchTrainer
from tests.train import loops

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]


def _trainer(tmp_path, name, workers, **config):
    nodes = tmp_path / "nodes"
    nodes.mkdir(exist_ok=True)
    return TorchTrainer(
        loops.loop,
        train_loop_config={"nodes": str(nodes), **config},
        scaling_config=train.ScalingConfig(num_workers=workers),
        run_config=train.RunConfig(
            name=name,
            storage_path=str(tmp_path / "runs"),
            failure_config=train.FailureConfig(max_failures=2),
            checkpoint_config=train.CheckpointConfig(num_to_keep=2),
        ),
    )


def _summary(result):
    with open(os.path.join(result.path, "summary.json")) as f:
        return json.load(f)


def _assert_matches_replay(trainer, result, rows=loops.ROWS, batch=4, in_place=False):
    """The run's steps (the newest generation's report of each) hold the rows the split rule
    gives at each step's size (a lost rank's report may be missing: its rows are the rule's),
    every row once in the epoch; rank 0's weights equal one process trained on them.
    The global batch is ``batch`` times the size the loop was entered at: each step's size,
    but when the group shrinks ``in_place`` the loop's loader keeps its global batch (growth
    enters the loop again)."""
    reported = loops.lineage(trainer.last_run["ledger"], full=True)
    assert sorted(reported) == list(range(1, len(reported) + 1)), "no step missing"
    order = global_order(rows, 0, True, 0)
    pos, steps = 0, {}
    entered_at = 0
    for index in sorted(reported):
        world = next(iter(reported[index].values()))["world"]
        entered_at = world if not in_place or world > entered_at else entered_at
        global_batch = batch * entered_at
        steps[index] = [rank_slice(order, pos, r, world, global_batch, False) for r in range(world)]
        pos += min(rows - pos, global_batch)
        for rank, entry in reported[index].items():
            if entry["rows"][0] != steps[index][rank]:
                json.dump(trainer.last_run["ledger"], open("/tmp/ledger.json", "w"))
            assert entry["rows"][0] == steps[index][rank], (index, rank)
    counts = collections.Counter(i for ranks in steps.values() for ids in ranks for i in ids)
    assert sorted(counts) == list(range(rows)) and set(counts.values()) == {1}, "each row once in the epoch"
    want = loops.replay(steps)
    got = result.return_values[0]
    for key, value in want.items():
        torch.testing.assert_close(torch.tensor(got[key]).reshape(value.shape), value, rtol=1e-5, atol=1e-6)
    return steps


def _kill_when(cluster, tmp_path, run_name, at_step, out):
    """Kill the node of rank 1 once step ``at_step`` is in the run's events (a driver thread)."""
    from elastic.faults import kill_node, worker_nodes

    events = tmp_path / "runs" / run_name / "events.jsonl"

    def watch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if events.exists() and any(
                e.get("kind") == "step" and e["step"] >= at_step
                for e in map(json.loads, events.read_text().splitlines())
            ):
                node = (tmp_path / "nodes" / "rank1").read_text()
                index = [n.node_id for n in worker_nodes(cluster)].index(node)
                out["kill_ts"] = time.time()
                kill_node(cluster, index)
                out["killed"] = node
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_fault_free_run_is_one_process_and_a_rerun_resumes(ray_cluster, tmp_path):
    trainer = _trainer(tmp_path, "plain", 2, batch=4)
    result = trainer.fit()
    steps = _assert_matches_replay(trainer, result)
    assert len(steps) == loops.ROWS // 8 and result.metrics["step"] == len(steps)
    summary = _summary(result)
    assert summary["status"] == "succeeded" and summary["steps"] == len(steps) and summary["failures"] == 0
    kinds = {e["kind"] for e in read_events(result.path)}
    assert {"job_start", "step", "checkpoint", "job_end"} <= kinds
    # CheckpointConfig(num_to_keep=2): the newest two committed checkpoints are kept
    kept = sorted(p for p in os.listdir(result.path) if p.startswith("checkpoint_"))
    assert kept == ["checkpoint_000015", "checkpoint_000020"]
    assert result.checkpoint.path.endswith("checkpoint_000020")
    assert [c.path[-17:] for c, _ in result.best_checkpoints] == kept
    with result.checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "state.pt"))
    assert state["step"] == 20
    # the same name and storage again: it resumes from the newest committed checkpoint (step 20)
    again = _trainer(tmp_path, "plain", 2, batch=4, epochs=2)
    second = again.fit()
    assert min(e["index"] for e in again.last_run["ledger"]) == 21
    assert second.metrics["step"] == 2 * len(steps)


def test_a_node_loss_with_the_step_held_loses_nothing(ray_cluster, tmp_path):
    trainer = _trainer(tmp_path, "held", (1, 4), batch=4, hold=True, pace_s=0.05)
    out: dict = {}
    killer = _kill_when(ray_cluster, tmp_path, "held", 6, out)
    result = trainer.fit()
    killer.join(timeout=10)
    assert "killed" in out
    steps = _assert_matches_replay(trainer, result, in_place=True)
    shrunk = [ranks for ranks in steps.values() if len(ranks) == 3]
    assert shrunk and all(sum(map(len, r)) == 16 for r in shrunk[:-1]), "in place, the global batch (16) is kept"
    summary = _summary(result)
    assert summary["failures"] == 1 and [r["lost_steps"] for r in summary["recoveries"]] == [0]
    events = read_events(result.path)
    resizes = [e for e in events if e["kind"] == "resize"]
    assert resizes and resizes[0]["how"] == "in place"
    assert (resizes[0]["old_dp"], resizes[0]["new_dp"], resizes[0]["reason"]) == (4, 3, "node_lost")
    first_at_3 = min(e["ts"] for e in events if e["kind"] == "step" and e["dp"] == 3)
    assert first_at_3 - out["kill_ts"] < 10.0  # the figure is the benchmark's; this catches a hang
    _assert_run_files(result, summary, events, out["killed"])


def _assert_run_files(result, summary, events, killed):
    """The run files of a run with one node lost (4 -> 3) have the built-in trainer's kinds
    and fields (docs/outputs.md), and ``elastic report`` draws them: the real CLI entry."""
    from elastic.control.timing import PHASES
    from elastic.events import RunResult
    from elastic.report.run_data import load_run
    from jobs.cli import main

    assert set(summary) == set(RunResult.model_fields) - {"stop"}  # a stopped job's field only
    assert summary["status"] == "succeeded" and summary["dp_history"][0] == [0, 4]
    assert [dp for _, dp in summary["dp_history"]][:2] == [4, 3]
    steps = [e for e in events if e["kind"] == "step"]
    assert summary["steps"] == steps[-1]["step"] == len(steps)  # each report index once: a held step's is dropped
    assert summary["final_loss"] == result.metrics["loss"]
    for e in steps:
        assert (e["dp"], e["world_size"], e["tp"], e["pp"], e["grad_accum"]) == (e["dp"], e["dp"], 1, 1, 1)
        assert e["loss"] == e["metrics"]["loss"] and e["step_time_s"] >= 0
    start = next(e for e in events if e["kind"] == "job_start")
    assert (start["dp"], start["tp"], start["pp"], start["nodes"]) == (4, 1, 1, 4)
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["cause"] == "node_lost" and failure["nodes"] == [killed] and failure["ranks"] == [1]
    (rec,) = summary["recoveries"]
    assert rec["cause"] == "node_lost" and set(rec["breakdown"]) <= set(PHASES)
    assert {"detect_s", "free_s", "configure_other_s", "first_step_s"} <= set(rec["breakdown"])
    assert sum(rec["breakdown"].values()) == pytest.approx(rec["downtime_s"], abs=0.01)  # each phase rounded to 1 ms
    assert rec["downtime_s"] == pytest.approx(rec["detect_s"] + rec["recover_s"], abs=0.002)
    stored = [e for e in events if e["kind"] == "checkpoint" and e["tier"] == "storage"]
    assert stored and all(e["committed"] and e["bytes"] > 0 for e in stored)
    assert {e["step"] for e in events if e["kind"] == "checkpoint" and e["tier"] == "memory"} >= {
        e["step"] for e in stored
    }
    assert events[-1]["kind"] == "job_end" and events[-1]["status"] == "succeeded"
    assert events[-1]["steps"] == summary["steps"]
    out = os.path.join(result.path, "report")
    assert main(["report", result.path]) == 0
    for name in ("report.md", "loss.png", "throughput.png", "timeline.png", "step_breakdown.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    text = open(os.path.join(out, "report.md")).read()
    assert f"- steps completed: {summary['steps']}," in text and "- failures: 1" in text
    assert "- DP over the run: 4 -> 3" in text and "| node_lost |" in text
    data = load_run(result.path)  # what the figures draw
    assert [s["step"] for s in data.steps] == [s["step"] for s in steps]
    assert [f.cause for f in data.failures] == ["node_lost"] and data.failures[0].downtime_s == rec["downtime_s"]
    assert [dp for _, dp in data.dp_timeline()] == [4, 3]


def test_a_node_loss_enters_the_loop_again_then_it_grows_back(ray_cluster, tmp_path):
    trainer = _trainer(tmp_path, "again", (1, 4), batch=4, pace_s=0.05, epochs=1)
    out: dict = {}
    killer = _kill_when(ray_cluster, tmp_path, "again", 7, out)

    def add_back():
        killer.join(timeout=300)
        ray_cluster.add_node(num_cpus=1)

    adder = threading.Thread(target=add_back, daemon=True)
    adder.start()
    result = trainer.fit()
    adder.join(timeout=60)
    _assert_matches_replay(trainer, result)
    events = read_events(result.path)
    resizes = [e for e in events if e["kind"] == "resize"]
    assert resizes[0]["how"] == "entered again" and resizes[0]["step"] in (5, 10)
    assert (resizes[0]["old_dp"], resizes[0]["new_dp"]) == (4, 3)
    summary = _summary(result)
    assert summary["failures"] == 1
    lost = summary["recoveries"][0]["lost_steps"]
    assert 0 < lost <= 5  # the steps since the checkpoint, trained again
    if len(resizes) > 1:  # the node came back before the epoch ended
        assert resizes[1]["how"] == "grown at a checkpoint" and resizes[1]["new_dp"] == 4
        assert resizes[1]["reason"] == "capacity returned"


def test_a_rank_holds_the_newest_checkpoints_not_all_of_them(ray_cluster, tmp_path):
    """A checkpoint at every one of 40 reports: each rank's memory (its own part, its copy of
    its peer's) drops a checkpoint once a newer one is complete (the driver's ``forget_before``),
    so it holds a few, whatever the run's length, where it held all 40 (the driver forgets
    with a lag of a poll or two: up to 10 is allowed for a loaded machine)."""
    trainer = TorchTrainer(
        loops.checkpointing_loop,
        train_loop_config={"reports": 40, "pace_s": 0.05},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="held", storage_path=str(tmp_path / "runs")),
    )
    result = trainer.fit()
    assert result.metrics["i"] == 40 and result.checkpoint.path.endswith("checkpoint_000040")
    held = trainer.last_run["held"]
    assert all(h and 1 <= max(h) <= 10 for h in held.values()), held


def test_an_error_the_loop_raises_on_every_rank_ends_the_run_at_once(ray_cluster, tmp_path):
    trainer = _trainer(tmp_path, "bug", 2, fail_at=3)
    with pytest.raises(train.TrainingFailedError) as info:
        trainer.fit()
    message = str(info.value)
    assert "ValueError: boom at step 3" in message and "loops.py" in message and "in loop" in message
    assert "elastic/train/rank.py" not in message  # the loop's own frames, not the runtime's
    with open(tmp_path / "runs" / "bug" / "summary.json") as f:
        summary = json.load(f)
    assert summary["status"] == "failed" and summary["failures"] == 1  # seen once, not retried
    kinds = [e["kind"] for e in read_events(str(tmp_path / "runs" / "bug"))]
    assert kinds.count("failure") == 1 and "resize" not in kinds and "restore" not in kinds
