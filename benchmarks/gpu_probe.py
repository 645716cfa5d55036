"""Whether onnxruntime-gpu runs on this machine: versions, providers, a one-node CUDA session.

Exits 3, with ``ldd``'s list of what the CUDA provider library cannot find, when the
session falls back to the CPU. Run by ``benchmarks/gpu_setup.sh`` (docs/CUDA.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper


def main() -> int:
    print("onnxruntime", ort.__version__, ort.__file__, "onnx", onnx.__version__)
    print("available", ort.get_available_providers())
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(),
                                providers=["CUDAExecutionProvider"])
    print("session providers", sess.get_providers())
    print("result", sess.run(None, {"x": np.arange(4, dtype=np.float32)})[0])
    if "CUDAExecutionProvider" not in sess.get_providers():
        lib = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
        print(subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout)
        return 3
    for name in ("pulp", "highspy", "onnx_graphsurgeon", "pynvml"):
        __import__(name)
    print("pulp, highspy, onnx_graphsurgeon, pynvml: importable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
