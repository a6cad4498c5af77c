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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

LITE0_DIM = 1280
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
