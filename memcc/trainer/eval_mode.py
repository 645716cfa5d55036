"""The forward model as inference runs it: ``memcc export --eval``.

A model exported from PyTorch in train mode keeps its train-mode behaviour in the forward
model ``memcc export`` writes: each training-mode BatchNormalization normalises by the
statistics of the batch it is given, and each Dropout drops. A user who trains with memcc
and then deploys the exported ONNX file wants what ``module.eval()`` gives in PyTorch: the
running statistics the training accumulated, and no dropping. So ``--eval`` writes

- every training-mode BatchNormalization whose running statistics the step carries as the
  inference-mode node, reading those statistics (their trained values become the file's
  weights). On a step compiled for CUDA the node was written as reductions feeding an
  inference-mode BatchNormalization (``passes/providers/batchnorm_for_cuda.py``); there the
  node is pointed at the running statistics its batch statistics updated, and the reductions
  fall away with everything else the outputs no longer read.
- every Dropout without its ``training_mode`` input, which ONNX defines as inference: the
  input passes through.

A training-mode BatchNormalization whose statistics are computed, not carried (timm's
weight standardisation: ``F.batch_norm(w, None, None, training=True)``), stays: PyTorch
computes it so in eval mode too. Random draws outside Dropout (stochastic depth, noise
layers) are refused: what eval mode does instead (skip the branch, scale it, keep it) is
the module's code, not the graph's, so no rewrite can know it.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from memcc.errors import InputError
from memcc.frontend.running_variance import carried_value
from memcc.graph import Graph, ancestors, attr
from memcc.step import TrainingStep

# How the export's line on what --eval changed begins (the CLI prints it as a fact, not as
# a warning).
EVAL_NOTE = "eval mode: "
RANDOM_OPS = frozenset({"RandomUniform", "RandomUniformLike", "RandomNormal",
                        "RandomNormalLike", "Bernoulli", "Multinomial"})


@dataclass(frozen=True)
class EvalMode:
    """The rewritten graph and what was rewritten (for the export's message)."""

    graph: Graph
    batchnorms: int
    dropouts: int


def inference_or_train_mode(graph: Graph, spec: TrainingStep, outputs: list[str], *,
                            eval_mode: bool, source: str) -> tuple[Graph, str | None]:
    """``graph`` in eval mode (``eval_mode``) or as it is, and the line that says what
    changed, or what train mode the model keeps (None: nothing to say)."""
    if eval_mode:
        made = in_eval_mode(graph, spec, outputs, source=source)
        done = [f"{made.batchnorms} BatchNorm(s) read their running statistics"] \
            * bool(made.batchnorms) + \
            [f"{made.dropouts} Dropout(s) pass their input through"] * bool(made.dropouts)
        return made.graph, EVAL_NOTE + (
            f"{' and '.join(done)}, as in PyTorch's eval mode" if done else
            "nothing to change (no training-mode BatchNorm or Dropout)")
    bns, drops = train_mode_nodes(graph, outputs)
    kept = [f"{bns} BatchNorm(s) normalise by each batch's statistics"] * bool(bns) + \
        [f"{drops} Dropout(s) drop values"] * bool(drops)
    if not kept:
        return graph, None
    return graph, (f"the model keeps train mode as it was exported ({' and '.join(kept)}); "
                   "for inference, export with --eval (running statistics, no dropping)")


def train_mode_nodes(graph: Graph, outputs: list[str]) -> tuple[int, int]:
    """How many training-mode BatchNormalizations and training Dropouts the forward
    outputs read (a plain export keeps them; ``memcc export`` says so)."""
    reached, _ = ancestors(outputs, graph.def_use().producer)
    bns = sum(1 for n in reached if _is_training_bn(n))
    drops = sum(1 for n in reached if n.op_type == "Dropout" and len(n.input) > 2
                and n.input[2])
    return bns, drops


def in_eval_mode(graph: Graph, spec: TrainingStep, outputs: list[str], *,
                 source: str = "<step>") -> EvalMode:
    """``graph`` (a step whose Dropouts are plain nodes again) with the rewrites the module
    docstring lists; raises ``InputError`` where the outputs read a random draw."""
    carried = set(spec.state.values())
    running = _running_of_batch_statistics(graph, spec)
    producer = graph.def_use().producer
    nodes: list[onnx.NodeProto] = []
    bns = drops = 0
    for n in graph.nodes:
        # The running variance of a PyTorch model is fed divided (running_variance.py).
        stats = [carried_value(s, producer) for s in n.input[3:5]]
        if n.op_type == "BatchNormalization" and len(stats) == 2:
            if _is_training_bn(n) and set(stats) <= carried:
                nodes.append(_inference_batchnorm(n, stats))
                bns += 1
                continue
            if not _is_training_bn(n) and all(s in running for s in stats):
                nodes.append(_inference_batchnorm(n, [running[s] for s in stats]))
                bns += 1
                continue
        if n.op_type == "Dropout" and len(n.input) > 2 and n.input[2]:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            del c.input[2:]
            nodes.append(c)
            drops += 1
            continue
        nodes.append(n)
    out = graph.copy(with_index=False)
    out.set_nodes(nodes)
    reached, _ = ancestors(outputs, out.def_use().producer)
    draws = [n for n in reached if n.op_type in RANDOM_OPS]
    if draws:
        names = ", ".join(f"'{n.name or n.output[0]}' ({n.op_type})" for n in draws[:3])
        raise InputError(
            f"{source}: --eval cannot write this model for inference: its outputs read "
            f"{len(draws)} random draw(s) outside Dropout ({names}; stochastic depth or a "
            "noise layer), and what eval mode does instead is the module's code, not the "
            "graph's. Export the weights (--format safetensors) and load them into the "
            "PyTorch module in eval mode, or export the module from PyTorch in eval mode "
            "and give it these weights")
    return EvalMode(out, bns, drops)


def _is_training_bn(node: onnx.NodeProto) -> bool:
    return node.op_type == "BatchNormalization" and int(attr(node, "training_mode", 0)) == 1


def _inference_batchnorm(node: onnx.NodeProto, stats: list[str]) -> onnx.NodeProto:
    """The node in inference form over ``stats`` (mean, variance): one output, only
    ``epsilon`` (``momentum`` is meaningless there)."""
    made = onnx.helper.make_node(
        "BatchNormalization", [*node.input[:3], *stats], [node.output[0]], name=node.name,
        epsilon=float(attr(node, "epsilon", 1e-5)))
    made.domain = node.domain
    return made


def _running_of_batch_statistics(graph: Graph, spec: TrainingStep) -> dict[str, str]:
    """Batch statistic -> the carried running statistic it updates, where the update is
    written as nodes: ``R.new = Add(Mul(R, momentum), Mul(batch, 1 - momentum))`` (the
    CUDA form of a training-mode BatchNorm)."""
    producer = graph.def_use().producer
    found: dict[str, str] = {}
    for new, old in spec.state.items():
        add = producer.get(carried_value(new, producer))
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
