"""What ``memcc build`` tells the user about the exported parameters, as warnings.

In: each trained parameter's ``ParameterSource`` (``exported.parameter_sources``), the
dynamo export's signature and ``ExportMap`` where the file has them. Out: warnings, nothing
else. Said here: parameters under made-up names (folded copies, eval-mode exports whose
BatchNorms went into the convolutions), weight tying split into copies, and from the dynamo
exporter's records the PyTorch parameters its optimizer merged, folded into constants,
merged into another's folded constant (``merged_folds``) or folded into a lookup of some of
their rows, each with what the step trains instead and how to export to train every
parameter on its own (``KEEP_EVERY_PARAMETER``).
"""

from __future__ import annotations

import warnings

from memcc.frontend.export_map import ExportMap
from memcc.frontend.export_signature import (
    ExportNote,
    ExportWarning,
    Signature,
    folding_arithmetic,
)
from memcc.frontend.exported import ParameterSource

# How to export so that every PyTorch parameter keeps an initializer of its own.
KEEP_EVERY_PARAMETER = "torch.onnx.export(..., dynamo=True, optimize=False)"


def _some(names: list[str] | tuple[str, ...], k: int = 6) -> str:
    return ", ".join(names[:k]) + (f" (+{len(names) - k} more)" if len(names) > k else "")


def _copies_of_nothing(unnamed: list[str], sources: dict[str, ParameterSource]) -> str:
    """What to say of made-up names that copy no parameter memcc can see: buffers the
    exporter's optimizer folded look so (Llama's rotary cos and sin tables, ``unsqueeze_N``
    of a dynamo export with ``optimize=True``), and PyTorch trains no buffer."""
    orphans = [p for p in unnamed if not sources[p].copy_of and not sources[p].pytorch_names]
    if not orphans:
        return ""
    flags = " ".join(f"--freeze '{p}'" for p in orphans[:4])
    return (f" {len(orphans)} of them copy no parameter memcc can see "
            f"({_some(orphans, 4)}): buffers the exporter folded look like that (rotary "
            "position tables do), and PyTorch does not train buffers; if these are, keep them "
            f"fixed with {flags}{' ...' if len(orphans) > 4 else ''}.")


def report_parameters(sources: dict[str, ParameterSource], source: str,
                      sig: Signature | None, emap: ExportMap | None = None) -> None:
    """Warn about parameters without a PyTorch name, about weight tying, and (from the
    dynamo exporter's records) about PyTorch parameters the exporter merged or folded."""
    # Copies whose op is known go back under their parameter's name: no warning. Rows
    # looked up from a parameter get a warning of their own (``_report_lookups``).
    unnamed = [p for p, s in sources.items() if not s.named and not s.copy_op
               and not s.rows_of]
    if unnamed:
        shown = _some([p + (f" (folded from {', '.join(sources[p].copy_of)})"
                            if sources[p].copy_of else "") for p in unnamed])
        conv_folded = sum(p.startswith("onnx::Conv_") for p in unnamed)
        if conv_folded:  # its own short warning first: the step trains another model
            warnings.warn(
                f"{source}: exported in eval mode, its BatchNorms folded into the "
                f"convolutions ({conv_folded} parameters named onnx::Conv_N): the step "
                "trains without "
                "BatchNorm and its batch statistics, unlike PyTorch in train mode. Export "
                "with model.train() and torch.onnx.export(..., training=torch.onnx."
                "TrainingMode.TRAINING, do_constant_folding=False) to train it as PyTorch "
                "does.", ExportWarning, stacklevel=2)
        warnings.warn(
            f"{source}: {len(unnamed)} trained parameter(s) have names the exporter made up, "
            f"not PyTorch state_dict names: {shown}. They are folded copies (pre-transposed "
            f"weights, constant-folded lookups). To map trained weights back by name, "
            f"export with {KEEP_EVERY_PARAMETER} or with dynamo=False, "
            "training=torch.onnx.TrainingMode.TRAINING and do_constant_folding=False (its "
            "constant folding, on by default, makes the copies in train mode too)."
            + _copies_of_nothing(unnamed, sources), ExportWarning, stacklevel=2)
    if emap is not None:
        _report_export_map(sources, source, emap)
    elif sig is not None:
        missing = sorted(sig.parameters - set(sources))
        if missing and unnamed:
            warnings.warn(
                f"{source}: PyTorch parameters not trained under their own name: "
                f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} (folded into "
                "the copies above, or not on a path to the loss).", ExportWarning,
                stacklevel=2)
    tied = sorted({tuple(sorted((p, *s.tied_with))) for p, s in sources.items()
                   if s.tied_with})
    if tied:
        groups = "; ".join(" = ".join(g) for g in tied[:4])
        warnings.warn(
            f"{source}: {len(tied)} group(s) of parameters hold the same values (weight "
            f"tying split into copies by the exporter, possibly transposed): {groups}. "
            "memcc trains each copy separately, so they drift apart; torch would train one "
            "tensor where they are copies of one parameter (not where they are distinct "
            "parameters that were equal at export, such as deep-copied layers).",
            ExportWarning, stacklevel=2)


