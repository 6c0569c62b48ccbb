"""Helpers of the tests of what a run refuses before anything starts."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jobs.cli import main

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart.yaml")
TINY_MODEL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.vocab_size=64", "model.seq_len=16"]


def refused(capsys, args: list[str], field: str, *, exit_code: int = 2) -> str:
    """Run the CLI; it must exit ``exit_code`` with one line naming ``field``, and start no Ray."""
    import ray

    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == exit_code, err
    assert len(err) == 1 and err[0].startswith(f"error: {field}: "), err
    assert not ray.is_initialized()
    return err[0]


def run_args(tmp_path, *sets: str, config: str = QUICKSTART) -> list[str]:
    """``elastic run CONFIG --run-dir TMP/run --set ...``."""
    args = ["run", config, "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    return args


def write_parquet(path, rows, *, fixed=True, statistics=True) -> None:
    """A parquet file of token rows: a fixed-size list column (or variable lists), with or
    without column statistics."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rows = np.asarray(rows, dtype=np.int32)
    col = (
        pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])
        if fixed
        else pa.array([list(r) for r in rows])
    )
    pq.write_table(pa.table({"tokens": col}), path, write_statistics=statistics)
