"""The ``captioner serve`` page in a real browser (headless Chromium via selenium + chromedriver).

Upload a scene, read the caption (the library's), hover a word and see the map change, pick
another n-best caption, upload a non-image and read the error; every request the page made went
to 127.0.0.1 (or never left the browser: data:, blob:, about:, chrome://). A changed setting
captions the same photo again; the keyboard alone, or taps alone, reach, show and pin a word; two models
answer side by side with the same word shown in both; an error clears the old result and a new
photo's result names it; 500 px wide, nothing scrolls sideways; axe-core finds no accessibility
violation. Skips where selenium, chromium or chromedriver is missing.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.viz.explorer import opening_word
from test_browser import DESKTOP, chrome, viewport

pytestmark = pytest.mark.slow  # starts a browser and a server

NETWORK_SCHEMES = {"http", "https", "ws", "wss", "ftp"}


def _axe_audit(axe, driver, frames) -> dict:
    """axe-core's audit of the page and of ``frames`` (axe audits the frames it is injected in): no
    violation at all, of any impact, best practices included; then each frame audited as a document of
    its own (a landmark, a heading, everything inside a landmark). ``axe`` is
    ``axe_core_python.selenium``. Returns the page's results."""
    auditor = axe.Axe()
    for frame in frames:
        driver.switch_to.frame(frame)
        driver.execute_script(auditor.axe_script)
        driver.switch_to.default_content()
    driver.set_script_timeout(60)
    results = auditor.run(driver)
    bad = [(v["id"], v["impact"], [n["target"] for n in v["nodes"]][:3]) for v in results["violations"]]
    assert bad == []
    for frame in frames:
        driver.switch_to.frame(frame)
        try:
            alone = auditor.run(driver)
        finally:
            driver.switch_to.default_content()
        bad = [(v["id"], v["impact"], [n["target"] for n in v["nodes"]][:3]) for v in alone["violations"]]
        assert bad == [], "in the frame"
    return results


@pytest.fixture(scope="module")
def driver():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with chrome("browser", "performance") as drv:
        yield drv


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint):
    """An untrained SAT model made to point (``untrained_checkpoint.point``): each word's map peaks somewhere else."""
    import captioner

    path = untrained_checkpoint.point(untrained_checkpoint(tmp_path_factory.mktemp("ckpt"), "sat_soft_tiny"))
    return captioner.load(path, device="cpu")


@pytest.fixture(scope="module")
def tagged_model(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint):
    """An untrained SAT model with a concept head over three words (each found in every photo), its first
    layer scaled up so that each tag's map peaks somewhere of its own."""
    import captioner
    from captioner.checkpoint.store import save_checkpoint

    root = tmp_path_factory.mktemp("tagged")
    model = captioner.load(untrained_checkpoint(root, "sat_soft_tiny", concepts=("circle", "square", "triangle")),
                           device="cpu")
    with torch.no_grad():
        model.model.decoder.extension.concept_head.net[0].weight.mul_(8.0)
    path = root / "tagged.safetensors"
    save_checkpoint(path, model.model, model.vocab)
    return captioner.load(path, device="cpu")


def _wait(drv, script: str, timeout: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout).until(lambda d: d.execute_script(script))


def _pixels(element) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(element.screenshot_as_png)).convert("RGB"), dtype=np.int16)


def _serve_page(driver, models: list, examples: int = 0):
    """Serve ``models`` ((name, Captioner) pairs) and open the page; a context manager yielding the base URL."""
    import contextlib

    from captioner.share.server import example_scenes
    from captioner.share.server import ServedModel, create_app, running

    @contextlib.contextmanager
    def opened():
        app = create_app([ServedModel(name, model) for name, model in models], example_scenes(examples))
        with running(app) as base:
            driver.get(base + "/")
            _wait(driver, "return document.body.dataset.state === 'idle';")
            yield base

    return opened()


def _answers(driver) -> int:
    return int(driver.execute_script("return document.body.dataset.answers;"))


def _upload(driver, path: Path) -> None:
    from selenium.webdriver.common.by import By

    before = _answers(driver)
    driver.find_element(By.ID, "file").send_keys(str(path))
    _wait(driver, f"return +document.body.dataset.answers > {before};", timeout=120.0)  # two models on a busy machine


def _scene(tmp_path: Path, seed: int = 3, side: int = 192, name: str = "scene.png") -> tuple[Image.Image, Path]:
    from captioner.data.shapes import render_scene, sample_scene

    rng = np.random.default_rng(seed)
    image = render_scene(rng, sample_scene(rng, side), side)
    image.save(tmp_path / name)
    return image, tmp_path / name


def _words_in(driver, frame) -> list[str]:
    from selenium.webdriver.common.by import By

    driver.switch_to.frame(frame)
    _wait(driver, "return document.body.dataset.ready === '1';")
    words = [w.text for w in driver.find_elements(By.CSS_SELECTOR, "#caption .word")]
    driver.switch_to.default_content()
    return words


