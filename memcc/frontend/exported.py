"""What the exporter says about the model, and what a user must know before training it.

The dynamo exporter records torch.export's graph signature in the ONNX graph's metadata
(``pkg.torch.export.ExportedProgram.graph_signature``): which initializers are PyTorch
parameters and buffers (by ``state_dict`` name) and which buffers the forward mutates.
TorchScript files carry no such record, so there names are judged by their spelling.
From that this module tells the builder:

- which float initializers are buffers (never trained, whatever their names);
- where each trained parameter came from (its initializer name, whether that is a PyTorch
  name, and which other parameters hold the same values: weight tying that the exporter
  split into copies), for ``memcc build``'s report and for mapping trained weights back;
- BatchNorm written in inference form for a model exported in train mode: dynamo's torch_lib
  drops the training flag, so a step built from it would silently train a different model.
  Where the signature proves the layer was in train mode (its running statistics are mutated
  buffers) and the BatchNormalization node is still there (``optimize=False``), memcc puts
  the layer back in training mode; where the exporter's optimizer folded it into a Conv, the
  batch statistics are gone and memcc can only warn.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.graph import Graph, attr, node_label

SIGNATURE_PROP = "pkg.torch.export.ExportedProgram.graph_signature"
# Graph.metadata key under which load_graph keeps the parsed signature for the builder.
SIGNATURE_KEY = "memcc.export_signature"

# Names exporters make up for values they create (folded copies, constants), for files
# without a graph signature: TorchScript's ``onnx::MatMul_12``, onnxscript's ``val_3`` and
# the bias it adds when it folds BatchNorm into a Conv (``stem.0.weight_bias``). Names such
# as ``embedding_1`` are only judged against a signature: spelled like that, they could be
# a hand-named parameter (``fc_1``).
_MADE_UP = re.compile(r"^(onnx::.*|val_\d+|.*\.weight_bias)$")
_SIGNATURE_LINE = re.compile(r"^\s*(\S+): (\w+)(?: target='([^']*)')?")


class ExportWarning(UserWarning):
    """The build goes on, but the step may not train what the user thinks it trains."""


@dataclass(frozen=True)
class Signature:
    """torch.export's view of the model's state, by ``state_dict`` name."""

    parameters: frozenset[str] = frozenset()
    buffers: frozenset[str] = frozenset()
    mutated_buffers: frozenset[str] = frozenset()

    def to_json(self) -> str:
        return json.dumps({"parameters": sorted(self.parameters),
                           "buffers": sorted(self.buffers),
                           "mutated_buffers": sorted(self.mutated_buffers)})

    @classmethod
    def from_json(cls, text: str | None) -> Signature | None:
        if not text:
            return None
        d = json.loads(text)
        return cls(frozenset(d.get("parameters", ())), frozenset(d.get("buffers", ())),
                   frozenset(d.get("mutated_buffers", ())))


def read_signature(model: onnx.ModelProto) -> Signature | None:
    """Parse the dynamo exporter's graph signature, if the file has one."""
    props = {p.key: p.value for p in getattr(model.graph, "metadata_props", ())}
    props.update({p.key: p.value for p in model.metadata_props})
    text = props.get(SIGNATURE_PROP)
    if not text:
        return None
    params: set[str] = set()
    buffers: set[str] = set()
    mutated: set[str] = set()
    for line in text.splitlines():
        m = _SIGNATURE_LINE.match(line)
        if not m or not m.group(3):
            continue
        kind, target = m.group(2), m.group(3)
        if kind == "PARAMETER":
            params.add(target)
        elif kind in ("BUFFER", "CONSTANT_TENSOR"):
            buffers.add(target)
        elif kind == "BUFFER_MUTATION":
            mutated.add(target)
    return Signature(frozenset(params), frozenset(buffers), frozenset(mutated))


def signature_of(graph: Graph) -> Signature | None:
    return Signature.from_json(graph.metadata.get(SIGNATURE_KEY))


# ---------------------------------------------------------------------------- BatchNorm
def restore_training_batchnorm(graph: Graph, source: str) -> list[str]:
    """Put BatchNorm written in inference form back in training mode where the signature
    proves torch ran it in train mode; warn where it cannot. Returns the restored nodes."""
    sig = signature_of(graph)
    restored: list[str] = []
    kept: list[str] = []
    for node in graph.nodes:
        if node.op_type != "BatchNormalization" or attr(node, "training_mode", 0):
            continue
        if len(node.input) < 5:
            continue
        stats = set(node.input[3:5])
        if sig is not None and stats <= sig.mutated_buffers and \
                stats <= set(graph.initializers):
            for a in list(node.attribute):
                if a.name == "training_mode":
                    node.attribute.remove(a)
            node.attribute.append(onnx.helper.make_attribute("training_mode", 1))
            restored.append(node.name)
        else:
            kept.append(node_label(node))
    if restored:
        warnings.warn(
            f"{source}: {len(restored)} BatchNormalization node(s) were exported in inference "
            "form although torch ran them in train mode (the dynamo exporter drops the "
            "flag); memcc restored batch statistics and carries the running statistics as "
            "state, as torch does.", ExportWarning, stacklevel=2)
    if kept:
        warnings.warn(
            f"{source}: {len(kept)} BatchNormalization node(s) use their running statistics "
            f"(inference form), e.g. {kept[0]}: the step trains with frozen statistics, "
            "unlike torch's train mode. If the model should train its BatchNorm, export "
            "with torch.onnx.export(..., dynamo=False, training=torch.onnx.TrainingMode."
            "TRAINING) or with dynamo=True and optimize=False.", ExportWarning, stacklevel=2)
    folded = sorted(b for b in (sig.mutated_buffers if sig else ())
                    if b.endswith("running_mean") and b not in graph.initializers)
    if folded:
        warnings.warn(
            f"{source}: the model was exported in train mode with BatchNorm "
            f"({len(folded)} layer(s), e.g. '{folded[0][:-len('.running_mean')]}'), but the "
            "exporter's optimizer folded them into the convolutions: batch statistics are "
            "gone and the step trains a different model. Export with torch.onnx.export(..., "
            "dynamo=True, optimize=False) (memcc restores the batch statistics) or with "
            "dynamo=False, training=torch.onnx.TrainingMode.TRAINING.",
            ExportWarning, stacklevel=2)
    return restored


