"""torch.export's graph signature as the dynamo exporter records it, and names exporters make up.

In: an ONNX file's metadata (``pkg.torch.export.ExportedProgram.graph_signature``), or the
parsed copy ``load_graph`` keeps on the ``Graph`` (``SIGNATURE_KEY``). Out: a ``Signature``
(which initializers are PyTorch parameters, buffers, mutated buffers, by ``state_dict``
name), or None for files without one (TorchScript), where ``is_made_up_name`` judges names
by their spelling. Also the warning classes the export checks raise (``ExportWarning``,
``ExportNote``). The bottom of the export modules: ``export_map``, ``folded_copies`` and
``exported`` build on it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import onnx

from memcc.graph import Graph

SIGNATURE_PROP = "pkg.torch.export.ExportedProgram.graph_signature"
# Graph.metadata key under which load_graph keeps the parsed signature for the builder.
SIGNATURE_KEY = "memcc.export_signature"

# Names exporters make up for values they create (folded copies, constants), for files
# without a graph signature: TorchScript's ``onnx::MatMul_12``, onnxscript's ``val_3`` and
# the bias it adds when it folds BatchNorm into a Conv (``stem.0.weight_bias``). Names such
# as ``embedding_1`` are only judged against a signature: spelled like that, they could be
# a hand-named parameter (``fc_1``).
_MADE_UP = re.compile(r"^(onnx::.*|val_\d+|.*\.weight_bias)$")
SIGNATURE_LINE = re.compile(r"^\s*(\S+): (\w+)(?: target='([^']*)')?")


class ExportWarning(UserWarning):
    """The build goes on, but the step may not train what the user thinks it trains."""


class ExportNote(ExportWarning):
    """What memcc changed in an export so that the step trains what PyTorch trains: shown
    as a note, not a warning (an ``ExportWarning`` so that callers catching those see it)."""


def file_props(model: onnx.ModelProto) -> dict[str, str]:
    """The file's metadata, graph-level entries overridden by model-level ones."""
    props = {p.key: p.value for p in getattr(model.graph, "metadata_props", ())}
    props.update({p.key: p.value for p in model.metadata_props})
    return props


@dataclass(frozen=True)
class Signature:
    """torch.export's view of the model's state, by ``state_dict`` name."""

    parameters: frozenset[str] = frozenset()
    buffers: frozenset[str] = frozenset()
    mutated_buffers: frozenset[str] = frozenset()
    # BUFFER lines marked persistent=True: in the module's state_dict (BART's
    # final_logits_bias), where a non-persistent buffer (position_ids) is not.
    persistent_buffers: frozenset[str] = frozenset()
    # (the program's output value, the buffer it is the new value of), one per
    # BUFFER_MUTATION line: what the forward writes back into each mutated buffer
    mutations: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> str:
        return json.dumps({"parameters": sorted(self.parameters),
                           "buffers": sorted(self.buffers),
                           "mutated_buffers": sorted(self.mutated_buffers),
                           "persistent_buffers": sorted(self.persistent_buffers),
                           "mutations": [list(m) for m in self.mutations]})

    @classmethod
    def from_json(cls, text: str | None) -> Signature | None:
        if not text:
            return None
        d = json.loads(text)
        return cls(frozenset(d.get("parameters", ())), frozenset(d.get("buffers", ())),
                   frozenset(d.get("mutated_buffers", ())),
                   frozenset(d.get("persistent_buffers", ())),
                   tuple((v, b) for v, b in d.get("mutations", ())))


def signature_entries(model: onnx.ModelProto) -> list[tuple[str, str, str | None, str]]:
    """(placeholder, kind, target or None, the whole line) for each entry of the dynamo
    exporter's graph signature; none for a file without one. The one reader of its lines,
    so that every pass that needs a placeholder's parameter or a buffer's persistence
    parses them alike."""
    out = []
    for line in (file_props(model).get(SIGNATURE_PROP) or "").splitlines():
        m = SIGNATURE_LINE.match(line)
        if m:
            out.append((m.group(1), m.group(2), m.group(3), line))
    return out


def parameter_placeholders(model: onnx.ModelProto) -> dict[str, str]:
    """FX placeholder -> PyTorch parameter name, from the signature's PARAMETER lines."""
    return {ph: target for ph, kind, target, _ in signature_entries(model)
            if kind == "PARAMETER" and target}


def read_signature(model: onnx.ModelProto) -> Signature | None:
    """Parse the dynamo exporter's graph signature, if the file has one."""
    if not file_props(model).get(SIGNATURE_PROP):
        return None
    params: set[str] = set()
    buffers: set[str] = set()
    mutated: set[str] = set()
    persistent: set[str] = set()
    mutations: list[tuple[str, str]] = []
    for value, kind, target, line in signature_entries(model):
        if not target:
            continue
        if kind == "PARAMETER":
            params.add(target)
        elif kind in ("BUFFER", "CONSTANT_TENSOR"):
            buffers.add(target)
            if kind == "BUFFER" and "persistent=True" in line:
                persistent.add(target)
        elif kind == "BUFFER_MUTATION":
            mutated.add(target)
            mutations.append((value, target))
    return Signature(frozenset(params), frozenset(buffers), frozenset(mutated),
                     frozenset(persistent), tuple(mutations))


def signature_of(graph: Graph) -> Signature | None:
    return Signature.from_json(graph.metadata.get(SIGNATURE_KEY))


def is_made_up_name(name: str) -> bool:
    """True for names exporters invent for folded copies and constants."""
    return bool(_MADE_UP.match(name))


# FX ops (a made-up name is its last folded FX node's) that compute values rather than look
# rows up: a parameter folded through one of them is no table (Gemma's ``add_4``, 1 + w).
_ARITHMETIC = frozenset({"add", "sub", "rsub", "mul", "div", "neg", "exp", "log", "pow",
                         "sqrt", "rsqrt", "reciprocal", "softplus", "sigmoid", "tanh"})


def folding_arithmetic(name: str) -> str:
    """The arithmetic op a made-up name (``add_4``, ``neg``, ``add_4.rows``) says the
    exporter's optimizer folded it by, or '' (a lookup, a view, or no such name)."""
    op = re.sub(r"_\d+$", "", name.removesuffix(".rows"))
    return op if op in _ARITHMETIC else ""
