"""Fixtures for storage tests: a real moto S3 server on loopback, fast retry timing.

The server runs in-process (moto's ``ThreadedMotoServer``) on a fixed free port so that a
test can stop it (clients get "connection refused", as in a real outage) and start it again
on the same port with its buckets intact: moto keeps its state in process memory.
"""

from __future__ import annotations

import logging

import pytest

from storage import RetryPolicy
from storage_testlib import MotoS3


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
