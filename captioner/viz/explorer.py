"""The HTML attention explorer: one self-contained file (inline CSS/JS, image as a data: URI).

The caption's words are buttons: hovering, focusing (Tab) or tapping one draws its attention, and
a click, Enter or Space keeps it (the arrow keys step); the word shown is marked the same way
however it was chosen and is written large above the map. The map is drawn over the photo on a
<canvas>, the photo itself beside it on a wide screen (under it on a narrow one); its long side is at least ``MIN_DISPLAY_SIDE`` pixels (a 128-px scene is
upscaled to be readable) and at most ``max_side``. Heat maps are rendered client-side from the raw
g x g weights embedded as JSON (bilinear upsampling with half-pixel centres, a Gaussian blur of
``BLUR_CELLS`` grid cells, placement on the encoder's crop box, dimming outside it, then the
style's layer: ``light`` darkens where the word did not look, ``heat`` lays the colour map (a
256-entry lookup table) over the photo with a transparent low end), the same rule as
:mod:`captioner.viz.heatmaps`; a legend shows both ends of the scale. The scale is the caption's
(``color_scale``, computed here in Python for the overlay view and for every layer and head), so a
word with spread-out attention looks flat next to one that points. A plain sentence says how
focused the word was; its figures (peak share, grid cell, entropy against log N) are one click away.

Inside a page (``captioner serve``) the explorer tells its parent which word it shows and which
style is chosen (``postMessage``), and offers ``captionerShowWord(word)``, ``captionerSetStyle``
and ``captionerSnapshot()`` (the map with the caption and the word under it, as a PNG data URL).

Raw weights rather than pre-rendered PNGs keep the file small and let the reader pick any layer
and head of a Transformer (layers x (heads + 1) maps per word would be hundreds of images). The
only branch on the decoder is whether per-layer/per-head maps (``all_attention``) are present: then
layer and head selectors appear, defaulting to the last layer's mean over heads (the overlay view).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from captioner.errors import ConfigError, DataError
from captioner.inference import Caption
from captioner.viz.attention_json import on_image
from captioner.viz.explorer_script import EXPLORER_CSS, EXPLORER_JS
from captioner.viz.heatmaps import BLUR_CELLS, DEFAULT_ALPHA, DEFAULT_CMAP, DIM, check_style, color_scale, colormap_lut

MIN_DISPLAY_SIDE = 384  # the canvas's long side is at least this many pixels


def display_size(image_size: tuple[int, int], min_side: int = MIN_DISPLAY_SIDE, max_side: int = 960
                 ) -> tuple[int, int]:
    """Canvas size for an image: the long side clamped to [min_side, max_side], the aspect kept.

    Small images (a 128-px scene) are upscaled to ``min_side``; large photos are bounded by
    ``max_side``; sizes in between are shown 1:1. ``max_side`` wins when the two disagree.
    """
    if min_side < 1 or max_side < 1:
        raise ConfigError(f"display sides must be >= 1, got min_side={min_side}, max_side={max_side}")
    w, h = image_size
    if w < 1 or h < 1:
        raise DataError(f"image size must be positive, got {w}x{h}")
    s = min(max_side, max(min_side, w, h)) / max(w, h)
    return max(1, round(w * s)), max(1, round(h * s))


def _image_data_uri(image: Image.Image, max_side: int) -> str:
    image = image.convert("RGB")
    if max(image.size) > max_side:
        s = max_side / max(image.size)
        image = image.resize((max(1, round(image.width * s)), max(1, round(image.height * s))),
                             Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=88)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _layer_head_scales(all_attention: np.ndarray) -> list[list[float]]:
    """vmax of the caption's colour scale for every layer (rows) and head (columns, mean of heads last)."""
    heads_and_mean = [all_attention, all_attention.mean(axis=2, keepdims=True)]
    maps = np.concatenate(heads_and_mean, axis=2)  # (L, layers, heads + 1, g, g)
    return [[color_scale(maps[:, i, j])[1] for j in range(maps.shape[2])] for i in range(maps.shape[1])]


