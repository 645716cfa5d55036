"""Checkpoints of a training run that a crash cannot damage.

A checkpoint is one safetensors file (written through ``safetensors.numpy``) holding every
carried value of the step (parameters, optimizer state, BatchNorm statistics) under the name
of the step input it feeds, which for parameters is the initializer name of the exported
model. Its string metadata holds what a resumed run needs besides tensors: the step count,
the data order position (an opaque JSON object the caller owns), and two guards:

- ``memcc.format``: the format tag. A file without it is not a memcc checkpoint.
- ``memcc.fingerprint``: a digest of the step's carried values (names, dtypes, shapes), its
  optimizer settings, loss and data inputs. A checkpoint of another step is refused, and the
  message names the first value that differs. The graph itself is not part of it, so a step
  rewritten by ``memcc compile`` (same state, other schedule) resumes the same checkpoint.
- ``memcc.sha256``: a digest of every tensor's bytes. safetensors checks its header, not its
  data, so a flipped byte in a tensor would otherwise load silently.

Why the write is safe against SIGKILL and power loss: the file is written under a temporary
name in the checkpoint directory (same file system, so the rename is atomic), flushed to
disk with ``fsync``, renamed to ``ckpt-<step>.safetensors`` and the directory is ``fsync``ed
so the rename itself is durable. A reader only ever looks at ``ckpt-*.safetensors`` names,
so it sees the old checkpoint or the new one, never part of one. Temporary files a killed
writer left behind are removed by the next save. The newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memcc.backend.onnx_file import default_permissions
from memcc.errors import InputError

FORMAT = "memcc-checkpoint/1"
FORMAT_KEY = "memcc.format"
FINGERPRINT_KEY = "memcc.fingerprint"
SIGNATURE_KEY = "memcc.signature"
STEP_KEY = "memcc.step"
DATA_KEY = "memcc.data_state"
SHA_KEY = "memcc.sha256"
SOURCE_KEY = "memcc.step_file"

PREFIX = "ckpt-"
SUFFIX = ".safetensors"
_NAME = re.compile(r"^ckpt-(\d+)\.safetensors$")
_TMP_PREFIX = ".ckpt-"
_TMP_SUFFIX = ".tmp"


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint file holds, checked: tensors, step count and data position."""

    path: Path
    tensors: dict[str, np.ndarray]
    step: int
    data_state: dict = field(default_factory=dict)
    step_file: str | None = None
    fingerprint: str = ""
    signature: str = ""

    def check_step(self, sig: Mapping, *, purpose: str = "resume") -> None:
        """Refuse this checkpoint unless it was written for the step described by ``sig``.
        ``purpose`` (``resume`` or ``export``) picks the advice: what to do differs. An
        export does not look at the data inputs' batch axis: the weights do not depend on
        it, and a data-parallel run writes its checkpoints at the global batch, which the
        step each rank ran (the user's file) does not have."""
        if self.fingerprint != fingerprint(sig) and not (
                purpose == "export" and self._same_but_batch(sig)):
            advice = ("Export it with the step file that trained it (or a memcc compile of "
                      "that step), or point --checkpoint at a checkpoint of this step."
                      if purpose == "export" else
                      "Use it with the step file that wrote it (or a memcc compile of that "
                      "step); to train this step from the start, choose a new checkpoint "
                      "directory.")
            raise InputError(
                f"{self.path}: written for another training step: "
                f"{_first_difference(self.signature, sig)}. {advice}")

    def _same_but_batch(self, sig: Mapping) -> bool:
        """Whether the step this was written for differs from ``sig`` in the data inputs'
        batch axis alone (the stored signature is the JSON its fingerprint was taken of)."""
        try:
            written = json.loads(self.signature or "")
        except ValueError:
            return False
        return isinstance(written, dict) and \
            fingerprint(_without_batch(written)) == fingerprint(_without_batch(sig))


def _without_batch(sig: Mapping) -> dict:
    """``sig`` with its data inputs' first axis (the batch) left out."""
    data = sig.get("data_inputs")
    if not isinstance(data, Mapping):
        return dict(sig)
    return {**sig, "data_inputs": {n: [v[0], list(v[1])[1:]] if isinstance(v, list)
                                   and len(v) == 2 and isinstance(v[1], list) else v
                                   for n, v in data.items()}}


