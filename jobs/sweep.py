"""``elastic sweep`` and its Ray Jobs entry point (docs/sweep.md)::

    elastic sweep CONFIG [--set K=V]... [--space FILE] [--address ADDR] [--trial-steps N]
                  [--max-trials N] [--exhaustive] [--memory-per-worker-gb X] [--out DIR] [--json]
    ray job submit --working-dir . -- python -m jobs.sweep CONFIG ...

``python -m jobs.sweep`` behaves exactly like ``elastic sweep``. Exit codes: 0 a best
configuration was found, 1 no configuration ran, 2 bad input (one line naming the key).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jobs.spec import JobSpec

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the job spec (YAML) to tune")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--space", default=None, help="YAML: candidate values per key (tp, pp, zero, ...)")
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join: HOST:PORT, or auto for the one running on this machine "
        "(default: RAY_ADDRESS, else an embedded cluster for this command alone)",
    )
    parser.add_argument("--trial-steps", type=int, default=10, help="training steps per trial (default 10)")
    parser.add_argument("--max-trials", type=int, default=None, help="launch at most N trials")
    parser.add_argument("--exhaustive", action="store_true", help="measure every feasible configuration (the grid)")
    parser.add_argument("--memory-per-worker-gb", type=float, default=None, help="memory budget per worker")
    parser.add_argument("--out", default=None, help="output directory (default ./sweeps/<name>-<UTC timestamp>)")
    parser.add_argument("--json", action="store_true", help="print results.json's entries instead of the table")


def main(args: argparse.Namespace) -> int:
    from elastic.errors import SpecError

    try:
        return _main(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _main(args: argparse.Namespace) -> int:
    from elastic.errors import SpecError
    from elastic.yaml_io import read_yaml

    spec = JobSpec.from_yaml(args.config, overrides=args.overrides)
    space = None
    if args.space:
        space = read_yaml(args.space, "--space")
        if space is None:
            raise SpecError("space", f"{args.space} is empty")
    from elastic.tune import report
    from elastic.tune.api import run_sweep

    outcome = run_sweep(
        spec,
        space,
        trial_steps=args.trial_steps,
        max_trials=args.max_trials,
        exhaustive=args.exhaustive,
        memory_per_worker_gb=args.memory_per_worker_gb,
        out=args.out,
        address=args.address,
        progress=not args.json,
    )
    if args.json:
        print(json.dumps(report.rank(outcome.entries), indent=2))
    else:
        print(report.format_table(outcome.entries))
        errs = report.memory_errors(outcome.entries)
        if errs:
            worst = max(errs, key=abs)
            print(
                f"memory model vs measured peak over {len(errs)} trial(s): worst {worst * 100:+.1f}%, "
                f"mean |error| {sum(abs(e) for e in errs) / len(errs) * 100:.1f}%"
            )
        print(f"sweep took {outcome.wall_s:.0f}s; files in {outcome.out}: results.json, heatmap.png", end="")
        print(", best.yaml" if outcome.best else "")
    if outcome.best is None:
        print("no configuration ran to the end: no best.yaml", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_BAD_INPUT, f"error: {message}\n")


def run(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m jobs.sweep", description="Ray Tune sweep over parallel configurations")
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return main(args)


if __name__ == "__main__":
    sys.exit(run())
