"""backend.device_step: the one runtime path, checked on the CPU.

The CUDA layout (state uploaded once through an Identity session, stored values left in the
graph for ORT to place, the batch copied into a bound buffer, outputs into buffers bound
once, two bindings in turn where an update cannot be written in place) runs here on the CPU
provider and must give the copying runner's numbers bit for bit. The prediction without
arena shrink and what keeps a step from being captured as a CUDA graph are read from the
graph alone, so they are tested here too; the capture itself needs a GPU
(benchmarks/cuda_check.py).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from memcc.backend.device_step import (
    DEVICE,
    HOST,
    DeviceSettings,
    DeviceStep,
    StepRoles,
    capture_blockers,
    device_session_graph,
)
from memcc.backend.onnx_file import save_graph
from memcc.backend.runner import RunRequest, run_steps, synthetic_feeds
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph, TensorInfo
from memcc.passes.analysis.arena import ArenaSetup, replay_steps
from memcc.passes.analysis.arrange import arrange_step
from memcc.passes.analysis.device_memory import arena_limit, outside_arena_bytes, predict_device
from memcc.step import TrainingStep
from models import build_model


def _step(name: str, opt: str = "sgd", **dims) -> Graph:
    return build_training_step(load_graph(build_model(name, **dims)),
                               BuildOptions(optimizer=opt))


def _device_step(graph: Graph, layout: str, in_place: bool = True, threads: int = 1
                 ) -> DeviceStep:
    spec = TrainingStep.of(graph)
    a = arrange_step(graph, spec, in_place=in_place)
    return DeviceStep(a.graph, StepRoles(spec.loss, spec.state, a.in_place.aliased),
                      DeviceSettings(provider="cpu", threads=threads, layout=layout))


@pytest.mark.parametrize("name, opt, in_place", [
    ("resnet18", "sgd", True),    # BatchNorm statistics: two bindings in turn
    ("gpt2", "adamw", True),      # Dropout counter, tied embedding
    ("mlp", "sgd", False),        # every update in a second buffer
])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_device_layout_gives_the_copying_runners_numbers(tmp_path, name, opt, in_place,
                                                             threads):
    graph = _step(name, opt)
    path = save_graph(graph, tmp_path / "step.onnx")
    feeds = synthetic_feeds(graph, seed=0)
    ref = run_steps(path, RunRequest(steps=3, isolate=False))
    step = _device_step(load_graph(path), DEVICE, in_place=in_place, threads=threads)
    losses = [step.run(feeds).loss for _ in range(3)]
    assert losses == list(ref.losses)
    host = _device_step(load_graph(path), HOST, in_place=in_place, threads=threads)
    for _ in range(3):
        host.run(feeds)
    a, b = step.state_dict(), host.state_dict()
    assert a.keys() == b.keys() == set(TrainingStep.of(graph).state.values())
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n, strict=True)


def test_loading_the_initial_state_repeats_the_first_steps(tmp_path):
    """What ``memcc run`` does after its profiled first step: the same buffers, set back."""
    graph = _step("resnet18")
    step = _device_step(graph, DEVICE)
    feeds = synthetic_feeds(graph, seed=0)
    initial = step.state_dict()
    first = [step.run(feeds).loss for _ in range(3)]
    step.load_state(initial)   # after an odd number of runs: the spares hold the state
    again = [step.run(feeds).loss for _ in range(3)]
    assert first == again


def test_the_device_layout_leaves_stored_values_to_ort_and_feeds_the_state():
    graph = _step("mlp")
    spec = TrainingStep.of(graph)
    carried = list(dict.fromkeys(spec.state.values()))
    g, state, fixed = device_session_graph(graph, carried, DEVICE)
    assert set(state) == set(carried) and not fixed
    assert not set(carried) & set(g.initializers)
    assert set(carried) <= set(g.inputs)
    assert set(graph.initializers) - set(carried) == set(g.initializers)
    h, state_h, fixed_h = device_session_graph(graph, carried, HOST)
    assert not h.initializers and set(state_h) == set(carried)
    assert set(fixed_h) == set(graph.initializers) - set(carried) | {
        n.output[0] for n in graph.nodes if n.op_type == "Constant"} - set(carried)


def test_a_step_with_the_returned_outputs_copies_them_back():
    graph = _step("mlp")
    spec = TrainingStep.of(graph)
    extra = spec.forward_outputs[0]   # the logits, made an output of the step here
    graph.outputs.append(extra)
    a = arrange_step(graph, spec)
    step = DeviceStep(a.graph, StepRoles(spec.loss, spec.state, a.in_place.aliased,
                                         returned=[extra]), DeviceSettings(layout=DEVICE))
    out = step.run(synthetic_feeds(graph, seed=0))
    assert out.arrays[extra].shape == graph.info[extra].shape and np.isfinite(out.loss)


def test_cuda_graph_needs_cuda():
    graph = _step("mlp")
    spec = TrainingStep.of(graph)
    with pytest.raises(InputError, match="--cuda-graph needs --provider cuda"):
        DeviceStep(graph, StepRoles(spec.loss, spec.state), DeviceSettings(cuda_graph=True))


# ---------------------------------------------------------------------------- prediction
def test_without_shrink_the_arena_settles_in_the_first_step():
    graph = _step("resnet18", batch=4)
    spec = TrainingStep.of(graph)
    a = arrange_step(graph, spec)
    report = replay_steps(a.graph, a.prediction, ArenaSetup(feeds_in_arena=False, cuda=True,
                                                            shrink=False, outputs_in_arena=False),
                          steps=3)
    assert report.extensions == 0, "a settled arena adds no region in later steps"
    assert len(set(report.peaks_per_step)) == 1
    assert report.first_run_peak_bytes == report.peak_device_bytes
    pred = predict_device(a.graph, a.prediction, aliased=a.in_place.aliased,
                          updates=spec.state)
    state = sum(graph.info[n].nbytes for n in set(spec.state.values()))
    # Bound: the state, a spare per update not in place (BatchNorm statistics), the batch,
    # the loss; stored values (constants) beside them.
    assert pred.bound_bytes >= state
    assert pred.steady_bytes >= pred.arena.peak_in_use_bytes + state
    assert pred.first_step_bytes >= pred.steady_bytes


def test_a_budget_the_state_alone_does_not_fit_fails_before_the_step_runs():
    """``gpu_mem_limit`` proves a budget on CUDA: the arena gets what the buffers bound
    beside it leave, and a budget they alone exceed is refused, naming the step."""
    from memcc.errors import RuntimeFailure

    graph = _step("resnet18", batch=4)
    spec = TrainingStep.of(graph)
    a = arrange_step(graph, spec)
    aliased = a.in_place.aliased
    outside = outside_arena_bytes(a.graph, aliased, spec.state)
    pred = predict_device(a.graph, a.prediction, aliased=aliased, updates=spec.state)
    assert pred.steady_bytes == pred.arena.peak_device_bytes + outside
    budget = pred.steady_bytes
    assert arena_limit(a.graph, aliased, spec.state, budget) == pred.arena.peak_device_bytes
    with pytest.raises(RuntimeFailure, match="step.onnx: .* more than the limit"):
        arena_limit(a.graph, aliased, spec.state, outside, source="step.onnx")


def test_a_real_export_runs_in_the_device_layout(tmp_path):
    """A torch.onnx export (dynamo, train mode, BatchNorm) through the CUDA layout on the
    CPU provider, at 2 threads, twice: the copying runner's numbers each time."""
    from exports import export

    path, _, _, dims = export("conv_bn", "dynamo", tmp_path, training=True)
    graph = build_training_step(load_graph(path, dims), BuildOptions())
    step_file = save_graph(graph, tmp_path / "step.onnx")
    ref = run_steps(step_file, RunRequest(steps=3, isolate=False))
    feeds = synthetic_feeds(graph, seed=0)
    for _ in range(2):
        step = _device_step(load_graph(step_file), DEVICE, threads=2)
        assert [step.run(feeds).loss for _ in range(3)] == list(ref.losses)


