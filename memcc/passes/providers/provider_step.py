"""The step as one execution provider runs it: every provider rewrite, in order, in one call.

In: a training step and the provider ("cpu" or "cuda"). Out: the step rewritten for it and
the pass contract's summary (``memcc/pass_contract.py``): ``{"batchnorm_rewritten": n}``,
and ``"sixteen_bit_emulated"`` (op -> nodes) where a 16-bit node had to compute in float32.
compile (``compiler.loading``), run and train (``backend.device_step.step_for_provider``)
and tune call this one function, so that they plan and run the same step.

On CUDA: training-mode BatchNorm as standard ops (``batchnorm_for_cuda``), then every
per-channel sum (BatchNorm's statistics, the gradients of its scale and bias: reductions over
axes 0, 2, 3 of an NCHW tensor) as sums over trailing axes: ORT's CUDA kernel adds
leading-axis sums with atomics, and on an H200 the trailing form ran issue 29's ResNet-50 step
in 321 ms instead of 479 (ResNet-18: 15.1 against 18.4 ms), and gives the same bits every
run. They were a Transpose and a trailing sum (``deterministic_reductions``); now two stages,
over H*W and then over N, with only the [N, C] partials transposed (``per_channel_sums``:
1.3-2.1x faster per sum on the H200). Also on CUDA: the weight gradients
of k x k convolutions with few channels and many pixels as a MatMul over patches
(``conv_weight_grad_cuda``: ``conv_weight_grads_as_patches`` and ``patch_bytes_max`` in the
summary; ``MEMCC_CONV_WEIGHT_GRAD=conv`` keeps the Conv form). Then every Concat of more than
32 inputs as nested ones, which a CUDA graph can capture (``concat_for_cuda_graphs``:
``concats_split``). On every provider, last: a 16-bit
node the provider has no kernel for computes in float32 between casts (``sixteen_bit``).
"""

from __future__ import annotations

from memcc.graph import Graph
from memcc.passes.providers.batchnorm_for_cuda import expand_training_batchnorm
from memcc.passes.providers.concat_for_cuda_graphs import split_wide_concats
from memcc.passes.providers.conv_weight_grad_cuda import (
    chunk_floor,
    conv_weight_grads_as_patches,
    patches_wanted,
)
from memcc.passes.providers.deterministic_reductions import per_channel, to_trailing_axes
from memcc.passes.providers.per_channel_sums import per_channel_two_stage
from memcc.passes.providers.sixteen_bit import for_provider as sixteen_bit


def for_provider(graph: Graph, provider: str) -> tuple[Graph, dict]:
    """The step as ``provider`` runs it, and what was rewritten (module docstring)."""
    rewritten_bn = 0
    conv: dict = {}
    if provider == "cuda":
        graph, report = expand_training_batchnorm(graph)
        rewritten_bn = int(report["batchnorm_rewritten"])
        if patches_wanted():
            graph, conv = conv_weight_grads_as_patches(graph, chunk_floor=chunk_floor())
        if not conv.get("conv_weight_grads_as_patches"):
            conv = {}  # the summary names only what was rewritten
        # Per-channel sums of float32 NCHW tensors in two stages (no activation-sized
        # Transpose); the rest (16-bit ones, ReduceLogSum, a classifier's [N, C] bias
        # gradient) as a Transpose and a trailing sum. Not ``per_channel_by_matmul``: it
        # moved ResNet-50's first loss by 1.6e-4 (cuBLAS's TF32, likely; not checked).
        graph, _ = per_channel_two_stage(graph)
        graph, _ = to_trailing_axes(graph, only=per_channel)
        graph, wide = split_wide_concats(graph)  # after the patches' 49-view Concats
        if wide["concats_split"]:
            conv = {**conv, **wide}
    graph, emulated = sixteen_bit(graph, provider)
    return graph, {"batchnorm_rewritten": rewritten_bn, **conv, **emulated}
