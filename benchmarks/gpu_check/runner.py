"""``make gpu-check``: every device path of the platform on one GPU, in one short call.

Runs in the driver process of the check, which never touches the GPU itself: each part
runs in its own process (``python -m benchmarks.gpu_check.parts NAME``) under its own time
bound, so a part that hangs, crashes or runs out of memory cannot eat the others' time or
leave the device dirty for them. A part writes its figures to a JSON file as it goes; a
part killed at its bound is recorded as ``timeout`` with the figures it had. The whole run
has a bound too (``--total-s``): a part that would start without enough time left is
recorded as ``skipped``.

Writes ``<out>/gpu_check.json`` (device, versions, date, every part's status, duration,
figures, goals and error) and ``<out>/gpu_check.log`` (the progress lines, also printed).
``--dry-run`` runs the same plumbing on CPU at tiny sizes (gloo), into ``runs/gpu-check-dry``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATUSES = ("pass", "fail", "error", "timeout", "skipped")


@dataclass(frozen=True)
class Part:
    name: str
    bound_s: float  # on the GPU
    dry_bound_s: float  # in the CPU dry run
    what: str


PARTS = (
    Part("device", 60, 120, "device name, driver, torch/CUDA/NCCL versions"),
    Part("tests", 100, 120, "the gpu-marked tests"),
    Part("throughput", 170, 120, "engine vs a plain PyTorch loop, ~1B Llama, bf16 + compile: tokens/s, MFU"),
    Part("memory", 60, 120, "memory model vs max_memory_allocated, 6 layouts"),
    Part("sweep", 60, 120, "the sweep's trial body over micro-batch x recompute, one real OOM"),
    Part("snapshot", 45, 120, "CUDA -> pinned CPU memory-tier snapshot as a fraction of step time"),
)
# A world-size-1 NCCL group needs no network: bootstrap on the loopback interface.
PART_ENV_DEFAULTS = {"NCCL_SOCKET_IFNAME": "lo"}
TOTAL_BOUND_S = 480.0  # 8 minutes, from a bare machine
KILL_GRACE_S = 5.0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = os.path.abspath(
        args.out or os.path.join(ROOT, "runs/gpu-check-dry" if args.dry_run else "benchmarks/results")
    )
    os.makedirs(out, exist_ok=True)
    log = Log(os.path.join(out, "gpu_check.log"))
    parts = [p for p in PARTS if not args.only or p.name in args.only or p.name == "device"]
    bounds = {p.name: (p.dry_bound_s if args.dry_run else p.bound_s) for p in parts} | args.bound
    t0 = time.monotonic()
    log(f"gpu-check{' --dry-run' if args.dry_run else ''}: {len(parts)} parts, total bound {args.total_s:.0f} s")
    results: dict[str, dict[str, Any]] = {}
    work = tempfile.mkdtemp(prefix="gpu-check-")
    for part in parts:
        left = args.total_s - (time.monotonic() - t0)
        bound = min(bounds[part.name], left - KILL_GRACE_S)
        if bound < 5:
            results[part.name] = _record(part, "skipped", 0.0, bounds[part.name], {}, "no time left in the total bound")
            log(f"[{part.name}] skipped: {left:.0f} s left of the total bound")
            continue
        log(f"[{part.name}] start ({part.what}); bound {bound:.0f} s")
        results[part.name] = run_part(part, bound, args, work, log)
        r = results[part.name]
        log(f"[{part.name}] {r['status']} in {r['duration_s']:.1f} s" + (f": {r['error']}" if r.get("error") else ""))
    report = {
        "check": "gpu_check",
        "dry_run": args.dry_run,
        "command": "make gpu-check" + (" GPU_CHECK_ARGS=--dry-run" if args.dry_run else ""),
        "commit": _commit(),
        "device": results.get("device", {}).get("figures", {}),
        "wall_s": round(time.monotonic() - t0, 1),
        "total_bound_s": args.total_s,
        "env": {k: os.environ.get(k, v) for k, v in PART_ENV_DEFAULTS.items()},
        "passed": all(r["status"] == "pass" for r in results.values()),
        "parts": results,
    }
    path = os.path.join(out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    log(summary(report))
    log(f"wrote {path} and {log.path}")
    log.close()
    return 0 if report["passed"] else 1


def run_part(part: Part, bound_s: float, args: argparse.Namespace, work: str, log: Log) -> dict[str, Any]:
    """Run one part in its own process group; kill the group at ``bound_s``."""
    result_path = os.path.join(work, f"{part.name}.json")
    cmd = [sys.executable, "-u", "-m", "benchmarks.gpu_check.parts", part.name, "--result", result_path]
    if args.dry_run:
        cmd.append("--dry-run")
    if part.name in args.inject:
        cmd += ["--inject", args.inject[part.name]]
    env = {**PART_ENV_DEFAULTS, **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    tail: deque[str] = deque(maxlen=30)
    reader = threading.Thread(target=_copy_lines, args=(proc.stdout, part.name, log, tail), daemon=True)
    reader.start()
    status, error = None, None
    try:
        proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        status, error = "timeout", f"killed at its bound of {bound_s:.0f} s"
        _kill_group(proc)
    else:
        _kill_strays(proc)
    reader.join(timeout=5)
    duration = time.monotonic() - t0
    written = _read_json(result_path)
    if status is None:
        if proc.returncode != 0:
            status = "error"
            error = written.get("error") or f"exit code {proc.returncode}: " + " | ".join(list(tail)[-5:])
        else:
            status = "pass" if written.get("passed") else "fail"
            error = written.get("error")
    return _record(part, status, duration, bound_s, written, error)


def _record(part: Part, status: str, duration: float, bound: float, written: dict, error: str | None) -> dict:
    assert status in STATUSES, status
    return {
        "status": status,
        "what": part.what,
        "duration_s": round(duration, 1),
        "bound_s": round(bound, 1),
        "figures": written.get("figures", {}),
        "goals": written.get("goals", {}),
        "error": error,
    }


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the part's process group (its children too), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_strays(proc: subprocess.Popen) -> None:
    """The part has exited: end anything it left in its process group (a compile worker, a
    test's child), so that nothing holds the GPU while the next part runs."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _commit() -> str | None:
    """The commit the check ran from, where the tree is a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _copy_lines(stream: Any, name: str, log: Log, tail: deque) -> None:
    for line in stream:
        line = line.rstrip("\n")
        tail.append(line)
        log(f"[{name}] {line}")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def summary(report: dict[str, Any]) -> str:
    dev = report["device"]
    lines = [
        f"device: {dev.get('device_name', '?')} | driver {dev.get('driver')} | torch {dev.get('torch')} | "
        f"CUDA {dev.get('cuda')} | {dev.get('date', '')}",
        f"{'part':<11} {'status':<8} {'time':>7}  goals",
    ]
    for name, r in report["parts"].items():
        goals = "; ".join(
            f"{g}: {v['value']} {v['op']} {v['target']}{'' if v['met'] else ' (missed)'}" for g, v in r["goals"].items()
        )
        lines.append(f"{name:<11} {r['status']:<8} {r['duration_s']:>6.1f}s  {goals}")
    lines.append(
        f"all passed: {report['passed']}; wall {report['wall_s']} s of a {report['total_bound_s']:.0f} s bound"
    )
    return "\n".join(lines)


class Log:
    """Lines to stdout (flushed: the device tool shows the tail) and to the log file."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "w")
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def __call__(self, text: str) -> None:
        with self._lock:
            for line in text.splitlines() or [""]:
                stamped = f"{time.monotonic() - self._t0:6.1f}s {line}"
                print(stamped, flush=True)
                self._file.write(stamped + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, gloo: the plumbing only")
    ap.add_argument(
        "--out", help="where gpu_check.json and .log go (default benchmarks/results; dry: runs/gpu-check-dry)"
    )
    ap.add_argument(
        "--only", type=lambda s: s.split(","), default=[], help="comma-separated parts (device always runs)"
    )
    ap.add_argument("--total-s", type=float, default=TOTAL_BOUND_S, help="bound of the whole run")
    ap.add_argument("--bound", action="append", default=[], metavar="PART=S", help="override a part's bound")
    ap.add_argument(
        "--inject", action="append", default=[], metavar="PART=hang|crash", help="testing aid: make a part misbehave"
    )
    args = ap.parse_args(argv)
    names = {p.name for p in PARTS}
    for key in ("bound", "inject"):
        pairs = dict(item.split("=", 1) for item in getattr(args, key))
        bad = set(pairs) - names
        if bad:
            ap.error(f"--{key}: unknown part(s) {sorted(bad)}; parts: {sorted(names)}")
        setattr(args, key, {k: float(v) for k, v in pairs.items()} if key == "bound" else pairs)
    unknown = set(args.only) - names
    if unknown:
        ap.error(f"--only: unknown part(s) {sorted(unknown)}; parts: {sorted(names)}")
    return args
