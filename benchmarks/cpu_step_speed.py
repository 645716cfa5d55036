"""CPU step speed (issue 30): memcc's step as built against ORT's own optimizer and PyTorch.

The question: on the CPU, is the training step ``memcc build`` writes, trained the way
``memcc train`` trains it (``memcc.Trainer``), as fast as ONNX Runtime running the very same
step file with its graph optimizations on (``ORT_ENABLE_ALL``), with the same or a lower
measured peak; and, for the transformers, as fast as PyTorch eager on the same module?

Models are unseen by memcc's zoo: transformers GPT-2, BERT, ViT, ResNet, MobileNetV2 and
ConvNeXt built from seeded configs (no download), exported with ``torch.onnx.export(...,
dynamo=True)``. Transformers run in eval mode (dropout probabilities 0, eager attention, so
the explicit scores tensor is on every side); convnets in train mode, and where they have
BatchNorm the export skips the exporter's optimizer (``optimize=False``), which would fold
BatchNorm into the convolutions, so that memcc restores the batch statistics and the step
trains BatchNorm as torch does. Parameters that a fresh model fills with one constant
(LayerNorm ones) are made unique first (``tests/exports.py``), so the exporter merges none.
Each export is built into a step with ``build_training_step(load_graph(f), BuildOptions())``:
cross-entropy, SGD lr 0.01 with momentum 0.9; the batch is ``runner.synthetic_feeds``.

Sides, all at ``--threads`` intra-op threads (default 2):

- ``memcc``: ``memcc.Trainer(step)`` as ``memcc train`` makes it (malloc, updates in place,
  ORT's optimizations off under memcc's execution contract), ``step(batch)`` timed;
- ``memcc-arena``: the same with ``arena=True`` (ORT's CPU arena, as ``compile --arena``);
- ``ORT-ALL``: ``onnxruntime.InferenceSession`` with default ``SessionOptions`` except
  ``graph_optimization_level = ORT_ENABLE_ALL`` and the thread count, on the same step file
  with the carried values (parameters, momentum, BatchNorm statistics) as graph inputs fed
  from arrays (the other stored values stay constants, which ORT may fold); every output is
  fetched and the updates carried into the next step, as a user's loop would;
- ``torch``: the same module in eager mode, ``torch.optim.SGD`` (lr 0.01, momentum 0.9,
  buffers present from the start), cross-entropy, ``backward``, ``step``
  (``benchmarks.torch_peer._train_step``); ``torch.set_num_threads(threads)`` and
  ``OMP_WAIT_POLICY=PASSIVE`` (torch_peer's docstring says why).

Timing: the sides in one fresh process with glibc's default allocator
(``memory.timing_env``), the one that exported and built the step (so torch loads once; its
garbage is collected before any side is made), except ``memcc-arena``, which runs in a
process of its own stepped from there (``ArenaSide``: it fixes glibc's mmap threshold for
its whole process, which slowed the other sides when it shared theirs). Each side is
stepped ``--warmup`` times, then ``--rounds`` rounds in which every side runs one step, the
order rotated per round (``benchmarks.stats``). Reported: each side's median step time with
its quartiles, and per-round ratios memcc/ORT-ALL, memcc-arena/ORT-ALL and memcc/torch,
their median and 95% bootstrap interval. The first loss of every side is kept: the sides
run the same step on the same weights and batch.

Measured peaks, each side in a fresh process under ``memory.child_env`` (every buffer of 4
KiB or more its own mmap, returned at free), with ``memory.CpuPeakMeter``: the baseline is
the resident size once the trainer or session exists, before its first step; the high-water
mark is reset before each step; a step's figure is its high-water mark over that baseline,
plus, for memcc, the arrays the trainer allocated before the baseline and binds to the step
(state, its copy of the batch, outputs, constants: ``held_bytes``, as ``memcc train``
counts them); ORT-ALL's state and batch are loaded after the baseline. The peak is the
largest figure of the steps after the first. Measured from before the first step, because
ORT's default session keeps what its arena grew to between steps: a baseline after a
warm-up step, as ``memcc run`` takes it, would hide that. Both figures so include the first
step's one-time allocations (thread pools, kernel caches); constants stay inside ORT-ALL's
session (in its baseline) while memcc's figure counts them. ``held_between_steps_bytes`` is
what each side still holds after its last step.
Node counts: the step as built, and the graph ORT-ALL runs after its optimizer
(``optimized_model_filepath``).

    python benchmarks/cpu_step_speed.py [--models gpt2,bert,vit,resnet,mobilenet_v2,convnext]
        [--size gpt2:batch=8,seq_len=256] [--tiny] [--rounds 10] [--warmup 2]
        [--threads 2] [--peak-steps 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from benchmarks.stats import interleaved_times, ratio_interval  # noqa: E402
from benchmarks.steps import parse_model  # noqa: E402
from memcc.backend import memory  # noqa: E402

SIDES = ("memcc", "memcc-arena", "ORT-ALL", "torch")
MEASURED = ("memcc", "memcc-arena", "ORT-ALL")
RATIOS = (("memcc", "ORT-ALL"), ("memcc-arena", "ORT-ALL"), ("memcc", "torch"))
MB = 1e6


# ---------------------------------------------------------------------------- models
@dataclass(frozen=True)
class Model:
    """One architecture: its sizes, how to build the torch module, what it eats."""

    family: str  # "transformer" or "convnet"
    defaults: dict
    tiny: dict
    build: Callable[[dict], object]  # sizes -> torch module returning logits
    kind: str  # "text" (input_ids), "text_mask" (+ attention_mask), "image" (pixels)
    batchnorm: bool = False

    @property
    def training(self) -> bool:
        """Convnets train in train mode (BatchNorm with batch statistics)."""
        return self.family == "convnet"

    @property
    def optimize(self) -> bool:
        """The dynamo exporter's optimizer folds train-mode BatchNorm into the convolutions
        (``memcc.frontend.exported``): skip it where there is BatchNorm."""
        return not self.batchnorm


def _gpt2(s: dict):
    from benchmarks.as_built_vs_eager import _module

    return _module(s)


def _bert(s: dict):
    import torch
    import transformers as T
    from exports import BertLogits

    torch.manual_seed(0)
    return BertLogits(T.BertForSequenceClassification(T.BertConfig(
        vocab_size=s["vocab"], hidden_size=s["width"], num_hidden_layers=s["depth"],
        num_attention_heads=s["heads"], intermediate_size=4 * s["width"],
        max_position_embeddings=s["seq_len"], num_labels=s["labels"],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager")))


def _vit(s: dict):
    import torch
    import transformers as T
    from exports import ImageLogits

    torch.manual_seed(0)
    return ImageLogits(T.ViTForImageClassification(T.ViTConfig(
        image_size=s["image"], patch_size=s["patch"], hidden_size=s["width"],
        num_hidden_layers=s["depth"], num_attention_heads=s["heads"],
        intermediate_size=4 * s["width"], num_labels=s["labels"], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager")))


def _resnet(s: dict):
    import torch
    import transformers as T
    from exports import ImageLogits

    torch.manual_seed(0)
    return ImageLogits(T.ResNetForImageClassification(T.ResNetConfig(
        num_channels=3, embedding_size=s["widths"][0], hidden_sizes=list(s["widths"]),
        depths=list(s["depths"]), layer_type="basic", num_labels=s["labels"])))


def _mobilenet_v2(s: dict):
    import torch
    import transformers as T
    from exports import ImageLogits

    torch.manual_seed(0)
    return ImageLogits(T.MobileNetV2ForImageClassification(T.MobileNetV2Config(
        num_channels=3, image_size=s["image"], depth_multiplier=s["multiplier"],
        num_labels=s["labels"], classifier_dropout_prob=0.0)))


def _convnext(s: dict):
    import torch
    import transformers as T
    from exports import ImageLogits

    torch.manual_seed(0)
    return ImageLogits(T.ConvNextForImageClassification(T.ConvNextConfig(
        num_channels=3, hidden_sizes=list(s["widths"]), depths=list(s["depths"]),
        num_stages=len(s["widths"]), num_labels=s["labels"], image_size=s["image"],
        drop_path_rate=0.0)))


_TEXT_TINY = dict(batch=2, seq_len=8, vocab=64, width=16, depth=1, heads=2)
MODELS: dict[str, Model] = {
    "gpt2": Model("transformer", dict(batch=4, seq_len=128, vocab=8192, width=256, depth=4,
                                      heads=4), _TEXT_TINY, _gpt2, "text"),
    "bert": Model("transformer", dict(batch=4, seq_len=128, vocab=8192, width=256, depth=4,
                                      heads=4, labels=2), {**_TEXT_TINY, "labels": 2}, _bert,
                  "text_mask"),
    "vit": Model("transformer", dict(batch=8, image=64, patch=8, width=256, depth=4, heads=4,
                                     labels=10),
                 dict(batch=2, image=8, patch=4, width=16, depth=1, heads=2, labels=3), _vit,
                 "image"),
    "resnet": Model("convnet", dict(batch=8, image=64, widths=[32, 64, 128, 256],
                                    depths=[2, 2, 2, 2], labels=10),
                    dict(batch=2, image=16, widths=[4, 8], depths=[1, 1], labels=3), _resnet,
                    "image", batchnorm=True),
    "mobilenet_v2": Model("convnet", dict(batch=8, image=64, multiplier=0.5, labels=10),
                          dict(batch=2, image=16, multiplier=0.1, labels=3), _mobilenet_v2,
                          "image", batchnorm=True),
    "convnext": Model("convnet", dict(batch=8, image=64, widths=[32, 64, 128, 256],
                                      depths=[2, 2, 2, 2], labels=10),
                      dict(batch=2, image=16, widths=[4, 8], depths=[1, 1], labels=3),
                      _convnext, "image"),
}


def make_module(name: str, sizes: dict):
    """The seeded torch module of ``name`` at ``sizes``, in the mode it is exported and
    trained in, with no parameter filled with one constant (the exporter would merge them)."""
    import torch
    from exports import _jitter_constant_parameters

    model = MODELS[name]
    module = model.build(sizes)
    _jitter_constant_parameters(module, torch.Generator().manual_seed(2))
    module.train(model.training)
    return module


def example_inputs(name: str, sizes: dict) -> dict[str, np.ndarray]:
    """Inputs for the export, by graph input name; token ids avoid the special ids 0-2."""
    model, rng = MODELS[name], np.random.default_rng(0)
    if model.kind == "image":
        shape = (sizes["batch"], 3, sizes["image"], sizes["image"])
        return {"pixel_values": rng.standard_normal(shape, dtype=np.float32)}
    shape = (sizes["batch"], sizes["seq_len"])
    out = {"input_ids": rng.integers(3, sizes["vocab"], shape, dtype=np.int64)}
    if model.kind == "text_mask":
        out["attention_mask"] = np.ones(shape, dtype=np.int64)
    return out


def export(name: str, sizes: dict, path: Path) -> list[str]:
    """``torch.onnx.export(..., dynamo=True)`` of the model; returns the input names."""
    import torch
    from exports import _quiet

    inputs = example_inputs(name, sizes)
    module = make_module(name, sizes)
    args = tuple(torch.from_numpy(a) for a in inputs.values())
    with torch.no_grad(), _quiet():
        torch.onnx.export(module, args, dynamo=True, optimize=MODELS[name].optimize,
                          input_names=list(inputs), output_names=["logits"],
                          verbose=False).save(str(path), external_data=False)
    return list(inputs)


# ---------------------------------------------------------------------------- preparation
def prepare(name: str, sizes: dict, tmp: Path) -> dict:
    """Export, build the step, and write what the children read: the step file, the batch,
    ORT-ALL's graph (carried values as inputs) and its initial carried values."""
    from memcc.backend.device_step import DEVICE, device_session_graph
    from memcc.backend.onnx_file import save_graph
    from memcc.backend.runner import synthetic_feeds
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from memcc.step import TrainingStep

    src, step_path = tmp / f"{name}.onnx", tmp / f"{name}_step.onnx"
    t0 = time.perf_counter()
    input_names = export(name, sizes, src)
    export_s = time.perf_counter() - t0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = build_training_step(load_graph(src), BuildOptions())
    notes = sorted({str(w.message).split(": ", 1)[-1][:300] for w in caught
                    if "BatchNorm" in str(w.message)})
    save_graph(step, step_path)
    spec = TrainingStep.of(step)
    batch = synthetic_feeds(step, 0)
    labels = [n for n in spec.data_inputs if n not in input_names]
    np.savez(tmp / f"{name}_batch.npz", **batch)
    carried = list(dict.fromkeys(spec.state.values()))
    g, state, _ = device_session_graph(step, carried, DEVICE)
    ort_path = tmp / f"{name}_ort_all.onnx"
    onnx.save_model(g.to_model(), str(ort_path))
    np.savez(tmp / f"{name}_state.npz", **state)
    return {
        "model": name, "sizes": sizes, "step": str(step_path), "ort_graph": str(ort_path),
        "batch": str(tmp / f"{name}_batch.npz"), "state": str(tmp / f"{name}_state.npz"),
        "input_names": input_names, "labels": labels[0] if labels else None,
        "loss": spec.loss, "updates": dict(spec.state), "outputs": list(step.outputs),
        "nodes": len(step.nodes),
        "memcc_kernels": sum(n.op_type != "Constant" for n in step.nodes),
        "export_s": export_s, "notes": notes,
        "state_bytes": sum(a.nbytes for a in (*state.values(), *batch.values())),
    }


