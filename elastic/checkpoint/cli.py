"""``elastic ckpt list URI [--json]`` and ``elastic ckpt verify URI [--step N]``.

Exit codes follow the CLI contract: 0 ok, 1 a checkpoint is damaged, 2 bad input (a URI
that cannot be opened or holds no checkpoint, a step that does not exist). ``URI`` is the
checkpoint root (``checkpoint.uri``); a step directory (``.../step_00000030``) also works.
S3 credentials come from the standard AWS environment variables; URIs are printed with
any user info redacted.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

EXIT_OK, EXIT_DAMAGED, EXIT_BAD_INPUT = 0, 1, 2
_STEP_DIR = re.compile(r"^(.*)/step_(\d+)/?$")


class _BadInput(Exception):
    pass


def _open(uri: str, step: int | None) -> tuple[Any, int | None]:
    """The store for ``uri`` (root or step directory) and the step it names, if any."""
    from storage import CheckpointStore, FsspecStorage

    match = _STEP_DIR.match(uri)
    if match:
        if step is not None and step != int(match.group(2)):
            raise _BadInput(f"--step {step} does not match the step directory {uri}")
        uri, step = match.group(1), int(match.group(2))
    try:
        store = CheckpointStore(uri)
        if not store.storage.exists(store.root):
            raise _BadInput(f"no checkpoint directory at {_redact(uri)}")
        if isinstance(store.storage, FsspecStorage) and store.storage.fs.isfile(store.root):
            raise _BadInput(f"{_redact(uri)} is a file, not a checkpoint directory")
    except _BadInput:
        raise
    except Exception as exc:  # noqa: BLE001 - unknown scheme, unreachable endpoint, bad credentials
        raise _BadInput(f"cannot open {_redact(uri)}: {type(exc).__name__}: {_redact(str(exc))}") from None
    return store, step


def _redact(text: str) -> str:
    from elastic.checkpoint.storage_tier import scrub

    return scrub(text)


def ckpt_list(uri: str, as_json: bool) -> int:
    """Every checkpoint under ``uri`` (committed ones and uncommitted attempts), by step."""
    try:
        store, step = _open(uri, None)
        infos = [i for i in store.list(include_uncommitted=True) if step is None or i.step == step]
    except _BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001
        print(f"error: cannot list {_redact(uri)}: {type(exc).__name__}: {_redact(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    rows = [{"step": i.step, "uri": _redact(i.uri), "committed": i.committed, "bytes": i.bytes} for i in infos]
    if as_json:
        print(json.dumps(rows))
        return EXIT_OK
    if not rows:
        print(f"no checkpoints under {_redact(uri)}")
        return EXIT_OK
    print(f"{'STEP':>8}  {'COMMITTED':<9}  {'BYTES':>14}  URI")
    for r in rows:
        print(f"{r['step']:>8}  {'yes' if r['committed'] else 'no':<9}  {r['bytes']:>14,}  {r['uri']}")
    return EXIT_OK


def ckpt_verify(uri: str, step: int | None) -> int:
    """Check every file of one step (or of every committed step) against the manifest's crc32."""
    try:
        store, step = _open(uri, step)
        if step is None:
            steps = [i.step for i in store.list_committed()]
            if not steps:
                raise _BadInput(f"no committed checkpoint under {_redact(uri)}")
        else:
            if not store.storage.ls(store.step_uri(step)):
                raise _BadInput(f"no checkpoint for step {step} under {_redact(uri)}")
            steps = [step]
        from storage.store import safe_relpath

        damaged = 0
        for s in steps:
            damage = store.verify(s, deep=True)
            if not damage:
                print(f"step {s}: ok")
                continue
            damaged += 1
            for d in damage:
                where = _redact(store.file_uri(s, d.relpath)) if safe_relpath(d.relpath) else repr(d.relpath)
                print(f"step {s}: DAMAGED {where}: {d.reason}")
    except _BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - storage unreachable mid-way
        print(f"error: cannot verify {_redact(uri)}: {type(exc).__name__}: {_redact(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if damaged:
        print(f"{damaged} of {len(steps)} checkpoint(s) damaged", file=sys.stderr)
        return EXIT_DAMAGED
    return EXIT_OK
