"""Read an ONNX file with its large float weights left where they are in the file.

``onnx.load`` copies every weight three times before memcc holds it as an array: the file
read into memory, the protobuf parse, and the ``raw_data`` bytes ``numpy_helper`` reads
(seconds and a gigabyte for the zoo's GPT-2 small, 500 MB of weights inline). A compile
that refuses an impossible budget needs none of those bytes, only the weights' shapes
(``compiler/floor_check.py``). Here the file is mapped, its protobuf wire format scanned
for the initializers' ``raw_data`` fields, and the model is parsed without them: each
large float initializer stays in the model as a stub (name, type, dims, no data) and its
values are a read-only numpy view into the mapping, read from disk only when something
reads them.

In: a path. Out: the model with stubs, and the stubs' arrays by name (``read_apart``);
``own_weights`` turns the views a ``Graph`` holds into arrays of its own (the mapping
would see a later write of the file in place: a truncated file is a crash on read).
``with_weights`` is the model with its stubs filled, for what must run it (ORT).
Anything unexpected in the file (a format other than binary protobuf, a wire type the
scan does not know) gives None, and the caller reads the file with ``onnx.load``.
"""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

from memcc.graph import Graph

# Float initializers at least this large are kept in the file (the stub size of
# ``frontend/load.py``'s shape inference, which never reads them either); smaller ones
# and other types (shape constants that load-time rewrites read) are parsed as usual.
STUB_BYTES = 1 << 16
_FLOATS = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
                     TensorProto.BFLOAT16})
# Field numbers of onnx.proto: ModelProto.graph, GraphProto.initializer, and TensorProto's
# dims, data_type, segment, name, raw_data, external_data, data_location.
_GRAPH, _INITIALIZER = 7, 5
_DIMS, _DATA_TYPE, _SEGMENT, _NAME, _RAW, _EXTERNAL, _LOCATION = 1, 2, 3, 8, 9, 13, 14

Arrays = dict[str, np.ndarray]


class _NotPlain(Exception):
    """The scan met something it does not read: ``onnx.load`` reads the file instead."""


def read_apart(path: str | os.PathLike) -> tuple[onnx.ModelProto, Arrays] | None:
    """The model in ``path`` with its large float initializers as stubs, and their values
    as read-only views into the mapped file; None where the file is not a plain binary
    protobuf this scan reads (``onnx.load`` then reads it, and says what is wrong)."""
    ext = os.path.splitext(os.fspath(path))[1]
    if sys.byteorder != "little" or (onnx.serialization.registry
                                     .get_format_from_file_extension(ext)
                                     not in (None, "protobuf")):
        return None
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # an empty file cannot be mapped
        return None
    view = memoryview(buf)
    arrays: Arrays = {}
    try:
        pieces = _model_without_weights(view, arrays)
        model = onnx.ModelProto()
        model.ParseFromString(b"".join(pieces))
    except Exception:  # noqa: BLE001 - any surprise: the ordinary reader says what it is
        return None
    return model, arrays


def own_weights(graph: Graph) -> None:
    """Replace every initializer of ``graph`` that is a view into a mapped file by a
    read-only copy of its own (as ``numpy_helper.to_array`` gives)."""
    for name, a in graph.initializers.items():
        if _mapped(a):
            graph.initializers[name] = owned(a)


def owned(a: np.ndarray) -> np.ndarray:
    """A read-only copy of ``a`` where it is a view into a mapped file; ``a`` otherwise."""
    if not _mapped(a):
        return a
    copy = np.array(a)
    copy.flags.writeable = False
    return copy


def with_weights(model: onnx.ModelProto, arrays: Arrays) -> onnx.ModelProto:
    """A copy of ``model`` whose stubs hold their values again (to run it in ORT)."""
    full = onnx.ModelProto()
    full.CopyFrom(model)
    for t in full.graph.initializer:
        if t.name in arrays and not t.HasField("raw_data"):
            t.raw_data = arrays[t.name].tobytes()
    return full


def _mapped(a: np.ndarray) -> bool:
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


def _model_without_weights(view: memoryview, arrays: Arrays) -> list:
    """The ModelProto's bytes, its graph's large initializers stubbed (``arrays`` gets
    their values), as pieces to join."""
    pieces: list = []
    kept = 0  # the bytes from here on not yet in ``pieces``
    for field, wire, start, body, end in _fields(view, 0, len(view)):
        if field == _GRAPH and wire == 2:
            graph = _graph_without_weights(view, body, end, arrays)
            pieces += [view[kept:start], _key_and_length(_GRAPH, sum(map(len, graph))),
                       *graph]
            kept = end
    pieces.append(view[kept:])
    return pieces


def _graph_without_weights(view: memoryview, begin: int, end: int, arrays: Arrays) -> list:
    pieces: list = []
    kept = begin
    for field, wire, start, body, stop in _fields(view, begin, end):
        if field != _INITIALIZER or wire != 2:
            continue
        stub = _stub(view, body, stop, arrays)
        if stub is not None:
            pieces += [view[kept:start], _key_and_length(_INITIALIZER, len(stub)), stub]
            kept = stop
    pieces.append(view[kept:end])
    return pieces


def _stub(view: memoryview, begin: int, end: int, arrays: Arrays) -> bytes | None:
    """The TensorProto at ``view[begin:end]`` without its ``raw_data`` (its values go to
    ``arrays``), or None where it stays as it is: not a large float tensor held inline."""
    dims: list[int] = []
    dtype, name, raw, other = 0, None, [], False
    for field, wire, start, body, stop in _fields(view, begin, end):
        if field == _DIMS:
            dims += [_varint(view, body)[0]] if wire == 0 else _packed(view, body, stop)
        elif field == _DATA_TYPE and wire == 0:
            dtype = _varint(view, body)[0]
        elif field == _NAME and wire == 2:
            name = bytes(view[body:stop]).decode("utf-8")
        elif field == _RAW and wire == 2:
            raw.append((start, body, stop))
        elif field in (_SEGMENT, _EXTERNAL, _LOCATION):
            other = True
    if dtype not in _FLOATS or name is None or len(raw) != 1 or other:
        return None
    start, body, stop = raw[0]
    np_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(dtype))
    count = int(np.prod(dims, dtype=np.int64))
    if stop - body < STUB_BYTES or stop - body != count * np_dtype.itemsize:
        return None
    arrays[name] = np.frombuffer(view.obj, dtype=np_dtype, count=count,
                                 offset=body).reshape(dims)
    return bytes(view[begin:start]) + bytes(view[stop:end])


def _fields(view: memoryview, pos: int, end: int):
    """Each field of the message at ``view[pos:end]``: (number, wire type, where its key
    starts, where its value starts, where it ends); a length-delimited value is
    ``view[value start:end]``."""
    while pos < end:
        start = pos
        key, pos = _varint(view, pos)
        field, wire = key >> 3, key & 7
        body = pos
        if wire == 0:
            pos = _varint(view, pos)[1]
        elif wire == 1:
            pos += 8
        elif wire == 2:
            length, body = _varint(view, pos)
            pos = body + length
        elif wire == 5:
            pos += 4
        else:  # groups: nothing onnx writes
            raise _NotPlain(f"wire type {wire}")
        if pos > end:
            raise _NotPlain("truncated")
        yield field, wire, start, body, pos


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise _NotPlain("varint")


def _packed(view: memoryview, pos: int, end: int) -> list[int]:
    out = []
    while pos < end:
        value, pos = _varint(view, pos)
        out.append(value)
    return out


def _key_and_length(field: int, length: int) -> bytes:
    return _encode(field << 3 | 2) + _encode(length)


def _encode(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
