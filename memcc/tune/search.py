"""``memcc tune``: the largest batch, and the fastest one, whose training step fits a budget.

Users of recomputation ask "what fits?" before anything else. ``tune`` answers it ahead of
time by building the step at candidate sizes of one symbolic dimension (the batch) and
planning each with the same plan pass ``memcc compile`` uses, so "fits" here means exactly
"``memcc compile --budget`` succeeds": a plan within the budget exists, which is the case
if and only if the smallest peak the planner can reach is within it (``choose_plan``
returns the ``--budget min`` plan when the at-budget search fails; ``planner.py``).

Planning a size costs tens of seconds on large steps, so the search compiles as few sizes
as it can, and asks the cheapest question that settles each one:

1. the step as built (liveness only, well under a second): a baseline within the budget
   fits with no rewrite, so it also gives the largest batch without rewriting;
2. the bytes no plan can remove (inputs, parameters, optimizer state, constants): above
   the budget, nothing fits;
3. the sqrt(n) segmentations (about a second): one within the budget proves a fit, since
   every strategy that recomputes keeps them as candidates;
4. only then the planner itself: the plan at the budget where a fit is expected (the
   table needs that plan anyway), else the ``--budget min`` search (what a refusal runs).

Every "fits" and "does not fit" is therefore certain, and the search keeps the invariant
"``low`` fits, ``high`` does not": the edge it reports has been shown to fit and the next
size up shown not to. Between known sizes it aims where a straight line through the peaks
crosses the budget (peaks grow almost linearly with the batch), falling back to halving.
Only monotonicity in the batch is assumed. Results are cached per size; nothing is written
unless asked (``write_step``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import onnx

from memcc.compiler import plan_budget_under, user_budget
from memcc.errors import InputError, MemccError
from memcc.frontend.load import read_model_apart
from memcc.graph import Graph
from memcc.passes.planning.planner import PlanOutcome
from memcc.sizes import format_size, parse_size
from memcc.step import KIND_KEY
from memcc.tune.options import Say, SearchRange, TuneOptions, parse_range
from memcc.tune.probe import SizeProbe, SizeSearch, floor_bytes
from memcc.tune.results import Candidate, TuneResult


# ---------------------------------------------------------------------------- the search
def tune(model: str | os.PathLike | onnx.ModelProto, budget: str | int, dim: str | SearchRange,
         options: TuneOptions | None = None, *, progress: Say | None = None) -> TuneResult:
    """Find the largest size of ``dim`` (``"batch=1..512"``) whose step fits ``budget``,
    the fastest one by predicted samples per second, and compile the one ``options.pick``
    names. Raises ``InputError`` for a model or range that cannot be searched, and when not
    even the smallest size fits (saying what fills the budget)."""
    opts = options or TuneOptions()
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    rng = dim if isinstance(dim, SearchRange) else parse_range(dim)
    budget_bytes = _budget(budget)
    # A file's large weights stay in it (mapped) until the smallest size passes the floor:
    # a refusal there needs their shapes alone (``frontend/weights_apart.py``).
    proto, weights, label = (model, {}, "<model>") if isinstance(model, onnx.ModelProto) \
        else (*read_model_apart(model), str(model))
    _check_searchable(proto, label, rng, opts)
    search = SizeSearch(proto, label, rng, opts, 0, say)
    search.weights = weights
    first = rng.low
    search.slack = search.compile.slack_for(search.step(first))
    plan_budget = plan_budget_under(budget_bytes, search.compile, search.slack)
    search.budget = plan_budget
    floor = floor_bytes(search.step(first), opts.provider)
    if floor > plan_budget:  # the step as built peaks at least there: nothing fits
        raise _under_the_floor(search, first, budget_bytes, floor)
    if not search.fits(first, expect=True)[0]:
        raise _nothing_fits(search, first, budget_bytes)
    # The largest size without a rewrite: liveness of the built step only.
    base_edge = _largest_as_built(search, rng)
    # Cheap tiers first: the largest size the baseline or a sqrt(n) plan proves to fit.
    start = base_edge if base_edge is not None else first
    if start == rng.high or search.cheap_fits(rng.high)[0] is True:
        cheap_edge = rng.high
    else:
        cheap_edge = search.edge(start, rng.high, lambda b: search.cheap_fits(b)[0] is True,
                                 search.estimate)
    # Then the planner, for sizes the cheap tiers leave open.
    largest = cheap_edge
    if cheap_edge < rng.high and search.cheap_fits(cheap_edge + 1)[0] is None:
        largest = _planner_edge(search, cheap_edge, rng.high)
    # The table: the edges, sizes up to the baseline edge (free), a few planned between.
    for b in _table_sizes(rng.low, base_edge, largest, opts.points):
        if search.plan(b) is None and b == largest:  # pragma: no cover - fits was certain
            raise MemccError(f"{label}: {rng.dim}={b} fitted but the plan at the budget was "
                             "refused; please report this with the command")
    cands = tuple(_candidate(search, p, largest) for _, p in sorted(search.probes.items()))
    timed = [c for c in cands if c.fits and c.samples_per_s is not None]
    fastest = max(timed, key=lambda c: (c.samples_per_s, -c.batch)).batch
    picked = largest if opts.pick == "largest" else fastest
    chosen = search.plan(picked)
    assert chosen is not None
    step = _compiled(chosen, opts.provider)
    lr = opts.lr_for(picked)
    return TuneResult(
        model=label, range=rng, budget_bytes=budget_bytes, planning_budget_bytes=plan_budget,
        candidates=cands, largest_batch=largest, largest_batch_without_rewrite=base_edge,
        fastest_batch=fastest, picked_batch=picked, pick=opts.pick, step=step,
        cost_source=search.probes[picked].costs.source, strategy=opts.strategy,
        lr_rule=opts.lr_rule if lr is not None else None, lr=lr,
        lr_applied=lr is not None and opts.build.optimizer != "none",
        stats=dict(search.stats), time_s=time.perf_counter() - t0,
        steps={b: _compiled(p.outcome, opts.provider) for b, p in search.probes.items()
               if p.outcome is not None},
    )


def _compiled(outcome: PlanOutcome, provider: str) -> Graph:
    """The rewritten step of a plan, with the plan and its provider recorded as ``memcc
    compile`` does."""
    from memcc.step import PLAN_KEY, PROVIDER_KEY

    step = outcome.best.graph
    step.metadata[PLAN_KEY] = json.dumps(outcome.best.plan.to_json(), sort_keys=True)
    step.metadata[PROVIDER_KEY] = provider
    return step


def _budget(budget: str | int) -> int:
    if isinstance(budget, str) and budget.strip().lower() == "min":
        raise InputError("--budget min: tune searches for what fits a given budget; give a "
                         "size, e.g. --budget 1GB (compile --budget min gives the smallest "
                         "peak of one step)")
    if isinstance(budget, str) and budget.strip().endswith("%"):
        raise InputError(f"--budget {budget.strip()}: tune searches the sizes that fit one "
                         "memory budget, which a share of each size's own peak is not; give "
                         "a size, e.g. --budget 1GB (compile --budget 50% plans one step at a "
                         "share of its peak)")
    # --budget 0 is searched like any budget too small: the refusal then names the bound
    # (the bytes the first size needs at least), as compile's does.
    return parse_size(budget)


def _check_searchable(model: onnx.ModelProto, label: str, rng: SearchRange,
                      opts: TuneOptions) -> None:
    """A forward model with ``rng.dim`` among its symbolic input dimensions."""
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get(KIND_KEY) == "training_step":
        raise InputError(f"{label}: already a training step, whose sizes are fixed. tune "
                         "builds the step at each size: pass the forward model it was built "
                         "from (with a symbolic batch dimension)")
    if rng.dim in opts.dims:
        raise InputError(f"--dim {rng.dim} is both searched ({rng.dim}={rng.low}..{rng.high}) "
                         f"and bound ({rng.dim}={opts.dims[rng.dim]}): drop the binding")
    inits = {t.name for t in model.graph.initializer}
    symbolic: dict[str, list[str]] = {}
    shapes = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        shapes.append(f"{vi.name} [{', '.join(d.dim_param or str(d.dim_value) for d in dims)}]")
        for d in dims:
            if d.dim_param:
                symbolic.setdefault(d.dim_param, []).append(vi.name)
    if rng.dim in symbolic:
        return
    have = (f"its symbolic dimensions are {', '.join(sorted(symbolic))} (search one of "
            "them)" if symbolic else "it has no symbolic dimension")
    # The batch is axis 0 of every input; another dimension (a sequence) sits where the
    # model has it, which the file cannot say (a walk-through: "seq" was advised as axis 0).
    batch = "batch" in rng.dim.lower()
    axis, which = ("0", "a dynamic batch axis") if batch else \
        ("AXIS", f"'{rng.dim}' a dynamic axis (AXIS: the inputs' axis that holds it)")
    raise InputError(
        f"{label}: no input has a symbolic dimension named '{rng.dim}'; {have}. Inputs: "
        f"{'; '.join(shapes) or 'none'}. Export the model with {which}: "
        "torch.onnx.export(model, args, f, input_names=['input'], "
        f"dynamic_axes={{'input': {{{axis}: '{rng.dim}'}}}}), or with dynamo=True, "
        f"dynamic_shapes={{'input': {{{axis}: torch.export.Dim('{rng.dim}')}}}}"
        + ("; the zoo's builders take -O dynamic_batch=true" if batch else ""))


def _under_the_floor(search: SizeSearch, b: int, budget: int, floor: int) -> InputError:
    """The refusal of a budget under the bytes no plan can remove at size ``b``."""
    label, dim = search.label, search.rng.dim
    need = user_budget(floor, search.compile, search.slack)
    return InputError(
        f"{label}: nothing fits {format_size(budget)} ({budget:,} bytes): at {dim}={b} "
        f"the inputs, parameters and optimizer state"
        + (" with the CUDA session's own handles and workspaces" if search.opts.provider
           == "cuda" else "") + " alone take "
        f"{format_size(floor)} ({floor:,} bytes; planning budget "
        f"{format_size(search.budget)} after the {search.opts.margin:.0%} + "
        f"{search.slack:,} bytes margin), and recomputation cannot shrink them (nor the "
        f"updated copies the step outputs). No budget under {format_size(need)} "
        f"({need:,} bytes) can fit: give --budget {need} or more (memcc compile "
        f"--budget min on the step at {dim}={b} finds what it needs), or train fewer "
        "parameters (--freeze PATTERN keeps them fixed, without gradients or state); "
        "adamw keeps two state tensors per parameter, sgd one")


def _nothing_fits(search: SizeSearch, b: int, budget: int) -> MemccError:
    """The refusal of a budget that the smallest size fits under no plan (its floor
    fits: ``_under_the_floor`` refused the rest before anything was priced)."""
    p = search.probes[b]
    label, dim = search.label, search.rng.dim
    # The smallest peak found; with --strategy none, the step as built.
    smallest = next(v for v in (p.smallest, p.sqrtn_peak, p.baseline.peak_bytes)
                    if v is not None)
    need = user_budget(smallest, search.compile, search.slack)
    return InputError(
        f"{label}: nothing fits {format_size(budget)}: even {dim}={b} needs a peak of "
        f"{format_size(smallest)} at the least (strategy {search.opts.strategy}; its step "
        f"as built peaks at {format_size(p.baseline.peak_bytes)}), and plans aim at "
        f"{format_size(search.budget)} (the budget less the {search.opts.margin:.0%} + "
        f"{search.slack:,} bytes margin). Give --budget {need} or more, or "
        "smaller sizes of the other dimensions (--dim NAME=INT)")


def _largest_as_built(search: SizeSearch, rng: SearchRange) -> int | None:
    """The largest size whose step as built fits (liveness only, no planning)."""
    def base_fits(b: int) -> bool:
        return search.probe(b).baseline.peak_bytes <= search.budget

    if not base_fits(rng.low):
        return None
    if base_fits(rng.high):
        return rng.high
    return search.edge(rng.low, rng.high, base_fits,
                       lambda b: float(search.probes[b].baseline.peak_bytes))


def _planner_edge(search: SizeSearch, low: int, top: int) -> int:
    """The edge above ``low`` (which fits) where the cheap tiers cannot tell: step up to
    where the sqrt(n) peaks, scaled by how far below them the planner reached, predict the
    edge, until a size does not fit; then close in. Typically three planner calls: a min
    search just above ``low`` (how much better than sqrt(n) the planner does), one just
    past the predicted edge, and the plan at the edge."""
    probe = low + 1
    while True:
        if not search.fits(probe)[0]:
            break
        low = probe
        if low == top:
            return top
        probe = min(max(_predicted_edge(search, low - 1, low) + 1, low + 1), top)
    return search.edge(low, probe, lambda b: search.fits(b)[0], search.estimate)


def _predicted_edge(search: SizeSearch, a: int, b: int) -> int:
    """The largest size whose scaled sqrt(n) peak, on the line through sizes ``a`` < ``b``,
    is within the budget (at least ``b``)."""
    s_a, s_b = search.sqrtn_peak(a), search.sqrtn_peak(b)
    ratios = [q.smallest / q.sqrtn_peak for q in search.probes.values()
              if q.smallest is not None and q.sqrtn_peak]
    ratio = min(ratios, default=1.0)
    slope = (s_b - s_a) / (b - a)
    if slope <= 0:
        return b
    return b + max(int((search.budget / ratio - s_b) / slope), 0)


def _table_sizes(low: int, base_edge: int | None, largest: int, points: int) -> list[int]:
    """Sizes the table shows with a predicted time: powers of two up to the baseline edge
    (no planning needed there), both edges, and ``points`` sizes spaced geometrically
    between them (each a plan)."""
    sizes = {largest}
    if base_edge is not None:
        sizes.add(base_edge)
        sizes.add(low)
        b = 1
        while b <= base_edge:
            if b >= low:
                sizes.add(b)
            b *= 2
    start = base_edge if base_edge is not None else low
    if largest > start and points > 0:
        for i in range(1, points + 1):
            sizes.add(int(round(start * (largest / start) ** (i / (points + 1)))))
    return sorted(s for s in sizes if low <= s <= largest)


def _candidate(search: SizeSearch, p: SizeProbe, largest: int) -> Candidate:
    """The table row of a size, from what the search learnt (it computes nothing new)."""
    base_s = p.baseline.compute_cost_s
    budget = search.budget
    row = dict(batch=p.batch, baseline_peak_bytes=p.baseline.peak_bytes,
               baseline_step_s=base_s, lr=p.lr)
    if p.baseline.peak_bytes <= budget:
        return Candidate(fits=True, decided_by="baseline", peak_bytes=p.baseline.peak_bytes,
                         peak_kind="as built", step_s=base_s, strategy="none (fits as built)",
                         **row)
    if p.outcome is not None:
        best = p.outcome.best
        return Candidate(fits=True, decided_by="plan", peak_bytes=best.peak_bytes,
                         peak_kind="plan", step_s=best.compute_cost_s,
                         strategy=p.outcome.label, **row)
    if search.opts.strategy == "none":
        return Candidate(fits=False, decided_by="baseline", peak_bytes=p.baseline.peak_bytes,
                         peak_kind="as built", **row)
    if p.smallest is not None:
        return Candidate(fits=p.smallest_fits(budget), decided_by="min-search",
                         peak_bytes=p.smallest, peak_kind="smallest", **row)
    if p.floor_bytes > budget:
        return Candidate(fits=False, decided_by="floor", peak_bytes=p.floor_bytes,
                         peak_kind="floor", **row)
    if p.sqrtn_fit is not None and p.sqrtn_fit <= budget:
        return Candidate(fits=True, decided_by="sqrtn", peak_bytes=p.sqrtn_peak,
                         peak_kind="sqrt(n)", **row)
    # Only its baseline was needed: it lies below the largest size (and fits, as the
    # peaks grow with the size) or above the size shown not to fit.
    below = p.batch < largest
    return Candidate(fits=below, decided_by="below-edge" if below else "above-edge",
                     peak_bytes=p.sqrtn_peak,
                     peak_kind=None if p.sqrtn_peak is None else "sqrt(n)", **row)


# ---------------------------------------------------------------------------- outputs
def write_step(result: TuneResult, path: str | os.PathLike) -> Path:
    """Write the chosen compiled step atomically (a temporary file, then a rename)."""
    from memcc.backend.onnx_file import save_graph

    out = Path(path)
    try:
        return save_graph(result.step, out)
    except OSError as exc:
        raise InputError(f"cannot write {exc.filename or out}: {exc.strerror or exc}. "
                         "Nothing was written.") from None
