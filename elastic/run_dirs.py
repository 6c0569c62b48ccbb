"""Where a run writes: its run directory and its checkpoint location, checked before anything
starts (driver side; ``ElasticTrainer.fit`` calls :func:`claim_locations`).

- A run directory must be a directory this process can write (not a file, not on a
  read-only filesystem): found here as one line naming ``--run-dir`` (or ``run_dir``), not
  as a traceback after Ray started.
- One run per location. A run directory that holds another run (``events.jsonl``,
  ``summary.json``, checkpoints) or a checkpoint location that holds checkpoints is
  refused (exit 2, naming ``--run-dir`` / ``run_dir`` or ``checkpoint.uri``) unless
  ``--resume`` continues that same run. "The same run" is the job's name and model
  (:class:`JobIdentity`, kept in ``job.json`` in both places): ``--resume`` may change the
  steps, the layout or the cluster, but a checkpoint of another model would only fail
  later, mid-start, with a layout mismatch.
- One run at a time: :func:`claim_locations` takes an exclusive lock (``flock`` on
  ``RUN_DIR/.lock``, held until :func:`release_run_dir` or the process's end) before it
  writes anything in the run directory, and checks the directory again under it, so two
  runs started together cannot both pass the check; the second is refused naming the field
  ("in use by another run", exit 2).
- Permissions (docs/outputs.md): the run directory and a local checkpoint location are
  created ``0750`` (owner and group; nobody else can list or read them, whatever the
  files' own modes). A directory that already exists keeps its mode: that is the user's
  choice. Object stores (``s3://``) are governed by the bucket's policy.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

from elastic.errors import SpecError
from storage import open_storage, redact_uri

IDENTITY = "job.json"
RUN_FILES = ("events.jsonl", "summary.json")
DIR_MODE = 0o750
LOCK = ".lock"
_HELD: dict[str, int] = {}  # realpath of a run directory -> the descriptor holding its lock


@dataclass(frozen=True)
class JobIdentity:
    """What makes two runs the same run: the job's name and its model."""

    name: str
    model: dict[str, Any]

    @classmethod
    def of(cls, spec: Any) -> JobIdentity:
        return cls(spec.name, spec.model.model_dump(mode="json", by_alias=True))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    def difference(self, raw: bytes | None) -> str | None:
        """How the run recorded in ``raw`` (a ``job.json``) differs from this one; None if it does not
        (or nothing was recorded: a run made before identities were kept)."""
        if raw is None:
            return None
        try:
            other = json.loads(raw)
            name, model = other["name"], other["model"]
        except (ValueError, KeyError, TypeError):
            return "its job.json is unreadable"
        if name != self.name:
            return f"it holds the job {name!r}, not {self.name!r}"
        changed = sorted(k for k in set(model) | set(self.model) if model.get(k) != self.model.get(k))
        if changed:
            k = changed[0]
            return f"it holds another model (model.{k}: {model.get(k)!r} there, {self.model.get(k)!r} here)"
        return None


def claim_locations(
    run_dir: str, run_dir_field: str, checkpoint_uri: str | None, options: dict[str, Any], resume: bool, spec: Any
) -> None:
    """Check both locations (nothing written until both pass), then create the run directory
    and record the job's identity in both. ``SpecError`` naming the field at fault.
    ``checkpoint_uri`` None: the run neither writes nor reads storage checkpoints."""
    identity = JobIdentity.of(spec)
    check_run_dir(run_dir, run_dir_field, resume, identity)
    if checkpoint_uri is not None:
        store, root = _checkpoint_store(checkpoint_uri, options)
        check_checkpoint_location(store, root, resume, identity)
    make_private_dir(run_dir, run_dir_field)
    lock_run_dir(run_dir, run_dir_field)
    try:
        check_run_dir(run_dir, run_dir_field, resume, identity)  # again, under the lock: no check-then-act
    except SpecError:
        release_run_dir(run_dir)
        raise
    _write(os.path.join(run_dir, IDENTITY), identity.to_json(), run_dir_field)
    if checkpoint_uri is None:
        return
    if store.fs_is_local:
        make_private_dir(_local_path(root), "checkpoint.uri")
    try:
        store.storage.put_bytes(store.storage.join(root, IDENTITY), identity.to_json())
    except Exception as exc:  # noqa: BLE001
        why = _reason(exc, store.options)
        raise SpecError("checkpoint.uri", f"cannot write to {redact_uri(root)}: {why}") from None


