"""ONNX Runtime sessions under memcc's execution contract.

A memory plan is a statement about one node order and one set of buffers. ORT keeps neither
by default (ORT_NOTES.md §1-3), so every session memcc creates, for timing, for the order
check and for the measured steps, is made here with the settings that keep a plan intact:

- ``execution_order = PRIORITY_BASED``: Kahn's algorithm with ties broken by node index, and
  node indices follow the file, so a file written in the planned topological order runs in
  exactly that order. The default (``DEFAULT``) is a reverse DFS that runs a recompute node
  next to its forward twin and undoes the plan.
- ``graph_optimization_level = ORT_DISABLE_ALL``: level 1 already merges duplicated
  (recomputed) nodes back (CommonSubexpressionElimination), folds the data dependencies that
  pin a node late (ConstantFolding) and fuses nodes into new ones with high indices that
  break the order. memcc writes the graph it wants run; ORT must run that graph. The
  ``optimization.disable_specified_optimizers`` entry also names CSE and ConstantFolding so
  that raising the level for an experiment can never silently bring them back.
- ``enable_mem_pattern = False``: the pattern planner allocates one block from the first
  run's trace; measured, it doubled the second run's peak.
- ``enable_mem_reuse = False``: with reuse on, the planner hands a dead buffer to a later
  value of the same shape and keeps it allocated in between (measured: 32 MB instead of
  16 MB on a three-node graph), so the peak depends on which shapes happen to match. With
  it off, a buffer is freed after its last consumer and nothing else, which is what
  ``passes.analysis.liveness`` predicts. Kernel-level in-place updates and aliasing (Relu,
  Reshape, ...) do not depend on this flag and liveness models them.
- CPU arena off (``enable_cpu_mem_arena = False``): allocations go straight to malloc and
  are returned at free, so the operating system sees the real peak. ``session.
  disable_prepacking``: prepacking copies constant weights into a second layout that no
  plan counts.
- CUDA: ``arena_extend_strategy = kSameAsRequested`` (the default power-of-two growth took
  133 MiB for a 96 MiB plan), ``cudnn_conv_use_max_workspace = 0`` (predictable scratch),
  and ``gpu_mem_limit`` when a budget should make the run fail instead of spill. The CUDA
  settings follow ORT's sources and have not been checked on a GPU yet.
- ``cpu_arena=True`` (``memcc run --arena``): the CPU provider allocates through the same
  arena class as CUDA (``BFCArena``, registered once per process with kSameAsRequested and
  shared through ``session.use_env_allocators``), so the CUDA allocation rules that
  ``passes.analysis.arena`` models are measured on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import onnx
import onnxruntime as ort

from memcc.errors import InputError, RuntimeFailure
from memcc.step import PRECISION_KEY

# ORT's default logger prints graph-load warnings (initializers that are also inputs, unused
# initializers) that are expected for memcc's files; errors still show.
ort.set_default_logger_severity(3)

PROVIDERS = ("cpu", "cuda", "auto")
ORT_PROVIDER = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
DISABLED_OPTIMIZERS = ("CommonSubexpressionElimination", "ConstantFolding")


def cuda_available() -> bool:
    """Whether this onnxruntime build can run the CUDA execution provider at all."""
    return ORT_PROVIDER["cuda"] in ort.get_available_providers()


def cuda_unavailable_reason() -> str | None:
    """Why ``--provider cuda`` cannot work here, in words a user can act on; None if it can.

    The two usual causes need different fixes: the CPU-only ``onnxruntime`` package (no
    CUDA provider compiled in), or ``onnxruntime-gpu`` installed but shadowed by the CPU
    package, which installs the same module (README, Install).
    """
    available = ort.get_available_providers()
    if ORT_PROVIDER["cuda"] in available:
        return None
    offered = ", ".join(available)
    if not _installed("onnxruntime-gpu"):
        return (f"onnxruntime-gpu is not installed, and this onnxruntime ({ort.__version__}) "
                f"has no CUDAExecutionProvider (it offers {offered}). On a machine with an "
                "NVIDIA GPU, install memcc's gpu extra (README, Install)")
    return (f"onnxruntime-gpu is installed, but the onnxruntime module that loads has no "
            f"CUDAExecutionProvider (it offers {offered}); the CPU package probably shadows "
            "it: pip uninstall -y onnxruntime && pip install --force-reinstall "
            "onnxruntime-gpu")


def _installed(distribution: str) -> bool:
    from importlib import metadata

    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def resolve_provider(provider: str) -> str:
    """Map ``cpu|cuda|auto`` to ``cpu`` or ``cuda``, failing early when CUDA is missing."""
    p = (provider or "cpu").lower()
    if p not in PROVIDERS:
        raise InputError(f"--provider '{provider}': choose one of {', '.join(PROVIDERS)}")
    if p == "auto":
        return "cuda" if cuda_available() else "cpu"
    reason = cuda_unavailable_reason() if p == "cuda" else None
    if reason is not None:
        raise RuntimeFailure(f"--provider cuda: CUDA is not available: {reason}; or run with "
                             "--provider cpu.")
    return p


def provider_as_planned(provider: str | None, planned: str | None
                        ) -> tuple[str, str | None]:
    """Where ``memcc run`` and ``train`` run a step, and a note for the user, if any.

    ``provider`` None: where the step was planned (``memcc compile --provider``, recorded as
    ``step.PROVIDER_KEY``), else the CPU. A plan made for CUDA on a machine without it runs
    on the CPU with a note, as does a plan run on a provider it was not made for: its budget
    and predicted times are the other provider's (a user who compiled with ``--provider
    cuda`` and ran without the flag got a CPU run and no word of it)."""
    if provider is None:
        if planned != "cuda":
            return "cpu", None
        reason = cuda_unavailable_reason()
        if reason is None:
            return "cuda", None
        return "cpu", (f"this step was planned for CUDA (memcc compile --provider cuda), but "
                       f"CUDA is not available here ({reason}): running it on the CPU, where "
                       "its budget and predicted times do not apply")
    resolved = resolve_provider(provider)
    if planned is not None and planned != resolved:
        return resolved, (f"this step was planned for {planned.upper()} (memcc compile "
                          f"--provider {planned}) and runs on {resolved.upper()} here: its "
                          f"budget and predicted times are {planned.upper()}'s")
    return resolved, None


def planning_provider(provider: str) -> str:
    """The provider ``memcc compile`` and ``memcc tune`` plan for: ``auto`` resolves as in
    ``resolve_provider`` (cuda where this onnxruntime runs CUDA, else cpu); ``cuda`` stays
    ``cuda`` without CUDA, where a step may be planned for a GPU elsewhere (compile warns or
    refuses per option, ``compiler.pipeline.check_provider``). Anything else is returned as given,
    for the caller's own message."""
    p = (provider or "cpu").lower()
    if p == "auto":
        return "cuda" if cuda_available() else "cpu"
    return p if p in PROVIDERS else provider


