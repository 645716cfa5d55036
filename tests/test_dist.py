"""Data-parallel training (``memcc train --nproc N``, ``memcc.dist``) on CPU with gloo.

Tiny zoo MLPs (batch 4 per rank against one process at batch 8). Two real 2-rank runs
(each a spawn of two processes, a few seconds): one through the CLI (DDP semantics, SGD,
its checkpoint resumed by one process), one through the API (ZeRO-1 AdamW, resumed on two
ranks from one process's checkpoint); the kill test's last run resumes on ZeRO-2 ranks.
ZeRO-0, 1 and 2 are checked bit for bit against each other on 2 ranks in threads of one
process (``dist_ranks.Threads``: the collectives over numpy arrays), in well under a second. The
step's split and one rank's replica are checked in-process against ``memcc.Trainer``, bit
for bit.

Tolerance: N ranks average N per-rank mean gradients, one process takes the mean over
the global batch: the sums run in another order, so parameters agree to float32 rounding
(measured: at most 3e-8 absolute after 3 SGD or AdamW steps; asserted: 1e-6).
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from dist_ranks import OneRank, Threads, run_ranks
from onnx_files import mlp_step_and_data
from typer.testing import CliRunner

from memcc import Trainer
from memcc.backend import checkpoint as ckpt
from memcc.backend.device_step import step_for_provider
from memcc.backend.onnx_file import save_graph
from memcc.cli import app
from memcc.dist import owners_of_state, peaks, split_step
from memcc.dist.launch import train_distributed
from memcc.dist.replica import Replica, ReplicaSettings, assign_owners
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.frontend.update_groups import update_units
from memcc.step import Role, TrainingStep
from memcc.trainer import TrainOptions, train
from models import build_model, mlp

runner = CliRunner()
K = 3
ATOL = 1e-6


def _mlp(batch: int):
    return mlp.build(batch=batch, in_features=12, width=16, depth=2, num_classes=4)


def _gpt2():
    return build_model("gpt2", width=32, depth=2, heads=2, vocab_size=64, seq_len=16, batch=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """MLP steps at batch 4 (per rank) and 8 (one process), SGD without momentum and
    AdamW, and 64 samples of data."""
    d = tmp_path_factory.mktemp("dist")
    out = {"dir": d}
    for opt, kw in (("sgd", {"momentum": 0.0}), ("adamw", {})):
        for b in (4, 8):
            step = build_training_step(load_graph(_mlp(b)), BuildOptions(optimizer=opt, **kw))
            out[f"{opt}{b}"] = save_graph(step, d / f"{opt}{b}.onnx")
    rng = np.random.default_rng(0)
    out["data"] = d / "data.npz"
    np.savez(out["data"], input=rng.standard_normal((64, 12)).astype(np.float32),
             labels=rng.integers(0, 4, 64).astype(np.int64))
    return out


def _params(directory) -> dict[str, np.ndarray]:
    return ckpt.load(ckpt.latest(directory)).tensors


def _assert_close(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=ATOL, err_msg=name)


def _single(files, opt: str, steps: int, directory, *, resume: bool = False):
    return train(TrainOptions(step=files[f"{opt}8"], data=files["data"], steps=steps,
                              checkpoint=directory, resume=resume, threads=1))


# ---------------------------------------------------------------------------- the split
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_the_step_is_cut_at_its_updates(opt):
    graph = build_training_step(load_graph(_gpt2()), BuildOptions(optimizer=opt))
    spec = TrainingStep.of(graph)
    split = split_step(graph, spec)
    roles = spec.roles
    assert all(roles[n.name] is Role.UPDATE for n in split.update.nodes)
    assert not any(roles[n.name] is Role.UPDATE for n in split.gradient.nodes)
    assert len(split.update.nodes) + len(split.gradient.nodes) == len(graph.nodes)
    assert set(split.gradient.outputs) == {spec.loss, *split.gradients.values()}
    assert set(split.update.outputs) == set(spec.state)
    owners = owners_of_state(split)
    units = update_units(graph, spec.state, spec.parameters)
    assert any(len(u) > 1 for u in units)  # the vectors' grouped update
    for unit in units:  # a parameter's update reads its own gradient, or its group's
        for p in unit:
            assert owners[f"{p}.new"] == sorted(unit)
    if opt == "adamw":
        assert owners["adamw.step.new"] == []


def test_holding_the_gradients_to_the_all_reduce_costs_memory_where_weights_dominate():
    """A wide MLP at batch 2 (weights outweigh activations): the fused step frees each
    gradient at its update, the split step holds them all (measured: +23%, SGD)."""
    forward = mlp.build(batch=2, in_features=64, width=256, depth=4, num_classes=8)
    graph = build_training_step(load_graph(forward), BuildOptions(optimizer="sgd"))
    p = peaks(split_step(graph, TrainingStep.of(graph)))
    assert p["fused_step"] < p["split_step"] <= p["fused_step"] + p["gradients"]


def test_a_step_without_optimizer_cannot_be_split():
    graph = build_training_step(load_graph(_mlp(4)), BuildOptions(optimizer="none"))
    with pytest.raises(InputError, match="--optimizer sgd or adamw"):
        split_step(graph, TrainingStep.of(graph), "s.onnx")


@pytest.mark.parametrize("model,opt", [("mlp", "sgd"), ("gpt2", "adamw"),
                                       ("resnet18", "adamw"), ("mlp-dropout", "adamw"),
                                       ("gpt2-compiled", "adamw"), ("mlp-bf16", "sgd")])
def test_one_rank_of_the_split_step_is_bit_identical_to_the_trainer(tmp_path, model, opt):
    """Gradient step, (no) all-reduce, update step: the fused step's numbers exactly, with
    BatchNorm statistics (carried by the gradient step) and the Dropout counter (read by
    the gradient step, advanced by the update step)."""
    if model == "mlp-dropout":
        path, _ = mlp_step_and_data(tmp_path, batch=4, in_features=12, width=16, depth=2,
                                    samples=8, optimizer=opt, dropout=0.25)
    elif model == "gpt2-compiled":  # memcc compile --budget min: recomputation rewrites
        built = build_training_step(load_graph(_gpt2()), BuildOptions(optimizer=opt))
        path = tmp_path / "min.onnx"
        res = runner.invoke(app, ["compile", str(save_graph(built, tmp_path / "s.onnx")),
                                  "--budget", "min", "--strategy", "sqrtn", "--cost",
                                  "analytic", "-o", str(path)])
        assert res.exit_code == 0, res.output
        assert len(load_graph(path).nodes) > len(built.nodes)  # recomputation was added
    elif model == "mlp-bf16":  # 16-bit nodes without CPU kernels: float32 between casts
        graph = build_training_step(load_graph(_mlp(4)),
                                    BuildOptions(optimizer=opt, precision="bf16"))
        assert any(ti.dtype == onnx.TensorProto.BFLOAT16 for ti in graph.info.values())
        path = save_graph(graph, tmp_path / "s.onnx")
    else:
        forward = {"mlp": lambda: _mlp(4), "gpt2": _gpt2,
                   "resnet18": lambda: build_model("resnet18", batch=2, resolution=16, width=4,
                                                   num_classes=4)}[model]()
        graph = build_training_step(load_graph(forward), BuildOptions(optimizer=opt))
        path = save_graph(graph, tmp_path / "s.onnx")
    trainer = Trainer(path, threads=1)
    graph, _ = step_for_provider(load_graph(path), "cpu")  # as memcc.dist.train prepares it
    split = split_step(graph, TrainingStep.of(graph))
    replica = Replica(split, OneRank(), ReplicaSettings(0, 1, threads=1))
    if model == "mlp-dropout":
        assert "dropout.step" in replica.opt_state
    if model == "resnet18":
        assert split.grad_carried and set(split.grad_carried.values()) <= set(replica.carried)
    rng = np.random.default_rng(1)
    for _ in range(K):
        batch = {d.name: (rng.integers(0, 4, (d.batch_size, *d.sample_shape))
                          if d.dtype.kind == "i" else
                          rng.standard_normal((d.batch_size, *d.sample_shape))).astype(d.dtype)
                 for d in trainer.inputs}
        assert replica.step(batch) == (trainer.step(batch), False)
    mine = replica.full_state()
    for name, value in trainer.state_dict().items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name, strict=True)


def test_zero1_owners_balance_the_bytes():
    graph = build_training_step(load_graph(_gpt2()), BuildOptions(optimizer="adamw"))
    split = split_step(graph, TrainingStep.of(graph))
    owner = assign_owners(split, 2)
    load = [sum(graph.info[p].nbytes for p, r in owner.items() if r == k) for k in (0, 1)]
    biggest = max(graph.info[p].nbytes for p in owner)
    assert abs(load[0] - load[1]) <= biggest


def _train_in_threads(path, zero: int, batches: list) -> tuple[dict, list]:
    """Two replicas of ``path`` at ZeRO-``zero`` (threads, ``dist_ranks.Threads``) trained on
    ``batches`` (per step, per rank); rank 0's consolidated state and both replicas."""
    graph, _ = step_for_provider(load_graph(path), "cpu")
    group, replicas, out = Threads(2), [None, None], {}

    def rank(r: int) -> None:
        split = split_step(graph.copy(), TrainingStep.of(graph))  # its own initial values
        replicas[r] = Replica(split, group.rank(r), ReplicaSettings(r, 2, zero, threads=1))
        for step in batches:
            replicas[r].step(step[r])
        state = replicas[r].full_state()
        if r == 0:
            out.update({k: v.copy() for k, v in state.items()})

    run_ranks(group, rank)
    return out, replicas


