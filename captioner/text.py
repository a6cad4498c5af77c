"""Caption text: a regex tokenizer and the token ``Vocabulary``.

The tokenizer lowercases, drops apostrophes and splits on anything not a letter or digit; it is
the single tokenization of training targets, hypotheses and references alike (no nltk download).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence

from captioner.errors import DataError
from captioner.files import MiB, atomic_write, read_json

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
MAX_VOCAB_BYTES = 64 * MiB  # a 1M-word vocabulary is about 15 MB of JSON

# Function words: never a concept (captioner.models.concepts), free to repeat in a caption
# (DecodeOptions.no_repeat_words). Articles, pronouns, prepositions, conjunctions, auxiliaries,
# and the commonest quantity words. Content words (nouns, verbs, adjectives, colours) remain.
STOP_WORDS = frozenset("""
a an the this that these those there here it its it's he him his she her hers they them their theirs we us our
you your i me my mine one ones some any each other another both all either neither no not nor and or but so if
then than as of in on at to into onto from by with without about above below under over near beside behind
between through across along around against up down out off while during after before for toward towards
is are was were be been being am has have had having do does did doing can could will would shall should may
might must very too also just only while who whom whose which what where when why how s t
""".split())

_WORD = re.compile(r"[^\W_]+")
_APOSTROPHES = re.compile(r"['\u2019`]")


def tokenize(text: str) -> list[str]:
    """Split a caption into lowercase tokens: ``"A man's dog, running."`` -> ``["a", "mans", "dog", "running"]``."""
    return _WORD.findall(_APOSTROPHES.sub("", text.lower()))


class Vocabulary:
    """Maps tokens to ids. Ids 0..3 are ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``; ``tokens`` follow in id order."""

    def __init__(self, tokens: Sequence[str] = ()) -> None:
        self.itos: list[str] = list(SPECIALS)
        for tok in tokens:
            if tok in SPECIALS:
                continue
            self.itos.append(tok)
        self.stoi: dict[str, int] = {tok: i for i, tok in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise DataError("vocabulary has duplicate tokens")

    # ids of the special tokens
    pad_id = 0
    bos_id = 1
    eos_id = 2
    unk_id = 3

    @classmethod
    def build(cls, captions: Iterable[str | Sequence[str]], min_freq: int = 1, max_size: int | None = None,
              max_len: int | None = None) -> "Vocabulary":
        """Build from captions (raw strings or token lists), most frequent first, ties alphabetically.

        ``min_freq``: rarer tokens become ``<unk>``; ``max_size``: most ordinary tokens kept; ``max_len``:
        count only the words :meth:`encode` keeps.
        """
        if min_freq < 1:
            raise DataError(f"min_freq must be >= 1, got {min_freq}")
        counts: Counter[str] = Counter()
        for cap in captions:
            words = tokenize(cap) if isinstance(cap, str) else cap
            counts.update(words if max_len is None else list(words)[:max_len])
        kept = sorted((t for t, c in counts.items() if c >= min_freq), key=lambda t: (-counts[t], t))
        if max_size is not None:
            kept = kept[:max_size]
        return cls(kept)

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, token: str) -> bool:
        return token in self.stoi

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.itos == other.itos

    def __repr__(self) -> str:
        return f"Vocabulary(size={len(self)})"

    def first_difference(self, other: "Vocabulary") -> str | None:
        """Where ``other`` first differs, in words (``"word 12 is 'dog' here and 'cat' there"``), or None."""
        for i, (mine, theirs) in enumerate(zip(self.itos, other.itos)):
            if mine != theirs:
                return f"word {i} is {mine!r} here and {theirs!r} there"
        if len(self.itos) == len(other.itos):
            return None
        i = min(len(self.itos), len(other.itos))
        if i < len(self.itos):
            return f"word {i} is {self.itos[i]!r} here and missing there"
        return f"word {i} is missing here and {other.itos[i]!r} there"

    def encode(self, caption: str | Sequence[str], max_len: int | None = None) -> list[int]:
        """Caption -> ``[<bos>, w1 .. wn, <eos>]`` ids, at most ``max_len`` words."""
        words = tokenize(caption) if isinstance(caption, str) else list(caption)
        if max_len is not None:
            words = words[:max_len]
        return [self.bos_id] + [self.stoi.get(w, self.unk_id) for w in words] + [self.eos_id]

    def decode_tokens(self, ids: Iterable[int]) -> list[str]:
        """Ids -> words, stopping at ``<eos>`` and skipping ``<bos>``/``<pad>``."""
        words = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.bos_id, self.pad_id):
                continue
            words.append(self.itos[i] if 0 <= i < len(self.itos) else UNK)
        return words

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> caption text (words joined by spaces)."""
        return " ".join(self.decode_tokens(ids))

    def to_dict(self) -> dict:
        return {"format": "captioner-vocab", "version": 1, "itos": self.itos}

    @classmethod
    def from_dict(cls, data: dict) -> "Vocabulary":
        if not isinstance(data, dict) or not isinstance(data.get("itos"), list):
            raise DataError("not a captioner vocabulary (expected a JSON object with an 'itos' list)")
        itos = data["itos"]
        if not all(isinstance(t, str) for t in itos):
            raise DataError("vocabulary tokens must all be strings")
        if len(set(itos)) != len(itos):
            raise DataError("vocabulary has duplicate tokens")
        if [str(t) for t in itos[: len(SPECIALS)]] != list(SPECIALS):
            raise DataError(f"vocabulary must start with {list(SPECIALS)}, got {itos[:4]}")
        return cls([str(t) for t in itos[len(SPECIALS):]])

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically (temporary file, fsync, rename); DataError when it cannot be written."""
        data = json.dumps(self.to_dict(), ensure_ascii=False).encode("utf-8")
        atomic_write(path, lambda f: f.write(data), error=DataError)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Vocabulary":
        """Read a vocabulary file (a regular file of at most ``MAX_VOCAB_BYTES``)."""
        data = read_json(path, MAX_VOCAB_BYTES, DataError, "vocabulary file")
        try:
            return cls.from_dict(data)
        except DataError as exc:
            raise DataError(f"{path}: {exc}") from None


IRREGULAR_PLURALS = {"man": "men", "woman": "women", "child": "children", "person": "people"}


def plural_forms(vocab: Vocabulary) -> dict[int, list[int]]:
    """Each word's id -> the ids of its plural in the vocabulary ("dog" -> "dogs", "bus" -> "buses", "pony" ->
    "ponies", "man" -> "men"): what else meets a constraint on the word (``DecodeOptions.constrain``), and which
    slots are plural (``DecodeOptions.fill_slots``)."""
    out: dict[int, list[int]] = {}
    for i, w in enumerate(vocab.itos):
        forms = [w + "s", w + "es"] + ([w[:-1] + "ies"] if w.endswith("y") else []) + \
            ([IRREGULAR_PLURALS[w]] if w in IRREGULAR_PLURALS else [])
        ids = [vocab.stoi[f] for f in forms if f in vocab.stoi]
        if ids and i > vocab.unk_id:
            out[i] = ids
    return out
