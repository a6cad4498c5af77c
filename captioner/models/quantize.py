"""An int8 EfficientNet-Lite trunk for CPU inference, with the activation ranges calibrated once.

Shape legend: B batch, C channels, H/W map size, D the trunk's output channels (+ the label top's).

EfficientNet-Lite was designed for integer inference (ReLU6, no squeeze-and-excitation): each
convolution with its BatchNorm folded in becomes one 8-bit convolution (weights per output channel,
symmetric; activations per tensor, unsigned), its ReLU6 the clamp of its output's range, each
residual sum an 8-bit add. PyTorch's own quantized kernels run it (the ``onednn`` engine: on this
package's CPUs it ran the Lite0 trunk several times faster than the ``x86``/``fbgemm`` engine,
whose depthwise path was slower than float32; docs/benchmarks.md). The ImageNet label top, when the
trunk has one, is quantized the same way; the region pool, the decoder, the attention maps and the
label reading stay float32.

``calibrate(trunk, batches)`` runs the float trunk (BatchNorm folded) over a few hundred photos and
returns each activation's ``(scale, zero_point)`` (histogram observers, as PyTorch's static
quantization uses) and each convolution's mean input per channel (for the bias correction): a small
JSON document shipped beside a model (``write_calibration`` / ``read_calibration``).
``Int8Lite(trunk, calibration)`` builds the int8 trunk from the float weights and that calibration:
the weights' quantization is deterministic, so nothing is calibrated at a user's call.

A stride-2 "SAME" convolution pads asymmetrically, and quantized tensors have no fast asymmetric
pad: it runs at stride 1 with symmetric padding and keeps every second output (from the second on
an even side, from the first on an odd one): the same sums as the strided convolution, at four
times the cost of that (depthwise, cheap) layer. The stem's pad is taken in float before the input
is quantized.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_weights

from captioner.errors import CheckpointError, ConfigError
from captioner.files import atomic_write, read_json
from captioner.models.encoder import (Conv2dSame, DepthwiseSeparableConv, EfficientNetLiteFeatures, InvertedResidual,
                                      _same_pad)

ENGINE = "onednn"  # PyTorch's quantized engine the int8 trunk runs on (see the module docstring)
FORMAT = 1  # the calibration file's format
MAX_CALIBRATION_BYTES = 1 << 20  # a calibration file larger than this is refused before it is read
INPUT = "input"  # the quantized input's site name

# PyTorch 2.14 warns that its quantized tensor types will go (pytorch/pytorch#184982, torchao's are to replace
# them); they are what its quantized CPU kernels take today: said once here (docs/benchmarks.md), not at each call
warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other",
                        category=UserWarning)


def int8_available() -> bool:
    """Whether this PyTorch build has the quantized engine the int8 trunk runs on."""
    return ENGINE in torch.backends.quantized.supported_engines


class ConvAct(nn.Module):
    """A convolution with its BatchNorm folded in, then ReLU6 (``relu6``) or nothing: float, or 8-bit once
    :meth:`quantize` packed its weights.

    A stride-2 convolution runs at stride 1 with symmetric padding and keeps every second output
    (see the module docstring); ``float_pad``: the stem, whose input is padded "SAME" in float.
    """

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d, relu6: bool, float_pad: bool = False) -> None:
        super().__init__()
        weight, bias = fuse_conv_bn_weights(conv.weight.detach(), None, bn.running_mean, bn.running_var, bn.eps,
                                            bn.weight.detach(), bn.bias.detach())
        self.register_buffer("weight", weight.detach().float())  # (C', C/groups, k, k)
        self.register_buffer("bias", bias.detach().float())  # (C',)
        kernel, stride, dilation = conv.kernel_size[0], conv.stride[0], conv.dilation[0]
        self.float_pad = float_pad and isinstance(conv, Conv2dSame)
        self.subsample = stride == 2 and not self.float_pad
        self.kernel, self.groups, self.dilation = kernel, conv.groups, dilation
        self.stride = stride if self.float_pad else 1
        self.padding = 0 if self.float_pad else dilation * (kernel - 1) // 2
        self.relu6 = relu6
        self.packed = None  # the 8-bit weights and bias, packed for the quantized engine
        self.qparams: tuple[float, int] | None = None  # the output's (scale, zero_point)

    def pad_input(self, x: torch.Tensor) -> torch.Tensor:
        """The stem's input (B,3,H,W) padded as TensorFlow's "SAME" (float, before quantization)."""
        h, w = x.shape[-2:]
        pad_h, pad_w = _same_pad(h, self.kernel, self.stride), _same_pad(w, self.kernel, self.stride)
        return F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))

    def quantize(self, qparams: tuple[float, int], input_mean: torch.Tensor | None = None) -> None:
        """Pack the weights in 8 bits (symmetric, per output channel) for outputs in ``qparams``.

        ``input_mean`` (C,): the calibration photos' mean input per channel; the bias then takes back the
        mean shift that rounding the weights causes (empirical bias correction, Nagel et al. 2019), which
        halves the trunk's error (weights alone: 0.16 -> 0.09 of the features' norm).
        """
        scales = (self.weight.abs().amax(dim=(1, 2, 3)) / 127.0).clamp(min=1e-12).double()  # (C',)
        qweight = torch.quantize_per_channel(self.weight, scales, torch.zeros(len(scales), dtype=torch.long), 0,
                                             torch.qint8)
        bias = self.bias
        if input_mean is not None:
            change = (qweight.dequantize() - self.weight).sum(dim=(2, 3))  # (C', C/groups)
            shift = change @ input_mean if self.groups == 1 else change[:, 0] * input_mean  # (C',)
            bias = bias - shift
        self.packed = torch.ops.quantized.conv2d_prepack(qweight, bias, [self.stride] * 2, [self.padding] * 2,
                                                         [self.dilation] * 2, self.groups)
        self.qparams = qparams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B,C,H,W) -> (B,C',H',W'), 8-bit in and out once quantized, else float."""
        h, w = x.shape[-2:]
        if self.packed is not None:
            op = torch.ops.quantized.conv2d_relu if self.relu6 else torch.ops.quantized.conv2d
            y = op(x, self.packed, *self.qparams)  # ReLU6: the clamp of the output's range [0, <= 6]
        else:
            y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
            y = F.relu6(y) if self.relu6 else y
        if self.subsample:  # the strided "SAME" outputs: every second one, from the second on an even side
            y = y[:, :, 1 - h % 2::2, 1 - w % 2::2]
        return y