def test_zero2_keeps_each_ranks_own_gradients_and_trains_bit_identically_to_zero0(files):
    """Two ranks (threads): ZeRO-0, 1 and 2 end K AdamW steps with the same bits; a ZeRO-2
    rank's bucket holds only its parameters' gradients, the others' are freed after the
    step, and the gradients it sent (NaN after their reduction) are never read."""
    rng = np.random.default_rng(2)
    batches = [[{"input": rng.standard_normal((4, 12)).astype(np.float32),
                 "labels": rng.integers(0, 4, 4).astype(np.int64)} for _ in (0, 1)]
               for _ in range(K)]
    runs = {z: _train_in_threads(files["adamw4"], z, batches) for z in (0, 1, 2)}
    for z in (1, 2):
        assert sorted(runs[z][0]) == sorted(runs[0][0])
        for name, value in runs[0][0].items():
            np.testing.assert_array_equal(runs[z][0][name], value, err_msg=name, strict=True)
    zero1, zero2 = runs[1][1], runs[2][1]
    grads = zero1[0].split.gradients
    for r, rep in enumerate(zero2):
        assert set(rep.grad_views) == {grads[p] for p, o in rep.owner.items() if o == r}
        assert rep.grad_step.transient_outputs == {}  # released after the reduction
        assert rep.held_bytes() < zero1[r].held_bytes()
    assert sum(f.nbytes for rep in zero2 for f in rep.grad_flats.values()) == \
        sum(zero1[0].split.full.info[g].nbytes for g in set(grads.values()))


