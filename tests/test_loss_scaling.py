"""Dynamic loss scaling in the step (``frontend/loss_scaling.py``), against torch.amp.GradScaler.

Steps are the zoo's tiny MLP (and a tiny GPT-2 for the chunked loss), trained through
``memcc.Trainer`` on the CPU. A batch with an infinite input makes every gradient non-finite:
the overflow GradScaler exists to catch.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from typer.testing import CliRunner

from memcc import Trainer
from memcc.backend import checkpoint as ckpt
from memcc.backend.onnx_file import save_graph
from memcc.backend.runner import session_graph, synthetic_feeds
from memcc.backend.session import SessionSettings, make_session
from memcc.cli import app
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.build_options import LOSS_SCALES
from memcc.frontend.emit import Emitter
from memcc.frontend.load import load_graph
from memcc.frontend.loss_scaling import FOUND_INF, GROWTH_TRACKER, SCALE, update_scale
from memcc.graph import Graph, TensorInfo
from memcc.passes.analysis.update_schedule import schedule_updates_early
from memcc.step import Role, TrainingStep
from models import build_model, mlp

SCALER = (SCALE, GROWTH_TRACKER)


@pytest.fixture(scope="module")
def forward() -> onnx.ModelProto:
    return mlp.build(batch=8, in_features=12, width=16, depth=2, num_classes=4)


@pytest.fixture(scope="module")
def feeds(forward) -> dict[str, np.ndarray]:
    step = build_training_step(load_graph(forward), BuildOptions())
    return synthetic_feeds(step, seed=0)


def overflowing(feeds: dict[str, np.ndarray], value: float = np.inf) -> dict[str, np.ndarray]:
    """The batch with one input element infinite (or NaN): every gradient is non-finite."""
    bad = {k: v.copy() for k, v in feeds.items()}
    bad["input"][0, 0] = value
    return bad


def trainer(forward, tmp_path, name: str, **options) -> Trainer:
    step = build_training_step(load_graph(forward), BuildOptions(**options))
    return Trainer(save_graph(step, tmp_path / f"{name}.onnx"), threads=1)


def run_once(path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of one step from the file's initial values (a plain session)."""
    graph = load_graph(path)
    sgraph, values = session_graph(graph)
    session = make_session(sgraph.to_model(), "cpu", SessionSettings(intra_op_threads=1))
    return dict(zip(graph.outputs, session.run(graph.outputs, {**values, **feeds}),
                    strict=True))


def scaler_state(t: Trainer) -> tuple[float, int]:
    sd = t.state_dict()
    return float(sd[SCALE]), int(sd[GROWTH_TRACKER])


def assert_same(a: dict, b: dict, names) -> None:
    for n in names:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n, strict=True)


# --------------------------------------------------------------------- options
def test_dynamic_is_the_default_with_fp16_only():
    assert BuildOptions(precision="fp16").dynamic_loss_scale
    assert not BuildOptions(precision="bf16").dynamic_loss_scale
    assert not BuildOptions().dynamic_loss_scale
    assert not BuildOptions(precision="fp16", loss_scale="none").dynamic_loss_scale
    assert BuildOptions(precision="bf16", loss_scale="dynamic").dynamic_loss_scale
    assert BuildOptions(loss_scale="dynamic").dynamic_loss_scale
    opts = BuildOptions()  # torch.amp.GradScaler's defaults
    assert (opts.init_scale, opts.growth_factor, opts.backoff_factor,
            opts.growth_interval) == (65536.0, 2.0, 0.5, 2000)


@pytest.mark.parametrize("field, value, message", [
    ("loss_scale", "static", "--loss-scale 'static': choose one of dynamic, none"),
    ("init_scale", 0.0, "init_scale 0: give a finite number above 0"),
    ("init_scale", float("inf"), "init_scale inf"),
    ("growth_factor", 1.0, "growth_factor 1: give a finite number above 1"),
    ("backoff_factor", 1.0, "backoff_factor 1: give a number between 0 and 1"),
    ("backoff_factor", 0.0, "backoff_factor 0"),
    ("growth_interval", 0, "growth_interval 0: give a whole number of steps from 1 to 2^24"),
    ("growth_interval", 2 ** 24 + 1, "growth_interval 16777217"),
    ("growth_interval", 2.5, "growth_interval 2.5"),
])
def test_bad_scaler_settings_are_refused_naming_the_setting(field, value, message):
    with pytest.raises(InputError) as info:
        BuildOptions(**{"loss_scale": "dynamic", field: value})
    assert message in str(info.value)


