"""A local HTTP server (127.0.0.1 only) with Range support, for the download tests.

``serve`` serves plain files (the dataset scripts, checkpoints by URL); it can cut the connection
in the middle of a body (``cut_after`` bytes, for the first ``cuts`` answers) to test resuming.
``serve_hub`` answers like the Hugging Face Hub's ``/{org}/{repo}/resolve/{revision}/{file}``
(``HEAD`` with ``X-Repo-Commit``, ``ETag``; ``X-Error-Code`` on a 404), for ``huggingface_hub``
pointed at it through its endpoint setting.
"""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves ``files`` by their last path component; records each request and the bytes sent.

    Class attributes (set by :func:`serve`): ``files``, ``honour_range`` (False: answer a Range
    request with the whole file, as some servers do), ``log`` of ``(name, Range header)``, ``sent``,
    ``cut_after`` / ``cuts`` (send only that many body bytes, then close, for the first ``cuts`` answers).
    """

    files: Mapping[str, bytes] = {}
    honour_range = True
    log: list[tuple[str, str | None]] = []
    sent = 0
    cut_after: int | None = None
    cuts = 0

    def _send_body(self, body: bytes) -> None:
        cls = type(self)
        if cls.cut_after is not None and cls.cuts > 0:
            cls.cuts -= 1
            body = body[: cls.cut_after]
            self.close_connection = True
        cls.sent += len(body)  # before the write: the client may finish reading before this thread goes on
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        name, rng = self.path.rsplit("/", 1)[-1], self.headers.get("Range")
        type(self).log.append((name, rng))
        if name not in self.files:
            self.send_error(404)
            return
        data = self.files[name]
        start = int(rng.split("=")[1].split("-")[0]) if rng and self.honour_range else 0
        if start >= len(data) and start:
            self.send_response(416)
            self.end_headers()
            return
        body = data[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self._send_body(body)

    def log_message(self, *args: object) -> None:
        pass


class HubHandler(RangeHandler):
    """``/{org}/{repo}/resolve/{revision}/{path}`` over ``repos = {"org/repo": {path: bytes}}``."""

    repos: Mapping[str, Mapping[str, bytes]] = {}
    commit = "0123456789abcdef0123456789abcdef01234567"

    def _lookup(self) -> bytes | None:
        parts = self.path.split("?", 1)[0].lstrip("/").split("/")
        type(self).log.append(("/".join(parts), self.headers.get("Range")))
        if len(parts) < 5 or parts[2] != "resolve":
            self._fail("RepoNotFound")
            return None
        repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
        if repo not in self.repos:
            self._fail("RepoNotFound")
            return None
        if filename not in self.repos[repo]:
            self._fail("EntryNotFound")
            return None
        return self.repos[repo][filename]

    def _fail(self, code: str) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Repo-Commit", self.commit)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _headers(self, data: bytes, start: int) -> None:
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", self.commit)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802
        data = self._lookup()
        if data is not None:
            self._headers(data, 0)

    def do_GET(self) -> None:  # noqa: N802
        data = self._lookup()
        if data is None:
            return
        rng = self.headers.get("Range")
        start = int(rng.split("=")[1].split("-")[0]) if rng else 0
        self._headers(data, start)
        self._send_body(data[start:])


@contextmanager
def _run(handler: type[RangeHandler]) -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextmanager
def serve(files: Mapping[str, bytes], prefix: str, cut_after: int | None = None,
          cuts: int = 0) -> Iterator[tuple[str, type[RangeHandler]]]:
    """Serve ``files`` at ``http://127.0.0.1:<port>/<prefix>/<name>``; yields that URL and the handler class."""
    handler = type("Handler", (RangeHandler,), {"files": files, "honour_range": True, "log": [], "sent": 0,
                                                "cut_after": cut_after, "cuts": cuts})
    with _run(handler) as httpd:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/{prefix}", handler


@contextmanager
def serve_hub(repos: Mapping[str, Mapping[str, bytes]]) -> Iterator[tuple[str, type[HubHandler]]]:
    """A fake Hub endpoint serving ``repos``; yields its base URL (for ``HF_ENDPOINT``) and the handler class."""
    handler = type("Hub", (HubHandler,), {"repos": repos, "log": [], "sent": 0, "cut_after": None, "cuts": 0})
    with _run(handler) as httpd:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
