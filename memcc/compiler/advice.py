"""What to try next, in words: after a failed ``--verify``, and where row chunks could lower
the smallest budget.

In: the verification result (``backend/verify.py``'s dict) with the options and the plan's
peak, or the ``load`` pass's summary. Out: sentences, which the report keeps
(``verification.next_steps``) and the refusals append; nothing here decides or plans.
"""

from __future__ import annotations

import math

from memcc.compiler.options import CompileOptions
from memcc.frontend.row_chunks import ATTENTION, FLAGS, MLP
from memcc.sizes import format_size


def next_steps(v: dict, options: CompileOptions, planned_peak: int, label: str,
               slack: int) -> list[str]:
    """What to try after a failed ``--verify``, one sentence per failed check (the report
    keeps them as ``verification.next_steps``)."""
    steps: list[str] = []
    if v.get("outputs_match") is False:
        if v.get("racing_nodes"):
            steps.append(
                "Outputs differ, and the model has nodes whose ONNX Runtime CPU kernel races "
                f"across intra-op threads ({', '.join(v['racing_nodes'][:3])}): their results "
                "change from run to run whatever the plan. Export ScatterND with a reduction "
                "as ScatterElements (docs/DETERMINISM.md).")
        elif v.get("comparison") == "bit-identical":
            steps.append(
                "Outputs differ: recomputation repeats the same kernels on the same inputs, "
                "so on CPU they should be bit-identical. Run the same command again: if the "
                "difference comes and goes, it is nondeterminism in ONNX Runtime's "
                "multi-threaded kernels, not the plan; if it stays, it is a memcc bug: "
                f"please report it with {label}, the command and the report.")
        elif options.provider == "cpu":
            steps.append(
                f"Outputs differ beyond the tolerance the plan's inexact variants state "
                f"({v.get('comparison')}). Updated parameters whose gradients agree were "
                "already judged by them (AdamW turns a gradient that is zero up to rounding "
                "into an update of up to the learning rate's size), so these differ by more. "
                "Compile with --no-variants for a plan that gives the step as built's bits, "
                f"and please report it with {label}, the command and the report.")
        else:
            steps.append(
                "Outputs differ beyond the CUDA tolerance: rtol 1e-5, or 4x what two runs "
                "of the step as built differ by on this GPU. Run the same command again: "
                "if the difference comes and goes, the step's own kernels are not "
                "reproducible (BENCHMARKS.md, 'CUDA on an H100'); if it stays, please "
                f"report it with {label}, the command and the report.")
    measured = v.get("measured_peak_bytes")
    budget = int(v.get("budget_bytes") or 0)
    if measured is None:
        steps.append(
            f"The peak could not be measured on {options.provider} "
            f"({v.get('measurement_method')}); install pynvml for CUDA, or verify with "
            "--provider cpu.")
    elif budget and measured > budget:
        ratio = measured / max(planned_peak, 1)
        # The margin at which this plan's measured/predicted ratio would still fit.
        need = 1.0 - (budget / ratio + slack) / budget
        margin = min(max(math.ceil((need + 0.01) * 100) / 100, options.margin + 0.01), 0.49)
        bigger = int((measured + slack) / (1.0 - options.margin)) + 1
        steps.append(
            f"The measured peak is {format_size(measured)}, {measured / budget - 1:.1%} over "
            f"the budget, and {ratio - 1:+.1%} off the predicted {format_size(planned_peak)}"
            f": compile again with a larger safety margin (--margin {margin:.2f}; now "
            f"{options.margin:.2f}) to keep the budget, or with a larger budget "
            f"(--budget {bigger} or more) if the device has room.")
    if v.get("order_matches_plan") is False:
        steps.append(
            "ONNX Runtime did not run the nodes in the planned order, so the measured peak "
            "does not test the plan. memcc relies on ORT's PRIORITY_BASED execution order "
            "(README, How memory is predicted and measured); this is a memcc bug or an "
            f"onnxruntime version that orders differently: please report it with {label}, "
            "the command and the report.")
    return steps


CHUNKS_HINT_LEAD = " The model also has "


def without_chunks_hint(message: str) -> str:
    """``message`` without ``chunks_hint``'s sentence: where compile built the step with row
    chunks itself and still refused, naming the flags that split them misleads (the
    settings it tried are named instead: ``chunk_choice._refusal``)."""
    head, found, _ = message.partition(CHUNKS_HINT_LEAD)
    return head if found else message


def chunks_hint(load_summary: dict) -> str:
    """Where the model has attentions or MLPs left whole, the flags that split them."""
    found = {k: n for k, n in (load_summary.get("splittable") or {}).items()
             if k in (ATTENTION, MLP)}   # what the flags below split (not the loss)
    if not found:
        return ""
    what = " and ".join(f"{n} {'attention' if kind == ATTENTION else 'MLP'}"
                        f"{'s' if n > 1 else ''} ({FLAGS[kind]} K)"
                        for kind, n in found.items())
    return (f"{CHUNKS_HINT_LEAD}{what} that row chunks can split, which lowers the "
            "smallest budget where their tensors are the largest (docs/VARIANTS.md, "
            "\"Attentions and MLPs over row chunks\").")
