"""``frontend.kernel_coverage``: which provider runs an op in bfloat16 / float16 with a kernel of
its own. Autocast and ``passes.providers.sixteen_bit`` trust ``has_kernel_for``; these tests
pin it against what ORT's CPU provider does with a one-node model (so a new onnxruntime that
adds or drops a 16-bit kernel turns CI red: .ci/run reruns this file on the newest release),
and check the CUDA table that memcc ships (read from ORT's source, not measured).
"""

from __future__ import annotations

import json

import pytest
from onnx import TensorProto

from benchmarks.kernel_coverage import (
    UNTYPED_16BIT,
    check_against_doc,
    one_node_model,
    parse_registrations,
    providers_in_profile,
    session_says,
)
from memcc.frontend.kernel_coverage import (
    CUDA_TABLE,
    coverage_table,
    cuda_table,
    float_constraint,
    has_kernel_bound,
    has_kernel_for,
)

BF16, FP16 = TensorProto.BFLOAT16, TensorProto.FLOAT16
# What onnxruntime 1.31.1 and 1.32.0's CPU provider do at opset 17 (docs/PRECISION.md,
# "Kernel coverage"): True where it runs the node in that type as written.
CPU_17 = {
    ("MatMul", BF16): False, ("MatMul", FP16): False,
    ("Relu", BF16): False, ("Relu", FP16): False,
    ("Equal", BF16): False, ("Equal", FP16): False,
    ("Max", BF16): False, ("Max", FP16): True,
    ("Expand", BF16): False, ("Expand", FP16): True,
    ("LayerNormalization", BF16): True, ("LayerNormalization", FP16): True,
    ("Transpose", BF16): True, ("Transpose", FP16): True,
    ("Shape", BF16): True, ("Shape", FP16): True,
    ("Cast", BF16): True, ("Cast", FP16): True,
}


@pytest.mark.parametrize(("op", "dtype"), [
    pytest.param(op, dtype, id=f"{op}-{'bf16' if dtype == BF16 else 'fp16'}")
    for op, dtype in CPU_17])
def test_cpu_registry_agrees_with_a_one_node_session(op: str, dtype: int) -> None:
    """The registry's answer is the session's: a kernel exactly where ORT neither fails
    (bfloat16) nor wraps the node in Casts of its own (float16)."""
    said = session_says(one_node_model(op, dtype, 17))
    assert has_kernel_for(op, 17, dtype, "cpu") == (said == "kernel"), said
    assert (said == "kernel") == CPU_17[op, dtype], (
        f"onnxruntime's CPU provider changed its {op} kernel in type {dtype}: rerun "
        "python -m benchmarks.kernel_coverage and update docs/PRECISION.md")


def test_a_float16_op_without_kernel_gets_ort_casts_and_a_bfloat16_one_fails() -> None:
    """The two failure modes the sixteen_bit pass exists for, as the benchmark sees them."""
    assert session_says(one_node_model("MatMul", FP16, 17)) == "casts"
    assert session_says(one_node_model("MatMul", BF16, 17)) == "fails"
    # At opset 18 Relu is also an ONNX function: ORT inlines it instead (Cast + Max).
    assert session_says(one_node_model("Relu", FP16, 18)) == "inlined"


