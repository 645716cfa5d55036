"""A word-level LSTM language model through memcc, against PyTorch eager on the same CPU.

PyTorch's word_language_model example (``first_use_models.WordLM``: embedding, two LSTM
layers with dropout 0.2 between them, a projection to the vocabulary with its bias),
exported by torch.onnx's TorchScript exporter in training mode. memcc unrolls each LSTM over
its steps (``memcc/frontend/recurrent.py``). Prints, measured in one run:

- ``memcc compile --budget min`` (the CLI, row chunks chosen by compile): the smallest
  budget, the plan's peak and predicted added time, the compile's wall time;
- the step time of the step as built (ORT, graph optimizations off, as ``memcc run`` runs
  it) and of PyTorch eager's training step (forward, cross-entropy, backward, SGD with
  momentum; dropout on, TF32 not applicable on the CPU), interleaved round by round at the
  same thread count, median and range over the rounds, and their ratio per round.

    python benchmarks/recurrent_lm.py [--batch 16] [--seq 128] [--width 256] [--vocab 5000]
                                      [--threads 2] [--rounds 7] [--time-limit 60]
                                      [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from first_use_models import WordLM  # noqa: E402


def export(path: Path, a: argparse.Namespace) -> WordLM:
    torch.manual_seed(0)
    model = WordLM(vocab=a.vocab, width=a.width).train()
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))
    torch.onnx.export(model, (ids,), str(path), dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      opset_version=17, input_names=["input_ids"], output_names=["logits"])
    return model


def memcc(*args: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", "from memcc.cli import main; main()", *args],
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"memcc {' '.join(args)} failed:\n{p.stderr[-2000:]}")
    return time.perf_counter() - t0, p.stdout


def smallest_budget(src: Path, work: Path, time_limit: float) -> dict:
    seconds, _ = memcc("compile", str(src), "--budget", "min", "--time-limit",
                       str(time_limit), "-o", str(work / "min.onnx"))
    report = json.loads((work / "min.report.json").read_text())
    chunks = report.get("row_chunks") or {}
    unchunked = next((c for c in chunks.get("candidates", [])
                      if set(c["chunks"].values()) == {1}), None)
    return {"compile_s": round(seconds, 1),
            "budget_mb": round(report["budget_bytes"] / 1e6, 2),
            "plan_peak_mb": round(report["plan"]["peak_bytes"] / 1e6, 2),
            "added_time": round(report["plan"]["overhead"], 3),
            "planned_step_peak_mb": round(report["baseline"]["peak_bytes"] / 1e6, 2),
            "unchunked_as_built_peak_mb": round(unchunked["as_built_peak_bytes"] / 1e6, 2)
            if unchunked else None,
            "row_chunks": chunks.get("chosen")}


def step_times(step: Path, model: WordLM, a: argparse.Namespace) -> dict:
    import onnxruntime as ort

    from memcc.backend.runner import synthetic_feeds
    from memcc.frontend.load import load_graph

    torch.set_num_threads(a.threads)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = a.threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(step), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in synthetic_feeds(load_graph(step), seed=0).items() if k in names}
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ids = torch.from_numpy(feeds["input_ids"])
    labels = torch.from_numpy(feeds["labels"]).reshape(-1)

    def torch_step() -> None:
        opt.zero_grad()
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), labels).backward()
        opt.step()

    mem, eager = [], []
    for r in range(a.rounds + 1):     # round 0 warms both up
        first = (lambda: sess.run(None, feeds), torch_step)
        for k, fn in (enumerate(first) if r % 2 else reversed(list(enumerate(first)))):
            t0 = time.perf_counter()
            fn()
            if r:
                (mem if k == 0 else eager).append(time.perf_counter() - t0)
    ratios = [m / e for m, e in zip(mem, eager, strict=True)]
    return {"memcc_s": _spread(mem), "torch_eager_s": _spread(eager),
            "ratio": _spread(ratios)}


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4),
            "max": round(max(xs), 4)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--time-limit", type=float, default=60.0, help="compile's (default 60)")
    return ap.parse_args(argv)


def run(a: argparse.Namespace) -> dict:
    work = a.work or Path(tempfile.mkdtemp(prefix="recurrent_lm_"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "lm.onnx"
    model = export(src, a)
    memcc("build", str(src), "-o", str(work / "step.onnx"))
    return {"model": vars(a) | {"work": str(work)}, "min": smallest_budget(src, work, a.time_limit),
            "step": step_times(work / "step.onnx", model, a)}


def main() -> None:
    print(json.dumps(run(parse()), indent=1, default=str))


if __name__ == "__main__":
    main()
