"""Graphed decoding steps (``captioner.decoding.graphs``): the same captions as the plain search.

On the CPU the wrapper runs its static-buffer path eagerly (the buffers, the per-shape entries and
the copy of per-image constants only when the search hands over new ones are all exercised); the
capture itself needs CUDA (the last test).
"""

from __future__ import annotations

import pytest
import torch

from captioner.decoding.graphs import GraphedSteps
from captioner.decoding.search import SearchRules, DecodeOptions, decode
from captioner.errors import ConfigError
from captioner.models.lstm import SATDecoder
from captioner.models.transformer import TransformerCaptionDecoder

BOS, EOS, V, N, D = 1, 2, 14, 9, 12


def _decoder(device: str = "cpu", attention: str = "soft") -> SATDecoder:
    torch.manual_seed(1)
    decoder = SATDecoder(V, D, embed_dim=8, hidden_dim=16, attention_dim=8, dropout=0.0, attention=attention,
                         hard_test_mode="argmax")
    with torch.no_grad():  # sharper weights and a likelier <eos>: images finish at different steps
        for p in decoder.parameters():
            p.mul_(6.0)
        decoder.out_word.bias[EOS] += 1.0
    return decoder.to(device).eval()


def _features(images: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(images, N, D, generator=torch.Generator().manual_seed(3)).relu().to(device)


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for per_a, per_b in zip(a, b):
        assert len(per_a) == len(per_b)
        for x, y in zip(per_a, per_b):
            assert (x.tokens, x.score, x.log_prob, x.finished) == (y.tokens, y.score, y.log_prob, y.finished)
            assert torch.equal(x.attention, y.attention)


@pytest.mark.parametrize("options", [DecodeOptions(beam_size=1, max_len=9),
                                     DecodeOptions(beam_size=3, max_len=9),
                                     DecodeOptions(beam_size=3, max_len=9, length_penalty=0.7, n_best=2)],
                         ids=["greedy", "beam3", "beam3-lp-nbest2"])
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_graphed_steps_give_the_plain_search_exactly(options: DecodeOptions, attention: str) -> None:
    decoder, features = _decoder(attention=attention), _features(6)
    plain = decode(decoder, features, SearchRules(BOS, EOS, (0, BOS)), options)
    graphed = GraphedSteps(decoder, capture=False)
    for _ in range(2):  # the second call reuses the first call's buffers
        _same(decode(graphed, features, SearchRules(BOS, EOS, (0, BOS)), options), plain)
    lengths = {len(h[0].tokens) for h in plain}
    assert len(lengths) > 1  # captions end at different steps: the batch shrinks mid-search
    if options.beam_size > 1:  # B rows, then B*K, then fewer as images finish: several shapes
        assert graphed.stats.shapes >= 3 and graphed.stats.static_copies >= 3
    else:
        assert graphed.stats.shapes == 1 and graphed.stats.static_copies == 2  # one per decode call


def test_per_image_constants_are_copied_only_when_the_search_hands_over_new_ones() -> None:
    """Greedy search keeps one ``State.static`` for the whole caption: one copy per call, however many steps."""
    graphed = GraphedSteps(_decoder(), capture=False)
    decode(graphed, _features(4), SearchRules(BOS, EOS), DecodeOptions(beam_size=1, max_len=12))
    assert graphed.stats.static_copies == 1 and graphed.stats.eager_steps > 1
    other = _features(4) + 1.0  # new images of the same shape: their constants must replace the old ones
    _same(decode(graphed, other, SearchRules(BOS, EOS), DecodeOptions(beam_size=1, max_len=12)),
          decode(_decoder(), other, SearchRules(BOS, EOS), DecodeOptions(beam_size=1, max_len=12)))
    assert graphed.stats.static_copies == 2


def test_growing_state_decoders_and_bad_values_are_refused() -> None:
    transformer = TransformerCaptionDecoder(V, D, grid=3, d_model=16, num_layers=1, num_heads=2, ff_dim=32)
    with pytest.raises(ConfigError, match="state grows with every word; only decoders with a fixed-size state"):
        GraphedSteps(transformer)
    with pytest.raises(ConfigError, match="max_graphs must be >= 0, got -1"):
        GraphedSteps(_decoder(), max_graphs=-1)
    with pytest.raises(ConfigError, match=r"needs a CUDA device \(the decoder is on cpu\)"):
        GraphedSteps(_decoder(), capture=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the capture itself needs a CUDA device")
def test_captured_steps_give_the_plain_search_exactly_on_cuda() -> None:
    decoder, features = _decoder("cuda"), _features(6, "cuda")
    graphed = GraphedSteps(decoder)
    for beam in (1, 3):
        options = DecodeOptions(beam_size=beam, max_len=9)
        plain = decode(decoder, features, SearchRules(BOS, EOS), options)
        _same(decode(graphed, features, SearchRules(BOS, EOS), options), plain)
    assert graphed.stats.captures >= 2 and graphed.stats.replays > 0 and graphed.stats.failed == 0


def test_only_shapes_that_come_back_get_buffers_and_at_most_max_graphs() -> None:
    """A shrinking beam batch passes through sizes seen once: those run the decoder's own step."""
    features, options = _features(6), DecodeOptions(beam_size=3, max_len=9)
    plain = decode(_decoder(), features, SearchRules(BOS, EOS), options)
    graphed = GraphedSteps(_decoder(), max_graphs=1, capture=False)
    _same(decode(graphed, features, SearchRules(BOS, EOS), options), plain)
    assert len(graphed._entries) == 1 and graphed.stats.shapes >= 3
    (key,) = graphed._entries
    assert key[0] == (18,)  # 6 images x 3 beams: the shape of most steps
    assert graphed.stats.static_copies == 1  # the 18 rows' constants, copied once: reorder keeps them
