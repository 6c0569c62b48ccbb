"""The benchmarks are a package: every one is listed in the catalog, imports, answers
``--help`` (with its quick settings, which must parse), runs as ``python -m benchmarks.X`` and
as ``python benchmarks/X.py`` from any directory, and none patches ``sys.path`` or imports
from ``tests/``. Fast: no Ray, nothing trains.

The source checks read the files (``ast``), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

from benchmarks import catalog
from benchmarks.__main__ import command, run_all

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# Modules that live in tests/ (test folders are not packages: they are imported by bare name).
TEST_MODULES = {p.stem for p in (ROOT / "tests").rglob("*.py")}


def _entry_modules() -> list[str]:
    """Runnable benchmarks: the modules directly under benchmarks/, and packages with a ``__main__``."""
    files = [p.stem for p in BENCH.glob("*.py") if p.stem not in ("__init__", "__main__")]
    packages = [p.parent.name for p in BENCH.glob("*/__main__.py")]
    return sorted(files + packages)


def _problems(path: pathlib.Path) -> list[str]:
    """``sys.path`` touched, or an import of ``tests`` or of a module that lives in tests/."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
            bad.append(f"{path.name}:{node.lineno} uses sys.path")
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top == "tests" or top in TEST_MODULES:
                bad.append(f"{path.name}:{node.lineno} imports {name} from tests/")
    return bad


def test_no_benchmark_patches_sys_path_or_imports_from_tests():
    files = sorted(BENCH.rglob("*.py"))
    assert len(files) > 15
    bad = [p for path in files for p in _problems(path)]
    assert not bad, bad


