"""memcc.Trainer: the same numbers as the copying runner, checkpoints that refuse what is not
theirs, data checked before training, and the trained forward model out.

Tiny zoo MLPs (a few thousand parameters), one ORT thread: the whole module runs in seconds.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from memcc import Trainer
from memcc.backend import checkpoint as ckpt
from memcc.backend.data import data_inputs, load_dataset
from memcc.backend.onnx_file import save_graph
from memcc.backend.runner import RunRequest, run_steps, session_graph, synthetic_feeds
from memcc.backend.session import SessionSettings, make_session
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.analysis.inplace import analyze_in_place
from memcc.step import TrainingStep
from models import mlp

STEPS = 4


def _forward(batch: int = 8) -> onnx.ModelProto:
    return mlp.build(batch=batch, in_features=12, width=16, depth=2, num_classes=4)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """One tiny MLP step per optimizer, and its forward model."""
    d = tmp_path_factory.mktemp("trainer")
    out = {"forward": _forward()}
    for opt in ("sgd", "adamw"):
        step = build_training_step(load_graph(out["forward"]), BuildOptions(optimizer=opt))
        out[opt] = save_graph(step, d / f"mlp_{opt}.onnx")
    return out


def _copying_loop(path, feeds, steps):
    """memcc run's loop (plain session.run, outputs replace inputs): the reference."""
    graph = load_graph(path)
    spec = TrainingStep.of(graph)
    sgraph, values = session_graph(graph)
    session = make_session(sgraph.to_model(), "cpu", SessionSettings(intra_op_threads=1))
    values.update(feeds)
    losses = []
    for _ in range(steps):
        result = dict(zip(graph.outputs, session.run(graph.outputs, values), strict=True))
        losses.append(float(result[spec.loss]))
        for out, inp in spec.state.items():
            values[inp] = result[out]
    return losses, {inp: values[inp] for inp in spec.state.values()}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_in_place_steps_are_bit_identical_to_the_copying_runner(steps, opt):
    path = steps[opt]
    feeds = synthetic_feeds(load_graph(path), seed=0)
    trainer = Trainer(path, threads=1)
    assert set(trainer.in_place.aliased) == set(trainer.updates), trainer.in_place.refused
    losses = [trainer.step(feeds) for _ in range(STEPS)]
    ref_losses, ref_state = _copying_loop(path, feeds, STEPS)
    assert losses == ref_losses
    assert losses == list(run_steps(path, RunRequest(steps=STEPS, isolate=False)).losses)
    state = trainer.state_dict()
    assert state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name, strict=True)
    assert losses[-1] < losses[0]


def test_state_dict_uses_the_forward_models_initializer_names(steps):
    trainer = Trainer(steps["sgd"], threads=1)
    forward_names = {t.name for t in steps["forward"].graph.initializer}
    params = trainer.parameters()
    assert params and set(params) <= forward_names
    # the vectors' momentum is one joined buffer (frontend/update_groups.py)
    state = trainer.state_dict()
    vectors = {p for p in params if state[p].ndim == 1}
    joined = {n for n in state if n.startswith("grouped.")}
    assert vectors and joined == {"grouped.float32.momentum"}
    assert set(state) == set(params) | {f"{p}.momentum" for p in set(params) - vectors} | joined
    assert state["grouped.float32.momentum"].size == sum(state[p].size for p in vectors)


def test_updates_that_are_read_later_keep_their_own_buffer():
    """The analysis refuses an alias when a node after the update still reads the old value."""
    graph = load_graph(_forward())
    step = build_training_step(graph, BuildOptions(optimizer="sgd", momentum=0.0))
    spec = TrainingStep.of(step)
    ok = analyze_in_place(step, spec.state)
    assert set(ok.aliased) == set(spec.state)
    out, inp = next(iter(spec.state.items()))
    late = onnx.helper.make_node("ReduceSum", [inp], ["late_read"], name="late_read")
    step.nodes.append(late)
    refused = analyze_in_place(step, spec.state)
    assert out in refused.refused and "late_read" in refused.refused[out]


def test_save_and_resume_continue_bit_identically(steps, tmp_path):
    path = steps["adamw"]
    feeds = synthetic_feeds(load_graph(path), seed=3)
    straight = Trainer(path, threads=1)
    for _ in range(5):
        straight.step(feeds)
    first = Trainer(path, threads=1)
    for _ in range(3):
        first.step(feeds)
    first.save(tmp_path / "ck", data_state={"position": 3})
    resumed = Trainer.resume(tmp_path / "ck", threads=1)
    assert resumed.steps_done == 3 and resumed.data_state == {"position": 3}
    for _ in range(2):
        resumed.step(feeds)
    a, b = straight.state_dict(), resumed.state_dict()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name, strict=True)


