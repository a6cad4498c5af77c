"""Images: robust loading, the checked inputs of the Python API, the encoder's transform and the region grid.

``load_image`` handles the modes real datasets contain (greyscale, 16-bit, float, alpha, palette
transparency, CMYK, EXIF rotation, animated GIFs) and turns every failure into a one-line
``ImageLoadError("<path>: <reason>")``; PIL exceptions and warnings never escape.
:func:`image_sources` checks what ``Captioner.caption`` is given (type, dtype, shape, NaN/inf,
size) and raises :class:`~captioner.errors.ImageInputError` naming the input (``image 2``).

:class:`ImageTransform` and :func:`crop_box` (the one account of which part of the photo the
encoder sees), and the grid on that part (:func:`cell_weights`, :func:`cell_centre`, :class:`Box`,
:func:`interval_overlap`) that heat maps, attention metrics and box targets share, so a word's
attention, its overlay and the box it is scored against agree cell for cell.
"""

from __future__ import annotations

import io
import logging
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from captioner.config import PREPROCESSING_FIELDS, EncoderConfig
from captioner.errors import ConfigError, DataError, ImageInputError, ImageLoadError
from captioner.files import MiB, check_regular, read_bytes


log = logging.getLogger(__name__)


DEFAULT_MAX_PIXELS = 64_000_000  # refuse larger images before decoding (decompression bombs)
# refuse larger files before reading them: 64 megapixels of uncompressed 16-bit RGBA fit in 512 MiB
DEFAULT_MAX_BYTES = 512 * MiB
BACKGROUND = (255, 255, 255)  # transparent pixels are composited onto white

# File signatures: a file that starts like an image but cannot be parsed is corrupt, not "not an image".
_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "PNG",
    b"\xff\xd8\xff": "JPEG",
    b"GIF87a": "GIF",
    b"GIF89a": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
}
_BOMB = re.compile(r"\((\d+) pixels\)")


def pixels_text(count: int) -> str:
    """A pixel count as people say it: ``"40 megapixels"`` from a million up, else ``"199 pixels"``."""
    return f"{count / 1e6:.3g} megapixels" if count >= 1_000_000 else f"{count} pixels"


def load_image(path: str | os.PathLike, max_pixels: int | None = DEFAULT_MAX_PIXELS,
               max_bytes: int = DEFAULT_MAX_BYTES, reduce_to: int | None = None) -> Image.Image:
    """Read an image file as RGB, EXIF orientation applied, alpha composited on white.

    ``max_pixels`` and ``max_bytes`` are checked from the header and the size before decoding;
    ``reduce_to``: decode a JPEG at the smallest 1/2, 1/4 or 1/8 scale keeping sides at least this
    long (None: every pixel). Every failure is an ``ImageLoadError`` naming the file; a pipe or device
    is refused without blocking.
    """
    return _load(Path(path), max_pixels, max_bytes, reduce_to)[0]


