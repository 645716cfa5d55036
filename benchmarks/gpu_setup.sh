#!/usr/bin/env bash
# On the GPU machine (no network): install onnxruntime-gpu and memcc's small dependencies
# from what earlier calls carried there, and write /tmp/env.sh for every later call.
# docs/CUDA.md, "Setting up onnxruntime-gpu on the GPU machine", says how the parts get there:
#   /tmp/parts/p*  the onnxruntime-gpu wheel's contents as an xz tarball, split in 55 MB parts
#   /tmp/whl/*.whl pulp, highspy, onnx, onnx-graphsurgeon
set -euo pipefail
cat /tmp/parts/p* > /tmp/ort.tar.xz
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site /tmp/whl/*.whl
tar -C /tmp/site -xJf /tmp/ort.tar.xz
# TensorRT is not installed there; ORT would log an error for its provider library.
rm -f /tmp/site/onnxruntime/capi/libonnxruntime_providers_tensorrt.so
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
NV=$(python3 -c "import glob, os, sys; print(':'.join(sorted({os.path.dirname(p) for p in \
glob.glob(sys.argv[1] + '/nvidia/**/lib*.so*', recursive=True)})))" "$SP")
cat > /tmp/env.sh <<EOT
export PYTHONPATH=/tmp/site:$PWD
export LD_LIBRARY_PATH=$NV:\$LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1
EOT
. /tmp/env.sh
python3 benchmarks/gpu_probe.py
