"""Parameters TorchScript's exporter stored once because they held equal values, untied.

``torch.onnx.export(..., dynamo=False)`` deduplicates initializers before it writes them.
With the model in eval mode (its default ``training=TrainingMode.EVAL``) it compares them
by value: the fresh weights of every BatchNorm or LayerNorm of one size (all ones), every
zero bias and running mean, are stored once, and each other parameter is an ``Identity`` of
that one under its own name (``3.weight = Identity(1.weight)``). Those are parameters torch
trains apart; trained as found, the step would train each group as one tensor, a different
model, and ``memcc export`` would write the copies' names nowhere.

Only constant-filled values are untied. Other equal values (in either mode) are parameters
that share storage (``b.weight = nn.Parameter(a.weight.data)``), which torch's optimizer
updates as one tensor: they stay one, with a warning (``kept_tied``): equal random values
are also what layers deep-copied at construction hold (``nn.TransformerEncoder``'s), which
torch trains apart, and the file cannot tell the two apart. Torch's own tying (one
parameter under two names) is traced once and read under one name, never through such an
Identity; an Identity the model itself runs on a parameter (a clone) is written in its
module's scope (``/m/Identity``) and is left alone too.

In: the raw ``ModelProto`` (in place, before memcc rewrites a node) and the arrays of its
stubs (``weights_apart``). Out: each such Identity replaced by an initializer of its own
under the Identity's output name, with the same values; the names untied are returned.
Files with a torch.export signature (the dynamo exporter, whose optimizer merges equal
parameters and records it: ``export_map``) and training steps memcc built are left alone.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
from onnx.external_data_helper import uses_external_data

from memcc.frontend.constants import constant_filled
from memcc.frontend.export_signature import SIGNATURE_PROP, file_props, is_made_up_name
from memcc.frontend.weights_apart import Arrays
from memcc.graph import FLOAT_TYPES
from memcc.step import KIND_KEY


def untie_deduplicated(model: onnx.ModelProto, arrays: Arrays) -> tuple[str, ...]:
    """Give every parameter the TorchScript exporter deduplicated for its constant-filled
    value an initializer of its own again (in ``model`` and, for stubs, ``arrays``); the
    names given one."""
    props = file_props(model)
    if KIND_KEY in props or props.get(SIGNATURE_PROP):
        return ()
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    untied: list[str] = []
    for node in graph.node:
        src = _copied(node, inits, outputs)
        t = inits.get(src)
        if t is None or not _constant(src, t, arrays):
            kept.append(node)
            continue
        dst = node.output[0]
        copy = onnx.TensorProto()
        copy.CopyFrom(t)
        copy.name = dst
        graph.initializer.append(copy)
        inits[dst] = copy
        if src in arrays:  # a stub's values: an array of the copy's own, never shared
            arrays[dst] = np.array(arrays[src])
        untied.append(dst)
    if untied:
        del graph.node[:]
        graph.node.extend(kept)
        infos = [v for v in graph.value_info if v.name not in inits]
        del graph.value_info[:]
        graph.value_info.extend(infos)
    return tuple(untied)


def kept_tied(model: onnx.ModelProto, arrays: Arrays) -> list[tuple[str, str]]:
    """(copy, parameter) for each parameter TorchScript's eval-mode export stored as an
    Identity of another holding equal values that are not constant-filled: these stay one
    tensor (storage shared in torch), but equal random values are also what layers deep-
    copied at construction hold (``nn.TransformerEncoder``'s), which torch trains apart."""
    props = file_props(model)
    if KIND_KEY in props or props.get(SIGNATURE_PROP):
        return []
    inits = {t.name: t for t in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    return [(node.output[0], src) for node in model.graph.node
            if (src := _copied(node, inits, outputs))
            and not _constant(src, inits[src], arrays)]


def _copied(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], outputs: set[str]
            ) -> str:
    """The float initializer an exporter's Identity copies under a PyTorch name (not the
    model's own clone in a module scope, not a graph output), else ''."""
    if node.op_type != "Identity" or node.domain not in ("", "ai.onnx") \
            or len(node.input) != 1 or len(node.output) != 1:
        return ""
    src, dst = node.input[0], node.output[0]
    t = inits.get(src)
    if t is None or t.data_type not in FLOAT_TYPES or dst in outputs or dst in inits \
            or is_made_up_name(dst) or "/" in node.name + dst:
        return ""
    return src


def _constant(name: str, t: onnx.TensorProto, arrays: Arrays) -> bool:
    """Every element equal (a sample decides most random arrays without a pass). False for
    values still in an external file (a model given with its data not loaded)."""
    if name in arrays:
        a = arrays[name]
    elif uses_external_data(t):
        return False
    else:
        a = onnx.numpy_helper.to_array(t)
    return constant_filled(a)
