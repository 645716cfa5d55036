"""``memcc build --batch-chunks K``: a convnet's stem (Conv of the image, training-mode
BatchNorm, Relu, MaxPool) over batch chunks, its batch statistics and their gradients summed
over the chunks (``frontend/batch_chunks.py``), and compile choosing it
(``compiler/stem_gate.py``, ``compiler/chunk_choice.py``).

Against the whole stem of the same model (the zoo's ResNet, built without torch; a
transformers ResNet export in train mode measured 1.6e-6 at 2, 3 and 8 chunks): loss,
every parameter's update and momentum, and the BatchNorm running statistics within
``BATCH_CHUNKS_TOLERANCE`` at 1 and 2 threads (each run twice, the same bits), with chunks
that do not divide the batch; no stem-sized activation left in the step; and a plan of the
chunked step that ``--verify`` runs against it.
"""

from __future__ import annotations

import json

import pytest
from threads import assert_step_matches
from typer.testing import CliRunner

from memcc.backend.onnx_file import save_model
from memcc.cli import app
from memcc.compiler.chunk_choice import BATCH, candidates
from memcc.compiler.stem_gate import stem_shares, worth_chunking
from memcc.errors import InputError
from memcc.frontend.batch_chunks import BATCH_CHUNKS_TOLERANCE
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.step import ROW_CHUNKS_KEY
from models import build_model


def test_stem_over_batch_chunks_matches_the_whole_stem():
    """Batch 8 in chunks of 3, 3 and 2: the step's outputs within tolerance of the whole
    stem's at 1 and 2 threads, and no value of the stem's full size is left (its forward,
    backward and weight gradient work one chunk at a time)."""
    model = build_model("resnet18", batch=8, resolution=64, width=8, blocks=[1, 1])
    whole = build_training_step(load_graph(model), BuildOptions())
    chunked = build_training_step(load_graph(model), BuildOptions(batch_chunks=3))
    stem = next(n for n in whole.nodes if n.op_type == "BatchNormalization")
    full = tuple(whole.info[stem.input[0]].shape)
    assert full[0] == 8
    made = {o for n in chunked.nodes for o in n.output if o}
    assert not [v for v in made if tuple(chunked.info[v].shape or ()) == full]
    assert json.loads(chunked.metadata[ROW_CHUNKS_KEY])[BATCH] == {"chunks": 3, "regions": 1}
    # Compile would not plan it unasked here: the shares pass, but the tensors are tiny.
    bound, tensors, size = stem_shares(whole)
    assert bound >= 0.3 and tensors >= 0.2 and size < 1 << 20
    assert not worth_chunking((bound, tensors, size)) and worth_chunking((bound, tensors, 2 << 20))
    assert_step_matches(whole, chunked, BATCH_CHUNKS_TOLERANCE, threads=(1, 2))


def test_a_real_train_mode_export_over_batch_chunks_matches_its_whole_stem():
    """What users feed: a transformers ResNet exported by torch.onnx in train mode (its
    stem Conv -> BatchNorm -> Relu -> MaxPool as the exporter writes it), batch 8 bound
    at load, in chunks of 3, 3 and 2, at 1 and 2 threads."""
    from exports import export

    path, _, _, _ = export("hf_resnet", "torchscript", training=True)
    forward = load_graph(path, {"batch": 8})
    whole = build_training_step(forward, BuildOptions())
    chunked = build_training_step(forward, BuildOptions(batch_chunks=3))
    assert json.loads(chunked.metadata[ROW_CHUNKS_KEY])[BATCH] == {"chunks": 3, "regions": 1}
    assert_step_matches(whole, chunked, BATCH_CHUNKS_TOLERANCE, threads=(1, 2))


@pytest.mark.parametrize("name, exporter, acts", [
    ("hardswish_stem", "torchscript", ["HardSigmoid", "Mul"]),
    ("silu_stem", "torchscript", ["Sigmoid", "Mul"]),
    ("silu_stem", "dynamo_noopt", ["Sigmoid", "Mul"]),
])
def test_a_stem_with_a_smooth_activation_over_batch_chunks_matches_its_whole_stem(
        name, exporter, acts):
    """MobileNetV3's HardSwish stem and EfficientNet's SiLU (x * Sigmoid(x) as both
    exporters write it, whose gradient reaches x twice) split too, exported in train
    mode, batch 8 in chunks of 3, 3 and 2, at 1 and 2 threads."""
    import warnings

    from exports import export

    from memcc.frontend.batch_chunks import find_stems
    from memcc.frontend.exported import restore_training_batchnorm

    path, _, _, _ = export(name, exporter, training=True)
    forward = load_graph(path, {"batch": 8})
    seen = forward.copy()
    with warnings.catch_warnings():   # dynamo's BatchNorm, restored to train mode as build does
        warnings.simplefilter("ignore")
        restore_training_batchnorm(seen, str(path))
    assert [[n.op_type for n in s.acts] for s in find_stems(seen)] == [acts]
    whole = build_training_step(forward, BuildOptions())
    chunked = build_training_step(forward, BuildOptions(batch_chunks=3))
    assert json.loads(chunked.metadata[ROW_CHUNKS_KEY])[BATCH] == {"chunks": 3, "regions": 1}
    assert_step_matches(whole, chunked, BATCH_CHUNKS_TOLERANCE, threads=(1, 2))


def test_compile_plans_the_chunked_stem_and_verifies_it(tmp_path):
    """``--batch-chunks 4 --budget min --verify``: the plan of the chunked step runs and
    matches it; compile's ladder offers the stem's chunks where the model has a stem, and
    a model without one is refused by name."""
    path, out, rep = tmp_path / "r.onnx", tmp_path / "out.onnx", tmp_path / "out.json"
    save_model(build_model("resnet18", batch=8, resolution=64, width=8, blocks=[1, 1]), path)
    r = CliRunner().invoke(app, [
        "compile", str(path), "--batch-chunks", "4", "--budget", "min",
        "-o", str(out), "--report", str(rep), "--cost", "analytic", "--time-limit", "1",
        "--verify"])
    assert r.exit_code == 0, r.output
    report = json.loads(rep.read_text())
    assert report["row_chunks"]["chosen"][BATCH] == 4
    assert report["verification"]["ok"], report["verification"]["problems"]
    found = {"loss": 0, "attention": 0, "mlp": 0, BATCH: 1}
    assert [c[BATCH] for c in candidates(BuildOptions(), found)] == [4, 8]
    with pytest.raises(InputError, match="--batch-chunks 2: no stem"):
        build_training_step(load_graph(build_model("mlp")), BuildOptions(batch_chunks=2))