# ---------------------------------------------------------------------------- 2 ranks
def test_two_ranks_train_as_one_process_on_the_global_batch_and_resume_on_one(files):
    """DDP semantics through the CLI; the 2-rank checkpoint resumes in one process."""
    d = files["dir"]
    res = runner.invoke(app, ["train", str(files["sgd4"]), "--data", str(files["data"]),
                              "--nproc", "2", "--steps", str(K), "--checkpoint",
                              str(d / "two"), "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    info = out["distributed"]
    assert info["global_batch"] == 8 and info["world_size"] == 2
    assert len(set(info["parameter_digest_per_rank"])) == 1  # the ranks' parameters agree
    single = _single(files, "sgd", K, d / "one")
    np.testing.assert_allclose(out["losses"], single.losses, rtol=1e-6)
    _assert_close(_params(d / "two"), _params(d / "one"))
    # 2 ranks -> 1 process: K more steps equal the uninterrupted run's 2K.
    _single(files, "sgd", 2 * K, d / "two", resume=True)
    _single(files, "sgd", 2 * K, d / "one", resume=True)
    _assert_close(_params(d / "two"), _params(d / "one"))
    # A run at another global batch (3 ranks x 4) refuses the checkpoint, before any rank.
    res = runner.invoke(app, ["train", str(files["sgd4"]), "--data", str(files["data"]),
                              "--nproc", "3", "--checkpoint", str(d / "two"), "--resume"])
    assert res.exit_code == 2 and "global batch" in res.output
    # The ranks' checkpoint exports with the step they ran (written at the global batch 8,
    # a step of batch 4): the weights do not depend on the batch.
    res = runner.invoke(app, ["export", str(files["sgd4"]), "--checkpoint", str(d / "two"),
                              "-o", str(d / "two.safetensors")])
    assert res.exit_code == 0, res.output


def test_zero1_shards_adamw_state_and_resumes_a_one_process_checkpoint(files, monkeypatch):
    """1 process -> 2 ranks with ZeRO-1: the same parameters as the uninterrupted run, and
    each rank holds about half of the optimizer state."""
    d = files["dir"]
    _single(files, "adamw", K, d / "z")
    result, info = train_distributed(
        TrainOptions(step=files["adamw4"], data=files["data"], steps=2 * K,
                     checkpoint=d / "z", resume=True, threads=1), 2, zero=1, quiet=True)
    assert result.start_step == K and result.steps_done == 2 * K
    _single(files, "adamw", 2 * K, d / "z1")
    _assert_close(_params(d / "z"), _params(d / "z1"))
    spec = TrainingStep.of(load_graph(files["adamw4"]))
    full = sum(load_graph(files["adamw4"]).info[i].nbytes for i in spec.state.values()
               if i not in spec.parameters)
    per_rank = info["optimizer_state_bytes_per_rank"]
    assert info["zero"] == 1 and len(per_rank) == 2
    assert len(set(info["parameter_digest_per_rank"])) == 1  # all gathered after the update
    # Not asked to (--measure-memory), the ranks allocate as memcc train does and no step
    # peak is measured; their resident sizes are what is shown.
    assert info["step_peak_bytes_per_rank"] == [None, None]
    assert info["memory_method"].startswith("none") and all(info["rss_bytes_per_rank"])
    # where each rank's time went: rank 0's as before, and every rank's
    assert info["seconds_per_rank"][0] == info["rank0_seconds"]
    assert len(info["seconds_per_rank"]) == 2
    assert all(s["gradient_step"] > 0 and s["update_step"] > 0
               for s in info["seconds_per_rank"])
    # And memcc train shows the prediction and the resident sizes instead (this run's
    # figures, handed to the command line's report).
    monkeypatch.setattr("memcc.dist.launch.train_distributed", lambda *a, **k: (result, info))
    res = runner.invoke(app, ["train", str(files["adamw4"]), "--data", str(files["data"]),
                              "--nproc", "2", "--zero", "1"])
    assert res.exit_code == 0, res.output
    assert "step peak predicted / the process resident: rank 0 " in res.output
    assert "rank 1 " in res.output and "--measure-memory" in res.output
    assert sum(per_rank) == full + 4  # the AdamW step counter (4 bytes) is on both ranks
    assert max(per_rank) <= 0.55 * full


# ---------------------------------------------------------------------------- errors
def test_missing_torch_names_the_extra(files, monkeypatch):
    real = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"No module named '{name}'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    res = runner.invoke(app, ["train", str(files["sgd4"]), "--data", str(files["data"]),
                              "--nproc", "2"])
    assert res.exit_code == 2
    assert 'pip install ".[dist]" in memcc\'s checkout' in res.output


