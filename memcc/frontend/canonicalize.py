"""Rewrite what exporters write into the plain tensor graph the rest of memcc works on.

Runs at load time, after dimensions are bound and shapes inferred, so every size is known.
Planning and gradient rules only ever see tensors of static shape, so:

- ``CastLike(x, like)`` becomes ``Cast(x, to=dtype(like))``: the dtype is known statically,
  and ``Cast`` has a gradient rule and folds like any other shape arithmetic (the dynamo
  exporter without its optimizer writes one per scalar constant it promotes).
- Sequence ops whose length and positions are static (``SplitToSequence`` feeding
  ``SequenceAt``: the dynamo exporter's spelling of ``torch.split``; ``SequenceConstruct``,
  ``ConcatFromSequence``, ``SequenceLength``, ``SequenceInsert``, ``SequenceEmpty``) become
  ``Split``/``Squeeze``/``Concat``/``Unsqueeze`` and constants: a sequence is only a list of
  tensor names here, so no sequence value survives into the graph.
- ``If`` whose condition is a compile-time constant once dimensions are bound is replaced by
  the branch it takes (its nodes move into the main graph under fresh names).

Each rewrite is exact (the same kernels on the same values). Anything that stays dynamic
(a sequence position computed from data, an ``If`` on data) is an ``InputError`` naming the
node, never a missing-shape error that would send the user after ``--dim``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import numpy as np
import onnx
import onnx.inliner
from onnx import helper, numpy_helper

from memcc.errors import InputError
from memcc.frontend.constants import constant_node_value
from memcc.graph import node_label

SEQUENCE_OPS = frozenset({"SplitToSequence", "SequenceAt", "SequenceConstruct",
                          "ConcatFromSequence", "SequenceLength", "SequenceInsert",
                          "SequenceEmpty", "SequenceErase"})
# Small integer/bool values the static evaluator computes to decide an If condition.
_MAX_STATIC_ELEMENTS = 4096


def needs_canonicalizing(model: onnx.ModelProto) -> bool:
    """True when the graph holds anything :func:`canonicalize` rewrites."""
    return any(n.op_type in SEQUENCE_OPS or n.op_type in ("CastLike", "If", "GatherND")
               for n in model.graph.node if n.domain in ("", "ai.onnx"))


def expand_function_ops(model: onnx.ModelProto, keep: frozenset[str] | set[str]
                        ) -> onnx.ModelProto | None:
    """Expand ops whose ONNX schema defines them as a function of other ops and that either
    have no gradient rule (``GroupNormalization``-21, ``RMSNormalization``-23,
    ``RotaryEmbedding``-23...) or no ORT kernel (``HardSwish``, ``Mish``, ``Bernoulli``: ORT
    would inline them itself, out of the planned order; ``backend.ort_kernels``): the
    schema's own body, made for this node's attributes and input types, becomes a
    model-local function that ``onnx.inliner`` inlines. Returns the new model, or None when
    nothing was expanded. ``keep``: op types memcc differentiates as they are and ORT runs
    as they are."""
    types = _types(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    functions: dict[str, onnx.FunctionProto] = {}
    original = model
    model = onnx.ModelProto()
    model.CopyFrom(original)
    fresh = _Namer(model)
    rewritten_here = SEQUENCE_OPS | {"CastLike", "If", "GatherND"}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in keep or \
                node.op_type in rewritten_here:
            continue
        body = _schema_function(node, opset, types)
        if body is None:
            continue
        name = fresh(f"{node.op_type}_expanded")
        body.name, body.domain = name, _EXPAND_DOMAIN
        del body.attribute[:]
        body.attribute.extend(a.name for a in node.attribute)
        functions[name] = body
        node.op_type, node.domain = name, _EXPAND_DOMAIN
    if not functions:
        return None
    model.functions.extend(functions.values())
    model.opset_import.append(helper.make_opsetid(_EXPAND_DOMAIN, 1))
    try:
        inlined = onnx.inliner.inline_local_functions(model)
    except Exception:
        return None  # leave the ops as they are: the gradient builder names them
    if any(n.domain == _EXPAND_DOMAIN for n in inlined.graph.node):
        return None
    for i, o in enumerate(inlined.opset_import):
        if o.domain == _EXPAND_DOMAIN:
            del inlined.opset_import[i]
            break
    return inlined


_EXPAND_DOMAIN = "memcc.expand"


def _schema_function(node: onnx.NodeProto, opset: int, types) -> onnx.FunctionProto | None:
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
    except Exception:
        return None
    try:
        if schema.has_context_dependent_function:
            tps = []
            for i in node.input:
                t = types.get(i)
                if t is None:
                    return None
                shape = list(t[1]) if t[1] is not None else None
                tps.append(helper.make_tensor_type_proto(t[0], shape).SerializeToString())
            version = _function_version(schema.context_dependent_function_opset_versions,
                                        opset)
            raw = schema.get_context_dependent_function_with_opset_version(
                version, node.SerializeToString(), tps)
        elif schema.has_function:
            raw = schema.get_function_with_opset_version(
                _function_version(schema.function_opset_versions, opset))
        else:
            return None
    except Exception:
        return None
    body = onnx.FunctionProto()
    body.ParseFromString(raw if isinstance(raw, bytes) else raw.SerializeToString())
    return body if body.node and _at_opset(body, opset) else None


def _at_opset(body: onnx.FunctionProto, opset: int) -> bool:
    """Declare ``body`` at the model's ONNX opset, which ``onnx.inliner`` requires (it leaves
    a function written for another version in place). Written for an older opset (HardSwish's
    body is opset 14's), it means the same at the model's when none of its ops changed in
    between; otherwise the op is left for ORT to inline."""
    for imp in body.opset_import:
        if imp.domain not in ("", "ai.onnx") or imp.version == opset:
            continue
        for node in body.node:
            if node.domain not in ("", "ai.onnx"):
                continue
            try:
                then = onnx.defs.get_schema(node.op_type, imp.version, "").since_version
                now = onnx.defs.get_schema(node.op_type, opset, "").since_version
            except Exception:  # noqa: BLE001 - an op unknown at one of the versions
                return False
            if then != now:
                return False
        imp.version = opset
    return True


def _function_version(versions: list[int], opset: int) -> int:
    """The newest function body written for an opset no newer than the model's."""
    usable = [v for v in versions if v <= opset]
    return max(usable) if usable else min(versions)


def seed_dropouts(nodes: Iterable[onnx.NodeProto]) -> None:
    """Give every ``Dropout`` without a ``seed`` attribute a fixed seed of its own.

    Without one, ORT's Dropout draws its mask from a generator seeded anew in every session
    (measured: two sessions of one model give different masks), so a step with dropout never
    gave the same loss twice and ``--verify`` could not compare a plan with its original.
    With a seed, each session draws the same sequence of masks, step after step, and the
    other random ops already behave so (an unseeded ``RandomUniformLike`` takes its seed
    from a fixed process-wide sequence). The seed is a hash of the node's name, so that no
    two Dropouts share a mask sequence and a rewrite that keeps the name keeps the draw.
    """
    reseed_dropouts([n for n in nodes if not any(a.name == "seed" for a in n.attribute)], "")


def reseed_dropouts(nodes: Iterable[onnx.NodeProto], salt: str) -> None:
    """Seed every ``Dropout`` among ``nodes`` from its name and ``salt``, replacing any seed
    it had: at load (``seed_dropouts``), for a row chunk of a Dropout (which copied its whole
    node's seed), for a training run resumed at step k (which would otherwise draw the masks
    of the run's first steps again)."""
    for node in nodes:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            kept = [a for a in node.attribute if a.name != "seed"]
            kept.append(helper.make_attribute(
                "seed", zlib.crc32((node.name + salt).encode()) & 0x7FFFFFFF))
            del node.attribute[:]
            node.attribute.extend(kept)


def shapes_needed(model: onnx.ModelProto) -> list[str]:
    """Values whose static type the rewrites need but shape inference left unknown."""
    types = _types(model)
    wanted: list[str] = []
    for n in model.graph.node:
        if n.op_type == "SplitToSequence":
            wanted.append(n.input[0])
        elif n.op_type == "CastLike":
            wanted.append(n.input[1])
        elif n.op_type == "GatherND":
            wanted += [n.input[0], n.input[1]]
    return [w for w in dict.fromkeys(wanted)
            if w and (w not in types or types[w][1] is None)]


def canonicalize(model: onnx.ModelProto, where: str) -> tuple[onnx.ModelProto, dict]:
    """Rewrite ``model`` (shapes already inferred) in place; return it and whether it
    changed (the pass contract's shape, ``memcc/pass_contract.py``, over the ONNX model:
    it runs before there is a ``Graph``).

    The caller re-runs shape inference afterwards: new values carry no type yet.
    """
    types = _types(model)
    consts = _Constants(model, types)
    changed = False
    out: list[onnx.NodeProto] = []
    seqs: dict[str, list[str]] = {}
    fresh = _Namer(model)
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            out.append(node)
            continue
        if node.op_type == "CastLike":
            like = types.get(node.input[1])
            if like is None:
                out.append(node)
                continue
            out.append(helper.make_node("Cast", [node.input[0]], [node.output[0]],
                                        name=node.name, to=like[0]))
            changed = True
        elif node.op_type in SEQUENCE_OPS:
            out.extend(_sequence(node, seqs, types, consts, fresh, where))
            changed = True
        elif node.op_type == "GatherND" and _float_data_gathernd(node, types):
            out.extend(_gathernd_as_gather(node, types, fresh))
            changed = True
        elif node.op_type == "If":
            cond = consts.value(node.input[0])
            if cond is None or cond.size != 1:
                out.append(node)
                continue
            out.extend(_inline_branch(node, bool(cond.reshape(-1)[0]), fresh))
            changed = True
        else:
            out.append(node)
    for o in model.graph.output:
        if o.name in seqs:
            raise InputError(
                f"{where}: graph output '{o.name}' is a sequence of tensors; memcc trains on "
                "tensor outputs. Return the tensors themselves (a tuple) from forward()."
            )
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(out)
    return model, {"changed": changed}


# ---------------------------------------------------------------------------- helpers
def _types(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int, ...] | None]]:
    """value -> (elem_type, static shape or None) from the inferred model."""
    out: dict[str, tuple[int, tuple[int, ...] | None]] = {}
    g = model.graph
    for vi in (*g.input, *g.value_info, *g.output):
        t = vi.type
        if not t.HasField("tensor_type") or not t.tensor_type.elem_type:
            continue
        tt = t.tensor_type
        shape: tuple[int, ...] | None = None
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shape = tuple(int(d.dim_value) for d in tt.shape.dim)
        out[vi.name] = (int(tt.elem_type), shape)
    for init in g.initializer:
        out[init.name] = (int(init.data_type), tuple(int(d) for d in init.dims))
    return out


