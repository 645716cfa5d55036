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

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from memcc.frontend.emit import Emitter
from memcc.graph import Graph, TensorInfo

T = TypeVar("T")

GROUP_PREFIX = "grouped"
# The optimizer state a parameter's update carries (``frontend/update.py``'s names).
STATE_KINDS = ("momentum", "exp_avg", "exp_avg_sq")


# Values per group at most (parameters here, running statistics in passes/providers/
# batchnorm_for_cuda.py): a Concat of more inputs cannot be captured in a CUDA graph (ORT's
# CUDA Concat takes at most 32 input pointers then; passes/providers/
# concat_for_cuda_graphs.py), and a smaller group's gradients are complete sooner, so its
# update can run earlier in the backward.
MAX_GROUP = 32


def vector_groups(graph: Graph, params: Sequence[str]) -> list[list[str]]:
    """The parameters updated together: the floating-point vectors (rank 1) in
    ``balanced_runs`` by dtype; a run of one vector is no group."""
    vectors = [p for p in params if (ti := graph.info.get(p)) is not None
               and ti.shape is not None and len(ti.shape) == 1
               and np.issubdtype(ti.np_dtype, np.floating)]
    return [run for run in balanced_runs(vectors, lambda p: graph.info[p].dtype)
            if len(run) > 1]


def balanced_runs(items: Sequence[T], key: Callable[[T], Hashable]) -> list[list[T]]:
    """``items`` by ``key`` (in their order), each key's cut into as few runs of at most
    ``MAX_GROUP`` as there can be, as equal as they can be."""
    by_key: dict[Hashable, list[T]] = {}
    for item in items:
        by_key.setdefault(key(item), []).append(item)
    runs = []
    for same in by_key.values():
        k = -(-len(same) // MAX_GROUP)
        sizes = [len(same) // k + (1 if i < len(same) % k else 0) for i in range(k)]
        starts = [sum(sizes[:i]) for i in range(k)]
        runs += [same[a:a + n] for a, n in zip(starts, sizes, strict=True)]
    return runs


def emit_joined(emit: Emitter, parts: Sequence[Sequence[str]], outputs: Sequence[str],
                update: Callable[..., str], *, name: str | None = None) -> list[str]:
    """One ``update`` over joined vectors: each of ``parts`` (lists of vectors of the same
    sizes, in the same order) joined by a Concat (the first one named ``name``, where
    given), ``update`` called on the joined values, its result split back into
    ``outputs``, with the first part's shapes. Per element the same arithmetic as on each
    vector alone."""
    infos = [emit.info(v) for v in parts[0]]
    sizes = [int(np.prod(ti.shape)) for ti in infos]
    flat = TensorInfo(infos[0].dtype, (sum(sizes),))
    joins = [emit.op("Concat", list(vs), outputs=[name] if name and k == 0 else 1,
                     info=flat, axis=0) for k, vs in enumerate(parts)]
    return emit.op("Split", [update(*joins), emit.ints(sizes)], outputs=list(outputs),
                   info=infos, axis=0)


def group_name(graph: Graph, dtype: np.dtype) -> str:
    """A name for a group's joined vector that no value of ``graph`` has, nor its state."""
    base = f"{GROUP_PREFIX}.{np.dtype(dtype).name}"
    name, k = base, 1
    while any(n in graph.info for n in (name, f"{name}.new",
                                        *(f"{name}.{kind}" for kind in STATE_KINDS))):
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
