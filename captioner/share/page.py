"""The ``captioner serve`` page: one HTML document, inline CSS and JS, nothing fetched from elsewhere.

Drop a photo on the page, choose one, or click an example; the page posts it to ``/api/caption``
and shows the best caption, the n-best list (click one to see its attention) and, in an iframe,
the explorer page the server rendered for that caption (hover or click a word; layer and head
selectors for a Transformer). Buttons download the overlay on show (PNG, from the explorer's
canvas) and the attention record (JSON). Errors from the server are shown in one line above.
A file larger than the server's limit is refused here before it is sent.

The document sets ``data-state`` on ``<body>`` (``idle``, ``busy``, ``done``, ``error``) and
counts answers in ``data-answers``: what the browser tests wait on.
"""

from __future__ import annotations

import html
import json

from captioner.files import size_text

__all__ = ["render_page"]

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1em auto; max-width: 1040px;
       padding: 0 1em; color: #1d1d1f; background: #fafafa; }
h1 { font-size: 1.2em; margin: 0 0 .5em; font-weight: 600; }
.controls { display: flex; flex-wrap: wrap; gap: 1em; align-items: center; margin: .4em 0 .8em; }
.controls select { margin-left: .35em; }
#drop { border: 2px dashed #9aa5b8; border-radius: 8px; padding: 1em; text-align: center; color: #445;
        background: #fff; }
