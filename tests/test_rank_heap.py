"""A data-parallel CPU rank keeps its freed step buffers in glibc's heap between steps
(``backend.memory.keep_heap_between_steps``), so that the next step does not fault them in
again: what stays resident after a step, in a process of its own (glibc's settings are
per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Three buffers of 20 MB made, written and freed, as a step's activations are: at glibc's
# defaults the 60 MB free at the heap's top exceed its dynamic trim threshold (twice the
# largest freed mmap, 40 MB), so every step gives them back (and the next faults them in
# again); kept, they stay resident between steps, and the peak is the same.
CYCLES = """
import json, sys
import numpy as np
from memcc.backend.memory import keep_heap_between_steps, peak_rss_bytes, rss_bytes
made = keep_heap_between_steps() if sys.argv[1] == "keep" else None
before = rss_bytes()
for _ in range(5):
    bufs = [np.ones(5_000_000, np.float32) for _ in range(3)]
    del bufs
print(json.dumps({"made": made, "kept": rss_bytes() - before,
                  "peak": peak_rss_bytes() - before}))
"""


def _cycles(mode: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CYCLES, mode], env={**base, **env},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_freed_step_buffers_stay_in_the_heap_between_steps() -> None:
    kept, default = _cycles("keep"), _cycles("default")
    assert kept["made"] is True
    assert default["kept"] < 30e6, default      # at glibc's defaults: most given back
    assert kept["kept"] > 55e6, kept            # kept: a step's 60 MB stay
    assert kept["peak"] < default["peak"] + 5e6, (kept, default)


def test_the_exact_measurement_keeps_its_own_settings() -> None:
    """``--measure-memory``'s ranks start with ``MALLOC_MMAP_THRESHOLD_``: each buffer its own
    mmap, as the prediction models it; the rank leaves that alone."""
    got = _cycles("keep", MALLOC_MMAP_THRESHOLD_="4096", MALLOC_ARENA_MAX="1")
    assert got["made"] is False and got["kept"] < 10e6, got
