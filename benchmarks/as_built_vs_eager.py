"""The step as built against PyTorch eager on a transformers GPT-2: which holds more?

Issue 10 asks that the training step ``memcc build`` writes (no budget, no plan) hold no more
than PyTorch eager on the same model and batch. This benchmark answers that for a
transformers ``GPT2LMHeadModel`` (random weights from a seeded config, no download), as each
``torch.onnx`` form writes it:

- memcc: export, ``memcc build --optimizer sgd`` (momentum 0.9, cross-entropy), then
  ``memcc run`` (the step outputs new parameters) and ``memcc run --in-place`` (updates
  written into the old buffers, as ``memcc train`` runs it); the peak is measured, not
  predicted (``memory.CpuPeakMeter`` in a fresh process, ``backend/runner.py``);
- PyTorch: the same module in eager mode, ``torch.optim.SGD`` with momentum buffers present
  from the start (like memcc's optimizer-state inputs), cross-entropy, ``backward``,
  ``step``, gradients set to None; measured with the same meter in a fresh process started
  with the same allocator settings (``memory.child_env``), baseline after a warm-up step on
  a freed copy.

Both use the model's eager attention (an explicit scores tensor) and no dropout, so neither
side saves what the other cannot. Parameters, momentum, batch and every activation are in
both figures; the ratio is memcc / torch.

    python benchmarks/as_built_vs_eager.py [--batch 8 --seq-len 256 --vocab 8192 --width 256
        --depth 4 --heads 4] [--forms dynamo,dynamo-noopt,torchscript] [--steps 3]
        [--loss-chunks K]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from memcc.backend import memory  # noqa: E402
from memcc.backend.runner import RunRequest, run_steps  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402

FORMS = ("dynamo", "dynamo-noopt", "torchscript")
MB = 1e6


def _module(cfg: dict):
    """The seeded transformers GPT-2, in eval mode (no dropout), returning logits only."""
    import torch
    import transformers as T

    class Logits(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=cfg["vocab"], n_embd=cfg["width"], n_layer=cfg["depth"],
        n_head=cfg["heads"], n_positions=cfg["seq_len"], bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))
    model.eval()
    return Logits(model)


def _batch(cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    shape = (cfg["batch"], cfg["seq_len"])
    return rng.integers(3, cfg["vocab"], shape), rng.integers(0, cfg["vocab"], shape)


def export(cfg: dict, form: str, path: Path) -> None:
    import torch

    from benchmarks.transformers_sweep import quiet

    ids = torch.tensor(_batch(cfg)[0])
    module = copy.deepcopy(_module(cfg))
    with torch.no_grad(), quiet():
        if form == "torchscript":
            torch.onnx.export(module, (ids,), str(path), dynamo=False, opset_version=18,
                              input_names=["input_ids"], output_names=["logits"])
        else:
            torch.onnx.export(module, (ids,), dynamo=True, optimize=form == "dynamo",
                              input_names=["input_ids"], output_names=["logits"],
                              verbose=False).save(str(path), external_data=False)


def measure_memcc(cfg: dict, form: str, steps: int, tmp: Path, loss_chunks: int = 1) -> dict:
    src, step = tmp / f"{form}.onnx", tmp / f"{form}_step.onnx"
    export(cfg, form, src)
    graph = build_training_step(load_graph(src), BuildOptions(optimizer="sgd",
                                                              loss_chunks=loss_chunks))
    onnx.save(graph.to_model(), str(step))
    out = {"nodes": len(graph.nodes)}
    for label, in_place in (("step", False), ("in_place", True)):
        r = run_steps(step, RunRequest(steps=steps, in_place=in_place, separate_timing=False))
        out[label] = {"measured_peak_bytes": r.measured_peak_bytes,
                      "predicted_peak_bytes": r.predicted_peak_bytes}
    return out


def measure_torch(cfg: dict, steps: int) -> dict:
    return memory.run_child("benchmarks.as_built_vs_eager", {"cfg": cfg, "steps": steps})


def _torch_child(payload: dict) -> dict:
    """Child side of ``measure_torch``: warm-up on a freed copy, baseline, measured steps."""
    import torch

    from benchmarks.torch_peer import _train_step as train_step

    cfg, steps = payload["cfg"], int(payload["steps"])
    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    ids, labels = (torch.tensor(a) for a in _batch(cfg))

    def setup():
        module = _module(cfg)
        opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
        for p in module.parameters():
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return module, opt

    def step(module, opt) -> float:
        return train_step(module, opt, ids, labels)

    state = setup()
    step(*state)
    del state
    gc.collect()
    meter = memory.CpuPeakMeter()
    meter.set_baseline()
    state = setup()
    peaks = []
    for _ in range(steps):
        meter.start()
        step(*state)
        peaks.append(meter.stop())
    return {"peak_bytes": max(peaks), "peak_bytes_per_step": peaks,
            "parameter_bytes": sum(p.numel() * p.element_size()
                                   for p in state[0].parameters()),
            "torch_version": torch.__version__, "method": meter.method}


def table(cfg: dict, eager: dict, rows: dict[str, dict]) -> str:
    lines = [f"transformers GPT-2 {cfg}; PyTorch eager {eager['peak_bytes'] / MB:.1f} MB "
             f"(torch {eager['torch_version']}, {eager['method']})", "",
             "| export | nodes | memcc step (MB) | / eager | memcc in place (MB) | / eager |",
             "|---|---|---|---|---|---|"]
    for form, r in rows.items():
        if "error" in r:
            lines.append(f"| {form} | - | {r['error']} | | | |")
            continue
        a, b = (r[k]["measured_peak_bytes"] for k in ("step", "in_place"))
        lines.append(f"| {form} | {r['nodes']} | {a / MB:.1f} | {a / eager['peak_bytes']:.3f} "
                     f"| {b / MB:.1f} | {b / eager['peak_bytes']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--child" in argv:
        return memory.child_main(list(argv), _torch_child)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("batch", 8), ("seq-len", 256), ("vocab", 8192), ("width", 256),
                          ("depth", 4), ("heads", 4)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--loss-chunks", type=int, default=1,
                    help="memcc build --loss-chunks (1: the plain loss)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("batch", "seq_len", "vocab", "width", "depth",
                                         "heads")}
    forms = [f for f in args.forms.split(",") if f]
    unknown = set(forms) - set(FORMS)
    if unknown:
        ap.error(f"--forms: unknown {sorted(unknown)}; choose from {', '.join(FORMS)}")
    eager = measure_torch(cfg, args.steps)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="memcc-eager-") as tmp:
        for form in forms:
            print(f"{form}: export, build, run ...", file=sys.stderr, flush=True)
            try:
                rows[form] = measure_memcc(cfg, form, args.steps, Path(tmp),
                                           args.loss_chunks)
            except Exception as exc:  # one failing export form must not hide the others
                rows[form] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    if args.loss_chunks > 1:
        print(f"memcc build --loss-chunks {args.loss_chunks}")
    print(table(cfg, eager, rows))
    if args.json:
        args.json.write_text(json.dumps({"config": cfg, "eager": eager, "memcc": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
