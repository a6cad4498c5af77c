"""Models and example photos that ship inside the package, so a first caption needs no download.

``available_models()`` lists the names; ``captioner.load(name)`` (and ``-c NAME`` in every command)
loads one offline, after checking its file's SHA-256; ``model_card(name)`` is its card (data and
the data's terms, dev scores, how it was trained). ``example_photos()`` are a few CC BY photos
(``photos/CREDITS.md``) that ``captioner attend`` captions when given no photo.
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from captioner.errors import CheckpointError
from captioner.files import file_kind, file_sha256

__all__ = ["DEFAULT_MODEL", "MODELS", "PretrainedModel", "available_models", "check_model_spec", "checked_package_file",
           "example_photos", "int8_calibration", "is_model_name", "model_card", "nearest_model",
           "packaged_language_models", "pretrained_path", "unknown_model"]

PACKAGE = Path(__file__).resolve().parent
WEIGHTS = PACKAGE / "weights"
PHOTOS = PACKAGE / "photos"


@dataclass(frozen=True)
class PretrainedModel:
    """One file that ships in ``weights/``, pinned by its SHA-256: a captioning model (``kind`` "captioner",
    with its card ``weights/<card>`` and the preset ``captioner train --init NAME`` starts from) or a caption
    language model (``kind`` "language model", fused by ``DecodeOptions.lm``)."""

    name: str
    file: str
    sha256: str
    summary: str
    card: str = ""
    preset: str = ""  # the training settings ``captioner train --init NAME`` starts from
    kind: str = "captioner"
    int8: str = ""  # ``weights/<int8>``: its encoder's int8 calibration (scripts/calibrate_int8.py); "": none
    int8_sha256: str = ""


    @property
    def path(self) -> Path:
        return WEIGHTS / self.file


MODELS: dict[str, PretrainedModel] = {
    "flickr8k": PretrainedModel(
        name="flickr8k",
        file="flickr8k.safetensors",
        sha256="59582d14d634f0dd4edc4f4006a6b24d95445c92c65121ee867ae0baab57ffde",
        card="flickr8k.md",
        preset="sat_soft_flickr8k",
        int8="flickr8k.int8.json",
        int8_sha256="328aa639e9af26b467747dd1b981d67f7b486241fac86e5ea9760cae115195fc",
        summary="Show, Attend and Tell with soft attention over an EfficientNet-Lite0 whose last stage was trained "
                "with it, reading the labels of the encoder's ImageNet classifier and able to copy their words; "
                "Flickr8k, then COCO caption text; 3,301 tokens",
    ),
    "coco": PretrainedModel(
        name="coco",
        file="coco_text_lm.safetensors",
        sha256="605a7e3cc212847f8ffe44367558e716722c4da77f1251ccd4d3898b347da0e4",
        kind="language model",
        summary="an LSTM language model of COCO caption text (the dev photos' captions left out), in the "
                "vocabulary of 'flickr8k': --lm coco",
    ),
}
DEFAULT_MODEL = "flickr8k"  # what caption, attend and serve use without --checkpoint


def available_models() -> list[str]:
    """Names of the captioning models shipped with the package (``captioner.load(name)``)."""
    return sorted(name for name, entry in MODELS.items() if entry.sha256 and entry.kind == "captioner")


def packaged_language_models() -> list[str]:
    """Names of the caption language models shipped with the package (``DecodeOptions.lm``)."""
    return sorted(name for name, entry in MODELS.items() if entry.sha256 and entry.kind == "language model")


def is_model_name(spec: object) -> bool:
    """Whether ``spec`` names a shipped model; ``CheckpointError`` when it is also an existing path (ambiguous)."""
    if not (isinstance(spec, str) and spec in available_models()):
        return False
    if os.path.lexists(spec):
        kind = "folder" if os.path.isdir(spec) else "file"
        raise CheckpointError(f"{spec!r} is both a shipped model's name and a {kind} here "
                              f"({os.path.abspath(spec)}); write ./{spec} for the {kind}, or run from another "
                              "folder for the shipped model")
    return True


def nearest_model(spec: str) -> str | None:
    """The shipped model a mistyped name most likely meant (``'FLICKR8K'``, ``'flickr8k '``, ``'flikr8k'``), or None."""
    key = spec.strip().lower()
    names = available_models()
    exact = [name for name in names if name.lower() == key]
    return exact[0] if exact else next(iter(difflib.get_close_matches(key, names, n=1, cutoff=0.6)), None)


def check_model_spec(spec: object) -> None:
    """Refuse an empty or blank checkpoint name (``''`` would otherwise be the current folder)."""
    if isinstance(spec, str) and not spec.strip():
        raise CheckpointError(f"checkpoint name {spec!r} is empty: give a shipped model's name "
                              f"({', '.join(available_models()) or 'none'}), a checkpoint file, a run folder or a URL")


def unknown_model(spec: str) -> CheckpointError:
    """The one line for a bare name that is neither a file here nor a shipped model: the shipped
    models, and the nearest of them."""
    near = nearest_model(spec)
    hint = f"; did you mean {near!r}?" if near is not None else ""
    return CheckpointError(f"{spec!r}: checkpoint not found: no such file or folder, and not a shipped model "
                           f"(shipped: {', '.join(available_models()) or 'none'}){hint}")


def _entry(name: str) -> PretrainedModel:
    entry = MODELS.get(name)
    if entry is None or not entry.sha256 or entry.kind != "captioner":
        known = ", ".join(available_models()) or "none"
        raise CheckpointError(f"{name!r} is not a shipped model (shipped: {known})")
    return entry


@functools.lru_cache(maxsize=None)
def _checked(path: Path, sha256: str, size: int, mtime: float) -> None:
    """Hash the file once per process (per size and modification time)."""
    actual = file_sha256(path, CheckpointError)
    if actual != sha256:
        raise CheckpointError(f"{path}: SHA-256 {actual[:16]}... differs from the registry's {sha256[:16]}... "
                              "(a damaged or replaced file); reinstall captioner")


def pretrained_path(name: str) -> Path:
    """The file of shipped model ``name`` after checking it is a regular file with the registry's SHA-256
    (``CheckpointError`` otherwise, one line)."""
    entry = _entry(name)
    return checked_package_file(entry.path, entry.sha256, f"shipped model {name!r}")


def checked_package_file(path: Path, sha256: str, what: str) -> Path:
    """``path``, a file installed with the package, after checking it is a regular file with ``sha256``
    (``CheckpointError`` naming ``what`` otherwise, one line; the hash is read once per process and version)."""
    try:
        st = path.stat()
    except OSError:
        raise CheckpointError(f"{what}: its file {path} is missing; reinstall captioner") from None
    kind = file_kind(st.st_mode)  # a link to /dev/zero or a named pipe would never finish hashing
    if kind is not None:
        raise CheckpointError(f"{what}: its file {path} is a {kind}, not a regular file; reinstall captioner")
    _checked(path, sha256, st.st_size, st.st_mtime)
    return path


def int8_calibration(name: str) -> Path | None:
    """The int8 calibration file of shipped model ``name`` after checking its SHA-256; None when it has none."""
    entry = _entry(name)
    if not entry.int8:
        return None
    return checked_package_file(WEIGHTS / entry.int8, entry.int8_sha256, f"the int8 calibration of {name!r}")


def model_card(name: str) -> str:
    """The model card (Markdown) of shipped model ``name``."""
    return (WEIGHTS / _entry(name).card).read_text(encoding="utf-8")


def example_photos() -> list[Path]:
    """The example photos shipped with the package (credits: ``photos/CREDITS.md``)."""
    return sorted(PHOTOS.glob("*.jpg"))
