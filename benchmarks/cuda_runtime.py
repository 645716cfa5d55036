"""How memcc's runtime runs a step (issue 29): every variant of ``memcc run`` on each step.

For each step (zoo models built here, or step files given as NAME=PATH) and each variant
(``default``: captured as a CUDA graph where possible; ``nograph``: ``cuda_graph=False``;
``det``: ``--deterministic``), one ``run_steps`` (the code of ``memcc run --json``) prints
one JSON line: step times, measured and predicted peaks (steady and first step), the
device prediction's parts, NVML's readings of each moment, whether the step was captured,
the executed order and the losses. ``--device-pieces`` first prints what the runtime's
pieces cost on the device (an upload of 1 GiB, a session, its first run, a second one).

    python benchmarks/cuda_runtime.py                                   # zoo steps, CUDA
    python benchmarks/cuda_runtime.py gpt2=STEP.onnx --variants default,det,det --steps 6
    python benchmarks/cuda_runtime.py --device-pieces
    python benchmarks/cuda_runtime.py --provider cpu --models mlp      # the code path, here
    python benchmarks/cuda_runtime.py --models resnet50,gpt2 --forms current,unfused,no-bn-reuse

``--forms`` (zoo steps only) builds each step in several forms, to time what issue 30 changed
on the device: ``current`` (as memcc builds and rewrites it now), ``unfused`` (built without
memcc's fusions, ``BuildOptions(fusions=())``), ``no-bn-reuse`` (training-mode BatchNorm
written for CUDA with a backward that recomputes its statistics, as before issue 30: the
step is saved already rewritten, so the runner's own rewrite finds nothing left to do),
``transposed-sums`` (per-channel sums as a transpose and a trailing-axis sum, memcc's CUDA
form before the two-stage sums of ``passes/providers/per_channel_sums.py``; saved
rewritten, likewise), ``conv-grad-as-conv`` (the current
step run with ``MEMCC_CONV_WEIGHT_GRAD=conv``: weight gradients in memcc's Conv form, not
as MatMuls over patches, to time that pass as a whole step), ``patches-unchunked`` (the
current step with each weight gradient's patches in one chunk, ``MEMCC_PATCH_CHUNK_BYTES``).
Each row carries its ``form``.

The figures of BENCHMARKS.md, "Issue 29 on an H200", came from this script (then kept
outside the repository as .gpu/smoke29.py and .gpu/diag29.py): raw lines in
benchmarks/cuda_h200_issue29/.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import numpy as np  # noqa: E402

from memcc.backend.onnx_file import save_graph  # noqa: E402
from memcc.backend.runner import RunRequest, run_steps  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.passes.providers.conv_weight_grad_cuda import CHUNK_ENV, FORM_ENV  # noqa: E402
from models import build_model  # noqa: E402

ZOO = {"mlp": dict(batch=512, in_features=1024, width=1024, depth=4),
       "resnet18": dict(batch=32, resolution=128),
       "resnet50": dict(batch=64, resolution=224),
       "gpt2": dict(batch=4, seq_len=256, vocab_size=8192, width=256, heads=4, depth=4)}
SMALL = {"mlp": dict(batch=8), "resnet18": dict(batch=2), "resnet50": dict(batch=2),
         "gpt2": dict(batch=2)}
FORMS = ("current", "unfused", "no-bn-reuse", "transposed-sums", "conv-grad-as-conv",
         "patches-unchunked")
VARIANTS = {"default": {}, "nograph": {"cuda_graph": False}, "det": {"deterministic": True}}
FIELDS = ("losses", "step_time_s", "measured_peak_bytes", "predicted_peak_bytes",
          "measured_over_predicted", "first_step_measured_bytes",
          "first_step_predicted_bytes", "cuda_graph", "deterministic", "order_matches_plan",
          "executed_order_mismatch", "off_provider_nodes")
MIB = 1 << 20


def run_row(path: Path, provider: str, variant: str, steps: int) -> dict:
    t0 = time.time()
    try:
        d = run_steps(path, RunRequest(steps=steps, provider=provider,
                                       **VARIANTS[variant])).to_json()
        row = {k: d[k] for k in FIELDS}
        row["step_times_ms"] = [round(t * 1000, 2) for t in d["step_times_s"]]
        row["device"] = {k: v for k, v in d["prediction"].get("device", {}).items()
                         if k != "arena"}
        row["readings"] = d["prediction"].get("device_readings")
    except Exception as exc:  # one failing variant must not lose the others' lines
        row = {"error": "".join(traceback.format_exception(exc))[-1500:]}
    row.update(variant=variant, wall_s=round(time.time() - t0, 1))
    return row


def built_form(name: str, sizes: dict, form: str, tmp: Path) -> Path:
    """The zoo step ``name`` in ``form`` (``--forms``), saved under ``tmp``."""
    forward = load_graph(build_model(name, **sizes))
    step = build_training_step(forward, BuildOptions(
        optimizer="sgd", **({"fusions": ()} if form == "unfused" else {})))
    if form == "no-bn-reuse":
        from memcc.passes.providers.batchnorm_for_cuda import expand_training_batchnorm

        step, _ = expand_training_batchnorm(step, reuse_statistics=False)
    if form == "transposed-sums":
        from memcc.passes.providers.batchnorm_for_cuda import expand_training_batchnorm
        from memcc.passes.providers.deterministic_reductions import per_channel, to_trailing_axes

        step, _ = expand_training_batchnorm(step)
        step, _ = to_trailing_axes(step, only=per_channel)
    return save_graph(step, tmp / f"{name}-{form}.onnx")


# Forms that run the current step's file under another setting of the CUDA rewrite it gets
# when loaded (an unplanned step is rewritten by the runner itself).
ENV_FORMS = {"conv-grad-as-conv": {FORM_ENV: "conv"},
             "patches-unchunked": {CHUNK_ENV: str(1 << 40)}}


@contextlib.contextmanager
def _conv_grad_form(form: str):
    """``conv-grad-as-conv``: the current step, run with ``MEMCC_CONV_WEIGHT_GRAD=conv``
    (its weight gradients in memcc's Conv form instead of patches), to time the patches
    pass as a whole step against the step without it; ``patches-unchunked``: with
    ``MEMCC_PATCH_CHUNK_BYTES`` above any patches (one chunk each), to time the chunks'
    Slices."""
    env = ENV_FORMS.get(form, {})
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def device_pieces() -> dict:
    """NVML around the runtime's pieces: an upload, a session, its first run."""
    import onnx

    from memcc.backend.device_step import upload
    from memcc.backend.memory import NvmlPeakMeter, device_baseline
    from memcc.backend.session import make_session

    out: dict[str, object] = {}
    device_baseline()
    m = NvmlPeakMeter()
    u0 = m.used()
    arrays = {f"a{i}": np.full((64, 1024, 1024), i + 1, np.float32) for i in range(4)}
    arrays["small"] = np.arange(10, dtype=np.int64)
    values = upload(arrays, "cuda")
    out["upload_delta_MB"] = (m.used() - u0) / MIB
    out["upload_expected_MB"] = sum(a.nbytes for a in arrays.values()) / MIB
    out["upload_values_ok"] = all(np.array_equal(values[k].numpy(), arrays[k]) for k in arrays)
    values["a0"].update_inplace(np.zeros((64, 1024, 1024), np.float32))
    out["update_inplace_ok"] = float(values["a0"].numpy().max()) == 0.0
    del values
    gc.collect()
    u2 = m.used()
    out["after_free_delta_MB"] = (u2 - u0) / MIB
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [256, 256])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [256, 256])])
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = {"x": np.ones((256, 256), np.float32)}
    first = make_session(model, "cuda")
    u3 = m.used()
    out["session_created_delta_MB"] = (u3 - u2) / MIB
    first.run(None, x)
    u4 = m.used()
    out["session_first_run_delta_MB"] = (u4 - u3) / MIB
    second = make_session(model, "cuda")
    second.run(None, x)
    out["second_session_delta_MB"] = (m.used() - u4) / MIB
    del first, second
    gc.collect()
    out["after_sessions_freed_delta_MB"] = (m.used() - u2) / MIB
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps_files", nargs="*", metavar="NAME=PATH",
                    help="step files to run instead of the zoo's")
    ap.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--models", default=",".join(ZOO), help="zoo steps to build")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated, repeats allowed (default,nograph,det)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--forms", default="current",
                    help=f"comma-separated forms of each zoo step ({', '.join(FORMS)})")
    ap.add_argument("--batch", type=int, help="the zoo steps' batch (default: ZOO's)")
    ap.add_argument("--width", type=int,
                    help="the zoo ResNets' width (default 16; torchvision's is 64)")
    ap.add_argument("--device-pieces", action="store_true",
                    help="print what the runtime's pieces cost on the device (CUDA) first")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    forms = [f for f in args.forms.split(",") if f]
    if sorted(set(forms) - set(FORMS)):
        ap.error(f"--forms: unknown {sorted(set(forms) - set(FORMS))}; choose from {FORMS}")
    if args.device_pieces:
        print(json.dumps({"device_pieces": device_pieces()}), flush=True)
    with tempfile.TemporaryDirectory(prefix="memcc-cuda-runtime-") as tmp:
        if args.steps_files:
            cases = [(a.split("=", 1)[0], "file", Path(a.split("=", 1)[1]))
                     for a in args.steps_files]
        else:
            sizes = ZOO if args.provider == "cuda" else SMALL
            # A form named twice (rows interleaved by form) is built once; the
            # ENV_FORMS rows run the current step's file.
            built: dict[tuple[str, str], Path] = {}
            cases = []
            for name in [m for m in args.models.split(",") if m]:
                for form in forms:
                    key = (name, "current" if form in ENV_FORMS else form)
                    if key not in built:
                        dims = {**sizes[name], **({"batch": args.batch} if args.batch else {}),
                                **({"width": args.width}
                                   if args.width and name.startswith("resnet") else {})}
                        built[key] = built_form(name, dims, key[1], Path(tmp))
                    cases.append((name, form, built[key]))
        for name, form, path in cases:
            for variant in variants:
                with _conv_grad_form(form):
                    row = run_row(path, args.provider, variant, args.steps)
                print(json.dumps({"model": name, "form": form, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
