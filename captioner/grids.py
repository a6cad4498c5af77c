"""Region grids in the base layer: arrays from tensors, where each grid cell lies on an image, and
the entropy of an attention map over the cells.

The heat maps (:mod:`captioner.viz.heatmaps`), the attention metrics
(:mod:`captioner.evaluation.attention_metrics`) and the box targets all place a g x g grid on the
part of an image the encoder saw; this module is that one placement, so that a word's attention,
its overlay and the box it is scored against agree cell for cell.

Shape legend: g grid side, n pixels along one axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Box", "as_array", "attention_entropy", "cell_centre", "cell_weights", "interval_overlap"]


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
    """How much of each interval ``[lo, hi)`` lies inside ``[box_lo, box_hi)`` (0 where they do not meet).

    The one overlap of boxes and grid cells (or pixels), one axis at a time: the box targets divide it
    by the cell's length, the attention-correctness canvas by the pixel's.
    """
    return np.clip(np.minimum(hi, box_hi) - np.maximum(lo, box_lo), 0.0, None)


def as_array(x: object, dtype: type = np.float32) -> np.ndarray:
    """numpy copy or view of an array or (CPU/GPU, grad or not) tensor, without importing torch."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()  # type: ignore[union-attr]
    return np.asarray(x, dtype=dtype)


def attention_entropy(weights: Any, eps: float = 1e-12) -> Any:
    """Entropy (nats) of attention distributions over the last axis: (..., N) -> (...).

    The one definition, ``-sum_n w_n log(w_n + eps)``, for a torch tensor (the decoders' outputs,
    training's validation) or a numpy array (the attention metrics), returned as the same kind.
    """
    if isinstance(weights, np.ndarray):
        return -(weights * np.log(weights + eps)).sum(-1)
    return -(weights * (weights + eps).log()).sum(-1)  # type: ignore[operator]


def cell_weights(n: int, start: float, stop: float, g: int, scale: float = 1.0) -> np.ndarray:
    """(n, g) 0/1 matrix taking each of ``n`` pixels to the grid cell it falls in (nearest).

    The grid's g cells split ``[start, stop)`` (original pixels) evenly; pixel i has its centre at
    ``(i + 0.5) / scale`` in original pixels (``scale`` < 1 for a downscaled canvas). Pixels
    outside the interval get an all-zero row.
    """
    centres = (np.arange(n) + 0.5) / scale  # pixel centres in original coordinates
    pos = (centres - start) / max(stop - start, 1e-9) * g  # position in grid units, 0..g
    inside = (pos >= 0) & (pos < g)
    cells = np.clip(np.floor(pos).astype(int), 0, g - 1)
    weights = np.zeros((n, g))
    weights[np.arange(n)[inside], cells[inside]] = 1.0
    return weights


def cell_centre(flat_index: int, g: int, view: Sequence[float]) -> tuple[float, float]:
    """Centre (x, y) of grid cell ``flat_index`` (row-major) of a g x g grid over ``view``.

    ``view`` is ``(left, top, right, bottom)`` in original pixels (the encoder's crop box).
    """
    r, c = divmod(int(flat_index), g)
    left, top, right, bottom = view
    return left + (c + 0.5) * (right - left) / g, top + (r + 0.5) * (bottom - top) / g
