"""Substitute operator variants: replace a forward node's gradient rule by another one.

``memcc build`` records on every differentiated forward node the gradients its rule read
and the gradients it returned (``step.rule_io``), and tags the rule's nodes with
``memcc.grad_of`` / ``memcc.rule``. For each node a plan gives a variant
(``Plan.variants``) this pass:

1. runs the variant's rule (``frontend/gradients/variant_rules.py``) on the same gradients,
   collecting its backward nodes and the nodes it adds to the forward pass (a mask);
2. gives the variant's results the names the default rule's results had, so every reader
   downstream (gradient sums, the optimizer, step outputs) is untouched;
3. removes the default rule's nodes that nothing reads any more (constants another rule
   shares stay), puts the variant's backward nodes where the default rule's began and its
   forward nodes right after the forward node (tagged ``memcc.role=forward``, so the step
   counts them as forward: a recompute clone never reads them late).

The forward pass is unchanged except for the added nodes, so a plan's recompute and offload
decisions (which name forward nodes and values) still apply after this pass.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass

import onnx

from memcc.frontend.emit import Emitter
from memcc.frontend.gradients.variants import (
    LOSSY,
    Variant,
    VariantContext,
    lookup,
    variants_for,
)
from memcc.graph import Graph, node_label
from memcc.passes.lowering.recompute import optional_output
from memcc.passes.plan import DEFAULT_VARIANT, Plan, StepStructure
from memcc.step import DEFAULT_RULE, GRAD_OF_PROP, RULE_PROP, node_props, rule_io, tag_node


@dataclass(frozen=True)
class VariantResult:
    graph: Graph
    substituted: tuple[tuple[str, str], ...]  # (forward node, variant key), in plan order
    forward_added: tuple[str, ...]            # names of nodes added to the forward pass
    backward_added: tuple[str, ...]           # names of the variants' backward nodes
    removed: tuple[str, ...]                  # names of the default rules' nodes removed


def rule_nodes(graph: Graph) -> dict[str, list[onnx.NodeProto]]:
    """forward node name -> the nodes its default rule emitted, in graph order."""
    out: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in graph.nodes:
        if not n.metadata_props:
            continue
        props = node_props(n)
        src = props.get(GRAD_OF_PROP)
        if src and props.get(RULE_PROP, DEFAULT_RULE) == DEFAULT_RULE:
            out[src].append(n)
    return out


def rule_body(old: list[onnx.NodeProto], gouts: list[str]) -> list[onnx.NodeProto]:
    """The rule's nodes that run in the backward pass: from the first that reads an
    incoming gradient on, Constants left out (a rule may also have placed a node in the
    forward pass, like MaxPool's index Cast, and constants run nowhere)."""
    grads = {g for g in gouts if g}
    start = next((k for k, n in enumerate(old) if any(i in grads for i in n.input)), 0)
    return [n for n in old[start:] if n.op_type != "Constant"]


def substitutable(graph: Graph, node: onnx.NodeProto,
                  rules: dict[str, list[onnx.NodeProto]]) -> str | None:
    """Why ``node``'s default rule cannot be replaced (None: it can): the step must say what
    the rule read and returned, and each returned gradient must come from one of its own
    nodes (a rule that hands a gradient through unchanged has nothing to replace)."""
    io = rule_io(node)
    if io is None:
        return "the step does not record its gradient rule's inputs and outputs " \
               "(built before variants existed: rebuild it with memcc build)"
    _, gins = io
    mine = {o for n in rules.get(node.name, ()) for o in n.output if o}
    returned = [g for g in gins if g]
    if not returned:
        return "its rule returns no gradient"
    if len(set(returned)) != len(returned) or any(g not in mine for g in returned):
        return "its rule's results are not all computed by the rule itself"
    return None


@dataclass(frozen=True)
class Replaced:
    """What a variant of one node takes the place of: the default rules of ``members`` (the
    node itself, or every node of its ``Region``), whose results the variant's results are
    renamed to."""

    members: tuple[str, ...]
    old: list[onnx.NodeProto]        # the members' rule nodes, in graph order
    gouts: list[str]                 # the gradients the node's rule reads ("": none)
    results: list[str]               # the default results, one per variant result ("": none)
    wants: set[str]                  # the values the variant returns gradients for


@dataclass(frozen=True)
class NodeOrder:
    """A graph's nodes by name and their positions, taken once by a caller that then only
    inserts and removes nodes (``apply_variants``): insertions keep the relative order of
    the nodes already there, and forward nodes are never removed. Two scans of the whole
    graph per region match cost 6.9 s of a timm EdgeNeXt compile."""

    named: Mapping[str, onnx.NodeProto]
    position: Mapping[int, int]

    @classmethod
    def of(cls, graph: Graph) -> NodeOrder:
        return cls({n.name: n for n in graph.nodes},
                   {id(n): k for k, n in enumerate(graph.nodes)})

    def rule_nodes_in(self, graph: Graph, nodes: Iterable[onnx.NodeProto]
                      ) -> list[onnx.NodeProto]:
        """Those of ``nodes`` still in ``graph`` (by its def-use index), in graph order."""
        producer = graph.def_use().producer
        here = {id(n): n for n in nodes
                if any(o and producer.get(o) is n for o in n.output)}
        return sorted(here.values(), key=lambda n: self.position[id(n)])


def replaced_rule(graph: Graph, node: onnx.NodeProto, variant: Variant,
                  rules: dict[str, list[onnx.NodeProto]], order: NodeOrder | None = None
                  ) -> Replaced | str:
    """What ``variant`` replaces on ``node``, or why it cannot replace anything there.
    ``order``: the caller's ``NodeOrder`` of ``graph`` (else the graph is scanned)."""
    why = substitutable(graph, node, rules)
    if why:
        return why
    gouts, gins = rule_io(node)  # type: ignore[misc]
    if variant.region is None:
        wants = {i for i, g in zip(node.input, gins, strict=False) if i and g}
        return Replaced((node.name,), rules.get(node.name, []), gouts, gins, wants)
    region = variant.region(graph, node)
    if region is None:
        return f"variant {variant.key} finds nothing it covers here"
    by_name = {n.name: n for n in graph.nodes if n.name in region.nodes} if order is None \
        else {m: order.named[m] for m in region.nodes if m in order.named}
    if any(rule_io(by_name[m]) is None for m in region.nodes if m in by_name) \
            or len(by_name) != len(region.nodes):
        return "the step does not record its gradient rules' inputs and outputs " \
               "(built before variants existed: rebuild it with memcc build)"
    ids = {id(n) for m in region.nodes for n in rules.get(m, ())}
    old = [n for n in graph.nodes if id(n) in ids] if order is None else \
        order.rule_nodes_in(graph, (n for m in region.nodes for n in rules.get(m, ())))
    # The region's results: what its rules compute that anything else reads (the summed
    # gradient of each input; a shared Constant is not a result).
    readers, outputs = graph.def_use().readers, set(graph.outputs)
    made = [o for n in old if n.op_type != "Constant" for o in n.output if o and (
        o in outputs or any(id(r) not in ids for r in readers.get(o, ())))]
    if len(made) != len(region.inputs):
        return f"the default rules of {len(region.nodes)} nodes from {node_label(node)} " \
               f"return {len(made)} gradients where the variant returns " \
               f"{len(region.inputs)}"
    results = [next((o for o in made if graph.info.get(o) == graph.info.get(i)), "")
               for i in region.inputs]
    if not all(results) or len(set(results)) != len(results):
        return "the region's gradients do not match its inputs"
    return Replaced(region.nodes, old, gouts, results, set(region.inputs))


def _replacements(graph: Graph, variants: dict[str, str], order: list[str]
                  ) -> Iterator[tuple[str, onnx.NodeProto | None, Variant | None,
                                      Replaced | str]]:
    """For each node of ``order`` that ``variants`` gives a variant: the node, the variant
    (None where either is unknown) and what it replaces (or why it cannot)."""
    index = NodeOrder.of(graph)
    rules = rule_nodes(graph)
    for name in order:
        node = index.named.get(name)
        variant = lookup(node.op_type, variants[name]) if node is not None else None
        got = replaced_rule(graph, node, variant, rules, index) \
            if node is not None and variant is not None else ""
        yield name, node, variant, got


def variant_problems(graph: Graph, plan: Plan) -> list[str]:
    """Why the variants of ``plan`` cannot be realised on ``graph`` (empty: they can)."""
    asked = {n: v for n, v in plan.variants.items() if v != DEFAULT_VARIANT}
    problems: list[str] = []
    if not asked:  # every plan's lowering asks: no walk of the step for none
        return problems
    covered: dict[str, str] = {}   # member node -> the node whose variant replaces its rule
    for name, node, variant, got in _replacements(graph, asked, sorted(asked)):
        if node is None:
            problems.append(f"'{name}' is not a node of this step")
        elif variant is None:
            problems.append(f"{node_label(node)} has no variant '{asked[name]}'")
        elif isinstance(got, str):
            problems.append(f"{node_label(node)}: {got}")
        else:
            for m in got.members:
                if m in covered:
                    problems.append(f"{node_label(node)}: variant {variant.key} replaces "
                                    f"the rule of '{m}', which the variant of "
                                    f"'{covered[m]}' replaces too")
                covered[m] = name
    return problems


def overlapping(graph: Graph, variants: dict[str, str], keep: Iterable[str] = ()) -> set[str]:
    """The nodes of ``variants`` to leave out so that no two replace the same rule: the
    ones not in ``keep`` (a plan's earlier choices) that overlap another."""
    keep = set(keep)
    asked = {n: v for n, v in variants.items() if v != DEFAULT_VARIANT}
    covered: set[str] = set()
    drop: set[str] = set()
    for name, _, variant, got in _replacements(
            graph, asked, sorted(asked, key=lambda n: (n not in keep, n))):
        if variant is None:
            continue
        members = got.members if not isinstance(got, str) else (name,)
        if covered & set(members):
            drop.add(name)
        else:
            covered.update(members)
    return drop


def region_variants(graph: Graph, st: StepStructure, *,
                    allow_lossy: bool = False) -> dict[str, str]:
    """Forward node -> its first applicable variant that covers a region (the rules of
    several nodes, ``Variant.region``), for every node that has one; none overlap."""
    rules = rule_nodes(graph)
    producers = graph.producers()
    found: dict[str, str] = {}
    for node in graph.nodes:
        if node.name not in st.forward or node.name not in rules:
            continue
        for v in applicable_variants(graph, node, rules, producers):
            if v.region is not None and (allow_lossy or v.tier != LOSSY):
                found[node.name] = v.name
                break
    drop = overlapping(graph, found)
    return {n: v for n, v in found.items() if n not in drop}


def applicable_variants(graph: Graph, node: onnx.NodeProto,
                        rules: dict[str, list[onnx.NodeProto]],
                        producers: dict[str, onnx.NodeProto] | None = None) -> list[Variant]:
    """The variants a plan may choose for ``node`` on this step. ``producers``: the
    graph's value -> producer index, where the caller asks for many nodes (a context
    indexing the whole graph again for each node's question was 4% of a compile)."""
    if substitutable(graph, node, rules) is not None:
        return []
    ctx = variant_context(graph, node, detached_prefix="", taken=())
    if producers is not None:
        ctx.share_producers(producers)
    return variants_for(ctx, node)


def variant_context(graph: Graph, node: onnx.NodeProto, detached_prefix: str, *,
                    taken: Iterable[str] | None = None,
                    wants: set[str] | None = None) -> VariantContext:
    """A context that emits ``node``'s variant rule into detached node lists (backward and
    forward extras), with the rule's recorded needs (or ``wants``: a region variant's
    inputs); nothing is added to ``graph.nodes``. ``taken``: names to avoid, when the
    caller knows them (the prefix is the node's name and the variant's, which nothing in a
    built step starts with)."""
    if wants is None:
        _, gins = rule_io(node) or ([], [])
        wants = {i for i, g in zip(node.input, gins, strict=False) if i and g}
    if taken is None:
        taken = set(graph.values()) | {n.name for n in graph.nodes if n.name}
    back = Emitter(graph, prefix=detached_prefix, detached=True, taken=taken)
    fwd = Emitter(graph, prefix=detached_prefix + "fwd/", detached=True, taken=taken)
    return VariantContext(graph=graph, emit=back, requires_grad=wants, forward=fwd)


def apply_variants(graph: Graph, plan: Plan) -> VariantResult:
    """A new graph with the default rules of ``plan.variants`` replaced; ``graph`` is
    untouched (returned as is when the plan asks for no variant)."""
    asked = sorted((n, v) for n, v in plan.variants.items() if v != DEFAULT_VARIANT)
    if not asked:
        return VariantResult(graph, (), (), (), ())
    out = graph.copy(with_index=False)
    rules = rule_nodes(out)
    order = NodeOrder.of(out)
    by_name = order.named
    # Names and reader counts once, kept up to date per variant: building them per variant
    # was most of a smallest-peak search's lowering time (ResNet-50: 52 plans).
    taken = set(out.values()) | {n.name for n in out.nodes if n.name}
    readers = reader_counts(out)
    producers = out.producers()
    # The def-use index too: a region variant's matching reads it, and rebuilding it after
    # each substitution took 9 of an EfficientNet-B0 compile's 39 s (1,499 rebuilds).
    index = out.def_use()
    substituted, fwd_added, back_added, removed = [], [], [], []
    for name, vname in asked:
        node = by_name[name]
        variant = lookup(node.op_type, vname)
        assert variant is not None  # variant_problems ran first
        got = replaced_rule(out, node, variant, rules, order)
        assert not isinstance(got, str), got
        ctx = variant_context(out, node, f"{name}/{vname}/", wants=got.wants, taken=taken)
        ctx.share_producers(producers)
        new = variant.rule(ctx, node, [g or None for g in got.gouts])
        back_nodes = list(ctx.emit.nodes)
        fwd_nodes = list(ctx.forward.nodes) if ctx.forward is not None else []
        _rename_results(out, back_nodes, got.results, new, node, variant)
        old = got.old
        dead = dead_after_replacing(out, old, {g for g in got.results if g},
                                    readers=readers)
        for n in dead:
            for o in n.output:
                if o and producers.get(o) is n:
                    del producers[o]
        for n in (*back_nodes, *fwd_nodes):
            producers.update((o, n) for o in n.output if o)
            taken.update(o for o in n.output if o)
            taken.add(n.name)
            for i in n.input:
                if i:
                    readers[i] += 1
        for n in back_nodes:
            tag_node(n, grad_of=name, rule=vname)
        for n in fwd_nodes:
            tag_node(n, role="forward", rule=vname)
        for n in dead:
            index.remove(n)
        for n in (*back_nodes, *fwd_nodes):
            index.add(n)
        body = rule_body(old, got.gouts)
        anchor = body[0] if body else old[0]
        nodes: list[onnx.NodeProto] = []
        dead_ids = {id(n) for n in dead}
        for n in out.nodes:
            if n is anchor:
                nodes.extend(back_nodes)
            if id(n) not in dead_ids:
                nodes.append(n)
            if n is node:
                nodes.extend(fwd_nodes)
        out.set_nodes(nodes, index=index.attach(nodes))
        named = list(node.output)
        _drop_outputs_only_dead_read(node, dead, readers, out.outputs)
        for o in set(named) - set(node.output):
            if o and index.producer.get(o) is node:
                del index.producer[o]
        for m in got.members:
            rules[m] = []
        substituted.append((name, variant.key))
        fwd_added += [n.name for n in fwd_nodes]
        back_added += [n.name for n in back_nodes]
        removed += [n.name for n in dead]
    # Handed on without the index kept here (its reader lists are not in node order).
    out.set_nodes(out.nodes)
    return VariantResult(out, tuple(substituted), tuple(fwd_added), tuple(back_added),
                         tuple(removed))


def _rename_results(graph: Graph, back_nodes: list[onnx.NodeProto], gins: list[str],
                    new: list[str | None], node: onnx.NodeProto, variant: Variant) -> None:
    """Make the variant's results carry the default results' names (an Identity where the
    variant returns a value it did not compute)."""
    produced = {o: (n, k) for n in back_nodes for k, o in enumerate(n.output) if o}
    for i, old in enumerate(gins):
        got = new[i] if i < len(new) else None
        if bool(old) != bool(got):
            raise RuntimeError(f"variant {variant.key} of {node_label(node)} returns a "
                               f"gradient for input {i} where the default rule "
                               f"{'does not' if got else 'does'}")
        if not old:
            continue
        if got in produced:
            n, k = produced.pop(got)
            n.output[k] = old
            for m in back_nodes:
                for j, inp in enumerate(m.input):
                    if inp == got:
                        m.input[j] = old
            graph.info[old] = graph.info.get(got, graph.info.get(old))
        else:
            back_nodes.append(onnx.helper.make_node(
                "Identity", [got], [old], name=f"{node.name}/{variant.name}/result{i}"))


def _drop_outputs_only_dead_read(node: onnx.NodeProto, dead: list[onnx.NodeProto],
                                 readers: Mapping[str, int], keep: Iterable[str]) -> None:
    """Optional outputs of the forward node that only the removed rule nodes read (MaxPool's
    Indices, LayerNorm's Mean, added at build for the default rule) become unnamed, so ORT
    no longer computes or allocates them; by the schema's rule the recompute lowering also
    drops unread outputs with (``recompute.optional_output``). ``readers``: the reader
    counts of the graph as it now stands (``reader_counts``, kept by ``apply_variants``)."""
    read_by_dead = {i for n in dead for i in n.input}
    keep = set(keep)
    unread = [k for k, o in enumerate(node.output)
              if k > 0 and o and o in read_by_dead and not readers.get(o, 0)
              and o not in keep and optional_output(node, k)]
    for k in unread:
        node.output[k] = ""
    while unread and len(node.output) > 1 and not node.output[-1]:
        del node.output[-1]


def reader_counts(graph: Graph) -> defaultdict[str, int]:
    """Value -> how many node inputs read it."""
    readers: defaultdict[str, int] = defaultdict(int)
    for n in graph.nodes:
        for i in n.input:
            if i:
                readers[i] += 1
    return readers


class _CountsFromIndex(dict):
    """``reader_counts(graph)``, each count read from the graph's def-use index when first
    asked: the variant terms ask a few per default rule, where counting every node's
    inputs each time took 3.8 s of a timm EdgeNeXt compile (310 rules)."""

    def __init__(self, index) -> None:
        super().__init__()
        self._index = index

    def __missing__(self, value: str) -> int:
        n = self[value] = self._index.reader_count(value)
        return n


def dead_after_replacing(graph: Graph, old: list[onnx.NodeProto], results: set[str], *,
                         readers: MutableMapping[str, int] | None = None
                         ) -> list[onnx.NodeProto]:
    """The default rule's nodes to remove: those producing the results (the variant now
    does), then, backwards, every rule node nothing else reads. ``readers``: the graph's
    reader counts when the caller keeps them (``reader_counts``); the removed nodes' reads
    are taken off them."""
    if readers is None:
        readers = _CountsFromIndex(graph.def_use())
    keep_out = set(graph.outputs)
    dead: list[onnx.NodeProto] = []
    dead_ids: set[int] = set()
    for n in reversed(old):
        outs = [o for o in n.output if o]
        producing_result = any(o in results for o in outs)
        unread = all(readers[o] == 0 and o not in keep_out for o in outs)
        if producing_result or unread:
            dead.append(n)
            dead_ids.add(id(n))
            for i in n.input:
                if i:
                    readers[i] -= 1
    return [n for n in old if id(n) in dead_ids]
