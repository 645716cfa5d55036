"""What a compile says as it goes: progress lines, warnings, and one ``PassReport`` per
stage (the pass contract's, ``memcc/pass_contract.py``, which runs the stages).

In: where the caller wants progress lines and warnings (the CLI prints them as they come).
Out: the ``Progress`` callable type, and ``warning_sink``: the report's list of warnings
with the function that adds to it.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]

__all__ = ["Progress", "warning_sink"]


def warning_sink(warn: Callable[[str], None] | None
                 ) -> tuple[list[str], Callable[[str], None]]:
    """A list the report keeps its warnings in, and the function that adds one to it and
    passes it on to ``warn`` (the CLI prints it as it happens)."""
    warnings: list[str] = []

    def warning(msg: str) -> None:
        warnings.append(msg)
        if warn is not None:
            warn(msg)

    return warnings, warning
