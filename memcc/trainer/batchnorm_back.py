"""A step compiled for CUDA, its training-mode BatchNorms written back as the nodes they were.

On CUDA a training-mode BatchNormalization is reductions feeding an inference-mode one,
with its running statistics updated by nodes of their own
(``passes/providers/batchnorm_for_cuda.py``). That form is the plan's, not the model's: a
forward model exported from it normalised by batch statistics nothing names as running
ones, so its safetensors file had no running statistics at all (a strict
``load_state_dict`` refused it, a loose one kept the module's initial statistics) and its
train-mode ONNX model carried the reductions. ``training_batchnorms_back`` finds each
rewritten node by its running statistics' updates and writes the training-mode node again,
reading the statistics it read and with the momentum its updates use; everything else of
the CUDA form is then read by nothing the outputs need.

Enters: a step graph and its ``TrainingStep``. Leaves: the graph with the nodes written
back, and how many.
"""

from __future__ import annotations

import onnx

from memcc.def_use import DefUse
from memcc.frontend.constants import constant_value
from memcc.frontend.running_variance import carried_value
from memcc.graph import Graph, attr, behind
from memcc.step import TrainingStep


def training_batchnorms_back(graph: Graph, spec: TrainingStep) -> tuple[Graph, int]:
    """A copy of ``graph`` with every CUDA-form BatchNorm (module docstring) a training-mode
    BatchNormalization again, and how many; ``graph`` itself where there is none."""
    if not any(_inference_form(n) for n in graph.nodes):  # no CUDA form: no graph walk
        return graph, 0
    du = graph.def_use()
    updates = _running_updates(graph, spec, du)
    nodes, back = [], 0
    for n in graph.nodes:
        stats = [updates.get(s) for s in n.input[3:5]] if _inference_form(n) else []
        if len(stats) == 2 and None not in stats and stats[0][1] == stats[1][1]:
            y = n.output[0]
            made = onnx.helper.make_node(
                "BatchNormalization", [*n.input[:3], stats[0][0], stats[1][0]],
                [y, f"{y}.running_mean", f"{y}.running_var"], name=n.name,
                epsilon=float(attr(n, "epsilon", 1e-5)), momentum=stats[0][1],
                training_mode=1)
            made.domain = n.domain
            nodes.append(made)
            back += 1
        else:
            nodes.append(n)
    if not back:
        return graph, 0
    out = graph.copy(with_index=False)
    out.set_nodes(nodes)
    return out, back


def _inference_form(n: onnx.NodeProto) -> bool:
    return n.op_type == "BatchNormalization" and len(n.input) >= 5 and \
        int(attr(n, "training_mode", 0)) == 0


def _running_updates(graph: Graph, spec: TrainingStep, du: DefUse
                     ) -> dict[str, tuple[str, float]]:
    """Batch statistic -> (the value its running statistic's update multiplies by the
    momentum, the momentum): ``Add(Mul(R, m), Mul(batch, 1 - m))``, R alone or in a Concat
    of several (the grouped form)."""
    producer, readers = du.producer, du.readers
    running = running_of_batch_statistics(spec, producer)
    wanted = set(running.values())
    found: dict[str, tuple[str, float]] = {}
    for n in graph.nodes:
        if n.op_type != "Mul" or len(n.input) != 2:
            continue
        for a, b in ((n.input[0], n.input[1]), (n.input[1], n.input[0])):
            m = scalar_constant(b, graph, producer)
            if m is None or not _mixes(n, m, graph, producer, readers):
                continue
            p = producer.get(a)
            for v in (list(p.input) if p is not None and p.op_type == "Concat" else [a]):
                if (r := carried_value(v, producer)) in wanted:
                    found.setdefault(r, (v, m))
    return {batch: found[r] for batch, r in running.items() if r in found}


def _mixes(mul: onnx.NodeProto, m: float, graph: Graph, producer: dict[str, onnx.NodeProto],
           readers) -> bool:
    """Whether ``mul``'s product is added to another product by ``1 - m``."""
    for add in readers.get(mul.output[0], ()):
        if add.op_type != "Add":
            continue
        other = producer.get(next((i for i in add.input if i != mul.output[0]), ""))
        if other is not None and other.op_type == "Mul" and any(
                (c := scalar_constant(i, graph, producer)) is not None and abs(c + m - 1) < 1e-6
                for i in other.input):
            return True
    return False


def running_of_batch_statistics(spec: TrainingStep, producer: dict[str, onnx.NodeProto]
                                ) -> dict[str, str]:
    """Batch statistic -> the carried running statistic it updates, where the update is
    written as nodes: ``R.new = Add(Mul(R, momentum), Mul(batch, 1 - momentum))`` (the
    CUDA form of a training-mode BatchNorm), or that over the concatenations of several
    statistics, split back (``batchnorm_for_cuda``'s grouped form)."""
    found: dict[str, str] = {}
    for new, old in spec.state.items():
        add = producer.get(carried_value(new, producer))
        if add is not None and add.op_type == "Split":
            found.update(_grouped_running(add, old, producer))
            continue
        if add is None or add.op_type != "Add":
            continue
        muls = [producer.get(i) for i in add.input]
        if not all(m is not None and m.op_type == "Mul" for m in muls):
            continue
        reads = [{carried_value(i, producer) for i in m.input}  # type: ignore[union-attr]
                 for m in muls]
        for mine, other in ((reads[0], reads[1]), (reads[1], reads[0])):
            if old in mine:
                for batch in other:
                    if batch in producer and producer[batch].op_type != "Constant":
                        found[batch] = old
    return found


def _grouped_running(split: onnx.NodeProto, old: str, producer: dict[str, onnx.NodeProto]
                     ) -> dict[str, str]:
    """{batch statistic: ``old``} where ``split`` splits ``Add(Mul(Concat(R...), m),
    Mul(Concat(batch...), 1 - m))`` and ``old`` is one of the ``R``; else {}."""
    add = producer.get(split.input[0])
    if add is None or add.op_type != "Add":
        return {}
    joins = []
    for value in add.input:
        mul = producer.get(value)
        if mul is None or mul.op_type != "Mul":
            return {}
        concats = [producer[i] for i in mul.input
                   if i in producer and producer[i].op_type == "Concat"]
        if not concats:
            return {}
        joins.append([carried_value(i, producer) for i in concats[0].input])
    for mine, other in ((joins[0], joins[1]), (joins[1], joins[0])):
        if old in mine and len(mine) == len(other):
            return {other[mine.index(old)]: old}
    return {}


def scalar_constant(value: str, graph: Graph, producer: dict[str, onnx.NodeProto]
                    ) -> float | None:
    """A scalar constant through Cast / CastLike (None: not one)."""
    value, _ = behind(value, producer, lambda n: n.op_type in ("Cast", "CastLike"))
    arr = constant_value(graph, value, producer)
    return None if arr is None or arr.size != 1 else float(arr.reshape(()))
