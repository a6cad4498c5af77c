"""The ``captioner serve`` page: one HTML document, inline CSS and JS, nothing fetched from elsewhere.

Drop a photo anywhere on the page, choose one, or click an example; the page posts it to
``/api/caption`` and shows, under the photo's name and thumbnail, the captions (best first, each with
its score: the log-probability per word, and the caption's total) and, in an iframe that follows
its content's height, the explorer page the server rendered for it (:mod:`captioner.viz.explorer`:
it opens on the caption's first tag-word or noun; hover, focus or tap a word, or one of the photo's
tags for a model with concept detectors; a heat map or attention as light; layer and head selectors
for a Transformer). Changing the model, the beam or the number of captions, or pressing "Run again",
captions the same photo again, and the page stays where it is (no scrolling: the upload box and the
focused control stay in view). With several models, "all models" (the default) shows them side by
side: the photo once above the columns, each column's map at its full size (no photo beside it;
on a phone the columns stay side by side), the same word lit in each, and a column whose caption lacks the
word says so and shows its tag of that name or its nearest word. Buttons download the
map on show with the caption and the word under it (PNG) and the attention record (JSON). An
error is shown in one line and clears the old result; a new photo marks it as the previous one's
until its own answer arrives. A file larger than the server's limit is refused before it is sent.
The script and stylesheet (``PAGE_JS``, ``PAGE_CSS``) follow :func:`render_page` below.

The document sets ``data-state`` on ``<body>`` (``idle``, ``busy``, ``done``, ``error``), counts
answers in ``data-answers`` and the last upload-to-map time in ``data-ms``: what the browser tests
wait on and measure.
"""

from __future__ import annotations

import html
import json

from captioner.files import size_text

__all__ = ["PAGE_CSS", "PAGE_JS", "render_page"]


def render_page(models: list[dict], examples: list[str], max_beam: int, max_bytes: int) -> str:
    """The page as one HTML string.

    Args:
        models: ``[{"name", "decoder", "encoder", ...}]``, the first selected.
        examples: the examples' names (``/examples/<index>`` serves each).
        max_beam: largest beam offered.
        max_bytes: largest upload (checked in the page before sending, and by the server).
    """
    config = {"models": models, "examples": examples, "max_beam": max_beam, "max_bytes": max_bytes,
              "max_text": size_text(max_bytes)}
    payload = json.dumps(config, separators=(",", ":")).replace("<", "\\u003c")  # safe inside <script>
    names = html.escape(", ".join(m["name"] for m in models))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>captioner: {names}</title>
<link rel="icon" href="data:,">
<style>{PAGE_CSS}</style>
</head>
<body data-state="loading" data-answers="0">
<main>
<h1>Where does each word look? <small>captioner serve</small></h1>
<div class="bar">
  <div id="drop"><label for="file">Drop a photo on the page, or choose one:</label> <input type="file" id="file" accept="image/*"></div>
  <div id="examples"><span>or an example:</span></div>
</div>
<div class="bar">
  <div id="current" hidden><img id="thumb" alt="" hidden><span id="file-name"></span></div>
  <label id="model-label">model<select id="model"></select></label>
  <label>beam<select id="beam"></select></label>
  <label>captions<select id="nbest-count"></select></label>
  <button type="button" id="again" disabled>Run again</button>
</div>
<p id="error" role="alert" hidden></p>
<p id="status" aria-live="polite"></p>
<section id="result" hidden aria-label="result">
  <p id="stale-note" hidden></p>
  <div id="result-head" class="bar"><img id="result-thumb" alt="" width="40" height="40" hidden>
    <span>Result for <strong id="result-file"></strong></span></div>
  <div id="columns"></div>
