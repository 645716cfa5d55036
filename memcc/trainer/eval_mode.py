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
  input passes through;
- every Dropout written as a random mask, ``x * (RandomUniform(Like) < keep) / keep`` (the
  dynamo exporter's in-place ``nn.Dropout``, timm's stochastic depth), as ``x``;
- every spectral norm (``torch.nn.utils.parametrizations.spectral_norm``'s ``_u`` and
  ``_v``, the old hook's ``weight_u`` and ``weight_v``, which the step carries:
  ``frontend/buffer_updates.py``) reading its stored vectors where the file runs the power
  iteration: torch's eval mode divides by ``u . W v`` of the vectors the last training step
  wrote, with no iteration; one more from the trained weight put the outputs 3.6e-3 to
  3.4e-2 of their largest off torch's (``tests/test_eval_spectral_norm.py``).

A training-mode BatchNormalization whose statistics are computed, not carried (timm's
weight standardisation: ``F.batch_norm(w, None, None, training=True)``), stays: PyTorch
computes it so in eval mode too. Other random draws (noise layers) are refused: what eval
mode does instead (skip the branch, scale it, keep it) is the module's code, not the
graph's, so no rewrite can know it.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from memcc.errors import InputError
from memcc.frontend.running_variance import carried_value, read_as
from memcc.graph import Graph, ancestors, attr, behind
from memcc.step import TrainingStep
from memcc.trainer.batchnorm_back import running_of_batch_statistics, scalar_constant

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
    spectral_norms: int = 0


def inference_or_train_mode(graph: Graph, spec: TrainingStep, outputs: list[str], *,
                            eval_mode: bool, source: str) -> tuple[Graph, str | None]:
    """``graph`` in eval mode (``eval_mode``) or as it is, and the line that says what
    changed, or what train mode the model keeps (None: nothing to say)."""
    if eval_mode:
        made = in_eval_mode(graph, spec, outputs, source=source)
        done = [f"{made.batchnorms} BatchNorm(s) read their running statistics"] \
            * bool(made.batchnorms) + \
            [f"{made.dropouts} Dropout(s) pass their input through"] * bool(made.dropouts) + \
            [f"{made.spectral_norms} spectral norm(s) read their stored vectors without a "
             "power iteration"] * bool(made.spectral_norms)
        return made.graph, EVAL_NOTE + (
            f"{' and '.join(done)}, as in PyTorch's eval mode" if done else
            "nothing to change (no training-mode BatchNorm, Dropout or spectral norm)")
    bns, drops = train_mode_nodes(graph, outputs)
    kept = [f"{bns} BatchNorm(s) normalise by each batch's statistics"] * bool(bns) + \
        [f"{drops} Dropout(s) are in training mode"] * bool(drops)
    if not kept:
        return graph, None
    return graph, (f"the model keeps train mode as it was exported ({' and '.join(kept)}); "
                   "for inference, export with --eval (running statistics, no dropping)")


def train_mode_nodes(graph: Graph, outputs: list[str]) -> tuple[int, int]:
    """How many training-mode BatchNormalizations and Dropouts (nodes, or masks written as
    random draws) the forward outputs read (a plain export keeps them; ``memcc export``
    says so)."""
    producer = graph.def_use().producer
    reached, _ = ancestors(outputs, producer)
    masked = _dropped_by_masks(graph, producer)
    bns = sum(1 for n in reached if _is_training_bn(n))
    drops = sum(1 for n in reached if (n.op_type == "Dropout" and len(n.input) > 2
                                       and n.input[2]) or id(n) in masked)
    return bns, drops


def in_eval_mode(graph: Graph, spec: TrainingStep, outputs: list[str], *,
                 source: str = "<step>") -> EvalMode:
    """``graph`` (a step whose Dropouts are plain nodes again) with the rewrites the module
    docstring lists; raises ``InputError`` where the outputs read a random draw."""
    carried = set(spec.state.values())
    producer = graph.def_use().producer
    running = running_of_batch_statistics(spec, producer)
    masked = _dropped_by_masks(graph, producer)
    vectors = _power_iterated(graph, spec, producer)
    nodes: list[onnx.NodeProto] = []
    made: dict[int, str] = {}  # id of a rewritten node -> "bn" or "dropout"
    out = graph.copy(with_index=False)
    for n in graph.nodes:
        n = _reading_stored(n, vectors)
        new, kind = _in_eval_mode(out, n, masked, producer, carried, running)
        nodes.extend(new)
        if kind:
            made[id(new[-1])] = kind
    out.set_nodes(nodes)
    reached, _ = ancestors(outputs, out.def_use().producer)
    kinds = [made[id(n)] for n in reached if id(n) in made]
    bns, drops = kinds.count("bn"), kinds.count("dropout")
    read = {i for n in reached for i in n.input}
    norms = sum(v.endswith("_v") and v in read for v in set(vectors.values()))
    draws = [n for n in reached if n.op_type in RANDOM_OPS]
    if draws:
        names = ", ".join(f"'{n.name or n.output[0]}' ({n.op_type})" for n in draws[:3])
        raise InputError(
            f"{source}: --eval cannot write this model for inference: its outputs read "
            f"{len(draws)} random draw(s) that are no Dropout mask ({names}; a noise "
            "layer, or a mask memcc does not recognise), and what eval mode does instead "
            "is the module's code, not the graph's. Export the weights (--format "
            "safetensors) and load them into the PyTorch module in eval mode, or export "
            "the module from PyTorch in eval mode and give it these weights")
    return EvalMode(out, bns, drops, norms)


