"""Cost model: estimates scale with work, measurements add up to the step and are cached."""

from __future__ import annotations

import pytest

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes import cost_model
from memcc.passes.cost_model import (
    DeviceRates,
    analytic_costs,
    measured_costs,
    node_flops_bytes,
    unit_costs,
)
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
    monkeypatch.setattr(cost_model, "CACHE_DIR", tmp_path)
    first = measured_costs(step, "cpu", runs=2)
    assert first.source == "measured"
    assert first.total(step) > 0
    assert list(tmp_path.glob("costs/*.json"))
    again = measured_costs(step, "cpu", runs=2)
    assert dict(again.seconds) == dict(first.seconds)  # from the cache, not re-measured
