"""``elastic ckpt list URI [--json]`` and ``elastic ckpt verify URI [--step N]`` on real files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from jobs.cli import main
from storage import CheckpointStore, commit_checkpoint, write_rank_shard

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def root(tmp_path):
    """Committed steps 2 and 4 (two ranks each) and an uncommitted attempt at step 6."""
    store = CheckpointStore(str(tmp_path / "ckpt"))
    for step in (2, 4, 6):
        results = [
            write_rank_shard(store, step, {"w": torch.full((64,), float(step + r)), f"rank{r}/n": step}, r)
            for r in range(2)
        ]
        if step != 6:
            commit_checkpoint(store, step, results, extra={"world": 2})
    return store.root


def test_list_json_through_the_console_entry(root):
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "ckpt", "list", root, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["step"], r["committed"]) for r in rows] == [(2, True), (4, True), (6, False)]
    assert all(set(r) == {"step", "uri", "committed", "bytes"} and r["bytes"] > 0 for r in rows)
    assert rows[0]["uri"] == f"{root}/step_00000002"


def test_list_table(root, capsys):
    assert main(["ckpt", "list", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["STEP", "COMMITTED", "BYTES"] and len(lines) == 4
    assert lines[3].split()[:2] == ["6", "no"]


def test_verify_names_the_damaged_file(root, capsys):
    assert main(["ckpt", "verify", root]) == 0
    assert capsys.readouterr().out.splitlines() == ["step 2: ok", "step 4: ok"]
    damaged = f"{root}/step_00000004/__1_0.distcp"
    with open(damaged, "r+b") as f:  # flip one byte inside the tensor data
        f.seek(-20, 2)
        byte = f.read(1)
        f.seek(-20, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main(["ckpt", "verify", root]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED {damaged}" in out and "crc32" in out and "step 2: ok" in out
    assert main(["ckpt", "verify", root, "--step", "2"]) == 0
    assert main(["ckpt", "verify", f"{root}/step_00000004"]) == 1  # a step directory works too


def test_verify_bad_input_exits_2(root, tmp_path, capsys):
    assert main(["ckpt", "verify", root, "--step", "99"]) == 2
    assert main(["ckpt", "verify", str(tmp_path / "nowhere")]) == 2
    assert main(["ckpt", "list", str(tmp_path / "nowhere"), "--json"]) == 2
    assert main(["ckpt", "verify", "nosuchscheme://bucket/x"]) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["ckpt", "verify", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 5
