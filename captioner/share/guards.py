"""What ``captioner serve`` holds at once, and who may ask: the guards around its routes.

Host (Starlette's ``TrustedHostMiddleware``) and Origin checks, bodies counted as they stream
against a size and a deadline for the whole body, a deadline for the whole request head and a cap on
connections (in all and per client address) in the uvicorn protocol, a budget for the decoded pixels
held at once across all requests, and one error shape, ``{"error": "<one line>"}``, for every error
the server or its HTTP layer sends. docs/share_and_show.md lists each bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import http
import io
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any, BinaryIO

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from captioner.device import available_memory
from captioner.errors import CaptionerError, one_line
from captioner.files import size_text

__all__ = ["DEFAULT_BODY", "DEFAULT_HEAD", "MAX_CONNECTIONS", "PER_CLIENT", "BodyGuard", "DecodeBudget", "Refused",
           "TrustedHosts", "allowed_hosts", "available_memory", "decode_cost", "default_decode_bytes",
           "error_response", "install_guards", "release_memory", "shared_budget", "uvicorn_options"]

DEFAULT_HEAD = 10.0  # seconds for a whole request line and headers, however slowly they trickle
DEFAULT_BODY = 60.0  # seconds for a whole request body
MAX_CONNECTIONS = 64  # connections at once, in all
PER_CLIENT = 16  # connections at once from one client address
QUEUE_SECONDS = 60.0  # how long an upload may wait for the decode budget before a 503
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers larger than this are refused (431)
TRIM_DELAY = 2.0  # seconds after the budget empties that memory is given back once more
MALLOC_ARENAS = 2
MMAP_THRESHOLD = 4 << 20  # allocations this large come from mmap, so freeing them gives the memory back
_WILDCARD = {"", "0.0.0.0", "::"}
_LOOPBACK = ("localhost", "127.0.0.1", "[::1]")

Scope = dict[str, Any]
CLOSE = {"Connection": "close"}  # after a body cut short: the rest of it is not read


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The documented error shape: ``{"error": "<one line>"}`` with ``status``."""
    return JSONResponse({"error": one_line(message)}, status_code=status, headers=headers)


class Refused(CaptionerError):
    """An upload the server will not decode now: over the budget (413) or the budget is busy (503)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# --- Host and Origin ---

def allowed_hosts(bind: str) -> list[str] | None:
    """The ``Host`` names a request may give when the server listens on ``bind``: that address and
    the loopback names (None: any, for a wildcard address)."""
    bind = bind.strip("[]").lower()
    if bind in _WILDCARD:
        return None
    return sorted({f"[{bind}]" if ":" in bind else bind, *_LOOPBACK})


class TrustedHosts:
    """Starlette's ``TrustedHostMiddleware`` decides; a refusal is answered in the JSON shape (a web
    page reached through DNS rebinding names a host that is not served here)."""

    def __init__(self, app: Any, bind: str = "127.0.0.1") -> None:
        self.app = app
        hosts = allowed_hosts(bind)
        self.check = None if hosts is None else TrustedHostMiddleware(self._passed, hosts, www_redirect=False)

    @staticmethod
    async def _passed(scope: Scope, receive: Any, send: Any) -> None:
        scope["captioner.host"] = True

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if self.check is not None and scope["type"] == "http":
            async def discard(message: dict) -> None:
                return None

            await self.check(scope, receive, discard)
            if not scope.pop("captioner.host", False):
                host = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
                await error_response(400, f"Host {host[:100]!r} is not served here (use the address the server "
                                          "printed; a name that resolves here is refused, as DNS rebinding "
                                          "uses one)")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _same_origin(origin: str, host_header: str) -> bool:
    """Whether ``Origin`` names this server as the request reached it (scheme http, same host and port)."""
    try:
        parsed = urllib.parse.urlsplit(origin)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        there = urllib.parse.urlsplit(f"http://{host_header}")
        here_port = there.port or 80
    except ValueError:
        return False
    return (parsed.scheme in ("http", "https") and bool(parsed.hostname)
            and parsed.hostname == there.hostname and port == here_port)


# --- bodies ---

class BodyGuard:
    """ASGI middleware: the Origin check, the streaming body limit and the deadline for the whole body."""

    def __init__(self, app: Any, max_upload: int, overhead: int = 0, body_seconds: float = DEFAULT_BODY) -> None:
        self.app, self.max_upload, self.max_body = app, max_upload, max_upload + overhead
        self.body_seconds = body_seconds

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refused = self._refusal(headers)
        if refused is not None:
            await refused(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _refusal(self, headers: dict[str, str]) -> JSONResponse | None:
        origin = headers.get("origin")
        if origin is not None and not _same_origin(origin, headers.get("host", "")):
            return error_response(403, f"cross-site request refused: Origin {origin[:100]!r} is not this page")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return error_response(413, f"upload too large ({size_text(int(length))}; the limit is "
                                       f"{size_text(self.max_upload)}): send a smaller copy, or start captioner "
                                       "serve with a higher --max-upload-mb", CLOSE)
        return None

    def _counted(self, receive: Any) -> Any:
        total, done = 0, False
        deadline = time.monotonic() + self.body_seconds

        async def counted() -> dict:
            nonlocal total, done
            if done:  # the body is in: later calls wait for a disconnect, without a deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.body_seconds:g} s",
                                    CLOSE) from None
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_body:
                    done = True
                    raise HTTPException(413, f"upload too large (more than {size_text(self.max_upload)})", CLOSE)
                done = not message.get("more_body", False)
            return message

        return counted


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    return error_response(exc.status_code, detail, exc.headers)


def install_guards(app: FastAPI, max_upload: int, overhead: int = 0, bind: str = "127.0.0.1",
                   body_seconds: float = DEFAULT_BODY) -> None:
    """Add :class:`BodyGuard` (bodies up to ``max_upload + overhead`` bytes: the form around the file),
    :class:`TrustedHosts` outside it, and the ``{"error": ...}`` shape of the framework's own answers."""
    app.add_middleware(BodyGuard, max_upload=max_upload, overhead=overhead, body_seconds=body_seconds)
    app.add_middleware(TrustedHosts, bind=bind)
    app.add_exception_handler(HTTPException, _http_error)


