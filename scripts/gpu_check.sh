#!/usr/bin/env bash
# The one-GPU checks, in one call, on a machine with one CUDA GPU, its own torch and no network
# (the device machines some sessions are lent). MetaDist is installed there without its dependencies
# (the image has them) and the one-GPU benchmarks run on the current tree:
#   benchmarks.cuda_memory (4 layers): eager, MetaDist, optimizer offload, a memory budget, on the CUDA allocator
#   benchmarks.cuda_step: the torch_step models at world size 1, MetaDist against eager and its prediction
#   benchmarks.compiled_step (world size 1): MetaDist's program compiled by Inductor, with and without CUDA
#   graphs, against torch.compile of the step (results/compiled_step_cuda.*, copied to $OUT)
# Results go to $OUT (default /tmp/gpu-out). PARTS (default memory,step,compiled) picks which run: their
# timeouts add up to more than one device call allows, and the compiled part alone (GPT-2 and LLaMA,
# six systems each, a cold Inductor cache) takes about 5 minutes on an H200.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 \
    || { tail -20 "$OUT/pip.log"; exit 1; }
$PY - <<'EOF'
import torch, torch.distributed as dist
import metadist_torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(),
      "nccl", ".".join(map(str, torch.cuda.nccl.version())), "nccl available", dist.is_nccl_available())
EOF
rc=0
PARTS=${PARTS:-memory,step,compiled}
[[ $PARTS == *memory* ]] && { timeout "${MEM_TIMEOUT:-180}" $PY -m benchmarks.cuda_memory --layers "${LAYERS:-4}" --out "$OUT/cuda_memory.json" \
    2>"$OUT/cuda_memory.err" || { rc=1; tail -30 "$OUT/cuda_memory.err"; }; }
[[ $PARTS == *step* ]] && { timeout "${STEP_TIMEOUT:-200}" $PY -m benchmarks.cuda_step --rounds "${ROUNDS:-40}" --out "$OUT/cuda_step.json" \
    2>"$OUT/cuda_step.err" || { rc=1; tail -30 "$OUT/cuda_step.err"; }; }
[[ $PARTS == *compiled* ]] && { timeout "${COMPILE_TIMEOUT:-420}" $PY -m benchmarks.compiled_step --part single --device cuda --no-warm \
    --name compiled_step_cuda >"$OUT/compiled_step.log" 2>&1 || { rc=1; tail -30 "$OUT/compiled_step.log"; }; }
cp benchmarks/results/compiled_step_cuda.* "$OUT/" 2>/dev/null
exit $rc
