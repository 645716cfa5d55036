"""The arena model (``memcc/passes/analysis/arena.py``): BFCArena's rules on hand-made request
sequences, the replay of a step, the CUDA prediction in compile, and the model against ORT's
own arena measured on CPU (``memcc run --arena``)."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from memcc.backend.onnx_file import save_graph
from memcc.backend.runner import RunRequest, run_steps
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.analysis.arena import (
    ArenaExhausted,
    ArenaSetup,
    BfcArena,
    replay_steps,
    rounded_bytes,
)
from memcc.passes.analysis.arrange import arrange_step
from memcc.passes.analysis.liveness import analyze_liveness
from memcc.step import TrainingStep

MB = 1 << 20


def test_requests_are_served_in_whole_256_byte_units():
    a = BfcArena()
    a.alloc("x", 1)
    a.alloc("y", 257)
    assert (rounded_bytes(0), rounded_bytes(1), rounded_bytes(256)) == (0, 256, 256)
    # Two regions, one per request (kSameAsRequested), each exactly the rounded request.
    assert (a.reserved, a.in_use, a.extensions) == (256 + 512, 256 + 512, 2)
    a.alloc("empty", 0)
    assert a.in_use == 768 and not a.holds("empty")


def test_freed_space_in_one_region_cannot_serve_a_larger_request():
    a = BfcArena()
    a.alloc("a", MB)
    a.alloc("b", MB)
    a.free("a")
    a.alloc("c", MB + MB // 2)  # 1 MB free, but in a region of its own: a third region
    assert a.in_use == MB + MB + MB // 2
    assert a.reserved == 3 * MB + MB // 2
    assert a.reserved > a.in_use  # what liveness alone would call the peak


def test_best_fit_splits_only_when_the_rest_is_as_large_as_the_request():
    a = BfcArena()
    a.alloc("big", 4 * MB)
    a.free("big")
    a.alloc("small", MB)            # 4 MB >= 2 x 1 MB: split, 3 MB stays free
    assert a.in_use == MB and a.reserved == 4 * MB
    a.alloc("mid", 2 * MB)          # 3 MB < 2 x 2 MB: the whole 3 MB chunk is handed out
    assert a.in_use == 4 * MB and a.extensions == 1
    a.alloc("more", 256)            # nothing free is left: a new region
    assert a.extensions == 2


def test_freeing_merges_neighbours_and_shrink_returns_empty_regions():
    a = BfcArena()
    a.alloc("r1", 4 * MB)
    a.free("r1")
    for k in ("p", "q", "r"):
        a.alloc(k, MB)              # all three from the 4 MB region
    a.alloc("other", 8 * MB)        # a second region
    a.free("q")
    a.free("p")                     # merges with q's chunk
    a.alloc("two", 2 * MB)          # fits the merged 2 MB: no new region
    assert a.extensions == 2
    a.free("other")
    assert a.shrink() == 8 * MB     # the 4 MB region still holds chunks: kept
    assert a.reserved == 4 * MB
    a.free("two")
    a.free("r")
    assert a.shrink() == 4 * MB and a.reserved == 0


def test_the_best_fit_is_the_smallest_free_chunk_lower_address_first():
    a = BfcArena()
    for k in ("a", "b", "c"):
        a.alloc(k, 2 * MB)
    a.free("c")
    a.free("a")
    a.alloc("x", MB + MB // 2)      # two equal free chunks: the lower address (a's) wins
    a.alloc("y", 2 * MB)            # c's chunk is still whole
    assert a.extensions == 3
    with pytest.raises(ArenaExhausted):
        BfcArena(limit=3 * MB).alloc("too big", 4 * MB)


def _chain(n_floats: int):
    """x -> a -> b -> c -> 3/4 slice d -> f -> sum: a and b, then b and c, are live together."""
    h = helper.make_node
    nodes = [h("Add", ["x", "x"], ["a"], name="a"), h("Mul", ["a", "a"], ["b"], name="b"),
             h("Sub", ["b", "x"], ["c"], name="c"), h("Slice", ["c", "s", "e"], ["d"], name="d"),
             h("Add", ["d", "d"], ["f"], name="f"),
             h("ReduceSum", ["f"], ["y"], keepdims=0, name="y")]
    inits = [helper.make_tensor("s", TensorProto.INT64, [1], [0]),
             helper.make_tensor("e", TensorProto.INT64, [1], [n_floats * 3 // 4])]
    g = helper.make_graph(nodes, "chain",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n_floats])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return load_graph(m)


def test_replay_reuses_freed_regions_and_keeps_the_output_region_between_steps():
    g = _chain(MB)  # 4 MiB per float tensor
    live = analyze_liveness(g)
    r = replay_steps(g, live, ArenaSetup(feeds_in_arena=False), steps=2)
    # a and b need two regions; c reuses a's, d (3 MiB) takes b's whole chunk (the 1 MiB
    # left is less than d: no split), f reuses a's region, and the scalar output splits b's
    # free region: that region holds the output when the run ends, so it survives the
    # shrink into the next step, where a meter's baseline includes it.
    assert r.peak_reserved_bytes == 8 * MB
    assert r.start_reserved_bytes == 4 * MB
    assert r.measured_bytes == 4 * MB
    assert r.peaks_per_step == (8 * MB, 8 * MB)
    assert r.fails_at is None and r.fragmentation_bytes == 0
    # With the feeds copied in (CUDA), x is one more region, and so are the slice bounds s
    # and e (the runner feeds initializers too: one 256-byte unit each); under a limit below
    # that the replay names where the run fails.
    cuda = replay_steps(g, live, ArenaSetup(feeds_in_arena=True), steps=1)
    assert cuda.peak_reserved_bytes == 12 * MB + 2 * 256
    failed = replay_steps(g, live, ArenaSetup(feeds_in_arena=True, limit=10 * MB), steps=1)
    assert failed.fails_at == "b"


def test_step_events_serve_each_scratch_buffer_separately():
    h = helper.make_node
    g = helper.make_graph(
        [h("Where", ["m", "x", "zero"], ["w"], name="w"),
         h("ReduceSum", ["w"], ["y"], keepdims=0, name="y")], "where",
        [helper.make_tensor_value_info("m", TensorProto.BOOL, [256, 256]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 256, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    graph = load_graph(m)
    from memcc.passes.analysis.arena import step_events

    events = step_events(graph, analyze_liveness(graph), feeds_in_arena=False)
    scratch = [e.nbytes for e in events if e.key.startswith("scratch") and e.nbytes]
    assert scratch == [8 * 256 * 256 * 4, 256 * 256 * 4]  # x selected, the scalar selected


def test_scatter_elements_copies_its_indices_beside_the_cpu_arena():
    """ORT's CPU ScatterElements copies its indices into a std::vector (glibc's heap): a CPU
    replay counts that copy beside the arena's regions; a CUDA replay keeps it a request."""
    h, n = helper.make_node, 1 << 19
    g = helper.make_graph(
        [h("ScatterElements", ["data", "idx", "upd"], ["s"], name="s"),
         h("ReduceSum", ["s"], ["y"], keepdims=0, name="y")], "scatter",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, [2 * n]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, [n]),
         helper.make_tensor_value_info("upd", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    graph = load_graph(m)
    live = analyze_liveness(graph)
    cpu = replay_steps(graph, live, ArenaSetup(feeds_in_arena=False, cpu_threads=1))
    assert cpu.peak_heap_bytes == 8 * n == 4 * MB      # the int64 copy, off the arena
    assert cpu.peak_reserved_bytes == 4 * MB + 256  # s, and y's region from the step before
    assert cpu.peak_bytes == cpu.peak_reserved_bytes + 4 * MB
    cuda = replay_steps(graph, live, ArenaSetup(feeds_in_arena=False))
    assert cuda.peak_heap_bytes == 0
    assert cuda.peak_reserved_bytes == 8 * MB               # s and the copy


def _step(tmp_path, name: str, **dims):
    from models import build_model

    step = build_training_step(load_graph(build_model(name, **dims)),
                               BuildOptions(optimizer="sgd", lr=0.01))
    return step, save_graph(step, tmp_path / f"{name}_step.onnx")


@pytest.mark.parametrize("in_place", [True, False])
def test_the_arena_model_predicts_ort_s_own_arena_measured_on_cpu(tmp_path, in_place):
    """ORT's CPU arena is the same BFCArena class the CUDA provider uses; registered with
    kSameAsRequested it is the CUDA allocation rules, measured by the OS. A transformer step
    (MatMul, Softmax, LayerNorm, Where scratch): measured within 5% of the arena model, run
    as memcc train runs it (updates in place, early) and with the copying runner."""
    step, path = _step(tmp_path, "gpt2", batch=4, seq_len=128, width=128, depth=2, heads=4)
    result = run_steps(path, RunRequest(steps=3, arena=True, in_place=in_place))
    arena = result.prediction["arena"]
    live = (arrange_step(step, TrainingStep.of(step)).prediction if in_place
            else analyze_liveness(step))
    assert result.prediction["liveness_peak_bytes"] == live.peak_bytes
    assert arena["fails_at"] is None and len(arena["peaks_per_step"]) == 3
    ratio = result.measured_peak_bytes / result.predicted_peak_bytes
    assert 0.95 <= ratio <= 1.05, result.to_json()


def test_cuda_regions_hold_whole_pages_and_small_ones_share_them():
    """Measured on an H100 (ORT's verbose arena log, BENCHMARKS.md "CUDA on an H100"): a
    region over 1 MiB starts on a 2 MiB boundary and holds whole 2 MiB pages; regions of
    1 MiB or less are packed into shared pages (modelled at 512-byte alignment); NVML
    counts pages (``test_the_page_rule_holds_on_the_arena_log_kept_from_the_h100``)."""
    a = BfcArena(cuda_pages=True)
    a.alloc("big", 3 * MB)  # 3 MiB: two pages
    assert a.reserved == 3 * MB and a.device_bytes == 4 * MB
    for k in range(7):  # 7 x 300 KiB, packed: 2.05 MiB of regions in two shared pages
        a.alloc(f"small{k}", 300 * 1024)
    assert a.device_bytes == 4 * MB + 4 * MB
    a.alloc("one", MB)  # exactly 1 MiB is packed too: 3.05 MiB of small regions, 2 pages
    assert a.device_bytes == 4 * MB + 4 * MB
    a.free("one")
    a.free("big")
    a.shrink()  # the big region goes, with its pages
    assert a.device_bytes == 4 * MB
    for k in range(7):
        a.free(f"small{k}")
    a.shrink()
    assert a.reserved == 0 and a.device_bytes == 0
    # Without pages (the CPU arena) the device bytes are the reserved bytes.
    cpu = BfcArena()
    cpu.alloc("big", 3 * MB)
    assert cpu.device_bytes == cpu.reserved == 3 * MB


def test_cuda_stream_tags_keep_freed_chunks_from_the_outputs():
    """ORT's stream-aware CUDA arena (bfc_arena.cc): a chunk a node used keeps the node's
    stream; a request without one (the step's outputs) may not take it; only chunks with
    the same tag merge; the end of a run clears the tags. Measured on an H100: GPT-2's step
    extended its arena 243 times per run, the replay without tags 128 times, with them 221
    (BENCHMARKS.md, "CUDA on an H100")."""
    a = BfcArena(streams=True)
    a.alloc("t", MB)
    a.free("t")
    a.alloc("out", MB, stream=None)  # t's chunk carries the node's stream: a new region
    assert a.extensions == 2
    a.alloc("u", MB)  # a node on the stream takes it back
    assert a.extensions == 2
    a.free("u")
    a.free("out")
    a.release_streams()
    a.alloc("o2", 2 * MB, stream=None)
    assert a.extensions == 3  # tags cleared, but the two regions still never merge
    a.alloc("o3", MB, stream=None)
    assert a.extensions == 3
    # Neighbours merge only with the same tag: a fresh region's rest keeps no tag, the
    # part a node used gets the node's, and freed they stay two chunks. Without stream
    # tags (the CPU arena) the same requests merge and reuse.
    for streams, regions in ((True, 2), (False, 1)):
        b = BfcArena(streams=streams)
        b.alloc("big", 2 * MB, stream=None)
        b.free("big")
        b.alloc("x", MB)
        b.free("x")
        b.alloc("y", 2 * MB)
        assert b.extensions == regions, streams


def test_replay_counts_pages_on_cuda_and_a_meter_sees_them():
    g = _chain(MB)
    live = analyze_liveness(g)
    plain = replay_steps(g, live, ArenaSetup(feeds_in_arena=True), steps=2)
    paged = replay_steps(g, live, ArenaSetup(feeds_in_arena=True, cuda=True), steps=2)
    assert plain.peak_device_bytes is None and plain.peak_bytes == plain.peak_reserved_bytes
    # The scalar output is requested without a stream, so it cannot take a chunk a node
    # freed: one more 256-byte region than without stream tags.
    assert paged.peak_reserved_bytes == plain.peak_reserved_bytes + 256
    # Three 4 MiB regions in whole pages, and the 256-byte regions (slice bounds, scalar
    # output) in one shared page.
    assert paged.peak_device_bytes == 12 * MB + 2 * MB
    assert paged.measured_bytes == paged.peak_device_bytes - paged.start_device_bytes
    assert paged.to_json()["peak_device_bytes"] == paged.peak_device_bytes


def test_cuda_plans_are_judged_by_the_arena_replay(tmp_path):
    from memcc.passes.analysis.cost_model import CUDA_NOMINAL, analytic_costs
    from memcc.passes.plan import Plan
    from memcc.passes.planning.simulate import SimulationRules, simulate

    step, _ = _step(tmp_path, "gpt2", batch=2, seq_len=64, width=64, depth=2, heads=2)
    costs = analytic_costs(step, CUDA_NOMINAL)
    cpu = simulate(step, Plan(), costs)
    cuda = simulate(step, Plan(), costs, rules=SimulationRules("cuda"))
    assert cpu.arena is None and cuda.arena is not None
    # The runtime's device bytes (backend.device_step): the step arranged as it trains
    # (updates in place), its arena without shrink, plus the buffers bound outside it
    # (state, batch, loss).
    from memcc.passes.analysis.device_memory import predict_step

    arranged, pred = predict_step(cuda.graph)
    assert arranged.in_place.aliased
    assert cuda.peak_bytes == pred.steady_bytes > cuda.arena.peak_device_bytes
    assert cuda.arena.peak_device_bytes >= cuda.arena.peak_reserved_bytes
    assert cuda.arena.peak_reserved_bytes >= cuda.arena.peak_in_use_bytes
    # The same buffers as the live bytes of the step in place, rounded to 256 bytes
    # instead of CPU pages, in whole device pages.
    live = arranged.prediction.peak_bytes
    assert 0.9 <= (cuda.arena.peak_in_use_bytes + pred.bound_bytes) / live <= 1.2
    assert cuda.peak_bytes % (2 * MB) == 0


def test_cuda_verify_caps_the_arena_at_the_budget_and_a_refused_run_does_not_fit(
        tmp_path, monkeypatch):
    """No GPU here: the CUDA run is replaced by one that records what it was asked for and
    then fails the way ORT does when the arena may not grow (the outputs are compared on
    the CPU stand-in)."""
    import memcc.backend.verify as verify
    from memcc.errors import RuntimeFailure

    step, _ = _step(tmp_path, "mlp", batch=8, in_features=16, width=16, depth=1, num_classes=3)
    asked = {}

    def refused(path, request):
        asked.update(vars(request))
        raise RuntimeFailure("ONNX Runtime failed while running the step: Available memory "
                             "of 0 is smaller than requested bytes of 4096")

    on_cpu = verify.step_outputs
    monkeypatch.setattr(verify, "run_steps", refused)
    monkeypatch.setattr(verify, "step_outputs",
                        lambda graph, feeds, provider, written=None:
                        on_cpu(graph, feeds, "cpu", written))
    result = verify.verify_rewrite(step, step, budget=123_456,
                                   how=verify.VerifyRun(provider="cuda"))
    assert asked["gpu_mem_limit"] == 123_456 and asked["provider"] == "cuda"
    assert not result["ok"] and result["peak_within_budget"] is False
    assert result["gpu_mem_limit_bytes"] == 123_456 and result["outputs_match"]
    assert "gpu_mem_limit 123,456" in result["problems"][0]
    # On the CPU provider nothing is capped.
    monkeypatch.setattr(verify, "run_steps", lambda path, request:
                        asked.update(cpu=vars(request)) or run_steps(path, request))
    assert verify.verify_rewrite(step, step, budget=1 << 40)["ok"]
    assert asked["cpu"]["gpu_mem_limit"] is None



def test_cpu_plans_made_for_the_cpu_arena_verify_through_it_and_train_through_it(tmp_path):
    """``memcc compile --arena``: the plan is judged by the CPU arena's replay, verified by
    running through ORT's CPU arena, and the step is marked so that ``memcc run`` and the
    trainer allocate through it without being told."""
    from memcc.compiler import CompileOptions, compile_model
    from memcc.passes.analysis.arena import cpu_arena_peak
    from memcc.passes.analysis.cost_model import NOMINAL_CPU, analytic_costs
    from memcc.passes.plan import Plan
    from memcc.passes.planning.simulate import SimulationRules, simulate
    from memcc.step import ALLOCATOR_KEY
    from memcc.trainer import Trainer

    step, path = _step(tmp_path, "gpt2", batch=4, seq_len=128, width=128, depth=2, heads=4)
    base = simulate(step, Plan(), analytic_costs(step, NOMINAL_CPU),
                    rules=SimulationRules("cpu-arena"))
    assert base.arena is not None
    file_order = arrange_step(step, TrainingStep.of(step), early_updates=False)
    assert base.peak_bytes == cpu_arena_peak(step, file_order.prediction)[1]
    out = tmp_path / "planned.onnx"
    result = compile_model(path, CompileOptions(budget=int(0.6 * base.peak_bytes), arena=True,
                                                verify=True, cost="analytic", time_limit=10),
                           output=out)
    report = result.report
    assert report["verification"]["ok"], report["verification"]
    assert report["options"]["arena"] and report["plan"]["device_arena"] is not None
    trained = simulate(step, Plan(), analytic_costs(step, NOMINAL_CPU),
                       rules=SimulationRules("cpu-arena", early_updates=True))
    assert report["baseline"]["peak_bytes"] == min(trained.peak_bytes, base.peak_bytes)
    assert result.graph.metadata[ALLOCATOR_KEY] == "arena"
    assert Trainer(out).arena and not Trainer(out, arena=False).arena
    assert not Trainer(path).arena
    # Training through the arena gives the same losses as from malloc, bit for bit.
    from memcc.backend.runner import synthetic_feeds
    losses = []
    for arena in (True, False):
        trainer = Trainer(out, arena=arena)
        feeds = synthetic_feeds(trainer.graph, 0)
        batch = {i.name: feeds[i.name] for i in trainer.inputs}
        losses.append([trainer.step(batch) for _ in range(2)])
    assert losses[0] == losses[1], losses
    # A compiled plan trained from malloc is told what glibc's heap may hold; the step as
    # built (no plan) and the plan trained through the arena are not.
    from memcc.trainer.memory import allocator_notes
    assert "compile with --arena" in allocator_notes(Trainer(out, arena=False))[0]
    assert allocator_notes(Trainer(out)) == [] and allocator_notes(Trainer(path)) == []
    run = run_steps(out, RunRequest(steps=1))
    assert "arena" in run.prediction and "arena" in run.timing_method
    with pytest.raises(InputError, match="--arena is for --provider cpu"):
        CompileOptions(budget="min", arena=True, provider="cuda")


def test_a_plan_compiled_for_malloc_and_trained_through_the_arena_says_its_arena_peak(
        tmp_path):
    """``memcc train --arena`` on a plan compiled without ``--arena`` (what the malloc note
    offers, and ``memcc tune -o`` writes): the budget was checked for malloc only, and the
    arena can hold much more (a tuned ResNet under 30 MB measured 42.9 MB through it), so
    the trainer says the arena's predicted peak next to the one the plan was made at; a
    plan trained as it was compiled gets no such note."""
    from memcc.compiler import CompileOptions, compile_model
    from memcc.trainer import Trainer
    from memcc.trainer.memory import StepMemory, allocator_notes

    step, path = _step(tmp_path, "gpt2", batch=2, seq_len=32, width=32, depth=1, heads=2)
    out = tmp_path / "malloc_plan.onnx"
    compile_model(path, CompileOptions(budget="90%", cost="analytic", time_limit=5),
                  output=out)
    through_arena = Trainer(out, arena=True)
    [note] = allocator_notes(through_arena)
    figure = f"{StepMemory(through_arena).predicted:,} bytes through the arena"
    assert figure in note and f"{through_arena.predicted_peak_bytes:,} it was planned" in note
    assert "compile with --arena" in note
    assert "glibc's heap" in allocator_notes(Trainer(out))[0]
    assert allocator_notes(Trainer(path, arena=True)) == []


@pytest.mark.parametrize("arena", [True, False])
def test_the_measuring_child_takes_its_baseline_after_two_runs_through_the_arena(
        tmp_path, arena):
    """After its first run ORT's CPU arena can hold more than between later steps (2.3 and
    7.2 MB on two compiled convnet plans of real exports, BENCHMARKS.md, session 43), which a
    baseline taken then counts as the session's: through the arena the child runs the step
    twice before it, from malloc once."""
    from unittest import mock

    from memcc.backend import cpu_child

    _, path = _step(tmp_path, "mlp", batch=4, width=16, depth=2)
    runs: list[str] = []
    real = cpu_child._run_in_place

    def counted(*args, **kwargs):
        runs.append("run")
        return real(*args, **kwargs)

    with mock.patch.object(cpu_child, "_run_in_place", counted):
        result = run_steps(path, RunRequest(steps=2, arena=arena, isolate=False,
                                            separate_timing=False))
    assert len(result.losses) == 2
    assert len(runs) == 2 + (2 if arena else 1)
