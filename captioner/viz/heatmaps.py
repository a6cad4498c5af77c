"""Heat maps: one word's g x g attention placed on the original image, its colours and its figures.

Shape legend: L words of a caption, g grid size, (H, W) original image height/width in pixels.

Grid cell (i, j) covers one (box_w/g) x (box_h/g) rectangle of the encoder's ``crop_box`` in
original pixels: the map is stretched back to the box's aspect (the photo is never squashed) and
pixels outside are dimmed. Upsampling is bilinear, then a Gaussian blur of ``BLUR_CELLS`` cells.
Two styles (``STYLES``, :func:`style_layer`): ``heat`` and ``light`` (the SAT paper's figures); each map
on its own scale (:func:`word_scale`). docs/caption_and_overlays.md explains them; the HTML explorer
implements the same rules in JavaScript.
"""

from __future__ import annotations

import math
import sys
from functools import lru_cache
from typing import Sequence

import numpy as np
from PIL import Image

from captioner.data.images import as_array, cell_weights
from captioner.errors import ConfigError, DataError

__all__ = ["BLUR_CELLS", "DEFAULT_ALPHA", "DEFAULT_CMAP", "DEFAULT_STYLE", "DIM", "HEAT_DIM", "STYLES", "UNIFORM_FLOOR",
           "LIT_MAX_GAIN", "LIT_TARGET", "attention_stats", "attention_to_image_map", "check_style", "color_scale",
           "colormap_lut", "legend_top", "light_gain",
           "map_overlap", "map_peaks", "overlay_heatmap", "peak_cell", "share_text", "spread_words", "stats_label",
           "style_layer", "word_scale"]

BLUR_CELLS = 0.35  # Gaussian blur sigma, in grid cells (shared with the explorer's JavaScript)
DIM = 0.35  # brightness kept outside the encoder's crop box
UNIFORM_FLOOR = 2.0  # the colour scale's top is at least this many times the uniform weight 1/(g*g)
STYLES = ("light", "heat")  # attention as light | a colour map with a transparent low end (the default)
DEFAULT_STYLE = "heat"  # shows the strongest region on any photo, dark ones included
HEAT_DIM = 0.5  # heat: where the word did not look, the photo is darkened by up to HEAT_DIM * alpha
DEFAULT_CMAP = "viridis"  # perceptually uniform, readable in grey and by most colour-blind readers
DEFAULT_ALPHA = 0.75  # light: darkening where the word did not look; heat: opacity at the scale's top
LIT_TARGET = 0.45  # light on a dark photo: where the word looked, its mean brightness raised to this share of white
LIT_MAX_GAIN = 8.0  # ... by at most this factor
_PEAK_CELL_PX = 8  # pixels per grid cell at which color_scale samples the upsampled maps


def _axis_weights(size: int, start: float, stop: float, g: int, smooth: bool) -> np.ndarray:
    """(size, g) weights taking g grid values to ``size`` pixels (0 outside [start, stop)); bilinear+blur or nearest."""
    if not smooth:
        return cell_weights(size, start, stop, g)
    weights = np.zeros((size, g), dtype=np.float64)
    centres = np.arange(size) + 0.5
    inside = np.flatnonzero((centres >= start) & (centres < stop))
    if inside.size == 0:
        return weights
    cell = (stop - start) / g
    u = (centres[inside] - start) / cell  # position in grid units, 0..g
    u = np.clip(u - 0.5, 0.0, g - 1.0)  # half-pixel centres, clamped at the edges
    lo = np.minimum(np.floor(u).astype(int), g - 1)
    hi = np.minimum(lo + 1, g - 1)
    frac = u - lo
    np.add.at(weights, (inside, lo), 1.0 - frac)
    np.add.at(weights, (inside, hi), frac)
    sigma = BLUR_CELLS * cell
    if sigma >= 0.5:
        weights[inside] = _gaussian_blur_columns(weights[inside], sigma)
    return weights


