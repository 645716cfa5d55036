"""benchmarks/gpu_peers.py in its CPU mode: the same code the GPU run takes, on tiny models.

``--prepare --small --precision bf16`` exports both transformers models with zero weights
and builds their fp32 and bf16 steps; ``--steps-from ... --provider cpu`` runs every system
in a child of its own. What must hold on any machine: every row of a model starts from the
same weights (digests of what each system holds after loading; the bf16 rows too), memcc's
first loss equals PyTorch's (fp32 within 1e-3, bf16 against ``torch.autocast`` within
``BF16_TOLERANCE``), checkpointing really wraps the blocks, and each row has its memory and
times. On CPU memcc's bf16 step computes the ops ORT's CPU provider has no bf16 kernel for
in float32 between casts (``memcc.passes.providers.sixteen_bit``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

from benchmarks import gpu_peers as gp  # noqa: E402


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prepared")
    sizes = gp.prepare(directory, small=True, precisions=["bf16"])
    return directory, sizes


def test_seeded_values_depend_on_the_name_only() -> None:
    a = gp.seeded_value("m.h.0.attn.c_attn.weight", (4, 12), np.float32)
    np.testing.assert_array_equal(a, gp.seeded_value("m.h.0.attn.c_attn.weight", (4, 12),
                                                     "float32"))
    assert not np.array_equal(a, gp.seeded_value("m.h.1.attn.c_attn.weight", (4, 12),
                                                 np.float32))
    assert 0.005 < float(a.std()) < 0.05
    assert np.all(gp.seeded_value("m.ln_f.weight", (8,), np.float32) == 1)
    assert np.all(gp.seeded_value("m.bn.running_var", (8,), np.float32) == 1)
    for zero in ("m.fc.bias", "m.bn.running_mean", "m.fc.weight.momentum"):
        assert not np.any(gp.seeded_value(zero, (3, 2), np.float32))


def test_prepare_writes_small_compressed_steps(prepared) -> None:
    directory, sizes = prepared
    for model in gp.MODELS:
        meta = json.loads((directory / f"{model}.json").read_text())
        assert meta["small"] and meta["carried"] and meta["parameters"]
        # zero weights: the compressed step is a small fraction of the file
        assert sizes[model]["compressed_bytes"] < sizes[model]["step_bytes"] / 10
        assert set(meta["precisions"]) == {"fp32", "bf16"}
        for precision, built in meta["precisions"].items():
            assert (directory / built["file"]).is_file() and built["nodes"] > 0
            assert built["file"] == gp.step_file(model, precision)
        # the bf16 step is the fp32 one with casts added
        assert meta["precisions"]["bf16"]["nodes"] > meta["precisions"]["fp32"]["nodes"]
        # what each provider computes in float32 between casts, asked once, here
        assert set(meta["precisions"]["bf16"]["sixteen_bit_emulated"]) == {"cpu", "cuda"}
        assert meta["precisions"]["bf16"]["sixteen_bit_emulated"]["cpu"]
    gpt2 = json.loads((directory / "gpt2.json").read_text())
    assert "m.lm_head.weight" in gpt2["parameters"]  # the exporter keeps the tied copy
    assert "m.lm_head.weight.momentum" in gpt2["carried"]
    assert gpt2["carried"]["m.lm_head.weight"]["dtype"] == "float32"  # master weights


def test_a_step_that_carries_other_values_stops_prepare() -> None:
    fp32 = {"names": ({"w": {"shape": [2], "dtype": "float32"}}, ["w"])}
    other = {"names": ({"w": {"shape": [2], "dtype": "bfloat16"}}, ["w"])}
    gp._same_carried("gpt2", fp32, fp32, "fp32")
    with pytest.raises(RuntimeError, match=r"gpt2: the bf16 step carries other values.*w: "
                                           r"fp32 .*float32.*bf16 .*bfloat16"):
        gp._same_carried("gpt2", fp32, other, "bf16")


def test_a_listed_bf16_step_that_is_missing_exits_2(prepared, tmp_path, capsys) -> None:
    directory, _ = prepared
    copy = tmp_path / "steps"
    copy.mkdir()
    for f in ("gpt2.json", "gpt2.step.onnx.xz"):  # the bf16 step left behind
        (copy / f).write_bytes((directory / f).read_bytes())
    assert gp.main(["--steps-from", str(copy), "--out", str(tmp_path / "out"),
                    "--provider", "cpu", "--models", "gpt2"]) == 2
    assert "gpt2.bf16.step.onnx.xz" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cpu_run_measures_every_system_from_the_same_weights(prepared, tmp_path,
                                                              capsys) -> None:
    directory, _ = prepared
    out = tmp_path / "out"
    plan = directory / "gpt2.step.onnx.xz"  # any compiled step of the model will do
    assert gp.main(["--steps-from", str(directory), "--out", str(out), "--provider", "cpu",
                    "--warmup", "1", "--steps", "2", "--plan", f"gpt2={plan}@same"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["rows"]
    assert [r for r in rows if "error" in r or "skipped" in r] == []
    for model in gp.MODELS:
        mine = [r for r in rows if r["model"] == model]
        systems = [r["system"] for r in mine]
        # the bf16 pair right after memcc as built and eager
        assert systems[:4] == ["memcc-as-built", "torch-eager", "memcc-bf16",
                               "torch-autocast-bf16"]
        assert "torch-checkpoint" in systems
        check = summary["checks"][model]
        assert check["same_weights"], check
        assert check["first_loss_agrees_1e-3"], check
        # fp32's check leaves the bf16 rows out; theirs is against torch.autocast
        assert "memcc-bf16" not in check["first_loss_rel_diff_vs_memcc"]
        assert check["bf16"]["reference"] == "torch-autocast-bf16"
        assert check["bf16"]["tolerance"] == gp.BF16_TOLERANCE == 2e-2
        assert check["bf16"]["first_loss_agrees"] is True, check
        fp32_digest = mine[0]["weights_digest"]
        for r in mine[2:4]:  # master weights: the bf16 rows hold fp32's exact weights
            assert r["weights_digest"] == fp32_digest
            assert np.all(np.isfinite(r["losses"])) and r["losses"][-1] < r["losses"][0]
        bf16 = mine[2]["settings"]
        assert bf16["precision"] == gp.BF16_MEMCC and bf16["autocast"]["precision"] == "bf16"
        assert bf16["sixteen_bit_emulated_at_prepare"]  # CPU: some ops in float32 between casts
        assert mine[3]["settings"]["precision"].startswith("torch.autocast bfloat16")
        assert mine[0]["settings"]["precision"] == mine[1]["settings"]["precision"] == "fp32"
        assert set(summary["bf16_ratios"][model]) == {
            "memcc-bf16 / torch-autocast-bf16", "memcc bf16 / fp32", "torch bf16 / fp32"}
    for r in rows:
        assert len(r["losses"]) == 3 and len(r["times_s"]) == 2
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["memory"]["peak_bytes"] > 0 and "cpu-vmhwm" in r["memory"]["method"]
        if r["system"] == "torch-checkpoint":
            blocks = 2 if r["model"] == "gpt2" else 4
            assert r["settings"]["checkpoint"].startswith(f"per block ({blocks} blocks)")
    assert "memcc-plan@same" in summary["checks"]["gpt2"]["first_losses"]
    assert summary["complete"]
    torch_gpt2 = next(r for r in rows if r["model"] == "gpt2" and r["system"] == "torch-eager")
    assert torch_gpt2["settings"]["filled_from"]["m.transformer.wte.weight"] == \
        "m.lm_head.weight"
    ratio = summary["ratios"]["gpt2"]["memcc-as-built"]["torch-eager"]
    assert ratio["time"] > 0 and ratio["peak"] > 0
    table = capsys.readouterr().out
    assert "| gpt2 | torch-checkpoint |" in table and "memcc / PyTorch" in table
    assert "| gpt2 | memcc-bf16 |" in table and "| resnet50 | torch-autocast-bf16 |" in table
    assert "bf16 first loss agrees with torch-autocast-bf16 within 2e-02: True" in table


def test_time_limit_lists_the_rows_it_skipped(prepared, tmp_path) -> None:
    directory, _ = prepared
    summary = gp.run(directory, tmp_path, provider="cpu", models=["gpt2"], time_limit_s=0.0)
    assert summary["rows"] and all("skipped" in r for r in summary["rows"])
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == summary["rows"]


def test_missing_steps_exit_2_and_write_nothing(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert gp.main(["--steps-from", str(tmp_path / "none"), "--out", str(out),
                    "--provider", "cpu"]) == 2
    assert "--prepare" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("model", gp.MODELS)
def test_checkpointing_recomputes_every_block_in_the_backward(model: str) -> None:
    import torch

    meta = gp.SMALL[model]
    module = gp.make_module(meta)
    calls = []
    for block in gp.blocks_of(module, meta["kind"]):  # count each block's forward runs
        def counted(*args, _forward=block.forward, **kwargs):
            calls.append(1)
            return _forward(*args, **kwargs)

        block.forward = counted
    blocks = gp.enable_checkpointing(module, meta["kind"])
    x = torch.from_numpy(gp.make_batch(meta)[gp.DATA_INPUT[meta["kind"]]])
    module(x).float().square().mean().backward()
    # once in the forward, once more when the backward recomputes it
    assert blocks == len(gp.blocks_of(module, meta["kind"])) and len(calls) == 2 * blocks


def _row(system: str, median: float, peak: int, loss: float, **settings) -> dict:
    memory = {"peak_bytes": peak, "peak_steady_bytes": peak, "method": "cuda-nvml"}
    if system.startswith("torch"):
        memory |= {"torch_max_memory_reserved_bytes": peak // 2,
                   "torch_max_memory_allocated_bytes": peak // 3}
    return {"system": system, "model": "gpt2", "median_s": median, "min_s": median,
            "max_s": median, "iqr_s": 0.0, "first_step_s": 1.0, "losses": [loss],
            "memory": memory, "weights_digest": "d", "settings": settings}


def test_cuda_rows_ratios_and_table() -> None:
    """The parent's CUDA side without a GPU: rows, ratios, checks and the table."""
    rows = gp.systems_for("cuda", ["memcc", "torch"])
    torch_rows = [(r["system"], r["tf32"]) for r in rows if r["kind"] == "torch"]
    assert torch_rows == [("torch-eager", True), ("torch-eager", False),
                          ("torch-eager", "default"),
                          ("torch-checkpoint", True), ("torch-checkpoint", False)]
    # with a bf16 step: its pair right after the fp32 pair, autocast at TF32 on
    rows = gp.systems_for("cuda", ["memcc", "torch"], ["fp32", "bf16"])
    described = [gp._describe(r, "cuda") for r in rows]
    assert described[:4] == ["memcc-as-built deterministic=False", "torch-eager tf32=on",
                             "memcc-bf16 deterministic=False", "torch-autocast-bf16 tf32=on"]
    assert described[-1] == "memcc-as-built deterministic=True"
    assert [r.get("precision") for r in rows[:4]] == [None, None, "bf16", "bf16"]
    assert [d for d in described if "memcc-bf16" in d or "torch-autocast" in d] == \
        described[2:4]  # what --only memcc-bf16 --only torch-autocast keeps
    measured = [_row("memcc-as-built", 0.07, 15_000_000_000, 10.8249),
                _row("torch-eager", 0.107, 20_000_000_000, 10.8251, tf32="off (...)"),
                _row("torch-eager", 0.08, 20_000_000_000, 10.8252, tf32="on (...)"),
                _row("memcc-bf16", 0.035, 9_000_000_000, 10.84, precision=gp.BF16_MEMCC),
                _row("torch-autocast-bf16", 0.05, 12_000_000_000, 10.83, tf32="on (...)",
                     precision="torch.autocast bfloat16")]
    ratios = gp.ratios(measured)["gpt2"]["memcc-as-built"]
    assert ratios["torch-eager"]["time"] == pytest.approx(0.07 / 0.107)
    assert ratios["torch-eager tf32"]["peak"] == pytest.approx(0.75)
    check = gp.checks(measured)["gpt2"]
    assert check["same_weights"] and check["first_loss_agrees_1e-3"]
    assert check["bf16"]["first_loss_rel_diff_vs_torch_autocast"]["memcc-bf16"] == \
        pytest.approx(0.01 / 10.83)
    assert check["bf16"]["first_loss_agrees"] is True
    bf16 = gp.bf16_ratios(measured)["gpt2"]
    assert bf16["memcc-bf16 / torch-autocast-bf16"]["time"] == pytest.approx(0.7)
    assert bf16["memcc bf16 / fp32"]["peak"] == pytest.approx(0.6)
    assert bf16["torch bf16 / fp32"]["rows"] == ["torch-autocast-bf16 tf32",
                                                "torch-eager tf32"]
    assert bf16["torch bf16 / fp32"]["time"] == pytest.approx(0.05 / 0.08)
    off = [*measured[:4], _row("torch-autocast-bf16", 0.05, 1, 10.84 * 1.03,
                               precision="torch.autocast bfloat16")]
    assert gp.checks(off)["gpt2"]["bf16"]["first_loss_agrees"] is False  # 3% apart
    assert gp.checks(measured[:4])["gpt2"]["bf16"]["first_loss_agrees"] is None  # no peer
    # An fp16 step (memcc only: ORT's CUDA provider has fp16 convolutions, no bf16 ones) is
    # a head row, and its loss-scaled first loss is kept out of the fp32 rows' 1e-3 check.
    rows = gp.systems_for("cuda", ["memcc", "torch"], ["fp32", "bf16", "fp16"])
    assert [gp._describe(r, "cuda") for r in rows][4] == "memcc-fp16 deterministic=False"
    fp16 = [*measured, _row("memcc-fp16", 0.03, 8_000_000_000, 10.9, precision="fp16 (...)")]
    check16 = gp.checks(fp16)["gpt2"]
    assert check16["first_loss_agrees_1e-3"]
    assert check16["fp16_first_loss_rel_diff_vs_fp32_memcc"]["memcc-fp16"] == \
        pytest.approx(abs(10.9 - 10.8249) / 10.8249)
    summary = {"provider": "cuda", "warmup": 2, "steps": 5, "ratios": gp.ratios(measured),
               "bf16_ratios": gp.bf16_ratios(measured), "checks": {"gpt2": check},
               "rows": [*measured, {"system": "torch-checkpoint", "model": "gpt2",
                                    "skipped": "--time-limit 110 s reached (112 s)"}]}
    text = gp.table(summary)
    assert "| gpt2 | torch-eager tf32 | 20,000 | 20,000 | 10,000 / 6,667 |" in text
    assert "skipped: --time-limit" in text and "0.65x time" in text
    assert "| gpt2 | memcc-bf16 | 9,000 |" in text
    assert "memcc-bf16 / torch-autocast-bf16 (memcc-bf16 / torch-autocast-bf16 tf32): " \
        "0.70x time, 0.75x peak" in text
    assert "bf16 first loss agrees with torch-autocast-bf16 tf32 within 2e-02: True" in text