def signature(types: Mapping[str, tuple[np.dtype, tuple[int, ...]]], extra: Mapping
              ) -> dict:
    """The JSON-able description of a step that its checkpoints must match."""
    return {
        "state": {n: [str(np.dtype(dt)), list(shape)] for n, (dt, shape) in sorted(
            types.items())},
        **{k: extra[k] for k in sorted(extra)},
    }


def fingerprint(sig: Mapping) -> str:
    return hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:32]


def tensors_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in name order (no copies made)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        arr = np.asarray(tensors[name], order="C")
        h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
        h.update(memoryview(arr.reshape(-1)).cast("B"))
    return h.hexdigest()


# ---------------------------------------------------------------------------- writing
def check_directory(directory: str | os.PathLike) -> None:
    """Fail before training, not at the first save after it, where ``directory`` cannot
    hold checkpoints: a file there or above it, or a directory memcc cannot write in (it
    need not exist yet: ``save`` creates it)."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise InputError(f"--checkpoint {d}: is a file, not a directory. Give a directory "
                         "for the checkpoints (memcc creates it if missing).")
    existing = d if d.exists() else next((a for a in d.parents if a.exists()), Path("."))
    if not existing.is_dir():
        raise InputError(f"--checkpoint {d}: {existing} is a file, not a directory. Choose "
                         "another directory for the checkpoints.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--checkpoint {d}: cannot write in {existing}. Make it writable or "
                         "choose another directory for the checkpoints.")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint records beside the tensors: the step count, the step's signature
    (``sig``: what a resume must match), the data order's position, and the step file."""

    step: int
    sig: Mapping
    data_state: Mapping | None = None
    step_file: str | None = None


def save(directory: str | os.PathLike, tensors: Mapping[str, np.ndarray],
         info: CheckpointInfo, *, keep: int = 2) -> Path:
    """Write ``ckpt-<step>.safetensors`` in ``directory`` atomically; return its path.

    The directory is created if missing. ``keep`` (at least 1) newest checkpoints stay.
    """
    step, sig, data_state, step_file = info.step, info.sig, info.data_state, info.step_file
    if keep < 1:
        raise InputError("a checkpoint directory must keep at least 1 checkpoint")
    d = Path(directory)
    check_directory(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--checkpoint {d}: cannot create the directory "
                         f"({exc.strerror or exc})") from None
    newest = latest(d)
    if newest is not None and _step_of(newest) > int(step):
        raise InputError(
            f"--checkpoint {d}: holds {newest.name}, newer than step {int(step)}; a resume "
            "would pick that one, and pruning would delete this one. Use an empty directory "
            "for a new run (or resume the run that wrote it).")
    _remove_stale_temporaries(d)
    arrays = {n: np.asarray(a, order="C") for n, a in tensors.items()}
    metadata = {
        FORMAT_KEY: FORMAT,
        FINGERPRINT_KEY: fingerprint(sig),
        SIGNATURE_KEY: json.dumps(sig, sort_keys=True),
        STEP_KEY: str(int(step)),
        DATA_KEY: json.dumps(dict(data_state or {}), sort_keys=True),
        SHA_KEY: tensors_digest(arrays),
    }
    if step_file is not None:
        metadata[SOURCE_KEY] = str(step_file)
    final = d / f"{PREFIX}{int(step):09d}{SUFFIX}"
    try:
        write_safetensors(final, arrays, metadata)
    except OSError as exc:
        raise InputError(f"--checkpoint {d}: cannot write a checkpoint "
                         f"({exc.strerror or exc}); the previous checkpoint is intact") from None
    for old in list_checkpoints(d)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def write_safetensors(path: Path, arrays: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> Path:
    """Write a safetensors file atomically: temp file in the same directory, fsync, rename,
    fsync the directory. On any failure the temp file goes and ``path`` is untouched."""
    from safetensors.numpy import save_file

    d = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=d)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        save_file({n: np.asarray(a, order="C") for n, a in arrays.items()}, str(tmp),
                  metadata=dict(metadata or {}))
        default_permissions(tmp)   # mkstemp's 0600, as the ONNX files memcc writes do not
        _fsync_file(tmp)
        os.replace(tmp, path)
        _fsync_dir(d)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_temporaries(directory: Path) -> None:
    for p in directory.glob(f"{_TMP_PREFIX}*{_TMP_SUFFIX}"):
        p.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- reading
