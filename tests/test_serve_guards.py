"""``captioner serve``'s guards (:mod:`captioner.share.guards`) against hostile requests, on 127.0.0.1.

Each case is answered with a 4xx ``{"error": ...}`` (or a closed connection) and the server keeps
serving; every request loop is bounded.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("multipart")

from captioner.cli import main  # noqa: E402
from captioner.share import guards, server as server_module  # noqa: E402
from test_serve import png_bytes, post, scene  # noqa: E402

IDLE = 1.0


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint):
    import captioner
    from captioner.share.examples import example_scenes
    from captioner.share.server import ServedModel, ServeLimits, create_app, running

    model = captioner.load(untrained_checkpoint(tmp_path_factory.mktemp("guards"), "sat_soft_tiny"), device="cpu")
    app = create_app([ServedModel("m", model)], example_scenes(1),
                     ServeLimits(max_bytes=64 * 1024, max_beam=2, idle_seconds=IDLE))
    saved = guards.DEFAULT_IDLE
    guards.DEFAULT_IDLE = IDLE  # the uvicorn protocol's idle timeout
    try:
        with running(app) as url:
            yield url
    finally:
        guards.DEFAULT_IDLE = saved


def _conn(base: str) -> http.client.HTTPConnection:
    host, port = base.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=10)


def _answer(conn: http.client.HTTPConnection) -> tuple[int, dict]:
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def _still_serving(base: str) -> None:
    status, answer = post(base, png_bytes(scene(3, (48, 48))), beam=2)
    assert status == 200, answer


def test_a_chunked_upload_is_counted_as_it_streams(base: str) -> None:
    conn = _conn(base)
    conn.putrequest("POST", "/api/caption")
    conn.putheader("Content-Type", "multipart/form-data; boundary=x")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    head = (b'--x\r\nContent-Disposition: form-data; name="image"; filename="big.png"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n")
    block = b"\0" * (16 * 1024)
    try:
        conn.send(f"{len(head):x}\r\n".encode() + head + b"\r\n")
        for _ in range(256):  # at most 4 MiB; the server answers after about 128 KiB
            conn.send(f"{len(block):x}\r\n".encode() + block + b"\r\n")
    except OSError:  # the server closed the connection after answering
        pass
    response = conn.getresponse()
    status, answer, close = response.status, json.loads(response.read()), response.getheader("connection")
    conn.close()
    assert status == 413 and answer == {"error": "upload too large (more than 64.0 KiB)"}
    assert close == "close"  # the rest of the body is not read
    _still_serving(base)


def _get(base: str, path: str, **headers: str) -> tuple[int, dict]:
    conn = _conn(base)
    conn.putrequest("GET", path, skip_host="Host" in headers)
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.endheaders()
    try:
        return _answer(conn)
    finally:
        conn.close()


def test_host_and_origin_are_checked(base: str) -> None:
    port = base.rsplit(":", 1)[1]
    status, answer = _get(base, "/api/models", Host=f"attacker.example:{port}")
    assert status == 400 and answer["error"].startswith(f"Host 'attacker.example:{port}' is not served here")
    for ok in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert _get(base, "/api/models", Host=ok)[0] == 200
    for origin in ("http://attacker.example", "null", f"http://127.0.0.1:{int(port) + 1}"):
        status, answer = _get(base, "/api/models", Origin=origin)
        assert status == 403 and answer["error"] == f"cross-site request refused: Origin {origin!r} is not this page"
    assert _get(base, "/api/models", Origin=base)[0] == 200
    _still_serving(base)


def test_every_4xx_has_the_error_shape(base: str) -> None:
    conn = _conn(base)
    conn.request("POST", "/api/caption", body=b"--x\r\nnot a part", headers={
        "Content-Type": "multipart/form-data; boundary=x"})
    status, answer = _answer(conn)
    conn.close()
    assert status in (400, 422) and set(answer) == {"error"}
    assert _get(base, "/no/such/page") == (404, {"error": "Not Found"})
    conn = _conn(base)
    conn.request("DELETE", "/api/models")
    assert _answer(conn) == (405, {"error": "Method Not Allowed"})
    conn.close()


def test_stalled_connections_are_closed(base: str) -> None:
    host, port = base.removeprefix("http://").split(":")
    socks = []
    for _ in range(20):  # headers never finished
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"POST /api/caption HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        socks.append(s)
    body = socket.create_connection((host, int(port)), timeout=5)  # a body that stalls
    body.sendall(b"POST /api/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; "
                 b"boundary=x\r\nContent-Length: 1000\r\n\r\n--x\r\n")
    start = time.monotonic()
    for s in socks:
        assert s.recv(100) == b""  # closed by the server
        s.close()
    reply = b""
    for _ in range(100):  # until the server closes it
        part = body.recv(4096)
        if not part:
            break
        reply += part
    body.close()
    assert time.monotonic() - start < 4 * IDLE
    assert reply.startswith(b"HTTP/1.1 408") and b'"the request body stalled (nothing for 1 s)"' in reply
    _still_serving(base)


def test_decoding_waits_for_a_slot(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert guards.decode_slots(40_000_000) >= 1
    monkeypatch.setattr(guards, "available_memory", lambda: 8 << 30)
    monkeypatch.setattr(guards.os, "cpu_count", lambda: 16)
    assert guards.decode_slots(40_000_000) == 2  # 4 GiB over 1.44 GB a picture
    monkeypatch.setattr(guards, "available_memory", lambda: 1 << 30)
    assert guards.decode_slots(40_000_000) == 1
    guards.decode_gate.cache_clear()
    decode, running, peak = server_module.decode_image, [0], [0]
    lock = threading.Lock()

    def slow_decode(*args: object, **kwargs: object):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(server_module, "decode_image", slow_decode)
    threads = [threading.Thread(target=post, args=(base, png_bytes(scene(i, (48, 48)))), kwargs={"beam": 1})
               for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        guards.decode_gate.cache_clear()
    assert peak[0] == 1


@pytest.mark.parametrize("value, code, message", [
    ("nan", 2, "argument --max-upload-mb: expected a finite number, got 'nan'"),
    ("inf", 2, "argument --max-upload-mb: expected a finite number, got 'inf'"),
    ("-1", 1, "--max-upload-mb must be a finite number > 0 (MiB, below 1048576), got -1.0"),
    ("1e300", 1, "--max-upload-mb must be a finite number > 0 (MiB, below 1048576), got 1e+300"),
])
def test_max_upload_mb_must_be_finite(value: str, code: int, message: str, capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    assert main(["serve", "-c", str(tmp_path / "m.safetensors"), "--max-upload-mb", value]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
