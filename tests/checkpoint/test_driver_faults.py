"""Faults around the driver and the storage tier, triggered for real through the CLI.

* The driver (``elastic run``) is SIGKILLed while a background S3 upload is in flight.
* The newest committed checkpoint is damaged before ``elastic run --resume``.
* The S3 secret never reaches the run directory, the bucket or Ray's own logs.

S3 is a real moto server on loopback. The upload is caught in flight deterministically: the
server holds the first data-file PUT of a chosen step until the test releases it, and the
test kills the driver as soon as that PUT has arrived (an event, not a sleep).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid

import pytest
import yaml
from ckpt_testlib import ckpt_raw, dp1_reference, events, losses
from waiting import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

STEPS = 9  # checkpoints at 3, 6, 9


def _cli(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _reference(tiny, tmp_path) -> dict[int, float]:
    """The fault-free losses at dp 1 (one rank in this process: the CLI's dp-1 reduction order)."""
    ref = dp1_reference(tiny, STEPS, str(tmp_path / "ref"), elastic={"max_dp": 1}, checkpoint={"every_steps": 0})
    return {step: loss for step, (loss, _) in ref.items()}


def _assert_resumed(run_dir: str, from_step: int, reference: dict[int, float]) -> None:
    assert [(e["source"], e["step"]) for e in events(run_dir, "restore")] == [("storage", from_step)]
    got = losses(run_dir)
    assert sorted(got) == list(range(from_step + 1, STEPS + 1))  # exactly the next steps, and all of them
    for step in got:
        # Same reduction order as the reference (dp 1): the tightest tolerance holds.
        assert got[step] == pytest.approx(reference[step], rel=1e-5), step


# --------------------------------------------------------------------------- corrupt newest


def test_damaged_newest_checkpoint_resumes_from_the_previous_one(ray_local, tiny_spec_dict, tmp_path):
    uri = str(tmp_path / "ckpt")
    reference = _reference(tiny_spec_dict, tmp_path)
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(ckpt_raw(tiny_spec_dict, uri, train={"steps": 6}, elastic={"max_dp": 1})))
    address = ray_local.get_runtime_context().gcs_address
    first = _cli("run", str(config), "--run-dir", str(tmp_path / "first"), "--address", address)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [(e["step"], e["committed"]) for e in events(str(tmp_path / "first"), "checkpoint", tier="storage")] == [
        (3, True),
        (6, True),
    ]
    shard = sorted(p for p in os.listdir(f"{uri}/step_00000006") if p.endswith(".distcp"))[0]
    with open(f"{uri}/step_00000006/{shard}", "r+b") as f:  # flip one byte inside the tensor data
        f.seek(-20, 2)
        byte = f.read(1)
        f.seek(-20, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    run_dir = str(tmp_path / "resumed")
    proc = _cli(
        "run", str(config), "--run-dir", run_dir, "--resume", "--set", f"train.steps={STEPS}", "--address", address
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = [line for line in proc.stderr.splitlines() if "damaged" in line]
    assert len(warning) == 1 and "step 6" in warning[0] and shard in warning[0] and "crc32" in warning[0], proc.stderr
    _assert_resumed(run_dir, 3, reference)
    assert json.load(open(f"{run_dir}/summary.json"))["status"] == "succeeded"


# --------------------------------------------------------------------------- S3 helpers


class GatedS3:
    """A moto S3 server that holds the first PUT whose path matches ``hold`` until released."""

    def __init__(self, hold: str):
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self.hold = re.compile(hold)
        self.arrived, self.release, self.done = threading.Event(), threading.Event(), threading.Event()
        self.held_path: str | None = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        app = DomainDispatcherApplication(create_backend_app)
        gate = self

        def gated(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if environ["REQUEST_METHOD"] == "PUT" and gate.held_path is None and gate.hold.search(path):
                gate.held_path = path
                gate.arrived.set()
                gate.release.wait(120)
                try:
                    return app(environ, start_response)
                finally:
                    gate.done.set()
            return app(environ, start_response)

        class Server(ThreadedMotoServer):
            def _server_entry(self) -> None:
                self._server = make_server("127.0.0.1", port, gated, True, request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self.server = Server(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.release.set()
        self.server.stop()


def _s3_client(endpoint: str, secret: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="AKIATESTKEY",
        aws_secret_access_key=secret,
        region_name="us-east-1",
    )


def _s3_options(endpoint: str, secret: str) -> dict:
    return {
        "endpoint_url": endpoint,
        "key": "AKIATESTKEY",
        "secret": secret,
        "region": "us-east-1",
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 30},
        "skip_instance_cache": True,
    }


def _aws_env(endpoint: str, secret: str) -> dict:
    return dict(
        os.environ,
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="AKIATESTKEY",
        AWS_SECRET_ACCESS_KEY=secret,
        AWS_DEFAULT_REGION="us-east-1",
    )


def _alive(pid: int) -> bool:
    """Still running: a zombie has exited, only its parent has not reaped it yet. (No
    psutil: a clean install has it only through Ray's vendored copy.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(condition, timeout: float, what: str, every: float = 0.2):
    return wait_until(condition, timeout, what, every)


# --------------------------------------------------------------------------- driver death


def test_driver_killed_mid_upload_leaves_nothing_half_committed(ray_local, tiny_spec_dict, tmp_path):
    import ray._private.state as ray_state

    secret = f"drv-{uuid.uuid4().hex}"
    gate = GatedS3(hold=r"/step_00000006/__\d+_\d+\.distcp$")  # step 6's first data file
    try:
        bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
        _s3_client(gate.endpoint, secret).create_bucket(Bucket=bucket)
        uri = f"s3://{bucket}/ckpt"
        reference = _reference(tiny_spec_dict, tmp_path)
        config = tmp_path / "spec.yaml"
        config.write_text(
            yaml.safe_dump(
                ckpt_raw(
                    tiny_spec_dict,
                    uri,
                    train={"steps": STEPS},
                    elastic={"max_dp": 1},
                    checkpoint={"storage_options": _s3_options(gate.endpoint, secret)},
                )
            )
        )
        address = ray_local.get_runtime_context().gcs_address
        pgs_before = set(ray_state.state.placement_group_table())
        driver = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jobs.cli",
                "run",
                str(config),
                "--run-dir",
                str(tmp_path / "killed"),
                "--address",
                address,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _wait(lambda: gate.arrived.is_set() or driver.poll() is not None, 180, "step 6's upload to start")
            assert gate.arrived.is_set(), f"the driver ended first: {driver.stderr.read()[-2000:]}"
            # Training goes on meanwhile; wait until the driver has committed step 3 (its
            # upload finished before step 6's began), so there is something to resume from.
            client = _s3_client(gate.endpoint, secret)
            _wait(
                lambda: client.list_objects_v2(Bucket=bucket, Prefix="ckpt/step_00000003/COMMITTED").get("KeyCount"),
                60,
                "step 3 to be committed",
            )
            assert driver.poll() is None and not gate.done.is_set()
            driver.send_signal(signal.SIGKILL)  # mid-upload: step 6's PUT is held by the server
            assert driver.wait(30) == -signal.SIGKILL
        finally:
            if driver.poll() is None:
                driver.kill()
        # The cluster notices: the dead driver's job ends, its actors die and its placement
        # groups are removed.
        job = _wait(
            lambda: next((j for j in ray_state.jobs() if j["DriverPid"] == driver.pid and j["IsDead"]), None),
            60,
            "the dead driver's job to be marked dead",
        )
        _wait(
            lambda: all(a["State"] == "DEAD" for a in ray_state.actors().values() if a["JobID"] == job["JobID"]),
            60,
            "the dead job's actors to be DEAD",
        )
        assert any(a["JobID"] == job["JobID"] for a in ray_state.actors().values()), "the run had no actors?"
        # DEAD in Ray's table comes before the process is gone: an upload thread could still
        # write once the held PUT returns. Wait for the processes themselves to exit.
        pids = [a["Pid"] for a in ray_state.actors().values() if a["JobID"] == job["JobID"] and a.get("Pid")]
        _wait(lambda: not any(_alive(pid) for pid in pids), 60, "the dead job's worker processes to exit")
        _wait(
            lambda: all(
                p["state"] == "REMOVED"
                for pid, p in ray_state.state.placement_group_table().items()
                if pid not in pgs_before
            ),
            60,
            "the dead run's placement groups to be removed",
        )
        gate.release.set()  # the held PUT may now land: a data file of a checkpoint never committed
        _wait(gate.done.is_set, 60, "the held upload to finish")

        env = _aws_env(gate.endpoint, secret)
        listed = _cli("ckpt", "list", uri, "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        rows = {r["step"]: r["committed"] for r in json.loads(listed.stdout)}
        assert rows.get(3) is True and rows.get(6) is not True and 9 not in rows, rows
        assert [s for s, c in rows.items() if c] == [3]
        verify = _cli("ckpt", "verify", uri, env=env)
        assert verify.returncode == 0 and verify.stdout.split() == ["step", "3:", "ok"], verify.stdout + verify.stderr

        run_dir = str(tmp_path / "resumed")
        proc = _cli("run", str(config), "--run-dir", run_dir, "--resume", "--address", address)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _assert_resumed(run_dir, 3, reference)
        final = {r["step"]: r["committed"] for r in json.loads(_cli("ckpt", "list", uri, "--json", env=env).stdout)}
        assert final == {3: True, 6: True, 9: True}  # the resumed run rewrote step 6 and committed it
        assert _cli("ckpt", "verify", uri, env=env).returncode == 0
    finally:
        gate.stop()


# --------------------------------------------------------------------------- secrets


def _ray_session_dir(ray_module) -> str:
    import ray._private.worker as ray_worker

    return ray_worker._global_node.get_session_dir_path()


def test_secret_never_reaches_run_dir_bucket_or_ray_logs(ray_local, tiny_spec_dict, tmp_path, moto_s3, s3_bucket):
    """A secret unique to this test, given in the spec's storage_options, with an S3 checkpoint
    per step and a storage restore (``--resume``), through the CLI on the shared Ray."""
    secret = f"sEcReT/{uuid.uuid4().hex}+only"
    uri = f"s3://{s3_bucket}/secret-run"
    options = dict(moto_s3.options(), secret=secret)
    config = tmp_path / "spec.yaml"
    config.write_text(
        yaml.safe_dump(
            ckpt_raw(
                tiny_spec_dict,
                uri,
                train={"steps": 3},
                elastic={"max_dp": 2},
                checkpoint={"every_steps": 1, "storage_options": options},
            )
        )
    )
    address = ray_local.get_runtime_context().gcs_address
    run_dir = tmp_path / "run"
    outputs = []
    for args in ([], ["--resume", "--set", "train.steps=4"]):
        proc = _cli("run", str(config), "--run-dir", str(run_dir), "--address", address, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs += [proc.stdout, proc.stderr]
    assert [e["step"] for e in events(str(run_dir), "restore")] == [3]
    session = _ray_session_dir(ray_local)
    ray_files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(session, "logs")) for f in fs]
    assert any(os.path.basename(f).startswith("worker-") for f in ray_files), "no worker logs found"
    places = {str(p): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    places.update({f"s3://{s3_bucket}/{k}": v for k, v in moto_s3.all_objects(s3_bucket).items()})
    for path in ray_files:
        try:
            places[path] = open(path, "rb").read()
        except OSError:
            pass  # a log rotated away meanwhile
    places.update({"cli output": "".join(outputs).encode()})
    assert len(places) > 10
    leaks = [where for where, data in places.items() if secret.encode() in data]
    assert leaks == [], f"the secret leaked into {leaks}"
