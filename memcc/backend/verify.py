"""Proof by running: the rewritten step computes what the original did, within budget.

Both steps run once in ORT, same session settings, same inputs (the synthetic batch and
the initial state); every output (loss, gradients, updated parameters and state) must be
bit-identical on the CPU provider, because recomputation repeats the same kernels on the
same inputs. On CUDA the step as built is not reproducible itself (measured on an H100:
two runs of one ResNet-50 step differ, BENCHMARKS.md "CUDA on an H100"), so the original
runs twice there and each output may differ from it by rtol 1e-5 or by
``SPREAD_FACTOR`` times what the original's two runs differ by, whichever is larger; the
report says which outputs needed the second. A plan with numerically equivalent operator
variants is compared within the largest tolerance they state, or within ``SPREAD_FACTOR``
times what one ulp of the batch moves the step as built by (``input_sensitivity``: the
original runs once more with every floating-point data input moved one ulp away from zero),
since a step whose outputs move that far for a change of the input's last bit cannot be
held to less by another rounding of the same arithmetic (transformers' MobileViT: the
momentum of its SiLU layers moves by 1.1e-4 relative for one ulp of the pixels, and the
plan's SiLU variant by 1.5e-4, against a stated 1e-5); the report says how many outputs
needed that. The rewritten step must
also leave every value it is fed as it was: one that writes into a fed buffer starts its
next step from other values (ORT's CPU BatchNorm did, for a recomputed clone), which one
run's outputs do not show. Then the
rewritten file runs under ``run_steps`` (its own measuring process): the measured peak must
be within the budget and ORT's executed order must be the planned order.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memcc.backend.determinism import racing_nodes
from memcc.backend.onnx_file import save_graph
from memcc.backend.runner import RunRequest, run_steps, session_graph, synthetic_feeds
from memcc.backend.session import make_session
from memcc.backend.step_feeds import refuse_bfloat16_feeds
from memcc.errors import RuntimeFailure
from memcc.graph import Graph, node_label
from memcc.passes.analysis.liveness import categorize
from memcc.step import TrainingStep


def step_outputs(graph: Graph, feeds: dict[str, np.ndarray], provider: str,
                 written: list[str] | None = None, also: Sequence[str] = ()
                 ) -> dict[str, np.ndarray]:
    """Every output of one run of ``graph``, and the values named in ``also`` (made outputs
    for this run); with ``written``, the names of the fed values (batch, parameters, state)
    whose bytes the run changed are appended to it. The run gets copies: the stored values
    are the graph's own arrays, and a run that writes into what it is fed would change the
    step compile writes."""
    g, values = session_graph(graph)
    names = list(dict.fromkeys([*graph.outputs, *also]))
    g.outputs = names
    sess = make_session(g.to_model(), provider)
    given = {**values, **feeds}
    fed = {n: np.array(v, copy=True) for n, v in given.items()}
    out = sess.run(names, fed)
    if written is not None:
        written.extend(n for n, v in given.items() if not _same_bytes(v, fed[n]))
    return dict(zip(names, out, strict=True))


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


# An output is compared relative to its own largest entry, or to this fraction of the largest
# output of its kind, whichever is larger.
NOISE_FLOOR = 0.1
# On CUDA a plan's output may differ from the original's by this many times what two runs
# of the original differ by: the plan's run and the original's are two draws of the same
# irreproducible arithmetic, and one draw of their difference can exceed another.
SPREAD_FACTOR = 4.0


def _max_abs_diff(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(x, dtype=np.float64)
                               - np.asarray(y, dtype=np.float64)), initial=0.0))


def run_to_run_spread(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]
                      ) -> dict[str, float]:
    """Per floating-point output, the largest difference between two runs of one step."""
    out = {}
    for name, x in a.items():
        x = np.asarray(x)
        if x.dtype.kind == "f" and name in b and np.shape(b[name]) == x.shape:
            out[name] = _max_abs_diff(x, b[name])
    return out


def input_sensitivity(graph: Graph, feeds: Mapping[str, np.ndarray],
                      ref: Mapping[str, np.ndarray], provider: str) -> dict[str, float]:
    """Per floating-point output, how far the step moves from ``ref`` (its outputs on
    ``feeds``) when every floating-point data input (the batch; the parameters and state
    are the graph's own values, not fed) moves one ulp away from zero (``one_ulp_out``).

    Away from zero rather than towards +inf: it treats a value and its negation alike, it
    leaves an infinity (an additive attention mask's -inf) infinite where +inf would make
    -inf the largest finite negative, and where it errs it tends to err strict: a change
    that is nearly one common scale of the batch is partly undone by a normalisation that
    follows it, so it tends to give the smaller sensitivity (transformers' MobileViT, batch
    4: the momentum that moves most moves by 9.9e-5 so, by 2.0e-4 towards +inf)."""
    nudged = {name: one_ulp_out(v) for name, v in feeds.items()}
    return run_to_run_spread(ref, step_outputs(graph, nudged, provider))


def one_ulp_out(v: np.ndarray) -> np.ndarray:
    """``v`` with every finite, non-zero floating-point entry moved one ulp away from zero;
    zeros (one ulp of zero is a subnormal, not a rounding-sized change), infinities, NaN
    and non-float arrays as they are."""
    v = np.asarray(v)
    if v.dtype.kind != "f":
        return v
    away = np.nextafter(v, np.copysign(np.asarray(np.inf, v.dtype), v))
    return np.where((v == 0) | ~np.isfinite(v), v, away).astype(v.dtype)


def compare_outputs(a: dict[str, np.ndarray], b: dict[str, np.ndarray], *, exact: bool,
                    tolerance: float | None = None,
                    kinds: Mapping[str, str] | None = None,
                    spread: Mapping[str, float] | None = None) -> list[str]:
    """Problems found comparing every output of ``a`` with ``b`` (``differing_outputs``)."""
    return list(differing_outputs(a, b, exact=exact, tolerance=tolerance, kinds=kinds,
                                  spread=spread).values())


def differing_outputs(a: dict[str, np.ndarray], b: dict[str, np.ndarray], *, exact: bool,
                      tolerance: float | None = None,
                      kinds: Mapping[str, str] | None = None,
                      spread: Mapping[str, float] | None = None) -> dict[str, str]:
    """Output -> the problem found comparing it in ``a`` with ``b``: bit for bit (``exact``),
    else within rtol 1e-5, or with ``tolerance`` (a plan with numerically equivalent
    variants): max |a - b| <= tolerance * max |a| per output, a relative error that stays
    meaningful for gradients with entries near zero.

    An output much smaller than the others of its kind (``kinds``: output -> parameters,
    optimizer state, gradients...; one kind for all when None) is compared relative to
    ``NOISE_FLOOR`` of the largest of them instead. Its own relative error can be rounding
    noise over rounding noise: the bias of a convolution followed by a BatchNorm in training
    mode has a gradient that is exactly zero in exact arithmetic, and float32 leaves about
    1e-7 of the layer's largest gradient in it, different for every rounding (timm's
    EfficientNet-B0 and MobileViT: relative errors of 1e-3 to 1e-2 on such gradients under a
    plan whose variants are within 1e-6 everywhere else). A real error in a small output
    still shows: with a tolerance of 1e-5, an output at a thousandth of the largest of its
    kind fails beyond 0.1% of its own size.

    ``spread`` (CUDA: ``run_to_run_spread`` of two runs of the original; CPU with a
    ``tolerance``: ``input_sensitivity``): an output also passes when it differs by at most
    ``SPREAD_FACTOR`` times its own spread. Bit for bit (``exact``) takes no spread."""
    problems: dict[str, str] = {}
    largest: dict[str, float] = {}
    if tolerance is not None:
        for name, v in a.items():
            v = np.asarray(v)
            if v.dtype.kind == "f":
                kind = (kinds or {}).get(name, "")
                largest[kind] = max(largest.get(kind, 0.0),
                                    float(np.max(np.abs(v), initial=0.0)))
    for name in a:
        if name not in b:
            problems[name] = f"output '{name}' missing from the rewritten step"
            continue
        x, y = np.asarray(a[name]), np.asarray(b[name])
        if x.shape != y.shape or x.dtype != y.dtype:
            problems[name] = (f"output '{name}': {x.dtype}{list(x.shape)} vs "
                              f"{y.dtype}{list(y.shape)}")
        elif tolerance is not None:
            err = _max_abs_diff(x, y)
            floor = NOISE_FLOOR * largest.get((kinds or {}).get(name, ""), 0.0)
            scale = max(float(np.max(np.abs(x.astype(np.float64)), initial=0.0)), floor)
            if err > tolerance * scale and not np.array_equal(x, y, equal_nan=True) \
                    and not _within_spread(err, name, spread):
                own = (f" and beyond {SPREAD_FACTOR:g}x the step as built's own spread "
                       f"{spread[name]:.3g}" if spread and name in spread else "")
                problems[name] = (f"output '{name}' differs by {err:.3g} (relative "
                                  f"{err / scale if scale else float('inf'):.3g}), beyond "
                                  f"the plan's stated tolerance {tolerance:g}{own}")
        elif exact and not np.array_equal(x, y, equal_nan=True):
            problems[name] = (f"output '{name}' differs (max abs diff "
                              f"{_max_abs_diff(x, y):.3g})")
        elif not exact and not np.allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True):
            err = _max_abs_diff(x, y)
            if not _within_spread(err, name, spread):
                own = (f" (the original's own runs differ by {spread[name]:.3g})"
                       if spread and name in spread else "")
                problems[name] = (f"output '{name}' differs beyond rtol 1e-5 (by {err:.3g})"
                                  f"{own}")
    return problems


def _within_spread(err: float, name: str, spread: Mapping[str, float] | None) -> bool:
    return bool(spread) and spread.get(name, 0.0) > 0.0 and err <= SPREAD_FACTOR * spread[name]


@dataclass(frozen=True)
class VerifyRun:
    """How ``verify_rewrite`` runs the two steps and compares them.

    ``provider``, ``seed`` (of the synthetic batch) and ``steps`` (measured runs of the
    rewritten step). ``tolerance``: the plan uses numerically equivalent variants (chunked
    sums, inverted affine), so outputs are compared within that relative error (or within
    ``SPREAD_FACTOR`` times the original's ``input_sensitivity``) instead of bit for bit.
    ``arena`` (CPU): the plan was made for ORT's CPU arena, so the rewritten step is
    measured allocating through it (``RunRequest(arena=True)``)."""

    provider: str = "cpu"
    seed: int = 0
    steps: int = 2
    tolerance: float | None = None
    arena: bool = False
    # Why the provider cannot run here (``--provider cuda`` without CUDA): the two steps are
    # compared on the CPU provider, and the device peak and order are not checked.
    numbers_only: str | None = None


def verify_rewrite(original: Graph, rewritten: Graph, *, budget: int,
                   how: VerifyRun = VerifyRun()) -> dict:
    """Run both steps and check outputs, measured peak and executed order (module doc);
    every check runs even when an earlier one failed, so the report has all three."""
    provider, seed, steps = how.provider, how.seed, how.steps
    tolerance, arena = how.tolerance, how.arena
    refuse_bfloat16_feeds(rewritten, source="the step", doing="verify the plan by running it")
    if how.numbers_only is not None:
        return _numbers_only(original, rewritten, budget, how)
    exact = provider == "cpu" and tolerance is None
    problems, outputs_differing, nonfinite, spread, judged, sensitive = _compared(
        original, rewritten, how, provider)
    with tempfile.TemporaryDirectory(prefix="memcc-verify-") as tmp:
        path = Path(tmp) / "rewritten.onnx"
        save_graph(rewritten, path)
        # On CUDA the arena is capped at the budget: a step that completes fits, whatever
        # the sampled peak says, and one ORT refuses does not fit (nothing is measured).
        run = None
        try:
            run = run_steps(path, RunRequest(steps=steps, provider=provider, seed=seed,
                            separate_timing=False, arena=arena,
                            gpu_mem_limit=budget if provider == "cuda" else None))
        except RuntimeFailure as exc:
            if provider != "cuda":
                raise
            problems.append(f"the step did not run with the CUDA arena capped at the budget "
                            f"(gpu_mem_limit {budget:,} bytes): {exc}")
    measured = run.measured_peak_bytes if run is not None else None
    if run is not None:
        if measured is None:
            problems.append(f"no peak measurement on {provider} ({run.measurement_method})")
        elif measured > budget:
            problems.append(f"measured peak {measured:,} bytes exceeds the budget {budget:,}")
        if not run.order_matches_plan:
            problems.append(f"ORT did not run the planned order: {run.executed_order_mismatch}")
    # The three checks separately as well as in ``problems``: the compile summary prints
    # each, and a failure's next step depends on which one failed.
    return {
        "ok": not problems,
        "problems": problems,
        "outputs_compared": len(rewritten.outputs),
        "comparison": _comparison(exact, tolerance, provider == "cuda",
                                  sensitive is not None),
        # CUDA: outputs on which two runs of the original itself differed.
        "irreproducible_outputs": (sum(v > 0 for v in spread.values())
                                   if provider == "cuda" and spread is not None else None),
        # CPU with a tolerance: outputs beyond it that passed only within SPREAD_FACTOR x
        # what one ulp of the batch moves the step as built by.
        "input_sensitive_outputs": sensitive,
        "outputs_match": outputs_differing == 0,
        "outputs_differing": outputs_differing,
        "outputs_judged_by_gradient": judged,
        "outputs_not_finite": nonfinite,
        "racing_nodes": [node_label(n) for n in racing_nodes(original)],
        "budget_bytes": int(budget),
        "peak_within_budget": (False if run is None else
                               None if measured is None else measured <= budget),
        "measured_peak_bytes": measured,
        "predicted_peak_bytes": run.predicted_peak_bytes if run is not None else None,
        "order_matches_plan": run.order_matches_plan if run is not None else None,
        "measurement_method": (run.measurement_method if run is not None
                               else "none: the run failed"),
        "step_time_s": run.step_time_s if run is not None else None,
        "gpu_mem_limit_bytes": int(budget) if provider == "cuda" else None,
        "numbers_only": None,
    }


def _numbers_only(original: Graph, rewritten: Graph, budget: int, how: VerifyRun) -> dict:
    """A plan for a provider that cannot run here (CUDA): both steps run on the CPU
    provider, whose kernels repeat the same arithmetic for a recompute, so the outputs are
    compared bit for bit (within the variants' tolerance or the original's
    ``input_sensitivity`` where the plan has some); the device peak and the executed order
    are not checked, and the report says why."""
    problems, differing, nonfinite, _, judged, sensitive = _compared(original, rewritten,
                                                                     how, "cpu")
    return {
        "ok": not problems, "problems": problems, "outputs_compared": len(rewritten.outputs),
        "comparison": _comparison(how.tolerance is None, how.tolerance,
                                  sensitivity=sensitive is not None) + " on the CPU provider",
        "numbers_only": how.numbers_only, "irreproducible_outputs": None,
        "input_sensitive_outputs": sensitive,
        "outputs_match": differing == 0, "outputs_differing": differing,
        "outputs_judged_by_gradient": judged,
        "outputs_not_finite": nonfinite, "racing_nodes": [], "budget_bytes": int(budget),
        "peak_within_budget": None, "measured_peak_bytes": None,
        "predicted_peak_bytes": None, "order_matches_plan": None,
        "measurement_method": f"{how.provider} is not available here "
                              f"({how.numbers_only})",
        "step_time_s": None, "gpu_mem_limit_bytes": None,
    }


def _compared(original: Graph, rewritten: Graph, how: VerifyRun, provider: str
              ) -> tuple[list[str], int, int, dict[str, float] | None, list[str], int | None]:
    """Both steps on ``provider`` from the same synthetic batch: the problems found, how
    many outputs differ, how many of the original's are not finite (a problem too), the
    spread each output may also differ by (``compare_outputs``: on CUDA the original's own
    run-to-run spread; on the CPU with a tolerance its ``input_sensitivity``; else None),
    the updated parameters that passed by their gradients
    (``_updates_of_matching_gradients``), and on the CPU with a tolerance how many outputs
    passed only by their sensitivity (else None)."""
    feeds = synthetic_feeds(original, how.seed)
    ref = step_outputs(original, feeds, provider)
    spread = None
    if provider == "cuda":
        spread = run_to_run_spread(ref, step_outputs(original, feeds, provider))
    elif how.tolerance is not None:
        spread = input_sensitivity(original, feeds, ref, provider)
    kinds = categorize(original)
    written: list[str] = []
    new = step_outputs(rewritten, feeds, provider, written)
    compare = {"exact": provider == "cpu" and how.tolerance is None,
               "tolerance": how.tolerance, "kinds": {name: kinds.get(name, "") for name in ref}}
    found = differing_outputs(ref, new, spread=spread, **compare)
    sensitive = None
    if provider != "cuda" and how.tolerance is not None:
        # Those that pass only by it: they fail the same comparison without it.
        sensitive = sum(name not in found for name in differing_outputs(ref, new, **compare))
    judged: list[str] = []
    if found and how.tolerance is not None:
        judged = _updates_of_matching_gradients(original, rewritten, feeds, provider,
                                                how.tolerance, found)
        for name in judged:
            del found[name]
    problems = list(found.values())
    differing = len(problems)
    if written:
        problems.append(
            f"the rewritten step wrote into {len(written)} of its fed values (e.g. "
            f"'{written[0]}'): ORT reused a fed buffer for a node's output, so the next "
            "step would start from other values; please report it with the model")
    return (problems, differing, _not_finite(ref, how.seed, problems), spread, judged,
            sensitive)


def _updates_of_matching_gradients(original: Graph, rewritten: Graph,
                                   feeds: dict[str, np.ndarray], provider: str,
                                   tolerance: float, found: Mapping[str, str]) -> list[str]:
    """The updated parameters among ``found`` whose difference the optimizer made from
    gradients that agree within ``tolerance``: judged by their gradients, they pass.

    A gradient that is zero in exact arithmetic (a key projection's bias: softmax ignores
    it) is rounding noise, and AdamW divides it by its own size (plus epsilon): the
    transformers ViT's plan with ``LayerNormalization:inverted`` moved such biases by 1.2e-5
    of their size where their gradients agreed within the plan's 1e-5. A parameter passes
    this way only where every gradient agrees, each of its optimizer state outputs agrees on
    its own, and the two steps' values of it differ by at most twice the largest update the
    step as built made to any parameter (two updates of the optimizer's own size, in
    opposite directions): an update made ten times too far still fails.
    """
    step, other = TrainingStep.of(original), TrainingStep.of(rewritten)
    params, grads, grads_new = step.trainable(), step.gradients(), other.gradients()
    fed_param = {out: src for out, src in step.state.items() if src in params}
    candidates = {o: p for o, p in fed_param.items()
                  if o in found and p in grads and p in grads_new}
    if not candidates:
        return []
    states_of = {p: [o for o, src in step.state.items() if src.startswith(p + ".")]
                 for p in candidates.values()}
    candidates = {o: p for o, p in candidates.items()
                  if not any(s in found for s in states_of[p])}
    # Every gradient, found in both steps (a step whose gradients cannot all be compared is
    # judged by its outputs alone).
    if not candidates or set(grads) != set(grads_new) \
            or not set(grads.values()) <= original.def_use().producer.keys() \
            or not set(grads_new.values()) <= rewritten.def_use().producer.keys():
        return []
    a = step_outputs(original, feeds, provider, also=list(grads.values()))
    b = step_outputs(rewritten, feeds, provider, also=[grads_new[p] for p in grads])
    grad_a = {p: a[g] for p, g in grads.items()}
    grad_b = {p: b[grads_new[p]] for p in grads}
    disagree = differing_outputs(grad_a, grad_b, exact=False, tolerance=tolerance)
    if disagree:
        return []
    fed = {out: original.initializers.get(p, feeds.get(p)) for out, p in fed_param.items()}
    largest_update = max((_max_abs_diff(a[out], v) for out, v in fed.items()
                          if v is not None and np.shape(v) == np.shape(a[out])), default=0.0)
    return [out for out in candidates
            if out in b and np.shape(b[out]) == np.shape(a[out])
            and _max_abs_diff(a[out], b[out]) <= 2.0 * largest_update]


def _not_finite(ref: Mapping[str, np.ndarray], seed: int, problems: list[str]) -> int:
    """How many outputs of the step as built are NaN or infinite; a problem where any is
    (NaN equals NaN in the comparison: those outputs went unchecked)."""
    bad = [n for n, v in ref.items()
           if np.asarray(v).dtype.kind == "f" and not np.isfinite(v).all()]
    if bad:
        problems.append(
            f"the step as built gives NaN or infinite values in {len(bad)} of "
            f"{len(ref)} outputs (e.g. '{bad[0]}') on memcc's synthetic data (seed "
            f"{seed}), so those outputs were not checked; run the step as built with "
            "`memcc run --data` on real data to see whether it trains")
    return len(bad)


# How the comparison names the CPU's allowance (``input_sensitivity``); the compile summary
# counts the outputs that needed it after this.
SENSITIVITY = f"within {SPREAD_FACTOR:g}x what 1 ulp of the input moves the step as built"


def _comparison(exact: bool, tolerance: float | None, spread: bool = False,
                sensitivity: bool = False) -> str:
    own = (f", or within {SPREAD_FACTOR:g}x the original's own run-to-run difference (CUDA)"
           if spread else f", or {SENSITIVITY}" if sensitivity else "")
    if exact:
        return "bit-identical"
    if tolerance is not None:
        return f"within relative {tolerance:g} (the plan's inexact variants){own}"
    return f"rtol 1e-5{own}"
