"""Known outputs of greedy, beam search and sampling on small seeded decoders (SAT soft, SAT hard,
Transformer), stored in ``tests/fixtures/decoding_golden.pt`` (weights, features and results).

The fixture pins what decoding returns (tokens, scores, attention, sampled words) so that a change
to the search or to the decoder-state plumbing cannot change a caption unnoticed. Regenerate it only
on purpose, from code whose outputs are known to be right::

    PYTHONPATH=. python tests/test_decoding_golden.py   # rewrites the fixture
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from captioner.decoding.search import SearchRules, DecodeOptions, decode, sample_captions
from captioner.models.base import CaptionDecoder
from captioner.models.lstm import SATDecoder
from captioner.models.transformer import TransformerCaptionDecoder

FIXTURE = Path(__file__).parent / "fixtures" / "decoding_golden.pt"
V, D, G = 17, 12, 3  # vocabulary, feature width, grid (N = 9 regions)
PAD, BOS, EOS, UNK = 0, 1, 2, 3
BANNED = (PAD, BOS, UNK)
TOL = 1e-6

SEARCHES = {  # name -> (DecodeOptions, banned ids)
    "greedy": (DecodeOptions(beam_size=1, max_len=8), BANNED),
    "beam1_lp": (DecodeOptions(beam_size=1, max_len=8, length_penalty=0.7), BANNED),
    "beam3": (DecodeOptions(beam_size=3, max_len=8, n_best=3), BANNED),
    "beam3_lp_unbanned": (DecodeOptions(beam_size=3, max_len=6, length_penalty=1.0, n_best=2), ()),
    "beam5_lp": (DecodeOptions(beam_size=5, max_len=8, length_penalty=0.7, n_best=5), BANNED),
}


def _decoders() -> dict[str, CaptionDecoder]:
    """The three decoders, freshly built (weights come from the fixture)."""
    sat = dict(vocab_size=V, feature_dim=D, embed_dim=16, hidden_dim=16, attention_dim=12, dropout=0.2, grid=G)
    return {
        "sat_soft": SATDecoder(**sat, attention="soft", region_positions=True),
        "sat_hard": SATDecoder(**sat, attention="hard", hard_soft_prob=0.3),
        "transformer": TransformerCaptionDecoder(vocab_size=V, feature_dim=D, grid=G, d_model=16, num_layers=2,
                                                 num_heads=4, ff_dim=32, dropout=0.2, max_len=8),
    }


def _search_record(hyps: list[list]) -> dict:
    """Per image, per hypothesis: tokens, score, log_prob, finished; attention of all of them stacked."""
    record = {field: [[getattr(h, field) for h in per_image] for per_image in hyps]
              for field in ("tokens", "score", "log_prob", "finished")}
    record["attention"] = torch.cat([h.attention for per_image in hyps for h in per_image])  # (sum L, N)
    return record


def _sample_record(decoder: CaptionDecoder, features: torch.Tensor, train: bool, seed: int) -> dict:
    decoder.train(train)
    torch.manual_seed(seed)
    out = sample_captions(decoder, features, BOS, EOS, PAD, samples=3, max_len=7, temperature=0.8,
                          banned_ids=BANNED)
    decoder.eval()
    return {"tokens": out.tokens, "lengths": out.lengths, "finished": out.finished}


def _output_layer(decoder: CaptionDecoder) -> torch.nn.Linear:
    return decoder.out_word if isinstance(decoder, SATDecoder) else decoder.out


def _run_all(decoders: dict[str, CaptionDecoder], features: torch.Tensor) -> dict:
    """Every case's outputs, keyed ``decoder/case``."""
    results = {}
    for name, decoder in decoders.items():
        decoder.eval()
        modes = ["expectation", "argmax"] if name == "sat_hard" else [None]
        for mode in modes:
            if mode is not None:
                decoder.hard_test_mode = mode
            for case, (options, banned) in SEARCHES.items():
                key = f"{name}/{case}" + (f"/{mode}" if mode else "")
                results[key] = _search_record(decode(decoder, features, SearchRules(BOS, EOS, banned), options))
        bias = _output_layer(decoder).bias
        saved = bias.detach().clone()
        with torch.no_grad():
            bias[EOS] = float("-inf")  # <eos> impossible: every caption is cut at max_len, unfinished
        for case in ("greedy", "beam3"):
            results[f"{name}/{case}/no_eos"] = _search_record(decode(decoder, features, SearchRules(BOS, EOS, SEARCHES[case][1]),
                                                                              SEARCHES[case][0]))
        with torch.no_grad():
            bias.copy_(saved)
        results[f"{name}/sample_eval"] = _sample_record(decoder, features, train=False, seed=11)
        results[f"{name}/sample_train"] = _sample_record(decoder, features, train=True, seed=12)
    return results


def _generate() -> None:
    torch.set_num_threads(1)
    decoders = {}
    for i, name in enumerate(["sat_soft", "sat_hard", "transformer"]):
        torch.manual_seed(100 + i)
        decoders[name] = _decoders()[name]  # built under this seed
    features = torch.randn(4, G * G, D, generator=torch.Generator().manual_seed(5))
    features[3] = features[1]  # two identical images: their beams must not mix
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": {n: d.state_dict() for n, d in decoders.items()}, "features": features,
                "results": _run_all(decoders, features)}, FIXTURE)
    print(f"wrote {FIXTURE}")


@pytest.fixture(scope="module")
def golden() -> dict:
    return torch.load(FIXTURE, weights_only=True)


@pytest.fixture(scope="module")
def actual(golden: dict) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decoders = _decoders()
        for name, decoder in decoders.items():
            decoder.load_state_dict(golden["weights"][name])
        return _run_all(decoders, golden["features"])
    finally:
        torch.set_num_threads(threads)


def test_fixture_covers_every_case(golden: dict, actual: dict) -> None:
    assert sorted(actual) == sorted(golden["results"])
    assert len(actual) == 3 * 2 + 3 * 2 + 4 * len(SEARCHES)
    # the fixture exercises finished and unfinished captions of several lengths
    searches = [res for key, res in golden["results"].items() if "sample" not in key]
    assert {f for res in searches for img in res["finished"] for f in img} == {True, False}
    assert len({len(t) for res in searches for img in res["tokens"] for t in img}) >= 4


@pytest.mark.parametrize("name", ["sat_soft", "sat_hard", "transformer"])
def test_search_outputs_match_fixture(name: str, golden: dict, actual: dict) -> None:
    keys = [k for k in golden["results"] if k.startswith(name + "/") and "sample" not in k]
    assert keys
    for key in keys:
        want, got = golden["results"][key], actual[key]
        assert got["tokens"] == want["tokens"], key
        assert got["finished"] == want["finished"], key
        for field in ("score", "log_prob"):
            for w, g in zip(want[field], got[field]):
                assert g == pytest.approx(w, abs=TOL), (key, field)
        torch.testing.assert_close(got["attention"], want["attention"], rtol=0, atol=TOL, msg=key)


@pytest.mark.parametrize("name", ["sat_soft", "sat_hard", "transformer"])
@pytest.mark.parametrize("mode", ["sample_eval", "sample_train"])
def test_sampling_matches_fixture(name: str, mode: str, golden: dict, actual: dict) -> None:
    want, got = golden["results"][f"{name}/{mode}"], actual[f"{name}/{mode}"]
    for field in ("tokens", "lengths", "finished"):
        assert torch.equal(got[field], want[field]), field


if __name__ == "__main__":
    _generate()
