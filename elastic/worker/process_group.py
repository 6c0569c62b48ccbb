"""A process group that can be re-formed in place: one per worker process, for its whole life.

``join(generation, rank, world, ...)`` joins generation ``generation`` of the job's
group; ``leave()`` tears the current one down so that peers blocked on this rank fail at
once. Most private torch calls the elastic runtime needs are made here; all are listed in
``elastic/worker/private_torch.py``, which ``tests/worker/test_torch_private_api.py`` checks.

Rendezvous. The job has one long-lived ``TCPStore``, served by the driver
(:class:`RendezvousStore`) on its loopback, reached only through relays that admit a
connection once it proves a per-job secret, which reaches the workers through Ray
(``elastic/worker/store_relay.py``), and sealed with that secret
(``elastic/worker/job_store.py``: no key of the job can be named, read or forged). Each generation's ranks meet under
their own key prefix (``PrefixStore("gen<N>/", store)``). Nothing is keyed by port: keys a generation left
behind are never read by the next one, so survivors can never pair with a stale peer, and
there is no free-port race to lose. When a member is lost in the middle of a rendezvous,
the driver abandons the generation (:meth:`ReconfigurableProcessGroup.abandon`, called
from the worker's control thread): the rank's connection to the store is shut down, so a
rank still waiting in that rendezvous fails at once instead of waiting out the timeout, and
a rank that had not started it yet refuses it. The next generation reconnects.

What a join connects. On gloo the world group is made lazily (a pair of ranks connects
when a collective first needs it): nothing in a training step spans the world (the stop
flag is agreed over the mesh's sub-groups, ``TrainEngine.forward_backward_agree``), so a
rank connects only to the members of its own DP, PP and TP groups, and its store
operations per re-formation no longer grow with the world (``store_ops``;
``benchmarks/recovery_scaling.py``). On NCCL the world is initialised eagerly on this
rank's device (``device_id``), so that the mesh's sub-groups are split from it
(``ncclCommSplit``, one call per mesh dimension) rather than each bootstrapped from the store.

Shrinking in place (NCCL). When a replica is lost, the driver asks each survivor's control
thread to shrink the group without the lost ranks (:meth:`shrink`:
``torch.distributed.shrink_group(lost, SHRINK_ABORT)``): the collectives the survivors are
blocked in are aborted at once, instead of waiting out ``collective_timeout_s``, and the
shrunk group (its communicator made by ``ncclCommShrink``, no store rendezvous) becomes the
next generation when the plan keeps exactly those survivors in their old order
(``ConfigureRequest.shrink_excluded``); otherwise the rank leaves it and joins a new
generation as usual. gloo cannot shrink (``supports_shrinking`` is false): there the
survivors' collectives fail within milliseconds anyway, and a new generation is formed.

Two timeouts. Joining (the store rendezvous, and connecting to every peer) is bounded by
``rendezvous_timeout``: a peer lost while the others connect to it is retried only that
long (gloo retries a refused connection until its timeout). Once the group and its mesh
exist, their collectives get the full ``collective_timeout_s``.

Leaving a group (see ``elastic/parallel/sockets.py`` for why cutting sockets is needed on
gloo): NCCL communicators are aborted; gloo's TCP connections are shut down. Then every
reference torch keeps to the old groups (the device-mesh stack, DTensor's sharding caches)
is dropped, and the group is destroyed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Collection, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elastic.messages import Connection
from elastic.parallel.sockets import GroupSockets
from elastic.worker.job_store import JobStore
from elastic.worker.store_relay import (
    LOOPBACK,
    MAX_CONNECTIONS,
    LocalRelay,
    StoreGate,
    derived_key,
    foreign_clients,
    require_signed_loopback,
)

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 10.0  # joining a generation, unless collective_timeout_s is shorter
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
_PROBE_KEY = "probe"  # checked once by a new store client (a name no JobStore key has: theirs begin "j/")


class RendezvousStore:
    """The job's ``TCPStore`` server, hosted by the driver (the controller's process).

    The store itself listens on loopback only (127.0.0.1, TCP-MD5 signed: no other user of
    the host can connect to it), and a :class:`~elastic.worker.store_relay.StoreGate` listens
    on ``host`` (the driver's address on the network the workers use, not every
    interface), on an OS-chosen port kept for the whole job, so no port is ever handed from
    one process to another and reused. A connection to the gate that does not prove
    ``secret`` is closed before any byte of it reaches the store
    (``elastic/worker/store_relay.py``). ``secret`` also seals the job's keys and values
    (``JobStore``); it goes to the workers with their ``ConfigureRequest``.
    """

    BUILD_TRIES = 3  # a store someone connected to before its listener was locked is built again

    def __init__(self, host: str, timeout_s: float, max_connections: int = MAX_CONNECTIONS):
        self.host = host
        self.secret = secrets.token_hex(32)
        self._timeout = timedelta(seconds=timeout_s)
        self.signed_loopback = False
        for _ in range(self.BUILD_TRIES):
            self._build_store(derived_key(self.secret, b"loopback"))
            intruders = foreign_clients(self.loopback_port) if self.signed_loopback else []
            if not intruders:
                break
            logger.warning("rendezvous store: %s connected before it was locked; building it again", intruders)
            self._close_store()
        else:
            raise RuntimeError(f"the rendezvous store was connected to by others {self.BUILD_TRIES} times in a row")
        if not self.signed_loopback:
            logger.warning(
                "rendezvous store: this kernel does not offer TCP_MD5SIG; its loopback port %d is open to "
                "every user of this host (the address the workers use is authenticated still)",
                self.loopback_port,
            )
        self._gate = StoreGate((host, 0), self.loopback_port, self.secret, max_connections)
        self.port = self._gate.port

    def _build_store(self, loopback_key: bytes) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(1024)
        self._store: Any = dist.TCPStore(
            LOOPBACK,
            self._listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=self._timeout,
            master_listen_fd=os.dup(self._listener.fileno()),  # the store server owns (and closes) the duplicate
        )
        self.loopback_port = self._store.port
        # Locked after the store's own client (unsigned, made by its constructor) connected;
        # whoever connected before that is found by ``foreign_clients``.
        self.signed_loopback = require_signed_loopback(self._listener, loopback_key)

    @property
    def address(self) -> tuple[str, int]:
        """Where the workers connect: the gate."""
        return (self.host, self.port)

    def take_denials(self) -> dict | None:
        """The connections the gate refused since the last call (``Denials.take``). Where the
        loopback port is not signed, the connections to it now that are not the driver's own
        (anyone on this host could have deleted keys) are named among them too."""
        if not self.signed_loopback:
            for local in foreign_clients(self.loopback_port) or []:
                self._gate.denials.add(f"{local[0]}:{local[1]}", "connected to the store's unsigned loopback port")
        return self._gate.denials.take()

    def close(self) -> None:
        """Stop serving: clients blocked on a key fail within milliseconds."""
        self._gate.close()
        self._close_store()

    def _close_store(self) -> None:
        self._store = None
        gc.collect()
        self._listener.close()


class ReconfigurableProcessGroup:
    """This process's membership in the job's process group, generation after generation."""

    lazy_world = True  # gloo: the world group connects pairs on first use (False: a full mesh at once)

    def __init__(self, device_type: str, timeout_s: float):
        self.device_type = device_type
        self.timeout = timedelta(seconds=timeout_s)  # collectives
        self.rendezvous_timeout = timedelta(seconds=min(timeout_s, max(RENDEZVOUS_TIMEOUT_S, timeout_s / 4)))
        self.generation = 0
        self._client: Any = None  # a JobStore over this process's TCPStore client
        self._client_address: tuple[tuple[str, int], str] | None = None  # (address, secret)
        self._relay: LocalRelay | None = None  # this process's way to the store (store_relay.py)
        self._client_sockets = GroupSockets()  # the store connection, shut down to abandon a rendezvous
        self._abandoned: set[int] = set()
        self._ops_at_join = 0
        self._shrunk: tuple[int, ...] | None = None  # the ranks a shrink in place left out (NCCL)
        self._joining: int | None = None  # the generation this rank is forming, until settled()
        self._lock = threading.Lock()
        self._sockets = GroupSockets()

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def join(
        self,
        generation: int,
        rank: int,
        world: int,
        store: tuple[str, int],
        secret: str = "",
        shrink_excluded: tuple[int, ...] | None = None,
    ) -> float:
        """Leave the current group (if any) and join ``generation``; returns the join time in s.

        ``secret`` is the job's store secret (``RendezvousStore.secret``). A group already
        shrunk without exactly ``shrink_excluded`` (:meth:`shrink`) is kept as this
        generation when it gives this rank ``rank`` of ``world``.
        """
        if self._shrunk is not None:
            shrunk, self._shrunk = self._shrunk, None
            if shrunk == tuple(sorted(shrink_excluded or ())) and (dist.get_rank(), dist.get_world_size()) == (
                rank,
                world,
            ):
                self.generation = generation
                return 0.0
        self.leave()
        with self._lock:
            if generation in self._abandoned:
                raise AbandonedRendezvous(f"generation {generation} was abandoned before this rank joined it")
            self._joining = generation
            client = self._store_client(store, secret)
            self._ops_at_join = client.ops
        self._sockets.before_init()  # after the store client: its connection outlives groups
        # Every rank must name its groups alike: the names prefix their store keys, and a
        # join that failed half-way leaves torch's group counter advanced in this process.
        _reset_group_names()
        t0 = time.perf_counter()
        with _gloo_lazy_init(self.backend == "gloo" and self.lazy_world):
            dist.init_process_group(
                backend=self.backend,
                store=self._group_store(client, generation),
                rank=rank,
                world_size=world,
                timeout=self.rendezvous_timeout,
                **self._device_options(),
            )
        _set_timeout(self.timeout, None)
        self.generation = generation
        return time.perf_counter() - t0

    def _device_options(self) -> dict[str, Any]:
        """Nothing for either backend: NCCL groups are not bound to a device (``device_id``).

        Bound, DeviceMesh splits its sub-groups from the world group (``split_group``), and
        on an H200 (torch 2.11, one rank) the first generation worked but the next one in
        the same process, after ``leave``, crashed the process in ``split_group``
        (segmentation fault; with or without non-blocking init, with a C++ or a Python
        store). Re-forming in the same process is what recovery does, so the group stays
        unbound, as in the GPU check that passed (docs/gpu.md): sub-groups are made with
        ``new_group``, and ``shrink`` is not available (it needs a bound group)."""
        return {}

    def mesh_built(self, groups: list[Any]) -> None:
        """The mesh's sub-groups exist (created with ``rendezvous_timeout``): give them the
        collective timeout."""
        for g in groups:
            _set_timeout(self.timeout, g)

    def built(self) -> None:
        """Call after the mesh and wrappers are built: their connections are cut on a failure."""
        self._sockets.capture()

    def connections(self) -> tuple[Connection, ...]:
        """The gloo group's and its mesh's TCP connections, as captured by ``built`` (none on NCCL)."""
        return self._sockets.connections if self.backend == "gloo" else ()

    def cut_links(self, links: Collection[Connection]) -> int:
        """Shut down this rank's links to lost peers (as this rank sees them; from the control
        thread): a collective blocked on one fails now. NCCL: ``shrink`` aborts instead."""
        return self._sockets.cut(links) if self.backend == "gloo" and links else 0

    def cut_all(self) -> int:
        """Shut down every connection captured at ``built`` (a survivor still in its step after
        the abort); what became of the captured sockets is logged when none was left to shut."""
        census = self._sockets.census() if self.backend == "gloo" else {}
        cut = self.cut_links(self.connections())
        if not cut:
            logger.warning("no connection of the group left to cut; its captured sockets: %s", census)
        return cut

    def shrink(self, excluded: tuple[int, ...]) -> bool:
        """NCCL: shrink the current group in place without the ``excluded`` ranks, aborting
        the collectives in flight on it (``SHRINK_ABORT``). Called from the worker's control
        thread while its train thread may be blocked in one; every survivor calls it. False
        where the group cannot shrink (gloo, or no group)."""
        if self.backend != "nccl" or not dist.is_initialized() or not excluded:
            return False
        if dist.group.WORLD is None or dist.group.WORLD.bound_device_id is None:
            return False  # not bound to a device (``_device_options``): the group is re-formed instead
        with self._lock:
            _shrink_default_group(sorted(excluded))
            self._shrunk = tuple(sorted(excluded))
        return True

    def leave(self, collect: bool = True) -> None:
        """Leave the group so that peers blocked on this rank fail at once, then destroy it.

        Call only after dropping this process's own references to the engine and mesh.
        A second call, with no group left, does nothing. A group shrunk in place is kept
        (only the old mesh's references are dropped) until ``join`` decides.
        ``collect``: run a full garbage collection first, for engines whose objects hold the
        groups in reference cycles (FSDP's and DTensor's state: thousands of objects). An
        engine that holds none (a DDP wrapper, whose last reference is dropped with it)
        skips it: the collection found nothing there and cost 9-37 ms per rank under load
        (instrumented 4-rank recoveries, 2026-11-27); the group's connections are cut first
        either way, so peers never wait on what a collection would free.
        """
        if self._shrunk is not None:
            _drop_torch_group_references()
            gc.collect()
            return
        if not dist.is_initialized() and not self._sockets.sockets:
            return
        if dist.is_initialized() and dist.get_backend() == "nccl":
            try:
                _abort_nccl()
            except Exception as exc:  # already broken: destroyed below either way
                logger.warning("NCCL abort failed: %s", exc)
        else:
            self._sockets.cut()
        _drop_torch_group_references()
        if collect:
            gc.collect()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may fail to tear down; it is gone either way
                logger.debug("destroy_process_group: %s", exc)

    def close(self) -> None:
        """Leave the group and close this process's relay to the store (its threads end)."""
        self.leave()
        with self._lock:
            relay, self._relay, self._client, self._client_address = self._relay, None, None, None
        if relay is not None:
            relay.close()

    def settled(self) -> None:
        """This rank's part in forming its generation is over (it joined, or it failed)."""
        with self._lock:
            self._joining = None

    def abandon(self, generation: int) -> None:
        """The driver gave up on ``generation`` (a member was lost while it formed).

        Safe to call from another thread while ``join`` is blocked forming that
        generation: the store connection is shut down under it, which fails its wait at
        once. A notice that arrives late (the rank has settled, or moved on to a newer
        generation) cuts nothing.
        """
        with self._lock:
            self._abandoned.add(generation)
            if self._joining == generation and self._client is not None:
                self._client_sockets.cut()
                self._client = None

    def store_ops(self) -> int:
        """Store operations this rank made since it began joining the current generation."""
        return self._client.ops - self._ops_at_join if self._client is not None else 0

    def _group_store(self, client: JobStore, generation: int) -> Any:
        """The store a generation's groups meet in.

        gloo: the sealed, counted ``JobStore``. NCCL: a C++ ``PrefixStore`` under a name only
        the secret gives, over the plain client. c10d clones the store from C++ for every
        ``split_group`` and NCCL's set-up; a Python store there failed (torch 2.11, H200:
        first "pure virtual function ::c10d::Store::clone", then, given a ``clone``, a
        segmentation fault inside ``split_group``). So under NCCL keys are unguessable but
        values are not sealed, and the operations are not counted (docs/architecture.md)."""
        if self.backend == "nccl":
            return dist.PrefixStore(f"{client.name('nccl')}/gen{generation}/", client.inner)
        return dist.PrefixStore(f"gen{generation}/", client)

    def _store_client(self, address: tuple[str, int], secret: str) -> JobStore:
        """This process's client of the job's store, through its local relay to the gate
        (``elastic/worker/store_relay.py``); made again when the store or the secret changes."""
        key = ((address[0], int(address[1])), secret)
        if self._client is None or self._client_address != key:
            if self._relay is None or self._client_address != key:
                if self._relay is not None:
                    self._relay.close()
                # Its listener exists before ``before_init``: it is never among the sockets cut.
                self._relay = LocalRelay(key[0], secret, self.rendezvous_timeout.total_seconds())
            self._client_sockets.before_init()
            tcp = dist.TCPStore(LOOPBACK, self._relay.port, is_master=False, timeout=self.rendezvous_timeout)
            # One round trip: the relay's sockets for this client (accepted, and to the gate)
            # exist before the capture, never among a group's (which ``leave`` cuts).
            tcp.check([_PROBE_KEY])
            self._client = JobStore(tcp, secret)
            self._client_sockets.capture()
            self._client_address = key
        return self._client


@contextlib.contextmanager
def _gloo_lazy_init(on: bool) -> Iterator[None]:
    """Groups made inside connect their gloo pairs lazily (torch reads this variable when
    it makes a gloo group); groups made after connect at once again."""
    if not on:
        yield
        return
    before = os.environ.get(GLOO_LAZY_INIT)
    os.environ[GLOO_LAZY_INIT] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GLOO_LAZY_INIT, None)
        else:
            os.environ[GLOO_LAZY_INIT] = before


