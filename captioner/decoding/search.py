"""Greedy and batched beam search, written only against the ``CaptionDecoder`` interface.

Shape legend: B images, K beams, A images still searching, R rows in the decoder batch (A * beams),
N regions (g*g), D feature width, V vocabulary, L words of a caption.

Search talks to a decoder only through ``init_state(features)`` and ``step(prev_tokens, state)``, and
moves batch rows with the ``State`` methods (``select`` / ``reorder``, see
:mod:`captioner.models.base`); it never re-implements a decoder step. Put the decoder in eval mode
first (``decode`` works on whatever mode it is in; :func:`captioner.inference.caption_features`
switches the model to eval and restores its mode afterwards).

Length: a caption has at most ``max_len`` words. After ``max_len`` words the search asks the decoder
once more, for ``<eos>`` only, so a caption of exactly ``max_len`` words can still finish. If the
decoder never gives ``<eos>`` a finite probability, the best unfinished beams are returned instead
(``Hypothesis.finished`` is False) -- decoding never fails for lack of ``<eos>``.

Scores: ``log_prob`` is the sum of the log-probabilities of every emitted token, including the
``<eos>`` step when the caption finished. ``score = log_prob / lp(L)`` with the GNMT length penalty
(Wu et al. 2016) ``lp(L) = ((5 + L) / 6) ** alpha``, where L counts the scored tokens (words, plus one
for ``<eos>`` when finished) and ``alpha = DecodeOptions.length_penalty``; ``alpha = 0`` gives the raw
sum. Larger alpha favours longer captions.

Never emitted: ``<pad>`` and ``<bos>``, and ``<unk>`` unless ``DecodeOptions.allow_unk``
(:func:`never_emitted_ids`; the inference layer passes them, ``decode`` itself suppresses exactly the
``banned_ids`` it is given, through :class:`captioner.decoding.filters.SuppressTokens`).

This module knows decoders and region features, nothing about images: the pipeline from an image
to a :class:`captioner.inference.Caption` is :mod:`captioner.inference`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from captioner.config import DecodeOptions  # the config tree's decoding section; importable from here too
from captioner.decoding.budget import image_chunks
from captioner.decoding.filters import BlockRepeats, SuppressTokens
from captioner.decoding.hypotheses import (NEG_INF, BeamHistory, Hypothesis, LiveBeams, Pending, best_reachable,
                                           keep_best, length_penalty, top_candidates)
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder, State
from captioner.text import STOP_WORDS, Vocabulary

logger = logging.getLogger(__name__)

# Hypothesis and length_penalty live in captioner.decoding.hypotheses and are part of this module's API too.
__all__ = ["DecodeOptions", "Hypothesis", "beam_search", "decode", "greedy_search", "initial_state", "length_penalty",
           "never_emitted_ids"]


def decode(
    decoder: CaptionDecoder,
    features: torch.Tensor,
    bos_id: int,
    eos_id: int,
    options: DecodeOptions | None = None,
    banned_ids: Sequence[int] = (),
    content_ids: Sequence[int] = (),
) -> list[list[Hypothesis]]:
    """Caption a batch of images from region features.

    Args:
        decoder: any ``CaptionDecoder`` (put it in eval mode first).
        features: (B, N, D) region features.
        bos_id: id fed at the first step.
        eos_id: id that ends a caption.
        options: search options; default ``DecodeOptions()`` (beam 3, 20 words).
        banned_ids: ids never emitted (e.g. ``<pad>``, ``<bos>``; never ``<eos>``): a
            :class:`SuppressTokens` filter sets their log-probabilities to -inf, the others are not
            renormalised.
        content_ids: the ids that ``options.no_repeat_words`` lets a caption use once
            (:func:`content_word_ids`).

    Returns:
        Per image, ``options.n_best`` hypotheses, best score first.

    Raises:
        ConfigError: features that are not (B, N, D), or a search that could need more memory than
            :data:`captioner.decoding.budget.MEMORY_LIMIT` for one image (one line naming the beam
            size and ``max_len``). Images are searched in chunks that fit the limit.
    """
    options = options or DecodeOptions()
    if features.dim() != 3:
        raise ConfigError(f"decode expects features of shape (B, N, D), got {tuple(features.shape)}")
    if features.size(0) == 0:
        return []
    if decoder.training:
        logger.warning("decode() called with the decoder in training mode (dropout / sampling active); "
                       "call .eval() first or use captioner.inference.caption_features()")
    # no_grad, and inference mode off even inside a caller's inference_mode, so that the returned
    # attention maps are ordinary tensors that a caller may change in place.
    search = greedy_search if options.beam_size == 1 else beam_search
    out: list[list[Hypothesis]] = []
    with torch.inference_mode(False), torch.no_grad():
        for chunk in image_chunks(decoder, features, options):  # a refused request raises before any step
            out += search(decoder, features[chunk], bos_id, eos_id, options, banned_ids, content_ids)
    return out


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


def greedy_search(decoder: CaptionDecoder, features: torch.Tensor, bos_id: int, eos_id: int,
                  options: DecodeOptions, banned_ids: Sequence[int] = (),
                  content_ids: Sequence[int] = ()) -> list[list[Hypothesis]]:
    """Batched greedy decoding (argmax at each step); see :func:`decode`."""
    suppress = SuppressTokens(banned_ids, eos_id)
    repeats = repeat_filter(options, content_ids, eos_id)
    B, N = features.shape[:2]
    T, device = options.max_len, features.device
    state = initial_state(decoder, features)
    prev = torch.full((B,), bos_id, dtype=torch.long, device=device)  # (B,)
    steps: list[torch.Tensor] = []  # one (B,) per word: memory grows with the words generated
    attn_steps: list[torch.Tensor] = []  # one (B, N) per word
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
        log_probs = suppress(log_probs)
        if repeats and steps:
            log_probs = repeats(log_probs, torch.stack(steps, 1))
        best_lp, best = log_probs.max(dim=-1)  # (B,), (B,)
        live = ~done
        log_prob = torch.where(live, log_prob + best_lp.double(), log_prob)
        ends = live & (best == eos_id)
        n_words = torch.where(ends, torch.full_like(n_words, t), n_words)
        steps.append(best)
        attn_steps.append(attn.to(torch.float32, copy=True))  # a copy: a decoder may reuse its buffer
        done |= ends
        if bool(done.all()):
            break
        prev = best
    tokens = torch.stack(steps, 1) if steps else torch.zeros(B, 0, dtype=torch.long, device=device)  # (B, L)
    attn_hist = torch.stack(attn_steps, 1) if attn_steps else features.new_zeros(B, 0, N).float()  # (B, L, N)
    out = []
    for b, (n, lp_b, fin) in enumerate(zip(n_words.tolist(), log_prob.tolist(), done.tolist())):
        scored = n + int(fin)
        out.append([Hypothesis(tokens[b, :n].tolist(), lp_b / length_penalty(scored, options.length_penalty),
                               attn_hist[b, :n].cpu(), lp_b, fin)])
    return out


def beam_search(decoder: CaptionDecoder, features: torch.Tensor, bos_id: int, eos_id: int,
                options: DecodeOptions, banned_ids: Sequence[int] = (),
                content_ids: Sequence[int] = ()) -> list[list[Hypothesis]]:
    """Batched beam search: all images and beams go through ``decoder.step`` as one batch.

    The first step runs one copy per image and takes its K best distinct words, so beams never start
    as duplicates. At each step the 2K best (beam, word) candidates of every image are ranked; an
    ``<eos>`` among the K best finishes a hypothesis, and the K best other candidates live on. An image
    stops once it holds ``n_best`` finished hypotheses that no live beam can still beat (log-probs are
    <= 0, so a beam's sum only falls; with a length penalty the bound uses the most favourable
    length), and its rows leave the batch. The result equals image-by-image search.

    The decoder state follows the beams: ``State.reorder`` (the per-step case: only ``dynamic`` is
    copied) while every image keeps its rows, ``State.select`` when the rows change image (the first
    expansion to K beams, images leaving the batch).
    """
    suppress = SuppressTokens(banned_ids, eos_id)
    repeats = repeat_filter(options, content_ids, eos_id)
    B, N = features.shape[:2]
    K, T, alpha, n_best = options.beam_size, options.max_len, options.length_penalty, options.n_best
    device = features.device
    state = initial_state(decoder, features)  # B rows: one copy per image for the first step
    beams = LiveBeams(scores=torch.zeros(B, 1, dtype=torch.float64, device=device), images=list(range(B)))
    history = BeamHistory()  # what each step chose: memory grows with the words generated, not max_len
    prev = torch.full((B,), bos_id, dtype=torch.long, device=device)  # (R,)
    words = torch.zeros(B, 0, dtype=torch.long, device=device)  # (R, t) each row's words so far (BlockRepeats)
    finished: list[list[Pending]] = [[] for _ in range(B)]  # per image, best first, at most n_best
    results: list[list[Pending]] = [[] for _ in range(B)]

    def close(a: int, t: int) -> None:
        """Group ``a``'s image is done after ``t`` words; too few finished: add its best live beams."""
        hyps = finished[beams.images[a]]
        if len(hyps) < n_best:
            hyps += beams.unfinished(a, t, alpha, n_best - len(hyps))
        hyps.sort(key=lambda h: h.score, reverse=True)
        results[beams.images[a]] = hyps[:n_best]

    for t in range(T + 1):
        log_probs, state, attn = decoder.step(prev, state)  # (R, V), (R, N)
        log_probs = _search_log_probs(log_probs, suppress, eos_id, eos_only=t == T)  # (R, V) float64
        if repeats:
            log_probs = repeats(log_probs, words)
        top_s, src, tok = top_candidates(beams.scores, log_probs, 2 * K)  # (A, C) each
        is_eos = tok == eos_id  # (A, C)
        ends = is_eos & torch.isfinite(top_s)
        ends[:, K:] = False  # only an <eos> among the K best candidates finishes a hypothesis
        for a, c in ends.nonzero().tolist():
            hyp = beams.pending(int(src[a, c]), t, float(top_s[a, c]), alpha, finished=True)
            keep_best(finished[beams.images[a]], hyp, n_best)
        if t == T:
            for a in range(len(beams.images)):
                close(a, t)
            break
        live_s, pos = top_s.masked_fill(is_eos, NEG_INF).topk(min(K, top_s.size(1)), dim=1)  # (A, K')
        keep = []
        for a, bound in enumerate(best_reachable(live_s[:, 0], t, T, alpha).tolist()):
            hyps = finished[beams.images[a]]
            if bound == NEG_INF or (len(hyps) >= n_best and hyps[n_best - 1].score >= bound):
                close(a, t)
            else:
                keep.append(a)
        if not keep:
            break
        keep_t = torch.tensor(keep, device=device)
        rows = src.gather(1, pos)[keep_t].reshape(-1)  # (A'*K',) source row of each new beam
        toks = tok.gather(1, pos)[keep_t].reshape(-1)  # (A'*K',)
        same_groups = len(keep) == len(beams.images) and pos.size(1) == beams.width
        state = state.reorder(rows) if same_groups else state.select(rows)
        history.append(rows, toks, attn.index_select(0, rows).float())
        if repeats:
            words = torch.cat([words.index_select(0, rows), toks.unsqueeze(1)], dim=1)
        beams = LiveBeams(live_s[keep_t], [beams.images[a] for a in keep])
        prev = toks
    read = iter(history.read([h for per_image in results for h in per_image], N))
    return [[next(read) for _ in per_image] for per_image in results]


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
