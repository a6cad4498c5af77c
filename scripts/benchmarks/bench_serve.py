"""``captioner serve`` latency: upload of a 500-px photo -> caption and attention back, over HTTP.

The model is the Lite0 SAT model (preset ``sat_soft_lite``: EfficientNet-Lite0 with its offline
ImageNet weights + a 512-wide Show-Attend-Tell decoder, 10,000-word vocabulary; the weights of
the decoder are untrained, which does not change the work done per request, except that captions
run to ``max_len`` 20 words: the slowest case). The app runs under uvicorn on 127.0.0.1 in this
process; each request posts the JPEG (beam 3, 1 caption) and waits for the JSON answer (caption,
per-word attention and the explorer page). The photo is a COCO photo from ``../shared/data``
resized to 500 px on its long side, or a synthetic one where that is absent.

Figures: ``p50_seconds``, ``p95_seconds``, ``mean_seconds`` over ``requests`` (50; 5 with
``--quick``) after 3 warm-up requests; ``server_p50_seconds``: the part spent in the handler
(decode, encode, search, explorer page); ``threads``: torch's intra-op threads.

    python scripts/benchmark.py --only serve
"""

from __future__ import annotations

import io
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
PHOTOS = REPO.parent / "shared" / "data" / "coco2017-mini" / "train2017"
VOCAB_SIZE = 10_000


def _photo() -> tuple[bytes, str]:
    import numpy as np
    from PIL import Image

    files = sorted(PHOTOS.glob("*.jpg"))[:1]
    if files:
        image, source = Image.open(files[0]).convert("RGB"), f"COCO {files[0].name}"
    else:
        image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (375, 500, 3), dtype=np.uint8))
        source = "synthetic noise"
    image.thumbnail((500, 500))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue(), f"{source}, {image.width}x{image.height}"


def _upload(url: str, data: bytes, name: str, content_type: str, beam: int) -> urllib.request.Request:
    """The page's upload form (``beam`` and ``image``) as a multipart POST request."""
    boundary = "bench-boundary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="beam"\r\n\r\n{beam}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"\r\n'
            f"Content-Type: {content_type}\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return urllib.request.Request(url, data=body, method="POST",
                                  headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})


def _post(url: str, data: bytes) -> dict:
    with urllib.request.urlopen(_upload(url, data, "photo.jpg", "image/jpeg", 3), timeout=120) as r:
        return json.loads(r.read())


def serve_latency(quick: bool) -> dict:
    import torch

    import captioner
    from captioner.checkpoint.store import save_checkpoint
    from captioner.config import get_preset
    from captioner.models.model import build_model
    from captioner.share.server import example_scenes
    from captioner.share.server import ServedModel, create_app, running
    from captioner.text import Vocabulary

    torch.manual_seed(0)
    vocab = Vocabulary([f"word{i}" for i in range(VOCAB_SIZE - 4)])
    model = build_model(get_preset("sat_soft_lite").model, len(vocab), load_pretrained=True)
    photo, source = _photo()
    requests = 5 if quick else 50
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        ckpt = Path(tmp) / "lite0_sat.safetensors"
        save_checkpoint(ckpt, model, vocab)
        app = create_app([ServedModel("lite0_sat", captioner.load(ckpt, device="cpu"))], example_scenes(1))
        with running(app) as base:
            url = f"{base}/api/caption"
            for _ in range(3):
                _post(url, photo)
            times, inside = [], []
            for _ in range(requests):
                t0 = time.perf_counter()
                answer = _post(url, photo)
                times.append(time.perf_counter() - t0)
                inside.append(answer["seconds"])
    times.sort()
    return {
        "p50_seconds": round(statistics.median(times), 4),
        "p95_seconds": round(times[min(len(times) - 1, round(0.95 * (len(times) - 1)))], 4),
        "mean_seconds": round(statistics.fmean(times), 4),
        "server_p50_seconds": round(statistics.median(inside), 4),
        "requests": requests,
        "words": len(answer["captions"][0]["words"]),
        "threads": torch.get_num_threads(),
        "photo": source,
    }


BENCHMARKS = {"serve": serve_latency}


# --- a crowd: 16 large uploads at once, and 70 connections that trickle their headers ---

def _grey16_png(side: int) -> bytes:
    """A ``side`` x ``side`` 16-bit grey PNG of a gradient (small on disk, large when decoded)."""
    import numpy as np
    from PIL import Image

    row = (np.arange(side, dtype=np.uint32) * 10 % 65536).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(np.repeat(row[None, :], side, axis=0)).save(buf, format="PNG")
    return buf.getvalue()


