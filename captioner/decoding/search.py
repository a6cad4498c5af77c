"""Greedy and batched beam search, written only against the ``CaptionDecoder`` interface.

Shape legend: B images, K beams, A images still searching, R rows in the decoder batch (A * beams),
N regions (g*g), D feature width, V vocabulary, L words of a caption.

Search talks to a decoder only through ``init_state(features)``, ``step(prev_tokens, state)`` and
``reorder_state(state, index)``; it never re-implements a decoder step. Put the decoder in eval mode
first (``decode`` works on whatever mode it is in; :func:`caption_features` and :func:`caption_images`
switch the model to eval and restore its mode afterwards).

Length: a caption has at most ``max_len`` words. After ``max_len`` words the search asks the decoder
once more, for ``<eos>`` only, so a caption of exactly ``max_len`` words can still finish. If the
decoder never gives ``<eos>`` a finite probability, the best unfinished beams are returned instead
(``Hypothesis.finished`` is False) -- decoding never fails for lack of ``<eos>``.

Scores: ``log_prob`` is the sum of the log-probabilities of every emitted token, including the
``<eos>`` step when the caption finished. ``score = log_prob / lp(L)`` with the GNMT length penalty
(Wu et al. 2016) ``lp(L) = ((5 + L) / 6) ** alpha``, where L counts the scored tokens (words, plus one
for ``<eos>`` when finished) and ``alpha = DecodeOptions.length_penalty``; ``alpha = 0`` gives the raw
sum. Larger alpha favours longer captions.

Never emitted: ``<pad>`` and ``<bos>``, and ``<unk>`` unless ``DecodeOptions.allow_unk`` (the
vocabulary-level :func:`caption_features` / :func:`caption_images` ban them; ``decode`` itself bans
exactly the ``banned_ids`` it is given).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from captioner.config import DecodeOptions  # the config tree's decoding section; importable from here too
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder
from captioner.text import Vocabulary

logger = logging.getLogger(__name__)

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    """One decoded caption.

    Attributes:
        tokens: emitted word ids, without ``<bos>``/``<eos>``.
        score: ``log_prob`` normalised by the length penalty (the ranking key).
        attention: (L, N) float32 on the CPU, one row per word: the attention the decoder returned at
            the step that emitted that word, for this beam.
        log_prob: raw sum of log-probabilities (including ``<eos>`` when finished).
        finished: False when ``<eos>`` never came within ``max_len`` words.
    """

    tokens: list[int]
    score: float
    attention: torch.Tensor
    log_prob: float = 0.0
    finished: bool = True


@dataclass
class CaptionResult:
    """The best caption of one image, ready for display and overlays.

    Attributes:
        text: words joined by spaces (``<pad>``/``<bos>`` skipped).
        words: one string per emitted token (aligned with ``attention``).
        tokens: emitted ids (no ``<bos>``/``<eos>``).
        score: length-normalised log-probability.
        attention: (L, g, g) float32 CPU tensor, one map per word.
        grid: (g, g).
        finished: False when the caption was cut at ``max_len`` without ``<eos>``.
    """

    text: str
    words: list[str]
    tokens: list[int]
    score: float
    attention: torch.Tensor
    grid: tuple[int, int]
    finished: bool = True


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ``((5 + length) / 6) ** alpha`` (1.0 when alpha is 0)."""
    return ((5.0 + length) / 6.0) ** alpha if alpha else 1.0


def decode(
    decoder: CaptionDecoder,
    features: torch.Tensor,
    bos_id: int,
    eos_id: int,
    options: DecodeOptions | None = None,
    banned_ids: Sequence[int] = (),
) -> list[list[Hypothesis]]:
    """Caption a batch of images from region features.

    Args:
        decoder: any ``CaptionDecoder`` (put it in eval mode first).
        features: (B, N, D) region features.
        bos_id: id fed at the first step.
        eos_id: id that ends a caption.
        options: search options; default greedy, 20 words.
        banned_ids: ids never emitted (e.g. ``<pad>``, ``<bos>``); their log-probabilities are set
            to -inf, the others are not renormalised.

    Returns:
        Per image, ``options.n_best`` hypotheses, best score first.
    """
    options = options or DecodeOptions()
    if features.dim() != 3:
        raise ConfigError(f"decode expects features of shape (B, N, D), got {tuple(features.shape)}")
    if features.size(0) == 0:
        return []
    if decoder.training:
        logger.warning("decode() called with the decoder in training mode (dropout / sampling active); "
                       "call .eval() first or use caption_features()")
    # no_grad, and inference mode off even inside a caller's inference_mode: beam search reads
    # tensor version counters, and inference tensors (which have none) cannot change in place here.
    with torch.inference_mode(False), torch.no_grad():
        if options.beam_size == 1:
            return greedy_search(decoder, features, bos_id, eos_id, options, banned_ids)
        return beam_search(decoder, features, bos_id, eos_id, options, banned_ids)


