"""Greedy and beam search: known-answer fakes, batched vs one-by-one, real tiny decoders."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from captioner.models.concepts import SATConcepts
from captioner.config import get_preset
from captioner.inference import caption_features
from captioner.decoding.search import (SearchRules, DecodeOptions, decode, length_penalty, search,
                                       never_emitted_ids)
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder, State, expand_groups
from captioner.models.model import build_model
from captioner.text import Vocabulary

BOS, EOS = 1, 2
A, B_, C = 3, 4, 5  # word ids of the 6-token toy vocabulary (0 pad, 1 bos, 2 eos)


class TableDecoder(CaptionDecoder):
    """Next-token probabilities looked up by prefix (a tuple of emitted ids); known answers by hand.

    Attention at each step is peaked on region ``prev_token % N`` so tests can check which beam's
    attention came back.
    """

    def __init__(self, table: dict[tuple[int, ...], list[float]], default: list[float], n_regions: int = 4):
        super().__init__()
        self.table, self.default, self.n_regions = table, default, n_regions
        self.vocab_size = len(default)
        self.calls = 0

    def init_state(self, features: torch.Tensor) -> State:
        return State({}, {"prefix": torch.zeros(features.size(0), 0, dtype=torch.long), "t": 0})

    def step(self, prev_tokens, state):
        self.calls += 1
        prefix, t = state.dynamic["prefix"], state.dynamic["t"]  # (B, t) words so far
        if t:
            prefix = torch.cat([prefix, prev_tokens.view(-1, 1)], 1)
        rows = [self.table.get(tuple(p), self.default) for p in prefix.tolist()]
        log_probs = torch.tensor(rows, dtype=torch.float32).log()  # (B, V)
        peak = nn.functional.one_hot(prev_tokens % self.n_regions, self.n_regions).float()  # (B, N)
        return log_probs, State(state.static, {"prefix": prefix, "t": t + 1}), torch.softmax(5.0 * peak, -1)


def probs(**kw: float) -> list[float]:
    """A 6-way distribution: named entries (pad, bos, eos, a, b, c), the rest share what is left."""
    names = ["pad", "bos", "eos", "a", "b", "c"]
    rest = (1.0 - sum(kw.values())) / (6 - len(kw))
    return [kw.get(n, rest) for n in names]


# greedy takes "a" (0.5) then <eos> (0.3): p = 0.15; the best caption is "b" <eos>: 0.4 * 0.9 = 0.36
GREEDY_TRAP = {(): probs(a=0.5, b=0.4, eos=0.04), (A,): probs(eos=0.3, a=0.2, b=0.2, c=0.2), (B_,): probs(eos=0.9)}
DEFAULT = probs(eos=0.5)


class TinyGRUDecoder(CaptionDecoder):
    """A small random attention GRU decoder with nested state, for batched vs one-by-one checks."""

    def __init__(self, vocab_size: int = 30, dim: int = 8, hidden: int = 16, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, hidden)
        self.cell = nn.GRUCell(2 * hidden, hidden)
        self.key = nn.Linear(dim, hidden)
        self.out = nn.Linear(2 * hidden, vocab_size)

    def init_state(self, features):
        keys = self.key(features)  # (B, N, H)
        return State({"mem": {"keys": keys, "pair": (keys.tanh(), 3)}}, {"h": keys.mean(1)})

    def step(self, prev_tokens, state):
        mem, h = state.static["mem"], state.dynamic["h"]
        attn = torch.softmax((mem["keys"] * h.unsqueeze(1)).sum(-1), -1)  # (B, N)
        ctx = (attn.unsqueeze(-1) * mem["pair"][0]).sum(1)  # (B, H)
        h = self.cell(torch.cat([self.embed(prev_tokens), ctx], -1), h)  # (B, H)
        log_probs = torch.log_softmax(self.out(torch.cat([h, ctx], -1)) * 3.0, -1)  # (B, V)
        return log_probs, State(state.static, {"h": h}), attn


class InPlaceCacheDecoder(TinyGRUDecoder):
    """Keeps past hidden states in a preallocated buffer written in place (same tensor object)."""

    def init_state(self, features):
        state = super().init_state(features)
        past = features.new_zeros(features.size(0), 32, self.cell.hidden_size)  # (B, T, H)
        t = torch.zeros(features.size(0), dtype=torch.long)
        return State(state.static, {**state.dynamic, "past": past, "t": t})

    def step(self, prev_tokens, state):
        past, t = state.dynamic["past"], int(state.dynamic["t"][0])
        h = state.dynamic["h"] + 0.5 * past.mean(1)
        log_probs, new, attn = super().step(prev_tokens, State(state.static, {**state.dynamic, "h": h}))
        past[:, t] = new.dynamic["h"]  # in place: identity unchanged, version counter bumped
        return log_probs, State(new.static, {**new.dynamic, "past": past, "t": state.dynamic["t"] + 1}), attn


def all_dynamic(cls):
    """The same decoder declaring no per-image constants: search then copies every entry at every step."""

    class AllDynamic(cls):
        def init_state(self, features):
            state = super().init_state(features)
            return State({}, {"static": state.static, "dynamic": state.dynamic})

        def step(self, prev_tokens, state):
            inner = State(state.dynamic["static"], state.dynamic["dynamic"])
            log_probs, new, attn = super().step(prev_tokens, inner)
            return log_probs, State({}, {"static": new.static, "dynamic": new.dynamic}), attn

    return AllDynamic


class StaticWatcher(TinyGRUDecoder):
    """Records, at every step, the batch size and the identity of the per-image constants it got."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: list[tuple[int, torch.Tensor]] = []  # kept alive, so no two share an id()

    def step(self, prev_tokens, state):
        self.seen.append((prev_tokens.numel(), state.static["mem"]["keys"]))
        return super().step(prev_tokens, state)


