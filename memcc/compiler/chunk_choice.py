"""Row chunks chosen by ``memcc compile``: the loss, attentions and MLPs split where it pays.

Row chunks (``frontend/chunked_loss.py``, ``frontend/row_chunks.py``) shrink a language
model's largest tensors (the logits, an attention's scores, an MLP's hidden activations)
at the price of smaller matrix products and gradients summed over chunks (equivalent tier,
within 1e-5). They are rewrites of the forward model, made before the autodiff, so the
planner cannot toggle them node by node as it does recompute or a variant: each setting is
another step. Compile weighs them the way it weighs strategies: it builds the step with a
few settings, plans each for the budget, and keeps the plan that fits at the least
predicted step time (``--budget min``: the smallest budget, ties to the least time).

A setting is one chunk count per kind (the loss, every attention, every MLP), not per
site: a transformer's layers are alike, and a count per site would multiply the plans
(each takes seconds). The ladder is short and ordered from the lightest split to the
heaviest (``LADDER``); where a kind has no site in the model, or its flag was given (an
override: ``--mlp-chunks 1`` keeps MLPs whole), the ladder leaves it as it is.

When compile searches (``needs_search``): the step as built does not fit the budget, or
``--budget min``. A step that fits as built is searched only where its plan adds time and
a setting's own added time, estimated from its build without planning it, is below that
(``compiler/chunk_fit.py``: planning every setting there doubled compile time and broke
--time-limit, so the screen comes first). Every setting of one compile, the step as loaded
included, shares one ``--time-limit`` (``compiler/chunk_clock.py``: each is given a fixed
share of the work and the deadline what is left of it; at a budget the step as built
misses, each setting is screened with a small share and the winner planned again with the
rest). A step given already built keeps
the chunks it was built with (they are part of its graph); the report says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from memcc.compiler.advice import without_chunks_hint
from memcc.compiler.chunk_budget import search_budget, smallest_named
from memcc.compiler.chunk_clock import SharedLimit
from memcc.compiler.chunk_fit import FREE, FitSearch, decision, search_fitting
from memcc.compiler.loading import LOSS, loss_sites
from memcc.compiler.stem_gate import gate
from memcc.errors import InputError
from memcc.frontend.batch_chunks import BATCH, splittable_stems
from memcc.frontend.build import BuildOptions
from memcc.frontend.load import load_graph
from memcc.frontend.row_chunks import ATTENTION, MLP, find_regions
from memcc.graph import Graph
from memcc.passes.planning.planner import BudgetError
from memcc.passes.planning.request import Budget
from memcc.passes.planning.work import simulated_nodes
from memcc.report_text import describe_chunks as describe
from memcc.sizes import format_size

if TYPE_CHECKING:
    from memcc.compiler.options import CompileOptions
    from memcc.compiler.planning import Planned
    from memcc.passes.analysis.cost_model import CostModel

KINDS = (LOSS, ATTENTION, MLP, BATCH)
FIELDS = {LOSS: "loss_chunks", ATTENTION: "attention_chunks", MLP: "mlp_chunks",
          BATCH: "batch_chunks"}
FLAGS = {LOSS: "--loss-chunks", ATTENTION: "--attention-chunks", MLP: "--mlp-chunks",
         BATCH: "--batch-chunks"}
# The settings tried, lightest first: the loss alone (no recompute, the logits are often the
# largest tensor), then attentions, MLPs and a convnet's stem (over batch chunks,
# frontend/batch_chunks.py) too, in 4 and in 8 chunks.
LADDER: tuple[dict[str, int], ...] = (
    {LOSS: 8},
    {LOSS: 8, ATTENTION: 4, MLP: 4, BATCH: 4},
    {LOSS: 8, ATTENTION: 8, MLP: 8, BATCH: 8},
)
# --budget min: budgets within this share of each other tie (the faster plan wins). 3%, the
# accuracy memcc's predicted peaks are held to: a split that lowers the budget by less is not
# a saving a user can count on, and it cost +84% (a transformers GPT-2 on the CPU) to +221%
# (on CUDA) predicted step time for 1-2% less budget with 1%.
MIN_TIE = 0.03

# Compile's plan stage for one step (``compiler.planning.Planned``: outcome, rewritten step,
# slack, planning budget; raises ``BudgetError`` where nothing fits).
PlanStep = Callable[[Graph, "CostModel", "CompileOptions"], "Planned"]
Rebuild = Callable[["CompileOptions"], tuple[Graph, "CostModel"]]
# A setting's step built but not planned: (its time as built less the step as loaded's,
# both priced by the step as loaded's cost model, in seconds; its nodes; how many bytes
# lower its peak as built is than the step as loaded's, both by the same liveness).
Estimate = Callable[["CompileOptions"], tuple[float, int, int]]


@dataclass(frozen=True)
class RowChunkSearch:
    """What compile lends the row-chunk search: the model as given (``model``, named
    ``label``; ``built``: compile built the step from a forward model, else it cannot be
    re-chunked), how to plan a step (``plan_step``) and to build the model with other
    chunks (``rebuild``), the pass list compile reports (left holding the chosen
    attempt's passes), progress, and ``user_budget(peak, slack)``: the budget a user
    gives for a plan of that peak."""

    model: object
    label: str
    built: bool
    plan_step: PlanStep
    rebuild: Rebuild
    passes: list
    say: Callable[[str], None]
    user_budget: Callable[[int, int], int]
    estimate: Estimate | None = None
    found: dict[str, int] | None = None
    # The most rows a region of each kind has (the load pass's ``splittable_rows``).
    rows: dict[str, int] | None = None


@dataclass
class Attempt:
    """One setting planned: its step, costs, plan (or refusal) and the passes that made it."""

    chunks: dict[str, int]
    options: CompileOptions
    estimated_added_time: float | None = None
    time_limit_s: float | None = None  # its share of --time-limit (``SharedLimit``)
    phase: str | None = None  # "screen" or "final" (``_search_budget``'s two phases)
    graph: Graph | None = None
    costs: CostModel | None = None
    planned: Planned | None = None
    refusal: BudgetError | None = None
    error: str | None = None          # the build itself failed (InputError)
    passes: list = field(default_factory=list)
    simulated_nodes: int = 0          # the nodes its plan simulated (``work.simulated_nodes``)

    @property
    def fits(self) -> bool:
        return self.planned is not None

    @property
    def step_time_s(self) -> float:
        return float(self.planned[0].best.compute_cost_s)

    def budget_bytes(self, user_budget: Callable[[int, int], int]) -> int | None:
        """The budget a user must give for this plan (``--budget min``'s answer)."""
        if self.planned is None:
            return None
        outcome, _, slack, _ = self.planned
        return user_budget(outcome.best.peak_bytes, slack)

    def to_json(self, base_time: float | None, user_budget) -> dict:
        out: dict = {"chunks": dict(self.chunks), "fits": self.fits}
        if self.time_limit_s is not None:
            out["time_limit_s"] = round(self.time_limit_s, 3)
        if self.phase is not None:
            out["phase"] = self.phase
        if self.estimated_added_time is not None:
            out["estimated_added_time"] = round(self.estimated_added_time, 4)
        if self.planned is not None:
            out["as_built_peak_bytes"] = int(self.planned[0].baseline.peak_bytes)
            out["peak_bytes"] = int(self.planned[0].best.peak_bytes)
            out["needs_budget_bytes"] = self.budget_bytes(user_budget)
            out["step_time_s"] = round(self.step_time_s, 6)
            if base_time:
                out["added_time"] = round(self.step_time_s / base_time - 1.0, 4)
        elif self.refusal is not None:
            out["refused"] = "does not fit"
            out["smallest_budget_bytes"] = int(self.refusal.smallest)
        if self.error is not None:
            out["refused"] = self.error
        return out


@dataclass
class Choice:
    """The attempt compile goes on with, and the report's ``row_chunks`` section."""

    attempt: Attempt
    report: dict


def sites(forward: Graph, build: BuildOptions) -> dict[str, int]:
    """How many places of each kind row chunks could split in ``forward``."""
    found = {kind: len(find_regions(forward, kind)) for kind in (ATTENTION, MLP)}
    stems = splittable_stems(forward)
    return {LOSS: loss_sites(forward, build), **found, **({BATCH: stems} if stems else {})}


def chunks_of(build: BuildOptions) -> dict[str, int]:
    """The counts a build uses (unset: 1; the stem's only where it is split, so that the
    settings of a model without a stem read as they did before it was a kind)."""
    return trim_chunks({k: int(getattr(build, FIELDS[k]) or 1) for k in KINDS})


def trim_chunks(chunks: dict[str, int], least: int = 2) -> dict[str, int]:
    """``chunks`` (or sites, ``least`` 1) without the stem's entry under ``least``."""
    return {k: n for k, n in chunks.items() if k != BATCH or n >= least}


def candidates(build: BuildOptions, found: dict[str, int],
               rows: dict[str, int] | None = None) -> list[dict[str, int]]:
    """The ladder's settings for this model: kinds given by flags kept, kinds without a
    site left whole, counts above ``rows`` (the most rows a region of the kind has) cut to
    it, as the build cuts them; duplicates and the setting as built dropped (a walk-through
    saw "mlp 4" and "mlp 8" planned on MobileNetV3's 4-row MLPs, the same step twice)."""
    fixed = chunks_of(build)
    auto = {k for k in KINDS if getattr(build, FIELDS[k]) is None and found.get(k)}
    if build.precision != "fp32":  # the chunked loss is float32-only (BuildOptions says)
        auto.discard(LOSS)
    most = rows or {}
    seen = [fixed]
    out = []
    for rung in LADDER:
        c = trim_chunks({k: (min(rung.get(k, 1), most.get(k, rung.get(k, 1))) if k in auto
                             else fixed.get(k, 1)) for k in KINDS})
        if c not in seen:
            seen.append(c)
            out.append(c)
    return out


def _given(build: BuildOptions, found: dict[str, int] | None) -> set[str]:
    """The kinds whose count a flag set (a model known to have no stem: as if set to 1)."""
    given = {k for k in KINDS if getattr(build, FIELDS[k]) is not None}
    return given | ({BATCH} if found is not None and not found.get(BATCH) else set())


def _gate_stem(search: RowChunkSearch, options: CompileOptions, graph: Graph,
               searchable: bool) -> tuple[dict[str, int], dict]:
    """The model's sites (``search.found``, else counted), gated (``stem_gate.gate``), and
    the report's ``stem_shares`` where the gate was asked."""
    found = search.found if search.found is not None or not searchable else sites(
        load_graph(search.model, options.dims, source=search.label), options.build)
    found, shares = gate(found, options.build.batch_chunks, graph)
    return found, ({"stem_shares": [round(x, 4) for x in shares[:2]],
                    "stem_tensors_bytes": shares[2]} if shares else {})


def _say_first(search: RowChunkSearch, later: int) -> None:
    """Name the step as built's plan where row-chunk settings may follow: its stages were
    the only ones no line named."""
    if later:
        search.say(f"row chunks: the step as built is planned first; {later} other "
                   "setting(s) may follow, within the one --time-limit")


def needs_search(first: Attempt, budget: Budget) -> str | None:
    """Why compile should try row chunks after the step as built (None: it should not)."""
    if budget.is_min:
        return "--budget min: the smallest budget is sought over row chunks too"
    if not first.fits:
        return "the step as built does not fit the budget"
    # Where the step as built fits, it is kept even when its plan recomputes a lot: each
    # setting is a whole plan, and searching them there doubled compile time and broke
    # --time-limit on MONeT's ResNet-50 (tests/large_time_limit.py).
    return None


def choose_row_chunks(search: RowChunkSearch, graph: Graph, costs: CostModel,
                      options: CompileOptions, budget: Budget) -> Choice:
    """Plan ``graph`` (the step as loaded) and, where it pays, the step built with other row
    chunks; return the chosen attempt (``search.passes`` then holds its passes only).
    Raises the refusal of the attempt that came nearest when no setting fits ``budget``."""
    label, built, passes, user_budget = (search.label, search.built, search.passes,
                                         search.user_budget)
    given = _given(options.build, search.found)
    searchable = built and given != set(KINDS)
    found, stem_report = _gate_stem(search, options, graph, searchable)
    # The settings that may be planned after the step as loaded share its --time-limit.
    later = len(candidates(options.build, found, search.rows)) if searchable else 0
    following = min(later, 1) if budget.is_min else later   # --budget min: the heaviest
    clock = SharedLimit.of(options.time_limit, budget.is_min, following)
    # The step as loaded (its load and cost passes are in ``passes``); where settings may
    # follow at a budget, its refusal is a screen (``chunk_budget`` searches the smallest).
    screens = bool(later) and not budget.is_min
    _say_first(search, following)
    first = _attempt(search, replace(options, smallest_on_refusal=not screens),
                     lambda: (graph, costs), mark=0, strict=True, limit=clock.first())
    base_time = costs.total(graph)
    report: dict = {"chosen": dict(first.chunks), "searched": False, **stem_report}
    tried = [first]

    def done(chosen: Attempt) -> Choice:
        passes[:] = chosen.passes
        report["chosen"] = dict(chosen.chunks)
        if len(tried) > 1:
            report["candidates"] = [
                {**a.to_json(base_time, user_budget), "chosen": a is chosen} for a in tried]
        if not chosen.fits:
            raise _refusal(chosen, tried, label, report.get("not_screened"))
        return Choice(chosen, report)

    if not built:
        report["why"] = ("the input is a training step: its row chunks were fixed when it "
                         "was built (memcc build --loss-chunks/--attention-chunks/"
                         "--mlp-chunks); compile the forward model to let compile choose "
                         "them")
        return done(first)
    if given == set(KINDS):
        report["why"] = "every kind was set by a flag (" + ", ".join(
            f"{FLAGS[k]} {getattr(options.build, FIELDS[k])}" for k in KINDS
            if getattr(options.build, FIELDS[k]) is not None) + ")"
        return done(first)

    def attempt(chunks: dict[str, int], limit: tuple[float, float],
                phase: str | None = None, built: Attempt | None = None) -> Attempt:
        """Plan ``chunks`` within ``limit`` (``SharedLimit``: work, deadline); ``built``:
        an attempt of the same setting whose step is planned again (not built again)."""
        search.say(f"row chunks: planning the step built with {describe(chunks)}"
                   + (f" ({phase})" if phase else ""))
        build = replace(options.build, **{FIELDS[k]: n for k, n in chunks.items()})
        # A screen refuses without the smallest-peak search (``chunk_budget`` does it).
        opts = replace(options, build=build, smallest_on_refusal=phase != "screen")
        mark = len(passes)
        load = (lambda: search.rebuild(opts)) if built is None else _reuse(built, passes)
        a = _attempt(search, opts, load, mark=mark, limit=limit)
        a.phase = phase
        tried.append(a)
        return a

    why = needs_search(first, budget)
    if why is None:
        step = (base_time, len(graph.nodes), search.estimate)
        _search_fitting((found, search.rows), first, options, step, (clock, report), attempt)
        return done(next((a for a in tried if a.chunks == report["chosen"]), first))
    report["sites"] = found
    ladder = candidates(options.build, found, search.rows)
    if not ladder:
        report["why"] = (why + "; but the model has no loss projection, attention, MLP or "
                         "stem left for compile to split")
        return done(first)
    report["searched"] = True
    report["why"] = why
    if budget.is_min:
        chosen = _search_min(first, ladder, lambda c: attempt(c, clock.next(1)), user_budget)
    else:
        chosen = search_budget(first, ladder, attempt, base_time, (clock, report))
    return done(chosen)


def _search_fitting(sites_rows: tuple[dict[str, int], dict[str, int] | None],
                    first: Attempt, options: CompileOptions,
                    step: tuple[float, int, Estimate | None],
                    clock: tuple[SharedLimit, dict], attempt) -> None:
    """A step that fits as built (``compiler/chunk_fit.py``): where its plan adds time,
    the settings whose own added time, estimated from their build, is below it are planned
    within what is left of ``--time-limit`` (``clock[0]``, shared with the step as built's
    plan); ``report`` (``clock[1]``) gets ``chosen``, ``screened`` and why. ``step``: the
    unchunked step's time and nodes, and how to estimate a setting (``sites_rows``: the
    model's sites, and the most rows a region of each kind has)."""
    base_time, nodes, estimator = step
    found, rows = sites_rows
    shared, report = clock
    first_added = first.step_time_s / base_time - 1.0 if base_time > 0 else 0.0
    # The same time summed in another order can differ in the last bit: no "-0.0%".
    first_added = round(first_added, 9) + 0.0
    report["as_built_added_time"] = round(first_added, 4)
    if first_added <= FREE:
        report["why"] = (f"the step as built fits the budget with no added time "
                         f"({first_added:+.1%}): row chunks could only add time, so none "
                         "was built or planned")
        return
    report["sites"] = found
    ladder = candidates(options.build, found, rows)
    if not ladder:
        report["why"] = (f"the step as built fits the budget at {first_added:+.1%}, and the "
                         "model has no loss projection, attention, MLP or stem left to split")
        return
    if estimator is None:   # a caller that cannot build settings without planning
        report["why"] = f"the step as built fits the budget at {first_added:+.1%}"
        return
    estimates: dict[tuple, float] = {}
    outcome = first.planned[0]
    shed = max(outcome.baseline.peak_bytes - outcome.best.peak_bytes, 1)

    def estimate(chunks: dict[str, int]) -> tuple[float, int]:
        build = replace(options.build, **{FIELDS[k]: n for k, n in chunks.items()})
        added_s, n, lowered = estimator(replace(options, build=build))
        # What the split leaves to shed is shed as the step as built's plan shed it: its
        # added time in proportion (a split that lowers the peak little saves little).
        left = max(shed - lowered, 0) / shed
        estimates[tuple(chunks.values())] = added_s / base_time + first_added * left
        return estimates[tuple(chunks.values())], n

    def plan(chunks: dict[str, int]) -> tuple[bool, float]:
        a = attempt(chunks, shared.next(len(ladder) - ladder.index(chunks)))
        a.estimated_added_time = estimates.get(tuple(chunks.values()))
        return a.fits, a.step_time_s if a.fits else 0.0

    plan_s = sum(p.time_s for p in first.passes if p.name in ("plan", "rewrite"))
    fs = FitSearch(first_added, base_time, ladder, estimate, plan, plan_s, nodes, shared.end)
    chosen = search_fitting(fs)
    report["screened"] = fs.screen
    report["searched"] = any(e.get("planned") for e in fs.screen)
    report["chosen"] = dict(chosen) if chosen is not None else dict(first.chunks)
    report["why"] = decision(first_added, report["chosen"], fs.screen)


def _reuse(built: Attempt, passes: list) -> Callable[[], tuple[Graph, CostModel]]:
    """Load ``built``'s step again: its build passes (not its plan's) go back into
    ``passes``, where the plan's refusal looks for the load's summary."""
    def load() -> tuple[Graph, CostModel]:
        passes.extend(p for p in built.passes if p.name not in ("plan", "rewrite"))
        return built.graph, built.costs
    return load


def _search_min(first: Attempt, ladder: list[dict[str, int]], attempt,
                user_budget) -> Attempt:
    """The heaviest split only (the smallest budget wherever a split lowers it; each
    setting costs a smallest-peak search of its own, and trying the lighter ones too made
    --budget min two to three times slower for a tie-break on time): it wins where its
    budget is smaller than the step as built's by more than ``MIN_TIE``."""
    heavy = attempt(ladder[-1])
    if not heavy.fits:
        return first
    if not first.fits or _budget(heavy, user_budget) < _budget(first, user_budget) / (
            1 + MIN_TIE):
        return heavy
    return first


def _budget(a: Attempt, user_budget) -> float:
    b = a.budget_bytes(user_budget)
    return float("inf") if b is None else float(b)


def _attempt(search: RowChunkSearch, options: CompileOptions,
             load: Callable[[], tuple[Graph, CostModel]], *, mark: int,
             limit: tuple[float, float | None], strict: bool = False) -> Attempt:
    """Build (``load``) and plan one setting (``search.plan_step``); its passes
    (``search.passes[mark:]``) are moved out of that list. A setting compile chose whose
    build fails is set aside with why (e.g. a loss projection that is also an attention's
    last product, split with it); the step as loaded (``strict``) raises as compile always
    did. ``limit``: the plan's share of --time-limit and its deadline (``SharedLimit``;
    the report keeps the options as given)."""
    passes, plan_step = search.passes, search.plan_step
    work, deadline = limit
    # The options kept are compile's (a screen's refusal without the smallest-peak search
    # is this plan's only).
    a = Attempt(chunks_of(options.build), replace(options, smallest_on_refusal=True),
                time_limit_s=work)
    before = simulated_nodes()
    try:
        a.graph, a.costs = load()
        planning = replace(options, time_limit=work, deadline=deadline)
        a.planned = plan_step(a.graph, a.costs, planning)
    except BudgetError as exc:
        a.refusal = exc
    except InputError as exc:
        if strict:
            raise
        a.error = str(exc)
    finally:
        a.simulated_nodes = simulated_nodes() - before
    a.passes = passes[mark:]
    del passes[mark:]
    return a


def _refusal(chosen: Attempt, tried: list[Attempt], label: str,
             not_screened: str | None = None) -> BudgetError:
    """The nearest attempt's refusal, saying which row chunks were tried (or why none
    was: ``not_screened``)."""
    if chosen.refusal is None:
        raise InputError(f"{label}: {chosen.error}")
    # Each setting's lowest budget, a screen's or the first plan's included: the searched
    # smallest peak's budget adds that plan's heap room, and a plan found at the budget can
    # need less (SegFormer's refusal named 7.55 MB where the first plan's 6.90 compiled).
    least: dict[tuple, Attempt] = {}
    for a in tried:
        key = tuple(a.chunks.items())
        if key not in least or smallest_named(a) < smallest_named(least[key]):
            least[key] = a
    chosen = min(least.values(), key=smallest_named)
    exc = chosen.refusal
    others = "; ".join(
        f"{describe(a.chunks)}: "
        + (format_size(a.refusal.smallest) if a.refusal is not None else str(a.error))
        for a in least.values() if a.chunks != chosen.chunks)
    if others:
        said = (" Compile also built the step with other row chunks: the smallest budget "
                f"above is with {describe(chosen.chunks)} (the others: {others}).")
    elif not_screened:
        said = f" Row chunks: {not_screened}."
    else:
        return exc
    return BudgetError(f"{without_chunks_hint(str(exc))}{said}", budget=exc.budget,
                       smallest=exc.smallest, outcome=exc.outcome)
