"""The labels the encoder sees on the ``captioner serve`` page, in headless Chromium.

With the shipped model (EfficientNet-Lite0, whose ImageNet head names what is in the photo): the photo's
five top labels, each with its probability, are a row of chips under the caption's words; hovering one
draws its map, the keyboard reaches, shows and pins them, and axe finds no violation. Side by side with a
model whose tiny encoder has no ImageNet head, that column has no row of labels and says nothing of it,
and the two maps' top edges are level. Skips where selenium or chromium is missing.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from captioner.pretrained import PHOTOS
from captioner.viz.explorer import LABELS_LABEL
from test_browser import DESKTOP, viewport
from test_browser_page import _example, _shipped_page, shipped  # noqa: F401
from test_browser_serve import (_axe_audit, _in_frame, _pixels, _serve_page, _upload, _wait, _words_in,  # noqa: F401
                                a_model, driver)

pytestmark = pytest.mark.slow  # starts a browser and a server

PHOTO = "family_table.jpg"  # example 0 of the page


def test_the_photos_labels_show_their_maps_by_hover_and_keyboard_with_no_accessibility_violation(driver, shipped):
    axe = pytest.importorskip("axe_core_python.selenium")
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    expected = shipped.caption(PHOTOS / PHOTO, beam=3, labels=5)[0].labels
    chips_text = [f"{w} {p:.2f}" for w, p, _ in expected]
    try:
        with _shipped_page(driver, shipped):
            viewport(driver, 1280, 900)
            _example(driver)
            frame = driver.find_element(By.CSS_SELECTOR, "#columns iframe")
            words = _words_in(driver, frame)
            time.sleep(0.3)  # the frame fitted to the window
            # the map, its legend and the downloads still fit the first screen with the row of labels above the map
            bottoms = driver.execute_script(
                "const f = document.querySelector('#columns iframe'), d = f.contentDocument, r = f.getBoundingClientRect();"
                "return [r.top + d.querySelector('.legend').getBoundingClientRect().bottom,"
                "        document.querySelector('.downloads').getBoundingClientRect().bottom, window.innerHeight];")
            assert max(bottoms[:2]) <= bottoms[2], bottoms
            driver.switch_to.frame(frame)
            row = driver.find_element(By.ID, "labels")
            assert row.is_displayed() and driver.find_element(By.ID, "labels-label").text == LABELS_LABEL
            chips = driver.find_elements(By.CSS_SELECTOR, "#labels .chip")
            assert [c.text for c in chips] == chips_text and len(chips) == 5
            assert all(c.is_displayed() for c in chips)
            canvas = driver.find_element(By.ID, "view")
            word_map = _pixels(canvas)  # the word the page opened on, pinned
            opened = driver.execute_script("return document.body.dataset.word;")
            ActionChains(driver).move_to_element(chips[0]).perform()  # hover: the label's map, its name large
            assert driver.execute_script("return document.body.dataset.shown;") == "label-0"
            assert driver.find_element(By.ID, "shown-word").text == "label: " + chips_text[0]
            assert np.abs(_pixels(canvas) - word_map).sum(-1).__gt__(30).mean() > 0.02, "hovering a label left the map"
            assert driver.find_element(By.ID, "summary").text.startswith(f"The label \u201c{expected[0][0]}\u201d")
            ActionChains(driver).move_to_element(driver.find_element(By.ID, "hint")).perform()  # away: the pinned word
            _wait(driver, f"return document.body.dataset.shown === '{opened}';")
            # the keyboard: Tab from the word strip reaches the first label; focus shows it, Enter pins, arrows step
            driver.execute_script(f"document.getElementById('word-{opened}').focus();")
            ActionChains(driver).send_keys(Keys.TAB).perform()
            assert driver.switch_to.active_element.get_attribute("id") == "label-0"
            assert driver.execute_script("return [document.body.dataset.shown, document.body.dataset.word];") == \
                ["label-0", opened]
            assert driver.execute_script("return getComputedStyle(arguments[0]).outlineWidth;", chips[0]) == "3px"
            ActionChains(driver).send_keys(Keys.ENTER).perform()
            assert driver.execute_script("return document.body.dataset.word;") == "label-0"
            ActionChains(driver).send_keys(Keys.ARROW_RIGHT).perform()
            assert driver.execute_script("return document.body.dataset.word;") == "label-1"
            assert driver.switch_to.active_element.get_attribute("id") == "label-1"
            assert chips[1].get_attribute("aria-pressed") == "true"
            assert driver.find_element(By.ID, "shown-word").text == "label: " + chips_text[1]
            ActionChains(driver).send_keys(Keys.END).perform()  # the row's ends, not the words'
            assert driver.execute_script("return document.body.dataset.word;") == "label-4"
            assert words and driver.find_elements(By.CSS_SELECTOR, "#concepts") == []  # no concept detectors
            driver.switch_to.default_content()
            # the PNG download names the label shown
            name = driver.execute_script(
                "let n = null; const save = HTMLAnchorElement.prototype.click;"
                "HTMLAnchorElement.prototype.click = function () { n = this.download; };"
                "document.querySelector('.download-png').click(); HTMLAnchorElement.prototype.click = save; return n;")
            assert name == "family_table_flickr8k_caption1_label5.png"
            results = _axe_audit(axe, driver, driver.find_elements(By.CSS_SELECTOR, "#columns iframe"))
            assert results["passes"], "axe checked nothing"
    finally:
        viewport(driver, *DESKTOP)


def test_side_by_side_a_model_without_an_imagenet_head_shows_no_labels_and_the_maps_stay_level(driver, shipped,
                                                                                               a_model):
    from selenium.webdriver.common.by import By

    try:
        with _serve_page(driver, [("flickr8k", shipped), ("tiny", a_model)]):
            viewport(driver, 1280, 900)
            _upload(driver, PHOTOS / PHOTO)
            assert driver.find_element(By.ID, "error").is_displayed() is False
            left, right = driver.find_elements(By.CSS_SELECTOR, "#columns iframe")
            _words_in(driver, left), _words_in(driver, right)
            assert _in_frame(driver, left, "return document.querySelectorAll('#labels .chip').length;") == 5
            driver.switch_to.frame(right)  # the tiny encoder: no row of labels, nothing said of them
            assert driver.find_elements(By.CSS_SELECTOR, "#labels, .chip") == []
            assert "label" not in driver.find_element(By.TAG_NAME, "body").text.lower()
            driver.switch_to.default_content()
            top = ("const f = document.querySelectorAll('#columns iframe')[arguments[0]];"
                   "return f.getBoundingClientRect().top + f.contentDocument.getElementById('view').getBoundingClientRect().top;")
            time.sleep(0.3)  # the frames fitted and levelled
            tops = [driver.execute_script(top, k) for k in (0, 1)]
            assert abs(tops[0] - tops[1]) <= 1, tops  # the row of labels moved the other map down to it
            lead = _in_frame(driver, right, "return getComputedStyle(document.documentElement)"
                                            ".getPropertyValue('--lead') || 'none';")
            assert lead.strip().endswith("px") and float(lead.strip()[:-2]) > 10, lead
    finally:
        viewport(driver, *DESKTOP)