def hand_greedy(decoder, features, max_len):
    """Reference greedy: one image, one step at a time, plain Python bookkeeping."""
    state = decoder.init_state(features)
    prev, words, total = torch.tensor([BOS]), [], 0.0
    for _ in range(max_len):
        lp, state, _ = decoder.step(prev, state)
        tok = int(lp[0].argmax())
        total += float(lp[0, tok])
        if tok == EOS:
            return words, total
        words.append(tok)
        prev = torch.tensor([tok])
    return words, total + float(decoder.step(prev, state)[0][0, EOS])


def test_options_validated():
    with pytest.raises(ConfigError, match="beam_size"):
        DecodeOptions(beam_size=0)
    with pytest.raises(ConfigError, match="n_best"):
        DecodeOptions(beam_size=2, n_best=3)
    with pytest.raises(ConfigError, match="length_penalty"):
        DecodeOptions(length_penalty=-1.0)
    with pytest.raises(ConfigError, match="max_len"):
        DecodeOptions(max_len=2.5)
    with pytest.raises(Exception):
        DecodeOptions().beam_size = 2  # frozen


def test_greedy_falls_into_trap_and_beam_finds_best():
    dec = TableDecoder(GREEDY_TRAP, DEFAULT).eval()
    feats = torch.zeros(1, 4, 2)
    greedy = decode(dec, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=1))[0][0]
    assert greedy.tokens == [A]
    assert greedy.score == pytest.approx(math.log(0.5 * 0.3), abs=1e-6)
    for k in (2, 3):
        best = decode(dec, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=k, n_best=2))[0]
        assert best[0].tokens == [B_]
        assert best[0].score == pytest.approx(math.log(0.4 * 0.9), abs=1e-6)
        assert best[0].finished
        assert best[1].tokens == [A] and best[1].score == pytest.approx(math.log(0.15), abs=1e-6)


