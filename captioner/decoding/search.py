"""Decoding: one batched beam search (greedy is beam 1; a constraint is a second, "met", state of the same
beams) and sampling, written only against a decoder's ``init_state`` / ``step`` contract. The rules that
read a model's labels are objects of ``captioner.decoding.rules``, composed by :func:`decode`. docs/decoding_metrics_checkpoint.md explains lengths, scores and
batching.

Shape legend: B images, K beams, A images still searching, R rows in the decoder batch (A * beams),
N regions (g*g), D feature width, V vocabulary, L words of a caption.

``DecodeOptions(precision="bfloat16")`` steps :func:`decoder_for`: the SAT decoder's fused steps in
bfloat16, else a bfloat16 copy of the decoder; beams are still ranked in float64.
"""

from __future__ import annotations

import copy
import logging
import math
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from captioner.config import DecodeOptions
from captioner.config.schema import DECODE_PRECISIONS
from captioner.errors import ConfigError
from captioner.files import size_text
from captioner.language import FusedDecoder
from captioner.models.base import CaptionDecoder, State
from captioner.models.lstm import FusedSATSteps
from captioner.decoding.rules import (AbsentVeto, ConfidentWords, CopyAttribution, fill_slots, label_reading,
                                      read_photos, required_reading)
from captioner.text import STOP_WORDS, Vocabulary, plural_forms


logger = logging.getLogger(__name__)


NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    """One decoded caption; ``attention`` (L, N) float32 CPU, the attention of the step that emitted each word
    (a word copied from the encoder's labels: mixed with its label's map, ``LabelReading.attribute``);
    ``copy_share`` (L,) float32 CPU, the copy's share of each word's probability (a model that reads the
    encoder's labels, decoded by :func:`decode`), else None."""

    tokens: list[int]  # emitted word ids, without ``<bos>``/``<eos>``
    score: float  # ``log_prob`` normalised by the length penalty (the ranking key)
    attention: torch.Tensor
    log_prob: float = 0.0  # raw sum of log-probabilities (including ``<eos>`` when finished)
    finished: bool = True  # False when ``<eos>`` never came within ``max_len`` words
    copy_share: torch.Tensor | None = None


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ``((5 + length) / 6) ** alpha`` (1.0 when alpha is 0)."""
    return ((5.0 + length) / 6.0) ** alpha if alpha else 1.0


@dataclass
class Pending:
    """A hypothesis still to be read out of a :class:`BeamHistory`: ``words`` words ending at ``row``
    of the decoder batch of step ``words`` (ranked by ``score``; tokens and attention come later)."""

    row: int
    words: int
    score: float
    log_prob: float
    finished: bool


class BeamHistory:
    """Back-pointers of a beam search (parent row, word, attention, the copy's share per step), read back by
    :meth:`read`.

    No step copies the whole history of every beam: a step costs O(R * N) whatever ``max_len`` is.
    """

    def __init__(self) -> None:
        self.parents: list[torch.Tensor] = []  # step t: (R_{t+1},) row of batch t
        self.words: list[torch.Tensor] = []  # step t: (R_{t+1},) word emitted at step t
        self.attention: list[torch.Tensor] = []  # step t: (R_{t+1}, N) float32
        self.shares: list[torch.Tensor] = []  # step t: (R_{t+1},) float32, when the search records them

    def append(self, parents: torch.Tensor, words: torch.Tensor, attention: torch.Tensor,
               share: torch.Tensor | None = None) -> None:
        self.parents.append(parents)
        self.words.append(words)
        self.attention.append(attention)
        if share is not None:
            self.shares.append(share)

    def read(self, pending: list[Pending], n_regions: int) -> list[Hypothesis]:
        """The hypotheses of ``pending`` with their tokens and attention, all walked back at once."""
        if not pending:
            return []
        device = self.parents[0].device if self.parents else torch.device("cpu")
        count, longest = len(pending), max(p.words for p in pending)
        lengths = torch.tensor([p.words for p in pending], device=device)  # (H,)
        rows = torch.tensor([p.row for p in pending], device=device)  # (H,) row in batch ``words``
        tokens = torch.zeros(count, longest, dtype=torch.long, device=device)  # (H, L)
        attention = torch.zeros(count, longest, n_regions, dtype=torch.float32, device=device)  # (H, L, N)
        shares = torch.zeros(count, longest, dtype=torch.float32, device=device) if self.shares else None  # (H, L)
        for t in range(longest - 1, -1, -1):
            active = lengths > t  # (H,) hypotheses whose word t was chosen at step t
            at = rows.clamp(max=self.parents[t].numel() - 1)  # inactive rows are masked out below
            tokens[:, t] = torch.where(active, self.words[t][at], tokens[:, t])
            attention[:, t] = torch.where(active[:, None], self.attention[t][at], attention[:, t])
            if shares is not None:
                shares[:, t] = torch.where(active, self.shares[t][at], shares[:, t])
            rows = torch.where(active, self.parents[t][at], rows)
        tokens_cpu, attention_cpu = tokens.cpu(), attention.cpu()
        shares_cpu = shares.cpu() if shares is not None else None
        return [Hypothesis(tokens_cpu[i, :p.words].tolist(), p.score, attention_cpu[i, :p.words].clone(), p.log_prob,
                           p.finished, None if shares_cpu is None else shares_cpu[i, :p.words].clone())
                for i, p in enumerate(pending)]


@dataclass
class LiveBeams:
    """The live beams of the images still searching: group ``a`` is rows ``a * width .. (a + 1) * width - 1``."""

    scores: torch.Tensor  # (A, width) float64 raw log-prob sums
    images: list[int]  # (A,) image of each group

    @property
    def width(self) -> int:
        return self.scores.size(1)

    def pending(self, row: int, words: int, raw: float, alpha: float, finished: bool) -> Pending:
        """The first ``words`` words of ``row``; scored over ``words`` tokens, plus ``<eos>`` if finished."""
        return Pending(row, words, raw / length_penalty(words + int(finished), alpha), raw, finished)

    def unfinished(self, a: int, words: int, alpha: float, count: int, order: torch.Tensor | None = None
                   ) -> list[Pending]:
        """Group ``a``'s ``count`` best live beams (finite scores; at least one) as unfinished hypotheses;
        ``order`` (width,) bool: those marked True first (a constrained search's beams that met it)."""
        key = self.scores[a] if order is None else torch.stack([order.double(), self.scores[a]], 1)
        order = self.scores[a].argsort(descending=True).tolist() if order is None else \
            sorted(range(self.width), key=lambda i: tuple(key[i].tolist()), reverse=True)
        beams = [i for i in order if math.isfinite(self.scores[a, i].item())] or order[:1]
        return [self.pending(a * self.width + i, words, self.scores[a, i].item(), alpha, finished=False)
                for i in beams[:count]]


def top_candidates(scores: torch.Tensor, log_probs: torch.Tensor, count: int, exclude: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best ``count`` (beam, word) extensions of each group, best first: (raw sums, source rows, words), (A, C) each.

    ``scores``: (A, W) raw log-prob sums of the live beams; ``log_probs``: (A * W, V) of their rows;
    ``exclude``: (A, W*V) bool, extensions never taken (another state's).
    """
    A, W = scores.shape
    V = log_probs.size(1)
    cand = (scores.view(-1, 1) + log_probs).view(A, W * V)  # (A, W*V)
    if exclude is not None:
        cand = cand.masked_fill(exclude, NEG_INF)
    top_s, top_i = cand.topk(min(count, W * V), dim=1)  # (A, C)
    src = torch.arange(A, device=scores.device).view(-1, 1) * W + top_i // V  # (A, C)
    return top_s, src, top_i % V


def keep_best(hyps: list[Pending], hyp: Pending, n_best: int) -> None:
    """Add ``hyp`` to ``hyps`` (best score first, ties in arrival order) and keep the ``n_best`` best."""
    hyps.append(hyp)
    hyps.sort(key=lambda h: h.score, reverse=True)
    del hyps[n_best:]


def best_reachable(raw: torch.Tensor, t: int, max_len: int, alpha: float) -> torch.Tensor:
    """Best normalised score a live beam of raw sum ``raw`` (A,) after step ``t`` can still reach.

    A raw sum only falls and lp(L) is monotonic, so the optimum is at the shortest or the longest length.
    """
    return torch.maximum(raw / length_penalty(t + 2, alpha), raw / length_penalty(max_len + 1, alpha))


class SuppressTokens:
    """Set the log-probabilities of ``ids`` to -inf (others not renormalised); ``eos_id`` is never suppressed."""

    def __init__(self, ids: Sequence[int], eos_id: int) -> None:
        self.ids = tuple(sorted({int(i) for i in ids} - {int(eos_id)}))

    def __repr__(self) -> str:
        return f"SuppressTokens({list(self.ids)})"

    def __call__(self, log_probs: torch.Tensor) -> torch.Tensor:
        """(..., V) -> (..., V), a new tensor unless nothing is suppressed."""
        if not self.ids:
            return log_probs
        return log_probs.index_fill(-1, torch.tensor(self.ids, device=log_probs.device), NEG_INF)


class BlockRepeats:
    """Forbid what would repeat: an n-gram the caption already holds, and a listed word it already used.

    ``ngram``: n > 1 blocks the word completing an n-gram already there; 0 = off. ``word_ids``: ids
    used at most once per caption; empty = off. ``eos_id`` is never blocked.
    """

    def __init__(self, ngram: int = 0, word_ids: Sequence[int] = (), eos_id: int = 2) -> None:
        self.ngram = int(ngram)
        self.word_ids = tuple(sorted({int(i) for i in word_ids} - {int(eos_id)}))
        self.eos_id = int(eos_id)
        self._mask: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return self.ngram > 1 or bool(self.word_ids)

    def __repr__(self) -> str:
        return f"BlockRepeats(ngram={self.ngram}, words={len(self.word_ids)})"

    def _word_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.numel() != vocab_size or self._mask.device != device:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [i for i in self.word_ids if i < vocab_size]
            mask[torch.tensor(ids, dtype=torch.long, device=device)] = True
            self._mask = mask
        return self._mask

    def __call__(self, log_probs: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """log_probs (R, V), words so far (R, t) -> (R, V), a new tensor unless nothing is blocked."""
        R, V = log_probs.shape
        t = words.shape[1]
        if not self or t == 0:
            return log_probs
        blocked = torch.zeros(R, V, dtype=torch.bool, device=log_probs.device)  # (R, V)
        if self.word_ids:
            used = torch.zeros_like(blocked).scatter_(1, words, True)  # (R, V)
            blocked |= used & self._word_mask(V, log_probs.device)
        n = self.ngram
        if n > 1 and t >= n - 1:
            prefix = words[:, t - (n - 1):]  # (R, n-1): the last n-1 words
            starts = t - (n - 1)  # earlier n-grams start at 0 .. starts-1 and end at a word already written
            if starts > 0:
                match = torch.ones(R, starts, dtype=torch.bool, device=words.device)  # (R, S)
                for j in range(n - 1):
                    match &= words[:, j:j + starts] == prefix[:, j:j + 1]
                nxt = words[:, n - 1:n - 1 + starts]  # (R, S) the word that followed each match
                rows = torch.arange(R, device=words.device).unsqueeze(1).expand_as(nxt)
                blocked[rows[match], nxt[match]] = True
        blocked[:, self.eos_id] = False
        return log_probs.masked_fill(blocked, NEG_INF) if bool(blocked.any()) else log_probs


MEMORY_LIMIT = 2 * 1024**3  # bytes one decode() call may plan for (all chunks run one after another)


def search_bytes(rows: int, max_len: int, n_regions: int, vocab_size: int, state_per_word: int = 0) -> int:
    """Worst-case bytes of one image's search with ``rows`` beams (1 for greedy).

    ``state_per_word``: the decoder state's growth per row and word (``state_bytes_per_word``).
    """
    per_word = 8 + 8 + 4 * n_regions + 2 * state_per_word  # parent row, word, attention (fp32), state
    per_step = 3 * 8 * vocab_size  # float64 log-probs, candidate sums and their top-k
    return rows * ((max_len + 1) * per_word + per_step)


def image_chunks(decoder: torch.nn.Module, features: torch.Tensor, options: DecodeOptions) -> list[slice]:
    """Slices of ``features`` (B, N, D) to search in turn within :data:`MEMORY_LIMIT`; ``ConfigError`` if one image cannot."""
    batch, n_regions = features.shape[:2]
    grow = decoder.state_bytes_per_word() if hasattr(decoder, "state_bytes_per_word") else 0
    one = search_bytes(options.beam_size, options.max_len, n_regions, int(getattr(decoder, "vocab_size", 0)), grow)
    if one > MEMORY_LIMIT:
        raise ConfigError(f"beam size {options.beam_size} with max_len {options.max_len} (--beam, --max-len) could "
                          f"need {size_text(one)} for one image's search if no caption ended before max_len (limit "
                          f"{size_text(MEMORY_LIMIT)}): lower --beam or --max-len")
    per_chunk = max(1, MEMORY_LIMIT // max(one, 1))
    return [slice(i, min(i + per_chunk, batch)) for i in range(0, batch, per_chunk)]


@dataclass(frozen=True)
class SearchRules:
    """What a search needs of the words besides its options: ``<bos>``, ``<eos>``, ``banned_ids`` (never
    emitted; never ``<eos>``), ``content_ids`` (what ``DecodeOptions.no_repeat_words`` allows once),
    ``word_forms`` (each word's plurals: they meet a constraint on it, and fill a plural's slot) and, for a
    model that copies words from its labels, the :class:`~captioner.decoding.rules.CopyAttribution` that
    keeps the copy's share of each chosen word (:func:`decode` sets it)."""

    bos_id: int
    eos_id: int
    banned_ids: tuple[int, ...] = ()
    content_ids: tuple[int, ...] = ()
    word_forms: Mapping[int, Sequence[int]] = field(default_factory=dict)
    copying: CopyAttribution | None = None

    @classmethod
    def of(cls, vocab: Vocabulary, options: DecodeOptions) -> SearchRules:
        """The rules of a search over ``vocab`` with ``options``."""
        return cls(vocab.bos_id, vocab.eos_id, never_emitted_ids(vocab, options), content_word_ids(vocab),
                   plural_forms(vocab) if options.constrain or options.fill_slots else {})


def decode(decoder: CaptionDecoder, features: torch.Tensor, words: Vocabulary | SearchRules,
           options: DecodeOptions | None = None, lm: nn.Module | None = None) -> list[list[Hypothesis]]:
    """Caption a batch of (B, N, D) region features; per image ``options.n_best`` hypotheses, best first.

    ``decoder``: any ``CaptionDecoder`` in eval mode; ``words``: its vocabulary (or the ids of
    :class:`SearchRules` directly); ``lm``: a
    ``captioner.language.CaptionLanguageModel`` over the same vocabulary, fused with ``options.lm_weight``
    (None: none). Every ``DecodeOptions`` field acts here or in :func:`search`: ``precision`` picks the
    stepping decoder (:func:`prepare`), ``veto`` wraps it in :class:`~captioner.decoding.rules.AbsentVeto`,
    ``lm_weight`` in ``FusedDecoder``, ``constrain`` gives each photo its constraint set
    (:class:`~captioner.decoding.rules.ConfidentWords`), ``fill_slots`` edits the captions after the search
    (:func:`~captioner.decoding.rules.fill_slots`); a model that copies has its copied words' attention
    mixed with their labels' maps (:class:`~captioner.decoding.rules.CopyAttribution`). ``ConfigError`` for
    features that are not (B, N, D), one image's search over :data:`MEMORY_LIMIT`, or a label option asked of
    a model that reads no labels.
    """
    options = options or DecodeOptions()
    if features.dim() != 3:
        raise ConfigError(f"decode expects features of shape (B, N, D), got {tuple(features.shape)}")
    labelled = {name: value for name, value in (("veto", options.veto), ("constrain", options.constrain),
                                                ("fill_slots", options.fill_slots)) if value}
    if features.size(0) == 0:
        return []
    reading = label_reading(decoder)
    for name, value in labelled.items():
        required_reading(decoder, name, value)
    if decoder.training:
        logger.warning("decode() called with the decoder in training mode (dropout / sampling active); "
                       "call .eval() first or use captioner.inference.caption_features()")
    rules = words if isinstance(words, SearchRules) else SearchRules.of(words, options)
    rules = replace(rules, copying=CopyAttribution(reading) if reading is not None else None)
    constraints = ConfidentWords(options.constrain, rules.word_forms) if options.constrain else None
    out: list[list[Hypothesis]] = []
    # no_grad, and inference mode off even inside a caller's inference_mode, so that the returned
    # attention maps are ordinary tensors that a caller may change in place.
    with torch.inference_mode(False), torch.no_grad():
        stepper, features = prepare(decoder, features, options.precision)  # float32: the decoder itself
        if options.veto:
            stepper = AbsentVeto(stepper, reading, options.veto)
        if lm is not None and options.lm_weight:
            stepper = FusedDecoder(stepper, lm, options.lm_weight)
        for chunk in image_chunks(stepper, features, options):  # a refused request raises before any step
            photos = read_photos(reading, features[chunk]) if reading is not None and labelled else None
            sets = constraints(photos) if constraints is not None else []
            found = search(stepper, features[chunk], options, rules, sets)
            if rules.copying is not None:  # a word copied from the encoder's labels looked where its label is
                rules.copying.attribute(features[chunk], found)
            if options.fill_slots:  # an absent object's word: what the labels see where it looked
                fill_slots(photos, found, options.fill_slots, rules.word_forms)
            out += found
    return out


def search(decoder: CaptionDecoder, features: torch.Tensor, options: DecodeOptions, rules: SearchRules,
           constraints: Sequence[Collection[int]] = ()) -> list[list[Hypothesis]]:
    """Batched beam search (greedy is beam 1): all images and beams go through ``decoder.step`` as one batch;
    ``options.n_best`` hypotheses per image of (B, N, D) ``features``, best first, stepping ``decoder`` as it is
    (:func:`decode` adds the precision, the veto and the fusion).

    The first step takes each image's K best distinct words. At each step the 2K best candidates of an
    image are ranked; an ``<eos>`` among the K best finishes a hypothesis and the K best others live on.
    An image stops once no live beam can beat its ``n_best`` finished ones, and its rows leave the
    batch. The result equals image-by-image search. The state follows the beams through
    ``State.reorder``, ``State.select``, or (a grouped state, the SAT LSTM) ``State.regroup``.

    ``constraints``: per image the words one of which its caption must hold (empty or missing: none):
    constrained beam search (Anderson et al. 2017) with one disjunctive constraint. Every beam is in one of
    two states, the constraint met or not, and each state keeps its own K beams, ranked as above; only a
    caption that met it is finished, one that did not is returned only when too few met it within
    ``max_len`` words. Without constraints every beam starts met and the search is the plain one.
    """
    bos_id, eos_id, copying = rules.bos_id, rules.eos_id, rules.copying
    suppress = SuppressTokens(rules.banned_ids, eos_id)
    repeats = repeat_filter(options, rules.content_ids, eos_id)
    B, N = features.shape[:2]
    K, T, alpha, n_best = options.beam_size, options.max_len, options.length_penalty, options.n_best
    device = features.device
    bound_images = [b for b in range(B) if b < len(constraints) and constraints[b]]
    states = (False, True) if bound_images else (True,)  # whether a beam has met its image's constraint
    wanted = None  # (B, V): the words that meet each image's constraint, built at the first step
    state = initial_state(decoder, features)  # B rows: one copy per image for the first step
    grouped = bool(getattr(decoder, "groups_rows", False))  # beams read their image's constants in place
    beams = LiveBeams(scores=torch.zeros(B, 1, dtype=torch.float64, device=device), images=list(range(B)))
    met = torch.tensor([b not in bound_images for b in range(B)], device=device)[:, None]  # (A, width)
    history = BeamHistory()  # what each step chose: memory grows with the words generated, not max_len
    prev = torch.full((B,), bos_id, dtype=torch.long, device=device)  # (R,)
    words = torch.zeros(B, 0, dtype=torch.long, device=device)  # (R, t) each row's words so far (BlockRepeats)
    finished = {s: [[] for _ in range(B)] for s in states}  # per state and image, best first, at most n_best
    results: list[list[Pending]] = [[] for _ in range(B)]

    def close(a: int, t: int) -> None:
        """Group ``a``'s image is done after ``t`` words; too few finished: add its best live beams."""
        image = beams.images[a]
        hyps = finished[True][image]
        if image not in bound_images:
            if len(hyps) < n_best:
                hyps += beams.unfinished(a, t, alpha, n_best - len(hyps))
            hyps.sort(key=lambda h: h.score, reverse=True)
        elif len(hyps) < n_best:  # too few met the constraint: the best of the rest, finished first
            hyps += finished[False][image][:n_best - len(hyps)]
            hyps += beams.unfinished(a, t, alpha, n_best - len(hyps), order=met[a])
        results[image] = hyps[:n_best]

    for t in range(T + 1):
        log_probs, state, attn = decoder.step(prev, state)  # (R, V), (R, N)
        step_shares = state.outputs.get("copy_share")  # (R, W') of a model that copies
        log_probs = _search_log_probs(log_probs, suppress, eos_id, eos_only=t == T)  # (R, V) float64
        if repeats:
            log_probs = repeats(log_probs, words)
        if bound_images and wanted is None:
            wanted = torch.zeros(B, log_probs.size(1), dtype=torch.bool, device=device)
            for b in bound_images:
                wanted[b, [w for w in constraints[b] if 0 <= w < log_probs.size(1)]] = True
        live_s, live_src, live_tok, live_met = [], [], [], []
        if bound_images:
            now = met.unsqueeze(-1) | wanted[beams.images].unsqueeze(1)  # (A, W, V) the state after each word
            now[:, :, eos_id] = met  # <eos> ends a beam in its state
            now = now.view(len(beams.images), -1)  # (A, W*V)
        for s in states:  # as plain beam search, per state: the 2K best candidates, ...
            top_s, src, tok = top_candidates(beams.scores, log_probs, 2 * K, (now != s) if bound_images else None)
            is_eos = tok == eos_id  # (A, C)
            ends = is_eos & torch.isfinite(top_s)
            ends[:, K:] = False  # ... an <eos> among the K best finishes a caption in that state ...
            for a, c in ends.nonzero().tolist():
                hyp = beams.pending(int(src[a, c]), t, float(top_s[a, c]), alpha, finished=True)
                keep_best(finished[s][beams.images[a]], hyp, n_best)
            best, pos = top_s.masked_fill(is_eos, NEG_INF).topk(min(K, top_s.size(1)), dim=1)  # (A, K')
            live_s.append(best)  # ... and the K best others live on
            live_src.append(src.gather(1, pos))
            live_tok.append(tok.gather(1, pos))
            live_met.append(torch.full_like(pos, s, dtype=torch.bool))
        if t == T:
            for a in range(len(beams.images)):
                close(a, t)
            break
        live_s, live_src, live_tok, live_met = (torch.cat(x, 1) for x in (live_s, live_src, live_tok, live_met))
        keep = []
        for a, bound in enumerate(best_reachable(live_s.max(dim=1).values, t, T, alpha).tolist()):
            hyps = finished[True][beams.images[a]]
            if bound == NEG_INF or (len(hyps) >= n_best and hyps[n_best - 1].score >= bound):
                close(a, t)
            else:
                keep.append(a)
        if not keep:
            break
        keep_t = torch.tensor(keep, device=device)
        rows = live_src[keep_t].reshape(-1)  # (A'*W',) source row of each new beam
        toks = live_tok[keep_t].reshape(-1)  # (A'*W',)
        width = live_s.size(1)
        same_groups = len(keep) == len(beams.images) and width == beams.width
        if same_groups:
            state = state.reorder(rows)
        elif grouped:  # each image's constants once for its beams: only the dropped images' go
            state = state.regroup(None if len(keep) == len(beams.images) else keep_t, rows, width)
        else:
            state = state.select(rows)
        history.append(rows, toks, attn.index_select(0, rows).float(),
                       None if copying is None else copying.shares(step_shares, rows, toks))
        if repeats:
            words = torch.cat([words.index_select(0, rows), toks.unsqueeze(1)], dim=1)
        beams = LiveBeams(live_s[keep_t], [beams.images[a] for a in keep])
        met = live_met[keep_t]
        prev = toks
    read = iter(history.read([h for per_image in results for h in per_image], N))
    return [[next(read) for _ in per_image] for per_image in results]


def initial_state(decoder: CaptionDecoder, features: torch.Tensor) -> State:
    """``decoder.init_state(features)``, checked to be a ``State`` (the decoding contract)."""
    state = decoder.init_state(features)
    if not isinstance(state, State):
        raise TypeError(f"{type(decoder).__name__}.init_state returned a {type(state).__name__}, "
                        "not a captioner.models.base.State")
    return state


def repeat_filter(options: DecodeOptions, content_ids: Sequence[int], eos_id: int) -> BlockRepeats:
    """The :class:`BlockRepeats` filter ``options`` asks for (falsy when it asks for none)."""
    return BlockRepeats(options.no_repeat_ngram, content_ids if options.no_repeat_words else (), eos_id)


def _search_log_probs(log_probs: torch.Tensor, suppress: SuppressTokens, eos_id: int, eos_only: bool) -> torch.Tensor:
    """float64 log-probs (R, V) with suppressed ids at -inf; with ``eos_only`` every id but ``<eos>``."""
    log_probs = suppress(log_probs.double())
    if not eos_only:
        return log_probs
    only_eos = torch.full_like(log_probs, NEG_INF)  # (R, V)
    only_eos[:, eos_id] = log_probs[:, eos_id]
    return only_eos


def content_word_ids(vocab: Vocabulary) -> tuple[int, ...]:
    """Ids of the vocabulary's content words (not special, not in ``STOP_WORDS``): what ``no_repeat_words`` limits."""
    return tuple(i for i, w in enumerate(vocab.itos) if i > vocab.unk_id and w not in STOP_WORDS)


def never_emitted_ids(vocab: Vocabulary, options: DecodeOptions | None = None) -> tuple[int, ...]:
    """Ids a caption never contains: ``<pad>``, ``<bos>`` and, unless ``options.allow_unk``, ``<unk>``."""
    if options is not None and options.allow_unk:
        return (vocab.pad_id, vocab.bos_id)
    return (vocab.pad_id, vocab.bos_id, vocab.unk_id)


# ----------------------------------------------------------------------------- sampling (SCST)

@dataclass
class SampledCaptions:
    """What :func:`sample_captions` returns (row r is sample ``r % K`` of image ``r // K``)."""

    tokens: torch.Tensor  # (R, L) sampled ids: words, then ``<eos>`` when the caption finished, then ``pad_id``
    lengths: torch.Tensor  # (R,) number of words (``<eos>`` not counted)
    finished: torch.Tensor  # (R,) whether ``<eos>`` was sampled

    def words(self) -> list[list[int]]:
        """Per row, the word ids without ``<eos>`` and padding (one host sync)."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths.tolist())]


def sample_captions(decoder: CaptionDecoder, features: torch.Tensor, bos_id: int, eos_id: int, pad_id: int,
                    samples: int = 1, max_len: int = 20, temperature: float = 1.0,
                    banned_ids: Sequence[int] = ()) -> SampledCaptions:
    """Draw ``samples`` (K) captions per image: ``SampledCaptions`` with R = B * K rows, image-major.

    The decoder samples in whatever mode it is in (training mode: the policy being trained).
    ``temperature`` > 0; ``banned_ids`` must include ``pad_id``.
    """
    if features.dim() != 3:
        raise ConfigError(f"sample_captions expects features of shape (B, N, D), got {tuple(features.shape)}")
    if samples < 1 or max_len < 1 or not temperature > 0:
        raise ConfigError(f"sampling needs samples >= 1, max_len >= 1 and temperature > 0, got "
                          f"{samples}, {max_len}, {temperature}")
    if pad_id not in banned_ids:
        raise ConfigError("sample_captions: pad_id must be one of the banned ids")
    suppress = SuppressTokens(banned_ids, eos_id)
    B, device = features.size(0), features.device
    R = B * samples
    with torch.inference_mode(False), torch.no_grad():
        state = initial_state(decoder, features)  # B rows
        state = state.select(torch.arange(B, device=device).repeat_interleave(samples))  # R rows, image-major
        prev = torch.full((R,), bos_id, dtype=torch.long, device=device)  # (R,)
        tokens = torch.full((R, max_len + 1), pad_id, dtype=torch.long, device=device)  # (R, max_len + 1)
        done = torch.zeros(R, dtype=torch.bool, device=device)  # (R,) <eos> drawn
        steps = 0
        for t in range(max_len + 1):
            log_probs, state, _ = decoder.step(prev, state)  # (R, V)
            if t == max_len:  # after max_len words only <eos> may follow
                word = torch.full_like(prev, eos_id)
            else:
                probs = torch.softmax(suppress(log_probs.float()) / temperature, dim=-1)  # (R, V)
                word = torch.multinomial(probs, 1).squeeze(1)  # (R,)
            word = torch.where(done, torch.full_like(word, pad_id), word)
            tokens[:, t] = word
            done |= word == eos_id
            steps = t + 1
            if bool(done.all()):
                break
            prev = word
        tokens = tokens[:, :steps]  # (R, L)
        words = (tokens != pad_id) & (tokens != eos_id)
        lengths = words.sum(dim=1)  # (R,)
        finished = (tokens == eos_id).any(dim=1)
        # the forced <eos> after max_len words was not sampled: a caption cut there is unfinished
        if steps == max_len + 1:
            forced = tokens[:, max_len] == eos_id
            finished = finished & ~forced
            tokens[:, max_len] = torch.where(forced, torch.full_like(tokens[:, max_len], pad_id), tokens[:, max_len])
            tokens = tokens[:, :max_len]
    return SampledCaptions(tokens, lengths, finished)


PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # DecodeOptions.precision -> dtype
assert tuple(PRECISIONS) == DECODE_PRECISIONS
# each decoder's low-precision stepper, kept while its weights are unchanged (gone with the decoder)
_LOW_PRECISION: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, nn.Module]] = weakref.WeakKeyDictionary()


def decoder_for(decoder: nn.Module, precision: str) -> nn.Module:
    """The decoder a search in ``precision`` steps: itself, its fused steps or a kept bfloat16 copy.

    Raises ``ValueError`` for a precision not in :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {sorted(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if dtype == torch.float32:
        return decoder
    tensors = [*decoder.parameters(), *decoder.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    key = (dtype, device, getattr(decoder, "hard_test_mode", None),
           tuple((t.data_ptr(), t._version) for t in tensors))
    cached = _LOW_PRECISION.get(decoder)
    if cached is not None and cached[0] == key:
        return cached[1]
    fused = getattr(decoder, "fused_steps", None)
    low = (fused(dtype) if fused is not None else None) or _copy_in(decoder, dtype)
    low.eval()
    _LOW_PRECISION[decoder] = (key, low)
    return low


def prepare(decoder: nn.Module, features: torch.Tensor, precision: str) -> tuple[nn.Module, torch.Tensor]:
    """(the decoder to step, the features for its ``init_state``): float32 for fused steps, else ``precision``."""
    stepper = decoder_for(decoder, precision)
    if stepper is decoder or isinstance(stepper, FusedSATSteps):
        return stepper, features
    return stepper, features.to(PRECISIONS[precision])


def _copy_in(decoder: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``decoder`` with its floating-point weights in ``dtype`` (the original untouched), but
    for the submodules that declare ``runs_in_float32`` (the concept head)."""
    caches = ("_step_cache",)  # what the decoder keeps of its weights: not copied into the copy
    saved = {key: decoder.__dict__.pop(key) for key in caches if key in decoder.__dict__}
    try:
        low = copy.deepcopy(decoder).to(dtype)
        for module in low.modules():
            if getattr(module, "runs_in_float32", False):
                module.float()
        return low
    finally:
        decoder.__dict__.update(saved)
