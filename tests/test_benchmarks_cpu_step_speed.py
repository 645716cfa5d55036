"""benchmarks/cpu_step_speed.py at its tiniest: every side timed and measured, every field
written, the four sides running the same step (issue 30's CPU target)."""

from __future__ import annotations

import json

import pytest

from benchmarks import cpu_step_speed as bench

ROW_FIELDS = {"model", "family", "sizes", "export", "notes", "nodes", "memcc_kernels",
              "ort_all_nodes", "state_bytes", "times", "ratios", "first_loss", "settings",
              "versions", "peaks", "peak_ratio", "peak_ratio_arena", "rounds", "threads"}
TIME_FIELDS = {"median_s", "q25_s", "q75_s", "times_s"}
RATIO_FIELDS = {"ratio", "low", "high", "confidence", "rounds", "a_median_s", "b_median_s",
                "verdict"}
PEAK_FIELDS = {"peak_bytes", "first_step_bytes", "peaks", "held_between_steps_bytes",
               "method"}


def test_every_side_is_timed_and_measured_on_the_same_step(tmp_path, capsys):
    out = tmp_path / "speed.json"
    rc = bench.main(["--tiny", "--models", "gpt2", "--rounds", "1", "--warmup", "1",
                     "--peak-steps", "1", "--threads", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert data["failed"] == []
    assert set(row) == ROW_FIELDS
    assert row["model"] == "gpt2" and row["family"] == "transformer"
    assert row["sizes"] == bench.MODELS["gpt2"].tiny and row["threads"] == 1
    assert "dynamo" in row["export"] and "eval" in row["export"]
    assert row["nodes"] >= row["memcc_kernels"] > 0
    assert row["ort_all_nodes"] > 0
    assert set(row["times"]) == set(bench.SIDES)
    for side, t in row["times"].items():
        assert set(t) == TIME_FIELDS, side
        assert len(t["times_s"]) == 1 and t["median_s"] > 0 and all(x > 0 for x in t["times_s"])
    assert set(row["ratios"]) == {"memcc/ORT-ALL", "memcc-arena/ORT-ALL", "memcc/torch"}
    for name, r in row["ratios"].items():
        assert set(r) == RATIO_FIELDS, name
        assert r["ratio"] > 0 and r["rounds"] == 1
    # The ratios are of the sides' own times, not of some other pair.
    t = {s: v["median_s"] for s, v in row["times"].items()}
    assert row["ratios"]["memcc/torch"]["ratio"] == pytest.approx(t["memcc"] / t["torch"])
    assert set(row["peaks"]) == set(bench.MEASURED)
    for side, p in row["peaks"].items():
        assert PEAK_FIELDS <= set(p), side
        # State (parameters, momentum) and batch are in every figure, whichever side.
        assert p["peak_bytes"] > row["state_bytes"] > 0 and len(p["peaks"]) == 2
        assert p["first_step_bytes"] > row["state_bytes"]
        assert "VmHWM" in p["method"]
    assert row["peaks"]["memcc"]["predicted_peak_bytes"] > 0
    assert row["peak_ratio"] == pytest.approx(row["peaks"]["memcc"]["peak_bytes"]
                                              / row["peaks"]["ORT-ALL"]["peak_bytes"])
    # Same weights, same batch, same step: the first losses agree (ORT-ALL's fusions and
    # torch's kernels round differently; memcc's two allocators run the same kernels).
    loss = row["first_loss"]
    assert set(loss) == set(bench.SIDES)
    assert loss["memcc"] == loss["memcc-arena"]
    assert loss["ORT-ALL"] == pytest.approx(loss["memcc"], rel=1e-4)
    assert loss["torch"] == pytest.approx(loss["memcc"], rel=1e-4)
    assert "ORT_ENABLE_ALL" in row["settings"]["ORT-ALL"]
    assert "1 threads" in row["settings"]["torch"]
    assert "allocator malloc" in row["settings"]["memcc"]
    assert "allocator arena" in row["settings"]["memcc-arena"]
    assert any("ORT_ENABLE_ALL" in line for line in data["settings"])
    printed = capsys.readouterr().out
    assert "| gpt2 |" in printed and "memcc / ORT-ALL" in printed and "ORT-ALL nodes" in printed


def test_a_failing_model_is_reported_and_the_run_exits_1(tmp_path, monkeypatch, capsys):
    def broken(name, sizes, **kw):
        raise RuntimeError(f"{name} would not export")

    monkeypatch.setattr(bench, "measure", broken)
    out = tmp_path / "speed.json"
    assert bench.main(["--tiny", "--models", "vit,resnet", "--out", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["rows"] == []
    assert [f["model"] for f in data["failed"]] == ["vit", "resnet"]
    assert "RuntimeError: resnet would not export" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--models", "gpt3"], "unknown ['gpt3']"),
    (["--size", "gpt2:layers=3"], "gpt2 has no size ['layers']"),
    (["--size", "llama:batch=2"], "unknown model 'llama'"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_arguments_exit_2_naming_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
