"""Data-parallel throughput and per-rank memory (issue 33): one process at batch 2B against
2 gloo ranks at batch B (``--zero 0`` and ``1``), on a zoo GPT-2 with AdamW.

    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode single --steps 12
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode zero0 --steps 12
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode zero1 --steps 12

Prints one JSON line: samples/s over the run (first step included), and for the ranks the
figures ``memcc train --nproc 2 --json`` reports (optimizer state and held bytes per rank,
resident size, where rank 0's time went). Steps and data are written to ``--dir``.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import numpy as np

GPT2 = dict(width=256, depth=4, heads=4, vocab_size=8192, seq_len=128)
RANK_BATCH = 4


def _files(d: Path) -> None:
    from memcc.backend.onnx_file import save_graph
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from models import build_model

    d.mkdir(parents=True, exist_ok=True)
    for b in (RANK_BATCH, 2 * RANK_BATCH):
        if not (d / f"gpt2_b{b}.onnx").exists():
            step = build_training_step(load_graph(build_model("gpt2", batch=b, **GPT2)),
                                       BuildOptions(optimizer="adamw"))
            save_graph(step, d / f"gpt2_b{b}.onnx")
    ids = np.random.default_rng(0).integers(0, GPT2["vocab_size"], (256, GPT2["seq_len"]))
    np.savez(d / "data.npz", input_ids=ids, labels=ids)


def main() -> None:
    from memcc.dist.launch import train_distributed
    from memcc.trainer.loop import TrainOptions, train

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["single", "zero0", "zero1"], required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/memcc_data_parallel"))
    a = ap.parse_args()
    _files(a.dir)
    if a.mode == "single":
        r = train(TrainOptions(step=a.dir / f"gpt2_b{2 * RANK_BATCH}.onnx",
                               data=a.dir / "data.npz", steps=a.steps))
        out = {"mode": f"1 process, batch {2 * RANK_BATCH}", "samples_per_s": r.samples_per_s,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    else:
        zero = int(a.mode[-1])
        r, info = train_distributed(TrainOptions(step=a.dir / f"gpt2_b{RANK_BATCH}.onnx",
                                                 data=a.dir / "data.npz", steps=a.steps),
                                    2, zero=zero, quiet=True)
        out = {"mode": f"2 ranks x batch {RANK_BATCH}, ZeRO-{zero}",
               "samples_per_s": r.samples_per_s, **info}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
