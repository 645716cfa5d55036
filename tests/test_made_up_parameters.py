"""memcc/frontend/exported.py: what build says of parameters under made-up names."""

from __future__ import annotations

import warnings

from memcc.frontend.exported import ParameterSource
from memcc.frontend.parameter_report import report_parameters


def _said(sources: dict[str, ParameterSource]) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report_parameters(sources, "m.onnx", None)
    return " ".join(str(w.message) for w in caught)


def test_a_made_up_name_that_copies_no_parameter_is_offered_a_freeze():
    """A dynamo export with optimize=True folds Llama's rotary cos and sin buffers into
    `unsqueeze_N` initializers, which memcc trains as parameters (a walk-through saw them
    move by 7.9e-6 in 8 steps and a strict load refuse them): build names them and gives
    the --freeze that keeps them fixed; a copy of a known parameter gets no such advice."""
    sources = {
        "unsqueeze_14": ParameterSource("unsqueeze_14", named=False),
        "val_3": ParameterSource("val_3", named=False, copy_of=("w",)),
        "w2": ParameterSource("w2", named=True, pytorch_names=("w2",)),
    }
    said = _said(sources)
    assert "1 of them copy no parameter memcc can see (unsqueeze_14)" in said, said
    assert "--freeze 'unsqueeze_14'" in said and "--freeze 'val_3'" not in said, said
    del sources["unsqueeze_14"]
    assert "copy no parameter" not in _said(sources)
