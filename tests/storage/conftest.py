"""Fixtures for storage tests: fast retry timing (the moto S3 server is in tests/conftest.py).

The server runs in-process (moto's ``ThreadedMotoServer``) on a fixed free port so that a
test can stop it (clients get "connection refused", as in a real outage) and start it again
on the same port with its buckets intact: moto keeps its state in process memory.
"""

from __future__ import annotations

import pytest

from storage import RetryPolicy


@pytest.fixture
def fast_retry() -> RetryPolicy:
    return RetryPolicy(initial_s=0.02, multiplier=2.0, max_s=0.2, deadline_s=5.0, jitter=0.0)
