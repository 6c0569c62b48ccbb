"""``elastic sweep`` / ``python -m jobs.sweep`` bad input: exit 2, one line naming the key,
before any Ray starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from cli_testlib import run_cli

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = {
    "name": "tiny",
    "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 64, "seq_len": 16},
    "parallel": {"micro_batch": 2},
    "elastic": {"min_dp": 1, "max_dp": 2},
    "train": {"global_batch": 8},
}


def _sweep_args(tmp_path, space_text: str | None, *extra: str) -> list[str]:
    """The job spec and space files written under ``tmp_path``; the arguments after ``sweep``."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(SPEC))
    args = [str(cfg)]
    if space_text is not None:
        space = tmp_path / "space.yaml"
        space.write_text(space_text)
        args += ["--space", str(space)]
    return args + list(extra)


def _run(tmp_path, space_text: str | None, *extra: str, module: str = "jobs.cli") -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", module] + (["sweep"] if module == "jobs.cli" else [])
    args += _sweep_args(tmp_path, space_text, *extra)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100, check=False)


@pytest.mark.parametrize(
    "space, extra, field",
    [
        ("{dp: [1, 2]}", (), "space.dp"),
        ("{tp: [1], bogus: [1]}", (), "space.bogus"),
        ("{zero: [0, 9]}", (), "space.zero"),
        ("# nothing here\n", (), "space"),
        ("{micro_batch: []}", (), "space.micro_batch"),
        ("{tp: [1]}", ("--trial-steps", "1"), "--trial-steps"),
        ("{tp: [1]}", ("--set", "parallel.bogus=1"), "parallel.bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys, space, extra, field):
    monkeypatch.chdir(tmp_path)  # where a sweep would write its directory
    p = run_cli(capsys, "sweep", *_sweep_args(tmp_path, space, *extra))
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}"), p.stderr
    assert not os.path.exists(tmp_path / "sweeps"), "nothing may start on bad input"


def test_jobs_sweep_entry_point_behaves_alike(tmp_path):
    """Both console entries, in their own process: exit 2 and the one line, nothing else."""
    p = _run(tmp_path, "{dp: [1, 2]}")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr
    assert p.stderr.startswith("error: space.dp") and not os.path.exists(tmp_path / "sweeps"), p.stderr
    p = _run(tmp_path, "{dp: [1, 2]}", module="jobs.sweep")
    assert p.returncode == 2 and p.stderr.startswith("error: space.dp"), p.stderr
    p = _run(tmp_path, None, "--no-such-flag", module="jobs.sweep")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
