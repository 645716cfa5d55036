"""benchmarks/dropout_cuda_check.py is for a GPU machine; its code path runs here on the CPU
provider at a tiny size, and without CUDA it must stop cleanly."""

from __future__ import annotations

import json

from benchmarks import dropout_cuda_check


def test_the_script_checks_resume_masks_and_timing_on_cpu(capsys):
    rc = dropout_cuda_check.main(["--provider", "cpu", "--model",
                                  "gpt2:batch=2,seq_len=8,vocab_size=64,width=16,depth=1,heads=2",
                                  "--steps", "4", "--time-steps", "1", "--repeats", "2",
                                  "--threads", "1"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert out["identical"] is True and out["max_abs_diff"] == 0.0 and out["counter"] == 4
    assert out["masks_match_reference"] is True and out["generator_on_provider"] is True
    assert out["ms_per_step"] > 0 and out["ms_per_step_ort_dropout"] > 0
    assert out["peak_bytes"] > 0 and out["peak_bytes_ort_dropout"] > 0


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    import memcc.backend.session as session

    monkeypatch.setattr(session, "cuda_unavailable_reason", lambda: "no GPU in this test")
    assert dropout_cuda_check.main([]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["provider"] == "cuda" and "no GPU in this test" in out["error"]
