"""Which ONNX ops ONNX Runtime runs with a kernel of its own, and which it expands.

An ONNX op that ORT has no kernel for at the model's opset, but that the ONNX standard
defines as a function of other ops (``HardSwish``, ``Mish``, ``Bernoulli``,
``GroupNormalization``-21, ``Swish``...), still runs: ORT inlines the function body when it
creates the session. The inlined nodes get new names and the highest node indices, so
they run after everything that was ready before them, and their intermediate values are
buffers that no plan counted. Measured on torchvision's MobileNetV3 (a ``HardSwish`` after
every block): the executed order left the plan at its first ``HardSwish`` and the step
peaked 29% above the prediction. memcc therefore expands such ops itself when it loads a
model (``frontend.function_ops.expand_function_ops``), so that the graph it plans is the
graph ORT runs.

The answer comes from ORT's own kernel registry (``get_all_opkernel_def``, in ORT's
``capi._pybind_state`` module; not part of ORT's documented API, so an ORT without it falls
back to the list measured for onnxruntime 1.31, ``INLINED_BY_ORT_1_31``). A test pins both
against what ORT does (``tests/test_ort_facts.py``).
"""

from __future__ import annotations

from functools import lru_cache

import onnx.defs

CPU = "CPUExecutionProvider"
# Builds whose providers are all among these can list their kernels. On onnxruntime-gpu
# 1.31.1 (measured on an H100), listing them loads every provider library, TensorRT's
# included, and the process dies with a segmentation fault where TensorRT is not installed.
SAFE_TO_LIST = frozenset({CPU, "AzureExecutionProvider"})
# The ONNX-domain ops that onnxruntime 1.31.1's CPU provider has no kernel for at any opset
# up to 24 and that ONNX defines as functions (Constant is never run: ORT turns it into an
# initializer).
INLINED_BY_ORT_1_31 = frozenset({
    "Bernoulli", "CastLike", "CenterCropPad", "GroupNormalization", "HardSwish", "Mish",
    "NegativeLogLikelihoodLoss", "SequenceMap", "SoftmaxCrossEntropyLoss", "Swish",
})


@lru_cache(maxsize=4)
def _registry(provider: str) -> dict[str, tuple[tuple[int, int], ...]] | None:
    """ONNX-domain op -> the opset ranges ORT's ``provider`` has kernels for, or None when
    this onnxruntime does not expose its registry."""
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state
        if set(onnxruntime.get_available_providers()) - SAFE_TO_LIST:
            return None
        defs = _pybind_state.get_all_opkernel_def()
    except (ImportError, AttributeError, RuntimeError):
        return None
    ranges: dict[str, set[tuple[int, int]]] = {}
    for d in defs:
        if d.provider == provider and d.domain in ("", "ai.onnx"):
            lo, hi = d.version_range
            ranges.setdefault(d.op_name, set()).add((int(lo), int(hi)))
    return {op: tuple(sorted(r)) for op, r in ranges.items()}


def has_kernel(op_type: str, opset: int, provider: str = CPU) -> bool:
    """Whether ORT runs an ONNX-domain ``op_type`` of a model at ``opset`` with a kernel of
    its own (True for ops this ONNX release does not know: ORT decides about those)."""
    try:
        since = onnx.defs.get_schema(op_type, opset, "").since_version
    except Exception:  # noqa: BLE001 - an unknown op or opset: not ours to expand
        return True
    registry = _registry(provider)
    if registry is None:
        return op_type not in INLINED_BY_ORT_1_31
    return any(lo <= since <= hi for lo, hi in registry.get(op_type, ()))


def inlined_by_ort(op_types: set[str] | frozenset[str], opset: int,
                   provider: str = CPU) -> frozenset[str]:
    """The ops among ``op_types`` that ORT would inline as their ONNX function body."""
    return frozenset(op for op in op_types if op != "Constant" and
                     not has_kernel(op, opset, provider))