# A spectral norm's vectors: the parametrization's ``<module>.parametrizations.<name>.<i>._u``
# and ``._v`` (its parameter ``....original``), the old hook's ``<module>.<name>_u`` and
# ``_v`` (its parameter ``<module>.<name>_orig``).
_PARAMETRIZED = ".parametrizations."


def _power_iterated(graph: Graph, spec: TrainingStep, producer: dict[str, onnx.NodeProto]
                    ) -> dict[str, str]:
    """Each value the step writes into a spectral norm's ``u`` or ``v`` (and the value the
    step names so behind an Identity), mapped to that buffer: eval mode reads the buffer
    where the forward reads the value, and the power iteration falls away unread."""
    written = {b: v for v, b in spec.state.items()}
    names = set(graph.inputs) | set(graph.initializers)
    vectors: dict[str, str] = {}
    for buffer, value in written.items():
        stem = buffer[:-2]
        if buffer[-2:] not in ("_u", "_v") or stem + ("_v" if buffer[-1] == "u" else "_u") \
                not in written:
            continue
        if not (_PARAMETRIZED in stem and stem.endswith(".") or stem + "_orig" in names):
            continue
        vectors[value] = buffer
        node = producer.get(value)
        if node is not None and node.op_type == "Identity":
            vectors[node.input[0]] = buffer
    return vectors


def _reading_stored(n: onnx.NodeProto, vectors: dict[str, str]) -> onnx.NodeProto:
    """``n``, or a copy of it that reads the stored vectors where it read the values the
    power iteration writes into them (the step's node is left as it is)."""
    if not any(i in vectors for i in n.input):
        return n
    c = onnx.NodeProto()
    c.CopyFrom(n)
    c.input[:] = [vectors.get(i, i) for i in n.input]
    return c


def _in_eval_mode(graph: Graph, n: onnx.NodeProto, masked: dict[int, str],
                  producer: dict[str, onnx.NodeProto], carried: set[str],
                  running: dict[str, str]) -> tuple[list[onnx.NodeProto], str | None]:
    """The nodes to put where ``n`` stood as eval mode runs it (the node last), and what
    it was ("bn", "dropout"; None: kept)."""
    if id(n) in masked:  # x * (rand < keep) / keep: x, as in eval mode
        x, y = masked[id(n)], n.output[0]
        want, have = graph.info.get(y), graph.info.get(x)
        if want is not None and have is not None and want.dtype != have.dtype:
            # A 16-bit mask Mul computed in float32 (or x read through a Cast up).
            return [onnx.helper.make_node("Cast", [x], [y], name=n.name, to=want.dtype)
                    ], "dropout"
        return [onnx.helper.make_node("Identity", [x], [y], name=n.name)], "dropout"
    if n.op_type == "BatchNormalization" and len(n.input) >= 5:
        # The running variance of a PyTorch model is fed divided (running_variance.py),
        # and a 16-bit step compiled for a provider without a 16-bit BatchNorm reads
        # float32 Casts of its statistics (passes/providers/sixteen_bit.py).
        stats = [carried_value(_behind_copies(s, graph, producer), producer)
                 for s in n.input[3:5]]
        if _is_training_bn(n) and set(stats) <= carried:
            return _inference_batchnorm(graph, n, stats), "bn"
        if not _is_training_bn(n) and all(s in running for s in stats):
            return _inference_batchnorm(graph, n, [running[s] for s in stats]), "bn"
    if n.op_type == "Dropout" and len(n.input) > 2 and n.input[2]:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        del c.input[2:]
        return [c], "dropout"
    return [n], None


def _dropped_by_masks(graph: Graph, producer: dict[str, onnx.NodeProto]
                      ) -> dict[int, str]:
    """Dropout written as a random mask (the dynamo exporter's in-place ``nn.Dropout`` and
    ``bernoulli_``, timm's stochastic depth): ``Mul(x, Div(Cast(Less(RandomUniform(Like),
    keep)), keep))``, the mask's mean 1; or HuggingFace's ``drop_path``,
    ``Mul(Div(x, keep), Floor(Add(keep, RandomUniform(Like))))``. id of the Mul -> x, which
    eval mode passes on."""
    found: dict[int, str] = {}
    for n in graph.nodes:
        if n.op_type != "Mul" or len(n.input) != 2:
            continue
        for x, mask in ((n.input[0], n.input[1]), (n.input[1], n.input[0])):
            keep = _scaled_uniform_mask(mask, graph, producer)
            if keep is not None:
                found[id(n)] = x
                break
            kept = _floored_uniform_mask(x, mask, graph, producer)
            if kept is not None:
                found[id(n)] = kept
                break
    return found


