"""Which ops an ONNX Runtime provider runs with a kernel of their own in a given element type.

Autocast (``frontend.autocast``) decides in which type each op of a step computes; a
provider without a 16-bit kernel for an op cannot run it so. ORT's CPU provider then either
fails to create the session (bfloat16) or wraps the node in Casts to float itself (float16:
``InsertCastTransformer``), which adds buffers no plan counted (ORT_NOTES §1). memcc
therefore asks here, and computes such a node in float32 between 16-bit casts itself
(``passes.providers.sixteen_bit``), so that the step planned is the step that runs.

The answer comes from ORT's kernel registry (``get_all_opkernel_def``: per kernel, its
opset range and the element types of each type constraint), which the installed
onnxruntime exposes for the CPU provider. A provider this onnxruntime cannot list (CUDA,
where listing loads every provider library: ``ort_kernels.SAFE_TO_LIST``) answers from the
table shipped for it (``CUDA_16BIT``), or, without one, False: computing in float32 is
always possible.
"""

from __future__ import annotations

from functools import lru_cache

import onnx.defs
from onnx import TensorProto, helper

from memcc.frontend.ort_kernels import CPU, SAFE_TO_LIST

PROVIDER_NAMES = {"cpu": CPU, "cuda": "CUDAExecutionProvider"}
# ONNX-domain op -> the 16-bit types ORT's CUDA provider has kernels for (the type of the
# op's main float constraint), where this onnxruntime cannot list CUDA's kernels.
CUDA_16BIT: dict[str, frozenset[int]] = {}


@lru_cache(maxsize=4)
def _registry(provider: str) -> dict[tuple[str, str], list[tuple[int, int, dict]]] | None:
    """(domain, op) -> [(first opset, last opset, {constraint: element type names})] of
    ``provider``'s kernels, or None when this onnxruntime cannot list them."""
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state
        if set(onnxruntime.get_available_providers()) - SAFE_TO_LIST:
            return None
        defs = _pybind_state.get_all_opkernel_def()
    except (ImportError, AttributeError, RuntimeError):
        return None
    out: dict[tuple[str, str], list[tuple[int, int, dict]]] = {}
    for d in defs:
        if d.provider == provider:
            domain = "" if d.domain == "ai.onnx" else d.domain
            lo, hi = d.version_range
            out.setdefault((domain, d.op_name), []).append(
                (int(lo), int(hi), dict(d.type_constraints)))
    return out


def _type_name(dtype: int) -> str:
    return f"tensor({helper.tensor_dtype_to_string(dtype).removeprefix('TensorProto.').lower()})"


def float_constraint(op_type: str, opset: int, domain: str = "") -> str | None:
    """The name of the type constraint of ``op_type``'s first output (the type it computes
    in), or None for an op this onnx release does not know."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except Exception:  # noqa: BLE001 - an op this onnx does not know
        return None
    return schema.outputs[0].type_str if schema.outputs else None


def has_kernel_for(op_type: str, opset: int, dtype: int, provider: str = "cpu",
                   domain: str = "") -> bool:
    """Whether ``provider`` ("cpu" or "cuda") runs ``op_type`` at ``opset`` with its output
    type constraint bound to ``dtype``."""
    name = PROVIDER_NAMES.get(provider, provider)
    registry = _registry(name)
    if registry is None:
        return dtype in CUDA_16BIT.get(op_type, frozenset()) if provider == "cuda" \
            and not domain else False
    try:
        since = onnx.defs.get_schema(op_type, opset, domain).since_version
    except Exception:  # noqa: BLE001 - unknown op: only the registry can say
        since = opset
    constraint = float_constraint(op_type, opset, domain)
    wanted = _type_name(dtype)
    for lo, hi, types in registry.get((domain, op_type), ()):
        if lo <= since <= hi and (constraint is None or wanted in types.get(constraint, ())):
            return True
    return False


SIXTEEN_BIT = (TensorProto.BFLOAT16, TensorProto.FLOAT16)


def has_kernel_bound(op_type: str, opset: int, bound: dict[str, int], provider: str = "cpu",
                     domain: str = "") -> bool:
    """Whether ``provider`` has a kernel for ``op_type`` at ``opset`` whose type
    constraints admit ``bound`` (constraint name -> element type, as the node's values
    bind them: a ``Greater`` of bfloat16 operands binds T to bfloat16, T1 to bool). Where
    the registry cannot be listed, only the constraint of the first output is asked
    (``has_kernel_for``)."""
    name = PROVIDER_NAMES.get(provider, provider)
    registry = _registry(name)
    if registry is None:
        constraint = float_constraint(op_type, opset, domain)
        dtype = bound.get(constraint or "", TensorProto.FLOAT)
        return has_kernel_for(op_type, opset, dtype, provider, domain)
    try:
        since = onnx.defs.get_schema(op_type, opset, domain).since_version
    except Exception:  # noqa: BLE001 - unknown op: only the registry can say
        since = opset
    for lo, hi, types in registry.get((domain, op_type), ()):
        if lo <= since <= hi and all(_type_name(t) in types.get(c, (_type_name(t),))
                                     for c, t in bound.items()):
            return True
    return False
