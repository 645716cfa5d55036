"""``memcc export --eval`` against PyTorch's eval mode on every family of tests/exports.py.

Each family is exported in train mode with Dropout 0.1 by each exporter, built (SGD,
learning rate 0.1), trained two steps on its example batch, checkpointed and exported with
``--eval`` (ONNX) and as safetensors. The safetensors are loaded into the PyTorch module
(``strict=False``; keys PyTorch wanted and did not get are counted), the module is put in
eval mode, and its output on the example batch is held against ONNX Runtime's run of the
eval model (2 threads): the largest difference over the largest output; then the same at
other sizes (batch 1, then batch 3 with 3 more tokens where the family has a sequence; "built
sizes only" where export kept the sizes the step was built at, and why); the last column the
same for the plain export, which keeps train mode. A row says what export printed or
refused.

    python benchmarks/export_eval_sweep.py [--families convnet,gpt2] [--exporters torchscript]
        [--row-chunks 2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]
from exports import (  # noqa: E402  (tests/exports.py)
    DYNAMO_NOOPT,
    EXPORTERS,
    FAMILIES,
    export,
    family,
    make_inputs,
    torch_forward,
)


def check(family: str, exporter: str, chunks: int = 1) -> str:
    """One row of the table (without its first two cells)."""
    import safetensors.torch
    import torch
    from typer.testing import CliRunner

    from memcc import api
    from memcc.cli import app
    from memcc.frontend.build import BuildOptions
    from memcc.trainer import Trainer

    try:
        path, module, inputs, dims = export(family, exporter, training=True, dropout=0.1)
    except Exception as exc:  # noqa: BLE001  (the exporter's own failure: a row)
        return f"torch.onnx.export failed: {type(exc).__name__} | - | - | -"
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = Path(tmp)
        try:
            graph = api.build(path, d / "s.onnx", dims=dims,
                              options=BuildOptions(optimizer="sgd", lr=0.1,
                                                   attention_chunks=chunks if chunks > 1
                                                   else None,
                                                   mlp_chunks=chunks + 1 if chunks > 1
                                                   else None))
        except Exception as exc:  # noqa: BLE001  (a row, not a crash)
            return f"build refused: {str(exc)[:80]} | - | - | -"
        trainer = Trainer(d / "s.onnx")
        logits = trainer.spec.forward_outputs[0]
        classes = int(graph.info[logits].shape[-1])
        shape = graph.info[trainer.spec.data_inputs[-1]].shape
        labels = np.random.default_rng(0).integers(0, classes, size=shape).astype(np.int64)
        for _ in range(2):
            trainer.step({**inputs, trainer.spec.data_inputs[-1]: labels})
        trainer.save(d / "ck")
        runner = CliRunner()
        with contextlib.redirect_stderr(io.StringIO()):
            r = runner.invoke(app, ["export", str(d / "s.onnx"), "--checkpoint", str(d / "ck"),
                                    "-o", str(d / "e.onnx"), "--eval"])
            w = runner.invoke(app, ["export", str(d / "s.onnx"), "--checkpoint", str(d / "ck"),
                                    "-o", str(d / "w.safetensors")])
            runner.invoke(app, ["export", str(d / "s.onnx"), "--checkpoint", str(d / "ck"),
                                "-o", str(d / "t.onnx")])
        said = " ".join(r.output.split())
        if r.exit_code != 0:
            return f"refused: {said[:120]} | - | - | -"
        if w.exit_code != 0:
            return f"{said[:100]} | safetensors failed | - | -"
        missing, unexpected = module.load_state_dict(
            safetensors.torch.load_file(d / "w.safetensors"), strict=False)
        missing = [k for k in missing if not k.endswith("num_batches_tracked")]
        module.eval()
        with torch.no_grad():
            want = module(**{k: torch.from_numpy(v) for k, v in inputs.items()}).numpy()
        note = said.split("wrote")[0].split("warning:")[0].replace("eval mode: ", "")
        note = note.strip() or "-"
        return (f"{note} | {len(missing)} missing, {len(unexpected)} unexpected | "
                f"{_gap(d / 'e.onnx', inputs, want):.1e} | "
                f"{_other_sizes(family, d / 'e.onnx', module, said)} | "
                f"{_gap(d / 't.onnx', inputs, want):.1e}")


def _other_sizes(family_name: str, path: Path, module, said: str) -> str:
    """The eval model against the module in eval mode at batch 1, and at batch 3 with 3
    more tokens (where the family has a sequence): the larger gap, or why not run."""
    if "written at the sizes" in said:
        return "built sizes only: " + said.split("ONNX Runtime failed:")[-1][:60]
    sizes = family(family_name).sizes
    tries = [{"batch": 1}, {"batch": 3, **({"seq": sizes["seq"] + 3} if "seq" in sizes
                                            else {})}]
    gaps = []
    for extra in tries:
        feeds = {k: v.numpy() for k, v in make_inputs(family_name, extra, seed=7).items()}
        gaps.append(_gap(path, feeds, torch_forward(module, feeds)))
    return f"{max(gaps):.1e}"


def _gap(path: Path, inputs: dict, want: np.ndarray) -> float:
    """ORT's run of ``path`` (2 threads, default session) against ``want``: the largest
    difference over the largest output."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    got = sess.run(None, {i.name: inputs[i.name] for i in sess.get_inputs()})[0]
    return float(np.abs(got - want).max() / np.abs(want).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--exporters", default=",".join((*EXPORTERS, DYNAMO_NOOPT)))
    ap.add_argument("--row-chunks", type=int, default=1,
                    help="K > 1: build with --attention-chunks K --mlp-chunks K+1 (families "
                         "with both: GPT-2, Llama, BERT, ViT)")
    a = ap.parse_args()
    print("| family | exporter | export --eval said | state_dict keys | eval model vs torch "
          "eval | at other sizes | plain export (train mode kept) vs torch eval |\n"
          "|---|---|---|---|---|---|---|")
    for name in a.families.split(","):
        for exporter in a.exporters.split(","):
            print(f"| {name} | {exporter} | {check(name, exporter, a.row_chunks)} |",
                  flush=True)


if __name__ == "__main__":
    main()