def test_length_penalty_changes_choice():
    # raw: "" <eos> = log 0.5 beats "a" <eos> = log(0.45 * 0.98); GNMT alpha=1.5 prefers the longer:
    # log(0.441) / (7/6)**1.5 = -0.650 > log(0.5) / 1 = -0.693
    table = {(): probs(eos=0.5, a=0.45), (A,): probs(eos=0.98)}
    dec = TableDecoder(table, probs(eos=0.9)).eval()
    feats = torch.zeros(1, 4, 2)
    raw = decode(dec, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=2))[0][0]
    assert raw.tokens == [] and raw.score == pytest.approx(math.log(0.5), abs=1e-6)
    pen = decode(dec, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=2, length_penalty=1.5))[0][0]
    assert pen.tokens == [A]
    assert pen.log_prob == pytest.approx(math.log(0.441), abs=1e-6)
    assert pen.score == pytest.approx(math.log(0.441) / (7 / 6) ** 1.5, abs=1e-6)
    assert length_penalty(1, 3.0) == 1.0 and length_penalty(4, 0.0) == 1.0


def test_max_len_respected_and_no_eos_still_returns_hypotheses():
    never_eos = probs(eos=0.0, a=0.7, b=0.2)
    dec = TableDecoder({}, never_eos).eval()
    feats = torch.zeros(2, 4, 2)
    for k in (1, 3):
        out = decode(dec, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=k, max_len=5, n_best=k))
        for hyps in out:
            assert len(hyps) == k
            assert all(len(h.tokens) == 5 and not h.finished for h in hyps)
            assert hyps[0].tokens == [A] * 5
            assert hyps[0].score == pytest.approx(5 * math.log(0.7), abs=1e-5)
            assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    # a caption of exactly max_len words can still end with <eos> (asked once more, <eos> only)
    table = {(): probs(a=0.9, eos=0.01), (A,): probs(a=0.9, eos=0.01), (A, A): probs(a=0.9, eos=0.01),
             (A, A, A): probs(eos=0.8)}
    dec = TableDecoder(table, DEFAULT).eval()
    for k in (1, 2):
        h = decode(dec, torch.zeros(1, 4, 2), SearchRules(BOS, EOS), DecodeOptions(beam_size=k, max_len=3))[0][0]
        assert h.tokens == [A] * 3 and h.finished
        assert h.log_prob == pytest.approx(3 * math.log(0.9) + math.log(0.8), abs=1e-5)


def test_attention_row_per_word_from_chosen_beam():
    table = {(): probs(b=0.6, a=0.3), (B_,): probs(c=0.8), (B_, C): probs(a=0.7), (B_, C, A): probs(eos=0.9)}
    dec = TableDecoder(table, DEFAULT, n_regions=6).eval()
    for k in (1, 3):
        h = decode(dec, torch.zeros(1, 6, 2), SearchRules(BOS, EOS), DecodeOptions(beam_size=k))[0][0]
        assert h.tokens == [B_, C, A]
        assert h.attention.shape == (3, 6)
        torch.testing.assert_close(h.attention.sum(-1), torch.ones(3))
        # row i comes from the step that emitted word i, whose input was the previous word
        assert h.attention.argmax(-1).tolist() == [BOS % 6, B_ % 6, C % 6]


@pytest.mark.parametrize("cls", [TinyGRUDecoder, InPlaceCacheDecoder])
def test_declaring_per_image_constants_changes_nothing(cls):
    feats = torch.randn(5, 5, 8, generator=torch.Generator().manual_seed(8))
    opts = DecodeOptions(beam_size=3, max_len=12, n_best=3)
    fast = decode(cls(seed=3).eval(), feats, SearchRules(BOS, EOS), opts)
    with torch.inference_mode():  # callers may decode inside inference mode (inference tensors)
        inside = decode(cls(seed=3).eval(), feats.clone(), SearchRules(BOS, EOS), opts)
    full = decode(all_dynamic(cls)(seed=3).eval(), feats, SearchRules(BOS, EOS), opts)
    for a, b, c in zip(fast, full, inside):
        assert [h.tokens for h in a] == [h.tokens for h in b] == [h.tokens for h in c]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


