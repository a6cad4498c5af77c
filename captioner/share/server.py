"""The web app behind ``captioner serve``: FastAPI routes over models loaded once.

Routes (the page fetches nothing from anywhere else): ``GET /`` the page; ``GET /api/models``;
``GET /examples/{i}`` (the package's photos, ``--examples DIR``, or scenes for a scenes model);
``POST /api/caption`` (``image``, ``model``, ``beam``, ``n_best``, ``everyday``): the n-best captions, each
with the photo's concepts and labels (or null), its ``attention.json`` record and its explorer page;
``everyday=true`` decodes with :data:`EVERYDAY` (400 for a model that does not offer it: ``info()``'s
``"everyday"``).
Bad uploads get ``{"error": "<file>: <reason>"}`` with 400 or 413, uploads beyond the decode budget
503, and the process keeps serving; bounds are :mod:`captioner.share.guards`'. Requests for one
model are captioned one at a time.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response

from captioner.data.images import DEFAULT_MAX_PIXELS, decode_image, load_image, pixels_text
from captioner.data.shapes import COLORS, SHAPES, SIZES, render_scene, sample_scene, scene_captions
from captioner.config import DecodeOptions, everyday_photos
from captioner.decoding.rules import label_reading
from captioner.errors import CaptionerError, ConfigError, DataError, ImageLoadError, one_line
from captioner.files import MiB, atomic_write, read_bytes, size_text
from captioner.inference import Captioner
from captioner.language import fusion_unavailable
from captioner.share.guards import (DEFAULT_BODY, DEFAULT_HEAD, MAX_CONNECTIONS, PER_CLIENT, QUEUE_SECONDS, Refused,
                                    decode_cost, error_response, install_guards, shared_budget, uvicorn_options)
from captioner.share.page import render_card_page, render_page
from captioner.text import SPECIALS, tokenize
from captioner.viz.attention_json import caption_to_dict
from captioner.viz.explorer import render_explorer


__all__ = ["EVERYDAY", "VERDICTS", "ServeLimits", "ServedModel", "caption_upload", "card_summary", "create_app", "running",
           "verdict"]

log = logging.getLogger(__name__)

LABELS = 5  # the photo's labels shown, for a model whose encoder has an ImageNet head
# the page's "everyday photos": the packaged language model of COCO caption text fused, object words the labels say
# are absent made unlikely and, where still written, filled with what the labels see where they looked (better on
# everyday photos, a little worse on Flickr8k's; docs/decoding_metrics_checkpoint.md)
EVERYDAY = everyday_photos()  # the named setting (captioner.config.EVERYDAY_PHOTOS), as --everyday
# the page's verdict on a caption from the model's own log-probability per word (its words and its end, divided by
# the words; teacher-forced, so never the fused score of "everyday photos"): at or above the first cut "likely
# right", below the second "probably wrong", between them "unsure". Fitted by scripts/experiments/verdict_bands.py
# on the shipped model's captions (beam 3) of the first 500 Flickr8k dev photos and the 168 everyday dev photos
# (coco2014-val168), plain and with EVERYDAY (1,336 captions): a caption is right when it names only objects its
# references name and its CIDEr-D is >= 0.5; right were 65% of those >= -0.15 per word, 41% between, 22% below -0.30
# (the table per set is in docs/share_and_show.md)
VERDICTS = ((-0.15, "likely right", "2 in 3 such captions of the dev photos were right"),
            (-0.30, "unsure", "2 in 5 such captions of the dev photos were right"),
            (float("-inf"), "probably wrong", "1 in 5 such captions of the dev photos was right"))
# what to do about an upload over a limit: the page shrinks a photo before it sends it (its long side to twice
# ServeLimits.display_side); another client can do the same, or the server can be started with a higher limit
PIXELS_HINT = ("shrink it before sending (the model looks at 224 px; a long side of 2,000 px is plenty), or start "
               "captioner serve with a higher --max-megapixels (at most {most:.0f})")
BYTES_HINT = "send a smaller copy (the page shrinks photos itself), or start captioner serve with a higher --max-upload-mb"
FORM_OVERHEAD = 64 * 1024  # multipart boundaries and the small fields around the file
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data: blob:; connect-src 'self'; frame-src 'self' about:; form-action 'self'; "
       "base-uri 'none'")


@dataclass(frozen=True)
class ServeLimits:
    """What one upload may ask for."""

    max_bytes: int = 20 * MiB  # largest upload accepted
    max_pixels: int = 40_000_000  # largest image accepted (from its header, before decoding: decompression bombs)
    # (at most the library's own guard, captioner.data.images.DEFAULT_MAX_PIXELS)
    max_beam: int = 5  # largest beam size (the n-best list is at most the beam)
    max_len: int = 20  # longest caption in words
    display_side: int = 720  # largest side of the picture in the explorer
    host: str = "127.0.0.1"  # the address served (the Host and Origin checks of :mod:`captioner.share.guards`)
    head_seconds: float = DEFAULT_HEAD  # the deadline for a whole request line and headers
    body_seconds: float = DEFAULT_BODY  # the deadline for a whole request body
    max_connections: int = MAX_CONNECTIONS  # connections at once; per_client: from one client address
    per_client: int = PER_CLIENT
    decode_bytes: int | None = None  # the budget of decoded images held at once (None: from the memory available)
    queue_seconds: float = QUEUE_SECONDS  # how long an upload may wait for the budget before a 503

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_beam", "max_len", "display_side", "head_seconds",
                     "body_seconds", "max_connections", "per_client", "queue_seconds"):
            if not getattr(self, name) >= 1 or getattr(self, name) == float("inf"):
                raise ConfigError(f"{name} must be a finite number >= 1, got {getattr(self, name)}")
        if self.max_pixels > DEFAULT_MAX_PIXELS:
            raise ConfigError(f"max_pixels must be at most {DEFAULT_MAX_PIXELS:,} (the image loader's own limit), "
                              f"got {self.max_pixels:,}")
        if self.decode_bytes is not None and not self.decode_bytes >= 1:
            raise ConfigError(f"decode_bytes must be >= 1, got {self.decode_bytes}")

    def uvicorn_options(self) -> dict:
        """The uvicorn options that apply these limits to connections."""
        return uvicorn_options(self.head_seconds, self.max_connections, self.per_client)


@dataclass
class ServedModel:
    """A model loaded once, its name on the page, its one request thread, how many ``labels`` it reports and
    whether it offers ``everyday`` photos (:data:`EVERYDAY`; ``everyday_why_not`` says why not)."""

    name: str
    captioner: Captioner
    card: str | None = field(default=None, repr=False)  # its model card (Markdown), when it has one
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "captioner-model"), repr=False)
    labels: int = field(init=False, default=0)
    everyday: bool = field(init=False, default=False)
    everyday_why_not: str = field(init=False, default="", repr=False)

    def __post_init__(self) -> None:
        try:
            self.captioner.label_head()  # built once here (its classifier read from the encoder's wheel)
            self.labels = LABELS
        except ConfigError:  # tiny, ResNet, timm names: no ImageNet head, no labels, no error
            self.labels = 0
        if label_reading(self.captioner.model.decoder) is None:  # what the veto and the fill read
            self.everyday_why_not = "its decoder does not read its encoder's labels"
            return
        self.everyday_why_not = fusion_unavailable(EVERYDAY.lm, self.captioner.vocab)  # loaded once (cached)
        self.everyday = not self.everyday_why_not
        if self.everyday_why_not:  # another vocabulary, or an install without the file
            log.info("%s: no everyday photos setting (%s)", self.name, self.everyday_why_not)

    def info(self) -> dict:
        """What the page shows of the model: its name, family, vocabulary, one line about it and whether it
        offers everyday photos."""
        cfg = self.captioner.config
        about = card_summary(self.card) if self.card else ""
        if not about:
            words = len(self.captioner.vocab) - len(SPECIALS)
            data = "synthetic scenes" if reads_scenes(self.captioner.vocab.itos) else "photos"
            about = f"{cfg.decoder.name} decoder over {cfg.encoder.name}, {words:,} words, trained on {data}"
        return {"name": self.name, "decoder": cfg.decoder.name, "encoder": cfg.encoder.name,
                "vocab": len(self.captioner.vocab), "about": about, "card": self.card is not None,
                "everyday": self.everyday}


def card_summary(card: str) -> str:
    """One line about a model from its card (Markdown), leading with what it knows: "knows <its photos>"
    when the card says (a sentence starting "The photos are ...", up to its first comma), then the title's
    text after the model's name."""
    title = next((line[2:].strip() for line in card.splitlines() if line.startswith("# ")), "")
    title = re.sub(r"^`[^`]*`\s*:\s*", "", title).replace("`", "")
    photos = re.search(r"\bThe photos are ([^,.;]+)", card)
    knows = f"knows photos {photos.group(1).strip()}" if photos else ""
    return one_line(" \u00b7 ".join(part for part in (knows, title) if part))[:200]


