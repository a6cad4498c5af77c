
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
  canvas.style.setProperty && canvas.style.setProperty("--aspect", String(canvas.width / canvas.height));
  const sx = canvas.width / D.image_size[0], sy = canvas.height / D.image_size[1];
  const box = [D.box[0] * sx, D.box[1] * sy, D.box[2] * sx, D.box[3] * sy];
  // what can be shown: the caption's words (0 .. L-1), then the photo's tags and labels, the chips (L .. L+C-1):
  // chips[j] is {kind, word, prob, map, k: its place in its row, first: the row's first chip, n: the row's length}
  const chips = [];
  [["tag", D.concepts, D.concept_maps], ["label", D.labels, D.label_maps]].forEach(function (row) {
    (row[1] || []).forEach(function (c, k) {
      chips.push({ kind: row[0], word: c.word, prob: c.prob, map: row[2][k], k: k, first: chips.length - k,
                   n: row[1].length });
    });
  });
  const L = D.words.length, C = chips.length, spans = [], buttons = [];
  let current = 0, shown = 0, over = -1;  // the pinned item | the item drawn now (hovered, focused or pinned); -1:
                                          // none | the item the pointer moved onto

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

  function isChip(i) { return i >= L; }
  function label(i) {  // what the item is called, large above the map and under a saved picture
    if (!isChip(i)) return "\u201c" + D.words[i] + "\u201d";
    const c = chips[i - L];
    return c.kind + ": " + c.word + " " + c.prob.toFixed(2);
  }

  function weights(i) {  // the g x g map shown for item i
    if (isChip(i)) return chips[i - L].map;
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

  function layerCanvas(m, side, bx) {  // the style's RGBA layer at a working resolution (at most side px) of the
    bx = bx || box;                      // box (heatmaps.style_layer)
    const bw = bx[2] - bx[0], bh = bx[3] - bx[1];
    const f = Math.min(1, (side || 240) / Math.max(bw, bh));
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
    let top = D.floor;  // the map's own scale: 0 to its peak (heatmaps.word_scale)
    for (let p = 0; p < a.length; p++) if (a[p] > top) top = a[p];
    const lo = 0, hi = top, strength = +alphaIn.value, light = styleSel.value === "light";
    const layer = document.createElement("canvas");
    layer.width = w; layer.height = h;
    const lctx = layer.getContext("2d"), img = lctx.createImageData(w, h);
    for (let p = 0; p < a.length; p++) {
      const v = hi - lo > 1e-12 ? Math.min(255, Math.max(0, Math.round(255 * (a[p] - lo) / (hi - lo)))) : 0;
      if (light) {  // black, opaque where the word did not look: the photo itself where it did
        img.data[4 * p + 3] = Math.round(255 * strength * (1 - v / 255));
      } else {  // the colour map, transparent at the low end, over black that darkens the rest a little
        const rgba = heat(v, strength);
        img.data[4 * p] = rgba[0]; img.data[4 * p + 1] = rgba[1]; img.data[4 * p + 2] = rgba[2];
        img.data[4 * p + 3] = Math.round(255 * rgba[3]);
      }
    }
    lctx.putImageData(img, 0, 0);
    if (light) layer.lit = litLayer(a, w, h, lo, hi, strength);
    return layer;
  }

  // "attention as light" on a dark photo: where the word looked, the photo is also lit up (its brightness raised
  // towards a mid grey), so the peak can be seen however dark the photo is; elsewhere it is only darkened
  let gain = null;
  function photoGain() {  // how much a photo this dark is brightened where the word looked (1: not at all)
    if (gain !== null) return gain;
    gain = 1;
    const probe = document.createElement("canvas");
    probe.width = probe.height = 32;
    const p = probe.getContext("2d");
    if (!p || !p.getImageData) return gain;
    try {
      p.drawImage(photo, 0, 0, 32, 32);
      const px = p.getImageData(0, 0, 32, 32).data;
      let sum = 0;
      for (let k = 0; k < px.length; k += 4) sum += 0.299 * px[k] + 0.587 * px[k + 1] + 0.114 * px[k + 2];
      gain = Math.min(D.lit_max, Math.max(1, D.lit_target * 255 / Math.max(1, sum / (px.length / 4))));  // light_gain
    } catch (e) { gain = 1; }
    return gain;
  }
  function litLayer(a, w, h, lo, hi, strength) {  // the lit photo's mask: opaque where the word looked most
    if (photoGain() < 1.05) return null;  // as heatmaps.overlay_heatmap: not for a photo that is bright enough
    const mask = document.createElement("canvas");
    mask.width = w; mask.height = h;
    const mctx = mask.getContext("2d"), img = mctx.createImageData(w, h);
    for (let p = 0; p < a.length; p++) {
      const v = hi - lo > 1e-12 ? Math.min(1, Math.max(0, (a[p] - lo) / (hi - lo))) : 0;
      img.data[4 * p + 3] = Math.round(255 * strength * v * v);
    }
    mctx.putImageData(img, 0, 0);
    return mask;
  }
  function drawLit(target, mask, bx) {  // the photo brightened by photoGain, through the mask, over the box
    const lit = document.createElement("canvas");
    lit.width = target.canvas.width; lit.height = target.canvas.height;
    const l = lit.getContext("2d");
    l.filter = "brightness(" + photoGain().toFixed(2) + ")";
    l.drawImage(photo, 0, 0, lit.width, lit.height);
    l.filter = "none";
    l.globalCompositeOperation = "destination-in";
    l.imageSmoothingEnabled = true;
    l.drawImage(mask, bx[0], bx[1], bx[2] - bx[0], bx[3] - bx[1]);
    l.globalCompositeOperation = "source-over";
    target.drawImage(lit, 0, 0);
  }

  function heat(v, strength) {  // heatmaps.style_layer "heat" at level v (0..255): [r, g, b, opacity 0..1]
    const paint = strength * (v / 255) * (v / 255), dark = D.heat_dim * strength * (1 - v / 255);
    const o = 1 - (1 - paint) * (1 - dark), k = o > 0 ? paint / o : 0;
    return [Math.round(D.lut[3 * v] * k), Math.round(D.lut[3 * v + 1] * k), Math.round(D.lut[3 * v + 2] * k), o];
  }

  function legend(pct) {  // what the two ends of the scale look like; the top is the map's strongest region
    const bar = document.getElementById("legend-bar"), strength = +alphaIn.value, stops = [];
    for (let k = 0; k <= 8; k++) {
      const v = Math.round(255 * k / 8), rgba = styleSel.value === "light" ? [0, 0, 0, strength * (1 - v / 255)]
        : heat(v, strength);
      stops.push("rgba(" + rgba[0] + "," + rgba[1] + "," + rgba[2] + "," + rgba[3].toFixed(3) + ")");
    }
    bar.style.background = "linear-gradient(to right, " + stops.join(", ") + "), #d9d9d9";
    document.getElementById("legend-top").textContent = pct === null ? "strongest region"
      : "strongest region, " + pct + "%";
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
    const pct = (100 * share).toFixed(share >= 0.1 ? 0 : 1);
    legend(pct);
    const figures = ": peak " + pct + "% at row " + (br + 1) + ", column " + (bc + 1) +
      " \u00b7 H " + entropy.toFixed(1) + "/" + Math.log(g * g).toFixed(1) + " nats";
    document.getElementById("shown-word").textContent = label(i);
    if (isChip(i)) {
      const t = chips[i - L], where = spread < 0.5 ? "lies mostly in one place" : spread < 0.85
        ? "lies in a few places" : "is spread all over the picture";
      document.getElementById("summary").textContent = "The " + t.kind + " \u201c" + t.word + "\u201d (probability " +
        t.prob.toFixed(2) + ") " + where + "; its strongest region holds " + pct + "% of its map.";
      info.textContent = t.kind + " " + (t.k + 1) + "/" + t.n + " \u201c" + t.word + "\u201d" + figures;
      return;
    }
    const how = spread < 0.5 ? "looked mostly at one place" : spread < 0.85 ? "looked at a few places"
      : "looked all over the picture";
    document.getElementById("summary").textContent = "Word " + (i + 1) + " of " + L + " " + how +
      "; its strongest region holds " + pct + "% of its attention.";
    info.textContent = "word " + (i + 1) + "/" + L + " \u201c" + D.words[i] + "\u201d" + figures;
  }

  function paint(target, w, h, bx, m, side) {  // the photo, dimmed outside the box, and map m's layer over it
    target.globalAlpha = 1;
    target.drawImage(photo, 0, 0, w, h);
    target.fillStyle = "rgba(0,0,0," + (1 - D.dim) + ")";  // dim what the encoder did not see
    target.fillRect(0, 0, w, bx[1]);
    target.fillRect(0, bx[3], w, h - bx[3]);
    target.fillRect(0, bx[1], bx[0], bx[3] - bx[1]);
    target.fillRect(bx[2], bx[1], w - bx[2], bx[3] - bx[1]);
    if (!m) return;
    target.imageSmoothingEnabled = true;
    target.imageSmoothingQuality = "high";
    const layer = layerCanvas(m, side, bx);
    target.drawImage(layer, bx[0], bx[1], bx[2] - bx[0], bx[3] - bx[1]);
    if (layer.lit) drawLit(target, layer.lit, bx);
  }

  const bare = document.getElementById("bare");
  let bareOn = false;  // the photo without the map
  function draw(i) {
    const none = i < 0 || i >= L + C;
    paint(ctx, canvas.width, canvas.height, box, none || bareOn ? null : weights(i));
    if (none) { legend(null); info.textContent = "empty caption"; return; }
    describe(i, weights(i));
  }

  function drawMinis() {  // the strip: each word's map, small, in the style and strength chosen
    spans.forEach(function (s, i) {
      const mini = s.firstChild;
      if (!mini || !mini.getContext) return;
      const c = mini.getContext("2d"), f = mini.width / canvas.width;
      paint(c, mini.width, mini.height, [box[0] * f, box[1] * f, box[2] * f, box[3] * f], weights(i), 48);
    });
  }

  function id(i) { return isChip(i) ? chips[i - L].kind + "-" + chips[i - L].k : String(i); }  // "3", "tag-0", "label-1"

  const missing = document.getElementById("missing");
  function show(i, quiet, note) {  // draw item i and mark it: hovered, focused and pinned items look the same
    shown = i;
    missing.textContent = note || ""; missing.hidden = !note;
    buttons.forEach(function (s, k) { s.classList.toggle("active", k === i); });
    document.body.dataset.shown = i < 0 ? "" : id(i);
    draw(i);
    if (!quiet && i >= 0 && window.parent !== window) {
      window.parent.postMessage({ captioner: "word", kind: isChip(i) ? chips[i - L].kind : "word",
                                  word: isChip(i) ? chips[i - L].word : D.words[i], map: weights(i) }, "*");
    }
  }

  function follow(i) {  // the strip scrolls to keep word i in view (playing, stepping, focused), not the page
    if (i < 0 || i >= L) return;
    const r = spans[i].getBoundingClientRect(), c = cap.getBoundingClientRect(), edge = 40;  // clear of the fade
    if (r.left < c.left + edge) cap.scrollLeft -= c.left + edge - r.left;
    else if (r.right > c.right - edge) cap.scrollLeft += r.right - (c.right - edge);
  }
  function cue() {  // the strip's faded ends say there is more of it to scroll to
    cap.classList.toggle("more-left", cap.scrollLeft > 1);
    cap.classList.toggle("more-right", cap.scrollLeft + cap.clientWidth < cap.scrollWidth - 1);
  }

  function select(i, quiet) {  // pin item i (click, tap, Enter, Space, arrows)
    current = i;
    buttons.forEach(function (s, k) {
      s.classList.toggle("pinned", k === current); s.setAttribute("aria-pressed", String(k === current));
    });
    if (i < L) spans.forEach(function (s, k) { s.tabIndex = k === i ? 0 : -1; });  // the strip: one Tab stop
    document.body.dataset.word = id(current);
    show(current, quiet);
    follow(current);
  }

  function bind(s, i) {  // hover, focus, tap and keys: the same for a word and a tag
    s.addEventListener("click", function () { select(i); });
    s.addEventListener("mousemove", function () {  // a pointer that moves onto it: a caption loaded under a
      if (over !== i) { over = i; show(i); }       // still pointer gets only mouseover/mouseenter, keeps its word
    });
    s.addEventListener("mouseleave", function () { over = -1; show(current); });
    s.addEventListener("focus", function () { show(i); follow(i); });
    s.addEventListener("blur", function () { show(current); });
    buttons.push(s);
  }

  const cap = document.getElementById("caption");
  cap.addEventListener("scroll", cue, { passive: true });
  window.addEventListener("resize", cue);
  const miniH = 88, miniW = Math.max(1, Math.round(miniH * canvas.width / canvas.height));
  D.words.forEach(function (word, i) {
    const s = document.createElement("button"), mini = document.createElement("canvas");
    const text = document.createElement("span");
    s.type = "button"; s.className = "word"; s.id = "word-" + i; s.tabIndex = -1;
    mini.className = "mini"; mini.width = miniW; mini.height = miniH;
    mini.setAttribute("aria-hidden", "true");
    text.textContent = word;
    s.appendChild(mini); s.appendChild(text);
    bind(s, i);
    cap.appendChild(s);
    spans.push(s);
  });
  chips.forEach(function (c, j) { bind(document.getElementById(c.kind + "-" + c.k), L + j); });  // in the page
  document.addEventListener("keydown", function (e) {
    if (e.target && (e.target.tagName === "SELECT" || e.target.tagName === "INPUT")) return;  // their own arrows
    const ends = e.key === "Home" || e.key === "End";
    const step = e.key === "ArrowRight" || e.key === "ArrowDown" ? 1 : e.key === "ArrowLeft" || e.key === "ArrowUp" ? -1 : 0;
    const list = e.target && e.target.classList;
    const onItem = list && (list.contains("word") || list.contains("chip"));
    if (!step && !(ends && onItem)) return;
    stop();
    const from = onItem ? shown : current;  // step through the words, or through a chip's row from a chip
    if (from < 0) return;
    const lo = isChip(from) ? L + chips[from - L].first : 0, n = isChip(from) ? chips[from - L].n : L;
    select(ends ? lo + (e.key === "Home" ? 0 : n - 1) : lo + ((from - lo + step) % n + n) % n);
    if (onItem) buttons[current].focus();
    e.preventDefault();
  });
  [layerSel, headSel, alphaIn].forEach(function (el) {
    el.addEventListener("input", function () { draw(shown); });
    el.addEventListener("change", function () { draw(shown); drawMinis(); });
  });
  alphaIn.addEventListener("change", function () {  // the page keeps the strength for the next answer
    if (window.parent !== window) window.parent.postMessage({ captioner: "strength", value: +alphaIn.value }, "*");
  });
  styleSel.addEventListener("change", function () {
    draw(shown); drawMinis();
    if (window.parent !== window) window.parent.postMessage({ captioner: "style", style: styleSel.value }, "*");
  });
  bare.addEventListener("click", function () {  // the photo as it is, without the map, and back
    bareOn = !bareOn;
    bare.setAttribute("aria-pressed", String(bareOn));
    draw(shown);
  });
  // Play: each word in turn, as the GIF shows them; any other choice stops it
  const play = document.getElementById("play");
  let timer = null;
  function stop() {
    if (timer === null) return;
    clearInterval(timer); timer = null;
    play.setAttribute("aria-pressed", "false"); play.textContent = "\u25b6 Play";
    document.body.dataset.playing = "";
  }
  play.addEventListener("click", function () {
    if (timer !== null) { stop(); return; }
    if (!L) return;
    let k = 0;
    play.setAttribute("aria-pressed", "true"); play.textContent = "\u275a\u275a Pause";
    document.body.dataset.playing = "1";
    select(0);
    timer = setInterval(function () {
      if (++k >= L) { stop(); return; }
      select(k);
    }, D.play_ms || 900);
  });
  cap.addEventListener("click", function () { stop(); });

  // for a page that holds several explorers: the same word in each, one style, a picture to save
  function overlap(a, b) {  // heatmaps.map_overlap: histogram intersection of two maps, each summing to 1
    let sa = 0, sb = 0, s = 0;
    a.forEach(function (row) { row.forEach(function (v) { sa += v; }); });
    b.forEach(function (row) { row.forEach(function (v) { sb += v; }); });
    if (!(sa > 0 && sb > 0)) return 0;
    a.forEach(function (row, r) { row.forEach(function (v, c) { s += Math.min(v / sa, b[r][c] / sb); }); });
    return s;
  }
  function regrid(map, rows, cols) {  // another model's map on this grid: each of its cells shared out by overlap
    const m = map.length, n = map[0].length;
    if (m === rows && n === cols) return map;
    const out = [];
    for (let r = 0; r < rows; r++) out.push(new Array(cols).fill(0));
    for (let i = 0; i < m; i++) for (let j = 0; j < n; j++) {
      const r0 = i * rows / m, r1 = (i + 1) * rows / m, c0 = j * cols / n, c1 = (j + 1) * cols / n;
      for (let r = Math.floor(r0); r < Math.min(rows, Math.ceil(r1)); r++)
        for (let c = Math.floor(c0); c < Math.min(cols, Math.ceil(c1)); c++)
          out[r][c] += map[i][j] * (Math.min(r1, r + 1) - Math.max(r0, r)) * (Math.min(c1, c + 1) - Math.max(c0, c));
    }
    return out;
  }
  function find(kind, word) {  // the item of that kind and name (a word of the caption, a tag, a label), or -1
    if (kind === "word") return D.words.indexOf(word);
    for (let j = 0; j < C; j++) if (chips[j].kind === kind && chips[j].word === word) return L + j;
    return -1;
  }
  window.captionerShowWord = function (word, kind, map) {  // kind "tag" or "label": a chip of the photo, else a word
    kind = kind === "tag" || kind === "label" ? kind : "word";
    if (find(kind, word) >= 0) { show(find(kind, word), true); return; }
    const where = kind === "word" ? "in this caption" : "among this photo's " + kind + "s";
    const others = { word: ["tag", "label"], tag: ["word", "label"], label: ["word", "tag"] }[kind];
    for (let o = 0; o < others.length; o++) if (find(others[o], word) >= 0) {  // the same name, of another kind
      show(find(others[o], word), true, "No \u201c" + word + "\u201d " + where + ": its " + others[o] + " instead.");
      return;
    }
    let best = -1, most = -1;  // else the caption's word whose map is most like the one shown beside
    const mine = map && map.length && map[0].length ? regrid(map, g, L ? weights(0)[0].length : g) : null;
    if (mine) for (let j = 0; j < L; j++) {
      const o = overlap(weights(j), mine);
      if (o > most) { most = o; best = j; }
    }
    if (best < 0) { show(current, true, "No \u201c" + word + "\u201d " + where + "."); return; }
    show(best, true, "No \u201c" + word + "\u201d " + where +
      ": its nearest word, the one that looked most alike (" + (100 * most).toFixed(0) + "% overlap).");
  };
  window.captionerSetStyle = function (style) {
    if (styleSel.value !== style) { styleSel.value = style; draw(shown); drawMinis(); }
  };
  window.captionerSetStrength = function (value) {
    if (+alphaIn.value !== +value) { alphaIn.value = String(value); draw(shown); drawMinis(); }
  };
  window.captionerSnapshot = function () {  // the map with the caption and the word under it
    const band = 56, out = document.createElement("canvas");
    out.width = canvas.width; out.height = canvas.height + band;
    const o = out.getContext("2d");
    o.fillStyle = "#fff"; o.fillRect(0, 0, out.width, out.height);
    o.drawImage(canvas, 0, 0);
    o.fillStyle = "#111"; o.font = "600 20px system-ui, sans-serif";
    o.fillText(shown >= 0 && shown < L + C ? label(shown) : "(empty caption)", 8, canvas.height + 22, out.width - 16);
    o.font = "15px system-ui, sans-serif"; o.fillStyle = "#333";
    o.fillText(D.caption, 8, canvas.height + 44, out.width - 16);
    return out.toDataURL("image/png");
  };
  if (window.parent !== window) {
    document.body.classList.add("embedded");
    ["dragenter", "dragover"].forEach(function (t) {  // a photo dropped here is the page's to caption
      document.addEventListener(t, function (e) { e.preventDefault(); });
    });
    document.addEventListener("drop", function (e) {
      e.preventDefault();
      const files = e.dataTransfer && e.dataTransfer.files;
      if (files && files.length) window.parent.postMessage({ captioner: "drop", file: files[0] }, "*");
    });
  }
  function start() {
    if (L) select(D.start, true); else { current = -1; show(-1, true); }  // an empty caption: the photo, and a line saying so
    drawMinis();
    cue();
    document.body.dataset.ready = "1";
  }
  if (photo.complete && photo.naturalWidth) start(); else photo.addEventListener("load", start);
})();
