"""What memcc's fusions (frontend/fuse.py) buy on the CPU: the step as built with and without
them, run the same way, paired round by round.

For each model the step is built twice from the same forward model (``BuildOptions()`` and
``BuildOptions(fusions=())``), both run in ORT sessions under memcc's execution contract
(``backend.session.session_options``: optimizations off, the file's order, no arena), with
the same parameters, state and batch fed. Printed per model: nodes, transposes fused, the
bytes the fused step no longer moves, whether both steps' outputs are the same bits (they
must be), and the step-time ratio fused / unfused with its 95% interval
(``benchmarks/stats.py``: interleaved rounds, bootstrap over rounds).

    python benchmarks/fusions.py [--models zoo-gpt2,zoo-resnet50,hf-gpt2] [--rounds 15]
        [--threads 2] [--out FILE.json]

``hf-gpt2`` is transformers' GPT2LMHeadModel from a seeded config (4 layers, width 256,
batch 4 x 128, vocabulary 8,192), exported by ``torch.onnx.export(dynamo=True)``: it needs
torch and transformers; the zoo models need neither.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from benchmarks.stats import interleaved_times, ratio_interval  # noqa: E402
from memcc.backend.runner import session_graph, synthetic_feeds  # noqa: E402
from memcc.backend.session import session_options  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.graph import Graph  # noqa: E402
from memcc.step import FUSIONS_KEY  # noqa: E402

ZOO = {
    "zoo-gpt2": ("gpt2", dict(batch=8, seq_len=128, width=256, depth=4, heads=4)),
    "zoo-resnet50": ("resnet50", dict(batch=8, resolution=64)),
    "zoo-bert": ("bert", dict(batch=8, seq_len=128, width=256, depth=4, heads=4)),
}
TINY = {"zoo-gpt2": ("gpt2", {}), "zoo-resnet50": ("resnet18", {})}


def forward_model(name: str, tiny: bool, tmp: Path) -> Graph:
    if name == "hf-gpt2":
        return load_graph(str(_export_hf_gpt2(tmp)))
    from models import build_model

    zoo, opts = (TINY if tiny else ZOO)[name]
    return load_graph(build_model(zoo, **opts))


def _export_hf_gpt2(tmp: Path) -> Path:
    import torch
    import transformers as T

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = T.GPT2LMHeadModel(T.GPT2Config(
                n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                eos_token_id=0))

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    torch.manual_seed(0)
    path = tmp / "hf-gpt2.onnx"
    torch.onnx.export(Logits().eval(), (torch.randint(0, 8192, (4, 128)),), str(path),
                      dynamo=True, optimize=False, verbose=False)
    return path


def _session(step: Graph, threads: int):
    g, values = session_graph(step)
    sess = ort.InferenceSession(g.to_model().SerializeToString(),
                                session_options(intra_op_threads=threads),
                                providers=["CPUExecutionProvider"])
    return sess, values


def measure(name: str, *, rounds: int, threads: int, tiny: bool, tmp: Path) -> dict:
    forward = forward_model(name, tiny, tmp)
    plain = build_training_step(forward, BuildOptions(fusions=()))
    fused = build_training_step(forward, BuildOptions())
    report = json.loads(fused.metadata[FUSIONS_KEY])
    batch = synthetic_feeds(plain, 0)
    runs = {}
    outputs = {}
    for label, step in (("unfused", plain), ("fused", fused)):
        sess, values = _session(step, threads)
        feeds = {**values, **batch}
        names = list(step.outputs)
        outputs[label] = sess.run(names, feeds)
        runs[label] = (lambda s=sess, n=names, f=feeds: s.run(n, f))
    same = all(np.array_equal(a, b) for a, b in zip(outputs["unfused"], outputs["fused"],
                                                      strict=True))
    times = interleaved_times(runs, rounds=rounds, warmup=1)
    ratio = ratio_interval(times["unfused"], times["fused"])
    return {"model": name, "nodes_unfused": len(plain.nodes), "nodes_fused": len(fused.nodes),
            "fused": report["fused"], "bytes_saved": report["bytes_saved"],
            "same_bits": same, "threads": threads, "ratio": ratio.to_json(),
            "unfused_median_s": ratio.a_median_s, "fused_median_s": ratio.b_median_s}


def table(rows: list[dict]) -> str:
    lines = ["| model | nodes (unfused -> fused) | transposes fused | bytes saved (MB) | "
             "same bits | unfused (ms) | fused (ms) | fused / unfused (95% CI) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["ratio"]
        mark = "" if (q["low"] > 1 or q["high"] < 1) else " ~"
        lines.append(
            f"| {r['model']} | {r['nodes_unfused']} -> {r['nodes_fused']} | "
            f"{sum(r['fused'].values())} | {r['bytes_saved'] / 1e6:.1f} | {r['same_bits']} | "
            f"{1e3 * r['unfused_median_s']:.1f} | {1e3 * r['fused_median_s']:.1f} | "
            f"{q['ratio']:.3f} ({q['low']:.3f}..{q['high']:.3f}){mark} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="zoo-gpt2,zoo-resnet50,hf-gpt2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="the zoo's default (tiny) sizes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in ZOO and m != "hf-gpt2"]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {sorted(ZOO) + ['hf-gpt2']}")
    with tempfile.TemporaryDirectory() as d:
        rows = [measure(m, rounds=args.rounds, threads=args.threads, tiny=args.tiny,
                        tmp=Path(d)) for m in names]
    print(f"onnxruntime {ort.__version__}, CPU provider, {args.threads} intra-op threads, "
          f"memcc's execution contract on both sides, {args.rounds} interleaved rounds")
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
