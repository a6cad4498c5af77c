"""A language model of captions, learnt from caption text alone, fused into the search (shallow fusion).

A captioner learns its sentences from the captions under its training photos: a Flickr8k model writes
"a man in a red shirt is ..." where a photo of a kitchen needs "a kitchen with a stove and ...". Caption
text without photos (COCO's, Flickr30k's) is plentiful. :class:`CaptionLanguageModel` is an LSTM language
model over a captioner's own vocabulary, trained on such text (``captioner lm``); ``DecodeOptions.lm_weight``
w > 0 adds ``w * log P_lm(word | the words so far)`` to the captioner's log-probability of every word the
search weighs (shallow fusion, Gulcehre et al. 2015, *On Using Monolingual Corpora in Neural Machine
Translation*). The captioner still chooses what it sees; the language model tells it how people write
about it. ``DecodeOptions.lm`` names the file, or ``"coco"``, the one that ships with the package
(COCO caption text, the vocabulary of the shipped ``flickr8k`` model).

Shape legend: B captions, T words, R search rows, V vocabulary, E embedding width, H LSTM width.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from captioner.checkpoint.store import check_weights
from captioner.config.schema import check_number
from captioner.errors import CheckpointError, ConfigError, DataError, one_line
from captioner.files import atomic_write, check_regular, read_json
from captioner.models.base import State, WrappedDecoder
from captioner import pretrained
from captioner.text import Vocabulary

__all__ = ["FORMAT", "CaptionLanguageModel", "FusedDecoder", "LanguageModelConfig", "caption_texts",
           "fusion_unavailable", "language_model_for", "load_language_model", "save_language_model", "train_language_model"]

FORMAT = "captioner-lm"  # the ``format`` metadata of a language model file
VERSION = 1
MAX_LM_BYTES = 1 << 30  # a language model file larger than this is refused unread
MAX_CAPTION_FILE_BYTES = 1 << 30  # a caption JSON larger than this is refused unread
MAX_WORDS = 20  # words of a caption the model reads (a search writes at most DecodeOptions.max_len)


@dataclass(frozen=True)
class LanguageModelConfig:
    """The widths of a :class:`CaptionLanguageModel` (stored in its file)."""

    vocab_size: int
    embed_dim: int = 256
    hidden_dim: int = 512
    dropout: float = 0.3

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "hidden_dim"):
            check_number(f"language model {name}", getattr(self, name), lambda v: 1 <= v <= 1 << 20,
                         f"a whole number from 1 to {1 << 20}", int)
        check_number("language model dropout", self.dropout, lambda v: 0.0 <= v < 1.0, "in [0, 1)")


class CaptionLanguageModel(nn.Module):
    """An LSTM language model: ``<bos>`` and the words so far -> the next word (``<eos>`` ends a caption)."""

    def __init__(self, config: LanguageModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        self.lstm = nn.LSTM(config.embed_dim, config.hidden_dim, batch_first=True)
        self.drop = nn.Dropout(config.dropout)
        self.out = nn.Linear(config.hidden_dim, config.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T), ``<bos>`` first -> logits (B, T, V): position t predicts token t + 1."""
        hidden, _ = self.lstm(self.drop(self.embed(tokens)))
        return self.out(self.drop(hidden))

    def initial_state(self, rows: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(h, c), each (R, H) zeros: the state before ``<bos>``."""
        zeros = torch.zeros(rows, self.config.hidden_dim, device=device)
        return zeros, zeros.clone()

    def step(self, prev: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The previous word (R,) and (h, c) (R, H) each -> next-word log-probabilities (R, V) and the new state."""
        h, c = (s.unsqueeze(0).contiguous() for s in state)  # (1, R, H): nn.LSTM's layout
        hidden, (h, c) = self.lstm(self.embed(prev).unsqueeze(1), (h, c))  # (R, 1, H)
        return F.log_softmax(self.out(hidden[:, 0]).float(), dim=-1), (h[0], c[0])


class FusedDecoder(WrappedDecoder):
    """``decoder`` with a language model's word scores added (shallow fusion): what the search steps.

    ``step`` returns ``log P_decoder(y) + weight * log P_lm(y)`` for every word y; the attention is the
    decoder's. The language model's (h, c) ride in ``State.dynamic`` beside the decoder's, so beams that
    move take theirs along. The decoder's extension (a label reading) and the step's ``State.outputs``
    are the wrapped decoder's own.
    """

    def __init__(self, decoder: nn.Module, lm: CaptionLanguageModel, weight: float) -> None:
        if lm.config.vocab_size != decoder.vocab_size:
            raise ConfigError(f"the language model has {lm.config.vocab_size} words and the decoder "
                              f"{decoder.vocab_size}: they must share one vocabulary")
        super().__init__(decoder)
        self.lm, self.weight = lm, float(weight)

    def init_state(self, features: torch.Tensor) -> State:
        inner = self.decoder.init_state(features)
        rows = features.size(0)  # init_state's dynamic rows: one per image
        return State(inner.static, {"decoder": inner.dynamic, "lm": self.lm.initial_state(rows, features.device)},
                     inner.group)

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        log_probs, inner, attention = self.decoder.step(prev_tokens, State(state.static, state.dynamic["decoder"],
                                                                            state.group))
        lm_log_probs, lm_state = self.lm.step(prev_tokens, state.dynamic["lm"])
        fused = log_probs.float() + self.weight * lm_log_probs
        return fused, State(inner.static, {"decoder": inner.dynamic, "lm": lm_state}, inner.group, inner.outputs), attention


def caption_texts(files: Sequence[str | os.PathLike], leave_out: Sequence[str | os.PathLike] = ()
                  ) -> tuple[list[str], dict[str, Any]]:
    """The captions of COCO-format caption files (``annotations[].caption``; no photos needed), without
    those of the image ids in the ``leave_out`` files (a dev set whose captions the text also holds), and
    what was read: ``{"files": [{"file", "captions"}], "left_out": n}``. ``DataError`` names a bad file."""
    left_ids: set[Any] = set()
    for path in leave_out:
        data = _caption_json(path)
        left_ids |= {image["id"] for image in data.get("images", []) if isinstance(image, dict) and "id" in image}
        left_ids |= {a.get("image_id") for a in data["annotations"] if isinstance(a, dict)}
    captions, read, dropped = [], [], 0
    for path in files:
        data = _caption_json(path)
        before = len(captions)
        for a in data["annotations"]:
            if not isinstance(a, dict) or not isinstance(a.get("caption"), str):
                continue
            if a.get("image_id") in left_ids:
                dropped += 1
                continue
            captions.append(a["caption"])
        read.append({"file": str(path), "captions": len(captions) - before})
    return captions, {"files": read, "left_out": dropped}


def _caption_json(path: str | os.PathLike) -> dict:
    data = read_json(path, MAX_CAPTION_FILE_BYTES, DataError, "caption file", dict)
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise DataError(f"{path}: not a COCO caption file (no 'annotations' list)")
    return data


def _batches(rows: list[list[int]], size: int, pad: int, shuffle: random.Random | None) -> Iterable[torch.Tensor]:
    order = list(range(len(rows)))
    if shuffle is not None:
        shuffle.shuffle(order)
    for start in range(0, len(order), size):
        chunk = [rows[i] for i in order[start:start + size]]
        out = torch.full((len(chunk), max(map(len, chunk))), pad, dtype=torch.long)
        for i, row in enumerate(chunk):
            out[i, :len(row)] = torch.tensor(row)
        yield out


@torch.no_grad()
def perplexity(lm: CaptionLanguageModel, rows: list[list[int]], pad: int) -> float:
    """exp of the mean negative log-likelihood per predicted token (words and ``<eos>``) of ``rows``."""
    was = lm.training
    lm.eval()
    total, count = 0.0, 0
    for batch in _batches(rows, 256, pad, None):
        logits = lm(batch[:, :-1])
        total += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1),
                                       ignore_index=pad, reduction="sum"))
        count += int((batch[:, 1:] != pad).sum())
    lm.train(was)
    return math.exp(total / max(count, 1))


