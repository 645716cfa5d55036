"""The CUDA path's load-time rewrites on real exports, checked on the CPU (session 42).

``--provider cuda`` rewrites a step before planning (``memcc/passes/providers/
provider_step.py``: training BatchNorm as reductions, k x k weight gradients as patches,
per-channel sums over trailing axes, wide Concats nested). Those forms are standard ONNX,
so ORT's CPU provider runs them: this sweep exports torchvision, timm and transformers
models (random weights, train mode, tiny sizes) and checks, per model, that the CUDA step
computes what the CPU step computes.

    # 1. export (needs torchvision, timm, transformers: a venv of their own)
    /tmp/walk6/venv/bin/python benchmarks/cuda_rewrite_sweep.py export --out DIR [--cases a,b]
    # 2. check (memcc's venv)
    python benchmarks/cuda_rewrite_sweep.py check DIR [--cases a,b] [--no-cli]

``check`` prints one markdown row per model: what ``for_provider(step, "cuda")`` rewrote
(BatchNorms, weight gradients as patches / kept by reason, wide Concats split), the
difference of the rewritten step from the step as built on the output furthest past its
tolerance (relative to that output's largest magnitude, over 1 and 2 intra-op threads) and
the name of that output, the
same with every weight gradient forced into the patches form (rule off: every 2-D,
ungrouped convolution), the step's own sensitivity (the step as built fed its float inputs
times 1 + 1e-6) on the worst output, and, unless ``--no-cli``, the outcome and wall time of
``memcc compile --provider cuda`` at ``--budget 60%`` and ``min`` and of ``memcc analyze
--provider cuda``; the compiled ``min`` file is then run on the CPU too (Memcpy nodes as
Identity) and compared the same way (``file`` column). Tolerance (docs/CUDA.md): 1e-4 of each
output's largest magnitude, running statistics 1e-5; ``FAIL`` marks a difference over it that
is also over 10x the step's own sensitivity.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TOL, STATS_TOL, NOISE = 1e-4, 1e-5, 1e-6

# name, model, exporter, batch, size (px; tokens for text; samples for audio)
CASES = [
    ("resnet18.ts", "tv_resnet18", "torchscript", 4, 64),
    ("resnet18.noopt", "tv_resnet18", "dynamo_noopt", 4, 64),
    ("mobilenetv3.ts", "tv_mobilenet_v3_small", "torchscript", 4, 64),
    ("mobilenetv3.noopt", "tv_mobilenet_v3_small", "dynamo_noopt", 4, 64),
    ("densenet121.ts", "tv_densenet121", "torchscript", 4, 64),
    ("efficientnet_b0.noopt", "tv_efficientnet_b0", "dynamo_noopt", 2, 64),
    ("shufflenet.ts", "tv_shufflenet_v2", "torchscript", 4, 64),
    ("squeezenet.ts", "tv_squeezenet1_1", "torchscript", 4, 64),
    ("r3d_18.ts", "tv_r3d_18", "torchscript", 2, 32),
    ("r3d_18.noopt", "tv_r3d_18", "dynamo_noopt", 2, 32),
    ("conv1d_bn.ts", "conv1d_bn", "torchscript", 4, 256),
    ("conv1d_bn.noopt", "conv1d_bn", "dynamo_noopt", 4, 256),
    ("convs_mixed.ts", "convs_mixed", "torchscript", 4, 40),
    ("convs_mixed.noopt", "convs_mixed", "dynamo_noopt", 4, 40),
    ("wav2vec2.ts", "audio_wav2vec2", "torchscript", 2, 1600),
    ("regnetx_002.ts", "timm_regnetx_002", "torchscript", 2, 64),
    ("convnext_atto.ts", "timm_convnext_atto", "torchscript", 2, 64),
    ("hf_resnet.noopt", "hf_resnet", "dynamo_noopt", 4, 32),
    ("hf_gpt2.noopt", "hf_gpt2", "dynamo_noopt", 4, 32),
    ("hf_vit.ts", "hf_vit", "torchscript", 4, 32),
]


def _extra_models(name: str, batch: int, size: int):
    """Models the first-use sweep does not have: (module, inputs, input names) or None."""
    import torch

    if name == "tv_r3d_18":  # 3-D convolutions and BatchNorm3d (video)
        from torchvision.models.video import r3d_18
        return r3d_18(num_classes=10), (torch.randn(batch, 3, 4, size, size),), ["x"]
    if name == "timm_regnetx_002":  # grouped 3x3 convolutions
        import timm
        return timm.create_model("regnetx_002", num_classes=10), (
            torch.randn(batch, 3, size, size),), ["x"]
    if name == "tv_densenet121":
        import torchvision.models as tv
        return tv.densenet121(num_classes=10), (torch.randn(batch, 3, size, size),), ["x"]
    if name == "conv1d_bn":  # 1-D convolutions with BatchNorm1d, a strided and a dilated one
        nn = torch.nn
        model = nn.Sequential(
            nn.Conv1d(2, 16, 9, stride=2, padding=4), nn.BatchNorm1d(16), nn.ReLU(),
            nn.Conv1d(16, 16, 3, padding=2, dilation=2), nn.BatchNorm1d(16), nn.ReLU(),
            nn.Conv1d(16, 16, 5, padding=2, groups=16), nn.BatchNorm1d(16), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, 10))
        return model, (torch.randn(batch, 2, size),), ["x"]
    if name == "convs_mixed":  # depthwise, grouped, dilated, strided, asymmetric 2-D
        nn = torch.nn
        model = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=2, dilation=2, groups=4), nn.BatchNorm2d(32),
            nn.ReLU(), nn.Conv2d(32, 16, (1, 3), padding=(0, 1)), nn.BatchNorm2d(16),
            nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=0), nn.BatchNorm2d(16),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
        return model, (torch.randn(batch, 3, size, size),), ["x"]
    return None


def export_all(out: Path, wanted: set[str] | None) -> None:
    """Export every wanted case to ``out/<case>.onnx`` in train mode (one line each)."""
    import warnings

    import first_use_models as fu

    warnings.filterwarnings("ignore")
    fu._torchvision_schemas()
    out.mkdir(parents=True, exist_ok=True)
    for name, model, exporter, batch, size in CASES:
        if wanted and name not in wanted:
            continue
        path = out / f"{name}.onnx"
        t0 = time.perf_counter()
        try:
            import torch
            torch.manual_seed(0)
            module = _extra_models(model, batch, size)
            fu.export((name, model, exporter, True, batch, size, False), path, module)
            print(f"{name}: exported in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - one failure must not stop the sweep
            print(f"{name}: export failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference over ``a``'s largest magnitude; 0 where both are noise."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if a64.shape != b64.shape:
        return float("inf")
    if a64.size == 0:
        return 0.0
    diff = float(np.max(np.abs(a64 - b64)))
    top = float(np.max(np.abs(a64)))
    if diff <= NOISE and top <= NOISE:
        return 0.0
    return diff / max(top, 1e-30)


def running_statistics(step) -> set[str]:
    """The step's updated BatchNorm running statistics (outputs held to STATS_TOL)."""
    from memcc.step import TrainingStep
    bn_inputs = {i for n in step.nodes if n.op_type == "BatchNormalization"
                 for i in n.input[3:5]}
    return {out for out, inp in TrainingStep.of(step).state.items() if inp in bn_inputs}


