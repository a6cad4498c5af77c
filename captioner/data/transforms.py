"""Encoder input transform (PIL RGB -> normalised tensor) and the geometry it implies.

``crop_box`` is the single source of truth for which part of the ORIGINAL image the encoder
sees; ``ImageTransform`` uses it, and overlay code uses it to map attention back onto the photo.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from captioner.config import PREPROCESSING_FIELDS, EncoderConfig
from captioner.errors import ConfigError

_RESAMPLE = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


def crop_box(width: int, height: int, cfg: EncoderConfig) -> tuple[int, int, int, int]:
    """The ``(left, top, right, bottom)`` box of a ``width`` x ``height`` image the encoder covers.

    ``"stretch"`` covers the whole image; ``"center_crop"`` covers the centred square whose side is
    the shorter image side (the image is scaled so that side becomes ``image_size``, then cropped).

    Args:
        width: original image width in pixels.
        height: original image height in pixels.
        cfg: encoder config (``resize`` is read).

    Returns:
        Integer pixel box in original-image coordinates, right/bottom exclusive.
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
    """PIL RGB image -> float tensor (3, S, S), resized per the config and normalised.

    Args:
        cfg: encoder config; ``image_size``, ``resize``, ``interpolation``, ``mean`` and ``std``
            are read.
    """

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