# --- memory: the decode budget ---

def default_decode_bytes() -> int:
    """The decode budget: a quarter of the memory available, between 256 MiB and 1 GiB."""
    return max(256 << 20, min(1 << 30, available_memory() // 4))


_MODE_BYTES = {"1": 1, "L": 1, "P": 1, "LA": 2, "La": 2, "PA": 2, "RGB": 3, "YCbCr": 3, "LAB": 3, "HSV": 3}


def decode_cost(data: bytes | BinaryIO, max_pixels: int | None) -> int:
    """Bytes an upload may need while decoded and captioned, from its header only (its bytes if unreadable)."""
    from PIL import Image

    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    size = stream.seek(0, 2)
    stream.seek(0)
    try:
        with Image.open(stream) as im:
            width, height = im.size
            mode = im.mode
    except Exception:  # noqa: BLE001 - the decoder names what is wrong with it
        return size
    finally:
        stream.seek(0)
    pixels = width * height
    if max_pixels is not None and pixels > max_pixels:
        return size
    per_pixel = _MODE_BYTES.get(mode, 4 if not mode.startswith("I;16") else 2)
    return pixels * (3 * per_pixel + 8) + size


class DecodeBudget:
    """Bytes of decoded images held at once, across all requests: an upload waits (up to ``wait`` s)
    until its cost fits, and gives it back when its answer is made."""

    def __init__(self, capacity: int, wait: float = QUEUE_SECONDS) -> None:
        self.capacity, self.wait = int(capacity), wait
        self.used = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, cost: int, name: str) -> Iterator[None]:
        """Hold ``cost`` bytes of the budget for the ``with`` block (``Refused`` 413 if too big, 503 after ``wait`` s)."""
        cost = max(1, int(cost))
        if cost > self.capacity:
            raise Refused(413, f"{name}: image too large for this server (about {size_text(cost)} while decoded; "
                               f"it decodes at most {size_text(self.capacity)} at once)")
        deadline = time.monotonic() + self.wait
        with self._cond:
            while self.used + cost > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Refused(503, f"{name}: the server is busy decoding other uploads; try again in a few "
                                       "seconds")
                self._cond.wait(left)
            self.used += cost
        try:
            yield
        finally:
            with self._cond:
                self.used -= cost
                idle = self.used == 0
                self._cond.notify_all()
            if idle:  # now, and once more when the answers made from it are sent and freed
                release_memory()
                timer = threading.Timer(TRIM_DELAY, self._trim_if_idle)
                timer.daemon = True
                timer.start()

    def _trim_if_idle(self) -> None:
        if self.used == 0:
            release_memory()


@functools.lru_cache(maxsize=None)
def shared_budget(capacity: int | None = None, wait: float = QUEUE_SECONDS) -> DecodeBudget:
    """The process-wide budget of ``capacity`` bytes (default :func:`default_decode_bytes`)."""
    limit_heap()
    return DecodeBudget(default_decode_bytes() if capacity is None else capacity, wait)


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


@functools.lru_cache(maxsize=1)
def limit_heap() -> None:
    """Large allocations from mmap and few shared heaps, so a decoded image's memory returns to the system."""
    lib = _libc()
    if lib is not None:
        lib.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
        lib.mallopt(-8, MALLOC_ARENAS)  # M_ARENA_MAX: the request threads share a few heaps


def release_memory() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim``; nothing elsewhere)."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


