"""Convolution weight gradients as a MatMul over patches on CUDA
(passes/providers/conv_weight_grad_cuda.py).

The rewrite has to compute the weight gradient memcc's rule computes with a Conv over
batch-swapped tensors: checked here on the CPU provider, which runs both forms, against the
step as built, at 1 and 2 intra-op threads. Only this pass is applied (``for_provider``'s
other CUDA rewrites, BatchNorm's among them, would change the step too and run on the CPU
as well; they have their own tests).

Tolerance: the same products are summed in another order (one MatMul over taps, channels
and pixels against a Conv's loop; partial sums per batch chunk), so the gradient differs in
the last bits: every weight gradient stays within 1e-5 of its largest magnitude in float32
(measured at most about 1e-6 here), and every other output of the step within 1e-5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_files import write_model
from threads import run_once

from memcc.backend.runner import synthetic_feeds
from memcc.compiler import CompileOptions, compile_model
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph, topological_problems
from memcc.passes.providers.conv_weight_grad_cuda import (
    WEIGHT_GRAD_PROP,
    chunk_sizes,
    conv_weight_grads_as_patches,
    use_patches,
)
from memcc.passes.providers.provider_step import for_provider
from memcc.step import PLAN_KEY, Role, TrainingStep
from models import build_model

RTOL = 1e-5


def _conv_step(tmp_path, c: int, hw: tuple[int, int], m: int, k: int, stride: int,
               pad: int, *, batch: int = 3, dilation: int = 1) -> Graph:
    """x [batch, c, *hw] -> Conv(w [m, c, k, k]) -> y; the training step memcc builds."""
    rng = np.random.default_rng(c * 100 + k)
    w = numpy_helper.from_array(
        (rng.standard_normal((m, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32), "w")
    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=[k, k],
                            strides=[stride] * 2, pads=[pad] * 4, dilations=[dilation] * 2)
    out = [(i + 2 * pad - dilation * (k - 1) - 1) // stride + 1 for i in hw]
    path = write_model(tmp_path / "conv.onnx", [conv], [("x", [batch, c, *hw])],
                       [("y", [batch, m, *out])], [w])
    return build_training_step(load_graph(path), BuildOptions())


def _weight_grads(step: Graph) -> list[str]:
    """The weight gradients in the weight's layout: the rule's swap after each tagged Conv."""
    readers = step.consumers()
    names = []
    for n in step.nodes:
        props = {p.key: p.value for p in n.metadata_props}
        if WEIGHT_GRAD_PROP in props:
            dw = json.loads(props[WEIGHT_GRAD_PROP])["dw"]
            names.append(readers[dw][0].output[0])
    return names


def _check_matches(step: Graph, rewritten: Graph, threads=(1, 2)) -> float:
    """Every output, and every weight gradient, of ``rewritten`` within RTOL of ``step``'s;
    returns the largest relative difference."""
    grads = _weight_grads(step)
    a_graph, b_graph = step.copy(), rewritten.copy()
    for g in (a_graph, b_graph):
        g.outputs = list(g.outputs) + [n for n in grads if n not in g.outputs]
    feeds = {k: v for k, v in synthetic_feeds(step, 0).items() if k not in step.initializers}
    worst = 0.0
    for t in threads:
        a, b = run_once(a_graph, feeds, t), run_once(b_graph, feeds, t)
        for name, value in a.items():
            ref = value.astype(np.float64)
            scale = max(float(np.max(np.abs(ref))), 1e-30)
            rel = float(np.max(np.abs(ref - b[name].astype(np.float64)))) / scale
            assert rel <= RTOL, (t, name, rel)
            worst = max(worst, rel)
    return worst


@pytest.mark.parametrize("c, hw, m, k, stride, pad, dilation", [
    (8, (12, 12), 6, 3, 1, 1, 1),     # 3x3 s1 p1
    (3, (20, 20), 8, 7, 2, 3, 1),     # the stem: 7x7 s2 p3
    (8, (15, 15), 4, 3, 2, 1, 1),     # 3x3 s2 p1, odd input
    (5, (9, 14), 7, 3, 1, 1, 1),      # non-square input
    (4, (13, 11), 6, 3, 2, 2, 2),     # dilated, strided, non-square
])
def test_one_convolution_matches_the_conv_form(tmp_path, c, hw, m, k, stride, pad, dilation):
    step = _conv_step(tmp_path, c, hw, m, k, stride, pad, dilation=dilation)
    rewritten, summary = conv_weight_grads_as_patches(step, min_pixels=1)
    assert summary["conv_weight_grads_as_patches"] == 1
    assert summary["patch_bytes_max"] > 0
    assert not topological_problems(rewritten)
    before = [n.op_type for n in step.nodes]
    ops = [n.op_type for n in rewritten.nodes]
    assert (before.count("Conv"), ops.count("Conv")) == (2, 1)  # the forward's stays
    assert (before.count("MatMul"), ops.count("MatMul")) == (0, 1)
    assert all(o in rewritten.info for n in rewritten.nodes for o in n.output if o)
    _check_matches(step, rewritten)


def test_batch_chunks_hold_at_most_the_cap(tmp_path):
    """Patches over batch chunks: each chunk's patches within max(bytes of x, floor), the
    partial gradients summed once, the result as the unchunked one."""
    step = _conv_step(tmp_path, 4, (10, 10), 5, 3, 1, 1, batch=7)
    whole, one = conv_weight_grads_as_patches(step, min_pixels=1)
    x_bytes = 7 * 4 * 10 * 10 * 4
    sample = 9 * 4 * 10 * 10 * 4  # k*k*C*P float32 per sample
    assert one["patch_bytes_max"] == 7 * sample  # under the 64 MiB floor: one chunk
    # A floor of two samples' patches (above x's bytes): chunks of 2, 2, 2 and 1 samples.
    chunked, summary = conv_weight_grads_as_patches(step, min_pixels=1,
                                                    chunk_floor=2 * sample)
    assert summary["patch_bytes_max"] == 2 * sample
    ops = [n.op_type for n in chunked.nodes]
    assert ops.count("MatMul") == len(chunk_sizes(7, sample, x_bytes, 2 * sample)) == 4
    assert ops.count("Sum") == 1
    _check_matches(step, chunked, threads=(1,))
    _check_matches(whole, chunked, threads=(2,))


@pytest.mark.parametrize("batch, sample, x_bytes, floor, sizes", [
    # 64@56x56 3x3, float32, batch 64: 6.9 MiB of patches per sample, x 49 MiB, so at most
    # 9 samples under the 64 MiB floor: 8 chunks of 8.
    (64, 9 * 64 * 56 * 56 * 4, 64 * 64 * 56 * 56 * 4, 64 << 20, [8] * 8),
    (7, 100, 50, 200, [2, 2, 2, 1]),  # the floor over x: 2 samples a chunk
    (5, 1000, 10, 1, [1] * 5),  # one sample over the cap: one per chunk
    (5, 10, 10, 1 << 20, [5]),
])
def test_chunk_sizes(batch, sample, x_bytes, floor, sizes):
    assert chunk_sizes(batch, sample, x_bytes, floor) == sizes
    assert sum(sizes) == batch


# ResNet-50's k x k weight gradients on an H200 (module docstring): C, H*W, ms of the
# Conv form, ms of the patches form.
MEASURED = [(3, 224 * 224, 23.9, 1.29), (64, 56 * 56, 6.02, 0.83), (128, 56 * 56, 1.18, 0.64),
            (128, 28 * 28, 1.04, 0.47), (256, 28 * 28, 0.374, 0.422),
            (256, 14 * 14, 0.329, 0.316), (512, 14 * 14, 0.222, 0.285),
            (512, 7 * 7, 0.213, 0.290)]


def test_the_rule_picks_the_faster_form_on_every_measured_shape():
    for c, pixels, conv_ms, patches_ms in MEASURED:
        # 256@14x14: 0.329 against 0.316, within the noise; the Conv is kept there.
        faster = patches_ms < 0.9 * conv_ms
        assert use_patches(c, pixels) == faster, (c, pixels)


def test_more_than_128_channels_or_groups_keep_the_conv(tmp_path):
    step = _conv_step(tmp_path, 136, (28, 28), 4, 3, 1, 1, batch=1)
    same, summary = conv_weight_grads_as_patches(step)
    assert same is step
    assert summary == {"conv_weight_grads_as_patches": 0,
                       "conv_weight_grads_kept": {"rule": 1}, "patch_bytes_max": 0}
    small = _conv_step(tmp_path, 8, (28, 28), 4, 3, 1, 1, batch=1)
    assert conv_weight_grads_as_patches(small)[1]["conv_weight_grads_as_patches"] == 1
    # Depthwise: tagged, kept.
    w = numpy_helper.from_array(np.ones((8, 1, 3, 3), np.float32), "w")
    dw = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4,
                          group=8)
    path = write_model(tmp_path / "dw.onnx", [dw], [("x", [2, 8, 28, 28])],
                       [("y", [2, 8, 28, 28])], [w])
    grouped = build_training_step(load_graph(path), BuildOptions())
    assert conv_weight_grads_as_patches(grouped)[1]["conv_weight_grads_kept"] == {
        "grouped or not 2-D": 1}


def _resnet18(**kw) -> Graph:
    return build_training_step(load_graph(build_model("resnet18", batch=2, resolution=112,
                                                      width=16)), BuildOptions(**kw))


def test_resnet18_step_matches_at_one_and_two_threads():
    """At 112 px and width 16 the rule picks the stem (3@112x112), layer1's four 3x3
    convolutions (16@28x28) and layer2's first (16@28x28, stride 2): 6 of 17."""
    step = _resnet18()
    rewritten, summary = conv_weight_grads_as_patches(step)
    assert summary["conv_weight_grads_as_patches"] == 6
    assert summary["conv_weight_grads_kept"] == {"rule": 11}
    assert not topological_problems(rewritten)
    assert _check_matches(step, rewritten) > 0  # not the same arithmetic