def test_beam_search_copies_per_image_constants_only_when_rows_change_image():
    dec = StaticWatcher(seed=3).eval()
    feats = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(0))
    decode(dec, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=3, max_len=12))
    sizes = [n for n, _ in dec.seen]
    assert sizes[:3] == [4, 12, 9] and sizes[-1] == 6  # one row per image, 3 beams each, images finishing
    for (n_prev, keys_prev), (n, keys) in zip(dec.seen, dec.seen[1:]):
        assert (keys is keys_prev) == (n == n_prev)  # copied exactly when rows change image
    assert len({id(keys) for _, keys in dec.seen}) == len(set(sizes)) < len(sizes)


def test_state_select_and_reorder():
    static = {"keys": torch.tensor([[1.0], [2.0]]), "pair": (torch.tensor([5, 6]), 3)}
    state = State(static, {"h": torch.tensor([10, 20]), "t": 7})
    picked = state.select(torch.tensor([1, 1, 0]))
    assert picked.static["keys"].tolist() == [[2.0], [2.0], [1.0]] and picked.static["pair"][1] == 3
    assert picked.static["pair"][0].tolist() == [6, 6, 5]
    assert picked.dynamic["h"].tolist() == [20, 20, 10] and picked.dynamic["t"] == 7
    moved = picked.reorder(torch.tensor([1, 0, 2]))  # beams swap within image 1
    assert moved.static is picked.static and moved.dynamic["h"].tolist() == [20, 20, 10]
    assert picked.reorder(torch.tensor([2, 0, 1])).dynamic["h"].tolist() == [10, 20, 20]


def test_state_regroup_reads_one_static_row_per_image():
    static = {"keys": torch.tensor([[1.0], [2.0], [3.0]])}
    state = State(static, {"h": torch.tensor([10, 20, 30])})
    grouped = state.regroup(None, torch.tensor([0, 0, 1, 1, 2, 2]), 2)  # every image kept: nothing copied
    assert grouped.static is static and grouped.group == 2
    assert grouped.dynamic["h"].tolist() == [10, 10, 20, 20, 30, 30]
    fewer = grouped.regroup(torch.tensor([0, 2]), torch.tensor([1, 0, 5, 4]), 2)  # image 1 left
    assert fewer.static["keys"].tolist() == [[1.0], [3.0]] and fewer.dynamic["h"].tolist() == [10, 10, 30, 30]
    assert fewer.reorder(torch.tensor([1, 0, 3, 2])).group == 2
    with pytest.raises(ValueError, match="regroup"):
        fewer.select(torch.tensor([0]))
    expanded = expand_groups({"keys": fewer.static["keys"], "pair": (torch.tensor([7, 8]), 4)}, 2)
    assert expanded["keys"].tolist() == [[1.0], [1.0], [3.0], [3.0]]
    assert expanded["pair"][0].tolist() == [7, 7, 8, 8] and expanded["pair"][1] == 4
    assert expand_groups(fewer.static, 1) is fewer.static


def _sat_concepts_tiny():
    from captioner.models.lstm import SATDecoder
    torch.manual_seed(0)
    return SATDecoder(vocab_size=20, feature_dim=8, embed_dim=8, hidden_dim=10, attention_dim=7, dropout=0.0,
                      extension=SATConcepts(8, 10, 3, 8, True, concept_hidden=6)).eval()


