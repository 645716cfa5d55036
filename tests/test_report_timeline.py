"""The report's timeline: step phases, plan-to-baseline alignment, and the plot drawn from them.

The plot is only worth reading if the same x is the same point of the step for the baseline
and the plan, and if it shows the line the planner really aimed for (the planning target),
not only the budget.
"""

from __future__ import annotations

import json
import re

import pytest

from memcc.compiler import CompileOptions, compile_model
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.analysis.phases import plan_origin, step_phases
from memcc.passes.plan import StepStructure
from memcc.report_view import aligned_x, plot_timeline, timeline_figure
from models import build_model


@pytest.fixture(scope="module")
def compiled():
    """A GPT-2 step planned well below its baseline peak, so the plan recomputes."""
    model = build_model("gpt2", batch=8, seq_len=128)
    base = compile_model(model, CompileOptions(budget="1TB", cost="analytic")).report
    budget = (base["baseline"]["peak_bytes"] * 3) // 4
    result = compile_model(model, CompileOptions(budget=str(budget), cost="analytic",
                                                 time_limit=10))
    return result, json.loads(json.dumps(result.report))  # as written to disk


@pytest.mark.parametrize("name,optimizer", [("gpt2", "sgd"), ("gpt2", "adamw"),
                                            ("gpt2", "none"), ("resnet18", "sgd")])
def test_phases_are_forward_then_backward_then_update(name, optimizer):
    step = build_training_step(load_graph(build_model(name)), BuildOptions(optimizer=optimizer))
    phases = step_phases(step)
    assert len(phases) == len(step.nodes)
    st = StepStructure.of(step)
    forward = [i for i, n in enumerate(step.nodes) if n.name in st.forward]
    assert phases.rindex("F") == forward[-1]  # the forward phase ends with the loss...
    for n in step.nodes[:forward[-1]]:  # ...and holds only forward nodes and
        if n.name not in st.forward:  # the gradient builder's helpers placed in it
            assert all(o.startswith("grad/") for o in n.output), n.name
    if name == "resnet18":  # MaxPool's indices are cast inside the forward pass
        assert len(forward) < phases.count("F")
    # memcc builds forward, backward, update in that order: one run of each.
    runs = re.findall(r"F+|B+|U+", phases)
    assert [r[0] for r in runs] == (["F", "B"] if optimizer == "none" else ["F", "B", "U"])
    produced_by = {o: (phases[i], n.name in st.forward)
                   for i, n in enumerate(step.nodes) for o in n.output}
    state = json.loads(step.metadata["memcc.state"])
    assert produced_by[step.metadata["memcc.loss"]] == ("F", True)
    updated = 0
    for out in step.outputs[1:]:  # the updated state, or the gradients themselves
        phase, in_forward = produced_by[out]
        if in_forward:  # BatchNorm's running statistics come out of the forward node
            assert out in state and phase == "F"
            continue
        assert phase == ("B" if optimizer == "none" else "U"), out
        assert optimizer == "none" or out in state
        updated += 1
    assert updated >= len(json.loads(step.metadata["memcc.parameters"]))


def test_plan_origin_lines_up_every_original_node(compiled):
    result, report = compiled
    base_graph, plan_graph = result.outcome.baseline.graph, result.outcome.best.graph
    tl = report["timeline"]
    origin = tl["plan_origin"]
    assert origin == plan_origin(base_graph, plan_graph)
    assert len(tl["phases"]) == len(tl["baseline"]) == len(base_graph.nodes)
    assert len(origin) == len(tl["plan"]) == len(plan_graph.nodes)
    kept = [o for o in origin if o >= 0]
    assert kept == sorted(set(kept))  # original nodes keep their order
    clones = [i for i, o in enumerate(origin) if o < 0]
    assert len(clones) == len(result.outcome.best.cloned_nodes) > 0
    for i in clones:  # every clone runs in the backward pass, just before an original node
        nxt = next(o for o in origin[i:] if o >= 0)
        assert tl["phases"][nxt] == "B"
        assert plan_graph.nodes[i].name not in {n.name for n in base_graph.nodes}
    # The same node has the same name in both: same point of the step.
    for i, o in enumerate(origin):
        if o >= 0:
            assert plan_graph.nodes[i].name == base_graph.nodes[o].name


