"""Decoding rules that read a model's labels: each one small object, composed by the search from
``DecodeOptions``, none of them inside the model.

A model whose decoder reads its encoder's labels (``encoder.labels``: the decoder's ``extension`` is a
:class:`~captioner.models.labels.LabelReading`) says, read-only, what the labels of a batch of photos
are, which object categories they call absent, and each region's class activation maps. The rules act
on the search with that reading:

* :class:`AbsentVeto` (``DecodeOptions.veto``): a filter on the decoder's steps; an object word whose
  category the labels call absent loses ``weight`` log-probability at every step;
* :class:`ConfidentWords` (``constrain``): each photo's constraint set, the lexicon words the copy can
  write whose label is at least ``tau`` likely, for the search's "met" state (Anderson et al. 2017);
* :func:`fill_slots` (``fill_slots``): after the search, an absent object's word becomes the object the
  labels see where that word looked (after Neural Baby Talk, Lu et al. 2018);
* :class:`CopyAttribution` (always, for a model that copies): the copy's share of each chosen word, which
  the decoder reports in ``State.outputs["copy_share"]`` at every step, kept by the search; after it, a
  copied word's attention mixed with its label's map.

Shape legend: B photos, N regions, R decoder rows, V vocabulary, W lexicon words, W' the copyable ones,
G object categories (W + 1 columns: the lexicon words, then person), C ImageNet classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from captioner.models.labels import LabelReading
from captioner.errors import ConfigError
from captioner.models.base import State, WrappedDecoder, expand_groups


def label_reading(decoder: torch.nn.Module) -> LabelReading | None:
    """The decoder's reading of its encoder's labels, or None for a decoder that reads none."""
    extension = getattr(decoder, "extension", None)
    return extension if isinstance(extension, LabelReading) else None


def required_reading(decoder: torch.nn.Module, option: str, value: float) -> LabelReading:
    """The decoder's label reading for the decoding option ``option=value``; ConfigError without one."""
    reading = label_reading(decoder)
    if reading is None:
        raise ConfigError(f"decoding {option}={value:g} needs a model that reads the encoder's labels "
                          "(encoder.labels); this one does not")
    return reading


@dataclass(frozen=True)
class PhotoLabels:
    """What a label reading says of a batch of photos: ``labels`` (B, W+1) and ``absent`` (B, W+1) per
    category (:meth:`LabelReading.absent`), read once per batch by :func:`read_photos`."""

    reading: LabelReading
    features: torch.Tensor  # (B, N, D + LITE_DIM) as the encoder gave them
    labels: torch.Tensor
    absent: torch.Tensor


@torch.no_grad()
def read_photos(reading: LabelReading, features: torch.Tensor) -> PhotoLabels:
    """The labels of ``features`` (B, N, D + LITE_DIM) and the categories they call absent."""
    labels = reading.labels(reading.class_probs(features))  # (B, W+1)
    return PhotoLabels(reading, features, labels, reading.absent(labels))


class AbsentVeto(WrappedDecoder):
    """``DecodeOptions.veto``: the decoder's steps with every object word whose category the labels call
    absent ``weight`` log-probability less (10: never said), renormalised; what the search steps (a
    language model, when fused, is added to these). Each photo's penalty (B, V) rides in ``State.static``
    beside the decoder's constants, so it follows the photo's rows wherever the search moves them."""

    KEY = "veto_penalty"

    def __init__(self, decoder: torch.nn.Module, reading: LabelReading, weight: float) -> None:
        super().__init__(decoder)
        self.reading, self.weight = reading, float(weight)

    def penalty(self, photos: PhotoLabels) -> torch.Tensor:
        """(B, V) float32: ``weight`` where a vocabulary word names a category absent from the photo, else 0."""
        category = photos.reading.word_category  # (V,) -1: names no category
        absent = photos.absent[:, category.clamp_min(0)].float()  # (B, V)
        return self.weight * absent * (category >= 0)

    def init_state(self, features: torch.Tensor) -> State:
        inner = self.decoder.init_state(features)
        penalty = self.penalty(read_photos(self.reading, features))
        return State({**inner.static, self.KEY: penalty}, inner.dynamic, inner.group)

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        static = {k: v for k, v in state.static.items() if k != self.KEY}
        log_probs, inner, attention = self.decoder.step(prev_tokens, State(static, state.dynamic, state.group))
        penalty = expand_groups(state.static[self.KEY], state.group)  # (R, V) each row's photo's
        vetoed = torch.log_softmax(log_probs.float() - penalty, dim=-1)
        return vetoed, State(state.static, inner.dynamic, inner.group, inner.outputs), attention


class ConfidentWords:
    """``DecodeOptions.constrain``: each photo's constraint set, the vocabulary ids of the lexicon words the
    copy can write whose label is at least ``tau`` likely, and their plurals (``word_forms``)."""

    def __init__(self, tau: float, word_forms: Mapping[int, Sequence[int]]) -> None:
        self.tau, self.word_forms = float(tau), word_forms

    def __call__(self, photos: PhotoLabels) -> list[list[int]]:
        copy_ids = photos.reading.copy_ids
        sure = (photos.labels[:, :-1] >= self.tau) & (copy_ids >= 0)  # (B, W)
        return [[v for w in copy_ids[row].tolist() for v in (w, *self.word_forms.get(w, ()))] for row in sure]


