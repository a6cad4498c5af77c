"""Self-critical sequence training (issue 15): reward, sampling, advantage, the second training stage.

Runs use the tiny presets on the 60-image ``tiny_shapes`` set (48 training images x 5 captions,
batch 16 -> 15 steps per epoch), validation greedy on 4 images.
"""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from captioner.config import Config, get_preset
from captioner.errors import ConfigError
from captioner.evaluation.metrics import cider_d_scores, document_frequencies
from captioner.text import tokenize
from captioner.training.loop import train
from captioner.training.scst import CaptionReward

PRESETS = ("sat_soft_tiny", "sat_hard_tiny", "transformer_tiny")
STEPS_PER_EPOCH = 15


def tiny_cfg(preset: str, root: Path, **overrides) -> Config:
    base = {"data.root": str(root), "train.batch_size": 16, "train.val_max_images": 4, "train.log_every": 1,
            "train.epochs": 1, "train.val_beam": 1}
    return get_preset(preset, **{**base, **overrides})


def step_rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["kind"] == "step"]


@pytest.fixture(scope="module")
def stage1(tiny_shapes: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One cross-entropy epoch per decoder (lr high enough to emit words): the SCST stages' --init."""
    runs = {}
    for preset in ("sat_soft_tiny", "sat_hard_tiny"):
        out = tmp_path_factory.mktemp(f"xe_{preset}")
        runs[preset] = train(tiny_cfg(preset, tiny_shapes, **{"train.lr": 1e-2}), out, progress=False).best_checkpoint
    return runs


# ----------------------------------------------------------------------------- reward


def test_metrics_cider_d_unchanged_by_the_doc_freq_refactor() -> None:
    hyps = ["a red circle", "a blue square on the left", "two shapes", "", "a a a"]
    refs = [["a red circle", "red circle left"], ["blue square", "a blue square on the left side"],
            ["two shapes here", "shapes"], ["x"], ["a b c a"]]
    before = [5.5064199846539355, 5.529466679443252, 2.7499277733951386, 0.0, 0.6730889748831435]  # pre-refactor
    # to 1e-12, not bit for bit: numpy 2.5 / Python 3.12 (the GPU image) differ in the last ulp
    assert cider_d_scores(hyps, refs) == pytest.approx(before, rel=1e-12, abs=1e-15)
    assert cider_d_scores(hyps, refs, doc_freq=document_frequencies(refs)) == pytest.approx(before, rel=1e-12, abs=1e-15)


def test_reward_equals_metrics_cider_d_with_the_training_doc_freqs(tiny_shapes: Path) -> None:
    from captioner.data.coco import load_caption_set

    train_set = load_caption_set(tiny_shapes, "train")
    references = [train_set.references(im.image_id) for im in train_set.images]
    reward = CaptionReward(references)
    assert reward.doc_freq.images == len(train_set)  # counted once, over the whole training corpus
    rng = random.Random(0)
    words = sorted({w for refs in references for r in refs for w in tokenize(r)})
    images = [rng.randrange(len(references)) for _ in range(40)] + [3, 3, 3]  # repeated images share refs
    hyps = [references[i][rng.randrange(len(references[i]))] if k % 3 == 0 else
            " ".join(rng.choice(words) for _ in range(rng.randrange(0, 9))) for k, i in enumerate(images)]
    batched = reward([tokenize(h) for h in hyps], images)
    expected = cider_d_scores(hyps, [references[i] for i in images], doc_freq=reward.doc_freq)
    assert max(abs(a - b) for a, b in zip(batched, expected)) < 1e-9
    assert max(batched) > 1.0 and min(batched) == 0.0  # real spread, not all zeros
    # corpus DFs differ from per-batch DFs (metrics' default), so the reward is not the eval score
    assert cider_d_scores(hyps, [references[i] for i in images]) != pytest.approx(batched)


def test_reward_bleu_mix() -> None:
    refs = [["a red circle above a blue square"], ["a green triangle"]]
    caps, images = [["a", "red", "circle", "above", "a", "blue", "square"], ["a", "square"]], [0, 1]
    cider = CaptionReward(refs)(caps, images)
    bleu = CaptionReward(refs, bleu_weight=1.0)(caps, images)
    mixed = CaptionReward(refs, bleu_weight=0.25)(caps, images)
    assert bleu[0] == pytest.approx(1.0) and 0.0 <= bleu[1] < 0.5
    assert mixed == pytest.approx([0.75 * c + 0.25 * b for c, b in zip(cider, bleu)], abs=1e-12)


# ----------------------------------------------------------------------------- sampling and the loss


def _model(preset: str, vocab_size: int = 30):
    from captioner.models.model import build_model

    torch.manual_seed(0)
    return build_model(get_preset(preset).model, vocab_size, load_pretrained=False)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_sampling_all_decoders_never_emits_banned_tokens(preset: str, mode: str) -> None:
    from captioner.decoding.search import sample_captions

    model = _model(preset)
    decoder = model.decoder.train(mode == "train")
    features = torch.randn(3, 16, model.encoder.out_dim)  # untrained: banned ids are likely without the ban
    banned = (0, 1, 3)  # <pad>, <bos>, <unk>
    torch.manual_seed(1)
    s = sample_captions(decoder, features, bos_id=1, eos_id=2, pad_id=0, samples=4, max_len=7, temperature=3.0,
                        banned_ids=banned)
    assert s.tokens.shape[0] == 12 and s.tokens.shape[1] <= 8
    for row, n, fin in zip(s.tokens.tolist(), s.lengths.tolist(), s.finished.tolist()):
        assert not {1, 3} & set(row) and 0 not in row[:n]  # never <bos>/<unk>; <pad> only as padding
        assert n <= 7 and (row[n] == 2 if fin else (n == 7 or row[n:] == [0] * len(row[n:])))
        assert all(t == 0 for t in row[n + 1:])  # everything after the first <eos> is padding
    assert len({tuple(r) for r in s.tokens.tolist()}) > 3  # samples differ
    torch.manual_seed(1)
    again = sample_captions(decoder.eval() if mode == "eval" else decoder, features, 1, 2, 0, 4, 7, 3.0, banned)
    if mode == "eval":
        assert torch.equal(again.tokens, s.tokens)  # the global seed fixes the draws


class _FixedReward:
    """Reward 1 for the first sample of every image, 0 for the others."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __call__(self, captions, images):  # noqa: ANN001
        return [1.0 if k % self.samples == 0 else 0.0 for k in range(len(captions))]


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_advantage_sign_raises_the_better_sample(preset: str) -> None:
    from captioner.text import Vocabulary
    from captioner.training.scst import SelfCritical, baselines, policy_log_probs

    assert baselines(torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0, 0.0]), 3, "mean").tolist() == [0.0, 0.5, 0.5,
                                                                                            1.5, 1.5, 3.0]
    vocab = Vocabulary.build(["a red circle", "a blue square", "green triangle left"], min_freq=1)
    model = _model(preset, len(vocab)).eval()  # eval: no dropout, so sampling and re-scoring agree exactly
    decoder, K = model.decoder, 4
    loss = SelfCritical(_FixedReward(K), vocab, samples=K, baseline="mean", max_len=6)
    features = torch.randn(2, 16, model.encoder.out_dim)
    torch.manual_seed(0)
    result = loss.batch_loss(decoder, decoder, None, features, torch.tensor([0, 1]))
    assert result.captions == 2 * K and result.parts["scst_reward"] == pytest.approx(0.25)
    assert result.parts["scst_better"] == pytest.approx(0.25)  # the first sample of each image beats its baseline
    # the sampled sequences, recovered by re-sampling with the same seed
    from captioner.decoding.search import sample_captions
    torch.manual_seed(0)
    s = sample_captions(decoder, features, vocab.bos_id, vocab.eos_id, vocab.pad_id, K, 6, 1.0, loss.banned)
    inputs = torch.cat([torch.full_like(s.tokens[:, :1], vocab.bos_id), s.tokens[:, :-1]], dim=1)

    def seq_lp() -> torch.Tensor:
        with torch.no_grad():
            logits = decoder(features.repeat_interleave(K, 0), inputs).logits
            lp = policy_log_probs(logits, s.tokens, s.tokens != vocab.pad_id, loss.banned, vocab.eos_id)
        return lp.sum(dim=1)  # (R,)

    before = seq_lp()
    opt = torch.optim.SGD(decoder.parameters(), lr=0.05)
    opt.zero_grad()
    result.total.backward()
    opt.step()
    change = seq_lp() - before
    assert change[0] > 0 and change[K] > 0  # better than the baseline: log-probability raised
    assert change[1:K].mean() < change[0] and change[K + 1:].mean() < change[K]


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_rescoring_gives_the_log_probs_the_sampler_drew_with(preset: str) -> None:
    """The gradient is of the policy that sampled: banned ids removed, temperature applied."""
    from captioner.decoding.search import sample_captions
    from captioner.training.scst import policy_log_probs

    model = _model(preset).eval()
    decoder, K, banned, T = model.decoder, 3, (0, 1, 3), 0.7  # <pad>, <bos>, <unk>
    features = torch.randn(2, 16, model.encoder.out_dim)
    torch.manual_seed(2)
    s = sample_captions(decoder, features, bos_id=1, eos_id=2, pad_id=0, samples=K, max_len=6, temperature=T,
                        banned_ids=banned)
    valid = s.tokens != 0
    inputs = torch.cat([torch.full_like(s.tokens[:, :1], 1), s.tokens[:, :-1]], dim=1)
    with torch.no_grad():
        logits = decoder(features.repeat_interleave(K, 0), inputs).logits  # (R, L, V)
    rescored = policy_log_probs(logits, s.tokens, valid, banned, eos_id=2, temperature=T)
    drawn = _drawn_log_probs(decoder, features, s.tokens, banned, eos_id=2, temperature=T)
    assert torch.allclose(rescored, drawn, atol=1e-5)
    assert bool((rescored[~valid] == 0).all()) and bool((rescored[valid] < 0).all())
    full = torch.log_softmax(logits, -1).gather(-1, s.tokens.unsqueeze(-1)).squeeze(-1)  # the model's own softmax
    assert (full - drawn)[valid].abs().max() > 1e-2  # which is not the sampled policy


def _drawn_log_probs(decoder, features, tokens, banned, eos_id, temperature):
    """(R, L) log-probability of each sampled id under the distribution the sampler drew it from
    (the decoder's step, banned ids at -inf except <eos>, divided by the temperature), replayed step by
    step through the decoding state; 0 at padding."""
    R, L = tokens.shape
    K = R // features.size(0)
    state = decoder.init_state(features).select(torch.arange(features.size(0)).repeat_interleave(K))
    prev = torch.full((R,), 1, dtype=torch.long)  # <bos>
    out = torch.zeros(R, L)
    ban = torch.tensor([i for i in banned if i != eos_id])
    with torch.no_grad():
        for t in range(L):
            log_probs, state, _ = decoder.step(prev, state)  # (R, V)
            probs = torch.softmax(log_probs.float().index_fill(-1, ban, float("-inf")) / temperature, dim=-1)
            drawn = probs.gather(1, tokens[:, t:t + 1]).squeeze(1).log()
            out[:, t] = torch.where(tokens[:, t] != 0, drawn, torch.zeros_like(drawn))
            prev = tokens[:, t]
    return out


@pytest.mark.parametrize("preset, head", [("sat_soft_tiny", "out_word"), ("transformer_tiny", "out")])
def test_banned_ids_get_no_gradient_from_the_scst_term(preset: str, head: str) -> None:
    """<unk> is never sampled: were it scored under the full softmax, every negative advantage would
    raise it and nothing would lower it again (on Flickr8k it took the whole distribution)."""
    from captioner.text import Vocabulary
    from captioner.training.scst import SelfCritical

    vocab = Vocabulary.build(["a red circle", "a blue square", "green triangle left"], min_freq=1)
    model = _model(preset, len(vocab)).eval()
    loss = SelfCritical(_FixedReward(4), vocab, samples=4, baseline="mean", max_len=6)
    torch.manual_seed(0)
    result = loss.batch_loss(model.decoder, model.decoder, None, torch.randn(2, 16, model.encoder.out_dim),
                             torch.tensor([0, 1]))
    result.total.backward()
    grad = getattr(model.decoder, head).bias.grad  # (V,): d loss / d logit, summed over positions
    banned = [vocab.pad_id, vocab.bos_id, vocab.unk_id]
    assert grad[banned].abs().max() == 0.0
    allowed = [i for i in range(len(vocab)) if i not in banned]
    assert grad[allowed].abs().max() > 0.0


@pytest.mark.parametrize("baseline", ["mean", "greedy"])
def test_the_greedy_reward_is_logged_with_either_baseline(baseline: str) -> None:
    from captioner.decoding.search import DecodeOptions, SearchRules, decode
    from captioner.text import Vocabulary
    from captioner.training.scst import SelfCritical

    vocab = Vocabulary.build(["a red circle", "a blue square", "green triangle left"], min_freq=1)
    model = _model("sat_soft_tiny", len(vocab)).eval()
    length = lambda captions, images: [float(len(c)) for c in captions]  # noqa: E731  reward: words
    loss = SelfCritical(length, vocab, samples=3, baseline=baseline, max_len=6)
    features = torch.randn(2, 16, model.encoder.out_dim)
    torch.manual_seed(0)
    result = loss.batch_loss(model.decoder, model.decoder, None, features, torch.tensor([0, 1]))
    greedy = decode(model.decoder, features, SearchRules(vocab.bos_id, vocab.eos_id, tuple(loss.banned)),
                    DecodeOptions(beam_size=1, max_len=6))
    words = [float(len(loss._texts([h[0].tokens])[0])) for h in greedy]
    assert result.parts["scst_greedy_reward"] == pytest.approx(sum(words) / 2)
    sampled = result.parts["scst_reward"]
    assert 0.0 <= result.parts["scst_better_than_greedy"] <= 1.0 and sampled >= 0
    if baseline == "greedy":
        assert result.parts["scst_baseline_reward"] == pytest.approx(result.parts["scst_greedy_reward"])
        assert result.parts["scst_better"] == pytest.approx(result.parts["scst_better_than_greedy"])


def test_hard_attention_gets_a_region_reinforce_term_with_the_caption_advantage() -> None:
    from captioner.text import Vocabulary
    from captioner.training.scst import SelfCritical

    vocab = Vocabulary.build(["a red circle", "a blue square"], min_freq=1)
    model = _model("sat_hard_tiny", len(vocab)).train()
    loss = SelfCritical(_FixedReward(3), vocab, samples=3, baseline="mean", max_len=5, entropy_weight=0.01)
    torch.manual_seed(0)
    result = loss.batch_loss(model.decoder, model.decoder, None, torch.randn(3, 16, model.encoder.out_dim),
                             torch.tensor([4, 4, 7]))  # rows 0 and 1 are one image: sampled once
    assert result.captions == 2 * 3
    assert {"reinforce", "entropy", "scst_reward", "scst_baseline_reward", "scst_better"} <= set(result.parts)
    assert result.parts["reinforce"] != 0.0 and math.isfinite(float(result.total.detach()))
    result.total.backward()
    assert model.decoder.attention.score.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("preset", ["sat_soft_tiny", "transformer_tiny"])
def test_mixed_objective_adds_the_references_cross_entropy(preset: str) -> None:
    import torch.nn.functional as F

    from captioner.text import Vocabulary
    from captioner.training.scst import SelfCritical

    vocab = Vocabulary.build(["a red circle", "a blue square", "green triangle left"], min_freq=1)
    model = _model(preset, len(vocab)).eval()
    decoder = model.decoder
    features = torch.randn(2, 16, model.encoder.out_dim)
    tokens = torch.tensor([vocab.encode("red circle", 10) + [vocab.pad_id],
                           vocab.encode("green triangle left", 10)])  # (2, T) references, one padded
    index = torch.tensor([0, 1])
    pure = SelfCritical(_FixedReward(3), vocab, samples=3, baseline="mean", max_len=6)
    mixed = SelfCritical(_FixedReward(3), vocab, samples=3, baseline="mean", max_len=6, xe_weight=0.5)
    torch.manual_seed(0)
    a = pure.batch_loss(decoder, decoder, None, features, index)
    torch.manual_seed(0)
    b = mixed.batch_loss(decoder, decoder, None, features, index, tokens=tokens)
    logits = decoder(features, tokens[:, :-1]).logits  # the references' cross-entropy, by hand
    ce = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=vocab.pad_id)
    assert float((b.total - a.total).detach()) == pytest.approx(0.5 * float(ce.detach()), rel=1e-5)
    assert b.parts["scst_xe"] == pytest.approx(float(ce.detach()), rel=1e-5)
    assert "scst_xe" not in a.parts
    with pytest.raises(ValueError, match="reference tokens"):
        mixed.batch_loss(decoder, decoder, None, features, index)


def test_scst_xe_weight_is_checked() -> None:
    from captioner.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.scst\.xe_weight must be a number >= 0"):
        get_preset("sat_soft_tiny", **{"train.scst.xe_weight": -1})
    with pytest.raises(ConfigError, match=r"^unknown config key: train\.scst_xe_weight$"):  # no flat spelling
        get_preset("sat_soft_tiny", **{"train.scst_xe_weight": -1})


# ----------------------------------------------------------------------------- the second training stage


def test_init_then_scst_round_trip_through_the_cli(tiny_shapes: Path, tmp_path: Path,
                                                  stage1: dict[str, Path]) -> None:
    from captioner.cli import main

    out = tmp_path / "scst"
    assert main(["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(out),
                 "--init", str(stage1["sat_soft_tiny"]), "--set", "train.objective=scst", "--set",
                 "train.batch_size=16", "--set", "train.val_max_images=4", "--set", "train.val_beam=1",
                 "--set", "train.log_every=5", "--set", "train.scst.samples=3", "--epochs", "1",
                 "--no-progress"]) == 0
    cfg = json.loads((out / "config.json").read_text())["train"]
    assert cfg["objective"] == "scst" and cfg["init"] == str(stage1["sat_soft_tiny"])
    rows = step_rows(out)
    assert len(rows) == STEPS_PER_EPOCH // 5
    for row in rows:
        reward, base, better = float(row["scst_reward"]), float(row["scst_baseline_reward"]), float(row["scst_better"])
        assert reward >= 0 and base >= 0 and 0.0 <= better <= 1.0 and float(row["loss"]) == pytest.approx(-reward)
        assert float(row["scst_greedy_reward"]) >= 0 and 0.0 <= float(row["scst_better_than_greedy"]) <= 1.0
    before, after = load_file(str(stage1["sat_soft_tiny"])), load_file(str(out / "latest.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)  # SCST trained the initialised weights
    assert (out / "best.safetensors").is_file()


@pytest.mark.slow  # three SCST training runs: about 8 s
def test_resume_mid_scst_reproduces_the_uninterrupted_run(tiny_shapes: Path, tmp_path: Path,
                                                          stage1: dict[str, Path]) -> None:
    """Hard attention: the sampled words, the greedy baseline and the sampled regions all draw random numbers."""
    scst = {"train.objective": "scst", "train.init": str(stage1["sat_hard_tiny"]), "train.epochs": 2,
            "train.scst.samples": 2, "train.lr": 1e-3}
    whole = tmp_path / "whole"
    train(tiny_cfg("sat_hard_tiny", tiny_shapes, **scst), whole, progress=False)
    part = tmp_path / "part"
    stopped = train(tiny_cfg("sat_hard_tiny", tiny_shapes, **scst, **{"train.time_budget": 1e-9}), part,
                    progress=False)
    assert stopped.history[-1]["step"] == 1 and stopped.history[-1]["partial"] == 1
    train(tiny_cfg("sat_hard_tiny", tiny_shapes, **scst), part, resume=True, progress=False)
    assert len(step_rows(part)) == 2 * STEPS_PER_EPOCH
    keys = ("step", "loss", "scst_reward", "scst_baseline_reward", "reinforce")
    assert [[r[k] for k in keys] for r in step_rows(part)] == [[r[k] for k in keys] for r in step_rows(whole)]
    wa, wb = load_file(str(whole / "latest.safetensors")), load_file(str(part / "latest.safetensors"))
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


@pytest.mark.parametrize("key,value,message", [
    ("train.objective", "rl", "train.objective='rl': use xe or scst"),
    ("train.scst.baseline", "beam", "train.scst.baseline='beam': use mean or greedy"),
    ("train.scst.samples", 0, "train.scst.samples must be an integer >= 1"),
    ("train.scst.temperature", -1, "train.scst.temperature must be a number > 0"),
    ("train.scst.bleu_weight", 2, "train.scst.bleu_weight must be in [0, 1]"),
])
def test_bad_scst_settings_are_one_line_errors(key: str, value, message: str, tiny_shapes: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from captioner.cli import main

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        get_preset("sat_soft_tiny", **{key: value})
    assert main(["train", "--preset", "sat_soft_tiny", "--data", str(tiny_shapes), "--out", str(tmp_path / "r"),
                 "--set", f"{key}={json.dumps(value)}", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("captioner train: error: ") and message in err and "\n" not in err, err


@pytest.mark.slow
def test_two_process_ddp_scst_run(tiny_shapes: Path, tmp_path: Path, stage1: dict[str, Path]) -> None:
    """torchrun, 2 CPU processes (Gloo): the per-step all-reduce carries the SCST terms; rank 0 alone logs."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    settings = {"train.objective": "scst", "train.val_max_images": 4, "train.log_every": 5, "train.epochs": 1,
                "train.batch_size": 16, "train.device": "cpu", "train.val_beam": 1}
    args = ["--preset", "sat_hard_tiny", "--data", str(tiny_shapes), "--no-progress", "--init",
            str(stage1["sat_hard_tiny"]), "--out", str(tmp_path / "ddp")]
    args += [a for key, value in settings.items() for a in ("--set", f"{key}={value}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "captioner", "train", *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = step_rows(tmp_path / "ddp")
    assert [r["step"] for r in rows] == ["5", "10", "15"]  # global batches of 16, logged once
    for row in rows:
        assert 0.0 <= float(row["scst_better"]) <= 1.0 and math.isfinite(float(row["scst_reward"]))
        assert math.isfinite(float(row["reinforce"]))
    assert (tmp_path / "ddp" / "best.safetensors").is_file()


def test_sampling_and_rescoring_see_the_same_policy_with_dropout_layers_off() -> None:
    """Dropout would give the re-scoring pass other masks than the sampling pass; ``dropout_off``
    makes a training-mode decoder compute exactly its eval-mode log-probabilities."""
    from captioner.models.lstm import SATDecoder
    from captioner.training.scst import dropout_off

    torch.manual_seed(0)
    decoder = SATDecoder(vocab_size=11, feature_dim=6, embed_dim=5, hidden_dim=7, attention_dim=4, dropout=0.5)
    features, tokens = torch.randn(3, 4, 6), torch.randint(4, 11, (3, 5))
    decoder.eval()
    reference = decoder(features, tokens).logits
    decoder.train()
    assert not torch.allclose(decoder(features, tokens).logits, reference)  # dropout on
    with dropout_off(decoder):
        assert decoder.training and torch.allclose(decoder(features, tokens).logits, reference)
    assert all(m.training for m in decoder.modules())  # restored
