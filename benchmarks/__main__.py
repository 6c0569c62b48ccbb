"""``python -m benchmarks list|run``: list the benchmarks, or run them one after another.

``run`` (``make bench``) runs every benchmark of ``benchmarks/catalog.py`` in order at its
quick settings, each in its own process (own session, a hard limit), its results file in
``--out-dir`` (``runs/bench/``) so that the published files in ``benchmarks/results/`` stay
as measured; a benchmark that cannot run here is skipped with the reason and the fix.
``run --full`` runs them at their default settings and writes the published files.
Runs in the process that was started, on the driver machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from benchmarks.catalog import BENCHMARKS, Benchmark, by_name
from benchmarks.harness import REPO_ROOT
from benchmarks.harness.proc import child_env, module_command


def list_benchmarks() -> None:
    width = max(len(b.name) for b in BENCHMARKS)
    files = {b.name: f"results/{b.results}" if b.results else "(prints only)" for b in BENCHMARKS}
    fwidth = max(len(f) for f in files.values())
    print(f"{'benchmark':<{width}}  {'results file':<{fwidth}}  measures")
    for b in BENCHMARKS:
        needs = "".join(f"; needs {n.what}: {n.how}" for n in b.needs)
        optional = "".join(f"; without {n.what} a side is skipped ({n.how})" for n in b.optional)
        print(f"{b.name:<{width}}  {files[b.name]:<{fwidth}}  {b.measures}{needs}{optional}")
    print("\nquick settings (make bench):")
    for b in BENCHMARKS:
        print(f"  python -m {b.module} {' '.join(b.quick)}")
    print("\npublished runs (make bench-full; defaults otherwise):")
    for b in BENCHMARKS:
        if b.full:
            print(f"  python -m {b.module} {' '.join(b.full)}")


def command(b: Benchmark, full: bool, out_dir: str) -> list[str]:
    if full:
        args = list(b.full) + ([b.out_flag, b.published()] if b.out_flag and b.results else [])
    else:
        args = list(b.quick) + ([b.out_flag, os.path.join(out_dir, f"{b.name}.json")] if b.out_flag else [])
    return module_command(b.module, *args)


def run_one(b: Benchmark, cmd: list[str], limit_s: float) -> tuple[str, float]:
    """Run one benchmark with its output on this terminal; returns (outcome, wall seconds)."""
    print(f"\n=== {b.name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=child_env(), start_new_session=True)
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"killed after {limit_s:.0f} s", time.time() - t0
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return ("ok" if rc == 0 else f"failed (exit {rc})"), time.time() - t0


def run_all(chosen: list[Benchmark], full: bool, out_dir: str, limit_s: float) -> list[tuple[str, str, float]]:
    """Each benchmark in turn, or the reason it cannot run here; (name, outcome, wall s) of each."""
    os.makedirs(out_dir, exist_ok=True)
    outcomes: list[tuple[str, str, float]] = []
    for b in chosen:
        missing = b.missing()
        if missing:
            why = "; ".join(f"no {n.what}: {n.how}" for n in missing)
            print(f"\n=== {b.name}: skipped ({why})", flush=True)
            outcomes.append((b.name, f"skipped: {why}", 0.0))
            continue
        for n in b.optional:
            if n.missing():
                print(f"note: {b.name} reports its {n.what} side(s) skipped: {n.what} is not installed ({n.how})")
        outcome, wall = run_one(b, command(b, full, out_dir), limit_s)
        outcomes.append((b.name, outcome, wall))
    return outcomes


def run(args: argparse.Namespace) -> int:
    chosen = by_name(args.only.split(",")) if args.only else list(BENCHMARKS)
    outcomes = run_all(chosen, args.full, args.out_dir, args.limit_min * 60)
    print("\nbenchmark              outcome")
    for name, outcome, wall in outcomes:
        print(f"{name:<22} {outcome}" + (f" ({wall:.0f} s)" if wall else ""))
    if not args.full:
        print(f"results files of this run: {os.path.relpath(args.out_dir, REPO_ROOT)}/ (benchmarks/results/ untouched)")
    return 1 if any(o.startswith(("failed", "killed")) for _, o, _ in outcomes) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the benchmarks, what each measures, its results file and quick settings")
    r = sub.add_parser("run", help="run the benchmarks in order (quick settings unless --full)")
    r.add_argument("--only", default="", help="comma-separated names (default: all)")
    r.add_argument("--full", action="store_true", help="default settings; writes the published benchmarks/results/")
    r.add_argument("--out-dir", default=os.path.join(REPO_ROOT, "runs", "bench"), help="results files of a quick run")
    r.add_argument("--limit-min", type=float, default=60.0, help="hard limit per benchmark in minutes (default 60)")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        list_benchmarks()
        return 0
    try:
        return run(args)
    except ValueError as exc:  # an unknown name in --only
        ap.error(f"--only: {exc}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
