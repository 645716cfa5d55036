"""memcc's Python API: every operation the ``memcc`` commands run, under one name each,
with the option types that go in and the results and errors that come out.

The CLI (``memcc/cli/``) parses flags, calls these and prints what comes back; it imports
nothing else of memcc (tests/test_api.py checks it), so a script calling ``memcc.api``
gets what ``memcc`` does, with the same checks and messages:

- build: ``build(model, output, dims=, options=BuildOptions(...))``, ``parse_dims``;
- compile: ``compile_model(model, CompileOptions(...), output=, report_path=)``,
  ``summary_lines``; ``analyze(model, CompileOptions(...))``, ``describe_analysis``;
- tune: ``tune(model, budget, "batch=1..512", TuneOptions(...))``, ``measure_tune``,
  ``write_step``, ``plot_tune``;
- run and train: ``run_steps(step)``, ``Trainer``, ``train(TrainOptions(...))``,
  ``plan_training``, ``latest_checkpoint``; export: ``export_checkpoint``;
- reports: ``load_report``, ``print_report``, ``plot_timeline``.

Importing ``memcc.api`` costs nothing: each name imports the module that owns it when it
is first used (PEP 562), so that ``memcc build`` does not load the planner, ONNX Runtime
or matplotlib, and ``memcc --help`` starts at once.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memcc.frontend.build import BuildOptions
    from memcc.graph import Graph

# name -> (module that owns it, its name there). Options and results sit with their
# operation; a few names say more here than in their module (``describe`` of what).
_OWNERS: dict[str, tuple[str, str]] = {
    # errors: a bad input (exit status 2 in the CLI), and its kinds
    "MemccError": ("memcc.errors", "MemccError"),
    "InputError": ("memcc.errors", "InputError"),
    # build: a forward model -> a training step
    "BuildOptions": ("memcc.frontend.build", "BuildOptions"),
    "parse_dims": ("memcc.frontend.load", "parse_dims"),
    "update_units": ("memcc.frontend.update_groups", "update_units"),
    "ExportWarning": ("memcc.frontend.exported", "ExportWarning"),
    "ExportNote": ("memcc.frontend.exported", "ExportNote"),
    "Graph": ("memcc.graph", "Graph"),
    "TrainingStep": ("memcc.step", "TrainingStep"),
    "check_writable": ("memcc.backend.onnx_file", "check_writable"),
    "format_size": ("memcc.sizes", "format_size"),
    # compile: a step (or a forward model) -> the step within a budget, and its report
    "CompileOptions": ("memcc.compiler", "CompileOptions"),
    "CompileResult": ("memcc.compiler", "CompileResult"),
    "VerificationError": ("memcc.compiler", "VerificationError"),
    "compile_model": ("memcc.compiler", "compile_model"),
    "summary_lines": ("memcc.compiler", "summary_lines"),
    # analyze: the step as built, before any plan
    "analyze": ("memcc.analyze", "analyze"),
    "Analysis": ("memcc.analyze", "Analysis"),
    "describe_analysis": ("memcc.analyze", "describe"),
    "ANALYZE_TIME_LIMIT": ("memcc.analyze", "DEFAULT_TIME_LIMIT"),
    # reports written by compile
    "load_report": ("memcc.report_view", "load_report"),
    "print_report": ("memcc.report_view", "print_report"),
    "plot_timeline": ("memcc.report_view", "plot_timeline"),
    "check_plot_path": ("memcc.report_view", "check_plot_path"),
    # tune: the largest and the fastest batch within a budget
    "TuneOptions": ("memcc.tune", "TuneOptions"),
    "TuneResult": ("memcc.tune", "TuneResult"),
    "tune": ("memcc.tune", "tune"),
    "measure_tune": ("memcc.tune", "measure"),
    "write_step": ("memcc.tune", "write_step"),
    "plot_tune": ("memcc.tune", "plot_tune"),
    # run: steps on a synthetic batch, measured
    "run_steps": ("memcc.backend.runner", "run_steps"),
    "RunRequest": ("memcc.backend.runner", "RunRequest"),
    # train and export
    "Trainer": ("memcc.trainer", "Trainer"),
    "TrainerOptions": ("memcc.trainer", "TrainerOptions"),
    "TrainOptions": ("memcc.trainer", "TrainOptions"),
    "TrainResult": ("memcc.trainer", "TrainResult"),
    "TrainingInterrupted": ("memcc.trainer", "TrainingInterrupted"),
    "train": ("memcc.trainer", "train"),
    "plan_training": ("memcc.trainer", "plan_training"),
    "describe_data": ("memcc.backend.data", "describe_data"),
    "latest_checkpoint": ("memcc.backend.checkpoint", "latest"),
    "export_checkpoint": ("memcc.trainer", "export_checkpoint"),
    "EVAL_NOTE": ("memcc.trainer.eval_mode", "EVAL_NOTE"),
    # memcc train --nproc N (data-parallel; torch only when one of these runs)
    "train_distributed": ("memcc.dist", "train_distributed"),
    "launched_by_torchrun": ("memcc.dist.comm", "launched_by_torchrun"),
    "describe_distributed_plan": ("memcc.dist.train", "describe_plan"),
}


def build(model: str | os.PathLike, output: str | os.PathLike, *,
          dims: Mapping[str, int] | None = None,
          options: BuildOptions | None = None) -> Graph:
    """``memcc build``: write the training step of a forward model to ``output``.

    ``output`` is checked before building, so a bad path fails at once and clearly."""
    from pathlib import Path

    from memcc.backend.onnx_file import check_writable, save_graph
    from memcc.errors import InputError
    from memcc.frontend.build import build_training_step
    from memcc.frontend.load import load_graph

    if not Path(model).exists():
        raise InputError(f"{model}: no such file")
    check_writable(output, "the training step", "--output/-o",
                   inputs=[("the forward model", model)])
    graph = build_training_step(load_graph(model, dims), options, source=str(model))
    save_graph(graph, Path(output))
    return graph


def __getattr__(name: str) -> Any:
    """The API name ``name``, imported from its module on first use (then kept here)."""
    try:
        module, attr = _OWNERS[name]
    except KeyError:
        raise AttributeError(f"module 'memcc.api' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_OWNERS])


__all__ = ["build", *_OWNERS]
