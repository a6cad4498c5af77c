"""The explorer page's stylesheet and script (:mod:`captioner.viz.explorer` embeds both inline).

The script reads the page's ``explorer-data`` JSON and draws the chosen word's map the way
:mod:`captioner.viz.heatmaps` does in numpy: bilinear upsampling with half-pixel centres, a
Gaussian blur of ``blur_cells`` grid cells, the caption's shared scale, then the style's RGBA layer
(``light``: black, opaque where the word did not look; ``heat``: the colour map, transparent at
its low end) over the photo.
"""

__all__ = ["EXPLORER_CSS", "EXPLORER_JS"]

EXPLORER_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.2em auto; max-width: 1180px;
       padding: 0 1em; color: #1d1d1f; background: #fafafa; }
h1 { font-size: 1.15em; margin: 0 0 .6em; font-weight: 600; }
.caption { font-size: 1.35em; margin: .3em 0 .7em; display: flex; flex-wrap: wrap; gap: .15em .2em; }
.word { font: inherit; color: inherit; background: none; border: 0; padding: .05em .3em; border-radius: .3em;
        cursor: pointer; }
.word:hover { background: #e3e8f4; }
.word.active { background: #1f47b8; color: #fff; }
.word.pinned { text-decoration: underline; text-decoration-thickness: .12em; text-underline-offset: .2em; }
.word:focus-visible, select:focus-visible, input:focus-visible, summary:focus-visible {
  outline: 3px solid #e0a800; outline-offset: 2px; }
.controls { display: flex; flex-wrap: wrap; gap: 1.2em; align-items: center; margin-bottom: .7em; font-size: .92em; }
.controls select, .controls input { margin-left: .35em; }
.views { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
.views figure { margin: 0; flex: 1 1 320px; min-width: 0; }
.views figcaption { color: #555; font-size: .9em; margin: .2em 0; }
#shown-word, .views figcaption.big { font-size: 1.9em; font-weight: 600; margin: 0 0 .15em; line-height: 1.2;
  overflow-wrap: anywhere; }
.views figcaption.big { font-weight: 400; color: #555; }  /* level with the word, so both pictures line up */
#summary { margin: .3em 0; }
#info { color: #555; font-variant-numeric: tabular-nums; }
/* the canvas is drawn at display_size and shrinks (never grows) on narrow screens */
canvas, #photo { display: block; max-width: 100%; height: auto; border-radius: 4px; box-shadow: 0 1px 4px #0003; }
.legend { display: flex; align-items: center; gap: .5em; font-size: .85em; color: #444; margin: .4em 0; }
.legend .bar { flex: 0 1 220px; height: 12px; border-radius: 3px; border: 1px solid #bbb; }
.help { color: #555; font-size: .85em; }
body.embedded { margin: 0; padding: 0 4px; max-width: none; }  /* inside a page: it gives the heading */
body.embedded h1 { display: none; }
[hidden] { display: none !important; }
"""

EXPLORER_JS = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("explorer-data").textContent);
  const photo = document.getElementById("photo");
  const canvas = document.getElementById("view");
  const ctx = canvas.getContext("2d");
  const layerSel = document.getElementById("layer");
  const headSel = document.getElementById("head");
  const styleSel = document.getElementById("style");
  const alphaIn = document.getElementById("alpha");
  const info = document.getElementById("info");
  const g = D.grid[0];
  canvas.width = D.display_size[0];  // small images are upscaled, large ones bounded (Python decides)
  canvas.height = D.display_size[1];
  const sx = canvas.width / D.image_size[0], sy = canvas.height / D.image_size[1];
  const box = [D.box[0] * sx, D.box[1] * sy, D.box[2] * sx, D.box[3] * sy];
  const spans = [];
  let current = 0, shown = 0;  // the pinned word | the word drawn now (hovered, focused or pinned)

  if (D.all_attention) {
    for (let l = 0; l < D.layers; l++) layerSel.add(new Option(String(l + 1), String(l)));
    headSel.add(new Option("mean", "mean"));
    for (let h = 0; h < D.heads; h++) headSel.add(new Option(String(h + 1), String(h)));
    layerSel.value = String(D.layer);
    headSel.value = D.head === null ? "mean" : String(D.head);
    document.getElementById("selectors").hidden = false;
  }
  alphaIn.value = String(D.alpha);
  styleSel.value = D.style;

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

  function vrange() {  // the caption's shared scale for what is shown now
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

  function layerCanvas(m) {  // the style's RGBA layer at a working resolution of the box (heatmaps.style_layer)
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
    const range = vrange(), lo = range[0], hi = range[1], strength = +alphaIn.value, light = styleSel.value === "light";
    const layer = document.createElement("canvas");
    layer.width = w; layer.height = h;
    const lctx = layer.getContext("2d"), img = lctx.createImageData(w, h);
    for (let p = 0; p < a.length; p++) {
      const v = hi - lo > 1e-12 ? Math.min(255, Math.max(0, Math.round(255 * (a[p] - lo) / (hi - lo)))) : 0;
      if (light) {  // black, opaque where the word did not look: the photo itself where it did
        img.data[4 * p + 3] = Math.round(255 * strength * (1 - v / 255));
      } else {  // the colour map, transparent at the low end
        img.data[4 * p] = D.lut[3 * v]; img.data[4 * p + 1] = D.lut[3 * v + 1];
        img.data[4 * p + 2] = D.lut[3 * v + 2]; img.data[4 * p + 3] = Math.round(255 * strength * v / 255);
      }
    }
    lctx.putImageData(img, 0, 0);
    return layer;
  }

  function legend() {  // what the two ends of the scale look like, and what the top stands for
    const bar = document.getElementById("legend-bar"), strength = +alphaIn.value, stops = [];
    for (let k = 0; k <= 8; k++) {
      const v = Math.round(255 * k / 8);
      stops.push(styleSel.value === "light"
        ? "rgba(0,0,0," + (strength * (1 - v / 255)).toFixed(3) + ")"
        : "rgba(" + D.lut[3 * v] + "," + D.lut[3 * v + 1] + "," + D.lut[3 * v + 2] + "," + (strength * v / 255).toFixed(3) + ")");
    }
    bar.style.background = "linear-gradient(to right, " + stops.join(", ") + "), #d9d9d9";
    document.getElementById("legend-top").textContent = "most attention (" +
      (100 * vrange()[1]).toFixed(0) + "% per region)";
  }

  function describe(i, m) {  // plain words first; the figures behind them on demand
    let best = 0, br = 0, bc = 0, total = 0, entropy = 0;
    m.forEach(function (row, r) {
      row.forEach(function (v, c) { total += v; if (v > best) { best = v; br = r; bc = c; } });
    });
    if (total > 0) m.forEach(function (row) { row.forEach(function (v) {
      if (v > 0) entropy -= (v / total) * Math.log(v / total);
    }); });
    const share = total > 0 ? best / total : 0, spread = entropy / Math.log(g * g);
    const how = spread < 0.5 ? "looked mostly at one place" : spread < 0.85 ? "looked at a few places"
      : "looked all over the picture";
    document.getElementById("shown-word").textContent = "\u201c" + D.words[i] + "\u201d";
    document.getElementById("summary").textContent = "Word " + (i + 1) + " of " + D.words.length + " " + how +
      "; its strongest region holds " + (100 * share).toFixed(share >= 0.1 ? 0 : 1) + "% of its attention.";
    info.textContent = "word " + (i + 1) + "/" + D.words.length + " \u201c" + D.words[i] + "\u201d: peak " +
      (100 * share).toFixed(share >= 0.1 ? 0 : 1) + "% at row " + (br + 1) + ", column " + (bc + 1) +
      " \u00b7 H " + entropy.toFixed(1) + "/" + Math.log(g * g).toFixed(1) + " nats";
  }

  function draw(i) {
    ctx.globalAlpha = 1;
    ctx.drawImage(photo, 0, 0, canvas.width, canvas.height);
    ctx.fillStyle = "rgba(0,0,0," + (1 - D.dim) + ")";  // dim what the encoder did not see
    ctx.fillRect(0, 0, canvas.width, box[1]);
    ctx.fillRect(0, box[3], canvas.width, canvas.height - box[3]);
    ctx.fillRect(0, box[1], box[0], box[3] - box[1]);
    ctx.fillRect(box[2], box[1], canvas.width - box[2], box[3] - box[1]);
    legend();
    if (!D.words.length) { info.textContent = "empty caption"; return; }
    const m = weights(i);
    ctx.imageSmoothingEnabled = true;
    ctx.imageSmoothingQuality = "high";
    ctx.drawImage(layerCanvas(m), box[0], box[1], box[2] - box[0], box[3] - box[1]);
    describe(i, m);
  }

  function show(i, quiet) {  // draw word i and mark it: hovered, focused and pinned words look the same
    if (!D.words.length) return;
    shown = i;
    spans.forEach(function (s, k) { s.classList.toggle("active", k === i); });
    document.body.dataset.shown = String(i);
    draw(i);
    if (!quiet && window.parent !== window) window.parent.postMessage({ captioner: "word", word: D.words[i] }, "*");
  }

  function select(i) {  // pin word i (click, tap, Enter, Space, arrows)
    if (!D.words.length) return;
    current = (i + D.words.length) % D.words.length;
    spans.forEach(function (s, k) {
      s.classList.toggle("pinned", k === current); s.setAttribute("aria-pressed", String(k === current));
    });
    document.body.dataset.word = String(current);
    show(current);
  }

  const cap = document.getElementById("caption");
  D.words.forEach(function (word, i) {
    const s = document.createElement("button");
    s.type = "button"; s.className = "word"; s.textContent = word; s.id = "word-" + i;
    s.addEventListener("click", function () { select(i); });
    s.addEventListener("mouseenter", function () { show(i); });
    s.addEventListener("mouseleave", function () { show(current); });
    s.addEventListener("focus", function () { show(i); });
    s.addEventListener("blur", function () { show(current); });
    cap.appendChild(s);
    spans.push(s);
  });
  document.addEventListener("keydown", function (e) {
    if (e.target && (e.target.tagName === "SELECT" || e.target.tagName === "INPUT")) return;  // their own arrows
    const step = e.key === "ArrowRight" || e.key === "ArrowDown" ? 1 : e.key === "ArrowLeft" || e.key === "ArrowUp" ? -1 : 0;
    if (!step) return;
    const onWord = e.target && e.target.classList && e.target.classList.contains("word");
    select((onWord ? shown : current) + step);
    if (onWord) spans[current].focus();
    e.preventDefault();
  });
  [layerSel, headSel, alphaIn].forEach(function (el) { el.addEventListener("input", function () { draw(shown); }); });
  styleSel.addEventListener("change", function () {
    draw(shown);
    if (window.parent !== window) window.parent.postMessage({ captioner: "style", style: styleSel.value }, "*");
  });

  // for a page that holds several explorers: the same word in each, one style, a picture to save
  window.captionerShowWord = function (word) {
    const k = D.words.indexOf(word);
    show(k >= 0 ? k : current, true);
  };
  window.captionerSetStyle = function (style) {
    if (styleSel.value !== style) { styleSel.value = style; draw(shown); }
  };
  window.captionerSnapshot = function () {  // the map with the caption and the word under it
    const band = 56, out = document.createElement("canvas");
    out.width = canvas.width; out.height = canvas.height + band;
    const o = out.getContext("2d");
    o.fillStyle = "#fff"; o.fillRect(0, 0, out.width, out.height);
    o.drawImage(canvas, 0, 0);
    o.fillStyle = "#111"; o.font = "600 20px system-ui, sans-serif";
    o.fillText(D.words.length ? "\u201c" + D.words[shown] + "\u201d" : "(empty caption)", 8, canvas.height + 22, out.width - 16);
    o.font = "15px system-ui, sans-serif"; o.fillStyle = "#333";
    o.fillText(D.caption, 8, canvas.height + 44, out.width - 16);
    return out.toDataURL("image/png");
  };
  if (window.parent !== window) document.body.classList.add("embedded");
  function start() {
    if (D.words.length) select(D.start); else draw(0);  // an empty caption: the photo, and a line saying so
    document.body.dataset.ready = "1";
  }
  if (photo.complete && photo.naturalWidth) start(); else photo.addEventListener("load", start);
})();
"""
