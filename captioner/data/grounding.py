"""Targets for attention supervision: object boxes on the region grid, and which caption words name which box.

Shape legend: g grid size, N = g * g regions (row-major: region n is row n // g, column n % g).

The encoder's g x g grid covers the part of the original image it sees, ``view`` = ``crop_box``
(the whole image for ``stretch``, the centred square for ``center_crop``). Region (r, c) covers
``[left + c w/g, left + (c+1) w/g) x [top + r h/g, top + (r+1) h/g)`` of the original pixels.

* :func:`box_coverage` gives each region's **coverage** by a box: the share of the region's area
  that lies inside it (0..1). ``sum_n alpha_n coverage_n`` is then exactly the attention mass the
  attention-correctness metric finds inside the box (it spreads a region's weight evenly over the
  region's pixels, ``captioner.evaluation.attention_metrics``). Several boxes: the union, as the
  per-region maximum of their coverages (the metric's mask takes the same maximum).
* :func:`bind_mentions` is the phrase binding rule: every word of an object mention (the name and
  the colour and size words before it, ``captioner.evaluation.attention_metrics.find_mentions``) points
  at the boxes of the named category; when several boxes share it, the mention's attribute words
  keep only the boxes whose own attributes agree ("the purple star" when the image has a green
  star too); when more than one box is still left, the word points at their union (see
  docs/grounding.md: with the mass form of the loss, "somewhere on one of these" is a correct
  target for an ambiguous word, never a wrong one). A category absent from the image binds
  nothing: the word contributes nothing.

Mentions are duck-typed (``start``, ``end``, ``category``, ``attributes``), so this module does not
depend on the evaluation layer that finds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from captioner.errors import DataError
from captioner.grids import interval_overlap

BINDING_ATTRIBUTES = ("color", "size")  # attribute kinds that pick one box among boxes of the same category


def _overlap(lo: np.ndarray, hi: np.ndarray, box_lo: float, box_hi: float) -> np.ndarray:
    """Share of each interval ``[lo, hi)`` inside ``[box_lo, box_hi)``: (g,) -> (g,)."""
    return interval_overlap(lo, hi, box_lo, box_hi) / np.maximum(hi - lo, 1e-9)


def box_coverage(boxes: Sequence[Sequence[float]], view: Sequence[float], grid: int) -> np.ndarray:
    """Each region's area share inside the union of ``boxes``.

    Args:
        boxes: ``(x, y, w, h)`` boxes in original pixels (empty: all zeros).
        view: ``(left, top, right, bottom)`` of the original image the grid covers (``crop_box``).
        grid: g, regions per side.

    Returns:
        (N,) float32 coverage in [0, 1], row-major over the g x g grid.
    """
    if grid < 1:
        raise DataError(f"grid must be >= 1, got {grid}")
    left, top, right, bottom = (float(v) for v in view)
    if not (right > left and bottom > top):
        raise DataError(f"view {tuple(view)} is empty")
    edges_x = left + (right - left) * np.arange(grid + 1) / grid  # (g+1,)
    edges_y = top + (bottom - top) * np.arange(grid + 1) / grid
    out = np.zeros((grid, grid), dtype=np.float64)
    for box in boxes:
        x, y, w, h = (float(v) for v in box)
        if not (w > 0 and h > 0):
            continue
        cols = _overlap(edges_x[:-1], edges_x[1:], x, x + w)  # (g,)
        rows = _overlap(edges_y[:-1], edges_y[1:], y, y + h)  # (g,)
        np.maximum(out, np.outer(rows, cols), out=out)
    return out.reshape(-1).astype(np.float32)  # (N,)


def _agrees(obj: Any, attributes: dict[str, str]) -> bool:
    """The box's own attributes do not contradict the mention's colour/size words."""
    own = getattr(obj, "attributes", None) or {}
    return all(str(own[k]).lower() == v for k, v in attributes.items() if k in BINDING_ATTRIBUTES and k in own)


def bind_mentions(mentions: Sequence[Any], objects: Sequence[Any]) -> list[tuple[int, tuple[int, ...]]]:
    """The phrase binding rule (module docstring): caption word index -> indices into ``objects``.

    Args:
        mentions: object mentions of one caption (``start``, ``end``, ``category``, ``attributes``),
            e.g. ``find_mentions(words, "shapes")``.
        objects: the image's boxes (``category``, ``attributes``), e.g. ``ObjectBox`` items.

    Returns:
        ``(word index, box indices)`` for every word of every mention whose category is in the
        image, in caption order; words of other mentions are left out (nothing to supervise).
    """
    bound: list[tuple[int, tuple[int, ...]]] = []
    for m in mentions:
        same = [i for i, obj in enumerate(objects) if obj.category == m.category]
        if len(same) > 1:
            agreeing = [i for i in same if _agrees(objects[i], dict(m.attributes))]
            same = agreeing or same  # nothing agrees: the words still name the category
        if not same:
            continue
        bound += [(word, tuple(same)) for word in range(m.start, m.end)]
    return bound
