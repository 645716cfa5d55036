"""What the recompute benchmarks share: model specs on the command line, the training step
they plan for, and how its memory splits into activations and the rest (the budgets are
fractions of the activations)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def parse_model(spec: str) -> tuple[str, dict]:
    """``name:key=value,...`` -> (name, options); ``blocks=3;4;6;3`` gives a list."""
    name, _, rest = spec.partition(":")
    opts: dict = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        opts[k] = _value(v)
    return name, opts


def _value(text: str):
    if ";" in text:
        return [_value(t) for t in text.split(";")]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def build_step(name: str, opts: dict, path: Path, log: Callable[[str], None]):
    """Build the zoo model's training step (cross-entropy, SGD), save it at ``path`` and
    return (step, liveness, activation bytes at the peak, the rest of the peak)."""
    from memcc.backend.onnx_file import save_graph
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from memcc.passes.analysis.liveness import analyze_liveness
    from models import build_model

    step = build_training_step(load_graph(build_model(name, **opts)), BuildOptions())
    save_graph(step, path)
    live = analyze_liveness(step)
    act = live.breakdown["activations"] + live.breakdown["scratch"]
    log(f"{name} {opts}: {len(step.nodes)} nodes, predicted peak {mb(live.peak_bytes)} MB "
        f"({mb(act)} MB activations)")
    return step, live, act, live.peak_bytes - act
