"""The ``captioner serve`` page in a real browser (headless Chromium via selenium + chromedriver).

Upload a scene, read the caption (the library's), hover a word and see the heat map change, pick
another n-best caption, upload a non-image and read the error; every request the page made went
to 127.0.0.1 (or never left the browser: data:, blob:, about:, chrome://). Skips where selenium, chromium or
chromedriver is missing.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
from PIL import Image

from test_browser import chrome

pytestmark = pytest.mark.slow  # starts a browser and a server

NETWORK_SCHEMES = {"http", "https", "ws", "wss", "ftp"}


@pytest.fixture(scope="module")
def driver():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with chrome("browser", "performance") as drv:
        yield drv


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint):
    """An untrained SAT model made to point: word embeddings and the attention's layers scaled up, so the
    previous word moves the hidden state and each word's map peaks somewhere else (max weight 0.3-0.7)."""
    import captioner
    from captioner.checkpoint.store import save_checkpoint
    from captioner.models.attention import AdditiveAttention

    model = captioner.load(untrained_checkpoint(tmp_path_factory.mktemp("ckpt"), "sat_soft_tiny"), device="cpu")
    with torch.no_grad():
        for module in model.model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.weight.mul_(10.0)
            if isinstance(module, AdditiveAttention):
                for layer in (module.feature_proj, module.hidden_proj, module.score):
                    layer.weight.mul_(60.0)
    path = tmp_path_factory.mktemp("peaked") / "peaked.safetensors"
    save_checkpoint(path, model.model, model.vocab)
    return captioner.load(path, device="cpu")


def _wait(drv, script: str, timeout: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout).until(lambda d: d.execute_script(script))


def _pixels(element) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(element.screenshot_as_png)).convert("RGB"), dtype=np.int16)


def test_upload_caption_hover_and_errors_all_on_127_0_0_1(driver, peaked_model, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    from captioner.data.shapes import render_scene, sample_scene
    from captioner.share.examples import example_scenes
    from captioner.share.server import ServedModel, create_app, running

    rng = np.random.default_rng(3)
    image = render_scene(rng, sample_scene(rng, 192), 192)
    photo = tmp_path / "scene.png"
    image.save(photo)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    expected = peaked_model.caption_nbest(image, n_best=3, beam=3)

    app = create_app([ServedModel("peaked", peaked_model)], example_scenes(2))
    with running(app) as base:
        driver.get_log("performance")
        driver.get(base + "/")
        _wait(driver, "return document.body.dataset.state === 'idle';")
        driver.find_element(By.ID, "file").send_keys(str(photo))
        _wait(driver, "return document.body.dataset.answers === '1';")
        assert driver.find_element(By.ID, "best").text == expected[0].text
        items = driver.find_elements(By.CSS_SELECTOR, "#nbest li .text")
        assert [li.text for li in items] == [c.text for c in expected]

        frame = driver.find_element(By.ID, "explorer")
        driver.switch_to.frame(frame)
        _wait(driver, "return document.body.dataset.ready === '1';")
        canvas = driver.find_element(By.ID, "view")
        before = _pixels(canvas)
        att = expected[0].attention  # (L, g, g): hover the word whose map differs most from the first word's
        far = int((att - att[0]).abs().flatten(1).sum(1).argmax())
        assert (att[far] - att[0]).abs().sum() > 0.5, "the test model's words all look at the same place"
        ActionChains(driver).move_to_element(driver.find_element(By.ID, f"word-{far}")).perform()
        after = _pixels(canvas)
        changed = np.abs(before - after).sum(-1) > 30
        assert changed.mean() > 0.02, "hovering another word did not change the heat map"
        driver.switch_to.default_content()

        driver.find_element(By.ID, "nbest-1").click()
        _wait(driver, "return document.body.dataset.answers === '2';")
        assert driver.find_element(By.ID, "best").text == expected[1].text

        driver.find_element(By.ID, "file").send_keys(str(notes))
        _wait(driver, "return document.body.dataset.state === 'error';")
        assert driver.find_element(By.ID, "error").text == "notes.txt: not an image file"

        driver.find_element(By.ID, "example-1").click()  # an example after an error: served again
        _wait(driver, "return document.body.dataset.state === 'done';")
        assert driver.find_element(By.ID, "error").is_displayed() is False

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