def test_checkpoints_are_atomic_and_only_the_newest_are_kept(steps, tmp_path):
    d = tmp_path / "ck"
    trainer = Trainer(steps["sgd"], threads=1)
    feeds = synthetic_feeds(trainer.graph, seed=0)
    d.mkdir()
    stale = d / ".ckpt-killed.tmp"  # what a writer killed mid-write leaves behind
    stale.write_bytes(b"\0" * 100)
    assert ckpt.latest(d) is None
    for _ in range(3):
        trainer.step(feeds)
        trainer.save(d)
    names = sorted(p.name for p in d.iterdir())
    assert names == ["ckpt-000000002.safetensors", "ckpt-000000003.safetensors"]
    assert ckpt.load(d).step == 3


def _corrupt_data_byte(path):
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # the last tensor's bytes (the header is at the start)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, message", [
    ("flip", "corrupt: its tensor data does not match the checksum"),
    ("truncate", "not a readable checkpoint"),
    ("foreign", "written for another training step: it has no value"),
    ("untagged", "not a memcc checkpoint"),
])
def test_corrupt_or_foreign_checkpoints_are_refused(steps, tmp_path, damage, message):
    d = tmp_path / "ck"
    source = steps["sgd"] if damage != "foreign" else steps["adamw"]
    saved = Trainer(source, threads=1).save(d)
    if damage == "flip":
        _corrupt_data_byte(saved)
    elif damage == "truncate":
        saved.write_bytes(saved.read_bytes()[:40])
    elif damage == "untagged":
        from safetensors.numpy import save_file

        save_file({"x": np.zeros(3, np.float32)}, str(saved))
    trainer = Trainer(steps["sgd"], threads=1)
    with pytest.raises(InputError, match=message) as info:
        trainer.restore(d)
    assert str(saved) in str(info.value)


@pytest.mark.parametrize("arrays, message", [
    ({"input": np.zeros((20, 12), np.float32)}, r"no array named 'labels' \(samples of shape"),
    ({"input": np.zeros((20, 11), np.float32), "labels": np.zeros(20, np.int64)},
     r"array 'input' has shape \[20, 11\] dtype float32; the step expects samples of shape "
     r"\[12\].*\[N, 12\]"),
    ({"input": np.zeros((20, 12), np.int64), "labels": np.zeros(20, np.int64)},
     r"array 'input' has shape \[20, 12\] dtype int64; the step takes float32: memcc "
     r"converts integers to integers and floats to floats"),
    ({"input": np.zeros((20, 12), np.float32), "labels": np.zeros(20, np.float32)},
     r"array 'labels' .* dtype float32; the step takes int64"),
    ({"input": np.zeros((20, 12), np.float32), "labels": np.zeros(20, np.uint64) + 2**63},
     r"array 'labels' .* with values in \[9223372036854775808, 9223372036854775808\], "
     r"which the step's int64 cannot hold"),
    ({"input": np.zeros((20, 12), np.float32), "labels": np.full(20, 4, np.uint8)},
     r"array 'labels' holds values from 4 to 4.*\[0, 4\)"),
    ({"input": np.zeros((20, 12), np.float32), "labels": np.zeros(19, np.int64)},
     r"different numbers of samples \('input' 20, 'labels' 19\)"),
    ({"input": np.zeros((20, 12), np.float32), "labels": np.full(20, 4, np.int64)},
     r"array 'labels' holds values from 4 to 4.*\[0, 4\)"),
    ({"input": np.zeros((5, 12), np.float32), "labels": np.zeros(5, np.int64)},
     r"5 samples, fewer than one batch of the step \(8\)"),
])
def test_data_mismatches_name_the_array_and_the_expected_shape(steps, tmp_path, arrays,
                                                               message):
    np.savez(tmp_path / "d.npz", **arrays)
    inputs = data_inputs(load_graph(steps["sgd"]))
    with pytest.raises(InputError, match=message):
        load_dataset(tmp_path / "d.npz", inputs)


