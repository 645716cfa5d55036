"""MobileNetV2: depthwise convolutions and inverted residuals with wide expanded activations."""

from __future__ import annotations

import onnx

from models._builder import GraphBuilder, batch_dim, float_input, logits_output, metadata
from models._layers import batch_norm, conv, linear, relu6

# (expansion t, channels c, repeats n, first stride s), as in the paper and torchvision.
_SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
             (6, 160, 3, 2), (6, 320, 1, 1)]


def build(batch: int = 2, resolution: int = 64, width_mult: float = 0.25,
          num_classes: int = 10, in_channels: int = 3, last_channel: int | None = None,
          seed: int = 0, dynamic_batch: bool = False, bn_training: bool = True
          ) -> onnx.ModelProto:
    """torchvision ``mobilenet_v2``: Conv3x3/2 stem, 17 inverted residual blocks (1x1 expand,
    3x3 depthwise Conv with group=channels, 1x1 linear projection, residual Add when shapes
    match), 1x1 conv to ``last_channel``, GlobalAveragePool, Flatten, Gemm classifier.
    Every conv is followed by BatchNormalization (training mode) and, except projections,
    by ReLU6 written as Clip(x, 0, 6). Names follow torchvision (``features.3.conv.1.0``).

    Options: ``batch``, ``resolution``, ``width_mult`` (channel multiplier, torchvision 1.0;
    channels rounded to multiples of 8), ``num_classes``, ``in_channels``, ``last_channel``
    (default: torchvision's 1280*max(1, width_mult)), ``seed``, ``dynamic_batch``,
    ``bn_training``. Input ``input`` [batch, in_channels, R, R]; output ``logits``
    [batch, num_classes]. Real size: ``width_mult=1.0, resolution=224, num_classes=1000``.
    The small default resolution is 64 so that the last stage stays 2x2 (see resnet.build).
    """
    options = dict(batch=batch, resolution=resolution, width_mult=width_mult,
                   num_classes=num_classes, in_channels=in_channels, last_channel=last_channel,
                   seed=seed, bn_training=bn_training)
    b = GraphBuilder("mobilenetv2", seed)
    n = batch_dim(batch, dynamic_batch)
    x = float_input(b, [n, in_channels, resolution, resolution])
    cin = _divisible(32 * width_mult)
    last = last_channel or _divisible(1280 * max(1.0, width_mult))
    x = _conv_bn(b, x, "features.0", in_channels, cin, 3, 2, 1, bn_training, act=True)
    idx = 1
    for t, c, reps, s in _SETTINGS:
        cout = _divisible(c * width_mult)
        for i in range(reps):
            x = _inverted_residual(b, x, f"features.{idx}", cin, cout, s if i == 0 else 1, t,
                                   bn_training)
            cin, idx = cout, idx + 1
    x = _conv_bn(b, x, f"features.{idx}", cin, last, 1, 1, 1, bn_training, act=True)
    x = b.op("GlobalAveragePool", [x], name="avgpool")
    x = b.op("Flatten", [x], name="flatten", axis=1)
    x = linear(b, x, "classifier.1", last, num_classes, std=0.01)
    logits_output(b, x, [n, num_classes])
    return b.model(build.__doc__ or "", metadata("mobilenetv2", options,
                                                 num_classes=num_classes))


def _divisible(value: float, divisor: int = 8) -> int:
    """torchvision's _make_divisible: round to a multiple of 8, never more than 10% down."""
    new = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * value else new


def _conv_bn(b: GraphBuilder, x: str, name: str, cin: int, cout: int, kernel: int,
             stride: int, groups: int, training: bool, act: bool) -> str:
    y = conv(b, x, f"{name}.0", cin, cout, kernel, stride=stride, groups=groups)
    y = batch_norm(b, y, f"{name}.1", cout, training)
    return relu6(b, y, f"{name}.2") if act else y


def _inverted_residual(b: GraphBuilder, x: str, name: str, cin: int, cout: int, stride: int,
                       expand: int, training: bool) -> str:
    hidden = round(cin * expand)
    y, k = x, 0
    if expand != 1:
        y = _conv_bn(b, y, f"{name}.conv.{k}", cin, hidden, 1, 1, 1, training, act=True)
        k += 1
    y = _conv_bn(b, y, f"{name}.conv.{k}", hidden, hidden, 3, stride, hidden, training,
                 act=True)
    y = conv(b, y, f"{name}.conv.{k + 1}", hidden, cout, 1)
    y = batch_norm(b, y, f"{name}.conv.{k + 2}", cout, training)
    if stride == 1 and cin == cout:
        y = b.op("Add", [x, y], name=f"{name}.add")
    return y
