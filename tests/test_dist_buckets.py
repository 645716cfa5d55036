"""Gradient buckets reduced while the backward goes on (``memcc.dist.buckets`` cuts the
gradient step, ``memcc.dist.overlap`` runs it; ``memcc train --nproc N --bucket-mb B``).

The same arithmetic as the unsegmented step, so bit for bit: one rank against
``memcc.Trainer``, two ranks (threads, ``dist_ranks.Threads``) against two ranks without
buckets at ZeRO-0 and ZeRO-1. Small buckets (a few hundred bytes) so that the tiny steps
are cut into many segments, tied weights and BatchNorm statistics among them.
"""

from __future__ import annotations

import numpy as np
import pytest
from dist_ranks import OneRank, Threads, run_ranks
from onnx_files import mlp_step_and_data

from memcc import Trainer
from memcc.backend.device_step import step_for_provider
from memcc.backend.onnx_file import save_graph
from memcc.dist import split_step
from memcc.dist.buckets import cut_at_buckets
from memcc.dist.replica import Replica, ReplicaSettings
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.step import TrainingStep
from models import build_model, mlp

K = 3


def _forward(model: str):
    return {"mlp": lambda: mlp.build(batch=4, in_features=12, width=16, depth=3,
                                     num_classes=4),
            "gpt2": lambda: build_model("gpt2", width=32, depth=2, heads=2, vocab_size=64,
                                        seq_len=16, batch=2),
            "resnet18": lambda: build_model("resnet18", batch=2, resolution=16, width=4,
                                            num_classes=4)}[model]()


def _step(tmp_path, model: str, opt: str, **build):
    graph = build_training_step(load_graph(_forward(model)), BuildOptions(optimizer=opt,
                                                                          **build))
    path = save_graph(graph, tmp_path / f"{model}-{opt}.onnx")
    graph, _ = step_for_provider(load_graph(path), "cpu")  # as memcc.dist.train prepares it
    return path, graph


def _batches(trainer: Trainer, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{d.name: (rng.integers(0, 4, (d.batch_size, *d.sample_shape))
                      if d.dtype.kind == "i" else
                      rng.standard_normal((d.batch_size, *d.sample_shape))).astype(d.dtype)
             for d in trainer.inputs} for _ in range(K)]


def test_the_cut_partitions_the_backward_and_every_gradient_lies_in_one_bucket(tmp_path):
    _, graph = _step(tmp_path, "gpt2", "adamw")
    split = split_step(graph, TrainingStep.of(graph))
    cut = cut_at_buckets(split, 2_000)
    segs = cut.segments
    assert len(segs) > 3
    grads = set(split.gradients.values())
    bucketed = [g for s in segs for g in s.bucket]
    assert sorted(bucketed) == sorted(grads)   # each once
    # Every bucket but the last holds at least the cap; no segment is empty.
    for s in segs[:-1]:
        assert sum(graph.info[g].nbytes for g in s.bucket) >= 2_000
    made = [n.name for s in segs for n in s.graph.nodes if n.op_type != "Constant"]
    assert made == [n.name for n in split.gradient.nodes if n.op_type != "Constant"]
    # A bucket is reduced only once no later segment reads its gradients; the tied
    # embedding's gradient is read by no later segment, its weight by the first.
    for k, s in enumerate(segs):
        assert cut.reduce_after[k] >= k
        for g in s.bucket:
            assert all(cut.reduce_after[k] >= j for j, t in enumerate(segs) if g in t.takes)
    with pytest.raises(InputError, match="positive"):
        cut_at_buckets(split, 0)


def _compiled_gpt2(tmp_path):
    """The zoo GPT-2 compiled at --budget min: recomputed nodes in the backward, which the
    cut must carry across segments like any other value."""
    from typer.testing import CliRunner

    from memcc.cli import app

    built, _ = _step(tmp_path, "gpt2", "adamw")
    path = tmp_path / "min.onnx"
    res = CliRunner().invoke(app, ["compile", str(built), "--budget", "min", "--strategy",
                                   "sqrtn", "--cost", "analytic", "-o", str(path)])
    assert res.exit_code == 0, res.output
    graph, _ = step_for_provider(load_graph(path), "cpu")
    return path, graph


