"""Multinomial caption sampling, written only against the ``CaptionDecoder`` interface.

Shape legend: B images, K samples per image, R = B * K sampled rows, N regions, D feature width,
V vocabulary, L <= max_len + 1 sampled steps.

Like :mod:`captioner.decoding.search`, sampling talks to a decoder only through ``init_state``
and ``step`` (the state of B images is expanded to R rows once, with ``State.select``, so
encoder-side projections are computed once per image), and never re-implements a decoder step; it
works for every decoder. It runs without gradients: a self-critical step re-scores the sampled
captions with teacher forcing (``decoder(features, tokens)``), which gives the same
log-probabilities with a graph (:mod:`captioner.training.scst`).

At each step the next word is drawn from ``softmax(log_probs / temperature)`` with the
``banned_ids`` (``<pad>``, ``<bos>``, ``<unk>``: :func:`captioner.decoding.search.never_emitted_ids`)
removed. A caption has at most ``max_len`` words; the step after that may only give ``<eos>``
(as in search). Every position after a row's ``<eos>`` holds ``pad_id``. The random draws use
torch's global generator (saved with a training state, so a resumed run draws the same words).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from captioner.decoding.search import SuppressTokens, initial_state
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder


@dataclass
class SampledCaptions:
    """What :func:`sample_captions` returns (row r is sample ``r % K`` of image ``r // K``).

    Attributes:
        tokens: (R, L) sampled ids: words, then ``<eos>`` when the caption finished, then ``pad_id``.
        lengths: (R,) number of words (``<eos>`` not counted).
        finished: (R,) whether ``<eos>`` was sampled.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    finished: torch.Tensor

    def words(self) -> list[list[int]]:
        """Per row, the word ids without ``<eos>`` and padding (one host sync)."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths.tolist())]


def sample_captions(decoder: CaptionDecoder, features: torch.Tensor, bos_id: int, eos_id: int, pad_id: int,
                    samples: int = 1, max_len: int = 20, temperature: float = 1.0,
                    banned_ids: Sequence[int] = ()) -> SampledCaptions:
    """Draw ``samples`` captions per image.

    Args:
        decoder: any ``CaptionDecoder``, in whatever mode it is in (training mode keeps dropout and,
            for hard attention, region sampling: the policy being trained).
        features: (B, N, D) region features.
        bos_id, eos_id, pad_id: the vocabulary's special ids.
        samples: K, captions per image.
        max_len: most words per caption.
        temperature: > 0; 1 samples from the model's distribution.
        banned_ids: ids never drawn (``pad_id`` must be among them, or padding would be ambiguous).

    Returns:
        ``SampledCaptions`` with R = B * K rows, image-major.
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
