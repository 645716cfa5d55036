"""What a checkpoint records besides the carried values, so that it can be refused when it
does not belong: the step's signature (carried values, optimizer, loss, data inputs) and,
for ``memcc train``, where in the data the run stood (seed, batches consumed, the data's
digest).

The carried values are stored as an update per parameter holds them: a grouped update's
joined optimizer state (``frontend/update_groups.py``) is split into its parameters' on
the way out and joined on the way in, so a checkpoint resumes a step built with or without
grouped updates (one written before memcc grouped them, too).

Values in, plain dicts out; the files themselves are ``backend.checkpoint``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from memcc.backend import checkpoint as ckpt
from memcc.backend.data import Dataset
from memcc.errors import InputError
from memcc.frontend.update_groups import joined, joined_states, per_parameter
from memcc.graph import Graph
from memcc.step import TrainingStep


def step_signature(graph: Graph, spec: TrainingStep, batch: int | None = None) -> dict:
    """What a checkpoint must share with a step to belong to it (``backend.checkpoint``);
    ``batch``: the data inputs' first axis as the checkpoints have it (the global batch of
    data-parallel ranks), else the step's."""
    data = {n: [str(graph.info[n].np_dtype),
                [batch if batch is not None else graph.info[n].shape[0],
                 *graph.info[n].shape[1:]]]
            for n in spec.data_or_free_inputs() if n in graph.info}
    return ckpt.signature(carried_types(graph, spec), {
        "optimizer": spec.optimizer.get("name"), "loss": spec.loss, "data_inputs": data})


def carried_types(graph: Graph, spec: TrainingStep) -> dict[str, tuple]:
    """Carried value -> (dtype, shape) as checkpoints hold them: a grouped update's joined
    optimizer state as its parameters' (``frontend/update_groups.py``)."""
    types = {inp: (graph.info[inp].np_dtype, tuple(graph.info[inp].shape))
             for inp in spec.state.values()}
    for j in joined_states(graph, spec.state):
        dtype = types.pop(j.name)[0]
        types.update({name: (dtype, shape) for name, shape in j.parts})
    return types


def checkpoint_tensors(graph: Graph, spec: TrainingStep, state: Mapping[str, np.ndarray]
                       ) -> dict[str, np.ndarray]:
    """The carried values as a checkpoint stores them (``carried_types``; views)."""
    return per_parameter(state, joined_states(graph, spec.state))


def step_tensors(graph: Graph, spec: TrainingStep, tensors: Mapping[str, np.ndarray]
                 ) -> dict[str, np.ndarray]:
    """A checkpoint's values as the step carries them (``checkpoint_tensors``' inverse)."""
    return joined(tensors, joined_states(graph, spec.state))


def run_data_state(seed: int, position: int, dataset: Dataset, fingerprint: str) -> dict:
    """Where a run stands in its data (``position`` batches in), for its checkpoint."""
    epoch, batch = divmod(position, dataset.batches_per_epoch)
    return {"seed": seed, "batches_consumed": position, "epoch": epoch,
            "batch_in_epoch": batch, "batches_per_epoch": dataset.batches_per_epoch,
            "data": fingerprint, "samples": dataset.num_samples}


def check_run_data_state(c: ckpt.Checkpoint, seed: int, fingerprint: str) -> None:
    """A resumed run must continue the same data order: the same seed and data."""
    ds = c.data_state
    if not ds:
        return
    if ds.get("seed") != seed:
        raise InputError(f"{c.path}: this run was started with --seed {ds.get('seed')}; resume "
                         f"it with the same seed (got --seed {seed}) so the data order "
                         "continues where it stopped")
    if ds.get("data") != fingerprint:
        raise InputError(f"{c.path}: this run was trained on other data ({ds.get('samples')} "
                         "samples, another content digest); resume it with the same --data")


