"""The HTML attention explorer: one self-contained file (inline CSS/JS, image as a data: URI).

The caption's words are clickable/hoverable spans; the selected word's attention is drawn over the
photo on a <canvas> whose long side is at least ``MIN_DISPLAY_SIDE`` pixels (a 128-px scene is
upscaled to be readable) and at most ``max_side``. Heat maps are rendered client-side from the raw
g x g weights embedded as JSON (bilinear upsampling with half-pixel centres, a Gaussian blur of
``BLUR_CELLS`` grid cells, the colour map as a 256-entry lookup table, placement on the encoder's
crop box, dimming outside it), the same rule as :mod:`captioner.viz.heatmaps`. Colours use the
caption's shared scale (``color_scale``, computed here in Python for the overlay view and for every
layer and head), so a word with spread-out attention looks flat next to one that points. A line
under the controls gives the word's peak share, its grid cell and its entropy against log N.

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
from captioner.viz.heatmaps import BLUR_CELLS, DIM, color_scale, colormap_lut

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.2em auto; max-width: 980px;
       padding: 0 1em; color: #1d1d1f; background: #fafafa; }
h1 { font-size: 1.15em; margin: 0 0 .6em; font-weight: 600; }
.caption { font-size: 1.35em; margin: .3em 0 .7em; }
.word { padding: .05em .25em; margin: 0 .05em; border-radius: .3em; cursor: pointer; outline: none; }
.word:hover, .word:focus-visible { background: #e3e8f4; }
.word.active { background: #2853c7; color: #fff; }
.controls { display: flex; flex-wrap: wrap; gap: 1.2em; align-items: center; margin-bottom: .7em; font-size: .92em; }
.controls select, .controls input { margin-left: .35em; }
#info { color: #555; font-variant-numeric: tabular-nums; }
/* the canvas is drawn at display_size and shrinks (never grows) on narrow screens */
canvas { display: block; max-width: 100%; height: auto; border-radius: 4px; box-shadow: 0 1px 4px #0003; }
.help { color: #777; font-size: .85em; }
[hidden] { display: none !important; }
"""

