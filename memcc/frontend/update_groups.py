"""Which parameters one optimizer update serves together, and how to find them again.

A convnet or a transformer has many vector parameters (BatchNorm and LayerNorm scales and
shifts, biases: 107 of ResNet-50's 161), each a few hundred floats, each with its own
update: four kernels per parameter for SGD with momentum, a dozen for AdamW. On CUDA each is
a launch for almost no work (PyTorch's ``foreach`` optimizers batch them for that reason).
ONNX has no op over a list of tensors, so memcc writes them as one update over their
concatenation: the vectors and their gradients are joined (``Concat``), the optimizer runs
once over the joined vector with one joined state (``grouped.float32.momentum``), and the
new value is split back into each parameter's (``Split``). The arithmetic is element-wise,
so each element goes through the same operations as alone: the step's outputs are the
same bits as with an update per parameter (tests/test_update_groups.py). The price is
the copies (three vector-sized, a few hundred kilobytes per step on ResNet-50) and that the
group's gradients all live until the last of them is made.

``update_units`` reads the groups back off a built step (the parameters whose new values
one ``Split`` writes), for whatever must keep a group together: the ZeRO deal of
parameters to ranks (``passes.analysis.rank_step``), gradient buckets (``dist.buckets``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from memcc.graph import Graph

GROUP_PREFIX = "grouped"


# Parameters per group at most: a Concat of more inputs cannot be captured in a CUDA graph
# (ORT's CUDA Concat takes at most 32 input pointers then; passes/providers/
# concat_for_cuda_graphs.py), and a smaller group's gradients are complete sooner, so its
# update can run earlier in the backward.
MAX_GROUP = 32


def vector_groups(graph: Graph, params: Sequence[str]) -> list[list[str]]:
    """The parameters updated together: the floating-point vectors (rank 1), by dtype in
    ``params``' order, cut into as few runs of at most ``MAX_GROUP`` as there can be, as
    equal as they can be; a dtype with one vector has none."""
    by_dtype: dict[np.dtype, list[str]] = {}
    for p in params:
        ti = graph.info.get(p)
        if ti is None or ti.shape is None or len(ti.shape) != 1:
            continue
        if not np.issubdtype(ti.np_dtype, np.floating):
            continue
        by_dtype.setdefault(np.dtype(ti.np_dtype), []).append(p)
    groups = []
    for ps in by_dtype.values():
        k = -(-len(ps) // MAX_GROUP)
        sizes = [len(ps) // k + (1 if i < len(ps) % k else 0) for i in range(k)]
        starts = [sum(sizes[:i]) for i in range(k)]
        groups += [ps[a:a + n] for a, n in zip(starts, sizes, strict=True) if n > 1]
    return groups


def group_name(graph: Graph, dtype: np.dtype) -> str:
    """A name for a group's joined vector that no value of ``graph`` has, nor its state."""
    base = f"{GROUP_PREFIX}.{np.dtype(dtype).name}"
    name, k = base, 1
    while any(n in graph.info for n in (name, f"{name}.new", f"{name}.momentum",
                                        f"{name}.exp_avg", f"{name}.exp_avg_sq")):
        k += 1
        name = f"{base}_{k}"
    return name


def update_units(graph: Graph, state: Mapping[str, str], params: Sequence[str]
                 ) -> list[list[str]]:
    """``params`` in the units their updates come in: each group's parameters (their new
    values, ``state``'s outputs, are written by one Split), every other parameter alone."""
    producer = graph.producers()
    new_of = {i: o for o, i in state.items()}
    units: dict[str, list[str]] = {}
    for p in params:
        node = producer.get(new_of.get(p, ""))
        key = f"split:{node.name}" if node is not None and node.op_type == "Split" else p
        units.setdefault(key, []).append(p)
    return list(units.values())


STATE_KINDS = ("momentum", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class JoinedState:
    """A group's joined optimizer state input (``grouped.float32.momentum``) and what it
    holds, in order: each parameter's state under the name an update per parameter gives
    it (``P.momentum``), with the parameter's shape."""

    name: str
    parts: tuple[tuple[str, tuple[int, ...]], ...]


def joined_states(graph: Graph, state: Mapping[str, str]) -> list[JoinedState]:
    """The joined state inputs of ``graph``'s grouped updates: ``G.kind``, where ``G`` is
    the Concat joining the group's parameters (its inputs, in order)."""
    producer = graph.producers()
    out = []
    for value in state.values():
        group, _, kind = value.rpartition(".")
        concat = producer.get(group)
        if kind not in STATE_KINDS or concat is None or concat.op_type != "Concat" \
                or not group.startswith(GROUP_PREFIX):
            continue
        out.append(JoinedState(value, tuple((f"{p}.{kind}", tuple(graph.info[p].shape))
                                            for p in concat.input)))
    return out


def per_parameter(tensors: Mapping[str, np.ndarray], joined: Sequence[JoinedState]
                  ) -> dict[str, np.ndarray]:
    """``tensors`` with each joined state split into its parameters' (views, no copy):
    the state as an update per parameter holds it, what checkpoints store, so that a
    checkpoint does not depend on whether the step groups its updates."""
    out = dict(tensors)
    for j in joined:
        if j.name not in out:
            continue
        flat, at = np.asarray(out.pop(j.name)), 0
        for name, shape in j.parts:
            n = int(np.prod(shape))
            out[name] = flat[at:at + n].reshape(shape)
            at += n
    return out


def joined(tensors: Mapping[str, np.ndarray], joined_: Sequence[JoinedState]
           ) -> dict[str, np.ndarray]:
    """``per_parameter``'s inverse: each joined state made from its parameters' where
    ``tensors`` has them all (the other way round, left as it is)."""
    out = dict(tensors)
    for j in joined_:
        names = [name for name, _ in j.parts]
        if j.name in out or not all(n in out for n in names):
            continue
        out[j.name] = np.concatenate([np.asarray(out.pop(n)).reshape(-1) for n in names])
    return out
