"""Make ``memcc`` (repo root) and the shared ``gradcheck`` helpers importable under plain pytest.

The package is not installed into the venv, and pytest's default import mode only puts the
test file's directory on ``sys.path``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _p in (_TESTS.parent, _TESTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


# The test files that take longest (CI's pass 1 on two cores, 2026-11-27), longest first.
# pytest-xdist's --dist loadfile hands out whole files in collection order; by default it
# reorders them by their number of tests, which sent few-but-long files (the compile tests)
# to the end of the run, where one worker ran them while the other sat idle. Longest first,
# the short files fill in at the end.
_LONGEST_FIRST = (
    "test_passes_planner.py", "test_exports_load.py", "test_exports_compile.py",
    "test_compile_zoo.py", "test_row_chunks.py", "test_cli_compile.py", "test_models_zoo.py",
    "test_dist.py", "test_benchmarks_export_sweep.py", "test_exports_grad.py", "test_tune.py",
    "test_benchmarks_gpu_peers.py", "test_autocast_numerics.py", "test_batchnorm_for_cuda.py",
)


# The torch exports the tests share (tests/exports.py), made once per run: the controller
# makes the directory before pytest-xdist starts its workers, which inherit its name.
_EXPORTS_ENV = "MEMCC_TEST_EXPORTS"


# The CPU roofline every test prices with (``memcc.backend.profiling.calibrate_cpu_rates``):
# a 2-core machine's, calibrated under the tests' own load. Tests that compare plans' estimated
# times across row-chunk settings turned on the machine's speed: a quiet machine's rates (5x
# faster kernels, the same 9.6 us per node) made a split's extra nodes dearer than its
# recompute savings. The cache directory, a temporary one, holds these rates dated now, and
# the node times tests measure (none from a user's cache).
_TEST_RATES = {"flops_per_s": 32_783_478_715.64, "bytes_per_s": 2_399_683_241.62,
               "overhead_s": 9.5695e-06, "source": "calibrated on this CPU",
               "sixteen_bit_flops": 1.0, "load_per_core": 0.0}
_CACHE_ENV = "MEMCC_CACHE"


def _pinned_cache() -> str:
    import json
    import time

    path = tempfile.mkdtemp(prefix="memcc-test-cache-")
    Path(path, "cpu_rates.json").write_text(json.dumps(
        {**_TEST_RATES, "calibrated_at": time.time()}))
    return path


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput") and _EXPORTS_ENV not in os.environ:
        config.memcc_exports = tempfile.mkdtemp(prefix="memcc-exports-")
        os.environ[_EXPORTS_ENV] = config.memcc_exports
    if not hasattr(config, "workerinput") and _CACHE_ENV not in os.environ:
        config.memcc_cache = _pinned_cache()
        os.environ[_CACHE_ENV] = config.memcc_cache


def pytest_unconfigure(config) -> None:  # noqa: ANN001 - pytest's hook
    for attr, env in (("memcc_exports", _EXPORTS_ENV), ("memcc_cache", _CACHE_ENV)):
        made = getattr(config, attr, None)
        if made:
            shutil.rmtree(made, ignore_errors=True)
            os.environ.pop(env, None)


def pytest_collection_modifyitems(session, config, items) -> None:  # noqa: ANN001
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
