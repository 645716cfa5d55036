"""The training-step runner: state carried between steps, batches, errors, order check."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from memcc.backend.onnx_file import save_graph
from memcc.backend.profile_order import compare_orders, executed_order
from memcc.backend.runner import RunRequest, run_steps, session_graph, synthetic_feeds
from memcc.backend.session import cuda_available, resolve_provider
from memcc.errors import InputError, RuntimeFailure
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph

H = helper.make_node
F = TensorProto.FLOAT
N, D, LR = 32, 5, 0.1


def linreg_step(path, *, n=N, d=D, lr=LR, seed=1, metadata=True, late_shape=False
                ) -> np.ndarray:
    """One SGD step of least-squares linear regression, written by hand with the metadata
    contract of ``memcc build``. Returns the initial weights. ``late_shape`` adds a Shape
    node after the forward pass, which ORT runs first (so the order check must fail)."""
    w0 = np.random.default_rng(seed).standard_normal((d, 1)).astype(np.float32)

    def const(name, value):
        return H("Constant", [], [name], name=name,
                 value=onnx.numpy_helper.from_array(np.asarray(value, np.float32), name))

    nodes = [
        H("MatMul", ["x", "W"], ["xw"], name="fwd/matmul"),
        H("Add", ["xw", "b"], ["pred"], name="fwd/add"),
        H("Sub", ["pred", "y"], ["diff"], name="fwd/sub"),
        H("Mul", ["diff", "diff"], ["sq"], name="fwd/square"),
        H("ReduceMean", ["sq"], ["loss"], keepdims=0, name="fwd/mean"),
        const("two_over_n", 2.0 / n),
        H("Mul", ["diff", "two_over_n"], ["g"], name="bwd/scale"),
        H("Transpose", ["x"], ["xT"], name="bwd/transpose"),
        H("MatMul", ["xT", "g"], ["W.grad"], name="bwd/matmul"),
        H("ReduceSum", ["g", "axis0"], ["b.grad"], keepdims=0, name="bwd/sum"),
        const("lr", lr),
        H("Mul", ["W.grad", "lr"], ["W.step0"], name="upd/w_step"),
        *([H("Shape", ["W"], ["W.shape"], name="late/shape")] if late_shape else []),
        H("Reshape", ["W.step0", "W.shape" if late_shape else "w_shape"], ["W.step"],
          name="upd/reshape"),
        H("Sub", ["W", "W.step"], ["W.new"], name="upd/w"),
        H("Mul", ["b.grad", "lr"], ["b.step"], name="upd/b_step"),
        H("Sub", ["b", "b.step"], ["b.new"], name="upd/b"),
    ]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        nodes, "linreg",
        [vi("x", F, [n, d]), vi("y", F, [n, 1]), vi("W", F, [d, 1]), vi("b", F, [1])],
        [vi("loss", F, []), vi("W.new", F, [d, 1]), vi("b.new", F, [1])],
        [onnx.numpy_helper.from_array(w0, "W"),
         onnx.numpy_helper.from_array(np.zeros(1, np.float32), "b"),
         onnx.numpy_helper.from_array(np.array([0], np.int64), "axis0"),
         onnx.numpy_helper.from_array(np.array([d, 1], np.int64), "w_shape")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    if metadata:
        for k, v in {
            "memcc.kind": "training_step", "memcc.loss": "loss",
            "memcc.data_inputs": json.dumps(["x", "y"]), "memcc.int_ranges": "{}",
            "memcc.state": json.dumps({"W.new": "W", "b.new": "b"}),
            "memcc.parameters": json.dumps(["W", "b"]),
        }.items():
            m.metadata_props.add(key=k, value=v)
    onnx.save_model(m, str(path))
    return w0


def numpy_sgd_losses(x, y, w, steps, lr=LR) -> list[float]:
    b = np.zeros(1, np.float32)
    losses = []
    for _ in range(steps):
        diff = x @ w + b - y
        losses.append(float(np.mean(diff * diff)))
        g = diff * np.float32(2.0 / len(x))
        w, b = w - lr * (x.T @ g), b - lr * g.sum(axis=0)
    return losses


@pytest.fixture
def linreg(tmp_path):
    path = tmp_path / "linreg.onnx"
    w0 = linreg_step(path)
    return path, w0


def test_state_is_carried_and_losses_follow_numpy_sgd(linreg):
    path, w0 = linreg
    r = run_steps(path, RunRequest(steps=20, seed=3))
    feeds = synthetic_feeds(load_graph(path), seed=3)
    expected = numpy_sgd_losses(feeds["x"], feeds["y"], w0, 20)
    np.testing.assert_allclose(r.losses, expected, rtol=1e-4)
    assert r.losses[-1] < 0.5 * r.losses[0]
    assert r.order_matches_plan and r.executed_order_mismatch is None
    assert len(r.step_times_s) == 20 and r.step_time_s > 0
    assert r.measured_peak_bytes is not None and r.measured_peak_bytes > 0


def test_json_has_the_contract_fields(linreg):
    d = run_steps(linreg[0], RunRequest(steps=2)).to_json()
    for key in ("steps", "losses", "step_time_s", "measured_peak_bytes",
                "predicted_peak_bytes", "order_matches_plan", "provider"):
        assert key in d
    assert d["steps"] == 2 and len(d["losses"]) == 2 and d["provider"] == "cpu"
    assert "MALLOC_MMAP_THRESHOLD_" in d["measurement_method"]
    json.dumps(d)


def test_built_mlp_losses_fall_over_20_sgd_steps(tmp_path):
    from models import mlp

    forward = mlp.build(batch=16, in_features=12, width=32, depth=2, num_classes=4)
    step = build_training_step(load_graph(forward), BuildOptions(optimizer="sgd", lr=0.05))
    path = save_graph(step, tmp_path / "mlp_step.onnx")
    r = run_steps(path, RunRequest(steps=20))
    assert r.losses[-1] < 0.7 * r.losses[0]
    assert all(np.isfinite(r.losses))
    assert r.order_matches_plan


def test_given_data_equals_the_same_synthetic_batch(linreg, tmp_path):
    path, _ = linreg
    feeds = synthetic_feeds(load_graph(path), seed=7)
    np.savez(tmp_path / "batch.npz", **feeds)
    from_file = run_steps(path, RunRequest(steps=3, data=tmp_path / "batch.npz"))
    synthetic = run_steps(path, RunRequest(steps=3, seed=7))
    assert from_file.losses == synthetic.losses
    assert from_file.to_json()["data"].endswith("batch.npz")


def test_session_graph_feeds_every_value_with_its_declared_shape(linreg):
    g = load_graph(linreg[0])
    stripped, values = session_graph(g)
    assert not stripped.initializers
    assert not any(n.op_type == "Constant" for n in stripped.nodes)
    assert values["lr"].shape == () and values["two_over_n"].shape == ()
    assert {"W", "b", "axis0", "lr"} <= set(stripped.inputs)
    for name, arr in values.items():
        assert tuple(arr.shape) == g.info[name].shape, name


def test_in_process_run_says_its_measurement_is_approximate(linreg):
    r = run_steps(linreg[0], RunRequest(steps=2, isolate=False))
    assert r.measurement_method.startswith("cpu-vmhwm-approximate")
    assert len(r.losses) == 2


def test_synthetic_batch_respects_int_ranges_masks_and_bools():
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        [H("Cast", ["ids"], ["f"], to=F, name="c")], "g",
        [vi("ids", TensorProto.INT64, [4, 50]), vi("mask", TensorProto.INT64, [4, 50]),
         vi("flag", TensorProto.BOOL, [2]), vi("x", TensorProto.FLOAT16, [3])],
        [vi("f", F, [4, 50])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.metadata_props.add(key="memcc.int_ranges", value=json.dumps({"ids": [3, 7]}))
    feeds = synthetic_feeds(load_graph(m), seed=0)
    assert feeds["ids"].min() >= 3 and feeds["ids"].max() < 7
    assert (feeds["mask"] == 1).all()
    assert not feeds["flag"][0] and feeds["flag"][1]      # a padding mask: head kept, tail True
    assert feeds["x"].dtype == np.float16
    again = synthetic_feeds(load_graph(m), seed=0)
    assert all(np.array_equal(feeds[k], again[k]) for k in feeds)


# ---------------------------------------------------------------------------- errors
def test_forward_model_is_refused_with_a_hint_to_build(tmp_path):
    path = tmp_path / "fwd.onnx"
    linreg_step(path, metadata=False)
    with pytest.raises(InputError, match="memcc build"):
        run_steps(path)


def test_not_an_onnx_file(tmp_path):
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"not a model")
    with pytest.raises(InputError, match="not an ONNX model"):
        run_steps(path)


@pytest.mark.parametrize("arrays, message", [
    ({"x": np.zeros((N, D), np.float32)}, r"no array named 'y' \(shape \[32, 1\], dtype float32"),
    ({"x": np.zeros((N, D + 1), np.float32), "y": np.zeros((N, 1), np.float32)},
     r"'x' has shape \[32, 6\].*expects \(shape \[32, 5\]"),
    ({"x": np.zeros((N, D), np.int64), "y": np.zeros((N, 1), np.float32)},
     r"'x' has shape \[32, 5\], dtype int64; the step takes float32"),
])
def test_bad_data_names_the_array_and_what_was_expected(linreg, tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(InputError, match=message):
        run_steps(linreg[0], RunRequest(data=tmp_path / "bad.npz"))


def test_float64_data_runs_as_the_step_s_float32(linreg, tmp_path):
    x = np.random.default_rng(0).standard_normal((N, D))
    y = np.ones((N, 1), np.float32)
    np.savez(tmp_path / "f64.npz", x=x, y=y)
    np.savez(tmp_path / "f32.npz", x=x.astype(np.float32), y=y)
    losses = [run_steps(linreg[0], RunRequest(data=tmp_path / f, steps=1)).losses
              for f in ("f64.npz", "f32.npz")]
    assert losses[0] == losses[1]


def test_data_that_is_not_npz(linreg, tmp_path):
    (tmp_path / "bad.npz").write_text("hello")
    with pytest.raises(InputError, match="cannot read it as an .npz"):
        run_steps(linreg[0], RunRequest(data=tmp_path / "bad.npz"))


def test_out_of_range_labels_are_refused(tmp_path):
    from models import mlp

    step = build_training_step(load_graph(mlp.build(batch=4, in_features=6, width=8, depth=1,
                                                    num_classes=3)))
    path = save_graph(step, tmp_path / "step.onnx")
    feeds = synthetic_feeds(step, seed=0)
    feeds["labels"] = np.full_like(feeds["labels"], 3)
    np.savez(tmp_path / "d.npz", **feeds)
    with pytest.raises(InputError, match=r"'labels' holds values from 3 to 3.*\[0, 3\)"):
        run_steps(path, RunRequest(data=tmp_path / "d.npz"))


def test_the_ignored_label_passes_the_data_check_only_where_the_step_ignores_it(tmp_path):
    """A step built with --ignore-index -100 records it: memcc run's and memcc train's data
    checks accept -100 in labels, still refuse any other value outside [0, classes), and
    say the ignored value is allowed; a step built without it refuses -100. Batches drawn
    from the seed keep to [0, classes)."""
    from memcc.backend.data import data_inputs, load_dataset
    from models import mlp

    def step_file(name, **options):
        step = build_training_step(load_graph(mlp.build(
            batch=4, in_features=6, width=8, depth=1, num_classes=3)), BuildOptions(**options))
        return step, save_graph(step, tmp_path / name)

    ignoring, ignoring_path = step_file("ignoring.onnx", ignore_index=-100)
    plain, plain_path = step_file("plain.onnx")
    feeds = synthetic_feeds(ignoring, seed=0)
    assert feeds["labels"].min() >= 0 and feeds["labels"].max() < 3
    feeds["labels"] = np.array([0, -100, 2, -100], np.int64)
    np.savez(tmp_path / "ok.npz", **feeds)
    run_steps(ignoring_path, RunRequest(data=tmp_path / "ok.npz"))
    load_dataset(tmp_path / "ok.npz", data_inputs(ignoring))
    feeds["labels"] = np.array([0, -100, 3, 1], np.int64)
    np.savez(tmp_path / "bad.npz", **feeds)
    refused = (r"'labels' holds values besides -100 from 0 to 3.*must lie in \[0, 3\), or "
               r"equal -100, the value the loss ignores \(--ignore-index\)")
    with pytest.raises(InputError, match=refused):
        run_steps(ignoring_path, RunRequest(data=tmp_path / "bad.npz"))
    with pytest.raises(InputError, match=refused):
        load_dataset(tmp_path / "bad.npz", data_inputs(ignoring))
    with pytest.raises(InputError, match=r"'labels' holds values from -100 to 2.*\[0, 3\); the "
                                         r"values below 0 are all -100.*--ignore-index -100"):
        run_steps(plain_path, RunRequest(data=tmp_path / "ok.npz"))
    with pytest.raises(InputError, match=r"'labels' holds values from -100 to 2"):
        load_dataset(tmp_path / "ok.npz", data_inputs(plain))


def test_broken_state_metadata_is_reported(tmp_path):
    path = tmp_path / "s.onnx"
    linreg_step(path)
    m = onnx.load(str(path))
    for p in m.metadata_props:
        if p.key == "memcc.state":
            p.value = json.dumps({"W.new": "W", "nope.new": "b"})
    onnx.save_model(m, str(path))
    with pytest.raises(InputError, match="output 'nope.new'"):
        run_steps(path)


def test_providers():
    assert resolve_provider("auto") == ("cuda" if cuda_available() else "cpu")
    with pytest.raises(InputError, match="choose one of"):
        resolve_provider("tpu")
    if not cuda_available():
        with pytest.raises(RuntimeFailure, match="no CUDAExecutionProvider"):
            resolve_provider("cuda")


# ---------------------------------------------------------------------------- order check
def test_compare_orders_reports_the_first_mismatch():
    assert compare_orders(["a", "b", "c"], ["a", "b", "c"]).matches
    check = compare_orders(["a", "b", "c"], ["a", "c", "b"])
    assert not check.matches
    assert check.first_mismatch == {"index": 1, "planned": "b", "executed": "c"}
    short = compare_orders(["a", "b"], ["a"])
    assert short.first_mismatch == {"index": 1, "planned": "b", "executed": None}


def test_late_shape_node_is_folded_so_ort_keeps_the_planned_order(tmp_path):
    """ORT runs ready Shape nodes first whatever the file order (tests/test_ort_facts.py);
    load_graph folds them into constants once shapes are static, so the order holds."""
    path = tmp_path / "late.onnx"
    linreg_step(path, late_shape=True)
    assert not [n for n in load_graph(path).nodes if n.op_type == "Shape"]
    r = run_steps(path, RunRequest(steps=2))
    assert r.order_matches_plan
    assert r.executed_order_mismatch is None


def test_nodes_out_of_topological_order_are_refused(tmp_path):
    path = tmp_path / "s.onnx"
    linreg_step(path)
    m = onnx.load(str(path))
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend([nodes[1], nodes[0], *nodes[2:]])
    onnx.save_model(m, str(path))
    with pytest.raises(InputError, match="topological order"):
        run_steps(path)


def test_executed_order_reads_kernel_events_by_start_time():
    events = [
        {"cat": "Session", "name": "model_run", "ts": 0},
        {"cat": "Node", "name": "b_kernel_time", "ts": 20},
        {"cat": "Node", "name": "a_fence_before", "ts": 5},
        {"cat": "Node", "name": "a_kernel_time", "ts": 10},
    ]
    assert executed_order(events) == ["a", "b"]


def test_labels_of_the_wrong_shape_are_refused_with_the_expected_shape(tmp_path):
    from memcc.backend.onnx_file import save_graph
    from memcc.frontend.build import BuildOptions, build_training_step
    from models import build_model

    step = build_training_step(load_graph(build_model("mlp", batch=4, depth=2)), BuildOptions())
    path = tmp_path / "step.onnx"
    save_graph(step, path)
    feeds = synthetic_feeds(step, 0)
    feeds["labels"] = np.zeros((5,), np.int64)  # the batch is 4
    np.savez(tmp_path / "bad.npz", **feeds)
    with pytest.raises(InputError, match=r"'labels' has shape \[5\].*expects \(shape \[4\]"):
        run_steps(path, RunRequest(data=tmp_path / "bad.npz"))


def test_a_child_payload_larger_than_one_command_line_argument_reaches_it():
    """Linux caps one argument at 128 KiB; a ResNet-50 plan's payload passed that when it
    went on the command line (``OSError: Argument list too long``). It goes on stdin."""
    from memcc.backend import memory

    payload = {"jobs": [], "runs": 1, "warmup": False, "provider": "cpu", "overrides": {},
               "padding": "x" * 300_000}
    assert memory.run_child("memcc.backend.memory", payload) == {}


def test_verify_fails_where_the_step_as_built_gives_nan(linreg, tmp_path):
    """NaN equals NaN in the comparison, so a step whose own outputs are NaN on the
    synthetic data (nn.TransformerEncoder under an all-True padding mask, before the
    synthetic bools became a padding mask) verified as bit-identical while checking
    nothing: it is a problem now, naming how many outputs."""
    from memcc.backend.verify import verify_rewrite

    finite = Graph.from_model(onnx.load(str(linreg[0])))
    assert verify_rewrite(finite, finite, budget=1 << 30)["outputs_not_finite"] == 0
    model = onnx.load(str(linreg[0]))
    b = next(t for t in model.graph.initializer if t.name == "b")
    b.CopyFrom(onnx.numpy_helper.from_array(np.array([np.nan], np.float32), "b"))
    graph = Graph.from_model(model)
    report = verify_rewrite(graph, graph, budget=1 << 30)
    assert not report["ok"] and report["outputs_not_finite"] == 3
    assert "NaN or infinite values in 3 of 3 outputs (e.g. 'loss')" in report["problems"][0]


def _batchnorm_twice_on_stored_statistics() -> Graph:
    """A step whose second training-mode BatchNorm reads the first one's stored running
    statistics: ORT's CPU kernel writes into that fed buffer (tests/test_ort_facts.py),
    as a recompute clone did before it read copies of its own."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"],
                              ["y", "m_new", "v_new"], training_mode=1, momentum=0.9),
             helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"],
                              ["y2", "m2", "v2"], training_mode=1, momentum=0.9),
             helper.make_node("Add", ["y", "y2"], ["z"])]
    stored = [onnx.numpy_helper.from_array(a.astype(np.float32), n) for n, a in
              (("s", np.ones(16)), ("b", np.zeros(16)), ("m", rng.standard_normal(16)),
               ("v", np.ones(16)))]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [8, 16, 8, 8])],
                          [vi("m_new", TensorProto.FLOAT, [16]),
                           vi("z", TensorProto.FLOAT, [8, 16, 8, 8])], stored)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 10
    return Graph.from_model(model)


