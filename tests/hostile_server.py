"""A 127.0.0.1 HTTP server whose answers misbehave on purpose, for the download bound tests.

Each behaviour is bounded so the server stops by itself: a stream is at most ``limit`` bytes, a
trickle sends at most ``limit`` bytes, a stall waits at most ``hold`` seconds.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class HostileHandler(http.server.BaseHTTPRequestHandler):
    """``/zeros``: ``limit`` zero bytes, no Content-Length; ``/huge``: announces ``limit`` bytes;
    ``/trickle``: one byte every ``gap`` seconds; ``/stall``: ``prefix`` bytes then nothing for
    ``hold`` seconds; ``/short``: ``body`` cut to ``cut`` bytes without a length; ``/file``: ``body``;
    ``/prefixed``: ``prefix`` then zeros, ``limit`` bytes in all, no Content-Length."""

    protocol_version = "HTTP/1.0"
    limit = 1 << 20
    gap = 0.05
    hold = 5.0
    prefix = b"\x10\x00\x00\x00\x00\x00\x00\x00{"
    body = b""
    cut = 0
    requests = 0
    sent = 0
    auth: str | None = None

    def _head(self, length: int | None = None) -> None:
        self.send_response(200)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _write(self, data: bytes) -> bool:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:  # the client gave up: what is being tested
            return False
        type(self).sent += len(data)
        return True

    def do_GET(self) -> None:  # noqa: N802
        cls = type(self)
        cls.requests += 1
        cls.auth = self.headers.get("Authorization")
        name = self.path.lstrip("/").split("/", 1)[0]  # the first path segment names the behaviour
        if name.startswith("zeros"):
            self._head()
            block = bytes(64 * 1024)
            for _ in range(cls.limit // len(block)):
                if not self._write(block):
                    return
        elif name.startswith("prefixed"):
            self._head()
            if not self._write(cls.prefix):
                return
            block = bytes(64 * 1024)
            for _ in range((cls.limit - len(cls.prefix)) // len(block)):
                if not self._write(block):
                    return
        elif name.startswith("huge"):
            self._head(cls.limit)
            self._write(bytes(1024))
        elif name.startswith("trickle"):
            self._head()
            for i in range(cls.limit):
                if not self._write(cls.prefix[i:i + 1] or b"\x00"):
                    return
                time.sleep(cls.gap)
        elif name.startswith("stall"):
            self._head(len(cls.prefix) + 1000)
            self._write(cls.prefix)
            end = time.monotonic() + cls.hold
            while time.monotonic() < end:
                time.sleep(0.02)
        elif name.startswith("short"):
            self._head()
            self._write(cls.body[:cls.cut])
        elif name.startswith("file"):
            self._head(len(cls.body))
            self._write(cls.body)
        else:
            self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def hostile(**attrs: object) -> Iterator[tuple[str, type[HostileHandler]]]:
    """Serve :class:`HostileHandler` with ``attrs`` on 127.0.0.1; yields the base URL and the handler class."""
    handler = type("Hostile", (HostileHandler,), dict(attrs))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
