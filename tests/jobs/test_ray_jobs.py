"""``ray job submit --working-dir . -- python -m jobs.train CONFIG`` against a real Ray head.

The head is started with the project's own environment (``ray[default]``: the Jobs server
lives in the dashboard), on a private temp dir and free ports, and stopped in teardown. The
head's address file goes to that private temp dir, so no other process joins it by accident.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time

import pytest
from waiting import wait_until

from elastic.events import read_events
from elastic.testing.ports import free_port as _free_port

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


@pytest.fixture
def ray_head(tmp_path_factory):
    """A real head serving the Jobs API; yields (env, gcs address, dashboard URL)."""
    with _head(tmp_path_factory, RAY_AUTH_MODE="disabled") as head:
        yield head


@contextlib.contextmanager
def _head(tmp_path_factory, **extra_env):
    temp = str(tmp_path_factory.mktemp("rayhead"))
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", RAY_USAGE_STATS_ENABLED="0", **extra_env)
    # `ray job stop` waits this long between SIGTERM and SIGKILL (Ray's default: 3 s), read by
    # the head's job supervisor: time for the stop checkpoint (docs/stopping.md).
    env["RAY_JOB_STOP_WAIT_TIME_S"] = "90"
    env.pop("RAY_ADDRESS", None)
    port, dash = _free_port(), _free_port()
    ports = {
        "--ray-client-server-port": _free_port(),
        "--dashboard-agent-grpc-port": _free_port(),
        "--dashboard-agent-listen-port": _free_port(),
        "--metrics-export-port": _free_port(),
        "--runtime-env-agent-port": _free_port(),
        "--node-manager-port": _free_port(),
        "--object-manager-port": _free_port(),
        "--min-worker-port": 0,
    }
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


def test_ray_job_submit_runs_jobs_train_and_ray_job_stop_leaves_a_resumable_checkpoint(ray_head, tmp_path):
    env, gcs, url = ray_head
    config = "examples/quickstart.yaml"  # inside the uploaded working dir
    # 1. A job that runs to the end, and the same spec run directly: same losses.
    job_dir, ref_dir = str(tmp_path / "job"), str(tmp_path / "ref")
    proc = _ray(
        env,
        "job",
        "submit",
        "--address",
        url,
        "--working-dir",
        ".",
        "--submission-id",
        "elastic-ok",
        "--",
        "python",
        "-m",
        "jobs.train",
        config,
        "--run-dir",
        job_dir,
        *_sets(["train.steps=6", "checkpoint.every_steps=3"]),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _job_status(env, url, "elastic-ok") == "SUCCEEDED" and "succeeded" in proc.stdout + proc.stderr
    summary = json.load(open(f"{job_dir}/summary.json"))
    assert summary["status"] == "succeeded" and summary["steps"] == 6 and summary["failures"] == 0
    steps = [e for e in read_events(job_dir) if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 7)) and summary["final_loss"] == pytest.approx(steps[-1]["loss"])
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.cli",
            "run",
            config,
            "--run-dir",
            ref_dir,
            "--address",
            gcs,
            *_sets(["train.steps=6", "checkpoint.every_steps=0"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses = {e["step"]: e["loss"] for e in read_events(ref_dir) if e["kind"] == "step"}
    for e in steps:  # same spec, same DP (2): the same losses
        assert e["loss"] == pytest.approx(ref_losses[e["step"]], rel=1e-5), e["step"]

    # 2. `ray job stop` mid-run: the workers end and a committed checkpoint remains.
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
        *_sets(["train.steps=100000", "checkpoint.every_steps=2"]),  # more than it reaches: `ray job stop` ends it
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _wait(
        lambda: _committed(env, uri) or _job_status(env, url, "elastic-stop") in ("FAILED", "SUCCEEDED"),
        240,
        "a committed checkpoint",
    )
    assert _job_status(env, url, "elastic-stop") == "RUNNING"
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
    stop_step = summary["stop"]["checkpoint_step"]
    assert stop_step == summary["steps"], summary
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
    resumed = str(tmp_path / "resumed")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.cli",
            "run",
            config,
            "--run-dir",
            resumed,
            "--address",
            gcs,
            "--resume",
            *_sets([f"train.steps={newest + 2}", "checkpoint.every_steps=2", f"checkpoint.uri={uri}"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_events(resumed)
    assert [(e["source"], e["step"]) for e in events if e["kind"] == "restore"] == [("storage", newest)]
    assert [e["step"] for e in events if e["kind"] == "step"] == [newest + 1, newest + 2]


@pytest.fixture
def token_head(tmp_path_factory):
    """A head with Ray token authentication, on a machine (HOME) where ~/.ray/auth_token exists,
    as after any ``ray.init`` of Ray 2.60; yields (env without RAY_AUTH_MODE, dashboard URL)."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    with _head(tmp_path_factory, HOME=str(home), RAY_AUTH_MODE="token") as (env, _, url):
        yield {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}, url


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
    tiny model and a run directory appended); without its export the head refuses them."""
    env, url = token_head
    export, submit = _readme_recipe()
    assert "http://127.0.0.1:8265" in submit
    job_dir = str(tmp_path / "job")
    extra = " ".join(f"--set {kv}" for kv in TINY + ["train.steps=3", "checkpoint.every_steps=0"])
    line = f"{submit.replace('http://127.0.0.1:8265', url)} {extra} --run-dir {job_dir}"
    refused = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert refused.returncode != 0
    assert "no authentication token was found" in refused.stdout + refused.stderr, refused.stderr[-2000:]
    proc = subprocess.run(
        ["bash", "-c", f"{export}\n{line}"], capture_output=True, text=True, timeout=400, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.load(open(f"{job_dir}/summary.json"))
    assert summary["status"] == "succeeded" and summary["steps"] == 3