def ort_all_options(threads: int, optimized_path: Path | None = None):
    """ORT's default ``SessionOptions`` with ``ORT_ENABLE_ALL`` and the thread count."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = int(threads)
    so.log_severity_level = 3  # logging only: memcc's files draw graph-load warnings
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    return so


def ort_all_nodes(prep: dict, threads: int, tmp: Path) -> int:
    """How many nodes ORT-ALL runs: the graph its optimizer saves (a throw-away session)."""
    import onnxruntime as ort

    out = tmp / f"{prep['model']}_ort_all_optimized.onnx"
    ort.InferenceSession(prep["ort_graph"], ort_all_options(threads, out),
                         providers=["CPUExecutionProvider"])
    return len(onnx.load(str(out), load_external_data=False).graph.node)


# ---------------------------------------------------------------------------- the sides
def _load(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {k: np.array(npz[k]) for k in npz.files}


class OrtAll:
    """ORT-ALL's loop: every output fetched, the updates fed back as the next inputs."""

    def __init__(self, prep: dict, threads: int) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(prep["ort_graph"], ort_all_options(threads),
                                            providers=["CPUExecutionProvider"])
        self.outputs, self.updates, self.loss = prep["outputs"], prep["updates"], prep["loss"]
        self.feeds: dict[str, np.ndarray] = {}

    def load(self, prep: dict) -> None:
        self.feeds = {**_load(prep["state"]), **_load(prep["batch"])}

    def step(self) -> float:
        values = dict(zip(self.outputs, self.session.run(self.outputs, self.feeds),
                          strict=True))
        for out, inp in self.updates.items():
            self.feeds[inp] = values[out]
        return float(np.asarray(values[self.loss]).reshape(-1)[0])