def test_cuda_provider_rewrites_and_the_cpu_does_not():
    step = _resnet18()
    _, cuda = for_provider(step, "cuda")
    assert cuda["conv_weight_grads_as_patches"] == 6 and cuda["patch_bytes_max"] > 0
    cpu_step, cpu = for_provider(step, "cpu")
    assert "conv_weight_grads_as_patches" not in cpu
    assert sum(n.op_type == "Conv" for n in cpu_step.nodes) == sum(
        n.op_type == "Conv" for n in step.nodes)



def test_the_conv_form_can_be_kept_by_environment(monkeypatch):
    """``MEMCC_CONV_WEIGHT_GRAD=conv``: the CUDA step keeps memcc's Conv form (the whole-step
    comparison the pass has not had on a GPU yet); another value is refused by name."""
    from memcc.errors import InputError
    from memcc.passes.providers.conv_weight_grad_cuda import FORM_ENV

    step = _resnet18()
    monkeypatch.setenv(FORM_ENV, "conv")
    kept, summary = for_provider(step, "cuda")
    assert "conv_weight_grads_as_patches" not in summary
    assert not any(n.op_type == "MatMul" and "patch" in n.name for n in kept.nodes)
    assert sum(n.op_type == "Conv" for n in kept.nodes) == sum(
        n.op_type == "Conv" for n in step.nodes)
    monkeypatch.setenv(FORM_ENV, "Patches")
    assert for_provider(step, "cuda")[1]["conv_weight_grads_as_patches"] == 6
    monkeypatch.setenv(FORM_ENV, "im2col")
    with pytest.raises(InputError, match="MEMCC_CONV_WEIGHT_GRAD=im2col"):
        for_provider(step, "cuda")