def render_explorer(
    image: Image.Image,
    caption: Caption,
    cmap: str = DEFAULT_CMAP,
    alpha: float = DEFAULT_ALPHA,
    layer: int = -1,
    head: int | None = None,
    title: str | None = None,
    max_side: int = 960,
    start: int = 0,
    min_side: int = MIN_DISPLAY_SIDE,
    style: str = "light",
) -> str:
    """The explorer page as one HTML string with no external resources.

    Args:
        image: the original RGB image (embedded as JPEG, at most ``max_side`` pixels).
        caption: the caption with its (L, g, g) attention (and optional all_attention); its image
            size and crop box default to ``image``'s (:func:`~captioner.viz.attention_json.on_image`).
        cmap: matplotlib colour map name of the ``heat`` style (embedded as a lookup table).
        alpha: initial strength (:func:`~captioner.viz.heatmaps.overlay_heatmap`).
        layer: layer selected first when ``caption.all_attention`` exists (negative counts from the end).
        head: head selected first (None = mean of heads).
        title: page heading (defaults to "Attention explorer").
        max_side: largest side of the embedded image and of the canvas.
        start: index of the word selected first.
        min_side: smallest long side of the canvas (small images are upscaled to it).
        style: the style shown first, ``light`` or ``heat`` (the reader can switch).
    """
    record = on_image(caption, image)
    data = {
        "caption": record.text, "words": record.words, "grid": list(record.grid),
        "image_size": list(record.image_size), "box": list(record.box),
        "attention": np.round(record.attention.numpy().astype(np.float64), 5).tolist(),
        "all_attention": None, "layers": 0, "heads": 0, "layer": 0, "head": None,
        "lut": colormap_lut(cmap).reshape(-1).tolist(), "alpha": float(alpha), "blur_cells": BLUR_CELLS,
        "dim": DIM, "display_size": list(display_size(record.image_size, min_side, max_side)),
        "scale": list(color_scale(record.attention)), "scales": None,
        "start": max(0, min(start, len(record.words) - 1)), "style": check_style(style),
    }
    if record.all_attention is not None:
        layers, heads = record.all_attention.shape[1:3]
        if not -layers <= layer < layers:
            raise ConfigError(f"layer {layer} out of range: the decoder has {layers} layers")
        if head is not None and not 0 <= head < heads:
            raise ConfigError(f"head {head} out of range: the decoder has {heads} heads")
        data.update(all_attention=np.round(record.all_attention.numpy().astype(np.float64), 5).tolist(),
                    layers=int(layers), heads=int(heads), layer=layer % layers, head=head,
                    scales=_layer_head_scales(record.all_attention.numpy()))
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")  # safe inside <script>
    size = data["display_size"]
    heading = html.escape(title or "Attention explorer")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{heading}: {html.escape(record.text)}</title>
<link rel="icon" href="data:,">
<style>{EXPLORER_CSS}</style>
</head>
<body>
<h1>{heading}</h1>
<p class="caption" id="caption" aria-label="caption: choose a word to see where the model looked"></p>
<div class="controls">
  <label>style<select id="style"><option value="light">attention as light</option>
    <option value="heat">heat map</option></select></label>
  <span id="selectors" hidden>
    <label>layer<select id="layer"></select></label>
    <label>head<select id="head"></select></label>
  </span>
  <label>strength<input type="range" id="alpha" min="0" max="1" step="0.05"></label>
</div>
<div class="views">
  <figure>
    <p id="shown-word" aria-live="polite"></p>
    <canvas id="view" role="img" aria-label="where the model looked for the chosen word"></canvas>
    <div class="legend"><span>little</span><span class="bar" id="legend-bar"></span><span id="legend-top"></span></div>
    <p id="summary"></p>
    <details><summary>figures</summary><span id="info"></span></details>
  </figure>
  <figure>
    <figcaption class="big">the photo</figcaption>
    <img id="photo" alt="the photo as given" width="{size[0]}" height="{size[1]}" src="{_image_data_uri(image, max_side)}">
  </figure>
</div>
<p class="help">Hover, tap or Tab to a word to see where the model looked; Enter, Space or a click keeps it;
the arrow keys step through the words. Outside the region the encoder saw, the image is dimmed.</p>
<script type="application/json" id="explorer-data">{payload}</script>
<script>{EXPLORER_JS}</script>
</body>
</html>
"""


def write_explorer(path: str | Path, image: Image.Image, caption: Caption, **options: object) -> Path:
    """Write :func:`render_explorer`'s page to ``path`` (options as there)."""
    path = Path(path)
    path.write_text(render_explorer(image, caption, **options), encoding="utf-8")  # type: ignore[arg-type]
    return path
