"""Sequence-level knowledge distillation (Kim & Rush 2016): a teacher's captions as extra targets.

``teacher_dataset(data, results, out)`` writes a dataset folder in the layout of a COCO caption
file beside ``splits.tsv`` and ``images/``: the human captions of every image, plus the teacher's
caption (a COCO results file from ``captioner evaluate --split train``, an ensemble decoding
for instance) of each training image. Other splits keep their human captions only, so validation
and scores are unchanged. A student trained on it learns the ensemble's captions at one model's
cost. The images are linked, not copied, and the folder keeps the source's name, so a feature
cache built for the source serves the student too.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from captioner.data.coco import read_json
from captioner.errors import DataError
from captioner.files import atomic_write

CAPTIONS = "captions_coco_format.json"
SPLITS = "splits.tsv"


def _write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")), error=DataError)


def _train_names(splits: Path, split: str) -> set[str]:
    try:
        with open(splits, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f, delimiter="\t"))
    except FileNotFoundError:
        raise DataError(f"{splits}: split file not found (the layout needs {SPLITS} beside {CAPTIONS})") from None
    return {row[0] for row in rows[1:] if len(row) >= 2 and row[1] == split}


def teacher_dataset(data: str | os.PathLike, results: str | os.PathLike, out: str | os.PathLike,
                    split: str = "train", keep_human: bool = True) -> dict[str, int]:
    """Write ``out/<name of data>/``: ``data``'s captions plus the teacher's for ``split``'s images.

    Args:
        data: a folder with ``captions_coco_format.json``, ``splits.tsv`` and ``images/``.
        results: the teacher's COCO results file ``[{"image_id", "caption"}]`` for ``split``.
        out: the parent folder of the new dataset (created).
        split: the split whose images get the teacher's captions.
        keep_human: False: ``split``'s images keep only the teacher's caption (Kim & Rush's
            sequence-level distillation proper); the other splits keep their human captions.

    Returns:
        ``{"images": ..., "human": ..., "teacher": ...}``: caption counts of the new file.

    Raises:
        DataError: a missing or malformed file, or a teacher caption of an image outside ``split``.
    """
    data, results = Path(data), Path(results)
    source = read_json(data / CAPTIONS)
    rows = read_json(results)
    if not isinstance(source, dict) or not isinstance(source.get("images"), list) \
            or not isinstance(source.get("annotations"), list):
        raise DataError(f"{data / CAPTIONS}: not a COCO caption file (needs 'images' and 'annotations' lists)")
    if not isinstance(rows, list):
        raise DataError(f"{results}: a COCO results file is a list of {{'image_id', 'caption'}}")
    train = _train_names(data / SPLITS, split)
    in_split = {img["id"] for img in source["images"] if img.get("file_name") in train}
    next_id = max((a["id"] for a in source["annotations"]), default=0) + 1
    teacher = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("caption"), str) or "image_id" not in row:
            raise DataError(f"{results}: entry {i} is not {{'image_id', 'caption'}}")
        if row["image_id"] not in in_split:
            raise DataError(f"{results}: image_id {row['image_id']!r} is not a {split} image of {data}; "
                            "only training images may get teacher captions")
        teacher.append({"id": next_id + i, "image_id": row["image_id"], "caption": row["caption"],
                        "teacher": True})
    target = Path(out) / data.name
    target.mkdir(parents=True, exist_ok=True)
    human = [a for a in source["annotations"] if keep_human or a.get("image_id") not in in_split]
    merged = dict(source, annotations=human + teacher)
    _write_text(target / CAPTIONS, json.dumps(merged))
    _write_text(target / SPLITS, (data / SPLITS).read_text(encoding="utf-8"))
    images = target / "images"
    if images.is_symlink() or images.exists():
        if images.resolve() != (data / "images").resolve():
            raise DataError(f"{images}: exists and is not a link to {data / 'images'}; remove it first")
    else:
        images.symlink_to((data / "images").resolve(), target_is_directory=True)
    return {"images": len(source["images"]), "human": len(human), "teacher": len(teacher)}
