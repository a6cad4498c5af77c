"""A local HTTP server (127.0.0.1 only) with Range support, for the download scripts' tests."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves ``files`` by their last path component; records each request and the bytes sent.

    Class attributes (set by :func:`serve`): ``files``, ``honour_range`` (False: answer a Range
    request with the whole file, as some servers do), ``log`` of ``(name, Range header)``, ``sent``.
    """

    files: Mapping[str, bytes] = {}
    honour_range = True
    log: list[tuple[str, str | None]] = []
    sent = 0

    def do_GET(self) -> None:  # noqa: N802
        name, rng = self.path.rsplit("/", 1)[-1], self.headers.get("Range")
        type(self).log.append((name, rng))
        if name not in self.files:
            self.send_error(404)
            return
        data = self.files[name]
        start = int(rng.split("=")[1].rstrip("-")) if rng and self.honour_range else 0
        if start >= len(data) and start:
            self.send_response(416)
            self.end_headers()
            return
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        type(self).sent += len(body)  # before the write: the client may finish reading before this thread goes on
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serve(files: Mapping[str, bytes], prefix: str) -> Iterator[tuple[str, type[RangeHandler]]]:
    """Serve ``files`` at ``http://127.0.0.1:<port>/<prefix>/<name>``; yields that URL and the handler class."""
    handler = type("Handler", (RangeHandler,), {"files": files, "honour_range": True, "log": [], "sent": 0})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/{prefix}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()
