"""memcc: an ahead-of-time memory compiler for ONNX training graphs."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``memcc.Trainer`` without importing ONNX Runtime on ``import memcc`` (the CLI's
    start-up and ``--version`` stay fast)."""
    if name == "Trainer":
        from memcc.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'memcc' has no attribute {name!r}")


__all__ = ["Trainer", "__version__"]
