"""Decoder configs, one dataclass per family, chosen by ``name``.

``DecoderConfig`` holds what every decoder has (``name``, ``dropout``, ``max_len``); ``SATConfig``
and ``TransformerConfig`` add their own fields, and ``DecoderConfig(name="transformer", ...)``
builds the family ``name`` picks. Defining a subclass registers the family for parsing
(:func:`decoder_families`). Every option is validated here, once. ``ConceptsConfig`` is the
model's optional ``concepts`` section, never a field of a decoder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from captioner.errors import ConfigError

SAT_ATTENTIONS = ("soft", "hard")  # decoder.attention
HARD_TEST_MODES = ("expectation", "argmax")  # decoder.hard_test_mode
CONCEPT_POOLINGS = ("lse", "noisy_or")  # concepts.pooling: how a concept head pools its regions


def check_hard_test_mode(mode: Any) -> str:
    """``mode`` when it is one of :data:`HARD_TEST_MODES`; ConfigError otherwise."""
    if mode not in HARD_TEST_MODES:
        raise ConfigError(f"decoder.hard_test_mode={mode!r}: use {' or '.join(HARD_TEST_MODES)}")
    return mode


class _FamilyByName(type):
    """Metaclass of ``DecoderConfig``: calling the base class builds the family its ``name`` picks."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is DecoderConfig:
            if args:
                raise TypeError("DecoderConfig(...) takes keyword arguments only (name=..., then the family's fields)")
            cls = decoder_family(kwargs.get("name", DEFAULT_DECODER))
        return type.__call__(cls, *args, **kwargs)


