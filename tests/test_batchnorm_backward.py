"""Training-mode BatchNorm's backward in the fewest nodes
(memcc/frontend/gradients/batchnorm_backward.py).

Checked against the general rule it replaces (``gradients/nn.py``, taken when the new form
does not apply) on the zoo ResNet-18, at 1 and 2 intra-op threads. Tolerance: only the last
step of ``dx`` is rounded differently (ORT's BatchNormalization folds its per-channel
operands first), so every output stays within 1e-5 of its largest magnitude here (measured
at most 1.5e-6; the difference grows with depth: 5.5e-6 on the zoo ResNet-50 at batch 4,
64 px, 1.1e-5 at batch 8); what does not depend on any ``dx`` (the loss, the running
statistics, the last BatchNorm's scale and bias updates) is the same bits.

The projection ``gy - xhat * sum(gy * xhat) / n`` is written with one more inference-mode
BatchNormalization (fed a variance of ``n * n``, no epsilon) where it took a Mul, a Reshape,
a Mul and an Add: checked bit for bit against that form, on one node for many counts and on
a whole step whose counts are not powers of two, at 1 and 2 threads.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from threads import mismatches, run_once

from memcc.backend.runner import session_graph, synthetic_feeds
from memcc.backend.session import SessionSettings, make_session
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


def test_nine_nodes_per_batchnorm_instead_of_21(steps):
    old, new = steps
    assert len(_backward_nodes(old, "layer1.0.bn2")) == 21
    ops = _backward_nodes(new, "layer1.0.bn2")
    assert len(ops) == 9 and ops.count("BatchNormalization") == 3
    assert "ReduceMean" not in ops and ops.count("Sub") == 1
    assert "Reciprocal" not in ops and "Sqrt" not in ops and "Reshape" not in ops


def _projection_model(n: int, channels: int) -> onnx.ModelProto:
    """The new projection (``new``) and the four-node one it replaces (``old``) on one
    input, as ``_less_projection`` writes them."""
    init = [numpy_helper.from_array(np.zeros(channels, np.float32), "zeros"),
            numpy_helper.from_array(np.full(channels, np.float32(n) * np.float32(n)), "sq"),
            numpy_helper.from_array(np.array(-1.0 / n, np.float32), "k"),
            numpy_helper.from_array(np.array([1, channels, 1, 1], np.int64), "view")]
    nodes = [helper.make_node("BatchNormalization", ["xhat", "s", "zeros", "zeros", "sq"],
                              ["p"], epsilon=0.0),
             helper.make_node("Sub", ["gy", "p"], ["new"]),
             helper.make_node("Mul", ["s", "k"], ["c"]),
             helper.make_node("Reshape", ["c", "view"], ["cv"]),
             helper.make_node("Mul", ["xhat", "cv"], ["q"]),
             helper.make_node("Add", ["gy", "q"], ["old"])]
    io = [helper.make_tensor_value_info(k, TensorProto.FLOAT, None)
          for k in ("xhat", "s", "gy", "new", "old")]
    graph = helper.make_graph(nodes, "projection", io[:3], io[3:], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_projection_by_the_count_is_the_four_node_forms_bits(threads):
    """ORT's kernel folds ``scale * (1 / sqrt(n * n))`` first and adds 0: the same float32
    product as ``scale * (-1 / n)`` up to its sign, for every count tried."""
    rng = np.random.default_rng(0)
    shape = (4, 16, 9, 9)
    counts = [*range(1, 3000, 37), 6272, 25088, 100352, 401408]
    assert all(batchnorm_backward._count_root_is_exact(n) for n in counts)
    for n in counts:
        sess = make_session(_projection_model(n, 16), "cpu",
                            SessionSettings(intra_op_threads=threads))
        feeds = {"xhat": rng.standard_normal(shape, dtype=np.float32),
                 "s": (rng.standard_normal(16) * 1e3).astype(np.float32),
                 "gy": rng.standard_normal(shape, dtype=np.float32)}
        new, old = sess.run(["new", "old"], feeds)
        assert np.array_equal(new, old), n


def test_a_step_with_the_projection_by_the_count_gives_the_old_forms_bits():
    """Counts that are not powers of two (batch 3 at 56 px: 2,352 down to 12 per channel):
    every output of the step the same bits as with the four-node projection, 1 and 2
    threads."""
    fwd = load_graph(build_model("resnet18", batch=3, resolution=56, width=8))
    new = build_training_step(fwd, BuildOptions())
    with mock.patch.object(batchnorm_backward, "_count_root_is_exact", lambda _: False):
        old = build_training_step(fwd, BuildOptions())
    def kernels(step):
        return sum(n.op_type != "Constant" for n in step.nodes)
    assert kernels(old) - kernels(new) == 2 * 20  # a Mul and a Reshape per BatchNorm
    feeds = {k: v for k, v in synthetic_feeds(old, 0).items() if k not in old.initializers}
    for threads in (1, 2):
        assert not mismatches(run_once(old, feeds, threads), run_once(new, feeds, threads))


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


def _statistics_nodes(step) -> list[onnx.NodeProto]:
    return [n for n in step.nodes if n.op_type == "BatchNormalization"
            and any(a.name == "training_mode" and a.i for a in n.attribute)
            and n.metadata_props and node_props(n).get(GRAD_OF_PROP)]


def test_the_statistics_node_writes_into_buffers_no_other_node_reads(steps):
    """ORT's CPU kernel writes a training-mode BatchNormalization's running outputs into its
    running inputs' buffers, so the backward's statistics node reads two made for it alone
    (a Split of zeros per node), and one session runs the step three times to the same bits,
    at 1 and 2 threads. Fed the rule's shared ``zeros`` instead (as a first version was), the
    statistics of one layer overwrote the zeros another reads: conv weights 1e2-1e4 off."""
    _, new = steps
    stats = _statistics_nodes(new)
    assert len(stats) == 20
    readers: dict[str, int] = {}
    for n in new.nodes:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    producers = new.producers()
    for n in stats:
        assert all(readers[b] == 1 and producers[b].op_type == "Split" for b in n.input[3:5])
        assert len(n.output) == 3 and float(next(
            a.f for a in n.attribute if a.name == "momentum")) == 0.0
    feeds = {k: v for k, v in synthetic_feeds(new, 0).items() if k not in new.initializers}
    names = list(new.outputs)
    graph, values = session_graph(new)
    for threads in (1, 2):
        sess = make_session(graph.to_model(), "cpu", SessionSettings(intra_op_threads=threads))
        runs = [dict(zip(names, sess.run(names, {**values, **feeds}), strict=True))
                for _ in range(3)]
        assert not mismatches(runs[0], runs[1]) and not mismatches(runs[0], runs[2])
        assert not mismatches(runs[0], run_once(new, feeds, threads))


def test_the_step_gives_the_same_bits_under_onnxruntimes_default_optimizations(steps):
    """A user may open the step in a plain ``InferenceSession`` (graph optimizations on):
    each statistics node's buffers are split from a constant of its own values, so that
    common-subexpression elimination merges no two of them into one buffer both nodes write
    (with zeros for all, the outputs were 0.53 relative off)."""
    import onnxruntime as ort

    _, new = steps
    values = [float(numpy_helper.to_array(n.attribute[0].t).max()) for n in new.nodes
              if n.op_type == "Constant" and batchnorm_backward.BUFFERS in n.output[0]]
    assert len(values) == len(set(values)) == 20
    feeds = {k: v for k, v in synthetic_feeds(new, 0).items() if k not in new.initializers}
    graph, held = session_graph(new)
    names = list(new.outputs)
    for threads in (1, 2):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        sess = ort.InferenceSession(graph.to_model().SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])
        want = run_once(new, feeds, threads)
        for _ in range(2):
            got = dict(zip(names, sess.run(names, {**held, **feeds}), strict=True))
            assert not mismatches(want, got), threads


def test_a_variant_that_writes_the_rule_again_keeps_each_nodes_constant_its_own(steps):
    """``bf16_saved`` runs the default rule again on a twin of the node (lowering, after
    build): its statistics node takes values no constant of the step holds, so the lowered
    step also gives the same bits under ORT's default optimizations."""
    import onnxruntime as ort

    from memcc.passes.lowering.variant_substitution import apply_variants
    from memcc.passes.plan import Plan

    _, new = steps
    bns = ["layer1.0.bn1", "layer1.0.bn2", "layer1.1.bn1", "layer1.1.bn2"]  # one width
    out = apply_variants(new, Plan(variants={b: "bf16_saved" for b in bns})).graph
    values = [float(numpy_helper.to_array(n.attribute[0].t).max()) for n in out.nodes
              if n.op_type == "Constant" and batchnorm_backward.BUFFERS in n.output[0]]
    assert len(values) == len(set(values)) == 20
    feeds = {k: v for k, v in synthetic_feeds(out, 0).items() if k not in out.initializers}
    graph, held = session_graph(out)
    options = ort.SessionOptions()  # graph optimizations on, as by default
    options.intra_op_num_threads = 2
    sess = ort.InferenceSession(graph.to_model().SerializeToString(), options,
                                providers=["CPUExecutionProvider"])
    names = list(out.outputs)
    got = dict(zip(names, sess.run(names, {**held, **feeds}), strict=True))
    assert not mismatches(run_once(out, feeds, 2), got)
