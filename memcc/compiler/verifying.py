"""``memcc compile --verify``: the rewritten step run against the step it was planned from,
and the error a failed verification raises (with the report, which compile writes anyway,
so that a user can read why).

Kept apart from the pipeline, which runs it as its ``verify`` stage: what to compare by (bit
for bit, or the plan's stated tolerance) is read from the plan pass's report, and the run
itself is ``backend.verify``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcc.errors import MemccError

if TYPE_CHECKING:
    from memcc.compiler.options import CompileOptions
    from memcc.graph import Graph
    from memcc.pass_contract import PassReport


class VerificationError(MemccError):
    """A plan whose rewritten step failed ``--verify``; ``report``: the compile report."""

    def __init__(self, message: str, *, report: dict) -> None:
        super().__init__(message)
        self.report = report


def plan_tolerance(passes: list[PassReport]) -> float | None:
    """None when every rewrite repeats the same arithmetic (compare bit for bit), else the
    largest relative error the chosen variants state (``equivalent`` tier)."""
    plan = next((p.summary for p in passes if p.name == "plan"), {})
    v = plan.get("variants") or {}
    return None if v.get("exactness", "exact") == "exact" else float(v["tolerance"])


def verify_plan(original: Graph, rewritten: Graph, budget: int, options: CompileOptions,
                how: tuple[float | None, str | None] = (None, None)) -> tuple[dict, dict]:
    """The verification, as the ``verify`` stage's result and its summary. ``how``: the
    plan's tolerance (None: bit for bit) and why CUDA is missing (None: it is not, or the
    provider is the CPU): then the numbers are checked on the CPU only."""
    from memcc.backend.verify import VerifyRun, verify_rewrite

    tolerance, cuda_missing = how
    result = verify_rewrite(original, rewritten, budget=budget, how=VerifyRun(
        provider=options.provider, tolerance=tolerance, arena=options.arena,
        numbers_only=cuda_missing))
    return result, result
