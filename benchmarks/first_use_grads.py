"""Gradients of the first-use image and audio models' memcc steps against torch, in float32
and float64 (BENCHMARKS.md, session 29's and 30's first-use sweeps).

Each case of ``first_use_models.py`` (image and audio models; the transformers text
architectures have ``transformers_sweep.py``, the recurrent ones
tests/test_exports_grad.py) is exported again with every dropout and drop-path rate set
to 0 and no two parameters equal, built with ``--optimizer none`` and run in ONNX
Runtime (2 threads). Its loss and its parameter gradients are compared with torch
autograd on the same batch, in float32 and in float64, for every parameter the export
stores as torch holds it (not a BatchNorm folded into a convolution, which the dynamo
exporter's optimizer and eval-mode exports write). A random-weight convnet at small size
is sensitive to rounding (a ReLU or a max-pool window flips): where memcc and torch's
float32 disagree, the float64 gradient says which is off. Errors are per parameter,
relative to the larger of the gradient's largest magnitude and 1e-3 of the largest over
all parameters (a parameter before a BatchNorm has a gradient that is zero up to
rounding), the worst over all parameters. The segmentation cases (``seg_`` models, logits
[N, 5, H, W]) are built with ``--class-axis 1 --ignore-index 255`` and compared with
``cross_entropy(..., ignore_index=255)`` on labels [N, H, W] a tenth of them 255.
In train-mode cases the running statistics the step carries (BatchNorm's ``running_mean``
and ``running_var`` under torch's buffer names) are held against torch's after the same
forward from the same starting values (the last column; same relative measure).

    pip install timm torchvision      # in a venv of their own (see first_use_models.py)
    python benchmarks/first_use_grads.py --cases googlenet.ts.train,mnasnet.noopt.train
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import first_use_models as fu
import numpy as np
import onnxruntime as ort
import torch

from memcc.backend.onnx_file import save_graph
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]
from exports import _jitter_constant_parameters  # noqa: E402  (tests/exports.py)


def _deterministic(model: torch.nn.Module) -> torch.nn.Module:
    """Every dropout and stochastic-depth rate 0, and no two parameters equal: exporters
    store equal constant tensors once (every zero-initialised bias as one initializer), so
    a gradient could not be told apart from its twins'."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout) or type(mod).__name__ == "StochasticDepth":
            mod.p = 0.0
        for k, v in list(vars(mod).items()):  # drop_path_prob, drop_rate, ...
            if "drop" in k and isinstance(v, float):
                setattr(mod, k, 0.0)
    _jitter_constant_parameters(model, torch.Generator().manual_seed(1))
    return model


def _labels(model_name: str, batch: int, px: int) -> tuple[np.ndarray, dict]:
    """A classifier's labels of 10 classes, or a segmenter's [N, H, W] of 5 classes with a
    tenth of the pixels 255 (void); the build options and torch's loss options for them."""
    rng = np.random.default_rng(0)
    if not model_name.startswith("seg_"):
        return rng.integers(0, 10, size=(batch,)).astype(np.int64), {}
    labels = rng.integers(0, 5, size=(batch, px, px)).astype(np.int64)
    labels[rng.random(labels.shape) < 0.1] = 255
    return labels, {"class_axis": 1, "ignore_index": 255}


