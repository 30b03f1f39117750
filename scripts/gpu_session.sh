#!/usr/bin/env bash
# One lent GPU session, prepared to run once (device tool, ~7 minutes): the planner's predictions are printed
# before every run. Measures, in order of what matters if it is cut short:
#   1. the host's cost per CUDA dispatch (course_lib.bench.host cuda) and per CPU dispatch on the GPU's host;
#   2. FSDP2 CPU offload vs on the GPU (course_lib.bench.offload): step, memory, zero_grad's gradients;
#   3. torch eager / JAX / torch compiled at L12 d1024 16x1024 and at L16 d2560 8x2048 (bench frameworks).
# Everything lands in $OUT (gpu.tgz holds every log). Usage there: bash scripts/gpu_session.sh
set -u
G=/tmp/gpu
mkdir -p "$G" "${OUT:=/tmp/out}"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PY:-python3}
step() { local name=$1 t=$2; shift 2; echo "=== $name ($(date +%T), limit ${t}s)"; timeout "$t" "$@" 2>&1 | tee "$G/$name.txt"; }
step env 40 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; $PY -c 'import torch, jax, flax; print(\"torch\", torch.__version__, \"jax\", jax.__version__, \"flax\", flax.__version__, jax.devices())'"
step host_cuda 60 $PY -m course_lib.bench.host cuda
step host_cpu 30 $PY -m course_lib.bench.host
step offload 80 $PY -m course_lib.bench.offload --out "$G"
step frameworks ${FW_LIMIT:-300} $PY -m course_lib bench frameworks --out "$G" --sizes L12-d1024-b16-s1024,L16-d2560-b8-s2048 \
    --runs torch,jax,compiled --steps 12 --timeout 120
cp "$G"/frameworks.json "$G"/offload.json "$OUT"/ 2>/dev/null
tar czf "$OUT/gpu.tgz" -C "$G" .
echo "=== done $(date +%T)"
