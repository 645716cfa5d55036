#!/usr/bin/env bash
# What one GPU call of a session runs (eighteenth and nineteenth sessions, issues 30, 31, 34): every check
# as a phase with its own time limit, most wanted first, each writing into $OUT as it goes,
# so a call cut short still returns what it measured. Run from the repository root on the
# GPU machine after .gpu/ was carried there (docs/CUDA.md, "Setting up onnxruntime-gpu on
# the GPU machine"):
#   .gpu/parts/p*  onnxruntime-gpu in parts (../shared/gpu/pack_ort_gpu.sh); p00 may already
#                  be in /tmp/parts from an earlier call
#   .gpu/whl/      the small wheels
#   .gpu/peers/    python benchmarks/gpu_peers.py --prepare .gpu/peers --precision bf16
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh
#
# PHASES="peers truth" picks phases (default: all, in the order below); MODELS="resnet50" the
# peers' and profile's models (default both), TRUTH_MODELS="resnet18 resnet50" the zoo models
# of truth (default all); a machine set up by an earlier call (/tmp/env.sh exists) is not set
# up again.
# PROVIDER=cpu SMALL=1 runs the same phases here at tiny sizes (the code path; no setup).
set -uo pipefail
: "${OUT:?set OUT to the folder for results}"
PROVIDER=${PROVIDER:-cuda}
SMALL=${SMALL:-}
PHASES=${PHASES:-peers sums truth batch184 patches chunks fp16search profile convgrad coverage dist}
MODELS=${MODELS:-gpt2,resnet50}
TRUTH_MODELS=${TRUTH_MODELS:-}
LOGS=${LOGS:-/tmp/gpu_logs}
mkdir -p "$OUT" "$LOGS"
T0=$(date +%s)