def test_the_profile_names_the_provider_of_each_node(tmp_path) -> None:
    """The CUDA check (``--provider cuda``, needs a GPU) reads the provider that ran the node
    from ORT's profile; the parsing is checked here on a CPU session."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    sess = ort.InferenceSession(one_node_model("MatMul", FP16, 17).SerializeToString(),
                                options, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    binding.bind_output("out0")
    sess.run_with_iobinding(binding)
    ran_on = providers_in_profile(sess.end_profiling())
    assert ran_on["MatMul_node"] == "CPUExecutionProvider"
    assert {"InsertedPrecisionFreeCast_in0", "InsertedPrecisionFreeCast_out0"} <= set(ran_on)


def test_float_constraint_follows_the_float_data() -> None:
    """Output's constraint where it admits float, else the first float input's."""
    assert float_constraint("Add", 17) == "T"
    assert float_constraint("Cast", 17) == "T2"           # the type it casts to
    assert float_constraint("Shape", 17) == "T"           # output int64: the input's
    assert float_constraint("Equal", 17) == "T"           # output bool
    assert float_constraint("IsNaN", 17) == "T1"
    assert float_constraint("ArgMax", 17) == "T"          # output a literal tensor(int64)
    assert float_constraint("And", 17) is None            # bool only
    assert float_constraint("NoSuchOp", 17) is None


def test_cuda_table_is_read_from_source_and_answers() -> None:
    table = cuda_table()
    assert table["measured"] is False and len(table["commit"]) == 40
    assert table["checked_against"].startswith("docs/OperatorKernels.md")
    assert json.loads(CUDA_TABLE.read_text())["ops"] == table["ops"]
    for dtype in (BF16, FP16):
        assert has_kernel_for("MatMul", 17, dtype, "cuda")
        assert has_kernel_for("LayerNormalization", 17, dtype, "cuda")
        assert has_kernel_for("Cast", 17, dtype, "cuda")
    assert has_kernel_for("Conv", 17, FP16, "cuda")
    assert not has_kernel_for("Conv", 17, BF16, "cuda")      # cuDNN conv: no bf16 kernel
    assert not has_kernel_for("Range", 17, FP16, "cuda")     # registered, float types only
    assert not has_kernel_for("Mish", 18, FP16, "cuda")      # not registered at all
    assert not has_kernel_for("FusedMatMul", 17, FP16, "cuda", "com.microsoft")
    # Ranges: MatMul-9..12 has float16 only; bfloat16 from 13.
    assert has_kernel_for("MatMul", 12, FP16, "cuda")
    assert not has_kernel_for("MatMul", 12, BF16, "cuda")


def test_has_kernel_bound_asks_every_constraint_on_cpu_and_the_table_on_cuda() -> None:
    """``passes.providers.sixteen_bit`` asks with the node's bound types."""
    assert has_kernel_bound("Max", 17, {"T": FP16}, "cpu")
    assert not has_kernel_bound("Max", 17, {"T": BF16}, "cpu")
    assert has_kernel_bound("Shape", 17, {"T": BF16, "T1": TensorProto.INT64}, "cpu")
    assert has_kernel_bound("MatMul", 17, {"T": BF16}, "cuda")
    assert not has_kernel_bound("Greater", 17, {"T": BF16, "T1": TensorProto.BOOL}, "cuda")
    assert has_kernel_bound("Greater", 17, {"T": FP16, "T1": TensorProto.BOOL}, "cuda")
    # Casts both ways: the table lists 16-bit types only, and a widening Cast binds its
    # float constraint (T2) to float32; the question is its bfloat16 input's.
    assert has_kernel_bound("Cast", 17, {"T1": BF16, "T2": TensorProto.FLOAT}, "cuda")
    assert has_kernel_bound("Cast", 17, {"T1": TensorProto.FLOAT, "T2": BF16}, "cuda")
    assert not has_kernel_bound("Conv", 17, {"T": BF16}, "cuda")
    assert has_kernel_bound("Conv", 17, {"T": FP16}, "cuda")


def test_a_bf16_step_for_cuda_emulates_no_cast() -> None:
    """Every Cast autocast writes has a CUDA kernel (ORT's source registers Cast for
    bfloat16 and float16 both ways): none may be computed in float32 between casts."""
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from memcc.passes.providers.sixteen_bit import for_provider
    from models import build_model

    step = build_training_step(load_graph(build_model("gpt2", batch=2, seq_len=16, width=32,
                                                      depth=1, heads=2)),
                               BuildOptions(precision="bf16"))
    _, report = for_provider(step, "cuda")
    emulated = report.get("sixteen_bit_emulated", {})
    assert "Cast" not in emulated and "MatMul" not in emulated


def test_run_and_train_say_which_nodes_a_16_bit_step_computes_in_float32(tmp_path) -> None:
    """Compile warned that a bf16 step's MatMuls run in float32 between casts on the CPU
    (slower than the float32 build); ``memcc run`` and ``train`` said nothing of it."""
    from memcc import Trainer
    from memcc.backend.onnx_file import save_graph
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from models import build_model

    step = build_training_step(load_graph(build_model("gpt2", batch=2, seq_len=16, width=32,
                                                      depth=1, heads=2)),
                               BuildOptions(precision="bf16"))
    trainer = Trainer(save_graph(step, tmp_path / "bf16.onnx"), provider="cpu")
    said = [n for n in trainer.notes if "no 16-bit kernel" in n]
    assert said and "MatMul" in said[0] and "float32 between casts" in said[0]