_JS = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("explorer-data").textContent);
  const photo = document.getElementById("photo");
  const canvas = document.getElementById("view");
  const ctx = canvas.getContext("2d");
  const layerSel = document.getElementById("layer");
  const headSel = document.getElementById("head");
  const alphaIn = document.getElementById("alpha");
  const info = document.getElementById("info");
  const g = D.grid[0];
  canvas.width = D.display_size[0];  // small images are upscaled, large ones bounded (Python decides)
  canvas.height = D.display_size[1];
  const sx = canvas.width / D.image_size[0], sy = canvas.height / D.image_size[1];
  const box = [D.box[0] * sx, D.box[1] * sy, D.box[2] * sx, D.box[3] * sy];
  const spans = [];
  let current = 0;

  if (D.all_attention) {
    for (let l = 0; l < D.layers; l++) layerSel.add(new Option(String(l + 1), String(l)));
    headSel.add(new Option("mean", "mean"));
    for (let h = 0; h < D.heads; h++) headSel.add(new Option(String(h + 1), String(h)));
    layerSel.value = String(D.layer);
    headSel.value = D.head === null ? "mean" : String(D.head);
    document.getElementById("selectors").hidden = false;
  }
  alphaIn.value = String(D.alpha);

  function weights(i) {  // the g x g map shown for word i
    if (!D.all_attention) return D.attention[i];
    const heads = D.all_attention[i][+layerSel.value];
    if (headSel.value !== "mean") return heads[+headSel.value];
    return heads[0].map(function (row, r) {
      return row.map(function (_, c) {
        let s = 0;
        for (let h = 0; h < heads.length; h++) s += heads[h][r][c];
        return s / heads.length;
      });
    });
  }

  function vrange() {  // the caption's shared colour scale for what is shown now
    if (!D.all_attention) return D.scale;
    return [0, D.scales[+layerSel.value][headSel.value === "mean" ? D.heads : +headSel.value]];
  }

  function axis(n, cell) {  // bilinear taps (half-pixel centres, clamped) for n pixels
    const lo = new Int32Array(n), hi = new Int32Array(n), fr = new Float32Array(n);
    for (let p = 0; p < n; p++) {
      const u = Math.min(Math.max((p + 0.5) / cell - 0.5, 0), g - 1);
      lo[p] = Math.min(Math.floor(u), g - 1); hi[p] = Math.min(lo[p] + 1, g - 1); fr[p] = u - lo[p];
    }
    return { lo: lo, hi: hi, fr: fr };
  }

  function blur(a, w, h, sigma, horizontal) {  // separable Gaussian, kernel renormalised at edges
    if (sigma < 0.5) return a;
    const r = Math.max(1, Math.floor(3 * sigma)), k = [];
    for (let x = -r; x <= r; x++) k.push(Math.exp(-0.5 * (x / sigma) * (x / sigma)));
    const out = new Float32Array(a.length), n = horizontal ? w : h;
    for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) {
      const p = horizontal ? x : y;
      let s = 0, ws = 0;
      for (let j = -r; j <= r; j++) {
        const q = p + j;
        if (q < 0 || q >= n) continue;
        s += k[j + r] * a[horizontal ? y * w + q : q * w + x]; ws += k[j + r];
      }
      out[y * w + x] = s / ws;
    }
    return out;
  }

  function heatCanvas(m) {  // colour-mapped heat layer at a working resolution of the box
    const bw = box[2] - box[0], bh = box[3] - box[1];
    const f = Math.min(1, 240 / Math.max(bw, bh));
    const w = Math.max(1, Math.round(bw * f)), h = Math.max(1, Math.round(bh * f));
    const ax = axis(w, w / g), ay = axis(h, h / g);
    let a = new Float32Array(w * h);
    for (let y = 0; y < h; y++) {
      const r0 = m[ay.lo[y]], r1 = m[ay.hi[y]], fy = ay.fr[y];
      for (let x = 0; x < w; x++) {
        const top = r0[ax.lo[x]] * (1 - ax.fr[x]) + r0[ax.hi[x]] * ax.fr[x];
        const bot = r1[ax.lo[x]] * (1 - ax.fr[x]) + r1[ax.hi[x]] * ax.fr[x];
        a[y * w + x] = top * (1 - fy) + bot * fy;
      }
    }
    a = blur(blur(a, w, h, D.blur_cells * w / g, true), w, h, D.blur_cells * h / g, false);
    const range = vrange(), lo = range[0], hi = range[1];
    const layer = document.createElement("canvas");
    layer.width = w; layer.height = h;
    const lctx = layer.getContext("2d"), img = lctx.createImageData(w, h);
    for (let p = 0; p < a.length; p++) {
      const v = hi - lo > 1e-12 ? Math.min(255, Math.max(0, Math.round(255 * (a[p] - lo) / (hi - lo)))) : 0;
      img.data[4 * p] = D.lut[3 * v]; img.data[4 * p + 1] = D.lut[3 * v + 1];
      img.data[4 * p + 2] = D.lut[3 * v + 2]; img.data[4 * p + 3] = 255;
    }
    lctx.putImageData(img, 0, 0);
    return layer;
  }

  function draw(i) {
    ctx.globalAlpha = 1;
    ctx.drawImage(photo, 0, 0, canvas.width, canvas.height);
    ctx.fillStyle = "rgba(0,0,0," + (1 - D.dim) + ")";  // dim what the encoder did not see
    ctx.fillRect(0, 0, canvas.width, box[1]);
    ctx.fillRect(0, box[3], canvas.width, canvas.height - box[3]);
    ctx.fillRect(0, box[1], box[0], box[3] - box[1]);
    ctx.fillRect(box[2], box[1], canvas.width - box[2], box[3] - box[1]);
    if (!D.words.length) { info.textContent = "empty caption"; return; }
    const m = weights(i);
    ctx.globalAlpha = +alphaIn.value;
    ctx.imageSmoothingEnabled = true;
    ctx.imageSmoothingQuality = "high";
    ctx.drawImage(heatCanvas(m), box[0], box[1], box[2] - box[0], box[3] - box[1]);
    ctx.globalAlpha = 1;
    let best = 0, br = 0, bc = 0, total = 0, entropy = 0;
    m.forEach(function (row, r) {
      row.forEach(function (v, c) { total += v; if (v > best) { best = v; br = r; bc = c; } });
    });
    if (total > 0) m.forEach(function (row) { row.forEach(function (v) {
      if (v > 0) entropy -= (v / total) * Math.log(v / total);
    }); });
    const share = total > 0 ? best / total : 0;
    info.textContent = "word " + (i + 1) + "/" + D.words.length + " \u201c" + D.words[i] + "\u201d: peak " +
      (100 * share).toFixed(share >= 0.1 ? 0 : 1) + "% at row " + (br + 1) + ", column " + (bc + 1) +
      " \u00b7 H " + entropy.toFixed(1) + "/" + Math.log(g * g).toFixed(1) + " nats";
  }

  function select(i) {
    if (!D.words.length) return;
    current = (i + D.words.length) % D.words.length;
    spans.forEach(function (s, k) { s.classList.toggle("active", k === current); });
    document.body.dataset.word = String(current);
    draw(current);
  }

  const cap = document.getElementById("caption");
  D.words.forEach(function (word, i) {
    const s = document.createElement("span");
    s.className = "word"; s.textContent = word; s.tabIndex = 0; s.id = "word-" + i;
    s.addEventListener("click", function () { select(i); });
    s.addEventListener("mouseenter", function () { draw(i); });
    s.addEventListener("mouseleave", function () { draw(current); });
    cap.appendChild(s); cap.appendChild(document.createTextNode(" "));
    spans.push(s);
  });
  document.addEventListener("keydown", function (e) {
    if (e.target && (e.target.tagName === "SELECT" || e.target.tagName === "INPUT")) return;  // their own arrows
    if (e.key === "ArrowRight") { select(current + 1); e.preventDefault(); }
    if (e.key === "ArrowLeft") { select(current - 1); e.preventDefault(); }
  });
  [layerSel, headSel, alphaIn].forEach(function (el) { el.addEventListener("input", function () { draw(current); }); });
  function start() { select(D.start); document.body.dataset.ready = "1"; }
  if (photo.complete && photo.naturalWidth) start(); else photo.addEventListener("load", start);
})();
"""


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
    cmap: str = "jet",
    alpha: float = 0.5,
    layer: int = -1,
    head: int | None = None,
    title: str | None = None,
    max_side: int = 960,
    start: int = 0,
    min_side: int = MIN_DISPLAY_SIDE,
) -> str:
    """The explorer page as one HTML string with no external resources.

    Args:
        image: the original RGB image (embedded as JPEG, at most ``max_side`` pixels).
        caption: the caption with its (L, g, g) attention (and optional all_attention); its image
            size and crop box default to ``image``'s (:func:`~captioner.viz.attention_json.on_image`).
        cmap: matplotlib colour map name (embedded as a lookup table).
        alpha: initial heat-map opacity.
        layer: layer selected first when ``record.all_attention`` exists (negative counts from the end).
        head: head selected first (None = mean of heads).
        title: page heading (defaults to "Attention explorer").
        max_side: largest side of the embedded image and of the canvas.
        start: index of the word selected first.
        min_side: smallest long side of the canvas (small images are upscaled to it).
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
        "start": max(0, min(start, len(record.words) - 1)),
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
    heading = html.escape(title or "Attention explorer")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{heading}: {html.escape(record.text)}</title>
<link rel="icon" href="data:,">
<style>{_CSS}</style>
</head>
<body>
<h1>{heading}</h1>
<p class="caption" id="caption" aria-label="caption words"></p>
<div class="controls">
  <span id="selectors" hidden>
    <label>layer<select id="layer"></select></label>
    <label>head<select id="head"></select></label>
  </span>
  <label>opacity<input type="range" id="alpha" min="0" max="1" step="0.05"></label>
  <span id="info"></span>
</div>
<canvas id="view" aria-label="attention heat map over the image"></canvas>
<img id="photo" alt="" hidden src="{_image_data_uri(image, max_side)}">
<p class="help">Click or hover a word to see where the model looked; the arrow keys \u2190 \u2192 step through
the words. Outside the region the encoder saw, the image is dimmed.</p>
<script type="application/json" id="explorer-data">{payload}</script>
<script>{_JS}</script>
</body>
</html>
"""


def write_explorer(path: str | Path, image: Image.Image, caption: Caption, **options: object) -> Path:
    """Write :func:`render_explorer`'s page to ``path`` (options as there)."""
    path = Path(path)
    path.write_text(render_explorer(image, caption, **options), encoding="utf-8")  # type: ignore[arg-type]
    return path