@pytest.mark.parametrize("which", ["sat_soft_tiny", "sat_hard_tiny", "sat_hard_argmax", "sat_concepts", "ensemble"])
def test_grouped_state_search_equals_a_copy_per_beam(which):
    """The SAT decoder reads one copy of an image's regions for all its beams (State.group): the same
    captions, scores and attention as when beam search gives every beam its own copy."""
    from captioner.models.ensemble import EnsembleDecoder

    if which == "sat_concepts":
        decoder, feats = _sat_concepts_tiny(), torch.randn(5, 16, 8, generator=torch.Generator().manual_seed(4))
    else:
        model = _real_model("sat_hard_tiny" if which == "sat_hard_argmax" else
                            "sat_soft_tiny" if which == "ensemble" else which)
        decoder = model.decoder
        if which == "sat_hard_argmax":
            decoder.hard_test_mode = "argmax"
        images = torch.randn(5, 3, 64, 64, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            feats, _ = model.encode(images)
        if which == "ensemble":
            other = _real_model("sat_soft_tiny")
            for p in other.decoder.parameters():
                p.data.mul_(0.9)
            d = feats.shape[-1]
            decoder = EnsembleDecoder([decoder, other.decoder], [(0, d), (d, 2 * d)], ["a", "b"]).eval()
            feats = torch.cat([feats, feats.flip(0)], dim=-1)
    assert decoder.groups_rows
    opts = DecodeOptions(beam_size=3, max_len=8, n_best=2)
    grouped = decode(decoder, feats, SearchRules(BOS, EOS), opts)
    for member in getattr(decoder, "members", [decoder]):
        member.groups_rows = False  # the instance attribute hides the class's: a copy per beam
    assert not decoder.groups_rows
    copied = decode(decoder, feats, SearchRules(BOS, EOS), opts)
    for a, b in zip(grouped, copied):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)
        for ha, hb in zip(a, b):
            torch.testing.assert_close(ha.attention, hb.attention, atol=1e-6, rtol=1e-5)


def test_a_decoder_without_state_is_refused():
    class DictDecoder(TinyGRUDecoder):
        def init_state(self, features):
            return {"h": features.mean(1)}

    with pytest.raises(TypeError, match="DictDecoder.init_state returned a dict, not a captioner.models.base.State"):
        decode(DictDecoder().eval(), torch.zeros(1, 5, 8), SearchRules(BOS, EOS), DecodeOptions(beam_size=2))


def test_beam_one_is_greedy_the_hand_loop():
    """Greedy decoding is the one search at beam 1: the argmax at every step, as a hand loop takes it."""
    dec = TinyGRUDecoder().eval()
    feats = torch.randn(5, 6, 8, generator=torch.Generator().manual_seed(1))
    opts = DecodeOptions(beam_size=1, max_len=12)
    with torch.no_grad():
        beam1 = search(dec, feats, opts, SearchRules(BOS, EOS))
        for b in range(5):
            words, total = hand_greedy(dec, feats[b:b + 1], 12)
            assert beam1[b][0].tokens == words
            assert beam1[b][0].score == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("k,alpha", [(3, 0.0), (4, 0.7)])
def test_batched_equals_one_by_one(k, alpha):
    dec = TinyGRUDecoder(seed=2).eval()
    feats = torch.randn(6, 5, 8, generator=torch.Generator().manual_seed(3))
    opts = DecodeOptions(beam_size=k, max_len=10, length_penalty=alpha, n_best=k)
    batched = decode(dec, feats, SearchRules(BOS, EOS), opts)
    assert len(batched) == 6
    for b in range(6):
        single = decode(dec, feats[b:b + 1], SearchRules(BOS, EOS), opts)[0]
        assert [h.tokens for h in batched[b]] == [h.tokens for h in single]
        for hb, hs in zip(batched[b], single):
            assert hb.score == pytest.approx(hs.score, abs=1e-4)
            torch.testing.assert_close(hb.attention, hs.attention, atol=1e-5, rtol=1e-4)
        scores = [h.score for h in batched[b]]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.tokens) for h in batched[b]}) == k  # distinct beams