def load_for_encoder(path: str | os.PathLike, side: int,
                     max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[Image.Image, tuple[int, int]]:
    """:func:`load_image` with ``reduce_to=side``, and the ``(width, height)`` of the full-size image
    (EXIF orientation applied): what crop boxes and overlays are measured in."""
    return _load(Path(path), max_pixels, DEFAULT_MAX_BYTES, side)


def _load(path: Path, max_pixels: int | None, max_bytes: int,
          reduce_to: int | None) -> tuple[Image.Image, tuple[int, int]]:
    """Read and decode ``path`` (PIL's warnings logged at debug level): the image and its full size."""
    data = _read_bytes(path, max_bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _decode(path, data, max_pixels, reduce_to)
        finally:
            for w in caught:
                log.debug("%s: %s", path, w.message)


def decode_image(data: bytes, name: str = "upload", max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode image bytes already in memory (an upload, named ``name`` in errors) with :func:`load_image`'s checks."""
    if not data:
        raise ImageLoadError(f"{name}: file is empty")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _decode(Path(name), data, max_pixels)[0]


def probe_image(path: str | os.PathLike, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """``(width, height)`` from the header without decoding: catches :func:`load_image`'s problems visible there."""
    path = Path(path)
    check_regular(path, DEFAULT_MAX_BYTES, ImageLoadError, "image file")  # open() would block on a pipe
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if not head:
                raise ImageLoadError(f"{path}: file is empty")
            f.seek(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Image.open(f) as im:
                    width, height = im.size
    except ImageLoadError:
        raise
    except Exception as exc:  # OSError (read errors, broken headers), SyntaxError, ValueError, ...
        raise _load_error(path, exc, head, max_pixels) from None
    if max_pixels is not None and width * height > max_pixels:
        raise ImageLoadError(f"{path}: image too large ({width}x{height} pixels, limit {pixels_text(max_pixels)})")
    return width, height


def _read_bytes(path: Path, max_bytes: int) -> bytes:
    data = read_bytes(path, max_bytes, ImageLoadError, "image file")  # regular files only, bounded
    if not data:
        raise ImageLoadError(f"{path}: file is empty")
    return data


# EXIF orientations that swap width and height (transpose, rotate 90/270, transverse)
_SWAPS_AXES = {5, 6, 7, 8}


def _decode(path: Path, data: bytes, max_pixels: int | None,
            reduce_to: int | None = None) -> tuple[Image.Image, tuple[int, int]]:
    """Header check, decode (so truncation shows up here), EXIF transpose, RGB conversion; with
    ``reduce_to`` a JPEG decodes at a reduced scale. Returns the image and the full size (w, h)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageLoadError(
                    f"{path}: image too large ({width}x{height} pixels, limit {pixels_text(max_pixels)})"
                )
            if im.format == "PNG":
                im.verify()  # checks every chunk's CRC, which load() does not
        with Image.open(io.BytesIO(data)) as im:
            full = im.size
            if reduce_to is not None and im.format == "JPEG":
                im.draft(im.mode, (reduce_to, reduce_to))  # each side stays >= reduce_to
            drafted = im.size != full
            if drafted and im.getexif().get(0x0112) in _SWAPS_AXES:
                full = (full[1], full[0])
            im.load()  # force decoding inside the try: truncated data raises here
            image = ImageOps.exif_transpose(im)  # a new, loaded image
        return to_rgb(image), (full if drafted else image.size)
    except ImageLoadError:
        raise
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, EOFError, struct.error ...
        raise _load_error(path, exc, data, max_pixels) from None


def _load_error(path: Path, exc: Exception, head: bytes, max_pixels: int | None) -> ImageLoadError:
    """What opening or decoding the image at ``path`` (whose first bytes are ``head``) raised, as the
    one-line ``ImageLoadError`` a user reads."""
    if isinstance(exc, FileNotFoundError):
        return ImageLoadError(f"{path}: file not found")
    if isinstance(exc, IsADirectoryError):
        return ImageLoadError(f"{path}: is a directory, not an image file")
    if isinstance(exc, PermissionError):
        return ImageLoadError(f"{path}: permission denied")
    if isinstance(exc, Image.DecompressionBombError):
        found = _BOMB.search(str(exc))
        size = pixels_text(int(found.group(1))) if found else "over PIL's MAX_IMAGE_PIXELS"
        limit = pixels_text(max_pixels) if max_pixels is not None else "PIL's MAX_IMAGE_PIXELS"
        return ImageLoadError(f"{path}: image too large ({size}, limit {limit})")
    if isinstance(exc, UnidentifiedImageError):
        kind = _signature(head)
        if kind:
            return ImageLoadError(f"{path}: truncated or corrupt image (unreadable {kind} header)")
        return ImageLoadError(f"{path}: not an image file")
    if isinstance(exc, _UnsupportedMode):
        return ImageLoadError(f"{path}: unsupported image mode {exc}")
    if isinstance(exc, MemoryError):
        return ImageLoadError(f"{path}: not enough memory to decode the image")
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    return ImageLoadError(f"{path}: truncated or corrupt image ({reason})")


def _signature(data: bytes) -> str | None:
    for magic, kind in _SIGNATURES.items():
        if data.startswith(magic):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


_BAND = 256  # rows of a wide greyscale image converted to 8 bits at a time


class _UnsupportedMode(Exception):
    """Internal: a decoded image mode that has no sensible RGB conversion."""


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert a loaded image of any PIL mode to RGB (16-bit and float scaled to 0..255, alpha onto white)."""
    mode = image.mode
    if mode == "RGB" and "transparency" not in image.info:
        return image
    if mode.startswith("I") or mode == "F":
        return Image.fromarray(_wide_to_uint8(image)).convert("RGB")
    if mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    try:
        return image.convert("RGB")
    except (ValueError, OSError):
        raise _UnsupportedMode(mode) from None


def _wide_to_uint8(image: Image.Image) -> np.ndarray:
    """(H, W) uint8 from a 16-bit, 32-bit integer or float greyscale image, converted in bands of rows
    so that the float temporaries stay small whatever the image's size."""
    mode = image.mode
    if not (mode.startswith("I;16") or mode in ("I", "F")):
        raise _UnsupportedMode(mode)
    values = np.asarray(image)  # (H, W) uint16, int32 or float32
    bands = [slice(top, top + _BAND) for top in range(0, values.shape[0], _BAND)]

    def wide(band: slice) -> np.ndarray:
        out = values[band].astype(np.float64)
        return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0) if mode == "F" else out

    lo, hi = 0.0, 0.0
    if values.size and not mode.startswith("I;16"):
        lo = min(float(wide(b).min()) for b in bands)
        hi = max(float(wide(b).max()) for b in bands)
    if mode.startswith("I;16") or (mode == "I" and lo >= 0 and hi <= 65535):
        scale = lambda v: v / 257.0  # noqa: E731
    elif mode == "F" and lo >= 0.0 and hi <= 1.0:
        scale = lambda v: v * 255.0  # noqa: E731
    elif mode == "F" and lo >= 0.0 and hi <= 255.0:
        scale = lambda v: v  # noqa: E731
    elif hi <= lo:
        return np.zeros(values.shape, np.uint8)
    else:
        scale = lambda v: (v - lo) * (255.0 / (hi - lo))  # noqa: E731
    out = np.empty(values.shape, np.uint8)
    for band in bands:
        out[band] = _round_u8(scale(wide(band)))
    return out


def _round_u8(values: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


ImageSource = Union[Path, Image.Image, torch.Tensor]
"""One checked image: a path (read later), an RGB PIL image or a float32 (3, S, S) tensor."""

HINT = "give a path, a PIL image or a (3, S, S) tensor"


def image_sources(images: Any, side: int, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> list[ImageSource]:
    """One checked source per image of ``images`` for a model of input side ``side``.

    Raises ``ImageInputError`` for the first input that cannot be captioned, named by its position.
    """
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    out: list[ImageSource] = []
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() == 4:
            out += [tensor_image(t, side, f"image {len(out) + 1 + i}") for i, t in enumerate(item.unbind(0))]
        else:
            out.append(_source(item, side, max_pixels, f"image {len(out) + 1}"))
    return out


def _source(item: Any, side: int, max_pixels: int | None, name: str) -> ImageSource:
    if isinstance(item, (str, os.PathLike)):
        return Path(item)
    if isinstance(item, bytes):
        return Path(os.fsdecode(item))
    if isinstance(item, Image.Image):
        return pil_image(item, name, max_pixels)
    if isinstance(item, torch.Tensor):
        return tensor_image(item, side, name)
    raise ImageInputError(f"{name}: cannot caption a {type(item).__name__}; {HINT}")


def pil_image(image: Image.Image, name: str = "image", max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """A PIL image as RGB, checked to have at least one and at most ``max_pixels`` pixels."""
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageInputError(f"{name}: empty image ({width}x{height} pixels)")
    if max_pixels is not None and width * height > max_pixels:
        raise ImageInputError(f"{name}: image too large ({width}x{height} pixels, limit {pixels_text(max_pixels)})")
    try:
        return to_rgb(image)
    except Exception as exc:  # noqa: BLE001 - an unsupported mode, an image whose data cannot be loaded
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ImageInputError(f"{name}: cannot convert the {image.mode} image to RGB ({reason[:120]})") from None


def tensor_image(x: torch.Tensor, side: int, name: str = "image") -> torch.Tensor:
    """An already-transformed image tensor, checked: floating dtype (made float32), (3, S, S), finite."""
    if x.is_complex() or not x.is_floating_point():
        dtype = str(x.dtype).replace("torch.", "")
        article = "an" if dtype[0] in "aeiou" else "a"
        raise ImageInputError(f"{name}: {article} {dtype} tensor is not an already-transformed image (normalised "
                              "floats); give the PIL image or its path, or transform it first")
    if tuple(x.shape) != (3, side, side):
        raise ImageInputError(f"{name}: an image tensor must be already transformed to (3, {side}, {side}) "
                              f"(or a batch of them), got {tuple(x.shape)}")
    x = x.detach()
    if x.dtype != torch.float32:
        x = x.float()
    if not bool(torch.isfinite(x).all()):
        bad = "NaN" if bool(torch.isnan(x).any()) else "infinite"
        raise ImageInputError(f"{name}: the image tensor holds {bad} values")
    return x


def token_ids(tokens: Sequence[Any], vocab_size: int) -> list[int]:
    """A caption's word ids, checked to be integers in ``[0, vocab_size)`` (DataError otherwise)."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, torch.Tensor)):
        raise DataError(f"tokens must be a sequence of word ids, got {type(tokens).__name__}")
    ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise DataError(f"tokens must be word ids in [0, {vocab_size}), got {i!r}")
    return ids


_RESAMPLE = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


def crop_box(width: int, height: int, cfg: EncoderConfig) -> tuple[int, int, int, int]:
    """The ``(left, top, right, bottom)`` box (right/bottom exclusive) of a ``width`` x ``height`` image the encoder covers.

    ``"stretch"`` covers it all; ``"center_crop"`` the centred square of the shorter side.
    """
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if cfg.resize == "stretch":
        return (0, 0, width, height)
    side = min(width, height)
    left = (width - side) // 2
    top = (height - side) // 2
    return (left, top, left + side, top + side)


class ImageTransform:
    """PIL RGB image -> float tensor (3, S, S), resized and normalised as ``cfg`` says."""

    def __init__(self, cfg: EncoderConfig) -> None:
        if not cfg.resolved:
            unset = ", ".join(f"encoder.{f}" for f in PREPROCESSING_FIELDS if getattr(cfg, f) is None)
            raise ConfigError(f"{unset} not set: the {cfg.name} encoder's entry gives them when the model is built "
                              "(captioner.models.model.resolve_model)")
        self.cfg = cfg
        self.size = cfg.image_size
        self.resample = _RESAMPLE[cfg.interpolation]
        self.mean = torch.tensor(cfg.mean, dtype=torch.float32).view(3, 1, 1)  # (3, 1, 1)
        self.std = torch.tensor(cfg.std, dtype=torch.float32).view(3, 1, 1)  # (3, 1, 1)

    def resize(self, image: Image.Image) -> Image.Image:
        """Crop to :func:`crop_box` (no pixel outside it leaks in), then antialiased resize to S x S."""
        if image.mode != "RGB":
            image = image.convert("RGB")
        box = crop_box(image.width, image.height, self.cfg)
        if box != (0, 0, image.width, image.height):
            image = image.crop(box)
        return image.resize((self.size, self.size), self.resample)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.normalize(self.pixels(image))  # (3, S, S)

    def pixels(self, image: Image.Image) -> torch.Tensor:
        """The resized image as uint8 (3, S, S), before normalisation (4x smaller to keep in memory)."""
        pixels = np.asarray(self.resize(image), dtype=np.uint8)  # (S, S, 3)
        return torch.from_numpy(pixels.copy()).permute(2, 0, 1)  # (3, S, S)

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 (..., 3, S, S) from :meth:`pixels` -> normalised float, bit-identical to ``__call__``."""
        x = pixels.float().div_(255.0)  # in [0, 1]
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        return (x - mean) / std

    def __repr__(self) -> str:
        return (f"ImageTransform(size={self.size}, resize={self.cfg.resize!r}, "
                f"interpolation={self.cfg.interpolation!r})")


def denormalize(x: torch.Tensor, cfg: EncoderConfig) -> torch.Tensor:
    """Undo the normalisation for display: (3, S, S) or (B, 3, S, S) -> same shape in [0, 1]."""
    mean = torch.tensor(cfg.mean, dtype=x.dtype, device=x.device).view(3, 1, 1)  # (3, 1, 1)
    std = torch.tensor(cfg.std, dtype=x.dtype, device=x.device).view(3, 1, 1)  # (3, 1, 1)
    return (x * std + mean).clamp(0.0, 1.0)  # (..., 3, S, S)


class Box(NamedTuple):
    """A box in original image pixels as ``(left, top, right, bottom)``: the part of an image an
    encoder sees (``crop_box``), or an object box read from COCO's ``(x, y, w, h)`` by :meth:`from_xywh`."""

    left: float
    top: float
    right: float
    bottom: float

    @classmethod
    def from_xywh(cls, box: Sequence[float]) -> "Box":
        """The box of a COCO ``(x, y, w, h)``."""
        x, y, w, h = box
        return cls(x, y, x + w, y + h)


def interval_overlap(lo: Any, hi: Any, box_lo: float, box_hi: float) -> np.ndarray:
    """How much of each interval ``[lo, hi)`` lies inside ``[box_lo, box_hi)`` (0 where they do not meet)."""
    return np.clip(np.minimum(hi, box_hi) - np.maximum(lo, box_lo), 0.0, None)


def as_array(x: object, dtype: type = np.float32) -> np.ndarray:
    """numpy copy or view of an array or (CPU/GPU, grad or not) tensor, without importing torch."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()  # type: ignore[union-attr]
    return np.asarray(x, dtype=dtype)


def attention_entropy(weights: Any, eps: float = 1e-12) -> Any:
    """Entropy (nats) ``-sum_n w_n log(w_n + eps)`` over the last axis, (..., N) -> (...), torch or numpy."""
    if isinstance(weights, np.ndarray):
        return -(weights * np.log(weights + eps)).sum(-1)
    return -(weights * (weights + eps).log()).sum(-1)  # type: ignore[operator]


def cell_weights(n: int, start: float, stop: float, g: int, scale: float = 1.0) -> np.ndarray:
    """(n, g) 0/1 matrix taking each of ``n`` pixels to the cell it falls in of g cells over ``[start, stop)``.

    Pixel i's centre is ``(i + 0.5) / scale`` in original pixels; pixels outside get an all-zero row.
    """
    centres = (np.arange(n) + 0.5) / scale  # pixel centres in original coordinates
    pos = (centres - start) / max(stop - start, 1e-9) * g  # position in grid units, 0..g
    inside = (pos >= 0) & (pos < g)
    cells = np.clip(np.floor(pos).astype(int), 0, g - 1)
    weights = np.zeros((n, g))
    weights[np.arange(n)[inside], cells[inside]] = 1.0
    return weights


def cell_centre(flat_index: int, g: int, view: Sequence[float]) -> tuple[float, float]:
    """Centre (x, y) of grid cell ``flat_index`` (row-major) of a g x g grid over ``view`` (the crop box)."""
    r, c = divmod(int(flat_index), g)
    left, top, right, bottom = view
    return left + (c + 0.5) * (right - left) / g, top + (r + 0.5) * (bottom - top) / g
