"""tune's cheap tiers judge a fit as compile does: the plan's peak and the heap room of the
small buffers it adds (``Simulation.fit_bytes``).

First-use audit, session 36: ``memcc tune`` of a transformers ViT (dynamo export, dynamic
batch) at ``--budget 8MB`` stopped with "batch=79 fitted but the plan at the budget was
refused; please report this": the sqrt(n) tier had called 79 a fit by its plan's peak, and
compile, counting that plan's heap room, refused every plan."""

from __future__ import annotations

from types import SimpleNamespace

from memcc.tune.options import TuneOptions, parse_range
from memcc.tune.probe import SizeProbe, SizeSearch
from memcc.tune.search import _candidate


def _search(probe: SizeProbe, budget: int) -> SizeSearch:
    search = SizeSearch(None, "m.onnx", parse_range("batch=1..8"), TuneOptions(), budget,
                        lambda _m: None)
    search.probes[probe.batch] = probe
    return search


def _probe(**kw) -> SizeProbe:
    return SizeProbe(batch=4, graph=None, costs=None, structure=None,
                     baseline=SimpleNamespace(peak_bytes=2_000, compute_cost_s=1.0),
                     floor_bytes=100, lr=None, **kw)


def test_a_sqrtn_plan_whose_heap_room_overflows_the_budget_settles_nothing():
    search = _search(_probe(sqrtn_peak=900, sqrtn_fit=1_100), 1_000)
    assert search.cheap_fits(4) == (None, "")
    row = _candidate(search, search.probes[4], largest=2)
    assert row.decided_by != "sqrtn" and not row.fits


def test_a_sqrtn_plan_that_fits_with_its_heap_room_is_a_fit():
    search = _search(_probe(sqrtn_peak=900, sqrtn_fit=950), 1_000)
    assert search.cheap_fits(4) == (True, "sqrtn")


def test_the_smallest_peak_fits_only_with_its_heap_room():
    assert not _probe(smallest=900, smallest_fit=1_100).smallest_fits(1_000)
    assert _probe(smallest=900, smallest_fit=1_000).smallest_fits(1_000)
    search = _search(_probe(smallest=900, smallest_fit=1_100), 1_000)
    assert search.cheap_fits(4) == (False, "min-search")
