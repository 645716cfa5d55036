"""Keep what solver libraries write to file descriptor 1 off memcc's stdout.

memcc's stdout carries its own output only (``--json`` commands print one JSON object
there), but a solver's C library can write to the process's fd 1 whatever its options say:
HiGHS 1.16 prints its "Running HiGHS ..." banner when the first ``Highs`` object is made,
before any option can be set. Options stay the first line of defence (``output_flag``
off, pulp's ``msg=False``); this guard is the second, at the file-descriptor level, where
a Python-level ``sys.stdout`` swap cannot reach.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Iterator

# Lines a solver prints about itself, not about the problem: dropped, not forwarded.
_BANNER_PREFIXES = (b"Running HiGHS ", b"Includes third-party software",
                    b"Copyright (c) ")

_state = threading.Lock()
_depth = 0


def _flush_c_stdio() -> None:
    """Flush the C library's stdio buffers, so that what a library printed before (or
    inside) the guard reaches the descriptor it was meant for (a fully buffered pipe would
    otherwise deliver it after fd 1 was put back)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):
        pass  # no C runtime reachable this way (Windows): nothing buffered to lose


@contextlib.contextmanager
def stdout_kept_clean() -> Iterator[None]:
    """Point fd 1 at a temporary file while the block runs, then put it back and copy what
    was written there to stderr, less solver banners. Nothing is lost (another thread's
    output that reached fd 1 meanwhile moves to stderr), and stdout gets none of it.

    Nested and concurrent uses share the outermost redirection: fd 1 is one per process.
    Where fd 1 cannot be duplicated (closed), the block runs unguarded."""
    global _depth
    with _state:
        _depth += 1
        outer = _depth == 1
    try:
        if not outer:
            yield
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        _flush_c_stdio()
        try:
            saved = os.dup(1)
        except OSError:
            yield
            return
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 1)
            try:
                yield
            finally:
                _flush_c_stdio()
                os.dup2(saved, 1)
                os.close(saved)
                sink.seek(0)
                _forward(sink.read())
    finally:
        with _state:
            _depth -= 1


def _forward(written: bytes) -> None:
    """Write ``written`` to stderr without the solver banner's lines."""
    kept = b"".join(line for line in written.splitlines(keepends=True)
                    if not line.lstrip().startswith(_BANNER_PREFIXES))
    if kept.strip():
        with contextlib.suppress(OSError):
            os.write(2, kept)
