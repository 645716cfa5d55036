"""``memcc`` command line: parses flags, fills option objects and calls ``memcc.api``
(nothing else of memcc), then prints what came back.

- ``app``: the typer application, the consoles, how errors and warnings are shown;
- ``options``: every option more than one command takes, declared once;
- ``building`` (build), ``compiling`` (compile, analyze, report), ``tuning`` (tune),
  ``training`` (run, train, export): the commands, one module per family.

The commands are added here, in the order ``memcc --help`` lists them. The console entry
``memcc = "memcc.cli:main"`` (pyproject.toml) and ``python -m memcc.cli`` both run ``main``.
"""

import os
import sys

from memcc.cli.app import app
from memcc.cli.building import build
from memcc.cli.compiling import analyze_cmd, compile_cmd, report_cmd
from memcc.cli.training import export_cmd, run, train
from memcc.cli.tuning import tune_cmd

app.command()(build)
app.command()(run)
app.command()(train)
app.command(name="export")(export_cmd)
app.command(name="compile")(compile_cmd)
app.command(name="tune")(tune_cmd)
app.command(name="analyze")(analyze_cmd)
app.command(name="report")(report_cmd)


# Help piped to a file or a pager: rich lays it out at 80 columns, where the option column
# cut flag names (``--attention-chu…``) in 7 entries of compile's help.
PIPED_HELP_WIDTH = 120


def _wide_help_when_piped() -> None:
    import os

    if sys.stdout.isatty() or os.environ.get("TERMINAL_WIDTH") or os.environ.get("COLUMNS"):
        return
    import typer.rich_utils

    typer.rich_utils.MAX_WIDTH = PIPED_HELP_WIDTH


def main() -> None:
    """The ``memcc`` command: ``app``, then an exit that a solve left running past its
    deadline cannot turn into an abort (``solvers.ilp.wait_for_left_behind``): where one
    still runs, the output is flushed and the process ends with the command's status
    without finalizing the interpreter."""
    _wide_help_when_piped()
    try:
        app()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    solvers = sys.modules.get("memcc.passes.planning.solvers.ilp")
    if solvers is not None and not solvers.wait_for_left_behind(solvers.EXIT_WAIT_S):
        status = code if isinstance(code, int) else 0 if code is None else 1
        if not isinstance(code, (int, type(None))):
            print(code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(code)


__all__ = ["app", "main"]