def test_the_source_check_sees_sys_path_and_test_imports(tmp_path):
    """The check above can fail: it flags each way a benchmark used to reach outside the package."""
    cases = {
        "a.py": "import sys\nsys.path.insert(0, '/x')\n",
        "b.py": "import os, sys\nif os.sep not in sys.path:\n    pass\n",
        "c.py": "def f():\n    from tests.data import x\n",
        "d.py": "import ckpt_testlib\n",
        "e.py": "from storage_testlib import MotoS3\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert _problems(tmp_path / name), name
    (tmp_path / "ok.py").write_text("import sys\nsys.exit(0)\nfrom benchmarks.harness import stats\n")
    assert _problems(tmp_path / "ok.py") == []


def test_every_module_is_in_the_catalog():
    listed = {b.name for b in catalog.BENCHMARKS} | set(catalog.NOT_BENCHMARKS)
    assert set(_entry_modules()) == listed


@pytest.mark.parametrize("bench", catalog.BENCHMARKS, ids=lambda b: b.name)
def test_every_benchmark_answers_help_with_its_quick_and_published_settings(bench, capsys):
    """``--help`` after the catalog's settings: argparse checks each value on the way (a bad
    one exits 2), and every option the catalog passes must be one the benchmark offers,
    spelled out (argparse would take an abbreviation silently)."""
    module = importlib.import_module(bench.module)
    for settings in (bench.quick, bench.full, bench.smoke or ()):
        with pytest.raises(SystemExit) as done:
            module.main([*settings, "--help"])
        assert done.value.code == 0, settings
        usage = capsys.readouterr().out
        offered = set(re.findall(r"(?<![\w-])--[\w-]+", usage))
        flags = [a for a in settings if a.startswith("--")] + ([bench.out_flag] if bench.out_flag else [])
        assert set(flags) <= offered, (set(flags) - offered, usage)
    assert bench.quick


@pytest.mark.parametrize("name", ["torchrun_ddp_baseline", "__main__"])
def test_the_other_entry_points_answer_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


def test_both_invocations_work_from_another_directory(tmp_path):
    """The editable install makes ``benchmarks`` importable everywhere: no ``sys.path`` help."""
    runs = [
        [sys.executable, "-m", "benchmarks.recovery_vs_raytrain", "--help"],
        [sys.executable, str(BENCH / "recovery_vs_raytrain.py"), "--help"],
        [sys.executable, str(BENCH / "overhead.py"), "--help"],
        [sys.executable, "-m", "benchmarks", "list"],
    ]
    for cmd in runs:
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (cmd, done.stderr[-2000:])
        assert "usage:" in done.stdout or "recovery_vs_raytrain" in done.stdout


def test_make_bench_skips_what_cannot_run_and_keeps_published_results(tmp_path, capsys):
    absent = catalog.Need("no_such_module_for_bench_test", "install it")
    b = catalog.Benchmark("sdc_overhead", "x", "sdc_overhead.json", "--json", ("--reps", "1"), needs=(absent,))
    assert run_all([b], full=False, out_dir=str(tmp_path), limit_s=1) == [
        ("sdc_overhead", "skipped: no no_such_module_for_bench_test: install it", 0.0)
    ]
    assert "skipped (no no_such_module_for_bench_test: install it)" in capsys.readouterr().out
    quick = command(b, full=False, out_dir=str(tmp_path))
    assert quick[1:] == ["-m", "benchmarks.sdc_overhead", "--reps", "1", "--json", str(tmp_path / "sdc_overhead.json")]
    full = command(b, full=True, out_dir=str(tmp_path))
    assert full[1:] == ["-m", "benchmarks.sdc_overhead", "--json", str(BENCH / "results" / "sdc_overhead.json")]


def test_recovery_first_step_work_takes_a_steady_step_off_the_recovery():
    from benchmarks.recovery.scenario import first_step_work

    # Steps at the smaller size completed at 10.0 (the recovery's first), 12.5, 15.0, 17.6
    # (by their last worker; any order).
    out = first_step_work(3.0, [(4, 17.6), (1, 10.0), (1, 9.8), (3, 15.0), (2, 12.5), (2, 12.1)], rows_per_worker=6)
    assert out["rows_per_worker_at_new_size"] == 6
    assert out["steady_step_at_new_size_s"] == pytest.approx(2.5)
    assert out["recovery_less_step_s"] == pytest.approx(0.5)
    # One step at that size: no steady step, nothing taken off.
    assert first_step_work(3.0, [(1, 10.0)], rows_per_worker=4) == {"rows_per_worker_at_new_size": 4}


def test_a_failed_recovery_run_keeps_its_failures_and_evidence(tmp_path):
    """Without --keep, a run that did not succeed still tells why: its failure events go
    into the results, and its files (less the checkpoints) and Ray's error logs are kept."""
    import json
    import shutil
    from pathlib import Path

    from benchmarks.recovery.driver import FAILURE_DETAIL_CHARS, failure_events, keep_evidence

    side = tmp_path / "ours-2"
    (side / "run" / "checkpoints" / "step_00000005").mkdir(parents=True)
    (side / "run" / "checkpoints" / "step_00000005" / "__0_0.distcp").write_bytes(b"x" * 1000)
    events = [
        {"kind": "step", "step": 8, "ts": 1.0},
        {"kind": "failure", "ts": 2.0, "cause": "node_lost", "ranks": [1], "detail": "1 worker(s) died"},
        {"kind": "failure", "ts": 3.0, "cause": "worker_error", "ranks": [2], "detail": "E" * 1000},
    ]
    lines = [json.dumps(e) for e in events] + ['{"kind": "fail']  # the last line cut by a deadline
    (side / "run" / "events.jsonl").write_text("\n".join(lines) + "\n")
    (side / "log.txt").write_text("driver log\n")
    ray_tmp = tmp_path / "ray" / "session_1" / "logs"
    ray_tmp.mkdir(parents=True)
    (ray_tmp / "worker-abc.err").write_text("Traceback: boom\n")
    (ray_tmp / "worker-def.err").write_text("")  # empty: not copied
    (ray_tmp / "raylet.out").write_text("not an error log\n")

    got = failure_events(str(side / "run"))
    assert [(f["cause"], f["ranks"]) for f in got] == [("node_lost", [1]), ("worker_error", [2])]
    assert len(got[1]["detail"]) == FAILURE_DETAIL_CHARS
    assert failure_events(str(tmp_path / "no-run")) == []

    dest = keep_evidence(str(side), str(tmp_path / "ray"))
    try:
        kept = {p.relative_to(dest).as_posix() for p in Path(dest).rglob("*") if p.is_file()}
        assert kept == {"side/log.txt", "side/run/events.jsonl", "ray-logs/logs-worker-abc.err"}
    finally:
        shutil.rmtree(dest)