def test_a_bad_loss_scale_flag_exits_2_naming_it(forward, tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(forward, str(model))
    r = CliRunner().invoke(app, ["build", str(model), "-o", str(tmp_path / "s.onnx"),
                                 "--loss-scale", "static"])
    assert r.exit_code == 2, r.output
    assert "--loss-scale" in r.output and "static" in r.output
    assert not (tmp_path / "s.onnx").exists()


def test_every_command_that_builds_takes_loss_scale_as_build_does():
    import typer

    group = typer.main.get_command(app)

    def param(command: str):
        return next(p for p in group.commands[command].params if "--loss-scale" in p.opts)

    b = param("build")
    assert set(b.type_descriptor.choices) == set(LOSS_SCALES) and b.default is None
    for command in ("compile", "analyze", "tune"):
        o = param(command)
        assert (o.help, o.default, o.type_descriptor.choices) == \
            (b.help, b.default, b.type_descriptor.choices), command


# --------------------------------------------------------------------- the step
@pytest.mark.parametrize("optimizer, extra", [
    ("sgd", {"weight_decay": 1e-2}), ("adamw", {}), ("none", {})])
def test_finite_steps_equal_the_unscaled_step_bit_for_bit(forward, feeds, tmp_path,
                                                          optimizer, extra):
    """Scaling by a power of two and dividing again is exact in float32 (no gradient here
    is near the ends of float32's range), and a kept step's update reads the very
    coefficients of the unscaled one: the same bits, not only close values."""
    plain = trainer(forward, tmp_path, "plain", optimizer=optimizer, **extra)
    scaled = trainer(forward, tmp_path, "scaled", optimizer=optimizer, loss_scale="dynamic",
                     **extra)
    assert set(scaled.updates.values()) == set(plain.updates.values()) | set(SCALER)
    for _ in range(4):
        assert plain.step(feeds) == scaled.step(feeds)
    assert_same(plain.state_dict(), scaled.state_dict(), plain.updates.values())
    assert scaler_state(scaled) == (65536.0, 4)
    # Every update is still written in place; only the two scalars keep a buffer.
    assert set(scaled.in_place.refused) == {f"{n}.new" for n in SCALER}
    if optimizer == "none":  # P.grad: the unscaled gradients, and found_inf beside them
        a, b = run_once(plain.path, feeds), run_once(scaled.path, feeds)
        assert a.keys() | {FOUND_INF, *(f"{n}.new" for n in SCALER)} == b.keys()
        assert_same(a, b, [o for o in a if o.endswith(".grad")])
        assert not b[FOUND_INF]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_an_overflow_skips_the_update_and_halves_the_scale(forward, feeds, tmp_path,
                                                           optimizer, value):
    t = trainer(forward, tmp_path, "s", optimizer=optimizer, loss_scale="dynamic")
    for _ in range(2):
        t.step(feeds)
    before = t.state_dict()
    assert scaler_state(t) == (65536.0, 2)
    t.step(overflowing(feeds, value))
    after = t.state_dict()
    assert_same(before, after, [n for n in before if n not in SCALER])
    assert scaler_state(t) == (32768.0, 0)


def test_a_first_step_overflow_leaves_adamw_as_new(forward, feeds, tmp_path):
    """GradScaler skips optimizer.step(): AdamW's count stays 0, and the next finite step is
    its first. (Its bias correction at count 0 would be 0: the step takes it at count + 1,
    or a skipped first step would write NaN.) The halved scale is a power of two: that first
    step equals the unscaled step's first, bit for bit."""
    plain = trainer(forward, tmp_path, "plain", optimizer="adamw")
    scaled = trainer(forward, tmp_path, "scaled", optimizer="adamw", loss_scale="dynamic")
    start = scaled.state_dict()
    scaled.step(overflowing(feeds))
    assert_same(start, scaled.state_dict(), plain.updates.values())
    assert float(scaled.state_dict()["adamw.step"]) == 0.0
    assert plain.step(feeds) == scaled.step(feeds)
    assert_same(plain.state_dict(), scaled.state_dict(), plain.updates.values())
    assert scaler_state(scaled) == (32768.0, 1)


def test_the_scale_grows_after_growth_interval_clean_steps(forward, feeds, tmp_path):
    t = trainer(forward, tmp_path, "s", optimizer="sgd", loss_scale="dynamic", init_scale=8.0,
                growth_interval=3)
    seen = []
    for _ in range(7):
        t.step(feeds)
        seen.append(scaler_state(t))
    assert seen == [(8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1), (16.0, 2), (32.0, 0), (32.0, 1)]


def test_optimizer_none_outputs_the_gradients_as_they_are_and_found_inf(forward, feeds,
                                                                        tmp_path):
    t = trainer(forward, tmp_path, "s", optimizer="none", loss_scale="dynamic")
    result = run_once(t.path, overflowing(feeds))
    assert bool(result[FOUND_INF])
    grads = [v for k, v in result.items() if k.endswith(".grad")]
    assert grads and not all(np.isfinite(g).all() for g in grads)
    assert (float(result[f"{SCALE}.new"]), int(result[f"{GROWTH_TRACKER}.new"])) == (32768.0, 0)
    t.step(overflowing(feeds))
    assert scaler_state(t) == (32768.0, 0)


def test_the_loss_scale_is_recorded_with_the_optimizer(forward):
    step = build_training_step(load_graph(forward),
                               BuildOptions(loss_scale="dynamic", growth_interval=7))
    record = json.loads(step.metadata["memcc.optimizer"])["loss_scale"]
    assert record == {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                      "growth_interval": 7}
    spec = TrainingStep.of(step)
    assert spec.state[f"{SCALE}.new"] == SCALE and spec.state[f"{GROWTH_TRACKER}.new"] == \
        GROWTH_TRACKER
    plain = build_training_step(load_graph(forward), BuildOptions())
    assert "loss_scale" not in json.loads(plain.metadata["memcc.optimizer"])
    assert SCALE not in plain.inputs


def test_the_chunked_loss_is_scaled_too(tmp_path):
    """--loss-chunks takes its gradients in the forward pass: they are scaled with the
    rest, and the trained values are the unscaled step's."""
    model = build_model("gpt2", batch=2, seq_len=8, width=16, depth=1, heads=2, vocab_size=64)
    steps = {}
    for ls in LOSS_SCALES:
        step = build_training_step(load_graph(model), BuildOptions(
            optimizer="sgd", loss_chunks=2, loss_scale=ls))
        steps[ls] = Trainer(save_graph(step, tmp_path / f"{ls}.onnx"), threads=1)
    feeds = synthetic_feeds(load_graph(tmp_path / "none.onnx"), seed=1)
    for _ in range(2):
        assert steps["none"].step(feeds) == steps["dynamic"].step(feeds)
    a, b = steps["none"].state_dict(), steps["dynamic"].state_dict()
    assert_same(a, b, a)
    assert scaler_state(steps["dynamic"]) == (65536.0, 2)


# --------------------------------------------------------------------- order and memory
def test_every_update_waits_for_the_whole_backward(forward):
    """found_inf reads every gradient and every update reads found_inf: moving updates
    early (passes/analysis/update_schedule.py) still gives a valid order, with no update
    before the last gradient, where the unscaled step's updates do move up."""
    def first_update_after_last_backward(opts: BuildOptions) -> tuple[bool, bool]:
        step = build_training_step(load_graph(forward), opts)
        spec = TrainingStep.of(step)
        sched = schedule_updates_early(step, spec)
        order = sched.nodes
        available = set(step.inputs) | set(step.initializers)
        for n in order:  # a valid order: every input computed before it is read
            assert all(i in available for i in n.input if i), n.name
            available.update(n.output)
        roles = [spec.roles[n.name] for n in order]
        last_backward = max(k for k, r in enumerate(roles) if r is Role.BACKWARD)
        first_update = min(k for k, r in enumerate(roles) if r is Role.UPDATE)
        return sched.moved, first_update > last_backward

    assert first_update_after_last_backward(BuildOptions()) == (True, False)
    _, waits = first_update_after_last_backward(BuildOptions(loss_scale="dynamic"))
    assert waits


def test_compile_min_budget_plans_and_verifies_a_scaled_step(forward, tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(forward, str(model))
    out, rep = tmp_path / "c.onnx", tmp_path / "c.json"
    r = CliRunner().invoke(app, ["compile", str(model), "--budget", "min", "-o", str(out),
                                 "--report", str(rep), "--cost", "analytic", "--verify",
                                 "--loss-scale", "dynamic", "--optimizer", "adamw"])
    assert r.exit_code == 0, r.output
    report = json.loads(rep.read_text())
    assert report["verification"]["ok"] and report["plan"]["fits"]
    assert SCALE in load_graph(out).inputs


# --------------------------------------------------------------------- checkpoints
def test_the_scaler_state_survives_a_checkpoint(forward, feeds, tmp_path):
    batches = [feeds, overflowing(feeds), feeds, feeds, feeds]
    opts = {"optimizer": "adamw", "loss_scale": "dynamic", "growth_interval": 2}
    straight = trainer(forward, tmp_path, "a", **opts)
    for b in batches:
        straight.step(b)
    first = trainer(forward, tmp_path, "b", **opts)
    for b in batches[:3]:
        first.step(b)
    saved = first.save(tmp_path / "ck")
    assert {k: float(v) for k, v in ckpt.load(saved).tensors.items() if k in SCALER} == \
        {SCALE: 32768.0, GROWTH_TRACKER: 1.0}
    resumed = Trainer.resume(tmp_path / "ck", threads=1)
    assert scaler_state(resumed) == (32768.0, 1)
    for b in batches[3:]:
        resumed.step(b)
    a, b = straight.state_dict(), resumed.state_dict()
    assert_same(a, b, a)
    assert scaler_state(resumed) == (65536.0, 1)


# --------------------------------------------------------------------- torch.amp.GradScaler
def test_the_scale_follows_torch_gradscaler_over_overflows(forward, feeds, tmp_path):
    """The same pattern of clean and overflowing steps through a torch model and
    GradScaler("cpu") and through the step: the same scale and tracker after every step."""
    torch = pytest.importorskip("torch")
    pattern = [False, True, False, False, False, True, True, False, False, False, False]
    model = torch.nn.Linear(12, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2)
    t = trainer(forward, tmp_path, "s", optimizer="sgd", loss_scale="dynamic",
                init_scale=4.0, growth_interval=2)
    for bad in pattern:
        batch = overflowing(feeds) if bad else feeds
        opt.zero_grad()
        x = torch.from_numpy(batch["input"])
        loss = torch.nn.functional.cross_entropy(model(x), torch.from_numpy(batch["labels"]))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        t.step(batch)
        theirs = scaler.state_dict()
        assert scaler_state(t) == (theirs["scale"], theirs["_growth_tracker"]), bad


def test_the_scale_update_matches_torchs_kernel_with_any_factors():
    """``update_scale`` against torch._amp_update_scale_ itself, with factors that are not
    powers of two (torch multiplies in float64) and a growth that would reach infinity."""
    torch = pytest.importorskip("torch")
    cases = [(65536.0, 3, 1.3, 0.7, 5), (3.0e38, 0, 2.0, 0.5, 1), (1.0, 1, 1.5, 0.3, 2),
             (1e-30, 4, 2.0, 0.25, 5), (1.0, 2 ** 24 - 3, 2.0, 0.5, 2 ** 24)]
    rng = np.random.default_rng(0)
    for scale0, tracker0, growth, backoff, interval in cases:
        opts = BuildOptions(loss_scale="dynamic", growth_factor=growth, backoff_factor=backoff,
                            growth_interval=interval)
        session = _update_session(opts)
        s, k = np.float32(scale0), np.float32(tracker0)
        ts, tk = torch.tensor([scale0], dtype=torch.float32), torch.tensor([tracker0],
                                                                         dtype=torch.int32)
        for found in rng.random(12) < 0.3:
            s, k = session.run(None, {SCALE: np.asarray(s), GROWTH_TRACKER: np.asarray(k),
                                      "found": np.asarray(found)})
            torch._amp_update_scale_(ts, tk, torch.tensor([float(found)]), growth, backoff,
                                     interval)
            assert (float(s), int(k)) == (float(ts[0]), int(tk[0]))


def _update_session(opts: BuildOptions) -> ort.InferenceSession:
    """A graph of ``update_scale`` alone: (scale, tracker, found_inf) -> the next two."""
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [], "update", [
            onnx.helper.make_tensor_value_info(SCALE, onnx.TensorProto.FLOAT, []),
            onnx.helper.make_tensor_value_info(GROWTH_TRACKER, onnx.TensorProto.FLOAT, []),
            onnx.helper.make_tensor_value_info("found", onnx.TensorProto.BOOL, [])], []),
        opset_imports=[onnx.helper.make_opsetid("", 17)])
    graph = Graph.from_model(model)
    graph.info.update({SCALE: TensorInfo(onnx.TensorProto.FLOAT, ()),
                       GROWTH_TRACKER: TensorInfo(onnx.TensorProto.FLOAT, ()),
                       "found": TensorInfo(onnx.TensorProto.BOOL, ())})
    graph.outputs = update_scale(Emitter(graph), {}, "found", opts)
    return ort.InferenceSession(graph.to_model().SerializeToString(),
                                providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------- an fp16 step
def test_an_fp16_step_backs_off_until_its_gradients_fit_then_trains(tmp_path):
    """--precision fp16 scales by default. From a scale of 2^24 the 16-bit backward
    overflows: those steps change nothing (same loss, AdamW's count stays 0) and halve the
    scale, until the gradients fit; from there the step trains as the float32 step does."""
    model = build_model("gpt2", batch=2, seq_len=16)
    runs = {}
    for precision in ("fp32", "fp16"):
        step = build_training_step(load_graph(model), BuildOptions(
            optimizer="adamw", precision=precision, init_scale=2.0 ** 24))
        assert (SCALE in step.inputs) == (precision == "fp16")
        runs[precision] = Trainer(save_graph(step, tmp_path / f"{precision}.onnx"), threads=1)
    feeds = synthetic_feeds(load_graph(tmp_path / "fp32.onnx"), seed=0)
    fp32 = [runs["fp32"].step(feeds) for _ in range(3)]
    t = runs["fp16"]
    scales, losses = [], []
    while len(scales) < 24 and float(t.state_dict()["adamw.step"]) < 2:
        losses.append(t.step(feeds))
        scales.append(scaler_state(t)[0])
    skipped = scales.index(scales[-1]) + 1  # the steps that halved the scale
    assert skipped >= 2 and scales[:skipped] == [2.0 ** (23 - k) for k in range(skipped)]
    assert len(scales) == skipped + 2 and scaler_state(t) == (scales[-1], 2)
    assert len(set(losses[:skipped + 1])) == 1  # nothing changed while skipping
    assert losses[0] == pytest.approx(fp32[0], rel=1e-2)
    np.testing.assert_allclose(losses[-1], fp32[1], rtol=1e-2)


def test_the_watch_counts_the_steps_an_overflow_skipped(forward, feeds, tmp_path):
    """``memcc train`` reports the scale and the skipped steps (``loss_scale`` in its JSON):
    a flat loss at the start of an fp16 run said nothing of why before."""
    from memcc.trainer.loss_scale_watch import LossScaleWatch

    t = trainer(forward, tmp_path, "w", loss_scale="dynamic")
    watch = LossScaleWatch(t)
    for batch in (feeds, overflowing(feeds), feeds, overflowing(feeds, np.nan)):
        t.step(batch)
        watch.after_step(t)
    assert watch.to_json() == {"scale": 16384.0, "skipped_steps": 2}
    assert t.state_value(SCALE) == scaler_state(t)[0]
    assert LossScaleWatch(trainer(forward, tmp_path, "n", loss_scale="none")).to_json() is None


def test_build_says_what_the_loss_scale_keeps_alive(tmp_path):
    """A loss-scaled fp16 ResNet-18 peaked 25% above its float32 step without a word: every
    gradient lives until the overflow check. build says so, with the bytes, where the
    scale is chosen, and not without one."""
    model = tmp_path / "m.onnx"
    onnx.save(build_model("mlp", batch=2), str(model))
    runner = CliRunner()
    said = {}
    for flags in (["--precision", "fp16"], ["--precision", "fp16", "--loss-scale", "none"],
                  ["--precision", "bf16"]):
        r = runner.invoke(app, ["build", str(model), "-o", str(tmp_path / "s.onnx"), *flags])
        assert r.exit_code == 0, r.output
        said[" ".join(flags)] = r.output
    assert "the dynamic loss scale" in said["--precision fp16"]
    assert "--precision bf16 needs no loss scale" in said["--precision fp16"]
    assert not any("loss scale (" in v for k, v in said.items() if k != "--precision fp16")