@pytest.mark.parametrize("args,message", [
    (["--nproc", "0"], "--nproc 0"),
    (["--nproc", "-3"], "--nproc -3"),
    (["--zero", "1"], "give --nproc N"),
    (["--measure-memory"], "give --nproc N"),
    (["--nproc", "2", "--zero", "3"], "--zero 3"),
    (["--nproc", "2", "--provider", "cuda"], "CUDA is not available"),
    (["--nproc", "2", "--arena"], "--arena is not supported with --nproc"),
])
def test_bad_data_parallel_options_exit_2_before_any_rank_starts(files, args, message):
    res = runner.invoke(app, ["train", str(files["sgd4"]), "--data", str(files["data"]),
                              *args])
    assert res.exit_code == 2, res.output
    assert message in res.output


def _ranks_of(parent: int) -> list[int]:
    """The spawned rank processes of ``parent`` (Linux /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmd:
            pids.append(int(d.name))
    return sorted(pids)


def _run_until_checkpoint_then(files, directory, signal_ranks: bool, *, resume: bool,
                               after: int = 0) -> tuple[int, str, str]:
    """Start ``memcc train --nproc 2`` (endless); once ``directory`` holds a checkpoint
    newer than step ``after``, SIGKILL one rank (``signal_ranks``) or SIGTERM memcc;
    (exit status, stdout, stderr)."""
    cmd = [sys.executable, "-m", "memcc.cli", "train", str(files["adamw4"]), "--data",
           str(files["data"]), "--nproc", "2", "--steps", "1000000", "--save-every", "20",
           "--checkpoint", str(directory), "--threads", "1", "--json",
           *(["--resume"] if resume else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120

        def newest() -> int:
            last = ckpt.latest(directory)
            return ckpt.load(last).step if last is not None else -1

        while newest() <= after and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = _ranks_of(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1] if signal_ranks else proc.pid,
                signal.SIGKILL if signal_ranks else signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        for pid in ranks:  # torch stops the others; nothing of this test may outlive it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, stdout, stderr


def test_sigterm_stops_every_rank_saved_and_a_killed_rank_leaves_the_last_checkpoint(files):
    """SIGTERM to memcc: every rank stops after the same step, which is saved (exit 143).
    Resumed, then SIGKILL to one rank: the run fails naming its newest checkpoint, which
    is whole, and a resumed 2-rank ZeRO-2 run (real gloo reduces: the threads test above
    has ZeRO-0, 1 and 2 bit-identical) continues it as one process would."""
    d = files["dir"] / "killed"
    code, stdout, stderr = _run_until_checkpoint_then(files, d, False, resume=False)
    assert code == 128 + signal.SIGTERM, stderr
    stopped = json.loads(stdout.strip().splitlines()[-1])
    assert stopped["interrupted"] == "SIGTERM" and "--resume --nproc 2" in stderr
    assert ckpt.load(ckpt.latest(d)).step == stopped["steps"]  # the stop step, saved
    code, _, stderr = _run_until_checkpoint_then(files, d, True, resume=True,
                                                 after=stopped["steps"])
    assert code == 2, stderr
    assert "a rank of the data-parallel run failed" in stderr and "--resume" in stderr
    c = ckpt.load(ckpt.latest(d))  # whole: its digest is checked on load
    assert c.step % 20 == 0 and c.step > stopped["steps"]
    shutil.copytree(d, files["dir"] / "killed1")
    result, _ = train_distributed(
        TrainOptions(step=files["adamw4"], data=files["data"], steps=c.step + K,
                     checkpoint=d, resume=True, threads=1), 2, zero=2, quiet=True)
    assert result.start_step == c.step and result.steps_done == c.step + K
    _single(files, "adamw", c.step + K, files["dir"] / "killed1", resume=True)
    _assert_close(_params(d), _params(files["dir"] / "killed1"))


def test_batch_size_check_counts_global_batches(files):
    res = runner.invoke(app, ["train", str(files["sgd4"]), "--data", str(files["data"]),
                              "--nproc", "2", "--batch-size-check"])
    assert res.exit_code == 0, res.output
    assert "2 ranks x batch 4 = 8 samples a step: 8 steps per epoch" in res.output


def test_under_torchrun_the_ranks_come_from_the_environment(files, monkeypatch):
    from memcc.dist.comm import launched_by_torchrun

    assert launched_by_torchrun() is None
    for k, v in {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "3",
                 "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    assert launched_by_torchrun() == (1, 3, 1)
    res = runner.invoke(app, ["train", str(files["sgd4"]), "--data", str(files["data"]),
                              "--nproc", "2"])
    assert res.exit_code == 2 and "torchrun started 3 ranks" in res.output


def test_the_single_device_tool_does_not_import_torch():
    code = ("import sys, memcc.api, memcc.cli, memcc.cli.training, memcc.dist.launch; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def _planned_for_cuda(step, tmp_path):
    """``step`` as compile writes a CUDA plan of it (``memcc.provider`` = cuda)."""
    from memcc.step import PROVIDER_KEY

    model = onnx.load(str(step))
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                        PROVIDER_KEY: "cuda"})
    planned = tmp_path / "cuda_plan.onnx"
    onnx.save(model, str(planned))
    return planned


def test_nproc_runs_where_the_step_was_planned(files, tmp_path, monkeypatch, capsys):
    """As one process does (``provider_as_planned``): no --provider means the provider the
    step was compiled for; a CUDA plan without CUDA runs on the CPU and says so."""
    from memcc.backend import session
    from memcc.dist.launch import _on_planned_provider

    planned = _planned_for_cuda(files["sgd4"], tmp_path)
    monkeypatch.setattr(session, "cuda_unavailable_reason", lambda: "no GPU in this test")
    opts = TrainOptions(step=planned, data=files["data"])
    assert _on_planned_provider(opts, say=True).provider == "cpu"
    assert "planned for CUDA" in capsys.readouterr().err
    # A step planned for the CPU, or built and never compiled: the CPU, nothing said.
    plain = TrainOptions(step=files["sgd4"], data=files["data"])
    assert _on_planned_provider(plain, say=True).provider == "cpu"
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(session, "cuda_unavailable_reason", lambda: None)
    assert _on_planned_provider(opts, say=True).provider == "cuda"


def test_json_runs_still_warn_on_stderr(files, tmp_path, monkeypatch, capsys):
    """``--json`` keeps stdout for its object; the note that a CUDA plan runs on the CPU and
    the warning that the step was planned for other ranks still reach stderr (both were
    dropped with --json)."""
    from memcc.backend import session
    from memcc.dist import launch

    planned = _planned_for_cuda(files["sgd4"], tmp_path)
    monkeypatch.setattr(session, "cuda_unavailable_reason", lambda: "no GPU in this test")
    monkeypatch.setattr(launch, "planned_for_other_ranks", lambda *a: "planned for 4 ranks")
    monkeypatch.setattr(launch, "_check_placement", lambda *a: None)
    monkeypatch.setattr(launch, "_spawn", lambda dopts: ("ran", dopts.quiet))
    monkeypatch.setattr(launch, "_raise_if_interrupted", lambda out: out)
    out = launch.train_distributed(TrainOptions(step=planned, data=files["data"]), 2,
                                   quiet=True)
    assert out == ("ran", True)
    err = capsys.readouterr()
    assert "planned for CUDA" in err.err and "warning:" in err.err
    assert "planned for 4 ranks" in err.err and err.out == ""


def test_zero2_is_refused_where_an_update_reads_every_gradient(tmp_path):
    """A dynamic loss scale's overflow check reads every gradient, which ZeRO-2 keeps on one
    rank each: refused before any rank starts (train) and before planning (compile),
    naming what to use instead; ranks failed with an unbound input before."""
    step = build_training_step(load_graph(_mlp(4)), BuildOptions(precision="fp16"))
    path = save_graph(step, tmp_path / "fp16.onnx")
    rng = np.random.default_rng(0)
    data = tmp_path / "d.npz"
    np.savez(data, input=rng.standard_normal((16, 12)).astype(np.float32),
             labels=rng.integers(0, 4, 16).astype(np.int64))
    for args in (["train", str(path), "--data", str(data), "--nproc", "2", "--zero", "2"],
                 ["compile", str(path), "--nproc", "2", "--zero", "2", "--budget", "1GB",
                  "--cost", "analytic"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, r.output
        assert "--zero 2" in r.output and "--zero 1 or 0" in r.output, r.output


def test_one_process_training_a_step_planned_for_ranks_says_so(tmp_path):
    """A step compiled with --nproc (``memcc.ranks`` in its metadata) trained by one process:
    the data-parallel run warns of other ranks; one process said nothing."""
    from memcc.step import RANKS_KEY

    step = build_training_step(load_graph(_mlp(4)), BuildOptions())
    step.metadata[RANKS_KEY] = json.dumps({"world_size": 2, "zero": 1, "bucket_bytes": None,
                                           "peak_bytes_per_rank": [1, 1], "budget_bytes": 2})
    t = Trainer(save_graph(step, tmp_path / "ranks.onnx"), threads=1)
    assert any("planned for 2 data-parallel ranks" in n and "--zero 1" in n for n in t.notes)
    plain = Trainer(save_graph(build_training_step(load_graph(_mlp(4)), BuildOptions()),
                               tmp_path / "plain.onnx"), threads=1)
    assert not any("data-parallel" in n for n in plain.notes)


def test_two_ranks_stop_at_a_loss_that_is_no_number_and_save_nothing_of_it(tmp_path):
    """As one process does (tests/test_train_cli.py): the loss is averaged across the
    ranks, so every rank sees the nan at the same step and stops there, none waiting in a
    collective; the error names the step and every checkpoint left is finite."""
    from onnx_files import diverging_gpt2_step_and_data, said_it_diverged

    step, data = diverging_gpt2_step_and_data(tmp_path, samples=64)
    res = runner.invoke(app, ["train", str(step), "--data", str(data), "--nproc", "2",
                              "--steps", "40",
                              "--checkpoint", str(tmp_path / "ck"), "--save-every", "1",
                              "--threads", "1"])
    assert res.exit_code != 0
    assert "rank 0" in said_it_diverged(res.output, tmp_path / "ck")