class Block(nn.Module):
    """One Lite block as a sequence of :class:`ConvAct`, plus its residual sum (``add``: its site)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        if isinstance(block, DepthwiseSeparableConv):
            layers = [ConvAct(block.conv_dw, block.bn1, True), ConvAct(block.conv_pw, block.bn2, False)]
        elif isinstance(block, InvertedResidual):
            layers = [ConvAct(block.conv_pw, block.bn1, True), ConvAct(block.conv_dw, block.bn2, True),
                      ConvAct(block.conv_pwl, block.bn3, False)]
        else:
            raise ConfigError(f"int8: no quantized form of a {type(block).__name__} block")
        self.layers = nn.Sequential(*layers)
        self.has_skip = block.has_skip
        self.add = Add()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers(x)
        return self.add(y, x) if self.has_skip else y


class Add(nn.Module):
    """A residual sum: float, or 8-bit into its calibrated ``(scale, zero_point)`` once set."""

    def __init__(self) -> None:
        super().__init__()
        self.qparams: tuple[float, int] | None = None

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.is_quantized:
            return torch.ops.quantized.add(a, b, self.qparams[0], self.qparams[1])
        return a + b


def _stage(blocks: Iterable[nn.Module], conv_head: nn.Conv2d, bn2: nn.BatchNorm2d) -> nn.Sequential:
    return nn.Sequential(*[Block(b) for b in blocks], ConvAct(conv_head, bn2, True))


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured: ``ranges`` ``{site: (scale, zero_point)}`` of every activation (and
    :data:`INPUT`), and ``means`` ``{site: (C,)}``, the mean input per channel of every convolution."""

    ranges: dict[str, tuple[float, int]]
    means: dict[str, torch.Tensor]