@torch.no_grad()
def fill_slots(photos: PhotoLabels, found: list[list], tau: float, word_forms: Mapping[int, Sequence[int]]) -> int:
    """Slots filled by detections at decoding: in every hypothesis of ``found`` (per photo), an object word
    whose category the labels call absent becomes the object word the labels see where that word looked:
    its attention (N,) over the regions' word probabilities (each region's class activation map through
    the lexicon), among the words the copy can write whose category is present, when the best is at least
    ``tau`` likely there; a plural (a form in ``word_forms``) is filled with its plural when the vocabulary
    has one. In place; the score and the attention stay the search's, and a hypothesis the fill makes
    equal to a better one of the same photo is dropped. Returns how many words were filled."""
    reading = photos.reading
    words = len(reading.lexicon.words)
    category = reading.label_category[:words]  # (W,)
    word_absent = photos.absent.gather(1, category.clamp_min(0).expand(photos.absent.size(0), -1))  # (B, W)
    present = ((reading.copy_ids >= 0) & (category >= 0) & ~word_absent).cpu()  # (B, W) what can fill a slot
    seen = reading.region_words(photos.features).cpu()  # (B, N, W) each region's words
    absent, slot_category, ids = photos.absent.cpu(), reading.word_category.cpu(), reading.copy_ids.cpu()
    plurals = {p for more in word_forms.values() for p in more}
    filled = 0
    for b, hyps in enumerate(found):
        for h in hyps:
            for t, token in enumerate(h.tokens):
                g = int(slot_category[token]) if 0 <= token < len(slot_category) else -1
                if g < 0 or not bool(absent[b, g]):
                    continue
                there = (h.attention[t].float() @ seen[b]).masked_fill(~present[b], -1.0)  # (W,)
                k = int(there.argmax())
                if float(there[k]) < tau:
                    continue
                word = int(ids[k])
                h.tokens[t] = word_forms[word][0] if token in plurals and word_forms.get(word) else word
                filled += 1
        unique: dict[tuple[int, ...], object] = {}
        for h in hyps:  # best first: the first of equal captions stays
            unique.setdefault(tuple(h.tokens), h)
        hyps[:] = unique.values()
    return filled


class CopyAttribution:
    """The copy's share of each chosen word (``Hypothesis.copy_share``) and, after the search, where a copied
    word looked: ``(1 - s) alpha + s m``, ``alpha`` the decoder's attention at its step, ``m`` its label's map
    (its classes' activation maps weighted by their probability, a softmax over the regions)."""

    def __init__(self, reading: LabelReading) -> None:
        self.reading = reading
        ids = reading.copy_ids[reading.copy_ids >= 0]
        column = torch.full((len(reading.word_category),), -1, dtype=torch.long, device=ids.device)
        column[ids] = torch.arange(len(ids), device=ids.device)
        self.column = column  # (V,) each vocabulary id's column among the copyable words (W'), -1: none
        usable = (reading.copy_ids >= 0).cpu()
        word_of = torch.full((len(reading.word_category),), -1, dtype=torch.long)  # vocabulary id -> lexicon word
        word_of[reading.copy_ids.cpu()[usable]] = torch.arange(len(usable))[usable]
        self.word_of = word_of

    def shares(self, step_shares: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """The copy's share of ``words`` (R',) chosen at ``rows`` (R',) of a step whose decoder reported
        ``step_shares`` (R, W'): (R',) float32, 0 for a word the copy cannot write."""
        column = self.column.to(words.device)[words]  # (R',)
        return torch.where(column >= 0, step_shares[rows, column.clamp_min(0)], 0.0).float()

    @torch.no_grad()
    def attribute(self, features: torch.Tensor, found: list[list]) -> None:
        """Every word with a copy share ``s > 0`` in ``found`` (per photo of ``features`` (B, N, D + LITE_DIM))
        gets the attention ``(1 - s) alpha + s m``. In place; rows still sum to 1."""
        reading, word_of = self.reading, self.word_of
        todo = [(b, h, (h.copy_share > 0).nonzero().flatten()) for b, hyps in enumerate(found) for h in hyps
                if h.copy_share is not None]
        todo = [(b, h, steps) for b, h, steps in todo if len(steps)]
        if not todo:
            return
        photos = [b for b, _, steps in todo for _ in steps]  # (E,) every entry's photo
        words = torch.cat([word_of[torch.tensor(h.tokens)[steps]] for _, h, steps in todo])  # (E,)
        maps = reading.word_maps(features, torch.tensor(photos), words).cpu()  # (E, N)
        at = 0
        for _, h, steps in todo:
            share = h.copy_share[steps, None].to(h.attention.dtype)  # (S, 1)
            m = maps[at:at + len(steps)].to(h.attention.dtype)
            h.attention[steps] = (1.0 - share) * h.attention[steps] + share * m
            at += len(steps)
