"""memcc's fusions (frontend/fuse.py) keep every output of the step bit for bit, at 1 and 2
intra-op threads, and leave the forward pass standard ONNX."""

from __future__ import annotations

import json

import pytest
from onnx import TensorProto, helper
from threads import mismatches, run_at_threads

from memcc.backend.runner import synthetic_feeds
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.fuse import (
    FUSED_MATMUL,
    MS_DOMAIN,
    TRANSPOSE_INTO_MATMUL,
    _rule_boundaries,
    _swaps_last_two,
    fuse,
)
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.step import FUSIONS_KEY, TrainingStep
from models import build_model

ZOO = {"gpt2": {}, "resnet18": {}, "mobilenetv2": {}}
# A real export too: transformers' GPT-2 through torch.onnx's dynamo exporter.
EXPORTED = ("gpt2-dynamo",)


@pytest.fixture(scope="module", params=sorted(ZOO) + list(EXPORTED))
def steps(request) -> tuple[str, Graph, Graph]:
    if request.param in EXPORTED:
        from exports import export

        path, _, _, dims = export(*request.param.split("-"))
        forward = load_graph(path, dims)
    else:
        forward = load_graph(build_model(request.param, **ZOO[request.param]))
    plain = build_training_step(forward, BuildOptions(fusions=()))
    fused = build_training_step(forward, BuildOptions())
    return request.param, plain, fused


def test_fused_steps_compute_the_same_bits_at_1_and_2_threads(steps):
    name, plain, fused = steps
    report = json.loads(fused.metadata[FUSIONS_KEY])
    assert report["fused"][TRANSPOSE_INTO_MATMUL] > 0, report
    assert report["nodes_after"] == len(fused.nodes) < len(plain.nodes) == report["nodes_before"]
    assert report["bytes_saved"] > 0
    feeds = synthetic_feeds(plain, 0)
    # Each thread count twice, the two runs the same bits (run_at_threads asserts it).
    a = run_at_threads(plain, feeds, threads=(1, 2))
    b = run_at_threads(fused, feeds, threads=(1, 2))
    for threads in (1, 2):
        assert list(a[threads]) == list(b[threads])
        assert not mismatches(a[threads], b[threads]), (name, threads)


def test_the_forward_pass_stays_standard_onnx(steps):
    _, plain, fused = steps
    fwd = TrainingStep.of(fused).forward
    assert fwd == TrainingStep.of(plain).forward
    assert all(n.domain in ("", "ai.onnx") for n in fused.nodes if n.name in fwd)
    made = [n for n in fused.nodes if n.op_type == FUSED_MATMUL]
    assert made and all(n.domain == MS_DOMAIN and n.name not in fwd for n in made)
    # What is left of the swaps of the last two axes that only GEMMs read outside the
    # forward pass: the rule boundaries a variant may rewire (never fused).
    readers, keep = fused.consumers(), _rule_boundaries(fused)
    for n in fused.nodes:
        rank = len(fused.info[n.input[0]].shape) if n.op_type == "Transpose" else 0
        if n.name not in fwd and _swaps_last_two(n, rank) and all(
                r.op_type in ("MatMul", FUSED_MATMUL) for r in readers[n.output[0]]):
            assert n.output[0] in keep, n.name


def _graph(nodes, inputs, outputs, inits=()) -> Graph:
    f32 = TensorProto.FLOAT
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, f32, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, f32, s) for n, s in outputs], list(inits)),
        opset_imports=[helper.make_opsetid("", 17)])
    return load_graph(model)


def test_a_transpose_read_by_anything_but_matmuls_or_returned_stays():
    nodes = [
        helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0], name="t1"),
        helper.make_node("MatMul", ["at", "a"], ["y1"], name="mm1"),
        helper.make_node("Relu", ["at"], ["y2"], name="relu"),
        helper.make_node("Transpose", ["a"], ["y3"], perm=[1, 0], name="t2"),
        helper.make_node("MatMul", ["y3", "a"], ["y4"], name="mm2"),
    ]
    g = _graph(nodes, [("a", [4, 4])], [("y1", [4, 4]), ("y2", [4, 4]), ("y3", [4, 4]),
                                         ("y4", [4, 4])])
    fused, report = fuse(g)
    assert report.fused[TRANSPOSE_INTO_MATMUL] == 0 and fused is g


def _run(g: Graph, feeds, threads):
    import onnxruntime as ort

    from memcc.backend.session import session_options

    model = g.to_model()
    sess = ort.InferenceSession(model.SerializeToString(),
                                session_options(intra_op_threads=threads),
                                providers=["CPUExecutionProvider"])
    return dict(zip(g.outputs, sess.run(g.outputs, feeds), strict=True))


def test_compile_fuses_a_step_built_without_the_fusions(tmp_path):
    from memcc.backend.onnx_file import save_graph
    from memcc.compiler import CompileOptions, compile_model

    forward = load_graph(build_model("gpt2"))
    old = build_training_step(forward, BuildOptions(fusions=()))
    old.metadata.pop(FUSIONS_KEY)  # as a step built before the fusions existed
    path = save_graph(old, tmp_path / "old.onnx")
    result = compile_model(path, CompileOptions(budget="1TB", cost="analytic"))
    fused = result.report["passes"][0]["summary"]["fusions"]
    assert fused["fused"][TRANSPOSE_INTO_MATMUL] > 0
    assert any(n.op_type == FUSED_MATMUL for n in result.graph.nodes)
