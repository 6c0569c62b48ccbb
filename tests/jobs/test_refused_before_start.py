"""What a run refuses before anything starts: one line naming the field, exit 2, no Ray and
nothing written (docs/cli.md). Cases the spec's own ranges let through, files that are not
what they claim, run directories and checkpoint locations that are unusable or hold
another run, an address where no cluster answers (a corpus that cannot train:
``test_refused_corpus.py``).

Most cases run the CLI's ``main`` in this process: each costs milliseconds, because nothing
past the checks runs. The few that need Ray are at the end (``cluster``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import yaml
from refusal_testlib import QUICKSTART, TINY_MODEL, refused, run_args, write_parquet

from elastic import ray_join
from elastic.errors import SpecError
from elastic.run_dirs import JobIdentity, claim_locations, release_run_dir
from jobs import JobSpec
from jobs.cli import main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _start_without_ray(request):
    """Each case that asserts "no Ray" starts with none (``no_ray``); the cluster cases at the end
    bring their own."""
    if request.node.get_closest_marker("cluster") is None:
        request.getfixturevalue("no_ray")


# --------------------------------------------------------------------------- values the ranges let through

NON_FINITE = [
    "train.lr",
    "train.grad_clip",
    "elastic.collective_timeout_s",
    "elastic.heartbeat_timeout_s",
    "elastic.min_dp_wait_s",
    "elastic.stop_grace_s",
    "elastic.grow_check_s",
    "elastic.straggler_factor",
    "resources.cpus_per_worker",
    "data.stagger_s",
]


@pytest.mark.parametrize("value", [".inf", ".nan", "-.inf", "inf"])
@pytest.mark.parametrize("field", NON_FINITE)
def test_non_finite_numbers_arerefused(capsys, tmp_path, field, value):
    line = refused(capsys, run_args(tmp_path, f"{field}={value}"), field)
    assert "finite" in line or "greater than" in line or "less than" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "sets,field",
    [
        (["seed=-1"], "seed"),
        (["resources.custom={foo: -1}"], "resources.custom.foo"),
        (["resources.custom={CPU: 2}"], "resources.custom"),
        (["checkpoint.storage_options={retry: {deadline_s: .inf}}"], "checkpoint.storage_options.retry.deadline_s"),
        (["model.seq_len=100000000"], "model.seq_len"),
        (["model.seq_len=4000000"], "data.num_samples"),  # 20000 rows of 4M ids: far more than this machine holds
        (["data.num_samples=4000000000"], "data.num_samples"),
        ([f"name={'n' * 300}"], "name"),
        (["resources.custom={a: 1, a: 2}"], "resources.custom.a"),
        (["train.lr=1e300"], "train.lr"),  # overflowed float32 on the workers: 11 worker_errors
        (["elastic.collective_timeout_s=0.001"], "elastic.collective_timeout_s"),  # every start timed out
        (["checkpoint.uri=memory://ck"], "checkpoint.uri"),  # trained, then failed to commit at the end
        (["data.num_samples=47"], "data.num_samples"),  # fewer rows than one batch of 48: rows twice per batch
    ],
    ids=lambda v: v if isinstance(v, str) else v[0][:40],
)
def test_values_that_would_fail_after_ray_started_arerefused(capsys, tmp_path, sets, field):
    refused(capsys, run_args(tmp_path, *sets), field)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- spec files


@pytest.mark.parametrize(
    "content,field",
    [
        (bytes(range(256)) * 2, "config"),
        (b"name: a\nname: b\n", "name"),
        (b"name: x\nmodel: {n_layers: 2}\ntrain:\n  steps: 3\n  steps: 4\n", "train.steps"),
    ],
    ids=["binary", "duplicate-top", "duplicate-nested"],
)
def test_binary_or_duplicate_key_spec_files_arerefused(capsys, tmp_path, content, field):
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(content)
    line = refused(capsys, ["run", str(spec), "--run-dir", str(tmp_path / "run")], field)
    assert "Traceback" not in line
    if field != "config":
        assert "given twice" in line


_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
)  # 9 levels of 10 aliases: 10^9 values from ~330 bytes


@pytest.mark.parametrize(
    "content,says",
    [
        (_BOMB, "expands to more than"),
        ("a: &a [1, *a]\n", "contains itself"),
        ("a: &a {b: *a}\n", "contains itself"),
        ("x: " + "[" * 3000 + "]" * 3000 + "\n", "nested deeper"),
    ],
    ids=["alias-bomb", "cyclic-list", "cyclic-map", "3000-levels"],
)
def test_spec_files_too_large_or_deep_to_be_a_spec_are_refused_fast(capsys, tmp_path, content, says):
    """Before: the bomb hung the CLI in the finite-number walk; a cycle or deep nesting was a
    RecursionError traceback. Now one line naming the file's field, within a second on an idle
    machine (3,000 levels: about 1 s in the parser). The bound below only tells a refusal from
    the old hang (the bomb's 10^9 values took hours), so that a loaded machine cannot fail it."""
    import time

    spec = tmp_path / "spec.yaml"
    spec.write_text(content)
    start = time.monotonic()
    line = refused(capsys, ["run", str(spec), "--run-dir", str(tmp_path / "run")], "config")
    assert says in line and time.monotonic() - start < 60.0
    assert not (tmp_path / "run").exists()


def test_merge_keys_are_not_duplicates(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: &b {n_layers: 2, d_model: 32}\n")  # `base` is not a spec key: read_yaml only
    from elastic.yaml_io import read_yaml

    assert read_yaml(spec, "config") == {"base": {"n_layers": 2, "d_model": 32}}
    spec.write_text("a: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n")
    assert read_yaml(spec, "config")["c"] == {"x": 1, "y": 3}


# --------------------------------------------------------------------------- run directories


def test_run_dir_that_is_a_file_or_under_one_isrefused(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for run_dir in (afile, afile / "sub"):
        line = refused(capsys, ["run", QUICKSTART, "--run-dir", str(run_dir)], "--run-dir")
        assert "is a file" in line
    spec = tmp_path / "spec.yaml"  # the same, from the spec's own key
    spec.write_text(yaml.safe_dump({"name": "x", "run_dir": str(afile)}))
    refused(capsys, ["run", str(spec)], "run_dir")


def test_a_file_where_a_directory_belongs_is_refused_by_every_command(capsys, tmp_path):
    """``data.cache_dir`` and ``train.tensorboard`` (a traceback once Ray had started), ``ckpt
    list``/``verify`` ("no checkpoints", exit 0) and ``report`` ("no such directory") on a file."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for key in ("data.cache_dir", "train.tensorboard"):
        for where in (afile, afile / "sub"):
            line = refused(capsys, run_args(tmp_path, f"{key}={where}"), key)
            assert "is a file" in line, line
    assert not (tmp_path / "run").exists()
    for args in (["ckpt", "list", str(afile)], ["ckpt", "verify", str(afile)]):
        assert main(args) == 2
        assert capsys.readouterr().err == f"error: {afile} is a file, not a checkpoint directory\n"
    assert main(["report", str(afile)]) == 2
    assert capsys.readouterr().err == f"error: RUN_DIR: a file, not a directory: {afile}\n"


def test_an_empty_run_dir_is_refused(capsys, tmp_path, monkeypatch):
    """``--run-dir ''`` ran in ./runs/ (the default), as did ``run_dir: ''``."""
    monkeypatch.chdir(tmp_path)
    refused(capsys, ["run", QUICKSTART, "--run-dir", ""], "--run-dir")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "x", "run_dir": ""}))
    refused(capsys, ["run", str(spec)], "run_dir")
    assert os.listdir(tmp_path) == ["spec.yaml"]


def test_a_spec_that_is_not_a_regular_file_is_refused_at_once(capsys, tmp_path):
    """A FIFO as the spec blocked the CLI for ever (no writer ever came)."""
    fifo = tmp_path / "spec.yaml"
    os.mkfifo(fifo)
    line = refused(capsys, ["run", str(fifo), "--run-dir", str(tmp_path / "run")], "config")
    assert line.endswith("is not a regular file"), line


def test_an_invisible_character_in_a_key_is_shown(capsys, tmp_path):
    """A zero-width space in ``global_batch`` printed ``train.global_batch: unknown key``."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: z\ntrain: {steps: 2, glob\u200bal_batch: 4}\n", encoding="utf-8")
    line = refused(capsys, ["run", str(spec), "--run-dir", str(tmp_path / "run")], "train.glob\\u200bal_batch")
    assert line == "error: train.glob\\u200bal_batch: unknown key (the key holds invisible characters: U+200B)"


def test_run_dir_on_a_read_only_filesystem_isrefused(capsys, tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() == 0:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(target)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    else:
        target.chmod(0o500)
    try:
        line = refused(capsys, ["run", QUICKSTART, "--run-dir", str(target / "run")], "--run-dir")
        assert "Read-only file system" in line or "Permission denied" in line, line
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(target)], check=False)
        else:
            target.chmod(0o700)


def _tiny_spec(tmp_path, name="reuse", d_model=32, ckpt=None) -> str:
    raw = {
        "name": name,
        "model": {"n_layers": 2, "d_model": d_model, "n_heads": 4, "vocab_size": 64, "seq_len": 16},
        "checkpoint": {"every_steps": 2, **({"uri": ckpt} if ckpt else {})},
    }
    path = tmp_path / f"{name}-{d_model}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_run_dir_holding_another_run_is_refused_unless_resume_continues_it(capsys, tmp_path):
    run_dir = tmp_path / "run"
    first = _tiny_spec(tmp_path)
    claim_locations(str(run_dir), "--run-dir", str(run_dir / "checkpoints"), {}, False, JobSpec.from_yaml(first))
    assert json.loads((run_dir / "job.json").read_text())["name"] == "reuse"
    assert oct((run_dir.stat().st_mode) & 0o777) == oct(0o750)  # docs/outputs.md: owner and group only
    release_run_dir(str(run_dir))
    # Created but never started (no events): the next run may take the directory.
    claim_locations(str(run_dir), "--run-dir", str(run_dir / "checkpoints"), {}, False, JobSpec.from_yaml(first))
    release_run_dir(str(run_dir))
    (run_dir / "events.jsonl").write_text('{"ts": 0, "kind": "job_start"}\n')
    line = refused(capsys, ["run", first, "--run-dir", str(run_dir)], "--run-dir")
    assert "holds another run" in line and "--resume" in line
    other_model = _tiny_spec(tmp_path, d_model=64)
    line = refused(capsys, ["run", other_model, "--run-dir", str(run_dir), "--resume"], "--run-dir")
    assert "model.d_model: 32 there, 64 here" in line
    line = refused(
        capsys, ["run", _tiny_spec(tmp_path, name="other"), "--run-dir", str(run_dir), "--resume"], "--run-dir"
    )
    assert "'reuse', not 'other'" in line
    # --resume of the same job and model passes the check (a longer run, another layout: the same run)
    same = JobSpec.from_yaml(first, overrides=["train.steps=500", "elastic.max_dp=1"])
    claim_locations(str(run_dir), "--run-dir", str(run_dir / "checkpoints"), {}, True, same)
    release_run_dir(str(run_dir))


def test_a_run_dir_another_run_holds_is_refused_before_anything_is_written(capsys, tmp_path):
    """Two runs on one ``--run-dir``: the second is refused (exit 2 naming ``--run-dir``), by the
    lock the first takes before it writes, not by a check a second run could pass in between."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir / ".lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        line = refused(capsys, ["run", _tiny_spec(tmp_path), "--run-dir", str(run_dir)], "--run-dir")
        assert f"in use by another run (pid {holder.pid})" in line
        assert sorted(os.listdir(run_dir)) == [".lock"]  # no job.json, nothing else written
    finally:
        holder.communicate(b"", timeout=30)
    claim_locations(str(run_dir), "--run-dir", str(run_dir / "ck"), {}, False, JobSpec.from_yaml(_tiny_spec(tmp_path)))
    release_run_dir(str(run_dir))  # the holder gone, the directory is free again


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
sys.stdin.read()
"""


def test_a_checkpoint_location_holding_checkpoints_is_refused_unless_resume_continues_it(capsys, tmp_path):
    ckpt = tmp_path / "shared-ckpt"
    first = _tiny_spec(tmp_path, ckpt=str(ckpt))
    claim_locations(str(tmp_path / "a"), "--run-dir", str(ckpt), {}, False, JobSpec.from_yaml(first))
    release_run_dir(str(tmp_path / "a"))
    (ckpt / "step_00000002").mkdir()
    line = refused(capsys, ["run", first, "--run-dir", str(tmp_path / "b")], "checkpoint.uri")
    assert "holds checkpoints of another run" in line
    other = _tiny_spec(tmp_path, d_model=64, ckpt=str(ckpt))
    line = refused(capsys, ["run", other, "--run-dir", str(tmp_path / "c"), "--resume"], "checkpoint.uri")
    assert "another model" in line
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()  # nothing written when refused
    claim_locations(str(tmp_path / "d"), "--run-dir", str(ckpt), {}, True, JobSpec.from_yaml(first))
    release_run_dir(str(tmp_path / "d"))


def test_identity_difference_names_what_differs():
    spec = JobSpec.from_yaml(QUICKSTART)
    me = JobIdentity.of(spec)
    assert me.difference(me.to_json()) is None and me.difference(None) is None
    assert "unreadable" in me.difference(b"{not json")


# --------------------------------------------------------------------------- the cluster address


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_no_cluster_answers_isrefused(capsys, tmp_path, monkeypatch):
    port = _closed_port()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for command in (["run", QUICKSTART], ["plan", QUICKSTART], ["sweep", QUICKSTART]):
        line = refused(capsys, [*command, "--address", f"127.0.0.1:{port}"], "--address")
        assert f"no Ray cluster answers at 127.0.0.1:{port}" in line
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "hello"}\n')
    refused(capsys, ["prepare", str(docs), str(tmp_path / "out"), "--address", f"127.0.0.1:{port}"], "--address")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    refused(capsys, run_args(tmp_path), "RAY_ADDRESS")
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-ray-here"))  # no recorded local cluster
    line = refused(capsys, run_args(tmp_path, "--address", "auto")[:2] + ["--address", "auto"], "--address")
    assert "no Ray cluster is running on this machine" in line
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


