"""In-place updates as analyses: which updates alias, the early update order, and liveness
counting the aliasing; then the runner measuring that arrangement."""

from __future__ import annotations

import numpy as np
import pytest

from memcc.backend.runner import RunRequest, run_steps
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.frontend.update_groups import GROUP_PREFIX
from memcc.passes.analysis.arrange import UPDATES_EARLY, arrange_step
from memcc.passes.analysis.inplace import analyze_in_place
from memcc.passes.analysis.liveness import allocation_bytes, analyze_liveness
from memcc.passes.analysis.update_schedule import schedule_updates_early
from memcc.step import Role, TrainingStep
from models import mlp


def _step(optimizer: str = "sgd", **size):
    dims = dict(batch=2, in_features=64, width=64, depth=3, num_classes=8) | size
    return build_training_step(load_graph(mlp.build(**dims)), BuildOptions(optimizer=optimizer))


@pytest.mark.parametrize("optimizer, per_param", [("sgd", 2), ("adamw", 3)])
def test_liveness_counts_in_place_outputs_as_sharing_their_inputs(optimizer, per_param):
    step = _step(optimizer)
    spec = TrainingStep.of(step)
    aliased = analyze_in_place(step, spec.state).aliased
    assert set(aliased) == set(spec.state)
    copying = analyze_liveness(step)
    inplace = analyze_liveness(step, in_place=aliased)
    param_bytes = sum(allocation_bytes(step.info[p].nbytes) for p in spec.parameters)
    # At the end of the step the copying run holds a second copy of every parameter and of
    # each optimizer state; in place none (adamw's step counter is 4 bytes on top).
    saved = copying.live_after[-1] - inplace.live_after[-1]
    assert param_bytes * per_param <= saved <= param_bytes * per_param + 64
    assert inplace.peak_bytes <= copying.peak_bytes


def test_without_aliases_liveness_is_unchanged():
    step = _step()
    assert analyze_liveness(step, in_place={}).peak_bytes == analyze_liveness(step).peak_bytes


def test_early_updates_follow_each_gradient_and_keep_the_backward_order():
    step = _step()
    spec = TrainingStep.of(step)
    sched = schedule_updates_early(step, spec)
    assert sched.moved, sched.reason
    names = [n.name for n in sched.nodes]
    roles = spec.roles
    backward = [n.name for n in step.nodes if roles[n.name] is not Role.UPDATE]
    assert [n for n in names if roles[n] is not Role.UPDATE] == backward
    first_update = min(names.index(n.name) for n in spec.nodes_with_role(Role.UPDATE))
    last_backward = max(names.index(n) for n in backward)
    assert first_update < last_backward  # updates now run inside the backward pass
    moved = step.copy()
    moved.set_nodes(list(sched.nodes))
    assert set(analyze_in_place(moved, spec.state).aliased) == set(spec.state)


def test_a_cone_computes_the_decayed_parameter_just_before_it_is_read():
    """AdamW's ``(1 - lr * wd) * P`` reads nothing the cone computes; held from the start of
    the cone it would be one more parameter-sized buffer at the cone's peak."""
    step = _step("adamw")
    spec = TrainingStep.of(step)
    sched = schedule_updates_early(step, spec)
    assert sched.moved, sched.reason
    order = sched.nodes
    producer = {o: j for j, n in enumerate(order) for o in n.output}
    # every parameter's own update, and each group's over its joined vector
    updated = [n.output[0][:-len(".new")] for n in order if n.op_type == "Sub"
               and n.output[0].endswith(".new") and spec.roles.get(n.name) is Role.UPDATE]
    assert {p for p in spec.parameters if f"{p}.new" in producer} & set(updated)
    assert any(p.startswith(GROUP_PREFIX) for p in updated)
    for p in updated:
        sub = order[producer[f"{p}.new"]]
        decayed = order[producer[sub.input[0]]]
        assert decayed.op_type == "Mul" and p in decayed.input
        between = order[producer[sub.input[0]] + 1:producer[f"{p}.new"]]
        assert all(n.op_type in ("Mul", "Constant") for n in between), \
            [n.op_type for n in between]


def test_arrangement_moves_updates_only_when_the_predicted_peak_does_not_rise():
    step = _step(width=256, batch=1)  # parameters dominate: early updates lower the peak
    spec = TrainingStep.of(step)
    early = arrange_step(step, spec)
    kept = arrange_step(step, spec, early_updates=False)
    assert early.schedule == UPDATES_EARLY
    assert early.prediction.peak_bytes < kept.prediction.peak_bytes
    small = _step(width=8, batch=64)  # activations dominate: moving would not help
    spec = TrainingStep.of(small)
    arr = arrange_step(small, spec)
    assert arr.prediction.peak_bytes <= arrange_step(small, spec, early_updates=False
                                                     ).prediction.peak_bytes


def test_runner_in_place_is_bit_identical_and_measured_like_the_prediction(tmp_path):
    from memcc.backend.onnx_file import save_graph

    # 0.8M parameters: large buffers are whole mmaps, so the measurement is exact enough
    path = save_graph(_step("adamw", width=512, batch=1), tmp_path / "step.onnx")
    copying = run_steps(path, RunRequest(steps=2, separate_timing=False, in_place=False))
    inplace = run_steps(path, RunRequest(steps=2, separate_timing=False))  # in place: the default
    assert copying.losses == inplace.losses
    assert inplace.order_matches_plan
    assert inplace.predicted_peak_bytes < copying.predicted_peak_bytes
    # The same kernels move the same bytes, in another order (issue 30's per-step counts).
    assert inplace.to_json()["kernels_per_step"] == copying.to_json()["kernels_per_step"] > 0
    assert (inplace.to_json()["bytes_moved_per_step"]
            == copying.to_json()["bytes_moved_per_step"] > 0)
    if inplace.measured_peak_bytes is not None:  # measured on Linux
        ratio = inplace.measured_peak_bytes / inplace.predicted_peak_bytes
        assert 0.95 < ratio < 1.1, ratio
        assert inplace.measured_peak_bytes < copying.measured_peak_bytes
    assert np.isfinite(inplace.losses).all()
