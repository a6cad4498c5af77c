"""The first look of the ``captioner serve`` page in headless Chromium, as a new user meets it.

With the shipped model and an example photo: at 1280x900 with three captions the map, its legend and
the downloads are in the window; on a 390x844 phone the map starts in the first screen; the score is
always shown and said in words, and equals ``captioner caption``'s on the same file. The word strip
(every word's small map, one Tab stop, arrow keys, a skip link), the play-through, the caption as
copyable text, the model said from its card, the examples ``-c a=flickr8k -c b=flickr8k`` offers, the
light style on a dark photo, re-runs that keep the user's choices, a keyed select that asks once, a
drop of text, no jump while a new photo is busy, and "everyday photos" offered where a model offers it.
Skips where selenium or chromium is missing.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from test_browser import DESKTOP, viewport
from test_browser_serve import (_DROP, _answers, _axe_audit, _dark_photo, _in_frame, _pixels, _scene, _serve_page,  # noqa: F401
                                _settled, _upload, _wait, _words_in, a_model, driver, peaked_model)

pytestmark = pytest.mark.slow  # starts a browser and a server

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shipped():
    import captioner

    return captioner.load("flickr8k", device="cpu")


def _png(data_url: str) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))).convert("RGB"), dtype=np.int16)


def _shipped_page(driver, shipped):
    """The shipped model served as ``captioner serve`` serves it (its card, the example photos)."""
    import contextlib

    from captioner.commands.serve import model_card_of
    from captioner.pretrained import PHOTOS
    from captioner.share.server import default_examples
    from captioner.share.server import ServedModel, create_app, running

    @contextlib.contextmanager
    def opened():
        app = create_app([ServedModel("flickr8k", shipped, card=model_card_of("flickr8k"))],
                         default_examples([shipped.vocab.itos], PHOTOS))
        with running(app) as base:
            driver.get(base + "/")
            _wait(driver, "return document.body.dataset.state === 'idle';")
            yield base

    return opened()


def _example(driver, index: int = 0) -> None:
    before = _answers(driver)
    driver.find_element("id", f"example-{index}").click()
    _wait(driver, f"return +document.body.dataset.answers > {before} && document.body.dataset.state === 'done';", 60)


_RECT = """const f = document.querySelector('#columns iframe'), r = f.getBoundingClientRect(), doc = f.contentDocument;
const v = doc.getElementById('view').getBoundingClientRect(), l = doc.querySelector('.legend').getBoundingClientRect();
const p = doc.getElementById('play').getBoundingClientRect(), d = document.querySelector('.downloads').getBoundingClientRect();
const c = document.querySelector('.chosen').getBoundingClientRect(), j = document.querySelector('.verdict').getBoundingClientRect();
return {map_top: Math.round(r.top + v.top), map_bottom: Math.round(r.top + v.bottom), map_width: Math.round(v.width),
        legend_bottom: Math.round(r.top + l.bottom), play_bottom: Math.round(r.top + p.bottom),
        downloads_bottom: Math.round(d.bottom), caption_top: Math.round(c.top), verdict_bottom: Math.round(j.bottom),
        height: window.innerHeight, scroll: window.scrollY};"""


def test_the_first_result_holds_what_matters_at_1280x900_and_starts_the_map_high_on_a_phone(driver, shipped):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    try:
        with _shipped_page(driver, shipped):
            viewport(driver, 1280, 900)
            Select(driver.find_element(By.ID, "nbest-count")).select_by_value("3")
            _example(driver)
            _wait(driver, "return document.querySelector('#columns iframe').offsetHeight > 300;")
            box = _settled(driver, _RECT)  # the frame fitted to the window
            assert box["scroll"] == 0
            assert box["map_bottom"] <= box["height"] and box["legend_bottom"] <= box["height"], box
            assert box["downloads_bottom"] <= box["height"], box
            assert box["map_width"] >= 600, box  # the map, not a thumbnail: no photo beside it
            assert len(driver.find_elements(By.CSS_SELECTOR, ".nbest .text")) == 3
            # the file name once on the page, the photo once (in the map; no thumbnails)
            name = driver.find_element(By.ID, "file-name").text
            assert name == "family_table.jpg"
            assert driver.execute_script("return document.body.innerText;").count(name) == 1
            assert driver.find_elements(By.CSS_SELECTOR, "#result img") == []
            # the model said in one line from its card, the card one click away
            about = driver.find_element(By.CSS_SELECTOR, "#about li").text
            assert about.startswith("flickr8k: knows photos mostly of people and dogs outdoors \u00b7 Show, Attend "
                                    "and Tell on Flickr8k")  # what it knows first
            card = driver.find_element(By.CSS_SELECTOR, "#about a").get_attribute("href")
            import urllib.request

            with urllib.request.urlopen(card, timeout=30) as r:
                assert "Show, Attend and Tell on Flickr8k" in r.read().decode()
            # a phone: a compact header; caption, verdict, map, legend and Play on the first screen; the downloads
            # within one short scroll
            viewport(driver, 390, 844, mobile=True)
            driver.execute_script("window.scrollTo(0, 0);")
            Select(driver.find_element(By.ID, "nbest-count")).select_by_value("1")
            _wait(driver, "return document.body.dataset.state === 'done' && "
                          "document.querySelectorAll('.nbest .text').length === 1;", 60)
            box = _settled(driver, _RECT)
            assert box["scroll"] == 0 and box["height"] == 844, box
            assert box["caption_top"] >= 0 and box["verdict_bottom"] < box["map_top"] <= 360, box
            assert box["legend_bottom"] <= 844 and box["play_bottom"] <= 844, box
            assert box["downloads_bottom"] <= 1050, box
            assert driver.execute_script("return document.documentElement.scrollWidth <= "
                                         "document.documentElement.clientWidth;"), "the page scrolls sideways"
    finally:
        viewport(driver, *DESKTOP)


def test_the_score_is_shown_by_default_and_equals_captioner_caption_on_the_same_file(driver, shipped, capsys):
    from selenium.webdriver.common.by import By

    from captioner.cli import main
    from captioner.pretrained import PHOTOS
    from captioner.share.server import verdict

    photo = sorted(PHOTOS.glob("*.jpg"))[1]
    assert main(["caption", str(photo), "--json"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with _shipped_page(driver, shipped):
        driver.execute_script("window.answers = []; window.fetch = (function (real) { return function () {"
                              " return real.apply(null, arguments).then(function (r) {"
                              " r.clone().json().then(function (j) { window.answers.push(j); }); return r; }); }; })"
                              "(window.fetch);")
        _example(driver, 1)  # the default view: one caption
        assert driver.find_element(By.ID, "file-name").text == photo.name
        answer = driver.execute_script("return window.answers[window.answers.length - 1];")
        best = answer["captions"][0]
        assert best["text"] == cli["caption"] and best["score"] == pytest.approx(cli["score"], abs=1e-4)
        # a verdict in words, its band that of the model's own log-probability per word; the number one click away
        words = len(cli["tokens"])
        said = driver.find_element(By.CSS_SELECTOR, ".column .verdict")
        assert said.is_displayed() and said.find_element(By.CSS_SELECTOR, "strong").text == best["verdict"]
        assert best["log_prob"] == pytest.approx(cli["score"], abs=1e-4)
        assert best["verdict"] == verdict(cli["score"], words)
        score = driver.find_element(By.CSS_SELECTOR, ".column .score")
        assert not score.is_displayed()
        driver.find_element(By.CSS_SELECTOR, ".column .numbers summary").click()
        assert score.is_displayed()
        assert score.text == (f"the model's own log-probability {cli['score']:.2f} in all \u00b7 {cli['score'] / words:.2f} "
                              f"per word ({words} words)")
        explain = driver.find_element(By.CSS_SELECTOR, ".column .explain")
        assert explain.is_displayed() and "closer to 0 is more likely" in explain.text
        assert not driver.find_element(By.CSS_SELECTOR, ".column .fused").is_displayed()  # plain: one number
        assert not driver.find_element(By.CSS_SELECTOR, ".nbest").is_displayed()  # one caption: no list
        # the caption as text to copy
        assert driver.find_element(By.CSS_SELECTOR, ".column .chosen .text").text == cli["caption"]
        driver.find_element(By.CSS_SELECTOR, ".column .chosen .copy").click()
        _wait(driver, "const s = window.getSelection().toString(), b = document.querySelector('.chosen .copy');"
                      f" return s === {json.dumps(cli['caption'])} || b.textContent === 'Copied';")


def test_two_shipped_models_named_on_the_command_line_keep_the_example_photos(driver):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "captioner", "serve", "-c", "a=flickr8k", "-c", "b=flickr8k",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving a, b on http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        driver.get(line.split(" on ", 1)[1].split()[0] + "/")
        _wait(driver, "return document.body.dataset.state === 'idle';")
        labels = [b.get_attribute("aria-label") for b in driver.find_elements("css selector", "#examples button")]
        assert labels == ["example: family_table", "example: phone_call", "example: skateboarder", "example: tennis"]
        assert "scene" not in " ".join(labels)
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_word_strip_is_one_tab_stop_with_arrow_keys_small_maps_and_a_play_through(driver, peaked_model,
                                                                                      tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    with _serve_page(driver, [("peaked", peaked_model)]):
        _upload(driver, _scene(tmp_path, seed=3)[1])
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        words = _words_in(driver, frame)
        assert len(words) > 3
        # the skip link: the first Tab stop of the page, and it leads to the words
        driver.execute_script("if (document.activeElement) document.activeElement.blur(); window.scrollTo(0, 0);")
        ActionChains(driver).send_keys(Keys.TAB).perform()
        assert driver.switch_to.active_element.get_attribute("id") == "skip"
        ActionChains(driver).send_keys(Keys.ENTER).perform()
        driver.switch_to.frame(frame)
        opened = driver.execute_script("return document.body.dataset.word;")
        assert driver.switch_to.active_element.get_attribute("id") == f"word-{opened}"
        # one Tab stop: the pinned word alone is reachable with Tab; the next Tab leaves the strip
        tabbable = driver.execute_script("return Array.prototype.filter.call(document.querySelectorAll('.word'),"
                                         " function (w) { return w.tabIndex === 0; }).map(function (w) { return w.id; });")
        assert tabbable == [f"word-{opened}"]
        ActionChains(driver).send_keys(Keys.TAB).perform()
        assert "word" not in (driver.switch_to.active_element.get_attribute("class") or "")
        ActionChains(driver).key_down(Keys.SHIFT).send_keys(Keys.TAB).key_up(Keys.SHIFT).perform()
        assert driver.switch_to.active_element.get_attribute("id") == f"word-{opened}"
        # arrows step, pin and carry the Tab stop; Home and End go to the ends
        ActionChains(driver).send_keys(Keys.ARROW_RIGHT).perform()
        step = (int(opened) + 1) % len(words)
        assert driver.switch_to.active_element.get_attribute("id") == f"word-{step}"
        assert driver.execute_script("return document.body.dataset.word;") == str(step)
        assert driver.find_element(By.ID, f"word-{step}").get_attribute("tabindex") == "0"
        ActionChains(driver).send_keys(Keys.END).perform()
        assert driver.execute_script("return document.body.dataset.word;") == str(len(words) - 1)
        ActionChains(driver).send_keys(Keys.HOME).perform()
        assert driver.execute_script("return document.body.dataset.word;") == "0"
        # every word's small map, each its own (the maps differ), under its word; a click selects
        minis = driver.find_elements(By.CSS_SELECTOR, ".word .mini")
        assert len(minis) == len(words)
        shots = [_png(driver.execute_script("return arguments[0].toDataURL('image/png');", m)) for m in minis]
        assert all(s.std() > 5 for s in shots), "a blank small map"
        assert max(np.abs(s - shots[0]).mean() for s in shots[1:]) > 3, "the small maps are all alike"
        minis[-1].click()
        assert driver.execute_script("return document.body.dataset.word;") == str(len(words) - 1)
        # the play-through: every word in turn, then it stops
        driver.execute_script("window.seen = []; new MutationObserver(function () {"
                              " if (window.seen[window.seen.length - 1] !== document.body.dataset.word)"
                              " window.seen.push(document.body.dataset.word); })"
                              ".observe(document.body, { attributes: true, attributeFilter: ['data-word'] });")
        driver.find_element(By.ID, "play").click()
        assert driver.find_element(By.ID, "play").get_attribute("aria-pressed") == "true"
        _wait(driver, "return document.body.dataset.playing === '';", timeout=len(words) * 2 + 10)
        assert driver.execute_script("return window.seen;") == [str(i) for i in range(len(words))]
        assert driver.find_element(By.ID, "play").get_attribute("aria-pressed") == "false"
        # the photo without the map, and back
        with_map = _pixels(driver.find_element(By.ID, "view"))
        driver.find_element(By.ID, "bare").click()
        bare = _pixels(driver.find_element(By.ID, "view"))
        assert np.abs(bare - with_map).sum(-1).__gt__(30).mean() > 0.02
        driver.find_element(By.ID, "bare").click()
        assert np.abs(_pixels(driver.find_element(By.ID, "view")) - with_map).sum(-1).__gt__(30).mean() < 0.01
        driver.switch_to.default_content()


def test_the_light_style_shows_the_peak_on_a_dark_photo(driver, a_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from captioner.viz.attention_json import on_image
    from test_browser_serve import _cell_pixels

    image, photo = _dark_photo(tmp_path, "scene")
    assert np.asarray(image).mean() < 40  # dark
    expected = a_model.caption(image, beam=3, attention=True)[0]
    with _serve_page(driver, [("a", a_model)]):
        _upload(driver, photo)
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, frame)
        driver.switch_to.frame(frame)
        Select(driver.find_element(By.ID, "style")).select_by_value("light")
        opened = int(driver.execute_script("return document.body.dataset.word;"))
        shot = _pixels(driver.find_element(By.ID, "view")).astype(np.float64)
        driver.switch_to.default_content()
    att = expected.attention[opened].numpy()
    peak = np.unravel_index(int(att.argmax()), att.shape)
    box = on_image(expected, image).box
    region = _cell_pixels(shot, image, box, att.shape[0], [peak]).mean()
    assert region >= 3 * shot.mean(), (region, shot.mean())
    assert region >= 60, region  # bright enough to see


def test_a_rerun_keeps_strength_and_caption_and_a_keyed_select_asks_once(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    _, photo = _scene(tmp_path, seed=5)
    with _serve_page(driver, [("peaked", peaked_model)]):
        Select(driver.find_element(By.ID, "nbest-count")).select_by_value("3")
        _upload(driver, photo)
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, frame)
        driver.switch_to.frame(frame)
        driver.execute_script("const a = document.getElementById('alpha'); a.value = '0.4';"
                              "a.dispatchEvent(new Event('input')); a.dispatchEvent(new Event('change'));")
        driver.switch_to.default_content()
        driver.find_element(By.ID, "nbest-2").click()
        _wait(driver, "return document.body.dataset.state === 'done';")
        second = driver.find_element(By.CSS_SELECTOR, ".chosen .text").text
        before = _answers(driver)
        driver.find_element(By.ID, "again").click()
        _wait(driver, f"return +document.body.dataset.answers > {before} && document.body.dataset.state === 'done';")
        assert driver.find_element(By.ID, "nbest-2").get_attribute("aria-pressed") == "true"
        assert driver.find_element(By.CSS_SELECTOR, ".chosen .text").text == second
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, frame)
        assert _in_frame(driver, frame, "return document.getElementById('alpha').value;") == "0.4"
        # ArrowDown twice on the closed beam select: one request, when the keys rest
        driver.execute_script("window.asked = 0; window.fetch = (function (real) { return function () {"
                              " window.asked++; return real.apply(null, arguments); }; })(window.fetch);")
        beam = driver.find_element(By.ID, "beam")
        driver.execute_script("arguments[0].focus();", beam)
        beam.send_keys(Keys.ARROW_DOWN)
        beam.send_keys(Keys.ARROW_DOWN)
        time.sleep(0.3)
        assert driver.execute_script("return window.asked;") == 0  # not at every step
        _wait(driver, "return window.asked === 1 && document.body.dataset.state === 'done';")
        time.sleep(1.0)
        assert driver.execute_script("return window.asked;") == 1
        assert beam.get_attribute("value") == "5"
        # a new photo: its own first caption again, the strength kept
        _upload(driver, _scene(tmp_path, seed=6, name="other.png")[1])
        assert driver.find_element(By.ID, "nbest-0").get_attribute("aria-pressed") == "true"
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, frame)
        assert _in_frame(driver, frame, "return document.getElementById('alpha').value;") == "0.4"


def test_a_drop_of_text_says_so_and_a_busy_photo_moves_nothing(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    _, first = _scene(tmp_path, seed=3, name="first.png")
    _, second = _scene(tmp_path, seed=6, name="second.png")
    with _serve_page(driver, [("peaked", peaked_model)]):
        _upload(driver, first)
        _words_in(driver, driver.find_element(By.CSS_SELECTOR, "#columns iframe"))
        where = ("const f = document.querySelector('#columns iframe').getBoundingClientRect(),"
                 " c = document.getElementById('columns').getBoundingClientRect();"
                 " return [Math.round(c.top), Math.round(f.top), Math.round(f.height), Math.round(f.width)];")
        _settled(driver, where)  # the frame fitted to the window before the drop
        text_drop = ("const data = new DataTransfer(); data.setData('text/plain', 'a dog');"
                     "for (const type of ['dragenter', 'dragover', 'drop']) document.body.dispatchEvent("
                     "new DragEvent(type, { dataTransfer: data, bubbles: true, cancelable: true }));")
        driver.execute_script(text_drop)
        error = driver.find_element(By.ID, "error")
        assert error.is_displayed() and error.text.startswith("That was text, not a photo")
        assert driver.find_element(By.ID, "result").is_displayed()  # the result stays
        driver.execute_script("window.fetch = (function (real) { return function () { const a = arguments;"
                              " return new Promise(function (ok) { setTimeout(function () { ok(real.apply(null, a)); },"
                              " 1500); }); }; })(window.fetch);")  # a slow answer, to look at the page meanwhile
        error_shown = _settled(driver, where)
        driver.find_element(By.ID, "file").send_keys(str(second))
        _wait(driver, "return document.body.dataset.state === 'busy';")
        busy = driver.execute_script(where)
        assert driver.find_element(By.ID, "stale-note").is_displayed()
        # the error line of the text drop goes, and nothing below it moves by more than that line
        line = error_shown[0] - busy[0]
        assert busy[1:] == [error_shown[1] - line, *error_shown[2:]], (error_shown, busy)
        time.sleep(0.5)
        assert driver.execute_script(where) == busy  # still: the old result waits where it was
        _wait(driver, "return document.body.dataset.state === 'done';")


def test_the_page_has_no_accessibility_violations(driver, peaked_model, tmp_path: Path) -> None:
    axe = pytest.importorskip("axe_core_python.selenium")
    from selenium.webdriver.common.by import By

    _, photo = _scene(tmp_path, seed=3, side=300)
    with _serve_page(driver, [("peaked", peaked_model)], examples=2):
        _upload(driver, photo)
        results = _axe_audit(axe, driver, driver.find_elements(By.CSS_SELECTOR, "#columns iframe"))
        assert results["passes"], "axe checked nothing"


_SENT = ("window.sent = []; window.fetch = (function (real) { return function (url, init) {"
         " if (init && init.body instanceof FormData) window.sent.push([init.body.get('model'), init.body.get('everyday')]);"
         " return real.apply(null, arguments); }; })(window.fetch);")  # each request's model and everyday field


def _metas(driver) -> dict[str, str]:
    return driver.execute_script("const out = {}; document.querySelectorAll('.column').forEach(function (c) {"
                                 " out[c.dataset.model] = c.querySelector('.meta').textContent; }); return out;")


def test_everyday_photos_is_offered_where_a_model_offers_it_and_said_in_the_meta_line(driver, shipped, peaked_model):
    axe = pytest.importorskip("axe_core_python.selenium")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    from captioner.pretrained import PHOTOS

    photo = PHOTOS / "family_table.jpg"  # a photo whose caption the everyday decoding changes
    expected = shipped.caption_nbest(photo, n_best=1, beam=3, veto=2.0, fill_slots=0.05, lm_weight=0.3)[0].text
    assert expected != shipped.caption_nbest(photo, n_best=1, beam=3)[0].text
    done = "return +document.body.dataset.answers > {};"  # an answer, or an error
    with _serve_page(driver, [("flickr8k", shipped), ("tiny", peaked_model)]):
        box = driver.find_element(By.ID, "everyday")
        models = Select(driver.find_element(By.ID, "model"))
        # side by side: offered, as one of the models offers it; the label names the box, its title says what it does
        assert box.is_enabled() and not box.is_selected() and box.accessible_name == "everyday photos"
        note = driver.find_element(By.ID, "everyday-note")  # said in words on the page, not in a tooltip
        assert note.is_displayed() and "better for food, animals, streets" in note.text
        assert box.get_attribute("aria-describedby") == "everyday-note"
        _axe_audit(axe, driver, [])
        models.select_by_value("tiny")  # a model without labels: off, and said why
        assert not box.is_enabled() and not box.is_selected() and note.text.startswith("Not offered by this model")
        models.select_by_value("flickr8k")
        assert box.is_enabled()
        driver.execute_script("arguments[0].focus();", box)
        box.send_keys(Keys.SPACE)  # the keyboard checks it; no photo yet: nothing asked
        assert box.is_selected() and _answers(driver) == 0
        driver.execute_script(_SENT)
        _upload(driver, photo)
        _wait(driver, "return document.body.dataset.state === 'done';", 60)
        assert driver.execute_script("return window.sent;") == [["flickr8k", "true"]]
        assert _metas(driver)["flickr8k"].startswith("beam 3 \u00b7 everyday photos \u00b7 ")
        assert driver.find_element(By.CSS_SELECTOR, ".column .chosen .text").text == expected
        before = _answers(driver)
        box.click()  # unchecked: the same photo again, plainly
        _wait(driver, done.format(before), 60)
        assert "everyday" not in _metas(driver)["flickr8k"]
        before = _answers(driver)
        box.click()
        _wait(driver, done.format(before), 60)
        # side by side: sent only to the model that offers it, said only in its column
        driver.execute_script("window.sent = [];")
        before = _answers(driver)
        models.select_by_value("")
        _wait(driver, done.format(before), 60)
        assert box.is_selected() and driver.execute_script("return document.body.dataset.state;") == "done", \
            driver.find_element(By.ID, "error").text
        assert sorted(driver.execute_script("return window.sent;")) == [["flickr8k", "true"], ["tiny", None]]
        metas = _metas(driver)
        assert "everyday photos" in metas["flickr8k"] and "everyday" not in metas["tiny"]
        # a model without it chosen alone turns it off; the choice comes back with a model that offers it
        before = _answers(driver)
        models.select_by_value("tiny")
        _wait(driver, done.format(before), 60)
        assert not box.is_selected() and "everyday" not in _metas(driver)["tiny"]
        models.select_by_value("flickr8k")
        assert box.is_selected()


def _numbers(driver) -> dict[str, str]:
    """The first column's verdict, its own log-probability line and the fused score's line (shown or not)."""
    return driver.execute_script(
        "const c = document.querySelector('.column'); c.querySelector('.numbers').open = true;"
        "const f = c.querySelector('.fused');"
        "return {verdict: c.querySelector('.verdict strong').textContent, text: c.querySelector('.chosen .text')"
        ".textContent, score: c.querySelector('.score').textContent, fused: f.hidden ? '' : f.textContent};")


def test_the_verdict_reads_the_models_own_log_probability_with_everyday_photos_on_or_off(driver, shipped):
    from selenium.webdriver.common.by import By

    from captioner.pretrained import PHOTOS
    from captioner.share.server import VERDICTS

    photo = PHOTOS / "phone_call.jpg"  # the same caption either way
    plain = shipped.caption_nbest(photo, n_best=1, beam=3)[0]
    assert plain.text == "a man in a black shirt is standing in front of a building"
    assert plain.score / len(plain.words) >= VERDICTS[0][0]  # -0.14 per word: the top band
    with _shipped_page(driver, shipped):
        _example(driver, 1)
        off = _numbers(driver)
        assert off["verdict"] == "likely right" and off["text"] == plain.text and off["fused"] == ""
        assert off["score"] == (f"the model's own log-probability {plain.score:.2f} in all \u00b7 "
                                f"{plain.score / 13:.2f} per word (13 words)")
        before = _answers(driver)
        driver.find_element(By.ID, "everyday").click()
        _wait(driver, f"return +document.body.dataset.answers > {before} && document.body.dataset.state === 'done';", 60)
        on = _numbers(driver)
        # the same caption, the same verdict and own log-probability; the fused search score named apart
        assert {k: on[k] for k in ("verdict", "text", "score")} == {k: off[k] for k in ("verdict", "text", "score")}
        assert "everyday photos" in on["fused"] and "search score" in on["fused"] and "own log-probability" in on["fused"]
        fused = shipped.caption_nbest(photo, n_best=1, beam=3, veto=2.0, fill_slots=0.05, lm_weight=0.3)[0].score
        assert f"{fused:.2f}" in on["fused"] and f"{fused:.2f}" not in on["score"]


def test_a_50_megapixel_phone_photo_is_shrunk_upright_in_the_browser_and_captioned(driver, shipped, tmp_path: Path):
    from PIL import Image

    from captioner.pretrained import PHOTOS

    # 8160x6120 (49.9 megapixels), stored on its side with EXIF orientation 6 as a phone stores a portrait photo
    with Image.open(PHOTOS / "skateboarder.jpg") as im:
        upright = im.convert("RGB").resize((6120, 8160))  # the photo as seen: portrait
    noise = np.random.default_rng(0).integers(-2, 3, (8160, 6120, 1), dtype=np.int16)  # a sensor's grain
    stored = Image.fromarray(np.clip(np.asarray(upright, dtype=np.int16) + noise, 0, 255).astype(np.uint8))
    stored = stored.transpose(Image.Transpose.ROTATE_90)  # as written: landscape, turned back by orientation 6
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "PXL_20260101_120000.jpg"
    stored.save(path, quality=75, exif=exif.tobytes())
    size = path.stat().st_size
    assert stored.size == (8160, 6120) and 2e6 <= size <= 3.2e6, size
    with _shipped_page(driver, shipped):
        driver.execute_script(_SENT_BYTES)
        before = _answers(driver)
        driver.find_element("id", "file").send_keys(str(path))
        _wait(driver, f"return +document.body.dataset.answers > {before};", 120)
        assert driver.execute_script("return document.body.dataset.state;") == "done", \
            driver.find_element("id", "error").text
        answer = driver.execute_script("return window.answers[window.answers.length - 1];")
        assert answer["image_size"] == [1080, 1440]  # upright: the long side 1440 px, portrait as the EXIF says
        assert driver.execute_script("return window.sentBytes;") < 1.5e6
        assert answer["captions"][0]["text"] and answer["file"] == path.name
        status = driver.find_element("id", "status").text
        assert status.endswith("sent at 1080\u00d71440 (from 6120\u00d78160)"), status


_SENT_BYTES = ("window.answers = []; window.fetch = (function (real) { return function (url, init) {"
               " if (init && init.body instanceof FormData) window.sentBytes = init.body.get('image').size;"
               " return real.apply(null, arguments).then(function (r) {"
               " r.clone().json().then(function (j) { window.answers.push(j); }); return r; }); }; })(window.fetch);")


def test_on_a_phone_the_strip_keeps_the_playing_word_in_view_and_shows_that_it_scrolls(driver, shipped):
    from selenium.webdriver.common.by import By

    try:
        with _shipped_page(driver, shipped):
            viewport(driver, 390, 844, mobile=True)
            _example(driver, 1)  # 13 words: more than the strip shows
            frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
            words = _words_in(driver, frame)
            assert len(words) == 13
            driver.switch_to.frame(frame)
            cap = driver.find_element(By.ID, "caption")
            assert driver.execute_script("return arguments[0].scrollWidth > arguments[0].clientWidth + 100;", cap)
            assert driver.execute_script("return getComputedStyle(arguments[0]).maskImage;", cap) != "none"  # the cue
            assert "more-right" in cap.get_attribute("class")
            driver.execute_script(
                "window.out = []; window.seen = []; const cap = document.getElementById('caption');"
                "new MutationObserver(function () { const i = document.body.dataset.word;"
                " const r = document.getElementById('word-' + i).getBoundingClientRect(), c = cap.getBoundingClientRect();"
                " window.seen.push(i); if (r.left < c.left - 1 || r.right > c.right + 1) window.out.push(i); })"
                ".observe(document.body, { attributes: true, attributeFilter: ['data-word'] });")
            driver.find_element(By.ID, "play").click()
            _wait(driver, "return document.body.dataset.playing === '';", timeout=60)
            assert driver.execute_script("return window.seen;")[-1] == "12"
            assert driver.execute_script("return window.out;") == []  # every played word inside the strip
            assert "more-left" in cap.get_attribute("class")  # scrolled on: the start fades now
            driver.execute_script("document.getElementById('word-0').focus();")  # the focused word too
            assert driver.execute_script("const r = document.getElementById('word-0').getBoundingClientRect(),"
                                         " c = document.getElementById('caption').getBoundingClientRect();"
                                         " return r.left >= c.left - 1 && r.right <= c.right + 1;")
            driver.switch_to.default_content()
    finally:
        driver.switch_to.default_content()
        viewport(driver, *DESKTOP)


def test_the_model_card_is_html_with_its_table_and_passes_axe(driver, shipped):
    axe = pytest.importorskip("axe_core_python.selenium")
    from selenium.webdriver.common.by import By

    with _shipped_page(driver, shipped) as base:
        driver.get(base + "/cards/0")
        assert driver.find_elements(By.TAG_NAME, "pre") == []
        assert driver.find_element(By.TAG_NAME, "h1").text.startswith("flickr8k: Show, Attend and Tell")
        headers = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "table thead th")]
        assert "CIDEr-D" in headers and len(driver.find_elements(By.CSS_SELECTOR, "table tbody tr")) >= 10
        assert "|" not in driver.find_element(By.TAG_NAME, "main").text.split("\n")[0]
        _axe_audit(axe, driver, [])
