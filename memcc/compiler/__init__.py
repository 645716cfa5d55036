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

import importlib
from typing import Any

# Each name from its module on first use (PEP 562): ``memcc compile --budget 1KB`` refuses
# after loading the step, and importing the planner, the cost model and onnxruntime with
# this package took a third of a second of that refusal.
_OWNERS = {
    "next_steps": "advice", "BASE_SLACK_BYTES": "options", "COST_SOURCES": "options",
    "CompileOptions": "options", "plan_budget_under": "options", "user_budget": "options",
    "CompileResult": "pipeline", "VerificationError": "verifying",
    "compile_model": "pipeline", "as_trained": "planning", "warning_sink": "progress",
    "unverified_path": "writing",
}
_ELSEWHERE = {"PassReport": "memcc.pass_contract", "summary_lines": "memcc.report_text",
              "verify_checks": "memcc.report_text"}


def __getattr__(name: str) -> Any:
    if name in _OWNERS:
        module = f"memcc.compiler.{_OWNERS[name]}"
    elif name in _ELSEWHERE:
        module = _ELSEWHERE[name]
    else:
        raise AttributeError(f"module 'memcc.compiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BASE_SLACK_BYTES", "COST_SOURCES", "CompileOptions", "CompileResult", "PassReport",
    "VerificationError", "as_trained", "compile_model", "next_steps", "plan_budget_under",
    "summary_lines", "unverified_path", "user_budget", "verify_checks", "warning_sink",
]