# --- connections: the uvicorn protocol ---

def _raw_answer(transport: asyncio.Transport, status: int, message: str) -> None:
    """Write a whole JSON error answer and close: for a connection whose request head never arrived."""
    body = json.dumps({"error": one_line(message)}).encode()
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("ascii")
    if not transport.is_closing():
        transport.write(head + body)
        transport.close()


def uvicorn_options(head_seconds: float = DEFAULT_HEAD, max_connections: int = MAX_CONNECTIONS,
                    per_client: int = PER_CLIENT) -> dict:
    """``uvicorn.Config`` options: an h11 head deadline, connection caps, JSON answers for h11's errors."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class RecordingConnection(h11.Connection):
        """h11's connection, keeping the protocol error it raised for the answer."""

        last_error: h11.RemoteProtocolError | None = None

        def next_event(self) -> Any:
            try:
                return super().next_event()
            except h11.RemoteProtocolError as exc:
                self.last_error = exc
                raise

    class GuardedProtocol(H11Protocol):
        """h11 with a deadline for each request head and connection caps."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn.__class__ = RecordingConnection
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_bytes = 0
            self.opened = 0.0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.opened = self.loop.time()
            if self._admit():
                self._arm()

        def data_received(self, data: bytes) -> None:
            if self.in_head():
                self._head_bytes += len(data)
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets its own deadline

        def in_head(self) -> bool:
            """No request is being answered: a request line or headers are (or may be) arriving."""
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(head_seconds, self._head_expired)

        def _head_expired(self) -> None:
            if self.transport.is_closing() or not self.in_head():
                return
            if self._head_bytes:
                _raw_answer(self.transport, 408, f"the request head did not arrive within {head_seconds:g} s")
            else:
                self.transport.close()

        def _open(self) -> list[GuardedProtocol]:
            return [c for c in self.connections
                    if c is not self and isinstance(c, GuardedProtocol) and not c.transport.is_closing()]

        def _evict(self, among: list[GuardedProtocol]) -> bool:
            """Close the oldest connection of ``among`` still waiting for its head; False when none is."""
            waiting = [c for c in among if c.in_head()]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c.opened)
            if oldest._head_bytes:
                _raw_answer(oldest.transport, 503, "too many connections: this one had not sent its request")
            else:
                oldest.transport.close()
            return True

        def _admit(self) -> bool:
            address = self.client[0] if self.client else None
            same = [c for c in self._open() if (c.client[0] if c.client else None) == address]
            if len(same) >= per_client and not self._evict(same):
                _raw_answer(self.transport, 503, f"too many connections from {address} ({per_client} at most); "
                                                 "try again when one has finished")
                return False
            others = self._open()
            if len(others) >= max_connections and not self._evict(others):
                _raw_answer(self.transport, 503, f"too many connections ({max_connections} at most); try again "
                                                 "in a few seconds")
                return False
            return True

        def send_400_response(self, msg: str) -> None:
            exc = getattr(self.conn, "last_error", None)
            status = getattr(exc, "error_status_hint", 400) or 400
            reason = one_line(str(exc))[:200] if exc is not None and str(exc) else msg
            _raw_answer(self.transport, status, f"bad HTTP request ({reason})")

    return {"http": GuardedProtocol, "timeout_keep_alive": 5, "limit_concurrency": None,
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
