#!/usr/bin/env python
"""Regenerate the screenshot of the ``captioner serve`` page (docs/images/serve_page.png).

    python scripts/make_serve_screenshot.py -c runs/flickr8k/sat_soft/best.safetensors \\
        --image ../shared/data/flickr8k/images/251792066_b5233b3d86.jpg --word 1
    python scripts/make_serve_screenshot.py -c soft=runs/demo/sat_soft/best.safetensors \\
        -c tf=runs/demo/transformer/best.safetensors --image scene.png --out docs/images/serve_side_by_side.png

Serves the checkpoints on 127.0.0.1 (in this process), opens the page in headless Chromium
(selenium + chromedriver, as the browser tests), uploads the image, keeps the word the page opens
on or selects word ``--word`` of the first model's best caption (0-based; with several models every
column shows that word, or says its caption lacks it) and saves a screenshot of the page
(``--size 420,900``: a phone).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--checkpoint", required=True, action="append", metavar="[NAME=]CKPT",
                        help="checkpoint (any --checkpoint spec); repeat it for models side by side")
    parser.add_argument("--image", required=True, help="photo to upload")
    parser.add_argument("--word", type=int, default=None,
                        help="word of the best caption to select (0-based; default: the one the page opens on)")
    parser.add_argument("--n-best", type=int, default=3, help="captions in the n-best list")
    parser.add_argument("--size", default="1400,1000", help="browser window WIDTH,HEIGHT")
    parser.add_argument("--style", choices=("heat", "light"), default="heat", help="style of the maps")
    parser.add_argument("--scroll", action="store_true", help="scroll the page so that the maps are in view")
    parser.add_argument("--out", default=str(REPO / "docs" / "images" / "serve_page.png"), help="PNG to write")
    args = parser.parse_args(argv)

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    import captioner
    from captioner.commands.serve import model_name
    from captioner.share.examples import example_scenes
    from captioner.share.server import ServedModel, create_app, running

    served, used = [], set()
    for value in args.checkpoint:
        name, spec = model_name(value, used)
        used.add(name)
        served.append(ServedModel(name, captioner.load(spec, device="cpu")))
    app = create_app(served, example_scenes())
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (*FLAGS, f"--window-size={args.size}", f"--user-data-dir={tempfile.mkdtemp()}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.set_window_size(*(int(v) for v in args.size.split(",")))  # the flag alone stops at 500 px wide
    wait = WebDriverWait(driver, 60)
    try:
        with running(app) as base:
            driver.get(base + "/")
            wait.until(lambda d: d.execute_script("return document.body.dataset.state === 'idle';"))
            Select(driver.find_element(By.ID, "nbest-count")).select_by_value(str(args.n_best))
            driver.find_element(By.ID, "file").send_keys(str(Path(args.image).resolve()))
            wait.until(lambda d: d.execute_script("return document.body.dataset.state === 'done';"))
            frames = driver.find_elements(By.CSS_SELECTOR, "#columns iframe")
            driver.switch_to.frame(frames[0])
            wait.until(lambda d: d.execute_script("return document.body.dataset.ready === '1';"))
            if args.style != "heat":
                Select(driver.find_element(By.ID, "style")).select_by_value(args.style)
            if args.word is not None:
                driver.find_element(By.ID, f"word-{args.word}").click()
            driver.switch_to.default_content()
            if args.scroll:  # the maps' tops at the top of the window
                driver.execute_script("const f = document.querySelector('#columns iframe'), c = "
                                      "f.contentDocument.getElementById('shown-word').getBoundingClientRect();"
                                      "window.scrollTo(0, f.getBoundingClientRect().top + window.scrollY + c.top - 8);")
            time.sleep(0.3)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.out)
    finally:
        driver.quit()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
