"""The exported model's symbolic axes, kept through the build for ``memcc export``.

memcc binds every symbolic dimension (``--dim batch=8``) and plans the step at those sizes;
the forward model ``memcc export`` writes out of the step would then take only that batch,
where the model the user exported took any. So ``load_graph`` records each graph input's
and output's axes as the exporter wrote them (``memcc.symbolic_dims``: name -> one entry
per axis, the dimension's name or null), and ``relax`` writes them back into a model.
Whether the written model really runs at other sizes is the export's to check
(``trainer/export.py``): memcc folds shape computations at the bound sizes, so a reshape to
``[8, 16, 12, 64]`` holds the batch in a constant until export puts the exporter's
computation back (``fold.with_shape_computations``).
"""

from __future__ import annotations

import json

import onnx

SYMBOLIC_DIMS_KEY = "memcc.symbolic_dims"


def symbolic_dims_of(model: onnx.ModelProto) -> dict[str, list[str | None]]:
    """Inputs (not initializers) and outputs with at least one named axis."""
    inits = {t.name for t in model.graph.initializer}
    found: dict[str, list[str | None]] = {}
    for vi in [*model.graph.input, *model.graph.output]:
        if vi.name in inits or not vi.type.tensor_type.HasField("shape"):
            continue
        axes = [d.dim_param or None for d in vi.type.tensor_type.shape.dim]
        if any(axes):
            found[vi.name] = axes
    return found


def recorded(metadata: dict[str, str]) -> dict[str, list[str | None]]:
    """What ``load_graph`` recorded of a step's (or model's) axes; empty where nothing."""
    return json.loads(metadata.get(SYMBOLIC_DIMS_KEY) or "{}")


def relax(model: onnx.ModelProto, axes: dict[str, list[str | None]]
          ) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy of ``model`` whose inputs and outputs have the recorded named axes again and
    no inner shapes (they hold the bound sizes), and each name's bound size."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    bound: dict[str, int] = {}
    for vi in [*out.graph.input, *out.graph.output]:
        names = axes.get(vi.name)
        dims = vi.type.tensor_type.shape.dim
        if not names or len(names) != len(dims):
            continue
        for d, name in zip(dims, names, strict=True):
            if name:
                if d.HasField("dim_value"):
                    bound.setdefault(name, int(d.dim_value))
                d.Clear()
                d.dim_param = name
    del out.graph.value_info[:]
    return out, bound