def session_options(
    *,
    profile: bool = False,
    profile_prefix: str | os.PathLike | None = None,
    intra_op_threads: int | None = None,
    log_severity: int = 3,
) -> ort.SessionOptions:
    """SessionOptions that keep the file's node order and make memory use predictable."""
    so = ort.SessionOptions()
    so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry(
        "optimization.disable_specified_optimizers", ";".join(DISABLED_OPTIMIZERS)
    )
    so.enable_mem_pattern = False
    so.enable_mem_reuse = False
    so.enable_cpu_mem_arena = False
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = log_severity
    if intra_op_threads is not None:
        so.intra_op_num_threads = int(intra_op_threads)
    if profile:
        so.enable_profiling = True
        if profile_prefix is not None:
            so.profile_file_prefix = str(profile_prefix)
    return so


CUDNN_SEARCH_ENV = "MEMCC_CUDNN_CONV_ALGO_SEARCH"


def cudnn_conv_algo_search() -> str:
    """How the CUDA provider picks each convolution's cuDNN algorithm: ``HEURISTIC``, one
    choice per shape from cuDNN's heuristics. Measured on an H100 (onnxruntime-gpu 1.31.1,
    BENCHMARKS.md "CUDA on an H100"): ORT's default, ``EXHAUSTIVE``, times every algorithm
    per node, and its winners asked the arena for workspaces of up to 614 MiB on VGG-16,
    which no plan can know in advance (the step measured 1.50x its prediction); ``DEFAULT``
    (implicit precomputed GEMM everywhere) kept workspaces small but ran MobileNetV2's step
    19x slower. None of the three made the step reproducible from run to run.
    ``MEMCC_CUDNN_CONV_ALGO_SEARCH`` (EXHAUSTIVE, HEURISTIC or DEFAULT) overrides it."""
    value = os.environ.get(CUDNN_SEARCH_ENV, "HEURISTIC").upper()
    if value not in ("EXHAUSTIVE", "HEURISTIC", "DEFAULT"):
        raise InputError(f"{CUDNN_SEARCH_ENV}={value}: choose EXHAUSTIVE, HEURISTIC or DEFAULT")
    return value


