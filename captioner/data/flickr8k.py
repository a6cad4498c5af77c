"""The official Flickr8k distribution (Hodosh et al. 2013), as users download and unzip it.

Layout of ``--data DIR``::

    DIR/Flicker8k_Dataset/*.jpg                              (sic: "Flicker")
    DIR/Flickr8k_text/Flickr8k.token.txt                     NAME.jpg#0<TAB>caption, suffixes #0..#4
    DIR/Flickr8k_text/Flickr_8k.{train,dev,test}Images.txt   one image name per line

People unzip differently, so the text files are also taken from ``DIR/Flickr8k_text/Flickr8k_text/``
or from ``DIR`` itself, and the images from the first folder of :data:`IMAGE_DIRS` that holds the
split's first files (``pick_image_dir``). Each search order is fixed, so the result is deterministic.

Splits: ``train``, ``dev`` (``val`` is an alias), ``test`` and ``all`` (the lists that exist,
merged). The token file's known dirt is handled: blank lines, CRLF line ends and exact duplicate
captions are dropped quietly; malformed lines (no tab, no ``#n`` suffix, empty caption) are skipped
with one warning that counts them and shows the first; names that no split list holds (the
``2258277193_586949ec62.jpg.1`` entry) are ignored; an image may have more or fewer than 5
captions. Image ids are the 1-based order in which names first appear in the token file, the same
for every split; the set is named ``flickr8k``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from captioner.data.caption_set import CaptionSet, ImageRecord, build_caption_set, pick_image_dir
from captioner.errors import DataError

log = logging.getLogger(__name__)

NAME = "flickr8k"
TOKEN_FILE = "Flickr8k.token.txt"
SPLIT_FILES = {"train": "Flickr_8k.trainImages.txt", "dev": "Flickr_8k.devImages.txt",
               "test": "Flickr_8k.testImages.txt"}
ALIASES = {"val": "dev"}
ALL_SPLIT = "all"
TEXT_DIRS = ("Flickr8k_text", "Flickr8k_text/Flickr8k_text", ".")
IMAGE_DIRS = ("Flicker8k_Dataset", "Flickr8k_Dataset", "Flickr8k_Dataset/Flicker8k_Dataset",
              "Flicker8k_Dataset/Flicker8k_Dataset", "Images", "images", ".")
_KEY = re.compile(r"^(?P<name>.+)#(?P<n>\d+)$")


@dataclass
class TokenFile:
    """The parsed caption file.

    Attributes:
        captions: ``{image name: [caption, ...]}``, names in first-seen order, captions in file order.
        malformed: lines skipped as malformed.  first_malformed: ``(line number, text)`` of the first.
        duplicates: captions dropped because the same image already had that exact caption.
    """

    captions: dict[str, list[str]] = field(default_factory=dict)
    malformed: int = 0
    first_malformed: tuple[int, str] | None = None
    duplicates: int = 0


def _lines(path: Path, what: str) -> list[str]:
    """The lines of a text file (any line ends, BOM dropped); a missing file is a one-line DataError."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"{path}: file not found ({what})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def parse_token_lines(lines: list[str]) -> TokenFile:
    """Parse ``NAME#n<TAB>caption`` lines (see the module docstring for what is skipped)."""
    out = TokenFile()
    seen: dict[str, set[str]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        key, tab, caption = line.partition("\t")
        match = _KEY.match(key.strip())
        caption = " ".join(caption.split())
        if not tab or match is None or not caption:
            out.malformed += 1
            if out.first_malformed is None:
                out.first_malformed = (number, line)
            continue
        name = match["name"].strip()
        if caption in seen.setdefault(name, set()):
            out.duplicates += 1
            continue
        seen[name].add(caption)
        out.captions.setdefault(name, []).append(caption)
    return out


def read_token_file(path: Path) -> TokenFile:
    """Parse ``Flickr8k.token.txt``, warning once about malformed lines."""
    parsed = parse_token_lines(_lines(path, "the Flickr8k caption file"))
    if parsed.first_malformed is not None:
        number, text = parsed.first_malformed
        shown = text if len(text) <= 80 else text[:77] + "..."
        log.warning("%s: skipped %d malformed line(s) (no tab, no #n suffix or empty caption); first: line %d: %r",
                    path, parsed.malformed, number, shown)
    if parsed.duplicates:
        log.info("%s: dropped %d duplicate caption line(s)", path, parsed.duplicates)
    if not parsed.captions:
        raise DataError(f"{path}: no 'NAME.jpg#n<TAB>caption' line")
    return parsed


def read_split_list(path: Path, split: str) -> list[str]:
    """Image names of one split list (blank lines and repeats dropped, order kept)."""
    names = [line.strip() for line in _lines(path, f"the Flickr8k {split!r} split list")]
    return list(dict.fromkeys(n for n in names if n))


def text_dir(root: Path) -> Path | None:
    """The first of :data:`TEXT_DIRS` under ``root`` holding the token file or a split list."""
    for rel in TEXT_DIRS:
        folder = root / rel if rel != "." else root
        if (folder / TOKEN_FILE).is_file() or any((folder / f).is_file() for f in SPLIT_FILES.values()):
            return folder
    return None


def detect(root: Path) -> bool:
    """True when ``root`` is a folder with the official Flickr8k text files or image folder."""
    if not root.is_dir():
        return False
    return text_dir(root) is not None or any((root / d).is_dir() for d in IMAGE_DIRS[:2])


def load(root: Path, split: str, images_dir: Path | None = None) -> CaptionSet:
    """One split of the official layout as a caption set named ``flickr8k``.

    Args:
        root: the dataset folder (``detect(root)`` is true).
        split: ``train``, ``dev`` (or ``val``), ``test`` or ``all``.
        images_dir: the image folder, when it is none of :data:`IMAGE_DIRS`.

    Raises:
        DataError: unknown split, or a missing or unreadable file (one line naming it).
    """
    split = ALIASES.get(split, split)
    if split not in (*SPLIT_FILES, ALL_SPLIT):
        raise DataError(f"{root}: unknown split {split!r}; available: {', '.join([*SPLIT_FILES, ALL_SPLIT])} "
                        f"(val = dev)")
    folder = text_dir(root) or root / TEXT_DIRS[0]
    if split == ALL_SPLIT:
        present = [s for s in SPLIT_FILES if (folder / SPLIT_FILES[s]).is_file()] or ["train"]
        names = list(dict.fromkeys(n for s in present for n in read_split_list(folder / SPLIT_FILES[s], s)))
    else:
        names = read_split_list(folder / SPLIT_FILES[split], split)
    if not names:
        raise DataError(f"{folder / SPLIT_FILES.get(split, SPLIT_FILES['train'])}: lists no image")
    token_path = folder / TOKEN_FILE
    parsed = read_token_file(token_path)
    ids = {name: i for i, name in enumerate(parsed.captions, start=1)}
    for name in names:  # listed but never captioned: build_caption_set skips them with a warning
        ids.setdefault(name, len(ids) + 1)
    if images_dir is None:
        probe = {"images": [{"file_name": n} for n in names[:8]]}
        images_dir = pick_image_dir(probe, *[root / d if d != "." else root for d in IMAGE_DIRS])
    entries = [(ImageRecord(image_id=ids[name], file_name=name, path=images_dir / name),
                parsed.captions.get(name, [])) for name in names]
    return build_caption_set(token_path, NAME, split, entries, images_dir)
