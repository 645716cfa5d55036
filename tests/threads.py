"""Run a training step at several intra-op thread counts and demand the same bits each time.

ORT's CPU kernels split work across intra-op threads; a kernel whose threads accumulate into
shared memory without order (ScatterND with reduction='add' did, for every embedding
gradient) gives a different answer on every run. One run cannot see that: each thread count
here runs twice, in fresh sessions, and the two runs must agree bit for bit. The outputs of
every thread count are returned, so a test can also hold each of them against torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from memcc.backend.runner import session_graph
from memcc.backend.session import SessionSettings, make_session
from memcc.graph import Graph

THREADS = (2, 4)
REPEATS = 2


def run_once(graph: Graph, feeds: Mapping[str, np.ndarray], threads: int
             ) -> dict[str, np.ndarray]:
    """One run of every output of ``graph`` in a fresh CPU session with ``threads`` threads."""
    g, values = session_graph(graph)
    sess = make_session(g.to_model(), "cpu", SessionSettings(intra_op_threads=threads))
    names = list(graph.outputs)
    return dict(zip(names, sess.run(names, {**values, **feeds}), strict=True))


def mismatches(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> list[str]:
    """Outputs that are not bit-identical, with the largest difference of each."""
    bad = []
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or not np.array_equal(x, y, equal_nan=True):
            diff = (float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
                    if x.shape == y.shape else float("nan"))
            bad.append(f"{name} (max abs diff {diff:.3g})")
    return bad


def run_at_threads(graph: Graph, feeds: Mapping[str, np.ndarray],
                   threads: Sequence[int] = THREADS, repeats: int = REPEATS
                   ) -> dict[int, dict[str, np.ndarray]]:
    """Outputs per thread count; fails unless the ``repeats`` runs of each count agree."""
    results: dict[int, dict[str, np.ndarray]] = {}
    for n in threads:
        first = run_once(graph, feeds, n)
        for k in range(1, repeats):
            bad = mismatches(first, run_once(graph, feeds, n))
            assert not bad, (f"{n} intra-op threads, run {k + 1} differs from run 1 in "
                             f"{len(bad)} outputs: {bad[:5]}")
        results[n] = first
    return results


def assert_step_matches(reference: Graph, step: Graph, tolerance: float,
                        threads: Sequence[int] = (1, 2, 4)) -> None:
    """``step`` (a rewrite of ``reference`` with the same outputs: the loss, and per
    parameter its new value and momentum, which from the zero initial state is its
    gradient) within ``tolerance`` relative of ``reference`` at one thread, at each thread
    count, each run twice with the same bits. Outputs far below the largest are held
    to ``tolerance`` of 1e-5 of it (their relative error is rounding noise)."""
    from memcc.backend.runner import synthetic_feeds

    feeds = synthetic_feeds(reference, seed=0)
    ref = run_once(reference, feeds, 1)
    assert set(ref) <= set(step.outputs), sorted(set(ref) - set(step.outputs))
    top = max(float(np.abs(ref[k]).max()) for k in ref)
    for n, got in run_at_threads(step, feeds, threads=threads).items():
        for k in ref:
            scale = max(float(np.abs(ref[k]).max()), 1e-5 * top)
            err = float(np.abs(got[k].astype(np.float64) - ref[k]).max()) / scale
            assert err <= tolerance, (n, k, err)
