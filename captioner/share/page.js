
"use strict";
(function () {
  const CFG = JSON.parse(document.getElementById("serve-config").textContent);
  const $ = function (id) { return document.getElementById(id); };
  const body = document.body, errorBox = $("error"), statusLine = $("status"), columns = $("columns");
  // last: the photo; style, strength: as the explorer opens, until chosen; chosen: the caption picked per model
  let last = null, run = 0, style = null, strength = null, started = 0, chosen = {}, chosenFor = null;

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
  // everyday photos (the server's EVERYDAY decoding), for the models that offer it; the user's choice is kept while
  // only models without it are chosen
  const everydayNote = $("everyday-note").textContent;
  let everyday = false;
  function offers(name) { return CFG.models.some(function (m) { return m.name === name && m.everyday; }); }
  function fillEveryday() {
    const offered = chosenModels().some(offers);
    $("everyday").disabled = !offered;
    $("everyday").checked = offered && everyday;
    $("everyday-label").classList.toggle("off", !offered);
    $("everyday-note").textContent = offered ? everydayNote : "Not offered by this model: it needs one that reads " +
      "its encoder's labels (as the shipped model does).";
  }
  fillEveryday();

  function setState(state) { body.dataset.state = state; }
  function answered() { body.dataset.answers = String(+(body.dataset.answers || 0) + 1); }
  function fail(message) {  // the photo's error: no old result under it, and nothing to run again
    errorBox.textContent = message; errorBox.hidden = false;
    statusLine.textContent = ""; $("result").hidden = true; columns.innerHTML = "";
    columns.style.minHeight = "";
    last = null; $("again").disabled = true;
    setState("error"); answered();
  }
  function notice(message) { errorBox.textContent = message; errorBox.hidden = false; }  // the result stays
  function chosenModels() {
    return $("model").value ? [$("model").value] : CFG.models.map(function (m) { return m.name; });
  }
  function frames() { return Array.prototype.slice.call(columns.querySelectorAll("iframe")); }
  function stem() { return (last.name.replace(/\.[^.]*$/, "") || "image").replace(/[^A-Za-z0-9._-]+/g, "_"); }

  function save(href, filename) {
    const a = document.createElement("a"); a.href = href; a.download = filename;
    document.body.appendChild(a); a.click(); a.remove();
  }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function scoreParts(c) {  // the model's own log-probability in all and per word (the words alone are counted)
    const v = c.log_prob, n = c.words.length, per = n ? v / n : v;
    return { total: v.toFixed(2), per: per.toFixed(2), n: n };
  }
  function verdictNote(name) {
    const v = CFG.verdicts.filter(function (x) { return x.name === name; })[0];
    return v ? v.note : "";
  }

  function column(data, many, keep) {  // one model's answer: the caption, its score, the n-best list, the map
    const col = el("section", "column"), frame = document.createElement("iframe");
    col.dataset.model = data.model;
    let shown = Math.min(keep, data.captions.length - 1);
    const head = el("div", "head"), more = el("div", "more"), map = el("div", "map");
    const h = el("h2", "", data.model + " ");
    h.appendChild(el("span", "meta", "beam " + data.beam + (data.everyday ? " \u00b7 everyday photos" : "") +
                     " \u00b7 " + data.seconds.toFixed(2) + " s"));
    head.appendChild(h);
    const line = el("p", "chosen"), text = el("span", "text"), copy = el("button", "copy", "Copy");
    copy.type = "button";
    copy.setAttribute("aria-label", "copy the caption");
    line.appendChild(text); line.appendChild(copy); head.appendChild(line);
    const judged = el("div", "judged"), verdict = el("p", "verdict");
    const word = el("strong", "verdict-word"), why = el("span", "why");
    verdict.appendChild(word); verdict.appendChild(why); judged.appendChild(verdict); head.appendChild(judged);
    // the numbers one click away: the model's own log-probability (never the fused score, said apart)
    const numbers = el("details", "numbers"), score = el("p", "score"), fused = el("p", "fused");
    const band = el("p", "band");
    numbers.appendChild(el("summary", "", "the numbers"));
    numbers.appendChild(band); numbers.appendChild(score); numbers.appendChild(fused);
    numbers.appendChild(el("p", "explain", "The model's own log-probability of this caption, word by word: 0 would be " +
                           "certain, closer to 0 is more likely. The verdict reads it per word, by bands fitted on " +
                           "dev photos."));
    judged.appendChild(numbers);
    function pick(k) {  // caption k of the list: its text, its score, its map
      shown = k;
      const c = data.captions[k], s = scoreParts(c);
      text.textContent = c.text || "(empty caption)";
      word.textContent = c.verdict;
      verdict.dataset.verdict = c.verdict;
      why.textContent = " \u00b7 " + verdictNote(c.verdict);
      band.textContent = c.verdict + ": " + verdictNote(c.verdict) + ".";
      score.textContent = "";
      score.appendChild(document.createTextNode("the model's own log-probability "));
      score.appendChild(el("strong", "", s.total));
      score.appendChild(document.createTextNode(" in all \u00b7 "));
      score.appendChild(el("strong", "", s.per));
      score.appendChild(document.createTextNode(" per word (" + s.n + (s.n === 1 ? " word)" : " words)")));
      fused.hidden = !data.everyday;  // "everyday photos": the search's score is another number, named as such
      fused.textContent = data.everyday ? "The caption was chosen with \u201ceveryday photos\u201d: its search " +
        "score, with the COCO language model and the labels' veto and fill (" + CFG.everyday_setting + "), is " +
        c.score.toFixed(2) +
        " in all. The model's own log-probability above leaves them out." : "";
      list.querySelectorAll("button").forEach(function (o, j) { o.setAttribute("aria-pressed", String(j === k)); });
      chosen[data.model] = k;
    }
    const list = el("ol", "nbest");
    list.setAttribute("aria-label", data.model + ": captions, best first");
    list.hidden = data.captions.length < 2;
    data.captions.forEach(function (c, k) {
      const li = document.createElement("li"), b = el("button", "nbest-item");
      b.type = "button"; b.id = "nbest-" + (many ? data.model + "-" : "") + k;
      const s = scoreParts(c);
      b.appendChild(el("span", "text", c.text || "(empty caption)"));
      b.appendChild(el("span", "score", c.verdict + " \u00b7 " + s.per + " per word"));
      b.addEventListener("click", function () { pick(k); load(frame, c.explorer, false); });
      li.appendChild(b); list.appendChild(li);
    });
    more.appendChild(list);
    copy.addEventListener("click", function () {
      const done = function () { copy.textContent = "Copied"; setTimeout(function () { copy.textContent = "Copy"; }, 1500); };
      const t = text.textContent;
      if (navigator.clipboard && navigator.clipboard.writeText) navigator.clipboard.writeText(t).then(done, select);
      else select();
      function select() {  // no clipboard here: the text selected, for Ctrl+C
        const r = document.createRange(); r.selectNodeContents(text);
        const sel = window.getSelection(); sel.removeAllRanges(); sel.addRange(r);
      }
    });
    const dl = el("div", "downloads");
    const png = el("button", "download-png", "Download this map (PNG)");
    const json = el("button", "download-json", "Download attention (JSON)");
    png.type = json.type = "button";
    png.addEventListener("click", function () {
      const w = frame.contentWindow;
      if (!w || !w.captionerSnapshot) return;
      const item = frame.contentDocument.body.dataset.shown || "0", chip = /^(tag|label)-(\d+)$/.exec(item);
      const what = chip ? "_" + chip[1] + (+chip[2] + 1) : "_word" + (+item + 1);  // a word, a tag or a label
      save(w.captionerSnapshot(), stem() + "_" + data.model + "_caption" + (shown + 1) + what + ".png");
    });
    json.addEventListener("click", function () {
      const c = data.captions[shown];
      const record = Object.assign({ model: data.model, file: data.file, score: c.score, log_prob: c.log_prob,
                                   verdict: c.verdict }, c.record);
      const url = URL.createObjectURL(new Blob([JSON.stringify(record)], { type: "application/json" }));
      save(url, stem() + "_" + data.model + "_caption" + (shown + 1) + "_attention.json");
      setTimeout(function () { URL.revokeObjectURL(url); }, 1000);
    });
    dl.appendChild(png); dl.appendChild(json); more.appendChild(dl);
    frame.title = data.model + ": where each word looked";
    map.appendChild(frame);
    col.appendChild(head); col.appendChild(map); col.appendChild(more);
    pick(shown);
    return { element: col, frame: frame, first: data.captions[shown].explorer };
  }

  function fit(frame) {  // the frame as high as what it holds (it follows the window); the map fits the window
    const doc = frame.contentDocument;
    if (!doc || !doc.body) return;
    const view = doc.getElementById("view"), said = doc.getElementById("summary");
    if (view && said) {  // room for the map: the window less what is above it, and its legend and sentence under it
      // the map's top on the page; for models stacked one above the other (a phone), its top in its own column
      const col = frame.closest(".column"), below = col && stacked(col);
      const top = view.getBoundingClientRect().top + (below ? frame.getBoundingClientRect().top -
        col.getBoundingClientRect().top : frame.getBoundingClientRect().top + window.scrollY);
      const play = doc.getElementById("play"), low = view.getBoundingClientRect().bottom;
      const after = play && play.getBoundingClientRect().top > low ? play.getBoundingClientRect().bottom : 0;
      const under = Math.max(said.getBoundingClientRect().bottom, after) - low;  // Play too, when it comes after
      const room = Math.max(200, Math.floor(window.innerHeight - top - under - 10));
      if (doc.documentElement.style.getPropertyValue("--map-max") !== room + "px")
        doc.documentElement.style.setProperty("--map-max", room + "px");
    }
    frame.style.height = Math.ceil(doc.body.getBoundingClientRect().height + 12) + "px";
    level();
  }
  function stacked(col) {  // models one above the other (a phone): col (default: the second) below the one before it
    col = col || columns.children[1];
    const before = col && col.previousElementSibling;
    return !!before && before.getBoundingClientRect().bottom <= col.getBoundingClientRect().top + 1;
  }
  function level() {  // side by side: every map as far down as the lowest one (rows of chips above a map differ)
    if (!columns.classList.contains("many")) return;
    if (stacked()) {  // one above the other: nothing to level
      frames().forEach(function (f) {
        const doc = f.contentDocument;
        if (doc && doc.documentElement.style.getPropertyValue("--lead")) doc.documentElement.style.removeProperty("--lead");
      });
      return;
    }
    const views = frames().map(function (f) {
      const doc = f.contentDocument, view = doc && doc.getElementById("view");
      if (!view) return null;
      const lead = parseFloat(doc.documentElement.style.getPropertyValue("--lead")) || 0;
      return { doc: doc, top: f.getBoundingClientRect().top + view.getBoundingClientRect().top - lead };
    });
    if (views.some(function (v) { return v === null; })) return;  // not all drawn yet
    const low = Math.max.apply(null, views.map(function (v) { return v.top; }));
    views.forEach(function (v) {
      const lead = Math.round(low - v.top) + "px";
      if (v.doc.documentElement.style.getPropertyValue("--lead") !== lead) v.doc.documentElement.style.setProperty("--lead", lead);
    });
  }
  function load(frame, html, counted) {
    frame.onload = function () {
      const w = frame.contentWindow, doc = frame.contentDocument;
      if (doc && doc.body) doc.body.classList.toggle("compare", columns.classList.contains("many"));
      if (w && w.captionerSetStyle && style) w.captionerSetStyle(style);
      if (w && w.captionerSetStrength && strength !== null) w.captionerSetStrength(strength);
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
    const mine = ++run, models = chosenModels(), photo = last;
    errorBox.hidden = true;
    if (photo.blob.size > CFG.max_bytes) {
      fail(photo.name + ": too large (" + (photo.blob.size / 1048576).toFixed(1) + " MiB; the limit is " +
           CFG.max_text + ") and this browser could not shrink it: save a smaller copy (a long side of 2,000 " +
           "pixels is plenty), or start captioner serve with a higher --max-upload-mb");
      return;
    }
    setState("busy"); started = performance.now();
    $("again").disabled = false;
    statusLine.textContent = "captioning\u2026";
    $("file-name").textContent = photo.name;
    if (!$("result").hidden && $("result").dataset.file !== photo.name + "#" + photo.serial) {
      $("result").classList.add("stale");
      $("stale-note").textContent = "Below: the previous photo's result, until this one's is done.";
      $("stale-note").hidden = false;
    }
    const form = new FormData();
    form.append("image", photo.blob, photo.name);
    form.append("beam", $("beam").value);
    form.append("n_best", $("nbest-count").value);
    const answers = await Promise.all(models.map(function (m) {
      const f = new FormData(); form.forEach(function (v, k) { f.append(k, v); });
      if ($("everyday").checked && offers(m)) f.append("everyday", "true");  // side by side: to those that offer it
      return ask(m, f);
    }));
    if (mine !== run) return;  // a newer request owns the page
    const bad = answers.filter(function (a) { return a.error; });
    if (bad.length) { fail(bad[0].error); return; }
    if (!$("result").hidden) columns.style.minHeight = columns.offsetHeight + "px";  // no jump while redrawn
    columns.innerHTML = "";
    $("result").classList.remove("stale"); $("stale-note").hidden = true;
    if (chosenFor !== photo.serial) chosen = {};  // a re-run of the same photo keeps the captions chosen
    chosenFor = photo.serial;
    $("result").dataset.file = photo.name + "#" + photo.serial;
    $("result").hidden = false;
    const several = answers.length > 1;
    $("result").classList.toggle("many", several); columns.classList.toggle("many", several);
    columns.style.setProperty("--n", String(answers.length));
    const built = answers.map(function (a) { return column(a, several, chosen[a.model] || 0); });
    let loaded = 0;
    built.forEach(function (b) {
      columns.appendChild(b.element);
      load(b.frame, b.first, function () {
        if (++loaded < built.length || mine !== run) return;
        const ms = performance.now() - started;
        body.dataset.ms = ms.toFixed(0);
        statusLine.textContent = models.length + (models.length > 1 ? " models" : " model") + " \u00b7 " +
          (ms / 1000).toFixed(2) + " s from upload to map" + (photo.note ? " \u00b7 " + photo.note : "");
        columns.style.minHeight = "";
        setState("done"); answered();
      });
    });
  }

  // a photo larger than the model and the map need (a phone's 50 megapixels) is shrunk here before it is sent:
  // its long side to CFG.upload_side, upright as its EXIF orientation says; anything the browser cannot decode is
  // sent as it is, for the server to name what is wrong with it
  async function shrunk(blob) {
    if (!CFG.upload_side || !window.createImageBitmap) return null;
    let bitmap;
    try { bitmap = await createImageBitmap(blob, { imageOrientation: "from-image" }); } catch (e) { return null; }
    const w = bitmap.width, h = bitmap.height, scale = CFG.upload_side / Math.max(w, h);
    if (!(scale < 1)) { bitmap.close(); return null; }
    const sw = Math.max(1, Math.round(w * scale)), sh = Math.max(1, Math.round(h * scale));
    const canvas = document.createElement("canvas"), ctx = canvas.getContext("2d");
    canvas.width = sw; canvas.height = sh;
    ctx.imageSmoothingQuality = "high";
    ctx.drawImage(bitmap, 0, 0, sw, sh);
    bitmap.close();
    const out = await new Promise(function (ok) { canvas.toBlob(ok, "image/jpeg", 0.92); });
    canvas.width = canvas.height = 0;  // its pixels let go at once
    return out && { blob: out, note: "sent at " + sw + "\u00d7" + sh + " (from " + w + "\u00d7" + h + ")" };
  }
  let serial = 0;
  async function choose(blob, name) {
    const mine = ++serial;
    if (blob.size > 4 * 1048576 || blob.size > CFG.max_bytes) {  // a large file: say why it takes a moment
      setState("busy"); statusLine.textContent = "shrinking the photo\u2026";
    }
    const small = await shrunk(blob);
    if (mine !== serial) return;  // another photo was chosen meanwhile
    last = { blob: small ? small.blob : blob, name: name, serial: mine, note: small ? small.note : "" };
    send();
  }

  window.addEventListener("message", function (e) {  // one explorer's word, style or strength, shown in the others
    const msg = e.data || {};
    const ours = frames().some(function (f) { return f.contentWindow === e.source; });
    if (!ours) return;
    if (msg.captioner === "drop" && msg.file instanceof Blob) { choose(msg.file, msg.file.name || "photo"); return; }
    frames().forEach(function (f) {
      const w = f.contentWindow;
      if (!w || w === e.source) return;
      if (msg.captioner === "word" && w.captionerShowWord) w.captionerShowWord(msg.word, msg.kind, msg.map);
      if (msg.captioner === "style" && w.captionerSetStyle) w.captionerSetStyle(msg.style);
      if (msg.captioner === "strength" && w.captionerSetStrength) w.captionerSetStrength(msg.value);
    });
    if (msg.captioner === "style") style = msg.style;
    if (msg.captioner === "strength") strength = msg.value;
  });
  window.addEventListener("resize", function () { frames().forEach(fit); });

  // a setting captions the photo again; stepping through a closed select with the arrow keys asks once, when
  // the keys rest (or the select is left), not at every step
  function setting(select, before) {
    let keyed = false, timer = null;
    function now() { clearTimeout(timer); timer = null; send(); }
    select.addEventListener("keydown", function () { keyed = true; });
    select.addEventListener("pointerdown", function () { keyed = false; });
    select.addEventListener("change", function () {
      if (before) before();
      if (!keyed) { now(); return; }
      clearTimeout(timer); timer = setTimeout(now, 800);
    });
    select.addEventListener("blur", function () { keyed = false; if (timer !== null) now(); });
  }
  setting($("beam"), fillNbest);
  setting($("nbest-count"));
  setting($("model"), fillEveryday);
  $("everyday").addEventListener("change", function () { everyday = this.checked; send(); });  // one toggle, one ask
  $("again").addEventListener("click", send);
  $("file").addEventListener("change", function () {
    if (this.files.length) choose(this.files[0], this.files[0].name);
  });
  $("skip").addEventListener("click", function (e) {  // to the words of the (first) caption: its strip's Tab stop
    const f = frames()[0], doc = f && f.contentDocument, word = doc && doc.querySelector(".word[tabindex='0']");
    if (!word) return;
    e.preventDefault(); f.focus(); word.focus();
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
    const data = e.dataTransfer, files = data && data.files;
    if (files && files.length) { choose(files[0], files[0].name); return; }
    const types = data ? Array.prototype.slice.call(data.types || []) : [];
    notice(types.indexOf("text/uri-list") >= 0 ? "That was a link, not a photo: save the picture, then drop the file."
           : "That was text, not a photo: drop an image file (JPEG, PNG, ...), or choose one.");
  });
  CFG.examples.forEach(function (example, i) {
    const b = document.createElement("button"), img = document.createElement("img");
    b.type = "button"; b.id = "example-" + i; b.title = example.name;
    b.setAttribute("aria-label", "example: " + example.name);
    img.src = "/examples/" + i; img.alt = "";
    b.appendChild(img);
    b.addEventListener("click", async function () {
      const r = await fetch("/examples/" + i);
      choose(await r.blob(), example.file);  // the file's own bytes: the score `captioner caption` gives it
    });
    $("examples").appendChild(b);
  });
  if (!CFG.examples.length) $("examples").hidden = true;
  setState("idle");
})();
