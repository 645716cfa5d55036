"""Weight tying in a TorchScript export, read from its node names (``read_scope_ties``).

In: a raw TorchScript ONNX file (no graph signature), whose node names give the module each
node ran in (``/model/lm_head/Transpose``). Out: initializer -> every PyTorch name its value
is, its own first, where some node shows a tie; None where none does, so that the names alone
decide. ``export_map`` wraps the result in an ``ExportMap``.
"""

from __future__ import annotations

import re

import onnx

from memcc.frontend.export_signature import is_made_up_name
from memcc.graph import FLOAT_TYPES


def read_scope_ties(model: onnx.ModelProto) -> dict[str, tuple[str, ...]] | None:
    """Weight tying in a TorchScript export, from its node names (``/model/lm_head/
    Transpose``: the module a node ran in). TorchScript stores a tied weight once, under one
    of its names, and the other module reads it: a node in module ``M`` that has no
    initializer of its own reads ``X.weight``, so ``M.weight`` is ``X.weight``. Only named
    float initializers are mapped; None when the file has no such node (no scope names, or
    no tying), so that the names alone decide, as before."""
    floats = {t.name for t in model.graph.initializer
              if t.data_type in FLOAT_TYPES and not is_made_up_name(t.name)}
    owners = {f.rsplit(".", k)[0] for f in floats for k in range(1, f.count(".") + 1)}
    tied: dict[str, set[str]] = {}
    for node in model.graph.node:
        if not node.name.startswith("/") or node.name.count("/") < 2:
            continue
        module = _scope_module(node.name)
        if module in owners:
            continue  # the module has parameters of its own: not a tied reader
        for i in node.input:
            if i in floats and "." in i and not i.startswith(module + ".") \
                    and not _own_read(module, i):
                tied.setdefault(i, set()).add(f"{module}.{i.rsplit('.', 1)[-1]}")
    if not tied:
        return None
    return {f: (f, *sorted(tied.get(f, ()))) for f in sorted(floats)}


_PARAMETRIZED = re.compile(r"^(.+)\.parametrizations\.([^.]+)\.original\d*$")


def _own_read(module: str, param: str) -> bool:
    """Whether a node in scope ``module`` reading ``param`` is the parameter's own module at
    work, under a scope name TorchScript made up, rather than another module tied to it: a
    module called again gets its scope suffixed (ALBERT's one shared layer, run per layer:
    ``attention/query_1`` reads ``attention.query.weight``; ``albert_layers.0_1``), and a
    parametrization runs in a scope named after the attribute it computes (weight norm:
    ``conv/weight/weight.0`` reads ``conv.parametrizations.weight.original0``), and a module
    reached past a level of its path runs under its path with that level left out."""
    m = _PARAMETRIZED.match(param)
    if m and (module == f"{m[1]}.{m[2]}" or module.startswith(f"{m[1]}.{m[2]}.")):
        return True
    mine, theirs = module.split("."), param.rsplit(".", 1)[0].split(".")
    if not mine or not theirs or not _same_part(mine[-1], theirs[-1]):
        return False
    # A module called by a path that skips a level of its own (OPT's causal-LM head calls
    # ``self.model.decoder`` itself: the scope is ``model/decoder`` for the module
    # ``model.model.decoder``) runs under a scope that is its path with levels left out.
    k = 0
    for part in theirs:
        if k < len(mine) and _same_part(mine[k], part):
            k += 1
    return k == len(mine)


def _same_part(scope: str, name: str) -> bool:
    """A scope segment of the module ``name`` (``query`` or, called again, ``query_1``)."""
    return scope == name or re.fullmatch(re.escape(name) + r"_\d+", scope) is not None


def _scope_module(node_name: str) -> str:
    """``/model/lm_head/Transpose`` -> ``model.lm_head``; TorchScript spells a Sequential's
    child with its parent's name as it spelt it (``/stem/stem.0/Conv`` -> ``stem.0``;
    ``/features/features.0/features.0.0/Conv`` -> ``features.0.0``, not
    ``features.0.features.0.0``)."""
    parts: list[str] = []
    previous = ""
    for seg in node_name[1:].split("/")[:-1]:
        spelt = seg
        if previous and seg.startswith(previous + "."):
            seg = seg[len(previous) + 1:]
        parts.append(seg)
        previous = spelt
    return ".".join(parts)
