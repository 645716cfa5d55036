"""Whether compile should build a convnet's stem over batch chunks (``frontend/batch_chunks.py``).

Each chunk setting compile tries is a whole plan (seconds to minutes on a convnet), so the
stem's batch chunks are tried only where no plan of the unchunked step can go low enough:
where the stem's BatchNorm backward bound (what is live all step, i.e. inputs, parameters
and optimizer state, plus three tensors the size of the stem BatchNorm's input, which
its backward holds at once and no recompute or variant removes) is at least
``STEM_BOUND_SHARE`` of the step as built's peak. Below it, the unchunked step's own
floors (a ResNet-50's deeper layers, MobileNetV2's depthwise gradients) are where the
smallest budget stops, and the chunked stem would only add time and compile time.
"""

from __future__ import annotations

from memcc.graph import Graph, attr
from memcc.passes.analysis.liveness import allocation_bytes, analyze_liveness

# The target for an unseen convnet's --budget min: 30% of the step as built. A
# stem bound above it makes the target unreachable without the chunks.
STEM_BOUND_SHARE = 0.30


def stem_bound(step: Graph) -> tuple[int, int]:
    """(the stem BatchNorm backward's bound, the step as built's peak) in allocated bytes;
    (0, peak) where no training-mode BatchNorm reads a Conv of a graph input."""
    producers = step.producers()
    data = {i for i in step.inputs if i not in step.initializers}
    stem = 0
    for node in step.nodes:
        if node.op_type != "BatchNormalization" or not attr(node, "training_mode", 0):
            continue
        conv = producers.get(node.input[0])
        if conv is not None and conv.op_type == "Conv" and conv.input[0] in data:
            stem = max(stem, allocation_bytes(step.info[node.input[0]].nbytes))
    peak = analyze_liveness(step).peak_bytes
    if not stem:
        return 0, peak
    held = sum(allocation_bytes(step.info[v].nbytes)
               for v in set(step.inputs) | set(step.initializers) if v in step.info)
    return held + 3 * stem, peak


def stem_bound_share(step: Graph) -> float:
    """The stem bound as a share of the step as built's peak (0 without a stem)."""
    bound, peak = stem_bound(step)
    return bound / peak if peak else 0.0
