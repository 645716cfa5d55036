"""Bad inputs to every command: exit status 2, one message naming what is wrong, nothing written.

README promises that errors "name the file, node or value at fault and what to do, exit with
status 2, and never leave a half-written file". Each case below is one thing a user can get
wrong (a missing or corrupt file, a bad size, flag or path, a file of the wrong kind, an
output path that would overwrite an input); each runs through the real command line (typer's
CliRunner, in-process: it keeps the exit status, stdout and stderr apart and keeps an
unhandled exception as ``result.exception`` instead of printing a traceback) and is checked
for: exit status 2, no exception escaping the CLI, the offending file or value named in the
output, and no file created, changed or removed in the output directory or among the inputs.

One tiny model and everything made from it (step, checkpoint, data, report) are built once
per module, so the whole list runs in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from memcc.cli import app
from models import build_model

runner = CliRunner()


@dataclass(frozen=True)
class Case:
    """``args`` with ``{f}`` (the shared inputs) and ``{o}`` (this case's empty output
    directory) filled in; ``names``: text the message must contain (the file or value);
    ``avoid``: text it must not (advice meant for another command)."""

    id: str
    args: tuple[str, ...]
    names: str
    avoid: str = ""


def case(id: str, args: str, names: str, avoid: str = "") -> Case:
    return Case(id, tuple(args.split()), names, avoid)


CASES = [
    # --- build
    case("build-missing", "build {f}/nope.onnx -o {o}/s.onnx", "nope.onnx"),
    case("build-dir-as-model", "build {f}/adir -o {o}/s.onnx", "adir"),
    case("build-text-file", "build {f}/notes.txt -o {o}/s.onnx", "notes.txt"),
    case("build-empty-file", "build {f}/empty.onnx -o {o}/s.onnx", "empty.onnx"),
    case("build-truncated-onnx", "build {f}/truncated.onnx -o {o}/s.onnx", "truncated.onnx"),
    case("build-a-step", "build {f}/step.onnx -o {o}/s.onnx", "step.onnx"),
    case("build-out-missing-dir", "build {f}/fwd.onnx -o {o}/no/such/s.onnx", "no/such"),
    case("build-out-is-dir", "build {f}/fwd.onnx -o {o}", "{o}"),
    case("build-out-unwritable", "build {f}/fwd.onnx -o /proc/s.onnx", "/proc"),
    case("build-out-equals-input", "build {f}/fwd.onnx -o {f}/fwd.onnx", "fwd.onnx"),
    case("build-bad-loss", "build {f}/fwd.onnx -o {o}/s.onnx --loss hinge", "hinge"),
    case("build-bad-optimizer", "build {f}/fwd.onnx -o {o}/s.onnx --optimizer lion", "lion"),
    case("build-dim-no-value", "build {f}/dyn.onnx -o {o}/s.onnx --dim batch", "batch"),
    case("build-dim-not-int", "build {f}/dyn.onnx -o {o}/s.onnx --dim batch=abc", "abc"),
    case("build-dim-zero", "build {f}/dyn.onnx -o {o}/s.onnx --dim batch=0", "batch=0"),
    case("build-dim-unknown", "build {f}/dyn.onnx -o {o}/s.onnx --dim batch=4 --dim seq=9",
         "seq"),
    case("build-dim-unbound", "build {f}/dyn.onnx -o {o}/s.onnx", "batch"),
    case("build-dim-misspelt", "build {f}/dyn.onnx -o {o}/s.onnx --dim bach=4",
         "--dim bach names none"),
    case("build-dim-twice", "build {f}/dyn.onnx -o {o}/s.onnx --dim batch=4 --dim batch=8",
         "batch is given twice (4 and 8)"),
    case("build-freeze-no-match", "build {f}/fwd.onnx -o {o}/s.onnx --freeze nothing.*",
         "nothing.*"),
    case("build-loss-chunks-zero", "build {f}/fwd.onnx -o {o}/s.onnx --loss-chunks 0",
         "--loss-chunks"),
    case("build-ignore-index-with-mse",
         "build {f}/fwd.onnx -o {o}/s.onnx --loss mse --ignore-index -100",
         "--ignore-index applies to --loss cross-entropy, not 'mse'"),
    case("build-ignore-index-with-loss-chunks",
         "build {f}/fwd.onnx -o {o}/s.onnx --ignore-index -100 --loss-chunks 2",
         "--ignore-index -100 with --loss-chunks 2"),
    case("build-attention-chunks-no-attention",
         "build {f}/fwd.onnx -o {o}/s.onnx --attention-chunks 2", "attention"),
    case("build-model-with-loss-output", "build {f}/lossy.onnx -o {o}/s.onnx", "--loss none"),
    case("build-negative-lr", "build {f}/fwd.onnx -o {o}/s.onnx --lr -1", "--lr -1"),
    case("build-negative-momentum", "build {f}/fwd.onnx -o {o}/s.onnx --momentum -0.9",
         "--momentum -0.9"),
    case("build-negative-weight-decay", "build {f}/fwd.onnx -o {o}/s.onnx --weight-decay "
         "-0.1", "--weight-decay -0.1"),
    # --- compile
    case("compile-missing", "compile {f}/nope.onnx --budget 1GB -o {o}/c.onnx", "nope.onnx"),
    case("compile-text-file", "compile {f}/notes.txt --budget 1GB -o {o}/c.onnx", "notes.txt"),
    case("compile-budget-zero", "compile {f}/step.onnx --budget 0 -o {o}/c.onnx", "0"),
    case("compile-budget-1KB", "compile {f}/step.onnx --budget 1KB -o {o}/c.onnx", "1KB"),
    case("compile-budget-bare-fraction", "compile {f}/step.onnx --budget 0.5 -o {o}/c.onnx",
         "write 50%"),
    case("compile-budget-negative", "compile {f}/step.onnx --budget -5MB -o {o}/c.onnx",
         "-5MB"),
    case("compile-budget-words", "compile {f}/step.onnx --budget abc -o {o}/c.onnx", "abc"),
    case("compile-budget-unit", "compile {f}/step.onnx --budget 5XB -o {o}/c.onnx", "5XB"),
    case("compile-out-equals-input", "compile {f}/step.onnx --budget 1GB -o {f}/step.onnx",
         "step.onnx"),
    case("compile-out-symlink-to-input",
         "compile {f}/step.onnx --budget 1GB -o {f}/step-link.onnx", "step-link.onnx"),
    case("compile-out-hardlink-to-input",
         "compile {f}/step.onnx --budget 1GB -o {f}/step-hard.onnx", "step-hard.onnx"),
    case("compile-report-equals-input",
         "compile {f}/step.onnx --budget 1GB -o {o}/c.onnx --report {f}/step.onnx", "step.onnx"),
    case("compile-report-equals-out",
         "compile {f}/step.onnx --budget 1GB -o {o}/c.onnx --report {o}/c.onnx", "c.onnx"),
    case("compile-out-missing-dir", "compile {f}/step.onnx --budget 1GB -o {o}/no/c.onnx",
         "no"),
    case("compile-bad-strategy", "compile {f}/step.onnx --budget 1GB -o {o}/c.onnx "
         "--strategy greedy", "greedy"),
    case("compile-bad-provider", "compile {f}/step.onnx --budget 1GB -o {o}/c.onnx "
         "--provider tpu", "tpu"),
    case("compile-bad-cost", "compile {f}/step.onnx --budget 1GB -o {o}/c.onnx --cost guess",
         "guess"),
    case("compile-time-limit-zero", "compile {f}/step.onnx --budget 1GB -o {o}/c.onnx "
         "--time-limit 0", "--time-limit"),
    case("compile-margin-too-big", "compile {f}/step.onnx --budget 1GB -o {o}/c.onnx "
         "--margin 0.7", "--margin"),
    case("compile-offload-on-cpu", "compile {f}/step.onnx --budget 1GB -o {o}/c.onnx "
         "--offload", "--offload"),
    case("compile-arena-with-cuda", "compile {f}/step.onnx --budget 1GB -o {o}/c.onnx "
         "--arena --provider cuda --cost analytic", "--arena"),
    case("compile-dim-unbound", "compile {f}/dyn.onnx --budget 1GB -o {o}/c.onnx", "batch"),
    case("compile-freeze-no-match", "compile {f}/fwd.onnx --budget 1GB -o {o}/c.onnx "
         "--freeze nothing.*", "nothing.*"),
    case("compile-bad-momentum", "compile {f}/fwd.onnx --budget 1GB -o {o}/c.onnx "
         "--momentum -0.5", "--momentum -0.5"),
    # --- run
    case("run-missing", "run {f}/nope.onnx", "nope.onnx"),
    case("run-forward-model", "run {f}/fwd.onnx", "fwd.onnx"),
    case("run-steps-zero", "run {f}/step.onnx --steps 0", "--steps"),
    case("run-bad-provider", "run {f}/step.onnx --provider tpu", "tpu"),
    case("run-data-missing", "run {f}/step.onnx --data {f}/nope.npz", "nope.npz"),
    case("run-data-corrupt", "run {f}/step.onnx --data {f}/corrupt.npz", "corrupt.npz"),
    case("run-data-truncated", "run {f}/step.onnx --data {f}/truncated.npz", "truncated.npz"),
    case("run-data-empty-file", "run {f}/step.onnx --data {f}/empty.npz", "empty.npz"),
    case("run-data-npy", "run {f}/step.onnx --data {f}/array.npy", "array.npy"),
    case("run-data-wrong-names", "run {f}/step.onnx --data {f}/names.npz", "labels"),
    case("run-data-wrong-shape", "run {f}/step.onnx --data {f}/shape.npz", "input"),
    case("run-data-dir", "run {f}/step.onnx --data {f}/adir", "adir"),
    # --- train
    case("train-forward-model", "train {f}/fwd.onnx --data {f}/data.npz",
         "then memcc train step.onnx"),
    case("train-missing-step", "train {f}/nope.onnx --data {f}/data.npz", "nope.onnx"),
    case("train-cuda-graph-on-cpu", "train {f}/step.onnx --data {f}/data.npz --cuda-graph",
         "--cuda-graph needs --provider cuda"),
    case("train-data-missing", "train {f}/step.onnx --data {f}/nope.npz", "nope.npz"),
    case("train-data-corrupt", "train {f}/step.onnx --data {f}/corrupt.npz", "corrupt.npz"),
    case("train-data-truncated", "train {f}/step.onnx --data {f}/truncated.npz",
         "truncated.npz"),
    case("train-data-shards-corrupt", "train {f}/step.onnx --data {f}/shards", "bad.npz"),
    case("train-data-wrong-dtype", "train {f}/step.onnx --data {f}/dtype.npz", "labels"),
    case("train-data-out-of-range", "train {f}/step.onnx --data {f}/range.npz", "labels"),
    case("train-data-too-few", "train {f}/step.onnx --data {f}/few.npz", "few.npz"),
    case("train-data-empty-dir", "train {f}/step.onnx --data {f}/adir", "adir"),
    case("train-data-pickled", "train {f}/step.onnx --data {f}/pickled.npz", "pickled.npz"),
    # numpy calls every file it cannot read a pickle: a text file was "object arrays"
    case("train-data-text-file", "train {f}/step.onnx --data {f}/notes.txt", "notes.txt",
         avoid="pickled"),
    case("train-steps-zero", "train {f}/step.onnx --data {f}/data.npz --steps 0", "--steps"),
    case("train-epochs-negative", "train {f}/step.onnx --data {f}/data.npz --epochs -1",
         "--epochs"),
    case("train-threads-negative", "train {f}/step.onnx --data {f}/data.npz --threads -2",
         "--threads"),
    case("train-save-every-zero", "train {f}/step.onnx --data {f}/data.npz --checkpoint "
         "{o}/ck --save-every 0", "--save-every"),
    case("train-bad-provider", "train {f}/step.onnx --data {f}/data.npz --provider tpu",
         "tpu"),
    case("train-checkpoint-is-file", "train {f}/step.onnx --data {f}/data.npz --checkpoint "
         "{f}/notes.txt", "notes.txt"),
    case("train-resume-corrupt", "train {f}/step.onnx --data {f}/data.npz --checkpoint "
         "{f}/badck --resume", "badck"),
    case("train-checkpoint-not-empty", "train {f}/step.onnx --data {f}/data.npz "
         "--checkpoint {f}/ck", "ck"),
    # --- export
    case("export-checkpoint-missing", "export {f}/step.onnx --checkpoint {f}/nock -o "
         "{o}/w.onnx", "nock"),
    case("export-checkpoint-empty-dir", "export {f}/step.onnx --checkpoint {f}/adir -o "
         "{o}/w.onnx", "adir"),
    case("export-checkpoint-corrupt", "export {f}/step.onnx --checkpoint {f}/badck -o "
         "{o}/w.onnx", "badck", avoid="resum"),
    case("export-checkpoint-foreign", "export {f}/step.onnx --checkpoint "
         "{f}/foreign.safetensors -o {o}/w.onnx", "foreign.safetensors", avoid="resum"),
    case("export-checkpoint-other-step", "export {f}/step-adamw.onnx --checkpoint {f}/ck -o "
         "{o}/w.onnx", "ck", avoid="train this step from the start"),
    case("export-forward-model", "export {f}/fwd.onnx --checkpoint {f}/ck -o {o}/w.onnx",
         "fwd.onnx"),
    case("export-out-equals-step", "export {f}/step.onnx --checkpoint {f}/ck -o "
         "{f}/step.onnx", "step.onnx"),
    case("export-out-equals-checkpoint", "export {f}/step.onnx --checkpoint "
         "{f}/ck/ckpt-000000002.safetensors -o {f}/ck/ckpt-000000002.safetensors",
         "ckpt-000000002.safetensors"),
    case("export-bad-format", "export {f}/step.onnx --checkpoint {f}/ck -o {o}/w.onnx "
         "--format pickle", "pickle"),
    case("export-out-missing-dir", "export {f}/step.onnx --checkpoint {f}/ck -o "
         "{o}/no/w.onnx", "no"),
    case("export-no-checkpoint", "export {f}/step.onnx -o {o}/w.safetensors",
         "--checkpoint"),
    case("export-checkpoint-as-step", "export {f}/ck -o {o}/w.safetensors",
         "memcc export STEP.onnx --checkpoint"),
    # --- tune
    case("tune-budget-words", "tune {f}/dyn.onnx --budget abc --dim batch=1..8", "abc"),
    case("tune-budget-zero", "tune {f}/dyn.onnx --budget 0 --dim batch=1..8", "0"),
    case("tune-no-range", "tune {f}/dyn.onnx --budget 1GB --dim batch=4", "--dim"),
    case("tune-two-ranges", "tune {f}/dyn.onnx --budget 1GB --dim batch=1..4 --dim "
         "seq=1..4", "seq=1..4"),
    case("tune-range-reversed", "tune {f}/dyn.onnx --budget 1GB --dim batch=8..2",
         "8..2"),
    case("tune-no-such-dim", "tune {f}/fwd.onnx --budget 1GB --dim batch=1..8", "batch"),
    case("tune-out-equals-input", "tune {f}/dyn.onnx --budget 1GB --dim batch=1..8 -o "
         "{f}/dyn.onnx", "dyn.onnx"),
    case("tune-plot-missing-dir", "tune {f}/dyn.onnx --budget 1GB --dim batch=1..8 --plot "
         "{o}/no/t.png", "no"),
    case("tune-bad-pick", "tune {f}/dyn.onnx --budget 1GB --dim batch=1..8 --pick best",
         "best"),
    case("tune-bad-lr-rule", "tune {f}/dyn.onnx --budget 1GB --dim batch=1..8 --ref-batch "
         "4 --ref-lr 0.1 --lr-rule cubic", "cubic"),
    case("tune-missing", "tune {f}/nope.onnx --budget 1GB --dim batch=1..8", "nope.onnx"),
    # --- report
    case("report-missing", "report {f}/nope.json", "nope.json"),
    case("report-not-json", "report {f}/notes.txt", "notes.txt"),
    case("report-not-a-report", "report {f}/other.json", "other.json"),
    case("report-dir", "report {f}/adir", "adir"),
    case("report-plot-missing-dir", "report {f}/r.json --plot {o}/nonexistent/p.png",
         "nonexistent"),
    case("report-plot-equals-report", "report {f}/r.json --plot {f}/r.json", "r.json"),
    case("report-plot-is-dir", "report {f}/r.json --plot {o}", "{o}"),
    case("report-plot-bad-format", "report {f}/r.json --plot {o}/p.txt", ".txt"),
    case("report-plot-no-timeline", "report {f}/r-old.json --plot {o}/p.png", "r-old.json"),
    case("run-cuda-graph-on-cpu", "run {f}/step.onnx --cuda-graph",
         "--cuda-graph needs --provider cuda"),
    # --- analyze
    case("analyze-missing", "analyze {f}/nope.onnx", "nope.onnx"),
    case("analyze-dir", "analyze {f}/adir", "adir"),
    case("analyze-text-file", "analyze {f}/notes.txt", "notes.txt"),
    case("analyze-truncated-onnx", "analyze {f}/truncated.onnx", "truncated.onnx"),
    case("analyze-bad-provider", "analyze {f}/step.onnx --provider tpu", "tpu"),
    case("analyze-arena-on-cuda", "analyze {f}/step.onnx --provider cuda --arena", "--arena"),
    case("analyze-dim-unbound", "analyze {f}/dyn.onnx", "batch"),
    case("analyze-bad-time-limit", "analyze {f}/step.onnx --time-limit -1", "-1"),
]


def _snapshot(*dirs: Path) -> dict[str, str]:
    """Every file under ``dirs`` with a digest of its bytes (symlinks by their target)."""
    seen = {}
    for d in dirs:
        for root, subdirs, files in os.walk(d):
            for name in [*files, *subdirs]:
                p = Path(root) / name
                if p.is_symlink():
                    seen[str(p)] = "-> " + os.readlink(p)
                elif p.is_file():
                    seen[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
                else:
                    seen[str(p)] = "dir"
    return seen


def _npz(path: Path, **arrays: np.ndarray) -> None:
    np.savez(path, **arrays)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The shared inputs: a tiny MLP (static and symbolic batch), its step, a checkpoint,
    data, a report, and broken or wrong files of each kind."""
    from memcc import api
    from memcc.backend import checkpoint as ckpt
    from memcc.compiler import CompileOptions, compile_model
    from memcc.frontend.build import BuildOptions
    from memcc.trainer import Trainer

    f = tmp_path_factory.mktemp("inputs")
    small = dict(in_features=8, width=8, depth=1)
    onnx.save(build_model("mlp", batch=4, **small), str(f / "fwd.onnx"))
    onnx.save(build_model("mlp", batch=4, dynamic_batch=True, **small), str(f / "dyn.onnx"))
    lossy = build_model("mlp", batch=4, **small)
    old = lossy.graph.output[0].name
    for n in lossy.graph.node:
        n.output[:] = ["loss" if o == old else o for o in n.output]
    lossy.graph.output[0].name = "loss"
    onnx.save(lossy, str(f / "lossy.onnx"))
    api.build(f / "fwd.onnx", f / "step.onnx")
    api.build(f / "fwd.onnx", f / "step-adamw.onnx", options=BuildOptions(optimizer="adamw"))
    (f / "step-link.onnx").symlink_to("step.onnx")
    os.link(f / "step.onnx", f / "step-hard.onnx")
    (f / "adir").mkdir()
    (f / "notes.txt").write_text("not a model\n")
    (f / "empty.onnx").write_bytes(b"")
    (f / "empty.npz").write_bytes(b"")
    (f / "truncated.onnx").write_bytes((f / "step.onnx").read_bytes()[:200])
    (f / "other.json").write_text('{"hello": 1}\n')

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.integers(0, 10, 16).astype(np.int64)
    _npz(f / "data.npz", input=x, labels=y)
    _npz(f / "names.npz", input=x, targets=y)
    _npz(f / "shape.npz", input=x[:, :5], labels=y)
    _npz(f / "dtype.npz", input=x, labels=y.astype(np.float32))
    _npz(f / "range.npz", input=x, labels=y + 10)
    _npz(f / "few.npz", input=x[:2], labels=y[:2])
    np.savez(f / "pickled.npz", input=np.array([object()] * 16, dtype=object), labels=y)
    np.save(f / "array.npy", x)
    (f / "corrupt.npz").write_bytes(b"PK\x03\x04" + b"\x00garbage" * 64)
    good = (f / "data.npz").read_bytes()
    (f / "truncated.npz").write_bytes(good[: len(good) // 2])
    (f / "shards").mkdir()
    _npz(f / "shards" / "a.npz", input=x, labels=y)
    (f / "shards" / "bad.npz").write_bytes(good[: len(good) // 3])
    with zipfile.ZipFile(f / "shards" / "c.npz", "w") as z:  # valid, never reached
        z.writestr("input.npy", b"")

    trainer = Trainer(f / "step.onnx")
    batch = {"input": x[:4], "labels": y[:4]}
    trainer.step(batch)
    trainer.step(batch)
    trainer.save(f / "ck")
    (f / "badck").mkdir()
    blob = bytearray((f / "ck" / "ckpt-000000002.safetensors").read_bytes())
    blob[-8:] = b"\xff" * 8  # tensor data no longer matches its checksum
    (f / "badck" / "ckpt-000000002.safetensors").write_bytes(bytes(blob))
    ckpt.write_safetensors(f / "foreign.safetensors", {"w": np.zeros(3, np.float32)})

    compile_model(f / "step.onnx", CompileOptions(budget="1GB", cost="analytic"),
                  output=f / "c.onnx", report_path=f / "r.json")
    old = json.loads((f / "r.json").read_text())
    del old["timeline"]
    (f / "r-old.json").write_text(json.dumps(old))
    return f


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_cleanly(bad: Case, inputs: Path, tmp_path: Path) -> None:
    own = tmp_path / "in"  # a copy per case: a case that wrote over an input harms no other
    shutil.copytree(inputs, own, symlinks=True)
    (own / "step-hard.onnx").unlink()
    os.link(own / "step.onnx", own / "step-hard.onnx")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = [a.format(f=own, o=out_dir) for a in bad.args]
    before = _snapshot(own, out_dir)
    cwd = os.getcwd()
    os.chdir(out_dir)  # anything written next to a relative default name lands here
    try:
        result = runner.invoke(app, args)
    finally:
        os.chdir(cwd)
    shown = result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{bad.id}: {type(result.exception).__name__}: {result.exception}\n{shown}")
    assert result.exit_code == 2, f"{bad.id}: exit {result.exit_code}\n{shown}"
    assert "Traceback" not in shown
    # One message, and nothing before it (a report's tables, a summary, a progress line).
    first = shown.strip().splitlines()[0]
    assert first.startswith(("error:", "Usage:")), f"{bad.id}: printed before the error:\n{shown}"
    assert shown.count("error:") <= 1, f"{bad.id}: more than one message:\n{shown}"
    flat = " ".join(shown.replace("│", " ").split())
    want = bad.names.format(f=own, o=out_dir)
    assert want in flat or want in shown, f"{bad.id}: {want!r} not named in:\n{shown}"
    assert not bad.avoid or bad.avoid not in flat, f"{bad.id}: says {bad.avoid!r}:\n{shown}"
    assert _snapshot(own, out_dir) == before, f"{bad.id}: files changed\n{shown}"


def test_the_list_covers_every_command() -> None:
    """At least 59 bad inputs (issue 35's count), and each command has some."""
    assert len(CASES) >= 59
    commands = {c.args[0] for c in CASES}
    assert commands >= {"build", "compile", "run", "train", "export", "tune", "report"}


# ---------------------------------------------------------------------------- options
def _command(name: str):
    import typer

    group = typer.main.get_command(app)
    return group if name == "" else group.commands[name]


BUILD_FLAGS = ("--loss", "--optimizer", "--lr", "--momentum", "--weight-decay", "--freeze",
               "--class-axis", "--ignore-index", "--loss-chunks", "--attention-chunks",
               "--mlp-chunks", "--dim")


@pytest.mark.parametrize("command", ["compile", "tune"])
def test_compile_and_tune_take_every_build_option_as_build_defines_it(command: str) -> None:
    """README: compile and tune build forward models with memcc build's options. Each one
    is there, with build's type, default and help (one definition, not copies)."""
    def by_flag(cmd) -> dict:
        return {o: p for p in cmd.params for o in p.opts}

    build, other = by_flag(_command("build")), by_flag(_command(command))
    for flag in BUILD_FLAGS:
        if command == "tune" and flag == "--dim":
            continue  # tune's --dim also takes the range it searches
        assert flag in other, f"memcc {command} lacks {flag}"
        b, o = build[flag], other[flag]
        if command == "compile" and flag in ("--loss-chunks", "--attention-chunks",
                                             "--mlp-chunks"):
            # compile chooses row chunks not given (compiler/chunk_choice.py): its help says so
            assert o.default is None and "row_chunks" in o.help, flag
            continue
        assert (o.help, o.default, o.multiple, o.metavar) == (b.help, b.default, b.multiple,
                                                              b.metavar), flag
        assert o.type_descriptor.choices == b.type_descriptor.choices, flag


def test_the_choices_the_cli_offers_are_the_ones_memcc_takes() -> None:
    """The CLI writes its choices out (importing their modules would slow every start);
    they must be exactly the values the modules accept."""
    from memcc.backend.session import PROVIDERS
    from memcc.compiler import COST_SOURCES
    from memcc.frontend.build import LOSSES, OPTIMIZERS
    from memcc.passes.planning.planner import STRATEGIES
    from memcc.trainer import EXPORT_FORMATS
    from memcc.tune import LR_RULES, PICKS

    def choices(command: str, flag: str) -> set:
        p = next(p for p in _command(command).params if flag in p.opts)
        return set(p.type_descriptor.choices)

    for command in ("build", "compile", "tune"):
        assert choices(command, "--loss") == set(LOSSES)
        assert choices(command, "--optimizer") == set(OPTIMIZERS)
    for command in ("compile", "tune"):
        assert choices(command, "--strategy") == set(STRATEGIES)
        assert choices(command, "--cost") == set(COST_SOURCES)
    for command in ("compile", "tune", "run", "train"):
        assert choices(command, "--provider") == set(PROVIDERS)
    assert choices("export", "--format") == set(EXPORT_FORMATS)
    assert choices("tune", "--pick") == set(PICKS)
    assert choices("tune", "--lr-rule") == set(LR_RULES)


@pytest.mark.parametrize("command", ["", "build", "compile", "tune", "run", "train",
                                     "export", "report"])
def test_help_shows_no_placeholder_for_flags_and_lists_choices(command: str) -> None:
    """An on/off flag takes no value: its row shows the flag (or --x / --no-x) alone, not
    ``<bool>``; an option with choices lists them rather than ``<str>``."""
    result = runner.invoke(app, [*([command] if command else []), "--help"],
                           env={"COLUMNS": "240"}, terminal_width=240)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    assert "<str>" not in result.output
    listed = {"build": "<cross-entropy|mse|none>", "compile": "<cpu|cuda|auto>",
              "tune": "<fastest|largest>", "run": "<cpu|cuda|auto>",
              "train": "<cpu|cuda|auto>", "export": "<onnx|safetensors>"}
    if command in listed:
        assert listed[command] in result.output


def test_compile_and_tune_build_a_forward_model_with_every_option_and_provider_auto(
        inputs: Path, tmp_path: Path) -> None:
    """--momentum, --weight-decay and --freeze reach the step compile and tune build, and
    --provider auto plans for where the step would run here (as run and train resolve it)."""
    from memcc.backend.session import cuda_available
    from memcc.frontend.load import load_graph
    from memcc.step import TrainingStep

    here = "cuda" if cuda_available() else "cpu"
    flags = ["--momentum", "0.5", "--weight-decay", "0.01", "--freeze", "head.*",
             "--provider", "auto", "--cost", "analytic"]
    out, rep = tmp_path / "c.onnx", tmp_path / "c.json"
    r = runner.invoke(app, ["compile", str(inputs / "fwd.onnx"), "--budget", "1GB", "-o",
                            str(out), "--report", str(rep), *flags])
    assert r.exit_code == 0, r.output
    assert json.loads(rep.read_text())["options"]["provider"] == here
    tuned = tmp_path / "t.onnx"
    r = runner.invoke(app, ["tune", str(inputs / "dyn.onnx"), "--budget", "1GB", "--dim",
                            "batch=1..8", "-o", str(tuned), *flags])
    assert r.exit_code == 0, r.output
    for path in (out, tuned):
        step = TrainingStep.of(load_graph(path))
        assert step.optimizer["momentum"] == 0.5 and step.optimizer["weight_decay"] == 0.01
        assert step.parameters and not any(p.startswith("head.") for p in step.parameters)


def test_build_options_given_with_a_training_step_are_named_as_ignored(
        inputs: Path, tmp_path: Path) -> None:
    """A step keeps the options it was built with: compile says so instead of silently
    dropping --freeze and the like."""
    r = runner.invoke(app, ["compile", str(inputs / "step.onnx"), "--budget", "1GB", "-o",
                            str(tmp_path / "c.onnx"), "--cost", "analytic", "--freeze",
                            "head.*"])
    assert r.exit_code == 0, r.output
    assert "already a training step" in r.output and "ignored" in r.output


# ---------------------------------------------------------------------------- budgets
@pytest.mark.parametrize("extra", [{}, {"arena": True}, {"provider": "cuda", "offload": False}],
                         ids=["cpu", "cpu-arena", "cuda"])
def test_an_impossible_budget_is_refused_before_any_search_with_a_true_bound(
        inputs: Path, extra: dict) -> None:
    """A budget below what the inputs, parameters and state alone take (plus the margin)
    is refused before the cost model or the planner runs, and the bound it names is never
    above the smallest budget the search finds (so it refuses nothing that fits)."""
    from memcc.compiler import CompileOptions, compile_model
    from memcc.passes.planning.planner import BudgetError

    said: list[str] = []
    options = CompileOptions(budget="1KB", cost="analytic", **extra)
    with pytest.raises(BudgetError) as refused:
        compile_model(inputs / "step.onnx", options, progress=said.append)
    assert said == ["load ..."], said
    assert "--budget 1KB" in str(refused.value) and "--budget min" in str(refused.value)
    smallest = compile_model(inputs / "step.onnx",
                             CompileOptions(budget="min", cost="analytic", **extra))
    assert refused.value.smallest <= smallest.report["budget_bytes"]


def test_a_refusal_the_clock_decided_says_so(inputs: Path) -> None:
    """A budget the search ran out of --time-limit on is refused with a word on the clock
    (a walk-through's GPT-2 was refused 10.03 MB at --time-limit 0.5 and fitted it at 30:
    the message blamed the budget alone)."""
    from memcc.compiler import CompileOptions, compile_model
    from memcc.passes.planning.planner import BudgetError

    smallest = compile_model(inputs / "step.onnx", CompileOptions(budget="min",
                                                                   cost="analytic"))
    under = smallest.report["budget_bytes"] - 1
    with pytest.raises(BudgetError) as refused:
        compile_model(inputs / "step.onnx", CompileOptions(budget=str(under), cost="analytic",
                                                           time_limit=0.001))
    assert "cut short by the time --time-limit gave it" in str(refused.value)
