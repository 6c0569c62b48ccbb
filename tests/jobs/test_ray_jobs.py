"""``ray job submit --working-dir . -- python -m jobs.train CONFIG`` against a real Ray head.

The head is started with the project's own environment (``ray[default]``: the Jobs server
lives in the dashboard), on a private temp dir and free ports, and stopped in teardown. The
head's address file goes to that private temp dir, so no other process joins it by accident.
One head, with Ray's token authentication as every shipped cluster config has it, serves
both tests of this file (a module fixture): a head costs some tens of seconds on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from elastic_testlib import single_rank_metrics
from waiting import wait_until

from elastic.events import read_events
from elastic.testing.ports import free_ports
from jobs import JobSpec

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
TINY = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=4",
    "model.vocab_size=64",
    "model.seq_len=16",
    "data.num_samples=2000",
    "parallel.micro_batch=2",
    "elastic.min_dp=1",
    "elastic.max_dp=2",
    "train.global_batch=8",
    "train.lr=3.0e-3",
    "elastic.heartbeat_timeout_s=20",
    "elastic.collective_timeout_s=40",
]


def _wait(condition, timeout: float, what: str, every: float = 0.5):
    return wait_until(condition, timeout, what, every)


@contextlib.contextmanager
def _head(tmp_path_factory, **extra_env):
    # Directly under /tmp: Ray's socket paths live below it and must stay under 108 bytes
    # (under xdist, tmp_path_factory's ``.../popen-gw1/rayhead0/session_...`` did not).
    temp = tempfile.mkdtemp(prefix="rayhead-", dir="/tmp")
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0", **extra_env)
    # `ray job stop` waits this long between SIGTERM and SIGKILL (Ray's default: 3 s), read by
    # the head's job supervisor: time for the stop checkpoint (docs/stopping.md).
    env["RAY_JOB_STOP_WAIT_TIME_S"] = "90"
    env.pop("RAY_ADDRESS", None)
    port, dash, *picked = free_ports(9)  # distinct: one at a time, two components got the same
    names = (
        "--ray-client-server-port",
        "--dashboard-agent-grpc-port",
        "--dashboard-agent-listen-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
        "--node-manager-port",
        "--object-manager-port",
    )
    ports = {**dict(zip(names, picked, strict=True)), "--min-worker-port": 0}
    cmd = [
        f"{BIN}/ray",
        "start",
        "--head",
        f"--temp-dir={temp}",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        "--num-cpus=3",
        "--object-store-memory=200000000",
        "--disable-usage-stats",
        *(f"{k}={v}" for k, v in ports.items()),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        url = f"http://127.0.0.1:{dash}"
        _wait(
            lambda: (
                subprocess.run(
                    [f"{BIN}/ray", "job", "list", "--address", url], capture_output=True, env=env, timeout=60
                ).returncode
                == 0
            ),
            120,
            "the Jobs API to answer",
            every=1,
        )
        yield env, f"127.0.0.1:{port}", url
    finally:
        # Stop only this head: its processes are found by their private temp dir (``ray stop``
        # would stop every Ray of this user on the machine).
        _stop_head(temp)


def _stop_head(temp: str) -> None:
    import signal

    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = open(f"/proc/{name}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if temp in cmdline and int(name) != os.getpid():
                pids.append(int(name))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM:
            deadline = time.monotonic() + 3  # a private head: no need to wait long for its SIGTERM
            while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
                time.sleep(0.2)
    shutil.rmtree(temp, ignore_errors=True)


def _ray(env, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([f"{BIN}/ray", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _job_status(env, url, job_id) -> str:
    proc = _ray(env, "job", "status", "--address", url, job_id, timeout=60)
    out = proc.stdout + proc.stderr
    for status in ("SUCCEEDED", "FAILED", "STOPPED", "RUNNING", "PENDING"):
        if status.lower() in out.lower():  # "Job 'x' succeeded", "Status for job 'x': RUNNING"
            return status
    return "?" + out[-800:]


def _sets(extra):
    return [a for kv in TINY + extra for a in ("--set", kv)]


def _committed(env, uri) -> list[int]:
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "ckpt", "list", uri, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    return (
        [r["step"] for r in json.loads(proc.stdout) if r["committed"]]
        if proc.returncode == 0 and proc.stdout.strip()
        else []
    )


def _committed_in_events(run_dir: str) -> list[int]:
    """The steps of the storage checkpoints a run's events report committed (none yet: [])."""
    try:
        events = read_events(run_dir)
        return [e["step"] for e in events if e["kind"] == "checkpoint" and e["tier"] == "storage" and e["committed"]]
    except (OSError, ValueError):  # not written yet, or a line being written
        return []