# ---------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParameterSource:
    """Where a trained parameter came from in the exported file."""

    exported_name: str
    named: bool  # the initializer name is the PyTorch state_dict name
    tied_with: tuple[str, ...] = field(default=())  # same values, as is or transposed

    def to_json(self) -> dict:
        d: dict = {"exported_name": self.exported_name, "named": self.named}
        if self.tied_with:
            d["tied_with"] = list(self.tied_with)
        return d


def is_made_up_name(name: str) -> bool:
    """True for names exporters invent for folded copies and constants."""
    return bool(_MADE_UP.match(name))


def parameter_sources(graph: Graph, params: list[str]) -> dict[str, ParameterSource]:
    """Initializer name, PyTorch-name status and weight tying of each parameter.

    Tying is found by value: exporters that split one PyTorch parameter into copies (a tied
    embedding and its pre-transposed output projection) leave equal or transposed-equal
    tensors. Constant-filled tensors (fresh LayerNorm weights) are equal without being tied,
    so they are not compared.
    """
    sig = signature_of(graph)

    def named(p: str) -> bool:
        if sig is not None:
            return p in sig.parameters or p in sig.buffers
        return not is_made_up_name(p)

    def key(a: np.ndarray) -> str:
        return hashlib.sha1(np.ascontiguousarray(a).tobytes() + str(a.shape).encode()
                            + a.dtype.str.encode()).hexdigest()

    arrays = {p: np.asarray(graph.initializers[p]) for p in params}
    comparable = [p for p, a in arrays.items()
                  if a.size > 1 and not np.all(a.reshape(-1) == a.reshape(-1)[0])]
    by_key: dict[str, list[str]] = {}
    for p in comparable:
        by_key.setdefault(key(arrays[p]), []).append(p)
    parent = {p: p for p in comparable}

    def find(p: str) -> str:
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    for p in comparable:
        a = arrays[p]
        keys = [key(a)] + ([key(a.T)] if a.ndim == 2 else [])
        for k in keys:
            for q in by_key.get(k, []):
                parent[find(q)] = find(p)
    groups: dict[str, list[str]] = {}
    for p in comparable:
        groups.setdefault(find(p), []).append(p)
    out: dict[str, ParameterSource] = {}
    for p in params:
        ties = [q for q in groups.get(find(p), [p]) if q != p] if p in parent else []
        out[p] = ParameterSource(p, named(p), tuple(ties))
    return out


def report_parameters(sources: dict[str, ParameterSource], source: str,
                      sig: Signature | None) -> None:
    """Warn about parameters without a PyTorch name and about weight tying."""
    unnamed = [p for p, s in sources.items() if not s.named]
    if unnamed:
        shown = ", ".join(unnamed[:6]) + (f" (+{len(unnamed) - 6} more)" if len(unnamed) > 6
                                          else "")
        warnings.warn(
            f"{source}: {len(unnamed)} trained parameter(s) have names the exporter made up, "
            f"not PyTorch state_dict names: {shown}. They are folded copies (pre-transposed "
            "weights, constant-folded lookups). To map trained weights back by name, export "
            "with torch.onnx.export(..., dynamo=True, optimize=False) or with dynamo=False "
            "and training=torch.onnx.TrainingMode.TRAINING.", ExportWarning, stacklevel=2)
    if sig is not None:
        missing = sorted(sig.parameters - set(sources))
        if missing and unnamed:
            warnings.warn(
                f"{source}: PyTorch parameters not trained under their own name: "
                f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} (folded into "
                "the copies above, or not on a path to the loss).", ExportWarning,
                stacklevel=2)
    tied = sorted({tuple(sorted((p, *s.tied_with))) for p, s in sources.items()
                   if s.tied_with})
    if tied:
        groups = "; ".join(" = ".join(g) for g in tied[:4])
        warnings.warn(
            f"{source}: {len(tied)} group(s) of parameters hold the same values (weight "
            f"tying split into copies by the exporter, possibly transposed): {groups}. "
            "memcc trains each copy separately, so they drift apart; torch would train one "
            "tensor.", ExportWarning, stacklevel=2)
