"""What a run refuses before anything starts: one line naming the field, exit 2, no Ray and
nothing written (docs/cli.md). Cases the spec's own ranges let through, files that are not
what they claim, run directories and checkpoint locations that are unusable or hold
another run, a corpus that cannot train, an address where no cluster answers.

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
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from elastic import ray_join
from elastic.errors import SpecError
from elastic.run_dirs import JobIdentity, claim_locations
from elastic.testing.corpora import write_corpus
from jobs import JobSpec
from jobs.cli import main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _start_without_ray(request):
    """Each case that asserts "no Ray" starts with none (``no_ray``); the cluster cases at the end
    bring their own."""
    if request.node.get_closest_marker("cluster") is None:
        request.getfixturevalue("no_ray")


QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart.yaml")
TINY_MODEL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.vocab_size=64", "model.seq_len=16"]


def _refused(capsys, args: list[str], field: str, *, exit_code: int = 2) -> str:
    """Run the CLI; it must exit ``exit_code`` with one line naming ``field``, and start no Ray."""
    import ray

    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == exit_code, err
    assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not ray.is_initialized()
    return err[0]


def _run_args(tmp_path, *sets: str, config: str = QUICKSTART) -> list[str]:
    args = ["run", config, "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    return args


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
def test_non_finite_numbers_are_refused(capsys, tmp_path, field, value):
    line = _refused(capsys, _run_args(tmp_path, f"{field}={value}"), field)
    assert "finite" in line or "greater than" in line, line
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
    ],
    ids=lambda v: v if isinstance(v, str) else v[0][:40],
)
def test_values_that_would_fail_after_ray_started_are_refused(capsys, tmp_path, sets, field):
    _refused(capsys, _run_args(tmp_path, *sets), field)
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
def test_binary_or_duplicate_key_spec_files_are_refused(capsys, tmp_path, content, field):
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(content)
    line = _refused(capsys, ["run", str(spec), "--run-dir", str(tmp_path / "run")], field)
    assert "Traceback" not in line
    if field != "config":
        assert "given twice" in line


def test_merge_keys_are_not_duplicates(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: &b {n_layers: 2, d_model: 32}\n")  # `base` is not a spec key: read_yaml only
    from elastic.yaml_io import read_yaml

    assert read_yaml(spec, "config") == {"base": {"n_layers": 2, "d_model": 32}}
    spec.write_text("a: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n")
    assert read_yaml(spec, "config")["c"] == {"x": 1, "y": 3}


# --------------------------------------------------------------------------- run directories


def test_run_dir_that_is_a_file_or_under_one_is_refused(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for run_dir in (afile, afile / "sub"):
        line = _refused(capsys, ["run", QUICKSTART, "--run-dir", str(run_dir)], "--run-dir")
        assert "is a file" in line
    spec = tmp_path / "spec.yaml"  # the same, from the spec's own key
    spec.write_text(yaml.safe_dump({"name": "x", "run_dir": str(afile)}))
    _refused(capsys, ["run", str(spec)], "run_dir")


def test_run_dir_on_a_read_only_filesystem_is_refused(capsys, tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() == 0:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(target)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    else:
        target.chmod(0o500)
    try:
        line = _refused(capsys, ["run", QUICKSTART, "--run-dir", str(target / "run")], "--run-dir")
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
    # Created but never started (no events): the next run may take the directory.
    claim_locations(str(run_dir), "--run-dir", str(run_dir / "checkpoints"), {}, False, JobSpec.from_yaml(first))
    (run_dir / "events.jsonl").write_text('{"ts": 0, "kind": "job_start"}\n')
    line = _refused(capsys, ["run", first, "--run-dir", str(run_dir)], "--run-dir")
    assert "holds another run" in line and "--resume" in line
    other_model = _tiny_spec(tmp_path, d_model=64)
    line = _refused(capsys, ["run", other_model, "--run-dir", str(run_dir), "--resume"], "--run-dir")
    assert "model.d_model: 32 there, 64 here" in line
    line = _refused(
        capsys, ["run", _tiny_spec(tmp_path, name="other"), "--run-dir", str(run_dir), "--resume"], "--run-dir"
    )
    assert "'reuse', not 'other'" in line
    # --resume of the same job and model passes the check (a longer run, another layout: the same run)
    same = JobSpec.from_yaml(first, overrides=["train.steps=500", "elastic.max_dp=1"])
    claim_locations(str(run_dir), "--run-dir", str(run_dir / "checkpoints"), {}, True, same)


def test_a_checkpoint_location_holding_checkpoints_is_refused_unless_resume_continues_it(capsys, tmp_path):
    ckpt = tmp_path / "shared-ckpt"
    first = _tiny_spec(tmp_path, ckpt=str(ckpt))
    claim_locations(str(tmp_path / "a"), "--run-dir", str(ckpt), {}, False, JobSpec.from_yaml(first))
    (ckpt / "step_00000002").mkdir()
    line = _refused(capsys, ["run", first, "--run-dir", str(tmp_path / "b")], "checkpoint.uri")
    assert "holds checkpoints of another run" in line
    other = _tiny_spec(tmp_path, d_model=64, ckpt=str(ckpt))
    line = _refused(capsys, ["run", other, "--run-dir", str(tmp_path / "c"), "--resume"], "checkpoint.uri")
    assert "another model" in line
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()  # nothing written when refused
    claim_locations(str(tmp_path / "d"), "--run-dir", str(ckpt), {}, True, JobSpec.from_yaml(first))


def test_identity_difference_names_what_differs():
    spec = JobSpec.from_yaml(QUICKSTART)
    me = JobIdentity.of(spec)
    assert me.difference(me.to_json()) is None and me.difference(None) is None
    assert "unreadable" in me.difference(b"{not json")


# --------------------------------------------------------------------------- the corpus


def _parquet(path, rows, *, fixed=True, statistics=True):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rows = np.asarray(rows, dtype=np.int32)
    col = (
        pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])
        if fixed
        else pa.array([list(r) for r in rows])
    )
    pq.write_table(pa.table({"tokens": col}), path, write_statistics=statistics)


def _corpora(root) -> dict[str, tuple[str, str]]:
    """name -> (data.source, what the one line must say)."""
    rng = np.random.default_rng(0)
    good = rng.integers(0, 64, size=(64, 17))
    _parquet(f"{root}/wide/part-0.parquet", rng.integers(0, 64, size=(64, 34)))
    _parquet(f"{root}/ids/part-0.parquet", rng.integers(0, 1000, size=(64, 17)))
    _parquet(f"{root}/varlen/part-0.parquet", np.concatenate([good[:, :16], good[:, :17]], axis=1)[:, :33], fixed=False)
    pq.write_table(pa.table({"ids": pa.array([[1] * 17] * 4)}), f"{root}/column.parquet")
    os.makedirs(f"{root}/nofiles")
    (open(f"{root}/nofiles/README.txt", "w")).write("no parquet here")
    os.makedirs(f"{root}/empty")
    open(f"{root}/empty/part-0.parquet", "wb").close()
    os.makedirs(f"{root}/corrupt")
    open(f"{root}/corrupt/part-0.parquet", "wb").write(b"PAR1" + b"\0" * 64 + b"PAR1")
    pq.write_table(pa.table({"tokens": pa.array(["a", "b"])}), f"{root}/strings.parquet")
    _parquet(f"{root}/indexed/part-00000.parquet", good)
    with open(f"{root}/indexed/index.json", "w") as f:
        json.dump({"seq_len": 32, "tokenizer": {"vocab_size": 64}, "shards": []}, f)
    write_corpus(f"{root}/nosidecar", good, 32, 8, vocab_size=64)  # version 3, one sidecar lost
    os.remove(f"{root}/nosidecar/part-00001.groups")
    return {
        "wide": (f"{root}/wide", "part-0.parquet: rows of 34 ids; model.seq_len + 1 = 17"),
        "ids": (f"{root}/ids", "token ids from 0 to 999"),
        "varlen": (f"{root}/varlen", "every row needs model.seq_len + 1 = 17"),
        "column": (f"file://{root}/column.parquet", "has no 'tokens' column (columns: ids)"),
        "nofiles": (f"{root}/nofiles", "holds no .parquet files"),
        "empty": (f"{root}/empty", "part-0.parquet is not a readable parquet file"),
        "corrupt": (f"{root}/corrupt", "part-0.parquet is not a readable parquet file"),
        "strings": (f"{root}/strings.parquet", "not a list of token ids"),
        "indexed": (f"{root}/indexed", "was prepared with --seq-len 32"),
        "nosidecar": (f"{root}/nosidecar", "nosidecar/part-00001.groups (the row-group sidecar of part-00001.parquet)"),
    }


def test_a_corpus_that_cannot_train_is_refused_naming_the_file(capsys, tmp_path):
    for name, (source, says) in _corpora(str(tmp_path / "corpora")).items():
        line = _refused(capsys, _run_args(tmp_path, *TINY_MODEL, f"data.source={source}"), "data.source")
        assert says in line, (name, line)
    assert not (tmp_path / "run").exists()


def test_a_corpus_on_s3_is_checked_with_our_storage_options(capsys, tmp_path, moto_s3, s3_bucket):
    """The options as users write them (``region``, ``endpoint_url``) reach s3fs translated: the
    driver reads the corpus on S3 and refuses it, where s3fs once raised a TypeError on
    ``region`` and the check was skipped with a warning."""
    corpora = _corpora(str(tmp_path / "corpora"))
    opts = json.dumps(moto_s3.options())
    for name in ("wide", "indexed"):
        local, says = corpora[name]
        for f in os.listdir(local):
            moto_s3.client().upload_file(os.path.join(local, f), s3_bucket, f"{name}/{f}")
        source = f"s3://{s3_bucket}/{name}"
        line = _refused(
            capsys,
            _run_args(tmp_path, *TINY_MODEL, f"data.source={source}", f"data.storage_options={opts}"),
            "data.source",
        )
        assert says in line, (name, line)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- the cluster address


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_where_no_cluster_answers_is_refused(capsys, tmp_path, monkeypatch):
    port = _closed_port()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for command in (["run", QUICKSTART], ["plan", QUICKSTART], ["sweep", QUICKSTART]):
        line = _refused(capsys, [*command, "--address", f"127.0.0.1:{port}"], "--address")
        assert f"no Ray cluster answers at 127.0.0.1:{port}" in line
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "hello"}\n')
    _refused(capsys, ["prepare", str(docs), str(tmp_path / "out"), "--address", f"127.0.0.1:{port}"], "--address")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    _refused(capsys, _run_args(tmp_path), "RAY_ADDRESS")
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-ray-here"))  # no recorded local cluster
    line = _refused(capsys, _run_args(tmp_path, "--address", "auto")[:2] + ["--address", "auto"], "--address")
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
    _refused(capsys, ["prepare", str(tmp_path / "missing"), str(out)], "INPUT")
    (tmp_path / "empty").mkdir()
    _refused(capsys, ["prepare", str(tmp_path / "empty"), str(out)], "INPUT")
    (tmp_path / "empty" / "a.jsonl").write_text("")
    line = _refused(capsys, ["prepare", str(tmp_path / "empty"), str(out)], "INPUT")
    assert "holds no documents" in line
    (tmp_path / "docs.jsonl").write_text('{"body": "hello"}\n')
    _refused(capsys, ["prepare", str(tmp_path / "docs.jsonl"), str(out)], "--text-field")
    _refused(capsys, ["prepare", str(tmp_path / "docs.jsonl"), str(out), "--tokenizer", "bpe:x"], "--tokenizer")
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
    _parquet(f"{corpus}/part-0.parquet", rng.integers(0, 64, size=(8, 17)))
    _parquet(f"{corpus}/part-1.parquet", rng.integers(64, 128, size=(64, 17)), statistics=False)
    address = ray_local.get_runtime_context().gcs_address
    args = _run_args(tmp_path, *TINY_MODEL, f"data.source={corpus}", "train.steps=6", "train.global_batch=8")
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
