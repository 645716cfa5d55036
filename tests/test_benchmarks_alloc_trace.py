"""benchmarks/alloc_trace.py: the first measured step's traced peak, read from the log."""

from __future__ import annotations

from benchmarks import alloc_trace


def test_the_traced_peak_counts_only_what_the_step_allocated(tmp_path):
    log = tmp_path / "alloc.log"
    log.write_text("\n".join([
        "a0 8192 libstdc++.so.6:_ZnwmSt11align_val_t+46",   # before the step: not its own
        "0 0 mark:1",
        "b0 36864 libstdc++.so.6:_Znwm+1c lib_onnxruntime.so:?+43f88a",
        "c0 135168 libstdc++.so.6:_ZnwmSt11align_val_t+46",
        "d0 40",
        "a0 -8192",                                          # freed in the step
        "e0 69632 libstdc++.so.6:_ZnwmSt11align_val_t+46",   # the peak: 36864+135168+40+69632-8192
        "c0 -135168",
        "0 0 mark:2",
        "f0 1000000 after the step"]))
    step = alloc_trace._read_log(log)
    assert step.start_bytes == 8192
    assert step.peak_bytes == 8192 + 36864 + 135168 + 40 - 8192 + 69632
    kinds = sorted((alloc_trace._kind(a), a.bytes) for a in step.peak_live.values())
    assert kinds == [("heap", 40), ("ort", 36864), ("tensor", 69632), ("tensor", 135168)]
    ort = next(a for a in step.allocs if a.bytes == 36864)
    assert (ort.at, ort.end) == (1, step.events)   # lived to the end of the step
