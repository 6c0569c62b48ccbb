"""Fixtures of the checkpoint tests: the moto S3 server of ``tests/storage``, reused.

``storage_testlib`` lives in ``tests/storage``; it is put on ``sys.path`` here (the suite
has no packages, so each test folder imports its helpers by plain module name). The
server is this folder's own session-scoped instance, so either folder runs alone.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "storage"))

from storage_testlib import MotoS3  # noqa: E402


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
