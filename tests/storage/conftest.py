"""Fixtures for storage tests: a real moto S3 server on loopback, fast retry timing.

The server runs in-process (moto's ``ThreadedMotoServer``) on a fixed free port so that a
test can stop it (clients get "connection refused", as in a real outage) and start it again
on the same port with its buckets intact: moto keeps its state in process memory.
"""

from __future__ import annotations

import logging
import socket
import uuid

import pytest

from storage import RetryPolicy

FAKE_KEY = "AKIAFAKEKEY0TESTONLY"
FAKE_SECRET = "fAkE/SeCrEt+0nly4Tests0000000000000000000"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoS3:
    """A moto S3 server that can be stopped and restarted on the same loopback port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def options(self) -> dict:
        """storage_options for this server; one botocore attempt so *our* retries are tested."""
        return {"endpoint_url": self.endpoint, "key": FAKE_KEY, "secret": FAKE_SECRET, "region": "us-east-1",
                "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
                "skip_instance_cache": True}

    def new_bucket(self) -> str:
        import boto3

        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=FAKE_KEY,
                              aws_secret_access_key=FAKE_SECRET, region_name="us-east-1")
        client.create_bucket(Bucket=name)
        return name

    def all_objects(self, bucket: str) -> dict[str, bytes]:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=FAKE_KEY,
                              aws_secret_access_key=FAKE_SECRET, region_name="us-east-1")
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
                for o in page.get("Contents", [])]
        return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


@pytest.fixture(scope="session")
def moto_s3():
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


@pytest.fixture
def fast_retry() -> RetryPolicy:
    return RetryPolicy(initial_s=0.02, multiplier=2.0, max_s=0.2, deadline_s=5.0, jitter=0.0)
