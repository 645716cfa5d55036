"""The Python entry points; the CLI only parses flags and calls these."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from memcc.backend.onnx_file import check_writable, save_graph
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph


def build(model: str | os.PathLike, output: str | os.PathLike, *,
          dims: Mapping[str, int] | None = None,
          options: BuildOptions | None = None) -> Graph:
    """``memcc build``: write the training step of a forward model to ``output``.

    ``output`` is checked before building, so a bad path fails at once and clearly."""
    if not Path(model).exists():
        raise InputError(f"{model}: no such file")
    check_writable(output, "the training step", "--output/-o",
                   inputs=[("the forward model", model)])
    graph = build_training_step(load_graph(model, dims), options, source=str(model))
    save_graph(graph, Path(output))
    return graph
