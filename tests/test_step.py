"""The training-step model: one reader of the metadata contract, node roles, provenance,
and the def-use index that passes keep instead of rebuilding maps."""

from __future__ import annotations

import json

import onnx
import pytest
from gradcheck import FLOAT, make_model
from onnx import helper

from memcc.backend.runner import read_step_spec
from memcc.def_use import DefUse
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph, topological_problems
from memcc.passes.analysis.liveness import categorize
from memcc.passes.plan import StepStructure
from memcc.step import DEFAULT_RULE, Role, TrainingStep
from models import build_model


@pytest.fixture(scope="module")
def mlp_step() -> Graph:
    return build_training_step(load_graph(build_model("mlp", batch=8, width=32, depth=3)),
                               BuildOptions(optimizer="adamw"))


def test_contract_fields_come_from_one_reader(mlp_step):
    step = TrainingStep.of(mlp_step)
    md = mlp_step.metadata
    assert step.is_training_step
    assert step.loss == md["memcc.loss"] == "loss"
    assert list(step.parameters) == json.loads(md["memcc.parameters"])
    assert step.state == json.loads(md["memcc.state"])
    assert list(step.data_inputs) == json.loads(md["memcc.data_inputs"])
    assert step.optimizer["name"] == "adamw"
    spec = read_step_spec(mlp_step)  # the runner's view is the step's
    assert (spec.loss, spec.data_inputs, dict(spec.state)) == \
        (step.loss, step.data_inputs, step.state)


def test_roles_split_the_step_into_forward_backward_update(mlp_step):
    step = TrainingStep.of(mlp_step)
    roles = [step.roles[n.name] for n in mlp_step.nodes]
    assert set(roles) == {Role.FORWARD, Role.BACKWARD, Role.UPDATE}
    # build emits forward, then backward, then the update: roles come in that order.
    order = [Role.FORWARD, Role.BACKWARD, Role.UPDATE]
    assert roles == sorted(roles, key=order.index)
    # Update nodes write every carried output; the loss is forward.
    du = mlp_step.def_use()
    assert step.roles[du.producer[step.loss].name] is Role.FORWARD
    for out in step.state:
        assert step.roles[du.producer[out].name] is Role.UPDATE


def test_every_gradient_node_names_its_forward_node_and_rule(mlp_step):
    step = TrainingStep.of(mlp_step)
    backward = step.nodes_with_role(Role.BACKWARD)
    traced = [n for n in backward if n.name in step.provenance]
    # Everything but the loss seed comes from a rule (the seed is a constant, if a node).
    assert len(traced) >= len(backward) - 1 and traced
    for n in traced:
        p = step.provenance[n.name]
        assert p.forward_node in step.forward and p.rule == DEFAULT_RULE
    # Every differentiated forward MatMul has backward nodes pointing at it.
    sources = {p.forward_node for p in step.provenance.values()}
    matmuls = [n.name for n in mlp_step.nodes if n.op_type in ("MatMul", "Gemm")
               and n.name in step.forward]
    assert matmuls and set(matmuls) <= sources


def test_provenance_survives_the_file(mlp_step, tmp_path):
    path = tmp_path / "step.onnx"
    onnx.save_model(mlp_step.to_model(), str(path))
    again = TrainingStep.of(load_graph(path))
    assert again.provenance == TrainingStep.of(mlp_step).provenance
    assert again.roles == TrainingStep.of(mlp_step).roles


def test_plain_graph_without_metadata_is_a_lenient_step():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="r")]
    g = load_graph(make_model(nodes, [("x", FLOAT, [2])], [("y", FLOAT, [2])]))
    step = TrainingStep.of(g)
    assert not step.is_training_step and step.loss == "y"
    assert step.forward == {"r"} and step.provenance == {}
    assert step.data_or_free_inputs() == ["x"]
    with pytest.raises(InputError, match="not a memcc training step"):
        step.validate("plain.onnx")


def test_malformed_metadata_is_named(mlp_step):
    g = mlp_step.copy()
    g.metadata["memcc.state"] = "{not json"
    with pytest.raises(InputError, match="malformed memcc.\\* metadata: memcc.state"):
        TrainingStep.of(g).validate()


def test_structure_and_categories_are_views_of_the_step(mlp_step):
    step = TrainingStep.of(mlp_step)
    st = StepStructure.of(mlp_step)
    assert st.forward == step.forward and st.saved == step.saved and st.loss == step.loss
    assert StepStructure.of(step) == st
    cats = categorize(mlp_step)
    assert all(cats[p] == "parameters" for p in step.parameters)


# ---------------------------------------------------------------------------- def-use index
def test_index_is_built_once_and_rebuilt_only_when_the_node_list_changes(mlp_step):
    g = mlp_step.copy()
    du = g.def_use()
    assert g.def_use() is du
    assert du.check(g.nodes) == []
    assert {v: n.name for v, n in du.producer.items()} == \
        {v: n.name for v, n in g.producers().items()}
    assert {v: [n.name for n in r] for v, r in du.readers.items()} == \
        {v: [n.name for n in r] for v, r in g.consumers().items()}
    g.nodes = list(g.nodes)  # a pass that replaced the list without telling the index
    assert g.def_use() is not du


def test_copy_carries_the_index_onto_the_copied_nodes(mlp_step):
    g = mlp_step.copy()
    g.def_use()
    c = g.copy()
    assert c._def_use is not None and c.def_use().check(c.nodes) == []
    assert all(n is not m for n, m in zip(c.nodes, g.nodes, strict=True))


def test_edits_keep_the_index_correct():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="n1"),
        helper.make_node("Neg", ["a"], ["b"], name="n2"),
        helper.make_node("Add", ["a", "b"], ["y"], name="n3"),
    ]
    g = load_graph(make_model(nodes, [("x", FLOAT, [2])], [("y", FLOAT, [2])]))
    du = g.def_use()
    extra = helper.make_node("Abs", ["a"], ["c"], name="n4")
    du.add(extra)
    du.rewire(g.nodes[2], 1, "c")
    du.remove(g.nodes[1])
    new = [g.nodes[0], extra, g.nodes[2]]
    g.set_nodes(new, du.attach(new))
    assert g.def_use() is du and du.check(g.nodes) == []
    assert du.reader_count("b") == 0 and du.producer["c"] is extra
    assert topological_problems(g) == []
    assert DefUse.build(g.nodes).check(g.nodes) == []


def test_topological_problems_name_the_node():
    nodes = [helper.make_node("Neg", ["a"], ["y"], name="late"),
             helper.make_node("Relu", ["x"], ["a"], name="early")]
    g = Graph(nodes, ["x"], ["y"], {}, {})  # load_graph would refuse this order
    assert topological_problems(g) == ["Neg node 'late' reads 'a' before it is produced"]


def test_index_agrees_with_an_independent_one(mlp_step):
    """onnx_ir (installed with the test tools, via onnxscript) keeps producer/uses links
    too; ours must name the same producer and the same readers for every value."""
    ir = pytest.importorskip("onnx_ir")
    theirs = ir.from_proto(mlp_step.to_model()).graph
    du = mlp_step.def_use()
    for node in theirs:
        for out in node.outputs:
            if not out.name:
                continue
            assert du.producer[out.name].name == node.name
            readers = sorted(u.node.name for u in out.uses())
            assert sorted(n.name for n in du.readers.get(out.name, ())) == readers
