"""Storage protocol over local paths, file:// and memory://; redaction; retry classification."""

from __future__ import annotations

import errno
import uuid

import pytest

from storage import RetryPolicy, StorageUnavailable, call_with_retry, is_transient, open_storage, redact, redact_uri
from storage.fs import s3_options


@pytest.fixture(params=["plain", "file", "memory"])
def base_uri(request, tmp_path):
    if request.param == "plain":
        return str(tmp_path / "root")
    if request.param == "file":
        return f"file://{tmp_path}/root"
    return f"memory://fs-test-{uuid.uuid4().hex}"


def test_roundtrip_operations(base_uri):
    st = open_storage(base_uri)
    a, b = st.join(base_uri, "d", "a.bin"), st.join(base_uri, "d", "sub", "b.bin")
    st.put_bytes(a, b"0123456789")
    with st.open(b, "wb") as f:
        for _ in range(3):
            f.write(b"xyz")
    assert st.get_bytes(a) == b"0123456789"
    assert st.get_bytes(a, 2, 5) == b"234"
    with st.open(b) as f:
        assert f.read() == b"xyzxyzxyz"
    assert st.exists(a) and not st.exists(st.join(base_uri, "nope"))
    assert st.ls(st.join(base_uri, "d")) == ["a.bin", "sub"]
    assert st.sizes(st.join(base_uri, "d")) == {"a.bin": 10}
    assert st.size(b) == 9
    assert st.ls(st.join(base_uri, "missing")) == []
    st.rm(st.join(base_uri, "d"))
    assert not st.exists(a) and not st.exists(b)
    st.rm(st.join(base_uri, "d"))  # missing is fine


def test_failed_streaming_write_publishes_nothing(base_uri):
    st = open_storage(base_uri)
    uri = st.join(base_uri, "partial.bin")
    with pytest.raises(RuntimeError, match="boom"):
        with st.open(uri, "wb") as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert not st.exists(uri)


def test_redact_replaces_every_credential():
    opts = {
        "endpoint_url": "http://127.0.0.1:9000",
        "key": "AK",
        "secret": "SK",
        "token": "T",
        "client_kwargs": {"aws_secret_access_key": "SK2", "region_name": "us-east-1"},
        "password": "pw",
        "sse_kms_key_id": "kms",
        "listings": [{"auth_token": "x"}],
        "anon": False,
        "tokens_per_s": 812.5,
        "credentials": {"user": "u"},
        "key_count": 3,
        "note": "s3://K:S@b/x",
    }
    assert redact(opts) == {
        "endpoint_url": "http://127.0.0.1:9000",
        "key": "***",
        "secret": "***",
        "token": "***",
        "client_kwargs": {"aws_secret_access_key": "***", "region_name": "us-east-1"},
        "password": "***",
        "sse_kms_key_id": "***",
        "listings": [{"auth_token": "***"}],
        "anon": False,
        "tokens_per_s": 812.5,
        "credentials": "***",
        "key_count": 3,
        "note": "s3://***@b/x",
    }
    assert opts["key"] == "AK"  # a copy, not in place
    assert redact_uri("s3://AK:SK@bucket/x") == "s3://***@bucket/x"
    assert redact_uri("s3://bucket/x") == "s3://bucket/x"
    assert redact_uri("copy s3://AK:a/b+c@bucket/x to /tmp") == "copy s3://***@bucket/x to /tmp"


def test_s3_options_from_env_and_options(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    assert s3_options({}) == {"client_kwargs": {"endpoint_url": "http://env:1", "region_name": "eu-west-3"}}
    got = s3_options({"endpoint_url": "http://opt:2", "aws_access_key_id": "AK", "aws_secret_access_key": "SK"})
    assert got == {
        "key": "AK",
        "secret": "SK",
        "client_kwargs": {"endpoint_url": "http://opt:2", "region_name": "eu-west-3"},
    }


@pytest.mark.parametrize(
    "exc, transient",
    [
        (ConnectionRefusedError(), True),
        (TimeoutError(), True),
        (OSError(errno.EIO, "io"), True),
        (FileNotFoundError(), False),
        (PermissionError(), False),
        (OSError(errno.EINVAL, "bad"), False),
        (ValueError(), False),
        (type("EndpointConnectionError", (Exception,), {})(), True),
    ],
)
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient


def test_retry_recovers_then_gives_up():
    calls, retried = [], []
    policy = RetryPolicy(
        initial_s=0.001, max_s=0.002, deadline_s=0.2, jitter=0.0, on_retry=lambda what, n, e, s: retried.append(n)
    )

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset")
        return "ok"

    assert call_with_retry(flaky, policy, "flaky") == "ok" and retried == [1, 2]

    def down():
        raise ConnectionRefusedError("refused")

    with pytest.raises(StorageUnavailable) as info:
        call_with_retry(down, policy, "down")
    assert info.value.attempts > 1 and isinstance(info.value.last_error, ConnectionRefusedError)
    with pytest.raises(FileNotFoundError):  # permanent: no retry at all
        call_with_retry(lambda: (_ for _ in ()).throw(FileNotFoundError("x")), policy, "missing")


def test_storage_imports_nothing_upstream():
    """Dependencies point jobs -> elastic -> storage; storage must also stay free of Ray."""
    import subprocess
    import sys

    code = (
        "import sys, storage, storage.dcp, storage.store, storage.fs\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'elastic', 'jobs'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
