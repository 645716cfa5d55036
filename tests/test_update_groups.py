"""The vector parameters' updates as one update of their concatenation
(memcc/frontend/update_groups.py).

The optimizer's arithmetic is element-wise, so the grouped step must give the same bits as
the step with an update per parameter, over several steps (the joined optimizer state
carried from step to step), at 1 and 2 intra-op threads; with fewer nodes; its new values
written in place; its parameters dealt to one rank together.
"""

from __future__ import annotations

import numpy as np
import pytest
from threads import run_once

from memcc.backend.runner import synthetic_feeds
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.frontend.update_groups import update_units
from memcc.graph import Graph
from memcc.passes.analysis.inplace import analyze_in_place
from memcc.passes.analysis.rank_step import assign_owners
from memcc.step import Role, TrainingStep
from models import build_model

MODELS = {"resnet18": ("sgd", dict(batch=4, resolution=32, width=8)),
          "gpt2": ("adamw", {})}


def _steps(model: str, **opts) -> tuple[Graph, Graph]:
    opt, dims = MODELS[model]
    fwd = load_graph(build_model(model, **dims))
    return tuple(build_training_step(fwd, BuildOptions(optimizer=opt, grouped_updates=g,
                                                       **opts))
                 for g in (False, True))


def _train(step: Graph, steps: int, threads: int) -> dict[str, np.ndarray]:
    """``steps`` steps, each fed the state the last one wrote; the last step's outputs."""
    spec = TrainingStep.of(step)
    feeds = {k: v for k, v in synthetic_feeds(step, 0).items() if k not in step.initializers}
    carried: dict[str, np.ndarray] = {}
    for _ in range(steps):
        g = step.copy()
        g.initializers.update(carried)
        out = run_once(g, feeds, threads)
        carried = {spec.state[o]: out[o] for o in spec.state}
    return out