def _trainer(prep: dict, threads: int, arena: bool | None):
    from memcc import Trainer

    return Trainer(prep["step"], threads=threads, arena=arena)


class ArenaSide:
    """``memcc.Trainer(arena=True)`` in a process of its own, stepped from the timing
    process through a pipe (a round trip of well under a millisecond, in its time).

    Its own process because such a trainer fixes glibc's mmap threshold for the whole
    process (``backend.memory.fix_mmap_threshold``): in the timing process every other
    side's buffers of 128 KiB and more then became mmaps of their own, faulted in on every
    step (on GPT-2, with it in the same process, memcc's malloc trainer took 1.75x
    ORT-ALL's time and torch 255 ms; without, 0.83x and 160 ms, a run minutes later)."""

    def __init__(self, prep: dict, threads: int, data: dict[str, np.ndarray]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_arena_worker, args=(theirs, prep, threads, data),
                                daemon=True)
        self.proc.start()
        self.threads, self.arena = self.conn.recv()

    def step(self) -> float:
        self.conn.send("step")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


def _arena_worker(conn, prep: dict, threads: int, data: dict[str, np.ndarray]) -> None:
    trainer = _trainer(prep, threads, True)
    conn.send((trainer.threads, trainer.arena))
    while conn.recv() is not None:
        conn.send(trainer.step(data))


