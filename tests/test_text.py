"""Tokenizer and Vocabulary: known answers, round trips, error messages."""

from __future__ import annotations

import json

import pytest

from captioner.errors import DataError
from captioner.text import SPECIALS, Vocabulary, tokenize


@pytest.mark.parametrize(
    "text, expected",
    [
        ("A man riding a horse.", ["a", "man", "riding", "a", "horse"]),
        ("Two dogs, one cat; and a bird!", ["two", "dogs", "one", "cat", "and", "a", "bird"]),
        ("A man's dog isn't here", ["a", "mans", "dog", "isnt", "here"]),
        ("A man\u2019s hat", ["a", "mans", "hat"]),  # typographic apostrophe
        ("  MIXED   Case\tTabs\nnewline ", ["mixed", "case", "tabs", "newline"]),
        ("a well-known 3-way stop", ["a", "well", "known", "3", "way", "stop"]),
        ("snake_case words", ["snake", "case", "words"]),
        ("Café crème in Zürich", ["café", "crème", "in", "zürich"]),
        ("...!?", []),
        ("", []),
    ],
)
def test_tokenize_known_answers(text: str, expected: list[str]) -> None:
    assert tokenize(text) == expected


def test_tokenize_is_idempotent_on_joined_tokens() -> None:
    text = "A Small, RED circle: to the left of a large blue square!"
    once = tokenize(text)
    assert tokenize(" ".join(once)) == once


def test_vocabulary_specials_and_order() -> None:
    vocab = Vocabulary.build(["a red circle", "a blue circle", "a red square"])
    assert vocab.itos[:4] == list(SPECIALS)
    assert (vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2, 3)
    # by decreasing frequency, ties alphabetically
    assert vocab.itos[4:] == ["a", "circle", "red", "blue", "square"]
    assert len(vocab) == 9


def test_vocabulary_encode_decode_round_trip() -> None:
    vocab = Vocabulary.build(["A small red circle.", "A large blue square."])
    ids = vocab.encode("A large red circle!")
    assert ids[0] == vocab.bos_id and ids[-1] == vocab.eos_id
    assert vocab.decode(ids) == "a large red circle"
    assert vocab.decode_tokens(ids + [vocab.pad_id, vocab.pad_id]) == ["a", "large", "red", "circle"]


def test_vocabulary_unknown_words_and_max_len() -> None:
    vocab = Vocabulary.build(["a red circle"])
    ids = vocab.encode("a green circle")
    assert ids[2] == vocab.unk_id
    assert vocab.decode(ids) == "a <unk> circle"
    assert vocab.encode("a red circle a red circle", max_len=2) == [vocab.bos_id, vocab.stoi["a"],
                                                                    vocab.stoi["red"], vocab.eos_id]


def test_vocabulary_decode_stops_at_eos() -> None:
    vocab = Vocabulary.build(["a red circle"])
    a, red = vocab.stoi["a"], vocab.stoi["red"]
    assert vocab.decode([vocab.bos_id, a, vocab.eos_id, red]) == "a"


def test_vocabulary_min_freq_cut_off() -> None:
    captions = ["a red circle", "a red square", "a blue star"]
    vocab = Vocabulary.build(captions, min_freq=2)
    assert vocab.itos[4:] == ["a", "red"]
    assert "circle" not in vocab and "a" in vocab
    with pytest.raises(DataError, match="min_freq must be >= 1, got 0"):
        Vocabulary.build(captions, min_freq=0)


def test_vocabulary_accepts_token_lists_and_max_size() -> None:
    vocab = Vocabulary.build([["x", "y", "y"], ["y", "z"]], max_size=1)
    assert vocab.itos[4:] == ["y"]


def test_vocabulary_save_load_round_trip(tmp_path) -> None:
    vocab = Vocabulary.build(["a red circle", "ünïcode wörds here"])
    path = tmp_path / "vocab.json"
    vocab.save(path)
    loaded = Vocabulary.load(path)
    assert loaded == vocab
    assert loaded.stoi == vocab.stoi
    assert json.loads(path.read_text(encoding="utf-8"))["itos"][:4] == list(SPECIALS)


def test_vocabulary_load_errors(tmp_path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(DataError, match=f"^{missing}: vocabulary file not found$"):
        Vocabulary.load(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"itos": [')
    with pytest.raises(DataError, match=f"^{bad}: invalid JSON at line 1, column 11 \\(Expecting value\\)$"):
        Vocabulary.load(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"itos": ["a", "b"]}))
    with pytest.raises(DataError, match=f"^{wrong}: vocabulary must start with"):
        Vocabulary.load(wrong)
    foreign = tmp_path / "foreign.json"
    foreign.write_text("[1, 2, 3]")
    with pytest.raises(DataError, match="not a captioner vocabulary"):
        Vocabulary.load(foreign)


def test_first_difference_names_the_first_word_that_differs():
    a, b = Vocabulary(["dog", "cat", "tree"]), Vocabulary(["dog", "tree", "cat"])
    assert a.first_difference(a) is None
    assert a.first_difference(b) == "word 5 is 'cat' here and 'tree' there"
    assert a.first_difference(Vocabulary(["dog"])) == "word 5 is 'cat' here and missing there"
    assert Vocabulary(["dog"]).first_difference(a) == "word 5 is missing here and 'cat' there"
