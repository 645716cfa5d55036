"""The convolution weight gradient's working set, and the floor it sets for ``--budget min``.

The default weight gradient (``memcc/frontend/gradients/nn.py``) is a Conv over batch-swapped
copies of the input x and of the output gradient gy. Issue 31: on a transformers ResNet
exported in train mode, ``--budget min`` stopped at the stem's weight gradient, where x
(the image, a graph input, never freed), its copy, gy and gy's copy were all live at once.
The rule now copies gy first: gy's other readers (the input and bias gradients) come
before, so gy is freed before x's copy is made, and at most three of the four are live.
"""

from __future__ import annotations

import json

from exports import export
from typer.testing import CliRunner

from memcc.cli import app
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.analysis.liveness import analyze_liveness
from memcc.passes.lowering.variant_substitution import rule_nodes
from memcc.step import rule_io


def test_weight_gradient_frees_gy_before_copying_x():
    """In every k x k Conv's default rule of a train-mode ResNet export (stem, 3x3 and
    strided layers), gy's copy is made first and gy's buffer is gone when x's copy is born,
    so gy, its copy, x and x's copy are never live together."""
    path, _, _, dims = export("hf_resnet", "torchscript", training=True)
    step = build_training_step(load_graph(path, {**dims, "batch": 4}), BuildOptions())
    live = analyze_liveness(step)
    forward = {n.name: n for n in step.nodes}
    checked = 0
    for fwd_name, nodes in rule_nodes(step).items():
        node = forward[fwd_name]
        if node.op_type != "Conv" or list(step.info[node.input[1]].shape[2:]) == [1, 1]:
            continue
        gy = rule_io(node)[0][0]
        copies = {n.input[0]: n.output[0] for n in nodes if n.op_type == "Transpose"}
        x_copy, gy_copy = copies[node.input[0]], copies[gy]
        assert live.values[gy_copy].birth < live.values[x_copy].birth, fwd_name
        gy_buffer = live.values[gy].buffer
        assert live.values[gy_buffer].death < live.values[x_copy].birth, fwd_name
        checked += 1
    assert checked == 3  # the stem and the 3x3 convolution of each stage


def test_train_mode_resnet_export_floor_drops_and_verifies(tmp_path):
    """``memcc compile --budget min`` on the same export at batch 8: before the reordering
    it stopped at the stem weight gradient's Transpose at 75.7% of the step as built (each
    batch size tried, 8 and 16, stayed above 74%); now 70.3%. ``--verify`` runs the plan
    against the step as built: the same gradients and updates (within the plan's stated
    tolerance), and tests/test_exports_grad.py holds the step as built to torch autograd."""
    path, _, _, _ = export("hf_resnet", "torchscript", training=True)
    out, rep = tmp_path / "out.onnx", tmp_path / "out.json"
    r = CliRunner().invoke(app, [
        "compile", str(path), "--dim", "batch=8", "--budget", "min", "-o", str(out),
        "--report", str(rep), "--cost", "analytic", "--time-limit", "20", "--verify",
        "--batch-chunks", "1"])   # the unchunked step's floor (tests/test_batch_chunks.py)
    assert r.exit_code == 0, r.output
    report = json.loads(rep.read_text())
    ratio = report["plan"]["peak_bytes"] / report["baseline"]["peak_bytes"]
    assert ratio < 0.73, (ratio, report["plan"]["peak_node"])
    v = report["verification"]
    variants = report["plan"]["variants"]
    expected = "bit-identical" if variants["exactness"] == "exact" else \
        f"within relative {variants['tolerance']:g}"
    assert v["ok"] and v["order_matches_plan"] and v["comparison"].startswith(expected), v


def test_smallest_plan_is_judged_as_trained_and_its_budget_fits(tmp_path):
    """The search judges plans in the order it is given (updates moved early for the step
    as built); ``--budget min`` also judges the plan recomputing every saved value
    (with the chosen variants) in the order ``memcc train`` runs, updates early
    (``compiler.planning._recompute_all``), and takes it where it needs less: on this
    export at batch 8, 70.5% -> 68.9% of the step as built. The budget it reports is then
    one compile accepts (the refusal path judges the same candidate)."""
    path, _, _, _ = export("hf_resnet", "torchscript", training=True)
    rep = tmp_path / "min.json"
    common = ["compile", str(path), "--dim", "batch=8", "--cost", "analytic",
              "--time-limit", "20", "-o", str(tmp_path / "out.onnx"), "--batch-chunks", "1"]
    r = CliRunner().invoke(app, [*common, "--budget", "min", "--report", str(rep)])
    assert r.exit_code == 0, r.output
    report = json.loads(rep.read_text())
    # The plan recomputing everything as trained, or a search's plan of the same peak at
    # less time (since the variant kinds on rebuilt-again plans are tried by what they
    # free: sqrtn+polish, 68.9% at +3.8% against +6.5%).
    ratio = report["plan"]["peak_bytes"] / report["baseline"]["peak_bytes"]
    assert ratio < 0.70, (ratio, report["plan"]["picked_strategy"])
    again = tmp_path / "again.json"
    r = CliRunner().invoke(app, [*common, "--budget", str(report["budget_bytes"]),
                                 "--report", str(again)])
    assert r.exit_code == 0, r.output
    assert json.loads(again.read_text())["plan"]["peak_bytes"] <= report["budget_bytes"]


def test_recomputing_everything_as_trained_lowers_the_step_as_built():
    """``trained_smallest.recompute_all_as_trained``: from a plan that keeps saved values
    live at its peak (the step as built), the plan recomputing every saved value it may,
    judged as trained and shed where the headroom allows, needs a smaller budget; from a
    plan that already recomputes everything there is nothing to judge."""
    from memcc.compiler.options import CompileOptions
    from memcc.compiler.trained_smallest import everything_as_trained, recompute_all_as_trained
    from memcc.passes.analysis.cost_model import unit_costs
    from memcc.passes.plan import Plan, StepStructure, nothing_saveable
    from memcc.passes.planning.simulate import SimulationRules, simulate

    path, _, _, dims = export("hf_resnet", "torchscript", training=True)
    graph = build_training_step(load_graph(path, {k: 8 for k in dims}), BuildOptions())
    st, costs = StepStructure.of(graph), unit_costs(graph)
    rules = SimulationRules("cpu", early_updates=True)
    as_built = simulate(graph, Plan(), costs, st, rules)
    opts = CompileOptions(budget="min")
    got = recompute_all_as_trained(graph, as_built, costs, opts, st)
    assert got is not None and got.peak_bytes < as_built.peak_bytes
    assert got.plan.recompute <= nothing_saveable(st).recompute
    everything = everything_as_trained(graph, as_built, costs, opts, st)
    assert everything is not None and everything.plan.recompute == nothing_saveable(st).recompute
    assert everything_as_trained(graph, everything, costs, opts, st) is None
