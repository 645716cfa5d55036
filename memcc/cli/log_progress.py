"""A command's progress where stderr is not a terminal (a file, a pipe, a CI log).

The status line on stderr (rich's) shows only on a terminal: piped to a file, a
``--budget min`` compile of a transformers model said nothing for minutes. Off a terminal,
``LogProgress`` prints each stage as a plain line with the seconds since the command began
(``compiling: plan ... (at 41.3 s)``), from ``QUIET_S`` seconds on: a command that ends
sooner (a small model, a refused budget, a bad input) prints no progress, so that an error
stays the one thing a failed command prints (``tests/test_bad_inputs.py``), and a long
one prints a line per stage, the one running at ``QUIET_S`` included. ``progress_lines``
is the status line or these lines, whichever stderr takes (``tune``, ``analyze``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape

QUIET_S = 3.0
# A stage running this long is said again ("... still running"): a refused compile's
# smallest-budget search printed one line at 2.4 s, then nothing for 50 s.
HEARTBEAT_S = 30.0


class LogProgress:
    """``say(message)`` for a run of stages; a context manager: lines are printed only
    inside it (a timer prints the stage running at ``quiet_s``, and none after exit)."""

    def __init__(self, what: str, print_line: Callable[[str], None],
                 quiet_s: float | None = None) -> None:
        self._what = what
        self._print = print_line
        self._started = time.perf_counter()
        self._pending: tuple[str, float] | None = None  # said before quiet_s, not printed
        self._current: tuple[str, float] | None = None  # the stage running, and since when
        self._loud = False                              # past quiet_s: print as said
        self._closed = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(QUIET_S if quiet_s is None else quiet_s, self._wake)
        self._timer.daemon = True

    def __enter__(self) -> LogProgress:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        with self._lock:  # a line being printed by the timer is finished before this
            self._closed = True

    def __call__(self, message: str) -> None:
        with self._lock:
            at = time.perf_counter() - self._started
            self._current = (message, at)
            if self._loud and not self._closed:
                self._line(message, at)
            else:
                self._pending = (message, at)

    def _wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._loud = True
            if self._pending is not None:
                self._line(*self._pending)
                self._pending = None
        self._beat_later()

    def _beat_later(self) -> None:
        self._timer = threading.Timer(HEARTBEAT_S, self._beat)
        self._timer.daemon = True
        self._timer.start()

    def _beat(self) -> None:
        """Say the stage running again where it has run ``HEARTBEAT_S`` seconds or more."""
        with self._lock:
            if self._closed:
                return
            now = time.perf_counter() - self._started
            if self._current is not None and now - self._current[1] >= HEARTBEAT_S:
                stage = self._current[0].removesuffix(" ...")
                self._print(f"{self._what}: {stage}, still running (at {now:.1f} s)")
        self._beat_later()

    def _line(self, message: str, at: float) -> None:
        self._print(f"{self._what}: {message} (at {at:.1f} s)")


@contextmanager
def progress_lines(console: Console, what: str) -> Iterator[Callable[[str], None]]:
    """``say(message)`` for a command's stages on ``console`` (stderr): the status line on
    a terminal (``what: message``), plain lines with the time off one (``LogProgress``):
    ``tune`` and ``analyze`` said nothing to a file or a CI log for minutes."""
    if console.is_terminal:
        with console.status(what) as status:
            yield lambda message: status.update(f"{what}: {escape(message)}")
        return
    with LogProgress(what, lambda line: console.print(escape(line), highlight=False,
                                                      soft_wrap=True)) as log:
        yield log