def test_a_recorded_local_cluster_is_joined_only_with_address_auto(tmp_path, monkeypatch):
    """DESIGN §10: Ray's record of the last local head (in a folder any user can write) is
    never followed silently; ``--address auto`` follows it, if something answers there."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "ray").mkdir()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{listener.getsockname()[1]}")
        assert ray_join.resolve(None) == ray_join.Target(None, "RAY_ADDRESS")  # embedded, not the record
        assert ray_join.resolve("local").address is None
        assert ray_join.resolve("auto").address == "auto"
    with pytest.raises(SpecError) as info:  # the record names a head that is gone
        ray_join.resolve("auto")
    assert info.value.field == "--address"


# --------------------------------------------------------------------------- prepare


def test_prepare_checks_its_input_before_ray(capsys, tmp_path):
    out = tmp_path / "out"
    refused(capsys, ["prepare", str(tmp_path / "missing"), str(out)], "INPUT")
    (tmp_path / "empty").mkdir()
    refused(capsys, ["prepare", str(tmp_path / "empty"), str(out)], "INPUT")
    (tmp_path / "empty" / "a.jsonl").write_text("")
    line = refused(capsys, ["prepare", str(tmp_path / "empty"), str(out)], "INPUT")
    assert "holds no documents" in line
    (tmp_path / "docs.jsonl").write_text('{"body": "hello"}\n')
    refused(capsys, ["prepare", str(tmp_path / "docs.jsonl"), str(out)], "--text-field")
    refused(capsys, ["prepare", str(tmp_path / "docs.jsonl"), str(out), "--tokenizer", "bpe:x"], "--tokenizer")
    # Bad lines failed inside a Ray Data task (a page of traceback); a binary file was tokenized.
    for name, content, says in [
        ("utf8.jsonl", b'{"text": "ok"}\n{"text": "caf\xff"}\n', "line 2 is not UTF-8 (byte 14)"),
        ("list.jsonl", b'{"text": "ok"}\n[1, 2]\n', "line 2 is not a JSON object (a list)"),
        ("cut.jsonl", b'{"text": "ok"}\n{"text": \n', "line 2 is not JSON"),
        ("binary.txt", b"\x7fELF\x02\x01\x01\x00\x00", "line 1 holds a NUL byte: not text (a binary file?)"),
        ("latin1.txt", b"hello\ncaf\xe9\n", "line 2 is not UTF-8 (byte 4)"),
    ]:
        (tmp_path / name).write_bytes(content)
        line = refused(capsys, ["prepare", str(tmp_path / name), str(out)], "INPUT")
        assert line == f"error: INPUT: {tmp_path / name} {says}", line
    assert not out.exists()


# --------------------------------------------------------------------------- the few that start Ray


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_ray_failing_to_start_is_one_line_exit_1(tmp_path):
    """An embedded Ray that cannot start (its temp folder is a file): one line, exit 1."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(blocker)
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "run", QUICKSTART, "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("job failed: could not start an embedded Ray cluster: NotADirectoryError"), proc.stderr


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_rows_found_bad_while_training_end_the_job_at_once(ray_local, capsys, tmp_path):
    """Bad ids past what the pre-flight samples (a file without column statistics, after the
    sampled first one): the rank's ``CorpusError`` ends the job at its first failure (exit 1),
    without retries that would meet it again; and ``prepare`` of documents that are all
    empty fails without leaving a partial corpus."""
    rng = np.random.default_rng(1)
    corpus = tmp_path / "corpus"
    write_parquet(f"{corpus}/part-0.parquet", rng.integers(0, 64, size=(8, 17)))
    write_parquet(f"{corpus}/part-1.parquet", rng.integers(64, 128, size=(64, 17)), statistics=False)
    address = ray_local.get_runtime_context().gcs_address
    args = run_args(tmp_path, *TINY_MODEL, f"data.source={corpus}", "train.steps=6", "train.global_batch=8")
    args += ["--set", "parallel.micro_batch=2", "--set", "elastic.max_dp=1", "--set", "checkpoint.every_steps=0"]
    args += ["--set", "elastic.max_failures=5", "--address", address]
    assert main(args) == 1
    err = capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failures"] == 1 and summary["steps"] == 1, summary
    assert "CorpusError" in err and "model.vocab_size 64 allows 0..63" in err.strip().splitlines()[-1], err[-2000:]

    from elastic.ingest import cli as ingest_cli

    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": ""}\n' * 3)
    out = tmp_path / "prepared"
    parser = __import__("argparse").ArgumentParser()
    ingest_cli.add_arguments(parser)
    assert ingest_cli.main(parser.parse_args([str(docs), str(out)])) == 2
    assert "holds no documents" in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    "sets,field,says",
    [
        (["elastic.max_dp=1000000"], "elastic.max_dp", "fit here"),
        (["parallel.tp=64", "model.n_heads=64", "model.d_model=256"], "parallel.tp", "a replica of 64 workers"),
    ],
    ids=["max-dp", "tp"],
)
def test_more_workers_than_an_embedded_cluster_holds_are_refused_with_what_fits(capsys, tmp_path, sets, field, says):
    """The embedded cluster is sized to the job: `max_dp: 1000000` would start a million torch
    workers on this machine's cores; refused before anything starts, naming what fits."""
    from elastic.api import WORKERS_PER_CORE

    line = refused(capsys, run_args(tmp_path, *sets), field)
    assert says in line and str(WORKERS_PER_CORE * (os.cpu_count() or 1)) in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["train.steps", "train.global_batch", "elastic.max_dp"])
