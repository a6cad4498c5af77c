"""Self-critical sequence training (SCST, Rennie et al. 2017): ``train.objective = "scst"``.

K captions sampled per distinct image of a batch, rewarded by CIDEr-D (optionally mixed with
BLEU-4) against all its references, minus a baseline (the other samples' mean, or the greedy
caption's reward). Main names: ``SelfCritical``, ``CaptionReward``. docs/training.md has the steps.

Shape legend: B distinct images of a batch, K samples per image, R = B * K, L sampled steps,
V vocabulary, N regions, D feature width.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from captioner.config import ScstConfig, TrainConfig
from captioner.config.schema import SCST_BASELINES
from captioner.decoding.search import DecodeOptions, SuppressTokens, never_emitted_ids, sample_captions
from captioner.errors import DataError
from captioner.evaluation.metrics import DocFrequencies, cider_d_tokenized, ngram_document_frequencies
from captioner.inference import search_features
from captioner.text import Vocabulary, tokenize
from captioner.training.objective import Batch, LossResult, Objective, TrainModel

log = logging.getLogger(__name__)


class CaptionReward:
    """``(1 - w) * CIDEr-D + w * BLEU-4`` of tokenized captions against per-image raw ``references``.

    ``sigma``, ``n``: CIDEr-D's length-penalty width and longest n-gram; ``doc_freq`` defaults to
    counts over ``references``.
    """

    def __init__(self, references: Sequence[Sequence[str]], bleu_weight: float = 0.0, sigma: float = 6.0,
                 n: int = 4, doc_freq: DocFrequencies | None = None) -> None:
        if not 0.0 <= bleu_weight <= 1.0:
            raise DataError(f"bleu_weight must be in [0, 1], got {bleu_weight}")
        self.references = [[tokenize(r) for r in refs] for refs in references]
        if any(not refs for refs in self.references):
            raise DataError("every training image needs at least one reference caption for the reward")
        self.bleu_weight = float(bleu_weight)
        self.sigma, self.n = sigma, n
        self.doc_freq = doc_freq if doc_freq is not None else ngram_document_frequencies(self.references, n)

    def cider_d(self, captions: Sequence[Sequence[str]], images: Sequence[int]) -> list[float]:
        """CIDEr-D (x10 scale) of each tokenized caption against all references of its image."""
        if len(captions) != len(images):
            raise DataError(f"{len(captions)} captions but {len(images)} image indices")
        return cider_d_tokenized(captions, images, self.references, self.doc_freq, self.sigma, self.n)

    def bleu4(self, captions: Sequence[Sequence[str]], images: Sequence[int]) -> list[float]:
        """Sentence BLEU-4 (0-1, nltk, smoothing method1) of each caption against its image's references."""
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

        smooth = SmoothingFunction().method1
        return [float(sentence_bleu(self.references[i], list(c), smoothing_function=smooth)) if c else 0.0
                for c, i in zip(captions, images)]

    def __call__(self, captions: Sequence[Sequence[str]], images: Sequence[int]) -> list[float]:
        """The reward of each tokenized caption (``images[j]``: the training image of caption j)."""
        rewards = self.cider_d(captions, images)
        if self.bleu_weight:
            w = self.bleu_weight
            rewards = [(1.0 - w) * c + w * b for c, b in zip(rewards, self.bleu4(captions, images))]
        return rewards


def distinct_images(image_index: torch.Tensor) -> tuple[list[int], list[int]]:
    """Batch rows of the first occurrence of each image, and those images' indices (batch order)."""
    rows: dict[int, int] = {}
    for row, image in enumerate(image_index.tolist()):
        rows.setdefault(int(image), row)
    return list(rows.values()), list(rows.keys())