def _report_export_map(sources: dict[str, ParameterSource], source: str,
                       emap: ExportMap) -> None:
    """Name every PyTorch parameter the exporter's optimizer merged into another or folded
    into a constant: the step as exported trains a different model than torch would."""
    _report_lookups(sources, source, emap)
    computed = [(c, torch_name, op) for c, (torch_name, init, op) in emap.computed.items()
                if init in sources and init not in emap.lookups]
    if computed:
        what = {"Identity": "an exact", "Transpose": "a transposed", "Reshape": "a reshaped",
                "Expand": "a broadcast (per batch slot)"}
        told = "; ".join(f"{c} was {what[op.split('(')[0]]} copy of {n}: now computed from it "
                         f"({op}), trained as one" for c, n, op in computed[:4])
        more = f" (+{len(computed) - 4} more)" if len(computed) > 4 else ""
        warnings.warn(
            f"{source}: {told}{more}. The exporter's optimizer had folded "
            f"{'this op' if len(computed) == 1 else 'these ops'} on the parameter into a "
            "constant (checked: equal bit for bit); memcc computes the copy from the "
            "parameter again, so the step trains one tensor, as PyTorch does.",
            ExportNote, stacklevel=3)
    merged = {p: s.merged for p, s in sources.items() if s.merged and s.pytorch_names}
    _report_merged_folds(sources, source, emap)
    if merged:
        n = sum(len(m) for m in merged.values())
        groups = "; ".join(f"{', '.join(m)} -> {p}" for p, m in list(merged.items())[:4])
        more = f" (+{len(merged) - 4} more groups)" if len(merged) > 4 else ""
        warnings.warn(
            f"{source}: the exporter's optimizer merged {n} PyTorch parameter(s) into "
            f"{len(merged)} initializer(s) that held equal values at export (freshly "
            f"initialised weights): {groups}{more}. memcc trains each group as one tied "
            "parameter: a different model from PyTorch's, which trains them apart; memcc "
            "export --format safetensors writes the group's trained value under every name. "
            f"To train every parameter on its own, export with {KEEP_EVERY_PARAMETER} (or "
            "give them distinct values before exporting).", ExportWarning, stacklevel=3)
    looked_up = {s.rows_of for s in sources.values() if s.rows_of}
    folded = [p for p in emap.folded if p not in looked_up]
    if folded:
        warnings.warn(
            f"{source}: {len(folded)} PyTorch parameter(s) are no longer in the file: "
            "the exporter's optimizer folded them into constants (a zero bias it removed) "
            "or into other weights (a BatchNorm into its convolution, an LSTM's or GRU's "
            f"weights into its gate-ordered W, R and B): {_some(folded)}. What was "
            "folded into a constant stays fixed at its value at export; a weight it was "
            "folded into trains under the exporter's name. memcc export writes no value for "
            "them under their PyTorch names (load with load_state_dict(..., strict=False): "
            "the module keeps the values it was exported with). To train and export them "
            f"as PyTorch has them, export with {KEEP_EVERY_PARAMETER}.", ExportWarning,
            stacklevel=3)
    if emap.unused:
        maybe = "".join(f" {n} may be a second name of one of {', '.join(c)}, or of none: "
                        "the records do not say which, so it gets no value." for n, c in
                        list(emap.maybe_tied.items())[:2])
        warnings.warn(
            f"{source}: {len(emap.unused)} PyTorch parameter(s) are not read by the exported "
            f"model and have no trained value: {_some(emap.unused)}. (Where torch ties one "
            "to another parameter, one tensor under two names, no record said which: load "
            f"with load_state_dict(..., strict=False).){maybe}", ExportWarning, stacklevel=3)


