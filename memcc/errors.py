"""One exception tree for the whole package.

The CLI turns any ``MemccError`` into a one-paragraph message and a non-zero exit, so every
error says what went wrong, where (file, node, value) and what the user can do about it.
"""

from __future__ import annotations


class MemccError(Exception):
    """Base class: anything memcc reports to a user as a failure of their input or plan."""


class InputError(MemccError):
    """The model file or a command-line value cannot be used as given."""


class ShapeError(MemccError):
    """A value has no concrete shape or dtype after binding dimensions and inference."""


class UnsupportedOpError(MemccError):
    """The gradient builder met an operator it has no rule for."""


class GradientError(MemccError):
    """A gradient rule cannot differentiate this particular use of a supported operator."""


class RuntimeFailure(MemccError):
    """ONNX Runtime refused or failed to run a graph that memcc produced or was given."""