def baselines(rewards: torch.Tensor, samples: int, kind: str, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """Each sample's baseline, (R,) -> (R,): ``greedy`` (the image's greedy reward) or ``mean`` (its other samples')."""
    if kind == "greedy":
        if greedy is None:
            raise ValueError("the greedy baseline needs the greedy rewards")
        return greedy.repeat_interleave(samples)
    per_image = rewards.view(-1, samples)  # (B, K)
    others = (per_image.sum(dim=1, keepdim=True) - per_image) / (samples - 1)  # (B, K)
    return others.reshape(-1)


@contextlib.contextmanager
def dropout_off(*modules: nn.Module) -> Iterator[None]:
    """Put every dropout layer of ``modules`` in eval mode (the modules keep their own mode).

    SCST samples without a graph and re-scores with teacher forcing: with dropout on, the two passes
    would be different policies. Hard attention still samples its regions.
    """
    layers = [m for module in modules for m in module.modules() if isinstance(m, nn.Dropout) and m.training]
    for layer in layers:
        layer.eval()
    try:
        yield
    finally:
        for layer in layers:
            layer.train()


def policy_log_probs(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, banned_ids: Sequence[int] = (),
                     eos_id: int = -1, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target) under the **sampling policy**: (R, L, V), (R, L), (R, L) -> (R, L) float32, 0 at padding.

    pi is ``softmax(logits / temperature)`` **without** ``banned_ids``, as ``sample_captions`` draws:
    with the full softmax, negative advantages push a never-sampled ``<unk>`` up until it takes the
    mass. Under pi the banned ids get no gradient.
    """
    scores = SuppressTokens(banned_ids, eos_id)(logits.float())  # the sampler's filter (captioner.decoding.search)
    if temperature != 1.0:
        scores = scores / temperature
    chosen = F.log_softmax(scores, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (R, L), -inf at pad
    return torch.where(mask, chosen, torch.zeros_like(chosen))


class SelfCritical(Objective):
    """The SCST objective for any decoder; no buffers, so nothing to resume (defaults: ``train.scst``).

    ``baseline``: ``"mean"`` or ``"greedy"``; ``max_len``: words per sampled caption;
    ``reinforce_weight``/``entropy_weight``: hard attention's terms; ``xe_weight``: the references'
    cross-entropy mixed in (0: pure SCST).
    """

    def __init__(self, reward: CaptionReward, vocab: Vocabulary, samples: int = ScstConfig.samples,
                 temperature: float = ScstConfig.temperature, baseline: str = ScstConfig.baseline,
                 max_len: int = TrainConfig.val_max_len, reinforce_weight: float = 1.0, entropy_weight: float = 0.0,
                 xe_weight: float = ScstConfig.xe_weight) -> None:
        super().__init__()
        if baseline not in SCST_BASELINES:
            raise ValueError(f"baseline {baseline!r}: use {' or '.join(SCST_BASELINES)}")
        self.reward, self.vocab = reward, vocab
        self.samples, self.temperature, self.baseline_kind, self.max_len = samples, temperature, baseline, max_len
        self.reinforce_weight, self.entropy_weight, self.xe_weight = reinforce_weight, entropy_weight, xe_weight
        self.banned = never_emitted_ids(vocab)

    def _texts(self, ids: list[list[int]]) -> list[list[str]]:
        # the validation path: ids -> text -> the one tokenization used by every metric
        return [tokenize(self.vocab.decode(row)) for row in ids]

    def _greedy(self, decoder: nn.Module, features: torch.Tensor) -> list[list[int]]:
        hyps = search_features(decoder, features, self.vocab, DecodeOptions(beam_size=1, max_len=self.max_len))
        return [h[0].tokens for h in hyps]

    def loss(self, model: TrainModel, batch: Batch) -> LossResult:
        """One SCST step's loss (:meth:`batch_loss` with the batch's parts)."""
        return self.batch_loss(model.forward, model.decoder, model.encode, batch.x, batch.image_index,
                               tokens=batch.tokens)

    def batch_loss(self, forward: Callable[[torch.Tensor, torch.Tensor], Any], decoder: nn.Module,
                   encode: Callable[[torch.Tensor], torch.Tensor] | None, x: torch.Tensor,
                   image_index: torch.Tensor, tokens: torch.Tensor | None = None) -> LossResult:
        """One SCST step's loss; its ``captions`` is R, the number of sampled captions.

        ``forward`` is the trained module, ``decoder`` the bare one (sampling without gradients), ``encode``
        images -> features (None on features). ``tokens``: the rows' references, needed when ``xe_weight`` > 0.
        """
        if self.xe_weight and tokens is None:
            raise ValueError("train.scst.xe_weight > 0 needs the batch's reference tokens")
        with dropout_off(decoder):
            result = self._batch_loss(forward, decoder, encode, x, image_index)
            if not self.xe_weight:
                return result
            out = forward(x, tokens[:, :-1])  # logits (rows, T-1, V): the references, teacher-forced
            ce = F.cross_entropy(out.logits.float().flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=self.vocab.pad_id)
            weighted = self.xe_weight * ce
            terms = {**result.terms, "scst_xe": ce.detach()}
            return LossResult(total=result.total + weighted, objective=result.objective + weighted.detach(),
                              terms=terms, captions=result.captions)

    def _batch_loss(self, forward: Callable[[torch.Tensor, torch.Tensor], Any], decoder: nn.Module,
                    encode: Callable[[torch.Tensor], torch.Tensor] | None, x: torch.Tensor,
                    image_index: torch.Tensor) -> LossResult:
        rows, images = distinct_images(image_index)
        K = self.samples
        keep = torch.tensor(rows, device=x.device)
        x = x.index_select(0, keep)  # (B, ...)
        with torch.no_grad():
            features = x if encode is None else encode(x)  # (B, N, D)
            if features.is_floating_point() and features.dtype != torch.float32:  # fp16/bf16 feature caches
                features = features.float()
            sampled = sample_captions(decoder, features, self.vocab.bos_id, self.vocab.eos_id, self.vocab.pad_id,
                                      K, self.max_len, self.temperature, self.banned)
            greedy_ids = self._greedy(decoder, features)  # logged with either baseline: the test-time policy
        sample_images = [i for i in images for _ in range(K)]
        rewards = self.reward(self._texts(sampled.words()), sample_images)
        device = x.device
        reward_t = torch.tensor(rewards, dtype=torch.float32, device=device)  # (R,)
        greedy_t = torch.tensor(self.reward(self._texts(greedy_ids), images), dtype=torch.float32, device=device)  # (B,)
        base = baselines(reward_t, K, self.baseline_kind, greedy_t)  # (R,)
        advantage = reward_t - base  # (R,)

        targets = sampled.tokens  # (R, L)
        bos = torch.full_like(targets[:, :1], self.vocab.bos_id)
        inputs = torch.cat([bos, targets[:, :-1]], dim=1)  # (R, L)
        out = forward(x.repeat_interleave(K, dim=0), inputs)  # logits (R, L, V)
        valid = targets != self.vocab.pad_id  # (R, L)
        mask = valid.float()
        count = mask.sum().clamp(min=1.0)
        token_lp = policy_log_probs(out.logits, targets, valid, self.banned, self.vocab.eos_id, self.temperature)  # (R, L)
        total = -(advantage.unsqueeze(1) * token_lp).sum() / count
        objective = -reward_t.mean()
        terms = {"scst_reward": reward_t.mean(), "scst_baseline_reward": base.mean(),
                 "scst_better": (reward_t > base).float().mean(), "scst_greedy_reward": greedy_t.mean(),
                 "scst_better_than_greedy": (reward_t > greedy_t.repeat_interleave(K)).float().mean()}
        if out.sample_log_probs is not None:  # hard attention: the region choices share the advantage
            region_lp = out.sample_log_probs.float() * mask  # (R, L)
            term = -self.reinforce_weight * (advantage.unsqueeze(1) * region_lp).sum() / count
            total = total + term
            terms["reinforce"] = term.detach()
        if out.attention_entropy is not None and self.entropy_weight:
            entropy = (out.attention_entropy.float() * mask).sum() / count
            bonus = -self.entropy_weight * entropy
            total, objective = total + bonus, objective + bonus.detach()
            terms["entropy"] = entropy.detach()
            terms["weighted_entropy"] = self.entropy_weight * entropy.detach()
        return LossResult(total=total, objective=objective.detach(), terms=terms, captions=int(targets.size(0)))


def build_self_critical(cfg: Any, train_set: Any, vocab: Vocabulary) -> SelfCritical:
    """``train.objective = "scst"``: the loss over ``train_set``'s references (DFs counted here, once)."""
    t = cfg.train
    if not t.init:
        log.warning("train.objective=scst without train.init (--init): self-critical training from random "
                    "weights rarely samples a rewarded caption; start from a cross-entropy checkpoint")
    reward = CaptionReward([train_set.references(image.image_id) for image in train_set.images],
                           bleu_weight=t.scst.bleu_weight)
    hard = cfg.model.decoder.attention_kind == "hard"
    s = t.scst
    return SelfCritical(reward, vocab, samples=s.samples, temperature=s.temperature, baseline=s.baseline,
                        max_len=t.val_max_len, reinforce_weight=t.reinforce_weight,
                        entropy_weight=t.entropy_weight if hard else 0.0, xe_weight=s.xe_weight)
