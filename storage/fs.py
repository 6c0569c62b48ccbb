"""A small storage Protocol over ``str`` URIs, implemented with fsspec.

Checkpoint code talks to storage only through :class:`Storage`, in full URIs
(``/abs/path``, ``file://...``, ``s3://bucket/prefix``, ``memory://...``). A ``Path`` would
break ``s3://``, and keeping the surface this small makes an object store and a local disk
behave the same way for the commit protocol in :mod:`storage.store`.

S3 endpoint and credentials come from the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``) or from
``storage_options`` (``endpoint_url``, ``key``, ``secret``, ``token``, ``region``, or any s3fs
argument). Use :func:`redact` / :func:`redact_uri` before logging any of them.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import logging
import os
import re
import stat
from collections.abc import Iterator
from typing import IO, Any, Protocol, runtime_checkable

import fsspec

from storage.errors import UnsafePath

log = logging.getLogger(__name__)

_SECRET_WORDS = ("secret", "token", "password", "passwd", "credential", "key", "signature")


@runtime_checkable
class Storage(Protocol):
    """Operations the checkpoint store needs; every argument is a full URI."""

    def join(self, base: str, *parts: str) -> str: ...
    def open(self, uri: str, mode: str = "rb") -> contextlib.AbstractContextManager[IO[bytes]]: ...
    def put_bytes(self, uri: str, data: bytes) -> None: ...
    def get_bytes(self, uri: str, start: int | None = None, end: int | None = None) -> bytes: ...
    def exists(self, uri: str) -> bool: ...
    def ls(self, uri: str) -> list[str]: ...
    def sizes(self, uri: str) -> dict[str, int]: ...
    def size(self, uri: str) -> int: ...
    def rm(self, uri: str) -> None: ...
    def is_link(self, uri: str) -> bool: ...


class FsspecStorage:
    """:class:`Storage` over one fsspec filesystem.

    - ``open(uri, "wb")`` streams (s3fs uploads multipart blocks); if the ``with`` body raises,
      the partial object is discarded instead of being published half-written.
    - Local writes are fsynced on close so "data, then manifest, then marker" also holds after
      a power loss.
    - Listings bypass fsspec's directory cache: other processes (other ranks) write here too.
    - On a local disk nothing is followed out of a directory: a listing leaves out symbolic
      links (and FIFOs, sockets, devices), a read of one is :class:`UnsafePath` (a FIFO would
      block the reader forever), and removing one removes the link, never its target.
    """

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self.fs = fs
        self._local = "file" in _protocols(fs)

    def join(self, base: str, *parts: str) -> str:
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])

    @contextlib.contextmanager
    def open(self, uri: str, mode: str = "rb") -> Iterator[IO[bytes]]:
        if mode == "rb":
            if self._local:
                with os.fdopen(self._open_plain(uri), "rb") as f:
                    yield f
                return
            with self.fs.open(uri, "rb") as f:
                yield f
            return
        if mode != "wb":
            raise ValueError(f"mode must be 'rb' or 'wb', not {mode!r}")
        f = self.fs.open(uri, "wb")
        try:
            yield f
            f.flush()
            if self._local:
                with contextlib.suppress(AttributeError, io.UnsupportedOperation, OSError):
                    os.fsync(f.fileno())
            f.close()  # publishes the object (single PUT or multipart completion)
        except BaseException:
            self._discard(f, uri)
            raise

    def _discard(self, f: Any, uri: str) -> None:
        """Drop a half-written file: abort the multipart upload / remove the local file."""
        try:
            if isinstance(f, fsspec.spec.AbstractBufferedFile):
                f.discard()  # s3fs: abort the multipart upload, drop the buffer
                f.closed = True  # so that close()/__del__ does not publish the partial buffer
            else:
                f.close()
                self.fs.rm(uri)
        except Exception as exc:  # noqa: BLE001 - best effort: the original error matters more
            log.warning("could not discard partial file %s: %s: %s", redact_uri(uri), type(exc).__name__, exc)

    def put_bytes(self, uri: str, data: bytes) -> None:
        with self.open(uri, "wb") as f:
            f.write(data)

    def get_bytes(self, uri: str, start: int | None = None, end: int | None = None) -> bytes:
        if not self._local:
            return self.fs.cat_file(uri, start=start, end=end)
        with os.fdopen(self._open_plain(uri), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            first = 0 if start is None else (start if start >= 0 else max(0, size + start))
            last = size if end is None else (min(end, size) if end >= 0 else size + end)
            f.seek(first)
            return f.read(max(0, last - first))

    def _open_plain(self, uri: str) -> int:
        """A local file opened for reading, if it is a regular file and not a symbolic link."""
        path = self.fs._strip_protocol(uri)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO opens without a writer
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(path, "is a symbolic link: never followed") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePath(path, "is not a regular file")
        return fd

    def exists(self, uri: str) -> bool:
        self._fresh(uri)
        return self.fs.exists(uri)

    def ls(self, uri: str) -> list[str]:
        """Names (not paths) of the direct children of ``uri``; ``[]`` if it does not exist."""
        return sorted(_basename(e["name"]) for e in self._entries(uri))

    def sizes(self, uri: str) -> dict[str, int]:
        """``{name: size}`` of the files directly under ``uri``, from a single listing."""
        return {_basename(e["name"]): int(e["size"]) for e in self._entries(uri) if e.get("type") == "file"}

    def size(self, uri: str) -> int:
        self._fresh(uri)
        return int(self.fs.size(uri))

    def is_link(self, uri: str) -> bool:
        """A local symbolic link (an object store has none)."""
        return self._local and os.path.islink(self.fs._strip_protocol(uri))

    def rm(self, uri: str) -> None:
        """Remove a file or a whole directory tree; a missing path is not an error."""
        self._fresh(uri)
        if self.is_link(uri):
            os.unlink(self.fs._strip_protocol(uri))  # the link, never what it points to
            return
        try:
            self.fs.rm(uri, recursive=True)
        except FileNotFoundError:
            pass

    def _entries(self, uri: str) -> list[dict[str, Any]]:
        self._fresh(uri)
        try:
            entries = self.fs.ls(uri, detail=True)
        except FileNotFoundError:
            return []
        if self._local:  # nothing followed out of the directory (the class docstring)
            entries = [e for e in entries if not e.get("islink") and e.get("type") in ("file", "directory")]
        return entries

    def _fresh(self, uri: str) -> None:
        if not self._local:
            self.fs.invalidate_cache(self.fs._strip_protocol(uri))


def open_storage(uri: str, storage_options: dict[str, Any] | None = None) -> FsspecStorage:
    """Storage for ``uri``'s scheme, configured from ``storage_options`` and AWS env vars."""
    protocol = fsspec.core.split_protocol(uri)[0] or "file"
    options = copy.deepcopy(dict(storage_options or {}))  # botocore mutates nested config dicts
    if protocol in ("s3", "s3a"):
        options = s3_options(options)
    elif protocol == "file":
        options.setdefault("auto_mkdir", True)
    log.debug("opening storage %s with options %s", redact_uri(uri), redact(options))
    return FsspecStorage(fsspec.filesystem(protocol, **options))