def _gaussian_blur_columns(a: np.ndarray, sigma: float) -> np.ndarray:
    """Blur each column of ``a`` (n, g) along n, the kernel renormalised at the edges (any g, even g <= 2)."""
    n = a.shape[0]
    radius = max(1, int(3 * sigma))
    x = np.arange(-radius, radius + 1)
    kernel = np.exp(-0.5 * (x / sigma) ** 2)
    norm = np.convolve(np.ones(n), kernel)[radius:radius + n]
    return np.stack([np.convolve(col, kernel)[radius:radius + n] / norm for col in a.T], axis=1)


def attention_to_image_map(attention: np.ndarray, width: int, height: int, box: Sequence[float] | None = None,
                           smooth: bool = True, preserve_mass: bool = False) -> np.ndarray:
    """Place one word's (g, g) attention (row 0 = top of ``box``) on the original image: (H, W) float32, 0 outside.

    ``smooth``: bilinear upsampling + blur (else flat cells). ``preserve_mass``: the map sums to
    ``attention.sum()`` over the image; else values stay in attention units.
    """
    att = np.asarray(attention, dtype=np.float64)
    if att.ndim != 2 or att.shape[0] != att.shape[1]:
        raise DataError(f"attention must be a square (g, g) grid, got shape {att.shape}")
    left, top, right, bottom = box if box is not None else (0, 0, width, height)
    eps = 1e-6 * max(width, height)  # scaled boxes carry rounding error
    if not (-eps <= left < right <= width + eps and -eps <= top < bottom <= height + eps):
        raise DataError(f"box {tuple(box)} does not fit a {width}x{height} image")
    g = att.shape[0]
    rows = _axis_weights(height, top, bottom, g, smooth)  # (H, g)
    cols = _axis_weights(width, left, right, g, smooth)  # (W, g)
    out = rows @ att @ cols.T  # (H, W)
    if preserve_mass:
        total = out.sum()
        out = out * (att.sum() / total) if total > 0 else out
    return out.astype(np.float32)


def map_peaks(maps: object) -> np.ndarray:
    """(...) highest value of each (..., g, g) map after upsampling and blurring, independent of the image's size."""
    att = as_array(maps, np.float64)
    if att.ndim < 2 or att.shape[-1] != att.shape[-2]:
        raise DataError(f"attention must be (..., g, g), got shape {att.shape}")
    g = att.shape[-1]
    flat = att.reshape(-1, g, g)
    weights = _axis_weights(g * _PEAK_CELL_PX, 0, g * _PEAK_CELL_PX, g, smooth=True)  # (side, g)
    peaks = np.empty(len(flat))
    for s in range(0, len(flat), 64):  # bounded memory: 64 maps of side x side at a time
        peaks[s:s + 64] = (weights @ flat[s:s + 64] @ weights.T).max(axis=(1, 2))
    return peaks.reshape(att.shape[:-2])


def word_scale(maps: object) -> np.ndarray:
    """(...) the top of each map's own scale: its upsampled peak, at least ``UNIFORM_FLOOR / (g * g)``."""
    att = as_array(maps, np.float64)
    peaks = map_peaks(att)
    return np.maximum(peaks, UNIFORM_FLOOR / (att.shape[-1] * att.shape[-2]))


def color_scale(attention: object) -> tuple[float, float]:
    """One scale ``(0, vmax)`` for (L, g, g) maps compared on a common scale; (0, 1) for an empty caption."""
    att = as_array(attention, np.float64)
    if att.ndim != 3 or att.shape[1] != att.shape[2]:
        raise DataError(f"attention must be (L, g, g), got shape {att.shape}")
    if att.shape[0] == 0:
        return 0.0, 1.0
    floor = UNIFORM_FLOOR / att.shape[1] ** 2
    return 0.0, max(float(map_peaks(att).max()), floor)


