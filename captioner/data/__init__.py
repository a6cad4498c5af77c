"""Data layer: image loading, encoder transforms, caption datasets, synthetic scenes.

The names below are importable from ``captioner.data`` directly; each submodule is imported on
first use, so ``import captioner.data`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_image": "images",
    "ImageTransform": "images",
    "crop_box": "images",
    "denormalize": "images",
    "ImageRecord": "caption_set",
    "CaptionSet": "caption_set",
    "ObjectBox": "caption_set",
    "InstanceBoxes": "caption_set",
    "load_caption_set": "coco",
    "check_images": "caption_set",
    "load_instances": "coco",
    "image_loader": "dataset",
    "CaptionTrainDataset": "dataset",
    "CaptionEvalDataset": "dataset",
    "collate_captions": "dataset",
    "collate_images": "dataset",
    "make_shapes": "shapes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"captioner.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'captioner.data' has no attribute {name!r}")
