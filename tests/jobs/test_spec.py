"""Spec validation: every malformed spec is refused by the CLI with exit 2, one line naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from cli_testlib import run_cli

from elastic.errors import SpecError
from jobs import JobSpec

pytestmark = pytest.mark.timeout(120)

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart.yaml")

# (override list, the field the one-line error must name)
MALFORMED = [
    (["bogus=1"], "bogus"),
    (["model.bogus=1"], "model.bogus"),
    (["parallel.tp=3"], "parallel.tp"),
    (["parallel.pp=3"], "parallel.pp"),
    (["model.n_heads=3"], "model.n_heads"),
    (["train.global_batch=7"], "train.global_batch"),
    (["train.global_batch=48", "parallel.micro_batch=5"], "train.global_batch"),
    (["train.steps=0"], "train.steps"),
    (["train.lr=-1"], "train.lr"),
    (["elastic.min_dp=5"], "elastic.min_dp"),
    (["elastic.max_dp=0"], "elastic.max_dp"),
    (["parallel.zero=4"], "parallel.zero"),
    (["resources.device=tpu"], "resources.device"),
    (["resources.device=cuda", "resources.gpus_per_worker=0"], "resources.gpus_per_worker"),
    (["model.kind=bert"], "model.kind"),
    (["data.source=not-a-uri"], "data.source"),
    (["data.source=ftp://host/data"], "data.source"),
    (["data.source=gs://bucket/corpus"], "data.source"),
    (["data.source=file:///no/such/corpus"], "data.source"),
    (["checkpoint.keep=0"], "checkpoint.keep"),
    (["model.n_layers=abc"], "model.n_layers"),
    (["elastic.heartbeat_timeout_s=-2"], "elastic.heartbeat_timeout_s"),
    (["name=has space"], "name"),
    (["model.tie_embeddings=true", "parallel.pp=2"], "model.tie_embeddings"),
    (["noequals"], "--set"),
    (["model.kind=llama", "model.n_kv_heads=2", "parallel.tp=4"], "parallel.tp"),  # tp > n_kv_heads
    (["model.kind=llama", "model.n_kv_heads=3"], "model.n_kv_heads"),
    (["model.kind=llama", "model.size=llama3-1b"], "model.size"),
    (["train.dtype=fp16"], "train.dtype"),
    # expert and context parallelism (docs/parallelism.md)
    (["parallel.ep=2"], "parallel.ep"),  # gpt has no experts
    (["parallel.cp=2"], "parallel.cp"),  # nor context-parallel attention
    (["model.kind=llama", "parallel.ep=2"], "parallel.ep"),  # a dense llama has no experts
    (["model.kind=llama", "model.moe={n_experts: 4, top_k: 2}", "parallel.ep=3"], "parallel.ep"),  # 3 ∤ 4
    (["model.kind=llama", "model.moe={n_experts: 4, top_k: 5}"], "model.moe.top_k"),
    (["model.kind=llama", "model.moe={n_experts: 4}"], "model.moe.top_k"),
    (["model.kind=llama", "model.moe={n_experts: 4, top_k: 1, bogus: 1}"], "model.moe.bogus"),
    (["model.kind=llama", "model.moe={n_experts: 4, top_k: 1, router: relu}"], "model.moe.router"),
    (["model.kind=llama", "parallel.cp=3"], "parallel.cp"),  # 3 ∤ seq_len 128
    (["model.kind=llama", "model.moe={n_experts: 8, top_k: 2}", "parallel.ep=8"], "train.global_batch"),
    (["model.kind=llama", "model.moe={n_experts: 4, top_k: 2, expert_hidden: 30}", "parallel.tp=4"], "parallel.tp"),
]


@pytest.mark.parametrize("overrides,field", MALFORMED, ids=[f for _, f in MALFORMED])
def test_python_api_names_field(overrides, field):
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(QUICKSTART, overrides=overrides)
    assert info.value.field == field


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True, timeout=60)


def test_cli_refuses_malformed_specs_with_one_line(tmp_path, capsys):
    # One subprocess per bad spec would cost ~2 s each; the CLI is exercised on a handful,
    # covering the three error sources (pydantic, cross-field, YAML/file), the console
    # entry (a subprocess) on the first.
    for i, (overrides, field) in enumerate([MALFORMED[0], MALFORMED[2], MALFORMED[5], MALFORMED[17]]):
        args = ["run", QUICKSTART]
        for o in overrides:
            args += ["--set", o]
        proc = _cli(*args) if i == 0 else run_cli(capsys, *args)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and field in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: {n_layers: [\n")
    proc = run_cli(capsys, "run", str(bad_yaml))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli(capsys, "run", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "config" in proc.stderr


def test_cli_refuses_unsupported_or_missing_data_sources_before_starting(tmp_path, capsys):
    """Found before anything starts (no Ray, no run directory), not as exit 1 at run time."""
    run_dir = tmp_path / "run"
    for source, why in [
        ("ftp://host/data", "protocol ftp:// is not supported"),
        (f"file://{tmp_path}/nowhere", "does not exist"),
        (str(tmp_path / "nowhere"), "does not exist"),
    ]:
        proc = run_cli(capsys, "run", QUICKSTART, "--set", f"data.source={source}", "--run-dir", str(run_dir))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: data.source: ") and why in lines[0], proc.stderr
    assert not run_dir.exists()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for source in (str(corpus), f"file://{corpus}", "s3://bucket/corpus", "synthetic"):  # accepted by the checks
        assert JobSpec.from_yaml(QUICKSTART, overrides=[f"data.source={source}"]).data.source == source


@pytest.mark.parametrize(
    "text", ["", "\n\n   \n", "# a spec that lost its body\n\n# name: x\n"], ids=["empty", "blank", "comments"]
)
def test_empty_spec_file_is_refused(tmp_path, capsys, text):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        JobSpec.from_yaml(path)
    assert info.value.field == "config" and "is empty" in str(info.value)
    if text == "":
        proc = run_cli(capsys, "run", str(path), "--run-dir", str(tmp_path / "run"))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: config: "), proc.stderr
        assert not (tmp_path / "run").exists()


def test_overrides_are_yaml_parsed():
    spec = JobSpec.from_yaml(QUICKSTART, overrides=["parallel.tp=2", "resources.custom={trainer: 1}", "train.lr=1e-3"])
    assert spec.parallel.tp == 2
    assert spec.resources.custom == {"trainer": 1.0}
    assert spec.train.lr == pytest.approx(1e-3)


def test_fields_match_design_yaml():
    raw = yaml.safe_load(open(QUICKSTART))
    spec = JobSpec.from_dict(raw)
    dumped = spec.model_dump(by_alias=True)
    for section, values in raw.items():
        if isinstance(values, dict):
            for key, value in values.items():
                assert dumped[section][key] == value, (section, key)
    assert spec.allowed_dps() == [1, 2, 3, 4]
    assert spec.grad_accum(4) == 3


def test_schema_is_exported(capsys):
    proc = run_cli(capsys, "schema")
    assert proc.returncode == 0
    schema = json.loads(proc.stdout)
    sections = {"name", "seed", "run_dir", "model", "data", "parallel", "elastic", "resources", "train", "checkpoint"}
    assert set(schema["properties"]) == sections
    assert "async" in json.dumps(schema)