def test_data_in_a_wider_or_narrower_type_of_the_same_kind_is_converted(steps, tmp_path):
    """uint8 labels (a segmentation mask's usual dtype) and numpy's float64 default train
    as the step's int64 and float32 would, and the run says it converted them."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 12))
    y = rng.integers(0, 4, 16)
    np.savez(tmp_path / "given.npz", input=x, labels=y.astype(np.uint8))
    np.savez(tmp_path / "exact.npz", input=x.astype(np.float32), labels=y)
    inputs = data_inputs(load_graph(steps["sgd"]))
    given = load_dataset(tmp_path / "given.npz", inputs)
    exact = load_dataset(tmp_path / "exact.npz", inputs)
    assert given.fingerprint() == exact.fingerprint()
    assert given.notes == ("--data array 'input' is float64: converted to the step's "
                               "float32 (rounded)", "--data array 'labels' is uint8: "
                               "converted to the step's int64")
    assert exact.notes == ()
    # An array the step does not take is left unread, with a note (README said an error,
    # and training took it in silence).
    np.savez(tmp_path / "extra.npz", input=x.astype(np.float32), labels=y, weights=y * 0.5)
    extra = load_dataset(tmp_path / "extra.npz", inputs)
    assert extra.fingerprint() == exact.fingerprint()
    assert extra.notes == ("--data arrays ['weights'] are not inputs of the step and are "
                               "not read (its data inputs are ['input', 'labels'])",)


def test_a_plan_made_for_cuda_trains_where_cuda_is_and_says_so_where_it_is_not(
        steps, tmp_path, monkeypatch):
    """``provider`` None (``memcc train`` without --provider): where the plan was made
    (``memcc.provider``, written by compile and tune), else the CPU. A CUDA plan where CUDA
    is missing trains on the CPU with a note in the run's notes; a plan run on another
    provider than its own is noted too; a step as built has nothing to say."""
    import memcc.backend.session as session
    from memcc.api import TrainOptions, train

    monkeypatch.setattr(session, "cuda_unavailable_reason", lambda: "no GPU (test)")
    graph = load_graph(steps["sgd"])
    graph.metadata["memcc.provider"] = "cuda"
    planned = save_graph(graph, tmp_path / "cuda_plan.onnx")
    t = Trainer(planned)
    assert t.provider == "cpu" and "planned for CUDA" in t.provider_note
    assert "no GPU (test)" in t.provider_note
    assert Trainer(steps["sgd"]).provider_note is None
    assert "runs on CPU here" in Trainer(planned, provider="cpu").provider_note
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", input=rng.standard_normal((16, 12)).astype(np.float32),
             labels=rng.integers(0, 4, 16))
    result = train(TrainOptions(step=planned, data=tmp_path / "d.npz", steps=2))
    assert any("planned for CUDA" in n for n in result.notes)


def test_shards_equal_one_file_and_each_epoch_sees_every_sample_once(steps, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((36, 12), dtype=np.float32)
    y = rng.integers(0, 4, 36)
    np.savez(tmp_path / "all.npz", input=x, labels=y)
    (tmp_path / "shards").mkdir()
    np.savez(tmp_path / "shards" / "a.npz", input=x[:20], labels=y[:20])
    np.savez(tmp_path / "shards" / "b.npz", input=x[20:], labels=y[20:])
    inputs = data_inputs(load_graph(steps["sgd"]))
    one = load_dataset(tmp_path / "all.npz", inputs)
    sharded = load_dataset(tmp_path / "shards", inputs)
    assert one.fingerprint() == sharded.fingerprint()
    assert one.batches_per_epoch == 4 and one.dropped_per_epoch == 4
    epoch0 = np.concatenate([one.indices(k, seed=1) for k in range(4)])
    epoch1 = np.concatenate([one.indices(k, seed=1) for k in range(4, 8)])
    assert len(set(epoch0)) == 32 and len(set(epoch1)) == 32
    assert not np.array_equal(epoch0, epoch1)
    assert not np.array_equal(epoch0, np.concatenate([one.indices(k, seed=2)
                                                      for k in range(4)]))
    np.testing.assert_array_equal(one.batch(5, 1)["input"], sharded.batch(5, 1)["input"])
    # files that are no .npz shard are left out, and said so (a walk-through: silently)
    assert not any("not read" in n for n in sharded.notes)
    np.save(tmp_path / "shards" / "c.npy", x[:4])
    (tmp_path / "shards" / "README.txt").write_text("shards")
    again = load_dataset(tmp_path / "shards", inputs)
    assert again.fingerprint() == sharded.fingerprint()
    assert any("2 file(s)" in n and "c.npy" in n and "README.txt" in n for n in again.notes)


def test_a_wrong_batch_is_refused_naming_the_array(steps):
    trainer = Trainer(steps["sgd"], threads=1)
    feeds = synthetic_feeds(trainer.graph, seed=0)
    feeds["input"] = feeds["input"][:4]
    with pytest.raises(InputError, match=r"array 'input' has shape \[4, 12\].*\[8, 12\]"):
        trainer.step(feeds)
    assert trainer.steps_done == 0


def test_a_batch_of_other_types_trains_as_memcc_train_converts_it(steps):
    """int32 labels and numpy's float64 inputs: converted as ``memcc train --data`` converts
    them (the same losses as the step's own types); floats for integer labels refused."""
    feeds = synthetic_feeds(Trainer(steps["sgd"], threads=1).graph, seed=0)
    want = Trainer(steps["sgd"], threads=1)
    got = Trainer(steps["sgd"], threads=1)
    other = {"input": feeds["input"].astype(np.float64),
             "labels": feeds["labels"].astype(np.int32)}
    for _ in range(2):
        assert got.step(other) == want.step(feeds)
    with pytest.raises(InputError, match=r"array 'labels' is float32; the step takes int64"):
        got.step({**feeds, "labels": feeds["labels"].astype(np.float32)})


def test_exported_onnx_is_the_forward_model_with_the_trained_weights(steps, tmp_path):
    trainer = Trainer(steps["sgd"], threads=1)
    feeds = synthetic_feeds(trainer.graph, seed=0)
    for _ in range(3):
        trainer.step(feeds)
    out = trainer.export(tmp_path / "trained.onnx")
    exported = onnx.load(str(out))
    assert [i.name for i in exported.graph.input] == ["input"]
    assert [o.name for o in exported.graph.output] == ["logits"]
    # No step metadata, but the producer whose BatchNorm semantics a new build follows.
    assert {p.key for p in exported.metadata_props if p.key.startswith("memcc.")} <= {
        "memcc.producer"}
    # The reference: the forward model memcc build started from, weights swapped by hand.
    reference = onnx.ModelProto()
    reference.CopyFrom(steps["forward"])
    state = trainer.state_dict()
    for t in reference.graph.initializer:
        if t.name in state:
            t.CopyFrom(onnx.numpy_helper.from_array(state[t.name], t.name))
    x = {"input": feeds["input"]}
    got = ort.InferenceSession(str(out)).run(None, x)[0]
    want = ort.InferenceSession(reference.SerializeToString()).run(None, x)[0]
    np.testing.assert_array_equal(got, want)
    untrained = ort.InferenceSession(steps["forward"].SerializeToString()).run(None, x)[0]
    assert not np.array_equal(got, untrained)


def test_export_without_recorded_forward_outputs_says_to_rebuild(steps, tmp_path):
    model = onnx.load(str(steps["sgd"]))
    keep = [p for p in model.metadata_props if p.key != "memcc.forward_outputs"]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    old = tmp_path / "old_step.onnx"
    onnx.save(model, str(old))
    with pytest.raises(InputError, match="rebuild the step with memcc build"):
        Trainer(old, threads=1).export(tmp_path / "x.onnx")


def test_checkpoint_metadata_records_step_data_position_and_format(steps, tmp_path):
    from safetensors import safe_open

    trainer = Trainer(steps["sgd"], threads=1)
    path = trainer.save(tmp_path / "ck", data_state={"batches_consumed": 0, "seed": 7})
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    assert meta[ckpt.FORMAT_KEY] == ckpt.FORMAT
    assert meta[ckpt.STEP_KEY] == "0"
    assert json.loads(meta[ckpt.DATA_KEY]) == {"batches_consumed": 0, "seed": 7}


@pytest.mark.parametrize("name, opt", [("resnet18", "sgd"), ("gpt2", "adamw"), ("bert", "sgd")])
def test_zoo_steps_train_bit_identically_to_the_copying_runner(tmp_path, name, opt):
    """BatchNorm statistics (resnet: second buffer, swapped), tied embeddings (gpt2), masks
    (bert): the Trainer's arrangement changes where values live, never what is computed."""
    from models import build_model

    step = build_training_step(load_graph(build_model(name)), BuildOptions(optimizer=opt))
    path = save_graph(step, tmp_path / "step.onnx")
    trainer = Trainer(path, threads=1)
    feeds = synthetic_feeds(trainer.graph, seed=0)
    losses = [trainer.step(feeds) for _ in range(2)]
    ref_losses, ref_state = _copying_loop(path, feeds, 2)
    assert losses == ref_losses
    state = trainer.state_dict()
    for name_, value in ref_state.items():
        np.testing.assert_array_equal(state[name_], value, err_msg=name_, strict=True)


def test_saving_an_older_step_over_a_newer_run_is_refused(steps, tmp_path):
    """Pruning keeps the newest steps: an older save would be deleted at once, and a resume
    would pick the other run's checkpoint."""
    d = tmp_path / "ck"
    newer = Trainer(steps["sgd"], threads=1)
    feeds = synthetic_feeds(newer.graph, seed=0)
    for _ in range(2):
        newer.step(feeds)
    newer.save(d)
    with pytest.raises(InputError, match="holds ckpt-000000002.safetensors, newer than step 0"):
        Trainer(steps["sgd"], threads=1).save(d)
    assert [p.name for p in ckpt.list_checkpoints(d)] == ["ckpt-000000002.safetensors"]


def test_a_resumed_run_draws_the_uninterrupted_runs_dropout_masks(tmp_path):
    """ORT's Dropout kept its generator in the session, which no checkpoint holds: a run
    resumed at step 3 drew other masks and ended with every tensor different. Masks now
    come from the step's carried counter: stopped at 3 and resumed (or re-created from a
    checkpoint) ends bit-identical to 6 uninterrupted steps, at 1 and at 2 threads."""
    from benchmarks.dropout_cuda_check import with_dropout

    forward = with_dropout(mlp.build(batch=8, in_features=16, width=32, depth=2), 0.1)
    path = save_graph(build_training_step(load_graph(forward), BuildOptions(optimizer="adamw")),
                      tmp_path / "drop.onnx")
    feeds = synthetic_feeds(load_graph(path), seed=1)
    straight = Trainer(path, threads=1)
    losses = [straight.step(feeds) for _ in range(6)]
    assert len(set(losses)) == 6, losses
    want = straight.state_dict()
    assert want["dropout.step"] == 6
    for threads in (1, 2):
        first = Trainer(path, threads=threads)
        assert [first.step(feeds) for _ in range(3)] == losses[:3]
        first.save(tmp_path / f"ck{threads}")
        del first
        resumed = Trainer.resume(tmp_path / f"ck{threads}", threads=threads)
        assert [resumed.step(feeds) for _ in range(3)] == losses[3:]
        got = resumed.state_dict()
        assert got.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name, strict=True)


