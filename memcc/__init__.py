"""memcc: an ahead-of-time memory compiler for ONNX training graphs."""

__version__ = "0.1.0"