def _rss(pid: int) -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of process ``pid`` in bytes."""
    found = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                found[key] = int(value.split()[0]) * 1024
    return found["VmRSS"], found["VmHWM"]


def _post_status(url: str, data: bytes, name: str) -> int:
    import urllib.error

    try:
        with urllib.request.urlopen(_upload(url, data, name, "image/png", 1), timeout=300) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def serve_crowd(quick: bool) -> dict:
    """``captioner serve`` (a separate process, the Lite0 SAT model) under 16 concurrent uploads of a
    6000x6000 16-bit grey PNG (peak and resting RSS of the server), then 70 connections that send one
    header byte every 8 s while real requests are timed (2000 px, 4 uploads and 10 connections with
    ``--quick``)."""
    import os
    import socket
    import subprocess
    import threading

    import torch

    from captioner.checkpoint.store import save_checkpoint
    from captioner.config import get_preset
    from captioner.models.model import build_model
    from captioner.text import Vocabulary

    side, uploads, slow = (2000, 4, 10) if quick else (6000, 16, 70)
    torch.manual_seed(0)
    vocab = Vocabulary([f"word{i}" for i in range(VOCAB_SIZE - 4)])
    model = build_model(get_preset("sat_soft_lite").model, len(vocab), load_pretrained=True)
    png = _grey16_png(side)
    small = _photo()[0]
    with tempfile.TemporaryDirectory(prefix="bench-crowd-") as tmp:
        ckpt = Path(tmp) / "lite0_sat.safetensors"
        save_checkpoint(ckpt, model, vocab)
        del model
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen([sys.executable, "-m", "captioner", "serve", "-c", str(ckpt), "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            line = proc.stdout.readline()
            port = int(line.rsplit(":", 1)[1].split()[0])
            base = f"http://127.0.0.1:{port}"
            url = f"{base}/api/caption"
            _post_status(url, small, "warm.jpg")
            time.sleep(1.0)
            start_rss = _rss(proc.pid)[0]
            samples, done = [], threading.Event()

            def sample() -> None:
                while not done.is_set():
                    samples.append(_rss(proc.pid)[0])
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            statuses: list[int] = []
            t0 = time.perf_counter()
            threads = [threading.Thread(target=lambda i=i: statuses.append(_post_status(url, png, f"grey16_{i}.png")))
                       for i in range(uploads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            burst_seconds = time.perf_counter() - t0
            time.sleep(3.0)
            done.set()
            sampler.join()
            rest_rss, hwm = _rss(proc.pid)

            # slow headers: each connection sends one byte, then one more every 8 s
            socks = []
            for _ in range(slow):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"G")
                socks.append(s)
            latencies, statuses_real = [], []
            t_slow = time.monotonic()
            next_byte = t_slow + 8.0
            while time.monotonic() - t_slow < (10.0 if quick else 20.0):  # bounded: 20 s of requests
                if time.monotonic() >= next_byte:
                    for s in socks:
                        try:
                            s.sendall(b"E")
                        except OSError:
                            pass
                    next_byte += 8.0
                r0 = time.perf_counter()
                statuses_real.append(_post_status(url, small, "real.jpg"))
                latencies.append(time.perf_counter() - r0)
                time.sleep(0.5)
            closed = 0
            for s in socks:
                s.settimeout(0.1)
                try:
                    s.recv(4096)  # an answer or the end: the server ended it
                    closed += 1
                except (socket.timeout, BlockingIOError):
                    pass  # still open
                except OSError:
                    closed += 1
                s.close()
        finally:
            proc.kill()
            proc.wait(30)
    return {
        "uploads": uploads, "side": side, "png_bytes": len(png),
        "statuses": "/".join(f"{code}x{statuses.count(code)}" for code in sorted(set(statuses))),
        "start_rss_gb": round(start_rss / 1e9, 3),
        "peak_rss_gb": round(max(hwm, max(samples, default=0)) / 1e9, 3),
        "rest_rss_gb": round(rest_rss / 1e9, 3),
        "burst_seconds": round(burst_seconds, 1),
        "slow_connections": slow, "slow_closed": closed,
        "real_requests": len(latencies),
        "real_ok": statuses_real.count(200),
        "real_max_seconds": round(max(latencies), 3),
        "real_p50_seconds": round(statistics.median(latencies), 3),
    }


BENCHMARKS["serve_crowd"] = serve_crowd
