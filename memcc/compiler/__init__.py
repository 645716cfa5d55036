"""``memcc compile`` as a library: what the CLI and the Python API call.

Rooms: ``options`` (what is asked, checked once; budget arithmetic), ``pipeline`` (load, cost,
plan, rewrite, verify, write: the stages in order), ``planning`` (the plan stage under a
user's budget), ``chunk_choice`` (row chunks chosen by planning several builds), ``report``
(the report JSON and the lines printed from it), ``advice`` (what to try next), ``progress``
(pass reports and warnings as the compile goes). docs/ARCHITECTURE.md walks one compile.
"""

from memcc.compiler.advice import next_steps
from memcc.compiler.options import (
    BASE_SLACK_BYTES,
    COST_SOURCES,
    CompileOptions,
    plan_budget_under,
    user_budget,
)
from memcc.compiler.pipeline import (
    CompileResult,
    VerificationError,
    compile_model,
    unverified_path,
)
from memcc.compiler.planning import as_trained
from memcc.compiler.progress import PassReport, warning_sink
from memcc.compiler.report import summary_lines, verify_checks

__all__ = [
    "BASE_SLACK_BYTES", "COST_SOURCES", "CompileOptions", "CompileResult", "PassReport",
    "VerificationError", "as_trained", "compile_model", "next_steps", "plan_budget_under",
    "summary_lines", "unverified_path", "user_budget", "verify_checks", "warning_sink",
]
