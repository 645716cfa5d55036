"""Impossible budgets refused fast, with the bound compile plans against (issue 31, item 4).

A budget under the step's floor (``passes/planning/floor.py``) is refused right after the
``load`` stage. What made that take seconds on real-size models was the load itself: ONNX
shape inference serialized every weight (several times), weight tying hashed every
parameter and every matrix's transpose, and the function-op expansion copied the whole
model to find nothing to expand. These tests hold the shortcuts to the results of the
long way, and the refusal's bound to the floor of the step compile goes on to plan.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from exports import export
from onnx import shape_inference

from memcc.compiler import CompileOptions, user_budget
from memcc.compiler.floor_check import check_floor
from memcc.compiler.loading import load_step
from memcc.errors import InputError
from memcc.frontend.exported import _fingerprint, parameter_sources
from memcc.frontend.load import _STUB_BYTES, _infer, _without_weights
from memcc.graph import Graph, TensorInfo
from memcc.passes.plan import StepStructure
from memcc.passes.planning.floor import runtime_bytes, step_floor
from memcc.passes.planning.planner import BudgetError
from models import build_model


def _full_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """What ``_infer`` did before: ONNX shape inference over the model, weights and all."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    for vi in m.graph.output:
        vi.type.tensor_type.ClearField("shape")
    return shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)


@pytest.mark.parametrize("name", ["resnet18", "gpt2"])
def test_shape_inference_over_weight_stubs_gives_the_same_model(name: str) -> None:
    """Large float weights go to shape inference as stubs (the light model is a fraction of
    the full one), and the model ``_infer`` returns equals what inference over the whole
    model returned, field for field, weights included."""
    model = build_model(name, width=32 if name == "resnet18" else 128)
    light = _without_weights(model)
    stubs = [t for t in light.graph.initializer
             if t.data_location == onnx.TensorProto.EXTERNAL]
    assert stubs and all(not t.raw_data for t in stubs)
    assert light.ByteSize() < model.ByteSize() / 2
    mine = onnx.ModelProto()
    mine.CopyFrom(model)
    assert _infer(mine, name) == _full_inference(model)