def _floored_uniform_mask(scaled: str, mask: str, graph: Graph,
                          producer: dict[str, onnx.NodeProto]) -> str | None:
    """``x`` where ``scaled * mask`` is ``(x / keep) * Floor(keep + uniform [0, 1))``:
    HuggingFace's stochastic depth (``drop_path``, Swin, ConvNeXt, BEiT), whose eval mode
    passes ``x`` on."""
    floor, div = _made_by(mask, producer)[0], _made_by(scaled, producer)[0]
    if floor is None or floor.op_type != "Floor" or div is None or div.op_type != "Div":
        return None
    add = _made_by(floor.input[0], producer)[0]
    if add is None or add.op_type != "Add":
        return None
    for keep_in, draw_in in ((add.input[0], add.input[1]), (add.input[1], add.input[0])):
        draw = _made_by(draw_in, producer)[0]
        if draw is None or draw.op_type not in ("RandomUniform", "RandomUniformLike") or \
                float(attr(draw, "low", 0.0)) != 0.0 or float(attr(draw, "high", 1.0)) != 1.0:
            continue
        keep = scalar_constant(keep_in, graph, producer)
        scale = scalar_constant(div.input[1], graph, producer)
        if keep is not None and scale is not None and 0.0 < keep <= 1.0 and \
                abs(keep - scale) <= 1e-6 * keep:
            return div.input[0]
    return None


def _scaled_uniform_mask(value: str, graph: Graph, producer: dict[str, onnx.NodeProto]
                         ) -> float | None:
    """``keep`` where ``value`` is ``Cast(Less(uniform [0, 1), keep)) / keep``."""
    div = _made_by(value, producer)[0]
    if div is None or div.op_type != "Div":
        return None
    scale = scalar_constant(div.input[1], graph, producer)
    less, cast = _made_by(div.input[0], producer)
    if less is not None and less.op_type == "CastLike":
        cast, less = less, _made_by(less.input[0], producer)[0]
    if cast is None or cast.op_type not in ("Cast", "CastLike"):
        return None
    if less is None or less.op_type != "Less":
        return None
    draw = _made_by(less.input[0], producer)[0]
    if draw is None or draw.op_type not in ("RandomUniform", "RandomUniformLike") or \
            float(attr(draw, "low", 0.0)) != 0.0 or float(attr(draw, "high", 1.0)) != 1.0:
        return None
    keep = scalar_constant(less.input[1], graph, producer)
    if keep is None or scale is None or not 0.0 < keep <= 1.0 or \
            abs(keep - scale) > 1e-6 * keep:
        return None
    return keep


def _behind_copies(value: str, graph: Graph, producer: dict[str, onnx.NodeProto]) -> str:
    """``value`` behind any ``Mul`` by a scalar one: the copy of a running statistic that a
    recomputed training BatchNorm's clone reads (``passes/lowering/recompute.py``
    ``_own_copy``). Such a clone computes a forward output where the step runs the nodes
    that read it after the backward (a head off the loss path, as Inception's auxiliary
    classifier), so eval mode must find the statistics behind the copy too."""
    return behind(value, producer, lambda n: n.op_type == "Mul" and len(n.input) == 2
                  and scalar_constant(n.input[1], graph, producer) == 1.0)[0]


def _made_by(value: str, producer: dict[str, onnx.NodeProto]
             ) -> tuple[onnx.NodeProto | None, onnx.NodeProto | None]:
    """The node that computes ``value`` behind any Casts (a 16-bit step compiled for a
    provider without the 16-bit kernel reads float32 Casts of its operands and casts its
    results down: ``passes/providers/sixteen_bit.py``), and the last Cast passed (None:
    none)."""
    value, casts = behind(value, producer, lambda n: n.op_type == "Cast")
    return producer.get(value), (casts[-1] if casts else None)


def _is_training_bn(node: onnx.NodeProto) -> bool:
    return node.op_type == "BatchNormalization" and int(attr(node, "training_mode", 0)) == 1


def _inference_batchnorm(graph: Graph, node: onnx.NodeProto, stats: list[str]
                         ) -> list[onnx.NodeProto]:
    """The node in inference form over ``stats`` (mean, variance): one output, only
    ``epsilon`` (``momentum`` is meaningless there); a statistic of another element type
    than the node read (a float16 one a float32-computed node read through a Cast) is cast
    to it, the Casts before the node."""
    casts: list[onnx.NodeProto] = []
    read = []
    for was, stat in zip(node.input[3:5], stats, strict=True):
        name, made_casts = read_as(graph, was, stat)
        read.append(name)
        casts.extend(made_casts)
    made = onnx.helper.make_node(
        "BatchNormalization", [*node.input[:3], *read], [node.output[0]], name=node.name,
        epsilon=float(attr(node, "epsilon", 1e-5)))
    made.domain = node.domain
    return [*casts, made]
