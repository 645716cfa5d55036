"""The PyTorch peer of memcc's recompute benchmark: eager PyTorch, optionally with
``torch.utils.checkpoint``, training the same architecture as a memcc zoo model.

The question the benchmark answers is "what would a user otherwise do to fit the step": run it
in PyTorch eager and wrap every residual block in ``checkpoint(block, x,
use_reentrant=False)`` (what Hugging Face's ``gradient_checkpointing_enable`` and torchvision
users do), or ``checkpoint_sequential`` with about sqrt(#blocks) segments. For the comparison
to mean anything, three things are held equal with memcc's own run (``memcc.backend.runner``):

- the model: the torch modules below mirror ``models/resnet.py``, ``models/gpt2.py`` and
  ``models/mlp.py`` layer for layer and load the very weights the zoo builder writes (parameter
  names are the same), so the first loss equals memcc's first loss;
- the step: cross-entropy over the last axis (mean), SGD lr 0.01 momentum 0.9, one fixed batch
  drawn exactly like ``runner.synthetic_feeds`` (N(0, 1) floats or token ids, then labels,
  from one ``numpy.random.default_rng(seed)``), momentum buffers present from the start like
  memcc's optimizer-state inputs;
- the measurement: a fresh child process with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc returns
  every buffer of 64 KiB or more to the kernel at free), baseline RSS taken after a warm-up
  step on a throw-away copy of the model was freed, then parameters, momentum and batch created
  afresh, the high-water mark reset before each step and ``VmHWM - baseline`` read after it.
  So the peak counts parameters, gradients, optimizer state, batch, activations and kernel
  scratch, but not the torch runtime itself, as memcc's figure does for ORT.

Threads: ``torch.set_num_threads(len(os.sched_getaffinity(0)))`` by default, i.e. every core
this process may run on, which is what ORT's default intra-op pool uses on machines without
SMT (ORT takes physical cores; pass ``threads=`` to match it on SMT machines). The child
sets ``OMP_WAIT_POLICY=PASSIVE`` by default (``omp_wait_policy=None`` keeps the environment's):
with any other busy process on the machine, OpenMP workers spinning for a descheduled peer
made steps 10-50x slower and erratic (0.2 s to 8 s for the same step on 2 shared cores),
whereas ORT's own pool degrades gracefully; passive waiting costs little on big kernels and
keeps the comparison about the step rather than about the neighbours. Peaks do not depend
on it.

Differences that remain are PyTorch's own and are the point of the comparison: in-place
updates (torch's SGD writes parameters in place, memcc's step outputs new ones), in-place ReLU
and ``+=`` in ResNet blocks (as torchvision writes them), and autograd's choice of what to save.

torch.compile (``compile_budget=f``): the module's forward goes through ``torch.compile``
(inductor, CPU) with ``torch._functorch.config.activation_memory_budget = f``, so the
min-cut partitioner with its knapsack decides what the backward recomputes. That is
PyTorch's own automatic answer to the question memcc answers, so it is the peer a plan
should be held against at the same memory. The warm-up step compiles (its time is reported
as ``compile_s``); each budget gets a code object of its own and every call runs under
``config.patch`` so that a guard failure can never recompile under another budget. The
optimizer step stays eager, as in most training loops.

``time_torch`` times several variants interleaved in one process (``benchmarks.stats``), in
a child with glibc's default allocator, for paired time ratios.

    python -m benchmarks.torch_peer resnet50 --batch 8 --resolution 128 --checkpoint per-block
    python -m benchmarks.torch_peer gpt2 --seq-len 128 --compile-budget 0.5
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence

import numpy as np

from memcc.backend import memory

FAMILIES = ("resnet18", "resnet50", "gpt2", "mlp")
CHECKPOINTS = ("none", "per-block", "sqrt")
ATTENTIONS = ("eager", "sdpa")
LR = 0.01
MOMENTUM = 0.9
# Zoo options that say how to write the ONNX graph, not what the network is.
_GRAPH_ONLY = ("dynamic_batch",)


# ---------------------------------------------------------------------------- public API
def measure_torch(family: str, options: dict, *, checkpoint: str = "none", steps: int = 3,
                  seed: int = 0, threads: int | None = None, attention: str = "eager",
                  omp_wait_policy: str | None = "PASSIVE", timeout_s: float | None = None,
                  compile_budget: float | None = None) -> dict:
    """Measure ``steps`` PyTorch eager training steps of zoo model ``family`` in a fresh child.

    ``options`` are the zoo builder's options (``models.build_model(family, **options)``);
    ``checkpoint`` is "none", "per-block" or "sqrt"; ``attention`` "eager" (explicit scores
    tensor, as the zoo's graph and HF's eager GPT-2) or "sdpa" (torch's fused attention);
    ``threads`` defaults to every core; ``omp_wait_policy`` see the module docstring;
    ``compile_budget`` (0..1) runs the forward under torch.compile with that
    ``activation_memory_budget`` (module docstring). Returns family, options, checkpoint,
    peak_bytes (max over steps), peak_bytes_per_step, step_time_s (median; a warm-up step
    ran before), step_times_s, losses, state_bytes (parameters + buffers + momentum + batch),
    threads, torch_version and method; with ``compile_budget`` also compile_s and
    graphs_compiled_during_steps (0 unless a guard failed and the measured steps paid for a
    recompile).
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, not {family!r}")
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, not {checkpoint!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, not {attention!r}")
    if steps < 1:
        raise ValueError("steps must be at least 1")
    _check_budget(compile_budget)
    payload = {"family": family, "options": dict(options), "checkpoint": checkpoint,
               "steps": steps, "seed": seed, "attention": attention,
               "threads": threads or len(os.sched_getaffinity(0)),
               "omp_wait_policy": omp_wait_policy, "compile_budget": compile_budget}
    return memory.run_child("benchmarks.torch_peer", payload, timeout_s=timeout_s)


def time_torch(family: str, options: dict, variants: Sequence[dict], *, rounds: int = 10,
               warmup: int = 1, order: str = "random", seed: int = 0,
               threads: int | None = None, attention: str = "eager",
               omp_wait_policy: str | None = "PASSIVE", timeout_s: float | None = None,
               min_seconds: float = 0.0, max_rounds: int | None = None) -> dict:
    """Time ``variants`` of one model interleaved, round by round, in one fresh child.

    Each variant is ``{"name": ..., "checkpoint": ..., "compile_budget": ... or None}``.
    One process for all of them so that round r of every variant shares the machine's state
    (``benchmarks.stats``); glibc's default allocator (``memory.timing_env``) because the
    measuring allocator's page faults are not what training costs. Each variant's first
    step (compilation included) runs alone before the rounds start; ``min_seconds`` and
    ``max_rounds`` as in ``benchmarks.stats.interleaved_times``. Returns
    ``{"times": {name: [s per round]}, "compile_s": {name: s}, "threads", ...}``.
    """
    for v in variants:
        if v.get("checkpoint", "none") not in CHECKPOINTS:
            raise ValueError(f"variant {v}: checkpoint must be one of {CHECKPOINTS}")
        _check_budget(v.get("compile_budget"))
    payload = {"kind": "time", "family": family, "options": dict(options),
               "variants": [dict(v) for v in variants], "rounds": int(rounds),
               "warmup": int(warmup), "order": order, "seed": seed, "attention": attention,
               "min_seconds": float(min_seconds), "max_rounds": max_rounds,
               "threads": threads or len(os.sched_getaffinity(0)),
               "omp_wait_policy": omp_wait_policy}
    return memory.run_child("benchmarks.torch_peer", payload, timeout_s=timeout_s,
                            measuring=False)


def _check_budget(budget: float | None) -> None:
    if budget is not None and not 0.0 <= float(budget) <= 1.0:
        raise ValueError(f"compile_budget must lie in [0, 1], not {budget}")


# ---------------------------------------------------------------------------- modules
def _torch():
    """Import torch lazily: the parent process only starts the child."""
    import torch

    return torch


@functools.cache
def _modules():
    """The torch modules, defined on first use so importing this file does not need torch.

    Defined once per process: torch.compile guards on the module's class, and fresh classes
    per call would make every new model instance recompile (inside the measured steps).
    """
    torch = _torch()
    nn = torch.nn
    F = nn.functional
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    def run_blocks(blocks: Sequence[nn.Module], x, mode: str):
        """The only place checkpointing happens: around residual blocks, nowhere else."""
        if mode == "sqrt":
            segments = max(1, round(math.sqrt(len(blocks))))
            return checkpoint_sequential(list(blocks), segments, x, use_reentrant=False)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False) if mode == "per-block" else block(x)
        return x

    def conv_bn(cin: int, cout: int, k: int, stride: int = 1, pad: int | None = None):
        conv = nn.Conv2d(cin, cout, k, stride, k // 2 if pad is None else pad, bias=False)
        return conv, nn.BatchNorm2d(cout)

    class Bottleneck(nn.Module):
        """torchvision's Bottleneck (v1.5, stride on the 3x3), with its in-place ops."""

        def __init__(self, cin: int, planes: int, stride: int) -> None:
            super().__init__()
            cout = planes * 4
            self.conv1, self.bn1 = conv_bn(cin, planes, 1)
            self.conv2, self.bn2 = conv_bn(planes, planes, 3, stride)
            self.conv3, self.bn3 = conv_bn(planes, cout, 1)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = (nn.Sequential(*conv_bn(cin, cout, 1, stride))
                               if stride != 1 or cin != cout else None)

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            out += x if self.downsample is None else self.downsample(x)
            return self.relu(out)

    class BasicBlock(nn.Module):
        """torchvision's BasicBlock."""

        def __init__(self, cin: int, planes: int, stride: int) -> None:
            super().__init__()
            self.conv1, self.bn1 = conv_bn(cin, planes, 3, stride)
            self.conv2, self.bn2 = conv_bn(planes, planes, 3)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = (nn.Sequential(*conv_bn(cin, planes, 1, stride))
                               if stride != 1 or cin != planes else None)

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            out += x if self.downsample is None else self.downsample(x)
            return self.relu(out)

    class ResNet(nn.Module):
        """models/resnet.py: 7x7/2 stem, BN, ReLU, 3x3/2 max-pool, 4 stages, GAP, fc."""

        def __init__(self, arch: str, width: int, num_classes: int, in_channels: int,
                     blocks: Sequence[int], mode: str) -> None:
            super().__init__()
            self.mode = mode
            block, expansion = (Bottleneck, 4) if arch == "resnet50" else (BasicBlock, 1)
            self.conv1, self.bn1 = conv_bn(in_channels, width, 7, 2, 3)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            cin = width
            for stage, count in enumerate(blocks):
                planes = width * 2**stage
                layer = []
                for j in range(count):
                    layer.append(block(cin, planes, 2 if stage > 0 and j == 0 else 1))
                    cin = planes * expansion
                setattr(self, f"layer{stage + 1}", nn.Sequential(*layer))
            self.stages = len(blocks)
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(cin, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            blocks = [b for s in range(self.stages) for b in getattr(self, f"layer{s + 1}")]
            x = run_blocks(blocks, x, self.mode)
            return self.fc(torch.flatten(self.avgpool(x), 1))

    class Conv1D(nn.Module):
        """HF's Conv1D: weight [in, out], as the zoo's MatMul + Add ``dense``."""

        def __init__(self, fin: int, fout: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(fin, fout))
            self.bias = nn.Parameter(torch.zeros(fout))

        def forward(self, x):
            y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
            return y.view(*x.shape[:-1], y.shape[-1])

    def gelu_new(x):
        """HF's NewGELUActivation, written out like the zoo's Pow/Tanh graph."""
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))

    class Attention(nn.Module):
        def __init__(self, width: int, heads: int, attention: str) -> None:
            super().__init__()
            self.heads, self.attention = heads, attention
            self.c_attn = Conv1D(width, 3 * width)
            self.c_proj = Conv1D(width, width)

        def forward(self, x):
            b, t, w = x.shape
            d = w // self.heads
            q, k, v = (z.view(b, t, self.heads, d).transpose(1, 2)
                       for z in self.c_attn(x).split(w, dim=2))
            if self.attention == "sdpa":
                ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
                mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                scores = torch.where(mask, scores, scores.new_tensor(-1e9))
                ctx = torch.matmul(torch.softmax(scores, dim=-1), v)
            return self.c_proj(ctx.transpose(1, 2).reshape(b, t, w))

    class MLPBlock(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.c_fc = Conv1D(width, 4 * width)
            self.c_proj = Conv1D(4 * width, width)

        def forward(self, x):
            return self.c_proj(gelu_new(self.c_fc(x)))

    class GPT2Block(nn.Module):
        """Pre-LN block of models/gpt2.py (HF GPT2Block without dropout)."""

        def __init__(self, width: int, heads: int, attention: str) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(width, eps=1e-5)
            self.attn = Attention(width, heads, attention)
            self.ln_2 = nn.LayerNorm(width, eps=1e-5)
            self.mlp = MLPBlock(width)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT2(nn.Module):
        """models/gpt2.py: wte + wpe, pre-LN blocks, ln_f, LM head (tied to wte or not)."""

        def __init__(self, vocab_size: int, width: int, depth: int, heads: int,
                     n_positions: int, tie_embeddings: bool, mode: str, attention: str
                     ) -> None:
            super().__init__()
            self.mode = mode
            self.wte = nn.Embedding(vocab_size, width)
            self.wpe = nn.Embedding(n_positions, width)
            self.h = nn.ModuleList(GPT2Block(width, heads, attention) for _ in range(depth))
            self.ln_f = nn.LayerNorm(width, eps=1e-5)
            self.lm_head = None
            if not tie_embeddings:  # the zoo stores it [width, vocab] for a plain MatMul
                self.lm_head = nn.Module()
                self.lm_head.weight = nn.Parameter(torch.empty(width, vocab_size))

        def forward(self, ids):
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = run_blocks(self.h, self.wte(ids) + self.wpe(pos), self.mode)
            x = self.ln_f(x)
            if self.lm_head is None:
                return F.linear(x, self.wte.weight)
            return torch.matmul(x, self.lm_head.weight)

    class MLP(nn.Module):
        """models/mlp.py: ``depth`` Linear + ReLU layers (the blocks) and a Linear head."""

        def __init__(self, in_features: int, width: int, depth: int, num_classes: int,
                     mode: str) -> None:
            super().__init__()
            self.mode = mode
            self.layers = nn.ModuleList(
                nn.Linear(in_features if i == 0 else width, width) for i in range(depth))
            self.head = nn.Linear(width if depth else in_features, num_classes)

        def forward(self, x):
            blocks = [nn.Sequential(layer, nn.ReLU()) for layer in self.layers]
            return self.head(run_blocks(blocks, x, self.mode))

    return {"resnet": ResNet, "gpt2": GPT2, "mlp": MLP}


# ---------------------------------------------------------------------------- zoo mirror
def zoo_options(family: str, options: dict) -> tuple[dict, object]:
    """The builder's options with its defaults filled in (from the model metadata), and the
    built ONNX model.

    Building the zoo model is how this file stays in step with the zoo: defaults, the
    resolved block counts and the weights all come from the builder itself.
    """
    from models import build_model, model_meta

    opts = {k: v for k, v in options.items() if k not in _GRAPH_ONLY and k != "arch"}
    model = build_model(family, **opts)
    return model_meta(model)["options"], model


def zoo_weights(model) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    # copies: to_array views the protobuf bytes read-only, which torch.from_numpy warns about
    return {t.name: np.array(numpy_helper.to_array(t)) for t in model.graph.initializer}


def make_module(family: str, opts: dict, mode: str, attention: str):
    """The torch module for ``family`` with the zoo's resolved options (no weights yet)."""
    m = _modules()
    if family.startswith("resnet"):
        module = m["resnet"](family, opts["width"], opts["num_classes"], opts["in_channels"],
                             opts["blocks"], mode)
        if not opts.get("bn_training", True):
            module.apply(lambda mod: mod.eval() if "BatchNorm" in type(mod).__name__ else None)
        return module
    if family == "gpt2":
        return m["gpt2"](opts["vocab_size"], opts["width"], opts["depth"], opts["heads"],
                         opts["n_positions"], opts["tie_embeddings"], mode, attention)
    return m["mlp"](opts["in_features"], opts["width"], opts["depth"], opts["num_classes"],
                    mode)


def load_weights(module, family: str, opts: dict, weights: dict[str, np.ndarray]) -> None:
    """Copy the zoo's initializers into ``module``; every name must match one tensor."""
    torch = _torch()
    state = {}
    for name, arr in weights.items():
        if family == "mlp" and opts.get("linear") == "matmul" and name.endswith(".weight"):
            arr = arr.T  # MatMul stores [in, out]; nn.Linear holds [out, in]
        state[name] = torch.from_numpy(np.ascontiguousarray(arr))
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise RuntimeError(f"torch/zoo mismatch: missing {missing}, unexpected {unexpected}")


def make_batch(family: str, opts: dict, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch ``memcc.backend.runner.synthetic_feeds`` makes: data input, then labels."""
    rng = np.random.default_rng(seed)
    b = opts["batch"]
    if family == "gpt2":
        shape, classes = (b, opts["seq_len"]), opts["vocab_size"]
        data = rng.integers(0, opts["vocab_size"], size=shape, dtype=np.int64)
        return data, rng.integers(0, classes, size=shape, dtype=np.int64)
    if family == "mlp":
        data = rng.standard_normal((b, opts["in_features"]), dtype=np.float32)
    else:
        r = opts["resolution"]
        data = rng.standard_normal((b, opts["in_channels"], r, r), dtype=np.float32)
    return data, rng.integers(0, opts["num_classes"], size=(b,), dtype=np.int64)


# ---------------------------------------------------------------------------- the child
def _setup(family: str, opts: dict, weights, batch, mode: str, attention: str):
    """Module, SGD with its momentum buffers, and tensors of the batch: the step's state."""
    torch = _torch()
    module = make_module(family, opts, mode, attention)
    load_weights(module, family, opts, weights)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    for p in params:  # memcc feeds zero momentum from step 1: same memory every step
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    x, y = (torch.from_numpy(a.copy()) for a in batch)
    return module, opt, x, y


def _call_module(module, x):
    """The frame torch.compile traces; each budget runs a renamed copy of its code."""
    return module(x)


def _eager_forward(module, x):
    return module(x)


def _forward_fn(compile_budget: float | None, tag: str) -> Callable:
    """``forward(module, x)``: eager, or compiled under ``activation_memory_budget``.

    Dynamo caches compiled code on the code object of the traced frame and does not guard
    on functorch's config, so two budgets sharing one code object would share one partition.
    A renamed copy of ``_call_module``'s code per budget keeps their caches apart; the
    ``config.patch`` around every call makes any recompile use this variant's budget.
    """
    if compile_budget is None:
        return _eager_forward
    torch = _torch()
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    # One compile thread: a worker pool competes with the measured process for 2 cores
    # and lives on after compiling; the compiled code is the same either way.
    inductor_config.compile_threads = 1
    code = _call_module.__code__
    name = f"_call_module_{tag}"
    code = code.replace(co_name=name, **({"co_qualname": name}
                                         if hasattr(code, "co_qualname") else {}))
    compiled = torch.compile(types.FunctionType(code, _call_module.__globals__, name))
    budget = float(compile_budget)

    def forward(module, x):
        with functorch_config.patch(activation_memory_budget=budget):
            return compiled(module, x)

    return forward


def _graphs_compiled() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def _train_step(module, opt, x, y, forward: Callable = _eager_forward) -> float:
    """One step; grads are dropped at its end so nothing but the state outlives it."""
    torch = _torch()
    logits = forward(module, x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _state_bytes(module, opt, x, y) -> int:
    tensors = [*module.parameters(), *module.buffers(), x, y]
    tensors += [s["momentum_buffer"] for s in opt.state.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_measurement(payload: dict) -> dict:
    """Child side of ``measure_torch`` (see the module docstring for the procedure)."""
    if payload.get("omp_wait_policy"):  # libgomp reads it once, when torch loads it
        os.environ["OMP_WAIT_POLICY"] = payload["omp_wait_policy"]
    torch = _torch()
    torch.set_num_threads(int(payload["threads"]))
    family, mode, attention = payload["family"], payload["checkpoint"], payload["attention"]
    budget = payload.get("compile_budget")
    opts, model = zoo_options(family, payload["options"])
    weights = zoo_weights(model)
    del model
    batch = make_batch(family, opts, int(payload["seed"]))
    forward = _forward_fn(budget, "measure")

    state = _setup(family, opts, weights, batch, mode, attention)
    t0 = time.perf_counter()
    _train_step(*state, forward)  # warm-up: compile, thread pools, oneDNN primitives
    compile_s = time.perf_counter() - t0
    del state
    gc.collect()
    meter = memory.CpuPeakMeter()
    meter.set_baseline()

    state = _setup(family, opts, weights, batch, mode, attention)
    graphs_before = _graphs_compiled()
    losses, times, peaks = [], [], []
    for _ in range(int(payload["steps"])):
        meter.start()
        t0 = time.perf_counter()
        losses.append(_train_step(*state, forward))
        times.append(time.perf_counter() - t0)
        peaks.append(meter.stop())
    how = "torch eager" if budget is None else \
        f"torch.compile (inductor) with activation_memory_budget={budget}"
    extra = {} if budget is None else {
        "compile_budget": budget, "compile_s": compile_s,
        "graphs_compiled_during_steps": _graphs_compiled() - graphs_before}
    return extra | {
        "family": family, "options": payload["options"], "resolved_options": opts,
        "checkpoint": mode, "attention": attention,
        "peak_bytes": max(peaks), "peak_bytes_per_step": peaks,
        "step_time_s": statistics.median(times), "step_times_s": times, "losses": losses,
        "state_bytes": _state_bytes(*state), "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "method": f"{how}, {meter.method}; baseline after a warm-up step on a freed "
                  f"copy; {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
                  f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}",
    }


def run_timing(payload: dict) -> dict:
    """Child side of ``time_torch``: every variant set up and warmed, then timed in rounds."""
    if payload.get("omp_wait_policy"):
        os.environ["OMP_WAIT_POLICY"] = payload["omp_wait_policy"]
    torch = _torch()
    from benchmarks.stats import interleaved_times

    torch.set_num_threads(int(payload["threads"]))
    family, attention = payload["family"], payload["attention"]
    opts, model = zoo_options(family, payload["options"])
    weights = zoo_weights(model)
    del model
    batch = make_batch(family, opts, int(payload["seed"]))
    steps: dict[str, Callable[[], float]] = {}
    compile_s: dict[str, float] = {}
    for i, v in enumerate(payload["variants"]):
        forward = _forward_fn(v.get("compile_budget"), f"v{i}")
        state = _setup(family, opts, weights, batch, v.get("checkpoint", "none"), attention)
        t0 = time.perf_counter()
        _train_step(*state, forward)
        compile_s[v["name"]] = time.perf_counter() - t0
        steps[v["name"]] = (lambda st=state, fw=forward: _train_step(*st, fw))
    graphs_before = _graphs_compiled()
    times = interleaved_times(steps, rounds=int(payload["rounds"]),
                              warmup=int(payload["warmup"]), order=payload["order"],
                              seed=int(payload["seed"]),
                              min_seconds=float(payload.get("min_seconds") or 0.0),
                              max_rounds=payload.get("max_rounds"))
    return {"times": times, "compile_s": compile_s,
            "graphs_compiled_during_rounds": _graphs_compiled() - graphs_before,
            "threads": torch.get_num_threads(), "torch_version": torch.__version__,
            "method": "interleaved rounds in one process, default allocator, "
                      f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"}


def _child(payload: dict) -> dict:
    return run_timing(payload) if payload.get("kind") == "time" else run_measurement(payload)


# ---------------------------------------------------------------------------- CLI
def _value(text: str):
    """``8`` -> 8, ``3,4,6,3`` -> [3, 4, 6, 3], ``false`` -> False, else the string."""
    if "," in text:
        return [_value(t) for t in text.split(",")]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, dict]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.torch_peer",
        description="Measure PyTorch eager training steps of a memcc zoo architecture. Any "
                    "other --name VALUE is a zoo option (--batch 8 --resolution 128, "
                    "--seq-len 256, --blocks 3,4,6,3); see `python -m models --help`.")
    p.add_argument("family", choices=FAMILIES)
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default="none")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the batch (weights: --weight-seed)")
    p.add_argument("--weight-seed", type=int, default=None, help="the zoo's seed option")
    p.add_argument("--threads", type=int, default=None, help="default: every core")
    p.add_argument("--omp-wait-policy", default="PASSIVE",
                   help="OMP_WAIT_POLICY of the child; 'inherit' keeps the environment's")
    p.add_argument("--attention", choices=ATTENTIONS, default="eager")
    p.add_argument("--compile-budget", type=float, default=None,
                   help="torch.compile with this activation_memory_budget (0..1)")
    args, rest = p.parse_known_args(list(argv))
    options: dict = {}
    it = iter(rest)
    for flag in it:
        if not flag.startswith("--"):
            p.error(f"unexpected argument {flag!r}")
        key, eq, text = flag[2:].partition("=")
        options[key.replace("-", "_")] = _value(text if eq else next(it, "true"))
    if args.weight_seed is not None:
        options["seed"] = args.weight_seed
    return args, options


def main(argv: Sequence[str]) -> int:
    if "--child" in argv:
        return memory.child_main(list(argv), _child)
    args, options = parse_args(argv)
    result = measure_torch(args.family, options, checkpoint=args.checkpoint, steps=args.steps,
                           seed=args.seed, threads=args.threads, attention=args.attention,
                           omp_wait_policy=None if args.omp_wait_policy == "inherit"
                           else args.omp_wait_policy, compile_budget=args.compile_budget)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
