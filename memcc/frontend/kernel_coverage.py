"""Which ops an ONNX Runtime provider runs with a kernel of their own in a given element type.

Autocast (``frontend.autocast``) decides in which type each op of a step computes; a
provider without a 16-bit kernel for an op cannot run it so. ORT's CPU provider then either
fails to create the session (bfloat16) or wraps the node in Casts to float itself (float16:
``InsertCastTransformer``, which runs even with graph optimizations off), which adds
buffers no plan counted (ORT_NOTES §1). memcc therefore asks here, and computes such a node
in float32 between 16-bit casts itself (``passes.providers.sixteen_bit``), so that the step
planned is the step that runs.

CPU: the answer comes from ORT's kernel registry (``get_all_opkernel_def``: per kernel, its
opset range and the element types of each type constraint), which the installed
onnxruntime exposes. ``benchmarks/kernel_coverage.py`` checks it against what sessions do
(docs/PRECISION.md, "Kernel coverage"), and ``tests/test_kernel_coverage.py`` pins it.

CUDA: listing the CUDA provider's kernels loads every provider library and can kill the
process (``ort_kernels.SAFE_TO_LIST``), and an onnxruntime without CUDA has none to list, so
the answer comes from the table memcc ships, ``memcc/data/ort_cuda_16bit_kernels.json``.
That table was READ FROM ORT'S SOURCE (the registrations of ``RegisterCudaKernels`` in
``onnxruntime/core/providers/cuda/cuda_execution_provider.cc`` and the type constraints of
its untyped kernels, at the commit the file names), NOT MEASURED on a GPU: no GPU was at
hand when it was made. ``benchmarks/kernel_coverage.py --cuda-from-source`` regenerates it.
An op the table does not know answers False: computing in float32 is always possible.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import onnx.defs
from onnx import TensorProto, helper

from memcc.frontend.ort_kernels import CPU, SAFE_TO_LIST

PROVIDER_NAMES = {"cpu": CPU, "cuda": "CUDAExecutionProvider"}
CUDA_TABLE = Path(__file__).resolve().parent.parent / "data" / "ort_cuda_16bit_kernels.json"
_FLOAT_TYPES = frozenset({"tensor(float)", "tensor(float16)", "tensor(bfloat16)",
                          "tensor(double)"})
_TABLE_NAMES = {TensorProto.BFLOAT16: "bfloat16", TensorProto.FLOAT16: "float16"}
Ranges = list[tuple[int, int, dict]]


@lru_cache(maxsize=4)
def _registry(provider: str) -> dict[tuple[str, str], Ranges] | None:
    """(domain, op) -> [(first opset, last opset, {constraint: element type names})] of
    ``provider``'s kernels, or None when this onnxruntime cannot list them (a provider it
    does not have, or one whose listing is unsafe)."""
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state
        available = set(onnxruntime.get_available_providers())
        if provider not in available or available - SAFE_TO_LIST:
            return None
        defs = _pybind_state.get_all_opkernel_def()
    except (ImportError, AttributeError, RuntimeError):
        return None
    out: dict[tuple[str, str], Ranges] = {}
    for d in defs:
        if d.provider == provider:
            domain = "" if d.domain == "ai.onnx" else d.domain
            lo, hi = d.version_range
            out.setdefault((domain, d.op_name), []).append(
                (int(lo), int(hi), dict(d.type_constraints)))
    return out


@lru_cache(maxsize=1)
def cuda_table() -> dict:
    """The shipped CUDA table (read from ORT's source, not measured): its header fields and
    ``ops``: ONNX-domain op -> [[first opset, last opset or None, [16-bit type names]]]."""
    return json.loads(CUDA_TABLE.read_text())


def _type_name(dtype: int) -> str:
    return f"tensor({helper.tensor_dtype_to_string(dtype).removeprefix('TensorProto.').lower()})"


def _schema(op_type: str, opset: int, domain: str):
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except Exception:  # noqa: BLE001 - an op or opset this onnx does not know
        return None


@lru_cache(maxsize=1024)  # asked once per node by autocast and the 16-bit pass
def float_constraint(op_type: str, opset: int, domain: str = "") -> str | None:
    """The name of the type constraint that carries ``op_type``'s floating-point data: its
    first output's when that admits float (Add: T, Cast: T2), else the first input's that
    does (Shape: T, Equal: T, ArgMax: T, IsNaN: T1), so that an op whose output is an
    integer or a bool is asked about the type it reads. None for an op this onnx does not
    know or one without a float constraint."""
    schema = _schema(op_type, opset, domain)
    if schema is None:
        return None
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    for formal in [*schema.outputs[:1], *schema.inputs]:
        if allowed.get(formal.type_str, set()) & _FLOAT_TYPES:
            return formal.type_str
    return None


def _cuda_has(op_type: str, since: int, dtype: int, domain: str) -> bool:
    """The shipped table's answer. It lists the 16-bit types only: any other type answers
    False, as an op outside the ONNX domain does."""
    wanted = _TABLE_NAMES.get(dtype)
    if domain or wanted is None:
        return False
    for lo, hi, types in cuda_table()["ops"].get(op_type, ()):
        if lo <= since <= (hi if hi is not None else since) and wanted in types:
            return True
    return False


def has_kernel_for(op_type: str, opset: int, dtype: int, provider: str = "cpu",
                   domain: str = "") -> bool:
    """Whether ``provider`` ("cpu" or "cuda") runs ``op_type`` of a model at ``opset`` with
    its float constraint (``float_constraint``) bound to ``dtype``, with a kernel of its own.
    CPU asks the installed onnxruntime's registry; CUDA the shipped table (read from ORT's
    source, not measured) wherever the registry cannot be listed."""
    schema = _schema(op_type, opset, domain)
    since = schema.since_version if schema is not None else opset
    registry = _registry(PROVIDER_NAMES.get(provider, provider))
    if registry is None:
        return provider == "cuda" and _cuda_has(op_type, since, dtype, domain)
    constraint = float_constraint(op_type, opset, domain)
    wanted = _type_name(dtype)
    for lo, hi, types in registry.get((domain, op_type), ()):
        if lo <= since <= hi and (constraint is None or wanted in types.get(constraint, ())):
            return True
    return False


def has_kernel_bound(op_type: str, opset: int, bound: dict[str, int], provider: str = "cpu",
                     domain: str = "") -> bool:
    """Whether ``provider`` has a kernel for ``op_type`` at ``opset`` whose type
    constraints admit ``bound`` (constraint name -> element type, as the node's values
    bind them: a ``Greater`` of bfloat16 operands binds T to bfloat16, T1 to bool). Where
    the registry cannot be listed (CUDA), the shipped table is asked about each 16-bit type
    the node binds, whichever constraint binds it: it lists an op's 16-bit types only, so a
    ``Cast`` from bfloat16 to float32 is asked about bfloat16 (its float constraint, T2, is
    float32, which the table does not list: asking that marked every such Cast as having no
    kernel). A node binding no 16-bit type is asked about its float constraint's type."""
    registry = _registry(PROVIDER_NAMES.get(provider, provider))
    if registry is None:
        sixteen = {t for t in bound.values() if t in _TABLE_NAMES}
        if sixteen:
            return all(has_kernel_for(op_type, opset, t, provider, domain) for t in sixteen)
        constraint = float_constraint(op_type, opset, domain)
        dtype = bound.get(constraint or "", TensorProto.FLOAT)
        return has_kernel_for(op_type, opset, dtype, provider, domain)
    schema = _schema(op_type, opset, domain)
    since = schema.since_version if schema is not None else opset
    for lo, hi, types in registry.get((domain, op_type), ()):
        if lo <= since <= hi and all(_type_name(t) in types.get(c, (_type_name(t),))
                                     for c, t in bound.items()):
            return True
    return False


def coverage_table(provider: str, ops: list[str] | tuple[str, ...], opset: int,
                   domain: str = "") -> list[dict]:
    """One row per op: ``{"op", "opset", "provider", "bfloat16", "float16", "source"}``,
    the two types answered by ``has_kernel_for``; ``source`` says where the answer came from
    ("registry" or the CUDA table's "source, not measured: <commit>")."""
    listed = _registry(PROVIDER_NAMES.get(provider, provider)) is not None
    source = "registry" if listed else (
        f"source, not measured: {cuda_table()['commit'][:12]}" if provider == "cuda"
        else "none")
    return [{"op": op, "opset": opset, "provider": provider,
             "bfloat16": has_kernel_for(op, opset, TensorProto.BFLOAT16, provider, domain),
             "float16": has_kernel_for(op, opset, TensorProto.FLOAT16, provider, domain),
             "source": source} for op in ops]
