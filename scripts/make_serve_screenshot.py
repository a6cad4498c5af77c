#!/usr/bin/env python
"""Regenerate the screenshots of the ``captioner serve`` page (docs/images/serve_page.png, serve_phone.png).

    python scripts/make_serve_screenshot.py                      # the shipped model, example photo 1, 1280x900
    python scripts/make_serve_screenshot.py --size 390,844 --n-best 1 --out docs/images/serve_phone.png
    python scripts/make_serve_screenshot.py --everyday --out everyday.png   # with "everyday photos" checked
    python scripts/make_serve_screenshot.py -c soft=runs/demo/sat_soft/best.safetensors \\
        -c tf=runs/demo/transformer/best.safetensors --image scene.png --out side_by_side.png

Serves the checkpoints (default: the shipped model) on 127.0.0.1 in this process, with the examples
``captioner serve`` offers them and their model cards, opens the page in headless Chromium (selenium +
chromedriver, as the browser tests) with a window of exactly ``--size`` (the page's innerWidth x
innerHeight), uploads ``--image`` or clicks example ``--example``, keeps the word the page opens on or
selects word ``--word`` of the first model's best caption (0-based; with several models every column
shows that word, or says its caption lacks it) or the photo's label ``--label`` (the chips of a model whose
encoder has an ImageNet head), with "everyday photos" checked for ``--everyday``, and saves a screenshot of
the first screen.
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
    parser.add_argument("-c", "--checkpoint", action="append", metavar="[NAME=]CKPT",
                        help="checkpoint (any --checkpoint spec; default: the shipped model); repeat it for models "
                             "side by side")
    parser.add_argument("--image", default=None, help="photo to upload (default: click example --example)")
    parser.add_argument("--example", type=int, default=0, help="the example to click when no --image (0-based)")
    parser.add_argument("--word", type=int, default=None,
                        help="word of the best caption to select (0-based; default: the one the page opens on)")
    parser.add_argument("--label", type=int, default=None,
                        help="label of the photo to select instead (0-based: the most probable first)")
    parser.add_argument("--n-best", type=int, default=3, help="captions in the n-best list")
    parser.add_argument("--size", default="1280,900", help="the page's window WIDTH,HEIGHT")
    parser.add_argument("--style", choices=("heat", "light"), default="heat", help="style of the maps")
    parser.add_argument("--scroll", action="store_true", help="scroll the page so that the maps are in view")
    parser.add_argument("--everyday", action="store_true",
                        help='check "everyday photos" (for the models that offer it) before the photo is captioned')
    parser.add_argument("--out", default=str(REPO / "docs" / "images" / "serve_page.png"), help="PNG to write")
    args = parser.parse_args(argv)

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    import captioner
    from captioner.commands.caption import default_model
    from captioner.commands.serve import model_card_of, model_name
    from captioner.pretrained import PHOTOS
    from captioner.share.server import default_examples
    from captioner.share.server import ServedModel, create_app, running

    served, used = [], set()
    for value in args.checkpoint or [default_model()]:
        name, spec = model_name(value, used)
        used.add(name)
        served.append(ServedModel(name, captioner.load(spec, device="cpu"), card=model_card_of(spec)))
    app = create_app(served, default_examples([m.captioner.vocab.itos for m in served], PHOTOS))
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in (*FLAGS, f"--window-size={args.size}", f"--user-data-dir={tempfile.mkdtemp()}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    width, height = (int(v) for v in args.size.split(","))
    # the page's window exactly WIDTH x HEIGHT, sized by DevTools (a phone's viewport below 600 px wide)
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                                   "deviceScaleFactor": 1, "mobile": width < 600})
    wait = WebDriverWait(driver, 60)
    try:
        with running(app) as base:
            driver.get(base + "/")
            wait.until(lambda d: d.execute_script("return document.body.dataset.state === 'idle';"))
            Select(driver.find_element(By.ID, "nbest-count")).select_by_value(str(args.n_best))
            if args.everyday:
                driver.find_element(By.ID, "everyday").click()
            if args.image:
                driver.find_element(By.ID, "file").send_keys(str(Path(args.image).resolve()))
            else:
                driver.find_element(By.ID, f"example-{args.example}").click()
            wait.until(lambda d: d.execute_script("return document.body.dataset.state === 'done';"))
            frames = driver.find_elements(By.CSS_SELECTOR, "#columns iframe")
            driver.switch_to.frame(frames[0])
            wait.until(lambda d: d.execute_script("return document.body.dataset.ready === '1';"))
            if args.style != "heat":
                Select(driver.find_element(By.ID, "style")).select_by_value(args.style)
            if args.word is not None:
                driver.find_element(By.ID, f"word-{args.word}").click()
            if args.label is not None:
                driver.find_element(By.ID, f"label-{args.label}").click()
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