def _ban(log_probs: torch.Tensor, banned: Sequence[int], eos_id: int) -> torch.Tensor:
    """Out-of-place: banned ids (never <eos>) get -inf."""
    ids = [i for i in banned if i != eos_id]
    if not ids:
        return log_probs
    return log_probs.index_fill(1, torch.tensor(ids, device=log_probs.device), NEG_INF)


def greedy_search(decoder: CaptionDecoder, features: torch.Tensor, bos_id: int, eos_id: int,
                  options: DecodeOptions, banned_ids: Sequence[int] = ()) -> list[list[Hypothesis]]:
    """Batched greedy decoding (argmax at each step); see :func:`decode`."""
    B, N = features.shape[:2]
    T, device = options.max_len, features.device
    state = decoder.init_state(features)
    prev = torch.full((B,), bos_id, dtype=torch.long, device=device)  # (B,)
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)  # (B, T)
    attn_hist = torch.zeros(B, T, N, dtype=torch.float32, device=device)  # (B, T, N)
    log_prob = torch.zeros(B, dtype=torch.float64, device=device)  # (B,)
    n_words = torch.full((B,), T, dtype=torch.long, device=device)  # (B,)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # (B,) emitted <eos>
    for t in range(T + 1):
        log_probs, state, attn = decoder.step(prev, state)  # (B, V), (B, N)
        if t == T:  # only <eos> may follow max_len words
            eos_lp = log_probs[:, eos_id].double()  # (B,)
            ends = ~done & torch.isfinite(eos_lp)
            log_prob = torch.where(ends, log_prob + eos_lp, log_prob)
            done |= ends
            break
        best_lp, best = _ban(log_probs, banned_ids, eos_id).max(dim=-1)  # (B,), (B,)
        live = ~done
        log_prob = torch.where(live, log_prob + best_lp.double(), log_prob)
        ends = live & (best == eos_id)
        n_words = torch.where(ends, torch.full_like(n_words, t), n_words)
        tokens[:, t] = best
        attn_hist[:, t] = attn.float()
        done |= ends
        if bool(done.all()):
            break
        prev = best
    out = []
    for b, (n, lp_b, fin) in enumerate(zip(n_words.tolist(), log_prob.tolist(), done.tolist())):
        scored = n + int(fin)
        out.append([Hypothesis(tokens[b, :n].tolist(), lp_b / length_penalty(scored, options.length_penalty),
                               attn_hist[b, :n].cpu(), lp_b, fin)])
    return out


