"""One way to run a training step: its state where it trains, bound once, run many times.

``memcc train`` (``memcc.Trainer``), ``memcc run``, ``--verify`` and ``memcc tune``'s
measurements on CUDA all run a step through ``DeviceStep``, so that what is measured is
what trains. Measured on an H200 (BENCHMARKS.md, issue 29), the step as ``memcc run`` used
to run it spent most of its time outside the kernels: state copied in and out every step
(189 ms of GPT-2's 465 were left once state stayed on the device), the arena shrunk after
every step (103 ms without), and ORT's host-side work for every node. So:

- The carried values (parameters, optimizer state, BatchNorm statistics, the Dropout
  counter) are device buffers, uploaded once (``upload``) through a session of
  ``MemcpyFromHost`` nodes whose arena grows by exactly each request (``kSameAsRequested``),
  so each value holds its own bytes and nothing more. Python's own
  ``OrtValue.ortvalue_from_numpy(..., "cuda")`` would place them in a second arena that
  grows by powers of two, which no plan counts and ``gpu_mem_limit`` does not cap.
- The step's other stored values (constants, frozen weights) stay initializers of the step
  session on CUDA: ORT puts each where its consumers read it (shape arguments on the host,
  the rest on the device, one ``cudaMalloc`` each) once, at load. On the CPU every stored
  value is a graph input fed from arrays the step holds (``runner.session_graph``), as the
  CPU measurement model expects.
- Every input and output is bound once (IOBinding) to a buffer with a fixed address: the
  batch is copied into its device buffer (``update_inplace``), the loss and other outputs
  are written into buffers allocated at the start, and each update that
  ``passes.analysis.inplace`` proves safe is written over the value it replaces. An update that is
  not (written by a kernel that still reads the old value) gets a second buffer, and the
  two swap roles each step: two bindings, used in turn.
- No arena shrink between steps (CUDA): the arena settles in the first step and holds the
  same regions from the second on; ``prediction`` says what it holds then, and what the
  first step peaks at (``passes.analysis.arena.replay_steps``, ``ArenaSetup(shrink=False)``).
- CUDA graphs: where every node runs on the CUDA provider with static shapes and no host
  copies, ORT captures the second run and replays it from then on (``enable_cuda_graph``);
  with two bindings, each gets its own graph (``gpu_graph_id``). ``capture_blockers`` says
  beforehand what prevents it, and a session ORT refuses to capture is opened again
  without it, the reason kept in ``cuda_graph_note``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.backend.cuda_graph import capture_blockers
from memcc.backend.session import SessionSettings, make_session
from memcc.errors import InputError, RuntimeFailure
from memcc.graph import Graph
from memcc.passes.analysis.device_memory import arena_limit
from memcc.passes.analysis.host_state import host_resident

# ---------------------------------------------------------------------------- placement
HOST, DEVICE = "host", "device"


def step_for_provider(graph: Graph, provider: str, *, deterministic: bool = False,
                      notes: list[str] | None = None) -> tuple[Graph, bool]:
    """The step as ``provider`` runs it, and whether anything was rewritten: on CUDA,
    training-mode BatchNorm as standard ops (``passes.providers.batchnorm_for_cuda``) and, for
    ``deterministic`` runs, every accumulating scatter in a form without atomics
    (``passes.providers.deterministic_scatter``) and every reduction over leading axes as one over
    trailing axes (``passes.providers.deterministic_reductions``), the two sources of run-to-run
    differences measured on an H200; their sums change order (within 1e-5). ORT's own
    ``use_deterministic_compute`` is not needed then, and cost GPT-2's step 44-49% there
    against 7% for the rewrites (docs/DETERMINISM.md, "CUDA")."""
    from memcc.passes.providers.provider_step import for_provider

    original = graph
    graph, report = for_provider(graph, provider)
    changed = graph is not original
    emulated = report.get("sixteen_bit_emulated") or {}
    if notes is not None and emulated:
        from memcc.passes.providers.sixteen_bit import describe_emulated

        notes.append(f"the {provider} provider of this onnxruntime has no 16-bit kernel for "
                     f"{describe_emulated(emulated)}: they compute in float32 between casts, "
                     "so the step runs slower than its float32 build (README, \"Mixed "
                     "precision\")")
    if provider == "cuda" and deterministic:
        from memcc.passes.providers.deterministic_reductions import to_trailing_axes
        from memcc.passes.providers.deterministic_scatter import for_cuda_determinism

        graph, scatters = for_cuda_determinism(graph)
        graph, reductions = to_trailing_axes(graph)
        changed = changed or bool(scatters.rewritten) or bool(reductions.rewritten)
    return graph, changed


def device_session_graph(graph: Graph, carried: Sequence[str], layout: str
                         ) -> tuple[Graph, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The graph the session gets, the carried values' initial arrays, and (``HOST``
    layout, the CPU's) the other stored values the step feeds. In the ``DEVICE`` layout
    (CUDA's) the other stored values stay in the graph (the module docstring says why), so
    the third dict is empty there."""
    from memcc.backend.runner import session_graph

    carried = list(dict.fromkeys(carried))
    if layout == HOST:
        g, values = session_graph(graph)
        state = {n: np.array(values.pop(n), order="C", copy=True) for n in carried}
        return g, state, values
    g = graph.copy()
    missing = [n for n in carried if n not in g.initializers]
    if missing:
        raise InputError(f"carried value '{missing[0]}' has no stored initial value in the "
                         "step file")
    state = {n: np.array(g.initializers.pop(n), order="C", copy=True) for n in carried}
    g.inputs = list(graph.inputs) + [n for n in carried if n not in graph.inputs]
    return g, state, {}


