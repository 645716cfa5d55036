"""Training data for ``memcc train``: arrays checked against the step, batches in a seeded order.

The data is an ``.npz`` file, or a directory of them (shards, taken in file-name order),
with one array per data input of the step, named like the input, whose first axis is the
sample axis. Everything is checked before a single step runs (a shape mismatch found after
an hour of training is an hour lost): every shard, every array's name, dtype and per-sample
shape, equal sample counts within a shard, and integer ranges where the step records them
(token ids, labels).

Order: the step has a fixed batch size (the first axis of its data inputs), so an epoch is
``samples // batch`` full batches; the remainder is dropped, as ``drop_last=True`` does. Batch
``k`` of the whole run (``k = 0, 1, ...``) is slice ``k mod batches_per_epoch`` of epoch
``k // batches_per_epoch``'s permutation, drawn from ``numpy.random.default_rng([seed,
epoch])``. So the data order position is just ``k`` (the number of batches consumed): a
resumed run that knows ``k``, the seed and the data gets the very same batches, without
replaying anything. Shards are read into memory.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memcc.errors import InputError
from memcc.graph import Graph, TensorInfo
from memcc.step import LABELS, TrainingStep


@dataclass(frozen=True)
class DataInput:
    """One data input of the step: name, dtype, the shape of one sample, the batch size."""

    name: str
    dtype: np.dtype
    sample_shape: tuple[int, ...]
    batch_size: int
    int_range: tuple[int, int] | None = None
    ignored: int | None = None     # --ignore-index: a value also allowed, outside the range

    def describe(self) -> str:
        return (f"samples of shape {list(self.sample_shape)} dtype {self.dtype} (the step "
                f"takes batches of {[self.batch_size, *self.sample_shape]})")


def data_inputs(graph: Graph, step: TrainingStep | None = None) -> list[DataInput]:
    """The step's data inputs and the batch size they share, or an error saying why not."""
    step = step or TrainingStep.of(graph)
    out: list[DataInput] = []
    for name in step.data_or_free_inputs():
        ti: TensorInfo | None = graph.info.get(name)
        if ti is None or not ti.shape:
            raise InputError(f"data input '{name}' has no batch axis (shape "
                             f"{list(ti.shape) if ti else 'unknown'}); memcc train batches "
                             "along the first axis")
        out.append(DataInput(name, ti.np_dtype, tuple(ti.shape[1:]), int(ti.shape[0]),
                             step.int_ranges.get(name), step.ignored_values.get(name)))
    sizes = {d.batch_size for d in out}
    if len(sizes) > 1:
        listed = ", ".join(f"'{d.name}' {d.batch_size}" for d in out)
        raise InputError(f"the step's data inputs have different first axes ({listed}); "
                         "memcc train needs one batch size for all of them")
    return out


def describe_data(step: str | os.PathLike) -> str:
    """What ``--data`` must hold for the step file ``step``: one line per data input (its
    name, per-sample shape, dtype and values), for a run given no data."""
    from memcc.backend.step_feeds import refuse_bfloat16_feeds  # it imports this module
    from memcc.frontend.load import load_graph

    graph = load_graph(step, mapped=True)
    TrainingStep.of(graph).validate(str(step))
    # No data can feed a bfloat16 step: say so rather than describe arrays no .npz holds.
    refuse_bfloat16_feeds(graph, source=str(step), doing="train the step")
    lines = []
    for d in data_inputs(graph):
        values = "" if d.int_range is None else \
            f", values in [{d.int_range[0]}, {d.int_range[1] - 1}]"
        if d.ignored is not None:
            values += f" or {d.ignored} (ignored by the loss)"
        lines.append(f"  '{d.name}': {d.describe()}{values}")
    return ("an .npz file (or a directory of .npz shards) with one array per data input, "
            "first axis the samples:\n" + "\n".join(lines))


@dataclass(frozen=True)
class Dataset:
    """All samples of the data, checked, with the order of batches for a seed."""

    source: str
    arrays: Mapping[str, np.ndarray]
    num_samples: int
    batch_size: int
    files: tuple[str, ...]
    # what reading the data changed or left out: arrays given in another dtype than the
    # step's (converted), arrays no input reads, files of a shard directory not read
    notes: tuple[str, ...] = ()
    _orders: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    @property
    def dropped_per_epoch(self) -> int:
        return self.num_samples - self.batches_per_epoch * self.batch_size

    def fingerprint(self) -> str:
        """Names, shapes, dtypes and a digest of the bytes: resuming on other data fails."""
        h = hashlib.sha256()
        for name in sorted(self.arrays):
            a = self.arrays[name]
            h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
            h.update(memoryview(np.asarray(a, order="C").reshape(-1)).cast("B"))
        return h.hexdigest()[:32]

    def indices(self, k: int, seed: int) -> np.ndarray:
        """Sample indices of batch ``k`` of the run (see the module docstring)."""
        epoch, j = divmod(int(k), self.batches_per_epoch)
        perm = self._orders.get((seed, epoch))
        if perm is None:  # one permutation per epoch, kept while the epoch lasts
            perm = np.random.default_rng([int(seed), epoch]).permutation(self.num_samples)
            self._orders.clear()
            self._orders[(seed, epoch)] = perm
        return perm[j * self.batch_size:(j + 1) * self.batch_size]

    def batch(self, k: int, seed: int) -> dict[str, np.ndarray]:
        idx = self.indices(k, seed)
        return {n: np.asarray(a[idx], order="C") for n, a in self.arrays.items()}