def provider_options(provider: str, *, gpu_mem_limit: int | None = None,
                     cuda_options: Mapping[str, str] | None = None) -> list:
    """The ``providers=`` list for ``InferenceSession`` (CUDA falls back to CPU per node).
    ``cuda_options`` adds CUDA provider options (experiments, e.g. whether copies on their
    own stream overlap compute: ``do_copy_in_default_stream``)."""
    if provider == "cpu":
        return [ORT_PROVIDER["cpu"]]
    cuda: dict[str, str] = {
        "arena_extend_strategy": "kSameAsRequested",
        "cudnn_conv_use_max_workspace": "0",
        "cudnn_conv_algo_search": cudnn_conv_algo_search(),
    }
    if gpu_mem_limit is not None:
        cuda["gpu_mem_limit"] = str(int(gpu_mem_limit))
    cuda.update(cuda_options or {})
    return [(ORT_PROVIDER["cuda"], cuda), ORT_PROVIDER["cpu"]]


ARENA_EXTEND_SAME_AS_REQUESTED = 1  # OrtArenaCfg's arena_extend_strategy: kSameAsRequested
_cpu_arena_registered = False


def register_cpu_arena() -> None:
    """Register the process-wide CPU arena that ``cpu_arena`` sessions share (once)."""
    global _cpu_arena_registered
    if _cpu_arena_registered:
        return
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                             ort.OrtMemType.DEFAULT)
    config = ort.OrtArenaCfg({"arena_extend_strategy": ARENA_EXTEND_SAME_AS_REQUESTED})
    ort.create_and_register_allocator(info, config)
    _cpu_arena_registered = True


@dataclass(frozen=True)
class SessionSettings:
    """How ``make_session`` sets up a session beyond the execution contract.

    ``profile`` / ``profile_prefix``: ORT's profiler and where it writes. ``extra_config``
    adds session config entries; ``option_overrides`` sets SessionOptions attributes on top
    of the contract (experiments only: the contract exists because the defaults break
    plans), enum values by member name, e.g. ``{"execution_order": "DEFAULT"}``.

    ``deterministic`` (CUDA): ORT's ``use_deterministic_compute``, which keeps ReduceSum and
    ReduceMean off their atomic-add fast path and asks cuDNN for deterministic algorithms
    (measured on an H200: a third of a GPT-2 step's time; docs/DETERMINISM.md). Scatters
    with a reduction stay atomic either way (``passes.providers.deterministic_scatter``).
    ``cuda_graph`` (CUDA): ORT's ``enable_cuda_graph``: the second run is captured and every
    later run replays it; ORT refuses at load when a node is not on the CUDA provider
    (``backend.device_step``).
    """

    profile: bool = False
    profile_prefix: str | os.PathLike | None = None
    gpu_mem_limit: int | None = None
    intra_op_threads: int | None = None
    extra_config: Mapping[str, str] | None = None
    option_overrides: Mapping[str, object] | None = None
    cpu_arena: bool = False
    cuda_options: Mapping[str, str] | None = None
    deterministic: bool = False
    cuda_graph: bool = False