@pytest.mark.parametrize("model,opt", [("mlp", "sgd"), ("mlp", "adamw"), ("gpt2", "adamw"),
                                       ("resnet18", "sgd"), ("mlp", "fp16-dynamic"),
                                       ("mlp-dropout", "adamw"), ("gpt2-compiled", "adamw"),
                                       ("hf-gpt2-dynamo", "adamw")])
def test_one_rank_by_buckets_is_bit_identical_to_the_trainer(tmp_path, model, opt):
    """fp16 with dynamic loss scaling: every update reads the finiteness of every gradient,
    so all wait for the last bucket (one update part, after the backward). Dropout: the
    gradient step reads the counter the last update part advances."""
    build = dict(precision="fp16", loss_scale="dynamic") if opt == "fp16-dynamic" else {}
    if model == "mlp-dropout":
        path, _ = mlp_step_and_data(tmp_path, batch=4, in_features=12, width=16, depth=3,
                                    samples=8, optimizer=opt, dropout=0.25)
        graph, _ = step_for_provider(load_graph(path), "cpu")
    elif model == "gpt2-compiled":
        path, graph = _compiled_gpt2(tmp_path)
    elif model == "hf-gpt2-dynamo":  # transformers' GPT-2 by torch.onnx's dynamo exporter
        from exports import export

        forward, _, _, dims = export("gpt2", "dynamo", tmp_path)
        built = build_training_step(load_graph(forward, dims), BuildOptions(optimizer=opt))
        path = save_graph(built, tmp_path / "hf.onnx")
        graph, _ = step_for_provider(load_graph(path), "cpu")
    else:
        path, graph = _step(tmp_path, model, "adamw" if build else opt, **build)
    trainer = Trainer(path, threads=1)
    split = split_step(graph, TrainingStep.of(graph))
    replica = Replica(split, OneRank(), ReplicaSettings(0, 1, threads=2, bucket_bytes=300))
    parts = [at for at, p in enumerate(replica.overlapped.updates) if p is not None]
    n = len(replica.overlapped.cut.segments)
    assert n > 2
    assert parts == [n] if build else len(parts) > 2
    if not build and model != "mlp-dropout":  # a grouped update, due at the end
        # (frontend/update_groups.py), holds copies of its gradients, not their buckets
        ov = replica.overlapped
        assert ov._grouped and parts[-1] == n
        assert ov._done_after == [ov.cut.waited_after(b) for b in range(n)], ov._done_after
    for batch in _batches(trainer):
        assert replica.step(batch) == (trainer.step(batch), False)
    mine = replica.full_state()
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name, strict=True)


def _two_ranks(graph, zero: int, bucket_bytes: int | None, batches: list) -> list:
    group, replicas = Threads(2), [None, None]

    def rank(r: int) -> None:
        split = split_step(graph.copy(), TrainingStep.of(graph))
        replicas[r] = Replica(split, group.rank(r), ReplicaSettings(
            r, 2, zero, threads=1, bucket_bytes=bucket_bytes))
        for step in batches:
            replicas[r].step(step[r])

    run_ranks(group, rank)
    return replicas


