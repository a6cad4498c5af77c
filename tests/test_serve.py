"""``captioner serve``: the FastAPI app over a real uvicorn server on 127.0.0.1 (no browser here;
``test_browser_serve.py`` drives the page in Chromium).

Checks: the page is self-contained; the answer equals the library's for the same image (n-best
included); bad uploads get one-line messages and the server keeps serving; two requests at once
each get their own answer; the command's options fail in one line; "everyday photos" decodes with
the veto and the COCO language model where a model offers it, and is refused in one line where not.
"""

from __future__ import annotations

import http.client
import io
import json
import struct
import threading
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("multipart")

from captioner.cli import main
from captioner.commands.serve import is_loopback, model_name


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def scene(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def bomb_png(width: int, height: int) -> bytes:
    """A valid 8x8 PNG whose header claims ``width`` x ``height`` (CRC fixed): decoding it would need GBs."""
    data = bytearray(png_bytes(Image.new("L", (8, 8))))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4: ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17: ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr: ihdr + 17])))
    return bytes(data)


def post(base: str, data: bytes, filename: str = "photo.png", **fields: object) -> tuple[int, dict]:
    boundary = "----captioner-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{filename}"\r\n'
                 "Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    request = urllib.request.Request(f"{base}/api/caption", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def shipped():
    import captioner

    return captioner.load("flickr8k", device="cpu")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, untrained_checkpoint):
    import captioner
    from captioner.files import MiB
    from captioner.share.server import example_scenes
    from captioner.share.server import ServedModel, ServeLimits, create_app, running

    root = tmp_path_factory.mktemp("serve")
    models = {name: captioner.load(untrained_checkpoint(root, name), device="cpu")
              for name in ("sat_soft_tiny", "transformer_tiny")}
    served = [ServedModel(name, model) for name, model in models.items()]
    app = create_app(served, example_scenes(2), ServeLimits(max_bytes=MiB // 4, max_beam=4))
    with running(app) as base:
        yield base, models


def test_page_is_self_contained(server) -> None:
    base, _ = server
    with urllib.request.urlopen(f"{base}/", timeout=30) as r:
        page = r.read().decode()
        csp = r.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp
    assert "http://" not in page and "https://" not in page and "//cdn" not in page
    assert 'id="file"' in page and "sat_soft_tiny" in page and "transformer_tiny" in page
    for path in ("/docs", "/openapi.json"):  # FastAPI's doc pages load scripts from CDNs: turned off
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(base + path, timeout=30)
    with urllib.request.urlopen(f"{base}/api/models", timeout=30) as r:
        assert [m["name"] for m in json.loads(r.read())] == ["sat_soft_tiny", "transformer_tiny"]
    with urllib.request.urlopen(f"{base}/examples/1", timeout=30) as r:
        assert Image.open(io.BytesIO(r.read())).size == (256, 256)


@pytest.mark.parametrize("name", ["sat_soft_tiny", "transformer_tiny"])
def test_answer_equals_the_library(server, name: str) -> None:
    base, models = server
    image = scene(0, (120, 90))
    status, answer = post(base, png_bytes(image), model=name, beam=3, n_best=3)
    assert status == 200, answer
    expected = models[name].caption_nbest(image, n_best=3, beam=3, all_heads=True)
    assert [c["text"] for c in answer["captions"]] == [c.text for c in expected]
    assert answer["captions"][0]["text"] == models[name].caption(image, beam=3)[0].text
    scores = [c["score"] for c in answer["captions"]]
    assert scores == sorted(scores, reverse=True)
    record = answer["captions"][0]["record"]
    assert record["format"] == "captioner-attention" and record["image_size"] == [120, 90]
    np.testing.assert_allclose(record["attention"], expected[0].attention.numpy(), atol=1e-4)
    assert ("all_attention" in record) == (name == "transformer_tiny")
    explorer = answer["captions"][0]["explorer"]
    assert explorer.startswith("<!DOCTYPE html>") and "explorer-data" in explorer
    # a tiny encoder has no ImageNet head: no labels, no row of them, no error
    assert answer["captions"][0]["labels"] is None and "labels" not in record and 'id="labels"' not in explorer


def test_bad_uploads_get_a_message_and_the_server_keeps_serving(server) -> None:
    base, _ = server
    good = png_bytes(scene(1, (64, 64)))
    cases = [
        (b"just some notes\n", "notes.txt", 400, "notes.txt: not an image file"),
        (good[: len(good) // 2], "cut.png", 400, "cut.png: truncated or corrupt image"),
        (bomb_png(9000, 9000), "bomb.png", 400, "bomb.png: image too large (9000x9000 pixels, limit 40 megapixels)"),
        (b"", "empty.jpg", 400, "empty.jpg: file is empty"),
        (good + b"\0" * (300 * 1024), "big.png", 413, "big.png: upload too large (over 256.0 KiB)"),
    ]
    for data, name, status, message in cases:
        got, answer = post(base, data, name)
        assert (got, answer["error"][: len(message)]) == (status, message), answer
        assert "\n" not in answer["error"]
        if "too large" in message:  # and what to do about it
            assert answer["error"].endswith("--max-megapixels (at most 64)" if "pixels" in message else
                                            "start captioner serve with a higher --max-upload-mb"), answer
        assert post(base, good)[0] == 200  # still serving
    got, answer = post(base, good, model="nope")
    assert got == 404 and "no model named 'nope'" in answer["error"]
    got, answer = post(base, good, beam=9)
    assert got == 400 and answer["error"] == "beam must be between 1 and 4, got 9"
    got, answer = post(base, good, beam=2, n_best=3)
    assert got == 400 and answer["error"] == "n_best must be between 1 and 2, got 3"


def test_a_50_mb_upload_is_refused_before_its_body_is_read(server) -> None:
    base, _ = server
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/api/caption")
    conn.putheader("Content-Type", "multipart/form-data; boundary=x")
    conn.putheader("Content-Length", str(50 * 1024 * 1024))
    conn.endheaders(b"--x\r\n")
    response = conn.getresponse()
    assert response.status == 413
    assert json.loads(response.read())["error"] == ("upload too large (50.0 MiB; the limit is 256.0 KiB): send a "
                                                    "smaller copy, or start captioner serve with a higher --max-upload-mb")
    conn.close()
    assert post(base, png_bytes(scene(2, (64, 64))))[0] == 200


def test_two_requests_at_once_each_get_their_own_answer(server) -> None:
    base, models = server
    images = [scene(10, (64, 64)), scene(11, (100, 70))]
    answers: list[dict] = [{}, {}]
    barrier = threading.Barrier(2)

    def ask(i: int) -> None:
        barrier.wait()
        answers[i] = post(base, png_bytes(images[i]), f"img{i}.png", model="sat_soft_tiny", beam=2, n_best=1)[1]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for image, answer, name in zip(images, answers, ("img0.png", "img1.png")):
        expected = models["sat_soft_tiny"].caption(image, beam=2, attention=True)[0]
        assert answer["file"] == name and answer["image_size"] == list(image.size)
        np.testing.assert_allclose(answer["captions"][0]["record"]["attention"], expected.attention.numpy(),
                                   atol=1e-4)


def test_model_names_and_hosts() -> None:
    assert model_name("runs/sat/best.safetensors", set()) == ("sat/best", "runs/sat/best.safetensors")
    assert model_name("soft=runs/a.safetensors", set()) == ("soft", "runs/a.safetensors")
    assert model_name("https://h/x/model.safetensors#sha256=ab", set())[0] == "x/model"
    assert model_name("https://h/m.safetensors?a=b", set())[0] != ""
    assert model_name("runs/a.safetensors", {"a"})[0] == "a-2"
    assert model_name("hf://org/repo", set())[0] == "org/repo"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")


def test_cli_errors_and_the_host_warning(tmp_path: Path, untrained_checkpoint, capsys, monkeypatch, caplog) -> None:
    import uvicorn

    ckpt = untrained_checkpoint(tmp_path, "sat_soft_tiny")
    assert main(["serve", "-c", str(ckpt), "--port", "70000"]) == 2  # refused while parsing, before the load
    assert "argument --port: must be between 0 and 65535, got 70000" in capsys.readouterr().err
    assert main(["serve", "-c", str(tmp_path / "missing.safetensors")]) == 1
    assert "missing.safetensors: checkpoint not found" in capsys.readouterr().err
    assert main(["serve", "-c", str(ckpt), "--examples", str(tmp_path / "none")]) == 1
    assert "--examples must be a folder" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: calls.append(
        {"host": server.config.host, "port": sockets[0].getsockname()[1]}))
    with caplog.at_level("WARNING"):
        assert main(["serve", "-c", str(ckpt), "--host", "0.0.0.0", "--port", "0"]) == 0
    assert calls and calls[0]["host"] == "0.0.0.0" and calls[0]["port"] > 0
    assert f"on http://0.0.0.0:{calls[0]['port']} " in capsys.readouterr().out  # the port it got, not 0
    assert any("anyone who can reach this machine" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert main(["serve", "-c", str(ckpt), "--port", "0"]) == 0
    assert calls[-1]["host"] == "127.0.0.1" and not caplog.records


def test_a_model_with_concepts_answers_with_the_photos_tags_and_their_chips(tmp_path: Path, untrained_checkpoint) -> None:
    import re

    import captioner
    from captioner.share.server import ServedModel, create_app, running
    from captioner.viz.explorer import CONCEPTS_LABEL

    tagged = captioner.load(untrained_checkpoint(tmp_path, "sat_soft_tiny", concepts=("circle", "square", "triangle")),
                            device="cpu")
    plain = captioner.load(untrained_checkpoint(tmp_path, "sat_soft_tiny"), device="cpu")
    image = scene(7, (96, 80))
    expected = tagged.caption(image, attention=True)[0].concepts
    assert [w for w, _ in expected] == ["circle", "square", "triangle"]
    app = create_app([ServedModel("tagged", tagged), ServedModel("plain", plain)])
    with running(app) as base:
        status, answer = post(base, png_bytes(image), model="tagged", beam=2, n_best=2)
        assert status == 200, answer
        for c in answer["captions"]:  # the photo's tags, the same under every caption of the n-best list
            assert c["concepts"] == [{"word": w, "prob": p} for w, p in expected]
            assert [t["word"] for t in c["record"]["concepts"]] == ["circle", "square", "triangle"]
            assert np.shape(c["record"]["concept_maps"]) == (3, 4, 4)
            chips = re.findall(r'class="chip" id="tag-\d+"[^>]*>([^<]*) <span class="prob">([^<]*)<', c["explorer"])
            assert chips == [(w, f"{p:.2f}") for w, p in expected] and CONCEPTS_LABEL in c["explorer"]
        status, answer = post(base, png_bytes(image), model="plain")
        assert status == 200 and answer["captions"][0]["concepts"] is None
        assert "concepts" not in answer["captions"][0]["record"]
        assert 'class="chip"' not in answer["captions"][0]["explorer"]
        assert CONCEPTS_LABEL not in answer["captions"][0]["explorer"]


def test_examples_follow_the_models_training_data_and_keep_their_bytes(tmp_path: Path, untrained_checkpoint,
                                                                       shipped) -> None:
    import captioner
    from captioner.errors import ImageLoadError
    from captioner.pretrained import PHOTOS
    from captioner.share.server import default_examples, folder_examples, reads_scenes

    scenes_model = captioner.load(untrained_checkpoint(tmp_path, "sat_soft_tiny"), device="cpu")
    assert not reads_scenes(shipped.vocab.itos) and reads_scenes(scenes_model.vocab.itos)
    assert not reads_scenes(["<pad>", "<bos>"]) and not reads_scenes("a dog on the grass".split())
    photos = sorted(PHOTOS.glob("*.jpg"))
    # any photo model keeps the photos (two shipped models named with -c too); a scenes model gets scenes
    for vocabularies in ([shipped.vocab.itos], [shipped.vocab.itos, shipped.vocab.itos]):
        examples = default_examples(vocabularies, PHOTOS)
        assert [e.info() for e in examples] == [{"name": p.stem, "file": p.name} for p in photos]
        assert [e.data for e in examples] == [p.read_bytes() for p in photos]  # not re-encoded
        assert {e.media_type for e in examples} == {"image/jpeg"}
    assert [e.info()["file"] for e in default_examples([scenes_model.vocab.itos], PHOTOS)] == \
        ["scene_1.png", "scene_2.png", "scene_3.png"]
    mixed = default_examples([shipped.vocab.itos, scenes_model.vocab.itos], PHOTOS)
    assert len(mixed) == len(photos) + 3
    # --examples DIR: the files as they are (a PNG stays a PNG), a bad one named
    folder = tmp_path / "mine"
    folder.mkdir()
    scene(3, (40, 30)).save(folder / "b.png")
    (folder / "a.jpg").write_bytes((PHOTOS / photos[0].name).read_bytes())
    mine = folder_examples(folder)
    assert [(e.name, e.media_type, e.info()["file"]) for e in mine] == [("a", "image/jpeg", "a.jpg"),
                                                                         ("b", "image/png", "b.png")]
    assert mine[1].data == (folder / "b.png").read_bytes()
    (folder / "c.png").write_bytes(b"not a picture")
    with pytest.raises(ImageLoadError, match="c.png"):
        folder_examples(folder)


def test_the_model_is_said_in_one_line_from_its_card_and_the_card_is_served(tmp_path: Path,
                                                                              untrained_checkpoint) -> None:
    import captioner
    from captioner.commands.serve import model_card_of
    from captioner.share.server import ServedModel, card_summary, create_app, running

    card = model_card_of("flickr8k")
    assert card_summary(card) == ("knows photos mostly of people and dogs outdoors \u00b7 Show, Attend and Tell on "
                                  "Flickr8k, reading what its encoder sees")
    assert card_summary("# `x`: A model\n\nsome text") == "A model"
    ckpt = untrained_checkpoint(tmp_path, "sat_soft_tiny")
    assert model_card_of(str(ckpt)) is None  # no card beside it
    (tmp_path / "README.md").write_text("# a project\n")
    assert model_card_of(str(ckpt)) is None  # any README is not a model card
    (tmp_path / "README.md").write_text("---\nlibrary_name: captioner\n---\n# `me/tiny`: Tiny shapes\n")
    assert model_card_of(str(ckpt)).endswith("# `me/tiny`: Tiny shapes\n") and model_card_of(str(tmp_path))
    assert model_card_of("https://example.org/model.safetensors") is None
    model = captioner.load(ckpt, device="cpu")
    plain = ServedModel("tiny", model).info()
    assert plain["about"] == "sat decoder over tiny, 12 words, trained on synthetic scenes" and not plain["card"]
    app = create_app([ServedModel("tiny", model), ServedModel("carded", model, card="# `c`: Carded <b>\n")])
    with running(app) as base:
        with urllib.request.urlopen(f"{base}/api/models", timeout=30) as r:
            assert [m["about"] for m in json.loads(r.read())][1] == "Carded <b>"
        with urllib.request.urlopen(f"{base}/", timeout=30) as r:
            page = r.read().decode()
        assert '<a href="/cards/1"' in page and '<a href="/cards/0"' not in page and "Carded &lt;b&gt;" in page
        with urllib.request.urlopen(f"{base}/cards/1", timeout=30) as r:
            assert '<h1 id="c-carded-b"><code>c</code>: Carded &lt;b&gt;</h1>' in r.read().decode()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}/cards/0", timeout=30)
        assert missing.value.code == 404 and json.loads(missing.value.read()) == {"error": "no model card for model 0"}


def test_an_example_photo_scores_as_captioner_caption_scores_its_file(server, capsys, tmp_path: Path,
                                                                       untrained_checkpoint) -> None:
    base, _ = server
    from captioner.pretrained import PHOTOS

    ckpt = untrained_checkpoint(tmp_path, "sat_soft_tiny")  # the served model's weights (the same seed)
    photo = sorted(PHOTOS.glob("*.jpg"))[0]  # a JPEG: decoded at the scale the encoder needs, as caption does
    status, answer = post(base, photo.read_bytes(), photo.name, model="sat_soft_tiny", beam=3, n_best=1)
    assert status == 200, answer
    assert main(["caption", str(photo), "--json", "-c", str(ckpt)]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["captions"][0]["text"] == row["caption"]
    assert answer["captions"][0]["score"] == pytest.approx(row["score"], abs=1e-4)


EVERYDAY_PHOTO = "family_table.jpg"  # an example photo whose caption the everyday decoding changes


def test_everyday_photos_decode_with_the_veto_and_the_language_model_where_offered(server, shipped,
                                                                                    monkeypatch) -> None:
    import captioner.inference
    from captioner.pretrained import PHOTOS
    from captioner.share.server import EVERYDAY, ServedModel, create_app, running, verdict

    _, models = server
    photo = PHOTOS / EVERYDAY_PHOTO
    plain = shipped.caption_nbest(photo, n_best=1, beam=3)[0]
    everyday = shipped.caption_nbest(photo, n_best=1, beam=3, veto=2.0, fill_slots=0.05, lm_weight=0.3)[0]
    assert everyday.text != plain.text, "the photo does not tell the two decodings apart"
    assert (EVERYDAY.veto, EVERYDAY.fill_slots, EVERYDAY.lm_weight, EVERYDAY.lm) == (2.0, 0.05, 0.3, "coco")
    searched = []  # the options each search of the server was given
    search = captioner.inference.search_features
    monkeypatch.setattr(captioner.inference, "search_features",
                        lambda decoder, features, vocab, options: searched.append(options) or
                        search(decoder, features, vocab, options))
    app = create_app([ServedModel("flickr8k", shipped), ServedModel("tiny", models["sat_soft_tiny"])])
    with running(app) as base:
        with urllib.request.urlopen(f"{base}/api/models", timeout=30) as r:
            assert [(m["name"], m["everyday"]) for m in json.loads(r.read())] == [("flickr8k", True), ("tiny", False)]
        with urllib.request.urlopen(f"{base}/", timeout=30) as r:
            assert '"everyday":true' in r.read().decode()  # the page is told which models offer it
        status, answer = post(base, photo.read_bytes(), photo.name, model="flickr8k", beam=3, n_best=1,
                              everyday="true")
        assert status == 200, answer
        assert answer["everyday"] is True and answer["captions"][0]["text"] == everyday.text
        assert answer["captions"][0]["score"] == pytest.approx(everyday.score, abs=1e-4)
        # the verdict reads the model's own log-probability of the chosen words, not the fused score
        own = answer["captions"][0]["log_prob"]
        assert own == pytest.approx(everyday.log_prob, abs=1e-4) and own != pytest.approx(everyday.score, abs=0.1)
        assert answer["captions"][0]["verdict"] == verdict(everyday.log_prob, len(everyday.words))
        assert (searched[-1].veto, searched[-1].fill_slots, searched[-1].lm_weight, searched[-1].lm,
                searched[-1].beam_size) == (2.0, 0.05, 0.3, "coco", 3)
        status, answer = post(base, photo.read_bytes(), photo.name, model="flickr8k", beam=3, n_best=1)
        assert status == 200 and answer["everyday"] is False and answer["captions"][0]["text"] == plain.text
        assert answer["captions"][0]["log_prob"] == pytest.approx(plain.score, abs=1e-4)
        assert (searched[-1].veto, searched[-1].fill_slots, searched[-1].lm_weight) == (0.0, 0.0, 0.0)
        # a model without labels: refused in one line naming it and why, before any search; plain, it answers
        count = len(searched)
        good = png_bytes(scene(4, (64, 64)))
        status, answer = post(base, good, model="tiny", everyday="true")
        assert status == 400 and answer == {"error": "model 'tiny' does not offer everyday photos: its decoder "
                                                     "does not read its encoder's labels"}
        assert len(searched) == count
        status, answer = post(base, good, model="tiny", everyday="false")
        assert status == 200 and answer["everyday"] is False
        status, answer = post(base, good, model="tiny", everyday="perhaps")
        assert status == 422 and answer["error"].startswith("bad request: everyday: ") and "\n" not in answer["error"]


@pytest.mark.parametrize("error", ["CheckpointError", "ConfigError"])
def test_a_model_whose_language_model_does_not_load_does_not_offer_everyday_photos(shipped, monkeypatch,
                                                                                    error: str) -> None:
    import captioner.errors
    import captioner.language
    from captioner.share.server import ServedModel, caption_upload

    def fails(spec: str, vocab) -> None:  # an install without the packaged file, or a model of another vocabulary
        raise getattr(captioner.errors, error)(f"language model {spec}: cannot be read here")

    monkeypatch.setattr(captioner.language, "language_model_for", fails)
    served = ServedModel("labelled", shipped)  # reads its encoder's labels, but no language model: no crash
    assert served.labels == 5 and served.info()["everyday"] is False
    with pytest.raises(captioner.errors.ConfigError) as refused:
        caption_upload(served, png_bytes(scene(5, (64, 64))), "photo.png", everyday=True)
    assert str(refused.value) == ("model 'labelled' does not offer everyday photos: language model coco: "
                                  "cannot be read here")


def test_verdicts_follow_the_bands_and_the_pixel_limit_says_what_to_do(server) -> None:
    from captioner.errors import ConfigError, ImageLoadError
    from captioner.share.server import VERDICTS, ServedModel, ServeLimits, caption_upload, verdict

    (upper, best, _), (lower, middle, _), (_, worst, _) = VERDICTS
    assert 0 > upper > lower and (best, middle, worst) == ("likely right", "unsure", "probably wrong")
    assert [verdict(upper * 10, 10), verdict(upper * 10 - 0.01, 10), verdict(lower * 4, 4),
            verdict(lower * 4 - 0.01, 4)] == [best, middle, middle, worst]
    assert verdict(upper - 0.01, 0) == middle  # no word: the end alone
    _, models = server
    photo = png_bytes(scene(3, (64, 48)))
    served = ServedModel("tiny", models["sat_soft_tiny"])
    with pytest.raises(ImageLoadError, match=r"^p\.png: image too large \(64x48 pixels, limit 3071 pixels\): shrink it"):
        caption_upload(served, photo, "p.png", limits=ServeLimits(max_pixels=64 * 48 - 1))
    answer = caption_upload(served, photo, "p.png", limits=ServeLimits(max_pixels=64 * 48))
    assert answer["captions"][0]["verdict"] in (best, middle, worst)
    with pytest.raises(ConfigError, match="max_pixels must be at most 64,000,000"):
        ServeLimits(max_pixels=64_000_001)


def test_the_model_card_is_a_page_of_html_with_its_tables() -> None:
    from captioner.commands.serve import model_card_of
    from captioner.share.page import card_html, render_card_page

    page = render_card_page("flickr8k", model_card_of("flickr8k"))
    assert "<pre" not in page and "| ---" not in page and "\n# " not in page and "`" not in page
    assert page.count("<table>") >= 2 and "<th>CIDEr-D</th>" in page and '<th scope="row">decoder</th>' in page
    assert '<a href="#how-it-was-trained">below</a>' in page and 'id="how-it-was-trained"' in page
    assert "<main>" in page and "<h1 " in page and "<ul><li>It knows Flickr8k&#x27;s world best" in page
    export = ("---\nlibrary_name: captioner\n---\n# `me/m`: M\n\n1. first\n   goes on\n2. second\n\n```python\n"
              "a < b\n```\n[x](javascript:void) ![map](overlay.png) **bold** <script>")
    assert card_html(export) == ('<h1 id="mem-m"><code>me/m</code>: M</h1>\n<ol><li>first goes on</li><li>second</li></ol>\n'
                                 "<pre><code>a &lt; b</code></pre>\n<p>x map <strong>bold</strong> &lt;script&gt;</p>")
