"""A :class:`~captioner.inference.Caption` as the JSON file every overlay is drawn from (``attention.json``).

Shape legend: L words, g grid size.

``{"format": "captioner-attention", "version": 1, "caption", "words", "grid": [g, g],
"attention": L x g x g, "image_size": [w, h], "box": [left, top, right, bottom]}`` plus, when
present, ``"layers"``, ``"heads"``, ``"all_attention"`` (L x layers x heads x g x g), ``"concepts"``
and ``"concept_maps"``, ``"labels"`` and ``"label_maps"``. Floats are rounded to 6 decimals;
missing optional keys read back as None, and a caption read back has no tokens and a NaN score.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from captioner.data.images import as_array
from captioner.errors import DataError, one_line
from captioner.files import MiB, Outputs, read_json, write_output
from captioner.inference import Caption

__all__ = ["caption_from_dict", "caption_to_dict", "on_image", "read_attention_json", "write_attention_json"]


def _tensor(x: object) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(as_array(x)))


def on_image(caption: Caption, image: Image.Image | None = None) -> Caption:
    """``caption`` checked and ready to draw: float32 CPU maps, an image size and a crop box (``image``'s if missing).

    Raises ``DataError``: no attention maps, maps that do not match the words, or no image size at all.
    """
    if caption.attention is None:
        raise DataError("the caption has no attention maps (caption with attention=True)")
    attention = _tensor(caption.attention)
    words = len(caption.words)
    if attention.ndim != 3 or attention.shape[0] != words or attention.shape[1] != attention.shape[2]:
        raise DataError(f"attention must be (L, g, g) with L={words} words, got shape {tuple(attention.shape)}")
    all_attention = None
    if caption.all_attention is not None:
        all_attention = _tensor(caption.all_attention)
        if all_attention.ndim != 5 or all_attention.shape[0] != words or \
                all_attention.shape[3:] != attention.shape[1:]:
            raise DataError(f"all_attention must be (L, layers, heads, g, g) with L={words} and "
                            f"g={attention.shape[-1]}, got {tuple(all_attention.shape)}")
    concepts, concept_maps = _checked_concepts(caption, attention.shape[1:])
    labels = _checked_labels(caption.labels, attention.shape[1:])
    size = caption.image_size if caption.image_size is not None else (image.size if image is not None else None)
    if size is None:
        raise DataError("the caption has no image size (it came from a tensor); pass the image")
    size = (int(size[0]), int(size[1]))
    box = caption.box if caption.box is not None else (0, 0, size[0], size[1])
    return dataclasses.replace(caption, attention=attention, all_attention=all_attention, image_size=size,
                               box=tuple(float(v) for v in box), grid=tuple(attention.shape[1:]), concepts=concepts,
                               concept_maps=concept_maps, labels=labels)


def _checked_concepts(caption: Caption, grid: tuple[int, int]
                      ) -> tuple[list[tuple[str, float]] | None, torch.Tensor | None]:
    """The caption's concepts as ``[(word, probability)]`` and their maps as a float32 (C, g, g) tensor."""
    if caption.concepts is None:
        if caption.concept_maps is not None:
            raise DataError("the caption has concept maps but no concepts")
        return None, None
    concepts = [(str(w), float(p)) for w, p in caption.concepts]
    if caption.concept_maps is None:
        raise DataError("the caption has concepts but no concept maps")
    maps = _tensor(caption.concept_maps)
    if maps.ndim != 3 or maps.shape[0] != len(concepts) or tuple(maps.shape[1:]) != tuple(grid):
        raise DataError(f"concept_maps must be (C, g, g) with C={len(concepts)} concepts and g={grid[-1]}, "
                        f"got shape {tuple(maps.shape)}")
    return concepts, maps


def _checked_labels(labels: object, grid: tuple[int, int]) -> list[tuple[str, float, torch.Tensor]] | None:
    """The caption's labels as ``[(word, probability, (g, g) float32 map)]``, or None."""
    if labels is None:
        return None
    try:
        checked = [(str(w), float(p), _tensor(m)) for w, p, m in labels]
    except (TypeError, ValueError) as exc:
        raise DataError(f"labels must be (word, probability, map) triples ({one_line(str(exc))})") from None
    for word, _, grid_map in checked:
        if tuple(grid_map.shape) != tuple(grid):
            raise DataError(f"the map of label {word!r} must be (g, g) = {tuple(grid)}, got {tuple(grid_map.shape)}")
    return checked


def caption_to_dict(caption: Caption, decimals: int = 6) -> dict:
    """The JSON object of the file format above (``caption`` placed with :func:`on_image` first)."""
    caption = on_image(caption)
    data = {
        "format": "captioner-attention", "version": 1, "caption": caption.text, "words": list(caption.words),
        "grid": list(caption.grid), "image_size": list(caption.image_size), "box": list(caption.box),
        "attention": np.round(caption.attention.numpy().astype(np.float64), decimals).tolist(),
    }
    if caption.all_attention is not None:
        data["layers"], data["heads"] = int(caption.all_attention.shape[1]), int(caption.all_attention.shape[2])
        data["all_attention"] = np.round(caption.all_attention.numpy().astype(np.float64), decimals).tolist()
    if caption.concepts is not None:
        data["concepts"] = [{"word": w, "prob": round(p, decimals)} for w, p in caption.concepts]
        data["concept_maps"] = np.round(caption.concept_maps.numpy().astype(np.float64), decimals).tolist()
    if caption.labels is not None:
        data["labels"] = [{"word": w, "prob": round(p, decimals)} for w, p, _ in caption.labels]
        data["label_maps"] = [np.round(m.numpy().astype(np.float64), decimals).tolist() for _, _, m in caption.labels]
    return data


def caption_from_dict(data: dict) -> Caption:
    """The :class:`Caption` a JSON object of the format above holds (no token ids, a NaN score)."""
    if not isinstance(data, dict) or data.get("format") != "captioner-attention":
        raise DataError("not a captioner attention file (format != 'captioner-attention')")
    try:
        words = [str(w) for w in data["words"]]
        attention = np.asarray(data["attention"], dtype=np.float32).reshape(len(words), *data["grid"])
        all_att = data.get("all_attention")
        concepts = data.get("concepts")
        if concepts is not None:
            concepts = [(str(c["word"]), float(c["prob"])) for c in concepts]
            maps = _tensor(np.asarray(data["concept_maps"], dtype=np.float32).reshape(len(concepts), *data["grid"]))
        labels = data.get("labels")
        if labels is not None:
            label_maps = np.asarray(data["label_maps"], dtype=np.float32).reshape(len(labels), *data["grid"])
            labels = [(str(c["word"]), float(c["prob"]), _tensor(m)) for c, m in zip(labels, label_maps)]
        caption = Caption(str(data["caption"]), words, [], float("nan"), tuple(int(g) for g in data["grid"]),
                          attention=_tensor(attention),
                          all_attention=None if all_att is None else _tensor(np.asarray(all_att, dtype=np.float32)),
                          image_size=tuple(data["image_size"]), box=tuple(data["box"]), concepts=concepts,
                          concept_maps=None if concepts is None else maps, labels=labels)
        return on_image(caption)
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"malformed attention record ({type(exc).__name__}: {exc})") from None


def write_attention_json(path: str | Path, caption: Caption, outputs: Outputs | None = None) -> Path:
    """Write ``caption`` as JSON (floats rounded to 6 decimals), atomically (recorded in ``outputs`` when given)."""
    data = (json.dumps(caption_to_dict(caption), separators=(",", ":")) + "\n").encode("utf-8")
    return write_output(path, lambda f: f.write(data), outputs, DataError)


def read_attention_json(path: str | Path) -> Caption:
    """Read a file written by :func:`write_attention_json` / :func:`write_overlays`."""
    data = read_json(path, 256 * MiB, DataError, "attention file")
    try:
        return caption_from_dict(data)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