def verdict(log_prob: float, words: int) -> str:
    """The page's words for a caption of ``words`` words whose own log-probability is ``log_prob``
    (:data:`VERDICTS`: by the log-probability per word)."""
    per_word = log_prob / max(1, words)
    return next(name for cut, name, _ in VERDICTS if per_word >= cut)


def _check_choice(name: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ConfigError(f"{name} must be between {low} and {high}, got {value}")
    return value


def caption_upload(served: ServedModel, data: bytes | BinaryIO, filename: str, beam: int = 3, n_best: int = 1,
                   limits: ServeLimits = ServeLimits(), *, everyday: bool = False) -> dict:
    """Caption an uploaded image (bytes or a spooled file): the n-best captions, each with its record and page.

    ``everyday``: decode with :data:`EVERYDAY`. The decoded image is held under the process-wide decode
    budget. Raises ``ImageLoadError`` (not a readable image, too large), ``ConfigError`` (``beam``/``n_best``,
    ``everyday`` for a model that does not offer it), ``Refused`` (413 or 503).
    """
    beam = _check_choice("beam", beam, 1, limits.max_beam)
    n_best = _check_choice("n_best", n_best, 1, beam)
    if everyday and not served.everyday:
        raise ConfigError(f"model {served.name!r} does not offer everyday photos: {served.everyday_why_not}")
    t0 = time.perf_counter()
    _check_pixels(data, filename, limits.max_pixels)
    budget = shared_budget(limits.decode_bytes, limits.queue_seconds)
    with budget.hold(decode_cost(data, limits.max_pixels), filename):
        if not isinstance(data, bytes):
            data.seek(0)
            data = data.read(limits.max_bytes + 1)
            if len(data) > limits.max_bytes:
                raise ImageLoadError(f"{filename}: upload too large (over {size_text(limits.max_bytes)}): {BYTES_HINT}")
        return _caption_image(served, data, filename, beam, n_best, everyday, limits, t0)


def _check_pixels(data: bytes | BinaryIO, filename: str, max_pixels: int) -> None:
    """``ImageLoadError`` saying what to do for an image whose header says it has more than ``max_pixels``
    pixels (an unreadable header is left to the decoder, which names the problem)."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        with Image.open(stream) as im:
            width, height = im.size
    except Exception:  # noqa: BLE001 - not an image: decode_image says so
        return
    finally:
        stream.seek(0)
    if width * height > max_pixels:
        raise ImageLoadError(f"{filename}: image too large ({width}x{height} pixels, limit {pixels_text(max_pixels)}): "
                             + PIXELS_HINT.format(most=DEFAULT_MAX_PIXELS / 1e6))


def _caption_image(served: ServedModel, data: bytes, filename: str, beam: int, n_best: int, everyday: bool,
                   limits: ServeLimits, t0: float) -> dict:
    image = decode_image(data, filename, limits.max_pixels)  # checked here; drawn by the explorer
    with tempfile.TemporaryDirectory(prefix="captioner-serve-") as folder:
        upload = Path(folder) / "upload"  # captioned from a file, as `captioner caption FILE` does: the same
        atomic_write(upload, lambda f: f.write(data), DataError, sync=False)  # the same decoding, the same score
        with served.lock:
            captions = served.worker.submit(served.captioner.caption_nbest, upload, n_best=n_best,
                                            options=EVERYDAY if everyday else None, beam=beam,
                                            max_len=limits.max_len, all_heads=True,
                                            labels=served.labels).result()
    out = []
    for rank, c in enumerate(captions, start=1):
        title = f"{served.name}: caption {rank} of {len(captions)}"
        own = c.log_prob if c.log_prob is not None else c.score
        out.append({"text": c.text, "score": round(c.score, 4), "log_prob": round(own, 4),
                    "verdict": verdict(own, len(c.words)), "words": c.words, "finished": c.finished,
                    "concepts": None if c.concepts is None else [{"word": w, "prob": p} for w, p in c.concepts],
                    "labels": None if c.labels is None else [{"word": w, "prob": p} for w, p, _ in c.labels],
                    "record": caption_to_dict(c, decimals=5),
                    "explorer": render_explorer(image, c, title=title, max_side=limits.display_side)})
    return {"model": served.name, "file": filename, "beam": beam, "everyday": everyday, "image_size": list(image.size),
            "seconds": round(time.perf_counter() - t0, 3), "captions": out}


_error = error_response  # the one error shape, {"error": "<one line>"}


def create_app(models: Sequence[ServedModel], examples: Sequence[Example] = (),
               limits: ServeLimits = ServeLimits()) -> FastAPI:
    """The app serving ``models`` (loaded already; the first is the default) and ``examples``."""
    if not models:
        raise ConfigError("serve needs at least one model")
    by_name = {m.name: m for m in models}
    if len(by_name) != len(models):
        raise ConfigError(f"two models have the same name: {[m.name for m in models]}")
    app = FastAPI(title="captioner", docs_url=None, redoc_url=None, openapi_url=None)  # the docs pages use CDNs
    page = render_page([m.info() for m in models], [e.info() for e in examples], limits.max_beam, limits.max_bytes,
                       [{"name": name, "note": note} for _, name, note in VERDICTS], 2 * limits.display_side)
    install_guards(app, limits.max_bytes, FORM_OVERHEAD, limits.host, limits.body_seconds)
    app.state.limits = limits

    @app.middleware("http")
    async def guard(request: Request, call_next):  # noqa: ANN202
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    @app.exception_handler(RequestValidationError)
    async def bad_form(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'request'}: {e.get('msg', '')}"
                    for e in exc.errors()]
        return _error(422, "bad request: " + "; ".join(problems))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request %s failed", request.url.path)
        return _error(500, f"the server failed on this request ({type(exc).__name__}); it keeps serving")

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/api/models")
    def list_models() -> list[dict]:
        return [m.info() for m in models]

    @app.get("/cards/{index}", response_class=HTMLResponse)
    def card(index: int) -> Response:
        if not 0 <= index < len(models) or models[index].card is None:
            return _error(404, f"no model card for model {index}")
        return HTMLResponse(render_card_page(models[index].name, models[index].card))

    @app.get("/examples/{index}")
    def example(index: int) -> Response:
        if not 0 <= index < len(examples):
            return _error(404, f"no example {index}")
        return Response(examples[index].data, media_type=examples[index].media_type)

    @app.post("/api/caption")
    def caption(image: UploadFile = File(...), model: str = Form(""), beam: int = Form(3),
                n_best: int = Form(1), everyday: bool = Form(False)) -> JSONResponse:
        served = by_name.get(model or models[0].name)
        if served is None:
            return _error(404, f"no model named {model!r}; served: {', '.join(by_name)}")
        name = one_line(image.filename or "upload")[:200]
        upload = image.file  # spooled: in memory up to 1 MiB, on disk past it, read under the decode budget
        size = upload.seek(0, 2)
        if size > limits.max_bytes:
            return _error(413, f"{name}: upload too large (over {size_text(limits.max_bytes)}): {BYTES_HINT}")
        try:
            return JSONResponse(caption_upload(served, upload, name, beam, n_best, limits, everyday=everyday))
        except Refused as exc:
            return _error(exc.status, str(exc), {"Retry-After": "5"} if exc.status == 503 else None)
        except CaptionerError as exc:
            return _error(400, str(exc))
        except MemoryError:
            return _error(413, f"{name}: not enough memory to caption this image")

    return app


@contextlib.contextmanager
def running(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a background thread (tests, benchmarks); yields its base URL."""
    import uvicorn

    limits = getattr(app.state, "limits", ServeLimits())
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           **limits.uvicorn_options()))
    thread = threading.Thread(target=server.run, name="captioner-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ConfigError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout)


__all__ = ["Example", "default_examples", "example_scenes", "folder_examples", "reads_scenes"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
MAX_EXAMPLES = 12
MAX_EXAMPLE_BYTES = 16 * MiB  # a larger example file is re-encoded (a JPEG of at most 2048 px)
SCENE_SHARE = 0.9  # a vocabulary this much made of the scenes' words is a scenes model's
MEDIA_TYPES = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "BMP": "image/bmp"}


@dataclass(frozen=True)
class Example:
    """One example picture: its name on the page, its file name, and its bytes with their media type."""

    name: str
    data: bytes
    media_type: str
    filename: str = ""

    def info(self) -> dict:
        """What the page is told: the name shown and the file name an upload of it carries."""
        ext = {"image/png": ".png", "image/webp": ".webp", "image/bmp": ".bmp"}.get(self.media_type, ".jpg")
        return {"name": self.name, "file": self.filename or self.name.replace(" ", "_") + ext}


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def example_scenes(count: int = 3, size: int = 256, seed: int = 7) -> list[Example]:
    """``count`` synthetic scenes (1-3 coloured shapes), the same on every start."""
    out = []
    for i in range(count):
        rng = np.random.default_rng(seed + i)
        image = render_scene(rng, sample_scene(rng, size), size)
        out.append(Example(f"scene {i + 1}", _png(image), "image/png", f"scene_{i + 1}.png"))
    return out


@functools.lru_cache(maxsize=1)
def scene_words() -> frozenset[str]:
    """Every word the synthetic scenes' captions use (their colours, shapes, sizes and templates)."""
    rng = np.random.default_rng(0)
    words = set(COLORS) | set(SHAPES) | set(SIZES)
    for _ in range(60):
        for caption in scene_captions(sample_scene(rng, 128)):
            words.update(tokenize(caption))
    return frozenset(words)


def reads_scenes(words: Iterable[str]) -> bool:
    """Whether a model with vocabulary ``words`` (special tokens left out) was trained on synthetic scenes:
    at least :data:`SCENE_SHARE` of its words are the scenes' words."""
    words = [w for w in words if not (w.startswith("<") and w.endswith(">"))]
    return bool(words) and sum(w in scene_words() for w in words) >= SCENE_SHARE * len(words)


def _example_file(path: Path) -> Example:
    """``path`` as an example: its own bytes when small enough, else a JPEG of it at most 2048 px."""
    image = load_image(path)  # ImageLoadError names the file
    if path.stat().st_size <= MAX_EXAMPLE_BYTES:
        data = read_bytes(path, MAX_EXAMPLE_BYTES, ImageLoadError)
        with Image.open(io.BytesIO(data)) as opened:
            kind = MEDIA_TYPES.get(opened.format or "")
        if kind is not None:
            return Example(path.stem, data, kind, path.name)
    image.thumbnail((2048, 2048))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=92)
    return Example(path.stem, buf.getvalue(), "image/jpeg", path.stem + ".jpg")


def folder_examples(folder: str | os.PathLike) -> list[Example]:
    """The image files of ``folder`` (sorted, at most :data:`MAX_EXAMPLES`); ``DataError`` for a bad folder or file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: --examples must be a folder of images")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:MAX_EXAMPLES]
    out = [_example_file(path) for path in files]
    if not out:
        raise ImageLoadError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in the --examples folder")
    return out


def default_examples(vocabularies: Iterable[Iterable[str]], photos: str | os.PathLike) -> list[Example]:
    """The examples for models with these vocabularies: the photos in ``photos`` when any model reads
    photos, the synthetic scenes when any was trained on them (both, for a mix)."""
    scenes = [reads_scenes(words) for words in vocabularies]
    out = folder_examples(photos) if not all(scenes) else []
    return out + (example_scenes() if any(scenes) else [])
