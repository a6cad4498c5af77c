"""Configuration: dataclasses, parsing and named presets.

A ``Config`` has four parts: ``model`` (encoder + decoder, saved in every checkpoint), ``data``,
``train`` and ``decoding``. The decoder is one dataclass per family (``SATConfig``,
``TransformerConfig``), picked by ``name``. Presets are registered by name; ``get_preset(name,
**overrides)`` returns a fresh copy with dotted overrides applied, e.g. ``get_preset("sat_soft_tiny",
**{"train.lr": 1e-3})``. Config files (JSON or YAML) hold the same nested structure; command-line
``--set key=value`` flags override them.

Modules: ``decoders`` (the decoder families), ``schema`` (every other dataclass, the preset table,
``resolve_config``), ``parse`` (nested mappings, overrides, files).
"""

from captioner.config.decoders import (
    DECODERS,
    ConceptsConfig,
    DecoderConfig,
    SATConfig,
    TransformerConfig,
    decoder_families,
    decoder_family,
)
from captioner.config.parse import load_config_file, parse_override
from captioner.config.schema import (
    GPU_BATCH,
    PRESETS,
    PREPROCESSING_FIELDS,
    SELECT_METRICS,
    Config,
    DataConfig,
    DecodeOptions,
    EncoderConfig,
    ModelConfig,
    ScstConfig,
    TrainConfig,
    get_preset,
    list_presets,
    model_config_from_dict,
    resolve_config,
)

__all__ = [
    "DECODERS", "GPU_BATCH", "PREPROCESSING_FIELDS", "PRESETS", "SELECT_METRICS", "ConceptsConfig",
    "Config", "DataConfig", "DecodeOptions", "DecoderConfig",
    "EncoderConfig", "ModelConfig", "SATConfig", "ScstConfig", "TrainConfig", "TransformerConfig", "decoder_families", "decoder_family",
    "get_preset", "list_presets", "load_config_file", "model_config_from_dict", "parse_override",
    "resolve_config",
]