def _settled(driver, script: str, timeout: float = 30.0):
    """The value of ``script`` once it stays the same over three reads 150 ms apart (the frames fitted to the
    window and their maps drawn, however long that takes on a busy machine)."""
    import time

    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        seen = [*seen[-2:], driver.execute_script(script)]
        if len(seen) == 3 and seen[0] == seen[1] == seen[2]:
            return seen[-1]
        time.sleep(0.15)
    raise AssertionError(f"the page did not settle in {timeout} s: {seen}")


def test_upload_caption_hover_and_errors_all_on_127_0_0_1(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    image, photo = _scene(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    expected = peaked_model.caption_nbest(image, n_best=3, beam=3)

    driver.get_log("performance")
    with _serve_page(driver, [("peaked", peaked_model)], examples=2) as base:
        Select = pytest.importorskip("selenium.webdriver.support.ui").Select
        Select(driver.find_element(By.ID, "nbest-count")).select_by_value("3")  # no photo yet: nothing to run
        assert _answers(driver) == 0
        _upload(driver, photo)
        items = driver.find_elements(By.CSS_SELECTOR, ".nbest .text")
        assert [li.text for li in items] == [c.text for c in expected]
        scores = driver.find_elements(By.CSS_SELECTOR, ".nbest .score")
        # each caption's verdict and the model's own log-probability per word (its words and its end, divided by
        # its words; plain decoding: the search's score); the whole figure under "the numbers"
        from captioner.share.server import verdict

        best = expected[0]
        per_word = best.score / len(best.words)
        assert scores[0].text == f"{verdict(best.score, len(best.words))} \u00b7 {per_word:.2f} per word"
        driver.find_element(By.CSS_SELECTOR, ".column .numbers summary").click()
        assert driver.find_element(By.CSS_SELECTOR, ".column .score").text == (
            f"the model's own log-probability {best.score:.2f} in all \u00b7 {per_word:.2f} per word "
            f"({len(best.words)} words)")
        assert driver.find_element(By.CSS_SELECTOR, ".column .chosen .text").text == best.text
        assert driver.find_element(By.ID, "file-name").text == "scene.png"

        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        assert _words_in(driver, frame) == expected[0].words
        driver.switch_to.frame(frame)
        canvas = driver.find_element(By.ID, "view")
        before = _pixels(canvas)
        opened = int(driver.execute_script("return document.body.dataset.word;"))
        att = expected[0].attention  # (L, g, g): hover the word whose map differs most from the opening word's
        far = int((att - att[opened]).abs().flatten(1).sum(1).argmax())
        assert (att[far] - att[opened]).abs().sum() > 0.5, "the test model's words all look at the same place"
        ActionChains(driver).move_to_element(driver.find_element(By.ID, f"word-{far}")).perform()
        after = _pixels(canvas)
        changed = np.abs(before - after).sum(-1) > 30
        assert changed.mean() > 0.02, "hovering another word did not change the map"
        # the hovered word is drawn as the pinned one is, and written large by the map
        assert driver.find_element(By.ID, f"word-{far}").get_attribute("class").split() == ["word", "active"]
        assert driver.find_element(By.ID, "shown-word").text == f"\u201c{expected[0].words[far]}\u201d"
        # the PNG the page downloads: the map on show with a band naming the word and the caption under it
        shot = driver.execute_script("return window.captionerSnapshot();")
        png = np.asarray(Image.open(io.BytesIO(base64.b64decode(shot.split(",", 1)[1]))).convert("RGB"))
        size = driver.execute_script("const c = document.getElementById('view'); return [c.width, c.height];")
        assert png.shape[:2] == (size[1] + 56, size[0])
        assert (png[size[1]:] < 100).all(-1).sum() > 200, "no words drawn under the map"
        driver.switch_to.default_content()

        before = _answers(driver)
        driver.find_element(By.ID, "nbest-1").click()
        _wait(driver, f"return +document.body.dataset.answers > {before};")
        assert driver.find_element(By.ID, "nbest-1").get_attribute("aria-pressed") == "true"
        assert _words_in(driver, driver.find_element(By.CSS_SELECTOR, "#columns iframe")) == expected[1].words

        _upload(driver, notes)
        assert driver.execute_script("return document.body.dataset.state;") == "error"
        assert driver.find_element(By.ID, "error").text == "notes.txt: not an image file"
        assert driver.find_element(By.ID, "again").get_attribute("disabled")  # nothing to run again
        # the stale-result rule: no caption of the previous photo is left under the error
        assert not driver.find_element(By.ID, "result").is_displayed()
        assert driver.find_elements(By.CSS_SELECTOR, "#columns iframe") == []

        driver.find_element(By.ID, "example-1").click()  # an example after an error: served again
        _wait(driver, "return document.body.dataset.state === 'done';")
        assert driver.find_element(By.ID, "error").is_displayed() is False
        assert driver.find_element(By.ID, "file-name").text == "scene_2.png"  # the example's name

        urls = [json.loads(e["message"])["message"]["params"]["request"]["url"]
                for e in driver.get_log("performance")
                if json.loads(e["message"])["message"]["method"] == "Network.requestWillBeSent"]
    assert any(u.startswith(base + "/api/caption") for u in urls)
    # Only network schemes can leave the machine; data:, blob:, about: and the browser's own
    # chrome:// resources (the file input's icons) never do.
    network = [u for u in urls if urlsplit(u).scheme in NETWORK_SCHEMES]
    outside = [u for u in network if not u.startswith(base + "/")]
    assert outside == []
    expected_400 = "/api/caption - Failed to load resource: the server responded with a status of 400"
    severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE" and expected_400 not in e["message"]]
    # (the 400 is the non-image's answer, which the browser logs; anything else, a script error included, fails)
    assert not severe, severe


def test_a_changed_setting_captions_the_same_photo_again(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    image, photo = _scene(tmp_path, seed=5)
    with _serve_page(driver, [("peaked", peaked_model)]):
        _upload(driver, photo)
        assert "beam 3" in driver.find_element(By.CSS_SELECTOR, ".column .meta").get_attribute("textContent")
        before = _answers(driver)
        Select(driver.find_element(By.ID, "beam")).select_by_value("1")  # no new upload
        _wait(driver, f"return +document.body.dataset.answers > {before} && document.body.dataset.state === 'done';")
        assert "beam 1" in driver.find_element(By.CSS_SELECTOR, ".column .meta").get_attribute("textContent")
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        assert _words_in(driver, frame) == peaked_model.caption(image, beam=1)[0].words
        before = _answers(driver)
        Select(driver.find_element(By.ID, "beam")).select_by_value("3")
        _wait(driver, f"return +document.body.dataset.answers > {before} && document.body.dataset.state === 'done';")
        Select(driver.find_element(By.ID, "nbest-count")).select_by_value("2")
        _wait(driver, "return document.querySelectorAll('.nbest .text').length === 2 && "
                      "document.body.dataset.state === 'done';")
        before = _answers(driver)
        driver.find_element(By.ID, "again").click()
        _wait(driver, f"return +document.body.dataset.answers > {before} && document.body.dataset.state === 'done';")
        assert driver.find_element(By.ID, "file-name").text == "scene.png"


def test_the_keyboard_alone_shows_and_pins_a_word(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    image, photo = _scene(tmp_path, seed=3)
    expected = peaked_model.caption(image, beam=3, attention=True)[0]
    att = expected.attention
    opened = opening_word(expected.words)
    far = int((att - att[opened]).abs().flatten(1).sum(1).argmax())
    assert far > 0
    with _serve_page(driver, [("peaked", peaked_model)]):
        _upload(driver, photo)
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, frame)
        # every control of the page is reachable with Tab, the explorer's words included
        reached = []
        driver.execute_script("if (document.activeElement) document.activeElement.blur(); window.scrollTo(0, 0);")
        for _ in range(40):
            ActionChains(driver).send_keys(Keys.TAB).perform()
            active = driver.switch_to.active_element
            reached.append(active.get_attribute("id") or active.tag_name)
            if active.tag_name == "iframe":
                break
        assert {"file", "beam", "nbest-count", "again"} <= set(reached), reached
        driver.switch_to.frame(frame)
        canvas = driver.find_element(By.ID, "view")
        pinned = _pixels(canvas)
        while "word" not in (driver.switch_to.active_element.get_attribute("class") or ""):
            ActionChains(driver).send_keys(Keys.TAB).perform()  # into the strip: the word it shows (one Tab stop)
        word = driver.switch_to.active_element
        assert word.get_attribute("id") == f"word-{opened}", word.get_attribute("outerHTML")
        outline = driver.execute_script("return getComputedStyle(arguments[0]).outlineWidth;", word)
        assert outline == "3px"  # a focus ring one can see
        key = Keys.ARROW_RIGHT if far > opened else Keys.ARROW_LEFT
        for _ in range(abs(far - opened)):
            ActionChains(driver).send_keys(key).perform()  # the arrows step, show and pin each word's map
        assert driver.switch_to.active_element.get_attribute("id") == f"word-{far}"
        assert driver.execute_script("return document.body.dataset.shown;") == str(far)
        assert np.abs(_pixels(canvas) - pinned).sum(-1).__gt__(30).mean() > 0.02, "the arrows did not show the map"
        assert driver.execute_script("return document.body.dataset.word;") == str(far)
        ActionChains(driver).send_keys(Keys.ENTER).perform()  # Enter keeps it
        assert driver.execute_script("return document.body.dataset.word;") == str(far)
        assert driver.find_element(By.ID, f"word-{far}").get_attribute("aria-pressed") == "true"
        ActionChains(driver).send_keys(Keys.ARROW_LEFT).perform()
        assert driver.execute_script("return document.body.dataset.word;") == str(far - 1)
        ActionChains(driver).send_keys(Keys.SPACE).perform()
        assert driver.execute_script("return document.body.dataset.word;") == str(far - 1)
        driver.switch_to.default_content()


def test_two_models_side_by_side_show_the_same_word(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    image, photo = _scene(tmp_path, seed=4)
    with _serve_page(driver, [("one", peaked_model), ("two", peaked_model)]):
        assert driver.execute_script("return document.getElementById('model').value;") == ""  # all models
        _upload(driver, photo)
        columns = driver.find_elements(By.CSS_SELECTOR, "#columns .column")
        assert [c.get_attribute("data-model") for c in columns] == ["one", "two"]
        frames = driver.find_elements(By.CSS_SELECTOR, "#columns iframe")
        words = peaked_model.caption(image, beam=3)[0].words
        assert [_words_in(driver, f) for f in frames] == [words, words]
        assert frames[0].location["y"] == frames[1].location["y"]  # in columns, side by side
        target = next(i for i, w in enumerate(words) if w != words[opening_word(words)])  # not what both opened on
        driver.switch_to.frame(frames[0])
        ActionChains(driver).move_to_element(driver.find_element(By.ID, f"word-{target}")).perform()
        driver.switch_to.default_content()
        driver.switch_to.frame(frames[1])
        _wait(driver, f"return document.body.dataset.shown === '{words.index(words[target])}';")
        driver.switch_to.default_content()


def test_a_new_photo_marks_the_old_result_until_its_own_arrives(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    _, first = _scene(tmp_path, seed=3, name="first.png")
    _, second = _scene(tmp_path, seed=6, name="second.png")
    with _serve_page(driver, [("peaked", peaked_model)]):
        _upload(driver, first)
        driver.execute_script("window.fetch = (function (real) { return function () { const a = arguments;"
                              " return new Promise(function (ok) { setTimeout(function () { ok(real.apply(null, a)); },"
                              " 1500); }); }; })(window.fetch);")  # a slow answer, to look at the page meanwhile
        driver.find_element(By.ID, "file").send_keys(str(second))
        _wait(driver, "return document.body.dataset.state === 'busy';")
        assert "stale" in driver.find_element(By.ID, "result").get_attribute("class")
        assert "previous photo" in driver.find_element(By.ID, "stale-note").text
        assert driver.find_element(By.ID, "file-name").text == "second.png"
        _wait(driver, "return document.body.dataset.state === 'done';")
        assert "stale" not in driver.find_element(By.ID, "result").get_attribute("class")
        assert driver.find_element(By.ID, "file-name").text == "second.png"


def test_narrow_screen_and_accessibility_audit(driver, peaked_model, tagged_model, tmp_path: Path) -> None:
    axe = pytest.importorskip("axe_core_python.selenium")
    from selenium.webdriver.common.by import By

    _, photo = _scene(tmp_path, seed=3, side=500)
    try:
        with _serve_page(driver, [("one", peaked_model), ("two", tagged_model)]):  # the tag chips audited too
            viewport(driver, 500, 1000)
            _upload(driver, photo)
            assert driver.execute_script("return document.documentElement.scrollWidth <= "
                                         "document.documentElement.clientWidth;"), "the page scrolls sideways"
            results = _axe_audit(axe, driver, driver.find_elements(By.CSS_SELECTOR, "#columns iframe"))
            assert results["passes"], "axe checked nothing"
    finally:
        viewport(driver, *DESKTOP)


def test_taps_alone_show_and_pin_a_word(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.actions import interaction
    from selenium.webdriver.common.actions.action_builder import ActionBuilder
    from selenium.webdriver.common.actions.pointer_input import PointerInput
    from selenium.webdriver.common.by import By

    def tap(element) -> None:
        actions = ActionBuilder(driver, mouse=PointerInput(interaction.POINTER_TOUCH, "finger"))
        actions.pointer_action.move_to(element).pointer_down().pause(0.05).pointer_up()
        actions.perform()

    image, photo = _scene(tmp_path, seed=3)
    words = peaked_model.caption(image, beam=3)[0].words
    with _serve_page(driver, [("peaked", peaked_model)]):
        _upload(driver, photo)
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, frame)
        driver.switch_to.frame(frame)
        target = len(words) - 1
        tap(driver.find_element(By.ID, f"word-{target}"))
        _wait(driver, f"return document.body.dataset.word === '{target}';")
        assert driver.execute_script("return document.body.dataset.shown;") == str(target)
        assert driver.find_element(By.ID, "shown-word").text == f"\u201c{words[target]}\u201d"
        driver.switch_to.default_content()


def test_the_photos_tags_show_their_maps_by_hover_keyboard_and_tap(driver, tagged_model, peaked_model,
                                                                    tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions import interaction
    from selenium.webdriver.common.actions.action_builder import ActionBuilder
    from selenium.webdriver.common.actions.pointer_input import PointerInput
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    image, photo = _scene(tmp_path, seed=3)
    expected = tagged_model.caption(image, beam=3, attention=True)[0]
    tags = [f"{w} {p:.2f}" for w, p in expected.concepts]
    with _serve_page(driver, [("tagged", tagged_model), ("plain", peaked_model)]):
        _upload(driver, photo)
        tagged, plain = driver.find_elements(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, plain)
        driver.switch_to.frame(plain)  # a model without concepts: no row of tags
        assert driver.find_elements(By.CSS_SELECTOR, "#concepts, .chip") == []
        driver.switch_to.default_content()
        words = _words_in(driver, tagged)
        driver.switch_to.frame(tagged)
        assert driver.find_element(By.CSS_SELECTOR, "#concepts-label").text == "Tags the model sees in this photo"
        chips = driver.find_elements(By.CSS_SELECTOR, "#concepts .chip")
        assert [c.text for c in chips] == tags
        canvas = driver.find_element(By.ID, "view")
        word_map = _pixels(canvas)  # the first word, pinned
        ActionChains(driver).move_to_element(chips[0]).perform()  # hover a tag: its map, its name written large
        assert np.abs(_pixels(canvas) - word_map).sum(-1).__gt__(30).mean() > 0.02, "hovering a tag left the map"
        assert driver.find_element(By.ID, "shown-word").text == "tag: " + tags[0]
        assert chips[0].get_attribute("class").split() == ["chip", "active"]
        # the keyboard: Tab from the last word reaches the first tag, focus shows it, Enter pins, arrows step
        driver.execute_script(f"document.getElementById('word-{len(words) - 1}').focus();")
        ActionChains(driver).send_keys(Keys.TAB).perform()
        assert driver.switch_to.active_element.get_attribute("id") == "tag-0"
        assert driver.execute_script("return getComputedStyle(arguments[0]).outlineWidth;", chips[0]) == "3px"
        assert driver.execute_script("return [document.body.dataset.shown, document.body.dataset.word];") == \
            ["tag-0", "0"]
        ActionChains(driver).send_keys(Keys.TAB).perform()
        tag1 = _pixels(canvas)
        assert np.abs(tag1 - word_map).sum(-1).__gt__(30).mean() > 0.02, "focusing a tag did not show its map"
        ActionChains(driver).send_keys(Keys.ENTER).perform()
        assert driver.execute_script("return document.body.dataset.word;") == "tag-1"
        assert chips[1].get_attribute("aria-pressed") == "true"
        ActionChains(driver).send_keys(Keys.ARROW_RIGHT).perform()
        assert driver.execute_script("return document.body.dataset.word;") == "tag-2"
        assert driver.switch_to.active_element.get_attribute("id") == "tag-2"
        ActionChains(driver).send_keys(Keys.SPACE).perform()
        assert driver.execute_script("return document.body.dataset.word;") == "tag-2"
        actions = ActionBuilder(driver, mouse=PointerInput(interaction.POINTER_TOUCH, "finger"))  # a tap pins
        actions.pointer_action.move_to(chips[0]).pointer_down().pause(0.05).pointer_up()
        actions.perform()
        _wait(driver, "return document.body.dataset.word === 'tag-0';")
        assert driver.find_element(By.ID, "shown-word").text == "tag: " + tags[0]
        driver.switch_to.default_content()


# ----------------------------------------------------------------------------- the first look


@pytest.fixture(scope="module")
def a_model(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint):
    """The pointing model of ``peaked_model`` with "a" made a little more likely: its captions start with
    "a" ("a triangle a triangle ..."), each word's map peaking somewhere of its own."""
    import captioner
    from captioner.checkpoint.store import save_checkpoint

    root = tmp_path_factory.mktemp("a_first")
    model = captioner.load(untrained_checkpoint.point(untrained_checkpoint(root, "sat_soft_tiny")), device="cpu")
    with torch.no_grad():
        for module in model.model.decoder.modules():
            if isinstance(module, torch.nn.Linear) and module.out_features == len(model.vocab) and \
                    module.bias is not None:
                module.bias[model.vocab.stoi["a"]] += 1.0
    path = root / "a_first.safetensors"
    save_checkpoint(path, model.model, model.vocab)
    return captioner.load(path, device="cpu")


COCO = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "coco2017-mini" / "train2017"


def _dark_photo(tmp_path: Path, which: str) -> tuple[Image.Image, Path]:
    """A dark photo (its brightness scaled to a fifth): a synthetic scene, or a real COCO photo at 500 px."""
    if which == "scene":
        image, _ = _scene(tmp_path, seed=3, side=256)
    else:
        photos = sorted(COCO.glob("*.jpg")) if COCO.is_dir() else []
        if not photos:
            pytest.skip(f"no COCO photos in {COCO}")
        image = Image.open(photos[0]).convert("RGB")
        image.thumbnail((500, 500))
    dark = Image.fromarray((np.asarray(image, dtype=np.float32) * 0.2).round().astype(np.uint8))
    dark.save(tmp_path / "dark.png")
    return dark, tmp_path / "dark.png"


def _cell_pixels(shot: np.ndarray, image: Image.Image, box, grid: int, cells) -> np.ndarray:
    """The pixels of the canvas screenshot ``shot`` in the middle half of each (row, col) grid cell of the box."""
    sx, sy = shot.shape[1] / image.width, shot.shape[0] / image.height
    left, top, right, bottom = box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy
    cw, ch = (right - left) / grid, (bottom - top) / grid
    out = []
    for r, c in cells:
        y0, x0 = top + (r + 0.25) * ch, left + (c + 0.25) * cw
        out.append(shot[int(y0): int(y0 + ch / 2), int(x0): int(x0 + cw / 2)].reshape(-1, 3))
    return np.concatenate(out)


@pytest.mark.parametrize("which", ["scene", "photo"])
def test_the_page_opens_on_the_first_noun_with_its_peak_distinct_on_a_dark_photo(driver, a_model, tmp_path: Path,
                                                                                    which: str) -> None:
    from selenium.webdriver.common.by import By

    from captioner.viz.attention_json import on_image

    image, photo = _dark_photo(tmp_path, which)
    assert np.asarray(image).mean() < 40  # dark
    expected = a_model.caption(image, beam=3, attention=True)[0]
    assert expected.words[0] == "a", expected.words
    with _serve_page(driver, [("a", a_model)]):
        _upload(driver, photo)
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, frame)
        driver.switch_to.frame(frame)
        opened = int(driver.execute_script("return document.body.dataset.word;"))
        assert opened == opening_word(expected.words) and opened > 0  # the first noun, not "a"
        assert expected.words[opened] in {"circle", "square", "triangle"}
        assert driver.find_element(By.ID, "shown-word").text == f"\u201c{expected.words[opened]}\u201d"
        shot = _pixels(driver.find_element(By.ID, "view")).astype(np.float64)
        legend = driver.find_element(By.ID, "legend-top").text
        summary = driver.find_element(By.ID, "summary").text
        driver.switch_to.default_content()
    att = expected.attention[opened].numpy()
    g = att.shape[0]
    peak = np.unravel_index(int(att.argmax()), att.shape)
    assert 0.2 < att.max() < 0.9  # a map with a peak and attention elsewhere too
    weak = [(r, c) for r in range(g) for c in range(g) if att[r, c] <= 0.2 * att.max()]
    box = on_image(expected, image).box
    inside = _cell_pixels(shot, image, box, g, [peak]).mean()
    outside = _cell_pixels(shot, image, box, g, weak).mean()
    # the strongest region stands out from where the word hardly looked, though the photo is dark
    assert inside - outside > 60 and inside > 2.5 * outside, (inside, outside)
    # the legend's top and the sentence give the same figure: the strongest region's share
    share = f"{100 * att.max() / att.sum():.0f}"
    assert legend == f"strongest region, {share}%"
    assert f"its strongest region holds {share}% of its attention" in summary


def test_the_page_does_not_scroll_and_keyboard_focus_stays_in_view(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    photos = [_scene(tmp_path, seed=seed, name=f"scene{seed}.png")[1] for seed in (5, 6)]
    try:
        viewport(driver, 1100, 650)
        with _serve_page(driver, [("one", peaked_model), ("two", peaked_model)]):
            Select(driver.find_element(By.ID, "nbest-count")).select_by_value("3")
            for photo in photos:  # the first answer, then one that replaces it
                _upload(driver, photo)
                assert driver.execute_script("return window.scrollY;") == 0
                assert driver.execute_script("return document.getElementById('drop').getBoundingClientRect().top;") >= 0
            # Tab to "Run again" and press Enter: the button keeps the focus, in view, with its ring
            driver.execute_script("if (document.activeElement) document.activeElement.blur(); window.scrollTo(0, 0);")
            for _ in range(30):
                ActionChains(driver).send_keys(Keys.TAB).perform()
                if driver.switch_to.active_element.get_attribute("id") == "again":
                    break
            before = _answers(driver)
            ActionChains(driver).send_keys(Keys.ENTER).perform()
            _wait(driver, f"return +document.body.dataset.answers > {before} && document.body.dataset.state === 'done';")
            active = driver.switch_to.active_element
            assert active.get_attribute("id") == "again"
            rect = driver.execute_script("const r = arguments[0].getBoundingClientRect(); return [r.top, r.bottom];", active)
            assert 0 <= rect[0] and rect[1] <= driver.execute_script("return window.innerHeight;")
            assert driver.execute_script("return getComputedStyle(arguments[0]).outlineWidth;", active) == "3px"
            assert driver.execute_script("return window.scrollY;") == 0
            # a user who scrolled down to the maps stays there when the answer to a changed setting comes
            driver.execute_script("window.scrollTo(0, 120);")
            scrolled = driver.execute_script("return window.scrollY;")
            assert scrolled > 50
            before = _answers(driver)
            driver.execute_script("const s = document.getElementById('beam'); s.value = '2';"  # (selenium's Select
                                  "s.dispatchEvent(new Event('change'));")  # would scroll the select into view)
            _wait(driver, f"return +document.body.dataset.answers > {before} && document.body.dataset.state === 'done';")
            assert abs(driver.execute_script("return window.scrollY;") - scrolled) <= 10  # (a line's change of height)
    finally:
        viewport(driver, *DESKTOP)


_DROP = """
const target = arguments[0], name = arguments[1], bytes = Uint8Array.from(atob(arguments[2]), c => c.charCodeAt(0));
const data = new DataTransfer();
data.items.add(new File([bytes], name, { type: "image/png" }));
let prevented = true;
for (const type of ["dragenter", "dragover", "drop"]) {
  const event = new DragEvent(type, { dataTransfer: data, bubbles: true, cancelable: true });
  prevented = !target.dispatchEvent(event) && prevented;
}
return prevented;
"""


def test_a_photo_dropped_outside_the_box_or_on_a_map_is_captioned(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    _, photo = _scene(tmp_path, seed=4)
    png = base64.b64encode(photo.read_bytes()).decode("ascii")
    with _serve_page(driver, [("peaked", peaked_model)]) as base:
        heading = driver.find_element(By.TAG_NAME, "h1")  # well outside the dashed box
        assert not driver.execute_script("return document.getElementById('drop').contains(arguments[0]);", heading)
        before = _answers(driver)
        assert driver.execute_script(_DROP, heading, "dropped.png", png)  # the browser does not open the file
        _wait(driver, f"return +document.body.dataset.answers > {before};")
        assert driver.find_element(By.ID, "file-name").text == "dropped.png"
        assert driver.current_url == base + "/"
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")  # and on the map: the page takes it
        _words_in(driver, frame)
        before = _answers(driver)
        driver.switch_to.frame(frame)
        assert driver.execute_script(_DROP, driver.find_element(By.ID, "view"), "on_the_map.png", png)
        driver.switch_to.default_content()
        _wait(driver, f"return +document.body.dataset.answers > {before};")
        assert driver.find_element(By.ID, "file-name").text == "on_the_map.png"
        assert driver.current_url == base + "/"


def _hover(driver, frame, element_id: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    driver.switch_to.frame(frame)
    ActionChains(driver).move_to_element(driver.find_element(By.ID, element_id)).perform()
    driver.switch_to.default_content()


def _in_frame(driver, frame, script: str):
    driver.switch_to.frame(frame)
    try:
        return _wait(driver, script)
    finally:
        driver.switch_to.default_content()


def test_side_by_side_shows_the_photo_once_and_says_when_a_caption_lacks_the_word(driver, a_model, tagged_model,
                                                                                    tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    image, photo = _scene(tmp_path, seed=3, side=256)
    words = a_model.caption(image, beam=3)[0].words
    tagged = tagged_model.caption(image, beam=3, attention=True)[0]
    missing = next(w for w in words if w not in tagged.words and w in [t for t, _ in tagged.concepts])
    assert "a" not in tagged.words
    try:
        viewport(driver, 1400, 1000)
        with _serve_page(driver, [("a", a_model), ("tagged", tagged_model)]):
            _upload(driver, photo)
            left, right = driver.find_elements(By.CSS_SELECTOR, "#columns iframe")
            _words_in(driver, left), _words_in(driver, right)
            # no thumbnail: the photo is shown in each map (its toggle shows it without the map)
            assert driver.find_elements(By.CSS_SELECTOR, "#result img") == []
            for frame in (left, right):  # no photo beside the map: the map as wide as its column, or as high as
                driver.switch_to.frame(frame)  # the window allows
                assert not driver.find_element(By.ID, "photo").is_displayed()
                canvas = driver.find_element(By.ID, "view")
                natural, shown = int(canvas.get_attribute("width")), canvas.size["width"]
                room = driver.execute_script("return parseFloat(document.documentElement.style"
                                             ".getPropertyValue('--map-max'));")
                driver.switch_to.default_content()
                assert natural >= 384 and shown >= min(frame.size["width"] - 16, room) - 1, (shown, room)
            # a word the other caption lacks: that column says so and shows its tag of that name
            view_top = "return document.getElementById('view').getBoundingClientRect().top + 1;"
            top = _in_frame(driver, right, view_top)
            _hover(driver, left, f"word-{words.index(missing)}")
            tag = [t for t, _ in tagged.concepts].index(missing)
            _in_frame(driver, right, f"return document.body.dataset.shown === 'tag-{tag}';")
            driver.switch_to.frame(right)
            note = driver.find_element(By.ID, "missing")
            assert note.is_displayed() and note.text == f"No \u201c{missing}\u201d in this caption: its tag instead."
            assert driver.find_element(By.ID, "shown-word").text.startswith(f"tag: {missing} ")
            driver.switch_to.default_content()
            assert _in_frame(driver, right, view_top) == top  # the note lies over the map's top: the map stays
            # a word that is neither in its caption nor a tag: its nearest word, labelled
            _hover(driver, left, "word-0")  # "a"
            _in_frame(driver, right, "return document.getElementById('missing').textContent.indexOf("
                                     "'No \\u201ca\\u201d in this caption: its nearest word') === 0;")
            driver.switch_to.frame(right)
            assert driver.find_element(By.ID, "shown-word").text == f"\u201c{tagged.words[0]}\u201d"
            driver.switch_to.default_content()
            # a word both captions have: no note
            shared = next((w for w in words if w in tagged.words), None)
            if shared is not None:
                _hover(driver, left, f"word-{words.index(shared)}")
                _in_frame(driver, right, "return document.getElementById('missing').hidden;")
    finally:
        viewport(driver, *DESKTOP)


def test_on_a_phone_the_models_stack_one_above_the_other_and_the_frames_follow_the_window(driver, a_model, tagged_model,
                                                                                  tmp_path: Path) -> None:
    axe = pytest.importorskip("axe_core_python.selenium")
    from selenium.webdriver.common.by import By

    image, photo = _scene(tmp_path, seed=3, side=500)
    words = a_model.caption(image, beam=3)[0].words
    try:
        with _serve_page(driver, [("a", a_model), ("tagged", tagged_model)]):
            viewport(driver, 420, 900)
            width = driver.execute_script("return window.innerWidth;")
            assert width <= 440, f"the window is {width} px wide"
            _upload(driver, photo)
            left, right = driver.find_elements(By.CSS_SELECTOR, "#columns iframe")
            _words_in(driver, left), _words_in(driver, right)
            assert left.location["x"] == right.location["x"] and left.location["y"] + left.size["height"] <= right.location["y"]
            assert driver.execute_script("return document.documentElement.scrollWidth <= "
                                         "document.documentElement.clientWidth;"), "the page scrolls sideways"
            for frame in (left, right):
                driver.switch_to.frame(frame)
                assert driver.find_element(By.ID, "view").size["width"] >= 300  # the width of the screen
                driver.switch_to.default_content()
            # the same word compared: hovered on the left, shown (or said missing) on the right
            _hover(driver, left, f"word-{words.index('triangle')}")
            _in_frame(driver, right, "return document.body.dataset.shown === 'tag-2' && "
                                     "!document.getElementById('missing').hidden;")
            _axe_audit(axe, driver, (left, right))  # with the note on show
            # the frames follow the window: grown to 1400 px, no blank left under the explorer
            viewport(driver, 1400, 900)
            _wait(driver, "return Array.prototype.every.call(document.querySelectorAll('#columns iframe'), function (f) {"
                          " return Math.abs(f.offsetHeight - f.contentDocument.body.getBoundingClientRect().height) < 40;"
                          "});", timeout=10)
    finally:
        viewport(driver, *DESKTOP)


def test_a_still_pointer_does_not_change_the_word_after_a_rerun(driver, a_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    image, photo = _scene(tmp_path, seed=3)
    expected = a_model.caption(image, beam=3)[0]
    opened = opening_word(expected.words)
    other = next(i for i, w in enumerate(expected.words) if w != expected.words[opened])
    with _serve_page(driver, [("a", a_model)]):
        _upload(driver, photo)
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, frame)
        _hover(driver, frame, f"word-{other}")  # the pointer rests on another word
        _in_frame(driver, frame, f"return document.body.dataset.shown === '{other}';")
        before = _answers(driver)
        driver.execute_script("document.getElementById('again').click();")  # the pointer does not move
        _wait(driver, f"return +document.body.dataset.answers > {before} && document.body.dataset.state === 'done';")
        frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
        _words_in(driver, frame)
        import time

        time.sleep(0.5)  # time for the browser to send the mouse events of a layout change
        driver.switch_to.frame(frame)
        assert driver.execute_script("return [document.body.dataset.shown, document.body.dataset.word];") == \
            [str(opened), str(opened)]
        driver.switch_to.default_content()