</section>
</main>
<script type="application/json" id="serve-config">{payload}</script>
<script>{PAGE_JS}</script>
</body>
</html>
"""


# --- the page's stylesheet and script (embedded inline by render_page) ---
# The script keeps the last photo (its bytes, name and a thumbnail) and captions it again whenever a
# setting changes or "Run again" is pressed; a new photo marks the shown result as the old one's until
# its own answer arrives, and an error clears it. With "all models" chosen it asks every model at once
# and shows one column each; a word (or tag) hovered, focused or pinned in one column is shown in the others
# (with its map, for a column that lacks the word), and one style holds for all. The page never scrolls by
# itself: the old columns' height is kept until the new ones are drawn, so nothing jumps.

PAGE_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: .8em auto; max-width: 1360px;
       padding: 0 1em; color: #1d1d1f; background: #fafafa; }
h1 { font-size: 1.2em; margin: 0 0 .4em; font-weight: 600; }
h1 small { font-weight: 400; color: #555; }
.bar { display: flex; flex-wrap: wrap; gap: .6em 1.2em; align-items: center; margin: .3em 0 .6em; }
.bar select { margin-left: .35em; }
button, select, input { font: inherit; }
button { padding: .25em .8em; border: 1px solid #8a94a6; border-radius: 6px; background: #fff; color: #1d1d1f;
         cursor: pointer; }
button:disabled { color: #6b6b6b; cursor: default; }
:focus-visible { outline: 3px solid #e0a800; outline-offset: 2px; }
#drop { border: 2px dashed #8a94a6; border-radius: 8px; padding: .6em 1em; color: #333; background: #fff;
        flex: 1 1 320px; }
body.dragging #drop { border-color: #1f47b8; background: #eef2fb; }
#examples { display: flex; gap: .5em; flex-wrap: wrap; align-items: center; }
#examples button { padding: 0; border: 2px solid transparent; border-radius: 6px; background: none; }
#examples button:hover { border-color: #1f47b8; }
#examples img { width: 56px; height: 56px; object-fit: cover; border-radius: 4px; display: block; }
#current { display: flex; align-items: center; gap: .6em; }
#thumb { width: 56px; height: 56px; object-fit: cover; border-radius: 4px; box-shadow: 0 1px 3px #0004; }
#file-name { font-weight: 600; overflow-wrap: anywhere; }
#error { color: #8a0000; background: #fdecec; border-radius: 6px; padding: .5em .8em; }
#status { color: #444; min-height: 1.4em; margin: .2em 0; }
#result.stale .column { opacity: .4; }
#stale-note { color: #6b4e00; background: #fff4d6; border-radius: 6px; padding: .3em .8em; }
#columns { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 440px), 1fr)); gap: 1.2em; }
/* models side by side: one column each, side by side at any width (a phone too), the photo once above them */
#columns.many { grid-template-columns: repeat(var(--n, 2), minmax(0, 1fr)); gap: .8em; }
#result.many #result-thumb { width: auto; height: 120px; max-width: 100%; object-fit: contain; border-radius: 4px; }
@media (max-width: 600px) {
  body { padding: 0 .4em; }
  #columns.many { gap: .4em; }
  #result.many #result-thumb { height: 72px; }
  .column h2 .meta { display: block; margin-left: 0; }
  .downloads button { font-size: .85em; }
}
.column { min-width: 0; }
.column h2 { font-size: 1em; margin: .2em 0; font-weight: 600; }
.column .meta { color: #444; font-size: .85em; font-weight: 400; margin-left: .4em; }
.nbest { list-style: none; margin: .2em 0 .4em; padding: 0; display: flex; flex-direction: column; gap: .2em; }
.nbest button { text-align: left; width: 100%; border-color: #c5cbd6; }
.nbest button[aria-pressed="true"] { background: #dfe6f7; border-color: #1f47b8; box-shadow: inset 3px 0 #1f47b8; }
.nbest .score { color: #444; font-size: .85em; margin-left: .6em; white-space: nowrap; }
iframe { width: 100%; border: 0; min-height: 200px; background: #fafafa; display: block; }
.downloads { display: flex; flex-wrap: wrap; gap: .6em; margin: .3em 0; }
[hidden] { display: none !important; }
"""

