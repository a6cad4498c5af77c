"""The HTML explorer in a real browser: headless Chromium through selenium + chromedriver.

Skips cleanly when selenium, chromium or chromedriver is missing.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from captions import make_caption

pytestmark = pytest.mark.slow  # starts a browser; needs chromium and chromedriver

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1100,900")


@contextmanager
def chrome(*logs: str) -> Iterator[Any]:
    """A headless Chromium driver that keeps the given logs (``"browser"``, ``"performance"``), quit
    and its profile removed afterwards; the test skips where selenium or chromium is absent."""
    webdriver = pytest.importorskip("selenium.webdriver")
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("chromium/chromedriver not installed")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="captioner-chrome-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", dict.fromkeys(logs, "ALL"))
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    drv.set_page_load_timeout(30)
    viewport(drv, *DESKTOP)
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


DESKTOP = (1100, 900)  # every test's page window, unless it sizes its own


def viewport(drv, width: int, height: int, mobile: bool = False) -> None:
    """Make the page's window (innerWidth x innerHeight) exactly ``width`` x ``height``, whatever the size of
    Chromium's own window and however busy the machine: DevTools' ``Emulation.setDeviceMetricsOverride``
    sizes the viewport itself (a resized window reaches the page a little later, and on a loaded machine
    after the test has read it). ``mobile``: a phone's viewport (overlay scroll bars, the page's
    ``<meta name="viewport">`` honoured: open such a page first, as a page without one is laid out 980 px
wide). Returns once the page sees the new size (its resize event fired)."""
    drv.switch_to.default_content()  # the page's window, not a frame's
    drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})
    _wait_for(drv, f"return window.innerWidth === {width} && window.innerHeight === {height};")


@pytest.fixture(scope="module")
def driver():
    with chrome("browser") as drv:
        yield drv


def _canvas_pixels(element) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(element.screenshot_as_png)).convert("RGB"), dtype=np.int16)


def _wait_for(drv, script: str, timeout: float = 10.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout).until(lambda d: d.execute_script(script))


@pytest.mark.parametrize("with_layers", [False, True], ids=["lstm", "transformer"])
def test_explorer_word_selection_changes_heat_map(driver, tmp_path, with_layers):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from captioner.viz.overlays import write_overlays

    words = ["a", "red", "circle", "below"]
    att = np.zeros((4, 4, 4), dtype=np.float32)
    for i, (r, c) in enumerate([(0, 0), (3, 3), (0, 3), (3, 0)]):  # each word looks at another corner
        att[i, r, c] = 1.0
    all_att = None
    if with_layers:  # (L, layers=2, heads=3, g, g): last-layer mean == att
        all_att = np.repeat(np.repeat(att[:, None, None], 2, axis=1), 3, axis=2)
        all_att[:, 0] = 1 / 16  # the first layer looks everywhere
    image = Image.fromarray(np.full((120, 240, 3), 140, dtype=np.uint8))
    paths = write_overlays(image, make_caption(words, att, (60, 0, 180, 120), all_att), tmp_path)

    driver.get_log("browser")  # drop entries from earlier pages
    driver.get(paths["html"].resolve().as_uri())
    _wait_for(driver, "return document.body.dataset.ready === '1';")
    canvas = driver.find_element(By.ID, "view")
    assert canvas.size["width"] > 0
    selectors = driver.find_element(By.ID, "selectors")
    assert selectors.is_displayed() == with_layers
    if with_layers:
        assert driver.execute_script("return document.getElementById('layer').value;") == "1"  # last layer
        assert driver.execute_script("return document.getElementById('head').value;") == "mean"

    # it opens on the first noun, "circle", not on "a"
    assert driver.execute_script("return document.body.dataset.word;") == "2"
    assert driver.find_element(By.ID, "shown-word").text == "\u201ccircle\u201d"
    driver.find_element(By.ID, "word-0").click()
    _wait_for(driver, "return document.body.dataset.word === '0';")
    first = _canvas_pixels(canvas)
    driver.find_element(By.ID, "word-1").click()
    _wait_for(driver, "return document.body.dataset.word === '1';")
    second = _canvas_pixels(canvas)
    assert first.shape == second.shape
    changed = np.abs(first - second).sum(-1) > 30
    assert changed.mean() > 0.02, "selecting another word did not change the heat map"
    # word 0 looks top-left of the box, word 1 bottom-right: the lit region (the heat map's top) moves accordingly
    h, w = first.shape[:2]
    lit = lambda px: np.percentile(px.sum(-1), 97)  # noqa: E731  (the brightest pixels of a quarter: its peak)
    assert lit(first[: h // 2, w // 4: w // 2]) > 1.5 * lit(first[h // 2:, w // 2: 3 * w // 4])
    assert lit(second[h // 2:, w // 2: 3 * w // 4]) > 1.5 * lit(second[: h // 2, w // 4: w // 2])

    driver.find_element(By.TAG_NAME, "body").send_keys(Keys.ARROW_RIGHT)
    _wait_for(driver, "return document.body.dataset.word === '2';")
    if with_layers:  # a selector that reports only "change" (as some browsers and assistive tools do) redraws too
        before = _canvas_pixels(canvas)
        driver.execute_script("const s = document.getElementById('layer'); s.value = '0';"
                              "s.dispatchEvent(new Event('change'));")
        assert (np.abs(_canvas_pixels(canvas) - before).sum(-1) > 30).mean() > 0.02, "a change event drew nothing"
    if with_layers:  # a different head's map is drawn without errors
        driver.execute_script("const s = document.getElementById('head'); s.value = '0';"
                              "s.dispatchEvent(new Event('input'));")
    severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, severe
