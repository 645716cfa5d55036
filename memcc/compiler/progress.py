"""What a compile says as it goes: one ``PassReport`` per stage, progress lines, warnings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PassReport:
    name: str
    time_s: float
    summary: dict

    def to_json(self) -> dict:
        return {"name": self.name, "time_s": round(self.time_s, 4), "summary": self.summary}


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
