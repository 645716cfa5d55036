"""``python -m models NAME -o FILE.onnx [options]``: write a zoo model to disk.

Common sizes have flags; any other builder option goes through ``-O key=value`` (values are
Python literals: ``-O blocks=[3,4,23,3]``, ``-O tie_embeddings=False``). Files whose weights
pass 1.8 GB are written with external data next to the model, since protobuf cannot
serialise messages over 2 GB.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
from pathlib import Path

import onnx

from models import MODELS, PRESETS, SIGNATURES, build_model, model_meta

EXTERNAL_DATA_THRESHOLD = int(1.8e9)
# torch buffers, not parameters
_BUFFER_SUFFIXES = (".running_mean", ".running_var")

# flag -> builder option
_FLAGS = {
    "batch": int, "resolution": int, "seq_len": int, "width": int, "depth": int,
    "heads": int, "vocab_size": int, "num_classes": int, "num_labels": int,
    "width_mult": float, "seed": int,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        print(list_models())
        return 0
    if not args.name or not args.output:
        print("error: NAME and -o FILE are required (or --list)", file=sys.stderr)
        return 2
    if args.name not in MODELS:
        print(f"error: unknown model {args.name!r}; known: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    try:
        options = _options(args)
        model = build_model(args.name, preset=args.preset, **options)
    except (ValueError, KeyError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    nbytes = save(model, args.output)
    params = sum(_numel(t) for t in model.graph.initializer)
    print(f"wrote {args.output}: {args.name}, {params:,} initializer elements, {nbytes:,} bytes "
          f"of weights, {len(model.graph.node)} nodes")
    return 0


def list_models(width: int = 100) -> str:
    """Every family with the sizes it gets when no option is given, and its presets.

    A bare ``python -m models gpt2 -o f.onnx`` builds a tiny model (the defaults exist for
    tests), so a user must see what they would get before asking for real sizes. The
    defaults are read back from the model the builder stamps (``memcc.zoo.options``), so
    values a builder derives (ResNet-50's ``blocks``, GPT-2's ``n_positions``) show as
    built; building them all takes well under a second and needs no torch.
    """
    lines = textwrap.wrap(
        "Each model with the options it is built with when none is given (tiny sizes, for "
        "tests) and its parameter count at those sizes; --preset NAME gives real sizes. Change "
        "any option with -O KEY=VALUE, or with its flag where one exists (--batch, --width, "
        "--seq-len, ...).", width, break_on_hyphens=False)
    labels = ["defaults"] + [f"--preset {p}" for presets in PRESETS.values() for p in presets]
    indent = max(map(len, labels)) + 3
    for name in MODELS:
        model = build_model(name)
        built = model_meta(model).get("options", {})
        defaults = _defaults(name)
        values = {k: built.get(k, defaults.get(k)) for k in _accepted(name)}
        lines += ["", f"{name} ({parameter_count(model):,} parameters at the defaults)"]
        lines += _wrapped("defaults", values, indent, width)
        for preset, opts in PRESETS.get(name, {}).items():
            lines += _wrapped(f"--preset {preset}", opts, indent, width)
    return "\n".join(lines)


def parameter_count(model: onnx.ModelProto) -> int:
    """Trainable values as torch counts them: initializers minus BatchNorm running stats."""
    return sum(_numel(t) for t in model.graph.initializer
               if not t.name.endswith(_BUFFER_SUFFIXES))


def save(model: onnx.ModelProto, path: str | Path) -> int:
    """onnx.save, with external data once the weights would not fit one protobuf message."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbytes = sum(len(t.raw_data) for t in model.graph.initializer)
    if nbytes > EXTERNAL_DATA_THRESHOLD:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save(model, str(path))
    return nbytes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("-o", "--output", help="where to write the .onnx file")
    p.add_argument("--preset", help="benchmark size (see --list); explicit options win")
    p.add_argument("--dynamic-batch", action="store_true",
                   help="declare the batch dimension symbolic ('batch')")
    for flag, typ in _FLAGS.items():
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=typ, default=None)
    p.add_argument("-O", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other builder option, value as a Python literal")
    p.add_argument("--list", action="store_true",
                   help="list the models: default sizes, parameter counts, presets")
    return p


def _options(args: argparse.Namespace) -> dict[str, object]:
    options: dict[str, object] = {k: getattr(args, k) for k in _FLAGS
                                  if getattr(args, k) is not None}
    if args.dynamic_batch:
        options["dynamic_batch"] = True
    for item in args.option:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"-O {item!r}: expected KEY=VALUE")
        try:
            options[key.strip()] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key.strip()] = text
    accepted = _accepted(args.name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"{args.name} has no option {', '.join(unknown)}; "
                         f"its options: {', '.join(accepted)}")
    return options


def _accepted(name: str) -> list[str]:
    params = inspect.signature(SIGNATURES[name]).parameters
    return [p for p in params if p != "arch"]


def _defaults(name: str) -> dict[str, object]:
    params = inspect.signature(SIGNATURES[name]).parameters
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}


def _wrapped(label: str, values: dict[str, object], indent: int, width: int) -> list[str]:
    """``KEY=VALUE`` pairs as ``-O`` takes them (no spaces inside a value), wrapped."""
    text = " ".join(f"{k}={v!r}".replace(" ", "") for k, v in values.items())
    return textwrap.wrap(text, width, initial_indent=f"  {label:{indent - 2}s}",
                         subsequent_indent=" " * indent, break_on_hyphens=False)


def _numel(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