def url_to_fs(uri: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``fsspec.core.url_to_fs`` with our option names translated as :func:`open_storage`
    does (``region``, ``endpoint_url``, the AWS variables): the filesystem and ``uri``'s path
    on it. Untranslated, s3fs rejects ``region`` with a TypeError."""
    fs = open_storage(uri, storage_options).fs
    return fs, fs._strip_protocol(uri)


def s3_options(options: dict[str, Any]) -> dict[str, Any]:
    """Translate our option names and the AWS env vars into s3fs arguments."""
    opts = dict(options)
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    endpoint = (
        opts.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        client_kwargs.setdefault("endpoint_url", endpoint)
    region = opts.pop("region", None) or opts.pop("region_name", None)
    region = region or os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        client_kwargs.setdefault("region_name", region)
    for ours, theirs in (
        ("aws_access_key_id", "key"),
        ("aws_secret_access_key", "secret"),
        ("aws_session_token", "token"),
    ):
        if ours in opts:
            opts.setdefault(theirs, opts.pop(ours))
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    return opts


def _is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def redact(options: Any) -> Any:
    """Copy of ``options`` with every credential-like value replaced by ``'***'``.

    A string/bytes/container value under a key containing secret/token/password/credential/key
    is a credential (numbers are not, so ``tokens_per_s`` survives); nested mappings and lists
    are walked, and URIs with user info (``s3://KEY:SECRET@bucket``) are redacted anywhere.
    """
    if isinstance(options, dict):
        return {
            k: ("***" if _is_secret_name(str(k)) and isinstance(v, (str, bytes, dict, list, tuple)) else redact(v))
            for k, v in options.items()
        }
    if isinstance(options, (list, tuple)):
        return type(options)(redact(v) for v in options)
    if isinstance(options, str):
        return redact_uri(options)
    return options


# Secrets may contain "/" (AWS secret keys often do), so user info runs to the "@", not to a "/".
_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^@\s]*@")


def redact_uri(uri: str) -> str:
    """``s3://KEY:SECRET@bucket/x`` -> ``s3://***@bucket/x``; other strings unchanged."""
    return _USERINFO.sub(r"\1***@", uri)


def _basename(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
