"""The ``memcc`` typer application and what every command shares: the consoles (results on
stdout, messages on stderr), how an error ends a command (``fail``: the message, exit status
2) and how a warning is shown (``warn``).

Commands are added in ``memcc/cli/__init__.py``, in the order ``memcc --help`` lists them.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from memcc.api import MemccError


class _FlagsWithoutPlaceholder:
    """typer's rich help gives every option a value placeholder, on/off flags too
    (``--verify <bool>``), although a flag takes no value: its row should read ``--verify``
    or ``--arena / --no-arena`` alone. An empty metavar shows nothing there; it changes
    nothing else (a flag's metavar is never used to parse or in messages)."""

    def get_params(self, ctx):  # noqa: ANN001, ANN201 - click's signature
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


class _Command(_FlagsWithoutPlaceholder, typer.core.TyperCommand):
    pass


class _Group(_FlagsWithoutPlaceholder, typer.core.TyperGroup):
    pass


class _App(typer.Typer):
    """Every command gets ``_Command`` (its help without flag placeholders), including
    commands added later with a plain ``@app.command()``."""

    def command(self, *args, cls=None, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    cls=_Group,
    help="memcc: fit neural-network training steps (ONNX) into a memory budget.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console(soft_wrap=True)


def fail(exc: MemccError) -> NoReturn:
    """End the command on a bad input: the message on stderr, exit status 2."""
    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def warn(message: str) -> None:
    """A compile goes on, but the user should know (e.g. costs estimated, not measured)."""
    err.print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def interrupted(paths: list[Path | None], before: list[int | None]) -> NoReturn:
    """After Ctrl-C: say which of ``paths`` were written since their ``stamps`` were
    ``before`` (memcc writes a file whole or not at all), and exit 130."""
    written = [str(p) for p, t in zip(paths, before, strict=True)
               if p is not None and stamps(p)[0] != t]
    err.print("interrupted: " + (f"{' and '.join(written)} had been written"
                                 if written else "nothing was written"), highlight=False)
    raise typer.Exit(code=130)


def stamps(*paths: Path | None) -> list[int | None]:
    """Each file's modification time (None: absent, or no path), to tell what an
    interrupted command wrote."""
    return [p.stat().st_mtime_ns if p is not None and p.exists() else None for p in paths]


def mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:,.1f} MB"


def _print_version(value: bool) -> None:
    """Print the installed package's version (its metadata, so it cannot drift from
    pyproject.toml) and stop before any command runs."""
    if value:
        from importlib.metadata import version

        out.print(f"memcc {version('memcc')}", highlight=False)
        raise typer.Exit()


def _show_warning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202 - warnings.showwarning's signature
    """memcc's own warnings about an input (``ExportWarning``, ``ExportNote``) are messages to
    the user, printed like every other ``warning:``/``note:`` line. Python's default shows
    them as ``memcc/frontend/build.py:111: ExportWarning: ...`` followed by the source line
    that raised them, which names memcc's code instead of the user's file. Every other
    warning keeps Python's format."""
    from memcc.api import ExportNote, ExportWarning

    if issubclass(category, ExportNote):
        err.print(f"note: {escape(str(message))}", highlight=False, soft_wrap=True)
    elif issubclass(category, ExportWarning):
        warn(str(message))
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print memcc's version and exit.")] = False,
) -> None:
    """memcc: fit neural-network training steps (ONNX) into a memory budget."""
    warnings.showwarning = _show_warning