def _joined_state(step: Graph, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The per-parameter optimizer state outputs of ``step``, joined as the grouped step
    joins them (the Concat of each group's parameters, in its order)."""
    joined = {}
    for node in step.nodes:
        if node.op_type == "Concat" and node.output[0].startswith("grouped."):
            for kind in ("momentum", "exp_avg", "exp_avg_sq"):
                parts = [f"{p}.{kind}.new" for p in node.input]
                if all(p in out for p in parts):
                    joined[f"{node.output[0]}.{kind}.new"] = parts
    return joined


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_grouped_step_trains_to_the_same_bits_in_fewer_nodes(model):
    apart, grouped = _steps(model)
    units = update_units(grouped, TrainingStep.of(grouped).state,
                         TrainingStep.of(grouped).parameters)
    vectors = max(units, key=len)
    assert len(vectors) > 5  # the biases and norm scales and shifts
    per_vector = 4 if model == "resnet18" else 11  # SGD momentum; AdamW
    assert len(grouped.nodes) <= len(apart.nodes) - (per_vector - 1) * len(vectors)
    joined = _joined_state(grouped, {o: None for o in apart.outputs})
    assert joined  # the grouped step's joined state, per kind
    for threads in (1, 2):
        want, got = _train(apart, 3, threads), _train(grouped, 3, threads)
        for name, value in got.items():
            expected = np.concatenate([want[p] for p in joined[name]]) \
                if name in joined else want[name]
            assert np.array_equal(expected, value), (threads, name)


def test_the_grouped_update_is_written_in_place():
    _, grouped = _steps("resnet18")
    spec = TrainingStep.of(grouped)
    result = analyze_in_place(grouped, spec.state)
    roles = spec.roles  # (the BatchNorm backwards' Splits of their own buffers are no update)
    split_outputs = {o for n in grouped.nodes if n.op_type == "Split"
                     and roles[n.name] is Role.UPDATE for o in n.output}
    assert split_outputs and split_outputs <= set(result.aliased)


def test_a_group_is_dealt_to_one_rank_and_zero2_takes_it():
    from memcc.dist.split import check_zero2

    _, grouped = _steps("resnet18")
    spec = TrainingStep.of(grouped)
    vectors = max(update_units(grouped, spec.state, spec.parameters), key=len)
    owner = assign_owners(spec.parameters, grouped, 3)
    assert len({owner[p] for p in vectors}) == 1
    assert len(set(owner.values())) == 3
    check_zero2(grouped, spec, "step")  # the group's update reads only its own gradients


def test_without_grouping_every_parameter_has_its_own_state():
    apart, _ = _steps("resnet18")
    spec = TrainingStep.of(apart)
    assert all(len(u) == 1 for u in update_units(apart, spec.state, spec.parameters))
    assert not any(n.startswith("grouped.") for n in apart.initializers)


def test_checkpoints_hold_the_state_per_parameter_and_resume_either_build(tmp_path):
    """A checkpoint stores a group's joined optimizer state as its parameters' (the names
    an update per parameter gives them), so a run resumes on a step built with or without
    grouped updates, to the same bits."""
    from memcc import Trainer
    from memcc.backend import checkpoint as ckpt
    from memcc.backend.onnx_file import save_graph

    apart, grouped = _steps("resnet18")
    paths = {k: save_graph(g, tmp_path / f"{k}.onnx")
             for k, g in (("apart", apart), ("grouped", grouped))}
    spec = TrainingStep.of(grouped)
    batch = {k: v for k, v in synthetic_feeds(grouped, 0).items() if k in spec.data_inputs}
    vectors = [p for p in spec.parameters if len(grouped.info[p].shape) == 1]
    for first, then in (("grouped", "apart"), ("apart", "grouped")):
        a = Trainer(paths[first], threads=1)
        for _ in range(2):
            a.step(batch)
        saved = a.save(tmp_path / f"ck-{first}")
        held = ckpt.load(saved).tensors
        assert not any(n.startswith("grouped.") for n in held)
        assert all(f"{p}.momentum" in held for p in vectors)
        b = Trainer(paths[then], threads=1)
        b.restore(saved)
        assert a.step(batch) == b.step(batch)
        want, got = a.parameters(), b.parameters()
        assert all(np.array_equal(want[p], got[p]) for p in want)


def test_the_cli_builds_either_and_says_which(tmp_path):
    from typer.testing import CliRunner

    from memcc.cli import app
    from memcc.frontend.load import load_graph as load

    model = tmp_path / "r.onnx"
    model.write_bytes(build_model("resnet18", batch=2, resolution=32, width=8)
                      .SerializeToString())
    said, splits = {}, {}
    for flag in ("--grouped-updates", "--no-grouped-updates"):
        out = tmp_path / f"{flag}.onnx"
        res = CliRunner().invoke(app, ["build", str(model), "-o", str(out), flag])
        assert res.exit_code == 0, res.output
        said[flag] = " ".join(res.output.split())
        step = load(out)
        roles = TrainingStep.of(step).roles
        splits[flag] = sum(n.op_type == "Split" and roles[n.name] is Role.UPDATE
                           for n in step.nodes)
    assert "41 vector parameters updated as 2 joined vectors" in said["--grouped-updates"]
    assert "joined" not in said["--no-grouped-updates"]
    assert splits == {"--grouped-updates": 2, "--no-grouped-updates": 0}


def test_a_split_that_reads_the_old_value_is_not_written_over_it():
    """In place only where the Split copies from another value: one that splits the old
    value itself would read what it overwrites."""
    import onnx
    from onnx import TensorProto, helper

    p = helper.make_tensor_value_info("p", TensorProto.FLOAT, [4])
    new = helper.make_tensor_value_info("p.new", TensorProto.FLOAT, [4])
    sizes = onnx.numpy_helper.from_array(np.array([4], np.int64), "sizes")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Split", ["p", "sizes"], ["p.new"], name="split", axis=0)],
        "g", [p], [new], [sizes]), opset_imports=[helper.make_opsetid("", 17)])
    result = analyze_in_place(Graph.from_model(model), {"p.new": "p"})
    assert result.aliased == {} and "reads the old value" in result.refused["p.new"]