def _torch_side(prep: dict, batch: dict[str, np.ndarray], threads: int):
    """The module, SGD with its momentum buffers, and the batch as tensors."""
    import torch

    from benchmarks.torch_peer import LR, MOMENTUM

    torch.set_num_threads(threads)
    module = make_module(prep["model"], prep["sizes"])
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    for p in params:  # memcc feeds zero momentum from step 1: same memory every step
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    xs = tuple(torch.from_numpy(batch[n].copy()) for n in prep["input_names"])
    y = torch.from_numpy(batch[prep["labels"]].copy())
    return module, opt, xs, y


def _forward(module, xs):
    return module(*xs)


# ---------------------------------------------------------------------------- children
def _time_child(p: dict) -> dict:
    """Export and build (``prepare``), then time all sides in rotated interleaved rounds.

    One process for both, so torch and transformers load once (the test's time budget);
    the export's garbage is collected and the heap trimmed before any side is made."""
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before torch loads libgomp
    import onnxruntime as ort
    import torch

    from benchmarks.torch_peer import _train_step

    threads = int(p["threads"])
    prep = prepare(p["model"], p["sizes"], Path(p["tmp"]))
    prep["ort_all_nodes"] = ort_all_nodes(prep, threads, Path(p["tmp"]))
    gc.collect()
    memory.trim_heap()
    batch = _load(prep["batch"])
    data = {n: batch[n] for n in (*prep["input_names"], prep["labels"])}
    malloc, arena = _trainer(prep, threads, None), ArenaSide(prep, threads, data)
    ort_all = OrtAll(prep, threads)
    ort_all.load(prep)
    state = _torch_side(prep, batch, threads)
    losses: dict[str, list[float]] = {s: [] for s in SIDES}
    steps = {
        "memcc": lambda: losses["memcc"].append(malloc.step(data)),
        "memcc-arena": lambda: losses["memcc-arena"].append(arena.step()),
        "ORT-ALL": lambda: losses["ORT-ALL"].append(ort_all.step()),
        "torch": lambda: losses["torch"].append(_train_step(*state, _forward)),
    }
    times = interleaved_times(steps, rounds=int(p["rounds"]), warmup=int(p["warmup"]),
                              order="rotate")
    arena.close()
    import transformers

    return {"prep": prep, "times": times,
            "first_loss": {s: v[0] for s, v in losses.items()},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "onnxruntime": ort.__version__},
            "settings": {
                "memcc": f"memcc.Trainer, {malloc.threads} threads, allocator "
                         f"{'arena' if malloc.arena else 'malloc'}",
                "memcc-arena": f"memcc.Trainer(arena=True), {arena.threads} threads, "
                               f"allocator {'arena' if arena.arena else 'malloc'}",
                "ORT-ALL": f"onnxruntime {ort.__version__} InferenceSession, default "
                           f"SessionOptions but ORT_ENABLE_ALL and intra_op_num_threads="
                           f"{threads}",
                "torch": f"torch {torch.__version__} eager, {torch.get_num_threads()} "
                         f"threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
            }}


