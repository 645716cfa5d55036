"""What a checkpoint records besides the carried values, so that it can be refused when it
does not belong: the step's signature (carried values, optimizer, loss, data inputs) and,
for ``memcc train``, where in the data the run stood (seed, batches consumed, the data's
digest).

Values in, plain dicts out; the files themselves are ``backend.checkpoint``'s.
"""

from __future__ import annotations

from memcc.backend import checkpoint as ckpt
from memcc.backend.data import Dataset
from memcc.errors import InputError
from memcc.graph import Graph
from memcc.step import TrainingStep


def step_signature(graph: Graph, spec: TrainingStep) -> dict:
    """What a checkpoint must share with a step to belong to it (``backend.checkpoint``)."""
    carried = {inp: (graph.info[inp].np_dtype, tuple(graph.info[inp].shape))
               for inp in spec.state.values()}
    data = {n: [str(graph.info[n].np_dtype), list(graph.info[n].shape)]
            for n in spec.data_or_free_inputs() if n in graph.info}
    return ckpt.signature(carried, {"optimizer": spec.optimizer.get("name"),
                                    "loss": spec.loss, "data_inputs": data})


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