class _Namer:
    def __init__(self, model: onnx.ModelProto) -> None:
        taken = {v for n in model.graph.node for v in (*n.input, *n.output, n.name)}
        taken |= {v.name for v in (*model.graph.input, *model.graph.output,
                                   *model.graph.initializer)}
        self.taken = taken

    def __call__(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name


class _Constants:
    """Values known at compile time: initializers, Constant nodes, ``Shape``/``Size`` of
    statically shaped values, and small integer/bool ops over those (evaluated with
    ``onnx.reference``). Used to decide ``If`` conditions and sequence positions."""

    def __init__(self, model: onnx.ModelProto,
                 types: dict[str, tuple[int, tuple[int, ...] | None]]) -> None:
        self.types = types
        self.opset = next((o.version for o in model.opset_import
                           if o.domain in ("", "ai.onnx")), 13)
        graph_inputs = {i.name for i in model.graph.input}
        self.known: dict[str, np.ndarray] = {
            t.name: numpy_helper.to_array(t) for t in model.graph.initializer
            if t.name not in graph_inputs and int(np.prod(t.dims)) <= _MAX_STATIC_ELEMENTS}
        self.producer = {o: n for n in model.graph.node for o in n.output if o}
        self.failed: set[str] = set()

    def value(self, name: str) -> np.ndarray | None:
        if not name:
            return None
        if name in self.known:
            return self.known[name]
        if name in self.failed:
            return None
        # Iterative depth-first evaluation: shape-arithmetic chains can be long.
        stack = [name]
        while stack:
            v = stack[-1]
            if v in self.known or v in self.failed:
                stack.pop()
                continue
            node = self.producer.get(v)
            if node is None:
                self.failed.add(v)
                stack.pop()
                continue
            pending = [i for i in self._inputs_needed(node)
                       if i not in self.known and i not in self.failed]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self._evaluate(node)
            for o in node.output:
                if o and o not in self.known:
                    self.failed.add(o)
        return self.known.get(name)

    def _inputs_needed(self, node: onnx.NodeProto) -> list[str]:
        if node.op_type in ("Shape", "Size", "Constant"):
            return []
        return [i for i in node.input if i]

    def _evaluate(self, node: onnx.NodeProto) -> None:
        out = node.output[0] if node.output else ""
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            return
        if node.op_type == "Constant":
            v = constant_node_value(node)
            if v is not None:
                self.known[out] = v
            return
        if node.op_type in ("Shape", "Size"):
            t = self.types.get(node.input[0])
            if t is None or t[1] is None:
                return
            shape = t[1]
            if node.op_type == "Size":
                self.known[out] = np.asarray(int(np.prod(shape)), dtype=np.int64)
                return
            start = _attr(node, "start", 0)
            end = _attr(node, "end", len(shape))
            self.known[out] = np.asarray(shape[slice(start, end)], dtype=np.int64)
            return
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute):
            return
        if any(i and i not in self.known for i in node.input):
            return
        if any(self.known[i].dtype.kind == "f" for i in node.input if i):
            return
        from onnx.reference import ReferenceEvaluator

        inits = [numpy_helper.from_array(self.known[i], i) for i in dict.fromkeys(node.input)
                 if i]
        g = helper.make_graph([node], "static", [], [helper.make_empty_tensor_value_info(out)],
                              inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        try:
            (value,) = ReferenceEvaluator(m).run(None, {})
        except Exception:
            return
        value = np.asarray(value)
        if value.size <= _MAX_STATIC_ELEMENTS and value.dtype.kind in "biu":
            self.known[out] = value


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _sequence(node: onnx.NodeProto, seqs: dict[str, list[str]],
              types: dict[str, tuple[int, tuple[int, ...] | None]], consts: _Constants,
              fresh: _Namer, where: str) -> list[onnx.NodeProto]:
    """Resolve one sequence op to tensor ops; record produced sequences in ``seqs``."""
    op = node.op_type

    def dynamic(what: str) -> InputError:
        return InputError(
            f"{where}: {node_label(node)}: {what} is only known at run time. memcc resolves "
            "sequences of tensors at load time, so their length and every position must be "
            "compile-time constants (binding --dim does not change this); rewrite the model "
            "to index a fixed number of tensors (e.g. torch.split with constant sizes)."
        )

    def elements(name: str) -> list[str]:
        if name not in seqs:
            raise dynamic(f"sequence '{name}' (not built by a sequence op memcc resolves)")
        return seqs[name]

    def position(k: int, length: int) -> int:
        if len(node.input) <= k or not node.input[k]:
            return length
        v = consts.value(node.input[k])
        if v is None:
            raise dynamic(f"the position '{node.input[k]}'")
        p = int(np.asarray(v).reshape(-1)[0])
        return p + length if p < 0 else p

    if op == "SequenceEmpty":
        seqs[node.output[0]] = []
        return []
    if op == "SequenceConstruct":
        seqs[node.output[0]] = list(node.input)
        return []
    if op == "SequenceInsert":
        items = list(elements(node.input[0]))
        items.insert(position(2, len(items)), node.input[1])
        seqs[node.output[0]] = items
        return []
    if op == "SequenceErase":
        items = list(elements(node.input[0]))
        p = position(1, len(items)) if len(node.input) > 1 and node.input[1] else len(items) - 1
        if not 0 <= p < len(items):
            raise InputError(f"{where}: {node_label(node)}: position {p} is outside the "
                             f"sequence of {len(items)} tensors")
        del items[p]
        seqs[node.output[0]] = items
        return []
    if op == "SequenceLength":
        n = len(elements(node.input[0]))
        return [helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                 value=numpy_helper.from_array(np.asarray(n, np.int64)))]
    if op == "SequenceAt":
        items = elements(node.input[0])
        p = position(1, len(items))
        if not 0 <= p < len(items):
            raise InputError(f"{where}: {node_label(node)}: position {p} is outside the "
                             f"sequence of {len(items)} tensors")
        return [helper.make_node("Identity", [items[p]], [node.output[0]], name=node.name)]
    if op == "ConcatFromSequence":
        items = elements(node.input[0])
        axis = _attr(node, "axis", 0)
        if not items:
            raise InputError(f"{where}: {node_label(node)} concatenates an empty sequence")
        if not _attr(node, "new_axis", 0):
            return [helper.make_node("Concat", items, [node.output[0]], name=node.name,
                                     axis=axis)]
        rank = types.get(items[0], (0, None))[1]
        if axis < 0:
            if rank is None:
                raise dynamic("the rank of the stacked tensors")
            axis += len(rank) + 1
        nodes, parts = _on_each_axis("Unsqueeze", items, axis, node, fresh)
        nodes.append(helper.make_node("Concat", parts, [node.output[0]], name=node.name,
                                      axis=axis))
        return nodes
    # SplitToSequence
    x = node.input[0]
    t = types.get(x)
    if t is None or t[1] is None:
        raise dynamic(f"the shape of '{x}'")
    shape = t[1]
    axis = _attr(node, "axis", 0) % max(len(shape), 1)
    size = shape[axis]
    keepdims = _attr(node, "keepdims", 1)
    split = consts.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    if len(node.input) > 1 and node.input[1] and split is None:
        raise dynamic(f"the split sizes '{node.input[1]}'")
    if split is None:
        sizes = [1] * size
    elif np.ndim(split) == 0:
        chunk = int(split)
        sizes = [chunk] * (size // chunk) + ([size % chunk] if size % chunk else [])
    else:
        sizes = [int(s) for s in np.asarray(split).reshape(-1)]
    parts = [fresh(f"{node.output[0]}/{i}") for i in range(len(sizes))]
    nodes: list[onnx.NodeProto] = []
    if len(sizes) == 1:
        nodes.append(helper.make_node("Identity", [x], parts, name=node.name))
    elif consts.opset >= 13:
        sz = _const_node(fresh, np.asarray(sizes, np.int64))
        nodes += [sz, helper.make_node("Split", [x, sz.output[0]], parts, name=node.name,
                                       axis=axis)]
    else:
        nodes.append(helper.make_node("Split", [x], parts, name=node.name, axis=axis,
                                      split=sizes))
    if split is None and not keepdims:
        squeezing, parts = _on_each_axis("Squeeze", parts, axis, node, fresh)
        nodes += squeezing
    for p, n in zip(parts, sizes, strict=True):  # later sequence ops read the parts' ranks
        part_shape = list(shape)
        part_shape[axis] = n
        if split is None and not keepdims:
            del part_shape[axis]
        types[p] = (t[0], tuple(part_shape))
    seqs[node.output[0]] = parts
    return nodes


_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                     onnx.TensorProto.BFLOAT16})