def test_aligned_x_spreads_clones_between_their_neighbours():
    assert aligned_x([0, 1, 2]) == [0.0, 1.0, 2.0]
    xs = aligned_x([0, 1, -1, -1, 2, 4])
    assert xs[:2] == [0.0, 1.0] and xs[4:] == [2.0, 4.0]
    assert xs[2] == pytest.approx(4 / 3) and xs[3] == pytest.approx(5 / 3)
    assert aligned_x([-1, 0]) == [-0.25, 0.0]
    assert aligned_x([0, -1]) == [0.0, 0.5]


def _line(ax, prefix: str):
    lines = [ln for ln in ax.get_lines() if ln.get_label().startswith(prefix)]
    assert len(lines) == 1, [ln.get_label() for ln in ax.get_lines()]
    return lines[0]


def test_plot_aligns_plan_with_baseline_and_draws_budget_and_target(compiled, tmp_path):
    import matplotlib.pyplot as plt

    _, report = compiled
    tl = report["timeline"]
    fig = timeline_figure(report)
    try:
        ax = fig.axes[0]
        base, plan = _line(ax, "baseline"), _line(ax, "plan (")
        bx, px = list(base.get_xdata()), list(plan.get_xdata())
        for i, o in enumerate(tl["plan_origin"]):
            if o >= 0:
                assert px[i] == bx[o]  # the same node at the same x
        clones = _line(ax, "plan: recomputed")
        assert len(clones.get_xdata()) == tl["plan_origin"].count(-1)

        mb = 1e6
        budget, target = _line(ax, "budget"), _line(ax, "planning target")
        assert budget.get_ydata()[0] == pytest.approx(report["budget_bytes"] / mb)
        assert target.get_ydata()[0] == pytest.approx(report["planning_budget_bytes"] / mb)
        expected = report["budget_bytes"] * (1 - report["margin"]) - report["slack_bytes"]
        assert report["planning_budget_bytes"] == pytest.approx(expected, abs=1)
        assert report["plan"]["peak_bytes"] <= report["planning_budget_bytes"]

        # The step runs as memcc train runs it: each update just after its gradient, so
        # the updates interleave with the backward pass and a stretch after it may be empty.
        assert [t.get_text() for t in ax.texts][:2] == ["forward", "backward"]
        assert set(t.get_text() for t in ax.texts) <= {"forward", "backward", "update"}
        assert "as built" in ax.get_xlabel()
        assert ax.get_legend() is not None
    finally:
        plt.close(fig)
    png = plot_timeline(report, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_plot_of_a_report_without_alignment_still_draws_and_says_so(compiled):
    import matplotlib.pyplot as plt

    _, report = compiled
    old = json.loads(json.dumps(report))
    del old["timeline"]["plan_origin"], old["timeline"]["phases"]
    fig = timeline_figure(old)
    try:
        ax = fig.axes[0]
        assert list(_line(ax, "plan (").get_xdata()) == list(range(len(old["timeline"]["plan"])))
        assert "not aligned" in ax.get_xlabel() and not ax.texts
    finally:
        plt.close(fig)


def test_plot_speaks_one_unit_in_axes_and_legends(compiled):
    """The axes are in MB (10^6 bytes); a legend in MiB beside them (the planning target's
    slack once read '1 MiB') made the two disagree (issue 35, item 11)."""
    import matplotlib.pyplot as plt

    from memcc.sizes import format_size

    _, report = compiled
    fig = timeline_figure(report)
    try:
        ax, bx = fig.axes[:2]
        assert "MB" in ax.get_ylabel() and "MB" in bx.get_ylabel()
        labels = [t.get_text() for a in (ax, bx) for t in a.get_legend().get_texts()]
        labels += [a.get_ylabel() for a in (ax, bx)] + [a.get_title() for a in (ax, bx)]
        assert not [s for s in labels if re.search(r"\b[KMGT]iB\b", s)], labels
        target = _line(ax, "planning target").get_label()
        assert target.endswith(f"- {format_size(report['slack_bytes'])}"), target
    finally:
        plt.close(fig)
