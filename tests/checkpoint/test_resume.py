"""``elastic run --resume``: the newest valid checkpoint, at whatever DP is allowed now."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from ckpt_testlib import assert_same_metrics, ckpt_raw, ckpt_spec, dp1_reference, events, metrics

from elastic import ElasticTrainer

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]


def test_resume_at_another_dp_continues_with_the_next_samples(ray_local, tiny_spec_dict, tmp_path):
    """6 steps at dp 1 (checkpoints 3, 6), then ``--resume`` to 9 steps at dp 2.

    Steps 7..9 must match a 9-step run without interruption: that needs the same weights,
    AdamW moments and step counts, the scheduler position (lr is still warming up) and
    exactly the next samples (the data position is in the checkpoint).
    """
    uri = str(tmp_path / "ckpt")
    first_dir, second_dir = (str(tmp_path / d) for d in ("first", "second"))
    # The uninterrupted run: one rank in this process (dp 1), not a Ray run.
    want = dp1_reference(tiny_spec_dict, 9, str(tmp_path / "ref"), elastic={"max_dp": 1}, checkpoint={"every_steps": 0})

    first = ckpt_spec(tiny_spec_dict, uri, train={"steps": 6}, elastic={"max_dp": 1})
    assert ElasticTrainer(first, run_dir=first_dir).fit().steps == 6
    assert [(e["step"], e["committed"]) for e in events(first_dir, "checkpoint", tier="storage")] == [
        (3, True),
        (6, True),
    ]

    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(ckpt_raw(tiny_spec_dict, uri, train={"steps": 6}, elastic={"max_dp": 1})))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.cli",
            "run",
            str(config),
            "--run-dir",
            second_dir,
            "--resume",
            "--set",
            "train.steps=9",
            "--set",
            "elastic.max_dp=2",
            "--address",
            ray_local.get_runtime_context().gcs_address,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(e["source"], e["step"]) for e in events(second_dir, "restore")] == [("storage", 6)]
    assert events(second_dir, "job_start")[0]["dp"] == 2
    resumed = metrics(second_dir)
    assert sorted(resumed) == [7, 8, 9]
    # dp 1 before, dp 2 after: another reduction order, still within 1e-5 (measured: printed).
    assert_same_metrics(resumed, want, (7, 8, 9))
    assert [(e["step"], e["committed"]) for e in events(second_dir, "checkpoint", tier="storage")] == [(9, True)]


def test_resume_without_a_checkpoint_is_refused_before_ray_starts(tiny_spec_dict, tmp_path):
    """``--resume`` with nothing to resume (no checkpoint, or only damaged ones): exit 2 naming --resume."""
    from elastic.errors import SpecError

    spec = ckpt_spec(tiny_spec_dict, str(tmp_path / "empty"), train={"steps": 2}, elastic={"max_dp": 1})
    with pytest.raises(SpecError) as info:
        ElasticTrainer(spec, run_dir=str(tmp_path / "run"), resume=True).fit()
    assert info.value.field == "--resume" and "nothing to resume" in str(info.value)
    assert not (tmp_path / "run" / "events.jsonl").exists()  # nothing started


@pytest.mark.parametrize("replicate", [False, True])
def test_fsdp_rank_lost_restores_from_peer_copy_else_storage(ray_local, tiny_spec_dict, tmp_path, replicate):
    """FSDP at dp 2, memory snapshots only at checkpoint steps, and rank 1 dies.

    Without peer copies the survivor holds half the state, so the controller restores the
    newest committed checkpoint from storage. With them (the default) the survivor also
    holds rank 1's shard, and the restore comes from memory. Either way the losses are the
    fault-free run's.
    """
    from elastic.faults import Fault, FaultInjector, WorkerFaults, worker_fault

    steps = 12

    def spec(uri):
        return ckpt_spec(
            tiny_spec_dict,
            uri,
            parallel={"zero": 3},
            train={"steps": steps},
            elastic={"min_dp": 2, "max_dp": 2},
            checkpoint={"memory_every_steps": 0, "replicate": replicate},
        )

    slow = [worker_fault("hang", s, rank=0, seconds=0.2) for s in range(1, steps + 1)]
    run_dir = str(tmp_path / "run")
    # The fault-free run: one rank in this process, the whole batch summed there (another
    # reduction order than dp 2, within 1e-5: measured, printed), shared by both cases.
    want = dp1_reference(
        tiny_spec_dict,
        steps,
        str(tmp_path / "ref"),
        parallel={"zero": 3},
        elastic={"max_dp": 1},
        checkpoint={"every_steps": 0},
    )
    injector = FaultInjector([Fault("kill_worker", at_step=5, rank=1)])
    result = ElasticTrainer(
        spec(str(tmp_path / "ckpt")), run_dir=run_dir, callbacks=[injector], step_hook=WorkerFaults(slow)
    ).fit()
    assert result.status == "succeeded" and result.steps == steps and result.failures == 1
    (restore,) = events(run_dir, "restore")
    assert restore["source"] == ("memory" if replicate else "storage") and restore["step"] in (3, 6)
    committed = [e["step"] for e in events(run_dir, "checkpoint", tier="storage") if e["committed"]]
    assert restore["step"] in committed and steps in committed
    got = metrics(run_dir)
    assert sorted(got) == list(range(1, steps + 1))
    assert_same_metrics(got, want, range(1, steps + 1))
