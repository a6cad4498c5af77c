"""``captioner.files.read_json``: the one bounded JSON reader behind results, attention, vocabulary,
annotation and model-card files; each bad file is one line naming it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from captioner.data.coco import read_annotations
from captioner.errors import DataError
from captioner.evaluation.metrics import read_coco_results
from captioner.files import read_json
from captioner.text import Vocabulary
from captioner.viz.attention_json import read_attention_json


def test_reads_json_with_or_without_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text('{"a": [1, 2]}', encoding="utf-8")
    assert read_json(path, 100, DataError) == {"a": [1, 2]}
    path.write_text('\ufeff[3]', encoding="utf-8")
    assert read_json(path, 100, DataError, expect=list) == [3]


@pytest.mark.parametrize(("content", "message"), [
    (b'{"a": ', r"invalid JSON at line 1, column 7 \(Expecting value\)$"),
    (b"[" * 100_000, r"invalid JSON \(nested too deeply\)$"),
    (b'["\xff"]', r"not UTF-8 text \(byte 2\)$"),
    (b"[1]", r"expected a JSON object, got list$"),
    (b" " * 200_001, r"too large"),
], ids=["truncated", "deep", "not-utf8", "wrong-type", "too-large"])
def test_each_bad_file_is_one_line_naming_it(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(DataError, match=f"^{path}: .*{message}") as info:
        read_json(path, 200_000, DataError, "results file", expect=dict)
    assert "\n" not in str(info.value)


def test_missing_file_and_named_pipe_name_what_the_file_is(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"^{tmp_path / 'no.json'}: results file not found$"):
        read_json(tmp_path / "no.json", 100, DataError, "results file")
    pipe = tmp_path / "pipe.json"
    os.mkfifo(pipe)
    with pytest.raises(DataError, match="named pipe"):
        read_json(pipe, 100, DataError)


@pytest.mark.parametrize("reader", [read_coco_results, read_attention_json, Vocabulary.load, read_annotations])
def test_every_reader_reports_invalid_json_the_same_way(tmp_path: Path, reader) -> None:  # noqa: ANN001
    path = tmp_path / "f.json"
    path.write_text("[1,\n ]")
    with pytest.raises(DataError, match=rf"^{path}: invalid JSON at line 2, column 2 \(Expecting value\)$"):
        reader(path)


def test_results_file_must_be_a_list(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text('{"image_id": 1}')
    with pytest.raises(DataError, match=f"^{path}: expected a JSON list, got dict$"):
        read_coco_results(path)
