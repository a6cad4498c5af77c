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

from captioner.cli import main
from captioner.share import guards, server as server_module
from test_serve import png_bytes, post, scene  # noqa: E402

IDLE = 1.0  # the deadlines for a request head and body
PER_CLIENT = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint):
    import captioner
    from captioner.share.server import example_scenes
    from captioner.share.server import ServedModel, ServeLimits, create_app, running

    model = captioner.load(untrained_checkpoint(tmp_path_factory.mktemp("guards"), "sat_soft_tiny"), device="cpu")
    app = create_app([ServedModel("m", model)], example_scenes(1),
                     ServeLimits(max_bytes=64 * 1024, max_beam=2, head_seconds=IDLE, body_seconds=IDLE,
                                 per_client=PER_CLIENT, max_connections=2 * PER_CLIENT))
    with running(app) as url:
        yield url


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


def _closed_or_refused(s: socket.socket) -> bytes:
    """What the server sent before closing ``s`` (nothing, or one JSON answer; a close with bytes of the
    client's still unread is a reset, which loses the answer)."""
    reply = b""
    for _ in range(100):
        try:
            part = s.recv(4096)
        except ConnectionResetError:
            return reply
        if not part:
            return reply
        reply += part
    raise AssertionError("not closed")


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
    for s in socks:  # evicted by newer ones (503) or past the head deadline (408)
        reply = _closed_or_refused(s)
        assert not reply or (reply.startswith((b"HTTP/1.1 503", b"HTTP/1.1 408")) and b'{"error": "' in reply), reply
        s.close()
    reply = _closed_or_refused(body)
    body.close()
    assert time.monotonic() - start < 4 * IDLE
    assert reply.startswith(b"HTTP/1.1 408") and b'"the request body did not arrive within 1 s"' in reply
    _still_serving(base)


def test_a_head_sent_a_byte_at_a_time_meets_the_same_deadline(base: str) -> None:
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    head = b"GET /api/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
    start, reply = time.monotonic(), b""
    try:
        for i in range(len(head)):  # bounded: 200 bytes, one each 0.05 s, 10 s in all; the server cuts it at 1 s
            s.sendall(head[i:i + 1])
            time.sleep(0.05)
    except OSError:
        pass
    try:
        reply = _closed_or_refused(s)
    except OSError:
        pass
    s.close()
    assert time.monotonic() - start < 3 * IDLE + 1
    assert reply.startswith(b"HTTP/1.1 408") and b'"the request head did not arrive within 1 s"' in reply


def test_slow_heads_from_one_address_do_not_lock_a_real_request_out(base: str) -> None:
    host, port = base.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(70):  # more than the per-address and total caps: the oldest are closed
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"G")
            socks.append(s)
        start = time.monotonic()
        status, answer = _get(base, "/api/models")
        assert status == 200 and time.monotonic() - start < 2, answer
        for s in socks[:-PER_CLIENT]:  # closed, with a JSON 503 unless its one byte was still unread
            reply = _closed_or_refused(s)
            assert not reply or (reply.startswith(b"HTTP/1.1 503") and b'{"error": "too many connections' in reply)
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("head, status, words", [
    (b"GET /api/models HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n", 400, "bad HTTP request"),
    (b"POST /api/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000000000000000000\r\n\r\n", None,
     ""),
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "bad HTTP request"),
])
def test_errors_of_the_http_layer_have_the_error_shape(base: str, head: bytes, status: int | None,
                                                       words: str) -> None:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(head)
        reply = _closed_or_refused(s)
    first, _, rest = reply.partition(b"\r\n")
    code = int(first.split()[1])
    assert code == status if status is not None else 400 <= code < 500, reply
    assert b"content-type: application/json" in rest.lower()
    answer = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert set(answer) == {"error"} and words in answer["error"]
    _still_serving(base)


def test_decoding_holds_a_budget_across_requests(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    budget = guards.DecodeBudget(1000, wait=5.0)
    monkeypatch.setattr(server_module, "shared_budget", lambda capacity, wait: budget)
    monkeypatch.setattr(server_module, "decode_cost", lambda data, max_pixels: 400)  # two fit at once
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
    answers = []
    threads = [threading.Thread(target=lambda i=i: answers.append(post(base, png_bytes(scene(i, (48, 48))), beam=1)))
               for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [a[0] for a in answers] == [200] * 5 and peak[0] == 2 and budget.used == 0


def test_past_the_budget_an_upload_gets_413_or_a_503_after_waiting(base: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    budget = guards.DecodeBudget(1000, wait=0.3)
    monkeypatch.setattr(server_module, "shared_budget", lambda capacity, wait: budget)
    monkeypatch.setattr(server_module, "decode_cost", lambda data, max_pixels: 1001)
    status, answer = post(base, png_bytes(scene(1, (48, 48))), "big.png", beam=1)
    assert status == 413 and answer["error"].startswith("big.png: image too large for this server")
    monkeypatch.setattr(server_module, "decode_cost", lambda data, max_pixels: 600)
    with budget.hold(600, "other"):  # another upload holds most of the budget
        status, answer = post(base, png_bytes(scene(1, (48, 48))), "wait.png", beam=1)
    assert status == 503 and answer == {"error": "wait.png: the server is busy decoding other uploads; try again "
                                                 "in a few seconds"}
    _still_serving(base)


def test_the_cost_of_a_decode_grows_with_its_pixels_and_their_depth() -> None:
    small, grey16 = png_bytes(scene(1, (48, 48))), None
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.zeros((300, 200), np.uint16)).save(out, "PNG")
    grey16 = out.getvalue()
    assert guards.decode_cost(small, None) >= 48 * 48 * 3
    assert guards.decode_cost(grey16, None) >= 300 * 200 * 14
    assert guards.decode_cost(grey16, 1000) == len(grey16)  # over the pixel limit: the decoder refuses it
    assert guards.decode_cost(b"not an image", None) == len(b"not an image")


@pytest.mark.slow  # starts the server in a fresh process: about 3 s
def test_port_0_prints_the_port_it_got(tmp_path: Path, untrained_checkpoint) -> None:
    import os
    import subprocess
    import sys

    ckpt = untrained_checkpoint(tmp_path, "sat_soft_tiny")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "captioner", "serve", "-c", str(ckpt), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1].split()[0])
        assert line.startswith("serving ") and port > 0, line
        status, answer = _get(f"http://127.0.0.1:{port}", "/api/models")
        assert status == 200 and answer[0]["name"]
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.parametrize("option, value, message", [
    ("--max-upload-mb", "nan", "argument --max-upload-mb: expected a finite number, got 'nan'"),
    ("--max-upload-mb", "inf", "argument --max-upload-mb: expected a finite number, got 'inf'"),
    ("--max-upload-mb", "-1", "argument --max-upload-mb: must be over 0 and at most 1024, got -1"),
    ("--max-upload-mb", "1e300", "argument --max-upload-mb: must be over 0 and at most 1024, got 1e300"),
    ("--max-beam", "0", "argument --max-beam: must be between 1 and 10000, got 0"),
    ("--port", "-1", "argument --port: must be between 0 and 65535, got -1"),
])
def test_serve_numbers_are_checked_before_anything_loads(option: str, value: str, message: str,
                                                         capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["serve", "-c", str(tmp_path / "m.safetensors"), option, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