# A learning-rate schedule that does not depend on ``train.steps`` (a 5-step warmup, then
# constant): the stopped job (100000 steps), its resume and a reference run of fewer steps
# follow one trajectory, so they can be compared step by step. The warmup still makes the
# rate depend on the step, so a resume that restarted the schedule would show in the losses.
STEP_FREE_SCHEDULE = ["train.warmup_steps=5", "train.min_lr_ratio=1.0"]
SLOW_S = 0.2


def test_ray_job_submit_runs_jobs_train_and_ray_job_stop_leaves_a_resumable_checkpoint(token_head, tmp_path):
    """A job submitted with `ray job submit` runs `jobs.train`; `ray job stop` ends it at a step
    boundary with a committed checkpoint of that step and no worker left; `--resume` goes on
    from there, and the job's steps, then the resumed ones, have the losses of a direct
    one-rank run never stopped (rel 1e-5). (A submitted job that runs to SUCCEEDED: the
    README recipe's test, on the same head.)"""
    env, gcs, url = token_head
    env = {**env, "RAY_AUTH_MODE": "token"}  # the head requires Ray's token
    config = "examples/quickstart.yaml"  # inside the uploaded working dir
    stop_dir = str(tmp_path / "stopped")
    uri = f"{stop_dir}/checkpoints"
    proc = _ray(
        env,
        "job",
        "submit",
        "--address",
        url,
        "--working-dir",
        ".",
        "--submission-id",
        "elastic-stop",
        "--no-wait",
        "--",
        "python",
        "-m",
        "jobs.train",
        config,
        "--run-dir",
        stop_dir,
        # More steps than it reaches: `ray job stop` ends it. Rank 0 paced (SLOW_S of work
        # before each step, the losses unchanged) so that it stops after tens of steps, not
        # hundreds: the reference run below replays every step the job made.
        "--fault",
        f"slow@1:rank=0:seconds={SLOW_S}",
        *_sets(["train.steps=100000", "checkpoint.every_steps=2", *STEP_FREE_SCHEDULE]),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The job's own events say when a checkpoint was committed (read here: the run dir is
    # local); Ray's status, a CLI call of some seconds, only every 10 s, for a job that ended.
    asked = [time.monotonic()]

    def committed_or_ended() -> bool:
        if _committed_in_events(stop_dir) or os.path.exists(f"{stop_dir}/summary.json"):
            return True
        if time.monotonic() - asked[0] < 10:
            return False
        asked[0] = time.monotonic()
        return _job_status(env, url, "elastic-stop") in ("FAILED", "SUCCEEDED", "STOPPED")

    _wait(committed_or_ended, 240, "a committed checkpoint", every=0.2)
    assert _job_status(env, url, "elastic-stop") == "RUNNING"
    # `ray job stop` waits for the job to end (without --no-wait).
    assert _ray(env, "job", "stop", "--address", url, "elastic-stop", timeout=120).returncode == 0
    _wait(lambda: _job_status(env, url, "elastic-stop") == "STOPPED", 120, "the job to be STOPPED")

    def no_train_worker_alive():
        out = _ray(env, "list", "actors", "--address", url, "--filter", "state=ALIVE", "--format", "json", timeout=60)
        last[:] = [out.returncode, out.stdout[-1500:], out.stderr[-1500:]]
        if out.returncode == 0 and "No resource in the cluster" in out.stdout:  # how `ray list` prints []
            return True
        text = out.stdout[out.stdout.find("[") :] if "[" in out.stdout else ""
        try:
            actors = json.loads(text)
        except ValueError:
            return False
        return out.returncode == 0 and not [a for a in actors if "TrainWorker" in a.get("class_name", "")]

    last: list = []

    try:
        _wait(no_train_worker_alive, 120, "the stopped job's workers to end", every=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last `ray list actors`: {last}") from None
    # SIGTERM stopped it at a step boundary with a checkpoint of that step (docs/stopping.md).
    summary = json.load(open(f"{stop_dir}/summary.json"))
    assert summary["status"] == "stopped" and summary["stop"]["signal"] == "SIGTERM", summary
    assert summary["failures"] == 0, summary
    stop_step = summary["stop"]["checkpoint_step"]
    assert stop_step == summary["steps"], summary
    steps = [e for e in read_events(stop_dir) if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, stop_step + 1))
    assert summary["final_loss"] == pytest.approx(steps[-1]["loss"])
    committed = _committed(env, uri)
    assert committed and max(committed) == stop_step and all(s % 2 == 0 or s == stop_step for s in committed)
    newest = max(committed)
    verify = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "ckpt", "verify", uri],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    # Uncommitted attempts may remain; every committed one verifies.
    assert verify.returncode == 0, verify.stdout + verify.stderr

    def direct_run(run_dir, *extra, sets):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "jobs.cli",
                "run",
                config,
                "--run-dir",
                run_dir,
                "--address",
                gcs,
                *extra,
                *_sets([f"train.steps={newest + 2}", *STEP_FREE_SCHEDULE, *sets]),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return read_events(run_dir)

    resumed = direct_run(
        str(tmp_path / "resumed"), "--resume", sets=["checkpoint.every_steps=2", f"checkpoint.uri={uri}"]
    )
    assert [(e["source"], e["step"]) for e in resumed if e["kind"] == "restore"] == [("storage", newest)]
    resumed_steps = [e for e in resumed if e["kind"] == "step"]
    assert [e["step"] for e in resumed_steps] == [newest + 1, newest + 2]
    # The same spec never stopped, trained by one rank in this process (``single_rank_metrics``:
    # the same samples per step, the whole batch on one rank): the same losses.
    overrides = [*TINY, f"train.steps={newest + 2}", *STEP_FREE_SCHEDULE, "checkpoint.every_steps=0"]
    ref = single_rank_metrics(JobSpec.from_yaml(os.path.join(ROOT, config), overrides=overrides), str(tmp_path / "ref"))
    ref_losses = {step: loss for step, (loss, _) in ref.items()}
    assert sorted(ref_losses) == list(range(1, newest + 3))
    for e in steps + resumed_steps:
        assert e["loss"] == pytest.approx(ref_losses[e["step"]], rel=1e-5), e["step"]


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """One head for this file's tests, with Ray token authentication, on a machine (HOME)
    where ~/.ray/auth_token exists, as after any ``ray.init`` of Ray 2.60; yields (env without
    RAY_AUTH_MODE, gcs address, dashboard URL): a client sends the token only once it sets
    ``RAY_AUTH_MODE=token``."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    with _head(tmp_path_factory, HOME=str(home), RAY_AUTH_MODE="token") as (env, gcs, url):
        yield {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}, gcs, url


def _readme_recipe() -> tuple[str, str]:
    """The README's Ray Jobs recipe: its `export RAY_AUTH_MODE=...` line and its `ray job submit` line."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = next(b for b in text.split("```bash")[1:] if "ray job submit" in b.split("```")[0]).split("```")[0]
    lines = [line.split("  #")[0].strip() for line in block.splitlines()]
    export = next(line for line in lines if line.startswith("export RAY_AUTH_MODE="))
    submit = next(line for line in lines if line.startswith("ray job submit"))
    return export, submit


