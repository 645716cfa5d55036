"""What keeps ORT from capturing a step as one CUDA graph, read from the graph alone.

Enters: a step's graph. Leaves: one line per blocker, naming the node or value and why
(empty when nothing visible blocks capture). ``device_step.DeviceStep`` asks before it
requests capture; ORT checks the rest at load and ``DeviceStep`` reports what it said.
"""

from __future__ import annotations

import numpy as np
import onnx

from memcc.frontend.constants import constant_value
from memcc.graph import Graph, node_label
from memcc.passes.providers.concat_for_cuda_graphs import MAX_INPUTS, is_wide_concat

# Ops whose CUDA kernels cannot be replayed from a captured graph: control flow (ORT
# refuses capture with subgraphs) and ORT's random generators, which draw their seed on the
# host at each run, so a replay would repeat the captured draw every step. Also a Concat of
# more than 32 inputs, which ORT's CUDA kernel refuses during capture (measured on an H200).
_CONTROL_FLOW = {"If", "Loop", "Scan"}
_RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
           "Multinomial", "Bernoulli"}


def capture_blockers(graph: Graph) -> list[str]:
    """What keeps ORT from capturing ``graph``'s step as one CUDA graph, read from the graph
    alone (each entry names the node or value and why); empty when nothing visible does.
    ORT checks the rest at load (nodes placed on the CPU provider, host copies) and
    ``DeviceStep`` reports what it said."""
    blockers = []
    producers = graph.producers()
    for node in graph.nodes:
        if node.op_type in _CONTROL_FLOW:
            blockers.append(f"{node_label(node)}: control flow ({node.op_type}) cannot be "
                            "captured")
        elif node.op_type in _RANDOM:
            blockers.append(f"{node_label(node)}: {node.op_type} draws on the host at each "
                            "run; a replayed graph would repeat one draw")
        elif node.op_type == "Dropout" and _dropout_trains(node, graph, producers):
            blockers.append(f"{node_label(node)}: a training-mode Dropout draws its mask on "
                            "the host at each run")
        elif is_wide_concat(node):
            # for_provider nests these on CUDA (passes/providers/concat_for_cuda_graphs.py);
            # a step that reaches the runner with one (planned elsewhere) runs uncaptured
            # instead of failing its capture.
            blockers.append(f"{node_label(node)}: a Concat of {len(node.input)} inputs (ORT "
                            f"captures at most {MAX_INPUTS})")
    for name in [*graph.inputs, *graph.outputs]:
        ti = graph.info.get(name)
        if ti is None or any(not isinstance(d, int) or d < 0 for d in ti.shape):
            blockers.append(f"'{name}': no static shape (a captured graph replays fixed "
                            "shapes)")
    return blockers


def _dropout_trains(node: onnx.NodeProto, graph: Graph, producers) -> bool:
    """Whether a Dropout may train: its ``training_mode`` input is given and not a constant
    False (a value computed at run time may be True)."""
    if len(node.input) < 3 or not node.input[2]:
        return False
    value = constant_value(graph, node.input[2], producers)
    return value is None or bool(np.asarray(value).reshape(-1)[0])
