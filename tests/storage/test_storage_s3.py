"""S3 through a real moto server on loopback: round trip, outages, and no leaked secrets."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
from storage_testlib import (
    FAKE_KEY,
    FAKE_SECRET,
    assemble,
    assert_same_objects,
    model_and_optimizer_state,
    save_sharded,
    target,
)

from storage import CheckpointStore, StorageUnavailable, commit_checkpoint, load_into, write_rank_shard

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def state():
    return model_and_optimizer_state(seed=1)


def full_target(tensors):
    return {k: torch.empty_like(v) for k, v in tensors.items()}


def assert_loads(store, step, tensors):
    t = full_target(tensors)
    load_into(store, t, step=step)
    assert all(torch.equal(t[k], tensors[k]) for k in tensors)


def test_s3_round_trip_with_resharding(moto_s3, s3_bucket, state, fast_retry):
    tensors, objects = state
    store = CheckpointStore(f"s3://{s3_bucket}/run/ckpt", storage_options=moto_s3.options(), retry=fast_retry)
    commit_checkpoint(store, 5, save_sharded(store, 5, tensors, objects), extra={"dp": 4})
    assert [(i.step, i.committed, i.uri) for i in store.list()] == [
        (5, True, f"s3://{s3_bucket}/run/ckpt/step_00000005")
    ]
    assert store.verify(5) == []
    targets = [target(tensors, r, 2) for r in range(2)]
    for t in targets:
        assert_same_objects(load_into(store, t).objects, objects)
    assert all(torch.equal(assemble(targets, k), v) for k, v in tensors.items())


def test_aws_environment_variables_configure_s3(moto_s3, s3_bucket, monkeypatch, fast_retry):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = CheckpointStore(f"s3://{s3_bucket}/env", storage_options={"skip_instance_cache": True}, retry=fast_retry)
    commit_checkpoint(store, 1, [write_rank_shard(store, 1, {"w": torch.arange(10.0)}, 0)])
    t = {"w": torch.empty(10)}
    load_into(store, t)
    assert torch.equal(t["w"], torch.arange(10.0))


def test_outage_during_upload_is_survived(moto_s3, s3_bucket, state, fast_retry):
    tensors, objects = state
    store = CheckpointStore(f"s3://{s3_bucket}/ckpt", storage_options=moto_s3.options(), retry=fast_retry)
    commit_checkpoint(store, 1, save_sharded(store, 1, tensors, objects))

    # 1) the server goes down as a background upload starts, and comes back while it retries
    retried = threading.Event()
    patient = dataclasses.replace(fast_retry, deadline_s=30.0, on_retry=lambda *a: retried.set())
    uploader = CheckpointStore(store.root, storage_options=moto_s3.options(), retry=patient)
    errors: list[BaseException] = []

    def background_upload():
        try:
            commit_checkpoint(uploader, 2, save_sharded(uploader, 2, tensors, objects))
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    moto_s3.stop()
    thread = threading.Thread(target=background_upload)
    thread.start()
    assert retried.wait(20), "the upload should be retrying while the server is down"
    moto_s3.start()
    thread.join(60)
    assert not thread.is_alive() and errors == []
    assert [i.step for i in store.list_committed()] == [1, 2]

    # 2) an outage longer than the deadline fails that checkpoint, and commits nothing
    moto_s3.stop()
    impatient = CheckpointStore(
        store.root, storage_options=moto_s3.options(), retry=dataclasses.replace(fast_retry, deadline_s=0.3)
    )
    with pytest.raises(StorageUnavailable):
        commit_checkpoint(impatient, 3, save_sharded(impatient, 3, tensors, objects))
    moto_s3.start()

    # 3) data uploaded, then the outage hits the commit: not committed until a later commit
    results = save_sharded(store, 4, tensors, objects)
    moto_s3.stop()
    with pytest.raises(StorageUnavailable):
        commit_checkpoint(impatient, 4, results)
    moto_s3.start()
    assert [i.step for i in store.list_committed()] == [1, 2]
    assert_loads(store, 1, tensors)
    assert_loads(store, 2, tensors)
    commit_checkpoint(store, 4, results)  # the results are plain data: the commit can be redone
    assert [i.step for i in store.list_committed()] == [1, 2, 4]
    assert store.verify(4) == []
    report = store.prune(keep=2)  # also removes whatever the failed step 3 left behind
    assert 1 in report.deleted and report.failed == {}
    assert [i.step for i in store.list(include_uncommitted=True)] == [2, 4]


def test_no_secret_in_files_or_logs(moto_s3, s3_bucket, state, caplog, fast_retry):
    tensors, objects = state
    opts = moto_s3.options()
    with caplog.at_level(logging.DEBUG, logger="storage"):
        store = CheckpointStore(f"s3://{s3_bucket}/ckpt", storage_options=opts, retry=fast_retry)
        results = save_sharded(store, 7, tensors, objects)
        # a careless caller passes its options along as "extra" run information
        commit_checkpoint(
            store, 7, results, extra={"storage_options": opts, "note": f"s3://{FAKE_KEY}:{FAKE_SECRET}@x"}
        )
        moto_s3.stop()
        with pytest.raises(StorageUnavailable):  # failures are logged too: with their URIs
            CheckpointStore(
                store.root, storage_options=opts, retry=dataclasses.replace(fast_retry, deadline_s=0.1)
            ).list()
        moto_s3.start()
        load_into(store, full_target(tensors))
        store.prune(keep=1)
    assert any(r.levelno >= logging.WARNING for r in caplog.records)  # the failures were logged
    text = caplog.text + "".join(repr(r.args) for r in caplog.records)
    assert FAKE_KEY not in text and FAKE_SECRET not in text
    blobs = moto_s3.all_objects(s3_bucket)
    assert any(k.endswith("manifest.json") for k in blobs)
    for key, body in blobs.items():
        assert FAKE_KEY.encode() not in body and FAKE_SECRET.encode() not in body, key
    manifest = store.read_manifest(7)
    assert manifest.extra["storage_options"]["secret"] == "***" and manifest.extra["note"] == "s3://***@x"
    assert manifest.extra["storage_options"]["endpoint_url"] == moto_s3.endpoint