def load_dataset(path: str | os.PathLike, inputs: list[DataInput]) -> Dataset:
    """Read ``--data``: an ``.npz`` file or a directory of ``.npz`` shards, fully checked."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"--data {p}: no such file or directory")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix == ".npz" and f.is_file())
        if not files:
            raise InputError(f"--data {p}: the directory holds no .npz files")
    else:
        files = [p]
    parts: dict[str, list[np.ndarray]] = {d.name: [] for d in inputs}
    notes: set[str] = set()
    if p.is_dir() and (skipped := sorted(f.name for f in p.iterdir()
                                         if f.is_file() and f.suffix != ".npz")):
        # a shard saved with numpy.save (.npy) would be silently left out (a walk-through)
        notes.add(f"{len(skipped)} file(s) of {p} not read (only .npz shards are): "
                  + ", ".join(skipped[:5]) + (", ..." if len(skipped) > 5 else ""))
    for f in files:
        shard = _read_shard(f, inputs, notes)
        for name, arr in shard.items():
            parts[name].append(arr)
    arrays = {n: (a[0] if len(a) == 1 else np.concatenate(a)) for n, a in parts.items()}
    batch = inputs[0].batch_size if inputs else 1
    n = len(next(iter(arrays.values()))) if arrays else 0
    if n < batch:
        raise InputError(f"--data {p}: {n} samples, fewer than one batch of the step "
                         f"({batch}); memcc train drops incomplete batches")
    return Dataset(str(p), arrays, n, batch, tuple(str(f) for f in files),
                   tuple(sorted(notes)))


def read_npz(f: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, or an ``InputError`` naming the file: a corrupt or
    truncated archive (``zipfile``, ``zlib`` and numpy's header errors), a plain ``.npy``
    array, a directory and pickled object arrays are all refused, with what to give."""
    p = Path(f)
    what = (f"--data {p}: cannot read it as an .npz file", "Write it with numpy.savez (one "
            "array per data input, named like it).")
    if p.is_dir():
        raise InputError(f"{what[0]}: it is a directory. {what[1]}")
    try:
        loaded = np.load(p, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise InputError(f"{what[0]}: it holds one unnamed array (an .npy file), not "
                             f"named arrays. {what[1]}")
        with loaded as npz:
            return {k: np.asarray(npz[k]) for k in npz.files}
    except FileNotFoundError:
        raise InputError(f"--data {p}: no such file") from None
    except ValueError as exc:
        if "pickle" not in str(exc):
            raise InputError(f"{what[0]} ({exc}); it may be truncated or corrupt. {what[1]}"
                             ) from None
        if not _numpy_signature(p):   # numpy calls any other file a pickle
            raise InputError(f"{what[0]}: it is not a numpy file (no .npz or .npy "
                             f"signature at its start). {what[1]}") from None
        raise InputError(f"{what[0]}: it holds object (pickled) arrays, which memcc does not "
                         "load (loading runs code from the file). Save numeric arrays with "
                         "numpy.savez.") from None
    except (OSError, EOFError, KeyError, zipfile.BadZipFile, zlib.error,
            struct.error) as exc:
        detail = str(exc) or type(exc).__name__
        raise InputError(f"{what[0]} ({detail}); it may be truncated or corrupt. {what[1]}"
                         ) from None


def _numpy_signature(path: Path) -> bool:
    """Whether the file starts as an .npz (a zip) or an .npy does; np.load says "pickle"
    of every other file, which named a text or ONNX file an object array."""
    with open(path, "rb") as f:
        head = f.read(6)
    return head.startswith(b"PK\x03\x04") or head == b"\x93NUMPY"


def _read_shard(f: Path, inputs: list[DataInput], notes: set[str]
                ) -> dict[str, np.ndarray]:
    """One shard's arrays, checked and in the step's dtypes (``notes`` gets what changed)."""
    arrays = read_npz(f)
    require_arrays(f, arrays, {d.name: f"({d.describe()})" for d in inputs})
    unused = sorted(set(arrays) - {d.name for d in inputs})
    if unused:  # sample weights, ids: not an error, but nothing the step reads
        notes.add(f"--data arrays {unused} are not inputs of the step and are not read (its "
                  f"data inputs are {[d.name for d in inputs]})")
    out: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for d in inputs:
        arr = arrays[d.name]
        wrong = f"--data {f}: array '{d.name}' has shape {list(arr.shape)} dtype {arr.dtype}"
        if arr.ndim < 1 or tuple(arr.shape[1:]) != d.sample_shape:
            raise InputError(
                f"{wrong}; the step expects {d.describe()}, so an array of shape "
                f"[N{''.join(f', {x}' for x in d.sample_shape)}] dtype {d.dtype}")
        if arr.dtype != d.dtype:
            notes.add(f"--data array '{d.name}' is {arr.dtype}: converted to the step's "
                      f"{d.dtype}" + (" (rounded)" if d.dtype.kind == "f" and
                                      arr.dtype.itemsize > d.dtype.itemsize else ""))
            arr = as_step_dtype(arr, d.dtype, wrong)
        check_int_range(f, d.name, arr, d.int_range, d.ignored)
        counts[d.name] = int(arr.shape[0])
        out[d.name] = arr
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"'{k}' {v}" for k, v in counts.items())
        raise InputError(f"--data {f}: its arrays hold different numbers of samples ({listed})"
                         "; the first axis of every array is the sample axis")
    return out


