"""U-Net: long-lived skip connections, the case where keeping activations costs most."""

from __future__ import annotations

import math

import onnx

from models._builder import GraphBuilder, batch_dim, float_input, logits_output, metadata
from models._layers import batch_norm, conv, relu


def build(batch: int = 2, resolution: int = 32, width: int = 8, depth: int = 3,
          num_classes: int = 4, in_channels: int = 3, seed: int = 0,
          dynamic_batch: bool = False, bn_training: bool = True) -> onnx.ModelProto:
    """The U-Net of Ronneberger et al. with padded convolutions and BatchNorm (as in the
    common ``milesial/Pytorch-UNet``): ``depth`` encoder stages of double Conv3x3+BN+ReLU and
    2x2 MaxPool, a bottleneck, and decoder stages that upsample with ConvTranspose (2x2,
    stride 2), Concat the matching encoder output on channels and apply a double conv. A 1x1
    Conv gives class scores, transposed NCHW -> NHWC so that the output ``logits`` is
    [batch, R, R, num_classes] and cross-entropy applies over the last axis.

    Options: ``batch``, ``resolution`` (multiple of 2**depth), ``width`` (channels of the
    first stage, doubled per stage; original 64), ``depth`` (number of downsamplings;
    original 4), ``num_classes``, ``in_channels``, ``seed``, ``dynamic_batch``,
    ``bn_training``. Input ``input`` [batch, in_channels, R, R].
    Real size: ``width=64, depth=4, resolution=256`` (31M parameters).
    """
    if resolution % 2**depth:
        raise ValueError(f"resolution {resolution} must be a multiple of 2**depth={2**depth}")
    options = dict(batch=batch, resolution=resolution, width=width, depth=depth,
                   num_classes=num_classes, in_channels=in_channels, seed=seed,
                   bn_training=bn_training)
    b = GraphBuilder("unet", seed)
    n = batch_dim(batch, dynamic_batch)
    x = float_input(b, [n, in_channels, resolution, resolution])
    skips: list[tuple[str, int]] = []
    cin = in_channels
    for i in range(depth):
        x = _double_conv(b, x, f"down{i}", cin, width * 2**i, bn_training)
        cin = width * 2**i
        skips.append((x, cin))
        x = b.op("MaxPool", [x], name=f"down{i}.pool", kernel_shape=[2, 2], strides=[2, 2])
    x = _double_conv(b, x, "bottleneck", cin, width * 2**depth, bn_training)
    cin = width * 2**depth
    for i in reversed(range(depth)):
        skip, cskip = skips[i]
        x = _up(b, x, f"up{i}.upconv", cin, cskip)
        x = b.op("Concat", [skip, x], name=f"up{i}.concat", axis=1)
        x = _double_conv(b, x, f"up{i}", 2 * cskip, cskip, bn_training)
        cin = cskip
    x = conv(b, x, "head", cin, num_classes, 1, bias=True)
    x = b.op("Transpose", [x], name="to_nhwc", perm=[0, 2, 3, 1])
    logits_output(b, x, [n, resolution, resolution, num_classes])
    return b.model(build.__doc__ or "", metadata("unet", options, num_classes=num_classes))


def _double_conv(b: GraphBuilder, x: str, name: str, cin: int, cout: int,
                 training: bool) -> str:
    x = conv(b, x, f"{name}.conv1", cin, cout, 3)
    x = relu(b, batch_norm(b, x, f"{name}.bn1", cout, training))
    x = conv(b, x, f"{name}.conv2", cout, cout, 3)
    return relu(b, batch_norm(b, x, f"{name}.bn2", cout, training))


def _up(b: GraphBuilder, x: str, name: str, cin: int, cout: int) -> str:
    """ConvTranspose 2x2/2: doubles the resolution (weight [C_in, C_out, kH, kW]). Windows do
    not overlap, so each output pixel sums ``cin`` products: He init uses fan-in ``cin``."""
    w = b.normal(f"{name}.weight", [cin, cout, 2, 2], math.sqrt(2.0 / cin))
    bias = b.zeros(f"{name}.bias", [cout])
    return b.op("ConvTranspose", [x, w, bias], name=name, kernel_shape=[2, 2],
                strides=[2, 2])
