"""Configuration: dataclasses, parsing and named presets.

``decoders`` (the decoder families), ``schema`` (every other dataclass, the preset table,
``resolve_config``), ``parse`` (nested mappings, ``--set key=value`` overrides, JSON/YAML files).
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
    EVERYDAY_PHOTOS,
    GPU_BATCH,
    PRESETS,
    PREPROCESSING_FIELDS,
    SELECT_METRICS,
    Config,
    DataConfig,
    DecodeOptions,
    EncoderConfig,
    LabelStageConfig,
    ModelConfig,
    ScstConfig,
    TrainConfig,
    everyday_photos,
    flags_of,
    get_preset,
    list_presets,
    model_config_from_dict,
    resolve_config,
)

__all__ = [
    "DECODERS", "EVERYDAY_PHOTOS", "GPU_BATCH", "PREPROCESSING_FIELDS", "PRESETS", "SELECT_METRICS", "ConceptsConfig",
    "Config", "DataConfig", "DecodeOptions", "DecoderConfig",
    "EncoderConfig", "LabelStageConfig", "ModelConfig", "SATConfig", "ScstConfig", "TrainConfig", "TransformerConfig", "decoder_families", "decoder_family",
    "everyday_photos", "flags_of", "get_preset", "list_presets", "load_config_file", "model_config_from_dict", "parse_override",
    "resolve_config",
]
