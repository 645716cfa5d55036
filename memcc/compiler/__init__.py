"""``memcc compile`` as a library: what the CLI and the Python API call.

Rooms, in the order a compile runs them: ``options`` (what is asked, checked once; budget
arithmetic), ``pipeline`` (the stages in order, each a pass of ``memcc.pass_contract``'s
runner), ``loading`` (the ``load`` stage and the provider check), ``costing`` (the
``cost_model`` stage), ``planning`` (the plan stage under a user's budget), ``chunk_choice``
(row chunks chosen by planning several builds), ``writing`` (both files, together or not
at all), ``report`` (the report JSON), ``advice`` (what to try next), ``progress``
(progress lines and warnings). The lines printed from a report are
``memcc.report_text``'s. docs/ARCHITECTURE.md walks one compile.
"""

from memcc.compiler.advice import next_steps
from memcc.compiler.options import (
    BASE_SLACK_BYTES,
    COST_SOURCES,
    CompileOptions,
    plan_budget_under,
    user_budget,
)
from memcc.compiler.pipeline import CompileResult, VerificationError, compile_model
from memcc.compiler.planning import as_trained
from memcc.compiler.progress import warning_sink
from memcc.compiler.writing import unverified_path
from memcc.pass_contract import PassReport
from memcc.report_text import summary_lines, verify_checks

__all__ = [
    "BASE_SLACK_BYTES", "COST_SOURCES", "CompileOptions", "CompileResult", "PassReport",
    "VerificationError", "as_trained", "compile_model", "next_steps", "plan_budget_under",
    "summary_lines", "unverified_path", "user_budget", "verify_checks", "warning_sink",
]
