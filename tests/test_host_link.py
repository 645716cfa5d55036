"""The swap copies' link: measured through ORT's own copy ops (on CPU here, where ORT runs
them as memcpy: the code path, not a PCIe figure), fitted per direction, cached."""

from __future__ import annotations

import json

import pytest

import memcc.backend.host_link as host_link
from memcc.errors import RuntimeFailure
from memcc.passes.analysis.cost_model import PCIE_NOMINAL, HostLink


def test_the_link_is_measured_per_direction_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(host_link, "CACHE_DIR", tmp_path)
    # Sizes 512x apart and 5 runs each (the median kept): with 2 runs and 8x, a run
    # descheduled on a busy 2-core CI machine made 64 KB take longer than 8 MB.
    link = host_link.measure_host_link("cpu", runs=5, elements=(1 << 14, 1 << 19, 1 << 23))
    assert link.bytes_per_s > 1e7 and link.from_host_bytes_per_s > 1e7
    assert link.latency_s >= 0 and link.from_host_latency_s >= 0
    assert "measured on this machine (cpu" in link.source
    # A bigger copy takes longer, each way.
    assert link.seconds(1 << 24) > link.seconds(1 << 10)
    assert link.seconds(1 << 24, "MemcpyFromHost") > link.seconds(1 << 10, "MemcpyFromHost")
    cached = list(tmp_path.glob("host_link-cpu-*.json"))
    assert len(cached) == 1
    assert HostLink.from_json(json.loads(cached[0].read_text())) == link
    # The second call reads the cache instead of measuring.
    monkeypatch.setattr(host_link, "_probe_model", None)
    assert host_link.measure_host_link("cpu") == link


def test_directions_price_their_own_copies_and_a_round_trip_is_both():
    link = HostLink(1e9, 1e-5, "test", from_host_bytes_per_s=2e9, from_host_latency_s=2e-5)
    assert link.seconds(1e9, "MemcpyToHost") == pytest.approx(1.0 + 1e-5)
    assert link.seconds(1e9, "MemcpyFromHost") == pytest.approx(0.5 + 2e-5)
    assert link.round_trip(1e9) == pytest.approx(1.5 + 3e-5)
    # Measured one way only: the other direction uses the same figures.
    assert PCIE_NOMINAL.round_trip(2e10) == pytest.approx(2 * PCIE_NOMINAL.seconds(2e10))


def test_copy_times_that_do_not_grow_are_refused():
    with pytest.raises(RuntimeFailure, match="do not grow"):
        host_link._fit([(1000, 1e-3), (10_000, 1e-4)], "MemcpyToHost")


def test_a_link_faster_than_any_host_link_is_refused_and_compile_falls_back(tmp_path,
                                                                            monkeypatch):
    """On CUDA, ORT's profiler timed the copies' launch (3 TB/s on an H100, where the copies
    ran at about 2 GB/s): such a figure is refused, never cached, and compile prices the
    copies at the nominal rate with a warning."""
    import onnxruntime

    from memcc.compiler.costing import measured_link

    monkeypatch.setattr(host_link, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(host_link, "_fit", lambda points, source: (2e-5, 3.1e12))
    with pytest.raises(RuntimeFailure, match="launch"):
        host_link.measure_host_link("cpu", runs=1, elements=(1 << 10, 1 << 12))
    assert not list(tmp_path.glob("host_link-*.json"))
    # An impossible figure in the cache (an older memcc's) is measured again, not trusted.
    cache = tmp_path / (f"host_link-cpu-profile-{onnxruntime.__version__}-"
                        f"{host_link.LINK_VERSION}.json")
    cache.write_text(json.dumps(HostLink(3e12, 0.0, "old").to_json()))
    monkeypatch.setattr(host_link, "_fit", lambda points, source: (1e-5, 1e10))
    assert host_link.measure_host_link("cpu", runs=1, elements=(1 << 10, 1 << 12)
                                       ).bytes_per_s == 1e10

    def refuse(provider):
        raise RuntimeFailure("MemcpyToHost measured at 3,100 GB/s")

    warnings: list[str] = []
    monkeypatch.setattr(host_link, "measure_host_link", refuse)
    assert measured_link("cuda", warnings.append) == PCIE_NOMINAL
    assert warnings and "nominal PCIe rate" in warnings[0]


def test_on_cuda_the_link_is_timed_by_the_wall_clock(tmp_path, monkeypatch):
    """ORT's profiler times the CUDA copies' launch (3 TB/s on an H100), so CUDA's default
    is the wall clock: the probe with its copies against the probe without, half the
    difference to each direction. The arithmetic, with clock readings made up (no GPU)."""
    assert host_link.default_method("cuda") == "wall"
    assert host_link.default_method("cpu") == "profile"
    monkeypatch.setattr(host_link, "CACHE_DIR", tmp_path)

    def clock(sess, feeds):
        nbytes = 4 * feeds["x"].size
        copies = sess.get_modelmeta().graph_name == "host_link"
        return 0.002 + (2 * (1e-5 + nbytes / 5e9) if copies else 0.0)

    monkeypatch.setattr(host_link, "_wall_time", clock)
    link = host_link.measure_host_link("cpu", method="wall", runs=2,
                                       elements=(1 << 12, 1 << 14, 1 << 16))
    assert link.bytes_per_s == pytest.approx(5e9) and link.latency_s == pytest.approx(1e-5)
    assert link.from_host_bytes_per_s is None  # one figure for both directions
    assert "wall-clock" in link.source
    with pytest.raises(ValueError, match="profile or wall"):
        host_link.measure_host_link("cpu", method="guess", use_cache=False)