def lock_run_dir(run_dir: str, field: str) -> None:
    """Hold ``run_dir``'s exclusive lock, or ``SpecError`` naming ``field`` when another run holds it."""
    key = os.path.realpath(run_dir)
    if key in _HELD:
        raise SpecError(field, f"{run_dir} is in use by another run in this process")
    path = os.path.join(run_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        raise SpecError(field, f"cannot create {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        who = f" (pid {holder})" if holder.isdigit() else ""
        raise SpecError(
            field, f"{run_dir} is in use by another run{who}; wait for it or choose a new run directory"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[key] = fd


def release_run_dir(run_dir: str) -> None:
    """Let go of ``run_dir``'s lock (no-op when this process does not hold it)."""
    fd = _HELD.pop(os.path.realpath(run_dir), None)
    if fd is not None:
        os.close(fd)


def check_local_dir(path: str, field: str) -> None:
    """``path`` is a directory this process can write in, or can be created as one; else a
    ``SpecError`` naming ``field`` (a file where the directory belongs, a read-only disk)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SpecError(field, f"{path} is a file, not a directory")
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise SpecError(field, f"cannot create {path}: {existing} is a file")
    why = _not_writable(existing)
    if why is not None:
        raise SpecError(field, f"cannot write in {existing}: {why}")


def check_run_dir(run_dir: str, field: str, resume: bool, identity: JobIdentity) -> None:
    check_local_dir(run_dir, field)
    if not os.path.isdir(run_dir):
        return
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))]
    if not held and not _has_steps(os.path.join(run_dir, "checkpoints")):
        return
    if not resume:
        raise SpecError(
            field,
            f"{run_dir} holds another run ({', '.join(held) or 'checkpoints'}); pass --resume to continue "
            "that run, or choose a new run directory",
        )
    why = identity.difference(_read(os.path.join(run_dir, IDENTITY)))
    if why is not None:
        raise SpecError(field, f"--resume cannot continue the run in {run_dir}: {why}")


def check_checkpoint_location(store: Any, root: str, resume: bool, identity: JobIdentity) -> None:
    try:
        names = store.storage.ls(root)
    except Exception as exc:  # noqa: BLE001 - any client's error: one line naming the field
        reason = _reason(exc, store.options)
        raise SpecError("checkpoint.uri", f"cannot list {redact_uri(root)}: {reason}") from None
    steps = [n for n in names if n.startswith("step_")]
    if not steps:
        return
    if not resume:
        raise SpecError(
            "checkpoint.uri",
            f"{redact_uri(root)} holds checkpoints of another run ({len(steps)}, newest {max(steps)}); "
            "pass --resume to continue that run, or choose a new checkpoint.uri",
        )
    try:
        raw = store.storage.get_bytes(store.storage.join(root, IDENTITY))
    except FileNotFoundError:
        raw = None
    except Exception as exc:  # noqa: BLE001
        reason = _reason(exc, store.options)
        raise SpecError("checkpoint.uri", f"cannot read {redact_uri(root)}/{IDENTITY}: {reason}") from None
    why = identity.difference(raw)
    if why is not None:
        raise SpecError("checkpoint.uri", f"--resume cannot continue from {redact_uri(root)}: {why}")


def make_private_dir(path: str, field: str) -> None:
    """Create ``path`` (and its parents) as ``DIR_MODE``; an existing directory keeps its mode."""
    if os.path.isdir(path):
        return
    try:
        os.makedirs(path, mode=DIR_MODE)
        os.chmod(path, DIR_MODE)  # makedirs' mode is masked by the umask
    except FileExistsError:
        if not os.path.isdir(path):
            raise SpecError(field, f"{path} is a file, not a directory") from None
    except OSError as exc:
        raise SpecError(field, f"cannot create {path}: {exc.strerror or exc}") from None


# --------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _Store:
    storage: Any
    fs_is_local: bool
    options: dict[str, Any]


def _checkpoint_store(uri: str, options: dict[str, Any]) -> tuple[_Store, str]:
    opts = {k: v for k, v in (options or {}).items() if k != "retry"}  # ``retry`` is ours, not fsspec's
    storage = open_storage(uri, opts)
    local = "file" in (storage.fs.protocol if isinstance(storage.fs.protocol, tuple) else (storage.fs.protocol,))
    return _Store(storage, local, options or {}), uri.rstrip("/")


def _local_path(uri: str) -> str:
    return uri.split("://", 1)[1] if uri.startswith("file://") else uri


def _has_steps(path: str) -> bool:
    return os.path.isdir(path) and any(n.startswith("step_") for n in os.listdir(path))


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _not_writable(directory: str) -> str | None:
    """Why this process cannot create a file in ``directory`` (None: it can). Tried for real:
    ``os.access`` answers for root by the mode bits, not by what the filesystem allows."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".elastic-probe-"):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _reason(exc: BaseException, options: dict[str, Any]) -> str:
    """One line on why a storage call failed, with credentials masked."""
    from elastic.checkpoint.storage_tier import scrub

    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return scrub(f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}", options)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _write(path: str, data: bytes, field: str) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as exc:
        raise SpecError(field, f"cannot write {path}: {exc.strerror or exc}") from None
