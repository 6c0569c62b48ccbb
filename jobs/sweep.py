"""Entry point for Ray Jobs: ``ray job submit --working-dir . -- python -m jobs.sweep CONFIG ...``.

Behaves exactly like ``elastic sweep`` (same flags, same exit codes; docs/sweep.md).
"""

from __future__ import annotations

import argparse
import logging
import sys

from elastic.tune.cli import EXIT_BAD_INPUT, add_arguments, main


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