def attention_stats(attention: object) -> tuple[float, float, float]:
    """(peak share, entropy, uniform entropy) of one (g, g) map normalised to sum 1; all-zero gives (0, 0, log N)."""
    att = as_array(attention, np.float64).reshape(-1)
    total = float(att.sum())
    uniform = math.log(att.size) if att.size else 0.0
    if total <= 0:
        return 0.0, 0.0, uniform
    p = att / total
    nz = p[p > 0]
    return float(p.max()), max(0.0, float(-(nz * np.log(nz)).sum())), uniform


def peak_cell(attention: object) -> tuple[int, int, float]:
    """``(row, col, share)`` of one (g, g) map's strongest region (row 0 = top) and its share of the map."""
    att = as_array(attention, np.float64)
    if att.ndim != 2 or att.shape[0] != att.shape[1] or att.size == 0:
        raise DataError(f"attention must be (g, g), got shape {att.shape}")
    row, col = np.unravel_index(int(np.argmax(att)), att.shape)
    total = float(att.sum())
    return int(row), int(col), float(att[row, col]) / total if total > 0 else 0.0


def map_overlap(a: object, b: object) -> float:
    """How much two (g, g) maps overlap: the histogram intersection of the two, each normalised to sum 1
    (1 = the same map, 0 = no region in common); 0 when either map is all zero."""
    a, b = as_array(a, np.float64), as_array(b, np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise DataError(f"maps must be two (g, g) arrays of one shape, got {a.shape} and {b.shape}")
    sa, sb = float(a.sum()), float(b.sum())
    if sa <= 0 or sb <= 0:
        return 0.0
    return float(np.minimum(a / sa, b / sb).sum())


def spread_words(entropy: float, uniform: float) -> str:
    """How spread out a map is, in words: its entropy against log N below 0.5 is ``"one place"``,
    below 0.85 ``"a few places"``, else ``"all over"`` (the explorer's sentence uses the same cut-offs)."""
    spread = entropy / uniform if uniform > 0 else 0.0
    return "one place" if spread < 0.5 else "a few places" if spread < 0.85 else "all over"


def share_text(share: float) -> str:
    """A peak share as the page and the panels write it: ``"42"`` (whole percent from 10%), ``"4.2"`` below."""
    return f"{100 * share:.0f}" if share >= 0.1 else f"{100 * share:.1f}"


def stats_label(attention: object) -> str:
    """The line printed under a word, e.g. ``"one place · top region 34%"``: how spread out its map
    is (:func:`spread_words`) and the peak share, the largest region's share of its attention."""
    peak, entropy, uniform = attention_stats(attention)
    return f"{spread_words(entropy, uniform)} \u00b7 top region {share_text(peak)}%"


def legend_top(share: float | None = None) -> str:
    """What the top of the legend stands for: the strongest region, with its share of the map when one
    map is shown (``"strongest region, 42%"``), the same figure as the line under it."""
    return "strongest region" if share is None else f"strongest region, {share_text(share)}%"


@lru_cache(maxsize=16)
def colormap_lut(name: str = DEFAULT_CMAP) -> np.ndarray:
    """A matplotlib colour map by name as a (256, 3) uint8 lookup table."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # never open a GUI backend from library code
    try:
        cmap = matplotlib.colormaps[name]
    except KeyError:
        raise ConfigError(f"unknown colour map {name!r} (try jet, viridis, inferno, magma)") from None
    return (cmap(np.linspace(0.0, 1.0, 256))[:, :3] * 255).round().astype(np.uint8)


def _box_mask(width: int, height: int, box: Sequence[float] | None) -> np.ndarray:
    if box is None:
        return np.ones((height, width), dtype=bool)
    ys = np.arange(height) + 0.5
    xs = np.arange(width) + 0.5
    return ((ys >= box[1]) & (ys < box[3]))[:, None] & ((xs >= box[0]) & (xs < box[2]))[None, :]


def check_style(style: str, option: str = "style") -> str:
    """``style`` when it is one of :data:`STYLES`, else a one-line ``ConfigError``."""
    if style not in STYLES:
        raise ConfigError(f"{option} must be one of {', '.join(STYLES)}, got {style!r}")
    return style


def style_layer(norm: np.ndarray, style: str = DEFAULT_STYLE, cmap: str = DEFAULT_CMAP, alpha: float = DEFAULT_ALPHA
                ) -> tuple[np.ndarray, np.ndarray]:
    """The layer over the photo for a map scaled to 0..1: ``(colours (..., 3), opacity (...))``.

    ``light``: black at opacity ``alpha * (1 - norm)``; ``heat``: the colour map at ``alpha * norm ** 2``
    over the photo darkened by ``HEAT_DIM * alpha * (1 - norm)``, folded into one colour and opacity.
    """
    norm = np.clip(np.asarray(norm, dtype=np.float64), 0.0, 1.0)
    if check_style(style) == "light":
        return np.zeros(norm.shape + (3,), dtype=np.float32), (alpha * (1.0 - norm)).astype(np.float32)
    level = (norm * 255).round()
    colours = colormap_lut(cmap)[level.astype(np.int64)].astype(np.float64)
    paint = alpha * (level / 255) ** 2  # the colour's own opacity
    dark = HEAT_DIM * alpha * (1.0 - level / 255)  # black under it, where the word did not look
    opacity = 1.0 - (1.0 - paint) * (1.0 - dark)
    safe = np.where(opacity > 0, opacity, 1.0)
    return (colours * (paint / safe)[..., None]).astype(np.float32), opacity.astype(np.float32)


def light_gain(image: Image.Image) -> float:
    """How much ``light`` brightens a dark photo where the word looked: 1 to ``LIT_MAX_GAIN``."""
    small = np.asarray(image.convert("RGB").resize((32, 32), Image.Resampling.BILINEAR), dtype=np.float64)
    luma = float((small @ np.array([0.299, 0.587, 0.114])).mean())
    return float(min(LIT_MAX_GAIN, max(1.0, LIT_TARGET * 255 / max(1.0, luma))))


def overlay_heatmap(image: Image.Image, heat_map: np.ndarray, cmap: str = DEFAULT_CMAP, alpha: float = DEFAULT_ALPHA,
                    box: Sequence[float] | None = None, scale: tuple[float, float] | None = None,
                    style: str = DEFAULT_STYLE) -> Image.Image:
    """Draw an (H, W) map over the same-size ``image`` in ``style``; dim it outside ``box``; return a new RGB image.

    ``alpha``: the darkest dimming (``light``) or the top opacity (``heat``). ``scale``: (vmin, vmax)
    of the scale, e.g. ``(0, word_scale(weights))``; None: 0 to this map's peak inside the box.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha must be in [0, 1], got {alpha}")
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32)
    if heat_map.shape != rgb.shape[:2]:
        raise DataError(f"heat map shape {heat_map.shape} does not match image size {image.size}")
    inside = _box_mask(image.width, image.height, box)
    lo, hi = scale if scale is not None else (0.0, float(heat_map[inside].max()))
    norm = (heat_map - lo) / (hi - lo) if hi - lo > 1e-12 else np.zeros_like(heat_map)
    colours, opacity = style_layer(norm, style, cmap, alpha)
    drawn = (1.0 - opacity[..., None]) * rgb + opacity[..., None] * colours
    gain = light_gain(image) if style == "light" else 1.0
    if gain >= 1.05:  # a dark photo: lit up where the word looked, so its peak can be seen
        lit = alpha * np.clip(norm, 0.0, 1.0) ** 2  # (H, W) the lit photo's opacity
        drawn = (1.0 - lit[..., None]) * drawn + lit[..., None] * np.minimum(255.0, gain * rgb)
    out = np.where(inside[..., None], drawn, DIM * rgb)
    return Image.fromarray(out.clip(0, 255).round().astype(np.uint8))
