"""How much memory a search may take, checked before its first step.

Search memory grows with the words generated (:mod:`captioner.decoding.hypotheses`), but a model
that never gives ``<eos>`` generates ``max_len`` words on every beam, so the bound is worked out for
that worst case: per row of the decoder batch and per word, the back-pointer, the word, the
attention over the N regions and the growth of the decoder's state (the Transformer's key/value
cache, counted twice because each step copies it); per row and step, the float64 scores of every
candidate word. A request whose single image could need more than :data:`MEMORY_LIMIT` is refused
in one line naming the beam size and ``max_len``; otherwise images are searched in chunks that fit.
"""

from __future__ import annotations

import torch

from captioner.config import DecodeOptions
from captioner.errors import ConfigError
from captioner.files import size_text

__all__ = ["MEMORY_LIMIT", "image_chunks", "search_bytes"]

MEMORY_LIMIT = 2 * 1024**3  # bytes one decode() call may plan for (all chunks run one after another)


def search_bytes(rows: int, max_len: int, n_regions: int, vocab_size: int, state_per_word: int = 0) -> int:
    """Worst-case bytes of one image's search with ``rows`` beams (1 for greedy).

    Args:
        rows: decoder rows of the image (the beam size).
        max_len: most words (plus the one ``<eos>``-only step).
        n_regions: N, attention values per word.
        vocab_size: V, candidate scores per row and step.
        state_per_word: the decoder state's growth per row and word (``state_bytes_per_word``).
    """
    per_word = 8 + 8 + 4 * n_regions + 2 * state_per_word  # parent row, word, attention (fp32), state
    per_step = 3 * 8 * vocab_size  # float64 log-probs, candidate sums and their top-k
    return rows * ((max_len + 1) * per_word + per_step)


def image_chunks(decoder: torch.nn.Module, features: torch.Tensor, options: DecodeOptions) -> list[slice]:
    """Slices of the batch ``features`` (B, N, D) to search one after another within :data:`MEMORY_LIMIT`.

    Raises:
        ConfigError: one image alone could need more (one line naming the beam size and max_len).
    """
    batch, n_regions = features.shape[:2]
    grow = decoder.state_bytes_per_word() if hasattr(decoder, "state_bytes_per_word") else 0
    one = search_bytes(options.beam_size, options.max_len, n_regions, int(getattr(decoder, "vocab_size", 0)), grow)
    if one > MEMORY_LIMIT:
        raise ConfigError(f"beam size {options.beam_size} with max_len {options.max_len} (--beam, --max-len) could "
                          f"need {size_text(one)} for one image's search if no caption ended before max_len (limit "
                          f"{size_text(MEMORY_LIMIT)}): lower --beam or --max-len")
    per_chunk = max(1, MEMORY_LIMIT // max(one, 1))
    return [slice(i, min(i + per_chunk, batch)) for i in range(0, batch, per_chunk)]