def test_a_step_rewritten_for_its_provider_exports_the_model_as_built(tmp_path, monkeypatch):
    """On CUDA the trainer runs training-mode BatchNorm written as standard ops (the CUDA
    provider refuses it); the exported model is still the step's own form. No GPU here:
    the rewrite is forced on the CPU provider, which runs both forms."""
    from exports import export

    import memcc.trainer.trainer as trainer_module
    from memcc.passes.providers.batchnorm_for_cuda import expand_training_batchnorm

    path, _, _, dims = export("conv_bn", "torchscript", tmp_path, training=True)
    step_file = save_graph(build_training_step(load_graph(path, dims), BuildOptions()),
                           tmp_path / "step.onnx")
    monkeypatch.setattr(trainer_module, "step_for_provider",
                        lambda graph, provider, deterministic=False, notes=None: (
                            expand_training_batchnorm(graph)[0], True))
    trainer = Trainer(step_file, threads=1)
    assert not [n for n in trainer.graph.nodes if n.op_type == "BatchNormalization"
                and any(a.name == "training_mode" and a.i for a in n.attribute)]
    feeds = synthetic_feeds(trainer.graph, seed=0)
    trainer.step(feeds)
    exported = onnx.load(str(trainer.export(tmp_path / "trained.onnx")))
    ops = [n.op_type for n in exported.graph.node]
    assert "BatchNormalization" in ops and "ReduceSumSquare" not in ops
    state = trainer.state_dict()
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in exported.graph.initializer}
    shared = weights.keys() & state.keys()
    assert shared, "the export must carry the trained parameters"
    assert all(np.array_equal(weights[k], state[k]) for k in shared)


def test_checkpoints_and_exported_weights_get_the_usual_file_mode(tmp_path):
    """safetensors files came out 0600 (mkstemp's mode) where memcc's ONNX files get the
    umask's mode: a checkpoint another user or a job under another account reads failed."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    out = ckpt.write_safetensors(tmp_path / "w.safetensors", {"a": np.ones(3, np.float32)})
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
