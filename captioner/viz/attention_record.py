"""The attention record behind every overlay, and its JSON file (``attention.json``).

Shape legend: L words, g grid size.

``{"format": "captioner-attention", "version": 1, "caption", "words", "grid": [g, g],
"attention": L x g x g, "image_size": [w, h], "box": [left, top, right, bottom]}`` plus, for
decoders with several layers/heads (the Transformer), ``"layers"``, ``"heads"`` and
``"all_attention"`` (L x layers x heads x g x g). Floats are rounded to 6 decimals.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from captioner.errors import DataError, one_line
from captioner.files import MiB, read_text
from captioner.grids import as_array


@dataclass
class AttentionRecord:
    """Everything the overlays are drawn from; the JSON file holds exactly this.

    Attributes:
        caption: the caption text.
        words: the L words, one per attention map.
        attention: (L, g, g) weights (the overlay view).
        image_size: (width, height) of the original image.
        box: (left, top, right, bottom) of the part the encoder saw, original pixels.
        all_attention: (L, layers, heads, g, g) per-layer, per-head maps (Transformer) or None.
    """

    caption: str
    words: list[str]
    attention: np.ndarray
    image_size: tuple[int, int]
    box: tuple[float, float, float, float]
    all_attention: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.attention = as_array(self.attention)
        shape = self.attention.shape
        if len(shape) != 3 or shape[0] != len(self.words) or shape[1] != shape[2]:
            raise DataError(f"attention must be (L, g, g) with L={len(self.words)} words, got shape {shape}")
        if self.all_attention is not None:
            self.all_attention = as_array(self.all_attention)
            if self.all_attention.ndim != 5 or self.all_attention.shape[0] != len(self.words) or \
                    self.all_attention.shape[3:] != self.attention.shape[1:]:
                raise DataError(f"all_attention must be (L, layers, heads, g, g) with L={len(self.words)} and "
                                f"g={self.grid}, got {self.all_attention.shape}")
        self.image_size = (int(self.image_size[0]), int(self.image_size[1]))
        self.box = tuple(float(v) for v in self.box)  # type: ignore[assignment]

    @property
    def grid(self) -> int:
        return int(self.attention.shape[-1])

    def to_dict(self, decimals: int = 6) -> dict:
        data = {
            "format": "captioner-attention", "version": 1, "caption": self.caption, "words": list(self.words),
            "grid": [self.grid, self.grid], "image_size": list(self.image_size), "box": list(self.box),
            "attention": np.round(self.attention.astype(np.float64), decimals).tolist(),
        }
        if self.all_attention is not None:
            data["layers"], data["heads"] = int(self.all_attention.shape[1]), int(self.all_attention.shape[2])
            data["all_attention"] = np.round(self.all_attention.astype(np.float64), decimals).tolist()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "AttentionRecord":
        if not isinstance(data, dict) or data.get("format") != "captioner-attention":
            raise DataError("not a captioner attention file (format != 'captioner-attention')")
        try:
            words = [str(w) for w in data["words"]]
            attention = np.asarray(data["attention"], dtype=np.float32).reshape(len(words), *data["grid"])
            all_att = data.get("all_attention")
            return cls(str(data["caption"]), words, attention, tuple(data["image_size"]), tuple(data["box"]),
                       None if all_att is None else np.asarray(all_att, dtype=np.float32))
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"malformed attention record ({type(exc).__name__}: {exc})") from None


def write_attention_json(path: str | Path, record: AttentionRecord) -> Path:
    """Write ``record`` as JSON (floats rounded to 6 decimals)."""
    path = Path(path)
    path.write_text(json.dumps(record.to_dict(), separators=(",", ":")) + "\n")
    return path


def read_attention_json(path: str | Path) -> AttentionRecord:
    """Read a file written by :func:`write_attention_json` / :func:`write_overlays`."""
    if not os.path.lexists(path):
        raise DataError(f"{path}: attention file not found")
    try:
        data = json.loads(read_text(path, 256 * MiB, DataError, "attention file"))
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{path}: cannot read attention JSON ({one_line(str(exc))[:200]})") from None
    try:
        return AttentionRecord.from_dict(data)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
