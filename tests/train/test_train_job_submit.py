"""``ray job submit ... -- python tests/train/job_script.py`` against a Ray head with token
authentication (``tests/jobs/test_ray_jobs.py``'s head): a script on ``elastic.train`` runs
as a Ray job, Ray says it SUCCEEDED, and its result and run files are where ``RunConfig``
put them."""

from __future__ import annotations

import json
import os
import re
import secrets

import pytest

from elastic.events import read_events
from tests.jobs.test_ray_jobs import _head, _job_status, _ray

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(400)]

STEPS = 4


def test_a_script_on_elastic_train_runs_as_a_ray_job_on_a_token_authenticated_head(tmp_path_factory, tmp_path):
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    with _head(tmp_path_factory, HOME=str(home), RAY_AUTH_MODE="token") as (env, gcs, url):
        env = {**env, "RAY_AUTH_MODE": "token"}  # the client sends the head's token
        script = ["python", "tests/train/job_script.py", "--storage", str(tmp_path), "--steps", str(STEPS)]
        job = "elastic-train-script"
        proc = _ray(env, "job", "submit", "--address", url, "--working-dir", ".", "--submission-id", job, "--", *script)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert _job_status(env, url, job) == "SUCCEEDED"
        logs = _ray(env, "job", "logs", "--address", url, job, timeout=60)  # the stream may miss lines
        out = logs.stdout + logs.stderr
    run = tmp_path / "submitted"
    assert f"result: step {STEPS}, checkpoint {run}/checkpoint_{STEPS:06d}" in out  # the job's own output
    port = gcs.rsplit(":", 1)[1]  # the head's GCS, as the job's driver names its host
    assert re.search(rf"^cluster: \S+:{port}$", out, re.M), out[-1500:]  # the head's cluster, not an embedded one
    summary = json.load(open(run / "summary.json"))
    assert (summary["status"], summary["steps"], summary["failures"]) == ("succeeded", STEPS, 0)
    events = read_events(str(run))
    assert [e["step"] for e in events if e["kind"] == "step"] == list(range(1, STEPS + 1))
    assert [e["dp"] for e in events if e["kind"] == "job_start"] == [2]
    (stored,) = [e for e in events if e["kind"] == "checkpoint" and e["tier"] == "storage"]
    assert stored["committed"] and stored["step"] == STEPS
    assert os.path.getsize(run / f"checkpoint_{STEPS:06d}" / "model.pt") > 0
    assert os.path.isfile(run / ".elastic" / f"checkpoint_{STEPS:06d}.json")  # its commit record