class Int8Lite(nn.Module):
    """An EfficientNet-Lite trunk (its label top too) as 8-bit convolutions: images (B,3,H,W) -> the float
    trunk's map (B,D,h,w), float32.

    Args:
        trunk: the float trunk (its weights are copied, BatchNorm folded).
        calibration: from :func:`calibrate` (or :func:`read_calibration`); None: a float copy of the same
            layers (what :func:`calibrate` observes).

    Raises:
        ConfigError: this PyTorch has no quantized engine for it, or ``calibration`` lacks a site.
    """

    def __init__(self, trunk: EfficientNetLiteFeatures, calibration: Calibration | None = None) -> None:
        super().__init__()
        if not isinstance(trunk, EfficientNetLiteFeatures):
            raise ConfigError(f"int8 needs an EfficientNet-Lite encoder, not {type(trunk).__name__}")
        self.stem = ConvAct(trunk.conv_stem, trunk.bn1, True, float_pad=True)
        self.body = nn.Sequential(*[Block(b) for stage in trunk.blocks[:-1] for b in stage])
        self.top = _stage(trunk.blocks[-1], trunk.conv_head, trunk.bn2)
        label_top = getattr(trunk, "label_top", None)
        self.label_top = None if label_top is None else _stage(label_top.stage, label_top.conv_head, label_top.bn2)
        self.input_qparams: tuple[float, int] | None = None
        self.eval()
        if calibration is not None:
            quantize_modules(self, calibration)

    def train(self, mode: bool = True) -> "Int8Lite":
        return super().train(False)  # inference only: no BatchNorm left, nothing to train

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem.pad_input(images)
        if self.input_qparams is not None:
            torch.backends.quantized.engine = ENGINE  # the engine the weights were packed for
            scale, zero_point = self.input_qparams
            x = torch.quantize_per_tensor(x.contiguous(memory_format=torch.channels_last), scale, zero_point,
                                          torch.quint8)
        x = self.body(self.stem(x))
        maps = [self.top(x)] + ([] if self.label_top is None else [self.label_top(x)])
        return torch.cat([m.dequantize() if m.is_quantized else m for m in maps], 1)  # (B, D, h, w)