if [ "$PROVIDER" = cuda ]; then
  if [ ! -f /tmp/env.sh ]; then
    mkdir -p /tmp/parts /tmp/whl
    cp -n .gpu/parts/p* /tmp/parts/ 2>/dev/null || true
    cp .gpu/whl/*.whl /tmp/whl/
    if ! bash benchmarks/gpu_setup.sh > "$LOGS/setup.log" 2>&1; then
      tail -40 "$LOGS/setup.log"; exit 1
    fi
  fi
  . /tmp/env.sh
  PY=python3
else
  PY=${PY:-python}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LOGS/gpu.txt" 2>&1

phase() {  # phase NAME SECONDS COMMAND...: one check, cut at SECONDS, its log kept
  local name=$1 limit=$2; shift 2
  case " $PHASES " in *" $name "*) ;; *) return 0 ;; esac
  local t=$(date +%s)
  echo "== $name (limit ${limit} s, at $((t - T0)) s)"
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "   $name: rc=$rc in $(( $(date +%s) - t )) s"
  tail -n 6 "$LOGS/$name.log" | cut -c1-300
  tar -C "$LOGS" -czf "$OUT/logs.tgz" .  # after every phase: a cut call keeps the logs
}

if [ -n "$SMALL" ]; then
  PEERS=${PEERS:-.gpu/peers-small}; SIZE=(--small); CONV=(--batch 2 --resolution 32 --rounds 2)
else
  PEERS=${PEERS:-.gpu/peers}; SIZE=(); CONV=(--batch 64 --resolution 224 --rounds 10)
fi
STEPS=()
for p in "" ".fp16"; do  # the fp32 steps first: a cut phase keeps them
  for m in resnet50 gpt2; do
    case ",$MODELS," in *",$m,"*) ;; *) continue ;; esac
    f="$PEERS/$m$p.step.onnx.xz"
    [ -f "$f" ] && STEPS+=("$m${p/./-}=$f")
  done
done

# 1. Issue 30's and 34's targets: memcc's step against PyTorch eager (TF32 on both sides),
#    fp32 and bf16 (torch.autocast), issue 29's GPT-2 and ResNet-50.
#    memcc's fp16 step too (ORT's CUDA provider has no bfloat16 Conv).
phase peers 220 $PY benchmarks/gpu_peers.py --steps-from "$PEERS" --out "$OUT/peers" \
  --provider "$PROVIDER" --models "$MODELS" --only "memcc-as-built deterministic=False" --only "torch-eager tf32=on" \
  --only bf16 --only fp16 --time-limit 190 --timeout 100
# 1b. Every session with a GPU: the zoo's memory truth.
phase truth 130 $PY benchmarks/cuda_check.py --out "$OUT/truth" --provider "$PROVIDER" \
  --phases env truth "${SIZE[@]}" ${TRUTH_MODELS:+--models $TRUTH_MODELS}
# 2. Issue 30: the weight gradients as MatMuls over patches (nineteenth session's pass, timed
#     per layer only) against memcc's Conv form, as whole ResNet-50 steps (batch 64, 224 px),
#     each twice, interleaved by form.
phase patches 120 $PY benchmarks/cuda_runtime.py --provider "$PROVIDER" --models resnet50 \
  --forms current,conv-grad-as-conv,current,conv-grad-as-conv --variants default --steps 6
# 2a. Per-channel sums in two stages (memcc's CUDA form since the twenty-second session, not
#     yet timed as a step) against the Transpose form, torchvision's ResNet-50 widths.
phase sums 150 $PY benchmarks/cuda_runtime.py --provider "$PROVIDER" --models resnet50 \
  --forms current,transposed-sums,current,transposed-sums --variants default --steps 6 \
  --width "${WIDTH:-64}"
# 2b. The patches' batch chunks (twenty-second session: 1,359 Slices, 33 ms of ResNet-50's
#     257 ms of blocking kernels at batch 184): one chunk per weight gradient against today's.
phase chunks 110 $PY benchmarks/cuda_runtime.py --provider "$PROVIDER" --models resnet50 \
  --forms current,patches-unchunked,current,patches-unchunked --variants default --steps 6
# 2c. The zoo's ResNet-50 at torchvision's width and the peers' batch, against the peers'
#     transformers export (181 ms at 184): what the export's graph costs.
phase batch184 90 $PY benchmarks/cuda_runtime.py --provider "$PROVIDER" --models resnet50 \
  --forms current --variants default --steps 6 --batch "${BATCH184:-184}" --width 64
# 2d. cuDNN's exhaustive search for fp16 (DEFAULT now: 248 ms of Conv kernels against 28.5
#     in fp32) and fp32: time and NVML peak, ResNet-50's memcc rows only.
phase fp16search 150 env MEMCC_CUDNN_CONV_ALGO_SEARCH=EXHAUSTIVE $PY benchmarks/gpu_peers.py \
  --steps-from "$PEERS" --out "$OUT/fp16search" --provider "$PROVIDER" --models resnet50 \
  --only "memcc-as-built deterministic=False" --only memcc-fp16 --time-limit 130 --timeout 100
# 3. Where the kernel time goes now (issue 30's table, after its changes).
phase profile 70 $PY benchmarks/cuda_profile.py "${STEPS[@]}" --provider "$PROVIDER" \
  --runs 2 --out "$OUT/profile.json"
# 4. Convolution weight gradients: standard-ONNX forms against cuDNN's backward-filter.
phase convgrad 100 $PY benchmarks/conv_weight_grad.py --provider "$PROVIDER" \
  --models resnet50 "${CONV[@]}" --budget-s 60 --out "$OUT/convgrad.json"
# 5. The 16-bit kernel table memcc ships for CUDA, against one-node sessions.
phase coverage 45 $PY benchmarks/kernel_coverage.py --provider "$PROVIDER" \
  --out "$OUT/coverage.md"

# 6. Issue 33: memcc train --nproc 2 --provider cuda (one GPU: 2 ranks over gloo, the code
#    path; NCCL needs a GPU per rank) against one process: losses and parameter digests.
phase dist 240 sh -c "PYTHONPATH=.:tests $PY -m benchmarks.data_parallel --mode check \
  --provider $PROVIDER --steps 3 --dir /tmp/memcc_dp_check > $OUT/dist.json"

echo "== done in $(( $(date +%s) - T0 )) s"
ls -la "$OUT"