def as_step_dtype(arr: np.ndarray, dtype: np.dtype, wrong: str) -> np.ndarray:
    """``arr`` in the step's ``dtype`` where converting keeps what it means: integers to
    another integer type that holds every value (uint8 segmentation masks and int32 token
    ids for an int64 input), floats to another float type (numpy's float64 default for a
    float32 input: rounded as torch's ``.float()`` rounds). Anything else, a kind change
    (floats for integer labels, booleans) or integers the type cannot hold, is refused
    (``wrong`` says which array of which file)."""
    dtype = np.dtype(dtype)
    if arr.dtype == dtype:
        return arr
    kinds = (arr.dtype.kind, dtype.kind)
    if kinds[0] in "iu" and kinds[1] in "iu":
        info = np.iinfo(dtype)
        if not arr.size or (int(arr.min()) >= info.min and int(arr.max()) <= info.max):
            return arr.astype(dtype)
        raise InputError(f"{wrong}, with values in [{int(arr.min())}, {int(arr.max())}], "
                         f"which the step's {dtype} cannot hold")
    if kinds[0] == "f" and kinds[1] == "f":
        return arr.astype(dtype)
    raise InputError(f"{wrong}; the step takes {dtype}: memcc converts integers to "
                     "integers and floats to floats, not one kind to another. Save the "
                     f"array as {dtype}")


def require_arrays(source: str | os.PathLike, arrays: Mapping[str, np.ndarray],
                   wanted: Mapping[str, str]) -> None:
    """An ``InputError`` unless ``arrays`` (read from ``--data source``) holds every data
    input in ``wanted`` (name -> how the step describes it, in parentheses)."""
    missing = [n for n in wanted if n not in arrays]
    if missing:
        need = "; ".join(f"'{n}' {wanted[n]}" for n in missing)
        raise InputError(
            f"--data {source}: no array named {need}. The file has "
            f"{sorted(arrays) or 'no arrays'}; the step's data inputs are {list(wanted)}")


def check_int_range(source: str | os.PathLike, name: str, arr: np.ndarray,
                    int_range: tuple[int, int] | None, ignored: int | None = None) -> None:
    """An ``InputError`` when ``arr`` (array ``name`` of ``--data source``) indexes
    something of the step's (``int_range``: [low, high)) with a value outside it. A step
    built with ``--ignore-index`` records the ignored label (``ignored``): that value is
    accepted too, wherever it lies."""
    if int_range is None or not arr.size:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo >= int_range[0] and hi < int_range[1]:
        return
    if ignored is not None:
        rest = arr[arr != ignored]
        if not rest.size:
            return
        lo, hi = int(rest.min()), int(rest.max())
        if lo >= int_range[0] and hi < int_range[1]:
            return
    also = "" if ignored is None else \
        f", or equal {ignored}, the value the loss ignores (--ignore-index)"
    besides = "" if ignored is None else f" besides {ignored}"
    # PyTorch's cross-entropy ignores -100 by default: a step built without it reads the
    # labels a user padded so as class indices (a walk-through asked for the hint).
    # Only the labels memcc's cross-entropy reads (--ignore-index applies to them alone; an
    # input's -100 padding is no label, and the flag would not help it).
    hint = "" if name != LABELS or ignored is not None or lo >= int_range[0] or \
        np.any((arr < int_range[0]) & (arr != -100)) else \
        ("; the values below 0 are all -100, the label PyTorch's cross-entropy ignores: "
         "build the step with --ignore-index -100 to ignore them too")
    raise InputError(
        f"--data {source}: array '{name}' holds values{besides} from {lo} to {hi}; it indexes "
        f"something of size {int_range[1]}, so values must lie in "
        f"[{int_range[0]}, {int_range[1]}){also}{hint}")
