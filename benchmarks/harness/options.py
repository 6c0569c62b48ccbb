"""Command-line options the benchmarks share: a comma-separated choice among known names.
Runs in a benchmark's driver process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def add_choice_list(ap: argparse.ArgumentParser, option: str, known: Sequence[str]) -> None:
    """``--<option>``: comma-separated names of ``known`` (all of them by default)."""
    ap.add_argument(f"--{option}", default=",".join(known), help="comma-separated, of " + ", ".join(known))


def chosen(ap: argparse.ArgumentParser, value: str, known: Sequence[str], option: str) -> list[str]:
    """The names ``value`` lists; exits 2 naming ``--<option>`` when one is unknown or none is given."""
    names = [n for n in value.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        ap.error(f"--{option}: unknown {bad or 'empty'}; choose from {', '.join(known)}")
    return names
