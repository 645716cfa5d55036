"""Write graphs to disk so that a failure never leaves a half-written file behind.

Every file is first written to a temporary file in its target directory (so the final
rename stays on one file system and is atomic), then renamed. ``write_together`` extends
that to several files: all are staged first and renamed last, and a failure anywhere
restores what was there before, so a compile never leaves a rewritten graph without its
report (or the reverse). ``check_writable`` finds the common reasons a write would fail
(missing or read-only directory, read-only file) before a long compile starts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx

from memcc.errors import InputError
from memcc.graph import Graph

# protobuf cannot serialise one message over 2 GiB; keep a margin for the graph itself.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


@dataclass(frozen=True)
class Staged:
    """A fully written temporary file and where it goes once every file is ready."""

    tmp: Path
    final: Path


def save_graph(graph: Graph, path: str | os.PathLike) -> Path:
    """Write ``graph`` to ``path`` atomically (temp file + rename), external data if large."""
    return save_model(graph.to_model(), path)


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    out = Path(path)
    write_together(stage_model(model, out))
    return out


def stage_model(model: onnx.ModelProto, path: str | os.PathLike) -> list[Staged]:
    """Write ``model`` next to ``path`` under temporary names (the graph, and its external
    data file when the model is too large for one protobuf message); nothing is renamed."""
    out = Path(path)
    if out.parent and not out.parent.exists():
        raise InputError(f"{out}: directory {out.parent} does not exist")
    whole = _serialized_if_small(model)
    tmp = _mkstemp(out)
    data_name = out.name + ".data"
    staged = [Staged(tmp, out)]
    try:
        if whole is not None:
            tmp.write_bytes(whole)
        elif not _inline(model) and model.ByteSize() <= EXTERNAL_DATA_THRESHOLD:
            onnx.save_model(model, str(tmp))
        else:
            tmp_data = tmp.with_suffix(".data.tmp")
            onnx.save_model(model, str(tmp), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=tmp_data.name,
                            size_threshold=1024)
            staged.insert(0, Staged(tmp_data, out.parent / data_name))
            # The location is recorded inside the model: rewrite it to the final name.
            m = onnx.load(str(tmp), load_external_data=False)
            for t in m.graph.initializer:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = data_name
            onnx.save_model(m, str(tmp))
            default_permissions(tmp_data)
        default_permissions(tmp)
    except BaseException:
        discard(staged)
        raise
    return staged


def _serialized_if_small(model: onnx.ModelProto) -> bytes | None:
    """The model's bytes as ``onnx.save_model`` writes them when it fits one protobuf
    message with margin (``EXTERNAL_DATA_THRESHOLD``), else None. Serialised once: the
    size test used to be ``ByteSize()``, which upb computes by serialising the whole model
    (5 s of a 124M-parameter GPT-2's compile), and ``save_model`` then serialised it again.
    Only a model whose tensors all sit inline (``_inline``) takes this path, so
    ``save_model``'s writing of external data would have done nothing."""
    if not _inline(model):
        return None
    try:
        whole = model.SerializeToString()
    except ValueError:   # over protobuf's 2 GiB: external data
        return None
    return whole if len(whole) <= EXTERNAL_DATA_THRESHOLD else None


def _inline(model: onnx.ModelProto) -> bool:
    """No tensor of ``model`` (initializer, node attribute) refers to an external data
    file, and no node holds a subgraph (not looked into: the old path takes those)."""
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        for a in node.attribute:
            if a.HasField("g") or a.graphs:
                return False
            tensors += [a.t] if a.HasField("t") else []
            tensors += a.tensors
    return all(t.data_location != onnx.TensorProto.EXTERNAL for t in tensors)


def stage_text(text: str, path: str | os.PathLike) -> list[Staged]:
    """Write ``text`` next to ``path`` under a temporary name; nothing is renamed."""
    out = Path(path)
    tmp = _mkstemp(out)
    staged = [Staged(tmp, out)]
    try:
        tmp.write_text(text)
        default_permissions(tmp)
    except BaseException:
        discard(staged)
        raise
    return staged


def write_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` writes the whole file to a temporary name next to ``path``, which is
    then renamed to ``path``: a failure leaves ``path`` as it was (for writers, such as
    matplotlib's, that take a file name)."""
    out = Path(path)
    tmp = _mkstemp(out)
    staged = [Staged(tmp, out)]
    try:
        write(tmp)
        default_permissions(tmp)
    except BaseException:
        discard(staged)
        raise
    write_together(staged)
    return out


def write_together(staged: list[Staged]) -> None:
    """Rename every staged file to its final name, or none of them.

    An existing target is first hard-linked to a backup name, so that when a later rename
    fails the earlier ones can be undone (the old files come back) and no mix of new and
    old files is left. Temporary files are removed on any failure.
    """
    done: list[tuple[Staged, Path | None]] = []
    try:
        for item in staged:
            backup = None
            if item.final.exists():
                backup = _backup_name(item.final)
                try:
                    os.link(item.final, backup)
                except OSError:  # no hard links here: the old file cannot be restored
                    backup = None
            try:
                os.replace(item.tmp, item.final)
            except BaseException:
                if backup is not None:
                    backup.unlink(missing_ok=True)
                raise
            done.append((item, backup))
    except BaseException:
        for item, backup in reversed(done):
            if backup is not None:
                os.replace(backup, item.final)
            else:
                item.final.unlink(missing_ok=True)
        discard(staged)
        raise
    for _, backup in done:
        if backup is not None:
            backup.unlink(missing_ok=True)


def discard(staged: list[Staged]) -> None:
    """Remove the temporary files of ``staged`` (those not renamed yet)."""
    for item in staged:
        item.tmp.unlink(missing_ok=True)


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether paths ``a`` and ``b`` name one file: equal once resolved (``..``, symlinks),
    or, where both exist, one inode (a hard link; ``os.path.samefile``)."""
    pa, pb = Path(a), Path(b)
    if pa.resolve() == pb.resolve():
        return True
    try:
        return pa.exists() and pb.exists() and os.path.samefile(pa, pb)
    except OSError:
        return False


def check_writable(path: str | os.PathLike, what: str, option: str, *,
                   inputs: Iterable[tuple[str, str | os.PathLike]] = ()) -> None:
    """Fail now, with what to do, if ``path`` cannot be written later.

    ``what`` names the file for the message ("the rewritten step"), ``option`` the flag that
    chooses it. The test is the real one where it matters: a temporary file is created and
    removed in the directory (permission bits, read-only mounts and root all decide
    correctly). An existing read-only file is refused rather than replaced behind the
    user's back, although renaming over it would succeed.

    ``inputs``: (description, path) of the files the command reads. Writing over one of
    them would destroy it (the rename replaces it before anything could be checked), so an
    output that is one of them, by name, symlink or hard link, is refused.
    """
    p = Path(path)
    where = f"cannot write {what} {p}"
    for name, src in inputs:
        if src is not None and isinstance(src, (str, os.PathLike)) and same_file(p, src):
            raise InputError(f"{where}: it is {name} ({src}), which this command reads; "
                             f"writing there would destroy it. Choose another path with "
                             f"{option}.")
    if p.is_dir():
        raise InputError(f"{where}: it is a directory. Give a file name with {option}.")
    parent = p.parent
    if not parent.exists():
        blocker = next((a for a in parent.parents if a.exists() and not a.is_dir()), None)
        if blocker is not None:
            raise InputError(f"{where}: {blocker} is a file, not a directory. Choose another "
                             f"path with {option}.")
        raise InputError(f"{where}: directory {parent} does not exist. Create it "
                         f"(mkdir -p {parent}) or choose another path with {option}.")
    if not parent.is_dir():
        raise InputError(f"{where}: {parent} is a file, not a directory. Choose another path "
                         f"with {option}.")
    try:
        _mkstemp(p).unlink()
    except OSError as exc:
        raise InputError(f"{where}: cannot create files in {parent} "
                         f"({exc.strerror or exc}). Make the directory writable or choose "
                         f"another path with {option}.") from None
    # Its mode bits too: os.access says yes to root, who then replaced a 0444 file.
    if p.exists() and (not os.access(p, os.W_OK) or not p.stat().st_mode & 0o222):
        raise InputError(f"{where}: the file exists and is read-only. Make it writable "
                         f"(chmod u+w {p}), remove it, or choose another path with {option}.")


def _mkstemp(out: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent or ".")
    os.close(fd)
    return Path(tmp)


def _backup_name(final: Path) -> Path:
    tmp = _mkstemp(final)  # a unique name in the same directory
    tmp.unlink()
    return tmp.with_suffix(".old")


def default_permissions(path: Path) -> None:
    """mkstemp creates files only the owner can read; give the result the usual mode."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