def make_session(model: onnx.ModelProto | bytes | str | os.PathLike, provider: str = "cpu",
                 settings: SessionSettings = SessionSettings()) -> ort.InferenceSession:
    """An ``InferenceSession`` under the execution contract, with errors memcc can report;
    ``settings``: what is set beyond the contract (``SessionSettings``)."""
    p = resolve_provider(provider)
    so = session_options(profile=settings.profile, profile_prefix=settings.profile_prefix,
                         intra_op_threads=settings.intra_op_threads)
    if p == "cuda" and settings.deterministic:
        so.use_deterministic_compute = True
    if settings.cpu_arena:
        register_cpu_arena()
        so.enable_cpu_mem_arena = True
        so.add_session_config_entry("session.use_env_allocators", "1")
    for key, value in (settings.extra_config or {}).items():
        so.add_session_config_entry(key, value)
    for key, value in (settings.option_overrides or {}).items():
        _override(so, key, value)
    if isinstance(model, onnx.ModelProto):
        source: bytes | str = model.SerializeToString()
        where = "<model>"
        if p == "cuda" and _needs_default_search(model, settings):
            settings = _default_search(settings)
    elif isinstance(model, bytes):
        source, where = model, "<model>"
    else:
        source = where = str(Path(model))
    try:
        sess = ort.InferenceSession(
            source, so, providers=provider_options(
                p, gpu_mem_limit=settings.gpu_mem_limit,
                cuda_options={**({"enable_cuda_graph": "1"} if settings.cuda_graph else {}),
                              **(settings.cuda_options or {})})
        )
    except Exception as exc:  # ORT raises its own exception types from pybind
        raise RuntimeFailure(
            f"{where}: ONNX Runtime ({ort.__version__}, {ORT_PROVIDER[p]}) could not load the "
            f"graph: {_first_line(exc)}"
        ) from exc
    if p == "cuda" and ORT_PROVIDER["cuda"] not in sess.get_providers():
        # ORT's Python wrapper falls back to the CPU when the CUDA provider cannot start (no
        # driver, missing CUDA/cuDNN libraries) and only logs it: times and peaks measured
        # in that session would be CPU numbers labelled CUDA.
        raise RuntimeFailure(
            f"{where}: --provider cuda: ONNX Runtime ({ort.__version__}) lists the "
            "CUDAExecutionProvider but could not start it (session providers: "
            f"{', '.join(sess.get_providers())}). Check the NVIDIA driver and the CUDA and "
            "cuDNN libraries onnxruntime-gpu needs (nvidia-smi; ORT's CUDA requirements "
            "page), or run with --provider cpu."
        )
    # ORT's Python ``run`` also retries on the CPU provider, printing only, when a CUDA
    # kernel fails at run time (EPFail): measured on an H200, a float16 Conv that cuDNN's
    # heuristics could not serve sent a whole ResNet-50 step to the CPU. memcc reports the
    # failure instead of measuring another provider's step.
    sess.disable_fallback()
    if p == "cuda" and _needs_default_search(sess, settings):
        # A file or bytes: its metadata is known only once ORT has read it, so the session
        # is made again (float16 steps only). A ModelProto was asked before (below).
        return make_session(model, provider, _default_search(settings))
    return sess


def _default_search(settings: SessionSettings) -> SessionSettings:
    return replace(settings, cuda_options={**(settings.cuda_options or {}),
                                           "cudnn_conv_algo_search": "DEFAULT"})


def _precision(meta: Mapping[str, str]) -> str | None:
    """The step's ``memcc.precision`` (``fp16``, ``bf16``), None where it has none."""
    try:
        return json.loads(meta[PRECISION_KEY]).get("precision")
    except (KeyError, ValueError, AttributeError):
        return None


def _needs_default_search(sess: ort.InferenceSession | onnx.ModelProto,
                          settings: SessionSettings) -> bool:
    """Whether a float16 step must leave cuDNN's heuristics: with HEURISTIC (memcc's
    default, ``cudnn_conv_algo_search``) ORT's cuDNN frontend found no engine for the
    float16 weight-gradient convolutions of a ResNet-50 step (``HEURISTIC_QUERY_FAILED``, an
    H200, onnxruntime-gpu 1.31.1, cuDNN 9.19), where DEFAULT and EXHAUSTIVE both ran it;
    DEFAULT keeps the small workspaces the plan assumes. Not when the search was chosen
    (``MEMCC_CUDNN_CONV_ALGO_SEARCH`` or the session's own CUDA options)."""
    if CUDNN_SEARCH_ENV in os.environ or "cudnn_conv_algo_search" in (settings.cuda_options
                                                                      or {}):
        return False
    meta = ({p.key: p.value for p in sess.metadata_props}
            if isinstance(sess, onnx.ModelProto) else sess.get_modelmeta().custom_metadata_map)
    return _precision(meta) == "fp16"


_ENUMS = {
    "execution_order": ort.ExecutionOrder,
    "graph_optimization_level": ort.GraphOptimizationLevel,
    "execution_mode": ort.ExecutionMode,
}


def _override(so: ort.SessionOptions, key: str, value: object) -> None:
    if not hasattr(so, key):
        raise InputError(f"SessionOptions has no attribute '{key}'")
    if key in _ENUMS and isinstance(value, str):
        value = getattr(_ENUMS[key], value)
    setattr(so, key, value)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
