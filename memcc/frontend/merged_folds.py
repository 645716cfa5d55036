"""Parameters whose folded constant the dynamo exporter's optimizer merged with another's.

In: a dynamo-exported ONNX model as written (before memcc rewrites a node) and its
``ExportMap``. Out: the map with each parameter so merged moved from ``unused`` to
``merged``, keyed by the constant it was merged into (``merged_folds``).

With ``optimize=True`` the optimizer folds what a parameter computes alone into a constant
(DeiT's ``cls_token.expand(B, -1, -1)`` into ``expand``; Mamba's ``-exp(A_log)[..., None]``
into ``unsqueeze_3``), and then stores equal constants once. Where two parameters held equal
values at export (DeiT's ``distillation_token`` and ``cls_token``, both zeros; Mamba's
``A_log`` of layer 1 and layer 0, the same ``log(arange)`` table), the second's constant
goes, and its readers read the first's: the FX node written for ``cat(expand, expand_1,
...)`` becomes ``Concat(expand, expand, ...)``. No node reads the second parameter any more,
so ``read_export_map`` calls it unused ("not read by the exported model"), while the step
trains it as the first: one value where torch trains two.

The records say so: an ONNX node reads a constant folded from one parameter that its FX
node does not name, in place of the one value the FX node names that is no value of the
file (folded away). Which parameter that value came from is not recorded; it is taken to be
the one unused parameter of the module the FX node ran in (of the first parameter's
attribute, where the module has several): a parameter no node reads, beside a node reading
another parameter's fold in place of a folded value of its own module.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import onnx

from memcc.frontend.export_map import (
    FX_NODE_PROP,
    NAME_SCOPES_PROP,
    ExportMap,
    literal_list,
)
from memcc.frontend.folded_copies import folded_from, signature_names

_FX_ARG = re.compile(r"%(\w+)")


def _module(target: str) -> str:
    """``m.layers.1.mixer.A_log`` -> ``m.layers.1.mixer``."""
    return target.rsplit(".", 1)[0] if "." in target else ""


def _attribute(target: str) -> str:
    return target.rsplit(".", 1)[-1]


def _fx_call(node: onnx.NodeProto) -> tuple[list[str], str]:
    """The values the node's FX node names as arguments (each time it names one), and the
    module it ran in."""
    props = {p.key: p.value for p in node.metadata_props}
    fx = props.get(FX_NODE_PROP, "")
    if not fx:
        return [], ""
    first = fx.splitlines()[0]
    call = first.split("=", 1)[1] if "=" in first else first
    scopes = literal_list(props.get(NAME_SCOPES_PROP))
    return _FX_ARG.findall(call), scopes[-2] if len(scopes) >= 2 else ""


def _merged_parameter(module: str, source: str, unused: set[str]) -> str | None:
    """The one unused parameter of ``module`` (of ``source``'s attribute, where there are
    several) that another's fold replaced; None where the records leave it open."""
    found = [q for q in sorted(unused) if _module(q) == module and q != source]
    if len(found) > 1:
        found = [q for q in found if _attribute(q) == _attribute(source)]
    return found[0] if len(found) == 1 else None


def merged_folds(model: onnx.ModelProto, emap: ExportMap) -> ExportMap:
    """``emap`` with the parameters the optimizer merged into another parameter's folded
    constant (module docstring) moved from ``unused`` to ``merged``: folded constant ->
    those parameters. A parameter two nodes claim for different constants stays unused."""
    if not emap.unused:
        return emap
    params, _ = signature_names(model)
    records = folded_from(model)
    values = {i.name for i in model.graph.input} | \
        {t.name for t in model.graph.initializer} | \
        {o for n in model.graph.node for o in n.output}
    unused = set(emap.unused)
    claims: dict[str, set[str]] = {}
    for node in model.graph.node:
        args, module = _fx_call(node)
        gone = {a for a in args if a not in values and a not in params}
        # Read more often than the FX node names it: in place of another value (DeiT's
        # ``cat(expand, expand_1)`` written ``Concat(expand, expand)``).
        extra = Counter(node.input) - Counter(args)
        subs = [i for i in extra if i in records
                and len({params[x] for x in records[i] if x in params}) == 1]
        if len(gone) != 1 or len(subs) != 1:
            continue
        source = next(params[x] for x in records[subs[0]] if x in params)
        q = _merged_parameter(module, source, unused)
        if q is not None:
            claims.setdefault(q, set()).add(subs[0])
    merged = dict(emap.merged)
    for q, into in sorted(claims.items()):
        if len(into) == 1:
            c = into.pop()
            merged[c] = (*merged.get(c, ()), q)
    taken = {q for names in merged.values() for q in names}
    if not taken - {q for names in emap.merged.values() for q in names}:
        return emap
    return replace(emap, merged=merged, unused=tuple(q for q in emap.unused if q not in taken))
