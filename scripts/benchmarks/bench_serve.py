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


def _post(url: str, data: bytes) -> dict:
    boundary = "bench-boundary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="beam"\r\n\r\n3\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="photo.jpg"\r\n'
            "Content-Type: image/jpeg\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def serve_latency(quick: bool) -> dict:
    import torch

    import captioner
    from captioner.checkpoint.store import save_checkpoint
    from captioner.config import get_preset
    from captioner.models.model import build_model
    from captioner.share.examples import example_scenes
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