PAGE_JS = r"""
"use strict";
(function () {
  const CFG = JSON.parse(document.getElementById("serve-config").textContent);
  const $ = function (id) { return document.getElementById(id); };
  const body = document.body, errorBox = $("error"), statusLine = $("status"), columns = $("columns");
  let last = null, run = 0, style = null, thumbUrl = null, started = 0;  // style: as the explorer opens, until chosen

  if (CFG.models.length > 1) $("model").add(new Option("all models, side by side", ""));
  CFG.models.forEach(function (m) {
    $("model").add(new Option(m.name + " (" + m.decoder + ", " + m.encoder + ")", m.name));
  });
  if (CFG.models.length < 2) $("model-label").hidden = true;
  for (let k = 1; k <= CFG.max_beam; k++) $("beam").add(new Option(String(k), String(k)));
  $("beam").value = String(Math.min(3, CFG.max_beam));
  function fillNbest() {
    const keep = +$("nbest-count").value || 1, beam = +$("beam").value;
    $("nbest-count").innerHTML = "";
    for (let k = 1; k <= beam; k++) $("nbest-count").add(new Option(String(k), String(k)));
    $("nbest-count").value = String(Math.min(keep, beam));
  }
  fillNbest();

  function setState(state) { body.dataset.state = state; }
  function answered() { body.dataset.answers = String(+(body.dataset.answers || 0) + 1); }
  function fail(message) {
    errorBox.textContent = message; errorBox.hidden = false;
    statusLine.textContent = ""; $("result").hidden = true; columns.innerHTML = "";  // no stale result under it
    columns.style.minHeight = "";
    setState("error"); answered();
  }
  function chosenModels() {
    return $("model").value ? [$("model").value] : CFG.models.map(function (m) { return m.name; });
  }
  function frames() { return Array.prototype.slice.call(columns.querySelectorAll("iframe")); }
  function stem() { return (last.name.replace(/\.[^.]*$/, "") || "image").replace(/[^A-Za-z0-9._-]+/g, "_"); }

  function save(href, filename) {
    const a = document.createElement("a"); a.href = href; a.download = filename;
    document.body.appendChild(a); a.click(); a.remove();
  }

  function column(data, many) {  // one model's answer: heading, n-best list, downloads, explorer
    const col = document.createElement("section"), frame = document.createElement("iframe");
    col.className = "column"; col.dataset.model = data.model;
    let shown = 0;
    const h = document.createElement("h2"), meta = document.createElement("span");
    h.textContent = data.model + " ";
    meta.className = "meta"; meta.textContent = "beam " + data.beam + " \u00b7 " + data.seconds.toFixed(2) + " s";
    h.appendChild(meta); col.appendChild(h);
    const list = document.createElement("ol"); list.className = "nbest";
    list.setAttribute("aria-label", data.model + ": captions, best first");
    list.hidden = data.captions.length < 2;
    data.captions.forEach(function (c, k) {
      const li = document.createElement("li"), b = document.createElement("button");
      b.type = "button"; b.className = "nbest-item"; b.id = "nbest-" + (many ? data.model + "-" : "") + k;
      b.setAttribute("aria-pressed", String(k === 0));
      const t = document.createElement("span"); t.className = "text"; t.textContent = c.text || "(empty caption)";
      const s = document.createElement("span"); s.className = "score";
      s.textContent = scoreText(c);
      s.title = "how likely the model finds this caption: the log-probability of its words and of its end, " +
        "per word and in all (0 would be certain; closer to 0 is more likely)";
      b.appendChild(t); b.appendChild(s);
      b.addEventListener("click", function () {
        shown = k;
        list.querySelectorAll("button").forEach(function (o, j) { o.setAttribute("aria-pressed", String(j === k)); });
        load(frame, c.explorer, false);
      });
      li.appendChild(b); list.appendChild(li);
    });
    col.appendChild(list);
    const dl = document.createElement("div"); dl.className = "downloads";
    const png = document.createElement("button"), json = document.createElement("button");
    png.type = json.type = "button"; png.className = "download-png"; json.className = "download-json";
    png.textContent = "Download this map (PNG)"; json.textContent = "Download attention (JSON)";
    png.addEventListener("click", function () {
      const w = frame.contentWindow;
      if (!w || !w.captionerSnapshot) return;
      const item = frame.contentDocument.body.dataset.shown || "0", tag = /^tag-(\d+)$/.exec(item);
      const what = tag ? "_tag" + (+tag[1] + 1) : "_word" + (+item + 1);  // a word of the caption or a tag of the photo
      save(w.captionerSnapshot(), stem() + "_" + data.model + "_caption" + (shown + 1) + what + ".png");
    });
    json.addEventListener("click", function () {
      const c = data.captions[shown];
      const record = Object.assign({ model: data.model, file: data.file, score: c.score }, c.record);
      const url = URL.createObjectURL(new Blob([JSON.stringify(record)], { type: "application/json" }));
      save(url, stem() + "_" + data.model + "_caption" + (shown + 1) + "_attention.json");
      setTimeout(function () { URL.revokeObjectURL(url); }, 1000);
    });
    dl.appendChild(png); dl.appendChild(json);
    frame.title = data.model + ": where each word looked";
    col.appendChild(frame); col.appendChild(dl);
    return { element: col, frame: frame, first: data.captions[0].explorer };
  }

  function scoreText(c) {  // the search's score is the caption's log-probability (its words and its end)
    const tokens = c.words.length + (c.finished ? 1 : 0), per = tokens ? c.score / tokens : c.score;
    return "log-probability " + per.toFixed(2) + " per word \u00b7 " + c.score.toFixed(2) + " in all";
  }
  function fit(frame) {  // the frame as high as what it holds: it grows and shrinks with the window
    const doc = frame.contentDocument;
    if (doc && doc.body) frame.style.height = Math.ceil(doc.body.getBoundingClientRect().height + 12) + "px";
  }
  function load(frame, html, counted) {
    frame.onload = function () {
      const w = frame.contentWindow, doc = frame.contentDocument;
      if (doc && doc.body) doc.body.classList.toggle("compare", columns.classList.contains("many"));
      if (w && w.captionerSetStyle && style) w.captionerSetStyle(style);
      fit(frame); setTimeout(function () { fit(frame); }, 50);
      if (w && w.ResizeObserver && doc && doc.body) new w.ResizeObserver(function () { fit(frame); }).observe(doc.body);
      if (counted) counted();
      else { setState("done"); answered(); }
    };
    frame.srcdoc = html;
  }


  async function ask(model, form) {
    form.set("model", model);
    let response, data;
    try {
      response = await fetch("/api/caption", { method: "POST", body: form });
    } catch (e) { return { error: "the server could not be reached (" + e + ")" }; }
    try { data = await response.json(); } catch (e) { data = { error: "the server answered " + response.status }; }
    if (!response.ok || data.error) return { error: data.error || ("the server answered " + response.status) };
    return data;
  }

  async function send() {
    if (!last) return;
    const mine = ++run, models = chosenModels();
    errorBox.hidden = true;
    if (last.blob.size > CFG.max_bytes) {
      fail(last.name + ": too large (" + (last.blob.size / 1048576).toFixed(1) + " MiB; the limit is " +
           CFG.max_text + ")");
      return;
    }
    setState("busy"); started = performance.now();
    $("again").disabled = false;
    statusLine.textContent = "captioning " + last.name + "\u2026";
    if (!$("result").hidden && $("result").dataset.file !== last.name + "#" + last.serial) {
      $("result").classList.add("stale");
      $("stale-note").textContent = "Below: the previous photo, " + $("result").dataset.name + ", until this one is done.";
      $("stale-note").hidden = false;
    }
    const form = new FormData();
    form.append("image", last.blob, last.name);
    form.append("beam", $("beam").value);
    form.append("n_best", $("nbest-count").value);
    const answers = await Promise.all(models.map(function (m) {
      const f = new FormData(); form.forEach(function (v, k) { f.append(k, v); }); return ask(m, f);
    }));
    if (mine !== run) return;  // a newer request owns the page
    const bad = answers.filter(function (a) { return a.error; });
    if (bad.length) { fail(bad[0].error); return; }
    if (!$("result").hidden) columns.style.minHeight = columns.offsetHeight + "px";  // no jump while redrawn
    columns.innerHTML = "";
    $("result").classList.remove("stale"); $("stale-note").hidden = true;
    $("result").dataset.file = last.name + "#" + last.serial; $("result").dataset.name = last.name;
    $("result-file").textContent = last.name;
    $("result-thumb").src = thumbUrl; $("result-thumb").alt = many(answers) ? "the photo: " + last.name : "";
    $("result").hidden = false;
    const several = many(answers);
    $("result").classList.toggle("many", several); columns.classList.toggle("many", several);
    columns.style.setProperty("--n", String(answers.length));
    const built = answers.map(function (a) { return column(a, several); });
    let loaded = 0;
    built.forEach(function (b) {
      columns.appendChild(b.element);
      load(b.frame, b.first, function () {
        if (++loaded < built.length || mine !== run) return;
        const ms = performance.now() - started;
        body.dataset.ms = ms.toFixed(0);
        statusLine.textContent = last.name + ": " + models.length + (models.length > 1 ? " models" : " model") +
          " \u00b7 " + (ms / 1000).toFixed(2) + " s from upload to map";
        columns.style.minHeight = "";
        setState("done"); answered();
      });
    });
  }

  function many(answers) { return answers.length > 1; }
  ["thumb", "result-thumb"].forEach(function (id) {  // a file that is no picture shows no broken image
    $(id).addEventListener("load", function () { $(id).hidden = false; });
    $(id).addEventListener("error", function () { $(id).hidden = true; });
  });

  let serial = 0;
  function choose(blob, name) {
    if (thumbUrl) URL.revokeObjectURL(thumbUrl);
    thumbUrl = URL.createObjectURL(blob);
    last = { blob: blob, name: name, serial: ++serial };
    $("thumb").hidden = true;
    $("thumb").src = thumbUrl; $("thumb").alt = "the photo being captioned: " + name;
    $("file-name").textContent = name; $("current").hidden = false;
    send();
  }

  window.addEventListener("message", function (e) {  // one explorer's word or style, shown in the others
    const msg = e.data || {};
    const ours = frames().some(function (f) { return f.contentWindow === e.source; });
    if (!ours) return;
    if (msg.captioner === "drop" && msg.file instanceof Blob) { choose(msg.file, msg.file.name || "photo"); return; }
    frames().forEach(function (f) {
      const w = f.contentWindow;
      if (!w || w === e.source) return;
      if (msg.captioner === "word" && w.captionerShowWord) w.captionerShowWord(msg.word, msg.kind, msg.map);
      if (msg.captioner === "style" && w.captionerSetStyle) w.captionerSetStyle(msg.style);
    });
    if (msg.captioner === "style") style = msg.style;
  });
  window.addEventListener("resize", function () { frames().forEach(fit); });

  $("beam").addEventListener("change", function () { fillNbest(); send(); });
  $("nbest-count").addEventListener("change", send);
  $("model").addEventListener("change", send);
  $("again").addEventListener("click", send);
  $("file").addEventListener("change", function () {
    if (this.files.length) choose(this.files[0], this.files[0].name);
  });
  // a photo dropped anywhere on the page is captioned (not opened by the browser in place of the page)
  let dragDepth = 0;
  document.addEventListener("dragenter", function (e) {
    e.preventDefault(); dragDepth++; body.classList.add("dragging");
  });
  document.addEventListener("dragover", function (e) { e.preventDefault(); });
  document.addEventListener("dragleave", function () {
    if (--dragDepth <= 0) { dragDepth = 0; body.classList.remove("dragging"); }
  });
  document.addEventListener("drop", function (e) {
    e.preventDefault(); dragDepth = 0; body.classList.remove("dragging");
    const files = e.dataTransfer && e.dataTransfer.files;
    if (files && files.length) choose(files[0], files[0].name);
  });
  CFG.examples.forEach(function (name, i) {
    const b = document.createElement("button"), img = document.createElement("img");
    b.type = "button"; b.id = "example-" + i; b.title = name; b.setAttribute("aria-label", "example: " + name);
    img.src = "/examples/" + i; img.alt = "";
    b.appendChild(img);
    b.addEventListener("click", async function () {
      const r = await fetch("/examples/" + i);
      const png = r.headers.get("content-type") === "image/png";
      choose(await r.blob(), name.replace(/\s+/g, "_") + (png ? ".png" : ".jpg"));
    });
    $("examples").appendChild(b);
  });
  if (!CFG.examples.length) $("examples").hidden = true;
  setState("idle");
})();
"""
