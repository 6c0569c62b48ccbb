"""Is the Ray GCS still there? (docs/stopping.md, "A lost Ray GCS"). Runs in the driver.

Training needs no GCS: the ranks' collectives are gloo's or NCCL's own connections, and the
driver's calls to its actors go to them directly. But every call that places, starts,
drains or stops workers goes through the GCS, and some of Ray's wait for it without a
timeout (the drain watch's ``get_draining_nodes``). When the GCS process is gone, Ray
retries for ``gcs_rpc_server_reconnect_timeout_s`` (60 s) and then ends the driver's
process itself, exit 1: no ``job_end``, no ``summary.json``, whatever the job did.

So the controller asks first, cheaply: one TCP connection to the GCS's port before each
drain poll (every ``DRAIN_POLL_S``). A refused connection (nobody listens: the process is
gone) is proof at once; a connection that times out counts after ``TIMEOUTS_TO_LOSS`` in a
row (a loaded machine can be slow to accept). Once lost, it stays lost: Ray does not
reconnect a driver to a new GCS without its own fault tolerance (an external Redis), which
this project does not set up.
"""

from __future__ import annotations

from elastic.control.diagnosis import connect_all

CONNECT_TIMEOUT_S = 0.2
TIMEOUTS_TO_LOSS = 3


class GcsWatch:
    """The GCS at ``address`` (``host:port``), or none to watch (``None``: no Ray here, as
    in the controller's tests with a fake group)."""

    def __init__(self, address: str | None):
        self.address = address
        self._timeouts = 0
        self._lost: str | None = None

    @classmethod
    def of_this_driver(cls) -> GcsWatch:
        """The GCS of the Ray this process is connected to."""
        import ray

        if not ray.is_initialized():
            return cls(None)
        try:
            return cls(ray.get_runtime_context().gcs_address)
        except Exception:  # noqa: BLE001 - no address to watch (a Ray Client session): nothing watched
            return cls(None)

    def lost(self) -> str | None:
        """Why the GCS is gone (one line), or None while it answers."""
        if self._lost is not None or not self.address:
            return self._lost
        host, _, port = self.address.rpartition(":")
        answer = connect_all({"gcs": (host.strip("[]"), int(port))}, CONNECT_TIMEOUT_S)["gcs"]
        if answer == "refused":
            self._lost = f"the Ray GCS at {self.address} is gone (its port refuses connections)"
        elif answer == "timeout":
            self._timeouts += 1
            if self._timeouts >= TIMEOUTS_TO_LOSS:
                self._lost = (
                    f"the Ray GCS at {self.address} is gone (no connection within {CONNECT_TIMEOUT_S:g}s, "
                    f"{TIMEOUTS_TO_LOSS} times in a row)"
                )
        else:
            self._timeouts = 0
        return self._lost
