"""Row-chunked regions computed whole again, for the model ``memcc export`` writes.

``frontend/row_chunks.py`` splits an attention's or an MLP's rows into chunks of fixed
sizes: a Split at the built sizes, a copy of the region per chunk, a Concat. The step needs
them; a model exported with them runs at the built sizes only. The Concat that joins a
region's chunks records how to undo the split (``WHOLE_ROWS``): which chunk-0 value each
split value's first part is, and which original value each of chunk 0's outputs stands
for. ``with_whole_rows`` renames chunk 0's nodes back to the whole values and drops the
Concat, so chunk 0 computes every row (its nodes are row-wise: the same arithmetic per
row) and the other chunks and the Splits are left unread, for the exporter's pruning.

A flat region (an MLP whose products run on [tokens, width] rows) dropped its Reshapes
from the chunks, so its values that were 3-D exist only flat; a shape computation the
exporter wrote reads them (GPT-2's Conv1D: ``x.size()[:-1] + (nf,)``). The record keeps
each such value as chunk 0's flat value, the shape input of the Reshape that made it 3-D
and its shape (``reshaped``); ``with_whole_rows`` puts those Reshapes back, so that
``fold.with_shape_computations`` can put the shape computations back after it.
"""

from __future__ import annotations

import json

import onnx

from memcc.graph import Graph, TensorInfo, in_dependency_order

WHOLE_ROWS = "memcc.whole_rows"


def record_whole_rows(concat: onnx.NodeProto, parts: dict[str, str],
                      outputs: dict[str, str],
                      reshaped: dict[str, tuple[str, str, list[int]]] | None = None
                      ) -> None:
    """On a region's joining ``concat``: ``parts`` (chunk 0's part of a split value -> the
    value), ``outputs`` (a value chunk 0 computes -> the original value it stands for) and
    ``reshaped`` (a flat region's value that was not 2-D -> chunk 0's flat value, the
    shape input that made it so, and its shape at the built sizes)."""
    record = {"parts": parts, "outputs": outputs}
    if reshaped:
        record["reshaped"] = {v: list(r) for v, r in reshaped.items()}
    concat.metadata_props.add(key=WHOLE_ROWS, value=json.dumps(record))


def with_whole_rows(graph: Graph) -> tuple[Graph, int]:
    """A copy of ``graph`` in which every recorded region is computed whole by its chunk 0
    (module docstring), and how many regions; ``graph`` itself where none was recorded."""
    records = [(i, json.loads(p.value)) for i, n in enumerate(graph.nodes)
               if n.op_type == "Concat" for p in n.metadata_props if p.key == WHOLE_ROWS]
    if not records:
        return graph, 0
    back: dict[str, str] = {}     # what chunk 0's nodes read -> the whole value
    renamed: dict[str, str] = {}  # what they write -> the whole value
    for _, rec in records:
        back.update(rec["parts"])
        renamed.update(rec["outputs"])
    joins = {i for i, _ in records}
    # A whole value's name that a later rewrite gave to another value stays unused: that
    # chunk value keeps its chunk name.
    taken = {o for i, n in enumerate(graph.nodes) if i not in joins for o in n.output
             if o and o not in renamed}
    renamed = {c: w for c, w in renamed.items() if w not in taken}
    back.update(renamed)
    out = graph.copy(with_index=False)
    nodes = []
    for i, n in enumerate(out.nodes):
        if i in joins:  # chunk 0's last node now writes the joined value itself
            continue
        for k, v in enumerate(n.input):
            n.input[k] = back.get(v, v)
        for k, v in enumerate(n.output):
            n.output[k] = renamed.get(v, v)
        nodes.append(n)
    unflat = _reshapes_back(out, nodes, [r for _, r in records], taken)
    out.set_nodes(in_dependency_order([*nodes, *unflat]) if unflat else nodes)
    return out, len(records)


def _reshapes_back(graph: Graph, nodes: list[onnx.NodeProto], records: list[dict],
                   taken: set[str]) -> list[onnx.NodeProto]:
    """The Reshapes that give a flat region's 3-D values back (module docstring), where
    their flat value and shape input are in the graph and no other value took the name."""
    made = set(graph.inputs) | set(graph.initializers)
    made |= {o for n in nodes for o in n.output if o}
    back = []
    for rec in records:
        for whole, (flat, shape, dims) in rec.get("reshaped", {}).items():
            ti = graph.info.get(flat)
            if whole in taken or whole in made or flat not in made or shape not in made \
                    or ti is None:
                continue
            back.append(onnx.helper.make_node("Reshape", [flat, shape], [whole],
                                              name=f"{whole}/whole_rows"))
            graph.info[whole] = TensorInfo(ti.dtype, tuple(dims))
            made.add(whole)
    return back
