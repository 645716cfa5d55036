"""benchmarks/cuda_check.py is what a session with a GPU runs; no session has had one, so
its code path is run here on the CPU provider at tiny sizes (no swap on CPU)."""

from __future__ import annotations

import json

import pytest

from benchmarks import cuda_check


def test_the_gpu_script_runs_every_phase_and_writes_its_summary(tmp_path):
    out = tmp_path / "out"
    rc = cuda_check.main(["--provider", "cpu", "--small", "--out", str(out),
                          "--phases", "env", "truth", "overlap", "plans", "--models", "mlp",
                          "--plan-models", "gpt2", "--fractions", "0.6", "--rounds", "1",
                          "--steps", "2", "--time-limit", "5"])  # the code path, not the plan
    assert rc == 0
    data = json.loads((out / "summary.json").read_text())
    assert data["env"][0]["provider"] == "cpu" and data["env"][0]["onnxruntime"]
    truth = data["truth"][0]
    assert "error" not in truth, truth
    assert truth["measured_bytes"] > 0 and 0.8 <= truth["measured_over_predicted"] <= 1.25
    plan = data["plans"][0]
    assert "error" not in plan, plan
    assert plan["verified"] is True and plan["offload"] is False
    assert plan["plan_bytes"] <= 0.6 * plan["baseline_bytes"]
    assert plan["step_time_ratio"] > 0 and len(plan["ratio_spread"]) == 2
    overlap = data["overlap"][0]
    assert "error" not in overlap, overlap
    assert overlap["compute_s"] > 0 and overlap["copy_s"] > 0 and overlap["both_s"] > 0
    md = (out / "summary.md").read_text()
    assert "## truth" in md and "## plans" in md


def test_cuda_sessions_fix_the_cudnn_algorithm_search(monkeypatch):
    """ORT's default search (EXHAUSTIVE) asked for workspaces no plan can know (614 MiB on
    VGG-16, measured on an H100); memcc asks for HEURISTIC unless told otherwise."""
    from memcc.backend.session import CUDNN_SEARCH_ENV, provider_options
    from memcc.errors import InputError

    monkeypatch.delenv(CUDNN_SEARCH_ENV, raising=False)
    (_, cuda), _ = provider_options("cuda")
    assert cuda["cudnn_conv_algo_search"] == "HEURISTIC"
    assert cuda["arena_extend_strategy"] == "kSameAsRequested"
    monkeypatch.setenv(CUDNN_SEARCH_ENV, "default")
    (_, cuda), _ = provider_options("cuda")
    assert cuda["cudnn_conv_algo_search"] == "DEFAULT"
    monkeypatch.setenv(CUDNN_SEARCH_ENV, "fastest")
    with pytest.raises(InputError, match=CUDNN_SEARCH_ENV):
        provider_options("cuda")


def test_repredict_sets_recorded_nvml_figures_against_todays_model(tmp_path):
    """``benchmarks/cuda_repredict.py`` rebuilds each recorded step and predicts it with
    today's CUDA model (device pages included), so the model can be checked against the
    H100's figures without a GPU."""
    from benchmarks.cuda_repredict import repredict

    dims = cuda_check.SMALL["mlp"]
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"truth": [
        {"model": "mlp", "dims": dims, "predicted_bytes": 1_000_000,
         "measured_bytes": 4 << 20},
        {"model": "resnet18", "error": "not measured"}]}))
    (row,) = repredict([summary])
    assert row["model"] == "mlp" and row["then"] == (4 << 20) / 1_000_000
    assert row["predicted_now"] % (2 << 20) == 0  # whole device pages
    assert row["now"] == (4 << 20) / row["predicted_now"]


def test_arena_log_reads_ort_s_regions_and_sets_them_against_the_replay(tmp_path):
    """The ``arena_log`` phase (how the tenth session found the page rule and the stream
    tags on an H100) runs here through ORT's CPU arena, the same class: on the small MLP the
    regions ORT's log shows the last run adding are exactly the replay's."""
    log = ("... Extending BFCArena for Cuda. bin_num:11 (requested) num_bytes: 786400 "
           "(actual) rounded_bytes:786432\n"
           "... Cuda BFC Arena shrunk by 786432 bytes.\n"
           "... Extending BFCArena for Cuda. bin_num:0 (requested) num_bytes: 4 (actual) "
           "rounded_bytes:256\n"
           "... Extending BFCArena for Cuda. bin_num:0 (requested) num_bytes: 8 (actual) "
           "rounded_bytes:256\n")
    assert cuda_check.ort_arena_runs(log) == [[786432], [256, 256]]
    cuda_check.main(["--provider", "cpu", "--small", "--out", str(tmp_path),
                     "--phases", "arena_log", "--models", "mlp"])
    (row,) = json.loads((tmp_path / "summary.json").read_text())["arena_log"]
    assert "error" not in row, row
    # two warm-up runs through the CPU arena (one on CUDA) and three measured ones
    assert len(row["ort_regions_per_run"]) == 5
    assert row["ort_regions_per_run"][-1] == row["replay_regions_last_run"] > 0
    assert row["in_ort_not_replay"] == [] and row["in_replay_not_ort"] == []


def test_the_page_rule_holds_on_the_arena_log_kept_from_the_h100(tmp_path):
    """The regions ORT's arena added in one MLP step on the H100 (kept, with NVML's reading
    of that step, in benchmarks/cuda_h100/), counted by memcc's page rule, are what NVML
    saw: within 0.6%, and every region over 1 MiB on a 2 MiB boundary."""
    import shutil

    from benchmarks.cuda_repredict import ROOT, from_logs

    kept = ROOT / "benchmarks" / "cuda_h100" / "arena_log_exhaustive"
    for name in ("mlp.log.gz", "summary.json"):
        shutil.copy(kept / name, tmp_path / name)
    (row,) = from_logs(tmp_path)
    assert row["large_regions_on_2mib_boundary"] == "100/100"
    assert 0.994 <= row["nvml_over_pages"] <= 1.006
    assert row["ort_regions_per_run"] == [59] * 4
