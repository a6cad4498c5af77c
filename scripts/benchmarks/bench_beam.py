"""Beam search throughput: batched (all images x beams in one decoder batch) vs image by image.

A Show-Attend-Tell soft-attention decoder of realistic width (512) over 7x7 regions of 1280
features (EfficientNet-Lite0's grid), vocabulary 5000, random weights and features; beam 3,
max_len 20 words, 64 images (16 with ``--quick``). Random weights never favour ``<eos>`` much, so
most captions run to max_len: the worst case for both variants. Also timed: the batched search
when every state entry is copied at every step (the same decoder declaring no per-image constants,
so its region features and their projections move with the beams like ``h`` and ``c``). Run through
``scripts/benchmark.py``:

    python scripts/benchmark.py --only beam
"""

from __future__ import annotations

import time

import torch

from captioner.decoding.search import SearchRules, DecodeOptions, decode
from captioner.models.base import State
from captioner.models.lstm import SATDecoder

BOS, EOS = 1, 2


def _decoder(vocab: int, dim: int, cls: type[SATDecoder] = SATDecoder) -> SATDecoder:
    torch.manual_seed(0)  # the same weights for every class
    return cls(vocab_size=vocab, feature_dim=dim, embed_dim=512, hidden_dim=512, attention_dim=512,
               dropout=0.0, attention="soft").eval()


class _AllDynamic(SATDecoder):
    """The same decoder with its per-image constants declared as changing each step."""

    def init_state(self, features: torch.Tensor) -> State:
        state = super().init_state(features)
        return State({}, {"static": state.static, "dynamic": state.dynamic})

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        log_probs, new, attn = super().step(prev_tokens, State(state.dynamic["static"], state.dynamic["dynamic"]))
        return log_probs, State({}, {"static": new.static, "dynamic": new.dynamic}), attn


def bench_beam(quick: bool = False) -> dict:
    """Images per second, beam 3, batched vs one image per ``decode`` call (same run, same inputs)."""
    n_images, regions, dim, vocab = (16, 49, 1280, 5000) if quick else (64, 49, 1280, 5000)
    decoder = _decoder(vocab, dim)
    features = torch.randn(n_images, regions, dim, generator=torch.Generator().manual_seed(1))  # (B, N, D)
    opts = DecodeOptions(beam_size=3, max_len=20)
    decode(decoder, features[:2], SearchRules(BOS, EOS), opts)  # warm-up

    t0 = time.perf_counter()
    batched = decode(decoder, features, SearchRules(BOS, EOS), opts)
    t_batched = time.perf_counter() - t0

    # the same search when every state entry is copied at every step (no per-image constants declared)
    copying = _decoder(vocab, dim, _AllDynamic)
    t0 = time.perf_counter()
    decode(copying, features, SearchRules(BOS, EOS), opts)
    t_copying = time.perf_counter() - t0

    t0 = time.perf_counter()
    single = [decode(decoder, features[b:b + 1], SearchRules(BOS, EOS), opts)[0] for b in range(n_images)]
    t_single = time.perf_counter() - t0

    same = sum(a[0].tokens == b[0].tokens for a, b in zip(batched, single))
    mean_len = sum(len(h[0].tokens) for h in batched) / n_images
    return {
        "batched_images_per_s": n_images / t_batched,
        "per_image_images_per_s": n_images / t_single,
        "batched_copying_state_images_per_s": n_images / t_copying,
        "ratio": t_single / t_batched,
        "images": n_images,
        "same_captions": same,
        "mean_words": mean_len,
        "threads": torch.get_num_threads(),
    }


BENCHMARKS = {"beam": bench_beam}
