"""The one check of the images handed to the Python API (``captioner.load(...).caption(images)``).

An input is a path, a PIL image, an already-transformed ``(3, S, S)`` tensor or a ``(B, 3, S, S)``
batch of them. :func:`image_sources` turns whatever was given into one checked source per image,
or raises :class:`~captioner.errors.ImageInputError` (a ``DataError`` and a ``ValueError``) with
one line naming the input (``image 2``) and the problem:

* type: anything but a path, a PIL image or a tensor;
* dtype: a tensor that is not floating point (``uint8``, ``int64``, ``bool``: not yet normalised;
  give a PIL image or a path instead); ``float16``, ``bfloat16`` and ``float64`` are converted
  to ``float32``;
* shape: a tensor that is not ``(3, S, S)`` (or a batch of them) for the model's ``S``;
* finiteness: a tensor holding NaN or infinity;
* size: a PIL image with no pixels, or more than ``max_pixels`` (what ``load_image`` refuses).

Paths are checked when they are read (:func:`captioner.data.images.load_image`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import torch
from PIL import Image

from captioner.data.images import DEFAULT_MAX_PIXELS, to_rgb
from captioner.errors import DataError, ImageInputError

__all__ = ["ImageSource", "image_sources", "pil_image", "tensor_image", "token_ids"]

ImageSource = Union[Path, Image.Image, torch.Tensor]
"""One checked image: a path (read later), an RGB PIL image or a float32 (3, S, S) tensor."""

HINT = "give a path, a PIL image or a (3, S, S) tensor"


def image_sources(images: Any, side: int, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> list[ImageSource]:
    """One checked source per image of ``images`` (one input, or a list or tuple of them).

    Args:
        images: a path, PIL image, (3, S, S) tensor or (B, 3, S, S) batch, or a list/tuple of these.
        side: the model's input side S.
        max_pixels: largest PIL image accepted (None: no bound).

    Raises:
        ImageInputError: the first input that cannot be captioned, named by its position.
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
        raise ImageInputError(f"{name}: image too large ({width}x{height} pixels, limit {max_pixels} pixels)")
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