def train_language_model(captions: Sequence[str], vocab: Vocabulary, epochs: int = 5, batch_size: int = 128,
                         lr: float = 2e-3, config: LanguageModelConfig | None = None, held_out: int = 1000,
                         seed: int = 0, progress: bool = True, on_epoch: Any = None
                         ) -> tuple[CaptionLanguageModel, dict[str, Any]]:
    """Fit a language model to ``captions`` over ``vocab`` (Adam, gradients clipped at 1): the model of the
    epoch whose held-out perplexity was lowest, and ``{"perplexity": [...per epoch], "best_epoch",
    "captions", "held_out", "seconds"}``. ``held_out`` captions (at most a tenth) are kept out for it.
    ``on_epoch(model, report, improved)`` is called after each epoch (to report it, and save the model of
    an epoch that ``improved`` on every earlier one)."""
    from tqdm import tqdm  # noqa: PLC0415

    if len(captions) < 2:
        raise ConfigError(f"a language model needs at least 2 captions to learn from, got {len(captions)}")
    config = config or LanguageModelConfig(len(vocab))
    generator = random.Random(seed)
    torch.manual_seed(seed)
    rows = [vocab.encode(c, MAX_WORDS) for c in captions]
    generator.shuffle(rows)
    n_held = max(1, min(held_out, len(rows) // 10))
    held, train = rows[:n_held], rows[n_held:]
    lm = CaptionLanguageModel(config)
    optimizer = torch.optim.Adam(lm.parameters(), lr=lr)
    report: dict[str, Any] = {"perplexity": [], "best_epoch": 0, "captions": len(train), "held_out": n_held}
    best, start = math.inf, time.monotonic()
    best_state = None
    for epoch in range(epochs):
        lm.train()
        batches = list(_batches(train, batch_size, vocab.pad_id, generator))
        for batch in tqdm(batches, desc=f"language model epoch {epoch + 1}/{epochs}", disable=not progress or None,
                          leave=False):
            logits = lm(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1),
                                   ignore_index=vocab.pad_id)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            optimizer.step()
        ppl = perplexity(lm, held, vocab.pad_id)
        report["perplexity"].append(round(ppl, 3))
        report["seconds"] = round(time.monotonic() - start, 1)
        improved = ppl < best
        if improved:
            best, report["best_epoch"] = ppl, epoch + 1
            best_state = {k: v.detach().clone() for k, v in lm.state_dict().items()}
        if on_epoch is not None:
            on_epoch(lm, report, improved)
    assert best_state is not None
    lm.load_state_dict(best_state)
    return lm.eval(), report


def save_language_model(path: str | os.PathLike, lm: CaptionLanguageModel, vocab: Vocabulary,
                        about: dict[str, Any] | None = None, half: bool = False) -> Path:
    """Write ``lm`` as a safetensors file (atomically) with its vocabulary, widths and ``about`` (what it read)."""
    from safetensors.torch import save  # noqa: PLC0415

    if len(vocab) != lm.config.vocab_size:
        raise ConfigError(f"the vocabulary has {len(vocab)} words, the language model {lm.config.vocab_size}")
    dtype = torch.float16 if half else torch.float32
    state = {k: v.detach().to(dtype).contiguous() for k, v in lm.state_dict().items()}
    meta = {"format": FORMAT, "version": str(VERSION), "config": json.dumps(asdict(lm.config)),
            "vocab": json.dumps(list(vocab.itos)), "about": json.dumps(about or {})}
    data = save(state, metadata=meta)
    return atomic_write(path, lambda f: f.write(data))


def load_language_model(spec: str | os.PathLike) -> tuple[CaptionLanguageModel, Vocabulary, dict[str, Any]]:
    """A language model file, or a packaged name (``pretrained.packaged_language_models()``): the model (float32, eval mode), its
    vocabulary and what it read. ``CheckpointError`` names the file and what is wrong with it."""
    path = packaged_path(spec) if isinstance(spec, str) and spec in pretrained.packaged_language_models() else Path(spec)
    check_regular(path, MAX_LM_BYTES, CheckpointError, "language model file")
    st = path.stat()
    return _load(path.resolve(), st.st_size, st.st_mtime_ns)


def packaged_path(name: str) -> Path:
    """The packaged language model ``name``; ``CheckpointError`` when this install lacks it."""
    entry = pretrained.MODELS[name]
    # the package's weights folder as it is now (read at each call, not bound once at import)
    return pretrained.checked_package_file(pretrained.WEIGHTS / entry.file, entry.sha256,
                                           f"the packaged language model {name!r}")


@functools.lru_cache(maxsize=4)
def _load(path: Path, size: int, mtime: int) -> tuple[CaptionLanguageModel, Vocabulary, dict[str, Any]]:
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a captioner language model ({why})")

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") != FORMAT:
                raise bad(f"its 'format' metadata is {meta.get('format')!r}, not {FORMAT!r}; "
                          "captioner lm writes one")
            state = {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except SafetensorError as exc:
        raise bad(f"unreadable safetensors: {str(exc).splitlines()[0][:120]}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if meta.get("version") != str(VERSION):
        raise bad(f"version {meta.get('version')!r}; this captioner reads version {VERSION}")
    check_weights(path, meta, state)  # every tensor finite (and its checksum, when the file records one)
    try:
        config = LanguageModelConfig(**json.loads(meta["config"]))
        vocab = Vocabulary.from_dict({"itos": json.loads(meta["vocab"])})
        about = json.loads(meta.get("about", "{}"))
    except (KeyError, TypeError, ValueError, DataError) as exc:  # ConfigError is a ValueError
        raise bad(f"bad metadata: {str(exc)[:120]}") from None
    lm = CaptionLanguageModel(config)
    try:
        lm.load_state_dict(state)
    except RuntimeError as exc:
        raise bad(f"its tensors do not fit its widths: {str(exc).splitlines()[0][:120]}") from None
    if len(vocab) != config.vocab_size:
        raise bad(f"{len(vocab)} words in its vocabulary, {config.vocab_size} in its widths")
    return lm.eval().requires_grad_(False), vocab, about


def language_model_for(spec: str, vocab: Vocabulary) -> CaptionLanguageModel:
    """The language model ``spec`` names (``DecodeOptions.lm``), checked to speak ``vocab``: the captioner's
    own, word for word (``ConfigError`` with the first difference otherwise)."""
    lm, lm_vocab, _ = load_language_model(spec)
    if lm_vocab != vocab:
        difference = vocab.first_difference(lm_vocab) or "they differ"
        raise ConfigError(f"language model {spec}: its vocabulary is not this captioner's ({difference}); train one "
                          "for this model: captioner lm --checkpoint MODEL --captions FILE.json --out lm.safetensors")
    return lm


def fusion_unavailable(spec: str, vocab: Vocabulary) -> str:
    """Why the language model ``spec`` cannot be fused into a search over ``vocab`` (one line: a file missing
    or damaged, another vocabulary), or "" when it can (:func:`language_model_for` succeeds; it is cached)."""
    try:
        language_model_for(spec, vocab)
    except (ConfigError, CheckpointError) as exc:
        return one_line(str(exc))
    return ""