def _torch_grads(model: torch.nn.Module, x: np.ndarray, labels: np.ndarray,
                 dtype: torch.dtype, stats: dict[str, np.ndarray] | None = None
                 ) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and parameter gradients; with ``stats`` (running statistics by buffer name,
    the step's initial ones), the buffers start from them, and ``stats`` receives the
    values the forward left (a train-mode export ran the module once already)."""
    m = copy.deepcopy(model).to(dtype)
    buffers = dict(m.named_buffers())
    with torch.no_grad():
        for k, v in (stats or {}).items():
            buffers[k].copy_(torch.from_numpy(np.array(v)))
    loss = torch.nn.functional.cross_entropy(m(torch.from_numpy(x).to(dtype)),
                                             torch.from_numpy(labels), ignore_index=255)
    loss.backward()
    if stats is not None:
        stats.update({k: buffers[k].double().numpy() for k in stats})
    return float(loss), {n: p.grad.double().numpy() for n, p in m.named_parameters()
                         if p.grad is not None}


def _worst(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> tuple[float, str]:
    floor = 1e-3 * max(float(np.abs(g).max()) for g in ref.values())
    return max(((float(np.abs(got[k] - ref[k]).max()) /
                 max(float(np.abs(ref[k]).max()), floor), k) for k in ref if k in got),
               default=(float("nan"), "none"))


def check(case: tuple) -> dict:
    name, model_name, exporter, train, batch, px, dyn = case
    torch.manual_seed(0)
    model, args, names = fu._inputs(model_name, batch, px)
    _deterministic(model).train(train)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        torch.manual_seed(0)
        fu.export(case, path, module=(model, args, names))
        labels, seg = _labels(model_name, batch, px)
        step = build_training_step(load_graph(path, {"batch": batch} if dyn else None),
                                   BuildOptions(optimizer="none", **seg))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        sess = ort.InferenceSession(str(save_graph(step, Path(tmp) / "s.onnx")), opts,
                                    providers=["CPUExecutionProvider"])
        x = args[0].numpy()
        fed = {i.name for i in sess.get_inputs()}
        out = dict(zip([o.name for o in sess.get_outputs()],
                       sess.run(None, {k: v for k, v in {names[0]: x, "labels": labels}.items()
                                       if k in fed}), strict=True))
    # Only the parameters the export stores as torch holds them (a folded BatchNorm's
    # convolution holds other values, so its gradient is another one).
    torch_values = {n: p.detach().numpy() for n, p in model.named_parameters()}
    memcc = {k[:-5]: v.astype(np.float64) for k, v in out.items() if k.endswith(".grad")
             and k[:-5] in torch_values and np.array_equal(
                 np.asarray(step.initializers[k[:-5]]).reshape(-1),
                 torch_values[k[:-5]].reshape(-1))}
    # The BatchNorm running statistics the step carries under torch's buffer names.
    buffers = dict(model.named_buffers())
    stats = {k[:-4]: np.asarray(step.initializers[k[:-4]]) for k in out
             if k.endswith(".new") and k[:-4] in buffers and "running_" in k}
    loss32, g32 = _torch_grads(model, x, labels, torch.float32, stats)
    loss64, g64 = _torch_grads(model, x, labels, torch.float64)
    carried = {k: out[f"{k}.new"].astype(np.float64) for k in stats}
    return {"case": name, "loss_memcc": float(out["loss"]), "loss_torch32": loss32,
            "running_stats": (_worst(carried, stats) if stats else (float("nan"), "none")),
            "stats_compared": len(stats),
            "loss_torch64": loss64, "compared": len(set(memcc) & set(g64)), "of": len(g64),
            "memcc_vs_torch32": _worst(memcc, g32), "memcc_vs_torch64": _worst(memcc, g64),
            "torch32_vs_torch64": _worst(g32, g64)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: "
                    "every image case)")
    a = ap.parse_args()
    fu._torchvision_schemas()
    wanted = set(a.cases.split(",")) if a.cases else None
    print("| case | loss memcc / torch fp32 | gradients compared | memcc vs torch fp32 | "
          "memcc vs torch fp64 | torch fp32 vs torch fp64 | running statistics vs torch "
          "fp32 |\n|---|---|---|---|---|---|---|")
    for case in fu.CASES:
        if case[1].startswith(("hf_", "rnn_")) or (wanted is not None and case[0] not in wanted):
            continue
        r = check(case)
        cells = [f"{r[k][0]:.1e} ({r[k][1]})" for k in
                 ("memcc_vs_torch32", "memcc_vs_torch64", "torch32_vs_torch64")]
        cells.append(f"{r['running_stats'][0]:.1e} ({r['stats_compared']} compared; "
                     f"worst {r['running_stats'][1]})")
        print(f"| {r['case']} | {r['loss_memcc']:.6f} / {r['loss_torch32']:.6f} | "
              f"{r['compared']} of {r['of']} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
