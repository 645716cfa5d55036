"""``build_training_step``: loss, optimizer updates and metadata match torch, bad input fails."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gradcheck import FLOAT, INT64, make_model

from memcc.errors import InputError, ShapeError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph

torch = pytest.importorskip("torch")


def mlp_model(batch="batch", d_in=6, hidden=8, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((d_in, hidden)) * 0.5).astype(np.float32)
    b1 = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((hidden, classes)) * 0.5).astype(np.float32)
    b2 = (rng.standard_normal(classes) * 0.1).astype(np.float32)
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "fc1.weight"], ["h0"]),
        onnx.helper.make_node("Add", ["h0", "fc1.bias"], ["h1"]),
        onnx.helper.make_node("Relu", ["h1"], ["h2"]),
        onnx.helper.make_node("Gemm", ["h2", "fc2.weight", "fc2.bias"], ["logits"]),
    ]
    m = make_model(nodes, [("x", FLOAT, [batch, d_in])], [("logits", FLOAT, [batch, classes])],
                   {"fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2})
    return m, {"fc1.weight": w1, "fc1.bias": b1, "fc2.weight": w2, "fc2.bias": b2}


def run_step(graph, feeds):
    model = graph.to_model()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def torch_mlp(params):
    t = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}

    def fwd(x):
        h = torch.relu(x @ t["fc1.weight"] + t["fc1.bias"])
        return h @ t["fc2.weight"] + t["fc2.bias"]

    return t, fwd


@pytest.mark.parametrize("optimizer", ["none", "sgd", "adamw"])
def test_two_steps_match_torch_optimizer(optimizer):
    model, params = mlp_model()
    graph = build_training_step(load_graph(model, {"batch": 5}),
                                BuildOptions(optimizer=optimizer, lr=0.05))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    labels = rng.integers(0, 4, size=5).astype(np.int64)
    state_map = json.loads(graph.metadata["memcc.state"])
    state = {n: graph.initializers[n] for n in state_map.values()}

    t, fwd = torch_mlp(params)
    opt = {
        "none": None,
        "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.05),
    }[optimizer]
    topt = opt(list(t.values())) if opt else None
    for _ in range(2):
        out = run_step(graph, {"x": x, "labels": labels, **state})
        loss = torch.nn.functional.cross_entropy(fwd(torch.tensor(x)), torch.tensor(labels))
        assert abs(out["loss"] - loss.item()) <= 1e-5 * max(1.0, abs(loss.item()))
        if topt is None:
            loss.backward()
            for k in params:
                np.testing.assert_allclose(out[f"{k}.grad"], t[k].grad.numpy(), rtol=1e-4,
                                           atol=1e-6)
            return
        topt.zero_grad()
        loss.backward()
        topt.step()
        state = {inp: out[o] for o, inp in state_map.items()}
        for k in params:
            np.testing.assert_allclose(state[k], t[k].detach().numpy(), rtol=1e-4, atol=1e-6)


def test_metadata_names_inputs_state_and_ranges():
    model, params = mlp_model()
    graph = build_training_step(load_graph(model, {"batch": 3}), BuildOptions())
    assert json.loads(graph.metadata["memcc.data_inputs"]) == ["x", "labels"]
    assert json.loads(graph.metadata["memcc.int_ranges"]) == {"labels": [0, 4]}
    assert sorted(json.loads(graph.metadata["memcc.parameters"])) == sorted(params)
    state = json.loads(graph.metadata["memcc.state"])
    assert state["fc1.weight.new"] == "fc1.weight"
    assert state["fc1.weight.momentum.new"] == "fc1.weight.momentum"
    assert graph.outputs[0] == "loss"
    assert graph.info["labels"].dtype == INT64 and graph.info["labels"].shape == (3,)


def test_mse_loss_adds_target_input():
    model, _ = mlp_model()
    graph = build_training_step(load_graph(model, {"batch": 2}), BuildOptions(loss="mse"))
    assert "target" in graph.inputs and graph.info["target"].shape == (2, 4)


def test_loss_none_requires_a_scalar_output():
    model, _ = mlp_model()
    with pytest.raises(InputError, match="scalar loss"):
        build_training_step(load_graph(model, {"batch": 2}), BuildOptions(loss="none"))


def test_model_without_float_output_is_rejected():
    m = make_model([onnx.helper.make_node("ArgMax", ["x"], ["idx"], axis=1)],
                   [("x", FLOAT, [2, 3])], [("idx", INT64, [2, 1])])
    with pytest.raises(InputError, match="no floating-point output"):
        build_training_step(load_graph(m), BuildOptions())


def test_unbound_symbolic_dimension_names_it():
    model, _ = mlp_model()
    with pytest.raises(ShapeError, match="--dim batch=INT"):
        load_graph(model)


def test_a_dim_the_model_lacks_names_the_ones_it_has():
    """The model's symbolic dimensions are listed as declared, before any is bound."""
    model, _ = mlp_model()
    with pytest.raises(InputError, match=r"\['seq'\]; its symbolic dimensions are \['batch'\]"):
        load_graph(model, {"batch": 4, "seq": 3})