def _peak_child(p: dict) -> dict:
    """One side's measured peak, in a fresh measuring process (module docstring): the
    baseline is taken once the trainer or session exists and before its first step; the
    peak is the largest of the steps after the first, whose one-time allocations stay in."""
    prep, threads, side = p["prep"], int(p["threads"]), p["side"]
    meter = memory.CpuPeakMeter()
    if side.startswith("memcc"):
        trainer = _trainer(prep, threads, True if side == "memcc-arena" else None)
        held = trainer.held_bytes()  # state, batch and outputs it binds, constants
        gc.collect()
        meter.set_baseline()
        batch = _load(prep["batch"])
        data = {n: batch[n] for n in (*prep["input_names"], prep["labels"])}
        del batch

        def step() -> None:
            trainer.step(data)
    else:
        held = 0
        ort_all = OrtAll(prep, threads)
        gc.collect()
        meter.set_baseline()
        ort_all.load(prep)

        def step() -> None:
            ort_all.step()
    peaks = []
    for _ in range(int(p["steps"]) + 1):
        meter.start()
        step()
        peaks.append(meter.stop() + held)
    between = memory.rss_bytes() - meter.baseline + held
    out = {"peak_bytes": max(peaks[1:]), "first_step_bytes": peaks[0], "peaks": peaks,
           "held_between_steps_bytes": between,
           "method": ("VmHWM over a baseline taken before the first step, plus what the "
                      "trainer held before it (state, bound batch and outputs, constants)"
                      if held else "VmHWM over a baseline taken before the first step, "
                      "state and batch loaded after it") + f"; {meter.method}"}
    if side.startswith("memcc"):
        out["predicted_peak_bytes"] = trainer.predicted_peak_bytes
    return out


