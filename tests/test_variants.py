"""Operator variants against the default gradient rule and against torch autograd.

Each variant replaces a forward node's default rule (``passes/lowering/variant_substitution.py``).
Its loss and
gradients must equal the default rule's bit for bit when it is ``exact``, and lie within its
stated relative ``tolerance`` when it is ``equivalent`` (error measured per tensor as
max |variant - default| / max |default|). Every comparison runs in fresh CPU sessions at 1 and
at 2 intra-op threads (``threads.run_once``), and each family is also held to torch.

Zoo steps are built with SGD and their gradient values (``TrainingStep.gradients``) added
as outputs: with ``--optimizer none`` the build renames parameter gradients to ``P.grad``
after recording the rule's results, so rules that return a parameter gradient could not be
substituted there. Norm parameters are set to random values (scale ~ N(1, 0.3), bias ~
N(0, 0.3)): at the zoo's initial scale 1 and bias 0 the inverted norms are bit-exact, which
would test nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from gradcheck import FLOAT, grad_graph, make_model, torch_grads, upstream_weight
from onnx import helper
from threads import run_once
from torch_reference import torch_loss_and_grads

from benchmarks.variant_checks import randomize_norm_params
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.gradients.variant_rules import (
    BF16_SAVED_BATCHNORM_TOLERANCE,
    BF16_SAVED_TOLERANCE,
    CONV_CHUNKS,
)
from memcc.frontend.gradients.variants import (
    EQUIVALENT,
    EXACT,
    LOSSY,
    TIERS,
    VARIANTS,
    Variant,
    load_variants,
    lookup,
)
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import NOMINAL_CPU, analytic_costs
from memcc.passes.lowering.lower import lower
from memcc.passes.lowering.variant_substitution import (
    applicable_variants,
    apply_variants,
    rule_nodes,
)
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.planner import build_problem
from memcc.passes.planning.request import DecisionKinds
from memcc.passes.planning.simulate import simulate
from memcc.step import TrainingStep
from models import build_model, make_feeds, make_labels

THREADS = (1, 2)
Outputs = dict[str, np.ndarray]


# ---------------------------------------------------------------------------- helpers
def rel_err(got: np.ndarray, ref: np.ndarray, floor: float = 0.0) -> float:
    got64, ref64 = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = max(float(np.abs(ref64).max(initial=0.0)), floor, 1e-30)
    return float(np.abs(got64 - ref64).max(initial=0.0)) / scale


def check_variant(ref: Graph, var: Graph, feeds: dict[str, np.ndarray], names: list[str],
                  variant: Variant) -> dict[int, Outputs]:
    """The variant step's ``names`` equal the default step's (``exact``) or lie within the
    variant's tolerance (``equivalent``) at every thread count; returns its outputs."""
    base = run_once(ref, feeds, 1)
    outs = {}
    for threads in THREADS:
        out = run_once(var, feeds, threads)
        for name in names:
            a, b = out[name], base[name]
            assert np.isfinite(a).all(), f"{variant.key}: {name} not finite"
            if variant.tier == EXACT:
                assert np.array_equal(a, b), \
                    f"{variant.key} at {threads} threads: {name} differs from the default"
            else:
                err = rel_err(a, b)
                assert err <= variant.tolerance, (f"{variant.key} at {threads} threads: "
                                                  f"{name} relative error {err:.2e}")
        outs[threads] = out
    return outs


def zoo_step(model: onnx.ModelProto) -> tuple[Graph, dict[str, np.ndarray], dict[str, str]]:
    """SGD training step with every parameter's gradient added as an output."""
    g = build_training_step(load_graph(model), BuildOptions(optimizer="sgd"))
    grads = TrainingStep(g).gradients()
    g.outputs = list(g.outputs) + [v for v in dict.fromkeys(grads.values())
                                   if v not in g.outputs]
    feeds = {**make_feeds(model, seed=0), "labels": make_labels(model, seed=0)}
    return g, feeds, grads


def forward_nodes(g: Graph, op: str) -> list[str]:
    st = StepStructure.of(g)
    return [n.name for n in g.nodes if n.op_type == op and n.name in st.forward]


