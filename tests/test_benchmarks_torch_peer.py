"""The PyTorch peer of the recompute benchmark trains the zoo's architecture, on memcc's batch.

The peer's numbers only mean something if its torch modules compute what the zoo's ONNX graph
computes and its batch is the runner's batch; these checks are cheap, the measured run is one
tiny child process per checkpoint mode.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_reference import torch_forward  # noqa: E402

from benchmarks import torch_peer as tp  # noqa: E402
from memcc.backend.runner import synthetic_feeds  # noqa: E402
from memcc.frontend.build import build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402

CASES = [
    ("resnet50", {"batch": 2, "resolution": 64, "width": 8}),
    ("resnet18", {"batch": 2, "resolution": 64, "width": 8}),
    ("gpt2", {"batch": 2, "seq_len": 8, "tie_embeddings": False, "n_positions": 12}),
    ("mlp", {"linear": "matmul"}),
]


@pytest.mark.parametrize(("family", "options"), CASES, ids=[c[0] for c in CASES])
def test_torch_module_matches_zoo_forward(family: str, options: dict) -> None:
    opts, model = tp.zoo_options(family, options)
    module = tp.make_module(family, opts, "none", "eager")
    tp.load_weights(module, family, opts, tp.zoo_weights(model))
    data, _ = tp.make_batch(family, opts, seed=0)
    # The node-by-node torch interpreter, not ORT: a plain ORT session runs training-mode
    # BatchNormalization with the running statistics.
    outputs, _ = torch_forward(model, {model.graph.input[0].name: data}, False)
    expected = outputs["logits"].detach().numpy()
    with torch.no_grad():
        got = module(torch.from_numpy(data)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_batch_is_the_runners_batch() -> None:
    for family, options in (("gpt2", {"batch": 2, "seq_len": 8}), ("mlp", {})):
        opts, model = tp.zoo_options(family, options)
        feeds = synthetic_feeds(build_training_step(load_graph(model)), seed=3)
        data, labels = tp.make_batch(family, opts, seed=3)
        name = "input_ids" if family == "gpt2" else "input"
        np.testing.assert_array_equal(feeds[name], data)
        np.testing.assert_array_equal(feeds["labels"], labels)


def test_measured_steps_with_and_without_checkpointing() -> None:
    options = {"batch": 2, "seq_len": 32, "width": 32, "depth": 2}
    plain = tp.measure_torch("gpt2", options, checkpoint="none", steps=2)
    ckpt = tp.measure_torch("gpt2", options, checkpoint="per-block", steps=2)
    for r in (plain, ckpt):
        assert r["family"] == "gpt2" and len(r["losses"]) == 2
        assert r["peak_bytes"] >= r["state_bytes"] > 0
        assert r["step_time_s"] > 0 and "cpu-vmhwm" in r["method"]
    assert ckpt["checkpoint"] == "per-block"
    np.testing.assert_allclose(ckpt["losses"], plain["losses"], rtol=1e-5)
    with pytest.raises(ValueError, match="checkpoint"):
        tp.measure_torch("gpt2", options, checkpoint="everything")