# ---------------------------------------------------------------------------- the runtime
def upload(arrays: Mapping[str, np.ndarray], provider: str, layout: str = DEVICE
           ) -> dict[str, object]:
    """``OrtValue``s holding ``arrays``. ``HOST``: the OrtValues share the arrays' memory
    (no copy; keep the arrays). ``DEVICE``: one run of a session of Identity nodes on
    ``provider`` writes a copy of each array into a buffer of its own (module docstring).
    The session is dropped at once: each buffer holds a reference to the arena it came
    from, which lives as long as they do, while the session's CUDA handles and workspaces
    (cuBLAS, cuDNN) are given back."""
    import onnxruntime as ort

    if layout == HOST:
        return {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in arrays.items()}
    if not arrays:
        return {}
    names = list(arrays)
    # CUDA: MemcpyFromHost reads its input where the caller's array is, so only the copy
    # is allocated on the device (an Identity would copy each array into the arena first,
    # and those copies, freed after the run, would stay reserved in an arena the values
    # keep alive). The CPU provider has no such kernel; Identity copies there.
    op = "MemcpyFromHost" if provider == "cuda" else "Identity"
    nodes, ins, outs = [], [], []
    for k, name in enumerate(names):
        a = arrays[name]
        dtype = onnx.helper.np_dtype_to_tensor_dtype(a.dtype)
        ins.append(onnx.helper.make_tensor_value_info(f"in{k}", dtype, list(a.shape)))
        outs.append(onnx.helper.make_tensor_value_info(f"out{k}", dtype, list(a.shape)))
        nodes.append(onnx.helper.make_node(op, [f"in{k}"], [f"out{k}"], name=f"upload{k}"))
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "memcc_upload", ins, outs),
                                   opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = make_session(model, provider)
    binding = session.io_binding()
    for k, name in enumerate(names):
        binding.bind_cpu_input(f"in{k}", np.asarray(arrays[name], order="C"))
        binding.bind_output(f"out{k}", "cuda" if provider == "cuda" else "cpu")
    ro = ort.RunOptions()
    if provider == "cuda":
        ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "gpu:0")
    try:
        session.run_with_iobinding(binding, ro)
    except Exception as exc:  # pybind raises ORT's own exception types
        raise RuntimeFailure(f"could not copy the step's state to the GPU: {exc}") from exc
    values = dict(zip(names, binding.get_outputs(), strict=True))
    del binding, session
    return values


@dataclass
class StepOutputs:
    """What one ``DeviceStep.run`` returns to the host: the loss and any output asked for."""

    loss: float
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRoles:
    """What the step's outputs are for. ``loss``: the loss output; ``updates``: output ->
    the input it replaces next step; ``aliased``: the updates written over their input;
    ``returned``: outputs copied back to the host after each run besides the loss."""

    loss: str
    updates: Mapping[str, str]
    aliased: Mapping[str, str] = field(default_factory=dict)
    returned: Sequence[str] = ()


