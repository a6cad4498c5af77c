"""Fuzz-style robustness: random and mutated inputs give a result or a one-line ``CaptionerError``.

Every loader a user can point at a file (``load_image``, ``load_caption_set``, ``load_instances``,
``Vocabulary.load``, ``load_checkpoint``) is fed seeded random bytes and mutations of valid files.
Each case must either succeed (with a sane result) or raise a ``CaptionerError`` subclass whose
message is one line naming the file; any other exception type is a bug. Random unicode captions go
through ``tokenize`` / ``Vocabulary.encode`` / ``decode`` round trips. Case counts are bounded and
every test carries a timeout, so nothing can hang the suite.
"""

from __future__ import annotations

import copy
import io
import json
import random
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from captioner.data.coco import load_caption_set, load_instances
from captioner.data.images import load_image
from captioner.errors import CaptionerError, CheckpointError, DataError, ImageLoadError
from captioner.text import SPECIALS, Vocabulary, tokenize

SEED = 1234
# Values a mutation may put anywhere in a JSON document: wrong types, empty containers, huge numbers.
ODD_VALUES: list[Any] = [None, True, False, 0, -1, 7, 1.5, float("inf"), "", "x", "<pad>", [], {}, [1], [[]],
                         {"a": 1}, 2**70, -(2**63), "\u202e\U0001F600", "a\nb"]


# ----------------------------------------------------------------------------- helpers


class Outcomes:
    """Runs cases and collects every wrong outcome, so one test run reports all distinct bugs.

    A case may return anything or raise the ``expected`` ``CaptionerError`` kind with a one-line
    message (naming the file when ``path`` is given). Anything else is recorded as a failure:
    another exception type, a ``CaptionerError`` of the wrong kind, or a bad message.
    """

    def __init__(self, expected: type[CaptionerError]) -> None:
        self.expected = expected
        self.failures: dict[str, str] = {}  # distinct problem -> first case that showed it

    def run(self, call: Callable[[], Any], case: str, path: Path | None = None) -> Any:
        try:
            return call()
        except self.expected as exc:
            message = str(exc)
            if not message or "\n" in message:
                self._fail(f"{type(exc).__name__} with a message that is not one line", case, message)
            elif path is not None and str(path) not in message:
                self._fail(f"{type(exc).__name__} whose message does not name the file", case, message)
            return exc
        except Exception as exc:  # noqa: BLE001 - the point is to catch what escapes
            import traceback

            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            self._fail(f"{type(exc).__name__} escaped at {where}", case, str(exc).splitlines()[0][:200]
                       if str(exc) else "")
            return exc

    def _fail(self, problem: str, case: str, detail: str) -> None:
        self.failures.setdefault(problem, f"{case}: {detail}")

    def check(self) -> None:
        assert not self.failures, "\n".join(f"{k} (e.g. {v})" for k, v in self.failures.items())


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """One of: flip bytes, truncate, splice random bytes, duplicate a block, zero a block."""
    buf = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif kind == 1:
        del buf[rng.randrange(len(buf)):]
    elif kind == 2:
        at = rng.randrange(len(buf))
        buf[at:at] = rng.randbytes(rng.randint(1, 64))
    elif kind == 3:
        a = rng.randrange(len(buf))
        b = min(len(buf), a + rng.randint(1, 256))
        buf[a:a] = buf[a:b]
    else:
        a = rng.randrange(len(buf))
        buf[a:a + rng.randint(1, 64)] = bytes(min(64, len(buf) - a))
    return bytes(buf)