def test_a_boolean_where_a_number_belongs_is_refused(capsys, tmp_path, key):
    """`train.steps: true` was read as 1 by pydantic's lax mode and ran one step."""
    line = refused(capsys, run_args(tmp_path, f"{key}=true"), key)
    assert "must be a number, got true" in line


def test_a_warmup_longer_than_the_run_is_said_before_it_starts(caplog, tmp_path):
    """``train.warmup_steps`` over ``train.steps`` is allowed (the first leg of a run that
    ``--resume`` extends past its warmup) but said, before anything starts."""
    from elastic.api import ElasticTrainer

    spec = JobSpec.from_yaml(_tiny_spec(tmp_path), overrides=["train.steps=4", "train.warmup_steps=9"])
    trainer = ElasticTrainer(spec, run_dir=str(tmp_path / "run"))
    with caplog.at_level("WARNING", logger="elastic.api"):
        trainer._check_before_start()
    release_run_dir(trainer.run_dir)
    said = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert said == [
        "train.warmup_steps (9) is more than train.steps (4): the learning rate stays below train.lr "
        "for the whole run, unless --resume extends it"
    ]


def test_gpus_an_embedded_cluster_lacks_are_refused(capsys, tmp_path):
    """``resources.gpus_per_worker: 1`` on a machine without a GPU waited ``min_dp_wait_s`` for
    capacity that could never come (an embedded cluster has this machine's GPUs)."""
    from elastic.api import check_fits_embedded

    if torch_gpus() == 0:
        line = refused(capsys, run_args(tmp_path, "resources.gpus_per_worker=1"), "resources.gpus_per_worker")
        assert "this machine has 0 that torch can see" in line, line
    spec = JobSpec.from_yaml(QUICKSTART, overrides=["resources.gpus_per_worker=1", "elastic.min_dp=2"])
    with pytest.raises(SpecError, match="2 GPUs are needed for min_dp=2 replicas, and this machine has 1"):
        check_fits_embedded(spec, gpus=1)
    check_fits_embedded(spec, gpus=2)


def torch_gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_a_sweep_memory_budget_that_is_not_a_finite_positive_number_is_refused(capsys, tmp_path, value):
    """``--memory-per-worker-gb nan`` compared false with every estimate: no trial was pruned."""
    line = refused(
        capsys,
        ["sweep", QUICKSTART, "--memory-per-worker-gb", value, "--out", str(tmp_path / "sweep")],
        "--memory-per-worker-gb",
    )
    assert "must be a finite number > 0" in line, line
    assert not (tmp_path / "sweep").exists()