def lowered(g: Graph, variants: dict[str, str]) -> Graph:
    """The step with ``variants``, each of which the planner could have chosen too."""
    rules = rule_nodes(g)
    by_name = {n.name: n for n in g.nodes}
    for name, vname in variants.items():
        offered = {v.name for v in applicable_variants(g, by_name[name], rules)}
        assert vname in offered, f"{name}: {vname} not applicable (offered: {offered})"
    return lower(g, Plan(variants=variants), StepStructure.of(g), check="full").graph


def assert_matches_torch(where: str, out: Outputs, grads: dict[str, str], ref_loss: float,
                         ref: dict[str, np.ndarray], rtol: float = 1e-3) -> None:
    """Loss and gradients against torch (float64), as tests/test_models_grad.py does."""
    assert abs(float(out["loss"]) - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss)), where
    floor = 1e-3 * max(float(np.abs(g).max()) for g in ref.values())
    for p, g in ref.items():
        err = rel_err(out[grads[p]], g, floor)
        assert err <= rtol, f"{where}: {p}: relative error {err:.2e} against torch"


def hand_built(op: str, feeds: dict[str, np.ndarray], wrt: list[str], opset: int = 17,
               computed: tuple[str, ...] = (), **attrs) -> Graph:
    """``y = op(*feeds)`` differentiated with loss sum(y * w), node named ``op``. The feeds
    named in ``computed`` reach it through an Identity (``x`` -> ``x.act``), so that they
    are activations of the step, not graph inputs."""
    outputs = ["y", "rm", "rv"] if attrs.get("training_mode") else ["y"]
    pre = [helper.make_node("Identity", [k], [f"{k}.act"], name=f"{k}.act") for k in computed]
    node = helper.make_node(op, [f"{k}.act" if k in computed else k for k in feeds], outputs,
                            name="op", **attrs)
    ins = [(k, FLOAT, list(v.shape)) for k, v in feeds.items()]
    if op == "BatchNormalization":  # shape inference leaves training mode's y unknown
        shape = list(feeds["x"].shape)
    else:
        probe = load_graph(make_model([*pre, node], ins, [("y", FLOAT, None)], opset=opset))
        shape = list(probe.info["y"].shape)
    return grad_graph(make_model([*pre, node], ins, [("y", FLOAT, shape)], opset=opset), wrt)


def check_hand_built(op: str, vname: str, feeds: dict[str, np.ndarray], wrt: list[str],
                     fn: Callable, opset: int = 17, rtol: float = 1e-4, **attrs) -> None:
    """Variant vs default (tier), then vs torch float32 (``rtol``) at every thread count."""
    ref = hand_built(op, feeds, wrt, opset, **attrs)
    var = apply_variants(ref, Plan(variants={"op": vname})).graph
    variant = lookup(op, vname)
    assert variant is not None
    outs = check_variant(ref, var, feeds, list(ref.outputs), variant)
    torch_loss, torch_g = torch_grads(fn, feeds, wrt)
    for out in outs.values():
        assert abs(float(out[var.outputs[0]]) - torch_loss) <= 1e-4 * max(1.0, abs(torch_loss))
        for name, out_name in zip(wrt, var.outputs[1:], strict=True):
            err = rel_err(out[out_name], torch_g[name])
            assert err <= rtol, f"{op}:{vname} {name}: {err:.2e} against torch"


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------- registry
def test_every_variant_states_a_valid_tier_and_its_tolerance():
    load_variants()
    keys = {v.key for table in VARIANTS.values() for v in table.values()}
    assert {f"Conv:chunks{k}" for k in CONV_CHUNKS} <= keys
    assert {"LayerNormalization:inverted", "BatchNormalization:inverted",
            "Sigmoid:from_input", "Tanh:from_input", "Exp:from_input",
            "Softmax:from_input"} <= keys
    for table in VARIANTS.values():
        for v in table.values():
            assert v.tier in TIERS, v.key
            assert v.summary, f"{v.key}: no docstring summary"
            if v.tier == EQUIVALENT:
                assert 0 < v.tolerance <= 1e-3, v.key
            if v.tier == EXACT:
                assert v.tolerance == 0, v.key