def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (by the step in their name)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def _step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else -1


def latest(directory: str | os.PathLike) -> Path | None:
    files = list_checkpoints(directory)
    return files[-1] if files else None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint file, or the newest one in a directory; errors say what is there."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        raise InputError(f"--checkpoint {p}: no such file or directory")
    found = latest(p)
    if found is None:
        raise InputError(f"--checkpoint {p}: no checkpoint in this directory (memcc writes "
                         f"{PREFIX}<step>{SUFFIX} files there with memcc train --checkpoint)")
    return found


def load(path: str | os.PathLike, *, sig: Mapping | None = None,
         purpose: str = "resume") -> Checkpoint:
    """Read and check a checkpoint file (or the newest in a directory).

    With ``sig`` the checkpoint must belong to that step; a foreign, truncated or corrupted
    file raises ``InputError`` naming the file and what is wrong with it. ``purpose``
    (``resume`` or ``export``) picks the advice those errors give.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    p = resolve(path)
    if purpose == "export":
        older = [c for c in list_checkpoints(p.parent) if _step_of(c) < _step_of(p)]
        hint = (f" Export an older checkpoint instead: --checkpoint {older[-1]}." if older
                else " Point --checkpoint at another checkpoint of this run.")
    else:
        hint = (f" Delete {p} to resume from the checkpoint before it, or point --checkpoint "
                "at another one.")
    try:
        tensors = load_file(str(p))
        metadata = _metadata(p)
    except (SafetensorError, OSError, ValueError) as exc:
        raise InputError(f"{p}: not a readable checkpoint (safetensors: {exc}).{hint}"
                         ) from None
    if metadata.get(FORMAT_KEY) != FORMAT:
        what = metadata.get(FORMAT_KEY)
        raise InputError(
            f"{p}: not a memcc checkpoint (format tag {what!r}, expected {FORMAT!r}). memcc "
            f"{'exports' if purpose == 'export' else 'resumes'} only checkpoints written by "
            "memcc train or memcc.Trainer.save.")
    if metadata.get(SHA_KEY) != tensors_digest(tensors):
        raise InputError(f"{p}: corrupt: its tensor data does not match the checksum "
                         f"written with it.{hint}")
    try:
        step = int(metadata[STEP_KEY])
        data_state = json.loads(metadata.get(DATA_KEY) or "{}")
    except (KeyError, ValueError) as exc:
        raise InputError(f"{p}: malformed checkpoint metadata ({exc}).{hint}") from None
    ckpt = Checkpoint(p, dict(tensors), step, data_state, metadata.get(SOURCE_KEY),
                      metadata.get(FINGERPRINT_KEY, ""), metadata.get(SIGNATURE_KEY, ""))
    if sig is not None:
        ckpt.check_step(sig, purpose=purpose)
    return ckpt


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return dict(f.metadata() or {})


def _first_difference(written: str | None, sig: Mapping) -> str:
    try:
        old = json.loads(written or "")
    except ValueError:
        return "its description of the step is unreadable"
    if not isinstance(old, dict):
        return "its description of the step is unreadable"
    old_state, new_state = old.get("state", {}), sig.get("state", {})
    missing = sorted(set(new_state) - set(old_state))
    if missing:
        return f"it has no value '{missing[0]}' ({len(missing)} missing)"
    extra = sorted(set(old_state) - set(new_state))
    if extra:
        return f"it holds '{extra[0]}', which this step does not carry ({len(extra)} extra)"
    for name in sorted(new_state):
        if old_state[name] != new_state[name]:
            dt, shape = old_state[name]
            want_dt, want_shape = new_state[name]
            return (f"'{name}' is {dt} {shape} there, this step carries {want_dt} "
                    f"{want_shape}")
    for key in sorted(set(old) | set(sig)):
        if key != "state" and old.get(key) != sig.get(key):
            return f"{key} differs (checkpoint: {old.get(key)}, this step: {sig.get(key)})"
    return "its fingerprint differs"