@dataclass(frozen=True)
class DeviceSettings:
    """Where and how the step runs. ``cuda_graph``: None = capture where possible, True =
    required (an error names what prevents it), False = never. ``layout``: ``DEVICE``
    (always on CUDA) or ``HOST`` (the CPU's default); the CPU runs the ``DEVICE`` layout
    too, which is how its logic is tested without a GPU. ``gpu_mem_limit``: the budget the
    bound buffers and the arena share (CUDA). ``profile_prefix``: ORT's profile file."""

    provider: str = "cpu"
    threads: int | None = None
    cpu_arena: bool = False
    gpu_mem_limit: int | None = None
    cuda_graph: bool | None = None
    profile_prefix: str | None = None
    layout: str | None = None


class DeviceStep:
    """A training step's session with its state bound where it trains (module docstring).

    ``graph``: the step as it will run (``passes.analysis.arrange``'s graph: in-place updates
    decided, node order fixed); ``roles``: what its outputs are for; ``settings``: where and
    how it runs; ``source``: the file named in messages.
    """

    def __init__(self, graph: Graph, roles: StepRoles,
                 settings: DeviceSettings = DeviceSettings(), *,
                 source: str = "<step>") -> None:
        provider = settings.provider
        self.provider = provider
        self.loss_name = roles.loss
        self.updates = dict(roles.updates)
        self.aliased = dict(roles.aliased)
        self.source = source
        self.returned = [o for o in roles.returned if o != roles.loss]
        carried = list(dict.fromkeys(self.updates.values()))
        self.layout = DEVICE if provider == "cuda" else (settings.layout or HOST)
        sgraph, state, fixed = device_session_graph(graph, carried, self.layout)
        # Optimizer state the step keeps in host memory (passes.lowering.offload_state): bound to
        # host buffers, which its MemcpyFromHost reads and its MemcpyToHost writes.
        self.host_resident = (host_resident(graph, self.updates) & set(state)
                              if self.layout == DEVICE else set())
        capture = self._decide_capture(graph, settings.cuda_graph)
        # The bound buffers, stored values and the session's own live beside the step's
        # arena; the arena may have what the budget leaves.
        limit = (arena_limit(graph, self.aliased, self.updates, settings.gpu_mem_limit,
                             source=source)
                 if provider == "cuda" and settings.gpu_mem_limit is not None else None)
        self.captured = self._open_session(sgraph.to_model(), settings, limit, capture)
        self._bind_buffers(graph, sgraph, state, fixed)
        del state  # the host arrays go once uploaded (kept by the HOST layout)
        self._bindings = [self._bind(swapped=False)]
        if self.spare:
            self._bindings.append(self._bind(swapped=True))
        self._run_options = self._make_run_options(settings)
        self.runs = 0
        self._captured: set[int] = set()  # bindings whose graph ORT has captured

    # ------------------------------------------------------------------ opening
    def _decide_capture(self, graph: Graph, cuda_graph: bool | None) -> bool:
        """Whether to ask ORT to capture the step as a CUDA graph (``cuda_graph_note`` says
        why not); an ``InputError`` where capture is required and cannot be had."""
        source = self.source
        self.cuda_graph_note: str | None = None
        capture = False
        if self.provider == "cuda" and cuda_graph is not False:
            blockers = capture_blockers(graph)
            if blockers and cuda_graph:
                raise InputError(f"{source}: --cuda-graph: the step cannot be captured: "
                                 + "; ".join(blockers[:3]))
            if self.host_resident:
                blockers.append(f"'{sorted(self.host_resident)[0]}' and "
                                f"{len(self.host_resident) - 1} other state value(s) are "
                                "copied to and from host memory each step (not captured)")
                if cuda_graph:
                    raise InputError(f"{source}: --cuda-graph: the step cannot be captured: "
                                     + blockers[-1])
            capture = not blockers
            if blockers:
                self.cuda_graph_note = "not captured: " + "; ".join(blockers[:3])
        elif self.provider == "cuda":
            self.cuda_graph_note = "off (--no-cuda-graph)"
        elif cuda_graph:
            raise InputError("--cuda-graph needs --provider cuda")
        return capture

    def _open_session(self, model: onnx.ModelProto, settings: DeviceSettings,
                      limit: int | None, capture: bool) -> bool:
        """Open ``self.session``, with CUDA graph capture when ``capture`` (falling back
        without it where ORT refuses and capture was not required); whether it captures."""
        provider = self.provider

        def open_session(with_graph: bool):
            return make_session(model, provider, SessionSettings(
                intra_op_threads=settings.threads,
                cpu_arena=settings.cpu_arena, gpu_mem_limit=limit,
                profile=settings.profile_prefix is not None,
                profile_prefix=settings.profile_prefix, cuda_graph=with_graph,
                extra_config={"session.use_device_allocator_for_initializers": "1"}
                if provider == "cuda" else None))

        if capture:
            try:
                self.session = open_session(True)
            except RuntimeFailure as exc:
                if settings.cuda_graph:
                    raise RuntimeFailure(f"{self.source}: --cuda-graph: ONNX Runtime refused "
                                         f"to capture the step: {exc}") from exc
                self.cuda_graph_note = f"not captured: ONNX Runtime refused: {exc}"
                capture = False
                self.session = open_session(False)
        else:
            self.session = open_session(False)
        return capture

    def _bind_buffers(self, graph: Graph, sgraph: Graph, state: dict[str, np.ndarray],
                      fixed: dict[str, np.ndarray]) -> None:
        """The buffers, each at a fixed address for the whole run: the carried state, a
        spare for every update not written in place, the batch, the outputs and (``HOST``)
        the stored values the step feeds."""
        import onnxruntime as ort

        host = self.layout == HOST
        self._host_state = state if host else {}
        spares = {inp: np.zeros_like(state[inp]) for out, inp in self.updates.items()
                  if out not in self.aliased}
        self._host_spare = spares if host else {}
        self.data_inputs = [n for n in sgraph.inputs if n not in state and n not in fixed
                            and n not in sgraph.initializers]
        batch0 = {n: np.zeros(graph.info[n].shape, graph.info[n].np_dtype)
                  for n in self.data_inputs}
        self._host_batch = batch0 if host else {}
        outputs = list(graph.outputs)
        out0 = {o: np.zeros(graph.info[o].shape, graph.info[o].np_dtype)
                for o in outputs if o not in self.updates}
        self._host_out = out0 if host else {}
        held = {n: state.pop(n) for n in self.host_resident}
        held_spares = {n: spares.pop(n) for n in list(spares) if n in self.host_resident}
        self._held_arrays = {**{f"s:{n}": a for n, a in held.items()},
                             **{f"p:{n}": a for n, a in held_spares.items()}}
        values = upload({**{f"s:{n}": a for n, a in state.items()},
                         **{f"p:{n}": a for n, a in spares.items()},
                         **{f"b:{n}": a for n, a in batch0.items()},
                         **{f"o:{n}": a for n, a in out0.items()}},
                        self.provider, self.layout)
        # Host buffers: the OrtValues share the arrays' memory (kept in _held_arrays).
        values |= upload(self._held_arrays, self.provider, HOST)
        state |= held
        spares |= held_spares
        self.state = {n: values[f"s:{n}"] for n in state}
        self.spare = {n: values[f"p:{n}"] for n in spares}
        self._batch = {n: values[f"b:{n}"] for n in batch0}
        self._out = {o: values[f"o:{o}"] for o in out0}
        self._fixed = {n: ort.OrtValue.ortvalue_from_numpy(np.asarray(a, order="C"))
                       for n, a in fixed.items()}
        self._fixed_arrays = fixed
        self._outputs = outputs

    def _make_run_options(self, settings: DeviceSettings) -> list:
        """One ``RunOptions`` per binding: its CUDA graph id when two bindings are captured,
        the CPU arena's shrink when the CPU arena is on (the arena model includes it)."""
        import onnxruntime as ort

        options = []
        for k in range(len(self._bindings)):
            ro = ort.RunOptions()
            if self.captured and len(self._bindings) > 1:
                ro.add_run_config_entry("gpu_graph_id", str(k + 1))
            if self.provider == "cpu" and settings.cpu_arena:
                ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            options.append(ro)
        return options

    # ------------------------------------------------------------------ binding
    def _bind(self, *, swapped: bool):
        """An IOBinding of every input and output; ``swapped``: the spares hold the current
        values and the updates go into the state buffers (the second binding)."""
        binding = self.session.io_binding()
        current = {n: (self.spare[n] if swapped and n in self.spare else v)
                   for n, v in self.state.items()}
        target = {n: (self.state[n] if swapped else v) for n, v in self.spare.items()}
        for name, value in current.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in self._fixed.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in self._batch.items():
            binding.bind_ortvalue_input(name, value)
        for out in self._outputs:
            inp = self.updates.get(out)
            if inp is None:
                binding.bind_ortvalue_output(out, self._out[out])
            elif out in self.aliased:
                binding.bind_ortvalue_output(out, current[inp])
            else:
                binding.bind_ortvalue_output(out, target[inp])
        return binding

    @property
    def _parity(self) -> int:
        return self.runs % len(self._bindings)

    def current(self) -> dict[str, object]:
        """The OrtValues that hold the carried values now (after ``runs`` steps)."""
        if self._parity == 0:
            return dict(self.state)
        return {n: (self.spare[n] if n in self.spare else v) for n, v in self.state.items()}

    # ------------------------------------------------------------------ running
    def run(self, batch: Mapping[str, np.ndarray]) -> StepOutputs:
        """One step on ``batch`` (already checked: names, shapes, dtypes as bound)."""
        for name in self.data_inputs:
            arr = np.asarray(batch[name], order="C")
            if self.layout == HOST:
                np.copyto(self._host_batch[name], arr)
            else:
                self._batch[name].update_inplace(arr)
        k = self._parity
        # A binding's first run with capture on: ORT's Run repeats the step until the graph
        # is captured (warm-up runs, then the capture run; measured: the first call applied
        # three updates). Put the state back and replay the captured graph once, so one
        # call is one step, as everywhere else.
        before = self.state_dict() if self.captured and k not in self._captured else None
        self._run_binding(k)
        if before is not None:
            self._captured.add(k)
            self.load_state(before)
            del before
            self._run_binding(k)
        self.runs += 1
        loss = self._read(self.loss_name) if self.loss_name in self._out else None
        arrays = {o: self._read(o) for o in self.returned if o in self._out}
        value = float(np.asarray(loss).reshape(-1)[0]) if loss is not None else math.nan
        return StepOutputs(value, arrays)

    def _run_binding(self, k: int) -> None:
        try:
            self.session.run_with_iobinding(self._bindings[k], self._run_options[k])
        except Exception as exc:  # pybind raises ORT's own exception types
            raise RuntimeFailure(f"{self.source}: ONNX Runtime failed while running the "
                                 f"step: {exc}") from exc

    def _read(self, name: str) -> np.ndarray:
        if self.layout == HOST:
            return self._host_out[name].copy()
        return self._out[name].numpy()

    # ------------------------------------------------------------------ state
    def value(self, name: str) -> np.ndarray:
        """A host copy of one carried value as it is now."""
        return np.array(self.current()[name].numpy(), copy=True)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Host copies of the carried values as they are now."""
        return {n: np.array(v.numpy(), copy=True) for n, v in self.current().items()}

    def host_state(self) -> dict[str, np.ndarray]:
        """``HOST`` layout: the live arrays themselves (no copy); else host copies."""
        if self.layout != HOST:
            return self.state_dict()
        return {n: (self._host_spare[n] if self._parity and n in self._host_spare else a)
                for n, a in self._host_state.items()}

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite the carried values in their buffers (the bindings stay valid)."""
        current = self.current()
        for name, arr in arrays.items():
            a = np.asarray(arr, order="C")
            if self.layout == HOST:
                np.copyto(self.host_state()[name], a)
            else:
                current[name].update_inplace(a)

    def held_bytes(self) -> int:
        """Bytes of every buffer this step bound (state, spares, batch, outputs, and on the
        CPU the stored values it feeds)."""
        def nbytes(v) -> int:
            shape = v.shape()
            return int(np.prod(shape)) * _itemsize(v) if shape else _itemsize(v)

        groups = (self.state, self.spare, self._batch, self._out, self._fixed)
        return sum(nbytes(v) for g in groups for v in g.values())


_ITEMSIZE = {"tensor(float)": 4, "tensor(double)": 8, "tensor(float16)": 2,
             "tensor(bfloat16)": 2, "tensor(int64)": 8, "tensor(int32)": 4,
             "tensor(int16)": 2, "tensor(int8)": 1, "tensor(uint8)": 1, "tensor(bool)": 1,
             "tensor(uint16)": 2, "tensor(uint32)": 4, "tensor(uint64)": 8}


def _itemsize(value) -> int:
    return _ITEMSIZE.get(value.data_type(), 4)
