"""ResNet-18/50 in the torchvision layout (v1.5: stride on the 3x3 conv of a bottleneck)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from models._builder import GraphBuilder, batch_dim, float_input, logits_output, metadata
from models._layers import batch_norm, conv, linear, relu


def build(arch: str = "resnet18", batch: int = 2, resolution: int = 64, width: int = 16,
          num_classes: int = 10, in_channels: int = 3, blocks: Sequence[int] | None = None,
          seed: int = 0, dynamic_batch: bool = False, bn_training: bool = True
          ) -> onnx.ModelProto:
    """torchvision ``resnet18`` (basic blocks) or ``resnet50`` (bottleneck blocks).

    Conv without bias, BatchNormalization (``bn_training``: training_mode=1, batch statistics,
    running stats as initializers ``*.running_mean/var``), ReLU, 3x3/2 MaxPool stem, residual
    Add, GlobalAveragePool, Flatten, Gemm ``fc``. Parameter names match torchvision
    (``layer1.0.conv1.weight``, ``layer2.0.downsample.0.weight``, ``fc.bias``, ...).

    Options: ``arch`` ("resnet18" | "resnet50"), ``batch``, ``resolution`` (square input),
    ``width`` (channels of the stem and of layer1; torchvision uses 64), ``num_classes``,
    ``in_channels``, ``blocks`` (blocks per stage; default [2,2,2,2] or [3,4,6,3], e.g.
    [3,4,23,3] gives ResNet-101), ``seed``, ``dynamic_batch``, ``bn_training``.
    Input ``input`` [batch, in_channels, R, R]; output ``logits`` [batch, num_classes].
    Real size: ``width=64, resolution=224, num_classes=1000`` (e.g. ``batch=32``).
    The small default resolution is 64, not 32: the last stage then stays 2x2, whereas at 1x1
    with batch 2 training-mode BN normalises 2 values per channel, which amplifies rounding
    until ORT and torch disagree in the second digit.
    """
    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {sorted(_ARCHS)}, not {arch!r}")
    bottleneck, default_blocks = _ARCHS[arch]
    blocks = list(blocks or default_blocks)
    options = dict(arch=arch, batch=batch, resolution=resolution, width=width,
                   num_classes=num_classes, in_channels=in_channels, blocks=blocks, seed=seed,
                   bn_training=bn_training)
    b = GraphBuilder(arch, seed)
    n = batch_dim(batch, dynamic_batch)
    x = float_input(b, [n, in_channels, resolution, resolution])
    x = conv(b, x, "conv1", in_channels, width, 7, stride=2, pad=3)
    x = relu(b, batch_norm(b, x, "bn1", width, bn_training))
    x = b.op("MaxPool", [x], name="maxpool", kernel_shape=[3, 3], strides=[2, 2],
             pads=[1, 1, 1, 1])
    cin = width
    block = _bottleneck if bottleneck else _basic
    for stage, count in enumerate(blocks):
        planes = width * 2**stage
        for j in range(count):
            stride = 2 if stage > 0 and j == 0 else 1
            x, cin = block(b, x, f"layer{stage + 1}.{j}", cin, planes, stride, bn_training)
    x = b.op("GlobalAveragePool", [x], name="avgpool")
    x = b.op("Flatten", [x], name="flatten", axis=1)
    x = linear(b, x, "fc", cin, num_classes, std=cin**-0.5)
    logits_output(b, x, [n, num_classes])
    return b.model(build.__doc__ or "", metadata(arch, options, num_classes=num_classes))


def build_resnet18(**options) -> onnx.ModelProto:
    """ResNet-18; see ``models.resnet.build`` for the options."""
    return build(arch="resnet18", **options)


def build_resnet50(**options) -> onnx.ModelProto:
    """ResNet-50; see ``models.resnet.build`` for the options."""
    return build(arch="resnet50", **options)


def _basic(b: GraphBuilder, x: str, name: str, cin: int, planes: int, stride: int,
           training: bool) -> tuple[str, int]:
    y = conv(b, x, f"{name}.conv1", cin, planes, 3, stride=stride)
    y = relu(b, batch_norm(b, y, f"{name}.bn1", planes, training))
    y = conv(b, y, f"{name}.conv2", planes, planes, 3)
    y = batch_norm(b, y, f"{name}.bn2", planes, training)
    return _residual(b, x, y, name, cin, planes, stride, training), planes


def _bottleneck(b: GraphBuilder, x: str, name: str, cin: int, planes: int, stride: int,
                training: bool) -> tuple[str, int]:
    cout = planes * 4
    y = conv(b, x, f"{name}.conv1", cin, planes, 1)
    y = relu(b, batch_norm(b, y, f"{name}.bn1", planes, training))
    y = conv(b, y, f"{name}.conv2", planes, planes, 3, stride=stride)
    y = relu(b, batch_norm(b, y, f"{name}.bn2", planes, training))
    y = conv(b, y, f"{name}.conv3", planes, cout, 1)
    y = batch_norm(b, y, f"{name}.bn3", cout, training)
    return _residual(b, x, y, name, cin, cout, stride, training), cout


def _residual(b: GraphBuilder, x: str, y: str, name: str, cin: int, cout: int, stride: int,
              training: bool) -> str:
    if stride != 1 or cin != cout:
        x = conv(b, x, f"{name}.downsample.0", cin, cout, 1, stride=stride)
        x = batch_norm(b, x, f"{name}.downsample.1", cout, training)
    s = b.op("Add", [y, x], name=f"{name}.add")
    return relu(b, s, f"{name}.relu")


_ARCHS = {"resnet18": (False, (2, 2, 2, 2)), "resnet50": (True, (3, 4, 6, 3))}
