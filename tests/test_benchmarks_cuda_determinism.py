"""benchmarks/cuda_determinism.py is what the lead runs on a GPU; its code path runs here on
the CPU provider at tiny sizes, where every kernel is deterministic: every configuration must
come out bit-identical, and the rewrite within the pass's tolerance of the step as built."""

from __future__ import annotations

import json

from benchmarks import cuda_determinism


def test_cpu_mode_writes_every_configuration(tmp_path):
    out = tmp_path / "out"
    rc = cuda_determinism.main(["--out", str(out), "--provider", "cpu", "--small",
                                "--models", "gpt2,resnet18", "--runs", "2"])
    assert rc == 0
    data = json.loads((out / "summary.json").read_text())
    assert data["provider"] == "cpu" and data["onnxruntime"]
    for name, kind in (("gpt2", "rows"), ("resnet18", "MaxPool phases")):
        row = data["models"][name]
        assert row["skipped"] == []
        assert len(row["rewrite"]["rewritten"]) == 1 and kind in row["rewrite"]["rewritten"][0]
        assert set(row["configs"]) == {cuda_determinism.config_name(d, r)
                                       for d, r in cuda_determinism.CONFIGS}
        for key, res in row["configs"].items():
            assert "error" not in res, (name, key, res)
            assert res["bit_identical"] and res["loss_identical"], (name, key)
            assert res["differing_outputs"] == {} and res["ms_median"] > 0
            ops = res["profile"]["by_op_type"]
            assert res["profile"]["nodes_on_other_provider"] == {}
            assert ("TopK" in ops) == (name == "gpt2" and "rewrite=on" in key), key
            if "rewrite=on" in key:
                assert res["vs_rewrite_off"]["max_relative"] <= 1e-5, (name, key)
        assert "ScatterElements" in row["deterministic_cost_by_op_ms"]
        assert row["reductions_rewritten"] > 0 and row["reductions_left"] == []
    emb = data["embedding_gradient"]
    assert emb["scatter"]["bit_identical"] and emb["rewritten"]["bit_identical"]
    assert "rows" in emb["rewrite"]["rewritten"][0]
    assert set(data["reductions"]) == set(cuda_determinism.REDUCTIONS)
    for name, row in data["reductions"].items():
        for key in ("deterministic=on", "deterministic=off"):
            assert row[key]["bit_identical"] and row[key]["ms_median"] > 0, (name, key)


def test_unknown_model_is_refused(capsys, tmp_path):
    assert cuda_determinism.main(["--out", str(tmp_path), "--models", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists()
