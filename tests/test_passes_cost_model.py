"""Cost model: estimates scale with work, measurements add up to the step and are cached,
and nodes nobody measured (clones, new nodes) get a calibrated time, never 0."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from memcc.backend import profiling
from memcc.backend.profiling import measured_costs
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.analysis import cost_model as cost_model_module
from memcc.passes.analysis.cost_model import (
    NOMINAL_CPU,
    Calibration,
    CostModel,
    DeviceRates,
    analytic_costs,
    analytic_estimate,
    node_flops_bytes,
    unit_costs,
)
from memcc.passes.lowering.recompute import apply_recompute
from memcc.passes.plan import Plan, StepStructure
from models import build_model

RATES = DeviceRates(1e10, 1e10, 1e-6, "test")


@pytest.fixture(scope="module")
def step():
    return build_training_step(load_graph(build_model("mlp", batch=256, width=256, depth=3)),
                               BuildOptions())


def test_flops_follow_the_matmul_shapes(step):
    mm = next(n for n in step.nodes if n.op_type in ("MatMul", "Gemm"))
    flops, nbytes = node_flops_bytes(step, mm)
    a, b = (step.info[i] for i in mm.input[:2])
    out = step.info[mm.output[0]]
    k = a.shape[-1]  # the zoo's first layer is not transposed on its input
    assert flops == pytest.approx(2 * out.numel * k, rel=0.01)
    assert nbytes >= a.nbytes + b.nbytes + out.nbytes


def test_aliasing_ops_cost_nothing_and_unit_costs_count_nodes(step):
    reshape = next((n for n in step.nodes if n.op_type == "Reshape"), None)
    if reshape is not None:
        assert analytic_costs(step, RATES).of(reshape) == 0.0
    assert unit_costs(step).total(step) == len(step.nodes)


def test_measured_costs_add_up_to_the_step_and_are_cached(step, tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "CACHE_DIR", tmp_path)
    first = measured_costs(step, "cpu", runs=2)
    assert first.source == "measured"
    assert first.total(step) > 0
    assert list(tmp_path.glob("costs/*.json"))
    again = measured_costs(step, "cpu", runs=2)
    assert dict(again.seconds) == dict(first.seconds)  # from the cache, not re-measured


def test_auto_estimates_where_measuring_would_outrun_the_time_limit(step, tmp_path,
                                                                     monkeypatch):
    """--cost auto measures node times (the step run 7 times, outside the planner's limit)
    only where that is estimated to take at most a quarter of --time-limit, or the step
    was measured before; else it estimates them and says why, naming --cost measured."""
    from memcc.compiler.costing import node_costs
    from memcc.compiler.options import CompileOptions

    monkeypatch.setattr(profiling, "CACHE_DIR", tmp_path)
    said: list[str] = []
    tight = CompileOptions(budget="min", time_limit=1e-6)
    costs, summary = node_costs(step, tight, said.append, None)
    assert costs.source == "analytic" and "--cost measured" in summary["note"]
    assert said and said[0].startswith("--cost auto: measuring node times would run the step 7")
    costs, summary = node_costs(step, CompileOptions(budget="min", time_limit=60), said.append,
                                None)
    assert costs.source == "measured" and "note" not in summary
    costs, _ = node_costs(step, tight, said.append, None)   # measured before: the cache
    assert costs.source == "measured" and len(said) == 1


def _fake_measured(step, factor_of) -> CostModel:
    """A "measured" model whose times are a known multiple of the roofline, per op type."""
    seconds = {n.name: analytic_estimate(step, n, NOMINAL_CPU) * factor_of(n.op_type)
               for n in step.nodes}
    return CostModel(seconds, "measured", "cpu")


def _new_gemm(step) -> onnx.NodeProto:
    """A Gemm the model has never seen, over shapes that exist in the step."""
    mm = next(n for n in step.nodes if n.op_type == "Gemm")
    node = onnx.NodeProto()
    node.CopyFrom(mm)
    node.name = "brand_new_gemm"
    return node


def test_calibration_is_fitted_on_the_measured_nodes(step):
    """Per op type: measured over estimated time; ops never measured: the same over all."""
    costs = _fake_measured(step, lambda op: 3.0 if op == "Gemm" else 0.5)
    cal = costs.calibration_for(step)
    assert cal.samples > 0
    assert cal.factor("Gemm") == pytest.approx(3.0)
    assert cal.factor("Add") == pytest.approx(0.5)
    never_seen = cal.factor("Conv")  # no Conv in an MLP: the ratio over all nodes
    assert never_seen == pytest.approx(cal.overall)
    assert 0.5 <= never_seen <= 3.0
    # Fitting is what ``Calibration.fit`` does, stated explicitly by ``calibrated``.
    fixed = costs.calibrated(step)
    assert fixed.calibration == Calibration.fit(step, costs.seconds, NOMINAL_CPU)


def test_calibrated_estimates_add_up_to_the_measured_time(step):
    """With per-node noise, the factor of an op type makes its nodes' calibrated estimates
    sum to their measured time (the large nodes, where the time is, are not underpriced)."""
    noise = iter([0.5, 2.0, 1.0, 3.0, 0.7] * 100)
    seconds = {n.name: analytic_estimate(step, n, NOMINAL_CPU) * next(noise)
               for n in step.nodes}
    cal = CostModel(seconds, "measured", "cpu").calibration_for(step)
    gemms = [n for n in step.nodes if n.op_type == "Gemm"]
    estimated = sum(analytic_estimate(step, n, NOMINAL_CPU) * cal.factor("Gemm") for n in gemms)
    assert estimated == pytest.approx(sum(seconds[n.name] for n in gemms))


def test_an_unseen_node_gets_a_positive_calibrated_time(step):
    costs = _fake_measured(step, lambda op: 3.0 if op == "Gemm" else 0.5)
    node = _new_gemm(step)
    assert costs.of(node) == 0.0  # the plain lookup knows nothing about it...
    priced = costs.price(node, step)  # ...the model does: estimate x the Gemm factor
    assert priced > 0
    assert priced == pytest.approx(3.0 * analytic_estimate(step, node, NOMINAL_CPU))
    assert costs.of(node, step) == priced


def test_a_recompute_clone_costs_what_its_original_measured(step):
    st = StepStructure.of(step)
    # A Gemm feeds a saved Relu: recomputing both re-runs the Gemm as ``<name>.rc``.
    relu = next(n for n in step.nodes if n.op_type == "Relu" and n.output[0] in st.saved)
    mm = next(n for n in step.nodes if relu.input[0] in n.output)
    lowered = apply_recompute(step, Plan(frozenset({mm.name, relu.name})), st).graph
    clone = next(n for n in lowered.nodes if n.name.startswith(mm.name + ".rc"))
    costs = _fake_measured(step, lambda op: 2.0)
    assert clone.name not in costs.seconds
    assert costs.seconds[mm.name] > 0
    assert costs.price(clone, lowered) == pytest.approx(costs.seconds[mm.name])
    renamed = onnx.NodeProto()
    renamed.CopyFrom(mm)
    renamed.name = mm.name + ".rc_3"  # a second clone of the same node
    assert costs.price(renamed, lowered) == pytest.approx(costs.seconds[mm.name])


def test_every_unseen_node_that_does_work_costs_more_than_zero(step):
    """Price a whole lowered step with a model that has no entry for any node: only
    aliasing ops (no kernel in ORT) may come out at 0."""
    measured = _fake_measured(step, lambda op: 1.7)
    nothing_known = CostModel({}, "measured", "cpu", calibration=measured.calibrated(step)
                              .calibration)
    for node in step.nodes:
        t = nothing_known.price(node, step)
        flops, nbytes = node_flops_bytes(step, node)
        if flops or nbytes:
            assert t > 0, node.name
    # Analytic models price unseen nodes with their own rates (factor 1); unit models as 1.
    node = _new_gemm(step)
    assert analytic_costs(step, RATES).price(node, step) == \
        pytest.approx(analytic_estimate(step, node, RATES))
    assert unit_costs(step).price(node, step) == 1.0
    # Estimates that came without their rates are calibrated like measurements.
    scaled = {n.name: 3.0 * analytic_estimate(step, n, NOMINAL_CPU) for n in step.nodes}
    assert CostModel(scaled, "analytic", "cpu").price(node, step) == \
        pytest.approx(3.0 * analytic_estimate(step, node, NOMINAL_CPU))


def test_aliasing_ops_are_priced_from_measured_ops_of_their_type(step):
    """The roofline sees no work in a Reshape; a measured Reshape says what one costs."""
    reshape = next((n for n in step.nodes if n.op_type == "Reshape"), None)
    if reshape is None:
        pytest.skip("this MLP has no Reshape")
    seconds = {n.name: 1e-6 for n in step.nodes}
    costs = CostModel(seconds, "measured", "cpu")
    unseen = onnx.NodeProto()
    unseen.CopyFrom(reshape)
    unseen.name = "another_reshape"
    assert costs.price(unseen, step) == pytest.approx(1e-6)


def test_a_copy_to_the_host_is_priced_by_its_bytes(step):
    """A swap copy (a node no profile has seen) costs its bytes at the calibrated rate."""
    costs = _fake_measured(step, lambda op: 2.0)
    saved = next(n.output[0] for n in step.nodes if n.op_type == "Relu")
    copy = onnx.helper.make_node("MemcpyToHost", [saved], [saved], name="copy_out")
    flops, nbytes = node_flops_bytes(step, copy)
    assert flops == 0 and nbytes == 2 * step.info[saved].nbytes
    assert costs.price(copy, step) == pytest.approx(
        2.0 * analytic_estimate(step, copy, NOMINAL_CPU))
    assert costs.price(copy, step) > 0


def test_the_planning_passes_run_nothing():
    """Measuring runs ORT and lives in backend/; no module under passes/ imports it."""
    passes = Path(cost_model_module.__file__).parent
    offenders = [str(p.relative_to(passes)) for p in sorted(passes.rglob("*.py"))
                 if "memcc.backend" in p.read_text()]
    assert offenders == []


def test_a_calibration_made_on_a_loaded_machine_is_made_again_once_it_is_quieter(monkeypatch):
    """A calibration cached under load (two processes per core waiting) priced every later
    step 2-6x too slow; it is now made again where the load has halved, and after a week."""
    import time

    from memcc.backend import profiling

    now = time.time()
    monkeypatch.setattr(profiling, "_load_per_core", lambda: 0.3)
    assert profiling._stale({"calibrated_at": now, "load_per_core": 2.0})
    assert not profiling._stale({"calibrated_at": now, "load_per_core": 0.4})
    monkeypatch.setattr(profiling, "_load_per_core", lambda: 1.5)
    assert not profiling._stale({"calibrated_at": now, "load_per_core": 2.0})
    assert profiling._stale({"calibrated_at": now - 8 * 24 * 3600, "load_per_core": 0.1})
    assert profiling._stale({"flops_per_s": 1.0})    # undated: a memcc before this one