def test_small_float_initializers_reach_shape_inference_with_their_values() -> None:
    """A Resize's scales are float values that shapes follow: small tensors keep their data
    (only tensors of ``_STUB_BYTES`` and more become stubs), so the output shape is known."""
    scales = onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    big = onnx.numpy_helper.from_array(np.ones((_STUB_BYTES // 4,), np.float32), "big")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest"),
         onnx.helper.make_node("Add", ["big", "big"], ["z"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 4, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None),
         onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)],
        [scales, big])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    out = _infer(model, "resize")
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in out.graph.output}
    assert shapes == {"y": [1, 3, 8, 8], "z": [_STUB_BYTES // 4]}
    assert {t.name for t in _without_weights(model).graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL} == {"big"}
    assert out.graph.initializer[1].raw_data == big.raw_data


def test_tied_copies_are_found_through_the_fingerprint() -> None:
    """A matrix and its transposed copy (under a name the exporter made up) share a
    fingerprint and are reported tied; a matrix of the same shape with other values is not
    (nor does its fingerprint match), and neither is an equal matrix under a PyTorch name of
    its own (a deep-copied layer: a parameter torch trains apart)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    other = rng.standard_normal((6, 4)).astype(np.float32)
    w_t = "onnx::MatMul_7"
    inits = {"w": w, w_t: np.ascontiguousarray(w.T), "other": other,
             "bias": rng.standard_normal(4).astype(np.float32), "layers.1.w": w.copy()}
    assert _fingerprint(w) == _fingerprint(inits[w_t]) != _fingerprint(other)
    g = Graph(nodes=[], inputs=[], outputs=[], initializers=inits,
              info={k: TensorInfo(onnx.TensorProto.FLOAT, a.shape) for k, a in inits.items()})
    sources = parameter_sources(g, list(inits))
    assert sources["w"].tied_with == (w_t,)
    assert set(sources[w_t].tied_with) == {"w", "layers.1.w"}
    assert sources["layers.1.w"].tied_with == (w_t,)
    assert sources["other"].tied_with == () and sources["bias"].tied_with == ()


def _steps():
    yield "mlp", build_model("mlp", batch=64), {}
    yield "resnet18", build_model("resnet18", batch=4, resolution=32), {}
    yield "gpt2", build_model("gpt2", batch=4, seq_len=32), {}
    path, _, _, dims = export("hf_resnet", "torchscript", training=True)
    yield "hf_resnet", str(path), {**dims, "batch": 4}


@pytest.mark.parametrize("provider", ["cpu", "cuda"])
def test_the_refusal_names_the_floor_of_the_step_compile_plans(provider: str) -> None:
    """On zoo models and a real train-mode export: one byte under the budget the floor
    needs is refused with exactly the floor of the step ``load`` builds (the step every
    later stage plans), and that budget itself passes the check (compile then plans as
    before)."""
    for name, model, dims in _steps():
        options = CompileOptions(budget="min", provider=provider, cost="analytic", dims=dims)
        graph, _ = load_step(model, name, options)
        st = StepStructure.of(graph)
        floor = step_floor(graph, st)
        # On CUDA the optimizer state may wait in host memory, and the session's own
        # handles and workspaces are on the device whatever the plan.
        need = user_budget(floor.total_bytes + runtime_bytes(provider) - (
            0 if provider == "cpu" else sum(graph.info[v].nbytes for v in _state(graph))),
            options, options.slack_for(graph))
        with pytest.raises(BudgetError) as refused:
            check_floor(graph, need - 1, options, name, st)
        assert refused.value.smallest == need, name
        assert "No budget under" in str(refused.value) and f"({need:,} bytes)" in str(
            refused.value), name
        check_floor(graph, need, options, name, st)


def test_the_cuda_floor_stays_under_the_smallest_budget_compile_finds() -> None:
    """The CUDA floor counts the session's own bytes (every predicted device peak does):
    a budget under it on a small step is refused at once, naming them, and the bound is
    still no higher than the budget ``--budget min`` plans for the same step on CUDA."""
    from memcc.compiler import compile_model

    model = build_model("mlp", batch=64)
    options = CompileOptions(budget="min", provider="cuda", cost="analytic", time_limit=5)
    graph, _ = load_step(model, "mlp", options)
    st = StepStructure.of(graph)
    with pytest.raises(BudgetError) as refused:
        check_floor(graph, runtime_bytes("cuda"), options, "mlp", st)
    assert "the CUDA session holds for itself" in str(refused.value)
    smallest = compile_model(model, options).report["budget_bytes"]
    assert refused.value.smallest <= smallest
    assert runtime_bytes("cuda") < smallest and runtime_bytes("cpu") == 0


def _state(graph: Graph) -> list[str]:
    from memcc.passes.lowering.offload_state import optimizer_state

    return [n for n, _ in optimizer_state(graph)]


def test_options_know_the_planner_strategies() -> None:
    """The options check a strategy name against ``STRATEGY_NAMES`` (so that the refusal
    path does not import every strategy): the names the planner registers."""
    from memcc.passes.planning.planner import STRATEGIES
    from memcc.passes.planning.request import STRATEGY_NAMES

    assert STRATEGY_NAMES == STRATEGIES


def test_the_floor_refusal_imports_no_planner_and_no_cost_model(tmp_path) -> None:
    """In a fresh interpreter, a budget under the floor is refused (the bound named) with
    the planner, the cost model and the row-chunk search never imported: the refusal costs
    the load of the step and no more."""
    import subprocess
    import sys

    model = tmp_path / "mlp.onnx"
    onnx.save(build_model("mlp", batch=64), model)
    code = (
        "import sys\n"
        "from memcc.compiler import CompileOptions, compile_model\n"
        "from memcc.passes.planning.refusal import BudgetError\n"
        f"try:\n    compile_model({str(model)!r}, CompileOptions(budget='1KB'))\n"
        "except BudgetError as e:\n    print('refused', e.smallest)\n"
        "heavy = ['memcc.passes.planning.planner', 'memcc.passes.analysis.cost_model',\n"
        "         'memcc.compiler.chunk_choice', 'memcc.compiler.planning']\n"
        "print('imported', [m for m in heavy if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0].startswith("refused ") and int(out[0].split()[1]) > 1000, out
    assert out[1] == "imported []", out


def test_tune_under_the_floor_names_the_budget_in_bytes(tmp_path) -> None:
    """``memcc tune --budget 0`` (refused before as "give a positive size", naming no
    bound; ``--budget 1KB`` takes the same path): exit status 2, the bytes the smallest
    size needs at least and the ``--budget`` to give (a lower bound: at it, the search
    refuses instead, with the larger budget it found)."""
    from typer.testing import CliRunner

    from memcc.cli import app
    from memcc.tune import TuneOptions, tune

    model = tmp_path / "dyn.onnx"
    onnx.save(build_model("mlp", dynamic_batch=True, width=128, depth=4, in_features=64),
              model)
    r = CliRunner().invoke(app, ["tune", str(model), "--budget", "0", "--dim",
                                 "batch=1..64", "--cost", "analytic", "-o",
                                 str(tmp_path / "t.onnx")])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "None" not in text and "batch=1" in text
    need = int(text.split("give --budget ")[1].split()[0])
    assert f"({need:,} bytes) can fit" in text
    # At that budget the floor no longer refuses: what does is the search, naming a budget
    # at least as large (the floor is a lower bound).
    with pytest.raises(InputError) as again:
        tune(model, need, "batch=1..1", TuneOptions(points=0, strategy="none",
                                                    cost="analytic"))
    msg = str(again.value)
    assert "needs a peak of" in msg and "alone take" not in msg
    assert int(msg.split("--budget ")[1].split()[0]) >= need


def test_weights_left_in_the_file_give_the_graph_a_whole_read_gives(tmp_path) -> None:
    """A file's large float weights are stubs while the model is read
    (``frontend/weights_apart.py``): the graph equals the one the whole model read gives
    (nodes, shapes, every initializer bit for bit), and filled again they are the model
    as written. With ``mapped`` they stay views into the file until ``own_weights``;
    without it, the graph owns them already."""
    from memcc.frontend.load import load_graph
    from memcc.frontend.weights_apart import _mapped, own_weights, read_apart, with_weights

    model = build_model("gpt2", batch=2, seq_len=16, width=128, vocab_size=500)
    path = tmp_path / "gpt2.onnx"
    onnx.save(model, path)
    light, arrays = read_apart(path)
    assert len(arrays) >= 5 and light.ByteSize() < model.ByteSize() / 4
    assert with_weights(light, arrays) == model  # what ORT runs where shapes need a run
    whole, owned, mapped = load_graph(model), load_graph(path), load_graph(path, mapped=True)
    assert not any(map(_mapped, owned.initializers.values()))
    assert sum(map(_mapped, mapped.initializers.values())) == len(arrays)
    own_weights(mapped)
    for g in (owned, mapped):
        assert g.nodes == whole.nodes and g.info == whole.info
        assert g.initializers.keys() == whole.initializers.keys()
        for name, a in g.initializers.items():
            b = whole.initializers[name]
            assert not _mapped(a) and not a.flags.writeable
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), name


def test_tune_refuses_and_analyze_answers_with_the_weights_left_in_the_file(
        tmp_path, monkeypatch) -> None:
    """``memcc tune`` under the smallest size's floor and ``memcc analyze`` (analytic node
    times) copy no weight out of the mapped file (``frontend/weights_apart.py``): the copy
    is made to fail here, and both still answer, tune's refusal naming the floor. Off a
    terminal (``QUIET_S`` 0 here) both say their stages as lines on stderr; ``--json``
    keeps stdout one JSON object."""
    import json

    from typer.testing import CliRunner

    from memcc.cli import app

    def copied(_a):
        raise AssertionError("a weight was copied out of the mapped file")

    monkeypatch.setattr("memcc.cli.log_progress.QUIET_S", 0.0)
    monkeypatch.setattr("memcc.tune.probe.owned", copied)
    monkeypatch.setattr("memcc.analyze.own_weights", copied)
    model = tmp_path / "gpt2.onnx"
    onnx.save(build_model("gpt2", batch=2, seq_len=16, width=128, vocab_size=500,
                          dynamic_batch=True), model)
    runner = CliRunner()
    r = runner.invoke(app, ["tune", str(model), "--budget", "1KB", "--dim", "batch=1..8"])
    assert r.exit_code == 2, r.output
    assert "the inputs, parameters and optimizer state alone take" in " ".join(
        r.stderr.split()), r.stderr
    assert "tune: batch=1: building the step (at " in r.stderr, r.stderr
    r = runner.invoke(app, ["analyze", str(model), "--dim", "batch=2", "--no-smallest",
                            "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["peak_bytes"] > 0
    assert "analyze: loading (at " in r.stderr, r.stderr
