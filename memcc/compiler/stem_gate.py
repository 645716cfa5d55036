"""Whether compile should build a convnet's stem over batch chunks (``frontend/batch_chunks.py``).

Each chunk setting compile tries is a whole plan (seconds to minutes on a convnet), so the
stem's batch chunks are tried only where they can matter, judged on the step as built:

- the stem BatchNorm backward's bound (what is live all step: inputs, parameters and
  optimizer state; plus three tensors the size of the stem BatchNorm's input, which its
  backward holds at once and no recompute or variant removes) is at least
  ``STEM_BOUND_SHARE`` of the step as built's peak: no plan of the unchunked step reaches
  below it;
- those three tensors alone are at least ``STEM_TENSORS_SHARE`` of that peak: the chunks
  take off at most them (less one chunk's), so where they are small (a zoo ResNet-18 at 8
  x 64 px: 12.6%, its parameters and momentum the rest of the bound) the floor barely
  moves, and the second plan would only cost compile time and the stem's extra
  convolutions;
- and they are at least ``STEM_TENSORS_MIN_BYTES``: on a step of a few megabytes the
  budget compile reports is mostly its fixed slack and the heap of small buffers, of which
  the chunked step has hundreds more (a 0.5 MB transformers ResNet at batch 8: the chunked
  plan's peak 23% lower, its budget 12% higher).
"""

from __future__ import annotations

from memcc.graph import Graph, attr
from memcc.passes.analysis.liveness import allocation_bytes, analyze_liveness

# The target for an unseen convnet's --budget min: 30% of the step as built. A
# stem bound above it makes the target unreachable without the chunks.
STEM_BOUND_SHARE = 0.30
# The stem's three tensors, as a share of the step as built's peak, that make a plan of the
# chunked step worth its compile time (small-width ResNet exports: 36-52%).
STEM_TENSORS_SHARE = 0.20
# ... and in bytes: the budget's fixed slack (``CompileOptions``: 1 MiB).
STEM_TENSORS_MIN_BYTES = 1 << 20


def stem_bound(step: Graph) -> tuple[int, int, int]:
    """(bytes live all step, the stem BatchNorm's input, the step as built's peak) in
    allocated bytes; the stem's is 0 where no training-mode BatchNorm reads a Conv of a
    graph input."""
    producers = step.producers()
    data = {i for i in step.inputs if i not in step.initializers}
    stem = 0
    for node in step.nodes:
        if node.op_type != "BatchNormalization" or not attr(node, "training_mode", 0):
            continue
        conv = producers.get(node.input[0])
        if conv is not None and conv.op_type == "Conv" and conv.input[0] in data:
            stem = max(stem, allocation_bytes(step.info[node.input[0]].nbytes))
    if not stem:
        return 0, 0, 0
    held = sum(allocation_bytes(step.info[v].nbytes)
               for v in set(step.inputs) | set(step.initializers) if v in step.info)
    return held, stem, analyze_liveness(step).peak_bytes


def stem_shares(step: Graph) -> tuple[float, float, int]:
    """(the stem bound, the stem's three tensors) as shares of the step as built's peak,
    and those tensors' bytes ((0, 0, 0) without a stem)."""
    held, stem, peak = stem_bound(step)
    return ((held + 3 * stem) / peak, 3 * stem / peak, 3 * stem) if peak else (0.0, 0.0, 0)


def worth_chunking(shares: tuple[float, float, int]) -> bool:
    """Whether ``stem_shares`` are high enough for compile to plan the chunked stem."""
    return (shares[0] >= STEM_BOUND_SHARE and shares[1] >= STEM_TENSORS_SHARE
            and shares[2] >= STEM_TENSORS_MIN_BYTES)


def gate(found: dict[str, int], given: int | None, step: Graph
         ) -> tuple[dict[str, int], tuple[float, float, int] | None]:
    """``found`` (sites per chunk kind) without the stem (``batch``) where its chunks are
    not worth a plan, judged on the step as built ``step``, and its shares (None: not
    asked: no stem, or ``given``, its count set by a flag)."""
    if not found.get("batch") or given is not None:
        return found, None
    shares = stem_shares(step)
    return (found if worth_chunking(shares) else {**found, "batch": 0}), shares