def _exhaustive(decoder, features, max_len, eos_id=EOS):
    """Every caption of up to max_len words with its log-prob (finished with <eos>), by brute force."""
    out = []

    def walk(prev, state, words, total):
        lp, state, _ = decoder.step(torch.tensor([prev]), state)
        out.append((total + float(lp[0, eos_id]), words))
        if len(words) < max_len:
            for tok in range(lp.size(1)):
                if tok != eos_id:
                    walk(tok, state, words + [tok], total + float(lp[0, tok]))

    walk(BOS, decoder.init_state(features), [], 0.0)
    return sorted(out, key=lambda x: -x[0])


def test_wide_beam_equals_exhaustive_search():
    dec = TinyGRUDecoder(vocab_size=6, seed=6).eval()
    feats = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(7))
    # 5 non-<eos> words: 125 beams keep every prefix of 3 words, so the search is exhaustive
    out = decode(dec, feats, SearchRules(BOS, EOS), DecodeOptions(beam_size=125, max_len=3, n_best=5))
    with torch.no_grad():
        for b in range(2):
            truth = _exhaustive(dec, feats[b:b + 1], 3)[:5]
            assert [h.tokens for h in out[b]] == [w for _, w in truth]
            assert [h.score for h in out[b]] == pytest.approx([s for s, _ in truth], abs=1e-4)


def test_search_stops_once_finished_beat_live_beams():
    table = TableDecoder(GREEDY_TRAP, DEFAULT).eval()
    decode(table, torch.zeros(1, 4, 2), SearchRules(BOS, EOS), DecodeOptions(beam_size=2, max_len=50))
    assert table.calls == 2  # both beams end at step 2 and beat every live beam: no 50-step search


def test_banned_ids_are_never_emitted():
    table = {(): probs(bos=0.4, pad=0.3, a=0.2, eos=0.05), (A,): probs(pad=0.6, eos=0.3)}
    dec = TableDecoder(table, DEFAULT).eval()
    feats = torch.zeros(1, 4, 2)
    assert decode(dec, feats, SearchRules(BOS, EOS), DecodeOptions())[0][0].tokens[0] == BOS  # unbanned: the model's argmax
    for k in (1, 3):
        h = decode(dec, feats, SearchRules(BOS, EOS, (0, BOS)), DecodeOptions(beam_size=k))[0][0]
        assert h.tokens == [A]
        assert h.log_prob == pytest.approx(math.log(0.2 * 0.3), abs=1e-6)  # not renormalised


