"""The counting proxy (``elastic/testing/s3proxy.py``) that the S3 tests and benchmarks measure
GETs in flight with: a strictly sequential client never shows two at once, even while other
threads of the proxy's process hold the GIL (as the in-process S3 server and a job's driver
do). Recorded after the response's last byte, a GET's end came after the next GET's start
in each of 3 runs of this test (60 GETs: 2 in flight); recorded before it, never."""

from __future__ import annotations

import http.client
import http.server
import subprocess
import sys
import threading

import pytest

from elastic.testing.s3proxy import CountingProxy

pytestmark = pytest.mark.timeout(120)

CLIENT = """
import http.client, sys
for i in range(60):
    c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]))  # a new connection each, as new processes do
    c.request("GET", "/b/k%d" % i)
    c.getresponse().read()
    c.close()
"""


class _Server(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b"x" * 2000
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_sequential_client_never_shows_two_gets_in_flight_under_gil_load():
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    proxy = CountingProxy(f"http://127.0.0.1:{upstream.server_address[1]}", prefix="/b")
    stop = threading.Event()

    def burn():
        while not stop.is_set():
            sum(range(2000))

    burners = [threading.Thread(target=burn, daemon=True) for _ in range(2)]
    for t in burners:
        t.start()
    try:
        port = proxy.endpoint.rsplit(":", 1)[1]
        subprocess.run([sys.executable, "-c", CLIENT, port], check=True, timeout=100)
    finally:
        stop.set()
        proxy.close()
        upstream.shutdown()
    assert proxy.counts()[0] == 60
    assert proxy.peak() == 1, proxy.at_peak()
    assert len(proxy.spans) == 60 and all(start <= end for start, end, _, _ in proxy.spans)
