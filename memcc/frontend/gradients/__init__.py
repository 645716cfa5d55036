"""Gradient rules, grouped by kind of op; importing the modules fills ``registry.RULES``."""

from __future__ import annotations

import importlib

_MODULES = ("elementwise", "reduction", "shape_ops", "nn", "grid_sample")
_loaded = False


def load_rules() -> None:
    global _loaded
    if not _loaded:
        for mod in _MODULES:
            importlib.import_module(f"{__name__}.{mod}")
        _loaded = True