class _FakeModel(nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder


@pytest.mark.parametrize("beam", [1, 3])
def test_unk_is_never_emitted_unless_allowed(beam):
    """The table's "a" is id 3, which a Vocabulary calls <unk>: the model's first choice everywhere."""
    vocab = Vocabulary(["x", "y", "z"])  # ids 4, 5, 6; 3 is <unk>
    assert A == vocab.unk_id
    table = {(): probs(a=0.6, b=0.3), (A,): probs(a=0.5, eos=0.4), (B_,): probs(a=0.6, eos=0.3),
             (B_, A): probs(eos=0.9)}
    model = _FakeModel(TableDecoder(table, DEFAULT))
    res = caption_features(model, torch.zeros(1, 4, 2), vocab, DecodeOptions(beam_size=beam))[0]
    assert vocab.unk_id not in res.tokens and res.words == ["x"] and res.text == "x"
    allowed = caption_features(model, torch.zeros(1, 4, 2), vocab, DecodeOptions(beam_size=beam, allow_unk=True))[0]
    assert allowed.words[0] == "<unk>" and allowed.tokens[0] == vocab.unk_id
    assert never_emitted_ids(vocab) == (vocab.pad_id, vocab.bos_id, vocab.unk_id)
    assert never_emitted_ids(vocab, DecodeOptions(allow_unk=True)) == (vocab.pad_id, vocab.bos_id)
    with pytest.raises(ConfigError, match="allow_unk"):
        DecodeOptions(allow_unk="yes")


def test_caption_features_restores_mode_and_shapes_attention():
    vocab = Vocabulary(["a", "b", "c"])  # ids 4, 5, 6: the table's ids 4 and 5 read "a", "b"
    table = {(): probs(b=0.6, a=0.3), (B_,): probs(c=0.8), (B_, C): probs(eos=0.9)}
    model = _FakeModel(TableDecoder(table, DEFAULT, n_regions=4)).train()
    res = caption_features(model, torch.zeros(2, 4, 3), vocab, DecodeOptions(beam_size=2))
    assert model.training and model.decoder.training
    assert len(res) == 2
    r = res[0]
    assert r.tokens == [B_, C] and r.words == ["a", "b"] and r.text == "a b"
    bos_first = TableDecoder({(): probs(bos=0.7, b=0.2), (B_,): probs(eos=0.9)}, DEFAULT)
    assert caption_features(_FakeModel(bos_first), torch.zeros(1, 4, 3), vocab)[0].words == ["a"]
    assert r.grid == (2, 2) and r.attention.shape == (2, 2, 2)
    torch.testing.assert_close(r.attention.sum((1, 2)), torch.ones(2))
    with pytest.raises(ConfigError, match="square grid"):
        caption_features(model, torch.zeros(1, 3, 3), vocab)


# ----------------------------------------------------------------------------- real tiny decoders

REAL = ["sat_soft_tiny", "sat_hard_tiny", "transformer_tiny"]


def _real_model(preset: str, vocab_size: int = 20):
    torch.manual_seed(0)
    return build_model(get_preset(preset).model, vocab_size=vocab_size).eval()


@pytest.mark.parametrize("preset", REAL)
def test_real_decoders_batched_equals_one_by_one_and_scores_match_forward(preset):
    model = _real_model(preset)
    images = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        feats, grid = model.encode(images)  # (3, 16, D)
    opts = DecodeOptions(beam_size=3, max_len=6, n_best=3)
    with torch.inference_mode():  # as in training-time validation
        batched = decode(model.decoder, feats.clone(), SearchRules(BOS, EOS), opts)
    greedy = decode(model.decoder, feats, SearchRules(BOS, EOS), DecodeOptions(max_len=6))
    for b in range(3):
        single = decode(model.decoder, feats[b:b + 1], SearchRules(BOS, EOS), opts)[0]
        assert [h.tokens for h in batched[b]] == [h.tokens for h in single]
        assert [h.score for h in batched[b]] == pytest.approx([h.score for h in single], abs=1e-4)
        for h in batched[b] + greedy[b]:
            assert h.attention.shape == (len(h.tokens), grid[0] * grid[1])
            torch.testing.assert_close(h.attention.sum(-1), torch.ones(len(h.tokens)), atol=1e-4, rtol=0)
            # the search's score equals teacher forcing the same caption through forward()
            ids = [BOS] + h.tokens + ([EOS] if h.finished else [])
            inp = torch.tensor([ids[:-1]])
            with torch.no_grad():
                out = model.decoder(feats[b:b + 1], inp)
            lp = torch.log_softmax(out.logits[0].double(), -1)  # (T, V)
            total = lp.gather(1, torch.tensor(ids[1:]).view(-1, 1)).sum().item()
            assert h.log_prob == pytest.approx(total, abs=1e-3)


def test_eval_mode_restores_the_mode_it_found_even_after_an_error():
    from captioner.models.base import eval_mode

    module = torch.nn.Sequential(torch.nn.Dropout(0.5))
    for start in (True, False):
        module.train(start)
        with eval_mode(module) as inside:
            assert inside is module and not module.training and not module[0].training
        assert module.training is start and module[0].training is start
    module.train()
    with pytest.raises(RuntimeError):
        with eval_mode(module):
            raise RuntimeError("boom")
    assert module.training
