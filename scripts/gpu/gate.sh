#!/usr/bin/env bash
# The whole GPU gate in ONE device call on a two-GPU machine (nvidia-h200-x2), inside the
# device tool's 10-minute limit. Two phases:
#   1. two tracks at once, one per GPU (CUDA_VISIBLE_DEVICES): the GPU tests, the differential
#      fuzz and EP1 figures on GPU 0; the soak, the sanitizers, EP8-virtual figures and the
#      example on GPU 1;
#   2. both GPUs: the two-GPU tests, process mode (handshake, NCCL bounds, two-tier), EP2
#      figures over NVLink (one process and two), the example in two processes, and the Python
#      Buffer under torchrun (N = 2) when a wheel was packed;
#   3. the network transport: both paths over NCCL (exact and capacity sizes, one process and
#      two, default transports and forced sockets), the two-tier group; then the fault runs with
#      the time that is left.
# Every step has its own time limit; the script keeps going after a failure and ends with a table
# (ok / FAILED / CUT). Logs go to one tarball in $OUT plus summary.txt (the tool returns 8 files).
#
#   bash scripts/gpu/gate.sh BIN_DIR            (BIN_DIR filled by scripts/gpu/pack.sh)
#
# On a machine with ONE GPU (nvidia-h200) the gate runs as one call too: both phase-1 tracks share
# GPU 0 (their timings are then indicative only), the Python Buffer runs with N = 1 and N = 2
# sharing the GPU, the fault trials run over CUDA IPC with both ranks on it, and every step that
# needs two GPUs (two-GPU tests, EP2 over NVLink, NCCL, two-tier) is listed as "not run (one GPU)".
#
# GATE_SKIP="soak sanitizer faults" (step names, space-separated) leaves steps out; the summary
# lists them as "not run", never as passed.
#
# Timings from phase 1 ran beside the other track's work on the other GPU (separate GPUs, 32
# host cores): they are indicative; BENCHMARKS.md says which figures came from where.
set -u
BIN=$(cd "${1:?usage: gate.sh BIN_DIR}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/ep-gate-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
LOGS=$(mktemp -d /tmp/ep-gate.XXXXXX)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
T0=$EPOCHREALTIME
elapsed() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }

# step NAME LIMIT_S CMD...: runs CMD under `timeout`, its output in $LOGS/NAME.log; one line in
# $LOGS/NAME.rc ("rc seconds").
DEADLINE=${GATE_DEADLINE_S:-555}   # every step ends by then, so the summary and logs come back
step() {
  local name=$1 limit=$2; shift 2
  if [[ " ${GATE_SKIP:-} " == *" $name "* ]]; then
    echo "0 0 0" > "$LOGS/$name.rc"; echo "NOT RUN: in GATE_SKIP" > "$LOGS/$name.log"
    echo "[gate $(elapsed) s] $name: skipped (GATE_SKIP)" >> "$LOGS/progress.txt"
    return
  fi
  local left=$(( DEADLINE - $(elapsed) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    echo "0 0 0" > "$LOGS/$name.rc"; echo "NOT RUN: the gate's time is spent" > "$LOGS/$name.log"
    echo "[gate $(elapsed) s] $name: not run (time spent)" >> "$LOGS/progress.txt"
    return
  fi
  local t0=$EPOCHREALTIME rc
  echo "[gate $(elapsed) s] $name: start (limit $limit s): $*" >> "$LOGS/progress.txt"
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  echo "$rc $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }') $limit" \
    > "$LOGS/$name.rc"
  echo "[gate $(elapsed) s] $name: rc=$rc" >> "$LOGS/progress.txt"
}

nvidia-smi -L > "$LOGS/env.txt" 2>&1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# two_gpu NAME...: marks steps that need two GPUs as not run on a one-GPU machine.
two_gpu() {
  local n
  for n in "$@"; do
    echo "0 0 0" > "$LOGS/$n.rc"; echo "NOT RUN: needs two GPUs, this machine has $NGPU" > "$LOGS/$n.log"
  done
}
if [ "$NGPU" -ge 2 ]; then TRACK_B_GPU=1; else TRACK_B_GPU=0; fi
cat "$BIN/BUILD-INFO" >> "$LOGS/env.txt" 2>/dev/null

# ---- phase 1: one track per GPU -------------------------------------------------------------
(
  export CUDA_VISIBLE_DEVICES=0
  step gpu-tests-1gpu 330 "$BIN/gpu"  # the others take about 250 s; the LogFMT tests' time is not measured yet
  step fuzz 95 env EP_GPU_FUZZ_MAX_SECS=85 "$BIN/gpu_fuzz"
  step bench-ep1 40 "$BIN/ep-bench" --backend gpu --ranks 1 --masked 0 --iters 200 --profile
  step bench-sweep-ep1 60 "$BIN/ep-bench" --backend gpu --ranks 1 --masked 0 --iters 100 \
    --sweep-tokens 1,16,128,512
) &
A=$!
(
  export CUDA_VISIBLE_DEVICES=$TRACK_B_GPU
  step soak 95 env EP_SOAK_MAX_SECS=85 "$BIN/gpu_soak"
  step sanitizer 110 env SAN_TOOL_LIMIT_S=34 bash "$HERE/sanitizer.sh" "$BIN" "$LOGS/sanitizer"
  step bench-ep8-virtual 45 "$BIN/ep-bench" --backend gpu --ranks 8 --masked 0 --iters 100
  step bench-ep2-virtual 30 "$BIN/ep-bench" --backend gpu --ranks 2 --masked 0 --iters 200 --profile
  step bench-sweep-ep8v 90 "$BIN/ep-bench" --backend gpu --ranks 8 --masked 0 --iters 50 \
    --sweep-tokens 1,16,128,512
  step example-virtual 40 bash -c "'$BIN/moe_layer' && '$BIN/moe_layer' --ranks 4 --mode bf16 \
    && '$BIN/moe_layer' --ranks 8 --mode fp8-ue8m0 && '$BIN/moe_layer' --nprocs 2"
) &
B=$!
wait $A $B

# ---- phase 2: both GPUs ---------------------------------------------------------------------
if [ "$NGPU" -lt 2 ]; then
  step gpu-process 90 "$BIN/gpu_process"
  if ls "$BIN"/ep_dispatch-*.whl > /dev/null 2>&1 && [ -f "$BIN/python/gpu.sh" ]; then
    step python 150 env OUT="$LOGS" NO_BENCH=1 NPROCS="1 2" SHARE_GPU=1 \
      bash "$BIN/python/gpu.sh" "$BIN" "$LOGS"
  fi
  step bench-ep2-2proc 30 "$BIN/ep-bench" --nprocs 2 --gpus 1 --masked 0
  step example-2proc 20 "$BIN/moe_layer" --nprocs 2 --gpus 1
  two_gpu gpu-tests-2gpu bench-ep2-2gpu bench-sweep-ep2-2gpu nccl-1proc-exact nccl-2proc-exact \
    net-2proc-exact net-1proc-exact nccl-1proc-capacity nccl-2proc-capacity net-2proc-capacity \
    net-1proc-capacity two-tier
else
  step gpu-tests-2gpu 80 "$BIN/gpu" two_gpus
  step gpu-process 90 "$BIN/gpu_process"
  step bench-ep2-2gpu 35 "$BIN/ep-bench" --backend gpu --ranks 2 --gpus 2 --masked 0 --iters 200 --profile
  step bench-sweep-ep2-2gpu 60 "$BIN/ep-bench" --backend gpu --ranks 2 --gpus 2 --masked 0 \
    --iters 100 --sweep-tokens 1,16,128,512
  if ls "$BIN"/ep_dispatch-*.whl > /dev/null 2>&1 && [ -f "$BIN/python/gpu.sh" ]; then
    step python 90 env OUT="$LOGS" BENCH_ARGS="--iters 50" bash "$BIN/python/gpu.sh" "$BIN" "$LOGS"
  fi
  step bench-ep2-2proc 30 "$BIN/ep-bench" --nprocs 2 --gpus 2 --masked 0
  step example-2proc 20 "$BIN/moe_layer" --nprocs 2 --gpus 2
  # ---- phase 3: the network transport, both paths, standard setting ---------------------------
  # NCCL on its default transports (NVLink P2P between the two GPUs), then forced onto its network
  # transport (sockets) with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (NCCL 2.28.3's documented
  # switches; NCCL_DEBUG=INFO in one run shows the channels going "via NET/Socket"); exact and
  # capacity sizes; in one process (ncclCommInitAll) and in two. Then the two-tier group: 4
  # processes on 2 GPUs as 2 emulated nodes (CUDA IPC inside a node, NCCL across).
  NET="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
  for sz in exact capacity; do
    step nccl-1proc-$sz 30 "$BIN/ep-bench" --backend gpu --ranks 2 --gpus 2 --transport nccl \
      --nccl-sizes $sz --masked 0 --iters 100
    step nccl-2proc-$sz 30 "$BIN/ep-bench" --nprocs 2 --gpus 2 --transport nccl --nccl-sizes $sz \
      --masked 0 --iters 100
    step net-2proc-$sz 40 env $NET NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET "$BIN/ep-bench" \
      --nprocs 2 --gpus 2 --transport nccl --nccl-sizes $sz --masked 0 --iters 100
    step net-1proc-$sz 30 env $NET "$BIN/ep-bench" --backend gpu --ranks 2 --gpus 2 \
      --transport nccl --nccl-sizes $sz --masked 0 --iters 100
  done
  step two-tier 60 "$BIN/ep-bench" --nprocs 4 --gpus 2 --nodes 2 --masked 0 --iters 50 \
    --timeout-secs 20
fi
left=$(( DEADLINE - $(elapsed) ))
if [ "$left" -gt 30 ]; then
  step faults "$left" env FAULT_BUDGET_S=$(( left - 8 )) FAULT_LOGDIR="$LOGS/faults" \
    bash "$HERE/faults.sh" "$BIN"
fi

# ---- summary ----------------------------------------------------------------------------------
{
  echo "== gate summary ($(elapsed) s; $(head -n 1 "$BIN/BUILD-INFO" 2>/dev/null))"
  for f in "$LOGS"/*.rc; do
    n=$(basename "$f" .rc); read -r rc secs limit < "$f"
    case $rc in 0) s=ok ;; 124|137) s="CUT at $limit s" ;; *) s="FAILED (exit $rc)" ;; esac
    grep -q '^NOT RUN' "$LOGS/$n.log" 2>/dev/null && s="not run ($(head -n 1 "$LOGS/$n.log"))"
    printf '%-18s %4s s  %s\n' "$n" "$secs" "$s"
  done
} >> "$SUMMARY"
# The lines a reader needs from each log, in the tail the tool returns.
for n in gpu-tests-1gpu gpu-tests-2gpu gpu-process fuzz soak sanitizer example-virtual \
         example-2proc faults python; do
  [ -f "$LOGS/$n.log" ] || continue
  echo "-- $n" >> "$SUMMARY"
  grep -aE '(passed|failed|skipped|SKIPPED|FAIL|PASS|panicked|configs|calls|ERROR SUMMARY|error|trials|survived|detect)' \
    "$LOGS/$n.log" | tail -n 14 >> "$SUMMARY"
done
for n in bench-ep1 bench-ep8-virtual bench-ep2-virtual bench-ep2-2gpu bench-ep2-2proc \
         bench-sweep-ep1 bench-sweep-ep8v bench-sweep-ep2-2gpu; do
  [ -f "$LOGS/$n.log" ] && { echo "-- $n"; tail -n 24 "$LOGS/$n.log"; } >> "$SUMMARY"
done
for f in "$LOGS"/nccl-*.log "$LOGS"/net-*.log "$LOGS"/two-tier.log; do
  [ -f "$f" ] || continue
  echo "-- $(basename "$f" .log)" >> "$SUMMARY"
  grep -aE '(==|path |per-expert|batched|speed-up|NCCL sends|wire|via NET|via P2P|unsupported|succeeded|FAIL|rror)' "$f" \
    | grep -v 'NCCL INFO Channel' | tail -n 20 >> "$SUMMARY"
  grep -a 'via NET\|via P2P\|via SHM' "$f" | head -n 2 >> "$SUMMARY"
done
tar -czf "$OUT/gate-logs.tar.gz" -C "$LOGS" . 2>/dev/null
cat "$SUMMARY"