def _child(payload: dict) -> dict:
    return _time_child(payload) if payload["kind"] == "time" else _peak_child(payload)


# ---------------------------------------------------------------------------- parent
def _spread(times: list[float]) -> dict:
    q25, q50, q75 = np.quantile(times, [0.25, 0.5, 0.75])
    return {"median_s": float(q50), "q25_s": float(q25), "q75_s": float(q75),
            "times_s": list(times)}


def measure(name: str, sizes: dict, *, rounds: int, warmup: int, threads: int,
            peak_steps: int, tmp: Path, log: Callable[[str], None]) -> dict:
    """One model: export, build and timing in one child, each side's peak in its own."""
    log(f"{name} {sizes}: export, build, time ...")
    timed = memory.run_child("benchmarks.cpu_step_speed",
                             {"kind": "time", "model": name, "sizes": sizes, "tmp": str(tmp),
                              "threads": threads, "rounds": rounds, "warmup": warmup},
                             measuring=False)
    prep, times = timed["prep"], timed["times"]
    log(f"{name}: exported in {prep['export_s']:.1f} s, step of {prep['nodes']} nodes; "
        "measuring peaks ...")
    peaks = {side: memory.run_child("benchmarks.cpu_step_speed",
                                    {"kind": "peak", "side": side, "prep": prep,
                                     "threads": threads, "steps": peak_steps})
             for side in MEASURED}
    ratios = {f"{b}/{a}": ratio_interval(times[a], times[b]).to_json() for b, a in RATIOS}
    model = MODELS[name]
    return {
        "model": name, "family": model.family, "sizes": sizes,
        "export": f"dynamo, optimize={model.optimize}, "
                  f"{'train' if model.training else 'eval'} mode",
        "notes": prep["notes"], "nodes": prep["nodes"],
        "memcc_kernels": prep["memcc_kernels"], "ort_all_nodes": prep["ort_all_nodes"],
        "state_bytes": prep["state_bytes"],
        "times": {s: _spread(times[s]) for s in SIDES}, "ratios": ratios,
        "first_loss": timed["first_loss"], "settings": timed["settings"],
        "versions": timed["versions"], "peaks": peaks,
        "peak_ratio": peaks["memcc"]["peak_bytes"] / peaks["ORT-ALL"]["peak_bytes"],
        "peak_ratio_arena": (peaks["memcc-arena"]["peak_bytes"]
                             / peaks["ORT-ALL"]["peak_bytes"]),
        "rounds": rounds, "threads": threads,
    }


def _cell(r: dict) -> str:
    mark = "" if r["low"] > 1.0 or r["high"] < 1.0 else " ~"
    return f"{r['ratio']:.2f} ({r['low']:.2f}..{r['high']:.2f}){mark}"


