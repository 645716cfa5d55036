"""Model zoo: forward ONNX models built with onnx.helper + numpy (no downloads, no torch).

``build_model(name, **options)`` returns an ``onnx.ModelProto`` (opset 17) whose inputs are
``input`` (float) or ``input_ids`` (+ ``attention_mask``) and whose one output is ``logits``,
shaped so that cross-entropy over the last axis is the natural loss. Defaults are tiny (tests);
``preset=`` or explicit options give benchmark sizes. ``make_feeds`` / ``make_labels`` make a
matching synthetic batch. Command line: ``python -m models NAME -o FILE.onnx [options]``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from models import bert, gpt2, mlp, mobilenetv2, resnet, unet, vgg
from models._builder import META_PREFIX

Builder = Callable[..., onnx.ModelProto]

MODELS: dict[str, Builder] = {
    "mlp": mlp.build,
    "resnet18": resnet.build_resnet18,
    "resnet50": resnet.build_resnet50,
    "vgg16": vgg.build,
    "mobilenetv2": mobilenetv2.build,
    "unet": unet.build,
    "gpt2": gpt2.build,
    "bert": bert.build,
}

# The builder function whose signature and docstring describe each model's options.
SIGNATURES: dict[str, Builder] = {**MODELS, "resnet18": resnet.build, "resnet50": resnet.build}

_IMAGENET = dict(resolution=224, num_classes=1000, batch=32)

# Benchmark sizes; explicit options override a preset's values.
PRESETS: dict[str, dict[str, dict[str, object]]] = {
    "mlp": {"large": dict(batch=512, in_features=4096, width=4096, depth=16, num_classes=1000)},
    "resnet18": {"imagenet": dict(width=64, **_IMAGENET)},
    "resnet50": {"imagenet": dict(width=64, **_IMAGENET)},
    "vgg16": {"imagenet": dict(width=64, hidden=4096, **_IMAGENET)},
    "mobilenetv2": {"imagenet": dict(width_mult=1.0, **_IMAGENET)},
    "unet": {"original": dict(width=64, depth=4, resolution=256, batch=8, num_classes=2)},
    "gpt2": {
        "gpt2": dict(width=768, depth=12, heads=12, vocab_size=50257, seq_len=1024, batch=8),
        "gpt2-medium": dict(width=1024, depth=24, heads=16, vocab_size=50257, seq_len=1024,
                            batch=4),
    },
    "bert": {"bert-base": dict(width=768, depth=12, heads=12, vocab_size=30522, seq_len=512,
                               batch=16, num_labels=2)},
}


def build_model(name: str, preset: str | None = None, **options) -> onnx.ModelProto:
    """Build zoo model ``name``; ``preset`` (see ``PRESETS``) fills options not given."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    if preset is not None:
        known = PRESETS.get(name, {})
        if preset not in known:
            raise KeyError(f"{name} has no preset {preset!r}; known: {sorted(known) or 'none'}")
        options = {**known[preset], **options}
    return MODELS[name](**options)


def model_meta(model: onnx.ModelProto) -> dict[str, object]:
    """The ``memcc.zoo.*`` metadata a zoo builder stamped on the model, JSON decoded."""
    meta: dict[str, object] = {}
    for prop in model.metadata_props:
        if prop.key.startswith(META_PREFIX):
            key = prop.key[len(META_PREFIX):]
            try:
                meta[key] = json.loads(prop.value)
            except json.JSONDecodeError:
                meta[key] = prop.value
    return meta


def make_feeds(model: onnx.ModelProto, seed: int = 0,
               dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """A synthetic batch for a zoo model: normal floats, token ids below ``vocab_size``,
    and an attention mask that pads the tail of every other sequence (so masking matters).

    ``dims`` binds symbolic dimensions (e.g. ``{"batch": 8}`` for ``dynamic_batch`` models).
    """
    rng = np.random.default_rng(seed)
    meta = model_meta(model)
    inits = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = _shape(vi, dims or {})
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        if vi.name == "attention_mask":
            feeds[vi.name] = _padding_mask(shape)
        elif np.issubdtype(dtype, np.integer):
            high = int(meta.get("vocab_size", 2)) if vi.name == "input_ids" else 2
            feeds[vi.name] = rng.integers(0, high, size=shape).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def make_labels(model: onnx.ModelProto, seed: int = 0,
                dims: dict[str, int] | None = None) -> np.ndarray:
    """int64 class labels shaped like ``logits`` without its last axis."""
    out = model.graph.output[0]
    shape = _shape(out, dims or {})
    return np.random.default_rng(seed + 1).integers(0, shape[-1], size=shape[:-1]).astype(
        np.int64)


def _shape(vi: onnx.ValueInfoProto, dims: dict[str, int]) -> tuple[int, ...]:
    out = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(d.dim_value)
        elif d.dim_param in dims:
            out.append(dims[d.dim_param])
        else:
            raise ValueError(f"{vi.name}: bind symbolic dimension {d.dim_param!r} with dims=")
    return tuple(out)


def _padding_mask(shape: tuple[int, ...]) -> np.ndarray:
    mask = np.ones(shape, np.int64)
    if len(shape) == 2 and shape[1] > 1:
        mask[1::2, shape[1] - max(1, shape[1] // 4):] = 0
    return mask


__all__ = ["MODELS", "PRESETS", "build_model", "make_feeds", "make_labels", "model_meta"]