def beam_search(decoder: CaptionDecoder, features: torch.Tensor, bos_id: int, eos_id: int,
                options: DecodeOptions, banned_ids: Sequence[int] = ()) -> list[list[Hypothesis]]:
    """Batched beam search: all images and beams go through ``decoder.step`` as one batch.

    The first step runs one copy per image and takes its K best distinct words, so beams never start
    as duplicates. At each step the 2K best (beam, word) candidates of every image are ranked; an
    ``<eos>`` among the K best finishes a hypothesis, and the K best other candidates live on. An image
    stops once it holds ``n_best`` finished hypotheses that no live beam can still beat (log-probs are
    <= 0, so a beam's sum only falls; with a length penalty the bound uses the most favourable
    length), and its rows leave the batch. The result equals image-by-image search.
    """
    B, N = features.shape[:2]
    K, T, alpha, n_best = options.beam_size, options.max_len, options.length_penalty, options.n_best
    device = features.device
    state = decoder.init_state(features)  # B rows: one copy per image for the first step
    reorder = _Reorderer(decoder, state)
    prev = torch.full((B,), bos_id, dtype=torch.long, device=device)  # (R,)
    scores = torch.zeros(B, 1, dtype=torch.float64, device=device)  # (A, beams) raw log-prob sums
    hist_tok = torch.zeros(B, T, dtype=torch.long, device=device)  # (R, T) words of each live beam
    hist_att = torch.zeros(B, T, N, dtype=torch.float32, device=device)  # (R, T, N)
    active = list(range(B))  # image of each group of rows
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    results: list[list[Hypothesis] | None] = [None] * B

    def close(a: int, img: int, t: int) -> None:
        """Finish image ``img`` (group ``a``), filling up with unfinished beams if needed."""
        hyps = finished[img]
        if len(hyps) < n_best:  # fall back on the live beams (t words, no <eos>)
            beams = scores.size(1)
            order = scores[a].argsort(descending=True).tolist()
            extra = [i for i in order if math.isfinite(scores[a, i].item())] or order[:1]
            for i in extra[: n_best - len(hyps)]:
                row, raw = a * beams + i, scores[a, i].item()
                hyps.append(Hypothesis(hist_tok[row, :t].tolist(), raw / length_penalty(t, alpha),
                                       hist_att[row, :t].cpu(), raw, False))
        hyps.sort(key=lambda h: h.score, reverse=True)
        results[img] = hyps[:n_best]

    for t in range(T + 1):
        A, beams = scores.shape
        log_probs, new_state, attn = decoder.step(prev, state)  # (R, V), (R, N)
        reorder.track(new_state)
        state = new_state
        V = log_probs.size(-1)
        log_probs = _ban(log_probs.double(), banned_ids, eos_id)  # (R, V)
        if t == T:  # after max_len words only <eos> may follow
            only_eos = torch.full_like(log_probs, NEG_INF)  # (R, V)
            only_eos[:, eos_id] = log_probs[:, eos_id]
            log_probs = only_eos
        cand = (scores.view(-1, 1) + log_probs).view(A, beams * V)  # (A, beams*V)
        top_s, top_i = cand.topk(min(2 * K, beams * V), dim=1)  # (A, C)
        top_tok = top_i % V  # (A, C)
        src = torch.arange(A, device=device).view(-1, 1) * beams + top_i // V  # (A, C) source rows
        is_eos = top_tok == eos_id  # (A, C)
        ends = is_eos & torch.isfinite(top_s)
        ends[:, K:] = False  # only an <eos> among the K best candidates finishes a hypothesis
        if bool(ends.any()):
            for a, c in ends.nonzero().tolist():
                row, raw, img = int(src[a, c]), float(top_s[a, c]), active[a]
                finished[img].append(Hypothesis(hist_tok[row, :t].tolist(), raw / length_penalty(t + 1, alpha),
                                                hist_att[row, :t].cpu(), raw, True))
                finished[img].sort(key=lambda h: h.score, reverse=True)
                del finished[img][n_best:]
        if t == T:
            for a, img in enumerate(active):
                close(a, img, t)
            break
        live_s, pos = top_s.masked_fill(is_eos, NEG_INF).topk(min(K, top_s.size(1)), dim=1)  # (A, K')
        # Best normalised score any live beam can still reach: raw sums only fall, lp(L) is monotonic
        # in L, so the optimum sits at the shortest (t + 2) or longest (T + 1) finished length.
        best = live_s[:, 0]  # (A,)
        bound = torch.maximum(best / length_penalty(t + 2, alpha), best / length_penalty(T + 1, alpha))
        keep = []
        for a, (img, b) in enumerate(zip(active, bound.tolist())):
            hyps = finished[img]
            if b == NEG_INF or (len(hyps) >= n_best and hyps[n_best - 1].score >= b):
                close(a, img, t)
            else:
                keep.append(a)
        if not keep:
            break
        keep_t = torch.tensor(keep, device=device)
        rows = src.gather(1, pos)[keep_t].reshape(-1)  # (A'*K',) source row of each new beam
        toks = top_tok.gather(1, pos)[keep_t].reshape(-1)  # (A'*K',)
        state = reorder(state, rows, keep_t, beams, pos.size(1), A)
        hist_tok = hist_tok.index_select(0, rows)
        hist_tok[:, t] = toks
        hist_att = hist_att.index_select(0, rows)
        hist_att[:, t] = attn.index_select(0, rows).float()
        scores = live_s[keep_t]  # (A', K')
        active = [active[a] for a in keep]
        prev = toks
    return [r if r is not None else [] for r in results]


def _fingerprint(value: object) -> tuple:
    """Identity and in-place version of every tensor inside a (nested) state entry."""
    if isinstance(value, torch.Tensor):  # an inference tensor cannot be modified outside inference mode
        return ((id(value), -1 if value.is_inference() else value._version),)
    if isinstance(value, dict):
        return tuple(x for v in value.values() for x in _fingerprint(v)) + (id(value), len(value))
    if isinstance(value, (list, tuple)):
        return tuple(x for v in value for x in _fingerprint(v)) + (id(value), len(value))
    return (id(value),)


