"""The counter hash every random draw of a training step uses (numpy reference): a uint32
hash of (seed, step, element index) that the ONNX generator in ``dropout_masks.py``
computes node for node, so a resumed run draws what the uninterrupted one did. Dropout
masks (``dropout_masks.py``) and the random uniforms and normals (``random_draws.py``) read
it; it lives apart so that neither imports the other.
"""

from __future__ import annotations

import zlib

import numpy as np

# Odd multipliers (from the published 32-bit integer hash constants); M2 mixes the step.
M0, M1, M2 = 0x7FEB352D, 0x846CA68B, 0x9E3779B1
K2_SALT = 0x6A09E667
SHIFT = 1 << 16
U32 = np.uint32


def _mix(h: np.ndarray, add: np.ndarray | int) -> np.ndarray:
    """The element hash after its first multiply (uint32, wrapping)."""
    h = h * h + U32(add)
    h = h + h // U32(SHIFT)
    return h * U32(M1)


def step_keys(seed: int, step: int) -> tuple[int, int]:
    """The two per-(node, step) keys of the element hash."""
    with np.errstate(over="ignore"):
        s = U32(step % (1 << 32)) * U32(M2) + U32(seed % (1 << 32))
        k1 = _mix(s * U32(M0), K2_SALT)
        k2 = _mix((k1 + U32(K2_SALT)) * U32(M0), M2)
    return int(k1), int(k2)


def dropout_hash(seed: int, step: int, shape: tuple[int, ...]) -> np.ndarray:
    """The uint32 hash of every element of a tensor of ``shape`` (numpy reference)."""
    k1, k2 = step_keys(seed, step)
    with np.errstate(over="ignore"):
        i = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
        h = ((i % (1 << 32)).astype(U32) + U32(k1)) * U32(M0)
        return _mix(h, k2).reshape(shape)


def name_seed(name: str, salt: str = "") -> int:
    """A random op's seed made from its node name (and a salt: a row chunk, a resumed
    step), so that no two ops share a sequence and a rewrite that keeps the name keeps the
    draw."""
    return zlib.crc32((name + salt).encode()) & 0x7FFFFFFF