@pytest.mark.parametrize("zero", [0, 1])
def test_two_ranks_by_buckets_train_the_bits_of_one_bucket_and_hold_no_gradient(tmp_path,
                                                                                zero):
    path, graph = _step(tmp_path, "gpt2", "adamw")
    trainer = Trainer(path, threads=1)
    batches = [[b, _batches(trainer, seed=9)[i]] for i, b in enumerate(_batches(trainer))]
    whole = _two_ranks(graph, zero, None, batches)
    by_buckets = _two_ranks(graph, zero, 1_500, batches)
    for r in (0, 1):
        a, b = whole[r].local_state(), by_buckets[r].local_state()
        assert sorted(a) == sorted(b)
        for name in a:
            np.testing.assert_array_equal(b[name], a[name], err_msg=name, strict=True)
        # Between steps a rank by buckets holds no gradient: the whole bucket's bytes less.
        grad_bytes = sum(f.nbytes for f in whole[r].grad_flats.values())
        assert by_buckets[r].held_bytes() <= whole[r].held_bytes() - grad_bytes + 8 + 64


def test_buckets_with_zero2_are_refused(tmp_path):
    _, graph = _step(tmp_path, "mlp", "sgd")
    split = split_step(graph, TrainingStep.of(graph))
    with pytest.raises(InputError, match="--zero 2"):
        Replica(split, OneRank(), ReplicaSettings(0, 2, 2, threads=1, bucket_bytes=1000))


def test_two_spawned_ranks_by_buckets_match_two_without(tmp_path):
    """The CLI end to end (2 gloo processes each): ``--bucket-mb`` trains the bits of the
    run without it, and reports its bucket size; a bad size is refused before any rank."""
    import json

    from typer.testing import CliRunner

    from memcc.backend import checkpoint as ckpt
    from memcc.cli import app

    path, _ = _step(tmp_path, "mlp", "adamw")
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    np.savez(data, input=rng.standard_normal((32, 12)).astype(np.float32),
             labels=rng.integers(0, 4, 32).astype(np.int64))
    runner, params = CliRunner(), {}
    for name, extra in (("whole", []), ("buckets", ["--bucket-mb", "0.0005"])):
        res = runner.invoke(app, ["train", str(path), "--data", str(data), "--nproc", "2",
                                  "--zero", "1", "--steps", str(K), "--threads", "1",
                                  "--checkpoint", str(tmp_path / name), "--json", *extra])
        assert res.exit_code == 0, res.output
        info = json.loads(res.stdout.strip().splitlines()[-1])["distributed"]
        assert info["bucket_bytes"] == (500 if extra else None)
        params[name] = ckpt.load(ckpt.latest(tmp_path / name)).tensors
    for name, value in params["whole"].items():
        np.testing.assert_array_equal(params["buckets"][name], value, err_msg=name)
    res = runner.invoke(app, ["train", str(path), "--data", str(data), "--nproc", "2",
                              "--bucket-mb", "0"])
    assert res.exit_code == 2 and "--bucket-mb 0" in res.output
    res = runner.invoke(app, ["train", str(path), "--data", str(data), "--bucket-mb", "25"])
    assert res.exit_code == 2 and "--nproc" in res.output


def test_the_prediction_by_buckets_holds_no_gradient_bucket(tmp_path):
    """``memcc train --nproc --bucket-mb``'s predicted peak: the rank's graph in the order
    the buckets run it (a valid order, the same nodes whatever the bucket size), below the
    one-bucket prediction."""
    from memcc.dist.bucket_memory import bucketed_rank_graph
    from memcc.dist.memory import predicted_rank_peak
    from memcc.graph import topological_problems
    from memcc.passes.analysis.rank_step import Ranks

    _, graph = _step(tmp_path, "gpt2", "adamw")
    for zero in (0, 1):
        view = bucketed_rank_graph(graph, Ranks(2, zero), 0, 1_500)
        assert topological_problems(view) == []
        assert sorted(n.name for n in view.nodes if not n.name.startswith("memcc.dist.hold/")) \
            == sorted(n.name for n in bucketed_rank_graph(graph, Ranks(2, zero), 0, 10**9).nodes
                      if not n.name.startswith("memcc.dist.hold/"))
        whole = predicted_rank_peak(graph, 2, zero, 0)
        by_buckets = predicted_rank_peak(graph, 2, zero, 0, 1_500)
        assert by_buckets < whole
