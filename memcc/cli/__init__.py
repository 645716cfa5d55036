"""``memcc`` command line: parses flags, fills option objects and calls ``memcc.api``
(nothing else of memcc), then prints what came back.

- ``app``: the typer application, the consoles, how errors and warnings are shown;
- ``options``: every option more than one command takes, declared once;
- ``building`` (build), ``compiling`` (compile, analyze, report), ``tuning`` (tune),
  ``training`` (run, train, export): the commands, one module per family.

The commands are added here, in the order ``memcc --help`` lists them. The console entry
``memcc = "memcc.cli:app"`` (pyproject.toml) and ``python -m memcc.cli`` both run ``app``.
"""

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


def main() -> None:  # pragma: no cover - console entry
    app()


__all__ = ["app", "main"]
