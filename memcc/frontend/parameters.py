"""Which initializers a training step trains.

In: the forward graph with its loss appended, the BatchNormalization running statistics
(``batchnorm_running_stats``), the ``--freeze`` patterns. Out: the trained parameters, in
initializer order: float initializers on a differentiable path to the loss, less buffers
(known by name or from the dynamo exporter's signature) and frozen ones. No parameter at
all, or a pattern that matches none, is an ``InputError``.
"""

from __future__ import annotations

import fnmatch

import numpy as np

from memcc.errors import InputError
from memcc.frontend.autodiff import differentiable_values
from memcc.frontend.export_map import ExportMap
from memcc.frontend.export_signature import signature_of
from memcc.frontend.loss_ops import CLASS_WEIGHTS_KEY
from memcc.graph import Graph, attr

# torch buffers that exporters store as float initializers (never parameters).
BUFFER_SUFFIXES = ("inv_freq", "running_mean", "running_var", "num_batches_tracked")


def choose_parameters(graph: Graph, loss: str, bn_stats, freeze: tuple[str, ...],
                      source: str, emap: ExportMap | None = None) -> list[str]:
    """The parameters the step trains; an error when there are none. ``emap``: the
    exporter's records (``export_map_of(graph)``, read once by the caller)."""
    params = _trainable_parameters(graph, loss, bn_stats, emap)
    params = _apply_freeze(params, freeze, source, _pytorch_names(emap, params))
    if not params:
        raise InputError(
            f"{source}: no trainable parameters: no floating-point initializer lies on a "
            "differentiable path to the loss" + (" (or every one is frozen)" if freeze
                                                else "")
        )
    return params


def batchnorm_running_stats(graph: Graph) -> list[tuple[object, str, str]]:
    """(node, running_mean, running_var) of BatchNormalization nodes in training mode.

    A training-mode BatchNorm whose running statistics are computed values, not
    initializers, and whose running outputs nothing reads has no state to carry: it is
    ``F.batch_norm(x, None, None, training=True)`` as TorchScript writes it (timm's
    weight-standardised convolutions normalise their weights so), and normalises by the
    batch's statistics alone."""
    read = {i for n in graph.nodes for i in n.input if i} | set(graph.outputs)
    out = []
    for node in graph.nodes:
        if node.op_type != "BatchNormalization" or len(node.input) < 5:
            continue
        if not attr(node, "training_mode", 0):
            continue
        stats = node.input[3:5]
        if (not all(s in graph.initializers for s in stats)
                and not any(o in read for o in node.output[1:3] if o)):
            continue
        out.append((node, stats[0], stats[1]))
    return out


def _trainable_parameters(graph: Graph, loss: str, bn_stats, emap: ExportMap | None
                          ) -> list[str]:
    """Float initializers on a differentiable path to the loss, minus BN statistics.

    Scalar constants that exporters store as initializers (0-d tensors, one-element
    tensors TorchScript names ``onnx::...``, and one-element tensors the dynamo exporter's
    optimizer folded from constants alone: ``ExportMap.constants``) are constants of the
    model, not parameters.
    Exporters also store pre-transposed copies of weights under made-up names
    (``onnx::MatMul_12``, ``val_3``): those are the parameters the graph uses, so they train.
    ONNX cannot tell a torch buffer from a parameter; buffers known by name (rotary
    ``inv_freq``, BatchNorm statistics) are not trained, nor initializers that reach the
    loss only as a loss op's class weights (``frontend.loss_ops``).
    """
    excluded = {s for _, m, v in bn_stats for s in (m, v)}
    excluded.update(n for n in graph.initializers if n.endswith(BUFFER_SUFFIXES))
    sig = signature_of(graph)
    if sig is not None:  # the dynamo exporter says which initializers are torch buffers
        excluded.update(sig.buffers)
    if emap is not None:  # ... and which one-element ones it folded from constants alone
        excluded.update(emap.constants)
    for node in graph.nodes:
        if node.op_type == "BatchNormalization" and len(node.input) >= 5:
            excluded.update(node.input[3:5])
    candidates = [
        n for n, a in graph.initializers.items()
        if n not in excluded and graph.info[n].is_float and np.ndim(a) > 0
        and not (n.startswith("onnx::") and np.size(a) == 1)
    ]
    # A loss op's class weights are never trained (torch's nll_loss has no gradient for
    # them; TorchScript stores a weight buffer as an initializer): cut where they are read.
    cut = {n.name for n in graph.nodes
           if any(p.key == CLASS_WEIGHTS_KEY for p in n.metadata_props)}
    reachable = differentiable_values(graph, loss, candidates, cut)
    return [n for n in candidates if n in reachable]


def _pytorch_names(emap: ExportMap | None, params: list[str]) -> dict[str, tuple[str, ...]]:
    """Each parameter's initializer name and every PyTorch name it stands for, from the
    exporter's records (``ExportMap``): those merged into it, its tied aliases (GPT-2's
    dynamo export holds ``transformer.wte.weight`` as ``lm_head.weight``), and for a copy
    the exporter folded from parameters, theirs."""
    if emap is None:
        return {p: (p,) for p in params}
    return {p: tuple(dict.fromkeys((p, *emap.stands_for.get(p, ()), *emap.copies.get(p, ()))))
            for p in params}


def _apply_freeze(params: list[str], patterns: tuple[str, ...], source: str,
                  names: dict[str, tuple[str, ...]]) -> list[str]:
    """Drop parameters any of whose ``names`` matches a ``--freeze`` pattern; a pattern that
    matches nothing is an error (a typo would otherwise silently train everything)."""
    if not patterns:
        return params

    def frozen(p: str, pat: str) -> bool:
        return any(fnmatch.fnmatchcase(n, pat) for n in names.get(p, (p,)))

    for pat in patterns:
        if not any(frozen(p, pat) for p in params):
            aliased = [f"{p} = {' = '.join(names[p][1:])}" for p in params
                       if len(names.get(p, ())) > 1]
            raise InputError(
                f"{source}: --freeze '{pat}' matches no trainable parameter (by its "
                "initializer name or any PyTorch name it stands for, tied aliases "
                f"included); parameters are named like {', '.join(params[:3])}"
                + (f" ({len(aliased)} with other PyTorch names too, e.g. "
                   f"{'; '.join(aliased[:2])})" if aliased else "")
                + ". Patterns use shell wildcards, e.g. --freeze 'embeddings.*'."
            )
    return [p for p in params if not any(frozen(p, pat) for pat in patterns)]
