"""Remove the Cast chains that ONNX Runtime removes itself, so that the planned step is the
step ORT runs.

Even with every graph optimization off, ORT applies ``RemoveDuplicateCastTransformer`` (part
of the transformer that inserts fp16 casts on the CPU) when it creates a session: a Cast
whose consumers are all Casts disappears, and so does a consumer that casts back to the
first Cast's input type, unless a step of the chain loses precision (ORT_NOTES §1). A step
planned with those Casts in it is not the step that runs: ORT leaves the planned order at
the first of them (a transformers BLOOM export casts its attention probabilities float ->
float twice). memcc applies the same rule when it loads a model, until nothing more goes,
so that ORT finds nothing left to remove. Building the training step added no chain ORT
would remove on any of 43 transformers, torchvision and timm exports checked, so the rule
runs at load only; ``--verify``'s order check would catch one.

The rule, as onnxruntime 1.31's ``insert_cast_transformer.cc`` states it and
``tests/test_ort_facts.py`` measures it on chains of two and three Casts, for each Cast
``A`` (input type ``s``, output type ``d``) in node order:

- if ``A`` loses precision (``_unsafe(s, d)``) and a consumer Cast ``B`` would lose precision
  casting back (``_unsafe(d_B, s_B)``), nothing happens to ``A`` or its consumers;
- a consumer Cast ``B`` that casts back (``d_B == s``, ``s_B == d``) and is not a graph
  output goes: its readers read ``A``'s input;
- if every reader of ``A``'s output is a Cast and ``A`` is not a graph output, ``A`` goes
  too (unless it loses precision and a remaining consumer casts to bool): the remaining
  consumers cast ``A``'s input.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from memcc.graph import Graph

_SIGNED = {TensorProto.INT8: 8, TensorProto.INT16: 16, TensorProto.INT32: 32,
           TensorProto.INT64: 64}
_UNSIGNED = {TensorProto.UINT8: 8, TensorProto.UINT16: 16, TensorProto.UINT32: 32,
             TensorProto.UINT64: 64}
_FLOAT = {TensorProto.FLOAT16: 16, TensorProto.BFLOAT16: 16, TensorProto.FLOAT: 32,
          TensorProto.DOUBLE: 64}
_HALVES = {TensorProto.FLOAT16, TensorProto.BFLOAT16}


def _group(dtype: int) -> str | None:
    if dtype == TensorProto.BOOL:
        return "bool"
    for name, table in (("int", _SIGNED), ("uint", _UNSIGNED), ("float", _FLOAT)):
        if dtype in table:
            return name
    return None


def _bits(dtype: int) -> int:
    return 1 if dtype == TensorProto.BOOL else {**_SIGNED, **_UNSIGNED, **_FLOAT}[dtype]


def _unsafe(src: int | None, dst: int | None) -> bool:
    """Whether casting ``src`` to ``dst`` may lose information, by ORT's own test."""
    gs = _group(src) if src is not None else None
    gd = _group(dst) if dst is not None else None
    if gs is None or gd is None:
        return True
    if gs not in ("bool", "uint") and gd == "uint":
        return True
    if gs == "float" and gd != "float":
        return True
    if gs == "uint" and gd == "int":
        return _bits(dst) <= _bits(src)
    if gs in ("int", "uint") and gd == "float":
        return _bits(dst) <= _bits(src)
    if src in _HALVES and dst in _HALVES and src != dst:
        return True
    return _bits(src) > _bits(dst)


def drop_cast_chains(graph: Graph, *, max_sweeps: int = 8) -> tuple[Graph, dict]:
    """Apply ORT's rule (module docstring) until it removes nothing; return the graph and
    how many Casts went (the pass contract, ``memcc/pass_contract.py``). The graph's nodes
    are replaced in place."""
    total = 0
    for _ in range(max_sweeps):
        removed = _sweep(graph)
        total += removed
        if not removed:
            break
    return graph, {"casts_dropped": total}


def _sweep(graph: Graph) -> int:
    outputs = set(graph.outputs)
    nodes = list(graph.nodes)
    gone: set[int] = set()
    readers: dict[str, list[onnx.NodeProto]] = {}   # value -> nodes reading it, per slot
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def dtype(name: str) -> int | None:
        ti = graph.info.get(name)
        return ti.dtype if ti is not None else None

    def reroute(node: onnx.NodeProto, old: str, new: str) -> None:
        for k, i in enumerate(node.input):
            if i == old:
                node.input[k] = new
                readers[old].remove(node)
                readers.setdefault(new, []).append(node)

    for a in nodes:
        if id(a) in gone or a.op_type != "Cast" or not a.input or not a.output:
            continue
        src, dst, out = dtype(a.input[0]), dtype(a.output[0]), a.output[0]
        lossy = _unsafe(src, dst)
        edges = list(readers.get(out, []))
        casts = list({id(n): n for n in edges if n.op_type == "Cast"}.values())
        if lossy and any(_unsafe(dtype(b.output[0]), dtype(b.input[0])) for b in casts):
            continue
        back = [b for b in casts if b.output[0] not in outputs
                and dtype(b.output[0]) == src and dtype(b.input[0]) == dst]
        kept = [b for b in casts if all(b is not x for x in back)]
        for b in back:
            for reader in list(readers.get(b.output[0], [])):
                reroute(reader, b.output[0], a.input[0])
            readers[out].remove(b)
            gone.add(id(b))
        if edges and len(back) + len(kept) == len(edges) and out not in outputs and \
                not (lossy and any(dtype(k.output[0]) == TensorProto.BOOL for k in kept)):
            for k in kept:
                reroute(k, out, a.input[0])
            readers[a.input[0]].remove(a)
            gone.add(id(a))
    if gone:
        graph.nodes = [n for n in nodes if id(n) not in gone]
    return len(gone)
