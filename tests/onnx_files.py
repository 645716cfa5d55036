"""Small hand-built ONNX models written to files, as a user's export would arrive."""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto, helper


def write_model(path: Path, nodes, inputs, outputs, inits=(), *, opset: int = 17) -> Path:
    """``inputs`` / ``outputs``: (name, shape) pairs of float tensors."""
    g = helper.make_graph(
        nodes, path.stem,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    path.write_bytes(m.SerializeToString())
    return path



def mlp_step_and_data(d: Path, *, batch: int, in_features: int, width: int, depth: int,
                      num_classes: int = 10, samples: int, seed: int = 0,
                      optimizer: str = "sgd", dropout: float | None = None) -> tuple[Path, Path]:
    """A zoo MLP's training step (``step.onnx``, with Dropout ``dropout`` after each hidden
    layer where given) and ``data.npz`` of ``samples`` random samples, both in ``d``: the
    train and resume tests' model, small enough that a step takes well under a
    millisecond."""
    import numpy as np

    from memcc.backend.onnx_file import save_graph
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from models import mlp

    forward = mlp.build(batch=batch, in_features=in_features, width=width, depth=depth,
                        num_classes=num_classes)
    if dropout is not None:
        from benchmarks.dropout_cuda_check import with_dropout

        forward = with_dropout(forward, dropout)
    step = save_graph(build_training_step(load_graph(forward), BuildOptions(optimizer=optimizer)),
                      d / "step.onnx")
    rng = np.random.default_rng(seed)
    data = d / "data.npz"
    np.savez(data, input=rng.standard_normal((samples, in_features), dtype=np.float32),
             labels=rng.integers(0, num_classes, samples))
    return step, data


def diverging_gpt2_step_and_data(d: Path, *, samples: int) -> tuple[Path, Path]:
    """A zoo GPT-2's step built at a learning rate of 1e4, whose loss goes to nan within a
    few steps, and ``samples`` random token rows: the divergence tests' run."""
    import numpy as np
    import onnx

    from memcc.backend.onnx_file import save_graph
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from models import build_model

    vocab = 64
    onnx.save(build_model("gpt2", batch=4, seq_len=16, width=32, vocab_size=vocab),
              str(d / "g.onnx"))
    step = save_graph(build_training_step(load_graph(d / "g.onnx"), BuildOptions(lr=1e4)),
                      d / "s.onnx")
    rng = np.random.default_rng(0)
    np.savez(d / "d.npz", input_ids=rng.integers(0, vocab, (samples, 16)),
             labels=rng.integers(0, vocab, (samples, 16)))
    return step, d / "d.npz"


def said_it_diverged(output: str, checkpoints: Path) -> str:
    """Check that a run of ``diverging_gpt2_step_and_data`` said its loss was no number
    and that every checkpoint it left holds finite values; return what it said, joined."""
    import numpy as np

    from memcc.backend import checkpoint as ckpt

    said = " ".join(output.split())
    assert "the loss is nan" in said or "the loss is inf" in said, said
    assert "training stopped" in said, said
    left = sorted(checkpoints.glob("ckpt-*.safetensors"))
    assert left, "the steps before it were saved"
    for path in left:
        for name, value in ckpt.load(path).tensors.items():
            assert np.isfinite(value).all(), (path.name, name)
    return said
