"""What ``captioner serve`` holds at once, and who may ask: the guards around its routes.

* **Host and Origin**: served on a loopback address, a request must name a loopback host
  (``127.0.0.1``, ``localhost``, ``[::1]``) in its ``Host`` header, so a web page reached through
  DNS rebinding is refused; served on another address, that address (or a loopback name); on a
  wildcard address (``0.0.0.0``, ``::``) any host. A request that carries an ``Origin`` header
  (browsers send it with every cross-site request) must come from the page itself: any other
  web site the user visits is refused, status 403.
* **Bodies**: a request body is counted as it streams (with or without ``Content-Length``, chunked
  or not) and cut off with a 413 as soon as it passes the limit, so nothing larger is ever held in
  memory or spooled to disk; a stated ``Content-Length`` over the limit is refused before reading.
* **Idle connections**: a connection that sends nothing for ``idle`` seconds while no request is
  being answered (a request line or headers never finished) is closed; a body that stalls as long
  is answered 408.
* **Decoding**: uploads are decoded under a process-wide semaphore whose size comes from the
  memory available and the pixel limit (a 16-bit image at the limit needs about 36 bytes per
  pixel while it is converted), so concurrent uploads cannot add up past the memory.
* **Errors**: every 4xx answer is ``{"error": "<one line>"}`` (also those of the framework: a
  malformed multipart body, an unknown route, a wrong method).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import os
import threading
import urllib.parse
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from captioner.errors import one_line
from captioner.files import size_text

__all__ = ["BYTES_PER_PIXEL", "DEFAULT_IDLE", "BodyGuard", "allowed_hosts", "available_memory", "decode_gate",
           "decode_slots", "error_response", "install_guards", "uvicorn_options"]

DEFAULT_IDLE = 30.0  # seconds a connection may send nothing while it is expected to
BYTES_PER_PIXEL = 36  # peak memory of decoding one pixel of a 16-bit image to RGB
MAX_CONNECTIONS = 64  # uvicorn answers 503 past this many connections and tasks at once
_WILDCARD = {"", "0.0.0.0", "::"}
_LOOPBACK_NAMES = {"localhost"}

Scope = dict[str, Any]


CLOSE = {"Connection": "close"}  # after a body cut short: the rest of it is not read


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The documented error shape: ``{"error": "<one line>"}`` with ``status``."""
    return JSONResponse({"error": one_line(message)}, status_code=status, headers=headers)


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind: str) -> frozenset[str] | None:
    """The host names a request may give in its ``Host`` header when the server listens on ``bind``
    (None: any, for a wildcard address); loopback addresses are matched by :func:`host_allowed`."""
    bind = bind.strip("[]").lower()
    if bind in _WILDCARD:
        return None
    return frozenset({bind})


def _split_host(value: str) -> str:
    """``host`` of a ``Host`` header value ``host[:port]`` (``[v6]:port`` too), lowercased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def host_allowed(host_header: str, allowed: frozenset[str] | None) -> bool:
    if allowed is None:
        return True
    host = _split_host(host_header)
    return host in allowed or _is_loopback(host)


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


class BodyGuard:
    """ASGI middleware: the Host and Origin checks, the streaming body limit and the body idle timeout."""

    def __init__(self, app: Any, max_upload: int, overhead: int = 0, bind: str = "127.0.0.1",
                 idle: float = DEFAULT_IDLE) -> None:
        self.app, self.max_upload, self.max_body, self.idle = app, max_upload, max_upload + overhead, idle
        self.allowed = allowed_hosts(bind)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refused = self._refusal(scope, headers)
        if refused is not None:
            await refused(scope, receive, send)
            return
        await self.app(scope, self._counted(receive), send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> JSONResponse | None:
        host = headers.get("host", "")
        if host and not host_allowed(host, self.allowed):
            return error_response(400, f"Host {host[:100]!r} is not served here (use the address the server "
                                       "printed; a name that resolves here is refused, as DNS rebinding uses one)")
        origin = headers.get("origin")
        if origin is not None and not _same_origin(origin, host):
            return error_response(403, f"cross-site request refused: Origin {origin[:100]!r} is not this page")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return error_response(413, f"upload too large ({size_text(int(length))}; the limit is "
                                       f"{size_text(self.max_upload)})", CLOSE)
        return None

    def _counted(self, receive: Any) -> Any:
        total, done = 0, False

        async def counted() -> dict:
            nonlocal total, done
            if done:  # the body is in: later calls wait for a disconnect, without a deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.idle)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body stalled (nothing for {self.idle:g} s)", CLOSE) from None
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
                   idle: float = DEFAULT_IDLE) -> None:
    """Add :class:`BodyGuard` (bodies up to ``max_upload + overhead`` bytes: the form around the file)
    and the ``{"error": ...}`` shape of the framework's own 4xx answers to ``app``."""
    app.add_middleware(BodyGuard, max_upload=max_upload, overhead=overhead, bind=bind, idle=idle)
    app.add_exception_handler(HTTPException, _http_error)


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable`` of /proc/meminfo; else the physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def decode_slots(max_pixels: int) -> int:
    """How many uploads may be decoded at once: half the available memory over the worst case of one,
    at least 1 and at most the number of CPUs."""
    worst = max(1, max_pixels) * BYTES_PER_PIXEL
    return max(1, min(os.cpu_count() or 1, available_memory() // 2 // worst))


@functools.lru_cache(maxsize=None)
def decode_gate(max_pixels: int) -> threading.BoundedSemaphore:
    """The process-wide semaphore that uploads of at most ``max_pixels`` are decoded under."""
    return threading.BoundedSemaphore(decode_slots(max_pixels))


def uvicorn_options(idle: float | None = None) -> dict:
    """``uvicorn.Config`` options that close idle connections (``idle`` seconds, default
    :data:`DEFAULT_IDLE`) and cap how many are served at once."""
    idle = DEFAULT_IDLE if idle is None else idle
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdleTimeoutProtocol(H11Protocol):
        """h11 that closes a connection silent for ``idle`` seconds while no request is being answered."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._idle_timer: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._idle_timer = self.loop.call_later(idle, self._on_idle)

        def _on_idle(self) -> None:
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self._arm()  # a request is being answered: the app's own timeouts apply
                return
            self.transport.close()

    return {"http": IdleTimeoutProtocol, "timeout_keep_alive": 5, "limit_concurrency": MAX_CONNECTIONS}