def test_a_dim_on_a_model_without_symbolic_dimensions_says_to_drop_it():
    """A walk-through read 'its symbolic dimensions are none' on a model with fixed sizes."""
    model, _ = mlp_model()
    for vi in [*model.graph.input, *model.graph.output]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param:
                d.dim_value = 4
    with pytest.raises(InputError, match=r"it has none \(every size is fixed in the file\), "
                                         r"so drop --dim"):
        load_graph(model, {"batch": 4})


def test_not_an_onnx_file(tmp_path):
    p = tmp_path / "junk.onnx"
    p.write_bytes(b"\x00\x01 definitely not protobuf \xff" * 10)
    with pytest.raises(InputError, match="not an ONNX model"):
        load_graph(p)


def test_linked_external_data_says_to_copy_it(tmp_path):
    """onnx refuses external data behind a symbolic link (a user who links an export's
    ``.onnx.data`` into a working folder): the error says what to do."""
    from models import build_model

    src = tmp_path / "src"
    src.mkdir()
    onnx.save(build_model("mlp"), str(src / "m.onnx"), save_as_external_data=True,
              location="m.onnx.data", size_threshold=0)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "m.onnx").write_bytes((src / "m.onnx").read_bytes())
    (linked / "m.onnx.data").symlink_to(src / "m.onnx.data")
    assert load_graph(src / "m.onnx").initializers
    with pytest.raises(InputError, match="copy the data file next to the model"):
        load_graph(linked / "m.onnx")


def test_bad_option_values():
    with pytest.raises(InputError, match="--loss"):
        BuildOptions(loss="hinge")
    with pytest.raises(InputError, match="--optimizer"):
        BuildOptions(optimizer="lion")


def test_sizes_the_model_cannot_run_at_say_why():
    """A position table of 4 rows read at a Range of the bound sequence length: its shape
    is known only by running the model, and at seq 8 that run fails. The error gives ORT's
    reason (the Gather and the index) and points at --dim, not at the exporter."""
    from onnx import helper, numpy_helper

    table = numpy_helper.from_array(np.ones((4, 3), np.float32), "positions")
    one = numpy_helper.from_array(np.array(1, np.int64), "one")
    zero = numpy_helper.from_array(np.array(0, np.int64), "zero")
    nodes = [helper.make_node("Shape", ["ids"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["seq"], axis=0),
             helper.make_node("Range", ["zero", "seq", "one"], ["pos"]),
             helper.make_node("Gather", ["positions", "pos"], ["y"], name="lookup", axis=0)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", FLOAT, None)], [table, one, zero])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert load_graph(model, {"batch": 2, "seq": 4}).info["y"].shape == (4, 3)
    with pytest.raises(ShapeError, match=r"failed: .*Gather node\. Name:'lookup'.*--dim"):
        load_graph(model, {"batch": 2, "seq": 8})