#drop.over { border-color: #2853c7; background: #eef2fb; }
#examples { display: flex; gap: .6em; margin: .6em 0; flex-wrap: wrap; align-items: center; }
#examples button { padding: 0; border: 2px solid transparent; border-radius: 6px; background: none; cursor: pointer; }
#examples button:hover { border-color: #2853c7; }
#examples img { width: 72px; height: 72px; object-fit: cover; border-radius: 4px; display: block; }
#error { color: #a00; background: #fdecec; border-radius: 6px; padding: .5em .8em; }
#status { color: #555; min-height: 1.4em; }
#best { font-size: 1.35em; margin: .3em 0; }
#nbest { margin: .2em 0 .6em; padding-left: 1.6em; }
#nbest li { cursor: pointer; padding: .1em .3em; border-radius: 4px; }
#nbest li.active { background: #dfe6f7; box-shadow: inset 3px 0 #2853c7; }
#nbest .score { color: #777; font-size: .85em; margin-left: .6em; }
iframe { width: 100%; border: 0; min-height: 420px; background: #fafafa; }
.downloads { display: flex; gap: .8em; margin: .4em 0; }
[hidden] { display: none !important; }
"""

_JS = r"""
"use strict";
(function () {
  const CFG = JSON.parse(document.getElementById("serve-config").textContent);
  const $ = function (id) { return document.getElementById(id); };
  const body = document.body, frame = $("explorer"), errorBox = $("error"), statusLine = $("status");
  let answer = null, shown = 0, stem = "image";

  CFG.models.forEach(function (m) {
    $("model").add(new Option(m.name + " (" + m.decoder + ", " + m.encoder + ")", m.name));
  });
  if (CFG.models.length < 2) $("model-label").hidden = true;
  for (let k = 1; k <= CFG.max_beam; k++) $("beam").add(new Option(String(k), String(k)));
  $("beam").value = String(Math.min(3, CFG.max_beam));
  function fillNbest() {
    const keep = +$("nbest-count").value || 3, beam = +$("beam").value;
    $("nbest-count").innerHTML = "";
    for (let k = 1; k <= beam; k++) $("nbest-count").add(new Option(String(k), String(k)));
    $("nbest-count").value = String(Math.min(keep, beam));
  }
  fillNbest();
  $("beam").addEventListener("change", fillNbest);

  function setState(state) { body.dataset.state = state; }
  function fail(message) {
    errorBox.textContent = message; errorBox.hidden = false; statusLine.textContent = ""; setState("error");
    body.dataset.answers = String(+(body.dataset.answers || 0) + 1);
  }

  function show(i) {
    shown = i;
    const c = answer.captions[i];
    $("best").textContent = c.text || "(empty caption)";
    Array.prototype.forEach.call($("nbest").children, function (li, k) { li.classList.toggle("active", k === i); });
    frame.srcdoc = c.explorer;
  }

  frame.addEventListener("load", function () {
    if (!answer) return;
    const doc = frame.contentDocument;
    function fit() { frame.style.height = (doc.documentElement.scrollHeight + 8) + "px"; }
    fit(); setTimeout(fit, 50);
    setState("done");
    body.dataset.answers = String(+(body.dataset.answers || 0) + 1);
  });

  async function send(blob, name) {
    errorBox.hidden = true;
    if (blob.size > CFG.max_bytes) {
      fail(name + ": too large (" + (blob.size / 1048576).toFixed(1) + " MiB; the limit is " + CFG.max_text + ")");
      return;
    }
    setState("busy");
    statusLine.textContent = "captioning " + name + "\u2026";
    stem = (name.replace(/\.[^.]*$/, "") || "image").replace(/[^A-Za-z0-9._-]+/g, "_");
    const form = new FormData();
    form.append("image", blob, name);
    form.append("model", $("model").value);
    form.append("beam", $("beam").value);
    form.append("n_best", $("nbest-count").value);
    let response, data;
    try {
      response = await fetch("/api/caption", { method: "POST", body: form });
    } catch (e) { fail("the server could not be reached (" + e + ")"); return; }
    try { data = await response.json(); } catch (e) { data = { error: "the server answered " + response.status }; }
    if (!response.ok || data.error) { fail(data.error || ("the server answered " + response.status)); return; }
    answer = data;
    statusLine.textContent = data.model + " \u00b7 beam " + data.beam + " \u00b7 " + data.seconds.toFixed(2) + " s";
    const list = $("nbest");
    list.innerHTML = "";
    data.captions.forEach(function (c, k) {
      const li = document.createElement("li");
      li.id = "nbest-" + k;
      const t = document.createElement("span"); t.className = "text"; t.textContent = c.text || "(empty caption)";
      const s = document.createElement("span"); s.className = "score"; s.textContent = c.score.toFixed(3);
      li.appendChild(t); li.appendChild(s);
      li.addEventListener("click", function () { show(k); });
      list.appendChild(li);
    });
    $("result").hidden = false;
    show(0);
  }

  function save(href, filename) {
    const a = document.createElement("a"); a.href = href; a.download = filename;
    document.body.appendChild(a); a.click(); a.remove();
  }
  $("download-png").addEventListener("click", function () {
    const canvas = frame.contentDocument && frame.contentDocument.getElementById("view");
    if (!canvas) return;
    const word = frame.contentDocument.body.dataset.word || "0";
    save(canvas.toDataURL("image/png"), stem + "_caption" + (shown + 1) + "_word" + (+word + 1) + ".png");
  });
  $("download-json").addEventListener("click", function () {
    const c = answer.captions[shown];
    const record = Object.assign({ model: answer.model, file: answer.file, score: c.score }, c.record);
    const url = URL.createObjectURL(new Blob([JSON.stringify(record)], { type: "application/json" }));
    save(url, stem + "_caption" + (shown + 1) + "_attention.json");
    setTimeout(function () { URL.revokeObjectURL(url); }, 1000);
  });

  $("file").addEventListener("change", function () {
    if (this.files.length) send(this.files[0], this.files[0].name);
    this.value = "";
  });
  const drop = $("drop");
  ["dragenter", "dragover"].forEach(function (t) {
    drop.addEventListener(t, function (e) { e.preventDefault(); drop.classList.add("over"); });
  });
  ["dragleave", "drop"].forEach(function (t) {
    drop.addEventListener(t, function () { drop.classList.remove("over"); });
  });
  drop.addEventListener("drop", function (e) {
    e.preventDefault();
    if (e.dataTransfer.files.length) send(e.dataTransfer.files[0], e.dataTransfer.files[0].name);
  });
  CFG.examples.forEach(function (name, i) {
    const b = document.createElement("button"), img = document.createElement("img");
    b.type = "button"; b.id = "example-" + i; b.title = name;
    img.src = "/examples/" + i; img.alt = name;
    b.appendChild(img);
    b.addEventListener("click", async function () {
      const r = await fetch("/examples/" + i);
      const png = r.headers.get("content-type") === "image/png";
      send(await r.blob(), name.replace(/\s+/g, "_") + (png ? ".png" : ".jpg"));
    });
    $("examples").appendChild(b);
  });
  if (!CFG.examples.length) $("examples").hidden = true;
  setState("idle");
})();
"""


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
<style>{_CSS}</style>
</head>
<body data-state="loading" data-answers="0">
<h1>Where does each word look? <small style="font-weight:400;color:#777">captioner serve</small></h1>
<div class="controls">
  <label id="model-label">model<select id="model"></select></label>
  <label>beam<select id="beam"></select></label>
  <label>n-best<select id="nbest-count"></select></label>
</div>
<div id="drop">Drop a photo here, or <label><input type="file" id="file" accept="image/*"></label></div>
<div id="examples"><span>or try an example:</span></div>
<p id="error" role="alert" hidden></p>
<p id="status" aria-live="polite"></p>
<section id="result" hidden>
  <p id="best" aria-label="best caption"></p>
  <ol id="nbest" aria-label="n-best captions"></ol>
  <div class="downloads">
    <button type="button" id="download-png">Download overlay (PNG)</button>
    <button type="button" id="download-json">Download attention (JSON)</button>
  </div>
  <iframe id="explorer" title="attention explorer"></iframe>
</section>
<script type="application/json" id="serve-config">{payload}</script>
<script>{_JS}</script>
</body>
</html>
"""