def _report_merged_folds(sources: dict[str, ParameterSource], source: str,
                         emap: ExportMap) -> None:
    """Name the parameters the optimizer merged into another's folded constant that the
    step trains under a made-up name (``merged_folds``): torch trains them apart, and no
    value is written back for either."""
    told = [f"{', '.join(s.merged)} with "
            f"{s.rows_of or ', '.join(s.copy_of) or 'another parameter'} "
            f"(trained as one, '{p}')" for p, s in sources.items()
            if s.merged and not s.pytorch_names]
    if told:
        warnings.warn(
            f"{source}: {len(told)} PyTorch parameter(s) held the same values at export as "
            "another, and the exporter's optimizer merged the constant it folded from each "
            f"into the other's: {_some(told, 4)}. The step trains one value where PyTorch "
            "trains two (the first loss matches; later steps drift apart), and memcc export "
            "writes neither back under its PyTorch name. To train each on its own, export "
            f"with {KEEP_EVERY_PARAMETER} (or give them distinct values before exporting).",
            ExportWarning, stacklevel=4)


def _report_lookups(sources: dict[str, ParameterSource], source: str,
                    emap: ExportMap) -> None:
    """Name every PyTorch parameter the exporter's optimizer folded into a lookup of some of
    its rows (``ExportMap.lookups``), and what the step trains instead."""
    rows = {p: s.rows_of for p, s in sources.items() if s.rows_of}
    computed = {p: param for p, param in rows.items() if folding_arithmetic(p)}
    _report_computed_folds(computed, source)
    rows = {p: param for p, param in rows.items() if p not in computed}
    if not rows:
        return
    shared = {init for c, (_, init, _) in emap.computed.items() if init in rows}
    told = "; ".join(
        f"{param} was folded into a lookup of some of its rows, which memcc trains as "
        f"'{p}'" + (" (one value shared by every batch slot, and by every position where each "
                     "held the same row)" if p in shared else "")
        for p, param in list(rows.items())[:4])
    more = f" (+{len(rows) - 4} more)" if len(rows) > 4 else ""
    warnings.warn(
        f"{source}: {told}{more}. The exporter's optimizer looked the rows up at the "
        "sizes the model was traced at (a position table at a static length) and folded "
        "them into a constant: the step trains those rows, as PyTorch would, but not the "
        "table, and memcc export cannot write the table back from them: PyTorch keeps its "
        "own values for it (load_state_dict(..., strict=False)). To train the table, "
        f"export with {KEEP_EVERY_PARAMETER} (or with dynamic shapes).", ExportWarning,
        stacklevel=4)


def _report_computed_folds(computed: dict[str, str], source: str) -> None:
    """Name the PyTorch parameters the optimizer folded by arithmetic (Gemma's RMSNorm
    weight into ``add_4`` = 1 + weight, Mamba's ``-exp(A_log)`` into ``neg``): no table and
    no rows, but a value the step trains in the parameter's place, which export does not
    turn back into the parameter (the file does not keep the constants such ops read)."""
    if not computed:
        return
    told = "; ".join(f"{param} into '{p}' (by '{folding_arithmetic(p)}')"
                     for p, param in list(computed.items())[:4])
    more = f" (+{len(computed) - 4} more)" if len(computed) > 4 else ""
    warnings.warn(
        f"{source}: the exporter's optimizer folded {len(computed)} PyTorch parameter(s) "
        f"into values computed from them: {told}{more}. The step trains each computed "
        "value, not the parameter, and memcc export does not compute the parameter back "
        "(the file keeps no record of the constants such ops read) and does not write it "
        "(load_state_dict(..., strict=False) keeps the module's own value). To train and "
        f"export it, export with {KEEP_EVERY_PARAMETER}.", ExportWarning, stacklevel=5)
