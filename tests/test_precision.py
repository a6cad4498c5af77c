"""Decoding in bfloat16 (captioner.decoding.search): the fused SAT steps compute the decoder's own
step, bfloat16 search returns well-formed captions close to float32's, and the low-precision decoder
follows the weights."""

from __future__ import annotations

import pytest
import torch

from captioner.models.concepts import SATConcepts
from captioner.config import DecodeOptions, get_preset
from captioner.decoding.search import SearchRules, decode, decoder_for
from captioner.errors import ConfigError
from captioner.models.base import State
from captioner.models.lstm import FusedSATSteps, SATDecoder
from captioner.models.model import build_model

BOS, EOS = 1, 2


def _model(preset: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(get_preset(preset).model, vocab_size=20).eval()


def _features(model, count: int = 4, seed: int = 1) -> torch.Tensor:
    images = torch.randn(count, 3, 64, 64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.encode(images)[0]  # (B, N, D)


def _sharp(decoder: SATDecoder) -> SATDecoder:
    """A random decoder with a peaked output layer (random ones are near uniform: every step a tie)."""
    with torch.no_grad():
        decoder.out_word.weight.mul_(40.0)
        decoder.out_word.bias.copy_(torch.linspace(0, 3, decoder.vocab_size))
    return decoder


def _fused_steps_match(decoder: SATDecoder, feats: torch.Tensor) -> FusedSATSteps:
    """The decoder's float32 fused steps, checked for 5 steps against its own (log-probs and attention)."""
    fused = FusedSATSteps(decoder, torch.float32)
    ref_state, fused_state = decoder.init_state(feats), fused.init_state(feats)
    tokens = torch.tensor([BOS] * feats.shape[0])
    with torch.no_grad():
        for t in range(5):
            want, ref_state, want_alpha = decoder.step(tokens, ref_state)
            got, fused_state, got_alpha = fused.step(tokens, fused_state)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_alpha, want_alpha, atol=1e-6, rtol=1e-5)
            tokens = torch.randint(3, 20, tokens.shape, generator=torch.Generator().manual_seed(t))
    return fused


@pytest.mark.parametrize("preset,mode", [("sat_soft_tiny", None), ("sat_hard_tiny", "expectation")])
def test_fused_steps_compute_the_decoders_step(preset, mode):
    decoder = _model(preset).decoder
    if mode:
        decoder.hard_test_mode = mode
    feats = _features(_model(preset))
    fused = _fused_steps_match(decoder, feats)
    # and the whole search, beams grouped per image, finds the same captions
    opts = DecodeOptions(beam_size=3, max_len=8, n_best=2)
    for a, b in zip(decode(fused, feats, SearchRules(BOS, EOS), opts), decode(decoder, feats, SearchRules(BOS, EOS), opts)):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)


def test_fused_steps_refuse_what_they_do_not_compute():
    decoder = _model("sat_hard_tiny").decoder
    decoder.hard_test_mode = "argmax"  # one region's feature, not the expectation the fused step takes
    with pytest.raises(ValueError, match="FusedSATSteps"):
        FusedSATSteps(decoder, torch.float32)
    assert not isinstance(decoder_for(decoder, "bfloat16"), FusedSATSteps)  # a bfloat16 copy instead
    with pytest.raises(TypeError, match="step by step"):
        FusedSATSteps(_model("sat_soft_tiny").decoder, torch.float32)(torch.zeros(1, 16, 8), torch.zeros(1, 3).long())


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "sat_hard_tiny", "transformer_tiny"])
def test_bfloat16_search_gives_float32_attention_and_close_scores(preset):
    model = _model(preset)
    if preset.startswith("sat"):
        _sharp(model.decoder)
    feats = _features(model, count=6)
    opts = DecodeOptions(beam_size=3, max_len=8)
    full = decode(model.decoder, feats, SearchRules(BOS, EOS), opts)
    low = decode(model.decoder, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=3, max_len=8, precision="bfloat16"))
    assert next(model.decoder.parameters()).dtype == torch.float32  # the model itself untouched
    same = 0
    for (a,), (b,) in zip(low, full):
        assert a.attention.dtype == torch.float32 and a.attention.shape == (len(a.tokens), feats.shape[1])
        torch.testing.assert_close(a.attention.sum(-1), torch.ones(len(a.tokens)), atol=1e-2, rtol=0)
        assert all(0 <= t < 20 and t not in (0, BOS) for t in a.tokens)
        if a.tokens == b.tokens:
            same += 1
            assert a.score == pytest.approx(b.score, rel=0.05, abs=0.05)  # bfloat16 keeps ~3 digits
    assert same >= 3  # near ties may fall the other way, most captions do not


