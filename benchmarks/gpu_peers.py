"""memcc's training step against PyTorch eager and PyTorch checkpointing, on one GPU.

Issue 29 item 4. Two transformers models, each built from a seeded config (no download):

- ``gpt2``: ``GPT2LMHeadModel``, 6 layers, width 768, 12 heads, vocabulary 50,257,
  n_positions 1,024, batch 8 x 1,024 tokens, eager attention, every dropout 0;
- ``resnet50``: ``ResNetForImageClassification`` with transformers' default config
  (ResNet-50), 1,000 classes, batch 184, 224 px (MONeT's table);

trained with cross-entropy (mean over every position / image), SGD lr 0.01 momentum 0.9
(momentum buffers present from the first step on both sides), fp32. Systems, per model:

- ``memcc-as-built``: the step ``memcc build`` writes, run by ``memcc.Trainer`` at its
  defaults (on CUDA: state on the device; CUDA graphs where the Trainer has them), and again
  with ``deterministic=True`` where the Trainer takes that argument;
- ``memcc-plan@LABEL``: a step compiled elsewhere (``--plan gpt2=FILE[@LABEL]``), the same
  way;
- ``torch-eager`` and ``torch-checkpoint`` (every transformer block / ResNet bottleneck
  wrapped in ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, what
  ``gradient_checkpointing_enable`` does), each with TF32 off and on (on CUDA);
- with ``--prepare --precision bf16`` (issue 34): ``memcc-bf16``, the step ``memcc build
  --precision bf16`` writes from the same export (parameters and momentum stay float32
  under the fp32 step's names, so both start from the same weights), run as memcc as
  built is (``memcc.Trainer`` rewrites the ops the provider has no bf16 kernel for into
  float32 between casts: on CPU most of them); and ``torch-autocast-bf16``, PyTorch eager
  with forward and loss under ``torch.autocast(device_type, dtype=torch.bfloat16)`` and
  backward and step outside, as PyTorch's recipe has it, TF32 on. Their first losses are
  checked against each other within ``BF16_TOLERANCE`` (2e-2 relative), apart from the
  fp32 rows' 1e-3; ``bf16_ratios`` gives memcc-bf16 / torch-autocast-bf16 and bf16 / fp32
  for each side.

The same weights on every side. ``--prepare DIR`` (CPU, here) exports each model with
``torch.onnx.export(..., dynamo=True, optimize=False)`` with every weight zero, so that the
step file xz-compresses to almost nothing, builds the step and writes
``DIR/<model>.step.onnx.xz`` (and ``DIR/<model>.bf16.step.onnx.xz``) and
``DIR/<model>.json`` (the config, and what each step is). The measuring run
decompresses the step and fills every carried value by name from a seeded generator
(``seeded_value``: one ``numpy.random.default_rng((seed, crc32(name)))`` per tensor, so the
value depends on the name only): N(0, 0.02) for weights, ones for norm weights (1-D
``.weight``) and running variances, zeros for biases, running means and momentum. memcc
gets them through ``Trainer.load_state_dict``, the PyTorch twin (the same wrapper around the
same transformers model, so its ``state_dict`` names are the step's input names) through
``load_state_dict(strict=True)``; the two names torch has that the step has not are filled
from what they stand for (``m.transformer.wte.weight`` is tied to ``m.lm_head.weight``,
which the exporter kept; BatchNorm's ``num_batches_tracked`` counters are zero). Each child
returns a digest of the parameters as the system holds them after loading (read back from
the device), and the parent checks that every row of a model has the same digest.

Measurement. Every system runs in a child process of its own (``memory.run_child``), one at
a time on the same GPU, so that one allocator's cache never shows in another's reading:

- peak memory: NVML's device-used memory, sampled from a thread (``NvmlPeakMeter``), minus
  the reading taken when the child started, before the system existed (so it counts the
  CUDA context, the session or module, the state, the batch and the step); sampled through
  set-up and the warm-up steps (``peak_first_step_bytes`` is step 1,
  ``peak_steady_bytes`` the last warm-up step) and read once after every timed step
  (``used_after_steps_bytes``). The sampler is off while steps are timed: a thread that
  wants the GIL would slow PyTorch's Python dispatch. PyTorch also reports
  ``torch.cuda.max_memory_reserved`` and ``max_memory_allocated`` over all its steps.
  On CPU (``--provider cpu``) the meter is ``memory.CpuPeakMeter`` (VmHWM over the RSS at
  the child's start, in a child started with memcc's measuring allocator settings).
- time: ``--warmup`` (2) untimed steps, then ``--steps`` (5) timed steps; each PyTorch step
  is wrapped in ``torch.cuda.synchronize()``, memcc's ``Trainer.step`` returns the loss as a
  host float, which waits for the step. Median, min, max and interquartile range, and the
  first step's time (session or module warm-up included) are reported.
- the batch is one fixed seeded batch (token ids and labels; N(0, 1) pixels) in host memory,
  and both sides copy it to the device every step (memcc's Trainer does; the PyTorch step
  does ``.to(device)`` inside the timed step), as a training loop reading host data would.

TF32: ONNX Runtime's CUDA provider uses TF32 for fp32 matrix products and convolutions
unless told otherwise (``use_tf32``, default 1), which memcc does not change; rows say so.
PyTorch runs with ``torch.backends.cuda.matmul.allow_tf32`` and ``cudnn.allow_tf32`` both
off and both on (PyTorch's own default is matmul off, cuDNN on).

    python benchmarks/gpu_peers.py --prepare DIR [--small] [--precision bf16]  # CPU
    python benchmarks/gpu_peers.py --steps-from DIR --out OUT       # GPU, measures
        [--provider cuda|cpu] [--models gpt2,resnet50] [--warmup 2] [--steps 5]
        [--plan gpt2=FILE[@LABEL]] [--systems memcc,torch] [--time-limit S] [--timeout S]

Rows run most wanted first across the models (``systems_for``); ``--time-limit`` starts no
system after S seconds (the rest are listed as skipped), and ``summary.json`` is rewritten
after every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import logging
import lzma
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from memcc.backend import memory  # noqa: E402
from memcc.errors import InputError  # noqa: E402

MODELS = ("gpt2", "resnet50")
LR = 0.01
MOMENTUM = 0.9
SEED = 0
INIT_STD = 0.02
MB = 1e6
# The models of issue 29, and tiny ones with the same structure for --small (CPU tests).
FULL = {
    "gpt2": {"kind": "gpt2", "batch": 8, "seq_len": 1024,
             "config": {"vocab_size": 50257, "n_embd": 768, "n_layer": 6, "n_head": 12,
                        "n_positions": 1024}},
    "resnet50": {"kind": "resnet", "batch": 184, "resolution": 224,
                 "config": {"num_labels": 1000}},
}
SMALL = {
    "gpt2": {"kind": "gpt2", "batch": 2, "seq_len": 32,
             "config": {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4,
                        "n_positions": 32}},
    "resnet50": {"kind": "resnet", "batch": 2, "resolution": 32,
                 "config": {"num_labels": 10, "embedding_size": 8,
                            "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1]}},
}
# What every GPT-2 config gets on top: no dropout, explicit attention scores, no KV cache.
GPT2_FIXED = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False,
              "bos_token_id": 0, "eos_token_id": 0}
DATA_INPUT = {"gpt2": "input_ids", "resnet": "pixel_values"}
MEMCC_TF32 = ("on: ONNX Runtime's CUDA provider default (use_tf32=1) for fp32 MatMul/Gemm "
              "and Conv")


def log(msg: str) -> None:
    print(f"[gpu_peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- models
@contextlib.contextmanager
def _quiet():
    """The exporter's and transformers' warnings and log chatter, silenced (not stdout:
    a child's result line goes there)."""
    loggers = [logging.getLogger(n) for n in ("torch", "transformers", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def make_module(meta: Mapping):
    """The PyTorch model of ``meta`` (from ``FULL``/``SMALL``), wrapped so that it returns
    logits only; parameters are named ``m.<transformers name>`` on both sides."""
    import torch
    import transformers as T

    class Logits(torch.nn.Module):
        def __init__(self, model: torch.nn.Module, data_input: str) -> None:
            super().__init__()
            self.m = model
            self.data_input = data_input

        def forward(self, x):
            return self.m(**{self.data_input: x}).logits

    kind = meta["kind"]
    with _quiet():
        if kind == "gpt2":
            config = T.GPT2Config(**meta["config"], **GPT2_FIXED)
            config._attn_implementation = "eager"
            model = T.GPT2LMHeadModel(config)
        else:
            model = T.ResNetForImageClassification(T.ResNetConfig(**meta["config"]))
    # GPT-2 has no dropout left, so train mode computes what eval mode does; ResNet's
    # BatchNorm trains on batch statistics, as memcc's step does.
    return Logits(model, DATA_INPUT[kind]).train()


def blocks_of(module, kind: str) -> list:
    """The residual blocks that checkpointing wraps: GPT-2's ``h`` blocks, ResNet's
    bottleneck layers (what ``gradient_checkpointing_enable`` wraps in transformers)."""
    if kind == "gpt2":
        return list(module.m.transformer.h)
    return [layer for stage in module.m.resnet.encoder.stages for layer in stage.layers]


def enable_checkpointing(module, kind: str) -> int:
    """Wrap every block's forward in ``checkpoint(..., use_reentrant=False)``; return how
    many blocks were wrapped."""
    from torch.utils.checkpoint import checkpoint

    blocks = blocks_of(module, kind)
    for block in blocks:
        forward = block.forward

        def wrapped(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = wrapped
    return len(blocks)


def make_batch(meta: Mapping, seed: int = SEED) -> dict[str, np.ndarray]:
    """One fixed batch: token ids and next-token labels for GPT-2 (labels over every
    position, as memcc's cross-entropy reads them), N(0, 1) pixels and class labels."""
    rng = np.random.default_rng(seed)
    b = int(meta["batch"])
    if meta["kind"] == "gpt2":
        vocab, t = int(meta["config"]["vocab_size"]), int(meta["seq_len"])
        return {"input_ids": rng.integers(0, vocab, size=(b, t), dtype=np.int64),
                "labels": rng.integers(0, vocab, size=(b, t), dtype=np.int64)}
    r = int(meta["resolution"])
    return {"pixel_values": rng.standard_normal((b, 3, r, r), dtype=np.float32),
            "labels": rng.integers(0, int(meta["config"]["num_labels"]), size=(b,),
                                   dtype=np.int64)}


def seeded_value(name: str, shape: Sequence[int], dtype, seed: int = SEED) -> np.ndarray:
    """The value every system starts from for the carried tensor ``name`` (see the module
    docstring); a function of (seed, name, shape) only."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if name.endswith((".momentum", ".running_mean", "num_batches_tracked", ".bias")) or \
            dtype.kind != "f":
        return np.zeros(shape, dtype)
    if name.endswith(".running_var") or (name.endswith(".weight") and len(shape) == 1):
        return np.ones(shape, dtype)
    rng = np.random.default_rng((seed, zlib.crc32(name.encode())))
    return (rng.standard_normal(shape, dtype=np.float32) * INIT_STD).astype(dtype)


def digest(values: Mapping[str, np.ndarray]) -> str:
    """sha1 over names and bytes, in name order: equal digests, equal weights."""
    h = hashlib.sha1()
    for name in sorted(values):
        a = np.ascontiguousarray(values[name])
        h.update(name.encode() + str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------- --prepare
PRECISIONS = ("bf16", "fp16")  # what --precision may add to the fp32 step; fp16 is a memcc
# row only (PyTorch's would need a GradScaler): ORT's CUDA provider has no bfloat16 Conv, so
# fp16 is the 16-bit type a convnet's convolutions run in there


def prepare(directory: Path, *, small: bool = False, models: Sequence[str] = MODELS,
            lr: float = LR, precisions: Sequence[str] = ()) -> dict:
    """Export every model once, build its fp32 step and one step per ``precisions`` from
    that same export, compress them into ``directory``; return the sizes. The 16-bit
    steps must carry exactly what the fp32 one does (master weights and momentum stay
    float32), or nothing of that model is written."""
    import torch

    bad = sorted(set(precisions) - set(PRECISIONS))
    if bad:
        raise InputError(f"--precision {bad[0]}: choose from {', '.join(PRECISIONS)}")
    directory.mkdir(parents=True, exist_ok=True)
    sizes: dict[str, dict] = {}
    for name in models:
        meta = {**(SMALL if small else FULL)[name], "model": name, "small": small,
                "lr": lr, "momentum": MOMENTUM, "optimizer": "sgd",
                "export": "torch.onnx.export(dynamo=True, optimize=False), weights zero",
                "torch_version": torch.__version__}
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="gpu-peers-") as tmp:
            src = _export_zero_weights(meta, Path(tmp) / "forward.onnx")
            log(f"{name}: exported in {time.perf_counter() - t0:.1f} s")
            built = {}
            for precision in ("fp32", *dict.fromkeys(precisions)):
                built[precision] = _build_step(src, lr, precision, Path(tmp))
                _same_carried(name, built["fp32"], built[precision], precision)
                log(f"{name}: {precision} step of {built[precision]['nodes']} nodes, "
                    f"{built[precision]['bytes'] / MB:.1f} MB "
                    f"({time.perf_counter() - t0:.1f} s)")
            meta["carried"], meta["parameters"] = built["fp32"].pop("names")
            meta["step_nodes"] = built["fp32"]["nodes"]
            meta["step_bytes"] = built["fp32"]["bytes"]
            for precision, b in built.items():  # only now: all built and checked
                b.pop("names", None)
                b["file"] = step_file(name, precision)
                out = directory / b["file"]
                with open(b.pop("path"), "rb") as f, lzma.open(out, "wb", preset=6) as z:
                    shutil.copyfileobj(f, z, 1 << 24)
                b["compressed_bytes"] = out.stat().st_size
            meta["precisions"] = built
        (directory / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
        sizes[name] = {"step_bytes": meta["step_bytes"],
                       "compressed_bytes": sum(b["compressed_bytes"] for b in built.values()),
                       "nodes": meta["step_nodes"], "precisions": built}
        xz = ", ".join(f"{k} {v['compressed_bytes'] / MB:.2f} MB" for k, v in built.items())
        log(f"{name}: {xz} xz ({time.perf_counter() - t0:.1f} s)")
    return sizes


def step_file(model: str, precision: str) -> str:
    """The compressed step's file name: ``gpt2.step.onnx.xz``, ``gpt2.bf16.step.onnx.xz``."""
    return f"{model}.step.onnx.xz" if precision == "fp32" else \
        f"{model}.{precision}.step.onnx.xz"


def _export_zero_weights(meta: Mapping, src: Path) -> Path:
    """``torch.onnx.export`` of the model of ``meta`` with every weight zero (the step
    compresses to almost nothing; the run fills the weights by name)."""
    import torch

    module = make_module(meta)
    if meta["kind"] == "gpt2":
        module.eval()  # no Dropout nodes in the file (every p is 0 anyway)
    with torch.no_grad():
        for t in module.state_dict().values():
            t.zero_()
    data = make_batch(meta)[DATA_INPUT[meta["kind"]]]
    with torch.no_grad(), _quiet():
        torch.onnx.export(module, (torch.from_numpy(data),), dynamo=True,
                          optimize=False, input_names=[DATA_INPUT[meta["kind"]]],
                          output_names=["logits"], verbose=False
                          ).save(str(src), external_data=False)
    return src


def _build_step(src: Path, lr: float, precision: str, tmp: Path) -> dict:
    """``memcc build`` of the exported forward at ``precision``, saved uncompressed in
    ``tmp``: its path, node count, bytes, and carried values and parameters."""
    import onnx

    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = build_training_step(load_graph(src), BuildOptions(
            optimizer="sgd", lr=lr, momentum=MOMENTUM, precision=precision),
            source=str(src))
    path = tmp / f"step.{precision}.onnx"
    onnx.save(graph.to_model(), str(path))
    built = {"path": str(path), "nodes": len(graph.nodes), "bytes": path.stat().st_size,
             "names": step_names(graph)}
    if precision != "fp32":
        built["sixteen_bit_emulated"] = emulated_ops(graph)
    return built


def emulated_ops(graph) -> dict[str, dict[str, int]]:
    """Per provider, the 16-bit ops ``memcc.Trainer`` computes in float32 between casts
    there (no kernel: ``memcc.passes.providers.sixteen_bit``), op -> count. Asked here,
    at --prepare, so that no measuring child loads the graph again: the CPU answer is the
    installed onnxruntime's kernel registry, the CUDA one memcc's shipped table
    (``memcc/data/ort_cuda_16bit_kernels.json``, read from ORT's source)."""
    from memcc.passes.providers.sixteen_bit import for_provider

    return {p: for_provider(graph, p)[1].get("sixteen_bit_emulated", {})
            for p in ("cpu", "cuda")}


def _same_carried(model: str, fp32: dict, other: dict, precision: str) -> None:
    """A 16-bit step that carries other names, shapes or dtypes than the fp32 one could not
    start from the same weights: stop with what differs."""
    if other["names"] == fp32["names"]:
        return
    (c32, p32), (c16, p16) = fp32["names"], other["names"]
    if precision == "fp16":  # its loss scale is state of its own, filled by the step
        c16 = {n: v for n, v in c16.items() if not n.startswith("loss_scale.")}
        if c16 == c32 and p16 == p32:
            return
    diff = sorted(n for n in set(c32) | set(c16) if c32.get(n) != c16.get(n))
    raise RuntimeError(
        f"{model}: the {precision} step carries other values than the fp32 step "
        f"(master weights and optimizer state should stay float32 under the same names): "
        + "; ".join(f"{n}: fp32 {c32.get(n)}, {precision} {c16.get(n)}" for n in diff[:5])
        + (f"; parameters differ: {sorted(set(p32) ^ set(p16))[:5]}"
           if p32 != p16 else ""))


# ---------------------------------------------------------------------------- children
def _settings_memcc(trainer_kwargs: dict, provider: str) -> dict:
    cuda_options = None
    if provider == "cuda":
        try:  # what memcc asks of ORT's CUDA provider (cuDNN's algorithm search, ...)
            from memcc.backend.session import provider_options

            cuda_options = dict(provider_options("cuda")[0][1])
        except Exception:  # the session module's API moved: the row just says less
            cuda_options = None
    return {"provider": provider, "cuda_provider_options": cuda_options,
            "tf32": MEMCC_TF32 if provider == "cuda" else "n/a (CPU)",
            "deterministic": trainer_kwargs.get("deterministic", "Trainer default"),
            "cuda_graph": trainer_kwargs.get("cuda_graph", "Trainer default")
            if provider == "cuda" else "n/a (CPU)",
            "trainer_arguments": {k: v for k, v in trainer_kwargs.items()}}


class _Meter:
    """NVML on CUDA (device used memory over the child's first reading), VmHWM on CPU."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        if provider == "cuda":
            self.nvml = memory.NvmlPeakMeter()
            self.baseline = self.nvml.set_baseline()
            self.method = self.nvml.method.replace(" (unverified)", "") + \
                "; baseline: the child's first reading, before the system existed"
        else:
            self.cpu = memory.CpuPeakMeter()
            self.baseline = self.cpu.set_baseline()
            self.method = self.cpu.method + "; baseline: RSS at the child's start"

    def start(self) -> None:
        if self.provider == "cuda":
            self.nvml.start()
        else:
            self.cpu.start()

    def stop(self) -> int | None:
        if self.provider == "cuda":
            return self.nvml.stop()
        return self.cpu.stop()

    def now(self) -> int | None:
        if self.provider == "cuda":
            if not self.nvml.available:
                return None
            return self.nvml.used() - (self.nvml.baseline or 0)
        return memory.rss_bytes() - (self.cpu.baseline or 0)


def _timing(first_s: float, times: list[float]) -> dict:
    q1, _, q3 = (statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1
                 else (times[0],) * 3)
    return {"first_step_s": first_s, "median_s": statistics.median(times),
            "min_s": min(times), "max_s": max(times), "iqr_s": q3 - q1, "times_s": times}


def _run_steps(step: Callable[[], float], meter: _Meter, warmup: int, steps: int,
               after_setup: int | None) -> dict:
    """Warm-up steps under the sampling meter, then timed steps without it."""
    losses, peaks = [], []
    first_s = 0.0
    for i in range(max(1, warmup)):
        meter.start()
        t0 = time.perf_counter()
        losses.append(step())
        if i == 0:
            first_s = time.perf_counter() - t0
        peaks.append(meter.stop())
    used_after, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        used_after.append(meter.now())
    known = [p for p in [after_setup, *peaks, *used_after] if p is not None]
    return {"losses": losses, **_timing(first_s, times or [first_s]),
            "memory": {"peak_bytes": max(known) if known else None,
                       "peak_setup_bytes": after_setup,
                       "peak_first_step_bytes": peaks[0],
                       "peak_steady_bytes": peaks[-1], "peak_warmup_steps_bytes": peaks,
                       "used_after_steps_bytes": used_after, "method": meter.method}}


def _memcc_child(p: dict) -> dict:
    import onnxruntime  # noqa: F401  (imported before the baseline: not the system)

    import memcc

    meter = _Meter(p["provider"])  # first: the reading before the system exists
    params = trainer_arguments()
    kwargs = {k: v for k, v in p["trainer"].items() if k in params}
    ignored = sorted(set(p["trainer"]) - set(kwargs))
    meter.start()
    t0 = time.perf_counter()
    trainer = memcc.Trainer(p["step"], provider=p["provider"], **kwargs)
    carried = {n: seeded_value(n, v["shape"], v["dtype"], int(p["seed"]))  # by name only
               for n, v in p["meta"]["carried"].items()}
    # What the fp32 step has not (an fp16 step's loss scale) keeps the step's own value.
    trainer.load_state_dict({**trainer.state_dict(), **carried})
    del carried
    setup_s = time.perf_counter() - t0
    after_setup = meter.stop()
    held = trainer.parameters()  # read back from where the step holds them
    weights = digest(held)
    del held
    batch = make_batch(p["meta"], int(p["seed"]))
    result = _run_steps(lambda: trainer.step(batch), meter, int(p["warmup"]),
                        int(p["steps"]), after_setup)
    settings = _settings_memcc(kwargs, p["provider"])
    # the step's own word (a --plan file may be 16-bit too), not the row's
    autocast = json.loads(trainer.graph.metadata.get("memcc.precision", "{}"))
    precision = autocast.get("precision", "fp32")
    settings["precision"] = BF16_MEMCC if precision == "bf16" else \
        precision if precision == "fp32" else f"{precision} (memcc build --precision)"
    if precision != "fp32":
        settings["autocast"] = autocast
        # --prepare's answer (memcc's tables there; a GPU machine's ORT may list its own)
        known = p["meta"].get("precisions", {}).get(precision, {})
        emulated = known.get("sixteen_bit_emulated", {}).get(p["provider"])
        settings["sixteen_bit_emulated_at_prepare"] = emulated \
            if p.get("precision") == precision and emulated is not None else \
            "not recorded (a --plan step, or an older --prepare)"
    for attr in ("cuda_graph", "deterministic", "cuda_graph_reason", "captured"):
        value = getattr(trainer, attr, None)  # what the Trainer says it did, where it says
        if isinstance(value, (bool, int, float, str)):
            settings[f"trainer.{attr}"] = value
    if ignored:
        settings["not_in_this_trainer"] = ignored
    predicted = {}
    for name in dir(trainer):  # predicted_peak_bytes, and any the Trainer adds
        if name.startswith("predicted_"):
            value = getattr(trainer, name, None)
            if isinstance(value, int):
                predicted[name] = value
    return {**result, "setup_s": setup_s, "weights_digest": weights, "settings": settings,
            "predicted": predicted,
            "onnxruntime_version": __import__("onnxruntime").__version__}


def _torch_child(p: dict) -> dict:
    if p["provider"] == "cpu":  # libgomp reads it once, at load: see benchmarks/torch_peer.py
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import transformers  # noqa: F401  (imported before the baseline: not the system)

    provider = p["provider"]
    device = torch.device("cuda" if provider == "cuda" else "cpu")
    meter = _Meter(provider)
    if provider == "cuda":
        # "default": PyTorch's own defaults, TF32 for cuDNN convolutions but not matmuls.
        torch.backends.cuda.matmul.allow_tf32 = p["tf32"] is True
        torch.backends.cudnn.allow_tf32 = bool(p["tf32"])
    else:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    meta = p["meta"]
    meter.start()
    t0 = time.perf_counter()
    with torch.device(device):  # built where it trains: transformers' init runs there
        module = make_module(meta)
    blocks = enable_checkpointing(module, meta["kind"]) if p["checkpoint"] else 0
    state = module.state_dict(keep_vars=True)
    in_step = set(meta["carried"])
    by_tensor: dict[int, str] = {}
    for n, t in state.items():  # tied names share one tensor: find the step's name for it
        if n in in_step:
            by_tensor[id(t)] = n
    values, filled, zeros = {}, {}, 0
    for n, t in state.items():
        source = n if n in in_step else by_tensor.get(id(t))
        if source is None and not n.endswith("num_batches_tracked"):
            raise RuntimeError(f"torch parameter {n} is not in the step and tied to nothing "
                               "that is: the twin and the export differ")
        values[n] = torch.from_numpy(seeded_value(source or n, t.shape,
                                                  _np_dtype(t.dtype), int(p["seed"])))
        if source is None:
            zeros += 1
        elif source != n:
            filled[n] = source
    extra = sorted(in_step - set(state) - {n for n in in_step if n.endswith(".momentum")})
    if extra:
        raise RuntimeError(f"the step carries {extra[:5]}, which the torch twin has not")
    module.load_state_dict(values, strict=True)
    del values
    module.to(device)
    params = [q for q in module.parameters() if q.requires_grad]
    opt = torch.optim.SGD(params, lr=float(meta["lr"]), momentum=float(meta["momentum"]))
    for q in params:  # memcc feeds zero momentum from step 1: the same state every step
        opt.state[q]["momentum_buffer"] = torch.zeros_like(q)
    setup_s = time.perf_counter() - t0
    if provider == "cuda":
        torch.cuda.synchronize()
    after_setup = meter.stop()
    held = module.state_dict()  # every name, tied ones included
    weights = digest({n: held[n].detach().cpu().numpy() for n in meta["parameters"]})
    del held
    batch = make_batch(meta, int(p["seed"]))
    x_host = torch.from_numpy(batch[DATA_INPUT[meta["kind"]]])
    y_host = torch.from_numpy(batch["labels"])
    if provider == "cuda":
        torch.cuda.reset_peak_memory_stats()
    bf16 = p.get("precision") == "bf16"

    def step() -> float:
        if provider == "cuda":
            torch.cuda.synchronize()
        x, y = x_host.to(device), y_host.to(device)
        # PyTorch's recipe: forward and loss under autocast, backward and step outside
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = module(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())  # waits for the loss
        if provider == "cuda":
            torch.cuda.synchronize()
        return value

    result = _run_steps(step, meter, int(p["warmup"]), int(p["steps"]), after_setup)
    if provider == "cuda":
        result["memory"]["torch_max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
        result["memory"]["torch_max_memory_allocated_bytes"] = \
            torch.cuda.max_memory_allocated()
    settings = {
        "provider": provider,
        "tf32": (_TF32_WORDS[p["tf32"]] if provider == "cuda" else "n/a (CPU)"),
        "precision": f"{BF16_TORCH} (device_type {device.type!r})" if bf16 else "fp32",
        "deterministic": "off (PyTorch default)",
        "read_back": {"matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
                      "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
                      "float32_matmul_precision": torch.get_float32_matmul_precision()},
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "checkpoint": f"per block ({blocks} blocks), use_reentrant=False" if blocks else "none",
        "attention": "eager" if meta["kind"] == "gpt2" else "n/a",
        "batch": "host tensors copied to the device inside each timed step",
        "filled_from": filled,  # torch names the step has not: tied to one it has
        "num_batches_tracked_zeroed": zeros,
    }
    return {**result, "setup_s": setup_s, "weights_digest": weights, "settings": settings,
            "torch_version": torch.__version__,
            "transformers_version": __import__("transformers").__version__}


def _np_dtype(torch_dtype) -> np.dtype:
    import torch

    return np.dtype({torch.float32: np.float32, torch.int64: np.int64,
                     torch.float16: np.float16, torch.float64: np.float64}[torch_dtype])


def _child(payload: dict) -> dict:
    with _quiet():
        if payload["system"] == "memcc":
            return _memcc_child(payload)
        return _torch_child(payload)


# ---------------------------------------------------------------------------- the parent
def trainer_arguments() -> set[str]:
    """The keyword arguments this memcc's ``Trainer`` takes (``cuda_graph`` and
    ``deterministic`` arrived with issue 29; rows use them only where they exist): its
    named parameters, and the ``TrainerOptions`` fields its ``**settings`` take."""
    import dataclasses

    import memcc

    params = inspect.signature(memcc.Trainer).parameters
    takes = {n for n, q in params.items() if q.kind is not inspect.Parameter.VAR_KEYWORD}
    try:
        from memcc.trainer.trainer import TrainerOptions

        takes |= {f.name for f in dataclasses.fields(TrainerOptions)}
    except ImportError:  # a memcc from before TrainerOptions: named parameters only
        pass
    return takes


_TF32_WORDS = {
    True: "on (torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32)",
    False: "off (torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32)",
    "default": "default: PyTorch's own (cudnn.allow_tf32 on for convolutions, "
               "matmul.allow_tf32 off)",
}


BF16_MEMCC = "bf16 (memcc build --precision bf16: autocast policy of memcc/frontend/autocast.py)"
BF16_TORCH = "torch.autocast bfloat16"


def systems_for(provider: str, families: Sequence[str],
                precisions: Sequence[str] = ()) -> list[dict]:
    """The rows to measure per model, most wanted first (``--time-limit`` drops the tail):
    memcc as built and PyTorch eager with TF32 on (ORT's setting; on CPU: no TF32), then,
    where a bf16 step was prepared (``precisions``), memcc's bf16 step and PyTorch eager
    under ``torch.autocast(bfloat16)`` (TF32 on); then eager with TF32 off and at PyTorch's
    own defaults (TF32 for convolutions only), checkpointing, memcc with --deterministic.
    Plans go in after the rows marked ``head``."""
    tf32s = (False, True) if provider == "cuda" else (False,)
    takes = trainer_arguments()
    # deterministic compute off where the Trainer has the switch (whatever its default)
    default = {"deterministic": False} if "deterministic" in takes else {}
    memcc, torch = "memcc" in families, "torch" in families
    eager = [{"system": "torch-eager", "kind": "torch", "checkpoint": False, "tf32": t}
             for t in tf32s]
    head, rest = [], []
    if memcc:
        head.append({"system": "memcc-as-built", "kind": "memcc", "trainer": default})
    if torch:
        head.append(eager[-1])  # TF32 on where there is TF32
    if "bf16" in precisions:
        if memcc:
            head.append({"system": "memcc-bf16", "kind": "memcc", "trainer": default,
                         "precision": "bf16"})
        if torch:
            head.append({"system": "torch-autocast-bf16", "kind": "torch",
                         "checkpoint": False, "tf32": tf32s[-1], "precision": "bf16"})
    if "fp16" in precisions and memcc:
        head.append({"system": "memcc-fp16", "kind": "memcc", "trainer": default,
                     "precision": "fp16"})
    if torch:
        rest += eager[:-1]
        if provider == "cuda":
            rest.append({"system": "torch-eager", "kind": "torch", "checkpoint": False,
                         "tf32": "default"})
        rest += [{"system": "torch-checkpoint", "kind": "torch", "checkpoint": True,
                  "tf32": t} for t in reversed(tf32s)]
    if memcc and "deterministic" in takes:
        rest.append({"system": "memcc-as-built", "kind": "memcc",
                     "trainer": {"deterministic": True}})
    return [{**r, "head": True} for r in head] + rest


def step_names(graph) -> tuple[dict[str, dict], list[str]]:
    """The step's carried values (name -> shape, dtype) and its parameters, which
    ``--prepare`` writes into the model's JSON so that the measuring run reads no graph."""
    from memcc.step import TrainingStep

    spec = TrainingStep.of(graph)
    carried = {}
    for name in sorted(set(spec.state.values())):
        ti = graph.info[name]
        carried[name] = {"shape": [int(d) for d in ti.shape], "dtype": str(ti.np_dtype)}
    return carried, list(spec.parameters)


def _decompress(src: Path, dst: Path) -> Path:
    if src.suffix != ".xz":
        return src
    with lzma.open(src, "rb") as z, open(dst, "wb") as f:
        shutil.copyfileobj(z, f, 1 << 24)
    return dst


def _plan_label(path: Path, label: str | None) -> str:
    return label or path.name.split(".")[0]


def _describe(row: dict, provider: str) -> str:
    what = row["system"] + "".join(f" {k}={v}" for k, v in (row.get("trainer") or {}).items())
    if row["kind"] == "torch" and provider == "cuda":
        what += f" tf32={ {True: 'on', False: 'off'}.get(row['tf32'], row['tf32']) }"
    return what


def load_meta(steps_from: Path, model: str) -> dict:
    meta_file = steps_from / f"{model}.json"
    step = steps_from / f"{model}.step.onnx.xz"
    if not meta_file.is_file() or not step.is_file():
        raise InputError(f"{steps_from}: no {meta_file.name} and {step.name}; run "
                         f"python benchmarks/gpu_peers.py --prepare {steps_from} first")
    meta = json.loads(meta_file.read_text())
    if "carried" not in meta:
        raise InputError(f"{meta_file}: written by an older --prepare (no 'carried'); run "
                         f"--prepare {steps_from} again")
    for precision in meta.get("precisions", {}):
        if not (steps_from / step_file(model, precision)).is_file():
            raise InputError(f"{meta_file}: lists a {precision} step but "
                             f"{step_file(model, precision)} is not in {steps_from}; copy "
                             f"it with the rest, or run --prepare {steps_from} again")
    return meta


def run(steps_from: Path, out: Path, *, provider: str = "cuda",
        models: Sequence[str] = MODELS, warmup: int = 2, steps: int = 5,
        plans: Mapping[str, list[tuple[Path, str | None]]] | None = None,
        families: Sequence[str] = ("memcc", "torch"), seed: int = SEED,
        only: Sequence[str] = (),
        timeout_s: float = 600.0, time_limit_s: float | None = None) -> dict:
    """Measure every system on every model; write and return ``summary.json``.

    Rows run in order of ``systems_for`` across models (every model's first row, then every
    model's second, ...), so that a ``time_limit_s`` that stops the run early skips the
    least wanted rows of every model rather than a whole model. Skipped rows are listed."""
    metas = {m: load_meta(steps_from, m) for m in models}
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gpu-peers-") as tmp:
        todo: list[tuple[int, int, str, dict]] = []
        for mi, model in enumerate(models):
            built = metas[model].get("precisions") or {"fp32": {}}
            step = {p: str(_decompress(steps_from / step_file(model, p),
                                       Path(tmp) / f"{model}.{p}.step.onnx"))
                    for p in built}
            mine = systems_for(provider, families, list(built))
            at = sum(1 for r in mine if r.get("head"))
            for i, (plan, label) in enumerate((plans or {}).get(model, [])):
                mine.insert(at + i, {"system": f"memcc-plan@{_plan_label(plan, label)}",
                                    "kind": "memcc", "trainer": mine[0].get("trainer", {}),
                                    "step": str(_decompress(
                                        plan, Path(tmp) / f"{model}.plan{i}.onnx"))})
            if only:  # --only: rows whose description holds one of the texts
                mine = [r for r in mine if any(t in _describe(r, provider) for t in only)]
            for rank, row in enumerate(mine):
                todo.append((rank, mi, model,
                             {"step": step[row.get("precision", "fp32")], **row}))
        log(f"{len(todo)} systems to measure, steps decompressed "
            f"({time.perf_counter() - t_start:.1f} s)")
        for rank, _, model, row in sorted(todo, key=lambda t: t[:2]):
            meta = metas[model]
            what = _describe(row, provider)
            elapsed = time.perf_counter() - t_start
            if time_limit_s is not None and elapsed > time_limit_s:
                rows.append({"system": row["system"], "model": model, "rank": rank,
                             "skipped": f"--time-limit {time_limit_s:.0f} s reached "
                                        f"({elapsed:.0f} s)", "what": what})
                log(f"{model}: {what}: skipped (time limit)")
                continue
            payload = {"system": row["kind"], "meta": meta, "provider": provider,
                       "seed": seed, "warmup": warmup, "steps": steps, "step": row["step"],
                       "trainer": row.get("trainer"), "checkpoint": row.get("checkpoint"),
                       "tf32": row.get("tf32"), "precision": row.get("precision", "fp32")}
            log(f"{model}: {what} ...")
            t0 = time.perf_counter()
            try:
                r = memory.run_child("benchmarks.gpu_peers", payload, timeout_s=timeout_s,
                                     measuring=provider == "cpu")
            except Exception as exc:  # one failing system must not hide the others
                r = {"error": f"{type(exc).__name__}: {str(exc)[-800:]}"}
            r = {"system": row["system"], "model": model, "rank": rank, **r,
                 "child_wall_s": time.perf_counter() - t0}
            rows.append(r)
            log(f"{model}: {what}: " + (r["error"] if "error" in r else
                f"median {r['median_s'] * 1e3:.1f} ms, peak {_mb(r['memory']['peak_bytes'])}"
                f" MB, first loss {r['losses'][0]:.6f}, {r['child_wall_s']:.1f} s"))
            write_summary(out, rows, metas, models, provider=provider, warmup=warmup,
                          steps=steps, seed=seed, wall_s=time.perf_counter() - t_start,
                          complete=False)  # so a run killed later leaves its rows
    return write_summary(out, rows, metas, models, provider=provider, warmup=warmup,
                         steps=steps, seed=seed, wall_s=time.perf_counter() - t_start,
                         complete=True)


def write_summary(out: Path, rows: list[dict], metas: Mapping[str, dict],
                  models: Sequence[str], *, complete: bool, **run: object) -> dict:
    """``summary.json`` from the rows so far (``complete`` false while the run goes on)."""
    rows = sorted(rows, key=lambda r: (models.index(r["model"]), r["rank"]))
    measured = [r for r in rows if "error" not in r and "skipped" not in r]
    summary = {**run, "complete": complete,
               "models": {m: {k: v for k, v in metas[m].items()
                              if k not in ("carried", "parameters")} for m in models},
               "rows": rows, "checks": checks(measured), "ratios": ratios(measured),
               "bf16_ratios": bf16_ratios(measured),
               "method": __doc__.split("Measurement.")[1].split("TF32:")[0].strip(),
               "tf32": __doc__.split("TF32:")[1].split("\n\n")[0].strip()}
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(out / "summary.json")
    return summary


def _mb(x: int | None) -> str:
    return "-" if x is None else f"{x / MB:,.0f}"


def _label(r: dict) -> str:
    s = r.get("settings", {})
    if r["system"].startswith("memcc"):
        extra = " det" if s.get("deterministic") is True else ""
        return r["system"] + extra
    tf = s.get("tf32", "")
    return r["system"] + (" tf32" if tf.startswith("on") else
                          " torch-defaults" if tf.startswith("default") else "")


BF16_TOLERANCE = 2e-2  # first loss, memcc bf16 against torch.autocast bf16, relative


def is_bf16(r: dict) -> bool:
    """A bf16 row: memcc's bf16 step (the step's own metadata says so, ``--plan`` files
    included) or PyTorch under autocast."""
    precision = str((r.get("settings") or {}).get("precision", ""))
    return precision.startswith(("bf16", "torch.autocast")) or \
        r["system"] in ("memcc-bf16", "torch-autocast-bf16")


def is_sixteen_bit(r: dict) -> bool:
    """A bf16 row, or memcc's fp16 step (dynamic loss scaling: its first loss is not an
    fp32 row's)."""
    precision = str((r.get("settings") or {}).get("precision", ""))
    return is_bf16(r) or precision.startswith("fp16") or r["system"] == "memcc-fp16"


def _rel(a: dict, ref: dict) -> float:
    return abs(a["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])


def checks(rows: list[dict]) -> dict:
    """Same weights in every row of a model (bf16 rows too: master weights are float32);
    the first loss of every fp32 row against memcc's as built (relative difference, within
    1e-3); of every memcc bf16 row against PyTorch's autocast row (within
    ``BF16_TOLERANCE``: bf16 keeps 8 bits of mantissa, a relative rounding of 2**-9 per
    value, and the two sides round different values)."""
    out: dict = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        ok = [r for r in rows if r["model"] == model and "error" not in r]
        fp32 = [r for r in ok if not is_sixteen_bit(r)]
        digests = {r["weights_digest"] for r in ok}
        ref = next((r for r in fp32 if r["system"] == "memcc-as-built"),
                   fp32[0] if fp32 else None)
        rel = {_label(r): _rel(r, ref) for r in fp32} if ref else {}
        out[model] = {"same_weights": len(digests) == 1,
                      "first_losses": {_label(r): r["losses"][0] for r in ok},
                      "first_loss_rel_diff_vs_memcc": rel,
                      "first_loss_agrees_1e-3": all(v <= 1e-3 for v in rel.values())}
        bf16 = [r for r in ok if is_bf16(r)]
        if bf16:
            out[model]["bf16"] = _bf16_check(bf16, ref)
        fp16 = [r for r in ok if is_sixteen_bit(r) and not is_bf16(r)]
        if fp16 and ref:
            out[model]["fp16_first_loss_rel_diff_vs_fp32_memcc"] = {
                _label(r): _rel(r, ref) for r in fp16}
    return out


def _bf16_check(bf16: list[dict], fp32_ref: dict | None) -> dict:
    peer = next((r for r in bf16 if r["system"].startswith("torch")), None)
    mine = [r for r in bf16 if r["system"].startswith("memcc")]
    rel = {_label(r): _rel(r, peer) for r in mine} if peer else {}
    return {"tolerance": BF16_TOLERANCE, "reference": _label(peer) if peer else None,
            "first_loss_rel_diff_vs_torch_autocast": rel,
            # None: one side missing (failed or skipped), nothing to compare
            "first_loss_agrees": all(v <= BF16_TOLERANCE for v in rel.values())
            if rel else None,
            "first_loss_rel_diff_vs_fp32_memcc": {_label(r): _rel(r, fp32_ref) for r in bf16}
            if fp32_ref else {}}


def _ratio(a: dict, b: dict) -> dict:
    pa, pb = a["memory"]["peak_bytes"], b["memory"]["peak_bytes"]
    return {"time": a["median_s"] / b["median_s"], "peak": pa / pb if pa and pb else None}


def ratios(rows: list[dict]) -> dict:
    """memcc / PyTorch, per model: median step time and NVML peak, each memcc row against
    each PyTorch row of the same run."""
    out: dict = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        ok = [r for r in rows if r["model"] == model and "error" not in r]
        mine = [r for r in ok if r["system"].startswith("memcc")]
        peers = [r for r in ok if r["system"].startswith("torch")]
        out[model] = {_label(a): {_label(b): _ratio(a, b) for b in peers} for a in mine}
    return out


def bf16_ratios(rows: list[dict]) -> dict:
    """Per model, where both rows were measured: memcc-bf16 / torch-autocast-bf16, and
    bf16 / fp32 for memcc (against memcc-as-built without --deterministic) and for PyTorch
    (against eager at the autocast row's TF32 setting)."""
    out: dict = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        ok = [r for r in rows if r["model"] == model and "error" not in r
              and (r.get("settings") or {}).get("deterministic") is not True]
        by = {r["system"]: r for r in reversed(ok)}  # the first row of each system
        pairs = {"memcc-bf16 / torch-autocast-bf16": ("memcc-bf16", "torch-autocast-bf16"),
                 "memcc bf16 / fp32": ("memcc-bf16", "memcc-as-built")}
        got = {k: (by.get(a), by.get(b)) for k, (a, b) in pairs.items()}
        peer = by.get("torch-autocast-bf16")
        if peer is not None:  # eager at the same TF32 as autocast ran
            tf32 = peer.get("settings", {}).get("tf32")
            got["torch bf16 / fp32"] = (peer, next(
                (r for r in ok if r["system"] == "torch-eager"
                 and r.get("settings", {}).get("tf32") == tf32), None))
        mine = {k: {"rows": [_label(a), _label(b)], **_ratio(a, b)}
                for k, (a, b) in got.items() if a is not None and b is not None}
        if mine:
            out[model] = mine
    return out


def table(summary: dict) -> str:
    lines = [f"provider {summary['provider']}, {summary['warmup']} warm-up + "
             f"{summary['steps']} timed steps; peak = device used (NVML) or RSS over the "
             "child's start", "",
             "| model | system | peak MB | steady MB | torch reserved / allocated MB | "
             "median ms (min..max, IQR) | first step s | losses |",
             "|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        if "error" in r or "skipped" in r:
            why = r.get("error") or "skipped: " + r["skipped"]
            lines.append(f"| {r['model']} | {r.get('what', r['system'])} | {why[:160]} "
                         "|||||")
            continue
        m = r["memory"]
        torch_mem = (f"{_mb(m['torch_max_memory_reserved_bytes'])} / "
                     f"{_mb(m['torch_max_memory_allocated_bytes'])}"
                     if "torch_max_memory_reserved_bytes" in m else "")
        lines.append(
            f"| {r['model']} | {_label(r)} | {_mb(m['peak_bytes'])} | "
            f"{_mb(m['peak_steady_bytes'])} | {torch_mem} | {r['median_s'] * 1e3:.1f} "
            f"({r['min_s'] * 1e3:.1f}..{r['max_s'] * 1e3:.1f}, {r['iqr_s'] * 1e3:.1f}) | "
            f"{r['first_step_s']:.2f} | {', '.join(f'{x:.5f}' for x in r['losses'][:3])} |")
    lines += ["", "memcc / PyTorch (time, peak), same run:"]
    for model, mine in summary["ratios"].items():
        for a, peers in mine.items():
            cells = "; ".join(f"{b}: {v['time']:.2f}x time, "
                              + (f"{v['peak']:.2f}x peak" if v["peak"] else "peak -")
                              for b, v in peers.items())
            lines.append(f"- {model} {a}: {cells}")
    for model, mine in summary.get("bf16_ratios", {}).items():
        cells = "; ".join(f"{k} ({' / '.join(v['rows'])}): {v['time']:.2f}x time, "
                          + (f"{v['peak']:.2f}x peak" if v["peak"] else "peak -")
                          for k, v in mine.items())
        lines.append(f"- {model} bf16: {cells}")
    for model, c in summary["checks"].items():
        worst = max(c["first_loss_rel_diff_vs_memcc"].values(), default=0.0)
        line = (f"- {model}: same weights in every row: {c['same_weights']}; fp32 first loss "
                f"agrees within 1e-3: {c['first_loss_agrees_1e-3']} "
                f"(max rel. diff {worst:.2e})")
        if "bf16" in c:
            b = c["bf16"]
            worst = max(b["first_loss_rel_diff_vs_torch_autocast"].values(), default=0.0)
            line += (f"; bf16 first loss agrees with {b['reference']} within "
                     f"{b['tolerance']:.0e}: {b['first_loss_agrees']} "
                     f"(max rel. diff {worst:.2e})")
        lines.append(line)
    return "\n".join(lines)


def _plans(specs: Sequence[str]) -> dict[str, list[tuple[Path, str | None]]]:
    plans: dict[str, list[tuple[Path, str | None]]] = {}
    for spec in specs:
        model, eq, rest = spec.partition("=")
        if not eq or model not in MODELS:
            raise InputError(f"--plan {spec}: write MODEL=FILE[@LABEL] with MODEL one of "
                             f"{', '.join(MODELS)}")
        path, _, label = rest.partition("@")
        if not Path(path).is_file():
            raise InputError(f"--plan {spec}: {path} is not a file")
        plans.setdefault(model, []).append((Path(path), label or None))
    return plans


def main(argv: Sequence[str]) -> int:
    if "--child" in argv:
        return memory.child_main(list(argv), _child)
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu_peers.py",
                                 description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--prepare", type=Path, metavar="DIR",
                      help="export and build the steps into DIR (CPU; needs torch)")
    what.add_argument("--steps-from", type=Path, metavar="DIR",
                      help="measure the steps --prepare wrote into DIR")
    ap.add_argument("--out", type=Path, help="where summary.json goes (with --steps-from)")
    ap.add_argument("--small", action="store_true", help="tiny configs (with --prepare)")
    ap.add_argument("--precision", action="append", default=[], choices=PRECISIONS,
                    help="with --prepare: also build each model's step at this precision "
                         "from the same export (repeatable); --steps-from then adds its rows")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--plan", action="append", default=[], metavar="MODEL=FILE[@LABEL]",
                    help="also measure this compiled step (memcc compile's output, .xz ok)")
    ap.add_argument("--systems", default="memcc,torch",
                    help="which families of rows: memcc, torch or both")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="measure only the rows whose description holds TEXT (repeatable; "
                         "e.g. 'tf32=default', 'memcc-as-built')")
    ap.add_argument("--time-limit", type=float, default=None, metavar="S",
                    help="start no system after S seconds; the rows left are listed as "
                         "skipped (least wanted rows of every model go first)")
    args = ap.parse_args(list(argv))
    models = [m for m in args.models.split(",") if m]
    bad = sorted(set(models) - set(MODELS))
    if bad:
        ap.error(f"--models: unknown {bad}; choose from {', '.join(MODELS)}")
    if args.prepare:
        sizes = prepare(args.prepare, small=args.small, models=models, lr=args.lr,
                        precisions=args.precision)
        total = sum(s["compressed_bytes"] for s in sizes.values())
        print(json.dumps({"sizes": sizes, "compressed_total_bytes": total}, indent=2))
        return 0
    if args.out is None:
        ap.error("--steps-from needs --out DIR")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1")
    families = [f for f in args.systems.split(",") if f]
    if not families or set(families) - {"memcc", "torch"}:
        ap.error(f"--systems {args.systems}: write memcc, torch or memcc,torch")
    try:
        summary = run(args.steps_from, args.out, provider=args.provider, models=models,
                      warmup=args.warmup, steps=args.steps, plans=_plans(args.plan),
                      families=families, seed=args.seed, timeout_s=args.timeout,
                      only=args.only,
                      time_limit_s=args.time_limit)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(summary))
    log(f"wrote {args.out / 'summary.json'} ({summary['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
