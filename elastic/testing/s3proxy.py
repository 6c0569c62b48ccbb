"""A counting HTTP proxy between S3 clients and an S3 server, for tests and benchmarks.

It forwards every request unchanged and records, at the server side of the job, how many
object GETs are in flight at every moment (from the request's arrival to the last byte of
its response) and how many bytes they returned. ``peak(t0, t1)`` is the largest number of
GETs in flight at once between two times; ``at_peak(t0, t1)`` names them.

A GET's end is recorded just before its response's last byte is sent: a client cannot start
a request that follows from that response before then, so a strictly sequential client never
shows two GETs in flight. (Recorded after the last byte, as this proxy once did, the end could
come after the next request's start: the client has its response while the proxy's thread
waits for the GIL, which the in-process S3 server and the job's driver share.)
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade", "trailer"}


class CountingProxy:
    def __init__(self, upstream: str, prefix: str = "", get_latency_s: float = 0.0):
        """``upstream``: the server's endpoint URL; ``prefix``: count only GETs whose path
        starts with it (e.g. ``/bucket/corpus``); other requests are forwarded uncounted.
        ``get_latency_s``: hold each counted GET this long before forwarding it, like an
        object store's time to first byte (loopback answers in about a millisecond)."""
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.prefix = prefix
        self._lock = threading.Lock()
        self.inflight = 0
        self.events: list[tuple[float, int]] = []  # (time, GETs in flight after the change)
        self.gets = 0
        self.bytes = 0
        self.paths: list[tuple[float, str]] = []  # (time, path) of every counted GET, as it starts
        self.served: list[tuple[float, str, str, int]] = []  # (time, path, Range header, bytes) as each ends
        self.spans: list[tuple[float, float, str, str]] = []  # (start, end, path, Range header) of each GET
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                counted = self.command == "GET" and self.path.startswith(proxy.prefix) and "list-type" not in self.path
                path, ranged = self.path.split("?", 1)[0], self.headers.get("Range") or ""
                started = t_start = None
                if counted:
                    started = t_start = proxy._change(+1)
                    with proxy._lock:
                        proxy.paths.append((t_start, path))
                    if get_latency_s:
                        time.sleep(get_latency_s)
                try:
                    conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    conn.close()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    out = data if self.command != "HEAD" else b""
                    if out:
                        self.end_headers()
                        self.wfile.write(out[:-1])
                    if started is not None:  # the end, before the client can have the whole response
                        ended, started = proxy._change(-1), None
                        with proxy._lock:
                            proxy.gets += 1
                            proxy.bytes += len(data)
                            proxy.served.append((ended, path, ranged, len(data)))
                            proxy.spans.append((t_start, ended, path, ranged))
                    if out:
                        self.wfile.write(out[-1:])
                    else:
                        self.end_headers()
                    self.wfile.flush()
                finally:
                    if started is not None:  # failed before its response was sent
                        proxy._change(-1)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _change(self, delta: int) -> float:
        with self._lock:
            now = time.time()
            self.inflight += delta
            self.events.append((now, self.inflight))
            return now

    def peak(self, t0: float = 0.0, t1: float = float("inf")) -> int:
        """Most GETs in flight at once between ``t0`` and ``t1`` (unix seconds)."""
        with self._lock:
            events = list(self.events)
        level, best = 0, 0
        for t, n in events:
            if t < t0:
                level = n
                continue
            if t > t1:
                break
            best = max(best, level, n)
            level = n
        return best

    def at_peak(self, t0: float = 0.0, t1: float = float("inf")) -> list[tuple[float, float, str, str]]:
        """The GETs (start, end, path, Range) in flight together at the first moment between
        ``t0`` and ``t1`` that ``peak`` counts: what a test names when a bound is broken."""
        with self._lock:
            spans = list(self.spans)
        best: list[tuple[float, float, str, str]] = []
        for t in sorted({max(s[0], t0) for s in spans if s[0] <= t1 and s[1] >= t0}):
            here = [s for s in spans if s[0] <= t <= s[1]]
            if len(here) > len(best):
                best = here
        return best

    def idle_s(self) -> float:
        """Seconds since the last counted GET ended with none left in flight (0 while any is)."""
        with self._lock:
            if self.inflight:
                return 0.0
            return time.time() - (self.events[-1][0] if self.events else 0.0)

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.gets, self.bytes

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