def compare(reference: dict, other: dict, names: list[str], stats: set[str] = frozenset()
            ) -> tuple[float, str]:
    """The relative difference, over ``names``, of the output furthest past its tolerance
    (running statistics ``STATS_TOL``, the rest ``TOL``), and that output."""
    worst, where, ratio = 0.0, "", 0.0
    for name in names:
        r = relative(reference[name], other[name])
        if r / (STATS_TOL if name in stats else TOL) > ratio:
            worst, where, ratio = r, name, r / (STATS_TOL if name in stats else TOL)
    return worst, where


def _as_cpu_file(graph):
    """A compiled CUDA file with its host copies as Identity (the CPU has no Memcpy)."""
    g = graph.copy()
    for n in g.nodes:
        if n.op_type in ("MemcpyFromHost", "MemcpyToHost"):
            n.op_type, n.domain = "Identity", ""
    return g


def check_numerics(path: Path, threads=(1, 2), compiled: Path | None = None) -> dict:
    """The rewritten step (and the forced patches, and ``compiled``) against the step as
    built, at each thread count; the step's own sensitivity on the worst output."""
    from threads import run_once

    from memcc.backend.runner import synthetic_feeds
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from memcc.passes.providers.conv_weight_grad_cuda import conv_weight_grads_as_patches
    from memcc.passes.providers.provider_step import for_provider

    step = build_training_step(load_graph(path), BuildOptions())
    cuda, summary = for_provider(step, "cuda")
    forced, fsum = conv_weight_grads_as_patches(step, min_pixels=1, max_channels=1 << 30)
    feeds = {k: v for k, v in synthetic_feeds(step, 0).items() if k not in step.initializers}
    stats = running_statistics(step)
    names = list(step.outputs)
    row = {"summary": summary, "forced": fsum, "rel": 0.0, "forced_rel": 0.0,
           "file_rel": None}
    others = {"rel": cuda, "forced_rel": forced}
    if compiled is not None and compiled.exists():
        others["file_rel"] = _as_cpu_file(load_graph(compiled))
    for t in threads:
        ref = run_once(step, feeds, t)
        for key, graph in others.items():
            out = run_once(graph, feeds, t)
            rel, where = compare(ref, out, [n for n in names if n in out], stats)
            if rel >= (row[key] or 0.0):
                row[key], row[key + "_at"] = rel, where
    worst = row.get("rel_at") or ""
    bumped = {k: (v * np.float32(1 + 1e-6)).astype(v.dtype)
              if v.dtype == np.float32 else v for k, v in feeds.items()}
    if worst:
        a, b = run_once(step, feeds, 1), run_once(step, bumped, 1)
        row["sensitivity"] = relative(a[worst], b[worst])
        row["tol"] = STATS_TOL if worst in stats else TOL
    return row