def mutate_json(doc: Any, rng: random.Random) -> Any:
    """Replace, delete, insert or retype 1-4 random nodes of a JSON document."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 4)):
        parent, key, node = None, None, doc
        for _ in range(rng.randint(1, 5)):
            if isinstance(node, dict) and node:
                parent, key = node, rng.choice(list(node))
            elif isinstance(node, list) and node:
                parent, key = node, rng.randrange(len(node))
            else:
                break
            node = parent[key]
        if parent is None:
            continue
        op = rng.randrange(4)
        if op == 0:
            parent[key] = copy.deepcopy(rng.choice(ODD_VALUES))
        elif op == 1:
            del parent[key]
        elif op == 2 and isinstance(parent, dict):
            parent[rng.choice(["id", "image_id", "caption", "file_name", "categories", "category_id", "bbox",
                               "sentences", "split", "filepath", "cocoid", "raw", "tokens"])] = \
                copy.deepcopy(rng.choice(ODD_VALUES))
        elif op == 3 and isinstance(parent, list):
            parent.append(copy.deepcopy(rng.choice(parent) if parent else rng.choice(ODD_VALUES)))
    return doc


def dump(doc: Any) -> str:
    return json.dumps(doc)  # inf/nan are written as Infinity/NaN: Python's json reads them back


def coco_captions(n: int = 3) -> dict:
    images = [{"id": i, "file_name": f"{i:05d}.png", "width": 8, "height": 8} for i in range(1, n + 1)]
    anns = [{"id": 10 * i + k, "image_id": i, "caption": f"A red circle number {k}."}
            for i in range(1, n + 1) for k in range(2)]
    return {"info": {}, "licenses": [], "images": images, "annotations": anns}


def karpathy(n: int = 3) -> dict:
    return {"dataset": "coco", "images": [
        {"filepath": "val2014", "filename": f"{i:05d}.jpg", "split": ["train", "val", "restval"][i % 3],
         "cocoid": i, "imgid": i, "sentences": [{"raw": "A dog runs.", "tokens": ["a", "dog", "runs"]}]}
        for i in range(n)]}


def coco_instances(n: int = 2) -> dict:
    doc = coco_captions(n)
    doc["categories"] = [{"id": 1, "name": "circle"}, {"id": 2, "name": "square"}]
    doc["annotations"] = [{"id": i, "image_id": i, "category_id": 1 + i % 2, "bbox": [1, 2, 3, 4], "area": 12,
                           "iscrowd": 0, "color": "red"} for i in range(1, n + 1)]
    return doc


def check_caption_set(cs: Any) -> None:
    """Invariants of any caption set a loader returns."""
    assert len(cs.images) > 0
    ids = [r.image_id for r in cs.images]
    assert all(isinstance(i, int) and not isinstance(i, bool) for i in ids) and len(set(ids)) == len(ids)
    for record in cs.images:
        assert isinstance(record.file_name, str) and record.file_name
        assert cs.captions[record.image_id], "an image without captions was kept"
        assert all(isinstance(c, str) and tokenize(c) for c in cs.captions[record.image_id])


# ----------------------------------------------------------------------------- images


def _seed_images() -> dict[str, bytes]:
    """Small valid files of several formats, the material the mutations start from."""
    out = {}
    noise = Image.effect_noise((24, 16), 60).convert("RGB")
    for fmt, kwargs in (("PNG", {}), ("JPEG", {"quality": 80}), ("GIF", {}), ("BMP", {}), ("TIFF", {}),
                        ("WEBP", {})):
        buf = io.BytesIO()
        try:
            noise.save(buf, fmt, **kwargs)
        except (KeyError, OSError):  # a format this Pillow build lacks
            continue
        out[fmt] = buf.getvalue()
    buf = io.BytesIO()
    Image.new("I;16", (9, 7), 4000).save(buf, "PNG")
    out["PNG16"] = buf.getvalue()
    frames = [Image.new("P", (10, 10), c) for c in (1, 2, 3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50)
    out["GIF-animated"] = buf.getvalue()
    return out


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` but whose IDAT holds one zlib'd byte."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00")) + chunk(b"IEND", b"")


@pytest.mark.timeout(120)
def test_load_image_on_random_and_mutated_bytes(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    seeds = _seed_images()
    assert {"PNG", "JPEG", "GIF"} <= set(seeds)
    cases: list[bytes] = [b"", b"\x00", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"BM",
                          _png_claiming(20000, 20000), _png_claiming(2**31 - 1, 1), _png_claiming(1, 1),
                          _png_claiming(0, 0)]
    cases += [rng.randbytes(rng.randint(1, 2048)) for _ in range(40)]
    names = sorted(seeds)
    while len(cases) < 200:
        data = seeds[rng.choice(names)]
        for _ in range(rng.randint(1, 3)):
            data = mutate_bytes(data, rng) or b"\x00"
        cases.append(data)

    loaded = refused = 0
    outcomes = Outcomes(ImageLoadError)
    for n, data in enumerate(cases):
        path = tmp_path / f"case{n:03d}.img"
        path.write_bytes(data)
        result = outcomes.run(lambda: load_image(path), f"case {n} ({data[:16]!r}...)", path)
        if isinstance(result, Image.Image):
            assert result.mode == "RGB" and result.width >= 1 and result.height >= 1
            result.tobytes()  # fully decoded, no lazy surprise later
            loaded += 1
        elif isinstance(result, ImageLoadError):
            refused += 1
    outcomes.check()
    assert loaded >= 5 and refused >= 50  # both branches were exercised


# ----------------------------------------------------------------------------- annotation files


def _images_folder(root: Path) -> None:
    (root / "images").mkdir(parents=True, exist_ok=True)


@pytest.mark.timeout(120)
def test_load_caption_set_on_mutated_coco_and_karpathy_json(tmp_path: Path) -> None:
    rng = random.Random(SEED + 1)
    results = {"ok": 0, "error": 0}
    outcomes = Outcomes(DataError)
    for n in range(200):
        root = tmp_path / f"case{n:03d}"
        _images_folder(root)
        if n % 2 == 0:
            path, split = root / "captions_train.json", "train"
            text = dump(mutate_json(coco_captions(), rng))
            target: Path = root
        else:
            path, split = root / "dataset_coco.json", rng.choice(["train", "val", "all"])
            text = dump(mutate_json(karpathy(), rng))
            target = path
        if n % 10 == 9:  # also cut some documents short
            text = text[: rng.randrange(len(text))]
        path.write_text(text)
        result = outcomes.run(lambda: load_caption_set(target, split), f"case {n} ({text[:300]})")
        if isinstance(result, DataError):
            results["error"] += 1
        elif not isinstance(result, Exception):
            check_caption_set(result)
            results["ok"] += 1
    outcomes.check()
    assert results["ok"] >= 10 and results["error"] >= 50


@pytest.mark.timeout(60)
def test_load_caption_set_on_random_bytes_and_hostile_json(tmp_path: Path) -> None:
    rng = random.Random(SEED + 2)
    docs = [rng.randbytes(rng.randint(0, 512)) for _ in range(30)]
    docs += [b"[" * 100_000, b'{"a":' * 50_000, b"\xff\xfe\x00\x00", "\ufeff{}".encode(),
             b'{"images": [], "annotations": []}', b'{"images": {}, "annotations": {}}', b"null", b"1e999999",
             b'{"images": [{"id": 1, "file_name": "a.png"}], "annotations": [{"id": 1, "image_id": 1, '
             b'"caption": "a cat"}], "categories": [{"id": 1, "name": "x"}]}']
    outcomes = Outcomes(DataError)
    for n, data in enumerate(docs):
        root = tmp_path / f"case{n:03d}"
        _images_folder(root)
        path = root / "captions_train.json"
        path.write_bytes(data)
        result = outcomes.run(lambda: load_caption_set(root, "train"), f"case {n} ({data[:60]!r})", path)
        if not isinstance(result, Exception):
            check_caption_set(result)
    outcomes.check()


@pytest.mark.timeout(60)
def test_load_instances_on_mutated_json(tmp_path: Path) -> None:
    rng = random.Random(SEED + 3)
    ok = 0
    outcomes = Outcomes(DataError)
    for n in range(100):
        root = tmp_path / f"case{n:03d}"
        root.mkdir()
        path = root / "instances_train.json"
        text = dump(mutate_json(coco_instances(), rng))
        path.write_text(text)
        result = outcomes.run(lambda: load_instances(root, "train"), f"case {n} ({text[:300]})", path)
        if isinstance(result, dict):
            ok += 1
            for boxes in result.values():
                for box in boxes:
                    assert isinstance(box.category, str) and len(box.bbox) == 4
                    assert all(isinstance(v, float) for v in box.bbox)
    outcomes.check()
    assert ok >= 5


# ----------------------------------------------------------------------------- vocabulary


@pytest.mark.timeout(60)
def test_vocabulary_load_on_random_and_mutated_files(tmp_path: Path) -> None:
    rng = random.Random(SEED + 4)
    good = Vocabulary(["a", "red", "circle", "\u00e9t\u00e9"]).to_dict()
    cases: list[bytes] = [b"", b"[" * 100_000, b"\xff\xfe", b"null", b"{}", b'{"itos": 5}']
    cases += [rng.randbytes(rng.randint(1, 256)) for _ in range(30)]
    cases += [dump(mutate_json(good, rng)).encode() for _ in range(100)]
    loaded = 0
    outcomes = Outcomes(DataError)
    for n, data in enumerate(cases):
        path = tmp_path / f"vocab{n:03d}.json"
        path.write_bytes(data)
        result = outcomes.run(lambda: Vocabulary.load(path), f"case {n} ({data[:60]!r})", path)
        if isinstance(result, Vocabulary):
            loaded += 1
            assert result.itos[:4] == list(SPECIALS) and len(set(result.itos)) == len(result.itos)
            result.decode(range(len(result) + 3))  # every id (and a few beyond) decodes
    outcomes.check()
    assert loaded >= 5


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from captioner.checkpoint.store import save_checkpoint
    from captioner.config import get_preset
    from captioner.models.model import build_model

    out = tmp_path_factory.mktemp("ckpt")
    vocab = Vocabulary(["a", "red", "circle"])
    torch.manual_seed(0)
    model = build_model(get_preset("sat_soft_tiny").model, len(vocab), load_pretrained=False)
    paths = {"safetensors": out / "tiny.safetensors", "torch": out / "tiny.pt"}
    save_checkpoint(paths["torch"], model, vocab, metadata={"epoch": 1})
    # A safetensors file starts with its header length; keep its first bytes away from b"\x80" and
    # b"PK" so that the seed file itself loads (those lengths are pinned by a test of their own in
    # test_reliability_checkpoints.py).
    for pad in range(64):
        save_checkpoint(paths["safetensors"], model, vocab, metadata={"epoch": 1, "pad": "x" * pad})
        head = paths["safetensors"].read_bytes()[:2]
        if head[:1] != b"\x80" and head != b"PK":
            break
    return paths


def _mutate_header(data: bytes, rng: random.Random) -> bytes:
    """Rewrite one field of a safetensors header's metadata (config, vocab, sizes) as odd JSON."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    meta = header["__metadata__"]
    key = rng.choice(["config", "vocab", "vocab_size", "aliases", "metadata", "format_version", "format"])
    if key in ("config", "vocab", "aliases", "metadata") and rng.random() < 0.7:
        meta[key] = dump(mutate_json(json.loads(meta[key]), rng))
    else:
        meta[key] = rng.choice(["", "0", "-3", "1e9", "[", "{}", "null", "99999999999999999999", "2"])
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data[8 + length:]


