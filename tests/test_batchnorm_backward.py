"""Training-mode BatchNorm's backward in the fewest nodes
(memcc/frontend/gradients/batchnorm_backward.py).

Checked against the general rule it replaces (``gradients/nn.py``, taken when the new form
does not apply) on the zoo ResNet-18, at 1 and 2 intra-op threads. Tolerance: only the last
step of ``dx`` is rounded differently (ORT's BatchNormalization folds its per-channel
operands first), so every output stays within 1e-5 of its largest magnitude here (measured
at most 1.5e-6; the difference grows with depth: 5.5e-6 on the zoo ResNet-50 at batch 4,
64 px, 1.1e-5 at batch 8); what does not depend on any ``dx`` (the loss, the running
statistics, the last BatchNorm's scale and bias updates) is the same bits.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from threads import run_once

from memcc.backend.runner import synthetic_feeds
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.gradients import batchnorm_backward
from memcc.frontend.load import load_graph
from memcc.step import GRAD_OF_PROP, node_props
from models import build_model

RTOL = 1e-5


@pytest.fixture(scope="module")
def steps():
    fwd = load_graph(build_model("resnet18", batch=4, resolution=32, width=8))
    new = build_training_step(fwd, BuildOptions())
    with mock.patch.object(batchnorm_backward, "applies", lambda *_: False):
        old = build_training_step(fwd, BuildOptions())
    return old, new


def _backward_nodes(step, forward_node: str) -> list[str]:
    return [n.op_type for n in step.nodes if n.op_type != "Constant" and n.metadata_props
            and node_props(n).get(GRAD_OF_PROP) == forward_node]


def test_fourteen_nodes_per_batchnorm_instead_of_21(steps):
    old, new = steps
    assert len(_backward_nodes(old, "layer1.0.bn2")) == 21
    ops = _backward_nodes(new, "layer1.0.bn2")
    assert len(ops) == 14 and ops.count("BatchNormalization") == 2
    assert "Reciprocal" not in ops and "Sqrt" not in ops


def test_outputs_match_the_general_rule_at_1_and_2_threads(steps):
    old, new = steps
    feeds = {k: v for k, v in synthetic_feeds(old, 0).items() if k not in old.initializers}
    last_bn = "layer4.1.bn2"
    exact = {o for o in old.outputs if "running_" in o or o.startswith(f"{last_bn}.")
             or o.startswith("fc.")} | {old.outputs[0]}
    for threads in (1, 2):
        want, got = run_once(old, feeds, threads), run_once(new, feeds, threads)
        assert set(want) == set(got)
        for name, value in want.items():
            if name in exact:
                assert np.array_equal(value, got[name]), (threads, name)
                continue
            a, b = value.astype(np.float64), got[name].astype(np.float64)
            scale = max(float(np.max(np.abs(a))), 1e-30)
            assert float(np.max(np.abs(a - b))) <= RTOL * scale, (threads, name)