def test_the_patch_chunk_floor_can_be_set_by_environment(monkeypatch):
    """``MEMCC_PATCH_CHUNK_BYTES``: the least bytes a chunk's patches may hold (one chunk
    each when it is above every patches tensor); a value that is not a positive count of
    bytes is refused by name."""
    from memcc.errors import InputError
    from memcc.passes.providers.conv_weight_grad_cuda import CHUNK_ENV

    step = _resnet18()  # batch 2: the default floor (64 MiB) holds both samples
    monkeypatch.setenv(CHUNK_ENV, "1")  # the input's bytes: one sample per chunk
    small, one = for_provider(step, "cuda")
    monkeypatch.setenv(CHUNK_ENV, str(1 << 40))
    whole, both = for_provider(step, "cuda")
    assert both["patch_bytes_max"] == 2 * one["patch_bytes_max"]
    slices = [sum(n.op_type == "Slice" for n in g.nodes) for g in (small, whole)]
    assert slices[0] > slices[1]
    for bad in ("0", "64MB"):
        monkeypatch.setenv(CHUNK_ENV, bad)
        with pytest.raises(InputError, match=f"MEMCC_PATCH_CHUNK_BYTES={bad}"):
            for_provider(step, "cuda")


def test_compile_for_cuda_plans_the_rewritten_step(tmp_path):
    """Planned, lowered and written for CUDA on a machine without one (costs estimated):
    the file computes the stem's weight gradient (3@32x32, 7x7) from patches, and the load
    pass says how many and how large the largest chunk's patches are. (At ``--budget min``
    the plan may give the stem a chunked variant instead, whose rule is the Conv form.)"""
    model = tmp_path / "resnet.onnx"
    model.write_bytes(build_model("resnet18", batch=2, resolution=32, width=8)
                      .SerializeToString())
    out = tmp_path / "out.onnx"
    result = compile_model(model, CompileOptions(budget="1GB", provider="cuda",
                                                 cost="analytic", offload=False), output=out)
    load = next(p for p in result.report["passes"] if p["name"] == "load")
    assert load["summary"]["conv_weight_grads_as_patches"] == 1
    assert load["summary"]["patch_bytes_max"] == 2 * 49 * 3 * 16 * 16 * 4  # one chunk
    written = load_graph(out)
    roles = TrainingStep.of(written).roles
    # not the joined vectors' (the update's vector parameters, frontend/update_groups.py;
    # the running statistics, batchnorm_for_cuda.py)
    ops = [n.op_type for n in written.nodes if roles.get(n.name) is not Role.UPDATE
           and not (n.op_type == "Concat" and len(written.info[n.output[0]].shape) == 1)]
    # 20 forward Convs and 16 of the 17 k x k weight gradients; the stem's from patches,
    # whose 49 taps' Concat is nested so that a CUDA graph captures it (at most 32 inputs).
    assert load["summary"]["concats_split"] == 1
    assert (ops.count("Conv"), ops.count("Concat"), ops.count("Pad")) == (36, 2, 1)


