"""One part of the GPU check, in its own process: ``python -m benchmarks.gpu_check.parts NAME``.

Started by ``runner.py`` with ``--result FILE``; the part writes its figures and goals there
as it goes (so a part killed at its time bound still leaves what it measured), and its
progress to stdout, flushed. Exit code 0 when it ran to the end (its goals may still be
missed: ``passed`` says), 1 when it raised.
"""

from __future__ import annotations

import argparse
import importlib
import json
import operator
import os
import sys
import time
import traceback
from typing import Any

MODULES = {
    "device": None,
    "tests": "benchmarks.gpu_check.tests_part",
    "throughput": "benchmarks.gpu_check.throughput",
    "memory": "benchmarks.gpu_check.memory",
    "sweep": "benchmarks.gpu_check.sweep",
    "snapshot": "benchmarks.gpu_check.snapshot",
}
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "within": None}


class Recorder:
    """A part's figures and goals, saved to its result file after every change.

    A goal is ``value op target``; ``within`` means ``|value - 1| <= target``. In the dry run
    the performance goals are recorded but not enforced (``enforced: false``): tiny CPU
    sizes say nothing about a GPU's figures.
    """

    def __init__(self, path: str, dry_run: bool):
        self.path, self.dry_run = path, dry_run
        self.figures: dict[str, Any] = {}
        self.goals: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self._t0 = time.monotonic()

    def say(self, text: str) -> None:
        print(f"{time.monotonic() - self._t0:6.1f}s {text}", flush=True)

    def figure(self, key: str, value: Any) -> None:
        self.figures[key] = value
        self.save()

    def goal(self, name: str, value: Any, op: str, target: Any, performance: bool = True) -> bool:
        """Record a goal; ``performance`` goals are informative only in the dry run."""
        if op == "within":
            met = value is not None and abs(value - 1.0) <= target
        else:
            met = value is not None and bool(_OPS[op](value, target))
        enforced = not (performance and self.dry_run)
        self.goals[name] = {"value": _round(value), "op": op, "target": target, "met": met, "enforced": enforced}
        self.save()
        self.say(f"goal {name}: {_round(value)} {op} {target}: {'met' if met else 'MISSED'}")
        return met

    @property
    def passed(self) -> bool:
        return self.error is None and all(g["met"] for g in self.goals.values() if g["enforced"])

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(
                {"figures": self.figures, "goals": self.goals, "passed": self.passed, "error": self.error},
                f,
                indent=2,
                default=str,
            )
        os.replace(tmp, self.path)


def _round(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def device_part(rec: Recorder, dry_run: bool) -> None:
    from benchmarks.gpu_check.device import device_facts

    facts = device_facts()
    for key, value in facts.items():
        rec.figures[key] = value
    rec.save()
    rec.say(", ".join(f"{k}={v}" for k, v in facts.items() if k != "peak_source"))
    if not dry_run:
        rec.goal("cuda_available", facts["device"] == "cuda", "==", True, performance=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=sorted(MODULES))
    ap.add_argument("--result", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--inject", choices=["hang", "crash"])
    args = ap.parse_args(argv)
    rec = Recorder(args.result, args.dry_run)
    rec.save()
    try:
        if args.inject == "hang":  # the runner must kill this at the part's bound
            rec.say("injected hang")
            time.sleep(3600)
        if args.inject == "crash":
            raise RuntimeError("injected crash")
        if args.part == "device":
            device_part(rec, args.dry_run)
        else:
            importlib.import_module(MODULES[args.part]).run(rec, args.dry_run)
    except BaseException as exc:  # recorded, then the process exits 1
        rec.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
        rec.save()
        traceback.print_exc(file=sys.stdout)
        sys.stdout.flush()
        return 1
    rec.save()
    rec.say(f"done: {'passed' if rec.passed else 'goals missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
