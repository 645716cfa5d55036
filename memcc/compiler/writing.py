"""Compile's files: checked before any work, written together or not at all.

In: the model and the two targets (``--output``, ``--report``); at the end the rewritten
step and the report. Out: both files renamed into place together, or an ``InputError``
that says nothing was written. Both targets are checked before any work: a read-only
directory found after a long compile wastes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx

from memcc.backend.onnx_file import (
    Staged,
    check_writable,
    discard,
    same_file,
    stage_model,
    stage_text,
    write_together,
)
from memcc.errors import InputError
from memcc.graph import Graph

Model = str | os.PathLike | onnx.ModelProto
Target = str | os.PathLike | None


def unverified_path(output: str | os.PathLike) -> Path:
    """Where a rewritten step that failed ``--verify`` is kept: ``OUT.unverified.onnx``."""
    out = Path(output)
    return out.with_name(f"{out.stem}.unverified{out.suffix or '.onnx'}")


def check_targets(model: Model, output: Target, report_path: Target) -> None:
    """Before any work: both files can be written, and are two different files, neither of
    them the model (a rename over it would destroy the input before anything is checked)."""
    if isinstance(model, (str, os.PathLike)) and not Path(model).exists():
        raise InputError(f"{model}: no such file")
    reads = [("the model", model)]
    if output is not None:
        check_writable(output, "the rewritten step", "--output/-o", inputs=reads)
    if report_path is not None:
        check_writable(report_path, "the report", "--report", inputs=reads)
    if output is not None and report_path is not None and same_file(output, report_path):
        raise InputError(f"--output and --report are the same file ({output}); give the "
                         "report another name.")


def write_outputs(output: Target, graph: Graph | None, report_path: Target,
                  report: dict) -> None:
    """The rewritten step and the report, renamed into place together or not at all."""
    staged: list[Staged] = []
    try:
        if output is not None and graph is not None:
            staged += stage_model(graph.to_model(), Path(output))
        if report_path is not None:
            staged += stage_text(json.dumps(report, indent=1, sort_keys=False) + "\n",
                                 Path(report_path))
    except OSError as exc:
        discard(staged)
        raise InputError(f"cannot write {exc.filename or output}: {exc.strerror or exc}. "
                         "Nothing was written.") from None
    except BaseException:
        discard(staged)
        raise
    try:
        write_together(staged)
    except OSError as exc:
        raise InputError(f"cannot write {exc.filename or output}: {exc.strerror or exc}. "
                         "Nothing was written.") from None