def _float_data_gathernd(node: onnx.NodeProto, types) -> bool:
    data, idx = types.get(node.input[0]), types.get(node.input[1])
    return (data is not None and data[0] in _FLOATS and data[1] is not None
            and idx is not None and idx[1] is not None and len(idx[1]) >= 1
            and _attr(node, "batch_dims", 0) == 0 and 1 <= idx[1][-1] <= len(data[1]))


def _gathernd_as_gather(node: onnx.NodeProto, types, fresh: _Namer) -> list[onnx.NodeProto]:
    """``GatherND(data, idx)`` (batch_dims 0) as ``Gather(Reshape(data, [P, *rest]), lin)``
    with ``lin`` the row-major linear index over the first ``k`` axes: exact, and the Gather
    gradient (a deterministic chunked ScatterElements) then covers it, where a ScatterND
    gradient would lose updates across threads on ORT's CPU provider."""
    data_shape = types[node.input[0]][1]
    idx_type, idx_shape = types[node.input[1]]
    k = idx_shape[-1]
    lead, rest = data_shape[:k], data_shape[k:]
    strides = [int(np.prod(lead[j + 1:])) for j in range(k)]
    name = node.name or node.output[0]

    def v(base: str) -> str:
        return fresh(f"{name}/{base}")

    nodes: list[onnx.NodeProto] = []
    idx = node.input[1]
    if idx_type != onnx.TensorProto.INT64:
        cast = v("indices_int64")
        nodes.append(helper.make_node("Cast", [idx], [cast], name=v("Cast"),
                                      to=onnx.TensorProto.INT64))
        idx = cast
    dims = _const_node(fresh, np.asarray(lead, np.int64))
    strd = _const_node(fresh, np.asarray(strides, np.int64))
    zero = _const_node(fresh, np.asarray(0, np.int64))
    axes = _const_node(fresh, np.asarray([-1], np.int64))
    shape = _const_node(fresh, np.asarray([int(np.prod(lead))] + list(rest), np.int64))
    nodes += [dims, strd, zero, axes, shape]
    neg, negi, wrap, norm, scaled, lin, flat = (v(s) for s in (
        "negative", "negative_int", "wrap", "normalized", "scaled", "linear", "rows"))
    nodes += [
        helper.make_node("Less", [idx, zero.output[0]], [neg], name=v("Less")),
        helper.make_node("Cast", [neg], [negi], name=v("Cast"), to=onnx.TensorProto.INT64),
        helper.make_node("Mul", [negi, dims.output[0]], [wrap], name=v("Mul")),
        helper.make_node("Add", [idx, wrap], [norm], name=v("Add")),
        helper.make_node("Mul", [norm, strd.output[0]], [scaled], name=v("Mul")),
        helper.make_node("ReduceSum", [scaled, axes.output[0]], [lin], name=v("ReduceSum"),
                         keepdims=0),
        helper.make_node("Reshape", [node.input[0], shape.output[0]], [flat],
                         name=v("Reshape")),
        helper.make_node("Gather", [flat, lin], [node.output[0]], name=name, axis=0),
    ]
    return nodes


