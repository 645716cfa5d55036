"""Make ``memcc`` (repo root) and the shared ``gradcheck`` helpers importable under plain pytest.

The package is not installed into the venv, and pytest's default import mode only puts the
test file's directory on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for _p in (_TESTS.parent, _TESTS):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