def test_sixteen_bit_weight_gradients_in_their_own_dtype():
    """fp16 steps: the patches and the MatMul in float16 (CUDA has the kernels; on the CPU
    the sixteen-bit pass computes the MatMul and Pad in float32, as it does the Conv), the
    gradients within float16's rounding of the Conv form's."""
    from memcc.passes.providers.sixteen_bit import for_provider as sixteen_bit

    step = build_training_step(load_graph(build_model("resnet18", batch=2, resolution=64,
                                                      width=16)), BuildOptions(precision="fp16"))
    rewritten, summary = conv_weight_grads_as_patches(step, min_pixels=64)
    assert summary["conv_weight_grads_as_patches"] == 10
    def fp16_matmuls(g: Graph) -> int:
        return sum(n.op_type == "MatMul" and g.info[n.output[0]].dtype == TensorProto.FLOAT16
                   for n in g.nodes)

    assert fp16_matmuls(rewritten) - fp16_matmuls(step) == 10
    _, cuda = sixteen_bit(rewritten, "cuda")
    assert not {"MatMul", "Pad", "Concat", "Slice"} & set(cuda.get("sixteen_bit_emulated", {}))
    grads = _weight_grads(step)
    a, b = sixteen_bit(step.copy(), "cpu")[0], sixteen_bit(rewritten.copy(), "cpu")[0]
    for g in (a, b):
        g.outputs = list(g.outputs) + grads
    feeds = {k: v for k, v in synthetic_feeds(step, 0).items() if k not in step.initializers}
    ra, rb = run_once(a, feeds, 1), run_once(b, feeds, 1)
    for name in grads:
        ref = ra[name].astype(np.float64)
        assert np.all(np.isfinite(ref)) and np.max(np.abs(ref)) > 0, name
        assert np.max(np.abs(ref - rb[name])) <= 1e-2 * np.max(np.abs(ref)), name