def sites(model: Int8Lite) -> dict[str, nn.Module]:
    """``{site name: module}`` of every activation quantized on its own: the convolutions' outputs and the
    residual sums (the input is :data:`INPUT`)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, ConvAct) or (isinstance(module, Add) and _has_skip(model, name))}


def _has_skip(model: Int8Lite, add_name: str) -> bool:
    return model.get_submodule(add_name.rpartition(".")[0]).has_skip


def quantize_modules(model: Int8Lite, calibration: Calibration) -> None:
    """Swap each float convolution of ``model`` for an 8-bit one (weights per channel, symmetric, bias
    corrected) whose output has its calibrated range; set the residual sums' and the input's ranges."""
    if not int8_available():
        raise ConfigError(f"int8: this PyTorch has no {ENGINE!r} quantized engine "
                          f"(it has {', '.join(torch.backends.quantized.supported_engines)}); use float32")
    ranges, means = calibration.ranges, calibration.means
    wanted = [INPUT, *sites(model)]
    missing = [name for name in wanted if name not in ranges]
    missing += [name for name, module in sites(model).items() if isinstance(module, ConvAct) and name not in means]
    if missing:
        raise ConfigError(f"int8 calibration lacks {len(missing)} of {len(wanted)} activations (e.g. {missing[0]})")
    torch.backends.quantized.engine = ENGINE  # weights are packed for the engine set when they are
    model.input_qparams = _qparams(ranges[INPUT])
    for name, module in sites(model).items():
        if isinstance(module, Add):
            module.qparams = _qparams(ranges[name])
            continue
        mean = means[name]
        if mean.shape != (module.weight.shape[1] * module.groups,):
            raise ConfigError(f"int8 calibration of {name}: {tuple(mean.shape)} channel means, the convolution "
                              f"takes {module.weight.shape[1] * module.groups}")
        module.quantize(_qparams(ranges[name]), mean)


def _qparams(pair: Iterable) -> tuple[float, int]:
    scale, zero_point = pair
    return float(scale), int(zero_point)


# ----------------------------------------------------------------------------- calibration
def calibrate(trunk: EfficientNetLiteFeatures, batches: Iterable[torch.Tensor]) -> Calibration:
    """The :class:`Calibration` of ``trunk`` on ``batches`` of transformed images (B,3,S,S), read from the float
    trunk (BatchNorm folded): histogram observers (unsigned 8 bits, the full range, as PyTorch's static
    quantization uses) and each convolution's mean input per channel."""
    from torch.ao.quantization.observer import HistogramObserver

    model = Int8Lite(trunk)  # float: the same layers, BatchNorm folded
    where = sites(model)
    observers = {name: HistogramObserver(dtype=torch.quint8, reduce_range=False) for name in [INPUT, *where]}
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add_mean(name: str, x: torch.Tensor) -> None:
        total = x.detach().double().sum(dim=(0, 2, 3))  # (C,) over photos and positions
        sums[name] = sums[name] + total if name in sums else total
        counts[name] = counts.get(name, 0) + x[:, 0].numel()

    hooks = [module.register_forward_hook(lambda _m, _i, out, name=name: observers[name](out.detach()))
             for name, module in where.items()]
    hooks += [module.register_forward_pre_hook(lambda _m, args, name=name: add_mean(name, args[0]))
              for name, module in where.items() if isinstance(module, ConvAct)]
    hooks.append(model.stem.register_forward_pre_hook(lambda _m, args: observers[INPUT](args[0].detach())))
    seen = 0
    try:
        with torch.no_grad():
            for images in batches:
                model(images)
                seen += len(images)
    finally:
        for hook in hooks:
            hook.remove()
    if not seen:
        raise ConfigError("int8 calibration needs at least one image")
    ranges = {}
    for name, observer in observers.items():
        scale, zero_point = observer.calculate_qparams()
        ranges[name] = (float(scale), int(zero_point))
    return Calibration(ranges, {name: (total / counts[name]).float() for name, total in sums.items()})


def write_calibration(path: Path, calibration: Calibration, about: dict) -> None:
    """Write ``calibration`` (and ``about``: what was calibrated on what) as JSON, atomically."""
    document = {"format": FORMAT, "engine": ENGINE, **about,
                "ranges": {name: [scale, zero_point] for name, (scale, zero_point) in calibration.ranges.items()},
                "means": {name: [float(f"{v:.5g}") for v in mean.tolist()] for name, mean in calibration.means.items()}}
    data = (json.dumps(document, separators=(",", ":")) + "\n").encode("utf-8")
    atomic_write(path, lambda f: f.write(data), CheckpointError)


def read_calibration(path: Path) -> Calibration:
    """The :class:`Calibration` of a file of :func:`write_calibration` (``CheckpointError`` naming it, one line)."""
    document = read_json(path, MAX_CALIBRATION_BYTES, CheckpointError, "int8 calibration file", expect=dict)
    try:
        if document.get("format") != FORMAT:
            raise ValueError(f"format {document.get('format')!r}, expected {FORMAT}")
        ranges = {str(k): _qparams(v) for k, v in document["ranges"].items()}
        means = {str(k): torch.tensor([float(x) for x in v], dtype=torch.float32) for k, v in document["means"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not an int8 calibration file "
                              f"({type(exc).__name__}: {str(exc)[:120]})") from None
    bad = [k for k, (scale, zero_point) in ranges.items() if not (math.isfinite(scale) and scale > 0)
           or not 0 <= zero_point <= 255]
    bad += [k for k, mean in means.items() if not bool(torch.isfinite(mean).all())]
    if bad:
        raise CheckpointError(f"{path}: int8 calibration of {bad[0]} is out of bounds")
    return Calibration(ranges, means)