def _with_meta(data: bytes, key: str, value: str) -> bytes:
    """The safetensors file ``data`` with one metadata string replaced."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["__metadata__"][key] = value
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data[8 + length:]


@pytest.mark.timeout(180)
def test_load_checkpoint_on_random_truncated_and_mutated_files(tiny_checkpoints: dict[str, Path],
                                                                tmp_path: Path) -> None:
    from captioner.checkpoint.store import LoadedCheckpoint, load_checkpoint

    rng = random.Random(SEED + 5)
    st = tiny_checkpoints["safetensors"].read_bytes()
    pt = tiny_checkpoints["torch"].read_bytes()
    cases: list[tuple[str, bytes]] = [("safetensors", b""), ("safetensors", st[:8]), ("pt", pt[:100])]
    cases += [("safetensors", st[: rng.randrange(len(st))]) for _ in range(20)]
    cases += [("pt", pt[: rng.randrange(len(pt))]) for _ in range(15)]
    cases += [(rng.choice(["safetensors", "pt"]), rng.randbytes(rng.randint(1, 4096))) for _ in range(20)]
    cases += [(rng.choice(["safetensors", "pt"]), magic + rng.randbytes(rng.randint(0, 64)))
              for magic in (b"\x80", b"\x80\x02", b"PK\x03\x04", b"PK") for _ in range(3)]
    cases += [("safetensors", mutate_bytes(st, rng)) for _ in range(25)]
    cases += [("pt", mutate_bytes(pt, rng)) for _ in range(20)]
    cases += [("safetensors", _mutate_header(st, rng)) for _ in range(60)]
    cases += [("safetensors", _with_meta(st, key, "[" * 100_000)) for key in ("config", "vocab", "metadata")]
    loaded = refused = 0
    outcomes = Outcomes(CheckpointError)
    for n, (suffix, data) in enumerate(cases):
        path = tmp_path / f"case{n:03d}.{suffix}"
        path.write_bytes(data)
        result = outcomes.run(lambda: load_checkpoint(path), f"case {n} ({len(data)} bytes)", path)
        if isinstance(result, LoadedCheckpoint):
            loaded += 1
            assert len(result.vocab) == result.model.vocab_size
        elif isinstance(result, CheckpointError):
            refused += 1
        path.unlink()
    outcomes.check()
    assert loaded >= 3 and refused >= 100


# ----------------------------------------------------------------------------- captions


def _random_text(rng: random.Random) -> str:
    """Unicode soup: letters of several scripts, digits, punctuation, spaces, emoji, combining marks."""
    pools = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n\u00a0\u2003",
             ".,;:!?'\"`\u2019-_()[]{}<>/\\|@#$%^&*~", "\u00e9\u00e8\u00fc\u00df\u0130\u0131\u00c5\u00f1",
             "\u0416\u0436\u03a3\u03c3\u03c2\u05d0\u0627\u4e2d\u6587\u3042\u30a2\ud55c",
             "\U0001F600\U0001F431\u2764\ufe0f", "\u0301\u0308\u200b\u200d\ufeff\u202e"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 40)))


@pytest.mark.timeout(60)
def test_tokenize_encode_decode_round_trips_on_random_unicode(tmp_path: Path) -> None:
    rng = random.Random(SEED + 6)
    texts = [_random_text(rng) for _ in range(300)]
    vocab = Vocabulary.build(texts[:200], min_freq=1)
    path = tmp_path / "vocab.json"
    vocab.save(path)
    assert Vocabulary.load(path) == vocab  # any unicode token survives the JSON round trip

    for text in texts:
        tokens = tokenize(text)
        assert all(t and t == t.lower() and not any(c.isspace() for c in t) for t in tokens), tokens
        assert all(all(c.isalnum() for c in t) for t in tokens), tokens  # no punctuation inside a token
        assert tokenize(" ".join(tokens)) == tokens  # tokenizing is idempotent

        ids = vocab.encode(text)
        assert ids[0] == vocab.bos_id and ids[-1] == vocab.eos_id and len(ids) == len(tokens) + 2
        expected = [t if t in vocab else "<unk>" for t in tokens]
        assert vocab.decode_tokens(ids) == expected
        assert vocab.decode(ids) == " ".join(expected)
        if all(t in vocab for t in tokens):
            assert vocab.encode(vocab.decode(ids)) == ids  # text -> ids -> text -> the same ids

        short = vocab.encode(text, max_len=3)
        assert short[1:-1] == ids[1:-1][:3]

    for _ in range(100):  # arbitrary id sequences, out-of-range ones included, decode without error
        ids = [rng.randrange(-5, len(vocab) + 5) for _ in range(rng.randint(0, 20))]
        words = vocab.decode_tokens(ids)
        assert all(isinstance(w, str) and w not in ("<pad>", "<bos>", "<eos>") for w in words)
