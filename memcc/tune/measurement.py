"""``memcc tune --measure``: run the sizes with the highest predicted throughput in ONNX
Runtime and put the measured step time and peak next to the prediction.

Apart from the search: a ``TuneResult`` enters, the same result with measured values
leaves; nothing here plans.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from memcc.tune.options import Say
from memcc.tune.results import TuneResult


# ---------------------------------------------------------------------------- measuring
def measure(result: TuneResult, *, top: int = 3, steps: int = 3, provider: str = "cpu",
            progress: Say | None = None) -> TuneResult:
    """Run the ``top`` sizes by predicted throughput in ONNX Runtime (``memcc run``'s
    runner: peak in a fresh process, times in another) and return the result with their
    measured step time and peak. The prediction ranks sizes; this says whether the ranking
    holds on this machine. Each step is written to a temporary directory, then removed."""
    import tempfile

    from memcc.backend.runner import RunRequest, run_steps

    say = progress or (lambda _m: None)
    timed = sorted((c for c in result.candidates if c.samples_per_s is not None
                    and c.batch in result.steps), key=lambda c: -(c.samples_per_s or 0))
    from memcc.backend.step_feeds import refuse_bfloat16_feeds

    for c in timed[:top]:  # before any of them runs
        refuse_bfloat16_feeds(result.steps[c.batch], source=result.model,
                              doing="measure the sizes (--measure runs their steps)",
                              instead="Without --measure, tune ranks the sizes by their "
                                      "predicted times")
    measured: dict[int, tuple[float, int | None]] = {}
    with tempfile.TemporaryDirectory(prefix="memcc-tune-") as tmp:
        for c in timed[:top]:
            say(f"{result.range.dim}={c.batch}: measuring {steps} steps in ONNX Runtime")
            path = Path(tmp) / f"{result.range.dim}{c.batch}.onnx"
            from memcc.backend.onnx_file import save_graph

            save_graph(result.steps[c.batch], path)
            run = run_steps(path, RunRequest(steps=steps, provider=provider))
            measured[c.batch] = (run.step_time_s, run.measured_peak_bytes)
            path.unlink()
    cands = tuple(replace(c, measured_step_s=measured[c.batch][0],
                          measured_peak_bytes=measured[c.batch][1])
                  if c.batch in measured else c for c in result.candidates)
    return replace(result, candidates=cands)
