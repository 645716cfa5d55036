"""1x1 convolutions' weight gradients in fewer nodes: memcc's form against the shorter
spellings issue 30 asked about, layer by layer on ORT's CPU provider.

memcc writes a 1x1 weight gradient as a batched MatMul and a sum over the batch, or as one
MatMul over flattened copies (``memcc/frontend/gradients/nn.py`` ``_pointwise_weight_grad``,
five or six nodes). The candidates here are fewer nodes:

``einsum``       ``Einsum("nmhw,nchw->mc")`` on gy and x as they are, then a Reshape to the
                 weight's shape (two nodes).
``einsum-ones``  the same Einsum with a third operand, ones of shape [1, 1], whose axes give
                 the weight's trailing 1s (``nmhw,nchw,ij->mcij``: one node).
``gy-left``      where memcc multiplies x by gy transposed and transposes the [C, M] result
                 (more input than output channels), gy by x transposed instead (one
                 Transpose fewer).

Every distinct 1x1 layer of the zoo's ResNet-50 at ``--batch`` x ``--resolution`` (the
shapes of ``benchmarks/conv_weight_grad.py``) runs under memcc's execution contract with
``--threads`` intra-op threads, in interleaved rounds (``benchmarks/stats.py``); printed per
layer and form: memcc's median, the form's, their ratio with its 95% interval, and whether
the form's dW is memcc's bits (else the largest difference over dW's largest magnitude).

    python benchmarks/pointwise_grad_forms.py [--threads 1] [--rounds 30] [--batch 8]
        [--resolution 64] [--forms einsum,einsum-ones,gy-left] [--shape SPEC ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

from benchmarks.conv_weight_grad import (  # noqa: E402
    ConvShape,
    _Net,
    _strided_x,
    memcc_form,
    network_shapes,
    parse_shape,
)
from benchmarks.stats import interleaved_times, ratio_interval  # noqa: E402


def _memcc(s: ConvShape) -> onnx.ModelProto:
    """memcc's rule as a built step has it: fused (Transposes into FusedMatMul)."""
    from memcc.frontend.fuse import fuse
    from memcc.frontend.load import load_graph

    return fuse(load_graph(memcc_form(s)), forward=frozenset())[0].to_model()


def _einsum(s: ConvShape, ones: bool = False) -> onnx.ModelProto:
    net = _Net()
    x = _strided_x(net, s)
    if ones:
        net.inits.append(numpy_helper.from_array(np.ones((1, 1), np.float32), "ones"))
        return net.model(net.op("Einsum", ["gy", x, "ones"], equation="nmhw,nchw,ij->mcij"), s)
    dw = net.op("Einsum", ["gy", x], equation="nmhw,nchw->mc")
    return net.model(net.reshape(dw, list(s.w)), s)


def _gy_left(s: ConvShape) -> onnx.ModelProto:
    n, c = s.x[:2]
    m, p = s.w[0], s.out[0] * s.out[1]
    net = _Net()
    gr, xr = net.reshape("gy", [n, m, p]), net.reshape(_strided_x(net, s), [n, c, p])
    prod = net.op("FusedMatMul", [gr, xr], domain="com.microsoft", transB=1)
    model = net.model(net.reshape(net.reduce_sum(prod, [0]), list(s.w)), s)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


FORMS = {"einsum": _einsum, "einsum-ones": lambda s: _einsum(s, ones=True),
         "gy-left": _gy_left}


def measure(s: ConvShape, forms: list[str], threads: int, rounds: int) -> dict:
    """memcc's form and ``forms`` on layer ``s``: medians, ratios, same bits or not."""
    from memcc.backend.session import SessionSettings, make_session

    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(s.x).astype(np.float32),
             "gy": rng.standard_normal((s.x[0], s.w[0], *s.out)).astype(np.float32)}
    runs, outs = {}, {}
    for name in ["memcc", *forms]:
        sess = make_session((_memcc if name == "memcc" else FORMS[name])(s), "cpu",
                            SessionSettings(intra_op_threads=threads))
        outs[name] = sess.run(None, feeds)[0]
        runs[name] = (lambda sess=sess: sess.run(None, feeds))
    times = interleaved_times(runs, rounds=rounds, warmup=1)
    ref = outs["memcc"].astype(np.float64)
    row = {"memcc_ms": 1e3 * float(np.median(times["memcc"])), "forms": {}}
    for name in forms:
        ri = ratio_interval(times["memcc"], times[name])
        diff = float(np.max(np.abs(outs[name] - ref))) / float(np.max(np.abs(ref)))
        row["forms"][name] = {"ms": ri.b_median_s * 1e3, "ratio": ri.cell(), "difference": diff}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--shape", type=parse_shape, action="append", default=None)
    args = ap.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    if unknown := set(forms) - set(FORMS):
        ap.error(f"unknown form(s) {sorted(unknown)}; choose from {sorted(FORMS)}")
    shapes = args.shape or [s for s in network_shapes(["resnet50"], args.batch,
                                                      args.resolution) if s.kind == "pointwise"]
    print(f"{args.threads} threads, {args.rounds} rounds; form ms, form / memcc (95% CI), "
          "= same bits as memcc's or the largest difference")
    for s in shapes:
        row = measure(s, forms, args.threads, args.rounds)
        flat = min(s.w[0], s.x[1]) >= s.out[0] * s.out[1]
        cells = [f"{k} {v['ms']:.2f} {v['ratio']} "
                 + ("=" if v["difference"] == 0 else f"{v['difference']:.1e}")
                 for k, v in row["forms"].items()]
        print(f"{s.label} x{s.count} ({'flat' if flat else 'batched'}): memcc "
              f"{row['memcc_ms']:.2f} | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
