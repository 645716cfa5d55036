"""Write graphs to disk so that a failure never leaves a half-written file behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx

from memcc.errors import InputError
from memcc.graph import Graph

# protobuf cannot serialise one message over 2 GiB; keep a margin for the graph itself.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000


def save_graph(graph: Graph, path: str | os.PathLike) -> Path:
    """Write ``graph`` to ``path`` atomically (temp file + rename), external data if large."""
    return save_model(graph.to_model(), path)


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    out = Path(path)
    if out.parent and not out.parent.exists():
        raise InputError(f"{out}: directory {out.parent} does not exist")
    size = model.ByteSize()
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent or ".")
    os.close(fd)
    data_name = out.name + ".data"
    try:
        if size > EXTERNAL_DATA_THRESHOLD:
            tmp_data = Path(tmp).with_suffix(".data.tmp")
            onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=tmp_data.name, size_threshold=1024)
            # The location is recorded inside the model: rewrite it to the final name.
            m = onnx.load(tmp, load_external_data=False)
            for t in m.graph.initializer:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = data_name
            onnx.save_model(m, tmp)
            os.replace(tmp_data, out.parent / data_name)
        else:
            onnx.save_model(model, tmp)
        _default_permissions(Path(tmp))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _default_permissions(path: Path) -> None:
    """mkstemp creates files only the owner can read; give the result the usual mode."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)
