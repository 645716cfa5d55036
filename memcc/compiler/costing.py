"""Compile's ``cost_model`` stage: each node's time, measured or estimated, and the host
link's rate for swap copies.

In: the training step (``Graph``), ``CompileOptions`` (``cost``, ``provider``), where
warnings go, and why CUDA is missing (``loading.check_provider``). Out: a ``CostModel``
and the ``cost_model`` pass's summary (source, provider, total, host link, calibration or
rates, and a note where measuring fell back to estimating).
"""

from __future__ import annotations

from dataclasses import replace

from memcc.backend.profiling import (
    cached_costs,
    calibrate_cpu_rates,
    measured_costs,
    measuring_runs,
)
from memcc.backend.step_feeds import bfloat16_feeds
from memcc.compiler.options import CompileOptions
from memcc.compiler.progress import Progress
from memcc.errors import MemccError
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import (
    CUDA_NOMINAL,
    CostModel,
    HostLink,
    analytic_costs,
    host_link_for,
)
from memcc.passes.analysis.cuda_node_times import default_calibration

# --cost auto measures node times where running the step as often as
# ``backend/profiling.measured_costs`` does (``measuring_runs``) is estimated to take at
# most this share of --time-limit; else it estimates them.
MEASURE_SHARE = 0.25


def node_costs(graph: Graph, options: CompileOptions, warning: Progress,
           cuda_missing: str | None) -> tuple[CostModel, dict]:
    """``cuda_missing``: why CUDA is not there (``check_provider`` already warned)."""
    note = None
    if cuda_missing is not None and options.cost == "auto":
        note = f"CUDA is not available, estimated instead: {cuda_missing}"
    elif options.cost == "auto" and (note := too_long_to_measure(graph, options)):
        warning(f"--cost auto: {note}")
    elif options.cost == "auto" and any(bfloat16_feeds(graph)):
        note = ("the step has bfloat16 inputs or outputs (a model exported in bfloat16), "
                "which ONNX Runtime's Python API cannot feed or return: node times estimated, "
                "not measured")
        warning(f"--cost auto: {note}")
    elif options.cost in ("auto", "measured"):
        try:
            cm = replace(measured_costs(graph, options.provider),
                         link=measured_link(options.provider, warning))
            summary = {"source": "measured", "provider": options.provider,
                       "total_s": round(cm.total(graph), 6)}
            if cm.link is not None:
                summary["host_link"] = cm.link.to_json()
            return cm, summary
        except MemccError as exc:
            if options.cost == "measured":
                raise
            note = f"measuring failed, estimated instead: {exc}"
            warning(f"--cost auto: measuring node times failed ({exc}); they are estimated "
                    "instead, so the predicted added time is an estimate.")
    cal = default_calibration() if options.provider == "cuda" else None
    if cal is not None:
        # Estimated from node times measured on a GPU (passes/analysis/cuda_node_times.py).
        cm = replace(cal.costs(graph), link=host_link_for(options.provider))
        summary = {"source": cm.source, "provider": options.provider,
                   "calibration": cal.describe(), "total_s": round(cm.total(graph), 6)}
    else:
        rates = calibrate_cpu_rates() if options.provider == "cpu" else CUDA_NOMINAL
        cm = replace(analytic_costs(graph, rates), link=host_link_for(options.provider))
        summary = {"source": "analytic", "provider": options.provider,
                   "rates": rates.to_json(), "total_s": round(cm.total(graph), 6)}
    if cm.link is not None:
        summary["host_link"] = cm.link.to_json()
    if note:
        summary["note"] = note
    return cm, summary


def too_long_to_measure(graph: Graph, options: CompileOptions) -> str | None:
    """Why ``--cost auto`` estimates this step's node times instead of measuring them, or
    None. Measuring runs the step ``measuring_runs()`` times (7), outside the planner's limit: a
    124M-parameter GPT-2 at batch 2 x 128 took 37 s of a compile on two cores, at batch
    8 x 1024 it would take minutes. Where the estimated step times that many runs exceed
    ``MEASURE_SHARE`` of ``--time-limit``, the times are estimated, unless this very step
    was measured before (the cache holds them)."""
    if options.provider != "cpu":
        return None    # a CUDA step runs in milliseconds: measuring is cheap there
    step_s = analytic_costs(graph, calibrate_cpu_rates()).total(graph)
    runs = measuring_runs()
    need = runs * step_s
    if need <= MEASURE_SHARE * options.time_limit or cached_costs(graph) is not None:
        return None
    return (f"measuring node times would run the step {runs} times, about "
            f"{need:.0f} s at the {step_s:.1f} s a step is estimated to take here, more "
            f"than {MEASURE_SHARE:.0%} of --time-limit {options.time_limit:g}: they are "
            "estimated instead (calibrated on this CPU). --cost measured measures them (and "
            "caches them for the next compile of this step)")


def measured_link(provider: str, warning: Progress) -> HostLink | None:
    """The swap copies' link measured on this machine (CUDA only: nothing is swapped on the
    CPU provider); the nominal PCIe figure, with a warning, when measuring fails."""
    if host_link_for(provider) is None:
        return None
    from memcc.backend.host_link import measure_host_link

    try:
        return measure_host_link(provider)
    except MemccError as exc:
        warning(f"measuring the host link failed ({exc}); swap copies are priced at the "
                "nominal PCIe rate instead.")
        return host_link_for(provider)