def _on_each_axis(op_type: str, values: list[str], axis: int, node: onnx.NodeProto,
                  fresh: _Namer) -> tuple[list[onnx.NodeProto], list[str]]:
    """``op_type`` (Squeeze or Unsqueeze) on ``axis`` of every value, sharing one axes
    constant: the nodes, the constant first, and the results in order."""
    ax = _const_node(fresh, np.asarray([axis], np.int64))
    nodes, outs = [ax], []
    for v in values:
        out = fresh(f"{v}/{op_type.lower()}d")
        nodes.append(helper.make_node(op_type, [v, ax.output[0]], [out],
                                      name=fresh(f"{node.name}/{op_type}")))
        outs.append(out)
    return nodes, outs


def _const_node(fresh: _Namer, value: np.ndarray) -> onnx.NodeProto:
    out = fresh("canonical_const")
    return helper.make_node("Constant", [], [out], name=fresh("Constant"),
                            value=numpy_helper.from_array(value, out))


def _inline_branch(node: onnx.NodeProto, cond: bool, fresh: _Namer) -> list[onnx.NodeProto]:
    """The nodes of the branch ``If`` takes, renamed apart, then its outputs by Identity."""
    branch = _attr(node, "then_branch" if cond else "else_branch", None)
    assert isinstance(branch, onnx.GraphProto)
    prefix = f"{node.name or node.output[0]}/{'then' if cond else 'else'}/"
    rename: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []
    for init in branch.initializer:
        rename[init.name] = fresh(prefix + init.name)
        nodes.append(helper.make_node("Constant", [], [rename[init.name]],
                                      name=fresh(prefix + "Constant"), value=init))
    for n in branch.node:
        for o in n.output:
            if o:
                rename[o] = fresh(prefix + o)
    for n in branch.node:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        m.name = fresh(prefix + (n.name or n.op_type))
        _rename_values(m, rename)
        nodes.append(m)
    for src, dst in zip(branch.output, node.output, strict=False):
        if dst:
            nodes.append(helper.make_node("Identity", [rename.get(src.name, src.name)], [dst],
                                          name=fresh(prefix + "output")))
    return nodes


def _rename_values(node: onnx.NodeProto, rename: dict[str, str]) -> None:
    for i, v in enumerate(node.input):
        if v in rename:
            node.input[i] = rename[v]
    for i, v in enumerate(node.output):
        if v in rename:
            node.output[i] = rename[v]
    for a in node.attribute:  # nested subgraphs may read the branch's values
        for g in _subgraphs(a):
            for inner in g.node:
                for i, v in enumerate(inner.input):
                    if v in rename:
                        inner.input[i] = rename[v]


def _subgraphs(a: onnx.AttributeProto) -> Iterable[onnx.GraphProto]:
    if a.type == onnx.AttributeProto.GRAPH:
        yield a.g
    elif a.type == onnx.AttributeProto.GRAPHS:
        yield from a.graphs
