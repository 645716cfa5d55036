"""LSTM, GRU and RNN nodes unrolled over their steps (memcc/frontend/recurrent.py).

The unrolled graph must compute what the operator defines: checked against ORT's own
kernels (at 1 and 2 threads on both sides) over the attributes exporters and users write,
and against ONNX's reference implementation where ORT has no kernel (``layout=1``). The
sums run in another order than ORT's, so the tolerance is float rounding (measured: at most
3.6e-7 absolute on values of order 1). Gradients against torch's are in
tests/test_exports_grad.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from memcc.errors import InputError, MemccError
from memcc.frontend.canonicalize import canonicalize
from memcc.frontend.load import load_graph

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
HIDDEN, INPUT, SEQ, BATCH = 5, 3, 6, 2


def _tensor(name: str, shape: list[int], rng: np.random.Generator, scale: float = 0.5):
    return helper.make_tensor(name, TensorProto.FLOAT, shape,
                              (scale * rng.standard_normal(shape)).astype(np.float32).ravel())


def recurrent_model(op: str, *, opset: int = 17, peepholes: bool = False,
                    initial: bool = True, bias: bool = True, **attrs) -> onnx.ModelProto:
    """One ``op`` node with random weights; X (and initial states) are graph inputs."""
    dirs = 2 if attrs.get("direction") == "bidirectional" else 1
    layout = attrs.get("layout", 0)
    g, rng = _GATES[op], np.random.default_rng(0)
    x_shape = [BATCH, SEQ, INPUT] if layout else [SEQ, BATCH, INPUT]
    h_shape = [BATCH, dirs, HIDDEN] if layout else [dirs, BATCH, HIDDEN]
    inits = [_tensor("W", [dirs, g * HIDDEN, INPUT], rng),
             _tensor("R", [dirs, g * HIDDEN, HIDDEN], rng)]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    names = ["X", "W", "R", "B" if bias else "", ""]
    if bias:
        inits.append(_tensor("B", [dirs, 2 * g * HIDDEN], rng, 1.0))
    states = (["H0", "C0"] if op == "LSTM" else ["H0"]) if initial else []
    for s in states:
        inputs.append(helper.make_tensor_value_info(s, TensorProto.FLOAT, h_shape))
    names += states
    if peepholes:
        names += [""] * (7 - len(names)) + ["P"]
        inits.append(_tensor("P", [dirs, 3 * HIDDEN], rng, 1.0))
    outs = ["Y", "Y_h", "Y_c"][: 3 if op == "LSTM" else 2]
    y_shape = [BATCH, SEQ, dirs, HIDDEN] if layout else [SEQ, dirs, BATCH, HIDDEN]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT,
                                             y_shape if o == "Y" else h_shape) for o in outs]
    node = helper.make_node(op, names, outs, name="rnn", hidden_size=HIDDEN, **attrs)
    graph = helper.make_graph([node], "recurrent", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=8)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]
                                        ).astype(np.float32) for i in model.graph.input}


def _run(model: onnx.ModelProto, feeds: dict, threads: int) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def _unrolled(model: onnx.ModelProto) -> onnx.ModelProto:
    out, report = canonicalize(onnx.shape_inference.infer_shapes(model), "test")
    assert report["changed"]
    assert not any(n.op_type in _GATES for n in out.graph.node)
    onnx.checker.check_model(out)
    return out


CASES = [
    ("LSTM", {}),
    ("LSTM", {"direction": "bidirectional"}),
    ("LSTM", {"direction": "reverse"}),
    ("LSTM", {"peepholes": True, "direction": "bidirectional"}),
    ("LSTM", {"clip": 0.5}),
    ("LSTM", {"initial": False, "bias": False}),
    ("LSTM", {"initial": False, "peepholes": True, "direction": "reverse"}),
    ("LSTM", {"activations": ["HardSigmoid", "LeakyRelu", "Tanh"],
              "activation_alpha": [0.3, 0.1], "activation_beta": [0.4]}),
    ("LSTM", {"opset": 7}),
    ("LSTM", {"opset": 9, "bias": False, "peepholes": True}),
    ("GRU", {"opset": 9, "bias": False, "linear_before_reset": 1}),
    ("GRU", {"direction": "bidirectional"}),
    ("GRU", {"linear_before_reset": 1}),
    ("GRU", {"linear_before_reset": 1, "direction": "reverse", "initial": False}),
    ("GRU", {"opset": 11, "clip": 1.0}),
    ("RNN", {}),
    ("RNN", {"activations": ["Relu", "Tanh"], "direction": "bidirectional", "opset": 11}),
]


@pytest.mark.parametrize("op,attrs", CASES, ids=[f"{o}-{i}" for i, (o, _) in
                                                 enumerate(CASES)])
def test_unrolled_matches_ort_kernel(op, attrs):
    model = recurrent_model(op, **attrs)
    feeds = _feeds(model)
    unrolled = _unrolled(model)
    for threads in (1, 2):
        ref = _run(model, feeds, threads)
        got = _run(unrolled, feeds, threads)
        for name, r, g in zip(("Y", "Y_h", "Y_c")[: len(ref)], ref, got, strict=True):
            assert g.shape == r.shape, name
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(ref[0]).max() > 0.1  # the outputs are not trivially small


@pytest.mark.parametrize("op,attrs", [
    ("LSTM", {"layout": 1, "direction": "reverse", "opset": 14}),
    ("GRU", {"layout": 1, "direction": "bidirectional", "linear_before_reset": 1,
             "opset": 14}),
])
def test_batch_first_layout_matches_reference(op, attrs):
    """ORT refuses ``layout=1`` ("Batchwise recurrent operations are not supported"); ONNX's
    reference implementation runs it."""
    model = recurrent_model(op, **attrs)
    feeds = _feeds(model)
    ref = ReferenceEvaluator(model).run(None, feeds)
    got = _run(_unrolled(model), feeds, 2)
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_unused_outputs_are_not_built():
    """torch.onnx often reads only Y: Y_h and Y_c, unnamed, cost nothing."""
    model = recurrent_model("LSTM")
    node = model.graph.node[0]
    node.output[1] = node.output[2] = ""
    del model.graph.output[1:]
    unrolled = _unrolled(model)
    np.testing.assert_allclose(_run(unrolled, _feeds(model), 1)[0],
                               _run(model, _feeds(model), 1)[0], rtol=1e-5, atol=1e-6)
    assert {o for n in unrolled.graph.node for o in n.output} >= {"Y"}
    assert not {"Y_h", "Y_c"} & {o for n in unrolled.graph.node for o in n.output}


def _constant_lengths(model: onnx.ModelProto, lengths: list[int]) -> None:
    model.graph.initializer.append(helper.make_tensor(
        "lens", TensorProto.INT32, [BATCH], lengths))
    model.graph.node[0].input[4] = "lens"


def test_full_sequence_lengths_are_accepted(tmp_path):
    model = recurrent_model("GRU")
    _constant_lengths(model, [SEQ] * BATCH)
    path = tmp_path / "gru.onnx"
    onnx.save(model, path)
    graph = load_graph(path)
    assert not any(n.op_type == "GRU" for n in graph.nodes)


@pytest.mark.parametrize("edit,match", [
    (lambda m: _constant_lengths(m, [SEQ, SEQ - 2]), "sequence_lens 'lens' are not all"),
    (lambda m: m.graph.node[0].attribute.append(helper.make_attribute("input_forget", 1)),
     "input_forget=1"),
    (lambda m: m.graph.node[0].attribute.append(
        helper.make_attribute("activations", ["Softsign", "Tanh", "Tanh"])),
     "activation 'softsign' has no gradient rule"),
])
def test_what_cannot_be_unrolled_is_refused_by_node(tmp_path, edit, match):
    model = recurrent_model("LSTM")
    edit(model)
    path = tmp_path / "lstm.onnx"
    onnx.save(model, path)
    with pytest.raises(InputError, match=match) as err:
        load_graph(path)
    assert "'rnn'" in str(err.value) and str(path) in str(err.value)


def test_an_unrolled_lstm_compiles_verifies_and_refuses_what_cannot_fit(tmp_path):
    """A torch.onnx export of nn.LSTM through memcc compile: --budget min plans, and
    --verify runs the plan against the step (bit for bit, measured peak within budget, the
    planned order); a budget under the step's floor is refused with the smallest budget."""
    from exports import export

    from memcc.compiler import CompileOptions, compile_model

    path, _, _, dims = export("lstm", "torchscript", tmp_path, training=True)
    result = compile_model(path, CompileOptions(budget="min", cost="analytic", verify=True,
                                                time_limit=5, dims=dims),
                           output=tmp_path / "min.onnx")
    verified = result.report["verification"]
    assert verified["ok"], verified
    with pytest.raises(MemccError, match=r"no plan peaks under|smallest budget"):
        compile_model(path, CompileOptions(budget=1024, cost="analytic", time_limit=5,
                                           dims=dims), output=tmp_path / "tiny.onnx")
    assert not (tmp_path / "tiny.onnx").exists()
