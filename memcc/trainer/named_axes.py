"""The exported forward model with the named axes the user's model had (``memcc export``).

``frontend/symbolic_dims.py`` records them; here they are written back and checked: the
model is run once in ONNX Runtime with every named axis at another size (1, or 2 where the
step was built at 1) on zeros, and kept only where it runs and its outputs follow the new
sizes. The shape computations memcc folded at build are put back first
(``fold.with_shape_computations``, by ``trainer/export.py``), and row-chunked regions
computed whole (``whole_rows``, an MLP on flat rows included); where a rewrite of memcc's
own still holds the built sizes the model stays at them and export says why.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from memcc.frontend.load import ort_reason, run_quietly
from memcc.frontend.symbolic_dims import relax

OWN_REWRITE = "a rewrite memcc made at the built sizes"
FOLDED_BEFORE = ("memcc folded its shape computations at the built sizes, and this step "
                 "was built before memcc kept what it folded: built again, it may keep its "
                 "axes")


def with_named_axes(model: onnx.ModelProto, axes: dict[str, list[str | None]],
                    reason: str = OWN_REWRITE) -> tuple[onnx.ModelProto, str | None]:
    """``model`` with ``axes`` written back where it runs so, else as it is, and what to
    tell the user in that case (None: nothing), with ``reason``: why it may not run."""
    relaxed, bound = relax(model, axes)
    if not bound:
        return model, None
    trial = {name: 1 if size != 1 else 2 for name, size in bound.items()}
    at = ", ".join(f"{n}={v}" for n, v in trial.items())
    built = ", ".join(f"{n}={v}" for n, v in bound.items())
    failed = _fails_at(relaxed, axes, trial)
    if failed is None:
        return relaxed, None
    return model, (f"the model is written at the sizes it was built for ({built}), not with "
                   f"its named axes: at {at} {failed} ({reason}). To deploy at other "
                   "sizes, load the weights (--format safetensors) into the PyTorch "
                   "module, or build and train at that size")


def _fails_at(model: onnx.ModelProto, axes: dict[str, list[str | None]],
              trial: dict[str, int]) -> str | None:
    """Why ``model`` does not run at the ``trial`` sizes (None: it does, and its outputs
    have those sizes on their named axes)."""
    feeds = {}
    for vi in model.graph.input:
        dims = [trial[d.dim_param] if d.dim_param else int(d.dim_value)
                for d in vi.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        feeds[vi.name] = np.zeros(dims, dtype)
    try:
        _, results = run_quietly(model, feeds)
    except Exception as exc:  # noqa: BLE001  (any failure means: keep the built sizes)
        said = ort_reason(exc)
        if len(said) > 200:  # at a word's end
            said = said[:200].rsplit(" ", 1)[0] + " ..."
        return f"ONNX Runtime failed: {said}"
    for vi, value in zip(model.graph.output, results, strict=True):
        # An output's axis named by the exporter alone (TorchScript's 'MatMullogits_dim_0'
        # where dynamic_axes named none there) has no size to check.
        for k, name in enumerate(axes.get(vi.name) or ()):
            if name in trial and (k >= value.ndim or value.shape[k] != trial[name]):
                return (f"output '{vi.name}' came out {list(value.shape)}, not {name}="
                        f"{trial[name]} on axis {k}")
    return None
