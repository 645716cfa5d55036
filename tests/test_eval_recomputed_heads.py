"""``memcc export --eval`` of a plan whose forward output is computed by recomputed clones.

A head off the loss path (Inception's and GoogLeNet's auxiliary classifiers) has no
backward, so the step may run its nodes after the backward, and a plan that recomputes
values they read gives them clones (``passes/lowering/recompute.py``). A recomputed
training BatchNorm's clone reads copies of the running statistics (``x * 1``, so that ORT's
kernel does not write into a buffer another BatchNorm reads); eval mode must find the
statistics behind them, or the exported head keeps normalising by the batch (a walk-through:
torchvision's Inception v3, 114% off on ``aux``).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from memcc import api
from memcc.frontend.build import BuildOptions
from memcc.frontend.load import load_graph
from memcc.graph import ancestors
from memcc.passes.lowering.recompute import apply_recompute
from memcc.passes.plan import Plan, StepStructure
from memcc.step import TrainingStep
from memcc.trainer.eval_mode import in_eval_mode, train_mode_nodes


def _cbr(cin: int, cout: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                               torch.nn.BatchNorm2d(cout), torch.nn.ReLU())


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.body = _cbr(3, 8), _cbr(8, 16)
        self.head = torch.nn.Linear(16, 5)
        self.aux = torch.nn.Sequential(_cbr(8, 8), torch.nn.AdaptiveAvgPool2d(1),
                                       torch.nn.Flatten(), torch.nn.Linear(8, 5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.stem(x)
        return self.head(self.body(h).mean((2, 3))), self.aux(h)


def test_a_head_computed_by_recomputed_batchnorms_reads_the_running_statistics(tmp_path):
    torch.manual_seed(0)
    module = _TwoHeads().train()
    for bn in (m for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 3, 16, 16)
    torch.onnx.export(module, (x,), tmp_path / "m.onnx", dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      opset_version=17, input_names=["x"], output_names=["logits", "aux"])
    api.build(tmp_path / "m.onnx", tmp_path / "s.onnx",
              options=BuildOptions(optimizer="sgd", lr=0.1))
    graph = load_graph(tmp_path / "s.onnx")
    # The aux head after the backward, as the step may run it, and its convolution and
    # BatchNorm recomputed there.
    producer = graph.def_use().producer
    trunk = {id(n) for n in ancestors(["loss"], producer)[0]}
    late = [n for n in ancestors(["aux"], producer)[0] if id(n) not in trunk]
    moved = {id(n) for n in late}
    graph.set_nodes([n for n in graph.nodes if id(n) not in moved]
                    + [n for n in graph.nodes if id(n) in moved])
    structure = StepStructure.of(graph)
    again = {n.name for n in late if n.op_type in ("Conv", "BatchNormalization")}
    assert len(again & structure.recomputable) == 2
    plan = apply_recompute(graph, Plan(frozenset(again)), structure).graph
    reached = ancestors(["aux"], plan.def_use().producer)[0]
    assert any(n.op_type == "BatchNormalization" and n.name.endswith(".rc") for n in reached)
    # stem, body, and the aux head's clone (which the head reads instead of its original)
    assert train_mode_nodes(plan, ["logits", "aux"])[0] == 3

    made = in_eval_mode(plan, TrainingStep.of(plan), ["logits", "aux"])
    assert made.batchnorms == 3
    assert train_mode_nodes(made.graph, ["logits", "aux"]) == (0, 0)

    # The exported head computes torch's eval mode (the statistics as the file holds them).
    kept = {id(n) for n in ancestors(["logits", "aux"], made.graph.def_use().producer)[0]}
    forward = made.graph.copy(with_index=False)
    forward.set_nodes([n for n in made.graph.nodes if id(n) in kept])
    forward.outputs[:] = ["logits", "aux"]
    used = {i for n in forward.nodes for i in n.input}
    forward.inputs[:] = [i for i in forward.inputs if i in used]
    for name in [i for i in forward.initializers if i not in used]:
        del forward.initializers[name]
    sess = ort.InferenceSession(forward.to_model().SerializeToString(),
                                providers=["CPUExecutionProvider"])
    got = sess.run(["aux"], {"x": x.numpy()})[0]
    with torch.no_grad():
        want = module.eval()(x)[1].numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