def test_the_copying_step_binds_a_second_buffer_for_every_update():
    graph = _step("mlp")
    spec = TrainingStep.of(graph)
    a = arrange_step(graph, spec)
    in_place = predict_device(a.graph, a.prediction, aliased=a.in_place.aliased,
                              updates=spec.state)
    b = arrange_step(graph, spec, in_place=False)
    copying = predict_device(b.graph, b.prediction, aliased={}, updates=spec.state)
    state = sum(graph.info[n].nbytes for n in set(spec.state.values()))
    assert copying.bound_bytes - in_place.bound_bytes == state


# ---------------------------------------------------------------------------- capture
def _tiny(nodes, inputs, outputs, inits=()) -> Graph:
    g = helper.make_graph(nodes, "t", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return load_graph(m)


def test_zoo_steps_have_nothing_that_blocks_capture():
    for name in ("mlp", "gpt2", "resnet18"):
        assert capture_blockers(_step(name)) == [], name


def test_capture_blockers_name_the_node_and_the_reason():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    rnd = _tiny([helper.make_node("RandomUniformLike", ["x"], ["r"], name="noise"),
                 helper.make_node("Add", ["x", "r"], ["y"])], [x], [y])
    assert any("'noise'" in b and "RandomUniformLike" in b for b in capture_blockers(rnd))
    dyn = _tiny([helper.make_node("Relu", ["x"], ["y"])], [x], [y])
    dyn.info["x"] = TensorInfo(TensorProto.FLOAT, (-1,))   # load_graph binds every dim
    assert any("'x'" in b and "static shape" in b for b in capture_blockers(dyn))
    ratio = onnx.numpy_helper.from_array(np.array(0.5, np.float32), "ratio")
    train = onnx.numpy_helper.from_array(np.array(True), "train")
    drop = _tiny([helper.make_node("Dropout", ["x", "ratio", "train"], ["y"], name="drop")],
                 [x], [y], [ratio, train])
    assert any("'drop'" in b for b in capture_blockers(drop))
    # load_graph folds or refuses control flow; a pass could still bring an If in.
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "b", [],
                               [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4])])
    flow = _tiny([helper.make_node("Relu", ["x"], ["y"])], [x], [y])
    flow.nodes.append(helper.make_node("If", ["c"], ["w"], name="choose",
                                       then_branch=branch, else_branch=branch))
    assert any("'choose'" in b and "control flow" in b for b in capture_blockers(flow))
    # ORT's CUDA Concat takes at most 32 inputs during capture (an H200 refused 49).
    wide = _tiny([helper.make_node("Concat", ["x"] * 33, ["y"], name="cat", axis=0)], [x],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [132])])
    assert any("'cat'" in b and "33 inputs" in b for b in capture_blockers(wide))
    narrow = _tiny([helper.make_node("Concat", ["x"] * 32, ["y"], axis=0)], [x],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [128])])
    assert capture_blockers(narrow) == []