def test_verify_fails_where_the_plan_writes_into_what_it_was_fed(linreg):
    """One run of a plan matched the step as built, yet its second run on the same state
    did not: the run had written into the fed running statistics (a SegFormer plan before
    the recompute clones read copies). ``--verify`` now checks that the rewritten step
    leaves every fed value's bytes as they were."""
    from memcc.backend import verify

    graph = _batchnorm_twice_on_stored_statistics()
    written: list[str] = []
    verify.step_outputs(graph, synthetic_feeds(graph, 0), "cpu", written)
    assert written == ["m", "v"]
    problems = verify._compared(graph, graph, verify.VerifyRun(), "cpu")[0]
    assert len(problems) == 1 and "wrote into 2 of its fed values (e.g. 'm')" in problems[0]
    clean = Graph.from_model(onnx.load(str(linreg[0])))
    assert verify.verify_rewrite(clean, clean, budget=1 << 30)["ok"]


def test_synthetic_bools_are_padding_masks_with_positions_either_way():
    """Every row of a bool input holds a False head of at least one and a True tail: a
    padding mask under torch's convention (True = padded), positions to attend to under
    the other (True = attend)."""
    from memcc.backend.step_feeds import _padding_mask

    m = _padding_mask((4, 3, 16), np.random.default_rng(0))
    assert m.dtype == bool and m.shape == (4, 3, 16)
    assert (~m[..., 0]).all() and m[..., -1].all()
    assert (np.diff(m.astype(int), axis=-1) >= 0).all()      # one switch from False to True
    assert len(np.unique(m.sum(-1))) > 1                     # the lengths are drawn
    assert _padding_mask((), np.random.default_rng(0)).shape == ()


def test_labels_padded_with_minus_100_are_told_of_ignore_index():
    """A step built without --ignore-index refuses -100 labels; the refusal says the flag
    (a walk-through: the message was clear but could have named it)."""
    from memcc.backend.data import check_int_range
    from memcc.errors import InputError

    labels = np.array([3, -100, 7, -100])
    with pytest.raises(InputError, match="build the step with --ignore-index -100"):
        check_int_range("d.npz", "labels", labels, (0, 10))
    with pytest.raises(InputError) as other:
        check_int_range("d.npz", "labels", np.array([3, -1]), (0, 10))
    assert "--ignore-index" not in str(other.value)
    check_int_range("d.npz", "labels", labels, (0, 10), ignored=-100)
    # Token ids padded with -100 are no labels: the flag would not help them (a walk-through).
    with pytest.raises(InputError) as ids:
        check_int_range("d.npz", "input_ids", labels, (0, 10))
    assert "--ignore-index" not in str(ids.value)