def run_cli(args: list[str]) -> tuple[str, float]:
    """``memcc ARGS`` in its own process: 'ok' or the error's first 90 characters."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "memcc", *args], capture_output=True, text=True,
                       timeout=900)
    dt = time.perf_counter() - t0
    if p.returncode == 0:
        return "ok", dt
    err = (p.stderr.strip().splitlines() or ["?"])[-1]
    return f"rc {p.returncode}: {err[:90]}", dt


def check_one(path: Path, cli: bool) -> str:
    """One markdown row for one exported model."""
    name = path.name[:-5]
    cells = []
    compiled = None
    if cli:
        tmp = path.with_suffix(".cuda60.onnx")
        for budget, out in (("60%", tmp), ("min", path.with_suffix(".cudamin.onnx"))):
            out.unlink(missing_ok=True)
            what, dt = run_cli(["compile", str(path), "--provider", "cuda", "--budget",
                                budget, "-o", str(out)])
            cells.append(f"{what} ({dt:.0f} s)")
        compiled = path.with_suffix(".cudamin.onnx")
        what, dt = run_cli(["analyze", str(path), "--provider", "cuda"])
        cells.append(f"{what} ({dt:.0f} s)")
    try:
        r = check_numerics(path, compiled=compiled)
    except Exception as e:  # noqa: BLE001 - report, go on
        return f"| {name} | error: {type(e).__name__}: {str(e)[:120]} |"
    s = r["summary"]
    kept = s.get("conv_weight_grads_kept", {})
    forced = r["forced"]
    rewrites = (f"bn {s['batchnorm_rewritten']}, patches "
                f"{s.get('conv_weight_grads_as_patches', 0)} (kept {kept or '-'}), forced "
                f"{forced['conv_weight_grads_as_patches']} (kept "
                f"{forced.get('conv_weight_grads_kept') or '-'}), concats "
                f"{s.get('concats_split', 0)}")
    verdict = "ok"
    if r["rel"] > r.get("tol", TOL) and r["rel"] > 10 * r.get("sensitivity", 0.0):
        verdict = "FAIL"
    elif r["rel"] > r.get("tol", TOL):
        verdict = "ok (sensitive)"
    file_rel = "-" if r["file_rel"] is None else f"{r['file_rel']:.1e} {r.get('file_rel_at', '')}"
    return (f"| {name} | {rewrites} | {r['rel']:.1e} {r.get('rel_at', '')} | "
            f"{r.get('sensitivity', 0.0):.1e} | {r['forced_rel']:.1e} | {file_rel} | "
            f"{verdict} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("export", "check"))
    ap.add_argument("dir", nargs="?", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cases", default="")
    ap.add_argument("--no-cli", action="store_true")
    a = ap.parse_args()
    wanted = set(filter(None, a.cases.split(",")))
    if a.what == "export":
        export_all(a.out or a.dir, wanted)
        return
    print("| model | rewrites | CUDA step vs CPU | own sensitivity | forced patches | file "
          "(min) | verdict | compile 60% | compile min | analyze |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, *_ in CASES:
        path = a.dir / f"{name}.onnx"
        if (not wanted or name in wanted) and path.exists():
            print(check_one(path, not a.no_cli), flush=True)


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]
    main()