def table(rows: list[dict]) -> str:
    def ms(r: dict, side: str) -> str:
        t = r["times"][side]
        spread = (t["q75_s"] - t["q25_s"]) / 2 / t["median_s"]
        return f"{1e3 * t['median_s']:.1f} ±{100 * spread:.0f}%"

    lines = ["Step times: median ms ± half the interquartile range; ratios: median of the "
             "per-round ratios (95% bootstrap interval; ~ where it spans 1).", "",
             "| model | memcc ms | memcc-arena ms | ORT-ALL ms | torch ms | memcc / ORT-ALL "
             "| arena / ORT-ALL | memcc / torch |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["ratios"]
        lines.append(f"| {r['model']} | {ms(r, 'memcc')} | {ms(r, 'memcc-arena')} | "
                     f"{ms(r, 'ORT-ALL')} | {ms(r, 'torch')} | {_cell(q['memcc/ORT-ALL'])} | "
                     f"{_cell(q['memcc-arena/ORT-ALL'])} | {_cell(q['memcc/torch'])} |")
    lines += ["", "Nodes: the step as built; the kernels memcc's session runs (its Constant "
              "nodes are fed as inputs); the nodes ORT-ALL runs after its optimizer. Peaks: "
              "measured, MB (module docstring).", "",
              "| model | step nodes | memcc kernels | ORT-ALL nodes | peak memcc | "
              "peak memcc-arena | peak ORT-ALL | memcc / ORT-ALL | arena / ORT-ALL |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pk = {s: r["peaks"][s]["peak_bytes"] / MB for s in MEASURED}
        lines.append(f"| {r['model']} | {r['nodes']} | {r['memcc_kernels']} | "
                     f"{r['ort_all_nodes']} | "
                     f"{pk['memcc']:.1f} | {pk['memcc-arena']:.1f} | {pk['ORT-ALL']:.1f} | "
                     f"{r['peak_ratio']:.2f} | {r['peak_ratio_arena']:.2f} |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        ort_ = ratio_interval(r["times"]["ORT-ALL"]["times_s"], r["times"]["memcc"]["times_s"])
        line = (f"{r['model']}: {ort_.verdict('memcc', 'ORT-ALL')}; peak "
                f"{r['peak_ratio']:.2f}x ORT-ALL's")
        if r["family"] == "transformer":
            t = ratio_interval(r["times"]["torch"]["times_s"], r["times"]["memcc"]["times_s"])
            line += f"; {t.verdict('memcc', 'torch')}"
        out.append(line)
    return out


def settings_lines(rows: list[dict], threads: int) -> list[str]:
    s = rows[0]["settings"] if rows else {}
    v = rows[0]["versions"] if rows else {}
    cpu = platform.processor() or platform.machine()
    return [f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu}, "
            f"{len(os.sched_getaffinity(0))} cores visible, {threads} threads per side; "
            + ", ".join(f"{k} {x}" for k, x in v.items()),
            *(f"- {k}: {x}" for k, x in s.items()),
            "- memcc sessions: memcc's execution contract (ORT_DISABLE_ALL, PRIORITY_BASED, "
            "no mem pattern/reuse, no prepacking), updates in place (IOBinding)",
            "- timing: one process, glibc default allocator, rotated interleaved rounds; "
            "peaks: a fresh measuring process per side (module docstring)"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python benchmarks/cpu_step_speed.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--size", action="append", default=[], metavar="MODEL:KEY=V,...",
                    help="override sizes, e.g. gpt2:batch=8,seq_len=256 or "
                         "resnet:widths=16;32,depths=1;1 (lists with ';')")
    ap.add_argument("--tiny", action="store_true",
                    help="the smallest sizes (the test's; seconds per model)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak-steps", type=int, default=2, help="measured steps per side")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        ap.error(f"--models: unknown {unknown or 'none given'}; choose from "
                 f"{', '.join(MODELS)}")
    for flag in ("rounds", "threads", "peak_steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must not be negative")
    args.sizes = {m: dict(MODELS[m].tiny if args.tiny else MODELS[m].defaults)
                  for m in args.models}
    for spec in args.size:
        name, opts = parse_model(spec)
        if name not in MODELS:
            ap.error(f"--size {spec}: unknown model '{name}'; choose from {', '.join(MODELS)}")
        bad = sorted(set(opts) - set(MODELS[name].defaults))
        if bad:
            ap.error(f"--size {spec}: {name} has no size {bad}; its sizes are "
                     f"{', '.join(MODELS[name].defaults)}")
        if name in args.sizes:
            args.sizes[name].update(opts)
    return args


def main(argv: list[str]) -> int:
    if "--child" in argv:
        return memory.child_main(list(argv), _child)
    args = parse_args(list(argv))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    rows, failed = [], []
    with tempfile.TemporaryDirectory(prefix="memcc-cpu-speed-") as tmp:
        for name in args.models:
            try:
                rows.append(measure(name, args.sizes[name], rounds=args.rounds,
                                    warmup=args.warmup, threads=args.threads,
                                    peak_steps=args.peak_steps, tmp=Path(tmp), log=log))
            except Exception as exc:  # one failing model must not hide the others
                failed.append({"model": name, "sizes": args.sizes[name],
                               "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
                log(f"{name}: FAILED: {failed[-1]['error']}")
    head = settings_lines(rows, args.threads)
    print("\n".join(head))
    print()
    if rows:
        print(table(rows))
        print()
        print("\n".join(verdicts(rows)))
    for r in rows:
        print(f"{r['model']}: {r['sizes']}; export {r['export']}; first loss "
              + ", ".join(f"{s} {v:.4f}" for s, v in r["first_loss"].items())
              + ("; " + "; ".join(r["notes"]) if r["notes"] else ""))
    for f in failed:
        print(f"{f['model']}: {f['sizes']}: failed: {f['error']}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"settings": head, "rows": rows, "failed": failed},
                                       indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