class _Reorderer:
    """``decoder.reorder_state`` that skips copying per-image constants.

    A state entry that ``step`` has left untouched at every step since ``init_state`` (same objects,
    no in-place change: tensor version counters are compared) still holds one row per image, repeated
    for its beams; moving rows within an image's group leaves it unchanged. Such entries (SAT's region
    features and their attention projections, the Transformer's projected memory) are re-indexed only
    when the groups change (first expansion to K beams, images leaving the batch) instead of being
    copied at every step. Decoders with their own ``reorder_state`` always get the whole state.
    """

    def __init__(self, decoder: CaptionDecoder, state: object) -> None:
        self.decoder = decoder
        default = getattr(decoder.reorder_state, "__func__", None) is CaptionDecoder.reorder_state
        self.prints = {k: _fingerprint(v) for k, v in state.items()} if default and isinstance(state, dict) else {}

    def track(self, new: object) -> None:
        """Drop every entry that the last ``step`` replaced or changed in place."""
        if not isinstance(new, dict):
            self.prints = {}
            return
        self.prints = {k: fp for k, fp in self.prints.items() if k in new and _fingerprint(new[k]) == fp}

    def __call__(self, state: object, rows: torch.Tensor, keep: torch.Tensor, beams: int, new_beams: int,
                 groups: int) -> object:
        if not self.prints or not isinstance(state, dict):
            return self.decoder.reorder_state(state, rows)
        moving = {k: v for k, v in state.items() if k not in self.prints}
        out = self.decoder.reorder_state(moving, rows)
        constant = {k: state[k] for k in self.prints}
        if keep.numel() != groups or new_beams != beams:  # groups change: row 0 of each kept group
            constant = self.decoder.reorder_state(constant, (keep * beams).repeat_interleave(new_beams))
            self.prints = {k: _fingerprint(v) for k, v in constant.items()}
        out.update(constant)
        return out


def _grid_for(model: torch.nn.Module, n_regions: int) -> tuple[int, int]:
    g = getattr(getattr(getattr(model, "config", None), "encoder", None), "grid", None)
    if g is not None and g * g == n_regions:
        return (g, g)
    root = math.isqrt(n_regions)
    if root * root != n_regions:
        raise ConfigError(f"cannot shape {n_regions} regions into a square grid; pass grid=(rows, cols)")
    return (root, root)


def never_emitted_ids(vocab: Vocabulary, options: DecodeOptions | None = None) -> tuple[int, ...]:
    """Ids a caption never contains: ``<pad>``, ``<bos>`` and, unless ``options.allow_unk``, ``<unk>``."""
    if options is not None and options.allow_unk:
        return (vocab.pad_id, vocab.bos_id)
    return (vocab.pad_id, vocab.bos_id, vocab.unk_id)


def _to_results(hyps: list[list[Hypothesis]], vocab: Vocabulary, grid: tuple[int, int]) -> list[CaptionResult]:
    out = []
    for per_image in hyps:
        h = per_image[0]
        words = [vocab.itos[i] if 0 <= i < len(vocab) else "<unk>" for i in h.tokens]
        attention = h.attention.view(len(h.tokens), grid[0], grid[1])  # (L, g, g)
        out.append(CaptionResult(vocab.decode(h.tokens), words, list(h.tokens), h.score, attention, grid, h.finished))
    return out


def caption_features(
    model: torch.nn.Module,
    features: torch.Tensor,
    vocab: Vocabulary,
    options: DecodeOptions | None = None,
    grid: tuple[int, int] | None = None,
) -> list[CaptionResult]:
    """Best caption per image from precomputed region features.

    Args:
        model: a ``Captioner`` (its ``decoder`` is used); switched to eval mode for the search and
            restored afterwards. ``<pad>`` and ``<bos>`` are never emitted, nor ``<unk>`` unless
            ``options.allow_unk``.
        features: (B, N, D) region features.
        vocab: the vocabulary the model was trained with.
        options: search options.
        grid: (rows, cols) of the regions; default from ``model.config.encoder.grid`` or sqrt(N).

    Returns:
        One ``CaptionResult`` per image.
    """
    grid = grid or _grid_for(model, features.size(1))
    if grid[0] * grid[1] != features.size(1):
        raise ConfigError(f"grid {grid} does not match {features.size(1)} regions")
    was_training = model.training
    model.eval()
    try:
        hyps = decode(model.decoder, features, vocab.bos_id, vocab.eos_id, options, never_emitted_ids(vocab, options))
    finally:
        model.train(was_training)
    return _to_results(hyps, vocab, grid)


def caption_images(
    model: torch.nn.Module,
    images: torch.Tensor,
    vocab: Vocabulary,
    options: DecodeOptions | None = None,
) -> list[CaptionResult]:
    """Encode images (B, 3, S, S) with ``model.encode`` and caption them; see :func:`caption_features`."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            features, grid = model.encode(images)  # (B, N, D), (g, g)
        hyps = decode(model.decoder, features, vocab.bos_id, vocab.eos_id, options, never_emitted_ids(vocab, options))
    finally:
        model.train(was_training)
    return _to_results(hyps, vocab, (int(grid[0]), int(grid[1])))