class AbandonedRendezvous(RuntimeError):
    """This rank was told to give up the generation it was joining."""


def is_collective_error(exc: BaseException) -> bool:
    """Did ``exc`` come out of the collective layer, rather than from this rank's own code?

    Decided by type, never by message text. torch raises ``DistError`` subclasses for NCCL
    and store errors; gloo's transport errors (a peer closed the connection, a timeout)
    reach Python as a plain ``RuntimeError`` converted from ``c10::Error``. Anything more
    specific (``ValueError``, ``torch.OutOfMemoryError``, an injected error, a user's own
    ``RuntimeError`` subclass) is the rank's own failure. A plain ``RuntimeError`` from
    elsewhere in torch's C++ is possible too; the controller resolves that case: when no
    peer turns out to be dead, the rank that reported first is blamed
    (``elastic/control/diagnosis.py``).
    """
    return isinstance(exc, dist.DistError) or type(exc) is RuntimeError


# --------------------------------------------------------------------------- private torch
# Each private name below is checked by tests/worker/test_torch_private_api.py.


def _set_timeout(timeout: timedelta, group: Any) -> None:
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def _reset_group_names() -> None:
    dist.distributed_c10d._world.group_count = 0


def _abort_nccl() -> None:
    dist.distributed_c10d._abort_process_group()


def _shrink_default_group(excluded: list[int]) -> None:
    """``torch.distributed.shrink_group`` is public; its flag still lives in ``distributed_c10d``."""
    dist.shrink_group(excluded, shrink_flags=dist.distributed_c10d.SHRINK_ABORT)


def _drop_torch_group_references() -> None:
    """torch's own references to the groups: the device-mesh stack and DTensor's caches.

    DTensor's sharding-propagation caches key on device meshes and keep their groups alive.
    """
    from torch.distributed.device_mesh import _mesh_resources
    from torch.distributed.tensor import DTensor

    _mesh_resources.mesh_stack.clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        clear = getattr(getattr(propagator, name, None), "cache_clear", None)
        if clear is not None:  # an lru_cache in the torch versions that have it
            clear()