def test_swapped_gradient_read_elsewhere_is_written_as_it_was(tmp_path):
    """When the swapped gradient [C, M, kh, kw] has readers other than the rule's final
    swap (here: it is a step output), the rewrite writes that value itself, not the swap's."""
    step = _conv_step(tmp_path, 6, (10, 12), 5, 3, 1, 1)
    conv = next(n for n in step.nodes if n.op_type == "Conv"
                and any(p.key == WEIGHT_GRAD_PROP for p in n.metadata_props))
    dw = json.loads(next(p.value for p in conv.metadata_props
                         if p.key == WEIGHT_GRAD_PROP))["dw"]
    step.outputs.append(dw)
    rewritten, summary = conv_weight_grads_as_patches(step, min_pixels=1)
    assert summary["conv_weight_grads_as_patches"] == 1
    producer = rewritten.producers()[dw]
    assert producer.op_type == "Transpose" and list(producer.attribute[0].ints) == [2, 3, 0, 1]
    _check_matches(step, rewritten)


def test_a_planned_step_is_left_as_planned(tmp_path):
    """``memcc run``/``train`` on CUDA apply the provider's rewrites to a compiled step too:
    its plan covers the forms it was planned with, so its weight gradients stay."""
    step = _conv_step(tmp_path, 8, (28, 28), 4, 3, 1, 1, batch=1)
    step.metadata[PLAN_KEY] = "{}"
    same, summary = conv_weight_grads_as_patches(step)
    assert same is step
    assert summary["conv_weight_grads_kept"] == {"planned step": 1}


def test_conv_transpose_weight_gradient(tmp_path):
    """ConvTranspose's weight gradient is the same rule with x and gy in each other's
    places (``_conv_transpose_grad``): the tag records the operands the rule used."""
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], kernel_shape=[3, 3],
                            strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])
    path = write_model(tmp_path / "ct.onnx", [node], [("x", [2, 4, 7, 9])],
                       [("y", [2, 3, 14, 18])], [w])
    step = build_training_step(load_graph(path), BuildOptions())
    rewritten, summary = conv_weight_grads_as_patches(step, min_pixels=1)
    assert summary["conv_weight_grads_as_patches"] == 1
    assert not topological_problems(rewritten)
    _check_matches(step, rewritten)


def test_a_stale_tag_keeps_the_conv(tmp_path):
    """A tag naming a value no node makes any more (a later pass renamed it) is reported,
    not followed."""
    step = _conv_step(tmp_path, 8, (28, 28), 4, 3, 1, 1, batch=1)
    conv = next(n for n in step.nodes if any(p.key == WEIGHT_GRAD_PROP
                                             for p in n.metadata_props))
    prop = next(p for p in conv.metadata_props if p.key == WEIGHT_GRAD_PROP)
    tag = json.loads(prop.value)
    step.info["gone"] = step.info[tag["gy"]]
    prop.value = json.dumps({**tag, "gy": "gone"})
    same, summary = conv_weight_grads_as_patches(step)
    assert same is step and summary["conv_weight_grads_kept"] == {"stale tag": 1}
