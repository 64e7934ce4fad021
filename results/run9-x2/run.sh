#!/usr/bin/env bash
# One device call: every GPU test, then the multi-process runs. Logs under $OUT.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=WARN
cd "$(dirname "$0")"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi -L > "$OUT/00-gpus.txt" 2>&1
NG=$(nvidia-smi -L | grep -c GPU)
step() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  local t0=$(date +%s%N)
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( ($(date +%s%N) - t0) / 1000000 )) ms: $*" | tee -a "$OUT/summary.txt"
}
step 01-gpu-tests 150 ./gpu_tests
step 02-mp-r1-nccl 45 ./ep-gpu-mp --nprocs 1 --transport nccl --iters 200
step 09-mp-r2-ipc-1gpu 60 ./ep-gpu-mp --nprocs 2 --gpus 1 --transport auto --iters 20 --timeout-ms 20000
step 03-mp-r1-nvlink 45 ./ep-gpu-mp --nprocs 1 --transport auto --iters 200
if [ "$NG" -ge 2 ]; then
  step 04-mp-r2-ipc-2gpu 45 ./ep-gpu-mp --nprocs 2 --gpus 2 --transport auto --iters 200
  step 05-mp-r2-nccl-2gpu 45 ./ep-gpu-mp --nprocs 2 --gpus 2 --transport nccl --iters 200
  step 06-die-ipc-2gpu 30 ./ep-gpu-mp --nprocs 2 --gpus 2 --transport auto --iters 0 --timeout-ms 3000 --die-rank 1
  step 07-stall-ipc-2gpu 30 ./ep-gpu-mp --nprocs 2 --gpus 2 --transport auto --iters 0 --timeout-ms 3000 --stall-rank 1
  step 08-die-nccl-2gpu 30 ./ep-gpu-mp --nprocs 2 --gpus 2 --transport nccl --iters 0 --timeout-ms 3000 --die-rank 1
fi
step 10-stall-ipc-1gpu 30 ./ep-gpu-mp --nprocs 2 --gpus 1 --transport auto --iters 0 --timeout-ms 3000 --stall-rank 1
step 11-die-ipc-1gpu 30 ./ep-gpu-mp --nprocs 2 --gpus 1 --transport auto --iters 0 --timeout-ms 3000 --die-rank 1
echo done >> "$OUT/summary.txt"
