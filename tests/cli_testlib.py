"""The command line in this process: ``jobs.cli.main`` as ``elastic ARGS...`` runs it.

A subprocess costs an interpreter start and the imports (~2 s of CPU each); each test file
keeps one subprocess per console entry for the entry itself (its exit code, and that nothing
but the one error line reaches stderr), and checks the rest of its cases here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(capsys, *args: str) -> CliResult:
    """``elastic *args`` in-process; ``capsys`` is the calling test's fixture."""
    from jobs.cli import main

    capsys.readouterr()  # drop what the test printed before
    code = main(list(args))
    out = capsys.readouterr()
    return CliResult(code, out.out, out.err)