def test_bfloat16_decoder_is_kept_until_a_weight_changes():
    decoder = _model("sat_soft_tiny").decoder
    first = decoder_for(decoder, "bfloat16")
    assert isinstance(first, FusedSATSteps) and decoder_for(decoder, "bfloat16") is first
    assert decoder_for(decoder, "float32") is decoder
    assert "_low_precision" not in dict(decoder.named_modules()) and not any(
        "low_precision" in k for k in decoder.state_dict())  # never saved with the model
    with torch.no_grad():
        decoder.out_word.bias.add_(1.0)  # an optimizer step, as far as the cache can tell
    second = decoder_for(decoder, "bfloat16")
    assert second is not first
    torch.testing.assert_close(second.weights["b_o"].float(), decoder.out_word.bias, atol=0.05, rtol=0.01)


def test_bfloat16_copy_for_decoders_the_fused_steps_do_not_cover():
    from captioner.models.lstm import SATDecoder

    torch.manual_seed(0)
    concepts = SATDecoder(vocab_size=20, feature_dim=8, embed_dim=8, hidden_dim=10, attention_dim=7, dropout=0.0,
                          extension=SATConcepts(8, 10, 3, 8, True, concept_hidden=6)).eval()
    low = decoder_for(concepts, "bfloat16")
    assert not isinstance(low, FusedSATSteps) and next(low.parameters()).dtype == torch.bfloat16
    assert next(concepts.parameters()).dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in low.extension.concept_head.parameters())  # reads float32 features
    feats = torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(2))
    for (h,) in decode(concepts, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=2, max_len=6, precision="bfloat16")):
        assert h.attention.dtype == torch.float32 and len(h.tokens) <= 6


def test_precision_is_checked_by_name():
    with pytest.raises(ConfigError, match="precision must be one of float32, bfloat16, got 'float16'"):
        DecodeOptions(precision="float16")
    with pytest.raises(ValueError, match="float64"):
        decoder_for(_model("sat_soft_tiny").decoder, "float64")
    model = _model("sat_soft_tiny")
    state = FusedSATSteps(model.decoder, torch.bfloat16).init_state(_features(model, count=2))
    assert isinstance(state, State) and state.static["features"].dtype == torch.bfloat16


def _label_decoder() -> tuple[SATDecoder, torch.Tensor]:
    """A SAT decoder reading labels (its reading's weights random, the copy's gate half open) and features
    of 16 regions (8 values, then 1280 label channels)."""
    from captioner.models.labels import SATLabels

    torch.manual_seed(0)
    reading = SATLabels(8, hidden_dim=10, embed_dim=8, vocab_size=20)
    reading.use_classifier(torch.randn(1000, 1280) * 0.05, torch.zeros(1000))
    reading.use_vocabulary({"dog": 5, "cat": 6, "clock": 7, "bear": 8})
    with torch.no_grad():
        for layer in (reading.init_labels, reading.out_labels, reading.gate):
            layer.weight.normal_(0.0, 0.5)
        reading.gate.bias.zero_()
    decoder = _sharp(SATDecoder(vocab_size=20, feature_dim=8, embed_dim=8, hidden_dim=10, attention_dim=7,
                                dropout=0.0, extension=reading).eval())
    feats = torch.cat([torch.randn(5, 16, 8), torch.rand(5, 16, 1280)], -1)
    return decoder, feats


def test_fused_steps_compute_a_label_readers_step_and_its_search():
    """The label reading leaves the attention alone, so the fused steps take it: the same log-probabilities
    (the copy mixed in), attention, captions, copied words' maps and veto as the decoder's own steps."""
    decoder, feats = _label_decoder()
    assert decoder.fuses() and decoder_for(decoder, "bfloat16").extension is decoder.extension
    fused = _fused_steps_match(decoder, feats)
    for options in (DecodeOptions(beam_size=3, max_len=8, n_best=2), DecodeOptions(beam_size=3, max_len=8, veto=10.0)):
        for a, b in zip(decode(fused, feats, SearchRules(BOS, EOS), options), decode(decoder, feats, SearchRules(BOS, EOS), options)):
            assert [h.tokens for h in a] == [h.tokens for h in b]
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-4)
            for x, y in zip(a, b):  # the copy's shares and the copied words' maps too
                torch.testing.assert_close(x.copy_share, y.copy_share, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(x.attention, y.attention, atol=1e-5, rtol=1e-4)
    low = decode(decoder, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=3, max_len=8, precision="bfloat16"))
    assert all(h.copy_share is not None and h.attention.dtype == torch.float32 for (h,) in low)
