"""Several trained models decoded as one: the mean of their next-word probabilities.

Shape legend: B batch (decoder rows), M members, N regions, D feature width (all members' regions
side by side), V vocabulary, T caption steps.

Built at load time (``captioner.load([a, b, ...])``), never trained or saved, an ordinary
``CaptionModel``. :class:`EnsembleEncoder` runs each distinct encoder once and lays their regions
side by side, (B, N, D_1 + D_2 + ...). :class:`EnsembleDecoder` returns ``log(mean_m p_m(w | ...))``
(the mean of probabilities, so one confident member cannot veto a word) and the members' mean
attention. Concepts come from the first member that has them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from captioner.config import ModelConfig
from captioner.errors import ConfigError
from captioner.models.base import CaptionDecoder, DecoderOutput, State
from captioner.models.model import CaptionModel

# what must agree for the members' encoders to see the same pixels and give the same regions
SHARED_ENCODER_FIELDS = ("image_size", "resize", "interpolation", "mean", "std", "grid")


def check_compatible(configs: Sequence[ModelConfig], names: Sequence[str]) -> None:
    """Raise ``ConfigError`` naming the member and the field when two members' images or grids differ."""
    first = configs[0].encoder
    for config, name in zip(configs[1:], names[1:]):
        for key in SHARED_ENCODER_FIELDS:
            mine, theirs = getattr(config.encoder, key), getattr(first, key)
            if mine != theirs:
                raise ConfigError(f"{name}: encoder.{key} is {mine!r} but {names[0]} has {theirs!r}; the models of "
                                  "an ensemble must see the same pixels and give the same grid of regions")


class EnsembleEncoder(nn.Module):
    """Distinct encoders run once each; their regions concatenated along the feature axis."""

    def __init__(self, encoders: Sequence[nn.Module]) -> None:
        super().__init__()
        self.encoders = nn.ModuleList(encoders)
        self.out_dim = sum(int(e.out_dim) for e in encoders)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        outputs = [encoder(images) for encoder in self.encoders]
        grids = {tuple(int(g) for g in grid) for _, grid in outputs}
        if len(grids) != 1:
            raise ConfigError(f"the ensemble's encoders gave different grids {sorted(grids)}")
        return torch.cat([features for features, _ in outputs], dim=-1), outputs[0][1]


class _SlicedConcepts(nn.Module):
    """A member's concept reading over that member's slice of the ensemble's regions: what ``Caption.concepts``
    reads of the ensemble (``concepts``, ``concept_ids``, ``concept_head.read``)."""

    def __init__(self, reading: nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.reading, self.start, self.end = reading, start, end
        self.concepts = reading.concepts

    @property
    def concept_ids(self) -> torch.Tensor:
        return self.reading.concept_ids

    @property
    def concept_head(self) -> "_SlicedConcepts":
        return self

    def probs(self, features: torch.Tensor) -> torch.Tensor:
        return self.reading.concept_head.probs(features[..., self.start:self.end])

    def read(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.reading.concept_head.read(features[..., self.start:self.end])


class EnsembleDecoder(CaptionDecoder):
    """The members' mean next-word distribution; ``slices``: each member's part of the feature axis."""

    def __init__(self, members: Sequence[CaptionDecoder], slices: Sequence[tuple[int, int]],
                 names: Sequence[str]) -> None:
        super().__init__()
        if not members or not len(members) == len(slices) == len(names):
            raise ConfigError("an ensemble needs one feature slice and one name per member, and at least one member")
        self.members = nn.ModuleList(members)
        self.member_names = list(names)
        self.slices = [(int(a), int(b)) for a, b in slices]
        self.vocab_size = members[0].vocab_size
        self.log_count = math.log(len(members))
        self.extension = None  # the photo's tags: the first member that can name them
        for member, (start, end) in zip(members, self.slices):
            if getattr(member.extension, "concepts", 0):
                self.extension = _SlicedConcepts(member.extension, start, end)
                break

    def _features(self, features: torch.Tensor) -> list[torch.Tensor]:
        return [features[..., a:b] for a, b in self.slices]

    def _mean(self, log_probs: list[torch.Tensor]) -> torch.Tensor:
        return torch.logsumexp(torch.stack(log_probs), dim=0) - self.log_count

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, need_all_attention: bool = False) -> DecoderOutput:
        """Teacher forcing: logits (B,T,V) are the log of the members' mean probabilities."""
        outs = [m(f, tokens) for m, f in zip(self.members, self._features(features))]
        log_probs = self._mean([torch.log_softmax(o.logits.float(), dim=-1) for o in outs])
        maps = [o.attention for o in outs]
        attention = torch.stack(maps).mean(0) if all(a is not None for a in maps) else None
        return DecoderOutput(log_probs, attention)

    def init_state(self, features: torch.Tensor) -> State:
        states = [m.init_state(f) for m, f in zip(self.members, self._features(features))]
        return State({"members": [s.static for s in states]}, {"members": [s.dynamic for s in states]})

    def step(self, prev_tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        log_probs, dynamic, maps = [], [], []
        for member, static, dyn in zip(self.members, state.static["members"], state.dynamic["members"]):
            lp, new, attention = member.step(prev_tokens, State(static, dyn, state.group))
            log_probs.append(lp.float())
            dynamic.append(new.dynamic)
            maps.append(attention.float())
        return (self._mean(log_probs), State(state.static, {"members": dynamic}, state.group),
                torch.stack(maps).mean(0))

    @property
    def groups_rows(self) -> bool:  # type: ignore[override]
        """A grouped state for the ensemble when every member reads one."""
        return all(bool(getattr(m, "groups_rows", False)) for m in self.members)

    def state_bytes_per_word(self) -> int:
        return sum(m.state_bytes_per_word() for m in self.members)


def _same_encoder(a: CaptionModel, b: CaptionModel) -> bool:
    """Equal encoder configs and equal encoder weights: one pass serves both."""
    if a.config.encoder != b.config.encoder or type(a.encoder) is not type(b.encoder):
        return False
    a, b = a.encoder, b.encoder
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in sa)


def build_ensemble(models: Sequence[CaptionModel], names: Sequence[str]) -> CaptionModel:
    """One ``CaptionModel`` decoding ``models`` together (eval mode), identical encoders sharing one pass.

    Raises ``ConfigError`` when the encoders do not see the same pixels or give the same grid.
    """
    configs = [m.config for m in models]
    check_compatible(configs, names)
    owners: list[CaptionModel] = []  # the member whose encoder each pass uses
    offsets: list[int] = []
    slices: list[tuple[int, int]] = []
    width = 0
    for model in models:
        e = next((i for i, owner in enumerate(owners) if _same_encoder(owner, model)), None)
        if e is None:
            e = len(owners)
            owners.append(model)
            offsets.append(width)
            width += int(model.encoder.out_dim)
        slices.append((offsets[e], offsets[e] + int(owners[e].encoder.out_dim)))
    decoder = EnsembleDecoder([m.decoder for m in models], slices, [c.decoder.name for c in configs])
    return CaptionModel(EnsembleEncoder([o.encoder for o in owners]), decoder, configs[0], models[0].vocab_size).eval()
