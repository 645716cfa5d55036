"""Gradients of every zoo model's training step match PyTorch autograd.

Every step runs twice at 2 and at 4 intra-op threads (``threads.run_at_threads``): the runs of
one thread count must agree bit for bit, and each count's gradients must match torch, so a
kernel that races across threads (the old ScatterND embedding gradient) fails here. GPT-2 also
runs at the size where that race was found (8 x 256 tokens into a 2000-row table).

The reference is ``torch_reference``: the forward ONNX graph interpreted op by op in torch,
in float64, differentiated by autograd (independent of memcc's gradient rules). Both sides use
the same weights, batch and labels; memcc's step runs in ORT on the CPU provider in float32.
float64 matters: in deep BatchNorm networks a float32 torch run is itself ~1e-2 away from the
exact gradient, so float32-vs-float32 would compare two noisy answers.
"""

from __future__ import annotations

import numpy as np
import pytest
from threads import run_at_threads
from torch_reference import torch_loss_and_grads

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from models import MODELS, build_model, make_feeds, make_labels

# At the default batch of 2 one mobilenetv2 ReLU6 input sits 7e-6 from the kink and flips
# side between float32 and float64, moving the stem's gradient by 1e-2; batch 8 has none.
OPTIONS = {"mobilenetv2": {"batch": 8}}
CASES = [(family, OPTIONS.get(family, {})) for family in sorted(MODELS)] + [
    ("gpt2", {"batch": 8, "seq_len": 256, "width": 256, "depth": 4, "heads": 4,
              "vocab_size": 2000})]


@pytest.mark.parametrize("family,options", CASES,
                         ids=[f + ("-" + "-".join(map(str, o.values())) if o else "")
                              for f, o in CASES])
def test_zoo_gradients_match_torch_at_2_and_4_threads(family, options):
    model = build_model(family, **options)
    feeds = make_feeds(model, seed=0)
    labels = make_labels(model, seed=0)
    ref_loss, ref_grads = torch_loss_and_grads(model, feeds, labels=labels, double=True)

    step = build_training_step(load_graph(model), BuildOptions(optimizer="none"))
    for threads, out in run_at_threads(step, {**feeds, "labels": labels}).items():
        _assert_matches(f"{family} at {threads} threads", out, ref_loss, ref_grads)


def _assert_matches(where: str, out: dict[str, np.ndarray], ref_loss: float,
                    ref_grads: dict[str, np.ndarray]) -> None:
    assert abs(float(out["loss"]) - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss)), where
    grads = {k[: -len(".grad")]: v for k, v in out.items() if k.endswith(".grad")}
    assert set(grads) == set(ref_grads), (where, set(grads) ^ set(ref_grads))
    # Relative error per tensor, against the tensor's own scale, floored at 1e-3 of the largest
    # gradient of the model: a bias before BatchNorm has a true gradient of 0, and both sides
    # then hold float32 rounding noise (~1e-7) that a pure relative error would call 100%.
    floor = 1e-3 * max(float(np.abs(g).max()) for g in ref_grads.values())
    for name, g in grads.items():
        ref = ref_grads[name]
        scale = max(float(np.abs(ref).max()), floor)
        err = float(np.abs(g.astype(np.float64) - ref).max()) / scale
        assert err <= 1e-3, f"{where}: {name}: relative error {err:.2e} > 1e-3"
    assert all(np.isfinite(g).all() for g in grads.values()), where