def test_readme_ray_jobs_recipe_works_as_written_with_token_auth(token_head, tmp_path):
    """The README's lines run through bash as written (the address pointed at this head, a
    tiny model and a run directory appended); without its export the head refuses them. With
    it, the job runs `jobs.train` to the end and Ray reports it SUCCEEDED."""
    env, _, url = token_head
    export, submit = _readme_recipe()
    assert '"$ELASTIC_JOBS_ADDRESS"' in submit  # what `cluster_configs/local.sh up` printed
    job_dir = str(tmp_path / "job")
    extra = " ".join(f"--set {kv}" for kv in TINY + ["train.steps=3", "checkpoint.every_steps=0"])
    printed = '"$ELASTIC_JOBS_ADDRESS"'
    line = f"{submit.replace(printed, url)} {extra} --run-dir {job_dir}"
    refused = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert refused.returncode != 0
    assert "no authentication token was found" in refused.stdout + refused.stderr, refused.stderr[-2000:]
    proc = subprocess.run(
        ["bash", "-c", f"{export}\n{line}"], capture_output=True, text=True, timeout=400, env=env, cwd=ROOT
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job_id = re.search(r"Job '([^']+)' succeeded", out)
    assert job_id, out[-3000:]
    assert _job_status({**env, "RAY_AUTH_MODE": "token"}, url, job_id.group(1)) == "SUCCEEDED"
    summary = json.load(open(f"{job_dir}/summary.json"))
    assert summary["status"] == "succeeded" and summary["steps"] == 3 and summary["failures"] == 0, summary
    steps = [e for e in read_events(job_dir) if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3] and summary["final_loss"] == pytest.approx(steps[-1]["loss"])
