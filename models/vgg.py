"""VGG-16 (configuration D): a long plain chain of 3x3 convolutions with large activations."""

from __future__ import annotations

import onnx

from models._builder import GraphBuilder, batch_dim, float_input, logits_output, metadata
from models._layers import batch_norm, conv, linear, relu

_CFG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
          512, 512, 512, "M"]


def build(batch: int = 2, resolution: int = 32, width: int = 8, hidden: int = 64,
          num_classes: int = 10, in_channels: int = 3, batch_norm_layers: bool = False,
          seed: int = 0, dynamic_batch: bool = False) -> onnx.ModelProto:
    """torchvision ``vgg16`` (or ``vgg16_bn`` with ``batch_norm_layers``): 13 Conv3x3+ReLU
    layers in 5 stages closed by 2x2 MaxPool, then Flatten and a 3-layer Gemm classifier
    (``classifier.0/3/6``; dropout left out). torchvision's adaptive 7x7 average pool is left
    out too: at 224x224 it is an identity, elsewhere the classifier takes C*(R/32)^2 features.

    Options: ``batch``, ``resolution`` (multiple of 32), ``width`` (channels of the first
    stage; all stages scale with it, torchvision uses 64), ``hidden`` (classifier width,
    torchvision 4096), ``num_classes``, ``in_channels``, ``batch_norm_layers`` (BN after each
    conv, training mode), ``seed``, ``dynamic_batch``.
    Input ``input`` [batch, in_channels, R, R]; output ``logits`` [batch, num_classes].
    Real size: ``width=64, hidden=4096, resolution=224, num_classes=1000`` (138M parameters).
    """
    if resolution % 32:
        raise ValueError(f"resolution must be a multiple of 32, not {resolution}")
    options = dict(batch=batch, resolution=resolution, width=width, hidden=hidden,
                   num_classes=num_classes, in_channels=in_channels,
                   batch_norm_layers=batch_norm_layers, seed=seed)
    b = GraphBuilder("vgg16", seed)
    n = batch_dim(batch, dynamic_batch)
    x = float_input(b, [n, in_channels, resolution, resolution])
    cin, idx = in_channels, 0
    for item in _CFG16:
        if item == "M":
            x = b.op("MaxPool", [x], name=f"features.{idx}", kernel_shape=[2, 2],
                     strides=[2, 2])
            idx += 1
            continue
        cout = max(1, int(item) * width // 64)
        x = conv(b, x, f"features.{idx}", cin, cout, 3, bias=True)
        if batch_norm_layers:
            x = batch_norm(b, x, f"features.{idx + 1}", cout)
            idx += 1
        x = relu(b, x, f"features.{idx + 1}")
        idx += 2
        cin = cout
    x = b.op("Flatten", [x], name="flatten", axis=1)
    feats = cin * (resolution // 32) ** 2
    # torchvision's init for the classifier, normal(0, 0.01): with He init a plain 16-layer
    # net without normalisation starts with gradients too large for plain SGD.
    x = relu(b, linear(b, x, "classifier.0", feats, hidden, std=0.01), "classifier.1")
    x = relu(b, linear(b, x, "classifier.3", hidden, hidden, std=0.01), "classifier.4")
    x = linear(b, x, "classifier.6", hidden, num_classes, std=0.01)
    logits_output(b, x, [n, num_classes])
    return b.model(build.__doc__ or "", metadata("vgg16", options, num_classes=num_classes))
