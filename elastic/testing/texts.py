"""Input text for the data-ingest tests and benchmarks, made locally from the standard library's
sources (text on every machine, nothing downloaded). Runs in the test or benchmark process."""

from __future__ import annotations

import glob
import json
import os
import sysconfig


def stdlib_texts(packages=("json", "email", "http"), limit: int | None = None) -> list[tuple[str, str]]:
    """(name, text) of the Python standard library's sources: text on every machine."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for p in packages for f in glob.glob(os.path.join(root, p, "*.py")))[:limit]
    return [(os.path.relpath(f, root), open(f, encoding="utf-8").read()) for f in files]


def write_jsonl(path: str, docs: list[tuple[str, str]], per_file: int = 8) -> list[str]:
    """Write ``docs`` as JSON lines files of ``per_file`` documents under ``path``."""
    os.makedirs(path, exist_ok=True)
    out = []
    for i in range(0, len(docs), per_file):
        name = os.path.join(path, f"docs-{i // per_file:03d}.jsonl")
        with open(name, "w") as f:
            for src, text in docs[i : i + per_file]:
                f.write(json.dumps({"text": text, "source": src}) + "\n")
        out.append(name)
    return out