@dataclass
class DecoderConfig(metaclass=_FamilyByName):
    """The fields every decoder family has; the base class of ``SATConfig`` and ``TransformerConfig``."""

    name: str = "sat"  # one of DECODERS; picks the family (its class); each family's default is its own name
    dropout: float = 0.5
    max_len: int = 50  # longest caption (words) the model can produce / position table size

    def __post_init__(self) -> None:
        family = decoder_family(self.name)
        if type(self) is not family:
            raise ConfigError(f"decoder.name={self.name!r} needs {family.__name__}, not {type(self).__name__}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"decoder.dropout must be in [0, 1), got {self.dropout}")
        self._check_positive("max_len")

    @property
    def width(self) -> int:
        """The decoder's hidden width (the Transformer's ``d_model``, the LSTM's ``hidden_dim``)."""
        raise NotImplementedError

    @property
    def attention_kind(self) -> str:
        """How the decoder attends to the regions: ``"soft"``, ``"hard"`` (SAT) or ``"cross"`` (Transformer)."""
        raise NotImplementedError

    @property
    def doubly_stochastic(self) -> bool:
        """Whether ``train.alpha_c``'s penalty on each region's summed attention applies (SAT only)."""
        return False

    def _check_positive(self, *keys: str) -> None:
        for key in keys:
            if getattr(self, key) < 1:
                raise ConfigError(f"decoder.{key} must be >= 1, got {getattr(self, key)}")


@dataclass
class ConceptsConfig:
    """``model.concepts``: what a decoder reads of a photo's concept detectors (``count=0``: none)."""

    count: int = 0  # K, the concepts read (0: none)
    hidden: int = 512  # the head's hidden width
    pooling: str = "lse"  # the head's pooling over regions: "lse" or "noisy_or"
    sharpness: float = 5.0  # r of the "lse" pooling
    # the concept prior: the attention at each step is multiplied by the maps of the concepts the decoder
    # expects to name next (a pointer over the photo's concepts, read from its state); needs count > 0 when built
    prior: bool = False

    def __post_init__(self) -> None:
        if self.count < 0 or self.hidden < 0:
            raise ConfigError(f"concepts.count and concepts.hidden must be >= 0, got {self.count} and {self.hidden}")
        if self.pooling not in CONCEPT_POOLINGS:
            raise ConfigError(f"concepts.pooling={self.pooling!r}: use {' or '.join(CONCEPT_POOLINGS)}")


@dataclass
class SATConfig(DecoderConfig):
    """Show, Attend and Tell (Xu et al. 2015): an LSTM with soft or hard attention over the regions."""

    name: str = "sat"
    embed_dim: int = 512  # word embedding size
    attention: str = "soft"  # "soft" (deterministic) or "hard" (stochastic, REINFORCE)
    hidden_dim: int = 512  # LSTM width
    attention_dim: int = 512  # additive attention width
    hard_test_mode: str = "expectation"  # hard attention at test time: "expectation" or "argmax"
    hard_soft_prob: float = 0.5  # training: probability of using the expected context instead
    # add learned row and column embeddings to the region features (what the Transformer's regions get):
    # without them an LSTM that attends by content cannot tell where the region it looked at lies
    region_positions: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention not in SAT_ATTENTIONS:
            raise ConfigError(f"decoder.attention={self.attention!r}: use 'soft' or 'hard'")
        check_hard_test_mode(self.hard_test_mode)
        if not 0.0 <= self.hard_soft_prob <= 1.0:
            raise ConfigError(f"decoder.hard_soft_prob must be in [0, 1], got {self.hard_soft_prob}")
        self._check_positive("embed_dim", "hidden_dim", "attention_dim")

    @property
    def width(self) -> int:
        return self.hidden_dim

    @property
    def attention_kind(self) -> str:
        return self.attention

    @property
    def doubly_stochastic(self) -> bool:
        return True


@dataclass
class TransformerConfig(DecoderConfig):
    """A Transformer decoder: masked self-attention, cross-attention to the regions, feed-forward."""

    name: str = "transformer"
    d_model: int = 512  # token and region width
    num_layers: int = 3
    num_heads: int = 8  # d_model must be divisible by it
    ff_dim: int = 2048  # feed-forward width
    tie_embeddings: bool = False  # the output projection shares the word embedding's weights

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_positive("d_model", "num_layers", "num_heads", "ff_dim")
        if self.d_model % self.num_heads:
            raise ConfigError(f"decoder.d_model={self.d_model} is not divisible by num_heads={self.num_heads}")

    @property
    def width(self) -> int:
        return self.d_model

    @property
    def attention_kind(self) -> str:
        return "cross"


def family_name(family: type[DecoderConfig]) -> str:
    """The name a family answers to: its class's ``name`` default (``SATConfig`` -> ``"sat"``)."""
    return next(f.default for f in dataclasses.fields(family) if f.name == "name")


def decoder_families() -> dict[str, type[DecoderConfig]]:
    """The decoder config classes by name: every subclass of ``DecoderConfig``, the first class of a name."""
    families: dict[str, type[DecoderConfig]] = {}
    todo = list(DecoderConfig.__subclasses__())
    while todo:
        family = todo.pop(0)
        families.setdefault(family_name(family), family)
        todo.extend(family.__subclasses__())
    return families


DECODERS = ("sat", "transformer")  # the built-in families
DEFAULT_DECODER = "sat"  # the family of a decoder mapping without a name
SHARED_KEYS = tuple(f.name for f in dataclasses.fields(DecoderConfig))  # name, dropout, max_len


def decoder_family(name: Any) -> type[DecoderConfig]:
    """The config class of decoder family ``name``; ConfigError naming the families otherwise."""
    families = decoder_families()
    family = families.get(name) if isinstance(name, str) else None
    if family is None:
        raise ConfigError(f"decoder.name={name!r} is not one of {', '.join(families)}")
    return family


def family_keys(family: type[DecoderConfig]) -> list[str]:
    """Every field of a family, shared ones first."""
    return [f.name for f in dataclasses.fields(family)]


def keys_help(family: type[DecoderConfig], key: str) -> str:
    """One clause for an error about ``key``: the family's keys, and which other family has ``key``."""
    families = decoder_families()
    name = family_name(family)
    owners = [n for n, other in families.items() if other is not family and key in family_keys(other)]
    switch = f"; {key} belongs to the {owners[0]} decoder: set model.decoder.name={owners[0]} first" if owners else ""
    return f"the {name} decoder's keys are {', '.join(family_keys(family))}{switch}"


def switched_family(section: dict[str, Any], name: Any) -> dict[str, Any]:
    """A decoder mapping for family ``name``: its defaults, keeping ``section``'s shared fields (a new dict)."""
    families = decoder_families()
    if name == section.get("name") or not isinstance(name, str) or name not in families:
        return {**section, "name": name}
    new = dataclasses.asdict(families[name]())
    new.update({k: section[k] for k in SHARED_KEYS if k in section and k != "name"})
    return new
