"""The training step as one model: the only reader of the ``memcc.*`` metadata contract.

``memcc build`` writes a training step as an ONNX file plus ``memcc.*`` metadata (which
output is the loss, which inputs are data, parameters and carried state) and, on the nodes
it emits, where each node came from (``memcc.role``, ``memcc.grad_of``, ``memcc.rule``).
Before this module the runner, the planner's ``StepStructure`` and liveness each parsed that
contract their own way; now they ask a ``TrainingStep``, so a change to the contract is a
change here only.

``TrainingStep.of`` is lenient (a plain graph without metadata is a step whose loss is its
first output and whose other inputs are data): the planner and liveness analyse anything.
``validate`` is strict and is what the runner calls before it trusts a file.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from functools import cached_property

import onnx

from memcc.errors import InputError
from memcc.graph import Graph, TensorInfo, ancestors

# The contract's keys (``frontend/build.py`` writes them, re-exporting these names).
KIND_KEY = "memcc.kind"
LOSS_KEY = "memcc.loss"
DATA_KEY = "memcc.data_inputs"
STATE_KEY = "memcc.state"
INT_RANGES_KEY = "memcc.int_ranges"
# --ignore-index: integer input -> the one value it may hold outside its ``int_ranges``
# range, which the loss ignores ({"labels": -100}); absent when nothing is ignored.
IGNORED_KEY = "memcc.ignored_values"
# The labels input the cross-entropy loss adds to a step (``frontend/loss.py``).
LABELS = "labels"
PARAMS_KEY = "memcc.parameters"
OPTIMIZER_KEY = "memcc.optimizer"
# parameter -> {"exported_name": initializer name in the exported file, "named": it is the
# PyTorch state_dict name, "pytorch_names": [every state_dict name its value is], "merged":
# [those the exporter's optimizer merged into it], "tied_with": [parameters holding the same
# values], "copy_of": [initializers a made-up copy was folded from], "copy_op": the op
# that made that copy from its one parameter (export writes it back through the inverse),
# "folded_copies": {made-up copy the exporter folded from it: the op the step now computes
# it with}}
PARAM_SOURCES_KEY = "memcc.parameter_sources"
# The other half of the same record: PyTorch parameters no step parameter holds, -> "folded"
# (the exporter's optimizer made them constants) or "unused" (the model never reads them).
FOLDED_PARAMS_KEY = "memcc.folded_parameters"
# Made-up initializers the step does not train (off the loss path) that the exporter folded
# from one PyTorch parameter by a known op -> {"copy_of": the parameter, "copy_op": the op}
# (``ExportMap.copy_ops``): ``memcc export`` writes them back under the parameter's name
# unchanged, as the trained copies of ``memcc.parameter_sources``.
UNTRAINED_COPIES_KEY = "memcc.untrained_copies"
# The forward model's own outputs (logits, ...): ``memcc export`` writes them back out.
FORWARD_OUTPUTS_KEY = "memcc.forward_outputs"
# With --loss-chunks the step never forms the logits: the projection that computed them
# ({"inputs": [h, W], "output": logits}), for exporting the forward model.
PROJECTION_KEY = "memcc.loss_projection"
# Set by --attention-chunks / --mlp-chunks: {"attention": {"chunks": K, "regions": how many
# were split}, "mlp": {...}}.
ROW_CHUNKS_KEY = "memcc.row_chunks"
# Set by ``memcc compile``: the plan the step was rewritten by (``Plan.to_json``).
PLAN_KEY = "memcc.plan"
# Set by ``memcc compile --arena``: the plan was judged by ORT's CPU arena, so it holds when
# the CPU provider allocates through that arena (``memcc train`` and ``run`` then do).
ALLOCATOR_KEY = "memcc.allocator"
# Set by ``memcc compile`` and ``memcc tune``: the provider the plan was made for ("cpu" or
# "cuda"); ``memcc run`` and ``train`` run there unless told otherwise.
PROVIDER_KEY = "memcc.provider"
# parameter -> the value holding its whole gradient (what the update reads).
GRADIENTS_KEY = "memcc.gradients"
# What memcc's fusions did to the step as built (passes/fuse.py, FusionReport.to_json()).
FUSIONS_KEY = "memcc.fusions"
# output -> a graph input whose buffer the runtime binds it to, held for the whole step:
# not carried state, but memory planned as a data-parallel rank holds it
# (``passes.analysis.rank_step``: gradients written into the all-reduce bucket). Only in the
# graphs the planner judges for a rank, never in a file memcc writes.
BOUND_KEY = "memcc.bound"
# "1" on a graph whose updates stand where they run, between the segments of a rank that
# reduces its gradients by buckets (``dist.bucket_memory``): the simulator keeps that order
# (no early updates). Only in the graphs the planner judges for a rank, never in a file.
PLACED_KEY = "memcc.updates_placed"
# Set by ``memcc compile --nproc N``: {"world_size", "zero", "peak_bytes_per_rank",
# "budget_bytes"}: the ranks the plan was made for (``memcc train --nproc`` checks them).
RANKS_KEY = "memcc.ranks"
# --precision bf16 / fp16: what autocast did (frontend/autocast.py); absent for fp32 steps.
PRECISION_KEY = "memcc.precision"
TRAINING_STEP = "training_step"

# Node-level provenance (``NodeProto.metadata_props``, IR version 10).
ROLE_PROP = "memcc.role"        # "update" on optimizer / carried-state nodes, "forward" on
                                # nodes a variant adds to the forward pass
GRAD_OF_PROP = "memcc.grad_of"  # backward node -> the forward node it differentiates
RULE_PROP = "memcc.rule"        # ... and the gradient rule (variant) that emitted it
DEFAULT_RULE = "default"
# On a differentiated forward node: the gradients its rule read (one per output) and the
# gradients it returned (one per input), as JSON lists ("" for none). A variant replaces
# the rule's nodes by its own that read and return the same values
# (``passes/lowering/variant_substitution.py``).
GRAD_IN_PROP = "memcc.grad_in"
GRAD_OUT_PROP = "memcc.grad_out"


class Role(enum.Enum):
    """What a node does in the step. Forward is structural: the ancestors of the loss."""

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclass(frozen=True)
class Provenance:
    """Where a backward node came from: the forward node and the gradient rule."""

    forward_node: str
    rule: str = DEFAULT_RULE


def node_props(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def node_prop(node: onnx.NodeProto, key: str) -> str | None:
    """One property of ``node`` as ``node_props`` reads it (the last one set wins), without
    building the dict: the simulator asks this of every node of every plan it judges."""
    value = None
    for p in node.metadata_props:
        if p.key == key:
            value = p.value
    return value


def is_forward_tagged(node: onnx.NodeProto) -> bool:
    """A node a variant added to the forward pass (``memcc.role=forward``)."""
    return bool(node.metadata_props) and node_prop(node, ROLE_PROP) == Role.FORWARD.value


def tag_node(node: onnx.NodeProto, **props: str) -> None:
    """Set ``memcc.*`` provenance on a node the frontend emitted (keys without prefix)."""
    have = {p.key: p for p in node.metadata_props}
    for key, value in props.items():
        full = f"memcc.{key}"
        if full in have:
            have[full].value = value
        else:
            node.metadata_props.add(key=full, value=value)


def record_rule_io(node: onnx.NodeProto, gouts: list[str | None],
                   gins: list[str | None]) -> None:
    tag_node(node, grad_in=json.dumps([g or "" for g in gouts]),
             grad_out=json.dumps([g or "" for g in gins]))


def rule_io(node: onnx.NodeProto) -> tuple[list[str], list[str]] | None:
    """(gradients read, gradients returned) of ``node``'s rule, or None when the step was
    built before this was recorded (then no variant can replace its rule)."""
    props = node_props(node)
    if GRAD_IN_PROP not in props or GRAD_OUT_PROP not in props:
        return None
    try:
        return list(json.loads(props[GRAD_IN_PROP])), list(json.loads(props[GRAD_OUT_PROP]))
    except ValueError:
        return None


class TrainingStep:
    """A graph plus what the contract says about it; node roles are derived on first use."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        md = graph.metadata
        self.kind: str = md.get(KIND_KEY, "")
        self.loss: str = md.get(LOSS_KEY) or (graph.outputs[0] if graph.outputs else "")
        self._errors: list[str] = []
        self.data_inputs: tuple[str, ...] = tuple(self._json(DATA_KEY, [], list))
        self.state: dict[str, str] = dict(self._json(STATE_KEY, {}, dict))
        self.bound: dict[str, str] = dict(self._json(BOUND_KEY, {}, dict))
        self.updates_placed: bool = md.get(PLACED_KEY) == "1"
        self.parameters: tuple[str, ...] = tuple(self._json(PARAMS_KEY, [], list))
        self.optimizer: dict = dict(self._json(OPTIMIZER_KEY, {}, dict))
        self.forward_outputs: tuple[str, ...] = tuple(
            self._json(FORWARD_OUTPUTS_KEY, [], list))
        # {"inputs": [h, W], "output": logits} when built with --loss-chunks, else None
        self.loss_projection: dict | None = self._json(PROJECTION_KEY, None, dict)
        # {"attention": {"chunks": K, "regions": n}, "mlp": ...} with row chunks, else {}
        self.row_chunks: dict = dict(self._json(ROW_CHUNKS_KEY, {}, dict))
        # "arena" for a plan compiled with --arena, else None (malloc, or not compiled)
        self.allocator: str | None = self.graph.metadata.get(ALLOCATOR_KEY) or None
        # "cpu" or "cuda" for a compiled plan, else None (a step as built)
        self.planned_provider: str | None = self.graph.metadata.get(PROVIDER_KEY) or None
        ranges: dict[str, tuple[int, int]] = {}
        for k, v in self._json(INT_RANGES_KEY, {}, dict).items():
            try:
                ranges[k] = (int(v[0]), int(v[1]))
            except (ValueError, TypeError, IndexError) as exc:
                self._errors.append(f"{INT_RANGES_KEY}: {exc}")
        self.int_ranges: dict[str, tuple[int, int]] = ranges
        self.ignored_values: dict[str, int] = {}
        for k, v in self._json(IGNORED_KEY, {}, dict).items():
            if isinstance(v, int) and not isinstance(v, bool):
                self.ignored_values[k] = v
            else:
                self._errors.append(f"{IGNORED_KEY}: '{k}': expected a whole number, got "
                                    f"{v!r}")

    @classmethod
    def of(cls, graph: Graph) -> TrainingStep:
        return cls(graph)

    def _json(self, key: str, default, kind: type):
        text = self.graph.metadata.get(key)
        if not text:
            return default
        try:
            value = json.loads(text)
        except ValueError as exc:
            self._errors.append(f"{key}: {exc}")
            return default
        if not isinstance(value, kind):
            self._errors.append(f"{key}: expected a JSON {kind.__name__}")
            return default
        return value

    # ------------------------------------------------------------------ contract
    @property
    def is_training_step(self) -> bool:
        return self.kind == TRAINING_STEP

    def data_or_free_inputs(self) -> list[str]:
        """The inputs a run must feed: the declared data, else every non-stored input."""
        if self.data_inputs:
            return list(self.data_inputs)
        return [i for i in self.graph.inputs if i not in self.graph.initializers]

    def trainable(self) -> set[str]:
        """Trainable parameters; files without the list fall back on ``P.grad`` naming."""
        if self.parameters:
            return set(self.parameters)
        produced = self.graph.def_use().producer
        return {p for p in set(self.state.values()) | set(self.graph.initializers)
                if f"{p}.grad" in produced}

    def gradients(self) -> dict[str, str]:
        """Parameter -> the value holding its gradient. Recorded by ``memcc build``; steps
        built before fall back on ``P.grad`` naming (``--optimizer none``)."""
        recorded = self._json(GRADIENTS_KEY, {}, dict)
        if recorded:
            return {str(p): str(g) for p, g in recorded.items()}
        produced = self.graph.def_use().producer
        return {p: f"{p}.grad" for p in self.trainable() if f"{p}.grad" in produced}

    def parameter_sources(self) -> dict[str, dict]:
        """Trainable parameter -> where it came from in the exported forward model:
        ``exported_name`` (the initializer name there; with dynamo ``optimize=False`` and
        TorchScript training exports, PyTorch's ``state_dict`` name), ``named`` (whether it
        is a PyTorch name rather than one the exporter made up) and ``tied_with`` (other
        parameters holding the same values: one PyTorch parameter exported as copies),
        ``pytorch_names`` (every ``state_dict`` name whose value the parameter is: its own,
        those the dynamo exporter's optimizer merged into it, those torch ties to them;
        empty for a made-up copy), ``merged``, ``copy_of``, ``copy_op`` (the op that made
        such a copy from its parameter, ``Transpose(perm=[1, 0])``) and ``folded_copies`` (copies
        the exporter folded from this parameter that the step computes from it again,
        ``{"val_303": "Transpose(perm=[1, 0])"}``). With ``folded_parameters``
        this is the one record of where the trained values belong. Steps built before this
        was recorded map every parameter to its own name."""
        recorded = self._json(PARAM_SOURCES_KEY, {}, dict)
        out: dict[str, dict] = {}
        for p in self.parameters:
            src = dict(recorded.get(p) or {"exported_name": p, "named": True})
            if "pytorch_names" not in src:  # recorded before the names were
                src["pytorch_names"] = [p] if src.get("named", True) else []
            out[p] = src
        return out

    def folded_parameters(self) -> dict[str, str]:
        """PyTorch parameters that no step parameter holds: ``"folded"`` (the dynamo
        exporter's optimizer turned them into constants: no trained value) or ``"unused"``
        (the exported model never reads them). Empty when the file did not say."""
        return {str(k): str(v) for k, v in self._json(FOLDED_PARAMS_KEY, {}, dict).items()}

    def untrained_copies(self) -> dict[str, dict]:
        """Made-up initializers the step does not train, each a copy the exporter folded
        from one PyTorch parameter by a known op: ``{"copy_of": name, "copy_op": op}``.
        Empty for steps built before this was recorded."""
        return {str(k): dict(v) for k, v in self._json(UNTRAINED_COPIES_KEY, {}, dict).items()
                if isinstance(v, dict)}

    def state_dict_names(self) -> dict[str, str]:
        """PyTorch ``state_dict`` name -> the trained parameter holding its value."""
        out: dict[str, str] = {}
        for p, src in self.parameter_sources().items():
            for name in src.get("pytorch_names", ()):
                out.setdefault(str(name), p)
        return out

    def validate(self, source: str = "<model>", *,
                 then: str = "memcc run step.onnx") -> TrainingStep:
        """Raise ``InputError`` unless the file keeps the contract the runner relies on.
        ``then``: what the caller's user does with the step once built (the message says
        how to build it, then that)."""
        g = self.graph
        if not self.is_training_step:
            raise InputError(
                f"{source}: not a memcc training step (no memcc.kind=training_step metadata). "
                f"Build one first: memcc build {source} -o step.onnx (or memcc compile "
                f"{source} --budget SIZE -o step.onnx, to fit a memory budget), then {then}"
            )
        if self._errors:
            raise InputError(f"{source}: malformed memcc.* metadata: {self._errors[0]}")
        if self.loss not in g.outputs:
            raise InputError(
                f"{source}: memcc.loss names '{self.loss}', which is not a graph output")
        for out, inp in self.state.items():
            if out not in g.outputs:
                raise InputError(
                    f"{source}: memcc.state names output '{out}', which the graph lacks")
            if inp not in g.inputs:
                raise InputError(
                    f"{source}: memcc.state names input '{inp}', which the graph lacks")
            if g.info.get(out) != g.info.get(inp):
                raise InputError(
                    f"{source}: state output '{out}' {describe_type(g.info.get(out))} does not "
                    f"match the input '{inp}' {describe_type(g.info.get(inp))} it replaces"
                )
        for name in self.data_inputs:
            if name not in g.inputs:
                raise InputError(
                    f"{source}: memcc.data_inputs names '{name}', not a graph input")
        missing = [i for i in g.inputs
                   if i not in g.initializers and i not in self.data_inputs]
        if missing:
            raise InputError(
                f"{source}: graph inputs {missing} have neither a stored value nor a place in "
                "memcc.data_inputs; rebuild the step with memcc build"
            )
        return self

    # ------------------------------------------------------------------ structure
    @cached_property
    def forward(self) -> frozenset[str]:
        """Forward node names: the ancestors of the loss (loss computation included), and
        nodes a variant added to the forward pass (tagged ``memcc.role=forward``: a mask
        taken while the activation is live) with their ancestors."""
        extras = [o for n in self.graph.nodes if is_forward_tagged(n) for o in n.output if o]
        nodes, _ = ancestors([self.loss, *extras], self.graph.def_use().producer)
        forward = {n.name for n in nodes}
        return frozenset(forward)

    @cached_property
    def roles(self) -> dict[str, Role]:
        """Role of every node: forward (structural), update (tagged by build), backward."""
        fwd = self.forward
        out: dict[str, Role] = {}
        for n in self.graph.nodes:
            if n.name in fwd:
                out[n.name] = Role.FORWARD
            elif any(p.key == ROLE_PROP and p.value == Role.UPDATE.value
                     for p in n.metadata_props):
                out[n.name] = Role.UPDATE
            else:
                out[n.name] = Role.BACKWARD
        return out

    @cached_property
    def provenance(self) -> dict[str, Provenance]:
        """Backward node -> the forward node and rule it came from (when build recorded it)."""
        out: dict[str, Provenance] = {}
        for n in self.graph.nodes:
            if not n.metadata_props:
                continue
            props = node_props(n)
            src = props.get(GRAD_OF_PROP)
            if src:
                out[n.name] = Provenance(src, props.get(RULE_PROP, DEFAULT_RULE))
        return out

    def nodes_with_role(self, role: Role) -> list[onnx.NodeProto]:
        roles = self.roles
        return [n for n in self.graph.nodes if roles[n.name] is role]

    @cached_property
    def saved(self) -> frozenset[str]:
        """Forward values that a non-forward node reads: what the forward pass hands on."""
        fwd = self.forward
        du = self.graph.def_use()
        return frozenset(
            v for v, node in du.producer.items() if node.name in fwd
            and any(r.name not in fwd for r in du.readers.get(v, ()))
        )


def describe_type(ti: TensorInfo | None) -> str:
    if ti is None:
        return "(unknown type)"
    return f"(shape {list(ti.shape)}, dtype {ti.np_dtype})"
