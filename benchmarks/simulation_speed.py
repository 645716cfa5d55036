"""The planner's simulator, before and after a change to it: the same results bit for bit,
and seconds per simulation.

Run each subcommand once per memcc tree (``PYTHONPATH=<tree>``; the script imports memcc
from there), then compare:

    PYTHONPATH=/tmp/before python benchmarks/simulation_speed.py record unet before.pkl
    PYTHONPATH=.           python benchmarks/simulation_speed.py record unet after.pkl
    python benchmarks/simulation_speed.py compare before.pkl after.pkl
    PYTHONPATH=/tmp/before python benchmarks/simulation_speed.py replay before.pkl --repeats 2
    PYTHONPATH=.           python benchmarks/simulation_speed.py replay before.pkl --repeats 2

``record``: ``choose_plan(Budget.MIN, strategy="auto", time_limit=300, regions=False)`` on a
zoo step (tests/test_passes_planner.py's sizes; ``gpt2-wide``: width 256, depth 6, 8 x 256
tokens), keeping a fingerprint of every simulation it makes (plan, peak, added time, the
lowered graph's nodes in order, every liveness field, the passes' reports less their times)
and of the outcome, and the plans it judged. ``compare``: every field of two records.
``replay``: the plans of a record simulated again as the search did (one structure, one
``PlanningContext``'s variant memo where the tree has one), wall and CPU seconds each.
``fixed``: eight fixed plans (none, recompute everything, six seeded random recompute sets)
simulated, seconds each and their fingerprints (for steps whose search takes long).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # models/; memcc itself from PYTHONPATH

CASES = {"gpt2": ("gpt2", dict(batch=4, seq_len=64)),
         "resnet18": ("resnet18", dict(batch=16, resolution=96)),
         "unet": ("unet", dict(batch=2, resolution=64)),
         "mobilenetv2": ("mobilenetv2", dict(batch=4, resolution=64)),
         "gpt2-wide": ("gpt2", dict(batch=8, seq_len=256, width=256, depth=6))}


def _untimed(x):
    """``x`` without the entries that are times (they differ run to run)."""
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if not (k.endswith("_s") or "time" in k)}
    if isinstance(x, list | tuple):
        return [_untimed(v) for v in x]
    return x


def _norm(x):
    """A value compared field by field, sets sorted (their order follows string hashes)."""
    if isinstance(x, set | frozenset):
        return sorted(_norm(v) for v in x)
    if isinstance(x, dict):
        return sorted((k, _norm(v)) for k, v in _untimed(x).items())
    if isinstance(x, list | tuple):
        return [_norm(v) for v in x]
    if dataclasses.is_dataclass(x):
        return type(x).__name__, [(f.name, _norm(getattr(x, f.name)))
                                  for f in dataclasses.fields(x)]
    return x


def _graph_digest(g) -> str:
    h = hashlib.sha256()
    for n in g.nodes:
        h.update(n.SerializeToString(deterministic=True))
    h.update(repr((g.inputs, g.outputs, sorted(g.info.items()), sorted(g.metadata.items()),
                   sorted(g.initializers), g.opsets, g.name)).encode())
    return h.hexdigest()


def fingerprint(s) -> dict:
    """Every field of a ``Simulation`` (the lowered graph as a digest of its nodes in order)."""
    lv = s.liveness
    return dict(plan=repr(_norm(s.plan)), peak=s.peak_bytes, cost=s.compute_cost_s,
                added=s.added_time_s, cloned=s.cloned_nodes, rec=s.recomputed_values,
                rerun=s.rerun_before, heap=s.heap_room, graph=_graph_digest(s.graph),
                passes=[(p.name, repr(_untimed(p.summary)), p.changed) for p in s.passes],
                arena=repr(s.arena), device=repr(s.device),
                live=repr((lv.order, sorted(lv.values.items()), lv.start_bytes,
                           lv.live_during, lv.live_after, lv.scratch, lv.peak_bytes,
                           lv.peak_step, lv.live_at_peak, sorted(lv.breakdown.items()),
                           sorted(lv.category_bytes.items()), lv.host_peak_bytes)))


def _step(case: str):
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from memcc.passes.analysis.cost_model import DeviceRates, analytic_costs
    from models import build_model

    name, kw = CASES[case]
    g = build_training_step(load_graph(build_model(name, **kw)), BuildOptions())
    return g, analytic_costs(g, DeviceRates(5e10, 1e10, 5e-6, "fixed test rates"))


def record(case: str, out: str) -> None:
    import memcc.passes.planning.context as context
    import memcc.passes.planning.planner as planner
    from memcc.passes.plan import Plan
    from memcc.passes.planning.request import Budget, PlanRequest
    from memcc.passes.planning.simulate import simulate

    g, costs = _step(case)
    base = simulate(g, Plan(), costs)
    sims, calls, seconds = [], [], []

    def recorded(graph, plan, costs_, structure=None, rules=None, *rest):
        t0 = time.perf_counter()
        s = simulate(graph, plan, costs_, structure, rules, *rest)
        seconds.append(time.perf_counter() - t0)
        sims.append(fingerprint(s))
        calls.append((graph is g, plan, rules))
        return s

    context.simulate = planner.simulate = recorded
    t0 = time.perf_counter()
    res = planner.choose_plan(g, costs, PlanRequest(Budget.MIN, strategy="auto", time_limit=300,
                                                    regions=False), baseline=base)
    wall = time.perf_counter() - t0
    outcome = dict(best=fingerprint(res.best), baseline=fingerprint(res.baseline),
                   strategy=res.strategy, picked=res.picked, smallest=res.smallest_peak,
                   solver=repr(_untimed(res.solver)), runs=repr(_untimed(res.runs)),
                   candidates=repr(_untimed(res.candidates)))
    with open(out, "wb") as f:
        pickle.dump(dict(case=case, outcome=outcome, sims=sims, calls=calls), f)
    print(f"{case}: {len(g.nodes)} nodes, choose_plan {wall:.1f} s, {len(sims)} simulations, "
          f"{sum(seconds) / max(len(sims), 1):.4f} s each; peak {res.best.peak_bytes:,}, "
          f"picked {res.picked or res.strategy}")


def compare(a_path: str, b_path: str) -> int:
    a, b = (pickle.load(open(p, "rb")) for p in (a_path, b_path))
    bad = [f"outcome {k}" for k in a["outcome"] if a["outcome"][k] != b["outcome"].get(k)]
    if len(a["sims"]) != len(b["sims"]):
        bad.append(f"{len(a['sims'])} simulations against {len(b['sims'])}")
    for i, (x, y) in enumerate(zip(a["sims"], b["sims"], strict=False)):
        bad += [f"simulation {i}: {k}" for k in x if x[k] != y[k]]
    print("\n".join(bad[:20]) or f"identical: the outcome and {len(a['sims'])} simulations")
    return 1 if bad else 0


def replay(path: str, repeats: int) -> None:
    from memcc.passes.plan import StepStructure
    from memcc.passes.planning.simulate import simulate

    rec = pickle.load(open(path, "rb"))
    g, costs = _step(rec["case"])
    memo_kind = None
    if "memo" in inspect.signature(simulate).parameters:
        from memcc.passes.lowering.lower import VariantMemo as memo_kind
    for _ in range(repeats):
        st, memo = StepStructure.of(g), memo_kind() if memo_kind else None
        extra = {"memo": memo} if memo_kind else {}
        calls = [(plan, rules) for own, plan, rules in rec["calls"] if own]
        t0, c0 = time.perf_counter(), time.process_time()
        for plan, rules in calls:
            simulate(g, plan, costs, st, rules, **extra)
        n = max(len(calls), 1)
        print(f"{rec['case']}: {len(calls)} simulations, {(time.perf_counter() - t0) / n:.4f} s "
              f"wall, {(time.process_time() - c0) / n:.4f} s CPU each")


def fixed(case: str, out: str, repeats: int) -> None:
    import random

    from memcc.passes.plan import Plan, StepStructure, nothing_saveable
    from memcc.passes.planning.simulate import simulate

    g, costs = _step(case)
    st = StepStructure.of(g)
    rng, rc = random.Random(7), sorted(st.recomputable)
    plans = [Plan(), nothing_saveable(st)] + [
        Plan(frozenset(rng.sample(rc, len(rc) // k)), "random") for k in (2, 3, 4, 5, 6, 8)]
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        sims = [simulate(g, p, costs, st) for p in plans]
        print(f"{case}: {len(g.nodes)} nodes, {len(plans)} plans, "
              f"{(time.perf_counter() - t0) / len(plans):.4f} s wall, "
              f"{(time.process_time() - c0) / len(plans):.4f} s CPU each")
    with open(out, "wb") as f:
        pickle.dump(dict(case=case, outcome={}, sims=[fingerprint(s) for s in sims],
                         calls=[]), f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("case", choices=sorted(CASES))
    r.add_argument("out")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    p = sub.add_parser("replay")
    p.add_argument("record")
    p.add_argument("--repeats", type=int, default=2)
    f = sub.add_parser("fixed")
    f.add_argument("case", choices=sorted(CASES))
    f.add_argument("out")
    f.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.case, args.out)
    elif args.cmd == "fixed":
        fixed(args.case, args.out, args.repeats)
    elif args.cmd == "replay":
        replay(args.record, args.repeats)
    else:
        return compare(args.a, args.b)
    return 0


if __name__ == "__main__":
    sys.exit(main())