def test_coverage_table_rows() -> None:
    rows = coverage_table("cuda", ["MatMul", "Conv"], 17)
    assert [(r["op"], r["bfloat16"], r["float16"]) for r in rows] == [
        ("MatMul", True, True), ("Conv", False, True)]
    assert rows[0]["source"].startswith("source, not measured")
    cpu = coverage_table("cpu", ["Transpose"], 17)
    assert cpu == [{"op": "Transpose", "opset": 17, "provider": "cpu", "bfloat16": True,
                    "float16": True, "source": "registry"}]


def _entry(kind: str, args: str) -> str:
    return (f"      BuildKernelCreateInfo<ONNX_OPERATOR_{kind}KERNEL_CLASS_NAME("
            f"kCudaExecutionProvider, {args})>,")


SOURCE = "\n".join([
    "static Status RegisterCudaKernels(KernelRegistry& kernel_registry) {",
    "  static const BuildKernelCreateInfoFn function_table[] = {",
    _entry("VERSIONED_TYPED_", "kOnnxDomain, 9, 12, MLFloat16, MatMul"),
    _entry("TYPED_", "kOnnxDomain, 13, BFloat16, MatMul"),
    _entry("TYPED_", "kOnnxDomain, 13, MLFloat16, MatMul"),
    _entry("TYPED_", "kOnnxDomain, 13, float, MatMul"),
    "// " + _entry("TYPED_", "kOnnxDomain, 1, MLFloat16, Gone"),
    _entry("TYPED_", "kOnnxDomain, 13, float, Cast"),
    _entry("TYPED_", "kOnnxDomain, 11, int64_t_MLFloat16_int64_t, OneHot"),
    _entry("", "kOnnxDomain, 13, Transpose"),
    _entry("", "kMSDomain, 1, FusedThing"),
    "  };",
])
CONTRIB = "\n".join([
    "Status RegisterCudaContribKernels(KernelRegistry& kernel_registry) {",
    "  static const BuildKernelCreateInfoFn function_table[] = {",
    "      BuildKernelCreateInfo<CUDA_ONNX_OP_VERSIONED_TYPED_CLASS_NAME("
    "1, 16, BFloat16_float_BFloat16, LayerNormalization)>,",
    "  };",
])
DOC = "\n".join([
    "## Operators implemented by CUDAExecutionProvider",
    "|**Operator Domain:** *ai.onnx*||||",
    "|MatMul|*in* A:**T**<br> *out* Y:**T**|13+|**T** = tensor(bfloat16), tensor(float16)|",
    "|||[9, 12]|**T** = tensor(double), tensor(float)|",
    "|Transpose|*in* data:**T**|13+|**T** = tensor(bfloat16), tensor(float16)|",
    "|**Operator Domain:** *com.microsoft*||||",
    "|OneHot|*in* x:**T**|11+|**T** = tensor(float16)|",
    "## Operators implemented by DmlExecutionProvider",
])


def test_parse_registrations_reads_typed_untyped_and_named_types() -> None:
    ops = parse_registrations(SOURCE, CONTRIB)
    assert ops["LayerNormalization"] == [[1, 16, ["bfloat16"]]]   # the contrib shorthand
    assert ops["MatMul"] == [[9, 12, ["float16"]], [13, None, ["bfloat16", "float16"]]]
    assert ops["Cast"] == [[13, None, ["bfloat16", "float16"]]]   # output T2: every type
    assert ops["OneHot"] == [[11, None, ["float16"]]]
    assert ops["Transpose"] == [[13, None, ["bfloat16", "float16"]]]
    assert "Gone" not in ops and "FusedThing" not in ops


def test_check_against_doc_names_each_difference() -> None:
    """ORT's generated OperatorKernels.md is the second reading of the same registry."""
    agree, differ = check_against_doc(parse_registrations(SOURCE), DOC)
    assert agree == 2                                   # MatMul-13, Transpose-13
    assert "MatMul-9: source ['float16'], doc []" in differ
    assert "OneHot-11: not in the doc" in differ        # its row is another domain's
    assert "Cast-13: not in the doc" in differ


def test_parse_registrations_refuses_an_untyped_kernel_it_was_not_told_about() -> None:
    assert "Frobnicate" not in UNTYPED_16BIT
    source = SOURCE.replace("13, Transpose", "13, Frobnicate")
    with pytest.raises(SystemExit, match="Frobnicate"):
        parse_registrations(source)
