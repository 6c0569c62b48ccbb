"""The job's rendezvous store as one rank uses it: sealed with the job's secret, and counted.

Runs in every worker process (``ReconfigurableProcessGroup`` wraps its ``TCPStore`` client
in a ``JobStore``); the driver only serves the store (``RendezvousStore``) and makes the
secret. A ``TCPStore`` has no authentication, so nobody reaches it without the job's
secret: it listens on the driver's loopback only, behind relays that admit a connection
only once it proves the secret (``elastic/worker/store_relay.py``). Behind them, nothing the
job puts there is readable or forgeable without the secret either, which reaches the
workers through Ray (the ``ConfigureRequest``), never through the store:

* key names are ``HMAC(secret, key)``: a listing shows opaque names, and no key of the job
  can be named, let alone read, without the secret;
* values are encrypted (a keystream of ``HMAC(secret, nonce, counter)``, a fresh random
  nonce per write) and authenticated (``HMAC`` over the name, nonce and ciphertext): a
  value written or replaced by anyone else fails with :class:`StoreTampered` instead of
  pointing a rank at a forged peer.

Every operation is counted (``ops``): the store operations per rank per re-formation that
``benchmarks/recovery_scaling.py`` reports.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

NONCE_BYTES = 16
TAG_BYTES = 16


class StoreTampered(RuntimeError):
    """A value in the rendezvous store was not written with the job's secret."""


class JobStore(dist.Store):
    """A ``dist.Store`` over ``inner`` (the job's ``TCPStore`` client) that seals every key
    and value with ``secret`` and counts its operations."""

    def __init__(self, inner: Any, secret: str, counter: list[int] | None = None):
        super().__init__()
        self.inner = inner
        self._secret = secret
        self._counter = counter if counter is not None else [0]  # shared with clones
        self._clones: list[JobStore] = []
        key = hashlib.sha256(secret.encode()).digest()
        self._name_key = hmac.new(key, b"name", hashlib.sha256).digest()
        self._enc_key = hmac.new(key, b"encrypt", hashlib.sha256).digest()
        self._mac_key = hmac.new(key, b"authenticate", hashlib.sha256).digest()

    @property
    def ops(self) -> int:
        """Store operations by this rank: this client's and its clones' (NCCL clones it)."""
        return self._counter[0]

    @ops.setter
    def ops(self, value: int) -> None:
        self._counter[0] = value

    # ----- sealing ------------------------------------------------------------------------
    def name(self, key: str) -> str:
        return "j/" + hmac.new(self._name_key, key.encode(), hashlib.sha256).hexdigest()[:40]

    def seal(self, name: str, value: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        body = _xor(value, self._stream(nonce, len(value)))
        return nonce + body + self._tag(name, nonce, body)

    def unseal(self, name: str, sealed: bytes) -> bytes:
        if len(sealed) < NONCE_BYTES + TAG_BYTES:
            raise StoreTampered("a rendezvous value is too short to be the job's")
        nonce, body, tag = sealed[:NONCE_BYTES], sealed[NONCE_BYTES:-TAG_BYTES], sealed[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(name, nonce, body)):
            raise StoreTampered("a rendezvous value was not written with the job's secret")
        return _xor(body, self._stream(nonce, len(body)))

    def _tag(self, name: str, nonce: bytes, body: bytes) -> bytes:
        return hmac.new(self._mac_key, name.encode() + nonce + body, hashlib.sha256).digest()[:TAG_BYTES]

    def _stream(self, nonce: bytes, n: int) -> bytes:
        blocks = (n + 31) // 32
        out = b"".join(
            hmac.new(self._enc_key, nonce + i.to_bytes(4, "big"), hashlib.sha256).digest() for i in range(blocks)
        )
        return out[:n]

    # ----- the dist.Store interface (what c10d and gloo call) -----------------------------
    def set(self, key: str, value: Any) -> None:
        self.ops += 1
        name = self.name(key)
        self.inner.set(name, self.seal(name, _bytes(value)))

    def get(self, key: str) -> bytes:
        self.ops += 1
        name = self.name(key)
        return self.unseal(name, self.inner.get(name))

    def add(self, key: str, value: int) -> int:
        self.ops += 1  # a counter lives on the server: its name is sealed, its value cannot be
        return self.inner.add(self.name(key), value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        """Supported as set-if-absent only (``expected`` empty): sealed values never compare equal."""
        self.ops += 1
        if _bytes(expected):
            raise NotImplementedError("JobStore.compare_set supports only an empty expected value")
        name = self.name(key)
        current = self.inner.compare_set(name, b"", self.seal(name, _bytes(desired)))
        return self.unseal(name, current)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.ops += 1
        names = [self.name(k) for k in keys]
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        self.ops += 1
        return self.inner.check([self.name(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        self.ops += 1
        return self.inner.delete_key(self.name(key))

    def num_keys(self) -> int:
        self.ops += 1
        return self.inner.num_keys()

    def clone(self) -> JobStore:
        """A second client of the same store, sealed the same way and counted in the same tally.

        c10d calls it from C++ (``split_group`` and NCCL's communicator set-up clone their
        parent's store); without it a Python store fails there with "pure virtual function
        ::c10d::Store::clone", which only a GPU run showed."""
        twin = JobStore(self.inner.clone(), self._secret, self._counter)
        # The caller holds only the C++ side: kept here, the Python object (and so the
        # methods above) lives as long as this client, i.e. the generation's group.
        self._clones.append(twin)
        return twin

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")