# ---------------------------------------------------------------------------- conv chunks
CONV_CASES = {
    # name: (x shape, w shape, attrs, bias, chunk count); batches not divisible by k included
    "2d-grouped-strided-dilated-bias": ((5, 4, 9, 8), (6, 2, 3, 3),
                                        dict(group=2, strides=[2, 1], pads=[1, 1, 1, 1],
                                             dilations=[1, 2]), True, 2),
    "2d-depthwise-uneven": ((7, 4, 6, 6), (4, 1, 3, 3),
                            dict(group=4, pads=[1, 1, 1, 1]), False, 4),
    "1d-same-upper": ((8, 3, 11), (5, 3, 4), dict(auto_pad="SAME_UPPER", strides=[2]), True, 8),
    "3d": ((4, 2, 5, 4, 6), (3, 2, 2, 3, 2), dict(strides=[1, 2, 1]), False, 4),
}


def _torch_conv(x_shape: tuple[int, ...], attrs: dict) -> Callable:
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[len(x_shape)]

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if attrs.get("auto_pad") == "SAME_UPPER":  # SAME_UPPER: extra pad at the end
            total = max(0, (-(-x.shape[2] // attrs["strides"][0]) - 1) * attrs["strides"][0]
                        + w.shape[2] - x.shape[2])
            x = F.pad(x, (total // 2, total - total // 2))
            return conv(x, w, b, stride=attrs["strides"])
        nd = len(x_shape) - 2
        pads = attrs.get("pads", [0] * 2 * nd)
        return conv(x, w, b, stride=attrs.get("strides", 1), padding=pads[:nd],
                    dilation=attrs.get("dilations", 1), groups=attrs.get("group", 1))

    return fn


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_chunks_hand_built(case):
    x_shape, w_shape, attrs, bias, k = CONV_CASES[case]
    rng = np.random.default_rng(0)
    feeds = {"x": rand(rng, *x_shape), "w": rand(rng, *w_shape)}
    if bias:
        feeds["b"] = rand(rng, w_shape[0])
    check_hand_built("Conv", f"chunks{k}", feeds, list(feeds), _torch_conv(x_shape, attrs),
                     opset=13 if bias else 17, kernel_shape=list(w_shape[2:]), **attrs)


def test_conv_chunks_error_at_realistic_size():
    """A ResNet layer1 conv at batch 32 (each weight-gradient entry sums 25,088 products):
    the chunked sums stay within the 1e-5 tolerance (measured about 1e-6 at worst on
    ResNet-sized layers), and the input gradient is the default's, bit for bit."""
    rng = np.random.default_rng(6)
    feeds = {"x": rand(rng, 32, 32, 28, 28), "w": 0.05 * rand(rng, 32, 32, 3, 3)}
    ref = hand_built("Conv", feeds, ["x", "w"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    var = apply_variants(ref, Plan(variants={"op": "chunks8"})).graph
    variant = lookup("Conv", "chunks8")
    assert variant is not None
    outs = check_variant(ref, var, feeds, list(ref.outputs), variant)
    base = run_once(ref, feeds, 1)
    assert all(np.array_equal(o[ref.outputs[1]], base[ref.outputs[1]]) for o in outs.values())


@pytest.fixture(scope="module")
def resnet():
    model = build_model("resnet18", batch=8, resolution=32, width=8)
    return model, *zoo_step(model)


@pytest.mark.parametrize("k", CONV_CHUNKS)
def test_conv_chunks_on_resnet(resnet, k):
    """Every Conv of a ResNet-18 step chunked; chunks4 is also held to torch (float64)."""
    model, g, feeds, grads = resnet
    convs = forward_nodes(g, "Conv")
    low = lowered(g, {c: f"chunks{k}" for c in convs})
    by_name = {n.name: n for n in low.nodes}
    for c in convs:  # k batch slices of the input per Conv, one per chunk
        x = by_name[c].input[0]
        mine = [n for n in low.nodes if n.name.startswith(f"{c}/chunks{k}/")]
        assert sum(n.op_type == "Slice" and n.input[0] == x for n in mine) == k
    variant = lookup("Conv", f"chunks{k}")
    assert variant is not None
    outs = check_variant(g, low, feeds, ["loss", *grads.values()], variant)
    if k == 4:
        data = {n: v for n, v in feeds.items() if n != "labels"}
        ref_loss, ref = torch_loss_and_grads(model, data, labels=feeds["labels"], double=True)
        for threads, out in outs.items():
            assert_matches_torch(f"chunks4 at {threads} threads", out, grads, ref_loss, ref)


def test_conv_chunks_apply_only_to_batches_of_at_least_k():
    g, _, _ = zoo_step(build_model("resnet18", batch=4, resolution=16, width=4,
                                   blocks=[1, 1, 1, 1]))
    rules = rule_nodes(g)
    conv = next(n for n in g.nodes if n.name == forward_nodes(g, "Conv")[1])
    names = {v.name for v in applicable_variants(g, conv, rules)}
    assert {"chunks2", "chunks4"} <= names and "chunks8" not in names


# ---------------------------------------------------------------------------- inverted norms
def test_layernorm_inverted_on_gpt2():
    """All LayerNorms of a GPT-2 step inverted: within 1e-5 of the default, and torch's."""
    model = randomize_norm_params(
        build_model("gpt2", batch=2, seq_len=32, width=64, depth=2, heads=4, vocab_size=128),
        "LayerNormalization")
    g, feeds, grads = zoo_step(model)
    lns = forward_nodes(g, "LayerNormalization")
    assert len(lns) == 5
    low = lowered(g, {n: "inverted" for n in lns})
    # The backward no longer reads the LayerNorms' inputs.
    back = [n for n in low.nodes if "/inverted/" in n.name]
    ins = {n.input[0] for n in low.nodes if n.name in lns}
    assert back and not ins & {i for n in back for i in n.input}
    variant = lookup("LayerNormalization", "inverted")
    assert variant is not None and variant.tolerance <= 1e-5
    outs = check_variant(g, low, feeds, ["loss", *grads.values()], variant)
    data = {n: v for n, v in feeds.items() if n != "labels"}
    ref_loss, ref = torch_loss_and_grads(model, data, labels=feeds["labels"], double=True)
    for threads, out in outs.items():
        assert_matches_torch(f"LayerNorm inverted at {threads} threads", out, grads,
                             ref_loss, ref)


def _layernorm_feeds(rng: np.random.Generator, zero: bool) -> dict[str, np.ndarray]:
    scale = (1.0 + 0.3 * rng.standard_normal(6)).astype(np.float32)
    if zero:
        scale[2] = 0.0
    return {"x": rand(rng, 3, 4, 6), "s": scale,
            "b": (0.3 * rng.standard_normal(6)).astype(np.float32)}


def test_layernorm_inverted_hand_built_and_a_zero_scale_stays_finite():
    rng = np.random.default_rng(2)
    feeds = _layernorm_feeds(rng, zero=False)

    def fn(x: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (6,), s, b, eps=1e-5)

    check_hand_built("LayerNormalization", "inverted", feeds, ["x", "s", "b"], fn,
                     axis=-1, epsilon=1e-5)
    # Scale 0 in channel 2: finite everywhere; only channel 2's scale gradient and the input
    # gradient at channel 2 (which needs that channel's xhat) may differ from the default.
    feeds = _layernorm_feeds(rng, zero=True)
    ref = hand_built("LayerNormalization", feeds, ["x", "s", "b"], axis=-1, epsilon=1e-5)
    var = apply_variants(ref, Plan(variants={"op": "inverted"})).graph
    a, b = run_once(ref, feeds, 1), run_once(var, feeds, 1)
    _, gx, gs, gb = var.outputs
    assert all(np.isfinite(v).all() for v in b.values())
    keep = [c for c in range(6) if c != 2]
    assert rel_err(b[gs][keep], a[gs][keep]) <= 1e-5
    assert rel_err(b[gb], a[gb]) <= 1e-5
    assert rel_err(b[gx][..., keep], a[gx][..., keep]) <= 1e-5


def test_batchnorm_inverted_on_resnet_with_bn_training():
    model = randomize_norm_params(
        build_model("resnet18", batch=8, resolution=32, width=8, bn_training=True),
        "BatchNormalization")
    g, feeds, grads = zoo_step(model)
    bns = forward_nodes(g, "BatchNormalization")
    low = lowered(g, {n: "inverted" for n in bns})
    fwd = [n for n in low.nodes if "/inverted/fwd/" in n.name]
    assert fwd and {n.op_type for n in fwd} >= {"ReduceSumSquare", "Reciprocal"}
    variant = lookup("BatchNormalization", "inverted")
    assert variant is not None
    outs = check_variant(g, low, feeds, ["loss", *grads.values()], variant)
    data = {n: v for n, v in feeds.items() if n != "labels"}
    ref_loss, ref = torch_loss_and_grads(model, data, labels=feeds["labels"], double=True)
    for threads, out in outs.items():
        assert_matches_torch(f"BatchNorm inverted at {threads} threads", out, grads,
                             ref_loss, ref)


def test_batchnorm_inverted_hand_built_and_inference_mode_is_not_covered():
    rng = np.random.default_rng(3)
    c = 5
    scale = (1.0 + 0.3 * rng.standard_normal(c)).astype(np.float32)
    scale[1] = 0.0  # guarded: finite, channel 1's scale gradient inexact
    feeds = {"x": rand(rng, 4, c, 3, 3), "s": scale,
             "b": (0.3 * rng.standard_normal(c)).astype(np.float32),
             "m": np.zeros(c, np.float32), "v": np.ones(c, np.float32)}
    ref = hand_built("BatchNormalization", feeds, ["x", "s", "b"], opset=15, training_mode=1)
    var = apply_variants(ref, Plan(variants={"op": "inverted"})).graph
    a, b = run_once(ref, feeds, 1), run_once(var, feeds, 1)
    _, gx, gs, gb = var.outputs
    assert all(np.isfinite(v).all() for v in b.values())
    keep = [k for k in range(c) if k != 1]
    assert rel_err(b[gs][keep], a[gs][keep]) <= 1e-5
    assert rel_err(b[gb], a[gb]) <= 1e-5
    assert rel_err(b[gx][:, keep], a[gx][:, keep]) <= 1e-5
    t = {k: torch.tensor(v, requires_grad=k in ("x", "s", "b")) for k, v in feeds.items()}
    y = F.batch_norm(t["x"], t["m"].clone(), t["v"].clone(), t["s"], t["b"], training=True)
    (y * torch.tensor(upstream_weight(tuple(y.shape)))).sum().backward()
    assert rel_err(b[gs][keep], t["s"].grad.numpy()[keep]) <= 1e-4
    assert rel_err(b[gx][:, keep], t["x"].grad.numpy()[:, keep]) <= 1e-4

    inference = hand_built("BatchNormalization", feeds, ["x", "s", "b"], opset=15)
    node = next(n for n in inference.nodes if n.name == "op")
    names = {v.name for v in applicable_variants(inference, node, rule_nodes(inference))}
    assert "inverted" not in names


# ---------------------------------------------------------------------------- from input
FROM_INPUT = {
    "Sigmoid": (dict(), torch.sigmoid),
    "Tanh": (dict(), torch.tanh),
    "Exp": (dict(), torch.exp),
    "Softmax": (dict(axis=1), lambda x: torch.softmax(x, dim=1)),
}


@pytest.mark.parametrize("op", list(FROM_INPUT))
def test_from_input_is_bit_exact_hand_built(op):
    attrs, fn = FROM_INPUT[op]
    feeds = {"x": rand(np.random.default_rng(4), 3, 7, 5)}
    check_hand_built(op, "from_input", feeds, ["x"], fn, rtol=1e-5, **attrs)


def test_softmax_from_input_before_opset_13_coerces_like_the_op():
    """Opset 11 Softmax normalizes over all axes from ``axis``: the recompute copies it."""
    feeds = {"x": rand(np.random.default_rng(5), 2, 3, 4)}
    check_hand_built("Softmax", "from_input", feeds, ["x"],
                     lambda x: torch.softmax(x.reshape(2, 12), 1).reshape(2, 3, 4),
                     opset=11, rtol=1e-5, axis=1)


def test_from_input_on_gpt2_is_bit_exact():
    """GPT-2's attention Softmax and GELU Tanh: the backward reads x, not y, same bits."""
    model = build_model("gpt2", batch=2, seq_len=16, width=32, depth=1, heads=2,
                        vocab_size=64)
    g, feeds, grads = zoo_step(model)
    chosen = {n: "from_input" for op in ("Softmax", "Tanh") for n in forward_nodes(g, op)}
    assert len(chosen) == 2
    low = lowered(g, chosen)
    for node in (n for n in low.nodes if n.name in chosen):
        readers = [n for n in low.nodes if node.output[0] in n.input]
        assert all("/from_input/" not in n.name for n in readers)
    variant = lookup("Softmax", "from_input")
    assert variant is not None
    check_variant(g, low, feeds, ["loss", *grads.values()], variant)


def test_layernorm_inverted_needs_scale_and_bias_the_backward_can_read():
    """A scale computed in the forward pass would have to be kept for the backward: the
    variant is not offered then."""
    nodes = [helper.make_node("Mul", ["s", "s"], ["s2"], name="square"),
             helper.make_node("LayerNormalization", ["x", "s2", "b"], ["y"], name="op")]
    ins = [("x", FLOAT, [2, 3, 4]), ("s", FLOAT, [4]), ("b", FLOAT, [4])]
    g = grad_graph(make_model(nodes, ins, [("y", FLOAT, [2, 3, 4])]), ["x", "s", "b"])
    node = next(n for n in g.nodes if n.name == "op")
    assert "inverted" not in {v.name for v in applicable_variants(g, node, rule_nodes(g))}


# ---------------------------------------------------------------------------- 16-bit storage
def bf16_stored(low: Graph, chosen: dict[str, str], by_name: dict) -> tuple[set[str], list]:
    """The forward values the ``bf16_saved`` variants of ``chosen`` copy to bfloat16 (the
    nodes' own inputs and outputs a forward Cast or centring mean reads), and the variants'
    backward nodes."""
    own = {v for n in chosen for v in [*by_name[n].input, *by_name[n].output] if v}
    forward = StepStructure.of(low).forward
    mine = [n for n in low.nodes if "/bf16_saved/" in n.name]
    stored = {i for n in mine if n.name in forward for i in n.input if i in own}
    return stored, [n for n in mine if n.name not in forward]


def assert_reads_bf16_copies(low: Graph, chosen: dict[str, str], by_name: dict) -> None:
    """The variants' backward nodes read the cast-back copies, never the float32 originals
    (which other rules may still read: that is the planner's business)."""
    stored, back = bf16_stored(low, chosen, by_name)
    assert stored and back
    assert not stored & {i for n in back for i in n.input}
    casts = [n for n in back if n.op_type == "Cast"]
    assert casts and all(low.info[n.input[0]].dtype == onnx.TensorProto.BFLOAT16
                         for n in casts)


BF16_CASES = {
    # name: (op, feed shapes or (shape, offset), feeds computed in the step, wrt, opset, attrs)
    "BatchNormalization-training": ("BatchNormalization",
                                    {"x": ((6, 5, 4, 4), 10.0), "s": (5,), "b": (5,),
                                     "m": (5,), "v": (5,)},
                                    ("x",), ["x", "s", "b"], 15, dict(training_mode=1)),
    "BatchNormalization-inference": ("BatchNormalization",
                                     {"x": ((6, 5, 4, 4), 3.0), "s": (5,), "b": (5,),
                                      "m": (5,), "v": (5,)},
                                     ("x",), ["x", "s", "b"], 15, {}),
    "LayerNormalization": ("LayerNormalization", {"x": ((3, 4, 16), 10.0), "s": (16,),
                                                  "b": (16,)},
                           ("x",), ["x", "s", "b"], 17, dict(axis=-1)),
    "Softmax": ("Softmax", {"x": (3, 7, 5)}, ("x",), ["x"], 17, dict(axis=1)),
    "LogSoftmax": ("LogSoftmax", {"x": (3, 7, 5)}, ("x",), ["x"], 17, dict(axis=-1)),
    "Sigmoid": ("Sigmoid", {"x": (3, 7, 5)}, ("x",), ["x"], 17, {}),
    "Tanh": ("Tanh", {"x": (3, 7, 5)}, ("x",), ["x"], 17, {}),
    "Exp": ("Exp", {"x": (3, 7, 5)}, ("x",), ["x"], 17, {}),
    "Erf": ("Erf", {"x": (3, 7, 5)}, ("x",), ["x"], 17, {}),
    "Gelu": ("Gelu", {"x": (3, 7, 5)}, ("x",), ["x"], 20, {}),
    "Mul-broadcast": ("Mul", {"a": (3, 7, 5), "w": (5,)}, ("a",), ["a", "w"], 17, {}),
    "Mul-square": ("Mul", {"a": (3, 7, 5), "b": (3, 7, 5)}, ("a", "b"), ["a", "b"], 17, {}),
    "Div": ("Div", {"a": (3, 7, 5), "b": ((3, 7, 1), 3.0)}, ("a", "b"), ["a", "b"], 17, {}),
    "Pow": ("Pow", {"x": (3, 7, 5), "p": ()}, ("x",), ["x", "p"], 17, {}),
    "ConvTranspose": ("ConvTranspose", {"x": (2, 3, 5, 5), "w": (3, 4, 3, 3)}, ("x",),
                      ["x", "w"], 17, dict(strides=[2, 2], pads=[1, 1, 1, 1])),
}


def _bf16_feeds(shapes: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random feeds; a (shape, offset) entry adds the offset (a normalisation's input far
    from zero mean, which the variant's centring is for). BatchNorm's running variance and
    Pow's base are kept positive, Pow's exponent at 3."""
    feeds = {}
    for k, spec in shapes.items():
        shape, offset = spec if spec and isinstance(spec[0], tuple) else (spec, 0.0)
        feeds[k] = (rand(rng, *shape) + offset).astype(np.float32)
    if "v" in feeds:
        feeds["v"] = np.abs(feeds["v"]) + 0.5
    if "p" in feeds:
        feeds["x"], feeds["p"] = np.abs(feeds["x"]) + 0.1, np.asarray(3.0, np.float32)
    return feeds


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_saved_hand_built(case):
    """Each op's stored values are read back from their bfloat16 copies, within the stated
    tolerance of the default rule at 1 and 2 threads, and not bit for bit (the copy is
    really rounded)."""
    op, shapes, computed, wrt, opset, attrs = BF16_CASES[case]
    feeds = _bf16_feeds(shapes, np.random.default_rng(7))
    ref = hand_built(op, feeds, wrt, opset, computed=computed, **attrs)
    node = next(n for n in ref.nodes if n.name == "op")
    variant = next((v for v in applicable_variants(ref, node, rule_nodes(ref))
                    if v.name == "bf16_saved"), None)
    assert variant is not None and variant.tier == LOSSY
    var = apply_variants(ref, Plan(variants={"op": "bf16_saved"})).graph
    assert_reads_bf16_copies(var, {"op": "bf16_saved"}, {"op": node})
    outs = check_variant(ref, var, feeds, list(ref.outputs), variant)
    base = run_once(ref, feeds, 1)
    assert any(not np.array_equal(outs[1][k], base[k]) for k in ref.outputs[1:])


def test_bf16_saved_is_not_offered_for_parameters_inputs_or_a_mask_op():
    """Graph inputs and parameters are kept anyway (nothing to free), Relu has the exact
    1-byte mask, and a value no wanted gradient reads is not stored."""
    rng = np.random.default_rng(8)
    feeds = {"x": rand(rng, 3, 7, 5)}
    for op in ("Tanh", "Softmax"):  # outputs: stored even when x is a graph input
        g = hand_built(op, feeds, ["x"])
        node = next(n for n in g.nodes if n.name == "op")
        assert "bf16_saved" in {v.name for v in applicable_variants(g, node, rule_nodes(g))}
    cases = [("Erf", {}, (), ["x"]),                      # x a graph input
             ("Relu", {}, ("x",), ["x"]),                 # the mask is exact and smaller
             ("Mul", {"w": rand(rng, 5)}, ("x",), ["x"])]  # w takes no gradient: x unread
    for op, more, computed, wrt in cases:
        g = hand_built(op, {**feeds, **more}, wrt, computed=computed)
        node = next(n for n in g.nodes if n.name == "op")
        names = {v.name for v in applicable_variants(g, node, rule_nodes(g))}
        assert "bf16_saved" not in names, op


def test_bf16_saved_lowers_the_simulated_peak_and_the_ilp_sees_it():
    """The convolution outputs each training-mode BatchNorm keeps for its backward are
    among the largest saved values of a ResNet step at 64x64 (where activations, not
    weights, make the peak); with bf16_saved they are kept at half the bytes, the simulated
    peak goes down, and the ILP's terms for the variant give the simulator's peak. Without
    --allow-lossy the ILP is not offered it."""
    g, _, _ = zoo_step(build_model("resnet18", batch=8, resolution=64, width=8,
                                   blocks=[1, 1, 1, 1]))
    st = StepStructure.of(g)
    costs = analytic_costs(g, NOMINAL_CPU)
    base = simulate(g, Plan(), costs, st)
    bns = forward_nodes(g, "BatchNormalization")
    every = simulate(g, Plan(variants=dict.fromkeys(bns, "bf16_saved")), costs, st)
    assert every.peak_bytes < base.peak_bytes
    pp = build_problem(g, st, base.liveness, costs, DecisionKinds(lossy=True))
    choice = {v: k for k, v in pp.variants.choice_of.items()}
    modelled = [(n, choice[(n, "bf16_saved")]) for n in bns if (n, "bf16_saved") in choice]
    assert modelled
    lower_peak = 0
    for node, var in modelled:
        x = np.zeros(pp.problem.n_vars)
        x[var] = 1.0
        sim = simulate(g, Plan(variants={node: "bf16_saved"}), costs, st)
        assert abs(pp.problem.peak(x) - sim.peak_bytes) <= 0.01 * base.peak_bytes, node
        lower_peak += sim.peak_bytes < base.peak_bytes
    assert lower_peak
    assert not any(name == "bf16_saved" for _, name in build_problem(
        g, st, base.liveness, costs).variants.choice_of.values())


@pytest.fixture(scope="module")
def gpt2_step():
    model = randomize_norm_params(
        build_model("gpt2", batch=2, seq_len=32, width=64, depth=2, heads=4, vocab_size=128),
        "LayerNormalization")
    return zoo_step(model)


@pytest.mark.parametrize("name", ["resnet", "gpt2"])
def test_bf16_saved_activations_within_their_stated_tolerance(name, gpt2_step):
    """Every node whose backward reads an activation keeps it in bfloat16 (ResNet: Conv,
    BatchNorm with random scales and biases, Gemm, the loss's LogSoftmax; GPT-2: MatMul,
    LayerNorm, Softmax, Tanh, Pow, Mul, LogSoftmax): the float32 originals are no longer
    read by the variants' backward, and the gradients stay within the largest stated bound
    of the default at 1 and 2 threads. The variant is never offered to the planner without
    --allow-lossy (tests/test_variants_planning.py)."""
    if name == "resnet":
        model = randomize_norm_params(
            build_model("resnet18", batch=8, resolution=32, width=8), "BatchNormalization")
        g, feeds, grads = zoo_step(model)
        expected = {"Conv", "BatchNormalization", "Gemm", "LogSoftmax"}
    else:
        g, feeds, grads = gpt2_step
        expected = {"MatMul", "LayerNormalization", "Softmax", "Tanh", "Pow", "Mul",
                    "LogSoftmax"}
    rules = rule_nodes(g)
    st = StepStructure.of(g)
    by_name = {n.name: n for n in g.nodes}
    offered = {n.name: v for n in g.nodes if n.name in st.forward
               for v in applicable_variants(g, n, rules) if v.name == "bf16_saved"}
    assert {by_name[n].op_type for n in offered} == expected
    chosen = dict.fromkeys(offered, "bf16_saved")
    low = lowered(g, chosen)
    assert_reads_bf16_copies(low, chosen, by_name)
    loosest = max(offered.values(), key=lambda v: v.tolerance)
    assert loosest.tier == LOSSY and loosest.tolerance == (
        BF16_SAVED_BATCHNORM_TOLERANCE if name == "resnet" else BF16_SAVED_TOLERANCE)
    check_variant(g, low, feeds, ["loss", *grads.values()], loosest)