def test_the_profile_names_nodes_that_ran_off_the_sessions_provider():
    from memcc.backend.profile_order import off_provider_nodes

    def ev(name, provider):
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": 1,
                "args": {"provider": provider}}

    events = [ev("a", "CUDAExecutionProvider"), ev("shape", "CPUExecutionProvider"),
              ev("copy", "CUDAExecutionProvider"), ev("shape", "CPUExecutionProvider"),
              {"cat": "Session", "name": "model_run"}]
    assert off_provider_nodes(events, "CUDAExecutionProvider") == [
        "shape (CPUExecutionProvider)"]
    assert off_provider_nodes(events, "CPUExecutionProvider") == [
        "a (CUDAExecutionProvider)", "copy (CUDAExecutionProvider)"]


def test_a_deterministic_cuda_step_has_no_atomic_scatter_left():
    """What ``--deterministic`` runs on CUDA, built here (the rewrite is graph to graph)."""
    from memcc.backend.device_step import step_for_provider
    from memcc.passes.providers.deterministic_scatter import is_accumulating_scatter

    graph = _step("gpt2")
    plain, changed = step_for_provider(graph, "cpu", deterministic=True)
    assert plain is graph and not changed
    fast, _ = step_for_provider(graph, "cuda")
    det, changed = step_for_provider(graph, "cuda", deterministic=True)
    assert changed
    assert any(is_accumulating_scatter(n) for n in fast.nodes)
    feeds = synthetic_feeds(graph, seed=0)
    a = _device_step(fast, DEVICE).run(feeds).loss
    b = _device_step(det, DEVICE).run(feeds).loss
    assert abs(a - b) <= 1e-5 * abs(a)
