"""The batch a run feeds, and the step contract it is checked against.

Enters: a step's graph (its ``memcc.*`` metadata) and either a seed or ``--data FILE.npz``.
Leaves: a ``StepSpec`` (loss, data inputs, carried state, integer ranges) and one batch,
one array per data input: made up from the seed (``synthetic_feeds``), or read from the
file and checked against the step before anything runs (``load_data``; the checks are
``backend.data``'s, shared with ``memcc train``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx import TensorProto

from memcc.backend.data import as_step_dtype, check_int_range, read_npz, require_arrays
from memcc.errors import InputError
from memcc.graph import Graph, TensorInfo
from memcc.step import TrainingStep
from memcc.step import describe_type as _describe


@dataclass(frozen=True)
class StepSpec:
    """The training-step contract read from a file's ``memcc.*`` metadata."""

    loss: str
    data_inputs: tuple[str, ...]
    state: Mapping[str, str]  # output name -> input name it replaces next step
    int_ranges: Mapping[str, tuple[int, int]]
    # --ignore-index: input -> the value its range check also accepts (labels)
    ignored_values: Mapping[str, int] = field(default_factory=dict)


def read_step_spec(graph: Graph, *, source: str = "<model>") -> StepSpec:
    """Read the ``memcc.*`` metadata (through ``TrainingStep``), or say how to make a step."""
    step = TrainingStep.of(graph).validate(source)
    return StepSpec(step.loss, step.data_inputs, step.state, step.int_ranges,
                    step.ignored_values)


def synthetic_feeds(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """One fixed batch for every input without a stored value, reproducible from ``seed``.

    Float data ~ N(0, 1); integer inputs listed in ``memcc.int_ranges`` (token ids, labels)
    uniform in ``[low, high)`` (also with ``--ignore-index``: no drawn label is ignored
    unless the ignored value lies in the range); other integers (attention masks) ones; bools
    a padding mask (``_padding_mask``).
    """
    step = TrainingStep.of(graph)
    names = step.data_or_free_inputs()
    ranges = step.int_ranges
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for name in names:
        ti = graph.info.get(name)
        if ti is None:
            raise InputError(f"data input '{name}' has no static shape; bind it with --dim")
        feeds[name] = _synthetic_array(name, ti, ranges.get(name), rng)
    return feeds


def _synthetic_array(name: str, ti: TensorInfo, rng_range, rng: np.random.Generator
                     ) -> np.ndarray:
    dt = ti.np_dtype
    if ti.is_float:
        return rng.standard_normal(ti.shape, dtype=np.float32).astype(dt)
    if ti.dtype == TensorProto.BOOL:
        return _padding_mask(ti.shape, rng)
    if np.issubdtype(dt, np.integer):
        if rng_range is not None:
            low, high = int(rng_range[0]), int(rng_range[1])
            return rng.integers(low, high, size=ti.shape, dtype=np.int64).astype(dt)
        return np.ones(ti.shape, dtype=dt)
    raise InputError(f"data input '{name}' has dtype {dt}, which memcc cannot synthesise; "
                     "pass --data FILE.npz")


def _padding_mask(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A bool input as a padding mask: each row along the last axis False for a drawn
    length of at least one, then True (the padded tail). Under either convention (True =
    padding, as nn.Transformer's key_padding_mask; True = attend, as scaled_dot_product_
    attention's masks) every row keeps positions to attend to; all True, as before, masked
    every key of nn.TransformerEncoder and left its loss and gradients NaN."""
    if not shape:
        return np.array(False)
    length = shape[-1]
    lead = tuple(shape[:-1])
    kept = rng.integers(1, length, size=lead) if length > 1 else np.ones(lead, np.int64)
    return np.arange(length) >= kept[..., None]


def load_data(path: str | os.PathLike, graph: Graph, spec: StepSpec) -> dict[str, np.ndarray]:
    """Read ``--data FILE.npz``: one array per data input, named like the input."""
    p = Path(path)
    arrays = read_npz(p)
    want = {n: graph.info[n] for n in spec.data_inputs}
    require_arrays(p, arrays, {n: _describe(ti) for n, ti in want.items()})
    feeds = {}
    for name, ti in want.items():
        arr = arrays[name]
        wrong = f"--data {p}: array '{name}' has shape {list(arr.shape)}, dtype {arr.dtype}"
        if tuple(arr.shape) != ti.shape:
            raise InputError(f"{wrong}; the step expects {_describe(ti)}")
        arr = as_step_dtype(arr, ti.np_dtype, wrong)
        check_int_range(p, name, arr, spec.int_ranges.get(name),
                        spec.ignored_values.get(name))
        feeds[name] = np.asarray(arr, order="C")
    return feeds


def bfloat16_feeds(graph: Graph) -> tuple[list[str], list[str]]:
    """The values a run of ``graph`` would feed (its inputs: the batch, carried state) and
    fetch (its outputs: gradients, updated state) as bfloat16 arrays: a model exported
    after ``.to(torch.bfloat16)``. Carried state counts where it is stored in the graph
    (a parameter the step updates is fed back each step). A ``--precision bf16`` step has
    none: its inputs, outputs and master weights are float32, its bfloat16 values inside."""
    step = TrainingStep.of(graph)
    fed = dict.fromkeys([*graph.inputs, *step.state.values()])
    bf16 = TensorProto.BFLOAT16
    inputs = [n for n in fed if n in graph.info and graph.info[n].dtype == bf16]
    outputs = [n for n in graph.outputs if n in graph.info and graph.info[n].dtype == bf16]
    return inputs, outputs


def _listed(names: list[str]) -> str:
    """The first four names quoted, and how many more."""
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return ", ".join(f"'{n}'" for n in names[:4]) + more


def refuse_bfloat16_feeds(graph: Graph, *, source: str, doing: str, instead: str = "") -> None:
    """Raise ``InputError`` where a run of ``graph`` would feed or fetch bfloat16 arrays
    (``bfloat16_feeds``): numpy has no bfloat16 of its own, and onnxruntime's Python API
    (1.31) neither converts ``ml_dtypes``' bfloat16 arrays into inputs (``memcc run`` failed
    with "Actual: (tensor(string))", a compile's measurement with "Numpy_type 256 can't be
    converted to MLDataType") nor bfloat16 outputs into arrays, on any provider. ``doing``:
    what would have run it ("run the step"); ``instead``: what the command can do without
    running the step, said first."""
    inputs, outputs = bfloat16_feeds(graph)
    if not inputs and not outputs:
        return
    stored = set(TrainingStep.of(graph).state.values()) | set(graph.initializers)
    batch = [n for n in inputs if n not in stored]
    carried = [n for n in inputs if n in stored]
    parts = [f"{len(names)} bfloat16 {kind} ({_listed(names)})"
             for kind, names in (("input(s)", batch), ("parameter(s) or state", carried),
                                 ("output(s)", [] if inputs else outputs)) if names]
    what = " and ".join(parts)
    raise InputError(
        f"{source}: cannot {doing}: the step has {what}, from a model exported in "
        "bfloat16, and ONNX Runtime's Python API feeds and returns no bfloat16 arrays "
        "(numpy has no bfloat16 type), on any provider. "
        + (f"{instead}. " if instead else "")
        + "To train it, export the model in float32 and build it with --precision bf16 "
        "(bfloat16 compute, float32 inputs, outputs and master weights), or export it in "
        "float16")
